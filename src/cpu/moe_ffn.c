/* The expert FFN on the CPU: the GEMM engine's grouped-by-offsets GEMM
 * (smelt_gemm_grouped_offs) for the products over permuted rows, and an
 * elementwise step between them (SwiGLU's silu(h1)·h3; the MLP's bias and
 * activation ride in the first GEMM's epilogue). The weight gradients are
 * smelt__moe_weight_grad's (src/core/op_moe_wgrad.c). Intermediates
 * [T·k, F] are f32 (f64 for f64 inputs) host scratch. */
#include "moe_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* offsets[1..E]: the cumulative row ends smelt_gemm_grouped_offs takes. */
static smelt_tensor ends_view(const smelt_tensor *offsets, int64_t E) {
  smelt_tensor v = *offsets;
  v.data = (char *)offsets->data + smelt_dtype_size(offsets->dtype);
  v.shape[0] = E;
  return v;
}

/* d = a·b over the experts' row ranges, + beta·c, + bias and act. */
static smelt_status gemm_offs(smelt_ctx *ctx, const smelt_tensor *a, const smelt_tensor *b, const smelt_tensor *c,
                              const smelt_tensor *d, const smelt_tensor *bias, smelt_act act,
                              const smelt_tensor *ends) {
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.mode = SMELT_GEMM_MODE_GROUPED_OFFS;
  desc.epilogue.beta = c ? 1.0 : 0.0;
  desc.epilogue.act = act;
  return smelt_gemm_grouped_offs(ctx, &desc, a, b, c, d, bias, ends);
}

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* Scratch [T·k, F] matrices, n of them (m's data NULL before). */
static smelt_status scratch_rf(const smelt__moe_state *ms, smelt_tensor *m, int n) {
  smelt_status s = SMELT_OK;
  for (int i = 0; !s && i < n; i++) s = smelt__moe_scratch(&m[i], ms->route_dt, ms->rows, ms->F, "an FFN intermediate");
  return s;
}

static void scratch_free(smelt_tensor *m, int n) {
  for (int i = 0; i < n; i++) free(m[i].data);
}

/* h1 = xp·W1 (+ b1), h3 = xp·W3 (SwiGLU), no activation. */
static smelt_status up_proj(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t,
                            const smelt_tensor *ends, smelt_tensor *h1, smelt_tensor *h3, smelt_act act) {
  smelt_status s = gemm_offs(ctx, t[SMELT__MT_XP_IN], t[SMELT__MT_W1], NULL, h1, t[SMELT__MT_B1], act, ends);
  if (!s && ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU)
    s = gemm_offs(ctx, t[SMELT__MT_XP_IN], t[SMELT__MT_W3], NULL, h3, NULL, SMELT_ACT_IDENTITY, ends);
  return s;
}

smelt_status smelt__moe_cpu_ffn(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t) {
  int64_t *end = (int64_t *)malloc((size_t)ms->E * sizeof(int64_t));
  if (!end) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the offsets");
  smelt_status s = smelt__moe_offsets(ms, t[SMELT__MT_OFFSETS_IN], end);
  const int64_t total = s ? 0 : end[ms->E - 1];
  free(end);
  if (s) return s;
  const int swiglu = ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU;
  const smelt_tensor ends = ends_view(t[SMELT__MT_OFFSETS_IN], ms->E);
  smelt_tensor h[2] = {{0}};
  s = scratch_rf(ms, h, 2);
  if (!s) s = up_proj(ctx, ms, t, &ends, &h[0], &h[1], swiglu ? SMELT_ACT_IDENTITY : ms->cfg.activation);
  if (!s && swiglu) {
    for (int64_t i = 0; i < total * ms->F; i++) {
      const double a = smelt__moe_get(&h[0], i);
      smelt__moe_set(&h[0], i, a * sigmoid(a) * smelt__moe_get(&h[1], i));
    }
  }
  if (!s) s = gemm_offs(ctx, &h[0], t[SMELT__MT_W2], NULL, t[SMELT__MT_YP], NULL, SMELT_ACT_IDENTITY, &ends);
  scratch_free(h, 2);
  return s;
}

/* ---------------------------------------------------------------- backward */

/* a = the FFN's hidden activation, g1 and g3 = the gradients of h1 and h3,
 * from h1, h3 and dA = dyp·W2ᵀ (rows below total). */
static void hidden_grads(const smelt__moe_state *ms, int64_t total, smelt_tensor *m) {
  smelt_tensor *h1 = &m[0], *h3 = &m[1], *dA = &m[2], *a = &m[3], *g3 = &m[4];
  const int swiglu = ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU;
  for (int64_t i = 0; i < total * ms->F; i++) {
    const double x = smelt__moe_get(h1, i), g = smelt__moe_get(dA, i);
    if (swiglu) {
      const double sg = sigmoid(x), up = smelt__moe_get(h3, i);
      smelt__moe_set(a, i, x * sg * up);
      smelt__moe_set(g3, i, g * x * sg);
      smelt__moe_set(h1, i, g * up * sg * (1.0 + x * (1.0 - sg)));
    } else {
      smelt__moe_set(a, i, smelt_act_apply(ms->cfg.activation, x, 0.01));
      smelt__moe_set(h1, i, g * smelt__act_grad(ms->cfg.activation, x, 0.01));
    }
  }
}

static void bias_grad(const smelt__moe_state *ms, const int64_t *start, const smelt_tensor *g1,
                      const smelt_tensor *db1) {
  for (int64_t e = 0; e < ms->E; e++)
    for (int64_t f = 0; f < ms->F; f++) {
      double acc = 0;
      for (int64_t r = start[e]; r < start[e + 1]; r++) acc += smelt__moe_get(g1, r * ms->F + f);
      smelt__moe_set(db1, e * ms->F + f, acc);
    }
}

/* dxp = g1·W1ᵀ (+ g3·W3ᵀ). */
static smelt_status input_grad(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t,
                               const smelt_tensor *ends, smelt_tensor *m) {
  const smelt_tensor w1t = smelt__tensor_swap_axes(t[SMELT__MT_W1], 1, 2);
  if (ms->cfg.ffn != SMELT_MOE_FFN_SWIGLU)
    return gemm_offs(ctx, &m[0], &w1t, NULL, t[SMELT__MT_DXP], NULL, SMELT_ACT_IDENTITY, ends);
  const smelt_tensor w3t = smelt__tensor_swap_axes(t[SMELT__MT_W3], 1, 2);
  smelt_tensor part;
  smelt_status s = smelt__moe_scratch(&part, ms->route_dt, ms->rows, ms->d, "the FFN's input gradient");
  if (!s) s = gemm_offs(ctx, &m[0], &w1t, NULL, &part, NULL, SMELT_ACT_IDENTITY, ends);
  if (!s) s = gemm_offs(ctx, &m[4], &w3t, &part, t[SMELT__MT_DXP], NULL, SMELT_ACT_IDENTITY, ends);
  free(part.data);
  return s;
}

static smelt_status ffn_bwd(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t,
                            const int64_t *start, smelt_tensor *m) {
  const smelt_tensor ends = ends_view(t[SMELT__MT_OFFSETS_IN], ms->E);
  const smelt_tensor w2t = smelt__tensor_swap_axes(t[SMELT__MT_W2], 1, 2);
  smelt_status s = up_proj(ctx, ms, t, &ends, &m[0], &m[1], SMELT_ACT_IDENTITY);
  if (!s) s = gemm_offs(ctx, t[SMELT__MT_DYP_IN], &w2t, NULL, &m[2], NULL, SMELT_ACT_IDENTITY, &ends);
  if (s) return s;
  hidden_grads(ms, start[ms->E], m);
  if (t[SMELT__MT_DW2] && (s = smelt__moe_weight_grad(ctx, ms, start, &m[3], t[SMELT__MT_DYP_IN], t[SMELT__MT_DW2]))) return s;
  if (t[SMELT__MT_DW1] && (s = smelt__moe_weight_grad(ctx, ms, start, t[SMELT__MT_XP_IN], &m[0], t[SMELT__MT_DW1]))) return s;
  if (t[SMELT__MT_DW3] && (s = smelt__moe_weight_grad(ctx, ms, start, t[SMELT__MT_XP_IN], &m[4], t[SMELT__MT_DW3]))) return s;
  if (t[SMELT__MT_DB1]) bias_grad(ms, start, &m[0], t[SMELT__MT_DB1]);
  return t[SMELT__MT_DXP] ? input_grad(ctx, ms, t, &ends, m) : SMELT_OK;
}

smelt_status smelt__moe_cpu_ffn_bwd(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t) {
  int64_t *start = (int64_t *)malloc((size_t)(ms->E + 1) * sizeof(int64_t));
  if (!start) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the offsets");
  start[0] = 0;
  smelt_status s = smelt__moe_offsets(ms, t[SMELT__MT_OFFSETS_IN], start + 1);
  smelt_tensor m[5] = {{0}}; /* h1 (then g1), h3, dA, a, g3 */
  if (!s) s = scratch_rf(ms, m, 5);
  if (!s) s = ffn_bwd(ctx, ms, t, start, m);
  scratch_free(m, 5);
  free(start);
  return s;
}
