/* Status names and messages (generated from SMELT_STATUS_LIST) and the
 * thread-local last-error message every failed call leaves behind. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[2048];

const char *smelt_status_name(smelt_status s) {
  switch (s) {
#define SMELT__NAME(name, value, msg) \
  case SMELT_STATUS_##name:           \
    return "SMELT_STATUS_" #name;
    SMELT_STATUS_LIST(SMELT__NAME)
#undef SMELT__NAME
  }
  return "SMELT_STATUS_UNKNOWN";
}

const char *smelt_status_string(smelt_status s) {
  switch (s) {
#define SMELT__MSG(name, value, msg) \
  case SMELT_STATUS_##name:          \
    return msg;
    SMELT_STATUS_LIST(SMELT__MSG)
#undef SMELT__MSG
  }
  return "unknown status";
}

const char *smelt_last_error(void) { return last_error; }

void smelt_clear_error(void) { last_error[0] = 0; }

smelt_status smelt__error(smelt_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  smelt__log(SMELT__LOG_DEBUG, "error %s: %s", smelt_status_name(s), last_error);
  return s;
}

int smelt_version(void) {
  return SMELT_VERSION_MAJOR * 10000 + SMELT_VERSION_MINOR * 100 + SMELT_VERSION_PATCH;
}

const char *smelt_version_string(void) { return SMELT_VERSION_STRING; }
