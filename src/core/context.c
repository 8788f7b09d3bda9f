/* Contexts: device selection (explicit or SMELT_DEVICE), the stream, memory
 * and copies, pool/cache statistics, timing events. The CPU backend has no
 * stream: everything on it is synchronous. */
#include "checked.h"
#include "internal.h"
#include "../cuda/cuda_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A smaller host than the machine, for smelt__host_fits: the fuzzer
 * (fuzz/fuzz_main.c) sets its own memory limit here, so a valid but huge
 * request (a CPU GEMM's K x N scratch of broadcast views) is refused as
 * OUT_OF_MEMORY instead of tripping libFuzzer's limit. 0: physical memory. */
size_t smelt__host_limit;

smelt_ctx_options smelt_ctx_options_default(void) {
  smelt_ctx_options o;
  memset(&o, 0, sizeof o);
  o.device = SMELT_DEVICE_CPU;
  o.use_env = 1;
  o.pool_reserve = 0;
  o.pool_release_threshold = SIZE_MAX;
  return o;
}

/* Parses "cpu", "cuda", "cuda:N". */
static smelt_status parse_device(const char *s, smelt_device_kind *kind, int *index) {
  if (!strcmp(s, "cpu")) {
    *kind = SMELT_DEVICE_CPU;
    *index = 0;
    return SMELT_OK;
  }
  if (!strncmp(s, "cuda", 4)) {
    *kind = SMELT_DEVICE_CUDA;
    *index = 0;
    if (s[4] == 0) return SMELT_OK;
    char *end;
    long v = s[4] == ':' ? strtol(s + 5, &end, 10) : -1;
    if (s[4] == ':' && s[5] && *end == 0 && v >= 0 && v < 1024) {
      *index = (int)v;
      return SMELT_OK;
    }
  }
  return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                      "smelt_ctx_create: SMELT_DEVICE=\"%s\" is not cpu, cuda or cuda:N", s);
}

smelt_status smelt_ctx_create(smelt_ctx **out, const smelt_ctx_options *opts) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_ctx_create: out is NULL");
  *out = NULL;
  smelt_status es = smelt__env_check("smelt_ctx_create");
  if (es) return es;
  smelt_ctx_options o = opts ? *opts : smelt_ctx_options_default();
  if (o.device != SMELT_DEVICE_CPU && o.device != SMELT_DEVICE_CUDA)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "smelt_ctx_create: device=%d is not cpu (0) or cuda (1)",
                        (int)o.device);
  const char *env = o.use_env ? smelt__getenv("SMELT_DEVICE") : NULL;
  if (env) {
    smelt_status s = parse_device(env, &o.device, &o.device_index);
    if (s) return s;
  }
  if (o.device_index < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "smelt_ctx_create: device_index=%d must be >= 0",
                        o.device_index);
  smelt_ctx *ctx = (smelt_ctx *)calloc(1, sizeof *ctx);
  if (!ctx) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_ctx_create: out of host memory");
  ctx->device = o.device;
  ctx->device_index = o.device == SMELT_DEVICE_CUDA ? o.device_index : 0;
  ctx->deterministic = o.deterministic != 0;
  if (o.device == SMELT_DEVICE_CUDA) {
    smelt_status s = smelt__cuda_ctx_create(ctx, &o);
    if (s) {
      free(ctx);
      return s;
    }
  }
  *out = ctx;
  return SMELT_OK;
}

void smelt_ctx_destroy(smelt_ctx *ctx) {
  if (!ctx) return;
  if (ctx->cuda) smelt__cuda_ctx_destroy(ctx);
  free(ctx);
}

smelt_device_kind smelt_ctx_device(const smelt_ctx *ctx) { return ctx ? ctx->device : SMELT_DEVICE_CPU; }
int smelt_ctx_device_index(const smelt_ctx *ctx) { return ctx ? ctx->device_index : 0; }
void smelt_ctx_set_deterministic(smelt_ctx *ctx, int on) {
  if (ctx) ctx->deterministic = on != 0;
}

smelt_status smelt_ctx_set_stream(smelt_ctx *ctx, void *stream) {
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_ctx_set_stream: ctx is NULL");
  if (!ctx->cuda) {
    if (stream)
      return smelt__error(SMELT_STATUS_WRONG_DEVICE, "smelt_ctx_set_stream: a CPU context has no streams");
    return SMELT_OK;
  }
  ctx->cuda->stream = stream ? (CUstream)stream : ctx->cuda->own_stream;
  return SMELT_OK;
}

void *smelt_ctx_stream(const smelt_ctx *ctx) { return (ctx && ctx->cuda) ? (void *)ctx->cuda->stream : NULL; }

