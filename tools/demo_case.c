/* The demo's row op cases: an input and outputs of env->tokens rows each,
 * run on the CPU backend in one call (the reference) and on the device block
 * by block. Activation, softmax and top-k differ only in their buffers and
 * in the one call that plans and runs, so the data, the blocking, the
 * transfers, the timing and the comparison are written once here. */
#include "demo.h"

#include <stdlib.h>

size_t cli_demo_case_elems(const cli_demo_case *c, int i) {
  return (size_t)(c->env->tokens * (c->buf[i].cols ? c->buf[i].cols : 1));
}

size_t cli_demo_case_bytes(const cli_demo_case *c, int i) {
  return cli_demo_case_elems(c, i) * smelt_dtype_size(c->buf[i].dt);
}

void cli_demo_case_load(cli_demo_case *c, uint64_t seed, double lo, double hi) {
  smelt_ctx *ctx = c->env->ctx;
  cli_demo_buf *in = &c->buf[0];
  in->host = cli_host_uniform(in->dt, cli_demo_case_elems(c, 0), seed, lo, hi);
  in->dev = cli_dev_upload(ctx, in->host, cli_demo_case_bytes(c, 0));
  for (int i = 1; i < c->nbuf; i++) {
    const size_t bytes = cli_demo_case_bytes(c, i);
    c->buf[i].host = cli_malloc(bytes);
    c->buf[i].ref = cli_malloc(bytes);
    c->buf[i].dev = cli_dev_alloc(ctx, bytes);
  }
}

/* Views of rows [row0, row0 + rows) of every buffer: the device's, or the
 * host's with the outputs' references (ctx is then the CPU backend). */
static void views_of(const cli_demo_case *c, smelt_ctx *ctx, int on_host, int64_t row0, int64_t rows,
                     smelt_tensor *views) {
  for (int i = 0; i < c->nbuf; i++) {
    const cli_demo_buf *b = &c->buf[i];
    void *p = !on_host ? b->dev : i == 0 ? b->host : b->ref;
    views[i] = cli_demo_rows(ctx, p, b->dt, row0, rows, b->cols);
  }
}

static void run_block(void *user, int64_t row0, int64_t rows, int slot) {
  cli_demo_case *c = user;
  smelt_tensor views[CLI_DEMO_MAX_BUFS];
  views_of(c, c->env->ctx, 0, row0, rows, views);
  c->op(c, c->env->ctx, &c->plan[slot], views);
}

/* Runs every block of the case `user` once (a cli_time_runs work function). */
static void run_all(void *user, int iter) {
  cli_demo_case *c = user;
  (void)iter;
  cli_demo_blocks(c->env, run_block, c);
}

cli_timing cli_demo_case_run(cli_demo_case *c) {
  smelt_tensor views[CLI_DEMO_MAX_BUFS];
  smelt_plan *ref_plan = NULL;
  views_of(c, c->env->cpu, 1, 0, c->env->tokens, views);
  c->op(c, c->env->cpu, &ref_plan, views);
  smelt_plan_destroy(ref_plan);

  run_all(c, 0);
  for (int i = 1; i < c->nbuf; i++)
    cli_dev_download(c->env->ctx, c->buf[i].host, c->buf[i].dev, cli_demo_case_bytes(c, i));
  return cli_time_runs(c->env->ctx, c->env->warmup, c->env->iters, run_all, c);
}

cli_diff cli_demo_case_diff(const cli_demo_case *c, int i) {
  return cli_compare(c->buf[i].host, c->buf[i].ref, c->buf[i].dt, cli_demo_case_elems(c, i));
}

void cli_demo_case_reset(cli_demo_case *c) {
  for (int i = 0; i < 2; i++) {
    smelt_plan_destroy(c->plan[i]);
    c->plan[i] = NULL;
  }
}

void cli_demo_case_free(cli_demo_case *c) {
  cli_demo_case_reset(c);
  for (int i = 0; i < c->nbuf; i++) {
    CLI_TRY(smelt_free(c->env->ctx, c->buf[i].dev));
    free(c->buf[i].host);
    free(c->buf[i].ref);
    c->buf[i].dev = c->buf[i].host = c->buf[i].ref = NULL;
  }
}
