/* smelt — fused GPU kernels for machine learning, with a C API.
 *
 * This header is the whole public API. Conventions:
 *   - Every fallible call returns smelt_status; SMELT_OK is 0. On failure a
 *     thread-local message (smelt_last_error) names the op, the tensor, the
 *     constraint, the value seen and the supported set. Nothing is written to
 *     outputs when a call fails its validation.
 *   - Tensors are non-owning views. Shapes and strides are in elements; strides
 *     may be any non-negative values (0 broadcasts along an axis on inputs).
 *   - Ops follow "plan, then run": *_plan validates what is static (dtypes,
 *     shapes, layouts), picks the kernel and compiles/loads it; *_run binds
 *     tensors of exactly the planned shapes and launches on the context's
 *     stream. The one-shot call (e.g. smelt_softmax) does both.
 *   - Device work is asynchronous on the context's stream; smelt_ctx_synchronize
 *     waits for it. The CPU backend runs synchronously.
 *   - Threads. Different contexts may be used from different threads at the
 *     same time: what the library keeps per process (the CUDA driver and
 *     NVRTC, loaded once; the kernel cache and its statistics, under a lock)
 *     is thread-safe, and smelt_last_error is per thread. One context, with
 *     everything made on it (plans, events, PEER stores), is used by one
 *     thread at a time: its calls must not overlap, though it may pass from
 *     thread to thread between calls (ordered by the caller, e.g. with a
 *     mutex). On CUDA, planning adds to the context's module table, a run may
 *     change its plan (GEMM loads a kernel for unaligned pointers once) and a
 *     run's launches must follow each other on the context's one stream; the
 *     CPU backend keeps the same rule, so code moves between the two. A PEER
 *     store reports the overlaps it sees (smelt/peer.h).
 */
#ifndef SMELT_H
#define SMELT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define SMELT_API
#else
#define SMELT_API __attribute__((visibility("default")))
#endif

#define SMELT_VERSION_MAJOR 0
#define SMELT_VERSION_MINOR 1
#define SMELT_VERSION_PATCH 0
#define SMELT_VERSION_STRING "0.1.0"

/* Runtime version: major*10000 + minor*100 + patch. */
SMELT_API int smelt_version(void);
SMELT_API const char *smelt_version_string(void);

/* ---------------------------------------------------------------- status */

/* X(name, value, message) — the one list every status is generated from. */
#define SMELT_STATUS_LIST(X)                                                         \
  X(OK, 0, "success")                                                                \
  X(INVALID_ARGUMENT, -1, "invalid argument")                                        \
  X(NULL_POINTER, -2, "null pointer")                                                \
  X(SHAPE_MISMATCH, -3, "shape mismatch")                                            \
  X(DTYPE_MISMATCH, -4, "unsupported or mismatched dtype")                           \
  X(BAD_LAYOUT, -5, "unsupported layout or strides")                                 \
  X(MISALIGNED, -6, "pointer not aligned for its dtype")                             \
  X(WRONG_DEVICE, -7, "tensor on the wrong device")                                  \
  X(UNSUPPORTED, -8, "unsupported configuration")                                    \
  X(OUT_OF_MEMORY, -9, "out of memory")                                              \
  X(NO_DEVICE, -10, "no usable device")                                              \
  X(DRIVER_ERROR, -11, "CUDA driver error")                                          \
  X(COMPILE_ERROR, -12, "kernel compilation failed")                                 \
  X(NOT_FOUND, -13, "not found")                                                     \
  X(CACHE_ERROR, -14, "kernel cache error")                                          \
  X(IO_ERROR, -15, "I/O error")                                                      \
  X(OVERFLOW, -16, "size overflow")                                                  \
  X(INTERNAL, -17, "internal error")

typedef enum smelt_status {
#define SMELT__STATUS_ENUM(name, value, msg) SMELT_STATUS_##name = value,
  SMELT_STATUS_LIST(SMELT__STATUS_ENUM)
#undef SMELT__STATUS_ENUM
} smelt_status;

#define SMELT_OK SMELT_STATUS_OK

