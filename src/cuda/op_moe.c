/* smelt_moe on CUDA: the router (its GEMMs through the GEMM engine, then
 * kernels/moe_route.cu), permute and unpermute (kernels/moe_permute.cu),
 * the expert FFN (src/cuda/moe_ffn.c) and the layer's forward chaining
 * them, all stream-ordered with no host synchronization; the backward runs
 * are in src/cuda/moe_bwd.c. */
#include "moe_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Experts per lane of the routing warp: the two module sizes. */
static const int route_items[] = {8, 32};
#define MAX_E (32 * 32)
/* kernels/moe_permute.cu's MOE_CHUNK (tokens a ranking chunk), COPY_SLICE
 * (bytes of a row a moe_copy_rows warp copies) and UNPERMUTE_SLICE (columns a
 * moe_unpermute warp sums) */
#define CHUNK 32
#define COPY_SLICE 2048
#define UNPERMUTE_SLICE 256

static void moe_cuda_free(void *p) {
  smelt__moe_cuda *mc = (smelt__moe_cuda *)p;
  if (!mc) return;
  smelt__moe_ffn_bwd_free(&mc->bwd);
  smelt__moe_ffn_free(&mc->ffn);
  for (int i = 0; i < SMELT__MOE_G_COUNT; i++) smelt_plan_destroy(mc->gemm[i]);
  for (int set = 0; set < 2; set++)
    for (int i = 0; i < SMELT__MOE_GG_COUNT; i++) smelt_plan_destroy(mc->grad_gemm[set][i]);
  free(mc);
}

/* The one place a variant's source is made (plan and enumerator):
 * variant 0, 1: the router for route_items[v]; 2: dispatch and combine. */
static void make_src(int v, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  if (v < 2) {
    snprintf(src->name, sizeof src->name, "moe_route_e%d", 32 * route_items[v]);
    src->body = "moe_route.cu";
    smelt__prelude_define(src, "MOE_ITEMS", route_items[v]);
  } else {
    snprintf(src->name, sizeof src->name, "moe_permute");
    src->body = "moe_permute.cu";
  }
}

int smelt__moe_variants(smelt__kernel_src *out, int max) {
  for (int v = 0; v < 3 && v < max; v++) make_src(v, &out[v]);
  int n = 3;
  n += smelt__moe_ffn_variants(out + (max < n ? max : n), max < n ? 0 : max - n);
  n += smelt__moe_sm90_variants(out + (max < n ? max : n), max < n ? 0 : max - n);
  return n + smelt__moe_decode_variants(out + (max < n ? max : n), max < n ? 0 : max - n);
}

/* What the CUDA kernels take; the rest is refused at planning. */
static smelt_status check_plan(const smelt__moe_state *ms) {
  if (ms->t[SMELT__MT_X].dtype == SMELT_DTYPE_F64)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, MOE_OP ": f64 is for the CPU backend (gradient checks) only");
  if (ms->E > MAX_E || ms->k > 32 || ms->cfg.num_groups > 32)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        MOE_OP ": num_experts=%lld, top_k=%lld, num_groups=%lld: CUDA routes up to %d experts, top_k "
                               "and num_groups up to 32",
                        (long long)ms->E, (long long)ms->k, (long long)ms->cfg.num_groups, MAX_E);
  return SMELT_OK;
}

