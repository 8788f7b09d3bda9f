/* PEER support kernels, independent of the weights' dtype:
 *   - a stable LSD radix sort of (u32 key, u32 value) pairs, 8 bits a pass
 *     (peer_sort_hist, peer_scan, peer_sort_scatter), and the keys it sorts
 *     (peer_use_keys): the backward sorts the uses of each expert and of each
 *     sub-key so that every gradient row is a sum in a fixed order, written
 *     once, with no floating-point atomics;
 *   - the runs of equal keys in a sorted array, indexed by key
 *     (peer_seg_bounds) or listed in key order (peer_seg_heads,
 *     peer_seg_compact), and the expert-gradient segment sums over them
 *     (peer_du, peer_dv: dense or sparse rows);
 *   - deterministic column sums (peer_colsum_*: dbq and the norm params);
 *   - a 16-bit matrix transpose (peer_transpose16: Wq made K-major so the
 *     query projection runs on the Hopper GEMM kernel);
 *   - the expert store's batch policy (peer_store_*): per-expert use counts,
 *     hits and misses in ascending id order, and the CLOCK hand run in
 *     parallel: the victims of m misses are the first m slots of
 *     R1 ++ R2, where R1 lists the unpinned slots with a clear reference bit
 *     and R2 those with a set bit, each in hand order (a sequential hand
 *     takes the R1 slots in its first revolution, clearing the R2 bits as it
 *     passes them, then takes R2 slots in the second); then the victims'
 *     rows are copied from the mapped host tables into their slots.
 * Scans are two-level: per-block sums, one block scanning them, and the
 * blocks re-reading their part. */
#include "peer_common.cuh"

#define NT 256
#define TILE 1024 /* items per block of the scans: 4 per thread */
#define SORT_TILE 4096
#define SORT_BINS 256

/* ---------------------------------------------------------------- block scan */

/* Exclusive prefix of v over the block (NT threads); *total gets the sum. */
static __device__ __forceinline__ u32 block_scan(u32 v, u32 *warp_sums, u32 *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u32 y = __shfl_up_sync(PEER_FULL, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    u32 w = lane < NT / 32 ? warp_sums[lane] : 0u, s = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u32 y = __shfl_up_sync(PEER_FULL, s, o);
      if (lane >= o) s += y;
    }
    if (lane < NT / 32) warp_sums[lane] = s - w;
    if (lane == NT / 32 - 1) warp_sums[NT / 32] = s;
  }
  __syncthreads();
  const u32 out = warp_sums[warp] + x - v;
  *total = warp_sums[NT / 32];
  __syncthreads();
  return out;
}

/* Exclusive scan of the TILE words of data from i0 (thread: 4 at i0 + 4
 * tid), starting at carry; returns the tile's sum. */
static __device__ __forceinline__ u32 scan_tile(u32 *d, i64 count, i64 i0, u32 carry, u32 *ws) {
  u32 v[4], sum = 0;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    v[j] = i0 + j < count ? d[i0 + j] : 0u;
    sum += v[j];
  }
  u32 tot;
  u32 run = carry + block_scan(sum, ws, &tot);
#pragma unroll
  for (int j = 0; j < 4; j++)
    if (i0 + j < count) {
      d[i0 + j] = run;
      run += v[j];
    }
  return tot;
}

/* In-place exclusive scan of data[0..count) (u32), one block; the sum goes
 * to *total_out (u64) when given. */
extern "C" __global__ void __launch_bounds__(NT) peer_scan(u64 data, i64 count, u64 total_out) {
  __shared__ u32 ws[NT / 32 + 1];
  u32 carry = 0;
  for (i64 base = 0; base < count; base += TILE) carry += scan_tile((u32 *)data, count, base + threadIdx.x * 4, carry, ws);
  if (threadIdx.x == 0 && total_out) *(u64 *)total_out = carry;
}

/* A two-level form for long arrays (the radix sort's histograms, 256 a
 * tile of keys: 32k words for the 524k uses; docs/PERF.md, PEER: backward):
 * peer_scan_sums sums each TILE (bsum[b]), peer_scan scans bsum, and
 * peer_scan_add writes each tile's exclusive prefix from bsum[b]. */
extern "C" __global__ void __launch_bounds__(NT) peer_scan_sums(u64 data, i64 count, u64 bsum) {
  __shared__ u32 ws[NT / 32 + 1];
  const i64 i0 = (i64)blockIdx.x * TILE + threadIdx.x * 4;
  u32 sum = 0;
#pragma unroll
  for (int j = 0; j < 4; j++) sum += i0 + j < count ? ((const u32 *)data)[i0 + j] : 0u;
  u32 tot;
  block_scan(sum, ws, &tot);
  if (threadIdx.x == 0) ((u32 *)bsum)[blockIdx.x] = tot;
}

