/* smelt_moe's backward on CUDA: the router's backward and the aux losses'
 * gradients (kernels/moe_route.cu), unpermute's and permute's backward
 * (kernels/moe_permute.cu), the expert FFN's (src/cuda/moe_ffn_bwd.c), and
 * the layer's, which recomputes the forward from x (router, permute, the
 * FFN keeping its intermediates) and chains the parts' backward:
 *   dyp, dweights   = unpermute's backward of dy
 *   dW1, dW3, dW2, db1, dxp = the FFN's backward of dyp
 *   dlogits         = the router's backward of dweights + the aux losses'
 *   dx              = permute's backward of dxp (+ the noise's part)
 *                     + dlogits·Wrᵀ;  dWr = xᵀ·dlogits (the GEMM engine)
 * dxp is never formed: its two f32 parts from the FFN are gathered by
 * token and summed in one pass (moe_add), which for a few experts and no
 * noise adds dlogits·Wrᵀ too and writes dx in its dtype; else it writes an
 * f32 dx to which the noise's and the router's products add.
 * The routing is recomputed from the same x by the same kernels, so the
 * backward sees the forward's selection and drops exactly. Every sum has a
 * fixed order and no gradient uses float atomics: a run repeats bit for
 * bit. The one wait for the stream is the FFN's (its weight gradients'
 * row ranges, read before the FFN's first launch). */
#include "moe_cuda.h"

#include <string.h>

smelt_status smelt__moe_zero_grads(smelt_ctx *ctx, const smelt_tensor *const *t) {
  for (int r = SMELT__MT_DWR; r <= SMELT__MT_DB1; r++) {
    const size_t bytes = t[r] ? (size_t)smelt_tensor_numel(t[r]) * smelt_dtype_size(t[r]->dtype) : 0;
    if (!bytes) continue;
    CUresult e = smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)t[r]->data, 0, bytes, ctx->cuda->stream);
    if (e) return smelt__cu_error(e, MOE_OP "_backward_run", "zeroing the weight gradients of no rows");
  }
  return SMELT_OK;
}

/* ---------------------------------------------------------------- the router */

/* A device workspace of consecutive 256-byte aligned pieces. */
typedef struct carve {
  char *base;
  size_t at;
} carve;

static void *piece(carve *c, int64_t n, size_t es) {
  void *p = c->base ? c->base + c->at : NULL; /* no base: a layout run for its size */
  c->at += smelt__moe_block_bytes(n, es);
  return p;
}

/* dlogits [T, E] f32 from logits (with the noise), the selections before
 * drops (sel) and after them (ids), dw (NULL: the aux losses' gradients
 * only) and sel_counts (the selections' counts, read when c_lb != 0). */
static smelt_status route_grad(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                               const void *logits, const int *sel, const int *ids, const void *dw,
                               const int *sel_counts, void *dlogits) {
  int64_t T = ms->T;
  if (T == 0) return SMELT_OK;
  int E = (int)ms->E, k = (int)ms->k, sig = ms->cfg.score == SMELT_MOE_SCORE_SIGMOID, renorm = ms->cfg.renormalize;
  float scaling = (float)ms->cfg.scaling_factor;
  const double Td = (double)T;
  double c_lb = ms->cfg.aux_loss_coeff * (double)E / ((double)k * Td * Td), c_z = ms->cfg.z_loss_coeff / Td;
  void *params[] = {&logits, &sel, &ids, &dw, &sel_counts, &dlogits, &T, &E, &k, &sig, &renorm, &scaling, &c_lb, &c_z};
  return smelt__cuda_launch(ctx, MOE_OP "_backward_run", mc->route_bwd, smelt__moe_grid(T, 4), 1, 1, 128, 0, params);
}

/* The routing of logits again (no noise: the logits hold it): sel, its
 * counts, and ids and w after the capacity's drops; lse (or NULL). */
