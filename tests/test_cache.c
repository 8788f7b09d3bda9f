/* JIT + disk cache tests: concurrent compiles from 8 processes leave one valid
 * entry; truncated or corrupted entries are rebuilt; an unusable folder falls
 * back to memory with a warning; keys change with source, options and arch.
 * A folder others can write or own is refused, planted links are not followed,
 * and precompile refuses bad archs and a cache that cannot save. With a GPU: load and launch a kernel, cold (compiled) and warm (disk hit). */
#include "harness.h"
#include "cuda/cuda_internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static void selftest_src(smelt__kernel_src *s, int scale) {
  memset(s, 0, sizeof *s);
  snprintf(s->name, sizeof s->name, "selftest_%d", scale);
  s->body = "selftest.cu";
  smelt__prelude_define(s, "SELFTEST_SCALE", scale);
}

static int have_nvrtc(void) { return smelt__nvrtc_info_get()->loaded; }

/* A fresh, empty cache folder under the build's temp area, set as SMELT_CACHE_DIR. */
static void fresh_cache_dir(char *dir, size_t n) {
  snprintf(dir, n, "/tmp/smelt-test-cache-XXXXXX");
  if (!mkdtemp(dir)) {
    th_fail(__FILE__, __LINE__, "mkdtemp failed");
    return;
  }
  setenv("SMELT_CACHE_DIR", dir, 1);
}

static int count_entries(const char *dir, char *first, size_t n) {
  DIR *d = opendir(dir);
  int count = 0;
  struct dirent *e;
  while (d && (e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (e->d_name[0] == '.' && l > 4 && !strcmp(e->d_name + l - 4, ".tmp")) count += 1000; /* stray temp */
    if (l > 6 && !strcmp(e->d_name + l - 6, ".cubin")) {
      if (first) snprintf(first, n, "%s/%s", dir, e->d_name);
      count++;
    }
  }
  if (d) closedir(d);
  return count;
}

static void remove_dir(const char *dir) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "    could not remove %s\n", dir);
}

static void restore_cache_env(void) {
  const char *keep = getenv("SMELT_TEST_CACHE_DIR");
  if (keep) setenv("SMELT_CACHE_DIR", keep, 1);
  else unsetenv("SMELT_CACHE_DIR");
}

/* Compiles s for arch through the disk cache, or loads it from there;
 * returns 1 for a disk hit, 0 for a compile, -1 for a failure (recorded). */
static int jit(const smelt__kernel_src *s, const char *arch) {
  void *bin = NULL;
  size_t n = 0;
  int cached = -1;
  double secs;
  smelt_status st = smelt__jit_cubin(s, arch, &bin, &n, &cached, &secs);
  CHECK_OK(st);
  CHECK(st || (bin && n > 0));
  free(bin);
  return st ? -1 : cached;
}

/* A fresh cache folder (dir) holding one entry (its path in entry): the
 * self-test kernel of the given scale (s) compiled for sm_80. Returns 1 when
 * the folder holds exactly that entry. */
static int cache_with_entry(char *dir, size_t dir_len, smelt__kernel_src *s, int scale, char *entry,
                            size_t entry_len) {
  fresh_cache_dir(dir, dir_len);
  selftest_src(s, scale);
  jit(s, "sm_80");
  return count_entries(dir, entry, entry_len) == 1;
}

static void test_keys(void) {
  if (!have_nvrtc()) SKIP("NVRTC not found");
  smelt__kernel_src a, b;
  selftest_src(&a, 2);
  selftest_src(&b, 2);
  char ka[65], kb[65], kc[65], kd[65];
  smelt__cache_key(&a, "sm_90a", ka);
  smelt__cache_key(&b, "sm_90a", kb);
  CHECK(!strcmp(ka, kb));
  selftest_src(&b, 3); /* a changed source (prelude) */
  smelt__cache_key(&b, "sm_90a", kc);
  CHECK(strcmp(ka, kc) != 0);
  smelt__cache_key(&a, "sm_80", kd); /* a changed option (--gpu-architecture) */
  CHECK(strcmp(ka, kd) != 0);
  CHECK_EQ_INT(strlen(ka), 64);
}

static int key_reads(const unsigned char *seen, const char *name) {
  const smelt__embedded_file *f = smelt__embedded_find(name);
  return f && seen[f - smelt__embedded_files];
}

