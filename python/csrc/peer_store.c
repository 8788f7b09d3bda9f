/* smelt.PeerStore: the hierarchical expert store (smelt/peer.h) from
 * Python. The U and V tables live in host memory (pinned and mapped into the
 * GPU's address space, or managed), an HBM cache of hot experts in front of
 * them; smelt.peer and smelt.peer_backward take the store in place of u and
 * v (store=).
 *
 * The store keeps its context alive and runs on it: ops that use the store
 * must run on the same context (the default context of the store's device
 * unless ctx= is given to both). tables() returns smelt.Tensor views of the
 * host tables that keep the store alive while they exist. */
#include "smelt_py.h"
#include "smelt/peer.h"

#include <string.h>

PyObject *smpy_store_type;

#define STORE_OP "smelt.PeerStore"

smpy_store *smpy_store_of(PyObject *o, const char *op) {
  if (!PyObject_TypeCheck(o, (PyTypeObject *)smpy_store_type)) {
    char tn[128];
    smpy_raise(SMELT_STATUS_DTYPE_MISMATCH, "%s: store must be a smelt.PeerStore or None, got %s", op,
               smpy_type_name(o, tn, sizeof tn));
    return NULL;
  }
  smpy_store *st = (smpy_store *)o;
  if (!st->store) {
    smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "%s: the store is closed", op);
    return NULL;
  }
  return st;
}

static int store_alive(smpy_store *st) { return smpy_store_of((PyObject *)st, STORE_OP) ? 0 : -1; }

static PyObject *store_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"num_experts", "input_dim",   "output_dim", "expert_hidden_size", "dtype", "cache_mb",
                           "managed",     "use_env",     "device",     "ctx",                NULL};
  long long n, din, dout, he = 1;
  const char *dtname = "bf16";
  PyObject *cache = Py_None, *managed = Py_None, *use_env = Py_True, *dev = Py_None, *ctx_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "LLL|$LsOOOOO:PeerStore", kwlist, &n, &din, &dout, &he, &dtname, &cache,
                                   &managed, &use_env, &dev, &ctx_obj))
    return NULL;
  smelt_peer_store_options o = smelt_peer_store_options_default();
  o.num_experts = n;
  o.input_dim = din;
  o.output_dim = dout;
  o.expert_hidden_size = he;
  if (smelt_dtype_from_name(dtname, &o.dtype))
    return smpy_raise(SMELT_STATUS_DTYPE_MISMATCH, STORE_OP ": dtype \"%s\" is not one of f32, f16, bf16, f64",
                      dtname);
  if (cache != Py_None) {
    o.cache_mb = PyFloat_AsDouble(cache);
    if (o.cache_mb == -1.0 && PyErr_Occurred()) return NULL;
  }
  int e;
  if (managed != Py_None) {
    if ((e = PyObject_IsTrue(managed)) < 0) return NULL;
    o.use_managed_memory = e;
  }
  if ((e = PyObject_IsTrue(use_env)) < 0) return NULL;
  o.use_env = e;
  smpy_ctx *c;
  if (ctx_obj != Py_None) {
    if (!PyObject_TypeCheck(ctx_obj, (PyTypeObject *)smpy_ctx_type)) {
      PyErr_SetString(PyExc_TypeError, STORE_OP ": ctx must be a smelt.Context");
      return NULL;
    }
    c = (smpy_ctx *)ctx_obj;
  } else {
    smelt_device_kind kind;
    int index;
    if (smpy_parse_device(dev, &kind, &index) < 0) return NULL;
    if (!(c = smpy_default_ctx(kind, index))) return NULL;
  }
  allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
  smpy_store *st = (smpy_store *)alloc(tp, 0);
  if (!st) return NULL;
  smelt_status s;
  smpy_ctx_lock(c);
  Py_BEGIN_ALLOW_THREADS s = smelt_peer_store_create(c->ctx, &o, &st->store);
  Py_END_ALLOW_THREADS
  smpy_ctx_unlock(c);
  if (s) {
    Py_DECREF(st);
    return smpy_raise_status(s);
  }
  Py_INCREF(c);
  st->ctx = c;
  st->opts = o;
  return (PyObject *)st;
}

static void store_free(smpy_store *st) {
  if (!st->store) return;
  smpy_ctx_lock(st->ctx);
  smelt_peer_store_destroy(st->store);
  smpy_ctx_unlock(st->ctx);
  st->store = NULL;
}

static void store_dealloc(PyObject *self) {
  smpy_store *st = (smpy_store *)self;
  PyTypeObject *tp = Py_TYPE(self);
  if (st->ctx) {
    store_free(st);
    Py_DECREF(st->ctx);
  }
  freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  f(self);
  Py_DECREF(tp);
}

/* Runs fn(store, arg) on the store's context, on `stream` when use_stream
 * (else the context's current one), without the GIL. */
