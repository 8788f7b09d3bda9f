/* DLPack consumption: any object with __dlpack__/__dlpack_device__ becomes a
 * smelt_tensor view, with no copy.
 *
 * Two roads, one meaning:
 *   - The exchange API (DLPack 1.2+; torch >= 2.10 publishes it on its tensor
 *     type). C function pointers give the tensor's DLTensor and the producer's
 *     current stream without running Python code. It never synchronizes, so it
 *     is only taken when we launch on exactly the producer's current stream,
 *     which is what __dlpack__(stream=that stream) would have arranged anyway.
 *   - The Python protocol: __dlpack_device__(), then
 *     __dlpack__(max_version=(1, 1), stream=S) for CUDA tensors (S = the stream
 *     the launch will use, so the producer orders its pending work before it),
 *     falling back to the legacy call without max_version on TypeError. The
 *     capsule ("dltensor_versioned" or "dltensor") is renamed "used_..." and its
 *     deleter is called when the op has been queued.
 *
 * Launch stream: an explicit stream= wins; otherwise the current stream of the
 * first tensor's framework when it publishes the exchange API (torch's
 * current stream for torch tensors); otherwise the legacy default stream, which
 * orders itself with every blocking stream. */
#include "smelt_py.h"

#include <stddef.h>
#include <string.h>

/* ---- exchange API lookup, cached per type */

typedef struct api_entry {
  PyObject *type;
  const smpy_dl_exchange_api *api;
} api_entry;

#define API_CACHE 16
static api_entry api_cache[API_CACHE];
static int api_count;
static int use_exchange_api = 1;

static const smpy_dl_exchange_api *api_from_attr(PyObject *o) {
  const smpy_dl_exchange_api *api = NULL;
  if (PyCapsule_CheckExact(o)) {
    api = (const smpy_dl_exchange_api *)PyCapsule_GetPointer(o, "dlpack_exchange_api");
  } else if (PyLong_Check(o)) {
    api = (const smpy_dl_exchange_api *)PyLong_AsVoidPtr(o);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    api = NULL;
  }
  /* A newer major version may chain to an older table we understand. */
  while (api && api->header.version.major != 1) api = (const smpy_dl_exchange_api *)api->header.prev_api;
  if (api && (!api->current_work_stream ||
              (!api->dltensor_from_py_object_no_sync && !api->managed_tensor_from_py_object_no_sync)))
    api = NULL;
  return api;
}

static const smpy_dl_exchange_api *lookup_api(PyObject *obj) {
  if (!use_exchange_api) return NULL;
  PyObject *tp = (PyObject *)Py_TYPE(obj);
  for (int i = 0; i < api_count; i++)
    if (api_cache[i].type == tp) return api_cache[i].api;
  const smpy_dl_exchange_api *api = NULL;
  static const char *names[] = {"__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__"};
  for (int i = 0; i < 2 && !api; i++) {
    PyObject *o = PyObject_GetAttrString(tp, names[i]);
    if (!o) {
      PyErr_Clear();
      continue;
    }
    api = api_from_attr(o);
    Py_DECREF(o); /* the table itself lives for the whole process (DLPack requires it) */
  }
  if (api_count < API_CACHE) {
    Py_INCREF(tp);
    api_cache[api_count].type = tp;
    api_cache[api_count].api = api;
    api_count++;
  }
  return api;
}

static PyObject *py_use_exchange_api(PyObject *self, PyObject *args) {
  int on = 1;
  if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
  int prev = use_exchange_api;
  use_exchange_api = on;
  return PyBool_FromLong(prev);
}

PyMethodDef smpy_dlpack_methods[] = {
    {"_use_exchange_api", py_use_exchange_api, METH_VARARGS,
     "_use_exchange_api(on) -> previous\n\nFor tests: turns the DLPack exchange-API fast path on or off."},
    {NULL, NULL, 0, NULL}};

/* ---- dtypes and devices */

