/* smelt_qgemm (include/smelt/qgemm.h). The CPU reference against a naive
 * f64 computation written here from the formats' definitions (its own
 * E2M1 and E4M3 tables, not the library's decoders): odd N, K a multiple
 * of 16, M across the GEMV/GEMM boundary, the tensor scale, bias and
 * activations, strided views, blocks of zero, NaN, subnormal and largest
 * scales, tiny and huge tensor scales. Bad arguments fail with the
 * documented status and write nothing. With a GPU, both CUDA paths (the
 * GEMV for M <= 16, split K or not, fast and element-wise loads; the
 * dequantizer + GEMM for M > 16) against the CPU reference, outputs
 * poisoned and padded, and the split-K reduction repeated bit for bit. */
#include "core/error_bound.h"
#include "harness.h"

/* One problem and its layouts. */
typedef struct qg_case {
  int64_t m, n, k;
  smelt_dtype xdt, ddt, bdt; /* bdt: the bias's dtype, SMELT_DTYPE_COUNT for none */
  smelt_act act;
  double alpha;
  int x_colmajor;    /* x as the transpose of a [K, M] buffer */
  int s_kmajor;      /* scales stored column-major ([N, K/16] with strides [1, N]) */
  int64_t q_pad;     /* extra bytes per row of q */
  int64_t d_pad;     /* extra elements per row of d (left poisoned) */
  int ts_exp;        /* tensor scale about 2^ts_exp */
  int specials;      /* zero, subnormal, largest and NaN scale blocks, zero rows of x */
} qg_case;

/* The inputs, logically (row-major, contiguous). */
typedef struct qg_data {
  double *x;     /* [M, K], values of xdt */
  uint8_t *q;    /* [N, K/2] */
  uint8_t *s;    /* [N, K/16] e4m3 bytes */
  float ts;
  double *bias;  /* [N] values of bdt, or NULL */
} qg_data;

