/* The MoE CPU backend: each run's mode to its part, and the layer's
 * forward and backward composed from the parts exactly as a caller would
 * chain their runs (the intermediates in host scratch, f32 or f64). The
 * backward recomputes the forward from x, so nothing but x is kept between
 * the passes. Everything is per token or per expert row in a fixed order,
 * so a token's output does not depend on the rest of its batch. */
#include "moe_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_SCRATCH = 12 };

/* The layer's tensors by role and the scratch behind the ones it made. */
typedef struct layer {
  const smelt_tensor *u[SMELT__MT_ROLES];
  smelt_tensor scratch[MAX_SCRATCH];
  int n;
} layer;

/* Role r's tensor: the caller's, or new zeroed scratch [d0] or [d0, d1]. */
static smelt_status need(layer *L, int r, smelt_dtype dt, int64_t d0, int64_t d1) {
  if (L->u[r]) return SMELT_OK;
  smelt_tensor *t = &L->scratch[L->n];
  smelt_status s = smelt__moe_scratch(t, dt, d0, d1, smelt__moe_roles[r].name);
  if (s) return s;
  L->n++;
  L->u[r] = t;
  return SMELT_OK;
}

static void layer_free(layer *L) {
  for (int i = 0; i < L->n; i++) free(L->scratch[i].data);
}

/* Router, permute and expert FFN: the forward up to the permuted outputs. */
static smelt_status forward_to_yp(smelt_ctx *ctx, const smelt__moe_state *ms, layer *L) {
  const smelt_dtype rd = ms->route_dt;
  const int64_t T = ms->T, E = ms->E, k = ms->k;
  smelt_status s;
  if ((s = need(L, SMELT__MT_LOGITS, rd, T, E)) || (s = need(L, SMELT__MT_IDS, SMELT_DTYPE_I32, T, k)) ||
      (s = need(L, SMELT__MT_WEIGHTS, rd, T, k)) || (s = need(L, SMELT__MT_COUNTS, SMELT_DTYPE_I64, E, -1)) ||
      (s = need(L, SMELT__MT_OFFSETS, SMELT_DTYPE_I64, E + 1, -1)) || (s = smelt__moe_cpu_route(ctx, ms, L->u)))
    return s;
  L->u[SMELT__MT_IDS_IN] = L->u[SMELT__MT_IDS];
  L->u[SMELT__MT_OFFSETS_IN] = L->u[SMELT__MT_OFFSETS];
  L->u[SMELT__MT_WEIGHTS_IN] = L->u[SMELT__MT_WEIGHTS];
  if ((s = need(L, SMELT__MT_XP, rd, ms->rows, ms->d)) || (s = need(L, SMELT__MT_ROW_MAP, SMELT_DTYPE_I32, T, k)) ||
      (s = smelt__moe_cpu_permute(ms, L->u)))
    return s;
  L->u[SMELT__MT_XP_IN] = L->u[SMELT__MT_XP];
  L->u[SMELT__MT_ROW_MAP_IN] = L->u[SMELT__MT_ROW_MAP];
  if ((s = need(L, SMELT__MT_YP, rd, ms->rows, ms->d)) || (s = smelt__moe_cpu_ffn(ctx, ms, L->u))) return s;
  L->u[SMELT__MT_YP_IN] = L->u[SMELT__MT_YP];
  return SMELT_OK;
}

static smelt_status forward(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_args *a) {
  layer L = {.n = 0};
  memcpy(L.u, a->t, sizeof L.u);
  smelt_status s = forward_to_yp(ctx, ms, &L);
  if (!s) s = smelt__moe_cpu_unpermute(ms, L.u);
  if (!s && a->stats) smelt__moe_stats_of(ms, L.u[SMELT__MT_COUNTS], L.u[SMELT__MT_DROPPED], a->stats);
  layer_free(&L);
  return s;
}

