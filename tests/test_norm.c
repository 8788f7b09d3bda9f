/* Norm tests: smelt_norm (RMSNorm, LayerNorm, the fused residual form),
 * smelt_norm_bwd and smelt_residual_add on every backend (the CPU always,
 * CUDA when present) against double-precision computations written here,
 * independent of the library's CPU reference, with the bounds of
 * src/core/error_bound.c. Inputs are fresh seeded random values; outputs
 * are poisoned and checked element by element for being written, with
 * the gaps between padded rows and the guard regions untouched. The widths
 * cover every kernel bucket and both entry points (odd widths, padded rows
 * and unaligned pointers take the element-wise one). The backward is also
 * checked against central differences of the forward, and on the GPU for
 * bit-for-bit repeatable weight gradients. Bad inputs: the status, a
 * message naming the tensor and the constraint, and nothing written. */
#include "core/error_bound.h"
#include "harness.h"

#include <math.h>

static double bound(const char *family, smelt_dtype dt, int output) {
  const smelt__bound_query q = {.family = family, .dtype = dt, .output = output};
  return smelt__error_bound(&q);
}
#define ABS_BOUND 1e-6

static smelt_ctx *backend(int b) { return b == 0 ? th_cpu() : th_cuda(); }
static const char *backend_name(smelt_ctx *ctx) { return smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA ? "cuda" : "cpu"; }
#define FOR_EACH_BACKEND(ctx)          \
  for (int th_b = 0; th_b < 2; th_b++) \
    for (smelt_ctx *ctx = backend(th_b); ctx; ctx = NULL)

/* ---- a tensor with its host copy: inputs random, outputs poisoned */

typedef struct tb {
  th_view v;
  th_buf b;
  smelt_tensor t;
  smelt_dtype dt;
  uint8_t *host; /* the whole storage (inputs) */
} tb;

static tb tb_new(smelt_ctx *ctx, th_view v, smelt_dtype dt, int input, double lo, double hi) {
  tb r;
  r.v = v;
  r.dt = dt;
  const size_t bytes = (size_t)v.storage * smelt_dtype_size(dt);
  r.b = th_buf_new(ctx, bytes);
  r.host = NULL;
  if (input) {
    r.host = (uint8_t *)malloc(bytes);
    th_fill_uniform(r.host, dt, v.storage, lo, hi);
    th_buf_upload(&r.b, r.host, bytes);
  }
  r.t = th_view_tensor(&r.v, &r.b, dt);
  return r;
}

static double tb_get(const tb *t, int64_t i) { return th_get(t->host, t->dt, t->v.offset + th_view_off(&t->v, i)); }

static void tb_free(tb *t) {
  th_buf_free(&t->b);
  free(t->host);
}

/* v rounded to dt. */
static double round_to(smelt_dtype dt, double v) {
  uint64_t cell = 0;
  th_set(&cell, dt, 0, v);
  return th_get(&cell, dt, 0);
}

/* Rows [L0, L1, C] with `pad` spare elements per row, `off` elements in. */
static th_view rows_view(const int64_t *lead, int64_t C, int pad, int off) {
  const int64_t shape[3] = {lead[0], lead[1], C}, strides[3] = {lead[1] * (C + pad), C + pad, 1};
  return th_view_make(3, shape, strides, off);
}

/* Statistics [L0, L1] every `step` elements. */
static th_view stats_view(const int64_t *lead, int step) {
  const int64_t strides[2] = {lead[1] * step, step};
  return th_view_make(2, lead, strides, 0);
}

static th_view vec_view(int64_t C) {
  const int64_t one = 1;
  return th_view_make(1, &C, &one, 0);
}

/* ---- the cases */

typedef struct nprob {
  smelt_dtype dt, wdt;
  smelt_norm_kind kind;
  int64_t lead[2], C;
  int pad, off, residual, h_out, weight, bias, stats_step;
  int specials; /* a NaN in row 1 and +inf in row 2 of x */
} nprob;

static const char *prob_text(smelt_ctx *ctx, const nprob *p, const char *op, char *buf, size_t n) {
  snprintf(buf, n, "%s %s %s %s w:%s [%lld, %lld, %lld] pad %d off %d%s%s%s%s", op, backend_name(ctx),
           smelt_norm_kind_name(p->kind), smelt_dtype_name(p->dt), smelt_dtype_name(p->wdt), (long long)p->lead[0],
           (long long)p->lead[1], (long long)p->C, p->pad, p->off, p->residual ? " +residual" : "",
           p->h_out ? " +h_out" : "", p->weight ? " +weight" : "", p->bias ? " +bias" : "");
  return buf;
}

/* The forward of one row in double: h as given, y, mean and rstd out. */
static void ref_norm_row(smelt_norm_kind kind, double eps, const double *h, const double *w, const double *b, int64_t C,
                         double *y, double *mean, double *rstd) {
  double s = 0, q = 0;
  for (int64_t j = 0; j < C; j++) s += h[j];
  const double m = kind == SMELT_NORM_LAYER ? s / (double)C : 0.0;
  for (int64_t j = 0; j < C; j++) q += (h[j] - m) * (h[j] - m);
  const double r = 1.0 / sqrt(q / (double)C + eps);
  for (int64_t j = 0; j < C; j++) y[j] = (h[j] - m) * r * (w ? w[j] : 1.0) + (b ? b[j] : 0.0);
  *mean = m;
  *rstd = r;
}

static double *vec_values(const tb *t, int present, int64_t C) {
  if (!present) return NULL;
  double *v = (double *)malloc((size_t)C * sizeof(double));
  for (int64_t j = 0; j < C; j++) v[j] = tb_get(t, j);
  return v;
}

