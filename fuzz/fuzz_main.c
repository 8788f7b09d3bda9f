/* libFuzzer entry point and the checks every call goes through; the
 * contract they enforce is smelt.h's: a failed call writes nothing and
 * says why, a successful one writes only its outputs, inputs stay as they
 * were, and nothing reads or writes outside what the caller described
 * (ASan sees the arena's edges; the byte comparison sees inside it).
 *
 * An input is a short program: each step's first byte picks an entry point,
 * which reads its shapes, layouts, dtypes and desc fields from the bytes
 * that follow. Everything runs on a CPU context. At exit the target prints
 * how many calls it made, per entry point.
 *
 * Run it with `make fuzz` (FUZZ_SECONDS=180 by default, from a copy of
 * fuzz/corpus), or by hand after configuring with
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DSMELT_FUZZ=ON
 *   build-fuzz/smelt_fuzz CORPUS_DIR -max_len=512 -timeout=10
 * A finding is a file crash-*, timeout-* or oom-*: run the target on it to
 * reproduce, with SMELT_FUZZ_VERBOSE=1 to see every call, its views and the
 * library's messages. */
#include "fuzz.h"
#include "core/checked.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

uint8_t *fz_arena;
static uint8_t *pristine, *snapshot;
static uint32_t *stamp, stamp_now;
static int verbose; /* SMELT_FUZZ_VERBOSE=1 prints every error message (to see what the generators miss) */

/* ---------------------------------------------------------------- input */

uint8_t fz_u8(fz *f) {
  if (!f->n) return 0;
  f->n--;
  return *f->p++;
}

uint32_t fz_u32(fz *f) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v = v << 8 | fz_u8(f);
  return v;
}

uint64_t fz_u64(fz *f) { return (uint64_t)fz_u32(f) << 32 | fz_u32(f); }

/* A used-up input (zeros) answers no: it means the plain, valid path. */
int fz_one_in(fz *f, int n) { return fz_u8(f) % n == n - 1; }

static const int64_t hostile[16] = {
    INT64_MAX, INT64_MAX - 1, INT64_MIN, -1, -2, (int64_t)1 << 62, ((int64_t)1 << 62) + 1, (int64_t)1 << 60,
    (int64_t)1 << 32, ((int64_t)1 << 31) - 1, (int64_t)1 << 31, ((int64_t)1 << 31) + 1, (int64_t)1 << 30,
    65536, 65535, ((int64_t)1 << 33) + 3};

int64_t fz_size(fz *f, int64_t max) {
  uint8_t b = fz_u8(f);
  if (b >= 240) return hostile[b - 240];
  return b % (max + 1);
}

int64_t fz_small(fz *f, int64_t max) { return fz_u8(f) % (max + 1); }

double fz_double(fz *f) {
  static const double odd[8] = {0.0, -0.0, 1.0, -1.0, 1e300, -1e-300, 0.0 / 0.0, 1.0 / 0.0};
  uint8_t b = fz_u8(f);
  if (b < 192) return (double)(int8_t)fz_u8(f) / 16.0;
  if (b < 248) return odd[b % 8];
  return -1.0 / 0.0;
}

int fz_enum(fz *f, int count) {
  uint8_t b = fz_u8(f);
  if (b < 232) return b % count;
  static const int odd[3] = {-1, 1000, 0x7fffffff};
  return odd[b % 3];
}

/* ---------------------------------------------------------------- views */

/* The library's rules for a tensor it may touch: fields in range, element
 * count and byte span without overflow (smelt__check_tensor). */
