/* smelt_norm and smelt_norm_bwd on CUDA: kernels/norm.cu, one module per
 * (direction, dtype, weight dtype, row-size bucket). The selector picks the
 * smallest bucket whose register tile holds the row (one warp per row up
 * to 256 elements, then one CTA of 128 to 1024 threads), or the looping
 * kernel for longer rows. Each run picks the entry point by layout
 * (*_vec: 16-byte accesses; *_unit: any row alignment).
 *
 * Both directions run a fixed grid (the CTAs that fit at once), each row
 * group walking its share of the rows. The backward's groups each leave
 * one partial row of the dweight and dbias sums in pool scratch;
 * norm_bwd_reduce adds those rows in order. The grid depends only on the
 * shape and the device, so the results repeat bit for bit. */
#include "../core/checked.h"
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

enum { F_VEC, F_UNIT, F_REDUCE };
static const char *const entry[2][3] = {{"norm_fwd_vec", "norm_fwd_unit", NULL},
                                        {"norm_bwd_vec", "norm_bwd_unit", "norm_bwd_reduce"}};

/* group: threads per row (32: a warp, 4 rows per CTA; more: the CTA);
 * items: elements per thread per tile; loop: 1 = any row length. */
typedef struct bucket {
  int group, items, block, loop;
  const char *tag;
} bucket;

static const bucket buckets[] = {
    {32, 8, 128, 0, "w8"},        /* C <= 256 */
    {128, 8, 128, 0, "b128"},     /* C <= 1024 */
    {256, 8, 256, 0, "b256"},     /* C <= 2048 */
    {512, 8, 512, 0, "b512"},     /* C <= 4096 */
    {1024, 8, 1024, 0, "b1024"},  /* C <= 8192 */
    {256, 8, 256, 1, "loop"},     /* longer rows */
};
#define NBUCKETS ((int)(sizeof buckets / sizeof *buckets))

/* (x dtype, weight dtype) pairs: the weights in x's dtype or f32. */
static const smelt_dtype dtype_pairs[][2] = {{SMELT_DTYPE_F32, SMELT_DTYPE_F32},
                                             {SMELT_DTYPE_F16, SMELT_DTYPE_F16},
                                             {SMELT_DTYPE_F16, SMELT_DTYPE_F32},
                                             {SMELT_DTYPE_BF16, SMELT_DTYPE_BF16},
                                             {SMELT_DTYPE_BF16, SMELT_DTYPE_F32}};
#define NPAIRS ((int)(sizeof dtype_pairs / sizeof *dtype_pairs))

static int select_bucket(int64_t C) {
  for (int b = 0; b < NBUCKETS; b++)
    if (!buckets[b].loop && C <= (int64_t)buckets[b].group * buckets[b].items) return b;
  return NBUCKETS - 1;
}

/* The one place a variant's source is made (plans and enumerators). */
static void make_src(int bwd, smelt_dtype dt, smelt_dtype wdt, int b, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "norm_%s_%s_w%s_%s", bwd ? "bwd" : "fwd", smelt_dtype_name(dt),
           smelt_dtype_name(wdt), buckets[b].tag);
  src->body = "norm.cu";
  smelt__prelude_define(src, "SMELT_DT", dt);
  smelt__prelude_define(src, "SMELT_WDT", wdt);
  smelt__prelude_define(src, "SMELT_GROUP", buckets[b].group);
  smelt__prelude_define(src, "SMELT_BLOCK", buckets[b].block);
  smelt__prelude_define(src, "SMELT_ITEMS", buckets[b].items);
  smelt__prelude_define(src, "SMELT_LOOP", buckets[b].loop);
  smelt__prelude_define(src, "SMELT_BWD", bwd);
}

static int variants(int bwd, smelt__kernel_src *out, int max) {
  int n = 0;
  for (int p = 0; p < NPAIRS; p++)
    for (int b = 0; b < NBUCKETS; b++, n++)
      if (n < max) make_src(bwd, dtype_pairs[p][0], dtype_pairs[p][1], b, &out[n]);
  return n;
}

int smelt__norm_variants(smelt__kernel_src *out, int max) { return variants(0, out, max); }
int smelt__norm_bwd_variants(smelt__kernel_src *out, int max) { return variants(1, out, max); }

/* Loads the bucket's module for x's dtype and the weights' (role `wrole`,
 * or the bias's when there is no weight; x's dtype when neither). */
