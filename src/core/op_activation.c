/* smelt_activation (y = act(x), elementwise): the activation table (names and
 * the double-precision definitions every backend is checked against), the
 * plan/run/one-shot entry points, and the output-layout check every op's plan
 * uses. Validation happens before anything is written. */
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const char *const act_names[SMELT_ACT_COUNT] = {
    "identity", "relu", "leaky_relu", "tanh", "sigmoid", "silu", "hardswish", "gelu", "gelu_tanh",
};
#define ACT_LIST "identity, relu, leaky_relu, tanh, sigmoid, silu, hardswish, gelu, gelu_tanh"

const char *smelt_act_name(smelt_act a) { return (unsigned)a < SMELT_ACT_COUNT ? act_names[a] : "?"; }

smelt_status smelt_act_from_name(const char *name, smelt_act *out) {
  if (!name || !out)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_act_from_name: %s is NULL", name ? "out" : "name");
  for (int a = 0; a < SMELT_ACT_COUNT; a++)
    if (!strcmp(name, act_names[a])) {
      *out = (smelt_act)a;
      return SMELT_OK;
    }
  return smelt__error(SMELT_STATUS_NOT_FOUND, "smelt_act_from_name: \"%s\" is not an activation (supported: %s)", name,
                      ACT_LIST);
}

/* The definitions of smelt.h, in forms without cancellation where a form
 * would lose digits: gelu through erfc (1 + erf(x) cancels for x < 0) and
 * gelu_tanh as x·sigmoid(2z) = 0.5·x·(1 + tanh z). Kernels use the same
 * forms, so infinities and NaN come out the same (e.g. silu(-inf) and
 * gelu(-inf) are -inf·0 = NaN, as in PyTorch). NaN propagates through all. */
double smelt_act_apply(smelt_act a, double x, double slope) {
  switch (a) {
    case SMELT_ACT_IDENTITY: return x;
    case SMELT_ACT_RELU: return x < 0 ? 0.0 : x;
    case SMELT_ACT_LEAKY_RELU: return x >= 0 ? x : slope * x;
    case SMELT_ACT_TANH: return tanh(x);
    case SMELT_ACT_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case SMELT_ACT_SILU: return x / (1.0 + exp(-x));
    case SMELT_ACT_HARDSWISH: return x * fmin(fmax(x + 3.0, 0.0), 6.0) / 6.0;
    case SMELT_ACT_GELU: return 0.5 * x * erfc(-x * 0.70710678118654752440);
    case SMELT_ACT_GELU_TANH: {
      double z = 0.7978845608 * (x + 0.044715 * x * x * x);
      return x / (1.0 + exp(-2.0 * z));
    }
    default: return NAN;
  }
}

/* ---- smelt_activation */

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* y may be x itself (same data and strides), or memory disjoint from x. */
static smelt_status check_in_place_or_disjoint(const smelt_tensor *x, const smelt_tensor *y) {
  int same = x->data == y->data;
  for (int d = 0; same && d < x->ndim; d++) same = x->shape[d] == 1 || x->strides[d] == y->strides[d];
  if (!same && smelt__tensors_overlap(x, y))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "smelt_activation: y overlaps x; y must be x exactly (in place) or disjoint from it");
  return SMELT_OK;
}

smelt_status smelt_activation_plan(smelt_ctx *ctx, const smelt_activation_desc *desc, const smelt_tensor *x,
                                   const smelt_tensor *y, smelt_plan **out) {
  static const char *op = "smelt_activation";
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: out is NULL", op);
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: ctx is NULL", op);
  if (!desc) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: desc is NULL", op);
  if ((unsigned)desc->act >= SMELT_ACT_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->act=%d is not a smelt_act (supported: %s)", op,
                        (int)desc->act, ACT_LIST);
  if (desc->act == SMELT_ACT_LEAKY_RELU && !isfinite(desc->slope))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->slope=%g must be finite for leaky_relu", op,
                        (double)desc->slope);
  smelt_status s;
  if ((s = smelt__check_tensor(op, "x", x)) || (s = smelt__check_tensor(op, "y", y)) ||
      (s = smelt__check_device(op, "x", x, ctx)) || (s = smelt__check_device(op, "y", y, ctx)) ||
      (s = smelt__check_dtype(op, "x", x, float_types, 3)))
    return s;
  if (y->dtype != x->dtype)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: y.dtype=%s must equal x.dtype=%s", op,
                        smelt_dtype_name(y->dtype), smelt_dtype_name(x->dtype));
  if ((s = smelt__check_same_shape(op, "x", x, "y", y)) || (s = smelt__check_output(op, "y", y)) ||
      (s = check_in_place_or_disjoint(x, y)))
    return s;
  smelt_plan *plan;
  if ((s = smelt__plan_new(ctx, SMELT__OP_ACTIVATION, &plan))) return s;
  plan->ntensors = 2;
  plan->t[0] = *x;
  plan->t[1] = *y;
  plan->p.act = *desc;
  snprintf(plan->describe, sizeof plan->describe, "activation %s %s (cpu reference)", smelt_act_name(desc->act),
           smelt_dtype_name(x->dtype));
  if (ctx->device == SMELT_DEVICE_CUDA && (s = smelt__cuda_activation_plan(plan))) {
    smelt_plan_destroy(plan);
    return s;
  }
  *out = plan;
  return SMELT_OK;
}

smelt_status smelt_activation_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *y) {
  static const char *op = "smelt_activation";
  if (!plan) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s_run: plan is NULL", op);
  if (plan->op != SMELT__OP_ACTIVATION)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s_run: the plan is not an activation plan", op);
  smelt_status s;
  if ((s = smelt__check_same_layout(op, "x", &plan->t[0], x)) ||
      (s = smelt__check_same_layout(op, "y", &plan->t[1], y)) || (s = check_in_place_or_disjoint(x, y)))
    return s;
  if (plan->ctx->device == SMELT_DEVICE_CUDA) return smelt__cuda_activation_run(plan, x, y);
  return smelt__cpu_activation(plan, x, y);
}

smelt_status smelt_activation(smelt_ctx *ctx, const smelt_activation_desc *desc, const smelt_tensor *x,
                              const smelt_tensor *y) {
  smelt_plan *plan;
  smelt_status s = smelt_activation_plan(ctx, desc, x, y, &plan);
  if (s) return s;
  s = smelt_activation_run(plan, x, y);
  smelt_plan_destroy(plan);
  return s;
}
