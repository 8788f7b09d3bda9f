/* Rotary tests: smelt_rotary on every backend (the CPU always, CUDA when
 * present) against a double-precision rotation written here, with the
 * bounds of src/core/error_bound.c. Cases cover both layouts, full and
 * partial rotary, both directions, positions absent / i32 / i64 (out of
 * range ones clamped), Q and K as views into a packed QKV buffer, odd head
 * sizes and unaligned pointers (the element-wise entry point), in place;
 * outputs are poisoned and checked element by element, gaps untouched.
 * The backward is checked as the adjoint of the forward (<dy, R x> =
 * <R⁻¹ dy, x>) and as its inverse (a round trip gives x back). */
#include "core/error_bound.h"
#include "harness.h"

#include <math.h>

static double bound(smelt_dtype dt) {
  const smelt__bound_query q = {.family = "rotary", .dtype = dt};
  return smelt__error_bound(&q);
}

static smelt_ctx *backend(int b) { return b == 0 ? th_cpu() : th_cuda(); }
static const char *backend_name(smelt_ctx *ctx) { return smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA ? "cuda" : "cpu"; }
#define FOR_EACH_BACKEND(ctx)          \
  for (int th_b = 0; th_b < 2; th_b++) \
    for (smelt_ctx *ctx = backend(th_b); ctx; ctx = NULL)

/* ---- buffers */

typedef struct rb {
  th_view v;
  th_buf b;
  smelt_tensor t;
  smelt_dtype dt;
  uint8_t *host; /* the whole storage */
} rb;

static rb rb_new(smelt_ctx *ctx, th_view v, smelt_dtype dt, const void *data) {
  rb r;
  r.v = v;
  r.dt = dt;
  const size_t bytes = (size_t)v.storage * smelt_dtype_size(dt);
  r.b = th_buf_new(ctx, bytes);
  r.host = (uint8_t *)malloc(bytes + 1);
  if (data) {
    memcpy(r.host, data, bytes);
    th_buf_upload(&r.b, r.host, bytes);
  }
  r.t = th_view_tensor(&r.v, &r.b, dt);
  return r;
}

static void rb_free(rb *r) {
  th_buf_free(&r->b);
  free(r->host);
}

/* Reads the buffer back into host (after a run). */
static void rb_download(rb *r) { th_buf_download(&r->b, r->host, (size_t)r->v.storage * smelt_dtype_size(r->dt)); }

static double rb_at(const rb *r, const int64_t *idx) {
  int64_t off = r->v.offset;
  for (int d = 0; d < r->v.ndim; d++) off += idx[d] * r->v.strides[d];
  return th_get(r->host, r->dt, off);
}

/* ---- the case */

typedef struct rprob {
  smelt_dtype dt;
  smelt_rotary_layout layout;
  int inverse;
  int64_t B, S, H, D, R, P;
  int positions; /* 0: none; 32 or 64: i32 or i64 positions, some out of range */
  int packed;    /* x a view of heads H..2H-1 in a [B, S, 3H, D] buffer */
  int off;       /* x and y one element in: unaligned */
  int in_place;
  int table_pad; /* spare floats per table row */
} rprob;

/* x: [B, S, H, D] over a buffer: contiguous, or the K part of packed QKV. */
static th_view x_view(const rprob *p) {
  const int64_t shape[4] = {p->B, p->S, p->H, p->D};
  const int64_t hh = p->packed ? 3 * p->H : p->H;
  const int64_t strides[4] = {p->S * hh * p->D, hh * p->D, p->D, 1};
  return th_view_make(4, shape, strides, p->off + (p->packed ? p->H * p->D : 0));
}

/* The table row of token (b, s). */
static int64_t ref_position(const rprob *p, const rb *pos, int64_t b, int64_t s) {
  if (!p->positions) return s;
  const int64_t idx[2] = {b, s};
  const int64_t v = (int64_t)rb_at(pos, idx);
  return v < 0 ? 0 : v >= p->P ? p->P - 1 : v;
}

