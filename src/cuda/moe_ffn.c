/* The MoE expert FFN on CUDA over the permuted rows, with the device
 * offsets and no host synchronization:
 *   SwiGLU  h1 = xp·W1ₑ, h3 = xp·W3ₑ (two grouped GEMMs), h1 = silu(h1)·h3
 *           (kernels/moe_ffn.cu, one pass at memory bandwidth), yp = h1·W2ₑ;
 *   MLP     h1 = act(xp·W1ₑ + b1ₑ) (bias and activation in the first GEMM's
 *           epilogue), yp = h1·W2ₑ.
 * Every product is smelt_gemm_grouped_offs (its Hopper kernel for f16 and
 * bf16), planned once with the MoE plan, the offsets' row ends read only by
 * the device. The intermediates are x's dtype (the fast kernels' operands)
 * in one workspace from the context's stream-ordered pool.
 *
 * On Hopper, SwiGLU's two up projections and silu·mul are one GEMM
 * (src/cuda/moe_gemm_sm90.c: its tiles load W1's and W3's columns side by
 * side, so no packed W13 is made; the API takes W1 and W3 as two [E, d, F]
 * tensors, which may change between runs). Elsewhere they are two GEMMs
 * and the SwiGLU kernel. */
#include "moe_cuda.h"

#include <stdio.h>
#include <string.h>

static const smelt_dtype ffn_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* The one place the SwiGLU kernel's source is made (plan and enumerator). */
static void make_src(smelt_dtype dt, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "moe_ffn_%s", smelt_dtype_name(dt));
  src->body = "moe_ffn.cu";
  smelt__prelude_define(src, "SMELT_DT", dt);
}

int smelt__moe_ffn_variants(smelt__kernel_src *out, int max) {
  const int n = (int)(sizeof ffn_dtypes / sizeof *ffn_dtypes);
  for (int v = 0; v < n && v < max; v++) make_src(ffn_dtypes[v], &out[v]);
  return n;
}

smelt_tensor smelt__moe_row_ends(const smelt_ctx *ctx, const smelt_tensor *offsets, int64_t E) {
  const int64_t shape[1] = {E};
  char *p = (char *)offsets->data + smelt_dtype_size(offsets->dtype);
  return smelt_tensor_make(p, offsets->dtype, SMELT_DEVICE_CUDA, ctx->device_index, 1, shape);
}

smelt_status smelt__moe_plan_offs_gemm(smelt_ctx *ctx, const smelt_tensor *a, const smelt_tensor *b,
                                       const smelt_tensor *d, const smelt_tensor *bias, smelt_act act,
                                       const smelt_tensor *ends, smelt_plan **out) {
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.mode = SMELT_GEMM_MODE_GROUPED_OFFS;
  desc.epilogue.act = act;
  return smelt_gemm_grouped_offs_plan(ctx, &desc, a, b, NULL, d, bias, ends, out);
}

/* The GEMMs for these offsets' and yp's dtypes, those not planned yet: only
 * the tensors' layouts matter (runs bind their own data). */
static smelt_status plan_for(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_ffn_cuda *fc,
                             const smelt_tensor *xp, const smelt_tensor *h1, const smelt_tensor *h3,
                             const smelt_tensor *yp, const smelt_tensor *ends) {
  const int o64 = ends->dtype == SMELT_DTYPE_I64, swiglu = ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU;
  const smelt_tensor *b1 = ms->t[SMELT__MT_B1].ndim >= 0 ? &ms->t[SMELT__MT_B1] : NULL;
  smelt_status s = SMELT_OK;
  if (!fc->up1[o64])
    s = smelt__moe_plan_offs_gemm(ctx, xp, &ms->t[SMELT__MT_W1], h1, b1, swiglu ? SMELT_ACT_IDENTITY : ms->cfg.activation, ends,
                  &fc->up1[o64]);
  if (!s && swiglu && !fc->up3[o64])
    s = smelt__moe_plan_offs_gemm(ctx, xp, &ms->t[SMELT__MT_W3], h3, NULL, SMELT_ACT_IDENTITY, ends, &fc->up3[o64]);
  if (!s && !fc->down[o64][yp->dtype])
    s = smelt__moe_plan_offs_gemm(ctx, h1, &ms->t[SMELT__MT_W2], yp, NULL, SMELT_ACT_IDENTITY, ends, &fc->down[o64][yp->dtype]);
  return s;
}

