/* NVFP4 weights x 16-bit activations (smelt_qgemm, include/smelt/qgemm.h):
 * D [M, N] = act(alpha · x [M, K] · Wᵀ + bias), W [N, K] as E2M1 pairs
 * (q [N, K/2]), an E4M3 scale per 16 of K and an f32 tensor scale.
 *
 * Prelude: QG_DT, x's dtype (2 f16, 3 bf16); GEMM_ACC 1 (gemm_common.cuh's
 * epilogue helpers in f32). Entry points:
 *   qgemm_w4_gemv     M <= 16 (decode): bound by reading W once, 4 bits an
 *                     element, so everything serves streaming W.
 *   qgemm_w4_dequant  M > 16: W to x's dtype, e2m1 · e4m3 exactly, for
 *                     smelt's 16-bit GEMM (the host multiplies by the tensor
 *                     scale in that GEMM's epilogue).
 *
 * Decoding. Every E2M1 x E4M3 product has at most 6 significant bits and
 * lies in [2^-10, 2688], so it is exact in bf16 and f16. A code s.ee.m put
 * at the 16-bit format's sign bit and the two low exponent bits and top
 * mantissa bit is the code's value times 2^-126 (bf16) or 2^-14 (f16),
 * zero and the subnormal 0.5 included (the 16-bit subnormals do it). So a
 * 32-bit word of 8 codes gives 4 words of pairs with two shifts and two
 * masks each (word j: codes j and j + 4), and one fma.rn.{bf16,f16}x2 by
 * the scale pair multiplies in the block scale: a 256-entry table in shared
 * memory maps an E4M3 byte to its value times 2^119 (bf16) or 2^7 (f16),
 * so the products are the exact e2m1 · e4m3 · 2^-7, far from both ends of
 * the range (NaN scales stay NaN). The GEMV's epilogue multiplies by 2^7
 * and the tensor scale in f32; the dequantizer by 2^7 in the 16-bit type.
 * x is staged with the same pairing (elements j and j + 4 of every 8 in one
 * word), so the mma's k order matches W's: the sum does not depend on it.
 *
 * The GEMV. A block of 8 warps owns 128 rows of W (16 per warp, the mma's
 * A operand: rows g and g + 8, g = lane / 4) and one K slice; x's M <= 16
 * rows are the n8 B operand (one fragment, two when M > 8). K is walked in
 * chunks of 512: lane (g, t = lane % 4) loads, per row, the 16 bytes (32
 * codes) at k = chunk + 128 j + 32 t, j = 0..3, so each load instruction
 * reads 64 contiguous bytes of each of 8 rows, straight into registers
 * without L1 allocation; the chunk's 32 scale bytes of a row come as one
 * 8-byte load per lane and are handed to the lanes that use them with
 * shuffles. The block stages the chunk of x in shared memory (16 rows x
 * 1 KB, the 16-byte units XOR-swizzled so that a quarter warp's loads hit
 * eight distinct bank groups) while the weights are in flight. Three blocks
 * fit an SM, so one block's loads overlap another's decoding.
 *
 * Split K. When N is small the host cuts K into slices (gridDim.y) so that
 * the SMs stay busy; every slice writes its f32 partial sums to a
 * workspace, and the last block of a column range to arrive (an integer
 * ticket, zeroed by the host) adds the slices in slice order and applies
 * the epilogue: the same bits on every run, no float atomics.
 *
 * Fast paths need: x rows of unit stride, 16-byte aligned; q and its rows
 * 16-byte aligned; scales of unit column stride, rows 8-byte aligned (the
 * host's `vec`). Other layouts, and chunks cut by the end of a slice, load
 * element by element with zeros past the end. Rows of W past N read row
 * N - 1 and rows of x past M are zero; neither is stored.
 */
#include "gemm_common.cuh"
#include "quant_math.cuh"
#include "smelt_mma.cuh"

