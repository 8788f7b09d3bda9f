/* Tensor views: construction, element counting and the validation every op
 * runs before touching memory. Validation messages name the op, the tensor,
 * the constraint and the value seen. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

smelt_tensor smelt_tensor_make(void *data, smelt_dtype dt, smelt_device_kind dev, int device_index,
                               int ndim, const int64_t *shape) {
  smelt_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dt;
  t.device = dev;
  t.device_index = device_index;
  if (ndim < 0 || ndim > SMELT_MAX_DIMS || (ndim > 0 && !shape)) {
    t.ndim = -1;
    return t;
  }
  t.ndim = ndim;
  int64_t stride = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    /* Saturate rather than wrap: a shape of more than 2^63 elements then
     * fails every op's validation as an overflow. */
    if (__builtin_mul_overflow(stride, shape[i] > 0 ? shape[i] : 1, &stride)) stride = INT64_MAX;
  }
  return t;
}

int64_t smelt_tensor_numel(const smelt_tensor *t) {
  if (!t || t->ndim < 0 || t->ndim > SMELT_MAX_DIMS) return -1;
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0) return -1;
    if (t->shape[i] == 0) return 0;
  }
  for (int i = 0; i < t->ndim; i++) {
    if (__builtin_mul_overflow(n, t->shape[i], &n)) return -1;
  }
  return n;
}

int smelt_tensor_is_contiguous(const smelt_tensor *t) {
  if (!t || t->ndim < 0 || t->ndim > SMELT_MAX_DIMS) return 0;
  const int64_t numel = smelt_tensor_numel(t);
  if (numel < 0) return 0; /* not a valid tensor, let alone a contiguous one */
  if (numel == 0) return 1; /* numpy gives empty arrays strides of 0 */
  int64_t expect = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->strides[i] != expect) return 0;
    if (__builtin_mul_overflow(expect, t->shape[i], &expect)) return 0;
  }
  return 1;
}

const char *smelt__shape_str(const smelt_tensor *t, char *buf, size_t n) {
  size_t used = 0;
  used += (size_t)snprintf(buf + used, n - used, "[");
  for (int i = 0; t && i < t->ndim && i < SMELT_MAX_DIMS && used < n; i++)
    used += (size_t)snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
  if (used < n) snprintf(buf + used, n - used, "]");
  return buf;
}

smelt_status smelt__check_dims(const char *op, const char *name, const smelt_tensor *t, int n, const int64_t *dims,
                               const char *what) {
  int same = t->ndim == n;
  for (int d = 0; same && d < n; d++) same = t->shape[d] == dims[d];
  if (same) return SMELT_OK;
  smelt_tensor want = {.ndim = n};
  for (int d = 0; d < n; d++) want.shape[d] = dims[d];
  char a[160], b[160];
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape=%s must be %s=%s", op, name,
                      smelt__shape_str(t, a, sizeof a), what, smelt__shape_str(&want, b, sizeof b));
}

