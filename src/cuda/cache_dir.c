/* The kernel cache's folder, and the only way files in it are opened.
 *
 * The cache holds CUBIN that smelt loads and runs on the GPU, so a folder
 * another user can write to is a way to run their code in our process. The
 * folder is used only when it and every folder above it are owned by us or by
 * root and writable by nobody else (a sticky world-writable parent such as
 * /tmp is allowed: others cannot rename our folder out of it); this is the
 * rule ssh applies to ~/.ssh. Files in it are opened without following links
 * and used only when they are regular files of ours. The SHA-256 inside an
 * entry proves it was not damaged, not who wrote it: ownership does that. When
 * the folder fails a check the cache is off (kernels stay in memory), one
 * warning says why, and smelt__cache_off_reason() keeps the reason for
 * `smelt info` and `smelt precompile`. */
#include "cuda_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define LIMIT_TEXT_(x) #x
#define LIMIT_TEXT(x) LIMIT_TEXT_(x)

static pthread_mutex_t reason_mu = PTHREAD_MUTEX_INITIALIZER;
static char off_reason[700];

/* Records why the cache is off; the first time, also as a warning. */
static void cache_off(const char *dir, const char *why) {
  char text[sizeof off_reason];
  const char *more = strlen(dir) > 200 ? "..." : ""; /* an over-long path would hide the reason */
  snprintf(text, sizeof text, "kernel cache folder %.200s%s is unusable (%s)", dir, more, why);
  pthread_mutex_lock(&reason_mu);
  int first = !off_reason[0];
  memcpy(off_reason, text, sizeof text);
  pthread_mutex_unlock(&reason_mu);
  if (first) smelt__log(SMELT__LOG_WARN, "%s; kernels stay in memory only", text);
}

void smelt__cache_off_reason(char *out, size_t n) {
  pthread_mutex_lock(&reason_mu);
  snprintf(out, n, "%s", off_reason);
  pthread_mutex_unlock(&reason_mu);
}

/* mkdir -p with mode 0700 for the folders we create; path fits PATH_MAX. */
static int make_dirs(const char *path) {
  char buf[PATH_MAX];
  snprintf(buf, sizeof buf, "%s", path);
  for (char *p = buf + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(buf, 0700) != 0 && errno != EEXIST) return -1;
    *p = '/';
  }
  return mkdir(buf, 0700) != 0 && errno != EEXIST ? -1 : 0;
}

/* One folder of the chain: ours or root's, and writable by no one else unless
 * sticky (then only for parents, never the cache folder itself). */
static int folder_is_safe(const struct stat *st, int is_cache, char *why, size_t n, const char *path) {
  uid_t me = geteuid();
  if (!S_ISDIR(st->st_mode)) return snprintf(why, n, "%s is not a folder", path), 0;
  if (st->st_uid != me && (is_cache || st->st_uid != 0))
    return snprintf(why, n, "%s is owned by uid %u, not by this user", path, (unsigned)st->st_uid), 0;
  int shared_write = (st->st_mode & (S_IWGRP | S_IWOTH)) != 0;
  if (shared_write && (is_cache || !(st->st_mode & S_ISVTX)))
    return snprintf(why, n, "%s is writable by group or others (mode %03o)", path, (unsigned)(st->st_mode & 07777)), 0;
  return 1;
}

/* Checks the resolved folder and every folder above it. */
static int chain_is_safe(const char *real, char *why, size_t n) {
  char buf[PATH_MAX];
  snprintf(buf, sizeof buf, "%s", real);
  for (int is_cache = 1;; is_cache = 0) {
    struct stat st;
    if (lstat(buf[0] ? buf : "/", &st) != 0) return snprintf(why, n, "%s: %s", buf, strerror(errno)), 0;
    if (!folder_is_safe(&st, is_cache, why, n, buf[0] ? buf : "/")) return 0;
    char *slash = strrchr(buf, '/');
    if (!slash || !buf[0]) return 1;
    *slash = 0; /* "/a/b" -> "/a" -> "" (the root) */
  }
}

const char *smelt__cache_dir(void) {
  static _Thread_local char dir[SMELT__CACHE_DIR_MAX + 1];
  const char *env = smelt__getenv("SMELT_CACHE_DIR");
  const char *xdg = smelt__getenv("XDG_CACHE_HOME");
  const char *home = smelt__getenv("HOME");
  char want[PATH_MAX + 32];
  if (env) snprintf(want, sizeof want, "%s", env);
  else if (xdg) snprintf(want, sizeof want, "%s/smelt", xdg);
  else if (home) snprintf(want, sizeof want, "%s/.cache/smelt", home);
  else want[0] = 0;
  dir[0] = 0;
  if (!want[0]) return dir;
  /* Over-long paths are refused rather than truncated to another folder. */
  if (strlen(want) > SMELT__CACHE_DIR_MAX) {
    cache_off(want, "its path is longer than " LIMIT_TEXT(SMELT__CACHE_DIR_MAX) " characters");
    return dir;
  }
  char real[PATH_MAX], why[PATH_MAX + 96];
  if (make_dirs(want) != 0 || !realpath(want, real)) {
    cache_off(want, strerror(errno));
    return dir;
  }
  if (strlen(real) > SMELT__CACHE_DIR_MAX) {
    cache_off(want, "its resolved path is longer than " LIMIT_TEXT(SMELT__CACHE_DIR_MAX) " characters");
    return dir;
  }
  if (!chain_is_safe(real, why, sizeof why)) {
    cache_off(want, why);
    return dir;
  }
  if (access(real, W_OK | X_OK) != 0) {
    cache_off(want, strerror(errno));
    return dir;
  }
  memcpy(dir, real, strlen(real) + 1); /* fits: checked against SMELT__CACHE_DIR_MAX above */
  return dir;
}

int smelt__cache_open(const char *path, int flags, mode_t mode) {
  int fd = open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) return -1;
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH))) {
    smelt__log(SMELT__LOG_WARN, "kernel cache: %s is not a regular file of this user's, writable by no one else; ignored",
               path);
    close(fd);
    errno = EPERM;
    return -1;
  }
  return fd;
}