static int must_reject(const smelt_tensor *t, int64_t *numel, int64_t *span) {
  if (t->ndim < 0 || t->ndim > SMELT_MAX_DIMS || (unsigned)t->dtype >= SMELT_DTYPE_COUNT) return 1;
  if (t->device != SMELT_DEVICE_CPU) return 1; /* the CPU ignores device_index (smelt__check_device) */
  int64_t n = 1, extent = 0, term;
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] < 0) return 1;
  for (int i = 0; i < t->ndim; i++)
    if (__builtin_mul_overflow(n, t->shape[i], &n)) return 1;
  *numel = n;
  *span = 0;
  if (n == 0) return 0; /* an empty view's strides are not checked */
  for (int i = 0; i < t->ndim; i++)
    if (t->strides[i] < 0) return 1;
  for (int i = 0; i < t->ndim; i++)
    if (__builtin_mul_overflow(t->shape[i] - 1, t->strides[i], &term) || __builtin_add_overflow(extent, term, &extent))
      return 1;
  if (__builtin_add_overflow(extent, 1, &extent) ||
      __builtin_mul_overflow(extent, (int64_t)smelt_dtype_size(t->dtype), span))
    return 1;
  if (!t->data || (uintptr_t)t->data % smelt_dtype_size(t->dtype)) return 1;
  return 0;
}

int fz_view_ok(const smelt_tensor *t) {
  int64_t numel, span;
  if (must_reject(t, &numel, &span)) return 0;
  if (numel == 0) return 1;
  const uint8_t *p = (const uint8_t *)t->data;
  return numel <= FZ_MAX_NUMEL && p >= fz_arena && span <= (int64_t)FZ_ARENA_BYTES &&
         p + span <= fz_arena + FZ_ARENA_BYTES;
}

/* The caller's usual way to a row-major view. */
static smelt_tensor row_major(smelt_dtype dt, int ndim, const int64_t *shape) {
  return smelt_tensor_make(NULL, dt, SMELT_DEVICE_CPU, 0, ndim, shape);
}

/* Row-major with the last two dims swapped in memory (a column-major matrix). */
static void transpose_last(smelt_tensor *t) {
  if (t->ndim < 2) return;
  int a = t->ndim - 2, b = t->ndim - 1;
  int64_t r = t->shape[a] > 0 ? t->shape[a] : 1;
  t->strides[b] = r;
  t->strides[a] = 1;
}

/* Every dim but the last steps over `pad` extra elements per row. */
static void pad_rows(smelt_tensor *t, int64_t pad) {
  int64_t stride = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    t->strides[i] = stride;
    int64_t s = t->shape[i] > 0 ? t->shape[i] : 1;
    if (__builtin_mul_overflow(stride, s, &stride)) stride = INT64_MAX;
    if (i == t->ndim - 1 && __builtin_add_overflow(stride, pad, &stride)) stride = INT64_MAX;
  }
}

static void damage(fz *f, smelt_tensor *t) {
  int d = t->ndim > 0 ? (int)(fz_u8(f) % t->ndim) : 0;
  static const int64_t strides[8] = {0, 1, 2, 3, (int64_t)1 << 31, (int64_t)1 << 62, INT64_MAX, -1};
  switch (fz_u8(f) % 9) {
  case 0: t->dtype = (smelt_dtype)fz_enum(f, SMELT_DTYPE_COUNT); break;
  case 1:
    t->ndim = (int)(fz_u8(f) % 11) - 1;
    for (int i = 0; i < t->ndim && i < SMELT_MAX_DIMS; i++)
      if (!t->shape[i]) t->shape[i] = fz_size(f, 4), t->strides[i] = 1;
    break;
  case 2: if (t->ndim > 0) t->shape[d] = fz_size(f, 9); break;
  case 3: if (t->ndim > 0) t->strides[d] = strides[fz_u8(f) % 8]; break;
  case 4: t->data = NULL; break;
  case 5: t->data = (uint8_t *)t->data + 1; break;
  case 6: t->device = (smelt_device_kind)fz_enum(f, 3); break;
  case 7: t->device_index = 1; break;
  case 8: if (t->ndim > 0) t->shape[d] = fz_size(f, 9), t->strides[d] = 0; break;
  }
}

static uint8_t *last_place;
static size_t next_free;

/* Places t in the arena: at the previous view's address (in place) now
 * and then, else at an offset from the input where its span fits, counted
 * from the end of the previous view (so a used-up input lays views out one
 * after another, disjoint). */