static smelt_status plan_moe(smelt_plan *plan, const void *args) {
  smelt__moe_state *ms = (smelt__moe_state *)plan->opdata;
  smelt_status s = check_plan(ms);
  if (s) return s;
  smelt__moe_cuda *mc = (smelt__moe_cuda *)calloc(1, sizeof *mc);
  if (!mc) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": out of host memory");
  ms->cuda = mc;
  ms->cuda_free = moe_cuda_free;
  const int v = ms->E <= 32 * route_items[0] ? 0 : 1;
  smelt__kernel_src route, perm;
  make_src(v, &route);
  make_src(2, &perm);
  if ((s = smelt__cuda_function(plan->ctx, &route, "moe_route", &mc->route)) ||
      (s = smelt__cuda_function(plan->ctx, &route, "moe_counts", &mc->counts)) ||
      (s = smelt__cuda_function(plan->ctx, &route, "moe_aux_columns", &mc->aux_columns)) ||
      (s = smelt__cuda_function(plan->ctx, &route, "moe_aux_final", &mc->aux_final)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_chunk_counts", &mc->chunk_counts)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_chunk_bases", &mc->chunk_bases)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_rank", &mc->rank)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_copy_rows", &mc->copy_rows)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_drop", &mc->drop)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_unpermute", &mc->unpermute)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_probs_list", &mc->probs_list)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_probs_rank", &mc->probs_rank)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_unpermute_bwd", &mc->unpermute_bwd)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_add", &mc->add)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_router_wgrad", &mc->router_wgrad)) ||
      (s = smelt__cuda_function(plan->ctx, &perm, "moe_router_wgrad_sum", &mc->router_wgrad_sum)) ||
      (s = smelt__cuda_function(plan->ctx, &route, "moe_route_bwd", &mc->route_bwd)) ||
      (s = smelt__cuda_function(plan->ctx, &route, "moe_noise_grad", &mc->noise_grad)) ||
      (s = smelt__cuda_function(plan->ctx, &route, "moe_split_bf16", &mc->split_bf16)))
    return s;
  const int ffn = ms->t[SMELT__MT_W1].ndim >= 0;
  ms->saved_bytes = (int64_t)smelt__moe_cuda_saved_bytes(ms);
  if (ffn && ((s = smelt__moe_ffn_plan(plan->ctx, ms, &mc->ffn)) ||
              (s = smelt__moe_ffn_bwd_load(plan->ctx, ms, &mc->bwd)) ||
              (s = smelt__moe_decode_plan(plan->ctx, ms, &mc->dec)) ||
              (s = smelt__moe_sm90_load(plan->ctx, ms, &mc->sm90))))
    return s;
  snprintf(plan->describe, sizeof plan->describe, "moe E=%d k=%d d=%d F=%d (%.32s + moe_permute%s%s)", (int)ms->E,
           (int)ms->k, (int)ms->d, (int)ms->F, route.name,
           !ffn                                     ? ""
           : mc->sm90.glu                           ? " + grouped GEMMs, gate and up fused with SwiGLU (sm90)"
           : ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU    ? " + grouped GEMMs + moe_swiglu"
                                                    : " + grouped GEMMs",
           mc->dec.route ? "; forward: moe_decode" : "");
  return SMELT_OK;
}

/* ---------------------------------------------------------------- runs */

/* rows [T, k] = each assignment's row in expert-major stable order: from
 * offsets (i32 or i64), or, with offsets NULL, its position among its
 * expert's assignments (moe_chunk_counts, moe_chunk_bases, moe_rank). */
static smelt_status rank_rows(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc, const char *op,
                              const void *ids, const smelt_tensor *offsets, void *rows) {
  int64_t T = ms->T, chunks = smelt__ceil_div(T, CHUNK);
  void *cc = NULL;
  smelt_status s = smelt__cuda_alloc(ctx, (size_t)(chunks * ms->E) * 4, &cc);
  if (s) return s;
  const void *od = offsets ? offsets->data : NULL;
  int k = (int)ms->k, E = (int)ms->E, o64 = offsets && offsets->dtype == SMELT_DTYPE_I64;
  void *p_counts[] = {&ids, &T, &k, &E, &cc};
  void *p_bases[] = {&cc, &chunks, &E, &od, &o64};
  void *p_rank[] = {&ids, &T, &k, &E, &cc, &rows};
  const unsigned smem = (unsigned)(E * 4);
  if (!(s = smelt__cuda_launch(ctx, op, mc->chunk_counts, (unsigned)chunks, 1, 1, CHUNK, smem, p_counts)) &&
      !(s = smelt__cuda_launch(ctx, op, mc->chunk_bases, (unsigned)E, 1, 1, 256, 0, p_bases)))
    s = smelt__cuda_launch(ctx, op, mc->rank, (unsigned)chunks, 1, 1, 32, smem, p_rank);
  smelt_status f = smelt__cuda_free(ctx, cc);
  return s ? s : f;
}

/* pos [T·k] = each assignment's place in its expert's probs order
 * (moe_probs_list gathers each expert's into its segment, moe_probs_rank
 * counts those before each), in a workspace of counts [E], two copies of
 * the offsets [E+1] and the list [T·k]. */