smelt_status smelt_ctx_synchronize(smelt_ctx *ctx) {
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_ctx_synchronize: ctx is NULL");
  if (!ctx->cuda) return SMELT_OK;
  smelt_status s = smelt__cuda_bind(ctx, "smelt_ctx_synchronize");
  if (s) return s;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuStreamSynchronize(ctx->cuda->stream), "smelt_ctx_synchronize");
  return SMELT_OK;
}

/* ---- memory */

smelt_status smelt_alloc(smelt_ctx *ctx, size_t bytes, void **out) {
  if (!ctx || !out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_alloc: ctx or out is NULL");
  *out = NULL;
  if (ctx->cuda) return smelt__cuda_alloc(ctx, bytes, out);
  /* 64-byte alignment matches what device allocations give vector code. */
  size_t rounded = (bytes + 63) & ~(size_t)63;
  if (rounded < bytes) return smelt__error(SMELT_STATUS_OVERFLOW, "smelt_alloc: %zu bytes overflows", bytes);
  smelt_status s = smelt__host_fits(bytes, "smelt_alloc", "the allocation");
  if (s) return s;
  void *p = aligned_alloc(64, rounded ? rounded : 64);
  if (!p) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_alloc: %zu bytes of host memory", bytes);
  *out = p;
  return SMELT_OK;
}

smelt_status smelt_free(smelt_ctx *ctx, void *p) {
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_free: ctx is NULL");
  if (!p) return SMELT_OK;
  if (ctx->cuda) return smelt__cuda_free(ctx, p);
  free(p);
  return SMELT_OK;
}

typedef enum { H2D, D2H, D2D } copy_kind;

static smelt_status copy(smelt_ctx *ctx, void *dst, const void *src, size_t bytes, copy_kind k,
                         const char *op) {
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: ctx is NULL", op);
  if (bytes == 0) return SMELT_OK;
  if (!dst || !src) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: dst or src is NULL", op);
  if (!ctx->cuda) {
    memmove(dst, src, bytes);
    return SMELT_OK;
  }
  smelt_status s = smelt__cuda_bind(ctx, op);
  if (s) return s;
  const smelt__cu_api *cu = smelt__cu(NULL);
  CUstream st = ctx->cuda->stream;
  /* Host copies are made synchronous with the stream so the host buffer is
   * safe to reuse (H2D) or read (D2H) when the call returns. */
  switch (k) {
    case H2D:
      SMELT__CU_CHECK(cu->cuMemcpyHtoDAsync((CUdeviceptr)dst, src, bytes, st), op);
      SMELT__CU_CHECK(cu->cuStreamSynchronize(st), op);
      break;
    case D2H:
      SMELT__CU_CHECK(cu->cuMemcpyDtoHAsync(dst, (CUdeviceptr)src, bytes, st), op);
      SMELT__CU_CHECK(cu->cuStreamSynchronize(st), op);
      break;
    case D2D: SMELT__CU_CHECK(cu->cuMemcpyDtoDAsync((CUdeviceptr)dst, (CUdeviceptr)src, bytes, st), op); break;
  }
  return SMELT_OK;
}

smelt_status smelt_memcpy_h2d(smelt_ctx *ctx, void *dst, const void *src, size_t bytes) {
  return copy(ctx, dst, src, bytes, H2D, "smelt_memcpy_h2d");
}
smelt_status smelt_memcpy_d2h(smelt_ctx *ctx, void *dst, const void *src, size_t bytes) {
  return copy(ctx, dst, src, bytes, D2H, "smelt_memcpy_d2h");
}
smelt_status smelt_memcpy_d2d(smelt_ctx *ctx, void *dst, const void *src, size_t bytes) {
  return copy(ctx, dst, src, bytes, D2D, "smelt_memcpy_d2d");
}

smelt_status smelt_pool_stats_get(smelt_ctx *ctx, smelt_pool_stats *out) {
  if (!ctx || !out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_pool_stats_get: ctx or out is NULL");
  memset(out, 0, sizeof *out);
  if (!ctx->cuda) return SMELT_OK; /* the CPU backend allocates from the heap and keeps no pool */
  const smelt__cu_api *cu = smelt__cu(NULL);
  CUmemoryPool pool = ctx->cuda->pool;
  SMELT__CU_CHECK(cu->cuMemPoolGetAttribute(pool, SMELT__CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &out->used),
                  "smelt_pool_stats_get");
  SMELT__CU_CHECK(cu->cuMemPoolGetAttribute(pool, SMELT__CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &out->reserved),
                  "smelt_pool_stats_get");
  SMELT__CU_CHECK(cu->cuMemPoolGetAttribute(pool, SMELT__CU_MEMPOOL_ATTR_USED_MEM_HIGH, &out->peak),
                  "smelt_pool_stats_get");
  return SMELT_OK;
}

smelt_status smelt_pool_reset_peak(smelt_ctx *ctx) {
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_pool_reset_peak: ctx is NULL");
  if (!ctx->cuda) return SMELT_OK;
  unsigned long long zero = 0; /* the driver takes 0 as "reset to the current use" */
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemPoolSetAttribute(ctx->cuda->pool, SMELT__CU_MEMPOOL_ATTR_USED_MEM_HIGH, &zero),
                  "smelt_pool_reset_peak");
  return SMELT_OK;
}

smelt_status smelt_pool_trim(smelt_ctx *ctx, size_t keep_bytes) {
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_pool_trim: ctx is NULL");
  if (!ctx->cuda) return SMELT_OK;
  smelt_status s = smelt_ctx_synchronize(ctx);
  if (s) return s;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemPoolTrimTo(ctx->cuda->pool, keep_bytes), "smelt_pool_trim");
  return SMELT_OK;
}

