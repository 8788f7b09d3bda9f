/* The PEER expert store on CUDA: host tables in pinned memory mapped into
 * the device's address space (cuMemHostAlloc PORTABLE | DEVICEMAP) or in
 * managed memory, an HBM cache of `slots` experts (U and V slot arrays),
 * and the policy state on the device: table [N] (expert -> slot), owner,
 * reference bits and pin marks [S], heat [N], counters.
 *
 * A batch runs entirely on the context's stream (kernels/peer_util.cu,
 * peer_store_*): count uses, look up (hits pin their slot), compact the
 * misses in ascending id order, rank the slots in hand order, assign
 * victims, copy the admitted experts' rows from the mapped host tables into
 * their slots (SM loads over the interconnect, many rows in flight) and
 * count the rest as read through the mapping. The expert kernels then read
 * each expert from its slot or, if it has none, from host through the
 * mapping, so the forward never waits for the host. */
#include "peer_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_peer_store"

enum { ST_LOOKUPS, ST_HITS, ST_MISSES, ST_EVICTIONS, ST_USES_MAPPED, ST_BYTES_STAGED, ST_BYTES_MAPPED, ST_RESIDENT, ST_N };
enum { SC_HAND, SC_MISSES, SC_C1, SC_C2, SC_P, SC_LAST, SC_N };

struct smelt__peer_store_cuda {
  smelt__peer_util util;
  CUdeviceptr u_map, v_map;     /* device addresses of the host tables */
  CUdeviceptr u_cache, v_cache; /* [S] slots */
  CUdeviceptr table, owner, ref, pin, rank, heat, counts, bsum_n, bsum_s1, bsum_s2, stats, scal;
  int64_t nb_n, nb_s; /* scan blocks over N and over S */
  uint64_t batches, uses;
};

static smelt_status dev_alloc(smelt_peer_store *st, CUdeviceptr *p, size_t bytes, const char *what) {
  CUresult r = smelt__cu(NULL)->cuMemAlloc(p, bytes ? bytes : 1);
  if (r) {
    size_t fr = 0, tot = 0;
    smelt__cu(NULL)->cuMemGetInfo(&fr, &tot);
    *p = 0;
    return smelt__error(r == SMELT__CU_ERROR_OUT_OF_MEMORY ? SMELT_STATUS_OUT_OF_MEMORY : SMELT_STATUS_DRIVER_ERROR,
                        OP "_create: allocating the %s (%.1f MiB) on cuda:%d failed (%.1f MiB free of %.1f MiB); use a "
                           "smaller cache_mb",
                        what, (double)bytes / 1048576.0, st->ctx->device_index, (double)fr / 1048576.0,
                        (double)tot / 1048576.0);
  }
  return SMELT_OK;
}

/* The host tables: pinned and mapped, or managed. */
static smelt_status host_alloc(smelt_peer_store *st, size_t bytes, void **host, CUdeviceptr *dev, const char *what) {
  const smelt__cu_api *cu = smelt__cu(NULL);
  CUresult r;
  if (st->managed) {
    r = cu->cuMemAllocManaged(dev, bytes ? bytes : 1, SMELT__CU_MEM_ATTACH_GLOBAL);
    if (!r) *host = (void *)(uintptr_t)*dev;
  } else {
    r = cu->cuMemHostAlloc(host, bytes ? bytes : 1, SMELT__CU_MEMHOSTALLOC_PORTABLE | SMELT__CU_MEMHOSTALLOC_DEVICEMAP);
    if (!r) {
      r = cu->cuMemHostGetDevicePointer(dev, *host, 0);
      if (r) {
        cu->cuMemFreeHost(*host);
        *host = NULL;
      }
    }
  }
  if (r)
    return smelt__error(r == SMELT__CU_ERROR_OUT_OF_MEMORY ? SMELT_STATUS_OUT_OF_MEMORY : SMELT_STATUS_DRIVER_ERROR,
                        OP "_create: allocating the %s table (%.2f GiB of %s memory) failed: %s", what,
                        (double)bytes / 1073741824.0, st->managed ? "managed" : "pinned host",
                        r == SMELT__CU_ERROR_OUT_OF_MEMORY ? "out of memory" : "driver error");
  memset(*host, 0, bytes);
  return SMELT_OK;
}

