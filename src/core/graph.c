/* smelt graphs (smelt/graph.h): the graph as the caller builds it. Each
 * tensor and op is checked as it is added, against what is already
 * declared (ids, shapes, dtypes, one writer per tensor), so a mistake is
 * reported where it was made; a failed op leaves the graph broken and
 * smelt_graph_plan repeats its message. Planning and running live in
 * graph_plan.c and graph_run.c. */
#include "graph_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const kind_names[SMELT__GOP_COUNT] = {"gemm",     "bias",   "act",       "binary", "residual_add",
                                                         "norm",     "rotary", "attention", "softmax"};
static const char *const binop_names[SMELT_GRAPH_BINOP_COUNT] = {"add", "sub", "mul", "div", "max", "min"};

const char *smelt_graph_binop_name(smelt_graph_binop op) {
  return (unsigned)op < SMELT_GRAPH_BINOP_COUNT ? binop_names[op] : "?";
}

const char *smelt__graph_kind_name(smelt__graph_okind k) { return kind_names[k]; }

void smelt_graph_destroy(smelt_graph *g) {
  if (!g) return;
  smelt__graph_unplan(g);
  free(g->tensors);
  free(g->ops);
  free(g->describe);
  free(g);
}

int smelt__graph_elementwise(smelt__graph_okind k) {
  return k == SMELT__GOP_BIAS || k == SMELT__GOP_ACT || k == SMELT__GOP_BINARY || k == SMELT__GOP_RESIDUAL;
}

int smelt__graph_op_reads(const smelt__graph_op *o, int t) {
  for (int i = 0; i < SMELT__GRAPH_MAX_IN; i++)
    if (o->in[i] == t) return 1;
  return 0;
}

const char *smelt__graph_op_label(const smelt_graph *g, int op, char *buf, size_t n) {
  const smelt__graph_op *o = &g->ops[op];
  if (o->kind == SMELT__GOP_ACT)
    snprintf(buf, n, "op %d (act %s)", op, smelt_act_name(o->p.act.act));
  else if (o->kind == SMELT__GOP_BINARY)
    snprintf(buf, n, "op %d (%s)", op, smelt_graph_binop_name(o->p.bin));
  else
    snprintf(buf, n, "op %d (%s)", op, kind_names[o->kind]);
  return buf;
}

smelt_status smelt_graph_create(smelt_ctx *ctx, smelt_graph **out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_graph_create: out is NULL");
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_graph_create: ctx is NULL");
  smelt_graph *g = (smelt_graph *)calloc(1, sizeof *g);
  if (g) g->describe = (char *)calloc(1, 1);
  if (!g || !g->describe) {
    free(g);
    return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_graph_create: out of host memory");
  }
  g->ctx = ctx;
  *out = g;
  return SMELT_OK;
}

/* ---------------------------------------------------------------- tensors */

/* Room for one more element of an array of `size`-byte items. */
static smelt_status grow(void **arr, int n, int *cap, size_t size, const char *op) {
  if (n < *cap) return SMELT_OK;
  const int want = *cap ? 2 * *cap : 8;
  void *p = realloc(*arr, (size_t)want * size);
  if (!p) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  *arr = p;
  *cap = want;
  return SMELT_OK;
}

static smelt_status check_name(const smelt_graph *g, const char *op, const char *name) {
  if (!name) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: name is NULL", op);
  const size_t len = strlen(name);
  if (len < 1 || len >= SMELT__GRAPH_NAME)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: name \"%.40s\" must have 1..%d characters", op, name,
                        SMELT__GRAPH_NAME - 1);
  for (int i = 0; i < g->ntensors; i++)
    if (!strcmp(g->tensors[i].name, name))
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: a tensor named \"%s\" exists already (tensor %d)", op,
                          name, i);
  return SMELT_OK;
}

