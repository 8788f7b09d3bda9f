/* The Ampere-class tensor-core GEMM (sm_80 and later, Hopper included):
 * mma.sync with ldmatrix fragment loads and a cp.async multistage pipeline.
 *
 * Prelude:
 *   GEMM_ACC      1 (f32) or 4 (i32)
 *   GEMM_TC       1 f16, 2 bf16, 3 tf32, 4 3xtf32, 5 i8, 6 fp8
 *   GEMM_FP8_A/B  4 (e4m3) or 5 (e5m2), with GEMM_TC 6
 *   GEMM_A_KMAJOR 1: A's K has unit stride (row-major A); 0: M has (column-major)
 *   GEMM_B_KMAJOR 1: B's K has unit stride (column-major B); 0: N has (row-major)
 *   GEMM_BM, GEMM_BN, GEMM_WM, GEMM_WN, GEMM_STAGES: block tile, warp grid, pipeline depth
 * The host guarantees: operands 16-byte aligned (pointers and every stride
 * but the unit one), 8-bit operands K-major, split-K slices a multiple of BK.
 *
 * Every K tile is 64 bytes of K: BK = 32 f16/bf16, 16 tf32, 64 i8/fp8, and
 * one mma k-step eats 32 bytes (m16n8k16 f16, m16n8k8 tf32, m16n8k32 8-bit),
 * so the fragment layouts in bytes are the same for every type and a stage
 * is (BM + BN) x 64 bytes whichever way an operand is stored:
 *   K-major tile: a row of 64 bytes per m (or n): four 16-byte chunks, chunk
 *     c of row r stored at chunk c ^ ((r >> 1) & 3), so the 8 rows one
 *     ldmatrix reads land in 8 different 16-byte bank groups;
 *   MN-major tile: a row of BM (BN) elements per k, chunk c of row k stored
 *     at chunk c ^ (k & 7), read with ldmatrix.trans (16-bit) or 32-bit loads
 *     (tf32).
 * Rows past M/N and K past the slice's end are zero-filled by cp.async's
 * source size, so ragged edges need no other care. After the main loop the
 * accumulators go through shared memory (the stages' space) to gemm_finish.
 *
 * fp8 on sm_89 and later is the native e4m3/e5m2 mma. On sm_80, which has
 * none, each fp8 byte becomes an f16 with the same bits shifted (e5m2 is the
 * top byte of an f16 exactly; e4m3 becomes its value times 2^-8, undone in
 * the epilogue), and the k32 fragments feed two f16 k16 mmas: both operands
 * see the same permutation of k, which leaves the sum unchanged.
 * tf32 rounds each f32 operand to the nearest tf32 (cvt.rna) in registers.
 * 3xtf32 splits each f32 x into big = rna(x) and small = rna(x - big) (x -
 * big is exact) and adds small*big + big*small + big*big, which recovers
 * about f32 accuracy; each k-step's three products are summed apart and
 * added to the accumulators with f32 adds (mma_step says why).
 */
#include "gemm_common.cuh"
#include "smelt_mma.cuh"

#define TC_F16 1
#define TC_BF16 2
#define TC_TF32 3
#define TC_3XTF32 4
#define TC_I8 5
#define TC_FP8 6

#if !defined(GEMM_TC) || !defined(GEMM_A_KMAJOR) || !defined(GEMM_B_KMAJOR) || !defined(GEMM_BM) || \
    !defined(GEMM_BN) || !defined(GEMM_WM) || !defined(GEMM_WN) || !defined(GEMM_STAGES)
#error "gemm_sm80.cu needs GEMM_TC, GEMM_A_KMAJOR, GEMM_B_KMAJOR, GEMM_BM, GEMM_BN, GEMM_WM, GEMM_WN, GEMM_STAGES"
#endif

#if GEMM_TC == TC_F16 || GEMM_TC == TC_BF16
#define ESIZE 2
#elif GEMM_TC == TC_TF32 || GEMM_TC == TC_3XTF32
#define ESIZE 4
#else
#define ESIZE 1
#endif

