/* Block-scaled fp8 GEMM (desc.scales = SMELT_GEMM_SCALES_BLOCK, DeepGEMM's
 * form: 1 x 128 scales of A, 128 x 128 scales of B, each 128-deep block of
 * K summed apart). The CPU reference is checked against a naive double
 * loop written here (odd M and N, K a multiple of 128 and ragged, batched
 * with its own and with shared scales, K-major scale views, every fp8
 * pair, bias, C, activation); with a Hopper GPU the same cases run on the
 * block-scaled wgmma kernel and are compared with the CPU reference, every
 * D poisoned and guarded, and so do GPU-only ones (more tiles than SMs,
 * the split tail, the 2 x 1 cluster). Grouped by offsets: an empty group,
 * rows past the last end untouched. The selector is checked on faked
 * devices. Scales span orders of magnitude from block to
 * block, so a kernel that applied one block's scale to another's sum, or
 * one scale to the whole K, fails (test_scales_matter shows by how much).
 * smelt_quantize's output feeds the GEMM as it is (test_quantized). Bad
 * scales fail with a clear message and leave D untouched. */
#include "core/error_bound.h"
#include "gemm_offs.h"
#include "gemm_scaled_case.h"

/* ---------------------------------------------------------------- a case */

typedef struct bcase {
  smelt_dtype a, b, d;
  int64_t m, n, k;
  int64_t batch;     /* 0: 2-D operands; L: batched */
  int has_bias, has_c;
  int kmajor_scales; /* scale views K-major: [rows, KB] with strides [1, rows] (DeepGEMM's layout) */
  int shared_b;      /* batched: one [NB, KB] of B scales for every entry (batch stride 0) */
  int exps;          /* block scales 2^e x [0.5, 1), e uniform in [-exps, exps] */
  const char *kernel; /* with CUDA and K > 0: a substring of the plan's description ("_blk" if NULL) */
  smelt_gemm_desc desc;
} bcase;

static bcase make(smelt_dtype a, smelt_dtype b, smelt_dtype d, int64_t m, int64_t n, int64_t k) {
  bcase s = {.a = a, .b = b, .d = d, .m = m, .n = n, .k = k, .exps = 8, .desc = smelt_gemm_desc_default()};
  s.desc.scales = SMELT_GEMM_SCALES_BLOCK;
  return s;
}

static int64_t kblocks(const bcase *s) { return (s->k + 127) / 128; }
static int64_t nblocks(const bcase *s) { return (s->n + 127) / 128; }
static int64_t up16(int64_t x) { return (x + 15) / 16 * 16; }

/* A [L,] rows x cols view whose rows are `ld` elements apart (row-major),
 * or with `trans` the view [cols, rows] of that storage (B as the [K, N]
 * view of a K-major [N, K]), 16 elements into its buffer. */
static th_view mat_view(int64_t batch, int64_t rows, int64_t cols, int64_t ld, int trans) {
  const int64_t r = trans ? cols : rows, c = trans ? rows : cols;
  const int64_t rs = trans ? 1 : ld, cs = trans ? ld : 1, bs = rows * ld;
  if (batch > 0) {
    const int64_t shape[3] = {batch, r, c}, strides[3] = {bs, rs, cs};
    return th_view_make(3, shape, strides, 16);
  }
  const int64_t shape[2] = {r, c}, strides[2] = {rs, cs};
  return th_view_make(2, shape, strides, 16);
}

/* Scales [L,] rows x kb, row-major or K-major; batch stride 0 when shared. */
static th_view scale_view(int64_t batch, int64_t rows, int64_t kb, int kmajor, int shared) {
  const int64_t rs = kmajor ? 1 : kb, ks = kmajor ? rows : 1, bs = shared ? 0 : rows * kb;
  if (batch > 0) {
    const int64_t shape[3] = {batch, rows, kb}, strides[3] = {bs, rs, ks};
    return th_view_make(3, shape, strides, 0);
  }
  const int64_t shape[2] = {rows, kb}, strides[2] = {rs, ks};
  return th_view_make(2, shape, strides, 0);
}

static int fp8(smelt_dtype d) { return d == SMELT_DTYPE_E4M3 || d == SMELT_DTYPE_E5M2; }

/* Positive scales (amax / fmax is) over 2 exps + 1 binades. */
static float *scales_filled(const th_view *v, int exps) {
  float *p = (float *)malloc(sizeof(float) * (size_t)(v->storage + 1));
  for (int64_t i = 0; i <= v->storage; i++)
    p[i] = (float)ldexp(th_rand_uniform(0.5, 1.0), (int)floor(th_rand_uniform(-exps, exps + 1)));
  return p;
}

