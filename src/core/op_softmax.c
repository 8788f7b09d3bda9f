/* smelt_softmax: row-wise softmax over the last dim, with an optional f32
 * logsumexp per row. The plan validates everything static; the run checks
 * the bound tensors against the plan before anything is written; the
 * one-shot call does both. */
#include "internal.h"

#include <stdio.h>

#define OP "smelt_softmax"

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* "[3, 5]" for t's dims but the last. */
static const char *lead_shape_str(const smelt_tensor *t, char *buf, size_t n) {
  smelt_tensor r = *t;
  r.ndim = t->ndim - 1;
  return smelt__shape_str(&r, buf, n);
}

static smelt_status check_disjoint(const char *an, const smelt_tensor *a, const char *bn, const smelt_tensor *b) {
  if (a && b && smelt__tensors_overlap(a, b))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": %s overlaps %s; outputs must not share memory with the input or each other", an, bn);
  return SMELT_OK;
}

static smelt_status check_all_disjoint(const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *lse) {
  smelt_status s;
  if ((s = check_disjoint("y", y, "x", x)) || (s = check_disjoint("lse", lse, "x", x)) ||
      (s = check_disjoint("lse", lse, "y", y)))
    return s;
  return SMELT_OK;
}

smelt_status smelt_softmax_plan(smelt_ctx *ctx, const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *lse,
                                smelt_plan **out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": out is NULL");
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": ctx is NULL");
  smelt_status s;
  if ((s = smelt__check_tensor(OP, "x", x)) || (s = smelt__check_tensor(OP, "y", y)) ||
      (lse && (s = smelt__check_tensor(OP, "lse", lse))) || (s = smelt__check_device(OP, "x", x, ctx)) ||
      (s = smelt__check_device(OP, "y", y, ctx)) || (lse && (s = smelt__check_device(OP, "lse", lse, ctx))) ||
      (s = smelt__check_dtype(OP, "x", x, float_types, 3)))
    return s;
  if (x->ndim < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": x.ndim=0 must be >= 1 (softmax runs over the last dim)");
  const int64_t C = x->shape[x->ndim - 1];
  if (C < 1) return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": x.shape[-1]=%lld must be >= 1", (long long)C);
  if (y->dtype != x->dtype)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": y.dtype=%s must equal x.dtype=%s",
                        smelt_dtype_name(y->dtype), smelt_dtype_name(x->dtype));
  if ((s = smelt__check_same_shape(OP, "x", x, "y", y))) return s;
  if (lse) {
    if (lse->dtype != SMELT_DTYPE_F32)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": lse.dtype=%s must be f32", smelt_dtype_name(lse->dtype));
    int same = lse->ndim == x->ndim - 1;
    for (int d = 0; same && d < lse->ndim; d++) same = lse->shape[d] == x->shape[d];
    if (!same) {
      char a[160], b[160];
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": lse.shape=%s must equal x.shape[:-1]=%s",
                          smelt__shape_str(lse, a, sizeof a), lead_shape_str(x, b, sizeof b));
    }
  }
  if ((s = smelt__check_output(OP, "y", y)) || (lse && (s = smelt__check_output(OP, "lse", lse))) ||
      (s = check_all_disjoint(x, y, lse)))
    return s;
  smelt_plan *plan;
  if ((s = smelt__plan_new(ctx, SMELT__OP_SOFTMAX, &plan))) return s;
  plan->ntensors = 3;
  plan->t[0] = *x;
  plan->t[1] = *y;
  if (lse) plan->t[2] = *lse;
  snprintf(plan->describe, sizeof plan->describe, "softmax %s C=%lld%s (cpu reference)", smelt_dtype_name(x->dtype),
           (long long)C, lse ? " +lse" : "");
  if (ctx->device == SMELT_DEVICE_CUDA && (s = smelt__cuda_softmax_plan(plan))) {
    smelt_plan_destroy(plan);
    return s;
  }
  *out = plan;
  return SMELT_OK;
}

smelt_status smelt_softmax_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *y,
                               const smelt_tensor *lse) {
  if (!plan) return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_run: plan is NULL");
  if (plan->op != SMELT__OP_SOFTMAX)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP "_run: the plan is not a softmax plan");
  const int planned_lse = plan->t[2].ndim >= 0;
  if (lse && !planned_lse)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": lse is given but the plan was made without one");
  if (!lse && planned_lse)
    return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": lse is NULL but the plan was made with one");
  smelt_status s;
  if ((s = smelt__check_same_layout(OP, "x", &plan->t[0], x)) ||
      (s = smelt__check_same_layout(OP, "y", &plan->t[1], y)) ||
      (lse && (s = smelt__check_same_layout(OP, "lse", &plan->t[2], lse))) || (s = check_all_disjoint(x, y, lse)))
    return s;
  if (plan->ctx->device == SMELT_DEVICE_CUDA) return smelt__cuda_softmax_run(plan, x, y, lse);
  return smelt__cpu_softmax(plan, x, y, lse);
}

smelt_status smelt_softmax(smelt_ctx *ctx, const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *lse) {
  smelt_plan *plan;
  smelt_status s = smelt_softmax_plan(ctx, x, y, lse, &plan);
  if (s) return s;
  s = smelt_softmax_run(plan, x, y, lse);
  smelt_plan_destroy(plan);
  return s;
}
