/* Tests of the paged-cache ops, smelt_attention_decode and
 * smelt_kv_cache_append, on every backend (the CPU always, CUDA when
 * present) against a double-precision reference written here, apart from
 * the library's CPU reference: it gathers each query's visible positions
 * through its own walk of the block table.
 *
 * Every case draws fresh seeded inputs and hands out the cache pages in
 * shuffled order, with odd lengths (0, 1, lengths shorter than Sq, page
 * multiples and one past them), GQA ratios 1, 4 and 8, Sq 1 and Sq > 1
 * (causal and not), pages of 16, 64 and odd sizes, custom and negative
 * scales, padded layouts, and block table entries past each sequence's
 * pages set to ids that do not exist (they must never be read). Outputs
 * are poisoned: every element must be written, nothing between them or
 * past the guards. The GPU cases include lengths that make the host split
 * the keys (the combine kernel) and groups × Sq of each row-warp shape.
 * The append is checked exactly, cache element by cache element, and then
 * read back through a decode. Bad inputs: status, a message naming the
 * tensor and the constraint, and outputs left untouched. */
#include "core/error_bound.h"
#include "harness.h"

#include <math.h>

#define MAXB 8

static smelt_ctx *backend(int b) { return b == 0 ? th_cpu() : th_cuda(); }
static int is_cuda(smelt_ctx *ctx) { return smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA; }
#define FOR_EACH_BACKEND(ctx)          \
  for (int th_b = 0; th_b < 2; th_b++) \
    for (smelt_ctx *ctx = backend(th_b); ctx; ctx = NULL)

typedef struct dcase {
  int64_t B, Sq, H, Hk, D, ps;
  int64_t lens[MAXB];
  int causal;
  float scale; /* 0: 1/sqrt(D) */
  int padded;  /* gaps between rows, heads, pages; strided table and lengths */
  int no_lse;
} dcase;

/* A row-major view of shape with `pad` spare elements after each line of
 * every dim but the innermost. */
static th_view lay(int nd, const int64_t *shape, int64_t pad) {
  int64_t strides[SMELT_MAX_DIMS], s = 1;
  for (int d = nd - 1; d >= 0; d--) {
    strides[d] = s;
    s = s * shape[d] + pad;
  }
  return th_view_make(nd, shape, strides, 0);
}

/* Everything a case's call needs, on the host and on ctx. */
typedef struct dsetup {
  int64_t pages, max_pages;
  th_view lq, lk, lv, ltab, lsl, lo, ll;
  double *q, *k, *v;    /* dense, as rounded to dt: [B][Sq][H][D], [pages][ps][Hk][D] */
  int32_t *table, *len; /* dense [B][max_pages], [B] */
  uint8_t *qh, *kh, *vh;
  th_buf qb, kb, vb, tb, sb, ob, lb;
  smelt_tensor qt, kt, vt, tt, st, ot, lt;
} dsetup;

static double *dense_of(const th_view *l, smelt_dtype dt, double lo, double hi, uint8_t **host) {
  *host = (uint8_t *)malloc((size_t)l->storage * smelt_dtype_size(dt) + 1);
  th_fill_uniform(*host, dt, l->storage, lo, hi);
  double *d = (double *)malloc((size_t)(l->numel + 1) * sizeof(double));
  for (int64_t i = 0; i < l->numel; i++) d[i] = th_get(*host, dt, th_view_off(l, i));
  return d;
}

static th_buf upload(smelt_ctx *ctx, const void *host, size_t bytes) {
  th_buf b = th_buf_new(ctx, bytes);
  th_buf_upload(&b, host, bytes);
  return b;
}

/* An i32 tensor of view l from dense values (the gaps poisoned). */
static th_buf upload_i32(smelt_ctx *ctx, const th_view *l, const int32_t *dense, smelt_tensor *t) {
  int32_t *h = (int32_t *)malloc((size_t)l->storage * 4 + 4);
  memset(h, 0xFF, (size_t)l->storage * 4);
  for (int64_t i = 0; i < l->numel; i++) h[th_view_off(l, i)] = dense[i];
  th_buf b = upload(ctx, h, (size_t)l->storage * 4);
  *t = th_view_tensor(l, &b, SMELT_DTYPE_I32);
  free(h);
  return b;
}

