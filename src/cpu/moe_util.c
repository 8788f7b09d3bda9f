/* Host scratch tensors and element access for the MoE CPU reference, and
 * the one check of an offsets tensor's values (which only the CPU can read
 * before it writes). */
#include "../core/checked.h"
#include "moe_cpu.h"

#include <stdlib.h>

smelt_status smelt__moe_scratch(smelt_tensor *t, smelt_dtype dt, int64_t d0, int64_t d1, const char *what) {
  int64_t shape[2] = {d0, d1 < 0 ? 1 : d1}, n;
  size_t bytes = 0;
  smelt_status s = smelt__mul_i64(shape[0], shape[1], &n, MOE_OP, what);
  if (s || (s = smelt__bytes(n, smelt_dtype_size(dt), &bytes, MOE_OP, what))) return s;
  void *p = calloc(bytes ? bytes : 1, 1);
  if (!p) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for %s (%zu bytes)", what, bytes);
  *t = smelt_tensor_make(p, dt, SMELT_DEVICE_CPU, 0, d1 < 0 ? 1 : 2, shape);
  return SMELT_OK;
}

double smelt__moe_get(const smelt_tensor *t, int64_t i) {
  return smelt__load_f64(t->data, t->dtype, smelt__tensor_offset(t, i));
}

int64_t smelt__moe_geti(const smelt_tensor *t, int64_t i) {
  const int64_t o = smelt__tensor_offset(t, i);
  return t->dtype == SMELT_DTYPE_I64 ? ((const int64_t *)t->data)[o] : ((const int32_t *)t->data)[o];
}

void smelt__moe_set(const smelt_tensor *t, int64_t i, double v) {
  smelt__store_f64(t->data, t->dtype, smelt__tensor_offset(t, i), v);
}

double smelt__moe_get2(const smelt_tensor *t, int64_t r, int64_t c) {
  return smelt__load_f64(t->data, t->dtype, r * t->strides[0] + c * t->strides[1]);
}

void smelt__moe_set2(const smelt_tensor *t, int64_t r, int64_t c, double v) {
  smelt__store_f64(t->data, t->dtype, r * t->strides[0] + c * t->strides[1], v);
}

smelt_status smelt__moe_offsets(const smelt__moe_state *ms, const smelt_tensor *offsets, int64_t *ends) {
  int64_t prev = smelt__moe_geti(offsets, 0);
  if (prev != 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": offsets[0]=%lld must be 0", (long long)prev);
  for (int64_t e = 0; e < ms->E; e++) {
    const int64_t v = smelt__moe_geti(offsets, e + 1);
    if (v < prev || v > ms->rows)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                          MOE_OP ": offsets[%lld]=%lld must be in [offsets[%lld]=%lld, T * top_k=%lld]",
                          (long long)(e + 1), (long long)v, (long long)e, (long long)prev, (long long)ms->rows);
    ends[e] = prev = v;
  }
  return SMELT_OK;
}
