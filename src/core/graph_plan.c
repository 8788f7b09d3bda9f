/* smelt_graph_plan: the whole graph checked and ordered (graph_order.c),
 * the ops grouped into kernels (graph_group.c), workspace for every
 * intermediate that is not fused away, each kernel planned through its
 * public op (graph_kernel.c), and the plan written out in words. A
 * failure at any step leaves the graph unplanned; the message of a
 * kernel's own plan is kept, after the kernel's ops. */
#include "graph_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_graph_plan"

void smelt__graph_unplan(smelt_graph *g) {
  for (int k = 0; k < g->ngroups; k++) smelt_plan_destroy(g->groups[k].plan);
  free(g->groups);
  g->groups = NULL;
  g->ngroups = 0;
  for (int t = 0; g->work && t < g->ntensors; t++)
    if (g->work[t]) smelt_free(g->ctx, g->work[t]);
  free(g->work);
  g->work = NULL;
  g->work_bytes = 0;
  for (int t = 0; t < g->ntensors; t++) {
    g->tensors[t].fused = 0;
    if (g->tensors[t].kind == SMELT__GT_INTER) g->tensors[t].view.data = NULL;
  }
  for (int o = 0; o < g->nops; o++) g->ops[o].group = -1;
  if (g->describe) g->describe[0] = 0;
}

void smelt__graph_say(smelt_graph *g, const char *fmt, ...) {
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  const size_t have = strlen(g->describe), add = strlen(line);
  char *p = (char *)realloc(g->describe, have + add + 2);
  if (!p) return; /* the description is advice: a short one is better than a failed plan */
  memcpy(p + have, line, add);
  p[have + add] = '\n';
  p[have + add + 1] = 0;
  g->describe = p;
}

/* ---------------------------------------------------------------- workspace */

static smelt_status materialize(smelt_graph *g) {
  g->work = (void **)calloc((size_t)g->ntensors + 1, sizeof *g->work);
  if (!g->work) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  for (int t = 0; t < g->ntensors; t++) {
    smelt__graph_tensor *x = &g->tensors[t];
    const size_t bytes = (size_t)smelt_tensor_numel(&x->view) * smelt_dtype_size(x->view.dtype);
    if (x->kind != SMELT__GT_INTER || x->fused || x->producer < 0 || !bytes) continue;
    smelt_status s = smelt_alloc(g->ctx, bytes, &g->work[t]);
    if (s) return s;
    x->view.data = g->work[t];
    g->work_bytes += bytes;
  }
  return SMELT_OK;
}

/* ---------------------------------------------------------------- description */

static const char *const gkind_names[] = {"gemm", "gemm", "activation", "residual_add",
                                          "norm", "rotary", "attention", "softmax"};

static void describe_group(smelt_graph *g, int k) {
  const smelt__graph_group *gr = &g->groups[k];
  char ops[600] = "", lbl[64], gone[300] = "";
  for (int i = 0; i < gr->nops; i++) {
    const size_t n = strlen(ops);
    snprintf(ops + n, sizeof ops - n, "%s%s", i ? ", " : "", smelt__graph_op_label(g, gr->ops[i], lbl, sizeof lbl));
    const int t = g->ops[gr->ops[i]].out;
    const size_t m = strlen(gone);
    if (g->tensors[t].fused) snprintf(gone + m, sizeof gone - m, "%s\"%s\"", m ? ", " : "", g->tensors[t].name);
  }
  const char *what = gkind_names[gr->kind];
  char form[128];
  if (gr->kind <= SMELT__GK_GEMM_EPI) snprintf(form, sizeof form, "%s, %s", what, gr->epilogue);
  else if (gr->kind == SMELT__GK_NORM && gr->nops == 2) snprintf(form, sizeof form, "norm with the residual add");
  else snprintf(form, sizeof form, "%s", what);
  const int out = g->ops[gr->ops[gr->nops - 1]].out;
  smelt__graph_say(g, "kernel %d: %s: %s -> \"%s\"%s%s; %s", k, form, ops, g->tensors[out].name,
                   gone[0] ? "; not materialized: " : "", gone, smelt_plan_describe(gr->plan));
  if (gr->why[0]) smelt__graph_say(g, "  not fused further: %s", gr->why);
}

