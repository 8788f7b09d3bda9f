/* smelt_peer on CUDA, the backward: runs take workspace from the context's
 * pool and launch, all stream-ordered.
 *
 *   GEMM q -> peer_rescore (qn, scores, gates of the given ids)
 *   -> expert backward (per use a, dz, d gate; dx from experts)
 *   -> peer_route_bwd (d score, d q, norm-parameter terms)
 *   -> GEMM dx = dq Wqᵀ + dx_experts, GEMM dWq = xᵀ dq,
 *      column sums (dbq, norm params), sorted segment sums
 *      (du, dv: a warp per expert row, every row written;
 *      the sparse rows: the runs listed in expert order, a warp
 *      per distinct expert;
 *      d sub-keys: a CTA per key row). */
#include "peer_cuda.h"

#define OP "smelt_peer"

/* Sorts n (key, use) pairs by key (stable, LSD, 8 bits a pass), keys from
 * peer_use_keys with the given mapping; max_key bounds the keys (the
 * sentinel included). On return *keys / *vals point at the sorted arrays
 * (inside the workspace k0/v0/k1/v1). */
typedef struct sort_ws {
  uint32_t *k0, *v0, *k1, *v1, *hist; /* hist: 256 words a tile of keys, then a word a scan tile of those */
} sort_ws;

/* The histograms' exclusive scan: two-level (one block a scan tile) where
 * one block would loop over many tiles; tsum holds a word a scan tile. */
static smelt_status scan_hist(smelt_ctx *ctx, const smelt__peer_util *u, void *hist, int64_t count, void *tsum) {
  const int64_t tiles = (count + SMELT__PEER_SCAN_TILE - 1) / SMELT__PEER_SCAN_TILE;
  if (tiles <= 1) return smelt__peer_scan(ctx, u, hist, count, NULL);
  void *p[] = {&hist, &count, &tsum};
  smelt_status s = smelt__cuda_launch(ctx, OP, u->scan_sums, (unsigned)tiles, 1, 1, 256, 0, p);
  if (!s) s = smelt__peer_scan(ctx, u, tsum, tiles, NULL);
  if (!s) s = smelt__cuda_launch(ctx, OP, u->scan_add, (unsigned)tiles, 1, 1, 256, 0, p);
  return s;
}

static smelt_status sort_uses(smelt_ctx *ctx, const smelt__peer_util *u, const sort_ws *ws, const void *ids, int64_t n,
                              int64_t h, int64_t k, int64_t N, int64_t div, int64_t mod, int64_t table_n,
                              uint32_t sentinel, uint32_t **keys, uint32_t **vals) {
  void *kp = ws->k0;
  {
    void *params[] = {(void *)&ids, &n, &h, &k, &N, &div, &mod, &table_n, &sentinel, &kp};
    smelt_status s = smelt__cuda_launch(ctx, OP, u->use_keys, (unsigned)((n + 255) / 256), 1, 1, 256, 0, params);
    if (s) return s;
  }
  int64_t nblocks = (n + SMELT__PEER_SORT_TILE - 1) / SMELT__PEER_SORT_TILE;
  int bits = 1;
  while (bits < 32 && ((uint64_t)sentinel >> bits)) bits++;
  /* ping-pong: the keys are in kbuf[cur]; the values in vbuf[cur], or the
   * identity before the first pass (vin NULL) */
  uint32_t *kbuf[2] = {ws->k0, ws->k1}, *vbuf[2] = {ws->v0, ws->v1};
  int cur = 0;
  void *vin = NULL, *hist = ws->hist;
  for (int shift = 0; shift < bits; shift += 8) {
    void *kin = kbuf[cur], *kout = kbuf[cur ^ 1], *vout = vbuf[cur ^ 1];
    void *hp[] = {&kin, &n, &shift, &hist, &nblocks};
    smelt_status s = smelt__cuda_launch(ctx, OP, u->sort_hist, (unsigned)nblocks, 1, 1, 256, 0, hp);
    if (!s) s = scan_hist(ctx, u, hist, 256 * nblocks, ws->hist + 256 * nblocks);
    void *sp[] = {&kin, &vin, &kout, &vout, &n, &shift, &hist, &nblocks};
    if (!s) s = smelt__cuda_launch(ctx, OP, u->sort_scatter, (unsigned)nblocks, 1, 1, 256, 0, sp);
    if (s) return s;
    cur ^= 1;
    vin = vbuf[cur];
  }
  *keys = kbuf[cur];
  *vals = vbuf[cur];
  return SMELT_OK;
}