static smelt_status reroute(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                            const smelt_tensor *const *t, const void *logits, int *sel, int *counts, int *ids, void *w,
                            double *lse) {
  smelt_status s = ms->T ? smelt__moe_cuda_select(ctx, ms, mc, (void *)logits, NULL, t[SMELT__MT_BIAS], sel, w, lse)
                         : SMELT_OK;
  if (!s) s = smelt__moe_cuda_count(ctx, ms, mc, sel, counts, 0, counts + ms->E, 0, NULL, 0);
  if (!s && ms->T) s = smelt_memcpy_d2d(ctx, ids, sel, (size_t)ms->rows * 4);
  if (!s && ms->T && ms->capacity >= 0) s = smelt__moe_cuda_drop(ctx, ms, mc, ids, w);
  return s;
}

static smelt_status f32_only(const char *op, const smelt_tensor *const *t, const int *roles, int n) {
  for (int i = 0; i < n; i++)
    if (t[roles[i]] && t[roles[i]]->dtype != SMELT_DTYPE_F32)
      return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: %s must be f32 on CUDA (f64 is for the CPU backend)", op,
                          smelt__moe_roles[roles[i]].name);
  return SMELT_OK;
}

/* The router's backward (dweights given) or the aux losses' run (values
 * and, with dlogits, their gradient). */
static smelt_status router_part(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                const smelt_tensor *const *t, int aux_run) {
  static const int roles[] = {SMELT__MT_LOGITS_IN, SMELT__MT_DWEIGHTS_IN, SMELT__MT_DLOGITS, SMELT__MT_AUX};
  smelt_status s = f32_only(aux_run ? MOE_OP "_aux_losses_run" : MOE_OP "_route_backward_run", t, roles, 4);
  if (s) return s;
  const int64_t T = ms->T, E = ms->E, R = ms->rows;
  const size_t bytes = 3 * smelt__moe_block_bytes(R, 4) + smelt__moe_block_bytes(2 * E + 1, 4) +
                       smelt__moe_block_bytes(T, 8) + smelt__moe_block_bytes(E * 2 + 2 * E + 1, 8);
  carve c = {NULL, 0};
  if ((s = smelt__cuda_alloc(ctx, bytes, (void **)&c.base))) return s;
  int *sel = piece(&c, R, 4), *ids = piece(&c, R, 4), *counts = piece(&c, 2 * E + 1, 4);
  void *w = piece(&c, R, 4);
  double *lse = piece(&c, T, 8);
  char *aux_ws = piece(&c, E * 2 + 2 * E + 1, 8);
  const void *logits = t[SMELT__MT_LOGITS_IN]->data;
  s = reroute(ctx, ms, mc, t, logits, sel, counts, ids, w, aux_run ? lse : NULL);
  if (!s && aux_run && t[SMELT__MT_AUX])
    s = smelt__moe_cuda_aux_values(ctx, ms, mc, logits, sel, t[SMELT__MT_AUX]->data, lse, aux_ws);
  if (!s && t[SMELT__MT_DLOGITS]) {
    const void *dw = aux_run ? NULL : t[SMELT__MT_DWEIGHTS_IN]->data;
    s = route_grad(ctx, ms, mc, logits, sel, ids, dw, counts, t[SMELT__MT_DLOGITS]->data);
  }
  smelt_status f = smelt__cuda_free(ctx, c.base);
  return s ? s : f;
}

/* ---------------------------------------------------------------- dispatch and combine */

static smelt_status unpermute_bwd(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                  const smelt_tensor *dy, const smelt_tensor *yp, const void *rm, const void *w,
                                  const smelt_tensor *dyp, void *dweights) {
  int64_t T = ms->T, dys = dy->strides[0];
  if (T == 0) return SMELT_OK;
  const void *dyd = dy->data, *ypd = yp->data;
  void *dypd = dyp->data;
  int dydt = (int)dy->dtype, ypdt = (int)yp->dtype, dypdt = (int)dyp->dtype, k = (int)ms->k, d = (int)ms->d;
  int vec = d % 8 == 0 && dys % 8 == 0 && (uintptr_t)dyd % 16 == 0 && (uintptr_t)ypd % 16 == 0 &&
            (uintptr_t)dypd % 16 == 0;
  void *params[] = {&dyd, &dydt, &dys, &ypd, &ypdt, &rm, &w, &dypd, &dypdt, &dweights, &T, &k, &d, &vec};
  return smelt__cuda_launch(ctx, MOE_OP "_backward_run", mc->unpermute_bwd, smelt__moe_grid(T, 8), 1, 1, 256, 0,
                            params);
}

