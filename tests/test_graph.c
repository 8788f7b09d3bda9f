/* Graph tests (smelt/graph.h, the fusion planner). Each case builds one
 * graph three times on every backend: bf16 fused, bf16 one op a kernel
 * (SMELT_GRAPH_UNFUSED) and f32 one op a kernel on the CPU, the reference
 * (its inputs the bf16 values, exactly). Both bf16 results must lie within the
 * ops' bound of the reference, and the fused one within the unfused one's
 * error (it rounds fewer intermediates). The cases check the kernel
 * counts, the description (what went where, why the rest did not fuse),
 * what was not materialized, and every output element written with
 * nothing around it touched. Bad graphs fail with a clear status and
 * message and write nothing. */
#include "core/error_bound.h"
#include "harness.h"

#define MAXT 24

static smelt_ctx *backend(int b) { return b == 0 ? th_cpu() : th_cuda(); }
#define FOR_EACH_BACKEND(ctx)          \
  for (int th_b = 0; th_b < 2; th_b++) \
    for (smelt_ctx *ctx = backend(th_b); ctx; ctx = NULL)

/* ---------------------------------------------------------------- a graph under test */

/* The inputs' values, drawn on the first build of a case (rounded to
 * bf16, so the f32 reference reads the very same numbers) and reused. */
typedef struct values {
  int n;
  double *v[MAXT];
} values;

enum { T_IN, T_OUT, T_MID };

typedef struct tt {
  int kind, id;
  smelt_dtype dt;
  th_view v;
  th_buf b;
  smelt_tensor t;
} tt;

typedef struct tg {
  smelt_ctx *ctx;
  smelt_graph *g;
  smelt_dtype dt; /* the activations' dtype */
  values *vals;
  int nin, n;
  tt t[MAXT];
} tg;

static th_view contiguous(int ndim, const int64_t *shape) {
  int64_t strides[SMELT_MAX_DIMS], s = 1;
  for (int d = ndim - 1; d >= 0; d--) strides[d] = s, s *= shape[d];
  return th_view_make(ndim, shape, strides, 0);
}

static int declare(tg *b, int kind, const char *name, smelt_dtype dt, int ndim, const int64_t *shape, double lo,
                   double hi) {
  tt *x = &b->t[b->n++];
  x->kind = kind;
  x->dt = dt;
  x->id = -1;
  x->v = contiguous(ndim, shape);
  if (kind == T_MID) {
    CHECK_OK(smelt_graph_tensor(b->g, name, dt, ndim, shape, &x->id));
    return x->id;
  }
  x->b = th_buf_new(b->ctx, (size_t)x->v.storage * smelt_dtype_size(dt));
  x->t = th_view_tensor(&x->v, &x->b, dt);
  if (kind == T_IN) {
    values *vs = b->vals;
    const int k = b->nin++;
    if (k == vs->n) {
      vs->v[vs->n++] = (double *)malloc((size_t)x->v.numel * sizeof(double) + 1);
      for (int64_t i = 0; i < x->v.numel; i++) {
        uint64_t cell = 0;
        th_set(&cell, SMELT_DTYPE_BF16, 0, th_rand_uniform(lo, hi));
        vs->v[k][i] = th_get(&cell, SMELT_DTYPE_BF16, 0);
      }
    }
    uint8_t *host = (uint8_t *)malloc((size_t)x->v.storage * smelt_dtype_size(dt) + 1);
    for (int64_t i = 0; i < x->v.numel; i++) th_set(host, dt, i, vs->v[k][i]);
    th_buf_upload(&x->b, host, (size_t)x->v.storage * smelt_dtype_size(dt));
    free(host);
    CHECK_OK(smelt_graph_input(b->g, name, &x->t, &x->id));
  } else {
    CHECK_OK(smelt_graph_output(b->g, name, &x->t, &x->id));
  }
  return x->id;
}

static int in(tg *b, const char *name, int ndim, const int64_t *shape) {
  return declare(b, T_IN, name, b->dt, ndim, shape, -1.0, 1.0);
}
static int out(tg *b, const char *name, int ndim, const int64_t *shape) {
  return declare(b, T_OUT, name, b->dt, ndim, shape, 0, 0);
}
static int mid(tg *b, const char *name, int ndim, const int64_t *shape) {
  return declare(b, T_MID, name, b->dt, ndim, shape, 0, 0);
}