/* dwr = xᵀ·dlogits; dx = dlogits·Wrᵀ + the rest (dx_rest: the FFN's and the noise's parts). */
static smelt_status router_input_grads(smelt_ctx *ctx, const layer *L, const smelt_tensor *dx_rest) {
  const smelt_tensor xt = smelt__tensor_swap_axes(L->u[SMELT__MT_X], 0, 1);
  const smelt_tensor wt = smelt__tensor_swap_axes(L->u[SMELT__MT_WR], 0, 1);
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  smelt_status s = SMELT_OK;
  if (L->u[SMELT__MT_DWR]) s = smelt_gemm(ctx, &desc, &xt, L->u[SMELT__MT_DLOGITS], NULL, L->u[SMELT__MT_DWR], NULL);
  desc.epilogue.beta = 1.0;
  if (!s && L->u[SMELT__MT_DX])
    s = smelt_gemm(ctx, &desc, L->u[SMELT__MT_DLOGITS], &wt, dx_rest, L->u[SMELT__MT_DX], NULL);
  return s;
}

/* Through the noise's scale: with z = x·Wnoise, dz = dlogits ∘ n ∘ sigmoid(z);
 * dwnoise = xᵀ·dz, and dz·Wnoiseᵀ added to dx_rest (NULL: dx not wanted). */
static smelt_status noise_grads(smelt_ctx *ctx, const smelt__moe_state *ms, const layer *L,
                                const smelt_tensor *dx_rest) {
  const smelt_tensor *x = L->u[SMELT__MT_X], *wn = L->u[SMELT__MT_WNOISE], *dl = L->u[SMELT__MT_DLOGITS];
  smelt_tensor z = {0}, dz = {0};
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  /* z and dz in the routing dtype (f32, or f64 with f64 x), which the
   * GEMMs pair with x and Wnoise as they pair dlogits in the router's. */
  smelt_status s = smelt__moe_scratch(&z, ms->route_dt, ms->T, ms->E, "the noise's scale");
  if (!s) s = smelt__moe_scratch(&dz, ms->route_dt, ms->T, ms->E, "the noise's gradient");
  if (!s) s = smelt_gemm(ctx, &desc, x, wn, NULL, &z, NULL);
  for (int64_t t = 0; !s && t < ms->T; t++)
    for (int64_t e = 0; e < ms->E; e++) {
      const int64_t i = t * ms->E + e;
      const double n = smelt__moe_normal(ms->cfg.noise_seed, ms->cfg.noise_token_offset + t, e);
      smelt__moe_set(&dz, i, smelt__moe_get(dl, i) * n / (1.0 + exp(-smelt__moe_get(&z, i))));
    }
  const smelt_tensor xt = smelt__tensor_swap_axes(x, 0, 1), wt = smelt__tensor_swap_axes(wn, 0, 1);
  if (!s && L->u[SMELT__MT_DWNOISE]) s = smelt_gemm(ctx, &desc, &xt, &dz, NULL, L->u[SMELT__MT_DWNOISE], NULL);
  desc.epilogue.beta = 1.0;
  if (!s && dx_rest) s = smelt_gemm(ctx, &desc, &dz, &wt, dx_rest, dx_rest, NULL);
  free(z.data);
  free(dz.data);
  return s;
}