static smelt_status rank_by_probs(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                  const void *ids, const void *w, void *pos) {
  const char *op = MOE_OP "_route_run";
  int *ws = NULL;
  int64_t n = ms->rows;
  int E = (int)ms->E;
  smelt_status s = smelt__cuda_alloc(ctx, (size_t)(3 * E + 2 + n) * 4, (void **)&ws);
  if (s) return s;
  int *offs = ws + E, *cursor = offs + E + 1, *list = cursor + E + 1;
  void *p_list[] = {&ids, &n, &E, &cursor, &list};
  void *p_rank[] = {&list, &offs, &w, &pos};
  const unsigned blocks = smelt__moe_grid(n, 256) < 4096 ? smelt__moe_grid(n, 256) : 4096;
  if (!(s = smelt__moe_cuda_count(ctx, ms, mc, ids, ws, 0, offs, 0, NULL, 0)) &&
      !(s = smelt__moe_cuda_count(ctx, ms, mc, ids, ws, 0, cursor, 0, NULL, 0)) &&
      !(s = smelt__cuda_launch(ctx, op, mc->probs_list, blocks, 1, 1, 256, 0, p_list)))
    s = smelt__cuda_launch(ctx, op, mc->probs_rank, (unsigned)E, 1, 1, 256, 0, p_rank);
  smelt_status f = smelt__cuda_free(ctx, ws);
  return s ? s : f;
}

/* Capacity: each expert keeps the first `capacity` of its tokens in the
 * policy's order (their places by rank_rows or rank_by_probs), the rest
 * get id -1 and weight 0. */
smelt_status smelt__moe_cuda_drop(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc, void *ids,
                                  void *w) {
  const char *op = MOE_OP "_route_run";
  void *pos = NULL;
  smelt_status s = smelt__cuda_alloc(ctx, (size_t)ms->rows * 4, &pos);
  if (s) return s;
  int64_t n = ms->rows;
  int cap = (int)ms->capacity;
  void *params[] = {&ids, &w, &pos, &n, &cap};
  const unsigned blocks = smelt__moe_grid(n, 256) < 4096 ? smelt__moe_grid(n, 256) : 4096;
  if (ms->cfg.drop_policy == SMELT_MOE_DROP_PROBS) s = rank_by_probs(ctx, ms, mc, ids, w, pos);
  else s = rank_rows(ctx, ms, mc, op, ids, NULL, pos);
  if (!s) s = smelt__cuda_launch(ctx, op, mc->drop, blocks, 1, 1, 256, 0, params);
  smelt_status f = smelt__cuda_free(ctx, pos);
  return s ? s : f;
}

static smelt_status route_checks(const smelt_tensor *const *t) {
  if (t[SMELT__MT_LOGITS]->dtype != SMELT_DTYPE_F32 || t[SMELT__MT_WEIGHTS]->dtype != SMELT_DTYPE_F32 ||
      (t[SMELT__MT_AUX] && t[SMELT__MT_AUX]->dtype != SMELT_DTYPE_F32))
    return smelt__error(SMELT_STATUS_UNSUPPORTED, MOE_OP "_route_run: logits, weights and aux must be f32 on CUDA");
  return SMELT_OK;
}

smelt_status smelt__moe_cuda_select(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                    void *logits, void *z, const smelt_tensor *bias_t, void *ids, void *w,
                                    double *lse) {
  const void *bias = bias_t ? bias_t->data : NULL;
  int64_t T = ms->T;
  int E = (int)ms->E, k = (int)ms->k, sig = ms->cfg.score == SMELT_MOE_SCORE_SIGMOID, renorm = ms->cfg.renormalize;
  int groups = (int)ms->cfg.num_groups, tg = (int)ms->cfg.topk_groups;
  float scaling = (float)ms->cfg.scaling_factor;
  uint64_t seed = ms->cfg.noise_seed;
  int64_t token0 = ms->cfg.noise_token_offset;
  void *params[] = {&logits, &z,       &bias,   &ids, &w,    &T,      &E,  &k,
                    &sig,    &renorm, &scaling, &groups, &tg, &seed, &token0, &lse};
  return smelt__cuda_launch(ctx, MOE_OP "_route_run", mc->route, smelt__moe_grid(T, 4), 1, 1, 128, 0, params);
}