static smelt_status no_f64(const char *op, const smelt_tensor *const *t, const int *roles, int n) {
  for (int i = 0; i < n; i++)
    if (t[roles[i]] && t[roles[i]]->dtype == SMELT_DTYPE_F64)
      return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: %s f64 is for the CPU backend", op,
                          smelt__moe_roles[roles[i]].name);
  return SMELT_OK;
}

static smelt_status unpermute_bwd_part(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                       const smelt_tensor *const *t) {
  const char *op = MOE_OP "_unpermute_backward_run";
  static const int f32[] = {SMELT__MT_WEIGHTS_IN, SMELT__MT_DWEIGHTS}, nof64[] = {SMELT__MT_YP_IN, SMELT__MT_DYP};
  smelt_status s = f32_only(op, t, f32, 2);
  if (!s) s = no_f64(op, t, nof64, 2);
  if (s) return s;
  return unpermute_bwd(ctx, ms, mc, t[SMELT__MT_DY_IN], t[SMELT__MT_YP_IN], t[SMELT__MT_ROW_MAP_IN]->data,
                       t[SMELT__MT_WEIGHTS_IN]->data, t[SMELT__MT_DYP],
                       t[SMELT__MT_DWEIGHTS] ? t[SMELT__MT_DWEIGHTS]->data : NULL);
}

static smelt_status permute_bwd_part(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                     const smelt_tensor *const *t) {
  static const int nof64[] = {SMELT__MT_DXP_IN};
  smelt_status s = no_f64(MOE_OP "_permute_backward_run", t, nof64, 1);
  return s ? s
           : smelt__moe_cuda_combine(ctx, ms, mc, MOE_OP "_permute_backward_run", t[SMELT__MT_DXP_IN],
                                     t[SMELT__MT_ROW_MAP_IN]->data, NULL, t[SMELT__MT_DX]);
}

/* ---------------------------------------------------------------- the layer */

/* The layer's tensors: the caller's by role, and its own in two
 * workspaces: `kept`, what the backward reads of the forward (the
 * routing, xp, row_map, yp, the selections and their counts, h1 and h3),
 * which a saved forward leaves in the caller's `saved` tensor; and `c`,
 * the backward's own (dyp, dweights, a, apart g1 and g3 when h1 and h3
 * are kept, and the f32 pieces). */
typedef struct layer {
  const smelt_tensor *u[SMELT__MT_ROLES];
  smelt_tensor own[10];
  int *sel, *sel_counts;
  smelt__moe_ffn_inter fi;
  carve kept, c;
} layer;

/* Role r's tensor: a new piece [rows, cols] (cols 0: 1-D) of workspace w. */
static void own(int dev, layer *L, carve *w, int i, int r, smelt_dtype dt, int64_t rows, int64_t cols) {
  const int64_t shape[2] = {rows, cols};
  void *p = piece(w, rows * (cols ? cols : 1), smelt_dtype_size(dt));
  L->own[i] = smelt_tensor_make(p, dt, SMELT_DEVICE_CUDA, dev, cols ? 2 : 1, shape);
  L->u[r] = &L->own[i];
}

/* A new [rows, F x n] piece of x's dtype (h1, a, g1; n 2: h13, g13). */
static smelt_tensor inter_piece(int dev, const smelt__moe_state *ms, carve *w, int n) {
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  const int64_t shape[2] = {ms->rows, ms->F * n};
  return smelt_tensor_make(piece(w, ms->rows * ms->F * n, smelt_dtype_size(xdt)), xdt, SMELT_DEVICE_CUDA, dev, 2,
                           shape);
}

/* Pre-activations or their gradients: SwiGLU's pair [rows, 2F] and its
 * halves, or the MLP's one [rows, F] (twice). */
static void inter_pair(int dev, const smelt__moe_state *ms, carve *w, smelt_tensor *pair, smelt_tensor *lo,
                       smelt_tensor *hi) {
  if (ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU) {
    *pair = inter_piece(dev, ms, w, 2);
    smelt__moe_pair_halves(pair, lo, hi);
  } else {
    memset(pair, 0, sizeof *pair);
    *lo = *hi = inter_piece(dev, ms, w, 1);
  }
}

