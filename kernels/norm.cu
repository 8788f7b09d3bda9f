/* RMSNorm and LayerNorm over the last dimension: the forward with an
 * optional residual add before it, and the backward with the weight and
 * bias gradients (include/smelt/norm.h has the definitions).
 *
 * Prelude: SMELT_DT (x's dtype); SMELT_WDT (weight and bias: SMELT_DT or
 * f32); SMELT_GROUP threads per row (32: one warp, several rows per CTA;
 * more: the whole CTA, SMELT_GROUP == SMELT_BLOCK); SMELT_ITEMS elements
 * per thread per tile; SMELT_LOOP; SMELT_BWD (0: the forward's entry
 * points, 1: the backward's).
 *   SMELT_LOOP 0: a row (at most GROUP*ITEMS elements) is one tile held in
 *     registers: every tensor is read once and written once, the op's
 *     bandwidth floor. The kind is a run-time argument: one branch per row.
 *     The grid holds the CTAs that fit at once, each walking rows; the
 *     forward fetches a group's next row (raw 16-bit data, half the
 *     registers of floats) before reducing this one, so loads stay in
 *     flight through the reductions and stores.
 *   SMELT_LOOP 1: longer rows in tiles, each pass reading the row again
 *     (from L2 while the rows in flight fit there).
 * Entry points by layout (the host picks per run): *_vec when every row
 * start and C are multiples of the 16-byte vector and the parameter
 * vectors are 16-byte aligned (16-byte accesses), *_unit otherwise (one
 * element per access, still coalesced).
 *
 * Statistics are f32; sums are warp shuffles (every lane gets the same
 * bits) and, for a whole-CTA group, one pass over the warps' sums in shared
 * memory. The backward's dweight and dbias are deterministic without
 * atomics: each row group keeps its columns' sums in registers (a thread
 * owns the same columns in every row) and writes them as one partial row;
 * norm_bwd_reduce then adds the partial rows of each column in a fixed
 * order. Outputs may be their inputs exactly (y = x, h_out = residual,
 * dx = dy): each element is read by the thread that later writes it.
 */
#include "smelt_device.cuh"

#if !defined(SMELT_DT) || !defined(SMELT_WDT) || !defined(SMELT_GROUP) || !defined(SMELT_BLOCK) || \
    !defined(SMELT_ITEMS) || !defined(SMELT_LOOP) || !defined(SMELT_BWD)
#error "norm.cu needs SMELT_DT, SMELT_WDT, SMELT_GROUP, SMELT_BLOCK, SMELT_ITEMS, SMELT_LOOP and SMELT_BWD"
#endif

#if SMELT_WDT == SMELT_DT_F32
typedef float welem_t;
static __device__ __forceinline__ float load_w(welem_t v) { return v; }
static __device__ __forceinline__ welem_t store_w(float f) { return f; }
#elif SMELT_WDT == SMELT_DT
typedef elem_t welem_t;
static __device__ __forceinline__ float load_w(welem_t v) { return load_elem(v); }
static __device__ __forceinline__ welem_t store_w(float f) { return store_elem(f); }
#else
#error "SMELT_WDT must be SMELT_DT or f32"
#endif

/* Elements per 16-byte vector, vectors per tile and thread, rows per CTA. */
#define VW SMELT_VW
#define CHUNKS (SMELT_ITEMS / VW)
#define RPC (SMELT_BLOCK / SMELT_GROUP)
#define KIND_LAYER 1
#define FULL 0xffffffffu

#if SMELT_ITEMS % (16 / 2) != 0
#error "SMELT_ITEMS must be a multiple of 8 (a whole 16-byte vector of any dtype)"
#endif

enum { MODE_VEC, MODE_UNIT };

/* Column of this thread's item i in the tile at `base`: in vec mode chunk
 * c = i / VW covers base + (c*GROUP + lane)*VW + [0, VW), else item i is
 * base + i*GROUP + lane, so neighbouring threads touch neighbouring memory. */
