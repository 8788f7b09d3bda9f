/* Bench op `softmax`: row softmax with its logsumexp over [rows, cols], as
 * attention and vocabulary logits need. A fused kernel reads x once and
 * writes y and lse once; that is the traffic counted. */
#include "bench.h"

#include <stdlib.h>

static int64_t opt_rows = 8192, opt_cols = 4096;
static const char *opt_dtype = "f32";

static const cli_opt options[] = {
    {"rows", CLI_OPT_INT, &opt_rows, "R", "rows (default 8192)"},
    {"cols", CLI_OPT_INT, &opt_cols, "C", "row length (default 4096)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT", "f32, f16 or bf16 (default f32); lse is f32"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

static struct {
  smelt_ctx *ctx;
  smelt_dtype dt;
  int sets;
  void **x, **y, **lse;
  smelt_plan *plan;
} st;

static void views(int set, smelt_tensor *x, smelt_tensor *y, smelt_tensor *lse) {
  int64_t shape[2] = {opt_rows, opt_cols};
  smelt_device_kind dev = smelt_ctx_device(st.ctx);
  int index = smelt_ctx_device_index(st.ctx);
  *x = smelt_tensor_make(st.x[set], st.dt, dev, index, 2, shape);
  *y = smelt_tensor_make(st.y[set], st.dt, dev, index, 2, shape);
  *lse = smelt_tensor_make(st.lse[set], SMELT_DTYPE_F32, dev, index, 1, shape);
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  static const smelt_dtype allowed[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  st.dt = cli_require_dtype(doc, "dtype", opt_dtype, allowed, 3);
  cli_require_range(doc, "rows", opt_rows, 1, (int64_t)1 << 31);
  cli_require_range(doc, "cols", opt_cols, 1, (int64_t)1 << 31);
  if (opt_rows > ((int64_t)1 << 36) / opt_cols)
    cli_usage_error(doc->command, "--rows x --cols exceeds 2^36 elements");
  uint64_t n = (uint64_t)(opt_rows * opt_cols), es = smelt_dtype_size(st.dt);
  snprintf(c->params_text, sizeof c->params_text, "rows=%lld cols=%lld dtype=%s",
           (long long)opt_rows, (long long)opt_cols, smelt_dtype_name(st.dt));
  snprintf(c->params_json, sizeof c->params_json, "\"rows\":%lld,\"cols\":%lld,\"dtype\":\"%s\"",
           (long long)opt_rows, (long long)opt_cols, smelt_dtype_name(st.dt));
  c->set_bytes = 2 * n * es + (uint64_t)opt_rows * sizeof(float);
  c->traffic_bytes = c->set_bytes;
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  size_t n = (size_t)(opt_rows * opt_cols), bytes = n * smelt_dtype_size(st.dt);
  void *host = cli_malloc(bytes);
  cli_fill_uniform(host, st.dt, n, 0x5EED1201u, -8.0, 8.0);
  st.ctx = ctx;
  st.sets = sets;
  st.x = cli_bench_upload_sets(ctx, host, bytes, sets);
  st.y = cli_bench_alloc_sets(ctx, bytes, sets);
  st.lse = cli_bench_alloc_sets(ctx, (size_t)opt_rows * sizeof(float), sets);
  free(host);
  smelt_tensor x, y, lse;
  views(0, &x, &y, &lse);
  CLI_TRY(smelt_softmax_plan(ctx, &x, &y, &lse, &st.plan));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(st.plan));
}

static void run(int set) {
  smelt_tensor x, y, lse;
  views(set, &x, &y, &lse);
  CLI_TRY(smelt_softmax_run(st.plan, &x, &y, &lse));
}

static void teardown(void) {
  smelt_plan_destroy(st.plan);
  cli_bench_free_sets(st.ctx, st.x, st.sets);
  cli_bench_free_sets(st.ctx, st.y, st.sets);
  cli_bench_free_sets(st.ctx, st.lse, st.sets);
}

const cli_bench_op cli_bench_softmax = {
    "softmax",
    "row softmax with logsumexp over [rows, cols] (f32, f16, bf16)",
    options, describe, setup, run, teardown,
};
