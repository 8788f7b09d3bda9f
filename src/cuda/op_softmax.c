/* smelt_softmax on CUDA: kernels/softmax.cu, one module per (dtype, row-size
 * bucket). The selector picks the smallest bucket whose register tile holds
 * the row (x read once, y written once), or the two-pass looping kernel for
 * rows longer than the largest tile. Each run picks the entry point by
 * layout: softmax_vec (wide accesses) when strides and pointers allow it,
 * softmax_unit for other rows of unit stride, softmax_gen otherwise. */
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

enum { F_VEC, F_UNIT, F_GEN, F_COUNT };
static const char *const entry[F_COUNT] = {"softmax_vec", "softmax_unit", "softmax_gen"};

/* group: threads per row (8 or 16: several rows per warp; 32: a warp; more:
 * the CTA); items: elements per thread per tile; loop: 1 = two passes over
 * tiles, any row length. */
typedef struct bucket {
  int group, items, block, loop;
  const char *tag;
} bucket;

static const bucket buckets[] = {
    {8, 8, 128, 0, "g8"},         /* C <= 64 */
    {16, 8, 128, 0, "g16"},       /* C <= 128 */
    {32, 8, 128, 0, "w8"},        /* C <= 256 */
    {32, 32, 128, 0, "w32"},      /* C <= 1024 */
    {128, 16, 128, 0, "b128"},    /* C <= 2048 */
    {256, 16, 256, 0, "b256"},    /* C <= 4096 */
    {512, 16, 512, 0, "b512"},    /* C <= 8192 */
    {1024, 16, 1024, 0, "b1024"}, /* C <= 16384 */
    {512, 16, 512, 1, "loop"},    /* longer rows */
};
#define NBUCKETS ((int)(sizeof buckets / sizeof *buckets))

static const smelt_dtype sm_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

static int select_bucket(int64_t C) {
  for (int b = 0; b < NBUCKETS; b++)
    if (!buckets[b].loop && C <= (int64_t)buckets[b].group * buckets[b].items) return b;
  return NBUCKETS - 1;
}

/* The one place a variant's source is made (plan and enumerator). */
static void make_src(smelt_dtype dt, int b, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "softmax_%s_%s", smelt_dtype_name(dt), buckets[b].tag);
  src->body = "softmax.cu";
  smelt__prelude_define(src, "SMELT_DT", dt);
  smelt__prelude_define(src, "SMELT_GROUP", buckets[b].group);
  smelt__prelude_define(src, "SMELT_BLOCK", buckets[b].block);
  smelt__prelude_define(src, "SMELT_ITEMS", buckets[b].items);
  smelt__prelude_define(src, "SMELT_LOOP", buckets[b].loop);
}

int smelt__softmax_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  for (size_t d = 0; d < sizeof sm_dtypes / sizeof *sm_dtypes; d++)
    for (int b = 0; b < NBUCKETS; b++, n++)
      if (n < max) make_src(sm_dtypes[d], b, &out[n]);
  return n;
}

static smelt_status plan_softmax(smelt_plan *plan, const void *args) {
  const smelt_tensor *x = &plan->t[0];
  int64_t C = x->shape[x->ndim - 1];
  int b = select_bucket(C);
  smelt__kernel_src src;
  make_src(x->dtype, b, &src);
  for (int i = 0; i < F_COUNT; i++) {
    CUfunction f;
    smelt_status s = smelt__cuda_function(plan->ctx, &src, entry[i], &f);
    if (s) return s;
    plan->func[i] = f;
  }
  plan->variant = b;
  plan->block = buckets[b].block;
  snprintf(plan->describe, sizeof plan->describe, "%s (softmax.cu, %s, %d threads per row)", src.name,
           buckets[b].loop ? "two passes" : "row in registers", buckets[b].group);
  return SMELT_OK;
}


/* Every row start of k (row dims only) is a multiple of vw elements. */
static int rows_aligned(const smelt__kshape *k, int64_t vw) {
  for (int d = 0; d < k->ndim; d++)
    if (k->strides[d] % vw) return 0;
  return 1;
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *y = t[1], *lse = t[2];
  int64_t n = smelt_tensor_numel(x);
  if (n == 0) return SMELT_OK;
  const bucket *bk = &buckets[plan->variant];
  const int nd = x->ndim - 1;
  int64_t C = x->shape[nd], rows = n / C;
  /* With one element per row the last stride is never used. */
  int64_t xcs = C == 1 ? 1 : x->strides[nd], ycs = C == 1 ? 1 : y->strides[nd];
  smelt__kshape xr, yr, lr;
  smelt__kshape_rows(x, nd, &xr);
  smelt__kshape_rows(y, nd, &yr);
  memset(&lr, 0, sizeof lr);
  if (lse) smelt__kshape_rows(lse, nd, &lr);
  void *xp = x->data, *yp = y->data, *lp = lse ? lse->data : NULL;

  const int64_t esize = (int64_t)smelt_dtype_size(x->dtype);
  const int64_t vw = bk->items * esize < 16 ? bk->items : 16 / esize;
  const int unit = xcs == 1 && ycs == 1;
  const int vec = unit && C % vw == 0 && ((uintptr_t)xp | (uintptr_t)yp) % (uintptr_t)(vw * esize) == 0 &&
                  rows_aligned(&xr, vw) && rows_aligned(&yr, vw);

  const int64_t rows_per_cta = bk->block / bk->group;
  int64_t g = smelt__ceil_div(rows, rows_per_cta);
  unsigned grid = (unsigned)(g > 0x7fffffff ? 0x7fffffff : g);
  void *params[] = {&xp, &yp, &lp, &rows, &C, &xr, &yr, &lr, &xcs, &ycs};
  smelt__nvtx_push("smelt_softmax");
  smelt_status s = smelt__cuda_launch(plan->ctx, "smelt_softmax",
                                      (CUfunction)plan->func[vec    ? F_VEC
                                                             : unit ? F_UNIT
                                                                    : F_GEN],
                                      grid, 1, 1, (unsigned)bk->block, 0, params);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_softmax = {.plan = plan_softmax, .run = run};
