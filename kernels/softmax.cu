/* Row-wise softmax over the last dimension, with each row's logsumexp.
 *
 * Prelude: SMELT_DT; SMELT_GROUP threads per row (8 or 16: several rows per
 * warp; 32: one warp per row; more: the whole CTA, SMELT_GROUP ==
 * SMELT_BLOCK); SMELT_ITEMS elements per thread per tile; SMELT_LOOP.
 *   SMELT_LOOP 0: the row (at most GROUP*ITEMS elements) is one tile held in
 *     registers, so x is read once and y written once: max, exp and sum,
 *     scale. This is the bandwidth-bound case the selector aims at.
 *   SMELT_LOOP 1: longer rows, in tiles of GROUP*ITEMS. Pass 1 keeps a running
 *     (max, sum) per thread; pass 2 reads the row again (from L2 while the
 *     rows in flight fit there) and writes y.
 * Entry points, by how elements are addressed (the host picks per run):
 *   softmax_vec   last-dim stride 1 for x and y, every row start aligned to
 *                 the vector width VW and C a multiple of it: VW elements
 *                 (up to 16 bytes) per access;
 *   softmax_unit  last-dim stride 1, any alignment: one element per access,
 *                 addresses are base + constant;
 *   softmax_gen   any strides.
 * Row r starts at row_offset(xr, r), xr being x's shape and strides without
 * the last dim (the same for y and lse), so any leading layout works.
 *
 * Semantics, shared with the CPU reference: m = the row's max over non-NaN
 * elements; ref = m, or 0 when m = -inf (a row of all -inf); s = sum of
 * exp(x - ref); y = exp(x - ref) / s, or 0 when s == 0; lse = ref + log s.
 * A NaN makes s NaN and so the whole row and its lse; a +inf gives
 * exp(inf - inf) = NaN, so such a row is NaN as well.
 */
#include "smelt_device.cuh"

#if !defined(SMELT_DT) || !defined(SMELT_GROUP) || !defined(SMELT_BLOCK) || !defined(SMELT_ITEMS) || \
    !defined(SMELT_LOOP)
#error "softmax.cu needs SMELT_DT, SMELT_GROUP, SMELT_BLOCK, SMELT_ITEMS and SMELT_LOOP"
#endif

/* Vector width in elements (at most 16 bytes), chunks per tile, elements per 32-bit word. */
#define VW (SMELT_ITEMS * (int)sizeof(elem_t) < 16 ? SMELT_ITEMS : 16 / (int)sizeof(elem_t))
#define CHUNKS (SMELT_ITEMS / VW)
#define EPW (4 / (int)sizeof(elem_t))
#define ROWS_PER_CTA (SMELT_BLOCK / SMELT_GROUP)
#define ROWS_PER_WARP (SMELT_GROUP < 32 ? 32 / SMELT_GROUP : 1)
/* Lanes a row spans within one warp: the shuffle distance of the reductions. */
#define WARP_SPAN (SMELT_GROUP < 32 ? SMELT_GROUP : 32)
#define NEG_INF __uint_as_float(0xff800000u)
#define FULL 0xffffffffu

enum { MODE_VEC, MODE_UNIT, MODE_STRIDED };

static __device__ __forceinline__ void unpack_word(u32 w, float *f) {
#if SMELT_DT == SMELT_DT_F32
  f[0] = __uint_as_float(w);
#else
  f[0] = load_elem((elem_t)(w & 0xffffu));
  f[1] = load_elem((elem_t)(w >> 16));
#endif
}

static __device__ __forceinline__ u32 pack_word(const float *f) {
#if SMELT_DT == SMELT_DT_F32
  return __float_as_uint(f[0]);
#else
  u32 r;
#if SMELT_DT == SMELT_DT_F16
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(f[1]), "f"(f[0]));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(f[1]), "f"(f[0]));
#endif
  return r;
#endif
}

/* The looping kernel reads each row twice. Its second reads (last use) and
 * its y stores are marked evict-first, so they do not push rows that are
 * still to be re-read out of L2. */
#define STREAM SMELT_LOOP

/* VW elements at p (aligned to VW elements) as one 16-, 8- or 4-byte access. */
static __device__ __forceinline__ void load_vw(const elem_t *p, float *f, bool last) {
  if (VW * sizeof(elem_t) == 16) {
    uint4 w = STREAM && last ? __ldcs((const uint4 *)p) : *(const uint4 *)p;
    unpack_word(w.x, f);
    unpack_word(w.y, f + EPW);
    unpack_word(w.z, f + 2 * EPW);
    unpack_word(w.w, f + 3 * EPW);
  } else if (VW * sizeof(elem_t) == 8) {
    uint2 w = *(const uint2 *)p;
    unpack_word(w.x, f);
    unpack_word(w.y, f + EPW);
  } else {
    unpack_word(*(const u32 *)p, f);
  }
}

