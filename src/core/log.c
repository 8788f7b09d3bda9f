/* Logging and the monotonic clock. Warnings print by default (an unusable
 * cache folder must not pass unseen); SMELT_LOG=off silences them, info and
 * debug say more. Messages go to stderr. */
#include "internal.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

int smelt__log_level(void) {
  /* Read each time: cheap, and tests may change it between calls. */
  /* An unknown value is refused by smelt__env_check; here it is the default. */
  const char *v = smelt__getenv("SMELT_LOG");
  if (!v) return SMELT__LOG_WARN;
  if (!strcmp(v, "debug")) return SMELT__LOG_DEBUG;
  if (!strcmp(v, "info")) return SMELT__LOG_INFO;
  if (!strcmp(v, "off")) return SMELT__LOG_OFF;
  return SMELT__LOG_WARN;
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
