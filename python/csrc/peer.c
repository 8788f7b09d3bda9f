/* PEER from Python: one entry point, _smelt.peer(mode, cfg, x, weights,
 * extra, outs, ctx, stream), for retrieval (mode 0), forward (1) and
 * backward (2). smelt/__init__.py fills cfg from the tensors' shapes and the
 * keyword arguments, so this layer only converts.
 *
 *   cfg      dict with every smelt_peer_config field by name (activation,
 *            query_norm and gate as names), and cfg.kernels's as route,
 *            expert_kernel, overlap, projection (names) and head_groups;
 *            unknown keys are errors
 *   weights  (wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sub_key_0..3, u, v,
 *            store), None where absent; store a smelt.PeerStore in place of
 *            u and v, used on its own context
 *   extra    () or, for the backward, (ids, dy)
 *   outs     retrieval (ids, scores); forward (y, ids, scores); backward
 *            (dx, dwq, dbq, dnorm_weight, dnorm_bias, dsub_key_0..3, du, dv,
 *            grad_ids, grad_count, du_rows, dv_rows).
 *            Each None (not computed), True (allocated here: ids [T, h, k]
 *            i64, scores [T, h, k] f32, y [T, d_out] in x's dtype, a dense
 *            gradient like what it differentiates, the sparse expert
 *            gradients as smelt/peer.h shapes them: grad_ids [T·h·k] and
 *            grad_count [1] i64, du_rows and dv_rows [T·h·k, ...] in u's and
 *            v's dtype) or a tensor to write. The sparse outputs are passed
 *            through whole; trimming them to the M distinct experts is the
 *            Python layer's choice (it takes a host sync).
 * Returns outs with the allocated tensors in place of True.
 *
 * PEER plans are made per call (plan, run, destroy), not cached: a PEER call
 * moves megabytes of expert rows, next to which planning is small, and the
 * configuration does not fit the op plan cache's key. */
#include "smelt_py.h"
#include "smelt/peer.h"

#include <string.h>

enum { W_WQ, W_BQ, W_NW, W_NB, W_BM, W_BV, W_SK0, W_U = W_SK0 + SMELT_PEER_MAX_DIMS, W_V, W_COUNT };
enum {
  G_DX, G_DWQ, G_DBQ, G_DNW, G_DNB, G_DSK0, G_DU = G_DSK0 + SMELT_PEER_MAX_DIMS, G_DV,
  G_IDS, G_CNT, G_DUR, G_DVR, /* the sparse expert gradients */
  G_COUNT
};

static const char *const w_names[W_COUNT] = {"wq",        "bq",        "norm_weight", "norm_bias",
                                             "bn_mean",   "bn_var",    "sub_keys[0]", "sub_keys[1]",
                                             "sub_keys[2]", "sub_keys[3]", "u",         "v"};
static const char *const g_names[G_COUNT] = {"dx",           "dwq",          "dbq",          "dnorm_weight",
                                             "dnorm_bias",   "dsub_keys[0]", "dsub_keys[1]", "dsub_keys[2]",
                                             "dsub_keys[3]", "du",           "dv",           "grad_ids",
                                             "grad_count",   "du_rows",      "dv_rows"};

/* What each gradient differentiates, or whose dtype its rows have (-1: dx,
 * whose model is x, and grad_ids and grad_count, which are i64). */
static const int g_like[G_COUNT] = {-1,        W_WQ,      W_BQ,      W_NW, W_NB, W_SK0, W_SK0 + 1, W_SK0 + 2,
                                    W_SK0 + 3, W_U,       W_V,       -1,   -1,   W_U,   W_V};

/* ---- cfg */

static int enum_of(PyObject *v, const char *field, const char *const *names, int n, int *out) {
  if (PyUnicode_Check(v))
    for (int i = 0; i < n; i++)
      if (names[i] && !PyUnicode_CompareWithASCIIString(v, names[i])) {
        *out = i;
        return 0;
      }
  PyObject *r = PyObject_Repr(v);
  PyObject *b = r ? PyUnicode_AsUTF8String(r) : NULL;
  char list[160] = "";
  size_t used = 0;
  for (int i = 0; i < n; i++)
    if (names[i]) used += (size_t)snprintf(list + used, sizeof list - used, "%s'%s'", used ? ", " : "", names[i]);
  smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.peer: %s=%s is not one of %s", field, b ? PyBytes_AsString(b) : "?",
             list);
  Py_XDECREF(r);
  Py_XDECREF(b);
  return -1;
}

