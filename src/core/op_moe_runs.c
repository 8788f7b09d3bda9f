/* smelt_moe_*_run: the layer's and the parts' runs on a MoE plan, and the
 * one-shot calls. Each run checks, before a backend sees anything, that x
 * and the weights it binds are as planned, that its required tensors are
 * there, that each of its own has its role's dtype, shape and layout, and
 * that its outputs share no memory with anything else; so a failed call
 * writes nothing. */
#include "moe_internal.h"

#include <stdio.h>

/* What a run binds besides its own tensors. */
enum { BIND_W = 1, BIND_X = 2, NEEDS_FFN = 4 };

static smelt_status check_planned(const smelt__moe_state *ms, const char *op, const smelt_tensor *const *t, int r) {
  const int planned = ms->t[r].ndim >= 0;
  const char *name = smelt__moe_roles[r].name;
  if (t[r] && !planned)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: weights.%s is given but the plan was made without one",
                        op, name);
  if (!t[r] && planned)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL but the plan was made with one", op, name);
  return t[r] ? smelt__check_same_layout(op, name, &ms->t[r], t[r]) : SMELT_OK;
}

/* The bound x and weights as planned. */
static smelt_status check_bound(const smelt__moe_state *ms, const char *op, const smelt_moe_weights *w,
                                const smelt_tensor *x, unsigned binds, smelt__moe_args *a) {
  smelt_status s;
  if (binds & BIND_W) {
    if (!w) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: weights is NULL", op);
    const smelt_tensor *l[SMELT__MT_ROLES] = {NULL};
    smelt__moe_weight_list(w, NULL, l);
    for (int r = SMELT__MT_WR; r < SMELT__MT_COUNT; r++) {
      a->t[r] = l[r];
      if ((s = check_planned(ms, op, a->t, r))) return s;
    }
  }
  if (binds & BIND_X) {
    if (!x) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: x is NULL", op);
    a->t[SMELT__MT_X] = x;
    if ((s = smelt__check_same_layout(op, "x", &ms->t[SMELT__MT_X], x))) return s;
  }
  if ((binds & NEEDS_FFN) && ms->t[SMELT__MT_W1].ndim < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: the plan was made without the expert weights (w1, w2%s), which this run needs", op,
                        ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU ? ", w3" : "");
  return SMELT_OK;
}

/* Checks and dispatches run a->mode (a->t holds the run's own tensors). */
static smelt_status run(smelt_plan *plan, const char *op, const smelt_moe_weights *w, const smelt_tensor *x,
                        unsigned binds, const int *required, int nrequired, smelt__moe_args *a) {
  smelt_status s = smelt__check_plan(&smelt__family_moe, op, plan);
  if (s) return s;
  const smelt__moe_state *ms = (const smelt__moe_state *)plan->opdata;
  if ((s = check_bound(ms, op, w, x, binds, a))) return s;
  for (int i = 0; i < nrequired; i++)
    if (!a->t[required[i]])
      return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL", op, smelt__moe_roles[required[i]].name);
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  for (int r = SMELT__MT_COUNT; r < SMELT__MT_ROLES; r++) {
    const smelt__role *ro = &smelt__moe_roles[r];
    if (a->t[r] && ((s = smelt__check_role(op, ro, a->t[r], plan->ctx)) ||
                    (s = smelt__moe_check_shape(ms, r, a->t[r], xdt)) ||
                    ((ro->flags & SMELT__ROLE_OUTPUT) && (s = smelt__check_output(op, ro->name, a->t[r])))))
      return s;
  }
  if ((s = smelt__check_roles_disjoint(&smelt__family_moe, op, a->t))) return s;
  return smelt__plan_dispatch(plan, a);
}

/* A run of `mode` with its own tensors own[i] in roles[i], the first
 * `nrequired` of them required. */
static smelt_status part(smelt_plan *plan, const char *op, smelt__moe_mode mode, const smelt_moe_weights *w,
                         const smelt_tensor *x, unsigned binds, const int *roles, const smelt_tensor *const *own,
                         int n, int nrequired) {
  smelt__moe_args a = {.mode = mode};
  for (int i = 0; i < n; i++) a.t[roles[i]] = own[i];
  return run(plan, op, w, x, binds, roles, nrequired, &a);
}