static void place(fz *f, smelt_tensor *t, int64_t span) {
  size_t es = smelt_dtype_size(t->dtype) ? smelt_dtype_size(t->dtype) : 1;
  if (span > (int64_t)FZ_ARENA_BYTES - 64) span = 0; /* must be rejected: any address will do */
  uint8_t b = fz_u8(f);
  if (b == 255 && last_place && last_place + span <= fz_arena + FZ_ARENA_BYTES) {
    t->data = last_place;
    return;
  }
  size_t room = FZ_ARENA_BYTES - 64 - (size_t)span;
  size_t off = (next_free + fz_u32(f)) % (room + 1);
  off -= off % 16;
  if (b == 254) off += es; /* aligned to the dtype only */
  t->data = fz_arena + off;
  last_place = (uint8_t *)t->data;
  next_free = off + (size_t)span + 16;
}

static const void *outs[FZ_MAX_OUTS];
static smelt_tensor out_views[FZ_MAX_OUTS];
static size_t out_bytes[FZ_MAX_OUTS];
static int n_outs;

void fz_output(const smelt_tensor *t) {
  if (n_outs < FZ_MAX_OUTS && fz_view_ok(t)) {
    out_views[n_outs] = *t;
    outs[n_outs] = NULL;
    out_bytes[n_outs++] = 0;
  }
}

void fz_output_bytes(const void *p, size_t n) {
  if (n_outs < FZ_MAX_OUTS) {
    outs[n_outs] = p;
    out_bytes[n_outs++] = n;
  }
}

void *fz_bytes(fz *f, size_t n) {
  if (n > FZ_ARENA_BYTES / 2) n = FZ_ARENA_BYTES / 2;
  size_t off = (size_t)(fz_u32(f) % (FZ_ARENA_BYTES - n + 1));
  return fz_arena + (off - off % 8);
}

static int chaos;

static smelt_tensor view(fz *f, smelt_dtype dt, int ndim, const int64_t *shape, int out, int breakable) {
  smelt_tensor base = row_major(dt, ndim, shape);
  base.data = fz_arena; /* damage() may make it NULL or misaligned */
  smelt_tensor t = base;
  uint8_t m = chaos ? fz_u8(f) : 0;
  if ((m & 7) == 5) transpose_last(&t);
  if ((m & 7) == 6) pad_rows(&t, 1 + (m >> 4));
  if ((m & 7) == 7 && !out && t.ndim > 0) t.strides[(m >> 3) % t.ndim] = 0;
  if (breakable && chaos == 2 && (m & 0x38) == 0x38) damage(f, &t);
  int64_t numel = 0, span = 0;
  smelt_tensor clean = t;
  clean.data = fz_arena;
  int reject = must_reject(&clean, &numel, &span);
  if (!reject && (numel > FZ_MAX_NUMEL || span > (int64_t)FZ_ARENA_BYTES - 64)) {
    /* Real work beyond the arena: a caller's bug, not the library's. */
    t = base;
    clean = t;
    clean.data = fz_arena;
    reject = must_reject(&clean, &numel, &span);
    /* A hostile size becomes a small one (the same in every view that
     * shares it, so the call may still be consistent, and cheap). */
    for (int i = 0; !reject && i < t.ndim; i++)
      if (t.shape[i] > 64) t.shape[i] = 16;
    if (!reject) {
      t = row_major(t.dtype, t.ndim, t.shape);
      t.data = fz_arena;
      numel = smelt_tensor_numel(&t);
      span = numel * (int64_t)smelt_dtype_size(t.dtype);
    }
    while (!reject && numel > FZ_MAX_NUMEL) {
      int big = 0;
      for (int i = 1; i < t.ndim; i++)
        if (t.shape[i] > t.shape[big]) big = i;
      t.shape[big] /= 2;
      t = row_major(t.dtype, t.ndim, t.shape);
      t.data = fz_arena;
      numel = smelt_tensor_numel(&t);
      span = numel * (int64_t)smelt_dtype_size(t.dtype);
    }
  }
  void *data = t.data;
  place(f, &t, reject ? 0 : span);
  if (data == NULL || data == fz_arena + 1) t.data = data ? (uint8_t *)t.data + 1 : NULL;
  if (out) fz_output(&t);
  return t;
}

