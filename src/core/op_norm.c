/* smelt_norm and smelt_norm_bwd: RMSNorm and LayerNorm over the last dim,
 * the forward with an optional residual add before it, the backward with
 * the weight and bias gradients. Two families on the op-family interface
 * (src/core/family.c does the shared checks); this file holds their roles
 * and the shape checks the two share. */
#include "error_bound.h"
#include "internal.h"

#include <math.h>
#include <stdio.h>

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype f32[] = {SMELT_DTYPE_F32};

const char *smelt_norm_kind_name(smelt_norm_kind k) {
  return k == SMELT_NORM_RMS ? "rms" : k == SMELT_NORM_LAYER ? "layer" : "?";
}

/* [..., C] with unit stride along C (any when C == 1, where it is never used). */
static smelt_status check_rows(const char *op, const char *name, const smelt_tensor *t, const smelt_tensor *x) {
  smelt_status s = smelt__check_same_shape(op, "x", x, name, t);
  if (s) return s;
  const int64_t C = t->shape[t->ndim - 1];
  if (C > 1 && t->strides[t->ndim - 1] != 1)
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[-1]=%lld must be 1 (rows are contiguous along C)", op,
                        name, (long long)t->strides[t->ndim - 1]);
  return SMELT_OK;
}

/* [C] with unit stride, in x's dtype or f32, and the dtype of the other
 * parameter vector when both are given. */
static smelt_status check_vector(const char *op, const char *name, const smelt_tensor *t, const smelt_tensor *x,
                                 const smelt_tensor *other) {
  const int64_t C = x->shape[x->ndim - 1];
  if (t->ndim != 1 || t->shape[0] != C)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s must be [C] = [%lld] (got ndim=%d, shape[0]=%lld)", op,
                        name, (long long)C, t->ndim, (long long)(t->ndim ? t->shape[0] : 0));
  if (C > 1 && t->strides[0] != 1)
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[0]=%lld must be 1", op, name,
                        (long long)t->strides[0]);
  if (t->dtype != x->dtype && t->dtype != SMELT_DTYPE_F32)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%s must be x's (%s) or f32", op, name,
                        smelt_dtype_name(t->dtype), smelt_dtype_name(x->dtype));
  if (other && other->dtype != t->dtype)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%s must equal weight.dtype=%s", op, name,
                        smelt_dtype_name(t->dtype), smelt_dtype_name(other->dtype));
  return SMELT_OK;
}

/* [...]: x's shape without its last dim. */
static smelt_status check_stats(const char *op, const char *name, const smelt_tensor *t, const smelt_tensor *x) {
  int same = t->ndim == x->ndim - 1;
  for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == x->shape[d];
  if (same) return SMELT_OK;
  smelt_tensor lead = *x;
  lead.ndim = x->ndim - 1;
  char a[160], b[160];
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape=%s must equal x.shape[:-1]=%s", op, name,
                      smelt__shape_str(t, a, sizeof a), smelt__shape_str(&lead, b, sizeof b));
}

static smelt_status check_desc(const char *op, const smelt_norm_desc *d, const smelt_tensor *x) {
  if (!d) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: desc is NULL", op);
  if ((unsigned)d->kind >= SMELT_NORM_KIND_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc.kind=%d is not one of rms (0), layer (1)", op,
                        (int)d->kind);
  if (!(d->eps >= 0.f) || isinf(d->eps))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc.eps=%g must be finite and >= 0", op, (double)d->eps);
  if (x->ndim < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: x.ndim=0 must be >= 1 (the norm runs over the last dim)",
                        op);
  if (x->shape[x->ndim - 1] < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: x.shape[-1]=%lld must be >= 1", op,
                        (long long)x->shape[x->ndim - 1]);
  return SMELT_OK;
}

/* mean: LayerNorm's only (required in the backward, `need`). */
static smelt_status check_mean(const char *op, smelt_norm_kind kind, const smelt_tensor *mean, const smelt_tensor *x,
                               int need) {
  if (kind == SMELT_NORM_RMS && mean)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: mean is given but RMSNorm has none (pass NULL)", op);
  if (kind == SMELT_NORM_LAYER && need && !mean)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: mean is NULL; the LayerNorm backward needs it", op);
  return mean ? check_stats(op, "mean", mean, x) : SMELT_OK;
}

/* ---- forward: x, residual, weight, bias, y, h_out, mean, rstd */

