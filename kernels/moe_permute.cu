/* MoE dispatch and combine on the GPU, without a host round trip.
 *
 * permute, stable and expert-major, in four launches over chunks of
 * MOE_CHUNK tokens:
 *   moe_chunk_counts  each chunk's assignments per expert (shared atomics:
 *                     counts do not depend on their order);
 *   moe_chunk_bases   per expert (a block each), every chunk's first row:
 *                     offsets[e] plus the earlier chunks' counts, a block scan;
 *   moe_rank          a warp per chunk ranks its assignments in (token, slot)
 *                     order, 32 at a time (__match_any_sync gives the lanes of
 *                     one expert; a lane's rank is the peers below it), and
 *                     writes row_map;
 *   moe_copy_rows     a warp per token and 2 KB of its row reads x once and
 *                     writes each of its kept rows of xp, in the widest unit
 *                     the layout allows: the one launch that moves the data.
 * Ids outside [0, E), and rows outside [0, T·k) (offsets that do not
 * match the ids), count as dropped (row -1): the CPU reference refuses
 * them, the GPU cannot without a host read, so it keeps every access in
 * bounds instead.
 *
 * moe_drop: the router's capacity, dropping the assignments whose place in
 * their expert's order is at or past it: by position, the places from
 * moe_rank (chunk bases from 0 rather than the offsets); by probs, from
 * moe_probs_list (each expert's assignments gathered into its segment of
 * the offsets, in any order: a per-expert cursor, integer atomics) and
 * moe_probs_rank (a block per expert counts, for each of its assignments,
 * those that rank before it: larger weight, NaN first, equal weights by
 * lower assignment index, so the place is a function of the set alone and
 * the result repeats though the gathering order does not).
 *
 * unpermute: a warp per token, y[t] = Σ_i w[t, i] · yp[row_map[t, i]] in
 * slot order in f32, over the rows that are not -1; yp and y in any of f32,
 * f16, bf16 (dtype codes of smelt_dtype, read at run time), 8 columns a
 * lane (16-byte accesses) where the layout allows. Without weights (NULL)
 * it is permute's backward: dx[t] = Σ_i dxp[row_map[t, i]].
 *
 * moe_unpermute_bwd: a warp per token; for each kept slot in slot order,
 * dyp[row] = w · dy[t] and dweights[t, i] = dy[t] · yp[row] (lanes over
 * columns, then a butterfly sum: a fixed order, the same bits every run).
 *
 * moe_add: the FFN's two input-gradient products (f32; the MLP has one)
 * summed, by row into dxp, or gathered by token into the layer's dx with
 * the router's part added (its f32 gradient times the router's weights,
 * for a few experts). */
#include "smelt_device.cuh"

#define FULL 0xffffffffu
#define MOE_CHUNK 32 /* tokens a chunk: 128 left T 4096 at 32 warps of ranking (7.8 us of a 53 us permute) */

extern "C" __global__ void moe_chunk_counts(const int *ids, i64 T, int k, int E, int *cc) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const i64 t = (i64)blockIdx.x * MOE_CHUNK + threadIdx.x;
  if (threadIdx.x < MOE_CHUNK && t < T)
    for (int i = 0; i < k; i++) {
      const int e = ids[t * k + i];
      if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
    }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) cc[(i64)blockIdx.x * E + e] = hist[e];
}

/* cc [chunks, E]: counts in, first rows out (block e scans column e).
 * offsets [E+1] i32 or i64, or NULL: each expert's rows from 0 (a token's
 * position among its expert's tokens). blockDim a multiple of 32, at most
 * 1024. */
extern "C" __global__ void moe_chunk_bases(int *cc, i64 chunks, int E, const void *offsets, int offsets64) {
  __shared__ int sums[32];
  const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  i64 carry = !offsets ? 0 : offsets64 ? ((const i64 *)offsets)[e] : ((const int *)offsets)[e];
  for (i64 c0 = 0; c0 < chunks; c0 += blockDim.x) {
    const i64 c = c0 + threadIdx.x;
    const int v = c < chunks ? cc[c * E + e] : 0;
    int x = v; /* inclusive scan in the warp, then over the warps */
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(FULL, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = lane < warps ? sums[lane] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(FULL, w, o);
        if (lane >= o) w += y;
      }
      sums[lane] = w;
    }
    __syncthreads();
    if (c < chunks) cc[c * E + e] = (int)(carry + (warp ? sums[warp - 1] : 0) + x - v);
    carry += sums[warps - 1];
    __syncthreads(); /* sums is rewritten by the next tile */
  }
}