typedef void (*build_fn)(tg *b);

static void vals_free(values *vs) {
  for (int k = 0; k < vs->n; k++) free(vs->v[k]);
  vs->n = 0;
}

static void tg_free(tg *b) {
  for (int i = 0; i < b->n; i++)
    if (b->t[i].kind != T_MID) th_buf_free(&b->t[i].b);
  smelt_graph_destroy(b->g);
}

/* Builds, plans with flags and runs the case. */
static void tg_run(tg *b, smelt_ctx *ctx, build_fn build, smelt_dtype dt, values *vals, unsigned flags) {
  memset(b, 0, sizeof *b);
  b->ctx = ctx;
  b->dt = dt;
  b->vals = vals;
  CHECK_OK(smelt_graph_create(ctx, &b->g));
  build(b);
  CHECK_OK(smelt_graph_plan(b->g, flags));
  CHECK_OK(smelt_graph_run(b->g, NULL));
  CHECK_OK(smelt_ctx_synchronize(ctx));
}

static double rel_l2(const double *got, const double *ref, int64_t n) {
  double e = 0, r = 0;
  for (int64_t i = 0; i < n; i++) e += (got[i] - ref[i]) * (got[i] - ref[i]), r += ref[i] * ref[i];
  return r > 0 ? sqrt(e / r) : sqrt(e);
}

/* A chain rounds a few times: the GEMM's bound and the norm's together. */
static double chain_bound(void) {
  const smelt_gemm_desc d = smelt_gemm_desc_default();
  const smelt__bound_query gq = {.family = "gemm", .dtype = SMELT_DTYPE_BF16, .dt_a = SMELT_DTYPE_BF16, .gemm = &d};
  const smelt__bound_query nq = {.family = "norm", .dtype = SMELT_DTYPE_BF16};
  return smelt__error_bound(&gq) + smelt__error_bound(&nq);
}

static void check_says(const smelt_graph *g, const char *const *says) {
  for (int i = 0; says && says[i]; i++)
    if (!strstr(smelt_graph_describe(g), says[i]))
      th_fail(__FILE__, __LINE__, "the description lacks \"%s\":\n%s", says[i], smelt_graph_describe(g));
}

/* The case on every backend: kernel counts fused and not, the
 * description, and each output of both forms against the reference. */
static void compare(const char *what, build_fn build, int kernels, int unfused, const char *const *says) {
  FOR_EACH_BACKEND(ctx) {
    values vals = {0, {NULL}};
    tg f, u, r;
    tg_run(&f, ctx, build, SMELT_DTYPE_BF16, &vals, 0);
    tg_run(&u, ctx, build, SMELT_DTYPE_BF16, &vals, SMELT_GRAPH_UNFUSED);
    tg_run(&r, th_cpu(), build, SMELT_DTYPE_F32, &vals, SMELT_GRAPH_UNFUSED); /* CUDA attention has no f32 */
    smelt_graph_stats st;
    CHECK_OK(smelt_graph_stats_get(f.g, &st));
    if (st.kernels != kernels) th_fail(__FILE__, __LINE__, "%s: %d kernels, want %d:\n%s", what, st.kernels, kernels,
                                       smelt_graph_describe(f.g));
    CHECK_OK(smelt_graph_stats_get(u.g, &st));
    CHECK_EQ_INT(st.kernels, unfused);
    CHECK_EQ_INT(st.fused_away, 0);
    check_says(f.g, says);
    for (int i = 0; i < f.n; i++) {
      if (f.t[i].kind != T_OUT) continue;
      const int64_t n = f.t[i].v.numel;
      double *gf = (double *)malloc((size_t)n * sizeof(double) + 8), *gu = (double *)malloc((size_t)n * sizeof(double) + 8),
             *gr = (double *)malloc((size_t)n * sizeof(double) + 8);
      th_check_output(what, "fused output", &f.t[i].v, &f.t[i].b, f.t[i].dt, gf);
      th_check_output(what, "unfused output", &u.t[i].v, &u.t[i].b, u.t[i].dt, gu);
      th_check_output(what, "reference output", &r.t[i].v, &r.t[i].b, r.t[i].dt, gr);
      const double ef = rel_l2(gf, gr, n), eu = rel_l2(gu, gr, n), bound = chain_bound();
      if (!(ef <= bound && eu <= bound && ef <= 1.5 * eu + 1e-6))
        th_fail(__FILE__, __LINE__, "%s (%s), output %d: relative L2 error fused %.3g, unfused %.3g (bound %.3g)",
                what, smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA ? "cuda" : "cpu", i, ef, eu, bound);
      free(gf), free(gu), free(gr);
    }
    tg_free(&f), tg_free(&u), tg_free(&r);
    vals_free(&vals);
  }
}