static smelt_status add_tensor(smelt_graph *g, const char *op, const char *name, smelt__graph_tkind kind,
                               const smelt_tensor *view, int *id) {
  smelt_status s = grow((void **)&g->tensors, g->ntensors, &g->cap_tensors, sizeof *g->tensors, op);
  if (s) return s;
  smelt__graph_unplan(g); /* a plan covers the graph it was made for */
  smelt__graph_tensor *t = &g->tensors[g->ntensors];
  memset(t, 0, sizeof *t);
  snprintf(t->name, sizeof t->name, "%s", name);
  t->kind = kind;
  t->view = *view;
  t->producer = -1;
  *id = g->ntensors++;
  return SMELT_OK;
}

static smelt_status begin_tensor(smelt_graph *g, const char *op, const char *name, const int *id) {
  if (!g) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: the graph is NULL", op);
  if (!id) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: id is NULL", op);
  return check_name(g, op, name);
}

static smelt_status declare(smelt_graph *g, const char *op, const char *name, smelt__graph_tkind kind,
                            const smelt_tensor *view, int *id) {
  smelt_status s = begin_tensor(g, op, name, id);
  if (s) return s;
  if (!view) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: view of \"%s\" is NULL", op, name);
  if ((s = smelt__check_tensor(op, name, view)) || (s = smelt__check_device(op, name, view, g->ctx))) return s;
  if (kind == SMELT__GT_OUTPUT && (s = smelt__check_output(op, name, view))) return s;
  return add_tensor(g, op, name, kind, view, id);
}

smelt_status smelt_graph_input(smelt_graph *g, const char *name, const smelt_tensor *view, int *id) {
  return declare(g, "smelt_graph_input", name, SMELT__GT_INPUT, view, id);
}

smelt_status smelt_graph_output(smelt_graph *g, const char *name, const smelt_tensor *view, int *id) {
  return declare(g, "smelt_graph_output", name, SMELT__GT_OUTPUT, view, id);
}

smelt_status smelt_graph_tensor(smelt_graph *g, const char *name, smelt_dtype dtype, int ndim, const int64_t *shape,
                                int *id) {
  const char *op = "smelt_graph_tensor";
  smelt_status s = begin_tensor(g, op, name, id);
  if (s) return s;
  if (ndim < 0 || ndim > SMELT_MAX_DIMS)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: \"%s\": ndim=%d is not 0..%d", op, name, ndim,
                        SMELT_MAX_DIMS);
  if (ndim && !shape) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: \"%s\": shape is NULL", op, name);
  if ((unsigned)dtype >= SMELT_DTYPE_COUNT)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: \"%s\": dtype=%d is not a smelt_dtype", op, name, (int)dtype);
  smelt_tensor v = smelt_tensor_make(NULL, dtype, smelt_ctx_device(g->ctx), smelt_ctx_device_index(g->ctx), ndim,
                                     shape);
  /* Its size must be sayable in bytes; the data comes at plan time. */
  const int64_t numel = smelt_tensor_numel(&v);
  if (numel < 0 || (uint64_t)numel > (uint64_t)INT64_MAX / smelt_dtype_size(dtype))
    return smelt__error(SMELT_STATUS_OVERFLOW, "%s: \"%s\": the shape's size does not fit in int64", op, name);
  return add_tensor(g, op, name, SMELT__GT_INTER, &v, id);
}

/* ---------------------------------------------------------------- op checks */

/* The op being added, for messages. */
typedef struct adding {
  smelt_graph *g;
  const char *op; /* "smelt_graph_act" */
} adding;

static const smelt_tensor *view_of(const adding *a, int id) { return &a->g->tensors[id].view; }
static const char *name_of(const adding *a, int id) { return a->g->tensors[id].name; }

static smelt_status check_id(const adding *a, const char *role, int id, int optional) {
  if (optional && id == -1) return SMELT_OK;
  if (id < 0 || id >= a->g->ntensors)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s=%d is not a tensor of the graph (0..%d%s)", a->op,
                        role, id, a->g->ntensors - 1, optional ? ", or -1: none" : "");
  return SMELT_OK;
}