static void fwd_case(smelt_ctx *ctx, const nprob *p) {
  const int64_t C = p->C, rows = p->lead[0] * p->lead[1], n = rows * C;
  const float eps = 1e-5f;
  char what[240];
  prob_text(ctx, p, "norm", what, sizeof what);
  const th_view rv = rows_view(p->lead, C, p->pad, p->off), sv = stats_view(p->lead, p->stats_step);
  tb x = tb_new(ctx, rv, p->dt, 1, -1.0, 3.0), res = tb_new(ctx, rv, p->dt, 1, -2.0, 2.0);
  tb w = tb_new(ctx, vec_view(C), p->wdt, 1, 0.5, 1.5), b = tb_new(ctx, vec_view(C), p->wdt, 1, -0.5, 0.5);
  tb y = tb_new(ctx, rv, p->dt, 0, 0, 0), h = tb_new(ctx, rv, p->dt, 0, 0, 0);
  tb mean = tb_new(ctx, sv, SMELT_DTYPE_F32, 0, 0, 0), rstd = tb_new(ctx, sv, SMELT_DTYPE_F32, 0, 0, 0);
  if (p->specials) {
    th_set(x.host, p->dt, x.v.offset + th_view_off(&x.v, C + C / 2), NAN);
    th_set(x.host, p->dt, x.v.offset + th_view_off(&x.v, 2 * C), INFINITY);
    th_buf_upload(&x.b, x.host, (size_t)x.v.storage * smelt_dtype_size(p->dt));
  }
  const int layer = p->kind == SMELT_NORM_LAYER;
  const smelt_norm_desc desc = {p->kind, eps};
  CHECK_OK(smelt_norm(ctx, &desc, &x.t, p->residual ? &res.t : NULL, p->weight ? &w.t : NULL, p->bias ? &b.t : NULL,
                      &y.t, p->h_out ? &h.t : NULL, layer ? &mean.t : NULL, &rstd.t));
  double *got = (double *)malloc((size_t)(n + 1) * sizeof(double)), *ref = (double *)malloc((size_t)(n + 1) * sizeof(double));
  double *hr = (double *)malloc((size_t)(n + 1) * sizeof(double));
  double *mref = (double *)malloc((size_t)(rows + 1) * sizeof(double)), *sref = (double *)malloc((size_t)(rows + 1) * sizeof(double));
  double *wv = vec_values(&w, p->weight, C), *bv = vec_values(&b, p->bias, C);
  for (int64_t i = 0; i < n; i++)
    hr[i] = p->residual ? round_to(p->dt, tb_get(&x, i) + tb_get(&res, i)) : tb_get(&x, i);
  for (int64_t r = 0; r < rows; r++)
    ref_norm_row(p->kind, eps, hr + r * C, wv, bv, C, ref + r * C, &mref[r], &sref[r]);
  th_check_output(what, "y", &y.v, &y.b, p->dt, got);
  if (!th_compare(what, got, ref, n, bound("norm", p->dt, 0), ABS_BOUND)) th_fail(__FILE__, __LINE__, "%s: y", what);
  if (p->h_out) {
    th_check_output(what, "h_out", &h.v, &h.b, p->dt, got);
    if (!th_compare(what, got, hr, n, 0, 0)) th_fail(__FILE__, __LINE__, "%s: h_out is not x + residual rounded", what);
  } else {
    CHECK(th_buf_untouched(&h.b));
  }
  th_check_output(what, "rstd", &rstd.v, &rstd.b, SMELT_DTYPE_F32, got);
  if (!th_compare(what, got, sref, rows, bound("norm", SMELT_DTYPE_F32, 1), 0))
    th_fail(__FILE__, __LINE__, "%s: rstd", what);
  if (layer) {
    th_check_output(what, "mean", &mean.v, &mean.b, SMELT_DTYPE_F32, got);
    if (!th_compare(what, got, mref, rows, bound("norm", SMELT_DTYPE_F32, 1), 0))
      th_fail(__FILE__, __LINE__, "%s: mean", what);
  }
  free(got), free(ref), free(hr), free(mref), free(sref), free(wv), free(bv);
  tb *all[] = {&x, &res, &w, &b, &y, &h, &mean, &rstd};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) tb_free(all[i]);
}

/* The widths: every bucket (warp to 256; CTAs to 1024, 2048, 4096, 8192;
 * tiles beyond), odd ones and vector multiples. */
typedef struct width_set {
  smelt_dtype dt, wdt;
  int64_t C[10];
} width_set;

static const width_set widths[] = {
    {SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, {1, 7, 255, 257, 1000, 2048, 4096, 8000, 8193, 16384}},
    {SMELT_DTYPE_BF16, SMELT_DTYPE_F32, {127, 4096, 9000}},
    {SMELT_DTYPE_F32, SMELT_DTYPE_F32, {3, 1000, 4096, 10000}},
    {SMELT_DTYPE_F16, SMELT_DTYPE_F16, {64, 2000, 8192}},
    {SMELT_DTYPE_F16, SMELT_DTYPE_F32, {129}},
};

/* The k-th case of a width: the optional parts and layouts vary with k. */
static nprob make_prob(const width_set *ws, int64_t C, smelt_norm_kind kind, int k) {
  nprob p = {ws->dt, ws->wdt, kind, {2, 3}, C, 0, 0, 0, 0, 0, 0, 1, 0};
  if (C <= 300) p.lead[0] = 5, p.lead[1] = 7;
  p.residual = k % 2 == 0;
  p.h_out = p.residual && k % 4 != 2;
  p.weight = k % 5 != 4;
  p.bias = k % 3 != 0;
  p.pad = k % 3 == 1 ? 3 : 0;
  p.off = k % 4 == 3 ? 1 : 0;
  p.stats_step = k % 2 ? 2 : 1;
  return p;
}

