/* Bench op `copy`: device-to-device smelt_memcpy_d2d. It moves every byte
 * once in and once out with no arithmetic, so its bandwidth (counting read
 * plus write, as the other ops count theirs) is the ceiling a memory-bound
 * kernel can approach. */
#include "bench.h"

#include <stdlib.h>

static int64_t opt_bytes = (int64_t)1 << 30;

static const cli_opt options[] = {
    {"bytes", CLI_OPT_INT, &opt_bytes, "N", "bytes to copy (default 1G; suffixes k, M, G)"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

static struct {
  smelt_ctx *ctx;
  size_t bytes;
  int sets;
  void **src, **dst;
} st;

static void copy_setup(smelt_ctx *ctx, size_t bytes, int sets) {
  void *host = cli_malloc(bytes);
  cli_fill_bytes(host, bytes, 0x5EED1001u);
  st.ctx = ctx;
  st.bytes = bytes;
  st.sets = sets;
  st.src = cli_bench_upload_sets(ctx, host, bytes, sets);
  st.dst = cli_bench_alloc_sets(ctx, bytes, sets);
  free(host);
}

static void copy_run(int set) { CLI_TRY(smelt_memcpy_d2d(st.ctx, st.dst[set], st.src[set], st.bytes)); }

static void copy_teardown(void) {
  cli_bench_free_sets(st.ctx, st.src, st.sets);
  cli_bench_free_sets(st.ctx, st.dst, st.sets);
}

static void copy_work(void *user, int iter) {
  (void)user;
  copy_run(iter % st.sets);
}

cli_timing cli_bench_copy_ceiling(smelt_ctx *ctx, uint64_t bytes, int sets, int warmup, int iters) {
  copy_setup(ctx, (size_t)bytes, sets);
  cli_timing t = cli_time_runs(ctx, warmup, iters, copy_work, NULL);
  copy_teardown();
  return t;
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  cli_require_range(doc, "bytes", opt_bytes, 1, (int64_t)1 << 40);
  snprintf(c->params_text, sizeof c->params_text, "bytes=%lld", (long long)opt_bytes);
  snprintf(c->params_json, sizeof c->params_json, "\"copy_bytes\":%lld", (long long)opt_bytes);
  c->set_bytes = 2 * (uint64_t)opt_bytes;
  c->traffic_bytes = 2 * (uint64_t)opt_bytes;
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  copy_setup(ctx, (size_t)opt_bytes, sets);
  snprintf(c->kernel, sizeof c->kernel, "smelt_memcpy_d2d");
}

const cli_bench_op cli_bench_copy = {
    "copy",
    "device-to-device copy: the bandwidth ceiling (read + write bytes)",
    options, describe, setup, copy_run, copy_teardown,
};
