/* CPU reference for smelt_residual_add: y = x + residual in double, rounded
 * once to the dtype. Each element is read before it is written, so y may
 * be the residual itself. */
#include "../core/internal.h"

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *res = t[1], *y = t[2];
  (void)plan;
  const int64_t n = smelt_tensor_numel(x);
  for (int64_t i = 0; i < n; i++) {
    const double v = smelt__load_f64(x->data, x->dtype, smelt__tensor_offset(x, i)) +
                     smelt__load_f64(res->data, res->dtype, smelt__tensor_offset(res, i));
    smelt__store_f64(y->data, y->dtype, smelt__tensor_offset(y, i), v);
  }
  return SMELT_OK;
}

const smelt__backend smelt__cpu_residual = {.run = run};
