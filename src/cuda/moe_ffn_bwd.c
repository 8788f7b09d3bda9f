/* The MoE expert FFN's backward on CUDA, over the permuted rows:
 *   dA  = dyp·W2ᵀ                 grouped-by-offsets GEMM, W2ᵀ the K-major
 *                                 view of W2 (the "RC" layout, Hopper's fast one)
 *   dh1, dh3, a from h1, h3, dA   kernels/moe_ffn.cu (SwiGLU; the MLP's act')
 *   dW2 = aᵀ·dyp, dW1 = xpᵀ·dh1, dW3 = xpᵀ·dh3   per expert: the host-grouped
 *                                 GEMM (smelt__moe_weight_grad; A column-major:
 *                                 "CR"), over the offsets read on the host
 *   db1 = column sums of dh1      moe_bias_grad (rows in order, no atomics)
 *   dxp = dh1·W1ᵀ + dh3·W3ᵀ       two grouped-by-offsets GEMMs (RC) into f32,
 *                                 summed by moe_add into dxp's dtype
 * The weight gradients sum over each expert's rows (along K), which the
 * grouped-by-offsets GEMM cannot group, so they are the one place of the
 * MoE backward that waits for the stream (one copy of E+1 offsets). Every
 * sum has a fixed order: the gradients repeat bit for bit. Intermediates
 * [rows, F] are of x's dtype (the fast kernels' operands), from the pool. */
#include "moe_cuda.h"

#include <stdlib.h>

void smelt__moe_ffn_bwd_free(smelt__moe_ffn_bwd_cuda *bc) {
  for (int o = 0; o < 2; o++) {
    smelt_plan_destroy(bc->up1[o]);
    smelt_plan_destroy(bc->up3[o]);
    smelt_plan_destroy(bc->down[o]);
    smelt_plan_destroy(bc->dx1[o]);
    smelt_plan_destroy(bc->dx3[o]);
    for (int y = 0; y < 4; y++) smelt_plan_destroy(bc->da[o][y]);
  }
}

/* d = a·b over the row ends, planned into *plan on first use. */
static smelt_status offs_gemm(smelt_ctx *ctx, smelt_plan **plan, const smelt_tensor *a, const smelt_tensor *b,
                              const smelt_tensor *d, const smelt_tensor *bias, const smelt_tensor *ends) {
  smelt_status s = SMELT_OK;
  if (!*plan) s = smelt__moe_plan_offs_gemm(ctx, a, b, d, bias, SMELT_ACT_IDENTITY, ends, plan);
  return s ? s : smelt_gemm_grouped_offs_run(*plan, a, b, NULL, d, bias, ends);
}

/* h1 = xp·W1 (+ b1), h3 = xp·W3 (SwiGLU): the up projections without the activation. */
static smelt_status up_proj(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_ffn_bwd_cuda *bc,
                            const smelt_tensor *const *t, const smelt_tensor *xp, const smelt_tensor *ends,
                            const smelt__moe_ffn_inter *fi) {
  const int o64 = ends->dtype == SMELT_DTYPE_I64;
  smelt_status s = offs_gemm(ctx, &bc->up1[o64], xp, t[SMELT__MT_W1], &fi->h1, t[SMELT__MT_B1], ends);
  if (!s && ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU)
    s = offs_gemm(ctx, &bc->up3[o64], xp, t[SMELT__MT_W3], &fi->h3, NULL, ends);
  return s;
}

/* The MLP's activation over the kept rows: a = act(h1) (moe_act). */
static smelt_status act_forward(smelt_ctx *ctx, const smelt__moe_state *ms, CUfunction f, void *a, void *h1,
                                const smelt_tensor *offsets) {
  const void *od = offsets->data;
  int o64 = offsets->dtype == SMELT_DTYPE_I64, E = (int)ms->E, act = (int)ms->cfg.activation;
  float slope = 0.01f;
  int64_t rows = ms->rows, F = ms->F;
  void *params[] = {&a, &h1, &act, &slope, &od, &o64, &E, &rows, &F};
  return smelt__cuda_launch(ctx, MOE_OP "_backward_run", f, smelt__moe_elementwise_grid(ctx, ms), 1, 1, 256, 0,
                            params);
}

smelt_status smelt__moe_ffn_forward_keep(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                         const smelt_tensor *const *t, const smelt_tensor *xp,
                                         const smelt_tensor *offsets, const smelt__moe_ffn_inter *fi,
                                         const smelt_tensor *yp) {
  smelt__moe_ffn_bwd_cuda *bc = &mc->bwd;
  const smelt_tensor ends = smelt__moe_row_ends(ctx, offsets, ms->E);
  smelt_status s = up_proj(ctx, ms, bc, t, xp, &ends, fi);
  if (s) return s;
  if (ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU)
    s = smelt__moe_swiglu(ctx, ms, &mc->ffn, fi->a.data, fi->h1.data, fi->h3.data, offsets);
  else
    s = act_forward(ctx, ms, bc->act, fi->a.data, fi->h1.data, offsets);
  return s ? s : offs_gemm(ctx, &bc->down[ends.dtype == SMELT_DTYPE_I64], &fi->a, t[SMELT__MT_W2], yp, NULL, &ends);
}

