/* System and device queries behind `smelt info`: what driver and NVRTC were
 * found (or why not), the devices and the arch smelt compiles for each, and the
 * disk cache's location and size. */
#include "cuda_internal.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

/* The arch string smelt compiles for: the 'a' variant on Hopper (wgmma, setmaxnreg). */
static void arch_of(int major, int minor, char *out, size_t n) {
  snprintf(out, n, "sm_%d%d%s", major, minor, (major == 9 && minor == 0) ? "a" : "");
}

smelt_status smelt_device_info_get(int index, smelt_device_info *out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_device_info_get: out is NULL");
  memset(out, 0, sizeof *out);
  const char *why = "";
  const smelt__cu_api *cu = smelt__cu(&why);
  if (!cu) return smelt__error(SMELT_STATUS_NO_DEVICE, "smelt_device_info_get: CUDA is not usable: %s", why);
  int n = 0;
  cu->cuDeviceGetCount(&n);
  if (index < 0 || index >= n)
    return smelt__error(SMELT_STATUS_NO_DEVICE, "smelt_device_info_get: index=%d must be in [0, %d)", index, n);
  CUdevice d;
  SMELT__CU_CHECK(cu->cuDeviceGet(&d, index), "smelt_device_info_get");
  SMELT__CU_CHECK(cu->cuDeviceGetName(out->name, (int)sizeof out->name, d), "smelt_device_info_get");
  int v = 0;
  out->index = index;
  SMELT__CU_CHECK(cu->cuDeviceGetAttribute(&out->sm_count, SMELT__CU_DEV_ATTR_SM_COUNT, d), "smelt_device_info_get");
  SMELT__CU_CHECK(cu->cuDeviceGetAttribute(&out->cc_major, SMELT__CU_DEV_ATTR_CC_MAJOR, d), "smelt_device_info_get");
  SMELT__CU_CHECK(cu->cuDeviceGetAttribute(&out->cc_minor, SMELT__CU_DEV_ATTR_CC_MINOR, d), "smelt_device_info_get");
  SMELT__CU_CHECK(cu->cuDeviceGetAttribute(&v, SMELT__CU_DEV_ATTR_L2_CACHE_SIZE, d), "smelt_device_info_get");
  out->l2_bytes = (uint64_t)v;
  SMELT__CU_CHECK(cu->cuDeviceGetAttribute(&out->smem_per_block_optin, SMELT__CU_DEV_ATTR_SMEM_OPTIN, d),
                  "smelt_device_info_get");
  size_t total = 0;
  SMELT__CU_CHECK(cu->cuDeviceTotalMem(&total, d), "smelt_device_info_get");
  out->total_memory = total;
  arch_of(out->cc_major, out->cc_minor, out->arch, sizeof out->arch);
  return SMELT_OK;
}

smelt_status smelt_system_info_get(smelt_system_info *out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_system_info_get: out is NULL");
  memset(out, 0, sizeof *out);
  const char *why = "";
  const smelt__cu_api *cu = smelt__cu(&why);
  if (cu) {
    out->driver_loaded = 1;
    out->driver_version = smelt__cu_driver_version();
    cu->cuDeviceGetCount(&out->device_count);
  } else {
    snprintf(out->driver_error, sizeof out->driver_error, "%s", why);
  }
  const smelt__nvrtc_info *ni = smelt__nvrtc_info_get();
  out->nvrtc_loaded = ni->loaded;
  out->nvrtc_major = ni->major;
  out->nvrtc_minor = ni->minor;
  snprintf(out->nvrtc_path, sizeof out->nvrtc_path, "%s", ni->path);
  snprintf(out->nvrtc_error, sizeof out->nvrtc_error, "%s", ni->error);
  snprintf(out->cache_dir, sizeof out->cache_dir, "%s", smelt__cache_dir());
  if (!out->cache_dir[0]) smelt__cache_off_reason(out->cache_error, sizeof out->cache_error);
  if (out->cache_dir[0]) {
    DIR *dir = opendir(out->cache_dir);
    struct dirent *e;
    while (dir && (e = readdir(dir))) {
      size_t l = strlen(e->d_name);
      if (l < 7 || strcmp(e->d_name + l - 6, ".cubin") || e->d_name[0] == '.') continue;
      char p[1024];
      struct stat st;
      snprintf(p, sizeof p, "%s/%s", out->cache_dir, e->d_name);
      if (stat(p, &st) == 0) {
        out->cache_bytes += (uint64_t)st.st_size;
        out->cache_entries++;
      }
    }
    if (dir) closedir(dir);
  }
  return SMELT_OK;
}