/* The reference of element (b, s, h, j) in double. */
static double ref_elem(const rprob *p, const rb *x, const rb *c, const rb *sn, const rb *pos, const int64_t *idx) {
  const int64_t j = idx[3], half = p->R / 2;
  if (j >= p->R) return rb_at(x, idx);
  const int gptj = p->layout == SMELT_ROTARY_GPTJ;
  const int64_t i = gptj ? j / 2 : j % half, first = gptj ? j % 2 == 0 : j < half;
  const int64_t j1 = gptj ? 2 * i : i, j2 = gptj ? 2 * i + 1 : i + half;
  const int64_t t[2] = {ref_position(p, pos, idx[0], idx[1]), i};
  const double cv = rb_at(c, t), sv = (p->inverse ? -1.0 : 1.0) * rb_at(sn, t);
  int64_t a[4] = {idx[0], idx[1], idx[2], j1}, b[4] = {idx[0], idx[1], idx[2], j2};
  const double x1 = rb_at(x, a), x2 = rb_at(x, b);
  return first ? x1 * cv - x2 * sv : x2 * cv + x1 * sv;
}

/* Host tables from smelt_rotary_tables, laid out with table_pad spare floats per row. */
static void make_tables(smelt_ctx *ctx, const rprob *p, rb *c, rb *s) {
  const int64_t half = p->R / 2, shape[2] = {p->P, half}, strides[2] = {half + p->table_pad, 1};
  const th_view tv = th_view_make(2, shape, strides, 0);
  float *fc = (float *)calloc((size_t)(p->P * half + 1), 4), *fs = (float *)calloc((size_t)(p->P * half + 1), 4);
  float *pc = (float *)calloc((size_t)tv.storage, 4), *ps = (float *)calloc((size_t)tv.storage, 4);
  CHECK_OK(smelt_rotary_tables(10000.0, p->P, p->R, fc, fs));
  for (int64_t q = 0; q < p->P; q++)
    for (int64_t i = 0; i < half; i++) pc[q * strides[0] + i] = fc[q * half + i], ps[q * strides[0] + i] = fs[q * half + i];
  *c = rb_new(ctx, tv, SMELT_DTYPE_F32, pc);
  *s = rb_new(ctx, tv, SMELT_DTYPE_F32, ps);
  free(fc), free(fs), free(pc), free(ps);
}

static rb make_positions(smelt_ctx *ctx, const rprob *p) {
  const int64_t shape[2] = {p->B, p->S}, strides[2] = {p->S, 1};
  const smelt_dtype dt = p->positions == 64 ? SMELT_DTYPE_I64 : SMELT_DTYPE_I32;
  const th_view v = th_view_make(2, shape, strides, 0);
  uint8_t *h = (uint8_t *)malloc((size_t)v.storage * 8 + 8);
  for (int64_t i = 0; i < v.storage; i++) th_set(h, dt, i, (double)((int64_t)(th_rand_u64() % (uint64_t)(p->P + 4)) - 2));
  rb r = rb_new(ctx, v, dt, h);
  free(h);
  return r;
}

