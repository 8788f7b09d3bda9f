/* smelt._smelt: module setup, the exception classes, and smelt.info().
 *
 * Statuses map onto Python's built-in exception kinds so callers can catch
 * what they already know (ValueError for shapes and layouts, TypeError for
 * dtypes, RuntimeError for device/driver/compile trouble), while every class
 * also derives from smelt.Error and carries .status and .status_name. */
#include "smelt_py.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static PyObject *exc_error, *exc_argument, *exc_dtype, *exc_unsupported, *exc_oom, *exc_backend;

static PyObject *exc_for(smelt_status s) {
  switch (s) {
    case SMELT_STATUS_INVALID_ARGUMENT:
    case SMELT_STATUS_NULL_POINTER:
    case SMELT_STATUS_SHAPE_MISMATCH:
    case SMELT_STATUS_BAD_LAYOUT:
    case SMELT_STATUS_MISALIGNED:
    case SMELT_STATUS_OVERFLOW:
    case SMELT_STATUS_NOT_FOUND: return exc_argument;
    case SMELT_STATUS_DTYPE_MISMATCH: return exc_dtype;
    case SMELT_STATUS_UNSUPPORTED: return exc_unsupported;
    case SMELT_STATUS_OUT_OF_MEMORY: return exc_oom;
    default: return exc_backend;
  }
}

static PyObject *raise_msg(smelt_status s, const char *msg) {
  PyObject *cls = exc_for(s);
  PyObject *exc = PyObject_CallFunction(cls, "s", msg);
  if (!exc) return NULL;
  PyObject *code = PyLong_FromLong((long)s);
  PyObject *name = PyUnicode_FromString(smelt_status_name(s));
  if (!code || !name || PyObject_SetAttrString(exc, "status", code) < 0 ||
      PyObject_SetAttrString(exc, "status_name", name) < 0) {
    Py_XDECREF(code);
    Py_XDECREF(name);
    Py_DECREF(exc);
    return NULL;
  }
  Py_DECREF(code);
  Py_DECREF(name);
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
  return NULL;
}

/* The C layer names the fields of its descs and configs; a Python caller
 * passed keyword arguments, so messages name those instead. Longer names
 * first where one is the start of another. */
static const char *const py_names[][2] = {
    {"cfg.num_experts_per_tok", "k"},     {"cfg->num_experts_per_tok", "k"},  {"desc->window_left", "window[0]"},
    {"desc->window_right", "window[1]"},  {"desc->scale", "scale"},           {"desc->causal", "causal"},
    {"desc->max_seqlen_q", "max_seqlen_q"}, {"desc->max_seqlen_k", "max_seqlen_k"}, {"desc->act", "activation"},
    {"desc->slope", "slope"},             {"cfg.activation", "activation"},   {"cfg->activation", "activation"},
    {"cfg.query_norm", "query_norm"},     {"cfg->query_norm", "query_norm"},  {"cfg.norm_eps", "norm_eps"},
    {"cfg->norm_eps", "norm_eps"},        {"cfg.l2_eps", "l2_eps"},           {"cfg->l2_eps", "l2_eps"},
    {"cfg.gate", "gate"},                 {"cfg->gate", "gate"},              {"cfg.kernels", "kernels"},
    {"cfg->kernels", "kernels"},          {"opts.cache_mb", "cache_mb"},      {"o.cache_mb", "cache_mb"},
    {"opts.dtype", "dtype"},              {"o.dtype", "dtype"},
};

/* msg with every C name of py_names replaced, into out. */
static int name_char(char c) { return c == '_' || c == '.' || c == '>' || isalnum((unsigned char)c); }

static void python_names(const char *msg, char *out, size_t n) {
  size_t used = 0;
  for (const char *start = msg; *msg && used + 1 < n;) {
    size_t i = 0, len = 0;
    /* Whole names only: neither neighbour continues them. */
    for (; i < sizeof py_names / sizeof *py_names && (msg == start || !name_char(msg[-1])); i++) {
      len = strlen(py_names[i][0]);
      if (!strncmp(msg, py_names[i][0], len) && !name_char(msg[len]) && msg[len] != '-') break;
    }
    if (i < sizeof py_names / sizeof *py_names && (msg == start || !name_char(msg[-1]))) {
      used += (size_t)snprintf(out + used, n - used, "%s", py_names[i][1]);
      msg += len;
    } else {
      out[used++] = *msg++;
    }
    if (used >= n) used = n - 1;
  }
  out[used] = 0;
}