/* out[c * stride] = Σ_r in[r, c] (f32 rows x cols), deterministic. */
static smelt_status colsum(smelt_ctx *ctx, const smelt__peer_util *u, const void *in, int64_t rows, int64_t cols,
                           void *part, const smelt_tensor *out) {
  void *pp[] = {(void *)&in, &rows, &cols, &part};
  smelt_status s = smelt__cuda_launch(ctx, OP, u->colsum_partial, (unsigned)((cols + 255) / 256), SMELT__PEER_CS_CHUNKS,
                                      1, 256, 0, pp);
  if (s) return s;
  void *o = out->data;
  int64_t stride = out->ndim == 1 ? out->strides[0] : 1; /* 2-D outputs ([h, dq]) are contiguous */
  int dt = out->dtype;
  void *fp[] = {&part, &cols, &o, &stride, &dt};
  return smelt__cuda_launch(ctx, OP, u->colsum_final, (unsigned)((cols + 255) / 256), 1, 1, 256, 0, fp);
}

/* bounds[2 r], bounds[2 r + 1] = the run of key r in the n sorted keys
 * (empty for rows without uses), r < nrows. */
static smelt_status seg_bounds(smelt_ctx *ctx, const smelt__peer_util *u, void *skeys, int64_t n, int64_t nrows,
                               void *bounds) {
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)(uintptr_t)bounds, 0, (size_t)nrows * 8, ctx->cuda->stream),
                  OP);
  void *params[] = {&skeys, &n, &nrows, &bounds};
  return smelt__cuda_launch(ctx, OP, u->seg_bounds, (unsigned)((n + 255) / 256), 1, 1, 256, 0, params);
}

static smelt_status memset0(smelt_ctx *ctx, const smelt_tensor *t) {
  const size_t bytes = (size_t)smelt_tensor_numel(t) * smelt_dtype_size(t->dtype);
  if (!bytes) return SMELT_OK;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)(uintptr_t)t->data, 0, bytes, ctx->cuda->stream), OP);
  return SMELT_OK;
}

/* The runs of the n sorted keys < nrows listed in key order (the sparse
 * expert gradients): bounds[2 r], bounds[2 r + 1] and ids[r] for run r,
 * -1 in ids past the runs, their number to *total (u64) and *count (i64,
 * when not NULL). bsum: one u32 a tile of TILE keys. */
static smelt_status seg_compact(smelt_ctx *ctx, const smelt__peer_util *u, void *skeys, int64_t n, int64_t nrows,
                                void *bsum, void *total, void *bounds, void *ids, void *count) {
  const unsigned tiles = (unsigned)((n + SMELT__PEER_SCAN_TILE - 1) / SMELT__PEER_SCAN_TILE);
  void *hp[] = {&skeys, &n, &nrows, &bsum};
  smelt_status s = smelt__cuda_launch(ctx, OP, u->seg_heads, tiles, 1, 1, 256, 0, hp);
  if (!s) s = smelt__peer_scan(ctx, u, bsum, tiles, total);
  void *cp[] = {&skeys, &n, &nrows, &bsum, &total, &bounds, &ids, &count};
  if (!s) s = smelt__cuda_launch(ctx, OP, u->seg_compact, tiles, 1, 1, 256, 0, cp);
  return s;
}

/* Expert gradient rows by sorted segment sums (peer_dv, peer_du): dense
 * (rows = N, bounds by expert, nrun NULL) or sparse (rows = the uses, bounds
 * by rank, nrun the device count of runs). */
