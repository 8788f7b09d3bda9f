/* Demo section: a transformer MLP's up-projection, h = gelu(x W^T + b), with
 * x [tokens, d_model], W [4 d_model, d_model] as a linear layer stores it,
 * b [4 d_model] and h [tokens, 4 d_model], all bf16. Fused, it is one GEMM
 * whose epilogue adds the bias and applies GELU before h is stored; unfused,
 * the GEMM stores x W^T + b (the library has no elementwise add, so the bias
 * stays in the GEMM) and a second pass, smelt_activation, reads h back and
 * applies GELU in place. The difference is one round trip of h through
 * memory, which the fused row saves.
 *
 * Both are checked against the CPU backend on windows of h (the first and the
 * last rows and columns; the naive reference is too slow for all of it), and
 * against each other on all of h: they differ by one extra bf16 rounding.
 * The CPU backend is the reference itself and slow, so there the problem is
 * clamped to a size that runs in a blink. */
#include "demo.h"

#include <math.h>
#include <stdlib.h>

/* CPU backend: at most this many rows and this d_model (N = 4 d_model). */
enum { CPU_MAX_ROWS = 64, CPU_MAX_D = 128 };
/* Reference windows: rows and columns at each end of h. */
enum { WIN_ROWS = 16, WIN_COLS = 256 };
/* Elements of W above which the section is skipped (1 GiB of bf16). */
#define MAX_W_ELEMS ((int64_t)1 << 29)
/* Elements of h compared between fused and unfused at most (first rows). */
#define MAX_DIFF_ELEMS ((int64_t)1 << 26)

typedef struct gemm_case {
  cli_demo_env *env;
  int64_t m, n, k;
  void *x, *w, *bias, *h; /* device: [m, k], [n, k], [n], [m, n] */
  int fused;
  smelt_plan *gemm[2], *act[2]; /* per block slot; act only when unfused */
} gemm_case;

/* W [n, k] row-major seen as B [k, n]: column-major. */
static smelt_tensor weight_view(smelt_ctx *ctx, void *w, int64_t k, int64_t n) {
  int64_t shape[2] = {k, n};
  smelt_tensor t = smelt_tensor_make(w, SMELT_DTYPE_BF16, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), 2, shape);
  t.strides[0] = 1;
  t.strides[1] = k;
  return t;
}

static void run_block(void *user, int64_t row0, int64_t rows, int slot) {
  gemm_case *c = user;
  smelt_ctx *ctx = c->env->ctx;
  smelt_tensor x = cli_demo_rows(ctx, c->x, SMELT_DTYPE_BF16, row0, rows, c->k);
  smelt_tensor w = weight_view(ctx, c->w, c->k, c->n);
  smelt_tensor b = cli_demo_rows(ctx, c->bias, SMELT_DTYPE_BF16, 0, c->n, 0);
  smelt_tensor h = cli_demo_rows(ctx, c->h, SMELT_DTYPE_BF16, row0, rows, c->n);
  if (!c->gemm[slot]) {
    smelt_gemm_desc d = smelt_gemm_desc_default();
    d.epilogue.act = c->fused ? SMELT_ACT_GELU : SMELT_ACT_IDENTITY;
    CLI_TRY(smelt_gemm_plan(ctx, &d, &x, &w, NULL, &h, &b, &c->gemm[slot]));
    if (!c->fused) {
      smelt_activation_desc a = {SMELT_ACT_GELU, 0.01f};
      CLI_TRY(smelt_activation_plan(ctx, &a, &h, &h, &c->act[slot]));
    }
  }
  CLI_TRY(smelt_gemm_run(c->gemm[slot], &x, &w, NULL, &h, &b));
  if (!c->fused) CLI_TRY(smelt_activation_run(c->act[slot], &h, &h));
}

static void run_all(void *user, int iter) {
  gemm_case *c = user;
  (void)iter;
  /* The blocks cover this section's rows, which the CPU clamp may cut. */
  cli_demo_env env = *c->env;
  env.tokens = c->m;
  env.block = c->env->block < c->m ? c->env->block : c->m;
  cli_demo_blocks(&env, run_block, c);
}

static void free_case(gemm_case *c) {
  for (int i = 0; i < 2; i++) {
    smelt_plan_destroy(c->gemm[i]);
    smelt_plan_destroy(c->act[i]);
    c->gemm[i] = c->act[i] = NULL;
  }
}

/* The windows: rows [r0, r0 + wr) x columns [c0, c0 + wc) at both ends of h
 * (one window when h is small). */