static void routing_roles(const smelt_moe_routing *r, smelt__moe_args *a) {
  if (!r) return;
  a->t[SMELT__MT_LOGITS] = r->logits;
  a->t[SMELT__MT_IDS] = r->ids;
  a->t[SMELT__MT_WEIGHTS] = r->weights;
  a->t[SMELT__MT_COUNTS] = r->counts;
  a->t[SMELT__MT_OFFSETS] = r->offsets;
  a->t[SMELT__MT_DROPPED] = r->dropped;
  a->t[SMELT__MT_AUX] = r->aux;
}

/* ---------------------------------------------------------------- the layer */

smelt_status smelt_moe_forward_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *x,
                                   const smelt_tensor *y, const smelt_moe_routing *routing, smelt_moe_stats *stats) {
  static const int required[] = {SMELT__MT_Y};
  smelt__moe_args a = {.mode = SMELT__MOE_FORWARD, .stats = stats};
  a.t[SMELT__MT_Y] = y;
  routing_roles(routing, &a);
  return run(plan, MOE_OP "_forward_run", w, x, BIND_W | BIND_X | NEEDS_FFN, required, 1, &a);
}

static smelt_status grads_roles(const char *op, const smelt_moe_grads *g, int dx_role, smelt__moe_args *a) {
  if (!g) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: grads is NULL", op);
  a->t[dx_role] = g->dx;
  a->t[SMELT__MT_DWR] = g->dwr;
  a->t[SMELT__MT_DWNOISE] = g->dwnoise;
  a->t[SMELT__MT_DW1] = g->dw1;
  a->t[SMELT__MT_DW3] = g->dw3;
  a->t[SMELT__MT_DW2] = g->dw2;
  a->t[SMELT__MT_DB1] = g->db1;
  return SMELT_OK;
}

/* The layer's backward, recomputing the forward (saved NULL) or from a
 * saved forward's state. */
static smelt_status layer_backward(smelt_plan *plan, const char *op, const smelt_moe_weights *w,
                                   const smelt_tensor *x, const smelt_tensor *dy, const smelt_tensor *saved,
                                   int with_saved, const smelt_moe_grads *grads) {
  smelt__moe_args a = {.mode = with_saved ? SMELT__MOE_BACKWARD_SAVED : SMELT__MOE_BACKWARD};
  smelt_status s = grads_roles(op, grads, SMELT__MT_DX, &a);
  if (s) return s;
  static const int required[] = {SMELT__MT_DY_IN, SMELT__MT_SAVED_IN};
  a.t[SMELT__MT_DY_IN] = dy;
  a.t[SMELT__MT_SAVED_IN] = saved;
  return run(plan, op, w, x, BIND_W | BIND_X | NEEDS_FFN, required, with_saved ? 2 : 1, &a);
}

smelt_status smelt_moe_backward_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *x,
                                    const smelt_tensor *dy, const smelt_moe_grads *grads) {
  return layer_backward(plan, MOE_OP "_backward_run", w, x, dy, NULL, 0, grads);
}

/* ---------------------------------------------------------------- the layer, saved */

smelt_status smelt_moe_saved_bytes(smelt_plan *plan, int64_t *bytes) {
  if (!bytes) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP "_saved_bytes: bytes is NULL");
  *bytes = 0;
  smelt_status s = smelt__check_plan(&smelt__family_moe, MOE_OP "_saved_bytes", plan);
  if (s) return s;
  *bytes = ((const smelt__moe_state *)plan->opdata)->saved_bytes;
  return SMELT_OK;
}

smelt_status smelt_moe_saved_bytes_for(const smelt_moe_config *cfg, int64_t tokens, smelt_dtype x_dtype,
                                       smelt_device_kind device, int64_t *bytes) {
  if (!bytes) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP "_saved_bytes_for: bytes is NULL");
  *bytes = 0;
  return smelt__moe_saved_bytes_for(cfg, tokens, x_dtype, device, bytes);
}