/* The views and random host storage of case s. */
static void inputs_new(const bcase *s, tgs_case *c) {
  memset(c, 0, sizeof *c);
  const smelt_dtype dts[TGS_N] = {s->a, s->b, s->d, s->d, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32};
  memcpy(c->dt, dts, sizeof dts);
  c->v[TGS_A] = mat_view(s->batch, s->m, s->k, up16(s->k), 0);
  c->v[TGS_B] = mat_view(s->batch, s->n, s->k, up16(s->k), 1);
  c->v[TGS_C] = mat_view(s->batch, s->m, s->n, up16(s->n), 0);
  c->v[TGS_D] = mat_view(s->batch, s->m, s->n, up16(s->n), 0);
  const int64_t one[1] = {s->n}, unit[1] = {1};
  c->v[TGS_BIAS] = th_view_make(1, one, unit, 0);
  c->v[TGS_SA] = scale_view(s->batch, s->m, kblocks(s), s->kmajor_scales, 0);
  c->v[TGS_SB] = scale_view(s->batch, nblocks(s), kblocks(s), s->kmajor_scales, s->shared_b);
  c->host[TGS_A] = tgs_filled(&c->v[TGS_A], s->a, -2, 2);
  c->host[TGS_B] = tgs_filled(&c->v[TGS_B], s->b, -2, 2);
  c->host[TGS_C] = tgs_filled(&c->v[TGS_C], s->d, -1, 1);
  c->host[TGS_BIAS] = tgs_filled(&c->v[TGS_BIAS], SMELT_DTYPE_F32, -1, 1);
  c->host[TGS_SA] = scales_filled(&c->v[TGS_SA], s->exps);
  c->host[TGS_SB] = scales_filled(&c->v[TGS_SB], s->exps);
  c->has[TGS_C] = s->has_c;
  c->has[TGS_BIAS] = s->has_bias;
  c->has[TGS_SA] = c->has[TGS_SB] = 1;
  c->desc = s->desc;
  /* On CUDA with K > 0 the plan must run a block-scaled kernel. */
  c->kernel = s->k == 0 ? NULL : s->kernel ? s->kernel : "_blk";
}

/* The naive loop's inputs: the case, its data, and whether every block
 * takes block 0's scales (what a kernel without per-block scaling would
 * compute). */
typedef struct naive_in {
  const bcase *s;
  const tgs_case *c;
  int one_scale;
} naive_in;

/* Element (l, i, j) of the block-scaled product: each 128-deep block of
 * K summed apart, times its scales. */
static double product(const void *user, int64_t l, int64_t i, int64_t j) {
  const naive_in *u = (const naive_in *)user;
  const bcase *s = u->s;
  const tgs_case *c = u->c;
  double acc = 0;
  for (int64_t kb = 0; kb < kblocks(s); kb++) {
    double part = 0;
    for (int64_t k = 128 * kb; k < 128 * kb + 128 && k < s->k; k++)
      part += tgs_at(c->host[TGS_A], s->a, &c->v[TGS_A], l, i, k) * tgs_at(c->host[TGS_B], s->b, &c->v[TGS_B], l, k, j);
    const int64_t sk = u->one_scale ? 0 : kb;
    acc += tgs_at(c->host[TGS_SA], SMELT_DTYPE_F32, &c->v[TGS_SA], l, i, sk) *
           tgs_at(c->host[TGS_SB], SMELT_DTYPE_F32, &c->v[TGS_SB], l, j / 128, sk) * part;
  }
  return acc;
}

/* The expected D [L][m][n]: smelt/gemm.h's block-scaled sum and epilogue
 * in double. */
static void naive(const void *user, double *out) { tgs_naive(((const naive_in *)user)->c, product, user, out); }

/* The bound against the CPU reference: the output's rounding, and at
 * least 2e-3 for the tensor cores' fp8 block sums (about 14 bits kept at
 * each of a block's four wgmma additions). A block scaled with another
 * block's scales is off by orders of magnitude. */
static double bound_of(const bcase *s) {
  const smelt__bound_query q = {.family = "gemm", .dtype = s->d, .dt_a = s->a, .gemm = &s->desc, .has_c = s->has_c};
  const double b = smelt__error_bound(&q);
  return b > 2e-3 ? b : 2e-3;
}

#define NAIVE_MACS ((int64_t)1 << 22)