/* "SMELT_STATUS_SHAPE_MISMATCH" etc.; "SMELT_STATUS_UNKNOWN" for other values. */
SMELT_API const char *smelt_status_name(smelt_status s);
/* The fixed one-line description of a status ("shape mismatch"). */
SMELT_API const char *smelt_status_string(smelt_status s);
/* The calling thread's message for its last failed call ("" if none). */
SMELT_API const char *smelt_last_error(void);
SMELT_API void smelt_clear_error(void);

/* ---------------------------------------------------------------- dtypes */

typedef enum smelt_dtype {
  SMELT_DTYPE_F64 = 0,
  SMELT_DTYPE_F32,
  SMELT_DTYPE_F16,
  SMELT_DTYPE_BF16,
  SMELT_DTYPE_E4M3, /* fp8 e4m3fn: max 448, no inf, NaN = S.1111.111 */
  SMELT_DTYPE_E5M2, /* fp8 e5m2: max 57344, IEEE-like inf/NaN */
  SMELT_DTYPE_I8,
  SMELT_DTYPE_I32,
  SMELT_DTYPE_I64,
  SMELT_DTYPE_U8,
  SMELT_DTYPE_BOOL,
  SMELT_DTYPE_COUNT
} smelt_dtype;

/* Size in bytes (0 for an invalid dtype) and short name ("bf16"; "?" if invalid). */
SMELT_API size_t smelt_dtype_size(smelt_dtype dt);
SMELT_API const char *smelt_dtype_name(smelt_dtype dt);
/* Parses a short name ("f32", "bf16", "e4m3", ...); SMELT_STATUS_NOT_FOUND if unknown. */
SMELT_API smelt_status smelt_dtype_from_name(const char *name, smelt_dtype *out);

/* Host conversions. Narrowing rounds to nearest even. f16/bf16 overflow to inf;
 * fp8 saturates to the largest finite value (NaN stays NaN). */
SMELT_API uint16_t smelt_f32_to_f16(float x);
SMELT_API float smelt_f16_to_f32(uint16_t h);
SMELT_API uint16_t smelt_f32_to_bf16(float x);
SMELT_API float smelt_bf16_to_f32(uint16_t h);
SMELT_API uint8_t smelt_f32_to_e4m3(float x);
SMELT_API float smelt_e4m3_to_f32(uint8_t v);
SMELT_API uint8_t smelt_f32_to_e5m2(float x);
SMELT_API float smelt_e5m2_to_f32(uint8_t v);

/* ---------------------------------------------------------------- tensors */

#define SMELT_MAX_DIMS 8

typedef enum smelt_device_kind {
  SMELT_DEVICE_CPU = 0,
  SMELT_DEVICE_CUDA = 1
} smelt_device_kind;

/* A non-owning view. shape[i] >= 0; strides in elements, non-negative
 * (negative strides are refused); ndim in [0, 8] (ndim 0 is a scalar of one
 * element). A view with no elements (some shape[i] == 0) may have any
 * strides and a NULL data pointer: nothing of it is read. Memory belongs to
 * the caller. */
typedef struct smelt_tensor {
  void *data;
  smelt_dtype dtype;
  smelt_device_kind device;
  int device_index; /* CUDA ordinal; 0 for the CPU */
  int ndim;
  int64_t shape[SMELT_MAX_DIMS];
  int64_t strides[SMELT_MAX_DIMS];
} smelt_tensor;

/* A row-major contiguous view of `ndim` dims. Returns the view by value; an
 * invalid ndim gives ndim = -1, which every op rejects. */
SMELT_API smelt_tensor smelt_tensor_make(void *data, smelt_dtype dt, smelt_device_kind dev,
                                         int device_index, int ndim, const int64_t *shape);
/* Number of elements (1 for ndim 0), or -1 on negative sizes / overflow. */
SMELT_API int64_t smelt_tensor_numel(const smelt_tensor *t);
/* 1 if row-major contiguous (size-1 dims may have any stride; a view with
 * no elements is contiguous whatever its strides). */