/* logits = x·Wr (+ n · softplus(x·Wnoise)), ids and weights; lse (or NULL)
 * each token's logsumexp. T > 0. */
static smelt_status route_tokens(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                 const smelt_tensor *const *t, double *lse) {
  const smelt_gemm_desc desc = smelt_gemm_desc_default();
  void *z = NULL;
  smelt_status s = smelt__gemm_reuse(ctx, &mc->gemm[SMELT__MOE_G_LOGITS], &desc, t[SMELT__MT_X], t[SMELT__MT_WR], NULL,
                                     t[SMELT__MT_LOGITS], NULL);
  if (!s && t[SMELT__MT_WNOISE] && !(s = smelt__cuda_alloc(ctx, (size_t)(ms->T * ms->E) * 4, &z))) {
    const smelt_tensor zt = smelt__moe_device_mat(ctx, z, SMELT_DTYPE_F32, ms->T, ms->E);
    s = smelt__gemm_reuse(ctx, &mc->gemm[SMELT__MOE_G_NOISE], &desc, t[SMELT__MT_X], t[SMELT__MT_WNOISE], NULL, &zt, NULL);
  }
  if (!s)
    s = smelt__moe_cuda_select(ctx, ms, mc, t[SMELT__MT_LOGITS]->data, z, t[SMELT__MT_BIAS], t[SMELT__MT_IDS]->data,
                               t[SMELT__MT_WEIGHTS]->data, lse);
  if (z) {
    smelt_status f = smelt__cuda_free(ctx, z);
    if (!s) s = f;
  }
  return s;
}

smelt_status smelt__moe_cuda_count(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                   const void *ids, void *counts, int c64, void *offs, int o64, void *dropped,
                                   int d64) {
  int64_t n = ms->rows;
  int E = (int)ms->E;
  void *params[] = {&ids, &n, &E, &counts, &c64, &offs, &o64, &dropped, &d64};
  return smelt__cuda_launch(ctx, MOE_OP "_route_run", mc->counts, 1, 1, 1, 1024, (unsigned)(E * 4), params);
}

/* The workspace: P [E] doubles (the softmax's column sums), then counts
 * [E] and offsets [E+1] ints. */
smelt_status smelt__moe_cuda_aux_values(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                        const void *logits, const void *ids, void *aux, double *lse, char *ws) {
  double *P = (double *)ws;
  int *cnt = (int *)(ws + ms->E * 8), *offs = cnt + ms->E;
  const char *op = MOE_OP "_route_run";
  int64_t T = ms->T;
  int E = (int)ms->E, k = (int)ms->k;
  double c_lb = ms->cfg.aux_loss_coeff, c_z = ms->cfg.z_loss_coeff;
  void *p_cols[] = {&logits, &lse, &T, &E, &P};
  void *p_final[] = {&cnt, &P, &lse, &T, &E, &k, &c_lb, &c_z, &aux};
  smelt_status s = smelt__moe_cuda_count(ctx, ms, mc, ids, cnt, 0, offs, 0, NULL, 0);
  if (!s) s = smelt__cuda_launch(ctx, op, mc->aux_columns, (unsigned)E, 1, 1, 256, 0, p_cols);
  if (!s) s = smelt__cuda_launch(ctx, op, mc->aux_final, 1, 1, 1, 256, 0, p_final);
  return s;
}

