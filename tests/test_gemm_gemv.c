/* The skinny-M GEMM (kernels/gemm_gemv.cu, M <= 16): which GEMMs the
 * selector gives it (on a faked sm_90 and sm_80, no GPU needed) and, with
 * a GPU, its results against a naive double-precision computation written
 * here: M from 1 to 16, odd N (1, 7, 1000, 4099: a last block of 32
 * columns cut anywhere), K from 8 to 8192 (13: a chunk of single
 * elements), slices chosen by smelt and asked for, batches, and every kind
 * of epilogue. Every case's plan must name the kernel, so a change of the
 * selector cannot quietly move these cases elsewhere; D is a padded view
 * into a poisoned buffer (rows above and between batches, columns past
 * N), which must keep its poison outside the view. */
#include "core/error_bound.h"
#include "cuda/gemm_cuda.h"
#include "harness.h"

#include <float.h>
#include <math.h>

/* ---------------------------------------------------------------- selection (no GPU needed) */

/* The selector's choice for M x N x K with K-major A and B (as
 * smelt__gemm_facts_of finds them) on a faked device, as the kernel's name. */
static const char *choice(const smelt__gemm_state *st, int64_t m, int64_t n, int64_t k, int a_k, int b_k, int cc,
                          char *why) {
  static smelt__kernel_src src;
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int count = smelt__gemm_table(table);
  smelt_device_info dev;
  memset(&dev, 0, sizeof dev);
  dev.cc_major = cc / 10;
  dev.cc_minor = cc % 10;
  dev.sm_count = cc == 90 ? 132 : 108;
  snprintf(dev.arch, sizeof dev.arch, "sm_%d%s", cc, cc == 90 ? "a" : "");
  const smelt__gemm_facts f = {.a_k = a_k, .a_mn = 1, .b_k = b_k, .b_mn = 1, .tma_a = {1, 1}, .tma_b = {1, 1}, .m = m, .n = n, .k = k,
                               .batch = 1, .sm90_d = 1, .k_min = k};
  int ki = -1;
  why[0] = 0;
  if (smelt__gemm_select(st, &f, &dev, table, count, &ki, why, 96) != SMELT_OK) return "";
  smelt__gemm_kernel_src(&table[ki], &src);
  return src.name;
}

static int is_gemv(const char *name) { return !strncmp(name, "gemm_gemv_", 10); }