SMELT_API int smelt_tensor_is_contiguous(const smelt_tensor *t);

/* ---------------------------------------------------------------- context */

typedef struct smelt_ctx smelt_ctx;

typedef struct smelt_ctx_options {
  /* SMELT_DEVICE_CPU or SMELT_DEVICE_CUDA; ignored when use_env is set and
   * SMELT_DEVICE is present ("cpu", "cuda", "cuda:N"). */
  smelt_device_kind device;
  int device_index;
  int use_env;              /* read SMELT_DEVICE (default 1 via smelt_ctx_options_default) */
  void *stream;             /* CUstream to launch on; NULL = a stream the context creates */
  size_t pool_reserve;      /* bytes reserved in the pool at creation (CUDA) */
  size_t pool_release_threshold; /* bytes the pool keeps after a sync (CUDA); SIZE_MAX = keep all */
  int deterministic;        /* ops with a fast non-deterministic path use the deterministic one */
} smelt_ctx_options;

SMELT_API smelt_ctx_options smelt_ctx_options_default(void);
/* opts may be NULL (defaults). Fails with SMELT_STATUS_NO_DEVICE when CUDA was
 * asked for and is not usable; the message says why. */
SMELT_API smelt_status smelt_ctx_create(smelt_ctx **out, const smelt_ctx_options *opts);
SMELT_API void smelt_ctx_destroy(smelt_ctx *ctx);
SMELT_API smelt_device_kind smelt_ctx_device(const smelt_ctx *ctx);
SMELT_API int smelt_ctx_device_index(const smelt_ctx *ctx);
/* Switches the stream later launches go to. NULL = the context's own stream;
 * any other value is a CUstream, including the driver's special handles
 * CU_STREAM_LEGACY ((void *)1, the legacy default stream, which is what torch's
 * default stream is) and CU_STREAM_PER_THREAD ((void *)2). */
SMELT_API smelt_status smelt_ctx_set_stream(smelt_ctx *ctx, void *stream);
SMELT_API void *smelt_ctx_stream(const smelt_ctx *ctx);
SMELT_API smelt_status smelt_ctx_synchronize(smelt_ctx *ctx);
SMELT_API void smelt_ctx_set_deterministic(smelt_ctx *ctx, int on);

/* Device memory from the context's stream-ordered pool (CUDA) or the heap (CPU).
 * The memory is usable in stream order; free is stream-ordered too. */
SMELT_API smelt_status smelt_alloc(smelt_ctx *ctx, size_t bytes, void **out);
SMELT_API smelt_status smelt_free(smelt_ctx *ctx, void *p);
/* Copies on the context's stream. h2d and d2h return only when the copy is
 * done (the host buffer may be reused/read at once); d2d is asynchronous like
 * any launch. On the CPU backend all three are plain memmove. */
SMELT_API smelt_status smelt_memcpy_h2d(smelt_ctx *ctx, void *dst, const void *src, size_t bytes);
SMELT_API smelt_status smelt_memcpy_d2h(smelt_ctx *ctx, void *dst, const void *src, size_t bytes);
SMELT_API smelt_status smelt_memcpy_d2d(smelt_ctx *ctx, void *dst, const void *src, size_t bytes);

typedef struct smelt_pool_stats {
  uint64_t used;     /* bytes handed out now */
  uint64_t reserved; /* bytes the pool holds from the driver now */
  uint64_t peak;     /* high-water mark of used */
} smelt_pool_stats;
SMELT_API smelt_status smelt_pool_stats_get(smelt_ctx *ctx, smelt_pool_stats *out);
/* Resets the peak (high-water mark) to the current use. */
SMELT_API smelt_status smelt_pool_reset_peak(smelt_ctx *ctx);
/* Synchronizes, then returns the pool's unused memory beyond keep_bytes to the driver. */
SMELT_API smelt_status smelt_pool_trim(smelt_ctx *ctx, size_t keep_bytes);

