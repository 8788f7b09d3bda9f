/* Conv2d as implicit GEMM on the mma.sync kernel: gemm_sm80.cu includes
 * this file when GEMM_CONV is set, and the one operand that is a gather of
 * an NHWC tensor is loaded by the functions here instead of the plain tile
 * copies; everything else (pipeline, fragments, split-K, the epilogue) is
 * the GEMM's. The GEMMs (smelt/conv2d.h's table):
 *   GEMM_CONV 1, fprop: M = NPQ, N = K, K = (r, s, c); A gathered from x
 *     (K-major, as a row-major A), B = w [K, RSC] K-major, a plain operand.
 *   GEMM_CONV 2, dgrad: M = NHW, N = C, K = (r, s, k); A gathered from dy
 *     (K-major), B gathered from w (row (r, s, k) is w[k, r, s, :], MN-major).
 *   GEMM_CONV 3, wgrad: M = K, N = (r, s, c), K = NPQ; A = dy as [NPQ, K]
 *     read MN-major, a plain operand; B gathered from x (MN-major).
 * The host guarantees: 16-bit operands; the gathered tensors' channels
 * (C, or K for dgrad's dy) a multiple of 8 with unit stride and every
 * other stride and pointer 16-byte aligned, so one 16-byte chunk never
 * crosses a tap; every index below fits an int; K slices a multiple of BK.
 * A chunk whose tap falls in the padding (or, for a strided dgrad, between
 * the stride's steps) is zero-filled by cp.async's source size, as the
 * GEMM's ragged edges are. The tap of a chunk is found by division (the
 * analytic iterator); each thread's rows (or columns) are fixed for the
 * whole run, so their coordinates are computed once, before the loop. */
#ifndef SMELT_CONV2D_IGEMM_CUH
#define SMELT_CONV2D_IGEMM_CUH

#if GEMM_CONV < 1 || GEMM_CONV > 3 || ESIZE != 2
#error "GEMM_CONV is 1 (fprop), 2 (dgrad) or 3 (wgrad), with 16-bit operands"
#endif

/* The geometry (mirrored by smelt__conv_kgeom in src/cuda/conv2d_igemm.c). */
typedef struct conv_geom {
  u64 x;                /* the gathered tensor: x (fprop, wgrad) or dy (dgrad) */
  i64 xs_n, xs_h, xs_w; /* its strides in elements; its channels have unit stride */
  u64 wt;               /* dgrad: the filter w [K, R, S, C] */
  i64 ws_k, ws_r, ws_s; /* dgrad: its strides (C has unit stride) */
  int xh, xw, xc;       /* the gathered tensor's spatial extents and channels */
  int oh, ow;           /* the spatial extents of the GEMM's rows (fprop: P, Q; dgrad: H, W) or, for wgrad,
                           of its K (P, Q) */
  int r, s;
  int pad_h, pad_w, st_h, st_w, dil_h, dil_w;
  int pad;
} conv_geom;

static_assert(sizeof(conv_geom) == 120, "conv_geom must match smelt__conv_kgeom");

#define GEMM_CONV_PARAM , const conv_geom G

#if GEMM_CONV == 1 || GEMM_CONV == 2
/* ---------------------------------------------------------------- A gathered (fprop, dgrad) */

/* A thread's A chunks (copy_kmajor's pattern): rows (tid + i NT) / 4, all
 * at chunk tid % 4 of the tile's K. */
#define CONV_AR (BM * 4 / NT)

/* Per row: the image's offset and the row's window origin (fprop: the
 * top-left tap p·stride − pad; dgrad: h + pad, from which a tap r reaches
 * output row (h + pad − r·dil) / stride); ok bit i: row i is real. */
typedef struct conv_arows {
  i64 base[CONV_AR];
  int y[CONV_AR], x[CONV_AR];
  unsigned ok;
} conv_arows;

static __device__ __forceinline__ void conv_arows_init(const conv_geom &G, i64 m0, i64 M, int tid, conv_arows &ra) {
  const int hw = G.oh * G.ow;
  ra.ok = 0;
#pragma unroll
  for (int i = 0; i < CONV_AR; i++) {
    const i64 m = m0 + ((tid + i * NT) >> 2);
    const int real = m < M;
    const int mm = real ? (int)m : 0, n = mm / hw, rem = mm - n * hw, oy = rem / G.ow, ox = rem - oy * G.ow;
    ra.base[i] = (i64)n * G.xs_n;
#if GEMM_CONV == 1
    ra.y[i] = oy * G.st_h - G.pad_h;
    ra.x[i] = ox * G.st_w - G.pad_w;
#else
    ra.y[i] = oy + G.pad_h;
    ra.x[i] = ox + G.pad_w;
#endif
    ra.ok |= (unsigned)real << i;
  }
}

