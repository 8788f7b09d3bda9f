/* The MoE layer's forward for a handful of tokens (at most MAXR = 16
 * assignments T·k: the decode step), in three launches where the general
 * path makes about ten (router GEMM, routing, counts, ranking, copy, three
 * grouped GEMMs, SwiGLU, combine). At these sizes the layer is a read of
 * the chosen experts' weights, so everything serves streaming them; the
 * host's rule for when this path runs is in src/cuda/moe_decode.c.
 *
 *   moe_decode_route  one block: logits = x·Wr (f32, a fixed summation
 *                     order), each token's selection by moe_route.cuh's
 *                     route_select (the router's own code: the same
 *                     choices and weights), counts, offsets and row_map
 *                     as the general path's (expert-major, tokens
 *                     ascending), and the work list of the two GEMVs:
 *                     groups of at most MOE_ROWS rows of one expert. It
 *                     also zeroes the GEMVs' tickets.
 *   moe_decode_up     h = silu(x·W1ₑ) ∘ (x·W3ₑ) for every group, f32
 *                     [T·k, F]: W1ₑ and W3ₑ streamed together, no
 *                     intermediate rounding, no separate SwiGLU pass.
 *   moe_decode_down   y[t] = Σ_i w[t, i] · (h·W2ₑ)[row(t, i)], slot order,
 *                     f32, rounded once into y (any row stride).
 *
 * The GEMVs. A CTA of 256 threads owns one group, one TILE of columns
 * (TILE: 128 bytes of each weight row, 8 threads of 16 bytes) and one
 * slice of K (at most MAX_SLICE rows, the group's inputs staged in shared
 * memory as f32, zero past the slice and the group's rows). The 32 K lanes
 * of the tile each keep NB = 8 16-byte weight loads in flight (L1 not
 * allocated: every weight is read once), then add them in with fmaf in K
 * order; the lanes are summed by shuffles and then by warps in a fixed
 * order. Columns are the fastest index of the grid, then the slice, then
 * the group, so the CTAs that run together read neighbouring 128-byte
 * pieces of the same weight rows.
 *
 * Split K without float atomics: with more than one slice, each CTA writes
 * its f32 partial sums to a workspace, and the last CTA to arrive at the
 * tile's ticket (an integer atomic; tickets zeroed by moe_decode_route)
 * adds the slices in slice order: the up projection per (group, tile),
 * then SwiGLU; the down projection per tile over every group and slice,
 * then the weighted sum of each token's slots. So every run gives the same
 * bits, and a token's bits do not depend on the other tokens of its batch
 * (each row's sums run the same way whatever group it is in; the slices
 * are the host's, from the config alone).
 *
 * On sm_90 the GEMVs are launched as programmatic dependents of the
 * kernel before them, which lets them start (the route and the up kernel
 * trigger at their start) and then wait in griddepcontrol.wait for that
 * kernel's end and memory: the launch gaps are hidden.
 *
 * Prelude: SMELT_DT (x's dtype, which Wr, W1, W3, W2 and y share),
 * MOE_ITEMS 2 (E <= 64), MOE_ROWS (1 or 4: rows of a group; 1 when T = 1,
 * where every group has one row, so the accumulators fit 3 CTAs an SM). */
#include "moe_route.cuh"
#include "smelt_mma.cuh" /* ld_stream: the weights read once */

#if !defined(SMELT_DT) || !defined(MOE_ROWS) || MOE_ITEMS != 2
#error "moe_decode.cu needs SMELT_DT, MOE_ROWS and MOE_ITEMS 2"
#endif

#define ROWS MOE_ROWS
#define MAXR 16           /* T·k at most (src/cuda/moe_decode.c's MAX_ROWS) */
#define THREADS 256       /* a GEMV block */
#define CT 8              /* threads across a tile */
#define KL (THREADS / CT) /* K lanes */
#define VW SMELT_VW       /* elements of a 16-byte load */
#define TILE (CT * VW)    /* columns of a CTA */
#define NB 8              /* weight loads a thread has in flight */
#define MAX_SLICE 2048    /* K rows of a CTA (a multiple of KL · NB) */
#define ROUTE_THREADS 512
#define TC 4 /* tokens a pass of the router's x·Wr */
#define OCC (ROWS == 1 ? 3 : 2)

