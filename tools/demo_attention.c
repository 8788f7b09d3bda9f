/* Demo section: self-attention over the demo's tokens, q, k, v [batch, seq,
 * heads, head_dim] in bf16 with heads x head_dim = d_model (head_dim 128
 * when d_model allows, else 64): smelt's fused attention (forward full and
 * causal, backward causal) against naive attention, the textbook algorithm
 * that materializes the score matrix S = scale q k^T and P = softmax(S) of
 * batch x heads x seq x seq elements before O = P v.
 *
 * On CUDA the naive attention is built from smelt's own unfused ops, as a
 * framework runs it: per batch element, S = scale q k^T as a batched GEMM
 * over heads into a [B, H, seq, seq] bf16 buffer (causal: the GEMM's C is a
 * [seq, seq] mask of 0 and -inf broadcast over heads, beta 1), P = softmax(S)
 * into a second one, then O = P v as a second batched GEMM. On the CPU backend it is a
 * host loop in f32. The fused kernels never hold S: their pool peak (inputs
 * and outputs, plus the backward's f32 dq workspace) stays linear in seq,
 * where the naive one grows with seq^2.
 *
 * Results are checked against the CPU backend (double precision) on a slice:
 * batch 0, heads 0 and H-1, the last rows (which see every key, so the slice
 * keeps the full problem's mask unchanged). The CPU backend is itself a
 * naive reference and slow, so there the problem is clamped to a size that
 * runs in a blink. */
#include "demo.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* CPU backend: at most this batch, sequence length and heads. */
enum { CPU_MAX_B = 1, CPU_MAX_S = 128, CPU_MAX_H = 2 };
/* Rows of the checked slice (the last ones of each checked head). */
enum { CHECK_ROWS = 64 };
/* Host runs of the naive attention (the CPU backend only). */
enum { NAIVE_WARMUP = 1, NAIVE_ITERS = 3 };

typedef struct attn_case {
  cli_demo_env *env;
  int64_t B, S, H, D;
  void *q, *k, *v, *o, *lse, *d_o, *dq, *dk, *dv; /* device */
  int causal, bwd;
  smelt_plan *plan;
} attn_case;

static smelt_tensor t4(smelt_ctx *ctx, void *p, const attn_case *c) {
  int64_t shape[4] = {c->B, c->S, c->H, c->D};
  return smelt_tensor_make(p, SMELT_DTYPE_BF16, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), 4, shape);
}

static smelt_tensor t_lse(smelt_ctx *ctx, void *p, const attn_case *c) {
  int64_t shape[3] = {c->B, c->H, c->S};
  return smelt_tensor_make(p, SMELT_DTYPE_F32, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), 3, shape);
}

static void run_case(void *user, int iter) {
  attn_case *c = user;
  smelt_ctx *ctx = c->env->ctx;
  (void)iter;
  smelt_tensor q = t4(ctx, c->q, c), k = t4(ctx, c->k, c), v = t4(ctx, c->v, c), o = t4(ctx, c->o, c);
  smelt_tensor lse = t_lse(ctx, c->lse, c);
  smelt_attention_desc d = smelt_attention_desc_default();
  d.causal = c->causal;
  if (!c->bwd) {
    if (!c->plan) CLI_TRY(smelt_attention_fwd_plan(ctx, &d, &q, &k, &v, &o, &lse, &c->plan));
    CLI_TRY(smelt_attention_fwd_run(c->plan, &q, &k, &v, &o, &lse));
    return;
  }
  smelt_tensor d_o = t4(ctx, c->d_o, c), dq = t4(ctx, c->dq, c), dk = t4(ctx, c->dk, c), dv = t4(ctx, c->dv, c);
  if (!c->plan) CLI_TRY(smelt_attention_bwd_plan(ctx, &d, &q, &k, &v, &o, &d_o, &lse, &dq, &dk, &dv, &c->plan));
  CLI_TRY(smelt_attention_bwd_run(c->plan, &q, &k, &v, &o, &d_o, &lse, &dq, &dk, &dv));
}