smelt_status smelt_moe_forward_save_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *x,
                                        const smelt_tensor *y, const smelt_tensor *saved,
                                        const smelt_moe_routing *routing) {
  const char *op = MOE_OP "_forward_save_run";
  if (routing && (routing->logits || routing->ids || routing->weights || routing->offsets))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: routing.logits, ids, weights and offsets must be NULL (saved keeps them); only aux, "
                        "counts and dropped can be asked for",
                        op);
  static const int roles[] = {SMELT__MT_Y, SMELT__MT_SAVED, SMELT__MT_COUNTS, SMELT__MT_DROPPED, SMELT__MT_AUX};
  const smelt_tensor *own[] = {y, saved, routing ? routing->counts : NULL, routing ? routing->dropped : NULL,
                               routing ? routing->aux : NULL};
  return part(plan, op, SMELT__MOE_FORWARD_SAVE, w, x, BIND_W | BIND_X | NEEDS_FFN, roles, own, 5, 2);
}

smelt_status smelt_moe_backward_saved_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *x,
                                          const smelt_tensor *dy, const smelt_tensor *saved,
                                          const smelt_moe_grads *grads) {
  return layer_backward(plan, MOE_OP "_backward_saved_run", w, x, dy, saved, 1, grads);
}

smelt_status smelt_moe_forward(smelt_ctx *ctx, const smelt_moe_config *cfg, const smelt_moe_weights *w,
                               const smelt_tensor *x, const smelt_tensor *y, const smelt_moe_routing *routing,
                               smelt_moe_stats *stats) {
  SMELT__ONE_SHOT(smelt_moe_plan(ctx, cfg, w, x, &plan), smelt_moe_forward_run(plan, w, x, y, routing, stats));
}

smelt_status smelt_moe_backward(smelt_ctx *ctx, const smelt_moe_config *cfg, const smelt_moe_weights *w,
                                const smelt_tensor *x, const smelt_tensor *dy, const smelt_moe_grads *grads) {
  SMELT__ONE_SHOT(smelt_moe_plan(ctx, cfg, w, x, &plan), smelt_moe_backward_run(plan, w, x, dy, grads));
}

/* ---------------------------------------------------------------- the router */

smelt_status smelt_moe_route_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *x,
                                 const smelt_moe_routing *routing) {
  if (!routing) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP "_route_run: routing is NULL");
  static const int required[] = {SMELT__MT_LOGITS, SMELT__MT_IDS, SMELT__MT_WEIGHTS, SMELT__MT_COUNTS,
                                 SMELT__MT_OFFSETS};
  smelt__moe_args a = {.mode = SMELT__MOE_ROUTE};
  routing_roles(routing, &a);
  return run(plan, MOE_OP "_route_run", w, x, BIND_W | BIND_X, required, 5, &a);
}

smelt_status smelt_moe_aux_losses_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *logits,
                                      const smelt_tensor *aux, const smelt_tensor *dlogits) {
  static const int roles[] = {SMELT__MT_LOGITS_IN, SMELT__MT_AUX, SMELT__MT_DLOGITS};
  const smelt_tensor *own[] = {logits, aux, dlogits};
  return part(plan, MOE_OP "_aux_losses_run", SMELT__MOE_AUX, w, NULL, BIND_W, roles, own, 3, 2);
}

smelt_status smelt_moe_route_backward_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *logits,
                                          const smelt_tensor *dweights, const smelt_tensor *dlogits) {
  static const int roles[] = {SMELT__MT_LOGITS_IN, SMELT__MT_DWEIGHTS_IN, SMELT__MT_DLOGITS};
  const smelt_tensor *own[] = {logits, dweights, dlogits};
  return part(plan, MOE_OP "_route_backward_run", SMELT__MOE_ROUTE_BWD, w, NULL, BIND_W, roles, own, 3, 3);
}

smelt_status smelt_moe_stats_get(smelt_plan *plan, const smelt_tensor *counts, const smelt_tensor *dropped,
                                 smelt_moe_stats *out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, MOE_OP "_stats_get: out is NULL");
  static const int required[] = {SMELT__MT_COUNTS_IN};
  smelt__moe_args a = {.mode = SMELT__MOE_STATS, .stats = out};
  a.t[SMELT__MT_COUNTS_IN] = counts;
  a.t[SMELT__MT_DROPPED_IN] = dropped;
  return run(plan, MOE_OP "_stats_get", NULL, NULL, 0, required, 1, &a);
}

/* ---------------------------------------------------------------- dispatch and combine */