/* meta (ints): [0] the group count G; groups g < MAXR as (expert, first
 * row, rows) from META_GROUPS; each permuted row's token from META_TOKEN
 * and its group from META_GROUP_OF. */
#define META_GROUPS 1
#define META_TOKEN (META_GROUPS + 3 * MAXR)
#define META_GROUP_OF (META_TOKEN + MAXR)

static_assert(MAX_SLICE % (KL * NB) == 0, "a slice's batches end inside the staged inputs");
static_assert(THREADS / 32 * 2 * ROWS * TILE <= ROWS * MAX_SLICE, "the lane sums fit the staged inputs' memory");

/* The VW elements of a 16-byte load as floats. */
static __device__ __forceinline__ void unpack(uint4 q, float *w) {
#if SMELT_DT == SMELT_DT_F32
  w[0] = __uint_as_float(q.x), w[1] = __uint_as_float(q.y), w[2] = __uint_as_float(q.z), w[3] = __uint_as_float(q.w);
#else
  const u32 u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    w[2 * j] = load_elem((elem_t)(u[j] & 0xffffu));
    w[2 * j + 1] = load_elem((elem_t)(u[j] >> 16));
  }
#endif
}

/* ---------------------------------------------------------------- routing */

/* acc[tt][v] += x[t0 + tt, c] · Wr[c, e0 + v] over this thread's rows c
 * (from c0, every step-th), tokens past T zero. vec: whole aligned 16-byte
 * units (E a multiple of VW, Wr aligned); else element by element, zero
 * past E. */
static __device__ __forceinline__ void logits_part(const elem_t *x, i64 x_stride, const elem_t *wr, int vec, int t0,
                                                   int T, int d, int E, int e0, int c0, int step,
                                                   float (*acc)[VW]) {
#pragma unroll 4
  for (int c = c0; c < d; c += step) {
    float w[VW];
    if (vec) {
      unpack(*(const uint4 *)(wr + (i64)c * E + e0), w);
    } else {
#pragma unroll
      for (int v = 0; v < VW; v++) w[v] = e0 + v < E ? load_elem(wr[(i64)c * E + e0 + v]) : 0.f;
    }
#pragma unroll
    for (int tt = 0; tt < TC; tt++) {
      const float xv = t0 + tt < T ? load_elem(x[(i64)(t0 + tt) * x_stride + c]) : 0.f;
#pragma unroll
      for (int v = 0; v < VW; v++) acc[tt][v] = fmaf(xv, w[v], acc[tt][v]);
    }
  }
}

