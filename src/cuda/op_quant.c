/* smelt_quantize and smelt_dequantize on CUDA: kernels/quant.cu, one module
 * per (x dtype, element format, quant format); the dequantizer's entry
 * point lives in the f32 module of its format. A quantize is one launch,
 * or four with a tensor-wide amax (per-tensor FP8, NVFP4's tensor scale):
 * zero the f32, its amax, the scale from it, the blocks. Each run picks the
 * 16-byte paths by x's and q's layout and alignment. */
#include "../core/quant_internal.h"
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

#define BLOCK 256
#define BLOCKS_PER_SM (2048 / BLOCK)
#define HOLD_COLS (4 * 16) /* columns a thread of quant_row holds: HOLD chunks of EPL */

enum { F_MAIN, F_AMAX, F_SCALAR, F_COUNT };

static const smelt_dtype x_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};


/* The one place a variant's source is made (plans and the enumerator). */
static void make_src(smelt_dtype dt, int fmt, smelt_quant_format f, smelt__kernel_src *src) {
  static const char *const fmt_names[] = {"e4m3", "e5m2", "e2m1"};
  static const char *const kind_names[] = {"tensor", "row", "1x128", "128x128", "mxfp8", "nvfp4"};
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "quant_%s_%s_%s", kind_names[f], fmt_names[fmt], smelt_dtype_name(dt));
  src->body = "quant.cu";
  smelt__prelude_define(src, "SMELT_DT", dt);
  smelt__prelude_define(src, "SMELT_QFMT", fmt);
  smelt__prelude_define(src, "SMELT_QKIND", f);
}

int smelt__quant_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  for (size_t d = 0; d < sizeof x_dtypes / sizeof *x_dtypes; d++)
    for (int f = 0; f < SMELT_QUANT_FORMAT_COUNT; f++)
      for (int fmt = 0; fmt < 2; fmt++) {
        if (f == SMELT_QUANT_NVFP4 && fmt == 1) continue;
        if (n < max) make_src(x_dtypes[d], f == SMELT_QUANT_NVFP4 ? 2 : fmt, (smelt_quant_format)f, &out[n]);
        n++;
      }
  return n;
}

/* The dequantizer's modules are the f32 quantizer's (counted there). */
int smelt__dequant_variants(smelt__kernel_src *out, int max) {
  (void)out;
  (void)max;
  return 0;
}

static const char *main_entry(smelt_quant_format f) {
  return f == SMELT_QUANT_FP8_ROW ? "quant_row" : f == SMELT_QUANT_FP8_128X128 ? "quant_tile" : "quant_seg";
}

static int needs_amax(smelt_quant_format f) { return f == SMELT_QUANT_FP8_TENSOR || f == SMELT_QUANT_NVFP4; }

/* The CTAs of BLOCK threads an SM holds at f's registers (64K an SM, given
 * out 8 a thread at a time), at most BLOCKS_PER_SM. quant_row and
 * quant_tile loop over their rows or blocks, so their grid is what is
 * resident at once: BLOCKS_PER_SM CTAs an SM where 3 fit (quant_row) is
 * 2.67 waves of equal CTAs, the last leaving a third of the slots idle. */
static int resident_ctas(CUfunction f) {
  int regs = 0;
  if (smelt__cu(NULL)->cuFuncGetAttribute(&regs, SMELT__CU_FUNC_ATTR_NUM_REGS, f) || regs <= 0) return BLOCKS_PER_SM;
  const int n = 65536 / ((regs + 7) / 8 * 8 * BLOCK);
  return n < 1 ? 1 : n < BLOCKS_PER_SM ? n : BLOCKS_PER_SM;
}

static smelt_status plan_quant(smelt_plan *plan, const void *args) {
  (void)args;
  const smelt_quant_format f = smelt__quant_format_of(plan);
  smelt__kernel_src src;
  make_src(plan->t[0].dtype, smelt__quant_elem_fmt(f, plan->t[1].dtype), f, &src);
  const char *entry[F_COUNT] = {main_entry(f), "quant_amax", "quant_scalar"};
  for (int i = 0; i < (needs_amax(f) ? F_COUNT : 1); i++) {
    CUfunction fn;
    smelt_status s = smelt__cuda_function(plan->ctx, &src, entry[i], &fn);
    if (s) return s;
    plan->func[i] = fn;
  }
  plan->block = BLOCK;
  /* plan->variant: the main kernel's CTAs an SM for grid_for. */
  plan->variant = f == SMELT_QUANT_FP8_ROW || f == SMELT_QUANT_FP8_128X128
                      ? resident_ctas((CUfunction)plan->func[F_MAIN])
                      : BLOCKS_PER_SM;
  snprintf(plan->describe, sizeof plan->describe, "%s (quant.cu, %s%s)", src.name, entry[0],
           needs_amax(f) ? " after the tensor amax" : "");
  return SMELT_OK;
}

static unsigned grid_for(const smelt_plan *plan, int64_t ctas, int per_sm) {
  int64_t cap = (int64_t)plan->ctx->cuda->info.sm_count * per_sm;
  if (ctas > cap) ctas = cap;
  return (unsigned)(ctas > 0 ? ctas : 1);
}

/* The kernels' arguments (QUANT_PARAMS in kernels/quant.cu). */
typedef struct qargs {
  void *x, *q, *scale;
  float *slot;
  int64_t rows, cols, xrs, xcs, qrs, srs, scs;
  int xvec, qvec;
  int tpr; /* quant_row's threads a row (the other entry points take the fields before it) */
} qargs;

