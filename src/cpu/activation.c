/* CPU reference for smelt_activation: each element through smelt_act_apply
 * (the double-precision definition), rounded once into y's dtype. Any
 * strides; in place (y == x) works because each element is read before it
 * is written and no other element reads it. */
#include "../core/internal.h"

smelt_status smelt__cpu_activation(const smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *y) {
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