smpy_dl_dtype smpy_dl_dtype_of(smelt_dtype dt) {
  smpy_dl_dtype d = {SMPY_DL_FLOAT, 32, 1};
  switch (dt) {
    case SMELT_DTYPE_F64: d.code = SMPY_DL_FLOAT, d.bits = 64; break;
    case SMELT_DTYPE_F32: d.code = SMPY_DL_FLOAT, d.bits = 32; break;
    case SMELT_DTYPE_F16: d.code = SMPY_DL_FLOAT, d.bits = 16; break;
    case SMELT_DTYPE_BF16: d.code = SMPY_DL_BFLOAT, d.bits = 16; break;
    case SMELT_DTYPE_E4M3: d.code = SMPY_DL_FLOAT8_E4M3FN, d.bits = 8; break;
    case SMELT_DTYPE_E5M2: d.code = SMPY_DL_FLOAT8_E5M2, d.bits = 8; break;
    case SMELT_DTYPE_I8: d.code = SMPY_DL_INT, d.bits = 8; break;
    case SMELT_DTYPE_I32: d.code = SMPY_DL_INT, d.bits = 32; break;
    case SMELT_DTYPE_I64: d.code = SMPY_DL_INT, d.bits = 64; break;
    case SMELT_DTYPE_U8: d.code = SMPY_DL_UINT, d.bits = 8; break;
    case SMELT_DTYPE_BOOL: d.code = SMPY_DL_BOOL, d.bits = 8; break;
    default: break;
  }
  return d;
}

static int dtype_from_dl(smpy_dl_dtype d, smelt_dtype *out) {
  if (d.lanes != 1) return -1;
  switch (d.code) {
    case SMPY_DL_FLOAT:
      if (d.bits == 64) return *out = SMELT_DTYPE_F64, 0;
      if (d.bits == 32) return *out = SMELT_DTYPE_F32, 0;
      if (d.bits == 16) return *out = SMELT_DTYPE_F16, 0;
      return -1;
    case SMPY_DL_BFLOAT: return d.bits == 16 ? (*out = SMELT_DTYPE_BF16, 0) : -1;
    case SMPY_DL_FLOAT8_E4M3FN: return d.bits == 8 ? (*out = SMELT_DTYPE_E4M3, 0) : -1;
    case SMPY_DL_FLOAT8_E5M2: return d.bits == 8 ? (*out = SMELT_DTYPE_E5M2, 0) : -1;
    case SMPY_DL_INT:
      if (d.bits == 8) return *out = SMELT_DTYPE_I8, 0;
      if (d.bits == 32) return *out = SMELT_DTYPE_I32, 0;
      if (d.bits == 64) return *out = SMELT_DTYPE_I64, 0;
      return -1;
    case SMPY_DL_UINT: return d.bits == 8 ? (*out = SMELT_DTYPE_U8, 0) : -1;
    case SMPY_DL_BOOL: return d.bits == 8 ? (*out = SMELT_DTYPE_BOOL, 0) : -1;
    default: return -1;
  }
}

static const char *dl_code_name(int code) {
  static const char *names[] = {"int",         "uint",          "float",         "opaque",
                                "bfloat",      "complex",       "bool",          "float8_e3m4",
                                "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
                                "float8_e5m2", "float8_e5m2fnuz",    "float8_e8m0fnu"};
  return code >= 0 && code < (int)(sizeof names / sizeof names[0]) ? names[code] : "unknown";
}

static const char *dl_device_name(int type) {
  switch (type) {
    case SMPY_DL_CPU: return "cpu";
    case SMPY_DL_CUDA: return "cuda";
    case SMPY_DL_CUDA_HOST: return "cuda_host";
    case SMPY_DL_OPENCL: return "opencl";
    case SMPY_DL_VULKAN: return "vulkan";
    case SMPY_DL_METAL: return "metal";
    case SMPY_DL_ROCM: return "rocm";
    case SMPY_DL_ROCM_HOST: return "rocm_host";
    case SMPY_DL_CUDA_MANAGED: return "cuda_managed";
    case SMPY_DL_ONEAPI: return "oneapi";
    default: return "unknown";
  }
}

static int is_cuda_type(int type) { return type == SMPY_DL_CUDA || type == SMPY_DL_CUDA_MANAGED; }

