/* GEMM tests. On every machine the library's CPU reference is checked
 * against a naive double-precision computation written here (its own
 * activations, conversions and saturation rules), for every dtype
 * combination, layout (RR, RC, CR, CC), epilogue and mode. With a GPU, the
 * same cases (and larger ones: 127, 1000+3, non-multiples of every tile,
 * split-K 1..16, grouped with empty groups, batched with broadcast strides,
 * misaligned pointers) run on CUDA and are compared against the CPU
 * reference with a bound per dtype. Every output is poisoned, padded between
 * rows and guarded at both ends; every element must be written and nothing
 * else. Bad-input tests check status, message and an untouched output. */
#include "core/error_bound.h"
#include "gemm_offs.h"
#include "harness.h"
#include "cuda/gemm_cuda.h"

#include <float.h>
#include <math.h>

/* ---------------------------------------------------------------- a case */

typedef struct gspec {
  smelt_dtype a, b, c, d, bias;
  int has_c, has_bias;
  int a_col, b_col, d_col; /* column-major A, B (and C), D */
  int pad;                 /* spare elements after every row (column) of each matrix */
  int ld16;                /* round leading dimensions up to 16 elements (tensor-op alignment) */
  int64_t m, n, k;
  int64_t batch;  /* 0: plain 2-D operands; L >= 1: batched 3-D */
  int b_bcast;    /* batched: one B for every batch (batch stride 0) */
  int misalign;   /* offset the data pointers of A, B, C, D by one element */
  smelt_gemm_desc desc;
} gspec;

static gspec spec(smelt_dtype a, smelt_dtype b, smelt_dtype d, int64_t m, int64_t n, int64_t k) {
  gspec s;
  memset(&s, 0, sizeof s);
  s.a = a;
  s.b = b;
  s.c = s.d = d;
  s.bias = SMELT_DTYPE_F32;
  s.m = m;
  s.n = n;
  s.k = k;
  s.desc = smelt_gemm_desc_default();
  return s;
}

/* spec with A row-major and B column-major (K contiguous in both) and
 * leading dimensions rounded to 16 elements: the RC layout tensor-op
 * kernels, the Hopper one's TMA loads included, take. */
static gspec rc_spec(smelt_dtype a, smelt_dtype b, smelt_dtype d, int64_t m, int64_t n, int64_t k) {
  gspec s = spec(a, b, d, m, n, k);
  s.b_col = 1;
  s.ld16 = 1;
  return s;
}

/* One matrix operand's memory: [L,] rows x cols, row- or column-major, with
 * `pad` spare elements per line and per batch. */
typedef struct gmat {
  smelt_dtype dt;
  int64_t batch, rows, cols, rs, cs, bs, storage, offset;
} gmat;

static gmat mat_layout(smelt_dtype dt, int64_t batch, int64_t rows, int64_t cols, int col_major, int pad, int bcast,
                       int offset, int ld16) {
  gmat g;
  g.dt = dt;
  g.batch = batch;
  g.rows = rows;
  g.cols = cols;
  g.offset = offset;
  int64_t ld = (col_major ? rows : cols) + pad;
  if (ld16) ld = (ld + 15) / 16 * 16;
  if (col_major) {
    g.rs = 1;
    g.cs = ld;
  } else {
    g.cs = 1;
    g.rs = ld;
  }
  int64_t one = (col_major ? cols * g.cs : rows * g.rs) + pad;
  g.bs = bcast ? 0 : one;
  int64_t nb = batch > 0 ? batch : 1;
  g.storage = offset + (bcast ? one : nb * one) + 1;
  return g;
}

static int64_t mat_off(const gmat *g, int64_t l, int64_t r, int64_t c) {
  return g->offset + l * g->bs + r * g->rs + c * g->cs;
}

static smelt_tensor mat_tensor(const gmat *g, void *base, smelt_ctx *ctx) {
  smelt_tensor t;
  memset(&t, 0, sizeof t);
  t.data = (char *)base + g->offset * (int64_t)smelt_dtype_size(g->dt);
  t.dtype = g->dt;
  t.device = smelt_ctx_device(ctx);
  t.device_index = smelt_ctx_device_index(ctx);
  int o = g->batch > 0;
  t.ndim = 2 + o;
  if (o) {
    t.shape[0] = g->batch;
    t.strides[0] = g->bs;
  }
  t.shape[o] = g->rows;
  t.shape[o + 1] = g->cols;
  t.strides[o] = g->rs;
  t.strides[o + 1] = g->cs;
  return t;
}

/* Host inputs of a case: random values of each dtype. */
typedef struct ginputs {
  gmat ga, gb, gc, gd;
  void *a, *b, *c, *bias;
} ginputs;

static void fill(void *p, smelt_dtype dt, int64_t n) {
  if (dt == SMELT_DTYPE_I8) {
    for (int64_t i = 0; i < n; i++) th_set(p, dt, i, (double)(int)th_rand_uniform(-128, 128));
  } else if (dt == SMELT_DTYPE_I32) {
    for (int64_t i = 0; i < n; i++) th_set(p, dt, i, (double)(int)th_rand_uniform(-1000, 1000));
  } else {
    th_fill_uniform(p, dt, n, dt == SMELT_DTYPE_E4M3 || dt == SMELT_DTYPE_E5M2 ? -2.0 : -1.0,
                    dt == SMELT_DTYPE_E4M3 || dt == SMELT_DTYPE_E5M2 ? 2.0 : 1.0);
  }
}

static void inputs_new(const gspec *s, ginputs *in) {
  int64_t L = s->batch;
  in->ga = mat_layout(s->a, L, s->m, s->k, s->a_col, s->pad, 0, s->misalign, s->ld16);
  in->gb = mat_layout(s->b, L, s->k, s->n, s->b_col, s->pad, s->b_bcast, s->misalign, s->ld16);
  in->gc = mat_layout(s->c, L, s->m, s->n, s->d_col, s->pad, 0, s->misalign, s->ld16);
  in->gd = mat_layout(s->d, L, s->m, s->n, s->d_col, s->pad, 0, s->misalign, s->ld16);
  in->a = malloc((size_t)in->ga.storage * smelt_dtype_size(s->a));
  in->b = malloc((size_t)in->gb.storage * smelt_dtype_size(s->b));
  in->c = malloc((size_t)in->gc.storage * smelt_dtype_size(s->c));
  in->bias = malloc((size_t)(s->n + 1) * smelt_dtype_size(s->bias));
  fill(in->a, s->a, in->ga.storage);
  fill(in->b, s->b, in->gb.storage);
  fill(in->c, s->c, in->gc.storage);
  fill(in->bias, s->bias, s->n + 1);
}

static void inputs_free(ginputs *in) {
  free(in->a);
  free(in->b);
  free(in->c);
  free(in->bias);
}

/* ---------------------------------------------------------------- the naive check */

static double act_ref(smelt_act a, double x, double slope) {
  switch (a) {
    case SMELT_ACT_IDENTITY: return x;
    case SMELT_ACT_RELU: return x > 0 ? x : x == x ? 0.0 : x;
    case SMELT_ACT_LEAKY_RELU: return x >= 0 ? x : slope * x;
    case SMELT_ACT_TANH: return tanh(x);
    case SMELT_ACT_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case SMELT_ACT_SILU: return x * (1.0 / (1.0 + exp(-x)));
    case SMELT_ACT_HARDSWISH: return x * fmin(fmax(x + 3.0, 0.0), 6.0) / 6.0;
    /* Without the cancellation of 1 + erf and 1 + tanh, which loses all
     * relative accuracy in the negative tail (x < -7.4 for bf16's). */
    case SMELT_ACT_GELU: return 0.5 * x * erfc(-x / sqrt(2.0));
    case SMELT_ACT_GELU_TANH: return x / (1.0 + exp(-2.0 * 0.7978845608 * (x + 0.044715 * x * x * x)));
    default: return NAN;
  }
}

/* What D holds after storing v: smelt/gemm.h's conversion rules, decoded. */
static double convert_ref(double v, smelt_dtype dt, int clamp) {
  uint8_t tmp[8];
  switch (dt) {
    case SMELT_DTYPE_F64: return v;
    case SMELT_DTYPE_I8:
    case SMELT_DTYPE_I32: {
      double lo = dt == SMELT_DTYPE_I8 ? -128 : -2147483648.0, hi = dt == SMELT_DTYPE_I8 ? 127 : 2147483647.0;
      if (isnan(v)) return 0;
      double r = nearbyint(v);
      return r < lo ? lo : r > hi ? hi : r;
    }
    default: {
      float f = (float)v;
      if (clamp) {
        double m = dt == SMELT_DTYPE_F32 ? FLT_MAX : dt == SMELT_DTYPE_F16 ? 65504.0 : 3.3895313892515355e38;
        if (dt == SMELT_DTYPE_F32 || dt == SMELT_DTYPE_F16 || dt == SMELT_DTYPE_BF16)
          f = (float)(f > m ? m : f < -m ? -m : f);
      }
      th_set(tmp, dt, 0, f);
      return th_get(tmp, dt, 0);
    }
  }
}

/* The expected D, decoded, [L][m][n] row-major. */
static void naive(const gspec *s, const ginputs *in, double *out) {
  const smelt_gemm_epilogue *e = &s->desc.epilogue;
  const int ints = s->a == SMELT_DTYPE_I8;
  int64_t L = s->batch > 0 ? s->batch : 1;
  for (int64_t l = 0; l < L; l++)
    for (int64_t i = 0; i < s->m; i++)
      for (int64_t j = 0; j < s->n; j++) {
        double acc = 0;
        int64_t iacc = 0;
        for (int64_t k = 0; k < s->k; k++) {
          double x = th_get(in->a, s->a, mat_off(&in->ga, l, i, k)), y = th_get(in->b, s->b, mat_off(&in->gb, l, k, j));
          if (ints) iacc += (int64_t)x * (int64_t)y;
          else acc += x * y;
        }
        if (ints) acc = (double)iacc;
        double v = e->alpha * e->scale_a * e->scale_b * acc;
        if (s->has_c && e->beta != 0) v += e->beta * th_get(in->c, s->c, mat_off(&in->gc, l, i, j));
        if (s->has_bias) v += th_get(in->bias, s->bias, j);
        v = act_ref(e->act, v, e->slope) * e->scale_d;
        out[(l * s->m + i) * s->n + j] = convert_ref(v, s->d, e->clamp);
      }
}

/* ---------------------------------------------------------------- running a case */

/* Runs the case on ctx; D decoded into out [L][m][n]. Checks the guards and
 * that nothing between D's elements was written. Returns the status. */
static smelt_status run_case(smelt_ctx *ctx, const gspec *s, const ginputs *in, double *out) {
  const size_t ea = smelt_dtype_size(s->a), eb = smelt_dtype_size(s->b), ec = smelt_dtype_size(s->c),
               ed = smelt_dtype_size(s->d), ebias = smelt_dtype_size(s->bias);
  th_buf A = th_buf_new(ctx, (size_t)in->ga.storage * ea), B = th_buf_new(ctx, (size_t)in->gb.storage * eb),
         C = th_buf_new(ctx, (size_t)in->gc.storage * ec), D = th_buf_new(ctx, (size_t)in->gd.storage * ed),
         Bias = th_buf_new(ctx, (size_t)(s->n + 1) * ebias);
  th_buf_upload(&A, in->a, A.bytes);
  th_buf_upload(&B, in->b, B.bytes);
  th_buf_upload(&C, in->c, C.bytes);
  th_buf_upload(&Bias, in->bias, Bias.bytes);
  smelt_tensor ta = mat_tensor(&in->ga, A.data, ctx), tb = mat_tensor(&in->gb, B.data, ctx),
               tc = mat_tensor(&in->gc, C.data, ctx), td = mat_tensor(&in->gd, D.data, ctx);
  int64_t bshape[1] = {s->n};
  smelt_tensor tbias = smelt_tensor_make(Bias.data, s->bias, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), 1,
                                         bshape);
  smelt_status st = smelt_gemm(ctx, &s->desc, &ta, &tb, s->has_c ? &tc : NULL, &td, s->has_bias ? &tbias : NULL);
  uint8_t *host = (uint8_t *)malloc(D.bytes);
  th_buf_download(&D, host, D.bytes);
  if (st == SMELT_OK) {
    CHECK(th_buf_guards_ok(&D));
    /* Every byte outside D's elements keeps the poison (0xFF). */
    uint8_t *mark = (uint8_t *)calloc((size_t)in->gd.storage, 1);
    int64_t L = s->batch > 0 ? s->batch : 1;
    for (int64_t l = 0; l < L; l++)
      for (int64_t i = 0; i < s->m; i++)
        for (int64_t j = 0; j < s->n; j++) {
          int64_t o = mat_off(&in->gd, l, i, j);
          mark[o] = 1;
          out[(l * s->m + i) * s->n + j] = th_get(host, s->d, o);
        }
    for (int64_t o = 0; o < in->gd.storage; o++)
      if (!mark[o])
        for (size_t b = 0; b < ed; b++)
          if (host[(size_t)o * ed + b] != 0xFF) {
            th_fail(__FILE__, __LINE__, "%s: D storage element %lld outside the view was written",
                    smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA ? "cuda" : "cpu", (long long)o);
            o = in->gd.storage;
            break;
          }
    free(mark);
  }
  free(host);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&C);
  th_buf_free(&D);
  th_buf_free(&Bias);
  return st;
}

static int is_fp8(smelt_dtype d) { return d == SMELT_DTYPE_E4M3 || d == SMELT_DTYPE_E5M2; }

/* Relative L2 bound of a GPU result against the CPU reference
 * (src/core/error_bound.c). */
static double bound_of(const gspec *s) {
  const smelt__bound_query q = {.family = "gemm", .dtype = s->d, .dt_a = s->a, .gemm = &s->desc, .has_c = s->has_c};
  return smelt__error_bound(&q);
}

static const char *dn(smelt_dtype d) { return smelt_dtype_name(d); }

/* Runs s on the CPU (against the naive check, unless `naive_too` is 0) and,
 * with a GPU, on CUDA against the CPU reference. Returns 0 on a failure. */
static int check(const gspec *s, int naive_too, const char *what) {
  char label[256];
  snprintf(label, sizeof label, "%s %sx%s->%s %c%c m%lld n%lld k%lld L%lld act %d%s%s", what, dn(s->a), dn(s->b),
           dn(s->d), s->a_col ? 'C' : 'R', s->b_col ? 'C' : 'R', (long long)s->m, (long long)s->n, (long long)s->k,
           (long long)s->batch, (int)s->desc.epilogue.act, s->has_c ? " +C" : "", s->has_bias ? " +bias" : "");
  ginputs in;
  inputs_new(s, &in);
  int64_t L = s->batch > 0 ? s->batch : 1, n = L * s->m * s->n;
  double *ref = (double *)malloc(sizeof(double) * (size_t)(n + 1)), *cpu = (double *)malloc(sizeof(double) * (size_t)(n + 1)),
         *gpu = (double *)malloc(sizeof(double) * (size_t)(n + 1));
  int ok = 1;
  int fails = th_failed_now;
  smelt_status st = run_case(th_cpu(), s, &in, cpu);
  if (st != SMELT_OK) {
    th_fail(__FILE__, __LINE__, "%s: cpu: %s (%s)", label, smelt_status_name(st), smelt_last_error());
    ok = 0;
  } else if (naive_too) {
    naive(s, &in, ref);
    /* Same arithmetic in double on both sides: differences come from how
     * the activations are written, which can flip one output rounding. */
    double rb = s->d == SMELT_DTYPE_F64 ? 1e-12 : s->d == SMELT_DTYPE_F32 ? 1e-6 : bound_of(s);
    if (!th_compare(label, cpu, ref, n, rb, 0)) ok = 0;
  }
  smelt_ctx *cu = th_cuda();
  if (ok && cu) {
    st = run_case(cu, s, &in, gpu);
    if (st != SMELT_OK) {
      th_fail(__FILE__, __LINE__, "%s: cuda: %s (%s)", label, smelt_status_name(st), smelt_last_error());
      ok = 0;
    } else if (!th_compare(label, gpu, cpu, n, bound_of(s), is_fp8(s->d) ? 0.51 : 0)) {
      ok = 0;
    }
  }
  if (th_failed_now != fails) ok = 0;
  if (!ok) th_fail(__FILE__, __LINE__, "case failed: %s", label);
  free(ref);
  free(cpu);
  free(gpu);
  inputs_free(&in);
  return ok;
}

/* ---------------------------------------------------------------- dtype x layout */

typedef struct combo {
  smelt_dtype a, b, d;
  smelt_gemm_math_op op;
  smelt_gemm_acc acc;
} combo;

static const combo combos[] = {
    {SMELT_DTYPE_F64, SMELT_DTYPE_F64, SMELT_DTYPE_F64, 0, 0},
    {SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 0, 0},
    {SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_GEMM_MATH_TF32, 0},
    {SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_GEMM_MATH_3XTF32, 0},
    {SMELT_DTYPE_F16, SMELT_DTYPE_F16, SMELT_DTYPE_F16, 0, 0},
    {SMELT_DTYPE_F16, SMELT_DTYPE_F16, SMELT_DTYPE_F32, 0, SMELT_GEMM_ACC_F16},
    {SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 0, 0},
    {SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, 0, 0},
    {SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, 0, 0},
    {SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2, SMELT_DTYPE_F32, 0, 0},
    {SMELT_DTYPE_E5M2, SMELT_DTYPE_E4M3, SMELT_DTYPE_F16, 0, 0},
    {SMELT_DTYPE_E5M2, SMELT_DTYPE_E5M2, SMELT_DTYPE_E4M3, 0, 0},
    {SMELT_DTYPE_I8, SMELT_DTYPE_I8, SMELT_DTYPE_I32, 0, 0},
    {SMELT_DTYPE_I8, SMELT_DTYPE_I8, SMELT_DTYPE_I8, 0, 0},
    {SMELT_DTYPE_F16, SMELT_DTYPE_BF16, SMELT_DTYPE_F32, 0, 0},
    {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16, 0, 0},
};
#define NCOMBOS ((int)(sizeof combos / sizeof *combos))

static gspec combo_spec(const combo *c, int64_t m, int64_t n, int64_t k) {
  gspec s = spec(c->a, c->b, c->d, m, n, k);
  s.desc.math.op = c->op;
  s.desc.math.acc = c->acc;
  if (c->a == SMELT_DTYPE_I8) {
    s.c = SMELT_DTYPE_I32;
    s.bias = SMELT_DTYPE_I32;
    if (c->d == SMELT_DTYPE_I8) s.desc.epilogue.alpha = 1.0 / 256; /* keep i8 outputs mostly in range */
  }
  if (is_fp8(c->a)) {
    s.desc.epilogue.scale_a = 0.5f;
    s.desc.epilogue.scale_b = 2.0f;
    s.desc.epilogue.scale_d = is_fp8(c->d) ? 4.0f : 1.0f;
  }
  return s;
}

/* Every dtype combination in every layout, small odd shapes, with C and bias. */
static void test_dtypes_layouts(void) {
  static const int64_t shapes[][3] = {{1, 1, 1}, {7, 5, 3}, {13, 17, 33}};
  for (int ci = 0; ci < NCOMBOS; ci++)
    for (int lay = 0; lay < 4; lay++)
      for (int si = 0; si < 3; si++) {
        gspec s = combo_spec(&combos[ci], shapes[si][0], shapes[si][1], shapes[si][2]);
        s.a_col = lay >> 1;
        s.b_col = lay & 1;
        s.d_col = si == 1;
        s.pad = si == 2 ? 3 : 0;
        s.has_c = si > 0;
        s.has_bias = si == 2;
        s.desc.epilogue.beta = s.has_c ? 0.5 : 0.0;
        if (!check(&s, 1, "dtypes")) return;
      }
}

/* Each activation with bias, beta, clamp and scales, on two dtypes. */
static void test_epilogues(void) {
  static const smelt_dtype dts[][2] = {{SMELT_DTYPE_F32, SMELT_DTYPE_F32}, {SMELT_DTYPE_BF16, SMELT_DTYPE_BF16}};
  for (int t = 0; t < 2; t++)
    for (int a = 0; a < SMELT_ACT_COUNT; a++) {
      gspec s = spec(dts[t][0], dts[t][0], dts[t][1], 19, 23, 29);
      s.has_c = 1;
      s.has_bias = 1;
      s.bias = t ? SMELT_DTYPE_BF16 : SMELT_DTYPE_F32;
      s.desc.epilogue.act = (smelt_act)a;
      s.desc.epilogue.alpha = 1.5;
      s.desc.epilogue.beta = -0.75;
      s.desc.epilogue.slope = 0.2f;
      s.desc.epilogue.scale_d = 0.5f;
      if (!check(&s, 1, "epilogue")) return;
    }
  /* Clamp: huge alpha overflows f16 to inf unless clamped. */
  for (int clamp = 0; clamp < 2; clamp++) {
    gspec s = spec(SMELT_DTYPE_F16, SMELT_DTYPE_F16, SMELT_DTYPE_F16, 9, 8, 16);
    s.desc.epilogue.alpha = 1e6;
    s.desc.epilogue.clamp = clamp;
    if (!check(&s, 1, "clamp")) return;
  }
  /* Integer outputs saturate: i8 from a float GEMM and from an int8 one. */
  gspec s = spec(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_I8, 11, 10, 40);
  s.desc.epilogue.alpha = 100;
  if (!check(&s, 1, "saturate")) return;
  s = spec(SMELT_DTYPE_I8, SMELT_DTYPE_I8, SMELT_DTYPE_I8, 11, 10, 40);
  s.c = SMELT_DTYPE_I32;
  if (!check(&s, 1, "saturate")) return;
}

