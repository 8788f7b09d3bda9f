/* smelt.Context: a smelt_ctx plus a lock and a plan cache.
 *
 * Ops are planned once per distinct (op, parameters, tensor layouts) and the
 * plan is reused: a one-shot call would re-validate and re-hash the kernel
 * source on every call, which costs more than the launch itself. The cache is
 * direct-mapped (SMPY_PLAN_SLOTS entries; a collision replaces the old plan).
 *
 * Threads: every use of a smelt_ctx happens under the context's lock. The GIL
 * is released while waiting for the lock, while CPU ops run and while a plan
 * is made (that may compile a kernel); the CUDA launch path keeps the GIL,
 * since it is shorter than the GIL hand-off would be. */
#include "smelt_py.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

PyObject *smpy_ctx_type;

#define SMPY_MAX_DEFAULT 64
static smpy_ctx *default_cpu;
static smpy_ctx *default_cuda[SMPY_MAX_DEFAULT];

void smpy_ctx_lock(smpy_ctx *c) {
  if (PyThread_acquire_lock(c->lock, NOWAIT_LOCK)) return;
  Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock(c->lock, WAIT_LOCK);
  Py_END_ALLOW_THREADS
}

void smpy_ctx_unlock(smpy_ctx *c) { PyThread_release_lock(c->lock); }

smelt_status smpy_ctx_use_stream(smpy_ctx *c, void *stream) {
  /* A CPU context has no streams: the C API refuses any but NULL, and so do we. */
  if (smelt_ctx_device(c->ctx) != SMELT_DEVICE_CUDA) return stream ? smelt_ctx_set_stream(c->ctx, stream) : SMELT_OK;
  if (c->stream_set && c->stream == stream) return SMELT_OK;
  /* smelt reads NULL as "the context's own stream"; the legacy default stream
   * (handle 0 in CUDA and torch) is passed as CU_STREAM_LEGACY = 0x1. */
  smelt_status s = smelt_ctx_set_stream(c->ctx, stream ? stream : (void *)(uintptr_t)1);
  if (s) return s;
  c->stream = stream;
  c->stream_set = 1;
  return SMELT_OK;
}

/* ---- plan cache */

void smpy_tkey_fill(smpy_tkey *k, const smelt_tensor *t) {
  k->dtype = (int32_t)t->dtype;
  k->device = (int32_t)t->device;
  k->index = t->device_index;
  k->ndim = t->ndim;
  uintptr_t p = (uintptr_t)t->data;
  int a = 0;
  while (a < 8 && !(p & ((uintptr_t)1 << a))) a++; /* log2 alignment, capped at 256 bytes */
  k->align = a;
  for (int i = 0; i < t->ndim && i < SMELT_MAX_DIMS; i++) {
    k->shape[i] = t->shape[i];
    k->strides[i] = t->strides[i];
  }
}

static uint64_t hash_key(const smpy_pkey *key) {
  const uint64_t *w = (const uint64_t *)key;
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < smpy_pkey_size(key) / 8; i++) {
    h ^= w[i];
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  return h;
}

/* The cached plan for key, or NULL on a miss (call with the lock held). */
static smelt_plan *plan_find(smpy_ctx *c, const smpy_pkey *key, uint64_t *hash) {
  *hash = hash_key(key);
  if (!c->plans) return NULL;
  smpy_plan_slot *s = &c->plans[*hash % SMPY_PLAN_SLOTS];
  if (s->plan && s->hash == *hash && s->key.ntensors == key->ntensors && !memcmp(&s->key, key, smpy_pkey_size(key))) {
    c->plan_hits++;
    return s->plan;
  }
  return NULL;
}

/* Stores a fresh plan under key, destroying whatever occupied its slot.
 * Returns 0, or -1 when it could not be cached (the caller still owns it). */
static int plan_store(smpy_ctx *c, const smpy_pkey *key, uint64_t hash, smelt_plan *plan) {
  c->plan_misses++;
  if (!c->plans) c->plans = (smpy_plan_slot *)calloc(SMPY_PLAN_SLOTS, sizeof *c->plans);
  if (!c->plans) return -1;
  smpy_plan_slot *s = &c->plans[hash % SMPY_PLAN_SLOTS];
  if (s->plan) smelt_plan_destroy(s->plan);
  s->plan = plan;
  s->hash = hash;
  s->key = *key;
  return 0;
}

