/* Demo section: one Mixture-of-Experts layer over the demo's tokens, as the
 * seed's users ran it (--num-experts, --top-k, --d-model, --seq-len,
 * --batch-size): softmax top-k routing with renormalization and SwiGLU
 * experts of width d_model, bf16. The device runs the whole layer; its
 * routing statistics (tokens per expert, dropped, load imbalance max/mean)
 * and the router's aux losses are printed, and the layer and the router
 * alone are timed. A token's output depends on that token only, so the CPU
 * backend checks the first CHECK_ROWS tokens (its naive loops would take
 * minutes over all of them). On the CPU backend the problem is scaled
 * down. */
#include "demo.h"

#include <math.h>
#include <stdlib.h>

enum { CHECK_ROWS = 32, CPU_TOKENS = 64, CPU_WIDTH = 64 };
#define MAX_WEIGHTS ((int64_t)1 << 28) /* elements of each of W1, W3, W2: 512 MiB of bf16 */

typedef struct moe_case {
  smelt_plan *plan;
  smelt_moe_weights w;
  smelt_tensor x, y;
  smelt_moe_routing r;
} moe_case;

static void run_layer(void *user, int iter) {
  moe_case *c = user;
  (void)iter;
  CLI_TRY(smelt_moe_forward_run(c->plan, &c->w, &c->x, &c->y, NULL, NULL));
}

static void run_router(void *user, int iter) {
  moe_case *c = user;
  (void)iter;
  CLI_TRY(smelt_moe_route_run(c->plan, &c->w, &c->x, &c->r));
}

static smelt_tensor ctx_tensor(smelt_ctx *ctx, void *p, smelt_dtype dt, int n, int64_t a, int64_t b, int64_t c) {
  const int64_t shape[3] = {a, b, c};
  return smelt_tensor_make(p, dt, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), n, shape);
}

