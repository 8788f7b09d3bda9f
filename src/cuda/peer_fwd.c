/* smelt_peer on CUDA, retrieval and forward: runs take workspace from the
 * context's pool and launch what the plan's variant names (peer_select.c),
 * all stream-ordered (no host synchronization, the store's batch policy
 * included).
 *
 *   retrieve  GEMM q = x Wq + bq (f32), or the projection fused in the
 *             routing -> split keys -> routing (ids, scores)
 *   forward   ... -> routing (+ gates) -> store batch -> expert forward,
 *             or the expert kernel beside the routing */
#include "peer_cuda.h"

#include <string.h>

#define OP "smelt_peer"

/* ---------------------------------------------------------------- run helpers */

smelt_status smelt__peer_ws_alloc(smelt_ctx *ctx, const size_t *bytes, int n, void **base, void **regions) {
  size_t total = 0, off[32];
  for (int i = 0; i < n; i++) {
    off[i] = total;
    total += (bytes[i] + 255) & ~(size_t)255;
  }
  smelt_status s = smelt__cuda_alloc(ctx, total, base);
  if (s) return s;
  for (int i = 0; i < n; i++) regions[i] = bytes[i] ? (char *)*base + off[i] : NULL;
  return SMELT_OK;
}

smelt_tensor smelt__peer_dev_tensor(const smelt_ctx *ctx, void *p, smelt_dtype dt, int64_t rows, int64_t cols) {
  int64_t shape[2] = {rows, cols};
  return smelt_tensor_make(p, dt, SMELT_DEVICE_CUDA, ctx->device_index, 2, shape);
}

void smelt__peer_fill_route(const smelt__peer_state *ps, const smelt_peer_weights *w, smelt__peer_route_params *P) {
  *P = (smelt__peer_route_params){.T = ps->T, .h = ps->h, .dq = ps->dq, .dsub = ps->dsub, .k = ps->k, .N = ps->N,
                                  .param_hs = ps->norm_per_head ? ps->dq : 0,
                                  .norm_eps = (float)ps->cfg.norm_eps, .l2_eps = (float)ps->cfg.l2_eps,
                                  .p = ps->p, .norm = (int)ps->cfg.query_norm, .key_l2 = ps->cfg.key_l2_norm != 0,
                                  .gate = (int)ps->cfg.gate, .key_dt = w->sub_keys[0]->dtype,
                                  .param_dt = SMELT_DTYPE_F32, .ready_groups = 1, .ready_round = 1};
  for (int i = 0; i < ps->p; i++) {
    P->keys[i] = (uint64_t)(uintptr_t)w->sub_keys[i]->data;
    P->n[i] = ps->n[i];
    P->key_hs[i] = ps->cfg.per_head_keys ? ps->n[i] * ps->dsub : 0;
  }
  const smelt_tensor *np[4] = {w->norm_weight, w->norm_bias, w->bn_mean, w->bn_var};
  uint64_t *dst[4] = {&P->norm_w, &P->norm_b, &P->bn_mean, &P->bn_var};
  for (int i = 0; i < 4; i++)
    if (np[i]) {
      *dst[i] = (uint64_t)(uintptr_t)np[i]->data;
      P->param_dt = np[i]->dtype;
    }
}

static int log2i(int64_t v) {
  int s = 0;
  while (((int64_t)1 << s) < v) s++;
  return s;
}

