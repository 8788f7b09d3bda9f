/* Op tests: activation, softmax and top-k on every backend (the CPU always,
 * CUDA when present) against a double-precision computation written here,
 * independent of the library's CPU reference. Each case draws fresh seeded
 * inputs, uses odd shapes and non-contiguous views (reversed, padded, strided,
 * broadcast inputs), poisons every output and checks that each element of the
 * view was written, that the gaps between elements and the guard regions were
 * not, and that NaN/Inf come out where the reference has them. Bad-input tests
 * cover every public entry point: the status, a message naming the tensor and
 * the constraint, and an output left untouched. */
#include "core/error_bound.h"
#include "harness.h"

#include <math.h>

static const smelt_dtype float_dts[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
#define NDT 3

/* Relative L2 error bounds per family and output (src/core/error_bound.c). */
static double bound(const char *family, smelt_dtype dt, int output) {
  const smelt__bound_query q = {.family = family, .dtype = dt, .output = output};
  return smelt__error_bound(&q);
}
/* An absolute bound for outputs near 0, where one element can carry all of
 * a small tensor's relative error (f16 subnormals are 6e-8 apart). */
#define ABS_BOUND 1e-7

static smelt_ctx *backend(int b) { return b == 0 ? th_cpu() : th_cuda(); }
static const char *backend_name(smelt_ctx *ctx) { return smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA ? "cuda" : "cpu"; }
#define FOR_EACH_BACKEND(ctx)          \
  for (int th_b = 0; th_b < 2; th_b++) \
    for (smelt_ctx *ctx = backend(th_b); ctx; ctx = NULL)

/* ---- views: a shape, a layout, strides and the storage they need */

enum { L_CONTIG, L_REVERSED, L_PADDED, L_STEP2, L_BCAST };
static const char *const layout_names[] = {"contig", "reversed", "padded", "step2", "bcast"};

typedef th_view view;

/* contig: row-major; reversed: column-major (the transpose of a row-major
 * buffer); padded: unit last stride, 3 spare elements per row and 1 per outer
 * step; step2: every other element along the last dim; bcast: row-major with
 * stride 0 on dim 0 (inputs only). */
static view make_view(int ndim, const int64_t *shape, int layout, int64_t offset) {
  int64_t strides[SMELT_MAX_DIMS], s = layout == L_STEP2 ? 2 : 1;
  if (layout == L_REVERSED) {
    for (int d = 0; d < ndim; d++) {
      strides[d] = s;
      s *= shape[d];
    }
  } else {
    for (int d = ndim - 1; d >= 0; d--) {
      strides[d] = s;
      s = s * shape[d] + (layout == L_PADDED ? (d == ndim - 1 ? 3 : 1) : layout == L_STEP2 ? 1 : 0);
    }
    if (layout == L_BCAST && ndim > 1) strides[0] = 0;
  }
  return th_view_make(ndim, shape, strides, offset);
}

/* Element offset (from the view's data) of row-major index i. */

static const char *shape_text(const view *v, char *buf, size_t n) {
  size_t used = (size_t)snprintf(buf, n, "[");
  for (int d = 0; d < v->ndim && used < n; d++)
    used += (size_t)snprintf(buf + used, n - used, "%s%lld", d ? ", " : "", (long long)v->shape[d]);
  if (used < n) snprintf(buf + used, n - used, "]");
  return buf;
}

/* Host storage for an input view: uniform values in [lo, hi), nonzero. */
static uint8_t *random_storage(const view *v, smelt_dtype dt, double lo, double hi) {
  uint8_t *h = (uint8_t *)malloc((size_t)v->storage * smelt_dtype_size(dt));
  th_fill_uniform(h, dt, v->storage, lo, hi);
  for (int64_t i = 0; i < v->storage; i++)
    if (th_get(h, dt, i) == 0) th_set(h, dt, i, hi / 2);
  return h;
}

static th_buf upload(smelt_ctx *ctx, const view *v, smelt_dtype dt, const void *host) {
  th_buf b = th_buf_new(ctx, (size_t)v->storage * smelt_dtype_size(dt));
  th_buf_upload(&b, host, (size_t)v->storage * smelt_dtype_size(dt));
  return b;
}

/* ---- activation */

static const int64_t act_shapes[][4] = {
    /* ndim, dims... */
    {1, 1}, {1, 7}, {1, 127}, {1, 1003}, {2, 3, 1}, {2, 5, 8193}, {3, 2, 3, 37},
};
/* (x layout, y layout, x offset, y offset): the offset of 1 element makes
 * the base pointers not 16-byte aligned (the GPU's scalar path). */
static const int act_layouts[][4] = {
    {L_CONTIG, L_CONTIG, 0, 0}, {L_CONTIG, L_CONTIG, 1, 0}, {L_REVERSED, L_PADDED, 0, 0},
    {L_PADDED, L_STEP2, 0, 1},  {L_BCAST, L_CONTIG, 0, 0},  {L_STEP2, L_REVERSED, 1, 1},
};

/* Sets a few elements of the view to NaN, +-inf and +-0. */
static void put_specials(uint8_t *host, const view *v, smelt_dtype dt) {
  static const double sp[] = {NAN, INFINITY, -INFINITY, 0.0, -0.0, 30.0, -30.0};
  for (size_t s = 0; s < sizeof sp / sizeof *sp && (int64_t)s < v->numel; s++) {
    int64_t i = (int64_t)(th_rand_u64() % (uint64_t)v->numel);
    th_set(host, dt, v->offset + th_view_off(v, i), sp[s]);
  }
}

static void act_case(smelt_ctx *ctx, smelt_dtype dt, smelt_act act, const int64_t *sh, const int *lay, int in_place,
                     int specials) {
  const int ndim = (int)sh[0];
  view xv = make_view(ndim, sh + 1, lay[0], lay[2]);
  view yv = in_place ? xv : make_view(ndim, sh + 1, lay[1], lay[3]);
  uint8_t *xh = random_storage(&xv, dt, -6, 6);
  if (specials) put_specials(xh, &xv, dt);
  th_buf xb = upload(ctx, &xv, dt, xh);
  th_buf yb = in_place ? xb : th_buf_new(ctx, (size_t)yv.storage * smelt_dtype_size(dt));
  smelt_tensor xt = th_view_tensor(&xv, &xb, dt), yt = th_view_tensor(&yv, &yb, dt);
  smelt_activation_desc desc = {act, 0.1f};
  char what[200], shp[64];
  snprintf(what, sizeof what, "activation %s %s %s %s x:%s%s y:%s", smelt_act_name(act), smelt_dtype_name(dt),
           backend_name(ctx), shape_text(&xv, shp, sizeof shp), layout_names[lay[0]], in_place ? " in place" : "",
           layout_names[in_place ? lay[0] : lay[1]]);
  smelt_status s = smelt_activation(ctx, &desc, &xt, &yt);
  if (s) th_fail(__FILE__, __LINE__, "%s: %s (%s)", what, smelt_status_name(s), smelt_last_error());
  double *got = (double *)malloc((size_t)xv.numel * sizeof *got);
  double *ref = (double *)malloc((size_t)xv.numel * sizeof *ref);
  for (int64_t i = 0; i < xv.numel; i++)
    ref[i] = smelt_act_apply(act, th_get(xh, dt, xv.offset + th_view_off(&xv, i)), desc.slope);
  if (in_place) {
    uint8_t *yh = (uint8_t *)malloc((size_t)xv.storage * smelt_dtype_size(dt));
    th_buf_download(&xb, yh, (size_t)xv.storage * smelt_dtype_size(dt));
    for (int64_t i = 0; i < xv.numel; i++) got[i] = th_get(yh, dt, xv.offset + th_view_off(&xv, i));
    CHECK(th_buf_guards_ok(&xb));
    free(yh);
  } else {
    th_check_output(what, "y", &yv, &yb, dt, got);
  }
  if (!th_compare(what, got, ref, xv.numel, bound("activation", dt, 0), ABS_BOUND))
    th_fail(__FILE__, __LINE__, "%s differs", what);
  free(got);
  free(ref);
  free(xh);
  if (!in_place) th_buf_free(&yb);
  th_buf_free(&xb);
}

static void test_activation_values(void) {
  FOR_EACH_BACKEND(ctx) {
    for (int d = 0; d < NDT; d++)
      for (int a = 0; a < SMELT_ACT_COUNT; a++)
        for (size_t s = 0; s < sizeof act_shapes / sizeof *act_shapes; s++)
          act_case(ctx, float_dts[d], (smelt_act)a, act_shapes[s],
                   act_layouts[(s + (size_t)a) % (sizeof act_layouts / sizeof *act_layouts)], 0, 0);
  }
}

static void test_activation_nan_inf(void) {
  static const int64_t sh[] = {2, 7, 149};
  FOR_EACH_BACKEND(ctx) {
    for (int d = 0; d < NDT; d++)
      for (int a = 0; a < SMELT_ACT_COUNT; a++) {
        act_case(ctx, float_dts[d], (smelt_act)a, sh, act_layouts[0], 0, 1);
        act_case(ctx, float_dts[d], (smelt_act)a, sh, act_layouts[3], 0, 1);
      }
  }
}

static void test_activation_in_place(void) {
  static const int64_t s1[] = {1, 1003}, s2[] = {2, 5, 8193};
  FOR_EACH_BACKEND(ctx) {
    for (int d = 0; d < NDT; d++) {
      act_case(ctx, float_dts[d], SMELT_ACT_GELU, s1, act_layouts[0], 1, 0);
      act_case(ctx, float_dts[d], SMELT_ACT_SILU, s1, act_layouts[1], 1, 0);
      act_case(ctx, float_dts[d], SMELT_ACT_LEAKY_RELU, s2, act_layouts[3], 1, 1);
    }
  }
}

/* One plan, several runs on other buffers of the same layout, aligned and not. */
static void test_activation_plan_reuse(void) {
  static const int64_t shape[] = {1003};
  const smelt_dtype dt = SMELT_DTYPE_BF16;
  FOR_EACH_BACKEND(ctx) {
    view v0 = make_view(1, shape, L_CONTIG, 0);
    uint8_t *h0 = random_storage(&v0, dt, -3, 3);
    th_buf x0 = upload(ctx, &v0, dt, h0), y0 = th_buf_new(ctx, (size_t)v0.storage * 2);
    smelt_tensor xt = th_view_tensor(&v0, &x0, dt), yt = th_view_tensor(&v0, &y0, dt);
    smelt_activation_desc desc = {SMELT_ACT_TANH, 0};
    smelt_plan *plan = NULL;
    CHECK_OK(smelt_activation_plan(ctx, &desc, &xt, &yt, &plan));
    REQUIRE(plan);
    CHECK(strstr(smelt_plan_describe(plan), "tanh") != NULL);
    for (int r = 0; r < 3; r++) {
      view v = make_view(1, shape, L_CONTIG, r); /* r = 1, 2: misaligned bases */
      uint8_t *h = random_storage(&v, dt, -3, 3);
      th_buf xb = upload(ctx, &v, dt, h), yb = th_buf_new(ctx, (size_t)v.storage * 2);
      smelt_tensor x = th_view_tensor(&v, &xb, dt), y = th_view_tensor(&v, &yb, dt);
      CHECK_OK(smelt_activation_run(plan, &x, &y));
      double got[1003], ref[1003];
      th_check_output("activation plan reuse", "y", &v, &yb, dt, got);
      for (int64_t i = 0; i < v.numel; i++) ref[i] = tanh(th_get(h, dt, v.offset + i));
      CHECK(th_compare("activation plan reuse", got, ref, v.numel, bound("activation", dt, 0), ABS_BOUND));
      free(h);
      th_buf_free(&xb);
      th_buf_free(&yb);
    }
    smelt_plan_destroy(plan);
    free(h0);
    th_buf_free(&x0);
    th_buf_free(&y0);
  }
}

/* ---- softmax */

/* The reference, written apart from the library's: a NaN or +inf anywhere
 * makes the row NaN; all -inf gives 0 and lse -inf; else the usual
 * max-subtracted form. */
static void ref_softmax_row(const double *x, int64_t C, double *y, double *lse) {
  int nan_row = 0;
  double m = -INFINITY;
  for (int64_t j = 0; j < C; j++) {
    if (isnan(x[j]) || x[j] == INFINITY)
      nan_row = 1;
    else if (x[j] > m)
      m = x[j];
  }
  if (nan_row || m == -INFINITY) {
    for (int64_t j = 0; j < C; j++) y[j] = nan_row ? NAN : 0.0;
    *lse = nan_row ? NAN : -INFINITY;
    return;
  }
  double s = 0;
  for (int64_t j = 0; j < C; j++) s += exp(x[j] - m);
  for (int64_t j = 0; j < C; j++) y[j] = exp(x[j] - m) / s;
  *lse = m + log(s);
}

/* Row specials: row 0 gets one NaN, row 1 is all -inf, row 2 gets some
 * -inf, row 3 one +inf. */
static void softmax_specials(uint8_t *h, const view *v, smelt_dtype dt) {
  const int64_t C = v->shape[v->ndim - 1], rows = v->numel / C;
  for (int64_t r = 0; r < rows && r < 4; r++)
    for (int64_t j = 0; j < C; j++) {
      int64_t at = v->offset + th_view_off(v, r * C + j);
      if (r == 1 || (r == 2 && j % 3 == 0)) th_set(h, dt, at, -INFINITY);
      if ((r == 0 || r == 3) && j == C / 2) th_set(h, dt, at, r == 0 ? NAN : INFINITY);
    }
}

static void softmax_case(smelt_ctx *ctx, smelt_dtype dt, int ndim, const int64_t *shape, int xl, int yl, int lse_layout,
                         int specials) {
  view xv = make_view(ndim, shape, xl, 0), yv = make_view(ndim, shape, yl, yl == L_CONTIG ? 0 : 1);
  view lv = make_view(ndim - 1, shape, lse_layout < 0 ? L_CONTIG : lse_layout, 0);
  const int64_t C = shape[ndim - 1], rows = xv.numel / C;
  uint8_t *xh = random_storage(&xv, dt, -8, 8);
  if (specials && xl != L_BCAST) softmax_specials(xh, &xv, dt);
  th_buf xb = upload(ctx, &xv, dt, xh);
  th_buf yb = th_buf_new(ctx, (size_t)yv.storage * smelt_dtype_size(dt));
  th_buf lb = th_buf_new(ctx, (size_t)lv.storage * 4);
  smelt_tensor xt = th_view_tensor(&xv, &xb, dt), yt = th_view_tensor(&yv, &yb, dt);
  smelt_tensor lt = th_view_tensor(&lv, &lb, SMELT_DTYPE_F32);
  char what[200], shp[64];
  snprintf(what, sizeof what, "softmax %s %s %s x:%s y:%s lse:%s", smelt_dtype_name(dt), backend_name(ctx),
           shape_text(&xv, shp, sizeof shp), layout_names[xl], layout_names[yl],
           lse_layout < 0 ? "none" : layout_names[lse_layout]);
  smelt_status s = smelt_softmax(ctx, &xt, &yt, lse_layout < 0 ? NULL : &lt);
  if (s) th_fail(__FILE__, __LINE__, "%s: %s (%s)", what, smelt_status_name(s), smelt_last_error());
  double *row = (double *)malloc((size_t)C * sizeof *row);
  double *ref = (double *)malloc((size_t)xv.numel * sizeof *ref);
  double *got = (double *)malloc((size_t)xv.numel * sizeof *got);
  double *lref = (double *)malloc((size_t)rows * sizeof *lref);
  double *lgot = (double *)malloc((size_t)rows * sizeof *lgot);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t j = 0; j < C; j++) row[j] = th_get(xh, dt, xv.offset + th_view_off(&xv, r * C + j));
    ref_softmax_row(row, C, ref + r * C, &lref[r]);
  }
  th_check_output(what, "y", &yv, &yb, dt, got);
  if (!th_compare(what, got, ref, xv.numel, bound("softmax", dt, 0), ABS_BOUND))
    th_fail(__FILE__, __LINE__, "%s: y differs", what);
  if (lse_layout >= 0) {
    th_check_output(what, "lse", &lv, &lb, SMELT_DTYPE_F32, lgot);
    if (!th_compare(what, lgot, lref, rows, bound("softmax", SMELT_DTYPE_F32, 1), 0))
      th_fail(__FILE__, __LINE__, "%s: lse differs", what);
  } else {
    uint8_t *lh = (uint8_t *)malloc((size_t)lv.storage * 4);
    th_buf_download(&lb, lh, (size_t)lv.storage * 4);
    CHECK(th_all_ff(lh, (size_t)lv.storage * 4));
    free(lh);
  }
  free(row);
  free(ref);
  free(got);
  free(lref);
  free(lgot);
  free(xh);
  th_buf_free(&xb);
  th_buf_free(&yb);
  th_buf_free(&lb);
}

