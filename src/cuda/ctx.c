/* Per-context CUDA state: the device's primary context, the stream, the
 * stream-ordered memory pool, the in-memory module table, and the checked
 * launch every op goes through. */
#include "cuda_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

smelt_status smelt__cuda_bind(smelt_ctx *ctx, const char *op) {
  const smelt__cu_api *cu = smelt__cu(NULL);
  CUcontext cur = NULL;
  cu->cuCtxGetCurrent(&cur);
  if (cur != ctx->cuda->cu_ctx) SMELT__CU_CHECK(cu->cuCtxSetCurrent(ctx->cuda->cu_ctx), op);
  return SMELT_OK;
}

static smelt_status create_pool(smelt__cuda_ctx *c, const smelt_ctx_options *o) {
  const smelt__cu_api *cu = smelt__cu(NULL);
  smelt__cu_pool_props props;
  memset(&props, 0, sizeof props);
  props.allocType = 1;         /* pinned device memory */
  props.location.type = 1;     /* a device */
  props.location.id = (int)c->dev;
  SMELT__CU_CHECK(cu->cuMemPoolCreate(&c->pool, &props), "smelt_ctx_create");
  /* Memory freed to the pool stays reserved up to the threshold across
   * synchronizations, so steady-state allocations never reach the driver. */
  unsigned long long thr = o->pool_release_threshold;
  SMELT__CU_CHECK(cu->cuMemPoolSetAttribute(c->pool, SMELT__CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &thr),
                  "smelt_ctx_create");
  if (o->pool_reserve) {
    CUdeviceptr p;
    SMELT__CU_CHECK(cu->cuMemAllocFromPoolAsync(&p, o->pool_reserve, c->pool, c->stream), "smelt_ctx_create");
    SMELT__CU_CHECK(cu->cuMemFreeAsync(p, c->stream), "smelt_ctx_create");
    SMELT__CU_CHECK(cu->cuStreamSynchronize(c->stream), "smelt_ctx_create");
  }
  return SMELT_OK;
}

smelt_status smelt__cuda_ctx_create(smelt_ctx *ctx, const smelt_ctx_options *o) {
  const char *why = "";
  const smelt__cu_api *cu = smelt__cu(&why);
  if (!cu) return smelt__error(SMELT_STATUS_NO_DEVICE, "smelt_ctx_create: CUDA is not usable: %s", why);
  int n = 0;
  cu->cuDeviceGetCount(&n);
  if (ctx->device_index >= n)
    return smelt__error(SMELT_STATUS_NO_DEVICE, "smelt_ctx_create: cuda:%d does not exist (%d CUDA device%s)",
                        ctx->device_index, n, n == 1 ? "" : "s");
  smelt__cuda_ctx *c = (smelt__cuda_ctx *)calloc(1, sizeof *c);
  if (!c) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_ctx_create: out of host memory");
  ctx->cuda = c;
  smelt_status s = smelt_device_info_get(ctx->device_index, &c->info);
  if (s) goto fail;
  CUresult r = cu->cuDeviceGet(&c->dev, ctx->device_index);
  if (!r) r = cu->cuDevicePrimaryCtxRetain(&c->cu_ctx, c->dev);
  if (r) {
    s = smelt__cu_error(r, "smelt_ctx_create", "retaining the primary context");
    goto fail;
  }
  if ((s = smelt__cuda_bind(ctx, "smelt_ctx_create"))) goto fail;
  if ((r = cu->cuStreamCreate(&c->own_stream, SMELT__CU_STREAM_NON_BLOCKING))) {
    s = smelt__cu_error(r, "smelt_ctx_create", "cuStreamCreate");
    goto fail;
  }
  c->stream = o->stream ? (CUstream)o->stream : c->own_stream;
  if ((s = create_pool(c, o))) goto fail;
  return SMELT_OK;
fail:
  smelt__cuda_ctx_destroy(ctx);
  return s;
}

void smelt__cuda_ctx_destroy(smelt_ctx *ctx) {
  smelt__cuda_ctx *c = ctx->cuda;
  if (!c) return;
  const smelt__cu_api *cu = smelt__cu(NULL);
  if (c->cu_ctx) {
    cu->cuCtxSetCurrent(c->cu_ctx);
    if (c->stream) cu->cuStreamSynchronize(c->stream);
    for (int i = 0; i < c->nmodules; i++) cu->cuModuleUnload(c->modules[i].module);
    if (c->pool) cu->cuMemPoolDestroy(c->pool);
    if (c->own_stream) cu->cuStreamDestroy(c->own_stream);
    cu->cuDevicePrimaryCtxRelease(c->dev);
  }
  free(c->modules);
  free(c);
  ctx->cuda = NULL;
}

