/* Compiles every kernel variant the selectors can pick, for sm_80 and sm_90a,
 * through NVRTC — on a machine without a GPU too, so kernel compile errors
 * never wait for a GPU run. The two arches compile in two processes. */
#include "harness.h"
#include "cuda/cuda_internal.h"

#include <sys/wait.h>
#include <unistd.h>

static void report(void *user, const char *kernel, int index, int total, double seconds, int cached) {
  (void)user;
  if (getenv("SMELT_TEST_VERBOSE"))
    printf("     [%d/%d] %s %s\n", index, total, kernel, cached ? "cached" : "compiled");
  (void)seconds;
}

static void test_all_variants(void) {
  if (!smelt__nvrtc_info_get()->loaded) SKIP("NVRTC not found");
  static const char *arches[] = {"sm_80", "sm_90a"};
  pid_t kid = fork();
  const char *mine = kid == 0 ? arches[0] : arches[1];
  int count = 0;
  smelt_status s = smelt_precompile(mine, report, NULL, &count);
  if (kid == 0) {
    if (s) fprintf(stderr, "    %s: %s\n", mine, smelt_last_error());
    _exit(s == SMELT_OK && count > 0 ? 0 : 1);
  }
  if (s) th_fail(__FILE__, __LINE__, "%s: %s", mine, smelt_last_error());
  CHECK(count > 0);
  int status = 0;
  waitpid(kid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  printf("     %d kernel variants per arch compiled for sm_80 and sm_90a\n", count);
}

const th_test th_tests_compile[] = {
    {"all_variants", test_all_variants},
    {0, 0},
};
