/* The PEER expert store: options, validation, the public calls, and the
 * CPU backend's implementation, which is also the reference CLOCK
 * simulator the CUDA store's statistics are checked against.
 *
 * The policy (smelt/peer.h) is defined sequentially here: per batch, hits
 * first (reference bit set, slot pinned), then the misses in ascending id
 * order each run the CLOCK hand. The CUDA store computes the same result in
 * parallel (src/cuda/peer_store_cuda.c); the two share no code, so the
 * tests comparing their statistics compare two implementations. On the CPU
 * backend the "cache" is bookkeeping only: every read goes to the host
 * tables, which is what a cached copy holds anyway.
 *
 * Threads: a store follows its context's rule (include/smelt.h: one thread
 * at a time), and checks it rather than locking. A lock would make the
 * store's bookkeeping safe while the context the store launches on and the
 * plan whose forward drives it stay unsafe, so it would promise nothing a
 * caller could use; the check turns the overlap that would silently corrupt
 * the cache (two batches, or a batch and a read of the counters) into an
 * error. */
#include "checked.h"
#include "peer_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_peer_store"

smelt_peer_store_options smelt_peer_store_options_default(void) {
  smelt_peer_store_options o;
  memset(&o, 0, sizeof o);
  o.dtype = SMELT_DTYPE_BF16;
  o.cache_mb = 1024;
  o.use_env = 1;
  return o;
}

/* SMELT_PEER_HBM_CACHE_MB: a number of MiB >= 0. */
static smelt_status env_cache_mb(double *mb) {
  const char *v = smelt__getenv("SMELT_PEER_HBM_CACHE_MB");
  if (!v) return SMELT_OK;
  char *end;
  errno = 0;
  double d = strtod(v, &end);
  if (errno || *end || !isfinite(d) || d < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP "_create: SMELT_PEER_HBM_CACHE_MB=\"%s\" is not a size in MiB (a number >= 0)", v);
  *mb = d;
  return SMELT_OK;
}

/* SMELT_PEER_USE_MANAGED_MEMORY: 0/1, true/false, yes/no, on/off. */
static smelt_status env_managed(int *on) {
  const char *v = smelt__getenv("SMELT_PEER_USE_MANAGED_MEMORY");
  if (!v) return SMELT_OK;
  static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no", "off"};
  for (int i = 0; i < 4; i++) {
    if (!strcmp(v, yes[i])) {
      *on = 1;
      return SMELT_OK;
    }
    if (!strcmp(v, no[i])) {
      *on = 0;
      return SMELT_OK;
    }
  }
  return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                      OP "_create: SMELT_PEER_USE_MANAGED_MEMORY=\"%s\" is not 0/1, true/false, yes/no or on/off", v);
}

smelt_status smelt__peer_store_enter(smelt_peer_store *st, const char *op) {
  if (__atomic_exchange_n(&st->busy, 1, __ATOMIC_ACQUIRE))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: the store is used from two threads at once (a context and what is made on it are used "
                        "by one thread at a time)",
                        op);
  return SMELT_OK;
}

void smelt__peer_store_leave(smelt_peer_store *st) { __atomic_store_n(&st->busy, 0, __ATOMIC_RELEASE); }

static void free_host_state(smelt_peer_store *st) {
  free(st->u_host);
  free(st->v_host);
  free(st->table);
  free(st->owner);
  free(st->ref);
  free(st->pin);
  free(st->heat);
}

static smelt_status create_cpu(smelt_peer_store *st) {
  const size_t es = smelt_dtype_size(st->dtype);
  const size_t ub = (size_t)(st->N * st->ulen) * es, vb = (size_t)(st->N * st->vlen) * es;
  st->u_host = calloc(ub ? ub : 1, 1);
  st->v_host = calloc(vb ? vb : 1, 1);
  st->table = (int32_t *)malloc((size_t)st->N * sizeof(int32_t));
  st->heat = (uint64_t *)calloc((size_t)st->N, sizeof(uint64_t));
  const size_t s = (size_t)(st->slots ? st->slots : 1);
  st->owner = (int32_t *)malloc(s * sizeof(int32_t));
  st->ref = (uint8_t *)calloc(s, 1);
  st->pin = (uint32_t *)calloc(s, sizeof(uint32_t));
  if (!st->u_host || !st->v_host || !st->table || !st->heat || !st->owner || !st->ref || !st->pin) {
    free_host_state(st);
    return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP "_create: no host memory for the tables (%.2f GiB)",
                        (double)(ub + vb) / 1073741824.0);
  }
  for (int64_t e = 0; e < st->N; e++) st->table[e] = -1;
  for (int64_t i = 0; i < st->slots; i++) st->owner[i] = -1;
  return SMELT_OK;
}

