/* Demo section: the BEM update of a frozen linear layer, y = s·((x·V)∘codes)·Uᵀ
 * over [tokens, d_model] at rank 16 (PEFT's alpha 32: s = 2), through the two
 * calls the seed's users had: smelt_bem_validate (the device against the
 * CPU reference on the same bytes) and smelt_bem_benchmark (fused against
 * the unfused GEMM + Hadamard + GEMM, and against the base layer's GEMM).
 * The whole tensor goes in one call: the update has no per-block state.
 * The CPU backend is the reference itself and slow (the benchmark's base
 * GEMM most), so there the problem is clamped. */
#include "core/error_bound.h"
#include "demo.h"

#include <stdlib.h>

enum { RANK = 16, CPU_MAX_ROWS = 64, CPU_MAX_D = 128 };

static const smelt_dtype dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* The section's device buffers and their views: x, v, codes, u, y. */
typedef struct bem_bufs {
  void *dev[5];
  smelt_tensor t[5];
} bem_bufs;

static void load(cli_demo_env *env, int64_t T, int64_t d, smelt_dtype dt, uint64_t seed, bem_bufs *b) {
  const int64_t shapes[5][2] = {{T, d}, {d, RANK}, {T, RANK}, {d, RANK}, {T, d}};
  const double range[5] = {1.0, 0.05, 2.0, 0.05, 1.0};
  const size_t es = smelt_dtype_size(dt);
  for (int i = 0; i < 5; i++) {
    const size_t n = (size_t)(shapes[i][0] * shapes[i][1]);
    void *host = cli_host_uniform(dt, n, seed + (uint64_t)i, -range[i], range[i]);
    b->dev[i] = cli_dev_upload(env->ctx, host, n * es);
    free(host);
    b->t[i] = smelt_tensor_make(b->dev[i], dt, smelt_ctx_device(env->ctx), smelt_ctx_device_index(env->ctx), 2,
                                shapes[i]);
  }
}

void cli_demo_bem(cli_demo_env *env) {
  const int cpu = smelt_ctx_device(env->ctx) == SMELT_DEVICE_CPU;
  const int64_t T = cpu && env->tokens > CPU_MAX_ROWS ? CPU_MAX_ROWS : env->tokens;
  const int64_t d = cpu && env->d_model > CPU_MAX_D ? CPU_MAX_D : env->d_model;
  char shapes[160];
  snprintf(shapes, sizeof shapes, "y = 2 ((x V) * codes) U^T, x and y [%lld, %lld], rank %d%s", (long long)T,
           (long long)d, RANK, T != env->tokens || d != env->d_model ? " (clamped on the CPU backend)" : "");
  cli_demo_table("bem update", shapes);
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    const smelt_dtype dt = dtypes[i];
    bem_bufs b;
    load(env, T, d, dt, 0x5EED2311u + 8 * i, &b);
    const smelt_bem_inputs in = {&b.t[0], &b.t[1], &b.t[2], &b.t[3], NULL, NULL};
    smelt_bem_desc desc = smelt_bem_desc_default();
    desc.scale = 2.0;
    smelt_bem_check chk;
    smelt_bem_timing tm;
    CLI_TRY(smelt_bem_validate(env->ctx, &desc, &in, &b.t[4], 0, &chk));
    CLI_TRY(smelt_bem_benchmark(env->ctx, &desc, &in, &b.t[4], env->warmup, env->iters, &tm));
    const double max_ref = chk.max_rel > 0 ? chk.max_abs / chk.max_rel : 0;
    const cli_diff diff = {.max_abs = chk.max_abs, .where = (size_t)chk.worst, .max_ref = max_ref};
    const cli_timing t = {.median_ms = tm.fused_ms, .min_ms = tm.fused_ms, .iters = env->iters};
    char label[32], note[160];
    snprintf(label, sizeof label, "%s y", smelt_dtype_name(dt));
    snprintf(note, sizeof note, "unfused %.3f ms (%.2fx), base GEMM %.3f ms (+%.1f%%)", tm.unfused_ms, tm.speedup,
             tm.base_ms, tm.overhead_pct);
    cli_demo_row(env, label, &diff, cli_demo_bound(&diff, "bem", dt), d, &t,
                 tm.fused_gbps * tm.fused_ms * 1e6, note);
    for (int k = 0; k < 5; k++) CLI_TRY(smelt_free(env->ctx, b.dev[k]));
  }
}