#define BM GEMM_BM
#define BN GEMM_BN
#define BK (64 / ESIZE)
#define CE (16 / ESIZE) /* elements per 16-byte chunk */
#define NT (GEMM_WM * GEMM_WN * 32)
#define WTM (BM / GEMM_WM) /* warp tile */
#define WTN (BN / GEMM_WN)
#define MI (WTM / 16) /* m16 fragments per warp */
#define NI (WTN / 8)  /* n8 fragments per warp */
#define STAGE_BYTES ((BM + BN) * 64)
/* Two blocks per SM (at most 128 registers for 256 threads) where that
 * costs no spills; tf32 and fp8 fragments need more registers. */
#define MIN_BLOCKS (ESIZE == 2 || GEMM_TC == TC_I8 ? 2 : 1)
#define OUT_LD (BN + 8) /* row stride of the output tile in shared memory */
/* Dynamic shared memory: the stages, reused for the output tile. */
#define SMEM_BYTES (GEMM_STAGES * STAGE_BYTES > BM * OUT_LD * 4 ? GEMM_STAGES * STAGE_BYTES : BM * OUT_LD * 4)

static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tiles are multiples of 16");
static_assert((BM * 4) % NT == 0 && (BN * 4) % NT == 0, "every thread copies the same number of chunks");
#if ESIZE == 1 && !(GEMM_A_KMAJOR && GEMM_B_KMAJOR)
#error "8-bit operands must be K-major"
#endif
#if GEMM_TC == TC_I8
#if GEMM_ACC != ACC_I32
#error "i8 accumulates in i32"
#endif
typedef int accv_t;
#else
#if GEMM_ACC != ACC_F32
#error "float tensor ops accumulate in f32"
#endif
typedef float accv_t;
#endif

/* sm_80 has no fp8 mma: convert to f16 (see the top). */
#if GEMM_TC == TC_FP8 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define FP8_VIA_F16 1
#else
#define FP8_VIA_F16 0
#endif

/* ---------------------------------------------------------------- PTX wrappers */

static __device__ __forceinline__ u32 to_tf32(u32 x) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(x)));
  return r;
}

/* d += a * b for one m16n8 fragment. */
static __device__ __forceinline__ void mma_f16(float *d, const u32 *a, const u32 *b) {
#if GEMM_TC == TC_BF16
  mma_16816_bf16(d, a, b);
#else
  mma_16816_f16(d, a, b);
#endif
}

