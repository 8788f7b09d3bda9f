/* The GEMM operand pre-pass: copies one operand, stored with any strides,
 * into a K-major workspace (rows of K, row-major A [M, K'] or B as
 * [N, K']), the only layout the Hopper kernel's TMA + wgmma path takes for
 * tf32 and fp8, and on the way makes its values what that kernel needs:
 *   PREP_COPY   the bits as they are (4-byte f32 or 1-byte fp8);
 *   PREP_TF32   f32 rounded to the nearest tf32, ties away from zero (the
 *               rounding of cvt.rna.tf32.f32), low 13 mantissa bits zero,
 *               so the wgmma, which reads only the top 19 bits, truncates
 *               nothing;
 *   PREP_SPLIT  3xtf32: big = rna(x), small = rna(x - big) (x - big is
 *               exact in f32), written as three parts of Kp along K: A as
 *               [small | big | big], B as [big | small | big] (the part
 *               holding `small` is P.small_part), so one tf32 GEMM over
 *               3 Kp adds a_s b_b, then a_b b_s, then a_b b_b: the small
 *               products first, every value exact in tf32.
 * Each part is Kp = K rounded up to 16 bytes of elements, zero-filled past
 * K, so TMA gets 16-byte aligned rows.
 *
 * A block moves a 64 x 64 element tile through shared memory: it reads
 * along the source's unit-stride axis (rows when the operand is MN-major,
 * K otherwise; a gather for general strides), so reads coalesce either
 * way, and writes whole 16-byte units along K. The tile's rows are padded
 * by one word, so the column-wise reads of an MN-major source and the
 * row-wise 16-byte gathers for the stores stay nearly free of bank
 * conflicts. Memory-bound: one read of the operand, one write of each part.
 *
 * The second entry, gemm_prep_pitch, serves 16-bit operands, which the
 * Hopper kernel takes in either major-ness but reads at half speed (or,
 * rows not 16 bytes apart, not at all) unless their rows are whole 128-byte
 * lines apart: it copies an operand row by row, keeping its major-ness,
 * into rows a multiple of 128 bytes apart (see gemm_prep_pitch below).
 */
#include "smelt_device.cuh"

#define PREP_COPY 1
#define PREP_TF32 2
#define PREP_SPLIT 3

#define TR 64  /* rows (m or n) per tile */
#define TK 64  /* K elements per tile */
#define NT 256 /* threads per block */

/* Launch parameters (mirrored by smelt__gemm_prep_params in src/cuda/gemm_prep.c). */
typedef struct prep_params {
  u64 src, dst;
  i64 rows, k;   /* the source: rows x k elements */
  i64 s_r, s_k;  /* element (r, k) is at src + (r * s_r + k * s_k) * es */
  i64 kp;        /* K of one part in the workspace (K rounded up to 16 bytes) */
  i64 ld;        /* the workspace's row stride in elements (parts x kp) */
  i64 tiles_k;   /* tiles along kp */
  int es;        /* element size: 4 or 1 */
  int form;      /* PREP_* */
  int small_part; /* PREP_SPLIT: the part (0 or 1) that holds the small values */
  int mn_unit;   /* 1: s_r is the unit stride (read along rows) */
} prep_params;

static_assert(sizeof(prep_params) == 88, "prep_params must match smelt__gemm_prep_params");

/* Round to the nearest tf32, ties away from zero, low 13 bits cleared;
 * adding half a tf32 unit to the magnitude bits carries into the exponent
 * where it must (subnormals, binade edges, overflow to infinity). NaN stays
 * a NaN (quieted, so clearing its low bits cannot make it an infinity).
 * The host twin is smelt__tf32_rna in src/cuda/gemm_prep.h. */
static __device__ __forceinline__ u32 tf32_rna(u32 u) {
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x007fffffu) ? (u | 0x00400000u) & 0xffffe000u : u;
  return (u + 0x1000u) & 0xffffe000u;
}

/* The small part of x whose big part is big: rna(x - big), zero when big
 * is not finite (an infinity or NaN carries the whole value). */
static __device__ __forceinline__ u32 tf32_small(u32 x, u32 big) {
  if ((big & 0x7f800000u) == 0x7f800000u) return 0u;
  return tf32_rna(__float_as_uint(__uint_as_float(x) - __uint_as_float(big)));
}