/* The expert row ranges of offsets [E+1] read on the host, clamped as the
 * offsets GEMM clamps them (running maximum, at most rows). */
static smelt_status host_starts(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *offsets,
                                int64_t *start) {
  const size_t es = smelt_dtype_size(offsets->dtype);
  void *h = malloc((size_t)(ms->E + 1) * es);
  if (!h) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP "_backward_run: out of host memory");
  smelt_status s = smelt_memcpy_d2h(ctx, h, offsets->data, (size_t)(ms->E + 1) * es);
  int64_t at = 0;
  for (int64_t e = 0; !s && e <= ms->E; e++) {
    const int64_t v = es == 8 ? ((const int64_t *)h)[e] : ((const int32_t *)h)[e];
    at = e == 0 ? 0 : v > at ? (v < ms->rows ? v : ms->rows) : at;
    start[e] = at;
  }
  free(h);
  return s;
}

/* dW2, dW1, dW3 and db1, those asked for, from a, dyp, xp, g1 and g3. */
static smelt_status weight_grads(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_ffn_bwd_cuda *bc,
                                 const smelt_tensor *const *t, const smelt_tensor *xp, const smelt_tensor *offsets,
                                 const smelt_tensor *dyp, const smelt__moe_ffn_inter *fi) {
  smelt_status s = SMELT_OK;
  if (t[SMELT__MT_DW1] || t[SMELT__MT_DW2] || t[SMELT__MT_DW3]) {
    int64_t *start = (int64_t *)malloc((size_t)(ms->E + 1) * sizeof *start);
    if (!start) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP "_backward_run: out of host memory");
    s = host_starts(ctx, ms, offsets, start);
    if (!s && t[SMELT__MT_DW2]) s = smelt__moe_weight_grad(ctx, ms, start, &fi->a, dyp, t[SMELT__MT_DW2]);
    if (!s && t[SMELT__MT_DW1]) s = smelt__moe_weight_grad(ctx, ms, start, xp, &fi->g1, t[SMELT__MT_DW1]);
    if (!s && t[SMELT__MT_DW3]) s = smelt__moe_weight_grad(ctx, ms, start, xp, &fi->g3, t[SMELT__MT_DW3]);
    free(start);
  }
  if (!s && t[SMELT__MT_DB1]) {
    const void *g = fi->g1.data, *od = offsets->data;
    void *db = t[SMELT__MT_DB1]->data;
    int o64 = offsets->dtype == SMELT_DTYPE_I64, E = (int)ms->E, dbt = (int)t[SMELT__MT_DB1]->dtype;
    int64_t rows = ms->rows, F = ms->F;
    void *params[] = {&g, &od, &o64, &E, &rows, &F, &db, &dbt};
    s = smelt__cuda_launch(ctx, MOE_OP "_backward_run", bc->bias_grad, smelt__moe_grid(F, 128), (unsigned)E, 1, 128,
                           0, params);
  }
  return s;
}

/* dxp = g1·W1ᵀ (+ g3·W3ᵀ): f32 products in one workspace, summed by moe_add. */
static smelt_status input_grad(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                               const smelt_tensor *const *t, const smelt_tensor *offsets,
                               const smelt__moe_ffn_inter *fi, const smelt_tensor *dxp) {
  smelt__moe_ffn_bwd_cuda *bc = &mc->bwd;
  const int swiglu = ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU;
  int o64 = offsets->dtype == SMELT_DTYPE_I64;
  const size_t pb = smelt__moe_block_bytes(ms->rows * ms->d, 4);
  char *ws = NULL;
  smelt_status s = smelt__cuda_alloc(ctx, swiglu ? 2 * pb : pb, (void **)&ws);
  if (s) return s;
  const smelt_tensor p1 = smelt__moe_device_mat(ctx, ws, SMELT_DTYPE_F32, ms->rows, ms->d),
                     p3 = smelt__moe_device_mat(ctx, ws + pb, SMELT_DTYPE_F32, ms->rows, ms->d),
                     ends = smelt__moe_row_ends(ctx, offsets, ms->E),
                     w1t = smelt__tensor_swap_axes(t[SMELT__MT_W1], 1, 2);
  s = offs_gemm(ctx, &bc->dx1[o64], &fi->g1, &w1t, &p1, NULL, &ends);
  if (!s && swiglu) {
    const smelt_tensor w3t = smelt__tensor_swap_axes(t[SMELT__MT_W3], 1, 2);
    s = offs_gemm(ctx, &bc->dx3[o64], &fi->g3, &w3t, &p3, NULL, &ends);
  }
  if (!s) {
    const void *a = p1.data, *b = swiglu ? p3.data : NULL, *od = offsets->data;
    void *out = dxp->data;
    int odt = (int)dxp->dtype, E = (int)ms->E;
    int64_t rows = ms->rows, d = ms->d;
    void *params[] = {&a, &b, &out, &odt, &od, &o64, &E, &rows, &d};
    const unsigned blocks = smelt__moe_grid(rows * d, 256), cap = 16u * (unsigned)ctx->cuda->info.sm_count;
    s = smelt__cuda_launch(ctx, MOE_OP "_backward_run", mc->add, blocks < cap ? blocks : cap, 1, 1, 256, 0, params);
  }
  smelt_status f = smelt__cuda_free(ctx, ws);
  return s ? s : f;
}

