/* smelt Conv2d: fprop, dgrad and wgrad, described the way the CUTLASS
 * Python interface describes its Conv2dOperation and Conv2dArguments, and
 * computed as the implicit GEMM those describe.
 *
 * The description has the GEMM engine's parts (smelt/gemm.h): the conv
 * kind; the problem's padding, stride and dilation; the iterator algorithm
 * and stride support that choose a kernel specialization; split-K; the math
 * (f32 exact or tf32); and GEMM's epilogue, reused as is. Tensors are
 * CUTLASS's A, B, C, D of the implicit GEMM, so the kind says what each is:
 *
 *   kind   A              B              C and D        bias   GEMM M x N x K
 *   fprop  x  [N,H,W,C]   w  [K,R,S,C]   y  [N,P,Q,K]   [K]    NPQ x K x RSC
 *   dgrad  dy [N,P,Q,K]   w  [K,R,S,C]   dx [N,H,W,C]   none   NHW x C x RSK
 *   wgrad  dy [N,P,Q,K]   x  [N,H,W,C]   dw [K,R,S,C]   none   K x RSC x NPQ
 *
 * Activations are NHWC, filters KRSC, outputs NPQK (row-major indices; any
 * non-negative strides, honoured by every backend). Cross-correlation, as
 * deep-learning frameworks define conv:
 *   y[n,p,q,k]  = sum_{r,s,c} x[n, ih(p,r), iw(q,s), c] · w[k,r,s,c]
 *   ih(p,r) = p·stride_h − pad_h0 + r·dilation_h,  iw(q,s) = q·stride_w − pad_w0 + s·dilation_w
 * where taps outside 0 <= ih < H, 0 <= iw < W read zero (the padding).
 *   dx[n,h,v,c] = sum over (p,r,k) with ih(p,r) = h and (q,s) with iw(q,s) = v
 *                 of dy[n,p,q,k] · w[k,r,s,c]          (the adjoint of fprop in x)
 *   dw[k,r,s,c] = sum_{n,p,q} dy[n,p,q,k] · x[n, ih(p,r), iw(q,s), c]   (its adjoint in w)
 *
 * Padding is per side, as CUTLASS's Conv2dProblemSize takes it (pad_h,
 * upper_pad_h, pad_w, upper_pad_w): the top and left pads shift the window,
 * the bottom and right pads only add output rows and columns. The output
 * size, for every kind:
 *   P = (H + pad_h0 + pad_h1 − dilation_h·(R − 1) − 1) / stride_h + 1
 *   Q = (W + pad_w0 + pad_w1 − dilation_w·(S − 1) − 1) / stride_w + 1
 * (integer division; the PyTorch formula, which CUTLASS's R·dilation form
 * equals for dilation 1). fprop takes H, W from A and checks D is [N,P,Q,K];
 * dgrad takes H, W from D (several H give one P when stride_h > 1) and
 * checks A is [N,P,Q,K]; wgrad takes R, S from D and checks the same. Any
 * N, H, W, C, K, R, S >= 1 with P, Q >= 1; pads >= 0, strides and
 * dilations >= 1.
 *
 * Element types: A and B of one dtype, f32, f16 or bf16, accumulated in
 * f32 (math TF32 rounds f32 operands to tf32 first, as smelt/gemm.h's
 * tf32); C and D f32, f16 or bf16, of one dtype (D's may differ from A's);
 * bias f32, f16 or bf16. The epilogue is GEMM's, per output element
 * (smelt_gemm_epilogue; the CPU reference does it in f64):
 *   v = alpha · scale_a · scale_b · acc + beta · C + bias[k]
 *   D = convert(scale_d · act(v))        (clamp saturates to D's finite range)
 * fprop takes all of it; dgrad and wgrad take alpha, beta and C (e.g. to
 * add into a gradient), clamp and the scales, but no bias and only the
 * identity activation. C is read only when beta != 0 (else it may be NULL);
 * D may be C exactly (same pointer and strides: in place) and must share no
 * memory with anything else.
 *
 * The iterator algorithm, stride support and split-K choose how a GPU
 * kernel walks the implicit GEMM; none changes the result beyond the order
 * of the f32 sums, and the CPU reference, which computes the sums directly
 * in f64, gives bit-identical results for every choice. Their
 * preconditions are checked on every backend, so a description that plans
 * on the CPU plans the same way on a GPU. On CUDA, f16 and bf16 problems
 * run, in this order of preference:
 *   - on Hopper (cc 9.0), as implicit GEMM on the GEMM engine's TMA + wgmma
 *     kernel, the activation loaded in TMA's im2col mode (a strided dgrad as
 *     stride² unit-stride phases of the taps that divide, in one launch,
 *     when every phase has a tap, D is 16-bit or f32 with 16-byte strides,
 *     there is no C and no split asked for; else dy gathered by the
 *     threads), when the activation's channels (fprop C,
 *     dgrad K) are a multiple of 8 and fill 3/4 of their 64-channel blocks,
 *     wgrad's C is a multiple of 64, the filter's taps fold to one stride,
 *     strides are 16-byte multiples, padding and dilation fit TMA's pixel
 *     box and C and D fold into the GEMM's [M, N] matrix; smelt's split-K
 *     is the GEMM's split tail (a last wave's tiles in K chunks) or, for
 *     plans of few tiles (wgrad's long K), parallel; both add their parts
 *     in order;
 *   - as implicit GEMM on the mma.sync kernel when the gathered tensors'
 *     channels (fprop and wgrad: C; dgrad: K and C) are a multiple of 8
 *     with unit stride, their other strides multiples of 8 elements, C and
 *     D fold into the GEMM's [M, N] matrix (any iterator); its split-K
 *     (smelt's choice: serial, for few output tiles and a long K);
 *   - through an explicit im2col workspace and the GEMM engine (few
 *     channels: ResNet's stem with C = 3), in chunks of at most 256 MiB;
 *     dgrad as a GEMM into f32 columns and a deterministic col2im;
 * the implicit GEMMs want A and B 16-byte aligned at run (else the
 * reference kernel runs that call); split-K changes the order of the f32 sums, so results differ between
 * split choices by rounding. Everything else runs the analytic reference
 * kernel (one thread per output element, f32 sums: correct, not fast).
 * smelt_plan_describe names the kernel.
 */