/* Every width of the table, both kinds, on every backend. */
static void for_each_width(void (*run_case)(smelt_ctx *, const nprob *)) {
  FOR_EACH_BACKEND(ctx) {
    int k = 0;
    for (size_t s = 0; s < sizeof widths / sizeof *widths; s++)
      for (int c = 0; c < 10 && widths[s].C[c]; c++)
        for (int kind = 0; kind < 2; kind++, k++) {
          const nprob p = make_prob(&widths[s], widths[s].C[c], (smelt_norm_kind)kind, k);
          run_case(ctx, &p);
        }
  }
}

static void test_fwd_values(void) { for_each_width(fwd_case); }

/* A NaN makes its row NaN (y and the statistics); +inf makes a LayerNorm
 * row NaN and gives an RMSNorm row rstd 0 (y = bias, NaN at the inf). */
static void test_fwd_nan_inf(void) {
  FOR_EACH_BACKEND(ctx) {
    for (int k = 0; k < 4; k++) {
      const width_set *ws = &widths[k % 2 ? 0 : 2];
      nprob p = make_prob(ws, k < 2 ? 1000 : 9000, (smelt_norm_kind)(k % 2), k);
      p.specials = 1;
      fwd_case(ctx, &p);
    }
  }
}

/* More rows than the GPU's fixed grid has groups (up to 8 CTAs of 128
 * threads per SM), so every group walks several rows and fetches each next
 * one ahead: warp groups (C 100) and whole-CTA groups (C 4096). */
static void test_fwd_many_rows(void) {
  FOR_EACH_BACKEND(ctx) {
    for (int c = 0; c < 2; c++) {
      nprob p = make_prob(&widths[c ? 0 : 2], c ? 4096 : 100, (smelt_norm_kind)c, 0);
      p.lead[0] = c ? 20 : 50, p.lead[1] = c ? 30 : 100;
      p.residual = p.h_out = p.weight = p.bias = 1;
      fwd_case(ctx, &p);
    }
  }
}

/* y over x and h_out over the residual: the fused form in place, with
 * many rows per group on the GPU (the next row is fetched while this one
 * is written). */
static void test_fwd_in_place(void) {
  FOR_EACH_BACKEND(ctx) {
    for (int c = 0; c < 3; c++) {
      const int64_t C = c == 0 ? 96 : c == 1 ? 3000 : 9000, lead[2] = {c == 0 ? 50 : c == 1 ? 20 : 2, c == 0 ? 100 : c == 1 ? 30 : 3};
      const int64_t rows = lead[0] * lead[1], n = rows * C;
      const smelt_dtype dt = SMELT_DTYPE_BF16;
      const th_view rv = rows_view(lead, C, 0, 0);
      tb x = tb_new(ctx, rv, dt, 1, -1.0, 1.0), res = tb_new(ctx, rv, dt, 1, -1.0, 1.0);
      tb w = tb_new(ctx, vec_view(C), dt, 1, 0.5, 1.5);
      const smelt_norm_desc desc = {SMELT_NORM_RMS, 1e-6f};
      CHECK_OK(smelt_norm(ctx, &desc, &x.t, &res.t, &w.t, NULL, &x.t, &res.t, NULL, NULL));
      double *hr = (double *)malloc((size_t)n * sizeof(double)), *ref = (double *)malloc((size_t)n * sizeof(double));
      double *got = (double *)malloc((size_t)n * sizeof(double)), *wv = vec_values(&w, 1, C), m, r;
      for (int64_t i = 0; i < n; i++) hr[i] = round_to(dt, tb_get(&x, i) + tb_get(&res, i));
      for (int64_t row = 0; row < rows; row++) ref_norm_row(SMELT_NORM_RMS, 1e-6, hr + row * C, wv, NULL, C, ref + row * C, &m, &r);
      uint8_t *host = (uint8_t *)malloc((size_t)n * 2);
      th_buf_download(&x.b, host, (size_t)n * 2);
      for (int64_t i = 0; i < n; i++) got[i] = th_get(host, dt, i);
      char what[64];
      snprintf(what, sizeof what, "norm in place %s C=%lld", backend_name(ctx), (long long)C);
      if (!th_compare(what, got, ref, n, bound("norm", dt, 0), ABS_BOUND)) th_fail(__FILE__, __LINE__, "%s: y", what);
      th_buf_download(&res.b, host, (size_t)n * 2);
      for (int64_t i = 0; i < n; i++) got[i] = th_get(host, dt, i);
      if (!th_compare(what, got, hr, n, 0, 0)) th_fail(__FILE__, __LINE__, "%s: h_out", what);
      CHECK(th_buf_guards_ok(&x.b) && th_buf_guards_ok(&res.b));
      free(hr), free(ref), free(got), free(wv), free(host);
      tb_free(&x), tb_free(&res), tb_free(&w);
    }
  }
}

/* ---- backward */