static void describe(smelt_graph *g, unsigned flags) {
  int gone = 0, kept = 0;
  for (int t = 0; t < g->ntensors; t++)
    if (g->tensors[t].kind == SMELT__GT_INTER) g->tensors[t].fused ? gone++ : kept++;
  smelt__graph_say(g, "smelt_graph: %d ops in %d kernels (%s); intermediates: %d not materialized, %d in %llu "
                   "bytes of workspace",
                   g->nops, g->ngroups, flags & SMELT_GRAPH_UNFUSED ? "unfused: one op a kernel" : "fused", gone,
                   kept, (unsigned long long)g->work_bytes);
  for (int k = 0; k < g->ngroups; k++) describe_group(g, k);
}

/* ---------------------------------------------------------------- plan */

/* A kernel's plan failed: its message, after the kernel's ops. */
static smelt_status kernel_failed(const smelt_graph *g, int k, smelt_status s) {
  char msg[1024], ops[300] = "", lbl[64];
  snprintf(msg, sizeof msg, "%s", smelt_last_error());
  const smelt__graph_group *gr = &g->groups[k];
  for (int i = 0; i < gr->nops; i++) {
    const size_t n = strlen(ops);
    snprintf(ops + n, sizeof ops - n, "%s%s", i ? ", " : "", smelt__graph_op_label(g, gr->ops[i], lbl, sizeof lbl));
  }
  return smelt__error(s, OP ": kernel %d (%s): %s", k, ops, msg);
}

static smelt_status plan_all(smelt_graph *g, unsigned flags) {
  int *order = (int *)malloc(((size_t)g->nops + 1) * sizeof *order);
  g->groups = (smelt__graph_group *)calloc((size_t)g->nops + 1, sizeof *g->groups);
  if (!order || !g->groups) {
    free(order);
    return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  }
  smelt_status s = smelt__graph_order(g, order);
  if (!s) s = smelt__graph_group_ops(g, order, flags);
  free(order);
  if (s || (s = materialize(g))) return s;
  for (int k = 0; k < g->ngroups; k++)
    if ((s = smelt__graph_group_plan(g, &g->groups[k]))) return kernel_failed(g, k, s);
  describe(g, flags);
  return SMELT_OK;
}

smelt_status smelt_graph_plan(smelt_graph *g, unsigned flags) {
  if (!g) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": the graph is NULL");
  if (flags & ~(unsigned)SMELT_GRAPH_UNFUSED)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": flags=0x%x has bits that are no SMELT_GRAPH_* flag",
                        flags);
  if (g->broken)
    return smelt__error(g->broken, OP ": the graph is broken since an op failed to be added: %s", g->broken_msg);
  if (!g->nops) return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": the graph has no ops");
  smelt__graph_unplan(g);
  smelt_status s = plan_all(g, flags);
  if (s) smelt__graph_unplan(g);
  return s;
}

const char *smelt_graph_describe(const smelt_graph *g) { return g && g->describe ? g->describe : ""; }

smelt_status smelt_graph_stats_get(const smelt_graph *g, smelt_graph_stats *out) {
  if (!g || !out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_graph_stats_get: %s is NULL", g ? "out" : "g");
  memset(out, 0, sizeof *out);
  out->ops = g->nops;
  out->tensors = g->ntensors;
  out->kernels = g->ngroups;
  for (int t = 0; t < g->ntensors; t++) out->fused_away += g->tensors[t].fused;
  out->workspace_bytes = g->work_bytes;
  return SMELT_OK;
}
