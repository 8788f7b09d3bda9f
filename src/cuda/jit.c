/* The JIT's disk cache: content-addressed CUBIN entries in front of NVRTC.
 *
 * Key = SHA-256 over the entry format, smelt's version, NVRTC's version, the
 * arch, the options, the full program text and the embedded headers it
 * includes, so any change to what would be compiled gives a new key. Entries are
 *   "SMELTCB1" | key (64 hex) | payload size (u64 LE) | SHA-256(payload) | payload
 * and anything that does not parse or verify is a miss (and is rebuilt).
 * Writes go to a temp file in the same folder, fsync, rename: readers never
 * see a partial entry and concurrent processes are safe. A per-key flock keeps
 * concurrent processes from compiling the same kernel twice. Only CUBIN is
 * stored; nothing executable on the host ever comes from the cache. */
#include "cuda_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define ENTRY_MAGIC "SMELTCB1"
#define ENTRY_FORMAT "smelt-cubin-entry-v1"
#define HEADER_BYTES (8 + 64 + 8 + 32)

static pthread_mutex_t stats_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t n_compiles, n_disk_hits;
static double compile_s;
static int warned_dir;

void smelt__jit_stats(uint64_t *compiles, uint64_t *disk_hits, double *seconds) {
  pthread_mutex_lock(&stats_mu);
  *compiles = n_compiles;
  *disk_hits = n_disk_hits;
  *seconds = compile_s;
  pthread_mutex_unlock(&stats_mu);
}

static void warn_once(const char *fmt, const char *a, const char *b) {
  pthread_mutex_lock(&stats_mu);
  int first = !warned_dir;
  warned_dir = 1;
  pthread_mutex_unlock(&stats_mu);
  if (first) smelt__log(SMELT__LOG_WARN, fmt, a, b);
}

/* Each embedded file's SHA-256, computed once a process: the key hashes
 * these digests instead of the files (some 600 KB of kernel text, which
 * took about a millisecond a key, and a key is taken on every module
 * lookup, one-shot calls included). */
static uint8_t (*file_digests)[32];
static pthread_once_t digests_once = PTHREAD_ONCE_INIT;
static void digest_files(void) {
  file_digests = (uint8_t(*)[32])malloc((size_t)(smelt__embedded_count ? smelt__embedded_count : 1) * 32);
  for (int i = 0; file_digests && i < smelt__embedded_count; i++) {
    smelt__sha256 h;
    smelt__sha256_init(&h);
    smelt__sha256_update(&h, smelt__embedded_files[i].text, smelt__embedded_files[i].len);
    smelt__sha256_final(&h, file_digests[i]);
  }
}

/* File f's text into h: its digest, or (digests unavailable) the text. */
static void hash_file(smelt__sha256 *h, const smelt__embedded_file *f) {
  if (file_digests) smelt__sha256_update(h, file_digests[f - smelt__embedded_files], 32);
  else smelt__sha256_update(h, f->text, f->len);
}


/* Whether the include line that goes on at p (to the line's end) carries
 * "smelt-key: if NAME" for a NAME the prelude does not define. */
static int skipped_include(const char *p, const char *end, const char *prelude) {
  static const char mark[] = "smelt-key: if ";
  const char *eol = memchr(p, '\n', (size_t)(end - p));
  if (!eol) eol = end;
  const size_t ml = sizeof mark - 1;
  for (const char *q = p; q + ml <= eol; q++) {
    if (memcmp(q, mark, ml)) continue;
    const char *name = q + ml, *e = name;
    while (e < eol && (*e == '_' || (*e >= 'A' && *e <= 'Z') || (*e >= 'a' && *e <= 'z') || (*e >= '0' && *e <= '9')))
      e++;
    char def[96];
    if (e == name || (size_t)(e - name) + 10 > sizeof def) return 0;
    snprintf(def, sizeof def, "#define %.*s ", (int)(e - name), name);
    return !strstr(prelude, def);
  }
  return 0;
}

void smelt__mark_includes(const char *text, size_t len, const char *prelude, unsigned char *seen) {
  static const char tag[] = "#include \"";
  const size_t tl = sizeof tag - 1;
  for (const char *p = text, *end = text + len; p + tl < end;) {
    const char *q = memchr(p, '#', (size_t)(end - p));
    if (!q || q + tl >= end) return;
    p = q + 1;
    if (memcmp(q, tag, tl)) continue;
    const char *name = q + tl, *close = memchr(name, '"', (size_t)(end - name));
    if (!close || close - name >= 128 || skipped_include(close, end, prelude)) continue;
    char buf[128];
    memcpy(buf, name, (size_t)(close - name));
    buf[close - name] = 0;
    const smelt__embedded_file *f = smelt__embedded_find(buf);
    if (!f) continue;
    const int i = (int)(f - smelt__embedded_files);
    if (seen[i]) continue;
    seen[i] = 1;
    smelt__mark_includes(f->text, f->len, prelude, seen);
  }
}