static int device_from_dl(const smpy_call *call, const char *name, int type, int id, smelt_device_kind *kind,
                          int *index) {
  if (type == SMPY_DL_CPU || type == SMPY_DL_CUDA_HOST) {
    *kind = SMELT_DEVICE_CPU;
    *index = 0;
    return 0;
  }
  if (is_cuda_type(type)) {
    *kind = SMELT_DEVICE_CUDA;
    *index = id;
    return 0;
  }
  smpy_raise(SMELT_STATUS_WRONG_DEVICE,
             "%s: %s is on DLPack device type %d (%s); smelt takes CPU and CUDA tensors", call->op, name, type,
             dl_device_name(type));
  return -1;
}

/* The first tensor picks the default context (unless ctx= was given). */
static int decide_ctx(smpy_call *call, const char *name, int type, int id) {
  smelt_device_kind kind = SMELT_DEVICE_CPU;
  int index = 0;
  if (device_from_dl(call, name, type, id, &kind, &index) < 0) return -1;
  if (!call->ctx) {
    call->ctx = smpy_default_ctx(kind, index);
    if (!call->ctx) return -1;
  }
  return 0;
}

static int ctx_is_cuda(const smpy_call *call) { return smelt_ctx_device(call->ctx->ctx) == SMELT_DEVICE_CUDA; }

/* `as`, when not NULL, is the dtype of an ml_dtypes array seen through its
 * integer view (ml_dtypes_view). */
static int convert(const smpy_call *call, const char *name, const smpy_dl_tensor *d, const smelt_dtype *as,
                   smelt_tensor *t) {
  if (d->ndim < 0 || d->ndim > SMELT_MAX_DIMS) {
    smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s has %d dims; smelt takes at most %d", call->op, name,
               (int)d->ndim, SMELT_MAX_DIMS);
    return -1;
  }
  if (as) {
    t->dtype = *as;
  } else if (dtype_from_dl(d->dtype, &t->dtype) < 0) {
    smpy_raise(SMELT_STATUS_DTYPE_MISMATCH,
               "%s: %s has DLPack dtype %s%d (code %d, lanes %d); smelt takes float64/32/16, bfloat16, "
               "float8_e4m3fn, float8_e5m2, int8/32/64, uint8 and bool",
               call->op, name, dl_code_name(d->dtype.code), d->dtype.bits, d->dtype.code, d->dtype.lanes);
    return -1;
  }
  smelt_device_kind kind = SMELT_DEVICE_CPU;
  if (device_from_dl(call, name, d->device.device_type, d->device.device_id, &kind, &t->device_index) < 0) return -1;
  t->device = kind;
  t->ndim = d->ndim;
  t->data = d->data ? (void *)((char *)d->data + d->byte_offset) : NULL;
  /* An empty array's strides mean nothing (numpy reports 0s): it gets the
   * row-major ones, so every check and plan sees one layout for it. */
  int empty = 0;
  for (int i = 0; i < d->ndim; i++) empty |= d->shape[i] == 0;
  int64_t stride = 1;
  for (int i = d->ndim - 1; i >= 0; i--) {
    t->shape[i] = d->shape[i];
    t->strides[i] = d->strides && !empty ? d->strides[i] : stride;
    stride *= d->shape[i] > 0 ? d->shape[i] : 1;
  }
  return 0;
}

/* ---- streams */

int smpy_parse_stream(PyObject *obj, void **out) {
  PyObject *v = NULL;
  if (PyLong_Check(obj)) {
    Py_INCREF(obj);
    v = obj;
  } else if (PyObject_HasAttrString(obj, "__cuda_stream__")) { /* CUDA stream protocol: (version, handle) */
    PyObject *r = PyObject_CallMethod(obj, "__cuda_stream__", NULL);
    if (!r) return -1;
    v = PySequence_GetItem(r, 1);
    Py_DECREF(r);
  } else if (PyObject_HasAttrString(obj, "cuda_stream")) { /* torch.cuda.Stream */
    v = PyObject_GetAttrString(obj, "cuda_stream");
  } else if (PyObject_HasAttrString(obj, "ptr")) { /* cupy.cuda.Stream */
    v = PyObject_GetAttrString(obj, "ptr");
  } else {
    PyErr_Format(PyExc_TypeError,
                 "smelt: stream must be None, an int CUstream handle, or a stream object (torch.cuda.Stream, "
                 "cupy Stream, or one with __cuda_stream__), got %R",
                 (PyObject *)Py_TYPE(obj));
    return -1;
  }
  if (!v) return -1;
  long long n = PyLong_AsLongLong(v);
  Py_DECREF(v);
  if (n == -1 && PyErr_Occurred()) return -1;
  if (n < 0) {
    smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt: stream=%lld is not a CUstream handle", n);
    return -1;
  }
  *out = (void *)(uintptr_t)n;
  return 0;
}