/* The kept workspace's layout (run with base NULL to size it). */
static void kept_layout(int dev, const smelt__moe_state *ms, layer *L) {
  const int64_t T = ms->T, E = ms->E, k = ms->k, R = ms->rows, d = ms->d;
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype, f32 = SMELT_DTYPE_F32, i32 = SMELT_DTYPE_I32;
  carve *w = &L->kept;
  w->at = 0;
  own(dev, L, w, 0, SMELT__MT_LOGITS, f32, T, E);
  own(dev, L, w, 1, SMELT__MT_IDS, i32, T, k);
  own(dev, L, w, 2, SMELT__MT_WEIGHTS, f32, T, k);
  own(dev, L, w, 3, SMELT__MT_COUNTS, i32, E, 0);
  own(dev, L, w, 4, SMELT__MT_OFFSETS, i32, E + 1, 0);
  own(dev, L, w, 5, SMELT__MT_XP, xdt, R, d);
  own(dev, L, w, 6, SMELT__MT_ROW_MAP, i32, T, k);
  own(dev, L, w, 7, SMELT__MT_YP, xdt, R, d);
  L->sel = piece(w, R, 4);
  L->sel_counts = piece(w, 2 * E + 1, 4);
  /* The MLP has no h3: its backward never reads it. */
  inter_pair(dev, ms, w, &L->fi.h13, &L->fi.h1, &L->fi.h3);
}

/* The backward's workspace up to its f32 pieces (base NULL: to size it);
 * g1 and g3 apart from h1 and h3 when those are a saved forward's. */
static void scratch_layout(int dev, const smelt__moe_state *ms, layer *L, int saved) {
  const int64_t T = ms->T, k = ms->k, R = ms->rows, d = ms->d;
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  carve *w = &L->c;
  w->at = 0;
  own(dev, L, w, 8, SMELT__MT_DYP, xdt, R, d);
  own(dev, L, w, 9, SMELT__MT_DWEIGHTS, SMELT_DTYPE_F32, T, k);
  L->fi.a = inter_piece(dev, ms, w, 1);
  if (saved) {
    inter_pair(dev, ms, w, &L->fi.g13, &L->fi.g1, &L->fi.g3);
  } else {
    L->fi.g13 = L->fi.h13;
    L->fi.g1 = L->fi.h1;
    L->fi.g3 = L->fi.h3;
  }
}

size_t smelt__moe_cuda_saved_bytes(const smelt__moe_state *ms) {
  layer L;
  memset(&L, 0, sizeof L);
  kept_layout(0, ms, &L);
  return L.kept.at;
}

/* The FFN's two parts of dxp [R, d] each, dlogits [T, E] and an f32 dx
 * [T, d] (where the router's products add to it), after the layout. */
static smelt_tensor f32_piece(smelt_ctx *ctx, layer *L, int64_t rows, int64_t cols) {
  return smelt__moe_device_mat(ctx, piece(&L->c, rows * cols, 4), SMELT_DTYPE_F32, rows, cols);
}

/* Through W [d, E] (Wr, or Wnoise: set 1) with the f32 gradient g [T, E]
 * of x·W: dw = xᵀ·g (dw NULL: not wanted) and out = g·Wᵀ + acc (out NULL:
 * not wanted; acc f32 [T, d], which may be out). With x and W bf16, g split
 * into bf16 hi + lo (moe_split_bf16) takes both onto tensor cores, two
 * products each, the first hi's into f32 (acc itself, in place) and the
 * second lo's on top; mixed bf16 x f32 operands took the engine's SIMT
 * kernel (0.77 of the 11.4 ms E8 backward). Else one product each. */
