/* Bench op `bem`: the fused generated update y (+)= s·((x·V)∘codes)·Uᵀ
 * (smelt/bem.h) over M rows. The kernel reads x and codes once, V and U
 * (small, shared by every row block) once from memory, and writes y once
 * (reads it too when accumulating): that is the traffic counted, as in
 * issue 23's bandwidth bar. x, codes and y rotate over the sets; V, U and
 * the offsets are one fixed copy, as a layer's weights are. */
#include "bench.h"

#include <stdlib.h>

static int64_t opt_m = 16384, opt_din = 4096, opt_dout = 4096, opt_rank = 16, opt_adapters = 0;
static const char *opt_dtype = "f16";
static int opt_accumulate, opt_u_transposed;

static const cli_opt options[] = {
    {"m", CLI_OPT_INT, &opt_m, "M", "rows (default 16384)"},
    {"d-in", CLI_OPT_INT, &opt_din, "D", "input features (default 4096)"},
    {"d-out", CLI_OPT_INT, &opt_dout, "D", "output features (default 4096)"},
    {"rank", CLI_OPT_INT, &opt_rank, "R", "rank, 1..128 (default 16)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT", "f16, bf16 or f32 (default f16)"},
    {"adapters", CLI_OPT_INT, &opt_adapters, "A", "A adapters over equal row segments (default 0: one, no offsets)"},
    {"accumulate", CLI_OPT_FLAG, &opt_accumulate, NULL, "y += the update (reads y as well)"},
    {"u-transposed", CLI_OPT_FLAG, &opt_u_transposed, NULL, "U stored [r, d_out] (the seed's pre-transposed layout)"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

static struct {
  smelt_ctx *ctx;
  smelt_dtype dt;
  int sets;
  void **x, **codes, **y, **v, **u, **offs;
  smelt_plan *plan;
} st;

/* The A used for the weights' leading dim (1 without segments). */
static int64_t adapters(void) { return opt_adapters ? opt_adapters : 1; }

static void views(int set, smelt_tensor *t) {
  const smelt_device_kind dev = smelt_ctx_device(st.ctx);
  const int index = smelt_ctx_device_index(st.ctx), segs = opt_adapters > 0, wd = segs ? 3 : 2;
  const int64_t xs[2] = {opt_m, opt_din}, cs[2] = {opt_m, opt_rank}, ys[2] = {opt_m, opt_dout};
  const int64_t vs[3] = {adapters(), opt_din, opt_rank}, us[3] = {adapters(), opt_dout, opt_rank};
  const int64_t os[1] = {opt_adapters + 1};
  t[0] = smelt_tensor_make(st.x[set], st.dt, dev, index, 2, xs);
  t[1] = smelt_tensor_make(st.v[0], st.dt, dev, index, wd, vs + 3 - wd);
  t[2] = smelt_tensor_make(st.codes[set], st.dt, dev, index, 2, cs);
  t[3] = smelt_tensor_make(st.u[0], st.dt, dev, index, wd, us + 3 - wd);
  if (opt_u_transposed) { /* [r, d_out] storage: strides (1, d_out) */
    t[3].strides[wd - 2] = 1;
    t[3].strides[wd - 1] = opt_dout;
  }
  t[4] = smelt_tensor_make(segs ? st.offs[0] : NULL, SMELT_DTYPE_I64, dev, index, 1, os);
  t[5] = smelt_tensor_make(st.y[set], st.dt, dev, index, 2, ys);
}

static smelt_bem_inputs inputs(const smelt_tensor *t) {
  return (smelt_bem_inputs){&t[0], &t[1], &t[2], &t[3], opt_adapters ? &t[4] : NULL, NULL};
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  static const smelt_dtype allowed[] = {SMELT_DTYPE_F16, SMELT_DTYPE_BF16, SMELT_DTYPE_F32};
  st.dt = cli_require_dtype(doc, "dtype", opt_dtype, allowed, 3);
  cli_require_range(doc, "m", opt_m, 1, (int64_t)1 << 31);
  cli_require_range(doc, "d-in", opt_din, 1, (int64_t)1 << 20);
  cli_require_range(doc, "d-out", opt_dout, 1, (int64_t)1 << 20);
  cli_require_range(doc, "rank", opt_rank, 1, SMELT_BEM_MAX_RANK);
  cli_require_range(doc, "adapters", opt_adapters, 0, 65536);
  if (opt_m > ((int64_t)1 << 36) / (opt_din > opt_dout ? opt_din : opt_dout))
    cli_usage_error(doc->command, "--m x --d-in (or --d-out) exceeds 2^36 elements");
  const uint64_t es = smelt_dtype_size(st.dt), M = (uint64_t)opt_m, A = (uint64_t)adapters();
  snprintf(c->params_text, sizeof c->params_text, "m=%lld d_in=%lld d_out=%lld rank=%lld adapters=%lld dtype=%s%s%s",
           (long long)opt_m, (long long)opt_din, (long long)opt_dout, (long long)opt_rank, (long long)opt_adapters,
           smelt_dtype_name(st.dt), opt_accumulate ? " accumulate" : "", opt_u_transposed ? " u_transposed" : "");
  snprintf(c->params_json, sizeof c->params_json,
           "\"m\":%lld,\"d_in\":%lld,\"d_out\":%lld,\"rank\":%lld,\"adapters\":%lld,\"dtype\":\"%s\","
           "\"accumulate\":%d,\"u_transposed\":%d",
           (long long)opt_m, (long long)opt_din, (long long)opt_dout, (long long)opt_rank, (long long)opt_adapters,
           smelt_dtype_name(st.dt), opt_accumulate, opt_u_transposed);
  c->set_bytes = M * (uint64_t)(opt_din + opt_rank + opt_dout) * es;
  c->fixed_bytes = A * (uint64_t)(opt_din + opt_dout) * (uint64_t)opt_rank * es + (A + 1) * 8;
  c->traffic_bytes = c->set_bytes + c->fixed_bytes + (opt_accumulate ? M * (uint64_t)opt_dout * es : 0);
  c->flops = 2.0 * (double)opt_m * (double)opt_rank * (double)(opt_din + opt_dout);
  /* The reference's loops run r multiply-adds per byte of x and y: about
   * 16 MB/s at rank 16 on one core (measured). */
  c->cpu_bytes_per_s = 2.5e8 / (double)opt_rank;
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  const size_t es = smelt_dtype_size(st.dt), M = (size_t)opt_m, A = (size_t)adapters();
  const size_t xb = M * (size_t)opt_din * es, cb = M * (size_t)opt_rank * es, yb = M * (size_t)opt_dout * es;
  const size_t vb = A * (size_t)(opt_din * opt_rank) * es, ub = A * (size_t)(opt_dout * opt_rank) * es;
  st.ctx = ctx;
  st.sets = sets;
  void *host = cli_malloc(xb > yb ? xb : yb);
  cli_fill_uniform(host, st.dt, xb / es, 0x5EED2301u, -1.0, 1.0);
  st.x = cli_bench_upload_sets(ctx, host, xb, sets);
  cli_fill_uniform(host, st.dt, yb / es, 0x5EED2302u, -1.0, 1.0);
  st.y = cli_bench_upload_sets(ctx, host, yb, sets);
  cli_fill_uniform(host, st.dt, cb / es, 0x5EED2303u, -2.0, 2.0);
  st.codes = cli_bench_upload_sets(ctx, host, cb, sets);
  free(host);
  void *w = cli_malloc(vb > ub ? vb : ub);
  cli_fill_uniform(w, st.dt, vb / es, 0x5EED2304u, -0.05, 0.05);
  st.v = cli_bench_upload_sets(ctx, w, vb, 1);
  cli_fill_uniform(w, st.dt, ub / es, 0x5EED2305u, -0.05, 0.05);
  st.u = cli_bench_upload_sets(ctx, w, ub, 1);
  free(w);
  int64_t *offs = (int64_t *)cli_malloc((A + 1) * sizeof *offs);
  for (size_t a = 0; a <= A; a++) offs[a] = (int64_t)(a * M / A);
  st.offs = cli_bench_upload_sets(ctx, offs, (A + 1) * sizeof *offs, 1);
  free(offs);
  smelt_tensor t[6];
  views(0, t);
  smelt_bem_desc d = smelt_bem_desc_default();
  d.scale = 2.0;
  d.accumulate = opt_accumulate;
  const smelt_bem_inputs in = inputs(t);
  CLI_TRY(smelt_bem_plan(ctx, &d, &in, &t[5], &st.plan));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(st.plan));
}

static void run(int set) {
  smelt_tensor t[6];
  views(set, t);
  const smelt_bem_inputs in = inputs(t);
  CLI_TRY(smelt_bem_run(st.plan, &in, &t[5]));
}

static void teardown(void) {
  smelt_plan_destroy(st.plan);
  cli_bench_free_sets(st.ctx, st.x, st.sets);
  cli_bench_free_sets(st.ctx, st.codes, st.sets);
  cli_bench_free_sets(st.ctx, st.y, st.sets);
  cli_bench_free_sets(st.ctx, st.v, 1);
  cli_bench_free_sets(st.ctx, st.u, 1);
  cli_bench_free_sets(st.ctx, st.offs, 1);
}

const cli_bench_op cli_bench_bem = {
    "bem",
    "the fused BEM update y (+)= s((x V) * codes) U^T over [m, d_in] -> [m, d_out] (f16, bf16, f32)",
    options, describe, setup, run, teardown,
};