PyObject *smpy_dlpack_stream_int(void *stream) {
  return PyLong_FromVoidPtr(stream ? stream : (void *)(uintptr_t)1); /* 1 = the legacy default stream */
}

/* ---- the call */

int smpy_call_begin(smpy_call *call, const char *op, PyObject *ctx, PyObject *stream) {
  call->op = op;
  call->ctx = NULL;
  call->stream_mode = 0;
  call->stream_known = 0;
  call->stream = NULL;
  call->first_api = NULL;
  call->nargs = 0;
  if (ctx && ctx != Py_None) {
    if (!PyObject_TypeCheck(ctx, (PyTypeObject *)smpy_ctx_type)) {
      PyErr_Format(PyExc_TypeError, "%s: ctx must be a smelt.Context or None, got %R", op, (PyObject *)Py_TYPE(ctx));
      return -1;
    }
    call->ctx = (smpy_ctx *)ctx;
  }
  if (stream && stream != Py_None) {
    if (smpy_parse_stream(stream, &call->stream) < 0) return -1;
    call->stream_mode = 1;
    call->stream_known = 1;
  }
  return 0;
}

void smpy_call_end(smpy_call *call) {
  /* Deleters may run Python code (numpy's drops a reference): park any
   * pending exception while they run. */
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  for (int i = 0; i < call->nargs; i++) {
    smpy_arg *a = &call->args[i];
    if (!a->owner) continue;
    if (a->versioned) {
      smpy_dl_managed_v *m = (smpy_dl_managed_v *)a->owner;
      if (m->deleter) m->deleter(m);
    } else {
      smpy_dl_managed *m = (smpy_dl_managed *)a->owner;
      if (m->deleter) m->deleter(m);
    }
    a->owner = NULL;
  }
  call->nargs = 0;
  if (PyErr_Occurred()) PyErr_WriteUnraisable(NULL); /* a deleter failed: nowhere to report it */
  PyErr_Restore(type, value, tb);
}

static smpy_arg *next_arg(smpy_call *call) {
  if (call->nargs >= SMPY_MAX_ARGS) {
    smpy_raise(SMELT_STATUS_INTERNAL, "%s: too many tensor arguments", call->op);
    return NULL;
  }
  smpy_arg *a = &call->args[call->nargs];
  a->owner = NULL;
  a->versioned = 0;
  return a;
}

static int check_flags(const smpy_call *call, const char *name, uint64_t flags, int writable) {
  if (!writable) return 0;
  if (flags & SMPY_DL_FLAG_READ_ONLY) {
    smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s is read-only (DLPack READ_ONLY flag) and cannot be written",
               call->op, name);
    return -1;
  }
  if (flags & SMPY_DL_FLAG_IS_COPIED) {
    smpy_raise(SMELT_STATUS_INVALID_ARGUMENT,
               "%s: the producer of %s exported a copy (DLPack IS_COPIED flag); results written there would be lost",
               call->op, name);
    return -1;
  }
  return 0;
}

/* Fast road. Returns 1 when imported, 0 to take the Python protocol, -1 on error. */
static int import_exchange(smpy_call *call, const smpy_dl_exchange_api *api, PyObject *obj, const char *name,
                           int writable, smpy_arg *a) {
  smpy_dl_tensor view;
  smpy_dl_managed_v *mt = NULL;
  const smpy_dl_tensor *d;
  if (api->dltensor_from_py_object_no_sync) {
    if (api->dltensor_from_py_object_no_sync(obj, &view) != 0) return -1;
    d = &view;
  } else {
    if (api->managed_tensor_from_py_object_no_sync(obj, &mt) != 0) return -1;
    d = &mt->dl_tensor;
    a->owner = mt;
    a->versioned = 1;
    call->nargs++; /* released by smpy_call_end whatever happens next */
  }
  if (decide_ctx(call, name, d->device.device_type, d->device.device_id) < 0) return -1;
  if (is_cuda_type(d->device.device_type) && ctx_is_cuda(call)) {
    void *cur = NULL;
    if (api->current_work_stream(SMPY_DL_CUDA, d->device.device_id, &cur) != 0) return -1;
    if (!call->stream_known) {
      call->stream = cur;
      call->stream_known = 1;
    }
    if (cur != call->stream) { /* another stream: let __dlpack__ order the producer's work */
      if (mt) {
        call->nargs--;
        a->owner = NULL;
        if (mt->deleter) mt->deleter(mt);
      }
      return 0;
    }
  }
  if (mt && check_flags(call, name, mt->flags, writable) < 0) return -1;
  if (convert(call, name, d, NULL, &a->t) < 0) return -1;
  if (!mt) call->nargs++;
  return 1;
}