static __device__ __forceinline__ i64 col(i64 base, int i, int lane, int mode) {
  return mode == MODE_VEC ? base + (i64)((i / VW) * SMELT_GROUP + lane) * VW + i % VW
                          : base + (i64)i * SMELT_GROUP + lane;
}

union wvec16 {
  uint4 u[VW * sizeof(welem_t) / 16];
  welem_t e[VW];
};

/* A tile as loaded, before conversion: CHUNKS 16-byte vectors (for bf16
 * and f16 half the registers of the floats), so that the next row can be
 * in flight while this one is reduced. */
typedef struct raw_tile {
  smelt_vec16 c[CHUNKS];
} raw_tile;

/* The tile at base of a row; columns past C read as 0 (nothing to a sum). */
static __device__ __forceinline__ void fetch_tile(const elem_t *row, i64 C, i64 base, int lane, int mode,
                                                  raw_tile &t) {
#pragma unroll
  for (int c = 0; c < CHUNKS; c++) {
    const i64 j = col(base, c * VW, lane, mode);
    if (mode == MODE_VEC) {
      if (j < C) {
        t.c[c].u = *(const uint4 *)(row + j);
      } else {
        t.c[c].u.x = t.c[c].u.y = t.c[c].u.z = t.c[c].u.w = 0u;
      }
    } else {
#pragma unroll
      for (int e = 0; e < VW; e++) {
        const i64 k = col(base, c * VW + e, lane, mode);
        t.c[c].e[e] = k < C ? row[k] : (elem_t)0;
      }
    }
  }
}

static __device__ __forceinline__ void unpack_tile(const raw_tile &t, float *v) {
#pragma unroll
  for (int c = 0; c < CHUNKS; c++)
#pragma unroll
    for (int e = 0; e < VW; e++) v[c * VW + e] = load_elem(t.c[c].e[e]);
}

/* A tile of a row as floats. */
static __device__ __forceinline__ void load_tile(const elem_t *row, i64 C, i64 base, int lane, int mode, float *v) {
  raw_tile t;
  fetch_tile(row, C, base, lane, mode, t);
  unpack_tile(t, v);
}

static __device__ __forceinline__ void store_tile(elem_t *row, i64 C, i64 base, int lane, int mode, const float *v) {
#pragma unroll
  for (int c = 0; c < CHUNKS; c++) {
    const i64 j = col(base, c * VW, lane, mode);
    if (mode == MODE_VEC) {
      if (j < C) {
        smelt_vec16 w;
#pragma unroll
        for (int e = 0; e < VW; e++) w.e[e] = store_elem(v[c * VW + e]);
        *(uint4 *)(row + j) = w.u;
      }
    } else {
#pragma unroll
      for (int e = 0; e < VW; e++) {
        const i64 k = col(base, c * VW + e, lane, mode);
        if (k < C) row[k] = store_elem(v[c * VW + e]);
      }
    }
  }
}

/* The weight or bias of the tile's columns; `dflt` when the vector is absent. */
static __device__ __forceinline__ void load_wtile(const welem_t *p, i64 C, i64 base, int lane, int mode, float dflt,
                                                  float *v) {
#pragma unroll
  for (int c = 0; c < CHUNKS; c++) {
    const i64 j = col(base, c * VW, lane, mode);
    if (p && mode == MODE_VEC && j < C) {
      wvec16 w;
#pragma unroll
      for (int q = 0; q < (int)(VW * sizeof(welem_t) / 16); q++) w.u[q] = ((const uint4 *)(p + j))[q];
#pragma unroll
      for (int e = 0; e < VW; e++) v[c * VW + e] = load_w(w.e[e]);
    } else {
#pragma unroll
      for (int e = 0; e < VW; e++) {
        const i64 k = col(base, c * VW + e, lane, mode);
        v[c * VW + e] = p && k < C ? load_w(p[k]) : dflt;
      }
    }
  }
}

/* Whether item i of the tile at base is a column of the row. */
static __device__ __forceinline__ bool valid(i64 base, int i, int lane, int mode, i64 C) {
  return col(base, i, lane, mode) < C;
}

