/* smelt_qgemm (include/smelt/qgemm.h): the quantized GEMM's family on the
 * op-family interface. The weights' tensors are roles of their own (q,
 * scale, tensor_scale) and their format is part of the description, so
 * the shared code checks and binds them like any tensor, and the format's
 * shapes come from the quantizers' own check (src/core/op_quant.c): what
 * smelt_quantize writes is what this op reads. The combinations not
 * implemented yet pass the shared checks and are refused here, by name. */
#include "error_bound.h"
#include "qgemm_internal.h"

#include <math.h>
#include <stdio.h>

#define OP "smelt_qgemm"

/* Every dtype a future format or activation may use reaches the check, so
 * an unimplemented one is UNSUPPORTED rather than a dtype error. */
static const smelt_dtype x_types[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16, SMELT_DTYPE_F32, SMELT_DTYPE_E4M3,
                                      SMELT_DTYPE_E5M2};
static const smelt_dtype q_types[] = {SMELT_DTYPE_U8, SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2};
static const smelt_dtype scale_types[] = {SMELT_DTYPE_E4M3, SMELT_DTYPE_F32, SMELT_DTYPE_U8};
static const smelt_dtype f32[] = {SMELT_DTYPE_F32};
static const smelt_dtype out_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

static const smelt__role roles[SMELT__QG_COUNT] = {
    [SMELT__QG_X] = {"x", 0, x_types, 5, 0},
    [SMELT__QG_Q] = {"w.q", 0, q_types, 3, 0},
    [SMELT__QG_SCALE] = {"w.scale", 0, scale_types, 3, 0},
    [SMELT__QG_TS] = {"w.tensor_scale", SMELT__ROLE_OPTIONAL, f32, 1, 0},
    [SMELT__QG_BIAS] = {"bias", SMELT__ROLE_OPTIONAL, out_types, 3, 0},
    [SMELT__QG_D] = {"d", SMELT__ROLE_OUTPUT, out_types, 3, 0},
};

smelt_qgemm_desc smelt_qgemm_desc_default(void) {
  smelt_qgemm_desc d = {1.0, SMELT_ACT_IDENTITY, 0.01f};
  return d;
}

static smelt_status check_desc(const smelt_qgemm_desc *d) {
  if ((unsigned)d->act >= SMELT_ACT_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.act=%d is not a smelt_act (0..%d)", (int)d->act,
                        SMELT_ACT_COUNT - 1);
  if (!isfinite(d->alpha))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.alpha=%g must be finite", d->alpha);
  if (!isfinite(d->slope))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.slope=%g must be finite", (double)d->slope);
  return SMELT_OK;
}

/* The format and the activations' dtype form an implemented pair. */
static smelt_status check_supported(smelt_quant_format f, smelt_dtype xdt) {
  if ((unsigned)f >= SMELT_QUANT_FORMAT_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": w.format=%d is not a smelt_quant_format (0..%d, fp8-tensor .. nvfp4)", (int)f,
                        SMELT_QUANT_FORMAT_COUNT - 1);
  if (f != SMELT_QUANT_NVFP4)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": weights of format %s are not implemented (supported: nvfp4 weights with bf16 or f16 "
                           "activations)",
                        smelt_quant_format_name(f));
  if (xdt != SMELT_DTYPE_BF16 && xdt != SMELT_DTYPE_F16)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": nvfp4 weights with %s activations are not implemented (supported: x bf16 or f16)",
                        smelt_dtype_name(xdt));
  return SMELT_OK;
}

static smelt_status check_matrix(const char *name, const smelt_tensor *t, const char *what) {
  if (t->ndim == 2) return SMELT_OK;
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": %s.ndim=%d must be 2 (%s)", name, t->ndim, what);
}

static smelt_status check_shapes(smelt_quant_format f, const smelt_tensor *const *t) {
  const smelt_tensor *x = t[SMELT__QG_X], *d = t[SMELT__QG_D], *bias = t[SMELT__QG_BIAS];
  smelt_status s;
  char a[160];
  if ((s = check_matrix("x", x, "[M, K]")) || (s = check_matrix("d", d, "[M, N]"))) return s;
  const int64_t M = x->shape[0], K = x->shape[1], N = d->shape[1];
  if (d->shape[0] != M)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": d.shape=%s must be [M, N] with M=%lld (x's rows)",
                        smelt__shape_str(d, a, sizeof a), (long long)M);
  if (K % 16)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                        OP ": K=%lld (x.shape[1]) must be a multiple of 16 for %s weights (whole scale blocks)",
                        (long long)K, smelt_quant_format_name(f));
  if ((s = smelt__quant_check_format(OP, f, N, K, t[SMELT__QG_Q], t[SMELT__QG_SCALE], t[SMELT__QG_TS]))) return s;
  if (bias && !(bias->ndim == 1 && bias->shape[0] == N))
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": bias.shape=%s must be [N]=[%lld]",
                        smelt__shape_str(bias, a, sizeof a), (long long)N);
  return SMELT_OK;
}

