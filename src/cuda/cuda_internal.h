/* The CUDA backend's internal interface: the driver and NVRTC entry points we
 * resolve at run time, the JIT + kernel cache, the per-context module table,
 * the memory pool and launch helpers.
 *
 * smelt builds with a C compiler alone, so the few driver types we need are
 * declared here with the values of the CUDA 12/13 headers; each entry point is
 * resolved through cuGetProcAddress at SMELT__CU_ABI (so every function pointer
 * below has the signature of that ABI, e.g. cuMemAlloc is cuMemAlloc_v2). */
#ifndef SMELT_CUDA_INTERNAL_H
#define SMELT_CUDA_INTERNAL_H

#include "../core/internal.h"

#include <sys/types.h>

#define SMELT__CU_ABI 12000

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef unsigned long long CUdeviceptr;

enum {
  SMELT__CU_DEV_ATTR_CLOCK_RATE = 13,
  SMELT__CU_DEV_ATTR_SM_COUNT = 16,
  SMELT__CU_DEV_ATTR_L2_CACHE_SIZE = 38,
  SMELT__CU_DEV_ATTR_CC_MAJOR = 75,
  SMELT__CU_DEV_ATTR_CC_MINOR = 76,
  SMELT__CU_DEV_ATTR_SMEM_PER_SM = 81,
  SMELT__CU_DEV_ATTR_SMEM_OPTIN = 97,
  SMELT__CU_DEV_ATTR_MEMORY_POOLS = 115,
  SMELT__CU_FUNC_ATTR_SHARED_SIZE = 1,
  SMELT__CU_FUNC_ATTR_LOCAL_SIZE = 3,
  SMELT__CU_FUNC_ATTR_NUM_REGS = 4,
  SMELT__CU_FUNC_ATTR_MAX_DYN_SMEM = 8,
  SMELT__CU_FUNC_ATTR_CARVEOUT = 9, /* preferred shared memory carveout, percent */
  SMELT__CU_POINTER_ATTR_MEMORY_TYPE = 2,
  SMELT__CU_POINTER_ATTR_DEVICE_ORDINAL = 9,
  SMELT__CU_MEMORYTYPE_HOST = 1,
  SMELT__CU_MEMORYTYPE_DEVICE = 2,
  SMELT__CU_MEMORYTYPE_UNIFIED = 4,
  SMELT__CU_STREAM_NON_BLOCKING = 1,
  SMELT__CU_EVENT_DISABLE_TIMING = 2,
  SMELT__CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
  SMELT__CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5,
  SMELT__CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7,
  SMELT__CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8,
  SMELT__CU_MEMHOSTALLOC_PORTABLE = 1,
  SMELT__CU_MEMHOSTALLOC_DEVICEMAP = 2,
  SMELT__CU_MEM_ATTACH_GLOBAL = 1,
  SMELT__CU_ERROR_OUT_OF_MEMORY = 2,
  SMELT__CU_ERROR_NOT_READY = 600
};

/* CUtensorMap: an opaque 128-byte-aligned descriptor for TMA (sm_90+). */
typedef struct smelt__cu_tensor_map {
  _Alignas(128) uint64_t opaque[16];
} smelt__cu_tensor_map;

/* The CUtensorMap* enum values smelt's maps use (CUDA 12/13):
 * CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle,
 * CUtensorMapL2promotion, CUtensorMapFloatOOBfill. */
enum {
  SMELT__TMA_U8 = 0,
  SMELT__TMA_F16 = 6,
  SMELT__TMA_F32 = 7,
  SMELT__TMA_BF16 = 9,
  SMELT__TMA_INTERLEAVE_NONE = 0,
  SMELT__TMA_SWIZZLE_128B = 3,
  SMELT__TMA_L2_256B = 3,
  SMELT__TMA_OOB_FILL_NONE = 0
};


/* CUlaunchAttribute with the one value we set, the cluster shape
 * (CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION), and CUlaunchConfig, in the CUDA
 * 12/13 layouts (the value is a 64-byte, 8-byte aligned union). */
enum { SMELT__CU_LAUNCH_ATTR_CLUSTER_DIMENSION = 4, SMELT__CU_LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6 };
typedef struct smelt__cu_launch_attr {
  int id;
  char pad[4];
  union {
    char raw[64];
    uint64_t align;
    struct {
      unsigned x, y, z;
    } cluster_dim;
    int allowed; /* programmatic stream serialization */
  } value;
} smelt__cu_launch_attr;
typedef struct smelt__cu_launch_config {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, smem;
  CUstream stream;
  smelt__cu_launch_attr *attrs;
  unsigned num_attrs;
} smelt__cu_launch_config;