/* The headers a key covers: those the body includes, directly or through
 * another header, and no other (gemm_sm90.cu reads gemm_epi_graph.cuh
 * through gemm_common.cuh, never attn_common.cuh), and a header included
 * under "smelt-key: if GEMM_CONV" only when the prelude defines GEMM_CONV. */
static void test_key_headers(void) {
  const smelt__embedded_file *body = smelt__embedded_find("gemm_sm90.cu");
  CHECK(body != NULL);
  if (!body) return;
  static const char *const in[] = {"gemm_common.cuh", "gemm_epi_graph.cuh", "smelt_device.cuh", "smelt_mma.cuh"};
  for (int conv = 0; conv < 2; conv++) {
    unsigned char seen[SMELT__MAX_EMBEDDED];
    memset(seen, 0, sizeof seen);
    const char *prelude = conv ? "#define GEMM_AB 3\n#define GEMM_CONV 2\n" : "#define GEMM_AB 3\n#define GEMM_CONVX 2\n";
    smelt__mark_includes(body->text, body->len, prelude, seen);
    for (size_t i = 0; i < sizeof in / sizeof *in; i++) CHECK(key_reads(seen, in[i]));
    CHECK(key_reads(seen, "conv2d_sm90.cuh") == conv);
    CHECK(!key_reads(seen, "attn_common.cuh"));
    CHECK(!key_reads(seen, "peer_common.cuh"));
  }
}

static void test_compile_and_reload(void) {
  if (!have_nvrtc()) SKIP("NVRTC not found");
  char dir[64], entry[600];
  fresh_cache_dir(dir, sizeof dir);
  smelt__kernel_src s;
  selftest_src(&s, 5);
  CHECK_EQ_INT(jit(&s, "sm_90a"), 0);
  CHECK_EQ_INT(count_entries(dir, entry, sizeof entry), 1);
  CHECK_EQ_INT(jit(&s, "sm_90a"), 1);
  /* Cache-only mode: a hit still works, a miss says how to warm the cache. */
  setenv("SMELT_JIT", "off", 1);
  CHECK_EQ_INT(jit(&s, "sm_90a"), 1);
  smelt__kernel_src other;
  selftest_src(&other, 6);
  void *bin = NULL;
  size_t n = 0;
  int cached;
  double secs;
  CHECK_STATUS(smelt__jit_cubin(&other, "sm_90a", &bin, &n, &cached, &secs), SMELT_STATUS_NOT_FOUND);
  CHECK_MSG("smelt precompile");
  unsetenv("SMELT_JIT");
  restore_cache_env();
  remove_dir(dir);
}

static void damage(const char *path, int truncate_it) {
  if (truncate_it) {
    CHECK(truncate(path, 50) == 0);
    return;
  }
  int fd = open(path, O_RDWR);
  CHECK(fd >= 0);
  unsigned char c = 0;
  CHECK(pread(fd, &c, 1, 300) == 1);
  c ^= 0x5a;
  CHECK(pwrite(fd, &c, 1, 300) == 1);
  close(fd);
}

static void test_bad_entries_rebuilt(void) {
  if (!have_nvrtc()) SKIP("NVRTC not found");
  for (int mode = 0; mode < 2; mode++) {
    char dir[64], entry[600];
    smelt__kernel_src s;
    REQUIRE(cache_with_entry(dir, sizeof dir, &s, 7, entry, sizeof entry));
    damage(entry, mode == 0);
    CHECK_EQ_INT(jit(&s, "sm_80"), 0); /* the damaged entry was a miss */
    CHECK_EQ_INT(jit(&s, "sm_80"), 1); /* and was rebuilt */
    restore_cache_env();
    remove_dir(dir);
  }
}