/* Row lengths that reach each GPU variant: 8 or 16 lanes per row (up to 64,
 * 128), a warp (up to 256, 1024), a CTA (up to 2048 ... 16384) and the
 * looping kernel. */
static const int64_t softmax_shapes[][4] = {
    {1, 1},         {1, 7},       {2, 3, 1},    {2, 127, 33}, {2, 9, 100},  {2, 64, 256},  {2, 2, 1003},
    {3, 2, 3, 300}, {2, 3, 2000}, {2, 5, 4001}, {2, 3, 5000}, {2, 5, 8193}, {2, 2, 16384}, {2, 2, 20001},
};

static void test_softmax_values(void) {
  FOR_EACH_BACKEND(ctx) {
    for (int d = 0; d < NDT; d++)
      for (size_t s = 0; s < sizeof softmax_shapes / sizeof *softmax_shapes; s++) {
        const int64_t *sh = softmax_shapes[s];
        softmax_case(ctx, float_dts[d], (int)sh[0], sh + 1, L_CONTIG, L_CONTIG, L_CONTIG, 0);
        softmax_case(ctx, float_dts[d], (int)sh[0], sh + 1, L_PADDED, L_STEP2, -1, 0);
        softmax_case(ctx, float_dts[d], (int)sh[0], sh + 1, L_REVERSED, L_PADDED, L_STEP2, 0);
        softmax_case(ctx, float_dts[d], (int)sh[0], sh + 1, L_BCAST, L_REVERSED, L_REVERSED, 0);
      }
  }
}