/* The backward of one row in double from the f32 statistics given. */
static void ref_bwd_row(smelt_norm_kind kind, const double *dy, const double *x, const double *w, double mean,
                        double rstd, const double *dh, int64_t C, double *dx, double *dw, double *db) {
  double sg = 0, sgx = 0;
  for (int64_t j = 0; j < C; j++) {
    const double g = dy[j] * (w ? w[j] : 1.0), xh = (x[j] - mean) * rstd;
    sg += g;
    sgx += g * xh;
  }
  const double mg = kind == SMELT_NORM_LAYER ? sg / (double)C : 0.0, mgx = sgx / (double)C;
  for (int64_t j = 0; j < C; j++) {
    const double g = dy[j] * (w ? w[j] : 1.0), xh = (x[j] - mean) * rstd;
    dx[j] = rstd * (g - mg - xh * mgx) + (dh ? dh[j] : 0.0);
    dw[j] += dy[j] * xh;
    db[j] += dy[j];
  }
}

/* The f32 statistics of x's rows (what a forward hands the backward). */
static void stats_of(const nprob *p, const tb *x, tb *mean, tb *rstd) {
  const int64_t C = p->C, rows = p->lead[0] * p->lead[1];
  float *m = (float *)malloc((size_t)mean->v.storage * 4), *r = (float *)malloc((size_t)rstd->v.storage * 4);
  double *h = (double *)malloc((size_t)C * sizeof(double)), *y = (double *)malloc((size_t)C * sizeof(double));
  for (int64_t row = 0; row < rows; row++) {
    double dm, dr;
    for (int64_t j = 0; j < C; j++) h[j] = tb_get(x, row * C + j);
    ref_norm_row(p->kind, 1e-5, h, NULL, NULL, C, y, &dm, &dr);
    m[th_view_off(&mean->v, row)] = (float)dm;
    r[th_view_off(&rstd->v, row)] = (float)dr;
  }
  th_buf_upload(&mean->b, m, (size_t)mean->v.storage * 4);
  th_buf_upload(&rstd->b, r, (size_t)rstd->v.storage * 4);
  mean->host = (uint8_t *)m;
  rstd->host = (uint8_t *)r;
  free(h), free(y);
}

/* One backward; dw_out (C floats, may be NULL) receives dweight's values. */
static void bwd_case(smelt_ctx *ctx, const nprob *p, double *dw_out) {
  const int64_t C = p->C, rows = p->lead[0] * p->lead[1], n = rows * C;
  char what[240];
  prob_text(ctx, p, "norm_bwd", what, sizeof what);
  const th_view rv = rows_view(p->lead, C, p->pad, p->off), sv = stats_view(p->lead, p->stats_step);
  const int layer = p->kind == SMELT_NORM_LAYER;
  tb dy = tb_new(ctx, rv, p->dt, 1, -1.0, 1.0), x = tb_new(ctx, rv, p->dt, 1, -1.0, 3.0);
  tb dh = tb_new(ctx, rv, p->dt, 1, -1.0, 1.0), w = tb_new(ctx, vec_view(C), p->wdt, 1, 0.5, 1.5);
  tb mean = tb_new(ctx, sv, SMELT_DTYPE_F32, 0, 0, 0), rstd = tb_new(ctx, sv, SMELT_DTYPE_F32, 0, 0, 0);
  tb dx = tb_new(ctx, rv, p->dt, 0, 0, 0), dw = tb_new(ctx, vec_view(C), p->wdt, 0, 0, 0);
  tb db = tb_new(ctx, vec_view(C), p->wdt, 0, 0, 0);
  stats_of(p, &x, &mean, &rstd);
  const smelt_norm_desc desc = {p->kind, 1e-5f};
  /* h_out stands for "dh given" here: the residual form's backward. */
  CHECK_OK(smelt_norm_bwd(ctx, &desc, &dy.t, &x.t, p->weight ? &w.t : NULL, layer ? &mean.t : NULL, &rstd.t,
                          p->h_out ? &dh.t : NULL, &dx.t, p->weight ? &dw.t : NULL, p->bias ? &db.t : NULL));
  double *ref = (double *)malloc((size_t)(n + 1) * sizeof(double)), *got = (double *)malloc((size_t)(n + C + 1) * sizeof(double));
  double *dwr = (double *)calloc((size_t)C, sizeof(double)), *dbr = (double *)calloc((size_t)C, sizeof(double));
  double *a = (double *)malloc((size_t)C * 3 * sizeof(double)), *wv = vec_values(&w, p->weight, C);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t j = 0; j < C; j++) {
      a[j] = tb_get(&dy, r * C + j);
      a[C + j] = tb_get(&x, r * C + j);
      a[2 * C + j] = tb_get(&dh, r * C + j);
    }
    const double m = layer ? th_get(mean.host, SMELT_DTYPE_F32, th_view_off(&mean.v, r)) : 0.0;
    const double s = th_get(rstd.host, SMELT_DTYPE_F32, th_view_off(&rstd.v, r));
    ref_bwd_row(p->kind, a, a + C, wv, m, s, p->h_out ? a + 2 * C : NULL, C, ref + r * C, dwr, dbr);
  }
  th_check_output(what, "dx", &dx.v, &dx.b, p->dt, got);
  if (!th_compare(what, got, ref, n, bound("norm_bwd", p->dt, 0), ABS_BOUND)) th_fail(__FILE__, __LINE__, "%s: dx", what);
  if (p->weight) {
    th_check_output(what, "dweight", &dw.v, &dw.b, p->wdt, got);
    if (!th_compare(what, got, dwr, C, bound("norm_bwd", p->wdt, 0), ABS_BOUND))
      th_fail(__FILE__, __LINE__, "%s: dweight", what);
    if (dw_out) memcpy(dw_out, got, (size_t)C * sizeof(double));
  }
  if (p->bias) {
    th_check_output(what, "dbias", &db.v, &db.b, p->wdt, got);
    if (!th_compare(what, got, dbr, C, bound("norm_bwd", p->wdt, 0), ABS_BOUND))
      th_fail(__FILE__, __LINE__, "%s: dbias", what);
  }
  free(ref), free(got), free(dwr), free(dbr), free(a), free(wv);
  tb *all[] = {&dy, &x, &dh, &w, &mean, &rstd, &dx, &dw, &db};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) tb_free(all[i]);
}

