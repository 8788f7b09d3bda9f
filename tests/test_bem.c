/* smelt_bem tests: the forward on every backend against a naive f64
 * evaluation of smelt/bem.h's definition written here (ranks 1 to 128, odd
 * sizes, the pre-transposed U, accumulate, segments with empty and clamped
 * ranges and rows outside every segment, per-adapter scales), the
 * backward against central differences of that evaluation (exact: the
 * loss is linear in each parameter), validation errors that write nothing,
 * and the validation and benchmark functions. GPU cases run only where a
 * device is present. */
#include "core/bem_internal.h"
#include "core/error_bound.h"
#include "harness.h"

#include <math.h>

/* ---------------------------------------------------------------- tensors */

/* A view over a guarded buffer on ctx, with its values (row-major, as
 * doubles) when it is an input. */
typedef struct tens {
  th_buf b;
  th_view v;
  smelt_tensor t;
  double *val;
} tens;

/* Inputs get random values in [lo, hi) rounded to dt (the storage around
 * the view is 0xFF: NaN for floats, so a stray read shows); outputs
 * (input 0) stay poison. strides NULL: row-major. */
static void tens_new(tens *T, smelt_ctx *ctx, smelt_dtype dt, int ndim, const int64_t *shape, const int64_t *strides,
                     int input, double lo, double hi) {
  int64_t cs[SMELT_MAX_DIMS], acc = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    cs[d] = acc;
    acc *= shape[d] > 0 ? shape[d] : 1;
  }
  T->v = th_view_make(ndim, shape, strides ? strides : cs, 0);
  const size_t es = smelt_dtype_size(dt), bytes = (size_t)T->v.storage * es;
  T->b = th_buf_new(ctx, bytes);
  T->t = th_view_tensor(&T->v, &T->b, dt);
  T->val = (double *)calloc((size_t)T->v.numel + 1, sizeof(double));
  if (!input) return;
  uint8_t *host = (uint8_t *)malloc(bytes + 1);
  memset(host, 0xFF, bytes);
  for (int64_t i = 0; i < T->v.numel; i++) {
    th_set(host, dt, th_view_off(&T->v, i), th_rand_uniform(lo, hi));
    T->val[i] = th_get(host, dt, th_view_off(&T->v, i));
  }
  th_buf_upload(&T->b, host, bytes);
  free(host);
}

static void tens_free(tens *T) {
  th_buf_free(&T->b);
  free(T->val);
}

/* The view's values now, row-major. */
static void tens_read(const tens *T, smelt_dtype dt, double *out) {
  const size_t es = smelt_dtype_size(dt);
  uint8_t *host = (uint8_t *)malloc((size_t)T->v.storage * es + 1);
  th_buf_download(&T->b, host, (size_t)T->v.storage * es);
  for (int64_t i = 0; i < T->v.numel; i++) out[i] = th_get(host, dt, th_view_off(&T->v, i));
  free(host);
}

/* ---------------------------------------------------------------- the f64 definition */

typedef struct bem_case {
  int64_t M, din, dout, r;
  int A;                 /* 0: one adapter without offsets */
  const int64_t *offs;   /* A + 1 raw offsets */
  smelt_dtype dt, offs_dt;
  int u_transposed;      /* u stored [r, d_out]: strides (1, d_out) */
  int v_transposed;      /* v stored [r, d_in]: strides (1, d_in) */
  int padded;            /* x, codes and y rows padded by 3 elements */
  int accumulate, scales;
  double scale;
} bem_case;

/* The case's desc: its scale and accumulate. */
static smelt_bem_desc case_desc(const bem_case *c) {
  smelt_bem_desc d = smelt_bem_desc_default();
  d.scale = c->scale;
  d.accumulate = c->accumulate;
  return d;
}

/* Segment bounds o[0..A] as smelt/bem.h defines them. */
static void bounds(const bem_case *c, int64_t *o) {
  const int A = c->A ? c->A : 1;
  int64_t run = 0;
  for (int a = 0; a <= A; a++) {
    const int64_t v = c->A ? c->offs[a] : (a ? c->M : 0);
    if (v > run) run = v;
    o[a] = run < c->M ? run : c->M;
  }
}

/* The adapter of row m, or -1. */
static int adapter_of(const bem_case *c, const int64_t *o, int64_t m) {
  const int A = c->A ? c->A : 1;
  for (int a = 0; a < A; a++)
    if (m >= o[a] && m < o[a + 1]) return a;
  return -1;
}