static uintptr_t end_of(const smelt_tensor *t) {
  return t->ndim < 0 ? 0 : (uintptr_t)t->data + (uintptr_t)smelt_tensor_numel(t) * smelt_dtype_size(t->dtype);
}

uintptr_t smelt__moe_round_up(uintptr_t v) { return (v + 255) & ~(uintptr_t)255; }

smelt_status smelt__moe_ffn_plan(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_ffn_cuda *fc) {
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  smelt__kernel_src src;
  make_src(xdt, &src);
  smelt_status s = SMELT_OK;
  if (ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU) s = smelt__cuda_function(ctx, &src, "moe_swiglu", &fc->swiglu);
  if (s || ms->rows == 0) return s;
  /* Placeholders for xp, h1, h3, yp and the offsets: 256-byte aligned like
   * the pool's blocks, past every weight so that no check sees an overlap.
   * The plans read no data; each run binds its real tensors. */
  uintptr_t at = 0;
  for (int r = SMELT__MT_W1; r <= SMELT__MT_B1; r++)
    if (end_of(&ms->t[r]) > at) at = end_of(&ms->t[r]);
  const int64_t R = ms->rows, d = ms->d, F = ms->F, E = ms->E, es = (int64_t)smelt_dtype_size(xdt);
  smelt_tensor t[5];
  const int64_t cols[4] = {d, F, F, d};
  for (int i = 0; i < 4; i++) {
    at = smelt__moe_round_up(at);
    t[i] = smelt__moe_device_mat(ctx, (void *)at, xdt, R, cols[i]);
    at += (uintptr_t)(R * cols[i] * es);
  }
  const int64_t one[1] = {E + 1};
  t[4] = smelt_tensor_make((void *)smelt__moe_round_up(at), SMELT_DTYPE_I32, SMELT_DEVICE_CUDA, ctx->device_index, 1, one);
  const smelt_tensor ends = smelt__moe_row_ends(ctx, &t[4], E);
  return plan_for(ctx, ms, fc, &t[0], &t[1], &t[2], &t[3], &ends);
}

smelt_status smelt__moe_ffn_bwd_load(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_ffn_bwd_cuda *bc) {
  smelt__kernel_src src;
  make_src(ms->t[SMELT__MT_X].dtype, &src);
  smelt_status s;
  if ((s = smelt__cuda_function(ctx, &src, "moe_act", &bc->act)) ||
      (s = smelt__cuda_function(ctx, &src, "moe_act_bwd", &bc->act_bwd)) ||
      (s = smelt__cuda_function(ctx, &src, "moe_bias_grad", &bc->bias_grad)))
    return s;
  return ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU ? smelt__cuda_function(ctx, &src, "moe_swiglu_bwd", &bc->swiglu_bwd)
                                             : SMELT_OK;
}

void smelt__moe_ffn_free(smelt__moe_ffn_cuda *fc) {
  for (int o = 0; o < 2; o++) {
    smelt_plan_destroy(fc->up1[o]);
    smelt_plan_destroy(fc->up3[o]);
    for (int y = 0; y < 4; y++) smelt_plan_destroy(fc->down[o][y]);
  }
}

unsigned smelt__moe_elementwise_grid(const smelt_ctx *ctx, const smelt__moe_state *ms) {
  const int64_t unit = 16 / (int64_t)smelt_dtype_size(ms->t[SMELT__MT_X].dtype);
  const int64_t blocks = smelt__ceil_div(ms->rows * ms->F / unit + 1, 256), cap = 16 * (int64_t)ctx->cuda->info.sm_count;
  return (unsigned)(blocks < cap ? blocks : cap);
}