#if GEMM_TC == TC_TF32 || GEMM_TC == TC_3XTF32
static __device__ __forceinline__ void mma_tf32(float *d, const u32 *a, const u32 *b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

#if GEMM_TC == TC_I8
static __device__ __forceinline__ void mma_i8(int *d, const u32 *a, const u32 *b) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

#if GEMM_TC == TC_FP8
#if !FP8_VIA_F16
#if GEMM_FP8_A == DT_E4M3 && GEMM_FP8_B == DT_E4M3
#define MMA_FP8_TYPES "e4m3.e4m3"
#elif GEMM_FP8_A == DT_E4M3
#define MMA_FP8_TYPES "e4m3.e5m2"
#elif GEMM_FP8_B == DT_E4M3
#define MMA_FP8_TYPES "e5m2.e4m3"
#else
#define MMA_FP8_TYPES "e5m2.e5m2"
#endif
static __device__ __forceinline__ void mma_fp8(float *d, const u32 *a, const u32 *b) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." MMA_FP8_TYPES ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
/* Two fp8 bytes (bits 0-7 and 8-15 of v) as an f16x2. */
static __device__ __forceinline__ u32 fp8x2_f16x2(u32 v, int dt) {
  u32 out = 0;
#pragma unroll
  for (int i = 0; i < 2; i++) {
    u32 b = (v >> (8 * i)) & 0xffu, h;
    if (dt == DT_E5M2) h = b << 8;
    else if ((b & 0x7fu) == 0x7fu) h = ((b & 0x80u) << 8) | 0x7e00u; /* NaN */
    else h = ((b & 0x80u) << 8) | ((b & 0x7fu) << 7);
    out |= h << (16 * i);
  }
  return out;
}
#endif
#endif

/* ---------------------------------------------------------------- global -> shared */

/* A K-major tile: `rows` rows (m or n) of BK elements from row r0 of X
 * (row stride ld elements), K from kt; rval rows and K up to k1 are real. */
static __device__ __forceinline__ void copy_kmajor(u32 s, const char *X, i64 ld, i64 r0, i64 rval, i64 kt, i64 k1,
                                                   int rows, int tid) {
#pragma unroll
  for (int i = 0; i < rows * 4 / NT; i++) {
    const int c = tid + i * NT, row = c >> 2, ch = c & 3;
    const i64 gk = kt + ch * CE, rem = k1 - gk;
    int bytes = row < rval ? (rem >= CE ? 16 : rem > 0 ? (int)rem * ESIZE : 0) : 0;
    const char *src = bytes ? X + ((r0 + row) * ld + gk) * ESIZE : X;
    cp_async16(s + row * 64 + ((ch ^ ((row >> 1) & 3)) << 4), src, bytes);
  }
}

/* An MN-major tile: BK rows (k) of `cols` elements from column o0 of X (row
 * stride ld elements, along k); oval columns and K up to k1 are real. */
static __device__ __forceinline__ void copy_mnmajor(u32 s, const char *X, i64 ld, i64 o0, i64 oval, i64 kt, i64 k1,
                                                    int cols, int tid) {
  const int rowch = cols * ESIZE / 16; /* chunks per row (>= 8) */
#pragma unroll
  for (int i = 0; i < cols * 4 / NT; i++) {
    const int c = tid + i * NT, krow = c / rowch, ch = c % rowch;
    const i64 gk = kt + krow, rem = oval - (i64)ch * CE;
    int bytes = gk < k1 ? (rem >= CE ? 16 : rem > 0 ? (int)rem * ESIZE : 0) : 0;
    const char *src = bytes ? X + (gk * ld + o0 + (i64)ch * CE) * ESIZE : X;
    cp_async16(s + krow * (cols * ESIZE) + ((ch ^ (krow & 7)) << 4), src, bytes);
  }
}

#if defined(GEMM_CONV)
#include "conv2d_igemm.cuh" /* conv2d as implicit GEMM: the gathered operand's loads; smelt-key: if GEMM_CONV */
#else
#define GEMM_CONV_PARAM
#endif

/* Byte offset of element (k, x) of an MN-major tf32 tile `cols` wide. */
static __device__ __forceinline__ u32 mn32_off(int k, int x, int cols) {
  return (u32)(k * cols * 4 + (((x >> 2) ^ (k & 7)) << 4) + ((x & 3) << 2));
}

/* ---------------------------------------------------------------- fragments */

/* A fragments of k-step ks (32 bytes of K) for this warp's MI m16 tiles. */
static __device__ __forceinline__ void frag_a(u32 sa, int ks, int wm0, int lane, u32 (*af)[4]) {
#pragma unroll
  for (int mi = 0; mi < MI; mi++) {
#if GEMM_A_KMAJOR
    const int row = wm0 + mi * 16 + (lane & 15), ch = ks * 2 + (lane >> 4);
    ldsm_x4(sa + row * 64 + ((ch ^ ((row >> 1) & 3)) << 4), af[mi]);
#elif ESIZE == 2
    const int k = ks * 16 + (lane & 7) + ((lane >> 4) << 3), m = wm0 + mi * 16 + (((lane >> 3) & 1) << 3);
    ldsm_x4_t(sa + k * (BM * 2) + (((m >> 3) ^ (k & 7)) << 4), af[mi]);
#else
    const int m = wm0 + mi * 16 + (lane >> 2), k = ks * 8 + (lane & 3);
    af[mi][0] = lds32(sa + mn32_off(k, m, BM));
    af[mi][1] = lds32(sa + mn32_off(k, m + 8, BM));
    af[mi][2] = lds32(sa + mn32_off(k + 4, m, BM));
    af[mi][3] = lds32(sa + mn32_off(k + 4, m + 8, BM));
#endif
  }
}

/* B fragments of k-step ks for this warp's NI n8 tiles. */
static __device__ __forceinline__ void frag_b(u32 sb, int ks, int wn0, int lane, u32 (*bf)[2]) {
#if GEMM_B_KMAJOR || ESIZE == 2
#pragma unroll
  for (int nj = 0; nj < NI / 2; nj++) {
    u32 r[4];
#if GEMM_B_KMAJOR
    const int n = wn0 + nj * 16 + (lane & 7) + ((lane >> 4) << 3), ch = ks * 2 + ((lane >> 3) & 1);
    ldsm_x4(sb + n * 64 + ((ch ^ ((n >> 1) & 3)) << 4), r);
#else
    const int k = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), n = wn0 + nj * 16 + ((lane >> 4) << 3);
    ldsm_x4_t(sb + k * (BN * 2) + (((n >> 3) ^ (k & 7)) << 4), r);
#endif
    bf[2 * nj][0] = r[0];
    bf[2 * nj][1] = r[1];
    bf[2 * nj + 1][0] = r[2];
    bf[2 * nj + 1][1] = r[3];
  }
#else
#pragma unroll
  for (int ni = 0; ni < NI; ni++) {
    const int n = wn0 + ni * 8 + (lane >> 2), k = ks * 8 + (lane & 3);
    bf[ni][0] = lds32(sb + mn32_off(k, n, BN));
    bf[ni][1] = lds32(sb + mn32_off(k + 4, n, BN));
  }
#endif
}