static void test_softmax_nan_inf(void) {
  static const int64_t shapes[][3] = {{2, 6, 5}, {2, 5, 200}, {2, 4, 1500}, {2, 4, 17000}};
  FOR_EACH_BACKEND(ctx) {
    for (int d = 0; d < NDT; d++)
      for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        softmax_case(ctx, float_dts[d], (int)shapes[s][0], shapes[s] + 1, L_CONTIG, L_CONTIG, L_CONTIG, 1);
        softmax_case(ctx, float_dts[d], (int)shapes[s][0], shapes[s] + 1, L_STEP2, L_PADDED, L_STEP2, 1);
      }
  }
}

/* ---- top-k */

/* a ranks before b: NaN first, then larger values, then the lower index. */
static int ranks_before(double a, int64_t ia, double b, int64_t ib) {
  if (isnan(a) || isnan(b)) return isnan(a) && (!isnan(b) || ia < ib);
  return a > b || (a == b && ia < ib);
}

enum { TK_RANDOM, TK_TIES, TK_SPECIALS };

static void topk_case(smelt_ctx *ctx, smelt_dtype dt, int idx_dt, int ndim, const int64_t *shape, int64_t k, int xl,
                      int vl, int mode) {
  const int64_t C = shape[ndim - 1];
  int64_t oshape[SMELT_MAX_DIMS];
  memcpy(oshape, shape, (size_t)ndim * sizeof *oshape);
  oshape[ndim - 1] = k;
  view xv = make_view(ndim, shape, xl, 0), vv = make_view(ndim, oshape, vl, 1);
  view iv = make_view(ndim, oshape, vl == L_CONTIG ? L_PADDED : L_CONTIG, 0);
  const size_t es = smelt_dtype_size(dt);
  const smelt_dtype it = idx_dt < 0 ? SMELT_DTYPE_I64 : (smelt_dtype)idx_dt;
  uint8_t *xh = random_storage(&xv, dt, -100, 100);
  if (mode != TK_RANDOM) {
    static const double sp[] = {NAN, INFINITY, -INFINITY, 0.0, -0.0};
    for (int64_t i = 0; i < xv.storage; i++) {
      double v = (double)(int)(th_rand_u64() % 9) - 4; /* many ties */
      if (mode == TK_SPECIALS && th_rand_u64() % 4 == 0) v = sp[th_rand_u64() % 5];
      th_set(xh, dt, i, v);
    }
  }
  th_buf xb = upload(ctx, &xv, dt, xh);
  th_buf vb = th_buf_new(ctx, (size_t)vv.storage * es);
  th_buf ib = th_buf_new(ctx, (size_t)iv.storage * smelt_dtype_size(it));
  smelt_tensor xt = th_view_tensor(&xv, &xb, dt), vt = th_view_tensor(&vv, &vb, dt), itn = th_view_tensor(&iv, &ib, it);
  char what[200], shp[64];
  snprintf(what, sizeof what, "topk %s k=%lld %s %s x:%s values:%s indices:%s", smelt_dtype_name(dt), (long long)k,
           backend_name(ctx), shape_text(&xv, shp, sizeof shp), layout_names[xl], layout_names[vl],
           idx_dt < 0 ? "none" : smelt_dtype_name(it));
  smelt_status s = smelt_topk(ctx, k, &xt, &vt, idx_dt < 0 ? NULL : &itn);
  if (s) th_fail(__FILE__, __LINE__, "%s: %s (%s)", what, smelt_status_name(s), smelt_last_error());

  const int64_t rows = xv.numel / C, nout = rows * k;
  double *vgot = (double *)malloc((size_t)nout * sizeof *vgot), *igot = (double *)malloc((size_t)nout * sizeof *igot);
  uint8_t *vh = (uint8_t *)malloc((size_t)vv.storage * es);
  uint8_t *taken = (uint8_t *)malloc((size_t)C);
  th_check_output(what, "values", &vv, &vb, dt, vgot);
  if (idx_dt >= 0) th_check_output(what, "indices", &iv, &ib, it, igot);
  th_buf_download(&vb, vh, (size_t)vv.storage * es);
  int64_t bad = -1;
  for (int64_t r = 0; r < rows && bad < 0; r++) {
    /* Selection by repeated scans: the best element not yet taken. */
    memset(taken, 0, (size_t)C);
    for (int64_t j = 0; j < k && bad < 0; j++) {
      int64_t best = -1;
      for (int64_t c = 0; c < C; c++) {
        if (taken[c]) continue;
        double xc = th_get(xh, dt, th_view_off(&xv, r * C + c));
        if (best < 0 || ranks_before(xc, c, th_get(xh, dt, th_view_off(&xv, r * C + best)), best)) best = c;
      }
      taken[best] = 1;
      const uint8_t *want = xh + th_view_off(&xv, r * C + best) * (int64_t)es;
      const uint8_t *have = vh + (vv.offset + th_view_off(&vv, r * k + j)) * (int64_t)es;
      if (memcmp(want, have, es) || (idx_dt >= 0 && igot[r * k + j] != (double)best)) {
        bad = r * k + j;
        th_fail(__FILE__, __LINE__, "%s: row %lld slot %lld: got %g (index %g), want %g (index %lld)", what,
                (long long)r, (long long)j, vgot[bad], idx_dt >= 0 ? igot[bad] : -1.0,
                th_get(xh, dt, th_view_off(&xv, r * C + best)), (long long)best);
      }
    }
  }
  if (idx_dt < 0) {
    uint8_t *ih = (uint8_t *)malloc((size_t)iv.storage * 8);
    th_buf_download(&ib, ih, (size_t)iv.storage * 8);
    CHECK(th_all_ff(ih, (size_t)iv.storage * 8));
    free(ih);
  }
  free(vgot);
  free(igot);
  free(vh);
  free(taken);
  free(xh);
  th_buf_free(&xb);
  th_buf_free(&vb);
  th_buf_free(&ib);
}

