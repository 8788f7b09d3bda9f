/* Row-wise top-k over the last dimension: the k largest values of each row,
 * largest first, and their indices.
 *
 * Order (smelt.h): descending value, NaN above +inf, -0.0 == +0.0, equal
 * values by ascending index. Each element maps to an order-preserving u32 key
 * (NaN -> 0xFFFFFFFE, both zeros -> the key of +0, otherwise the sign-flip
 * map), which leaves 0 free to mean "no element". Values are copied from x
 * (bit-exact: NaN payloads and the sign of zero survive); indices are written
 * as i32 or i64 (SMELT_IDX), and only when the pointer is not NULL.
 *
 * Prelude: SMELT_DT, SMELT_IDX (32 or 64), SMELT_ITEMS, SMELT_BLOCK.
 *   SMELT_ITEMS > 0: rows of at most 32*ITEMS elements (MoE routers over E
 *     experts, PEER sub-key scores): one warp per row. Lane l keeps the keys of
 *     elements it*32 + l in registers and its current best. A round is two
 *     warp reductions (REDUX, sm_80+): the largest key, then the smallest
 *     index among the lanes holding it; the winning lane writes the output,
 *     drops that key and rescans its ITEMS keys.
 *   SMELT_ITEMS == 0: longer rows, one CTA per row, on packed keys
 *     (key << 32 | ~index: all distinct, ties to the lower index). Each
 *     thread streams its share of the row keeping its 16 largest keys in a
 *     sorted register list; 16 block-wide rounds then pop the largest list
 *     head. For k > 16 this repeats on the keys below the last output, so a
 *     row is read ceil(k/16) times.
 */
#include "smelt_device.cuh"

#if !defined(SMELT_DT) || !defined(SMELT_IDX) || !defined(SMELT_ITEMS) || !defined(SMELT_BLOCK)
#error "topk.cu needs SMELT_DT, SMELT_IDX, SMELT_ITEMS and SMELT_BLOCK"
#endif

#if SMELT_IDX == 32
typedef int idx_t;
#elif SMELT_IDX == 64
typedef i64 idx_t;
#else
#error "SMELT_IDX must be 32 or 64"
#endif

#define FULL 0xffffffffu

