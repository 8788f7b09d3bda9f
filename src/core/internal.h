/* Internal declarations shared by the core, the CPU backend and the CUDA backend.
 * Internal non-static symbols carry the smelt__ prefix. */
#ifndef SMELT_INTERNAL_H
#define SMELT_INTERNAL_H

#include "smelt.h"

#include <stdarg.h>
#include <stdbool.h>

#if defined(__GNUC__)
#define SMELT__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define SMELT__PRINTF(a, b)
#endif

/* ---- errors: set the thread-local message and return the status */
smelt_status smelt__error(smelt_status s, const char *fmt, ...) SMELT__PRINTF(2, 3);

/* ---- logging (SMELT_LOG=warn|info|debug; off by default; to stderr) */
enum { SMELT__LOG_OFF = 0, SMELT__LOG_WARN = 1, SMELT__LOG_INFO = 2, SMELT__LOG_DEBUG = 3 };
int smelt__log_level(void);
void smelt__log(int level, const char *fmt, ...) SMELT__PRINTF(2, 3);

/* ---- environment helpers */
const char *smelt__getenv(const char *name); /* NULL when unset or empty */
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

/* Offset in elements of the element with linear (row-major) index i. */
int64_t smelt__tensor_offset(const smelt_tensor *t, int64_t i);

/* ---- dtype element access for the CPU backend (any float/int dtype as double) */
double smelt__load_f64(const void *base, smelt_dtype dt, int64_t off);
void smelt__store_f64(void *base, smelt_dtype dt, int64_t off, double v);

/* ---- context */
struct smelt__cuda_ctx;
struct smelt_ctx {
  smelt_device_kind device;
  int device_index;
  int deterministic;
  struct smelt__cuda_ctx *cuda; /* NULL on the CPU backend */
};

/* ---- plans */
typedef enum smelt__op {
  SMELT__OP_ACTIVATION = 1,
  SMELT__OP_SOFTMAX,
  SMELT__OP_TOPK,
  SMELT__OP_GEMM,
  SMELT__OP_ATTENTION,
  SMELT__OP_PEER
} smelt__op;

#define SMELT__PLAN_MAX_TENSORS 6
#define SMELT__PLAN_MAX_FUNCS 4

struct smelt_plan {
  smelt_ctx *ctx;
  smelt__op op;
  char describe[160];
  int ntensors;
  smelt_tensor t[SMELT__PLAN_MAX_TENSORS]; /* planned views (data ignored); ndim -1 = absent */
  union {
    smelt_activation_desc act;
    struct { int64_t k; } topk;
  } p;
  /* Op-specific state too large for the union (owned by the plan; freed with
   * opdata_free when the plan is destroyed). */
  void *opdata;
  void (*opdata_free)(void *opdata);
  /* CUDA: functions loaded from the context's module table (owned by it). */
  void *func[SMELT__PLAN_MAX_FUNCS];
  int variant; /* backend-specific variant picked by the selector */
  int block;   /* launch block size chosen at plan time */
};

smelt_status smelt__plan_new(smelt_ctx *ctx, smelt__op op, smelt_plan **out);

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
  char prelude[1024];  /* "#define SMELT_DT 2\n..." */
} smelt__kernel_src;

/* Enumerates every variant an op family's selector can pick (for precompile and
 * the compile test). Writes up to max entries, returns the total count. */
typedef int (*smelt__variant_enum_fn)(smelt__kernel_src *out, int max);
int smelt__activation_variants(smelt__kernel_src *out, int max);
int smelt__softmax_variants(smelt__kernel_src *out, int max);
int smelt__topk_variants(smelt__kernel_src *out, int max);
int smelt__gemm_variants(smelt__kernel_src *out, int max);
int smelt__attention_variants(smelt__kernel_src *out, int max);
int smelt__peer_variants(smelt__kernel_src *out, int max);
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
smelt_status smelt__cpu_activation(const smelt_plan *plan, const smelt_tensor *x,
                                   const smelt_tensor *y);
smelt_status smelt__cpu_softmax(const smelt_plan *plan, const smelt_tensor *x,
                                const smelt_tensor *y, const smelt_tensor *lse);
smelt_status smelt__cpu_topk(const smelt_plan *plan, const smelt_tensor *x,
                             const smelt_tensor *values, const smelt_tensor *indices);

/* ---- CUDA backend op entry points (src/cuda/op_*.c). *_plan selects and loads
 * the kernel into plan->func; *_run launches on the context's stream. */
smelt_status smelt__cuda_activation_plan(smelt_plan *plan);
smelt_status smelt__cuda_activation_run(smelt_plan *plan, const smelt_tensor *x,
                                        const smelt_tensor *y);
smelt_status smelt__cuda_softmax_plan(smelt_plan *plan);
smelt_status smelt__cuda_softmax_run(smelt_plan *plan, const smelt_tensor *x,
                                     const smelt_tensor *y, const smelt_tensor *lse);
smelt_status smelt__cuda_topk_plan(smelt_plan *plan);
smelt_status smelt__cuda_topk_run(smelt_plan *plan, const smelt_tensor *x,
                                  const smelt_tensor *values, const smelt_tensor *indices);

#endif /* SMELT_INTERNAL_H */