static void test_topk_values(void) {
  /* ndim, dims..., k: MoE routers (E <= 256, k <= 8), PEER (1024, 16), long
   * rows (a CTA per row; k > 16 takes several passes), k == C, 3-D. */
  static const int64_t cases[][5] = {
      {1, 1, 1},       {1, 7, 3},          {2, 3, 1, 1},      {2, 33, 8, 2},   {2, 64, 256, 8},  {2, 9, 1024, 16},
      {2, 5, 8193, 5}, {2, 4, 1003, 1003}, {3, 2, 3, 50, 50}, {2, 3, 300, 17}, {2, 2, 2500, 37},
  };
  FOR_EACH_BACKEND(ctx) {
    for (int d = 0; d < NDT; d++)
      for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int64_t *cs = cases[c];
        const int nd = (int)cs[0];
        const int64_t k = cs[1 + nd];
        topk_case(ctx, float_dts[d], SMELT_DTYPE_I64, nd, cs + 1, k, L_CONTIG, L_CONTIG, TK_RANDOM);
        topk_case(ctx, float_dts[d], SMELT_DTYPE_I32, nd, cs + 1, k, L_REVERSED, L_STEP2, TK_TIES);
        topk_case(ctx, float_dts[d], -1, nd, cs + 1, k, L_PADDED, L_REVERSED, TK_RANDOM);
        topk_case(ctx, float_dts[d], SMELT_DTYPE_I32, nd, cs + 1, k, L_STEP2, L_PADDED, TK_SPECIALS);
      }
  }
}

static void test_topk_nan_inf_ties(void) {
  static const int64_t cases[][4] = {{2, 16, 40, 40}, {2, 8, 256, 8}, {2, 4, 700, 16}, {2, 3, 3000, 7}};
  FOR_EACH_BACKEND(ctx) {
    for (int d = 0; d < NDT; d++)
      for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        topk_case(ctx, float_dts[d], SMELT_DTYPE_I64, 2, cases[c] + 1, cases[c][3], L_CONTIG, L_CONTIG, TK_SPECIALS);
        topk_case(ctx, float_dts[d], SMELT_DTYPE_I32, 2, cases[c] + 1, cases[c][3], L_BCAST, L_STEP2, TK_TIES);
      }
  }
}

/* ---- empty tensors: plans succeed, runs write nothing */

static void test_ops_empty(void) {
  static const int64_t rows0[] = {0, 5}, rows0k[] = {0, 2}, cols0[] = {3, 0};
  FOR_EACH_BACKEND(ctx) {
    th_buf b = th_buf_new(ctx, 64);
    view v = make_view(2, rows0, L_CONTIG, 0), vk = make_view(2, rows0k, L_CONTIG, 0),
         vl = make_view(1, rows0, L_CONTIG, 0), vc = make_view(2, cols0, L_CONTIG, 0);
    smelt_tensor x = th_view_tensor(&v, &b, SMELT_DTYPE_F32), y = x, lse = th_view_tensor(&vl, &b, SMELT_DTYPE_F32);
    smelt_tensor vals = th_view_tensor(&vk, &b, SMELT_DTYPE_F32), idx = th_view_tensor(&vk, &b, SMELT_DTYPE_I32);
    smelt_tensor z = th_view_tensor(&vc, &b, SMELT_DTYPE_BF16);
    x.data = NULL; /* no elements, so no memory is needed */
    smelt_activation_desc desc = {SMELT_ACT_RELU, 0};
    CHECK_OK(smelt_activation(ctx, &desc, &x, &y));
    CHECK_OK(smelt_activation(ctx, &desc, &z, &z));
    CHECK_OK(smelt_softmax(ctx, &x, &y, &lse));
    CHECK_OK(smelt_topk(ctx, 2, &x, &vals, &idx));
    uint8_t h[64];
    th_buf_download(&b, h, sizeof h);
    CHECK(th_all_ff(h, sizeof h));
    CHECK(th_buf_guards_ok(&b));
    th_buf_free(&b);
  }
}