static const double e2m1_values[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

static double e2m1(unsigned c) { return (c & 8u ? -1.0 : 1.0) * e2m1_values[c & 7u]; }

/* E4M3 (OCP FN): S.EEEE.MMM, bias 7, subnormals, S.1111.111 NaN, no inf. */
static double e4m3(unsigned b) {
  const unsigned e = (b >> 3) & 15u, m = b & 7u;
  if ((b & 0x7fu) == 0x7fu) return NAN;
  const double v = e ? ldexp(1.0 + m / 8.0, (int)e - 7) : ldexp(m, -9);
  return b & 0x80u ? -v : v;
}

static double random_scale_byte(void) {
  return (double)((unsigned)th_rand_uniform(4, 11) << 3 | (unsigned)th_rand_uniform(0, 8));
}

static void make_data(const qg_case *c, qg_data *dd) {
  const int64_t kb = c->k / 16;
  dd->x = malloc((size_t)(c->m * c->k + 1) * sizeof(double));
  dd->q = malloc((size_t)(c->n * c->k / 2 + 1));
  dd->s = malloc((size_t)(c->n * kb + 1));
  dd->bias = c->bdt != SMELT_DTYPE_COUNT ? malloc((size_t)(c->n + 1) * sizeof(double)) : NULL;
  for (int64_t i = 0; i < c->m * c->k; i++) {
    const double v = th_rand_uniform(-1, 1);
    uint16_t h;
    th_set(&h, c->xdt, 0, v); /* rounded to x's dtype */
    dd->x[i] = th_get(&h, c->xdt, 0);
  }
  for (int64_t i = 0; i < c->n * c->k / 2; i++) dd->q[i] = (uint8_t)th_rand_u64();
  for (int64_t i = 0; i < c->n * kb; i++) dd->s[i] = (uint8_t)random_scale_byte();
  dd->ts = (float)ldexp(th_rand_uniform(0.5, 1.0), c->ts_exp);
  if (c->specials && c->n > 3 && kb > 0) {
    for (int64_t j = 0; j < kb; j++) dd->s[0 * kb + j] = 0x00;  /* column 0: all zero */
    dd->s[1 * kb + kb - 1] = 0x7e;                               /* 448 */
    dd->s[2 * kb + 0] = 0x01;                                    /* the smallest subnormal, 2^-9 */
    dd->s[3 * kb + kb / 2] = (uint8_t)(th_rand_u64() & 1 ? 0x7f : 0xff); /* NaN: column 3 is NaN */
    for (int64_t k = 0; k < c->k && c->m > 1; k++) dd->x[1 * c->k + k] = 0.0; /* row 1 of x zero */
  }
  for (int64_t n = 0; dd->bias && n < c->n; n++) {
    float v = (float)th_rand_uniform(-2, 2);
    uint16_t h;
    th_set(&h, c->bdt == SMELT_DTYPE_F32 ? SMELT_DTYPE_BF16 : c->bdt, 0, v);
    dd->bias[n] = th_get(&h, c->bdt == SMELT_DTYPE_F32 ? SMELT_DTYPE_BF16 : c->bdt, 0);
  }
}

static void free_data(qg_data *dd) {
  free(dd->x);
  free(dd->q);
  free(dd->s);
  free(dd->bias);
}

/* The naive f64 result [M, N]. */
static void reference(const qg_case *c, const qg_data *dd, double *ref) {
  const int64_t kb = c->k / 16;
  for (int64_t m = 0; m < c->m; m++)
    for (int64_t n = 0; n < c->n; n++) {
      double acc = 0.0;
      for (int64_t k = 0; k < c->k; k++) {
        const unsigned code = (dd->q[n * c->k / 2 + k / 2] >> ((k & 1) * 4)) & 15u;
        acc += dd->x[m * c->k + k] * (e2m1(code) * e4m3(dd->s[n * kb + k / 16]) * (double)dd->ts);
      }
      const double v = c->alpha * acc + (dd->bias ? dd->bias[n] : 0.0);
      ref[m * c->n + n] = smelt_act_apply(c->act, v, 0.01);
    }
}

/* Buffers and views of one run on ctx. */
typedef struct qg_bufs {
  th_buf x, q, s, t, b, d;
  th_view xv, qv, sv, tv, bv, dv;
} qg_bufs;

static void bufs_make(smelt_ctx *ctx, const qg_case *c, const qg_data *dd, qg_bufs *B) {
  const int64_t kb = c->k / 16, xsh[2] = {c->m, c->k}, qsh[2] = {c->n, c->k / 2}, ssh[2] = {c->n, kb};
  const int64_t xst[2] = {c->x_colmajor ? 1 : c->k, c->x_colmajor ? c->m : 1}, qst[2] = {c->k / 2 + c->q_pad, 1};
  const int64_t sst[2] = {c->s_kmajor ? 1 : kb, c->s_kmajor ? c->n : 1}, one[1] = {1}, unit[1] = {1};
  const int64_t dsh[2] = {c->m, c->n}, dst[2] = {c->n + c->d_pad, 1}, bsh[1] = {c->n}, bst[1] = {2};
  B->xv = th_view_make(2, xsh, xst, 0);
  B->qv = th_view_make(2, qsh, qst, 0);
  B->sv = th_view_make(2, ssh, sst, 0);
  B->tv = th_view_make(1, one, unit, 0);
  B->bv = th_view_make(1, bsh, bst, 0);
  B->dv = th_view_make(2, dsh, dst, 0);
  const size_t xes = smelt_dtype_size(c->xdt);
  uint8_t *hx = calloc((size_t)B->xv.storage + 1, xes), *hq = calloc((size_t)B->qv.storage + 1, 1);
  uint8_t *hs = calloc((size_t)B->sv.storage + 1, 1), *hb = calloc((size_t)B->bv.storage + 1, 8);
  for (int64_t i = 0; i < c->m * c->k; i++) th_set(hx, c->xdt, th_view_off(&B->xv, i), dd->x[i]);
  for (int64_t r = 0; r < c->n; r++) memcpy(hq + r * qst[0], dd->q + r * c->k / 2, (size_t)(c->k / 2));
  for (int64_t i = 0; i < c->n * kb; i++) hs[th_view_off(&B->sv, i)] = dd->s[i];
  for (int64_t n = 0; dd->bias && n < c->n; n++) th_set(hb, c->bdt, th_view_off(&B->bv, n), dd->bias[n]);
  B->x = th_buf_new(ctx, (size_t)B->xv.storage * xes + 1);
  B->q = th_buf_new(ctx, (size_t)B->qv.storage + 1);
  B->s = th_buf_new(ctx, (size_t)B->sv.storage + 1);
  B->t = th_buf_new(ctx, 4);
  B->b = th_buf_new(ctx, (size_t)B->bv.storage * 8 + 1);
  B->d = th_buf_new(ctx, (size_t)B->dv.storage * smelt_dtype_size(c->ddt) + 1);
  th_buf_upload(&B->x, hx, (size_t)B->xv.storage * xes);
  th_buf_upload(&B->q, hq, (size_t)B->qv.storage);
  th_buf_upload(&B->s, hs, (size_t)B->sv.storage);
  th_buf_upload(&B->t, &dd->ts, 4);
  if (dd->bias) th_buf_upload(&B->b, hb, (size_t)B->bv.storage * smelt_dtype_size(c->bdt));
  free(hx);
  free(hq);
  free(hs);
  free(hb);
}

static void bufs_free(qg_bufs *B) {
  th_buf_free(&B->x);
  th_buf_free(&B->q);
  th_buf_free(&B->s);
  th_buf_free(&B->t);
  th_buf_free(&B->b);
  th_buf_free(&B->d);
}

/* The call's tensors over B. */
typedef struct qg_args {
  smelt_tensor x, q, s, t, b, d;
  smelt_qgemm_weights w;
  smelt_qgemm_desc desc;
} qg_args;

static void args_make(const qg_case *c, const qg_bufs *B, qg_args *a) {
  a->x = th_view_tensor(&B->xv, &B->x, c->xdt);
  a->q = th_view_tensor(&B->qv, &B->q, SMELT_DTYPE_U8);
  a->s = th_view_tensor(&B->sv, &B->s, SMELT_DTYPE_E4M3);
  a->t = th_view_tensor(&B->tv, &B->t, SMELT_DTYPE_F32);
  a->b = th_view_tensor(&B->bv, &B->b, c->bdt == SMELT_DTYPE_COUNT ? SMELT_DTYPE_F32 : c->bdt);
  a->d = th_view_tensor(&B->dv, &B->d, c->ddt);
  a->w = (smelt_qgemm_weights){SMELT_QUANT_NVFP4, &a->q, &a->s, &a->t};
  a->desc = smelt_qgemm_desc_default();
  a->desc.alpha = c->alpha;
  a->desc.act = c->act;
}

/* Random inputs for c, on ctx, and the call's tensors over them. */
static void setup(smelt_ctx *ctx, const qg_case *c, qg_data *dd, qg_bufs *B, qg_args *a) {
  make_data(c, dd);
  bufs_make(ctx, c, dd, B);
  args_make(c, B, a);
}

/* Runs c on ctx; got [M, N] (every element written, padding untouched). */
static void run_on(smelt_ctx *ctx, const qg_case *c, const qg_data *dd, double *got) {
  qg_bufs B;
  qg_args a;
  bufs_make(ctx, c, dd, &B);
  args_make(c, &B, &a);
  CHECK_OK(smelt_qgemm(ctx, &a.desc, &a.x, &a.w, dd->bias ? &a.b : NULL, &a.d));
  CHECK_OK(smelt_ctx_synchronize(ctx));
  th_check_output("qgemm", "d", &B.dv, &B.d, c->ddt, got);
  CHECK(th_buf_guards_ok(&B.x) && th_buf_guards_ok(&B.q) && th_buf_guards_ok(&B.s) && th_buf_guards_ok(&B.b));
  bufs_free(&B);
}

static double bound(smelt_ctx *ctx, smelt_dtype dt) {
  const smelt__bound_query q = {.family = "qgemm", .metric = SMELT__METRIC_REL_L2, .device = smelt_ctx_device(ctx),
                                .dtype = dt};
  return smelt__error_bound(&q);
}

static const char *case_str(const qg_case *c, char *buf, size_t n) {
  snprintf(buf, n, "M=%lld N=%lld K=%lld x %s d %s bias %s act %d%s%s%s", (long long)c->m, (long long)c->n,
           (long long)c->k, smelt_dtype_name(c->xdt), smelt_dtype_name(c->ddt),
           c->bdt == SMELT_DTYPE_COUNT ? "none" : smelt_dtype_name(c->bdt), (int)c->act,
           c->x_colmajor ? " x-colmajor" : "", c->s_kmajor ? " s-kmajor" : "", c->specials ? " specials" : "");
  return buf;
}

/* ---------------------------------------------------------------- CPU */

static const qg_case cpu_cases[] = {
    {1, 37, 64, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_COUNT, SMELT_ACT_IDENTITY, 1.0, 0, 0, 0, 0, 0, 0},
    {3, 5, 16, SMELT_DTYPE_F16, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_ACT_RELU, 0.5, 1, 0, 3, 2, -3, 0},
    {16, 33, 528, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_ACT_GELU, 1.0, 0, 1, 0, 1, 0, 1},
    {17, 9, 96, SMELT_DTYPE_BF16, SMELT_DTYPE_F16, SMELT_DTYPE_F16, SMELT_ACT_SILU, -2.0, 0, 0, 7, 0, -60, 1},
    {64, 7, 48, SMELT_DTYPE_F16, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_ACT_LEAKY_RELU, 1.0, 1, 1, 0, 3, 40, 1},
};

static void test_qgemm_cpu_vs_naive(void) {
  for (size_t i = 0; i < sizeof cpu_cases / sizeof *cpu_cases; i++) {
    const qg_case *c = &cpu_cases[i];
    qg_data dd;
    make_data(c, &dd);
    double *ref = malloc((size_t)(c->m * c->n) * sizeof(double)), *got = malloc((size_t)(c->m * c->n) * sizeof(double));
    reference(c, &dd, ref);
    run_on(th_cpu(), c, &dd, got);
    char what[200];
    CHECK(th_compare(case_str(c, what, sizeof what), got, ref, c->m * c->n, bound(th_cpu(), c->ddt), 0.0));
    if (c->specials && c->n > 3)
      for (int64_t m = 0; m < c->m; m++) {
        CHECK(isnan(got[m * c->n + 3]));             /* a NaN scale block poisons its column */
        if (c->alpha > 0 && c->bdt == SMELT_DTYPE_COUNT) CHECK(got[m * c->n] == 0.0); /* zero scales */
      }
    free(ref);
    free(got);
    free_data(&dd);
    if (th_failed_now) return;
  }
}

/* Hand-checked: x = 1, each W row one code and scale, ts = 0.5. */
static void test_qgemm_cpu_hand(void) {
  const qg_case c = {2, 3, 16, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_COUNT, SMELT_ACT_IDENTITY, 1.0,
                     0, 0, 0, 0, 0, 0};
  qg_data dd = {0};
  dd.x = malloc(32 * sizeof(double));
  dd.q = calloc(24, 1);
  dd.s = malloc(3);
  for (int i = 0; i < 32; i++) dd.x[i] = i < 16 ? 1.0 : -2.0;
  dd.q[0] = 0x91;       /* codes 1 (0.5) and 9 (-0.5) */
  dd.q[8] = 0x07;       /* 6, then zeros */
  dd.q[16 + 7] = 0xf0;  /* code 0 at k = 14, 15 (-6) at k = 15 */
  dd.s[0] = 0x38;       /* 1.0 */
  dd.s[1] = 0x7e;       /* 448 */
  dd.s[2] = 0x01;       /* 2^-9 */
  dd.ts = 0.5f;
  double got[6];
  run_on(th_cpu(), &c, &dd, got);
  const double want[6] = {0.0, 6 * 448 * 0.5, -6 * 0x1p-9 * 0.5, 0.0, -2 * 6 * 448 * 0.5, 2 * 6 * 0x1p-9 * 0.5};
  for (int i = 0; i < 6; i++)
    if (got[i] != want[i]) th_fail(__FILE__, __LINE__, "d[%d] = %.17g, want %.17g", i, got[i], want[i]);
  free_data(&dd);
}

/* Each bad call fails with its status and message, and d stays poisoned. */
static void test_qgemm_bad_inputs(void) {
  const qg_case c = {4, 5, 32, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_ACT_IDENTITY, 1.0,
                     0, 0, 0, 0, 0, 0};
  smelt_ctx *ctx = th_cpu();
  qg_data dd;
  qg_bufs B;
  qg_args a;
  setup(ctx, &c, &dd, &B, &a);
  smelt_qgemm_weights w = a.w;
  w.format = SMELT_QUANT_FP8_1X128;
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &a.x, &w, NULL, &a.d), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("fp8-1x128");
  w.format = SMELT_QUANT_MXFP8;
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &a.x, &w, NULL, &a.d), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("mxfp8");
  w.format = (smelt_quant_format)99;
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &a.x, &w, NULL, &a.d), SMELT_STATUS_INVALID_ARGUMENT);
  smelt_tensor xf = a.x;
  xf.dtype = SMELT_DTYPE_F32;
  xf.strides[0] /= 2; /* keep the view inside its buffer */
  xf.shape[1] /= 2;
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &xf, &a.w, NULL, &a.d), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("f32 activations");
  smelt_tensor xk = a.x;
  xk.shape[1] = 24; /* K not a multiple of 16 */
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &xk, &a.w, NULL, &a.d), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("multiple of 16");
  smelt_tensor qs = a.q;
  qs.shape[1] = 15;
  w = a.w;
  w.q = &qs;
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &a.x, &w, NULL, &a.d), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("q.shape");
  w = a.w;
  w.tensor_scale = NULL;
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &a.x, &w, NULL, &a.d), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("tensor_scale");
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &a.x, NULL, NULL, &a.d), SMELT_STATUS_NULL_POINTER);
  smelt_tensor bs = a.b;
  bs.shape[0] = 4;
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &a.x, &a.w, &bs, &a.d), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("bias.shape");
  smelt_tensor dm = a.d;
  dm.shape[0] = 3;
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &a.x, &a.w, NULL, &dm), SMELT_STATUS_SHAPE_MISMATCH);
  smelt_qgemm_desc desc = smelt_qgemm_desc_default();
  desc.alpha = NAN;
  CHECK_STATUS(smelt_qgemm(ctx, &desc, &a.x, &a.w, NULL, &a.d), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("alpha");
  desc = smelt_qgemm_desc_default();
  desc.act = SMELT_ACT_COUNT;
  CHECK_STATUS(smelt_qgemm(ctx, &desc, &a.x, &a.w, NULL, &a.d), SMELT_STATUS_INVALID_ARGUMENT);
  smelt_tensor dx = a.x; /* d over x's memory */
  dx.dtype = SMELT_DTYPE_F32;
  dx.shape[1] = 5;
  dx.strides[0] = 5;
  CHECK_STATUS(smelt_qgemm(ctx, NULL, &a.x, &a.w, NULL, &dx), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK(th_buf_untouched(&B.d));
  /* A plan binds weights of its format only. */
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_qgemm_plan(ctx, NULL, &a.x, &a.w, &a.b, &a.d, &plan));
  w = a.w;
  w.format = SMELT_QUANT_MXFP8;
  CHECK_STATUS(smelt_qgemm_run(plan, &a.x, &w, &a.b, &a.d), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(smelt_qgemm_run(plan, &a.x, &a.w, NULL, &a.d), SMELT_STATUS_NULL_POINTER);
  CHECK(th_buf_untouched(&B.d));
  CHECK_OK(smelt_qgemm_run(plan, &a.x, &a.w, &a.b, &a.d));
  smelt_plan_destroy(plan);
  bufs_free(&B);
  free_data(&dd);
}

/* K = 0 gives act(bias), on every backend and both CUDA paths. */
static void test_qgemm_empty(void) {
  smelt_ctx *ctxs[2] = {th_cpu(), th_cuda()};
  for (int i = 0; i < 4; i++) {
    if (!ctxs[i / 2]) continue;
    const qg_case c = {i % 2 ? 20 : 3, 5, 0, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_ACT_RELU, 1.0,
                       0, 0, 0, 0, 0, 0};
    qg_data dd;
    make_data(&c, &dd);
    double got[100], ref[100];
    reference(&c, &dd, ref);
    run_on(ctxs[i / 2], &c, &dd, got);
    CHECK(th_compare("K = 0", got, ref, c.m * c.n, 1e-7, 0.0));
    free_data(&dd);
  }
}

/* ---------------------------------------------------------------- GPU */

static const qg_case gpu_cases[] = {
    /* The GEMV with K split (N small): 1040 = two chunks and a 16-wide tail, element-wise (q rows of
     * 520 bytes); then 16-byte loads, whole chunks and (1664) a 128-wide tail. */
    {1, 300, 1040, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_COUNT, SMELT_ACT_IDENTITY, 1.0, 0, 0, 0, 3, 0, 1},
    {4, 257, 2048, SMELT_DTYPE_F16, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_ACT_GELU, 0.75, 0, 0, 0, 0, -20, 1},
    {8, 129, 512, SMELT_DTYPE_BF16, SMELT_DTYPE_F16, SMELT_DTYPE_BF16, SMELT_ACT_SILU, 1.0, 0, 0, 16, 1, 0, 0},
    {9, 131, 1664, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_F16, SMELT_ACT_RELU, 1.0, 0, 0, 0, 2, 3, 1},
    {16, 515, 4096, SMELT_DTYPE_F16, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_ACT_IDENTITY, -1.5, 0, 0, 0, 1, 0, 1},
    /* One chunk: no split. */
    {16, 4001, 272, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_COUNT, SMELT_ACT_TANH, 1.0, 0, 0, 0, 0, 0, 1},
    /* Element-wise loads: strided x, k-major scales, q rows not 16-byte units. */
    {5, 77, 1056, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_COUNT, SMELT_ACT_IDENTITY, 1.0, 1, 1, 3, 1, 0, 1},
    {13, 200, 528, SMELT_DTYPE_F16, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_ACT_IDENTITY, 1.0, 0, 0, 5, 0, 0, 0},
    /* M > 16: dequantized W through the 16-bit GEMM. */
    {17, 129, 528, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_ACT_GELU, 1.0, 0, 0, 0, 1, 0, 1},
    {64, 250, 1024, SMELT_DTYPE_F16, SMELT_DTYPE_F32, SMELT_DTYPE_COUNT, SMELT_ACT_IDENTITY, 2.0, 0, 0, 3, 0, -4, 1},
    {100, 96, 48, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_ACT_SILU, 1.0, 1, 1, 0, 5, 0, 0},
};

static void test_qgemm_gpu_vs_cpu(void) {
  smelt_ctx *gpu = th_cuda();
  if (!gpu) SKIP("no CUDA device");
  for (size_t i = 0; i < sizeof gpu_cases / sizeof *gpu_cases; i++) {
    const qg_case *c = &gpu_cases[i];
    qg_data dd;
    make_data(c, &dd);
    const size_t bytes = (size_t)(c->m * c->n) * sizeof(double);
    double *ref = malloc(bytes), *got = malloc(bytes);
    run_on(th_cpu(), c, &dd, ref);
    run_on(gpu, c, &dd, got);
    char what[200];
    CHECK(th_compare(case_str(c, what, sizeof what), got, ref, c->m * c->n, bound(gpu, c->ddt), 0.0));
    free(ref);
    free(got);
    free_data(&dd);
    if (th_failed_now) return;
  }
}

/* The exactness of the decoding, alone: one nonzero x per row picks one
 * column of W, so D holds single weights, e2m1 · e4m3 · ts, which must come
 * out exactly in f32 (every code, subnormal and largest scales). */
static void test_qgemm_gpu_exact_weights(void) {
  smelt_ctx *gpu = th_cuda();
  if (!gpu) SKIP("no CUDA device");
  for (int mm = 0; mm < 2; mm++) {
    const int64_t M = mm ? 32 : 16; /* the GEMV and the dequantizer */
    const qg_case c = {M, 67, 1024, mm ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_COUNT,
                       SMELT_ACT_IDENTITY, 1.0, 0, 0, 0, 0, 0, 0};
    qg_data dd;
    make_data(&c, &dd);
    for (int64_t m = 0; m < M; m++)
      for (int64_t k = 0; k < c.k; k++) dd.x[m * c.k + k] = k == 31 * m + 5 ? 1.0 : 0.0;
    for (int64_t n = 0; n < c.n; n++) /* largest, subnormal and ordinary scales where row n % M picks */
      dd.s[n * 64 + (31 * (n % M) + 5) / 16] = (uint8_t)(n % 3 == 0 ? 0x7e : n % 3 == 1 ? 0x03 : 0x3d);
    dd.ts = 0.375f;
    const size_t bytes = (size_t)(M * c.n) * sizeof(double);
    double *ref = malloc(bytes), *got = malloc(bytes);
    reference(&c, &dd, ref);
    run_on(gpu, &c, &dd, got);
    for (int64_t i = 0; i < M * c.n; i++)
      if (got[i] != ref[i]) {
        th_fail(__FILE__, __LINE__, "M=%lld d[%lld] = %.9g, want %.9g exactly", (long long)M, (long long)i, got[i],
                ref[i]);
        break;
      }
    free(ref);
    free(got);
    free_data(&dd);
  }
}

/* The split-K reduction adds the slices in a fixed order: two runs of one
 * plan give the same bits. */
static void test_qgemm_gpu_deterministic(void) {
  smelt_ctx *gpu = th_cuda();
  if (!gpu) SKIP("no CUDA device");
  const qg_case c = {7, 190, 8192, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_COUNT, SMELT_ACT_IDENTITY, 1.0,
                     0, 0, 0, 0, 0, 0};
  qg_data dd;
  qg_bufs B;
  qg_args a;
  setup(gpu, &c, &dd, &B, &a);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_qgemm_plan(gpu, &a.desc, &a.x, &a.w, NULL, &a.d, &plan));
  const size_t bytes = (size_t)B.dv.storage * 4;
  uint8_t *first = malloc(bytes), *again = malloc(bytes);
  CHECK_OK(smelt_qgemm_run(plan, &a.x, &a.w, NULL, &a.d));
  CHECK_OK(smelt_ctx_synchronize(gpu));
  th_buf_download(&B.d, first, bytes);
  for (int r = 0; r < 3; r++) CHECK_OK(smelt_qgemm_run(plan, &a.x, &a.w, NULL, &a.d));
  CHECK_OK(smelt_ctx_synchronize(gpu));
  th_buf_download(&B.d, again, bytes);
  CHECK(!memcmp(first, again, bytes));
  smelt_plan_destroy(plan);
  free(first);
  free(again);
  bufs_free(&B);
  free_data(&dd);
}

const th_test th_tests_qgemm[] = {
    {"cpu_vs_naive", test_qgemm_cpu_vs_naive},
    {"cpu_hand", test_qgemm_cpu_hand},
    {"bad_inputs", test_qgemm_bad_inputs},
    {"empty", test_qgemm_empty},
    {"gpu_vs_cpu", test_qgemm_gpu_vs_cpu},
    {"gpu_exact_weights", test_qgemm_gpu_exact_weights},
    {"gpu_deterministic", test_qgemm_gpu_deterministic},
    {0, 0},
};
