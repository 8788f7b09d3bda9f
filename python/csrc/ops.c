/* The ops as the C layer exposes them: positional arguments, explicit outputs
 * (None = allocate through the input's framework, else a smelt.Tensor), the
 * context and the stream. smelt/__init__.py wraps them with keywords and
 * docstrings; these are the fast path it calls.
 *
 * Each call: import x (which picks the context and the launch stream), make
 * or import the outputs, find or make the plan, run it on the launch stream,
 * release the DLPack imports. */
#include "smelt_py.h"

#include <string.h>

static PyObject *act_names; /* dict: name -> smelt_act */
static PyObject *act_tuple; /* the names, in enum order */

enum { OP_ACTIVATION = 1, OP_SOFTMAX, OP_TOPK };

typedef struct op_args {
  int op;
  smelt_activation_desc desc;
  int64_t k;
  const smelt_tensor *t[3]; /* op-specific order; NULL = absent */
} op_args;

static smelt_status make_plan(smelt_ctx *ctx, const op_args *o, smelt_plan **plan) {
  switch (o->op) {
    case OP_ACTIVATION: return smelt_activation_plan(ctx, &o->desc, o->t[0], o->t[1], plan);
    case OP_SOFTMAX: return smelt_softmax_plan(ctx, o->t[0], o->t[1], o->t[2], plan);
    case OP_TOPK: return smelt_topk_plan(ctx, o->k, o->t[0], o->t[1], o->t[2], plan);
    default: return SMELT_STATUS_INTERNAL;
  }
}

static smelt_status run_plan(smelt_plan *plan, const op_args *o) {
  switch (o->op) {
    case OP_ACTIVATION: return smelt_activation_run(plan, o->t[0], o->t[1]);
    case OP_SOFTMAX: return smelt_softmax_run(plan, o->t[0], o->t[1], o->t[2]);
    case OP_TOPK: return smelt_topk_run(plan, o->t[0], o->t[1], o->t[2]);
    default: return SMELT_STATUS_INTERNAL;
  }
}

/* Plans (cached) and runs the op on the call's context and stream. */
static int execute(smpy_call *call, const op_args *o) {
  smpy_ctx *c = call->ctx;
  smpy_pkey key;
  memset(&key, 0, sizeof key);
  key.op = o->op;
  key.act = (int32_t)o->desc.act;
  key.slope = o->desc.slope;
  key.k = o->k;
  key.deterministic = c->deterministic;
  key.ntensors = 3;
  for (int i = 0; i < 3; i++) {
    if (o->t[i])
      smpy_tkey_fill(&key.t[i], o->t[i]);
    else
      key.t[i].ndim = -1;
  }
  int cpu = smelt_ctx_device(c->ctx) == SMELT_DEVICE_CPU;
  uint64_t hash;
  smelt_plan *plan, *uncached = NULL;
  smelt_status s;
  smpy_ctx_lock(c);
  s = smpy_ctx_use_stream(c, call->stream);
  plan = s ? NULL : smpy_plan_find(c, &key, &hash);
  if (!s && !plan) {
    /* Planning may compile a kernel: let other threads run meanwhile. */
    Py_BEGIN_ALLOW_THREADS s = make_plan(c->ctx, o, &plan);
    Py_END_ALLOW_THREADS
    if (!s && smpy_plan_store(c, &key, hash, plan) < 0) uncached = plan;
  }
  if (!s) {
    if (cpu) {
      Py_BEGIN_ALLOW_THREADS s = run_plan(plan, o);
      Py_END_ALLOW_THREADS
    } else {
      s = run_plan(plan, o);
    }
  }
  if (uncached) smelt_plan_destroy(uncached);
  smpy_ctx_unlock(c);
  if (s) {
    smpy_raise_status(s);
    return -1;
  }
  return 0;
}

static int unpack(PyObject *args, const char *name, Py_ssize_t n, PyObject **out) {
  if (PyTuple_Size(args) != n) {
    PyErr_Format(PyExc_TypeError, "_smelt.%s takes %zd positional arguments", name, n);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) out[i] = PyTuple_GetItem(args, i);
  return 0;
}

