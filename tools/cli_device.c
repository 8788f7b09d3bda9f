/* Choosing and opening the context a command runs on, and moving data to and
 * from its memory. The choice order is the one users expect from other tools:
 * an explicit --device wins, then the SMELT_DEVICE environment variable (read
 * by the library through smelt_ctx_options_default), then "the GPU if there
 * is one". Falling back to the CPU is said out loud, with the library's
 * reason, because a silent fallback makes every timing misleading. */
#include "cli.h"

#include <stdlib.h>
#include <string.h>

static void parse_device(const cli_doc *doc, const char *s, smelt_device_kind *kind, int *index) {
  char *end;
  *index = 0;
  if (strcmp(s, "cpu") == 0) {
    *kind = SMELT_DEVICE_CPU;
    return;
  }
  if (strncmp(s, "cuda", 4) == 0) {
    *kind = SMELT_DEVICE_CUDA;
    if (s[4] == '\0') return;
    if (s[4] == ':' && s[5] >= '0' && s[5] <= '9') {
      long v = strtol(s + 5, &end, 10);
      if (*end == '\0' && v < 1024) {
        *index = (int)v;
        return;
      }
    }
  }
  cli_usage_error(doc->command, "--device '%s' is not one of: cpu, cuda, cuda:N", s);
}

smelt_status cli_ctx_open(const cli_doc *doc, const char *device, smelt_ctx **out, char *why,
                          size_t why_len) {
  smelt_ctx_options opts = smelt_ctx_options_default();
  if (device) {
    opts.use_env = 0;
    parse_device(doc, device, &opts.device, &opts.device_index);
    snprintf(why, why_len, "from --device");
    return smelt_ctx_create(out, &opts);
  }
  const char *env = getenv("SMELT_DEVICE");
  if (env && env[0]) {
    snprintf(why, why_len, "from SMELT_DEVICE=%s", env);
    return smelt_ctx_create(out, &opts);
  }
  opts.device = SMELT_DEVICE_CUDA;
  opts.device_index = 0;
  smelt_status s = smelt_ctx_create(out, &opts);
  if (s != SMELT_STATUS_NO_DEVICE) {
    snprintf(why, why_len, "%s", s == SMELT_OK ? "default (CUDA is usable)" : "default: cuda");
    return s;
  }
  snprintf(why, why_len, "default fell back to the CPU: %s", smelt_last_error());
  *out = cli_ctx_open_cpu();
  return SMELT_OK;
}

smelt_ctx *cli_ctx_open_cpu(void) {
  smelt_ctx_options opts = smelt_ctx_options_default();
  opts.use_env = 0;
  opts.device = SMELT_DEVICE_CPU;
  opts.device_index = 0;
  smelt_ctx *ctx = NULL;
  CLI_TRY(smelt_ctx_create(&ctx, &opts));
  return ctx;
}

void cli_ctx_describe(smelt_ctx *ctx, cli_device_desc *out) {
  memset(out, 0, sizeof *out);
  if (smelt_ctx_device(ctx) == SMELT_DEVICE_CPU) {
    snprintf(out->label, sizeof out->label, "cpu");
    snprintf(out->name, sizeof out->name, "host CPU");
    return;
  }
  smelt_device_info info;
  int index = smelt_ctx_device_index(ctx);
  CLI_TRY(smelt_device_info_get(index, &info));
  snprintf(out->label, sizeof out->label, "cuda:%d", index);
  snprintf(out->name, sizeof out->name, "%s", info.name);
  out->l2_bytes = info.l2_bytes;
  out->total_memory = info.total_memory;
}

void *cli_dev_alloc(smelt_ctx *ctx, size_t bytes) {
  void *p = NULL;
  CLI_TRY(smelt_alloc(ctx, bytes, &p));
  return p;
}

void *cli_dev_upload(smelt_ctx *ctx, const void *host, size_t bytes) {
  void *p = cli_dev_alloc(ctx, bytes);
  CLI_TRY(smelt_memcpy_h2d(ctx, p, host, bytes));
  return p;
}

void cli_dev_download(smelt_ctx *ctx, void *host, const void *dev, size_t bytes) {
  CLI_TRY(smelt_memcpy_d2h(ctx, host, dev, bytes));
  CLI_TRY(smelt_ctx_synchronize(ctx));
}
