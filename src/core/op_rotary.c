/* smelt_rotary: rotary position embedding over [B, S, H, D] with f32
 * cos/sin tables, GPT-NeoX or GPT-J pairs, partial rotary and its inverse
 * (the backward). The family's half of the op-family interface: roles,
 * the shape checks, and the host helper that fills the tables. */
#include "error_bound.h"
#include "internal.h"

#include <math.h>
#include <stdio.h>

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype f32[] = {SMELT_DTYPE_F32};
static const smelt_dtype index_types[] = {SMELT_DTYPE_I32, SMELT_DTYPE_I64};

const char *smelt_rotary_layout_name(smelt_rotary_layout l) {
  return l == SMELT_ROTARY_NEOX ? "neox" : l == SMELT_ROTARY_GPTJ ? "gptj" : "?";
}

smelt_status smelt_rotary_tables(double theta, int64_t P, int64_t R, float *cos_t, float *sin_t) {
  const char *op = "smelt_rotary_tables";
  if (!cos_t || !sin_t) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL", op, cos_t ? "sin" : "cos");
  if (!(theta > 0) || isinf(theta))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: theta=%g must be finite and > 0", op, theta);
  if (P < 0 || R < 2 || R % 2)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: P=%lld must be >= 0 and R=%lld even and >= 2", op,
                        (long long)P, (long long)R);
  for (int64_t i = 0; i < R / 2; i++) {
    const double freq = pow(theta, -2.0 * (double)i / (double)R);
    for (int64_t p = 0; p < P; p++) {
      cos_t[p * (R / 2) + i] = (float)cos((double)p * freq);
      sin_t[p * (R / 2) + i] = (float)sin((double)p * freq);
    }
  }
  return SMELT_OK;
}

static const smelt__role roles[] = {
    {"x", 0, float_types, 3, 0},
    {"cos", 0, f32, 1, 0},
    {"sin", 0, f32, 1, 0},
    {"positions", SMELT__ROLE_OPTIONAL, index_types, 2, 0},
    {"y", SMELT__ROLE_OUTPUT | SMELT__ROLE_IN_PLACE | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
};

static smelt_status check_table(const char *op, const char *name, const smelt_tensor *t, const smelt_tensor *x) {
  const int64_t D = x->shape[3];
  /* shape[1] > D / 2, not 2 * shape[1] > D: a huge shape must not overflow. */
  if (t->ndim != 2 || t->shape[1] < 1 || t->shape[1] > D / 2)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                        "%s: %s must be [P, R/2] with 2 <= R <= D=%lld (got ndim=%d, shape[-1]=%lld)", op, name,
                        (long long)D, t->ndim, (long long)(t->ndim ? t->shape[t->ndim - 1] : 0));
  if (t->shape[1] > 1 && t->strides[1] != 1)
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[1]=%lld must be 1", op, name,
                        (long long)t->strides[1]);
  return SMELT_OK;
}

static smelt_status check(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_rotary.op;
  const smelt_rotary_desc *d = (const smelt_rotary_desc *)params;
  const smelt_tensor *x = t[0], *c = t[1], *s = t[2], *pos = t[3];
  if (!d) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: desc is NULL", op);
  if ((unsigned)d->layout >= SMELT_ROTARY_LAYOUT_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc.layout=%d is not one of neox (0), gptj (1)", op,
                        (int)d->layout);
  if (d->inverse != 0 && d->inverse != 1)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc.inverse=%d must be 0 or 1", op, d->inverse);
  if (x->ndim != 4)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: x must be [B, S, H, D] (got ndim=%d)", op, x->ndim);
  smelt_status st = smelt__check_same_shape(op, "x", x, "y", t[4]);
  if (st) return st;
  if (x->shape[3] > 1 && (x->strides[3] != 1 || t[4]->strides[3] != 1))
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[3]=%lld must be 1 (heads are contiguous along D)",
                        op, x->strides[3] != 1 ? "x" : "y", (long long)(x->strides[3] != 1 ? x : t[4])->strides[3]);
  if ((st = check_table(op, "cos", c, x)) ||
      (st = check_table(op, "sin", s, x)) || (st = smelt__check_same_shape(op, "cos", c, "sin", s)))
    return st;
  if (pos && (pos->ndim != 2 || pos->shape[0] != x->shape[0] || pos->shape[1] != x->shape[1]))
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: positions must be [B, S] = [%lld, %lld]", op,
                        (long long)x->shape[0], (long long)x->shape[1]);
  if (!pos && x->shape[1] > c->shape[0])
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                        "%s: S=%lld exceeds the tables' P=%lld positions (pass positions, or longer tables)", op,
                        (long long)x->shape[1], (long long)c->shape[0]);
  if (c->shape[0] < 1 && smelt_tensor_numel(x) > 0)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: cos has P=0 positions", op);
  snprintf(plan->describe, sizeof plan->describe, "rotary %s %s%s R=%lld D=%lld (cpu reference)",
           smelt_rotary_layout_name(d->layout), smelt_dtype_name(x->dtype), d->inverse ? " inverse" : "",
           (long long)(2 * c->shape[1]), (long long)x->shape[3]);
  return SMELT_OK;
}

const smelt__family smelt__family_rotary = {
    .name = "rotary",
    .op = "smelt_rotary",
    .what = "a rotary",
    .nroles = 5,
    .roles = roles,
    .params_size = sizeof(smelt_rotary_desc),
    .check = check,
    .cpu = &smelt__cpu_rotary,
    .cuda = &smelt__cuda_rotary,
    .bound = smelt__bound_norm,
};

smelt_status smelt_rotary_plan(smelt_ctx *ctx, const smelt_rotary_desc *desc, const smelt_tensor *x,
                               const smelt_tensor *cos, const smelt_tensor *sin, const smelt_tensor *positions,
                               const smelt_tensor *y, smelt_plan **out) {
  const smelt_tensor *t[] = {x, cos, sin, positions, y};
  return smelt__family_plan(&smelt__family_rotary, ctx, desc, t, out);
}

smelt_status smelt_rotary_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *cos,
                              const smelt_tensor *sin, const smelt_tensor *positions, const smelt_tensor *y) {
  const smelt_tensor *t[] = {x, cos, sin, positions, y};
  return smelt__family_run(&smelt__family_rotary, plan, t);
}

smelt_status smelt_rotary(smelt_ctx *ctx, const smelt_rotary_desc *desc, const smelt_tensor *x,
                          const smelt_tensor *cos, const smelt_tensor *sin, const smelt_tensor *positions,
                          const smelt_tensor *y) {
  SMELT__ONE_SHOT(smelt_rotary_plan(ctx, desc, x, cos, sin, positions, y, &plan),
                  smelt_rotary_run(plan, x, cos, sin, positions, y));
}