/* Rows [r0, S) of head h, batch 0, of a host bf16 [B, S, H, D] tensor as doubles. */
static double *rows_of(const uint16_t *src, const attn_case *c, int64_t h, int64_t r0) {
  const int64_t n = (c->S - r0) * c->D;
  double *out = cli_malloc((size_t)n * sizeof *out);
  for (int64_t r = r0; r < c->S; r++)
    for (int64_t d = 0; d < c->D; d++)
      out[(r - r0) * c->D + d] = smelt_bf16_to_f32(src[(r * c->H + h) * c->D + d]);
  return out;
}

/* The CPU backend's O (or dq, with the backward) for the last rows of
 * heads 0 and H-1 of batch 0, stacked [heads][rows][D], in double. The
 * backward reads the device's O and LSE, as the device's backward did. */
static double *reference(const attn_case *c, const uint16_t *hq, const uint16_t *hk, const uint16_t *hv,
                         const uint16_t *ho, const float *hlse, const uint16_t *hdo, int nh, int64_t r0) {
  const int64_t rows = c->S - r0, S = c->S, D = c->D;
  double *ref = cli_malloc((size_t)(nh * rows * D) * sizeof *ref);
  for (int i = 0; i < nh; i++) {
    const int64_t h = i ? c->H - 1 : 0;
    double *q = rows_of(hq, c, h, r0), *k = rows_of(hk, c, h, 0), *v = rows_of(hv, c, h, 0);
    int64_t qs[4] = {1, rows, 1, D}, ks[4] = {1, S, 1, D}, ls[3] = {1, 1, rows};
    smelt_tensor tq = smelt_tensor_make(q, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, 4, qs);
    smelt_tensor tk = smelt_tensor_make(k, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, 4, ks);
    smelt_tensor tv = smelt_tensor_make(v, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, 4, ks);
    smelt_tensor tr = smelt_tensor_make(ref + i * rows * D, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, 4, qs);
    smelt_attention_desc d = smelt_attention_desc_default();
    d.causal = c->causal;
    if (!c->bwd) {
      CLI_TRY(smelt_attention_fwd(c->env->cpu, &d, &tq, &tk, &tv, &tr, NULL));
    } else {
      double *o = rows_of(ho, c, h, r0), *d_o = rows_of(hdo, c, h, r0);
      double *dk = cli_malloc((size_t)(S * D) * sizeof *dk), *dv = cli_malloc((size_t)(S * D) * sizeof *dv);
      float *lse = cli_malloc((size_t)rows * sizeof *lse);
      for (int64_t r = 0; r < rows; r++) lse[r] = hlse[h * S + r0 + r];
      smelt_tensor to = smelt_tensor_make(o, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, 4, qs);
      smelt_tensor tdo = smelt_tensor_make(d_o, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, 4, qs);
      smelt_tensor tl = smelt_tensor_make(lse, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, ls);
      smelt_tensor tdk = smelt_tensor_make(dk, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, 4, ks);
      smelt_tensor tdv = smelt_tensor_make(dv, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, 4, ks);
      CLI_TRY(smelt_attention_bwd(c->env->cpu, &d, &tq, &tk, &tv, &to, &tdo, &tl, &tr, &tdk, &tdv));
      free(o);
      free(d_o);
      free(dk);
      free(dv);
      free(lse);
    }
    free(q);
    free(k);
    free(v);
  }
  return ref;
}

/* The same slice of a host bf16 [B, S, H, D] result, stacked as reference(). */
static double *slice_of(const uint16_t *x, const attn_case *c, int nh, int64_t r0) {
  const int64_t rows = c->S - r0, D = c->D;
  double *out = cli_malloc((size_t)(nh * rows * D) * sizeof *out);
  for (int i = 0; i < nh; i++) {
    double *part = rows_of(x, c, i ? c->H - 1 : 0, r0);
    memcpy(out + i * rows * D, part, (size_t)(rows * D) * sizeof *out);
    free(part);
  }
  return out;
}

