/* smelt_moe_*: the configuration, MoE's half of the op-family interface
 * (its tensor roles, the config and weight checks) and the plan. The runs'
 * entry points are in op_moe_runs.c.
 *
 * One plan serves the layer and every part, each with tensors of its own,
 * and the weights come as a struct, so MoE has entry points of its own
 * around the shared pieces (src/core/family.c), as PEER does. */
#include "checked.h"
#include "error_bound.h"
#include "moe_internal.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

smelt_moe_config smelt_moe_config_default(void) {
  smelt_moe_config c;
  memset(&c, 0, sizeof c);
  c.score = SMELT_MOE_SCORE_SOFTMAX;
  c.renormalize = 1;
  c.scaling_factor = 1.0;
  c.drop_policy = SMELT_MOE_DROP_NONE;
  c.ffn = SMELT_MOE_FFN_SWIGLU;
  c.activation = SMELT_ACT_GELU;
  return c;
}

/* ---------------------------------------------------------------- the config */

#define DIM_MAX ((int64_t)1 << 31)

static smelt_status take_dim(const char *field, int64_t v, int64_t lo, int64_t *out) {
  if (v < lo || v >= DIM_MAX)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": cfg.%s=%lld must be in [%lld, 2^31)", field,
                        (long long)v, (long long)lo);
  *out = v;
  return SMELT_OK;
}

static smelt_status check_coeff(const char *field, double v, int may_be_negative) {
  if (!isfinite(v) || (!may_be_negative && v < 0))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": cfg.%s=%g must be finite%s", field, v,
                        may_be_negative ? "" : " and >= 0");
  return SMELT_OK;
}

/* Group-limited routing's constraints (smelt/moe.h). */
static smelt_status check_groups(const smelt_moe_config *c) {
  const int64_t G = c->num_groups, tg = c->topk_groups;
  if (!G && !tg) return SMELT_OK;
  if (G < 1 || c->num_experts % G)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": cfg.num_groups=%lld must divide num_experts=%lld",
                        (long long)G, (long long)c->num_experts);
  if (tg < 1 || tg > G || tg > c->top_k)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        MOE_OP ": cfg.topk_groups=%lld must be in [1, min(num_groups=%lld, top_k=%lld)]",
                        (long long)tg, (long long)G, (long long)c->top_k);
  if (c->top_k > tg * (c->num_experts / G))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        MOE_OP ": cfg.top_k=%lld exceeds the %lld experts of topk_groups=%lld groups of %lld",
                        (long long)c->top_k, (long long)(tg * (c->num_experts / G)), (long long)tg,
                        (long long)(c->num_experts / G));
  return SMELT_OK;
}

static smelt_status check_capacity(const smelt_moe_config *c) {
  smelt_status s = check_coeff("capacity_factor", c->capacity_factor, 0);
  if (s) return s;
  if ((unsigned)c->drop_policy >= SMELT_MOE_DROP_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        MOE_OP ": cfg.drop_policy=%d is not a smelt_moe_drop (none, probs, position)",
                        (int)c->drop_policy);
  if ((c->capacity_factor > 0) != (c->drop_policy != SMELT_MOE_DROP_NONE))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        MOE_OP ": cfg.capacity_factor=%g and cfg.drop_policy=%d disagree: a capacity needs a drop "
                               "policy (probs or position), none needs capacity_factor 0",
                        c->capacity_factor, (int)c->drop_policy);
  return SMELT_OK;
}

static smelt_status resolve_config(const smelt_moe_config *c, smelt__moe_state *ms) {
  smelt_status s;
  memset(ms, 0, sizeof *ms);
  ms->cfg = *c;
  if ((s = take_dim("num_experts", c->num_experts, 1, &ms->E)) || (s = take_dim("d_model", c->d_model, 1, &ms->d)) ||
      (s = take_dim("ffn_dim", c->ffn_dim, 1, &ms->F)))
    return s;
  if (c->top_k < 1 || c->top_k > c->num_experts)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": cfg.top_k=%lld must be in [1, num_experts=%lld]",
                        (long long)c->top_k, (long long)c->num_experts);
  ms->k = c->top_k;
  if ((unsigned)c->score >= SMELT_MOE_SCORE_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        MOE_OP ": cfg.score=%d is not a smelt_moe_score (softmax, sigmoid)",
                        (int)c->score);
  if ((unsigned)c->ffn >= SMELT_MOE_FFN_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": cfg.ffn=%d is not a smelt_moe_ffn (swiglu, mlp)",
                        (int)c->ffn);
  if (c->ffn == SMELT_MOE_FFN_MLP && (unsigned)c->activation >= SMELT_ACT_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": cfg.activation=%d is not a smelt_act",
                        (int)c->activation);
  if (c->noise_token_offset < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": cfg.noise_token_offset=%lld must be >= 0",
                        (long long)c->noise_token_offset);
  if ((s = check_coeff("scaling_factor", c->scaling_factor, 1)) ||
      (s = check_coeff("aux_loss_coeff", c->aux_loss_coeff, 0)) ||
      (s = check_coeff("z_loss_coeff", c->z_loss_coeff, 0)) || (s = check_groups(c)) || (s = check_capacity(c)))
    return s;
  return SMELT_OK;
}

