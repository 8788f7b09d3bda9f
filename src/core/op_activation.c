/* smelt_activation (y = act(x), elementwise): the activation table (names and
 * the double-precision definitions every backend is checked against) and the
 * family's half of the op-family interface (src/core/family.c does the rest).
 * Validation happens before anything is written. */
#include "error_bound.h"
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

/* The derivative of smelt_act_apply(a, x, slope) in x (the CPU references'
 * backward passes). */
double smelt__act_grad(smelt_act a, double x, double slope) {
  const double sg = 1.0 / (1.0 + exp(-x));
  switch (a) {
    case SMELT_ACT_RELU: return x > 0 ? 1.0 : 0.0;
    case SMELT_ACT_LEAKY_RELU: return x >= 0 ? 1.0 : slope;
    case SMELT_ACT_TANH: return 1.0 - tanh(x) * tanh(x);
    case SMELT_ACT_SIGMOID: return sg * (1.0 - sg);
    case SMELT_ACT_SILU: return sg * (1.0 + x * (1.0 - sg));
    case SMELT_ACT_HARDSWISH: return x < -3 ? 0.0 : x > 3 ? 1.0 : (2.0 * x + 3.0) / 6.0;
    case SMELT_ACT_GELU: return 0.5 * (1.0 + erf(x / sqrt(2.0))) + x * exp(-0.5 * x * x) / sqrt(2.0 * 3.14159265358979323846);
    case SMELT_ACT_GELU_TANH: {
      const double c = 0.7978845608, u = c * (x + 0.044715 * x * x * x), th = tanh(u);
      return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * c * (1.0 + 3.0 * 0.044715 * x * x);
    }
    default: return 1.0;
  }
}

/* ---- smelt_activation */

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* y may be x itself (same data and strides), or memory disjoint from x. */
static const smelt__role roles[] = {
    {"x", 0, float_types, 3, 0},
    {"y", SMELT__ROLE_OUTPUT | SMELT__ROLE_IN_PLACE | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
};

static smelt_status check(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_activation.op;
  const smelt_activation_desc *desc = (const smelt_activation_desc *)params;
  if (!desc) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: desc is NULL", op);
  if ((unsigned)desc->act >= SMELT_ACT_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->act=%d is not a smelt_act (supported: %s)", op,
                        (int)desc->act, ACT_LIST);
  if (desc->act == SMELT_ACT_LEAKY_RELU && !isfinite(desc->slope))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->slope=%g must be finite for leaky_relu", op,
                        (double)desc->slope);
  smelt_status s = smelt__check_same_shape(op, "x", t[0], "y", t[1]);
  if (s) return s;
  plan->p.act = *desc;
  snprintf(plan->describe, sizeof plan->describe, "activation %s %s (cpu reference)", smelt_act_name(desc->act),
           smelt_dtype_name(t[0]->dtype));
  return SMELT_OK;
}

const smelt__family smelt__family_activation = {
    .name = "activation",
    .op = "smelt_activation",
    .what = "an activation",
    .nroles = 2,
    .roles = roles,
    .check = check,
    .cpu = &smelt__cpu_activation,
    .cuda = &smelt__cuda_activation,
    .bound = smelt__bound_elementwise,
};

smelt_status smelt_activation_plan(smelt_ctx *ctx, const smelt_activation_desc *desc, const smelt_tensor *x,
                                   const smelt_tensor *y, smelt_plan **out) {
  const smelt_tensor *t[] = {x, y};
  return smelt__family_plan(&smelt__family_activation, ctx, desc, t, out);
}

smelt_status smelt_activation_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *y) {
  const smelt_tensor *t[] = {x, y};
  return smelt__family_run(&smelt__family_activation, plan, t);
}

smelt_status smelt_activation(smelt_ctx *ctx, const smelt_activation_desc *desc, const smelt_tensor *x,
                              const smelt_tensor *y) {
  SMELT__ONE_SHOT(smelt_activation_plan(ctx, desc, x, y, &plan), smelt_activation_run(plan, x, y));
}