static smelt_status plan_dir(smelt_plan *plan, int bwd, const smelt_tensor *w, const smelt_tensor *bias) {
  const smelt_tensor *x = &plan->t[0];
  const smelt_dtype wdt = w->ndim >= 0 ? w->dtype : bias && bias->ndim >= 0 ? bias->dtype : x->dtype;
  const int b = select_bucket(x->shape[x->ndim - 1]);
  smelt__kernel_src src;
  make_src(bwd, x->dtype, wdt, b, &src);
  for (int i = 0; i < (bwd ? 3 : 2); i++) {
    CUfunction f;
    smelt_status s = smelt__cuda_function(plan->ctx, &src, entry[bwd][i], &f);
    if (s) return s;
    plan->func[i] = f;
  }
  plan->variant = b;
  plan->block = buckets[b].block;
  snprintf(plan->describe, sizeof plan->describe, "%s (norm.cu, %s, %d threads per row)", src.name,
           buckets[b].loop ? "rows in tiles" : "row in registers", buckets[b].group);
  return SMELT_OK;
}

static smelt_status plan_fwd(smelt_plan *plan, const void *args) {
  (void)args;
  return plan_dir(plan, 0, &plan->t[2], &plan->t[3]);
}

static smelt_status plan_bwd(smelt_plan *plan, const void *args) {
  (void)args;
  return plan_dir(plan, 1, &plan->t[2], &plan->t[8]);
}

/* t (absent: NULL) allows 16-byte accesses of vw elements: data aligned
 * to 16 bytes and every stride but the last a multiple of vw. */
static int vec_ok(const smelt_tensor *t, int64_t vw) {
  if (!t) return 1;
  if ((uintptr_t)t->data % 16) return 0;
  for (int d = 0; d + 1 < t->ndim; d++)
    if (t->shape[d] > 1 && t->strides[d] % vw) return 0;
  return 1;
}

/* The entry point for this run's tensors (`rows` of them [..., C], `vecs`
 * the parameter vectors). */
static int pick_entry(int64_t C, smelt_dtype dt, const smelt_tensor *const *rows, int nrows,
                      const smelt_tensor *const *vecs, int nvecs) {
  const int64_t vw = 16 / (int64_t)smelt_dtype_size(dt);
  int ok = C % vw == 0;
  for (int i = 0; ok && i < nrows; i++) ok = vec_ok(rows[i], vw);
  for (int i = 0; ok && i < nvecs; i++) ok = !vecs[i] || (uintptr_t)vecs[i]->data % 16 == 0;
  return ok ? F_VEC : F_UNIT;
}

/* The row layout of a [..., C] tensor or of a statistic [...] (zeros when absent). */
static smelt__kshape rows_of(const smelt_tensor *t, int nd) {
  smelt__kshape k;
  memset(&k, 0, sizeof k);
  if (t) smelt__kshape_rows(t, nd, &k);
  return k;
}

static const void *data_of(const smelt_tensor *t) { return t ? t->data : NULL; }

/* The grid of both directions: as many CTAs as fit on the device at once
 * (the kernels take about 64 registers a thread, so 1024 threads per SM),
 * each walking its share of the rows. The forward fetches a group's next
 * row while it reduces this one; the backward keeps one partial row of
 * the weight sums per group, so fewer groups also mean less of that
 * traffic. */
static int64_t row_grid(const smelt_plan *plan, int64_t rows) {
  const bucket *bk = &buckets[plan->variant];
  const int64_t per_sm = bk->block >= 1024 ? 1 : 1024 / bk->block;
  const int64_t cap = per_sm * (int64_t)plan->ctx->cuda->info.sm_count;
  const int64_t need = smelt__ceil_div(rows, bk->block / bk->group);
  return need < 1 ? 1 : need < cap ? need : cap;
}

