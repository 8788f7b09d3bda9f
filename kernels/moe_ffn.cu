/* The SwiGLU step of the MoE expert FFN between its two grouped GEMMs:
 * h = silu(a) · b, in place into a, over the rows the router kept.
 *
 * a and b are [rows, F] contiguous, so their first offsets[E] rows are one
 * flat run of offsets[E] · F elements: the kernel walks it in 16-byte units
 * (a grid-stride loop, one load of each and one store, f32 math), then the
 * few elements past the last whole unit. The count of kept rows is read
 * here, from the device offsets, so the host launches for every row that
 * could be kept and needs no synchronization; a count outside [0, rows]
 * (offsets that are the caller's bug) is clamped so nothing outside a and b
 * is touched. elem_t is the prelude's SMELT_DT. */
#include "smelt_device.cuh"

#define UNIT ((int)(16 / sizeof(elem_t))) /* elements per 16-byte access */

typedef union unit16 {
  uint4 v;
  elem_t e[UNIT];
} unit16;

static __device__ __forceinline__ float silu_mul(float a, float b) { return a / (1.f + expf(-a)) * b; }

/* a, b 16-byte aligned; offsets [E+1] i32 or i64. */
extern "C" __global__ void moe_swiglu(elem_t *a, const elem_t *b, const void *offsets, int offsets64, int E, i64 rows,
                                      i64 F) {
  i64 kept = offsets64 ? ((const i64 *)offsets)[E] : (i64)((const int *)offsets)[E];
  kept = kept < 0 ? 0 : kept > rows ? rows : kept;
  const i64 n = kept * F, units = n / UNIT, stride = (i64)gridDim.x * blockDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  for (i64 u = first; u < units; u += stride) {
    unit16 x, y;
    x.v = ((const uint4 *)a)[u];
    y.v = ((const uint4 *)b)[u];
#pragma unroll
    for (int j = 0; j < UNIT; j++) x.e[j] = store_elem(silu_mul(load_elem(x.e[j]), load_elem(y.e[j])));
    ((uint4 *)a)[u] = x.v;
  }
  for (i64 i = units * UNIT + first; i < n; i += stride) a[i] = store_elem(silu_mul(load_elem(a[i]), load_elem(b[i])));
}
