/* smelt.Tensor: memory smelt allocated itself (from the context's pool on CUDA,
 * the heap on the CPU), returned where no framework could allocate an output.
 * It exports DLPack (versioned and legacy), so torch.from_dlpack, numpy
 * .from_dlpack and friends take it without a copy.
 *
 * Streams: the memory is ordered on the stream it was allocated on. A consumer
 * that passes another stream to __dlpack__ gets a host synchronization of that
 * stream first (the C API has no cross-stream event wait yet). */
#include "smelt_py.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

PyObject *smpy_tensor_type;

PyObject *smpy_tensor_new(smpy_ctx *c, void *stream, smelt_dtype dt, int ndim, const int64_t *shape) {
  if (ndim < 0 || ndim > SMELT_MAX_DIMS)
    return smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.Tensor: ndim=%d is not in [0, %d]", ndim,
                      SMELT_MAX_DIMS);
  size_t es = smelt_dtype_size(dt);
  if (!es) return smpy_raise(SMELT_STATUS_DTYPE_MISMATCH, "smelt.Tensor: invalid dtype %d", (int)dt);
  uint64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0)
      return smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.Tensor: shape[%d]=%lld is negative", i,
                        (long long)shape[i]);
    if (shape[i] && n > ((uint64_t)1 << 62) / (uint64_t)shape[i])
      return smpy_raise(SMELT_STATUS_OVERFLOW, "smelt.Tensor: shape overflows");
    n *= (uint64_t)shape[i];
  }
  PyTypeObject *tp = (PyTypeObject *)smpy_tensor_type;
  allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
  smpy_tensor *t = (smpy_tensor *)alloc(tp, 0);
  if (!t) return NULL;
  smelt_tensor view = smelt_tensor_make(NULL, dt, smelt_ctx_device(c->ctx), smelt_ctx_device_index(c->ctx), ndim,
                                        shape);
  t->nbytes = (size_t)(n * es);
  void *p = NULL;
  smpy_ctx_lock(c);
  smelt_status s = smpy_ctx_use_stream(c, stream);
  if (!s) s = smelt_alloc(c->ctx, t->nbytes, &p);
  smpy_ctx_unlock(c);
  if (s) {
    Py_DECREF(t);
    return smpy_raise_status(s);
  }
  view.data = p;
  t->t = view;
  t->stream = stream;
  Py_INCREF(c);
  t->ctx = c;
  return (PyObject *)t;
}

PyObject *smpy_tensor_view(smpy_ctx *c, PyObject *owner, const smelt_tensor *t) {
  PyTypeObject *tp = (PyTypeObject *)smpy_tensor_type;
  allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
  smpy_tensor *v = (smpy_tensor *)alloc(tp, 0);
  if (!v) return NULL;
  v->t = *t;
  v->nbytes = (size_t)smelt_tensor_numel(t) * smelt_dtype_size(t->dtype);
  v->stream = NULL;
  Py_INCREF(owner);
  v->owner = owner;
  Py_INCREF(c);
  v->ctx = c;
  return (PyObject *)v;
}

static void tensor_dealloc(PyObject *self) {
  smpy_tensor *t = (smpy_tensor *)self;
  PyTypeObject *tp = Py_TYPE(self);
  if (t->owner) {
    Py_DECREF(t->owner);
  } else if (t->ctx) {
    if (t->t.data) {
      smpy_ctx *c = t->ctx;
      smpy_ctx_lock(c);
      /* Free in the order of the stream the memory belongs to, then put the
       * context back on the stream its last op used. */
      void *prev = c->stream;
      int prev_set = c->stream_set;
      smpy_ctx_use_stream(c, t->stream);
      smelt_free(c->ctx, t->t.data); /* a failure here has nowhere to go */
      if (prev_set) smpy_ctx_use_stream(c, prev);
      smpy_ctx_unlock(c);
    }
  }
  Py_XDECREF(t->ctx);
  freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  f(self);
  Py_DECREF(tp);
}

/* ---- DLPack export */

typedef struct export_v {
  smpy_dl_managed_v m;
  int64_t shape[SMELT_MAX_DIMS], strides[SMELT_MAX_DIMS];
} export_v;

typedef struct export_l {
  smpy_dl_managed m;
  int64_t shape[SMELT_MAX_DIMS], strides[SMELT_MAX_DIMS];
} export_l;