static int parse_act(PyObject *o, smelt_act *act) {
  if (PyLong_Check(o)) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *act = (smelt_act)v; /* range checked by smelt */
    return 0;
  }
  PyObject *v = PyDict_GetItemWithError(act_names, o);
  if (!v) {
    if (PyErr_Occurred()) return -1;
    PyObject *msg = PyUnicode_FromFormat("smelt.activation: act=%R is not one of %R", o, act_tuple);
    PyObject *b = msg ? PyUnicode_AsUTF8String(msg) : NULL;
    if (b) smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "%s", PyBytes_AsString(b));
    Py_XDECREF(msg);
    Py_XDECREF(b);
    return -1;
  }
  *act = (smelt_act)PyLong_AsLong(v);
  return 0;
}

static PyObject *py_activation(PyObject *self, PyObject *args) {
  PyObject *a[6]; /* x, out, act, slope, ctx, stream */
  if (unpack(args, "activation", 6, a) < 0) return NULL;
  op_args o;
  memset(&o, 0, sizeof o);
  o.op = OP_ACTIVATION;
  if (parse_act(a[2], &o.desc.act) < 0) return NULL;
  double slope = PyFloat_AsDouble(a[3]);
  if (slope == -1.0 && PyErr_Occurred()) return NULL;
  o.desc.slope = (float)slope;

  smpy_call call;
  PyObject *out = a[1], *made = NULL, *result = NULL;
  smelt_tensor *x, *y;
  if (smpy_call_begin(&call, "smelt.activation", a[4], a[5]) < 0) return NULL;
  if (smpy_call_import(&call, a[0], "x", 0, &x) < 0) goto done;
  if (out == Py_None) {
    if (!(out = made = smpy_call_alloc(&call, x->dtype, x->ndim, x->shape))) goto done;
  }
  if (smpy_call_import(&call, out, "out", 1, &y) < 0) goto done;
  o.t[0] = x;
  o.t[1] = y;
  if (execute(&call, &o) < 0) goto done;
  Py_INCREF(out);
  result = out;
done:
  smpy_call_end(&call);
  Py_XDECREF(made);
  return result;
}

static PyObject *py_softmax(PyObject *self, PyObject *args) {
  PyObject *a[6]; /* x, out, lse, want_lse, ctx, stream */
  if (unpack(args, "softmax", 6, a) < 0) return NULL;
  int want_lse = PyObject_IsTrue(a[3]);
  if (want_lse < 0) return NULL;
  op_args o;
  memset(&o, 0, sizeof o);
  o.op = OP_SOFTMAX;

  smpy_call call;
  PyObject *out = a[1], *lse = a[2], *made_out = NULL, *made_lse = NULL, *result = NULL;
  smelt_tensor *x, *y, *l = NULL;
  if (smpy_call_begin(&call, "smelt.softmax", a[4], a[5]) < 0) return NULL;
  if (smpy_call_import(&call, a[0], "x", 0, &x) < 0) goto done;
  if ((out == Py_None || (lse == Py_None && want_lse)) && x->ndim < 1) {
    smpy_raise(SMELT_STATUS_SHAPE_MISMATCH, "smelt.softmax: x must have at least 1 dim, got a scalar");
    goto done;
  }
  if (out == Py_None && !(out = made_out = smpy_call_alloc(&call, x->dtype, x->ndim, x->shape))) goto done;
  if (lse == Py_None && want_lse &&
      !(lse = made_lse = smpy_call_alloc(&call, SMELT_DTYPE_F32, x->ndim - 1, x->shape)))
    goto done;
  if (smpy_call_import(&call, out, "out", 1, &y) < 0) goto done;
  if (lse != Py_None && smpy_call_import(&call, lse, "lse", 1, &l) < 0) goto done;
  o.t[0] = x;
  o.t[1] = y;
  o.t[2] = l;
  if (execute(&call, &o) < 0) goto done;
  if (want_lse)
    result = PyTuple_Pack(2, out, lse);
  else {
    Py_INCREF(out);
    result = out;
  }
done:
  smpy_call_end(&call);
  Py_XDECREF(made_out);
  Py_XDECREF(made_lse);
  return result;
}

static int parse_index_dtype(PyObject *o, int *want, smelt_dtype *dt) {
  *want = 1;
  if (o == Py_None) {
    *want = 0;
    return 0;
  }
  if (PyUnicode_Check(o)) {
    if (!PyUnicode_CompareWithASCIIString(o, "int64") || !PyUnicode_CompareWithASCIIString(o, "i64")) {
      *dt = SMELT_DTYPE_I64;
      return 0;
    }
    if (!PyUnicode_CompareWithASCIIString(o, "int32") || !PyUnicode_CompareWithASCIIString(o, "i32")) {
      *dt = SMELT_DTYPE_I32;
      return 0;
    }
  }
  PyObject *r = PyObject_Repr(o);
  PyObject *b = r ? PyUnicode_AsUTF8String(r) : NULL;
  smpy_raise(SMELT_STATUS_DTYPE_MISMATCH, "smelt.topk: index_dtype=%s is not 'int64', 'int32' or None",
             b ? PyBytes_AsString(b) : "?");
  Py_XDECREF(r);
  Py_XDECREF(b);
  return -1;
}