/* ---------------------------------------------------------------- modes */

static void test_batched(void) {
  for (int bc = 0; bc < 2; bc++)
    for (int lay = 0; lay < 4; lay++) {
      gspec s = spec(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 9, 11, 13);
      s.batch = 3;
      s.b_bcast = bc;
      s.a_col = lay >> 1;
      s.b_col = lay & 1;
      s.has_c = 1;
      s.has_bias = 1;
      s.desc.epilogue.beta = 2.0;
      if (!check(&s, 1, "batched")) return;
      s = spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 17, 9, 24);
      s.batch = 4;
      s.b_bcast = bc;
      s.a_col = lay >> 1;
      s.b_col = lay & 1;
      s.desc.mode = SMELT_GEMM_MODE_BATCHED;
      if (!check(&s, 1, "batched")) return;
    }
}

/* Split-K on the CPU is the plain GEMM; on a GPU every slice count 1..16. */
static void test_split_k(void) {
  for (int serial = 0; serial < 2; serial++)
    for (int sk = 1; sk <= 16; sk += (th_cuda() ? 1 : 5)) {
      gspec s = spec(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 33, 20, th_cuda() ? 1000 + 3 : 70);
      s.desc.mode = serial ? SMELT_GEMM_MODE_SPLIT_K_SERIAL : SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
      s.desc.split_k = sk;
      s.has_c = 1;
      s.has_bias = 1;
      s.desc.epilogue.beta = 1.0;
      s.desc.epilogue.act = SMELT_ACT_GELU;
      if (!check(&s, !th_cuda(), serial ? "split serial" : "split parallel")) return;
      s = spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 130, 70, th_cuda() ? 2000 + 7 : 64);
      s.b_col = 1;
      s.desc.mode = serial ? SMELT_GEMM_MODE_SPLIT_K_SERIAL : SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
      s.desc.split_k = sk;
      if (!check(&s, !th_cuda(), serial ? "split serial" : "split parallel")) return;
      s = spec(SMELT_DTYPE_I8, SMELT_DTYPE_I8, SMELT_DTYPE_I32, 20, 33, th_cuda() ? 999 : 40);
      s.b_col = 1;
      s.desc.mode = serial ? SMELT_GEMM_MODE_SPLIT_K_SERIAL : SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
      s.desc.split_k = sk;
      if (!check(&s, !th_cuda(), serial ? "split serial" : "split parallel")) return;
    }
}

/* Array mode: count problems at pointers from arrays in device memory. */
static void run_array(smelt_ctx *ctx, smelt_dtype dt, int64_t count, int64_t m, int64_t n, int64_t k, int b_col) {
  const size_t es = smelt_dtype_size(dt);
  gmat ga = mat_layout(dt, 0, m, k, 0, 1, 0, 0, 0), gb = mat_layout(dt, 0, k, n, b_col, 0, 0, 0, 0),
       gd = mat_layout(dt, 0, m, n, 0, 2, 0, 0, 0);
  size_t sa = (size_t)ga.storage * es, sb = (size_t)gb.storage * es, sd = (size_t)gd.storage * es;
  /* Problem i: A at slot i, B at slot count-1-i, C and D at their own slots. */
  th_buf A = th_buf_new(ctx, sa * (size_t)count), B = th_buf_new(ctx, sb * (size_t)count),
         C = th_buf_new(ctx, sd * (size_t)count), D = th_buf_new(ctx, sd * (size_t)count),
         P = th_buf_new(ctx, 4 * sizeof(void *) * (size_t)count);
  uint8_t *ha = malloc(A.bytes), *hb = malloc(B.bytes), *hc = malloc(C.bytes), *hd = malloc(D.bytes);
  fill(ha, dt, (int64_t)(A.bytes / es));
  fill(hb, dt, (int64_t)(B.bytes / es));
  fill(hc, dt, (int64_t)(C.bytes / es));
  th_buf_upload(&A, ha, A.bytes);
  th_buf_upload(&B, hb, B.bytes);
  th_buf_upload(&C, hc, C.bytes);
  void **hp = malloc(4 * sizeof(void *) * (size_t)count);
  for (int64_t i = 0; i < count; i++) {
    hp[i] = (char *)A.data + sa * (size_t)i;
    hp[count + i] = (char *)B.data + sb * (size_t)(count - 1 - i);
    hp[2 * count + i] = (char *)C.data + sd * (size_t)i;
    hp[3 * count + i] = (char *)D.data + sd * (size_t)i;
  }
  th_buf_upload(&P, hp, P.bytes);
  void **dp = (void **)P.data;
  smelt_gemm_ptrs ptrs = {(const void *const *)dp, (const void *const *)(dp + count),
                          (const void *const *)(dp + 2 * count), dp + 3 * count};
  smelt_tensor ta = mat_tensor(&ga, hp[0], ctx), tb = mat_tensor(&gb, hp[count], ctx),
               tc = mat_tensor(&gd, hp[2 * count], ctx), td = mat_tensor(&gd, hp[3 * count], ctx);
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.epilogue.beta = -1.0;
  desc.epilogue.act = SMELT_ACT_RELU;
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_gemm_array_plan(ctx, &desc, count, &ta, &tb, &tc, &td, NULL, &plan));
  if (plan) CHECK_OK(smelt_gemm_array_run(plan, &ptrs, NULL));
  smelt_plan_destroy(plan);
  th_buf_download(&D, hd, D.bytes);
  CHECK(th_buf_guards_ok(&D));
  double *got = malloc(sizeof(double) * (size_t)(m * n)), *want = malloc(sizeof(double) * (size_t)(m * n));
  for (int64_t i = 0; i < count && !th_failed_now; i++) {
    const uint8_t *pa = ha + sa * (size_t)i, *pb = hb + sb * (size_t)(count - 1 - i), *pc = hc + sd * (size_t)i,
                  *pd = hd + sd * (size_t)i;
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < n; c++) {
        double acc = 0;
        for (int64_t kk = 0; kk < k; kk++) acc += th_get(pa, dt, mat_off(&ga, 0, r, kk)) * th_get(pb, dt, mat_off(&gb, 0, kk, c));
        double v = acc - th_get(pc, dt, mat_off(&gd, 0, r, c));
        want[r * n + c] = convert_ref(v > 0 ? v : 0, dt, 0);
        got[r * n + c] = th_get(pd, dt, mat_off(&gd, 0, r, c));
      }
    char what[64];
    snprintf(what, sizeof what, "array %s problem %lld", dn(dt), (long long)i);
    CHECK(th_compare(what, got, want, m * n, dt == SMELT_DTYPE_F32 ? 1e-5 : 1e-2, 1e-6));
  }
  free(got);
  free(want);
  free(hp);
  free(ha);
  free(hb);
  free(hc);
  free(hd);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&C);
  th_buf_free(&D);
  th_buf_free(&P);
}

static void test_array(void) {
  run_array(th_cpu(), SMELT_DTYPE_F32, 3, 7, 9, 5, 0);
  if (th_cuda()) {
    run_array(th_cuda(), SMELT_DTYPE_F32, 5, 33, 17, 70, 1);
    run_array(th_cuda(), SMELT_DTYPE_BF16, 4, 130, 72, 64, 1);
    run_array(th_cuda(), SMELT_DTYPE_F16, 3, 7, 8, 16, 0);
  }
}

/* Grouped: problems of their own sizes, some empty, on every backend.
 * `hopper`: D rows 16-byte aligned and a Hopper tile asked for: 1 the
 * cooperative 128 x 256, which only the Hopper kernel has (so the run fails
 * unless it takes it); 2 the ping-pong 128 x 128, which the selector tries
 * on Hopper before mma.sync's tile of that size. */
static void run_grouped(smelt_ctx *ctx, smelt_dtype dt, int b_col, const int64_t (*sizes)[3], int count, int bias,
                        int hopper) {
  smelt_tensor *t = calloc((size_t)count * 4, sizeof *t);
  gmat *g = calloc((size_t)count * 3, sizeof *g);
  th_buf *bufs = calloc((size_t)count * 4, sizeof *bufs);
  void **host = calloc((size_t)count * 4, sizeof *host);
  for (int i = 0; i < count; i++) {
    int64_t m = sizes[i][0], n = sizes[i][1], k = sizes[i][2];
    g[3 * i] = mat_layout(dt, 0, m, k, 0, 0, 0, 0, 1);
    g[3 * i + 1] = mat_layout(dt, 0, k, n, b_col, 0, 0, 0, 1);
    g[3 * i + 2] = mat_layout(dt, 0, m, n, 0, !hopper, 0, 0, hopper);
    int64_t el[4] = {g[3 * i].storage, g[3 * i + 1].storage, g[3 * i + 2].storage, n + 1};
    for (int j = 0; j < 4; j++) {
      smelt_dtype dj = j == 3 ? SMELT_DTYPE_F32 : dt;
      bufs[4 * i + j] = th_buf_new(ctx, (size_t)el[j] * smelt_dtype_size(dj));
      host[4 * i + j] = malloc(bufs[4 * i + j].bytes);
      if (j != 2) {
        fill(host[4 * i + j], dj, el[j]);
        th_buf_upload(&bufs[4 * i + j], host[4 * i + j], bufs[4 * i + j].bytes);
      }
    }
    t[i] = mat_tensor(&g[3 * i], bufs[4 * i].data, ctx);
    t[count + i] = mat_tensor(&g[3 * i + 1], bufs[4 * i + 1].data, ctx);
    t[2 * count + i] = mat_tensor(&g[3 * i + 2], bufs[4 * i + 2].data, ctx);
    int64_t bn[1] = {n};
    t[3 * count + i] = smelt_tensor_make(bufs[4 * i + 3].data, SMELT_DTYPE_F32, smelt_ctx_device(ctx),
                                         smelt_ctx_device_index(ctx), 1, bn);
  }
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.epilogue.act = SMELT_ACT_SILU;
  /* hopper 1: the cooperative Hopper tile; 2: the ping-pong one; 3: pairs
   * along M (B multicast); 4: quads along N (A multicast, narrow tile);
   * 5: the 64 x 64 tile (one consumer); 6: 64 x 128. */
  if (hopper && hopper <= 2) desc.tile.n = hopper == 2 ? 128 : 256;
  if (hopper == 2) desc.tile.m = 128;
  if (hopper == 3) desc.tile.cluster_m = 2;
  if (hopper == 4) desc.tile.cluster_n = 4;
  if (hopper >= 5) desc.tile.m = 64;
  if (hopper == 6) desc.tile.n = 128;
  CHECK_OK(smelt_gemm_grouped(ctx, &desc, count, t, t + count, NULL, t + 2 * count, bias ? t + 3 * count : NULL));
  for (int i = 0; i < count && !th_failed_now; i++) {
    int64_t m = sizes[i][0], n = sizes[i][1], k = sizes[i][2];
    th_buf_download(&bufs[4 * i + 2], host[4 * i + 2], bufs[4 * i + 2].bytes);
    CHECK(th_buf_guards_ok(&bufs[4 * i + 2]));
    /* Nothing between D's rows was written (the row padding keeps its poison). */
    const size_t ed = smelt_dtype_size(dt);
    for (int64_t o = 0; o < g[3 * i + 2].storage; o++) {
      const int64_t r = g[3 * i + 2].rs ? o / g[3 * i + 2].rs : 0, c = o - r * g[3 * i + 2].rs;
      if (r < m && c < n) continue;
      for (size_t b = 0; b < ed; b++)
        if (((uint8_t *)host[4 * i + 2])[(size_t)o * ed + b] != 0xFF) {
          th_fail(__FILE__, __LINE__, "grouped group %d: D storage element %lld outside the view was written", i,
                  (long long)o);
          o = g[3 * i + 2].storage;
          break;
        }
    }
    double *got = malloc(sizeof(double) * (size_t)(m * n + 1)), *want = malloc(sizeof(double) * (size_t)(m * n + 1));
    /* A and Bᵀ as contiguous doubles first: the 4000-row group's reference
     * through th_get per product took most of the suite's time. */
    double *ad = malloc(sizeof(double) * (size_t)(m * k + 1)), *bt = malloc(sizeof(double) * (size_t)(k * n + 1));
    for (int64_t r = 0; r < m; r++)
      for (int64_t kk = 0; kk < k; kk++) ad[r * k + kk] = th_get(host[4 * i], dt, mat_off(&g[3 * i], 0, r, kk));
    for (int64_t kk = 0; kk < k; kk++)
      for (int64_t c = 0; c < n; c++) bt[c * k + kk] = th_get(host[4 * i + 1], dt, mat_off(&g[3 * i + 1], 0, kk, c));
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < n; c++) {
        double acc = 0;
        for (int64_t kk = 0; kk < k; kk++) acc += ad[r * k + kk] * bt[c * k + kk];
        if (bias) acc += th_get(host[4 * i + 3], SMELT_DTYPE_F32, c);
        want[r * n + c] = convert_ref(act_ref(SMELT_ACT_SILU, acc, 0), dt, 0);
        got[r * n + c] = th_get(host[4 * i + 2], dt, mat_off(&g[3 * i + 2], 0, r, c));
      }
    char what[64];
    snprintf(what, sizeof what, "grouped %s group %d", dn(dt), i);
    CHECK(th_compare(what, got, want, m * n, dt == SMELT_DTYPE_F32 ? 1e-5 : 1e-2, 1e-6));
    free(ad);
    free(bt);
    free(got);
    free(want);
  }
  for (int i = 0; i < 4 * count; i++) {
    th_buf_free(&bufs[i]);
    free(host[i]);
  }
  free(t);
  free(g);
  free(bufs);
  free(host);
}

static void test_grouped(void) {
  static const int64_t small[][3] = {{5, 7, 3}, {0, 4, 4}, {9, 1, 6}, {3, 0, 2}, {2, 3, 0}, {11, 6, 17}};
  run_grouped(th_cpu(), SMELT_DTYPE_F32, 0, small, 6, 1, 0);
  if (!th_cuda()) return;
  static const int64_t big[][3] = {{129, 200, 64}, {0, 64, 64}, {1, 1, 1}, {300, 72, 136}, {64, 0, 8},
                                   {7, 9, 0},      {128, 128, 128}, {65, 257, 40}};
  run_grouped(th_cuda(), SMELT_DTYPE_F32, 0, small, 6, 1, 0);
  run_grouped(th_cuda(), SMELT_DTYPE_BF16, 1, big, 8, 1, 0);
  run_grouped(th_cuda(), SMELT_DTYPE_F16, 0, big, 8, 0, 0);
  /* The Hopper kernel's grouped mode: empty groups, ragged tiles, one row,
   * and more tiles than SMs, so CTAs cross group boundaries. N is a
   * multiple of 8 (rows of whole 16-byte units, which its TMA stores need;
   * other N take mma.sync). */
  if (!th_cuda_sm90()) return;
  static const int64_t hop[][3] = {{129, 200, 64}, {0, 64, 64},     {1, 8, 1},        {300, 72, 136},
                                   {64, 0, 8},     {128, 128, 128}, {4000, 1104, 24}, {65, 264, 40}};
  run_grouped(th_cuda(), SMELT_DTYPE_BF16, 1, hop, 8, 1, 1);
  run_grouped(th_cuda(), SMELT_DTYPE_F16, 1, hop, 8, 0, 1);
  run_grouped(th_cuda(), SMELT_DTYPE_BF16, 1, hop, 8, 1, 2);
  run_grouped(th_cuda(), SMELT_DTYPE_BF16, 1, hop, 8, 1, 3);
  run_grouped(th_cuda(), SMELT_DTYPE_F16, 1, hop, 8, 0, 4);
  run_grouped(th_cuda(), SMELT_DTYPE_BF16, 1, hop, 8, 1, 5);
  run_grouped(th_cuda(), SMELT_DTYPE_F16, 1, hop, 8, 1, 6);
}

/* ---------------------------------------------------------------- edges */

static void test_edges(void) {
  /* K = 0: D = epilogue(beta * C + bias). */
  gspec s = spec(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 5, 6, 0);
  s.has_c = s.has_bias = 1;
  s.desc.epilogue.beta = 3.0;
  s.desc.epilogue.act = SMELT_ACT_TANH;
  check(&s, 1, "K=0");
  /* M = 0 and N = 0 write nothing. */
  s = spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 0, 6, 4);
  check(&s, 1, "M=0");
  s = spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 6, 0, 4);
  check(&s, 1, "N=0");
  /* NaN in C with beta = 0 is not read. */
  for (int b = 0; b < 2; b++) {
    smelt_ctx *ctx = b ? th_cuda() : th_cpu();
    if (!ctx) continue;
    float ha[4] = {1, 2, 3, 4}, hb[4] = {1, 0, 0, 1}, hc[4] = {NAN, NAN, NAN, NAN}, hd[4];
    th_buf A = th_buf_new(ctx, 16), B = th_buf_new(ctx, 16), C = th_buf_new(ctx, 16), D = th_buf_new(ctx, 16);
    th_buf_upload(&A, ha, 16);
    th_buf_upload(&B, hb, 16);
    th_buf_upload(&C, hc, 16);
    int64_t sh[2] = {2, 2};
    smelt_device_kind dk = smelt_ctx_device(ctx);
    smelt_tensor ta = smelt_tensor_make(A.data, SMELT_DTYPE_F32, dk, 0, 2, sh),
                 tb = smelt_tensor_make(B.data, SMELT_DTYPE_F32, dk, 0, 2, sh),
                 tc = smelt_tensor_make(C.data, SMELT_DTYPE_F32, dk, 0, 2, sh),
                 td = smelt_tensor_make(D.data, SMELT_DTYPE_F32, dk, 0, 2, sh);
    CHECK_OK(smelt_gemm(ctx, NULL, &ta, &tb, &tc, &td, NULL));
    th_buf_download(&D, hd, 16);
    CHECK(hd[0] == 1 && hd[1] == 2 && hd[2] == 3 && hd[3] == 4);
    /* In place: D is C. A NaN in A reaches exactly its row. */
    ha[0] = NAN;
    th_buf_upload(&A, ha, 16);
    smelt_gemm_desc desc = smelt_gemm_desc_default();
    desc.epilogue.beta = 1.0;
    CHECK_OK(smelt_gemm(ctx, &desc, &ta, &tb, &td, &td, NULL));
    th_buf_download(&D, hd, 16);
    CHECK(isnan(hd[0]) && isnan(hd[1]) && hd[2] == 6 && hd[3] == 8);
    th_buf_free(&A);
    th_buf_free(&B);
    th_buf_free(&C);
    th_buf_free(&D);
  }
}

static void test_desc_default(void) {
  smelt_gemm_desc d = smelt_gemm_desc_default();
  CHECK(d.epilogue.alpha == 1.0 && d.epilogue.beta == 0.0);
  CHECK(d.epilogue.scale_a == 1.0f && d.epilogue.scale_b == 1.0f && d.epilogue.scale_d == 1.0f);
  CHECK(d.epilogue.slope == 0.01f && d.epilogue.act == SMELT_ACT_IDENTITY);
  CHECK(d.mode == SMELT_GEMM_MODE_AUTO && d.split_k == 0 && d.math.opclass == SMELT_GEMM_OPCLASS_AUTO);
}

/* ---------------------------------------------------------------- bad inputs */

typedef struct bad_env {
  float a[64], b[64], c[64], d[64], bias[8];
  smelt_tensor ta, tb, tc, td, tbias;
} bad_env;

static void bad_env_init(bad_env *e) {
  for (int i = 0; i < 64; i++) e->a[i] = e->b[i] = e->c[i] = 1.0f;
  for (int i = 0; i < 64; i++) e->d[i] = NAN;
  int64_t sa[2] = {3, 4}, sb[2] = {4, 5}, sd[2] = {3, 5}, sbias[1] = {5};
  e->ta = smelt_tensor_make(e->a, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sa);
  e->tb = smelt_tensor_make(e->b, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sb);
  e->tc = smelt_tensor_make(e->c, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sd);
  e->td = smelt_tensor_make(e->d, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sd);
  e->tbias = smelt_tensor_make(e->bias, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sbias);
}

static int untouched(const bad_env *e) {
  for (int i = 0; i < 64; i++)
    if (!isnan(e->d[i])) return 0;
  return 1;
}

#define BAD(call, status, msg) \
  do {                         \
    CHECK_STATUS(call, status); \
    CHECK_MSG(msg);            \
    CHECK(untouched(&e));      \
  } while (0)

