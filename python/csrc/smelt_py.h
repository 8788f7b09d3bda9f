/* Internal declarations of the smelt Python extension (smelt._smelt).
 *
 * The extension is built against the limited API of Python 3.9 (abi3), so one
 * binary serves every CPython >= 3.9; it needs neither torch nor the CUDA
 * toolkit to build. Tensors come in through DLPack (csrc/dlpack_in.c), ops are
 * cached plans per context (csrc/context.c), and memory smelt allocates itself
 * comes back as smelt.Tensor, which exports DLPack (csrc/tensor.c).
 *
 * Every non-static symbol is smpy_-prefixed and hidden: only PyInit__smelt
 * is exported from the shared object. */
#ifndef SMELT_PY_H
#define SMELT_PY_H

#define PY_SSIZE_T_CLEAN
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x03090000
#endif
#include <Python.h>

#include <stddef.h>

#include "dlpack.h"
#include "smelt.h"
#include "smelt/peer.h"

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

/* ---- errors (module.c) */

/* Raises the exception class for status `s` with smelt's thread-local message
 * (or the status text when empty) and returns NULL. */
PyObject *smpy_raise_status(smelt_status s);
/* Raises the class for `s` with a message formatted here; returns NULL. */
PyObject *smpy_raise(smelt_status s, const char *fmt, ...);
/* The name of obj's type ("int", "ndarray") into buf, for messages; "?"
 * if it has none. */
const char *smpy_type_name(PyObject *obj, char *buf, size_t n);

/* Creates the type of spec and adds it to module as `name` (module.c);
 * *type gets a reference of its own. Returns 0 or -1 with an exception. */
int smpy_add_type(PyObject *module, PyType_Spec *spec, const char *name, PyObject **type);

/* ---- contexts (context.c) */

#define SMPY_PLAN_SLOTS 128

typedef struct smpy_tkey {
  int32_t dtype, device, index, ndim, align, pad;
  int64_t shape[SMELT_MAX_DIMS], strides[SMELT_MAX_DIMS];
} smpy_tkey;

#define SMPY_KEY_TENSORS 14 /* the attention backward's 11 and its 3 modifier tensors */

/* Everything a plan depends on: op, parameters, and the layout of each tensor
 * (dtype, device, shape, strides, pointer alignment class). Only the first
 * `ntensors` entries of t take part in hashing and comparison (smpy_pkey_size),
 * so small ops pay nothing for the room the attention backward needs.
 * f and i hold op-specific parameters (gemm: alpha, beta, math; attention:
 * scale, causal, windows, max lengths); unused ones stay zero. */
typedef struct smpy_pkey {
  int32_t op, act, deterministic, ntensors;
  uint64_t mod_data[3]; /* attention: the modifier tensors' memory, which its plan keeps (0: none) */
  double slope;
  int64_t k;
  double f[4];
  int64_t i[6];
  smpy_tkey t[SMPY_KEY_TENSORS];
} smpy_pkey;

/* Bytes of key that matter: the header and its first ntensors tensor keys. */
#define smpy_pkey_size(key) (offsetof(smpy_pkey, t) + (size_t)(key)->ntensors * sizeof(smpy_tkey))

typedef struct smpy_plan_slot {
  uint64_t hash;
  smelt_plan *plan; /* NULL = empty */
  smpy_pkey key;
} smpy_plan_slot;

typedef struct smpy_ctx {
  PyObject_HEAD
  smelt_ctx *ctx;
  PyThread_type_lock lock; /* serializes every use of ctx (CPU ops run without the GIL) */
  int deterministic;
  int stream_set;        /* stream below was handed to smelt_ctx_set_stream */
  void *stream;          /* the stream handle last set (CUstream value; 0 = legacy default) */
  smpy_plan_slot *plans; /* SMPY_PLAN_SLOTS, direct-mapped; allocated on first use */
  uint64_t plan_hits, plan_misses;
} smpy_ctx;

extern PyObject *smpy_ctx_type;
int smpy_ctx_type_init(PyObject *module);
/* Parses 'cpu', 'cuda', 'cuda:N' or anything whose str() is one; None is
 * SMELT_DEVICE when set, else cuda when a GPU is present, else cpu. */
int smpy_parse_device(PyObject *obj, smelt_device_kind *kind, int *index);
/* Borrowed reference to the process-wide default context of a device (created
 * on first use), or NULL with an exception set. */
smpy_ctx *smpy_default_ctx(smelt_device_kind dev, int index);

/* Takes the context lock, releasing the GIL while it waits. */
void smpy_ctx_lock(smpy_ctx *c);
void smpy_ctx_unlock(smpy_ctx *c);
/* Points the context at a stream (handle value as CUDA sees it; 0 is the
 * legacy default stream). Call with the lock held. */
smelt_status smpy_ctx_use_stream(smpy_ctx *c, void *stream);
void smpy_tkey_fill(smpy_tkey *k, const smelt_tensor *t);

/* ---- smelt-owned tensors (tensor.c) */

typedef struct smpy_tensor {
  PyObject_HEAD
  smpy_ctx *ctx;   /* strong reference */
  PyObject *owner; /* strong reference to what owns the memory (a view), or NULL: smelt allocated it */
  void *stream;    /* stream the memory is ordered on (CUDA) */
  size_t nbytes;
  smelt_tensor t;  /* contiguous view of the allocation */
} smpy_tensor;