/* Group-wide sums of a and b: xor shuffles within the warp (every lane gets
 * the same bits), then for a whole-CTA group one pass over the warps' sums
 * in `red` (64 floats, alternated between rows by the caller so that a row's
 * writes never meet the previous row's reads). */
static __device__ __forceinline__ void group_sum2(float *a, float *b, float *red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    *a += __shfl_xor_sync(FULL, *a, o);
    *b += __shfl_xor_sync(FULL, *b, o);
  }
#if SMELT_GROUP > 32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    red[warp] = *a;
    red[32 + warp] = *b;
  }
  __syncthreads();
  *a = smelt_warp_sum(lane < SMELT_GROUP / 32 ? red[lane] : 0.f);
  *b = smelt_warp_sum(lane < SMELT_GROUP / 32 ? red[32 + lane] : 0.f);
#else
  (void)red;
#endif
}

/* The host merges row dims, so one dim (offset r * stride) is the usual case. */
static __device__ __forceinline__ i64 row_offset(const smelt_kshape &s, i64 r) {
  return s.ndim == 1 ? r * s.strides[0] : smelt_offset(s, r);
}

#if SMELT_BWD == 0
/* ---- forward */

typedef struct fwd_args {
  const elem_t *x, *res;
  const welem_t *w, *b;
  elem_t *y, *h;
  float *mean, *rstd;
  i64 rows, C;
  float eps;
  int kind;
} fwd_args;

/* h = x (+ residual, rounded to the dtype as h_out stores it) for one tile;
 * `again` reads h back from h_out when the first pass stored it there (the
 * residual may be h_out itself by then). */
static __device__ __forceinline__ void load_h(const fwd_args &a, const elem_t *xr, const elem_t *rr, elem_t *hr, i64 base,
                                              int lane, int mode, bool again, float *h) {
  if (again && hr) {
    load_tile(hr, a.C, base, lane, mode, h);
    return;
  }
  load_tile(xr, a.C, base, lane, mode, h);
  if (rr) {
    float t[SMELT_ITEMS];
    load_tile(rr, a.C, base, lane, mode, t);
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) h[i] = load_elem(store_elem(h[i] + t[i]));
    if (hr && !again) store_tile(hr, a.C, base, lane, mode, h);
  }
}

/* y = (h - mean) * rstd * w + b for one tile. */
static __device__ __forceinline__ void store_y(const fwd_args &a, elem_t *yr, i64 base, int lane, int mode, float mean,
                                               float rstd, float *h) {
  float w[SMELT_ITEMS], b[SMELT_ITEMS];
  load_wtile(a.w, a.C, base, lane, mode, 1.f, w);
  load_wtile(a.b, a.C, base, lane, mode, 0.f, b);
#pragma unroll
  for (int i = 0; i < SMELT_ITEMS; i++) h[i] = (h[i] - mean) * rstd * w[i] + b[i];
  store_tile(yr, a.C, base, lane, mode, h);
}

/* The row's mean from this thread's sum (the group's sum over C). */
static __device__ __forceinline__ float row_mean(const fwd_args &a, float s, float *red) {
  float unused = 0.f;
  group_sum2(&s, &unused, red);
  return s / (float)a.C;
}

/* rstd from this thread's sum of squared deviations, in red's other half. */
static __device__ __forceinline__ float row_rstd(const fwd_args &a, float sq, float *red) {
  float unused = 0.f;
  group_sum2(&sq, &unused, red + 64);
  return rsqrtf(sq / (float)a.C + a.eps);
}

/* The statistics, written by the group's first thread. */
static __device__ __forceinline__ void write_stats(float *mean_out, float *rstd_out, int lane, float mean, float rstd) {
  if (lane == 0) {
    if (mean_out) *mean_out = mean;
    if (rstd_out) *rstd_out = rstd;
  }
}