/* Deleters may be called by a consumer on any thread, with or without the GIL. */
static void deleter_v(smpy_dl_managed_v *m) {
  PyGILState_STATE g = PyGILState_Ensure();
  Py_XDECREF((PyObject *)m->manager_ctx);
  PyGILState_Release(g);
  free(m);
}

static void deleter_l(smpy_dl_managed *m) {
  PyGILState_STATE g = PyGILState_Ensure();
  Py_XDECREF((PyObject *)m->manager_ctx);
  PyGILState_Release(g);
  free(m);
}

/* A capsule nobody consumed still owns its tensor. */
static void capsule_destructor_v(PyObject *cap) {
  if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    smpy_dl_managed_v *m = (smpy_dl_managed_v *)PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m && m->deleter) m->deleter(m);
  }
}

static void capsule_destructor_l(PyObject *cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) {
    smpy_dl_managed *m = (smpy_dl_managed *)PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter) m->deleter(m);
  }
}

static void fill_dl(smpy_dl_tensor *d, smpy_tensor *t, int64_t *shape, int64_t *strides) {
  d->data = t->t.data;
  d->device.device_type = t->t.device == SMELT_DEVICE_CUDA ? SMPY_DL_CUDA : SMPY_DL_CPU;
  d->device.device_id = t->t.device == SMELT_DEVICE_CUDA ? t->t.device_index : 0;
  d->ndim = t->t.ndim;
  d->dtype = smpy_dl_dtype_of(t->t.dtype);
  for (int i = 0; i < t->t.ndim; i++) {
    shape[i] = t->t.shape[i];
    strides[i] = t->t.strides[i];
  }
  d->shape = shape;
  d->strides = strides;
  d->byte_offset = 0;
}

static PyObject *tensor_dlpack(PyObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
  smpy_tensor *t = (smpy_tensor *)self;
  PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO:__dlpack__", kwlist, &stream, &max_version, &dl_device, &copy))
    return NULL;
  if (copy != Py_None && PyObject_IsTrue(copy) == 1) {
    PyErr_SetString(PyExc_BufferError, "smelt.Tensor.__dlpack__: copy=True is not supported");
    return NULL;
  }
  if (dl_device != Py_None) {
    int type = -1, id = -1;
    if (!PyArg_ParseTuple(dl_device, "ii", &type, &id)) return NULL;
    int my_type = t->t.device == SMELT_DEVICE_CUDA ? SMPY_DL_CUDA : SMPY_DL_CPU;
    int my_id = t->t.device == SMELT_DEVICE_CUDA ? t->t.device_index : 0;
    if (type != my_type || id != my_id) {
      PyErr_Format(PyExc_BufferError, "smelt.Tensor.__dlpack__: dl_device=(%d, %d) would need a copy", type, id);
      return NULL;
    }
  }
  if (t->t.device == SMELT_DEVICE_CUDA && stream != Py_None) {
    /* -1: the consumer asks for no synchronization. Otherwise make the data
     * ready for the consumer's stream (1 = legacy default, 2 = per-thread). */
    long long sv = PyLong_AsLongLong(stream);
    if (sv == -1 && PyErr_Occurred()) return NULL;
    if (sv == 0) {
      PyErr_SetString(PyExc_ValueError, "smelt.Tensor.__dlpack__: stream=0 is ambiguous in DLPack");
      return NULL;
    }
    void *want = sv == 1 ? NULL : (void *)(uintptr_t)sv;
    if (sv != -1 && want != t->stream) {
      smpy_ctx *c = t->ctx;
      smelt_status s;
      smpy_ctx_lock(c);
      void *prev = c->stream;
      int prev_set = c->stream_set;
      s = smpy_ctx_use_stream(c, t->stream);
      if (!s) {
        Py_BEGIN_ALLOW_THREADS s = smelt_ctx_synchronize(c->ctx);
        Py_END_ALLOW_THREADS
      }
      if (prev_set) smpy_ctx_use_stream(c, prev);
      smpy_ctx_unlock(c);
      if (s) return smpy_raise_status(s);
    }
  }
  int versioned = 0;
  if (max_version != Py_None) {
    PyObject *major = PySequence_GetItem(max_version, 0);
    if (!major) return NULL;
    long mj = PyLong_AsLong(major);
    Py_DECREF(major);
    if (mj == -1 && PyErr_Occurred()) return NULL;
    versioned = mj >= 1;
  }
  if (versioned) {
    export_v *e = (export_v *)calloc(1, sizeof *e);
    if (!e) return PyErr_NoMemory();
    e->m.version.major = 1;
    e->m.version.minor = 1;
    e->m.flags = 0;
    fill_dl(&e->m.dl_tensor, t, e->shape, e->strides);
    Py_INCREF(self);
    e->m.manager_ctx = self;
    e->m.deleter = deleter_v;
    PyObject *cap = PyCapsule_New(&e->m, "dltensor_versioned", capsule_destructor_v);
    if (!cap) deleter_v(&e->m);
    return cap;
  }
  export_l *e = (export_l *)calloc(1, sizeof *e);
  if (!e) return PyErr_NoMemory();
  fill_dl(&e->m.dl_tensor, t, e->shape, e->strides);
  Py_INCREF(self);
  e->m.manager_ctx = self;
  e->m.deleter = deleter_l;
  PyObject *cap = PyCapsule_New(&e->m, "dltensor", capsule_destructor_l);
  if (!cap) deleter_l(&e->m);
  return cap;
}