static void test_selector(void) {
  smelt__gemm_state st;
  memset(&st, 0, sizeof st);
  st.desc = smelt_gemm_desc_default();
  st.mode = SMELT_GEMM_MODE_PLAIN;
  st.acc = SMELT_GEMM_ACC_F32;
  st.dt_a = st.dt_b = st.dt_d = SMELT_DTYPE_BF16;
  char why[96];
  static const int ccs[] = {90, 80};
  for (int i = 0; i < 2; i++) {
    const int cc = ccs[i];
    /* M <= 16 with K-major A and B: the GEMV kernel, both 16-bit types,
     * whatever N and K; M = 17 and up: not. */
    static const int64_t ms[] = {1, 4, 13, 16};
    for (int j = 0; j < 4; j++) {
      CHECK(!strcmp(choice(&st, ms[j], 4096, 4096, 1, 1, cc, why), "gemm_gemv_bf16_RC_16x32"));
      CHECK(strstr(why, "skinny M: GEMV streaming B") != NULL);
      CHECK(is_gemv(choice(&st, ms[j], 7, 8192 * 4, 1, 1, cc, why)));
    }
    for (int64_t m = 17; m <= 4096; m *= 4) CHECK(!is_gemv(choice(&st, m, 4096, 4096, 1, 1, cc, why)));
    st.dt_a = st.dt_b = SMELT_DTYPE_F16;
    CHECK(!strcmp(choice(&st, 1, 8192, 8192, 1, 1, cc, why), "gemm_gemv_f16_RC_16x32"));
    st.dt_a = st.dt_b = SMELT_DTYPE_BF16;
    /* Not for an N-major B (x @ W with W [K, N]), an M-major A or
     * unaligned operands (facts 0). */
    CHECK(!is_gemv(choice(&st, 1, 4096, 4096, 1, 0, cc, why)));
    CHECK(!is_gemv(choice(&st, 1, 4096, 4096, 0, 1, cc, why)));
    /* A tile or opclass that excludes it; its own tile keeps it. */
    st.desc.tile.m = 64;
    CHECK(!is_gemv(choice(&st, 1, 4096, 4096, 1, 1, cc, why)));
    st.desc.tile.m = 16;
    CHECK(is_gemv(choice(&st, 1, 4096, 4096, 1, 1, cc, why)));
    st.desc.tile.m = 0;
    st.desc.tile.cluster_m = 2;
    CHECK(!is_gemv(choice(&st, 1, 4096, 4096, 1, 1, cc, why)));
    st.desc.tile.cluster_m = 0;
    st.desc.math.opclass = SMELT_GEMM_OPCLASS_SIMT;
    CHECK(!strcmp(choice(&st, 1, 4096, 4096, 1, 1, cc, why), "gemm_simt_accf32"));
    st.desc.math.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
    CHECK(is_gemv(choice(&st, 1, 4096, 4096, 1, 1, cc, why)));
    st.desc.math.opclass = SMELT_GEMM_OPCLASS_AUTO;
    /* Modes: batched and parallel splits yes; serial splits and grouped no. */
    st.mode = SMELT_GEMM_MODE_BATCHED;
    CHECK(is_gemv(choice(&st, 16, 4096, 4096, 1, 1, cc, why)));
    st.mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
    st.split_k = 4;
    CHECK(is_gemv(choice(&st, 16, 4096, 4096, 1, 1, cc, why)));
    st.mode = SMELT_GEMM_MODE_SPLIT_K_SERIAL;
    CHECK(!is_gemv(choice(&st, 16, 4096, 4096, 1, 1, cc, why)));
    st.mode = SMELT_GEMM_MODE_GROUPED;
    st.split_k = 1;
    CHECK(!is_gemv(choice(&st, 16, 4096, 4096, 1, 1, cc, why)));
    st.mode = SMELT_GEMM_MODE_PLAIN;
    /* Other operand types: tf32 and fp8 keep their kernels. */
    st.dt_a = st.dt_b = SMELT_DTYPE_F32;
    st.desc.math.op = SMELT_GEMM_MATH_TF32;
    CHECK(!is_gemv(choice(&st, 1, 4096, 4096, 1, 1, cc, why)));
    st.desc.math.op = SMELT_GEMM_MATH_DEFAULT;
    st.dt_a = st.dt_b = SMELT_DTYPE_E4M3;
    CHECK(!is_gemv(choice(&st, 1, 4096, 4096, 1, 1, cc, why)));
    st.dt_a = st.dt_b = SMELT_DTYPE_BF16;
  }
  /* Before sm_80: SIMT. */
  CHECK(!strcmp(choice(&st, 1, 4096, 4096, 1, 1, 75, why), "gemm_simt_accf32"));
  /* The autotuner's candidates include it. */
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int count = smelt__gemm_table(table);
  smelt_device_info dev;
  memset(&dev, 0, sizeof dev);
  dev.cc_major = 9;
  dev.sm_count = 132;
  const smelt__gemm_facts f = {.a_k = 1, .a_mn = 1, .b_k = 1, .b_mn = 1, .tma_a = {1, 1}, .tma_b = {1, 1}, .m = 4, .n = 4096, .k = 4096,
                               .batch = 1, .sm90_d = 1, .k_min = 4096};
  int cand[SMELT__GEMM_MAX_KERNELS], gemv = 0;
  const int nc = smelt__gemm_candidates(&st, &f, &dev, table, count, cand, SMELT__GEMM_MAX_KERNELS);
  for (int i = 0; i < nc && i < SMELT__GEMM_MAX_KERNELS; i++) gemv += table[cand[i]].fam == SMELT__GK_GEMV;
  CHECK_EQ_INT(gemv, 1);
}

/* ---------------------------------------------------------------- GPU cases */

typedef struct vcase {
  smelt_dtype ab, d, bias; /* A and B; C and D; bias */
  int64_t m, n, k, batch;  /* batch 0: 2-D operands */
  int has_c, has_bias;
  smelt_gemm_mode mode;
  int split_k;
  smelt_act act;
  double alpha, beta;
  float scale_d, slope;
  int clamp;
  int expect_split; /* the plan must say "split-K parallel": 1 always, 2 when smelt should choose a split */
} vcase;

static double act_of(smelt_act a, double x, double slope) {
  if (a == SMELT_ACT_GELU) return 0.5 * x * erfc(-x / sqrt(2.0));
  if (a == SMELT_ACT_SILU) return x / (1.0 + exp(-x));
  if (a == SMELT_ACT_RELU) return x > 0 ? x : 0;
  if (a == SMELT_ACT_LEAKY_RELU) return x >= 0 ? x : slope * x;
  return x;
}