PyObject *smpy_raise_status(smelt_status s) {
  const char *m = smelt_last_error();
  char named[1100], buf[1200];
  python_names((m && *m) ? m : smelt_status_string(s), named, sizeof named);
  snprintf(buf, sizeof buf, "%s [%s]", named, smelt_status_name(s));
  return raise_msg(s, buf);
}

PyObject *smpy_raise(smelt_status s, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return raise_msg(s, buf);
}

const char *smpy_type_name(PyObject *obj, char *buf, size_t n) {
  PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__name__");
  PyObject *b = name ? PyUnicode_AsUTF8String(name) : NULL;
  snprintf(buf, n, "%s", b ? PyBytes_AsString(b) : "?");
  Py_XDECREF(name);
  Py_XDECREF(b);
  PyErr_Clear();
  return buf;
}

/* ---- info */

static int set_item(PyObject *d, const char *key, PyObject *v) {
  if (!v) return -1;
  int r = PyDict_SetItemString(d, key, v);
  Py_DECREF(v);
  return r;
}

static PyObject *device_dict(const smelt_device_info *di) {
  PyObject *d = PyDict_New();
  if (!d) return NULL;
  if (set_item(d, "name", PyUnicode_FromString(di->name)) || set_item(d, "index", PyLong_FromLong(di->index)) ||
      set_item(d, "sm_count", PyLong_FromLong(di->sm_count)) ||
      set_item(d, "compute_capability", Py_BuildValue("(ii)", di->cc_major, di->cc_minor)) ||
      set_item(d, "total_memory", PyLong_FromUnsignedLongLong(di->total_memory)) ||
      set_item(d, "l2_bytes", PyLong_FromUnsignedLongLong(di->l2_bytes)) ||
      set_item(d, "smem_per_block_optin", PyLong_FromLong(di->smem_per_block_optin)) ||
      set_item(d, "arch", PyUnicode_FromString(di->arch))) {
    Py_DECREF(d);
    return NULL;
  }
  return d;
}

static PyObject *py_info(PyObject *self, PyObject *unused) {
  smelt_system_info si;
  smelt_status s = smelt_system_info_get(&si);
  if (s) return smpy_raise_status(s);
  PyObject *d = PyDict_New();
  if (!d) return NULL;
  PyObject *nv = si.nvrtc_loaded ? PyUnicode_FromFormat("%d.%d", si.nvrtc_major, si.nvrtc_minor)
                                 : (Py_INCREF(Py_None), Py_None);
  if (set_item(d, "version", PyUnicode_FromString(smelt_version_string())) ||
      set_item(d, "driver_loaded", PyBool_FromLong(si.driver_loaded)) ||
      set_item(d, "driver_version", PyLong_FromLong(si.driver_version)) ||
      set_item(d, "driver_error", PyUnicode_FromString(si.driver_error)) ||
      set_item(d, "nvrtc_loaded", PyBool_FromLong(si.nvrtc_loaded)) || set_item(d, "nvrtc_version", nv) ||
      set_item(d, "nvrtc_path", PyUnicode_FromString(si.nvrtc_path)) ||
      set_item(d, "nvrtc_error", PyUnicode_FromString(si.nvrtc_error)) ||
      set_item(d, "device_count", PyLong_FromLong(si.device_count)) ||
      set_item(d, "cache_dir", PyUnicode_FromString(si.cache_dir)) ||
      set_item(d, "cache_bytes", PyLong_FromUnsignedLongLong(si.cache_bytes)) ||
      set_item(d, "cache_entries", PyLong_FromUnsignedLongLong(si.cache_entries)) ||
      set_item(d, "cache_error", PyUnicode_FromString(si.cache_error))) {
    Py_DECREF(d);
    return NULL;
  }
  PyObject *devs = PyList_New(0);
  if (!devs) {
    Py_DECREF(d);
    return NULL;
  }
  for (int i = 0; i < si.device_count; i++) {
    smelt_device_info di;
    s = smelt_device_info_get(i, &di);
    PyObject *dd = s ? (smpy_raise_status(s), NULL) : device_dict(&di);
    if (!dd || PyList_Append(devs, dd) < 0) {
      Py_XDECREF(dd);
      Py_DECREF(devs);
      Py_DECREF(d);
      return NULL;
    }
    Py_DECREF(dd);
  }
  if (set_item(d, "devices", devs)) {
    Py_DECREF(d);
    return NULL;
  }
  return d;
}