/* row_map [T, k] of ids [T, k]: one warp per chunk; cc from
 * moe_chunk_bases. Shared memory: E ints. */
extern "C" __global__ void moe_rank(const int *ids, i64 T, int k, int E, const int *cc, int *row_map) {
  extern __shared__ int next[];
  const int lane = threadIdx.x;
  const i64 t0 = (i64)blockIdx.x * MOE_CHUNK, a0 = t0 * k;
  const int n = (int)((T - t0 < MOE_CHUNK ? T - t0 : MOE_CHUNK) * k);
  for (int e = lane; e < E; e += 32) next[e] = cc[(i64)blockIdx.x * E + e];
  __syncwarp();
  for (int base = 0; base < n; base += 32) {
    const int idx = base + lane;
    int e = idx < n ? ids[a0 + idx] : -1;
    if (e < -1 || e >= E) e = -1;
    const unsigned peers = __match_any_sync(FULL, e);
    int row = e >= 0 ? next[e] + __popc(peers & ((1u << lane) - 1u)) : -1;
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) next[e] += __popc(peers);
    __syncwarp();
    if (row < 0 || row >= T * k) row = -1;
    if (idx < n) row_map[a0 + idx] = row;
  }
}

/* xp[row_map[t, i]] = x[t] for every kept assignment: a warp a token's
 * slice of COPY_SLICE bytes (grid: T times the slices, 8 warps a block),
 * reading x once for its k rows (a warp an assignment read each row of x k
 * times: 64 of the 128 MB moved at T 4096, d 4096, k 2, bf16). x rows
 * x_stride bytes apart, row_bytes used; xp rows of row_bytes. */
#define COPY_SLICE 2048
#define COPY_UNITS(type, bytes_)                                                         \
  for (i64 o = o0 + (i64)lane * (bytes_); o < o1; o += 32 * (bytes_)) {                  \
    const type v = *(const type *)(src + o);                                              \
    for (int i = 0; i < k; i++)                                                           \
      if (rows[i] >= 0) *(type *)(xp + (i64)rows[i] * row_bytes + o) = v;                 \
  }
extern "C" __global__ void moe_copy_rows(const char *x, i64 x_stride, const int *row_map, i64 T, int k, char *xp,
                                         i64 row_bytes, int unit) {
  __shared__ int rows_s[8][32]; /* the token's rows, a warp's (k <= 32) */
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 slices = (row_bytes + COPY_SLICE - 1) / COPY_SLICE;
  const i64 gw = (i64)blockIdx.x * (blockDim.x >> 5) + warp, t = gw / slices;
  if (t >= T) return;
  int *rows = rows_s[warp];
  if (lane < k) {
    const int r = row_map[t * k + lane];
    rows[lane] = r >= 0 && r < T * k ? r : -1;
  }
  __syncwarp();
  const i64 o0 = gw % slices * COPY_SLICE, o1 = o0 + COPY_SLICE < row_bytes ? o0 + COPY_SLICE : row_bytes;
  const char *src = x + t * x_stride;
  if (unit == 16) COPY_UNITS(uint4, 16)
  else if (unit == 8) COPY_UNITS(uint2, 8)
  else if (unit == 4) COPY_UNITS(u32, 4)
  else COPY_UNITS(smelt_h16, 2)
}
#undef COPY_UNITS

/* Capacity: an assignment at or past place cap among its expert's (pos from
 * moe_rank without offsets, or from moe_probs_rank) is dropped: id -1, weight 0. */
extern "C" __global__ void moe_drop(int *ids, float *weights, const int *pos, i64 n, int cap) {
  for (i64 a = (i64)blockIdx.x * blockDim.x + threadIdx.x; a < n; a += (i64)gridDim.x * blockDim.x)
    if (pos[a] >= cap) {
      ids[a] = -1;
      weights[a] = 0.f;
    }
}

/* list [n]: expert e's assignments in [offs[e], offs[e+1]), placed by the
 * cursor [E] (a copy of offs, advanced here). */
extern "C" __global__ void moe_probs_list(const int *ids, i64 n, int E, int *cursor, int *list) {
  for (i64 a = (i64)blockIdx.x * blockDim.x + threadIdx.x; a < n; a += (i64)gridDim.x * blockDim.x) {
    const int e = ids[a];
    if (e >= 0 && e < E) list[atomicAdd(&cursor[e], 1)] = (int)a;
  }
}

