/* Internal declarations shared by the core, the CPU backend and the CUDA backend.
 * Internal non-static symbols carry the smelt__ prefix. */
#ifndef SMELT_INTERNAL_H
#define SMELT_INTERNAL_H

#include "smelt.h"
#include "families.h"

#include <stdarg.h>
#include <stdbool.h>

#if defined(__GNUC__)
#define SMELT__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define SMELT__PRINTF(a, b)
#endif

/* ---- errors: set the thread-local message and return the status */
smelt_status smelt__error(smelt_status s, const char *fmt, ...) SMELT__PRINTF(2, 3);

/* ---- logging (SMELT_LOG=off|warn|info|debug; warn by default; to stderr) */
enum { SMELT__LOG_OFF = 0, SMELT__LOG_WARN = 1, SMELT__LOG_INFO = 2, SMELT__LOG_DEBUG = 3 };
int smelt__log_level(void);
void smelt__log(int level, const char *fmt, ...) SMELT__PRINTF(2, 3);

/* ---- environment (env.c) */
const char *smelt__getenv(const char *name); /* NULL when unset or empty */
/* INVALID_ARGUMENT "<op>: SMELT_X=\"v\" is not one of: ..." for the first
 * variable set to a value smelt does not know. */
smelt_status smelt__env_check(const char *op);
/* Whether the variable is set to exactly `value`. */
int smelt__env_is(const char *name, const char *value);
double smelt__now_seconds(void);             /* monotonic clock */

/* ---- hashing */
typedef struct smelt__sha256 {
  uint32_t h[8];
  uint64_t len;
  uint8_t buf[64];
  size_t nbuf;
} smelt__sha256;
void smelt__sha256_init(smelt__sha256 *s);
void smelt__sha256_update(smelt__sha256 *s, const void *data, size_t n);
void smelt__sha256_final(smelt__sha256 *s, uint8_t out[32]);
void smelt__sha256_hex(const uint8_t digest[32], char out[65]);

/* ---- tensor validation. Each returns SMELT_OK or an error whose message starts
 * with "<op>: <name>" and names the constraint and the value seen. */
/* ndim in [0,8], shapes >= 0, strides >= 0, numel and byte extent fit in int64,
 * dtype valid, data non-NULL unless numel == 0, data aligned to the dtype size. */
smelt_status smelt__check_tensor(const char *op, const char *name, const smelt_tensor *t);
/* t->device/device_index must match the context's. */
smelt_status smelt__check_device(const char *op, const char *name, const smelt_tensor *t,
                                 const smelt_ctx *ctx);
/* Same ndim and shape. */
smelt_status smelt__check_same_shape(const char *op, const char *an, const smelt_tensor *a,
                                     const char *bn, const smelt_tensor *b);
/* Same dtype, shape and strides (a plan's tensor vs the run's). */
smelt_status smelt__check_same_layout(const char *op, const char *an, const smelt_tensor *planned,
                                      const smelt_tensor *t);
/* The dtype is one of `n` allowed. */
smelt_status smelt__check_dtype(const char *op, const char *name, const smelt_tensor *t,
                                const smelt_dtype *allowed, int n);
/* Byte range [lo, hi) an element of t can touch (relative to data). */
void smelt__tensor_span(const smelt_tensor *t, int64_t *lo, int64_t *hi);
/* 1 if two tensors' byte ranges intersect (neither is empty). */
int smelt__tensors_overlap(const smelt_tensor *a, const smelt_tensor *b);
/* An output's elements must be distinct memory: a stride 0 or interleaved
 * dims over sizes > 1 would make the result depend on the order of writes. */
smelt_status smelt__check_output(const char *op, const char *name, const smelt_tensor *t);
/* Formats "[2, 3, 4]" into buf. */
const char *smelt__shape_str(const smelt_tensor *t, char *buf, size_t n);
/* t has exactly the n dims given, else SHAPE_MISMATCH naming op, the role
 * and what (the expected shape in words, e.g. "[T, d_model]"). */
smelt_status smelt__check_dims(const char *op, const char *name, const smelt_tensor *t, int n, const int64_t *dims,
                               const char *what);

/* ceil(a / b) for a >= 0, b > 0 (tiles of b covering a), without the
 * overflow of a + b - 1 near INT64_MAX. */
static inline int64_t smelt__ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

/* Offset in elements of the element with linear (row-major) index i. */
int64_t smelt__tensor_offset(const smelt_tensor *t, int64_t i);
/* d/dx of smelt_act_apply(a, x, slope) (src/core/op_activation.c). */
double smelt__act_grad(smelt_act a, double x, double slope);
/* The view of t with axes i and j exchanged (a transpose: no data moves). */
smelt_tensor smelt__tensor_swap_axes(const smelt_tensor *t, int i, int j);

