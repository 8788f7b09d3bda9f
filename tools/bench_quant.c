/* Bench op `quant`: smelt_quantize of a [rows, cols] matrix into one of the
 * low-precision formats. The default is the issue's acceptance case, a
 * 16384 x 8192 bf16 activation into DeepGEMM's 1x128 FP8; the op is
 * memory-bound, so its figure is the rate against the copy ceiling.
 * Traffic counted: x read once, q and the scales written once (the
 * per-tensor formats' second read of x for the amax is not counted). */
#include "bench.h"

#include <stdlib.h>
#include <string.h>

static int64_t opt_rows = 16384, opt_cols = 8192;
static const char *opt_dtype = "bf16", *opt_format = "fp8-1x128", *opt_elem = "e4m3";

static const cli_opt options[] = {
    {"rows", CLI_OPT_INT, &opt_rows, "R", "rows, e.g. tokens (default 16384)"},
    {"cols", CLI_OPT_INT, &opt_cols, "K", "row length, the quantized axis (default 8192)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT", "x: f32, f16 or bf16 (default bf16)"},
    {"format", CLI_OPT_STRING, &opt_format, "F",
     "fp8-tensor, fp8-row, fp8-1x128, fp8-128x128, mxfp8 or nvfp4 (default fp8-1x128)"},
    {"elem", CLI_OPT_STRING, &opt_elem, "DT", "FP8 and MXFP8 elements: e4m3 or e5m2 (default e4m3)"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

static struct {
  smelt_ctx *ctx;
  smelt_dtype dt, elem;
  smelt_quant_format f;
  int64_t qcols, sr, sc;
  smelt_dtype sdt;
  int sets;
  void **x, **q, **scale, **ts;
  smelt_plan *plan;
} st;

/* The format's scale grid and q width, as include/smelt/quant.h gives them. */
static void shapes(void) {
  static const int64_t br[] = {0, 1, 1, 128, 1, 1}, bk[] = {0, 0, 128, 128, 32, 16};
  st.qcols = st.f == SMELT_QUANT_NVFP4 ? (opt_cols + 1) / 2 : opt_cols;
  st.sr = br[st.f] ? (opt_rows + br[st.f] - 1) / br[st.f] : 1;
  st.sc = bk[st.f] ? (opt_cols + bk[st.f] - 1) / bk[st.f] : 1;
  st.sdt = st.f == SMELT_QUANT_MXFP8 ? SMELT_DTYPE_U8 : st.f == SMELT_QUANT_NVFP4 ? SMELT_DTYPE_E4M3 : SMELT_DTYPE_F32;
}

static void views(int set, smelt_tensor *x, smelt_tensor *q, smelt_tensor *s, smelt_tensor *t) {
  const int64_t xs[2] = {opt_rows, opt_cols}, qs[2] = {opt_rows, st.qcols}, ss[2] = {st.sr, st.sc}, one[1] = {1};
  smelt_device_kind dev = smelt_ctx_device(st.ctx);
  int index = smelt_ctx_device_index(st.ctx);
  *x = smelt_tensor_make(st.x[set], st.dt, dev, index, 2, xs);
  *q = smelt_tensor_make(st.q[set], st.f == SMELT_QUANT_NVFP4 ? SMELT_DTYPE_U8 : st.elem, dev, index, 2, qs);
  *s = smelt_tensor_make(st.scale[set], st.sdt, dev, index, 2, ss);
  *t = smelt_tensor_make(st.ts[set], SMELT_DTYPE_F32, dev, index, 1, one);
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  static const smelt_dtype allowed[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  static const smelt_dtype elems[] = {SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2};
  st.dt = cli_require_dtype(doc, "dtype", opt_dtype, allowed, 3);
  st.elem = cli_require_dtype(doc, "elem", opt_elem, elems, 2);
  st.f = SMELT_QUANT_FORMAT_COUNT;
  for (int f = 0; f < SMELT_QUANT_FORMAT_COUNT; f++)
    if (!strcmp(opt_format, smelt_quant_format_name((smelt_quant_format)f))) st.f = (smelt_quant_format)f;
  if (st.f == SMELT_QUANT_FORMAT_COUNT) cli_usage_error(doc->command, "--format %s is not a format", opt_format);
  cli_require_range(doc, "rows", opt_rows, 1, (int64_t)1 << 31);
  cli_require_range(doc, "cols", opt_cols, 1, (int64_t)1 << 31);
  if (opt_rows > ((int64_t)1 << 36) / opt_cols) cli_usage_error(doc->command, "--rows x --cols exceeds 2^36 elements");
  shapes();
  snprintf(c->params_text, sizeof c->params_text, "rows=%lld cols=%lld dtype=%s format=%s elem=%s",
           (long long)opt_rows, (long long)opt_cols, smelt_dtype_name(st.dt), opt_format, smelt_dtype_name(st.elem));
  snprintf(c->params_json, sizeof c->params_json,
           "\"rows\":%lld,\"cols\":%lld,\"dtype\":\"%s\",\"format\":\"%s\",\"elem\":\"%s\"", (long long)opt_rows,
           (long long)opt_cols, smelt_dtype_name(st.dt), opt_format, smelt_dtype_name(st.elem));
  c->set_bytes = (uint64_t)(opt_rows * opt_cols) * smelt_dtype_size(st.dt) + (uint64_t)(opt_rows * st.qcols) +
                 (uint64_t)(st.sr * st.sc) * smelt_dtype_size(st.sdt) + 4;
  c->traffic_bytes = c->set_bytes;
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  size_t xb = (size_t)(opt_rows * opt_cols) * smelt_dtype_size(st.dt);
  void *host = cli_malloc(xb);
  cli_fill_uniform(host, st.dt, (size_t)(opt_rows * opt_cols), 0x5EED2801u, -4.0, 4.0);
  st.ctx = ctx;
  st.sets = sets;
  st.x = cli_bench_upload_sets(ctx, host, xb, sets);
  st.q = cli_bench_alloc_sets(ctx, (size_t)(opt_rows * st.qcols), sets);
  st.scale = cli_bench_alloc_sets(ctx, (size_t)(st.sr * st.sc) * smelt_dtype_size(st.sdt), sets);
  st.ts = cli_bench_alloc_sets(ctx, 4, sets);
  free(host);
  smelt_tensor x, q, s, t;
  views(0, &x, &q, &s, &t);
  CLI_TRY(smelt_quantize_plan(ctx, st.f, &x, &q, &s, st.f == SMELT_QUANT_NVFP4 ? &t : NULL, &st.plan));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(st.plan));
}

static void run(int set) {
  smelt_tensor x, q, s, t;
  views(set, &x, &q, &s, &t);
  CLI_TRY(smelt_quantize_run(st.plan, &x, &q, &s, st.f == SMELT_QUANT_NVFP4 ? &t : NULL));
}

static void teardown(void) {
  smelt_plan_destroy(st.plan);
  cli_bench_free_sets(st.ctx, st.x, st.sets);
  cli_bench_free_sets(st.ctx, st.q, st.sets);
  cli_bench_free_sets(st.ctx, st.scale, st.sets);
  cli_bench_free_sets(st.ctx, st.ts, st.sets);
}

const cli_bench_op cli_bench_quant = {
    "quant",
    "smelt_quantize of [rows, cols] to FP8 (block scales), MXFP8 or NVFP4",
    options, describe, setup, run, teardown,
};
