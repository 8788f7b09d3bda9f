/* The skinny GEMM (M <= 16: the decode step of an LLM, x [M,K] times the
 * weights W [N,K]): bound by reading B once, so everything serves streaming
 * B at HBM bandwidth. The 64-row wgmma tiles waste three quarters of their
 * rows here and keep too few bytes of B in flight per SM.
 *
 * Prelude: GEMM_ACC 1 (f32), GEMM_TC 1 (f16) or 2 (bf16).
 * The host guarantees: M <= 16, A and B K-major (unit stride along K when
 * K > 1), 16-byte aligned (pointers and every other stride), split-K slices
 * a multiple of 8 elements. Modes: plain, batched, parallel split-K.
 *
 * A 256-thread block owns 32 columns of D (32 rows of W) and all M rows;
 * its 8 warps take the block's K range in interleaved chunks of 128, so at
 * any moment the block reads 2 KB runs of 32 neighbouring rows of W. W is
 * the mma's 16-row A operand (rows g and g + 8 of each of a warp's two
 * 16-row groups, g = lane / 4) and x its n8 B operand (rows g and g + 8 of
 * D: one fragment, or two when M > 8), and the mma's k order is ours to
 * choose, because the sum does not depend on it: lane (g, t) loads the 16
 * bytes at k = kb + 32 j + 8 t of each of its rows of W and x, and the
 * mma of half h takes words 2h and 2h + 1 of them as its k pairs (2t, 2t+1)
 * and (2t+8, 2t+9). So every fragment is a 16-byte load of the lane's own:
 * W straight into registers (one row 64 contiguous bytes per instruction,
 * no L1 allocation, a 256-byte L2 prefetch), x (read by every block)
 * through L1 by cp.async into the lane's own slots of shared memory, which
 * keeps registers for W. A warp issues all of a chunk's loads (16 of W, up
 * to 8 of x: 8 KB of W per warp, 64 KB per block, two blocks per SM) before
 * its first mma, which is what keeps HBM busy.
 *
 * Columns past N and rows past M read a valid row instead (their results
 * are never stored); K past the slice's end is zero in both operands. The
 * warps' partial sums meet in shared memory and are added in warp order
 * (the same bits on every run), then gemm_finish applies the epilogue or
 * writes a parallel split's partial sums.
 */
#include "gemm_common.cuh"
#include "smelt_mma.cuh"

#define TC_F16 1
#define TC_BF16 2

#if !defined(GEMM_TC) || (GEMM_TC != TC_F16 && GEMM_TC != TC_BF16)
#error "gemm_gemv.cu needs GEMM_TC 1 (f16) or 2 (bf16)"
#endif
#if GEMM_ACC != ACC_F32
#error "gemm_gemv.cu accumulates in f32"
#endif

#define NT 256
#define WARPS (NT / 32)
#define BM 16          /* rows of D: all of M */
#define RG 2           /* 16-row groups of W per warp */
#define BN (16 * RG)   /* columns of D per block */
#define J 4            /* 16-byte loads per row of W per chunk */
#define CHUNK (32 * J) /* K per warp and chunk: 4 lanes x 8 elements x J */
#define RED_LD (BN + 4) /* row stride of the partial sums (lanes' stores hit distinct banks) */

static_assert(BM == 16 && BN == 32 && CHUNK == 128, "the table's tile (src/cuda/gemm_select.c, gemv)");

/* 16 bytes of x (which every block reads) into this lane's slot of shared
 * memory, through L1. */