static smelt_status store_run(smpy_store *st, smelt_status (*fn)(smelt_peer_store *, const void *), const void *arg,
                              int use_stream, void *stream) {
  smelt_status s = SMELT_OK;
  smpy_ctx_lock(st->ctx);
  if (use_stream) s = smpy_ctx_use_stream(st->ctx, stream);
  if (!s) {
    Py_BEGIN_ALLOW_THREADS s = fn(st->store, arg);
    Py_END_ALLOW_THREADS
  }
  smpy_ctx_unlock(st->ctx);
  return s;
}

/* None, or the status's exception. */
static PyObject *none_or_raise(smelt_status s) {
  if (s) return smpy_raise_status(s);
  Py_INCREF(Py_None);
  return Py_None;
}

typedef struct write_args {
  int64_t first, count;
  const void *u, *v;
} write_args;

static smelt_status do_write(smelt_peer_store *s, const void *a) {
  const write_args *w = (const write_args *)a;
  return smelt_peer_store_write(s, w->first, w->count, w->u, w->v);
}
static smelt_status do_prefetch(smelt_peer_store *s, const void *a) {
  return smelt_peer_store_prefetch(s, (const smelt_tensor *)a);
}

static smelt_status do_invalidate(smelt_peer_store *s, const void *a) {
  (void)a;
  return smelt_peer_store_invalidate(s);
}
static smelt_status do_reset(smelt_peer_store *s, const void *a) {
  (void)a;
  return smelt_peer_store_stats_reset(s);
}
static smelt_status do_stats(smelt_peer_store *s, const void *a) {
  return smelt_peer_store_stats_get(s, (smelt_peer_store_stats *)a);
}

static PyObject *store_tables(PyObject *self, PyObject *unused) {
  smpy_store *st = (smpy_store *)self;
  if (store_alive(st) < 0) return NULL;
  smelt_tensor u, v;
  smelt_status s = smelt_peer_store_tables(st->store, &u, &v);
  if (s) return smpy_raise_status(s);
  PyObject *pu = smpy_tensor_view(st->ctx, self, &u), *pv = pu ? smpy_tensor_view(st->ctx, self, &v) : NULL;
  PyObject *r = pv ? PyTuple_Pack(2, pu, pv) : NULL;
  Py_XDECREF(pu);
  Py_XDECREF(pv);
  return r;
}

/* rows: [count, dim, h_e] (or [count, dim] when h_e is 1; for v [count, h_e,
 * dim] or [count, dim]), contiguous, host memory, the store's dtype. */
static int check_rows(const smelt_tensor *t, const char *name, const smpy_store *st, int is_u, int64_t *count) {
  const int64_t he = st->opts.expert_hidden_size, dim = is_u ? st->opts.input_dim : st->opts.output_dim;
  const int64_t want3[2] = {is_u ? dim : he, is_u ? he : dim};
  int ok = t->device == SMELT_DEVICE_CPU && t->dtype == st->opts.dtype && t->ndim >= 1 &&
           smelt_tensor_is_contiguous(t);
  if (ok && t->ndim == 3) ok = t->shape[1] == want3[0] && t->shape[2] == want3[1];
  else if (ok && t->ndim == 2) ok = he == 1 && t->shape[1] == dim;
  else ok = 0;
  if (!ok) {
    smpy_raise(SMELT_STATUS_INVALID_ARGUMENT,
               STORE_OP ".write: %s must be a contiguous host tensor of dtype %s shaped [count, %lld, %lld]%s "
                        "(got dtype %s, %d dims, device %s)",
               name, smelt_dtype_name(st->opts.dtype), (long long)want3[0], (long long)want3[1],
               he == 1 ? " or [count, dim]" : "", smelt_dtype_name(t->dtype), t->ndim,
               t->device == SMELT_DEVICE_CPU ? "cpu" : "cuda");
    return -1;
  }
  *count = t->shape[0];
  return 0;
}

static PyObject *store_write(PyObject *self, PyObject *args) {
  smpy_store *st = (smpy_store *)self;
  long long first;
  PyObject *uo, *vo;
  if (!PyArg_ParseTuple(args, "LOO:write", &first, &uo, &vo) || store_alive(st) < 0) return NULL;
  smpy_call call;
  smelt_tensor *u, *v;
  PyObject *r = NULL;
  if (smpy_call_begin(&call, STORE_OP ".write", Py_None, Py_None) < 0) return NULL;
  int64_t nu, nv;
  if (smpy_call_import(&call, uo, "u_rows", 0, &u) < 0 || smpy_call_import(&call, vo, "v_rows", 0, &v) < 0 ||
      check_rows(u, "u_rows", st, 1, &nu) < 0 || check_rows(v, "v_rows", st, 0, &nv) < 0)
    goto done;
  if (nu != nv) {
    smpy_raise(SMELT_STATUS_SHAPE_MISMATCH, STORE_OP ".write: u_rows has %lld experts, v_rows %lld", (long long)nu,
               (long long)nv);
    goto done;
  }
  const write_args wa = {first, nu, u->data, v->data};
  r = none_or_raise(store_run(st, do_write, &wa, 0, NULL));
done:
  smpy_call_end(&call);
  return r;
}

