/* Demo section: one 3x3 layer of a ResNet's 28x28 stage (64 -> 64
 * channels, padding 1, NHWC, bf16) through its three passes: fprop with the
 * bias and ReLU fused into the epilogue, then dgrad and wgrad as a training
 * step runs them. Each pass runs on the device and on the CPU backend from
 * the same inputs, and its row shows the error against the CPU, the time
 * and the kernel the plan chose (its description). The problem is fixed,
 * not the transformer shape of the other sections: a conv layer has no
 * tokens. On the CPU backend it is scaled down, the reference being naive
 * loops. */
#include "demo.h"
#include "smelt/conv2d.h"

#include <math.h>
#include <stdlib.h>

/* The layer on a GPU and on the CPU backend: N, H = W, C = K. */
enum { GPU_N = 2, GPU_HW = 28, GPU_C = 64, CPU_N = 1, CPU_HW = 8, CPU_C = 16, TAPS = 3 };

/* The pass's A, B and D among x [N,H,W,C], w [K,R,S,C], y [N,P,Q,K]
 * (smelt/conv2d.h's table). */
static const int pass_roles[SMELT_CONV2D_KIND_COUNT][3] = {{0, 1, 2}, {2, 1, 0}, {2, 0, 1}};
static const char *const pass_labels[SMELT_CONV2D_KIND_COUNT] = {"fprop +bias+relu", "dgrad", "wgrad"};

typedef struct conv_case {
  smelt_ctx *ctx;
  smelt_conv2d_desc desc;
  smelt_tensor a, b, d, bias; /* on the device; bias.data NULL outside fprop */
  smelt_plan *plan;
} conv_case;

static void run_pass(void *user, int iter) {
  conv_case *c = user;
  (void)iter;
  CLI_TRY(smelt_conv2d_run(c->plan, &c->a, &c->b, NULL, &c->d, c->bias.data ? &c->bias : NULL));
}

static smelt_tensor view(smelt_ctx *ctx, void *data, const int64_t *shape) {
  return smelt_tensor_make(data, SMELT_DTYPE_BF16, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), 4, shape);
}