/* ---------------------------------------------------------------- the cases */

enum { M = 37, K = 29, N = 23 };

/* y = gelu(x @ w + b + r): the fixed epilogue's whole form, in a shuffled order. */
static void build_fixed(tg *b) {
  const int64_t xs[2] = {M, K}, ws[2] = {K, N}, bs[1] = {N}, ys[2] = {M, N};
  const int x = in(b, "x", 2, xs), w = in(b, "w", 2, ws), bias = in(b, "b", 1, bs), r = in(b, "r", 2, ys);
  const int h1 = mid(b, "h1", 2, ys), h2 = mid(b, "h2", 2, ys), h3 = mid(b, "h3", 2, ys), y = out(b, "y", 2, ys);
  CHECK_OK(smelt_graph_gemm(b->g, NULL, x, w, h1));
  CHECK_OK(smelt_graph_residual_add(b->g, h1, r, h2));
  CHECK_OK(smelt_graph_bias(b->g, h2, bias, h3));
  CHECK_OK(smelt_graph_act(b->g, SMELT_ACT_GELU, 0, h3, y));
}

static void test_fixed_epilogue(void) {
  static const char *const says[] = {"1 kernels (fused)", "kernel 0: gemm, fixed epilogue (C, bias, gelu)",
                                     "not materialized: \"h1\", \"h2\", \"h3\"", NULL};
  compare("fixed", build_fixed, 1, 4, says);
}

/* y = gelu(x @ w + b) + r with the pre-activation kept (an output read by
 * the next op: stored on the way) and a second bias as a column slot. */
static void build_graph(tg *b) {
  const int64_t xs[2] = {M, K}, ws[2] = {K, N}, bs[1] = {N}, ys[2] = {M, N};
  const int x = in(b, "x", 2, xs), w = in(b, "w", 2, ws), bias = in(b, "b", 1, bs), r = in(b, "r", 2, ys);
  const int b2 = in(b, "b2", 1, bs);
  const int h1 = mid(b, "h1", 2, ys), pre = out(b, "pre", 2, ys), h3 = mid(b, "h3", 2, ys), h4 = mid(b, "h4", 2, ys);
  const int y = out(b, "y", 2, ys);
  CHECK_OK(smelt_graph_gemm(b->g, NULL, x, w, h1));
  CHECK_OK(smelt_graph_bias(b->g, h1, bias, pre));
  CHECK_OK(smelt_graph_act(b->g, SMELT_ACT_GELU, 0, pre, h3));
  CHECK_OK(smelt_graph_binary(b->g, SMELT_GRAPH_SUB, r, h3, h4));
  CHECK_OK(smelt_graph_bias(b->g, h4, b2, y));
}

static void test_epilogue_graph(void) {
  static const char *const says[] = {"kernel 0: gemm, epilogue graph of", "not materialized: \"h1\", \"h3\", \"h4\"",
                                     "0 in 0 bytes of workspace", NULL};
  compare("graph", build_graph, 1, 5, says);
}

/* SwiGLU: y = (silu(x @ w1) * (x @ w3)) @ w2. The gate's GEMM comes first
 * but its epilogue reads the up projection, so that kernel runs first. */