/* ---- bad inputs */

/* A small valid setup on one context: x [3, 5] f32 random, y/lse/values/
 * indices poisoned, in buffers that must stay untouched by failing calls. */
typedef struct bad_env {
  smelt_ctx *ctx;
  th_buf xb, yb, lb, vb, ib;
  smelt_tensor x, y, lse, vals, idx;
} bad_env;

static bad_env bad_env_new(smelt_ctx *ctx) {
  static const int64_t shape[] = {3, 5}, kshape[] = {3, 2};
  bad_env e;
  memset(&e, 0, sizeof e);
  e.ctx = ctx;
  view xv = make_view(2, shape, L_CONTIG, 0), lv = make_view(1, shape, L_CONTIG, 0),
       kv = make_view(2, kshape, L_CONTIG, 0);
  uint8_t *h = random_storage(&xv, SMELT_DTYPE_F32, -1, 1);
  e.xb = upload(ctx, &xv, SMELT_DTYPE_F32, h);
  free(h);
  e.yb = th_buf_new(ctx, (size_t)xv.storage * 4);
  e.lb = th_buf_new(ctx, (size_t)lv.storage * 4);
  e.vb = th_buf_new(ctx, (size_t)kv.storage * 4);
  e.ib = th_buf_new(ctx, (size_t)kv.storage * 8);
  e.x = th_view_tensor(&xv, &e.xb, SMELT_DTYPE_F32);
  e.y = th_view_tensor(&xv, &e.yb, SMELT_DTYPE_F32);
  e.lse = th_view_tensor(&lv, &e.lb, SMELT_DTYPE_F32);
  e.vals = th_view_tensor(&kv, &e.vb, SMELT_DTYPE_F32);
  e.idx = th_view_tensor(&kv, &e.ib, SMELT_DTYPE_I64);
  return e;
}

static int outputs_untouched(const bad_env *e) {
  return th_buf_untouched(&e->yb) && th_buf_untouched(&e->lb) && th_buf_untouched(&e->vb) && th_buf_untouched(&e->ib);
}

static void bad_env_free(bad_env *e) {
  th_buf_free(&e->xb);
  th_buf_free(&e->yb);
  th_buf_free(&e->lb);
  th_buf_free(&e->vb);
  th_buf_free(&e->ib);
}

/* Mutations of a valid tensor that every op must reject, with the status
 * and a fragment of the message. */
typedef struct mutation {
  const char *what, *msg;
  smelt_status want;
} mutation;

enum { M_NDIM9, M_NEG, M_OVERFLOW, M_MISALIGNED, M_NULLDATA, M_DTYPE, M_COUNT };
static const mutation mutations[M_COUNT] = {
    {"ndim 9", ".ndim=9", SMELT_STATUS_INVALID_ARGUMENT},
    {"negative size", ".shape[0]=-1", SMELT_STATUS_INVALID_ARGUMENT},
    {"2^62 x 4 elements", "2^63", SMELT_STATUS_OVERFLOW},
    {"f32 at an odd address", ".data", SMELT_STATUS_MISALIGNED},
    {"NULL data", ".data is NULL", SMELT_STATUS_NULL_POINTER},
    {"i32 dtype", "i32", SMELT_STATUS_DTYPE_MISMATCH},
};

static smelt_tensor mutate(smelt_tensor t, int m) {
  switch (m) {
    case M_NDIM9: t.ndim = 9; break;
    case M_NEG: t.shape[0] = -1; break;
    case M_OVERFLOW:
      t.ndim = 2;
      t.shape[0] = (int64_t)1 << 62;
      t.shape[1] = 4;
      t.strides[0] = 4;
      t.strides[1] = 1;
      break;
    case M_MISALIGNED: t.data = (uint8_t *)t.data + 1; break;
    case M_NULLDATA: t.data = NULL; break;
    case M_DTYPE: t.dtype = SMELT_DTYPE_I32; break;
  }
  return t;
}

/* The name of the mutated tensor, the status and the fragment in the message,
 * and nothing written. */
#define CHECK_REJECT(call, want, name, frag) \
  do {                                       \
    CHECK_STATUS(call, want);                \
    CHECK_MSG(name);                         \
    CHECK_MSG(frag);                         \
    CHECK(outputs_untouched(&e));            \
  } while (0)