extern "C" __global__ void __launch_bounds__(NT) peer_scan_add(u64 data, i64 count, u64 bsum) {
  __shared__ u32 ws[NT / 32 + 1];
  scan_tile((u32 *)data, count, (i64)blockIdx.x * TILE + threadIdx.x * 4, ((const u32 *)bsum)[blockIdx.x], ws);
}

/* ---------------------------------------------------------------- radix sort */

/* hist[d * nblocks + b] = number of keys of tile b with digit d. */
extern "C" __global__ void __launch_bounds__(NT) peer_sort_hist(u64 keys, i64 n, int shift, u64 hist, i64 nblocks) {
  __shared__ u32 cnt[SORT_BINS];
  cnt[threadIdx.x] = 0;
  __syncthreads();
  const u32 *k = (const u32 *)keys;
  const i64 base = (i64)blockIdx.x * SORT_TILE;
  for (int i = threadIdx.x; i < SORT_TILE; i += NT)
    if (base + i < n) atomicAdd(&cnt[(k[base + i] >> shift) & (SORT_BINS - 1)], 1u);
  __syncthreads();
  ((u32 *)hist)[threadIdx.x * nblocks + blockIdx.x] = cnt[threadIdx.x];
}

/* A CTA per tile, a warp per eighth of it (SCATTER_PER keys a lane, held in
 * registers, loaded at once): each warp counts its digits, the counts are
 * turned into each warp's start per digit (the tile's offset from the
 * scanned histogram, then warps in order), and each warp walks its part in
 * order, 32 keys at a time: keys with equal digits in a batch rank by lane
 * and the batch's leader of each digit advances the warp's cursor. Equal
 * digits thus keep their input order (stable). vin == 0: the values are
 * the input positions. */