smelt_status smelt__check_tensor(const char *op, const char *name, const smelt_tensor *t) {
  if (!t) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL", op, name);
  if (t->ndim < 0 || t->ndim > SMELT_MAX_DIMS)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s.ndim=%d must be in [0, %d]", op, name,
                        t->ndim, SMELT_MAX_DIMS);
  if ((unsigned)t->dtype >= SMELT_DTYPE_COUNT)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%d is not a smelt_dtype", op, name,
                        (int)t->dtype);
  if (t->device != SMELT_DEVICE_CPU && t->device != SMELT_DEVICE_CUDA)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s.device=%d is not cpu (0) or cuda (1)", op,
                        name, (int)t->device);
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] < 0)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s.shape[%d]=%lld must be >= 0", op, name, i,
                          (long long)t->shape[i]);
  int64_t numel = smelt_tensor_numel(t);
  if (numel < 0) return smelt__error(SMELT_STATUS_OVERFLOW, "%s: %s has more than 2^63 elements", op, name);
  /* Nothing of an empty view is read: its strides (numpy gives 0) and data
   * do not matter. */
  if (numel == 0) return SMELT_OK;
  for (int i = 0; i < t->ndim; i++)
    if (t->strides[i] < 0)
      return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[%d]=%lld must be >= 0 (negative strides are not supported)",
                          op, name, i, (long long)t->strides[i]);
  /* The furthest element's byte offset must fit too. */
  int64_t extent = 0, esize = (int64_t)smelt_dtype_size(t->dtype), term;
  for (int i = 0; i < t->ndim; i++) {
    if (__builtin_mul_overflow(t->shape[i] - 1, t->strides[i], &term) ||
        __builtin_add_overflow(extent, term, &extent))
      return smelt__error(SMELT_STATUS_OVERFLOW, "%s: %s spans more than 2^63 elements", op, name);
  }
  if (__builtin_add_overflow(extent, 1, &term) || __builtin_mul_overflow(term, esize, &term))
    return smelt__error(SMELT_STATUS_OVERFLOW, "%s: %s spans more than 2^63 bytes", op, name);
  if (!t->data) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s.data is NULL", op, name);
  if ((uintptr_t)t->data % (uintptr_t)esize)
    return smelt__error(SMELT_STATUS_MISALIGNED, "%s: %s.data=%p is not aligned to its dtype %s (%lld bytes)",
                        op, name, t->data, smelt_dtype_name(t->dtype), (long long)esize);
  return SMELT_OK;
}

smelt_status smelt__check_device(const char *op, const char *name, const smelt_tensor *t,
                                 const smelt_ctx *ctx) {
  if (t->device != ctx->device || (t->device == SMELT_DEVICE_CUDA && t->device_index != ctx->device_index))
    return smelt__error(SMELT_STATUS_WRONG_DEVICE, "%s: %s is on %s:%d but the context is on %s:%d", op, name,
                        t->device == SMELT_DEVICE_CUDA ? "cuda" : "cpu", t->device_index,
                        ctx->device == SMELT_DEVICE_CUDA ? "cuda" : "cpu", ctx->device_index);
  return SMELT_OK;
}

smelt_status smelt__check_same_shape(const char *op, const char *an, const smelt_tensor *a,
                                     const char *bn, const smelt_tensor *b) {
  int same = a->ndim == b->ndim;
  for (int i = 0; same && i < a->ndim; i++) same = a->shape[i] == b->shape[i];
  if (!same) {
    char sa[160], sb[160];
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape=%s must equal %s.shape=%s", op, bn,
                        smelt__shape_str(b, sb, sizeof sb), an, smelt__shape_str(a, sa, sizeof sa));
  }
  return SMELT_OK;
}

smelt_status smelt__check_same_layout(const char *op, const char *an, const smelt_tensor *planned,
                                      const smelt_tensor *t) {
  smelt_status s = smelt__check_tensor(op, an, t);
  if (s) return s;
  if (t->dtype != planned->dtype)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%s differs from the planned %s", op, an,
                        smelt_dtype_name(t->dtype), smelt_dtype_name(planned->dtype));
  char sa[160], sb[160];
  int same = t->ndim == planned->ndim;
  for (int i = 0; same && i < t->ndim; i++) same = t->shape[i] == planned->shape[i];
  if (!same)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape=%s differs from the planned %s", op, an,
                        smelt__shape_str(t, sa, sizeof sa), smelt__shape_str(planned, sb, sizeof sb));
  for (int i = 0; i < t->ndim && smelt_tensor_numel(t) > 0; i++)
    if (t->strides[i] != planned->strides[i] && t->shape[i] != 1)
      return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[%d]=%lld differs from the planned %lld", op,
                          an, i, (long long)t->strides[i], (long long)planned->strides[i]);
  if (t->device != planned->device || t->device_index != planned->device_index)
    return smelt__error(SMELT_STATUS_WRONG_DEVICE, "%s: %s is on another device than planned", op, an);
  return SMELT_OK;
}