static void test_concurrent_processes(void) {
  if (!have_nvrtc()) SKIP("NVRTC not found");
  char dir[64];
  fresh_cache_dir(dir, sizeof dir);
  smelt__kernel_src s;
  selftest_src(&s, 11);
  pid_t kids[8];
  for (int i = 0; i < 8; i++) {
    kids[i] = fork();
    if (kids[i] == 0) {
      void *bin;
      size_t n;
      int cached;
      double secs;
      smelt_status st = smelt__jit_cubin(&s, "sm_90a", &bin, &n, &cached, &secs);
      _exit(st == SMELT_OK && n > 0 ? 0 : 1);
    }
  }
  int all_ok = 1;
  for (int i = 0; i < 8; i++) {
    int status = 0;
    waitpid(kids[i], &status, 0);
    all_ok = all_ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  CHECK(all_ok);
  CHECK_EQ_INT(count_entries(dir, NULL, 0), 1); /* one entry, no stray temp files */
  void *bin;
  size_t n;
  int cached;
  double secs;
  CHECK_OK(smelt__jit_cubin(&s, "sm_90a", &bin, &n, &cached, &secs));
  CHECK(cached == 1);
  free(bin);
  uint64_t compiles, hits;
  smelt__jit_stats(&compiles, &hits, &secs);
  CHECK(hits >= 1);
  restore_cache_env();
  remove_dir(dir);
}

/* In a child process (the warning is logged once per process): an unusable
 * folder still compiles, keeps the kernel in memory and logs a warning. */
static void test_unusable_folder(void) {
  if (!have_nvrtc()) SKIP("NVRTC not found");
  const char *dirs[] = {"/proc/self/smelt-cache", "/proc/self"}; /* cannot create; exists read-only */
  for (int i = 0; i < 2; i++) {
    char logpath[] = "/tmp/smelt-test-log-XXXXXX";
    int fd = mkstemp(logpath);
    REQUIRE(fd >= 0);
    pid_t pid = fork();
    if (pid == 0) {
      dup2(fd, 2);
      setenv("SMELT_LOG", "warn", 1);
      setenv("SMELT_CACHE_DIR", dirs[i], 1);
      smelt__kernel_src s;
      selftest_src(&s, 13);
      void *bin;
      size_t n;
      int cached;
      double secs;
      smelt_status st = smelt__jit_cubin(&s, "sm_80", &bin, &n, &cached, &secs);
      _exit(st == SMELT_OK && n > 0 && cached == 0 ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    char log[2048] = {0};
    ssize_t got = pread(fd, log, sizeof log - 1, 0);
    close(fd);
    unlink(logpath);
    CHECK(got > 0 && strstr(log, "kernels stay in memory only"));
  }
}

/* GPU: load through a context (cold compile into a fresh folder, then a warm
 * load from disk in a second context), launch, verify, report both times. */
static void test_gpu_cold_warm(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  char dir[64];
  fresh_cache_dir(dir, sizeof dir);
  smelt__kernel_src s;
  selftest_src(&s, 3);
  double times[2];
  for (int round = 0; round < 2; round++) {
    smelt_ctx *ctx;
    smelt_ctx_options o = smelt_ctx_options_default();
    o.use_env = 0;
    o.device = SMELT_DEVICE_CUDA;
    REQUIRE(smelt_ctx_create(&ctx, &o) == SMELT_OK);
    CUfunction f;
    double t0 = smelt__now_seconds();
    CHECK_OK(smelt__cuda_function(ctx, &s, "smelt_selftest", &f));
    times[round] = smelt__now_seconds() - t0;
    enum { N = 1000 };
    float hx[N], hy[N];
    for (int i = 0; i < N; i++) hx[i] = (float)th_rand_uniform(-1, 1);
    void *dx, *dy;
    CHECK_OK(smelt_alloc(ctx, sizeof hx, &dx));
    CHECK_OK(smelt_alloc(ctx, sizeof hy, &dy));
    CHECK_OK(smelt_memcpy_h2d(ctx, dx, hx, sizeof hx));
    long long n = N;
    void *params[] = {&dx, &dy, &n};
    CHECK_OK(smelt__cuda_launch(ctx, "selftest", f, (N + 255) / 256, 1, 1, 256, 0, params));
    CHECK_OK(smelt_memcpy_d2h(ctx, hy, dy, sizeof hy));
    int bad = 0;
    /* The GPU fuses the multiply-add; allow for the host's separate rounding. */
    for (int i = 0; i < N; i++) bad += fabsf(hy[i] - (hx[i] * 3.0f + 1.0f)) > 1e-6f;
    CHECK_EQ_INT(bad, 0);
    smelt_free(ctx, dx);
    smelt_free(ctx, dy);
    smelt_ctx_destroy(ctx);
  }
  printf("     kernel load: cold (NVRTC compile + load) %.1f ms, warm (disk cache + load) %.2f ms\n",
         1e3 * times[0], 1e3 * times[1]);
  restore_cache_env();
  remove_dir(dir);
}

/* GPU, Hopper: issue 4's compile figures for one Hopper GEMM variant (bf16,
 * 1024^3): plan + first run in a fresh folder (NVRTC compile + load), then
 * in a second context from the disk cache (A row-major, B column-major).
 * Printed, not asserted: timing bars belong in the benchmark record, not in
 * a test that can flake. */
static void test_gpu_gemm_hopper_cold_warm(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  smelt_device_info info;
  REQUIRE(smelt_device_info_get(0, &info) == SMELT_OK);
  if (info.cc_major != 9) SKIP("not a Hopper GPU");
  char dir[64];
  fresh_cache_dir(dir, sizeof dir);
  enum { N = 1024 };
  double times[2];
  char kernel[160] = "";
  for (int round = 0; round < 2; round++) {
    smelt_ctx *ctx;
    smelt_ctx_options o = smelt_ctx_options_default();
    o.use_env = 0;
    o.device = SMELT_DEVICE_CUDA;
    REQUIRE(smelt_ctx_create(&ctx, &o) == SMELT_OK);
    void *a, *b, *d;
    CHECK_OK(smelt_alloc(ctx, (size_t)N * N * 2, &a));
    CHECK_OK(smelt_alloc(ctx, (size_t)N * N * 2, &b));
    CHECK_OK(smelt_alloc(ctx, (size_t)N * N * 2, &d));
    int64_t shape[2] = {N, N};
    int di = smelt_ctx_device_index(ctx);
    smelt_tensor ta = smelt_tensor_make(a, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di, 2, shape),
                 tb = smelt_tensor_make(b, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di, 2, shape),
                 td = smelt_tensor_make(d, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, di, 2, shape);
    /* B column-major (the RC layout the Hopper kernel takes). */
    tb.strides[0] = 1;
    tb.strides[1] = N;
    smelt_plan *plan = NULL;
    double t0 = smelt__now_seconds();
    CHECK_OK(smelt_gemm_plan(ctx, NULL, &ta, &tb, NULL, &td, NULL, &plan));
    CHECK_OK(smelt_gemm_run(plan, &ta, &tb, NULL, &td, NULL));
    CHECK_OK(smelt_ctx_synchronize(ctx));
    times[round] = smelt__now_seconds() - t0;
    if (plan) snprintf(kernel, sizeof kernel, "%s", smelt_plan_describe(plan));
    smelt_plan_destroy(plan);
    smelt_free(ctx, a);
    smelt_free(ctx, b);
    smelt_free(ctx, d);
    smelt_ctx_destroy(ctx);
  }
  CHECK(strstr(kernel, "sm90") != NULL);
  printf("     hopper gemm (%s): cold (compile + load + run) %.1f ms, warm (disk cache + load + run) %.2f ms\n",
         kernel, 1e3 * times[0], 1e3 * times[1]);
  restore_cache_env();
  remove_dir(dir);
}

/* The cache folder is refused when it or a folder above it is writable by
 * others or owned by someone else, and when its path is too long; the reason
 * is kept for `smelt info`. Needs no NVRTC: only the folder is checked. */
static void expect_refused(const char *dir, const char *why) {
  setenv("SMELT_CACHE_DIR", dir, 1);
  CHECK(smelt__cache_dir()[0] == 0);
  char reason[768];
  smelt__cache_off_reason(reason, sizeof reason);
  if (!strstr(reason, why)) {
    th_fail(__FILE__, __LINE__, "cache refusal reason");
    fprintf(stderr, "    for %.60s: got \"%s\", want \"%s\"\n", dir, reason, why);
  }
}

static void test_untrusted_folders(void) {
  char dir[64], sub[128];
  fresh_cache_dir(dir, sizeof dir);
  CHECK(strcmp(smelt__cache_dir(), dir) == 0); /* mkdtemp's 0700 under sticky /tmp: trusted */
  CHECK(chmod(dir, 0777) == 0);
  expect_refused(dir, "writable by group or others");
  CHECK(chmod(dir, 01777) == 0); /* sticky is fine for a parent, never for the folder itself */
  expect_refused(dir, "writable by group or others");
  snprintf(sub, sizeof sub, "%s/cache", dir); /* a private folder below a sticky one, as in /tmp */
  setenv("SMELT_CACHE_DIR", sub, 1);
  CHECK(smelt__cache_dir()[0] != 0);
  CHECK(chmod(dir, 0777) == 0); /* below a shared one that is not sticky */
  expect_refused(sub, "writable by group or others");
  CHECK(chmod(dir, 0700) == 0);
  setenv("SMELT_CACHE_DIR", sub, 1);
  CHECK(smelt__cache_dir()[0] != 0);
  if (geteuid() == 0) { /* only root can give a folder away */
    CHECK(chown(sub, 65534, 65534) == 0);
    expect_refused(sub, "not by this user");
  }
  char long_dir[700];
  memset(long_dir, 'a', sizeof long_dir - 1);
  long_dir[0] = '/';
  long_dir[sizeof long_dir - 1] = 0;
  expect_refused(long_dir, "longer than");
  restore_cache_env();
  remove_dir(dir);
}

/* Entries and lock files are opened without following links: a planted link
 * at an entry's name is a miss, and one at the lock's name is not followed. */
static void test_planted_links(void) {
  if (!have_nvrtc()) SKIP("NVRTC not found");
  char dir[64], entry[600], moved[620], lock[600], target[600];
  smelt__kernel_src s;
  REQUIRE(cache_with_entry(dir, sizeof dir, &s, 17, entry, sizeof entry));
  /* A valid entry reached through a link is not loaded. */
  snprintf(moved, sizeof moved, "%s.elsewhere", entry);
  REQUIRE(rename(entry, moved) == 0 && symlink(moved, entry) == 0);
  CHECK_EQ_INT(jit(&s, "sm_80"), 0);
  /* Nor is an entry that others may write. */
  CHECK(chmod(entry, 0666) == 0);
  CHECK_EQ_INT(jit(&s, "sm_80"), 0);
  /* A link at a missing key's lock file: the file it names is never made. */
  smelt__kernel_src other;
  selftest_src(&other, 19);
  char key[65];
  smelt__cache_key(&other, "sm_80", key);
  snprintf(lock, sizeof lock, "%s/%s.lock", dir, key);
  snprintf(target, sizeof target, "%s/planted-target", dir);
  REQUIRE(symlink(target, lock) == 0);
  jit(&other, "sm_80");
  CHECK(access(target, F_OK) != 0);
  restore_cache_env();
  remove_dir(dir);
}

/* smelt_precompile refuses an over-long or pre-Ampere arch before hashing or
 * compiling anything, and fails when nothing could be saved. */
static void test_precompile_refusals(void) {
  char arch[400];
  memset(arch, '9', sizeof arch - 1);
  memcpy(arch, "sm_", 3);
  arch[sizeof arch - 1] = 0;
  int count = -1;
  CHECK_STATUS(smelt_precompile(arch, NULL, NULL, &count), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_EQ_INT(count, 0);
  CHECK_STATUS(smelt_precompile("sm_75", NULL, NULL, &count), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("sm_80 or newer");
  setenv("SMELT_CACHE_DIR", "/proc/self/smelt-cache", 1);
  CHECK_STATUS(smelt_precompile("sm_90a", NULL, NULL, &count), SMELT_STATUS_CACHE_ERROR);
  CHECK_MSG("nothing could be saved");
  CHECK_EQ_INT(count, 0);
  restore_cache_env();
}

const th_test th_tests_cache[] = {
    {"keys", test_keys},
    {"key_headers", test_key_headers},
    {"compile_and_reload", test_compile_and_reload},
    {"bad_entries_rebuilt", test_bad_entries_rebuilt},
    {"concurrent_processes", test_concurrent_processes},
    {"unusable_folder", test_unusable_folder},
    {"untrusted_folders", test_untrusted_folders},
    {"planted_links", test_planted_links},
    {"precompile_refusals", test_precompile_refusals},
    {"gpu_cold_warm", test_gpu_cold_warm},
    {"gpu_gemm_hopper_cold_warm", test_gpu_gemm_hopper_cold_warm},
    {0, 0},
};
