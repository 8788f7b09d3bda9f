/* Opens NVRTC at run time and compiles kernel sources to CUBIN for an exact
 * arch. $SMELT_NVRTC_PATH, when set, is the only library tried (one that does
 * not open is an error, never a silent fallback to another NVRTC); otherwise
 * the sonames by major version, then CUDA_HOME / CUDA_PATH / /usr/local/cuda,
 * then pip's nvidia-cuda-nvrtc wheels in the usual site-packages folders (the
 * Python binding names its own environment's wheel through SMELT_NVRTC_PATH).
 * Kernels include only smelt's own headers (passed to NVRTC from the embedded
 * copies), so no toolkit headers are needed. */
#include "cuda_internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;

static struct {
  const char *(*GetErrorString)(nvrtcResult);
  nvrtcResult (*Version)(int *, int *);
  nvrtcResult (*CreateProgram)(nvrtcProgram *, const char *, const char *, int, const char *const *,
                               const char *const *);
  nvrtcResult (*DestroyProgram)(nvrtcProgram *);
  nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char *const *);
  nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t *);
  nvrtcResult (*GetProgramLog)(nvrtcProgram, char *);
  nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t *);
  nvrtcResult (*GetCUBIN)(nvrtcProgram, char *);
} rtc;

static smelt__nvrtc_info info;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void *open_lib(void) {
  void *h;
  const char *env = smelt__getenv("SMELT_NVRTC_PATH");
  if (env) {
    if (!(h = dlopen(env, RTLD_NOW | RTLD_LOCAL)))
      snprintf(info.error, sizeof info.error, "SMELT_NVRTC_PATH: %.400s (unset it to search the usual places)",
               dlerror());
    return h;
  }
  static const char *sonames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so"};
  for (size_t i = 0; i < sizeof sonames / sizeof *sonames; i++)
    if ((h = dlopen(sonames[i], RTLD_NOW | RTLD_LOCAL))) return h;
  const char *roots[] = {smelt__getenv("CUDA_HOME"), smelt__getenv("CUDA_PATH"), "/usr/local/cuda"};
  char pat[600];
  for (size_t i = 0; i < 3; i++) {
    if (!roots[i]) continue;
    snprintf(pat, sizeof pat, "%s/lib64/libnvrtc.so.[0-9]*", roots[i]);
    if ((h = smelt__dlopen_glob(pat))) return h;
    snprintf(pat, sizeof pat, "%s/lib/libnvrtc.so.[0-9]*", roots[i]);
    if ((h = smelt__dlopen_glob(pat))) return h;
  }
  if ((h = smelt__dlopen_pip("nvidia/cu13/lib/libnvrtc.so.[0-9]*"))) return h;
  return smelt__dlopen_pip("nvidia/cuda_nvrtc/lib/libnvrtc.so.[0-9]*");
}

static void load(void) {
  void *h = open_lib();
  if (!h) {
    if (!info.error[0]) /* else SMELT_NVRTC_PATH's own error */
      snprintf(info.error, sizeof info.error,
               "libnvrtc not found (tried libnvrtc.so.13/.12/.11.2, CUDA_HOME, CUDA_PATH, /usr/local/cuda, "
               "pip nvidia-cuda-nvrtc); install the CUDA toolkit's NVRTC or `pip install nvidia-cuda-nvrtc`, "
               "or set SMELT_NVRTC_PATH");
    return;
  }
#define SMELT__RTC(field, sym)                                                            \
  if (!(*(void **)&rtc.field = dlsym(h, sym))) {                                          \
    snprintf(info.error, sizeof info.error, "%.400s lacks %s", info.path, sym);               \
    return;                                                                               \
  }
  SMELT__RTC(GetErrorString, "nvrtcGetErrorString")
  SMELT__RTC(Version, "nvrtcVersion")
  SMELT__RTC(CreateProgram, "nvrtcCreateProgram")
  SMELT__RTC(DestroyProgram, "nvrtcDestroyProgram")
  SMELT__RTC(CompileProgram, "nvrtcCompileProgram")
  SMELT__RTC(GetProgramLogSize, "nvrtcGetProgramLogSize")
  SMELT__RTC(GetProgramLog, "nvrtcGetProgramLog")
  SMELT__RTC(GetCUBINSize, "nvrtcGetCUBINSize")
  SMELT__RTC(GetCUBIN, "nvrtcGetCUBIN")
#undef SMELT__RTC
  /* Record the file actually opened, for `smelt info`. */
  Dl_info di;
  if (dladdr(*(void **)&rtc.Version, &di) && di.dli_fname) snprintf(info.path, sizeof info.path, "%s", di.dli_fname);
  rtc.Version(&info.major, &info.minor);
  info.loaded = 1;
}

const smelt__nvrtc_info *smelt__nvrtc_info_get(void) {
  pthread_once(&once, load);
  return &info;
}