static PyObject *tensor_dlpack_device(PyObject *self, PyObject *unused) {
  smpy_tensor *t = (smpy_tensor *)self;
  if (t->t.device == SMELT_DEVICE_CUDA) return Py_BuildValue("(ii)", SMPY_DL_CUDA, t->t.device_index);
  return Py_BuildValue("(ii)", SMPY_DL_CPU, 0);
}

static PyObject *dims_tuple(const int64_t *v, int n) {
  PyObject *tup = PyTuple_New(n);
  if (!tup) return NULL;
  for (int i = 0; i < n; i++) {
    PyObject *x = PyLong_FromLongLong(v[i]);
    if (!x) {
      Py_DECREF(tup);
      return NULL;
    }
    PyTuple_SetItem(tup, i, x);
  }
  return tup;
}

static PyObject *tensor_get_shape(PyObject *self, void *c) {
  smpy_tensor *t = (smpy_tensor *)self;
  return dims_tuple(t->t.shape, t->t.ndim);
}
static PyObject *tensor_get_strides(PyObject *self, void *c) {
  smpy_tensor *t = (smpy_tensor *)self;
  return dims_tuple(t->t.strides, t->t.ndim);
}
static PyObject *tensor_get_ndim(PyObject *self, void *c) { return PyLong_FromLong(((smpy_tensor *)self)->t.ndim); }
static PyObject *tensor_get_dtype(PyObject *self, void *c) {
  return PyUnicode_FromString(smelt_dtype_name(((smpy_tensor *)self)->t.dtype));
}
static PyObject *tensor_get_device(PyObject *self, void *c) {
  smpy_tensor *t = (smpy_tensor *)self;
  if (t->t.device == SMELT_DEVICE_CPU) return PyUnicode_FromString("cpu");
  return PyUnicode_FromFormat("cuda:%d", t->t.device_index);
}
static PyObject *tensor_get_ptr(PyObject *self, void *c) { return PyLong_FromVoidPtr(((smpy_tensor *)self)->t.data); }
static PyObject *tensor_get_nbytes(PyObject *self, void *c) {
  return PyLong_FromSize_t(((smpy_tensor *)self)->nbytes);
}
static PyObject *tensor_get_ctx(PyObject *self, void *c) {
  PyObject *ctx = (PyObject *)((smpy_tensor *)self)->ctx;
  Py_INCREF(ctx);
  return ctx;
}
static PyObject *tensor_get_stream(PyObject *self, void *c) {
  smpy_tensor *t = (smpy_tensor *)self;
  if (t->t.device == SMELT_DEVICE_CPU) Py_RETURN_NONE;
  return PyLong_FromVoidPtr(t->stream);
}

static PyObject *tensor_repr(PyObject *self) {
  smpy_tensor *t = (smpy_tensor *)self;
  PyObject *shape = tensor_get_shape(self, NULL), *dev = tensor_get_device(self, NULL);
  PyObject *r = NULL;
  if (shape && dev)
    r = PyUnicode_FromFormat("smelt.Tensor(shape=%R, dtype='%s', device='%U')", shape, smelt_dtype_name(t->t.dtype),
                             dev);
  Py_XDECREF(shape);
  Py_XDECREF(dev);
  return r;
}

