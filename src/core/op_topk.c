/* smelt_topk: the k largest elements of each row (last dim), largest first,
 * with their indices (optional, i32 or i64). The family's half of the
 * op-family interface: its tensors and its shape checks (src/core/family.c
 * does the rest). */
#include "error_bound.h"
#include "internal.h"

#include <stdio.h>

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype index_types[] = {SMELT_DTYPE_I32, SMELT_DTYPE_I64};

static const smelt__role roles[] = {
    {"x", 0, float_types, 3, 0},
    {"values", SMELT__ROLE_OUTPUT | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"indices", SMELT__ROLE_OUTPUT | SMELT__ROLE_OPTIONAL, index_types, 2, 0},
};

/* t's shape must be x.shape[:-1] + [k]. */
static smelt_status check_out_shape(const char *name, const smelt_tensor *t, const smelt_tensor *x, int64_t k) {
  smelt_tensor want = *x;
  want.shape[x->ndim - 1] = k;
  int same = t->ndim == x->ndim;
  for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == want.shape[d];
  if (!same) {
    char a[160], b[160];
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape=%s must equal x.shape[:-1] + [k]=%s",
                        smelt__family_topk.op, name, smelt__shape_str(t, a, sizeof a),
                        smelt__shape_str(&want, b, sizeof b));
  }
  return SMELT_OK;
}

static smelt_status check(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_topk.op;
  const smelt_tensor *x = t[0];
  const int64_t k = *(const int64_t *)params;
  if (x->ndim < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: x.ndim=0 must be >= 1 (top-k runs over the last dim)", op);
  const int64_t C = x->shape[x->ndim - 1];
  if (k < 1 || k > C)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: k=%lld must be in [1, x.shape[-1]=%lld]", op, (long long)k,
                        (long long)C);
  smelt_status s;
  if ((s = check_out_shape("values", t[1], x, k)) || (t[2] && (s = check_out_shape("indices", t[2], x, k)))) return s;
  plan->p.topk.k = k;
  snprintf(plan->describe, sizeof plan->describe, "topk %s k=%lld of C=%lld (cpu reference)",
           smelt_dtype_name(x->dtype), (long long)k, (long long)C);
  return SMELT_OK;
}

const smelt__family smelt__family_topk = {
    .name = "topk",
    .op = "smelt_topk",
    .what = "a top-k",
    .nroles = 3,
    .roles = roles,
    .check = check,
    .cpu = &smelt__cpu_topk,
    .cuda = &smelt__cuda_topk,
    .bound = smelt__bound_elementwise,
};

smelt_status smelt_topk_plan(smelt_ctx *ctx, int64_t k, const smelt_tensor *x, const smelt_tensor *values,
                             const smelt_tensor *indices, smelt_plan **out) {
  const smelt_tensor *t[] = {x, values, indices};
  return smelt__family_plan(&smelt__family_topk, ctx, &k, t, out);
}

smelt_status smelt_topk_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *values,
                            const smelt_tensor *indices) {
  const smelt_tensor *t[] = {x, values, indices};
  return smelt__family_run(&smelt__family_topk, plan, t);
}

smelt_status smelt_topk(smelt_ctx *ctx, int64_t k, const smelt_tensor *x, const smelt_tensor *values,
                        const smelt_tensor *indices) {
  SMELT__ONE_SHOT(smelt_topk_plan(ctx, k, x, values, indices, &plan), smelt_topk_run(plan, x, values, indices));
}