smelt_status smelt__cuda_function(smelt_ctx *ctx, const smelt__kernel_src *src, const char *fn,
                                  CUfunction *out) {
  const smelt__cu_api *cu = smelt__cu(NULL);
  smelt__cuda_ctx *c = ctx->cuda;
  smelt_status s = smelt__cuda_bind(ctx, src->name);
  if (s) return s;
  char key[65];
  smelt__cache_key(src, c->info.arch, key);
  CUmodule mod = NULL;
  for (int i = 0; i < c->nmodules && !mod; i++)
    if (!strcmp(c->modules[i].key, key)) mod = c->modules[i].module;
  if (mod) {
    c->memory_hits++;
  } else {
    void *bin;
    size_t n;
    int cached;
    double secs;
    double t0 = smelt__now_seconds();
    s = smelt__jit_cubin(src, c->info.arch, &bin, &n, &cached, &secs);
    if (s) return s;
    CUresult r = cu->cuModuleLoadData(&mod, bin);
    free(bin);
    if (r) return smelt__cu_error(r, src->name, "cuModuleLoadData");
    if (c->nmodules == c->cap_modules) {
      int cap = c->cap_modules ? 2 * c->cap_modules : 16;
      smelt__module_entry *m = (smelt__module_entry *)realloc(c->modules, (size_t)cap * sizeof *m);
      if (!m) {
        cu->cuModuleUnload(mod);
        return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", src->name);
      }
      c->modules = m;
      c->cap_modules = cap;
    }
    memcpy(c->modules[c->nmodules].key, key, sizeof key);
    c->modules[c->nmodules].module = mod;
    c->nmodules++;
    smelt__log(SMELT__LOG_INFO, "loaded %s (%s) in %.3f s", src->name, cached ? "disk cache" : "compiled",
               smelt__now_seconds() - t0);
  }
  CUresult r = cu->cuModuleGetFunction(out, mod, fn);
  if (r) return smelt__cu_error(r, src->name, fn);
  if (smelt__log_level() >= SMELT__LOG_DEBUG) {
    int regs = 0, smem = 0, local = 0;
    cu->cuFuncGetAttribute(&regs, SMELT__CU_FUNC_ATTR_NUM_REGS, *out);
    cu->cuFuncGetAttribute(&smem, SMELT__CU_FUNC_ATTR_SHARED_SIZE, *out);
    cu->cuFuncGetAttribute(&local, SMELT__CU_FUNC_ATTR_LOCAL_SIZE, *out);
    smelt__log(SMELT__LOG_DEBUG, "%s.%s: %d registers, %d B static shared, %d B local (spills)", src->name, fn,
               regs, smem, local);
  }
  return SMELT_OK;
}

/* Binds the context and lets f take smem bytes of dynamic shared memory
 * (above the default 48 KiB it must opt in; occupancy queries count it too). */
static smelt_status prepare(smelt_ctx *ctx, const char *op, CUfunction f, unsigned smem) {
  smelt_status s = smelt__cuda_bind(ctx, op);
  if (s) return s;
  if (smem > 48 * 1024)
    SMELT__CU_CHECK(smelt__cu(NULL)->cuFuncSetAttribute(f, SMELT__CU_FUNC_ATTR_MAX_DYN_SMEM, (int)smem), op);
  return SMELT_OK;
}

smelt_status smelt__cuda_launch(smelt_ctx *ctx, const char *op, CUfunction f, unsigned gx, unsigned gy,
                                unsigned gz, unsigned block, unsigned smem, void **params) {
  if (gx == 0 || gy == 0 || gz == 0) return SMELT_OK;
  smelt_status s = prepare(ctx, op, f, smem);
  if (s) return s;
  const smelt__cu_api *cu = smelt__cu(NULL);
  SMELT__CU_CHECK(cu->cuLaunchKernel(f, gx, gy, gz, block, 1, 1, smem, ctx->cuda->stream, params, NULL), op);
  return SMELT_OK;
}

/* Prepares f and a launch of gx blocks on the context's stream with one
 * attribute of kind `id`, whose value the caller sets. */
static smelt_status config_one(smelt_ctx *ctx, const char *op, CUfunction f, smelt__cu_launch_config *c,
                               smelt__cu_launch_attr *a, int id, unsigned gx, unsigned block, unsigned smem) {
  smelt_status s = prepare(ctx, op, f, smem);
  if (s) return s;
  memset(c, 0, sizeof *c);
  memset(a, 0, sizeof *a);
  a->id = id;
  c->grid_x = gx;
  c->grid_y = c->grid_z = 1;
  c->block_x = block;
  c->block_y = c->block_z = 1;
  c->smem = smem;
  c->stream = ctx->cuda->stream;
  c->attrs = a;
  c->num_attrs = 1;
  return SMELT_OK;
}

