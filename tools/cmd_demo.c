/* `smelt demo`: the ops on a problem shaped like one transformer layer's
 * (tokens = batch x seq rows of d_model features; router logits over the
 * experts), each run on the chosen device, checked against the CPU backend
 * and timed. It shows the library working end to end; `smelt bench` is the
 * tool for honest bandwidth numbers (it rotates inputs past L2, this does not).
 * Rows go to the device in blocks of --block-size, the way a serving loop
 * feeds them, while the reference gets the whole tensor in one call: the
 * comparison therefore also checks that blocking does not change results. */
#include "core/error_bound.h"
#include "demo.h"

#include <string.h>

/* Each op family's section, from the family list (a family without one is
 * a NULL entry, skipped). */
#define SECTION(name) {#name, cli_demo_##name},
static const cli_demo_section sections[] = {SMELT__FAMILY_LIST(SECTION)};
enum { NSECTIONS = sizeof sections / sizeof sections[0] };

/* Few runs: the demo shows an op, it does not benchmark one. */
enum { DEMO_WARMUP = 2, DEMO_ITERS = 10 };

static const char *device_opt;
static int64_t batch = 4, seq = 256, d_model = 1024, block = 0, experts = 8, top_k = 2;
static int profile_memory;

static const cli_doc doc = {
    "smelt demo",
    "smelt demo [options]",
    "Runs each op family on a problem shaped like one transformer layer's\n"
    "(batch*seq tokens of d_model features) on the device, checks each result\n"
    "against the CPU backend (max abs error within the op's bound), and times it\n"
    "(median of 10 runs). Exit status 1 when a check exceeds its bound.\n"
    "\n"
    "sections, in order:\n"
    "  activation  every activation over the [tokens, d_model] rows\n"
    "  softmax     softmax with its logsumexp over the same rows\n"
    "  topk        MoE-style top-k routing over [tokens, num-experts] logits\n"
    "  gemm        the MLP up-projection gelu(x W^T + b) to 4*d_model, fused\n"
    "              and unfused\n"
    "  conv2d      one ResNet 3x3 layer (28x28x64 -> 64, batch 2): fprop with\n"
    "              bias+relu fused, dgrad and wgrad, with the kernel each plan chose\n"
    "  attention   self-attention over the tokens (forward full and causal,\n"
    "              backward causal) against naive attention\n"
    "  peer        PEER over a million experts in the expert store (host tables,\n"
    "              an HBM cache): routing and the cache warming up\n"
    "  moe         a MoE layer (num-experts SwiGLU experts of width d_model,\n"
    "              softmax top-k): routing and load-balance statistics, timings\n"
    "  bem         the rank-16 BEM update of a [d_model, d_model] layer: validated,\n"
    "              and timed against the unfused form and the base layer\n"
    "On the CPU backend the gemm, conv2d, attention, peer, moe and bem problems are scaled down\n"
    "(each says so): the reference is naive loops.\n",
};