static void build_swiglu(tg *b) {
  const int64_t xs[2] = {M, K}, ws[2] = {K, N}, w2s[2] = {N, 17}, hs[2] = {M, N}, ys[2] = {M, 17};
  const int x = in(b, "x", 2, xs), w1 = in(b, "w1", 2, ws), w3 = in(b, "w3", 2, ws), w2 = in(b, "w2", 2, w2s);
  const int g = mid(b, "g", 2, hs), up = mid(b, "u", 2, hs), a = mid(b, "a", 2, hs), m = mid(b, "m", 2, hs);
  const int y = out(b, "y", 2, ys);
  CHECK_OK(smelt_graph_gemm(b->g, NULL, x, w1, g));
  CHECK_OK(smelt_graph_gemm(b->g, NULL, x, w3, up));
  CHECK_OK(smelt_graph_act(b->g, SMELT_ACT_SILU, 0, g, a));
  CHECK_OK(smelt_graph_binary(b->g, SMELT_GRAPH_MUL, a, up, m));
  CHECK_OK(smelt_graph_gemm(b->g, NULL, m, w2, y));
}

static void test_swiglu(void) {
  static const char *const says[] = {"kernel 0: gemm, plain: op 1 (gemm)",
                                     "kernel 1: gemm, epilogue graph of 4 nodes, 0 slots: op 0 (gemm), op 2 (act silu), "
                                     "op 3 (mul)",
                                     "\"m\" goes to op 4 (gemm): it is a GEMM operand (smelt has no GEMM prologue)",
                                     NULL};
  compare("swiglu", build_swiglu, 3, 5, says);
}

/* A pre-norm block's adds: h1 = x + r kept (an output) and normalized;
 * h2 = x + r2 only normalized (never materialized). */
static void build_prenorm(tg *b) {
  const int64_t xs[3] = {2, 5, 40}, cs[1] = {40};
  const int x = in(b, "x", 3, xs), r = in(b, "r", 3, xs), r2 = in(b, "r2", 3, xs), w = in(b, "w", 1, cs);
  const int h1 = out(b, "h1", 3, xs), y1 = out(b, "y1", 3, xs), h2 = mid(b, "h2", 3, xs), y2 = out(b, "y2", 3, xs);
  const smelt_norm_desc rms = {SMELT_NORM_RMS, 1e-6f}, layer = {SMELT_NORM_LAYER, 1e-5f};
  CHECK_OK(smelt_graph_residual_add(b->g, x, r, h1));
  CHECK_OK(smelt_graph_norm(b->g, &rms, h1, w, -1, y1));
  CHECK_OK(smelt_graph_binary(b->g, SMELT_GRAPH_ADD, r2, x, h2));
  CHECK_OK(smelt_graph_norm(b->g, &layer, h2, w, w, y2));
}

static void test_norm_residual(void) {
  static const char *const says[] = {"kernel 0: norm with the residual add: op 0 (residual_add), op 1 (norm) -> \"y1\";",
                                     "kernel 1: norm with the residual add: op 2 (add), op 3 (norm) -> \"y2\"; not "
                                     "materialized: \"h2\"",
                                     "intermediates: 1 not materialized, 0 in 0 bytes", NULL};
  compare("prenorm", build_prenorm, 2, 4, says);
}

/* Elementwise ops without a GEMM, on 3-D tensors: one K = 0 epilogue. A
 * lone bias is one too; a lone activation takes smelt_activation. */
static void build_elementwise(tg *b) {
  const int64_t s3[3] = {3, 4, 10}, s2[2] = {12, 10}, bs[1] = {10};
  const int x = in(b, "x", 3, s3), y = in(b, "y", 3, s3), z = in(b, "z", 3, s3);
  const int a = mid(b, "a", 3, s3), c = mid(b, "c", 3, s3), e = mid(b, "e", 3, s3), d = out(b, "d", 3, s3);
  CHECK_OK(smelt_graph_binary(b->g, SMELT_GRAPH_MUL, x, y, a));
  CHECK_OK(smelt_graph_binary(b->g, SMELT_GRAPH_SUB, z, a, c));
  CHECK_OK(smelt_graph_act(b->g, SMELT_ACT_RELU, 0, c, e));
  CHECK_OK(smelt_graph_binary(b->g, SMELT_GRAPH_MAX, e, x, d));
  const int p = in(b, "p", 2, s2), pb = in(b, "pb", 1, bs), q = out(b, "q", 2, s2), t = in(b, "t", 2, s2);
  const int tq = out(b, "tq", 2, s2);
  CHECK_OK(smelt_graph_bias(b->g, p, pb, q));
  CHECK_OK(smelt_graph_act(b->g, SMELT_ACT_TANH, 0, t, tq));
}

