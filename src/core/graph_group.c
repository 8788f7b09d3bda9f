/* The fusion rules of smelt/graph.h: which ops share a kernel. The ops are
 * visited in their order; an op not yet in a kernel starts one:
 *   - a GEMM or an elementwise op starts a chain (graph_chain.c) that takes
 *     the reader of its value while that value is read by that op alone,
 *     the reader is elementwise and it fits the epilogue;
 *   - before that, an add whose sum is normalized next becomes the norm's
 *     fused residual form;
 *   - anything else is a kernel of its own.
 * Greedy and in order: a GEMM takes its chain before the chain's ops are
 * visited themselves, so an add after a GEMM lands in the GEMM's epilogue
 * rather than in the norm after it (both cost one kernel; the epilogue
 * moves less memory). Kernels are then put in an order in which each
 * follows the kernels it reads from. */
#include "graph_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const smelt_tensor *tview(const smelt_graph *g, int t) { return &g->tensors[t].view; }

/* The one op reading tensor t, or -1 when none or several do. */
static int only_reader(const smelt_graph *g, int t) {
  if (g->tensors[t].readers != 1) return -1;
  for (int o = 0; o < g->nops; o++)
    if (smelt__graph_op_reads(&g->ops[o], t)) return o;
  return -1;
}

/* Why a reader of t cannot join an epilogue, by its kind. */
static const char *not_elementwise(smelt__graph_okind k) {
  switch (k) {
    case SMELT__GOP_GEMM: return "it is a GEMM operand (smelt has no GEMM prologue)";
    case SMELT__GOP_NORM: return "a norm reads whole rows (no epilogue or GEMM prologue form in smelt)";
    case SMELT__GOP_ROTARY: return "rotary turns pairs of elements across a row (an epilogue sees one element)";
    case SMELT__GOP_ATTENTION: return "attention reads whole sequences";
    default: return "softmax reads whole rows";
  }
}

/* Why the chain's value goes no further (or "" when nothing reads it). */
static void why_stop(const smelt_graph *g, int t, int reader, const char *because, char *buf, size_t n) {
  const smelt__graph_tensor *x = &g->tensors[t];
  char lbl[64];
  if (x->readers == 0) {
    buf[0] = 0;
  } else if (x->readers > 1) {
    snprintf(buf, n, "\"%s\" is read by %d ops, so it is materialized", x->name, x->readers);
  } else {
    snprintf(buf, n, "\"%s\" goes to %s: %s", x->name, smelt__graph_op_label(g, reader, lbl, sizeof lbl), because);
  }
}

/* Why the output of a kernel that is no chain goes no further. */
static void why_after(const smelt_graph *g, smelt__graph_group *gr) {
  const int t = g->ops[gr->ops[gr->nops - 1]].out, r = only_reader(g, t);
  const char *because = r < 0 ? "" : smelt__graph_elementwise(g->ops[r].kind)
                                         ? "smelt's norm, rotary, attention and softmax kernels have no epilogue"
                                         : not_elementwise(g->ops[r].kind);
  why_stop(g, t, r, because, gr->why, sizeof gr->why);
}

static void chain_group(smelt_graph *g, smelt__graph_group *gr, int op, int fuse) {
  smelt__graph_chain c;
  smelt__graph_chain_begin(&c, g, gr, op);
  for (;;) {
    const int r = fuse ? only_reader(g, c.tensor) : -1;
    char because[SMELT__GRAPH_WHY] = "";
    if (r >= 0 && g->ops[r].group < 0 && smelt__graph_elementwise(g->ops[r].kind) &&
        smelt__graph_chain_fits(&c, g, r, because, sizeof because)) {
      smelt__graph_chain_add(&c, g, r);
      continue;
    }
    if (r >= 0 && g->ops[r].group >= 0)
      snprintf(because, sizeof because, "that op is in the kernel of its other operand already");
    else if (r >= 0 && !because[0])
      snprintf(because, sizeof because, "%s", not_elementwise(g->ops[r].kind));
    if (fuse) why_stop(g, c.tensor, r, because, gr->why, sizeof gr->why);
    break;
  }
  smelt__graph_chain_end(&c, g);
}

/* Roles of a kernel of one public op: its tensor ids (-1 absent) as they
 * are, views as declared. */
