/* NVTX ranges around every op so profilers show smelt by name. NVTX's
 * injection library is opened lazily; without it these are no-ops. */
#include "cuda_internal.h"

#include <dlfcn.h>
#include <pthread.h>

static int (*push_a)(const char *);
static int (*pop)(void);
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load(void) {
  /* Only worth a dlopen when a profiler asked for ranges (it sets this). */
  if (!smelt__getenv("NVTX_INJECTION64_PATH") && !smelt__env_is("SMELT_NVTX", "1")) return;
  /* libnvtx3interop (CUDA 13's nvidia-nvtx wheel) and libnvToolsExt (older
   * toolkits) export the NVTX C API and forward to the profiler's injection. */
  static const char *names[] = {"libnvtx3interop.so.1", "libnvToolsExt.so.1", "nvidia/cu13/lib/libnvtx3interop.so.1",
                                "nvidia/nvtx/lib/libnvToolsExt.so.1"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    void *h = i < 2 ? dlopen(names[i], RTLD_NOW | RTLD_LOCAL) : smelt__dlopen_pip(names[i]);
    if (!h) continue;
    *(void **)&push_a = dlsym(h, "nvtxRangePushA");
    *(void **)&pop = dlsym(h, "nvtxRangePop");
    if (push_a && pop) return;
    push_a = NULL;
    pop = NULL;
  }
}

void smelt__nvtx_push(const char *name) {
  pthread_once(&once, load);
  if (push_a) push_a(name);
}

void smelt__nvtx_pop(void) {
  if (pop) pop();
}
