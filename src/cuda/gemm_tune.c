/* The GEMM autotuner: time the kernels that could serve a problem, keep the
 * fastest correct one in a record in the cache folder, and let later plans
 * use it.
 *
 * Candidates come from the selector's own list (smelt__gemm_candidates),
 * each with the split-K slice counts worth trying where smelt may choose
 * one. A candidate is planned through the ordinary smelt_gemm_plan while a
 * thread-local override tells the planning hook which kernel and split to
 * take, so a tuned plan is made exactly as a plan that reads the record
 * later will be (split mode, reduction kernel, fallback for other
 * alignments). Every candidate's first output is compared with the
 * heuristic choice's: a wrong kernel can be fast, and a record of one would
 * make every later plan wrong.
 *
 * A record is one small JSON file per key, $cache/gemm-tune/<sha256(key)>.json,
 * written atomically (temp file, fsync, rename) while holding a per-key
 * flock, which also keeps two processes from timing the same problem on one
 * GPU at once. Its key names the device, so a cache folder shared by
 * different GPUs keeps one record per GPU; a record is used only when its
 * key and smelt version match and its kernel exists and fits the operands.
 * Anything else is ignored with a log line, and planning falls back to the
 * heuristic. Records hold kernel names, never code. */
#include "gemm_tune.h"
#include "../core/error_bound.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define OP "smelt_gemm_autotune"
#define RECORD_FORMAT "smelt-gemm-tune-1"
#define KEY_FORMAT "gemm-v1"
#define WARMUP 3
#define REPS 15
/* A candidate must beat the heuristic by this factor to win, so timing
 * noise alone never moves the choice. */
#define WIN_MARGIN 0.98

static const char *const mode_names[SMELT_GEMM_MODE_COUNT] = {"AUTO",  "PLAIN", "SPLIT_K_SERIAL", "SPLIT_K_PARALLEL",
                                                              "BATCHED", "ARRAY", "GROUPED", "GROUPED_OFFS"};
static const char *const acc_names[SMELT_GEMM_ACC_COUNT] = {"auto", "f32", "f16", "f64", "i32"};

/* What smelt_gemm_autotune tells the planning hook on its own thread. */
static _Thread_local struct {
  int force;             /* plan this kernel and split */
  int kernel, split_k;
  int heuristic;         /* plan with the heuristic alone, and capture what planning saw */
  int captured;
  smelt__gemm_state st;  /* the state as the hook saw it (split-K not yet decided) */
  smelt__gemm_facts f;
} tuning;

/* ---------------------------------------------------------------- key and path */

static int64_t pow2_ceil(int64_t v) {
  int64_t p = 1;
  if (v <= 0) return 0;
  while (p < v && p < ((int64_t)1 << 62)) p <<= 1;
  return p;
}

/* Row-major (R: unit stride along columns), column-major (C) or strided (S). */
static char layout_letter(const smelt__gemm_mat *x) { return x->cs == 1 ? 'R' : x->rs == 1 ? 'C' : 'S'; }

static const char *dt_or_none(int present, smelt_dtype dt) { return present ? smelt_dtype_name(dt) : "-"; }

int smelt__gemm_tune_key(const smelt__gemm_state *st, const smelt_device_info *dev, char *key, size_t n) {
  if (st->mode == SMELT_GEMM_MODE_ARRAY || st->mode == SMELT_GEMM_MODE_GROUPED || st->mode == SMELT_GEMM_MODE_AUTO)
    return -1;
  /* The device name goes into a JSON string and between '|' separators. */
  char name[sizeof dev->name];
  size_t i = 0;
  for (; dev->name[i] && i + 1 < sizeof name; i++) {
    const char ch = dev->name[i];
    name[i] = ch < 0x20 || ch > 0x7e || ch == '"' || ch == '\\' || ch == '|' ? '_' : ch;
  }
  name[i] = 0;
  const smelt_gemm_desc *d = &st->desc;
  const smelt_gemm_tile *t = &d->tile;
  const smelt__gemm_prob *p = &st->prob;
  const int64_t l = st->mode == SMELT_GEMM_MODE_BATCHED ? st->count : 1;
  int w = snprintf(key, n,
                   KEY_FORMAT "|dev=%s|sms=%d|cc=%d.%d|a=%s|b=%s|c=%s|d=%s|bias=%s|acc=%s|math=%d|opclass=%d|"
                              "layout=%c%c|act=%s|mode=%s|split=%d|tile=%dx%dx%d,s%d,w%dx%d|m=%lld|n=%lld|k=%lld|l=%lld",
                   name, dev->sm_count, dev->cc_major, dev->cc_minor, smelt_dtype_name(st->dt_a),
                   smelt_dtype_name(st->dt_b), dt_or_none(st->has_c, st->dt_c), smelt_dtype_name(st->dt_d),
                   dt_or_none(st->has_bias, st->dt_bias), acc_names[st->acc], (int)d->math.op, (int)d->math.opclass,
                   layout_letter(&p->a), layout_letter(&p->b), smelt_act_name(d->epilogue.act), mode_names[st->mode],
                   st->split_k, t->m, t->n, t->k, t->stages, t->warps_m, t->warps_n, (long long)pow2_ceil(p->m),
                   (long long)pow2_ceil(p->n), (long long)pow2_ceil(p->k), (long long)pow2_ceil(l));
  return w > 0 && (size_t)w < n ? 0 : -1;
}