#define SCATTER_PER (SORT_TILE / NT)
extern "C" __global__ void __launch_bounds__(NT) peer_sort_scatter(u64 kin, u64 vin, u64 kout, u64 vout, i64 n,
                                                                   int shift, u64 hist, i64 nblocks) {
  __shared__ u32 cursor[NT / 32][SORT_BINS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < (NT / 32) * SORT_BINS; i += NT) (&cursor[0][0])[i] = 0;
  const u32 *ki = (const u32 *)kin, *vi = (const u32 *)vin;
  u32 *ko = (u32 *)kout, *vo = (u32 *)vout;
  const i64 s0 = (i64)blockIdx.x * SORT_TILE + warp * (SORT_TILE / (NT / 32));
  u32 key[SCATTER_PER], val[SCATTER_PER];
#pragma unroll
  for (int i = 0; i < SCATTER_PER; i++) {
    const i64 x = s0 + 32 * i + lane;
    key[i] = x < n ? ki[x] : 0u;
    val[i] = x < n ? (vi ? vi[x] : (u32)x) : 0u;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < SCATTER_PER; i++) {
    const bool in = s0 + 32 * i + lane < n;
    const u32 d = in ? (key[i] >> shift) & (SORT_BINS - 1) : SORT_BINS + lane;
    const unsigned peers = __match_any_sync(PEER_FULL, d);
    if (in && __ffs(peers) - 1 == lane) cursor[warp][d] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  for (int d = threadIdx.x; d < SORT_BINS; d += NT) {
    u32 run = ((const u32 *)hist)[d * nblocks + blockIdx.x];
    for (int w = 0; w < NT / 32; w++) {
      const u32 c = cursor[w][d];
      cursor[w][d] = run;
      run += c;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < SCATTER_PER; i++) {
    const bool in = s0 + 32 * i + lane < n;
    const u32 d = in ? (key[i] >> shift) & (SORT_BINS - 1) : SORT_BINS + lane;
    const unsigned peers = __match_any_sync(PEER_FULL, d);
    const u32 rank = __popc(peers & ((1u << lane) - 1u));
    const u32 at = in ? cursor[warp][d] + rank : 0u;
    __syncwarp();
    if (in) {
      ko[at] = key[i];
      vo[at] = val[i];
      if (rank == 0) cursor[warp][d] += __popc(peers);
    }
    __syncwarp();
  }
}

/* Sort keys of the uses (ids [n] i64): expert e -> (e / div) % mod (mod 0:
 * none) + (per-head tables) head * table_n; ids outside [0, N) -> sentinel,
 * which sorts last and is skipped. */
extern "C" __global__ void __launch_bounds__(NT) peer_use_keys(u64 ids, i64 n, i64 h, i64 k, i64 N, i64 div, i64 mod,
                                                              i64 table_n, u32 sentinel, u64 keys) {
  const i64 u = (i64)blockIdx.x * NT + threadIdx.x;
  if (u >= n) return;
  const i64 e = ((const i64 *)ids)[u];
  u32 key = sentinel;
  if (e >= 0 && e < N) {
    i64 a = e / div;
    if (mod) a %= mod;
    if (table_n) a += ((u / k) % h) * table_n;
    key = (u32)a;
  }
  ((u32 *)keys)[u] = key;
}

/* ---------------------------------------------------------------- segments */

/* bounds[2 key], bounds[2 key + 1] = the first and one past the last
 * position of key's run in the sorted keys (keys >= nrows skipped); rows
 * without uses keep the zeros the caller wrote (an empty run). */
extern "C" __global__ void __launch_bounds__(NT) peer_seg_bounds(u64 skeys, i64 n, i64 nrows, u64 bounds) {
  const i64 s = (i64)blockIdx.x * NT + threadIdx.x;
  if (s >= n) return;
  const u32 *keys = (const u32 *)skeys;
  const u32 key = keys[s];
  if ((i64)key >= nrows) return;
  u32 *b = (u32 *)bounds;
  if (s == 0 || keys[s - 1] != key) b[2 * (i64)key] = (u32)s;
  if (s == n - 1 || keys[s + 1] != key) b[2 * (i64)key + 1] = (u32)(s + 1);
}

/* The runs of the n sorted keys as a compact list (the sparse expert
 * gradients): runs of keys < nrows in key order, two-level like the
 * scans. peer_seg_heads: bsum[b] = the runs starting in tile b (TILE keys).
 * peer_seg_compact, with bsum scanned and *total (u64) their sum: run r
 * gets bounds[2 r], bounds[2 r + 1] and ids[r] = its key (i64), ids[i] =
 * -1 for i >= total, and *count (i64, when given) = total. */
static __device__ __forceinline__ void seg_flags(const u32 *keys, i64 n, i64 nrows, i64 i, bool *head, bool *tail) {
  const u32 key = i < n ? keys[i] : 0u;
  const bool in = i < n && (i64)key < nrows;
  *head = in && (i == 0 || keys[i - 1] != key);
  *tail = in && (i == n - 1 || keys[i + 1] != key);
}

extern "C" __global__ void __launch_bounds__(NT) peer_seg_heads(u64 skeys, i64 n, i64 nrows, u64 bsum) {
  __shared__ u32 ws[NT / 32 + 1];
  const i64 i0 = (i64)blockIdx.x * TILE + threadIdx.x * 4;
  u32 mine = 0;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    bool hd, tl;
    seg_flags((const u32 *)skeys, n, nrows, i0 + j, &hd, &tl);
    mine += hd;
  }
  u32 tot;
  block_scan(mine, ws, &tot);
  if (threadIdx.x == 0) ((u32 *)bsum)[blockIdx.x] = tot;
}

extern "C" __global__ void __launch_bounds__(NT) peer_seg_compact(u64 skeys, i64 n, i64 nrows, u64 bsum, u64 total,
                                                                 u64 bounds, u64 ids, u64 count) {
  __shared__ u32 ws[NT / 32 + 1];
  const u32 *keys = (const u32 *)skeys;
  const i64 i0 = (i64)blockIdx.x * TILE + threadIdx.x * 4, runs = (i64) * (const u64 *)total;
  bool hd[4], tl[4];
  u32 mine = 0;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    seg_flags(keys, n, nrows, i0 + j, &hd[j], &tl[j]);
    mine += hd[j];
  }
  u32 tot;
  u32 r = ((const u32 *)bsum)[blockIdx.x] + block_scan(mine, ws, &tot); /* runs begun before i0 */
  u32 *b = (u32 *)bounds;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const i64 i = i0 + j;
    if (i >= n) break;
    r += hd[j]; /* runs begun up to i: i's own run is r - 1 */
    if (hd[j]) {
      b[2 * (i64)(r - 1)] = (u32)i;
      ((i64 *)ids)[r - 1] = keys[i];
    }
    if (tl[j]) b[2 * (i64)(r - 1) + 1] = (u32)(i + 1);
    if (i >= runs) ((i64 *)ids)[i] = -1;
  }
  if (count && blockIdx.x == 0 && threadIdx.x == 0) *(i64 *)count = runs;
}

/* ---------------------------------------------------------------- expert gradients */

#define SEG_E 8 /* contiguous elements per lane and pass */