smelt_status smpy_cached_run(smpy_call *call, const smpy_pkey *key, smpy_plan_fn plan_fn, smpy_run_fn run_fn,
                             const void *arg) {
  smpy_ctx *c = call->ctx;
  const int cpu = smelt_ctx_device(c->ctx) == SMELT_DEVICE_CPU;
  uint64_t hash;
  smelt_plan *plan = NULL, *uncached = NULL;
  smpy_ctx_lock(c);
  smelt_status s = smpy_ctx_use_stream(c, call->stream);
  if (!s) plan = plan_find(c, key, &hash);
  if (!s && !plan) {
    PyThreadState *ts = PyEval_SaveThread();
    s = plan_fn(c->ctx, arg, &plan);
    PyEval_RestoreThread(ts);
    if (!s && plan_store(c, key, hash, plan) < 0) uncached = plan;
  }
  if (!s) {
    PyThreadState *ts = cpu ? PyEval_SaveThread() : NULL;
    s = run_fn(plan, arg);
    if (ts) PyEval_RestoreThread(ts);
  }
  if (uncached) smelt_plan_destroy(uncached);
  smpy_ctx_unlock(c);
  return s;
}

static void plans_clear(smpy_ctx *c) {
  if (!c->plans) return;
  for (int i = 0; i < SMPY_PLAN_SLOTS; i++)
    if (c->plans[i].plan) smelt_plan_destroy(c->plans[i].plan);
  free(c->plans);
  c->plans = NULL;
}

/* ---- construction */

/* "cpu", "cuda" or "cuda:N"; `what` names where s came from in the error. */
static int parse_device_str(const char *s, const char *what, smelt_device_kind *kind, int *index) {
  int ok = 1;
  if (!strcmp(s, "cpu")) {
  } else if (!strncmp(s, "cuda", 4)) {
    *kind = SMELT_DEVICE_CUDA;
    char tail;
    if (s[4] != 0 && !(s[4] == ':' && sscanf(s + 5, "%d%c", index, &tail) == 1 && *index >= 0)) ok = 0;
  } else {
    ok = 0;
  }
  if (!ok) smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt: %s \"%s\" is not cpu, cuda or cuda:N", what, s);
  return ok ? 0 : -1;
}

int smpy_parse_device(PyObject *obj, smelt_device_kind *kind, int *index) {
  *kind = SMELT_DEVICE_CPU;
  *index = 0;
  if (!obj || obj == Py_None) {
    /* The smelt command's rule: SMELT_DEVICE when set, else the GPU when
     * there is one. */
    const char *env = getenv("SMELT_DEVICE");
    if (env && *env) return parse_device_str(env, "SMELT_DEVICE", kind, index);
    smelt_system_info si;
    if (smelt_system_info_get(&si) == SMELT_OK && si.device_count > 0) *kind = SMELT_DEVICE_CUDA;
    return 0;
  }
  PyObject *str = PyObject_Str(obj); /* accepts torch.device too: str() is "cuda:0" */
  if (!str) return -1;
  PyObject *b = PyUnicode_AsUTF8String(str);
  Py_DECREF(str);
  if (!b) return -1;
  const int r = parse_device_str(PyBytes_AsString(b), "device", kind, index);
  Py_DECREF(b);
  return r;
}

static smpy_ctx *ctx_create(PyTypeObject *tp, smelt_device_kind kind, int index, int deterministic) {
  allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
  smpy_ctx *c = (smpy_ctx *)alloc(tp, 0);
  if (!c) return NULL;
  c->lock = PyThread_allocate_lock();
  if (!c->lock) {
    Py_DECREF(c);
    PyErr_NoMemory();
    return NULL;
  }
  smelt_ctx_options o = smelt_ctx_options_default();
  o.device = kind;
  o.device_index = index;
  o.use_env = 0; /* the device asked for here is explicit; SMELT_DEVICE must not override it */
  o.deterministic = deterministic;
  smelt_status s;
  Py_BEGIN_ALLOW_THREADS s = smelt_ctx_create(&c->ctx, &o);
  Py_END_ALLOW_THREADS
  if (s) {
    smpy_raise_status(s);
    Py_DECREF(c);
    return NULL;
  }
  c->deterministic = deterministic;
  return c;
}

static PyObject *ctx_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"device", "deterministic", NULL};
  PyObject *dev = NULL;
  int det = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|Op:Context", kwlist, &dev, &det)) return NULL;
  smelt_device_kind kind;
  int index;
  if (smpy_parse_device(dev, &kind, &index) < 0) return NULL;
  return (PyObject *)ctx_create(tp, kind, index, det);
}

