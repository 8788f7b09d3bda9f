/* The shared half of every op family on the interface (src/core/internal.h):
 * the argument checks, the plan's copy of the tensor views, the run's check
 * against them, and the dispatch to the context's backend. A family writes
 * only what is its own: its roles, its parameter and shape checks, its
 * backends. Messages name the op, the tensor, the constraint and the value. */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

smelt_status smelt__check_role(const char *op, const smelt__role *r, const smelt_tensor *t, const smelt_ctx *ctx) {
  smelt_status s;
  if ((s = smelt__check_tensor(op, r->name, t)) || (s = smelt__check_device(op, r->name, t, ctx))) return s;
  return r->dtypes ? smelt__check_dtype(op, r->name, t, r->dtypes, r->ndtypes) : SMELT_OK;
}

smelt_status smelt__check_disjoint(const char *op, const char *on, const smelt_tensor *out, const char *in_name,
                                   const smelt_tensor *in, int in_place) {
  if (!smelt__tensors_overlap(out, in)) return SMELT_OK;
  if (in_place) {
    int same = out->data == in->data && out->dtype == in->dtype && out->ndim == in->ndim;
    for (int d = 0; same && d < out->ndim; d++) same = out->shape[d] == 1 || out->strides[d] == in->strides[d];
    if (same) return SMELT_OK;
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: %s overlaps %s without being %s exactly (same data, dtype and strides: in place)", op,
                        on, in_name, in_name);
  }
  return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                      "%s: %s overlaps %s; outputs must not share memory with an input or each other", op, on,
                      in_name);
}

smelt_status smelt__check_roles_disjoint(const smelt__family *f, const char *op, const smelt_tensor *const *t) {
  for (int a = 0; a < f->nroles; a++) {
    const smelt__role *ra = &f->roles[a];
    if (!t[a] || !(ra->flags & SMELT__ROLE_OUTPUT)) continue;
    for (int b = 0; b < f->nroles; b++) {
      if (b == a || !t[b] || ((f->roles[b].flags & SMELT__ROLE_OUTPUT) && b > a)) continue;
      const int in_place = (ra->flags & SMELT__ROLE_IN_PLACE) && ra->alias == b;
      smelt_status s = smelt__check_disjoint(op, ra->name, t[a], f->roles[b].name, t[b], in_place);
      if (s) return s;
    }
  }
  return SMELT_OK;
}

static smelt_status check_args(const smelt__family *f, const smelt_ctx *ctx, const smelt_tensor *const *t) {
  smelt_status s;
  for (int r = 0; r < f->nroles; r++) {
    if (!t[r] && !(f->roles[r].flags & SMELT__ROLE_OPTIONAL))
      return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL", f->op, f->roles[r].name);
    if (t[r] && (s = smelt__check_tensor(f->op, f->roles[r].name, t[r]))) return s;
  }
  for (int r = 0; r < f->nroles; r++)
    if (t[r] && (s = smelt__check_device(f->op, f->roles[r].name, t[r], ctx))) return s;
  for (int r = 0; r < f->nroles; r++) {
    const smelt__role *ro = &f->roles[r];
    if (!t[r]) continue;
    if (ro->dtypes && (s = smelt__check_dtype(f->op, ro->name, t[r], ro->dtypes, ro->ndtypes))) return s;
    if ((ro->flags & SMELT__ROLE_DTYPE_OF_0) && t[r]->dtype != t[0]->dtype)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%s must equal %s.dtype=%s", f->op, ro->name,
                          smelt_dtype_name(t[r]->dtype), f->roles[0].name, smelt_dtype_name(t[0]->dtype));
  }
  return SMELT_OK;
}

static smelt_status check_outputs(const smelt__family *f, const smelt_tensor *const *t) {
  smelt_status s;
  for (int r = 0; r < f->nroles; r++)
    if (t[r] && (f->roles[r].flags & SMELT__ROLE_OUTPUT) && (s = smelt__check_output(f->op, f->roles[r].name, t[r])))
      return s;
  return smelt__check_roles_disjoint(f, f->op, t);
}