/* The key covers what the compile sees: the entry format, the library
 * version, NVRTC's version, the arch, the options, the program text (the
 * kernel's name, prelude and body, as nvrtc.c assembles it) and the
 * embedded headers the program includes, directly or through another
 * (every header for a program whose body is not an embedded file), so a
 * header's change renews only the keys of the kernels that read it. */
void smelt__cache_key(const smelt__kernel_src *src, const char *arch, char hex[65]) {
  pthread_once(&digests_once, digest_files);
  smelt__sha256 h;
  smelt__sha256_init(&h);
  const smelt__nvrtc_info *ni = smelt__nvrtc_info_get();
  char head[128];
  int n = snprintf(head, sizeof head, "%s|%s|nvrtc %d.%d|", ENTRY_FORMAT, SMELT_VERSION_STRING, ni->major, ni->minor);
  smelt__sha256_update(&h, head, (size_t)n);
  /* The arch is the caller's string: hashed in place, never copied into a
   * fixed buffer. */
  smelt__sha256_update(&h, arch, strlen(arch));
  smelt__sha256_update(&h, "|", 1);
  const char *opts[16];
  int nopts = smelt__nvrtc_options(arch, opts, 16);
  /* Options in sorted order so their listing order never changes the key. */
  for (int i = 1; i < nopts; i++)
    for (int j = i; j > 0 && strcmp(opts[j - 1], opts[j]) > 0; j--) {
      const char *t = opts[j];
      opts[j] = opts[j - 1];
      opts[j - 1] = t;
    }
  for (int i = 0; i < nopts; i++) smelt__sha256_update(&h, opts[i], strlen(opts[i]) + 1);
  /* The program text's parts, each ended by a NUL (none holds one). */
  smelt__sha256_update(&h, src->name, strlen(src->name) + 1);
  const smelt__embedded_file *body = smelt__embedded_find(src->body);
  unsigned char seen[SMELT__MAX_EMBEDDED];
  const int all = !body || smelt__embedded_count > SMELT__MAX_EMBEDDED;
  memset(seen, 0, sizeof seen);
  if (body) {
    smelt__sha256_update(&h, src->prelude, strlen(src->prelude) + 1);
    smelt__sha256_update(&h, src->body, strlen(src->body) + 1);
    hash_file(&h, body);
    if (!all) {
      smelt__mark_includes(src->prelude, strlen(src->prelude), src->prelude, seen);
      smelt__mark_includes(body->text, body->len, src->prelude, seen);
    }
  }
  for (int i = 0; i < smelt__embedded_count; i++) {
    const smelt__embedded_file *f = &smelt__embedded_files[i];
    size_t l = strlen(f->name);
    if (l > 4 && !strcmp(f->name + l - 4, ".cuh") && (all || seen[i])) {
      smelt__sha256_update(&h, f->name, l + 1);
      hash_file(&h, f);
    }
  }
  uint8_t d[32];
  smelt__sha256_final(&h, d);
  smelt__sha256_hex(d, hex);
}

static uint64_t get_u64le(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

/* Reads and verifies an entry; NULL on any mismatch (a miss). */
static void *read_entry(const char *path, const char *key, size_t *size) {
  int fd = smelt__cache_open(path, O_RDONLY, 0);
  FILE *f = fd >= 0 ? fdopen(fd, "rb") : NULL;
  if (!f) {
    if (fd >= 0) close(fd);
    return NULL;
  }
  uint8_t head[HEADER_BYTES];
  void *payload = NULL;
  if (fread(head, 1, sizeof head, f) != sizeof head) goto bad;
  if (memcmp(head, ENTRY_MAGIC, 8) || memcmp(head + 8, key, 64)) goto bad;
  uint64_t n = get_u64le(head + 72);
  if (n == 0 || n > (1u << 30)) goto bad;
  payload = malloc((size_t)n);
  if (!payload || fread(payload, 1, (size_t)n, f) != n) goto bad;
  if (fgetc(f) != EOF) goto bad; /* trailing bytes: not what we wrote */
  uint8_t d[32];
  smelt__sha256 h;
  smelt__sha256_init(&h);
  smelt__sha256_update(&h, payload, (size_t)n);
  smelt__sha256_final(&h, d);
  if (memcmp(d, head + 80, 32)) goto bad;
  fclose(f);
  *size = (size_t)n;
  return payload;
bad:
  free(payload);
  fclose(f);
  smelt__log(SMELT__LOG_INFO, "cache entry %s is invalid; rebuilding", path);
  return NULL;
}

static int write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = (const uint8_t *)p;
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

int smelt__cache_write_atomic(const char *dir, const char *path, const char *tag, const void *head, size_t head_n,
                              const void *body, size_t body_n) {
  static int counter;
  char tmp[PATH_MAX + 96];
  snprintf(tmp, sizeof tmp, "%s/.%s.%d.%d.tmp", dir, tag, (int)getpid(), __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED));
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  int ok = write_all(fd, head, head_n) == 0 && write_all(fd, body, body_n) == 0 && fsync(fd) == 0;
  ok = (close(fd) == 0) && ok;
  if (!ok || rename(tmp, path) != 0) {
    int e = errno;
    unlink(tmp);
    errno = e;
    return -1;
  }
  return 0;
}