#ifndef SMELT_CONV2D_H
#define SMELT_CONV2D_H

#include "../smelt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum smelt_conv2d_kind {
  SMELT_CONV2D_FPROP = 0, /* y = conv(x, w) with the full epilogue */
  SMELT_CONV2D_DGRAD,     /* dx from dy and w */
  SMELT_CONV2D_WGRAD,     /* dw from dy and x */
  SMELT_CONV2D_KIND_COUNT
} smelt_conv2d_kind;

/* How the implicit GEMM's activation (A) tiles are gathered; CUTLASS's
 * IteratorAlgorithm. C·size means C times A's element size in bytes. */
typedef enum smelt_conv2d_iterator {
  SMELT_CONV2D_ITER_AUTO = 0,       /* smelt chooses among those whose preconditions hold */
  SMELT_CONV2D_ITER_ANALYTIC,       /* any problem: every tap's coordinates computed afresh */
  SMELT_CONV2D_ITER_OPTIMIZED,      /* R, S <= 32 (tap masks precomputed per tile); dgrad: unit stride */
  SMELT_CONV2D_ITER_FIXED_CHANNELS, /* fprop; one access holds a tap's channels: C a power of two,
                                       C·size <= 16 bytes (C in 1, 2, 4, and 8 for f16/bf16) */
  SMELT_CONV2D_ITER_FEW_CHANNELS,   /* fprop; a tap's channels fit one 16-byte access: C·size <= 16
                                       (C <= 4 for f32, <= 8 for f16/bf16; C = 3 the usual first layer) */
  SMELT_CONV2D_ITER_COUNT
} smelt_conv2d_iterator;