static int int_of(PyObject *v, const char *field, long long *out) {
  if (!PyLong_Check(v)) {
    PyErr_Format(PyExc_TypeError, "smelt.peer: %s must be an int, got %R", field, (PyObject *)Py_TYPE(v));
    return -1;
  }
  *out = PyLong_AsLongLong(v);
  return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int parse_cfg(PyObject *d, smelt_peer_config *c) {
  static const char *const acts[SMELT_ACT_COUNT] = {[SMELT_ACT_GELU] = "gelu", [SMELT_ACT_RELU] = "relu"};
  static const char *const norms[] = {"none", "layernorm", "batchnorm", "l2"};
  static const char *const gates[] = {"softmax", "sigmoid", "relu"};
  static const char *const routes[] = {"auto", "reg", "wg"};
  static const char *const experts[] = {"auto", "bulk", "warp", "rows"};
  static const char *const overlaps[] = {"auto", "beside", "after"};
  static const char *const projections[] = {"auto", "fused", "gemm"};
  if (!PyDict_Check(d)) {
    PyErr_SetString(PyExc_TypeError, "smelt.peer: cfg must be a dict");
    return -1;
  }
  *c = smelt_peer_config_default();
  PyObject *key, *v;
  Py_ssize_t pos = 0;
  while (PyDict_Next(d, &pos, &key, &v)) {
    PyObject *kb = PyUnicode_Check(key) ? PyUnicode_AsUTF8String(key) : NULL;
    if (!kb) {
      PyErr_Clear();
      PyErr_SetString(PyExc_TypeError, "smelt.peer: cfg keys must be str");
      return -1;
    }
    const char *k = PyBytes_AsString(kb);
    long long iv = 0;
    int e = 0, rc = 0;
    if (!strcmp(k, "input_dim")) rc = int_of(v, k, &iv), c->input_dim = iv;
    else if (!strcmp(k, "output_dim")) rc = int_of(v, k, &iv), c->output_dim = iv;
    else if (!strcmp(k, "num_experts")) rc = int_of(v, k, &iv), c->num_experts = iv;
    else if (!strcmp(k, "num_experts_per_tok")) rc = int_of(v, k, &iv), c->num_experts_per_tok = iv;
    else if (!strcmp(k, "num_heads")) rc = int_of(v, k, &iv), c->num_heads = iv;
    else if (!strcmp(k, "expert_hidden_size")) rc = int_of(v, k, &iv), c->expert_hidden_size = iv;
    else if (!strcmp(k, "query_dim")) rc = int_of(v, k, &iv), c->query_dim = iv;
    else if (!strcmp(k, "product_key_dims")) rc = int_of(v, k, &iv), c->product_key_dims = (int)iv;
    else if (!strcmp(k, "key_l2_norm")) rc = (e = PyObject_IsTrue(v)) < 0 ? -1 : 0, c->key_l2_norm = e > 0;
    else if (!strcmp(k, "per_head_keys")) rc = (e = PyObject_IsTrue(v)) < 0 ? -1 : 0, c->per_head_keys = e > 0;
    else if (!strcmp(k, "norm_eps")) c->norm_eps = PyFloat_AsDouble(v), rc = PyErr_Occurred() ? -1 : 0;
    else if (!strcmp(k, "l2_eps")) c->l2_eps = PyFloat_AsDouble(v), rc = PyErr_Occurred() ? -1 : 0;
    else if (!strcmp(k, "activation")) rc = enum_of(v, k, acts, SMELT_ACT_COUNT, &e), c->activation = (smelt_act)e;
    else if (!strcmp(k, "query_norm")) rc = enum_of(v, k, norms, 4, &e), c->query_norm = (smelt_peer_norm)e;
    else if (!strcmp(k, "gate")) rc = enum_of(v, k, gates, 3, &e), c->gate = (smelt_peer_gate)e;
    else if (!strcmp(k, "route")) rc = enum_of(v, k, routes, 3, &e), c->kernels.route = (smelt_peer_route_kernel)e;
    else if (!strcmp(k, "expert_kernel"))
      rc = enum_of(v, k, experts, 4, &e), c->kernels.expert = (smelt_peer_expert_kernel)e;
    else if (!strcmp(k, "overlap")) rc = enum_of(v, k, overlaps, 3, &e), c->kernels.overlap = (smelt_peer_overlap)e;
    else if (!strcmp(k, "projection"))
      rc = enum_of(v, k, projections, 3, &e), c->kernels.projection = (smelt_peer_projection)e;
    else if (!strcmp(k, "head_groups")) rc = int_of(v, k, &iv), c->kernels.head_groups = (int)iv;
    else if (!strcmp(k, "sub_key_sizes")) {
      Py_ssize_t n = PySequence_Check(v) ? PySequence_Size(v) : -1;
      if (n < 0 || n > SMELT_PEER_MAX_DIMS) {
        PyErr_Clear();
        smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.peer: sub_key_sizes must be a sequence of at most %d ints",
                   SMELT_PEER_MAX_DIMS);
        rc = -1;
      }
      for (Py_ssize_t i = 0; i < n && !rc; i++) {
        PyObject *item = PySequence_GetItem(v, i);
        rc = item ? int_of(item, "sub_key_sizes[i]", &iv) : -1;
        Py_XDECREF(item);
        c->sub_key_sizes[i] = iv;
      }
    } else {
      smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.peer: cfg has no field '%s'", k);
      rc = -1;
    }
    Py_DECREF(kb);
    if (rc < 0) return -1;
  }
  return 0;
}

