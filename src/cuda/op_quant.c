/* smelt_quantize and smelt_dequantize on CUDA: not yet there; planning
 * refuses with UNSUPPORTED (no silent fallback to the CPU reference). */
#include "cuda_internal.h"

int smelt__quant_variants(smelt__kernel_src *out, int max) {
  (void)out;
  (void)max;
  return 0;
}

int smelt__dequant_variants(smelt__kernel_src *out, int max) {
  (void)out;
  (void)max;
  return 0;
}

static smelt_status refuse(smelt_plan *plan, const void *args) {
  (void)args;
  return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: not available on CUDA yet (the CPU backend has it)",
                      plan->family->op);
}

const smelt__backend smelt__cuda_quant = {.plan = refuse, .run = refuse};
const smelt__backend smelt__cuda_dequant = {.plan = refuse, .run = refuse};