/* ---- dtype element access for the CPU backend (any float/int dtype as double) */
double smelt__load_f64(const void *base, smelt_dtype dt, int64_t off);
void smelt__store_f64(void *base, smelt_dtype dt, int64_t off, double v);
/* The epilogue's clamp (smelt/gemm.h) for D of type dt: v rounded to f32
 * first, as a kernel's f32 epilogue value is, then held to dt's finite
 * range when dt is f32, f16 or bf16; other types as they are. */
double smelt__clamp_finite(smelt_dtype dt, double v);

/* ---- context */
struct smelt__cuda_ctx;
struct smelt_ctx {
  smelt_device_kind device;
  int device_index;
  int deterministic;
  struct smelt__cuda_ctx *cuda; /* NULL on the CPU backend */
};

/* ---- plans */
#define SMELT__PLAN_MAX_TENSORS 10
#define SMELT__PLAN_MAX_FUNCS 5

struct smelt__family;

struct smelt_plan {
  smelt_ctx *ctx;
  const struct smelt__family *family; /* the family that made it */
  char describe[256];
  smelt_tensor t[SMELT__PLAN_MAX_TENSORS]; /* planned views (data ignored); ndim -1 = absent */
  union {
    smelt_activation_desc act;
    struct { int64_t k; } topk;
  } p;
  /* Op-specific state too large for the union (owned by the plan; freed with
   * opdata_free when the plan is destroyed). */
  void *opdata;
  void (*opdata_free)(void *opdata);
  /* The backend's own decisions (owned by the plan; freed with backend_free). */
  void *backend;
  void (*backend_free)(void *backend);
  /* CUDA: functions loaded from the context's module table (owned by it). */
  void *func[SMELT__PLAN_MAX_FUNCS];
  int variant; /* backend-specific variant picked by the selector */
  int block;   /* launch block size chosen at plan time */
};

smelt_status smelt__plan_new(smelt_ctx *ctx, smelt_plan **out);

/* ---- the op-family interface (src/core/family.c). A family registers
 * once: a line in src/core/families.h (which also names its variant
 * enumerator, smelt__<name>_variants, and its backends) and its
 * smelt__family: tensor roles, description size, own checks, CPU and CUDA
 * backends, error bound. The shared code does the rest: argument checks,
 * the plan's copy of the views and of the description, the run's check
 * against them, the backend dispatch and the one-shot call. */

/* A backend's half of a family. `args` is the family's run arguments: for
 * families planned by smelt__family_plan, the role-indexed tensor array
 * (const smelt_tensor *const *, NULL for absent roles). */
typedef struct smelt__backend {
  smelt_status (*plan)(smelt_plan *plan, const void *args); /* selects and loads; NULL: nothing to choose */
  smelt_status (*run)(smelt_plan *plan, const void *args);
} smelt__backend;

enum {
  SMELT__ROLE_OPTIONAL = 1, /* may be NULL */
  SMELT__ROLE_OUTPUT = 2,   /* written: distinct elements, disjoint from every other role */
  SMELT__ROLE_IN_PLACE = 4, /* an output that may be role `alias` exactly (same data and strides) */
  SMELT__ROLE_DTYPE_OF_0 = 8 /* its dtype must equal role 0's */
};

/* A tensor a family takes: its name in messages and what the shared checks
 * ask of it. */
typedef struct smelt__role {
  const char *name;
  unsigned flags;            /* SMELT__ROLE_* */
  const smelt_dtype *dtypes; /* the dtypes allowed (NULL: decided elsewhere) */
  int ndtypes;
  int alias;                 /* SMELT__ROLE_IN_PLACE: the role it may be */
} smelt__role;

struct smelt__bound_query;

typedef struct smelt__family {
  const char *name; /* as in src/core/families.h: "softmax" */
  const char *op;   /* the entry points' prefix and every message's: "smelt_softmax" */
  const char *what; /* "a softmax": "the plan is not a softmax plan" */
  int nroles;
  const smelt__role *roles;
  size_t params_size; /* bytes of the description (`params`) the plan keeps in opdata; 0: none */
  /* What the shared checks cannot see (parameters, shapes), after them and
   * before the output checks; fills plan->p, opdata and describe. */
  smelt_status (*check)(smelt_plan *plan, const void *params, const smelt_tensor *const *t);
  const smelt__backend *cpu, *cuda;
  double (*bound)(const struct smelt__bound_query *q); /* src/core/error_bound.h */
} smelt__family;

/* A new plan of family f (nothing planned yet). */
smelt_status smelt__family_plan_new(const smelt__family *f, smelt_ctx *ctx, smelt_plan **out);
/* A plan of f around a family's resolved `state` (the plan owns it from
 * here on, also on failure, and frees it with state_free), described by
 * `describe` until the backend says what it picked, then planned by the
 * context's backend for `args`. For families with entry points of their own. */
smelt_status smelt__family_plan_state(const smelt__family *f, smelt_ctx *ctx, void *state, void (*state_free)(void *),
                                      const char *describe, const void *args, smelt_plan **out);
/* Plans a family's call: ctx and out, every role's presence, tensor, device
 * and dtype, the family's check, outputs distinct and disjoint, then the
 * backend's plan. On failure *out is NULL and nothing was written. */