static void test_activation_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    bad_env e = bad_env_new(ctx);
    smelt_activation_desc desc = {SMELT_ACT_GELU, 0.01f};
    smelt_plan *plan = (smelt_plan *)&e; /* must be reset to NULL on failure */
    CHECK_REJECT(smelt_activation_plan(NULL, &desc, &e.x, &e.y, &plan), SMELT_STATUS_NULL_POINTER, "smelt_activation",
                 "ctx is NULL");
    CHECK(plan == NULL);
    CHECK_REJECT(smelt_activation_plan(ctx, NULL, &e.x, &e.y, &plan), SMELT_STATUS_NULL_POINTER, "smelt_activation",
                 "desc is NULL");
    CHECK_REJECT(smelt_activation_plan(ctx, &desc, NULL, &e.y, &plan), SMELT_STATUS_NULL_POINTER, "x is NULL", "x");
    CHECK_REJECT(smelt_activation_plan(ctx, &desc, &e.x, NULL, &plan), SMELT_STATUS_NULL_POINTER, "y is NULL", "y");
    CHECK_REJECT(smelt_activation_plan(ctx, &desc, &e.x, &e.y, NULL), SMELT_STATUS_NULL_POINTER, "smelt_activation",
                 "out is NULL");
    CHECK_REJECT(smelt_activation(NULL, &desc, &e.x, &e.y), SMELT_STATUS_NULL_POINTER, "smelt_activation", "ctx");
    smelt_activation_desc bad = {(smelt_act)42, 0};
    CHECK_REJECT(smelt_activation(ctx, &bad, &e.x, &e.y), SMELT_STATUS_INVALID_ARGUMENT, "desc->act=42", "gelu_tanh");
    bad.act = SMELT_ACT_LEAKY_RELU;
    bad.slope = NAN;
    CHECK_REJECT(smelt_activation(ctx, &bad, &e.x, &e.y), SMELT_STATUS_INVALID_ARGUMENT, "desc->slope", "finite");
    for (int m = 0; m < M_COUNT; m++) {
      smelt_tensor bx = mutate(e.x, m), by = mutate(e.y, m);
      CHECK_REJECT(smelt_activation(ctx, &desc, &bx, &e.y), mutations[m].want, "x", mutations[m].msg);
      if (m == M_DTYPE) {
        CHECK_REJECT(smelt_activation(ctx, &desc, &e.x, &by), SMELT_STATUS_DTYPE_MISMATCH, "y.dtype=i32",
                     "x.dtype=f32");
      } else {
        CHECK_REJECT(smelt_activation(ctx, &desc, &e.x, &by), mutations[m].want, "y", mutations[m].msg);
      }
    }
    smelt_tensor y2 = e.y;
    y2.shape[1] = 4;
    CHECK_REJECT(smelt_activation(ctx, &desc, &e.x, &y2), SMELT_STATUS_SHAPE_MISMATCH, "y.shape=[3, 4]",
                 "x.shape=[3, 5]");
    y2 = e.x;
    y2.dtype = SMELT_DTYPE_F16;
    smelt_tensor x16 = y2;
    CHECK_REJECT(smelt_activation(ctx, &desc, &x16, &e.y), SMELT_STATUS_DTYPE_MISMATCH, "y.dtype=f32", "x.dtype=f16");
    /* y over x shifted by one element: overlapping but not in place. */
    y2 = e.x;
    y2.data = (uint8_t *)e.x.data + 4;
    y2.shape[0] = 2;
    smelt_tensor x2 = e.x;
    x2.shape[0] = 2;
    CHECK_REJECT(smelt_activation(ctx, &desc, &x2, &y2), SMELT_STATUS_INVALID_ARGUMENT, "y overlaps x", "in place");
    y2 = e.y;
    y2.strides[0] = 0;
    CHECK_REJECT(smelt_activation(ctx, &desc, &e.x, &y2), SMELT_STATUS_BAD_LAYOUT, "y.strides=[0, 1]", "distinct");
    if (th_cuda() && ctx == th_cuda()) {
      smelt_tensor host_x = e.x;
      host_x.device = SMELT_DEVICE_CPU;
      host_x.device_index = 0;
      CHECK_REJECT(smelt_activation(ctx, &desc, &host_x, &e.y), SMELT_STATUS_WRONG_DEVICE, "x is on cpu", "cuda");
    }
    /* Runs: a NULL or foreign plan, tensors that differ from the planned ones. */
    CHECK_REJECT(smelt_activation_run(NULL, &e.x, &e.y), SMELT_STATUS_NULL_POINTER, "smelt_activation", "plan");
    smelt_plan *sp = NULL;
    CHECK_OK(smelt_softmax_plan(ctx, &e.x, &e.y, NULL, &sp));
    CHECK_REJECT(smelt_activation_run(sp, &e.x, &e.y), SMELT_STATUS_INVALID_ARGUMENT, "smelt_activation",
                 "not an activation plan");
    smelt_plan_destroy(sp);
    CHECK_OK(smelt_activation_plan(ctx, &desc, &e.x, &e.y, &plan));
    REQUIRE(plan);
    CHECK_REJECT(smelt_activation_run(plan, NULL, &e.y), SMELT_STATUS_NULL_POINTER, "x is NULL", "x");
    CHECK_REJECT(smelt_activation_run(plan, &e.x, NULL), SMELT_STATUS_NULL_POINTER, "y is NULL", "y");
    y2 = e.y;
    y2.shape[1] = 4;
    CHECK_REJECT(smelt_activation_run(plan, &e.x, &y2), SMELT_STATUS_SHAPE_MISMATCH, "y.shape=[3, 4]", "planned");
    y2 = e.y;
    y2.strides[0] = 6;
    CHECK_REJECT(smelt_activation_run(plan, &e.x, &y2), SMELT_STATUS_BAD_LAYOUT, "y.strides[0]=6", "planned");
    x16 = e.x;
    x16.dtype = SMELT_DTYPE_BF16;
    CHECK_REJECT(smelt_activation_run(plan, &x16, &e.y), SMELT_STATUS_DTYPE_MISMATCH, "x.dtype=bf16", "planned");
    for (int m = M_MISALIGNED; m <= M_NULLDATA; m++) {
      smelt_tensor bx = mutate(e.x, m);
      CHECK_REJECT(smelt_activation_run(plan, &bx, &e.y), mutations[m].want, "x", mutations[m].msg);
    }
    smelt_plan_destroy(plan);
    bad_env_free(&e);
  }
}

static void test_softmax_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    bad_env e = bad_env_new(ctx);
    smelt_plan *plan = (smelt_plan *)&e;
    CHECK_REJECT(smelt_softmax_plan(NULL, &e.x, &e.y, &e.lse, &plan), SMELT_STATUS_NULL_POINTER, "smelt_softmax",
                 "ctx is NULL");
    CHECK(plan == NULL);
    CHECK_REJECT(smelt_softmax_plan(ctx, &e.x, &e.y, &e.lse, NULL), SMELT_STATUS_NULL_POINTER, "smelt_softmax",
                 "out is NULL");
    CHECK_REJECT(smelt_softmax(NULL, &e.x, &e.y, NULL), SMELT_STATUS_NULL_POINTER, "smelt_softmax", "ctx");
    CHECK_REJECT(smelt_softmax(ctx, NULL, &e.y, NULL), SMELT_STATUS_NULL_POINTER, "x is NULL", "x");
    CHECK_REJECT(smelt_softmax(ctx, &e.x, NULL, &e.lse), SMELT_STATUS_NULL_POINTER, "y is NULL", "y");
    for (int m = 0; m < M_COUNT; m++) {
      smelt_tensor bx = mutate(e.x, m), by = mutate(e.y, m), bl = mutate(e.lse, m);
      CHECK_REJECT(smelt_softmax(ctx, &bx, &e.y, &e.lse), mutations[m].want, "x", mutations[m].msg);
      if (m == M_DTYPE) {
        CHECK_REJECT(smelt_softmax(ctx, &e.x, &by, &e.lse), SMELT_STATUS_DTYPE_MISMATCH, "y.dtype=i32", "x.dtype");
        CHECK_REJECT(smelt_softmax(ctx, &e.x, &e.y, &bl), SMELT_STATUS_DTYPE_MISMATCH, "lse.dtype=i32", "f32");
      } else {
        CHECK_REJECT(smelt_softmax(ctx, &e.x, &by, &e.lse), mutations[m].want, "y", mutations[m].msg);
        CHECK_REJECT(smelt_softmax(ctx, &e.x, &e.y, &bl), mutations[m].want, "lse", mutations[m].msg);
      }
    }
    smelt_tensor t = e.lse;
    t.shape[0] = 5;
    CHECK_REJECT(smelt_softmax(ctx, &e.x, &e.y, &t), SMELT_STATUS_SHAPE_MISMATCH, "lse.shape=[5]", "x.shape[:-1]=[3]");
    t = e.y;
    t.shape[0] = 2;
    CHECK_REJECT(smelt_softmax(ctx, &e.x, &t, NULL), SMELT_STATUS_SHAPE_MISMATCH, "y.shape=[2, 5]", "x.shape=[3, 5]");
    t = e.x;
    t.ndim = 0;
    CHECK_REJECT(smelt_softmax(ctx, &t, &t, NULL), SMELT_STATUS_SHAPE_MISMATCH, "x.ndim=0", ">= 1");
    smelt_tensor x0 = e.x, y0 = e.y;
    x0.shape[1] = y0.shape[1] = 0;
    CHECK_REJECT(smelt_softmax(ctx, &x0, &y0, NULL), SMELT_STATUS_SHAPE_MISMATCH, "x.shape[-1]=0", ">= 1");
    t = e.x; /* y over x: in place is not offered */
    CHECK_REJECT(smelt_softmax(ctx, &e.x, &t, NULL), SMELT_STATUS_INVALID_ARGUMENT, "y overlaps x", "must not");
    t = e.lse;
    t.data = e.y.data;
    CHECK_REJECT(smelt_softmax(ctx, &e.x, &e.y, &t), SMELT_STATUS_INVALID_ARGUMENT, "lse overlaps y", "must not");
    t = e.lse;
    t.strides[0] = 0;
    CHECK_REJECT(smelt_softmax(ctx, &e.x, &e.y, &t), SMELT_STATUS_BAD_LAYOUT, "lse.strides=[0]", "distinct");
    if (th_cuda() && ctx == th_cuda()) {
      t = e.lse;
      t.device = SMELT_DEVICE_CPU;
      t.device_index = 0;
      CHECK_REJECT(smelt_softmax(ctx, &e.x, &e.y, &t), SMELT_STATUS_WRONG_DEVICE, "lse is on cpu", "cuda");
    }
    CHECK_REJECT(smelt_softmax_run(NULL, &e.x, &e.y, NULL), SMELT_STATUS_NULL_POINTER, "smelt_softmax", "plan");
    CHECK_OK(smelt_softmax_plan(ctx, &e.x, &e.y, &e.lse, &plan));
    REQUIRE(plan);
    CHECK_REJECT(smelt_softmax_run(plan, &e.x, &e.y, NULL), SMELT_STATUS_NULL_POINTER, "lse is NULL", "plan");
    CHECK_REJECT(smelt_activation_run(plan, &e.x, &e.y), SMELT_STATUS_INVALID_ARGUMENT, "smelt_activation",
                 "not an activation plan");
    t = e.lse;
    t.strides[0] = 2;
    CHECK_REJECT(smelt_softmax_run(plan, &e.x, &e.y, &t), SMELT_STATUS_BAD_LAYOUT, "lse.strides[0]=2", "planned");
    t = e.x;
    t.shape[0] = 2;
    CHECK_REJECT(smelt_softmax_run(plan, &t, &e.y, &e.lse), SMELT_STATUS_SHAPE_MISMATCH, "x.shape=[2, 5]", "planned");
    t = mutate(e.y, M_NULLDATA);
    CHECK_REJECT(smelt_softmax_run(plan, &e.x, &t, &e.lse), SMELT_STATUS_NULL_POINTER, "y.data", "NULL");
    smelt_plan_destroy(plan);
    CHECK_OK(smelt_softmax_plan(ctx, &e.x, &e.y, NULL, &plan));
    CHECK_REJECT(smelt_softmax_run(plan, &e.x, &e.y, &e.lse), SMELT_STATUS_INVALID_ARGUMENT, "lse", "without");
    smelt_plan_destroy(plan);
    bad_env_free(&e);
  }
}

