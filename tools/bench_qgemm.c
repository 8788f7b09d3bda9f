/* Bench op `qgemm`: smelt_qgemm of x [M, K] (bf16 or f16) with NVFP4
 * weights W [N, K] (an nn.Linear's [out, in], quantized), D [M, N] in x's
 * dtype. The default is the decode case, M = 1 with N = K = 8192,
 * where the op is bound by reading the 4-bit weights: its figure is the
 * rate against the copy ceiling. Traffic counted: q, the scales, x and D
 * once each. The weights are random bytes with block scales of moderate
 * size (the kernel's speed does not depend on the values). */
#include "bench.h"

#include <stdlib.h>
#include <string.h>

static int64_t opt_m = 1, opt_n = 8192, opt_k = 8192;
static const char *opt_dtype = "bf16", *opt_act = "identity";
static int opt_bias;

static const cli_opt options[] = {
    {"m", CLI_OPT_INT, &opt_m, "M", "rows of x and D, e.g. tokens (default 1)"},
    {"n", CLI_OPT_INT, &opt_n, "N", "rows of W, columns of D (default 8192)"},
    {"k", CLI_OPT_INT, &opt_k, "K", "inner dimension, a multiple of 16 (default 8192)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT", "x and D: bf16 or f16 (default bf16)"},
    {"act", CLI_OPT_STRING, &opt_act, "A", "activation of the epilogue (default identity)"},
    {"bias", CLI_OPT_FLAG, &opt_bias, NULL, "add a bias [N] in the epilogue"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

static struct {
  smelt_ctx *ctx;
  smelt_dtype dt;
  smelt_act act;
  int sets;
  void **x, **q, **scale, **ts, **bias, **d;
  smelt_plan *plan;
} st;

static uint64_t bytes_q(void) { return (uint64_t)(opt_n * opt_k / 2); }
static uint64_t bytes_scale(void) { return (uint64_t)(opt_n * opt_k / 16); }

typedef struct views_t {
  smelt_tensor x, q, s, t, b, d;
  smelt_qgemm_weights w;
} views_t;

static void views(int set, views_t *v) {
  const int64_t xs[2] = {opt_m, opt_k}, qs[2] = {opt_n, opt_k / 2}, ss[2] = {opt_n, opt_k / 16}, one[1] = {1};
  const int64_t ds[2] = {opt_m, opt_n}, bs[1] = {opt_n};
  const smelt_device_kind dev = smelt_ctx_device(st.ctx);
  const int index = smelt_ctx_device_index(st.ctx);
  v->x = smelt_tensor_make(st.x[set], st.dt, dev, index, 2, xs);
  v->q = smelt_tensor_make(st.q[set], SMELT_DTYPE_U8, dev, index, 2, qs);
  v->s = smelt_tensor_make(st.scale[set], SMELT_DTYPE_E4M3, dev, index, 2, ss);
  v->t = smelt_tensor_make(st.ts[set], SMELT_DTYPE_F32, dev, index, 1, one);
  v->b = smelt_tensor_make(st.bias[set], st.dt, dev, index, 1, bs);
  v->d = smelt_tensor_make(st.d[set], st.dt, dev, index, 2, ds);
  v->w = (smelt_qgemm_weights){SMELT_QUANT_NVFP4, &v->q, &v->s, &v->t};
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  static const smelt_dtype allowed[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16};
  st.dt = cli_require_dtype(doc, "dtype", opt_dtype, allowed, 2);
  if (smelt_act_from_name(opt_act, &st.act) != SMELT_OK)
    cli_usage_error(doc->command, "--act '%s' is not an activation smelt knows", opt_act);
  cli_require_range(doc, "m", opt_m, 1, (int64_t)1 << 24);
  cli_require_range(doc, "n", opt_n, 1, (int64_t)1 << 24);
  cli_require_range(doc, "k", opt_k, 16, (int64_t)1 << 24);
  if (opt_k % 16) cli_usage_error(doc->command, "--k %lld is not a multiple of 16", (long long)opt_k);
  if (opt_n > ((int64_t)1 << 36) / opt_k || opt_m > ((int64_t)1 << 36) / opt_k ||
      opt_m > ((int64_t)1 << 36) / opt_n)
    cli_usage_error(doc->command, "a matrix exceeds 2^36 elements");
  snprintf(c->params_text, sizeof c->params_text, "m=%lld n=%lld k=%lld dtype=%s format=nvfp4 act=%s%s",
           (long long)opt_m, (long long)opt_n, (long long)opt_k, smelt_dtype_name(st.dt), smelt_act_name(st.act),
           opt_bias ? " bias" : "");
  snprintf(c->params_json, sizeof c->params_json,
           "\"m\":%lld,\"n\":%lld,\"k\":%lld,\"dtype\":\"%s\",\"format\":\"nvfp4\",\"act\":\"%s\",\"bias\":%s",
           (long long)opt_m, (long long)opt_n, (long long)opt_k, smelt_dtype_name(st.dt), smelt_act_name(st.act),
           opt_bias ? "true" : "false");
  const uint64_t es = smelt_dtype_size(st.dt);
  c->set_bytes = bytes_q() + bytes_scale() + 4 + (uint64_t)(opt_m * opt_k + opt_m * opt_n + opt_n) * es;
  c->traffic_bytes = bytes_q() + bytes_scale() + (uint64_t)(opt_m * opt_k + opt_m * opt_n) * es;
  c->flops = 2.0 * (double)opt_m * (double)opt_n * (double)opt_k;
  /* The CPU reference decodes each weight and sums in f64: about 2e7 FLOP/s. */
  c->cpu_bytes_per_s = (double)c->traffic_bytes / (c->flops * (1.0 / 2e7 - 1.0 / 1e9));
}

/* Random codes; scale bytes with exponents 4..10 (2^-3 .. 2^3). */
static void fill_weights(uint8_t *q, uint8_t *s) {
  uint64_t r = 0x5EED2802u;
  for (uint64_t i = 0; i < bytes_q(); i++) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    q[i] = (uint8_t)(r >> 56);
  }
  for (uint64_t i = 0; i < bytes_scale(); i++) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    s[i] = (uint8_t)((4 + (r >> 61) % 7) << 3 | (r >> 40) % 8);
  }
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  const size_t es = smelt_dtype_size(st.dt), xb = (size_t)(opt_m * opt_k) * es, bb = (size_t)opt_n * es;
  uint8_t *hx = cli_malloc(xb), *hq = cli_malloc(bytes_q()), *hs = cli_malloc(bytes_scale()), *hb = cli_malloc(bb);
  cli_fill_uniform(hx, st.dt, (size_t)(opt_m * opt_k), 0x5EED2803u, -1.0, 1.0);
  cli_fill_uniform(hb, st.dt, (size_t)opt_n, 0x5EED2804u, -1.0, 1.0);
  fill_weights(hq, hs);
  const float one = 1.0f;
  st.ctx = ctx;
  st.sets = sets;
  st.x = cli_bench_upload_sets(ctx, hx, xb, sets);
  st.q = cli_bench_upload_sets(ctx, hq, bytes_q(), sets);
  st.scale = cli_bench_upload_sets(ctx, hs, bytes_scale(), sets);
  st.ts = cli_bench_upload_sets(ctx, &one, 4, sets);
  st.bias = cli_bench_upload_sets(ctx, hb, bb, sets);
  st.d = cli_bench_alloc_sets(ctx, (size_t)(opt_m * opt_n) * es, sets);
  free(hx);
  free(hq);
  free(hs);
  free(hb);
  views_t v;
  views(0, &v);
  smelt_qgemm_desc desc = smelt_qgemm_desc_default();
  desc.act = st.act;
  CLI_TRY(smelt_qgemm_plan(ctx, &desc, &v.x, &v.w, opt_bias ? &v.b : NULL, &v.d, &st.plan));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(st.plan));
}

static void run(int set) {
  views_t v;
  views(set, &v);
  CLI_TRY(smelt_qgemm_run(st.plan, &v.x, &v.w, opt_bias ? &v.b : NULL, &v.d));
}

static void teardown(void) {
  smelt_plan_destroy(st.plan);
  cli_bench_free_sets(st.ctx, st.x, st.sets);
  cli_bench_free_sets(st.ctx, st.q, st.sets);
  cli_bench_free_sets(st.ctx, st.scale, st.sets);
  cli_bench_free_sets(st.ctx, st.ts, st.sets);
  cli_bench_free_sets(st.ctx, st.bias, st.sets);
  cli_bench_free_sets(st.ctx, st.d, st.sets);
}

const cli_bench_op cli_bench_qgemm = {
    "qgemm",
    "smelt_qgemm: x [M, K] bf16/f16 times NVFP4 weights [N, K] (W4A16), with its epilogue",
    options, describe, setup, run, teardown,
};