/* CUmemPoolProps (CUDA 12/13 layout). */
typedef struct smelt__cu_pool_props {
  int allocType;   /* 1 = pinned */
  int handleTypes; /* 0 = none */
  struct { int type; int id; } location; /* type 1 = device */
  void *win32SecurityAttributes;
  size_t maxSize;
  unsigned short usage;
  unsigned char reserved[54];
} smelt__cu_pool_props;

/* X(name, return-less parameter list) — every driver entry point we use. */
#define SMELT__CU_FUNCS(X)                                                              \
  X(cuInit, (unsigned int flags))                                                       \
  X(cuDriverGetVersion, (int *v))                                                       \
  X(cuGetErrorName, (CUresult e, const char **s))                                       \
  X(cuGetErrorString, (CUresult e, const char **s))                                     \
  X(cuDeviceGetCount, (int *n))                                                         \
  X(cuDeviceGet, (CUdevice * d, int ordinal))                                           \
  X(cuDeviceGetName, (char *name, int len, CUdevice d))                                 \
  X(cuDeviceGetAttribute, (int *v, int attr, CUdevice d))                               \
  X(cuDeviceTotalMem, (size_t * bytes, CUdevice d))                                     \
  X(cuDevicePrimaryCtxRetain, (CUcontext * c, CUdevice d))                              \
  X(cuDevicePrimaryCtxRelease, (CUdevice d))                                            \
  X(cuCtxSetCurrent, (CUcontext c))                                                     \
  X(cuCtxGetCurrent, (CUcontext * c))                                                   \
  X(cuStreamCreate, (CUstream * s, unsigned int flags))                                 \
  X(cuStreamDestroy, (CUstream s))                                                      \
  X(cuStreamSynchronize, (CUstream s))                                                  \
  X(cuModuleLoadData, (CUmodule * m, const void *image))                                \
  X(cuModuleUnload, (CUmodule m))                                                       \
  X(cuModuleGetFunction, (CUfunction * f, CUmodule m, const char *name))               \
  X(cuFuncGetAttribute, (int *v, int attr, CUfunction f))                               \
  X(cuFuncSetAttribute, (CUfunction f, int attr, int value))                            \
  X(cuLaunchKernel, (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,  \
                     unsigned by, unsigned bz, unsigned smem, CUstream s, void **params,  \
                     void **extra))                                                     \
  X(cuLaunchKernelEx, (const smelt__cu_launch_config *config, CUfunction f, void **params, void **extra)) \
  X(cuOccupancyMaxActiveClusters, (int *n, CUfunction f, const smelt__cu_launch_config *config)) \
  X(cuMemAlloc, (CUdeviceptr * p, size_t bytes))                                        \
  X(cuMemFree, (CUdeviceptr p))                                                         \
  X(cuMemGetInfo, (size_t * free_b, size_t * total_b))                                  \
  X(cuMemcpyHtoD, (CUdeviceptr dst, const void *src, size_t n))                         \
  X(cuMemcpyDtoH, (void *dst, CUdeviceptr src, size_t n))                               \
  X(cuMemcpyDtoDAsync, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s))         \
  X(cuMemcpyHtoDAsync, (CUdeviceptr dst, const void *src, size_t n, CUstream s))         \
  X(cuMemcpyDtoHAsync, (void *dst, CUdeviceptr src, size_t n, CUstream s))               \
  X(cuMemsetD8Async, (CUdeviceptr p, unsigned char v, size_t n, CUstream s))             \
  X(cuMemHostAlloc, (void **p, size_t bytes, unsigned int flags))                       \
  X(cuMemHostGetDevicePointer, (CUdeviceptr * d, void *p, unsigned int flags))          \
  X(cuMemFreeHost, (void *p))                                                           \
  X(cuMemAllocManaged, (CUdeviceptr * p, size_t bytes, unsigned int flags))             \
  X(cuMemPoolCreate, (CUmemoryPool * pool, const smelt__cu_pool_props *props))           \
  X(cuMemPoolDestroy, (CUmemoryPool pool))                                              \
  X(cuMemPoolSetAttribute, (CUmemoryPool pool, int attr, void *value))                  \
  X(cuMemPoolGetAttribute, (CUmemoryPool pool, int attr, void *value))                  \
  X(cuMemPoolTrimTo, (CUmemoryPool pool, size_t keep))                                  \
  X(cuMemAllocFromPoolAsync, (CUdeviceptr * p, size_t bytes, CUmemoryPool pool, CUstream s)) \
  X(cuMemFreeAsync, (CUdeviceptr p, CUstream s))                                        \
  X(cuPointerGetAttribute, (void *data, int attr, CUdeviceptr p))                       \
  X(cuEventCreate, (CUevent * e, unsigned int flags))                                   \
  X(cuEventRecord, (CUevent e, CUstream s))                                             \
  X(cuEventSynchronize, (CUevent e))                                                    \
  X(cuEventElapsedTime, (float *ms, CUevent a, CUevent b))                              \
  X(cuEventDestroy, (CUevent e))                                                        \
  X(cuTensorMapEncodeTiled, (smelt__cu_tensor_map * map, int dtype, unsigned rank, void *addr,  \
                             const uint64_t *dims, const uint64_t *strides, const unsigned *box,   \
                             const unsigned *elem_strides, int interleave, int swizzle, int l2,    \
                             int oob_fill))                                               \
  X(cuTensorMapEncodeIm2col, (smelt__cu_tensor_map * map, int dtype, unsigned rank, void *addr, \
                              const uint64_t *dims, const uint64_t *strides, const int *lower,    \
                              const int *upper, unsigned channels, unsigned pixels,               \
                              const unsigned *elem_strides, int interleave, int swizzle, int l2,  \
                              int oob_fill))