/* The current stream of a producer without the exchange API, for the two
 * frameworks that have one: torch older than 2.10 and cupy. Returns 1 when
 * found, 0 when the producer has no notion of one, -1 on error. */
static int producer_stream(PyObject *obj, int device_id, void **out) {
  PyObject *mod = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__module__");
  if (!mod) {
    PyErr_Clear();
    return 0;
  }
  PyObject *r = NULL;
  PyObject *b = PyUnicode_Check(mod) ? PyUnicode_AsUTF8String(mod) : NULL;
  Py_DECREF(mod);
  if (!b) {
    PyErr_Clear();
    return 0;
  }
  const char *m = PyBytes_AsString(b);
  int torch_ = !strcmp(m, "torch");
  int cupy_ = !strncmp(m, "cupy", 4);
  Py_DECREF(b);
  if (torch_) { /* torch.cuda.current_stream(device_id).cuda_stream */
    PyObject *torch = PyImport_ImportModule("torch.cuda");
    if (!torch) return -1;
    PyObject *s = PyObject_CallMethod(torch, "current_stream", "i", device_id);
    Py_DECREF(torch);
    if (!s) return -1;
    r = PyObject_GetAttrString(s, "cuda_stream");
    Py_DECREF(s);
  } else if (cupy_) { /* cupy.cuda.get_current_stream().ptr */
    PyObject *cupy = PyImport_ImportModule("cupy.cuda");
    if (!cupy) return -1;
    PyObject *s = PyObject_CallMethod(cupy, "get_current_stream", NULL);
    Py_DECREF(cupy);
    if (!s) return -1;
    r = PyObject_GetAttrString(s, "ptr");
    Py_DECREF(s);
  } else {
    return 0;
  }
  if (!r) return -1;
  *out = PyLong_AsVoidPtr(r);
  Py_DECREF(r);
  return PyErr_Occurred() ? -1 : 1;
}