/* The record folder, created on demand; "" when there is no cache folder. */
static void tune_dir(char *dir, size_t n, int create) {
  const char *cache = smelt__cache_dir();
  if (!cache[0] || (size_t)snprintf(dir, n, "%s/gemm-tune", cache) >= n) {
    dir[0] = 0;
    return;
  }
  if (create && mkdir(dir, 0700) != 0 && errno != EEXIST) dir[0] = 0;
}

/* "<dir>/<name><ext>" where name is the key's hash. */
static void key_file(const char *dir, const char *key, const char *ext, char *path, size_t n) {
  smelt__sha256 h;
  uint8_t dg[32];
  char hex[65];
  smelt__sha256_init(&h);
  smelt__sha256_update(&h, key, strlen(key));
  smelt__sha256_final(&h, dg);
  smelt__sha256_hex(dg, hex);
  if (!dir[0] || (size_t)snprintf(path, n, "%s/%s%s", dir, hex, ext) >= n) path[0] = 0;
}

void smelt__gemm_tune_path(const char *key, char *path, size_t n) {
  char dir[600];
  tune_dir(dir, sizeof dir, 0);
  key_file(dir, key, ".json", path, n);
}

/* ---------------------------------------------------------------- the record file */

int smelt__gemm_tune_format(const smelt__gemm_tune_record *r, char *text, size_t n) {
  int w = snprintf(text, n,
                   "{\n"
                   "  \"format\": \"" RECORD_FORMAT "\",\n"
                   "  \"smelt\": \"%s\",\n"
                   "  \"key\": \"%s\",\n"
                   "  \"kernel\": \"%s\",\n"
                   "  \"split_k\": %d,\n"
                   "  \"median_ms\": %.6g,\n"
                   "  \"heuristic\": \"%s\",\n"
                   "  \"heuristic_split_k\": %d,\n"
                   "  \"heuristic_ms\": %.6g,\n"
                   "  \"shape\": [%lld, %lld, %lld, %lld]\n"
                   "}\n",
                   r->version, r->key, r->kernel, r->split_k, r->median_ms, r->heuristic, r->heuristic_split_k,
                   r->heuristic_ms, (long long)r->m, (long long)r->n, (long long)r->k, (long long)r->l);
  return w > 0 && (size_t)w < n ? w : -1;
}

static const char *skip_ws(const char *p) {
  while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
  return p;
}

/* The value after "name": (whitespace skipped), or NULL. Names and values
 * never contain quotes (the writer makes sure), so the quoted name cannot
 * occur inside another field's value. */
static const char *field(const char *text, const char *name) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\"", name);
  const char *p = strstr(text, pat);
  if (!p || strstr(p + 1, pat)) return NULL; /* absent or repeated */
  p = skip_ws(p + strlen(pat));
  return *p == ':' ? skip_ws(p + 1) : NULL;
}

static int end_of_value(const char *p) {
  p = skip_ws(p);
  return *p == ',' || *p == '}' || *p == ']';
}

static int get_string(const char *text, const char *name, char *out, size_t n) {
  const char *p = field(text, name);
  if (!p || *p != '"') return -1;
  size_t i = 0;
  for (p++; *p != '"'; p++) {
    if (!*p || *p == '\\' || (unsigned char)*p < 0x20 || i + 1 >= n) return -1;
    out[i++] = *p;
  }
  out[i] = 0;
  return end_of_value(p + 1) ? 0 : -1;
}

