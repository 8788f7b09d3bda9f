/* smelt quantizers: bf16/f16/f32 matrices to the low-precision formats of
 * the scaled GEMMs (../shared/SEMANTICS.md, Low-precision formats), and back
 * for checking. Included by smelt.h.
 *
 * Shapes. x is [rows, cols] with K = cols the quantized (contiguous) axis;
 * blocks run along K and the last block of a row may be short (ragged K).
 * Every scale is computed in f32 with the expressions below, in this order,
 * on the CPU reference and on the GPU alike, so both give the same bits.
 *
 *   format            q                         scale                          tensor_scale
 *   FP8_TENSOR        [rows, cols] e4m3|e5m2    [1] f32 (or [1, 1])            NULL
 *   FP8_ROW           [rows, cols] e4m3|e5m2    [rows] f32 (or [rows, 1])      NULL
 *   FP8_1X128         [rows, cols] e4m3|e5m2    [rows, ceil(cols/128)] f32     NULL
 *   FP8_128X128       [rows, cols] e4m3|e5m2    [ceil(rows/128), ceil(cols/128)] f32   NULL
 *   MXFP8             [rows, cols] e4m3|e5m2    [rows, ceil(cols/32)] u8 (E8M0)        NULL
 *   NVFP4             [rows, ceil(cols/2)] u8   [rows, ceil(cols/16)] e4m3     [1] f32 (or [1, 1])
 *
 * FP8_1X128 is DeepGEMM's A side (one scale per row and 128 of K) and
 * FP8_128X128 its B side (one per 128 rows and 128 of K). Scale tensors take
 * any non-negative strides, so DeepGEMM's K-major scale layout is the view
 * [rows, kb] with strides [1, ld]. x takes any strides; q must have unit
 * column stride (any row stride).
 *
 * Definitions (amax: the largest |x| of the block; NaN elements are left out
 * of it, ±inf are in it; fmax: 448 for e4m3, 57344 for e5m2; RNE-sat: round
 * to nearest even, values beyond the format's largest finite one saturate
 * to it, ±inf included):
 *   FP8_*   scale = amax / fmax, or 1 when amax = 0 (a block of zeros);
 *           q = RNE-sat(x / scale). A NaN element gives the format's NaN
 *           (e4m3 S.1111.111, e5m2 S.11111.10); a block holding ±inf gets
 *           scale +inf, its ±inf elements become NaN and the others ±0.
 *   MXFP8   (OCP Microscaling Formats v1.0, blocks of 32 along K)
 *           shared_exp = floor(log2(amax)) − emax_elem (e4m3: 8, e5m2: 15),
 *           clamped to [−127, 127]; amax = 0 (or below 2^-119 with e4m3,
 *           2^-112 with e5m2) gives the clamp −127. The E8M0 byte is
 *           shared_exp + 127 (scale 2^(byte − 127); 0xFF, NaN, is written
 *           for a block holding ±inf). q = RNE-sat(x / 2^shared_exp),
 *           rounded once from x (exact scaling); NaN elements as FP8_*, and
 *           in a NaN-scale block every element is NaN.
 *   NVFP4   (NVIDIA's recipe) tensor_scale = amax_tensor / (448 · 6), or 1
 *           when amax_tensor = 0; block_scale = e4m3(amax_block / (6 ·
 *           tensor_scale)) per 16 of K (RNE-sat); q = E2M1 RNE-sat(x /
 *           (block_scale · tensor_scale)), or ±0 where that product is 0.
 *           E2M1 is S.EE.M with values ±{0, .5, 1, 1.5, 2, 3, 4, 6}; it has
 *           no NaN, so a NaN element gives +6 (0x7). Two elements per byte,
 *           element 2j in the low nibble and 2j + 1 in the high one; an odd
 *           cols leaves the last byte's high nibble 0.
 *
 * Dequantization (for checking) computes y = decode(q) · s in f32 and
 * rounds once to y's dtype (f32 or bf16), where s is the block's f32 scale,
 * 2^(byte − 127) for MXFP8 (NaN for byte 0xFF), and block_scale ·
 * tensor_scale (the same f32 product as above) for NVFP4. y is [rows, cols],
 * any strides.
 *
 * Validation: x f32/f16/bf16 2-D; the shapes and dtypes above; outputs
 * distinct and disjoint from the inputs. On an error nothing is written.
 * CUDA: every format and dtype; the CPU backend is the bit-exact reference.
 */
#ifndef SMELT_QUANT_H
#define SMELT_QUANT_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum smelt_quant_format {
  SMELT_QUANT_FP8_TENSOR = 0, /* one f32 scale for the tensor */
  SMELT_QUANT_FP8_ROW,        /* one f32 scale per row */
  SMELT_QUANT_FP8_1X128,      /* one f32 scale per row and 128 of K (DeepGEMM A) */
  SMELT_QUANT_FP8_128X128,    /* one f32 scale per 128 x 128 block (DeepGEMM B) */
  SMELT_QUANT_MXFP8,          /* one E8M0 byte per row and 32 of K (OCP MX) */
  SMELT_QUANT_NVFP4,          /* E2M1 pairs, one e4m3 scale per 16 of K, one f32 tensor scale */
  SMELT_QUANT_FORMAT_COUNT
} smelt_quant_format;

/* "fp8-tensor", "fp8-row", "fp8-1x128", "fp8-128x128", "mxfp8", "nvfp4"; "?" if invalid. */
SMELT_API const char *smelt_quant_format_name(smelt_quant_format f);

/* x [rows, cols] f32|f16|bf16 -> q, scale, tensor_scale (NVFP4 only, else
 * NULL), shapes as in the table above. */
SMELT_API smelt_status smelt_quantize_plan(smelt_ctx *ctx, smelt_quant_format format, const smelt_tensor *x,
                                           const smelt_tensor *q, const smelt_tensor *scale,
                                           const smelt_tensor *tensor_scale, smelt_plan **out);
SMELT_API smelt_status smelt_quantize_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *q,
                                          const smelt_tensor *scale, const smelt_tensor *tensor_scale);
SMELT_API smelt_status smelt_quantize(smelt_ctx *ctx, smelt_quant_format format, const smelt_tensor *x,
                                      const smelt_tensor *q, const smelt_tensor *scale,
                                      const smelt_tensor *tensor_scale);

/* q, scale, tensor_scale as smelt_quantize writes them -> y [rows, cols]
 * f32|bf16 (rows and cols are read from y). One call, without a plan of
 * its own: it is there to check quantized data, not for speed. */
SMELT_API smelt_status smelt_dequantize(smelt_ctx *ctx, smelt_quant_format format, const smelt_tensor *q,
                                        const smelt_tensor *scale, const smelt_tensor *tensor_scale,
                                        const smelt_tensor *y);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_QUANT_H */