void cli_demo_moe(cli_demo_env *env) {
  const int cpu = smelt_ctx_device(env->ctx) == SMELT_DEVICE_CPU;
  const int64_t T = cpu && env->tokens > CPU_TOKENS ? CPU_TOKENS : env->tokens,
                d = cpu && env->d_model > CPU_WIDTH ? CPU_WIDTH : env->d_model, F = d, E = env->experts,
                k = env->top_k, check = T < CHECK_ROWS ? T : CHECK_ROWS;
  const smelt_dtype bf = SMELT_DTYPE_BF16, f32 = SMELT_DTYPE_F32, i32 = SMELT_DTYPE_I32;
  char text[256];
  snprintf(text, sizeof text,
           "x [%lld, %lld] bf16, %lld experts (W1, W3 [%lld, %lld], W2 [%lld, %lld] each), softmax top-%lld "
           "renormalized, SwiGLU%s",
           (long long)T, (long long)d, (long long)E, (long long)d, (long long)F, (long long)F, (long long)d,
           (long long)k, T < env->tokens || d < env->d_model ? " (scaled down on the CPU backend)" : "");
  cli_demo_table("moe (a Mixture-of-Experts layer)", text);
  if ((double)E * (double)d * (double)F > (double)MAX_WEIGHTS) {
    printf("  skipped: %lld experts of %lld x %lld would take over %lld weights each for W1, W3, W2\n", (long long)E,
           (long long)d, (long long)F, (long long)MAX_WEIGHTS);
    return;
  }

  smelt_moe_config cfg = smelt_moe_config_default();
  cfg.num_experts = E, cfg.top_k = k, cfg.d_model = d, cfg.ffn_dim = F;
  cfg.aux_loss_coeff = 0.01, cfg.z_loss_coeff = 0.001;
  /* The inputs, on the host (the reference's) and the device. */
  const double sd = 1.0 / sqrt((double)d), sf = 1.0 / sqrt((double)F);
  const size_t n[5] = {(size_t)(T * d), (size_t)(d * E), (size_t)(E * d * F), (size_t)(E * d * F), (size_t)(E * F * d)};
  const double spread[5] = {1.0, 2.0 * sd, sd, sd, sf};
  void *host[5], *dev[5];
  for (int i = 0; i < 5; i++) {
    host[i] = cli_host_uniform(bf, n[i], 0x5EED2270u + (uint64_t)i, -spread[i], spread[i]);
    dev[i] = cli_dev_upload(env->ctx, host[i], n[i] * 2);
  }
  smelt_tensor dw[4], hw[4];
  const int64_t wshape[4][3] = {{d, E, 0}, {E, d, F}, {E, d, F}, {E, F, d}};
  for (int i = 0; i < 4; i++) {
    dw[i] = ctx_tensor(env->ctx, dev[i + 1], bf, i ? 3 : 2, wshape[i][0], wshape[i][1], wshape[i][2]);
    hw[i] = ctx_tensor(env->cpu, host[i + 1], bf, i ? 3 : 2, wshape[i][0], wshape[i][1], wshape[i][2]);
  }
  moe_case c = {.w = {.wr = &dw[0], .w1 = &dw[1], .w3 = &dw[2], .w2 = &dw[3]}};
  void *ybuf = cli_dev_alloc(env->ctx, n[0] * 2), *rbuf[7];
  const smelt_dtype rdt[7] = {f32, i32, f32, i32, i32, i32, f32};
  const int64_t rshape[7][2] = {{T, E}, {T, k}, {T, k}, {E, 0}, {E + 1, 0}, {1, 0}, {2, 0}};
  smelt_tensor rt[7];
  for (int i = 0; i < 7; i++) {
    const int64_t elems = rshape[i][0] * (rshape[i][1] ? rshape[i][1] : 1);
    rbuf[i] = cli_dev_alloc(env->ctx, (size_t)(elems ? elems : 1) * 4);
    rt[i] = ctx_tensor(env->ctx, rbuf[i], rdt[i], rshape[i][1] ? 2 : 1, rshape[i][0], rshape[i][1], 0);
  }
  c.r = (smelt_moe_routing){&rt[0], &rt[1], &rt[2], &rt[3], &rt[4], &rt[5], &rt[6]};
  c.x = ctx_tensor(env->ctx, dev[0], bf, 2, T, d, 0);
  c.y = ctx_tensor(env->ctx, ybuf, bf, 2, T, d, 0);
  const smelt_status s = smelt_moe_plan(env->ctx, &cfg, &c.w, &c.x, &c.plan);
  if (s == SMELT_STATUS_UNSUPPORTED) {
    printf("  skipped: %s\n", smelt_last_error());
  } else {
    CLI_TRY(s);
    smelt_moe_stats st;
    CLI_TRY(smelt_moe_forward_run(c.plan, &c.w, &c.x, &c.y, &c.r, &st));
    /* The reference: the CPU backend's layer over the first `check` tokens. */
    uint16_t *got = cli_malloc(n[0] * 2), *ref = cli_malloc((size_t)(check * d) * 2);
    cli_dev_download(env->ctx, got, ybuf, n[0] * 2);
    const smelt_moe_weights hmw = {.wr = &hw[0], .w1 = &hw[1], .w3 = &hw[2], .w2 = &hw[3]};
    const smelt_tensor hx = ctx_tensor(env->cpu, host[0], bf, 2, check, d, 0),
                       hy = ctx_tensor(env->cpu, ref, bf, 2, check, d, 0);
    CLI_TRY(smelt_moe_forward(env->cpu, &cfg, &hmw, &hx, &hy, NULL, NULL));
    const cli_diff diff = cli_compare(got, ref, bf, (size_t)(check * d));
    const cli_timing tl = cli_time_runs(env->ctx, env->warmup, env->iters, run_layer, &c),
                     tr = cli_time_runs(env->ctx, env->warmup, env->iters, run_router, &c);
    /* Bytes: x and y, and the weights of the experts that got tokens. */
    const double used = (double)(E - st.empty_experts),
                 bytes = (double)(n[0] * 4 + n[1] * 2) + used * (double)(3 * d * F) * 2.0,
                 flops = 2.0 * (double)st.kept * (double)d * (double)F * 3.0,
                 tf = tl.median_ms > 0 ? flops / (tl.median_ms * 1e-3) / 1e12 : 0.0;
    char note[320];
    snprintf(note, sizeof note, "first %lld tokens checked; expert FFN %.2f TFLOP/s; %s", (long long)check, tf,
             smelt_plan_describe(c.plan));
    cli_demo_row(env, "layer forward", &diff, cli_demo_bound(&diff, "moe", bf), d, &tl, bytes, note);
    float aux[2];
    int32_t *counts = cli_malloc((size_t)E * 4);
    cli_dev_download(env->ctx, aux, rbuf[6], sizeof aux);
    cli_dev_download(env->ctx, counts, rbuf[3], (size_t)E * 4);
    printf("  %-18s %12s %9s %5s %10.4f %9s  logits x·Wr, softmax, top-%lld, counts, offsets, aux losses\n",
           "router alone", "", "", "", tr.median_ms, "", (long long)k);
    printf("  routing: %lld tokens x top-%lld = %lld assignments, %lld kept, %lld dropped; tokens per expert "
           "%lld..%lld, %lld experts empty; load imbalance %.3f (max/mean); aux losses: load balance %.6g, z %.6g\n",
           (long long)st.tokens, (long long)k, (long long)st.assignments, (long long)st.kept, (long long)st.dropped,
           (long long)st.min_count, (long long)st.max_count, (long long)st.empty_experts, st.imbalance, aux[0],
           aux[1]);
    printf("  tokens per expert:");
    for (int64_t e = 0; e < E && e < 64; e++) printf(" %d", counts[e]);
    printf("%s\n", E > 64 ? " ..." : "");
    free(counts);
    free(got);
    free(ref);
    smelt_plan_destroy(c.plan);
  }
  CLI_TRY(smelt_free(env->ctx, ybuf));
  for (int i = 0; i < 7; i++) CLI_TRY(smelt_free(env->ctx, rbuf[i]));
  for (int i = 0; i < 5; i++) {
    CLI_TRY(smelt_free(env->ctx, dev[i]));
    free(host[i]);
  }
}