/* Naive attention on the host in f32: S and P of B x H x S x S floats
 * materialized, as a framework's unfused attention keeps them. o is [B, S,
 * H, D] f32; the scores buffer is the caller's (its size is the point). */
static void naive_attention(const attn_case *c, const float *q, const float *k, const float *v, float *scores,
                            float *o) {
  const int64_t B = c->B, S = c->S, H = c->H, D = c->D;
  const float scale = 1.0f / sqrtf((float)D);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      float *sm = scores + (b * H + h) * S * S;
      for (int64_t i = 0; i < S; i++) {
        const float *qi = q + ((b * S + i) * H + h) * D;
        float m = -INFINITY;
        for (int64_t j = 0; j < S; j++) {
          const float *kj = k + ((b * S + j) * H + h) * D;
          float s = 0;
          for (int64_t d = 0; d < D; d++) s += qi[d] * kj[d];
          sm[i * S + j] = c->causal && j > i ? -INFINITY : scale * s;
          if (sm[i * S + j] > m) m = sm[i * S + j];
        }
        float l = 0;
        for (int64_t j = 0; j < S; j++) l += (sm[i * S + j] = expf(sm[i * S + j] - m));
        for (int64_t j = 0; j < S; j++) sm[i * S + j] /= l;
      }
      for (int64_t i = 0; i < S; i++) {
        float *oi = o + ((b * S + i) * H + h) * D;
        for (int64_t d = 0; d < D; d++) oi[d] = 0;
        for (int64_t j = 0; j < S; j++) {
          const float p = sm[i * S + j], *vj = v + ((b * S + j) * H + h) * D;
          for (int64_t d = 0; d < D; d++) oi[d] += p * vj[d];
        }
      }
    }
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The naive row (host; CPU backend only): time, error on the slice, memory. */
static void naive_row(cli_demo_env *env, const attn_case *c, const uint16_t *hq, const uint16_t *hk,
                      const uint16_t *hv, const double *ref, int nh, int64_t r0, double bytes) {
  const size_t n = (size_t)(c->B * c->S * c->H * c->D), ns = (size_t)(c->B * c->H * c->S * c->S);
  float *q = cli_malloc(n * sizeof *q), *k = cli_malloc(n * sizeof *k), *v = cli_malloc(n * sizeof *v);
  float *o = cli_malloc(n * sizeof *o), *scores = cli_malloc(ns * sizeof *scores);
  for (size_t i = 0; i < n; i++) {
    q[i] = smelt_bf16_to_f32(hq[i]);
    k[i] = smelt_bf16_to_f32(hk[i]);
    v[i] = smelt_bf16_to_f32(hv[i]);
  }
  double ms[NAIVE_ITERS];
  for (int i = 0; i < NAIVE_WARMUP + NAIVE_ITERS; i++) {
    const double t0 = cli_now_seconds();
    naive_attention(c, q, k, v, scores, o);
    if (i >= NAIVE_WARMUP) ms[i - NAIVE_WARMUP] = 1e3 * (cli_now_seconds() - t0);
  }
  qsort(ms, NAIVE_ITERS, sizeof ms[0], cmp_double);
  cli_timing t = {ms[NAIVE_ITERS / 2], ms[0], NAIVE_ITERS};
  const int64_t rows = c->S - r0;
  double *got = cli_malloc((size_t)(nh * rows * c->D) * sizeof *got);
  for (int i = 0; i < nh; i++)
    for (int64_t r = 0; r < rows; r++)
      for (int64_t d = 0; d < c->D; d++)
        got[(i * rows + r) * c->D + d] = o[((r0 + r) * c->H + (i ? c->H - 1 : 0)) * c->D + d];
  cli_diff df = cli_compare(got, ref, SMELT_DTYPE_F64, (size_t)(nh * rows * c->D));
  char note[160], mem[32];
  snprintf(note, sizeof note, "host f32 loops; S (softmaxed in place to P) held: %s", cli_fmt_bytes(ns * sizeof(float), mem, sizeof mem));
  cli_demo_row(env, c->causal ? "naive causal" : "naive full", &df,
               cli_demo_bound(&df, "attention", SMELT_DTYPE_F32), c->D, &t, bytes, note);
  free(q);
  free(k);
  free(v);
  free(o);
  free(scores);
  free(got);
}