static void roles_of(const smelt_graph *g, smelt__graph_group *gr, smelt__graph_gkind kind, int n, const int *ids) {
  gr->kind = kind;
  gr->nroles = n;
  for (int r = 0; r < n; r++) {
    gr->id[r] = ids[r] < 0 ? SMELT__GR_ABSENT : ids[r];
    if (ids[r] >= 0) gr->view[r] = *tview(g, ids[r]);
  }
}

/* Rule 3: add op `a` whose sum the norm `n` reads as x, as one smelt_norm. */
static int norm_residual(const smelt_graph *g, int a, int *norm) {
  const smelt__graph_op *o = &g->ops[a];
  if (o->kind != SMELT__GOP_RESIDUAL && !(o->kind == SMELT__GOP_BINARY && o->p.bin == SMELT_GRAPH_ADD)) return 0;
  for (int n = 0; n < g->nops; n++) {
    const smelt__graph_op *p = &g->ops[n];
    if (p->kind != SMELT__GOP_NORM || p->in[0] != o->out || p->group >= 0) continue;
    /* The norm's parameters must not wait for the sum (they would, inside one kernel). */
    for (int i = 1; i < 3; i++)
      if (p->in[i] >= 0 && g->tensors[p->in[i]].kind != SMELT__GT_INPUT) return 0;
    /* smelt_norm's rows have unit stride along C. */
    const int t[3] = {o->in[0], o->in[1], o->out};
    for (int i = 0; i < 3; i++) {
      const smelt_tensor *v = tview(g, t[i]);
      if (v->ndim < 1 || (v->shape[v->ndim - 1] > 1 && v->strides[v->ndim - 1] != 1)) return 0;
    }
    *norm = n;
    return 1;
  }
  return 0;
}

static void norm_group(smelt_graph *g, smelt__graph_group *gr, int add, int norm) {
  const smelt__graph_op *a = &g->ops[add], *n = &g->ops[norm];
  smelt__graph_tensor *h = &g->tensors[a->out];
  const int keep = h->kind == SMELT__GT_OUTPUT || h->readers > 1;
  const int ids[6] = {a->in[0], a->in[1], n->in[1], n->in[2], n->out, keep ? a->out : -1};
  roles_of(g, gr, SMELT__GK_NORM, 6, ids);
  gr->nops = 2;
  gr->ops[0] = add, gr->ops[1] = norm;
  h->fused = !keep;
}

static void single_group(smelt_graph *g, smelt__graph_group *gr, int op) {
  const smelt__graph_op *o = &g->ops[op];
  gr->nops = 1;
  gr->ops[0] = op;
  const int *in = o->in;
  switch (o->kind) {
    case SMELT__GOP_NORM: {
      const int ids[6] = {in[0], -1, in[1], in[2], o->out, -1};
      roles_of(g, gr, SMELT__GK_NORM, 6, ids);
      break;
    }
    case SMELT__GOP_ROTARY: {
      const int ids[5] = {in[0], in[1], in[2], in[3], o->out};
      roles_of(g, gr, SMELT__GK_ROTARY, 5, ids);
      break;
    }
    case SMELT__GOP_ATTENTION: {
      const int ids[4] = {in[0], in[1], in[2], o->out};
      roles_of(g, gr, SMELT__GK_ATTENTION, 4, ids);
      break;
    }
    default: {
      const int ids[2] = {in[0], o->out};
      roles_of(g, gr, SMELT__GK_SOFTMAX, 2, ids);
      break;
    }
  }
}

/* A lone activation or add takes its own kernel (any shape); other lone
 * elementwise ops stay K = 0 epilogue chains. */
static void lone_elementwise(const smelt_graph *g, smelt__graph_group *gr) {
  const smelt__graph_op *o = &g->ops[gr->ops[0]];
  if (gr->nops != 1) return;
  if (o->kind == SMELT__GOP_ACT) {
    const int ids[2] = {o->in[0], o->out};
    roles_of(g, gr, SMELT__GK_ACT, 2, ids);
  } else if (o->kind == SMELT__GOP_RESIDUAL || (o->kind == SMELT__GOP_BINARY && o->p.bin == SMELT_GRAPH_ADD)) {
    const int ids[3] = {o->in[0], o->in[1], o->out};
    roles_of(g, gr, SMELT__GK_RESIDUAL, 3, ids);
  }
}