static PyObject *py_default_context(PyObject *self, PyObject *args) {
  PyObject *dev = Py_None;
  if (!PyArg_ParseTuple(args, "|O:default_context", &dev)) return NULL;
  smelt_device_kind kind;
  int index = 0;
  if (smpy_parse_device(dev, &kind, &index) < 0) return NULL;
  PyObject *c = (PyObject *)smpy_default_ctx(kind, index);
  Py_XINCREF(c);
  return c;
}

static PyMethodDef module_methods[] = {
    {"info", py_info, METH_NOARGS,
     "info() -> dict\n\nsmelt's version, CUDA driver and NVRTC status (with the reason when either is\n"
     "missing), the kernel cache folder and size, and one dict per CUDA device."},
    {"default_context", py_default_context, METH_VARARGS,
     "default_context(device=None) -> Context\n\nThe process-wide context ops use for tensors on `device` "
     "('cpu', 'cuda', 'cuda:N')\nwhen no ctx= is given. Created on first use. None: SMELT_DEVICE when set, else\n"
     "cuda when a GPU is present, else cpu."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_smelt",
    .m_doc = "smelt's C extension: DLPack tensors in, smelt ops, contexts.",
    .m_size = -1,
};

static PyObject *new_exc(PyObject *m, const char *name, PyObject *base2, const char *doc) {
  PyObject *bases = base2 ? PyTuple_Pack(2, exc_error, base2) : PyTuple_Pack(1, PyExc_Exception);
  if (!bases) return NULL;
  char full[64];
  snprintf(full, sizeof full, "smelt.%s", name);
  PyObject *cls = PyErr_NewExceptionWithDoc(full, doc, bases, NULL);
  Py_DECREF(bases);
  if (!cls) return NULL;
  Py_INCREF(cls);
  if (PyModule_AddObject(m, name, cls) < 0) {
    Py_DECREF(cls);
    Py_DECREF(cls);
    return NULL;
  }
  return cls; /* the module holds one reference, this static the other */
}

int smpy_add_type(PyObject *module, PyType_Spec *spec, const char *name, PyObject **type) {
  *type = PyType_FromSpec(spec);
  if (!*type) return -1;
  Py_INCREF(*type);
  if (PyModule_AddObject(module, name, *type) < 0) {
    Py_DECREF(*type);
    return -1;
  }
  return 0;
}

static int add_methods(PyObject *m, PyMethodDef *defs) {
  PyObject *name = PyModule_GetNameObject(m);
  if (!name) return -1;
  for (PyMethodDef *d = defs; d->ml_name; d++) {
    PyObject *f = PyCFunction_NewEx(d, NULL, name);
    if (!f || PyModule_AddObject(m, d->ml_name, f) < 0) {
      Py_XDECREF(f);
      Py_DECREF(name);
      return -1;
    }
  }
  Py_DECREF(name);
  return 0;
}

PyMODINIT_FUNC PyInit__smelt(void) {
  module_def.m_methods = module_methods;
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return NULL;
  if (!(exc_error = new_exc(m, "Error", NULL,
                            "Base class of every error smelt raises; .status is the smelt_status value "
                            "and .status_name its name.")) ||
      !(exc_argument = new_exc(m, "ArgumentError", PyExc_ValueError,
                               "Bad shapes, layouts, strides, alignment or argument values.")) ||
      !(exc_dtype = new_exc(m, "DTypeError", PyExc_TypeError, "Unsupported or mismatched dtypes.")) ||
      !(exc_unsupported = new_exc(m, "UnsupportedError", PyExc_NotImplementedError,
                                  "A configuration smelt does not implement (a RuntimeError).")) ||
      !(exc_oom = new_exc(m, "OutOfMemoryError", PyExc_RuntimeError, "Device or host memory exhausted.")) ||
      !(exc_backend = new_exc(m, "BackendError", PyExc_RuntimeError,
                              "Device, driver, compilation, cache and other run-time failures.")) ||
      add_methods(m, smpy_op_methods) < 0 || add_methods(m, smpy_peer_methods) < 0 ||
      add_methods(m, smpy_moe_methods) < 0 || add_methods(m, smpy_epi_methods) < 0 ||
      add_methods(m, smpy_bem_methods) < 0 ||
      add_methods(m, smpy_dlpack_methods) < 0 || smpy_ctx_type_init(m) < 0 || smpy_tensor_type_init(m) < 0 ||
      smpy_store_type_init(m) < 0 || smpy_graph_type_init(m) < 0 ||
      smpy_ops_init(m) < 0 || PyModule_AddStringConstant(m, "__version__", smelt_version_string()) < 0 ||
      PyModule_AddIntConstant(m, "MAX_DIMS", SMELT_MAX_DIMS) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