/* The CPU reference against the naive loop (small cases) and, with a
 * Hopper GPU, CUDA against the CPU reference. Returns 0 on a failure. */
static int check(const bcase *s, const char *what) {
  char label[256];
  snprintf(label, sizeof label, "%s %sx%s->%s m%lld n%lld k%lld L%lld%s%s%s%s act %d", what, smelt_dtype_name(s->a),
           smelt_dtype_name(s->b), smelt_dtype_name(s->d), (long long)s->m, (long long)s->n, (long long)s->k,
           (long long)s->batch, s->kmajor_scales ? " kmajor-scales" : "", s->shared_b ? " shared-sb" : "",
           s->has_c ? " +C" : "", s->has_bias ? " +bias" : "", (int)s->desc.epilogue.act);
  tgs_case c;
  inputs_new(s, &c);
  const naive_in user = {s, &c, 0};
  const int ok = tgs_check(&c, label, s->m * s->n * s->k <= NAIVE_MACS ? naive : NULL, &user,
                           s->d == SMELT_DTYPE_F32 ? 1e-6 : bound_of(s), th_cuda_sm90() ? th_cuda() : NULL,
                           bound_of(s), fp8(s->d) ? -1.0 : 0);
  tgs_free(&c);
  return ok;
}

/* A tensor on ctx's device with these strides. */
static smelt_tensor mk(smelt_ctx *ctx, void *data, smelt_dtype dt, int nd, const int64_t *shape,
                       const int64_t *strides) {
  smelt_tensor t = smelt_tensor_make(data, dt, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), nd, shape);
  for (int i = 0; i < nd; i++) t.strides[i] = strides[i];
  return t;
}

/* A 2-D tensor on ctx's device, rows x cols, strides rs and cs. */
static smelt_tensor mat2(smelt_ctx *ctx, void *data, smelt_dtype dt, int64_t rows, int64_t cols, int64_t rs,
                         int64_t cs) {
  const int64_t shape[2] = {rows, cols}, strides[2] = {rs, cs};
  return mk(ctx, data, dt, 2, shape, strides);
}

/* ---------------------------------------------------------------- cases */

/* Every fp8 pair and D type, odd M and N (edge tiles in both), K a
 * multiple of 128 and ragged (a short last block), bias, C, activations,
 * alpha and the per-tensor scales. On Hopper: the fast epilogue through
 * TMA stores (16-bit and f32 D, N a multiple of 8), through the threads (N
 * odd) and the general one (C, fp8 D). */
static void test_plain(void) {
  static const struct {
    smelt_dtype a, b, d;
    int64_t m, n, k;
    int bias, c;
    smelt_act act;
  } cases[] = {
      {SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, 257, 200, 640, 1, 0, SMELT_ACT_GELU},
      {SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_F32, 77, 131, 384, 0, 0, SMELT_ACT_IDENTITY},
      {SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_F16, 130, 136, 300, 1, 1, SMELT_ACT_RELU},
      {SMELT_DTYPE_E5M2, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, 1, 8, 128, 0, 0, SMELT_ACT_IDENTITY},
      {SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2, SMELT_DTYPE_E4M3, 65, 72, 256, 1, 0, SMELT_ACT_IDENTITY},
      {SMELT_DTYPE_E5M2, SMELT_DTYPE_E5M2, SMELT_DTYPE_F32, 9, 264, 1, 1, 0, SMELT_ACT_IDENTITY},
      {SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, 200, 136, 2560, 0, 0, SMELT_ACT_IDENTITY},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    bcase s = make(cases[i].a, cases[i].b, cases[i].d, cases[i].m, cases[i].n, cases[i].k);
    s.has_bias = cases[i].bias;
    s.has_c = cases[i].c;
    s.desc.epilogue.beta = s.has_c ? 0.5 : 0.0;
    s.desc.epilogue.alpha = i == 2 ? 0.75 : 1.0;
    s.desc.epilogue.scale_a = i == 1 ? 0.5f : 1.0f;
    s.desc.epilogue.act = cases[i].act;
    s.kmajor_scales = i % 2;
    if (!check(&s, "plain")) return;
  }
}

/* Batched: each entry its own scales, or one B scale tensor for all
 * (batch stride 0); K-major scale views. */
static void test_batched(void) {
  for (int i = 0; i < 2; i++) {
    bcase s = make(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, i ? SMELT_DTYPE_F32 : SMELT_DTYPE_BF16, 130, 136, 384);
    s.batch = 3;
    s.shared_b = i;
    s.kmajor_scales = i;
    s.has_bias = !i;
    if (!check(&s, "batched")) return;
  }
}

