/* Logging and small environment helpers. Library code never prints unless
 * SMELT_LOG asks for it (warn, info or debug); messages go to stderr. */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *smelt__getenv(const char *name) {
  const char *v = getenv(name);
  return (v && *v) ? v : NULL;
}

int smelt__log_level(void) {
  /* Read each time: cheap, and tests may change it between calls. */
  const char *v = smelt__getenv("SMELT_LOG");
  if (!v) return SMELT__LOG_OFF;
  if (!strcmp(v, "debug")) return SMELT__LOG_DEBUG;
  if (!strcmp(v, "info")) return SMELT__LOG_INFO;
  if (!strcmp(v, "warn") || !strcmp(v, "warning")) return SMELT__LOG_WARN;
  return SMELT__LOG_OFF;
}

void smelt__log(int level, const char *fmt, ...) {
  if (level > smelt__log_level()) return;
  static const char *names[] = {"", "warn", "info", "debug"};
  char line[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "smelt %s: %s\n", names[level], line);
}

double smelt__now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