/* quant_row's threads a row: the fewest (a power of two, 32 to BLOCK) that
 * hold the row; BLOCK where none does. */
static int row_threads(int64_t cols) {
  int t = 32;
  while (t < BLOCK && (int64_t)t * HOLD_COLS < cols) t *= 2;
  return t;
}

static void args_of(const smelt_tensor *const *t, smelt_quant_format f, qargs *a) {
  const smelt_tensor *x = t[0], *q = t[1], *sc = t[2];
  const int64_t es = (int64_t)smelt_dtype_size(x->dtype), qalign = f == SMELT_QUANT_NVFP4 ? 8 : 16;
  a->x = x->data;
  a->q = q->data;
  a->scale = sc->data;
  a->slot = f == SMELT_QUANT_NVFP4 ? (float *)t[3]->data : (float *)sc->data;
  a->rows = x->shape[0];
  a->cols = x->shape[1];
  a->xrs = x->strides[0];
  a->xcs = x->strides[1];
  a->qrs = q->strides[0];
  smelt__quant_scale_strides(sc, &a->srs, &a->scs);
  a->xvec = a->xcs == 1 && (uintptr_t)a->x % 16 == 0 && (a->rows == 1 || a->xrs * es % 16 == 0);
  a->qvec = (uintptr_t)a->q % (uintptr_t)qalign == 0 && (a->rows == 1 || a->qrs % qalign == 0);
  a->tpr = row_threads(a->cols);
}

static smelt_status run_quant(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt_quant_format f = smelt__quant_format_of(plan);
  if (smelt_tensor_numel(t[0]) == 0) return SMELT_OK;
  qargs a;
  args_of(t, f, &a);
  void *params[] = {&a.x, &a.rows, &a.cols, &a.xrs, &a.xcs, &a.xvec, &a.q, &a.qrs, &a.qvec, &a.scale,
                    &a.srs, &a.scs, &a.slot, &a.tpr};
  const int64_t seg_warps = a.rows * smelt__ceil_div(a.cols, 512);
  smelt_status s = SMELT_OK;
  smelt__nvtx_push("smelt_quantize");
  if (needs_amax(f)) {
    int zero = 0, one = 1;
    void *p0[] = {&a.slot, &zero}, *p1[] = {&a.slot, &one};
    if (!(s = smelt__cuda_launch(plan->ctx, "smelt_quantize", (CUfunction)plan->func[F_SCALAR], 1, 1, 1, 1, 0, p0)) &&
        !(s = smelt__cuda_launch(plan->ctx, "smelt_quantize", (CUfunction)plan->func[F_AMAX],
                                 grid_for(plan, smelt__ceil_div(seg_warps, BLOCK / 32), BLOCKS_PER_SM), 1, 1, BLOCK, 0,
                                 params)))
      s = smelt__cuda_launch(plan->ctx, "smelt_quantize", (CUfunction)plan->func[F_SCALAR], 1, 1, 1, 1, 0, p1);
  }
  const int64_t ctas = f == SMELT_QUANT_FP8_ROW       ? smelt__ceil_div(a.rows, BLOCK / a.tpr)
                       : f == SMELT_QUANT_FP8_128X128 ? smelt__ceil_div(a.rows, 128) * smelt__ceil_div(a.cols, 128)
                                                      : smelt__ceil_div(seg_warps, BLOCK / 32);
  if (!s)
    s = smelt__cuda_launch(plan->ctx, "smelt_quantize", (CUfunction)plan->func[F_MAIN],
                           grid_for(plan, ctas, plan->variant), 1, 1, BLOCK, 0, params);
  smelt__nvtx_pop();
  return s;
}

static smelt_status plan_dequant(smelt_plan *plan, const void *args) {
  (void)args;
  const smelt_quant_format f = smelt__quant_format_of(plan);
  smelt__kernel_src src;
  make_src(SMELT_DTYPE_F32, smelt__quant_elem_fmt(f, plan->t[0].dtype), f, &src);
  CUfunction fn;
  smelt_status s = smelt__cuda_function(plan->ctx, &src, "dequant", &fn);
  if (s) return s;
  plan->func[0] = fn;
  plan->block = BLOCK;
  snprintf(plan->describe, sizeof plan->describe, "%s (quant.cu, dequant)", src.name);
  return SMELT_OK;
}

static smelt_status run_dequant(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *q = t[0], *sc = t[1], *y = t[3];
  int64_t rows = y->shape[0], cols = y->shape[1], n = rows * cols;
  if (n == 0) return SMELT_OK;
  void *qp = q->data, *sp = sc->data, *yp = y->data;
  const float *tp = t[2] ? (const float *)t[2]->data : NULL;
  int64_t qrs = q->strides[0], yrs = y->strides[0], ycs = y->strides[1], srs, scs;
  smelt__quant_scale_strides(sc, &srs, &scs);
  int ybf16 = y->dtype == SMELT_DTYPE_BF16;
  void *params[] = {&qp, &rows, &cols, &qrs, &sp, &srs, &scs, &tp, &yp, &yrs, &ycs, &ybf16};
  smelt__nvtx_push("smelt_dequantize");
  smelt_status s = smelt__cuda_launch(plan->ctx, "smelt_dequantize", (CUfunction)plan->func[0],
                                      grid_for(plan, smelt__ceil_div(n, BLOCK), BLOCKS_PER_SM), 1, 1, BLOCK, 0,
                                      params);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_quant = {.plan = plan_quant, .run = run_quant};
const smelt__backend smelt__cuda_dequant = {.plan = plan_dequant, .run = run_dequant};