void smelt__peer_fill_expert(const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x,
                               const smelt__peer_expert *ev, smelt__peer_expert_params *P) {
  memset(P, 0, sizeof *P);
  P->x = (uint64_t)(uintptr_t)x->data;
  P->x_rs = x->strides[0];
  P->x_dt = x->dtype;
  P->T = ps->T;
  P->hk = ps->h * ps->k;
  P->din = ps->din;
  P->dout = ps->dout;
  P->he = ps->he;
  P->N = ps->N;
  P->chunk = ev->chunk;
  P->act = (int)ps->cfg.activation;
  P->groups_out = ev->gout;
  P->groups_in = ev->gin;
  P->he_shift = log2i(ps->he);
  P->stage_uses = (int)ev->stage_uses;
  if (ps->store) {
    const int32_t *table;
    const void *uc, *vc, *uh, *vh;
    smelt__cuda_peer_store_views(ps->store, &table, &uc, &vc, &uh, &vh);
    P->table = (uint64_t)(uintptr_t)table;
    P->u_cache = (uint64_t)(uintptr_t)uc;
    P->v_cache = (uint64_t)(uintptr_t)vc;
    P->u_host = (uint64_t)(uintptr_t)uh;
    P->v_host = (uint64_t)(uintptr_t)vh;
  } else {
    P->u_host = (uint64_t)(uintptr_t)w->u->data;
    P->v_host = (uint64_t)(uintptr_t)w->v->data;
  }
}

/* Through a K-major copy of Wq when planned so (wq_t). */
smelt_status smelt__peer_project(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x, void *q) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const smelt__peer_cuda *pc = (const smelt__peer_cuda *)ps->cuda;
  smelt_ctx *ctx = plan->ctx;
  const int64_t hd = ps->h * ps->dq;
  smelt_tensor qt = smelt__peer_dev_tensor(ctx, q, SMELT_DTYPE_F32, ps->T, hd);
  if (!pc->wq_t) return smelt_gemm_run(pc->gemm_q, x, w->wq, NULL, &qt, w->bq);
  void *wt;
  smelt_status s = smelt__cuda_alloc(ctx, (size_t)(ps->din * hd) * 2, &wt);
  if (s) return s;
  void *in = w->wq->data;
  int64_t rows = ps->din, cols = hd, rs = w->wq->strides[0], cs = w->wq->strides[1];
  void *tp[] = {&in, &rows, &cols, &rs, &cs, &wt};
  s = smelt__cuda_launch(ctx, OP, pc->util.transpose16, (unsigned)((cols + 63) / 64), (unsigned)((rows + 63) / 64), 1,
                         256, 0, tp);
  if (!s) {
    smelt_tensor wtt = smelt__peer_dev_tensor(ctx, wt, w->wq->dtype, rows, cols);
    wtt.strides[0] = 1;
    wtt.strides[1] = rows;
    s = smelt_gemm_run(pc->gemm_q, x, &wtt, NULL, &qt, w->bq);
  }
  smelt_status s2 = smelt__cuda_free(ctx, wt);
  return s ? s : s2;
}

/* ---------------------------------------------------------------- the routing */

/* The workspace's first region: q (f32 [T, h*dq]), or with the fused projection the
 * room for Wq's K-major copy (peer_route_prep writes it). */
static size_t qws_bytes(const smelt__peer_state *ps, int pj) {
  return pj ? (size_t)(ps->din * ps->h * ps->dq) * 2 : (size_t)(ps->T * ps->h * ps->dq) * 4;
}

/* Fills P's projection fields for peer_route_wg_split_pj (wt: the room for Wq's K-major copy). */
static void pj_params(const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x, void *wt,
                      smelt__peer_route_params *P) {
  P->q = 0;
  P->x = (uint64_t)(uintptr_t)x->data;
  P->x_rs = x->strides[0];
  P->wt = (uint64_t)(uintptr_t)wt;
  P->din = ps->din;
  P->bq = w->bq ? (uint64_t)(uintptr_t)w->bq->data : 0;
  P->bq_dt = w->bq ? w->bq->dtype : SMELT_DTYPE_F32;
}

/* The routing launch L of variant v; E: the expert kernel's parameters
 * when it runs beside (v->fwd), launched as the routing's programmatic
 * dependent, else NULL. wq: with the fused projection, Wq, copied K-major
 * into P->wt beside the key split (peer_route_prep). */
