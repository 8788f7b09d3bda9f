/* Kernels with one module per dtype (f32, f16, bf16) and nothing else in
 * their prelude but SMELT_DT (kernels/residual.cu, kernels/rotary.cu): the
 * one make_src, variant list and plan those families share. */
#ifndef SMELT_DTYPE_MODULE_H
#define SMELT_DTYPE_MODULE_H

#include "cuda_internal.h"

/* A dtype-only kernel family: its body file, module name prefix and entry points. */
typedef struct smelt__dtype_module {
  const char *body;   /* "rotary.cu" */
  const char *prefix; /* "rotary": modules rotary_f32, rotary_f16, rotary_bf16 */
  const char *const *entries;
  int nentries; /* at most SMELT__PLAN_MAX_FUNCS */
} smelt__dtype_module;

/* The variant enumerator's answer for m (smelt__<family>_variants). */
int smelt__dtype_module_variants(const smelt__dtype_module *m, smelt__kernel_src *out, int max);
/* Loads m's module for the plan's role-0 dtype into plan->func[0..nentries). */
smelt_status smelt__dtype_module_plan(const smelt__dtype_module *m, smelt_plan *plan);

#endif /* SMELT_DTYPE_MODULE_H */
