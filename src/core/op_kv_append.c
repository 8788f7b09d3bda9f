/* smelt_kv_cache_append: new keys and values into their cache pages. The
 * family's half of the op-family interface: roles and shape checks (the
 * caches are outputs written in place, which the shared checks keep apart
 * from every input and from each other). */
#include "attn_decode_internal.h"
#include "error_bound.h"

#include <stdio.h>

static const smelt_dtype i32[] = {SMELT_DTYPE_I32};

static const smelt__role roles[] = {
    {"k_new", 0, NULL, 0, 0},
    {"v_new", SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"block_table", 0, i32, 1, 0},
    {"cache_seqlens", 0, i32, 1, 0},
    {"k_cache", SMELT__ROLE_OUTPUT | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"v_cache", SMELT__ROLE_OUTPUT | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
};

static smelt_status check(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_kv_cache_append.op;
  const smelt_tensor *k = t[SMELT__APP_K];
  smelt_status s = smelt__paged_check_shapes(op, "k_new", k, t[SMELT__APP_KC], t[SMELT__APP_VC], t[SMELT__APP_TABLE],
                                             t[SMELT__APP_SEQLENS]);
  if (s || (s = smelt__check_same_shape(op, "k_new", k, "v_new", t[SMELT__APP_V])) ||
      (s = smelt__paged_unit_d(op, "v_new", t[SMELT__APP_V])))
    return s;
  if (k->shape[2] != t[SMELT__APP_KC]->shape[2])
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: k_new.shape[2]=%lld must equal k_cache.shape[2]=%lld (kv heads Hk)",
                        op, (long long)k->shape[2], (long long)t[SMELT__APP_KC]->shape[2]);
  (void)params;
  snprintf(plan->describe, sizeof plan->describe, "kv cache append %s B=%lld Snew=%lld Hk=%lld D=%lld page=%lld (cpu reference)",
           smelt_dtype_name(k->dtype), (long long)k->shape[0], (long long)k->shape[1], (long long)k->shape[2],
           (long long)k->shape[3], (long long)t[SMELT__APP_KC]->shape[1]);
  return SMELT_OK;
}

const smelt__family smelt__family_kv_cache_append = {
    .name = "kv_cache_append",
    .op = "smelt_kv_cache_append",
    .what = "a kv cache append",
    .nroles = 6,
    .roles = roles,
    .check = check,
    .cpu = &smelt__cpu_kv_cache_append,
    .cuda = &smelt__cuda_kv_cache_append,
    .bound = smelt__bound_elementwise,
};

smelt_status smelt_kv_cache_append_plan(smelt_ctx *ctx, const smelt_tensor *k_new, const smelt_tensor *v_new,
                                        const smelt_tensor *block_table, const smelt_tensor *cache_seqlens,
                                        const smelt_tensor *k_cache, const smelt_tensor *v_cache, smelt_plan **out) {
  const smelt_tensor *t[] = {k_new, v_new, block_table, cache_seqlens, k_cache, v_cache};
  return smelt__family_plan(&smelt__family_kv_cache_append, ctx, NULL, t, out);
}

smelt_status smelt_kv_cache_append_run(smelt_plan *plan, const smelt_tensor *k_new, const smelt_tensor *v_new,
                                       const smelt_tensor *block_table, const smelt_tensor *cache_seqlens,
                                       const smelt_tensor *k_cache, const smelt_tensor *v_cache) {
  const smelt_tensor *t[] = {k_new, v_new, block_table, cache_seqlens, k_cache, v_cache};
  return smelt__family_run(&smelt__family_kv_cache_append, plan, t);
}

smelt_status smelt_kv_cache_append(smelt_ctx *ctx, const smelt_tensor *k_new, const smelt_tensor *v_new,
                                   const smelt_tensor *block_table, const smelt_tensor *cache_seqlens,
                                   const smelt_tensor *k_cache, const smelt_tensor *v_cache) {
  SMELT__ONE_SHOT(smelt_kv_cache_append_plan(ctx, k_new, v_new, block_table, cache_seqlens, k_cache, v_cache, &plan),
                  smelt_kv_cache_append_run(plan, k_new, v_new, block_table, cache_seqlens, k_cache, v_cache));
}