static smelt_status check_shape_as(const adding *a, const char *role, int id, const char *as_role, int as) {
  const smelt_tensor *t = view_of(a, id), *u = view_of(a, as);
  int same = t->ndim == u->ndim;
  for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == u->shape[d];
  if (same) return SMELT_OK;
  char ts[160], us[160];
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s \"%s\" is %s but must have the shape of %s \"%s\", %s",
                      a->op, role, name_of(a, id), smelt__shape_str(t, ts, sizeof ts), as_role, name_of(a, as),
                      smelt__shape_str(u, us, sizeof us));
}

static smelt_status check_dtype_as(const adding *a, const char *role, int id, const char *as_role, int as) {
  if (view_of(a, id)->dtype == view_of(a, as)->dtype) return SMELT_OK;
  return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s \"%s\" is %s but must have the dtype of %s \"%s\", %s",
                      a->op, role, name_of(a, id), smelt_dtype_name(view_of(a, id)->dtype), as_role, name_of(a, as),
                      smelt_dtype_name(view_of(a, as)->dtype));
}

static smelt_status check_like(const adding *a, const char *role, int id, const char *as_role, int as) {
  smelt_status s = check_shape_as(a, role, id, as_role, as);
  return s ? s : check_dtype_as(a, role, id, as_role, as);
}

static smelt_status check_float(const adding *a, const char *role, int id) {
  const smelt_dtype dt = view_of(a, id)->dtype;
  if (dt == SMELT_DTYPE_F32 || dt == SMELT_DTYPE_F16 || dt == SMELT_DTYPE_BF16) return SMELT_OK;
  return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s \"%s\" is %s (supported: f32, f16, bf16)", a->op, role,
                      name_of(a, id), smelt_dtype_name(dt));
}

static smelt_status check_ndim(const adding *a, const char *role, int id, int ndim, const char *what) {
  char sh[160];
  if (view_of(a, id)->ndim == ndim) return SMELT_OK;
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s \"%s\" is %s but must be %s", a->op, role, name_of(a, id),
                      smelt__shape_str(view_of(a, id), sh, sizeof sh), what);
}

static smelt_status check_dim(const adding *a, const char *role, int id, int d, int64_t want, const char *what) {
  const int64_t got = view_of(a, id)->shape[d];
  if (got == want) return SMELT_OK;
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s \"%s\".shape[%d]=%lld must equal %s=%lld", a->op, role,
                      name_of(a, id), d, (long long)got, what, (long long)want);
}

/* ---------------------------------------------------------------- adding an op */

static smelt_status begin_op(smelt_graph *g, const char *op) {
  if (!g) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: the graph is NULL", op);
  return SMELT_OK;
}

/* The op's failure breaks the graph (its first one is kept for the plan). */
static smelt_status fail(smelt_graph *g, smelt_status s) {
  if (s && g && !g->broken) {
    g->broken = s;
    snprintf(g->broken_msg, sizeof g->broken_msg, "%s", smelt_last_error());
  }
  return s;
}

/* The output's checks, then the op joins the graph. */
static smelt_status add_op(const adding *a, smelt__graph_op *o) {
  smelt_graph *g = a->g;
  smelt_status s = check_id(a, "the output", o->out, 0);
  if (s) return s;
  smelt__graph_tensor *t = &g->tensors[o->out];
  char lbl[64];
  if (t->kind == SMELT__GT_INPUT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: the output \"%s\" is an input of the graph; an op writes an output or an intermediate",
                        a->op, t->name);
  if (t->producer >= 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: \"%s\" is written already, by %s", a->op, t->name,
                        smelt__graph_op_label(g, t->producer, lbl, sizeof lbl));
  if (smelt__graph_op_reads(o, o->out))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: \"%s\" is both read and written by the op", a->op,
                        t->name);
  if ((s = grow((void **)&g->ops, g->nops, &g->cap_ops, sizeof *g->ops, a->op))) return s;
  smelt__graph_unplan(g);
  o->group = -1;
  t->producer = g->nops;
  for (int i = 0; i < SMELT__GRAPH_MAX_IN; i++) {
    int first = o->in[i] >= 0;
    for (int j = 0; j < i && first; j++) first = o->in[j] != o->in[i];
    if (first) g->tensors[o->in[i]].readers++;
  }
  g->ops[g->nops++] = *o;
  return SMELT_OK;
}