static void test_topk_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    bad_env e = bad_env_new(ctx);
    smelt_plan *plan = (smelt_plan *)&e;
    CHECK_REJECT(smelt_topk_plan(NULL, 2, &e.x, &e.vals, &e.idx, &plan), SMELT_STATUS_NULL_POINTER, "smelt_topk",
                 "ctx is NULL");
    CHECK(plan == NULL);
    CHECK_REJECT(smelt_topk_plan(ctx, 2, &e.x, &e.vals, &e.idx, NULL), SMELT_STATUS_NULL_POINTER, "smelt_topk",
                 "out is NULL");
    CHECK_REJECT(smelt_topk(NULL, 2, &e.x, &e.vals, &e.idx), SMELT_STATUS_NULL_POINTER, "smelt_topk", "ctx");
    CHECK_REJECT(smelt_topk(ctx, 2, NULL, &e.vals, &e.idx), SMELT_STATUS_NULL_POINTER, "x is NULL", "x");
    CHECK_REJECT(smelt_topk(ctx, 2, &e.x, NULL, &e.idx), SMELT_STATUS_NULL_POINTER, "values is NULL", "values");
    CHECK_REJECT(smelt_topk(ctx, 0, &e.x, &e.vals, &e.idx), SMELT_STATUS_INVALID_ARGUMENT, "k=0", "[1, x.shape[-1]=5]");
    CHECK_REJECT(smelt_topk(ctx, 6, &e.x, &e.vals, &e.idx), SMELT_STATUS_INVALID_ARGUMENT, "k=6", "[1, x.shape[-1]=5]");
    CHECK_REJECT(smelt_topk(ctx, 3, &e.x, &e.vals, &e.idx), SMELT_STATUS_SHAPE_MISMATCH, "values.shape=[3, 2]",
                 "x.shape[:-1] + [k]=[3, 3]");
    for (int m = 0; m < M_COUNT; m++) {
      smelt_tensor bx = mutate(e.x, m), bv = mutate(e.vals, m), bi = mutate(e.idx, m);
      CHECK_REJECT(smelt_topk(ctx, 2, &bx, &e.vals, &e.idx), mutations[m].want, "x", mutations[m].msg);
      if (m == M_DTYPE) {
        CHECK_REJECT(smelt_topk(ctx, 2, &e.x, &bv, &e.idx), SMELT_STATUS_DTYPE_MISMATCH, "values.dtype=i32",
                     "x.dtype=f32");
      } else {
        CHECK_REJECT(smelt_topk(ctx, 2, &e.x, &bv, &e.idx), mutations[m].want, "values", mutations[m].msg);
        CHECK_REJECT(smelt_topk(ctx, 2, &e.x, &e.vals, &bi), mutations[m].want, "indices", mutations[m].msg);
      }
    }
    smelt_tensor t = e.idx;
    t.dtype = SMELT_DTYPE_F32;
    CHECK_REJECT(smelt_topk(ctx, 2, &e.x, &e.vals, &t), SMELT_STATUS_DTYPE_MISMATCH, "indices.dtype=f32", "i32, i64");
    t = e.idx;
    t.shape[1] = 3;
    CHECK_REJECT(smelt_topk(ctx, 2, &e.x, &e.vals, &t), SMELT_STATUS_SHAPE_MISMATCH, "indices.shape=[3, 3]", "[3, 2]");
    t = e.vals;
    t.data = e.x.data;
    CHECK_REJECT(smelt_topk(ctx, 2, &e.x, &t, &e.idx), SMELT_STATUS_INVALID_ARGUMENT, "values overlaps x", "must not");
    t = e.idx;
    t.dtype = SMELT_DTYPE_I32;
    t.data = e.vals.data;
    CHECK_REJECT(smelt_topk(ctx, 2, &e.x, &e.vals, &t), SMELT_STATUS_INVALID_ARGUMENT, "indices overlaps values",
                 "must not");
    t = e.vals;
    t.strides[1] = 0;
    CHECK_REJECT(smelt_topk(ctx, 2, &e.x, &t, NULL), SMELT_STATUS_BAD_LAYOUT, "values.strides=[2, 0]", "distinct");
    if (th_cuda() && ctx == th_cuda()) {
      t = e.idx;
      t.device = SMELT_DEVICE_CPU;
      t.device_index = 0;
      CHECK_REJECT(smelt_topk(ctx, 2, &e.x, &e.vals, &t), SMELT_STATUS_WRONG_DEVICE, "indices is on cpu", "cuda");
    }
    CHECK_REJECT(smelt_topk_run(NULL, &e.x, &e.vals, &e.idx), SMELT_STATUS_NULL_POINTER, "smelt_topk", "plan");
    CHECK_OK(smelt_topk_plan(ctx, 2, &e.x, &e.vals, &e.idx, &plan));
    REQUIRE(plan);
    CHECK_REJECT(smelt_topk_run(plan, &e.x, &e.vals, NULL), SMELT_STATUS_NULL_POINTER, "indices is NULL", "plan");
    CHECK_REJECT(smelt_softmax_run(plan, &e.x, &e.y, NULL), SMELT_STATUS_INVALID_ARGUMENT, "smelt_softmax",
                 "not a softmax plan");
    t = e.idx;
    t.dtype = SMELT_DTYPE_I32;
    CHECK_REJECT(smelt_topk_run(plan, &e.x, &e.vals, &t), SMELT_STATUS_DTYPE_MISMATCH, "indices.dtype=i32", "planned");
    t = e.vals;
    t.shape[1] = 1;
    CHECK_REJECT(smelt_topk_run(plan, &e.x, &t, &e.idx), SMELT_STATUS_SHAPE_MISMATCH, "values.shape=[3, 1]", "planned");
    t = mutate(e.x, M_MISALIGNED);
    CHECK_REJECT(smelt_topk_run(plan, &t, &e.vals, &e.idx), SMELT_STATUS_MISALIGNED, "x.data", "aligned");
    smelt_plan_destroy(plan);
    CHECK_OK(smelt_topk_plan(ctx, 2, &e.x, &e.vals, NULL, &plan));
    CHECK_REJECT(smelt_topk_run(plan, &e.x, &e.vals, &e.idx), SMELT_STATUS_INVALID_ARGUMENT, "indices", "without");
    smelt_plan_destroy(plan);
    bad_env_free(&e);
  }
}