void smelt__cuda_peer_store_destroy(smelt_peer_store *st) {
  struct smelt__peer_store_cuda *c = st->cuda;
  if (!c) return;
  const smelt__cu_api *cu = smelt__cu(NULL);
  smelt__cuda_bind(st->ctx, OP "_destroy");
  cu->cuStreamSynchronize(st->ctx->cuda->stream);
  const CUdeviceptr devs[] = {c->u_cache, c->v_cache, c->table,   c->owner,   c->ref,     c->pin,  c->rank,
                              c->heat,    c->counts,  c->bsum_n,  c->bsum_s1, c->bsum_s2, c->stats, c->scal};
  for (size_t i = 0; i < sizeof devs / sizeof *devs; i++)
    if (devs[i]) cu->cuMemFree(devs[i]);
  void *hosts[2] = {st->u_host, st->v_host};
  const CUdeviceptr maps[2] = {c->u_map, c->v_map};
  for (int i = 0; i < 2; i++) {
    if (!hosts[i]) continue;
    if (st->managed) cu->cuMemFree(maps[i]);
    else cu->cuMemFreeHost(hosts[i]);
  }
  free(c);
  st->cuda = NULL;
}

static smelt_status zero(smelt_peer_store *st, CUdeviceptr p, unsigned char v, size_t bytes) {
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemsetD8Async(p, v, bytes, st->ctx->cuda->stream), OP);
  return SMELT_OK;
}

smelt_status smelt__cuda_peer_store_create(smelt_peer_store *st) {
  struct smelt__peer_store_cuda *c = (struct smelt__peer_store_cuda *)calloc(1, sizeof *c);
  if (!c) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP "_create: out of host memory");
  st->cuda = c;
  smelt_status s = smelt__cuda_bind(st->ctx, OP "_create");
  const size_t es = smelt_dtype_size(st->dtype), N = (size_t)st->N, S = (size_t)st->slots;
  const size_t ub = (size_t)st->ulen * es, vb = (size_t)st->vlen * es;
  c->nb_n = (st->N + SMELT__PEER_TILE - 1) / SMELT__PEER_TILE;
  c->nb_s = (st->slots + SMELT__PEER_TILE - 1) / SMELT__PEER_TILE;
  if (!s) s = smelt__peer_util_load(st->ctx, &c->util);
  if (!s) s = host_alloc(st, N * ub, &st->u_host, &c->u_map, "U");
  if (!s) s = host_alloc(st, N * vb, &st->v_host, &c->v_map, "V");
  if (!s && S) s = dev_alloc(st, &c->u_cache, S * ub, "HBM cache of U");
  if (!s && S) s = dev_alloc(st, &c->v_cache, S * vb, "HBM cache of V");
  if (!s) s = dev_alloc(st, &c->table, N * 4, "expert -> slot table");
  if (!s) s = dev_alloc(st, &c->owner, S * 4, "slot owners");
  if (!s) s = dev_alloc(st, &c->ref, S, "reference bits");
  if (!s) s = dev_alloc(st, &c->pin, S * 4, "pin marks");
  if (!s) s = dev_alloc(st, &c->rank, S * 8, "slot ranks");
  if (!s) s = dev_alloc(st, &c->heat, N * 8, "heat counters");
  if (!s) s = dev_alloc(st, &c->counts, N * 4, "use counts");
  if (!s) s = dev_alloc(st, &c->bsum_n, (size_t)c->nb_n * 4, "scan sums");
  if (!s) s = dev_alloc(st, &c->bsum_s1, (size_t)c->nb_s * 4, "scan sums");
  if (!s) s = dev_alloc(st, &c->bsum_s2, (size_t)c->nb_s * 4, "scan sums");
  if (!s) s = dev_alloc(st, &c->stats, ST_N * 8, "statistics");
  if (!s) s = dev_alloc(st, &c->scal, SC_N * 8, "policy scalars");
  if (!s) s = zero(st, c->table, 0xFF, N * 4); /* -1: no slot */
  if (!s && S) s = zero(st, c->owner, 0xFF, S * 4);
  if (!s && S) s = zero(st, c->ref, 0, S);
  if (!s && S) s = zero(st, c->pin, 0, S * 4); /* batch numbers start at 1 */
  if (!s) s = zero(st, c->heat, 0, N * 8);
  if (!s) s = zero(st, c->stats, 0, ST_N * 8);
  if (!s) s = zero(st, c->scal, 0, SC_N * 8);
  if (!s) SMELT__CU_CHECK(smelt__cu(NULL)->cuStreamSynchronize(st->ctx->cuda->stream), OP "_create");
  if (s) smelt__cuda_peer_store_destroy(st);
  return s;
}