static int get_int(const char *text, const char *name, int64_t lo, int64_t hi, int64_t *out) {
  const char *p = field(text, name);
  char *end;
  if (!p) return -1;
  errno = 0;
  long long v = strtoll(p, &end, 10);
  if (end == p || errno || v < lo || v > hi || !end_of_value(end)) return -1;
  *out = v;
  return 0;
}

static int get_double(const char *text, const char *name, double *out) {
  const char *p = field(text, name);
  char *end;
  if (!p) return -1;
  double v = strtod(p, &end);
  if (end == p || !(v >= 0 && v < 1e12) || !end_of_value(end)) return -1;
  *out = v;
  return 0;
}

static int get_shape(const char *text, int64_t v[4]) {
  const char *p = field(text, "shape");
  if (!p || *p != '[') return -1;
  p++;
  for (int i = 0; i < 4; i++) {
    char *end;
    errno = 0;
    long long x = strtoll(skip_ws(p), &end, 10);
    if (end == skip_ws(p) || errno || x < 0) return -1;
    v[i] = x;
    p = skip_ws(end);
    if (*p != (i < 3 ? ',' : ']')) return -1;
    p++;
  }
  return end_of_value(p) ? 0 : -1;
}

int smelt__gemm_tune_parse(const char *text, smelt__gemm_tune_record *r, char *why, size_t why_n) {
  memset(r, 0, sizeof *r);
  char format[64];
  int64_t split, hsplit, shape[4];
  const char *p = skip_ws(text);
  size_t len = strlen(text);
  while (len && (text[len - 1] == '\n' || text[len - 1] == ' ' || text[len - 1] == '\r' || text[len - 1] == '\t'))
    len--;
  const char *bad = NULL;
  if (*p != '{' || !len || text[len - 1] != '}') bad = "not one JSON object (truncated?)";
  else if (get_string(text, "format", format, sizeof format) || strcmp(format, RECORD_FORMAT))
    bad = "\"format\" is not \"" RECORD_FORMAT "\"";
  else if (get_string(text, "smelt", r->version, sizeof r->version)) bad = "no \"smelt\" version";
  else if (get_string(text, "key", r->key, sizeof r->key)) bad = "no \"key\"";
  else if (get_string(text, "kernel", r->kernel, sizeof r->kernel) || !r->kernel[0]) bad = "no \"kernel\"";
  else if (get_int(text, "split_k", 1, SMELT_GEMM_MAX_SPLIT_K, &split)) bad = "\"split_k\" is not 1..64";
  else if (get_double(text, "median_ms", &r->median_ms)) bad = "\"median_ms\" is not a time";
  else if (get_string(text, "heuristic", r->heuristic, sizeof r->heuristic)) bad = "no \"heuristic\"";
  else if (get_int(text, "heuristic_split_k", 1, SMELT_GEMM_MAX_SPLIT_K, &hsplit))
    bad = "\"heuristic_split_k\" is not 1..64";
  else if (get_double(text, "heuristic_ms", &r->heuristic_ms)) bad = "\"heuristic_ms\" is not a time";
  else if (get_shape(text, shape)) bad = "\"shape\" is not [M, N, K, L]";
  if (bad) {
    snprintf(why, why_n, "%s", bad);
    return -1;
  }
  r->split_k = (int)split;
  r->heuristic_split_k = (int)hsplit;
  r->m = shape[0];
  r->n = shape[1];
  r->k = shape[2];
  r->l = shape[3];
  return 0;
}

smelt_status smelt__gemm_tune_store(const smelt__gemm_tune_record *r) {
  char dir[600], path[700], text[2048];
  tune_dir(dir, sizeof dir, 1);
  if (!dir[0])
    return smelt__error(SMELT_STATUS_CACHE_ERROR,
                        OP ": no usable cache folder for the tuning record (set SMELT_CACHE_DIR to a writable folder)");
  key_file(dir, r->key, ".json", path, sizeof path);
  const int len = smelt__gemm_tune_format(r, text, sizeof text);
  if (!path[0] || len < 0) return smelt__error(SMELT_STATUS_INTERNAL, OP ": the tuning record does not fit its buffer");
  if (smelt__cache_write_atomic(dir, path, "gemm-tune", text, (size_t)len, NULL, 0) != 0)
    return smelt__error(SMELT_STATUS_IO_ERROR, OP ": cannot write the tuning record %s (%s)", path, strerror(errno));
  smelt__log(SMELT__LOG_INFO, "gemm tuning record %s: %s split-K %d", path, r->kernel, r->split_k);
  return SMELT_OK;
}