static smelt__graph_op new_op(smelt__graph_okind kind, int out) {
  smelt__graph_op o;
  memset(&o, 0, sizeof o);
  o.kind = kind;
  o.out = out;
  for (int i = 0; i < SMELT__GRAPH_MAX_IN; i++) o.in[i] = -1;
  return o;
}

/* Each role's id names a tensor of the graph (or is -1 where optional). */
static smelt_status check_ids(const adding *a, int n, const char *const *roles, const int *ids, const int *optional) {
  for (int i = 0; i < n; i++) {
    smelt_status s = check_id(a, roles[i], ids[i], optional ? optional[i] : 0);
    if (s) return s;
  }
  return SMELT_OK;
}

static smelt_status check_gemm_desc(const adding *a, const smelt_gemm_desc *d) {
  const smelt_gemm_epilogue *e = &d->epilogue;
  if (e->beta != 0.0 || e->act != SMELT_ACT_IDENTITY || e->graph || e->scale_d != 1.0f)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: desc.epilogue must be the default but for alpha and clamp (beta %g, act %s, scale_d %g, "
                        "graph %s): bias, activation and residual are graph ops of their own",
                        a->op, e->beta, smelt_act_name(e->act), (double)e->scale_d, e->graph ? "set" : "NULL");
  if ((d->mode != SMELT_GEMM_MODE_AUTO && d->mode != SMELT_GEMM_MODE_PLAIN) || d->split_k > 1 ||
      d->scales != SMELT_GEMM_SCALES_VECTOR)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        "%s: desc.mode=%d, split_k=%d, scales=%d: a graph's GEMM is plain (mode AUTO or PLAIN, "
                        "split_k 0 or 1, no block scales)",
                        a->op, (int)d->mode, d->split_k, (int)d->scales);
  return SMELT_OK;
}

smelt_status smelt_graph_gemm(smelt_graph *g, const smelt_gemm_desc *desc, int a_, int b, int d) {
  const adding a = {g, "smelt_graph_gemm"};
  smelt_status s = begin_op(g, a.op);
  if (s) return s;
  static const char *const roles[] = {"a", "b", "d"};
  const int ids[] = {a_, b, d};
  const smelt_gemm_desc dd = desc ? *desc : smelt_gemm_desc_default();
  if ((s = check_ids(&a, 3, roles, ids, NULL)) || (s = check_gemm_desc(&a, &dd)) ||
      (s = check_ndim(&a, "a", a_, 2, "[M, K]")) || (s = check_ndim(&a, "b", b, 2, "[K, N]")) ||
      (s = check_ndim(&a, "d", d, 2, "[M, N]")) || (s = check_dim(&a, "b", b, 0, view_of(&a, a_)->shape[1], "K")) ||
      (s = check_dim(&a, "d", d, 0, view_of(&a, a_)->shape[0], "M")) ||
      (s = check_dim(&a, "d", d, 1, view_of(&a, b)->shape[1], "N")))
    return fail(g, s);
  smelt__graph_op o = new_op(SMELT__GOP_GEMM, d);
  o.in[0] = a_, o.in[1] = b;
  o.p.gemm = dd;
  return fail(g, add_op(&a, &o));
}

smelt_status smelt_graph_bias(smelt_graph *g, int x, int bias, int y) {
  const adding a = {g, "smelt_graph_bias"};
  smelt_status s = begin_op(g, a.op);
  if (s) return s;
  static const char *const roles[] = {"x", "bias", "y"};
  const int ids[] = {x, bias, y};
  if ((s = check_ids(&a, 3, roles, ids, NULL)) || (s = check_ndim(&a, "x", x, 2, "[M, N]")) ||
      (s = check_float(&a, "x", x)) || (s = check_like(&a, "y", y, "x", x)) ||
      (s = check_ndim(&a, "bias", bias, 1, "[N]")) || (s = check_float(&a, "bias", bias)) ||
      (s = check_dim(&a, "bias", bias, 0, view_of(&a, x)->shape[1], "N")))
    return fail(g, s);
  smelt__graph_op o = new_op(SMELT__GOP_BIAS, y);
  o.in[0] = x, o.in[1] = bias;
  return fail(g, add_op(&a, &o));
}