/* CUTLASS's StrideSupport. */
typedef enum smelt_conv2d_stride_support {
  SMELT_CONV2D_STRIDE_AUTO = 0, /* unity when stride_h = stride_w = 1, else strided */
  SMELT_CONV2D_STRIDE_STRIDED,  /* any stride */
  SMELT_CONV2D_STRIDE_UNITY,    /* stride_h = stride_w = 1 only */
  SMELT_CONV2D_STRIDE_COUNT
} smelt_conv2d_stride_support;

/* CUTLASS's SplitKMode. The slices cut the implicit GEMM's reduction (RSC,
 * RSK or NPQ); slices beyond its length are empty. */
typedef enum smelt_conv2d_split_k_mode {
  SMELT_CONV2D_SPLIT_K_AUTO = 0, /* serial or parallel, as smelt chooses */
  SMELT_CONV2D_SPLIT_K_SERIAL,   /* slices add into D in slice order, the last applying the epilogue */
  SMELT_CONV2D_SPLIT_K_PARALLEL, /* slices write partial sums to a workspace; a reduction adds them in
                                    slice order and applies the epilogue */
  SMELT_CONV2D_SPLIT_K_COUNT
} smelt_conv2d_split_k_mode;

typedef struct smelt_conv2d_desc {
  smelt_conv2d_kind kind;
  int pad_h0, pad_h1;         /* top, bottom (>= 0) */
  int pad_w0, pad_w1;         /* left, right (>= 0) */
  int stride_h, stride_w;     /* >= 1 */
  int dilation_h, dilation_w; /* >= 1 */
  smelt_gemm_math_op math;    /* DEFAULT (exact f32 products) or TF32 (f32 A and B only) */
  smelt_conv2d_iterator iterator;
  smelt_conv2d_stride_support stride_support;
  smelt_conv2d_split_k_mode split_k_mode;
  int split_k_slices;           /* 0 = choose, 1 = none, up to SMELT_GEMM_MAX_SPLIT_K */
  smelt_gemm_epilogue epilogue; /* as smelt/gemm.h; bias and activation in fprop only */
} smelt_conv2d_desc;

/* fprop, no padding, stride 1, dilation 1, DEFAULT math, everything else
 * chosen by smelt, and smelt_gemm_desc_default()'s epilogue (alpha 1,
 * beta 0, identity, slope 0.01, scales 1). Start from this and change
 * fields. */
SMELT_API smelt_conv2d_desc smelt_conv2d_desc_default(void);

/* P (axis 0) or Q (axis 1) of the formula above for an input extent
 * `in` (H or W) and filter extent `f` (R or S); 0 when the dilated filter
 * is larger than the padded input, -1 for an invalid desc or extent. */
SMELT_API int64_t smelt_conv2d_out_size(const smelt_conv2d_desc *desc, int axis, int64_t in, int64_t f);

/* desc may be NULL (the defaults). a, b, d are required; c may be NULL when
 * epilogue.beta == 0; bias may be NULL (fprop only). Shapes as in the table
 * above; validation failures name the tensor by its role in the kind
 * ("A (dy)") and write nothing. */
SMELT_API smelt_status smelt_conv2d_plan(smelt_ctx *ctx, const smelt_conv2d_desc *desc, const smelt_tensor *a,
                                         const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                         const smelt_tensor *bias, smelt_plan **out);
/* Binds tensors of exactly the planned dtypes, shapes and strides (data
 * pointers may change). */
SMELT_API smelt_status smelt_conv2d_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b,
                                        const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias);
SMELT_API smelt_status smelt_conv2d(smelt_ctx *ctx, const smelt_conv2d_desc *desc, const smelt_tensor *a,
                                    const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                    const smelt_tensor *bias);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_CONV2D_H */