/* Pages for every sequence's positions, handed out in shuffled order;
 * entries past a sequence's pages hold ids outside the cache. */
static void make_table(const dcase *c, dsetup *s) {
  int64_t need = 0;
  s->max_pages = 1;
  for (int64_t b = 0; b < c->B; b++) {
    const int64_t n = (c->lens[b] + c->ps - 1) / c->ps;
    need += n;
    if (n + 1 > s->max_pages) s->max_pages = n + 1;
  }
  s->pages = need + 3;
  int32_t *perm = (int32_t *)malloc((size_t)s->pages * 4);
  for (int64_t i = 0; i < s->pages; i++) perm[i] = (int32_t)i;
  for (int64_t i = s->pages - 1; i > 0; i--) {
    const int64_t j = (int64_t)(th_rand_u64() % (uint64_t)(i + 1));
    const int32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  s->table = (int32_t *)malloc((size_t)(c->B * s->max_pages + 1) * 4);
  s->len = (int32_t *)malloc((size_t)(c->B + 1) * 4);
  int64_t next = 0;
  for (int64_t b = 0; b < c->B; b++) {
    const int64_t n = (c->lens[b] + c->ps - 1) / c->ps;
    s->len[b] = (int32_t)c->lens[b];
    for (int64_t p = 0; p < s->max_pages; p++)
      s->table[b * s->max_pages + p] = p < n ? perm[next++] : (p % 2 ? -7 : (int32_t)(s->pages + 1000));
  }
  free(perm);
}

static void setup(smelt_ctx *ctx, smelt_dtype dt, const dcase *c, dsetup *s) {
  memset(s, 0, sizeof *s);
  make_table(c, s);
  const int64_t pad = c->padded ? 8 : 0;
  const int64_t qs[4] = {c->B, c->Sq, c->H, c->D}, cs[4] = {s->pages, c->ps, c->Hk, c->D};
  const int64_t ts[2] = {c->B, s->max_pages}, ss[1] = {c->B}, ls[3] = {c->B, c->H, c->Sq};
  s->lq = lay(4, qs, pad);
  s->lo = lay(4, qs, pad);
  s->lk = lay(4, cs, pad);
  s->lv = lay(4, cs, 2 * pad);
  s->ltab = lay(2, ts, c->padded ? 1 : 0);
  const int64_t sls[1] = {c->padded ? 2 : 1};
  s->lsl = th_view_make(1, ss, sls, 0);
  s->ll = lay(3, ls, c->padded ? 3 : 0);
  s->q = dense_of(&s->lq, dt, -2, 2, &s->qh);
  s->k = dense_of(&s->lk, dt, -2, 2, &s->kh);
  s->v = dense_of(&s->lv, dt, -1, 1, &s->vh);
  const size_t es = smelt_dtype_size(dt);
  s->qb = upload(ctx, s->qh, (size_t)s->lq.storage * es);
  s->kb = upload(ctx, s->kh, (size_t)s->lk.storage * es);
  s->vb = upload(ctx, s->vh, (size_t)s->lv.storage * es);
  s->tb = upload_i32(ctx, &s->ltab, s->table, &s->tt);
  s->sb = upload_i32(ctx, &s->lsl, s->len, &s->st);
  s->ob = th_buf_new(ctx, (size_t)s->lo.storage * es);
  s->lb = th_buf_new(ctx, (size_t)s->ll.storage * 4);
  s->qt = th_view_tensor(&s->lq, &s->qb, dt);
  s->kt = th_view_tensor(&s->lk, &s->kb, dt);
  s->vt = th_view_tensor(&s->lv, &s->vb, dt);
  s->ot = th_view_tensor(&s->lo, &s->ob, dt);
  s->lt = th_view_tensor(&s->ll, &s->lb, SMELT_DTYPE_F32);
}

static void teardown(dsetup *s) {
  th_buf *bufs[] = {&s->qb, &s->kb, &s->vb, &s->tb, &s->sb, &s->ob, &s->lb};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) th_buf_free(bufs[i]);
  free(s->q), free(s->k), free(s->v), free(s->table), free(s->len), free(s->qh), free(s->kh), free(s->vh);
}

/* Row (position p, kv head hk) of sequence b in a dense cache; the zero
 * row for a page id outside the cache (what CUDA reads there). */
