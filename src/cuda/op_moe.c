/* smelt_moe on CUDA: no kernels yet. Planning on a CUDA context fails with
 * UNSUPPORTED, saying so, rather than running the CPU reference behind the
 * caller's back (the tensors live on the device). */
#include "../core/moe_internal.h"

static smelt_status plan_moe(smelt_plan *plan, const void *args) {
  return smelt__error(SMELT_STATUS_UNSUPPORTED,
                      MOE_OP ": the CUDA backend has no MoE kernels yet; use a CPU context (smelt/moe.h)");
}

static smelt_status run(smelt_plan *plan, const void *args) {
  return smelt__error(SMELT_STATUS_UNSUPPORTED, MOE_OP ": the CUDA backend has no MoE kernels yet");
}

int smelt__moe_variants(smelt__kernel_src *out, int max) { return 0; }

const smelt__backend smelt__cuda_moe = {.plan = plan_moe, .run = run};
