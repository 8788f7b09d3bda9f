/* `smelt info`: everything a user (or a bug report) needs to know about this
 * installation, in the order things can go wrong: the library, the driver,
 * NVRTC, the devices, the kernel cache, then a live context and its pool.
 * Missing pieces are reported with the library's reason, not as failures:
 * info must work on a machine with no GPU at all. */
#include "cli.h"

static const cli_doc doc = {
    "smelt info",
    "smelt info",
    "Prints the library version, whether the CUDA driver and NVRTC were found\n"
    "(and why not), every device, the kernel cache, and the memory pool of a\n"
    "context on the default device: SMELT_DEVICE when set, else cuda when usable,\n"
    "else cpu.\n",
};

static const cli_opt options[] = {{NULL, CLI_OPT_FLAG, NULL, NULL, NULL}};

static void print_devices(const smelt_system_info *sys) {
  printf("devices    %d\n", sys->device_count);
  for (int i = 0; i < sys->device_count; i++) {
    smelt_device_info d;
    CLI_TRY(smelt_device_info_get(i, &d));
    char mem[32], l2[32], smem[32];
    printf("  cuda:%d   %s: %s (cc %d.%d), %d SMs, %s, L2 %s, smem/block %s\n", d.index, d.name,
           d.arch, d.cc_major, d.cc_minor, d.sm_count, cli_fmt_bytes(d.total_memory, mem, sizeof mem),
           cli_fmt_bytes(d.l2_bytes, l2, sizeof l2),
           cli_fmt_bytes((uint64_t)d.smem_per_block_optin, smem, sizeof smem));
  }
}

/* A context on the device the other commands would pick shows that one can
 * be made, and what its pool holds right after creation. */
static void print_context(void) {
  smelt_ctx *ctx = NULL;
  char why[640];
  smelt_status s = cli_ctx_open(&doc, NULL, &ctx, why, sizeof why);
  if (s != SMELT_OK) {
    printf("context    not created (%s): %s: %s\n", why, smelt_status_name(s), smelt_last_error());
    return;
  }
  cli_device_desc dev;
  cli_ctx_describe(ctx, &dev);
  smelt_pool_stats pool;
  smelt_cache_stats cache;
  CLI_TRY(smelt_pool_stats_get(ctx, &pool));
  CLI_TRY(smelt_cache_stats_get(ctx, &cache));
  char used[32], reserved[32], peak[32];
  printf("context    %s (%s), %s\n", dev.label, dev.name, why);
  printf("pool       used %s, reserved %s, peak %s\n", cli_fmt_bytes(pool.used, used, sizeof used),
         cli_fmt_bytes(pool.reserved, reserved, sizeof reserved),
         cli_fmt_bytes(pool.peak, peak, sizeof peak));
  printf("jit        %llu compiles (%.2f s), %llu disk hits, %llu memory hits in this process\n",
         (unsigned long long)cache.compiles, cache.compile_seconds,
         (unsigned long long)cache.disk_hits, (unsigned long long)cache.memory_hits);
  smelt_ctx_destroy(ctx);
}

int cli_cmd_info(int argc, char **argv) {
  const cli_opt *const tables[] = {options, NULL};
  if (cli_parse(&doc, argc, argv, tables)) return CLI_EXIT_OK;

  smelt_system_info sys;
  CLI_TRY(smelt_system_info_get(&sys));
  printf("smelt      %s\n", smelt_version_string());
  if (sys.driver_loaded)
    printf("driver     loaded, CUDA %d.%d (%d)\n", sys.driver_version / 1000,
           sys.driver_version % 1000 / 10, sys.driver_version);
  else
    printf("driver     not loaded: %s\n", sys.driver_error);
  if (sys.nvrtc_loaded)
    printf("nvrtc      %d.%d at %s\n", sys.nvrtc_major, sys.nvrtc_minor, sys.nvrtc_path);
  else
    printf("nvrtc      missing: %s\n", sys.nvrtc_error);
  print_devices(&sys);
  if (sys.cache_dir[0]) {
    char size[32];
    printf("cache      %s: %llu entries, %s\n", sys.cache_dir, (unsigned long long)sys.cache_entries,
           cli_fmt_bytes(sys.cache_bytes, size, sizeof size));
  } else {
    printf("cache      off: %s\n", sys.cache_error[0] ? sys.cache_error : "no SMELT_CACHE_DIR, XDG_CACHE_HOME or HOME");
  }
  print_context();
  return CLI_EXIT_OK;
}
