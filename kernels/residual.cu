/* The residual add, y = x + residual, elementwise in f32 and rounded once.
 *
 * Prelude: SMELT_DT. Entry points by layout (the host picks per run):
 *   add_vec  x, residual and y contiguous and 16-byte aligned: 16-byte
 *            accesses in a grid-stride loop, the tail element by element;
 *   add_gen  any strides: each row-major index is mapped to its three
 *            offsets (the host merges dims, so usually one multiply each).
 * y may be the residual itself (in place): each element is read and then
 * written by the same thread.
 */
#include "smelt_device.cuh"

#if !defined(SMELT_DT)
#error "residual.cu needs SMELT_DT"
#endif

#define BLOCK 256
#define VW SMELT_VW


static __device__ __forceinline__ elem_t add(elem_t a, elem_t b) { return store_elem(load_elem(a) + load_elem(b)); }

extern "C" __global__ void __launch_bounds__(BLOCK) add_vec(const elem_t *x, const elem_t *r, elem_t *y, i64 n) {
  const i64 nvec = n / VW, step = (i64)gridDim.x * BLOCK, tid = (i64)blockIdx.x * BLOCK + threadIdx.x;
  for (i64 i = tid; i < nvec; i += step) {
    smelt_vec16 a, b;
    a.u = ((const uint4 *)x)[i];
    b.u = ((const uint4 *)r)[i];
#pragma unroll
    for (int e = 0; e < VW; e++) a.e[e] = add(a.e[e], b.e[e]);
    ((uint4 *)y)[i] = a.u;
  }
  const i64 t = nvec * VW + tid; /* the tail: fewer than VW elements */
  if (t < n) y[t] = add(x[t], r[t]);
}

static __device__ __forceinline__ i64 offset_of(const smelt_kshape &s, i64 i) {
  return s.ndim == 1 ? i * s.strides[0] : smelt_offset(s, i);
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    add_gen(const elem_t *x, const elem_t *r, elem_t *y, i64 n, smelt_kshape xs, smelt_kshape rs, smelt_kshape ys) {
  const i64 step = (i64)gridDim.x * BLOCK;
  for (i64 i = (i64)blockIdx.x * BLOCK + threadIdx.x; i < n; i += step)
    y[offset_of(ys, i)] = add(x[offset_of(xs, i)], r[offset_of(rs, i)]);
}