static const double *row_of(const dcase *c, const dsetup *s, const double *cache, int64_t b, int64_t p, int64_t hk) {
  static const double zeros[256];
  const int64_t page = s->table[b * s->max_pages + p / c->ps];
  if (page < 0 || page >= s->pages) return zeros;
  return cache + ((page * c->ps + p % c->ps) * c->Hk + hk) * c->D;
}

/* The reference: o [B][Sq][H][D], lse [B][H][Sq]. */
static void reference(const dcase *c, const dsetup *s, double *o, double *lse) {
  const int64_t H = c->H, D = c->D, G = c->H / c->Hk;
  const double scale = c->scale != 0 ? (double)c->scale : 1.0 / sqrt((double)D);
  double *sc = (double *)malloc((size_t)(s->max_pages * c->ps + 1) * sizeof(double));
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t i = 0; i < c->Sq; i++)
      for (int64_t h = 0; h < H; h++) {
        const int64_t last = c->causal ? c->lens[b] - c->Sq + i : c->lens[b] - 1;
        const double *qr = s->q + ((b * c->Sq + i) * H + h) * D;
        double *orow = o + ((b * c->Sq + i) * H + h) * D, m = -INFINITY, l = 0;
        for (int64_t d = 0; d < D; d++) orow[d] = 0;
        for (int64_t p = 0; p <= last; p++) {
          const double *kr = row_of(c, s, s->k, b, p, h / G);
          double dot = 0;
          for (int64_t d = 0; d < D; d++) dot += qr[d] * kr[d];
          sc[p] = scale * dot;
          if (sc[p] > m) m = sc[p];
        }
        for (int64_t p = 0; p <= last; p++) {
          const double *vr = row_of(c, s, s->v, b, p, h / G), e = exp(sc[p] - m);
          l += e;
          for (int64_t d = 0; d < D; d++) orow[d] += e * vr[d];
        }
        for (int64_t d = 0; d < D; d++) orow[d] = last < 0 ? 0 : orow[d] / l;
        lse[(b * H + h) * c->Sq + i] = last < 0 ? INFINITY : m + log(l);
      }
  free(sc);
}

static double bound_of(smelt_ctx *ctx, smelt_dtype dt, int output) {
  const smelt__bound_query q = {.family = "attention_decode", .device = smelt_ctx_device(ctx), .dtype = dt,
                                .output = output};
  return smelt__error_bound(&q);
}

static void case_text(const dcase *c, smelt_ctx *ctx, smelt_dtype dt, char *buf, size_t n) {
  size_t u = (size_t)snprintf(buf, n, "decode %s %s B=%lld Sq=%lld H=%lld Hk=%lld D=%lld page=%lld%s%s scale=%g lens",
                              is_cuda(ctx) ? "cuda" : "cpu", smelt_dtype_name(dt), (long long)c->B, (long long)c->Sq,
                              (long long)c->H, (long long)c->Hk, (long long)c->D, (long long)c->ps,
                              c->causal ? " causal" : "", c->padded ? " padded" : "", (double)c->scale);
  for (int64_t b = 0; b < c->B && u < n; b++) u += (size_t)snprintf(buf + u, n - u, " %lld", (long long)c->lens[b]);
}

/* Decode on ctx against the reference, o and lse checked for every element. */
static void run_case(smelt_ctx *ctx, smelt_dtype dt, const dcase *c) {
  char what[320];
  case_text(c, ctx, dt, what, sizeof what);
  dsetup s;
  setup(ctx, dt, c, &s);
  const int64_t nq = s.lq.numel, nl = s.ll.numel;
  double *oref = (double *)malloc((size_t)(nq + 1) * 8), *lref = (double *)malloc((size_t)(nl + 1) * 8);
  double *got = (double *)malloc((size_t)(nq + 1) * 8), *lgot = (double *)malloc((size_t)(nl + 1) * 8);
  reference(c, &s, oref, lref);
  smelt_attention_decode_desc d = smelt_attention_decode_desc_default();
  d.causal = c->causal;
  d.scale = c->scale;
  smelt_status st = smelt_attention_decode(ctx, &d, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, c->no_lse ? NULL : &s.lt);
  if (st) th_fail(__FILE__, __LINE__, "%s: %s (%s)", what, smelt_status_name(st), smelt_last_error());
  th_check_output(what, "o", &s.lo, &s.ob, dt, got);
  if (!th_compare(what, got, oref, nq, bound_of(ctx, dt, 0), 0)) th_fail(__FILE__, __LINE__, "%s: o differs", what);
  if (c->no_lse) {
    CHECK(th_buf_untouched(&s.lb));
  } else {
    th_check_output(what, "lse", &s.ll, &s.lb, SMELT_DTYPE_F32, lgot);
    if (!th_compare(what, lgot, lref, nl, bound_of(ctx, SMELT_DTYPE_F32, 1), 0))
      th_fail(__FILE__, __LINE__, "%s: lse differs", what);
  }
  free(oref), free(lref), free(got), free(lgot);
  teardown(&s);
}