/* v as D of type dt holds it (clamped to the finite range when asked). */
static double stored(double v, smelt_dtype dt, int clamp) {
  const double top = dt == SMELT_DTYPE_F16 ? 65504.0 : dt == SMELT_DTYPE_BF16 ? 0x1.fep127 : FLT_MAX;
  if (clamp) v = v > top ? top : v < -top ? -top : v;
  uint8_t one[8];
  th_set(one, dt, 0, v);
  return th_get(one, dt, 0);
}

static int64_t round8(int64_t v) { return (v + 7) / 8 * 8; }

/* Views of a case: A [L?, M, K] rows lda apart, B [L?, K, N] the columns
 * of W [N, K] (rows ldw apart), C and D [L?, M, N] rows N + 3 apart, D one
 * row and one element into its buffer, a spare row between batches. */
typedef struct vviews {
  th_view a, b, c, d;
  int64_t lda, ldw, ldd, ld_batch;
} vviews;

static vviews views_of(const vcase *c) {
  vviews v;
  const int o = c->batch > 0;
  const int64_t L = o ? c->batch : 1;
  v.lda = round8(c->k) + 8;
  v.ldw = round8(c->k) + 8;
  v.ldd = c->n + 3;
  v.ld_batch = (c->m + 1) * v.ldd;
  const int64_t sa[3] = {L, c->m, c->k}, ta[3] = {c->m * v.lda, v.lda, 1};
  const int64_t sb[3] = {L, c->k, c->n}, tb[3] = {c->n * v.ldw, 1, v.ldw};
  const int64_t sd[3] = {L, c->m, c->n}, td[3] = {v.ld_batch, v.ldd, 1};
  v.a = th_view_make(2 + o, sa + 1 - o, ta + 1 - o, 0);
  v.b = th_view_make(2 + o, sb + 1 - o, tb + 1 - o, 0);
  v.c = th_view_make(2 + o, sd + 1 - o, td + 1 - o, 0);
  v.d = th_view_make(2 + o, sd + 1 - o, td + 1 - o, v.ldd + 1);
  v.d.storage += v.ldd; /* and a spare row below */
  return v;
}

/* D as the naive computation gives it, [L][M][N]. */
static void expected(const vcase *c, const vviews *v, const void *a, const void *b, const void *cm, const void *bias,
                     double *out) {
  const int64_t L = c->batch > 0 ? c->batch : 1;
  double *x = (double *)malloc(sizeof(double) * (size_t)(c->m * c->k + 1));
  double *w = (double *)malloc(sizeof(double) * (size_t)(c->n * c->k + 1));
  for (int64_t l = 0; l < L; l++) {
    for (int64_t i = 0; i < c->m * c->k; i++) x[i] = th_get(a, c->ab, l * c->m * v->lda + i / c->k * v->lda + i % c->k);
    for (int64_t i = 0; i < c->n * c->k; i++) w[i] = th_get(b, c->ab, l * c->n * v->ldw + i / c->k * v->ldw + i % c->k);
    for (int64_t r = 0; r < c->m; r++)
      for (int64_t col = 0; col < c->n; col++) {
        double s = 0;
        for (int64_t k = 0; k < c->k; k++) s += x[r * c->k + k] * w[col * c->k + k];
        s *= c->alpha;
        if (c->has_c) s += c->beta * th_get(cm, c->d, l * v->ld_batch + r * v->ldd + col);
        if (c->has_bias) s += th_get(bias, c->bias, col);
        out[(l * c->m + r) * c->n + col] = stored(act_of(c->act, s, c->slope) * c->scale_d, c->d, c->clamp);
      }
  }
  free(x);
  free(w);
}

/* Plans and runs c twice on the GPU (the plan must name the GEMV kernel;
 * both runs must give the same bits) and checks D against the naive
 * result with the GEMM bound of src/core/error_bound.c. 0 on a failure. */
