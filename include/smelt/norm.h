/* smelt row norms (RMSNorm, LayerNorm) with their backward, the residual
 * add, and the fused residual add + norm of a pre-norm transformer block.
 * Included by smelt.h.
 *
 * Definitions, per row of C elements (h = x + residual in the residual
 * form, h = x otherwise; statistics in f32, computed from h as rounded to
 * x's dtype, which is what h_out holds):
 *   LayerNorm  mean = sum(h) / C,  rstd = 1 / sqrt(sum((h - mean)^2) / C + eps)
 *              xhat = (h - mean) · rstd
 *   RMSNorm    rstd = 1 / sqrt(sum(h^2) / C + eps),  xhat = h · rstd
 *   y = xhat · weight + bias   (weight absent: 1; bias absent: 0)
 * Backward, with g = dy · weight and means over the row:
 *   LayerNorm  dx = rstd · (g − mean(g) − xhat · mean(g · xhat))
 *   RMSNorm    dx = rstd · (g − xhat · mean(g · xhat))
 *   dx += dh (the gradient reaching h_out in the residual form; it is the
 *   residual's gradient as well as x's)
 *   dweight = sum over rows of dy · xhat,  dbias = sum over rows of dy
 * The GPU sums dweight and dbias in a fixed order (per-CTA partial sums,
 * then one pass over them in order), so its results repeat bit for bit.
 *
 * Layouts: every [..., C] tensor has the same shape with unit stride along
 * C (rows may lie at any non-negative strides); the statistics are [...]
 * (x's shape without its last dim, any strides). weight and bias are [C]
 * with unit stride, in x's dtype or f32 (both the same dtype). C >= 1.
 * On an error nothing is written. Every backend supports every case.
 */
#ifndef SMELT_NORM_H
#define SMELT_NORM_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum smelt_norm_kind {
  SMELT_NORM_RMS = 0,   /* RMSNorm: no mean */
  SMELT_NORM_LAYER = 1, /* LayerNorm */
  SMELT_NORM_KIND_COUNT
} smelt_norm_kind;

/* "rms", "layer"; "?" if invalid. */
SMELT_API const char *smelt_norm_kind_name(smelt_norm_kind k);

typedef struct smelt_norm_desc {
  smelt_norm_kind kind;
  float eps; /* >= 0 and finite; 1e-5 or 1e-6 as the models use */
} smelt_norm_desc;

/* Forward, optionally after a residual add (one pass over the rows):
 *   x         [..., C]  f32, f16 or bf16
 *   residual  [..., C]  x's dtype, or NULL (then h = x)
 *   weight    [C]       x's dtype or f32, or NULL
 *   bias      [C]       weight's dtype (x's when weight is NULL), or NULL
 *   y         [..., C]  x's dtype; may be x exactly (in place)
 *   h_out     [..., C]  x's dtype: h = x + residual; only with residual, may
 *                       be NULL; may be residual exactly (the residual
 *                       stream updated in place)
 *   mean      [...]     f32; LayerNorm only; may be NULL
 *   rstd      [...]     f32; may be NULL
 * Keep mean and rstd for the backward. */
SMELT_API smelt_status smelt_norm_plan(smelt_ctx *ctx, const smelt_norm_desc *desc, const smelt_tensor *x,
                                       const smelt_tensor *residual, const smelt_tensor *weight,
                                       const smelt_tensor *bias, const smelt_tensor *y, const smelt_tensor *h_out,
                                       const smelt_tensor *mean, const smelt_tensor *rstd, smelt_plan **out);
SMELT_API smelt_status smelt_norm_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *residual,
                                      const smelt_tensor *weight, const smelt_tensor *bias, const smelt_tensor *y,
                                      const smelt_tensor *h_out, const smelt_tensor *mean,
                                      const smelt_tensor *rstd);
SMELT_API smelt_status smelt_norm(smelt_ctx *ctx, const smelt_norm_desc *desc, const smelt_tensor *x,
                                  const smelt_tensor *residual, const smelt_tensor *weight, const smelt_tensor *bias,
                                  const smelt_tensor *y, const smelt_tensor *h_out, const smelt_tensor *mean,
                                  const smelt_tensor *rstd);

/* Backward (desc as in the forward; eps is not used):
 *   dy       [..., C]  f32, f16 or bf16
 *   x        [..., C]  dy's dtype: the forward's h (x, or h_out in the residual form)
 *   weight   [C]       as in the forward, or NULL
 *   mean     [...]     f32: LayerNorm's, from the forward; NULL for RMSNorm
 *   rstd     [...]     f32, from the forward
 *   dh       [..., C]  dy's dtype, or NULL: added to dx
 *   dx       [..., C]  dy's dtype; may be dy exactly (in place)
 *   dweight  [C]       weight's dtype, or NULL; only with weight
 *   dbias    [C]       weight's dtype (dy's when weight is NULL), or NULL */
SMELT_API smelt_status smelt_norm_bwd_plan(smelt_ctx *ctx, const smelt_norm_desc *desc, const smelt_tensor *dy,
                                           const smelt_tensor *x, const smelt_tensor *weight,
                                           const smelt_tensor *mean, const smelt_tensor *rstd,
                                           const smelt_tensor *dh, const smelt_tensor *dx,
                                           const smelt_tensor *dweight, const smelt_tensor *dbias,
                                           smelt_plan **out);
SMELT_API smelt_status smelt_norm_bwd_run(smelt_plan *plan, const smelt_tensor *dy, const smelt_tensor *x,
                                          const smelt_tensor *weight, const smelt_tensor *mean,
                                          const smelt_tensor *rstd, const smelt_tensor *dh, const smelt_tensor *dx,
                                          const smelt_tensor *dweight, const smelt_tensor *dbias);
SMELT_API smelt_status smelt_norm_bwd(smelt_ctx *ctx, const smelt_norm_desc *desc, const smelt_tensor *dy,
                                      const smelt_tensor *x, const smelt_tensor *weight, const smelt_tensor *mean,
                                      const smelt_tensor *rstd, const smelt_tensor *dh, const smelt_tensor *dx,
                                      const smelt_tensor *dweight, const smelt_tensor *dbias);

/* Residual add, y = x + residual, elementwise (rounded once to the dtype):
 *   x, residual, y  same shape (any ndim <= 8), same dtype (f32, f16, bf16),
 *                   any non-negative strides; y may be residual exactly (in
 *                   place). Its backward is the identity for both inputs. */
SMELT_API smelt_status smelt_residual_add_plan(smelt_ctx *ctx, const smelt_tensor *x, const smelt_tensor *residual,
                                               const smelt_tensor *y, smelt_plan **out);
SMELT_API smelt_status smelt_residual_add_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *residual,
                                              const smelt_tensor *y);
SMELT_API smelt_status smelt_residual_add(smelt_ctx *ctx, const smelt_tensor *x, const smelt_tensor *residual,
                                          const smelt_tensor *y);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_NORM_H */