static void test_bad_inputs(void) {
  smelt_ctx *cpu = th_cpu();
  bad_env e;
  bad_env_init(&e);
  smelt_gemm_desc d = smelt_gemm_desc_default();
  smelt_plan *plan = (smelt_plan *)1;
  BAD(smelt_gemm_plan(cpu, NULL, &e.ta, &e.tb, NULL, &e.td, NULL, NULL), SMELT_STATUS_NULL_POINTER, "out is NULL");
  BAD(smelt_gemm_plan(NULL, NULL, &e.ta, &e.tb, NULL, &e.td, NULL, &plan), SMELT_STATUS_NULL_POINTER, "ctx is NULL");
  CHECK(plan == NULL);
  BAD(smelt_gemm(cpu, NULL, NULL, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_NULL_POINTER, "A is NULL");
  BAD(smelt_gemm(cpu, NULL, &e.ta, NULL, NULL, &e.td, NULL), SMELT_STATUS_NULL_POINTER, "B is NULL");
  BAD(smelt_gemm(cpu, NULL, &e.ta, &e.tb, NULL, NULL, NULL), SMELT_STATUS_NULL_POINTER, "D is NULL");
  /* The description. */
  d.math.opclass = (smelt_gemm_opclass)9;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_INVALID_ARGUMENT, "desc.math.opclass=9");
  d = smelt_gemm_desc_default();
  d.split_k = SMELT_GEMM_MAX_SPLIT_K + 1;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_INVALID_ARGUMENT, "desc.split_k=65");
  d = smelt_gemm_desc_default();
  d.tile.m = -8;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_INVALID_ARGUMENT, "desc.tile.m=-8");
  d = smelt_gemm_desc_default();
  d.tile.cluster_m = 2;
  d.tile.cluster_n = 2;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_UNSUPPORTED, "cluster=2x2");
  d = smelt_gemm_desc_default();
  d.tile.cluster_n = 3;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_UNSUPPORTED, "cluster=0x3");
  d = smelt_gemm_desc_default();
  d.epilogue.alpha = NAN;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_INVALID_ARGUMENT, "alpha=nan must be finite");
  d = smelt_gemm_desc_default();
  d.epilogue.act = SMELT_ACT_COUNT;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_INVALID_ARGUMENT, "desc.epilogue.act");
  /* C is needed when beta != 0. */
  d = smelt_gemm_desc_default();
  d.epilogue.beta = 0.5;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_NULL_POINTER, "C is NULL but");
  /* Shapes. */
  smelt_tensor t = e.tb;
  t.shape[0] = 5;
  BAD(smelt_gemm(cpu, NULL, &e.ta, &t, NULL, &e.td, NULL), SMELT_STATUS_SHAPE_MISMATCH, "B.shape[0]=5 must equal K=4");
  t = e.td;
  t.shape[1] = 4;
  BAD(smelt_gemm(cpu, NULL, &e.ta, &e.tb, NULL, &t, NULL), SMELT_STATUS_SHAPE_MISMATCH, "D.shape[1]=4 must equal N=5");
  t = e.tbias;
  t.shape[0] = 4;
  BAD(smelt_gemm(cpu, NULL, &e.ta, &e.tb, NULL, &e.td, &t), SMELT_STATUS_SHAPE_MISMATCH, "bias.shape=[4] must be [N]=[5]");
  t = e.ta;
  t.ndim = 1;
  BAD(smelt_gemm(cpu, NULL, &t, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_SHAPE_MISMATCH, "A.ndim=1 must be 2");
  /* Dtypes. */
  t = e.tb;
  t.dtype = SMELT_DTYPE_F64;
  BAD(smelt_gemm(cpu, NULL, &e.ta, &t, NULL, &e.td, NULL), SMELT_STATUS_DTYPE_MISMATCH, "do not combine");
  t = e.ta;
  t.dtype = SMELT_DTYPE_BOOL;
  BAD(smelt_gemm(cpu, NULL, &t, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_DTYPE_MISMATCH, "A.dtype=bool is not supported");
  d = smelt_gemm_desc_default();
  d.math.acc = SMELT_GEMM_ACC_F16;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_DTYPE_MISMATCH, "desc.math.acc=f16");
  t = e.ta;
  t.dtype = SMELT_DTYPE_F16;
  d = smelt_gemm_desc_default();
  d.math.op = SMELT_GEMM_MATH_TF32;
  BAD(smelt_gemm(cpu, &d, &t, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_DTYPE_MISMATCH, "TF32 needs f32 A and B");
  /* Memory. */
  t = e.td;
  t.data = e.a;
  CHECK_STATUS(smelt_gemm(cpu, NULL, &e.ta, &e.tb, NULL, &t, NULL), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("D overlaps A");
  t = e.tc;
  t.data = e.d + 1;
  d = smelt_gemm_desc_default();
  d.epilogue.beta = 1;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, &t, &e.td, NULL), SMELT_STATUS_INVALID_ARGUMENT, "without being C exactly");
  t = e.td;
  t.strides[0] = 0;
  BAD(smelt_gemm(cpu, NULL, &e.ta, &e.tb, NULL, &t, NULL), SMELT_STATUS_BAD_LAYOUT, "D.strides=[0, 1]");
  t = e.ta;
  t.device = SMELT_DEVICE_CUDA;
  BAD(smelt_gemm(cpu, NULL, &t, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_WRONG_DEVICE, "A is on cuda:0");
  /* Modes. */
  d = smelt_gemm_desc_default();
  d.mode = SMELT_GEMM_MODE_ARRAY;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_INVALID_ARGUMENT, "smelt_gemm_array_plan");
  d = smelt_gemm_desc_default();
  d.mode = SMELT_GEMM_MODE_PLAIN;
  d.split_k = 4;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_INVALID_ARGUMENT, "desc.split_k=4 needs mode");
  d = smelt_gemm_desc_default();
  d.mode = SMELT_GEMM_MODE_BATCHED;
  BAD(smelt_gemm(cpu, &d, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_SHAPE_MISMATCH, "BATCHED needs 3-D");
  /* Runs against a plan. */
  plan = NULL;
  CHECK_OK(smelt_gemm_plan(cpu, NULL, &e.ta, &e.tb, NULL, &e.td, NULL, &plan));
  REQUIRE(plan);
  CHECK(strstr(smelt_plan_describe(plan), "gemm") != NULL);
  t = e.ta;
  t.shape[0] = 2;
  BAD(smelt_gemm_run(plan, &t, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_SHAPE_MISMATCH, "differs from the planned");
  BAD(smelt_gemm_run(plan, &e.ta, &e.tb, NULL, &e.td, &e.tbias), SMELT_STATUS_INVALID_ARGUMENT,
      "bias is given but the plan was made without one");
  BAD(smelt_gemm_run(NULL, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_NULL_POINTER, "plan is NULL");
  BAD(smelt_gemm_grouped_run(plan, 1, &e.ta, &e.tb, NULL, &e.td, NULL), SMELT_STATUS_INVALID_ARGUMENT,
      "not a grouped plan");
  smelt_gemm_ptrs ptrs = {0, 0, 0, 0};
  BAD(smelt_gemm_array_run(plan, &ptrs, NULL), SMELT_STATUS_INVALID_ARGUMENT, "not an array plan");
  smelt_plan_destroy(plan);
  /* Array. */
  plan = NULL;
  CHECK_OK(smelt_gemm_array_plan(cpu, NULL, 2, &e.ta, &e.tb, NULL, &e.td, NULL, &plan));
  REQUIRE(plan);
  BAD(smelt_gemm_array_run(plan, NULL, NULL), SMELT_STATUS_NULL_POINTER, "ptrs is NULL");
  BAD(smelt_gemm_array_run(plan, &ptrs, NULL), SMELT_STATUS_NULL_POINTER, "ptrs->a is NULL");
  const void *pa[2] = {e.a, e.a}, *pb[2] = {e.b, NULL};
  void *pd[2] = {e.d, e.d + 20};
  smelt_gemm_ptrs p2 = {pa, pb, NULL, pd};
  BAD(smelt_gemm_array_run(plan, &p2, NULL), SMELT_STATUS_NULL_POINTER, "ptrs->b[1] is NULL");
  smelt_plan_destroy(plan);
  BAD(smelt_gemm_array_plan(cpu, NULL, -1, &e.ta, &e.tb, NULL, &e.td, NULL, &plan), SMELT_STATUS_INVALID_ARGUMENT,
      "count=-1");
  /* Grouped. */
  smelt_tensor ga[2] = {e.ta, e.ta}, gb[2] = {e.tb, e.tb}, gd[2] = {e.td, e.td};
  gd[1].data = e.d + 20;
  BAD(smelt_gemm_grouped(cpu, NULL, 0, ga, gb, NULL, gd, NULL), SMELT_STATUS_INVALID_ARGUMENT, "count=0 must be >= 1");
  gb[1].dtype = SMELT_DTYPE_F16;
  BAD(smelt_gemm_grouped(cpu, NULL, 2, ga, gb, NULL, gd, NULL), SMELT_STATUS_DTYPE_MISMATCH, "group 1");
  gb[1] = e.tb;
  gb[1].shape[0] = 3;
  BAD(smelt_gemm_grouped(cpu, NULL, 2, ga, gb, NULL, gd, NULL), SMELT_STATUS_SHAPE_MISMATCH,
      "group 1: B.shape[0]=3 must equal K=4");
  /* Groups run in no fixed order: one may not read or write another's D. */
  gb[1] = e.tb;
  ga[1].data = e.d;
  BAD(smelt_gemm_grouped(cpu, NULL, 2, ga, gb, NULL, gd, NULL), SMELT_STATUS_INVALID_ARGUMENT,
      "group 1's A overlaps group 0's D");
  ga[1] = e.ta;
  gd[1].data = e.d + 5;
  BAD(smelt_gemm_grouped(cpu, NULL, 2, ga, gb, NULL, gd, NULL), SMELT_STATUS_INVALID_ARGUMENT,
      "group 1's D overlaps group 0's D");
  /* A group too large for the CPU reference fails before group 0 is written
   * (its tensors are never touched, so they are only addresses). */
  const int64_t big = (int64_t)1 << 29, sa1[2] = {1, big}, sb1[2] = {big, big}, sd1[2] = {1, big};
  const uint64_t far = (uint64_t)1 << 61; /* above every real address, so nothing overlaps */
  ga[1] = smelt_tensor_make((void *)(uintptr_t)far, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sa1);
  gb[1] = smelt_tensor_make((void *)(uintptr_t)(far + ((uint64_t)1 << 32)), SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sb1);
  gd[1] = smelt_tensor_make((void *)(uintptr_t)(3 * far), SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sd1);
  BAD(smelt_gemm_grouped(cpu, NULL, 2, ga, gb, NULL, gd, NULL), SMELT_STATUS_OUT_OF_MEMORY,
      "more than this machine's");
  /* Tensor ops cannot serve f64 on a GPU. */
  smelt_ctx *cu = th_cuda();
  if (cu) {
    th_buf A = th_buf_new(cu, 1024), D = th_buf_new(cu, 1024);
    int64_t sh[2] = {4, 4};
    smelt_tensor a = smelt_tensor_make(A.data, SMELT_DTYPE_F64, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), 2, sh);
    smelt_tensor dd = smelt_tensor_make(D.data, SMELT_DTYPE_F64, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), 2, sh);
    d = smelt_gemm_desc_default();
    d.math.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
    CHECK_STATUS(smelt_gemm(cu, &d, &a, &a, NULL, &dd, NULL), SMELT_STATUS_UNSUPPORTED);
    CHECK_MSG("no tensor-op kernel");
    d = smelt_gemm_desc_default();
    d.tile.m = 96;
    CHECK_STATUS(smelt_gemm(cu, &d, &a, &a, NULL, &dd, NULL), SMELT_STATUS_UNSUPPORTED);
    CHECK_MSG("64x64x16");
    th_buf_free(&A);
    th_buf_free(&D);
  }
}

/* ---------------------------------------------------------------- GPU: kernels */

/* Every tensor-op kernel of the table, reached through the description
 * (dtype, layout, tile), on sizes that cut every tile edge, and the SIMT
 * kernels on the same shapes. */
static void test_gpu_kernels(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  static const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 9}, {127, 129, 65}, {200, 136, 100}, {64, 64, 64}};
  static const int tiles[] = {128, 64};
  for (int ci = 0; ci < NCOMBOS; ci++) {
    const combo *c = &combos[ci];
    const int eight = c->a == SMELT_DTYPE_I8 || is_fp8(c->a);
    for (int lay = 0; lay < 4; lay++) {
      if (eight && lay != 1) continue; /* 8-bit tensor ops are K-major: A row-major, B column-major */
      for (int ti = 0; ti < 2; ti++)
        for (int si = 0; si < 5; si++) {
          gspec s = combo_spec(c, shapes[si][0], shapes[si][1], shapes[si][2]);
          s.a_col = lay >> 1;
          s.b_col = lay & 1;
          s.ld16 = 1;
          s.desc.tile.m = tiles[ti];
          /* Tensor-op kinds force tensor cores; the rest exercise SIMT (64 x 64). */
          int tc = (c->a == SMELT_DTYPE_F16 && c->b == SMELT_DTYPE_F16 && !c->acc) || c->a == SMELT_DTYPE_BF16 ||
                   eight || c->op != SMELT_GEMM_MATH_DEFAULT;
          if (c->a == SMELT_DTYPE_F16 && c->b == SMELT_DTYPE_BF16) tc = 0;
          if (c->a == SMELT_DTYPE_F32 && c->b == SMELT_DTYPE_F16) tc = 0;
          const int only128 = c->op != SMELT_GEMM_MATH_DEFAULT || eight;
          if (tc && ti == 1 && only128) continue;
          if (!tc && ti == 0) continue;
          if (tc) s.desc.math.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
          s.has_c = si & 1;
          s.has_bias = si >= 2;
          s.desc.epilogue.beta = s.has_c ? -0.5 : 0.0;
          s.desc.epilogue.act = si == 3 ? SMELT_ACT_GELU : SMELT_ACT_IDENTITY;
          if (!check(&s, 0, tc ? "tensor op" : "simt")) return;
        }
    }
  }
}

/* Large odd sizes on the main paths, and padded (non-contiguous) operands. */
static void test_gpu_large(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  gspec s = spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 1003, 1003, 1003);
  s.b_col = 1;
  s.has_bias = 1;
  s.desc.epilogue.act = SMELT_ACT_GELU;
  if (!check(&s, 0, "large")) return;
  s = spec(SMELT_DTYPE_F16, SMELT_DTYPE_F16, SMELT_DTYPE_F32, 517, 1003, 263);
  s.a_col = 1;
  s.pad = 8; /* keeps 16-byte alignment: still tensor cores */
  if (!check(&s, 0, "large")) return;
  s = spec(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 300, 1003, 257);
  s.desc.math.op = SMELT_GEMM_MATH_3XTF32;
  if (!check(&s, 0, "large")) return;
  s = spec(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 255, 257, 1003);
  s.pad = 1;
  if (!check(&s, 0, "large")) return;
}

/* Operands the tensor-op kernels cannot take: misaligned pointers or odd
 * leading dimensions take the SIMT path; a plan made for aligned tensors
 * falls back at run time when given misaligned ones. */
static void test_gpu_unaligned(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  gspec s = spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 70, 33, 45);
  s.misalign = 1;
  if (!check(&s, 0, "misaligned")) return;
  s = spec(SMELT_DTYPE_F16, SMELT_DTYPE_F16, SMELT_DTYPE_F16, 31, 66, 37);
  s.pad = 1;
  s.b_col = 1;
  if (!check(&s, 0, "odd ld")) return;
  /* Plan aligned, run misaligned: the result must still be right. */
  const int64_t M = 40, N = 24, K = 32;
  th_buf A = th_buf_new(cu, (size_t)(M * K + 8) * 2), B = th_buf_new(cu, (size_t)(K * N + 8) * 2),
         D = th_buf_new(cu, (size_t)(M * N + 8) * 4);
  uint16_t *ha = malloc((size_t)(M * K + 8) * 2), *hb = malloc((size_t)(K * N + 8) * 2);
  float *hd = malloc((size_t)(M * N + 8) * 4);
  fill(ha, SMELT_DTYPE_BF16, M * K + 8);
  fill(hb, SMELT_DTYPE_BF16, K * N + 8);
  th_buf_upload(&A, ha, A.bytes);
  th_buf_upload(&B, hb, B.bytes);
  int64_t sa[2] = {M, K}, sb[2] = {K, N}, sd[2] = {M, N};
  int di = smelt_ctx_device_index(cu);
  smelt_tensor ta = smelt_tensor_make(A.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di, 2, sa),
               tb = smelt_tensor_make(B.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di, 2, sb),
               td = smelt_tensor_make(D.data, SMELT_DTYPE_F32, SMELT_DEVICE_CUDA, di, 2, sd);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_gemm_plan(cu, NULL, &ta, &tb, NULL, &td, NULL, &plan));
  REQUIRE(plan);
  /* A tensor-op kernel (RR: mma.sync, or the Hopper one with an MN-major B). */
  CHECK(strstr(smelt_plan_describe(plan), "sm80") != NULL || strstr(smelt_plan_describe(plan), "sm90") != NULL);
  for (int off = 0; off < 2; off++) {
    smelt_tensor a2 = ta;
    a2.data = (uint16_t *)A.data + off;
    CHECK_OK(smelt_gemm_run(plan, &a2, &tb, NULL, &td, NULL));
    th_buf_download(&D, hd, D.bytes);
    double *got = malloc(sizeof(double) * (size_t)(M * N)), *want = malloc(sizeof(double) * (size_t)(M * N));
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        double acc = 0;
        for (int64_t k = 0; k < K; k++)
          acc += th_get(ha, SMELT_DTYPE_BF16, off + i * K + k) * th_get(hb, SMELT_DTYPE_BF16, k * N + j);
        want[i * N + j] = (float)acc;
        got[i * N + j] = hd[i * N + j];
      }
    CHECK(th_compare(off ? "run misaligned" : "run aligned", got, want, M * N, 1e-5, 0));
    free(got);
    free(want);
  }
  smelt_plan_destroy(plan);
  free(ha);
  free(hb);
  free(hd);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
}

/* Every activation with bias (f32 or bf16), alpha, slope and scale_d on one
 * ragged bf16 problem, m x 520 x 72, through the Hopper tile tm x tn (0:
 * chosen); D bf16 or f16, and f32 too with f32_d. 0 at the first failure. */
static int sm90_epilogue_sweep(int64_t m, int tm, int tn, int f32_d, const char *what) {
  for (int a = 0; a < SMELT_ACT_COUNT; a++) {
    const smelt_dtype dd = f32_d && a % 3 == 2 ? SMELT_DTYPE_F32 : a % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
    gspec s = rc_spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, dd, m, 520, 72);
    s.desc.tile.m = tm;
    s.desc.tile.n = tn;
    s.has_bias = 1;
    s.bias = a % 3 ? SMELT_DTYPE_F32 : SMELT_DTYPE_BF16;
    s.desc.epilogue.act = (smelt_act)a;
    s.desc.epilogue.alpha = 1.5;
    s.desc.epilogue.slope = 0.2f;
    s.desc.epilogue.scale_d = 0.5f;
    if (!check(&s, 0, what)) return 0;
  }
  return 1;
}

/* The Hopper kernel (sm_90a only), forced through its tile: sizes that cut
 * every tile edge, several tiles per persistent CTA, both 16-bit types, tf32
 * and fp8, and both epilogues (general: C or fp8 D; fast: 16-bit or f32
 * row-major D without C) with bias and activations. */
