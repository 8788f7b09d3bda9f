/* The demo's sections and what they share. A section is one function that
 * runs one op family on the model-shaped problem described by cli_demo_env:
 * on the device under test, checked against the CPU backend, timed. A new
 * family adds a section file; cmd_demo.c finds it through the family list. */
#ifndef SMELT_CLI_DEMO_H
#define SMELT_CLI_DEMO_H

#include "cli.h"
#include "core/families.h"

typedef struct cli_demo_env {
  smelt_ctx *ctx; /* the device under test */
  smelt_ctx *cpu; /* the CPU backend: the reference */
  int64_t batch, seq, d_model, experts, top_k;
  int64_t tokens; /* batch * seq: the rows every section works on */
  int64_t block;  /* rows per call on the device (<= tokens) */
  int warmup, iters;
  int failures;   /* checks over their bound so far */
} cli_demo_env;

typedef struct cli_demo_section {
  const char *name;
  void (*run)(cli_demo_env *env);
} cli_demo_section;

/* Each op family's section, cli_demo_<name> (src/core/families.h): weak,
 * so a family may have none. */
#define CLI_DEMO_DECL(name) void cli_demo_##name(cli_demo_env *env) __attribute__((weak));
SMELT__FAMILY_LIST(CLI_DEMO_DECL)

/* A view of rows [row0, row0 + rows) of a contiguous [*, cols] matrix on the
 * context's device; cols == 0 gives the 1-D [rows] view of a vector. */
smelt_tensor cli_demo_rows(smelt_ctx *ctx, void *base, smelt_dtype dt, int64_t row0, int64_t rows,
                           int64_t cols);
/* Calls fn for each block of rows in order: [0, block), [block, 2 block), ...
 * `slot` is 0 for a full block and 1 for a shorter last one: sections keep one
 * plan per slot and reuse it for every block of that shape, as a serving loop
 * would. */
typedef void (*cli_demo_block_fn)(void *user, int64_t row0, int64_t rows, int slot);
void cli_demo_blocks(const cli_demo_env *env, cli_demo_block_fn fn, void *user);

/* The largest error a row of `family` allows in an output of dtype dt
 * (src/core/error_bound.c, one element's worst) at d's scale: the larger
 * of its largest reference magnitude and 1. */
double cli_demo_bound(const cli_diff *d, const char *family, smelt_dtype dt);
/* A row op's case (tools/demo_case.c): its buffers of env->tokens rows,
 * buf[0] the input and the others its outputs, and the function that plans
 * (once per block slot) and runs the op on ctx with views of them. The
 * reference is the same function on the CPU backend over all rows in one
 * call. A section that needs more (activation's desc) puts the case first
 * in a struct of its own. */
enum { CLI_DEMO_MAX_BUFS = 3 };
typedef struct cli_demo_buf {
  smelt_dtype dt;
  int64_t cols; /* elements a row; 0: one, seen as a 1-D view */
  void *host;   /* the input's values, or an output as the device wrote it */
  void *ref;    /* an output as the CPU backend wrote it */
  void *dev;
} cli_demo_buf;
typedef struct cli_demo_case cli_demo_case;
typedef void (*cli_demo_op_fn)(cli_demo_case *c, smelt_ctx *ctx, smelt_plan **plan, const smelt_tensor *views);
struct cli_demo_case {
  cli_demo_env *env;
  cli_demo_op_fn op;
  int nbuf;
  cli_demo_buf buf[CLI_DEMO_MAX_BUFS];
  smelt_plan *plan[2]; /* the device's, one per block slot */
};
/* The elements and the bytes of buffer i. */
size_t cli_demo_case_elems(const cli_demo_case *c, int i);
size_t cli_demo_case_bytes(const cli_demo_case *c, int i);
/* Fills the input with seeded uniform values in [lo, hi) (cli_fill_uniform)
 * and uploads it; allocates the outputs on the host and the device. */
void cli_demo_case_load(cli_demo_case *c, uint64_t seed, double lo, double hi);
/* Runs the reference, then every block once on the device; downloads the
 * outputs and times the device's runs (the env's warm-up, then its timed
 * runs). */
cli_timing cli_demo_case_run(cli_demo_case *c);
/* Output i as the device wrote it against the reference. */
cli_diff cli_demo_case_diff(const cli_demo_case *c, int i);
/* Destroys the device's plans (a new problem plans again). */
void cli_demo_case_reset(cli_demo_case *c);
/* Destroys the plans and frees every buffer. */
void cli_demo_case_free(cli_demo_case *c);

/* Starts a section's table: its title, the shapes, the column header. */
void cli_demo_table(const char *title, const char *shapes);
/* One row: the case, its largest error against the CPU backend and the bound
 * (a row over its bound says FAIL, names the worst element as [row, col] of a
 * matrix with `cols` columns, and counts in env->failures), then the median
 * time and the bandwidth implied by `bytes` moved per run (blank when t is
 * NULL: a second output of the same run), then a note. */
void cli_demo_row(cli_demo_env *env, const char *label, const cli_diff *d, double bound,
                  int64_t cols, const cli_timing *t, double bytes, const char *note);

#endif /* SMELT_CLI_DEMO_H */