#define EPT (TR * TK / NT) /* elements each thread moves into the tile */

/* Tile element i (of TR x TK) in the order of the source's unit-stride
 * axis: along rows for an MN-major source, along K otherwise. */
static __device__ __forceinline__ int tile_r(const prep_params &P, int i) { return P.mn_unit ? i % TR : i / TK; }
static __device__ __forceinline__ int tile_k(const prep_params &P, int i) { return P.mn_unit ? i / TR : i % TK; }

/* Its byte offset in the tile, rows `row_bytes` apart. */
static __device__ __forceinline__ int tile_index(const prep_params &P, int i, int row_bytes) {
  return tile_r(P, i) * row_bytes + tile_k(P, i) * P.es;
}

/* Its value from the source (zero past the rows or K). */
static __device__ __forceinline__ u32 load_elem(const prep_params &P, i64 r0, i64 k0, int i) {
  const i64 gr = r0 + tile_r(P, i), gk = k0 + tile_k(P, i);
  if (gr >= P.rows || gk >= P.k) return 0u;
  const i64 off = gr * P.s_r + gk * P.s_k;
  return P.es == 4 ? ((const u32 *)P.src)[off] : (u32)((const unsigned char *)P.src)[off];
}

static __device__ __forceinline__ void store16(char *p, const u32 *w) {
  *(uint4 *)p = make_uint4(w[0], w[1], w[2], w[3]);
}

extern "C" __global__ void __launch_bounds__(NT) gemm_prep(const prep_params P) {
  /* TR rows of TK elements, each row one word longer than its data. */
  __shared__ __align__(16) u32 tile[TR * (TK + 1)];
  const int rsw = P.es == 4 ? TK + 1 : TK / 4 + 1; /* row stride in words */
  unsigned char *tb = (unsigned char *)tile;
  const i64 t = blockIdx.x;
  const i64 r0 = t / P.tiles_k * TR, k0 = t % P.tiles_k * TK;
  /* A thread's EPT elements are loaded before any is stored, so all its
   * loads are in flight at once (enough bytes in flight per SM to reach
   * the memory's bandwidth). */
  u32 v[EPT];
#pragma unroll
  for (int j = 0; j < EPT; j++) v[j] = load_elem(P, r0, k0, threadIdx.x + j * NT);
#pragma unroll
  for (int j = 0; j < EPT; j++) {
    const int at = tile_index(P, threadIdx.x + j * NT, rsw * 4);
    if (P.es == 4) tile[at / 4] = v[j];
    else tb[at] = (unsigned char)v[j];
  }
  __syncthreads();
  /* 16-byte units: 4 f32 or 16 fp8 elements, 4 words of a tile row. */
  const int ce = 16 / P.es, units = TK / ce;
  for (int i = threadIdx.x; i < TR * units; i += NT) {
    const int r = i / units, c = i % units;
    const i64 gr = r0 + r, gk = k0 + (i64)c * ce;
    if (gr >= P.rows || gk >= P.kp) continue;
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) w[j] = tile[r * rsw + 4 * c + j];
    char *dst = (char *)P.dst + (gr * P.ld + gk) * P.es;
    if (P.form == PREP_COPY) {
      store16(dst, w);
    } else if (P.form == PREP_TF32) {
#pragma unroll
      for (int j = 0; j < 4; j++) w[j] = tf32_rna(w[j]);
      store16(dst, w);
    } else {
      u32 big[4], small[4];
#pragma unroll
      for (int j = 0; j < 4; j++) {
        big[j] = tf32_rna(w[j]);
        small[j] = tf32_small(w[j], big[j]);
      }
      /* Chosen element by element, so that both stay in registers. */
#pragma unroll
      for (int part = 0; part < 3; part++) {
        u32 o[4];
#pragma unroll
        for (int j = 0; j < 4; j++) o[j] = part == P.small_part ? small[j] : big[j];
        store16(dst + part * P.kp * 4, o);
      }
    }
  }
}

/* ---------------------------------------------------------------- 16-bit rows re-pitched */

#define PU 4 /* 16-byte units each thread moves per block (all loaded before any is stored) */

/* One 2-D copy: rows x cols 16-bit elements, the source's rows s_src
 * elements apart (any even address), the workspace's s_dst apart (a
 * multiple of 64: 128-byte lines) from a 128-byte aligned start. The
 * block's units are numbered row by row, `units` 16-byte units a row. */