/* Whether assignment a (weight wa) ranks before b (weight wb). */
static __device__ __forceinline__ bool ranks_before(float wa, int a, float wb, int b) {
  const bool an = wa != wa, bn = wb != wb;
  if (an != bn) return an;
  if (!an && wa != wb) return wa > wb;
  return a < b;
}

#define PROBS_TILE 256 /* moe_probs_rank's block and shared tile */

/* pos[a] = the place of each of expert e's assignments (block e) in the
 * probs order among them: how many of the segment rank before it. */
extern "C" __global__ void moe_probs_rank(const int *list, const int *offs, const float *w, int *pos) {
  __shared__ float tw[PROBS_TILE];
  __shared__ int ta[PROBS_TILE];
  const int lo = offs[blockIdx.x], n = offs[blockIdx.x + 1] - lo;
  for (int base = 0; base < n; base += PROBS_TILE) { /* the same trip counts in every thread: the barriers */
    const int j = base + threadIdx.x;
    const int a = j < n ? list[lo + j] : -1;
    const float wa = a >= 0 ? w[a] : 0.f;
    int place = 0;
    for (int t0 = 0; t0 < n; t0 += PROBS_TILE) {
      __syncthreads();
      if (t0 + threadIdx.x < n) {
        ta[threadIdx.x] = list[lo + t0 + threadIdx.x];
        tw[threadIdx.x] = w[ta[threadIdx.x]];
      }
      __syncthreads();
      const int m = n - t0 < PROBS_TILE ? n - t0 : PROBS_TILE;
      for (int i = 0; a >= 0 && i < m; i++) place += ranks_before(tw[i], ta[i], wa, a);
    }
    if (a >= 0) pos[a] = place;
  }
}

static __device__ __forceinline__ float load_any(const void *p, int dt, i64 i) {
  if (dt == SMELT_DT_F32) return ((const float *)p)[i];
  if (dt == SMELT_DT_F16) return smelt_f16_to_f32(((const smelt_h16 *)p)[i]);
  return smelt_bf16_to_f32(((const smelt_h16 *)p)[i]);
}

static __device__ __forceinline__ void store_any(void *p, int dt, i64 i, float v) {
  if (dt == SMELT_DT_F32) ((float *)p)[i] = v;
  else if (dt == SMELT_DT_F16) ((smelt_h16 *)p)[i] = smelt_f32_to_f16(v);
  else ((smelt_h16 *)p)[i] = smelt_f32_to_bf16(v);
}

/* 8 elements from p + i (16-byte aligned) as floats, and back. */
static __device__ __forceinline__ void load8(const void *p, int dt, i64 i, float *v) {
  if (dt == SMELT_DT_F32) {
    const float4 a = ((const float4 *)((const float *)p + i))[0], b = ((const float4 *)((const float *)p + i))[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
  const uint4 q = *(const uint4 *)((const smelt_h16 *)p + i);
  const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const smelt_h16 lo = (smelt_h16)(w[j] & 0xffffu), hi = (smelt_h16)(w[j] >> 16);
    v[2 * j] = dt == SMELT_DT_F16 ? smelt_f16_to_f32(lo) : smelt_bf16_to_f32(lo);
    v[2 * j + 1] = dt == SMELT_DT_F16 ? smelt_f16_to_f32(hi) : smelt_bf16_to_f32(hi);
  }
}

static __device__ __forceinline__ void store8(void *p, int dt, i64 i, const float *v) {
  if (dt == SMELT_DT_F32) {
    ((float4 *)((float *)p + i))[0] = make_float4(v[0], v[1], v[2], v[3]);
    ((float4 *)((float *)p + i))[1] = make_float4(v[4], v[5], v[6], v[7]);
    return;
  }
  u32 w[4];
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const smelt_h16 lo = dt == SMELT_DT_F16 ? smelt_f32_to_f16(v[2 * j]) : smelt_f32_to_bf16(v[2 * j]);
    const smelt_h16 hi = dt == SMELT_DT_F16 ? smelt_f32_to_f16(v[2 * j + 1]) : smelt_f32_to_bf16(v[2 * j + 1]);
    w[j] = (u32)lo | ((u32)hi << 16);
  }
  *(uint4 *)((smelt_h16 *)p + i) = make_uint4(w[0], w[1], w[2], w[3]);
}