/* x [T, d] (rows x_stride apart), wr [d, E], bias [E] f32 or NULL; out:
 * logits [T, E] f32, ids and weights [T, k], counts [E] and offsets
 * [E+1] (i32 or i64 each), dropped [1] (or NULL: 0 here, nothing is
 * dropped), row_map [T, k], meta (above); tickets [n_tickets] zeroed.
 * One block of ROUTE_THREADS; T <= 16, E <= 64, T·k <= MAXR.
 *
 * x·Wr: thread i owns the VW experts of unit i % P (P = the units of a row
 * rounded up to a power of two, so a warp's lanes of one unit are a
 * butterfly apart) and every (ROUTE_THREADS / P)-th row; lanes, then warps
 * in order, are summed, TC tokens a pass. */
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_decode_route(const elem_t *x, i64 x_stride, const elem_t *wr, int wr_vec, const float *bias, float *logits,
                     int *ids, float *weights, void *counts, int counts64, void *offsets, int offsets64, void *dropped,
                     int dropped64, int *row_map, int *meta, int *tickets, int n_tickets, int T, int d, int E, int k,
                     int sigmoid, int renorm, float scaling, int groups, int topk_groups) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  __shared__ float red[ROUTE_THREADS / 32][TC][64];
  __shared__ float lg[MAXR * 64];
  __shared__ int sel[MAXR], next[64];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < n_tickets; i += ROUTE_THREADS) tickets[i] = 0;
  const int units = (E + VW - 1) / VW;
  int P = 1;
  while (P < units) P <<= 1;
  const int unit = tid % P;
  for (int t0 = 0; t0 < T; t0 += TC) {
    float acc[TC][VW];
#pragma unroll
    for (int tt = 0; tt < TC; tt++)
#pragma unroll
      for (int v = 0; v < VW; v++) acc[tt][v] = 0.f;
    if (unit < units) logits_part(x, x_stride, wr, wr_vec, t0, T, d, E, unit * VW, tid / P, ROUTE_THREADS / P, acc);
    for (int o = 16; o >= P; o >>= 1)
#pragma unroll
      for (int tt = 0; tt < TC; tt++)
#pragma unroll
        for (int v = 0; v < VW; v++) acc[tt][v] += __shfl_xor_sync(FULL, acc[tt][v], o);
    if (lane < P)
#pragma unroll
      for (int tt = 0; tt < TC; tt++)
#pragma unroll
        for (int v = 0; v < VW; v++) red[warp][tt][lane * VW + v] = acc[tt][v];
    __syncthreads();
    for (int i = tid; i < TC * E; i += ROUTE_THREADS) {
      const int tt = i / E, e = i % E;
      if (t0 + tt >= T) continue;
      float s = 0.f;
      for (int w = 0; w < ROUTE_THREADS / 32; w++) s += red[w][tt][e];
      lg[(t0 + tt) * E + e] = s;
      logits[(i64)(t0 + tt) * E + e] = s;
    }
    __syncthreads();
  }
  if (warp < T) { /* a warp a token, as moe_route */
    float l[MOE_ITEMS];
    unsigned valid = 0;
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++) {
      const int e = lane + 32 * j;
      l[j] = NEG_INF;
      if (e < E) valid |= 1u << j, l[j] = lg[warp * E + e];
    }
    int id;
    float w;
    route_select(l, valid, bias, lane, E, k, sigmoid, renorm, scaling, groups, topk_groups, &id, &w);
    if (lane < k) {
      ids[warp * k + lane] = id;
      weights[warp * k + lane] = w;
      sel[warp * k + lane] = id;
    }
  }
  __syncthreads();
  if (tid) return;
  /* The bookkeeping of at most 16 assignments, in one thread. */
  const int n = T * k;
  for (int e = 0; e < E; e++) next[e] = 0;
  for (int a = 0; a < n; a++)
    if (sel[a] >= 0 && sel[a] < E) next[sel[a]]++;
  int at = 0;
  for (int e = 0; e < E; e++) {
    const int c = next[e];
    store_index(counts, counts64, e, c);
    store_index(offsets, offsets64, e, at);
    next[e] = at;
    at += c;
  }
  store_index(offsets, offsets64, E, at);
  if (dropped) store_index(dropped, dropped64, 0, n - at);
  for (int a = 0; a < n; a++) { /* (token, slot) order: tokens ascending within an expert */
    const int e = sel[a], row = e >= 0 && e < E ? next[e]++ : -1;
    row_map[a] = row;
    if (row >= 0) meta[META_TOKEN + row] = a / k;
  }
  int G = 0, row = 0;
  for (int e = 0; e < E; e++) /* next[e] is now expert e's end */
    for (; row < next[e]; G++) {
      const int rows = next[e] - row < ROWS ? next[e] - row : ROWS;
      meta[META_GROUPS + 3 * G] = e;
      meta[META_GROUPS + 3 * G + 1] = row;
      meta[META_GROUPS + 3 * G + 2] = rows;
      for (int r = 0; r < rows; r++) meta[META_GROUP_OF + row + r] = G;
      row += rows;
    }
  meta[0] = G;
}

/* ---------------------------------------------------------------- the GEMVs */

/* This CTA's place: block b = ((g · splits) + s) · tiles + tile. */
typedef struct place {
  int g, s, tile, e, row0, n; /* group, slice, tile; the group's expert, first row and rows */
} place;

static __device__ __forceinline__ place place_of(const int *meta, int tiles, int splits) {
  place p;
  p.tile = blockIdx.x % tiles;
  p.s = blockIdx.x / tiles % splits;
  p.g = blockIdx.x / tiles / splits;
  p.e = meta[META_GROUPS + 3 * p.g];
  p.row0 = meta[META_GROUPS + 3 * p.g + 1];
  p.n = meta[META_GROUPS + 3 * p.g + 2];
  return p;
}

/* acc[m][r][v] += Σ over this thread's K rows kk (kk ≡ its lane mod KL,
 * kk < len) of xs[r][kk] · w[m][kk · ld + col + v], col its tile columns,
 * for nm matrices (1 or 2, a constant where it is inlined); col_ok: those
 * columns exist. */