/* The "dev=..|sms=..|cc=.." part of a key, for messages. */
static void key_device(const char *key, char *out, size_t n) {
  const char *p = strstr(key, "|dev=");
  size_t i = 0;
  int bars = 0;
  if (p)
    for (p++; *p && i + 1 < n; p++) {
      if (*p == '|' && ++bars == 3) break;
      out[i++] = *p;
    }
  out[i] = 0;
}

smelt__tune_verdict smelt__gemm_tune_load(const char *key, smelt__gemm_tune_record *r) {
  char path[700], text[4096], why[96];
  smelt__gemm_tune_path(key, path, sizeof path);
  if (!path[0]) return SMELT__TUNE_ABSENT;
  int fd = smelt__cache_open(path, O_RDONLY, 0);
  FILE *fp = fd >= 0 ? fdopen(fd, "rb") : NULL;
  if (!fp) {
    if (fd >= 0) close(fd);
    return SMELT__TUNE_ABSENT;
  }
  const size_t len = fread(text, 1, sizeof text - 1, fp);
  const int more = fgetc(fp) != EOF;
  fclose(fp);
  text[len] = 0;
  if (more || strlen(text) != len) snprintf(why, sizeof why, "larger than a record or not text");
  if (more || strlen(text) != len || smelt__gemm_tune_parse(text, r, why, sizeof why)) {
    smelt__log(SMELT__LOG_WARN, "smelt_gemm: tuning record %s is corrupt (%s); ignored, using the heuristic", path,
               why);
    return SMELT__TUNE_CORRUPT;
  }
  if (strcmp(r->version, SMELT_VERSION_STRING)) {
    smelt__log(SMELT__LOG_INFO, "smelt_gemm: tuning record %s was written by smelt %s, this is %s; ignored", path,
               r->version, SMELT_VERSION_STRING);
    return SMELT__TUNE_VERSION;
  }
  if (strcmp(r->key, key)) {
    char theirs[300], ours[300];
    key_device(r->key, theirs, sizeof theirs);
    key_device(key, ours, sizeof ours);
    if (strcmp(theirs, ours))
      smelt__log(SMELT__LOG_WARN, "smelt_gemm: tuning record %s was made on another device (%s; this is %s); ignored",
                 path, theirs, ours);
    else
      smelt__log(SMELT__LOG_WARN, "smelt_gemm: tuning record %s was made for another problem (%s); ignored", path,
                 r->key);
    return SMELT__TUNE_FOREIGN;
  }
  return SMELT__TUNE_USED;
}

/* ---------------------------------------------------------------- the planning hook */

smelt__tune_verdict smelt__gemm_tune_lookup(const smelt__gemm_state *st, const smelt__gemm_facts *f,
                                            const smelt_device_info *dev, const smelt__gemm_kernel *table, int n,
                                            int *kernel, int *split_k) {
  if (tuning.force) {
    *kernel = tuning.kernel;
    *split_k = tuning.split_k;
    return SMELT__TUNE_USED;
  }
  if (tuning.heuristic) {
    tuning.st = *st;
    tuning.f = *f;
    tuning.captured = 1;
    return SMELT__TUNE_ABSENT;
  }
  const char *env = smelt__getenv("SMELT_GEMM_TUNE");
  if (env && !strcmp(env, "off")) return SMELT__TUNE_OFF;
  char key[SMELT__TUNE_KEY_MAX];
  if (smelt__gemm_tune_key(st, dev, key, sizeof key)) return SMELT__TUNE_ABSENT;
  smelt__gemm_tune_record r;
  smelt__tune_verdict v = smelt__gemm_tune_load(key, &r);
  if (v != SMELT__TUNE_USED) return v;
  int cand[SMELT_GEMM_TUNE_MAX_CANDIDATES];
  const int nc = smelt__gemm_candidates(st, f, dev, table, n, cand, SMELT_GEMM_TUNE_MAX_CANDIDATES);
  for (int i = 0; i < nc && i < SMELT_GEMM_TUNE_MAX_CANDIDATES; i++) {
    smelt__kernel_src src;
    smelt__gemm_kernel_src(&table[cand[i]], &src);
    if (strcmp(src.name, r.kernel)) continue;
    /* A split of the persistent Hopper kernel is timed only as the
     * heuristic's own choice (few tiles: smelt__gemm_sm90_auto_split) or
     * where the plan fixed its split, which its key then holds; a record
     * naming one elsewhere is unfit. */
    if (table[cand[i]].fam == SMELT__GK_SM90 && r.split_k != 1 && !st->split_k &&
        smelt__gemm_sm90_auto_split(st, &table[cand[i]], f, dev->sm_count) < 2)
      break;
    *kernel = cand[i];
    *split_k = r.split_k;
    return SMELT__TUNE_USED;
  }
  smelt__log(SMELT__LOG_INFO,
             "smelt_gemm: tuning record for %s names %s split-K %d, which cannot run these operands; using the heuristic",
             key, r.kernel, r.split_k);
  return SMELT__TUNE_UNFIT;
}