static PyObject *store_prefetch(PyObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"ids", "stream", NULL};
  smpy_store *st = (smpy_store *)self;
  PyObject *io, *stream = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$O:prefetch", kwlist, &io, &stream) || store_alive(st) < 0)
    return NULL;
  smpy_call call;
  smelt_tensor *ids;
  PyObject *r = NULL;
  if (smpy_call_begin(&call, STORE_OP ".prefetch", (PyObject *)st->ctx, stream) < 0) return NULL;
  if (smpy_call_import(&call, io, "ids", 0, &ids) < 0) goto done;
  r = none_or_raise(store_run(st, do_prefetch, ids, 1, call.stream));
done:
  smpy_call_end(&call);
  return r;
}

static PyObject *store_simple(PyObject *self, smelt_status (*fn)(smelt_peer_store *, const void *)) {
  smpy_store *st = (smpy_store *)self;
  if (store_alive(st) < 0) return NULL;
  return none_or_raise(store_run(st, fn, NULL, 0, NULL));
}
static PyObject *store_invalidate(PyObject *self, PyObject *unused) { return store_simple(self, do_invalidate); }
static PyObject *store_reset_stats(PyObject *self, PyObject *unused) { return store_simple(self, do_reset); }

static PyObject *store_stats(PyObject *self, PyObject *unused) {
  smpy_store *st = (smpy_store *)self;
  if (store_alive(st) < 0) return NULL;
  smelt_peer_store_stats x;
  smelt_status s = store_run(st, do_stats, &x, 0, NULL);
  if (s) return smpy_raise_status(s);
  return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsLsLsd}", "batches", x.batches, "lookups", x.lookups, "hits", x.hits,
                       "misses", x.misses, "evictions", x.evictions, "uses", x.uses, "uses_mapped", x.uses_mapped,
                       "bytes_staged", x.bytes_staged, "bytes_mapped", x.bytes_mapped, "bytes_from_host",
                       x.bytes_from_host, "slots", (long long)x.slots, "resident", (long long)x.resident, "hit_rate",
                       x.hit_rate);
}

static PyObject *store_report(PyObject *self, PyObject *unused) {
  smpy_store *st = (smpy_store *)self;
  if (store_alive(st) < 0) return NULL;
  char buf[2048];
  smelt_status s;
  smpy_ctx_lock(st->ctx);
  s = smelt_peer_store_report(st->store, buf, sizeof buf);
  smpy_ctx_unlock(st->ctx);
  if (s) return smpy_raise_status(s);
  return PyUnicode_FromString(buf);
}

/* heat(first=0, count=None) -> smelt.Tensor [count] i64 in host memory. */
static PyObject *store_heat(PyObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"first", "count", NULL};
  smpy_store *st = (smpy_store *)self;
  long long first = 0;
  PyObject *co = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|LO:heat", kwlist, &first, &co) || store_alive(st) < 0) return NULL;
  long long count = st->opts.num_experts - first;
  if (co != Py_None && (count = PyLong_AsLongLong(co)) == -1 && PyErr_Occurred()) return NULL;
  if (first < 0 || count < 0 || first > st->opts.num_experts || count > st->opts.num_experts - first)
    return smpy_raise(SMELT_STATUS_INVALID_ARGUMENT,
                      STORE_OP ".heat: experts [%lld, %lld + %lld) are not within [0, %lld)", first, first, count,
                      (long long)st->opts.num_experts);
  smpy_ctx *cpu = smpy_default_ctx(SMELT_DEVICE_CPU, 0);
  if (!cpu) return NULL;
  const int64_t shape[1] = {count};
  PyObject *out = smpy_tensor_new(cpu, NULL, SMELT_DTYPE_I64, 1, shape);
  if (!out) return NULL;
  smelt_status s;
  smpy_ctx_lock(st->ctx);
  s = smelt_peer_store_heat(st->store, first, count, (uint64_t *)((smpy_tensor *)out)->t.data);
  smpy_ctx_unlock(st->ctx);
  if (s) {
    Py_DECREF(out);
    return smpy_raise_status(s);
  }
  return out;
}

static PyObject *store_close(PyObject *self, PyObject *unused) {
  store_free((smpy_store *)self);
  Py_RETURN_NONE;
}

