/* smelt_quantize and smelt_dequantize (include/smelt/quant.h): two families
 * on the op-family interface sharing one description of each format's
 * tensors, so that the shapes the quantizer writes are the shapes the
 * dequantizer reads. The plan keeps the format in opdata. */
#include "error_bound.h"
#include "quant_internal.h"

#include <stdio.h>

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype q_types[] = {SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2, SMELT_DTYPE_U8};
static const smelt_dtype scale_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_U8, SMELT_DTYPE_E4M3};
static const smelt_dtype f32[] = {SMELT_DTYPE_F32};
static const smelt_dtype y_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_BF16};

static const smelt__role quant_roles[] = {
    {"x", 0, float_types, 3, 0},
    {"q", SMELT__ROLE_OUTPUT, q_types, 3, 0},
    {"scale", SMELT__ROLE_OUTPUT, scale_types, 3, 0},
    {"tensor_scale", SMELT__ROLE_OUTPUT | SMELT__ROLE_OPTIONAL, f32, 1, 0},
};

static const smelt__role dequant_roles[] = {
    {"q", 0, q_types, 3, 0},
    {"scale", 0, scale_types, 3, 0},
    {"tensor_scale", SMELT__ROLE_OPTIONAL, f32, 1, 0},
    {"y", SMELT__ROLE_OUTPUT, y_types, 2, 0},
};

static const char *const format_names[SMELT_QUANT_FORMAT_COUNT] = {"fp8-tensor", "fp8-row",  "fp8-1x128",
                                                                   "fp8-128x128", "mxfp8", "nvfp4"};

const char *smelt_quant_format_name(smelt_quant_format f) {
  return (unsigned)f < SMELT_QUANT_FORMAT_COUNT ? format_names[f] : "?";
}

void smelt__quant_geometry(smelt_quant_format f, int64_t rows, int64_t cols, smelt__quant_geom *g) {
  static const int64_t block_rows[] = {0, 1, 1, 128, 1, 1}, block_cols[] = {0, 0, 128, 128, 32, 16};
  g->rows = rows;
  g->cols = cols;
  g->br = block_rows[f] ? block_rows[f] : (rows > 0 ? rows : 1);
  g->bk = block_cols[f] ? block_cols[f] : (cols > 0 ? cols : 1);
  g->sr = smelt__ceil_div(rows, g->br);
  g->sc = smelt__ceil_div(cols, g->bk);
  if (f == SMELT_QUANT_FP8_TENSOR) g->sr = g->sc = 1;
  if (f == SMELT_QUANT_FP8_ROW) g->sc = 1;
  g->qcols = f == SMELT_QUANT_NVFP4 ? smelt__ceil_div(cols, 2) : cols;
  g->elem = f == SMELT_QUANT_NVFP4 ? SMELT_DTYPE_U8 : SMELT_DTYPE_COUNT; /* COUNT: e4m3 or e5m2 */
  g->scale_dtype = f == SMELT_QUANT_MXFP8 ? SMELT_DTYPE_U8 : f == SMELT_QUANT_NVFP4 ? SMELT_DTYPE_E4M3 : SMELT_DTYPE_F32;
}

void smelt__quant_scale_strides(const smelt_tensor *s, int64_t *rs, int64_t *cs) {
  *rs = s->ndim >= 1 ? s->strides[0] : 0;
  *cs = s->ndim == 2 ? s->strides[1] : 0;
}

static smelt_status shape_error(const char *op, const char *name, const smelt_tensor *t, const char *want,
                                smelt_quant_format f) {
  char a[160];
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape=%s must be %s for format %s", op, name,
                      smelt__shape_str(t, a, sizeof a), want, smelt_quant_format_name(f));
}

/* t is [r, c], or [r] where c is 1 and `one_d` allows it ([1] for [1, 1]). */
static smelt_status check_2d(const char *op, const char *name, const smelt_tensor *t, int64_t r, int64_t c,
                             int one_d, smelt_quant_format f) {
  char want[96];
  if (t->ndim == 2 && t->shape[0] == r && t->shape[1] == c) return SMELT_OK;
  if (one_d && c == 1 && t->ndim == 1 && t->shape[0] == r) return SMELT_OK;
  snprintf(want, sizeof want, one_d && c == 1 ? "[%lld, 1] or [%lld]" : "[%lld, %lld]", (long long)r,
           (long long)(one_d && c == 1 ? r : c));
  return shape_error(op, name, t, want, f);
}

static smelt_status check_dtype_is(const char *op, const char *name, const smelt_tensor *t, smelt_dtype want,
                                   smelt_quant_format f) {
  if (t->dtype == want) return SMELT_OK;
  return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%s must be %s for format %s", op, name,
                      smelt_dtype_name(t->dtype), smelt_dtype_name(want), smelt_quant_format_name(f));
}