int smelt__gemm_tune_choice(const smelt__gemm_state *st, const smelt__gemm_facts *f, const smelt_device_info *dev,
                            const smelt__gemm_kernel *table, int n, int *kernel, char *why, size_t why_n) {
  int ki = *kernel, split = 0;
  if (smelt__gemm_tune_lookup(st, f, dev, table, n, &ki, &split) != SMELT__TUNE_USED) return 0;
  *kernel = ki;
  snprintf(why, why_n, "%s", tuning.force ? "autotune candidate" : "tuned: from the record");
  return split;
}

/* ---------------------------------------------------------------- tuning */

/* Relative L2 bound between two GPU results of one GEMM: twice the bound
 * each has against the exact result (src/core/error_bound.c, which the
 * tests and `smelt bench gemm --check` use too). A wrong kernel misses it
 * by orders of magnitude. */
static double tolerance(const smelt__gemm_state *st) {
  const smelt__bound_query q = {
      .family = "gemm", .dtype = st->dt_d, .dt_a = st->dt_a, .gemm = &st->desc, .has_c = st->has_c};
  return 2.0 * smelt__error_bound(&q);
}

/* ||got - ref|| / ||ref|| over D's elements; NaN and infinities must sit
 * where the reference has them (else *mismatch counts them). */
static double rel_error(const smelt_tensor *d, const void *got, const void *ref, int64_t *mismatch) {
  const int64_t n = smelt_tensor_numel(d);
  double diff2 = 0, ref2 = 0;
  *mismatch = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t off = smelt__tensor_offset(d, i);
    const double x = smelt__load_f64(got, d->dtype, off), r = smelt__load_f64(ref, d->dtype, off);
    if (isnan(r) || isnan(x) || isinf(r) || isinf(x)) {
      *mismatch += !(x == r || (isnan(x) && isnan(r)));
      continue;
    }
    diff2 += (x - r) * (x - r);
    ref2 += r * r;
  }
  return ref2 > 0 ? sqrt(diff2 / ref2) : sqrt(diff2);
}