/* ΔY [M, d_out] from row-major values (v [A, d_in, r], u [A, d_out, r]). */
static void delta64(const bem_case *c, const double *x, const double *v, const double *codes, const double *u,
                    const double *scales, double *dy) {
  int64_t o[64];
  bounds(c, o);
  const int64_t r = c->r;
  for (int64_t m = 0; m < c->M; m++) {
    const int a = adapter_of(c, o, m);
    double H[SMELT_BEM_MAX_RANK];
    for (int64_t j = 0; j < r; j++) {
      double acc = 0;
      for (int64_t k = 0; a >= 0 && k < c->din; k++) acc += x[m * c->din + k] * v[(a * c->din + k) * r + j];
      H[j] = acc * codes[m * r + j];
    }
    const double s = a < 0 ? 0 : c->scale * (scales ? scales[a] : 1.0);
    for (int64_t n = 0; n < c->dout; n++) {
      double acc = 0;
      for (int64_t j = 0; j < r; j++) acc += H[j] * u[(a < 0 ? 0 : (a * c->dout + n) * r) + (a < 0 ? 0 : j)];
      dy[m * c->dout + n] = a < 0 ? 0 : s * acc;
    }
  }
}

/* ---------------------------------------------------------------- one case */

typedef struct bem_tensors {
  tens x, v, codes, u, offs, scales, y;
  smelt_bem_inputs in;
} bem_tensors;

static void make_inputs(smelt_ctx *ctx, const bem_case *c, bem_tensors *T) {
  const int segs = c->A > 0, A = segs ? c->A : 1, wd = segs ? 3 : 2;
  const int64_t pad = c->padded ? 3 : 0;
  const int64_t xs[2] = {c->M, c->din}, xst[2] = {c->din + pad, 1};
  const int64_t cs[2] = {c->M, c->r}, cst[2] = {c->r + pad, 1};
  const int64_t vs[3] = {A, c->din, c->r}, vst[3] = {c->din * c->r, 1, c->din};
  const int64_t us[3] = {A, c->dout, c->r}, ust[3] = {c->dout * c->r, 1, c->dout};
  tens_new(&T->x, ctx, c->dt, 2, xs, xst, 1, -1, 1);
  tens_new(&T->codes, ctx, c->dt, 2, cs, cst, 1, -2, 2);
  tens_new(&T->v, ctx, c->dt, wd, vs + 3 - wd, c->v_transposed ? vst + 3 - wd : NULL, 1, -1, 1);
  tens_new(&T->u, ctx, c->dt, wd, us + 3 - wd, c->u_transposed ? ust + 3 - wd : NULL, 1, -1, 1);
  memset(&T->in, 0, sizeof T->in);
  T->in.x = &T->x.t;
  T->in.v = &T->v.t;
  T->in.codes = &T->codes.t;
  T->in.u = &T->u.t;
  memset(&T->offs, 0, sizeof T->offs);
  memset(&T->scales, 0, sizeof T->scales);
  if (segs) {
    const int64_t os[1] = {A + 1};
    tens_new(&T->offs, ctx, c->offs_dt, 1, os, NULL, 0, 0, 0);
    uint8_t host[8 * 65];
    for (int a = 0; a <= A; a++) th_set(host, c->offs_dt, a, (double)c->offs[a]);
    th_buf_upload(&T->offs.b, host, (size_t)(A + 1) * smelt_dtype_size(c->offs_dt));
    T->in.offsets = &T->offs.t;
  }
  if (c->scales) {
    const int64_t ss[1] = {A};
    tens_new(&T->scales, ctx, SMELT_DTYPE_F32, 1, ss, NULL, 1, 0.25, 2);
    T->in.scales = &T->scales.t;
  }
  const int64_t ys[2] = {c->M, c->dout}, yst[2] = {c->dout + pad, 1};
  tens_new(&T->y, ctx, c->dt, 2, ys, yst, c->accumulate, -1, 1);
}

static void free_inputs(const bem_case *c, bem_tensors *T) {
  tens_free(&T->x);
  tens_free(&T->v);
  tens_free(&T->codes);
  tens_free(&T->u);
  tens_free(&T->y);
  if (c->A) tens_free(&T->offs);
  if (c->scales) tens_free(&T->scales);
}

static const char *dev_name(smelt_ctx *ctx) { return smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA ? "cuda" : "cpu"; }