void smelt__cuda_peer_store_views(const smelt_peer_store *st, const int32_t **table, const void **u_cache,
                                  const void **v_cache, const void **u_host, const void **v_host) {
  const struct smelt__peer_store_cuda *c = st->cuda;
  *table = st->slots ? (const int32_t *)(uintptr_t)c->table : NULL;
  *u_cache = (const void *)(uintptr_t)c->u_cache;
  *v_cache = (const void *)(uintptr_t)c->v_cache;
  *u_host = (const void *)(uintptr_t)c->u_map;
  *v_host = (const void *)(uintptr_t)c->v_map;
}

static smelt_status sync(smelt_peer_store *st, const char *op) {
  smelt_status s = smelt__cuda_bind(st->ctx, op);
  if (s) return s;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuStreamSynchronize(st->ctx->cuda->stream), op);
  return SMELT_OK;
}

smelt_status smelt__cuda_peer_store_write(smelt_peer_store *st, int64_t first, int64_t count, const void *u_rows,
                                          const void *v_rows) {
  const char *op = OP "_write";
  smelt_status s = sync(st, op); /* no kernel may be reading the rows being replaced */
  if (s) return s;
  const struct smelt__peer_store_cuda *c = st->cuda;
  const smelt__cu_api *cu = smelt__cu(NULL);
  const size_t es = smelt_dtype_size(st->dtype), ub = (size_t)st->ulen * es, vb = (size_t)st->vlen * es;
  memcpy((char *)st->u_host + (size_t)first * ub, u_rows, (size_t)count * ub);
  memcpy((char *)st->v_host + (size_t)first * vb, v_rows, (size_t)count * vb);
  if (!st->slots) return SMELT_OK;
  /* cached copies of the written experts get the new rows too */
  int32_t *slots = (int32_t *)malloc((size_t)count * sizeof(int32_t));
  if (!slots) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  CUresult r = cu->cuMemcpyDtoH(slots, c->table + (CUdeviceptr)first * 4, (size_t)count * 4);
  for (int64_t i = 0; i < count && !r; i++) {
    if (slots[i] < 0) continue;
    r = cu->cuMemcpyHtoD(c->u_cache + (CUdeviceptr)slots[i] * ub, (const char *)u_rows + (size_t)i * ub, ub);
    if (!r) r = cu->cuMemcpyHtoD(c->v_cache + (CUdeviceptr)slots[i] * vb, (const char *)v_rows + (size_t)i * vb, vb);
  }
  free(slots);
  if (r) return smelt__cu_error(r, op, "refreshing cached experts");
  return SMELT_OK;
}