/* K = 0: D = epilogue(beta C + bias), the scales [M, 0] and [NB, 0]. */
static void test_empty_k(void) {
  bcase s = make(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_F32, 5, 7, 0);
  s.has_bias = 1;
  s.has_c = 1;
  s.desc.epilogue.beta = 2.0;
  check(&s, "empty K");
}

/* Scales that differ by up to 2^24 between blocks: applying block 0's
 * scales to the whole K (no per-block scaling) is wrong by far more than
 * any bound, so the per-block result the reference and the GPU agree on
 * is the block-scaled one. */
static void test_scales_matter(void) {
  bcase s = make(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_F32, 33, 40, 512);
  s.exps = 12;
  tgs_case c;
  inputs_new(&s, &c);
  const int64_t n = s.m * s.n;
  double *good = (double *)malloc(sizeof(double) * (size_t)n), *wrong = (double *)malloc(sizeof(double) * (size_t)n);
  const naive_in per_block = {&s, &c, 0}, one = {&s, &c, 1};
  naive(&per_block, good);
  naive(&one, wrong);
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    num += (wrong[i] - good[i]) * (wrong[i] - good[i]);
    den += good[i] * good[i];
  }
  CHECK(sqrt(num / den) > 0.1);
  free(good);
  free(wrong);
  tgs_free(&c);
  check(&s, "scales matter");
}

/* Quantized data as smelt_quantize writes it (x in FP8_1X128, w [N, K] in
 * FP8_128X128) is the GEMM's input as it is: B is the [K, N] view of q(w).
 * The result equals the product of the dequantized operands. */
static void test_quantized(void) {
  smelt_ctx *ctx = th_cpu();
  const int64_t M = 67, N = 150, K = 300, KB = 3, NB = 2;
  float *x = (float *)malloc(sizeof(float) * (size_t)(M * K)), *w = (float *)malloc(sizeof(float) * (size_t)(N * K));
  /* Per-block magnitudes over many binades, as activations' outliers are. */
  for (int64_t i = 0; i < M * K; i++) x[i] = (float)ldexp(th_rand_normal(), (int)((i / 128 + i / K) % 9) - 4);
  for (int64_t i = 0; i < N * K; i++) w[i] = (float)ldexp(th_rand_normal(), (int)((i % K) / 128) * 3 - 3);
  uint8_t *qx = (uint8_t *)malloc((size_t)(M * K)), *qw = (uint8_t *)malloc((size_t)(N * K));
  float *sx = (float *)malloc(sizeof(float) * (size_t)(M * KB)),
        *sw = (float *)malloc(sizeof(float) * (size_t)(NB * KB)), *d = (float *)malloc(sizeof(float) * (size_t)(M * N));
  /* B is the [K, N] view of q(w) [N, K]. */
  const smelt_dtype f8 = SMELT_DTYPE_E4M3, f32 = SMELT_DTYPE_F32;
  const smelt_tensor tx = mat2(ctx, x, f32, M, K, K, 1), tqx = mat2(ctx, qx, f8, M, K, K, 1),
                     tsx = mat2(ctx, sx, f32, M, KB, KB, 1), tw = mat2(ctx, w, f32, N, K, K, 1),
                     tqw = mat2(ctx, qw, f8, N, K, K, 1), tb = mat2(ctx, qw, f8, K, N, 1, K),
                     tsw = mat2(ctx, sw, f32, NB, KB, KB, 1), td = mat2(ctx, d, f32, M, N, N, 1);
  CHECK_OK(smelt_quantize(ctx, SMELT_QUANT_FP8_1X128, &tx, &tqx, &tsx, NULL));
  CHECK_OK(smelt_quantize(ctx, SMELT_QUANT_FP8_128X128, &tw, &tqw, &tsw, NULL));
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.scales = SMELT_GEMM_SCALES_BLOCK;
  const smelt_gemm_scales sc = {&tsx, &tsw};
  CHECK_OK(smelt_gemm_scaled(ctx, &desc, &tqx, &tb, NULL, &td, NULL, &sc));
  double *got = (double *)malloc(sizeof(double) * (size_t)(M * N)),
         *ref = (double *)malloc(sizeof(double) * (size_t)(M * N));
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double acc = 0;
      for (int64_t k = 0; k < K; k++)
        acc += th_get(qx, f8, i * K + k) * sx[i * KB + k / 128] * th_get(qw, f8, j * K + k) *
               sw[(j / 128) * KB + k / 128];
      ref[i * N + j] = acc;
      got[i * N + j] = d[i * N + j];
    }
  CHECK(th_compare("quantized inputs vs the dequantized product", got, ref, M * N, 1e-6, 0));
  free(x);
  free(w);
  free(qx);
  free(qw);
  free(sx);
  free(sw);
  free(d);
  free(got);
  free(ref);
}

