/* The harness behind tests/harness.h: failure bookkeeping, seeded random
 * numbers, shared CPU/CUDA contexts and guarded device buffers. */
#include "harness.h"
#include "core/internal.h"

#include <stdarg.h>

int th_failed_now;
int th_skipped_now;
uint64_t th_seed;
static uint64_t rng_state;

void th_fail(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "    %s:%d: ", file, line);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, " [seed %llu]\n", (unsigned long long)th_seed);
  va_end(ap);
  th_failed_now++;
}

void th_skip(const char *why) {
  fprintf(stderr, "    skipped: %s\n", why);
  th_skipped_now = 1;
}

void th_seed_set(uint64_t seed) {
  th_seed = seed;
  rng_state = seed ? seed : 0x9e3779b97f4a7c15ull;
}

/* splitmix64: small, fast, good enough for test data. */
uint64_t th_rand_u64(void) {
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double th_rand_uniform(double lo, double hi) {
  return lo + (hi - lo) * ((double)(th_rand_u64() >> 11) * (1.0 / 9007199254740992.0));
}

double th_rand_normal(void) {
  double u1 = th_rand_uniform(1e-300, 1.0), u2 = th_rand_uniform(0.0, 1.0);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static smelt_ctx *cpu_ctx, *cuda_ctx;
static int cuda_tried;

smelt_ctx *th_cpu(void) {
  if (!cpu_ctx) {
    smelt_ctx_options o = smelt_ctx_options_default();
    o.use_env = 0;
    if (smelt_ctx_create(&cpu_ctx, &o) != SMELT_OK) {
      fprintf(stderr, "cannot create a CPU context: %s\n", smelt_last_error());
      exit(1);
    }
  }
  return cpu_ctx;
}

smelt_ctx *th_cuda(void) {
  if (!cuda_tried) {
    cuda_tried = 1;
    const char *no = getenv("SMELT_TEST_NO_CUDA");
    if (no && *no && strcmp(no, "0")) return NULL;
    smelt_ctx_options o = smelt_ctx_options_default();
    o.use_env = 0;
    o.device = SMELT_DEVICE_CUDA;
    if (smelt_ctx_create(&cuda_ctx, &o) != SMELT_OK) cuda_ctx = NULL;
  }
  return cuda_ctx;
}

int th_cuda_sm90(void) {
  smelt_ctx *cu = th_cuda();
  smelt_device_info di;
  return cu && smelt_device_info_get(smelt_ctx_device_index(cu), &di) == SMELT_OK && di.cc_major == 9 &&
         di.cc_minor == 0;
}

void th_contexts_destroy(void) {
  smelt_ctx_destroy(cpu_ctx);
  smelt_ctx_destroy(cuda_ctx);
  cpu_ctx = cuda_ctx = NULL;
  cuda_tried = 0;
}

static void pattern(uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(0xA5 ^ (i * 7));
}

th_buf th_buf_new(smelt_ctx *ctx, size_t bytes) {
  th_buf b;
  memset(&b, 0, sizeof b);
  b.ctx = ctx;
  b.bytes = bytes;
  size_t total = bytes + 2 * TH_GUARD;
  void *p = NULL;
  if (smelt_alloc(ctx, total, &p) != SMELT_OK) {
    fprintf(stderr, "th_buf_new(%zu): %s\n", bytes, smelt_last_error());
    exit(1);
  }
  b.base = (uint8_t *)p;
  b.data = b.base + TH_GUARD;
  uint8_t *host = (uint8_t *)malloc(total);
  pattern(host, TH_GUARD);
  memset(host + TH_GUARD, 0xFF, bytes);
  pattern(host + TH_GUARD + bytes, TH_GUARD);
  smelt_memcpy_h2d(ctx, b.base, host, total);
  free(host);
  return b;
}

void th_buf_free(th_buf *b) {
  if (b->base) {
    smelt_ctx_synchronize(b->ctx);
    smelt_free(b->ctx, b->base);
  }
  memset(b, 0, sizeof *b);
}

void th_buf_upload(th_buf *b, const void *host, size_t bytes) {
  if (smelt_memcpy_h2d(b->ctx, b->data, host, bytes) != SMELT_OK) {
    fprintf(stderr, "th_buf_upload: %s\n", smelt_last_error());
    exit(1);
  }
}

void th_buf_download(const th_buf *b, void *host, size_t bytes) {
  smelt_ctx_synchronize(b->ctx);
  if (smelt_memcpy_d2h(b->ctx, host, b->data, bytes) != SMELT_OK) {
    fprintf(stderr, "th_buf_download: %s\n", smelt_last_error());
    exit(1);
  }
}

int th_all_ff(const void *p, size_t n) {
  const uint8_t *u = (const uint8_t *)p;
  for (size_t i = 0; i < n; i++)
    if (u[i] != 0xFF) return 0;
  return 1;
}

int th_buf_untouched(const th_buf *b) {
  uint8_t *h = (uint8_t *)malloc(b->bytes + 1);
  th_buf_download(b, h, b->bytes);
  int ok = th_all_ff(h, b->bytes) && th_buf_guards_ok(b);
  free(h);
  return ok;
}

int th_buf_guards_ok(const th_buf *b) {
  uint8_t *got = (uint8_t *)malloc(TH_GUARD), *want = (uint8_t *)malloc(TH_GUARD);
  pattern(want, TH_GUARD);
  smelt_ctx_synchronize(b->ctx);
  smelt_memcpy_d2h(b->ctx, got, b->base, TH_GUARD);
  int ok = !memcmp(got, want, TH_GUARD);
  smelt_memcpy_d2h(b->ctx, got, b->base + TH_GUARD + b->bytes, TH_GUARD);
  ok = ok && !memcmp(got, want, TH_GUARD);
  free(got);
  free(want);
  return ok;
}

int64_t th_view_off(const th_view *v, int64_t i) {
  int64_t off = 0;
  for (int d = v->ndim - 1; d >= 0; d--) {
    off += (i % v->shape[d]) * v->strides[d];
    i /= v->shape[d];
  }
  return off;
}

th_view th_view_make(int ndim, const int64_t *shape, const int64_t *strides, int64_t offset) {
  th_view v;
  memset(&v, 0, sizeof v);
  v.ndim = ndim;
  v.offset = offset;
  v.numel = 1;
  int64_t extent = 0;
  for (int d = 0; d < ndim; d++) {
    v.shape[d] = shape[d];
    v.strides[d] = strides[d];
    v.numel *= shape[d];
    extent += (shape[d] > 0 ? shape[d] - 1 : 0) * strides[d];
  }
  v.storage = offset + extent + 1;
  return v;
}

void th_check_output(const char *what, const char *name, const th_view *v, const th_buf *b, smelt_dtype dt,
                     double *got) {
  const size_t es = smelt_dtype_size(dt);
  uint8_t *host = (uint8_t *)malloc((size_t)v->storage * es + 1);
  uint8_t *hit = (uint8_t *)calloc((size_t)v->storage + 1, 1);
  th_buf_download(b, host, (size_t)v->storage * es);
  int64_t unwritten = -1, stray = -1;
  for (int64_t i = 0; i < v->numel; i++) {
    int64_t at = v->offset + th_view_off(v, i);
    hit[at] = 1;
    if (th_all_ff(host + at * (int64_t)es, es) && unwritten < 0) unwritten = i;
    if (got) got[i] = th_get(host, dt, at);
  }
  for (int64_t at = 0; at < v->storage; at++)
    if (!hit[at] && !th_all_ff(host + at * (int64_t)es, es) && stray < 0) stray = at;
  if (unwritten >= 0)
    th_fail(__FILE__, __LINE__, "%s: %s element %lld was not written", what, name, (long long)unwritten);
  if (stray >= 0)
    th_fail(__FILE__, __LINE__, "%s: %s storage element %lld outside the view was written", what, name,
            (long long)stray);
  if (!th_buf_guards_ok(b)) th_fail(__FILE__, __LINE__, "%s: a guard region of %s was overwritten", what, name);
  free(host);
  free(hit);
}

smelt_tensor th_view_tensor(const th_view *v, const th_buf *b, smelt_dtype dt) {
  smelt_tensor t;
  memset(&t, 0, sizeof t);
  t.data = (uint8_t *)b->data + v->offset * (int64_t)smelt_dtype_size(dt);
  t.dtype = dt;
  t.device = smelt_ctx_device(b->ctx);
  t.device_index = smelt_ctx_device_index(b->ctx);
  t.ndim = v->ndim;
  for (int d = 0; d < v->ndim; d++) {
    t.shape[d] = v->shape[d];
    t.strides[d] = v->strides[d];
  }
  return t;
}

double th_get(const void *host, smelt_dtype dt, int64_t i) { return smelt__load_f64(host, dt, i); }

void th_set(void *host, smelt_dtype dt, int64_t i, double v) { smelt__store_f64(host, dt, i, v); }

void th_fill_uniform(void *host, smelt_dtype dt, int64_t n, double lo, double hi) {
  for (int64_t i = 0; i < n; i++) th_set(host, dt, i, th_rand_uniform(lo, hi));
}

int th_compare(const char *what, const double *got, const double *ref, int64_t n, double rel_bound,
               double abs_bound) {
  double num = 0, den = 0, max_abs = 0;
  int64_t at = -1, nan_bad = -1;
  for (int64_t i = 0; i < n; i++) {
    int gn = isnan(got[i]), rn = isnan(ref[i]);
    if (gn || rn) {
      if (gn != rn && nan_bad < 0) nan_bad = i;
      continue;
    }
    if (isinf(got[i]) || isinf(ref[i])) {
      if (got[i] != ref[i] && nan_bad < 0) nan_bad = i;
      continue;
    }
    double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    if (fabs(d) > max_abs) {
      max_abs = fabs(d);
      at = i;
    }
  }
  double rel = den > 0 ? sqrt(num / den) : sqrt(num);
  int ok = nan_bad < 0 && (rel <= rel_bound || max_abs <= abs_bound);
  if (!ok) {
    fprintf(stderr, "    %s: rel err %.3g (bound %.3g), max abs err %.3g at %lld (got %.9g ref %.9g)", what, rel,
            rel_bound, max_abs, (long long)at, at >= 0 ? got[at] : 0.0, at >= 0 ? ref[at] : 0.0);
    if (nan_bad >= 0)
      fprintf(stderr, "; NaN/Inf parity broken at %lld (got %g ref %g)", (long long)nan_bad, got[nan_bad],
              ref[nan_bad]);
    fprintf(stderr, " [seed %llu]\n", (unsigned long long)th_seed);
  }
  return ok;
}