/* acc += the products of one k-step's fragments. */
static __device__ __forceinline__ void mma_step(accv_t (*acc)[NI][4], u32 (*af)[4], u32 (*bf)[2]) {
#if GEMM_TC == TC_TF32
#pragma unroll
  for (int mi = 0; mi < MI; mi++)
#pragma unroll
    for (int i = 0; i < 4; i++) af[mi][i] = to_tf32(af[mi][i]);
#pragma unroll
  for (int ni = 0; ni < NI; ni++) {
    bf[ni][0] = to_tf32(bf[ni][0]);
    bf[ni][1] = to_tf32(bf[ni][1]);
  }
#elif GEMM_TC == TC_3XTF32
  u32 as[MI][4], bs[NI][2]; /* the small parts; af, bf become the big ones */
#pragma unroll
  for (int mi = 0; mi < MI; mi++)
#pragma unroll
    for (int i = 0; i < 4; i++) {
      u32 big = to_tf32(af[mi][i]);
      as[mi][i] = to_tf32(__float_as_uint(__uint_as_float(af[mi][i]) - __uint_as_float(big)));
      af[mi][i] = big;
    }
#pragma unroll
  for (int ni = 0; ni < NI; ni++)
#pragma unroll
    for (int i = 0; i < 2; i++) {
      u32 big = to_tf32(bf[ni][i]);
      bs[ni][i] = to_tf32(__float_as_uint(__uint_as_float(bf[ni][i]) - __uint_as_float(big)));
      bf[ni][i] = big;
    }
#endif
#pragma unroll
  for (int mi = 0; mi < MI; mi++)
#pragma unroll
    for (int ni = 0; ni < NI; ni++) {
#if GEMM_TC == TC_F16 || GEMM_TC == TC_BF16
      mma_f16(acc[mi][ni], af[mi], bf[ni]);
#elif GEMM_TC == TC_TF32
      mma_tf32(acc[mi][ni], af[mi], bf[ni]);
#elif GEMM_TC == TC_3XTF32
      /* The k-step's three products into a fresh accumulator, small ones
       * first (the big one would swamp them), then added to acc with f32
       * adds: the mma's own sum truncates, so a running total kept inside
       * it loses about half a unit toward zero per mma, a bias growing
       * with K (5.7e-5 at K 8192 on H100); a k-step's own sum is small, its
       * truncation random in sign. */
      float t[4] = {0.f, 0.f, 0.f, 0.f};
      mma_tf32(t, as[mi], bf[ni]);
      mma_tf32(t, af[mi], bs[ni]);
      mma_tf32(t, af[mi], bf[ni]);
#pragma unroll
      for (int i = 0; i < 4; i++) acc[mi][ni][i] += t[i];
#elif GEMM_TC == TC_I8
      mma_i8(acc[mi][ni], af[mi], bf[ni]);
#elif !FP8_VIA_F16
      mma_fp8(acc[mi][ni], af[mi], bf[ni]);
#else
      /* k32 fragment -> two k16 ones; low byte pairs hold fp8 k 4t, 4t+1 and
       * high pairs 4t+2, 4t+3, matched between A and B. */
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const u32 a0 = af[mi][2 * h], a1 = af[mi][2 * h + 1], b0 = bf[ni][h];
        u32 a[4] = {fp8x2_f16x2(a0, GEMM_FP8_A), fp8x2_f16x2(a1, GEMM_FP8_A), fp8x2_f16x2(a0 >> 16, GEMM_FP8_A),
                    fp8x2_f16x2(a1 >> 16, GEMM_FP8_A)};
        u32 b[2] = {fp8x2_f16x2(b0, GEMM_FP8_B), fp8x2_f16x2(b0 >> 16, GEMM_FP8_B)};
        mma_f16(acc[mi][ni], a, b);
      }
#endif
    }
}

