/* `smelt bench <op>`: times one op the way kernel work is judged here (see
 * STYLE.md): device events, warm-up first, median of many runs, inputs
 * rotated over sets larger than L2 so every run reads DRAM, and the result
 * quoted against a device copy of the same traffic measured in the same run.
 * Absolute numbers drift between runs and machines; the ratio to the copy
 * ceiling is the figure to compare. */
#include "bench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The copy, then each op family's bench, from the family list (a family
 * without one is a NULL entry, skipped). */
#define BENCH(name) &cli_bench_##name,
static const cli_bench_op *const ops[] = {&cli_bench_copy, SMELT__FAMILY_LIST(BENCH)};
enum { NOPS = sizeof ops / sizeof ops[0] };

static const char *device_opt;
static int64_t warmup = 5, iters = 20, rotate = 0;
static int json, cpu_anyway;

static const cli_opt common_options[] = {
    {"device", CLI_OPT_STRING, &device_opt, "cpu|cuda[:N]",
     "device to run on (default: cuda when usable, else cpu)"},
    {"warmup", CLI_OPT_INT, &warmup, "N", "untimed runs first (default 5)"},
    {"iters", CLI_OPT_INT, &iters, "N", "timed runs (default 20)"},
    {"rotate", CLI_OPT_INT, &rotate, "N", "input sets rotated (default: enough for > 2x L2)"},
    {"json", CLI_OPT_FLAG, &json, NULL, "print one JSON object per line instead of text"},
    {"cpu-anyway", CLI_OPT_FLAG, &cpu_anyway, NULL,
     "on the CPU backend, run a case estimated to take over a minute instead of refusing it"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

void **cli_bench_alloc_sets(smelt_ctx *ctx, size_t bytes, int sets) {
  void **bufs = cli_malloc((size_t)sets * sizeof *bufs);
  for (int i = 0; i < sets; i++) bufs[i] = cli_dev_alloc(ctx, bytes);
  return bufs;
}

void **cli_bench_upload_sets(smelt_ctx *ctx, const void *host, size_t bytes, int sets) {
  void **bufs = cli_malloc((size_t)sets * sizeof *bufs);
  for (int i = 0; i < sets; i++) bufs[i] = cli_dev_upload(ctx, host, bytes);
  return bufs;
}

void cli_bench_free_sets(smelt_ctx *ctx, void **bufs, int sets) {
  for (int i = 0; i < sets; i++) CLI_TRY(smelt_free(ctx, bufs[i]));
  free(bufs);
}

void cli_bench_poison(smelt_ctx *ctx, void *dev, size_t bytes) {
  void *p = cli_malloc(bytes);
  memset(p, 0xFF, bytes);
  CLI_TRY(smelt_memcpy_h2d(ctx, dev, p, bytes));
  free(p);
}

/* The API reports no host cache sizes, so the CPU backend assumes a typical
 * last-level cache and keeps its sets within a modest host budget and
 * count: its naive loops are bound by arithmetic, not by the cache, and an
 * op's setup may run once per set (PEER's backward runs a forward for each
 * set's ids; 819 small sets took 4 minutes). */
#define CPU_CACHE_BYTES ((uint64_t)64 << 20)
#define CPU_SET_BUDGET ((uint64_t)1 << 30)
#define CPU_MAX_SETS 8
#define MAX_SETS 1024

/* Enough sets that one pass over them spans more than twice the L2, so each
 * run finds its inputs in DRAM as a layer of a real model would; capped at
 * half the device memory (one set at least). */
static int default_sets(const cli_device_desc *dev, uint64_t set_bytes) {
  uint64_t cache = dev->l2_bytes ? dev->l2_bytes : CPU_CACHE_BYTES;
  uint64_t budget = dev->total_memory ? dev->total_memory / 2 : CPU_SET_BUDGET;
  uint64_t sets = 2 * cache / set_bytes + 1;
  if (sets * set_bytes > budget) sets = budget / set_bytes;
  if (sets < 1) sets = 1;
  const uint64_t most = dev->total_memory ? MAX_SETS : CPU_MAX_SETS;
  return (int)(sets > most ? most : sets);
}

/* The CPU backend runs the naive reference loops (about 1 GFLOP/s, and
 * 50 to 200 MB/s for most row ops, on one core here; the copy is memmove,
 * not estimated): the defaults, sized for a GPU, would run for an hour, and
 * PEER's million experts would fill the host's memory (its backward was
 * killed by the OOM killer at 23 GB). A case estimated to take more than a
 * minute is refused with its numbers and the ways out, unless --cpu-anyway;
 * one that needs more than the host's memory always is. */
#define CPU_FLOPS_PER_S 1e9
#define CPU_BYTES_PER_S 5e7
#define CPU_MAX_SECONDS 60.0

static double host_memory_bytes(void) {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? (double)pages * (double)page : 0;
}

static void refuse_gpu_sizes_on_cpu(const cli_doc *doc, const cli_bench_case *c, int sets, int reference) {
  const double memory = (double)c->set_bytes * sets + (double)c->fixed_bytes, host = host_memory_bytes();
  char need[32], have[32], work[64] = "";
  cli_fmt_bytes((uint64_t)memory, need, sizeof need);
  cli_fmt_bytes((uint64_t)host, have, sizeof have);
  if (host > 0 && memory > host)
    cli_usage_error(doc->command,
                    "on the CPU backend this case needs about %s of host memory, more than this machine's %s; "
                    "its sizes are for a GPU: pass smaller ones or --device cuda",
                    need, have);
  /* A set's setup may cost a run (PEER's backward runs a forward per set). */
  const int runs = (int)(warmup + iters) + sets;
  const double rate = c->cpu_bytes_per_s > 0 ? c->cpu_bytes_per_s : CPU_BYTES_PER_S;
  const double seconds = runs * (c->flops / CPU_FLOPS_PER_S + (double)c->traffic_bytes / rate);
  if (!reference || seconds <= CPU_MAX_SECONDS || cpu_anyway) return;
  if (c->flops > 0) snprintf(work, sizeof work, "%.3g GFLOP and ", c->flops / 1e9);
  cli_usage_error(doc->command,
                  "on the CPU backend (the naive reference loops) this case would take about %.0f minutes (%d "
                  "runs of %s%.3g GB each, %s of memory); its sizes are for a GPU: pass smaller ones, fewer runs "
                  "(--warmup 0 --iters 1), --device cuda, or --cpu-anyway to run it",
                  ceil(seconds / 60.0), runs, work, (double)c->traffic_bytes / 1e9, need);
}

typedef struct bench_work {
  const cli_bench_op *op;
  int sets;
} bench_work;

static void op_work(void *user, int iter) {
  const bench_work *w = user;
  w->op->run(iter % w->sets);
}

static double gbps(uint64_t bytes, const cli_timing *t) {
  return t->median_ms > 0 ? (double)bytes / (t->median_ms * 1e-3) / 1e9 : 0.0;
}

static double tflops(double flops, const cli_timing *t) {
  return t->median_ms > 0 ? flops / (t->median_ms * 1e-3) / 1e12 : 0.0;
}

static void print_text(const cli_bench_op *op, const cli_bench_case *c, const cli_device_desc *dev,
                       const char *why, int sets, const cli_timing *ceil, const cli_timing *t) {
  char set[32], all[32], l2[32];
  printf("smelt bench %s: %s\n", op->name, c->params_text);
  printf("%-10s %s (%s); %s\n", "device", dev->label, dev->name, why);
  printf("%-10s %s\n", "kernel", c->kernel);
  printf("%-10s %d x %s rotated (%s; %s %s); %lld warm-up + %lld timed runs\n", "sets", sets,
         cli_fmt_bytes(c->set_bytes, set, sizeof set),
         cli_fmt_bytes(c->set_bytes * (uint64_t)sets, all, sizeof all),
         dev->l2_bytes ? "L2" : "assumed cache",
         cli_fmt_bytes(dev->l2_bytes ? dev->l2_bytes : CPU_CACHE_BYTES, l2, sizeof l2),
         (long long)warmup, (long long)iters);
  if (ceil)
    printf("%-10s median %.4f ms  min %.4f ms  %8.1f GB/s  (ceiling: d2d copy, same traffic)\n",
           "copy", ceil->median_ms, ceil->min_ms, gbps(c->traffic_bytes, ceil));
  printf("%-10s median %.4f ms  min %.4f ms  %8.1f GB/s", op->name, t->median_ms, t->min_ms,
         gbps(c->traffic_bytes, t));
  if (ceil && gbps(c->traffic_bytes, ceil) > 0)
    printf("  %.1f%% of copy", 100.0 * gbps(c->traffic_bytes, t) / gbps(c->traffic_bytes, ceil));
  if (c->flops > 0 && tflops(c->flops, t) >= 0.1)
    printf("  %8.2f TFLOP/s", tflops(c->flops, t));
  else if (c->flops > 0)
    printf("  %8.2f GFLOP/s", 1e3 * tflops(c->flops, t));
  printf("\n");
  if (c->check_text[0]) printf("%-10s %s\n", "check", c->check_text);
  if (c->note_text[0]) printf("%-10s %s\n", c->note_label, c->note_text);
}

/* One object per line, keys in a fixed order; the copy_* keys are absent
 * when the op is the copy itself, flops and tflops when the op counts no
 * arithmetic, the check_* keys when no check ran, and the op's notes last. */
static void print_json(const cli_bench_op *op, const cli_bench_case *c, const cli_device_desc *dev,
                       int sets, const cli_timing *ceil, const cli_timing *t) {
  printf("{\"op\":");
  cli_json_string(stdout, op->name);
  printf(",\"device\":");
  cli_json_string(stdout, dev->label);
  printf(",\"device_name\":");
  cli_json_string(stdout, dev->name);
  printf(",%s,\"kernel\":", c->params_json);
  cli_json_string(stdout, c->kernel);
  printf(",\"bytes\":%llu,\"sets\":%d,\"warmup\":%lld,\"iters\":%lld,\"median_ms\":",
         (unsigned long long)c->traffic_bytes, sets, (long long)warmup, (long long)iters);
  cli_json_number(stdout, t->median_ms);
  printf(",\"min_ms\":");
  cli_json_number(stdout, t->min_ms);
  printf(",\"gbps\":");
  cli_json_number(stdout, gbps(c->traffic_bytes, t));
  if (c->flops > 0) {
    printf(",\"flops\":");
    cli_json_number(stdout, c->flops);
    printf(",\"tflops\":");
    cli_json_number(stdout, tflops(c->flops, t));
  }
  if (ceil) {
    double cg = gbps(c->traffic_bytes, ceil);
    printf(",\"copy_median_ms\":");
    cli_json_number(stdout, ceil->median_ms);
    printf(",\"copy_gbps\":");
    cli_json_number(stdout, cg);
    printf(",\"pct_of_copy\":");
    cli_json_number(stdout, cg > 0 ? 100.0 * gbps(c->traffic_bytes, t) / cg : NAN);
  }
  if (c->check_json[0]) printf(",%s", c->check_json);
  if (c->note_json[0]) printf(",%s", c->note_json);
  printf("}\n");
}

_Noreturn static void usage_no_op(const char *what) {
  char names[128] = "";
  for (int i = 0; i < NOPS; i++) {
    if (!ops[i]) continue;
    strncat(names, i ? ", " : "", sizeof names - strlen(names) - 1);
    strncat(names, ops[i]->name, sizeof names - strlen(names) - 1);
  }
  cli_usage_error("smelt bench", "%s (one of: %s)", what, names);
}

static void print_bench_help(void) {
  char about[1024];
  int len = snprintf(about, sizeof about,
                     "Times one op with device events (median of --iters runs after --warmup),\n"
                     "rotating input sets past L2, and quotes its bandwidth (bytes read + written)\n"
                     "against a device copy of the same traffic measured in the same run;\n"
                     "ops that count arithmetic (gemm) are quoted in TFLOP/s too.\n\nops:\n");
  for (int i = 0; i < NOPS; i++)
    if (ops[i]) len += snprintf(about + len, sizeof about - (size_t)len, "  %-12s %s\n", ops[i]->name, ops[i]->about);
  snprintf(about + len, sizeof about - (size_t)len,
           "\nRun 'smelt bench <op> --help' for the op's own options.\n");
  const cli_doc doc = {"smelt bench", "smelt bench <op> [options]", about};
  const cli_opt *const tables[] = {common_options, NULL};
  cli_print_help(stdout, &doc, tables);
}

int cli_cmd_bench(int argc, char **argv) {
  if (argc < 2) usage_no_op("missing <op>");
  if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
    print_bench_help();
    return CLI_EXIT_OK;
  }
  const cli_bench_op *op = NULL;
  for (int i = 0; i < NOPS; i++)
    if (ops[i] && strcmp(argv[1], ops[i]->name) == 0) op = ops[i];
  if (!op) {
    char what[96];
    snprintf(what, sizeof what, "unknown op '%s'", argv[1]);
    usage_no_op(what);
  }

  char command[64], usage[96], about[256];
  snprintf(command, sizeof command, "smelt bench %s", op->name);
  snprintf(usage, sizeof usage, "smelt bench %s [options]", op->name);
  snprintf(about, sizeof about, "Bench: %s.\n", op->about);
  cli_doc doc = {command, usage, about};
  const cli_opt *const tables[] = {op->options, common_options, NULL};
  if (cli_parse(&doc, argc - 1, argv + 1, tables)) return CLI_EXIT_OK;
  cli_require_range(&doc, "warmup", warmup, 0, 100000);
  cli_require_range(&doc, "iters", iters, 1, 100000);
  cli_require_range(&doc, "rotate", rotate, 0, MAX_SETS);
  cli_bench_case c;
  memset(&c, 0, sizeof c);
  op->describe(&doc, &c);

  char why[640];
  smelt_ctx *ctx = NULL;
  CLI_TRY(cli_ctx_open(&doc, device_opt, &ctx, why, sizeof why));
  cli_device_desc dev;
  cli_ctx_describe(ctx, &dev);
  int sets = rotate ? (int)rotate : default_sets(&dev, c.set_bytes);
  if (smelt_ctx_device(ctx) == SMELT_DEVICE_CPU) refuse_gpu_sizes_on_cpu(&doc, &c, sets, op != &cli_bench_copy);

  /* The ceiling moves the op's traffic: half read, half written, over sets
   * of its own (the op's sets are sized by the bytes that change between
   * runs, which for a decode step are a few KB beside hundreds of MB of
   * weights: 1024 copies of the traffic filled the GPU). */
  cli_timing ceil_t;
  int have_ceil = op != &cli_bench_copy;
  if (have_ceil) {
    const int own = default_sets(&dev, c.traffic_bytes ? c.traffic_bytes : 1);
    ceil_t = cli_bench_copy_ceiling(ctx, c.traffic_bytes / 2, sets < own ? sets : own, (int)warmup, (int)iters);
  }

  op->setup(ctx, sets, &c);
  if (smelt_ctx_device(ctx) == SMELT_DEVICE_CPU && c.check_text[0]) {
    /* The check's reference is the CPU backend: here it checked itself. */
    strncat(c.check_text, " (the CPU backend against itself: not an independent check)",
            sizeof c.check_text - strlen(c.check_text) - 1);
    strncat(c.check_json, ",\"check_independent\":false", sizeof c.check_json - strlen(c.check_json) - 1);
  }
  bench_work w = {op, sets};
  cli_timing t = cli_time_runs(ctx, (int)warmup, (int)iters, op_work, &w);
  op->teardown();
  smelt_ctx_destroy(ctx);

  if (json)
    print_json(op, &c, &dev, sets, have_ceil ? &ceil_t : NULL, &t);
  else
    print_text(op, &c, &dev, why, sets, have_ceil ? &ceil_t : NULL, &t);
  if (c.check_failed) {
    fflush(stdout);
    fprintf(stderr, "smelt bench %s: the check against the CPU backend failed: %s\n", op->name, c.check_text);
    return CLI_EXIT_FAIL;
  }
  return CLI_EXIT_OK;
}