static void test_gpu_sm90(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  static const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 9}, {129, 257, 70}, {300, 520, 333}, {1003, 1003, 1003},
                                      {2048, 2304, 256}};
  for (int t = 0; t < 2; t++)
    for (int si = 0; si < 6; si++) {
      smelt_dtype dt = t ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
      gspec s = rc_spec(dt, dt, si % 2 ? SMELT_DTYPE_F32 : dt, shapes[si][0], shapes[si][1], shapes[si][2]);
      s.desc.tile.n = 256;
      s.has_c = si >= 2 && si != 4;
      s.has_bias = si >= 3;
      s.desc.epilogue.beta = s.has_c ? 0.25 : 0.0;
      s.desc.epilogue.act = si == 4 ? SMELT_ACT_GELU : si == 5 ? SMELT_ACT_SILU : SMELT_ACT_IDENTITY;
      s.pad = si == 3 ? 8 : 0;
      if (!check(&s, 0, "sm90")) return;
    }
  /* The fast epilogue (16-bit row-major D, rows of whole 16-byte units, no
   * C; TMA stores of 64 x 64 pieces; the N of 1, 13 and 1003 above take its
   * thread stores, those with C the general epilogue, and their D row
   * padding must stay untouched): every
   * activation with bias, alpha, slope and scale_d on a ragged tile; a
   * consumer half wholly past M (m 60) and tiles cut inside a piece
   * (n 136); one row; 160 tiles over 132 SMs; clamp. */
  if (!sm90_epilogue_sweep(300, 0, 256, 0, "sm90 fast epilogue")) return;
  static const int64_t fshapes[][3] = {{60, 136, 100}, {1, 40, 5}, {1200, 4000, 40}, {129, 64, 256}};
  for (int si = 0; si < 4; si++) {
    gspec s = rc_spec(SMELT_DTYPE_F16, SMELT_DTYPE_F16, si % 2 ? SMELT_DTYPE_BF16 : SMELT_DTYPE_F16, fshapes[si][0],
                      fshapes[si][1], fshapes[si][2]);
    s.desc.tile.n = 256;
    s.has_bias = si < 2;
    s.desc.epilogue.act = si == 0 ? SMELT_ACT_GELU_TANH : SMELT_ACT_IDENTITY;
    if (!check(&s, 0, "sm90 fast epilogue")) return;
  }
  /* The fast epilogue's thread stores (smelt__gemm_sm90_fast_d 2): D's
   * rows not whole 16-byte units (N odd: 16-bit and f32; rows padded by an
   * odd count) or D's start not 16-byte aligned (misalign: every operand
   * one element off, so A and B take the pre-pass copy too), element by
   * element out of the piece buffer; the row padding and everything past
   * M and N keep their poison. */
  static const int64_t ushapes[][3] = {{300, 517, 99}, {129, 65, 40}, {1003, 1003, 1003}, {200, 264, 70}};
  for (int si = 0; si < 4; si++) {
    gspec s = rc_spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, si == 1 ? SMELT_DTYPE_F32 : SMELT_DTYPE_BF16,
                      ushapes[si][0], ushapes[si][1], ushapes[si][2]);
    s.desc.tile.n = 256;
    s.has_bias = si != 2;
    s.desc.epilogue.act = si == 0 ? SMELT_ACT_GELU : si == 3 ? SMELT_ACT_SILU : SMELT_ACT_IDENTITY;
    s.pad = si == 0 ? 3 : si == 1 ? 1 : 0;
    s.misalign = si == 3;
    if (!check(&s, 0, "sm90 thread stores")) return;
  }
  for (int clamp = 0; clamp < 2; clamp++) {
    gspec s = rc_spec(SMELT_DTYPE_F16, SMELT_DTYPE_F16, SMELT_DTYPE_F16, 70, 304, 16);
    s.desc.tile.n = 256;
    s.desc.epilogue.alpha = 1e6;
    s.desc.epilogue.clamp = clamp;
    if (!check(&s, 0, "sm90 fast epilogue clamp")) return;
  }
  /* The narrow tile (128 x 64, 8 stages), asked for: both epilogues, ragged
   * edges, a skinny M, more tiles than SMs. */
  static const int64_t nshapes[][3] = {{7, 13, 9}, {129, 200, 70}, {128, 4096, 256}, {1000, 3000, 32}};
  for (int si = 0; si < 4; si++) {
    gspec s = rc_spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, si == 1 ? SMELT_DTYPE_F32 : SMELT_DTYPE_BF16, nshapes[si][0],
                      nshapes[si][1], nshapes[si][2]);
    s.desc.tile.m = 128;
    s.desc.tile.n = 64;
    s.has_c = si == 1;
    s.has_bias = si != 3;
    s.desc.epilogue.beta = s.has_c ? 0.25 : 0.0;
    s.desc.epilogue.act = si == 2 ? SMELT_ACT_GELU : SMELT_ACT_IDENTITY;
    if (!check(&s, 0, "sm90 narrow")) return;
  }
  /* The 64-row tiles (one consumer warpgroup), asked for: 64 x 64 (13
   * stages) and 64 x 128 (8 stages). M of 1, 7, 64, 65, 127, 128 and 1003
   * (a tile of one row), ragged N and K, K of more steps than stages
   * (1000), more tiles than SMs (1003 x 1000), both epilogues (C with beta
   * and N of 13 take the general one; 16-bit and f32 D the fast one), bias
   * with activations. */
  static const int64_t rshapes[][3] = {{1, 8, 5},      {7, 13, 9},       {64, 4096, 256},   {65, 200, 70},
                                       {127, 136, 1000}, {128, 2048, 512}, {1003, 1000, 333}};
  static const int rtiles[][2] = {{64, 64}, {64, 128}};
  for (int ti = 0; ti < 2; ti++)
    for (int si = 0; si < 7; si++) {
      const smelt_dtype dt = (ti + si) % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
      gspec s = rc_spec(dt, dt, si == 3 || si == 6 ? SMELT_DTYPE_F32 : dt, rshapes[si][0], rshapes[si][1],
                        rshapes[si][2]);
      s.desc.tile.m = rtiles[ti][0];
      s.desc.tile.n = rtiles[ti][1];
      s.has_c = si == 1 || si == 3;
      s.has_bias = si != 2;
      s.desc.epilogue.beta = s.has_c ? 0.25 : 0.0;
      s.desc.epilogue.act = si == 4   ? SMELT_ACT_GELU
                            : si == 5 ? SMELT_ACT_SILU
                            : si == 6 ? SMELT_ACT_GELU_TANH
                                      : SMELT_ACT_IDENTITY;
      char what[48];
      snprintf(what, sizeof what, "sm90 64-row %dx%d", rtiles[ti][0], rtiles[ti][1]);
      if (!check(&s, 0, what)) return;
    }
  /* ... and chosen without asking for skinny M: every activation with
   * bias, alpha, slope and scale_d on ragged tiles (M 100: one tile row,
   * the second 64 rows past M), 16-bit and f32 D. */
  if (!sm90_epilogue_sweep(100, 0, 0, 1, "sm90 64-row epilogue")) return;
  /* The ping-pong schedule (128 x 128, asked for): each consumer owns
   * whole tiles and steps over the other's stages of the ring, so the
   * cases have one to five tiles per CTA (247 and 612 tiles over 132
   * CTAs: odd and even counts), ragged M, N and K, a tile whose lower
   * 64-row half lies past M (m 60), f32 and 16-bit D, bias and every
   * activation with alpha, slope and scale_d; and tiles of more K steps
   * than stages with three per CTA (k 520, 286 tiles), where a consumer
   * skips laps of the ring. */
  static const int64_t pshapes[][3] = {
      {2400, 1600, 200}, {2100, 4488, 72}, {60, 136, 100}, {1003, 1000, 333}, {1300, 3300, 520}};
  for (int si = 0; si < 5; si++) {
    gspec s = rc_spec(si % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16, si % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16,
                      si == 2 ? SMELT_DTYPE_F32 : si % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16, pshapes[si][0],
                      pshapes[si][1], pshapes[si][2]);
    s.desc.tile.m = 128;
    s.desc.tile.n = 128;
    s.has_bias = si != 1;
    s.desc.epilogue.act = si == 0 ? SMELT_ACT_GELU : si == 2 ? SMELT_ACT_SILU : SMELT_ACT_IDENTITY;
    if (!check(&s, 0, "sm90 ping-pong")) return;
  }
  if (!sm90_epilogue_sweep(300, 128, 128, 0, "sm90 ping-pong epilogue")) return;
  /* Parallel split-K on the Hopper kernel, asked for: slices write f32
   * partial sums through 3-D TMA stores (each slice's rows clip at M),
   * gemm_reduce applies the epilogue. Slices chosen by smelt (2 of the
   * narrow tile here), 3 and 16; ragged M, N and K; C. */
  static const int64_t kshapes[][4] = {{128, 2048, 2048, 0}, {200, 516, 1000, 3}, {130, 264, 333, 16}};
  for (int si = 0; si < 3; si++) {
    gspec s = rc_spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, si == 1 ? SMELT_DTYPE_F32 : SMELT_DTYPE_BF16, kshapes[si][0],
                      kshapes[si][1], kshapes[si][2]);
    s.desc.mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
    s.desc.split_k = (int)kshapes[si][3];
    s.has_c = si == 1;
    s.desc.epilogue.beta = s.has_c ? 0.5 : 0.0;
    s.has_bias = 1;
    s.desc.epilogue.act = si == 2 ? SMELT_ACT_IDENTITY : SMELT_ACT_GELU;
    if (!check(&s, 0, "sm90 split-K")) return;
  }
  /* The 64-row tile splits the same way (3 slices; 2 chosen). */
  for (int si = 0; si < 2; si++) {
    gspec s = rc_spec(SMELT_DTYPE_F16, SMELT_DTYPE_F16, si ? SMELT_DTYPE_F16 : SMELT_DTYPE_F32, 65 + 62 * si, 264,
                      si ? 2048 : 1000);
    s.desc.tile.m = s.desc.tile.n = 64;
    s.desc.mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
    s.desc.split_k = si ? 0 : 3;
    s.has_c = !si;
    s.desc.epilogue.beta = s.has_c ? 0.5 : 0.0;
    s.has_bias = 1;
    s.desc.epilogue.act = SMELT_ACT_GELU;
    if (!check(&s, 0, "sm90 64-row split-K")) return;
  }
  /* tf32 and fp8 split the same way (K tiles of 32 and 128 elements). */
  for (int fi = 0; fi < 2; fi++) {
    gspec s = fi ? rc_spec(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, 200, 516, 1000)
                 : rc_spec(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 200, 516, 1000);
    if (!fi) s.desc.math.op = SMELT_GEMM_MATH_TF32;
    s.desc.tile.n = 256; /* their only Hopper tile (else few tiles take mma.sync) */
    s.desc.mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
    s.desc.split_k = 3;
    s.has_bias = 1;
    if (!check(&s, 0, "sm90 split-K")) return;
  }
  /* tf32 and fp8 on the same kernel (K steps of 32 and 128 elements):
   * ragged K, both epilogues, every fp8 pair with its scales. */
  static const int64_t tshapes[][3] = {{129, 264, 70}, {1003, 1003, 1003}, {300, 520, 333}};
  for (int si = 0; si < 3; si++) {
    gspec s = rc_spec(SMELT_DTYPE_F32, SMELT_DTYPE_F32, si == 1 ? SMELT_DTYPE_BF16 : SMELT_DTYPE_F32, tshapes[si][0],
                      tshapes[si][1], tshapes[si][2]);
    s.desc.tile.n = 256;
    s.desc.math.op = SMELT_GEMM_MATH_TF32;
    s.has_c = si == 2;
    s.has_bias = si >= 1;
    s.desc.epilogue.beta = s.has_c ? 0.25 : 0.0;
    s.desc.epilogue.act = si == 1 ? SMELT_ACT_GELU : SMELT_ACT_IDENTITY;
    if (!check(&s, 0, "sm90 tf32")) return;
  }
  static const smelt_dtype f8[][3] = {{SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16},
                                      {SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2, SMELT_DTYPE_F16},
                                      {SMELT_DTYPE_E5M2, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16},
                                      {SMELT_DTYPE_E5M2, SMELT_DTYPE_E5M2, SMELT_DTYPE_E4M3}};
  for (int fi = 0; fi < 4; fi++) {
    const int64_t *sh = tshapes[fi % 3];
    gspec s = rc_spec(f8[fi][0], f8[fi][1], f8[fi][2], sh[0], sh[1], sh[2] + 130);
    s.desc.tile.n = 256;
    s.desc.epilogue.scale_a = 0.5f;
    s.desc.epilogue.scale_b = 2.0f;
    s.desc.epilogue.scale_d = is_fp8(f8[fi][2]) ? 4.0f : 1.0f;
    s.has_bias = fi % 2;
    s.has_c = fi == 2;
    s.desc.epilogue.beta = s.has_c ? 0.5 : 0.0;
    if (!check(&s, 0, "sm90 fp8")) return;
  }
  /* Chosen without asking once the tiles fill the GPU. */
  const int64_t M = 2048, N = 4096, K = 64;
  th_buf A = th_buf_new(cu, (size_t)(M * K) * 2), B = th_buf_new(cu, (size_t)(K * N) * 2), D = th_buf_new(cu, (size_t)(M * N) * 2);
  int64_t sa[2] = {M, K}, sd[2] = {M, N};
  int di_ = smelt_ctx_device_index(cu);
  smelt_tensor ta = smelt_tensor_make(A.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di_, 2, sa),
               td = smelt_tensor_make(D.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di_, 2, sd);
  smelt_tensor tb = ta;
  tb.data = B.data;
  tb.shape[0] = K;
  tb.shape[1] = N;
  tb.strides[0] = 1;
  tb.strides[1] = K;
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_gemm_plan(cu, NULL, &ta, &tb, NULL, &td, NULL, &plan));
  if (plan) CHECK(strstr(smelt_plan_describe(plan), "gemm_sm90") != NULL);
  smelt_plan_destroy(plan);
  /* A skinny M (128 rows: 16 wide tiles, 64 narrow ones) takes the 64-row
   * tile. */
  ta.shape[0] = 128;
  td.shape[0] = 128;
  plan = NULL;
  CHECK_OK(smelt_gemm_plan(cu, NULL, &ta, &tb, NULL, &td, NULL, &plan));
  if (plan) CHECK(strstr(smelt_plan_describe(plan), "gemm_sm90_bf16_RC_64x64") != NULL);
  smelt_plan_destroy(plan);
  /* ... also with a long K: no split (two slices and gemm_reduce ran
   * slower than 64 SMs unsplit on the 128-row tile). */
  th_buf A2 = th_buf_new(cu, (size_t)(128 * 4096) * 2), B2 = th_buf_new(cu, (size_t)(4096 * N) * 2);
  int64_t sa2[2] = {128, 4096};
  smelt_tensor ta2 = smelt_tensor_make(A2.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di_, 2, sa2), tb2 = tb;
  tb2.data = B2.data;
  tb2.shape[0] = 4096;
  tb2.strides[1] = 4096;
  plan = NULL;
  CHECK_OK(smelt_gemm_plan(cu, NULL, &ta2, &tb2, NULL, &td, NULL, &plan));
  if (plan) {
    CHECK(strstr(smelt_plan_describe(plan), "gemm_sm90_bf16_RC_64x64") != NULL);
    CHECK(strstr(smelt_plan_describe(plan), "split-K") == NULL);
  }
  smelt_plan_destroy(plan);
  th_buf_free(&A2);
  th_buf_free(&B2);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
}

/* A plain GEMM whose tiles would busy at most an eighth of the SMs splits K
 * on its own (a MoE router's logits: 1 x 8 x 4096, bf16 into f32), and its
 * result is exact on small integers. */
static void test_gpu_sm90_few_tiles_split(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  const int di_ = smelt_ctx_device_index(cu);
  const int64_t M = 1, N = 8, K = 4096;
  uint16_t *ha = malloc((size_t)(M * K) * 2), *hb = malloc((size_t)(K * N) * 2);
  double want[8] = {0};
  for (int64_t k = 0; k < K; k++) {
    const int av = (int)(k % 5) - 2;
    ha[k] = smelt_f32_to_bf16((float)av);
    for (int64_t n = 0; n < N; n++) {
      const int bv = (int)((k * 3 + n) % 7) - 3;
      hb[k * N + n] = smelt_f32_to_bf16((float)bv);
      want[n] += av * bv;
    }
  }
  th_buf A = th_buf_new(cu, (size_t)(M * K) * 2), B = th_buf_new(cu, (size_t)(K * N) * 2), D = th_buf_new(cu, (size_t)(M * N) * 4);
  th_buf_upload(&A, ha, (size_t)(M * K) * 2);
  th_buf_upload(&B, hb, (size_t)(K * N) * 2);
  int64_t sa[2] = {M, K}, sb[2] = {K, N}, sd[2] = {M, N};
  smelt_tensor ta = smelt_tensor_make(A.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di_, 2, sa),
               tb = smelt_tensor_make(B.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di_, 2, sb),
               td = smelt_tensor_make(D.data, SMELT_DTYPE_F32, SMELT_DEVICE_CUDA, di_, 2, sd);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_gemm_plan(cu, NULL, &ta, &tb, NULL, &td, NULL, &plan));
  if (plan) {
    CHECK(strstr(smelt_plan_describe(plan), "gemm_sm90") != NULL);
    CHECK(strstr(smelt_plan_describe(plan), "split-K parallel") != NULL);
    CHECK_OK(smelt_gemm_run(plan, &ta, &tb, NULL, &td, NULL));
    float got[8];
    th_buf_download(&D, got, sizeof got);
    for (int n = 0; n < 8; n++) CHECK(got[n] == (float)want[n]);
  }
  smelt_plan_destroy(plan);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
  free(ha);
  free(hb);
}

/* Clusters with TMA multicast (kernels/gemm_sm90.cu), asked for through
 * desc.tile.cluster_m / cluster_n. */
/* The split tail on the Hopper kernel (plain runs, cooperative tiles):
 * the tiles of a part-idle last wave run in K chunks over all CTAs, each
 * chunk but the last storing its partial sums in a slot, the last adding
 * them and finishing the tile. Chosen by the heuristic, on 128 x 64 tiles
 * (small problems with many tiles: the CPU reference is the test's cost):
 * 143 tiles of 9 K steps (4 chunks) with bias + GELU, 306 tiles (2 chunks)
 * into f32 D, odd N (thread stores), C (the general epilogue); on 128 x 256
 * tiles, 143 of them with bias + GELU; forced (SMELT_GEMM_SPLIT_TAIL=on) where
 * it saves too little to be chosen: 222 narrow tiles, a tail of 90 in 4
 * chunks (360 units: CTAs with chunks of several tiles). Each result twice,
 * bitwise equal (the chunks add in a fixed order). */
static void test_gpu_sm90_split_tail(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  static const struct {
    int64_t m, n, k;
    int tn, f32_d, has_c, act, force;
  } cases[] = {
      {1300, 832, 520, 64, 0, 0, 1, 0}, {2100, 1100, 300, 64, 1, 0, 0, 0}, {1300, 833, 260, 64, 0, 0, 0, 0},
      {1300, 832, 300, 64, 0, 1, 0, 0}, {1300, 3300, 260, 256, 0, 0, 1, 0}, {700, 2360, 512, 64, 0, 0, 0, 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    gspec s = rc_spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, cases[i].f32_d ? SMELT_DTYPE_F32 : SMELT_DTYPE_BF16,
                      cases[i].m, cases[i].n, cases[i].k);
    s.desc.tile.m = 128;
    s.desc.tile.n = cases[i].tn;
    s.has_c = cases[i].has_c;
    s.desc.epilogue.beta = s.has_c ? 0.5 : 0.0;
    s.has_bias = cases[i].act;
    s.desc.epilogue.act = cases[i].act ? SMELT_ACT_GELU : SMELT_ACT_IDENTITY;
    if (cases[i].force) setenv("SMELT_GEMM_SPLIT_TAIL", "on", 1);
    int ok = check(&s, 0, "sm90 split tail");
    if (ok) {
      ginputs in;
      inputs_new(&s, &in);
      const size_t n = (size_t)(s.m * s.n);
      double *g1 = (double *)malloc(sizeof(double) * n), *g2 = (double *)malloc(sizeof(double) * n);
      ok = run_case(cu, &s, &in, g1) == SMELT_OK && run_case(cu, &s, &in, g2) == SMELT_OK &&
           !memcmp(g1, g2, sizeof(double) * n);
      CHECK(ok);
      free(g1);
      free(g2);
      inputs_free(&in);
    }
    unsetenv("SMELT_GEMM_SPLIT_TAIL");
    if (!ok) return;
  }
}

/* RR, CC and CR on the Hopper kernel (MN-major boxes and descriptors), in
 * the three tiles the selector takes unasked: a tile of one row, ragged M,
 * N and K (TMA zero fill inside the panels), K of more steps than stages,
 * more tiles than SMs, both epilogues (C with beta and an N of 13 take the
 * general one), bias with activations, padded leading dimensions. */
static void test_gpu_sm90_layouts(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  static const int64_t shapes[][3] = {{1, 8, 5}, {7, 13, 9}, {129, 264, 70}, {300, 520, 1000}, {1003, 1000, 333}};
  static const int tiles[][2] = {{128, 256}, {128, 64}, {64, 64}};
  for (int l = 0; l < 3; l++)
    for (int ti = 0; ti < 3; ti++)
      for (int si = 0; si < 5; si++) {
        const smelt_dtype dt = (l + ti + si) % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
        gspec s = spec(dt, dt, si == 2 ? SMELT_DTYPE_F32 : dt, shapes[si][0], shapes[si][1], shapes[si][2]);
        s.a_col = l != 0;
        s.b_col = l == 1;
        s.ld16 = 1;
        s.pad = si == 3 ? 8 : 0;
        s.desc.tile.m = tiles[ti][0];
        s.desc.tile.n = tiles[ti][1];
        s.has_c = si == 1;
        s.has_bias = si >= 2;
        s.desc.epilogue.beta = s.has_c ? 0.25 : 0.0;
        s.desc.epilogue.act = si == 3 ? SMELT_ACT_GELU : si == 4 ? SMELT_ACT_SILU : SMELT_ACT_IDENTITY;
        if (!check(&s, 0, "sm90 layouts")) return;
      }
  /* The ping-pong schedule (128 x 128, asked for) for RR and CR (B
   * MN-major; CR's A halves its two MN-major panels): ragged edges, more K
   * steps than stages with a consumer skipping laps of the ring (k 520),
   * f32 and 16-bit D (the only epilogue it has: no C). */
  static const int64_t pshapes[][3] = {{60, 136, 100}, {1003, 1000, 333}, {1300, 3300, 520}};
  for (int si = 0; si < 6; si++) {
    const smelt_dtype dt = si % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
    gspec s = spec(dt, dt, si % 3 == 0 ? SMELT_DTYPE_F32 : dt, pshapes[si % 3][0], pshapes[si % 3][1],
                   pshapes[si % 3][2]);
    s.a_col = si >= 3;
    s.ld16 = 1;
    s.desc.tile.m = s.desc.tile.n = 128;
    s.has_bias = si % 3 != 1;
    s.desc.epilogue.act = si % 3 == 2 ? SMELT_ACT_GELU : SMELT_ACT_IDENTITY;
    if (!check(&s, 0, "sm90 ping-pong layouts")) return;
  }
}

/* Batched on the Hopper kernel (3-D maps, tiles entry by entry): each
 * unasked tile and layout, a broadcast B (batch stride 0: a 2-D map), f32
 * D, bias with activations, ragged edges; with C it falls to mma.sync. */
