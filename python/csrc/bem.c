/* BEM from Python: one entry point, _smelt.bem(mode, scale, accumulate,
 * u_transposed, ins, extra, outs, ctx, stream), for the update (mode 0),
 * the backward (1), validation (2) and the benchmark (3) of smelt/bem.h.
 * smelt/_bem.py turns keywords into these arguments, so this layer only
 * converts.
 *
 *   ins      (x, v, codes, u, offsets, scales): smelt_bem_inputs in order,
 *            None where absent
 *   extra    update (); backward (dy,); validation (tolerance,);
 *            benchmark (warmup, iters)
 *   outs     backward (dx, dv, du, dcodes), the others (y,). Each None (not
 *            computed; y is required), True (allocated here: y [M, d_out] in
 *            x's dtype, a gradient like what it differentiates) or a tensor
 *            to write.
 *   u_transposed: u (and du) come as [.., r, d_out] and are read through
 *            their transposed view, the seed's pre-transposed layout.
 * Returns outs with the allocated tensors in place of True; validation
 * returns (y, check dict), the benchmark the timing dict.
 *
 * The update and the backward cache their plans in the context, as the ops
 * of ops.c do: the update is a memory-bound pass whose planning (checks,
 * kernel lookup) would otherwise cost about as much as its launch.
 * Validation and the benchmark plan per call (they copy to the host and
 * time many runs). */
#include "smelt_py.h"
#include "smelt/bem.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

enum { I_X, I_V, I_CODES, I_U, I_OFFSETS, I_SCALES, I_COUNT };
enum { G_DX, G_DV, G_DU, G_DCODES, G_COUNT };
enum { MODE_UPDATE, MODE_BACKWARD, MODE_VALIDATE, MODE_BENCHMARK };

/* The plan cache's op ids: past ops.c's enum, one for each direction. */
enum { KEY_OP_UPDATE = 1000, KEY_OP_BACKWARD };

static const char *const i_names[I_COUNT] = {"x", "v", "codes", "u", "offsets", "scales"};
static const char *const g_names[G_COUNT] = {"dx", "dv", "du", "dcodes"};
static const char *const op_names[4] = {"smelt.bem_update", "smelt.bem_backward", "smelt.bem_validate",
                                        "smelt.bem_benchmark"};
/* The input each gradient differentiates. */
static const int g_like[G_COUNT] = {I_X, I_V, I_U, I_CODES};

/* The C layer's names in its messages and the Python ones (NULL: the
 * function called). Whole names only; each may be followed by a field. */
static const char *const renames[][2] = {
    {"smelt_bem", NULL},      {"smelt_bem_run", NULL},        {"smelt_bem_backward", NULL},
    {"smelt_bem_backward_run", NULL}, {"smelt_bem_validate", NULL}, {"smelt_bem_benchmark", NULL},
    {"desc.scale", "scale"},  {"desc.accumulate", "accumulate"}, {"y", "out"},
    {"grads.dx", "dx"},       {"grads.dv", "dv"},             {"grads.du", "du"},
    {"grads.dcodes", "dcodes"},
};

static int word_char(char c) { return c == '_' || isalnum((unsigned char)c); }

/* Raises smelt's message for s in Python's names (op for the C entry point). */
static void raise_named(smelt_status s, const char *op) {
  const char *m = smelt_last_error();
  if (!m || !*m) m = smelt_status_string(s);
  char buf[1100];
  size_t used = 0;
  for (const char *p = m; *p && used + 1 < sizeof buf;) {
    size_t i = 0, len = 0;
    const int starts = p == m || (!word_char(p[-1]) && p[-1] != '.');
    for (; starts && i < sizeof renames / sizeof *renames; i++) {
      len = strlen(renames[i][0]);
      if (!strncmp(p, renames[i][0], len) && !word_char(p[len])) break;
    }
    if (starts && i < sizeof renames / sizeof *renames) {
      used += (size_t)snprintf(buf + used, sizeof buf - used, "%s", renames[i][1] ? renames[i][1] : op);
      p += len;
    } else {
      buf[used++] = *p++;
    }
    if (used >= sizeof buf) used = sizeof buf - 1;
  }
  buf[used] = 0;
  smpy_raise(s, "%s [%s]", buf, smelt_status_name(s));
}

/* Swaps the last two dims of t: u given [.., r, d_out] read as [.., d_out, r]. */
static void transpose_last(smelt_tensor *t) {
  if (t->ndim < 2) return;
  const int a = t->ndim - 2, b = t->ndim - 1;
  int64_t s = t->shape[a];
  t->shape[a] = t->shape[b];
  t->shape[b] = s;
  s = t->strides[a];
  t->strides[a] = t->strides[b];
  t->strides[b] = s;
}

/* What a cached BEM call binds: the direction, the description and t (x,
 * v, codes, u, offsets, scales, then y, or dy and the four gradients). */