static smelt_status grad_products(smelt_ctx *ctx, smelt__moe_cuda *mc, int set, const smelt_tensor *x,
                                  const smelt_tensor *w, const smelt_tensor *g, const smelt_tensor *dw,
                                  const smelt_tensor *acc, const smelt_tensor *out) {
  smelt_plan **pl = mc->grad_gemm[set];
  const smelt_tensor xt = smelt__tensor_swap_axes(x, 0, 1), wt = smelt__tensor_swap_axes(w, 0, 1);
  smelt_gemm_desc plain = smelt_gemm_desc_default(), add = plain;
  add.epilogue.beta = 1.0;
  smelt_status s = SMELT_OK;
  if (x->dtype != SMELT_DTYPE_BF16 || w->dtype != SMELT_DTYPE_BF16) {
    if (dw) s = smelt__gemm_reuse(ctx, &pl[SMELT__MOE_GG_DW], &plain, &xt, g, NULL, dw, NULL);
    if (!s && out) s = smelt__gemm_reuse(ctx, &pl[SMELT__MOE_GG_D], &add, g, &wt, acc, out, NULL);
    return s;
  }
  const int64_t T = g->shape[0], E = g->shape[1], d = x->shape[1];
  const size_t hb = smelt__moe_block_bytes(T * E, 2);
  char *ws = NULL;
  if ((s = smelt__cuda_alloc(ctx, 2 * hb + (dw ? smelt__moe_block_bytes(d * E, 4) : 0), (void **)&ws))) return s;
  const smelt_tensor hi = smelt__moe_device_mat(ctx, ws, SMELT_DTYPE_BF16, T, E),
                     lo = smelt__moe_device_mat(ctx, ws + hb, SMELT_DTYPE_BF16, T, E),
                     tmp = smelt__moe_device_mat(ctx, ws + 2 * hb, SMELT_DTYPE_F32, d, E);
  const void *gd = g->data;
  void *hd = hi.data, *ld = lo.data;
  int64_t n = T * E;
  void *params[] = {&gd, &hd, &ld, &n};
  const unsigned blocks = smelt__moe_grid(n, 256) < 1024 ? smelt__moe_grid(n, 256) : 1024;
  s = smelt__cuda_launch(ctx, MOE_OP "_backward_run", mc->split_bf16, blocks, 1, 1, 256, 0, params);
  if (!s && dw && !(s = smelt__gemm_reuse(ctx, &pl[SMELT__MOE_GG_DW_HI], &plain, &xt, &hi, NULL, &tmp, NULL)))
    s = smelt__gemm_reuse(ctx, &pl[SMELT__MOE_GG_DW_LO], &add, &xt, &lo, &tmp, dw, NULL);
  if (!s && out && !(s = smelt__gemm_reuse(ctx, &pl[SMELT__MOE_GG_D_HI], &add, &hi, &wt, acc, acc, NULL)))
    s = smelt__gemm_reuse(ctx, &pl[SMELT__MOE_GG_D_LO], &add, &lo, &wt, acc, out, NULL);
  smelt_status f = smelt__cuda_free(ctx, ws);
  return s ? s : f;
}

/* Through the noise's scale: z = x·Wnoise, dz = dlogits ∘ n ∘ sigmoid(z);
 * dwnoise = xᵀ·dz and dx_part += dz·Wnoiseᵀ (dx_part NULL: not wanted). */
static smelt_status noise_grads(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                const smelt_tensor *const *u, const smelt_tensor *dl, const smelt_tensor *dx_part) {
  const smelt_tensor *x = u[SMELT__MT_X], *wn = u[SMELT__MT_WNOISE];
  int64_t T = ms->T;
  char *ws = NULL;
  const size_t zb = smelt__moe_block_bytes(T * ms->E, 4);
  smelt_status s = smelt__cuda_alloc(ctx, 2 * zb, (void **)&ws);
  if (s) return s;
  const smelt_tensor z = smelt__moe_device_mat(ctx, ws, SMELT_DTYPE_F32, T, ms->E),
                     dz = smelt__moe_device_mat(ctx, ws + zb, SMELT_DTYPE_F32, T, ms->E);
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  s = smelt__gemm_reuse(ctx, &mc->gemm[SMELT__MOE_G_NOISE], &desc, x, wn, NULL, &z, NULL);
  if (!s) {
    const void *dld = dl->data, *zd = z.data;
    void *dzd = dz.data;
    int E = (int)ms->E;
    uint64_t seed = ms->cfg.noise_seed;
    int64_t token0 = ms->cfg.noise_token_offset;
    void *params[] = {&dld, &zd, &dzd, &T, &E, &seed, &token0};
    const unsigned blocks = smelt__moe_grid(T * E, 256) < 4096 ? smelt__moe_grid(T * E, 256) : 4096;
    s = smelt__cuda_launch(ctx, MOE_OP "_backward_run", mc->noise_grad, blocks, 1, 1, 256, 0, params);
  }
  if (!s) s = grad_products(ctx, mc, 1, x, wn, &dz, u[SMELT__MT_DWNOISE], dx_part, dx_part);
  smelt_status f = smelt__cuda_free(ctx, ws);
  return s ? s : f;
}