static void test_gpu_sm90_batched(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  static const struct {
    int64_t l, m, n, k;
    int tm, tn, lay, bcast, f32_d, c;
  } cases[] = {
      {3, 129, 264, 70, 128, 256, 1, 0, 0, 0}, {2, 7, 8, 5, 64, 64, 0, 1, 1, 0},
      {5, 300, 136, 333, 128, 64, 2, 0, 0, 0}, {4, 256, 320, 512, 0, 0, 3, 1, 0, 0},
      {3, 65, 72, 40, 0, 0, 1, 0, 0, 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const smelt_dtype dt = i % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
    gspec s = spec(dt, dt, cases[i].f32_d ? SMELT_DTYPE_F32 : dt, cases[i].m, cases[i].n, cases[i].k);
    s.batch = cases[i].l;
    s.b_bcast = cases[i].bcast;
    s.a_col = cases[i].lay == 2 || cases[i].lay == 3;
    s.b_col = cases[i].lay == 1 || cases[i].lay == 2;
    s.ld16 = 1;
    s.desc.tile.m = cases[i].tm;
    s.desc.tile.n = cases[i].tn;
    s.has_c = cases[i].c;
    s.desc.epilogue.beta = s.has_c ? 0.5 : 0.0;
    s.has_bias = i != 1;
    s.desc.epilogue.act = i == 0 ? SMELT_ACT_GELU : i == 2 ? SMELT_ACT_SILU : SMELT_ACT_IDENTITY;
    if (!check(&s, 0, "sm90 batched")) return;
  }
}

static void test_gpu_sm90_cluster(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  /* Pairs along M on the wide tile (B shared), pairs and quads along N on
   * the narrow tile (A shared). Tile counts that are not multiples of the
   * cluster (the out-of-range tile of a unit loads zeros, stores nothing
   * and still arrives on the barriers): 3 x 3, 1 x 65 and 19 x 7 wide, 9
   * and 65 narrow columns; ragged M, N and K; K with more steps than
   * stages (333 and 1000); more units than clusters (so clusters walk
   * several units); one row; both epilogues (f32 D with C takes the
   * general one), bias and activations. */
  static const int cls[][2] = {{2, 1}, {1, 2}, {1, 4}};
  static const int64_t cshapes[][3] = {{300, 520, 333}, {129, 72, 70},   {128, 4104, 1000},
                                       {2400, 1600, 72}, {60, 136, 100}, {1, 8, 1}};
  for (int ci = 0; ci < 3; ci++)
    for (int si = 0; si < 6; si++) {
      const smelt_dtype dt = (ci + si) % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
      gspec s = rc_spec(dt, dt, si == 1 ? SMELT_DTYPE_F32 : dt, cshapes[si][0], cshapes[si][1], cshapes[si][2]);
      s.desc.tile.cluster_m = cls[ci][0];
      s.desc.tile.cluster_n = cls[ci][1];
      s.has_c = si == 1;
      s.has_bias = si != 3;
      s.desc.epilogue.beta = s.has_c ? 0.25 : 0.0;
      s.desc.epilogue.act = si == 0 ? SMELT_ACT_GELU : si == 4 ? SMELT_ACT_SILU : SMELT_ACT_IDENTITY;
      char what[48];
      snprintf(what, sizeof what, "sm90 cluster %dx%d", cls[ci][0], cls[ci][1]);
      if (!check(&s, 0, what)) return;
    }
}

/* The fast epilogue's MUFU forms of gelu, gelu_tanh, sigmoid and silu for
 * 16-bit D (kernels/gemm_sm90.cu, act16), element by element over
 * [-16, 16]: A [i, 0] = 1, A [i, 1] = r_i and B [0, j] = x_j, B [1, j] = 1
 * (everything else 0) make acc = x_j + r_i exactly, so D [i, j] must be
 * act(x_j + r_i) rounded once: every element within one ulp of the
 * correctly rounded value (or 0 where that is below max(1, |x|) 2^-126:
 * the MUFU forms flush), and at most 5% of them one ulp off (those whose exact
 * value lies within the forms' 2e-5 relative error of a rounding
 * boundary; a wrong coefficient moves far more, by far more). Both
 * schedules (cooperative 128 x 256, ping-pong 128 x 128). */
static void test_gpu_sm90_act16(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  const int64_t M = 256, N = 4096, K = 64;
  th_buf A = th_buf_new(cu, (size_t)(M * K) * 2), B = th_buf_new(cu, (size_t)(K * N) * 2),
         D = th_buf_new(cu, (size_t)(M * N) * 2);
  uint16_t *ha = calloc((size_t)(M * K), 2), *hb = calloc((size_t)(K * N), 2), *hd = malloc((size_t)(M * N) * 2);
  double *x = malloc(sizeof(double) * (size_t)N), *r = malloc(sizeof(double) * (size_t)M);
  for (int64_t j = 0; j < N; j++) {
    /* Evenly over [-16, 16] plus, every 16th, a small value near 0. */
    double v = j % 16 ? -16.0 + 32.0 * ((double)j + 0.5) / (double)N : ldexp((double)(j / 16 % 64) - 32.0, -12);
    th_set(hb, SMELT_DTYPE_BF16, j * K, v);
    x[j] = th_get(hb, SMELT_DTYPE_BF16, j * K);
    th_set(hb, SMELT_DTYPE_BF16, j * K + 1, 1.0);
  }
  for (int64_t i = 0; i < M; i++) {
    th_set(ha, SMELT_DTYPE_BF16, i * K, 1.0);
    r[i] = ldexp((double)(i % 128) - 64.0, -11); /* exact in bf16; x_j + r_i exact in f32 */
    th_set(ha, SMELT_DTYPE_BF16, i * K + 1, r[i]);
  }
  th_buf_upload(&A, ha, A.bytes);
  th_buf_upload(&B, hb, B.bytes);
  int64_t sa[2] = {M, K}, sd[2] = {M, N};
  int dix = smelt_ctx_device_index(cu);
  smelt_tensor ta = smelt_tensor_make(A.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, dix, 2, sa);
  smelt_tensor tb = ta;
  tb.data = B.data;
  tb.shape[0] = K;
  tb.shape[1] = N;
  tb.strides[0] = 1;
  tb.strides[1] = K;
  static const smelt_act acts[] = {SMELT_ACT_GELU, SMELT_ACT_GELU_TANH, SMELT_ACT_SIGMOID, SMELT_ACT_SILU};
  for (int dt = 0; dt < 2; dt++)
    for (int sched = 0; sched < 2; sched++)
      for (int a = 0; a < 4; a++) {
        const smelt_dtype dd = dt ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
        smelt_tensor td = smelt_tensor_make(D.data, dd, SMELT_DEVICE_CUDA, dix, 2, sd);
        smelt_gemm_desc desc = smelt_gemm_desc_default();
        desc.tile.m = 128;
        desc.tile.n = sched ? 128 : 256;
        desc.epilogue.act = acts[a];
        smelt_plan *plan = NULL;
        CHECK_OK(smelt_gemm_plan(cu, &desc, &ta, &tb, NULL, &td, NULL, &plan));
        REQUIRE(plan);
        CHECK(strstr(smelt_plan_describe(plan), sched ? "_pp" : "128x256") != NULL);
        CHECK_OK(smelt_gemm_run(plan, &ta, &tb, NULL, &td, NULL));
        smelt_plan_destroy(plan);
        th_buf_download(&D, hd, D.bytes);
        int64_t off = 0, bad = -1;
        for (int64_t i = 0; i < M; i++)
          for (int64_t j = 0; j < N; j++) {
            const double want = convert_ref(act_ref(acts[a], x[j] + r[i], 0), dd, 0),
                         got = th_get(hd, dd, i * N + j);
            /* The documented flush: results below max(1, |x|) 2^-126 may be 0. */
            const double xa = fabs(x[j] + r[i]);
            if (got == want || (got == 0.0 && fabs(want) < ldexp(xa > 1.0 ? xa : 1.0, -126))) continue;
            /* One ulp of the output type at want (f16 subnormals: 2^-24). */
            int e;
            frexp(want, &e);
            double ulp = ldexp(1.0, e - 1 - (dt ? 10 : 7));
            if (dt && ulp < ldexp(1.0, -24)) ulp = ldexp(1.0, -24);
            off++;
            if (!(fabs(got - want) <= ulp) && bad < 0) bad = i * N + j;
          }
        if (bad >= 0 || off > M * N / 20)
          th_fail(__FILE__, __LINE__,
                  "act %d %s %s: %lld of %lld off by one ulp; first worse at x %.9g (got %.9g, want %.9g)", (int)acts[a], dn(dd), sched ? "ping-pong" : "cooperative", (long long)off, (long long)(M * N),
                  bad >= 0 ? x[bad % N] + r[bad / N] : 0.0, bad >= 0 ? th_get(hd, dd, bad) : 0.0,
                  bad >= 0 ? convert_ref(act_ref(acts[a], x[bad % N] + r[bad / N], 0), dd, 0) : 0.0);
      }
  free(ha);
  free(hb);
  free(hd);
  free(x);
  free(r);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
}

/* ---------------------------------------------------------------- selection (no GPU needed) */

/* A state as planning leaves it for bf16 operands and D, f32 accumulation
 * and the default desc, in the given mode and split-K. */
smelt__gemm_state bf16_state(smelt_gemm_mode mode, int split_k) {
  const smelt__gemm_state st = {.desc = smelt_gemm_desc_default(),
                                .mode = mode,
                                .split_k = split_k,
                                .acc = SMELT_GEMM_ACC_F32,
                                .dt_a = SMELT_DTYPE_BF16,
                                .dt_b = SMELT_DTYPE_BF16,
                                .dt_d = SMELT_DTYPE_BF16};
  return st;
}

const char *pick_name(const smelt__gemm_state *st, const smelt__gemm_facts *f, int cc_major, int cc_minor,
                             smelt_status *status) {
  static smelt__kernel_src src;
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  int n = smelt__gemm_table(table), k = -1;
  smelt_device_info dev;
  memset(&dev, 0, sizeof dev);
  dev.cc_major = cc_major;
  dev.cc_minor = cc_minor;
  dev.sm_count = cc_major == 9 ? 132 : 108;
  snprintf(dev.arch, sizeof dev.arch, cc_major == 9 ? "sm_90a" : "sm_80");
  char why[96];
  *status = smelt__gemm_select(st, f, &dev, table, n, &k, why, sizeof why);
  if (*status) return "";
  smelt__gemm_kernel_src(&table[k], &src);
  return src.name;
}

static void test_selector(void) {
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int n = smelt__gemm_table(table);
  /* The enumerator lists exactly the table, with distinct names. */
  CHECK(n > 0 && n <= SMELT__GEMM_MAX_KERNELS);
  CHECK_EQ_INT(smelt__gemm_variants(NULL, 0), n + smelt__gemm_graph_variants(NULL, 0) + 1); /* graphs, pre-pass */
  smelt__kernel_src *all = calloc((size_t)n, sizeof *all);
  smelt__gemm_variants(all, n);
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++)
      if (!strcmp(all[i].name, all[j].name)) th_fail(__FILE__, __LINE__, "duplicate variant %s", all[i].name);
  free(all);
  /* Every Hopper variant fits H100's 227 KiB of shared memory per block. */
  for (int i = 0; i < n; i++)
    if (table[i].fam == SMELT__GK_SM90 && table[i].smem > 227 * 1024)
      th_fail(__FILE__, __LINE__, "table entry %d needs %d bytes of shared memory", i, table[i].smem);
  smelt__gemm_state st = bf16_state(SMELT_GEMM_MODE_PLAIN, 1);
  smelt__gemm_facts f = {.a_k = 1, .a_mn = 1, .b_k = 1, .b_mn = 1, .tma_a = {1, 1}, .tma_b = {1, 1}, .m = 8192,
                         .n = 8192, .k = 8192, .batch = 1, .sm90_d = 1, .k_min = 8192};
  smelt_status s;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4"));
  CHECK(!strcmp(pick_name(&st, &f, 8, 0, &s), "gemm_sm80_bf16_RC_128x128x32_s4_w2x4"));
  /* Batched: the Hopper kernel when D's entries are 16-byte units apart. */
  {
    smelt__gemm_state bs = bf16_state(SMELT_GEMM_MODE_BATCHED, 1);
    smelt__gemm_facts g = f;
    g.batch = 8;
    g.batch_d16 = 1;
    CHECK(!strcmp(pick_name(&bs, &g, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4"));
    g.batch_d16 = 0;
    CHECK(!strncmp(pick_name(&bs, &g, 9, 0, &s), "gemm_sm80_", 10));
  }
  /* The other layouts take the Hopper kernel with MN-major operands, in the
   * tile the same rules give RC (the skinny one: 64 x 64). */
  {
    static const char *const names[3][2] = {{"gemm_sm90_bf16_RR_128x256x64_s4", "gemm_sm90_bf16_RR_64x64x64_s13"},
                                            {"gemm_sm90_bf16_CC_128x256x64_s4", "gemm_sm90_bf16_CC_64x64x64_s13"},
                                            {"gemm_sm90_bf16_CR_128x256x64_s4", "gemm_sm90_bf16_CR_64x64x64_s13"}};
    for (int l = 0; l < 3; l++)
      for (int skinny = 0; skinny < 2; skinny++) {
        smelt__gemm_facts g = f;
        g.a_k = l == 0;
        g.a_mn = l != 0;
        g.b_k = l == 1;
        g.b_mn = l != 1;
        g.m = skinny ? 64 : 8192;
        CHECK(!strcmp(pick_name(&st, &g, 9, 0, &s), names[l][skinny]));
        /* RR and CR have the ping-pong kernel when its tile is asked for. */
        if (l != 1 && !skinny) {
          st.desc.tile.m = st.desc.tile.n = 128;
          CHECK(strstr(pick_name(&st, &g, 9, 0, &s), "_128x128x64_s6_pp") != NULL);
          st.desc.tile.m = st.desc.tile.n = 0;
        }
        /* Overlapping MN-major rows (a stride below M or N) are no TMA operand. */
        g.tma_b[0] = g.tma_a[0] = 0;
        CHECK(!strncmp(pick_name(&st, &g, 9, 0, &s), "gemm_sm80_", 10));
      }
  }
  /* Short K (<= 1024) with at least an SM's worth of 128 x 128 tiles takes
   * the ping-pong kernel in plain runs, every layout that has it (RC, RR,
   * CR); grouped runs and K 2048 the cooperative one. */
  {
    smelt__gemm_facts g = f;
    g.m = 4096;
    g.n = 14336;
    g.k = 1024;
    CHECK(!strcmp(pick_name(&st, &g, 9, 0, &s), "gemm_sm90_bf16_RC_128x128x64_s6_pp"));
    g.b_k = 0;
    g.b_mn = 1;
    CHECK(!strcmp(pick_name(&st, &g, 9, 0, &s), "gemm_sm90_bf16_RR_128x128x64_s6_pp"));
    g.a_k = 0;
    g.a_mn = 1;
    CHECK(!strcmp(pick_name(&st, &g, 9, 0, &s), "gemm_sm90_bf16_CR_128x128x64_s6_pp"));
    smelt__gemm_state gs = st;
    gs.mode = SMELT_GEMM_MODE_GROUPED;
    g.batch = 8;
    CHECK(!strcmp(pick_name(&gs, &g, 9, 0, &s), "gemm_sm90_bf16_CR_128x256x64_s4"));
    g = f;
    g.m = 4096;
    g.n = 14336;
    g.k = 2048;
    CHECK(!strcmp(pick_name(&st, &g, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4"));
    g.k = 1024;
    g.m = 512; /* 448 tiles of 128 x 128 */
    CHECK(!strcmp(pick_name(&st, &g, 9, 0, &s), "gemm_sm90_bf16_RC_128x128x64_s6_pp"));
    g.m = 128; /* 112: fewer than the SMs */
    CHECK(strcmp(pick_name(&st, &g, 9, 0, &s), "gemm_sm90_bf16_RC_128x128x64_s6_pp") != 0);
    g.m = 802816; /* N 64 would leave half of each 128-wide tile empty */
    g.n = 64;
    g.k = 152;
    CHECK(strcmp(pick_name(&st, &g, 9, 0, &s), "gemm_sm90_bf16_RC_128x128x64_s6_pp") != 0);
  }
  /* Otherwise the ping-pong kernel only when its tile is asked for (it ran
   * behind the cooperative one, GELU included), and only with a D its fast
   * epilogue writes (else the 128 x 128 mma.sync tile). */
  st.desc.epilogue.act = SMELT_ACT_GELU;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4"));
  st.desc.tile.m = st.desc.tile.n = 128;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x128x64_s6_pp"));
  f.sm90_d = 0;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm80_bf16_RC_128x128x32_s4_w2x4"));
  f.sm90_d = 1;
  st.desc.tile.m = st.desc.tile.n = 0;
  /* Cluster kernels when their cluster is asked for; a cluster no kernel
   * of that tile has, or a tile the cluster kernels lack, is an error. */
  st.desc.tile.cluster_m = 2;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4_c2x1"));
  st.desc.tile.cluster_m = 0;
  st.desc.tile.cluster_n = 4;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x64x64_s8_c1x4"));
  st.desc.tile.cluster_n = 2;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x64x64_s8_c1x2"));
  st.desc.tile.n = 256;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "") && s == SMELT_STATUS_UNSUPPORTED);
  CHECK(!strcmp(pick_name(&st, &f, 8, 0, &s), "") && s == SMELT_STATUS_UNSUPPORTED);
  st.desc.tile.n = 0;
  st.desc.tile.cluster_n = 1;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4"));
  st.desc.tile.cluster_n = 0;
  st.desc.epilogue.act = SMELT_ACT_IDENTITY;
  /* Few tiles: the narrow Hopper tile (the small mma.sync tile before
   * Hopper); the 64-row one when 128 x 64 tiles would leave at least half
   * the SMs idle (2048 x 512: 128 of them; 512 x 512: 32; 128 x 4096: 64,
   * 256 x 4096: 128; 64 x 4096: 64), and for M <= 64. */
  f.m = 2048;
  f.n = 512;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x64x64_s8"));
  f.m = f.n = 512;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_64x64x64_s13"));
  CHECK(!strcmp(pick_name(&st, &f, 8, 0, &s), "gemm_sm80_bf16_RC_64x64x32_s4_w2x2"));
  f.m = 128;
  f.n = 4096;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_64x64x64_s13"));
  st.dt_a = st.dt_b = st.dt_d = SMELT_DTYPE_F16;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_f16_RC_64x64x64_s13"));
  st.dt_a = st.dt_b = st.dt_d = SMELT_DTYPE_BF16;
  f.m = 256;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x64x64_s8"));
  f.m = 64;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_64x64x64_s13"));
  f.n = 8192; /* M <= 64: as many 64 x 64 tiles as 128 x 64 ones (128) */
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_64x64x64_s13"));
  f.m = 65;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x64x64_s8"));
  f.m = 64;
  f.n = 4096;
  /* The other 64-row tile when asked for: 64 x 128; no 64-row tile comes
   * in clusters; a 128-row tile when asked for keeps it. */
  st.desc.tile.m = 64;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_64x64x64_s13"));
  st.desc.tile.n = 128;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_64x128x64_s8"));
  st.desc.tile.n = 0;
  st.desc.tile.cluster_m = 2;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "") && s == SMELT_STATUS_UNSUPPORTED);
  st.desc.tile.cluster_m = 0;
  st.desc.tile.m = 128;
  st.desc.tile.n = 64;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x64x64_s8"));
  st.desc.tile.m = st.desc.tile.n = 0;
  /* Parallel splits may take the 64-row tile. */
  st.mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
  st.split_k = 2;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_64x64x64_s13"));
  st.mode = SMELT_GEMM_MODE_PLAIN;
  st.split_k = 1;
  f.m = f.n = 512;
  st.desc.math.op = SMELT_GEMM_MATH_TF32; /* no narrow tf32 tile on Hopper */
  st.dt_a = st.dt_b = SMELT_DTYPE_F32;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm80_tf32_RC_128x128x16_s4_w2x4"));
  st.desc.math.op = SMELT_GEMM_MATH_DEFAULT;
  st.dt_a = st.dt_b = SMELT_DTYPE_BF16;
  st.desc.tile.n = 256; /* ... unless the description asks for the Hopper tile */
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4"));
  pick_name(&st, &f, 8, 0, &s);
  CHECK_EQ_INT(s, SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("matches no");
  st.desc.tile.n = 0;
  f.a_k = 0; /* column-major A: MN-major on Hopper, mma.sync elsewhere */
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_CC_64x64x64_s13"));
  CHECK(!strcmp(pick_name(&st, &f, 8, 0, &s), "gemm_sm80_bf16_CC_64x64x32_s4_w2x2"));
  f.a_mn = 0; /* A usable neither way: SIMT */
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_simt_accf32"));
  st.desc.math.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
  pick_name(&st, &f, 9, 0, &s);
  CHECK_EQ_INT(s, SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("16-byte aligned");
  st.desc.math.opclass = SMELT_GEMM_OPCLASS_AUTO;
  f.a_k = f.a_mn = 1;
  /* Parallel splits run on Hopper when the f32 partial sums' rows are whole
   * 16-byte units (N a multiple of 4), never on the ping-pong kernel;
   * serial splits stay on mma.sync. */
  st.mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
  st.split_k = 4;
  f.m = f.n = 8192;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4"));
  st.desc.epilogue.act = SMELT_ACT_GELU;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4"));
  st.desc.epilogue.act = SMELT_ACT_IDENTITY;
  f.n = 8190;
  CHECK(!strncmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm80_bf16_RC_128x128", 25));
  f.n = 8192;
  st.mode = SMELT_GEMM_MODE_SPLIT_K_SERIAL;
  CHECK(!strncmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm80_bf16_RC_128x128", 25));
  /* Grouped on Hopper: when every group has K >= 1 and a D for the fast
   * epilogue; otherwise mma.sync. */
  st.mode = SMELT_GEMM_MODE_GROUPED;
  st.split_k = 1;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_bf16_RC_128x256x64_s4"));
  f.sm90_d = 0;
  CHECK(!strncmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm80_bf16_RC_128x128", 25));
  f.sm90_d = 1;
  f.k_min = 0;
  CHECK(!strncmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm80_bf16_RC_128x128", 25));
  f.k_min = 8192;
  st.mode = SMELT_GEMM_MODE_PLAIN;
  /* The fast epilogue's TMA stores write a row's last 16-byte unit in full:
   * only rows of whole units (N * size a multiple of 16) may take them (1),
   * one row and one column included; other rows take its thread stores
   * (2), and C or a column-major D the general epilogue (0). */
  {
    static _Alignas(16) uint8_t dbuf[64];
    smelt__gemm_prob p;
    memset(&p, 0, sizeof p);
    p.m = p.n = p.k = 1;
    p.d.data = dbuf;
    p.d.rs = 16;
    p.d.cs = 1;
    CHECK_EQ_INT(smelt__gemm_sm90_fast_d(&st, &p), 2);
    p.n = 8;
    CHECK_EQ_INT(smelt__gemm_sm90_fast_d(&st, &p), 1);
    p.m = 7;
    p.n = 13;
    CHECK_EQ_INT(smelt__gemm_sm90_fast_d(&st, &p), 2);
    p.n = 16;
    CHECK_EQ_INT(smelt__gemm_sm90_fast_d(&st, &p), 1);
    st.dt_d = SMELT_DTYPE_F32;
    p.n = 4;
    CHECK_EQ_INT(smelt__gemm_sm90_fast_d(&st, &p), 1);
    p.n = 6;
    CHECK_EQ_INT(smelt__gemm_sm90_fast_d(&st, &p), 2);
    p.d.cs = 2;
    CHECK_EQ_INT(smelt__gemm_sm90_fast_d(&st, &p), 0);
    p.d.cs = 1;
    st.has_c = 1;
    CHECK_EQ_INT(smelt__gemm_sm90_fast_d(&st, &p), 0);
    st.has_c = 0;
    st.dt_d = SMELT_DTYPE_BF16;
  }
  /* fp8 on Hopper: wgmma for 16-bit D; mma.sync for f32 D (fp8 wgmma keeps
   * fewer accumulator bits than f32) and before Hopper. */
  st.dt_a = st.dt_b = SMELT_DTYPE_E4M3;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_e4m3xe4m3_RC_128x256x128_s4"));
  st.dt_b = SMELT_DTYPE_E5M2;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_e4m3xe5m2_RC_128x256x128_s4"));
  st.dt_b = SMELT_DTYPE_E4M3;
  CHECK(!strcmp(pick_name(&st, &f, 8, 0, &s), "gemm_sm80_e4m3xe4m3_RC_128x128x64_s4_w2x4"));
  st.dt_d = SMELT_DTYPE_F32;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm80_e4m3xe4m3_RC_128x128x64_s4_w2x4"));
  st.dt_d = SMELT_DTYPE_BF16;
  /* 8-bit types need K-major operands. */
  f.b_k = 0;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_simt_accf32"));
  f.b_k = 1;
  st.dt_a = st.dt_b = SMELT_DTYPE_I8;
  st.acc = SMELT_GEMM_ACC_I32;
  CHECK(!strcmp(pick_name(&st, &f, 8, 0, &s), "gemm_sm80_i8_RC_128x128x64_s4_w2x4"));
  /* f32: exact on CUDA cores unless tf32 is asked for. */
  st.dt_a = st.dt_b = SMELT_DTYPE_F32;
  st.acc = SMELT_GEMM_ACC_F32;
  CHECK(!strcmp(pick_name(&st, &f, 8, 0, &s), "gemm_simt_accf32"));
  st.desc.math.op = SMELT_GEMM_MATH_TF32; /* tf32: wgmma on Hopper */
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm90_tf32_RC_128x256x32_s4"));
  CHECK(!strcmp(pick_name(&st, &f, 8, 0, &s), "gemm_sm80_tf32_RC_128x128x16_s4_w2x4"));
  st.desc.math.op = SMELT_GEMM_MATH_3XTF32;
  CHECK(!strcmp(pick_name(&st, &f, 8, 0, &s), "gemm_sm80_3xtf32_RC_128x128x16_s4_w2x4"));
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_sm80_3xtf32_RC_128x128x16_s4_w2x4"));
  /* Old GPUs: SIMT only. */
  CHECK(!strcmp(pick_name(&st, &f, 7, 5, &s), "gemm_simt_accf32"));
  st.desc.math.op = SMELT_GEMM_MATH_DEFAULT;
  st.dt_a = st.dt_b = SMELT_DTYPE_F64;
  st.acc = SMELT_GEMM_ACC_F64;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_simt_accf64"));
  CHECK(smelt__gemm_reduce_kernel(table, n, SMELT_GEMM_ACC_F16) >= 0);
}

/* ---------------------------------------------------------------- grouped by offsets */

/* smelt_gemm_grouped_offs (the case is in gemm_offs.h). Checked against
 * a loop written here that applies smelt/gemm.h's clamping rule on its own
 * (row r belongs to the first group whose clamped end exceeds it); rows no
 * group owns, the padding between D's rows and the guards must keep their
 * poison. */

/* Host memory of a case: A [T, K], B as [G, K, N] or [G, N, K], C and D
 * [T, N] with spare columns, bias [G, N] with a spare column. */
typedef struct oinputs {
  int64_t lda, ldb, ldd, ldbias, a_el, b_el, d_el, bias_el;
  void *a, *b, *c, *bias, *offs;
} oinputs;

static int64_t round16(int64_t v, int on) { return on ? (v + 15) / 16 * 16 : v; }

static void offs_inputs(const ocase *o, oinputs *in) {
  in->lda = round16(o->k + 1, o->ld16);
  in->ldb = round16((o->b_col ? o->k : o->n) + 1, o->ld16);
  in->ldd = round16(o->n + 3, o->ld16);
  in->ldbias = o->n + 1;
  in->a_el = o->t * in->lda + 1;
  in->b_el = o->g * (o->b_col ? o->n : o->k) * in->ldb + 1;
  in->d_el = o->t * in->ldd + 1;
  in->bias_el = o->g * in->ldbias + 1;
  in->a = malloc((size_t)in->a_el * smelt_dtype_size(o->a));
  in->b = malloc((size_t)in->b_el * smelt_dtype_size(o->b));
  in->c = malloc((size_t)in->d_el * smelt_dtype_size(o->d));
  in->bias = malloc((size_t)in->bias_el * smelt_dtype_size(o->bias));
  in->offs = malloc((size_t)(o->g + 1) * 8);
  fill(in->a, o->a, in->a_el);
  fill(in->b, o->b, in->b_el);
  fill(in->c, o->d, in->d_el);
  fill(in->bias, o->bias, in->bias_el);
  for (int64_t g = 0; g < o->g; g++) {
    if (o->offs64) ((int64_t *)in->offs)[g] = o->offs[g];
    else ((int32_t *)in->offs)[g] = (int32_t)o->offs[g];
  }
}

static void offs_inputs_free(oinputs *in) {
  free(in->a);
  free(in->b);
  free(in->c);
  free(in->bias);
  free(in->offs);
}

static int64_t b_off(const ocase *o, const oinputs *in, int64_t g, int64_t k, int64_t n) {
  return o->b_col ? (g * o->n + n) * in->ldb + k : (g * o->k + k) * in->ldb + n;
}

/* The group that owns row r under the clamping rule, or -1. */
static int64_t offs_owner(const ocase *o, int64_t r) {
  int64_t run = 0;
  for (int64_t g = 0; g < o->g; g++) {
    if (o->offs[g] > run) run = o->offs[g];
    if (r < (run < o->t ? run : o->t)) return g;
  }
  return -1;
}

static smelt_gemm_desc offs_desc(const ocase *o) {
  smelt_gemm_desc d = smelt_gemm_desc_default();
  d.math.opclass = o->opclass;
  d.epilogue.act = o->act;
  d.epilogue.slope = 0.2f;
  d.epilogue.alpha = 1.25;
  d.epilogue.beta = o->has_c ? -0.5 : 0.0;
  d.tile.m = o->tile_m;
  d.tile.n = o->tile_n;
  return d;
}

/* Runs the case on ctx; D's raw bytes (d_el elements) into dhost. `runs`
 * plans once and runs that many times (the same tensors). */
static smelt_status offs_run(smelt_ctx *ctx, const ocase *o, const oinputs *in, uint8_t *dhost, int runs) {
  const size_t ea = smelt_dtype_size(o->a), eb = smelt_dtype_size(o->b), ed = smelt_dtype_size(o->d),
               ebias = smelt_dtype_size(o->bias), eo = o->offs64 ? 8 : 4;
  th_buf A = th_buf_new(ctx, (size_t)in->a_el * ea), B = th_buf_new(ctx, (size_t)in->b_el * eb),
         C = th_buf_new(ctx, (size_t)in->d_el * ed), D = th_buf_new(ctx, (size_t)in->d_el * ed),
         Bias = th_buf_new(ctx, (size_t)in->bias_el * ebias), Offs = th_buf_new(ctx, (size_t)(o->g + 1) * eo);
  th_buf_upload(&A, in->a, A.bytes);
  th_buf_upload(&B, in->b, B.bytes);
  th_buf_upload(&C, in->c, C.bytes);
  th_buf_upload(&Bias, in->bias, Bias.bytes);
  th_buf_upload(&Offs, in->offs, (size_t)o->g * eo);
  const smelt_device_kind dk = smelt_ctx_device(ctx);
  const int di = smelt_ctx_device_index(ctx);
  int64_t sa[2] = {o->t, o->k}, sb[3] = {o->g, o->k, o->n}, sd[2] = {o->t, o->n}, sbias[2] = {o->g, o->n},
          so[1] = {o->g};
  smelt_tensor ta = smelt_tensor_make(A.data, o->a, dk, di, 2, sa), tb = smelt_tensor_make(B.data, o->b, dk, di, 3, sb),
               tc = smelt_tensor_make(C.data, o->d, dk, di, 2, sd), td = smelt_tensor_make(D.data, o->d, dk, di, 2, sd),
               tbias = smelt_tensor_make(Bias.data, o->bias, dk, di, 2, sbias),
               toffs = smelt_tensor_make(Offs.data, o->offs64 ? SMELT_DTYPE_I64 : SMELT_DTYPE_I32, dk, di, 1, so);
  ta.strides[0] = in->lda;
  if (o->b_col) {
    tb.strides[0] = o->n * in->ldb;
    tb.strides[1] = 1;
    tb.strides[2] = in->ldb;
  } else {
    tb.strides[0] = o->k * in->ldb;
    tb.strides[1] = in->ldb;
  }
  tc.strides[0] = td.strides[0] = in->ldd;
  tbias.strides[0] = in->ldbias;
  const smelt_gemm_desc desc = offs_desc(o);
  smelt_plan *plan = NULL;
  smelt_status st = smelt_gemm_grouped_offs_plan(ctx, &desc, &ta, &tb, o->has_c ? &tc : NULL, &td,
                                                 o->has_bias ? &tbias : NULL, &toffs, &plan);
  if (st == SMELT_OK && o->kernel && ctx != th_cpu() && strncmp(smelt_plan_describe(plan), o->kernel, strlen(o->kernel)))
    th_fail(__FILE__, __LINE__, "plan runs %s, want %s...", smelt_plan_describe(plan), o->kernel);
  for (int i = 0; i < runs && st == SMELT_OK; i++)
    st = smelt_gemm_grouped_offs_run(plan, &ta, &tb, o->has_c ? &tc : NULL, &td, o->has_bias ? &tbias : NULL, &toffs);
  smelt_plan_destroy(plan);
  th_buf_download(&D, dhost, D.bytes);
  if (st == SMELT_OK) CHECK(th_buf_guards_ok(&D));
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&C);
  th_buf_free(&D);
  th_buf_free(&Bias);
  th_buf_free(&Offs);
  return st;
}

/* Rows no group owns and the spare columns keep the poison (0xFF bytes). */
static int offs_poison_ok(const ocase *o, const oinputs *in, const uint8_t *dhost, const char *label) {
  const size_t ed = smelt_dtype_size(o->d);
  for (int64_t e = 0; e < in->d_el; e++) {
    const int64_t r = e / in->ldd, c = e % in->ldd;
    if (r < o->t && c < o->n && offs_owner(o, r) >= 0) continue;
    for (size_t b = 0; b < ed; b++)
      if (dhost[(size_t)e * ed + b] != 0xFF) {
        th_fail(__FILE__, __LINE__, "%s: D element %lld (row %lld, column %lld) was written", label, (long long)e,
                (long long)r, (long long)c);
        return 0;
      }
  }
  return 1;
}

/* The owned rows of D, decoded, row-major [T][N] (unowned rows 0). */
static void offs_decode(const ocase *o, const oinputs *in, const uint8_t *dhost, double *out) {
  for (int64_t r = 0; r < o->t; r++)
    for (int64_t c = 0; c < o->n; c++)
      out[r * o->n + c] = offs_owner(o, r) >= 0 ? th_get(dhost, o->d, r * in->ldd + c) : 0.0;
}

static void offs_naive(const ocase *o, const oinputs *in, double *out) {
  const smelt_gemm_desc desc = offs_desc(o);
  const smelt_gemm_epilogue *e = &desc.epilogue;
  const int ints = o->a == SMELT_DTYPE_I8;
  for (int64_t r = 0; r < o->t; r++) {
    const int64_t g = offs_owner(o, r);
    for (int64_t c = 0; c < o->n; c++) {
      if (g < 0) {
        out[r * o->n + c] = 0.0;
        continue;
      }
      double acc = 0;
      for (int64_t k = 0; k < o->k; k++) {
        const double x = th_get(in->a, o->a, r * in->lda + k), y = th_get(in->b, o->b, b_off(o, in, g, k, c));
        acc += ints ? (double)((int64_t)x * (int64_t)y) : x * y;
      }
      double v = e->alpha * acc;
      if (o->has_c) v += e->beta * th_get(in->c, o->d, r * in->ldd + c);
      if (o->has_bias) v += th_get(in->bias, o->bias, g * in->ldbias + c);
      out[r * o->n + c] = convert_ref(act_ref(e->act, v, e->slope), o->d, 0);
    }
  }
}

static double offs_bound(const ocase *o) {
  gspec s = spec(o->a, o->b, o->d, o->t, o->n, o->k);
  return bound_of(&s);
}

void offs_check(const ocase *o, const char *what) {
  char label[192];
  snprintf(label, sizeof label, "grouped_offs %s %sx%s->%s %s T%lld N%lld K%lld G%lld i%d act %d%s%s", what,
           dn(o->a), dn(o->b), dn(o->d), o->b_col ? "RC" : "RR", (long long)o->t, (long long)o->n, (long long)o->k,
           (long long)o->g, o->offs64 ? 64 : 32, (int)o->act, o->has_c ? " +C" : "", o->has_bias ? " +bias" : "");
  oinputs in;
  offs_inputs(o, &in);
  const size_t ed = smelt_dtype_size(o->d);
  const int64_t n = o->t * o->n;
  uint8_t *dh = malloc((size_t)in.d_el * ed);
  double *cpu = malloc(sizeof(double) * (size_t)(n + 1)), *ref = malloc(sizeof(double) * (size_t)(n + 1)),
         *gpu = malloc(sizeof(double) * (size_t)(n + 1));
  smelt_status st = offs_run(th_cpu(), o, &in, dh, 1);
  if (st != SMELT_OK) {
    th_fail(__FILE__, __LINE__, "%s: cpu: %s (%s)", label, smelt_status_name(st), smelt_last_error());
  } else if (offs_poison_ok(o, &in, dh, label)) {
    offs_decode(o, &in, dh, cpu);
    offs_naive(o, &in, ref);
    const double rb = o->d == SMELT_DTYPE_F32 ? 1e-6 : offs_bound(o);
    if (n > 0) CHECK(th_compare(label, cpu, ref, n, rb, 0));
    smelt_ctx *cu = th_cuda();
    if (cu) {
      memset(dh, 0, (size_t)in.d_el * ed);
      st = offs_run(cu, o, &in, dh, 2);
      if (st != SMELT_OK) {
        th_fail(__FILE__, __LINE__, "%s: cuda: %s (%s)", label, smelt_status_name(st), smelt_last_error());
      } else if (offs_poison_ok(o, &in, dh, label)) {
        offs_decode(o, &in, dh, gpu);
        if (n > 0) CHECK(th_compare(label, gpu, cpu, n, offs_bound(o), 0));
      }
    }
  }
  free(dh);
  free(cpu);
  free(ref);
  free(gpu);
  offs_inputs_free(&in);
}

ocase ocase_make(smelt_dtype dt, int64_t t, int64_t n, int64_t k, int64_t g, const int64_t *offs) {
  ocase o;
  memset(&o, 0, sizeof o);
  o.a = o.b = o.d = dt;
  o.bias = dt == SMELT_DTYPE_F64 ? SMELT_DTYPE_F64 : SMELT_DTYPE_F32;
  o.t = t;
  o.n = n;
  o.k = k;
  o.g = g;
  o.offs = offs;
  return o;
}

/* Small cases (CPU against the loop here; with a GPU, CUDA against CPU). */
static void test_grouped_offs(void) {
  /* An empty group, a group of one row, groups that are no multiple of any
   * tile, and rows past the last offset (left alone). */
  static const int64_t o1[] = {3, 3, 4, 15, 20};
  ocase o = ocase_make(SMELT_DTYPE_F32, 23, 7, 5, 5, o1);
  o.has_c = o.has_bias = 1;
  o.act = SMELT_ACT_GELU;
  offs_check(&o, "f32 C bias gelu");
  o.offs64 = 1;
  o.b_col = 1;
  o.has_c = 0;
  o.act = SMELT_ACT_LEAKY_RELU;
  offs_check(&o, "f32 i64 RC leaky");
  /* 16-bit and mixed types, the first group empty, the last one to T. */
  static const int64_t o2[] = {0, 9, 9, 30};
  o = ocase_make(SMELT_DTYPE_BF16, 30, 13, 17, 4, o2);
  o.b_col = 1;
  o.has_bias = 1;
  o.bias = SMELT_DTYPE_BF16;
  o.act = SMELT_ACT_SILU;
  offs_check(&o, "bf16 RC silu");
  o.a = SMELT_DTYPE_F16;
  o.b = SMELT_DTYPE_F16;
  o.d = SMELT_DTYPE_F32;
  o.has_c = 1;
  o.act = SMELT_ACT_TANH;
  offs_check(&o, "f16->f32 C tanh");
  /* Exact types: f64 and i8 x i8 -> i32. */
  o = ocase_make(SMELT_DTYPE_F64, 30, 5, 9, 4, o2);
  o.has_bias = 1;
  offs_check(&o, "f64");
  o = ocase_make(SMELT_DTYPE_I8, 30, 6, 11, 4, o2);
  o.d = SMELT_DTYPE_I32;
  o.bias = SMELT_DTYPE_I32;
  o.has_bias = 1;
  offs_check(&o, "i8");
  /* K = 0: D = epilogue(beta C + bias) on the owned rows. */
  o = ocase_make(SMELT_DTYPE_F32, 12, 4, 0, 3, o1);
  o.has_c = o.has_bias = 1;
  offs_check(&o, "K=0");
  /* One group over every row; all offsets 0 (nothing written). */
  static const int64_t o3[] = {19}, o4[] = {0, 0, 0};
  o = ocase_make(SMELT_DTYPE_F32, 19, 6, 4, 1, o3);
  offs_check(&o, "one group");
  o = ocase_make(SMELT_DTYPE_F32, 19, 6, 4, 3, o4);
  o.has_bias = 1;
  offs_check(&o, "all empty");
  /* The caller's bug: decreasing, negative and too large offsets are
   * clamped (ends 4, 4, 10, 10, 10): nothing outside D is written. */
  static const int64_t o5[] = {4, 2, 12, -1, 7};
  o = ocase_make(SMELT_DTYPE_F32, 10, 5, 3, 5, o5);
  o.has_bias = 1;
  offs_check(&o, "clamped");
  o.offs64 = 1;
  offs_check(&o, "clamped i64");
}

/* GPU: larger shapes on SIMT and mma.sync, many groups (more than one
 * warp's chunk of 32), tiles crossing group boundaries. */
static void test_gpu_grouped_offs(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  static const int64_t o1[] = {129, 129, 130, 430, 430, 700, 1003, 1003};
  ocase o = ocase_make(SMELT_DTYPE_F32, 1003, 200, 136, 8, o1);
  o.has_c = o.has_bias = 1;
  o.act = SMELT_ACT_GELU;
  o.opclass = SMELT_GEMM_OPCLASS_SIMT;
  offs_check(&o, "simt f32");
  o = ocase_make(SMELT_DTYPE_BF16, 1003, 264, 136, 8, o1);
  o.b_col = 1;
  o.ld16 = 1;
  o.has_bias = 1;
  o.bias = SMELT_DTYPE_BF16;
  o.act = SMELT_ACT_SILU;
  o.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
  offs_check(&o, "mma.sync bf16 RC");
  o.a = o.b = o.d = SMELT_DTYPE_F16;
  o.b_col = 0;
  o.offs64 = 1;
  offs_check(&o, "mma.sync f16 RR i64");
  o.opclass = SMELT_GEMM_OPCLASS_SIMT;
  offs_check(&o, "simt f16 RR");
  /* 70 groups of uneven sizes (some empty), rows left over at the end. */
  static int64_t o2[70];
  int64_t run = 0;
  for (int g = 0; g < 70; g++) {
    run += g % 7 == 3 ? 0 : (int64_t)th_rand_uniform(0, 90);
    o2[g] = run;
  }
  o = ocase_make(SMELT_DTYPE_BF16, run + 17, 136, 72, 70, o2);
  o.b_col = 1;
  o.ld16 = 1;
  o.has_bias = 1;
  o.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
  offs_check(&o, "mma.sync 70 groups");
  o.opclass = SMELT_GEMM_OPCLASS_SIMT;
  offs_check(&o, "simt 70 groups");
  /* The caller's bug on the device: the same clamping, no stray writes. */
  static const int64_t o3[] = {300, 100, 2000, -5, 900};
  o = ocase_make(SMELT_DTYPE_BF16, 1000, 136, 64, 5, o3);
  o.b_col = 1;
  o.ld16 = 1;
  o.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
  offs_check(&o, "mma.sync clamped");
  o.opclass = SMELT_GEMM_OPCLASS_SIMT;
  offs_check(&o, "simt clamped");
}

/* Every error of the grouped_offs entry points: status, message, and D
 * left alone. */
static void test_grouped_offs_bad(void) {
  smelt_ctx *cpu = th_cpu();
  float a[12], b[40], c[12], d[12], bias[8];
  int32_t offs[2] = {1, 3};
  int64_t offs64[2] = {1, 3};
  float foffs[2] = {1, 3};
  for (int i = 0; i < 12; i++) a[i] = c[i] = 1.0f;
  for (int i = 0; i < 40; i++) b[i] = 1.0f;
  for (int i = 0; i < 8; i++) bias[i] = 1.0f;
  for (int i = 0; i < 12; i++) d[i] = NAN;
  int64_t sa[2] = {3, 4}, sb[3] = {2, 4, 4}, sd[2] = {3, 4}, sbias[2] = {2, 4}, so[1] = {2};
  const smelt_device_kind k = SMELT_DEVICE_CPU;
  const smelt_tensor ta = smelt_tensor_make(a, SMELT_DTYPE_F32, k, 0, 2, sa),
                     tb = smelt_tensor_make(b, SMELT_DTYPE_F32, k, 0, 3, sb),
                     tc = smelt_tensor_make(c, SMELT_DTYPE_F32, k, 0, 2, sd),
                     td = smelt_tensor_make(d, SMELT_DTYPE_F32, k, 0, 2, sd),
                     tbias = smelt_tensor_make(bias, SMELT_DTYPE_F32, k, 0, 2, sbias),
                     to = smelt_tensor_make(offs, SMELT_DTYPE_I32, k, 0, 1, so),
                     to64 = smelt_tensor_make(offs64, SMELT_DTYPE_I64, k, 0, 1, so);
#define OBAD(call, status, msg)                            \
  do {                                                     \
    CHECK_STATUS(call, status);                            \
    CHECK_MSG(msg);                                        \
    for (int i_ = 0; i_ < 12; i_++) CHECK(isnan(d[i_]));   \
  } while (0)
  smelt_plan *plan = (smelt_plan *)1;
  OBAD(smelt_gemm_grouped_offs_plan(cpu, NULL, &ta, &tb, NULL, &td, NULL, &to, NULL), SMELT_STATUS_NULL_POINTER,
       "smelt_gemm_grouped_offs: out is NULL");
  OBAD(smelt_gemm_grouped_offs_plan(NULL, NULL, &ta, &tb, NULL, &td, NULL, &to, &plan), SMELT_STATUS_NULL_POINTER,
       "ctx is NULL");
  CHECK(plan == NULL);
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, NULL, &tb, NULL, &td, NULL, &to), SMELT_STATUS_NULL_POINTER, "A is NULL");
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, NULL, NULL, &td, NULL, &to), SMELT_STATUS_NULL_POINTER, "B is NULL");
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, NULL, NULL, &to), SMELT_STATUS_NULL_POINTER, "D is NULL");
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, &td, NULL, NULL), SMELT_STATUS_NULL_POINTER,
       "offs is NULL");
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.epilogue.beta = 1.0;
  OBAD(smelt_gemm_grouped_offs(cpu, &desc, &ta, &tb, NULL, &td, NULL, &to), SMELT_STATUS_NULL_POINTER,
       "C is NULL but desc.epilogue.beta=1");
  desc = smelt_gemm_desc_default();
  desc.mode = SMELT_GEMM_MODE_GROUPED;
  OBAD(smelt_gemm_grouped_offs(cpu, &desc, &ta, &tb, NULL, &td, NULL, &to), SMELT_STATUS_INVALID_ARGUMENT,
       "desc.mode=GROUPED must be AUTO or GROUPED_OFFS");
  desc.mode = SMELT_GEMM_MODE_GROUPED_OFFS;
  smelt_tensor t2 = ta;
  OBAD(smelt_gemm(cpu, &desc, &ta, &t2, NULL, &td, NULL), SMELT_STATUS_INVALID_ARGUMENT,
       "desc.mode=GROUPED_OFFS belongs to smelt_gemm_grouped_offs_plan");
  desc.split_k = 2;
  OBAD(smelt_gemm_grouped_offs(cpu, &desc, &ta, &tb, NULL, &td, NULL, &to), SMELT_STATUS_INVALID_ARGUMENT,
       "desc.split_k=2: split-K serves plain GEMMs only");
  /* Shapes. */
  int64_t s3[3] = {1, 3, 4};
  t2 = smelt_tensor_make(a, SMELT_DTYPE_F32, k, 0, 3, s3);
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &t2, &tb, NULL, &td, NULL, &to), SMELT_STATUS_SHAPE_MISMATCH,
       "A.ndim=3 must be 2 (A[T, K]");
  t2 = smelt_tensor_make(b, SMELT_DTYPE_F32, k, 0, 2, sa);
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &t2, NULL, &td, NULL, &to), SMELT_STATUS_SHAPE_MISMATCH,
       "B.ndim=2 must be 3 (B[G, K, N]");
  t2 = tb;
  t2.shape[1] = 3;
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &t2, NULL, &td, NULL, &to), SMELT_STATUS_SHAPE_MISMATCH,
       "B.shape[1]=3 must equal K=4");
  t2 = td;
  t2.shape[0] = 2;
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, &t2, NULL, &to), SMELT_STATUS_SHAPE_MISMATCH,
       "D.shape[0]=2 must equal T=3");
  /* offs is read as one contiguous array: other strides are refused (stride 0
   * once read past the buffer, stride 2 computed wrong groups). */
  for (int64_t stride = 0; stride <= 2; stride += 2) {
    t2 = to;
    t2.strides[0] = stride;
    OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, &td, NULL, &t2), SMELT_STATUS_BAD_LAYOUT,
         "offs.strides[0]");
  }
  t2 = tc;
  t2.shape[1] = 3;
  desc = smelt_gemm_desc_default();
  desc.epilogue.beta = 1.0;
  OBAD(smelt_gemm_grouped_offs(cpu, &desc, &ta, &tb, &t2, &td, NULL, &to), SMELT_STATUS_SHAPE_MISMATCH,
       "C.shape[1]=3 must equal N=4");
  t2 = tbias;
  t2.shape[0] = 3;
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, &td, &t2, &to), SMELT_STATUS_SHAPE_MISMATCH,
       "bias.shape[0]=3 must equal G=2");
  t2 = smelt_tensor_make(bias, SMELT_DTYPE_F32, k, 0, 1, sbias + 1);
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, &td, &t2, &to), SMELT_STATUS_SHAPE_MISMATCH,
       "bias.ndim=1 must be 2");
  int64_t s1[1] = {1};
  t2 = smelt_tensor_make(offs, SMELT_DTYPE_I32, k, 0, 1, s1);
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, &td, NULL, &t2), SMELT_STATUS_SHAPE_MISMATCH,
       "offs.shape=[1] must be [G]=[2]");
  /* Dtypes and devices. */
  t2 = smelt_tensor_make(foffs, SMELT_DTYPE_F32, k, 0, 1, so);
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, &td, NULL, &t2), SMELT_STATUS_DTYPE_MISMATCH,
       "offs.dtype=f32 is not supported");
  t2 = to;
  t2.device = SMELT_DEVICE_CUDA;
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, &td, NULL, &t2), SMELT_STATUS_WRONG_DEVICE,
       "offs is on cuda:0 but the context is on cpu");
  t2 = tb;
  t2.dtype = SMELT_DTYPE_F64;
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &t2, NULL, &td, NULL, &to), SMELT_STATUS_DTYPE_MISMATCH,
       "A.dtype=f32 and B.dtype=f64 do not combine");
  /* Memory: D must not overlap A, B, bias or offs. */
  t2 = smelt_tensor_make(d, SMELT_DTYPE_I32, k, 0, 1, so);
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &ta, &tb, NULL, &td, NULL, &t2), SMELT_STATUS_INVALID_ARGUMENT,
       "D overlaps offs");
  t2 = smelt_tensor_make(d, SMELT_DTYPE_F32, k, 0, 2, sa);
  OBAD(smelt_gemm_grouped_offs(cpu, NULL, &t2, &tb, NULL, &td, NULL, &to), SMELT_STATUS_INVALID_ARGUMENT,
       "D overlaps A");
  /* Runs: the plan's kind, its tensors, and the offsets' layout. */
  CHECK_OK(smelt_gemm_grouped_offs_plan(cpu, NULL, &ta, &tb, NULL, &td, &tbias, &to, &plan));
  OBAD(smelt_gemm_run(plan, &ta, &tb, NULL, &td, &tbias), SMELT_STATUS_INVALID_ARGUMENT,
       "the plan is a GROUPED_OFFS plan; use smelt_gemm_grouped_offs_run");
  OBAD(smelt_gemm_grouped_offs_run(plan, &ta, &tb, NULL, &td, &tbias, NULL), SMELT_STATUS_NULL_POINTER,
       "smelt_gemm_grouped_offs_run: offs is NULL");
  OBAD(smelt_gemm_grouped_offs_run(plan, &ta, &tb, NULL, &td, NULL, &to), SMELT_STATUS_NULL_POINTER,
       "bias is NULL but the plan was made with one");
  OBAD(smelt_gemm_grouped_offs_run(plan, &ta, &tb, NULL, &td, &tbias, &to64), SMELT_STATUS_DTYPE_MISMATCH,
       "offs.dtype=i64 differs from the planned i32");
  t2 = td;
  t2.strides[0] = 5;
  OBAD(smelt_gemm_grouped_offs_run(plan, &ta, &tb, NULL, &t2, &tbias, &to), SMELT_STATUS_BAD_LAYOUT,
       "D.strides[0]=5 differs from the planned 4");
  OBAD(smelt_gemm_grouped_offs_run(NULL, &ta, &tb, NULL, &td, &tbias, &to), SMELT_STATUS_NULL_POINTER,
       "plan is NULL");
  CHECK_OK(smelt_gemm_grouped_offs_run(plan, &ta, &tb, NULL, &td, &tbias, &to));
  smelt_plan_destroy(plan);
  for (int i = 0; i < 12; i++) d[i] = NAN;
  int64_t s44[2] = {4, 4};
  t2 = smelt_tensor_make(b, SMELT_DTYPE_F32, k, 0, 2, s44);
  CHECK_OK(smelt_gemm_plan(cpu, NULL, &ta, &t2, NULL, &td, NULL, &plan));
  OBAD(smelt_gemm_grouped_offs_run(plan, &ta, &tb, NULL, &td, NULL, &to), SMELT_STATUS_INVALID_ARGUMENT,
       "the plan is a PLAIN plan, not a grouped_offs plan");
  smelt_plan_destroy(plan);