/* The router: tokens, aux losses (before drops), capacity, counts. */
smelt_status smelt__moe_cuda_route(smelt_plan *plan, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                   const smelt_tensor *const *t, int *sel, int *sel_counts) {
  smelt_status s = route_checks(t);
  if (s) return s;
  smelt_ctx *ctx = plan->ctx;
  const int64_t T = ms->T, E = ms->E;
  char *ws = NULL; /* aux: lse [T] doubles, then aux_losses's workspace */
  if (t[SMELT__MT_AUX] && (s = smelt__cuda_alloc(ctx, (size_t)(T * 8 + E * 8 + (2 * E + 1) * 4), (void **)&ws)))
    return s;
  double *lse = ws ? (double *)ws : NULL;
  if (T > 0) s = route_tokens(ctx, ms, mc, t, lse);
  if (!s && ws)
    s = smelt__moe_cuda_aux_values(ctx, ms, mc, t[SMELT__MT_LOGITS]->data, t[SMELT__MT_IDS]->data,
                                   t[SMELT__MT_AUX]->data, lse, ws + T * 8);
  if (ws) {
    smelt_status f = smelt__cuda_free(ctx, ws);
    if (!s) s = f;
  }
  const void *ids = t[SMELT__MT_IDS]->data;
  if (!s && sel && T > 0) s = smelt_memcpy_d2d(ctx, sel, ids, (size_t)ms->rows * 4);
  if (!s && sel_counts) s = smelt__moe_cuda_count(ctx, ms, mc, ids, sel_counts, 0, sel_counts + E, 0, NULL, 0);
  if (!s && T > 0 && ms->capacity >= 0) s = smelt__moe_cuda_drop(ctx, ms, mc, (void *)ids, t[SMELT__MT_WEIGHTS]->data);
  if (s) return s;
  const smelt_tensor *dr = t[SMELT__MT_DROPPED];
  return smelt__moe_cuda_count(ctx, ms, mc, ids, t[SMELT__MT_COUNTS]->data,
                               t[SMELT__MT_COUNTS]->dtype == SMELT_DTYPE_I64, t[SMELT__MT_OFFSETS]->data,
                               t[SMELT__MT_OFFSETS]->dtype == SMELT_DTYPE_I64, dr ? dr->data : NULL,
                               dr && dr->dtype == SMELT_DTYPE_I64);
}

/* The widest copy unit (16, 8, 4 or 2 bytes) of rows of row_bytes at x
 * (rows x_stride bytes apart) and xp. */
static int copy_unit(const void *x, int64_t x_stride, const void *xp, int64_t row_bytes) {
  int unit = 16;
  while (unit > 2 && ((uintptr_t)x % (uintptr_t)unit || (uintptr_t)xp % (uintptr_t)unit || x_stride % unit ||
                      row_bytes % unit))
    unit /= 2;
  return unit;
}

smelt_status smelt__moe_cuda_permute(smelt_plan *plan, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                     const smelt_tensor *const *t) {
  const char *op = MOE_OP "_permute_run";
  int64_t T = ms->T;
  if (T == 0) return SMELT_OK;
  const smelt_tensor *x = t[SMELT__MT_X], *xp = t[SMELT__MT_XP];
  void *rm = t[SMELT__MT_ROW_MAP]->data, *xpd = xp->data;
  smelt_status s = rank_rows(plan->ctx, ms, mc, op, t[SMELT__MT_IDS_IN]->data, t[SMELT__MT_OFFSETS_IN], rm);
  if (s) return s;
  const int64_t es = (int64_t)smelt_dtype_size(x->dtype);
  const void *xd = x->data;
  int k = (int)ms->k;
  int64_t x_stride = x->strides[0] * es, row_bytes = ms->d * es;
  int unit = copy_unit(xd, x_stride, xpd, row_bytes);
  void *p_copy[] = {&xd, &x_stride, &rm, &T, &k, &xpd, &row_bytes, &unit};
  /* a warp a token's COPY_SLICE bytes of row, 8 warps a block */
  return smelt__cuda_launch(plan->ctx, op, mc->copy_rows, smelt__moe_grid(T * smelt__ceil_div(row_bytes, COPY_SLICE), 8),
                            1, 1, 256, 0, p_copy);
}