static smelt_status expert_grads(smelt_ctx *ctx, const smelt__peer_state *ps, const smelt__peer_util *u, void *bnd,
                                 void *sv, int64_t rows, void *nrun, const smelt_tensor *x, const smelt_tensor *dy,
                                 void *ua, void *udz, const smelt_tensor *du, const smelt_tensor *dv) {
  int64_t hk = ps->h * ps->k, he = ps->he;
  const unsigned grid = (unsigned)((rows + 7) / 8);
  smelt_status s = SMELT_OK;
  if (dv) {
    void *dyp = dy->data, *dvp = dv->data;
    int64_t dy_rs = dy->strides[0], dout = ps->dout;
    int dy_dt = dy->dtype, dv_dt = dv->dtype;
    void *vp[] = {&bnd, &sv, &rows, &nrun, &ua, &dyp, &dy_rs, &dy_dt, &hk, &he, &dout, &dvp, &dv_dt};
    s = smelt__cuda_launch(ctx, OP, u->dv, grid, 1, 1, 256, 0, vp);
  }
  if (!s && du) {
    void *xp = x->data, *dup = du->data;
    int64_t x_rs = x->strides[0], din = ps->din;
    int x_dt = x->dtype, du_dt = du->dtype;
    void *up[] = {&bnd, &sv, &rows, &nrun, &udz, &xp, &x_rs, &x_dt, &hk, &he, &din, &dup, &du_dt};
    s = smelt__cuda_launch(ctx, OP, u->du, grid, 1, 1, 256, 0, up);
  }
  return s;
}

enum { W_Q, W_QN, W_SC, W_G, W_DG, W_DS, W_UA, W_UDZ, W_DQ, W_DQ16, W_DX, W_PG, W_PB, W_K0, W_V0, W_K1, W_V1, W_HIST, W_BND,
       W_PART, W_RSUM, W_RTOT, W_N };

