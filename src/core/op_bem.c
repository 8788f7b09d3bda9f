/* smelt_bem_*: BEM's half of the op-family interface (its tensor roles,
 * its bound) and plan/run/one-shot for the forward and the backward.
 *
 * The forward and the backward take different tensors (up to 11 roles, more
 * than a plan's generic copy holds), so BEM has entry points of its own
 * around the shared pieces (src/core/family.c), as PEER does: the plan
 * keeps the views in its state, a run checks its tensors against them, and
 * everything is checked before a backend sees anything, so a failed call
 * writes nothing. */
#include "bem_internal.h"
#include "error_bound.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_bem"

smelt_bem_desc smelt_bem_desc_default(void) {
  smelt_bem_desc d;
  memset(&d, 0, sizeof d);
  d.scale = 1.0;
  return d;
}

/* ---------------------------------------------------------------- roles and bound */

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype offset_types[] = {SMELT_DTYPE_I32, SMELT_DTYPE_I64}, f32_type[] = {SMELT_DTYPE_F32};

#define FLOAT(n, f) {.name = n, .flags = (f) | SMELT__ROLE_DTYPE_OF_0, .dtypes = float_types, .ndtypes = 3}
#define OUT SMELT__ROLE_OUTPUT
#define OPT SMELT__ROLE_OPTIONAL
static const smelt__role roles[SMELT__BT_ROLES] = {
    [SMELT__BT_X] = FLOAT("x", 0),
    [SMELT__BT_V] = FLOAT("v", 0),
    [SMELT__BT_CODES] = FLOAT("codes", 0),
    [SMELT__BT_U] = FLOAT("u", 0),
    [SMELT__BT_OFFSETS] = {.name = "offsets", .flags = OPT, .dtypes = offset_types, .ndtypes = 2},
    [SMELT__BT_SCALES] = {.name = "scales", .flags = OPT, .dtypes = f32_type, .ndtypes = 1},
    [SMELT__BT_Y] = FLOAT("y", OUT | OPT),
    [SMELT__BT_DY] = FLOAT("dy", OPT),
    [SMELT__BT_DX] = FLOAT("grads.dx", OUT | OPT),
    [SMELT__BT_DV] = FLOAT("grads.dv", OUT | OPT),
    [SMELT__BT_DU] = FLOAT("grads.du", OUT | OPT),
    [SMELT__BT_DCODES] = FLOAT("grads.dcodes", OUT | OPT),
};
#undef FLOAT
#undef OUT
#undef OPT

/* The CPU computes in double and rounds once. The GPU accumulates x·V in
 * f32 and rounds H to the input type before the second product (as an
 * unfused run stores it), so a 16-bit result carries H's rounding besides
 * its own. One element's worst error allows four elementwise units. */
static double bound_bem(const smelt__bound_query *q) {
  const double unit = q->dtype == SMELT_DTYPE_F16 ? 0x1.0p-9 : q->dtype == SMELT_DTYPE_BF16 ? 0x1.0p-6 : 1e-5;
  if (q->metric == SMELT__METRIC_MAX_REL) return 4 * unit;
  const int cuda = q->device == SMELT_DEVICE_CUDA;
  /* The composed backward (output 1 on CUDA) keeps four [M, r]
   * intermediates in the input type: up to three roundings on a path. */
  if (cuda && q->output) return q->dtype == SMELT_DTYPE_F32 ? 2e-5 : q->dtype == SMELT_DTYPE_F16 ? 5e-3 : 3e-2;
  switch (q->dtype) {
    case SMELT_DTYPE_F32: return cuda ? 2e-5 : 1e-6;
    case SMELT_DTYPE_F16: return cuda ? 2e-3 : 1e-3;
    default: return cuda ? 1.5e-2 : 8e-3;
  }
}

const smelt__family smelt__family_bem = {
    .name = "bem",
    .op = OP,
    .what = "a BEM",
    .nroles = SMELT__BT_ROLES,
    .roles = roles,
    .cpu = &smelt__cpu_bem,
    .cuda = &smelt__cuda_bem,
    .bound = bound_bem,
};

