/* Conv2d's explicit path (src/cuda/conv2d_explicit.c): the two data
 * movements around its GEMMs, for the 16-bit problems whose channels the
 * implicit GEMMs cannot gather (C = 3 in a network's first layer).
 *
 * conv2d_im2col writes rows m0 .. m0 + rows - 1 of im2col(x), the GEMM's
 * row-major [NPQ, kp] operand: row (n, p, q), column (r·S + s)·C + c holds
 * x[n, ih(p,r), iw(q,s), c], zero for a tap in the padding and for the
 * columns past R·S·C (kp, a multiple of 8, makes every row 16 bytes
 * aligned). The filter's copy [K, kp] is the same kernel on w read as K
 * images of R x S pixels with one output position each. It copies bits, so
 * one module serves f16 and bf16.
 *
 * conv2d_col2im is the gather after dgrad's GEMM, whose f32 columns
 * dcol[(n, p, q), (r, s, c)] = sum_k dy[n,p,q,k]·w[k,r,s,c]: each dx
 * element adds the columns of the taps that read it, r then s ascending
 * (one thread, a fixed order: deterministic without atomics), then applies
 * dgrad's epilogue, dx = convert(scale_d · (alpha_ab · sum + beta · C)).
 * With a 1 x 1 filter over a [K, R, S, C] "image" it finishes a wgrad
 * summed in f32 over several chunks.
 *
 * Prelude: GEMM_ACC 1 (gemm_common.cuh's f32 epilogue). C and D dtypes are
 * run-time parameters. Indices are 64-bit; the host keeps the extents
 * below 2^31.
 */
#include "gemm_common.cuh"

#define BLOCK 256

/* im2col's launch parameters (src/cuda/conv2d_explicit.c's im2col_kparams).
 * Strides in elements. */
typedef struct im2col_params {
  u64 src, dst;
  i64 s_n, s_h, s_w, s_c; /* the source's [N, H, W, C] strides */
  i64 m0, rows;           /* the rows written: m0 .. m0 + rows - 1 of the whole [NPQ, kp] */
  i64 kp, rsc;            /* the destination's row stride (a multiple of 8) and the columns with taps */
  int h, w, c, p, q, s;   /* the source's extents, the output's, the filter's width (R follows from rsc) */
  int pad_h, pad_w, st_h, st_w, dil_h, dil_w;
} im2col_params;

static_assert(sizeof(im2col_params) == 128, "im2col_params must match im2col_kparams");

/* Each thread writes 8 columns of one row: one 16-byte store. */
extern "C" __global__ void __launch_bounds__(BLOCK) conv2d_im2col(im2col_params P) {
  const i64 vecs = P.kp / 8, total = P.rows * vecs, pq = (i64)P.p * P.q;
  for (i64 e = (i64)blockIdx.x * BLOCK + threadIdx.x; e < total; e += (i64)gridDim.x * BLOCK) {
    const i64 row = e / vecs, m = P.m0 + row;
    const int j0 = (int)(e - row * vecs) * 8; /* kp < 2^31 */
    const i64 n = m / pq, pix = m - n * pq, p = pix / P.q, q = pix - p * P.q;
    const i64 h0 = p * P.st_h - P.pad_h, w0 = q * P.st_w - P.pad_w;
    const smelt_h16 *x = (const smelt_h16 *)P.src + n * P.s_n;
    /* The first column's tap and channel; the loop steps them. */
    const int tap = j0 / P.c;
    int c = j0 - tap * P.c, r = tap / P.s, s = tap - r * P.s;
    u32 packed[4] = {0, 0, 0, 0};
    for (int i = 0; i < 8; i++) {
      const i64 ih = h0 + (i64)r * P.dil_h, iw = w0 + (i64)s * P.dil_w;
      if (j0 + i < P.rsc && ih >= 0 && ih < P.h && iw >= 0 && iw < P.w)
        packed[i / 2] |= (u32)x[ih * P.s_h + iw * P.s_w + c * P.s_c] << (16 * (i % 2));
      if (++c == P.c) {
        c = 0;
        if (++s == P.s) s = 0, r++;
      }
    }
    *(uint4 *)((smelt_h16 *)P.dst + row * P.kp + j0) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

/* col2im's launch parameters (src/cuda/conv2d_explicit.c's col2im_kparams).
 * The columns' element for (image n - n0, output position (p, q), tap
 * (r, s), channel c) is at (n - n0)·col_n + p·col_p + q·col_q + (r·S + s)·C + c. */
typedef struct col2im_params {
  u64 col, c, d;
  i64 col_n, col_p, col_q;
  i64 c_s[4], d_s[4];       /* C's and D's strides, [N, H, W, C] */
  i64 n0, images;           /* the images written: n0 .. n0 + images - 1 of D */
  int h, w, ch, p, q, r, s; /* D's extents, the columns' output extents, the filter's */
  int pad_h, pad_w, st_h, st_w, dil_h, dil_w, pad0;
  double alpha_ab, beta; /* alpha · scale_a · scale_b; beta (C read when has_c) */
  float scale_d;
  int dt_c, dt_d, clamp, has_c, pad1;
} col2im_params;

static_assert(sizeof(col2im_params) == 224, "col2im_params must match col2im_kparams");

/* The output position whose tap f reads coordinate i, or -1. */
static __device__ __forceinline__ i64 untap(i64 i, i64 f, int stride, int pad0, int dil, i64 out) {
  const i64 t = i + pad0 - f * dil;
  return t >= 0 && t % stride == 0 && t / stride < out ? t / stride : -1;
}

extern "C" __global__ void __launch_bounds__(BLOCK) conv2d_col2im(col2im_params P) {
  const i64 total = P.images * P.h * P.w * P.ch;
  for (i64 e = (i64)blockIdx.x * BLOCK + threadIdx.x; e < total; e += (i64)gridDim.x * BLOCK) {
    i64 rest = e;
    const i64 c = rest % P.ch;
    rest /= P.ch;
    const i64 x = rest % P.w;
    rest /= P.w;
    const i64 y = rest % P.h, nl = rest / P.h, n = P.n0 + nl;
    const float *col = (const float *)P.col + nl * P.col_n + c;
    float acc = 0.f;
    for (i64 r = 0; r < P.r; r++) {
      const i64 p = untap(y, r, P.st_h, P.pad_h, P.dil_h, P.p);
      for (i64 s = 0; s < P.s && p >= 0; s++) {
        const i64 q = untap(x, s, P.st_w, P.pad_w, P.dil_w, P.q);
        if (q >= 0) acc += col[p * P.col_p + q * P.col_q + (r * P.s + s) * P.ch];
      }
    }
    float v = (float)P.alpha_ab * acc;
    if (P.has_c)
      v += (float)P.beta *
           gemm_loadf((const void *)P.c, P.dt_c, n * P.c_s[0] + y * P.c_s[1] + x * P.c_s[2] + c * P.c_s[3]);
    gemm_store((void *)P.d, P.dt_d, n * P.d_s[0] + y * P.d_s[1] + x * P.d_s[2] + c * P.d_s[3], v * P.scale_d, P.clamp);
  }
}