static void rot_case(smelt_ctx *ctx, const rprob *p) {
  char what[200];
  snprintf(what, sizeof what, "rotary %s %s %s%s [%lld, %lld, %lld, %lld] R=%lld pos %d%s%s%s", backend_name(ctx),
           smelt_rotary_layout_name(p->layout), smelt_dtype_name(p->dt), p->inverse ? " inverse" : "", (long long)p->B,
           (long long)p->S, (long long)p->H, (long long)p->D, (long long)p->R, p->positions, p->packed ? " packed" : "",
           p->off ? " unaligned" : "", p->in_place ? " in place" : "");
  const th_view xv = x_view(p);
  uint8_t *xh = (uint8_t *)malloc((size_t)xv.storage * 4 + 4);
  th_fill_uniform(xh, p->dt, xv.storage, -2, 2);
  rb x = rb_new(ctx, xv, p->dt, xh), y = rb_new(ctx, xv, p->dt, NULL), c, s, pos;
  make_tables(ctx, p, &c, &s);
  if (p->positions) pos = make_positions(ctx, p);
  const smelt_rotary_desc desc = {p->layout, p->inverse};
  CHECK_OK(smelt_rotary(ctx, &desc, &x.t, &c.t, &s.t, p->positions ? &pos.t : NULL, p->in_place ? &x.t : &y.t));
  const int64_t n = xv.numel;
  double *got = (double *)malloc((size_t)n * sizeof(double)), *ref = (double *)malloc((size_t)n * sizeof(double));
  memcpy(x.host, xh, (size_t)xv.storage * smelt_dtype_size(p->dt)); /* the input, for the reference */
  for (int64_t i = 0; i < n; i++) {
    int64_t idx[4], rest = i;
    for (int d = 3; d >= 0; d--) idx[d] = rest % xv.shape[d], rest /= xv.shape[d];
    ref[i] = ref_elem(p, &x, &c, &s, p->positions ? &pos : NULL, idx);
  }
  if (p->in_place) {
    rb_download(&x);
    for (int64_t i = 0; i < n; i++) got[i] = th_get(x.host, p->dt, xv.offset + th_view_off(&xv, i));
    CHECK(th_buf_guards_ok(&x.b));
  } else {
    th_check_output(what, "y", &y.v, &y.b, p->dt, got);
  }
  if (!th_compare(what, got, ref, n, bound(p->dt), 1e-6)) th_fail(__FILE__, __LINE__, "%s", what);
  free(xh), free(got), free(ref);
  rb_free(&x), rb_free(&y), rb_free(&c), rb_free(&s);
  if (p->positions) rb_free(&pos);
}