smelt_tensor fz_moved(fz *f, const smelt_tensor *t, int out) {
  smelt_tensor c = *t;
  int64_t numel, span;
  c.data = fz_arena;
  if (!must_reject(&c, &numel, &span) && fz_view_ok(t))
    place(f, &c, span);
  else
    c.data = t->data;
  if (out) fz_output(&c);
  return c;
}

int64_t fz_mul(int64_t a, int64_t b) {
  int64_t r;
  if (a < 0 || b < 0) return a < b ? a : b;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}

void fz_cap_work(int64_t *dims, int n, int64_t cap) {
  for (;;) {
    int64_t work = 1;
    int big = -1;
    for (int i = 0; i < n; i++) {
      if (dims[i] < 0 || dims[i] > 64) continue;
      work *= dims[i];
      if (big < 0 || dims[i] > dims[big]) big = i;
    }
    if (work <= cap || big < 0) return;
    dims[big] /= 2;
  }
}

smelt_tensor fz_view(fz *f, smelt_dtype dt, int ndim, const int64_t *shape, int out) {
  return view(f, dt, ndim, shape, out, 1);
}

smelt_tensor fz_view_plain(fz *f, smelt_dtype dt, int ndim, const int64_t *shape, int out) {
  return view(f, dt, ndim, shape, out, 0);
}

void fz_fill_ints(const smelt_tensor *t, const int64_t *values, int64_t n) {
  if (!fz_view_ok(t) || (t->dtype != SMELT_DTYPE_I32 && t->dtype != SMELT_DTYPE_I64)) return;
  int64_t numel = smelt_tensor_numel(t);
  for (int64_t i = 0; i < numel && i < n; i++) {
    int64_t off = 0, rest = i;
    for (int d = t->ndim - 1; d >= 0; d--) {
      off += rest % t->shape[d] * t->strides[d];
      rest /= t->shape[d];
    }
    if (t->dtype == SMELT_DTYPE_I32) {
      int32_t v = (int32_t)values[i];
      memcpy((int32_t *)t->data + off, &v, 4);
    } else {
      memcpy((int64_t *)t->data + off, &values[i], 8);
    }
  }
}

/* ---------------------------------------------------------------- checks */

typedef struct counter {
  const char *name;
  uint64_t calls, ok;
  double seconds;
} counter;
static double t_begin;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
/* One per entry-point name (one-shot, _plan and _run of every op). */
#define FZ_MAX_COUNTERS 256
static counter counters[FZ_MAX_COUNTERS];
static int n_counters;
static uint64_t total_calls;

static counter *count(const char *name) {
  total_calls++;
  for (int i = 0; i < n_counters; i++)
    if (counters[i].name == name || !strcmp(counters[i].name, name)) return &counters[i];
  if (n_counters == FZ_MAX_COUNTERS) abort();
  counters[n_counters].name = name;
  return &counters[n_counters++];
}

void fz_count(const char *name) {
  counter *c = count(name);
  c->calls++;
  c->ok++; /* a helper without a status has nothing to fail */
}

static void fail(const char *name, const char *what, smelt_status s) {
  fprintf(stderr, "smelt_fuzz: %s: %s (status %s, message \"%s\")\n", name, what, smelt_status_name(s),
          smelt_last_error());
  abort();
}

void fz_begin(void) {
  memcpy(snapshot, fz_arena, FZ_ARENA_BYTES);
  smelt_clear_error();
  t_begin = now();
}

static void mark(const smelt_tensor *t) {
  int64_t numel = smelt_tensor_numel(t);
  size_t es = smelt_dtype_size(t->dtype);
  for (int64_t i = 0; i < numel; i++) {
    int64_t off = 0, rest = i;
    for (int d = t->ndim - 1; d >= 0; d--) {
      off += rest % t->shape[d] * t->strides[d];
      rest /= t->shape[d];
    }
    size_t at = (size_t)((uint8_t *)t->data - fz_arena) + (size_t)off * es;
    for (size_t b = 0; b < es; b++) stamp[at + b] = stamp_now;
  }
}

