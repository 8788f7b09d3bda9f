/* GEMM with row scales of A and column scales of B (smelt_gemm_scales, the
 * row-wise form of torch._scaled_mm). The library's CPU reference is
 * checked against a naive double-precision loop written here for several
 * dtypes, layouts, vector shapes and strides, batched and split modes and
 * grouped by offsets; with a GPU the same cases, and cases forced onto each
 * kernel whose epilogue applies the vectors (SIMT, mma.sync, the Hopper
 * kernel's general and fast epilogues in every tile, split-K's reduction),
 * are compared against the CPU reference. Every D is poisoned and guarded:
 * each element must be written and nothing else. Bad vectors fail with a
 * clear message and leave D untouched. */
#include "core/error_bound.h"
#include "gemm_scaled_case.h"

/* ---------------------------------------------------------------- a case */

typedef struct scase {
  smelt_dtype a, b, d;
  int64_t m, n, k;
  int64_t batch;        /* 0: 2-D operands; L: batched */
  int a_col, b_col;     /* column-major A, B */
  int ld16;             /* leading dimensions rounded up to 16 elements */
  int has_bias, has_c;
  int sa, sb;           /* 0 none; 1 [M] / [N]; 2 [M, 1] / [1, N]; 3 1-D with stride 3 */
  smelt_gemm_desc desc;
  const char *kernel;   /* with a GPU: a substring of the plan's description, or NULL */
} scase;

static scase make(smelt_dtype a, smelt_dtype b, smelt_dtype d, int64_t m, int64_t n, int64_t k) {
  const scase s = {.a = a, .b = b, .d = d, .m = m, .n = n, .k = k, .sa = 1, .sb = 1, .desc = smelt_gemm_desc_default()};
  return s;
}

/* RC with 16-element leading dimensions: the Hopper kernel's layout. */
static scase make_rc(smelt_dtype a, smelt_dtype b, smelt_dtype d, int64_t m, int64_t n, int64_t k) {
  scase s = make(a, b, d, m, n, k);
  s.b_col = 1;
  s.ld16 = 1;
  return s;
}

/* A [L,] rows x cols matrix, row- or column-major, one element into its
 * buffer, or with ld16 (the tensor-op alignment) 16 elements in and its
 * leading dimension rounded up to 16 elements. */
static th_view mat_view(int64_t batch, int64_t rows, int64_t cols, int col_major, int ld16) {
  int64_t ld = col_major ? rows : cols;
  const int64_t offset = ld16 ? 16 : 1;
  if (ld16) ld = (ld + 15) / 16 * 16;
  const int64_t rs = col_major ? 1 : ld, cs = col_major ? ld : 1, bs = (col_major ? cols : rows) * ld;
  if (batch > 0) {
    const int64_t shape[3] = {batch, rows, cols}, strides[3] = {bs, rs, cs};
    return th_view_make(3, shape, strides, offset);
  }
  const int64_t shape[2] = {rows, cols}, strides[2] = {rs, cs};
  return th_view_make(2, shape, strides, offset);
}

/* A scale vector of n values in form `how` (see scase.sa). */
static th_view vec_view(int64_t n, int how, int row) {
  if (how == 2) {
    const int64_t shape[2] = {row ? n : 1, row ? 1 : n}, strides[2] = {row ? 1 : n, row ? 1 : 1};
    return th_view_make(2, shape, strides, 0);
  }
  const int64_t shape[1] = {n}, strides[1] = {how == 3 ? 3 : 1};
  return th_view_make(1, shape, strides, 0);
}

static int fp8(smelt_dtype d) { return d == SMELT_DTYPE_E4M3 || d == SMELT_DTYPE_E5M2; }

