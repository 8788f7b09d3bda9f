/* Bench op `conv2d`: one Conv2d pass (fprop, dgrad or wgrad) of an NHWC
 * layer, square padding, stride and dilation, as issue 24's ResNet-50
 * table describes its layers (the default is 56x56x64->64 3x3 at batch 8).
 * The work is the implicit GEMM's, 2·N·P·Q·K·R·S·C flops for every pass,
 * so passes and peers compare in TFLOP/s; the traffic counted is each
 * input read once and the output written once. */
#include "bench.h"

#include <stdlib.h>
#include <string.h>

static int64_t opt_n = 8, opt_h = 56, opt_w = 56, opt_c = 64, opt_k = 64, opt_r = 3, opt_s = 3;
static int64_t opt_stride = 1, opt_pad = 1, opt_dilation = 1;
static const char *opt_pass = "fprop", *opt_dtype = "bf16";

static const cli_opt options[] = {
    {"n", CLI_OPT_INT, &opt_n, "N", "batch (default 8)"},
    {"h", CLI_OPT_INT, &opt_h, "H", "input height (default 56)"},
    {"w", CLI_OPT_INT, &opt_w, "W", "input width (default 56)"},
    {"c", CLI_OPT_INT, &opt_c, "C", "input channels (default 64)"},
    {"k", CLI_OPT_INT, &opt_k, "K", "output channels, filters (default 64)"},
    {"r", CLI_OPT_INT, &opt_r, "R", "filter height (default 3)"},
    {"s", CLI_OPT_INT, &opt_s, "S", "filter width (default 3)"},
    {"stride", CLI_OPT_INT, &opt_stride, "U", "stride on both axes (default 1)"},
    {"pad", CLI_OPT_INT, &opt_pad, "P", "padding on every side (default 1)"},
    {"dilation", CLI_OPT_INT, &opt_dilation, "D", "dilation on both axes (default 1)"},
    {"pass", CLI_OPT_STRING, &opt_pass, "PASS", "fprop, dgrad or wgrad (default fprop)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT", "f32, f16 or bf16 for every tensor (default bf16)"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

/* A, B and D by pass: 0 x [N,H,W,C], 1 w [K,R,S,C], 2 y [N,P,Q,K]. */
static const int roles[SMELT_CONV2D_KIND_COUNT][3] = {{0, 1, 2}, {2, 1, 0}, {2, 0, 1}};

static struct {
  smelt_ctx *ctx;
  smelt_dtype dt;
  smelt_conv2d_desc desc;
  int64_t shape[3][4]; /* x, w, y */
  size_t bytes[3];
  int sets;
  void **buf[3]; /* A, B, D */
  smelt_plan *plan;
} st;

static void views(int set, smelt_tensor *t) {
  const smelt_device_kind dev = smelt_ctx_device(st.ctx);
  const int index = smelt_ctx_device_index(st.ctx);
  for (int i = 0; i < 3; i++)
    t[i] = smelt_tensor_make(st.buf[i][set], st.dt, dev, index, 4, st.shape[roles[st.desc.kind][i]]);
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  static const smelt_dtype allowed[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  static const char *const passes[] = {"fprop", "dgrad", "wgrad"};
  st.dt = cli_require_dtype(doc, "dtype", opt_dtype, allowed, 3);
  int pass = 0;
  while (pass < SMELT_CONV2D_KIND_COUNT && strcmp(opt_pass, passes[pass])) pass++;
  if (pass == SMELT_CONV2D_KIND_COUNT) cli_usage_error(doc->command, "--pass %s is not fprop, dgrad or wgrad", opt_pass);
  const int64_t most = (int64_t)1 << 20;
  const char *const dims[] = {"n", "h", "w", "c", "k", "r", "s"};
  const int64_t vals[] = {opt_n, opt_h, opt_w, opt_c, opt_k, opt_r, opt_s};
  for (int i = 0; i < 7; i++) cli_require_range(doc, dims[i], vals[i], 1, most);
  cli_require_range(doc, "stride", opt_stride, 1, 1024);
  cli_require_range(doc, "pad", opt_pad, 0, 1024);
  cli_require_range(doc, "dilation", opt_dilation, 1, 1024);
  smelt_conv2d_desc *d = &st.desc;
  *d = smelt_conv2d_desc_default();
  d->kind = (smelt_conv2d_kind)pass;
  d->pad_h0 = d->pad_h1 = d->pad_w0 = d->pad_w1 = (int)opt_pad;
  d->stride_h = d->stride_w = (int)opt_stride;
  d->dilation_h = d->dilation_w = (int)opt_dilation;
  const int64_t P = smelt_conv2d_out_size(d, 0, opt_h, opt_r), Q = smelt_conv2d_out_size(d, 1, opt_w, opt_s);
  if (P < 1 || Q < 1) cli_usage_error(doc->command, "the dilated filter is larger than the padded input");
  const int64_t shape[3][4] = {{opt_n, opt_h, opt_w, opt_c}, {opt_k, opt_r, opt_s, opt_c}, {opt_n, P, Q, opt_k}};
  memcpy(st.shape, shape, sizeof shape);
  c->set_bytes = 0;
  for (int i = 0; i < 3; i++) {
    const double elems = (double)shape[i][0] * (double)shape[i][1] * (double)shape[i][2] * (double)shape[i][3];
    if (elems > (double)((int64_t)1 << 34)) cli_usage_error(doc->command, "a tensor exceeds 2^34 elements");
    st.bytes[i] = (size_t)elems * smelt_dtype_size(st.dt);
    c->set_bytes += st.bytes[i];
  }
  c->traffic_bytes = c->set_bytes;
  c->flops = 2.0 * (double)opt_n * (double)P * (double)Q * (double)opt_k * (double)opt_r * (double)opt_s * (double)opt_c;
  /* The CPU reference reads each product's operands through typed loads:
   * about 1.5e8 flops/s, not the runner's assumed 1e9, so the difference
   * is charged to its traffic for the estimate that refuses long runs. */
  c->cpu_bytes_per_s = (double)c->traffic_bytes / (c->flops * (1.0 / 1.5e8 - 1.0 / 1e9));
  /* The parameters, in text and in JSON, from one list. */
  const struct {
    const char *name;
    int64_t v;
  } nums[] = {{"n", opt_n}, {"h", opt_h}, {"w", opt_w}, {"c", opt_c}, {"k", opt_k}, {"r", opt_r}, {"s", opt_s},
              {"stride", opt_stride}, {"pad", opt_pad}, {"dilation", opt_dilation}, {"p", P}, {"q", Q}};
  int lt = snprintf(c->params_text, sizeof c->params_text, "pass=%s dtype=%s", passes[pass], smelt_dtype_name(st.dt));
  int lj = snprintf(c->params_json, sizeof c->params_json, "\"pass\":\"%s\",\"dtype\":\"%s\"", passes[pass],
                    smelt_dtype_name(st.dt));
  for (size_t i = 0; i < sizeof nums / sizeof *nums; i++) {
    lt += snprintf(c->params_text + lt, sizeof c->params_text - (size_t)lt, " %s=%lld", nums[i].name,
                   (long long)nums[i].v);
    lj += snprintf(c->params_json + lj, sizeof c->params_json - (size_t)lj, ",\"%s\":%lld", nums[i].name,
                   (long long)nums[i].v);
  }
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  st.ctx = ctx;
  st.sets = sets;
  for (int i = 0; i < 2; i++) { /* the pass's inputs */
    const size_t bytes = st.bytes[roles[st.desc.kind][i]];
    void *host = cli_host_uniform(st.dt, bytes / smelt_dtype_size(st.dt), 0x5EED2401u + (uint64_t)i, -1.0, 1.0);
    st.buf[i] = cli_bench_upload_sets(ctx, host, bytes, sets);
    free(host);
  }
  st.buf[2] = cli_bench_alloc_sets(ctx, st.bytes[roles[st.desc.kind][2]], sets);
  smelt_tensor t[3];
  views(0, t);
  CLI_TRY(smelt_conv2d_plan(ctx, &st.desc, &t[0], &t[1], NULL, &t[2], NULL, &st.plan));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(st.plan));
}

static void run(int set) {
  smelt_tensor t[3];
  views(set, t);
  CLI_TRY(smelt_conv2d_run(st.plan, &t[0], &t[1], NULL, &t[2], NULL));
}

static void teardown(void) {
  smelt_plan_destroy(st.plan);
  for (int i = 0; i < 3; i++) cli_bench_free_sets(st.ctx, st.buf[i], st.sets);
}

const cli_bench_op cli_bench_conv2d = {
    "conv2d",
    "one Conv2d pass (fprop, dgrad, wgrad) of an NHWC layer: --n --h --w --c --k --r --s [--stride --pad --dilation]",
    options, describe, setup, run, teardown,
};
