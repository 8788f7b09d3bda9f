/* Epilogue graphs (smelt/epilogue.h): the builders, the graph's own checks,
 * and the checks of its tensor slots against a GEMM problem.
 *
 * A graph is checked whole before anything is planned: operands precede
 * their node (so it is acyclic), every field is in range, unused fields are
 * 0 (equal graphs are equal bytes, which the CUDA kernel names rely on),
 * and each slot serves one kind of node with one shape. The slots' tensors
 * are then checked against the problem: shapes, dtypes, reductions
 * contiguous, and outputs disjoint from every input and from each other. */
#include "gemm_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- builders */

smelt_epi_graph smelt_epi_graph_empty(void) {
  smelt_epi_graph g;
  memset(&g, 0, sizeof g);
  return g;
}

static int append(smelt_epi_graph *g, smelt_epi_node n) {
  if (!g || g->count < 0 || g->count >= SMELT_EPI_MAX_NODES) {
    if (g) g->count = SMELT_EPI_MAX_NODES + 1; /* reported by smelt_epi_graph_check */
    return -1;
  }
  g->node[g->count] = n;
  return g->count++;
}

int smelt_epi_input(smelt_epi_graph *g, smelt_epi_op op, int slot) {
  const int slotted = op == SMELT_EPI_ROW || op == SMELT_EPI_COL || op == SMELT_EPI_AUX;
  return append(g, (smelt_epi_node){.op = op, .slot = slotted ? slot : 0});
}

int smelt_epi_scalar(smelt_epi_graph *g, float value) {
  return append(g, (smelt_epi_node){.op = SMELT_EPI_SCALAR, .value = value});
}

int smelt_epi_binary(smelt_epi_graph *g, smelt_epi_op op, int a, int b) {
  return append(g, (smelt_epi_node){.op = op, .a = a, .b = b});
}

int smelt_epi_act(smelt_epi_graph *g, smelt_act act, float slope, int a) {
  return append(g, (smelt_epi_node){.op = SMELT_EPI_ACT, .a = a, .act = act,
                                    .slope = act == SMELT_ACT_LEAKY_RELU ? slope : 0.0f});
}

int smelt_epi_clamp(smelt_epi_graph *g, int a, float lo, float hi) {
  return append(g, (smelt_epi_node){.op = SMELT_EPI_CLAMP, .a = a, .lo = lo, .hi = hi});
}

int smelt_epi_cast(smelt_epi_graph *g, int a, smelt_dtype dtype) {
  return append(g, (smelt_epi_node){.op = SMELT_EPI_CAST, .a = a, .dtype = dtype});
}

int smelt_epi_store(smelt_epi_graph *g, int a, int slot) {
  return append(g, (smelt_epi_node){.op = SMELT_EPI_STORE, .a = a, .slot = slot});
}

int smelt_epi_reduce_node(smelt_epi_graph *g, smelt_epi_op op, smelt_epi_reduce how, int a, int slot) {
  return append(g, (smelt_epi_node){.op = op, .a = a, .slot = slot, .reduce = how});
}

/* ---------------------------------------------------------------- the graph alone */

#define GOP "smelt_epi_graph"

static const char *const op_names[SMELT_EPI_OP_COUNT] = {
    "ACC", "C", "BIAS", "ROW", "COL", "AUX", "SCALAR", "ADD", "SUB", "MUL",
    "DIV", "MAX", "MIN", "ACT", "CLAMP", "CAST", "STORE", "ROW_REDUCE", "COL_REDUCE"};

/* How many operands an op takes, and whether it names a slot. */
static int arity(smelt_epi_op op) {
  if (op >= SMELT_EPI_ADD && op <= SMELT_EPI_MIN) return 2;
  return op >= SMELT_EPI_ACT ? 1 : 0;
}

static int slotted(smelt_epi_op op) {
  return op == SMELT_EPI_ROW || op == SMELT_EPI_COL || op == SMELT_EPI_AUX || op == SMELT_EPI_STORE ||
         op == SMELT_EPI_ROW_REDUCE || op == SMELT_EPI_COL_REDUCE;
}

static smelt_status bad(int i, const smelt_epi_node *n, const char *what) {
  return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, GOP ": node %d (%s): %s", i,
                      (unsigned)n->op < SMELT_EPI_OP_COUNT ? op_names[n->op] : "?", what);
}