static int run_case(const vcase *c) {
  smelt_ctx *cu = th_cuda();
  const vviews v = views_of(c);
  const size_t eab = smelt_dtype_size(c->ab), ed = smelt_dtype_size(c->d), eb = smelt_dtype_size(c->bias);
  void *ha = malloc((size_t)v.a.storage * eab), *hb = malloc((size_t)v.b.storage * eab),
       *hc = malloc((size_t)v.c.storage * ed), *hbias = malloc((size_t)c->n * eb), *first = malloc((size_t)v.d.storage * ed),
       *second = malloc((size_t)v.d.storage * ed);
  th_fill_uniform(ha, c->ab, v.a.storage, -1, 1);
  th_fill_uniform(hb, c->ab, v.b.storage, -1, 1);
  th_fill_uniform(hc, c->d, v.c.storage, -1, 1);
  th_fill_uniform(hbias, c->bias, c->n, -1, 1);
  th_buf A = th_buf_new(cu, (size_t)v.a.storage * eab), B = th_buf_new(cu, (size_t)v.b.storage * eab),
         C = th_buf_new(cu, (size_t)v.c.storage * ed), D = th_buf_new(cu, (size_t)v.d.storage * ed),
         Bias = th_buf_new(cu, (size_t)c->n * eb);
  th_buf_upload(&A, ha, A.bytes);
  th_buf_upload(&B, hb, B.bytes);
  th_buf_upload(&C, hc, C.bytes);
  th_buf_upload(&Bias, hbias, Bias.bytes);
  const smelt_tensor ta = th_view_tensor(&v.a, &A, c->ab), tb = th_view_tensor(&v.b, &B, c->ab),
                     tc = th_view_tensor(&v.c, &C, c->d), td = th_view_tensor(&v.d, &D, c->d);
  const int64_t nb[1] = {c->n};
  const smelt_tensor tbias = smelt_tensor_make(Bias.data, c->bias, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), 1, nb);
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.mode = c->mode;
  desc.split_k = c->split_k;
  desc.epilogue.alpha = c->alpha;
  desc.epilogue.beta = c->has_c ? c->beta : 0.0;
  desc.epilogue.act = c->act;
  desc.epilogue.slope = c->slope;
  desc.epilogue.scale_d = c->scale_d;
  desc.epilogue.clamp = c->clamp;
  char label[160];
  snprintf(label, sizeof label, "gemv %s->%s m%lld n%lld k%lld L%lld act %d%s%s split %d", smelt_dtype_name(c->ab),
           smelt_dtype_name(c->d), (long long)c->m, (long long)c->n, (long long)c->k, (long long)c->batch, (int)c->act,
           c->has_c ? " +C" : "", c->has_bias ? " +bias" : "", c->split_k);
  const int fails = th_failed_now;
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_gemm_plan(cu, &desc, &ta, &tb, c->has_c ? &tc : NULL, &td, c->has_bias ? &tbias : NULL, &plan));
  if (plan) {
    const char *how = smelt_plan_describe(plan);
    if (!strstr(how, "gemm_gemv_") || (c->expect_split && !strstr(how, "split-K parallel")))
      th_fail(__FILE__, __LINE__, "%s: planned as %s", label, how);
    for (int rep = 0; rep < 2; rep++) {
      CHECK_OK(smelt_gemm_run(plan, &ta, &tb, c->has_c ? &tc : NULL, &td, c->has_bias ? &tbias : NULL));
      th_buf_download(&D, rep ? second : first, D.bytes);
    }
    if (memcmp(first, second, D.bytes)) th_fail(__FILE__, __LINE__, "%s: two runs differ", label);
    const int64_t n = v.d.numel;
    double *got = (double *)malloc(sizeof(double) * (size_t)n), *want = (double *)malloc(sizeof(double) * (size_t)n);
    th_check_output(label, "D", &v.d, &D, c->d, got);
    expected(c, &v, ha, hb, hc, hbias, want);
    const smelt__bound_query q = {.family = "gemm", .dtype = c->d, .dt_a = c->ab, .gemm = &desc, .has_c = c->has_c};
    th_compare(label, got, want, n, smelt__error_bound(&q), 0);
    free(got);
    free(want);
  }
  smelt_plan_destroy(plan);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&C);
  th_buf_free(&D);
  th_buf_free(&Bias);
  free(ha);
  free(hb);
  free(hc);
  free(hbias);
  free(first);
  free(second);
  if (th_failed_now != fails) th_fail(__FILE__, __LINE__, "case failed: %s", label);
  return th_failed_now == fails;
}

/* A GPU of sm_80 or newer (the kernel's mma.sync), with its SM count. */
static int gemv_device(int *sms) {
  smelt_ctx *cu = th_cuda();
  smelt_device_info di;
  if (!cu || smelt_device_info_get(smelt_ctx_device_index(cu), &di) != SMELT_OK || di.cc_major < 8) return 0;
  *sms = di.sm_count;
  return 1;
}

#define BF SMELT_DTYPE_BF16
#define H SMELT_DTYPE_F16
#define F32 SMELT_DTYPE_F32