static __device__ __forceinline__ void gemv(const elem_t *const *w, const int nm, i64 ld, int len, bool col_ok,
                                            const float *xs, float (*acc)[ROWS][VW]) {
  const int kl = threadIdx.x / CT, col = threadIdx.x % CT * VW, per = NB / nm; /* per: K rows a batch */
  for (int kb = 0; kb < len; kb += KL * per) {
    uint4 q[NB];
#pragma unroll
    for (int j = 0; j < NB; j++) {
      const int kk = kb + j / nm * KL + kl;
      q[j] = col_ok && kk < len ? ld_stream(w[j % nm] + (i64)kk * ld + col) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < NB; j++) {
      const int kk = kb + j / nm * KL + kl;
      float wv[VW];
      unpack(q[j], wv);
#pragma unroll
      for (int r = 0; r < ROWS; r++) {
        const float xv = xs[r * MAX_SLICE + kk];
#pragma unroll
        for (int v = 0; v < VW; v++) acc[j % nm][r][v] = fmaf(xv, wv[v], acc[j % nm][r][v]);
      }
    }
  }
}

/* out [nm][ROWS][TILE] = acc summed over the K lanes: the 4 of a warp by
 * shuffles, then the warps in order through red (the staged inputs'
 * memory, free once every thread is past gemv). */
static __device__ __forceinline__ void sum_lanes(float (*acc)[ROWS][VW], const int nm, float *red, float *out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int m = 0; m < nm; m++)
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
      for (int v = 0; v < VW; v++) {
        float s = acc[m][r][v];
        s += __shfl_xor_sync(FULL, s, 8);
        s += __shfl_xor_sync(FULL, s, 16);
        acc[m][r][v] = s;
      }
  __syncthreads();
  if (lane < CT)
#pragma unroll
    for (int m = 0; m < nm; m++)
#pragma unroll
      for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int v = 0; v < VW; v++) red[((warp * nm + m) * ROWS + r) * TILE + lane * VW + v] = acc[m][r][v];
  __syncthreads();
  for (int i = threadIdx.x; i < nm * ROWS * TILE; i += THREADS) {
    float s = 0.f;
    for (int w = 0; w < THREADS / 32; w++) s += red[w * nm * ROWS * TILE + i];
    out[i] = s;
  }
  __syncthreads();
}

/* Whether this CTA is the last of `expected` to arrive at the ticket: its
 * writes before are visible to that CTA, everyone's to it after. */
static __device__ __forceinline__ bool arrive(int *ticket, int expected) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == expected - 1;
  __syncthreads();
  if (last) __threadfence();
  return last != 0;
}

/* h [T·k, F] f32 = silu(x·W1ₑ) ∘ (x·W3ₑ) of each group's rows. x [T, d]
 * (rows x_stride apart); w1, w3 [E, d, F]; part [G_max][splits][tiles][2]
 * [ROWS][TILE] f32 and tickets [G_max · tiles] when splits > 1. */
extern "C" __global__ void __launch_bounds__(THREADS, OCC)
    moe_decode_up(const elem_t *x, i64 x_stride, const elem_t *w1, const elem_t *w3, const int *meta, float *h,
                  float *part, int *tickets, int d, int F, int tiles, int splits, int slice) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  __shared__ __align__(16) float xs[ROWS * MAX_SLICE];
  __shared__ float out[2 * ROWS * TILE];
  if ((int)(blockIdx.x / tiles / splits) >= meta[0]) return;
  const place p = place_of(meta, tiles, splits);
  const int k0 = p.s * slice, len = d - k0 < slice ? d - k0 : slice, n0 = p.tile * TILE;
#pragma unroll
  for (int r = 0; r < ROWS; r++) {
    const elem_t *xr = x + (i64)meta[META_TOKEN + p.row0 + (r < p.n ? r : 0)] * x_stride + k0;
    for (int kk = threadIdx.x; kk < MAX_SLICE; kk += THREADS)
      xs[r * MAX_SLICE + kk] = r < p.n && kk < len ? load_elem(xr[kk]) : 0.f;
  }
  __syncthreads();
  float acc[2][ROWS][VW];
