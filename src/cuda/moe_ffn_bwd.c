/* The MoE expert FFN's backward on CUDA, over the permuted rows:
 *   dA  = dyp·W2ᵀ                 grouped-by-offsets GEMM, W2ᵀ the K-major
 *                                 view of W2 (the "RC" layout, Hopper's fast one)
 *   dh1, dh3, a from h1, h3, dA   kernels/moe_ffn.cu (SwiGLU; the MLP's act');
 *                                 on Hopper SwiGLU's in dA's epilogue
 *                                 (src/cuda/moe_gemm_sm90.c: dA never stored)
 *   dW2 = aᵀ·dyp, dW1 = xpᵀ·dh1, dW3 = xpᵀ·dh3   per expert: the host-grouped
 *                                 GEMM (smelt__moe_weight_grad; A column-major:
 *                                 "CR"), over the offsets read on the host
 *   db1 = column sums of dh1      moe_bias_grad (rows in order, no atomics)
 *   dxp = dh1·W1ᵀ + dh3·W3ᵀ       on Hopper one GEMM over K = 2F (g13 = [dh1 |
 *                                 dh3]: src/cuda/moe_gemm_sm90.c) into an f32
 *                                 part, else two grouped-by-offsets GEMMs (RC)
 *                                 into two, which smelt__moe_dx_sum (moe_add)
 *                                 adds into dxp, or the layer gathers by token
 *                                 straight into dx
 * The weight gradients sum over each expert's rows (along K), which the
 * grouped-by-offsets GEMM cannot group, so they are the one place of the
 * MoE backward that waits for the stream (one copy of E+1 offsets). That
 * copy is made first, before any of the backward's launches: the stream
 * then drains only what came before (the forward, unpermute's backward),
 * and the GPU idles one launch's latency, where a copy just before the
 * weight gradients left it idle until the host had planned and launched
 * their first GEMM. Every sum has a fixed order: the gradients repeat bit
 * for bit. Intermediates [rows, F] are of x's dtype (the fast kernels'
 * operands), from the pool. */
#include "moe_cuda.h"

#include <stdlib.h>
#include <string.h>

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
  smelt_status s;
  if (smelt__moe_sm90_fits(&mc->sm90, ms, t, xp))
    s = smelt__moe_glu_run(ctx, ms, &mc->sm90, t, xp, offsets, &fi->h13, &fi->a);
  else if (!(s = up_proj(ctx, ms, bc, t, xp, &ends, fi)))
    s = ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU ? smelt__moe_swiglu(ctx, ms, &mc->ffn, &fi->a, &fi->h1, &fi->h3, offsets)
                                            : act_forward(ctx, ms, bc->act, fi->a.data, fi->h1.data, offsets);
  if (s) return s;
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

/* Whether any of dW1, dW2, dW3 is asked for (the host needs the offsets). */
static int wants_weight_grads(const smelt_tensor *const *t) {
  return t[SMELT__MT_DW1] || t[SMELT__MT_DW2] || t[SMELT__MT_DW3];
}

/* dW2, dW1, dW3 and db1, those asked for, from a, dyp, xp, g1 and g3
 * (start: host_starts', when a weight gradient is asked for). */