/* ---------------------------------------------------------------- shapes */

static smelt_status check_shape(const smelt_tensor *const *t, int r, int n, const int64_t *dims, const char *what) {
  return smelt__check_dims(OP, roles[r].name, t[r], n, dims, what);
}

/* M, d_in, r and A from x, codes and v (with offsets: v's first dim). */
static smelt_status resolve_dims(const smelt_tensor *const *t, smelt__bem_state *st) {
  char a[160];
  const smelt_tensor *x = t[SMELT__BT_X], *codes = t[SMELT__BT_CODES], *v = t[SMELT__BT_V];
  if (x->ndim != 2)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": x.shape=%s must be [M, d_in] (2 dims)",
                        smelt__shape_str(x, a, sizeof a));
  if (codes->ndim != 2)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": codes.shape=%s must be [M, r] (2 dims)",
                        smelt__shape_str(codes, a, sizeof a));
  st->M = x->shape[0];
  st->din = x->shape[1];
  st->r = codes->shape[1];
  if (st->r < 1 || st->r > SMELT_BEM_MAX_RANK)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": the rank codes.shape[1]=%lld must be in [1, %d]",
                        (long long)st->r, SMELT_BEM_MAX_RANK);
  const smelt_tensor *offs = t[SMELT__BT_OFFSETS];
  st->A = 1;
  if (offs) {
    if (v->ndim != 3)
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                          OP ": v.shape=%s must be [A, d_in, r] (3 dims) when offsets are given",
                          smelt__shape_str(v, a, sizeof a));
    st->A = v->shape[0];
    if (st->A < 1)
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": v.shape[0]=%lld (the adapters) must be >= 1",
                          (long long)st->A);
  }
  if (st->A >= ((int64_t)1 << 31))
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": %lld adapters; at most 2^31 - 1", (long long)st->A);
  return SMELT_OK;
}

/* Every role's shape from the resolved dims (d_out from u). */
static smelt_status check_shapes(const smelt_tensor *const *t, smelt__bem_state *st) {
  smelt_status s = resolve_dims(t, st);
  if (s) return s;
  const int segs = t[SMELT__BT_OFFSETS] != NULL, wd = segs ? 3 : 2;
  const smelt_tensor *u = t[SMELT__BT_U];
  if (u->ndim != wd) {
    char a[160];
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": u.shape=%s must be %s (%d dims)",
                        smelt__shape_str(u, a, sizeof a), segs ? "[A, d_out, r]" : "[d_out, r]", wd);
  }
  st->dout = u->shape[wd - 2];
  const int64_t x_dims[2] = {st->M, st->din}, codes_dims[2] = {st->M, st->r}, y_dims[2] = {st->M, st->dout};
  const int64_t v_dims[3] = {st->A, st->din, st->r}, u_dims[3] = {st->A, st->dout, st->r};
  const int64_t offs_dims[1] = {st->A + 1}, scales_dims[1] = {st->A};
  const char *v_what = segs ? "[A, d_in, r]" : "[d_in, r]", *u_what = segs ? "[A, d_out, r]" : "[d_out, r]";
  if ((s = check_shape(t, SMELT__BT_CODES, 2, codes_dims, "[M, r]")) ||
      (s = check_shape(t, SMELT__BT_V, wd, v_dims + 3 - wd, v_what)) ||
      (s = check_shape(t, SMELT__BT_U, wd, u_dims + 3 - wd, u_what)) ||
      (segs && (s = check_shape(t, SMELT__BT_OFFSETS, 1, offs_dims, "[A + 1]"))) ||
      (t[SMELT__BT_SCALES] && (s = check_shape(t, SMELT__BT_SCALES, 1, scales_dims, "[A]"))))
    return s;
  const struct {
    int role;
    const int64_t *dims;
    int n;
    const char *what;
  } like[] = {
      {SMELT__BT_Y, y_dims, 2, "[M, d_out]"},           {SMELT__BT_DY, y_dims, 2, "[M, d_out]"},
      {SMELT__BT_DX, x_dims, 2, "x's shape [M, d_in]"}, {SMELT__BT_DCODES, codes_dims, 2, "codes' shape [M, r]"},
      {SMELT__BT_DV, v_dims + 3 - wd, wd, "v's shape"}, {SMELT__BT_DU, u_dims + 3 - wd, wd, "u's shape"},
  };
  for (size_t i = 0; i < sizeof like / sizeof *like; i++)
    if (t[like[i].role] && (s = check_shape(t, like[i].role, like[i].n, like[i].dims, like[i].what))) return s;
  return SMELT_OK;
}