#undef OBAD
}

/* A batched GEMM whose D is empty ([L, 0, N]) has nothing to write however
 * large L is. The CPU used to visit every empty batch (2^40 of them here:
 * hours), and computed offsets into empty operands that overflow (found by
 * fuzz/). */
static void test_empty_huge_batch(void) {
  const int64_t L = (int64_t)1 << 40;
  float a[1], b[4], d[1];
  smelt_tensor ta = smelt_tensor_make(a, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){L, 0, 2});
  smelt_tensor tb = smelt_tensor_make(b, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){L, 2, 2});
  smelt_tensor td = smelt_tensor_make(d, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){L, 0, 2});
  tb.strides[0] = 0; /* one B for every batch */
  CHECK_OK(smelt_gemm(th_cpu(), NULL, &ta, &tb, NULL, &td, NULL));
  /* K = 0: A and B are empty and may have any strides; the batch and row
   * offsets into them overflowed (UBSan) though they are never read. */
  float a2[1], b2[1], d2[12];
  ta = smelt_tensor_make(a2, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){2, 3, 0});
  tb = smelt_tensor_make(b2, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){2, 0, 2});
  td = smelt_tensor_make(d2, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){2, 3, 2});
  ta.strides[0] = tb.strides[0] = (int64_t)1 << 62;
  for (int i = 0; i < 12; i++) d2[i] = NAN;
  CHECK_OK(smelt_gemm(th_cpu(), NULL, &ta, &tb, NULL, &td, NULL));
  for (int i = 0; i < 12; i++) CHECK(d2[i] == 0);
  smelt_tensor a1 = smelt_tensor_make(a2, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){4, 0});
  smelt_tensor d1 = smelt_tensor_make(d2, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){4, 2});
  a1.strides[0] = (int64_t)1 << 62;
  int64_t offs[2] = {2, 4};
  smelt_tensor to = smelt_tensor_make(offs, SMELT_DTYPE_I64, SMELT_DEVICE_CPU, 0, 1, (int64_t[]){2});
  for (int i = 0; i < 8; i++) d2[i] = NAN;
  CHECK_OK(smelt_gemm_grouped_offs(th_cpu(), NULL, &a1, &tb, NULL, &d1, NULL, &to));
  for (int i = 0; i < 8; i++) CHECK(d2[i] == 0);
}