smelt_status smelt__cuda_peer_store_invalidate(smelt_peer_store *st) {
  const char *op = OP "_invalidate";
  struct smelt__peer_store_cuda *c = st->cuda;
  smelt_status s = smelt__cuda_bind(st->ctx, op);
  if (!s) s = zero(st, c->table, 0xFF, (size_t)st->N * 4);
  if (!s && st->slots) s = zero(st, c->owner, 0xFF, (size_t)st->slots * 4);
  if (!s && st->slots) s = zero(st, c->ref, 0, (size_t)st->slots);
  if (!s) s = zero(st, c->stats + ST_RESIDENT * 8, 0, 8);
  if (!s) s = sync(st, op);
  return s;
}

static smelt_status batch(smelt_peer_store *st, const int64_t *ids_dev, int64_t n) {
  struct smelt__peer_store_cuda *c = st->cuda;
  smelt_ctx *ctx = st->ctx;
  const smelt__peer_util *u = &c->util;
  uint32_t batch = ++st->batch;
  c->batches++;
  c->uses += (uint64_t)n;
  if (n == 0) return SMELT_OK;
  smelt_status s = smelt__cuda_bind(ctx, OP);
  if (s) return s;
  /* misses are at most the distinct ids: min(n, N) */
  const int64_t mmax = n < st->N ? n : st->N;
  void *arrays;
  if ((s = smelt__cuda_alloc(ctx, (size_t)mmax * 12, &arrays))) return s;
  void *miss_e = arrays, *miss_uses = (char *)arrays + mmax * 4, *admit = (char *)arrays + mmax * 8;
  void *ids = (void *)ids_dev, *counts = (void *)(uintptr_t)c->counts, *table = (void *)(uintptr_t)c->table;
  void *ref = (void *)(uintptr_t)c->ref, *pin = (void *)(uintptr_t)c->pin, *heat = (void *)(uintptr_t)c->heat;
  void *stats = (void *)(uintptr_t)c->stats, *scal = (void *)(uintptr_t)c->scal;
  void *bsn = (void *)(uintptr_t)c->bsum_n, *bs1 = (void *)(uintptr_t)c->bsum_s1, *bs2 = (void *)(uintptr_t)c->bsum_s2;
  void *rank = (void *)(uintptr_t)c->rank, *owner = (void *)(uintptr_t)c->owner;
  int64_t N = st->N, S = st->slots;
  uint64_t slot_bytes = st->slot_bytes;
  smelt__nvtx_push("smelt_peer_store_batch");
  s = zero(st, c->counts, 0, (size_t)N * 4);
  void *p_count[] = {&ids, &n, &N, &counts};
  if (!s) s = smelt__cuda_launch(ctx, OP, u->store_count, (unsigned)((n + 255) / 256), 1, 1, 256, 0, p_count);
  void *p_lookup[] = {&counts, &N, &table, &ref, &pin, &batch, &heat, &stats, &bsn};
  if (!s) s = smelt__cuda_launch(ctx, OP, u->store_lookup, (unsigned)c->nb_n, 1, 1, 256, 0, p_lookup);
  if (!s) s = smelt__peer_scan(ctx, u, bsn, c->nb_n, (char *)scal + SC_MISSES * 8);
  void *p_miss[] = {&counts, &N, &table, &bsn, &miss_e, &miss_uses};
  if (!s) s = smelt__cuda_launch(ctx, OP, u->store_misses, (unsigned)c->nb_n, 1, 1, 256, 0, p_miss);
  if (!s && S) {
    void *p_sc[] = {&ref, &pin, &batch, &S, &scal, &bs1, &bs2};
    s = smelt__cuda_launch(ctx, OP, u->store_slot_count, (unsigned)c->nb_s, 1, 1, 256, 0, p_sc);
    if (!s) s = smelt__peer_scan(ctx, u, bs1, c->nb_s, (char *)scal + SC_C1 * 8);
    if (!s) s = smelt__peer_scan(ctx, u, bs2, c->nb_s, (char *)scal + SC_C2 * 8);
    void *p_rank[] = {&ref, &pin, &batch, &S, &scal, &bs1, &bs2, &rank};
    if (!s) s = smelt__cuda_launch(ctx, OP, u->store_slot_rank, (unsigned)c->nb_s, 1, 1, 256, 0, p_rank);
    void *p_assign[] = {&rank, &S, &scal, &owner, &table, &ref, &pin, &batch, &miss_e, &admit, &stats, &slot_bytes};
    if (!s) s = smelt__cuda_launch(ctx, OP, u->store_assign, (unsigned)((S + 255) / 256), 1, 1, 256, 0, p_assign);
  }
  if (!s) {
    void *uh = (void *)(uintptr_t)c->u_map, *vh = (void *)(uintptr_t)c->v_map;
    void *uc = (void *)(uintptr_t)c->u_cache, *vc = (void *)(uintptr_t)c->v_cache;
    const size_t es = smelt_dtype_size(st->dtype);
    int64_t ub = st->ulen * (int64_t)es, vb = st->vlen * (int64_t)es;
    int wide = ub % 16 == 0 && vb % 16 == 0;
    void *p_fin[] = {&scal, &S, &miss_e, &miss_uses, &admit, &uh, &vh, &uc, &vc, &ub, &vb, &wide, &stats, &slot_bytes};
    /* enough blocks to keep many rows in flight over the interconnect */
    const int64_t grid = mmax < 4 * (int64_t)ctx->cuda->info.sm_count ? mmax : 4 * (int64_t)ctx->cuda->info.sm_count;
    s = smelt__cuda_launch(ctx, OP, u->store_finish, (unsigned)grid, 1, 1, 256, 0, p_fin);
  }
  smelt__nvtx_pop();
  smelt_status s2 = smelt__cuda_free(ctx, arrays);
  return s ? s : s2;
}

