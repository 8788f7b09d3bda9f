/* An elementwise chain as one GEMM epilogue (smelt/graph.h, rules 1 and
 * 2). The chain starts at a GEMM, whose accumulator is its first value,
 * or at an elementwise op, carried by a GEMM with K = 0 (the engine's
 * D = epilogue(beta · C) with empty A and B), and grows one op at a time:
 * each op reads the value so far and maybe one tensor of the same shape
 * ([M, N]: the GEMM's C the first time, an AUX slot after) or a bias
 * ([N]: the GEMM's bias the first time, a COL slot after). The nodes go
 * into an epilogue graph as they come; an op that would overflow its 32
 * nodes or 8 slots ends the chain. At the end, a chain the fixed epilogue
 * can say (bias, one C, one activation last, nothing stored on the way)
 * drops the graph and takes the fixed epilogue, which on Hopper has the
 * fast TMA-store path; the rest keep the graph. */
#include "graph_internal.h"

#include <stdio.h>
#include <string.h>

enum { R_A, R_B, R_C, R_D, R_BIAS, R_SLOT0 };

int smelt__graph_as_matrix(const smelt_tensor *t, smelt_tensor *m) {
  *m = *t;
  m->ndim = 2;
  const int last = t->ndim - 1;
  m->shape[1] = t->ndim ? t->shape[last] : 1;
  m->strides[1] = t->ndim ? t->strides[last] : 1;
  /* The leading dims fold into rows when each (of size > 1) steps over
   * exactly the dims inside it; size-1 dims step nowhere. */
  int64_t rows = 1, row_stride = -1, step = 0;
  for (int d = last - 1; d >= 0; d--) {
    rows *= t->shape[d];
    if (t->shape[d] == 1) continue;
    if (row_stride < 0) row_stride = t->strides[d];
    else if (t->strides[d] != step) return smelt_tensor_numel(t) == 0;
    step = t->strides[d] * t->shape[d];
  }
  m->shape[0] = rows;
  m->strides[0] = row_stride >= 0 ? row_stride : m->shape[1] * m->strides[1];
  return 1;
}

static const smelt_tensor *tview(const smelt_graph *g, int t) { return &g->tensors[t].view; }

/* The node already standing for tensor t, or -1. */
static int node_of(const smelt__graph_chain *c, int t) {
  for (int i = 0; i < c->nknown; i++)
    if (c->known[i].tensor == t) return c->known[i].node;
  return -1;
}

static void remember(smelt__graph_chain *c, int t, int node) {
  c->known[c->nknown].tensor = t;
  c->known[c->nknown++].node = node;
}

/* The slot role for tensor t (its matrix or vector view). */
static int new_slot(smelt__graph_chain *c, int t, const smelt_tensor *v) {
  smelt__graph_group *gr = c->gr;
  const int slot = c->nslots++;
  gr->id[R_SLOT0 + slot] = t;
  gr->view[R_SLOT0 + slot] = *v;
  return slot;
}

/* What an input costs: nodes and slots. */
typedef struct cost {
  int nodes, slots;
} cost;

static cost input_cost(const smelt__graph_chain *c, int t, int vector) {
  cost k = {0, 0};
  if (node_of(c, t) >= 0) return k;
  k.nodes = 1;
  k.slots = vector ? c->has_bias : c->has_c;
  return k;
}

/* The node for input tensor t: [M, N] as C or AUX, [N] as BIAS or COL. */
static int input_node(smelt__graph_chain *c, const smelt_graph *g, int t, int vector) {
  int n = node_of(c, t);
  if (n >= 0) return n;
  smelt__graph_group *gr = c->gr;
  smelt_tensor m;
  if (vector) {
    if (!c->has_bias) {
      c->has_bias = 1;
      gr->id[R_BIAS] = t;
      gr->view[R_BIAS] = *tview(g, t);
      n = smelt_epi_input(&gr->epi, SMELT_EPI_BIAS, 0);
    } else {
      n = smelt_epi_input(&gr->epi, SMELT_EPI_COL, new_slot(c, t, tview(g, t)));
    }
  } else {
    smelt__graph_as_matrix(tview(g, t), &m);
    if (!c->has_c) {
      c->has_c = 1;
      gr->id[R_C] = t;
      gr->view[R_C] = m;
      n = smelt_epi_input(&gr->epi, SMELT_EPI_C, 0);
    } else {
      n = smelt_epi_input(&gr->epi, SMELT_EPI_AUX, new_slot(c, t, &m));
    }
  }
  remember(c, t, n);
  return n;
}

