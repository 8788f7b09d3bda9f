/* smelt_bem on CUDA: not yet supported (the CPU backend runs it). */
#include "cuda_internal.h"

static smelt_status plan_bem(smelt_plan *plan, const void *args) {
  (void)plan;
  (void)args;
  return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_bem: not supported on CUDA yet");
}

static smelt_status run(smelt_plan *plan, const void *args) { return plan_bem(plan, args); }

int smelt__bem_variants(smelt__kernel_src *out, int max) {
  (void)out;
  (void)max;
  return 0;
}

const smelt__backend smelt__cuda_bem = {.plan = plan_bem, .run = run};
