/* A trivial kernel the runtime's own tests compile, cache and launch:
 * y[i] = x[i] * SELFTEST_SCALE + 1. SELFTEST_SCALE comes from the prelude. */
#include "smelt_device.cuh"

extern "C" __global__ void smelt_selftest(const float *x, float *y, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * (float)SELFTEST_SCALE + 1.0f;
}