/* M from 1 to 16 (one n8 fragment up to 8, two above), odd N, K of one
 * partial chunk (8, 13, 64), of whole and cut chunks over many warps
 * (4104, 8192), with the epilogue kinds spread over them: bias + GELU,
 * beta with C, f32 and f16 D, clamp, alpha, scale_d, leaky ReLU's slope.
 * Fields left 0 take the defaults: alpha and scale_d 1, slope 0.01, an
 * f32 bias. */
static const vcase shapes[] = {
    {.ab = BF, .d = BF, .m = 1, .n = 2200, .k = 8192, .has_bias = 1, .act = SMELT_ACT_GELU}, /* 69 blocks: not split */
    {.ab = BF, .d = BF, .m = 4, .n = 4099, .k = 4104, .has_bias = 1},
    {.ab = H, .d = H, .m = 2, .n = 7, .k = 4104, .has_c = 1, .beta = -0.5},
    {.ab = BF, .d = F32, .m = 3, .n = 1000, .k = 64, .alpha = 1.5, .scale_d = 0.5f},
    {.ab = H, .d = BF, .bias = BF, .m = 5, .n = 1, .k = 8, .has_bias = 1, .act = SMELT_ACT_RELU},
    /* Every output past f16's range: clamped to +-65504. */
    {.ab = H, .d = H, .m = 8, .n = 4099, .k = 64, .alpha = 1e6, .clamp = 1},
    {.ab = BF, .d = BF, .m = 5, .n = 7, .k = 13, .has_c = 1, .beta = 2.0, .has_bias = 1},
    {.ab = H, .d = F32, .m = 13, .n = 300, .k = 8192, .has_bias = 1, .act = SMELT_ACT_SILU, .expect_split = 2},
    {.ab = BF, .d = BF, .m = 16, .n = 4099, .k = 64, .has_c = 1, .beta = 0.25, .act = SMELT_ACT_LEAKY_RELU,
     .slope = 0.2f},
    {.ab = H, .d = BF, .m = 16, .n = 1000, .k = 4104, .has_bias = 1, .act = SMELT_ACT_GELU, .expect_split = 2},
};

/* K in slices: asked for (3 slices of 1408, 1408 and 1288, the last one
 * ending in a cut chunk; 16 slices over 8192), and chosen by smelt; and
 * batches (a B per batch), with C, bias and activations. */
static const vcase splits_batches[] = {
    {.ab = BF, .d = F32, .m = 16, .n = 7, .k = 4104, .mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL, .split_k = 3, .has_c = 1,
     .beta = 0.5, .expect_split = 1},
    {.ab = H, .d = H, .m = 8, .n = 500, .k = 8192, .split_k = 16, .has_bias = 1, .act = SMELT_ACT_GELU,
     .expect_split = 1},
    {.ab = BF, .d = BF, .m = 1, .n = 300, .k = 2048, .has_bias = 1, .expect_split = 2},
    {.ab = BF, .d = BF, .m = 4, .n = 100, .k = 200, .batch = 3, .has_c = 1, .beta = -1.0, .has_bias = 1,
     .act = SMELT_ACT_SILU},
    {.ab = H, .d = F32, .m = 13, .n = 33, .k = 4104, .batch = 2},
};

/* Runs count cases of a table (defaults filled in) until one fails. */
static void run_table(const vcase *cases, int count) {
  int sms;
  if (!gemv_device(&sms)) SKIP("no CUDA device of sm_80 or newer");
  for (int i = 0; i < count; i++) {
    vcase c = cases[i];
    if (!c.bias) c.bias = SMELT_DTYPE_F32;
    if (c.alpha == 0) c.alpha = 1.0;
    if (c.scale_d == 0) c.scale_d = 1.0f;
    if (c.slope == 0) c.slope = 0.01f;
    /* smelt splits K itself when ceil(N / 32) blocks leave half the SMs idle. */
    if (c.expect_split == 2) c.expect_split = 2 * ((c.n + 31) / 32) <= sms;
    if (!run_case(&c)) return;
  }
}

static void test_gpu_shapes(void) { run_table(shapes, (int)(sizeof shapes / sizeof *shapes)); }
static void test_gpu_split_batched(void) { run_table(splits_batches, (int)(sizeof splits_batches / sizeof *splits_batches)); }

const th_test th_tests_gemm_gemv[] = {
    {"selector", test_selector},
    {"gpu_shapes", test_gpu_shapes},
    {"gpu_split_batched", test_gpu_split_batched},
    {0, 0},
};