#if SMELT_LOOP == 0
/* One row from its fetched tiles (rc is read only with a residual). */
static __device__ __forceinline__ void fwd_row(const fwd_args &a, const raw_tile &xc, const raw_tile &rc, elem_t *yr,
                                               elem_t *hr, float *mean_out, float *rstd_out, int lane, float *red,
                                               int mode) {
  float h[SMELT_ITEMS];
  unpack_tile(xc, h);
  if (a.res) {
    float t[SMELT_ITEMS];
    unpack_tile(rc, t);
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) h[i] = load_elem(store_elem(h[i] + t[i]));
    if (hr) store_tile(hr, a.C, 0, lane, mode, h);
  }
  float s = 0.f, mean = 0.f;
  if (a.kind == KIND_LAYER) {
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) s += h[i];
    mean = row_mean(a, s, red);
  }
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < SMELT_ITEMS; i++) {
    const float d = valid(0, i, lane, mode, a.C) ? h[i] - mean : 0.f;
    sq += d * d;
  }
  const float rstd = row_rstd(a, sq, red);
  store_y(a, yr, 0, lane, mode, mean, rstd, h);
  write_stats(mean_out, rstd_out, lane, mean, rstd);
}

/* Each group walks rows r = its first, + the grid's rows per step, with
 * the next row's x and residual fetched before this row is reduced, so a
 * group's loads stay in flight through its reductions and stores (the
 * grid is a few CTAs per SM). `red` alternates halves between rows. */
static __device__ __forceinline__ void fwd_rows(const fwd_args &a, const smelt_kshape &xs, const smelt_kshape &rs,
                                                const smelt_kshape &ys, const smelt_kshape &hs,
                                                const smelt_kshape &ms, const smelt_kshape &ss, int mode) {
  __shared__ float red[2][128];
  const int lane = threadIdx.x % SMELT_GROUP, group = threadIdx.x / SMELT_GROUP;
  const i64 step = (i64)gridDim.x * RPC;
  i64 r = (i64)blockIdx.x * RPC + group;
  raw_tile xn, rn = {};
  if (r < a.rows) {
    fetch_tile(a.x + row_offset(xs, r), a.C, 0, lane, mode, xn);
    if (a.res) fetch_tile(a.res + row_offset(rs, r), a.C, 0, lane, mode, rn);
  }
  for (int parity = 0; r < a.rows; r += step, parity ^= 1) {
    const raw_tile xc = xn, rc = rn;
    if (r + step < a.rows) {
      fetch_tile(a.x + row_offset(xs, r + step), a.C, 0, lane, mode, xn);
      if (a.res) fetch_tile(a.res + row_offset(rs, r + step), a.C, 0, lane, mode, rn);
    }
    fwd_row(a, xc, rc, a.y + row_offset(ys, r), a.h ? a.h + row_offset(hs, r) : 0,
            a.mean ? a.mean + row_offset(ms, r) : 0, a.rstd ? a.rstd + row_offset(ss, r) : 0, lane, red[parity], mode);
  }
}
#else
static __device__ __forceinline__ void fwd_row(const fwd_args &a, const elem_t *xr, const elem_t *rr, elem_t *yr,
                                               elem_t *hr, float *mean_out, float *rstd_out, int lane, float *red,
                                               int mode) {
  const i64 tile = (i64)SMELT_GROUP * SMELT_ITEMS;
  const bool layer = a.kind == KIND_LAYER;
  float s = 0.f, sq = 0.f, mean = 0.f;
  for (i64 base = 0; base < a.C; base += tile) {
    float h[SMELT_ITEMS];
    load_h(a, xr, rr, hr, base, lane, mode, false, h);
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) {
      s += h[i];
      sq += h[i] * h[i];
    }
  }
  if (layer) {
    mean = row_mean(a, s, red);
    /* The deviations from the mean, in a second pass: no cancellation. */
    sq = 0.f;
    for (i64 base = 0; base < a.C; base += tile) {
      float h[SMELT_ITEMS];
      load_h(a, xr, rr, hr, base, lane, mode, true, h);
#pragma unroll
      for (int i = 0; i < SMELT_ITEMS; i++) {
        const float d = valid(base, i, lane, mode, a.C) ? h[i] - mean : 0.f;
        sq += d * d;
      }
    }
  }
  const float rstd = row_rstd(a, sq, red);
  for (i64 base = 0; base < a.C; base += tile) {
    float h[SMELT_ITEMS];
    load_h(a, xr, rr, hr, base, lane, mode, true, h);
    store_y(a, yr, base, lane, mode, mean, rstd, h);
  }
  write_stats(mean_out, rstd_out, lane, mean, rstd);
}