typedef struct smelt__cu_api {
#define SMELT__CU_FIELD(name, params) CUresult (*name) params;
  SMELT__CU_FUNCS(SMELT__CU_FIELD)
#undef SMELT__CU_FIELD
} smelt__cu_api;

/* The driver, opened once per process (thread-safe). NULL when not usable;
 * then *why (may be NULL) says why. */
const smelt__cu_api *smelt__cu(const char **why);
int smelt__cu_driver_version(void);
/* Turns a failed driver call into a status with "<op>: <what> failed: CUDA_ERROR_x (text)". */
smelt_status smelt__cu_error(CUresult r, const char *op, const char *what);
#define SMELT__CU_CHECK(call, op)                                                   \
  do {                                                                              \
    CUresult smelt__r = (call);                                                     \
    if (smelt__r != 0) return smelt__cu_error(smelt__r, (op), #call);               \
  } while (0)

/* dlopen the highest-versioned file matching a glob pattern; NULL if none. */
void *smelt__dlopen_glob(const char *pattern);
/* dlopen a library inside a pip wheel ("nvidia/cu13/lib/libnvrtc.so.[0-9]*")
 * of $VIRTUAL_ENV, $CONDA_PREFIX, /usr/local, /usr or /opt/torch/.venv. */
void *smelt__dlopen_pip(const char *rel);

/* ---- NVRTC, opened once per process. */
typedef struct smelt__nvrtc_info {
  int loaded;
  int major, minor;
  char path[512];
  char error[512];
} smelt__nvrtc_info;
const smelt__nvrtc_info *smelt__nvrtc_info_get(void);

/* Compiles src for arch ("sm_90a") to CUBIN (malloc'd, caller frees). On a
 * compile error returns SMELT_STATUS_COMPILE_ERROR with the log in the message
 * and, with SMELT_DUMP_SOURCE=1, the line-numbered source on stderr. */
smelt_status smelt__nvrtc_compile(const smelt__kernel_src *src, const char *arch, void **cubin,
                                  size_t *size);
/* The exact option list used for an arch (for the cache key); returns the count. */
int smelt__nvrtc_options(const char *arch, const char **opts, int max);

/* ---- JIT: disk cache in front of NVRTC. */
/* Cache folder ($SMELT_CACHE_DIR or $XDG_CACHE_HOME/smelt or ~/.cache/smelt),
 * resolved, created with mode 0700; "" when off: it cannot be made, its path is
 * too long, or it or a folder above it is another user's or writable by
 * others (src/cuda/cache_dir.c). */
const char *smelt__cache_dir(void);
/* The longest cache folder path: with "/gemm-tune/<64 hex>.json" below it, a
 * path still fits the buffers, and the folder fits smelt_system_info.cache_dir. */
#define SMELT__CACHE_DIR_MAX 400
/* Why the cache is off ("" when it never was), for `smelt info` and precompile. */
void smelt__cache_off_reason(char *out, size_t n);
/* open() for files in the cache folder: never follows a link, close-on-exec,
 * and only a regular file owned by this user and writable by no one else;
 * -1 with errno set otherwise. */
int smelt__cache_open(const char *path, int flags, mode_t mode);
/* The content key (hex SHA-256) for src on arch. */
void smelt__cache_key(const smelt__kernel_src *src, const char *arch, char hex[65]);
/* Marks seen[i] for each embedded file i that text (len bytes) names in an
 * #include "..." and, through their text, the files those name. Every such
 * line counts, whatever #if or comment surrounds it, so the set holds at
 * least what the preprocessor reads; but for a line that says
 * "smelt-key: if NAME" (an include under #if defined(NAME), NAME only ever
 * defined by a program's prelude) when the prelude has no #define NAME.
 * seen has SMELT__MAX_EMBEDDED entries (the key takes every header when
 * there are more files). */
#define SMELT__MAX_EMBEDDED 512
void smelt__mark_includes(const char *text, size_t len, const char *prelude, unsigned char *seen);
/* Gets the CUBIN for src on arch: disk hit, else compile (unless SMELT_JIT=off)
 * and store. *cached = 1 on a disk hit. Caller frees *cubin. */
smelt_status smelt__jit_cubin(const smelt__kernel_src *src, const char *arch, void **cubin,
                              size_t *size, int *cached, double *seconds);
/* Writes head then body to `path` in `dir` so readers see all or nothing: a
 * temp file in dir (named after `tag`), fsync, rename. Returns 0, or -1 with
 * errno set. The kernel cache and the GEMM tuning records write through it. */
int smelt__cache_write_atomic(const char *dir, const char *path, const char *tag, const void *head, size_t head_n,
                              const void *body, size_t body_n);
/* Process-wide counters. */
void smelt__jit_stats(uint64_t *compiles, uint64_t *disk_hits, double *compile_seconds);

/* ---- per-context CUDA state */
typedef struct smelt__module_entry {
  char key[65];
  CUmodule module;
} smelt__module_entry;

typedef struct smelt__cuda_ctx {
  CUdevice dev;
  CUcontext cu_ctx;
  CUstream own_stream;
  CUstream stream; /* where launches go */
  CUmemoryPool pool;
  smelt_device_info info;
  smelt__module_entry *modules;
  int nmodules, cap_modules;
  uint64_t memory_hits;
} smelt__cuda_ctx;

smelt_status smelt__cuda_ctx_create(smelt_ctx *ctx, const smelt_ctx_options *opts);
void smelt__cuda_ctx_destroy(smelt_ctx *ctx);
/* Makes the context's CUcontext current on the calling thread. */
smelt_status smelt__cuda_bind(smelt_ctx *ctx, const char *op);
/* Loads (compile/cache/in-memory) the module for src and returns function `fn`. */
smelt_status smelt__cuda_function(smelt_ctx *ctx, const smelt__kernel_src *src, const char *fn,
                                  CUfunction *out);
/* Launch with checking; `op` names the op in any error. */
smelt_status smelt__cuda_launch(smelt_ctx *ctx, const char *op, CUfunction f, unsigned gx,
                                unsigned gy, unsigned gz, unsigned block, unsigned smem,
                                void **params);
/* Launch of gx blocks along x as the programmatic dependent of the kernel
 * queued before it on the context's stream (programmatic dependent launch,
 * sm_90): its CTAs may start once every CTA of that kernel has executed
 * griddepcontrol.launch_dependents (or ended), before that kernel ends;
 * without that instruction, or where the driver serializes, it runs after
 * it as usual. It must then not read that kernel's results without its own
 * synchronization (it does not wait with griddepcontrol.wait). */
smelt_status smelt__cuda_launch_dependent(smelt_ctx *ctx, const char *op, CUfunction f, unsigned gx, unsigned block,
                                          unsigned smem, void **params);
/* Launch of gx blocks (a multiple of `cluster`) in clusters of `cluster`
 * blocks along x (cuLaunchKernelEx with the cluster shape). */
smelt_status smelt__cuda_launch_cluster(smelt_ctx *ctx, const char *op, CUfunction f, unsigned gx, unsigned cluster,
                                        unsigned block, unsigned smem, void **params);
/* How many clusters of `cluster` blocks (block threads, smem bytes each)
 * can run at once on the device: the grid of a persistent cluster kernel. */
smelt_status smelt__cuda_max_clusters(smelt_ctx *ctx, const char *op, CUfunction f, unsigned cluster, unsigned block,
                                      unsigned smem, int *n);
/* Pool allocation on the context's stream. */
smelt_status smelt__cuda_alloc(smelt_ctx *ctx, size_t bytes, void **out);
smelt_status smelt__cuda_free(smelt_ctx *ctx, void *p);

/* NVTX ranges (libnvToolsExt opened lazily; no-ops when absent). */
void smelt__nvtx_push(const char *name);
void smelt__nvtx_pop(void);

/* Packs a tensor's shape/strides for a kernel: up to 8 dims, innermost last. */
typedef struct smelt__kshape {
  int64_t shape[SMELT_MAX_DIMS];
  int64_t strides[SMELT_MAX_DIMS];
  int ndim;
  int pad;
} smelt__kshape;
void smelt__kshape_from(smelt__kshape *k, const smelt_tensor *t);
/* The row layout of t's first nrow_dims dims (the rows of a row-wise op), size-1
 * dims dropped and contiguous neighbours merged: usually one dim, so a row's
 * offset is r * stride. */
void smelt__kshape_rows(const smelt_tensor *t, int nrow_dims, smelt__kshape *k);

#endif /* SMELT_CUDA_INTERNAL_H */