/* The views and random host storage of case s. */
static void inputs_new(const scase *s, tgs_case *c) {
  memset(c, 0, sizeof *c);
  const smelt_dtype dts[TGS_N] = {s->a, s->b, s->d, s->d, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32};
  memcpy(c->dt, dts, sizeof dts);
  c->v[TGS_A] = mat_view(s->batch, s->m, s->k, s->a_col, s->ld16);
  c->v[TGS_B] = mat_view(s->batch, s->k, s->n, s->b_col, s->ld16);
  c->v[TGS_C] = mat_view(s->batch, s->m, s->n, 0, s->ld16);
  c->v[TGS_D] = mat_view(s->batch, s->m, s->n, 0, s->ld16);
  const int64_t one[1] = {s->n}, unit[1] = {1};
  c->v[TGS_BIAS] = th_view_make(1, one, unit, 0);
  c->v[TGS_SA] = vec_view(s->m, s->sa, 1);
  c->v[TGS_SB] = vec_view(s->n, s->sb, 0);
  c->host[TGS_A] = tgs_filled(&c->v[TGS_A], s->a, fp8(s->a) ? -2 : -1, fp8(s->a) ? 2 : 1);
  c->host[TGS_B] = tgs_filled(&c->v[TGS_B], s->b, fp8(s->b) ? -2 : -1, fp8(s->b) ? 2 : 1);
  c->host[TGS_C] = tgs_filled(&c->v[TGS_C], s->d, -1, 1);
  c->host[TGS_BIAS] = tgs_filled(&c->v[TGS_BIAS], SMELT_DTYPE_F32, -1, 1);
  /* Scales of both signs and a wide range, as per-token amax scales are. */
  c->host[TGS_SA] = tgs_filled(&c->v[TGS_SA], SMELT_DTYPE_F32, -4, 4);
  c->host[TGS_SB] = tgs_filled(&c->v[TGS_SB], SMELT_DTYPE_F32, 0.01, 3);
  c->has[TGS_C] = s->has_c;
  c->has[TGS_BIAS] = s->has_bias;
  c->has[TGS_SA] = s->sa != 0;
  c->has[TGS_SB] = s->sb != 0;
  c->desc = s->desc;
  c->kernel = s->kernel;
}

static double vec_at(const void *p, const th_view *v, int64_t i) {
  return ((const float *)p)[v->offset + th_view_off(v, i)];
}

/* The naive loop's inputs: the case and its data. */
typedef struct naive_in {
  const scase *s;
  const tgs_case *c;
} naive_in;

/* Element (l, i, j) of the product, scaled by the case's vectors. */
static double product(const void *user, int64_t l, int64_t i, int64_t j) {
  const scase *s = ((const naive_in *)user)->s;
  const tgs_case *c = ((const naive_in *)user)->c;
  double acc = 0;
  for (int64_t k = 0; k < s->k; k++)
    acc += tgs_at(c->host[TGS_A], s->a, &c->v[TGS_A], l, i, k) * tgs_at(c->host[TGS_B], s->b, &c->v[TGS_B], l, k, j);
  if (s->sa) acc *= vec_at(c->host[TGS_SA], &c->v[TGS_SA], i);
  if (s->sb) acc *= vec_at(c->host[TGS_SB], &c->v[TGS_SB], j);
  return acc;
}

/* The expected D [L][m][n], decoded: smelt/gemm.h's epilogue in double. */
static void naive(const void *user, double *out) { tgs_naive(((const naive_in *)user)->c, product, user, out); }

static double bound_of(const scase *s) {
  const smelt__bound_query q = {.family = "gemm", .dtype = s->d, .dt_a = s->a, .gemm = &s->desc, .has_c = s->has_c};
  return smelt__error_bound(&q);
}

/* Larger cases (the GPU ones, to stay fast) skip the naive loop: the CPU
 * reference they are compared with is checked against it on the small ones. */
#define NAIVE_MACS ((int64_t)1 << 22)

/* The CPU reference against the naive loop (small cases) and, with a GPU
 * (and `gpu`), CUDA against the CPU reference. Returns 0 on a failure. */