/* yp [T·k, d] contiguous; row_map, w [T, k] (w NULL: 1); y rows of y_stride
 * elements. A warp a token's slice of UNPERMUTE_SLICE columns (grid: T times
 * the slices, 8 warps a block): by whole rows, a decode step's one token
 * was one warp looping over d (15 us at d 4096; docs/PERF.md, MoE). */
#define UNPERMUTE_SLICE 256
extern "C" __global__ void moe_unpermute(const void *yp, int yp_dt, const int *row_map, const float *w, void *y,
                                         int y_dt, i64 T, int k, int d, i64 y_stride, int vec) {
  const int lane = threadIdx.x & 31, slices = (d + UNPERMUTE_SLICE - 1) / UNPERMUTE_SLICE;
  const i64 gw = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), t = gw / slices;
  if (t >= T) return;
  const int c_lo = (int)(gw % slices) * UNPERMUTE_SLICE, c_hi = min(d, c_lo + UNPERMUTE_SLICE);
  const int my_row = lane < k ? row_map[t * k + lane] : -1;
  const float my_w = lane < k ? (w ? w[t * k + lane] : 1.f) : 0.f;
  if (vec) { /* d, y_stride multiples of 8, yp and y 16-byte aligned; the slice is one round of 8 a lane */
    const int c = c_lo + lane * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, v[8];
    for (int i = 0; i < k; i++) {
      const int r = __shfl_sync(FULL, my_row, i);
      const float wi = __shfl_sync(FULL, my_w, i);
      if (c >= c_hi || r < 0 || r >= T * k) continue;
      load8(yp, yp_dt, (i64)r * d + c, v);
#pragma unroll
      for (int j = 0; j < 8; j++) acc[j] += wi * v[j];
    }
    if (c < c_hi) store8(y, y_dt, t * y_stride + c, acc);
    return;
  }
  for (int c0 = c_lo; c0 < c_hi; c0 += 32) { /* the same trip count in every lane: the shuffles */
    const int c = c0 + lane;
    float acc = 0.f;
    for (int i = 0; i < k; i++) {
      const int r = __shfl_sync(FULL, my_row, i);
      const float wi = __shfl_sync(FULL, my_w, i);
      if (r >= 0 && r < T * k && c < c_hi) acc += wi * load_any(yp, yp_dt, (i64)r * d + c);
    }
    if (c < c_hi) store_any(y, y_dt, t * y_stride + c, acc);
  }
}

/* dy rows of dy_stride elements, yp [T·k, d] contiguous, row_map and w
 * [T, k]; dyp [T·k, d] out (the kept rows), dweights [T, k] f32 out or NULL
 * (0 where dropped). vec: d and dy_stride multiples of 8, dy, yp, dyp
 * 16-byte aligned. */
extern "C" __global__ void moe_unpermute_bwd(const void *dy, int dy_dt, i64 dy_stride, const void *yp, int yp_dt,
                                             const int *row_map, const float *w, void *dyp, int dyp_dt,
                                             float *dweights, i64 T, int k, int d, int vec) {
  const int lane = threadIdx.x & 31;
  const i64 t = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= T) return;
  for (int i = 0; i < k; i++) {
    int r = row_map[t * k + i];
    r = r >= 0 && r < T * k ? r : -1;
    const float wi = w[t * k + i];
    float dot = 0.f;
    if (r >= 0 && vec) {
      float g[8], v[8];
      for (int c = lane * 8; c < d; c += 32 * 8) {
        load8(dy, dy_dt, t * dy_stride + c, g);
        load8(yp, yp_dt, (i64)r * d + c, v);
#pragma unroll
        for (int j = 0; j < 8; j++) dot += g[j] * v[j], g[j] *= wi;
        store8(dyp, dyp_dt, (i64)r * d + c, g);
      }
    } else if (r >= 0) {
      for (int c = lane; c < d; c += 32) {
        const float g = load_any(dy, dy_dt, t * dy_stride + c);
        dot += g * load_any(yp, yp_dt, (i64)r * d + c);
        store_any(dyp, dyp_dt, (i64)r * d + c, wi * g);
      }
    }
    dot = smelt_warp_sum(dot);
    if (dweights && lane == 0) dweights[t * k + i] = r >= 0 ? dot : 0.f;
  }
}