/* The fields op n does not use are 0. */
static smelt_status check_unused(int i, const smelt_epi_node *n) {
  const int ar = arity(n->op);
  if ((ar < 1 && n->a) || (ar < 2 && n->b)) return bad(i, n, "an operand it does not take is not 0");
  if (!slotted(n->op) && n->slot) return bad(i, n, "slot is not 0 (the op reads no tensor slot)");
  if (n->op != SMELT_EPI_ACT && (n->act || n->slope != 0.0f)) return bad(i, n, "act and slope must be 0 (not ACT)");
  if (n->op == SMELT_EPI_ACT && n->act != SMELT_ACT_LEAKY_RELU && n->slope != 0.0f)
    return bad(i, n, "slope must be 0 for an activation other than leaky_relu");
  if (n->op != SMELT_EPI_SCALAR && n->value != 0.0f) return bad(i, n, "value must be 0 (not SCALAR)");
  if (n->op != SMELT_EPI_CLAMP && (n->lo != 0.0f || n->hi != 0.0f)) return bad(i, n, "lo and hi must be 0 (not CLAMP)");
  if (n->op != SMELT_EPI_CAST && n->dtype) return bad(i, n, "dtype must be 0 (not CAST)");
  if (n->op != SMELT_EPI_ROW_REDUCE && n->op != SMELT_EPI_COL_REDUCE && n->reduce)
    return bad(i, n, "reduce must be 0 (not a reduction)");
  return SMELT_OK;
}

static smelt_status check_node(int i, const smelt_epi_node *n) {
  char msg[160];
  if ((unsigned)n->op >= SMELT_EPI_OP_COUNT) {
    snprintf(msg, sizeof msg, "op=%d is not a smelt_epi_op (0..%d)", (int)n->op, SMELT_EPI_OP_COUNT - 1);
    return bad(i, n, msg);
  }
  const int ar = arity(n->op);
  if ((ar >= 1 && (n->a < 0 || n->a >= i)) || (ar == 2 && (n->b < 0 || n->b >= i))) {
    snprintf(msg, sizeof msg, "operands a=%d, b=%d must be earlier nodes (0..%d)", n->a, n->b, i - 1);
    return bad(i, n, msg);
  }
  if (slotted(n->op) && (n->slot < 0 || n->slot >= SMELT_EPI_MAX_TENSORS)) {
    snprintf(msg, sizeof msg, "slot=%d is not 0..%d", n->slot, SMELT_EPI_MAX_TENSORS - 1);
    return bad(i, n, msg);
  }
  switch (n->op) {
    case SMELT_EPI_ACT:
      if ((unsigned)n->act >= SMELT_ACT_COUNT || !isfinite(n->slope)) return bad(i, n, "act or slope out of range");
      break;
    case SMELT_EPI_SCALAR:
      if (!isfinite(n->value)) return bad(i, n, "value must be finite");
      break;
    case SMELT_EPI_CLAMP:
      if (isnan(n->lo) || isnan(n->hi) || n->lo > n->hi) return bad(i, n, "needs lo <= hi (not NaN)");
      break;
    case SMELT_EPI_CAST:
      if (n->dtype != SMELT_DTYPE_F32 && n->dtype != SMELT_DTYPE_F16 && n->dtype != SMELT_DTYPE_BF16 &&
          n->dtype != SMELT_DTYPE_E4M3 && n->dtype != SMELT_DTYPE_E5M2) {
        snprintf(msg, sizeof msg, "dtype=%s is not one of f32, f16, bf16, e4m3, e5m2", smelt_dtype_name(n->dtype));
        return bad(i, n, msg);
      }
      break;
    case SMELT_EPI_ROW_REDUCE:
    case SMELT_EPI_COL_REDUCE:
      if ((unsigned)n->reduce >= SMELT_EPI_REDUCE_COUNT) return bad(i, n, "reduce is not SUM, RMAX or AMAX");
      break;
    default: break;
  }
  return check_unused(i, n);
}

smelt_status smelt_epi_graph_check(const smelt_epi_graph *g) {
  if (!g) return smelt__error(SMELT_STATUS_NULL_POINTER, GOP ": the graph is NULL");
  if (g->count < 1 || g->count > SMELT_EPI_MAX_NODES)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, GOP ": count=%d is not 1..%d (nodes)", g->count,
                        SMELT_EPI_MAX_NODES);
  for (int i = 0; i < g->count; i++) {
    smelt_status s = check_node(i, &g->node[i]);
    if (s) return s;
  }
  for (int i = g->count; i < SMELT_EPI_MAX_NODES; i++) {
    static const smelt_epi_node zero;
    if (memcmp(&g->node[i], &zero, sizeof zero))
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, GOP ": node %d past count=%d is not all zeros", i,
                          g->count);
  }
  if (g->out < 0 || g->out >= g->count)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, GOP ": out=%d is not a node (0..%d)", g->out, g->count - 1);
  /* Each slot serves one kind of node: an input slot is never written, and
   * one output is never written twice. */
  int kind[SMELT_EPI_MAX_TENSORS] = {0}, writer[SMELT_EPI_MAX_TENSORS];
  for (int i = 0; i < g->count; i++) {
    const smelt_epi_node *n = &g->node[i];
    if (!slotted(n->op)) continue;
    const int out = n->op >= SMELT_EPI_STORE;
    if (kind[n->slot] && (kind[n->slot] != (int)n->op + 1 || out)) {
      char msg[160];
      snprintf(msg, sizeof msg, "slot %d is already %s by node %d", n->slot, out ? "used" : "used otherwise",
               writer[n->slot]);
      return bad(i, n, msg);
    }
    kind[n->slot] = (int)n->op + 1;
    writer[n->slot] = i;
  }
  return SMELT_OK;
}