static void write_entry(const char *dir, const char *path, const char *key, const void *bin, size_t n) {
  uint8_t head[HEADER_BYTES];
  memcpy(head, ENTRY_MAGIC, 8);
  memcpy(head + 8, key, 64);
  for (int i = 0; i < 8; i++) head[72 + i] = (uint8_t)((uint64_t)n >> (8 * i));
  smelt__sha256 h;
  smelt__sha256_init(&h);
  smelt__sha256_update(&h, bin, n);
  smelt__sha256_final(&h, head + 80);
  if (smelt__cache_write_atomic(dir, path, key, head, sizeof head, bin, n) != 0)
    warn_once("cannot write to kernel cache folder %s (%s); kernels stay in memory only", dir, strerror(errno));
}

smelt_status smelt__jit_cubin(const smelt__kernel_src *src, const char *arch, void **cubin, size_t *size,
                              int *cached, double *seconds) {
  *cubin = NULL;
  *size = 0;
  *cached = 0;
  *seconds = 0;
  char key[65];
  smelt__cache_key(src, arch, key);
  const char *d = smelt__cache_dir();
  char dir[PATH_MAX], path[PATH_MAX + 80], lockp[PATH_MAX + 80];
  snprintf(dir, sizeof dir, "%s", d);
  int lockfd = -1;
  if (dir[0]) {
    snprintf(path, sizeof path, "%s/%s.cubin", dir, key);
    void *bin = read_entry(path, key, size);
    if (!bin) {
      /* Miss: take the key's lock, then look again — another process may have
       * compiled it while we waited. */
      snprintf(lockp, sizeof lockp, "%s/%s.lock", dir, key);
      lockfd = smelt__cache_open(lockp, O_RDWR | O_CREAT, 0600);
      if (lockfd >= 0 && flock(lockfd, LOCK_EX) != 0) {
        close(lockfd);
        lockfd = -1;
      }
      bin = read_entry(path, key, size);
    }
    if (bin) {
      if (lockfd >= 0) close(lockfd);
      pthread_mutex_lock(&stats_mu);
      n_disk_hits++;
      pthread_mutex_unlock(&stats_mu);
      smelt__log(SMELT__LOG_INFO, "cache hit %s (%s) for %s", src->name, key, arch);
      *cubin = bin;
      *cached = 1;
      return SMELT_OK;
    }
  }
  if (smelt__env_is("SMELT_JIT", "off")) {
    if (lockfd >= 0) close(lockfd);
    return smelt__error(SMELT_STATUS_NOT_FOUND,
                        "smelt jit: kernel %s for %s is not in the cache (%s) and SMELT_JIT=off; warm the cache with "
                        "`smelt precompile --arch %s`",
                        src->name, arch, dir[0] ? dir : "disabled", arch);
  }
  double t0 = smelt__now_seconds();
  smelt_status s = smelt__nvrtc_compile(src, arch, cubin, size);
  double dt = smelt__now_seconds() - t0;
  if (s == SMELT_OK) {
    pthread_mutex_lock(&stats_mu);
    n_compiles++;
    compile_s += dt;
    pthread_mutex_unlock(&stats_mu);
    *seconds = dt;
    smelt__log(SMELT__LOG_INFO, "compiled %s for %s in %.3f s (%zu bytes)", src->name, arch, dt, *size);
    if (dir[0]) write_entry(dir, path, key, *cubin, *size);
  }
  if (lockfd >= 0) {
    /* The lock file stays: removing it would race with a waiter that holds it open. */
    close(lockfd);
  }
  return s;
}