/* Each group walks rows r = its first, + the grid's rows per step; `red`
 * alternates halves between a group's successive rows. */
static __device__ __forceinline__ void fwd_rows(const fwd_args &a, const smelt_kshape &xs, const smelt_kshape &rs,
                                                const smelt_kshape &ys, const smelt_kshape &hs,
                                                const smelt_kshape &ms, const smelt_kshape &ss, int mode) {
  __shared__ float red[2][128];
  const int lane = threadIdx.x % SMELT_GROUP, group = threadIdx.x / SMELT_GROUP;
  int parity = 0;
  for (i64 r = (i64)blockIdx.x * RPC + group; r < a.rows; r += (i64)gridDim.x * RPC, parity ^= 1)
    fwd_row(a, a.x + row_offset(xs, r), a.res ? a.res + row_offset(rs, r) : 0, a.y + row_offset(ys, r),
            a.h ? a.h + row_offset(hs, r) : 0, a.mean ? a.mean + row_offset(ms, r) : 0,
            a.rstd ? a.rstd + row_offset(ss, r) : 0, lane, red[parity], mode);
}
#endif

#define FWD_ENTRY(name, mode)                                                                                         \
  extern "C" __global__ void __launch_bounds__(SMELT_BLOCK)                                                           \
      name(const elem_t *x, const elem_t *res, const welem_t *w, const welem_t *b, elem_t *y, elem_t *h, float *mean, \
           float *rstd, i64 rows, i64 C, float eps, int kind, smelt_kshape xs, smelt_kshape rs, smelt_kshape ys,     \
           smelt_kshape hs, smelt_kshape ms, smelt_kshape ss) {                                                       \
    const fwd_args a = {x, res, w, b, y, h, mean, rstd, rows, C, eps, kind};                                          \
    fwd_rows(a, xs, rs, ys, hs, ms, ss, mode);                                                                        \
  }

FWD_ENTRY(norm_fwd_vec, MODE_VEC)
FWD_ENTRY(norm_fwd_unit, MODE_UNIT)

#else
/* ---- backward */

typedef struct bwd_args {
  const elem_t *dy, *x;
  const welem_t *w;
  const float *mean, *rstd;
  const elem_t *dh;
  elem_t *dx;
  float *pdw, *pdb; /* [parts, C] partial sums each, or NULL when not wanted */
  i64 rows, C;
  int kind;
} bwd_args;

/* One tile's dy, xhat and g = dy * w. */
static __device__ __forceinline__ void load_grad_tile(const bwd_args &a, const elem_t *dyr, const elem_t *xr, i64 base,
                                                      int lane, int mode, float mean, float rstd, float *dy, float *xh,
                                                      float *g) {
  load_tile(dyr, a.C, base, lane, mode, dy);
  load_tile(xr, a.C, base, lane, mode, xh);
  load_wtile(a.w, a.C, base, lane, mode, 1.f, g);
#pragma unroll
  for (int i = 0; i < SMELT_ITEMS; i++) {
    xh[i] = (xh[i] - mean) * rstd;
    g[i] *= dy[i];
  }
}

/* dx = rstd (g - mg - xhat mgx) (+ dh) for one tile. */
static __device__ __forceinline__ void store_dx(const bwd_args &a, const elem_t *dhr, elem_t *dxr, i64 base, int lane,
                                                int mode, float rstd, float mg, float mgx, const float *xh, float *g) {
  float d[SMELT_ITEMS];
  if (dhr) {
    load_tile(dhr, a.C, base, lane, mode, d);
  } else {
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) d[i] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < SMELT_ITEMS; i++) g[i] = rstd * (g[i] - mg - xh[i] * mgx) + d[i];
  store_tile(dxr, a.C, base, lane, mode, g);
}