/* The naive attention on the device from smelt's unfused ops (see the top
 * of the file): plans for one batch element, reused for each. */
typedef struct naive_gpu {
  const attn_case *c;
  void *scores, *probs, *mask, *o;
  smelt_plan *qk, *pv, *sm;
} naive_gpu;

/* Head-major [H, rows, cols] views of one batch element: `x` is a [B, S, H,
 * D] tensor's batch element (row stride H*D, head stride D), `s` the
 * scores [H, S, S] (contiguous), `k_t` k's element as k^T [H, D, S]. */
static smelt_tensor heads_view(smelt_ctx *ctx, void *p, const attn_case *c, int kind) {
  int64_t shape[3], strides[3];
  if (kind == 0) { /* q, v or o: [H, S, D] */
    shape[0] = c->H, shape[1] = c->S, shape[2] = c->D;
    strides[0] = c->D, strides[1] = c->H * c->D, strides[2] = 1;
  } else if (kind == 1) { /* k^T: [H, D, S] */
    shape[0] = c->H, shape[1] = c->D, shape[2] = c->S;
    strides[0] = c->D, strides[1] = 1, strides[2] = c->H * c->D;
  } else { /* scores [H, S, S]; kind 3: the mask, one [S, S] for every head */
    shape[0] = c->H, shape[1] = c->S, shape[2] = c->S;
    strides[0] = kind == 3 ? 0 : c->S * c->S, strides[1] = c->S, strides[2] = 1;
  }
  smelt_tensor t = smelt_tensor_make(p, SMELT_DTYPE_BF16, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), 3, shape);
  for (int i = 0; i < 3; i++) t.strides[i] = strides[i];
  return t;
}

static void naive_gpu_run(void *user, int iter) {
  naive_gpu *n = user;
  const attn_case *c = n->c;
  smelt_ctx *ctx = c->env->ctx;
  (void)iter;
  const size_t es = sizeof(uint16_t), elem = (size_t)(c->S * c->H * c->D), sq = (size_t)(c->H * c->S * c->S);
  smelt_gemm_desc qk = smelt_gemm_desc_default(), pv = smelt_gemm_desc_default();
  qk.epilogue.alpha = 1.0 / sqrt((double)c->D);
  qk.epilogue.beta = c->causal ? 1.0 : 0.0;
  for (int64_t b = 0; b < c->B; b++) {
    char *s = (char *)n->scores + (size_t)b * sq * es, *p = (char *)n->probs + (size_t)b * sq * es;
    smelt_tensor q = heads_view(ctx, (char *)c->q + (size_t)b * elem * es, c, 0);
    smelt_tensor kt = heads_view(ctx, (char *)c->k + (size_t)b * elem * es, c, 1);
    smelt_tensor v = heads_view(ctx, (char *)c->v + (size_t)b * elem * es, c, 0);
    smelt_tensor o = heads_view(ctx, (char *)n->o + (size_t)b * elem * es, c, 0);
    smelt_tensor ts = heads_view(ctx, s, c, 2), tp = heads_view(ctx, p, c, 2), mask = heads_view(ctx, n->mask, c, 3);
    const smelt_tensor *cm = c->causal ? &mask : NULL;
    if (!n->qk) CLI_TRY(smelt_gemm_plan(ctx, &qk, &q, &kt, cm, &ts, NULL, &n->qk));
    CLI_TRY(smelt_gemm_run(n->qk, &q, &kt, cm, &ts, NULL));
    int64_t rows[2] = {c->H * c->S, c->S};
    smelt_tensor fs = smelt_tensor_make(s, SMELT_DTYPE_BF16, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), 2, rows),
                 fp = smelt_tensor_make(p, SMELT_DTYPE_BF16, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), 2, rows);
    if (!n->sm) CLI_TRY(smelt_softmax_plan(ctx, &fs, &fp, NULL, &n->sm));
    CLI_TRY(smelt_softmax_run(n->sm, &fs, &fp, NULL));
    if (!n->pv) CLI_TRY(smelt_gemm_plan(ctx, &pv, &tp, &v, NULL, &o, NULL, &n->pv));
    CLI_TRY(smelt_gemm_run(n->pv, &tp, &v, NULL, &o, NULL));
  }
}