static void bwd_values_case(smelt_ctx *ctx, const nprob *p) { bwd_case(ctx, p, NULL); }

static void test_bwd_values(void) { for_each_width(bwd_values_case); }

/* Many rows over a fixed grid: every CTA has several rows and the
 * partial sums many rows; the same inputs give the same bits twice. */
static void test_bwd_repeatable(void) {
  smelt_ctx *ctx = th_cuda();
  if (!ctx) SKIP("no CUDA device");
  for (int c = 0; c < 2; c++) {
    const width_set ws = {SMELT_DTYPE_BF16, SMELT_DTYPE_F32, {0}};
    nprob p = make_prob(&ws, c ? 4096 : 200, SMELT_NORM_LAYER, 1);
    p.lead[0] = c ? 64 : 40, p.lead[1] = c ? 48 : 100;
    p.weight = p.bias = 1;
    p.pad = c ? 0 : 3; /* the element-wise entry point, then the vector one */
    const uint64_t seed = th_seed;
    double *a = (double *)malloc((size_t)p.C * sizeof(double)), *b = (double *)malloc((size_t)p.C * sizeof(double));
    bwd_case(ctx, &p, a);
    th_seed_set(seed); /* the same inputs again */
    bwd_case(ctx, &p, b);
    th_seed_set(seed + 1); /* fresh inputs for the next width */
    CHECK(memcmp(a, b, (size_t)p.C * sizeof(double)) == 0);
    free(a), free(b);
  }
}

/* ---- gradient check: the CPU backward against central differences of
 * the forward in double, L = sum(dy * y), in f32 so that the backward's
 * own rounding stays below the differences' error. */

typedef struct gc_problem {
  smelt_norm_kind kind;
  int64_t rows, C;
  double *x, *w, *b, *dy;
} gc_problem;

static double gc_loss(const gc_problem *g) {
  double L = 0, m, r;
  double *y = (double *)malloc((size_t)g->C * sizeof(double));
  for (int64_t row = 0; row < g->rows; row++) {
    ref_norm_row(g->kind, 1e-5, g->x + row * g->C, g->w, g->b, g->C, y, &m, &r);
    for (int64_t j = 0; j < g->C; j++) L += g->dy[row * g->C + j] * y[j];
  }
  free(y);
  return L;
}

/* dL/dv[i] by central differences, v one of g's arrays. */
static double gc_diff(gc_problem *g, double *v, int64_t i) {
  const double h = 1e-5, keep = v[i];
  v[i] = keep + h;
  const double up = gc_loss(g);
  v[i] = keep - h;
  const double down = gc_loss(g);
  v[i] = keep;
  return (up - down) / (2 * h);
}

static void gc_case(smelt_norm_kind kind, int64_t rows, int64_t C) {
  smelt_ctx *ctx = th_cpu();
  const int64_t lead[2] = {1, rows}, n = rows * C;
  const th_view rv = rows_view(lead, C, 0, 0), sv = stats_view(lead, 1);
  const smelt_dtype f = SMELT_DTYPE_F32;
  tb x = tb_new(ctx, rv, f, 1, -1, 2), dy = tb_new(ctx, rv, f, 1, -1, 1);
  tb w = tb_new(ctx, vec_view(C), f, 1, 0.5, 1.5), b = tb_new(ctx, vec_view(C), f, 1, -0.5, 0.5);
  tb y = tb_new(ctx, rv, f, 0, 0, 0), mean = tb_new(ctx, sv, f, 0, 0, 0), rstd = tb_new(ctx, sv, f, 0, 0, 0);
  tb dx = tb_new(ctx, rv, f, 0, 0, 0), dw = tb_new(ctx, vec_view(C), f, 0, 0, 0), db = tb_new(ctx, vec_view(C), f, 0, 0, 0);
  const smelt_norm_desc desc = {kind, 1e-5f};
  const int layer = kind == SMELT_NORM_LAYER;
  CHECK_OK(smelt_norm(ctx, &desc, &x.t, NULL, &w.t, &b.t, &y.t, NULL, layer ? &mean.t : NULL, &rstd.t));
  CHECK_OK(smelt_norm_bwd(ctx, &desc, &dy.t, &x.t, &w.t, layer ? &mean.t : NULL, &rstd.t, NULL, &dx.t, &dw.t, &db.t));
  gc_problem g = {kind, rows, C, NULL, NULL, NULL, NULL};
  g.x = (double *)malloc((size_t)n * sizeof(double)), g.dy = (double *)malloc((size_t)n * sizeof(double));
  g.w = vec_values(&w, 1, C), g.b = vec_values(&b, 1, C);
  for (int64_t i = 0; i < n; i++) g.x[i] = tb_get(&x, i), g.dy[i] = tb_get(&dy, i);
  double *got = (double *)malloc((size_t)n * sizeof(double)), *num = (double *)malloc((size_t)n * sizeof(double));
  char what[96];
  snprintf(what, sizeof what, "norm gradient check %s [%lld, %lld]", smelt_norm_kind_name(kind), (long long)rows,
           (long long)C);
  th_check_output(what, "dx", &dx.v, &dx.b, f, got);
  for (int64_t i = 0; i < n; i++) num[i] = gc_diff(&g, g.x, i);
  if (!th_compare(what, got, num, n, 1e-5, 1e-6)) th_fail(__FILE__, __LINE__, "%s: dx", what);
  th_check_output(what, "dweight", &dw.v, &dw.b, f, got);
  for (int64_t j = 0; j < C; j++) num[j] = gc_diff(&g, g.w, j);
  if (!th_compare(what, got, num, C, 1e-5, 1e-6)) th_fail(__FILE__, __LINE__, "%s: dweight", what);
  th_check_output(what, "dbias", &db.v, &db.b, f, got);
  for (int64_t j = 0; j < C; j++) num[j] = gc_diff(&g, g.b, j);
  if (!th_compare(what, got, num, C, 1e-5, 1e-6)) th_fail(__FILE__, __LINE__, "%s: dbias", what);
  free(got), free(num), free(g.x), free(g.dy), free(g.w), free(g.b);
  tb *all[] = {&x, &dy, &w, &b, &y, &mean, &rstd, &dx, &dw, &db};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) tb_free(all[i]);
}