smelt_status smelt__family_plan(const smelt__family *f, smelt_ctx *ctx, const void *params,
                                const smelt_tensor *const *t, smelt_plan **out);
/* Runs a plan of f: each role as planned (present or absent, dtype, shape,
 * strides but those of size-1 dims, device; non-NULL data), disjoint, then
 * the backend's run. */
smelt_status smelt__family_run(const smelt__family *f, smelt_plan *plan, const smelt_tensor *const *t);
/* Each role of a run as planned (`planned`: the views by role, ndim -1
 * when absent): present or absent as planned, then dtype, shape, strides
 * (but those of size-1 dims), device and non-NULL data; `op` names the
 * entry point in messages. */
smelt_status smelt__check_views(const smelt__family *f, const char *op, const smelt_tensor *planned,
                                const smelt_tensor *const *t);
/* Every output role against every input role and every earlier output
 * (an SMELT__ROLE_IN_PLACE output may be its alias exactly). */
smelt_status smelt__check_roles_disjoint(const smelt__family *f, const char *op, const smelt_tensor *const *t);
/* The plan's backend runs args (no checks: the family did them). */
smelt_status smelt__plan_dispatch(smelt_plan *plan, const void *args);
/* plan is a plan of family f; `op` names the entry point in the message. */
smelt_status smelt__check_plan(const smelt__family *f, const char *op, const smelt_plan *plan);
/* t (validated, on ctx's device) has a dtype role r allows. */
smelt_status smelt__check_role(const char *op, const smelt__role *r, const smelt_tensor *t, const smelt_ctx *ctx);
/* Output `out` (role name on) shares no memory with `in`, or is it exactly
 * when in_place (same data, dtype and strides but those of size-1 dims). */
smelt_status smelt__check_disjoint(const char *op, const char *on, const smelt_tensor *out, const char *in_name,
                                   const smelt_tensor *in, int in_place);

/* The one-shot call of every family: plan, run, destroy. PLAN_CALL takes
 * &plan, RUN_CALL uses plan. */
#define SMELT__ONE_SHOT(PLAN_CALL, RUN_CALL) \
  do {                                       \
    smelt_plan *plan = NULL;                 \
    smelt_status one_shot_s = (PLAN_CALL);   \
    if (!one_shot_s) one_shot_s = (RUN_CALL); \
    smelt_plan_destroy(plan);                \
    return one_shot_s;                       \
  } while (0)

/* ---- embedded kernel sources (generated at build time from kernels/) */
typedef struct smelt__embedded_file {
  const char *name; /* "unary.cu", "smelt_device.cuh" */
  const char *text;
  size_t len;
} smelt__embedded_file;
extern const smelt__embedded_file smelt__embedded_files[];
extern const int smelt__embedded_count;
const smelt__embedded_file *smelt__embedded_find(const char *name);

/* ---- kernel sources: what the JIT compiles. The prelude (#defines) is the
 * operation description; `body` names an embedded kernels/ file. */
typedef struct smelt__kernel_src {
  char name[96];       /* module name built from the parameters: "act_gelu_bf16" */
  const char *body;    /* embedded file name: "unary.cu" */
  char prelude[8192];  /* "#define SMELT_DT 2\n..." (an epilogue graph's code takes a few KiB) */
} smelt__kernel_src;

/* Enumerates every variant an op family's selector can pick (for precompile and
 * the compile test). Writes up to max entries, returns the total count. */
typedef int (*smelt__variant_enum_fn)(smelt__kernel_src *out, int max);
#define SMELT__VARIANTS_DECL(name) int smelt__##name##_variants(smelt__kernel_src *out, int max);
SMELT__FAMILY_LIST(SMELT__VARIANTS_DECL)
#undef SMELT__VARIANTS_DECL
extern const smelt__variant_enum_fn smelt__variant_enums[];
extern const int smelt__variant_enum_count;

/* Appends "#define NAME value\n" to src->prelude. */
void smelt__prelude_define(smelt__kernel_src *src, const char *name, long long value);

/* ---- CPU backend (src/cpu): naive, double accumulation. Tensors validated. */
/* A candidate for the CPU top-k selections (smelt_topk, PEER routing), and
 * their one order for qsort: descending value, NaN first, then ascending
 * index — a total order, so qsort's instability is harmless. */
typedef struct smelt__rank {
  double v;
  int64_t i;
} smelt__rank;
int smelt__rank_cmp(const void *a, const void *b);

/* ---- the families on the interface: the core's family and the backends. */
#define SMELT__FAMILY_DECL(name)                  \
  extern const smelt__family smelt__family_##name; \
  extern const smelt__backend smelt__cpu_##name, smelt__cuda_##name;
SMELT__FAMILY_LIST(SMELT__FAMILY_DECL)
extern const smelt__family *const smelt__families[];
extern const int smelt__family_count;

#endif /* SMELT_INTERNAL_H */