static void bem_case_run(smelt_ctx *ctx, const bem_case *c) {
  bem_tensors T;
  make_inputs(ctx, c, &T);
  char what[200];
  snprintf(what, sizeof what, "bem %s %s M=%lld d_in=%lld d_out=%lld r=%lld A=%d%s%s%s%s%s", dev_name(ctx),
           smelt_dtype_name(c->dt), (long long)c->M, (long long)c->din, (long long)c->dout, (long long)c->r, c->A,
           c->u_transposed ? " u^T" : "", c->v_transposed ? " v^T" : "", c->padded ? " padded" : "",
           c->accumulate ? " accumulate" : "", c->scales ? " scales" : "");
  const smelt_bem_desc d = case_desc(c);
  const int64_t n = c->M * c->dout;
  double *ref = (double *)calloc((size_t)n + 1, sizeof *ref), *got = (double *)calloc((size_t)n + 1, sizeof *got);
  delta64(c, T.x.val, T.v.val, T.codes.val, T.u.val, c->scales ? T.scales.val : NULL, ref);
  for (int64_t i = 0; c->accumulate && i < n; i++) ref[i] += T.y.val[i];
  smelt_status s = smelt_bem(ctx, &d, &T.in, &T.y.t);
  if (s) th_fail(__FILE__, __LINE__, "%s: %s (%s)", what, smelt_status_name(s), smelt_last_error());
  else {
    if (c->accumulate) tens_read(&T.y, c->dt, got);
    else th_check_output(what, "y", &T.y.v, &T.y.b, c->dt, got);
    const smelt__bound_query q = {.family = "bem", .metric = SMELT__METRIC_REL_L2, .device = smelt_ctx_device(ctx),
                                  .dtype = c->dt};
    if (!th_compare(what, got, ref, n, smelt__error_bound(&q), 0)) th_fail(__FILE__, __LINE__, "%s", what);
    /* Rows in no segment keep y exactly with accumulate (zero without). */
    int64_t o[64];
    bounds(c, o);
    for (int64_t m = 0; m < c->M; m++)
      for (int64_t k = 0; adapter_of(c, o, m) < 0 && k < c->dout; k++) {
        const double want = c->accumulate ? T.y.val[m * c->dout + k] : 0.0;
        if (got[m * c->dout + k] != want) {
          th_fail(__FILE__, __LINE__, "%s: row %lld (no segment) col %lld is %g, want %g", what, (long long)m,
                  (long long)k, got[m * c->dout + k], want);
          m = c->M;
          break;
        }
      }
  }
  free(ref);
  free(got);
  free_inputs(c, &T);
}