static int import_protocol(smpy_call *call, PyObject *obj, const char *name, int writable, const smelt_dtype *as,
                           smpy_arg *a) {
  PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
  if (!dev) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      char tn[128];
      smpy_raise(SMELT_STATUS_DTYPE_MISMATCH,
                 "%s: %s must be a DLPack tensor (numpy, torch, cupy, jax, ... with __dlpack__ and "
                 "__dlpack_device__), got %s",
                 call->op, name, smpy_type_name(obj, tn, sizeof tn));
    }
    return -1;
  }
  int type = -1, id = -1;
  PyObject *t0 = PySequence_Check(dev) && PySequence_Size(dev) == 2 ? PySequence_GetItem(dev, 0) : NULL;
  PyObject *t1 = t0 ? PySequence_GetItem(dev, 1) : NULL;
  Py_DECREF(dev);
  if (t0 && t1) {
    type = (int)PyLong_AsLong(t0);
    id = (int)PyLong_AsLong(t1);
  }
  Py_XDECREF(t0);
  Py_XDECREF(t1);
  if (PyErr_Occurred()) return -1;
  if (!t0 || !t1) {
    PyErr_Format(PyExc_TypeError, "%s: %s.__dlpack_device__() did not return (device_type, device_id)", call->op,
                 name);
    return -1;
  }
  if (decide_ctx(call, name, type, id) < 0) return -1;
  int pass_stream = is_cuda_type(type) && ctx_is_cuda(call);
  if (pass_stream && !call->stream_known) {
    int found = producer_stream(obj, id, &call->stream);
    if (found < 0) return -1;
    if (!found) call->stream = NULL; /* the legacy default stream */
    call->stream_known = 1;
  }

  PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
  if (!meth) return -1;
  PyObject *empty = PyTuple_New(0);
  PyObject *kw = PyDict_New();
  PyObject *stream = pass_stream ? smpy_dlpack_stream_int(call->stream) : NULL;
  PyObject *maxv = Py_BuildValue("(ii)", 1, 1);
  PyObject *cap = NULL;
  if (empty && kw && maxv && (!pass_stream || stream) && PyDict_SetItemString(kw, "max_version", maxv) == 0 &&
      (!pass_stream || PyDict_SetItemString(kw, "stream", stream) == 0)) {
    cap = PyObject_Call(meth, empty, kw);
    if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
      /* A pre-1.0 producer: no max_version keyword. */
      PyErr_Clear();
      PyDict_DelItemString(kw, "max_version");
      cap = PyObject_Call(meth, empty, kw);
    }
  }
  Py_DECREF(meth);
  Py_XDECREF(empty);
  Py_XDECREF(kw);
  Py_XDECREF(stream);
  Py_XDECREF(maxv);
  if (!cap) return -1;

  const smpy_dl_tensor *d = NULL;
  uint64_t flags = 0;
  if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    smpy_dl_managed_v *m = (smpy_dl_managed_v *)PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (!m || PyCapsule_SetName(cap, "used_dltensor_versioned") < 0) {
      Py_DECREF(cap);
      return -1;
    }
    a->owner = m;
    a->versioned = 1;
    call->nargs++;
    Py_DECREF(cap);
    if (m->version.major != 1) {
      smpy_raise(SMELT_STATUS_UNSUPPORTED, "%s: %s came as DLPack %u.%u; smelt reads DLPack 1.x", call->op, name,
                 m->version.major, m->version.minor);
      return -1;
    }
    d = &m->dl_tensor;
    flags = m->flags;
  } else if (PyCapsule_IsValid(cap, "dltensor")) {
    smpy_dl_managed *m = (smpy_dl_managed *)PyCapsule_GetPointer(cap, "dltensor");
    if (!m || PyCapsule_SetName(cap, "used_dltensor") < 0) {
      Py_DECREF(cap);
      return -1;
    }
    a->owner = m;
    a->versioned = 0;
    call->nargs++;
    Py_DECREF(cap);
    d = &m->dl_tensor;
  } else {
    PyErr_Format(PyExc_TypeError, "%s: %s.__dlpack__() returned %R, not an unconsumed DLPack capsule", call->op, name,
                 (PyObject *)Py_TYPE(cap));
    Py_DECREF(cap);
    return -1;
  }
  if (check_flags(call, name, flags, writable) < 0) return -1;
  return convert(call, name, d, as, &a->t);
}

/* numpy has no bf16 or fp8 of its own; ml_dtypes adds them, but numpy's
 * __dlpack__ refuses them. Such an array goes in as its same-size integer
 * view (whose capsule keeps the view, and so the array, alive) and takes
 * its dtype back after. Returns 1 with *view and *dt set, 0 when obj is not
 * one, -1 on an error. */
static int ml_dtypes_view(PyObject *obj, PyObject **view, smelt_dtype *dt) {
  static const struct {
    const char *name, *as;
    smelt_dtype dt;
  } types[] = {{"bfloat16", "uint16", SMELT_DTYPE_BF16},
               {"float8_e4m3fn", "uint8", SMELT_DTYPE_E4M3},
               {"float8_e5m2", "uint8", SMELT_DTYPE_E5M2}};
  PyObject *mod = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__module__");
  int numpy = mod && PyUnicode_Check(mod) && PyUnicode_CompareWithASCIIString(mod, "numpy") == 0;
  Py_XDECREF(mod);
  PyErr_Clear();
  if (!numpy) return 0;
  PyObject *dtype = PyObject_GetAttrString(obj, "dtype");
  PyObject *name = dtype ? PyObject_GetAttrString(dtype, "name") : NULL;
  Py_XDECREF(dtype);
  if (!name) return -1;
  int r = 0;
  for (size_t i = 0; i < sizeof types / sizeof *types && !r && PyUnicode_Check(name); i++) {
    if (PyUnicode_CompareWithASCIIString(name, types[i].name)) continue;
    *view = PyObject_CallMethod(obj, "view", "s", types[i].as);
    *dt = types[i].dt;
    r = *view ? 1 : -1;
  }
  Py_DECREF(name);
  return r;
}