smelt_status smelt__cuda_peer_backward(smelt_plan *plan, const smelt__peer_variant *v, const smelt_peer_weights *w,
                                       const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *dy,
                                       const smelt_peer_grads *g) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  smelt__peer_cuda *pc = (smelt__peer_cuda *)ps->cuda;
  smelt_ctx *ctx = plan->ctx;
  const int64_t T = ps->T, h = ps->h, k = ps->k, hd = h * ps->dq, nuse = T * h * k;
  const int want_norm = g->dnorm_weight || g->dnorm_bias;
  int want_keys = 0;
  for (int i = 0; i < ps->p; i++) want_keys |= g->dsub_keys[i] != NULL;
  const int sparse = g->grad_ids != NULL;
  const int want_sort = want_keys || g->du || g->dv || sparse;
  const int64_t nblocks = (nuse + SMELT__PEER_SORT_TILE - 1) / SMELT__PEER_SORT_TILE;
  size_t bytes[W_N] = {0};
  bytes[W_Q] = (size_t)(T * hd) * 4;
  bytes[W_QN] = (size_t)(T * hd) * 4;
  bytes[W_SC] = bytes[W_G] = bytes[W_DG] = bytes[W_DS] = (size_t)nuse * 4;
  bytes[W_UA] = bytes[W_UDZ] = (size_t)(nuse * ps->he) * 4;
  bytes[W_DQ] = (size_t)(T * hd) * 4;
  /* dq also goes out in Wq's dtype when that is 16-bit and a gradient the
   * GEMMs produce is wanted in it too (its own rounding is then as large as
   * dq's): the dx GEMM (dq Wqᵀ) and the dWq GEMM (xᵀ dq, when x has that
   * dtype) then run on tensor cores. f32 gradients keep f32 dq (SIMT). */
  const smelt_dtype qdt = w->wq->dtype;
  const int dx16 = g->dx && g->dx->dtype == qdt, dwq16 = g->dwq && g->dwq->dtype == qdt && x->dtype == qdt;
  const int dq16 = (qdt == SMELT_DTYPE_BF16 || qdt == SMELT_DTYPE_F16) && (dx16 || dwq16);
  bytes[W_DQ16] = dq16 ? (size_t)(T * hd) * 2 : 0;
  bytes[W_DX] = g->dx ? (size_t)(T * ps->din) * 4 : 0;
  bytes[W_PG] = g->dnorm_weight ? (size_t)(T * hd) * 4 : 0;
  bytes[W_PB] = g->dnorm_bias ? (size_t)(T * hd) * 4 : 0;
  if (want_sort) {
    bytes[W_K0] = bytes[W_V0] = bytes[W_K1] = bytes[W_V1] = (size_t)(nuse ? nuse : 1) * 4;
    bytes[W_HIST] = (size_t)(256 * (nblocks ? nblocks : 1) + (nblocks + 3) / 4) * 4; /* + scan_hist's tile sums */
    /* segment bounds of the longest table sorted: experts or a dim's key rows */
    int64_t rows = g->du || g->dv ? ps->N : 1;
    if (sparse && nuse > rows) rows = nuse; /* the sparse rows' bounds, by rank */
    for (int i = 0; i < ps->p; i++)
      if (g->dsub_keys[i] && (ps->cfg.per_head_keys ? h : 1) * ps->n[i] > rows) rows = (ps->cfg.per_head_keys ? h : 1) * ps->n[i];
    bytes[W_BND] = (size_t)rows * 8;
  }
  bytes[W_PART] = (size_t)(SMELT__PEER_CS_CHUNKS * hd) * 4; /* the widest column sum: dbq */
  if (sparse) {
    bytes[W_RSUM] = (size_t)((nuse + SMELT__PEER_SCAN_TILE - 1) / SMELT__PEER_SCAN_TILE + 1) * 4;
    bytes[W_RTOT] = 8;
  }
  void *base, *r[W_N];
  smelt_status s = smelt__peer_ws_alloc(ctx, bytes, W_N, &base, r);
  if (s) return s;
  smelt__nvtx_push("smelt_peer_backward");
  smelt__peer_route_params P;
  smelt__peer_fill_route(ps, w, &P);
  P.q = (uint64_t)(uintptr_t)r[W_Q];
  P.qn = (uint64_t)(uintptr_t)r[W_QN];
  P.ids = (uint64_t)(uintptr_t)ids->data;
  P.scores = (uint64_t)(uintptr_t)r[W_SC];
  P.gates = (uint64_t)(uintptr_t)r[W_G];
  P.dg = (uint64_t)(uintptr_t)r[W_DG];
  P.ds = (uint64_t)(uintptr_t)r[W_DS];
  P.dqo = (uint64_t)(uintptr_t)r[W_DQ];
  P.pgamma = (uint64_t)(uintptr_t)r[W_PG];
  P.pbeta = (uint64_t)(uintptr_t)r[W_PB];
  P.dq16 = (uint64_t)(uintptr_t)r[W_DQ16];
  P.dq16_dt = (int)qdt;
  const unsigned rows_grid = (unsigned)((T * h + 7) / 8);
  void *pp[] = {&P};
  if (T > 0) s = smelt__peer_project(plan, w, x, r[W_Q]);
  if (!s) s = smelt__cuda_launch(ctx, OP, pc->rescore, rows_grid, 1, 1, 256, 0, pp);
  if (!s) {
    smelt__peer_expert_params E;
    smelt__peer_fill_expert(ps, w, x, &v->ev, &E);
    E.dy = (uint64_t)(uintptr_t)dy->data;
    E.dy_rs = dy->strides[0];
    E.dy_dt = dy->dtype;
    E.ids = P.ids;
    E.gates = P.gates;
    E.ua = (uint64_t)(uintptr_t)r[W_UA];
    E.udz = (uint64_t)(uintptr_t)r[W_UDZ];
    E.dg = P.dg;
    E.dx = (uint64_t)(uintptr_t)r[W_DX];
    void *ep[] = {&E};
    s = smelt__cuda_launch(ctx, OP, v->ev.bwd, (unsigned)T, 1, 1, 256, v->ev.bwd_smem, ep);
  }
  if (!s) s = smelt__cuda_launch(ctx, OP, pc->route_bwd, rows_grid, 1, 1, 256, pc->rbwd_smem, pp);
  smelt_tensor dqt = smelt__peer_dev_tensor(ctx, r[W_DQ], SMELT_DTYPE_F32, T, hd);
  smelt_tensor dq16t = dq16 ? smelt__peer_dev_tensor(ctx, r[W_DQ16], qdt, T, hd) : dqt;
  if (!s && g->dx) { /* dx = dq Wqᵀ + dx from the experts */
    const smelt_tensor wqt = smelt__tensor_swap_axes(w->wq, 0, 1),
                       dxe = smelt__peer_dev_tensor(ctx, r[W_DX], SMELT_DTYPE_F32, T, ps->din);
    smelt_gemm_desc d = smelt_gemm_desc_default();
    d.epilogue.beta = 1.0;
    s = smelt__gemm_reuse(ctx, &pc->gemm_dx, &d, dx16 ? &dq16t : &dqt, &wqt, &dxe, g->dx, NULL);
  }
  if (!s && g->dwq) { /* dWq = xᵀ dq */
    const smelt_tensor xt = smelt__tensor_swap_axes(x, 0, 1);
    const smelt_gemm_desc d = smelt_gemm_desc_default();
    s = smelt__gemm_reuse(ctx, &pc->gemm_dwq, &d, &xt, dwq16 ? &dq16t : &dqt, NULL, g->dwq, NULL);
  }
  if (!s && g->dbq) s = colsum(ctx, &pc->util, r[W_DQ], T, hd, r[W_PART], g->dbq);
  if (!s && want_norm) { /* [h, dq] params sum over tokens; [dq] ones over tokens and heads */
    const int64_t rows = ps->norm_per_head ? T : T * h, cols = ps->norm_per_head ? hd : ps->dq;
    if (g->dnorm_weight) s = colsum(ctx, &pc->util, r[W_PG], rows, cols, r[W_PART], g->dnorm_weight);
    if (!s && g->dnorm_bias) s = colsum(ctx, &pc->util, r[W_PB], rows, cols, r[W_PART], g->dnorm_bias);
  }
  sort_ws sw = {(uint32_t *)r[W_K0], (uint32_t *)r[W_V0], (uint32_t *)r[W_K1], (uint32_t *)r[W_V1],
                (uint32_t *)r[W_HIST]};
  if (!s && nuse == 0) {
    if (g->du) s = memset0(ctx, g->du);
    if (!s && g->dv) s = memset0(ctx, g->dv);
    if (!s && g->grad_count) s = memset0(ctx, g->grad_count);
  } else if (!s && (g->du || g->dv || sparse)) {
    uint32_t *sk, *sv;
    void *bnd = r[W_BND];
    s = sort_uses(ctx, &pc->util, &sw, ids->data, nuse, h, k, ps->N, 1, 0, 0, (uint32_t)ps->N, &sk, &sv);
    if (!s && (g->du || g->dv)) { /* every row written: zeros where no use selected the expert */
      s = seg_bounds(ctx, &pc->util, sk, nuse, ps->N, bnd);
      if (!s) s = expert_grads(ctx, ps, &pc->util, bnd, sv, ps->N, NULL, x, dy, r[W_UA], r[W_UDZ], g->du, g->dv);
    }
    if (!s && sparse) { /* the distinct experts' rows, in expert order (bnd reused in stream order) */
      s = seg_compact(ctx, &pc->util, sk, nuse, ps->N, r[W_RSUM], r[W_RTOT], bnd, g->grad_ids->data,
                      g->grad_count ? g->grad_count->data : NULL);
      if (!s)
        s = expert_grads(ctx, ps, &pc->util, bnd, sv, nuse, r[W_RTOT], x, dy, r[W_UA], r[W_UDZ], g->du_rows,
                         g->dv_rows);
    }
  }
  for (int i = 0; i < ps->p && !s; i++) {
    const smelt_tensor *dk = g->dsub_keys[i];
    if (!dk) continue;
    if (nuse == 0) {
      s = memset0(ctx, dk);
      continue;
    }
    int64_t div = 1;
    for (int j = i + 1; j < ps->p; j++) div *= ps->n[j];
    const int64_t table_n = ps->cfg.per_head_keys ? ps->n[i] : 0;
    int64_t nrows = (ps->cfg.per_head_keys ? h : 1) * ps->n[i];
    uint32_t *sk, *sv;
    void *bnd = r[W_BND];
    s = sort_uses(ctx, &pc->util, &sw, ids->data, nuse, h, k, ps->N, div, ps->n[i], table_n, (uint32_t)nrows, &sk, &sv);
    if (!s) s = seg_bounds(ctx, &pc->util, sk, nuse, nrows, bnd);
    if (s) break;
    void *svp = sv, *dkp = dk->data;
    int dim = i, dk_dt = dk->dtype;
    void *kp[] = {&P, &bnd, &svp, &dim, &nrows, &dkp, &dk_dt};
    s = smelt__cuda_launch(ctx, OP, pc->dkeys, (unsigned)nrows, 1, 1, 256, 0, kp);
  }
  smelt__nvtx_pop();
  smelt_status s2 = smelt__cuda_free(ctx, base);
  return s ? s : s2;
}