static smelt_status launch_route(smelt_plan *plan, const smelt__peer_variant *v, const smelt__peer_route_launch *L,
                                 smelt__peer_route_params *P, smelt__peer_expert_params *E, const smelt_tensor *wq) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const int64_t gx = (ps->T + 63) / 64;
  /* the split sub-keys, hi and lo parts [rows][dpad] bf16, and for reg and
   * wg each table's largest hi and lo row norms (f32 [tables][2], zeroed
   * for split_keys's atomic maxima), live for this call */
  int64_t rows = 0, tables = 0;
  for (int i = 0; i < ps->p; i++) {
    rows += (ps->cfg.per_head_keys ? ps->h : 1) * ps->n[i];
    tables += ps->cfg.per_head_keys ? ps->h : 1;
  }
  const int64_t dpad = (ps->dsub + 15) & ~(int64_t)15;
  /* split: a counter per tile and the next unit's after the blocks', and
   * the units' lists (64 rows x 16 packed entries) */
  const int64_t tiles = gx * ps->h;
  if (E) { /* the tiles' order and the expert warps' counters (route_tile) */
    P->ready_groups = v->head_groups;
    P->ready_round = (int)((v->expert_grid * (v->expert_block / 32) + 63) / 64);
  }
  const size_t bytes[5] = {(size_t)(rows * dpad) * 2, (size_t)(rows * dpad) * 2, v->kmax ? (size_t)tables * 8 : 0,
                           E || L->split ? (size_t)(gx * P->ready_groups + (L->split ? tiles + 1 : 0)) * 4 : 0,
                           L->split ? (size_t)tiles * 2 * 64 * 16 * 8 : 0};
  void *base, *r[5];
  smelt_status s = smelt__peer_ws_alloc(plan->ctx, bytes, 5, &base, r);
  if (s) return s;
  const smelt__cu_api *cu = smelt__cu(NULL);
  CUstream st = plan->ctx->cuda->stream;
  uint64_t khi = (uint64_t)(uintptr_t)r[0], klo = (uint64_t)(uintptr_t)r[1], kmax = (uint64_t)(uintptr_t)r[2];
  uint64_t ready = E || L->split ? (uint64_t)(uintptr_t)r[3] : 0;
  /* kmax and the counters, adjacent in the workspace (either may be
   * absent: NULL): one memset */
  char *z0 = r[2] ? (char *)r[2] : (char *)r[3];
  const size_t zero = r[3] ? (size_t)((char *)r[3] - z0) + bytes[3] : bytes[2];
  if (z0) {
    CUresult e = cu->cuMemsetD8Async((CUdeviceptr)(uintptr_t)z0, 0, zero, st);
    if (e != 0) s = smelt__cu_error(e, OP, "cuMemsetD8Async");
  }
  uint64_t wqp = wq ? (uint64_t)(uintptr_t)wq->data : 0;
  int64_t wrs = wq ? wq->strides[0] : 0, wcs = wq ? wq->strides[1] : 0;
  void *sp[] = {P, &khi, &klo, &rows, &kmax, &wqp, &wrs, &wcs};
  const int64_t tiles16 = P->wt ? (ps->h * ps->dq + 63) / 64 * ((ps->din + 63) / 64) : 0; /* the copy's */
  if (!s) s = smelt__cuda_launch(plan->ctx, OP, v->prep, (unsigned)(tiles16 + (rows + 7) / 8), 1, 1, 256, 0, sp);
  /* kmax is read by reg, wg and the persistent forms only, ready by the
   * latter, xl by the split ones (the driver takes as many parameters as
   * the kernel declares) */
  uint64_t xl = (uint64_t)(uintptr_t)r[4];
  void *rp[] = {P, &khi, &klo, &kmax, &ready, &xl};
  if (!s) s = smelt__cuda_launch(plan->ctx, OP, L->f, L->grid[0], L->grid[1], 1, 256, L->smem, rp);
  if (!s && E) {
    E->ready = ready;
    E->ready_need = (int)(ps->h / P->ready_groups);
    E->ready_shift = 6; /* kernels/peer_route.cu's ROWS */
    E->ready_groups = P->ready_groups;
    E->ready_gu = (int)(ps->h / P->ready_groups * ps->k);
    void *ep[] = {E};
    s = smelt__cuda_launch_dependent(plan->ctx, OP, v->ev.fwd, v->expert_grid, v->expert_block, v->expert_smem, ep);
  }
  smelt_status s2 = smelt__cuda_free(plan->ctx, base);
  return s ? s : s2;
}