smelt_status smelt__cuda_launch_dependent(smelt_ctx *ctx, const char *op, CUfunction f, unsigned gx, unsigned block,
                                          unsigned smem, void **params) {
  if (gx == 0) return SMELT_OK;
  smelt__cu_launch_config c;
  smelt__cu_launch_attr a;
  smelt_status s =
      config_one(ctx, op, f, &c, &a, SMELT__CU_LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, gx, block, smem);
  if (s) return s;
  a.value.allowed = 1;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuLaunchKernelEx(&c, f, params, NULL), op);
  return SMELT_OK;
}

/* config_one() for clusters of `cluster` blocks along x. */
static smelt_status config_cluster(smelt_ctx *ctx, const char *op, CUfunction f, smelt__cu_launch_config *c,
                                   smelt__cu_launch_attr *a, unsigned gx, unsigned cluster, unsigned block,
                                   unsigned smem) {
  smelt_status s = config_one(ctx, op, f, c, a, SMELT__CU_LAUNCH_ATTR_CLUSTER_DIMENSION, gx, block, smem);
  if (s) return s;
  a->value.cluster_dim.x = cluster;
  a->value.cluster_dim.y = a->value.cluster_dim.z = 1;
  return SMELT_OK;
}

smelt_status smelt__cuda_launch_cluster(smelt_ctx *ctx, const char *op, CUfunction f, unsigned gx, unsigned cluster,
                                        unsigned block, unsigned smem, void **params) {
  if (gx == 0) return SMELT_OK;
  if (gx % cluster != 0)
    return smelt__error(SMELT_STATUS_INTERNAL, "%s: grid %u is not a multiple of the cluster size %u", op, gx, cluster);
  smelt__cu_launch_config c;
  smelt__cu_launch_attr a;
  smelt_status s = config_cluster(ctx, op, f, &c, &a, gx, cluster, block, smem);
  if (s) return s;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuLaunchKernelEx(&c, f, params, NULL), op);
  return SMELT_OK;
}

smelt_status smelt__cuda_max_clusters(smelt_ctx *ctx, const char *op, CUfunction f, unsigned cluster, unsigned block,
                                      unsigned smem, int *n) {
  smelt__cu_launch_config c;
  smelt__cu_launch_attr a;
  smelt_status s = config_cluster(ctx, op, f, &c, &a, cluster, cluster, block, smem);
  if (s) return s;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuOccupancyMaxActiveClusters(n, f, &c), op);
  if (*n < 1)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        "%s: no cluster of %u blocks of %u threads and %u bytes fits the device", op, cluster, block,
                        smem);
  return SMELT_OK;
}

smelt_status smelt__cuda_alloc(smelt_ctx *ctx, size_t bytes, void **out) {
  smelt_status s = smelt__cuda_bind(ctx, "smelt_alloc");
  if (s) return s;
  CUdeviceptr p = 0;
  CUresult r = smelt__cu(NULL)->cuMemAllocFromPoolAsync(&p, bytes ? bytes : 1, ctx->cuda->pool, ctx->cuda->stream);
  if (r) {
    char what[96];
    snprintf(what, sizeof what, "allocating %zu bytes from the pool", bytes);
    return smelt__cu_error(r, "smelt_alloc", what);
  }
  *out = (void *)(uintptr_t)p;
  return SMELT_OK;
}

smelt_status smelt__cuda_free(smelt_ctx *ctx, void *p) {
  smelt_status s = smelt__cuda_bind(ctx, "smelt_free");
  if (s) return s;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemFreeAsync((CUdeviceptr)(uintptr_t)p, ctx->cuda->stream), "smelt_free");
  return SMELT_OK;
}

void smelt__kshape_from(smelt__kshape *k, const smelt_tensor *t) {
  memset(k, 0, sizeof *k);
  k->ndim = t->ndim;
  for (int i = 0; i < t->ndim; i++) {
    k->shape[i] = t->shape[i];
    k->strides[i] = t->strides[i];
  }
}

void smelt__kshape_rows(const smelt_tensor *t, int nrow_dims, smelt__kshape *k) {
  smelt_tensor a = *t;
  a.ndim = 0;
  for (int d = 0; d < nrow_dims; d++) {
    if (t->shape[d] == 1) continue;
    int last = a.ndim - 1;
    if (last >= 0 && a.strides[last] == t->shape[d] * t->strides[d]) {
      a.shape[last] *= t->shape[d];
      a.strides[last] = t->strides[d];
    } else {
      a.shape[a.ndim] = t->shape[d];
      a.strides[a.ndim++] = t->strides[d];
    }
  }
  smelt__kshape_from(k, &a);
}