/* Grouped by offsets (the MoE form): A [T, K] stacked, B [G, K, N] as the
 * view of [G, N, K], sa [T, KB] per row, sb [G, NB, KB] per group; an
 * empty group and rows past the last end, which stay untouched. CPU
 * against a naive loop, and with a Hopper GPU CUDA against the CPU. */
static void test_offs(void) {
  const int64_t T = 300, N = 264, K = 384, G = 3, KB = 3, NB = 3;
  /* As large as tgs_upload() reads: the view's storage and one more. */
  const int64_t ends[4] = {100, 100, 290, 0};
  const smelt_dtype f8 = SMELT_DTYPE_E4M3, bf = SMELT_DTYPE_BF16, f32 = SMELT_DTYPE_F32;
  const int64_t a_sh[2] = {T, K}, a_st[2] = {K, 1}, b_sh[3] = {G, K, N}, b_st[3] = {N * K, 1, K}, d_sh[2] = {T, N},
                d_st[2] = {N, 1}, sa_sh[2] = {T, KB}, sa_st[2] = {KB, 1}, sb_sh[3] = {G, NB, KB},
                sb_st[3] = {NB * KB, KB, 1}, o_sh[1] = {G}, o_st[1] = {1};
  const th_view va = th_view_make(2, a_sh, a_st, 0), vb = th_view_make(3, b_sh, b_st, 0),
                vd = th_view_make(2, d_sh, d_st, 0), vsa = th_view_make(2, sa_sh, sa_st, 0),
                vsb = th_view_make(3, sb_sh, sb_st, 0), vo = th_view_make(1, o_sh, o_st, 0);
  void *a = tgs_filled(&va, f8, -2, 2), *b = tgs_filled(&vb, f8, -2, 2);
  float *sa = scales_filled(&vsa, 8), *sb = scales_filled(&vsb, 8);
  double *ref = (double *)malloc(sizeof(double) * (size_t)(T * N)), *got[2] = {NULL, NULL};
  for (int64_t g = 0, r0 = 0; g < G; r0 = ends[g], g++)
    for (int64_t r = r0; r < ends[g]; r++)
      for (int64_t j = 0; j < N; j++) {
        double acc = 0;
        for (int64_t kb = 0; kb < KB; kb++) {
          double part = 0;
          for (int64_t k = 128 * kb; k < 128 * kb + 128; k++)
            part += th_get(a, f8, r * K + k) * th_get(b, f8, g * N * K + j * K + k);
          acc += (double)sa[r * KB + kb] * sb[g * NB * KB + (j / 128) * KB + kb] * part;
        }
        ref[r * N + j] = tgs_stored(acc, bf);
      }
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.scales = SMELT_GEMM_SCALES_BLOCK;
  smelt_ctx *ctxs[2] = {th_cpu(), th_cuda_sm90() ? th_cuda() : NULL};
  const th_view views[TGS_ON] = {va, vb, vsa, vsb, vo};
  void *const host[TGS_ON] = {a, b, sa, sb, (void *)ends};
  const smelt_dtype dts[TGS_ON] = {f8, f8, f32, f32, SMELT_DTYPE_I64};
  for (int ci = 0; ci < 2 && ctxs[ci]; ci++) {
    got[ci] = (double *)malloc(sizeof(double) * (size_t)(T * N));
    const smelt_status st = tgs_run_offs(ctxs[ci], &desc, views, host, dts, &vd, bf, ends[G - 1], "_blk", got[ci]);
    const char *what = ci ? "block-scaled grouped offs cuda vs cpu" : "block-scaled grouped offs cpu vs naive";
    if (st != SMELT_OK)
      th_fail(__FILE__, __LINE__, "%s: %s (%s)", what, smelt_status_name(st), smelt_last_error());
    else if (!th_compare(what, got[ci], ci ? got[0] : ref, ends[G - 1] * N, 1.1e-2, 0))
      th_fail(__FILE__, __LINE__, "%s", what);
  }
  free(got[0]);
  free(got[1]);
  free(ref);
  free(a);
  free(b);
  free(sa);
  free(sb);
}