static void test_gradient_check(void) {
  for (int kind = 0; kind < 2; kind++) {
    gc_case((smelt_norm_kind)kind, 3, 5);
    gc_case((smelt_norm_kind)kind, 2, 33);
  }
}

/* ---- bad inputs */

typedef struct bad_env {
  tb x, res, w, b, y, h, mean, rstd, w16;
} bad_env;

static bad_env bad_new(smelt_ctx *ctx) {
  const int64_t lead[2] = {1, 3};
  bad_env e;
  const th_view rv = rows_view(lead, 8, 0, 0), sv = stats_view(lead, 1);
  e.x = tb_new(ctx, rv, SMELT_DTYPE_BF16, 1, -1, 1);
  e.res = tb_new(ctx, rv, SMELT_DTYPE_BF16, 1, -1, 1);
  e.w = tb_new(ctx, vec_view(8), SMELT_DTYPE_BF16, 1, -1, 1);
  e.w16 = tb_new(ctx, vec_view(8), SMELT_DTYPE_F16, 1, -1, 1);
  e.b = tb_new(ctx, vec_view(8), SMELT_DTYPE_F32, 1, -1, 1);
  e.y = tb_new(ctx, rv, SMELT_DTYPE_BF16, 0, 0, 0);
  e.h = tb_new(ctx, rv, SMELT_DTYPE_BF16, 0, 0, 0);
  e.mean = tb_new(ctx, sv, SMELT_DTYPE_F32, 0, 0, 0);
  e.rstd = tb_new(ctx, sv, SMELT_DTYPE_F32, 0, 0, 0);
  return e;
}

static void bad_free(bad_env *e) {
  tb *all[] = {&e->x, &e->res, &e->w, &e->b, &e->y, &e->h, &e->mean, &e->rstd, &e->w16};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) tb_free(all[i]);
}

/* The call fails with `want`, its message has both substrings, and no output was written. */
#define REJECT(env, call, want, s1, s2)                                                  \
  do {                                                                                   \
    CHECK_STATUS(call, want);                                                            \
    CHECK_MSG(s1);                                                                       \
    CHECK_MSG(s2);                                                                       \
    CHECK(th_buf_untouched(&(env).y.b) && th_buf_untouched(&(env).h.b) &&                \
          th_buf_untouched(&(env).mean.b) && th_buf_untouched(&(env).rstd.b));           \
  } while (0)

/* No rows of a huge width (valid: no memory): the CPU backward's column
 * sums of 2 C doubles are refused as an overflow, not computed with a
 * wrapped 2 C (a fuzz finding: UBSan's signed overflow). */
static void test_bwd_empty_wide(void) {
  const int64_t C = INT64_MAX - 1, shape[2] = {0, C}, one[1] = {0};
  const smelt_tensor dy = smelt_tensor_make(NULL, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, shape),
                     st = smelt_tensor_make(NULL, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, one);
  const smelt_norm_desc rms = {SMELT_NORM_RMS, 1e-5f};
  const smelt_status s = smelt_norm_bwd(th_cpu(), &rms, &dy, &dy, NULL, NULL, &st, NULL, &dy, NULL, NULL);
  CHECK_EQ_INT(s, SMELT_STATUS_OVERFLOW);
  CHECK_MSG("column sums");
}