static void test_elementwise(void) {
  static const char *const says[] = {"kernel 0: gemm, K = 0, epilogue graph of", "not materialized: \"a\", \"c\", \"e\"",
                                     "kernel 2: activation: op 5 (act tanh)", NULL};
  compare("elementwise", build_elementwise, 3, 6, says);
}

/* Attention with rotary q and k and a softmax after: each its own kernel. */
static void build_attention(tg *b) {
  const int64_t qs[4] = {2, 9, 4, 64}, ks[4] = {2, 11, 2, 64}, ts[2] = {11, 24}; /* D 64: a CUDA head dim */
  const int q = in(b, "q", 4, qs), k = in(b, "k", 4, ks), v = in(b, "v", 4, ks);
  const int cs = declare(b, T_IN, "cos", SMELT_DTYPE_F32, 2, ts, -1, 1);
  const int sn = declare(b, T_IN, "sin", SMELT_DTYPE_F32, 2, ts, -1, 1);
  const int qr = mid(b, "qr", 4, qs), kr = mid(b, "kr", 4, ks), o = mid(b, "o", 4, qs), y = out(b, "y", 4, qs);
  const smelt_rotary_desc rd = {SMELT_ROTARY_NEOX, 0};
  smelt_attention_desc ad = smelt_attention_desc_default();
  ad.causal = 1;
  CHECK_OK(smelt_graph_rotary(b->g, &rd, q, cs, sn, -1, qr));
  CHECK_OK(smelt_graph_rotary(b->g, &rd, k, cs, sn, -1, kr));
  CHECK_OK(smelt_graph_attention(b->g, &ad, qr, kr, v, o));
  CHECK_OK(smelt_graph_softmax(b->g, o, y));
}

static void test_attention(void) {
  static const char *const says[] = {"kernel 2: attention: op 2 (attention)",
                                     "\"qr\" goes to op 2 (attention): attention reads whole sequences",
                                     "\"o\" goes to op 3 (softmax): softmax reads whole rows", NULL};
  compare("attention", build_attention, 4, 4, says);
}

/* ---------------------------------------------------------------- runs, plans and stats */

/* A run on other buffers (bind) gives the same bits as on the declared
 * ones and leaves the declared outputs alone. */
static void test_bind(void) {
  FOR_EACH_BACKEND(ctx) {
    values vals = {0, {NULL}};
    tg a, b;
    tg_run(&a, ctx, build_graph, SMELT_DTYPE_BF16, &vals, 0);
    memset(&b, 0, sizeof b);
    b.ctx = ctx, b.dt = SMELT_DTYPE_BF16, b.vals = &vals;
    CHECK_OK(smelt_graph_create(ctx, &b.g));
    build_graph(&b);
    const smelt_tensor *bind[MAXT];
    for (int i = 0; i < b.n; i++) bind[b.t[i].id] = b.t[i].kind == T_MID ? NULL : &b.t[i].t;
    CHECK_OK(smelt_graph_run(a.g, bind));
    CHECK_OK(smelt_ctx_synchronize(ctx));
    for (int i = 0; i < b.n; i++) {
      if (b.t[i].kind != T_OUT) continue;
      const size_t bytes = (size_t)b.t[i].v.storage * 2;
      uint8_t *x = (uint8_t *)malloc(bytes), *y = (uint8_t *)malloc(bytes);
      th_buf_download(&a.t[i].b, x, bytes);
      th_buf_download(&b.t[i].b, y, bytes);
      CHECK(!memcmp(x, y, bytes));
      free(x), free(y);
    }
    /* b's own graph was never planned: its run is refused. */
    CHECK_STATUS(smelt_graph_run(b.g, NULL), SMELT_STATUS_INVALID_ARGUMENT);
    CHECK_MSG("not planned");
    tg_free(&a), tg_free(&b);
    vals_free(&vals);
  }
}

