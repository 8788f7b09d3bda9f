/* How the command ends when something goes wrong. Library code never exits;
 * the command does, with a status that scripts can tell apart: 1 for a
 * library error (named by its status and the library's own message), 2 for a
 * usage error. */
#include "cli.h"

#include <stdarg.h>
#include <stdlib.h>

_Noreturn void cli_fail(smelt_status s) {
  const char *msg = smelt_last_error();
  fflush(stdout); /* what was printed so far comes first when both go to one pipe */
  /* Some statuses come without a message; the fixed description still says what failed. */
  fprintf(stderr, "smelt: %s: %s\n", smelt_status_name(s), msg[0] ? msg : smelt_status_string(s));
  exit(CLI_EXIT_FAIL);
}

_Noreturn void cli_usage_error(const char *cmd, const char *fmt, ...) {
  va_list ap;
  fflush(stdout);
  fprintf(stderr, "%s: ", cmd);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\nTry '%s --help'.\n", cmd);
  exit(CLI_EXIT_USAGE);
}

_Noreturn void cli_fatal(const char *fmt, ...) {
  va_list ap;
  fflush(stdout);
  fprintf(stderr, "smelt: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n");
  exit(CLI_EXIT_FAIL);
}

void *cli_malloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) cli_fatal("out of host memory allocating %zu bytes", bytes);
  return p;
}