/* ---- the call */

static int tuple_of(PyObject *o, Py_ssize_t n, const char *what) {
  if (!PyTuple_Check(o) || PyTuple_Size(o) != n) {
    PyErr_Format(PyExc_TypeError, "_smelt.peer: %s must be a tuple of %zd", what, n);
    return -1;
  }
  return 0;
}

static smelt_status run(smpy_call *call, int mode, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                        const smelt_tensor *x, smelt_tensor *const *o, const smelt_tensor *ids, const smelt_tensor *dy,
                        const smelt_peer_grads *g) {
  smpy_ctx *c = call->ctx;
  smelt_status s;
  const int cpu = smelt_ctx_device(c->ctx) == SMELT_DEVICE_CPU;
  smpy_ctx_lock(c);
  s = smpy_ctx_use_stream(c, call->stream);
  if (!s) {
    PyThreadState *ts = cpu ? PyEval_SaveThread() : NULL;
    if (mode == 0) s = smelt_peer_retrieve(c->ctx, cfg, w, x, o[0], o[1]);
    else if (mode == 1) s = smelt_peer_forward(c->ctx, cfg, w, x, o[0], o[1], o[2]);
    else s = smelt_peer_backward(c->ctx, cfg, w, x, ids, dy, g);
    if (ts) PyEval_RestoreThread(ts);
  }
  smpy_ctx_unlock(c);
  return s;
}