static __device__ __forceinline__ void store_vw(elem_t *p, const float *f) {
  if (VW * sizeof(elem_t) == 16) {
    uint4 w;
    w.x = pack_word(f);
    w.y = pack_word(f + EPW);
    w.z = pack_word(f + 2 * EPW);
    w.w = pack_word(f + 3 * EPW);
    if (STREAM) {
      __stcs((uint4 *)p, w);
    } else {
      *(uint4 *)p = w;
    }
  } else if (VW * sizeof(elem_t) == 8) {
    uint2 w;
    w.x = pack_word(f);
    w.y = pack_word(f + EPW);
    *(uint2 *)p = w;
  } else {
    *(u32 *)p = pack_word(f);
  }
}

/* One tile of a row: this thread's chunk c covers the elements
 * base + (c*GROUP + lane)*VW + [0, VW) (vec) or base + c*GROUP + lane, so
 * neighbouring threads touch neighbouring memory. Elements past C read as
 * -inf, which adds nothing to the max or the sum. */
static __device__ __forceinline__ void load_tile(const elem_t *row, i64 cs, i64 C, i64 base, int lane, float *v,
                                                 int mode, bool last) {
  if (mode == MODE_VEC) {
#pragma unroll
    for (int c = 0; c < CHUNKS; c++) {
      const i64 j = base + (i64)(c * SMELT_GROUP + lane) * VW;
      if (j < C) {
        load_vw(row + j, v + c * VW, last);
      } else {
#pragma unroll
        for (int e = 0; e < VW; e++) v[c * VW + e] = NEG_INF;
      }
    }
  } else {
#pragma unroll
    for (int c = 0; c < SMELT_ITEMS; c++) {
      const i64 j = base + (i64)c * SMELT_GROUP + lane;
      v[c] = j < C ? load_elem(row[mode == MODE_UNIT ? j : j * cs]) : NEG_INF;
    }
  }
}

static __device__ __forceinline__ void store_tile(elem_t *row, i64 cs, i64 C, i64 base, int lane, const float *v,
                                                  int mode) {
  if (mode == MODE_VEC) {
#pragma unroll
    for (int c = 0; c < CHUNKS; c++) {
      const i64 j = base + (i64)(c * SMELT_GROUP + lane) * VW;
      if (j < C) store_vw(row + j, v + c * VW);
    }
  } else {
#pragma unroll
    for (int c = 0; c < SMELT_ITEMS; c++) {
      const i64 j = base + (i64)c * SMELT_GROUP + lane;
      if (j < C) row[mode == MODE_UNIT ? j : j * cs] = store_elem(v[c]);
    }
  }
}

/* Folds (om, os) into (m, s); each sum is relative to its own max (or to 0
 * when that max is -inf, in which case the sum is 0 or NaN). */
static __device__ __forceinline__ void combine(float *m, float *s, float om, float os) {
  const float nm = fmaxf(*m, om);
  *s = *s * (*m == nm ? 1.f : expf(*m - nm)) + os * (om == nm ? 1.f : expf(om - nm));
  *m = nm;
}

/* Group-wide reductions. Within a warp, xor shuffles over WARP_SPAN lanes
 * (a group of 8 or 16 lanes never mixes with its neighbours). For a
 * whole-CTA group, the warp results meet in shared memory and every warp
 * reduces those again, so all threads get the result after one barrier.
 * `red` holds 32 floats per use; distinct uses take distinct slots, so a
 * barrier later in the row separates a write from the previous row's reads. */
