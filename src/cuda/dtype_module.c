/* The dtype-only kernel families' shared source, variants and plan
 * (src/cuda/dtype_module.h). */
#include "dtype_module.h"

#include <stdio.h>
#include <string.h>

static const smelt_dtype dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

static void make_src(const smelt__dtype_module *m, smelt_dtype dt, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "%s_%s", m->prefix, smelt_dtype_name(dt));
  src->body = m->body;
  smelt__prelude_define(src, "SMELT_DT", dt);
}

int smelt__dtype_module_variants(const smelt__dtype_module *m, smelt__kernel_src *out, int max) {
  int n = 0;
  for (size_t d = 0; d < sizeof dtypes / sizeof *dtypes; d++, n++)
    if (n < max) make_src(m, dtypes[d], &out[n]);
  return n;
}

smelt_status smelt__dtype_module_plan(const smelt__dtype_module *m, smelt_plan *plan) {
  smelt__kernel_src src;
  make_src(m, plan->t[0].dtype, &src);
  for (int i = 0; i < m->nentries; i++) {
    CUfunction f;
    smelt_status s = smelt__cuda_function(plan->ctx, &src, m->entries[i], &f);
    if (s) return s;
    plan->func[i] = f;
  }
  snprintf(plan->describe, sizeof plan->describe, "%s (%s, entry point by layout)", src.name, m->body);
  return SMELT_OK;
}