static PyObject *py_peer(PyObject *self, PyObject *args) {
  int mode;
  PyObject *cfg_d, *xo, *wt, *extra, *outs, *ctx, *stream;
  if (!PyArg_ParseTuple(args, "iOOOOOOO:peer", &mode, &cfg_d, &xo, &wt, &extra, &outs, &ctx, &stream)) return NULL;
  static const Py_ssize_t nouts[3] = {2, 3, G_COUNT};
  if (mode < 0 || mode > 2) {
    PyErr_Format(PyExc_ValueError, "_smelt.peer: mode=%d is not 0, 1 or 2", mode);
    return NULL;
  }
  smelt_peer_config cfg;
  if (parse_cfg(cfg_d, &cfg) < 0 ||
      tuple_of(wt, W_COUNT + 1, "weights") < 0 || tuple_of(extra, mode == 2 ? 2 : 0, "extra") < 0 ||
      tuple_of(outs, nouts[mode], "outs") < 0)
    return NULL;
  static const char *const op_names[3] = {"smelt.peer_retrieve", "smelt.peer", "smelt.peer_backward"};
  smpy_call call;
  PyObject *slots[G_COUNT] = {NULL}, *result = NULL;
  smelt_tensor *x, *wts[W_COUNT] = {NULL}, *o[G_COUNT] = {NULL}, *ids = NULL, *dy = NULL;
  PyObject *so = PyTuple_GetItem(wt, W_COUNT);
  smpy_store *store = NULL;
  if (so != Py_None) {
    if (!(store = smpy_store_of(so, op_names[mode]))) return NULL;
    if (ctx != Py_None && ctx != (PyObject *)store->ctx)
      return smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "%s: ctx is not the store's context", op_names[mode]);
    ctx = (PyObject *)store->ctx; /* the store runs on its own context */
  }
  if (smpy_call_begin(&call, op_names[mode], ctx, stream) < 0) return NULL;
  if (smpy_call_import(&call, xo, "x", 0, &x) < 0) goto done;
  for (int i = 0; i < W_COUNT; i++) {
    PyObject *t = PyTuple_GetItem(wt, i);
    if (t != Py_None && smpy_call_import(&call, t, w_names[i], 0, &wts[i]) < 0) goto done;
  }
  if (mode == 2 && (smpy_call_import(&call, PyTuple_GetItem(extra, 0), "ids", 0, &ids) < 0 ||
                    smpy_call_import(&call, PyTuple_GetItem(extra, 1), "dy", 0, &dy) < 0))
    goto done;
  const int64_t tok = x->ndim >= 1 ? x->shape[0] : 0;
  const int64_t sel[3] = {tok, cfg.num_heads, cfg.num_experts_per_tok}, yshape[2] = {tok, cfg.output_dim};
  const int64_t nuse = tok * cfg.num_heads * cfg.num_experts_per_tok, one = 1;
  const int64_t urows[3] = {nuse, cfg.input_dim, cfg.expert_hidden_size};
  const int64_t vrows[3] = {nuse, cfg.expert_hidden_size, cfg.output_dim};
  for (int i = 0; i < nouts[mode]; i++) {
    PyObject *given = PyTuple_GetItem(outs, i);
    int r;
    if (mode < 2) {
      const int k = mode == 0 ? i + 1 : i; /* 0 y, 1 ids, 2 scores */
      static const char *const names[3] = {"out", "ids", "scores"}; /* the Python arguments */
      const smelt_dtype dt = k == 0 ? x->dtype : k == 1 ? SMELT_DTYPE_I64 : SMELT_DTYPE_F32;
      r = smpy_out_arg(&call, given, names[k], dt, k ? 3 : 2, k ? sel : yshape, &slots[i], &o[i]);
    } else {
      const smelt_tensor *like = i == G_DX ? x : g_like[i] < 0 ? NULL : wts[g_like[i]];
      if (i >= G_DUR && store) { /* the rows' dtype is the store's */
        r = smpy_out_arg(&call, given, g_names[i], store->opts.dtype, 3, i == G_DUR ? urows : vrows, &slots[i], &o[i]);
        if (r < 0) goto done;
        continue;
      }
      if (given == Py_True && !like && g_like[i] >= 0) {
        smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.peer_backward: %s is asked for but %s is absent",
                   g_names[i], w_names[g_like[i]]);
        goto done;
      }
      if (i < G_IDS)
        r = smpy_out_arg(&call, given, g_names[i], like ? like->dtype : SMELT_DTYPE_F32, like ? like->ndim : 0,
                    like ? like->shape : NULL, &slots[i], &o[i]);
      else /* one entry or row per use of an expert (smelt/peer.h) */
        r = smpy_out_arg(&call, given, g_names[i], like ? like->dtype : SMELT_DTYPE_I64, i < G_DUR ? 1 : 3,
                    i == G_IDS ? &nuse : i == G_CNT ? &one : i == G_DUR ? urows : vrows, &slots[i], &o[i]);
    }
    if (r < 0) goto done;
  }
  smelt_peer_weights w = {.wq = wts[W_WQ], .bq = wts[W_BQ], .norm_weight = wts[W_NW], .norm_bias = wts[W_NB],
                          .bn_mean = wts[W_BM], .bn_var = wts[W_BV], .u = wts[W_U], .v = wts[W_V],
                          .store = store ? store->store : NULL};
  smelt_peer_grads g = {.dx = o[G_DX], .dwq = o[G_DWQ], .dbq = o[G_DBQ], .dnorm_weight = o[G_DNW],
                        .dnorm_bias = o[G_DNB], .du = o[G_DU], .dv = o[G_DV], .grad_ids = o[G_IDS],
                        .grad_count = o[G_CNT], .du_rows = o[G_DUR], .dv_rows = o[G_DVR]};
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) {
    w.sub_keys[i] = wts[W_SK0 + i];
    g.dsub_keys[i] = o[G_DSK0 + i];
  }
  smelt_status s = run(&call, mode, &cfg, &w, x, o, ids, dy, &g);
  if (s) {
    smpy_raise_status(s);
    goto done;
  }
  result = PyTuple_New(nouts[mode]);
  for (int i = 0; result && i < nouts[mode]; i++) {
    PyTuple_SetItem(result, i, slots[i]); /* steals */
    slots[i] = NULL;
  }
done:
  smpy_call_end(&call);
  for (int i = 0; i < G_COUNT; i++) Py_XDECREF(slots[i]);
  return result;
}

PyMethodDef smpy_peer_methods[] = {
    {"peer", py_peer, METH_VARARGS,
     "peer(mode, cfg, x, weights, extra, outs, ctx, stream) -> outs (mode 0 retrieve, 1 forward, 2 backward)"},
    {NULL, NULL, 0, NULL}};
