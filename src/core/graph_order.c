/* The whole graph's checks (smelt/graph.h), before anything is planned:
 * every intermediate read is written by some op, every output is written,
 * outputs share no memory with other caller tensors, and the ops have an
 * order in which each follows the writers of what it reads (no cycle).
 * The order is Kahn's, taking the lowest-numbered ready op first, so an
 * acyclic graph runs its ops in the order they were added where it can. */
#include "graph_internal.h"

#include <stdlib.h>

static smelt_status check_tensors(const smelt_graph *g) {
  const char *op = "smelt_graph_plan";
  char lbl[64];
  for (int t = 0; t < g->ntensors; t++) {
    const smelt__graph_tensor *x = &g->tensors[t];
    if (x->kind == SMELT__GT_OUTPUT && x->producer < 0)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: output \"%s\" (tensor %d) is written by no op", op,
                          x->name, t);
    if (x->kind != SMELT__GT_INTER || x->producer >= 0) continue;
    for (int o = 0; o < g->nops; o++)
      if (smelt__graph_op_reads(&g->ops[o], t))
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                            "%s: intermediate \"%s\" (tensor %d) is read by %s but written by no op", op, x->name, t,
                            smelt__graph_op_label(g, o, lbl, sizeof lbl));
  }
  for (int t = 0; t < g->ntensors; t++) {
    if (g->tensors[t].kind != SMELT__GT_OUTPUT) continue;
    for (int u = 0; u < g->ntensors; u++) {
      if (u == t || g->tensors[u].kind == SMELT__GT_INTER) continue;
      smelt_status s = smelt__check_disjoint(op, g->tensors[t].name, &g->tensors[t].view, g->tensors[u].name,
                                             &g->tensors[u].view, 0);
      if (s) return s;
    }
  }
  return SMELT_OK;
}

/* An input of op o written by an op still waiting (one exists when o waits). */
static int waiting_input(const smelt_graph *g, const int *waiting, int o) {
  for (int i = 0; i < SMELT__GRAPH_MAX_IN; i++) {
    const int t = g->ops[o].in[i];
    if (t >= 0 && g->tensors[t].producer >= 0 && waiting[g->tensors[t].producer]) return t;
  }
  return -1;
}

/* The ops left over by Kahn's order are on a cycle or after one. Walking
 * back from one through waiting writers nops times ends on the cycle;
 * name that op and the input it waits for. */
static smelt_status cycle(const smelt_graph *g, const int *waiting) {
  int o = 0;
  while (!waiting[o]) o++;
  for (int step = 0; step < g->nops; step++) o = g->tensors[waiting_input(g, waiting, o)].producer;
  const int t = waiting_input(g, waiting, o);
  char lbl[64], wl[64];
  return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                      "smelt_graph_plan: %s reads \"%s\", written by %s, which depends on %s's own output: the ops "
                      "form a cycle",
                      smelt__graph_op_label(g, o, lbl, sizeof lbl), g->tensors[t].name,
                      smelt__graph_op_label(g, g->tensors[t].producer, wl, sizeof wl), lbl);
}

smelt_status smelt__graph_order(const smelt_graph *g, int *order) {
  smelt_status s = check_tensors(g);
  if (s) return s;
  /* waiting[o]: how many of op o's inputs are not yet written. */
  int *waiting = (int *)calloc((size_t)g->nops + 1, sizeof *waiting);
  if (!waiting) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_graph_plan: out of host memory");
  for (int o = 0; o < g->nops; o++)
    for (int i = 0; i < SMELT__GRAPH_MAX_IN; i++) {
      const int t = g->ops[o].in[i];
      int first = t >= 0;
      for (int j = 0; j < i && first; j++) first = g->ops[o].in[j] != t;
      if (first && g->tensors[t].producer >= 0) waiting[o]++;
    }
  int n = 0;
  for (int done = 1; done && n < g->nops;) {
    done = 0;
    for (int o = 0; o < g->nops; o++) {
      if (waiting[o]) continue;
      waiting[o] = -1;
      order[n++] = o;
      done = 1;
      for (int r = 0; r < g->nops; r++)
        if (waiting[r] > 0 && smelt__graph_op_reads(&g->ops[r], g->ops[o].out)) waiting[r]--;
      break;
    }
  }
  if (n < g->nops) {
    for (int o = 0; o < g->nops; o++) waiting[o] = waiting[o] > 0;
    s = cycle(g, waiting);
  }
  free(waiting);
  return s;
}
