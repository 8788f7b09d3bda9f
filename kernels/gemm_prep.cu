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