static const smelt_epi_op bin_ops[SMELT_GRAPH_BINOP_COUNT] = {SMELT_EPI_ADD, SMELT_EPI_SUB, SMELT_EPI_MUL,
                                                                SMELT_EPI_DIV, SMELT_EPI_MAX, SMELT_EPI_MIN};

/* What op o adds to the chain when `value` (a node, or -1 for a chain
 * that starts at o) is its input `from`. */
static cost op_cost(const smelt__graph_chain *c, const smelt__graph_op *o, int from) {
  cost k = {1, 0};
  for (int i = 0; i < 2; i++) {
    if (o->in[i] < 0 || o->in[i] == from) continue;
    const cost in = input_cost(c, o->in[i], o->kind == SMELT__GOP_BIAS && i == 1);
    k.nodes += in.nodes, k.slots += in.slots;
  }
  return k;
}

static int op_node(smelt__graph_chain *c, const smelt_graph *g, const smelt__graph_op *o, int from, int value) {
  smelt_epi_graph *e = &c->gr->epi;
  int in[2];
  for (int i = 0; i < 2; i++)
    in[i] = o->in[i] < 0 ? -1 : o->in[i] == from ? value : input_node(c, g, o->in[i], o->kind == SMELT__GOP_BIAS && i == 1);
  switch (o->kind) {
    case SMELT__GOP_ACT: return smelt_epi_act(e, o->p.act.act, o->p.act.slope, in[0]);
    case SMELT__GOP_BINARY: return smelt_epi_binary(e, bin_ops[o->p.bin], in[0], in[1]);
    default: return smelt_epi_binary(e, SMELT_EPI_ADD, in[0], in[1]); /* bias, residual */
  }
}

void smelt__graph_chain_begin(smelt__graph_chain *c, smelt_graph *g, smelt__graph_group *gr, int op) {
  memset(c, 0, sizeof *c);
  c->gr = gr;
  gr->kind = SMELT__GK_GEMM_EPI;
  gr->nops = 1;
  gr->ops[0] = op;
  gr->nroles = R_SLOT0 + SMELT_EPI_MAX_TENSORS;
  for (int r = 0; r < gr->nroles; r++) gr->id[r] = SMELT__GR_ABSENT;
  gr->epi = smelt_epi_graph_empty();
  const smelt__graph_op *o = &g->ops[op];
  gr->gemm = o->kind == SMELT__GOP_GEMM ? o->p.gemm : smelt_gemm_desc_default();
  if (o->kind == SMELT__GOP_GEMM) {
    gr->id[R_A] = o->in[0], gr->view[R_A] = *tview(g, o->in[0]);
    gr->id[R_B] = o->in[1], gr->view[R_B] = *tview(g, o->in[1]);
    c->value = smelt_epi_input(&gr->epi, SMELT_EPI_ACC, 0);
  } else {
    /* K = 0: A [M, 0] and B [0, N], empty f32 views (no data is read). */
    smelt_tensor m;
    smelt__graph_as_matrix(tview(g, o->out), &m);
    const int64_t as[2] = {m.shape[0], 0}, bs[2] = {0, m.shape[1]};
    gr->id[R_A] = gr->id[R_B] = SMELT__GR_FIXED;
    gr->view[R_A] = smelt_tensor_make(NULL, SMELT_DTYPE_F32, m.device, m.device_index, 2, as);
    gr->view[R_B] = smelt_tensor_make(NULL, SMELT_DTYPE_F32, m.device, m.device_index, 2, bs);
    c->k0 = 1;
    c->value = op_node(c, g, o, -1, -1);
  }
  c->tensor = o->out;
}

/* Whether tensor t reads as a matrix (a K = 0 chain reads every tensor so). */
static int matrix_ok(const smelt_graph *g, int t) {
  smelt_tensor m;
  return smelt__graph_as_matrix(tview(g, t), &m);
}