int smpy_call_import(smpy_call *call, PyObject *obj, const char *name, int writable, smelt_tensor **out) {
  smpy_arg *a = next_arg(call);
  if (!a) return -1;
  const smpy_dl_exchange_api *api = lookup_api(obj);
  if (call->nargs == 0 && !call->first_api) call->first_api = api;
  if (api) {
    int r = import_exchange(call, api, obj, name, writable, a);
    if (r < 0) return -1;
    if (r == 1) {
      *out = &a->t;
      return 0;
    }
  }
  PyObject *view = NULL;
  smelt_dtype dt = SMELT_DTYPE_F32;
  const int ml = ml_dtypes_view(obj, &view, &dt);
  if (ml < 0) return -1;
  const int r = import_protocol(call, ml ? view : obj, name, writable, ml ? &dt : NULL, a);
  Py_XDECREF(view);
  if (r < 0) return -1;
  *out = &a->t;
  return 0;
}

/* ---- outputs */

typedef struct alloc_error {
  char kind[64];
  char message[512];
  int set;
} alloc_error;

static void set_alloc_error(void *ctx, const char *kind, const char *message) {
  alloc_error *e = (alloc_error *)ctx;
  snprintf(e->kind, sizeof e->kind, "%s", kind ? kind : "RuntimeError");
  snprintf(e->message, sizeof e->message, "%s", message ? message : "");
  e->set = 1;
}

PyObject *smpy_call_alloc(smpy_call *call, smelt_dtype dt, int ndim, const int64_t *shape) {
  const smpy_dl_exchange_api *api = call->first_api;
  if (api && api->managed_tensor_allocator && api->managed_tensor_to_py_object_no_sync) {
    int64_t shp[SMELT_MAX_DIMS];
    for (int i = 0; i < ndim; i++) shp[i] = shape[i];
    smpy_dl_tensor proto;
    memset(&proto, 0, sizeof proto);
    int cuda = ctx_is_cuda(call);
    proto.device.device_type = cuda ? SMPY_DL_CUDA : SMPY_DL_CPU;
    proto.device.device_id = cuda ? smelt_ctx_device_index(call->ctx->ctx) : 0;
    proto.ndim = ndim;
    proto.dtype = smpy_dl_dtype_of(dt);
    proto.shape = shp;
    proto.strides = NULL;
    smpy_dl_managed_v *mt = NULL;
    alloc_error err;
    err.set = 0;
    if (api->managed_tensor_allocator(&proto, &mt, &err, set_alloc_error) != 0 || !mt) {
      if (PyErr_Occurred()) return NULL;
      PyObject *cls = !strcmp(err.kind, "MemoryError")  ? PyExc_MemoryError
                      : !strcmp(err.kind, "TypeError")  ? PyExc_TypeError
                      : !strcmp(err.kind, "ValueError") ? PyExc_ValueError
                                                        : PyExc_RuntimeError;
      PyErr_Format(cls, "%s: allocating an output failed: %s", call->op, err.set ? err.message : "(no message)");
      return NULL;
    }
    void *py = NULL;
    if (api->managed_tensor_to_py_object_no_sync(mt, &py) != 0 || !py) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "%s: wrapping an output failed", call->op);
      return NULL;
    }
    return (PyObject *)py;
  }
  return smpy_tensor_new(call->ctx, call->stream, dt, ndim, shape);
}

int smpy_out_arg(smpy_call *call, PyObject *given, const char *name, smelt_dtype dt, int ndim, const int64_t *shape,
                 PyObject **slot, smelt_tensor **t) {
  *t = NULL;
  if (given == Py_None) {
    Py_INCREF(Py_None);
    *slot = Py_None;
    return 0;
  }
  if (given == Py_True) {
    if (!(*slot = smpy_call_alloc(call, dt, ndim, shape))) return -1;
  } else {
    Py_INCREF(given);
    *slot = given;
  }
  return smpy_call_import(call, *slot, name, 1, t);
}