smelt_status smelt_graph_act(smelt_graph *g, smelt_act act, float slope, int x, int y) {
  const adding a = {g, "smelt_graph_act"};
  smelt_status s = begin_op(g, a.op);
  if (s) return s;
  static const char *const roles[] = {"x", "y"};
  const int ids[] = {x, y};
  if ((unsigned)act >= SMELT_ACT_COUNT)
    s = smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: act=%d is not a smelt_act (0..%d)", a.op, (int)act,
                     SMELT_ACT_COUNT - 1);
  if (s || (s = check_ids(&a, 2, roles, ids, NULL)) || (s = check_float(&a, "x", x)) ||
      (s = check_like(&a, "y", y, "x", x)))
    return fail(g, s);
  smelt__graph_op o = new_op(SMELT__GOP_ACT, y);
  o.in[0] = x;
  o.p.act.act = act;
  o.p.act.slope = act == SMELT_ACT_LEAKY_RELU ? slope : 0.0f;
  return fail(g, add_op(&a, &o));
}

static smelt_status add_binary(const adding *a, smelt__graph_okind kind, smelt_graph_binop bop, int x, int r, int y,
                               const char *xn, const char *rn) {
  smelt_status s = begin_op(a->g, a->op);
  if (s) return s;
  const char *const roles[] = {xn, rn, "y"};
  const int ids[] = {x, r, y};
  if ((unsigned)bop >= SMELT_GRAPH_BINOP_COUNT)
    s = smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: op=%d is not a smelt_graph_binop (0..%d)", a->op, (int)bop,
                     SMELT_GRAPH_BINOP_COUNT - 1);
  if (s || (s = check_ids(a, 3, roles, ids, NULL)) || (s = check_float(a, xn, x)) ||
      (s = check_like(a, rn, r, xn, x)) || (s = check_like(a, "y", y, xn, x)))
    return fail(a->g, s);
  smelt__graph_op o = new_op(kind, y);
  o.in[0] = x, o.in[1] = r;
  o.p.bin = bop;
  return fail(a->g, add_op(a, &o));
}

smelt_status smelt_graph_binary(smelt_graph *g, smelt_graph_binop op, int a_, int b, int y) {
  const adding a = {g, "smelt_graph_binary"};
  return add_binary(&a, SMELT__GOP_BINARY, op, a_, b, y, "a", "b");
}

smelt_status smelt_graph_residual_add(smelt_graph *g, int x, int residual, int y) {
  const adding a = {g, "smelt_graph_residual_add"};
  return add_binary(&a, SMELT__GOP_RESIDUAL, SMELT_GRAPH_ADD, x, residual, y, "x", "residual");
}

smelt_status smelt_graph_norm(smelt_graph *g, const smelt_norm_desc *desc, int x, int weight, int bias, int y) {
  const adding a = {g, "smelt_graph_norm"};
  smelt_status s = begin_op(g, a.op);
  if (s) return s;
  static const char *const roles[] = {"x", "weight", "bias", "y"};
  static const int optional[] = {0, 1, 1, 0};
  const int ids[] = {x, weight, bias, y};
  if (!desc) s = smelt__error(SMELT_STATUS_NULL_POINTER, "%s: desc is NULL", a.op);
  if (s || (s = check_ids(&a, 4, roles, ids, optional)) || (s = check_float(&a, "x", x)) ||
      (s = check_like(&a, "y", y, "x", x)))
    return fail(g, s);
  const smelt_tensor *xv = view_of(&a, x);
  if (xv->ndim < 1) s = check_ndim(&a, "x", x, 1, "[..., C]");
  const int64_t C = xv->ndim ? xv->shape[xv->ndim - 1] : 0;
  for (int i = 1; i < 3 && !s; i++)
    if (ids[i] >= 0 && !(s = check_ndim(&a, roles[i], ids[i], 1, "[C]"))) s = check_dim(&a, roles[i], ids[i], 0, C, "C");
  if (s) return fail(g, s);
  smelt__graph_op o = new_op(SMELT__GOP_NORM, y);
  o.in[0] = x, o.in[1] = weight, o.in[2] = bias;
  o.p.norm = *desc;
  return fail(g, add_op(&a, &o));
}