static void print_view(const smelt_tensor *t, const void *p, size_t n) {
  if (!t) {
    fprintf(stderr, "  bytes at %td, %zu long\n", (const uint8_t *)p - fz_arena, n);
    return;
  }
  fprintf(stderr, "  %s at %td, ndim %d, shape", smelt_dtype_name(t->dtype), (const uint8_t *)t->data - fz_arena,
          t->ndim);
  for (int d = 0; d < t->ndim && d < SMELT_MAX_DIMS; d++) fprintf(stderr, " %lld", (long long)t->shape[d]);
  fprintf(stderr, ", strides");
  for (int d = 0; d < t->ndim && d < SMELT_MAX_DIMS; d++) fprintf(stderr, " %lld", (long long)t->strides[d]);
  fprintf(stderr, "\n");
}

void fz_trace(const char *name, const smelt_tensor *t, int n) {
  if (!verbose) return;
  fprintf(stderr, "smelt_fuzz: calling %s\n", name);
  for (int i = 0; i < n; i++) print_view(&t[i], NULL, 0);
}

/* Every byte that changed must belong to an output's element. */
static void check_writes(const char *name) {
  stamp_now++;
  for (int i = 0; i < n_outs; i++) {
    if (outs[i]) {
      size_t at = (size_t)((const uint8_t *)outs[i] - fz_arena);
      for (size_t b = 0; b < out_bytes[i] && at + b < FZ_ARENA_BYTES; b++) stamp[at + b] = stamp_now;
    } else {
      mark(&out_views[i]);
    }
  }
  for (size_t i = 0; i < FZ_ARENA_BYTES; i += 4096) {
    if (!memcmp(fz_arena + i, snapshot + i, 4096)) continue;
    for (size_t b = i; b < i + 4096; b++)
      if (fz_arena[b] != snapshot[b] && stamp[b] != stamp_now) {
        fprintf(stderr, "smelt_fuzz: %s wrote arena byte %zu, in no output; the outputs:\n", name, b);
        for (int o = 0; o < n_outs; o++) print_view(outs[o] ? NULL : &out_views[o], outs[o], out_bytes[o]);
        abort();
      }
  }
}

smelt_status fz_end(const char *name, smelt_status s) {
  counter *c = count(name);
  c->seconds += now() - t_begin;
  c->calls++;
  if (s == SMELT_OK) {
    c->ok++;
    check_writes(name);
    return s;
  }
  if (verbose) fprintf(stderr, "smelt_fuzz: %s: %s\n", name, smelt_last_error());
  if (!strcmp(smelt_status_name(s), "SMELT_STATUS_UNKNOWN")) fail(name, "returned a status outside the list", s);
  if (!smelt_last_error()[0]) fail(name, "failed with an empty message", s);
  if (memcmp(fz_arena, snapshot, FZ_ARENA_BYTES)) fail(name, "failed but wrote to the arena", s);
  return s;
}

smelt_status fz_end_pure(const char *name, smelt_status s) {
  int saved = n_outs;
  n_outs = 0;
  fz_end(name, s);
  n_outs = saved;
  return s;
}

void fz_check_plan(const char *name, smelt_status s, const smelt_plan *plan) {
  if (s == SMELT_OK && !plan) fail(name, "succeeded without a plan", s);
  if (s != SMELT_OK && plan) fail(name, "failed but returned a plan", s);
}

void fz_reset_outputs(void) { n_outs = 0; }

int fz_round(int r, int mode) {
  if (r >= (mode ? mode : 1)) return 0;
  if (r) fz_reset_outputs();
  return 1;
}

int fz_mode(fz *f) { return fz_u8(f) % 3; }

