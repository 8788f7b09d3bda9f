/* Compiles every kernel variant the selectors can pick, for sm_80 and sm_90a,
 * through NVRTC — on a machine without a GPU too, so kernel compile errors
 * never wait for a GPU run. The two arches compile in two processes. Without
 * NVRTC the test skips, unless SMELT_REQUIRE_NVRTC=1 (set by `make test`, so
 * CI cannot stay green by skipping it). */
#include "harness.h"
#include "cuda/cuda_internal.h"

#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Progress, so minutes of compiling on a small machine are not minutes of
 * silence: a line per arch every 15 seconds and at the end (every kernel
 * with SMELT_TEST_VERBOSE). Each arch's process prints its own. */
static void report(void *user, const char *kernel, int index, int total, double seconds, int cached) {
  static struct timespec start, last;
  static int compiled;
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  if (index == 1) start = last = now;
  compiled += !cached;
  (void)seconds;
  if (getenv("SMELT_TEST_VERBOSE"))
    printf("     [%d/%d] %s %s\n", index, total, kernel, cached ? "cached" : "compiled");
  else if (index == total || now.tv_sec - last.tv_sec >= 15)
    printf("     %s: %d/%d kernels (%d compiled, %d from the cache), %lld s\n", (const char *)user, index, total,
           compiled, index - compiled, (long long)(now.tv_sec - start.tv_sec));
  else
    return;
  last = now;
  fflush(stdout);
}

static void test_all_variants(void) {
  const smelt__nvrtc_info *ni = smelt__nvrtc_info_get();
  if (!ni->loaded) {
    const char *req = getenv("SMELT_REQUIRE_NVRTC");
    if (!req || strcmp(req, "1")) SKIP("NVRTC not found");
    th_fail(__FILE__, __LINE__, "SMELT_REQUIRE_NVRTC=1 but %s (scripts/setup-deps installs NVRTC)", ni->error);
    return;
  }
  static const char *arches[] = {"sm_80", "sm_90a"};
  fflush(stdout); /* the child must not print the parent's buffered lines again */
  pid_t kid = fork();
  const char *mine = kid == 0 ? arches[0] : arches[1];
  int count = 0;
  smelt_status s = smelt_precompile(mine, report, (void *)mine, &count);
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