static const smelt__role fwd_roles[] = {
    {"x", 0, float_types, 3, 0},
    {"residual", SMELT__ROLE_OPTIONAL | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"weight", SMELT__ROLE_OPTIONAL, float_types, 3, 0},
    {"bias", SMELT__ROLE_OPTIONAL, float_types, 3, 0},
    {"y", SMELT__ROLE_OUTPUT | SMELT__ROLE_IN_PLACE | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"h_out", SMELT__ROLE_OUTPUT | SMELT__ROLE_OPTIONAL | SMELT__ROLE_IN_PLACE | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 1},
    {"mean", SMELT__ROLE_OUTPUT | SMELT__ROLE_OPTIONAL, f32, 1, 0},
    {"rstd", SMELT__ROLE_OUTPUT | SMELT__ROLE_OPTIONAL, f32, 1, 0},
};

static smelt_status check_fwd(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_norm.op;
  const smelt_norm_desc *d = (const smelt_norm_desc *)params;
  const smelt_tensor *x = t[0], *res = t[1], *w = t[2], *b = t[3];
  smelt_status s;
  if ((s = check_desc(op, d, x)) || (s = check_rows(op, "x", x, x)) || (s = check_rows(op, "y", t[4], x)))
    return s;
  if (res && (s = check_rows(op, "residual", res, x))) return s;
  if (t[5] && !res)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: h_out is given without residual (h_out = x + residual)", op);
  if (t[5] && (s = check_rows(op, "h_out", t[5], x))) return s;
  if ((w && (s = check_vector(op, "weight", w, x, NULL))) || (b && (s = check_vector(op, "bias", b, x, w))) ||
      (s = check_mean(op, d->kind, t[6], x, 0)) || (t[7] && (s = check_stats(op, "rstd", t[7], x))))
    return s;
  snprintf(plan->describe, sizeof plan->describe, "norm %s %s C=%lld%s (cpu reference)", smelt_norm_kind_name(d->kind),
           smelt_dtype_name(x->dtype), (long long)x->shape[x->ndim - 1], res ? " +residual" : "");
  return SMELT_OK;
}

const smelt__family smelt__family_norm = {
    .name = "norm",
    .op = "smelt_norm",
    .what = "a norm",
    .nroles = 8,
    .roles = fwd_roles,
    .params_size = sizeof(smelt_norm_desc),
    .check = check_fwd,
    .cpu = &smelt__cpu_norm,
    .cuda = &smelt__cuda_norm,
    .bound = smelt__bound_norm,
};

smelt_status smelt_norm_plan(smelt_ctx *ctx, const smelt_norm_desc *desc, const smelt_tensor *x,
                             const smelt_tensor *residual, const smelt_tensor *weight, const smelt_tensor *bias,
                             const smelt_tensor *y, const smelt_tensor *h_out, const smelt_tensor *mean,
                             const smelt_tensor *rstd, smelt_plan **out) {
  const smelt_tensor *t[] = {x, residual, weight, bias, y, h_out, mean, rstd};
  return smelt__family_plan(&smelt__family_norm, ctx, desc, t, out);
}

smelt_status smelt_norm_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *residual,
                            const smelt_tensor *weight, const smelt_tensor *bias, const smelt_tensor *y,
                            const smelt_tensor *h_out, const smelt_tensor *mean, const smelt_tensor *rstd) {
  const smelt_tensor *t[] = {x, residual, weight, bias, y, h_out, mean, rstd};
  return smelt__family_run(&smelt__family_norm, plan, t);
}

smelt_status smelt_norm(smelt_ctx *ctx, const smelt_norm_desc *desc, const smelt_tensor *x,
                        const smelt_tensor *residual, const smelt_tensor *weight, const smelt_tensor *bias,
                        const smelt_tensor *y, const smelt_tensor *h_out, const smelt_tensor *mean,
                        const smelt_tensor *rstd) {
  SMELT__ONE_SHOT(smelt_norm_plan(ctx, desc, x, residual, weight, bias, y, h_out, mean, rstd, &plan),
                  smelt_norm_run(plan, x, residual, weight, bias, y, h_out, mean, rstd));
}

/* ---- backward: dy, x, weight, mean, rstd, dh, dx, dweight, dbias */

