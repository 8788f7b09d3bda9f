/* smelt quantized GEMM: the "production kernel manager" of the
 * low-precision formats. One call takes the weights' format name and the
 * activations' dtype, picks the kernel and runs the GEMM with its epilogue:
 *
 *   D [M, N] = act(alpha · (x [M, K] · dequant(W)ᵀ) + bias [N])
 *
 * W [N, K] is given quantized, as smelt_quantize writes it from an
 * nn.Linear weight [out, in] (K-major: one row of W per output column):
 *
 *   format   q                  scale                 tensor_scale
 *   NVFP4    [N, K/2] u8        [N, K/16] e4m3        [1] or [1, 1] f32
 *
 * dequant(W)[n, k] = e2m1(q[n, k]) · e4m3(scale[n, k/16]) · tensor_scale,
 * exactly (the real number: no rounding of the product), E2M1 element 2j
 * in the low nibble of byte j and 2j + 1 in the high one
 * (include/smelt/quant.h). x is bf16 or f16 [M, K], any strides; D is f32,
 * f16 or bf16 [M, N], any strides; bias (optional) f32, f16 or bf16 [N],
 * any stride. act is smelt_act (slope for leaky_relu), applied last. D is
 * rounded once to its dtype (to nearest even; overflow gives ±inf).
 *
 * K rule: K must be a multiple of 16 (whole scale blocks; smelt_quantize
 * also writes ragged rows, which this op does not take). Any M, N >= 0;
 * K = 0 gives D = act(bias). q has unit column stride, any row stride;
 * scale and x take any strides (aligned, unit-stride rows are the fast
 * path on CUDA).
 *
 * Supported now: NVFP4 weights with bf16 or f16 activations (W4A16).
 * Every other format (fp8-*, mxfp8) or activation dtype is refused with
 * SMELT_STATUS_UNSUPPORTED naming the combination; the descriptor already
 * carries them, so adding one is a new case, not a new API.
 *
 * CUDA: M <= 16 streams the 4-bit weights through a GEMV kernel
 * (kernels/qgemm_w4.cu: mma.sync on weights decoded in registers, K split
 * over CTAs when N is small, added in a fixed order: deterministic);
 * M > 16 dequantizes W to x's dtype into a workspace (exact: every E2M1 x
 * E4M3 product fits bf16 and f16) and runs smelt's 16-bit GEMM with the
 * tensor scale and the epilogue. The CPU backend is the reference:
 * weights decoded exactly, products summed in f64.
 *
 * Validation happens before anything is written; on an error nothing is.
 * Included by smelt.h (after quant.h).
 */
#ifndef SMELT_QGEMM_H
#define SMELT_QGEMM_H

#ifdef __cplusplus
extern "C" {
#endif

/* The quantized weights: the format's tensors, as in the table above
 * (tensor_scale NULL for formats without one). */
typedef struct smelt_qgemm_weights {
  smelt_quant_format format;
  const smelt_tensor *q;
  const smelt_tensor *scale;
  const smelt_tensor *tensor_scale;
} smelt_qgemm_weights;

/* The epilogue: D = act(alpha · acc + bias). */
typedef struct smelt_qgemm_desc {
  double alpha; /* finite; default 1 */
  smelt_act act;
  float slope;  /* leaky_relu slope (default 0.01) */
} smelt_qgemm_desc;

/* alpha 1, identity, slope 0.01. */
SMELT_API smelt_qgemm_desc smelt_qgemm_desc_default(void);

/* desc may be NULL (the defaults); bias may be NULL. x [M, K], w's tensors
 * for [N, K], d [M, N]. */
SMELT_API smelt_status smelt_qgemm_plan(smelt_ctx *ctx, const smelt_qgemm_desc *desc, const smelt_tensor *x,
                                        const smelt_qgemm_weights *w, const smelt_tensor *bias, const smelt_tensor *d,
                                        smelt_plan **out);
/* Binds tensors of exactly the planned dtypes, shapes and strides, and
 * weights of the planned format (data pointers may change). */
SMELT_API smelt_status smelt_qgemm_run(smelt_plan *plan, const smelt_tensor *x, const smelt_qgemm_weights *w,
                                       const smelt_tensor *bias, const smelt_tensor *d);
SMELT_API smelt_status smelt_qgemm(smelt_ctx *ctx, const smelt_qgemm_desc *desc, const smelt_tensor *x,
                                   const smelt_qgemm_weights *w, const smelt_tensor *bias, const smelt_tensor *d);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_QGEMM_H */
