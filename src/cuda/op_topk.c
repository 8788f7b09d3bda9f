/* smelt_topk on CUDA: kernels/topk.cu, one module per (dtype, index dtype,
 * path). Rows of up to 1024 elements (MoE routers, PEER sub-keys) take the
 * warp-per-row register kernel in one of two sizes; longer rows take the
 * CTA-per-row kernel. Without an indices tensor the i64 module is used (it
 * writes no indices then). */
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

/* items: keys per lane of a warp (rows up to 32*items); 0 = CTA per row. */
typedef struct path {
  int items, block;
  const char *tag;
} path;

static const path paths[] = {
    {8, 128, "w8"},   /* C <= 256 */
    {32, 128, "w32"}, /* C <= 1024 */
    {0, 256, "cta"},  /* longer rows */
};
#define NPATHS ((int)(sizeof paths / sizeof *paths))

static const smelt_dtype tk_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype tk_idx[] = {SMELT_DTYPE_I32, SMELT_DTYPE_I64};

static int select_path(int64_t C) {
  for (int p = 0; p < NPATHS; p++)
    if (paths[p].items && C <= 32 * (int64_t)paths[p].items) return p;
  return NPATHS - 1;
}

/* The one place a variant's source is made (plan and enumerator). */
static void make_src(smelt_dtype dt, smelt_dtype idx, int p, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "topk_%s_%s_%s", smelt_dtype_name(dt), smelt_dtype_name(idx), paths[p].tag);
  src->body = "topk.cu";
  smelt__prelude_define(src, "SMELT_DT", dt);
  smelt__prelude_define(src, "SMELT_IDX", idx == SMELT_DTYPE_I32 ? 32 : 64);
  smelt__prelude_define(src, "SMELT_ITEMS", paths[p].items);
  smelt__prelude_define(src, "SMELT_BLOCK", paths[p].block);
}

int smelt__topk_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  for (size_t d = 0; d < sizeof tk_dtypes / sizeof *tk_dtypes; d++)
    for (size_t i = 0; i < sizeof tk_idx / sizeof *tk_idx; i++)
      for (int p = 0; p < NPATHS; p++, n++)
        if (n < max) make_src(tk_dtypes[d], tk_idx[i], p, &out[n]);
  return n;
}

static smelt_status plan_topk(smelt_plan *plan, const void *args) {
  const smelt_tensor *x = &plan->t[0], *ind = &plan->t[2];
  int64_t C = x->shape[x->ndim - 1];
  /* The kernels pack an element's index into 32 bits. */
  if (C > (int64_t)UINT32_MAX)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_topk: x.shape[-1]=%lld must be <= %u on CUDA", (long long)C,
                        UINT32_MAX);
  int p = select_path(C);
  smelt__kernel_src src;
  make_src(x->dtype, ind->ndim >= 0 ? ind->dtype : SMELT_DTYPE_I64, p, &src);
  CUfunction f;
  smelt_status s = smelt__cuda_function(plan->ctx, &src, "topk_rows", &f);
  if (s) return s;
  plan->func[0] = f;
  plan->variant = p;
  plan->block = paths[p].block;
  snprintf(plan->describe, sizeof plan->describe, "%s (topk.cu, %s)", src.name,
           paths[p].items ? "warp per row, keys in registers" : "CTA per row, per-thread top-16 lists");
  return SMELT_OK;
}


static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *values = t[1], *indices = t[2];
  int64_t n = smelt_tensor_numel(x);
  if (n == 0) return SMELT_OK;
  const path *pt = &paths[plan->variant];
  const int nd = x->ndim - 1;
  int64_t C = x->shape[nd], rows = n / C, k = plan->p.topk.k;
  int64_t xcs = x->strides[nd], vcs = values->strides[nd], ics = indices ? indices->strides[nd] : 0;
  smelt__kshape xr, vr, ir;
  smelt__kshape_rows(x, x->ndim - 1, &xr);
  smelt__kshape_rows(values, values->ndim - 1, &vr);
  memset(&ir, 0, sizeof ir);
  if (indices) smelt__kshape_rows(indices, indices->ndim - 1, &ir);
  void *xp = x->data, *vp = values->data, *ip = indices ? indices->data : NULL;
  const int64_t rows_per_cta = pt->items ? pt->block / 32 : 1;
  int64_t g = smelt__ceil_div(rows, rows_per_cta);
  unsigned grid = (unsigned)(g > 0x7fffffff ? 0x7fffffff : g);
  void *params[] = {&xp, &vp, &ip, &rows, &C, &k, &xr, &vr, &ir, &xcs, &vcs, &ics};
  smelt__nvtx_push("smelt_topk");
  smelt_status s = smelt__cuda_launch(plan->ctx, "smelt_topk", (CUfunction)plan->func[0], grid, 1, 1,
                                      (unsigned)pt->block, 0, params);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_topk = {.plan = plan_topk, .run = run};