static void test_values(void) {
  static const smelt_dtype dts[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  /* D, R: full, partial, odd pairs (unit path), a short head. */
  static const int64_t dims[][2] = {{64, 64}, {128, 64}, {80, 32}, {6, 4}, {128, 128}, {96, 24}};
  FOR_EACH_BACKEND(ctx) {
    int k = 0;
    for (int d = 0; d < 3; d++)
      for (size_t g = 0; g < sizeof dims / sizeof *dims; g++)
        for (int layout = 0; layout < 2; layout++, k++) {
          rprob p = {dts[d], (smelt_rotary_layout)layout, k % 3 == 1, 2, 5, 3, dims[g][0], dims[g][1], 7,
                     k % 3 == 0 ? 0 : k % 3 == 1 ? 32 : 64, k % 4 == 1, k % 5 == 2, k % 4 == 3, k % 2};
          if (!p.positions) p.P = p.S + (k % 2);
          rot_case(ctx, &p);
        }
  }
}

/* The backward is the adjoint: <dy, R x> = <R⁻¹ dy, x> (f32, in double),
 * and R⁻¹ R x = x. */
static void test_adjoint_and_round_trip(void) {
  FOR_EACH_BACKEND(ctx) {
    for (int layout = 0; layout < 2; layout++) {
      const rprob p = {SMELT_DTYPE_F32, (smelt_rotary_layout)layout, 0, 2, 9, 4, 64, 48, 16, 32, 0, 0, 0, 0};
      const th_view xv = x_view(&p);
      const size_t bytes = (size_t)xv.storage * 4;
      float *a = (float *)malloc(bytes), *b = (float *)malloc(bytes);
      th_fill_uniform(a, SMELT_DTYPE_F32, xv.storage, -1, 1);
      th_fill_uniform(b, SMELT_DTYPE_F32, xv.storage, -1, 1);
      rb x = rb_new(ctx, xv, SMELT_DTYPE_F32, a), dy = rb_new(ctx, xv, SMELT_DTYPE_F32, b);
      rb rx = rb_new(ctx, xv, SMELT_DTYPE_F32, NULL), rdy = rb_new(ctx, xv, SMELT_DTYPE_F32, NULL);
      rb back = rb_new(ctx, xv, SMELT_DTYPE_F32, NULL), c, s, pos = make_positions(ctx, &p);
      make_tables(ctx, &p, &c, &s);
      const smelt_rotary_desc fwd = {(smelt_rotary_layout)layout, 0}, inv = {(smelt_rotary_layout)layout, 1};
      CHECK_OK(smelt_rotary(ctx, &fwd, &x.t, &c.t, &s.t, &pos.t, &rx.t));
      CHECK_OK(smelt_rotary(ctx, &inv, &dy.t, &c.t, &s.t, &pos.t, &rdy.t));
      CHECK_OK(smelt_rotary(ctx, &inv, &rx.t, &c.t, &s.t, &pos.t, &back.t));
      rb_download(&rx), rb_download(&rdy), rb_download(&back);
      double lhs = 0, rhs = 0, scale = 0;
      double *got = (double *)malloc((size_t)xv.numel * sizeof(double)), *ref = (double *)malloc((size_t)xv.numel * sizeof(double));
      for (int64_t i = 0; i < xv.numel; i++) {
        const int64_t o = th_view_off(&xv, i);
        lhs += (double)b[o] * th_get(rx.host, SMELT_DTYPE_F32, o);
        rhs += th_get(rdy.host, SMELT_DTYPE_F32, o) * (double)a[o];
        scale += fabs((double)a[o] * b[o]);
        got[i] = th_get(back.host, SMELT_DTYPE_F32, o);
        ref[i] = a[o];
      }
      if (!(fabs(lhs - rhs) <= 1e-6 * scale))
        th_fail(__FILE__, __LINE__, "rotary %s adjoint %s: <dy, Rx> = %.12g, <R^-1 dy, x> = %.12g", backend_name(ctx),
                smelt_rotary_layout_name(p.layout), lhs, rhs);
      if (!th_compare("rotary round trip", got, ref, xv.numel, 1e-6, 0)) th_fail(__FILE__, __LINE__, "round trip");
      free(a), free(b), free(got), free(ref);
      rb *all[] = {&x, &dy, &rx, &rdy, &back, &c, &s, &pos};
      for (size_t i = 0; i < sizeof all / sizeof *all; i++) rb_free(all[i]);
    }
  }
}

static void test_tables(void) {
  float c[3 * 4], s[3 * 4];
  CHECK_OK(smelt_rotary_tables(10000.0, 3, 8, c, s));
  for (int p = 0; p < 3; p++)
    for (int i = 0; i < 4; i++) {
      const double a = p * pow(10000.0, -2.0 * i / 8.0);
      CHECK(c[p * 4 + i] == (float)cos(a) && s[p * 4 + i] == (float)sin(a));
    }
  CHECK_STATUS(smelt_rotary_tables(10000.0, 3, 7, c, s), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("R=7");
  CHECK_STATUS(smelt_rotary_tables(0.0, 3, 8, c, s), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("theta=0");
  CHECK_STATUS(smelt_rotary_tables(10000.0, 3, 8, NULL, s), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("cos is NULL");
}

#define REJECT(out, call, want, s1, s2) \
  do {                                  \
    CHECK_STATUS(call, want);           \
    CHECK_MSG(s1);                      \
    CHECK_MSG(s2);                      \
    CHECK(th_buf_untouched(&(out).b));  \
  } while (0)

static void test_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    const rprob p = {SMELT_DTYPE_BF16, SMELT_ROTARY_NEOX, 0, 1, 4, 2, 16, 8, 4, 32, 0, 0, 0, 0};
    const th_view xv = x_view(&p);
    uint8_t *xh = (uint8_t *)calloc((size_t)xv.storage, 2);
    rb x = rb_new(ctx, xv, p.dt, xh), y = rb_new(ctx, xv, p.dt, NULL), c, s, pos = make_positions(ctx, &p);
    make_tables(ctx, &p, &c, &s);
    smelt_rotary_desc d = {SMELT_ROTARY_NEOX, 0};
    REJECT(y, smelt_rotary(ctx, NULL, &x.t, &c.t, &s.t, NULL, &y.t), SMELT_STATUS_NULL_POINTER, "smelt_rotary",
           "desc is NULL");
    d.layout = (smelt_rotary_layout)5;
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &c.t, &s.t, NULL, &y.t), SMELT_STATUS_INVALID_ARGUMENT, "desc.layout=5",
           "neox");
    d.layout = SMELT_ROTARY_NEOX, d.inverse = 2;
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &c.t, &s.t, NULL, &y.t), SMELT_STATUS_INVALID_ARGUMENT, "desc.inverse=2",
           "0 or 1");
    d.inverse = 0;
    smelt_tensor t = x.t, u = y.t;
    t.ndim = u.ndim = 3;
    REJECT(y, smelt_rotary(ctx, &d, &t, &c.t, &s.t, NULL, &u), SMELT_STATUS_SHAPE_MISMATCH, "x must be [B, S, H, D]",
           "ndim=3");
    /* Tables shorter than S, without positions. */
    t = c.t, u = s.t;
    t.shape[0] = u.shape[0] = 3;
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &t, &u, NULL, &y.t), SMELT_STATUS_SHAPE_MISMATCH, "S=4 exceeds",
           "P=3 positions");
    t = c.t;
    t.shape[1] = 9;
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &t, &s.t, NULL, &y.t), SMELT_STATUS_SHAPE_MISMATCH, "cos must be [P, R/2]",
           "R <= D=16");
    /* R/2 of 2^62 (stride 0, so its span fits): refused without 2 * R/2
     * overflowing (a fuzz finding). */
    t = c.t;
    t.shape[0] = 1, t.shape[1] = (int64_t)1 << 62, t.strides[1] = 0;
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &t, &s.t, NULL, &y.t), SMELT_STATUS_SHAPE_MISMATCH, "cos must be [P, R/2]",
           "R <= D=16");
    t = c.t;
    t.shape[1] = 2;
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &t, &s.t, NULL, &y.t), SMELT_STATUS_SHAPE_MISMATCH, "cos", "sin");
    t = pos.t;
    t.shape[1] = 3;
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &c.t, &s.t, &t, &y.t), SMELT_STATUS_SHAPE_MISMATCH, "positions must be",
           "[1, 4]");
    t = pos.t;
    t.dtype = SMELT_DTYPE_F32;
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &c.t, &s.t, &t, &y.t), SMELT_STATUS_DTYPE_MISMATCH, "positions.dtype=f32",
           "i32");
    t = c.t;
    t.dtype = SMELT_DTYPE_BF16;
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &t, &s.t, NULL, &y.t), SMELT_STATUS_DTYPE_MISMATCH, "cos.dtype=bf16", "f32");
    t = x.t, u = y.t;
    t.shape[3] = u.shape[3] = 8;
    t.strides[3] = u.strides[3] = 2;
    REJECT(y, smelt_rotary(ctx, &d, &t, &c.t, &s.t, NULL, &u), SMELT_STATUS_BAD_LAYOUT, "x.strides[3]=2", "must be 1");
    REJECT(y, smelt_rotary(ctx, &d, &x.t, &c.t, &s.t, NULL, &c.t), SMELT_STATUS_DTYPE_MISMATCH, "y.dtype=f32",
           "x.dtype=bf16");
    free(xh);
    rb *all[] = {&x, &y, &c, &s, &pos};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) rb_free(all[i]);
  }
}

const th_test th_tests_rotary[] = {
    {"values", test_values},
    {"adjoint_and_round_trip", test_adjoint_and_round_trip},
    {"tables", test_tables},
    {"bad_inputs", test_bad_inputs},
    {0, 0},
};