static const smelt_dtype dts[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* One adapter: odd sizes, ranks 1 to 128, every layout and accumulate. */
static void forward_cases(smelt_ctx *ctx, int big) {
  static const int64_t shapes[][4] = {{1, 1, 1, 1}, {5, 7, 9, 1}, {33, 19, 23, 128}, {17, 64, 40, 16},
                                      {0, 8, 8, 4}, {70, 37, 130, 5}, {129, 72, 136, 16}};
  static const int64_t big_shapes[][4] = {{300, 520, 264, 16}, {257, 96, 1000, 33}, {131, 200, 72, 128}};
  const int ns = big ? 3 : (int)(sizeof shapes / sizeof *shapes);
  for (int d = 0; d < 3; d++)
    for (int i = 0; i < ns; i++)
      for (int lay = 0; lay < 4; lay++) {
        const int64_t *sh = big ? big_shapes[i] : shapes[i];
        bem_case c = {.M = sh[0], .din = sh[1], .dout = sh[2], .r = sh[3], .dt = dts[d], .u_transposed = lay & 1,
                      .v_transposed = lay == 2, .padded = lay >= 2, .accumulate = lay == 1 || lay == 3,
                      .scale = 16.0 / (double)sh[3]};
        bem_case_run(ctx, &c);
      }
}

/* Segments: an empty one, rows before the first and after the last,
 * decreasing offsets (clamped), offsets past M, i32 and i64. */
static void segment_cases(smelt_ctx *ctx, int64_t din, int64_t dout) {
  static const int64_t o1[] = {0, 5, 5, 13}, o2[] = {2, 6, 6, 10}, o3[] = {0, 9, 4, 40}, o4[] = {-3, 0, 13};
  static const int64_t o5[] = {0, 130, 131, 200, 300}, o6[] = {0, 0, 0, 0, 0};
  /* 50 adapters (the kernels scan offsets 32 at a time): small, empty and
   * decreasing segments, the last ones past M. */
  int64_t o7[51];
  for (int a = 0; a <= 50; a++) o7[a] = a == 0 ? 5 : a % 7 == 3 ? o7[a - 1] - 20 : o7[a - 1] + (a * 13) % 17;
  const struct {
    const int64_t *o;
    int A;
    int64_t M;
  } segs[] = {{o1, 3, 13}, {o2, 3, 13}, {o3, 3, 13}, {o4, 2, 13}, {o5, 4, 300}, {o6, 4, 20}, {o7, 50, 330}};
  for (int d = 0; d < 3; d++)
    for (size_t i = 0; i < sizeof segs / sizeof *segs; i++) {
      bem_case c = {.M = segs[i].M, .din = din, .dout = dout, .r = 8, .A = segs[i].A, .offs = segs[i].o,
                    .dt = dts[d], .offs_dt = i % 2 ? SMELT_DTYPE_I32 : SMELT_DTYPE_I64,
                    .u_transposed = (int)(i % 3 == 1), .accumulate = (int)(i % 2), .scales = i != 0,
                    .scale = 0.5};
      bem_case_run(ctx, &c);
    }
}

static void test_forward(void) { forward_cases(th_cpu(), 0); }
static void test_segments(void) { segment_cases(th_cpu(), 11, 9); }

/* ---------------------------------------------------------------- backward */

/* sum(ΔY ∘ dy) in f64. */
static double loss64(const bem_case *c, const double *x, const double *v, const double *codes, const double *u,
                     const double *scales, const double *dy) {
  double *d = (double *)calloc((size_t)(c->M * c->dout) + 1, sizeof *d), L = 0;
  delta64(c, x, v, codes, u, scales, d);
  for (int64_t i = 0; i < c->M * c->dout; i++) L += d[i] * dy[i];
  free(d);
  return L;
}

/* Central differences of the loss in each element of p (n of them). The
 * loss is linear in each element, so step 1 is exact up to rounding. */
static void fd_grad(const bem_case *c, bem_tensors *T, const double *dy, double *p, int64_t n, double *g) {
  const double *sc = c->scales ? T->scales.val : NULL;
  for (int64_t i = 0; i < n; i++) {
    const double keep = p[i];
    p[i] = keep + 1;
    const double hi = loss64(c, T->x.val, T->v.val, T->codes.val, T->u.val, sc, dy);
    p[i] = keep - 1;
    const double lo = loss64(c, T->x.val, T->v.val, T->codes.val, T->u.val, sc, dy);
    p[i] = keep;
    g[i] = (hi - lo) / 2;
  }
}

/* The gradients on ctx, or (composed) through the composition the CUDA
 * backend runs (src/core/bem_compose.c) on the CPU context's ops. */
static smelt_status backward_on(smelt_ctx *ctx, const bem_case *c, bem_tensors *T, const smelt_tensor *dy,
                                const smelt_bem_grads *g, int composed) {
  const smelt_bem_desc d = case_desc(c);
  if (!composed) return smelt_bem_backward(ctx, &d, &T->in, dy, g);
  smelt_plan *plan = NULL;
  smelt_status s = smelt_bem_backward_plan(ctx, &d, &T->in, dy, g, &plan);
  const smelt_tensor *t[SMELT__BT_ROLES] = {[SMELT__BT_X] = T->in.x,       [SMELT__BT_V] = T->in.v,
                                            [SMELT__BT_CODES] = T->in.codes, [SMELT__BT_U] = T->in.u,
                                            [SMELT__BT_SCALES] = T->in.scales, [SMELT__BT_DY] = dy,
                                            [SMELT__BT_DX] = g->dx,          [SMELT__BT_DV] = g->dv,
                                            [SMELT__BT_DU] = g->du,          [SMELT__BT_DCODES] = g->dcodes};
  if (!s) s = smelt__bem_compose_plan(plan, t);
  if (!s) s = smelt__bem_compose_run(plan, t);
  smelt_plan_destroy(plan);
  return s;
}

static void backward_case(smelt_ctx *ctx, const bem_case *c, int composed) {
  bem_tensors T;
  make_inputs(ctx, c, &T);
  const int64_t ys[2] = {c->M, c->dout};
  tens dy, g[4];
  tens_new(&dy, ctx, c->dt, 2, ys, NULL, 1, -1, 1);
  const tens *like[4] = {&T.x, &T.v, &T.u, &T.codes};
  static const char *const names[4] = {"dx", "dv", "du", "dcodes"};
  for (int i = 0; i < 4; i++) tens_new(&g[i], ctx, c->dt, like[i]->v.ndim, like[i]->v.shape, NULL, 0, 0, 0);
  const smelt_bem_grads grads = {&g[0].t, &g[1].t, &g[2].t, &g[3].t};
  CHECK_OK(backward_on(ctx, c, &T, &dy.t, &grads, composed));
  /* The composition keeps 16-bit intermediates: the CUDA backward's bound. */
  const int cuda_bound = composed || smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA;
  double *params[4] = {T.x.val, T.v.val, T.u.val, T.codes.val};
  for (int i = 0; i < 4; i++) {
    const int64_t n = like[i]->v.numel;
    double *got = (double *)calloc((size_t)n + 1, sizeof *got), *fd = (double *)calloc((size_t)n + 1, sizeof *fd);
    char what[160];
    snprintf(what, sizeof what, "bem backward %s%s %s M=%lld r=%lld A=%d %s", dev_name(ctx),
             composed ? " composed" : "", smelt_dtype_name(c->dt), (long long)c->M, (long long)c->r, c->A,
             names[i]);
    th_check_output(what, names[i], &g[i].v, &g[i].b, c->dt, got);
    fd_grad(c, &T, dy.val, params[i], n, fd);
    const smelt__bound_query q = {.family = "bem", .metric = SMELT__METRIC_REL_L2,
                                  .device = cuda_bound ? SMELT_DEVICE_CUDA : SMELT_DEVICE_CPU, .dtype = c->dt,
                                  .output = 1};
    if (!th_compare(what, got, fd, n, smelt__error_bound(&q), 0)) th_fail(__FILE__, __LINE__, "%s", what);
    free(got);
    free(fd);
  }
  for (int i = 0; i < 4; i++) tens_free(&g[i]);
  tens_free(&dy);
  free_inputs(c, &T);
}

static void test_backward(void) {
  static const int64_t o[] = {1, 4, 4, 6};
  for (int d = 0; d < 3; d++) {
    const bem_case one = {.M = 7, .din = 6, .dout = 5, .r = 3, .dt = dts[d], .u_transposed = 1, .scale = 0.75};
    backward_case(th_cpu(), &one, 0);
    const bem_case segs = {.M = 7, .din = 5, .dout = 4, .r = 2, .A = 3, .offs = o, .dt = dts[d],
                           .offs_dt = SMELT_DTYPE_I32, .v_transposed = 1, .padded = 1, .scales = 1, .scale = 2};
    backward_case(th_cpu(), &segs, 0);
  }
  const bem_case r1 = {.M = 4, .din = 3, .dout = 3, .r = 1, .dt = SMELT_DTYPE_F32, .scale = 1};
  backward_case(th_cpu(), &r1, 0);
}

/* Shapes of the backward on CUDA (and of its composition on the CPU):
 * odd rows, ranks 1, 5 and 16, every layout, per-adapter scales. */
static void backward_shapes(smelt_ctx *ctx, int composed) {
  static const int64_t shapes[][4] = {{29, 16, 12, 16}, {9, 7, 5, 1}, {21, 16, 13, 5}};
  for (int d = 0; d < 3; d++)
    for (int i = 0; i < 3; i++) {
      const int64_t *sh = shapes[i];
      const bem_case c = {.M = sh[0], .din = sh[1], .dout = sh[2], .r = sh[3], .dt = dts[d], .u_transposed = i == 1,
                          .v_transposed = i == 2, .padded = i == 2, .scales = i == 0, .scale = 1.5};
      backward_case(ctx, &c, composed);
    }
}

static void test_backward_composed(void) { backward_shapes(th_cpu(), 1); }

/* ---------------------------------------------------------------- errors */

/* A call that fails writes nothing: every output stays poison. */
static void check_untouched(const tens *t, const char *what) {
  if (!th_buf_untouched(&t->b)) th_fail(__FILE__, __LINE__, "%s: an output was written", what);
}

static void test_bad_inputs(void) {
  smelt_ctx *ctx = th_cpu();
  const bem_case c = {.M = 6, .din = 5, .dout = 4, .r = 3, .dt = SMELT_DTYPE_F32, .scale = 1};
  bem_tensors T;
  make_inputs(ctx, &c, &T);
  smelt_bem_desc d = smelt_bem_desc_default();
  smelt_bem_inputs in = T.in;
  /* shapes, ranks, dtypes: one field of one tensor changed */
  static const struct {
    int role, dim; /* role: x, v, codes, u, y; dim -1: the dtype becomes f16 */
    int64_t size;
    smelt_status want;
    const char *msg;
  } muts[] = {
      {2, 0, 5, SMELT_STATUS_SHAPE_MISMATCH, "codes.shape=[5, 3] must be [M, r]"},
      {3, 1, 2, SMELT_STATUS_SHAPE_MISMATCH, "u.shape=[4, 2] must be [d_out, r]"},
      {4, 1, 3, SMELT_STATUS_SHAPE_MISMATCH, "y.shape=[6, 3] must be [M, d_out]"},
      {2, 1, 0, SMELT_STATUS_UNSUPPORTED, "rank codes.shape[1]=0 must be in [1, 128]"},
      {1, -1, 0, SMELT_STATUS_DTYPE_MISMATCH, "v.dtype=f16 must equal x.dtype=f32"},
      {0, 1, 6, SMELT_STATUS_SHAPE_MISMATCH, "v.shape=[5, 3] must be [d_in, r]=[6, 3]"},
  };
  smelt_tensor bad;
  for (size_t i = 0; i < sizeof muts / sizeof *muts; i++) {
    smelt_tensor ts[5] = {T.x.t, T.v.t, T.codes.t, T.u.t, T.y.t};
    if (muts[i].dim < 0) ts[muts[i].role].dtype = SMELT_DTYPE_F16;
    else ts[muts[i].role].shape[muts[i].dim] = muts[i].size;
    const smelt_bem_inputs mi = {&ts[0], &ts[1], &ts[2], &ts[3], NULL, NULL};
    CHECK_STATUS(smelt_bem(ctx, &d, &mi, &ts[4]), muts[i].want);
    CHECK_MSG(muts[i].msg);
  }
  check_untouched(&T.y, "bad shapes");
  /* offsets without 3-D weights; scales of the wrong length */
  int64_t offs_host[2] = {0, 6};
  const int64_t os[1] = {2}, ss[1] = {2};
  smelt_tensor offs = smelt_tensor_make(offs_host, SMELT_DTYPE_I64, SMELT_DEVICE_CPU, 0, 1, os);
  in = T.in;
  in.offsets = &offs;
  CHECK_STATUS(smelt_bem(ctx, &d, &in, &T.y.t), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("v.shape=[5, 3] must be [A, d_in, r]");
  float sc_host[2] = {1, 1};
  smelt_tensor sc = smelt_tensor_make(sc_host, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, ss);
  in = T.in;
  in.scales = &sc;
  CHECK_STATUS(smelt_bem(ctx, &d, &in, &T.y.t), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("scales.shape=[2] must be [A]=[1]");
  offs.dtype = SMELT_DTYPE_F32;
  in = T.in;
  in.offsets = &offs;
  CHECK_STATUS(smelt_bem(ctx, &d, &in, &T.y.t), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("offsets");
  /* desc, NULLs, overlap */
  d.scale = NAN;
  CHECK_STATUS(smelt_bem(ctx, &d, &T.in, &T.y.t), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("desc.scale=nan must be finite");
  d = smelt_bem_desc_default();
  d.accumulate = 2;
  CHECK_STATUS(smelt_bem(ctx, &d, &T.in, &T.y.t), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("desc.accumulate=2");
  d = smelt_bem_desc_default();
  in = T.in;
  in.u = NULL;
  CHECK_STATUS(smelt_bem(ctx, &d, &in, &T.y.t), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("smelt_bem: u is NULL");
  CHECK_STATUS(smelt_bem(ctx, &d, &T.in, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("y is NULL");
  smelt_tensor ov = T.y.t;
  ov.data = T.x.t.data;
  ov.shape[1] = 2;
  ov.strides[0] = 2;
  bad = T.x.t;
  bad.shape[1] = 2;
  bad.strides[0] = 2;
  in = T.in;
  in.x = &bad;
  const int64_t us2[2] = {2, 3};
  smelt_tensor u2 = T.u.t;
  u2.shape[0] = us2[0];
  in.u = &u2;
  smelt_tensor v2 = T.v.t;
  v2.shape[0] = 2;
  in.v = &v2;
  CHECK_STATUS(smelt_bem(ctx, &d, &in, &ov), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("y overlaps x");
  /* plans and runs: the wrong direction, another layout */
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_bem_plan(ctx, &d, &T.in, &T.y.t, &plan));
  const smelt_bem_grads none = {0};
  CHECK_STATUS(smelt_bem_backward_run(plan, &T.in, &T.y.t, &none), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("the plan is a forward plan");
  bad = T.y.t;
  bad.strides[0] = 7;
  CHECK_STATUS(smelt_bem_run(plan, &T.in, &bad), SMELT_STATUS_BAD_LAYOUT);
  CHECK_MSG("y.strides[0]=7 differs from the planned");
  smelt_plan_destroy(plan);
  check_untouched(&T.y, "bad forward calls");
  /* the backward's own */
  tens dx;
  tens_new(&dx, ctx, c.dt, 2, T.x.v.shape, NULL, 0, 0, 0);
  bad = dx.t;
  bad.shape[1] = 4;
  const smelt_bem_grads g_bad = {.dx = &bad};
  CHECK_STATUS(smelt_bem_backward(ctx, &d, &T.in, &T.y.t, &g_bad), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("grads.dx.shape=[6, 4] must be x's shape [M, d_in]");
  const smelt_bem_grads g_ok = {.dx = &dx.t};
  CHECK_STATUS(smelt_bem_backward(ctx, &d, &T.in, NULL, &g_ok), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("dy is NULL");
  CHECK_STATUS(smelt_bem_backward(ctx, &d, &T.in, &T.y.t, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("grads is NULL");
  check_untouched(&dx, "bad backward calls");
  tens_free(&dx);
  free_inputs(&c, &T);
}

/* ---------------------------------------------------------------- validate and benchmark */

static void check_validate(smelt_ctx *ctx, const bem_case *c) {
  bem_tensors T;
  make_inputs(ctx, c, &T);
  const smelt_bem_desc d = case_desc(c);
  smelt_bem_check r;
  CHECK_OK(smelt_bem_validate(ctx, &d, &T.in, &T.y.t, 0, &r));
  CHECK(r.passed);
  CHECK(r.tolerance > 0 && r.max_rel <= r.tolerance && r.max_abs >= 0 && r.rel_l2 >= 0);
  if (smelt_ctx_device(ctx) == SMELT_DEVICE_CPU) CHECK(r.max_abs == 0);
  /* A tolerance nothing meets fails where the result is not exact. */
  CHECK_OK(smelt_bem_validate(ctx, &d, &T.in, &T.y.t, 1e-300, &r));
  CHECK(r.passed == (r.max_rel <= 1e-300));
  free_inputs(c, &T);
}

static void test_validate(void) {
  static const int64_t o[] = {0, 3, 3, 9};
  const bem_case one = {.M = 9, .din = 13, .dout = 7, .r = 4, .dt = SMELT_DTYPE_BF16, .u_transposed = 1, .scale = 2};
  const bem_case segs = {.M = 9, .din = 8, .dout = 5, .r = 3, .A = 3, .offs = o, .dt = SMELT_DTYPE_F32,
                         .offs_dt = SMELT_DTYPE_I64, .accumulate = 1, .scales = 1, .scale = 1};
  check_validate(th_cpu(), &one);
  check_validate(th_cpu(), &segs);
}

static void check_benchmark(smelt_ctx *ctx, const bem_case *c) {
  bem_tensors T;
  make_inputs(ctx, c, &T);
  const smelt_bem_desc d = case_desc(c);
  smelt_bem_timing tm;
  CHECK_OK(smelt_bem_benchmark(ctx, &d, &T.in, &T.y.t, 1, 3, &tm));
  CHECK(tm.fused_ms > 0 && tm.unfused_ms > 0 && tm.fused_gbps > 0 && tm.base_ms > 0);
  CHECK(fabs(tm.overhead_pct - 100 * tm.fused_ms / tm.base_ms) < 1e-9 * tm.overhead_pct);
  CHECK(fabs(tm.speedup - tm.unfused_ms / tm.fused_ms) < 1e-9 * tm.speedup);
  free_inputs(c, &T);
}

static void test_benchmark(void) {
  const bem_case c = {.M = 64, .din = 48, .dout = 40, .r = 8, .dt = SMELT_DTYPE_F16, .u_transposed = 1, .scale = 2};
  check_benchmark(th_cpu(), &c);
  const bem_case acc = {.M = 16, .din = 8, .dout = 8, .r = 2, .dt = SMELT_DTYPE_F32, .accumulate = 1, .scale = 1};
  check_benchmark(th_cpu(), &acc);
  static const int64_t o[] = {0, 16};
  const bem_case segs = {.M = 16, .din = 8, .dout = 8, .r = 2, .A = 1, .offs = o, .dt = SMELT_DTYPE_F32,
                         .offs_dt = SMELT_DTYPE_I32, .scale = 1};
  bem_tensors T;
  make_inputs(th_cpu(), &segs, &T);
  smelt_bem_desc d = smelt_bem_desc_default();
  smelt_bem_timing tm;
  CHECK_STATUS(smelt_bem_benchmark(th_cpu(), &d, &T.in, &T.y.t, 1, 3, &tm), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("offsets must be NULL");
  free_inputs(&segs, &T);
}

/* ---------------------------------------------------------------- GPU */

static void test_gpu_forward(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  forward_cases(th_cuda(), 0);
  forward_cases(th_cuda(), 1);
}

static void test_gpu_segments(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  segment_cases(th_cuda(), 11, 9);
  segment_cases(th_cuda(), 136, 264);
}

static void test_gpu_validate(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  static const int64_t o[] = {0, 100, 100, 257};
  const bem_case one = {.M = 300, .din = 264, .dout = 136, .r = 16, .dt = SMELT_DTYPE_F16, .scale = 2};
  const bem_case segs = {.M = 257, .din = 72, .dout = 40, .r = 24, .A = 3, .offs = o, .dt = SMELT_DTYPE_BF16,
                         .offs_dt = SMELT_DTYPE_I32, .u_transposed = 1, .accumulate = 1, .scales = 1, .scale = 1};
  check_validate(th_cuda(), &one);
  check_validate(th_cuda(), &segs);
  const bem_case b = {.M = 512, .din = 256, .dout = 256, .r = 16, .dt = SMELT_DTYPE_BF16, .scale = 2};
  check_benchmark(th_cuda(), &b);
}

static void test_gpu_backward(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  backward_shapes(th_cuda(), 0);
}

static void test_gpu_unsupported(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  /* The backward with segments. */
  static const int64_t o[] = {0, 3, 6};
  const bem_case sc = {.M = 6, .din = 5, .dout = 4, .r = 3, .A = 2, .offs = o, .dt = SMELT_DTYPE_F16,
                       .offs_dt = SMELT_DTYPE_I64, .scale = 1};
  bem_tensors S;
  make_inputs(th_cuda(), &sc, &S);
  tens dx;
  tens_new(&dx, th_cuda(), sc.dt, 2, S.x.v.shape, NULL, 0, 0, 0);
  const smelt_bem_grads g = {.dx = &dx.t};
  smelt_bem_desc d = smelt_bem_desc_default();
  CHECK_STATUS(smelt_bem_backward(th_cuda(), &d, &S.in, &S.y.t, &g), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("backward with segments (offsets) is not supported on CUDA");
  check_untouched(&dx, "backward with segments on CUDA");
  tens_free(&dx);
  free_inputs(&sc, &S);
  const bem_case c = {.M = 6, .din = 5, .dout = 4, .r = 3, .dt = SMELT_DTYPE_F16, .scale = 1};
  bem_tensors T;
  make_inputs(th_cuda(), &c, &T);
  /* x's columns must have unit stride on CUDA: every other column of a wider x. */
  smelt_tensor xs = T.x.t;
  xs.shape[1] = 2;
  xs.strides[1] = 2;
  smelt_tensor vs = T.v.t;
  vs.shape[0] = 2;
  smelt_bem_inputs in = T.in;
  in.x = &xs;
  in.v = &vs;
  CHECK_STATUS(smelt_bem(th_cuda(), &d, &in, &T.y.t), SMELT_STATUS_BAD_LAYOUT);
  CHECK_MSG("x.strides[1]=2 must be 1 on CUDA");
  check_untouched(&T.y, "x with strided columns on CUDA");
  free_inputs(&c, &T);
}

const th_test th_tests_bem[] = {
    {"forward", test_forward},
    {"segments", test_segments},
    {"backward", test_backward},
    {"backward_composed", test_backward_composed},
    {"bad_inputs", test_bad_inputs},
    {"validate", test_validate},
    {"benchmark", test_benchmark},
    {"gpu_forward", test_gpu_forward},
    {"gpu_segments", test_gpu_segments},
    {"gpu_validate", test_gpu_validate},
    {"gpu_backward", test_gpu_backward},
    {"gpu_unsupported", test_gpu_unsupported},
    {0, 0},
};