extern PyObject *smpy_tensor_type;
int smpy_tensor_type_init(PyObject *module);
/* A new contiguous tensor on c's device, allocated on `stream`. */
PyObject *smpy_tensor_new(smpy_ctx *c, void *stream, smelt_dtype dt, int ndim, const int64_t *shape);
/* A tensor over memory `owner` keeps alive (t: a contiguous view of it). */
PyObject *smpy_tensor_view(smpy_ctx *c, PyObject *owner, const smelt_tensor *t);

/* ---- the PEER expert store (peer_store.c) */

typedef struct smpy_store {
  PyObject_HEAD
  smpy_ctx *ctx;            /* strong reference: the store's context */
  smelt_peer_store *store;  /* NULL once closed */
  smelt_peer_store_options opts;
} smpy_store;

extern PyObject *smpy_store_type;
int smpy_store_type_init(PyObject *module);
/* o as an open store, or NULL with a TypeError (not a store) or an
 * ArgumentError (closed) naming op. */
smpy_store *smpy_store_of(PyObject *o, const char *op);

/* ---- the fusion planner (graph.c): _smelt.Graph */
int smpy_graph_type_init(PyObject *module);

/* ---- DLPack consumption (dlpack_in.c) */

#define SMPY_MAX_ARGS 32

typedef struct smpy_arg {
  smelt_tensor t;
  void *owner;   /* managed tensor whose deleter we call at the end, or NULL */
  int versioned; /* owner is a smpy_dl_managed_v */
} smpy_arg;

/* One op call: the context, the launch stream, and every imported tensor. */
typedef struct smpy_call {
  const char *op;               /* "smelt.activation" */
  smpy_ctx *ctx;                /* borrowed; NULL until the first tensor decides */
  int stream_mode;              /* 0 auto, 1 explicit */
  int stream_known;             /* launch stream decided (CUDA only) */
  void *stream;                 /* launch stream: CUstream value, 0 = legacy default */
  const smpy_dl_exchange_api *first_api; /* exchange API of the first tensor (for allocation) */
  int nargs;
  smpy_arg args[SMPY_MAX_ARGS];
} smpy_call;

/* Parses ctx (None or smelt.Context) and stream (None, int, or a stream object
 * with cuda_stream / __cuda_stream__ / ptr). Returns 0 or -1 with an exception. */
int smpy_call_begin(smpy_call *call, const char *op, PyObject *ctx, PyObject *stream);
/* Imports one tensor argument. `writable` refuses read-only and copied tensors.
 * On success *out points at the imported view (owned by call). */
int smpy_call_import(smpy_call *call, PyObject *obj, const char *name, int writable, smelt_tensor **out);
/* Releases everything imported (calls the producers' deleters). */
void smpy_call_end(smpy_call *call);
/* One op call on a cached plan: with the context's lock held and its stream
 * made the call's, the plan cached under key, else plan(ctx, arg, &plan)
 * without the GIL (it may compile a kernel) and cached; then run(plan, arg),
 * without the GIL on the CPU (a CUDA run only queues). A plan the cache
 * could not keep is destroyed after its run. */
typedef smelt_status (*smpy_plan_fn)(smelt_ctx *ctx, const void *arg, smelt_plan **out);
typedef smelt_status (*smpy_run_fn)(smelt_plan *plan, const void *arg);
smelt_status smpy_cached_run(smpy_call *call, const smpy_pkey *key, smpy_plan_fn plan, smpy_run_fn run,
                             const void *arg);
/* A new output on the call's device: through the first tensor's framework when it
 * publishes an exchange API (a torch tensor for torch inputs), else a smelt.Tensor. */
PyObject *smpy_call_alloc(smpy_call *call, smelt_dtype dt, int ndim, const int64_t *shape);
/* An op's output: None stays absent (*t NULL), True is allocated (dt,
 * shape), anything else is imported writable. *slot owns the new reference
 * that goes into the op's result. Returns 0 or -1 with an exception. */
int smpy_out_arg(smpy_call *call, PyObject *given, const char *name, smelt_dtype dt, int ndim, const int64_t *shape,
                 PyObject **slot, smelt_tensor **t);
/* The DLPack dtype of a smelt dtype. */
smpy_dl_dtype smpy_dl_dtype_of(smelt_dtype dt);
extern PyMethodDef smpy_dlpack_methods[];
/* Parses a stream argument into a CUDA handle value (0 = legacy default). */
int smpy_parse_stream(PyObject *obj, void **out);
/* The DLPack stream integer for a CUDA handle (legacy default -> 1). */
PyObject *smpy_dlpack_stream_int(void *stream);

/* ---- ops (ops.c) */
extern PyMethodDef smpy_op_methods[];
extern PyMethodDef smpy_peer_methods[]; /* peer.c */
extern PyMethodDef smpy_moe_methods[];  /* moe.c */
extern PyMethodDef smpy_bem_methods[];  /* bem.c */
extern PyMethodDef smpy_epi_methods[];  /* epi.c */
int smpy_ops_init(PyObject *module);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif /* SMELT_PY_H */