typedef struct smelt_cache_stats {
  uint64_t compiles;    /* NVRTC compilations this process */
  uint64_t disk_hits;   /* CUBINs loaded from the disk cache */
  uint64_t memory_hits; /* plans served from the in-memory module table */
  double compile_seconds;
} smelt_cache_stats;
SMELT_API smelt_status smelt_cache_stats_get(smelt_ctx *ctx, smelt_cache_stats *out);

/* Timing events on the context's stream: device events on CUDA, the host
 * monotonic clock on the CPU. For benchmarks; elapsed is in milliseconds. */
typedef struct smelt_event smelt_event;
SMELT_API smelt_status smelt_event_create(smelt_ctx *ctx, smelt_event **out);
SMELT_API smelt_status smelt_event_record(smelt_event *ev);
SMELT_API smelt_status smelt_event_elapsed_ms(smelt_event *start, smelt_event *end, float *ms);
SMELT_API void smelt_event_destroy(smelt_event *ev);

/* ---------------------------------------------------------------- system info */

typedef struct smelt_device_info {
  char name[256];
  int index;
  int sm_count;
  int cc_major, cc_minor;
  uint64_t total_memory;
  uint64_t l2_bytes;
  int smem_per_block_optin;
  char arch[16]; /* "sm_90a" for Hopper, "sm_80" ... : what smelt compiles for */
} smelt_device_info;

typedef struct smelt_system_info {
  int driver_loaded;     /* libcuda.so.1 opened and initialized */
  int driver_version;    /* e.g. 13000 */
  char driver_error[512]; /* why not, when driver_loaded is 0 */
  int nvrtc_loaded;
  int nvrtc_major, nvrtc_minor;
  char nvrtc_path[512];
  char nvrtc_error[512];
  int device_count;
  char cache_dir[512];   /* "" when the disk cache is off */
  uint64_t cache_bytes;  /* size of the entries in cache_dir */
  uint64_t cache_entries;
  char cache_error[768]; /* why the disk cache is off, when cache_dir is "" */
} smelt_system_info;

SMELT_API smelt_status smelt_system_info_get(smelt_system_info *out);
SMELT_API smelt_status smelt_device_info_get(int index, smelt_device_info *out);

/* ---------------------------------------------------------------- plans */

/* A plan: an op's validated static description plus its loaded kernel. Plans
 * belong to the context they were made on and must be destroyed before it. */
typedef struct smelt_plan smelt_plan;
SMELT_API void smelt_plan_destroy(smelt_plan *plan); /* NULL is a no-op */
/* Human-readable description of the kernel the plan picked ("softmax_rows f32 regs"). */
SMELT_API const char *smelt_plan_describe(const smelt_plan *plan);

/* ---------------------------------------------------------------- activation */

typedef enum smelt_act {
  SMELT_ACT_IDENTITY = 0,
  SMELT_ACT_RELU,
  SMELT_ACT_LEAKY_RELU, /* x if x >= 0 else slope*x */
  SMELT_ACT_TANH,
  SMELT_ACT_SIGMOID,
  SMELT_ACT_SILU,       /* x * sigmoid(x) */
  SMELT_ACT_HARDSWISH,  /* x * min(max(x + 3, 0), 6) / 6 */
  SMELT_ACT_GELU,       /* 0.5 x (1 + erf(x / sqrt 2)) */
  SMELT_ACT_GELU_TANH,  /* 0.5 x (1 + tanh(0.7978845608 (x + 0.044715 x^3))) */
  SMELT_ACT_COUNT
} smelt_act;

SMELT_API const char *smelt_act_name(smelt_act a);
SMELT_API smelt_status smelt_act_from_name(const char *name, smelt_act *out);
/* The activation in double precision: the definition every backend is checked against. */
SMELT_API double smelt_act_apply(smelt_act a, double x, double slope);

/* y = act(x), elementwise. x and y: same shape (any ndim <= 8), same dtype
 * (f32, f16, bf16), any non-negative strides (y must not overlap x unless y == x exactly,
 * which is allowed: in place). slope is used by leaky_relu (default 0.01). */
typedef struct smelt_activation_desc {
  smelt_act act;
  float slope;
} smelt_activation_desc;

