/* The test runner: every suite's tests in order, each with a fresh seed
 * (SMELT_TEST_SEED fixes it), ending with "N passed, N failed, N skipped".
 * An argument filters tests by substring; `--exclude S` skips those matching S;
 * `--suite NAME` runs that suite alone (a substring would also match, say,
 * qgemm/ for gemm/); `--suites` lists the suite names.
 * The op families' suites come from the family list, in its order. */
#include "core/families.h"
#include "cuda/cuda_internal.h"
#include "harness.h"

#include <time.h>

extern const th_test th_tests_core[];
extern const th_test th_tests_cache[];
extern const th_test th_tests_gemm_tune[];
extern const th_test th_tests_gemm_gemv[];
extern const th_test th_tests_gemm_offs_sm90[];
extern const th_test th_tests_gemm_prep[];
extern const th_test th_tests_gemm_scales[];
extern const th_test th_tests_gemm_fp8blk[];
extern const th_test th_tests_epi_graph[];
extern const th_test th_tests_compile[];
extern const th_test th_tests_threads[];
extern const th_test th_tests_inputs[];
extern const th_test th_tests_moe_bwd[];
extern const th_test th_tests_attn_mods[];
extern const th_test th_tests_graph[];
/* Every op family has a suite of its name (src/core/families.h). */
#define SUITE_DECL(name) extern const th_test th_tests_##name[];
SMELT__FAMILY_LIST(SUITE_DECL)
#define SUITE(name) {#name, th_tests_##name},

static const struct {
  const char *name;
  const th_test *tests;
} suites[] = {
    {"core", th_tests_core},
    {"cache", th_tests_cache},
    SMELT__FAMILY_LIST(SUITE)
    {"moe_bwd", th_tests_moe_bwd},
    {"attn_mods", th_tests_attn_mods},
    {"inputs", th_tests_inputs},
    {"threads", th_tests_threads},
    {"gemm_tune", th_tests_gemm_tune},
    {"gemm_gemv", th_tests_gemm_gemv},
    {"gemm_offs_sm90", th_tests_gemm_offs_sm90},
    {"gemm_prep", th_tests_gemm_prep},
    {"gemm_scales", th_tests_gemm_scales},
    {"gemm_fp8blk", th_tests_gemm_fp8blk},
    {"epi_graph", th_tests_epi_graph},
    {"graph", th_tests_graph},
    {"compile", th_tests_compile},
};

int main(int argc, char **argv) {
  const char *filter = NULL, *exclude = NULL, *only = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--exclude") && i + 1 < argc) exclude = argv[++i];
    else if (!strcmp(argv[i], "--suite") && i + 1 < argc) only = argv[++i];
    else if (!strcmp(argv[i], "--suites")) {
      for (size_t s = 0; s < sizeof suites / sizeof *suites; s++) printf("%s\n", suites[s].name);
      return 0;
    } else filter = argv[i];
  }
  const char *seed_env = getenv("SMELT_TEST_SEED");
  uint64_t base = seed_env ? strtoull(seed_env, NULL, 10) : (uint64_t)time(NULL);
  printf("smelt tests (seed base %llu; CUDA %s)\n", (unsigned long long)base,
         th_cuda() ? "available: GPU cases run" : "not available: CPU cases only");
  int passed = 0, failed = 0, skipped = 0, index = 0;
  for (size_t s = 0; s < sizeof suites / sizeof *suites; s++) {
    if (only && strcmp(only, suites[s].name)) continue;
    for (const th_test *t = suites[s].tests; t->name; t++) {
      char full[200];
      snprintf(full, sizeof full, "%s/%s", suites[s].name, t->name);
      if ((filter && !strstr(full, filter)) || (exclude && strstr(full, exclude))) continue;
      th_seed_set(base + (uint64_t)index++ * 7919u);
      th_failed_now = 0;
      th_skipped_now = 0;
      smelt_clear_error();
      struct timespec a, b;
      /* Kernels compiled during a test (not found in the disk cache) are
       * named in its line: they, not the GPU, are most of a slow test. */
      uint64_t c0, c1, h0, h1;
      double j0, j1;
      smelt__jit_stats(&c0, &h0, &j0);
      clock_gettime(CLOCK_MONOTONIC, &a);
      t->fn();
      clock_gettime(CLOCK_MONOTONIC, &b);
      smelt__jit_stats(&c1, &h1, &j1);
      double secs = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
      const char *verdict = th_failed_now ? "FAIL" : th_skipped_now ? "skip" : "ok";
      if (c1 > c0)
        printf("%-4s %s (%.2f s; %llu kernels compiled in %.1f s)\n", verdict, full, secs,
               (unsigned long long)(c1 - c0), j1 - j0);
      else
        printf("%-4s %s (%.2f s)\n", verdict, full, secs);
      fflush(stdout);
      if (th_failed_now) failed++;
      else if (th_skipped_now) skipped++;
      else passed++;
    }
  }
  th_contexts_destroy();
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed ? 1 : 0;
}