/* The FFN's input gradient summed: its two products a + b (f32 [rows, d]
 * contiguous; b NULL: the MLP's one), a warp a row's slice of
 * UNPERMUTE_SLICE columns of out (dtype code out_dt, rows out_stride
 * apart, n rows). Without row_map, out row r is a[r] + b[r] for the kept
 * rows (offsets[E], clamped to rows): the FFN's dxp. With row_map [n, k],
 * out row t is permute's backward of it, the sum over t's kept rows in
 * slot order (-1 or past rows: none), then, with g, plus the router's part
 * Σ_e g[t, e] · w[c, e] in e order (g f32 [n, E]; w [d, E] of dtype code
 * w_dt, strides w_rs and w_cs): the layer's dx straight from the products,
 * without dxp, an f32 dx and the router's products over it in between
 * (docs/PERF.md, MoE). vec: d and out_stride multiples of 8, a, b and out
 * 16-byte aligned. */
#define ADD_ROUTER_E 16 /* src/cuda/moe_bwd.c: the most experts moe_add takes the router's part for */

/* t's router gradient g[t, 0 .. E) into registers (E <= ADD_ROUTER_E). */
static __device__ __forceinline__ void router_grad(const float *g, i64 t, int E, float *gt) {
#pragma unroll
  for (int e = 0; e < ADD_ROUTER_E; e++) gt[e] = e < E ? g[t * E + e] : 0.f;
}

/* The router's part of dx's column c, Σ_e gt[e] · w[c, e] in e order: the
 * row of w in 16-byte loads when its E 16-bit weights are whole 16-byte
 * units (vw), else element by element. (Element loads for a lane's 8
 * columns, the gradient read again for each, kept L1 at 97% of its
 * throughput and the kernel at ~7x its traffic's time: H100, E8, 715 us
 * under the profiler.) */
static __device__ __forceinline__ float router_col(const float *gt, const void *w, int w_dt, i64 w_rs, i64 w_cs, int E,
                                                   int c, int vw) {
  float r = 0.f;
  if (vw) {
#pragma unroll
    for (int e0 = 0; e0 < ADD_ROUTER_E; e0 += 8) {
      if (e0 >= E) break;
      float v[8];
      load8(w, w_dt, (i64)c * w_rs + e0, v);
#pragma unroll
      for (int q = 0; q < 8; q++) r += gt[e0 + q] * v[q];
    }
  } else {
#pragma unroll
    for (int e = 0; e < ADD_ROUTER_E; e++)
      if (e < E) r += gt[e] * load_any(w, w_dt, (i64)c * w_rs + e * w_cs);
  }
  return r;
}

extern "C" __global__ void moe_add(const float *a, const float *b, const int *row_map, int k, const void *offsets,
                                   int offsets64, int E, const float *g, const void *w, int w_dt, i64 w_rs, i64 w_cs,
                                   void *out, int out_dt, i64 out_stride, i64 n, i64 rows, int d, int vec) {
  const int lane = threadIdx.x & 31, slices = (d + UNPERMUTE_SLICE - 1) / UNPERMUTE_SLICE;
  const i64 gw = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), t = gw / slices;
  i64 kept = offsets64 ? ((const i64 *)offsets)[E] : (i64)((const int *)offsets)[E];
  kept = kept < 0 ? 0 : kept > rows ? rows : kept;
  if (t >= n || (!row_map && t >= kept)) return;
  const int c_lo = (int)(gw % slices) * UNPERMUTE_SLICE, c_hi = min(d, c_lo + UNPERMUTE_SLICE);
  const int slots = row_map ? k : 1;
  const i64 my_row = !row_map ? (lane == 0 ? t : -1) : lane < k ? (i64)row_map[t * k + lane] : -1;
  if (vec) { /* the slice is one round of 8 columns a lane */
    const int c = c_lo + lane * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, u[8], v[8];
    for (int i = 0; i < slots; i++) {
      const i64 r = __shfl_sync(FULL, my_row, i);
      if (c >= c_hi || r < 0 || r >= rows) continue;
      load8(a, SMELT_DT_F32, r * d + c, u);
      if (b) load8(b, SMELT_DT_F32, r * d + c, v);
#pragma unroll
      for (int j = 0; j < 8; j++) acc[j] += b ? u[j] + v[j] : u[j];
    }
    if (c >= c_hi) return;
    if (g) {
      float gt[ADD_ROUTER_E];
      router_grad(g, t, E, gt);
      const int vw = w_dt != SMELT_DT_F32 && w_cs == 1 && E % 8 == 0 && w_rs % 8 == 0 && (u64)w % 16 == 0;
#pragma unroll
      for (int j = 0; j < 8; j++) acc[j] += router_col(gt, w, w_dt, w_rs, w_cs, E, c + j, vw);
    }
    store8(out, out_dt, t * out_stride + c, acc);
    return;
  }
  float gt[ADD_ROUTER_E];
  if (g) router_grad(g, t, E, gt);
  for (int c0 = c_lo; c0 < c_hi; c0 += 32) { /* the same trip count in every lane: the shuffles */
    const int c = c0 + lane;
    float acc = 0.f;
    for (int i = 0; i < slots; i++) {
      const i64 r = __shfl_sync(FULL, my_row, i);
      if (r >= 0 && r < rows && c < c_hi) acc += b ? a[r * d + c] + b[r * d + c] : a[r * d + c];
    }
    if (c >= c_hi) continue;
    if (g) acc += router_col(gt, w, w_dt, w_rs, w_cs, E, c, 0);
    store_any(out, out_dt, t * out_stride + c, acc);
  }
}