#if !defined(QG_DT) || (QG_DT != DT_F16 && QG_DT != DT_BF16)
#error "qgemm_w4.cu needs QG_DT 2 (f16) or 3 (bf16)"
#endif
#if GEMM_ACC != ACC_F32
#error "qgemm_w4.cu's epilogue is f32"
#endif

#define NT 256
#define WARPS (NT / 32)
#define BN (16 * WARPS)  /* rows of W (columns of D) per block */
#define J 4              /* 16-byte loads per row of W, chunk and lane */
#define CHUNK (128 * J)  /* K per chunk: 4 lanes x 32 codes x J */
#define XU (CHUNK / 8)   /* 16-byte units of x per row and chunk */
#define MR 16            /* rows of x: all of M */

static_assert(BN == 128 && CHUNK == 512, "the host's tile (src/cuda/op_qgemm.c)");

#if QG_DT == DT_BF16
#define MAG_SHIFT 6            /* a code's ee.m to bits 8..6 (and 24..22) */
#define MAG_MASK 0x01c001c0u
#define SCALE_EXP2 119         /* the table's factor: 2^119 x 2^-126 = 2^-7 */
#define TIMES_128 0x43004300u  /* 128 in both halves */
#define MMA mma_16816_bf16
#else
#define MAG_SHIFT 9            /* to bits 11..9 (and 27..25) */
#define MAG_MASK 0x0e000e00u
#define SCALE_EXP2 7           /* 2^7 x 2^-14 = 2^-7 */
#define TIMES_128 0x58005800u
#define MMA mma_16816_f16
#endif

/* The launch parameters (mirrored by qg_kparams in src/cuda/op_qgemm.c). */
typedef struct qg_params {
  u64 x, q, scale, ts, bias, d, ws, cnt;
  i64 m, n, k, x_rs, x_cs, q_rs, s_rs, s_cs, bias_s, d_rs, d_cs, k_slice;
  double alpha;
  float slope;
  int act, dt_bias, dt_d, has_bias, splits, vec, pad;
} qg_params;

static_assert(sizeof(qg_params) == 200, "qg_params must match qg_kparams");

/* ---------------------------------------------------------------- decoding */

static __device__ __forceinline__ u32 shl(u32 w, int s) { return s >= 0 ? w << s : w >> -s; }

/* Word j (0..3) of 8 E2M1 codes (code i in bits 4i..4i+3): codes j and
 * j + 4 in the low and high halves, each its value times 2^-126 (bf16) or
 * 2^-14 (f16). */
static __device__ __forceinline__ u32 e2m1_pair(u32 w, int j) {
  return (shl(w, MAG_SHIFT - 4 * j) & MAG_MASK) | (shl(w, 12 - 4 * j) & 0x80008000u);
}

/* a · b per 16-bit half, rounded to nearest (exact for every use here); -0
 * added keeps the sign of a zero product. */
static __device__ __forceinline__ u32 mul2(u32 a, u32 b) {
  u32 r;
#if QG_DT == DT_BF16
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
#else
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
#endif
  return r;
}

/* The table entry of an E4M3 scale byte: its value times 2^SCALE_EXP2 in
 * both halves (exact: 4 significant bits, within range). */
static __device__ __forceinline__ u32 scale_pair(u32 byte) {
  const float v = smelt_q_decode(byte, SMELT_Q_E4M3) * __uint_as_float((127u + SCALE_EXP2) << 23);
#if QG_DT == DT_BF16
  const u32 h = smelt_f32_to_bf16(v);
#else
  const u32 h = smelt_f32_to_f16(v);
#endif
  return h | h << 16;
}

static __device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

