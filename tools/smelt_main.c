/* The `smelt` command: a table of subcommands, each in its own cmd_*.c file.
 * Exit status: 0 success, 1 a library error or failed check, 2 a usage error. */
#include "cli.h"

#include <string.h>

typedef struct cli_command {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *summary;
} cli_command;

static const cli_command commands[] = {
    {"info", cli_cmd_info, "versions, driver and NVRTC, devices, kernel cache, memory pool"},
    {"precompile", cli_cmd_precompile, "compile every kernel variant into the disk cache"},
    {"demo", cli_cmd_demo, "run each op on a model-shaped problem, check it, time it"},
    {"bench", cli_cmd_bench, "time one op against the device-copy bandwidth ceiling"},
};
enum { NCOMMANDS = sizeof commands / sizeof commands[0] };

static void print_usage(FILE *f) {
  fprintf(f, "usage: smelt <command> [options]\n\nsmelt %s: fused GPU kernels for machine learning.\n\n"
             "commands:\n",
          smelt_version_string());
  for (int i = 0; i < NCOMMANDS; i++) fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].summary);
  fprintf(f, "\nRun 'smelt <command> --help' for a command's options.\n"
             "Environment: SMELT_DEVICE=cpu|cuda|cuda:N, SMELT_CACHE_DIR, SMELT_JIT=off,\n"
             "SMELT_LOG=info|debug.\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    print_usage(stderr);
    return CLI_EXIT_USAGE;
  }
  const char *name = argv[1];
  if (strcmp(name, "-h") == 0 || strcmp(name, "--help") == 0) {
    print_usage(stdout);
    return CLI_EXIT_OK;
  }
  if (strcmp(name, "--version") == 0) {
    printf("smelt %s\n", smelt_version_string());
    return CLI_EXIT_OK;
  }
  for (int i = 0; i < NCOMMANDS; i++)
    if (strcmp(name, commands[i].name) == 0) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "smelt: unknown %s '%s'\nTry 'smelt --help'.\n",
          name[0] == '-' ? "option" : "command", name);
  return CLI_EXIT_USAGE;
}