static const smelt__role bwd_roles[] = {
    {"dy", 0, float_types, 3, 0},
    {"x", SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"weight", SMELT__ROLE_OPTIONAL, float_types, 3, 0},
    {"mean", SMELT__ROLE_OPTIONAL, f32, 1, 0},
    {"rstd", 0, f32, 1, 0},
    {"dh", SMELT__ROLE_OPTIONAL | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"dx", SMELT__ROLE_OUTPUT | SMELT__ROLE_IN_PLACE | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"dweight", SMELT__ROLE_OUTPUT | SMELT__ROLE_OPTIONAL, float_types, 3, 0},
    {"dbias", SMELT__ROLE_OUTPUT | SMELT__ROLE_OPTIONAL, float_types, 3, 0},
};

static smelt_status check_bwd(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_norm_bwd.op;
  const smelt_norm_desc *d = (const smelt_norm_desc *)params;
  const smelt_tensor *dy = t[0], *w = t[2], *dw = t[7], *db = t[8];
  smelt_status s;
  if ((s = check_desc(op, d, dy)) || (s = check_rows(op, "dy", dy, dy)) || (s = check_rows(op, "x", t[1], dy)) ||
      (s = check_rows(op, "dx", t[6], dy)) || (t[5] && (s = check_rows(op, "dh", t[5], dy))))
    return s;
  if (dw && !w)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: dweight is given without weight", op);
  if ((w && (s = check_vector(op, "weight", w, dy, NULL))) || (dw && (s = check_vector(op, "dweight", dw, dy, w))) ||
      (db && (s = check_vector(op, "dbias", db, dy, w))) || (s = check_mean(op, d->kind, t[3], dy, 1)) ||
      (s = check_stats(op, "rstd", t[4], dy)))
    return s;
  snprintf(plan->describe, sizeof plan->describe, "norm_bwd %s %s C=%lld (cpu reference)",
           smelt_norm_kind_name(d->kind), smelt_dtype_name(dy->dtype), (long long)dy->shape[dy->ndim - 1]);
  return SMELT_OK;
}

const smelt__family smelt__family_norm_bwd = {
    .name = "norm_bwd",
    .op = "smelt_norm_bwd",
    .what = "a norm backward",
    .nroles = 9,
    .roles = bwd_roles,
    .params_size = sizeof(smelt_norm_desc),
    .check = check_bwd,
    .cpu = &smelt__cpu_norm_bwd,
    .cuda = &smelt__cuda_norm_bwd,
    .bound = smelt__bound_norm,
};

smelt_status smelt_norm_bwd_plan(smelt_ctx *ctx, const smelt_norm_desc *desc, const smelt_tensor *dy,
                                 const smelt_tensor *x, const smelt_tensor *weight, const smelt_tensor *mean,
                                 const smelt_tensor *rstd, const smelt_tensor *dh, const smelt_tensor *dx,
                                 const smelt_tensor *dweight, const smelt_tensor *dbias, smelt_plan **out) {
  const smelt_tensor *t[] = {dy, x, weight, mean, rstd, dh, dx, dweight, dbias};
  return smelt__family_plan(&smelt__family_norm_bwd, ctx, desc, t, out);
}

smelt_status smelt_norm_bwd_run(smelt_plan *plan, const smelt_tensor *dy, const smelt_tensor *x,
                                const smelt_tensor *weight, const smelt_tensor *mean, const smelt_tensor *rstd,
                                const smelt_tensor *dh, const smelt_tensor *dx, const smelt_tensor *dweight,
                                const smelt_tensor *dbias) {
  const smelt_tensor *t[] = {dy, x, weight, mean, rstd, dh, dx, dweight, dbias};
  return smelt__family_run(&smelt__family_norm_bwd, plan, t);
}

smelt_status smelt_norm_bwd(smelt_ctx *ctx, const smelt_norm_desc *desc, const smelt_tensor *dy,
                            const smelt_tensor *x, const smelt_tensor *weight, const smelt_tensor *mean,
                            const smelt_tensor *rstd, const smelt_tensor *dh, const smelt_tensor *dx,
                            const smelt_tensor *dweight, const smelt_tensor *dbias) {
  SMELT__ONE_SHOT(smelt_norm_bwd_plan(ctx, desc, dy, x, weight, mean, rstd, dh, dx, dweight, dbias, &plan),
                  smelt_norm_bwd_run(plan, dy, x, weight, mean, rstd, dh, dx, dweight, dbias));
}