smelt_status smelt_peer_store_create(smelt_ctx *ctx, const smelt_peer_store_options *opts, smelt_peer_store **out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_create: out is NULL");
  *out = NULL;
  if (!ctx || !opts) return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_create: %s is NULL", !ctx ? "ctx" : "opts");
  smelt_peer_store_options o = *opts;
  const int64_t lim = (int64_t)1 << 31;
  const struct { const char *n; int64_t v; } dims[] = {{"num_experts", o.num_experts},
                                                       {"input_dim", o.input_dim},
                                                       {"output_dim", o.output_dim},
                                                       {"expert_hidden_size", o.expert_hidden_size}};
  for (int i = 0; i < 4; i++)
    if (dims[i].v < 1 || dims[i].v >= lim)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP "_create: opts.%s=%lld must be in [1, 2^31)", dims[i].n,
                          (long long)dims[i].v);
  const int cpu = ctx->device == SMELT_DEVICE_CPU;
  if (o.dtype != SMELT_DTYPE_F32 && o.dtype != SMELT_DTYPE_F16 && o.dtype != SMELT_DTYPE_BF16 &&
      !(cpu && o.dtype == SMELT_DTYPE_F64))
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP "_create: opts.dtype=%s is not supported (supported: f32, f16, bf16%s)",
                        smelt_dtype_name(o.dtype), cpu ? ", f64" : "");
  smelt_status s;
  if (o.use_env && ((s = env_cache_mb(&o.cache_mb)) || (s = env_managed(&o.use_managed_memory)))) return s;
  if (!isfinite(o.cache_mb) || o.cache_mb < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP "_create: opts.cache_mb=%g must be a size in MiB >= 0",
                        o.cache_mb);
  smelt_peer_store *st = (smelt_peer_store *)calloc(1, sizeof *st);
  if (!st) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP "_create: out of host memory");
  st->ctx = ctx;
  st->N = o.num_experts;
  st->din = o.input_dim;
  st->dout = o.output_dim;
  st->he = o.expert_hidden_size;
  st->dtype = o.dtype;
  int64_t slot_elems = 0, slot_bytes = 0, table_bytes = 0;
  if ((s = smelt__mul_i64(st->din, st->he, &st->ulen, OP "_create", "input_dim x expert_hidden_size")) ||
      (s = smelt__mul_i64(st->he, st->dout, &st->vlen, OP "_create", "expert_hidden_size x output_dim")) ||
      (s = smelt__add_i64(st->ulen, st->vlen, &slot_elems, OP "_create", "an expert's elements")) ||
      (s = smelt__mul_i64(slot_elems, (int64_t)smelt_dtype_size(o.dtype), &slot_bytes, OP "_create",
                          "an expert's bytes")) ||
      (s = smelt__mul_i64(st->N, slot_bytes, &table_bytes, OP "_create", "the tables' bytes")) ||
      (s = smelt__host_fits((size_t)table_bytes, OP "_create", "the host tables"))) {
    free(st);
    return s;
  }
  st->slot_bytes = (uint64_t)slot_bytes;
  st->cache_mb = o.cache_mb;
  st->managed = o.use_managed_memory != 0;
  const double cache_bytes = o.cache_mb * 1048576.0;
  const double want = floor(cache_bytes / (double)st->slot_bytes);
  if (o.cache_mb > 0 && want < 1) {
    const unsigned long long slot = (unsigned long long)st->slot_bytes;
    free(st);
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP "_create: a cache of %g MiB cannot hold one expert of %llu bytes; use 0 for no cache or at "
                           "least %.4f MiB",
                        o.cache_mb, slot, (double)slot / 1048576.0);
  }
  /* More slots than experts would stay empty. */
  st->slots = want > (double)st->N ? st->N : (int64_t)want;
  s = cpu ? create_cpu(st) : smelt__cuda_peer_store_create(st);
  if (s) {
    free(st);
    return s;
  }
  *out = st;
  return SMELT_OK;
}