/* ---------------------------------------------------------------- plans */

/* The role array of a call: the inputs, then y (forward) or dy and the
 * gradients (backward). */
static void role_list(const smelt_bem_inputs *in, const smelt_tensor *y, const smelt_tensor *dy,
                      const smelt_bem_grads *g, const smelt_tensor **t) {
  memset(t, 0, SMELT__BT_ROLES * sizeof *t);
  t[SMELT__BT_X] = in->x;
  t[SMELT__BT_V] = in->v;
  t[SMELT__BT_CODES] = in->codes;
  t[SMELT__BT_U] = in->u;
  t[SMELT__BT_OFFSETS] = in->offsets;
  t[SMELT__BT_SCALES] = in->scales;
  t[SMELT__BT_Y] = y;
  t[SMELT__BT_DY] = dy;
  if (g) {
    t[SMELT__BT_DX] = g->dx;
    t[SMELT__BT_DV] = g->dv;
    t[SMELT__BT_DU] = g->du;
    t[SMELT__BT_DCODES] = g->dcodes;
  }
}

/* Presence (x, v, codes, u and the direction's own: y, or dy and grads),
 * each tensor, device, dtype, shape, then the outputs. */
static smelt_status check_call(const smelt_ctx *ctx, int backward, const smelt_bem_inputs *in,
                               const smelt_bem_grads *g, const smelt_tensor *const *t, smelt__bem_state *st) {
  if (!in) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": in is NULL");
  if (backward && !g) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": grads is NULL");
  const int required[] = {SMELT__BT_X, SMELT__BT_V, SMELT__BT_CODES, SMELT__BT_U,
                          backward ? SMELT__BT_DY : SMELT__BT_Y};
  for (size_t i = 0; i < sizeof required / sizeof *required; i++)
    if (!t[required[i]]) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": %s is NULL", roles[required[i]].name);
  smelt_status s;
  for (int r = 0; r < SMELT__BT_ROLES; r++) {
    if (!t[r]) continue;
    if ((s = smelt__check_role(OP, &roles[r], t[r], ctx))) return s;
    if ((roles[r].flags & SMELT__ROLE_DTYPE_OF_0) && t[r]->dtype != t[0]->dtype)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": %s.dtype=%s must equal x.dtype=%s", roles[r].name,
                          smelt_dtype_name(t[r]->dtype), smelt_dtype_name(t[0]->dtype));
  }
  if ((s = check_shapes(t, st))) return s;
  for (int r = 0; r < SMELT__BT_ROLES; r++)
    if (t[r] && (roles[r].flags & SMELT__ROLE_OUTPUT) && (s = smelt__check_output(OP, roles[r].name, t[r])))
      return s;
  return smelt__check_roles_disjoint(&smelt__family_bem, OP, t);
}

static smelt_status check_desc(const smelt_bem_desc *desc) {
  if (!desc) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": desc is NULL");
  if (!isfinite(desc->scale))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.scale=%g must be finite", desc->scale);
  if (desc->accumulate != 0 && desc->accumulate != 1)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.accumulate=%d must be 0 or 1", desc->accumulate);
  return SMELT_OK;
}