/* ---------------------------------------------------------------- retrieve, forward */

/* Projects (unless fused: the room for Wq's copy at q) and routes by L:
 * ids, and scores and gates where not NULL; E as launch_route's. */
static smelt_status project_route(smelt_plan *plan, const smelt__peer_variant *v, const smelt__peer_route_launch *L,
                                  const smelt_peer_weights *w, const smelt_tensor *x, void *q, void *ids, void *scores,
                                  void *gates, smelt__peer_expert_params *E) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const int pj = v->projection == SMELT_PEER_PROJECTION_FUSED;
  smelt_status s = pj ? SMELT_OK : smelt__peer_project(plan, w, x, q);
  if (s) return s;
  smelt__peer_route_params P;
  smelt__peer_fill_route(ps, w, &P);
  P.q = (uint64_t)(uintptr_t)q;
  if (pj) pj_params(ps, w, x, q, &P);
  P.ids = (uint64_t)(uintptr_t)ids;
  P.scores = (uint64_t)(uintptr_t)scores;
  P.gates = (uint64_t)(uintptr_t)gates;
  return launch_route(plan, v, L, &P, E, pj ? w->wq : NULL);
}

smelt_status smelt__cuda_peer_retrieve(smelt_plan *plan, const smelt__peer_variant *v, const smelt_peer_weights *w,
                                       const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *scores) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  smelt_ctx *ctx = plan->ctx;
  const int pj = v->projection == SMELT_PEER_PROJECTION_FUSED;
  const size_t bytes[1] = {qws_bytes(ps, pj)};
  void *base, *q;
  smelt_status s = smelt__peer_ws_alloc(ctx, bytes, 1, &base, &q);
  if (s) return s;
  smelt__nvtx_push("smelt_peer_retrieve");
  s = project_route(plan, v, &v->alone, w, x, q, ids->data, scores->data, NULL, NULL);
  smelt__nvtx_pop();
  smelt_status s2 = smelt__cuda_free(ctx, base);
  return s ? s : s2;
}

smelt_status smelt__cuda_peer_forward(smelt_plan *plan, const smelt__peer_variant *v, const smelt_peer_weights *w,
                                      const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *ids,
                                      const smelt_tensor *scores) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  smelt_ctx *ctx = plan->ctx;
  const int64_t nuse = ps->T * ps->h * ps->k;
  const int pj = v->projection == SMELT_PEER_PROJECTION_FUSED, beside = v->overlap == SMELT_PEER_OVERLAP_BESIDE;
  const size_t bytes[3] = {qws_bytes(ps, pj), (size_t)nuse * 4, ids ? 0 : (size_t)nuse * 8};
  void *base, *r[3];
  smelt_status s = smelt__peer_ws_alloc(ctx, bytes, 3, &base, r);
  if (s) return s;
  void *q = r[0], *gates = r[1], *idp = ids ? ids->data : r[2];
  smelt__nvtx_push("smelt_peer_forward");
  smelt__peer_expert_params E;
  smelt__peer_fill_expert(ps, w, x, &v->ev, &E);
  E.y = (uint64_t)(uintptr_t)y->data;
  E.y_rs = y->strides[0];
  E.y_dt = y->dtype;
  E.ids = (uint64_t)(uintptr_t)idp;
  E.gates = (uint64_t)(uintptr_t)gates;
  E.stage_uses = v->expert_slots; /* the backward's E keeps the warp kernel's */
  s = project_route(plan, v, &v->fwd, w, x, q, idp, scores ? scores->data : NULL, gates, beside ? &E : NULL);
  if (!s && ps->store) s = smelt__cuda_peer_store_batch(ps->store, (const int64_t *)idp, nuse);
  if (!s && !beside) {
    void *params[] = {&E};
    s = smelt__cuda_launch(ctx, OP, v->ev.fwd, v->expert_grid, 1, 1, v->expert_block, v->expert_smem, params);
  }
  smelt__nvtx_pop();
  smelt_status s2 = smelt__cuda_free(ctx, base);
  return s ? s : s2;
}
