/* smelt_graph_run: every bound tensor checked against its declaration
 * (present for inputs and outputs, absent for intermediates, the declared
 * dtype, shape, strides and device) and the outputs against everything
 * else, before the first kernel runs; then the kernels in order. */
#include "graph_internal.h"

#define OP "smelt_graph_run"

static smelt_status check_bind(const smelt_graph *g, const smelt_tensor *const *bind) {
  smelt_status s;
  for (int t = 0; t < g->ntensors; t++) {
    const smelt__graph_tensor *x = &g->tensors[t];
    const smelt_tensor *b = bind[t];
    if (x->kind == SMELT__GT_INTER) {
      if (b)
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": bind[%d] is given but \"%s\" is an intermediate "
                            "(the graph's own; pass NULL)", t, x->name);
      continue;
    }
    if (!b)
      return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": bind[%d] (\"%s\", an %s) is NULL", t, x->name,
                          x->kind == SMELT__GT_INPUT ? "input" : "output");
    if ((s = smelt__check_tensor(OP, x->name, b)) || (s = smelt__check_same_layout(OP, x->name, &x->view, b)) ||
        (s = smelt__check_device(OP, x->name, b, g->ctx)))
      return s;
  }
  for (int t = 0; t < g->ntensors; t++) {
    if (g->tensors[t].kind != SMELT__GT_OUTPUT) continue;
    for (int u = 0; u < g->ntensors; u++)
      if (u != t && g->tensors[u].kind != SMELT__GT_INTER &&
          (s = smelt__check_disjoint(OP, g->tensors[t].name, bind[t], g->tensors[u].name, bind[u], 0)))
        return s;
  }
  return SMELT_OK;
}

smelt_status smelt_graph_run(smelt_graph *g, const smelt_tensor *const *bind) {
  if (!g) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": the graph is NULL");
  if (!g->ngroups) return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": the graph is not planned (smelt_graph_plan)");
  smelt_status s;
  if (bind && (s = check_bind(g, bind))) return s;
  for (int k = 0; k < g->ngroups; k++)
    if ((s = smelt__graph_group_run(g, &g->groups[k], bind))) return s;
  return SMELT_OK;
}