void smelt__moe_pair_halves(const smelt_tensor *pair, smelt_tensor *lo, smelt_tensor *hi) {
  const int64_t F = pair->shape[1] / 2;
  *lo = *pair;
  lo->shape[1] = F;
  *hi = *lo;
  /* No offset on a NULL pointer (a layout run's, sizing the workspace). */
  if (pair->data) hi->data = (char *)pair->data + (size_t)F * smelt_dtype_size(pair->dtype);
}

smelt_status smelt__moe_swiglu(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_ffn_cuda *fc,
                               const smelt_tensor *out, const smelt_tensor *h1, const smelt_tensor *h3,
                               const smelt_tensor *offsets) {
  void *od = offsets->data, *o = out->data, *a = h1->data, *b = h3->data;
  int o64 = offsets->dtype == SMELT_DTYPE_I64, E = (int)ms->E;
  int64_t rows = ms->rows, F = ms->F, os = out->strides[0], as = h1->strides[0], bs = h3->strides[0];
  void *params[] = {&o, &a, &b, &od, &o64, &E, &rows, &F, &os, &as, &bs};
  return smelt__cuda_launch(ctx, MOE_OP "_ffn_run", fc->swiglu, smelt__moe_elementwise_grid(ctx, ms), 1, 1, 256, 0,
                            params);
}

smelt_status smelt__moe_ffn_run(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_ffn_cuda *fc,
                                const smelt__moe_sm90 *m, const smelt_tensor *const *t, const smelt_tensor *xp,
                                const smelt_tensor *offsets, const smelt_tensor *yp) {
  if (yp->dtype == SMELT_DTYPE_F64)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, MOE_OP "_ffn_run: yp f64 is for the CPU backend only");
  if (ms->rows == 0) return SMELT_OK;
  const smelt_dtype hdt = xp->dtype;
  const int swiglu_ffn = ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU, fused = smelt__moe_sm90_fits(m, ms, t, xp);
  const size_t hb = (size_t)smelt__moe_round_up((uintptr_t)(ms->rows * ms->F) * smelt_dtype_size(hdt));
  char *ws = NULL;
  smelt_status s = smelt__cuda_alloc(ctx, swiglu_ffn && !fused ? 2 * hb : hb, (void **)&ws);
  if (s) return s;
  const smelt_tensor h1 = smelt__moe_device_mat(ctx, ws, hdt, ms->rows, ms->F),
                     h3 = smelt__moe_device_mat(ctx, ws + hb, hdt, ms->rows, ms->F),
                     ends = smelt__moe_row_ends(ctx, offsets, ms->E);
  const int o64 = offsets->dtype == SMELT_DTYPE_I64;
  s = plan_for(ctx, ms, fc, xp, &h1, &h3, yp, &ends);
  if (!s && fused) s = smelt__moe_glu_run(ctx, ms, m, t, xp, offsets, NULL, &h1);
  else if (!s)
    s = smelt_gemm_grouped_offs_run(fc->up1[o64], xp, t[SMELT__MT_W1], NULL, &h1, t[SMELT__MT_B1], &ends);
  if (!s && swiglu_ffn && !fused &&
      !(s = smelt_gemm_grouped_offs_run(fc->up3[o64], xp, t[SMELT__MT_W3], NULL, &h3, NULL, &ends)))
    s = smelt__moe_swiglu(ctx, ms, fc, &h1, &h1, &h3, offsets);
  if (!s) s = smelt_gemm_grouped_offs_run(fc->down[o64][yp->dtype], &h1, t[SMELT__MT_W2], NULL, yp, NULL, &ends);
  smelt_status f = smelt__cuda_free(ctx, ws);
  return s ? s : f;
}