typedef struct bem_call {
  int backward;
  const smelt_bem_desc *d;
  smelt_bem_inputs in;
  smelt_bem_grads g;
  const smelt_tensor *out; /* y, or dy */
} bem_call;

static smelt_status bem_plan(smelt_ctx *ctx, const void *arg, smelt_plan **plan) {
  const bem_call *b = (const bem_call *)arg;
  return b->backward ? smelt_bem_backward_plan(ctx, b->d, &b->in, b->out, &b->g, plan)
                     : smelt_bem_plan(ctx, b->d, &b->in, b->out, plan);
}

static smelt_status bem_run(smelt_plan *plan, const void *arg) {
  const bem_call *b = (const bem_call *)arg;
  return b->backward ? smelt_bem_backward_run(plan, &b->in, b->out, &b->g) : smelt_bem_run(plan, &b->in, b->out);
}

/* Plans (cached) and runs the update or the backward; t as bem_call's. */
static smelt_status run_cached(smpy_call *call, int backward, const smelt_bem_desc *d, const smelt_tensor *const *t) {
  smpy_ctx *c = call->ctx;
  const bem_call b = {backward, d, {t[I_X], t[I_V], t[I_CODES], t[I_U], t[I_OFFSETS], t[I_SCALES]},
                      {t[I_COUNT + 1], t[I_COUNT + 2], t[I_COUNT + 3], t[I_COUNT + 4]}, t[I_COUNT]};
  smpy_pkey key;
  memset(&key, 0, sizeof key);
  key.op = backward ? KEY_OP_BACKWARD : KEY_OP_UPDATE;
  key.deterministic = c->deterministic;
  key.f[0] = d->scale;
  key.i[0] = d->accumulate;
  key.ntensors = I_COUNT + (backward ? 1 + G_COUNT : 1);
  for (int i = 0; i < key.ntensors; i++) {
    if (t[i]) smpy_tkey_fill(&key.t[i], t[i]);
    else key.t[i].ndim = -1;
  }
  return smpy_cached_run(call, &key, bem_plan, bem_run, &b);
}

/* Validation or the benchmark (plan per call) into *result. */
static smelt_status run_check(smpy_call *call, int mode, const smelt_bem_desc *d, const smelt_tensor *const *t,
                              double tolerance, int warmup, int iters, PyObject **result) {
  smpy_ctx *c = call->ctx;
  const smelt_bem_inputs in = {t[I_X], t[I_V], t[I_CODES], t[I_U], t[I_OFFSETS], t[I_SCALES]};
  smelt_bem_check chk;
  smelt_bem_timing tm;
  smpy_ctx_lock(c);
  smelt_status s = smpy_ctx_use_stream(c, call->stream);
  if (!s) {
    PyThreadState *ts = PyEval_SaveThread();
    s = mode == MODE_VALIDATE ? smelt_bem_validate(c->ctx, d, &in, t[I_COUNT], tolerance, &chk)
                              : smelt_bem_benchmark(c->ctx, d, &in, t[I_COUNT], warmup, iters, &tm);
    PyEval_RestoreThread(ts);
  }
  smpy_ctx_unlock(c);
  if (s) return s;
  *result = mode == MODE_VALIDATE
                ? Py_BuildValue("{s:d,s:d,s:d,s:L,s:d,s:O}", "max_abs", chk.max_abs, "max_rel", chk.max_rel, "rel_l2",
                                chk.rel_l2, "worst", (long long)chk.worst, "tolerance", chk.tolerance, "passed",
                                chk.passed ? Py_True : Py_False)
                : Py_BuildValue("{s:d,s:d,s:d,s:d,s:d,s:d}", "fused_ms", tm.fused_ms, "unfused_ms", tm.unfused_ms,
                                "speedup", tm.speedup, "base_ms", tm.base_ms, "overhead_pct", tm.overhead_pct,
                                "fused_gbps", tm.fused_gbps);
  return SMELT_OK;
}

/* mode's extra arguments: dy's object, the tolerance, or warmup and iters. */
static int parse_extra(int mode, PyObject *extra, PyObject **dy, double *tolerance, int *warmup, int *iters) {
  static const Py_ssize_t sizes[4] = {0, 1, 1, 2};
  if (!PyTuple_Check(extra) || PyTuple_Size(extra) != sizes[mode]) {
    PyErr_Format(PyExc_TypeError, "_smelt.bem: extra must be a tuple of %zd for mode %d", sizes[mode], mode);
    return -1;
  }
  if (mode == MODE_BACKWARD) *dy = PyTuple_GetItem(extra, 0);
  if (mode == MODE_VALIDATE) {
    *tolerance = PyFloat_AsDouble(PyTuple_GetItem(extra, 0));
    if (*tolerance == -1.0 && PyErr_Occurred()) return -1;
  }
  if (mode == MODE_BENCHMARK && !PyArg_ParseTuple(extra, "ii:bem_benchmark", warmup, iters)) return -1;
  return 0;
}