int smelt__graph_chain_fits(const smelt__graph_chain *c, const smelt_graph *g, int op, char *why, size_t n) {
  const smelt__graph_op *o = &g->ops[op];
  const smelt__graph_tensor *v = &g->tensors[c->tensor];
  const cost k = op_cost(c, o, c->tensor);
  const int store = v->kind == SMELT__GT_OUTPUT;
  if (c->gr->epi.count + k.nodes + store > SMELT_EPI_MAX_NODES ||
      c->nslots + k.slots + store > SMELT_EPI_MAX_TENSORS) {
    snprintf(why, n, "the epilogue graph is full (%d nodes, %d slots of %d and %d)", c->gr->epi.count, c->nslots,
             SMELT_EPI_MAX_NODES, SMELT_EPI_MAX_TENSORS);
    return 0;
  }
  if (c->gr->nops == SMELT__GRAPH_MAX_CHAIN) {
    snprintf(why, n, "the kernel holds %d ops already", SMELT__GRAPH_MAX_CHAIN);
    return 0;
  }
  const int ts[3] = {o->in[0], o->in[1], o->out};
  for (int i = 0; i < 3 && c->k0; i++)
    if (ts[i] >= 0 && !matrix_ok(g, ts[i])) {
      snprintf(why, n, "\"%s\" cannot be read as a matrix [rows, last dim] (its leading dims do not fold)",
               g->tensors[ts[i]].name);
      return 0;
    }
  return 1;
}

void smelt__graph_chain_add(smelt__graph_chain *c, smelt_graph *g, int op) {
  smelt__graph_tensor *v = &g->tensors[c->tensor];
  smelt_tensor m;
  if (v->kind == SMELT__GT_OUTPUT) {
    /* An output the chain passes on is written on the way. */
    smelt__graph_as_matrix(&v->view, &m);
    smelt_epi_store(&c->gr->epi, c->value, new_slot(c, c->tensor, &m));
    c->stores++;
  } else {
    v->fused = 1;
  }
  c->value = op_node(c, g, &g->ops[op], c->tensor, c->value);
  c->gr->ops[c->gr->nops++] = op;
  c->tensor = g->ops[op].out;
}

/* ---------------------------------------------------------------- the end */

/* The fixed epilogue's form: after the GEMM, at most one bias, one [M, N]
 * add (as C) and one activation, the activation last, nothing stored. */
static int fixed_form(const smelt__graph_chain *c, const smelt_graph *g, smelt_act *act, float *slope) {
  const smelt__graph_group *gr = c->gr;
  if (c->k0 || c->stores || c->nslots) return 0;
  *act = SMELT_ACT_IDENTITY;
  *slope = 0.01f;
  for (int i = 1; i < gr->nops; i++) {
    const smelt__graph_op *o = &g->ops[gr->ops[i]];
    if (*act != SMELT_ACT_IDENTITY) return 0;
    if (o->kind == SMELT__GOP_ACT) {
      *act = o->p.act.act;
      if (*act == SMELT_ACT_LEAKY_RELU) *slope = o->p.act.slope;
      if (*act == SMELT_ACT_IDENTITY) return 0; /* an identity op: the graph keeps the count honest */
    } else if (o->kind == SMELT__GOP_BINARY && o->p.bin != SMELT_GRAPH_ADD) {
      return 0;
    } else if (o->in[0] == o->in[1]) {
      return 0; /* v + v */
    }
  }
  return 1;
}

static void say_fixed(char *buf, size_t n, int has_bias, int has_c, smelt_act act) {
  snprintf(buf, n, "fixed epilogue (%s%s%s%s%s)", has_c ? "C" : "", has_c && has_bias ? ", " : "",
           has_bias ? "bias" : "", (has_c || has_bias) && act ? ", " : "", act ? smelt_act_name(act) : "");
  if (!has_c && !has_bias && !act) snprintf(buf, n, "plain");
}

void smelt__graph_chain_end(smelt__graph_chain *c, const smelt_graph *g) {
  smelt__graph_group *gr = c->gr;
  gr->id[R_D] = c->tensor;
  smelt__graph_as_matrix(tview(g, c->tensor), &gr->view[R_D]);
  gr->gemm.epilogue.beta = c->has_c ? 1.0 : 0.0;
  smelt_act act;
  float slope;
  if (fixed_form(c, g, &act, &slope)) {
    gr->kind = SMELT__GK_GEMM;
    gr->nroles = R_SLOT0;
    gr->gemm.epilogue.act = act;
    gr->gemm.epilogue.slope = slope;
    say_fixed(gr->epilogue, sizeof gr->epilogue, c->has_bias, c->has_c, act);
    return;
  }
  gr->epi.out = c->value;
  gr->gemm.epilogue.graph = &gr->epi;
  snprintf(gr->epilogue, sizeof gr->epilogue, "%sepilogue graph of %d nodes, %d slot%s", c->k0 ? "K = 0, " : "",
           gr->epi.count, c->nslots, c->nslots == 1 ? "" : "s");
}