void smelt_peer_store_destroy(smelt_peer_store *st) {
  if (!st) return;
  if (st->cuda) smelt__cuda_peer_store_destroy(st);
  else free_host_state(st);
  free(st);
}

smelt_status smelt_peer_store_tables(smelt_peer_store *st, smelt_tensor *u, smelt_tensor *v) {
  if (!st || !u || !v) return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_tables: NULL argument");
  int64_t us[3] = {st->N, st->din, st->he}, vs[3] = {st->N, st->he, st->dout};
  *u = smelt_tensor_make(st->u_host, st->dtype, SMELT_DEVICE_CPU, 0, 3, us);
  *v = smelt_tensor_make(st->v_host, st->dtype, SMELT_DEVICE_CPU, 0, 3, vs);
  return SMELT_OK;
}

/* A store and experts [first, first + count) within it, for op. */
static smelt_status check_experts(const char *op, const smelt_peer_store *st, int64_t first, int64_t count) {
  if (!st) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: store is NULL", op);
  if (first < 0 || count < 0 || first > st->N - count)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: experts [%lld, %lld + %lld) are not within [0, num_experts=%lld)",
                        op, (long long)first, (long long)first, (long long)count, (long long)st->N);
  return SMELT_OK;
}

smelt_status smelt_peer_store_write(smelt_peer_store *st, int64_t first, int64_t count, const void *u_rows,
                                    const void *v_rows) {
  smelt_status s = check_experts(OP "_write", st, first, count);
  if (s || count == 0) return s;
  if (!u_rows || !v_rows)
    return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_write: %s is NULL", !u_rows ? "u_rows" : "v_rows");
  if ((s = smelt__peer_store_enter(st, OP "_write"))) return s;
  if (st->cuda) {
    s = smelt__cuda_peer_store_write(st, first, count, u_rows, v_rows);
  } else {
    const size_t es = smelt_dtype_size(st->dtype);
    memcpy((char *)st->u_host + (size_t)(first * st->ulen) * es, u_rows, (size_t)(count * st->ulen) * es);
    memcpy((char *)st->v_host + (size_t)(first * st->vlen) * es, v_rows, (size_t)(count * st->vlen) * es);
  }
  smelt__peer_store_leave(st);
  return s;
}

static void invalidate_cpu(smelt_peer_store *st) {
  for (int64_t s = 0; s < st->slots; s++) {
    if (st->owner[s] >= 0) st->table[st->owner[s]] = -1;
    st->owner[s] = -1;
    st->ref[s] = 0;
  }
  st->stats.resident = 0;
}

/* A call that takes nothing but the store: its CUDA or its CPU half, run
 * inside the store. */
static smelt_status in_store(smelt_peer_store *st, const char *op, smelt_status (*cuda)(smelt_peer_store *),
                             void (*cpu)(smelt_peer_store *)) {
  if (!st) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: store is NULL", op);
  smelt_status s = smelt__peer_store_enter(st, op);
  if (s) return s;
  if (st->cuda) s = cuda(st);
  else cpu(st);
  smelt__peer_store_leave(st);
  return s;
}