static PyObject *py_topk(PyObject *self, PyObject *args) {
  PyObject *a[7]; /* x, k, values, indices, index_dtype, ctx, stream */
  if (unpack(args, "topk", 7, a) < 0) return NULL;
  op_args o;
  memset(&o, 0, sizeof o);
  o.op = OP_TOPK;
  o.k = PyLong_AsLongLong(a[1]);
  if (o.k == -1 && PyErr_Occurred()) return NULL;
  int want_idx;
  smelt_dtype idt = SMELT_DTYPE_I64;
  if (parse_index_dtype(a[4], &want_idx, &idt) < 0) return NULL;

  smpy_call call;
  PyObject *vals = a[2], *idx = a[3], *made_v = NULL, *made_i = NULL, *result = NULL;
  smelt_tensor *x, *v, *ix = NULL;
  if (smpy_call_begin(&call, "smelt.topk", a[5], a[6]) < 0) return NULL;
  if (smpy_call_import(&call, a[0], "x", 0, &x) < 0) goto done;
  if (vals == Py_None || (idx == Py_None && want_idx)) {
    if (x->ndim < 1) {
      smpy_raise(SMELT_STATUS_SHAPE_MISMATCH, "smelt.topk: x must have at least 1 dim, got a scalar");
      goto done;
    }
    if (o.k < 0 || o.k > x->shape[x->ndim - 1]) {
      smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.topk: k=%lld must be in [1, %lld] (x.shape[-1])",
                 (long long)o.k, (long long)x->shape[x->ndim - 1]);
      goto done;
    }
  }
  int64_t shape[SMELT_MAX_DIMS];
  for (int i = 0; i < x->ndim; i++) shape[i] = x->shape[i];
  if (x->ndim >= 1) shape[x->ndim - 1] = o.k;
  if (vals == Py_None && !(vals = made_v = smpy_call_alloc(&call, x->dtype, x->ndim, shape))) goto done;
  if (idx == Py_None && want_idx && !(idx = made_i = smpy_call_alloc(&call, idt, x->ndim, shape))) goto done;
  if (smpy_call_import(&call, vals, "values", 1, &v) < 0) goto done;
  if (idx != Py_None && smpy_call_import(&call, idx, "indices", 1, &ix) < 0) goto done;
  o.t[0] = x;
  o.t[1] = v;
  o.t[2] = ix;
  if (execute(&call, &o) < 0) goto done;
  result = PyTuple_Pack(2, vals, idx);
done:
  smpy_call_end(&call);
  Py_XDECREF(made_v);
  Py_XDECREF(made_i);
  return result;
}

PyMethodDef smpy_op_methods[] = {
    {"activation", py_activation, METH_VARARGS, "activation(x, out, act, slope, ctx, stream) -> out"},
    {"softmax", py_softmax, METH_VARARGS, "softmax(x, out, lse, want_lse, ctx, stream) -> out or (out, lse)"},
    {"topk", py_topk, METH_VARARGS, "topk(x, k, values, indices, index_dtype, ctx, stream) -> (values, indices)"},
    {NULL, NULL, 0, NULL}};

int smpy_ops_init(PyObject *module) {
  act_names = PyDict_New();
  if (!act_names) return -1;
  PyObject *names = PyTuple_New(SMELT_ACT_COUNT);
  if (!names) return -1;
  for (int i = 0; i < SMELT_ACT_COUNT; i++) {
    PyObject *n = PyUnicode_FromString(smelt_act_name((smelt_act)i));
    PyObject *v = PyLong_FromLong(i);
    if (!n || !v || PyDict_SetItem(act_names, n, v) < 0) {
      Py_XDECREF(n);
      Py_XDECREF(v);
      Py_DECREF(names);
      return -1;
    }
    Py_DECREF(v);
    PyTuple_SetItem(names, i, n); /* steals n */
  }
  act_tuple = names;
  Py_INCREF(names);
  if (PyModule_AddObject(module, "ACTIVATIONS", names) < 0) {
    Py_DECREF(names);
    return -1;
  }
  return 0;
}