/* Stores v[0..SEG_E) at out[i..]: one 16-byte store when the dtype is
 * 16-bit and the address allows it, else element by element (up to n). */
static __device__ __forceinline__ void seg_store(u64 out, i64 i, int dt, const float *v, i64 n) {
  if (n == SEG_E && dt != SMELT_DT_F32 && ((out + 2 * (u64)i) & 15) == 0) {
    u32 w[SEG_E / 2];
#pragma unroll
    for (int e = 0; e < SEG_E / 2; e++) {
      const smelt_h16 lo = dt == SMELT_DT_F16 ? smelt_f32_to_f16(v[2 * e]) : smelt_f32_to_bf16(v[2 * e]);
      const smelt_h16 hi = dt == SMELT_DT_F16 ? smelt_f32_to_f16(v[2 * e + 1]) : smelt_f32_to_bf16(v[2 * e + 1]);
      w[e] = (u32)lo | ((u32)hi << 16);
    }
    *(uint4 *)((smelt_h16 *)out + i) = make_uint4(w[0], w[1], w[2], w[3]);
    return;
  }
#pragma unroll
  for (int e = 0; e < SEG_E; e++)
    if (e < n) peer_st(out, i + e, dt, v[e]);
}

/* Expert gradient rows, a warp per expert e (every row written: rows no
 * use selected get zeros), each row a sum over e's uses in sorted (use)
 * order, lane l covering elements [8 (l + 32 m), +8). The sparse form
 * passes peer_seg_compact's bounds and rows (e = the run's rank) and its
 * run count (u64, device) as nrun: rows e >= *nrun get zeros.
 *   dV_e[j, c] = Σ ua[use, j] dy[t(use), c]      peer_dv
 *   dU_e[i, j] = Σ udz[use, j] x[t(use), i]      peer_du
 * Where a lane's 8 elements are contiguous and aligned in the token's row
 * (dy, or x with h_e = 1) the vector path sweeps SEG_P of its passes per
 * read of the uses, each use one 16-byte load a pass (the issue's shape:
 * a 1024-element row in one sweep); else element by element. Both add in
 * the same order, so dense and sparse rows are the same bits either way. */
#define SEG_P 4