/* Roles: x, residual, weight, bias, y, h_out, mean, rstd. */
static smelt_status run_fwd(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt_norm_desc *d = (const smelt_norm_desc *)plan->opdata;
  const smelt_tensor *x = t[0];
  const int nd = x->ndim - 1;
  int64_t C = x->shape[nd], rows = C ? smelt_tensor_numel(x) / C : 0;
  if (rows == 0) return SMELT_OK;
  const bucket *bk = &buckets[plan->variant];
  const smelt_tensor *rt[] = {x, t[1], t[4], t[5]};
  const int f = pick_entry(C, x->dtype, rt, 4, t + 2, 2);
  smelt__kshape xs = rows_of(x, nd), rs = rows_of(t[1], nd), ys = rows_of(t[4], nd), hs = rows_of(t[5], nd),
                ms = rows_of(t[6], nd), ss = rows_of(t[7], nd);
  const void *xp = x->data, *rp = data_of(t[1]), *wp = data_of(t[2]), *bp = data_of(t[3]);
  const void *yp = t[4]->data, *hp = data_of(t[5]), *mp = data_of(t[6]), *sp = data_of(t[7]);
  float eps = d->eps;
  int kind = (int)d->kind;
  const unsigned grid = (unsigned)row_grid(plan, rows);
  void *params[] = {&xp, &rp, &wp, &bp, &yp, &hp, &mp, &sp, &rows, &C, &eps, &kind, &xs, &rs, &ys, &hs, &ms, &ss};
  smelt__nvtx_push("smelt_norm");
  smelt_status s = smelt__cuda_launch(plan->ctx, "smelt_norm", (CUfunction)plan->func[f], grid, 1, 1,
                                      (unsigned)bk->block, 0, params);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_norm = {.plan = plan_fwd, .run = run_fwd};

/* Roles: dy, x, weight, mean, rstd, dh, dx, dweight, dbias. */
static smelt_status run_bwd(smelt_plan *plan, const void *args) {
  const char *op = "smelt_norm_bwd";
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt_norm_desc *d = (const smelt_norm_desc *)plan->opdata;
  const smelt_tensor *dy = t[0];
  const int nd = dy->ndim - 1;
  int64_t C = dy->shape[nd], rows = smelt_tensor_numel(dy) / C;
  const int want_sums = t[7] || t[8];
  if (rows == 0 && !want_sums) return SMELT_OK;
  const bucket *bk = &buckets[plan->variant];
  int64_t grid = row_grid(plan, rows), parts = grid * (bk->block / bk->group), half = 0, cols = 0;
  smelt_status s;
  if (want_sums && ((s = smelt__mul_i64(parts, C, &half, op, "the partial sums")) ||
                    (s = smelt__mul_i64(half, 8, &cols, op, "the partial sums' bytes"))))
    return s;
  if (smelt__ceil_div(C, 32) > 0x7fffffff)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: C=%lld is too long for the column reduction", op,
                        (long long)C);
  void *scratch = NULL;
  if (want_sums && (s = smelt__cuda_alloc(plan->ctx, (size_t)cols, &scratch))) return s;
  float *pdw = t[7] ? (float *)scratch : NULL, *pdb = t[8] ? (float *)scratch + half : NULL;
  const smelt_tensor *rt[] = {dy, t[1], t[5], t[6]};
  const int f = pick_entry(C, dy->dtype, rt, 4, t + 2, 1);
  smelt__kshape dys = rows_of(dy, nd), xs = rows_of(t[1], nd), ms = rows_of(t[3], nd), ss = rows_of(t[4], nd),
                dhs = rows_of(t[5], nd), dxs = rows_of(t[6], nd);
  const void *dyp = dy->data, *xp = t[1]->data, *wp = data_of(t[2]), *mp = data_of(t[3]), *sp = t[4]->data;
  const void *dhp = data_of(t[5]), *dxp = t[6]->data, *dwp = data_of(t[7]), *dbp = data_of(t[8]);
  int kind = (int)d->kind;
  void *params[] = {&dyp, &xp, &wp, &mp, &sp, &dhp, &dxp, &pdw, &pdb, &rows, &C, &kind, &dys, &xs, &ms, &ss, &dhs, &dxs};
  void *rparams[] = {&pdw, &pdb, &parts, &C, &dwp, &dbp};
  smelt__nvtx_push(op);
  s = smelt__cuda_launch(plan->ctx, op, (CUfunction)plan->func[f], (unsigned)grid, 1, 1, (unsigned)bk->block, 0,
                         params);
  if (!s && want_sums)
    s = smelt__cuda_launch(plan->ctx, op, (CUfunction)plan->func[F_REDUCE], (unsigned)smelt__ceil_div(C, 32), 2, 1,
                           256, 0, rparams);
  smelt__nvtx_pop();
  if (scratch) {
    smelt_status fs = smelt__cuda_free(plan->ctx, scratch);
    if (!s) s = fs;
  }
  return s;
}

const smelt__backend smelt__cuda_norm_bwd = {.plan = plan_bwd, .run = run_bwd};