static PyObject *py_bem(PyObject *self, PyObject *args) {
  int mode, accumulate, u_t, warmup = 0, iters = 0;
  double scale, tolerance = 0;
  PyObject *ins, *extra, *outs, *ctx, *stream, *dyo = NULL;
  if (!PyArg_ParseTuple(args, "idipOOOOO:bem", &mode, &scale, &accumulate, &u_t, &ins, &extra, &outs, &ctx, &stream))
    return NULL;
  if (mode < MODE_UPDATE || mode > MODE_BENCHMARK) {
    PyErr_Format(PyExc_ValueError, "_smelt.bem: mode=%d is not 0, 1, 2 or 3", mode);
    return NULL;
  }
  const Py_ssize_t nouts = mode == MODE_BACKWARD ? G_COUNT : 1;
  if (!PyTuple_Check(ins) || PyTuple_Size(ins) != I_COUNT || !PyTuple_Check(outs) || PyTuple_Size(outs) != nouts) {
    PyErr_Format(PyExc_TypeError, "_smelt.bem: ins and outs must be tuples of %d and %zd", I_COUNT, nouts);
    return NULL;
  }
  if (parse_extra(mode, extra, &dyo, &tolerance, &warmup, &iters) < 0) return NULL;
  const char *op = op_names[mode];
  smelt_bem_desc desc = smelt_bem_desc_default();
  desc.scale = scale;
  desc.accumulate = accumulate;
  smpy_call call;
  PyObject *slots[G_COUNT] = {NULL}, *result = NULL, *info = NULL;
  /* ins, then y, or dy and the gradients (run_cached's order). */
  smelt_tensor *t[I_COUNT + 1 + G_COUNT] = {NULL};
  if (smpy_call_begin(&call, op, ctx, stream) < 0) return NULL;
  for (int i = 0; i < I_COUNT; i++) {
    PyObject *o = PyTuple_GetItem(ins, i);
    if ((i <= I_U || o != Py_None) && smpy_call_import(&call, o, i_names[i], 0, &t[i]) < 0) goto done;
  }
  if (u_t) transpose_last(t[I_U]);
  if (mode == MODE_BACKWARD && smpy_call_import(&call, dyo, "dy", 0, &t[I_COUNT]) < 0) goto done;
  for (int i = 0; i < nouts; i++) {
    PyObject *given = PyTuple_GetItem(outs, i);
    const smelt_tensor *x = t[I_X], *u = t[I_U];
    int64_t shape[SMELT_MAX_DIMS] = {x->ndim >= 1 ? x->shape[0] : 0, u->ndim >= 2 ? u->shape[u->ndim - 2] : 0};
    int nd = 2;
    const char *name = "out";
    smelt_tensor **slot = &t[I_COUNT + (mode == MODE_BACKWARD) + i];
    if (mode == MODE_BACKWARD) {
      /* A gradient has the shape of what it differentiates, as given. */
      smelt_tensor like = *t[g_like[i]];
      if (g_like[i] == I_U && u_t) transpose_last(&like);
      nd = like.ndim;
      for (int j = 0; j < nd; j++) shape[j] = like.shape[j];
      name = g_names[i];
    } else if (given == Py_None) {
      smpy_raise(SMELT_STATUS_NULL_POINTER, "%s: out is None", op);
      goto done;
    }
    if (smpy_out_arg(&call, given, name, t[I_X]->dtype, nd, shape, &slots[i], slot) < 0) goto done;
    if (mode == MODE_BACKWARD && i == G_DU && u_t && *slot) transpose_last(*slot);
  }
  smelt_status s = mode <= MODE_BACKWARD
                       ? run_cached(&call, mode, &desc, (const smelt_tensor *const *)t)
                       : run_check(&call, mode, &desc, (const smelt_tensor *const *)t, tolerance, warmup, iters, &info);
  if (s) {
    raise_named(s, op);
    goto done;
  }
  if (mode >= MODE_VALIDATE && !info) goto done; /* the dict could not be made */
  if (mode == MODE_BENCHMARK) {
    result = info;
    info = NULL;
  } else {
    result = mode == MODE_VALIDATE   ? PyTuple_Pack(2, slots[0], info)
             : mode == MODE_BACKWARD ? PyTuple_Pack(G_COUNT, slots[G_DX], slots[G_DV], slots[G_DU], slots[G_DCODES])
                                     : PyTuple_Pack(1, slots[0]);
  }
done:
  smpy_call_end(&call);
  for (int i = 0; i < G_COUNT; i++) Py_XDECREF(slots[i]);
  Py_XDECREF(info);
  return result;
}

PyMethodDef smpy_bem_methods[] = {
    {"bem", py_bem, METH_VARARGS,
     "bem(mode, scale, accumulate, u_transposed, ins, extra, outs, ctx, stream) -> outs, (y, check) or timing "
     "(0 update, 1 backward, 2 validate, 3 benchmark)"},
    {NULL, NULL, 0, NULL}};