static int check(const scase *s, int gpu, const char *what) {
  char label[256];
  snprintf(label, sizeof label, "%s %sx%s->%s %c%c m%lld n%lld k%lld L%lld sa%d sb%d%s%s act %d", what,
           smelt_dtype_name(s->a), smelt_dtype_name(s->b), smelt_dtype_name(s->d), s->a_col ? 'C' : 'R',
           s->b_col ? 'C' : 'R', (long long)s->m, (long long)s->n, (long long)s->k, (long long)s->batch, s->sa, s->sb,
           s->has_c ? " +C" : "", s->has_bias ? " +bias" : "", (int)s->desc.epilogue.act);
  tgs_case c;
  inputs_new(s, &c);
  const naive_in user = {s, &c};
  const double rb = s->d == SMELT_DTYPE_F64 ? 1e-12 : s->d == SMELT_DTYPE_F32 ? 1e-6 : bound_of(s);
  const int ok = tgs_check(&c, label, s->m * s->n * s->k <= NAIVE_MACS ? naive : NULL, &user, rb,
                           gpu ? th_cuda() : NULL, bound_of(s), fp8(s->d) ? -1.0 : 0);
  tgs_free(&c);
  return ok;
}

/* ---------------------------------------------------------------- CPU reference (and any device) */

/* Every input dtype family, every layout, each vector form, with and
 * without bias, C and an activation; odd sizes. */
static void test_dtypes_layouts(void) {
  static const smelt_dtype dts[][3] = {
      {SMELT_DTYPE_F64, SMELT_DTYPE_F64, SMELT_DTYPE_F64},   {SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32},
      {SMELT_DTYPE_F16, SMELT_DTYPE_F16, SMELT_DTYPE_F16},   {SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_F32},
      {SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16}, {SMELT_DTYPE_E5M2, SMELT_DTYPE_E4M3, SMELT_DTYPE_F16},
      {SMELT_DTYPE_I8, SMELT_DTYPE_I8, SMELT_DTYPE_F32},     {SMELT_DTYPE_F32, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16}};
  static const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 9}, {33, 17, 40}, {65, 31, 3}};
  for (int di = 0; di < 8; di++)
    for (int l = 0; l < 4; l++) {
      const int64_t *sh = shapes[(di + l) % 4];
      scase s = make(dts[di][0], dts[di][1], dts[di][2], sh[0], sh[1], sh[2]);
      s.a_col = l & 1;
      s.b_col = (l >> 1) & 1;
      s.sa = (di + l) % 4;
      s.sb = (di + 2 * l + 1) % 4;
      s.has_bias = l % 2 == 0;
      s.has_c = l == 3;
      s.desc.epilogue.beta = s.has_c ? 0.5 : 0.0;
      s.desc.epilogue.alpha = l == 1 ? 0.75 : 1.0;
      s.desc.epilogue.scale_a = fp8(s.a) ? 0.5f : 1.0f;
      s.desc.epilogue.scale_b = fp8(s.b) ? 2.0f : 1.0f;
      s.desc.epilogue.act = l == 2 ? SMELT_ACT_GELU : l == 3 ? SMELT_ACT_RELU : SMELT_ACT_IDENTITY;
      if (!check(&s, 1, "scales")) return;
    }
}

/* Batched (the vectors shared by every entry) and both split-K modes. */
static void test_modes(void) {
  for (int mi = 0; mi < 3; mi++) {
    scase s = make(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 37, 29, 300);
    s.b_col = 1;
    s.has_bias = 1;
    if (mi == 0) {
      s.batch = 3;
    } else {
      s.desc.mode = mi == 1 ? SMELT_GEMM_MODE_SPLIT_K_SERIAL : SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
      s.desc.split_k = 4;
    }
    s.sa = 1 + mi;
    s.sb = 3 - mi;
    if (!check(&s, 1, mi == 0 ? "scales batched" : "scales split-K")) return;
  }
}

/* ---------------------------------------------------------------- GPU kernels */

/* fp8 e4m3 RC on the Hopper kernel's wide tile (its only fp8 tile): the
 * fast epilogue in its unrolled form (bf16 D, identity; bias or not) and
 * its rolled one (GELU, scale_d; f16 D: fp8 takes the Hopper kernel only
 * for 16- and 8-bit D), the general epilogue (N of 13,
 * C, fp8 D), ragged M, N and K, a tile half past M, one row, more tiles
 * than SMs; then 16-bit types on the narrow (128 x 64), 64-row (64 x 64,
 * 64 x 128) and ping-pong (128 x 128: two row bands a consumer) tiles;
 * then a parallel split-K on the Hopper kernel (the slices without the
 * vectors, gemm_reduce with them). */