void cli_demo_conv2d(cli_demo_env *env) {
  const int cpu = smelt_ctx_device(env->ctx) == SMELT_DEVICE_CPU;
  const int64_t n = cpu ? CPU_N : GPU_N, hw = cpu ? CPU_HW : GPU_HW, ch = cpu ? CPU_C : GPU_C;
  const int64_t shapes[3][4] = {{n, hw, hw, ch}, {ch, TAPS, TAPS, ch}, {n, hw, hw, ch}}; /* x, w, y */
  const int64_t bias_shape[1] = {ch};
  char text[192];
  snprintf(text, sizeof text,
           "x [%lld, %lld, %lld, %lld] (NHWC), w [%lld, %d, %d, %lld] (KRSC), y [%lld, %lld, %lld, %lld], 3x3, "
           "padding 1, bf16%s",
           (long long)n, (long long)hw, (long long)hw, (long long)ch, (long long)ch, TAPS, TAPS, (long long)ch,
           (long long)n, (long long)hw, (long long)hw, (long long)ch, cpu ? " (scaled down on the CPU backend)" : "");
  cli_demo_table("conv2d (a ResNet 3x3 layer: fprop, dgrad, wgrad)", text);

  /* Every tensor gets values, since each is an input of some pass; the
   * weights at about 1/sqrt(fan-in), as a trained layer's. */
  size_t elems[3];
  void *host[3], *dev[3];
  const double spread[3] = {1.0, 2.0 / sqrt((double)(TAPS * TAPS * ch)), 1.0};
  for (int i = 0; i < 3; i++) {
    elems[i] = (size_t)(shapes[i][0] * shapes[i][1] * shapes[i][2] * shapes[i][3]);
    host[i] = cli_host_uniform(SMELT_DTYPE_BF16, elems[i], 0x5EED2461u + (uint64_t)i, -spread[i], spread[i]);
    dev[i] = cli_dev_upload(env->ctx, host[i], elems[i] * sizeof(uint16_t));
  }
  void *bias_host = cli_host_uniform(SMELT_DTYPE_BF16, (size_t)ch, 0x5EED2464u, -0.5, 0.5);
  void *bias_dev = cli_dev_upload(env->ctx, bias_host, (size_t)ch * sizeof(uint16_t));
  const double flops = 2.0 * (double)(n * hw * hw) * (double)ch * (double)(TAPS * TAPS) * (double)ch;

  for (int kind = 0; kind < SMELT_CONV2D_KIND_COUNT; kind++) {
    const int *r = pass_roles[kind];
    const size_t out_bytes = elems[r[2]] * sizeof(uint16_t);
    uint16_t *ref = cli_malloc(out_bytes), *got = cli_malloc(out_bytes);
    conv_case c = {env->ctx, smelt_conv2d_desc_default(), {0}, {0}, {0}, {0}, NULL};
    c.desc.kind = (smelt_conv2d_kind)kind;
    c.desc.pad_h0 = c.desc.pad_h1 = c.desc.pad_w0 = c.desc.pad_w1 = 1;
    if (kind == SMELT_CONV2D_FPROP) c.desc.epilogue.act = SMELT_ACT_RELU;

    /* The CPU backend's result from the host copies of the same inputs. */
    smelt_tensor ha = view(env->cpu, host[r[0]], shapes[r[0]]), hb = view(env->cpu, host[r[1]], shapes[r[1]]);
    smelt_tensor hd = view(env->cpu, ref, shapes[r[2]]);
    smelt_tensor hbias = smelt_tensor_make(bias_host, SMELT_DTYPE_BF16, SMELT_DEVICE_CPU, 0, 1, bias_shape);
    CLI_TRY(smelt_conv2d(env->cpu, &c.desc, &ha, &hb, NULL, &hd, kind == SMELT_CONV2D_FPROP ? &hbias : NULL));

    void *out = cli_dev_alloc(env->ctx, out_bytes);
    c.a = view(env->ctx, dev[r[0]], shapes[r[0]]);
    c.b = view(env->ctx, dev[r[1]], shapes[r[1]]);
    c.d = view(env->ctx, out, shapes[r[2]]);
    if (kind == SMELT_CONV2D_FPROP)
      c.bias = smelt_tensor_make(bias_dev, SMELT_DTYPE_BF16, smelt_ctx_device(env->ctx),
                                 smelt_ctx_device_index(env->ctx), 1, bias_shape);
    CLI_TRY(smelt_conv2d_plan(env->ctx, &c.desc, &c.a, &c.b, NULL, &c.d, c.bias.data ? &c.bias : NULL, &c.plan));
    run_pass(&c, 0);
    cli_dev_download(env->ctx, got, out, out_bytes);
    cli_diff d = cli_compare(got, ref, SMELT_DTYPE_BF16, elems[r[2]]);
    cli_timing t = cli_time_runs(env->ctx, env->warmup, env->iters, run_pass, &c);

    char note[320];
    const double gf = t.median_ms > 0 ? flops / (t.median_ms * 1e-3) / 1e9 : 0.0;
    snprintf(note, sizeof note, "%.2f %s; %s", gf >= 100 ? gf / 1e3 : gf, gf >= 100 ? "TFLOP/s" : "GFLOP/s",
             smelt_plan_describe(c.plan));
    const double bytes = (double)((elems[r[0]] + elems[r[1]] + elems[r[2]]) * sizeof(uint16_t));
    cli_demo_row(env, pass_labels[kind], &d, cli_demo_bound(&d, "conv2d", SMELT_DTYPE_BF16), shapes[r[2]][3], &t,
                 bytes, note);

    smelt_plan_destroy(c.plan);
    CLI_TRY(smelt_free(env->ctx, out));
    free(ref);
    free(got);
  }

  for (int i = 0; i < 3; i++) {
    CLI_TRY(smelt_free(env->ctx, dev[i]));
    free(host[i]);
  }
  CLI_TRY(smelt_free(env->ctx, bias_dev));
  free(bias_host);
}