smelt_status smelt__cuda_peer_store_batch(smelt_peer_store *st, const int64_t *ids_dev, int64_t n) {
  smelt_status s = smelt__peer_store_enter(st, OP);
  if (s) return s;
  s = batch(st, ids_dev, n);
  smelt__peer_store_leave(st);
  return s;
}

smelt_status smelt__cuda_peer_store_stats(smelt_peer_store *st, smelt_peer_store_stats *out) {
  const char *op = OP "_stats_get";
  smelt_status s = sync(st, op);
  if (s) return s;
  uint64_t v[ST_N];
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemcpyDtoH(v, st->cuda->stats, sizeof v), op);
  memset(out, 0, sizeof *out);
  out->batches = st->cuda->batches;
  out->uses = st->cuda->uses;
  out->lookups = v[ST_LOOKUPS];
  out->hits = v[ST_HITS];
  out->misses = v[ST_MISSES];
  out->evictions = v[ST_EVICTIONS];
  out->uses_mapped = v[ST_USES_MAPPED];
  out->bytes_staged = v[ST_BYTES_STAGED];
  out->bytes_mapped = v[ST_BYTES_MAPPED];
  out->resident = (int64_t)v[ST_RESIDENT];
  return SMELT_OK;
}

smelt_status smelt__cuda_peer_store_stats_reset(smelt_peer_store *st) {
  const char *op = OP "_stats_reset";
  smelt_status s = smelt__cuda_bind(st->ctx, op);
  if (!s) s = zero(st, st->cuda->stats, 0, ST_RESIDENT * 8); /* every counter but the residency */
  if (!s) s = sync(st, op);
  st->cuda->batches = st->cuda->uses = 0;
  return s;
}

smelt_status smelt__cuda_peer_store_heat(smelt_peer_store *st, int64_t first, int64_t count, uint64_t *out) {
  const char *op = OP "_heat";
  smelt_status s = sync(st, op);
  if (s) return s;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemcpyDtoH(out, st->cuda->heat + (CUdeviceptr)first * 8, (size_t)count * 8), op);
  return SMELT_OK;
}