static PyObject *get_i64(PyObject *self, void *off) {
  return PyLong_FromLongLong(*(const int64_t *)((const char *)&((smpy_store *)self)->opts + (size_t)off));
}
static PyObject *get_dtype(PyObject *self, void *c) {
  return PyUnicode_FromString(smelt_dtype_name(((smpy_store *)self)->opts.dtype));
}
static PyObject *get_ctx(PyObject *self, void *c) {
  PyObject *ctx = (PyObject *)((smpy_store *)self)->ctx;
  Py_INCREF(ctx);
  return ctx;
}
static PyObject *get_closed(PyObject *self, void *c) { return PyBool_FromLong(!((smpy_store *)self)->store); }

static PyMethodDef store_methods[] = {
    {"tables", store_tables, METH_NOARGS,
     "tables() -> (u, v)\n\nsmelt.Tensor views of the host tables, u [N, d_in, h_e] and v [N, h_e, d_out]\n"
     "(torch.from_dlpack / numpy.from_dlpack view them). Write through them only while no\n"
     "kernel runs, then call invalidate()."},
    {"write", store_write, METH_VARARGS,
     "write(first, u_rows, v_rows)\n\nCopies experts first.. from contiguous host tensors of the store's dtype,\n"
     "[count, d_in, h_e] and [count, h_e, d_out] ([count, d] when h_e is 1), into the\n"
     "tables and refreshes their cached copies. Synchronous."},
    {"invalidate", store_invalidate, METH_NOARGS, "invalidate()\n\nEmpties the cache (statistics unchanged)."},
    {"prefetch", (PyCFunction)(void (*)(void))store_prefetch, METH_VARARGS | METH_KEYWORDS,
     "prefetch(ids, *, stream=None)\n\nOne batch of the cache policy for ids (int64, the store's device), as a\n"
     "forward would run it: warms the cache."},
    {"stats", store_stats, METH_NOARGS,
     "stats() -> dict\n\nbatches, lookups, hits, misses, evictions, uses, uses_mapped, bytes_staged,\n"
     "bytes_mapped, bytes_from_host, slots, resident, hit_rate (waits for the stream)."},
    {"reset_stats", store_reset_stats, METH_NOARGS, "reset_stats()\n\nZeroes the counters."},
    {"report", store_report, METH_NOARGS, "report() -> str\n\nA few printable lines: memory, sizes, counters."},
    {"heat", (PyCFunction)(void (*)(void))store_heat, METH_VARARGS | METH_KEYWORDS,
     "heat(first=0, count=None) -> smelt.Tensor\n\nUses of experts [first, first + count) since creation, int64."},
    {"close", store_close, METH_NOARGS,
     "close()\n\nFrees the tables and the cache now (views from tables() must not be used after)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef store_getset[] = {
    {"num_experts", get_i64, NULL, "N", (void *)offsetof(smelt_peer_store_options, num_experts)},
    {"input_dim", get_i64, NULL, "d_in", (void *)offsetof(smelt_peer_store_options, input_dim)},
    {"output_dim", get_i64, NULL, "d_out", (void *)offsetof(smelt_peer_store_options, output_dim)},
    {"expert_hidden_size", get_i64, NULL, "h_e", (void *)offsetof(smelt_peer_store_options, expert_hidden_size)},
    {"dtype", get_dtype, NULL, "the tables' smelt dtype name", NULL},
    {"context", get_ctx, NULL, "the smelt.Context the store belongs to", NULL},
    {"closed", get_closed, NULL, "True after close()", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot store_slots[] = {
    {Py_tp_new, (void *)store_new},
    {Py_tp_dealloc, (void *)store_dealloc},
    {Py_tp_methods, store_methods},
    {Py_tp_getset, store_getset},
    {Py_tp_doc,
     (void *)"PeerStore(num_experts, input_dim, output_dim, *, expert_hidden_size=1, dtype='bf16',\n"
             "          cache_mb=None, managed=None, use_env=True, device=None, ctx=None)\n\n"
             "PEER's hierarchical expert store: U and V in host memory (pinned and mapped, or managed\n"
             "with managed=True), an HBM cache of cache_mb MiB (default 1024; 0: none) under CLOCK.\n"
             "use_env: SMELT_PEER_HBM_CACHE_MB and SMELT_PEER_USE_MANAGED_MEMORY override cache_mb and\n"
             "managed. device: 'cuda', 'cuda:N' or 'cpu' (the reference backend); None: SMELT_DEVICE\n"
             "when set, else cuda when a GPU is present, else cpu.\n"
             "The tables start zeroed: fill them with write() or through tables()."},
    {0, NULL}};

static PyType_Spec store_spec = {"smelt.PeerStore", sizeof(smpy_store), 0, Py_TPFLAGS_DEFAULT, store_slots};

int smpy_store_type_init(PyObject *module) {
  return smpy_add_type(module, &store_spec, "PeerStore", &smpy_store_type);
}