static __device__ __forceinline__ u32 word_of(const uint4 &v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* 8 consecutive 16-bit elements (e0 .. e7) regrouped as the decoder pairs
 * codes: (e0, e4), (e1, e5), (e2, e6), (e3, e7). */
static __device__ __forceinline__ uint4 pair_up(const uint4 &v) {
  return make_uint4(prmt(v.x, v.z, 0x5410), prmt(v.x, v.z, 0x7632), prmt(v.y, v.w, 0x5410), prmt(v.y, v.w, 0x7632));
}

/* The way back: decoded words d[0..3] in element order. */
static __device__ __forceinline__ uint4 unpair(const u32 *d) {
  return make_uint4(prmt(d[0], d[1], 0x5410), prmt(d[2], d[3], 0x5410), prmt(d[0], d[1], 0x7632),
                    prmt(d[2], d[3], 0x7632));
}

/* The 16 bytes (32 codes) of a row of q at element k, byte by byte: words
 * whose 8 codes lie at or past `end` are zero (end is a multiple of 16). */
static __device__ __forceinline__ uint4 ld_codes_tail(const unsigned char *row, i64 k, i64 end) {
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const unsigned char *p = row + k / 2 + 4 * i;
    w[i] = k + 8 * i < end ? (u32)p[0] | (u32)p[1] << 8 | (u32)p[2] << 16 | (u32)p[3] << 24 : 0u;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/* The scale bytes of the `n` blocks of 16 codes from k on (byte i of the
 * result: block i), zero past `end`. */
static __device__ __forceinline__ uint2 ld_scales_tail(const unsigned char *row, i64 cs, i64 k, i64 end, int n) {
  u32 w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; i++)
    if (i < n && k + 16 * i < end) w[i >> 2] |= (u32)row[(k / 16 + i) * cs] << (8 * (i & 3));
  return make_uint2(w[0], w[1]);
}

/* ---------------------------------------------------------------- the GEMV */

/* Unit u of x row `row` in shared memory: XOR of u's low two bits with
 * (bit 3 of u, row parity), so the 8 lanes of a quarter warp (two rows,
 * t = 0..3) reach 8 distinct bank groups. */
static __device__ __forceinline__ int xs_unit(int u, int row) { return u ^ (((u >> 2) & 2) | (row & 1)); }

/* Eight elements of a row of x at k, element by element, zeros at or past end. */
static __device__ __forceinline__ uint4 ld_x_tail(const smelt_h16 *row, i64 k, i64 end, i64 cs) {
  u32 w[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const u32 lo = k + 2 * e < end ? row[(k + 2 * e) * cs] : 0u;
    const u32 hi = k + 2 * e + 1 < end ? row[(k + 2 * e + 1) * cs] : 0u;
    w[e] = lo | hi << 16;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/* The chunk [kc, kc + CHUNK) of x's rows (8, or 16 when M > 8) into xs,
 * paired for the decoder; rows past M are zero. */
static __device__ __forceinline__ void stage_x(const qg_params &P, uint4 (*xs)[XU], i64 kc, i64 k1, int full,
                                               int rows) {
  for (int e = threadIdx.x; e < rows * XU; e += NT) {
    const int m = e / XU, u = e % XU;
    const i64 k = kc + 8 * u;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (m < P.m) {
      const smelt_h16 *row = (const smelt_h16 *)P.x + m * P.x_rs;
      v = full ? *(const uint4 *)(row + k) : ld_x_tail(row, k, k1, P.x_cs);
    }
    xs[m][xs_unit(u, m)] = pair_up(v);
  }
}

static __device__ __forceinline__ float ld_cg(const float *p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

/* D[m, n] from its sum of e2m1 · e4m3 · 2^-7 · x products. */
static __device__ __forceinline__ void store_d(const qg_params &P, i64 m, i64 n, float acc, float ts) {
  float v = acc * 128.f * ts * (float)P.alpha;
  if (P.has_bias) v += gemm_load_epi((const void *)P.bias, P.dt_bias, n * P.bias_s);
  gemm_store((void *)P.d, P.dt_d, m * P.d_rs + n * P.d_cs, gemm_act(v, P.act, P.slope), 0);
}

/* acc[f][i] is the sum for D[8 f + 2 t + (i & 1)][n0 + g + 8 (i >> 1)]:
 * stored, or (split K) left in the workspace, the last slice to arrive
 * adding all of them in slice order. */
static __device__ __forceinline__ void finish(const qg_params &P, const float (*acc)[4], i64 n0, int g, int t,
                                              int *last) {
  const float ts = *(const float *)P.ts;
  if (P.splits == 1) {
#pragma unroll
    for (int f = 0; f < 2; f++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const i64 m = 8 * f + 2 * t + (i & 1), n = n0 + g + 8 * (i >> 1);
        if (m < P.m && n < P.n) store_d(P, m, n, acc[f][i], ts);
      }
    return;
  }
  float *ws = (float *)P.ws;
#pragma unroll
  for (int f = 0; f < 2; f++)
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const i64 m = 8 * f + 2 * t + (i & 1), n = n0 + g + 8 * (i >> 1);
      if (m < P.m && n < P.n) ws[((i64)blockIdx.y * P.m + m) * P.n + n] = acc[f][i];
    }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd((int *)P.cnt + blockIdx.x, 1) == P.splits - 1;
  __syncthreads();
  if (!*last) return;
  __threadfence();
#pragma unroll
  for (int f = 0; f < 2; f++)
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const i64 m = 8 * f + 2 * t + (i & 1), n = n0 + g + 8 * (i >> 1);
      if (m >= P.m || n >= P.n) continue;
      float s = 0.f;
      for (int sl = 0; sl < P.splits; sl++) s += ld_cg(ws + ((i64)sl * P.m + m) * P.n + n);
      store_d(P, m, n, s, ts);
    }
}

/* One chunk's products: for each of the lane's J 16-byte pieces of its two
 * rows, 4 words of codes, each decoded into 4 pair words (x the block
 * scale) that are two mma steps with the matching words of x. Lane t holds
 * the 8 scale bytes of piece j = t of its rows (sraw); piece j's two bytes
 * for lane t are bytes 2t, 2t + 1 of lane j's. */
static __device__ __forceinline__ void chunk_mma(float (*acc)[4], const uint4 (*wq)[2], const uint2 *sraw,
                                                 const uint4 (*xs)[XU], const u32 *stab, int lane, int two) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < J; j++) {
    u32 sc[2][2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int src = (lane & ~3) | j;
      const u32 lo = __shfl_sync(0xffffffffu, sraw[h].x, src), hi = __shfl_sync(0xffffffffu, sraw[h].y, src);
      const u32 pair = ((t & 2) ? hi : lo) >> (16 * (t & 1));
      sc[h][0] = stab[pair & 0xffu];
      sc[h][1] = stab[(pair >> 8) & 0xffu];
    }
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int u = 16 * j + 4 * t + q;
      const uint4 xa = lds128(smem_u32(&xs[g][xs_unit(u, g)]));
      const uint4 xb = two ? lds128(smem_u32(&xs[g + 8][xs_unit(u, g + 8)])) : xa;
      u32 dw[2][4];
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const u32 w = word_of(wq[j][h], q), s = sc[h][q >> 1];
#pragma unroll
        for (int jj = 0; jj < 4; jj++) dw[h][jj] = mul2(e2m1_pair(w, jj), s);
      }
#pragma unroll
      for (int ss = 0; ss < 2; ss++) {
        const u32 a[4] = {dw[0][2 * ss], dw[1][2 * ss], dw[0][2 * ss + 1], dw[1][2 * ss + 1]};
        const u32 b0[2] = {word_of(xa, 2 * ss), word_of(xa, 2 * ss + 1)};
        MMA(acc[0], a, b0);
        if (two) {
          const u32 b1[2] = {word_of(xb, 2 * ss), word_of(xb, 2 * ss + 1)};
          MMA(acc[1], a, b1);
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT, 3) qgemm_w4_gemv(const qg_params P) {
  __shared__ __align__(16) uint4 xs[MR][XU];
  __shared__ u32 stab[256];
  __shared__ int last;
  static_assert(NT == 256, "one table entry per thread");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const i64 n0 = (i64)blockIdx.x * BN + warp * 16;
  const i64 k0 = (i64)blockIdx.y * P.k_slice, k1 = k0 + P.k_slice < P.k ? k0 + P.k_slice : P.k;
  const int two = P.m > 8;
  stab[threadIdx.x] = scale_pair(threadIdx.x);
  /* This lane's rows of W and of its scales: n0 + g and n0 + g + 8. */
  const unsigned char *wrow[2], *srow[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const i64 n = n0 + g + 8 * h, nn = n < P.n ? n : P.n - 1;
    wrow[h] = (const unsigned char *)P.q + nn * P.q_rs;
    srow[h] = (const unsigned char *)P.scale + nn * P.s_rs;
  }
  float acc[2][4] = {};

  for (i64 kc = k0; kc < k1; kc += CHUNK) {
    const int full = P.vec && kc + CHUNK <= k1;
    uint4 wq[J][2];
    uint2 sraw[2]; /* the scales of piece j = t: 8 blocks of 16 from kc + 128 t */
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
      for (int j = 0; j < J; j++)
        wq[j][h] = full ? ld_stream(wrow[h] + kc / 2 + 64 * j + 16 * t)
                        : ld_codes_tail(wrow[h], kc + 128 * j + 32 * t, k1);
      sraw[h] = full ? *(const uint2 *)(srow[h] + kc / 16 + 8 * t)
                     : ld_scales_tail(srow[h], P.s_cs, kc + 128 * t, k1, 8);
    }
    __syncthreads(); /* the previous chunk's x is used up (and the table is written) */
    stage_x(P, xs, kc, k1, full, two ? 16 : 8);
    __syncthreads();
    chunk_mma(acc, wq, sraw, xs, stab, lane, two);
  }
  finish(P, acc, n0, g, t, &last);
}

/* ---------------------------------------------------------------- the dequantizer */

/* W' [N, K] in x's dtype (P.d, row stride P.d_rs, 16-byte aligned rows) =
 * e2m1 · e4m3 exactly: a thread per 32 codes. */
extern "C" __global__ void __launch_bounds__(NT) qgemm_w4_dequant(const qg_params P) {
  __shared__ u32 stab[256];
  stab[threadIdx.x] = scale_pair(threadIdx.x);
  __syncthreads();
  const i64 per_row = (P.k + 31) / 32, total = P.n * per_row;
  for (i64 i = (i64)blockIdx.x * NT + threadIdx.x; i < total; i += (i64)gridDim.x * NT) {
    const i64 n = i / per_row, k = i % per_row * 32;
    const unsigned char *qr = (const unsigned char *)P.q + n * P.q_rs;
    const int whole = k + 32 <= P.k;
    const uint4 w = whole && P.vec ? ld_stream(qr + k / 2) : ld_codes_tail(qr, k, P.k);
    const u32 sp = ld_scales_tail((const unsigned char *)P.scale + n * P.s_rs, P.s_cs, k, P.k, 2).x;
    uint4 *out = (uint4 *)((smelt_h16 *)P.d + n * P.d_rs + k);
#pragma unroll
    for (int q = 0; q < 4; q++) {
      if (q >= 2 && !whole) break;
      const u32 c = word_of(w, q), s = stab[(sp >> (8 * (q >> 1))) & 0xffu];
      u32 d[4];
#pragma unroll
      for (int jj = 0; jj < 4; jj++) d[jj] = mul2(mul2(e2m1_pair(c, jj), s), TIMES_128);
      out[q] = unpair(d);
    }
  }
}