static __device__ __forceinline__ void cp_async_ca16(u32 dst, const smelt_h16 *src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

/* The 8 elements at k .. k + 7 of a row (elements `ks` apart) that lie
 * before `end`, zeros after: a chunk cut by the end of K or of a slice. */
static __device__ __forceinline__ uint4 ld_tail(const smelt_h16 *row, i64 k, i64 end, i64 ks) {
  u32 w[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const u32 lo = k + 2 * e < end ? row[(k + 2 * e) * ks] : 0;
    const u32 hi = k + 2 * e + 1 < end ? row[(k + 2 * e + 1) * ks] : 0;
    w[e] = lo | hi << 16;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

#if GEMM_TC == TC_BF16
#define MMA mma_16816_bf16
#else
#define MMA mma_16816_f16
#endif

static __device__ __forceinline__ u32 word(const uint4 &v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

/* One 32-wide step of K: for each 16-row group of W (its rows g and g + 8
 * in bw[rg][0..1]) and x's rows g and g + 8 (ax[0..1]), the two mmas of
 * words (0, 1) and (2, 3); the second n8 fragment only when M > 8. */
static __device__ __forceinline__ void step(float (*acc)[2][4], const uint4 (*bw)[2], const uint4 *ax, int two) {
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const u32 b0[2] = {word(ax[0], 2 * hh), word(ax[0], 2 * hh + 1)};
    const u32 b1[2] = {word(ax[1], 2 * hh), word(ax[1], 2 * hh + 1)};
#pragma unroll
    for (int rg = 0; rg < RG; rg++) {
      const u32 a[4] = {word(bw[rg][0], 2 * hh), word(bw[rg][1], 2 * hh), word(bw[rg][0], 2 * hh + 1),
                        word(bw[rg][1], 2 * hh + 1)};
      MMA(acc[rg][0], a, b0);
      if (two) MMA(acc[rg][1], a, b1);
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT, 2) gemm_gemv(const gemm_params P) {
  /* Each lane's slots for x, [warp][j][h][lane]; after the main loop a
   * warp's region holds its partial sums (BM x RED_LD floats). */
  __shared__ uint4 xs[WARPS][J][2][32];
  static_assert(BM * RED_LD * 4 <= J * 2 * 32 * 16, "a warp's partial sums fit its x slots");
  gemm_work w;
  gemm_locate(P, BM, BN, w);
  const gemm_prob &p = w.p;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const i64 n0 = (i64)w.tn * BN;
  /* This lane's rows: of W, n0 + 16 rg + 8 h + g; of x, g + 8 h. */
  const smelt_h16 *wrow[RG][2], *xrow[2];
#pragma unroll
  for (int rg = 0; rg < RG; rg++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const i64 n = n0 + 16 * rg + 8 * h + g;
      wrow[rg][h] = (const smelt_h16 *)p.b + (n < p.n ? n : p.n - 1) * p.b_cs;
    }
#pragma unroll
  for (int h = 0; h < 2; h++) xrow[h] = (const smelt_h16 *)p.a + (g + 8 * h < p.m ? g + 8 * h : 0) * p.a_rs;
  const int two = p.m > 8;
  const u32 slots = smem_u32(&xs[warp][0][0][lane]);
  float acc[RG][2][4] = {};

  for (i64 kb = w.k0 + (i64)warp * CHUNK; kb < w.k1; kb += (i64)WARPS * CHUNK) {
    const i64 k = kb + 8 * t;
    if (kb + CHUNK <= w.k1) {
      uint4 bw[J][RG][2];
#pragma unroll
      for (int j = 0; j < J; j++)
#pragma unroll
        for (int rg = 0; rg < RG; rg++)
#pragma unroll
          for (int h = 0; h < 2; h++) bw[j][rg][h] = ld_stream(wrow[rg][h] + k + 32 * j);
#pragma unroll
      for (int j = 0; j < J; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
          if (h == 0 || two) cp_async_ca16(slots + (j * 2 + h) * 32 * 16, xrow[h] + k + 32 * j);
      cp_async_commit();
      CP_ASYNC_WAIT(0);
#pragma unroll
      for (int j = 0; j < J; j++) {
        uint4 ax[2];
        ax[0] = lds128(slots + (j * 2) * 32 * 16);
        ax[1] = two ? lds128(slots + (j * 2 + 1) * 32 * 16) : ax[0];
        step(acc, bw[j], ax, two);
      }
    } else {
#pragma unroll 1
      for (int j = 0; j < J; j++) {
        uint4 bw[RG][2], ax[2];
#pragma unroll
        for (int rg = 0; rg < RG; rg++)
#pragma unroll
          for (int h = 0; h < 2; h++) bw[rg][h] = ld_tail(wrow[rg][h], k + 32 * j, w.k1, p.b_rs);
#pragma unroll
        for (int h = 0; h < 2; h++) ax[h] = ld_tail(xrow[h], k + 32 * j, w.k1, p.a_cs);
        step(acc, bw, ax, two);
      }
    }
  }

  /* acc[rg][f][i] is D[8 f + 2 t + (i & 1)][n0 + 16 rg + 8 (i >> 1) + g]. */
  __syncwarp();
  float *red = (float *)&xs[warp][0][0][0];
#pragma unroll
  for (int rg = 0; rg < RG; rg++)
#pragma unroll
    for (int f = 0; f < 2; f++)
#pragma unroll
      for (int i = 0; i < 4; i++) red[(8 * f + 2 * t + (i & 1)) * RED_LD + 16 * rg + 8 * (i >> 1) + g] = acc[rg][f][i];
  __syncthreads();
  /* The warps' sums in warp order, into warp 0's region. */
  float *sum = (float *)&xs[0][0][0][0];
  for (int e = threadIdx.x; e < BM * BN; e += NT) {
    const int at = e / BN * RED_LD + e % BN;
    float s = sum[at];
#pragma unroll
    for (int v = 1; v < WARPS; v++) s += ((const float *)&xs[v][0][0][0])[at];
    sum[at] = s;
  }
  __syncthreads();
  gemm_finish(P, w, sum, RED_LD, BM, BN, NT);
}
