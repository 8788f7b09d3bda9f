/* smelt_precompile: walks every op family's variant list and puts each
 * kernel's CUBIN for the given arch into the disk cache. Needs NVRTC only. */
#include "cuda_internal.h"

#include <stdlib.h>
#include <string.h>

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

static smelt_status one_arch(const char *arch, smelt_progress_fn progress, void *user, int *count) {
  if (!smelt__cache_dir()[0]) {
    char why[768];
    smelt__cache_off_reason(why, sizeof why);
    return smelt__error(SMELT_STATUS_CACHE_ERROR, "smelt_precompile: nothing could be saved: %s",
                        why[0] ? why : "no cache folder (set SMELT_CACHE_DIR, XDG_CACHE_HOME or HOME)");
  }
  int total = 0;
  for (int f = 0; f < smelt__variant_enum_count; f++) total += smelt__variant_enums[f](NULL, 0);
  smelt__kernel_src *all = (smelt__kernel_src *)calloc((size_t)(total ? total : 1), sizeof *all);
  if (!all) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_precompile: out of host memory");
  int at = 0;
  for (int f = 0; f < smelt__variant_enum_count; f++) at += smelt__variant_enums[f](all + at, total - at);
  smelt_status s = SMELT_OK;
  for (int i = 0; i < total && !s; i++) {
    void *bin;
    size_t n;
    int cached;
    double secs;
    s = smelt__jit_cubin(&all[i], arch, &bin, &n, &cached, &secs);
    if (s) break;
    free(bin);
    (*count)++;
    if (progress) progress(user, all[i].name, i + 1, total, secs, cached);
  }
  free(all);
  return s;
}

smelt_status smelt_precompile(const char *arch, smelt_progress_fn progress, void *user, int *compiled_count) {
  int dummy = 0;
  int *count = compiled_count ? compiled_count : &dummy;
  *count = 0;
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