/* ---------------------------------------------------------------- against the description */

static int has_op(const smelt_epi_graph *g, smelt_epi_op op) {
  for (int i = 0; i < g->count; i++)
    if (g->node[i].op == op) return 1;
  return 0;
}

smelt_status smelt__epi_check_desc(const char *op, const smelt_epi_graph *g, const smelt_gemm_desc *d, int has_bias) {
  smelt_status s = smelt_epi_graph_check(g);
  if (s) return s;
  const smelt_gemm_epilogue *e = &d->epilogue;
  if (e->act != SMELT_ACT_IDENTITY || e->scale_d != 1.0f)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: desc.epilogue.act=%s and scale_d=%g must be identity and 1 with a graph (write them "
                        "as ACT and MUL nodes)",
                        op, smelt_act_name(e->act), (double)e->scale_d);
  if (has_op(g, SMELT_EPI_C) != (e->beta != 0.0))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: the graph has %s C node but desc.epilogue.beta=%g (C is read exactly when beta != 0)", op,
                        has_op(g, SMELT_EPI_C) ? "a" : "no", e->beta);
  if (has_op(g, SMELT_EPI_BIAS) != (has_bias != 0))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: the graph has %s BIAS node but bias is %s", op,
                        has_op(g, SMELT_EPI_BIAS) ? "a" : "no", has_bias ? "given" : "NULL");
  return SMELT_OK;
}

/* ---------------------------------------------------------------- the slots' tensors */

static const smelt_dtype in_types[] = {SMELT_DTYPE_F64, SMELT_DTYPE_F32, SMELT_DTYPE_F16,
                                       SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2};
static const smelt_dtype red_types[] = {SMELT_DTYPE_F32};

/* The node kind of each used slot (op + 1; 0 unused). */
static void slot_kinds(const smelt_epi_graph *g, int kind[SMELT_EPI_MAX_TENSORS]) {
  memset(kind, 0, SMELT_EPI_MAX_TENSORS * sizeof *kind);
  for (int i = 0; i < g->count; i++)
    if (slotted(g->node[i].op)) kind[g->node[i].slot] = (int)g->node[i].op + 1;
}

/* One slot's tensor against its kind: shape, dtype, strides. */
static smelt_status check_slot(const char *op, const smelt_ctx *ctx, int slot, smelt_epi_op k, const smelt_tensor *t,
                               const smelt__gemm_prob *p) {
  char name[32], sh[160];
  snprintf(name, sizeof name, "epi->t[%d]", slot);
  if (!t) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL but the graph's %s node uses it", op, name,
                              op_names[k]);
  const int red = k == SMELT_EPI_ROW_REDUCE || k == SMELT_EPI_COL_REDUCE;
  const smelt__role r = {name, 0, red ? red_types : in_types, red ? 1 : (int)(sizeof in_types / sizeof *in_types), 0};
  smelt_status s = smelt__check_role(op, &r, t, ctx);
  if (s) return s;
  const int mat = k == SMELT_EPI_AUX || k == SMELT_EPI_STORE;
  const int64_t len = k == SMELT_EPI_ROW || k == SMELT_EPI_ROW_REDUCE ? p->m : p->n;
  if (mat ? t->ndim != 2 || t->shape[0] != p->m || t->shape[1] != p->n : t->ndim != 1 || t->shape[0] != len) {
    if (mat)
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape=%s must be [M, N]=[%lld, %lld] (%s)", op, name,
                          smelt__shape_str(t, sh, sizeof sh), (long long)p->m, (long long)p->n, op_names[k]);
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape=%s must be [%s]=[%lld] (%s)", op, name,
                        smelt__shape_str(t, sh, sizeof sh), len == p->m && (k == SMELT_EPI_ROW || k == SMELT_EPI_ROW_REDUCE) ? "M" : "N",
                        (long long)len, op_names[k]);
  }
  /* Reductions are written whole by one pass over contiguous memory. */
  if (red && len > 1 && t->strides[0] != 1)
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[0]=%lld must be 1 (a reduction's output)", op, name,
                        (long long)t->strides[0]);
  if (k == SMELT_EPI_STORE || red) return smelt__check_output(op, name, t);
  return SMELT_OK;
}