/* ---- the activation table */

static void test_act_table(void) {
  for (int a = 0; a < SMELT_ACT_COUNT; a++) {
    smelt_act got = SMELT_ACT_COUNT;
    CHECK_OK(smelt_act_from_name(smelt_act_name((smelt_act)a), &got));
    CHECK_EQ_INT(got, a);
  }
  CHECK(!strcmp(smelt_act_name(SMELT_ACT_GELU_TANH), "gelu_tanh"));
  CHECK(!strcmp(smelt_act_name((smelt_act)99), "?"));
  smelt_act out;
  CHECK_STATUS(smelt_act_from_name("swish", &out), SMELT_STATUS_NOT_FOUND);
  CHECK_MSG("\"swish\"");
  CHECK_MSG("gelu_tanh");
  CHECK_STATUS(smelt_act_from_name(NULL, &out), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("name is NULL");
  CHECK_STATUS(smelt_act_from_name("relu", NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("out is NULL");
  /* Values from the definitions (computed independently, e.g. with mpmath). */
  static const struct {
    smelt_act a;
    double x, want;
  } v[] = {
      {SMELT_ACT_IDENTITY, -1.5, -1.5},
      {SMELT_ACT_RELU, -2.0, 0.0},
      {SMELT_ACT_RELU, 2.5, 2.5},
      {SMELT_ACT_LEAKY_RELU, -2.0, -0.2},
      {SMELT_ACT_TANH, 0.5, 0.46211715726000974},
      {SMELT_ACT_SIGMOID, 1.0, 0.7310585786300049},
      {SMELT_ACT_SILU, -1.0, -0.2689414213699951},
      {SMELT_ACT_HARDSWISH, 1.0, 0.6666666666666666},
      {SMELT_ACT_HARDSWISH, -4.0, 0.0},
      {SMELT_ACT_GELU, 1.0, 0.8413447460685429},
      {SMELT_ACT_GELU, -3.0, -0.004049694095523},
      {SMELT_ACT_GELU_TANH, 1.0, 0.8411919906082768},
  };
  for (size_t i = 0; i < sizeof v / sizeof *v; i++) {
    double got = smelt_act_apply(v[i].a, v[i].x, 0.1);
    if (fabs(got - v[i].want) > 1e-12 * (1 + fabs(v[i].want)))
      th_fail(__FILE__, __LINE__, "%s(%g) = %.17g, want %.17g", smelt_act_name(v[i].a), v[i].x, got, v[i].want);
  }
  CHECK(isnan(smelt_act_apply((smelt_act)99, 1.0, 0.1)));
  CHECK(isnan(smelt_act_apply(SMELT_ACT_GELU, NAN, 0.1)));
  CHECK(isnan(smelt_act_apply(SMELT_ACT_RELU, NAN, 0.1)));
  CHECK(smelt_act_apply(SMELT_ACT_SIGMOID, -INFINITY, 0.1) == 0.0);
  CHECK(smelt_act_apply(SMELT_ACT_GELU, INFINITY, 0.1) == INFINITY);
}

const th_test th_tests_activation[] = {
    {"act_table", test_act_table},
    {"values", test_activation_values},
    {"nan_inf", test_activation_nan_inf},
    {"in_place", test_activation_in_place},
    {"plan_reuse", test_activation_plan_reuse},
    {"bad_inputs", test_activation_bad_inputs},
    {"empty_all_ops", test_ops_empty},
    {0, 0},
};

const th_test th_tests_softmax[] = {
    {"values", test_softmax_values},
    {"nan_inf", test_softmax_nan_inf},
    {"bad_inputs", test_softmax_bad_inputs},
    {0, 0},
};

/* A broadcast row of 2^60 elements (stride 0) is a valid view, but the CPU
 * reference's sort scratch for it would be 2^64 bytes: refused as an
 * overflow with the output untouched (the size once wrapped to 0 bytes). */
static void test_topk_broadcast_row(void) {
  float one = 1.0f, out = -7.0f;
  int64_t xs[2] = {1, (int64_t)1 << 60}, vs[2] = {1, 1};
  smelt_tensor x = smelt_tensor_make(&one, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, xs);
  x.strides[0] = x.strides[1] = 0;
  smelt_tensor v = smelt_tensor_make(&out, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, vs);
  CHECK_STATUS(smelt_topk(th_cpu(), 1, &x, &v, NULL), SMELT_STATUS_OVERFLOW);
  CHECK_MSG("a row's scratch");
  CHECK(out == -7.0f);
}

const th_test th_tests_topk[] = {
    {"values", test_topk_values},
    {"nan_inf_ties", test_topk_nan_inf_ties},
    {"bad_inputs", test_topk_bad_inputs},
    {"broadcast_row", test_topk_broadcast_row},
    {0, 0},
};