/* T tokens: the permuted rows T·k (i32 row indices), T·E, and the noise's
 * token numbers noise_token_offset + t for t < T, each within its range. */
static smelt_status take_tokens(smelt__moe_state *ms, int64_t T, const char *op) {
  smelt_status s;
  ms->T = T;
  if ((s = smelt__mul_i64(T, ms->k, &ms->rows, op, "T * top_k")) ||
      (s = smelt__mul_i64(T, ms->E, &(int64_t){0}, op, "T * num_experts")))
    return s;
  if (ms->rows >= DIM_MAX)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: %lld tokens times top_k=%lld must be < 2^31 (i32 row indices)", op, (long long)T,
                        (long long)ms->k);
  if (T > 0 && ms->cfg.noise_token_offset > INT64_MAX - (T - 1))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: cfg.noise_token_offset=%lld plus %lld tokens - 1 exceeds 2^63 - 1", op,
                        (long long)ms->cfg.noise_token_offset, (long long)T);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- weights and x */

/* x and the weights by role (NULL = absent). */
void smelt__moe_weight_list(const smelt_moe_weights *w, const smelt_tensor *x, const smelt_tensor **out) {
  out[SMELT__MT_X] = x;
  out[SMELT__MT_WR] = w->wr;
  out[SMELT__MT_BIAS] = w->expert_bias;
  out[SMELT__MT_WNOISE] = w->wnoise;
  out[SMELT__MT_W1] = w->w1;
  out[SMELT__MT_W3] = w->w3;
  out[SMELT__MT_W2] = w->w2;
  out[SMELT__MT_B1] = w->b1;
}

/* Which FFN weights the config takes: all of them or none. */
static smelt_status check_ffn_set(const smelt_tensor *const *l, const smelt_moe_config *c) {
  const int swiglu = c->ffn == SMELT_MOE_FFN_SWIGLU;
  const int any = l[SMELT__MT_W1] || l[SMELT__MT_W3] || l[SMELT__MT_W2] || l[SMELT__MT_B1];
  if (!any) return SMELT_OK;
  if (!l[SMELT__MT_W1] || !l[SMELT__MT_W2] || (swiglu && !l[SMELT__MT_W3]))
    return smelt__error(SMELT_STATUS_NULL_POINTER,
                        MOE_OP ": the expert weights are partly given: %s needs w1, w2%s (or none of them, for the "
                               "router's parts only)",
                        swiglu ? "swiglu" : "mlp", swiglu ? " and w3" : "");
  if (swiglu && l[SMELT__MT_B1])
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": weights.b1 is given but cfg.ffn is swiglu (no bias)");
  if (!swiglu && l[SMELT__MT_W3])
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": weights.w3 is given but cfg.ffn is mlp");
  return SMELT_OK;
}

/* f64 (the CPU's gradient-check type) pairs only with f64: x and every
 * weight but the f32 selection bias. */
static smelt_status check_f64(const smelt_tensor *const *l) {
  const int x64 = l[SMELT__MT_X]->dtype == SMELT_DTYPE_F64;
  for (int r = SMELT__MT_WR; r < SMELT__MT_COUNT; r++)
    if (r != SMELT__MT_BIAS && l[r] && (l[r]->dtype == SMELT_DTYPE_F64) != x64)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH,
                          MOE_OP ": weights.%s.dtype=%s with x.dtype=%s: f64 pairs only with f64",
                          smelt__moe_roles[r].name,
                          smelt_dtype_name(l[r]->dtype), smelt_dtype_name(l[SMELT__MT_X]->dtype));
  return SMELT_OK;
}