/* Stats, a second plan with other flags, and an op added after planning. */
static void test_replan(void) {
  values vals = {0, {NULL}};
  tg a;
  tg_run(&a, th_cpu(), build_fixed, SMELT_DTYPE_BF16, &vals, 0);
  smelt_graph_stats st;
  CHECK_OK(smelt_graph_stats_get(a.g, &st));
  CHECK_EQ_INT(st.ops, 4);
  CHECK_EQ_INT(st.tensors, 8);
  CHECK_EQ_INT(st.kernels, 1);
  CHECK_EQ_INT(st.fused_away, 3);
  CHECK_EQ_INT(st.workspace_bytes, 0);
  CHECK_OK(smelt_graph_plan(a.g, SMELT_GRAPH_UNFUSED));
  CHECK_OK(smelt_graph_stats_get(a.g, &st));
  CHECK_EQ_INT(st.kernels, 4);
  CHECK_EQ_INT(st.fused_away, 0);
  CHECK_EQ_INT(st.workspace_bytes, 3 * M * N * 2);
  CHECK(strstr(smelt_graph_describe(a.g), "unfused: one op a kernel") != NULL);
  const int64_t ys[2] = {M, N};
  const int z = out(&a, "z", 2, ys);
  CHECK_OK(smelt_graph_act(a.g, SMELT_ACT_RELU, 0, a.t[7].id, z));
  CHECK_STATUS(smelt_graph_run(a.g, NULL), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_EQ_INT(smelt_graph_describe(a.g)[0], 0);
  CHECK_STATUS(smelt_graph_plan(a.g, 2), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("flags=0x2");
  tg_free(&a);
  vals_free(&vals);
}

/* ---------------------------------------------------------------- bad graphs */

/* A graph with x [M, K], w [K, N], r [M, N] f32, outputs y and y2 [M, N]. */
typedef struct bad {
  tg b;
  int x, w, r, y, y2;
} bad;

static void bad_new(bad *e, smelt_ctx *ctx, values *vals) {
  memset(e, 0, sizeof *e);
  e->b.ctx = ctx, e->b.dt = SMELT_DTYPE_BF16, e->b.vals = vals;
  CHECK_OK(smelt_graph_create(ctx, &e->b.g));
  const int64_t xs[2] = {M, K}, ws[2] = {K, N}, ys[2] = {M, N};
  e->x = in(&e->b, "x", 2, xs);
  e->w = in(&e->b, "w", 2, ws);
  e->r = declare(&e->b, T_IN, "r", SMELT_DTYPE_F32, 2, ys, -1, 1);
  e->y = out(&e->b, "y", 2, ys);
  e->y2 = out(&e->b, "y2", 2, ys);
}

/* Nothing was written: every output buffer still poison. */
static void untouched(const bad *e) {
  for (int i = 0; i < e->b.n; i++)
    if (e->b.t[i].kind == T_OUT) CHECK(th_buf_untouched(&e->b.t[i].b));
}

#define EXPECT(call, status, sub) \
  do {                            \
    CHECK_STATUS(call, status);   \
    CHECK_MSG(sub);               \
  } while (0)

static void test_bad_ops(void) {
  values vals = {0, {NULL}};
  bad e;
  bad_new(&e, th_cpu(), &vals);
  smelt_graph *g = e.b.g;
  const int64_t bs[2] = {K + 1, N};
  const int wb = in(&e.b, "wb", 2, bs);
  EXPECT(smelt_graph_gemm(g, NULL, e.x, wb, e.y), SMELT_STATUS_SHAPE_MISMATCH,
         "smelt_graph_gemm: b \"wb\".shape[0]=30 must equal K=29");
  EXPECT(smelt_graph_plan(g, 0), SMELT_STATUS_SHAPE_MISMATCH, "the graph is broken since an op failed");
  CHECK_MSG("\"wb\".shape[0]=30");
  tg_free(&e.b);
  vals_free(&vals);

  bad_new(&e, th_cpu(), &vals);
  g = e.b.g;
  EXPECT(smelt_graph_residual_add(g, e.y2, e.r, e.y), SMELT_STATUS_DTYPE_MISMATCH,
         "residual \"r\" is f32 but must have the dtype of x \"y2\", bf16");
  EXPECT(smelt_graph_act(g, SMELT_ACT_GELU, 0, 99, e.y), SMELT_STATUS_INVALID_ARGUMENT,
         "x=99 is not a tensor of the graph (0..4)");
  const int64_t ys[2] = {M, N};
  const int yi = in(&e.b, "yi", 2, ys);
  EXPECT(smelt_graph_act(g, SMELT_ACT_GELU, 0, e.y, yi), SMELT_STATUS_INVALID_ARGUMENT,
         "the output \"yi\" is an input of the graph");
  EXPECT(smelt_graph_act(g, SMELT_ACT_GELU, 0, e.x, e.x), SMELT_STATUS_INVALID_ARGUMENT, "is an input");
  smelt_gemm_desc d = smelt_gemm_desc_default();
  d.epilogue.beta = 1;
  const int h = mid(&e.b, "h", 2, ys);
  EXPECT(smelt_graph_gemm(g, &d, e.x, e.w, h), SMELT_STATUS_INVALID_ARGUMENT, "bias, activation and residual");
  EXPECT(smelt_graph_tensor(g, "h", SMELT_DTYPE_F32, 2, ys, &d.split_k), SMELT_STATUS_INVALID_ARGUMENT,
         "a tensor named \"h\" exists already");
  tg_free(&e.b);
  vals_free(&vals);

  /* A lone mul runs on the GEMM engine with K = 0: its output's leading
   * dims must fold into rows. */
  bad_new(&e, th_cpu(), &vals);
  const int64_t s3[3] = {3, 4, 10}, st[3] = {100, 12, 1};
  const int p = in(&e.b, "p", 3, s3), q = in(&e.b, "q", 3, s3);
  tt *o = &e.b.t[e.b.n++];
  o->kind = T_OUT, o->dt = SMELT_DTYPE_BF16, o->v = th_view_make(3, s3, st, 0);
  o->b = th_buf_new(th_cpu(), (size_t)o->v.storage * 2);
  o->t = th_view_tensor(&o->v, &o->b, o->dt);
  CHECK_OK(smelt_graph_output(e.b.g, "pq", &o->t, &o->id));
  CHECK_OK(smelt_graph_binary(e.b.g, SMELT_GRAPH_MUL, p, q, o->id));
  CHECK_OK(smelt_graph_gemm(e.b.g, NULL, e.x, e.w, e.y));
  CHECK_OK(smelt_graph_gemm(e.b.g, NULL, e.x, e.w, e.y2));
  EXPECT(smelt_graph_plan(e.b.g, 0), SMELT_STATUS_UNSUPPORTED, "op 0 (mul): \"pq\" cannot be read as a matrix");
  EXPECT(smelt_graph_plan(e.b.g, SMELT_GRAPH_UNFUSED), SMELT_STATUS_UNSUPPORTED, "leading dims do not fold");
  untouched(&e);
  tg_free(&e.b);
  vals_free(&vals);
}

static void test_bad_graphs(void) {
  FOR_EACH_BACKEND(ctx) {
    values vals = {0, {NULL}};
    bad e;
    const int64_t ys[2] = {M, N};
    /* An intermediate read but never written. */
    bad_new(&e, ctx, &vals);
    int t = mid(&e.b, "t", 2, ys);
    CHECK_OK(smelt_graph_act(e.b.g, SMELT_ACT_GELU, 0, t, e.y));
    CHECK_OK(smelt_graph_act(e.b.g, SMELT_ACT_GELU, 0, e.y, e.y2));
    EXPECT(smelt_graph_plan(e.b.g, 0), SMELT_STATUS_INVALID_ARGUMENT,
           "intermediate \"t\" (tensor 5) is read by op 0 (act gelu) but written by no op");
    EXPECT(smelt_graph_run(e.b.g, NULL), SMELT_STATUS_INVALID_ARGUMENT, "not planned");
    untouched(&e);
    tg_free(&e.b);
    /* A cycle: t1 = gelu(t2), t2 = relu(t1). */
    bad_new(&e, ctx, &vals);
    const int t1 = mid(&e.b, "t1", 2, ys), t2 = mid(&e.b, "t2", 2, ys);
    CHECK_OK(smelt_graph_gemm(e.b.g, NULL, e.x, e.w, e.y2));
    CHECK_OK(smelt_graph_act(e.b.g, SMELT_ACT_GELU, 0, t2, t1));
    CHECK_OK(smelt_graph_act(e.b.g, SMELT_ACT_RELU, 0, t1, t2));
    CHECK_OK(smelt_graph_act(e.b.g, SMELT_ACT_TANH, 0, t1, e.y));
    EXPECT(smelt_graph_plan(e.b.g, 0), SMELT_STATUS_INVALID_ARGUMENT, "the ops form a cycle");
    CHECK_MSG("op 1 (act gelu) reads \"t2\", written by op 2 (act relu)");
    untouched(&e);
    tg_free(&e.b);
    /* An output nobody writes; an output over an input. */
    bad_new(&e, ctx, &vals);
    CHECK_OK(smelt_graph_gemm(e.b.g, NULL, e.x, e.w, e.y));
    EXPECT(smelt_graph_plan(e.b.g, 0), SMELT_STATUS_INVALID_ARGUMENT, "output \"y2\" (tensor 4) is written by no op");
    EXPECT(smelt_graph_act(e.b.g, SMELT_ACT_GELU, 0, e.y2, e.y), SMELT_STATUS_INVALID_ARGUMENT,
           "\"y\" is written already, by op 0 (gemm)");
    untouched(&e);
    tg_free(&e.b);
    bad_new(&e, ctx, &vals);
    smelt_tensor over = e.b.t[0].t;
    over.dtype = SMELT_DTYPE_BF16, over.shape[1] = N, over.strides[0] = N;
    int o;
    CHECK_OK(smelt_graph_output(e.b.g, "over", &over, &o));
    CHECK_OK(smelt_graph_gemm(e.b.g, NULL, e.x, e.w, e.y2));
    CHECK_OK(smelt_graph_act(e.b.g, SMELT_ACT_RELU, 0, e.y2, e.y));
    CHECK_OK(smelt_graph_act(e.b.g, SMELT_ACT_RELU, 0, e.y2, o));
    EXPECT(smelt_graph_plan(e.b.g, 0), SMELT_STATUS_INVALID_ARGUMENT, "over overlaps x");
    untouched(&e);
    tg_free(&e.b);
    vals_free(&vals);
  }
}

/* A planned graph's run with bad bindings fails before any kernel runs. */
static void test_bad_bind(void) {
  FOR_EACH_BACKEND(ctx) {
    values vals = {0, {NULL}};
    bad e;
    bad_new(&e, ctx, &vals);
    const int64_t ys[2] = {M, N};
    const int h = mid(&e.b, "h", 2, ys);
    CHECK_OK(smelt_graph_gemm(e.b.g, NULL, e.x, e.w, h));
    CHECK_OK(smelt_graph_act(e.b.g, SMELT_ACT_GELU, 0, h, e.y));
    CHECK_OK(smelt_graph_act(e.b.g, SMELT_ACT_RELU, 0, h, e.y2));
    CHECK_OK(smelt_graph_plan(e.b.g, 0));
    CHECK(strstr(smelt_graph_describe(e.b.g), "\"h\" is read by 2 ops, so it is materialized") != NULL);
    smelt_tensor v[6];
    const smelt_tensor *bind[6];
    for (int i = 0; i < 5; i++) v[i] = e.b.t[i].t, bind[i] = &v[i];
    bind[5] = NULL;
    v[1].shape[0] = K - 1;
    EXPECT(smelt_graph_run(e.b.g, bind), SMELT_STATUS_SHAPE_MISMATCH, "smelt_graph_run: w");
    v[1] = e.b.t[1].t;
    bind[5] = &v[0];
    EXPECT(smelt_graph_run(e.b.g, bind), SMELT_STATUS_INVALID_ARGUMENT, "\"h\" is an intermediate");
    bind[5] = NULL, bind[3] = NULL;
    EXPECT(smelt_graph_run(e.b.g, bind), SMELT_STATUS_NULL_POINTER, "bind[3] (\"y\", an output) is NULL");
    bind[3] = &v[4];
    EXPECT(smelt_graph_run(e.b.g, bind), SMELT_STATUS_INVALID_ARGUMENT, "overlaps");
    untouched(&e);
    tg_free(&e.b);
    vals_free(&vals);
  }
}

const th_test th_tests_graph[] = {
    {"fixed_epilogue", test_fixed_epilogue},
    {"epilogue_graph", test_epilogue_graph},
    {"swiglu", test_swiglu},
    {"norm_residual", test_norm_residual},
    {"elementwise", test_elementwise},
    {"attention", test_attention},
    {"bind", test_bind},
    {"replan", test_replan},
    {"bad_ops", test_bad_ops},
    {"bad_graphs", test_bad_graphs},
    {"bad_bind", test_bad_bind},
    {0, 0},
};
