/* The library's environment variables that take a word, each with the
 * words it knows. A value outside them is refused by name where contexts
 * are made and kernels precompiled (SMELT_JIT=bogus used to mean "on"), so
 * a typo fails once and loudly instead of changing nothing. Paths
 * (SMELT_CACHE_DIR, SMELT_NVRTC_PATH) are checked where they are opened,
 * SMELT_DEVICE where it is parsed, the PEER store's variables where a
 * store is made. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

typedef struct env_var {
  const char *name;
  const char *values[6]; /* NULL-terminated */
} env_var;

static const env_var vars[] = {
    {"SMELT_LOG", {"off", "warn", "warning", "info", "debug", NULL}},
    {"SMELT_JIT", {"on", "off", NULL}},
    {"SMELT_GEMM_TUNE", {"on", "off", NULL}},
    {"SMELT_GEMM_SPLIT_TAIL", {"on", "off", NULL}},
    {"SMELT_DUMP_SOURCE", {"0", "1", NULL}},
    {"SMELT_NVTX", {"0", "1", NULL}},
};

const char *smelt__getenv(const char *name) {
  const char *v = getenv(name);
  return (v && *v) ? v : NULL;
}

static int known(const env_var *e, const char *v) {
  for (int i = 0; e->values[i]; i++)
    if (!strcmp(v, e->values[i])) return 1;
  return 0;
}

smelt_status smelt__env_check(const char *op) {
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
    const char *v = smelt__getenv(vars[i].name);
    if (!v || known(&vars[i], v)) continue;
    char set[64] = "";
    for (int j = 0; vars[i].values[j]; j++) {
      strncat(set, j ? ", " : "", sizeof set - strlen(set) - 1);
      strncat(set, vars[i].values[j], sizeof set - strlen(set) - 1);
    }
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s=\"%.64s\" is not one of: %s (or unset)", op,
                        vars[i].name, v, set);
  }
  return SMELT_OK;
}

int smelt__env_is(const char *name, const char *value) {
  const char *v = smelt__getenv(name);
  return v && !strcmp(v, value);
}