/* The selector on faked devices: block scales take the block-scaled
 * kernel on Hopper (plain, batched, grouped by offsets; its cluster when
 * asked), fail with UNSUPPORTED elsewhere or for operands it cannot read,
 * and with K = 0 take any kernel (nothing to scale). */
static void test_select(void) {
  static const struct {
    smelt_gemm_mode mode;
    int cc, a_k, cluster_m, sm90_d;
    int64_t k;
    smelt_dtype b, d;
    const char *want; /* "" : UNSUPPORTED */
  } cases[] = {
      {SMELT_GEMM_MODE_PLAIN, 9, 1, 0, 1, 8192, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16,
       "gemm_sm90_e4m3xe4m3_RC_128x128x128_s6_blk"},
      {SMELT_GEMM_MODE_PLAIN, 9, 1, 0, 0, 300, SMELT_DTYPE_E5M2, SMELT_DTYPE_F32,
       "gemm_sm90_e4m3xe5m2_RC_128x128x128_s6_blk"},
      {SMELT_GEMM_MODE_PLAIN, 9, 1, 2, 1, 8192, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16,
       "gemm_sm90_e4m3xe4m3_RC_128x128x128_s6_c2x1_blk"},
      {SMELT_GEMM_MODE_BATCHED, 9, 1, 0, 1, 1024, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16,
       "gemm_sm90_e4m3xe4m3_RC_128x128x128_s6_blk"},
      {SMELT_GEMM_MODE_GROUPED_OFFS, 9, 1, 0, 1, 4096, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16,
       "gemm_sm90_e4m3xe4m3_RC_128x128x128_s6_blk"},
      {SMELT_GEMM_MODE_BATCHED, 9, 1, 0, 0, 1024, SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, ""},
      {SMELT_GEMM_MODE_PLAIN, 9, 0, 0, 1, 8192, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, ""},
      {SMELT_GEMM_MODE_PLAIN, 8, 1, 0, 1, 8192, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, ""},
      {SMELT_GEMM_MODE_PLAIN, 9, 1, 0, 1, 0, SMELT_DTYPE_E4M3, SMELT_DTYPE_F32,
       "gemm_sm80_e4m3xe4m3_RC_128x128x64_s4_w2x4"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    smelt__gemm_state st = bf16_state(cases[i].mode, 1);
    st.dt_a = SMELT_DTYPE_E4M3;
    st.dt_b = cases[i].b;
    st.dt_d = cases[i].d;
    st.blk = st.has_sa = st.has_sb = 1;
    st.desc.scales = SMELT_GEMM_SCALES_BLOCK;
    st.desc.tile.cluster_m = cases[i].cluster_m;
    const int64_t k = cases[i].k;
    const smelt__gemm_facts f = {.a_k = cases[i].a_k, .a_mn = 1, .b_k = 1, .b_mn = 1, .tma_a = {1, 1},
                                 .tma_b = {1, 1}, .m = 4096, .n = 4096, .k = k, .batch = 8,
                                 .sm90_d = cases[i].sm90_d, .k_min = k, .batch_d16 = 1};
    smelt_status s;
    const char *got = pick_name(&st, &f, cases[i].cc, 0, &s);
    if (strcmp(got, cases[i].want) || (!cases[i].want[0] && s != SMELT_STATUS_UNSUPPORTED))
      th_fail(__FILE__, __LINE__, "case %zu: picked \"%s\" (%s), want \"%s\"", i, got, smelt_status_name(s),
              cases[i].want);
    if (!cases[i].want[0] && !strstr(smelt_last_error(), "block scales run on Hopper"))
      th_fail(__FILE__, __LINE__, "case %zu: message \"%s\"", i, smelt_last_error());
  }
}

/* ---------------------------------------------------------------- GPU only */

/* More tiles than SMs (140 on 132: some CTAs walk two, their second tile
 * starting mid-ring). The CPU reference is the oracle (no naive loop). */
static void test_gpu_many_tiles(void) {
  if (!th_cuda_sm90()) SKIP("no Hopper GPU");
  bcase s = make(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, 1700, 1160, 200);
  s.has_bias = 1;
  check(&s, "many tiles");
}

/* The split tail (SMELT_GEMM_SPLIT_TAIL=on): tiles in K chunks, each from
 * its own first k block, so the scales must follow the chunk's K offset. */
static void test_gpu_split_tail(void) {
  if (!th_cuda_sm90()) SKIP("no Hopper GPU");
  setenv("SMELT_GEMM_SPLIT_TAIL", "on", 1);
  bcase s = make(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_F32, 384, 384, 1024);
  check(&s, "split tail");
  unsetenv("SMELT_GEMM_SPLIT_TAIL");
}

/* The 2 x 1 cluster variant (asked for by its tile): pairs of tiles along
 * M sharing B through multicast, an odd tile count (a unit's tile past M
 * loads, runs and stores nothing). */
static void test_gpu_cluster(void) {
  if (!th_cuda_sm90()) SKIP("no Hopper GPU");
  bcase s = make(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, 300, 264, 384);
  s.desc.tile.cluster_m = 2;
  s.kernel = "_c2x1_blk";
  s.has_bias = 1;
  check(&s, "cluster 2x1");
}

/* Operands the block-scaled kernel cannot read (A column-major) fail on
 * CUDA with UNSUPPORTED, naming what it needs. */
static void test_gpu_unsupported(void) {
  smelt_ctx *ctx = th_cuda();
  if (!ctx) SKIP("no GPU");
  const int64_t M = 8, N = 8, K = 128;
  th_buf A = th_buf_new(ctx, M * K), B = th_buf_new(ctx, N * K), D = th_buf_new(ctx, M * N * 2),
         SA = th_buf_new(ctx, M * 4), SB = th_buf_new(ctx, 4);
  const int64_t ash[2] = {M, K}, ast[2] = {1, M}, bsh[2] = {K, N}, bst[2] = {1, K}, dsh[2] = {M, N}, dst[2] = {N, 1},
                sash[2] = {M, 1}, sast[2] = {1, 1}, sbsh[2] = {1, 1};
  const smelt_tensor ta = mk(ctx, A.data, SMELT_DTYPE_E4M3, 2, ash, ast),
                     tb = mk(ctx, B.data, SMELT_DTYPE_E4M3, 2, bsh, bst),
                     td = mk(ctx, D.data, SMELT_DTYPE_BF16, 2, dsh, dst),
                     tsa = mk(ctx, SA.data, SMELT_DTYPE_F32, 2, sash, sast),
                     tsb = mk(ctx, SB.data, SMELT_DTYPE_F32, 2, sbsh, sast);
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.scales = SMELT_GEMM_SCALES_BLOCK;
  const smelt_gemm_scales sc = {&tsa, &tsb};
  CHECK_STATUS(smelt_gemm_scaled(ctx, &desc, &ta, &tb, NULL, &td, NULL, &sc), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("block scales run on Hopper");
  CHECK(th_buf_untouched(&D));
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
  th_buf_free(&SA);
  th_buf_free(&SB);
}

/* ---------------------------------------------------------------- errors */

/* Bad block scales and modes: each fails with its status and a message
 * naming the tensor and the rule, and leaves D untouched. */
static void test_errors(void) {
  smelt_ctx *ctx = th_cpu();
  const int64_t M = 5, N = 130, K = 200; /* KB 2, NB 2 */
  uint8_t a[5 * 200], b[130 * 200], a16[5 * 200 * 2];
  float d[5 * 130], sa[5 * 2], sb[2 * 2], big[64];
  memset(a, 0x38, sizeof a);
  memset(b, 0x38, sizeof b);
  memset(a16, 0, sizeof a16);
  for (int i = 0; i < 10; i++) sa[i] = 1.f;
  for (int i = 0; i < 4; i++) sb[i] = 1.f;
  memset(d, 0xff, sizeof d);
  const int64_t ash[2] = {M, K}, ast[2] = {K, 1}, bsh[2] = {K, N}, bst[2] = {1, K}, dsh[2] = {M, N}, dst[2] = {N, 1};
  const int64_t sash[2] = {M, 2}, sbsh[2] = {2, 2}, st2[2] = {2, 1}, wrong[2] = {M, 3}, wrong_b[2] = {1, 2};
  const smelt_tensor ta = mk(ctx, a, SMELT_DTYPE_E4M3, 2, ash, ast),
                     t16 = mk(ctx, a16, SMELT_DTYPE_BF16, 2, ash, ast),
                     tb = mk(ctx, b, SMELT_DTYPE_E4M3, 2, bsh, bst),
                     td = mk(ctx, d, SMELT_DTYPE_F32, 2, dsh, dst),
                     tsa = mk(ctx, sa, SMELT_DTYPE_F32, 2, sash, st2),
                     tsb = mk(ctx, sb, SMELT_DTYPE_F32, 2, sbsh, st2),
                     tsa_wrong = mk(ctx, big, SMELT_DTYPE_F32, 2, wrong, st2),
                     tsb_wrong = mk(ctx, big, SMELT_DTYPE_F32, 2, wrong_b, st2),
                     tsa_vec = mk(ctx, sa, SMELT_DTYPE_F32, 1, ash, st2 + 1),
                     tsa_over = mk(ctx, d, SMELT_DTYPE_F32, 2, sash, st2);
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.scales = SMELT_GEMM_SCALES_BLOCK;
  const struct {
    const smelt_tensor *a, *sa, *sb;
    smelt_status want;
    const char *msg;
  } bad[] = {
      {&t16, &tsa, &tsb, SMELT_STATUS_DTYPE_MISMATCH, "block scales need fp8 A and B"},
      {&ta, &tsa, NULL, SMELT_STATUS_NULL_POINTER, "scales->b is NULL"},
      {&ta, &tsa_wrong, &tsb, SMELT_STATUS_SHAPE_MISMATCH, "scales->a.shape[1]=3 must equal ceil(K/128)=2"},
      {&ta, &tsa, &tsb_wrong, SMELT_STATUS_SHAPE_MISMATCH, "scales->b.shape[0]=1 must equal ceil(N/128)=2"},
      {&ta, &tsa_vec, &tsb, SMELT_STATUS_SHAPE_MISMATCH, "scales->a.ndim=1 must be 2"},
      {&ta, &tsa_over, &tsb, SMELT_STATUS_INVALID_ARGUMENT, "D overlaps scales->a"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    const smelt_gemm_scales sc = {bad[i].sa, bad[i].sb};
    CHECK_STATUS(smelt_gemm_scaled(ctx, &desc, bad[i].a, &tb, NULL, &td, NULL, &sc), bad[i].want);
    CHECK_MSG(bad[i].msg);
    CHECK(th_all_ff(d, sizeof d));
  }
  const smelt_gemm_scales good = {&tsa, &tsb};
  /* No split-K or host-grouped form, grouped by offsets b [G, NB, KB], and a valid kind. */
  smelt_gemm_desc split = desc;
  split.mode = SMELT_GEMM_MODE_SPLIT_K_SERIAL;
  split.split_k = 2;
  CHECK_STATUS(smelt_gemm_scaled(ctx, &split, &ta, &tb, NULL, &td, NULL, &good), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("block scales serve plain and batched GEMMs");
  smelt_gemm_desc odd = desc;
  odd.scales = (smelt_gemm_scale_kind)7;
  CHECK_STATUS(smelt_gemm_scaled(ctx, &odd, &ta, &tb, NULL, &td, NULL, &good), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("desc.scales=7");
  const int64_t b3[3] = {1, K, N}, b3s[3] = {K * N, 1, K}, offs_sh[1] = {1}, one[1] = {1};
  int32_t offs[1] = {M};
  const smelt_tensor tb3 = mk(ctx, b, SMELT_DTYPE_E4M3, 3, b3, b3s),
                     to = mk(ctx, offs, SMELT_DTYPE_I32, 1, offs_sh, one);
  CHECK_STATUS(smelt_gemm_grouped_offs_scaled(ctx, &desc, &ta, &tb3, NULL, &td, NULL, &to, &good),
               SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("scales->b.ndim=2 must be 3");
  CHECK_STATUS(smelt_gemm_grouped(ctx, &desc, 1, &ta, &tb, NULL, &td, NULL), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("desc.scales=BLOCK serves plain, batched and grouped-by-offsets GEMMs");
  /* Without scales the block form has nothing to scale by. */
  CHECK_STATUS(smelt_gemm(ctx, &desc, &ta, &tb, NULL, &td, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK(th_all_ff(d, sizeof d));
  /* The good call writes D. */
  CHECK_OK(smelt_gemm_scaled(ctx, &desc, &ta, &tb, NULL, &td, NULL, &good));
  CHECK(!th_all_ff(d, sizeof d));
}

const th_test th_tests_gemm_fp8blk[] = {
    {"plain", test_plain},
    {"batched", test_batched},
    {"empty_k", test_empty_k},
    {"scales_matter", test_scales_matter},
    {"quantized", test_quantized},
    {"offs", test_offs},
    {"select", test_select},
    {"gpu_many_tiles", test_gpu_many_tiles},
    {"gpu_split_tail", test_gpu_split_tail},
    {"gpu_cluster", test_gpu_cluster},
    {"gpu_unsupported", test_gpu_unsupported},
    {"errors", test_errors},
    {NULL, NULL},
};
