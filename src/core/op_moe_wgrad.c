/* The expert FFN's weight gradients, dW[e] = lhs_eᵀ · rhs_e over each
 * expert's rows, for both backends. The sum runs along K, over a row range
 * that differs by expert, which the grouped-by-offsets GEMM (groups along
 * M) cannot express; so this is the host-scheduled grouped GEMM
 * (smelt_gemm_grouped) over views of each expert's rows, with the row
 * ranges on the host. Grouped runs never split K, so each dW[e] is summed
 * in one fixed order: the same bits on every run. */
#include "moe_internal.h"

#include <stdlib.h>

/* Rows [r0, r0 + n) of a [R, cols] tensor of unit column stride (rows rs
 * apart), or their transpose [cols, n] (strides 1 and rs). */
static smelt_tensor rows_of(const smelt_tensor *t, int64_t r0, int64_t n, int transpose) {
  smelt_tensor v = *t;
  const int64_t cols = t->shape[1], rs = t->strides[0];
  /* No offset on a NULL data pointer (an empty tensor's): undefined even at 0. */
  if (t->data) v.data = (char *)t->data + (size_t)(r0 * rs) * smelt_dtype_size(t->dtype);
  v.shape[0] = transpose ? cols : n;
  v.shape[1] = transpose ? n : cols;
  v.strides[0] = transpose ? 1 : rs;
  v.strides[1] = transpose ? rs : 1;
  return v;
}

/* Expert e's matrix of weights [E, a, b]. */
static smelt_tensor expert_of(const smelt_tensor *w, int64_t e) {
  smelt_tensor v = *w;
  if (w->data) v.data = (char *)w->data + (size_t)(e * w->strides[0]) * smelt_dtype_size(w->dtype);
  v.ndim = w->ndim - 1;
  for (int i = 0; i < v.ndim; i++) {
    v.shape[i] = w->shape[i + 1];
    v.strides[i] = w->strides[i + 1];
  }
  return v;
}

smelt_status smelt__moe_weight_grad(smelt_ctx *ctx, const smelt__moe_state *ms, const int64_t *start,
                                    const smelt_tensor *lhs, const smelt_tensor *rhs, const smelt_tensor *dw) {
  const int64_t E = ms->E;
  smelt_tensor *v = (smelt_tensor *)malloc((size_t)(3 * E) * sizeof *v);
  if (!v) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the weight gradients");
  for (int64_t e = 0; e < E; e++) {
    v[e] = rows_of(lhs, start[e], start[e + 1] - start[e], 1);
    v[E + e] = rows_of(rhs, start[e], start[e + 1] - start[e], 0);
    v[2 * E + e] = expert_of(dw, e);
  }
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.mode = SMELT_GEMM_MODE_GROUPED;
  smelt_status s = smelt_gemm_grouped(ctx, &desc, E, v, v + E, NULL, v + 2 * E, NULL);
  free(v);
  return s;
}