static void test_gpu_sm90(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  static const int64_t fshapes[][3] = {{129, 264, 200}, {1003, 1000, 40}, {60, 136, 130},
                                       {1, 40, 128},    {300, 520, 260},  {2100, 2304, 16}};
  for (int si = 0; si < 6; si++) {
    scase s = make_rc(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, si == 4 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16,
                      fshapes[si][0], fshapes[si][1], fshapes[si][2]);
    s.desc.tile.n = 256;
    s.kernel = "gemm_sm90_e4m3";
    s.has_bias = si % 2;
    s.sa = si == 3 ? 0 : 1 + si % 3;
    s.sb = si == 5 ? 0 : 1 + (si + 1) % 3;
    s.desc.epilogue.scale_a = 0.5f;
    s.desc.epilogue.alpha = 1.5;
    s.desc.epilogue.act = si == 2 ? SMELT_ACT_GELU : SMELT_ACT_IDENTITY;
    s.desc.epilogue.scale_d = si == 1 ? 0.25f : 1.0f;
    if (!check(&s, 1, "sm90 fp8 fast")) return;
  }
  static const int64_t gshapes[][3] = {{7, 13, 9}, {200, 264, 300}, {129, 136, 128}};
  for (int si = 0; si < 3; si++) {
    scase s = make_rc(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, si == 2 ? SMELT_DTYPE_E4M3 : SMELT_DTYPE_BF16,
                      gshapes[si][0], gshapes[si][1], gshapes[si][2]);
    s.desc.tile.n = 256;
    s.kernel = "gemm_sm90_e4m3";
    s.has_c = si == 1;
    s.desc.epilogue.beta = s.has_c ? 0.5 : 0.0;
    s.has_bias = 1;
    s.desc.epilogue.scale_d = si == 2 ? 4.0f : 1.0f;
    if (!check(&s, 1, "sm90 fp8 general")) return;
  }
  static const struct {
    int tm, tn;
    const char *kernel;
  } tiles[] = {{128, 64, "_128x64"}, {64, 64, "_64x64"}, {64, 128, "_64x128"}, {128, 128, "_pp"}};
  static const int64_t tshapes[][3] = {{129, 200, 70}, {1003, 1000, 40}, {60, 136, 100}, {65, 264, 256}};
  for (int ti = 0; ti < 4; ti++)
    for (int si = 0; si < 4; si++) {
      const smelt_dtype dt = (ti + si) % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
      scase s = make_rc(dt, dt, si == 2 ? SMELT_DTYPE_F32 : dt, tshapes[si][0], tshapes[si][1], tshapes[si][2]);
      s.desc.tile.m = tiles[ti].tm;
      s.desc.tile.n = tiles[ti].tn;
      s.kernel = tiles[ti].kernel;
      s.has_bias = si != 1;
      s.sa = 1 + (si + ti) % 3;
      s.sb = si == 3 ? 0 : 1 + si % 3;
      s.desc.epilogue.act = si == 1 ? SMELT_ACT_GELU : SMELT_ACT_IDENTITY;
      if (!check(&s, 1, "sm90 16-bit")) return;
    }
  for (int si = 0; si < 2; si++) {
    scase s = si ? make_rc(SMELT_DTYPE_E4M3, SMELT_DTYPE_E4M3, SMELT_DTYPE_BF16, 200, 516, 600)
                 : make_rc(SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 130, 264, 333);
    s.desc.tile.n = 256;
    s.kernel = "split-K";
    s.desc.mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
    s.desc.split_k = 3;
    s.has_bias = 1;
    if (!check(&s, 1, "sm90 split-K")) return;
  }
}