smelt_status smelt_graph_rotary(smelt_graph *g, const smelt_rotary_desc *desc, int x, int cos, int sin,
                                int positions, int y) {
  const adding a = {g, "smelt_graph_rotary"};
  smelt_status s = begin_op(g, a.op);
  if (s) return s;
  static const char *const roles[] = {"x", "cos", "sin", "positions", "y"};
  static const int optional[] = {0, 0, 0, 1, 0};
  const int ids[] = {x, cos, sin, positions, y};
  if (!desc) s = smelt__error(SMELT_STATUS_NULL_POINTER, "%s: desc is NULL", a.op);
  if (s || (s = check_ids(&a, 5, roles, ids, optional)) || (s = check_ndim(&a, "x", x, 4, "[B, S, H, D]")) ||
      (s = check_float(&a, "x", x)) || (s = check_like(&a, "y", y, "x", x)))
    return fail(g, s);
  smelt__graph_op o = new_op(SMELT__GOP_ROTARY, y);
  o.in[0] = x, o.in[1] = cos, o.in[2] = sin, o.in[3] = positions;
  o.p.rotary = *desc;
  return fail(g, add_op(&a, &o));
}

smelt_status smelt_graph_attention(smelt_graph *g, const smelt_attention_desc *desc, int q, int k, int v, int o_) {
  const adding a = {g, "smelt_graph_attention"};
  smelt_status s = begin_op(g, a.op);
  if (s) return s;
  static const char *const roles[] = {"q", "k", "v", "o"};
  const int ids[] = {q, k, v, o_};
  const smelt_attention_desc dd = desc ? *desc : smelt_attention_desc_default();
  if (dd.alibi_slopes || dd.sinks || dd.dsinks)
    s = smelt__error(SMELT_STATUS_UNSUPPORTED,
                     "%s: desc.alibi_slopes, sinks and dsinks must be NULL in a graph (its plans keep no tensors "
                     "of their own)",
                     a.op);
  if (s || (s = check_ids(&a, 4, roles, ids, NULL)) || (s = check_ndim(&a, "q", q, 4, "[B, Sq, H, D]")) ||
      (s = check_ndim(&a, "k", k, 4, "[B, Sk, Hk, D]")) || (s = check_dtype_as(&a, "k", k, "q", q)) ||
      (s = check_like(&a, "v", v, "k", k)) || (s = check_like(&a, "o", o_, "q", q)))
    return fail(g, s);
  smelt__graph_op o = new_op(SMELT__GOP_ATTENTION, o_);
  o.in[0] = q, o.in[1] = k, o.in[2] = v;
  o.p.attention = dd;
  return fail(g, add_op(&a, &o));
}

smelt_status smelt_graph_softmax(smelt_graph *g, int x, int y) {
  const adding a = {g, "smelt_graph_softmax"};
  smelt_status s = begin_op(g, a.op);
  if (s) return s;
  static const char *const roles[] = {"x", "y"};
  const int ids[] = {x, y};
  if ((s = check_ids(&a, 2, roles, ids, NULL)) || (s = check_float(&a, "x", x)) ||
      (s = check_like(&a, "y", y, "x", x)))
    return fail(g, s);
  smelt__graph_op o = new_op(SMELT__GOP_SOFTMAX, y);
  o.in[0] = x;
  return fail(g, add_op(&a, &o));
}