static int cmp_float(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

typedef struct tune_io {
  smelt_ctx *ctx;
  const smelt_tensor *a, *b, *c, *d, *bias;
  size_t d_bytes; /* D's span */
  void *poison;   /* 0xFF bytes of D's span when D is contiguous, else NULL */
  void *ref, *got;
  smelt_event *ev[2 * REPS];
} tune_io;

/* One candidate: a first run compared with the reference (or, for the
 * heuristic, taken as it), warm-up, timed runs. */
static smelt_status measure(tune_io *io, smelt_plan *plan, int is_ref, double bound, smelt_gemm_tune_candidate *c) {
  smelt_ctx *ctx = io->ctx;
  smelt_status s;
  if (io->poison && (s = smelt_memcpy_h2d(ctx, io->d->data, io->poison, io->d_bytes))) return s;
  if ((s = smelt_gemm_run(plan, io->a, io->b, io->c, io->d, io->bias)) || (s = smelt_ctx_synchronize(ctx)) ||
      (s = smelt_memcpy_d2h(ctx, is_ref ? io->ref : io->got, io->d->data, io->d_bytes)))
    return s;
  int64_t mismatch = 0;
  c->rel_err = is_ref ? 0.0 : rel_error(io->d, io->got, io->ref, &mismatch);
  c->correct = mismatch == 0 && c->rel_err <= bound;
  if (!c->correct) return SMELT_OK;
  for (int i = 0; i < WARMUP; i++)
    if ((s = smelt_gemm_run(plan, io->a, io->b, io->c, io->d, io->bias))) return s;
  for (int i = 0; i < REPS; i++)
    if ((s = smelt_event_record(io->ev[2 * i])) || (s = smelt_gemm_run(plan, io->a, io->b, io->c, io->d, io->bias)) ||
        (s = smelt_event_record(io->ev[2 * i + 1])))
      return s;
  float ms[REPS];
  for (int i = 0; i < REPS; i++)
    if ((s = smelt_event_elapsed_ms(io->ev[2 * i], io->ev[2 * i + 1], &ms[i]))) return s;
  qsort(ms, REPS, sizeof ms[0], cmp_float);
  c->median_ms = ms[REPS / 2];
  return SMELT_OK;
}

/* Split-K slice counts worth timing for kernel k when smelt may choose:
 * none, and powers of two while the tiles times the slices stay within a
 * few waves and each slice keeps 256 of K. */
static int splits_for(const smelt__gemm_kernel *k, const smelt__gemm_state *req, const smelt_device_info *dev,
                      int *out) {
  if (req->split_k) {
    out[0] = req->split_k;
    return 1;
  }
  out[0] = 1;
  /* Hopper split-K runs only when asked: unsplit was faster (docs/PERF.md,
   * GEMM: decisions). */
  if (k->fam == SMELT__GK_SM90 || req->mode == SMELT_GEMM_MODE_BATCHED) return 1;
  const smelt__gemm_prob *p = &req->prob;
  const int64_t tiles = smelt__ceil_div(p->m, k->bm) * smelt__ceil_div(p->n, k->bn);
  int n = 1;
  for (int s = 2; s <= 16 && tiles < dev->sm_count; s *= 2)
    if (tiles * s <= 4 * (int64_t)dev->sm_count && p->k / s >= 256) out[n++] = s;
  return n;
}

static void add_candidate(smelt_gemm_tune_result *r, int *kernels, const smelt__gemm_kernel *table, int ki, int split,
                          int heuristic) {
  for (int i = 0; i < r->count; i++)
    if (kernels[i] == ki && r->cand[i].split_k == split) {
      r->cand[i].heuristic |= heuristic;
      return;
    }
  if (r->count == SMELT_GEMM_TUNE_MAX_CANDIDATES) return;
  smelt_gemm_tune_candidate *c = &r->cand[r->count];
  memset(c, 0, sizeof *c);
  smelt__kernel_src src;
  smelt__gemm_kernel_src(&table[ki], &src);
  snprintf(c->kernel, sizeof c->kernel, "%s", src.name);
  c->split_k = split;
  c->heuristic = heuristic;
  kernels[r->count++] = ki;
}

static smelt_status plan_forced(tune_io *io, const smelt_gemm_desc *desc, int ki, int split, smelt_plan **out) {
  tuning.force = 1;
  tuning.kernel = ki;
  tuning.split_k = split;
  smelt_status s = smelt_gemm_plan(io->ctx, desc, io->a, io->b, io->c, io->d, io->bias, out);
  tuning.force = 0;
  if (!s && ((const smelt__gemm_cuda_plan *)(*out)->backend)->kernel != ki) {
    smelt_plan_destroy(*out);
    *out = NULL;
    s = smelt__error(SMELT_STATUS_INTERNAL, OP ": planning did not take the candidate kernel (table entry %d)", ki);
  }
  return s;
}

/* Times every candidate into r and leaves the winner's result in D. */
static smelt_status tune(tune_io *io, const smelt_gemm_desc *desc, smelt_plan *heur, const smelt__gemm_state *req,
                         const smelt__gemm_facts *f, smelt_gemm_tune_result *r) {
  const smelt__gemm_state *hs = (const smelt__gemm_state *)heur->opdata;
  const smelt_device_info *dev = &io->ctx->cuda->info;
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int n = smelt__gemm_table(table);
  int ks[SMELT_GEMM_TUNE_MAX_CANDIDATES], kernels[SMELT_GEMM_TUNE_MAX_CANDIDATES];
  int nk = smelt__gemm_candidates(req, f, dev, table, n, ks, SMELT_GEMM_TUNE_MAX_CANDIDATES);
  if (nk > SMELT_GEMM_TUNE_MAX_CANDIDATES) nk = SMELT_GEMM_TUNE_MAX_CANDIDATES;
  int tensor = 0;
  for (int i = 0; i < nk; i++) tensor |= table[ks[i]].fam != SMELT__GK_SIMT;
  const smelt__gemm_cuda_plan *hc = (const smelt__gemm_cuda_plan *)heur->backend;
  add_candidate(r, kernels, table, hc->kernel, hc->split_k, 1);
  for (int i = 0; i < nk; i++) {
    /* CUDA cores are no match for tensor cores where both can serve. */
    if (tensor && table[ks[i]].fam == SMELT__GK_SIMT) continue;
    int splits[8];
    const int ns = splits_for(&table[ks[i]], req, dev, splits);
    for (int j = 0; j < ns; j++) add_candidate(r, kernels, table, ks[i], splits[j], 0);
  }
  r->heuristic = 0;
  const double bound = tolerance(hs);
  smelt_status s = measure(io, heur, 1, bound, &r->cand[0]);
  if (s) return s; /* without the reference nothing can be judged */
  smelt_plan *best = heur;
  int winner = 0;
  for (int i = 1; i < r->count; i++) {
    smelt_gemm_tune_candidate *c = &r->cand[i];
    smelt_plan *plan = NULL;
    c->status = plan_forced(io, desc, kernels[i], c->split_k, &plan);
    if (!c->status) c->status = measure(io, plan, 0, bound, c);
    if (c->status) smelt__log(SMELT__LOG_INFO, OP ": candidate %s split-K %d: %s", c->kernel, c->split_k,
                              smelt_last_error());
    smelt__log(SMELT__LOG_DEBUG, OP ": %s split-K %d: %.4f ms, rel err %.2e%s", c->kernel, c->split_k,
               (double)c->median_ms, c->rel_err, c->correct ? "" : " (wrong)");
    const float to_beat = winner == 0 ? (float)(r->cand[0].median_ms * WIN_MARGIN) : r->cand[winner].median_ms;
    if (!c->status && c->correct && c->median_ms < to_beat) {
      if (best != heur) smelt_plan_destroy(best);
      best = plan;
      winner = i;
    } else {
      smelt_plan_destroy(plan);
    }
  }
  smelt_clear_error();
  r->winner = winner;
  /* The last run may have been a wrong candidate's: leave the winner's result. */
  s = smelt_gemm_run(best, io->a, io->b, io->c, io->d, io->bias);
  if (best != heur) smelt_plan_destroy(best);
  return s;
}

static smelt_status check_args(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *c,
                               const smelt_tensor *d, unsigned flags) {
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": ctx is NULL");
  if (flags & ~(unsigned)SMELT_GEMM_TUNE_NO_RECORD)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": flags=0x%x has unknown bits (known: SMELT_GEMM_TUNE_NO_RECORD)",
                        flags);
  if (desc && desc->epilogue.graph)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": desc.epilogue.graph is not tuned (its plans use the heuristic)");
  const smelt_gemm_mode mode = desc ? desc->mode : SMELT_GEMM_MODE_AUTO;
  if (mode == SMELT_GEMM_MODE_ARRAY || mode == SMELT_GEMM_MODE_GROUPED)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": desc.mode=%s is not tuned (plain, split-K and batched GEMMs are; array and grouped plans "
                           "use the heuristic)",
                        mode_names[mode]);
  if (desc && desc->epilogue.beta != 0.0 && c && d && c->data && c->data == d->data)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": D is C (in place): every timed run would read the previous run's D; give D its own memory");
  if (ctx->device != SMELT_DEVICE_CUDA)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": needs a CUDA context (the CPU backend has one kernel: nothing to tune)");
  return SMELT_OK;
}

