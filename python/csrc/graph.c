/* smelt._smelt.Graph: the fusion planner (smelt/graph.h) from Python, one
 * method per C call, tensors by number. smelt/graph.py wraps it as
 * smelt.Graph (names, tensors kept for the run, keyword binding).
 *
 * The graph keeps its context alive and locks it around every call (an op
 * added after a plan drops the plan, which frees workspace on the
 * context). Declared inputs and outputs are imported only for their
 * layout; run(bind, stream) imports every caller tensor again and runs on
 * the producers' stream, as ops do. */
#include "smelt_py.h"

#include <stdio.h>

#define OP "smelt.Graph"

typedef struct smpy_graph {
  PyObject_HEAD
  smpy_ctx *ctx; /* strong reference */
  smelt_graph *g;
} smpy_graph;

static PyObject *graph_type;

static PyObject *graph_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  PyObject *ctx;
  if (!PyArg_ParseTuple(args, "O:Graph", &ctx)) return NULL;
  if (!PyObject_TypeCheck(ctx, (PyTypeObject *)smpy_ctx_type)) {
    PyErr_SetString(PyExc_TypeError, OP ": ctx must be a smelt.Context");
    return NULL;
  }
  allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
  smpy_graph *self = (smpy_graph *)alloc(tp, 0);
  if (!self) return NULL;
  smpy_ctx *c = (smpy_ctx *)ctx;
  const smelt_status s = smelt_graph_create(c->ctx, &self->g);
  if (s) {
    Py_DECREF(self);
    return smpy_raise_status(s);
  }
  Py_INCREF(c);
  self->ctx = c;
  return (PyObject *)self;
}

static void graph_dealloc(PyObject *o) {
  smpy_graph *self = (smpy_graph *)o;
  PyTypeObject *tp = Py_TYPE(o);
  if (self->ctx) {
    smpy_ctx_lock(self->ctx);
    smelt_graph_destroy(self->g);
    smpy_ctx_unlock(self->ctx);
    Py_DECREF(self->ctx);
  }
  freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  f(o);
  Py_DECREF(tp);
}

/* The status as None or its exception. */
static PyObject *done(smelt_status s) {
  if (s) return smpy_raise_status(s);
  Py_RETURN_NONE;
}

#define LOCKED(self, call)              \
  do {                                  \
    smpy_ctx_lock((self)->ctx);         \
    const smelt_status locked_s = call; \
    smpy_ctx_unlock((self)->ctx);       \
    return done(locked_s);              \
  } while (0)

/* ---------------------------------------------------------------- tensors */

static PyObject *declare(smpy_graph *self, PyObject *args, int output) {
  const char *name;
  PyObject *obj;
  if (!PyArg_ParseTuple(args, "sO", &name, &obj)) return NULL;
  smpy_call call;
  smelt_tensor *t;
  int id = -1;
  smelt_status s = SMELT_OK;
  if (smpy_call_begin(&call, output ? OP ".output" : OP ".input", (PyObject *)self->ctx, NULL) < 0) return NULL;
  if (smpy_call_import(&call, obj, name, output, &t) < 0) {
    smpy_call_end(&call);
    return NULL;
  }
  smpy_ctx_lock(self->ctx);
  s = output ? smelt_graph_output(self->g, name, t, &id) : smelt_graph_input(self->g, name, t, &id);
  smpy_ctx_unlock(self->ctx);
  smpy_call_end(&call);
  return s ? smpy_raise_status(s) : PyLong_FromLong(id);
}

static PyObject *graph_input(PyObject *self, PyObject *args) { return declare((smpy_graph *)self, args, 0); }
static PyObject *graph_output(PyObject *self, PyObject *args) { return declare((smpy_graph *)self, args, 1); }

static PyObject *graph_tensor(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  const char *name, *dtname;
  PyObject *shape;
  if (!PyArg_ParseTuple(args, "ssO!", &name, &dtname, &PyTuple_Type, &shape)) return NULL;
  smelt_dtype dt;
  if (smelt_dtype_from_name(dtname, &dt))
    return smpy_raise(SMELT_STATUS_DTYPE_MISMATCH, OP ".tensor: dtype '%s' is not a smelt dtype name", dtname);
  const Py_ssize_t nd = PyTuple_Size(shape);
  if (nd > SMELT_MAX_DIMS)
    return smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, OP ".tensor: %zd dims (at most %d)", nd, SMELT_MAX_DIMS);
  int64_t dims[SMELT_MAX_DIMS] = {0};
  for (Py_ssize_t i = 0; i < nd; i++) {
    dims[i] = PyLong_AsLongLong(PyTuple_GetItem(shape, i));
    if (dims[i] == -1 && PyErr_Occurred()) return NULL;
  }
  int id = -1;
  smpy_ctx_lock(self->ctx);
  const smelt_status s = smelt_graph_tensor(self->g, name, dt, (int)nd, dims, &id);
  smpy_ctx_unlock(self->ctx);
  return s ? smpy_raise_status(s) : PyLong_FromLong(id);
}

