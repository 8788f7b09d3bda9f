/* Finding NVIDIA's run-time libraries without a toolkit: by glob pattern (the
 * highest version first) and inside pip wheels (nvidia-cuda-nvrtc,
 * nvidia-nvtx, ...) of the Python environments we know about. */
#include "cuda_internal.h"

#include <dlfcn.h>
#include <glob.h>
#include <stdio.h>

void *smelt__dlopen_glob(const char *pattern) {
  glob_t g;
  void *h = NULL;
  if (glob(pattern, 0, NULL, &g) == 0) {
    /* glob sorts ascending: try the highest version first. */
    for (size_t i = g.gl_pathc; i-- > 0 && !h;) h = dlopen(g.gl_pathv[i], RTLD_NOW | RTLD_LOCAL);
    globfree(&g);
  }
  return h;
}

void *smelt__dlopen_pip(const char *rel) {
  const char *prefixes[] = {smelt__getenv("VIRTUAL_ENV"), smelt__getenv("CONDA_PREFIX"), "/usr/local", "/usr",
                            "/opt/torch/.venv"};
  char pat[600];
  void *h;
  for (size_t p = 0; p < sizeof prefixes / sizeof *prefixes; p++) {
    if (!prefixes[p]) continue;
    snprintf(pat, sizeof pat, "%s/lib/python3*/site-packages/%s", prefixes[p], rel);
    if ((h = smelt__dlopen_glob(pat))) return h;
  }
  return NULL;
}