/* ---------------------------------------------------------------- CPU */

static void test_cpu_decode_one_query(void) {
  const dcase c = {3, 1, 8, 2, 32, 16, {1, 37, 100}, 1, 0, 0, 0};
  run_case(th_cpu(), SMELT_DTYPE_F32, &c);
  run_case(th_cpu(), SMELT_DTYPE_BF16, &c);
  const dcase f64 = {2, 1, 4, 4, 8, 3, {7, 12}, 1, 0, 0, 0};
  run_case(th_cpu(), SMELT_DTYPE_F64, &f64);
}

static void test_cpu_decode_chunked_causal(void) {
  /* GQA 8, Sq 5: a sequence shorter than Sq (rows that see nothing), one
   * of exactly a page, one a page and a bit, one empty. */
  const dcase c = {4, 5, 16, 2, 64, 64, {3, 64, 130, 0}, 1, 0, 0, 0};
  run_case(th_cpu(), SMELT_DTYPE_F32, &c);
  run_case(th_cpu(), SMELT_DTYPE_F16, &c);
  const dcase g4 = {2, 9, 8, 2, 16, 16, {9, 47}, 1, 0, 0, 0};
  run_case(th_cpu(), SMELT_DTYPE_F32, &g4);
}

static void test_cpu_decode_options(void) {
  /* Not causal, a negative scale, padded layouts, no lse; MHA (group 1). */
  const dcase nc = {2, 4, 4, 4, 16, 16, {33, 5}, 0, -0.3f, 1, 0};
  run_case(th_cpu(), SMELT_DTYPE_F32, &nc);
  const dcase nolse = {2, 1, 8, 1, 24, 5, {11, 26}, 1, 0.7f, 1, 1};
  run_case(th_cpu(), SMELT_DTYPE_F32, &nolse);
}

/* ---------------------------------------------------------------- CUDA */

static void test_gpu_decode(void) {
  smelt_ctx *ctx = th_cuda();
  if (!ctx) SKIP("no CUDA device");
  static const dcase cases[] = {
      /* one row warp (group 4 × Sq 1), splits across the device at B1 */
      {1, 1, 32, 8, 128, 16, {3001}, 1, 0, 0, 0},
      {1, 1, 32, 8, 64, 64, {777}, 1, 0, 1, 0},
      /* B8 of mixed lengths, one empty and one shorter than a tile */
      {8, 1, 16, 2, 128, 64, {1, 0, 63, 64, 65, 500, 129, 1000}, 1, 0, 0, 0},
      /* group 8 × Sq 3 = 24 rows: two row warps; Sq > 1 causal, odd page size */
      {3, 3, 16, 2, 128, 24, {2, 77, 300}, 1, 0, 0, 0},
      /* group 4 × Sq 16 = 64 rows: four row warps; group 8 × Sq 16 = 128: two row blocks */
      {2, 16, 8, 2, 64, 16, {16, 200}, 1, 0, 1, 0},
      {2, 16, 16, 2, 128, 64, {40, 1500}, 1, -0.2f, 0, 0},
      /* not causal, MHA, no lse, pages of 1 */
      {2, 2, 4, 4, 64, 1, {5, 90}, 0, 0, 1, 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    run_case(ctx, SMELT_DTYPE_BF16, &cases[i]);
    run_case(ctx, SMELT_DTYPE_F16, &cases[i]);
  }
}

/* A page id outside the cache reads as zeros on CUDA: keys with score 0
 * and zero values, no access outside the cache (guards intact). */
static void test_gpu_decode_bad_page(void) {
  smelt_ctx *ctx = th_cuda();
  if (!ctx) SKIP("no CUDA device");
  const dcase c = {2, 1, 8, 2, 128, 16, {40, 100}, 1, 0, 0, 0};
  dsetup s;
  setup(ctx, SMELT_DTYPE_BF16, &c, &s);
  s.table[1 * s.max_pages + 2] = (int32_t)(s.pages + 5);
  s.table[0] = -2;
  th_buf_free(&s.tb);
  s.tb = upload_i32(ctx, &s.ltab, s.table, &s.tt);
  const int64_t nq = s.lq.numel;
  double *oref = (double *)malloc((size_t)(nq + 1) * 8), *lref = (double *)malloc((size_t)(s.ll.numel + 1) * 8);
  double *got = (double *)malloc((size_t)(nq + 1) * 8);
  reference(&c, &s, oref, lref);
  CHECK_OK(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt));
  th_check_output("decode with bad page ids", "o", &s.lo, &s.ob, SMELT_DTYPE_BF16, got);
  CHECK(th_compare("decode with bad page ids", got, oref, nq, bound_of(ctx, SMELT_DTYPE_BF16, 0), 0));
  CHECK(th_buf_guards_ok(&s.kb) && th_buf_guards_ok(&s.vb));
  free(oref), free(lref), free(got);
  teardown(&s);
}

