/* A GEMM through a plan an op keeps across its calls (smelt__gemm_reuse):
 * the one-shot smelt_gemm plans on every call (the kernel choice and the
 * module lookup), which an op's inner product should pay once. */
#include "gemm_internal.h"

/* The run's refusals of tensors unlike the planned ones (dtype, shape,
 * strides, device, an operand given or not): the plan is made again for
 * them. A refused run writes nothing. */
static int unlike_planned(smelt_status s) {
  return s == SMELT_STATUS_SHAPE_MISMATCH || s == SMELT_STATUS_DTYPE_MISMATCH || s == SMELT_STATUS_BAD_LAYOUT ||
         s == SMELT_STATUS_WRONG_DEVICE || s == SMELT_STATUS_INVALID_ARGUMENT || s == SMELT_STATUS_NULL_POINTER;
}

smelt_status smelt__gemm_reuse(smelt_ctx *ctx, smelt_plan **slot, const smelt_gemm_desc *desc, const smelt_tensor *a,
                               const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                               const smelt_tensor *bias) {
  if (*slot) {
    smelt_status s = smelt_gemm_run(*slot, a, b, c, d, bias);
    if (!unlike_planned(s)) return s;
    smelt_plan_destroy(*slot);
    *slot = NULL;
  }
  smelt_status s = smelt_gemm_plan(ctx, desc, a, b, c, d, bias, slot);
  return s ? s : smelt_gemm_run(*slot, a, b, c, d, bias);
}