/* kernels/moe_permute.cu's WGRAD_TOKENS: the tokens a moe_router_wgrad block sums. */
#define WGRAD_TOKENS 64

/* dw [d, E] = xᵀ·g (g f32 [T, E], E <= ADD_ROUTER_E, x of unit column
 * stride) in f32 in one pass over x: moe_router_wgrad's partial sums over
 * 64-token chunks, then moe_router_wgrad_sum adding them in order. */
static smelt_status router_wgrad(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                 const smelt_tensor *x, const smelt_tensor *g, const smelt_tensor *dw) {
  const void *xd = x->data, *gd = g->data;
  int xdt = (int)x->dtype, E = (int)ms->E, d = (int)ms->d, dwt = (int)dw->dtype;
  int chunks = (int)smelt__ceil_div(ms->T, WGRAD_TOKENS);
  int vec = d % 8 == 0 && x->strides[0] % 8 == 0 && (uintptr_t)xd % 16 == 0;
  int64_t T = ms->T, xs = x->strides[0], dwr = dw->strides[0], dwc = dw->strides[1];
  float *part = NULL;
  smelt_status s = smelt__cuda_alloc(ctx, (size_t)chunks * (size_t)d * (size_t)E * sizeof(float), (void **)&part);
  if (s) return s;
  if (chunks > 0) {
    void *params[] = {&xd, &xdt, &xs, &gd, &E, &T, &d, &vec, &part};
    s = smelt__cuda_launch(ctx, MOE_OP "_backward_run", mc->router_wgrad, (unsigned)smelt__ceil_div(d, 8 * 256),
                           (unsigned)chunks, 1, 256, 0, params);
  }
  void *dwd = dw->data;
  void *params[] = {&part, &chunks, &d, &E, &dwd, &dwt, &dwr, &dwc};
  if (!s)
    s = smelt__cuda_launch(ctx, MOE_OP "_backward_run", mc->router_wgrad_sum, smelt__moe_grid((int64_t)d * E, 256), 1, 1,
                           256, 0, params);
  smelt_status f = smelt__cuda_free(ctx, part);
  return s ? s : f;
}

/* Forward again to yp, keeping what the backward needs. */
static smelt_status layer_forward(smelt_plan *plan, const smelt__moe_state *ms, smelt__moe_cuda *mc, layer *L) {
  const smelt_tensor **u = L->u;
  const int lb = ms->cfg.aux_loss_coeff != 0.0;
  smelt_status s = smelt__moe_cuda_route(plan, ms, mc, u, L->sel, lb ? L->sel_counts : NULL);
  u[SMELT__MT_IDS_IN] = u[SMELT__MT_IDS];
  u[SMELT__MT_OFFSETS_IN] = u[SMELT__MT_OFFSETS];
  if (!s) s = smelt__moe_cuda_permute(plan, ms, mc, u);
  if (!s)
    s = smelt__moe_ffn_forward_keep(plan->ctx, ms, mc, u, u[SMELT__MT_XP], u[SMELT__MT_OFFSETS], &L->fi,
                                    u[SMELT__MT_YP]);
  return s;
}

/* The most experts for which moe_add adds the router's part of dx itself:
 * E loads (Wr from L1) and multiply-adds an element, which for tens of
 * experts approach what the router's products over an f32 dx cost. */
#define ADD_ROUTER_E 16