smpy_ctx *smpy_default_ctx(smelt_device_kind dev, int index) {
  smpy_ctx **slot;
  if (dev == SMELT_DEVICE_CPU) {
    slot = &default_cpu;
  } else {
    if (index < 0 || index >= SMPY_MAX_DEFAULT)
      return (smpy_ctx *)smpy_raise(SMELT_STATUS_WRONG_DEVICE, "smelt: CUDA device index %d out of range", index);
    slot = &default_cuda[index];
  }
  if (!*slot) {
    /* ctx_create lets other threads run: one of them may have filled the slot meanwhile. */
    smpy_ctx *c = ctx_create((PyTypeObject *)smpy_ctx_type, dev, index, 0);
    if (!c) return NULL;
    if (*slot)
      Py_DECREF(c);
    else
      *slot = c; /* kept for the process */
  }
  return *slot;
}

static void ctx_dealloc(PyObject *self) {
  smpy_ctx *c = (smpy_ctx *)self;
  PyTypeObject *tp = Py_TYPE(self);
  plans_clear(c);
  if (c->ctx) smelt_ctx_destroy(c->ctx);
  if (c->lock) PyThread_free_lock(c->lock);
  freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  f(self);
  Py_DECREF(tp);
}

/* ---- methods */

static PyObject *ctx_synchronize(PyObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"stream", NULL};
  smpy_ctx *c = (smpy_ctx *)self;
  PyObject *stream_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:synchronize", kwlist, &stream_obj)) return NULL;
  void *stream = NULL;
  int explicit_stream = stream_obj != Py_None;
  if (explicit_stream && smpy_parse_stream(stream_obj, &stream) < 0) return NULL;
  smelt_status s;
  smpy_ctx_lock(c);
  void *prev = c->stream;
  int prev_set = c->stream_set;
  s = explicit_stream ? smpy_ctx_use_stream(c, stream) : SMELT_OK;
  if (!s) {
    Py_BEGIN_ALLOW_THREADS s = smelt_ctx_synchronize(c->ctx);
    Py_END_ALLOW_THREADS
  }
  if (explicit_stream && prev_set) smpy_ctx_use_stream(c, prev);
  smpy_ctx_unlock(c);
  if (s) return smpy_raise_status(s);
  Py_RETURN_NONE;
}

static PyObject *ctx_pool_stats(PyObject *self, PyObject *unused) {
  smpy_ctx *c = (smpy_ctx *)self;
  smelt_pool_stats st;
  smpy_ctx_lock(c);
  smelt_status s = smelt_pool_stats_get(c->ctx, &st);
  smpy_ctx_unlock(c);
  if (s) return smpy_raise_status(s);
  return Py_BuildValue("{s:K,s:K,s:K}", "used", (unsigned long long)st.used, "reserved",
                       (unsigned long long)st.reserved, "peak", (unsigned long long)st.peak);
}

static PyObject *ctx_pool_trim(PyObject *self, PyObject *args) {
  smpy_ctx *c = (smpy_ctx *)self;
  unsigned long long keep = 0;
  if (!PyArg_ParseTuple(args, "|K:pool_trim", &keep)) return NULL;
  smelt_status s;
  smpy_ctx_lock(c);
  Py_BEGIN_ALLOW_THREADS s = smelt_pool_trim(c->ctx, (size_t)keep);
  Py_END_ALLOW_THREADS
  smpy_ctx_unlock(c);
  if (s) return smpy_raise_status(s);
  Py_RETURN_NONE;
}

static PyObject *ctx_cache_stats(PyObject *self, PyObject *unused) {
  smpy_ctx *c = (smpy_ctx *)self;
  smelt_cache_stats st;
  smpy_ctx_lock(c);
  smelt_status s = smelt_cache_stats_get(c->ctx, &st);
  uint64_t hits = c->plan_hits, misses = c->plan_misses;
  smpy_ctx_unlock(c);
  if (s) return smpy_raise_status(s);
  return Py_BuildValue("{s:K,s:K,s:K,s:d,s:K,s:K}", "compiles", (unsigned long long)st.compiles, "disk_hits",
                       (unsigned long long)st.disk_hits, "memory_hits", (unsigned long long)st.memory_hits,
                       "compile_seconds", st.compile_seconds, "plan_hits", (unsigned long long)hits,
                       "plan_misses", (unsigned long long)misses);
}

static PyObject *ctx_clear_plans(PyObject *self, PyObject *unused) {
  smpy_ctx *c = (smpy_ctx *)self;
  smpy_ctx_lock(c);
  plans_clear(c);
  smpy_ctx_unlock(c);
  Py_RETURN_NONE;
}

static PyObject *ctx_get_device(PyObject *self, void *closure) {
  smpy_ctx *c = (smpy_ctx *)self;
  if (smelt_ctx_device(c->ctx) == SMELT_DEVICE_CPU) return PyUnicode_FromString("cpu");
  return PyUnicode_FromFormat("cuda:%d", smelt_ctx_device_index(c->ctx));
}

