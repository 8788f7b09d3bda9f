/* Timing with the library's events: device events on CUDA, the host clock on
 * the CPU backend, so one code path serves both. Reports the median (robust
 * to a stray slow run) and the minimum (the best the hardware did). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */

#include "cli.h"

#include <stdlib.h>
#include <time.h>

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

cli_timing cli_time_runs(smelt_ctx *ctx, int warmup, int iters, cli_work_fn fn, void *user) {
  int iter = 0;
  for (; iter < warmup; iter++) fn(user, iter);
  CLI_TRY(smelt_ctx_synchronize(ctx));

  smelt_event **ev = cli_malloc(2 * (size_t)iters * sizeof *ev);
  for (int i = 0; i < 2 * iters; i++) CLI_TRY(smelt_event_create(ctx, &ev[i]));
  for (int i = 0; i < iters; i++, iter++) {
    CLI_TRY(smelt_event_record(ev[2 * i]));
    fn(user, iter);
    CLI_TRY(smelt_event_record(ev[2 * i + 1]));
  }
  CLI_TRY(smelt_ctx_synchronize(ctx));

  double *ms = cli_malloc((size_t)iters * sizeof *ms);
  for (int i = 0; i < iters; i++) {
    float t;
    CLI_TRY(smelt_event_elapsed_ms(ev[2 * i], ev[2 * i + 1], &t));
    ms[i] = t;
  }
  for (int i = 0; i < 2 * iters; i++) smelt_event_destroy(ev[i]);
  free(ev);

  qsort(ms, (size_t)iters, sizeof *ms, cmp_double);
  cli_timing t;
  t.iters = iters;
  t.min_ms = ms[0];
  t.median_ms = iters % 2 ? ms[iters / 2] : 0.5 * (ms[iters / 2 - 1] + ms[iters / 2]);
  free(ms);
  return t;
}

double cli_now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
