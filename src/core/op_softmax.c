/* smelt_softmax: row-wise softmax over the last dim, with an optional f32
 * logsumexp per row. The family's half of the op-family interface: its
 * tensors and its shape checks (src/core/family.c does the rest). */
#include "error_bound.h"
#include "internal.h"

#include <stdio.h>

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype f32[] = {SMELT_DTYPE_F32};

static const smelt__role roles[] = {
    {"x", 0, float_types, 3, 0},
    {"y", SMELT__ROLE_OUTPUT | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"lse", SMELT__ROLE_OUTPUT | SMELT__ROLE_OPTIONAL, f32, 1, 0},
};

/* "[3, 5]" for t's dims but the last. */
static const char *lead_shape_str(const smelt_tensor *t, char *buf, size_t n) {
  smelt_tensor r = *t;
  r.ndim = t->ndim - 1;
  return smelt__shape_str(&r, buf, n);
}

static smelt_status check(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_softmax.op;
  const smelt_tensor *x = t[0], *lse = t[2];
  if (x->ndim < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: x.ndim=0 must be >= 1 (softmax runs over the last dim)", op);
  const int64_t C = x->shape[x->ndim - 1];
  if (C < 1) return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: x.shape[-1]=%lld must be >= 1", op, (long long)C);
  smelt_status s = smelt__check_same_shape(op, "x", x, "y", t[1]);
  if (s) return s;
  if (lse) {
    int same = lse->ndim == x->ndim - 1;
    for (int d = 0; same && d < lse->ndim; d++) same = lse->shape[d] == x->shape[d];
    if (!same) {
      char a[160], b[160];
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: lse.shape=%s must equal x.shape[:-1]=%s", op,
                          smelt__shape_str(lse, a, sizeof a), lead_shape_str(x, b, sizeof b));
    }
  }
  snprintf(plan->describe, sizeof plan->describe, "softmax %s C=%lld%s (cpu reference)", smelt_dtype_name(x->dtype),
           (long long)C, lse ? " +lse" : "");
  return SMELT_OK;
}

const smelt__family smelt__family_softmax = {
    .name = "softmax",
    .op = "smelt_softmax",
    .what = "a softmax",
    .nroles = 3,
    .roles = roles,
    .check = check,
    .cpu = &smelt__cpu_softmax,
    .cuda = &smelt__cuda_softmax,
    .bound = smelt__bound_elementwise,
};

smelt_status smelt_softmax_plan(smelt_ctx *ctx, const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *lse,
                                smelt_plan **out) {
  const smelt_tensor *t[] = {x, y, lse};
  return smelt__family_plan(&smelt__family_softmax, ctx, NULL, t, out);
}

smelt_status smelt_softmax_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *y,
                               const smelt_tensor *lse) {
  const smelt_tensor *t[] = {x, y, lse};
  return smelt__family_run(&smelt__family_softmax, plan, t);
}

smelt_status smelt_softmax(smelt_ctx *ctx, const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *lse) {
  SMELT__ONE_SHOT(smelt_softmax_plan(ctx, x, y, lse, &plan), smelt_softmax_run(plan, x, y, lse));
}