static smelt_status layer_backward(smelt_plan *plan, const smelt__moe_state *ms, smelt__moe_cuda *mc, layer *L) {
  smelt_ctx *ctx = plan->ctx;
  const smelt_tensor **u = L->u;
  const int want_dx = u[SMELT__MT_DX] != NULL, want_route = want_dx || u[SMELT__MT_DWR] || u[SMELT__MT_DWNOISE];
  const smelt_tensor parts[2] = {f32_piece(ctx, L, ms->rows, ms->d), f32_piece(ctx, L, ms->rows, ms->d)},
                     dl = f32_piece(ctx, L, ms->T, ms->E), dx_part = f32_piece(ctx, L, ms->T, ms->d);
  const void *rm = u[SMELT__MT_ROW_MAP]->data;
  const int nparts = smelt__moe_dx_parts(mc, ms, u);
  smelt_status s = unpermute_bwd(ctx, ms, mc, u[SMELT__MT_DY_IN], u[SMELT__MT_YP], rm, u[SMELT__MT_WEIGHTS]->data,
                                 u[SMELT__MT_DYP], u[SMELT__MT_DWEIGHTS]->data);
  if (!s)
    s = smelt__moe_ffn_backward(ctx, ms, mc, u, u[SMELT__MT_XP], u[SMELT__MT_OFFSETS], u[SMELT__MT_DYP], &L->fi,
                                want_dx ? parts : NULL);
  if (s || !want_route) return s;
  s = route_grad(ctx, ms, mc, u[SMELT__MT_LOGITS]->data, L->sel, u[SMELT__MT_IDS]->data,
                 u[SMELT__MT_DWEIGHTS]->data, L->sel_counts, dl.data);
  const smelt_tensor *offs = u[SMELT__MT_OFFSETS], *wr = u[SMELT__MT_WR];
  /* dx in one pass over the FFN's parts, with the router's part, where the
   * noise has none and E is small; else through an f32 dx the router's
   * (and the noise's) products add to. */
  if (want_dx && !u[SMELT__MT_WNOISE] && ms->E <= ADD_ROUTER_E && wr->dtype != SMELT_DTYPE_F64) {
    if (!s) s = smelt__moe_dx_sum(ctx, ms, mc, parts, nparts, offs, rm, &dl, wr, u[SMELT__MT_DX]);
    const smelt_tensor *x = u[SMELT__MT_X], *dwr = u[SMELT__MT_DWR];
    if (!s && dwr && x->strides[1] == 1) s = router_wgrad(ctx, ms, mc, x, &dl, dwr);
    else if (!s && dwr) s = grad_products(ctx, mc, 0, x, wr, &dl, dwr, NULL, NULL);
    return s;
  }
  if (!s && want_dx) s = smelt__moe_dx_sum(ctx, ms, mc, parts, nparts, offs, rm, NULL, NULL, &dx_part);
  if (!s && u[SMELT__MT_WNOISE]) s = noise_grads(ctx, ms, mc, u, &dl, want_dx ? &dx_part : NULL);
  return s ? s : grad_products(ctx, mc, 0, u[SMELT__MT_X], wr, &dl, u[SMELT__MT_DWR], &dx_part, u[SMELT__MT_DX]);
}

/* The state is carved in 256-byte pieces from saved's start. */
static smelt_status saved_aligned(const char *op, const smelt_tensor *saved) {
  if ((uintptr_t)saved->data % 256 != 0)
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: saved.data must be 256-byte aligned on CUDA", op);
  return SMELT_OK;
}

/* The layer's backward: from the caller's saved tensor (a saved forward's
 * state), or from the forward recomputed into a workspace of its own. */