static smelt_status check_weights(smelt_ctx *ctx, const smelt_moe_weights *w, const smelt_tensor *x,
                                  smelt__moe_state *ms) {
  if (!w) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP ": weights is NULL");
  if (!x) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP ": x is NULL");
  if (!w->wr) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP ": weights.wr is NULL");
  const smelt_tensor *l[SMELT__MT_ROLES] = {NULL};
  smelt__moe_weight_list(w, x, l);
  smelt_status s;
  for (int r = 0; r < SMELT__MT_COUNT; r++)
    if (l[r] && (s = smelt__check_role(MOE_OP, &smelt__moe_roles[r], l[r], ctx))) return s;
  if (x->ndim != 2)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, MOE_OP ": x.ndim=%d must be 2 (x[T, d_model])", x->ndim);
  if ((s = take_tokens(ms, x->shape[0], MOE_OP))) return s;
  for (int r = 0; r < SMELT__MT_COUNT; r++)
    if (l[r] && (s = smelt__moe_check_shape(ms, r, l[r], x->dtype))) return s;
  if ((s = check_ffn_set(l, &ms->cfg)) || (s = check_f64(l))) return s;
  for (int r = 0; r < SMELT__MT_ROLES; r++) {
    if (r < SMELT__MT_COUNT && l[r]) ms->t[r] = *l[r];
    else ms->t[r].ndim = -1;
  }
  ms->route_dt = x->dtype == SMELT_DTYPE_F64 ? SMELT_DTYPE_F64 : SMELT_DTYPE_F32;
  ms->capacity = -1;
  if (ms->cfg.capacity_factor > 0) {
    const double c = ceil((double)ms->rows / (double)ms->E * ms->cfg.capacity_factor);
    ms->capacity = c < (double)ms->T ? (int64_t)c : ms->T;
  }
  return SMELT_OK;
}

/* smelt_moe_saved_bytes_for: the config resolved as a plan resolves it,
 * T and x's dtype as x would give them, then the backend's count. */
smelt_status smelt__moe_saved_bytes_for(const smelt_moe_config *cfg, int64_t tokens, smelt_dtype x_dtype,
                                        smelt_device_kind device, int64_t *bytes) {
  const char *op = MOE_OP "_saved_bytes_for";
  if (!cfg) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: cfg is NULL", op);
  if (device != SMELT_DEVICE_CPU && device != SMELT_DEVICE_CUDA)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: device=%d is not CPU or CUDA", op, (int)device);
  if (x_dtype != SMELT_DTYPE_F32 && x_dtype != SMELT_DTYPE_F16 && x_dtype != SMELT_DTYPE_BF16 &&
      x_dtype != SMELT_DTYPE_F64)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: x_dtype=%s is not f32, f16, bf16 or f64", op,
                        smelt_dtype_name(x_dtype));
  smelt__moe_state ms;
  smelt_status s = resolve_config(cfg, &ms);
  if (s) return s;
  if (tokens < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: tokens=%lld must be >= 0", op, (long long)tokens);
  if ((s = take_tokens(&ms, tokens, op))) return s;
  ms.t[SMELT__MT_X].dtype = x_dtype;
  *bytes = device == SMELT_DEVICE_CUDA ? (int64_t)smelt__moe_cuda_saved_bytes(&ms) : 0;
  return SMELT_OK;
}

/* ---------------------------------------------------------------- the family and the plan */

static void state_free(void *p) {
  smelt__moe_state *ms = (smelt__moe_state *)p;
  if (ms && ms->cuda_free) ms->cuda_free(ms->cuda);
  free(ms);
}

const smelt__family smelt__family_moe = {
    .name = "moe",
    .op = MOE_OP,
    .what = "a MoE",
    .nroles = SMELT__MT_ROLES,
    .roles = smelt__moe_roles,
    .cpu = &smelt__cpu_moe,
    .cuda = &smelt__cuda_moe,
    .bound = smelt__bound_moe,
};

smelt_status smelt_moe_plan(smelt_ctx *ctx, const smelt_moe_config *cfg, const smelt_moe_weights *w,
                            const smelt_tensor *x, smelt_plan **out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP ": out is NULL");
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP ": ctx is NULL");
  if (!cfg) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP ": cfg is NULL");
  smelt__moe_state *ms = (smelt__moe_state *)calloc(1, sizeof *ms);
  if (!ms) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": out of host memory");
  smelt_status s = resolve_config(cfg, ms);
  if (!s) s = check_weights(ctx, w, x, ms);
  if (s) {
    free(ms);
    return s;
  }
  char describe[160];
  snprintf(describe, sizeof describe, "moe E=%lld k=%lld d=%lld F=%lld %s %s (cpu reference)", (long long)ms->E,
           (long long)ms->k, (long long)ms->d, (long long)ms->F,
           ms->cfg.score == SMELT_MOE_SCORE_SOFTMAX ? "softmax" : "sigmoid",
           ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU ? "swiglu" : smelt_act_name(ms->cfg.activation));
  return smelt__family_plan_state(&smelt__family_moe, ctx, ms, state_free, describe, NULL, out);
}
