/* Shared pieces of the `smelt` command: exits, option parsing, contexts and
 * device memory, host data, timing and formatting.
 *
 * The command uses nothing of the library but include/smelt.h, so it is also
 * the first real user of the public API: anything it needs and cannot do
 * through that header is missing from the API. Tool symbols carry the cli_
 * prefix so they never meet the library's smelt_/smelt__ names. */
#ifndef SMELT_CLI_H
#define SMELT_CLI_H

#include "smelt.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* ---------------------------------------------------------------- commands */

/* Each takes the arguments after "smelt" (argv[0] is the command's name) and
 * returns the process exit status. */
int cli_cmd_info(int argc, char **argv);
int cli_cmd_precompile(int argc, char **argv);
int cli_cmd_demo(int argc, char **argv);
int cli_cmd_bench(int argc, char **argv);

/* ---------------------------------------------------------------- exits */

/* 0 success; 1 a library error or a failed check; 2 a usage error. */
enum { CLI_EXIT_OK = 0, CLI_EXIT_FAIL = 1, CLI_EXIT_USAGE = 2 };

/* Prints "smelt: <status name>: <last error>" to stderr and exits 1. */
_Noreturn void cli_fail(smelt_status s);
#define CLI_TRY(call)                                 \
  do {                                                \
    smelt_status cli_try_s_ = (call);                 \
    if (cli_try_s_ != SMELT_OK) cli_fail(cli_try_s_); \
  } while (0)

/* Prints "<cmd>: <message>" and a pointer to --help to stderr, exits 2. */
_Noreturn void cli_usage_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Prints "smelt: <message>" to stderr and exits 1 (host-side failures). */
_Noreturn void cli_fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* malloc that exits through cli_fatal when the host is out of memory. */
void *cli_malloc(size_t bytes);

/* ---------------------------------------------------------------- options */

typedef enum cli_opt_kind {
  CLI_OPT_FLAG,   /* int, set to 1 when present */
  CLI_OPT_INT,    /* int64_t; a k, M or G suffix multiplies by 2^10, 2^20, 2^30 */
  CLI_OPT_STRING, /* const char *, pointing into argv */
  CLI_OPT_LIST    /* cli_list: repeatable, each value may be comma-separated */
} cli_opt_kind;

#define CLI_LIST_MAX 16
typedef struct cli_list {
  int n;
  char item[CLI_LIST_MAX][32];
} cli_list;

/* One option; a table of them ends with an entry whose name is NULL. */
typedef struct cli_opt {
  const char *name; /* without the leading "--" */
  cli_opt_kind kind;
  void *value;
  const char *metavar; /* shown in --help after the name; NULL for flags */
  const char *help;    /* one line, with the default in parentheses */
} cli_opt;

typedef struct cli_doc {
  const char *command; /* "smelt bench softmax": prefixes messages */
  const char *usage;   /* "smelt bench softmax [options]" */
  const char *about;   /* a paragraph, lines ending in \n */
} cli_doc;

/* Parses argv[1..argc) against `tables` (a NULL-terminated list of option
 * tables). Accepts "--name value" and "--name=value". Returns 1 when -h or
 * --help printed the help (the command then exits 0), else 0. Unknown options,
 * positional arguments and bad values are usage errors (exit 2). */
int cli_parse(const cli_doc *doc, int argc, char **argv, const cli_opt *const *tables);
/* Prints the help that --help prints, to `f`. */
void cli_print_help(FILE *f, const cli_doc *doc, const cli_opt *const *tables);
/* A usage error unless lo <= v <= hi; returns v as an int64_t. */
int64_t cli_require_range(const cli_doc *doc, const char *name, int64_t v, int64_t lo, int64_t hi);
/* Parses a dtype option that must be one of `allowed`; usage error otherwise. */
smelt_dtype cli_require_dtype(const cli_doc *doc, const char *name, const char *value,
                              const smelt_dtype *allowed, int n);