/* The router's weight gradient where moe_add takes its dx part (E <=
 * ADD_ROUTER_E): dw [d, E] = xᵀ·g (x [T, d] of dtype code x_dt, rows
 * x_stride apart; g f32 [T, E]) in f32, in one pass over x instead of the
 * engine's two products over g's bf16 hi and lo parts (each reading x:
 * ~40 us apiece at E8 T4096 d4096). moe_router_wgrad: block (bx, by)
 * sums tokens by·WGRAD_TOKENS .. +WGRAD_TOKENS - 1 for 8 columns a thread
 * (2048 a block; 16-byte loads where vec: d and x_stride multiples of 8,
 * x 16-byte aligned) into part [chunks][d][E]; moe_router_wgrad_sum adds
 * the chunks in order (the same bits every run) into dw (dtype code dw_dt,
 * strides dw_rs, dw_cs). */
#define WGRAD_TOKENS 64

extern "C" __global__ void moe_router_wgrad(const void *x, int x_dt, i64 x_stride, const float *g, int E, i64 T, int d,
                                            int vec, float *part) {
  __shared__ float gs[WGRAD_TOKENS][ADD_ROUTER_E];
  const i64 t0 = (i64)blockIdx.y * WGRAD_TOKENS;
  for (int i = threadIdx.x; i < WGRAD_TOKENS * ADD_ROUTER_E; i += blockDim.x) {
    const int tt = i / ADD_ROUTER_E, e = i % ADD_ROUTER_E;
    gs[tt][e] = t0 + tt < T && e < E ? g[(t0 + tt) * E + e] : 0.f;
  }
  __syncthreads();
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (c >= d) return;
  const int n = T - t0 < WGRAD_TOKENS ? (int)(T - t0) : WGRAD_TOKENS;
  float acc[8][ADD_ROUTER_E];
#pragma unroll
  for (int j = 0; j < 8; j++)
#pragma unroll
    for (int e = 0; e < ADD_ROUTER_E; e++) acc[j][e] = 0.f;
  for (int tt = 0; tt < n; tt++) {
    float v[8];
    if (vec) {
      load8(x, x_dt, (t0 + tt) * x_stride + c, v);
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++) v[j] = c + j < d ? load_any(x, x_dt, (t0 + tt) * x_stride + c + j) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int e = 0; e < ADD_ROUTER_E; e++) acc[j][e] += v[j] * gs[tt][e];
  }
  float *out = part + ((i64)blockIdx.y * d + c) * E;
#pragma unroll
  for (int j = 0; j < 8; j++)
#pragma unroll
    for (int e = 0; e < ADD_ROUTER_E; e++)
      if (c + j < d && e < E) out[j * E + e] = acc[j][e];
}

extern "C" __global__ void moe_router_wgrad_sum(const float *part, int chunks, int d, int E, void *dw, int dw_dt,
                                                i64 dw_rs, i64 dw_cs) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x, n = (i64)d * E;
  if (i >= n) return;
  float sum = 0.f;
  for (int j = 0; j < chunks; j++) sum += part[j * n + i];
  store_any(dw, dw_dt, (i / E) * dw_rs + (i % E) * dw_cs, sum);
}