static void test_gpu_decode_unsupported(void) {
  smelt_ctx *ctx = th_cuda();
  if (!ctx) SKIP("no CUDA device");
  const dcase c = {1, 1, 4, 2, 96, 16, {20}, 1, 0, 0, 0};
  dsetup s;
  setup(ctx, SMELT_DTYPE_BF16, &c, &s);
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt),
               SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("D=96");
  CHECK(th_buf_untouched(&s.ob));
  teardown(&s);
  const dcase f = {1, 1, 4, 2, 64, 16, {20}, 1, 0, 0, 0};
  setup(ctx, SMELT_DTYPE_F32, &f, &s);
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt),
               SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("q.dtype=f32");
  teardown(&s);
}

/* ---------------------------------------------------------------- errors */

static void test_decode_bad_shapes(void) {
  smelt_ctx *ctx = th_cpu();
  const dcase c = {2, 2, 8, 2, 16, 16, {5, 40}, 1, 0, 0, 0};
  dsetup s;
  setup(ctx, SMELT_DTYPE_F32, &c, &s);
  smelt_tensor t;
  t = s.qt;
  t.ndim = 3;
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &t, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("q.ndim=3");
  t = s.vt;
  t.shape[1] = 15;
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &t, &s.tt, &s.st, &s.ot, &s.lt), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("v_cache");
  smelt_tensor q3 = s.qt, o3 = s.ot;
  q3.shape[2] = o3.shape[2] = 7;
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &q3, &s.kt, &s.vt, &s.tt, &s.st, &o3, NULL), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("multiple of k_cache.shape[2]=2");
  t = s.tt;
  t.dtype = SMELT_DTYPE_F32;
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &t, &s.st, &s.ot, &s.lt), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("block_table");
  t = s.st;
  t.shape[0] = 3;
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &t, &s.ot, &s.lt), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("cache_seqlens.shape[0]=3");
  t = s.lt;
  t.shape[2] = 1;
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &t), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("lse.shape");
  smelt_attention_decode_desc d = smelt_attention_decode_desc_default();
  d.causal = 2;
  CHECK_STATUS(smelt_attention_decode(ctx, &d, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("desc->causal=2");
  d = smelt_attention_decode_desc_default();
  d.scale = NAN;
  CHECK_STATUS(smelt_attention_decode(ctx, &d, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("desc->scale");
  /* o over q's memory */
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.qt, &s.lt),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("o overlaps q");
  CHECK(th_buf_untouched(&s.ob) && th_buf_untouched(&s.lb));
  teardown(&s);

  const dcase big = {1, 65, 1, 1, 8, 16, {70}, 1, 0, 0, 0};
  setup(ctx, SMELT_DTYPE_F32, &big, &s);
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt),
               SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("1..64");
  teardown(&s);
}

/* Bad device data: the CPU rejects it before writing. */
static void test_cpu_decode_bad_table(void) {
  smelt_ctx *ctx = th_cpu();
  const dcase c = {2, 1, 4, 2, 16, 16, {5, 40}, 1, 0, 0, 0};
  dsetup s;
  setup(ctx, SMELT_DTYPE_F32, &c, &s);
  int32_t *tab = (int32_t *)s.tb.data;
  const int64_t at = th_view_off(&s.ltab, 1 * s.max_pages + 2); /* sequence 1's third page */
  const int32_t keep = tab[at];
  tab[at] = (int32_t)s.pages;
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("block_table[1][2]");
  tab[at] = keep;
  int32_t *len = (int32_t *)s.sb.data;
  len[0] = (int32_t)(s.max_pages * c.ps + 1);
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("cache_seqlens[0]");
  len[0] = -1;
  CHECK_STATUS(smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, &s.lt),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK(th_buf_untouched(&s.ob) && th_buf_untouched(&s.lb));
  teardown(&s);
}

/* ---------------------------------------------------------------- append */

/* Appends Snew random rows to each sequence of c (whose lens are the
 * lengths before), checks the caches exactly, then decodes the last Sq = Snew
 * queries against the reference of the grown cache. */
static void run_append(smelt_ctx *ctx, smelt_dtype dt, const dcase *before, int64_t snew) {
  char what[320];
  dcase c = *before;
  c.Sq = snew;
  for (int64_t b = 0; b < c.B; b++) c.lens[b] += snew;
  case_text(&c, ctx, dt, what, sizeof what);
  dsetup s;
  setup(ctx, dt, &c, &s); /* the grown lengths size the table */
  /* cache_seqlens before the append */
  int32_t *len0 = (int32_t *)malloc((size_t)c.B * 4);
  for (int64_t b = 0; b < c.B; b++) len0[b] = (int32_t)before->lens[b];
  smelt_tensor l0t;
  th_buf l0b = upload_i32(ctx, &s.lsl, len0, &l0t);
  const int64_t ns[4] = {c.B, snew, c.Hk, c.D};
  const th_view ln = lay(4, ns, c.padded ? 8 : 0);
  uint8_t *kh, *vh;
  double *kn = dense_of(&ln, dt, -2, 2, &kh), *vn = dense_of(&ln, dt, -1, 1, &vh);
  const size_t es = smelt_dtype_size(dt);
  th_buf knb = upload(ctx, kh, (size_t)ln.storage * es), vnb = upload(ctx, vh, (size_t)ln.storage * es);
  const smelt_tensor knt = th_view_tensor(&ln, &knb, dt), vnt = th_view_tensor(&ln, &vnb, dt);
  /* The expected caches: the new rows over the old. */
  for (int64_t b = 0; b < c.B; b++)
    for (int64_t j = 0; j < snew; j++) {
      const int64_t p = before->lens[b] + j, page = s.table[b * s.max_pages + p / c.ps];
      for (int64_t h = 0; h < c.Hk; h++)
        for (int64_t d = 0; d < c.D; d++) {
          const int64_t ci = ((page * c.ps + p % c.ps) * c.Hk + h) * c.D + d, ni = ((b * snew + j) * c.Hk + h) * c.D + d;
          s.k[ci] = kn[ni];
          s.v[ci] = vn[ni];
        }
    }
  smelt_status st = smelt_kv_cache_append(ctx, &knt, &vnt, &s.tt, &l0t, &s.kt, &s.vt);
  if (st) th_fail(__FILE__, __LINE__, "%s: append: %s (%s)", what, smelt_status_name(st), smelt_last_error());
  for (int w = 0; w < 2; w++) {
    const th_view *l = w ? &s.lv : &s.lk;
    uint8_t *h = (uint8_t *)malloc((size_t)l->storage * es + 1);
    th_buf_download(w ? &s.vb : &s.kb, h, (size_t)l->storage * es);
    int64_t bad = 0;
    for (int64_t i = 0; i < l->numel; i++) bad += th_get(h, dt, th_view_off(l, i)) != (w ? s.v : s.k)[i];
    if (bad) th_fail(__FILE__, __LINE__, "%s: %lld elements of %s differ after the append", what, (long long)bad,
                     w ? "v_cache" : "k_cache");
    CHECK(th_buf_guards_ok(w ? &s.vb : &s.kb));
    free(h);
  }
  double *oref = (double *)malloc((size_t)(s.lq.numel + 1) * 8), *lref = (double *)malloc((size_t)(s.ll.numel + 1) * 8);
  double *got = (double *)malloc((size_t)(s.lq.numel + 1) * 8);
  reference(&c, &s, oref, lref);
  st = smelt_attention_decode(ctx, NULL, &s.qt, &s.kt, &s.vt, &s.tt, &s.st, &s.ot, NULL);
  if (st) th_fail(__FILE__, __LINE__, "%s: decode: %s (%s)", what, smelt_status_name(st), smelt_last_error());
  th_check_output(what, "o", &s.lo, &s.ob, dt, got);
  if (!th_compare(what, got, oref, s.lq.numel, bound_of(ctx, dt, 0), 0))
    th_fail(__FILE__, __LINE__, "%s: o after the append differs", what);
  free(oref), free(lref), free(got), free(kn), free(vn), free(kh), free(vh), free(len0);
  th_buf_free(&l0b), th_buf_free(&knb), th_buf_free(&vnb);
  teardown(&s);
}

static void test_append_then_decode(void) {
  FOR_EACH_BACKEND(ctx) {
    const dcase a = {3, 0, 8, 2, 64, 16, {0, 15, 33}, 1, 0, 0, 0};
    run_append(ctx, SMELT_DTYPE_BF16, &a, 1);
    run_append(ctx, SMELT_DTYPE_BF16, &a, 7);
    const dcase p = {2, 0, 16, 2, 128, 64, {63, 200}, 1, 0, 1, 0};
    run_append(ctx, SMELT_DTYPE_F16, &p, 2);
    if (!is_cuda(ctx)) {
      const dcase f = {2, 0, 4, 1, 5, 3, {4, 0}, 1, 0, 0, 0};
      run_append(ctx, SMELT_DTYPE_F32, &f, 4);
    }
  }
}

static void test_append_bad(void) {
  smelt_ctx *ctx = th_cpu();
  const dcase c = {2, 3, 4, 2, 16, 16, {5, 40}, 1, 0, 0, 0};
  dsetup s;
  setup(ctx, SMELT_DTYPE_F32, &c, &s);
  /* k_new like the cache's rows: [B, 3, Hk, D] from q's buffer (q has H = 4 heads). */
  smelt_tensor kn = s.qt;
  kn.shape[2] = 2;
  int32_t *len = (int32_t *)s.sb.data;
  len[1] = (int32_t)(s.max_pages * c.ps - 2); /* 3 more rows do not fit */
  uint8_t *before = (uint8_t *)malloc(s.kb.bytes);
  memcpy(before, s.kb.data, s.kb.bytes);
  CHECK_STATUS(smelt_kv_cache_append(ctx, &kn, &kn, &s.tt, &s.st, &s.kt, &s.vt), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("cache_seqlens[1]");
  CHECK(!memcmp(before, s.kb.data, s.kb.bytes));
  len[1] = 40;
  smelt_tensor bad = s.qt; /* 4 heads, the cache has 2 */
  CHECK_STATUS(smelt_kv_cache_append(ctx, &bad, &bad, &s.tt, &s.st, &s.kt, &s.vt), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("kv heads");
  /* The cache is written in place: it must not be an input too. */
  CHECK_STATUS(smelt_kv_cache_append(ctx, &kn, &kn, &s.tt, &s.st, &s.kt, &s.kt), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK(!memcmp(before, s.kb.data, s.kb.bytes));
  free(before);
  teardown(&s);
}

const th_test th_tests_attention_decode[] = {
    {"cpu_one_query", test_cpu_decode_one_query},
    {"cpu_chunked_causal", test_cpu_decode_chunked_causal},
    {"cpu_options", test_cpu_decode_options},
    {"cpu_bad_table", test_cpu_decode_bad_table},
    {"bad_shapes", test_decode_bad_shapes},
    {"gpu_decode", test_gpu_decode},
    {"gpu_bad_page", test_gpu_decode_bad_page},
    {"gpu_unsupported", test_gpu_decode_unsupported},
    {0, 0},
};

const th_test th_tests_kv_cache_append[] = {
    {"append_then_decode", test_append_then_decode},
    {"bad", test_append_bad},
    {0, 0},
};