/* f16 on mma.sync (K tile 32: no Hopper tile has it), every layout, odd M
 * and N, plain and both split-K modes; f32 on SIMT. */
static void test_gpu_mma_simt(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  static const int64_t shapes[][3] = {{7, 13, 9}, {129, 131, 200}, {257, 75, 520}};
  for (int l = 0; l < 4; l++)
    for (int si = 0; si < 3; si++) {
      scase s = make(SMELT_DTYPE_F16, SMELT_DTYPE_F16, si == 1 ? SMELT_DTYPE_F32 : SMELT_DTYPE_F16, shapes[si][0],
                     shapes[si][1], shapes[si][2]);
      s.a_col = l & 1;
      s.b_col = (l >> 1) & 1;
      s.ld16 = 1;
      s.desc.math.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
      s.desc.tile.k = 32;
      s.kernel = "gemm_sm80";
      s.has_bias = si != 0;
      s.sa = 1 + (l + si) % 3;
      s.sb = 1 + (2 * l + si) % 3;
      if (si == 2) {
        s.desc.mode = l % 2 ? SMELT_GEMM_MODE_SPLIT_K_SERIAL : SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
        s.desc.split_k = 3;
      }
      if (!check(&s, 1, "mma.sync")) return;
    }
  scase s = make(SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 131, 67, 45);
  s.desc.math.opclass = SMELT_GEMM_OPCLASS_SIMT;
  s.kernel = "gemm_simt";
  s.has_bias = 1;
  s.sa = 3;
  s.sb = 2;
  check(&s, 1, "simt");
}

/* ---------------------------------------------------------------- grouped by offsets */

/* A [T, K] bf16, B [G, K, N] as the view of [G, N, K] (the Hopper kernel's
 * layout; 16-element K), D [T, N] bf16, sa [T], sb [G, N] (rows `sb_ld`
 * apart); groups from `offs`, rows past the last end untouched. */
static void offs_case(int64_t t, int64_t n, int64_t k, int64_t g, const int64_t *offs, int sb_ld_pad, int tile_n,
                      const char *kernel) {
  smelt_ctx *ctxs[2] = {th_cpu(), th_cuda()};
  const smelt_dtype dt = SMELT_DTYPE_BF16;
  const int64_t sa_shape[2] = {t, 1}, sa_str[2] = {1, 1}, sb_shape[2] = {g, n}, sb_str[2] = {n + sb_ld_pad, 1},
                a_shape[2] = {t, k}, a_str[2] = {k, 1}, b_shape[3] = {g, k, n}, b_str[3] = {n * k, 1, k},
                d_shape[2] = {t, n}, d_str[2] = {n, 1}, o_shape[1] = {g}, o_str[1] = {1};
  const th_view va = th_view_make(2, a_shape, a_str, 0), vb = th_view_make(3, b_shape, b_str, 0),
                vd = th_view_make(2, d_shape, d_str, 0), vsa = th_view_make(2, sa_shape, sa_str, 0),
                vsb = th_view_make(2, sb_shape, sb_str, 0), vo = th_view_make(1, o_shape, o_str, 0);
  void *a = tgs_filled(&va, dt, -1, 1), *b = tgs_filled(&vb, dt, -1, 1);
  float *sa = (float *)tgs_filled(&vsa, SMELT_DTYPE_F32, -3, 3),
        *sb = (float *)tgs_filled(&vsb, SMELT_DTYPE_F32, 0.1, 2);
  /* As large as tgs_upload() reads: the view's storage and one more. */
  int64_t *o = (int64_t *)calloc((size_t)(vo.storage + 1), sizeof(int64_t));
  memcpy(o, offs, sizeof(int64_t) * (size_t)g);
  double *ref = (double *)malloc(sizeof(double) * (size_t)(t * n + 1)),
         *got[2] = {(double *)malloc(sizeof(double) * (size_t)(t * n + 1)),
                    (double *)malloc(sizeof(double) * (size_t)(t * n + 1))};
  int64_t prev = 0, last = 0;
  for (int64_t gi = 0; gi < g; gi++) {
    const int64_t end = o[gi] > prev ? (o[gi] < t ? o[gi] : t) : prev;
    for (int64_t r = prev; r < end; r++)
      for (int64_t j = 0; j < n; j++) {
        double acc = 0;
        for (int64_t kk = 0; kk < k; kk++)
          acc += th_get(a, dt, r * k + kk) * th_get(b, dt, gi * n * k + j * k + kk);
        ref[r * n + j] = tgs_stored(acc * sa[r] * sb[gi * (n + sb_ld_pad) + j], dt);
      }
    prev = last = end;
  }
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.tile.n = tile_n;
  const th_view views[TGS_ON] = {va, vb, vsa, vsb, vo};
  void *const host[TGS_ON] = {a, b, sa, sb, o};
  const smelt_dtype dts[TGS_ON] = {dt, dt, SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_I64};
  for (int ci = 0; ci < 2 && ctxs[ci]; ci++) {
    const smelt_status st = tgs_run_offs(ctxs[ci], &desc, views, host, dts, &vd, dt, last, kernel, got[ci]);
    const smelt__bound_query q = {.family = "gemm", .dtype = dt, .dt_a = dt, .gemm = &desc};
    const char *what = ci ? "grouped offs cuda vs cpu" : "grouped offs cpu vs naive";
    if (st != SMELT_OK)
      th_fail(__FILE__, __LINE__, "%s: %s (%s)", what, smelt_status_name(st), smelt_last_error());
    else if (!th_compare(what, got[ci], ci ? got[0] : ref, last * n, smelt__error_bound(&q), 0))
      th_fail(__FILE__, __LINE__, "%s", what);
  }
  free(a);
  free(b);
  free(sa);
  free(sb);
  free(o);
  free(ref);
  free(got[0]);
  free(got[1]);
}