/* 8 contiguous elements at base[i], 16-byte aligned (32 for f32). */
static __device__ __forceinline__ void ld8(u64 base, i64 i, int dt, float *v) {
  if (dt == SMELT_DT_F32) {
    const float4 a = ((const float4 *)((const float *)base + i))[0], b = ((const float4 *)((const float *)base + i))[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
  const uint4 r = *(const uint4 *)((const smelt_h16 *)base + i);
  const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const smelt_h16 lo = (smelt_h16)(w[e] & 0xffffu), hi = (smelt_h16)(w[e] >> 16);
    v[2 * e] = dt == SMELT_DT_F16 ? smelt_f16_to_f32(lo) : smelt_bf16_to_f32(lo);
    v[2 * e + 1] = dt == SMELT_DT_F16 ? smelt_f16_to_f32(hi) : smelt_bf16_to_f32(hi);
  }
}

/* Rows of ld8-able tokens: 8-element groups start aligned in every row. */
static __device__ __forceinline__ bool ld8_ok(u64 base, i64 rs, int dt, i64 n) {
  const u64 align = dt == SMELT_DT_F32 ? 32u : 16u;
  return n % SEG_E == 0 && rs % SEG_E == 0 && base % align == 0;
}

/* One sweep of the vector path: passes p < SEG_P of lane's elements from
 * c0, the uses b0..b1; a(use, f) the use's factor for element group f,
 * src(use) the token row's element 0, col(f) the column of f in it. */
#define SEG_SWEEP(A_OF, SRC_OF, COL_OF, SRC, SRC_DT, OUT, OUT_DT)                  \
  for (i64 c0 = 0; c0 < row; c0 += 32 * SEG_E * SEG_P) {                          \
    float s[SEG_P][SEG_E];                                                         \
    _Pragma("unroll") for (int p = 0; p < SEG_P; p++)                              \
      _Pragma("unroll") for (int x = 0; x < SEG_E; x++) s[p][x] = 0.f;             \
    for (u32 m = b0; m < b1; m++) {                                                \
      const u32 use = vals[m], t = use / (u32)hk;                                  \
      _Pragma("unroll") for (int p = 0; p < SEG_P; p++) {                          \
        const i64 f = c0 + (i64)(p * 32 + lane) * SEG_E;                           \
        if (f < row) {                                                             \
          float v[SEG_E];                                                          \
          ld8(SRC, SRC_OF + COL_OF, SRC_DT, v);                                    \
          const float a = A_OF;                                                    \
          _Pragma("unroll") for (int x = 0; x < SEG_E; x++) s[p][x] = fmaf(a, v[x], s[p][x]); \
        }                                                                          \
      }                                                                            \
    }                                                                              \
    _Pragma("unroll") for (int p = 0; p < SEG_P; p++) {                            \
      const i64 f = c0 + (i64)(p * 32 + lane) * SEG_E;                             \
      if (f < row) seg_store(OUT, e * row + f, OUT_DT, s[p], SEG_E);               \
    }                                                                              \
  }

extern "C" __global__ void __launch_bounds__(NT) peer_dv(u64 bounds, u64 svals, i64 N, u64 nrun, u64 ua, u64 dy,
                                                        i64 dy_rs, int dy_dt, i64 hk, i64 he, i64 dout, u64 dv, int dv_dt) {
  const int lane = threadIdx.x & 31;
  const i64 e = (i64)blockIdx.x * (NT / 32) + (threadIdx.x >> 5);
  if (e >= N) return;
  const bool run = !nrun || (u64)e < *(const u64 *)nrun; /* rows past the runs: zeros, like unused experts' */
  const u32 b0 = run ? ((const u32 *)bounds)[2 * e] : 0u, b1 = run ? ((const u32 *)bounds)[2 * e + 1] : 0u;
  const u32 *vals = (const u32 *)svals;
  const i64 row = he * dout;
  if (ld8_ok(dy, dy_rs, dy_dt, dout)) { /* a group lies in one row j of [he, dout] */
    SEG_SWEEP(((const float *)ua)[(i64)use * he + (u32)f / (u32)dout], (i64)t * dy_rs, (u32)f % (u32)dout, dy, dy_dt,
              dv, dv_dt)
    return;
  }
  for (i64 f0 = (i64)lane * SEG_E; f0 < row; f0 += 32 * SEG_E) {
    /* element f0 + x is (j[x], c[x]) of the [he, dout] row; one division per pass */
    u32 jx[SEG_E], cx[SEG_E];
    jx[0] = (u32)f0 / (u32)dout; /* rows are < 2^32 elements */
    cx[0] = (u32)f0 - jx[0] * (u32)dout;
#pragma unroll
    for (int x = 1; x < SEG_E; x++) {
      jx[x] = jx[x - 1];
      cx[x] = cx[x - 1] + 1;
      if (cx[x] == dout) cx[x] = 0, jx[x]++;
    }
    const int nx = row - f0 < SEG_E ? (int)(row - f0) : SEG_E;
    float s[SEG_E];
#pragma unroll
    for (int x = 0; x < SEG_E; x++) s[x] = 0.f;
    for (u32 m = b0; m < b1; m++) {
      const u32 use = vals[m], t = use / (u32)hk;
      const float *a = (const float *)ua + (i64)use * he;
#pragma unroll
      for (int x = 0; x < SEG_E; x++)
        if (x < nx) s[x] = fmaf(a[jx[x]], peer_ld(dy, (i64)t * dy_rs + cx[x], dy_dt), s[x]);
    }
    seg_store(dv, e * row + f0, dv_dt, s, nx);
  }
}

extern "C" __global__ void __launch_bounds__(NT) peer_du(u64 bounds, u64 svals, i64 N, u64 nrun, u64 udz, u64 x,
                                                        i64 x_rs, int x_dt, i64 hk, i64 he, i64 din, u64 du, int du_dt) {
  const int lane = threadIdx.x & 31;
  const i64 e = (i64)blockIdx.x * (NT / 32) + (threadIdx.x >> 5);
  if (e >= N) return;
  const bool run = !nrun || (u64)e < *(const u64 *)nrun; /* rows past the runs: zeros, like unused experts' */
  const u32 b0 = run ? ((const u32 *)bounds)[2 * e] : 0u, b1 = run ? ((const u32 *)bounds)[2 * e + 1] : 0u;
  const u32 *vals = (const u32 *)svals;
  const i64 row = din * he;
  if (he == 1 && ld8_ok(x, x_rs, x_dt, din)) { /* element f is x[t, f] */
    SEG_SWEEP(((const float *)udz)[use], (i64)t * x_rs, f, x, x_dt, du, du_dt)
    return;
  }
  const int sh = __ffsll(he) - 1; /* h_e is a power of two */
  for (i64 f0 = (i64)lane * SEG_E; f0 < row; f0 += 32 * SEG_E) {
    const int nx = row - f0 < SEG_E ? (int)(row - f0) : SEG_E;
    float s[SEG_E];
#pragma unroll
    for (int y = 0; y < SEG_E; y++) s[y] = 0.f;
    for (u32 m = b0; m < b1; m++) {
      const u32 use = vals[m], t = use / (u32)hk;
      const float *a = (const float *)udz + (i64)use * he;
#pragma unroll
      for (int y = 0; y < SEG_E; y++) {
        const i64 f = f0 + y;
        if (y < nx) s[y] = fmaf(a[f & (he - 1)], peer_ld(x, (i64)t * x_rs + (f >> sh), x_dt), s[y]);
      }
    }
    seg_store(du, e * row + f0, du_dt, s, nx);
  }
}

/* ---------------------------------------------------------------- column sums */

#define CS_CHUNKS 32

/* part[ch, c] = Σ_{rows of chunk ch} in[r, c]; grid (ceil(cols / NT), CS_CHUNKS). */
extern "C" __global__ void __launch_bounds__(NT) peer_colsum_partial(u64 in, i64 rows, i64 cols, u64 part) {
  const i64 c = (i64)blockIdx.x * NT + threadIdx.x;
  if (c >= cols) return;
  const i64 ch = blockIdx.y, r0 = rows * ch / CS_CHUNKS, r1 = rows * (ch + 1) / CS_CHUNKS;
  const float *p = (const float *)in;
  float s = 0.f;
  for (i64 r = r0; r < r1; r++) s += p[r * cols + c];
  ((float *)part)[ch * cols + c] = s;
}

/* out[c * out_stride] = Σ_ch part[ch, c], chunks in order. */
extern "C" __global__ void __launch_bounds__(NT) peer_colsum_final(u64 part, i64 cols, u64 out, i64 out_stride,
                                                                  int out_dt) {
  const i64 c = (i64)blockIdx.x * NT + threadIdx.x;
  if (c >= cols) return;
  float s = 0.f;
  for (int ch = 0; ch < CS_CHUNKS; ch++) s += ((const float *)part)[ch * cols + c];
  peer_st(out, c * out_stride, out_dt, s);
}

/* ---------------------------------------------------------------- transpose */

/* peer_transpose_tile (peer_common.cuh), a tile a block. */
extern "C" __global__ void __launch_bounds__(NT) peer_transpose16(u64 in, i64 rows, i64 cols, i64 rs, i64 cs, u64 out) {
  peer_transpose_tile(in, rows, cols, rs, cs, out, blockIdx.x, blockIdx.y);
}

/* ---------------------------------------------------------------- the store */

/* Device statistics and scalars of a store (src/cuda/peer_store_cuda.c). */
enum { ST_LOOKUPS, ST_HITS, ST_MISSES, ST_EVICTIONS, ST_USES_MAPPED, ST_BYTES_STAGED, ST_BYTES_MAPPED, ST_RESIDENT };
enum { SC_HAND, SC_MISSES, SC_C1, SC_C2, SC_P, SC_LAST };

/* counts[e] = uses of e in the batch (counts zeroed by the caller). */
extern "C" __global__ void __launch_bounds__(NT) peer_store_count(u64 ids, i64 n, i64 N, u64 counts) {
  const i64 u = (i64)blockIdx.x * NT + threadIdx.x;
  if (u >= n) return;
  const i64 e = ((const i64 *)ids)[u];
  if (e >= 0 && e < N) atomicAdd((u32 *)counts + e, 1u);
}

/* Per expert with uses: heat, a lookup; a hit sets its slot's bit and pins
 * it; misses counted per block (bsum) for their compaction. */
extern "C" __global__ void __launch_bounds__(NT) peer_store_lookup(u64 counts, i64 N, u64 table, u64 ref, u64 pin,
                                                                  u32 batch, u64 heat, u64 stats, u64 bsum) {
  __shared__ u32 acc[3];
  if (threadIdx.x < 3) acc[threadIdx.x] = 0;
  __syncthreads();
  const i64 e0 = (i64)blockIdx.x * TILE + threadIdx.x * 4;
  u32 lookups = 0, hits = 0, misses = 0;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const i64 e = e0 + j;
    if (e >= N) break;
    const u32 c = ((const u32 *)counts)[e];
    if (!c) continue;
    ((u64 *)heat)[e] += c;
    lookups++;
    const int s = ((const int *)table)[e];
    if (s >= 0) {
      hits++;
      ((u8 *)ref)[s] = 1;
      ((u32 *)pin)[s] = batch;
    } else {
      misses++;
    }
  }
  if (lookups) atomicAdd(&acc[0], lookups);
  if (hits) atomicAdd(&acc[1], hits);
  if (misses) atomicAdd(&acc[2], misses);
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 *st = (u64 *)stats;
    if (acc[0]) atomicAdd((unsigned long long *)&st[ST_LOOKUPS], (unsigned long long)acc[0]);
    if (acc[1]) atomicAdd((unsigned long long *)&st[ST_HITS], (unsigned long long)acc[1]);
    if (acc[2]) atomicAdd((unsigned long long *)&st[ST_MISSES], (unsigned long long)acc[2]);
    ((u32 *)bsum)[blockIdx.x] = acc[2];
  }
}