static const smelt__backend *backend_of(const smelt_plan *plan) {
  return plan->ctx->device == SMELT_DEVICE_CUDA ? plan->family->cuda : plan->family->cpu;
}

smelt_status smelt__family_plan_new(const smelt__family *f, smelt_ctx *ctx, smelt_plan **out) {
  smelt_status s = smelt__plan_new(ctx, out);
  if (!s) (*out)->family = f;
  return s;
}

/* The plan's copy of the family's description, in opdata. */
static smelt_status keep_params(const smelt__family *f, smelt_plan *plan, const void *params) {
  if (!f->params_size || !params) return SMELT_OK;
  plan->opdata = malloc(f->params_size);
  if (!plan->opdata) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", f->op);
  memcpy(plan->opdata, params, f->params_size);
  plan->opdata_free = free;
  return SMELT_OK;
}

smelt_status smelt__family_plan(const smelt__family *f, smelt_ctx *ctx, const void *params,
                                const smelt_tensor *const *t, smelt_plan **out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: out is NULL", f->op);
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: ctx is NULL", f->op);
  smelt_plan *plan;
  smelt_status s = check_args(f, ctx, t);
  if (s || (s = smelt__family_plan_new(f, ctx, &plan))) return s;
  for (int r = 0; r < f->nroles; r++)
    if (t[r]) plan->t[r] = *t[r];
  if (!(s = keep_params(f, plan, params)) && !(s = f->check(plan, params, t)) && !(s = check_outputs(f, t)) &&
      backend_of(plan)->plan)
    s = backend_of(plan)->plan(plan, t);
  if (s) {
    smelt_plan_destroy(plan);
    return s;
  }
  *out = plan;
  return SMELT_OK;
}

smelt_status smelt__family_plan_state(const smelt__family *f, smelt_ctx *ctx, void *state, void (*state_free)(void *),
                                      const char *describe, const void *args, smelt_plan **out) {
  smelt_plan *plan;
  smelt_status s = smelt__family_plan_new(f, ctx, &plan);
  if (s) {
    state_free(state);
    return s;
  }
  plan->opdata = state;
  plan->opdata_free = state_free;
  snprintf(plan->describe, sizeof plan->describe, "%s", describe);
  if (backend_of(plan)->plan && (s = backend_of(plan)->plan(plan, args))) {
    smelt_plan_destroy(plan);
    return s;
  }
  *out = plan;
  return SMELT_OK;
}

smelt_status smelt__check_plan(const smelt__family *f, const char *op, const smelt_plan *plan) {
  if (!plan) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: plan is NULL", op);
  if (plan->family != f)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: the plan is not %s plan", op, f->what);
  return SMELT_OK;
}

smelt_status smelt__check_views(const smelt__family *f, const char *op, const smelt_tensor *planned_views,
                                const smelt_tensor *const *t) {
  smelt_status s;
  for (int r = 0; r < f->nroles; r++) {
    const int planned = planned_views[r].ndim >= 0;
    if (t[r] && !planned)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s is given but the plan was made without one", op,
                          f->roles[r].name);
    if (!t[r] && planned)
      return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL but the plan was made with one", op,
                          f->roles[r].name);
  }
  for (int r = 0; r < f->nroles; r++)
    if (t[r] && (s = smelt__check_same_layout(op, f->roles[r].name, &planned_views[r], t[r]))) return s;
  return SMELT_OK;
}

smelt_status smelt__family_run(const smelt__family *f, smelt_plan *plan, const smelt_tensor *const *t) {
  char run_op[64];
  snprintf(run_op, sizeof run_op, "%s_run", f->op);
  smelt_status s;
  if ((s = smelt__check_plan(f, run_op, plan)) || (s = smelt__check_views(f, f->op, plan->t, t)) ||
      (s = smelt__check_roles_disjoint(f, f->op, t)))
    return s;
  return smelt__plan_dispatch(plan, t);
}

smelt_status smelt__plan_dispatch(smelt_plan *plan, const void *args) { return backend_of(plan)->run(plan, args); }
