/* The second pass of an epilogue graph's reductions (smelt/epilogue.h):
 * element i of the output vector combines the partials the GEMM kernel
 * wrote (kernels/gemm_epi_graph.cuh), part[c * len + i] for c = 0, 1, ...,
 * chunks - 1, in that order, so the result does not depend on scheduling.
 * kind: 0 a sum, 1 a max, 2 an abs-max (the partials hold |x| already);
 * the maxima keep a NaN once they see one. chunks 0 (an empty axis) gives
 * the identity. Consecutive threads take consecutive elements: each chunk
 * is read in whole rows. No prelude. */
#include "smelt_device.cuh"

extern "C" __global__ void __launch_bounds__(256) gemm_epi_reduce(const float *part, i64 chunks, i64 len, int kind,
                                                                  float *out) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (i64)gridDim.x * blockDim.x) {
    float a = kind == 1 ? -__int_as_float(0x7f800000) : 0.f;
    for (i64 c = 0; c < chunks; c++) {
      const float v = part[c * len + i];
      a = kind == 0 ? a + v : a > v || a != a ? a : v;
    }
    out[i] = a;
  }
}
