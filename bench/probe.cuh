/* What the standalone CUDA probes in bench/ share (each is one nvcc
 * program; this header sits beside them, so no -I is needed): the runtime
 * error check and the 16-byte non-caching global load they read rows with. */
#ifndef SMELT_BENCH_PROBE_CUH
#define SMELT_BENCH_PROBE_CUH
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

static __device__ __forceinline__ uint4 ldg_nc(const void *p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
#endif
