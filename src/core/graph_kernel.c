/* Each kernel of a graph's plan through its public op: the role views
 * (a graph tensor's view, with the run's data or the workspace's), the
 * plan call and the run call. No kernel of its own: whatever smelt_gemm,
 * smelt_norm and the others choose on this context is what runs. */
#include "graph_internal.h"

enum { R_A, R_B, R_C, R_D, R_BIAS, R_SLOT0 };

smelt_tensor smelt__graph_role_view(const smelt_graph *g, const smelt__graph_group *gr, int r,
                                    const smelt_tensor *const *bind) {
  smelt_tensor v = gr->view[r];
  const int t = gr->id[r];
  if (t >= 0) v.data = bind && g->tensors[t].kind != SMELT__GT_INTER ? bind[t]->data : g->tensors[t].view.data;
  return v;
}

/* The kernel's tensors: views[r] for present roles, p[r] NULL for absent ones. */
static void views_of(const smelt_graph *g, const smelt__graph_group *gr, const smelt_tensor *const *bind,
                     smelt_tensor *views, const smelt_tensor **p) {
  for (int r = 0; r < gr->nroles; r++) {
    if (gr->id[r] == SMELT__GR_ABSENT) {
      p[r] = NULL;
      continue;
    }
    views[r] = smelt__graph_role_view(g, gr, r, bind);
    p[r] = &views[r];
  }
}

static smelt_epi_tensors epi_of(const smelt_tensor *const *p) {
  smelt_epi_tensors e = {0, {NULL}};
  for (int s = 0; s < SMELT_EPI_MAX_TENSORS; s++)
    if (p[R_SLOT0 + s]) {
      e.t[s] = p[R_SLOT0 + s];
      e.count = s + 1;
    }
  return e;
}

smelt_status smelt__graph_group_plan(smelt_graph *g, smelt__graph_group *gr) {
  smelt_tensor v[SMELT__GRAPH_MAX_ROLES];
  const smelt_tensor *p[SMELT__GRAPH_MAX_ROLES];
  views_of(g, gr, NULL, v, p);
  const smelt__graph_op *last = &g->ops[gr->ops[gr->nops - 1]];
  smelt_ctx *ctx = g->ctx;
  smelt_plan **out = &gr->plan;
  switch (gr->kind) {
    case SMELT__GK_GEMM: return smelt_gemm_plan(ctx, &gr->gemm, p[R_A], p[R_B], p[R_C], p[R_D], p[R_BIAS], out);
    case SMELT__GK_GEMM_EPI: {
      const smelt_epi_tensors e = epi_of(p);
      return smelt_gemm_epi_plan(ctx, &gr->gemm, p[R_A], p[R_B], p[R_C], p[R_D], p[R_BIAS], NULL, &e, out);
    }
    case SMELT__GK_ACT: {
      const smelt_activation_desc d = {last->p.act.act, last->p.act.slope};
      return smelt_activation_plan(ctx, &d, p[0], p[1], out);
    }
    case SMELT__GK_RESIDUAL: return smelt_residual_add_plan(ctx, p[0], p[1], p[2], out);
    case SMELT__GK_NORM:
      return smelt_norm_plan(ctx, &last->p.norm, p[0], p[1], p[2], p[3], p[4], p[5], NULL, NULL, out);
    case SMELT__GK_ROTARY: return smelt_rotary_plan(ctx, &last->p.rotary, p[0], p[1], p[2], p[3], p[4], out);
    case SMELT__GK_ATTENTION: return smelt_attention_fwd_plan(ctx, &last->p.attention, p[0], p[1], p[2], p[3], NULL, out);
    default: return smelt_softmax_plan(ctx, p[0], p[1], NULL, out);
  }
}

smelt_status smelt__graph_group_run(const smelt_graph *g, smelt__graph_group *gr, const smelt_tensor *const *bind) {
  smelt_tensor v[SMELT__GRAPH_MAX_ROLES];
  const smelt_tensor *p[SMELT__GRAPH_MAX_ROLES];
  views_of(g, gr, bind, v, p);
  smelt_plan *plan = gr->plan;
  switch (gr->kind) {
    case SMELT__GK_GEMM: return smelt_gemm_run(plan, p[R_A], p[R_B], p[R_C], p[R_D], p[R_BIAS]);
    case SMELT__GK_GEMM_EPI: {
      const smelt_epi_tensors e = epi_of(p);
      return smelt_gemm_epi_run(plan, p[R_A], p[R_B], p[R_C], p[R_D], p[R_BIAS], NULL, &e);
    }
    case SMELT__GK_ACT: return smelt_activation_run(plan, p[0], p[1]);
    case SMELT__GK_RESIDUAL: return smelt_residual_add_run(plan, p[0], p[1], p[2]);
    case SMELT__GK_NORM: return smelt_norm_run(plan, p[0], p[1], p[2], p[3], p[4], p[5], NULL, NULL);
    case SMELT__GK_ROTARY: return smelt_rotary_run(plan, p[0], p[1], p[2], p[3], p[4]);
    case SMELT__GK_ATTENTION: return smelt_attention_fwd_run(plan, p[0], p[1], p[2], p[3], NULL);
    default: return smelt_softmax_run(plan, p[0], p[1], NULL);
  }
}