SMELT_API smelt_status smelt_activation_plan(smelt_ctx *ctx, const smelt_activation_desc *desc,
                                             const smelt_tensor *x, const smelt_tensor *y,
                                             smelt_plan **out);
SMELT_API smelt_status smelt_activation_run(smelt_plan *plan, const smelt_tensor *x,
                                            const smelt_tensor *y);
SMELT_API smelt_status smelt_activation(smelt_ctx *ctx, const smelt_activation_desc *desc,
                                        const smelt_tensor *x, const smelt_tensor *y);

/* ---------------------------------------------------------------- softmax */

/* Row-wise softmax over the last dimension.
 *   x   [..., C]  f32, f16 or bf16 (any non-negative strides)
 *   y   [..., C]  same dtype and shape as x
 *   lse [...]     f32, logsumexp of each row (may be NULL)
 * NaN in a row makes the whole row (and its lse) NaN. A row of all -inf has
 * no mass: y = 0 and lse = -inf. C >= 1. */
SMELT_API smelt_status smelt_softmax_plan(smelt_ctx *ctx, const smelt_tensor *x,
                                          const smelt_tensor *y, const smelt_tensor *lse,
                                          smelt_plan **out);
SMELT_API smelt_status smelt_softmax_run(smelt_plan *plan, const smelt_tensor *x,
                                         const smelt_tensor *y, const smelt_tensor *lse);
SMELT_API smelt_status smelt_softmax(smelt_ctx *ctx, const smelt_tensor *x, const smelt_tensor *y,
                                     const smelt_tensor *lse);

/* ---------------------------------------------------------------- top-k */

/* Row-wise top-k over the last dimension, largest first.
 *   x       [..., C]  f32, f16 or bf16 (any non-negative strides); 1 <= k <= C
 *   values  [..., k]  same dtype as x
 *   indices [..., k]  i32 or i64 (may be NULL when only values are wanted)
 * Order: descending by value; equal values by ascending index; NaN ranks above
 * +inf (as torch.topk); -0.0 and +0.0 are equal. */
SMELT_API smelt_status smelt_topk_plan(smelt_ctx *ctx, int64_t k, const smelt_tensor *x,
                                       const smelt_tensor *values, const smelt_tensor *indices,
                                       smelt_plan **out);
SMELT_API smelt_status smelt_topk_run(smelt_plan *plan, const smelt_tensor *x,
                                      const smelt_tensor *values, const smelt_tensor *indices);
SMELT_API smelt_status smelt_topk(smelt_ctx *ctx, int64_t k, const smelt_tensor *x,
                                  const smelt_tensor *values, const smelt_tensor *indices);

/* ---------------------------------------------------------------- precompile */

/* Compiles every kernel variant the selectors can pick for `arch` ("sm_90a",
 * "sm_80", ...; NULL = each local device's arch) into the disk cache. No GPU
 * is needed. Kernels compile on one thread per core. `progress` (may be NULL)
 * is called once per kernel, from those threads but never two calls at once,
 * with index counting completions from 1 and cached = 1 when the kernel was
 * already in the cache;
 * *compiled_count counts every kernel now in the cache, cached ones included.
 * Fails with INVALID_ARGUMENT for an arch below sm_80 or not of that form, and
 * with CACHE_ERROR (naming why) when there is no usable cache folder. */
typedef void (*smelt_progress_fn)(void *user, const char *kernel, int index, int total,
                                  double seconds, int cached);
SMELT_API smelt_status smelt_precompile(const char *arch, smelt_progress_fn progress, void *user,
                                        int *compiled_count);

#include "smelt/gemm.h"
#include "smelt/conv2d.h"
#include "smelt/attention.h"
#include "smelt/attention_decode.h"
#include "smelt/peer.h"
#include "smelt/moe.h"
#include "smelt/bem.h"
#include "smelt/quant.h"
#include "smelt/norm.h"
#include "smelt/rotary.h"
#include "smelt/qgemm.h"
#include "smelt/graph.h"

#ifdef __cplusplus
}
#endif

#endif /* SMELT_H */