smelt_status smelt_gemm_autotune(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                 const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                 const smelt_tensor *bias, unsigned flags, smelt_gemm_tune_result *out) {
  smelt_status s = check_args(ctx, desc, c, d, flags);
  if (s) return s;
  /* The heuristic's plan validates everything, and shows the tuner the
   * state and operand facts planning decides on. */
  smelt_plan *heur = NULL;
  memset(&tuning, 0, sizeof tuning);
  tuning.heuristic = 1;
  s = smelt_gemm_plan(ctx, desc, a, b, c, d, bias, &heur);
  tuning.heuristic = 0;
  if (s) return s;
  if (!tuning.captured) {
    smelt_plan_destroy(heur);
    return smelt__error(SMELT_STATUS_INTERNAL, OP ": planning did not consult the tuner");
  }
  const smelt__gemm_state req = tuning.st;
  const smelt__gemm_facts f = tuning.f;
  const int has_c = ((const smelt__gemm_state *)heur->opdata)->has_c;
  const int64_t batch = req.mode == SMELT_GEMM_MODE_BATCHED ? req.count : 1;
  if (req.prob.m < 1 || req.prob.n < 1 || req.prob.k < 1 || batch < 1) {
    smelt_plan_destroy(heur);
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": M=%lld, N=%lld, K=%lld, L=%lld: an empty GEMM has nothing to time", (long long)req.prob.m,
                        (long long)req.prob.n, (long long)req.prob.k, (long long)batch);
  }

  smelt_gemm_tune_result *r = (smelt_gemm_tune_result *)calloc(1, sizeof *r);
  tune_io io;
  memset(&io, 0, sizeof io);
  io.ctx = ctx;
  io.a = a;
  io.b = b;
  io.c = has_c ? c : NULL;
  io.d = d;
  io.bias = bias;
  int64_t lo, hi;
  smelt__tensor_span(d, &lo, &hi);
  io.d_bytes = (size_t)(hi - lo);
  io.ref = malloc(io.d_bytes ? io.d_bytes : 1);
  io.got = malloc(io.d_bytes ? io.d_bytes : 1);
  if (smelt_tensor_is_contiguous(d) && (io.poison = malloc(io.d_bytes ? io.d_bytes : 1)))
    memset(io.poison, 0xFF, io.d_bytes);
  if (!r || !io.ref || !io.got) s = smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  for (int i = 0; i < 2 * REPS && !s; i++) s = smelt_event_create(ctx, &io.ev[i]);

  /* One tuner per key at a time: timings of two processes sharing a GPU
   * would be worth nothing. */
  char key[SMELT__TUNE_KEY_MAX], dir[600], lock_path[700];
  int lock_fd = -1;
  const int keyed = smelt__gemm_tune_key(&req, &ctx->cuda->info, key, sizeof key) == 0;
  tune_dir(dir, sizeof dir, !(flags & SMELT_GEMM_TUNE_NO_RECORD));
  if (!s && keyed && dir[0] && !(flags & SMELT_GEMM_TUNE_NO_RECORD)) {
    key_file(dir, key, ".lock", lock_path, sizeof lock_path);
    lock_fd = lock_path[0] ? open(lock_path, O_RDWR | O_CREAT, 0600) : -1;
    if (lock_fd >= 0 && flock(lock_fd, LOCK_EX) != 0) {
      close(lock_fd);
      lock_fd = -1;
    }
  }
  if (!s) s = tune(&io, desc, heur, &req, &f, r);
  if (!s) {
    const smelt_gemm_tune_candidate *w = &r->cand[r->winner], *h = &r->cand[r->heuristic];
    if (keyed) smelt__gemm_tune_path(key, r->record_path, sizeof r->record_path);
    if (!keyed)
      smelt__log(SMELT__LOG_WARN, OP ": no record key for this problem (mode %s); nothing written",
                 mode_names[req.mode]);
    else if (!(flags & SMELT_GEMM_TUNE_NO_RECORD)) {
      smelt__gemm_tune_record rec;
      memset(&rec, 0, sizeof rec);
      snprintf(rec.key, sizeof rec.key, "%s", key);
      snprintf(rec.version, sizeof rec.version, "%s", SMELT_VERSION_STRING);
      snprintf(rec.kernel, sizeof rec.kernel, "%s", w->kernel);
      rec.split_k = w->split_k;
      rec.median_ms = w->median_ms;
      snprintf(rec.heuristic, sizeof rec.heuristic, "%s", h->kernel);
      rec.heuristic_split_k = h->split_k;
      rec.heuristic_ms = h->median_ms;
      rec.m = req.prob.m;
      rec.n = req.prob.n;
      rec.k = req.prob.k;
      rec.l = batch;
      s = smelt__gemm_tune_store(&rec);
      r->recorded = s == SMELT_OK;
    }
  }
  if (lock_fd >= 0) close(lock_fd); /* the lock file stays, as the kernel cache's do */
  if (out && r) *out = *r;
  for (int i = 0; i < 2 * REPS; i++) smelt_event_destroy(io.ev[i]);
  free(io.ref);
  free(io.got);
  free(io.poison);
  free(r);
  smelt_plan_destroy(heur);
  return s;
}
