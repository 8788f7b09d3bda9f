/* Opens the CUDA driver at run time. We dlopen libcuda.so.1 (never the
 * toolkit's libcuda.so stub, which fails every call) and resolve each entry
 * point through cuGetProcAddress with an explicit ABI version: a plain dlsym of
 * e.g. "cuMemAlloc" returns the CUDA 3.x ABI (32-bit sizes). */
#include "cuda_internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static smelt__cu_api api;
static int api_ok;
static int driver_version;
static char why_not[512];
static pthread_once_t once = PTHREAD_ONCE_INIT;

typedef CUresult (*get_proc_v2_fn)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*get_proc_v1_fn)(const char *, void **, int, unsigned long long);

static void load(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(why_not, sizeof why_not, "libcuda.so.1 not found (no NVIDIA driver): %s", dlerror());
    return;
  }
  get_proc_v2_fn gp2 = (get_proc_v2_fn)dlsym(lib, "cuGetProcAddress_v2");
  get_proc_v1_fn gp1 = gp2 ? NULL : (get_proc_v1_fn)dlsym(lib, "cuGetProcAddress");
  if (!gp2 && !gp1) {
    snprintf(why_not, sizeof why_not, "libcuda.so.1 has no cuGetProcAddress (driver older than CUDA 11.3)");
    return;
  }
#define SMELT__RESOLVE(name, params)                                                         \
  {                                                                                          \
    void *fn = NULL;                                                                         \
    int found = 0;                                                                           \
    CUresult r = gp2 ? gp2(#name, &fn, SMELT__CU_ABI, 0, &found) : gp1(#name, &fn, SMELT__CU_ABI, 0); \
    if (r != 0 || !fn) {                                                                     \
      snprintf(why_not, sizeof why_not, "driver lacks %s (error %d); CUDA 12 or newer needed", #name, r); \
      return;                                                                                \
    }                                                                                        \
    memcpy(&api.name, &fn, sizeof fn);                                                       \
  }
  SMELT__CU_FUNCS(SMELT__RESOLVE)
#undef SMELT__RESOLVE
  CUresult r = api.cuInit(0);
  if (r != 0) {
    const char *name = "?";
    api.cuGetErrorName(r, &name);
    snprintf(why_not, sizeof why_not, "cuInit failed: %s (%d) — no usable GPU?", name, r);
    return;
  }
  api.cuDriverGetVersion(&driver_version);
  api_ok = 1;
}

const smelt__cu_api *smelt__cu(const char **why) {
  pthread_once(&once, load);
  if (!api_ok && why) *why = why_not;
  return api_ok ? &api : NULL;
}

int smelt__cu_driver_version(void) {
  pthread_once(&once, load);
  return driver_version;
}

smelt_status smelt__cu_error(CUresult r, const char *op, const char *what) {
  const char *name = "CUDA_ERROR_UNKNOWN", *text = "";
  if (api_ok) {
    api.cuGetErrorName(r, &name);
    api.cuGetErrorString(r, &text);
  }
  smelt_status s = r == SMELT__CU_ERROR_OUT_OF_MEMORY ? SMELT_STATUS_OUT_OF_MEMORY : SMELT_STATUS_DRIVER_ERROR;
  return smelt__error(s, "%s: %s failed: %s (%s)", op, what, name, text ? text : "");
}