static void test_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    bad_env e = bad_new(ctx);
    const smelt_norm_desc rms = {SMELT_NORM_RMS, 1e-5f}, layer = {SMELT_NORM_LAYER, 1e-5f};
    smelt_norm_desc d = rms;
    smelt_plan *plan = (smelt_plan *)&e;
    REJECT(e, smelt_norm_plan(ctx, NULL, &e.x.t, NULL, NULL, NULL, &e.y.t, NULL, NULL, NULL, &plan),
           SMELT_STATUS_NULL_POINTER, "smelt_norm", "desc is NULL");
    CHECK(plan == NULL);
    d.kind = (smelt_norm_kind)7;
    REJECT(e, smelt_norm(ctx, &d, &e.x.t, NULL, NULL, NULL, &e.y.t, NULL, NULL, NULL), SMELT_STATUS_INVALID_ARGUMENT,
           "desc.kind=7", "rms");
    d = rms, d.eps = -1.f;
    REJECT(e, smelt_norm(ctx, &d, &e.x.t, NULL, NULL, NULL, &e.y.t, NULL, NULL, NULL), SMELT_STATUS_INVALID_ARGUMENT,
           "desc.eps", ">= 0");
    d.eps = NAN;
    REJECT(e, smelt_norm(ctx, &d, &e.x.t, NULL, NULL, NULL, &e.y.t, NULL, NULL, NULL), SMELT_STATUS_INVALID_ARGUMENT,
           "desc.eps", "finite");
    REJECT(e, smelt_norm(ctx, &rms, &e.x.t, NULL, NULL, NULL, NULL, NULL, NULL, NULL), SMELT_STATUS_NULL_POINTER,
           "y is NULL", "smelt_norm");
    smelt_tensor t = e.x.t;
    t.ndim = 0;
    REJECT(e, smelt_norm(ctx, &rms, &t, NULL, NULL, NULL, &t, NULL, NULL, NULL), SMELT_STATUS_SHAPE_MISMATCH,
           "x.ndim=0", ">= 1");
    t = e.x.t;
    t.strides[2] = 2, t.shape[2] = 4;
    smelt_tensor ty = e.y.t;
    ty.shape[2] = 4;
    REJECT(e, smelt_norm(ctx, &rms, &t, NULL, NULL, NULL, &ty, NULL, NULL, NULL), SMELT_STATUS_BAD_LAYOUT,
           "x.strides[-1]=2", "must be 1");
    ty = e.y.t;
    ty.shape[1] = 2;
    REJECT(e, smelt_norm(ctx, &rms, &e.x.t, NULL, NULL, NULL, &ty, NULL, NULL, NULL), SMELT_STATUS_SHAPE_MISMATCH,
           "y.shape=[1, 2, 8]", "x.shape=[1, 3, 8]");
    t = e.w.t;
    t.shape[0] = 7;
    REJECT(e, smelt_norm(ctx, &rms, &e.x.t, NULL, &t, NULL, &e.y.t, NULL, NULL, NULL), SMELT_STATUS_SHAPE_MISMATCH,
           "weight must be [C] = [8]", "shape[0]=7");
    REJECT(e, smelt_norm(ctx, &rms, &e.x.t, NULL, &e.w16.t, NULL, &e.y.t, NULL, NULL, NULL),
           SMELT_STATUS_DTYPE_MISMATCH, "weight.dtype=f16", "or f32");
    REJECT(e, smelt_norm(ctx, &rms, &e.x.t, NULL, &e.w.t, &e.b.t, &e.y.t, NULL, NULL, NULL),
           SMELT_STATUS_DTYPE_MISMATCH, "bias.dtype=f32", "weight.dtype=bf16");
    REJECT(e, smelt_norm(ctx, &rms, &e.x.t, NULL, NULL, NULL, &e.y.t, &e.h.t, NULL, NULL),
           SMELT_STATUS_INVALID_ARGUMENT, "h_out is given without residual", "x + residual");
    REJECT(e, smelt_norm(ctx, &rms, &e.x.t, NULL, NULL, NULL, &e.y.t, NULL, &e.mean.t, NULL),
           SMELT_STATUS_INVALID_ARGUMENT, "mean is given", "RMSNorm");
    t = e.rstd.t;
    t.shape[1] = 2;
    REJECT(e, smelt_norm(ctx, &layer, &e.x.t, NULL, NULL, NULL, &e.y.t, NULL, &e.mean.t, &t),
           SMELT_STATUS_SHAPE_MISMATCH, "rstd.shape=[1, 2]", "x.shape[:-1]=[1, 3]");
    t = e.x.t;
    t.data = (uint8_t *)e.x.t.data + 2;
    t.shape[1] = 2;
    ty = e.x.t;
    ty.shape[1] = 2;
    REJECT(e, smelt_norm(ctx, &rms, &ty, NULL, NULL, NULL, &t, NULL, NULL, NULL), SMELT_STATUS_INVALID_ARGUMENT,
           "y overlaps x", "in place");
    REJECT(e, smelt_norm(ctx, &rms, &e.x.t, &e.res.t, NULL, NULL, &e.y.t, &e.y.t, NULL, NULL),
           SMELT_STATUS_INVALID_ARGUMENT, "h_out overlaps", "y");
    t = e.res.t;
    t.dtype = SMELT_DTYPE_F16;
    REJECT(e, smelt_norm(ctx, &rms, &e.x.t, &t, NULL, NULL, &e.y.t, NULL, NULL, NULL), SMELT_STATUS_DTYPE_MISMATCH,
           "residual.dtype=f16", "x.dtype=bf16");
    /* Runs: a plan without the residual, a run with one; a foreign plan. */
    CHECK_OK(smelt_norm_plan(ctx, &rms, &e.x.t, NULL, NULL, NULL, &e.y.t, NULL, NULL, NULL, &plan));
    REQUIRE(plan);
    REJECT(e, smelt_norm_run(plan, &e.x.t, &e.res.t, NULL, NULL, &e.y.t, NULL, NULL, NULL),
           SMELT_STATUS_INVALID_ARGUMENT, "residual is given", "without");
    REJECT(e, smelt_norm_bwd_run(plan, &e.x.t, &e.x.t, NULL, NULL, &e.rstd.t, NULL, &e.y.t, NULL, NULL),
           SMELT_STATUS_INVALID_ARGUMENT, "smelt_norm_bwd", "not a norm backward plan");
    smelt_plan_destroy(plan);
    /* Backward. */
    REJECT(e, smelt_norm_bwd(ctx, &layer, &e.x.t, &e.res.t, NULL, NULL, &e.rstd.t, NULL, &e.y.t, NULL, NULL),
           SMELT_STATUS_NULL_POINTER, "mean is NULL", "LayerNorm");
    REJECT(e, smelt_norm_bwd(ctx, &rms, &e.x.t, &e.res.t, NULL, NULL, &e.rstd.t, NULL, &e.y.t, &e.h.t, NULL),
           SMELT_STATUS_INVALID_ARGUMENT, "dweight is given without weight", "smelt_norm_bwd");
    REJECT(e, smelt_norm_bwd(ctx, &rms, &e.x.t, &e.res.t, NULL, NULL, NULL, NULL, &e.y.t, NULL, NULL),
           SMELT_STATUS_NULL_POINTER, "rstd is NULL", "smelt_norm_bwd");
    REJECT(e, smelt_norm_bwd(ctx, &rms, &e.x.t, &e.res.t, &e.w.t, NULL, &e.rstd.t, NULL, &e.y.t, NULL, &e.b.t),
           SMELT_STATUS_DTYPE_MISMATCH, "dbias.dtype=f32", "weight.dtype=bf16");
    bad_free(&e);
  }
}

