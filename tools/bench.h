/* The benchmarks. Each op is one file with one cli_bench_op; the runner in
 * cmd_bench.c owns what they share: the common options, the context, input
 * rotation past L2, the copy ceiling, timing and output. One op runs per
 * process, so an op keeps its buffers and plan in file-scope state. */
#ifndef SMELT_CLI_BENCH_H
#define SMELT_CLI_BENCH_H

#include "cli.h"
#include "core/families.h"

typedef struct cli_bench_case {
  char params_text[256];  /* "rows=8192 cols=4096 dtype=f32" */
  char params_json[512];  /* "\"rows\":8192,\"cols\":4096,\"dtype\":\"f32\"" */
  uint64_t set_bytes;     /* device memory one input + output set occupies */
  uint64_t fixed_bytes;   /* memory beside the sets (weights, tables, gradients), 0 when none to speak of */
  double cpu_bytes_per_s; /* the CPU reference's rate where slower than the runner assumes; 0: assumed */
  uint64_t traffic_bytes; /* bytes the op must read plus write per run */
  double flops;           /* arithmetic per run (2 per multiply-add): quoted in TFLOP/s when > 0 */
  char kernel[160];       /* what runs: the plan's description */
  /* An op that checks its result against the CPU backend (in setup) says how
   * it went: one line of text, the same as JSON members, and whether the
   * check failed (the command then exits 1). Empty when no check ran. */
  char check_text[192];
  char check_json[256];
  int check_failed;
  /* What else the op measured in setup (MoE's routing statistics): a line
   * of text under note_label, and the same as JSON members. Empty: none. */
  const char *note_label;
  char note_text[256];
  char note_json[384];
} cli_bench_case;

typedef struct cli_bench_op {
  const char *name;
  const char *about;
  const cli_opt *options; /* the op's own; the runner adds the common ones */
  /* Validates the op's options (usage errors exit 2); fills c but kernel. */
  void (*describe)(const cli_doc *doc, cli_bench_case *c);
  /* Allocates `sets` input + output sets, uploads random inputs, plans once
   * (every set has the planned shapes); fills c->kernel (and the check_
   * fields when the op checked its result). */
  void (*setup)(smelt_ctx *ctx, int sets, cli_bench_case *c);
  void (*run)(int set);
  void (*teardown)(void);
} cli_bench_op;

extern const cli_bench_op cli_bench_copy;
/* Each op family's bench, cli_bench_<name> (src/core/families.h): weak, so
 * a family may have none. */
#define CLI_BENCH_DECL(name) extern const cli_bench_op cli_bench_##name __attribute__((weak));
SMELT__FAMILY_LIST(CLI_BENCH_DECL)

/* Times a device-to-device copy of `bytes` rotated over `sets` buffer pairs:
 * the bandwidth ceiling every other op is quoted against. */
cli_timing cli_bench_copy_ceiling(smelt_ctx *ctx, uint64_t bytes, int sets, int warmup, int iters);

/* `sets` device buffers of `bytes` each: uninitialized, or each a copy of
 * `host` (the same data at different addresses defeats caching just as well
 * as different data, and costs one host fill). */
void **cli_bench_alloc_sets(smelt_ctx *ctx, size_t bytes, int sets);
void **cli_bench_upload_sets(smelt_ctx *ctx, const void *host, size_t bytes, int sets);
void cli_bench_free_sets(smelt_ctx *ctx, void **bufs, int sets);
/* Fills a device buffer with 0xFF bytes (NaN in every float type), so that
 * a check sees every element a run left unwritten. */
void cli_bench_poison(smelt_ctx *ctx, void *dev, size_t bytes);

#endif /* SMELT_CLI_BENCH_H */