static smelt_status plan_call(smelt_ctx *ctx, const smelt_bem_desc *desc, int backward, const smelt_bem_inputs *in,
                              const smelt_tensor *y, const smelt_tensor *dy, const smelt_bem_grads *g,
                              smelt_plan **out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": out is NULL");
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": ctx is NULL");
  smelt_status s = check_desc(desc);
  if (s) return s;
  const smelt_tensor *t[SMELT__BT_ROLES];
  if (in) role_list(in, y, dy, g, t);
  smelt__bem_state *st = (smelt__bem_state *)calloc(1, sizeof *st);
  if (!st) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  if ((s = check_call(ctx, backward, in, g, t, st))) {
    free(st);
    return s;
  }
  st->desc = *desc;
  st->backward = backward;
  for (int r = 0; r < SMELT__BT_ROLES; r++) {
    if (t[r]) st->planned[r] = *t[r];
    else st->planned[r].ndim = -1;
  }
  char describe[160];
  snprintf(describe, sizeof describe, "bem %s %s M=%lld d_in=%lld d_out=%lld r=%lld A=%lld (cpu reference)",
           backward ? "backward" : "forward", smelt_dtype_name(in->x->dtype), (long long)st->M, (long long)st->din,
           (long long)st->dout, (long long)st->r, (long long)st->A);
  return smelt__family_plan_state(&smelt__family_bem, ctx, st, free, describe, t, out);
}

/* A run of plan (`op` names the entry point): the direction as planned,
 * every role as planned, outputs disjoint, then the backend. */
static smelt_status run_call(smelt_plan *plan, const char *op, int backward, const smelt_bem_inputs *in,
                             const smelt_tensor *y, const smelt_tensor *dy, const smelt_bem_grads *g) {
  smelt_status s = smelt__check_plan(&smelt__family_bem, op, plan);
  if (s) return s;
  const smelt__bem_state *st = (const smelt__bem_state *)plan->opdata;
  if (st->backward != backward)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: the plan is a %s plan", op,
                        st->backward ? "backward" : "forward");
  if (!in) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: in is NULL", op);
  if (backward && !g) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: grads is NULL", op);
  const smelt_tensor *t[SMELT__BT_ROLES];
  role_list(in, y, dy, g, t);
  if ((s = smelt__check_views(&smelt__family_bem, OP, st->planned, t)) ||
      (s = smelt__check_roles_disjoint(&smelt__family_bem, OP, t)))
    return s;
  return smelt__plan_dispatch(plan, t);
}

smelt_status smelt_bem_plan(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                            const smelt_tensor *y, smelt_plan **out) {
  return plan_call(ctx, desc, 0, in, y, NULL, NULL, out);
}

smelt_status smelt_bem_run(smelt_plan *plan, const smelt_bem_inputs *in, const smelt_tensor *y) {
  return run_call(plan, OP "_run", 0, in, y, NULL, NULL);
}

smelt_status smelt_bem(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                       const smelt_tensor *y) {
  SMELT__ONE_SHOT(smelt_bem_plan(ctx, desc, in, y, &plan), smelt_bem_run(plan, in, y));
}

smelt_status smelt_bem_backward_plan(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                     const smelt_tensor *dy, const smelt_bem_grads *grads, smelt_plan **out) {
  return plan_call(ctx, desc, 1, in, NULL, dy, grads, out);
}

smelt_status smelt_bem_backward_run(smelt_plan *plan, const smelt_bem_inputs *in, const smelt_tensor *dy,
                                    const smelt_bem_grads *grads) {
  return run_call(plan, OP "_backward_run", 1, in, NULL, dy, grads);
}

smelt_status smelt_bem_backward(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                const smelt_tensor *dy, const smelt_bem_grads *grads) {
  SMELT__ONE_SHOT(smelt_bem_backward_plan(ctx, desc, in, dy, grads, &plan),
                  smelt_bem_backward_run(plan, in, dy, grads));
}

/* ---------------------------------------------------------------- segments */

void smelt__bem_bounds(const smelt_tensor *offsets, int64_t A, int64_t M, int64_t *o) {
  int64_t run = 0;
  for (int64_t a = 0; a <= A; a++) {
    const int64_t at = offsets ? a * offsets->strides[0] : 0;
    const int64_t v = !offsets                             ? (a ? M : 0)
                      : offsets->dtype == SMELT_DTYPE_I32 ? ((const int32_t *)offsets->data)[at]
                                                          : ((const int64_t *)offsets->data)[at];
    if (v > run) run = v;
    o[a] = run < M ? run : M;
  }
}