typedef struct windows {
  int count;
  int64_t wr, wc, r0[2], c0[2];
} windows;

static windows windows_of(int64_t m, int64_t n) {
  windows w;
  w.wr = m < WIN_ROWS ? m : WIN_ROWS;
  w.wc = n < WIN_COLS ? n : WIN_COLS;
  w.r0[0] = w.c0[0] = 0;
  w.r0[1] = m - w.wr;
  w.c0[1] = n - w.wc;
  w.count = w.r0[1] == 0 && w.c0[1] == 0 ? 1 : 2;
  return w;
}

/* The CPU reference of the windows, stacked: [count * wr, wc]. */
static void reference(cli_demo_env *env, const windows *win, int64_t k, const uint16_t *x,
                      const uint16_t *w, const uint16_t *bias, uint16_t *ref) {
  smelt_gemm_desc d = smelt_gemm_desc_default();
  d.epilogue.act = SMELT_ACT_GELU;
  for (int i = 0; i < win->count; i++) {
    int64_t xs[2] = {win->wr, k}, ws[2] = {k, win->wc}, bs[1] = {win->wc}, hs[2] = {win->wr, win->wc};
    smelt_tensor tx = smelt_tensor_make((void *)(x + win->r0[i] * k), SMELT_DTYPE_BF16, SMELT_DEVICE_CPU, 0, 2, xs);
    smelt_tensor tw = smelt_tensor_make((void *)(w + win->c0[i] * k), SMELT_DTYPE_BF16, SMELT_DEVICE_CPU, 0, 2, ws);
    tw.strides[0] = 1;
    tw.strides[1] = k;
    smelt_tensor tb = smelt_tensor_make((void *)(bias + win->c0[i]), SMELT_DTYPE_BF16, SMELT_DEVICE_CPU, 0, 1, bs);
    smelt_tensor th = smelt_tensor_make(ref + i * win->wr * win->wc, SMELT_DTYPE_BF16, SMELT_DEVICE_CPU, 0, 2, hs);
    CLI_TRY(smelt_gemm(env->cpu, &d, &tx, &tw, NULL, &th, &tb));
  }
}

/* The device's h at the windows, stacked as reference() stacks them. */
static void fetch_windows(cli_demo_env *env, const windows *win, int64_t n, const void *h, uint16_t *got) {
  uint16_t *rows = cli_malloc((size_t)(win->wr * n) * sizeof *rows);
  for (int i = 0; i < win->count; i++) {
    cli_dev_download(env->ctx, rows, (const uint16_t *)h + win->r0[i] * n, (size_t)(win->wr * n) * sizeof *rows);
    for (int64_t r = 0; r < win->wr; r++)
      for (int64_t cidx = 0; cidx < win->wc; cidx++)
        got[(i * win->wr + r) * win->wc + cidx] = rows[r * n + win->c0[i] + cidx];
  }
  free(rows);
}