static PyObject *tensor_new_py(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"shape", "dtype", "device", "ctx", NULL};
  PyObject *shape_obj, *dev = Py_None, *ctx_obj = Py_None;
  const char *dtname = "f32";
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|s$OO:Tensor", kwlist, &shape_obj, &dtname, &dev, &ctx_obj))
    return NULL;
  smelt_dtype dt;
  if (smelt_dtype_from_name(dtname, &dt))
    return smpy_raise(SMELT_STATUS_DTYPE_MISMATCH,
                      "smelt.Tensor: dtype \"%s\" is not one of f64 f32 f16 bf16 e4m3 e5m2 i8 i32 i64 u8 bool",
                      dtname);
  PyObject *seq = PySequence_Tuple(shape_obj);
  if (!seq) return NULL;
  Py_ssize_t n = PyTuple_Size(seq);
  int64_t shape[SMELT_MAX_DIMS];
  if (n > SMELT_MAX_DIMS) {
    Py_DECREF(seq);
    return smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.Tensor: %zd dims, at most %d", n, SMELT_MAX_DIMS);
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    shape[i] = PyLong_AsLongLong(PyTuple_GetItem(seq, i));
    if (shape[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      return NULL;
    }
  }
  Py_DECREF(seq);
  smpy_ctx *c;
  if (ctx_obj != Py_None) {
    if (!PyObject_TypeCheck(ctx_obj, (PyTypeObject *)smpy_ctx_type)) {
      PyErr_SetString(PyExc_TypeError, "smelt.Tensor: ctx must be a smelt.Context");
      return NULL;
    }
    c = (smpy_ctx *)ctx_obj;
  } else {
    smelt_device_kind kind;
    int index;
    if (smpy_parse_device(dev, &kind, &index) < 0) return NULL;
    c = smpy_default_ctx(kind, index);
    if (!c) return NULL;
  }
  /* On CUDA the memory is ordered on the context's current stream. */
  return smpy_tensor_new(c, c->stream, dt, (int)n, shape);
}

static PyMethodDef tensor_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))tensor_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) -> PyCapsule"},
    {"__dlpack_device__", tensor_dlpack_device, METH_NOARGS, "__dlpack_device__() -> (device_type, device_id)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef tensor_getset[] = {
    {"shape", tensor_get_shape, NULL, "tuple of sizes", NULL},
    {"strides", tensor_get_strides, NULL, "tuple of strides in elements", NULL},
    {"ndim", tensor_get_ndim, NULL, "number of dims", NULL},
    {"dtype", tensor_get_dtype, NULL, "smelt dtype name ('f32', 'bf16', ...)", NULL},
    {"device", tensor_get_device, NULL, "'cpu' or 'cuda:N'", NULL},
    {"data_ptr", tensor_get_ptr, NULL, "address of the first element", NULL},
    {"nbytes", tensor_get_nbytes, NULL, "bytes allocated", NULL},
    {"context", tensor_get_ctx, NULL, "the smelt.Context that owns the memory", NULL},
    {"stream", tensor_get_stream, NULL, "CUstream handle the memory is ordered on (None on the CPU)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot tensor_slots[] = {
    {Py_tp_new, (void *)tensor_new_py},
    {Py_tp_dealloc, (void *)tensor_dealloc},
    {Py_tp_methods, tensor_methods},
    {Py_tp_getset, tensor_getset},
    {Py_tp_repr, (void *)tensor_repr},
    {Py_tp_doc, (void *)"Tensor(shape, dtype='f32', *, device=None, ctx=None)\n\n"
                        "Uninitialized contiguous memory owned by smelt (the context's pool on CUDA).\n"
                        "Ops return one when the inputs' framework cannot allocate outputs. Exports\n"
                        "DLPack: torch.from_dlpack(t) and numpy.from_dlpack(t) view it without a copy;\n"
                        "t.numpy() and numpy.asarray(t) too, bf16 and fp8 included (with ml_dtypes).\n"
                        "device=None: SMELT_DEVICE when set, else cuda when a GPU is present, else cpu."},
    {0, NULL}};

static PyType_Spec tensor_spec = {"smelt.Tensor", sizeof(smpy_tensor), 0, Py_TPFLAGS_DEFAULT, tensor_slots};

int smpy_tensor_type_init(PyObject *module) {
  return smpy_add_type(module, &tensor_spec, "Tensor", &smpy_tensor_type);
}