smelt_status smelt__moe_cuda_combine(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                     const char *op, const smelt_tensor *yp, const void *rm, const void *wd,
                                     const smelt_tensor *y) {
  int64_t T = ms->T, ys = y->strides[0];
  if (T == 0) return SMELT_OK;
  const void *ypd = yp->data;
  void *yd = y->data;
  /* The kernels' dtype codes (SMELT_DT_F32 1, F16 2, BF16 3) are smelt_dtype's values. */
  int ypdt = (int)yp->dtype, ydt = (int)y->dtype, k = (int)ms->k, d = (int)ms->d;
  /* 8 columns a lane: rows of whole 16-byte units of both, both 16-byte aligned. */
  int vec = d % 8 == 0 && ys % 8 == 0 && (uintptr_t)ypd % 16 == 0 && (uintptr_t)yd % 16 == 0;
  void *params[] = {&ypd, &ypdt, &rm, &wd, &yd, &ydt, &T, &k, &d, &ys, &vec};
  /* a warp a token's UNPERMUTE_SLICE columns, 8 warps a block */
  return smelt__cuda_launch(ctx, op, mc->unpermute, smelt__moe_grid(T * smelt__ceil_div(d, UNPERMUTE_SLICE), 8), 1, 1,
                            256, 0, params);
}

static smelt_status unpermute(smelt_plan *plan, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                              const smelt_tensor *const *t) {
  const smelt_tensor *yp = t[SMELT__MT_YP_IN], *w = t[SMELT__MT_WEIGHTS_IN];
  if (yp->dtype == SMELT_DTYPE_F64 || w->dtype != SMELT_DTYPE_F32)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, MOE_OP "_unpermute_run: yp f64 or weights other than f32 on CUDA");
  return smelt__moe_cuda_combine(plan->ctx, ms, mc, MOE_OP "_unpermute_run", yp, t[SMELT__MT_ROW_MAP_IN]->data,
                                 w->data, t[SMELT__MT_Y]);
}

/* The statistics: counts and dropped copied to the host (which waits for
 * the stream: the one run that does). */
static smelt_status stats(smelt_plan *plan, const smelt__moe_state *ms, const smelt__moe_args *a) {
  const smelt_tensor *counts = a->t[SMELT__MT_COUNTS_IN], *dropped = a->t[SMELT__MT_DROPPED_IN];
  int64_t host[2] = {0, 0};
  const size_t cb = (size_t)ms->E * smelt_dtype_size(counts->dtype);
  void *hc = malloc(cb);
  if (!hc) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP "_stats_get: out of host memory");
  smelt_status s = smelt_memcpy_d2h(plan->ctx, hc, counts->data, cb);
  if (!s && dropped) s = smelt_memcpy_d2h(plan->ctx, host, dropped->data, smelt_dtype_size(dropped->dtype));
  if (!s) {
    const int64_t shape[1] = {ms->E}, one[1] = {1};
    const smelt_tensor hct = smelt_tensor_make(hc, counts->dtype, SMELT_DEVICE_CPU, 0, 1, shape);
    const smelt_dtype ddt = dropped ? dropped->dtype : SMELT_DTYPE_I64;
    const smelt_tensor hdt = smelt_tensor_make(host, ddt, SMELT_DEVICE_CPU, 0, 1, one);
    smelt__moe_stats_of(ms, &hct, dropped ? &hdt : NULL, a->stats);
  }
  free(hc);
  return s;
}

/* ---------------------------------------------------------------- the layer */

/* The layer's forward: router, permute, expert FFN and unpermute, each as
 * its run does it, into the caller's routing tensors where given and one
 * workspace for the rest (indices i32, routing f32, xp and yp of x's
 * dtype); or, where the decode path's rule holds (src/cuda/moe_decode.c),
 * its three launches into the same tensors. Only the statistics, when
 * asked, wait for the stream. */