static void bind_slot(smelt__epi_slots *e, int slot, smelt_epi_op k, const smelt_tensor *t) {
  e->dt[slot] = t->dtype;
  e->data[slot] = t->data;
  const int row = k == SMELT_EPI_ROW || k == SMELT_EPI_ROW_REDUCE, col = k == SMELT_EPI_COL || k == SMELT_EPI_COL_REDUCE;
  e->rs[slot] = col ? 0 : t->strides[0];
  e->cs[slot] = row ? 0 : col ? t->strides[0] : t->strides[1];
}

/* Outputs share no memory with the operands, the input slots or each other. */
static smelt_status check_slots_disjoint(const char *op, const int kind[], const smelt_epi_tensors *epi,
                                         const smelt_tensor *const *operands, int noperands) {
  for (int s = 0; s < SMELT_EPI_MAX_TENSORS; s++) {
    if (!kind[s] || kind[s] - 1 < SMELT_EPI_STORE) continue;
    char on[32], in[32];
    snprintf(on, sizeof on, "epi->t[%d]", s);
    for (int i = 0; i < noperands; i++) {
      if (!operands[i]) continue;
      snprintf(in, sizeof in, "operand %d of the GEMM", i);
      smelt_status st = smelt__check_disjoint(op, on, epi->t[s], i == 3 ? "D" : in, operands[i], 0);
      if (st) return st;
    }
    for (int o = 0; o < SMELT_EPI_MAX_TENSORS; o++) {
      if (o == s || !kind[o]) continue;
      snprintf(in, sizeof in, "epi->t[%d]", o);
      smelt_status st = smelt__check_disjoint(op, on, epi->t[s], in, epi->t[o], 0);
      if (st) return st;
    }
  }
  return SMELT_OK;
}

smelt_status smelt__epi_resolve(const char *op, const smelt_ctx *ctx, const smelt_epi_graph *g,
                                const smelt_epi_tensors *epi, const smelt_tensor *const *operands, int noperands,
                                smelt__gemm_prob *p, smelt_tensor *planned) {
  int kind[SMELT_EPI_MAX_TENSORS];
  slot_kinds(g, kind);
  int used = 0;
  for (int s = 0; s < SMELT_EPI_MAX_TENSORS; s++)
    if (kind[s]) used = s + 1;
  const int given = epi ? epi->count : 0;
  if (given < 0 || given > SMELT_EPI_MAX_TENSORS)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: epi->count=%d is not 0..%d", op, given,
                        SMELT_EPI_MAX_TENSORS);
  if (given < used)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: the graph uses slot %d but epi %s", op, used - 1,
                        epi ? "has fewer tensors" : "is NULL");
  for (int s = 0; s < given; s++)
    if (!kind[s] && epi->t[s])
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: epi->t[%d] is given but no node of the graph uses it",
                          op, s);
  memset(&p->epi, 0, sizeof p->epi);
  p->epi.count = used;
  for (int s = 0; s < used; s++) {
    if (!kind[s]) continue;
    smelt_status st = check_slot(op, ctx, s, (smelt_epi_op)(kind[s] - 1), epi->t[s], p);
    if (st) return st;
    bind_slot(&p->epi, s, (smelt_epi_op)(kind[s] - 1), epi->t[s]);
    if (planned) planned[s] = *epi->t[s];
  }
  return check_slots_disjoint(op, kind, epi, operands, noperands);
}

smelt_status smelt__epi_check_run(const char *op, const smelt_epi_graph *g, const smelt_tensor *planned,
                                  const smelt_epi_tensors *epi, const smelt_tensor *const *operands, int noperands,
                                  smelt__gemm_prob *p) {
  int kind[SMELT_EPI_MAX_TENSORS];
  slot_kinds(g, kind);
  for (int s = 0; s < SMELT_EPI_MAX_TENSORS; s++) {
    if (!kind[s]) continue;
    char name[32];
    snprintf(name, sizeof name, "epi->t[%d]", s);
    if (!epi || s >= epi->count || !epi->t[s])
      return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL but the plan's graph uses it", op, name);
    smelt_status st = smelt__check_tensor(op, name, epi->t[s]);
    if (st || (st = smelt__check_same_layout(op, name, &planned[s], epi->t[s]))) return st;
    p->epi.data[s] = epi->t[s]->data;
  }
  return check_slots_disjoint(op, kind, epi, operands, noperands);
}
