/* Finding NVIDIA's run-time libraries without a toolkit: by glob pattern (the
 * highest version first) and inside pip wheels (nvidia-cuda-nvrtc,
 * nvidia-nvtx, ...) of the standard Python prefixes: the active venv or conda
 * environment, pip's --user folder and the system's. A Python run by its full
 * path is no active venv: the binding names its own wheel (SMELT_NVRTC_PATH). */
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
  const char *home = smelt__getenv("HOME");
  char user[400] = "";
  if (home) snprintf(user, sizeof user, "%.390s/.local", home);
  const char *prefixes[] = {smelt__getenv("VIRTUAL_ENV"), smelt__getenv("CONDA_PREFIX"), user[0] ? user : NULL,
                            "/usr/local", "/usr"};
  char pat[600];
  void *h;
  for (size_t p = 0; p < sizeof prefixes / sizeof *prefixes; p++) {
    if (!prefixes[p]) continue;
    /* site-packages, or dist-packages where Debian's Python installs. */
    snprintf(pat, sizeof pat, "%s/lib/python3*/*-packages/%s", prefixes[p], rel);
    if ((h = smelt__dlopen_glob(pat))) return h;
  }
  return NULL;
}