static const cli_opt options[] = {
    {"device", CLI_OPT_STRING, &device_opt, "cpu|cuda[:N]",
     "device to run on (default: cuda when usable, else cpu)"},
    {"batch-size", CLI_OPT_INT, &batch, "B", "sequences per batch (default 4)"},
    {"seq-len", CLI_OPT_INT, &seq, "S", "tokens per sequence (default 256)"},
    {"d-model", CLI_OPT_INT, &d_model, "D", "hidden size: softmax and activation row length (default 1024)"},
    {"block-size", CLI_OPT_INT, &block, "N", "rows per call on the device (default 0: all B*S rows)"},
    {"num-experts", CLI_OPT_INT, &experts, "E", "router logits per token (default 8)"},
    {"top-k", CLI_OPT_INT, &top_k, "K", "experts chosen per token (default 2)"},
    {"profile-memory", CLI_OPT_FLAG, &profile_memory, NULL,
     "print pool used/reserved/peak after each section"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

smelt_tensor cli_demo_rows(smelt_ctx *ctx, void *base, smelt_dtype dt, int64_t row0, int64_t rows,
                           int64_t cols) {
  int64_t shape[2] = {rows, cols};
  int64_t row_elems = cols ? cols : 1;
  char *p = (char *)base + (size_t)(row0 * row_elems) * smelt_dtype_size(dt);
  return smelt_tensor_make(p, dt, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), cols ? 2 : 1,
                           shape);
}

void cli_demo_blocks(const cli_demo_env *env, cli_demo_block_fn fn, void *user) {
  for (int64_t row0 = 0; row0 < env->tokens; row0 += env->block) {
    int64_t rows = env->tokens - row0 < env->block ? env->tokens - row0 : env->block;
    fn(user, row0, rows, rows == env->block ? 0 : 1);
  }
}

double cli_demo_bound(const cli_diff *d, const char *family, smelt_dtype dt) {
  const smelt__bound_query q = {.family = family, .metric = SMELT__METRIC_MAX_REL, .dtype = dt};
  return smelt__error_bound(&q) * (d->max_ref > 1.0 ? d->max_ref : 1.0);
}

void cli_demo_table(const char *title, const char *shapes) {
  printf("\n%s: %s\n", title, shapes);
  printf("  %-18s %12s %9s %5s %10s %9s  %s\n", "case", "max_abs_err", "bound", "check", "median_ms",
         "GB/s", "note");
}

void cli_demo_row(cli_demo_env *env, const char *label, const cli_diff *d, double bound,
                  int64_t cols, const cli_timing *t, double bytes, const char *note) {
  int ok = d->max_abs <= bound;
  if (!ok) env->failures++;
  printf("  %-18s %12.3e %9.1e %5s", label, d->max_abs, bound, ok ? "ok" : "FAIL");
  if (t)
    printf(" %10.4f %9.1f", t->median_ms,
           t->median_ms > 0 ? bytes / (t->median_ms * 1e-3) / 1e9 : 0.0);
  else
    printf(" %10s %9s", "", "");
  printf("  %s", note);
  if (!ok)
    printf(" (worst at [%lld, %lld])", (long long)(d->where / (size_t)cols),
           (long long)(d->where % (size_t)cols));
  printf("\n");
}

static void print_pool(smelt_ctx *ctx, const char *after) {
  smelt_pool_stats s;
  CLI_TRY(smelt_pool_stats_get(ctx, &s));
  char used[32], reserved[32], peak[32];
  printf("  pool after %s: used %s, reserved %s, peak %s\n", after,
         cli_fmt_bytes(s.used, used, sizeof used), cli_fmt_bytes(s.reserved, reserved, sizeof reserved),
         cli_fmt_bytes(s.peak, peak, sizeof peak));
}

/* Sizes are validated here so sections can trust them; the element limit
 * keeps the host-side reference buffers within reach of a laptop. */
static void validate(void) {
  const int64_t big = (int64_t)1 << 24;
  cli_require_range(&doc, "batch-size", batch, 1, big);
  cli_require_range(&doc, "seq-len", seq, 1, big);
  cli_require_range(&doc, "d-model", d_model, 1, big);
  cli_require_range(&doc, "num-experts", experts, 1, big);
  cli_require_range(&doc, "top-k", top_k, 1, experts);
  int64_t tokens = batch * seq;
  cli_require_range(&doc, "block-size", block, 0, tokens);
  const int64_t max_elems = (int64_t)1 << 28;
  if (tokens > max_elems / d_model || tokens > max_elems / experts)
    cli_usage_error(doc.command, "batch-size x seq-len x max(d-model, num-experts) exceeds %lld elements",
                    (long long)max_elems);
}

int cli_cmd_demo(int argc, char **argv) {
  const cli_opt *const tables[] = {options, NULL};
  if (cli_parse(&doc, argc, argv, tables)) return CLI_EXIT_OK;
  validate();

  char why[640];
  cli_demo_env env;
  memset(&env, 0, sizeof env);
  CLI_TRY(cli_ctx_open(&doc, device_opt, &env.ctx, why, sizeof why));
  env.cpu = cli_ctx_open_cpu();
  env.batch = batch;
  env.seq = seq;
  env.d_model = d_model;
  env.experts = experts;
  env.top_k = top_k;
  env.tokens = batch * seq;
  env.block = block ? block : env.tokens;
  env.warmup = DEMO_WARMUP;
  env.iters = DEMO_ITERS;

  cli_device_desc dev;
  cli_ctx_describe(env.ctx, &dev);
  if (smelt_ctx_device(env.ctx) == SMELT_DEVICE_CPU)
    printf("smelt demo on cpu (host CPU): the device under test is the CPU backend itself, so its checks are not\n"
           "independent (they show that calls in blocks match one whole call); `make test` checks the CPU\n"
           "backend against float64 references\n");
  else
    printf("smelt demo on %s (%s), checked against the CPU backend\n", dev.label, dev.name);
  printf("device: %s\n", why);
  printf("problem: batch %lld x seq %lld = %lld tokens, d_model %lld, %lld experts, top-%lld, "
         "blocks of %lld rows\n",
         (long long)batch, (long long)seq, (long long)env.tokens, (long long)d_model,
         (long long)experts, (long long)top_k, (long long)env.block);
  printf("timing: median of %d runs after %d warm-up runs\n", env.iters, env.warmup);

  for (int i = 0; i < NSECTIONS; i++) {
    if (!sections[i].run) continue;
    sections[i].run(&env);
    if (profile_memory) print_pool(env.ctx, sections[i].name);
  }

  smelt_ctx_destroy(env.cpu);
  smelt_ctx_destroy(env.ctx);
  if (env.failures) {
    fflush(stdout);
    fprintf(stderr, "smelt demo: %d check%s exceeded the bound\n", env.failures,
            env.failures == 1 ? "" : "s");
    return CLI_EXIT_FAIL;
  }
  printf("\nall checks within bounds\n");
  return CLI_EXIT_OK;
}
