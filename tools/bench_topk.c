/* Bench op `topk`: row-wise top-k over [rows, cols], values and indices.
 * The default shape is MoE routing (DeepSeek-V3: 256 experts, top-8, over a
 * batch of tokens). Traffic counted: x read once, values and indices
 * written once. */
#include "bench.h"

#include <stdlib.h>

static int64_t opt_rows = 16384, opt_cols = 256, opt_k = 8;
static const char *opt_dtype = "f32";
static const char *opt_index_dtype = "i32";

static const cli_opt options[] = {
    {"rows", CLI_OPT_INT, &opt_rows, "R", "rows, e.g. tokens (default 16384)"},
    {"cols", CLI_OPT_INT, &opt_cols, "C", "row length, e.g. experts (default 256)"},
    {"k", CLI_OPT_INT, &opt_k, "K", "largest values kept per row (default 8)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT", "f32, f16 or bf16 (default f32)"},
    {"index-dtype", CLI_OPT_STRING, &opt_index_dtype, "DT", "i32 or i64 (default i32)"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

static struct {
  smelt_ctx *ctx;
  smelt_dtype dt, idt;
  int sets;
  void **x, **values, **indices;
  smelt_plan *plan;
} st;

static void views(int set, smelt_tensor *x, smelt_tensor *v, smelt_tensor *ix) {
  int64_t xshape[2] = {opt_rows, opt_cols}, kshape[2] = {opt_rows, opt_k};
  smelt_device_kind dev = smelt_ctx_device(st.ctx);
  int index = smelt_ctx_device_index(st.ctx);
  *x = smelt_tensor_make(st.x[set], st.dt, dev, index, 2, xshape);
  *v = smelt_tensor_make(st.values[set], st.dt, dev, index, 2, kshape);
  *ix = smelt_tensor_make(st.indices[set], st.idt, dev, index, 2, kshape);
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  static const smelt_dtype allowed[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  static const smelt_dtype index_allowed[] = {SMELT_DTYPE_I32, SMELT_DTYPE_I64};
  st.dt = cli_require_dtype(doc, "dtype", opt_dtype, allowed, 3);
  st.idt = cli_require_dtype(doc, "index-dtype", opt_index_dtype, index_allowed, 2);
  cli_require_range(doc, "rows", opt_rows, 1, (int64_t)1 << 31);
  cli_require_range(doc, "cols", opt_cols, 1, (int64_t)1 << 31);
  cli_require_range(doc, "k", opt_k, 1, opt_cols);
  if (opt_rows > ((int64_t)1 << 36) / opt_cols)
    cli_usage_error(doc->command, "--rows x --cols exceeds 2^36 elements");
  uint64_t es = smelt_dtype_size(st.dt), is = smelt_dtype_size(st.idt);
  snprintf(c->params_text, sizeof c->params_text, "rows=%lld cols=%lld k=%lld dtype=%s index=%s",
           (long long)opt_rows, (long long)opt_cols, (long long)opt_k, smelt_dtype_name(st.dt),
           smelt_dtype_name(st.idt));
  snprintf(c->params_json, sizeof c->params_json,
           "\"rows\":%lld,\"cols\":%lld,\"k\":%lld,\"dtype\":\"%s\",\"index_dtype\":\"%s\"",
           (long long)opt_rows, (long long)opt_cols, (long long)opt_k, smelt_dtype_name(st.dt),
           smelt_dtype_name(st.idt));
  c->set_bytes = (uint64_t)(opt_rows * opt_cols) * es + (uint64_t)(opt_rows * opt_k) * (es + is);
  c->traffic_bytes = c->set_bytes;
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  size_t es = smelt_dtype_size(st.dt);
  size_t n = (size_t)(opt_rows * opt_cols), nk = (size_t)(opt_rows * opt_k);
  void *host = cli_malloc(n * es);
  cli_fill_uniform(host, st.dt, n, 0x5EED1301u, -4.0, 4.0);
  st.ctx = ctx;
  st.sets = sets;
  st.x = cli_bench_upload_sets(ctx, host, n * es, sets);
  st.values = cli_bench_alloc_sets(ctx, nk * es, sets);
  st.indices = cli_bench_alloc_sets(ctx, nk * smelt_dtype_size(st.idt), sets);
  free(host);
  smelt_tensor x, v, ix;
  views(0, &x, &v, &ix);
  CLI_TRY(smelt_topk_plan(ctx, opt_k, &x, &v, &ix, &st.plan));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(st.plan));
}

static void run(int set) {
  smelt_tensor x, v, ix;
  views(set, &x, &v, &ix);
  CLI_TRY(smelt_topk_run(st.plan, &x, &v, &ix));
}

static void teardown(void) {
  smelt_plan_destroy(st.plan);
  cli_bench_free_sets(st.ctx, st.x, st.sets);
  cli_bench_free_sets(st.ctx, st.values, st.sets);
  cli_bench_free_sets(st.ctx, st.indices, st.sets);
}

const cli_bench_op cli_bench_topk = {
    "topk",
    "row-wise top-k values and indices over [rows, cols] (MoE routing)",
    options, describe, setup, run, teardown,
};