smelt_status smelt__check_dtype(const char *op, const char *name, const smelt_tensor *t,
                                const smelt_dtype *allowed, int n) {
  for (int i = 0; i < n; i++)
    if (t->dtype == allowed[i]) return SMELT_OK;
  char set[128];
  size_t used = 0;
  for (int i = 0; i < n && used < sizeof set; i++)
    used += (size_t)snprintf(set + used, sizeof set - used, "%s%s", i ? ", " : "", smelt_dtype_name(allowed[i]));
  return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%s is not supported (supported: %s)", op, name,
                      smelt_dtype_name(t->dtype), set);
}

void smelt__tensor_span(const smelt_tensor *t, int64_t *lo, int64_t *hi) {
  int64_t numel = smelt_tensor_numel(t);
  if (numel <= 0) {
    *lo = *hi = 0;
    return;
  }
  int64_t extent = 0;
  for (int i = 0; i < t->ndim; i++) extent += (t->shape[i] - 1) * t->strides[i];
  *lo = 0;
  *hi = (extent + 1) * (int64_t)smelt_dtype_size(t->dtype);
}

int smelt__tensors_overlap(const smelt_tensor *a, const smelt_tensor *b) {
  if (!a || !b || a->device != b->device) return 0;
  int64_t alo, ahi, blo, bhi;
  smelt__tensor_span(a, &alo, &ahi);
  smelt__tensor_span(b, &blo, &bhi);
  if (ahi == alo || bhi == blo) return 0;
  uintptr_t a0 = (uintptr_t)a->data + (uintptr_t)alo, a1 = (uintptr_t)a->data + (uintptr_t)ahi;
  uintptr_t b0 = (uintptr_t)b->data + (uintptr_t)blo, b1 = (uintptr_t)b->data + (uintptr_t)bhi;
  return a0 < b1 && b0 < a1;
}

smelt_status smelt__check_output(const char *op, const char *name, const smelt_tensor *t) {
  /* Sorted by stride, the dims of size > 1 must each step past everything
   * the smaller ones reach. This rejects a few exotic interleavings that do
   * not overlap; no output has a reason to use one. */
  if (smelt_tensor_numel(t) == 0) return SMELT_OK;
  int64_t stride[SMELT_MAX_DIMS], size[SMELT_MAX_DIMS];
  int n = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (t->shape[d] <= 1) continue;
    int at = n++;
    while (at > 0 && stride[at - 1] > t->strides[d]) {
      stride[at] = stride[at - 1];
      size[at] = size[at - 1];
      at--;
    }
    stride[at] = t->strides[d];
    size[at] = t->shape[d];
  }
  int64_t reach = 0;
  for (int i = 0; i < n; i++) {
    if (stride[i] <= reach) {
      char shape[160], strides[160];
      size_t used = 0;
      used += (size_t)snprintf(strides, sizeof strides, "[");
      for (int d = 0; d < t->ndim && used < sizeof strides; d++)
        used +=
            (size_t)snprintf(strides + used, sizeof strides - used, "%s%lld", d ? ", " : "", (long long)t->strides[d]);
      if (used < sizeof strides) snprintf(strides + used, sizeof strides - used, "]");
      return smelt__error(SMELT_STATUS_BAD_LAYOUT,
                          "%s: %s.strides=%s over shape %s make elements share memory; an output's elements "
                          "must be distinct",
                          op, name, strides, smelt__shape_str(t, shape, sizeof shape));
    }
    reach += (size[i] - 1) * stride[i];
  }
  return SMELT_OK;
}

int64_t smelt__tensor_offset(const smelt_tensor *t, int64_t i) {
  int64_t off = 0;
  for (int d = t->ndim - 1; d >= 0; d--) {
    off += (i % t->shape[d]) * t->strides[d];
    i /= t->shape[d];
  }
  return off;
}

smelt_tensor smelt__tensor_swap_axes(const smelt_tensor *t, int i, int j) {
  smelt_tensor r = *t;
  r.shape[i] = t->shape[j];
  r.shape[j] = t->shape[i];
  r.strides[i] = t->strides[j];
  r.strides[j] = t->strides[i];
  return r;
}