smelt_status smelt_moe_permute_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *ids,
                                   const smelt_tensor *offsets, const smelt_tensor *xp, const smelt_tensor *row_map) {
  static const int roles[] = {SMELT__MT_IDS_IN, SMELT__MT_OFFSETS_IN, SMELT__MT_XP, SMELT__MT_ROW_MAP};
  const smelt_tensor *own[] = {ids, offsets, xp, row_map};
  return part(plan, MOE_OP "_permute_run", SMELT__MOE_PERMUTE, NULL, x, BIND_X, roles, own, 4, 4);
}

smelt_status smelt_moe_permute_backward_run(smelt_plan *plan, const smelt_tensor *dxp, const smelt_tensor *row_map,
                                            const smelt_tensor *dx) {
  static const int roles[] = {SMELT__MT_DXP_IN, SMELT__MT_ROW_MAP_IN, SMELT__MT_DX};
  const smelt_tensor *own[] = {dxp, row_map, dx};
  return part(plan, MOE_OP "_permute_backward_run", SMELT__MOE_PERMUTE_BWD, NULL, NULL, 0, roles, own, 3, 3);
}

smelt_status smelt_moe_unpermute_run(smelt_plan *plan, const smelt_tensor *yp, const smelt_tensor *row_map,
                                     const smelt_tensor *weights, const smelt_tensor *y) {
  static const int roles[] = {SMELT__MT_YP_IN, SMELT__MT_ROW_MAP_IN, SMELT__MT_WEIGHTS_IN, SMELT__MT_Y};
  const smelt_tensor *own[] = {yp, row_map, weights, y};
  return part(plan, MOE_OP "_unpermute_run", SMELT__MOE_UNPERMUTE, NULL, NULL, 0, roles, own, 4, 4);
}

smelt_status smelt_moe_unpermute_backward_run(smelt_plan *plan, const smelt_tensor *dy, const smelt_tensor *yp,
                                              const smelt_tensor *row_map, const smelt_tensor *weights,
                                              const smelt_tensor *dyp, const smelt_tensor *dweights) {
  static const int roles[] = {SMELT__MT_DY_IN,   SMELT__MT_YP_IN, SMELT__MT_ROW_MAP_IN, SMELT__MT_WEIGHTS_IN,
                              SMELT__MT_DYP, SMELT__MT_DWEIGHTS};
  const smelt_tensor *own[] = {dy, yp, row_map, weights, dyp, dweights};
  return part(plan, MOE_OP "_unpermute_backward_run", SMELT__MOE_UNPERMUTE_BWD, NULL, NULL, 0, roles, own, 6, 5);
}

/* ---------------------------------------------------------------- the expert FFN */

smelt_status smelt_moe_ffn_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *xp,
                               const smelt_tensor *offsets, const smelt_tensor *yp) {
  static const int roles[] = {SMELT__MT_XP_IN, SMELT__MT_OFFSETS_IN, SMELT__MT_YP};
  const smelt_tensor *own[] = {xp, offsets, yp};
  return part(plan, MOE_OP "_ffn_run", SMELT__MOE_FFN, w, NULL, BIND_W | NEEDS_FFN, roles, own, 3, 3);
}

smelt_status smelt_moe_ffn_backward_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *xp,
                                        const smelt_tensor *offsets, const smelt_tensor *dyp,
                                        const smelt_moe_grads *grads) {
  const char *op = MOE_OP "_ffn_backward_run";
  smelt__moe_args a = {.mode = SMELT__MOE_FFN_BWD};
  smelt_status s = grads_roles(op, grads, SMELT__MT_DXP, &a);
  if (s) return s;
  if (grads->dwr || grads->dwnoise)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: grads.%s is given but the FFN does not use it", op,
                        grads->dwr ? "dwr" : "dwnoise");
  static const int required[] = {SMELT__MT_XP_IN, SMELT__MT_OFFSETS_IN, SMELT__MT_DYP_IN};
  a.t[SMELT__MT_XP_IN] = xp;
  a.t[SMELT__MT_OFFSETS_IN] = offsets;
  a.t[SMELT__MT_DYP_IN] = dyp;
  return run(plan, op, w, NULL, BIND_W | NEEDS_FFN, required, 3, &a);
}