/* ---------------------------------------------------------------- ops */

static PyObject *graph_gemm(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  int a, b, d, math;
  double alpha;
  if (!PyArg_ParseTuple(args, "iiidi", &a, &b, &d, &alpha, &math)) return NULL;
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.epilogue.alpha = alpha;
  desc.math.op = (smelt_gemm_math_op)math;
  LOCKED(self, smelt_graph_gemm(self->g, &desc, a, b, d));
}

static PyObject *graph_bias(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  int x, b, y;
  if (!PyArg_ParseTuple(args, "iii", &x, &b, &y)) return NULL;
  LOCKED(self, smelt_graph_bias(self->g, x, b, y));
}

static PyObject *graph_act(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  const char *name;
  float slope;
  int x, y;
  if (!PyArg_ParseTuple(args, "sfii", &name, &slope, &x, &y)) return NULL;
  smelt_act act;
  if (smelt_act_from_name(name, &act))
    return smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, OP ".act: '%s' is not one of smelt.ACTIVATIONS", name);
  LOCKED(self, smelt_graph_act(self->g, act, slope, x, y));
}

static PyObject *graph_binary(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  int op, a, b, y;
  if (!PyArg_ParseTuple(args, "iiii", &op, &a, &b, &y)) return NULL;
  LOCKED(self, smelt_graph_binary(self->g, (smelt_graph_binop)op, a, b, y));
}

static PyObject *graph_residual_add(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  int x, r, y;
  if (!PyArg_ParseTuple(args, "iii", &x, &r, &y)) return NULL;
  LOCKED(self, smelt_graph_residual_add(self->g, x, r, y));
}

static PyObject *graph_norm(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  int kind, x, w, b, y;
  float eps;
  if (!PyArg_ParseTuple(args, "ifiiii", &kind, &eps, &x, &w, &b, &y)) return NULL;
  const smelt_norm_desc desc = {(smelt_norm_kind)kind, eps};
  LOCKED(self, smelt_graph_norm(self->g, &desc, x, w, b, y));
}

static PyObject *graph_rotary(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  int layout, inverse, x, c, s, p, y;
  if (!PyArg_ParseTuple(args, "iiiiiii", &layout, &inverse, &x, &c, &s, &p, &y)) return NULL;
  const smelt_rotary_desc desc = {(smelt_rotary_layout)layout, inverse};
  LOCKED(self, smelt_graph_rotary(self->g, &desc, x, c, s, p, y));
}

static PyObject *graph_attention(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  float scale, softcap;
  int causal, q, k, v, out;
  long long wl, wr;
  if (!PyArg_ParseTuple(args, "fiLLfiiii", &scale, &causal, &wl, &wr, &softcap, &q, &k, &v, &out)) return NULL;
  smelt_attention_desc desc = smelt_attention_desc_default();
  desc.scale = scale;
  desc.causal = causal;
  desc.window_left = wl;
  desc.window_right = wr;
  desc.softcap = softcap;
  LOCKED(self, smelt_graph_attention(self->g, &desc, q, k, v, out));
}

static PyObject *graph_softmax(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  int x, y;
  if (!PyArg_ParseTuple(args, "ii", &x, &y)) return NULL;
  LOCKED(self, smelt_graph_softmax(self->g, x, y));
}

/* ---------------------------------------------------------------- plan, run, describe */

static PyObject *graph_plan(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  unsigned flags;
  if (!PyArg_ParseTuple(args, "I", &flags)) return NULL;
  smelt_status s;
  smpy_ctx_lock(self->ctx);
  Py_BEGIN_ALLOW_THREADS s = smelt_graph_plan(self->g, flags);
  Py_END_ALLOW_THREADS
  smpy_ctx_unlock(self->ctx);
  return done(s);
}

/* bind: one entry per tensor, None for intermediates; outputs are
 * imported writable. */
