/* smelt_topk: the k largest elements of each row (last dim), largest first,
 * with their indices (optional, i32 or i64). The plan validates everything
 * static; the run checks the bound tensors against the plan before anything
 * is written; the one-shot call does both. */
#include "internal.h"

#include <stdio.h>

#define OP "smelt_topk"

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype index_types[] = {SMELT_DTYPE_I32, SMELT_DTYPE_I64};

/* t's shape must be x.shape[:-1] + [k]. */
static smelt_status check_out_shape(const char *name, const smelt_tensor *t, const smelt_tensor *x, int64_t k) {
  smelt_tensor want = *x;
  want.shape[x->ndim - 1] = k;
  int same = t->ndim == x->ndim;
  for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == want.shape[d];
  if (!same) {
    char a[160], b[160];
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": %s.shape=%s must equal x.shape[:-1] + [k]=%s", name,
                        smelt__shape_str(t, a, sizeof a), smelt__shape_str(&want, b, sizeof b));
  }
  return SMELT_OK;
}

static smelt_status check_disjoint(const char *an, const smelt_tensor *a, const char *bn, const smelt_tensor *b) {
  if (a && b && smelt__tensors_overlap(a, b))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": %s overlaps %s; outputs must not share memory with the input or each other", an, bn);
  return SMELT_OK;
}

static smelt_status check_all_disjoint(const smelt_tensor *x, const smelt_tensor *v, const smelt_tensor *i) {
  smelt_status s;
  if ((s = check_disjoint("values", v, "x", x)) || (s = check_disjoint("indices", i, "x", x)) ||
      (s = check_disjoint("indices", i, "values", v)))
    return s;
  return SMELT_OK;
}

smelt_status smelt_topk_plan(smelt_ctx *ctx, int64_t k, const smelt_tensor *x, const smelt_tensor *values,
                             const smelt_tensor *indices, smelt_plan **out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": out is NULL");
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": ctx is NULL");
  smelt_status s;
  if ((s = smelt__check_tensor(OP, "x", x)) || (s = smelt__check_tensor(OP, "values", values)) ||
      (indices && (s = smelt__check_tensor(OP, "indices", indices))) || (s = smelt__check_device(OP, "x", x, ctx)) ||
      (s = smelt__check_device(OP, "values", values, ctx)) ||
      (indices && (s = smelt__check_device(OP, "indices", indices, ctx))) ||
      (s = smelt__check_dtype(OP, "x", x, float_types, 3)))
    return s;
  if (x->ndim < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": x.ndim=0 must be >= 1 (top-k runs over the last dim)");
  const int64_t C = x->shape[x->ndim - 1];
  if (k < 1 || k > C)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": k=%lld must be in [1, x.shape[-1]=%lld]", (long long)k,
                        (long long)C);
  if (values->dtype != x->dtype)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": values.dtype=%s must equal x.dtype=%s",
                        smelt_dtype_name(values->dtype), smelt_dtype_name(x->dtype));
  if ((s = check_out_shape("values", values, x, k))) return s;
  if (indices && ((s = smelt__check_dtype(OP, "indices", indices, index_types, 2)) ||
                  (s = check_out_shape("indices", indices, x, k))))
    return s;
  if ((s = smelt__check_output(OP, "values", values)) ||
      (indices && (s = smelt__check_output(OP, "indices", indices))) || (s = check_all_disjoint(x, values, indices)))
    return s;
  smelt_plan *plan;
  if ((s = smelt__plan_new(ctx, SMELT__OP_TOPK, &plan))) return s;
  plan->ntensors = 3;
  plan->t[0] = *x;
  plan->t[1] = *values;
  if (indices) plan->t[2] = *indices;
  plan->p.topk.k = k;
  snprintf(plan->describe, sizeof plan->describe, "topk %s k=%lld of C=%lld (cpu reference)",
           smelt_dtype_name(x->dtype), (long long)k, (long long)C);
  if (ctx->device == SMELT_DEVICE_CUDA && (s = smelt__cuda_topk_plan(plan))) {
    smelt_plan_destroy(plan);
    return s;
  }
  *out = plan;
  return SMELT_OK;
}

smelt_status smelt_topk_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *values,
                            const smelt_tensor *indices) {
  if (!plan) return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_run: plan is NULL");
  if (plan->op != SMELT__OP_TOPK)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP "_run: the plan is not a top-k plan");
  const int planned_idx = plan->t[2].ndim >= 0;
  if (indices && !planned_idx)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": indices is given but the plan was made without it");
  if (!indices && planned_idx)
    return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": indices is NULL but the plan was made with it");
  smelt_status s;
  if ((s = smelt__check_same_layout(OP, "x", &plan->t[0], x)) ||
      (s = smelt__check_same_layout(OP, "values", &plan->t[1], values)) ||
      (indices && (s = smelt__check_same_layout(OP, "indices", &plan->t[2], indices))) ||
      (s = check_all_disjoint(x, values, indices)))
    return s;
  if (plan->ctx->device == SMELT_DEVICE_CUDA) return smelt__cuda_topk_run(plan, x, values, indices);
  return smelt__cpu_topk(plan, x, values, indices);
}

smelt_status smelt_topk(smelt_ctx *ctx, int64_t k, const smelt_tensor *x, const smelt_tensor *values,
                        const smelt_tensor *indices) {
  smelt_plan *plan;
  smelt_status s = smelt_topk_plan(ctx, k, x, values, indices, &plan);
  if (s) return s;
  s = smelt_topk_run(plan, x, values, indices);
  smelt_plan_destroy(plan);
  return s;
}