/* A's K tile from kt (K ends at k1) into the stage at s. */
static __device__ __forceinline__ void conv_load_a(u32 s, const conv_geom &G, const conv_arows &ra, i64 kt, i64 k1,
                                                   int tid) {
  const int ch = tid & 3;
  const i64 gk = kt + ch * CE;
  const int kin = gk < k1;
  const int g = kin ? (int)gk : 0, rs = g / G.xc, c = g - rs * G.xc, r = rs / G.s, sx = rs - r * G.s;
#pragma unroll
  for (int i = 0; i < CONV_AR; i++) {
    const int row = (tid + i * NT) >> 2;
#if GEMM_CONV == 1
    const int y = ra.y[i] + r * G.dil_h, x = ra.x[i] + sx * G.dil_w;
    const int ok = kin && ((ra.ok >> i) & 1) && (unsigned)y < (unsigned)G.xh && (unsigned)x < (unsigned)G.xw;
#else
    const int yy = ra.y[i] - r * G.dil_h, xx = ra.x[i] - sx * G.dil_w;
    const int y = yy / G.st_h, x = xx / G.st_w;
    const int ok = kin && ((ra.ok >> i) & 1) && yy >= 0 && xx >= 0 && y * G.st_h == yy && x * G.st_w == xx &&
                   y < G.xh && x < G.xw;
#endif
    const char *src = ok ? (const char *)G.x + (ra.base[i] + (i64)y * G.xs_h + (i64)x * G.xs_w + c) * ESIZE
                         : (const char *)G.x;
    cp_async16(s + row * 64 + ((ch ^ ((row >> 1) & 3)) << 4), src, ok ? 16 : 0);
  }
}
#endif

#if GEMM_CONV == 2
/* ---------------------------------------------------------------- B gathered (dgrad) */

/* B's K tile from kt: row (r, s, k) of BN filter channels from column n0
 * (nval real), copy_mnmajor's layout. dy's channels G.xc are w's K. */
static __device__ __forceinline__ void conv_load_b(u32 s, const conv_geom &G, i64 n0, i64 nval, i64 kt, i64 k1,
                                                   int tid) {
  const int rowch = BN * ESIZE / 16;
#pragma unroll
  for (int i = 0; i < BN * 4 / NT; i++) {
    const int cc = tid + i * NT, krow = cc / rowch, ch = cc % rowch;
    const i64 gk = kt + krow;
    const int ok = gk < k1 && nval - (i64)ch * CE > 0;
    const int g = ok ? (int)gk : 0, rs = g / G.xc, k = g - rs * G.xc, r = rs / G.s, sx = rs - r * G.s;
    const char *src = ok ? (const char *)G.wt +
                               ((i64)k * G.ws_k + (i64)r * G.ws_r + (i64)sx * G.ws_s + n0 + (i64)ch * CE) * ESIZE
                         : (const char *)G.wt;
    cp_async16(s + krow * (BN * ESIZE) + ((ch ^ (krow & 7)) << 4), src, ok ? 16 : 0);
  }
}
#endif

#if GEMM_CONV == 3
/* ---------------------------------------------------------------- B gathered (wgrad) */

/* A thread's B chunks (copy_mnmajor's pattern): column chunk tid % rowch
 * of rows tid / rowch + i (NT / rowch); the chunk's tap (r, s) and channel
 * are the thread's for the whole run. */
#define CONV_ROWCH (BN * ESIZE / 16)
static_assert(NT % CONV_ROWCH == 0, "a thread's B chunks share their column");

typedef struct conv_bcol {
  int ry, rx, c; /* r·dil − pad, s·dil − pad, the channel */
  int ok;        /* the column chunk is real */
} conv_bcol;

static __device__ __forceinline__ void conv_bcol_init(const conv_geom &G, i64 n0, i64 nval, int tid, conv_bcol &cb) {
  const int ch = tid % CONV_ROWCH;
  cb.ok = nval - (i64)ch * CE > 0;
  const int n = cb.ok ? (int)(n0 + ch * CE) : 0, rs = n / G.xc, r = rs / G.s, sx = rs - r * G.s;
  cb.c = n - rs * G.xc;
  cb.ry = r * G.dil_h - G.pad_h;
  cb.rx = sx * G.dil_w - G.pad_w;
}

/* B's K tile from kt: rows (n, p, q) of the tile's BN (r, s, c) columns. */
static __device__ __forceinline__ void conv_load_b(u32 s, const conv_geom &G, const conv_bcol &cb, i64 kt, i64 k1,
                                                   int tid) {
  const int ch = tid % CONV_ROWCH, pq = G.oh * G.ow;
#pragma unroll
  for (int i = 0; i < BN * 4 / NT; i++) {
    const int krow = tid / CONV_ROWCH + i * (NT / CONV_ROWCH);
    const i64 gk = kt + krow;
    const int kin = gk < k1;
    const int g = kin ? (int)gk : 0, n = g / pq, rem = g - n * pq, oy = rem / G.ow, ox = rem - oy * G.ow;
    const int y = oy * G.st_h + cb.ry, x = ox * G.st_w + cb.rx;
    const int ok = kin && cb.ok && (unsigned)y < (unsigned)G.xh && (unsigned)x < (unsigned)G.xw;
    const char *src = ok ? (const char *)G.x + ((i64)n * G.xs_n + (i64)y * G.xs_h + (i64)x * G.xs_w + cb.c) * ESIZE
                         : (const char *)G.x;
    cp_async16(s + krow * (BN * ESIZE) + ((ch ^ (krow & 7)) << 4), src, ok ? 16 : 0);
  }
}
#endif

#endif /* SMELT_CONV2D_IGEMM_CUH */