/* Uneven and empty groups, rows past the last end; on a GPU the SIMT or
 * mma.sync kernel (the selector's pick) and, on Hopper, the wgmma kernel's
 * fast epilogue with the group's row of sb. */
static void test_grouped_offs(void) {
  static const int64_t offs[] = {5, 5, 70, 69, 200, 290};
  offs_case(300, 72, 48, 6, offs, 3, 0, NULL);
  if (th_cuda_sm90()) {
    static const int64_t big[] = {0, 300, 300, 800, 1100};
    offs_case(1200, 392, 64, 5, big, 8, 256, "gemm_sm90");
  }
}

/* ---------------------------------------------------------------- bad inputs */

/* Wrong dtype, shape or device of a vector, a vector over D, a run that
 * does not match its plan: each fails with a message naming the vector,
 * and D keeps its poison. */
static void test_bad_inputs(void) {
  smelt_ctx *cpu = th_cpu();
  const int64_t M = 5, N = 6, K = 4;
  th_buf A = th_buf_new(cpu, M * K * 4), B = th_buf_new(cpu, K * N * 4), D = th_buf_new(cpu, M * N * 4),
         V = th_buf_new(cpu, 64 * 4);
  memset(A.data, 0, A.bytes);
  memset(B.data, 0, B.bytes);
  memset(V.data, 0, V.bytes);
  const int64_t sa_[2] = {M, K}, sb_[2] = {K, N}, sd_[2] = {M, N}, vm[1] = {M}, vn[1] = {N}, vm1[2] = {M, 1},
                vn1[2] = {N, 1};
  const smelt_tensor ta = smelt_tensor_make(A.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sa_),
                     tb = smelt_tensor_make(B.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sb_),
                     td = smelt_tensor_make(D.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sd_);
  const smelt_tensor good_a = smelt_tensor_make(V.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, vm),
                     good_b = smelt_tensor_make((float *)V.data + 32, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, vn);
  smelt_tensor f16_a = good_a, long_a = good_a, col_b = smelt_tensor_make(good_b.data, SMELT_DTYPE_F32,
                                                                           SMELT_DEVICE_CPU, 0, 2, vn1),
               cuda_b = good_b, over_a = smelt_tensor_make(D.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, vm1);
  f16_a.dtype = SMELT_DTYPE_F16;
  long_a.shape[0] = M + 1;
  cuda_b.device = SMELT_DEVICE_CUDA;
  const struct {
    smelt_gemm_scales sc;
    smelt_status want;
    const char *msg;
  } bad[] = {
      {{&f16_a, &good_b}, SMELT_STATUS_DTYPE_MISMATCH, "scales->a"},
      {{&long_a, NULL}, SMELT_STATUS_SHAPE_MISMATCH, "scales->a.shape=[6] must be [M]=[5] or [M, 1]"},
      {{NULL, &col_b}, SMELT_STATUS_SHAPE_MISMATCH, "scales->b.shape=[6, 1] must be [N]=[6] or [1, N]"},
      {{&good_a, &cuda_b}, SMELT_STATUS_WRONG_DEVICE, "scales->b is on cuda:0 but the context is on cpu"},
      {{&over_a, &good_b}, SMELT_STATUS_INVALID_ARGUMENT, "D overlaps scales->a"},
  };
  for (int i = 0; i < 5; i++) {
    smelt_plan *plan = NULL;
    CHECK_STATUS(smelt_gemm_scaled_plan(cpu, NULL, &ta, &tb, NULL, &td, NULL, &bad[i].sc, &plan), bad[i].want);
    CHECK_MSG(bad[i].msg);
    CHECK(plan == NULL);
    CHECK_STATUS(smelt_gemm_scaled(cpu, NULL, &ta, &tb, NULL, &td, NULL, &bad[i].sc), bad[i].want);
    CHECK(th_buf_untouched(&D));
  }
  /* Runs must bind the planned vectors: present, absent, same shape. */
  const smelt_gemm_scales both = {&good_a, &good_b}, only_a = {&good_a, NULL};
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_gemm_scaled_plan(cpu, NULL, &ta, &tb, NULL, &td, NULL, &both, &plan));
  CHECK(smelt_gemm_run(plan, &ta, &tb, NULL, &td, NULL) != SMELT_OK);
  CHECK_MSG("scales->a");
  CHECK(smelt_gemm_scaled_run(plan, &ta, &tb, NULL, &td, NULL, &only_a) != SMELT_OK);
  CHECK_MSG("scales->b");
  smelt_plan_destroy(plan);
  plan = NULL;
  CHECK_OK(smelt_gemm_plan(cpu, NULL, &ta, &tb, NULL, &td, NULL, &plan));
  CHECK(smelt_gemm_scaled_run(plan, &ta, &tb, NULL, &td, NULL, &both) != SMELT_OK);
  CHECK_MSG("scales->a");
  smelt_plan_destroy(plan);
  CHECK(th_buf_untouched(&D));
  /* Grouped by offsets: B's scales are [G, N]. */
  const int64_t b3[3] = {2, K, N}, g1[1] = {2};
  th_buf B3 = th_buf_new(cpu, 2 * K * N * 4), O = th_buf_new(cpu, 2 * 4);
  memset(B3.data, 0, B3.bytes);
  memset(O.data, 0, O.bytes);
  const smelt_tensor tb3 = smelt_tensor_make(B3.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, b3),
                     to = smelt_tensor_make(O.data, SMELT_DTYPE_I32, SMELT_DEVICE_CPU, 0, 1, g1);
  CHECK_STATUS(smelt_gemm_grouped_offs_scaled(cpu, NULL, &ta, &tb3, NULL, &td, NULL, &to, &both),
               SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("scales->b.shape=[6] must be [G, N]=[2, 6]");
  CHECK(th_buf_untouched(&D));
  th_buf_free(&B3);
  th_buf_free(&O);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
  th_buf_free(&V);
}

const th_test th_tests_gemm_scales[] = {
    {"dtypes_layouts", test_dtypes_layouts},
    {"modes", test_modes},
    {"grouped_offs", test_grouped_offs},
    {"bad_inputs", test_bad_inputs},
    {"gpu_sm90", test_gpu_sm90},
    {"gpu_mma_simt", test_gpu_mma_simt},
    {0, 0},
};