static smelt_status check(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const smelt__qgemm_params *p = (const smelt__qgemm_params *)params;
  smelt_status s;
  if ((s = check_desc(&p->desc)) || (s = check_supported(p->format, t[SMELT__QG_X]->dtype)) ||
      (s = check_shapes(p->format, t)))
    return s;
  snprintf(plan->describe, sizeof plan->describe, "qgemm %s x %s [%lld, %lld] -> %s [%lld, %lld] (cpu reference)",
           smelt_dtype_name(t[SMELT__QG_X]->dtype), smelt_quant_format_name(p->format),
           (long long)t[SMELT__QG_X]->shape[0], (long long)t[SMELT__QG_X]->shape[1],
           smelt_dtype_name(t[SMELT__QG_D]->dtype), (long long)t[SMELT__QG_D]->shape[0],
           (long long)t[SMELT__QG_D]->shape[1]);
  return SMELT_OK;
}

/* The weights are exact in the kernels' 16-bit operands and the sums are
 * f32 (the GEMV and the GEMM alike), so the error is that of a 16-bit GEMM
 * with f32 accumulation: the output's rounding plus the f32 sums. The CPU
 * reference against the exact result: its one rounding to D's dtype. */
static double bound(const smelt__bound_query *q) {
  const double out = q->dtype == SMELT_DTYPE_BF16 ? 1e-2 : q->dtype == SMELT_DTYPE_F16 ? 2e-3 : 1e-6;
  if (q->metric == SMELT__METRIC_MAX_REL) return 4 * out + 1e-4;
  return q->device == SMELT_DEVICE_CPU ? out : out + 1e-5;
}

const smelt__family smelt__family_qgemm = {
    .name = "qgemm",
    .op = OP,
    .what = "a qgemm",
    .nroles = SMELT__QG_COUNT,
    .roles = roles,
    .params_size = sizeof(smelt__qgemm_params),
    .check = check,
    .cpu = &smelt__cpu_qgemm,
    .cuda = &smelt__cuda_qgemm,
    .bound = bound,
};

/* The role array of a call, or NULL_POINTER when w is NULL. */
static smelt_status roles_of(const smelt_tensor *x, const smelt_qgemm_weights *w, const smelt_tensor *bias,
                             const smelt_tensor *d, const smelt_tensor **t) {
  if (!w) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": w is NULL");
  t[SMELT__QG_X] = x;
  t[SMELT__QG_Q] = w->q;
  t[SMELT__QG_SCALE] = w->scale;
  t[SMELT__QG_TS] = w->tensor_scale;
  t[SMELT__QG_BIAS] = bias;
  t[SMELT__QG_D] = d;
  return SMELT_OK;
}

smelt_status smelt_qgemm_plan(smelt_ctx *ctx, const smelt_qgemm_desc *desc, const smelt_tensor *x,
                              const smelt_qgemm_weights *w, const smelt_tensor *bias, const smelt_tensor *d,
                              smelt_plan **out) {
  if (out) *out = NULL;
  const smelt_tensor *t[SMELT__QG_COUNT];
  smelt_status s = roles_of(x, w, bias, d, t);
  if (s) return s;
  smelt__qgemm_params p = {w->format, desc ? *desc : smelt_qgemm_desc_default()};
  return smelt__family_plan(&smelt__family_qgemm, ctx, &p, t, out);
}

smelt_status smelt_qgemm_run(smelt_plan *plan, const smelt_tensor *x, const smelt_qgemm_weights *w,
                             const smelt_tensor *bias, const smelt_tensor *d) {
  const smelt_tensor *t[SMELT__QG_COUNT];
  smelt_status s;
  if ((s = smelt__check_plan(&smelt__family_qgemm, "smelt_qgemm_run", plan)) || (s = roles_of(x, w, bias, d, t)))
    return s;
  const smelt_quant_format planned = smelt__qgemm_params_of(plan)->format;
  if (w->format != planned)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "smelt_qgemm_run: w.format=%s differs from the planned %s",
                        smelt_quant_format_name(w->format), smelt_quant_format_name(planned));
  return smelt__family_run(&smelt__family_qgemm, plan, t);
}

smelt_status smelt_qgemm(smelt_ctx *ctx, const smelt_qgemm_desc *desc, const smelt_tensor *x,
                         const smelt_qgemm_weights *w, const smelt_tensor *bias, const smelt_tensor *d) {
  SMELT__ONE_SHOT(smelt_qgemm_plan(ctx, desc, x, w, bias, d, &plan), smelt_qgemm_run(plan, x, w, bias, d));
}