int smelt__nvrtc_options(const char *arch, const char **opts, int max) {
  static _Thread_local char archopt[64];
  snprintf(archopt, sizeof archopt, "--gpu-architecture=%s", arch);
  /* No -ftz or fast math: the quantizers' MXFP8 scaling and others rely on
   * subnormals surviving a multiply (kernels/quant_math.cuh). */
  const char *all[] = {archopt, "-std=c++17", "-lineinfo", "-default-device", "--include-path=/smelt"};
  int n = (int)(sizeof all / sizeof *all);
  for (int i = 0; i < n && i < max; i++) opts[i] = all[i];
  return n;
}

/* The full program text: a generated header line, the prelude, then the body. */
static char *program_text(const smelt__kernel_src *src, smelt_status *st) {
  const smelt__embedded_file *body = smelt__embedded_find(src->body);
  if (!body) {
    *st = smelt__error(SMELT_STATUS_INTERNAL, "smelt jit: kernel body %s is not embedded", src->body);
    return NULL;
  }
  size_t n = strlen(src->name) + strlen(src->prelude) + body->len + strlen(src->body) + 128;
  char *text = (char *)malloc(n);
  if (!text) {
    *st = smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt jit: out of host memory");
    return NULL;
  }
  snprintf(text, n, "// Generated by smelt for kernel %s.\n%s#line 1 \"%s\"\n%s", src->name, src->prelude,
           src->body, body->text);
  *st = SMELT_OK;
  return text;
}

static void dump_source(const char *name, const char *text, const char *const *opts, int nopts) {
  fprintf(stderr, "smelt: source of kernel %s (options:", name);
  for (int i = 0; i < nopts; i++) fprintf(stderr, " %s", opts[i]);
  fprintf(stderr, ")\n");
  int line = 1;
  const char *p = text;
  while (*p) {
    const char *e = strchr(p, '\n');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    fprintf(stderr, "%5d  %.*s\n", line++, (int)len, p);
    p += len + (e ? 1 : 0);
  }
}

smelt_status smelt__nvrtc_compile(const smelt__kernel_src *src, const char *arch, void **cubin,
                                  size_t *size) {
  *cubin = NULL;
  *size = 0;
  const smelt__nvrtc_info *ni = smelt__nvrtc_info_get();
  if (!ni->loaded) return smelt__error(SMELT_STATUS_COMPILE_ERROR, "smelt jit: %s", ni->error);
  smelt_status st;
  char *text = program_text(src, &st);
  if (!text) return st;
  /* Every embedded header is offered under its own name. */
  const char *hnames[64], *htexts[64];
  int nh = 0;
  for (int i = 0; i < smelt__embedded_count && nh < 64; i++) {
    const char *nm = smelt__embedded_files[i].name;
    size_t l = strlen(nm);
    if (l > 4 && !strcmp(nm + l - 4, ".cuh")) {
      hnames[nh] = nm;
      htexts[nh] = smelt__embedded_files[i].text;
      nh++;
    }
  }
  nvrtcProgram prog = NULL;
  char fname[128];
  snprintf(fname, sizeof fname, "%s.cu", src->name);
  nvrtcResult r = rtc.CreateProgram(&prog, text, fname, nh, htexts, hnames);
  if (r != 0) {
    free(text);
    return smelt__error(SMELT_STATUS_COMPILE_ERROR, "smelt jit: nvrtcCreateProgram(%s): %s", src->name,
                        rtc.GetErrorString(r));
  }
  const char *opts[16];
  int nopts = smelt__nvrtc_options(arch, opts, 16);
  r = rtc.CompileProgram(prog, nopts, opts);
  size_t logn = 0;
  rtc.GetProgramLogSize(prog, &logn);
  char *log = (char *)malloc(logn + 1);
  if (log) {
    log[0] = 0;
    if (logn) rtc.GetProgramLog(prog, log);
    log[logn] = 0;
  }
  if (r != 0) {
    if (smelt__env_is("SMELT_DUMP_SOURCE", "1")) dump_source(src->name, text, opts, nopts);
    st = smelt__error(SMELT_STATUS_COMPILE_ERROR, "smelt jit: compiling %s for %s failed: %s\n%s%s", src->name,
                      arch, rtc.GetErrorString(r), log ? log : "",
                      smelt__env_is("SMELT_DUMP_SOURCE", "1") ? "" : "(set SMELT_DUMP_SOURCE=1 to print the source)");
    free(log);
    free(text);
    rtc.DestroyProgram(&prog);
    return st;
  }
  if (log && log[0]) smelt__log(SMELT__LOG_DEBUG, "nvrtc log for %s:\n%s", src->name, log);
  free(log);
  free(text);
  size_t n = 0;
  rtc.GetCUBINSize(prog, &n);
  void *bin = n ? malloc(n) : NULL;
  if (!bin) {
    rtc.DestroyProgram(&prog);
    return smelt__error(SMELT_STATUS_COMPILE_ERROR, "smelt jit: no CUBIN for %s on %s", src->name, arch);
  }
  rtc.GetCUBIN(prog, (char *)bin);
  rtc.DestroyProgram(&prog);
  *cubin = bin;
  *size = n;
  return SMELT_OK;
}
