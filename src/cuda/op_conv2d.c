/* smelt_conv2d on CUDA: not served yet. The implicit-GEMM kernels on the
 * GEMM engine are still to come, and a GPU context must not quietly run the
 * CPU reference instead, so planning fails with UNSUPPORTED and says so. */
#include "cuda_internal.h"

int smelt__conv2d_variants(smelt__kernel_src *out, int max) { return 0; }

static smelt_status plan_conv2d(smelt_plan *plan, const void *args) {
  return smelt__error(SMELT_STATUS_UNSUPPORTED,
                      "smelt_conv2d: the CUDA backend has no conv2d kernels yet (supported: the CPU backend)");
}

static smelt_status run(smelt_plan *plan, const void *args) {
  return smelt__error(SMELT_STATUS_INTERNAL, "smelt_conv2d: a CUDA conv2d plan cannot exist");
}

const smelt__backend smelt__cuda_conv2d = {.plan = plan_conv2d, .run = run};