smelt_status smelt_peer_store_invalidate(smelt_peer_store *st) {
  return in_store(st, OP "_invalidate", smelt__cuda_peer_store_invalidate, invalidate_cpu);
}

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static void batch_cpu(smelt_peer_store *st, const int64_t *ids, int64_t n) {
  smelt_peer_store_stats *c = &st->stats;
  const uint32_t batch = ++st->batch;
  c->batches++;
  c->uses += (uint64_t)n;
  if (n == 0) return; /* an empty ids view may have no data at all */
  /* sorted ids, then the misses (expert, uses) packed into their front */
  int64_t *sorted = (int64_t *)malloc((size_t)(n ? n : 1) * sizeof(int64_t));
  int64_t *miss_uses = (int64_t *)malloc((size_t)(n ? n : 1) * sizeof(int64_t));
  if (!sorted || !miss_uses) { /* this batch's statistics are lost; results never depend on them */
    free(sorted);
    free(miss_uses);
    return;
  }
  memcpy(sorted, ids, (size_t)n * sizeof(int64_t));
  qsort(sorted, (size_t)n, sizeof(int64_t), cmp_i64);
  /* 1: each distinct expert is one lookup; hits (resident at the batch's
   * start) set their bit and are pinned. */
  int64_t nmiss = 0;
  for (int64_t i = 0; i < n;) {
    const int64_t e = sorted[i];
    int64_t j = i;
    while (j < n && sorted[j] == e) j++;
    st->heat[e] += (uint64_t)(j - i);
    c->lookups++;
    const int32_t s = st->table[e];
    if (s >= 0) {
      c->hits++;
      st->ref[s] = 1;
      st->pin[s] = batch;
    } else {
      c->misses++;
      sorted[nmiss] = e;
      miss_uses[nmiss++] = j - i;
    }
    i = j;
  }
  /* 2: the misses, ascending, each run the hand: pinned slots are skipped,
   * set bits cleared, the first unpinned slot with a clear bit taken. Two
   * revolutions find one unless every slot is pinned. */
  for (int64_t m = 0; m < nmiss; m++) {
    const int64_t e = sorted[m];
    int64_t victim = -1;
    for (int64_t step = 0; step < 2 * st->slots && victim < 0; step++) {
      const int64_t s = st->hand;
      st->hand = s + 1 == st->slots ? 0 : s + 1;
      if (st->pin[s] == batch) continue;
      if (st->ref[s]) {
        st->ref[s] = 0;
        continue;
      }
      victim = s;
    }
    if (victim < 0) { /* no cache, or every slot pinned: read through the mapping */
      c->uses_mapped += (uint64_t)miss_uses[m];
      c->bytes_mapped += (uint64_t)miss_uses[m] * st->slot_bytes;
      continue;
    }
    if (st->owner[victim] >= 0) {
      c->evictions++;
      st->table[st->owner[victim]] = -1;
    } else {
      c->resident++;
    }
    st->owner[victim] = (int32_t)e;
    st->table[e] = (int32_t)victim;
    st->ref[victim] = 1;
    st->pin[victim] = batch;
    c->bytes_staged += st->slot_bytes;
  }
  free(sorted);
  free(miss_uses);
}

smelt_status smelt__peer_store_batch_cpu(smelt_peer_store *st, const int64_t *ids, int64_t n, const char *op) {
  smelt_status s = smelt__peer_store_enter(st, op);
  if (s) return s;
  batch_cpu(st, ids, n);
  smelt__peer_store_leave(st);
  return SMELT_OK;
}

smelt_status smelt_peer_store_prefetch(smelt_peer_store *st, const smelt_tensor *ids) {
  if (!st) return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_prefetch: store is NULL");
  static const smelt_dtype i64 = SMELT_DTYPE_I64;
  smelt_status s;
  if ((s = smelt__check_tensor(OP "_prefetch", "ids", ids)) ||
      (s = smelt__check_device(OP "_prefetch", "ids", ids, st->ctx)) ||
      (s = smelt__check_dtype(OP "_prefetch", "ids", ids, &i64, 1)))
    return s;
  if (!smelt_tensor_is_contiguous(ids))
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, OP "_prefetch: ids must be contiguous");
  const int64_t n = smelt_tensor_numel(ids);
  if (st->cuda) return smelt__cuda_peer_store_batch(st, (const int64_t *)ids->data, n);
  const int64_t *p = (const int64_t *)ids->data;
  for (int64_t i = 0; i < n; i++)
    if (p[i] < 0 || p[i] >= st->N)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP "_prefetch: ids[%lld]=%lld is outside [0, num_experts=%lld)",
                          (long long)i, (long long)p[i], (long long)st->N);
  return smelt__peer_store_batch_cpu(st, p, n, OP "_prefetch");
}

