/* smelt_precompile: walks every op family's variant list and puts each
 * kernel's CUBIN for the given arch into the disk cache, one worker thread per
 * core. Needs NVRTC only. */
#include "cuda_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* "sm_" then 2-3 digits, at least 80, then at most one letter (sm_90a,
 * sm_100f): smelt's kernels need Ampere or newer, and a bad string should be
 * one clear error rather than NVRTC's. */
static int arch_is_supported(const char *a) {
  if (strncmp(a, "sm_", 3) != 0) return 0;
  const char *p = a + 3;
  int cc = 0, digits = 0;
  for (; *p >= '0' && *p <= '9' && digits < 4; p++, digits++) cc = cc * 10 + (*p - '0');
  if (*p >= 'a' && *p <= 'z') p++;
  return *p == '\0' && digits >= 2 && digits <= 3 && cc >= 80;
}

/* The work of one arch, shared by its worker threads: each takes the next
 * variant; the first failure stops them all and keeps its message (errors are
 * thread-local, so it is raised again on the calling thread). */
typedef struct {
  const char *arch;
  smelt__kernel_src *all;
  int total;
  smelt_progress_fn progress;
  void *user;
  pthread_mutex_t mu;
  int next, done;
  smelt_status status;
  char error[2048];
} precompile_job;

static void *worker(void *arg) {
  precompile_job *job = (precompile_job *)arg;
  for (;;) {
    pthread_mutex_lock(&job->mu);
    int i = job->status ? job->total : job->next++;
    pthread_mutex_unlock(&job->mu);
    if (i >= job->total) return NULL;
    void *bin = NULL;
    size_t n;
    int cached;
    double secs;
    smelt_status s = smelt__jit_cubin(&job->all[i], job->arch, &bin, &n, &cached, &secs);
    free(bin);
    pthread_mutex_lock(&job->mu);
    if (s && !job->status) {
      job->status = s;
      snprintf(job->error, sizeof job->error, "%s", smelt_last_error());
    }
    /* One progress call at a time, counting completions in order. */
    if (!s && ++job->done && job->progress)
      job->progress(job->user, job->all[i].name, job->done, job->total, secs, cached);
    pthread_mutex_unlock(&job->mu);
  }
}

/* NVRTC compiles are independent and NVRTC is thread-safe, so the variants
 * compile on every core: precompile and the compile test take minutes on one. */
static int worker_count(int total) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int n = cores > 0 ? (int)cores : 1;
  if (n > 32) n = 32;
  return n < total ? n : (total > 0 ? total : 1);
}

static smelt_status one_arch(const char *arch, smelt_progress_fn progress, void *user, int *count) {
  if (!smelt__cache_dir()[0]) {
    char why[768];
    smelt__cache_off_reason(why, sizeof why);
    return smelt__error(SMELT_STATUS_CACHE_ERROR, "smelt_precompile: nothing could be saved: %s",
                        why[0] ? why : "no cache folder (set SMELT_CACHE_DIR, XDG_CACHE_HOME or HOME)");
  }
  int total = 0;
  for (int f = 0; f < smelt__variant_enum_count; f++) total += smelt__variant_enums[f](NULL, 0);
  precompile_job job = {.arch = arch, .total = total, .progress = progress, .user = user};
  job.all = (smelt__kernel_src *)calloc((size_t)(total ? total : 1), sizeof *job.all);
  if (!job.all) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_precompile: out of host memory");
  int at = 0;
  for (int f = 0; f < smelt__variant_enum_count; f++) at += smelt__variant_enums[f](job.all + at, total - at);
  pthread_mutex_init(&job.mu, NULL);
  (void)smelt__nvrtc_info_get(); /* load NVRTC once, before the threads */
  pthread_t threads[32];
  int started = 0, want = worker_count(total);
  for (; started < want; started++)
    if (pthread_create(&threads[started], NULL, worker, &job) != 0) break;
  if (started == 0) worker(&job); /* no thread could start: compile here */
  for (int t = 0; t < started; t++) pthread_join(threads[t], NULL);
  pthread_mutex_destroy(&job.mu);
  free(job.all);
  *count += job.done;
  if (job.status) return smelt__error(job.status, "%s", job.error);
  return SMELT_OK;
}

smelt_status smelt_precompile(const char *arch, smelt_progress_fn progress, void *user, int *compiled_count) {
  int dummy = 0;
  int *count = compiled_count ? compiled_count : &dummy;
  *count = 0;
  smelt_status es = smelt__env_check("smelt_precompile");
  if (es) return es;
  if (smelt__env_is("SMELT_JIT", "off"))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "smelt_precompile: SMELT_JIT=off forbids compiling, and precompiling is compiling; run it "
                        "with SMELT_JIT unset (or on), then deploy with SMELT_JIT=off");
  if (arch) {
    if (!arch_is_supported(arch))
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                          "smelt_precompile: arch=\"%.40s\" is not a supported target: sm_80 or newer, such as "
                          "sm_80, sm_86, sm_89 or sm_90a",
                          arch);
    return one_arch(arch, progress, user, count);
  }
  smelt_system_info si;
  smelt_system_info_get(&si);
  if (!si.device_count)
    return smelt__error(SMELT_STATUS_NO_DEVICE, "smelt_precompile: no local GPU to take the arch from; pass one");
  for (int d = 0; d < si.device_count; d++) {
    smelt_device_info di;
    smelt_status s = smelt_device_info_get(d, &di);
    if (!s) s = one_arch(di.arch, progress, user, count);
    if (s) return s;
  }
  return SMELT_OK;
}