/* ---------------------------------------------------------------- the kernel */

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS) gemm_tc(const gemm_params P GEMM_CONV_PARAM EPI_KPARAM) {
  extern __shared__ __align__(128) unsigned char smem[];
  gemm_work w;
  gemm_locate(P, BM, BN, w);
  if (w.tm < 0) return; /* grouped by offsets: no tile for this block */
  const gemm_prob &p = w.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm0 = (warp % GEMM_WM) * WTM, wn0 = (warp / GEMM_WM) * WTN;
  const i64 m0 = (i64)w.tm * BM, n0 = (i64)w.tn * BN;
  const char *A = (const char *)p.a, *B = (const char *)p.b;
  const i64 lda = GEMM_A_KMAJOR ? p.a_rs : p.a_cs, ldb = GEMM_B_KMAJOR ? p.b_cs : p.b_rs;
  const i64 mval = p.m - m0, nval = p.n - n0;
  const int ktiles = (int)((w.k1 - w.k0 + BK - 1) / BK);
  const u32 s0 = smem_u32(smem);

  accv_t acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; mi++)
#pragma unroll
    for (int ni = 0; ni < NI; ni++)
#pragma unroll
      for (int i = 0; i < 4; i++) acc[mi][ni][i] = (accv_t)0;

  /* Stage s: A at s0 + s * STAGE_BYTES, B after it. A conv's gathered
   * operand takes its own loads (conv2d_igemm.cuh). */
#if GEMM_CONV == 1 || GEMM_CONV == 2
  conv_arows ra;
  conv_arows_init(G, m0, p.m, tid, ra);
#define LOAD_A(sa_, kt) conv_load_a(sa_, G, ra, (kt), w.k1, tid)
#elif GEMM_A_KMAJOR
#define LOAD_A(sa_, kt) copy_kmajor(sa_, A, lda, m0, mval, (kt), w.k1, BM, tid)
#else
#define LOAD_A(sa_, kt) copy_mnmajor(sa_, A, lda, m0, mval, (kt), w.k1, BM, tid)
#endif
#if GEMM_CONV == 2
#define LOAD_B(sb_, kt) conv_load_b(sb_, G, n0, nval, (kt), w.k1, tid)
#elif GEMM_CONV == 3
  conv_bcol cb;
  conv_bcol_init(G, n0, nval, tid, cb);