/* The naive row on CUDA: time, error on the slice, pool peak (S and P for
 * the whole batch, as a framework holds them, and the mask). */
static void naive_gpu_row(cli_demo_env *env, const attn_case *c, const double *ref, int nh, int64_t r0,
                          double bytes) {
  smelt_ctx *ctx = env->ctx;
  const size_t es = sizeof(uint16_t), n = (size_t)(c->B * c->S * c->H * c->D);
  const size_t ns = (size_t)(c->B * c->H * c->S * c->S), nm = (size_t)(c->S * c->S);
  naive_gpu g;
  memset(&g, 0, sizeof g);
  g.c = c;
  smelt_pool_stats before, after;
  CLI_TRY(smelt_ctx_synchronize(ctx));
  CLI_TRY(smelt_pool_reset_peak(ctx));
  CLI_TRY(smelt_pool_stats_get(ctx, &before));
  g.scores = cli_dev_alloc(ctx, ns * es);
  g.probs = cli_dev_alloc(ctx, ns * es);
  g.o = cli_dev_alloc(ctx, n * es);
  if (c->causal) { /* bottom-right alignment with seq_q == seq_k: key j is seen by rows i >= j */
    uint16_t *hm = cli_malloc(nm * es);
    for (int64_t i = 0; i < c->S; i++)
      for (int64_t j = 0; j < c->S; j++) hm[i * c->S + j] = j > i ? 0xFF80u /* bf16 -inf */ : 0;
    g.mask = cli_dev_upload(ctx, hm, nm * es);
    free(hm);
  }
  naive_gpu_run(&g, 0);
  CLI_TRY(smelt_ctx_synchronize(ctx));
  uint16_t *res = cli_malloc(n * es);
  cli_dev_download(ctx, res, g.o, n * es);
  double *got = slice_of(res, c, nh, r0);
  const int64_t rows = c->S - r0;
  cli_diff df = cli_compare(got, ref, SMELT_DTYPE_F64, (size_t)(nh * rows * c->D));
  cli_timing t = cli_time_runs(ctx, env->warmup, env->iters, naive_gpu_run, &g);
  CLI_TRY(smelt_pool_stats_get(ctx, &after));
  char note[320], peak[32], ws[32], sb[32];
  snprintf(note, sizeof note, "smelt gemm + softmax + gemm, S and P held (%s each, bf16); pool peak %s (workspace %s)",
           cli_fmt_bytes(ns * es, sb, sizeof sb), cli_fmt_bytes(after.peak, peak, sizeof peak),
           cli_fmt_bytes(after.peak - before.used, ws, sizeof ws));
  /* bf16 S and P: each rounding of the scores shows in O. */
  const double bound = 4 * cli_demo_bound(&df, "attention", SMELT_DTYPE_BF16);
  cli_demo_row(env, c->causal ? "naive causal" : "naive full", &df, bound, c->D, &t, bytes, note);
  smelt_plan_destroy(g.qk);
  smelt_plan_destroy(g.pv);
  smelt_plan_destroy(g.sm);
  CLI_TRY(smelt_free(ctx, g.scores));
  CLI_TRY(smelt_free(ctx, g.probs));
  CLI_TRY(smelt_free(ctx, g.o));
  if (g.mask) CLI_TRY(smelt_free(ctx, g.mask));
  free(res);
  free(got);
}