static smelt_status backward(smelt_plan *plan, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                             const smelt__moe_args *a) {
  smelt_ctx *ctx = plan->ctx;
  const smelt_tensor *saved = a->t[SMELT__MT_SAVED_IN];
  const char *op = saved ? MOE_OP "_backward_saved_run" : MOE_OP "_backward_run";
  static const int nof64[] = {SMELT__MT_DY_IN, SMELT__MT_DX};
  smelt_status s = no_f64(op, a->t, nof64, 2);
  if (!s && saved) s = saved_aligned(op, saved);
  if (s) return s;
  if (ms->T == 0) return smelt__moe_zero_grads(ctx, a->t);
  layer L;
  memset(&L, 0, sizeof L);
  memcpy(L.u, a->t, sizeof L.u);
  if (saved) L.kept.base = (char *)saved->data;
  else if ((s = smelt__cuda_alloc(ctx, smelt__moe_cuda_saved_bytes(ms), (void **)&L.kept.base))) return s;
  kept_layout(ctx->device_index, ms, &L);
  scratch_layout(ctx->device_index, ms, &L, saved != NULL);
  const size_t bytes =
      L.c.at + smelt__moe_block_bytes(2 * ms->rows * ms->d + ms->T * ms->E + ms->T * ms->d, 4) + 4 * 256;
  if (!(s = smelt__cuda_alloc(ctx, bytes, (void **)&L.c.base))) {
    scratch_layout(ctx->device_index, ms, &L, saved != NULL);
    if (!saved) s = layer_forward(plan, ms, mc, &L);
    if (!s) s = layer_backward(plan, ms, mc, &L);
    smelt_status f = smelt__cuda_free(ctx, L.c.base);
    s = s ? s : f;
  }
  smelt_status g = saved ? SMELT_OK : smelt__cuda_free(ctx, L.kept.base);
  return s ? s : g;
}

/* The layer's forward keeping the backward's state in the caller's saved
 * tensor: y, and everything backward() would recompute. */
static smelt_status forward_save(smelt_plan *plan, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                 const smelt__moe_args *a) {
  smelt_ctx *ctx = plan->ctx;
  smelt_status s = saved_aligned(MOE_OP "_forward_save_run", a->t[SMELT__MT_SAVED]);
  if (s || ms->T == 0) return s;
  layer L;
  memset(&L, 0, sizeof L);
  memcpy(L.u, a->t, sizeof L.u);
  L.kept.base = (char *)a->t[SMELT__MT_SAVED]->data;
  kept_layout(ctx->device_index, ms, &L);
  /* The caller's counts, when asked for, in place of the kept piece (the
   * backward reads the offsets, never the counts); aux and dropped pass
   * through to the router. */
  if (a->t[SMELT__MT_COUNTS]) L.u[SMELT__MT_COUNTS] = a->t[SMELT__MT_COUNTS];
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  s = smelt__cuda_alloc(ctx, smelt__moe_block_bytes(ms->rows * ms->F, smelt_dtype_size(xdt)), (void **)&L.c.base);
  if (s) return s;
  L.fi.a = inter_piece(ctx->device_index, ms, &L.c, 1);
  s = layer_forward(plan, ms, mc, &L);
  if (!s)
    s = smelt__moe_cuda_combine(ctx, ms, mc, MOE_OP "_forward_save_run", L.u[SMELT__MT_YP],
                                L.u[SMELT__MT_ROW_MAP]->data, L.u[SMELT__MT_WEIGHTS]->data, a->t[SMELT__MT_Y]);
  smelt_status f = smelt__cuda_free(ctx, L.c.base);
  return s ? s : f;
}

/* ---------------------------------------------------------------- dispatch */

smelt_status smelt__moe_cuda_backward_part(smelt_plan *plan, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                           const smelt__moe_args *a) {
  smelt_ctx *ctx = plan->ctx;
  switch (a->mode) {
    case SMELT__MOE_AUX: return router_part(ctx, ms, mc, a->t, 1);
    case SMELT__MOE_ROUTE_BWD: return router_part(ctx, ms, mc, a->t, 0);
    case SMELT__MOE_UNPERMUTE_BWD: return unpermute_bwd_part(ctx, ms, mc, a->t);
    case SMELT__MOE_PERMUTE_BWD: return permute_bwd_part(ctx, ms, mc, a->t);
    case SMELT__MOE_FFN_BWD: return smelt__moe_ffn_backward_run(ctx, ms, mc, a->t);
    case SMELT__MOE_BACKWARD:
    case SMELT__MOE_BACKWARD_SAVED: return backward(plan, ms, mc, a);
    case SMELT__MOE_FORWARD_SAVE: return forward_save(plan, ms, mc, a);
    default: return smelt__error(SMELT_STATUS_INTERNAL, MOE_OP ": unknown run mode %d", (int)a->mode);
  }
}