static PyObject *ctx_get_device_type(PyObject *self, void *closure) {
  smpy_ctx *c = (smpy_ctx *)self;
  return PyUnicode_FromString(smelt_ctx_device(c->ctx) == SMELT_DEVICE_CPU ? "cpu" : "cuda");
}

static PyObject *ctx_get_index(PyObject *self, void *closure) {
  return PyLong_FromLong(smelt_ctx_device_index(((smpy_ctx *)self)->ctx));
}

static PyObject *ctx_get_stream(PyObject *self, void *closure) {
  smpy_ctx *c = (smpy_ctx *)self;
  if (smelt_ctx_device(c->ctx) == SMELT_DEVICE_CPU) Py_RETURN_NONE;
  return PyLong_FromVoidPtr(c->stream_set ? c->stream : smelt_ctx_stream(c->ctx));
}

static PyObject *ctx_get_det(PyObject *self, void *closure) {
  return PyBool_FromLong(((smpy_ctx *)self)->deterministic);
}

static int ctx_set_det(PyObject *self, PyObject *v, void *closure) {
  smpy_ctx *c = (smpy_ctx *)self;
  int on = v ? PyObject_IsTrue(v) : 0;
  if (on < 0) return -1;
  smpy_ctx_lock(c);
  smelt_ctx_set_deterministic(c->ctx, on);
  c->deterministic = on;
  smpy_ctx_unlock(c);
  return 0;
}

static PyObject *ctx_repr(PyObject *self) {
  PyObject *dev = ctx_get_device(self, NULL);
  if (!dev) return NULL;
  PyObject *r = PyUnicode_FromFormat("smelt.Context(device='%U', deterministic=%s)", dev,
                                     ((smpy_ctx *)self)->deterministic ? "True" : "False");
  Py_DECREF(dev);
  return r;
}

static PyMethodDef ctx_methods[] = {
    {"synchronize", (PyCFunction)(void (*)(void))ctx_synchronize, METH_VARARGS | METH_KEYWORDS,
     "synchronize(stream=None)\n\nWaits (without holding the GIL) for the work smelt queued on the stream of "
     "its\nlast op, or on `stream` when given. A no-op on the CPU, which has no streams\n(a stream there "
     "is refused, as by every op)."},
    {"pool_stats", ctx_pool_stats, METH_NOARGS,
     "pool_stats() -> dict(used, reserved, peak)\n\nBytes of the context's stream-ordered pool (all 0 on the CPU)."},
    {"pool_trim", ctx_pool_trim, METH_VARARGS,
     "pool_trim(keep_bytes=0)\n\nSynchronizes, then returns unused pool memory above keep_bytes to the driver."},
    {"cache_stats", ctx_cache_stats, METH_NOARGS,
     "cache_stats() -> dict\n\ncompiles, disk_hits, memory_hits, compile_seconds (kernel cache, process-wide\n"
     "except memory_hits) and plan_hits, plan_misses (this context's plan cache)."},
    {"clear_plans", ctx_clear_plans, METH_NOARGS, "clear_plans()\n\nDrops every cached plan of this context."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef ctx_getset[] = {
    {"device", ctx_get_device, NULL, "'cpu' or 'cuda:N'", NULL},
    {"device_type", ctx_get_device_type, NULL, "'cpu' or 'cuda'", NULL},
    {"device_index", ctx_get_index, NULL, "CUDA ordinal (0 on the CPU)", NULL},
    {"stream", ctx_get_stream, NULL, "CUstream handle ops last ran on (None on the CPU)", NULL},
    {"deterministic", ctx_get_det, ctx_set_det, "ops with a non-deterministic fast path use the deterministic one",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot ctx_slots[] = {
    {Py_tp_new, (void *)ctx_new},
    {Py_tp_dealloc, (void *)ctx_dealloc},
    {Py_tp_methods, ctx_methods},
    {Py_tp_getset, ctx_getset},
    {Py_tp_repr, (void *)ctx_repr},
    {Py_tp_doc, (void *)"Context(device=None, deterministic=False)\n\n"
                        "A smelt context: the device ('cpu', 'cuda', 'cuda:N' or a torch.device; None:\n"
                        "SMELT_DEVICE when set, else cuda when a GPU is present, else cpu), the\n"
                        "memory pool, the kernel cache statistics and a cache of op plans. Ops pick the\n"
                        "default context of their tensors' device unless ctx= is given."},
    {0, NULL}};

static PyType_Spec ctx_spec = {"smelt.Context", sizeof(smpy_ctx), 0, Py_TPFLAGS_DEFAULT, ctx_slots};

int smpy_ctx_type_init(PyObject *module) {
  return smpy_add_type(module, &ctx_spec, "Context", &smpy_ctx_type);
}
