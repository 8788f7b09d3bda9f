/* smelt_precompile: walks every op family's variant list and puts each
 * kernel's CUBIN for the given arch into the disk cache. Needs NVRTC only. */
#include "cuda_internal.h"

#include <stdlib.h>
#include <string.h>

static smelt_status one_arch(const char *arch, smelt_progress_fn progress, void *user, int *count) {
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
    if (strncmp(arch, "sm_", 3) || strlen(arch) < 5)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                          "smelt_precompile: arch=\"%s\" must look like sm_80, sm_86, sm_89 or sm_90a", arch);
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