static smelt_status weight_grads(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_ffn_bwd_cuda *bc,
                                 const smelt_tensor *const *t, const smelt_tensor *xp, const smelt_tensor *offsets,
                                 const int64_t *start, const smelt_tensor *dyp, const smelt__moe_ffn_inter *fi) {
  smelt_status s = SMELT_OK;
  if (t[SMELT__MT_DW2]) s = smelt__moe_weight_grad(ctx, ms, start, &fi->a, dyp, t[SMELT__MT_DW2]);
  if (!s && t[SMELT__MT_DW1]) s = smelt__moe_weight_grad(ctx, ms, start, xp, &fi->g1, t[SMELT__MT_DW1]);
  if (!s && t[SMELT__MT_DW3]) s = smelt__moe_weight_grad(ctx, ms, start, xp, &fi->g3, t[SMELT__MT_DW3]);
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

int smelt__moe_dx_parts(const smelt__moe_cuda *mc, const smelt__moe_state *ms, const smelt_tensor *const *t) {
  return ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU && !smelt__moe_sm90_fits(&mc->sm90, ms, t, NULL) ? 2 : 1;
}

/* The input gradient's parts, f32: p[0] = g1·W1ᵀ (+ g3·W3ᵀ in one GEMM
 * over g13 on Hopper), else (SwiGLU) p[1] = g3·W3ᵀ. */
static smelt_status input_grad(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                               const smelt_tensor *const *t, const smelt_tensor *offsets,
                               const smelt__moe_ffn_inter *fi, const smelt_tensor *p) {
  smelt__moe_ffn_bwd_cuda *bc = &mc->bwd;
  const int o64 = offsets->dtype == SMELT_DTYPE_I64;
  if (smelt__moe_sm90_fits(&mc->sm90, ms, t, NULL))
    return smelt__moe_kcat_run(ctx, ms, &mc->sm90, t, &fi->g13, offsets, &p[0]);
  const smelt_tensor ends = smelt__moe_row_ends(ctx, offsets, ms->E),
                     w1t = smelt__tensor_swap_axes(t[SMELT__MT_W1], 1, 2);
  smelt_status s = offs_gemm(ctx, &bc->dx1[o64], &fi->g1, &w1t, &p[0], NULL, &ends);
  if (!s && ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU) {
    const smelt_tensor w3t = smelt__tensor_swap_axes(t[SMELT__MT_W3], 1, 2);
    s = offs_gemm(ctx, &bc->dx3[o64], &fi->g3, &w3t, &p[1], NULL, &ends);
  }
  return s;
}

/* kernels/moe_permute.cu's UNPERMUTE_SLICE: the columns a moe_add warp sums. */
#define ADD_SLICE 256

smelt_status smelt__moe_dx_sum(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                               const smelt_tensor *parts, int nparts, const smelt_tensor *offsets, const void *row_map,
                               const smelt_tensor *g, const smelt_tensor *w, const smelt_tensor *out) {
  const void *a = parts[0].data, *b = nparts == 2 ? parts[1].data : NULL;
  const void *od = offsets->data, *gd = g ? g->data : NULL, *wd = w ? w->data : NULL;
  void *outd = out->data;
  int k = (int)ms->k, o64 = offsets->dtype == SMELT_DTYPE_I64, E = (int)ms->E, d = (int)ms->d;
  int wdt = w ? (int)w->dtype : 0, odt = (int)out->dtype;
  int64_t wrs = w ? w->strides[0] : 0, wcs = w ? w->strides[1] : 0, os = out->strides[0];
  int64_t n = row_map ? ms->T : ms->rows, rows = ms->rows;
  int vec = d % 8 == 0 && os % 8 == 0 && (uintptr_t)a % 16 == 0 && (uintptr_t)b % 16 == 0 && (uintptr_t)outd % 16 == 0;
  if (n == 0) return SMELT_OK;
  void *params[] = {&a, &b, &row_map, &k, &od, &o64, &E, &gd, &wd, &wdt,
                    &wrs, &wcs, &outd, &odt, &os, &n, &rows, &d, &vec};
  /* a warp a row's ADD_SLICE columns, 8 warps a block */
  return smelt__cuda_launch(ctx, MOE_OP "_backward_run", mc->add, smelt__moe_grid(n * smelt__ceil_div(d, ADD_SLICE), 8),
                            1, 1, 256, 0, params);
}

/* From dA in fi->a: g1, g3 (SwiGLU's or the MLP's act') and a again. */
static smelt_status act_backward(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_ffn_bwd_cuda *bc,
                                 const smelt_tensor *offsets, const smelt__moe_ffn_inter *fi) {
  const void *od = offsets->data, *h1 = fi->h1.data, *h3 = fi->h3.data;
  void *a = fi->a.data, *g1 = fi->g1.data, *g3 = fi->g3.data;
  int o64 = offsets->dtype == SMELT_DTYPE_I64, E = (int)ms->E, act = (int)ms->cfg.activation;
  float slope = 0.01f;
  int64_t rows = ms->rows, F = ms->F, hs = fi->h1.strides[0], gs = fi->g1.strides[0];
  const unsigned grid = smelt__moe_elementwise_grid(ctx, ms);
  if (ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU) {
    void *params[] = {&h1, &h3, &a, &g1, &g3, &od, &o64, &E, &rows, &F, &hs, &gs};
    return smelt__cuda_launch(ctx, MOE_OP "_backward_run", bc->swiglu_bwd, grid, 1, 1, 256, 0, params);
  }
  void *params[] = {&h1, &a, &g1, &act, &slope, &od, &o64, &E, &rows, &F};
  return smelt__cuda_launch(ctx, MOE_OP "_backward_run", bc->act_bwd, grid, 1, 1, 256, 0, params);
}

smelt_status smelt__moe_ffn_backward(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                     const smelt_tensor *const *t, const smelt_tensor *xp,
                                     const smelt_tensor *offsets, const smelt_tensor *dyp,
                                     const smelt__moe_ffn_inter *fi, const smelt_tensor *parts) {
  smelt__moe_ffn_bwd_cuda *bc = &mc->bwd;
  int64_t *start = NULL;
  smelt_status s = SMELT_OK;
  if (wants_weight_grads(t)) {
    if (!(start = (int64_t *)malloc((size_t)(ms->E + 1) * sizeof *start)))
      return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP "_backward_run: out of host memory");
    s = host_starts(ctx, ms, offsets, start);
  }
  const smelt_tensor ends = smelt__moe_row_ends(ctx, offsets, ms->E),
                     w2t = smelt__tensor_swap_axes(t[SMELT__MT_W2], 1, 2);
  int o64 = ends.dtype == SMELT_DTYPE_I64;
  /* On Hopper dA and SwiGLU's backward are one GEMM (a dyp of x's dtype). */
  if (!s && smelt__moe_sm90_fits(&mc->sm90, ms, t, dyp))
    s = smelt__moe_dglu_run(ctx, ms, &mc->sm90, t, dyp, offsets, &fi->h13, &fi->g13, &fi->a);
  else if (!s && !(s = offs_gemm(ctx, &bc->da[o64][dyp->dtype], dyp, &w2t, &fi->a, NULL, &ends)))
    s = act_backward(ctx, ms, bc, offsets, fi);
  if (!s) s = weight_grads(ctx, ms, bc, t, xp, offsets, start, dyp, fi);
  free(start);
  return s || !parts ? s : input_grad(ctx, ms, mc, t, offsets, fi, parts);
}