/* The misses in ascending id order, with their use counts (bsum scanned). */
extern "C" __global__ void __launch_bounds__(NT) peer_store_misses(u64 counts, i64 N, u64 table, u64 bsum, u64 miss_e,
                                                                  u64 miss_uses) {
  __shared__ u32 ws[NT / 32 + 1];
  const i64 e0 = (i64)blockIdx.x * TILE + threadIdx.x * 4;
  u32 flag[4], c[4], mine = 0;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const i64 e = e0 + j;
    c[j] = e < N ? ((const u32 *)counts)[e] : 0u;
    flag[j] = c[j] && ((const int *)table)[e] < 0;
    mine += flag[j];
  }
  u32 tot;
  u32 at = ((const u32 *)bsum)[blockIdx.x] + block_scan(mine, ws, &tot);
#pragma unroll
  for (int j = 0; j < 4; j++)
    if (flag[j]) {
      ((u32 *)miss_e)[at] = (u32)(e0 + j);
      ((u32 *)miss_uses)[at] = c[j];
      at++;
    }
}

/* Slot classes at hand-order position q (slot (hand + q) mod S): 1 = R1
 * (unpinned, bit clear), 2 = R2 (unpinned, bit set), 0 = pinned. */
static __device__ __forceinline__ int slot_class(u64 ref, u64 pin, u32 batch, i64 s) {
  if (((const u32 *)pin)[s] == batch) return 0;
  return ((const u8 *)ref)[s] ? 2 : 1;
}