/* ---- residual add */

static void add_case(smelt_ctx *ctx, smelt_dtype dt, const int64_t *shape, int layout, int in_place) {
  /* layout 0: contiguous; 1: one element in (unaligned); 2: rows padded by 3 and y reversed. */
  const int64_t contig[2] = {shape[1], 1}, padded[2] = {shape[1] + 3, 1}, reversed[2] = {1, shape[0]};
  const th_view xv = th_view_make(2, shape, layout == 2 ? padded : contig, layout == 1);
  const th_view yv = th_view_make(2, shape, layout == 2 ? reversed : contig, 0);
  tb x = tb_new(ctx, xv, dt, 1, -2, 2), r = tb_new(ctx, in_place ? xv : yv, dt, 1, -2, 2);
  tb y = tb_new(ctx, yv, dt, 0, 0, 0);
  const int64_t n = shape[0] * shape[1];
  CHECK_OK(smelt_residual_add(ctx, &x.t, &r.t, in_place ? &r.t : &y.t));
  double *got = (double *)malloc((size_t)(n + 1) * sizeof(double)), *ref = (double *)malloc((size_t)(n + 1) * sizeof(double));
  for (int64_t i = 0; i < n; i++) ref[i] = round_to(dt, tb_get(&x, i) + tb_get(&r, i));
  char what[120];
  snprintf(what, sizeof what, "residual_add %s %s [%lld, %lld] layout %d%s", backend_name(ctx), smelt_dtype_name(dt),
           (long long)shape[0], (long long)shape[1], layout, in_place ? " in place" : "");
  if (in_place) {
    uint8_t *host = (uint8_t *)malloc((size_t)r.v.storage * smelt_dtype_size(dt));
    th_buf_download(&r.b, host, (size_t)r.v.storage * smelt_dtype_size(dt));
    for (int64_t i = 0; i < n; i++) got[i] = th_get(host, dt, r.v.offset + th_view_off(&r.v, i));
    free(host);
    CHECK(th_buf_guards_ok(&r.b));
  } else {
    th_check_output(what, "y", &y.v, &y.b, dt, got);
  }
  if (!th_compare(what, got, ref, n, 0, 0)) th_fail(__FILE__, __LINE__, "%s", what);
  free(got), free(ref);
  tb_free(&x), tb_free(&r), tb_free(&y);
}

static void test_residual_values(void) {
  static const int64_t shapes[][2] = {{1, 1}, {3, 7}, {5, 128}, {4, 1001}, {2, 4096}};
  static const smelt_dtype dts[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  FOR_EACH_BACKEND(ctx) {
    for (int d = 0; d < 3; d++)
      for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
        for (int layout = 0; layout < 3; layout++) add_case(ctx, dts[d], shapes[s], layout, layout == 0 && s % 2);
  }
}

static void test_residual_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    bad_env e = bad_new(ctx);
    REJECT(e, smelt_residual_add(ctx, &e.x.t, NULL, &e.y.t), SMELT_STATUS_NULL_POINTER, "residual is NULL",
           "smelt_residual_add");
    smelt_tensor t = e.res.t;
    t.shape[1] = 2;
    REJECT(e, smelt_residual_add(ctx, &e.x.t, &t, &e.y.t), SMELT_STATUS_SHAPE_MISMATCH, "residual.shape=[1, 2, 8]",
           "x.shape");
    REJECT(e, smelt_residual_add(ctx, &e.x.t, &e.res.t, &e.x.t), SMELT_STATUS_INVALID_ARGUMENT, "y overlaps x",
           "must not");
    t = e.y.t;
    t.dtype = SMELT_DTYPE_F32;
    REJECT(e, smelt_residual_add(ctx, &e.x.t, &e.res.t, &t), SMELT_STATUS_DTYPE_MISMATCH, "y.dtype=f32",
           "x.dtype=bf16");
    bad_free(&e);
  }
}

const th_test th_tests_norm[] = {
    {"fwd_values", test_fwd_values},
    {"fwd_nan_inf", test_fwd_nan_inf},
    {"fwd_many_rows", test_fwd_many_rows},
    {"fwd_in_place", test_fwd_in_place},
    {"bad_inputs", test_bad_inputs},
    {0, 0},
};

const th_test th_tests_norm_bwd[] = {
    {"values", test_bwd_values},
    {"repeatable", test_bwd_repeatable},
    {"gradient_check", test_gradient_check},
    {"empty_wide", test_bwd_empty_wide},
    {0, 0},
};

const th_test th_tests_residual[] = {
    {"values", test_residual_values},
    {"bad_inputs", test_residual_bad_inputs},
    {0, 0},
};