const th_test th_tests_gemm[] = {
    {"desc_default", test_desc_default},
    {"dtypes_layouts", test_dtypes_layouts},
    {"epilogues", test_epilogues},
    {"batched", test_batched},
    {"split_k", test_split_k},
    {"array", test_array},
    {"grouped", test_grouped},
    {"edges", test_edges},
    {"bad_inputs", test_bad_inputs},
    {"selector", test_selector},
    {"gpu_kernels", test_gpu_kernels},
    {"gpu_large", test_gpu_large},
    {"gpu_unaligned", test_gpu_unaligned},
    {"gpu_sm90", test_gpu_sm90},
    {"gpu_sm90_layouts", test_gpu_sm90_layouts},
    {"gpu_sm90_split_tail", test_gpu_sm90_split_tail},
    {"gpu_sm90_few_tiles_split", test_gpu_sm90_few_tiles_split},
    {"gpu_sm90_batched", test_gpu_sm90_batched},
    {"gpu_sm90_cluster", test_gpu_sm90_cluster},
    {"gpu_sm90_act16", test_gpu_sm90_act16},
    {"grouped_offs", test_grouped_offs},
    {"grouped_offs_bad", test_grouped_offs_bad},
    {"gpu_grouped_offs", test_gpu_grouped_offs},
    {"empty_huge_batch", test_empty_huge_batch},
    {0, 0},
};

/* ---------------------------------------------------------------- gemm_tune: the autotuner */

#include "cuda/gemm_tune.h"

#include <fcntl.h>
#include <unistd.h>

/* A fresh cache folder as SMELT_CACHE_DIR (removed by tune_dir_done). */
static void tune_dir_new(char *dir, size_t n) {
  snprintf(dir, n, "/tmp/smelt-test-tune-XXXXXX");
  if (!mkdtemp(dir)) th_fail(__FILE__, __LINE__, "mkdtemp failed");
  setenv("SMELT_CACHE_DIR", dir, 1);
}

static void tune_dir_done(const char *dir) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "    could not remove %s\n", dir);
  const char *keep = getenv("SMELT_TEST_CACHE_DIR");
  if (keep) setenv("SMELT_CACHE_DIR", keep, 1);
  else unsetenv("SMELT_CACHE_DIR");
}

/* A fake H100 and a plain bf16 RC GEMM state as planning sees it (split-K
 * left to smelt), with operand facts that every tensor-op kernel accepts. */
static smelt_device_info tune_dev(const char *name) {
  smelt_device_info dev;
  memset(&dev, 0, sizeof dev);
  snprintf(dev.name, sizeof dev.name, "%s", name);
  dev.sm_count = 132;
  dev.cc_major = 9;
  dev.cc_minor = 0;
  snprintf(dev.arch, sizeof dev.arch, "sm_90a");
  return dev;
}

static void tune_state(smelt__gemm_state *st, smelt__gemm_facts *f, int64_t m, int64_t n, int64_t k) {
  *st = bf16_state(SMELT_GEMM_MODE_PLAIN, 0);
  st->dt_c = SMELT_DTYPE_BF16;
  st->count = 1;
  st->prob.m = m;
  st->prob.n = n;
  st->prob.k = k;
  st->prob.a.rs = k; /* A row-major, B column-major */
  st->prob.a.cs = 1;
  st->prob.b.rs = 1;
  st->prob.b.cs = k;
  st->prob.d.rs = n;
  st->prob.d.cs = 1;
  smelt__gemm_facts ff = {.a_k = 1, .a_mn = 1, .b_k = 1, .b_mn = 1, .tma_a = {1, 1}, .tma_b = {1, 1}, .m = m, .n = n,
                          .k = k, .batch = 1, .sm90_d = 1, .k_min = k};
  *f = ff;
}

static smelt__gemm_tune_record tune_rec(const char *key, const char *kernel, int split) {
  smelt__gemm_tune_record r;
  memset(&r, 0, sizeof r);
  snprintf(r.key, sizeof r.key, "%s", key);
  snprintf(r.version, sizeof r.version, "%s", SMELT_VERSION_STRING);
  snprintf(r.kernel, sizeof r.kernel, "%s", kernel);
  r.split_k = split;
  r.median_ms = 0.125;
  snprintf(r.heuristic, sizeof r.heuristic, "gemm_sm90_bf16_RC_128x64x64_s8");
  r.heuristic_split_k = 1;
  r.heuristic_ms = 0.25;
  r.m = r.n = r.k = 512;
  r.l = 1;
  return r;
}

/* The table index of the kernel named `name`, or -1. */
static int kernel_index(const smelt__gemm_kernel *table, int n, const char *name) {
  for (int i = 0; i < n; i++) {
    smelt__kernel_src src;
    smelt__gemm_kernel_src(&table[i], &src);
    if (!strcmp(src.name, name)) return i;
  }
  return -1;
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  if (!f) {
    th_fail(__FILE__, __LINE__, "cannot write %s", path);
    return;
  }
  fputs(text, f);
  fclose(f);
}

/* Runs lookup with stderr captured and SMELT_LOG=info; the log lands in log. */
static smelt__tune_verdict lookup_logged(const smelt__gemm_state *st, const smelt__gemm_facts *f,
                                         const smelt_device_info *dev, const smelt__gemm_kernel *table, int n,
                                         int *kernel, int *split, char *log, size_t log_n) {
  char path[] = "/tmp/smelt-test-tune-log-XXXXXX";
  int fd = mkstemp(path);
  fflush(stderr);
  int saved = dup(2);
  dup2(fd, 2);
  const char *level = getenv("SMELT_LOG");
  char keep[32] = "";
  if (level) snprintf(keep, sizeof keep, "%s", level);
  setenv("SMELT_LOG", "info", 1);
  smelt__tune_verdict v = smelt__gemm_tune_lookup(st, f, dev, table, n, kernel, split);
  if (keep[0]) setenv("SMELT_LOG", keep, 1);
  else unsetenv("SMELT_LOG");
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  ssize_t got = pread(fd, log, log_n - 1, 0);
  log[got > 0 ? got : 0] = 0;
  close(fd);
  unlink(path);
  return v;
}

static void test_tune_key(void) {
  smelt_device_info h100 = tune_dev("NVIDIA H100 80GB HBM3"), other = tune_dev("NVIDIA H200");
  smelt__gemm_state st;
  smelt__gemm_facts f;
  char k1[SMELT__TUNE_KEY_MAX], k2[SMELT__TUNE_KEY_MAX];
  tune_state(&st, &f, 4096, 4096, 4096);
  CHECK_EQ_INT(smelt__gemm_tune_key(&st, &h100, k1, sizeof k1), 0);
  CHECK(strstr(k1, "dev=NVIDIA H100 80GB HBM3|sms=132|cc=9.0|") != NULL);
  CHECK(strstr(k1, "|layout=RC|") && strstr(k1, "|a=bf16|") && strstr(k1, "|c=-|") && strstr(k1, "|mode=PLAIN|"));
  /* The shape class: each size rounded up to a power of two. */
  st.prob.m = 3000;
  CHECK_EQ_INT(smelt__gemm_tune_key(&st, &h100, k2, sizeof k2), 0);
  CHECK(!strcmp(k1, k2));
  st.prob.m = 4097;
  smelt__gemm_tune_key(&st, &h100, k2, sizeof k2);
  CHECK(strcmp(k1, k2) != 0 && strstr(k2, "|m=8192|"));
  st.prob.m = 4096;
  /* Device, layout, dtypes, epilogue and mode each change the key. */
  smelt__gemm_tune_key(&st, &other, k2, sizeof k2);
  CHECK(strcmp(k1, k2) != 0);
  st.prob.a.rs = 1;
  st.prob.a.cs = 4096;
  smelt__gemm_tune_key(&st, &h100, k2, sizeof k2);
  CHECK(strstr(k2, "|layout=CC|") != NULL);
  st.prob.a.rs = 4096;
  st.prob.a.cs = 1;
  st.desc.epilogue.act = SMELT_ACT_GELU;
  smelt__gemm_tune_key(&st, &h100, k2, sizeof k2);
  CHECK(strcmp(k1, k2) != 0 && strstr(k2, "|act=gelu|"));
  st.desc.epilogue.act = SMELT_ACT_IDENTITY;
  st.dt_d = SMELT_DTYPE_F32;
  smelt__gemm_tune_key(&st, &h100, k2, sizeof k2);
  CHECK(strcmp(k1, k2) != 0);
  st.dt_d = SMELT_DTYPE_BF16;
  /* A name with characters a record cannot hold is made safe. */
  smelt_device_info odd = tune_dev("GPU \"x\"|\\y");
  smelt__gemm_tune_key(&st, &odd, k2, sizeof k2);
  CHECK(strstr(k2, "dev=GPU _x___y|") != NULL);
  /* Array and grouped plans are not tuned. */
  st.mode = SMELT_GEMM_MODE_GROUPED;
  CHECK_EQ_INT(smelt__gemm_tune_key(&st, &h100, k2, sizeof k2), -1);
  st.mode = SMELT_GEMM_MODE_ARRAY;
  CHECK_EQ_INT(smelt__gemm_tune_key(&st, &h100, k2, sizeof k2), -1);
}