#define LOAD_B(sb_, kt) conv_load_b(sb_, G, cb, (kt), w.k1, tid)
#elif GEMM_B_KMAJOR
#define LOAD_B(sb_, kt) copy_kmajor(sb_, B, ldb, n0, nval, (kt), w.k1, BN, tid)
#else
#define LOAD_B(sb_, kt) copy_mnmajor(sb_, B, ldb, n0, nval, (kt), w.k1, BN, tid)
#endif
#define LOAD_STAGE(stage, kt)                                                                      \
  do {                                                                                             \
    const u32 sa_ = s0 + (stage) * STAGE_BYTES;                                                    \
    LOAD_A(sa_, kt);                                                                               \
    LOAD_B(sa_ + BM * 64, kt);                                                                     \
  } while (0)

#pragma unroll
  for (int s = 0; s < GEMM_STAGES - 1; s++) {
    if (s < ktiles) LOAD_STAGE(s, w.k0 + (i64)s * BK);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; kt++) {
    /* Tile kt has landed once at most STAGES - 2 newer groups are pending. */
    CP_ASYNC_WAIT(GEMM_STAGES - 2);
    __syncthreads();
    /* Refill the stage every thread finished reading in the previous step. */
    const int next = kt + GEMM_STAGES - 1;
    if (next < ktiles) LOAD_STAGE(next % GEMM_STAGES, w.k0 + (i64)next * BK);
    cp_async_commit();
    const u32 sa = s0 + (kt % GEMM_STAGES) * STAGE_BYTES, sb = sa + BM * 64;
    /* 3xtf32's per-step sums need registers of their own: overlapping the
     * two k-steps as well spilled (ptxas: 254 registers and 40-56 bytes of
     * spill for RC and CR, none rolled). */
#if GEMM_TC == TC_3XTF32
#pragma unroll 1
#else
#pragma unroll
#endif
    for (int ks = 0; ks < 2; ks++) {
      u32 af[MI][4], bf[NI][2];
      frag_a(sa, ks, wm0, lane, af);
      frag_b(sb, ks, wn0, lane, bf);
      mma_step(acc, af, bf);
    }
  }
#undef LOAD_STAGE
#undef LOAD_A
#undef LOAD_B
  CP_ASYNC_WAIT(0);

  /* The stages are free once every warp is past its last mma. Fragment
   * element i of (mi, ni) is tile row wm0 + mi*16 + lane/4 + 8*(i/2), column
   * wn0 + ni*8 + 2*(lane%4) + i%2; rows are OUT_LD wide, whose 8-word pad puts
   * the 8 rows of one store in different banks. */
  __syncthreads();
  ws_t *out = (ws_t *)smem;
#if FP8_VIA_F16
  /* Undo the 2^-8 of each e4m3 operand (exact: a power of two). */
  const float fix = (GEMM_FP8_A == DT_E4M3 ? 256.f : 1.f) * (GEMM_FP8_B == DT_E4M3 ? 256.f : 1.f);
#endif
#pragma unroll
  for (int mi = 0; mi < MI; mi++)
#pragma unroll
    for (int ni = 0; ni < NI; ni++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int r = wm0 + mi * 16 + (lane >> 2) + 8 * h, c = wn0 + ni * 8 + 2 * (lane & 3);
#if FP8_VIA_F16
        out[r * OUT_LD + c] = acc[mi][ni][2 * h] * fix;
        out[r * OUT_LD + c + 1] = acc[mi][ni][2 * h + 1] * fix;
#else
        out[r * OUT_LD + c] = acc[mi][ni][2 * h];
        out[r * OUT_LD + c + 1] = acc[mi][ni][2 * h + 1];
#endif
      }
  __syncthreads();
  gemm_finish(P, w, out, OUT_LD, BM, BN, NT EPI_ARG);
}