smelt_status smelt__quant_check_format(const char *op, smelt_quant_format f, int64_t rows, int64_t cols,
                                 const smelt_tensor *q, const smelt_tensor *scale, const smelt_tensor *ts) {
  if ((unsigned)f >= SMELT_QUANT_FORMAT_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: format=%d is not a smelt_quant_format (supported: 0..%d, fp8-tensor .. nvfp4)", op,
                        (int)f, SMELT_QUANT_FORMAT_COUNT - 1);
  smelt__quant_geom g;
  smelt__quant_geometry(f, rows, cols, &g);
  smelt_status s;
  if (g.elem == SMELT_DTYPE_COUNT && q->dtype != SMELT_DTYPE_E4M3 && q->dtype != SMELT_DTYPE_E5M2)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: q.dtype=%s must be e4m3 or e5m2 for format %s", op,
                        smelt_dtype_name(q->dtype), smelt_quant_format_name(f));
  if ((g.elem != SMELT_DTYPE_COUNT && (s = check_dtype_is(op, "q", q, g.elem, f))) ||
      (s = check_2d(op, "q", q, rows, g.qcols, 0, f)) ||
      (s = check_dtype_is(op, "scale", scale, g.scale_dtype, f)) ||
      (s = check_2d(op, "scale", scale, g.sr, g.sc, f <= SMELT_QUANT_FP8_ROW, f)))
    return s;
  if (q->shape[1] > 1 && q->strides[1] != 1)
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: q.strides[1]=%lld must be 1 (rows of q are contiguous)", op,
                        (long long)q->strides[1]);
  if (f == SMELT_QUANT_NVFP4 && !ts)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: tensor_scale is NULL; format nvfp4 needs one ([1] f32)", op);
  if (f != SMELT_QUANT_NVFP4 && ts)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: tensor_scale must be NULL for format %s (nvfp4 only)", op,
                        smelt_quant_format_name(f));
  return ts ? check_2d(op, "tensor_scale", ts, 1, 1, 1, f) : SMELT_OK;
}

static smelt_status check_matrix(const char *op, const char *name, const smelt_tensor *t) {
  if (t->ndim == 2) return SMELT_OK;
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.ndim=%d must be 2 ([rows, cols], K = cols)", op, name,
                      t->ndim);
}

static void describe(smelt_plan *plan, const char *what, smelt_quant_format f, const smelt_tensor *wide,
                     const smelt_tensor *q) {
  snprintf(plan->describe, sizeof plan->describe, "%s %s %s [%lld, %lld] %s (cpu reference)", what,
           smelt_quant_format_name(f), smelt_dtype_name(wide->dtype), (long long)wide->shape[0],
           (long long)wide->shape[1], smelt_dtype_name(q->dtype));
}

static smelt_status check_quant(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_quant.op;
  smelt_quant_format f = *(const smelt_quant_format *)params;
  smelt_status s;
  if ((s = check_matrix(op, "x", t[0])) ||
      (s = smelt__quant_check_format(op, f, t[0]->shape[0], t[0]->shape[1], t[1], t[2], t[3])))
    return s;
  describe(plan, "quantize", f, t[0], t[1]);
  return SMELT_OK;
}

static smelt_status check_dequant(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_dequant.op;
  smelt_quant_format f = *(const smelt_quant_format *)params;
  smelt_status s;
  if ((s = check_matrix(op, "y", t[3])) ||
      (s = smelt__quant_check_format(op, f, t[3]->shape[0], t[3]->shape[1], t[0], t[1], t[2])))
    return s;
  describe(plan, "dequantize", f, t[3], t[0]);
  return SMELT_OK;
}

/* Both families are bit-exact against the CPU reference. */
static double bound_exact(const smelt__bound_query *q) {
  (void)q;
  return 0.0;
}

const smelt__family smelt__family_quant = {
    .name = "quant",
    .op = "smelt_quantize",
    .what = "a quantize",
    .nroles = 4,
    .roles = quant_roles,
    .params_size = sizeof(smelt_quant_format),
    .check = check_quant,
    .cpu = &smelt__cpu_quant,
    .cuda = &smelt__cuda_quant,
    .bound = bound_exact,
};

const smelt__family smelt__family_dequant = {
    .name = "dequant",
    .op = "smelt_dequantize",
    .what = "a dequantize",
    .nroles = 4,
    .roles = dequant_roles,
    .params_size = sizeof(smelt_quant_format),
    .check = check_dequant,
    .cpu = &smelt__cpu_dequant,
    .cuda = &smelt__cuda_dequant,
    .bound = bound_exact,
};

smelt_status smelt_quantize_plan(smelt_ctx *ctx, smelt_quant_format format, const smelt_tensor *x,
                                 const smelt_tensor *q, const smelt_tensor *scale, const smelt_tensor *tensor_scale,
                                 smelt_plan **out) {
  const smelt_tensor *t[] = {x, q, scale, tensor_scale};
  return smelt__family_plan(&smelt__family_quant, ctx, &format, t, out);
}

smelt_status smelt_quantize_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *q,
                                const smelt_tensor *scale, const smelt_tensor *tensor_scale) {
  const smelt_tensor *t[] = {x, q, scale, tensor_scale};
  return smelt__family_run(&smelt__family_quant, plan, t);
}

smelt_status smelt_quantize(smelt_ctx *ctx, smelt_quant_format format, const smelt_tensor *x, const smelt_tensor *q,
                            const smelt_tensor *scale, const smelt_tensor *tensor_scale) {
  SMELT__ONE_SHOT(smelt_quantize_plan(ctx, format, x, q, scale, tensor_scale, &plan),
                  smelt_quantize_run(plan, x, q, scale, tensor_scale));
}

smelt_status smelt_dequantize(smelt_ctx *ctx, smelt_quant_format format, const smelt_tensor *q,
                              const smelt_tensor *scale, const smelt_tensor *tensor_scale, const smelt_tensor *y) {
  const smelt_tensor *t[] = {q, scale, tensor_scale, y};
  SMELT__ONE_SHOT(smelt__family_plan(&smelt__family_dequant, ctx, &format, t, &plan),
                  smelt__family_run(&smelt__family_dequant, plan, t));
}