/* ---------------------------------------------------------------- contexts */

/* What a command needs to know about the device a context runs on. */
typedef struct cli_device_desc {
  char label[32];  /* "cuda:0" or "cpu" */
  char name[256];  /* "NVIDIA H200" or "host CPU" */
  uint64_t l2_bytes;     /* 0 on the CPU: the API does not report host caches */
  uint64_t total_memory; /* 0 on the CPU */
} cli_device_desc;

/* Opens the context a command runs on. `device` is the --device value
 * ("cpu", "cuda", "cuda:N"; a bad one is a usage error) or NULL: then
 * SMELT_DEVICE decides when set, else CUDA when a context can be created,
 * else the CPU. `why` receives one line saying how the device was chosen.
 * Returns the library's status when the chosen context cannot be created. */
smelt_status cli_ctx_open(const cli_doc *doc, const char *device, smelt_ctx **out, char *why,
                          size_t why_len);
/* A CPU-backend context: the reference the device results are checked against. */
smelt_ctx *cli_ctx_open_cpu(void);
void cli_ctx_describe(smelt_ctx *ctx, cli_device_desc *out);

/* Device memory of the context (CLI_TRY inside: failures exit). */
void *cli_dev_alloc(smelt_ctx *ctx, size_t bytes);
void *cli_dev_upload(smelt_ctx *ctx, const void *host, size_t bytes);
void cli_dev_download(smelt_ctx *ctx, void *host, const void *dev, size_t bytes);

/* ---------------------------------------------------------------- host data */

/* Uniform random values in [lo, hi) rounded to dt (f64, f32, f16, bf16),
 * from a seeded generator so every run and machine sees the same inputs. */
void cli_fill_uniform(void *buf, smelt_dtype dt, size_t n, uint64_t seed, double lo, double hi);
/* A new host buffer (free it with free) of n such values. */
void *cli_host_uniform(smelt_dtype dt, size_t n, uint64_t seed, double lo, double hi);
/* Random bytes (for copies, where only the byte count matters). */
void cli_fill_bytes(void *buf, size_t bytes, uint64_t seed);
/* Element i of a host buffer as a double (f64, f32, f16, bf16, i32, i64). */
double cli_load(const void *buf, smelt_dtype dt, size_t i);

typedef struct cli_diff {
  double max_abs;     /* largest |got - ref| (inf where exactly one is NaN) */
  size_t where;       /* its element index */
  double max_ref;     /* largest finite |ref|, for scaling the bound */
  int64_t mismatches; /* elements that are not exactly equal */
} cli_diff;
cli_diff cli_compare(const void *got, const void *ref, smelt_dtype dt, size_t n);

/* ---------------------------------------------------------------- timing */

typedef struct cli_timing {
  double median_ms;
  double min_ms;
  int iters;
} cli_timing;

/* One unit of work; `iter` counts up across warm-up and timed runs (benches
 * use it to rotate input sets). Failures exit through CLI_TRY. */
typedef void (*cli_work_fn)(void *user, int iter);
/* Runs fn `warmup` times, then `iters` times between a pair of smelt events
 * each. All events are recorded before one synchronize, so host launch gaps
 * between runs are not measured. */
cli_timing cli_time_runs(smelt_ctx *ctx, int warmup, int iters, cli_work_fn fn, void *user);
/* Seconds on the host's monotonic clock (for work with no context). */
double cli_now_seconds(void);

/* ---------------------------------------------------------------- formatting */

/* "512 B", "1.5 KiB", "60.0 MiB", "139.8 GiB". */
const char *cli_fmt_bytes(uint64_t bytes, char *buf, size_t n);
/* A JSON string literal, escaped. */
void cli_json_string(FILE *f, const char *s);
/* A JSON number; null when not finite (JSON has no inf or NaN). */
void cli_json_number(FILE *f, double v);

#endif /* SMELT_CLI_H */