/* The row's statistics and the means of g and g * xhat. */
static __device__ __forceinline__ void row_means(const bwd_args &a, float sg, float sgx, float *red, float *mg,
                                                 float *mgx) {
  group_sum2(&sg, &sgx, red);
  *mg = a.kind == KIND_LAYER ? sg / (float)a.C : 0.f;
  *mgx = sgx / (float)a.C;
}

#if SMELT_LOOP == 0
static __device__ __forceinline__ void bwd_rows(const bwd_args &a, const smelt_kshape &dys, const smelt_kshape &xs,
                                                const smelt_kshape &ms, const smelt_kshape &ss,
                                                const smelt_kshape &dhs, const smelt_kshape &dxs, int mode) {
  __shared__ float red[2][64];
  const int lane = threadIdx.x % SMELT_GROUP, group = threadIdx.x / SMELT_GROUP;
  float dw[SMELT_ITEMS], db[SMELT_ITEMS];
#pragma unroll
  for (int i = 0; i < SMELT_ITEMS; i++) dw[i] = db[i] = 0.f;
  int parity = 0;
  for (i64 r = (i64)blockIdx.x * RPC + group; r < a.rows; r += (i64)gridDim.x * RPC, parity ^= 1) {
    const float mean = a.mean ? a.mean[row_offset(ms, r)] : 0.f, rstd = a.rstd[row_offset(ss, r)];
    float dy[SMELT_ITEMS], xh[SMELT_ITEMS], g[SMELT_ITEMS];
    load_grad_tile(a, a.dy + row_offset(dys, r), a.x + row_offset(xs, r), 0, lane, mode, mean, rstd, dy, xh, g);
    float sg = 0.f, sgx = 0.f, mg, mgx;
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) {
      sg += g[i];
      sgx += g[i] * xh[i];
      dw[i] += dy[i] * xh[i];
      db[i] += dy[i];
    }
    row_means(a, sg, sgx, red[parity], &mg, &mgx);
    store_dx(a, a.dh ? a.dh + row_offset(dhs, r) : 0, a.dx + row_offset(dxs, r), 0, lane, mode, rstd, mg, mgx, xh, g);
  }
  /* This group's partial row (zeros when it had no rows). */
  const i64 part = (i64)blockIdx.x * RPC + group;