static void test_tune_record_format(void) {
  smelt__gemm_tune_record r = tune_rec("gemm-v1|dev=X|sms=1|cc=9.0|m=512", "gemm_sm80_bf16_RC_64x64x32_s4_w2x2", 4), q;
  char text[2048], why[128];
  const int len = smelt__gemm_tune_format(&r, text, sizeof text);
  REQUIRE(len > 0 && (size_t)len == strlen(text));
  CHECK(text[0] == '{' && strstr(text, "\"kernel\": \"gemm_sm80_bf16_RC_64x64x32_s4_w2x2\""));
  CHECK_EQ_INT(smelt__gemm_tune_parse(text, &q, why, sizeof why), 0);
  CHECK(!strcmp(q.key, r.key) && !strcmp(q.kernel, r.kernel) && !strcmp(q.version, r.version) &&
        !strcmp(q.heuristic, r.heuristic));
  CHECK_EQ_INT(q.split_k, 4);
  CHECK_EQ_INT(q.heuristic_split_k, 1);
  CHECK(q.median_ms == 0.125 && q.heuristic_ms == 0.25);
  CHECK(q.m == 512 && q.n == 512 && q.k == 512 && q.l == 1);
  /* Too small a buffer is refused, not cut. */
  CHECK_EQ_INT(smelt__gemm_tune_format(&r, text, 64), -1);
  smelt__gemm_tune_format(&r, text, sizeof text);
  /* Every damage is refused with a reason: truncated, foreign format,
   * out-of-range or missing fields, repeated fields, escapes. */
  char bad[2048];
  snprintf(bad, sizeof bad, "%.*s", len / 2, text);
  CHECK_EQ_INT(smelt__gemm_tune_parse(bad, &q, why, sizeof why), -1);
  CHECK(strstr(why, "truncated") != NULL);
  CHECK_EQ_INT(smelt__gemm_tune_parse("", &q, why, sizeof why), -1);
  const struct { const char *from, *to, *why; } edits[] = {
      {"smelt-gemm-tune-1", "smelt-gemm-tune-0", "format"},
      {"\"split_k\": 4", "\"split_k\": 0", "split_k"},
      {"\"split_k\": 4", "\"split_k\": 65", "split_k"},
      {"\"split_k\": 4", "\"split_k\": x", "split_k"},
      {"\"kernel\": \"gemm_sm80_bf16_RC_64x64x32_s4_w2x2\"", "\"kernel\": \"\"", "kernel"},
      {"\"kernel\"", "\"kernels\"", "kernel"},
      {"\"median_ms\": 0.125", "\"median_ms\": -1", "median_ms"},
      {"[512, 512, 512, 1]", "[512, 512, 512]", "shape"},
      {"\"heuristic_ms\"", "\"kernel\": \"a\", \"heuristic_ms\"", "kernel"},
      {"dev=X", "dev=\\X", "key"},
  };
  for (size_t i = 0; i < sizeof edits / sizeof *edits; i++) {
    const char *at = strstr(text, edits[i].from);
    REQUIRE(at != NULL);
    snprintf(bad, sizeof bad, "%.*s%s%s", (int)(at - text), text, edits[i].to, at + strlen(edits[i].from));
    if (smelt__gemm_tune_parse(bad, &q, why, sizeof why) != -1)
      th_fail(__FILE__, __LINE__, "edit %zu (%s) was accepted", i, edits[i].to);
    else if (!strstr(why, edits[i].why))
      th_fail(__FILE__, __LINE__, "edit %zu: reason \"%s\" lacks \"%s\"", i, why, edits[i].why);
  }
}

static void test_tune_record_lookup(void) {
  char dir[64], key[SMELT__TUNE_KEY_MAX], path[700], log[4096], text[2048];
  tune_dir_new(dir, sizeof dir);
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int n = smelt__gemm_table(table);
  smelt_device_info dev = tune_dev("NVIDIA H100 80GB HBM3");
  smelt__gemm_state st;
  smelt__gemm_facts f;
  tune_state(&st, &f, 512, 512, 4096);
  REQUIRE(smelt__gemm_tune_key(&st, &dev, key, sizeof key) == 0);
  smelt__gemm_tune_path(key, path, sizeof path);
  CHECK(strncmp(path, dir, strlen(dir)) == 0 && strstr(path, "/gemm-tune/") && strstr(path, ".json"));
  int ki = -1, split = 0;
  /* No record: the heuristic. */
  CHECK_EQ_INT(smelt__gemm_tune_lookup(&st, &f, &dev, table, n, &ki, &split), SMELT__TUNE_ABSENT);
  CHECK_EQ_INT(ki, -1);
  /* A record naming the small mma.sync tile with 4 slices is used as is. */
  const char *small = "gemm_sm80_bf16_RC_64x64x32_s4_w2x2";
  smelt__gemm_tune_record r = tune_rec(key, small, 4), q;
  CHECK_OK(smelt__gemm_tune_store(&r));
  CHECK_EQ_INT(smelt__gemm_tune_load(key, &q), SMELT__TUNE_USED);
  CHECK(!strcmp(q.kernel, small) && q.split_k == 4);
  CHECK_EQ_INT(smelt__gemm_tune_lookup(&st, &f, &dev, table, n, &ki, &split), SMELT__TUNE_USED);
  CHECK_EQ_INT(ki, kernel_index(table, n, small));
  CHECK_EQ_INT(split, 4);
  char why[96] = "";
  ki = 0;
  CHECK_EQ_INT(smelt__gemm_tune_choice(&st, &f, &dev, table, n, &ki, why, sizeof why), 4);
  CHECK(strstr(why, "record") != NULL);
  /* SMELT_GEMM_TUNE=off: records are not used. */
  setenv("SMELT_GEMM_TUNE", "off", 1);
  ki = -1;
  CHECK_EQ_INT(smelt__gemm_tune_lookup(&st, &f, &dev, table, n, &ki, &split), SMELT__TUNE_OFF);
  CHECK_EQ_INT(ki, -1);
  unsetenv("SMELT_GEMM_TUNE");
  /* A plan that fixed its split has another key: the record is not its. */
  st.split_k = 2;
  CHECK_EQ_INT(smelt__gemm_tune_lookup(&st, &f, &dev, table, n, &ki, &split), SMELT__TUNE_ABSENT);
  st.split_k = 0;
  /* The Hopper kernel splits K on its own only on a few tiles, not these:
   * a record saying it does here is unfit. */
  r = tune_rec(key, "gemm_sm90_bf16_RC_128x64x64_s8", 2);
  CHECK_OK(smelt__gemm_tune_store(&r));
  CHECK_EQ_INT(lookup_logged(&st, &f, &dev, table, n, &ki, &split, log, sizeof log), SMELT__TUNE_UNFIT);
  CHECK(strstr(log, "cannot run these operands") != NULL);
  /* A kernel for other dtypes, or one that does not exist, is unfit. */
  r = tune_rec(key, "gemm_sm80_f16_RC_64x64x32_s4_w2x2", 1);
  CHECK_OK(smelt__gemm_tune_store(&r));
  CHECK_EQ_INT(lookup_logged(&st, &f, &dev, table, n, &ki, &split, log, sizeof log), SMELT__TUNE_UNFIT);
  r = tune_rec(key, "gemm_sm70_bf16_RC_1x1x1", 1);
  CHECK_OK(smelt__gemm_tune_store(&r));
  CHECK_EQ_INT(lookup_logged(&st, &f, &dev, table, n, &ki, &split, log, sizeof log), SMELT__TUNE_UNFIT);
  /* ... and so is one whose operands lost the alignment tensor ops need. */
  r = tune_rec(key, small, 1);
  CHECK_OK(smelt__gemm_tune_store(&r));
  f.a_k = f.a_mn = 0;
  CHECK_EQ_INT(lookup_logged(&st, &f, &dev, table, n, &ki, &split, log, sizeof log), SMELT__TUNE_UNFIT);
  f.a_k = f.a_mn = 1;
  /* A record of another smelt version is ignored with a log line. */
  r = tune_rec(key, small, 1);
  snprintf(r.version, sizeof r.version, "0.0.1");
  CHECK_OK(smelt__gemm_tune_store(&r));
  CHECK_EQ_INT(lookup_logged(&st, &f, &dev, table, n, &ki, &split, log, sizeof log), SMELT__TUNE_VERSION);
  CHECK(strstr(log, "written by smelt 0.0.1") != NULL);
  /* A record made on another GPU, found under this key's name (a copied
   * cache folder), is ignored with a log line naming both devices. */
  smelt_device_info h200 = tune_dev("NVIDIA H200");
  char other[SMELT__TUNE_KEY_MAX];
  smelt__gemm_tune_key(&st, &h200, other, sizeof other);
  r = tune_rec(other, small, 1);
  smelt__gemm_tune_format(&r, text, sizeof text);
  write_text(path, text);
  ki = -1;
  CHECK_EQ_INT(lookup_logged(&st, &f, &dev, table, n, &ki, &split, log, sizeof log), SMELT__TUNE_FOREIGN);
  CHECK(strstr(log, "another device") && strstr(log, "NVIDIA H200") && strstr(log, "NVIDIA H100 80GB HBM3"));
  CHECK_EQ_INT(ki, -1);
  /* A corrupt record (cut short, or not text) is ignored with a log line. */
  r = tune_rec(key, small, 1);
  int len = smelt__gemm_tune_format(&r, text, sizeof text);
  text[len / 3] = 0;
  write_text(path, text);
  CHECK_EQ_INT(lookup_logged(&st, &f, &dev, table, n, &ki, &split, log, sizeof log), SMELT__TUNE_CORRUPT);
  CHECK(strstr(log, "is corrupt") && strstr(log, path));
  {
    FILE *fp = fopen(path, "wb");
    REQUIRE(fp != NULL);
    const char junk[] = {'{', 0, '}'};
    fwrite(junk, 1, sizeof junk, fp);
    fclose(fp);
  }
  CHECK_EQ_INT(lookup_logged(&st, &f, &dev, table, n, &ki, &split, log, sizeof log), SMELT__TUNE_CORRUPT);
  CHECK_EQ_INT(ki, -1);
  /* A fresh store replaces it; no temp files are left behind. */
  CHECK_OK(smelt__gemm_tune_store(&r));
  CHECK_EQ_INT(smelt__gemm_tune_lookup(&st, &f, &dev, table, n, &ki, &split), SMELT__TUNE_USED);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "ls -A '%s/gemm-tune' | grep -q tmp", dir);
  CHECK(system(cmd) != 0);
  /* Without a usable cache folder nothing is read, and a store says why. */
  setenv("SMELT_CACHE_DIR", "/proc/smelt-no-such-folder", 1);
  CHECK_EQ_INT(smelt__gemm_tune_lookup(&st, &f, &dev, table, n, &ki, &split), SMELT__TUNE_ABSENT);
  CHECK_STATUS(smelt__gemm_tune_store(&r), SMELT_STATUS_CACHE_ERROR);
  CHECK_MSG("no usable cache folder");
  tune_dir_done(dir);
}

static void test_tune_bad_inputs(void) {
  int64_t shape[2] = {8, 8};
  static float buf[3][64];
  smelt_tensor a = smelt_tensor_make(buf[0], SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, shape),
               b = smelt_tensor_make(buf[1], SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, shape),
               d = smelt_tensor_make(buf[2], SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, shape);
  smelt_gemm_tune_result r;
  CHECK_STATUS(smelt_gemm_autotune(NULL, NULL, &a, &b, NULL, &d, NULL, 0, &r), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("ctx is NULL");
  CHECK_STATUS(smelt_gemm_autotune(th_cpu(), NULL, &a, &b, NULL, &d, NULL, 0x10, &r), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("flags=0x10");
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.mode = SMELT_GEMM_MODE_GROUPED;
  CHECK_STATUS(smelt_gemm_autotune(th_cpu(), &desc, &a, &b, NULL, &d, NULL, 0, &r), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("desc.mode=GROUPED is not tuned");
  desc = smelt_gemm_desc_default();
  desc.epilogue.beta = 1.0;
  CHECK_STATUS(smelt_gemm_autotune(th_cpu(), &desc, &a, &b, &d, &d, NULL, 0, &r), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("D is C (in place)");
  CHECK_STATUS(smelt_gemm_autotune(th_cpu(), NULL, &a, &b, NULL, &d, NULL, 0, &r), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("needs a CUDA context");
  smelt_ctx *cu = th_cuda();
  if (!cu) return;
  /* On a GPU, what planning refuses the tuner refuses the same way. */
  CHECK_STATUS(smelt_gemm_autotune(cu, NULL, &a, &b, NULL, &d, NULL, 0, &r), SMELT_STATUS_WRONG_DEVICE);
  CHECK_STATUS(smelt_gemm_autotune(cu, NULL, NULL, &b, NULL, &d, NULL, 0, &r), SMELT_STATUS_NULL_POINTER);
}

/* GPU: tunes s, checks the result against the CPU reference, then checks
 * that a fresh plan takes the recorded winner (and computes correctly),
 * and that SMELT_GEMM_TUNE=off brings the heuristic back. */
static void tune_gpu_case(const gspec *s, const char *what) {
  smelt_ctx *cu = th_cuda();
  ginputs in;
  inputs_new(s, &in);
  const int64_t L = s->batch > 0 ? s->batch : 1, n = L * s->m * s->n;
  double *ref = (double *)malloc(sizeof(double) * (size_t)n), *got = (double *)malloc(sizeof(double) * (size_t)n);
  CHECK_OK(run_case(th_cpu(), s, &in, ref));
  const size_t ed = smelt_dtype_size(s->d);
  th_buf A = th_buf_new(cu, (size_t)in.ga.storage * smelt_dtype_size(s->a)),
         B = th_buf_new(cu, (size_t)in.gb.storage * smelt_dtype_size(s->b)),
         C = th_buf_new(cu, (size_t)in.gc.storage * smelt_dtype_size(s->c)), D = th_buf_new(cu, (size_t)in.gd.storage * ed),
         Bias = th_buf_new(cu, (size_t)(s->n + 1) * smelt_dtype_size(s->bias));
  th_buf_upload(&A, in.a, A.bytes);
  th_buf_upload(&B, in.b, B.bytes);
  th_buf_upload(&C, in.c, C.bytes);
  th_buf_upload(&Bias, in.bias, Bias.bytes);
  smelt_tensor ta = mat_tensor(&in.ga, A.data, cu), tb = mat_tensor(&in.gb, B.data, cu),
               tc = mat_tensor(&in.gc, C.data, cu), td = mat_tensor(&in.gd, D.data, cu);
  int64_t bshape[1] = {s->n};
  smelt_tensor tbias = smelt_tensor_make(Bias.data, s->bias, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), 1, bshape);
  const smelt_tensor *pc = s->has_c ? &tc : NULL, *pbias = s->has_bias ? &tbias : NULL;
  uint8_t *host = (uint8_t *)malloc(D.bytes);
  smelt_gemm_tune_result *r = (smelt_gemm_tune_result *)calloc(1, sizeof *r);
  smelt_status st = smelt_gemm_autotune(cu, &s->desc, &ta, &tb, pc, &td, pbias, 0, r);
  if (st != SMELT_OK) th_fail(__FILE__, __LINE__, "%s: autotune: %s (%s)", what, smelt_status_name(st), smelt_last_error());
  if (st == SMELT_OK) {
    printf("    %s: %d candidates, winner %s split-K %d %.4f ms (heuristic %s %.4f ms)\n", what, r->count,
           r->cand[r->winner].kernel, r->cand[r->winner].split_k, (double)r->cand[r->winner].median_ms,
           r->cand[r->heuristic].kernel, (double)r->cand[r->heuristic].median_ms);
    CHECK(r->count >= 1 && r->winner >= 0 && r->winner < r->count && r->cand[r->heuristic].heuristic);
    CHECK(r->cand[r->winner].correct && r->cand[r->winner].status == SMELT_OK && r->cand[r->winner].median_ms > 0);
    CHECK_EQ_INT(r->recorded, 1);
    CHECK(access(r->record_path, R_OK) == 0);
    /* D holds the GEMM's result. */
    CHECK_OK(smelt_ctx_synchronize(cu));
    th_buf_download(&D, host, D.bytes);
    for (int64_t l = 0; l < L; l++)
      for (int64_t i = 0; i < s->m; i++)
        for (int64_t j = 0; j < s->n; j++) got[(l * s->m + i) * s->n + j] = th_get(host, s->d, mat_off(&in.gd, l, i, j));
    CHECK(th_compare(what, got, ref, n, bound_of(s), 0));
    CHECK(th_buf_guards_ok(&D));
    /* A second plan takes the record's winner and computes correctly. */
    smelt_plan *plan = NULL;
    CHECK_OK(smelt_gemm_plan(cu, &s->desc, &ta, &tb, pc, &td, pbias, &plan));
    if (plan) {
      const char *desc = smelt_plan_describe(plan);
      printf("    plan: %s\n", desc);
      CHECK(strncmp(desc, r->cand[r->winner].kernel, strlen(r->cand[r->winner].kernel)) == 0);
      CHECK(strstr(desc, "tuned: from the record") != NULL);
      memset(host, 0xFF, D.bytes);
      th_buf_upload(&D, host, D.bytes);
      CHECK_OK(smelt_gemm_run(plan, &ta, &tb, pc, &td, pbias));
      CHECK_OK(smelt_ctx_synchronize(cu));
      th_buf_download(&D, host, D.bytes);
      for (int64_t l = 0; l < L; l++)
        for (int64_t i = 0; i < s->m; i++)
          for (int64_t j = 0; j < s->n; j++)
            got[(l * s->m + i) * s->n + j] = th_get(host, s->d, mat_off(&in.gd, l, i, j));
      CHECK(th_compare(what, got, ref, n, bound_of(s), 0));
      smelt_plan_destroy(plan);
    }
    setenv("SMELT_GEMM_TUNE", "off", 1);
    plan = NULL;
    CHECK_OK(smelt_gemm_plan(cu, &s->desc, &ta, &tb, pc, &td, pbias, &plan));
    if (plan) CHECK(strstr(smelt_plan_describe(plan), "tuned") == NULL);
    smelt_plan_destroy(plan);
    unsetenv("SMELT_GEMM_TUNE");
  }
  /* The record stays out of the suite's cache: later GEMM tests see the heuristic. */
  if (r->record_path[0]) unlink(r->record_path);
  free(r);
  free(host);
  free(ref);
  free(got);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&C);
  th_buf_free(&D);
  th_buf_free(&Bias);
  inputs_free(&in);
}

static void test_tune_gpu(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  /* A plain bf16 linear layer with bias + GELU (Hopper and mma.sync kernels compete). */
  gspec s = rc_spec(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 384, 256, 512);
  s.has_bias = 1;
  s.bias = SMELT_DTYPE_BF16;
  s.desc.epilogue.act = SMELT_ACT_GELU;
  tune_gpu_case(&s, "bf16 RC 384x256x512 bias+gelu");
  /* Few tiles and a long K: split-K slice counts compete too; with C. */
  s = rc_spec(SMELT_DTYPE_F16, SMELT_DTYPE_F16, SMELT_DTYPE_F16, 64, 96, 4096);
  s.has_c = 1;
  s.desc.epilogue.beta = 0.5;
  tune_gpu_case(&s, "f16 RC 64x96x4096 +C");
  /* Batched f32 (SIMT only on CUDA cores: one candidate, still a record). */
  s = spec(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 33, 17, 65);
  s.batch = 3;
  tune_gpu_case(&s, "f32 batched 3x33x17x65");
  /* NO_RECORD times and reports but writes nothing; an empty GEMM is refused. */
  smelt_ctx *cu = th_cuda();
  th_buf A = th_buf_new(cu, 64 * 64 * 2), B = th_buf_new(cu, 64 * 64 * 2), D = th_buf_new(cu, 64 * 64 * 2);
  int64_t shape[2] = {64, 64};
  smelt_tensor ta = smelt_tensor_make(A.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), 2, shape),
               tb = smelt_tensor_make(B.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), 2, shape),
               td = smelt_tensor_make(D.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), 2, shape);
  uint16_t host[64 * 64];
  for (int i = 0; i < 64 * 64; i++) host[i] = smelt_f32_to_bf16((float)th_rand_uniform(-1, 1));
  th_buf_upload(&A, host, sizeof host);
  th_buf_upload(&B, host, sizeof host);
  smelt_gemm_tune_result *r = (smelt_gemm_tune_result *)calloc(1, sizeof *r);
  for (int i = 0; i < 2; i++) {
    CHECK_OK(smelt_gemm_autotune(cu, NULL, &ta, &tb, NULL, &td, NULL, SMELT_GEMM_TUNE_NO_RECORD, r));
    CHECK_EQ_INT(r->recorded, 0);
    CHECK(r->count >= 1 && r->cand[r->winner].median_ms > 0);
    if (i == 0 && r->record_path[0]) unlink(r->record_path); /* a leftover of an earlier run */
  }
  CHECK(r->record_path[0] && access(r->record_path, F_OK) != 0);
  shape[0] = 0;
  td = smelt_tensor_make(D.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), 2, shape);
  ta = smelt_tensor_make(A.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), 2, shape);
  CHECK_STATUS(smelt_gemm_autotune(cu, NULL, &ta, &tb, NULL, &td, NULL, 0, r), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("nothing to time");
  free(r);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
}

const th_test th_tests_gemm_tune[] = {
    {"key", test_tune_key},
    {"record_format", test_tune_record_format},
    {"record_lookup", test_tune_record_lookup},
    {"bad_inputs", test_tune_bad_inputs},
    {"gpu", test_tune_gpu},
    {0, 0},
};
