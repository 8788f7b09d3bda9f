/* CPU reference for smelt_softmax, in double: per row of C elements,
 *   m   = max over the non-NaN elements (NaN compares false)
 *   ref = m, or 0 when m = -inf (a row of all -inf)
 *   s   = sum of exp(x - ref)
 *   y   = exp(x - ref) / s, or 0 when s == 0 (no mass: all -inf)
 *   lse = ref + log s
 * A NaN makes s NaN, hence the whole row and lse NaN; a +inf makes
 * exp(inf - inf) NaN, so such a row is NaN as well. The kernels follow the
 * same steps in f32. */
#include "../core/internal.h"

#include <math.h>

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *y = t[1], *lse = t[2];
  const int64_t C = x->shape[x->ndim - 1];
  const int64_t rows = smelt_tensor_numel(x) / C;
  for (int64_t r = 0; r < rows; r++) { /* x, y: [rows, C] in row-major index order; lse: [rows] */
    double m = -INFINITY;
    for (int64_t j = 0; j < C; j++) {
      double v = smelt__load_f64(x->data, x->dtype, smelt__tensor_offset(x, r * C + j));
      if (v > m) m = v;
    }
    const double ref = m == -INFINITY ? 0.0 : m;
    double s = 0.0;
    for (int64_t j = 0; j < C; j++)
      s += exp(smelt__load_f64(x->data, x->dtype, smelt__tensor_offset(x, r * C + j)) - ref);
    for (int64_t j = 0; j < C; j++) {
      double e = exp(smelt__load_f64(x->data, x->dtype, smelt__tensor_offset(x, r * C + j)) - ref);
      smelt__store_f64(y->data, y->dtype, smelt__tensor_offset(y, r * C + j), s == 0.0 ? 0.0 : e / s);
    }
    if (lse) smelt__store_f64(lse->data, lse->dtype, smelt__tensor_offset(lse, r), ref + log(s));
  }
  return SMELT_OK;
}

const smelt__backend smelt__cpu_softmax = {.run = run};