/* A chain without a GEMM reads its first op's tensors as matrices
 * [rows, last dim] (later ops are checked as they join). */
static smelt_status check_folds(const smelt_graph *g, int op) {
  const smelt__graph_op *o = &g->ops[op];
  const int ts[3] = {o->in[0], o->in[1], o->out};
  smelt_tensor m;
  char lbl[64];
  for (int i = 0; i < 3; i++)
    if (ts[i] >= 0 && !smelt__graph_as_matrix(tview(g, ts[i]), &m))
      return smelt__error(SMELT_STATUS_UNSUPPORTED,
                          "smelt_graph_plan: %s: \"%s\" cannot be read as a matrix [rows, last dim] (its leading "
                          "dims do not fold), which an elementwise op without a GEMM needs (it runs on the GEMM "
                          "engine with K = 0)",
                          smelt__graph_op_label(g, op, lbl, sizeof lbl), g->tensors[ts[i]].name);
  return SMELT_OK;
}

/* Kernels in an order where each follows those it reads from (Kahn's,
 * lowest first). The rules never merge ops into a cycle; INTERNAL if
 * they did. */
static smelt_status order_groups(smelt_graph *g) {
  const int n = g->ngroups;
  int *done = (int *)calloc((size_t)n + 1, sizeof *done), *map = (int *)calloc((size_t)n + 1, sizeof *map);
  smelt__graph_group *sorted = (smelt__graph_group *)calloc((size_t)n + 1, sizeof *sorted);
  smelt_status s = SMELT_OK;
  if (!done || !map || !sorted) s = smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_graph_plan: out of host memory");
  for (int k = 0; k < n && !s; k++) {
    int pick = -1;
    for (int c = 0; c < n && pick < 0; c++) {
      if (done[c]) continue;
      int ready = 1;
      for (int i = 0; i < g->groups[c].nops && ready; i++)
        for (int j = 0; j < SMELT__GRAPH_MAX_IN && ready; j++) {
          const int t = g->ops[g->groups[c].ops[i]].in[j];
          const int p = t >= 0 ? g->tensors[t].producer : -1;
          ready = p < 0 || g->ops[p].group == c || done[g->ops[p].group];
        }
      if (ready) pick = c;
    }
    if (pick < 0) {
      s = smelt__error(SMELT_STATUS_INTERNAL, "smelt_graph_plan: the kernels depend on each other in a cycle");
      break;
    }
    done[pick] = 1;
    map[pick] = k;
    sorted[k] = g->groups[pick];
  }
  if (!s) {
    for (int o = 0; o < g->nops; o++) g->ops[o].group = map[g->ops[o].group];
    memcpy(g->groups, sorted, (size_t)n * sizeof *sorted);
    /* The copies' epilogue graphs moved with them. */
    for (int k = 0; k < n; k++)
      if (g->groups[k].gemm.epilogue.graph) g->groups[k].gemm.epilogue.graph = &g->groups[k].epi;
  }
  free(done);
  free(map);
  free(sorted);
  return s;
}

smelt_status smelt__graph_group_ops(smelt_graph *g, const int *order, unsigned flags) {
  const int fuse = !(flags & SMELT_GRAPH_UNFUSED);
  for (int i = 0; i < g->nops; i++) {
    const int op = order[i];
    if (g->ops[op].group >= 0) continue;
    smelt__graph_group *gr = &g->groups[g->ngroups];
    memset(gr, 0, sizeof *gr);
    int norm;
    if (fuse && norm_residual(g, op, &norm)) {
      norm_group(g, gr, op, norm);
    } else if (g->ops[op].kind == SMELT__GOP_GEMM || smelt__graph_elementwise(g->ops[op].kind)) {
      chain_group(g, gr, op, fuse);
      lone_elementwise(g, gr);
      smelt_status s = gr->kind == SMELT__GK_GEMM_EPI && gr->id[0] == SMELT__GR_FIXED ? check_folds(g, op) : SMELT_OK;
      if (s) return s;
    } else {
      single_group(g, gr, op);
    }
    if (fuse && gr->kind >= SMELT__GK_NORM) why_after(g, gr);
    for (int k = 0; k < gr->nops; k++) g->ops[gr->ops[k]].group = g->ngroups;
    g->ngroups++;
  }
  return order_groups(g);
}