static PyObject *graph_run(PyObject *o, PyObject *args) {
  smpy_graph *self = (smpy_graph *)o;
  PyObject *bind, *outputs, *stream;
  if (!PyArg_ParseTuple(args, "O!O!O", &PyTuple_Type, &bind, &PyTuple_Type, &outputs, &stream)) return NULL;
  const Py_ssize_t n = PyTuple_Size(bind);
  if (n > SMPY_MAX_ARGS || PyTuple_Size(outputs) != n)
    return smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, OP ".run: %zd tensors (at most %d from Python)", n,
                      SMPY_MAX_ARGS);
  smpy_call call;
  const smelt_tensor *views[SMPY_MAX_ARGS];
  if (smpy_call_begin(&call, OP ".run", (PyObject *)self->ctx, stream) < 0) return NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *t = PyTuple_GetItem(bind, i);
    smelt_tensor *v = NULL;
    char name[32];
    snprintf(name, sizeof name, "tensor %zd", i);
    if (t != Py_None && smpy_call_import(&call, t, name, PyObject_IsTrue(PyTuple_GetItem(outputs, i)), &v) < 0) {
      smpy_call_end(&call);
      return NULL;
    }
    views[i] = v;
  }
  smpy_ctx *cx = self->ctx;
  const int cpu = smelt_ctx_device(cx->ctx) == SMELT_DEVICE_CPU;
  smpy_ctx_lock(cx);
  smelt_status s = smpy_ctx_use_stream(cx, call.stream);
  if (!s) {
    PyThreadState *ts = cpu ? PyEval_SaveThread() : NULL;
    s = smelt_graph_run(self->g, views);
    if (ts) PyEval_RestoreThread(ts);
  }
  smpy_ctx_unlock(cx);
  smpy_call_end(&call);
  return done(s);
}

static PyObject *graph_describe(PyObject *o, PyObject *unused) {
  smpy_graph *self = (smpy_graph *)o;
  smpy_ctx_lock(self->ctx);
  PyObject *r = PyUnicode_FromString(smelt_graph_describe(self->g));
  smpy_ctx_unlock(self->ctx);
  return r;
}

static PyObject *graph_stats(PyObject *o, PyObject *unused) {
  smpy_graph *self = (smpy_graph *)o;
  smelt_graph_stats st;
  smpy_ctx_lock(self->ctx);
  const smelt_status s = smelt_graph_stats_get(self->g, &st);
  smpy_ctx_unlock(self->ctx);
  if (s) return smpy_raise_status(s);
  return Py_BuildValue("{s:i,s:i,s:i,s:i,s:K}", "ops", st.ops, "tensors", st.tensors, "kernels", st.kernels,
                       "fused_away", st.fused_away, "workspace_bytes", (unsigned long long)st.workspace_bytes);
}

static PyMethodDef graph_methods[] = {
    {"input", graph_input, METH_VARARGS, "input(name, tensor) -> id"},
    {"output", graph_output, METH_VARARGS, "output(name, tensor) -> id"},
    {"tensor", graph_tensor, METH_VARARGS, "tensor(name, dtype, shape) -> id"},
    {"gemm", graph_gemm, METH_VARARGS, "gemm(a, b, d, alpha, math)"},
    {"bias", graph_bias, METH_VARARGS, "bias(x, bias, y)"},
    {"act", graph_act, METH_VARARGS, "act(name, slope, x, y)"},
    {"binary", graph_binary, METH_VARARGS, "binary(op, a, b, y): op a smelt_graph_binop value"},
    {"residual_add", graph_residual_add, METH_VARARGS, "residual_add(x, residual, y)"},
    {"norm", graph_norm, METH_VARARGS, "norm(kind, eps, x, weight, bias, y)"},
    {"rotary", graph_rotary, METH_VARARGS, "rotary(layout, inverse, x, cos, sin, positions, y)"},
    {"attention", graph_attention, METH_VARARGS,
     "attention(scale, causal, window_left, window_right, softcap, q, k, v, o)"},
    {"softmax", graph_softmax, METH_VARARGS, "softmax(x, y)"},
    {"plan", graph_plan, METH_VARARGS, "plan(flags)"},
    {"run", graph_run, METH_VARARGS, "run(bind, outputs, stream): bind and outputs one entry per tensor"},
    {"describe", graph_describe, METH_NOARGS, "describe() -> str"},
    {"stats", graph_stats, METH_NOARGS, "stats() -> dict"},
    {NULL, NULL, 0, NULL}};

static PyType_Slot graph_slots[] = {
    {Py_tp_new, (void *)graph_new},
    {Py_tp_dealloc, (void *)graph_dealloc},
    {Py_tp_methods, graph_methods},
    {Py_tp_doc, (void *)"_smelt.Graph(ctx): smelt_graph, tensors by number (smelt.Graph wraps it)."},
    {0, NULL}};

static PyType_Spec graph_spec = {"smelt._smelt.Graph", sizeof(smpy_graph), 0, Py_TPFLAGS_DEFAULT, graph_slots};

int smpy_graph_type_init(PyObject *module) { return smpy_add_type(module, &graph_spec, "Graph", &graph_type); }