void cli_demo_gemm(cli_demo_env *env) {
  const int cpu = smelt_ctx_device(env->ctx) == SMELT_DEVICE_CPU;
  int64_t m = env->tokens, k = env->d_model;
  if (cpu) {
    m = m < CPU_MAX_ROWS ? m : CPU_MAX_ROWS;
    k = k < CPU_MAX_D ? k : CPU_MAX_D;
  }
  const int64_t n = 4 * k;
  char shapes[192];
  snprintf(shapes, sizeof shapes, "h = gelu(x W^T + b), x [%lld, %lld], W [%lld, %lld], h [%lld, %lld], bf16%s",
           (long long)m, (long long)k, (long long)n, (long long)k, (long long)m, (long long)n,
           cpu && (m != env->tokens || k != env->d_model) ? " (clamped on the CPU backend)" : "");
  cli_demo_table("gemm (MLP up-projection)", shapes);
  if (n * k > MAX_W_ELEMS) {
    printf("  skipped: W would hold %lld elements (at most %lld here)\n", (long long)(n * k), (long long)MAX_W_ELEMS);
    return;
  }

  const size_t es = sizeof(uint16_t), nx = (size_t)(m * k), nw = (size_t)(n * k), nh = (size_t)(m * n);
  uint16_t *x = cli_malloc(nx * es), *w = cli_malloc(nw * es), *bias = cli_malloc((size_t)n * es);
  /* Weights scaled as a trained layer's are (about 1/sqrt(fan-in)), so the
   * pre-activations spread over GELU's curved region around 0. */
  cli_fill_uniform(x, SMELT_DTYPE_BF16, nx, 0x5EED0301u, -1.0, 1.0);
  cli_fill_uniform(w, SMELT_DTYPE_BF16, nw, 0x5EED0302u, -2.0 / sqrt((double)k), 2.0 / sqrt((double)k));
  cli_fill_uniform(bias, SMELT_DTYPE_BF16, (size_t)n, 0x5EED0303u, -1.0, 1.0);

  const windows win = windows_of(m, n);
  const size_t nwin = (size_t)(win.count * win.wr * win.wc);
  uint16_t *ref = cli_malloc(nwin * es), *got = cli_malloc(nwin * es);
  reference(env, &win, k, x, w, bias, ref);

  gemm_case fc = {env, m, n, k, NULL, NULL, NULL, NULL, 1, {NULL, NULL}, {NULL, NULL}};
  fc.x = cli_dev_upload(env->ctx, x, nx * es);
  fc.w = cli_dev_upload(env->ctx, w, nw * es);
  fc.bias = cli_dev_upload(env->ctx, bias, (size_t)n * es);
  fc.h = cli_dev_alloc(env->ctx, nh * es);
  gemm_case uc = fc;
  uc.fused = 0;
  uc.h = cli_dev_alloc(env->ctx, nh * es);

  const double flops = 2.0 * (double)m * (double)n * (double)k;
  const double bytes_fused = (double)((nx + nw + (size_t)n + nh) * es);
  const double bytes_unfused = bytes_fused + 2.0 * (double)(nh * es); /* the activation pass reads and writes h */
  gemm_case *cases[2] = {&fc, &uc};
  const char *labels[2] = {"fused bias+gelu", "gemm+bias, gelu"};
  for (int i = 0; i < 2; i++) {
    gemm_case *c = cases[i];
    run_all(c, 0);
    fetch_windows(env, &win, n, c->h, got);
    cli_diff d = cli_compare(got, ref, SMELT_DTYPE_BF16, nwin);
    cli_timing t = cli_time_runs(env->ctx, env->warmup, env->iters, run_all, c);
    char note[320];
    const double gf = t.median_ms > 0 ? flops / (t.median_ms * 1e-3) / 1e9 : 0.0;
    snprintf(note, sizeof note, "%.2f %s; %s%s%s", gf >= 100 ? gf / 1e3 : gf, gf >= 100 ? "TFLOP/s" : "GFLOP/s",
             smelt_plan_describe(c->gemm[0]), c->fused ? "" : " + ", c->fused ? "" : smelt_plan_describe(c->act[0]));
    /* Up to one bf16 rounding apart (two for the unfused path). */
    double bound = cli_demo_bound(&d, "gemm", SMELT_DTYPE_BF16);
    cli_demo_row(env, labels[i], &d, bound, win.wc, &t, i == 0 ? bytes_fused : bytes_unfused, note);
  }

  /* Fused against unfused, on as much of h as is sensible to fetch. */
  const int64_t diff_rows = m < MAX_DIFF_ELEMS / n ? m : MAX_DIFF_ELEMS / n;
  const size_t nd = (size_t)(diff_rows * n);
  uint16_t *hf = cli_malloc(nd * es), *hu = cli_malloc(nd * es);
  cli_dev_download(env->ctx, hf, fc.h, nd * es);
  cli_dev_download(env->ctx, hu, uc.h, nd * es);
  cli_diff d = cli_compare(hf, hu, SMELT_DTYPE_BF16, nd);
  char note[128];
  snprintf(note, sizeof note, "max |fused - unfused| over %s%lld x %lld outputs; %lld differ",
           diff_rows < m ? "the first " : "", (long long)diff_rows, (long long)n, (long long)d.mismatches);
  cli_demo_row(env, "fused vs unfused", &d, cli_demo_bound(&d, "gemm", SMELT_DTYPE_BF16), n,
               NULL, 0.0, note);

  free_case(&fc);
  free_case(&uc);
  CLI_TRY(smelt_free(env->ctx, fc.x));
  CLI_TRY(smelt_free(env->ctx, fc.w));
  CLI_TRY(smelt_free(env->ctx, fc.bias));
  CLI_TRY(smelt_free(env->ctx, fc.h));
  CLI_TRY(smelt_free(env->ctx, uc.h));
  free(x);
  free(w);
  free(bias);
  free(ref);
  free(got);
  free(hf);
  free(hu);
}