extern "C" __global__ void __launch_bounds__(NT) peer_store_slot_count(u64 ref, u64 pin, u32 batch, i64 S, u64 scal,
                                                                      u64 bsum1, u64 bsum2) {
  const i64 hand = ((const i64 *)scal)[SC_HAND];
  const i64 q0 = (i64)blockIdx.x * TILE + threadIdx.x * 4;
  u32 n1 = 0, n2 = 0;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const i64 q = q0 + j;
    if (q >= S) break;
    const int c = slot_class(ref, pin, batch, (hand + q) % S);
    n1 += c == 1;
    n2 += c == 2;
  }
  __shared__ u32 a1, a2;
  if (threadIdx.x == 0) a1 = a2 = 0;
  __syncthreads();
  if (n1) atomicAdd(&a1, n1);
  if (n2) atomicAdd(&a2, n2);
  __syncthreads();
  if (threadIdx.x == 0) {
    ((u32 *)bsum1)[blockIdx.x] = a1;
    ((u32 *)bsum2)[blockIdx.x] = a2;
  }
}

/* rank[s] = the slot's index in R1 ++ R2 (-1 when pinned); the positions of
 * the m-th victim (SC_P, when m <= |R1|) and of the last one (SC_LAST). */
extern "C" __global__ void __launch_bounds__(NT) peer_store_slot_rank(u64 ref, u64 pin, u32 batch, i64 S, u64 scal,
                                                                     u64 bsum1, u64 bsum2, u64 rank) {
  __shared__ u32 ws[NT / 32 + 1];
  i64 *sc = (i64 *)scal;
  const i64 hand = sc[SC_HAND], m = sc[SC_MISSES], c1 = sc[SC_C1], c2 = sc[SC_C2];
  const i64 admitted = m < c1 + c2 ? m : c1 + c2;
  const i64 q0 = (i64)blockIdx.x * TILE + threadIdx.x * 4;
  int cls[4];
  u32 n1 = 0, n2 = 0;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const i64 q = q0 + j;
    cls[j] = q < S ? slot_class(ref, pin, batch, (hand + q) % S) : 0;
    n1 += cls[j] == 1;
    n2 += cls[j] == 2;
  }
  u32 tot;
  u32 r1 = ((const u32 *)bsum1)[blockIdx.x] + block_scan(n1, ws, &tot);
  u32 r2 = ((const u32 *)bsum2)[blockIdx.x] + block_scan(n2, ws, &tot);
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const i64 q = q0 + j;
    if (q >= S) break;
    const i64 s = (hand + q) % S;
    i64 r = -1;
    if (cls[j] == 1) r = r1++;
    else if (cls[j] == 2) r = c1 + r2++;
    ((i64 *)rank)[s] = r;
    if (r >= 0 && r == m - 1 && m <= c1) sc[SC_P] = q;
    if (r >= 0 && r == admitted - 1) sc[SC_LAST] = q;
  }
}

