/* CPU reference for smelt_activation: each element through smelt_act_apply
 * (the double-precision definition), rounded once into y's dtype. Any
 * strides; in place (y == x) works because each element is read before it
 * is written and no other element reads it. */
#include "../core/internal.h"

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *y = t[1];
  const smelt_act act = plan->p.act.act;
  const double slope = plan->p.act.slope;
  const int64_t n = smelt_tensor_numel(x);
  /* i: row-major index over x.shape == y.shape */
  for (int64_t i = 0; i < n; i++) {
    double v = smelt__load_f64(x->data, x->dtype, smelt__tensor_offset(x, i));
    smelt__store_f64(y->data, y->dtype, smelt__tensor_offset(y, i), smelt_act_apply(act, v, slope));
  }
  return SMELT_OK;
}

const smelt__backend smelt__cpu_activation = {.run = run};