static smelt_status backward(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_args *a) {
  layer L = {.n = 0};
  memcpy(L.u, a->t, sizeof L.u);
  const smelt_dtype rd = ms->route_dt;
  const int input_grads = a->t[SMELT__MT_DX] || a->t[SMELT__MT_DWR] || a->t[SMELT__MT_DWNOISE];
  smelt_status s = forward_to_yp(ctx, ms, &L);
  if (!s && !(s = need(&L, SMELT__MT_DYP, rd, ms->rows, ms->d)) &&
      !(s = need(&L, SMELT__MT_DWEIGHTS, rd, ms->T, ms->k)))
    s = smelt__moe_cpu_unpermute_bwd(ms, L.u);
  L.u[SMELT__MT_DYP_IN] = L.u[SMELT__MT_DYP];
  L.u[SMELT__MT_DWEIGHTS_IN] = L.u[SMELT__MT_DWEIGHTS];
  L.u[SMELT__MT_LOGITS_IN] = L.u[SMELT__MT_LOGITS];
  if (!s && a->t[SMELT__MT_DX]) s = need(&L, SMELT__MT_DXP, rd, ms->rows, ms->d);
  if (!s) s = smelt__moe_cpu_ffn_bwd(ctx, ms, L.u);
  if (!s && input_grads && !(s = need(&L, SMELT__MT_DLOGITS, rd, ms->T, ms->E))) s = smelt__moe_cpu_route_bwd(ms, L.u);
  smelt_tensor dx_rest = {0};
  if (!s && a->t[SMELT__MT_DX] &&
      !(s = smelt__moe_scratch(&dx_rest, rd, ms->T, ms->d, "the FFN's and the noise's part of dx"))) {
    const smelt_tensor *p[SMELT__MT_ROLES] = {NULL};
    p[SMELT__MT_DXP_IN] = L.u[SMELT__MT_DXP];
    p[SMELT__MT_ROW_MAP_IN] = L.u[SMELT__MT_ROW_MAP];
    p[SMELT__MT_DX] = &dx_rest;
    s = smelt__moe_cpu_permute_bwd(ms, p);
  }
  if (!s && L.u[SMELT__MT_WNOISE] && (a->t[SMELT__MT_DX] || a->t[SMELT__MT_DWNOISE]))
    s = noise_grads(ctx, ms, &L, a->t[SMELT__MT_DX] ? &dx_rest : NULL);
  if (!s && input_grads) s = router_input_grads(ctx, &L, &dx_rest);
  free(dx_rest.data);
  layer_free(&L);
  return s;
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt__moe_args *a = (const smelt__moe_args *)args;
  const smelt__moe_state *ms = (const smelt__moe_state *)plan->opdata;
  smelt_ctx *ctx = plan->ctx;
  switch (a->mode) {
    case SMELT__MOE_ROUTE: return smelt__moe_cpu_route(ctx, ms, a->t);
    case SMELT__MOE_AUX: return smelt__moe_cpu_aux_run(ms, a->t);
    case SMELT__MOE_ROUTE_BWD: return smelt__moe_cpu_route_bwd(ms, a->t);
    case SMELT__MOE_PERMUTE: return smelt__moe_cpu_permute(ms, a->t);
    case SMELT__MOE_PERMUTE_BWD: return smelt__moe_cpu_permute_bwd(ms, a->t);
    case SMELT__MOE_UNPERMUTE: return smelt__moe_cpu_unpermute(ms, a->t);
    case SMELT__MOE_UNPERMUTE_BWD: return smelt__moe_cpu_unpermute_bwd(ms, a->t);
    case SMELT__MOE_FFN: return smelt__moe_cpu_ffn(ctx, ms, a->t);
    case SMELT__MOE_FFN_BWD: return smelt__moe_cpu_ffn_bwd(ctx, ms, a->t);
    /* The CPU keeps no state (saved_bytes 0): a saved run is the plain one. */
    case SMELT__MOE_FORWARD:
    case SMELT__MOE_FORWARD_SAVE: return forward(ctx, ms, a);
    case SMELT__MOE_BACKWARD:
    case SMELT__MOE_BACKWARD_SAVED: return backward(ctx, ms, a);
    case SMELT__MOE_STATS:
      smelt__moe_stats_of(ms, a->t[SMELT__MT_COUNTS_IN], a->t[SMELT__MT_DROPPED_IN], a->stats);
      return SMELT_OK;
    default: return smelt__error(SMELT_STATUS_INTERNAL, MOE_OP ": unknown run mode %d", (int)a->mode);
  }
}

const smelt__backend smelt__cpu_moe = {.run = run};