/* Victims take their miss (evicting the resident expert); R2 slots the hand
 * passed lose their bit. */
extern "C" __global__ void __launch_bounds__(NT) peer_store_assign(u64 rank, i64 S, u64 scal, u64 owner, u64 table,
                                                                  u64 ref, u64 pin, u32 batch, u64 miss_e,
                                                                  u64 admit_slot, u64 stats, u64 slot_bytes) {
  const i64 s = (i64)blockIdx.x * NT + threadIdx.x;
  if (s >= S) return;
  const i64 *sc = (const i64 *)scal;
  const i64 hand = sc[SC_HAND], m = sc[SC_MISSES], c1 = sc[SC_C1];
  const i64 r = ((const i64 *)rank)[s];
  if (r < 0) return;
  const i64 q = (s - hand + S) % S;
  u64 *st = (u64 *)stats;
  if (r < m) {
    const u32 e = ((const u32 *)miss_e)[r];
    const int old = ((int *)owner)[s];
    if (old >= 0) {
      ((int *)table)[old] = -1;
      atomicAdd((unsigned long long *)&st[ST_EVICTIONS], 1ull);
    } else {
      atomicAdd((unsigned long long *)&st[ST_RESIDENT], 1ull);
    }
    ((int *)owner)[s] = (int)e;
    ((int *)table)[e] = (int)s;
    ((u8 *)ref)[s] = 1;
    ((u32 *)pin)[s] = batch;
    ((u32 *)admit_slot)[r] = (u32)s;
    atomicAdd((unsigned long long *)&st[ST_BYTES_STAGED], (unsigned long long)slot_bytes);
  } else if (m > 0 && r >= c1 && (m > c1 || q < sc[SC_P])) {
    ((u8 *)ref)[s] = 0;
  }
}

/* Misses in turn (grid-stride over r < m): admitted ones have their rows
 * copied from the host tables into their slot (16-byte units when `wide`,
 * else 2-byte units); the others are counted as read through the mapping.
 * Block 0 then moves the hand past the last victim. */
extern "C" __global__ void __launch_bounds__(NT)
    peer_store_finish(u64 scal, i64 S, u64 miss_e, u64 miss_uses, u64 admit_slot, u64 u_host, u64 v_host,
                      u64 u_cache, u64 v_cache, i64 u_bytes, i64 v_bytes, int wide, u64 stats, u64 slot_bytes) {
  i64 *sc = (i64 *)scal;
  const i64 m = sc[SC_MISSES], c12 = sc[SC_C1] + sc[SC_C2];
  const i64 admitted = m < c12 ? m : c12;
  for (i64 r = blockIdx.x; r < m; r += gridDim.x) {
    const u32 e = ((const u32 *)miss_e)[r];
    if (r >= admitted) {
      if (threadIdx.x == 0) {
        const u64 uses = ((const u32 *)miss_uses)[r];
        u64 *st = (u64 *)stats;
        atomicAdd((unsigned long long *)&st[ST_USES_MAPPED], (unsigned long long)uses);
        atomicAdd((unsigned long long *)&st[ST_BYTES_MAPPED], (unsigned long long)(uses * slot_bytes));
      }
      continue;
    }
    const i64 s = ((const u32 *)admit_slot)[r];
    const u64 pairs[2][3] = {{u_host + (u64)e * u_bytes, u_cache + (u64)s * u_bytes, (u64)u_bytes},
                             {v_host + (u64)e * v_bytes, v_cache + (u64)s * v_bytes, (u64)v_bytes}};
    for (int p = 0; p < 2; p++) {
      if (wide) {
        const uint4 *src = (const uint4 *)pairs[p][0];
        uint4 *dst = (uint4 *)pairs[p][1];
        for (i64 i = threadIdx.x; i < (i64)(pairs[p][2] / 16); i += NT) dst[i] = src[i];
      } else {
        const unsigned short *src = (const unsigned short *)pairs[p][0];
        unsigned short *dst = (unsigned short *)pairs[p][1];
        for (i64 i = threadIdx.x; i < (i64)(pairs[p][2] / 2); i += NT) dst[i] = src[i];
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && admitted > 0) sc[SC_HAND] = (sc[SC_HAND] + sc[SC_LAST] + 1) % S;
}
