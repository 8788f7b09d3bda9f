/* Bench op `activation`: y = act(x) over n elements, the purest
 * memory-bound op (n read, n written), so it should reach the copy ceiling.
 * --strided times the generic-stride path on a realistic non-contiguous
 * view: rows of 1024 elements inside rows of 1088, as after slicing the last
 * dimension of a wider tensor. The padding is never touched, so the bytes
 * counted are the bytes moved. */
#include "bench.h"

#include <stdlib.h>

enum { ROW = 1024, PITCH = 1088 }; /* PITCH keeps every row 128-byte aligned */

static int64_t opt_n = (int64_t)1 << 24;
static const char *opt_dtype = "f16";
static const char *opt_act = "gelu";
static int opt_strided;

static const cli_opt options[] = {
    {"n", CLI_OPT_INT, &opt_n, "N", "elements (default 16M; with --strided a multiple of 1024)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT", "f32, f16 or bf16 (default f16)"},
    {"act", CLI_OPT_STRING, &opt_act, "ACT", "relu, silu, gelu, gelu_tanh, ... (default gelu)"},
    {"strided", CLI_OPT_FLAG, &opt_strided, NULL, "x and y are [n/1024, 1024] views with row pitch 1088"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

static struct {
  smelt_ctx *ctx;
  smelt_dtype dt;
  smelt_activation_desc desc;
  int sets;
  size_t buf_elems; /* elements one buffer holds, padding included */
  void **x, **y;
  smelt_plan *plan;
} st;

static smelt_tensor view(void *data) {
  if (!opt_strided) {
    int64_t shape[1] = {opt_n};
    return smelt_tensor_make(data, st.dt, smelt_ctx_device(st.ctx), smelt_ctx_device_index(st.ctx), 1,
                             shape);
  }
  int64_t shape[2] = {opt_n / ROW, ROW};
  smelt_tensor t = smelt_tensor_make(data, st.dt, smelt_ctx_device(st.ctx),
                                     smelt_ctx_device_index(st.ctx), 2, shape);
  t.strides[0] = PITCH;
  return t;
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  static const smelt_dtype allowed[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  st.dt = cli_require_dtype(doc, "dtype", opt_dtype, allowed, 3);
  if (smelt_act_from_name(opt_act, &st.desc.act) != SMELT_OK)
    cli_usage_error(doc->command, "--act '%s' is not an activation smelt knows", opt_act);
  st.desc.slope = 0.01f;
  cli_require_range(doc, "n", opt_n, 1, (int64_t)1 << 36);
  if (opt_strided && opt_n % ROW != 0)
    cli_usage_error(doc->command, "--strided needs --n to be a multiple of %d, got %lld", ROW,
                    (long long)opt_n);
  st.buf_elems = (size_t)(opt_strided ? opt_n / ROW * PITCH : opt_n);
  size_t es = smelt_dtype_size(st.dt);
  snprintf(c->params_text, sizeof c->params_text, "n=%lld dtype=%s act=%s%s", (long long)opt_n,
           smelt_dtype_name(st.dt), smelt_act_name(st.desc.act), opt_strided ? " strided" : "");
  snprintf(c->params_json, sizeof c->params_json,
           "\"n\":%lld,\"dtype\":\"%s\",\"act\":\"%s\",\"strided\":%s", (long long)opt_n,
           smelt_dtype_name(st.dt), smelt_act_name(st.desc.act), opt_strided ? "true" : "false");
  c->set_bytes = 2 * (uint64_t)st.buf_elems * es;
  c->traffic_bytes = 2 * (uint64_t)opt_n * es;
  /* The CPU reference evaluates erf and tanh in double: about 20 MB/s here. */
  c->cpu_bytes_per_s = 2e7;
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  size_t bytes = st.buf_elems * smelt_dtype_size(st.dt);
  void *host = cli_malloc(bytes);
  cli_fill_uniform(host, st.dt, st.buf_elems, 0x5EED1101u, -6.0, 6.0);
  st.ctx = ctx;
  st.sets = sets;
  st.x = cli_bench_upload_sets(ctx, host, bytes, sets);
  st.y = cli_bench_alloc_sets(ctx, bytes, sets);
  free(host);
  smelt_tensor x = view(st.x[0]), y = view(st.y[0]);
  CLI_TRY(smelt_activation_plan(ctx, &st.desc, &x, &y, &st.plan));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(st.plan));
}

static void run(int set) {
  smelt_tensor x = view(st.x[set]), y = view(st.y[set]);
  CLI_TRY(smelt_activation_run(st.plan, &x, &y));
}

static void teardown(void) {
  smelt_plan_destroy(st.plan);
  cli_bench_free_sets(st.ctx, st.x, st.sets);
  cli_bench_free_sets(st.ctx, st.y, st.sets);
}

const cli_bench_op cli_bench_activation = {
    "activation",
    "y = act(x), elementwise (f32, f16, bf16; contiguous or strided)",
    options, describe, setup, run, teardown,
};