#pragma unroll
  for (int m = 0; m < 2; m++)
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
      for (int v = 0; v < VW; v++) acc[m][r][v] = 0.f;
  const i64 at = ((i64)p.e * d + k0) * F + n0;
  const elem_t *w[2] = {w1 + at, w3 + at};
  gemv(w, 2, F, len, n0 + threadIdx.x % CT * VW < F, xs, acc);
  sum_lanes(acc, 2, xs, out);
  if (splits > 1) {
    const i64 size = 2 * ROWS * TILE, first = ((i64)p.g * splits * tiles + p.tile) * size;
    for (int i = threadIdx.x; i < size; i += THREADS) part[first + (i64)p.s * tiles * size + i] = out[i];
    if (!arrive(tickets + p.g * tiles + p.tile, splits)) return;
    for (int i = threadIdx.x; i < size; i += THREADS) {
      float s = 0.f;
      for (int j = 0; j < splits; j++) s += __ldcg(part + first + (i64)j * tiles * size + i);
      out[i] = s;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < ROWS * TILE; i += THREADS) {
    const int r = i / TILE, c = i % TILE;
    if (r >= p.n || n0 + c >= F) continue;
    const float a = out[i], b = out[ROWS * TILE + i];
    h[(i64)(p.row0 + r) * F + n0 + c] = a / (1.f + expf(-a)) * b;
  }
}

/* y [T, d] (rows y_stride apart) = Σ_i weights[t, i] · (h·W2ₑ)[row_map[t, i]]
 * in slot order. h [T·k, F] f32; w2 [E, F, d]; part [G_max][splits][tiles]
 * [ROWS][TILE] f32; tickets [tiles]. */
extern "C" __global__ void __launch_bounds__(THREADS, OCC)
    moe_decode_down(const float *h, const elem_t *w2, const int *meta, const int *row_map, const float *weights,
                    elem_t *y, i64 y_stride, float *part, int *tickets, int T, int k, int d, int F, int tiles,
                    int splits, int slice) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  __shared__ __align__(16) float xs[ROWS * MAX_SLICE];
  __shared__ float out[ROWS * TILE];
  const int G = meta[0];
  if ((int)(blockIdx.x / tiles / splits) >= G) return;
  const place p = place_of(meta, tiles, splits);
  const int k0 = p.s * slice, len = F - k0 < slice ? F - k0 : slice, n0 = p.tile * TILE;
#pragma unroll
  for (int r = 0; r < ROWS; r++)
    for (int kk = threadIdx.x; kk < MAX_SLICE; kk += THREADS)
      xs[r * MAX_SLICE + kk] = r < p.n && kk < len ? h[(i64)(p.row0 + r) * F + k0 + kk] : 0.f;
  __syncthreads();
  float acc[1][ROWS][VW];
#pragma unroll
  for (int r = 0; r < ROWS; r++)
#pragma unroll
    for (int v = 0; v < VW; v++) acc[0][r][v] = 0.f;
  const elem_t *w[1] = {w2 + ((i64)p.e * F + k0) * d + n0};
  gemv(w, 1, d, len, n0 + threadIdx.x % CT * VW < d, xs, acc);
  sum_lanes(acc, 1, xs, out);
  const i64 size = ROWS * TILE;
  for (int i = threadIdx.x; i < size; i += THREADS)
    part[(((i64)p.g * splits + p.s) * tiles + p.tile) * size + i] = out[i];
  if (!arrive(tickets + p.tile, G * splits)) return;
  for (int i = threadIdx.x; i < T * TILE; i += THREADS) {
    const int t = i / TILE, c = i % TILE;
    if (n0 + c >= d) continue;
    float acc_y = 0.f;
    for (int a = 0; a < k; a++) {
      const int row = row_map[t * k + a];
      if (row < 0) continue;
      const int g = meta[META_GROUP_OF + row], r = row - meta[META_GROUPS + 3 * g + 1];
      const float *src = part + ((i64)g * splits * tiles + p.tile) * size + r * TILE + c;
      float v = 0.f;
      for (int j = 0; j < splits; j++) v += __ldcg(src + (i64)j * tiles * size);
      acc_y += weights[t * k + a] * v;
    }
    y[(i64)t * y_stride + n0 + c] = store_elem(acc_y);
  }
}