/* The counters of a store the caller has entered. */
static smelt_status stats_of(smelt_peer_store *st, smelt_peer_store_stats *out) {
  if (st->cuda) {
    smelt_status s = smelt__cuda_peer_store_stats(st, out);
    if (s) return s;
  } else {
    *out = st->stats;
  }
  out->slots = st->slots;
  out->bytes_from_host = out->bytes_staged + out->bytes_mapped;
  out->hit_rate = out->lookups ? (double)out->hits / (double)out->lookups : 0.0;
  return SMELT_OK;
}

smelt_status smelt_peer_store_stats_get(smelt_peer_store *st, smelt_peer_store_stats *out) {
  if (!st || !out) return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_stats_get: NULL argument");
  smelt_status s = smelt__peer_store_enter(st, OP "_stats_get");
  if (s) return s;
  s = stats_of(st, out);
  smelt__peer_store_leave(st);
  return s;
}

static void stats_reset_cpu(smelt_peer_store *st) {
  const int64_t resident = st->stats.resident;
  memset(&st->stats, 0, sizeof st->stats);
  st->stats.resident = resident;
}

smelt_status smelt_peer_store_stats_reset(smelt_peer_store *st) {
  return in_store(st, OP "_stats_reset", smelt__cuda_peer_store_stats_reset, stats_reset_cpu);
}

/* "1.50 GiB", "12.0 MiB", "512 B" */
static const char *bytes_text(double b, char *buf, size_t n) {
  if (b >= 1073741824.0) snprintf(buf, n, "%.2f GiB", b / 1073741824.0);
  else if (b >= 1048576.0) snprintf(buf, n, "%.1f MiB", b / 1048576.0);
  else if (b >= 1024.0) snprintf(buf, n, "%.1f KiB", b / 1024.0);
  else snprintf(buf, n, "%.0f B", b);
  return buf;
}

smelt_status smelt_peer_store_report(smelt_peer_store *st, char *buf, size_t n) {
  if (!st || !buf) return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_report: NULL argument");
  if (n == 0) return SMELT_OK;
  smelt_peer_store_stats c;
  smelt_status s = smelt__peer_store_enter(st, OP "_report");
  if (s) return s;
  s = stats_of(st, &c);
  smelt__peer_store_leave(st);
  if (s) return s;
  char a[32], b[32], d[32], e[32];
  const char *mem = !st->cuda ? "host memory (CPU backend)" : st->managed ? "managed memory" : "pinned host memory mapped into the device";
  snprintf(buf, n,
           "peer store: %lld experts x %llu B (%s, d_in %lld, h_e %lld, d_out %lld) = %s in %s\n"
           "cache: %g MiB = %lld slots, %lld resident\n"
           "batches %llu, lookups %llu, hits %llu (%.2f%%), misses %llu, evictions %llu\n"
           "uses %llu (%llu through the mapping); from host %s (staged %s, mapped %s)\n",
           (long long)st->N, (unsigned long long)st->slot_bytes, smelt_dtype_name(st->dtype), (long long)st->din,
           (long long)st->he, (long long)st->dout, bytes_text((double)st->N * (double)st->slot_bytes, a, sizeof a),
           mem, st->cache_mb, (long long)c.slots, (long long)c.resident, (unsigned long long)c.batches,
           (unsigned long long)c.lookups, (unsigned long long)c.hits, 100.0 * c.hit_rate,
           (unsigned long long)c.misses, (unsigned long long)c.evictions, (unsigned long long)c.uses,
           (unsigned long long)c.uses_mapped, bytes_text((double)c.bytes_from_host, b, sizeof b),
           bytes_text((double)c.bytes_staged, d, sizeof d), bytes_text((double)c.bytes_mapped, e, sizeof e));
  return SMELT_OK;
}

smelt_status smelt_peer_store_heat(smelt_peer_store *st, int64_t first, int64_t count, uint64_t *out) {
  smelt_status s = check_experts(OP "_heat", st, first, count);
  if (s || count == 0) return s;
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, OP "_heat: out is NULL");
  if ((s = smelt__peer_store_enter(st, OP "_heat"))) return s;
  if (st->cuda) s = smelt__cuda_peer_store_heat(st, first, count, out);
  else memcpy(out, st->heat + first, (size_t)count * sizeof(uint64_t));
  smelt__peer_store_leave(st);
  return s;
}