void cli_demo_attention(cli_demo_env *env) {
  const int cpu = smelt_ctx_device(env->ctx) == SMELT_DEVICE_CPU;
  const int64_t D = env->d_model % 128 == 0 ? 128 : env->d_model % 64 == 0 ? 64 : 0;
  attn_case base;
  memset(&base, 0, sizeof base);
  base.env = env;
  base.B = env->batch;
  base.S = env->seq;
  base.D = D;
  base.H = D ? env->d_model / D : 0;
  if (cpu) {
    base.B = base.B < CPU_MAX_B ? base.B : CPU_MAX_B;
    base.S = base.S < CPU_MAX_S ? base.S : CPU_MAX_S;
    base.H = base.H < CPU_MAX_H ? base.H : CPU_MAX_H;
  }
  const int clamped = base.B != env->batch || base.S != env->seq || base.H * D != env->d_model;
  char shapes[192];
  if (D)
    snprintf(shapes, sizeof shapes, "q, k, v, o [%lld, %lld, %lld, %lld] (batch, seq, heads, head_dim), bf16%s",
             (long long)base.B, (long long)base.S, (long long)base.H, (long long)D,
             cpu && clamped ? " (clamped on the CPU backend)" : "");
  else
    snprintf(shapes, sizeof shapes, "d_model %lld", (long long)env->d_model);
  cli_demo_table("attention (fused, vs naive)", shapes);
  if (!D) {
    printf("  skipped: d_model %lld is not a multiple of 64 (head_dim 64 or 128)\n", (long long)env->d_model);
    return;
  }

  const size_t n = (size_t)(base.B * base.S * base.H * D), es = sizeof(uint16_t);
  const size_t nl = (size_t)(base.B * base.H * base.S);
  uint16_t *hq = cli_malloc(n * es), *hk = cli_malloc(n * es), *hv = cli_malloc(n * es), *hdo = cli_malloc(n * es);
  uint16_t *hres = cli_malloc(n * es);
  float *hlse = cli_malloc(nl * sizeof *hlse);
  cli_fill_uniform(hq, SMELT_DTYPE_BF16, n, 0x5EED0601u, -2.0, 2.0);
  cli_fill_uniform(hk, SMELT_DTYPE_BF16, n, 0x5EED0602u, -2.0, 2.0);
  cli_fill_uniform(hv, SMELT_DTYPE_BF16, n, 0x5EED0603u, -1.0, 1.0);
  cli_fill_uniform(hdo, SMELT_DTYPE_BF16, n, 0x5EED0604u, -1.0, 1.0);

  attn_case c = base;
  c.q = cli_dev_upload(env->ctx, hq, n * es);
  c.k = cli_dev_upload(env->ctx, hk, n * es);
  c.v = cli_dev_upload(env->ctx, hv, n * es);
  c.d_o = cli_dev_upload(env->ctx, hdo, n * es);
  c.o = cli_dev_alloc(env->ctx, n * es);
  c.lse = cli_dev_alloc(env->ctx, nl * sizeof(float));
  c.dq = cli_dev_alloc(env->ctx, n * es);
  c.dk = cli_dev_alloc(env->ctx, n * es);
  c.dv = cli_dev_alloc(env->ctx, n * es);

  const int nh = base.H > 1 ? 2 : 1;
  const int64_t r0 = base.S > CHECK_ROWS ? base.S - CHECK_ROWS : 0, rows = base.S - r0;
  const double io_fwd = (double)(4 * n * es + nl * sizeof(float)), io_bwd = (double)(8 * n * es + nl * sizeof(float));
  static const struct {
    const char *label;
    int causal, bwd;
  } cases[] = {{"fused fwd full", 0, 0}, {"fused fwd causal", 1, 0}, {"fused bwd causal", 1, 1}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    c.causal = cases[i].causal;
    c.bwd = cases[i].bwd;
    c.plan = NULL;
    smelt_pool_stats before, after;
    CLI_TRY(smelt_ctx_synchronize(env->ctx));
    CLI_TRY(smelt_pool_reset_peak(env->ctx));
    CLI_TRY(smelt_pool_stats_get(env->ctx, &before));
    run_case(&c, 0);
    CLI_TRY(smelt_ctx_synchronize(env->ctx));
    double *ref = reference(&c, hq, hk, hv, hres, hlse, hdo, nh, r0);
    uint16_t *res = cli_malloc(n * es);
    cli_dev_download(env->ctx, res, c.bwd ? c.dq : c.o, n * es);
    double *got = slice_of(res, &c, nh, r0);
    cli_diff df = cli_compare(got, ref, SMELT_DTYPE_F64, (size_t)(nh * rows * D));
    cli_timing t = cli_time_runs(env->ctx, env->warmup, env->iters, run_case, &c);
    CLI_TRY(smelt_pool_stats_get(env->ctx, &after));
    if (!c.bwd && c.causal) { /* the backward's O and LSE: this forward's (o and lse keep them) */
      cli_dev_download(env->ctx, hres, c.o, n * es);
      cli_dev_download(env->ctx, hlse, c.lse, nl * sizeof(float));
    }
    const double pairs = c.causal ? 0.5 : 1.0;
    const double flops = (c.bwd ? 2.5 : 1.0) * 4.0 * pairs * (double)(base.B * base.H * D) * (double)base.S * (double)base.S;
    const double tf = t.median_ms > 0 ? flops / (t.median_ms * 1e-3) / 1e12 : 0.0;
    char note[320], peak[32], ws[32];
    /* The CPU backend has no device pool: the peak is a CUDA figure. */
    if (cpu)
      snprintf(note, sizeof note, "%.2f %s; %s", tf >= 0.1 ? tf : tf * 1e3, tf >= 0.1 ? "TFLOP/s" : "GFLOP/s",
               smelt_plan_describe(c.plan));
    else
      snprintf(note, sizeof note, "%.2f %s; pool peak %s (workspace %s); %s", tf >= 0.1 ? tf : tf * 1e3,
               tf >= 0.1 ? "TFLOP/s" : "GFLOP/s", cli_fmt_bytes(after.peak, peak, sizeof peak),
               cli_fmt_bytes(after.peak - before.used, ws, sizeof ws), smelt_plan_describe(c.plan));
    /* bf16 results: about two roundings of the output's magnitude. */
    const double bound = cli_demo_bound(&df, "attention", SMELT_DTYPE_BF16);
    cli_demo_row(env, cases[i].label, &df, bound, D, &t, c.bwd ? io_bwd : io_fwd,
                 note);
    if (!c.bwd && cpu) naive_row(env, &c, hq, hk, hv, ref, nh, r0, io_fwd);
    if (!c.bwd && !cpu) naive_gpu_row(env, &c, ref, nh, r0, io_fwd);
    smelt_plan_destroy(c.plan);
    free(ref);
    free(res);
    free(got);
  }
  void *bufs[] = {c.q, c.k, c.v, c.d_o, c.o, c.lse, c.dq, c.dk, c.dv};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CLI_TRY(smelt_free(env->ctx, bufs[i]));
  free(hq);
  free(hk);
  free(hv);
  free(hdo);
  free(hres);
  free(hlse);
}
