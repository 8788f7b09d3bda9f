/* The SIMT GEMM: CUDA cores only, every dtype, layout, stride, epilogue and
 * mode. It serves f64, exact f32, the f16 accumulator, and every operand the
 * tensor-core kernels cannot take (mixed dtypes, unaligned or general
 * strides): the safety net, correct first and reasonably fast second.
 *
 * Prelude: GEMM_ACC (1 f32, 2 f16, 3 f64, 4 i32). Operand dtypes are
 * run-time: tiles are converted to the multiply type (in_t) once, on their
 * way into shared memory, so the inner loop is plain FMAs.
 *
 * A 256-thread block computes a 64 x 64 output tile, 16 of K at a time;
 * thread (tx, ty) of a 16 x 16 grid owns rows ty + 16 i and columns
 * tx + 16 j (i, j < 4): a warp reads two A values (broadcast) and 16
 * consecutive B values per k, without bank conflicts. The next K tile is
 * read from global memory into registers while the current one is
 * multiplied. The finished tile goes through shared memory to gemm_finish.
 * Two blocks per SM is asked for explicitly: left to itself, ptxas for
 * sm_90 caps this kernel at 64 registers and spills.
 */
#include "gemm_common.cuh"

#define BM 64
#define BN 64
#define BK 16
#define NT 256
#define TM 4
#define TN 4
#define LOADS (BM * BK / NT) /* elements of A (and of B) each thread moves per K tile */

#if GEMM_ACC == ACC_F64
typedef double in_t;
typedef double acc_t;
#elif GEMM_ACC == ACC_F32
typedef float in_t;
typedef float acc_t;
#elif GEMM_ACC == ACC_F16
typedef smelt_h16 in_t; /* f16 bits: products and sums round to f16 */
typedef smelt_h16 acc_t;
#elif GEMM_ACC == ACC_I32
typedef int in_t;
typedef int acc_t;
#else
#error "GEMM_ACC must be 1, 2, 3 or 4"
#endif

/* An operand element in the multiply type. */
static __device__ __forceinline__ in_t load_in(const void *base, int dt, i64 off) {
#if GEMM_ACC == ACC_F64
  (void)dt;
  return ((const double *)base)[off];
#elif GEMM_ACC == ACC_F32
  return gemm_loadf(base, dt, off);
#elif GEMM_ACC == ACC_F16
  (void)dt;
  return ((const smelt_h16 *)base)[off];
#else
  (void)dt;
  return (int)((const signed char *)base)[off];
#endif
}

static __device__ __forceinline__ acc_t mul_add(in_t a, in_t b, acc_t c) {
#if GEMM_ACC == ACC_F16
  smelt_h16 r;
  asm("fma.rn.f16 %0, %1, %2, %3;" : "=h"(r) : "h"(a), "h"(b), "h"(c));
  return r;
#elif GEMM_ACC == ACC_I32
  /* Wraps past 2^31 like the tensor cores' s32 accumulator (unsigned: defined). */
  return (int)((u32)c + (u32)(a * b));
#else
  return a * b + c;
#endif
}

static __device__ __forceinline__ ws_t acc_to_ws(acc_t v) {
#if GEMM_ACC == ACC_F16
  return smelt_f16_to_f32(v);
#else
  return v;
#endif
}

/* The K tiles, and after the main loop the output tile (see gemm_finish). */
union simt_smem {
  struct {
    in_t a[BK][BM + 1]; /* +1: a K-contiguous operand's transposing stores would hit one bank 16 times */
    in_t b[BK][BN + 1];
  } k;
  ws_t out[BM][BN + 1];
};

extern "C" __global__ void __launch_bounds__(NT, 2) gemm_simt(const gemm_params P EPI_KPARAM) {
  __shared__ union simt_smem sm;
  gemm_work w;
  gemm_locate(P, BM, BN, w);
  if (w.tm < 0) return; /* grouped by offsets: no tile for this block */
  const gemm_prob &p = w.p;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const i64 m0 = (i64)w.tm * BM, n0 = (i64)w.tn * BN;
  const void *A = (const void *)p.a;
  const void *B = (const void *)p.b;
  /* Which index runs fastest across threads when loading: the one with unit
   * stride in memory, so a warp's loads coalesce. */
  const int a_kfast = p.a_cs == 1, b_nfast = p.b_cs == 1;

  acc_t acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; i++)
#pragma unroll
    for (int j = 0; j < TN; j++) acc[i][j] = (acc_t)0;

  in_t ra[LOADS], rb[LOADS];
  /* Reads K tile kt into ra/rb (zeros outside A and B). */
#define LOAD_TILE(kt)                                                                    \
  do {                                                                                   \
    _Pragma("unroll") for (int l = 0; l < LOADS; l++) {                                  \
      const int e = tid + l * NT;                                                        \
      int mm = a_kfast ? e / BK : e % BM, kk = a_kfast ? e % BK : e / BM;                \
      i64 gm = m0 + mm, gk = (kt) + kk;                                                  \
      ra[l] = gm < p.m && gk < w.k1 ? load_in(A, P.dt_a, gm * p.a_rs + gk * p.a_cs) : (in_t)0; \
      int nn = b_nfast ? e % BN : e / BK, kb = b_nfast ? e / BN : e % BK;                \
      i64 gn = n0 + nn, gkb = (kt) + kb;                                                 \
      rb[l] = gn < p.n && gkb < w.k1 ? load_in(B, P.dt_b, gkb * p.b_rs + gn * p.b_cs) : (in_t)0; \
    }                                                                                    \
  } while (0)

  if (w.k0 < w.k1) LOAD_TILE(w.k0);
  for (i64 kt = w.k0; kt < w.k1; kt += BK) {
#pragma unroll
    for (int l = 0; l < LOADS; l++) {
      const int e = tid + l * NT;
      sm.k.a[a_kfast ? e % BK : e / BM][a_kfast ? e / BK : e % BM] = ra[l];
      sm.k.b[b_nfast ? e / BN : e % BK][b_nfast ? e % BN : e / BK] = rb[l];
    }
    __syncthreads();
    if (kt + BK < w.k1) LOAD_TILE(kt + BK);
#pragma unroll
    for (int kk = 0; kk < BK; kk++) {
      in_t a[TM], b[TN];
#pragma unroll
      for (int i = 0; i < TM; i++) a[i] = sm.k.a[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < TN; j++) b[j] = sm.k.b[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = mul_add(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#undef LOAD_TILE

  /* Element (i, j) of this thread's tile is D[m0 + ty + 16 i, n0 + tx + 16 j];
   * the last __syncthreads of the loop freed the K tiles. */
#pragma unroll
  for (int i = 0; i < TM; i++)
#pragma unroll
    for (int j = 0; j < TN; j++) sm.out[ty + 16 * i][tx + 16 * j] = acc_to_ws(acc[i][j]);
  __syncthreads();
  gemm_finish(P, w, &sm.out[0][0], BN + 1, BM, BN, NT EPI_ARG);
}
