/* The second kernel of a parallel split-K GEMM: adds the slices' partial
 * sums in slice order (so the result does not depend on scheduling) and
 * applies the epilogue.
 *
 * Prelude: GEMM_ACC (1 f32, 2 f16, 3 f64, 4 i32), which fixes the partial
 * sums' type ws_t. The workspace holds splits x M x N values, element
 * (z, r, c) at z * M * N + r * N + c. Consecutive threads take consecutive
 * elements of a row: coalesced workspace reads and, for row-major D, stores.
 */
#include "gemm_common.cuh"

#define NT 256

/* Element i: the slices' sum in order, then the epilogue at (r, c). */
static __device__ __forceinline__ void reduce_one(const gemm_params &P, const ws_t *ws, i64 total, i64 i, i64 r,
                                                  i64 c) {
  ws_t s = ws[i];
  for (int z = 1; z < P.splits; z++) {
#if GEMM_ACC == ACC_I32
    s = (int)((u32)s + (u32)ws[z * total + i]); /* wraps, as the accumulator does */
#else
    s += ws[z * total + i];
#endif
  }
  gemm_epilogue(P, P.p, r, c, (epi_t)s);
}

extern "C" __global__ void __launch_bounds__(NT) gemm_reduce(const gemm_params P) {
  const gemm_prob &p = P.p;
  const i64 total = p.m * p.n;
  const ws_t *ws = (const ws_t *)P.workspace;
  /* (r, c) of i by 32-bit division when the sizes allow: a 64-bit one is a
   * long software sequence, next to a few loads per element. */
  if (total < ((i64)1 << 31)) {
    const u32 n = (u32)p.n;
    for (u32 i = blockIdx.x * NT + threadIdx.x; i < (u32)total; i += gridDim.x * NT)
      reduce_one(P, ws, total, i, i / n, i % n);
    return;
  }
  for (i64 i = (i64)blockIdx.x * NT + threadIdx.x; i < total; i += (i64)gridDim.x * NT)
    reduce_one(P, ws, total, i, i / p.n, i % p.n);
}
