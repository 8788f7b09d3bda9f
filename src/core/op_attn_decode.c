/* smelt_attention_decode: attention of Sq new queries per sequence over a
 * paged KV cache. The family's half of the op-family interface: its roles,
 * its description and its shape checks (src/core/family.c does the rest;
 * the block table and lengths are device data, which the backends check as
 * include/smelt/attention_decode.h says). */
#include "attn_decode_internal.h"
#include "error_bound.h"

#include <math.h>
#include <stdio.h>

static const smelt_dtype float_types[] = {SMELT_DTYPE_F16, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_F64};
static const smelt_dtype f32[] = {SMELT_DTYPE_F32};
static const smelt_dtype i32[] = {SMELT_DTYPE_I32};

static const smelt__role roles[] = {
    {"q", 0, float_types, 4, 0},
    {"k_cache", SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"v_cache", SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"block_table", 0, i32, 1, 0},
    {"cache_seqlens", 0, i32, 1, 0},
    {"o", SMELT__ROLE_OUTPUT | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"lse", SMELT__ROLE_OUTPUT | SMELT__ROLE_OPTIONAL, f32, 1, 0},
};

smelt_attention_decode_desc smelt_attention_decode_desc_default(void) {
  smelt_attention_decode_desc d = {0.0f, 1};
  return d;
}

double smelt__decode_scale(const smelt_plan *plan) {
  const smelt_attention_decode_desc *d = (const smelt_attention_decode_desc *)plan->opdata;
  return d->scale != 0.0f ? (double)d->scale : 1.0 / sqrt((double)plan->t[SMELT__DEC_Q].shape[3]);
}

static smelt_status check(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_attention_decode.op;
  const smelt_tensor *q = t[SMELT__DEC_Q], *lse = t[SMELT__DEC_LSE];
  smelt_status s = smelt__paged_check_shapes(op, "q", q, t[SMELT__DEC_K], t[SMELT__DEC_V], t[SMELT__DEC_TABLE],
                                             t[SMELT__DEC_SEQLENS]);
  if (s || (s = smelt__check_same_shape(op, "q", q, "o", t[SMELT__DEC_O])) ||
      (s = smelt__paged_unit_d(op, "o", t[SMELT__DEC_O])))
    return s;
  smelt__paged_geom g;
  smelt__paged_geom_of(q, t[SMELT__DEC_K], t[SMELT__DEC_TABLE], &g);
  if (g.Sq < 1 || g.Sq > 64)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: q.shape[1]=%lld (queries per sequence Sq) must be in 1..64",
                        op, (long long)g.Sq);
  if (g.H < 1 || g.H % g.Hk)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                        "%s: q.shape[2]=%lld (heads H) must be a positive multiple of k_cache.shape[2]=%lld (kv heads Hk)",
                        op, (long long)g.H, (long long)g.Hk);
  if (lse && (lse->ndim != 3 || lse->shape[0] != g.B || lse->shape[1] != g.H || lse->shape[2] != g.Sq)) {
    char a[160];
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: lse.shape=%s must equal [B, H, Sq]=[%lld, %lld, %lld]", op,
                        smelt__shape_str(lse, a, sizeof a), (long long)g.B, (long long)g.H, (long long)g.Sq);
  }
  const smelt_attention_decode_desc *d = (const smelt_attention_decode_desc *)plan->opdata;
  if (!isfinite(d->scale))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->scale=%g must be finite (0 = 1/sqrt(D))", op,
                        (double)d->scale);
  if (d->causal != 0 && d->causal != 1)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->causal=%d must be 0 or 1", op, d->causal);
  snprintf(plan->describe, sizeof plan->describe, "attention decode %s B=%lld Sq=%lld H=%lld/%lld D=%lld page=%lld%s (cpu reference)",
           smelt_dtype_name(q->dtype), (long long)g.B, (long long)g.Sq, (long long)g.H, (long long)g.Hk,
           (long long)g.D, (long long)g.page_size, d->causal ? " causal" : "");
  return SMELT_OK;
}

const smelt__family smelt__family_attention_decode = {
    .name = "attention_decode",
    .op = "smelt_attention_decode",
    .what = "an attention decode",
    .nroles = 7,
    .roles = roles,
    .params_size = sizeof(smelt_attention_decode_desc),
    .check = check,
    .cpu = &smelt__cpu_attention_decode,
    .cuda = &smelt__cuda_attention_decode,
    .bound = smelt__bound_attention,
};

smelt_status smelt_attention_decode_plan(smelt_ctx *ctx, const smelt_attention_decode_desc *desc, const smelt_tensor *q,
                                         const smelt_tensor *k_cache, const smelt_tensor *v_cache,
                                         const smelt_tensor *block_table, const smelt_tensor *cache_seqlens,
                                         const smelt_tensor *o, const smelt_tensor *lse, smelt_plan **out) {
  const smelt_attention_decode_desc d = desc ? *desc : smelt_attention_decode_desc_default();
  const smelt_tensor *t[] = {q, k_cache, v_cache, block_table, cache_seqlens, o, lse};
  return smelt__family_plan(&smelt__family_attention_decode, ctx, &d, t, out);
}

smelt_status smelt_attention_decode_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k_cache,
                                        const smelt_tensor *v_cache, const smelt_tensor *block_table,
                                        const smelt_tensor *cache_seqlens, const smelt_tensor *o,
                                        const smelt_tensor *lse) {
  const smelt_tensor *t[] = {q, k_cache, v_cache, block_table, cache_seqlens, o, lse};
  return smelt__family_run(&smelt__family_attention_decode, plan, t);
}

smelt_status smelt_attention_decode(smelt_ctx *ctx, const smelt_attention_decode_desc *desc, const smelt_tensor *q,
                                    const smelt_tensor *k_cache, const smelt_tensor *v_cache,
                                    const smelt_tensor *block_table, const smelt_tensor *cache_seqlens,
                                    const smelt_tensor *o, const smelt_tensor *lse) {
  SMELT__ONE_SHOT(smelt_attention_decode_plan(ctx, desc, q, k_cache, v_cache, block_table, cache_seqlens, o, lse, &plan),
                  smelt_attention_decode_run(plan, q, k_cache, v_cache, block_table, cache_seqlens, o, lse));
}
