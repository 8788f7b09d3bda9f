/* `smelt precompile`: fills the disk cache with every kernel variant the
 * selectors can pick, for each requested arch, so deployments can run with
 * SMELT_JIT=off. No GPU is needed; without one (and without --arch) it builds
 * for the two archs smelt tunes for, Ampere (sm_80) and Hopper (sm_90a). */
#include "cli.h"

#include <ctype.h>
#include <string.h>

static cli_list arches;

static const cli_doc doc = {
    "smelt precompile",
    "smelt precompile [--arch sm_90a]...",
    "Compiles every kernel variant into the disk cache (see 'smelt info' for its\n"
    "folder), printing one line per kernel. Default archs: those of the local\n"
    "devices, or sm_80 and sm_90a when there is none.\n",
};

static const cli_opt options[] = {
    {"arch", CLI_OPT_LIST, &arches, "ARCH", "target arch, repeatable or comma-separated (sm_80, sm_90a)"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

/* "sm_" then digits then at most one letter (sm_90a, sm_100f): catching a
 * typo here gives a usage error instead of an NVRTC failure. */
static int arch_is_valid(const char *a) {
  if (strncmp(a, "sm_", 3) != 0 || !isdigit((unsigned char)a[3])) return 0;
  const char *p = a + 3;
  while (isdigit((unsigned char)*p)) p++;
  if (islower((unsigned char)*p)) p++;
  return *p == '\0';
}

static void add_arch(cli_list *list, const char *arch) {
  for (int i = 0; i < list->n; i++)
    if (strcmp(list->item[i], arch) == 0) return;
  snprintf(list->item[list->n++], sizeof list->item[0], "%s", arch);
}

/* Each local device's arch once; the defaults when there is no device. */
static void default_arches(cli_list *list) {
  smelt_system_info sys;
  CLI_TRY(smelt_system_info_get(&sys));
  for (int i = 0; i < sys.device_count && list->n < CLI_LIST_MAX; i++) {
    smelt_device_info d;
    CLI_TRY(smelt_device_info_get(i, &d));
    add_arch(list, d.arch);
  }
  if (list->n == 0) {
    add_arch(list, "sm_80");
    add_arch(list, "sm_90a");
  }
}

/* `index` counts from 1, as the line does. */
static void progress(void *user, const char *kernel, int index, int total, double seconds,
                     int cached) {
  (void)user;
  if (cached)
    printf("[%d/%d] %s  cached\n", index, total, kernel);
  else
    printf("[%d/%d] %s  %.2f s\n", index, total, kernel, seconds);
  fflush(stdout); /* progress is for watching, also through a pipe */
}

int cli_cmd_precompile(int argc, char **argv) {
  const cli_opt *const tables[] = {options, NULL};
  if (cli_parse(&doc, argc, argv, tables)) return CLI_EXIT_OK;
  for (int i = 0; i < arches.n; i++)
    if (!arch_is_valid(arches.item[i]))
      cli_usage_error(doc.command, "--arch '%s' is not an arch like sm_80 or sm_90a", arches.item[i]);
  cli_list targets = {0};
  for (int i = 0; i < arches.n; i++) add_arch(&targets, arches.item[i]);
  if (targets.n == 0) default_arches(&targets);

  for (int i = 0; i < targets.n; i++) {
    int compiled = 0;
    double t0 = cli_now_seconds();
    CLI_TRY(smelt_precompile(targets.item[i], progress, NULL, &compiled));
    printf("compiled %d kernels for %s in %.2f s\n", compiled, targets.item[i],
           cli_now_seconds() - t0);
  }
  return CLI_EXIT_OK;
}