smelt_status smelt__moe_ffn_backward(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                     const smelt_tensor *const *t, const smelt_tensor *xp,
                                     const smelt_tensor *offsets, const smelt_tensor *dyp,
                                     const smelt__moe_ffn_inter *fi, const smelt_tensor *dxp) {
  smelt__moe_ffn_bwd_cuda *bc = &mc->bwd;
  const smelt_tensor ends = smelt__moe_row_ends(ctx, offsets, ms->E),
                     w2t = smelt__tensor_swap_axes(t[SMELT__MT_W2], 1, 2);
  int o64 = ends.dtype == SMELT_DTYPE_I64;
  smelt_status s = offs_gemm(ctx, &bc->da[o64][dyp->dtype], dyp, &w2t, &fi->a, NULL, &ends);
  if (s) return s;
  const void *od = offsets->data, *h1 = fi->h1.data, *h3 = fi->h3.data;
  void *a = fi->a.data, *g1 = fi->g1.data, *g3 = fi->g3.data;
  int E = (int)ms->E, act = (int)ms->cfg.activation;
  float slope = 0.01f;
  int64_t rows = ms->rows, F = ms->F;
  const unsigned grid = smelt__moe_elementwise_grid(ctx, ms);
  if (ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU) {
    void *params[] = {&h1, &h3, &a, &g1, &g3, &od, &o64, &E, &rows, &F};
    s = smelt__cuda_launch(ctx, MOE_OP "_backward_run", bc->swiglu_bwd, grid, 1, 1, 256, 0, params);
  } else {
    void *params[] = {&h1, &a, &g1, &act, &slope, &od, &o64, &E, &rows, &F};
    s = smelt__cuda_launch(ctx, MOE_OP "_backward_run", bc->act_bwd, grid, 1, 1, 256, 0, params);
  }
  if (!s) s = weight_grads(ctx, ms, bc, t, xp, offsets, dyp, fi);
  return s || !dxp ? s : input_grad(ctx, ms, mc, t, offsets, fi, dxp);
}

smelt_status smelt__moe_ffn_inter_alloc(smelt_ctx *ctx, const smelt__moe_state *ms, char **ws,
                                        smelt__moe_ffn_inter *fi) {
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  const size_t hb = smelt__moe_block_bytes(ms->rows * ms->F, smelt_dtype_size(xdt));
  smelt_status s = smelt__cuda_alloc(ctx, 3 * hb, (void **)ws);
  if (s) return s;
  fi->h1 = smelt__moe_device_mat(ctx, *ws, xdt, ms->rows, ms->F);
  fi->h3 = smelt__moe_device_mat(ctx, *ws + hb, xdt, ms->rows, ms->F);
  fi->a = smelt__moe_device_mat(ctx, *ws + 2 * hb, xdt, ms->rows, ms->F);
  fi->g1 = fi->h1; /* the gradients in place of the pre-activations */
  fi->g3 = fi->h3;
  return SMELT_OK;
}

smelt_status smelt__moe_ffn_backward_run(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                         const smelt_tensor *const *t) {
  const smelt_tensor *dyp = t[SMELT__MT_DYP_IN], *dxp = t[SMELT__MT_DXP];
  if (dyp->dtype == SMELT_DTYPE_F64 || (dxp && dxp->dtype == SMELT_DTYPE_F64))
    return smelt__error(SMELT_STATUS_UNSUPPORTED, MOE_OP "_ffn_backward_run: dyp and dxp f64 are for the CPU backend");
  if (ms->rows == 0) return smelt__moe_zero_grads(ctx, t);
  char *ws = NULL;
  smelt__moe_ffn_inter fi;
  smelt_status s = smelt__moe_ffn_inter_alloc(ctx, ms, &ws, &fi);
  if (s) return s;
  const smelt_tensor ends = smelt__moe_row_ends(ctx, t[SMELT__MT_OFFSETS_IN], ms->E);
  if (!(s = up_proj(ctx, ms, &mc->bwd, t, t[SMELT__MT_XP_IN], &ends, &fi)))
    s = smelt__moe_ffn_backward(ctx, ms, mc, t, t[SMELT__MT_XP_IN], t[SMELT__MT_OFFSETS_IN], dyp, &fi, dxp);
  smelt_status f = smelt__cuda_free(ctx, ws);
  return s ? s : f;
}