static __device__ __forceinline__ u32 order_key(float f) {
  if (f != f) return 0xfffffffeu;
  const u32 u = f == 0.f ? 0u : __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Output slot r of a row gets element j of the input row. */
static __device__ __forceinline__ void emit(const elem_t *xrow, i64 xcs, elem_t *vrow, i64 vcs, idx_t *irow, i64 ics,
                                            i64 r, i64 j) {
  vrow[r * vcs] = xrow[j * xcs];
  if (irow) irow[r * ics] = (idx_t)j;
}

/* The host merges row dims, so one dim is the usual case. */
static __device__ __forceinline__ i64 row_offset(const smelt_kshape &s, i64 r) {
  return s.ndim == 1 ? r * s.strides[0] : smelt_offset(s, r);
}

#if SMELT_ITEMS > 0
#define ROWS_PER_CTA (SMELT_BLOCK / 32)

/* The largest key among this lane's, the first (lowest index) on ties. */
static __device__ __forceinline__ void scan(const u32 *key, u32 *best, int *at) {
  *best = 0u;
  *at = 0;
#pragma unroll
  for (int it = 0; it < SMELT_ITEMS; it++) {
    if (key[it] > *best) {
      *best = key[it];
      *at = it;
    }
  }
}

static __device__ __forceinline__ void topk_row(const elem_t *xrow, i64 xcs, i64 C, i64 k, elem_t *vrow, i64 vcs,
                                                idx_t *irow, i64 ics) {
  const int lane = threadIdx.x & 31;
  u32 key[SMELT_ITEMS];
#pragma unroll
  for (int it = 0; it < SMELT_ITEMS; it++) {
    const i64 j = it * 32 + lane;
    key[it] = j < C ? order_key(load_elem(xrow[j * xcs])) : 0u;
  }
  u32 best;
  int at;
  scan(key, &best, &at);
  for (i64 r = 0; r < k; r++) {
    /* k <= C, so some lane still holds a key: top > 0. */
    const u32 top = __reduce_max_sync(FULL, best);
    const u32 mine = (u32)(at * 32 + lane);
    const u32 j = __reduce_min_sync(FULL, best == top ? mine : 0xffffffffu);
    if (best == top && mine == j) {
      emit(xrow, xcs, vrow, vcs, irow, ics, r, j);
#pragma unroll
      for (int it = 0; it < SMELT_ITEMS; it++)
        if (it == at) key[it] = 0u;
      scan(key, &best, &at);
    }
  }
}

extern "C" __global__ void __launch_bounds__(SMELT_BLOCK)
    topk_rows(const elem_t *x, elem_t *vals, idx_t *idx, i64 rows, i64 C, i64 k, smelt_kshape xr, smelt_kshape vr,
              smelt_kshape ir, i64 xcs, i64 vcs, i64 ics) {
  const i64 step = (i64)gridDim.x * ROWS_PER_CTA;
  for (i64 r = (i64)blockIdx.x * ROWS_PER_CTA + threadIdx.x / 32; r < rows; r += step)
    topk_row(x + row_offset(xr, r), xcs, C, k, vals + row_offset(vr, r), vcs, idx ? idx + row_offset(ir, r) : idx, ics);
}

#else
#define NWARPS (SMELT_BLOCK / 32)
/* Candidates each thread keeps per pass. */
#define KMAX 16

/* Block-wide max of a u64: per warp by two 32-bit reductions (high word, then
 * the low word among lanes with the top high word), then once more over the
 * warp results. red[2][32] alternates by round so one barrier per round
 * suffices: a slot is rewritten only two rounds later, after every thread
 * has passed the barrier of the round in between. */
static __device__ __forceinline__ u64 warp_max_u64(u64 v) {
  const u32 hi = (u32)(v >> 32);
  const u32 mh = __reduce_max_sync(FULL, hi);
  const u32 ml = __reduce_max_sync(FULL, hi == mh ? (u32)v : 0u);
  return ((u64)mh << 32) | ml;
}

static __device__ __forceinline__ u64 block_max_u64(u64 v, u64 *red) {
  const int lane = threadIdx.x & 31;
  v = warp_max_u64(v);
  if (lane == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  return warp_max_u64(lane < NWARPS ? red[lane] : 0ull);
}

/* Inserts key into the descending list (the caller checked key > list[KMAX-1]).
 * Walking from the tail, each slot takes its predecessor, the key or itself. */
static __device__ __forceinline__ void insert(u64 *list, u64 key) {
#pragma unroll
  for (int i = KMAX - 1; i > 0; i--) list[i] = key > list[i - 1] ? list[i - 1] : key > list[i] ? key : list[i];
  list[0] = key > list[0] ? key : list[0];
}

/* One row: passes of up to KMAX outputs. In a pass each thread scans its
 * elements (j = tid, tid + BLOCK, ...) once, keeping its KMAX largest packed
 * keys below the last output so far; then KMAX block-wide rounds pop the
 * largest head. Packed keys are distinct, so exactly one thread owns each
 * round's winner. k <= KMAX (MoE, PEER) is a single read of the row. */
static __device__ __forceinline__ void topk_row(const elem_t *xrow, i64 xcs, i64 C, i64 k, elem_t *vrow, i64 vcs,
                                                idx_t *irow, i64 ics, u64 (*red)[32], int *phase) {
  u64 prev = ~0ull; /* above every packed key: NaN's key is 0xFFFFFFFE */
  for (i64 done = 0; done < k; done += KMAX) {
    u64 list[KMAX];
#pragma unroll
    for (int i = 0; i < KMAX; i++) list[i] = 0ull;
    for (i64 j = threadIdx.x; j < C; j += SMELT_BLOCK) {
      const u64 key = ((u64)order_key(load_elem(xrow[j * xcs])) << 32) | ~(u32)j;
      if (key < prev && key > list[KMAX - 1]) insert(list, key);
    }
    const i64 n = k - done < KMAX ? k - done : KMAX;
    for (i64 r = 0; r < n; r++) {
      const u64 best = block_max_u64(list[0], red[*phase]);
      *phase ^= 1;
      if (list[0] == best) {
#pragma unroll
        for (int i = 0; i < KMAX - 1; i++) list[i] = list[i + 1];
        list[KMAX - 1] = 0ull;
      }
      if (threadIdx.x == 0) emit(xrow, xcs, vrow, vcs, irow, ics, done + r, (i64)~(u32)best);
      prev = best;
    }
  }
}

extern "C" __global__ void __launch_bounds__(SMELT_BLOCK)
    topk_rows(const elem_t *x, elem_t *vals, idx_t *idx, i64 rows, i64 C, i64 k, smelt_kshape xr, smelt_kshape vr,
              smelt_kshape ir, i64 xcs, i64 vcs, i64 ics) {
  __shared__ u64 red[2][32];
  int phase = 0;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x)
    topk_row(x + row_offset(xr, row), xcs, C, k, vals + row_offset(vr, row), vcs, idx ? idx + row_offset(ir, row) : idx,
             ics, red, &phase);
}
#endif