static smelt_status forward(smelt_plan *plan, const smelt__moe_state *ms, smelt__moe_cuda *mc, const smelt__moe_args *a) {
  smelt_ctx *ctx = plan->ctx;
  const int64_t T = ms->T, E = ms->E, k = ms->k, R = ms->rows, d = ms->d;
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype, f32 = SMELT_DTYPE_F32, i32 = SMELT_DTYPE_I32;
  const struct {
    int role;
    smelt_dtype dt;
    int64_t rows, cols; /* cols 0: 1-D */
  } inner[] = {{SMELT__MT_LOGITS, f32, T, E},   {SMELT__MT_IDS, i32, T, k},     {SMELT__MT_WEIGHTS, f32, T, k},
               {SMELT__MT_COUNTS, i32, E, 0},   {SMELT__MT_OFFSETS, i32, E + 1, 0}, {SMELT__MT_XP, xdt, R, d},
               {SMELT__MT_ROW_MAP, i32, T, k},  {SMELT__MT_YP, xdt, R, d}};
  enum { N_INNER = sizeof inner / sizeof *inner };
  const smelt_tensor *u[SMELT__MT_ROLES];
  memcpy(u, a->t, sizeof u);
  size_t bytes = 0;
  for (int i = 0; i < N_INNER; i++)
    if (!u[inner[i].role])
      bytes += smelt__moe_block_bytes(inner[i].rows * (inner[i].cols ? inner[i].cols : 1), smelt_dtype_size(inner[i].dt));
  char *ws = NULL;
  smelt_status s = smelt__cuda_alloc(ctx, bytes, (void **)&ws);
  if (s) return s;
  smelt_tensor own[N_INNER];
  size_t at = 0;
  for (int i = 0; i < N_INNER; i++) {
    if (u[inner[i].role]) continue;
    const int64_t shape[2] = {inner[i].rows, inner[i].cols};
    own[i] = smelt_tensor_make(ws + at, inner[i].dt, SMELT_DEVICE_CUDA, ctx->device_index, inner[i].cols ? 2 : 1,
                               shape);
    u[inner[i].role] = &own[i];
    at += smelt__moe_block_bytes(inner[i].rows * (inner[i].cols ? inner[i].cols : 1), smelt_dtype_size(inner[i].dt));
  }
  u[SMELT__MT_IDS_IN] = u[SMELT__MT_IDS];
  u[SMELT__MT_OFFSETS_IN] = u[SMELT__MT_OFFSETS];
  u[SMELT__MT_WEIGHTS_IN] = u[SMELT__MT_WEIGHTS];
  u[SMELT__MT_ROW_MAP_IN] = u[SMELT__MT_ROW_MAP];
  u[SMELT__MT_YP_IN] = u[SMELT__MT_YP];
  if (smelt__moe_decode_fits(&mc->dec, u)) {
    if (!(s = route_checks(u))) s = smelt__moe_decode_forward(ctx, ms, &mc->dec, u);
  } else if (!(s = smelt__moe_cuda_route(plan, ms, mc, u, NULL, NULL)) &&
             !(s = smelt__moe_cuda_permute(plan, ms, mc, u)) &&
             !(s = smelt__moe_ffn_run(ctx, ms, &mc->ffn, &mc->sm90, u, u[SMELT__MT_XP], u[SMELT__MT_OFFSETS], u[SMELT__MT_YP]))) {
    s = unpermute(plan, ms, mc, u);
  }
  if (!s && a->stats) {
    smelt__moe_args sa = {.mode = SMELT__MOE_STATS, .stats = a->stats};
    sa.t[SMELT__MT_COUNTS_IN] = u[SMELT__MT_COUNTS];
    sa.t[SMELT__MT_DROPPED_IN] = u[SMELT__MT_DROPPED];
    s = stats(plan, ms, &sa);
  }
  smelt_status f = smelt__cuda_free(ctx, ws);
  return s ? s : f;
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt__moe_args *a = (const smelt__moe_args *)args;
  const smelt__moe_state *ms = (const smelt__moe_state *)plan->opdata;
  smelt__moe_cuda *mc = (smelt__moe_cuda *)ms->cuda;
  switch (a->mode) {
    case SMELT__MOE_ROUTE: return smelt__moe_cuda_route(plan, ms, mc, a->t, NULL, NULL);
    case SMELT__MOE_PERMUTE: return smelt__moe_cuda_permute(plan, ms, mc, a->t);
    case SMELT__MOE_UNPERMUTE: return unpermute(plan, ms, mc, a->t);
    case SMELT__MOE_FFN:
      return smelt__moe_ffn_run(plan->ctx, ms, &mc->ffn, &mc->sm90, a->t, a->t[SMELT__MT_XP_IN], a->t[SMELT__MT_OFFSETS_IN],
                                a->t[SMELT__MT_YP]);
    case SMELT__MOE_FORWARD: return forward(plan, ms, mc, a);
    case SMELT__MOE_STATS: return stats(plan, ms, a);
    default: return smelt__moe_cuda_backward_part(plan, ms, mc, a);
  }
}

const smelt__backend smelt__cuda_moe = {.plan = plan_moe, .run = run};