smelt_status smelt__moe_ffn_inter_alloc(smelt_ctx *ctx, const smelt__moe_state *ms, char **ws,
                                        smelt__moe_ffn_inter *fi) {
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  const size_t hb = smelt__moe_block_bytes(ms->rows * ms->F, smelt_dtype_size(xdt));
  smelt_status s = smelt__cuda_alloc(ctx, 3 * hb, (void **)ws);
  if (s) return s;
  memset(fi, 0, sizeof *fi);
  if (ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU) {
    fi->h13 = smelt__moe_device_mat(ctx, *ws, xdt, ms->rows, 2 * ms->F); /* 2 hb hold it */
    smelt__moe_pair_halves(&fi->h13, &fi->h1, &fi->h3);
  } else {
    fi->h1 = smelt__moe_device_mat(ctx, *ws, xdt, ms->rows, ms->F);
    fi->h3 = fi->h1;
  }
  fi->a = smelt__moe_device_mat(ctx, *ws + 2 * hb, xdt, ms->rows, ms->F);
  fi->g1 = fi->h1; /* the gradients in place of the pre-activations */
  fi->g3 = fi->h3;
  fi->g13 = fi->h13;
  return SMELT_OK;
}

smelt_status smelt__moe_ffn_backward_run(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                         const smelt_tensor *const *t) {
  const smelt_tensor *dyp = t[SMELT__MT_DYP_IN], *dxp = t[SMELT__MT_DXP], *offsets = t[SMELT__MT_OFFSETS_IN];
  if (dyp->dtype == SMELT_DTYPE_F64 || (dxp && dxp->dtype == SMELT_DTYPE_F64))
    return smelt__error(SMELT_STATUS_UNSUPPORTED, MOE_OP "_ffn_backward_run: dyp and dxp f64 are for the CPU backend");
  if (ms->rows == 0) return smelt__moe_zero_grads(ctx, t);
  char *ws = NULL, *pws = NULL;
  smelt__moe_ffn_inter fi;
  smelt_status s = smelt__moe_ffn_inter_alloc(ctx, ms, &ws, &fi);
  if (s) return s;
  /* dxp's two f32 parts (smelt__moe_ffn_backward's), then their sum into dxp. */
  const size_t pb = smelt__moe_block_bytes(ms->rows * ms->d, 4);
  if (dxp) s = smelt__cuda_alloc(ctx, (ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU ? 2 : 1) * pb, (void **)&pws);
  const smelt_tensor parts[2] = {smelt__moe_device_mat(ctx, pws, SMELT_DTYPE_F32, ms->rows, ms->d),
                                 smelt__moe_device_mat(ctx, pws ? pws + pb : NULL, SMELT_DTYPE_F32, ms->rows, ms->d)};
  const smelt_tensor ends = smelt__moe_row_ends(ctx, offsets, ms->E);
  if (!s) s = up_proj(ctx, ms, &mc->bwd, t, t[SMELT__MT_XP_IN], &ends, &fi);
  if (!s) s = smelt__moe_ffn_backward(ctx, ms, mc, t, t[SMELT__MT_XP_IN], offsets, dyp, &fi, dxp ? parts : NULL);
  if (!s && dxp) s = smelt__moe_dx_sum(ctx, ms, mc, parts, smelt__moe_dx_parts(mc, ms, t), offsets, NULL, NULL, NULL, dxp);
  smelt_status f = smelt__cuda_free(ctx, ws), g = pws ? smelt__cuda_free(ctx, pws) : SMELT_OK;
  return s ? s : f ? f : g;
}