smelt_status smelt_cache_stats_get(smelt_ctx *ctx, smelt_cache_stats *out) {
  if (!ctx || !out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_cache_stats_get: ctx or out is NULL");
  memset(out, 0, sizeof *out);
  smelt__jit_stats(&out->compiles, &out->disk_hits, &out->compile_seconds);
  out->memory_hits = ctx->cuda ? ctx->cuda->memory_hits : 0;
  return SMELT_OK;
}

/* ---- events */

struct smelt_event {
  smelt_ctx *ctx;
  CUevent ev;     /* CUDA */
  double host_s;  /* CPU */
};

smelt_status smelt_event_create(smelt_ctx *ctx, smelt_event **out) {
  if (!ctx || !out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_event_create: ctx or out is NULL");
  *out = NULL;
  smelt_event *e = (smelt_event *)calloc(1, sizeof *e);
  if (!e) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_event_create: out of host memory");
  e->ctx = ctx;
  if (ctx->cuda) {
    smelt_status s = smelt__cuda_bind(ctx, "smelt_event_create");
    CUresult r = s ? 0 : smelt__cu(NULL)->cuEventCreate(&e->ev, 0);
    if (s || r) {
      free(e);
      return s ? s : smelt__cu_error(r, "smelt_event_create", "cuEventCreate");
    }
  }
  *out = e;
  return SMELT_OK;
}

smelt_status smelt_event_record(smelt_event *e) {
  if (!e) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_event_record: event is NULL");
  if (!e->ctx->cuda) {
    e->host_s = smelt__now_seconds();
    return SMELT_OK;
  }
  SMELT__CU_CHECK(smelt__cu(NULL)->cuEventRecord(e->ev, e->ctx->cuda->stream), "smelt_event_record");
  return SMELT_OK;
}

smelt_status smelt_event_elapsed_ms(smelt_event *a, smelt_event *b, float *ms) {
  if (!a || !b || !ms) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_event_elapsed_ms: NULL argument");
  if (a->ctx != b->ctx)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "smelt_event_elapsed_ms: events of different contexts");
  if (!a->ctx->cuda) {
    *ms = (float)((b->host_s - a->host_s) * 1e3);
    return SMELT_OK;
  }
  const smelt__cu_api *cu = smelt__cu(NULL);
  SMELT__CU_CHECK(cu->cuEventSynchronize(b->ev), "smelt_event_elapsed_ms");
  SMELT__CU_CHECK(cu->cuEventElapsedTime(ms, a->ev, b->ev), "smelt_event_elapsed_ms");
  return SMELT_OK;
}

void smelt_event_destroy(smelt_event *e) {
  if (!e) return;
  if (e->ctx->cuda && e->ev) smelt__cu(NULL)->cuEventDestroy(e->ev);
  free(e);
}

/* ---- plans */

smelt_status smelt__plan_new(smelt_ctx *ctx, smelt_plan **out) {
  smelt_plan *p = (smelt_plan *)calloc(1, sizeof *p);
  if (!p) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt plan: out of host memory");
  p->ctx = ctx;
  for (int i = 0; i < SMELT__PLAN_MAX_TENSORS; i++) p->t[i].ndim = -1;
  *out = p;
  return SMELT_OK;
}

void smelt_plan_destroy(smelt_plan *plan) {
  if (!plan) return;
  if (plan->backend_free) plan->backend_free(plan->backend);
  if (plan->opdata_free) plan->opdata_free(plan->opdata);
  free(plan);
}

const char *smelt_plan_describe(const smelt_plan *plan) { return plan ? plan->describe : ""; }