static __device__ __forceinline__ float group_max(float v, float *red) {
#pragma unroll
  for (int o = WARP_SPAN / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
#if SMELT_GROUP > 32
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = smelt_warp_max((threadIdx.x & 31) < SMELT_GROUP / 32 ? red[threadIdx.x & 31] : NEG_INF);
#else
  (void)red;
#endif
  return v;
}

static __device__ __forceinline__ float group_sum(float v, float *red) {
#pragma unroll
  for (int o = WARP_SPAN / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
#if SMELT_GROUP > 32
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = smelt_warp_sum((threadIdx.x & 31) < SMELT_GROUP / 32 ? red[threadIdx.x & 31] : 0.f);
#else
  (void)red;
#endif
  return v;
}

static __device__ __forceinline__ void warp_combine(float *m, float *s) {
#pragma unroll
  for (int o = WARP_SPAN / 2; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(FULL, *m, o);
    const float os = __shfl_xor_sync(FULL, *s, o);
    combine(m, s, om, os);
  }
}

static __device__ __forceinline__ void group_combine(float *m, float *s, float *red) {
  warp_combine(m, s);
#if SMELT_GROUP > 32
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    red[threadIdx.x >> 5] = *m;
    red[32 + (threadIdx.x >> 5)] = *s;
  }
  __syncthreads();
  *m = lane < SMELT_GROUP / 32 ? red[lane] : NEG_INF;
  *s = lane < SMELT_GROUP / 32 ? red[32 + lane] : 0.f;
  warp_combine(m, s);
  /* The next row writes red again. */
  __syncthreads();
#else
  (void)red;
#endif
}

#if SMELT_LOOP == 0
/* The whole row in registers: C <= SMELT_GROUP * SMELT_ITEMS. */
static __device__ __forceinline__ void softmax_row(const elem_t *xrow, elem_t *yrow, float *lse, i64 xcs, i64 ycs,
                                                   i64 C, int lane, float *red, int mode) {
  float v[SMELT_ITEMS];
  load_tile(xrow, xcs, C, 0, lane, v, mode, true);
  float m = NEG_INF;
#pragma unroll
  for (int i = 0; i < SMELT_ITEMS; i++) m = fmaxf(m, v[i]);
  m = group_max(m, red);
  const float ref = m == NEG_INF ? 0.f : m;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < SMELT_ITEMS; i++) {
    v[i] = expf(v[i] - ref);
    s += v[i];
  }
  s = group_sum(s, red + 32);
  const float inv = s == 0.f ? 0.f : 1.f / s;
#pragma unroll
  for (int i = 0; i < SMELT_ITEMS; i++) v[i] *= inv;
  store_tile(yrow, ycs, C, 0, lane, v, mode);
  if (lse && lane == 0) *lse = ref + logf(s);
}
#else
/* Any C: tiles of SMELT_GROUP * SMELT_ITEMS elements, two passes. */
static __device__ __forceinline__ void softmax_row(const elem_t *xrow, elem_t *yrow, float *lse, i64 xcs, i64 ycs,
                                                   i64 C, int lane, float *red, int mode) {
  const i64 tile = (i64)SMELT_GROUP * SMELT_ITEMS;
  float m = NEG_INF, s = 0.f;
  for (i64 base = 0; base < C; base += tile) {
    float v[SMELT_ITEMS];
    load_tile(xrow, xcs, C, base, lane, v, mode, false);
    float tm = NEG_INF;
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) tm = fmaxf(tm, v[i]);
    const float tref = tm == NEG_INF ? 0.f : tm;
    float ts = 0.f;
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) ts += expf(v[i] - tref);
    combine(&m, &s, tm, ts);
  }
  group_combine(&m, &s, red);
  const float ref = m == NEG_INF ? 0.f : m;
  const float inv = s == 0.f ? 0.f : 1.f / s;
  for (i64 base = 0; base < C; base += tile) {
    float v[SMELT_ITEMS];
    load_tile(xrow, xcs, C, base, lane, v, mode, true);
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) v[i] = expf(v[i] - ref) * inv;
    store_tile(yrow, ycs, C, base, lane, v, mode);
  }
  if (lse && lane == 0) *lse = ref + logf(s);
}
#endif

/* The host merges row dims, so one dim (offset r * stride) is the usual case
 * and skips smelt_offset's divisions. */
static __device__ __forceinline__ i64 row_offset(const smelt_kshape &s, i64 r) {
  return s.ndim == 1 ? r * s.strides[0] : smelt_offset(s, r);
}

/* rows rows of C elements; xr/yr/lr: the row layouts (shape without the last
 * dim); xcs/ycs: the last-dim strides. lse may be NULL. The loop runs over
 * each warp's first row so every lane of a warp takes the same trip count
 * (the shuffles need all 32); a group past the last row works on nothing. */
static __device__ __forceinline__ void softmax_rows(const elem_t *x, elem_t *y, float *lse, i64 rows, i64 C,
                                                    const smelt_kshape &xr, const smelt_kshape &yr,
                                                    const smelt_kshape &lr, i64 xcs, i64 ycs, int mode) {
  __shared__ float red[64];
  const int lane = threadIdx.x % SMELT_GROUP;
  const int group = threadIdx.x / SMELT_GROUP;
  const int in_warp = group % ROWS_PER_WARP;
  const i64 step = (i64)gridDim.x * ROWS_PER_CTA;
  for (i64 first = (i64)blockIdx.x * ROWS_PER_CTA + group - in_warp; first < rows; first += step) {
    const bool mine = first + in_warp < rows;
    const i64 r = mine ? first + in_warp : first;
    softmax_row(x + row_offset(xr, r), y + row_offset(yr, r), lse && mine ? lse + row_offset(lr, r) : (float *)0, xcs,
                ycs, mine ? C : 0, lane, red, mode);
  }
}

#define SOFTMAX_ENTRY(name, mode)                                                                                      \
  extern "C" __global__ void __launch_bounds__(SMELT_BLOCK)                                                            \
      name(const elem_t *x, elem_t *y, float *lse, i64 rows, i64 C, smelt_kshape xr, smelt_kshape yr, smelt_kshape lr, \
           i64 xcs, i64 ycs) {                                                                                         \
    softmax_rows(x, y, lse, rows, C, xr, yr, lr, xcs, ycs, mode);                                                      \
  }

SOFTMAX_ENTRY(softmax_vec, MODE_VEC)
SOFTMAX_ENTRY(softmax_unit, MODE_UNIT)
SOFTMAX_ENTRY(softmax_gen, MODE_STRIDED)
