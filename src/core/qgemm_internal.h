/* What smelt_qgemm's core, CPU reference and CUDA backend share: the roles
 * by index and the description the plan keeps. */
#ifndef SMELT_QGEMM_INTERNAL_H
#define SMELT_QGEMM_INTERNAL_H

#include "quant_internal.h"

/* The family's tensors by role index. */
enum { SMELT__QG_X, SMELT__QG_Q, SMELT__QG_SCALE, SMELT__QG_TS, SMELT__QG_BIAS, SMELT__QG_D, SMELT__QG_COUNT };

/* The plan's description (opdata). */
typedef struct smelt__qgemm_params {
  smelt_quant_format format;
  smelt_qgemm_desc desc;
} smelt__qgemm_params;

static inline const smelt__qgemm_params *smelt__qgemm_params_of(const smelt_plan *plan) {
  return (const smelt__qgemm_params *)plan->opdata;
}

#endif /* SMELT_QGEMM_INTERNAL_H */