#pragma unroll
  for (int i = 0; i < SMELT_ITEMS; i++) {
    const i64 j = col(0, i, lane, mode);
    if (j < a.C) {
      if (a.pdw) a.pdw[part * a.C + j] = dw[i];
      if (a.pdb) a.pdb[part * a.C + j] = db[i];
    }
  }
}
#else
static __device__ __forceinline__ void bwd_rows(const bwd_args &a, const smelt_kshape &dys, const smelt_kshape &xs,
                                                const smelt_kshape &ms, const smelt_kshape &ss,
                                                const smelt_kshape &dhs, const smelt_kshape &dxs, int mode) {
  __shared__ float red[2][64];
  const int lane = threadIdx.x % SMELT_GROUP, group = threadIdx.x / SMELT_GROUP;
  const i64 tile = (i64)SMELT_GROUP * SMELT_ITEMS, part = (i64)blockIdx.x * RPC + group;
  float *pdw = a.pdw ? a.pdw + part * a.C : 0, *pdb = a.pdb ? a.pdb + part * a.C : 0;
  /* The partial rows live in global memory here, each column read and
   * written only by the thread that owns it in every tile. */
  for (i64 base = 0; base < a.C; base += tile)
#pragma unroll
    for (int i = 0; i < SMELT_ITEMS; i++) {
      const i64 j = col(base, i, lane, mode);
      if (j < a.C) {
        if (pdw) pdw[j] = 0.f;
        if (pdb) pdb[j] = 0.f;
      }
    }
  int parity = 0;
  for (i64 r = (i64)blockIdx.x * RPC + group; r < a.rows; r += (i64)gridDim.x * RPC, parity ^= 1) {
    const float mean = a.mean ? a.mean[row_offset(ms, r)] : 0.f, rstd = a.rstd[row_offset(ss, r)];
    const elem_t *dyr = a.dy + row_offset(dys, r), *xr = a.x + row_offset(xs, r);
    float sg = 0.f, sgx = 0.f, mg, mgx;
    for (i64 base = 0; base < a.C; base += tile) {
      float dy[SMELT_ITEMS], xh[SMELT_ITEMS], g[SMELT_ITEMS];
      load_grad_tile(a, dyr, xr, base, lane, mode, mean, rstd, dy, xh, g);
#pragma unroll
      for (int i = 0; i < SMELT_ITEMS; i++) {
        sg += g[i];
        sgx += g[i] * xh[i];
      }
    }
    row_means(a, sg, sgx, red[parity], &mg, &mgx);
    for (i64 base = 0; base < a.C; base += tile) {
      float dy[SMELT_ITEMS], xh[SMELT_ITEMS], g[SMELT_ITEMS];
      load_grad_tile(a, dyr, xr, base, lane, mode, mean, rstd, dy, xh, g);
#pragma unroll
      for (int i = 0; i < SMELT_ITEMS; i++) {
        const i64 j = col(base, i, lane, mode);
        if (j < a.C) {
          if (pdw) pdw[j] += dy[i] * xh[i];
          if (pdb) pdb[j] += dy[i];
        }
      }
      store_dx(a, a.dh ? a.dh + row_offset(dhs, r) : 0, a.dx + row_offset(dxs, r), base, lane, mode, rstd, mg, mgx,
               xh, g);
    }
  }
}
#endif

#define BWD_ENTRY(name, mode)                                                                                          \
  extern "C" __global__ void __launch_bounds__(SMELT_BLOCK)                                                            \
      name(const elem_t *dy, const elem_t *x, const welem_t *w, const float *mean, const float *rstd, const elem_t *dh, \
           elem_t *dx, float *pdw, float *pdb, i64 rows, i64 C, int kind, smelt_kshape dys, smelt_kshape xs,          \
           smelt_kshape ms, smelt_kshape ss, smelt_kshape dhs, smelt_kshape dxs) {                                    \
    const bwd_args a = {dy, x, w, mean, rstd, dh, dx, pdw, pdb, rows, C, kind};                                       \
    bwd_rows(a, dys, xs, ms, ss, dhs, dxs, mode);                                                                      \
  }

BWD_ENTRY(norm_bwd_vec, MODE_VEC)
BWD_ENTRY(norm_bwd_unit, MODE_UNIT)

/* The second stage: out[j] = the sum of part[p, j] over p = 0..parts-1, in
 * that order per thread row (ty) and then over the 8 thread rows, so the
 * result depends only on the partial rows, never on timing. 32 columns per
 * CTA (a warp reads 128 contiguous bytes per partial row); blockIdx.y picks
 * dweight (0) or dbias (1). */
extern "C" __global__ void __launch_bounds__(256)
    norm_bwd_reduce(const float *pdw, const float *pdb, i64 parts, i64 C, welem_t *dw, welem_t *db) {
  __shared__ float acc[8][33];
  const float *part = blockIdx.y ? pdb : pdw;
  welem_t *out = blockIdx.y ? db : dw;
  if (!out) return;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const i64 j = (i64)blockIdx.x * 32 + tx;
  float s = 0.f;
  if (j < C)
    for (i64 p = ty; p < parts; p += 8) s += part[p * C + j];
  acc[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && j < C) {
    float t = acc[0][tx];
#pragma unroll
    for (int k = 1; k < 8; k++) t += acc[k][tx];
    out[j] = store_w(t);
  }
}
#endif
