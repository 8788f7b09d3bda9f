/* Conv2d by direct convolution: CUDA's analytic reference path, correct
 * for every problem smelt/conv2d.h describes and not fast. Each thread owns
 * one element of D and gathers its sum in f32 exactly as the CPU reference
 * (src/cpu/conv2d.c) does in f64: fprop over the taps (r, s) and channels c,
 * dgrad over the taps whose output position (p, q) reads the element and
 * the filters k, wgrad over n, p, q. It then applies GEMM's epilogue with
 * GEMM's own functions (gemm_common.cuh), so the two engines round alike.
 * The implicit-GEMM kernels are to replace it on the fast paths; the
 * description's iterator and split-K do not change what it computes.
 *
 * Prelude: SMELT_DT, A's and B's dtype (1 f32, 2 f16, 3 bf16); CONV_KIND
 * (0 fprop, 1 dgrad, 2 wgrad: smelt_conv2d_kind); CONV_TF32 1 rounds f32
 * operands to tf32 (cvt.rna) before they multiply; GEMM_ACC 1 (f32, for
 * gemm_common.cuh). C, D and bias dtypes are run-time parameters, as in the
 * GEMM kernels. Every index is 64-bit: any size the host accepted fits.
 */
#include "gemm_common.cuh"

#if !defined(SMELT_DT) || !defined(CONV_KIND) || !defined(CONV_TF32)
#error "conv2d_direct.cu needs SMELT_DT, CONV_KIND and CONV_TF32"
#endif

#define KIND_FPROP 0
#define KIND_DGRAD 1
#define KIND_WGRAD 2
#define BLOCK 256

/* Launch parameters (mirrored by conv_kparams in src/cuda/op_conv2d.c).
 * Strides are in elements, in each tensor's own dim order. */
typedef struct conv_params {
  u64 a, b, c, d, bias;
  i64 a_s[4], b_s[4], c_s[4], d_s[4], bias_s;
  i64 n, h, w, c_, k, r, s, p, q; /* the problem (c_: channels; c is C's pointer) */
  i64 total;                      /* D's elements */
  int pad_h0, pad_w0, stride_h, stride_w, dil_h, dil_w;
  double alpha_ab; /* alpha * scale_a * scale_b */
  double beta;
  float scale_d, slope;
  int dt_c, dt_d, dt_bias, act, clamp, has_c, has_bias, pad;
} conv_params;

static_assert(sizeof(conv_params) == 336, "conv_params must match conv_kparams");

static __device__ __forceinline__ i64 off4(const i64 *st, i64 i0, i64 i1, i64 i2, i64 i3) {
  return i0 * st[0] + i1 * st[1] + i2 * st[2] + i3 * st[3];
}

/* An operand element of A or B in f32 (tf32 when asked). */
static __device__ __forceinline__ float operand(u64 base, i64 off) {
  float v = load_elem(((const elem_t *)base)[off]);
#if CONV_TF32
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  v = __uint_as_float(r);
#endif
  return v;
}

/* The input coordinate output position o reads through tap f, or -1 in the
 * padding; and the output position whose tap f reads input coordinate i,
 * or -1 when none does. */
static __device__ __forceinline__ i64 tap(i64 o, i64 f, int stride, int pad0, int dil, i64 in) {
  const i64 i = o * stride - pad0 + f * dil;
  return i >= 0 && i < in ? i : -1;
}
static __device__ __forceinline__ i64 untap(i64 i, i64 f, int stride, int pad0, int dil, i64 out) {
  const i64 t = i + pad0 - f * dil;
  return t >= 0 && t % stride == 0 && t / stride < out ? t / stride : -1;
}

/* The sum of D's element (i0, i1, i2, i3): y[n,p,q,k], dx[n,h,w,c] or
 * dw[k,r,s,c] by the kind. fprop and dgrad run over the filter taps (r, s),
 * mapping (i1, i2) through each to A's (p, q) in dgrad or (h, w) in fprop,
 * and sum over A's last dim, which is the filter's dim 3 in fprop (c) and
 * dim 0 in dgrad (k). */
static __device__ float conv_sum(const conv_params &P, i64 i0, i64 i1, i64 i2, i64 i3) {
  float acc = 0.f;
#if CONV_KIND == KIND_WGRAD
  for (i64 n = 0; n < P.n; n++)
    for (i64 p = 0; p < P.p; p++) {
      const i64 h = tap(p, i1, P.stride_h, P.pad_h0, P.dil_h, P.h);
      for (i64 q = 0; q < P.q && h >= 0; q++) {
        const i64 w = tap(q, i2, P.stride_w, P.pad_w0, P.dil_w, P.w);
        if (w >= 0) acc = fmaf(operand(P.a, off4(P.a_s, n, p, q, i0)), operand(P.b, off4(P.b_s, n, h, w, i3)), acc);
      }
    }
#else
  const int dgrad = CONV_KIND == KIND_DGRAD;
  const i64 inner = dgrad ? P.k : P.c_;
  for (i64 r = 0; r < P.r; r++) {
    const i64 ai =
        dgrad ? untap(i1, r, P.stride_h, P.pad_h0, P.dil_h, P.p) : tap(i1, r, P.stride_h, P.pad_h0, P.dil_h, P.h);
    for (i64 s = 0; s < P.s && ai >= 0; s++) {
      const i64 aj =
          dgrad ? untap(i2, s, P.stride_w, P.pad_w0, P.dil_w, P.q) : tap(i2, s, P.stride_w, P.pad_w0, P.dil_w, P.w);
      for (i64 x = 0; x < inner && aj >= 0; x++)
        acc = fmaf(operand(P.a, off4(P.a_s, i0, ai, aj, x)),
                   operand(P.b, dgrad ? off4(P.b_s, x, r, s, i3) : off4(P.b_s, i3, r, s, x)), acc);
    }
  }
#endif
  return acc;
}

extern "C" __global__ void __launch_bounds__(BLOCK) conv2d_direct(conv_params P) {
  /* D's extents in its own dim order. */
#if CONV_KIND == KIND_FPROP
  const i64 e1 = P.p, e2 = P.q, e3 = P.k;
#elif CONV_KIND == KIND_DGRAD
  const i64 e1 = P.h, e2 = P.w, e3 = P.c_;
#else
  const i64 e1 = P.r, e2 = P.s, e3 = P.c_;
#endif
  for (i64 e = (i64)blockIdx.x * BLOCK + threadIdx.x; e < P.total; e += (i64)gridDim.x * BLOCK) {
    i64 rest = e;
    const i64 i3 = rest % e3;
    rest /= e3;
    const i64 i2 = rest % e2;
    rest /= e2;
    const i64 i1 = rest % e1, i0 = rest / e1;
    float v = (float)P.alpha_ab * conv_sum(P, i0, i1, i2, i3);
    if (P.has_c) v += (float)P.beta * gemm_loadf((const void *)P.c, P.dt_c, off4(P.c_s, i0, i1, i2, i3));
    if (P.has_bias) v += gemm_loadf((const void *)P.bias, P.dt_bias, i3 * P.bias_s);
    v = gemm_act(v, P.act, P.slope) * P.scale_d;
    gemm_store((void *)P.d, P.dt_d, off4(P.d_s, i0, i1, i2, i3), v, P.clamp);
  }
}