typedef struct pitch_copy {
  u64 src, dst;
  i64 s_src, s_dst;
  u32 rows, cols, units, blocks;
} pitch_copy;

/* Launch parameters (mirrored by smelt__gemm_pitch_params in
 * src/cuda/gemm_prep.c): A's copy and B's, the first c[0].blocks blocks on
 * c[0] and the rest on c[1], so one launch moves both operands. */
typedef struct pitch_params {
  pitch_copy c[2];
} pitch_params;

static_assert(sizeof(pitch_params) == 96, "pitch_params must match smelt__gemm_pitch_params");

/* Word j (0..7) of the 32 bytes w, by selects rather than a local-memory
 * array index. */
static __device__ __forceinline__ u32 word_at(const u32 w[8], u32 j) {
  u32 r = w[0];
#pragma unroll
  for (u32 q = 1; q < 8; q++) r = j == q ? w[q] : r;
  return r;
}

/* The n (<= 8) elements at p (any even address) as one 16-byte unit,
 * zeros past n. Where the unit is aligned and whole, one 16-byte load;
 * where the two aligned 16-byte blocks that hold it lie inside the row
 * [lo, hi), both loaded and shifted into place (rows not 16 bytes apart:
 * every unit but a row's ends); at a row's ends, element by element, so
 * that nothing outside the operand is read. */
static __device__ __forceinline__ uint4 load_unit(const char *p, u32 n, const char *lo, const char *hi) {
  const u32 o = (u32)(u64)p & 15u;
  if (o == 0 && n == 8) return __ldg((const uint4 *)p);
  const char *a = p - o;
  u32 w[8];
  if (a >= lo && a + 32 <= hi) {
    const uint4 x = __ldg((const uint4 *)a), y = __ldg((const uint4 *)(a + 16));
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w, w[4] = y.x, w[5] = y.y, w[6] = y.z, w[7] = y.w;
    const u32 q = o >> 2, sh = (o & 3u) * 8u; /* the window's first word and byte shift */
    u32 v[4];
#pragma unroll
    for (u32 i = 0; i < 4; i++) v[i] = __funnelshift_r(word_at(w, q + i), word_at(w, q + i + 1), sh);
    return make_uint4(v[0], v[1], v[2], v[3]); /* n is 8 here: the row goes on past a + 32 */
  }
  const unsigned short *e = (const unsigned short *)p;
  u32 h[8];
#pragma unroll
  for (u32 j = 0; j < 8; j++) h[j] = j < n ? (u32)__ldg(e + j) : 0u;
  return make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
}

/* Each block moves NT * PU consecutive units of its copy: all of a
 * thread's loads are issued before its first store, 64 bytes a thread in
 * flight (about 100 KB an SM at 40 registers; the memory's bandwidth needs
 * a fifth of that); units past the copy's end do nothing. Every store is a whole,
 * aligned 16-byte unit; the last unit of a row carries zeros past cols
 * into the row's padding, which no kernel reads (the GEMM's tensor maps
 * end at cols and fill zeros past it). */
extern "C" __global__ void __launch_bounds__(NT) gemm_prep_pitch(const pitch_params P) {
  const int second = blockIdx.x >= P.c[0].blocks;
  const pitch_copy C = second ? P.c[1] : P.c[0]; /* selects, not a dynamic index into the parameters */
  const u32 b = blockIdx.x - (second ? P.c[0].blocks : 0u);
  const u32 total = C.rows * C.units; /* below 2^31 (checked by the host): no u32 wraps */
  uint4 v[PU];
  char *d[PU];
#pragma unroll
  for (int j = 0; j < PU; j++) {
    const u32 at = b * (NT * PU) + j * NT + threadIdx.x;
    d[j] = 0;
    if (at >= total) continue;
    const u32 r = at / C.units, u = at % C.units;
    const char *row = (const char *)C.src + (i64)r * C.s_src * 2;
    v[j] = load_unit(row + u * 16, min(8u, C.cols - u * 8), row, row + (u64)C.cols * 2);
    d[j] = (char *)C.dst + ((i64)r * C.s_dst + u * 8) * 2;
  }
#pragma unroll
  for (int j = 0; j < PU; j++)
    if (d[j]) *(uint4 *)d[j] = v[j];
}