unsigned fz_nulls(fz *f, int n) { return fz_one_in(f, 12) ? 1u << (fz_u8(f) % n) : 0; }

const smelt_tensor *fz_maybe_null(unsigned nulls, smelt_tensor *t, int i) {
  return nulls >> i & 1 ? NULL : &t[i];
}

smelt_dtype fz_float_dtype(fz *f) {
  static const smelt_dtype common[3] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  uint8_t b = fz_u8(f);
  return b < 224 ? common[b % 3] : (smelt_dtype)fz_enum(f, SMELT_DTYPE_COUNT);
}

void fz_same(const char *name, const void *before, const void *after, size_t n) {
  if (memcmp(before, after, n)) fail(name, "modified an input passed as const", SMELT_OK);
}

/* ---------------------------------------------------------------- driver */

/* At exit: the calls per entry point, and with SMELT_FUZZ_MIN_CALLS set, a
 * failing exit status when fewer calls than that were made (CI asks for 10^6). */
static void report(void) {
  for (int i = 0; i < n_counters; i++)
    fprintf(stderr, "smelt_fuzz:   %-36s %10llu calls %10llu ok %8.2f s\n", counters[i].name,
            (unsigned long long)counters[i].calls, (unsigned long long)counters[i].ok, counters[i].seconds);
  fprintf(stderr, "smelt_fuzz: %llu calls over %d entry points\n", (unsigned long long)total_calls, n_counters);
  const char *min = getenv("SMELT_FUZZ_MIN_CALLS");
  if (min && total_calls < strtoull(min, NULL, 10)) {
    fprintf(stderr, "smelt_fuzz: fewer calls than SMELT_FUZZ_MIN_CALLS=%s\n", min);
    _Exit(1);
  }
}

static smelt_ctx *ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  /* libFuzzer's default limit is 2 GB a process: a request the library
   * allows on this machine but not there is refused as on a 1 GiB host. */
  smelt__host_limit = (size_t)1 << 30;
  fz_arena = aligned_alloc(4096, FZ_ARENA_BYTES);
  pristine = aligned_alloc(4096, FZ_ARENA_BYTES);
  snapshot = aligned_alloc(4096, FZ_ARENA_BYTES);
  stamp = calloc(FZ_ARENA_BYTES, sizeof *stamp);
  /* Ordinary values of every dtype, with the odd NaN and inf among them. */
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < FZ_ARENA_BYTES; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    pristine[i] = (uint8_t)(i % 4 == 3 ? 0x3c + (x & 3) : x);
  }
  smelt_ctx_options o = smelt_ctx_options_default();
  o.device = SMELT_DEVICE_CPU;
  o.use_env = 0;
  if (smelt_ctx_create(&ctx, &o)) {
    fprintf(stderr, "smelt_fuzz: no CPU context: %s\n", smelt_last_error());
    abort();
  }
  verbose = getenv("SMELT_FUZZ_VERBOSE") != NULL;
  atexit(report);
  return 0;
}

typedef void (*entry)(fz *);
static const entry entries[] = {fz_activation, fz_softmax, fz_topk, fz_helpers, fz_gemm, fz_gemm_array,
                                fz_gemm_grouped, fz_gemm_grouped_offs, fz_attention, fz_attention_varlen,
                                fz_peer, fz_peer_store, fz_conv2d, fz_moe, fz_bem, fz_quant,
                                fz_attention_decode, fz_norm, fz_residual_add, fz_rotary, fz_qgemm, fz_graph};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  memcpy(fz_arena, pristine, FZ_ARENA_BYTES);
  fz f = {data, size, ctx};
  for (int step = 0; step < 8 && (step == 0 || f.n > 0); step++) {
    n_outs = 0;
    last_place = NULL;
    next_free = 0;
    /* Most calls valid, some with odd layouts, some with a broken view. */
    uint8_t c = fz_u8(&f);
    chaos = c < 128 ? 0 : c < 192 ? 1 : 2;
    entries[fz_u8(&f) % (sizeof entries / sizeof entries[0])](&f);
  }
  return 0;
}
