/* Conv2d tests. A table of cases (odd sizes, stride 2, dilation 2, padding
 * 0, 1, 3 and uneven, 1x1 and 7x7 filters, C = 3, N = 1, every kind, the
 * epilogues, the dtypes) runs through the library and is compared with an
 * independent formulation written here in f64: one loop over every (output
 * position, tap) pair that scatters each product into the sum it belongs
 * to, so dgrad and wgrad are checked against a scatter where the reference
 * gathers. The adjoint identities <fprop(x, w), dy> = <x, dgrad(dy, w)> =
 * <w, wgrad(dy, x)> tie the three kinds together. Inputs are read through
 * strided views whose gaps hold NaN (a read outside the view shows), and
 * outputs are poisoned and guarded (every element written, nothing else).
 * Bad inputs fail with a status and a message naming the tensor and write
 * nothing. With a GPU, every case of the table runs on CUDA on the CPU
 * run's inputs and is compared with the CPU reference within GEMM's bound
 * for the equivalent GEMM. */
#include "core/error_bound.h"
#include "cuda/conv2d_cuda.h"
#include "harness.h"

/* ---------------------------------------------------------------- a case */

/* Epilogue presets: the fields they set are listed beside each. */
enum {
  EPI_PLAIN,      /* alpha 1 */
  EPI_ALPHA_BETA, /* alpha 0.5, beta -0.75 with C */
  EPI_BIAS_RELU,  /* bias, relu (fprop) */
  EPI_ALL,        /* alpha 1.25, beta 0.5 with C, bias, gelu (fprop) */
  EPI_CLAMP,      /* alpha 3e4, silu, clamp (fprop; an f16 D saturates) */
  EPI_IN_PLACE    /* beta 1, D is C */
};

typedef struct ccase {
  const char *name;
  smelt_conv2d_kind kind;
  int64_t n, h, w, c, k, r, s;
  int pad_h0, pad_h1, pad_w0, pad_w1;
  int stride, dil; /* both axes; 0 means 1 */
  smelt_dtype in, out;
  int tf32;
  int epi;
  int gap;   /* spare elements after every row of every 4-D view (strided, not contiguous) */
  int split; /* split-K slices asked for: > 0 serial, < 0 parallel, 0 smelt's choice */
} ccase;

#define F32 SMELT_DTYPE_F32
#define F16 SMELT_DTYPE_F16
#define BF16 SMELT_DTYPE_BF16
#define FPROP SMELT_CONV2D_FPROP
#define DGRAD SMELT_CONV2D_DGRAD
#define WGRAD SMELT_CONV2D_WGRAD

static const ccase cases[] = {
    {"fprop 3x3 pad 1", FPROP, 2, 9, 11, 5, 7, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop 3x3 pad 0 N=1", FPROP, 1, 7, 6, 4, 3, 3, 3, 0, 0, 0, 0, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop 3x3 stride 2 odd", FPROP, 2, 13, 9, 6, 5, 3, 3, 1, 1, 1, 1, 2, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop 3x3 dilation 2", FPROP, 1, 12, 10, 3, 4, 3, 3, 2, 2, 2, 2, 1, 2, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop 7x7 stride 2 pad 3 C=3", FPROP, 2, 17, 15, 3, 8, 7, 7, 3, 3, 3, 3, 2, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop 1x1", FPROP, 2, 5, 7, 16, 9, 1, 1, 0, 0, 0, 0, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop 1x1 stride 2", FPROP, 1, 8, 7, 6, 5, 1, 1, 0, 0, 0, 0, 2, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop uneven pads 3x2", FPROP, 2, 6, 8, 5, 3, 3, 2, 0, 2, 1, 0, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop pad 3 > filter", FPROP, 1, 4, 5, 2, 3, 2, 3, 3, 3, 3, 3, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop filter as large as input", FPROP, 2, 5, 4, 3, 2, 5, 4, 0, 0, 0, 0, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop stride 3 dilation 2 pad 3", FPROP, 1, 19, 17, 3, 4, 3, 3, 3, 1, 3, 2, 3, 2, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop strided views", FPROP, 2, 7, 9, 5, 6, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 0, EPI_PLAIN, 3, 0},
    {"fprop f16", FPROP, 2, 9, 9, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1, F16, F16, 0, EPI_PLAIN, 0, 0},
    {"fprop bf16 stride 2", FPROP, 2, 10, 9, 4, 6, 3, 3, 1, 1, 1, 1, 2, 1, BF16, BF16, 0, EPI_PLAIN, 0, 0},
    {"fprop bf16 -> f32", FPROP, 1, 8, 8, 7, 5, 3, 3, 1, 1, 1, 1, 1, 1, BF16, F32, 0, EPI_PLAIN, 0, 0},
    {"fprop tf32", FPROP, 2, 9, 8, 12, 6, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 1, EPI_PLAIN, 0, 0},
    {"fprop alpha beta", FPROP, 2, 7, 8, 5, 6, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 0, EPI_ALPHA_BETA, 0, 0},
    {"fprop bias relu", FPROP, 2, 7, 8, 5, 6, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 0, EPI_BIAS_RELU, 0, 0},
    {"fprop bf16 everything", FPROP, 2, 9, 7, 6, 10, 3, 3, 1, 1, 1, 1, 2, 1, BF16, BF16, 0, EPI_ALL, 1, 0},
    {"fprop f16 clamp silu", FPROP, 1, 6, 6, 8, 4, 3, 3, 1, 1, 1, 1, 1, 1, F16, F16, 0, EPI_CLAMP, 0, 0},
    {"fprop in place", FPROP, 2, 6, 7, 4, 5, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 0, EPI_IN_PLACE, 0, 0},
    {"dgrad 3x3 pad 1", DGRAD, 2, 9, 11, 5, 7, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"dgrad 3x3 stride 2 odd", DGRAD, 2, 13, 9, 6, 5, 3, 3, 1, 1, 1, 1, 2, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"dgrad stride 2 even H (rows no tap reads)", DGRAD, 1, 10, 8, 3, 4, 1, 1, 0, 0, 0, 0, 2, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"dgrad dilation 2 pad 0", DGRAD, 1, 12, 10, 3, 4, 3, 3, 0, 0, 0, 0, 1, 2, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"dgrad 7x7 stride 2 pad 3", DGRAD, 1, 15, 13, 3, 6, 7, 7, 3, 3, 3, 3, 2, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"dgrad uneven pads", DGRAD, 2, 6, 8, 5, 3, 3, 2, 0, 2, 1, 0, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"dgrad stride 3 dilation 2", DGRAD, 1, 19, 17, 3, 4, 3, 3, 3, 1, 3, 2, 3, 2, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"dgrad bf16 strided views", DGRAD, 2, 9, 8, 6, 5, 3, 3, 1, 1, 1, 1, 2, 1, BF16, BF16, 0, EPI_PLAIN, 2, 0},
    {"dgrad f16 alpha beta", DGRAD, 2, 7, 7, 4, 6, 3, 3, 1, 1, 1, 1, 1, 1, F16, F16, 0, EPI_ALPHA_BETA, 0, 0},
    {"dgrad tf32 in place", DGRAD, 1, 8, 9, 5, 7, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 1, EPI_IN_PLACE, 0, 0},
    {"wgrad 3x3 pad 1", WGRAD, 2, 9, 11, 5, 7, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"wgrad 3x3 stride 2 odd", WGRAD, 2, 13, 9, 6, 5, 3, 3, 1, 1, 1, 1, 2, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"wgrad dilation 2 pad 0", WGRAD, 1, 12, 10, 3, 4, 3, 3, 0, 0, 0, 0, 1, 2, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"wgrad 7x7 stride 2 pad 3 C=3", WGRAD, 2, 17, 15, 3, 8, 7, 7, 3, 3, 3, 3, 2, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"wgrad 1x1", WGRAD, 2, 5, 7, 16, 9, 1, 1, 0, 0, 0, 0, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"wgrad uneven pads", WGRAD, 2, 6, 8, 5, 3, 3, 2, 0, 2, 1, 0, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"wgrad bf16 -> f32 strided views", WGRAD, 3, 8, 9, 4, 6, 3, 3, 1, 1, 1, 1, 1, 1, BF16, F32, 0, EPI_PLAIN, 1, 0},
    {"wgrad f16 accumulate into C", WGRAD, 2, 7, 7, 4, 6, 3, 3, 1, 1, 1, 1, 2, 1, F16, F32, 0, EPI_IN_PLACE, 0, 0},
    {"wgrad tf32 alpha beta", WGRAD, 2, 8, 8, 6, 5, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 1, EPI_ALPHA_BETA, 0, 0},
    /* Sizes that span many GPU blocks, odd everywhere; long wgrad sums
     * (N·P·Q in the thousands). */
    {"fprop bf16 3x3 s2 odd", FPROP, 3, 29, 31, 19, 33, 3, 3, 1, 1, 1, 1, 2, 1, BF16, BF16, 0, EPI_ALL, 0, 0},
    {"fprop f16 7x7 s2 C=3", FPROP, 2, 45, 43, 3, 16, 7, 7, 3, 3, 3, 3, 2, 1, F16, F16, 0, EPI_BIAS_RELU, 0, 0},
    {"fprop f32 1x1 K=65", FPROP, 2, 13, 11, 40, 65, 1, 1, 0, 0, 0, 0, 1, 1, F32, F32, 0, EPI_ALPHA_BETA, 1, 0},
    {"fprop tf32 dilation 2", FPROP, 2, 21, 19, 12, 10, 3, 3, 2, 2, 2, 2, 1, 2, F32, F32, 1, EPI_PLAIN, 0, 0},
    {"dgrad f32 s2 alpha beta", DGRAD, 2, 30, 29, 17, 24, 3, 3, 1, 1, 1, 1, 2, 1, F32, F32, 0, EPI_ALPHA_BETA, 0, 0},
    {"dgrad bf16 dilation 2", DGRAD, 2, 23, 21, 9, 14, 3, 3, 2, 1, 2, 1, 1, 2, BF16, BF16, 0, EPI_PLAIN, 2, 0},
    {"dgrad f16 7x7 s2 pad 3", DGRAD, 1, 31, 29, 3, 16, 7, 7, 3, 3, 3, 3, 2, 1, F16, F32, 0, EPI_IN_PLACE, 0, 0},
    {"wgrad f32 long sums", WGRAD, 4, 33, 35, 5, 7, 3, 3, 1, 1, 1, 1, 1, 1, F32, F32, 0, EPI_PLAIN, 0, 0},
    {"wgrad tf32 s2", WGRAD, 2, 20, 21, 8, 16, 3, 3, 1, 1, 1, 1, 2, 1, F32, F32, 1, EPI_IN_PLACE, 0, 0},
    {"wgrad bf16 -> f32 7x7", WGRAD, 2, 25, 23, 3, 8, 7, 7, 3, 3, 3, 3, 2, 1, BF16, F32, 0, EPI_ALPHA_BETA, 1, 0},
    /* The implicit GEMM's problems on CUDA (16-bit, channels a multiple of
     * 8, C and D dense): several tiles each way, partial edge tiles, every
     * epilogue, the split-K modes; a strided view (gap) falls back. */
    {"igemm fprop bf16 3x3", FPROP, 2, 17, 19, 24, 40, 3, 3, 1, 1, 1, 1, 1, 1, BF16, BF16, 0, EPI_ALL, 0, 0},
    {"igemm fprop f16 s2 d2 pads", FPROP, 3, 21, 18, 16, 24, 3, 3, 2, 1, 2, 1, 2, 2, F16, F16, 0, EPI_BIAS_RELU, 0, 0},
    {"igemm fprop bf16 1x1 -> f32", FPROP, 2, 15, 13, 64, 136, 1, 1, 0, 0, 0, 0, 1, 1, BF16, F32, 0, EPI_ALPHA_BETA, 0, 0},
    {"igemm fprop bf16 serial x3", FPROP, 1, 14, 15, 32, 16, 3, 3, 1, 1, 1, 1, 1, 1, BF16, BF16, 0, EPI_PLAIN, 0, 3},
    {"igemm fprop f16 strided views", FPROP, 2, 9, 10, 16, 8, 3, 3, 1, 1, 1, 1, 1, 1, F16, F16, 0, EPI_PLAIN, 8, 0},
    {"igemm fprop f16 C=8 (auto: fixed channels)", FPROP, 2, 19, 17, 8, 24, 3, 3, 1, 1, 1, 1, 2, 1, F16, F16, 0, EPI_BIAS_RELU, 0, 0},
    {"igemm dgrad bf16 3x3", DGRAD, 2, 17, 15, 24, 32, 3, 3, 1, 1, 1, 1, 1, 1, BF16, BF16, 0, EPI_PLAIN, 0, 0},
    {"igemm dgrad f16 7x7 s2", DGRAD, 2, 23, 21, 8, 16, 7, 7, 3, 3, 3, 3, 2, 1, F16, F32, 0, EPI_ALPHA_BETA, 0, 0},
    {"igemm dgrad bf16 s2 d2 in place", DGRAD, 1, 25, 22, 16, 8, 3, 3, 2, 2, 2, 2, 2, 2, BF16, BF16, 0, EPI_IN_PLACE, 0, 0},
    {"igemm wgrad bf16 long sums", WGRAD, 4, 29, 31, 16, 24, 3, 3, 1, 1, 1, 1, 1, 1, BF16, F32, 0, EPI_PLAIN, 0, 0},
    {"igemm wgrad f16 s2 into C", WGRAD, 2, 27, 25, 8, 16, 3, 3, 1, 1, 1, 1, 2, 1, F16, F32, 0, EPI_IN_PLACE, 0, 0},
    {"igemm wgrad bf16 parallel x5", WGRAD, 2, 19, 17, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1, BF16, F32, 0, EPI_ALPHA_BETA, 0, -5},
    /* The Hopper implicit GEMM's problems (channels that fill their
     * 64-channel blocks, wgrad's C a multiple of 64): partial tiles and
     * channel blocks, stride and dilation, both tile widths, the fast
     * epilogue (16-bit and f32 D) and the general one (C), its own split
     * and an asked-for parallel one. On other GPUs they take the paths
     * above. */
    {"hopper fprop bf16 3x3 C=64 all", FPROP, 2, 11, 13, 64, 72, 3, 3, 1, 1, 1, 1, 1, 1, BF16, BF16, 0, EPI_ALL, 0, 0},
    {"hopper fprop f16 s2 d2 C=96 K=136", FPROP, 2, 17, 15, 96, 136, 3, 3, 2, 1, 2, 1, 2, 2, F16, F16, 0, EPI_BIAS_RELU, 0, 0},
    {"hopper fprop bf16 1x1 C=128 -> f32", FPROP, 3, 9, 10, 128, 64, 1, 1, 0, 0, 0, 0, 1, 1, BF16, F32, 0, EPI_PLAIN, 0, 0},
    {"hopper fprop bf16 1x1 wide tiles", FPROP, 2, 48, 48, 64, 136, 1, 1, 0, 0, 0, 0, 1, 1, BF16, BF16, 0, EPI_BIAS_RELU, 0, 0},
    {"hopper dgrad f16 1x1 wide tiles", DGRAD, 2, 48, 48, 136, 64, 1, 1, 0, 0, 0, 0, 1, 1, F16, F16, 0, EPI_PLAIN, 0, 0},
    {"hopper dgrad bf16 3x3 K=64", DGRAD, 2, 12, 11, 40, 64, 3, 3, 1, 1, 1, 1, 1, 1, BF16, BF16, 0, EPI_PLAIN, 0, 0},
    {"hopper dgrad f16 s2 K=128 alpha beta", DGRAD, 2, 15, 13, 24, 128, 3, 3, 1, 1, 1, 1, 2, 1, F16, F32, 0, EPI_ALPHA_BETA, 0, 0},
    {"hopper dgrad bf16 d2 K=112 C=136", DGRAD, 1, 14, 17, 136, 112, 3, 3, 2, 2, 2, 2, 1, 2, BF16, BF16, 0, EPI_PLAIN, 0, 0},
    /* Strided dgrads by phases: odd extents (phases of unequal rows),
     * uneven pads, f32 D, nine phases of one tap; a 1x1 stride 2, whose odd
     * phases have no tap, gathers. */
    {"hopper dgrad bf16 s2 phases", DGRAD, 2, 15, 14, 72, 128, 3, 3, 1, 1, 1, 1, 2, 1, BF16, BF16, 0, EPI_PLAIN, 0, 0},
    {"hopper dgrad f16 s2 phases uneven pads -> f32", DGRAD, 2, 13, 12, 64, 64, 3, 3, 2, 1, 0, 2, 2, 1, F16, F32, 0, EPI_PLAIN, 0, 0},
    {"hopper dgrad bf16 s3 d2 phases", DGRAD, 1, 20, 19, 64, 64, 3, 3, 3, 1, 3, 1, 3, 2, BF16, BF16, 0, EPI_PLAIN, 0, 0},
    {"hopper dgrad bf16 1x1 s2 gathers", DGRAD, 2, 10, 9, 64, 64, 1, 1, 0, 0, 0, 0, 2, 1, BF16, BF16, 0, EPI_PLAIN, 0, 0},
    {"hopper wgrad bf16 C=64 own split", WGRAD, 2, 40, 40, 64, 40, 3, 3, 1, 1, 1, 1, 1, 1, BF16, F32, 0, EPI_PLAIN, 0, 0},
    {"hopper wgrad bf16 split tail", WGRAD, 1, 16, 16, 512, 128, 3, 3, 1, 1, 1, 1, 1, 1, BF16, BF16, 0, EPI_PLAIN, 0, 0},
    {"hopper wgrad f16 s2 C=128 into C", WGRAD, 2, 17, 15, 128, 16, 3, 3, 1, 1, 1, 1, 2, 1, F16, F32, 0, EPI_IN_PLACE, 0, 0},
    {"hopper wgrad bf16 parallel x3", WGRAD, 2, 13, 11, 64, 24, 3, 3, 1, 1, 1, 1, 1, 1, BF16, BF16, 0, EPI_ALPHA_BETA, 0, -3},
    /* The explicit im2col path's problems on CUDA (16-bit, channels not a
     * multiple of 8): C = 3 and 5, 7x7 stride 2 pad 3, stride and dilation
     * with uneven pads, every epilogue the kind takes, in place, asked-for
     * splits; workspaces of one chunk and of several (its bound, 4x the
     * larger activation, is small for K = 8 or 16 under a 7x7 filter), with
     * a shorter last chunk and, for wgrad, f32 sums across chunks. */
    {"explicit fprop bf16 7x7 s2 C=3 bias relu", FPROP, 2, 23, 21, 3, 16, 7, 7, 3, 3, 3, 3, 2, 1, BF16, BF16, 0, EPI_BIAS_RELU, 0, 0},
    {"explicit fprop f16 3x3 C=5 alpha beta", FPROP, 2, 13, 11, 5, 24, 3, 3, 1, 1, 1, 1, 1, 1, F16, F16, 0, EPI_ALPHA_BETA, 0, 0},
    {"explicit fprop f16 s2 d2 uneven pads C=6 all", FPROP, 2, 17, 16, 6, 12, 3, 2, 2, 1, 0, 2, 2, 2, F16, F16, 0, EPI_ALL, 0, 0},
    {"explicit fprop bf16 d2 C=3 -> f32 in place", FPROP, 1, 19, 17, 3, 8, 3, 3, 2, 2, 2, 2, 1, 2, BF16, F32, 0, EPI_IN_PLACE, 0, 0},
    {"explicit fprop f16 C=3 clamp silu", FPROP, 2, 9, 10, 3, 8, 3, 3, 1, 1, 1, 1, 1, 1, F16, F16, 0, EPI_CLAMP, 0, 0},
    {"explicit dgrad bf16 7x7 s2 C=3 alpha beta", DGRAD, 3, 23, 21, 3, 16, 7, 7, 3, 3, 3, 3, 2, 1, BF16, BF16, 0, EPI_ALPHA_BETA, 0, 0},
    {"explicit dgrad f16 s2 C=5 -> f32 in place", DGRAD, 2, 14, 13, 5, 64, 3, 3, 1, 1, 1, 1, 2, 1, F16, F32, 0, EPI_IN_PLACE, 0, 0},
    {"explicit dgrad bf16 d2 uneven pads C=3", DGRAD, 2, 15, 14, 3, 8, 3, 3, 2, 1, 2, 1, 1, 2, BF16, BF16, 0, EPI_PLAIN, 0, 0},
    {"explicit wgrad bf16 7x7 s2 C=3 chunks", WGRAD, 2, 23, 21, 3, 16, 7, 7, 3, 3, 3, 3, 2, 1, BF16, F32, 0, EPI_ALPHA_BETA, 0, 0},
    {"explicit wgrad f16 C=5 into C", WGRAD, 2, 15, 13, 5, 32, 3, 3, 1, 1, 1, 1, 1, 1, F16, F16, 0, EPI_IN_PLACE, 0, 0},
    {"explicit wgrad bf16 C=3 serial x3", WGRAD, 2, 16, 16, 3, 64, 3, 3, 1, 1, 1, 1, 1, 1, BF16, BF16, 0, EPI_PLAIN, 0, 3},
    {"explicit wgrad f16 5x5 C=5 parallel x2 chunks", WGRAD, 2, 12, 12, 5, 8, 5, 5, 2, 2, 2, 2, 1, 1, F16, F32, 0, EPI_IN_PLACE, 0, -2},
};
#define NCASES ((int)(sizeof cases / sizeof *cases))

static int64_t out_extent(int64_t in, int pad0, int pad1, int dil, int stride, int64_t f) {
  return (in + pad0 + pad1 - dil * (f - 1) - 1) / stride + 1;
}

static smelt_conv2d_desc case_desc(const ccase *cs) {
  smelt_conv2d_desc d = smelt_conv2d_desc_default();
  d.kind = cs->kind;
  d.pad_h0 = cs->pad_h0, d.pad_h1 = cs->pad_h1, d.pad_w0 = cs->pad_w0, d.pad_w1 = cs->pad_w1;
  d.stride_h = d.stride_w = cs->stride ? cs->stride : 1;
  d.dilation_h = d.dilation_w = cs->dil ? cs->dil : 1;
  d.math = cs->tf32 ? SMELT_GEMM_MATH_TF32 : SMELT_GEMM_MATH_DEFAULT;
  if (cs->split) {
    d.split_k_mode = cs->split > 0 ? SMELT_CONV2D_SPLIT_K_SERIAL : SMELT_CONV2D_SPLIT_K_PARALLEL;
    d.split_k_slices = cs->split > 0 ? cs->split : -cs->split;
  }
  smelt_gemm_epilogue *e = &d.epilogue;
  switch (cs->epi) {
    case EPI_ALPHA_BETA: e->alpha = 0.5, e->beta = -0.75; break;
    case EPI_BIAS_RELU: e->act = SMELT_ACT_RELU; break;
    case EPI_ALL: e->alpha = 1.25, e->beta = 0.5, e->act = SMELT_ACT_GELU; break;
    case EPI_CLAMP: e->alpha = 3e4, e->act = SMELT_ACT_SILU, e->clamp = 1; break;
    case EPI_IN_PLACE: e->beta = 1.0; break;
    default: break;
  }
  return d;
}

/* One 4-D operand: its logical values (row-major, f64), its strided view
 * and its storage on the host (gaps NaN) and on the device. */
typedef struct opnd {
  int64_t dims[4];
  smelt_dtype dt;
  double *v;
  th_view view;
  th_buf buf;
} opnd;

static void opnd_new(opnd *o, smelt_ctx *ctx, smelt_dtype dt, int64_t d0, int64_t d1, int64_t d2, int64_t d3, int gap,
                     int fill) {
  const int64_t dims[4] = {d0, d1, d2, d3};
  int64_t strides[4];
  strides[3] = 1;
  strides[2] = d3 + gap;
  strides[1] = d2 * strides[2] + gap;
  strides[0] = d1 * strides[1] + gap;
  memcpy(o->dims, dims, sizeof dims);
  o->dt = dt;
  o->view = th_view_make(4, dims, strides, 0);
  o->v = (double *)calloc((size_t)o->view.numel, sizeof(double));
  const size_t bytes = (size_t)o->view.storage * smelt_dtype_size(dt);
  o->buf = th_buf_new(ctx, bytes);
  if (!fill) return;
  uint8_t *host = (uint8_t *)malloc(bytes);
  memset(host, 0xFF, bytes); /* NaN in the gaps: a read outside the view poisons a result */
  th_fill_uniform(o->v, SMELT_DTYPE_F64, o->view.numel, -1.0, 1.0);
  for (int64_t i = 0; i < o->view.numel; i++) {
    th_set(host, dt, th_view_off(&o->view, i), o->v[i]);
    o->v[i] = th_get(host, dt, th_view_off(&o->view, i)); /* the value the library sees */
  }
  th_buf_upload(&o->buf, host, bytes);
  free(host);
}

static smelt_tensor opnd_tensor(const opnd *o) { return th_view_tensor(&o->view, &o->buf, o->dt); }

static void opnd_free(opnd *o) {
  free(o->v);
  th_buf_free(&o->buf);
}

/* ---------------------------------------------------------------- the independent formulation */

/* Every (n, p, q, k, r, s, c) whose tap lands inside x, scattered into all
 * three results: y[n,p,q,k] += x·w, dx[n,h,w,c] += dy·w, dw[k,r,s,c] += dy·x
 * (any may be NULL). Arrays are row-major NHWC, KRSC, NPQK. */
typedef struct geom {
  int64_t n, h, w, c, k, r, s, p, q;
  int pad_h0, pad_w0, stride, dil;
} geom;

static geom case_geom(const ccase *cs) {
  geom g = {cs->n, cs->h, cs->w, cs->c, cs->k, cs->r, cs->s, 0, 0, cs->pad_h0, cs->pad_w0,
            cs->stride ? cs->stride : 1, cs->dil ? cs->dil : 1};
  g.p = out_extent(cs->h, cs->pad_h0, cs->pad_h1, g.dil, g.stride, cs->r);
  g.q = out_extent(cs->w, cs->pad_w0, cs->pad_w1, g.dil, g.stride, cs->s);
  return g;
}

static void scatter(const geom *g, const double *x, const double *w, const double *dy, double *y, double *dx,
                    double *dw) {
  for (int64_t n = 0; n < g->n; n++)
    for (int64_t p = 0; p < g->p; p++)
      for (int64_t q = 0; q < g->q; q++)
        for (int64_t r = 0; r < g->r; r++)
          for (int64_t s = 0; s < g->s; s++) {
            const int64_t h = p * g->stride - g->pad_h0 + r * g->dil, ww = q * g->stride - g->pad_w0 + s * g->dil;
            if (h < 0 || h >= g->h || ww < 0 || ww >= g->w) continue;
            for (int64_t k = 0; k < g->k; k++)
              for (int64_t c = 0; c < g->c; c++) {
                const int64_t xi = ((n * g->h + h) * g->w + ww) * g->c + c, wi = ((k * g->r + r) * g->s + s) * g->c + c,
                              yi = ((n * g->p + p) * g->q + q) * g->k + k;
                if (y) y[yi] += x[xi] * w[wi];
                if (dx) dx[xi] += dy[yi] * w[wi];
                if (dw) dw[wi] += dy[yi] * x[xi];
              }
          }
}

/* ---------------------------------------------------------------- running a case */

/* The bound for the library's D on ctx's device against the exact result:
 * GEMM's for the equivalent GEMM (smelt/conv2d.h's table). */
static double case_bound(const ccase *cs, const smelt_conv2d_desc *d, smelt_device_kind dev) {
  const geom g = case_geom(cs);
  smelt_gemm_desc gd = smelt_gemm_desc_default();
  gd.math.op = d->math;
  gd.epilogue = d->epilogue;
  smelt__bound_query q;
  memset(&q, 0, sizeof q);
  q.family = "conv2d";
  q.metric = SMELT__METRIC_REL_L2;
  q.device = dev;
  q.dtype = cs->out;
  q.dt_a = cs->in;
  q.gemm = &gd;
  q.has_c = d->epilogue.beta != 0;
  q.k = cs->kind == FPROP ? g.r * g.s * g.c : cs->kind == DGRAD ? g.r * g.s * g.k : g.n * g.p * g.q;
  return smelt__error_bound(&q);
}

/* A case's operands on one context: x, w, dy (the kind's two inputs
 * filled), D's buffer, C (filled when read) and bias [K] in D's dtype. */
typedef struct case_ops {
  opnd x, w, dy, out, c, bias;
} case_ops;

static void case_ops_new(case_ops *o, const ccase *cs) {
  const geom g = case_geom(cs);
  smelt_ctx *ctx = th_cpu();
  opnd_new(&o->x, ctx, cs->in, g.n, g.h, g.w, g.c, cs->gap, cs->kind != DGRAD);
  opnd_new(&o->w, ctx, cs->in, g.k, g.r, g.s, g.c, cs->gap, cs->kind != WGRAD);
  opnd_new(&o->dy, ctx, cs->in, g.n, g.p, g.q, g.k, cs->gap, cs->kind != FPROP);
  const opnd *outs[3] = {&o->dy, &o->x, &o->w}; /* D's shape by kind: y, dx, dw */
  const int64_t *od = outs[cs->kind]->dims;
  opnd_new(&o->out, ctx, cs->out, od[0], od[1], od[2], od[3], cs->gap, 0);
  opnd_new(&o->c, ctx, cs->out, od[0], od[1], od[2], od[3], cs->gap, case_desc(cs).epilogue.beta != 0);
  opnd_new(&o->bias, ctx, cs->out, 1, 1, 1, g.k, 0, 1);
}

/* src's values and storage in a new operand on ctx. */
static void opnd_clone(opnd *dst, const opnd *src, smelt_ctx *ctx) {
  *dst = *src;
  dst->v = (double *)malloc((size_t)src->view.numel * sizeof(double));
  memcpy(dst->v, src->v, (size_t)src->view.numel * sizeof(double));
  dst->buf = th_buf_new(ctx, src->buf.bytes);
  void *host = malloc(src->buf.bytes);
  th_buf_download(&src->buf, host, src->buf.bytes);
  th_buf_upload(&dst->buf, host, src->buf.bytes);
  free(host);
}

static void case_ops_clone(case_ops *dst, const case_ops *src, smelt_ctx *ctx) {
  opnd_clone(&dst->x, &src->x, ctx);
  opnd_clone(&dst->w, &src->w, ctx);
  opnd_clone(&dst->dy, &src->dy, ctx);
  opnd_clone(&dst->out, &src->out, ctx);
  opnd_clone(&dst->c, &src->c, ctx);
  opnd_clone(&dst->bias, &src->bias, ctx);
}

static void case_ops_free(case_ops *o) {
  opnd_free(&o->x);
  opnd_free(&o->w);
  opnd_free(&o->dy);
  opnd_free(&o->out);
  opnd_free(&o->c);
  opnd_free(&o->bias);
}

/* Runs the case on ctx and reads D back into got (every element written,
 * nothing else; C untouched unless D is C). */
static void case_exec(smelt_ctx *ctx, const ccase *cs, const case_ops *o, double *got) {
  const smelt_conv2d_desc desc = case_desc(cs);
  const int has_c = desc.epilogue.beta != 0, in_place = cs->epi == EPI_IN_PLACE;
  const int has_bias = cs->epi == EPI_BIAS_RELU || cs->epi == EPI_ALL;
  const smelt_tensor ta = opnd_tensor(cs->kind == FPROP ? &o->x : &o->dy),
                     tb = opnd_tensor(cs->kind == WGRAD ? &o->x : &o->w), tc = opnd_tensor(&o->c),
                     td = opnd_tensor(in_place ? &o->c : &o->out);
  smelt_tensor tbias = opnd_tensor(&o->bias);
  tbias.ndim = 1;
  tbias.shape[0] = o->bias.dims[3];
  tbias.strides[0] = 1;
  CHECK_OK(smelt_conv2d(ctx, &desc, &ta, &tb, has_c ? &tc : NULL, &td, has_bias ? &tbias : NULL));
  CHECK_OK(smelt_ctx_synchronize(ctx));
  th_check_output(cs->name, "D", &o->out.view, in_place ? &o->c.buf : &o->out.buf, cs->out, got);
  if (!in_place && has_c) {
    double *cv = (double *)malloc((size_t)o->c.view.numel * sizeof(double));
    th_check_output(cs->name, "C (not written)", &o->c.view, &o->c.buf, cs->out, cv);
    for (int64_t i = 0; i < o->c.view.numel; i++)
      if (cv[i] != o->c.v[i]) {
        th_fail(__FILE__, __LINE__, "%s: C element %lld changed", cs->name, (long long)i);
        break;
      }
    free(cv);
  }
  if (in_place || !has_c) CHECK(th_buf_untouched(in_place ? &o->out.buf : &o->c.buf));
}

/* Runs one case on the CPU and checks D against the formulation above;
 * with a GPU context, runs it there on the same inputs and checks D
 * against the CPU reference's. */
static void run_case(const ccase *cs, smelt_ctx *gpu) {
  const geom g = case_geom(cs);
  const smelt_conv2d_desc desc = case_desc(cs);
  const smelt_gemm_epilogue *e = &desc.epilogue;
  case_ops o;
  case_ops_new(&o, cs);
  /* The exact sums, then the epilogue in f64. */
  const int64_t numel = o.out.view.numel;
  const int has_bias = cs->epi == EPI_BIAS_RELU || cs->epi == EPI_ALL;
  double *ref = (double *)calloc((size_t)numel, sizeof(double)), *got = (double *)malloc((size_t)numel * sizeof(double));
  scatter(&g, o.x.v, o.w.v, o.dy.v, cs->kind == FPROP ? ref : NULL, cs->kind == DGRAD ? ref : NULL,
          cs->kind == WGRAD ? ref : NULL);
  for (int64_t i = 0; i < numel; i++) {
    double v = e->alpha * ref[i] + e->beta * o.c.v[i] + (has_bias ? o.bias.v[i % g.k] : 0);
    v = smelt_act_apply(e->act, v, e->slope);
    if (e->clamp) v = fmin(fmax(v, cs->out == F16 ? -65504.0 : -3.4e38), cs->out == F16 ? 65504.0 : 3.4e38);
    ref[i] = v;
  }
  case_ops dev; /* copied before the CPU runs: in place, it writes C */
  if (gpu) case_ops_clone(&dev, &o, gpu);
  case_exec(th_cpu(), cs, &o, got);
  if (!th_compare(cs->name, got, ref, numel, case_bound(cs, &desc, SMELT_DEVICE_CPU), 0))
    th_fail(__FILE__, __LINE__, "%s: the CPU reference differs from the f64 formulation", cs->name);
  if (gpu) {
    double *got_gpu = (double *)malloc((size_t)numel * sizeof(double));
    case_exec(gpu, cs, &dev, got_gpu);
    if (!th_compare(cs->name, got_gpu, got, numel, case_bound(cs, &desc, SMELT_DEVICE_CUDA), 0))
      th_fail(__FILE__, __LINE__, "%s: CUDA differs from the CPU reference", cs->name);
    free(got_gpu);
    case_ops_free(&dev);
  }
  free(ref);
  free(got);
  case_ops_free(&o);
}

/* Every case of the table on the CPU against the f64 formulation; where a
 * CUDA device runs gpu_cases, that test checks the CPU the same way first
 * (run_case), so this one would only repeat it. */
static void test_cpu_cases(void) {
  if (th_cuda()) SKIP("gpu_cases checks the CPU reference on every case");
  /* Not the few cases sized for the Hopper kernel's tiles and splits (over
   * 2^24 multiply-adds: three quarters of the table's work, a minute under
   * ASan): the CPU reference runs the same loops on the smaller cases of
   * each kind, layout and epilogue. */
  for (int i = 0; i < NCASES; i++) {
    const geom g = case_geom(&cases[i]);
    if (g.n * g.p * g.q * g.k * g.r * g.s * g.c <= ((int64_t)1 << 24)) run_case(&cases[i], NULL);
  }
}

/* ---------------------------------------------------------------- adjoints */

/* <y, dy> = <x, dx> = <w, dw> in f64, y exact from the formulation above,
 * dx and dw from the library (f32, so each product's rounding is bounded
 * by 2^-24 of the sum of magnitudes). */
static void test_adjoint(void) {
  smelt_ctx *ctx = th_cpu();
  for (int i = 0; i < NCASES; i++) {
    const ccase *base = &cases[i];
    if (base->kind != FPROP || base->epi != EPI_PLAIN || base->in != F32 || base->tf32) continue;
    const geom g = case_geom(base);
    opnd x, w, dy, dx, dw;
    opnd_new(&x, ctx, F32, g.n, g.h, g.w, g.c, 0, 1);
    opnd_new(&w, ctx, F32, g.k, g.r, g.s, g.c, 0, 1);
    opnd_new(&dy, ctx, F32, g.n, g.p, g.q, g.k, 0, 1);
    opnd_new(&dx, ctx, F32, g.n, g.h, g.w, g.c, 0, 0);
    opnd_new(&dw, ctx, F32, g.k, g.r, g.s, g.c, 0, 0);
    smelt_conv2d_desc d = case_desc(base);
    const smelt_tensor tx = opnd_tensor(&x), tw = opnd_tensor(&w), tdy = opnd_tensor(&dy), tdx = opnd_tensor(&dx),
                       tdw = opnd_tensor(&dw);
    d.kind = DGRAD;
    CHECK_OK(smelt_conv2d(ctx, &d, &tdy, &tw, NULL, &tdx, NULL));
    d.kind = WGRAD;
    CHECK_OK(smelt_conv2d(ctx, &d, &tdy, &tx, NULL, &tdw, NULL));
    double *y = (double *)calloc((size_t)dy.view.numel, sizeof(double));
    double *gx = (double *)malloc((size_t)x.view.numel * sizeof(double)),
           *gw = (double *)malloc((size_t)w.view.numel * sizeof(double));
    scatter(&g, x.v, w.v, NULL, y, NULL, NULL);
    th_check_output(base->name, "dx", &dx.view, &dx.buf, F32, gx);
    th_check_output(base->name, "dw", &dw.view, &dw.buf, F32, gw);
    double ydy = 0, xdx = 0, wdw = 0, mx = 0, mw = 0;
    for (int64_t j = 0; j < dy.view.numel; j++) ydy += y[j] * dy.v[j];
    for (int64_t j = 0; j < x.view.numel; j++) xdx += x.v[j] * gx[j], mx += fabs(x.v[j] * gx[j]);
    for (int64_t j = 0; j < w.view.numel; j++) wdw += w.v[j] * gw[j], mw += fabs(w.v[j] * gw[j]);
    if (fabs(xdx - ydy) > 1e-6 * (mx + 1) || fabs(wdw - ydy) > 1e-6 * (mw + 1))
      th_fail(__FILE__, __LINE__, "%s: <y,dy>=%.12g <x,dx>=%.12g <w,dw>=%.12g", base->name, ydy, xdx, wdw);
    free(y);
    free(gx);
    free(gw);
    opnd_free(&x);
    opnd_free(&w);
    opnd_free(&dy);
    opnd_free(&dx);
    opnd_free(&dw);
  }
}

/* ---------------------------------------------------------------- kernel choices */

/* Every iterator, stride support and split-K a problem allows gives the
 * same bits on ctx: the backends sum each output whole (smelt/conv2d.h). */
static void choices_same_bits(smelt_ctx *ctx) {
  const geom g = {2, 7, 6, 4, 5, 3, 3, 7, 6, 1, 1, 1, 1};
  opnd x, w, d0, d1;
  opnd_new(&x, ctx, F32, g.n, g.h, g.w, g.c, 0, 1);
  opnd_new(&w, ctx, F32, g.k, g.r, g.s, g.c, 0, 1);
  opnd_new(&d0, ctx, F32, g.n, g.p, g.q, g.k, 0, 0);
  opnd_new(&d1, ctx, F32, g.n, g.p, g.q, g.k, 0, 0);
  smelt_conv2d_desc d = smelt_conv2d_desc_default();
  d.pad_h0 = d.pad_h1 = d.pad_w0 = d.pad_w1 = 1;
  const smelt_tensor tx = opnd_tensor(&x), tw = opnd_tensor(&w), t0 = opnd_tensor(&d0), t1 = opnd_tensor(&d1);
  CHECK_OK(smelt_conv2d(ctx, &d, &tx, &tw, NULL, &t0, NULL));
  const size_t bytes = (size_t)d0.view.numel * sizeof(float);
  float *want = (float *)malloc(bytes), *have = (float *)malloc(bytes);
  th_buf_download(&d0.buf, want, bytes);
  for (int it = 0; it < SMELT_CONV2D_ITER_COUNT; it++)
    for (int ss = 0; ss < SMELT_CONV2D_STRIDE_COUNT; ss++)
      for (int sm = 0; sm < SMELT_CONV2D_SPLIT_K_COUNT; sm++)
        for (int slices = 0; slices <= 64; slices = slices ? slices * 4 : 1) {
          d.iterator = (smelt_conv2d_iterator)it;
          d.stride_support = (smelt_conv2d_stride_support)ss;
          d.split_k_mode = (smelt_conv2d_split_k_mode)sm;
          d.split_k_slices = slices;
          memset(have, 0, bytes);
          th_buf_upload(&d1.buf, have, bytes);
          CHECK_OK(smelt_conv2d(ctx, &d, &tx, &tw, NULL, &t1, NULL));
          th_buf_download(&d1.buf, have, bytes);
          if (memcmp(want, have, bytes))
            th_fail(__FILE__, __LINE__, "iterator %d, stride support %d, split-K %d x %d changed the bits", it, ss, sm,
                    slices);
        }
  free(want);
  free(have);
  opnd_free(&x);
  opnd_free(&w);
  opnd_free(&d0);
  opnd_free(&d1);
}

static void test_choices_same_bits(void) { choices_same_bits(th_cpu()); }

/* What the plan's description says it resolved AUTO to. */
static void test_auto_choices(void) {
  smelt_ctx *ctx = th_cpu();
  const struct {
    smelt_conv2d_kind kind;
    int64_t c, r;
    int stride;
    smelt_dtype dt;
    const char *want;
  } t[] = {
      {FPROP, 4, 3, 1, F32, "fixed_channels, unity"},
      {FPROP, 3, 7, 2, F32, "few_channels, strided"},
      {FPROP, 8, 3, 1, F16, "fixed_channels"},
      {FPROP, 8, 3, 1, F32, "optimized"},
      {FPROP, 16, 33, 1, F32, "analytic"},
      {DGRAD, 16, 3, 2, F32, "analytic, strided"},
      {DGRAD, 16, 3, 1, F32, "optimized, unity"},
      {WGRAD, 3, 3, 2, F32, "optimized, strided"},
  };
  for (size_t i = 0; i < sizeof t / sizeof *t; i++) {
    const int64_t H = 40, P = (H + 2 - (t[i].r - 1) - 1) / t[i].stride + 1;
    const int64_t xs[4] = {1, H, H, t[i].c}, ws[4] = {2, t[i].r, t[i].r, t[i].c}, ys[4] = {1, P, P, 2};
    const int64_t *as = t[i].kind == FPROP ? xs : ys, *bs = t[i].kind == WGRAD ? xs : ws,
                  *ds = t[i].kind == FPROP ? ys : t[i].kind == DGRAD ? xs : ws;
    static float buf[3][2 * 33 * 33 * 16];
    smelt_tensor a = smelt_tensor_make(buf[0], t[i].dt, SMELT_DEVICE_CPU, 0, 4, as),
                 b = smelt_tensor_make(buf[1], t[i].dt, SMELT_DEVICE_CPU, 0, 4, bs),
                 d = smelt_tensor_make(buf[2], t[i].dt, SMELT_DEVICE_CPU, 0, 4, ds);
    smelt_conv2d_desc desc = smelt_conv2d_desc_default();
    desc.kind = t[i].kind;
    desc.pad_h0 = desc.pad_h1 = desc.pad_w0 = desc.pad_w1 = 1;
    desc.stride_h = desc.stride_w = t[i].stride;
    smelt_plan *plan = NULL;
    CHECK_OK(smelt_conv2d_plan(ctx, &desc, &a, &b, NULL, &d, NULL, &plan));
    if (plan && !strstr(smelt_plan_describe(plan), t[i].want))
      th_fail(__FILE__, __LINE__, "case %zu: \"%s\" lacks \"%s\"", i, smelt_plan_describe(plan), t[i].want);
    if (plan && !strstr(smelt_plan_describe(plan), "split-K serial x1"))
      th_fail(__FILE__, __LINE__, "case %zu: \"%s\": the CPU sums without split-K", i, smelt_plan_describe(plan));
    smelt_plan_destroy(plan);
  }
}

static void test_out_size(void) {
  smelt_conv2d_desc d = smelt_conv2d_desc_default();
  CHECK_EQ_INT(smelt_conv2d_out_size(NULL, 0, 7, 3), 5);
  d.pad_h0 = 3, d.pad_h1 = 3, d.stride_h = 2;
  CHECK_EQ_INT(smelt_conv2d_out_size(&d, 0, 224, 7), 112);
  d.pad_w0 = 1, d.pad_w1 = 0, d.dilation_w = 2;
  CHECK_EQ_INT(smelt_conv2d_out_size(&d, 1, 10, 3), 7);
  CHECK_EQ_INT(smelt_conv2d_out_size(NULL, 1, 2, 3), 0);
  CHECK_EQ_INT(smelt_conv2d_out_size(NULL, 2, 7, 3), -1);
  CHECK_EQ_INT(smelt_conv2d_out_size(NULL, 0, 0, 3), -1);
  d.stride_h = 0;
  CHECK_EQ_INT(smelt_conv2d_out_size(&d, 0, 7, 3), -1);
  d = smelt_conv2d_desc_default();
  d.dilation_h = 1 << 30;
  CHECK_EQ_INT(smelt_conv2d_out_size(&d, 0, 7, INT64_MAX), -1); /* the dilated extent overflows */
}

/* ---------------------------------------------------------------- bad inputs */

/* A valid fprop on the CPU: x [2,5,6,3], w [4,3,3,3], y and C [2,5,6,4]
 * (pad 1), bias [4]; each bad call changes one thing. */
typedef struct bad_env {
  opnd x, w, y, c;
  th_buf bias_buf;
  smelt_tensor a, b, tc, d, bias;
  smelt_conv2d_desc desc;
} bad_env;

static void bad_env_new(bad_env *e) {
  smelt_ctx *ctx = th_cpu();
  opnd_new(&e->x, ctx, F32, 2, 5, 6, 3, 0, 1);
  opnd_new(&e->w, ctx, F32, 4, 3, 3, 3, 0, 1);
  opnd_new(&e->y, ctx, F32, 2, 5, 6, 4, 0, 0);
  opnd_new(&e->c, ctx, F32, 2, 5, 6, 4, 0, 1);
  e->bias_buf = th_buf_new(ctx, 4 * sizeof(float));
  const float b[4] = {1, 2, 3, 4};
  th_buf_upload(&e->bias_buf, b, sizeof b);
  e->a = opnd_tensor(&e->x);
  e->b = opnd_tensor(&e->w);
  e->tc = opnd_tensor(&e->c);
  e->d = opnd_tensor(&e->y);
  const int64_t k = 4;
  e->bias = smelt_tensor_make(e->bias_buf.data, F32, SMELT_DEVICE_CPU, 0, 1, &k);
  e->desc = smelt_conv2d_desc_default();
  e->desc.pad_h0 = e->desc.pad_h1 = e->desc.pad_w0 = e->desc.pad_w1 = 1;
}

static void bad_env_free(bad_env *e) {
  opnd_free(&e->x);
  opnd_free(&e->w);
  opnd_free(&e->y);
  opnd_free(&e->c);
  th_buf_free(&e->bias_buf);
}

/* The call fails with `want` and a message containing `msg`, both as a
 * plan and as a one-shot call, and y is untouched. */
static void expect_bad(const char *what, const bad_env *e, const smelt_conv2d_desc *desc, const smelt_tensor *a,
                       const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias,
                       smelt_status want, const char *msg) {
  smelt_plan *plan = (smelt_plan *)&plan;
  smelt_status s = smelt_conv2d_plan(th_cpu(), desc, a, b, c, d, bias, &plan);
  if (s != want || !strstr(smelt_last_error(), msg) || plan)
    th_fail(__FILE__, __LINE__, "%s: plan returned %s \"%s\", want %s with \"%s\"", what, smelt_status_name(s),
            smelt_last_error(), smelt_status_name(want), msg);
  s = smelt_conv2d(th_cpu(), desc, a, b, c, d, bias);
  if (s != want) th_fail(__FILE__, __LINE__, "%s: one-shot returned %s", what, smelt_status_name(s));
  if (!th_buf_untouched(&e->y.buf)) th_fail(__FILE__, __LINE__, "%s: y was written", what);
}

/* An fprop of x [1, H, 6, C] and w [4, R, 3, C] (pad 1) with `iterator`
 * fails as UNSUPPORTED with `msg`, writing nothing. */
static void expect_bad_iterator(const char *what, smelt_conv2d_iterator iterator, int64_t h, int64_t r, int64_t c,
                                const char *msg) {
  bad_env e;
  bad_env_new(&e);
  opnd x, w, y;
  opnd_new(&x, th_cpu(), F32, 1, h, 6, c, 0, 1);
  opnd_new(&w, th_cpu(), F32, 4, r, 3, c, 0, 1);
  opnd_new(&y, th_cpu(), F32, 1, h + 2 - r + 1, 6, 4, 0, 0);
  e.desc.iterator = iterator;
  const smelt_tensor a = opnd_tensor(&x), b = opnd_tensor(&w), d = opnd_tensor(&y);
  expect_bad(what, &e, &e.desc, &a, &b, NULL, &d, NULL, SMELT_STATUS_UNSUPPORTED, msg);
  CHECK(th_buf_untouched(&y.buf));
  opnd_free(&x);
  opnd_free(&w);
  opnd_free(&y);
  bad_env_free(&e);
}

static void test_bad_desc(void) {
  bad_env e;
  bad_env_new(&e);
  const struct {
    const char *what;
    int field, value;
    smelt_status want;
    const char *msg;
  } t[] = {
      {"kind 3", 0, 3, SMELT_STATUS_INVALID_ARGUMENT, "desc.kind=3"},
      {"pad_h0 -1", 1, -1, SMELT_STATUS_INVALID_ARGUMENT, "desc.pad_h0=-1 must be >= 0"},
      {"pad_w1 -2", 2, -2, SMELT_STATUS_INVALID_ARGUMENT, "desc.pad_w1=-2"},
      {"stride_w 0", 3, 0, SMELT_STATUS_INVALID_ARGUMENT, "desc.stride_w=0 must be >= 1"},
      {"dilation_h 0", 4, 0, SMELT_STATUS_INVALID_ARGUMENT, "desc.dilation_h=0"},
      {"math 3xtf32", 5, SMELT_GEMM_MATH_3XTF32, SMELT_STATUS_UNSUPPORTED, "3XTF32"},
      {"math 9", 5, 9, SMELT_STATUS_INVALID_ARGUMENT, "desc.math=9"},
      {"iterator 5", 6, 5, SMELT_STATUS_INVALID_ARGUMENT, "desc.iterator=5"},
      {"stride_support 3", 7, 3, SMELT_STATUS_INVALID_ARGUMENT, "desc.stride_support=3"},
      {"split_k_mode -1", 8, -1, SMELT_STATUS_INVALID_ARGUMENT, "desc.split_k_mode=-1"},
      {"split_k_slices 65", 9, 65, SMELT_STATUS_INVALID_ARGUMENT, "desc.split_k_slices=65"},
      {"act 99", 10, 99, SMELT_STATUS_INVALID_ARGUMENT, "desc.epilogue.act=99"},
      {"alpha nan", 11, 0, SMELT_STATUS_INVALID_ARGUMENT, "desc.epilogue.alpha=nan must be finite"},
      {"scale_d inf", 12, 0, SMELT_STATUS_INVALID_ARGUMENT, "desc.epilogue.scale_d=inf"},
      {"unity with stride 2", 13, 0, SMELT_STATUS_INVALID_ARGUMENT, "stride_support=unity needs stride 1x1"},
      {"fixed_channels C 3", 14, 0, SMELT_STATUS_UNSUPPORTED, "C a power of two (C=3)"},
  };
  for (size_t i = 0; i < sizeof t / sizeof *t; i++) {
    smelt_conv2d_desc d = e.desc;
    switch (t[i].field) {
      case 0: d.kind = (smelt_conv2d_kind)t[i].value; break;
      case 1: d.pad_h0 = t[i].value; break;
      case 2: d.pad_w1 = t[i].value; break;
      case 3: d.stride_w = t[i].value; break;
      case 4: d.dilation_h = t[i].value; break;
      case 5: d.math = (smelt_gemm_math_op)t[i].value; break;
      case 6: d.iterator = (smelt_conv2d_iterator)t[i].value; break;
      case 7: d.stride_support = (smelt_conv2d_stride_support)t[i].value; break;
      case 8: d.split_k_mode = (smelt_conv2d_split_k_mode)t[i].value; break;
      case 9: d.split_k_slices = t[i].value; break;
      case 10: d.epilogue.act = (smelt_act)t[i].value; break;
      case 11: d.epilogue.alpha = NAN; break;
      case 12: d.epilogue.scale_d = INFINITY; break;
      case 13: d.stride_support = SMELT_CONV2D_STRIDE_UNITY, d.stride_h = 2; break;
      case 14: d.iterator = SMELT_CONV2D_ITER_FIXED_CHANNELS; break;
    }
    expect_bad(t[i].what, &e, &d, &e.a, &e.b, NULL, &e.d, NULL, t[i].want, t[i].msg);
  }
  /* Iterators a problem's size rules out: R = 33 (over H = 40, so P = 10
   * with pad 1), C = 5 in f32. */
  expect_bad_iterator("optimized R 33", SMELT_CONV2D_ITER_OPTIMIZED, 40, 33, 3, "optimized needs R, S <= 32");
  expect_bad_iterator("few_channels C 5", SMELT_CONV2D_ITER_FEW_CHANNELS, 5, 3, 5,
                      "few_channels needs fprop with C x 4 bytes <= 16");
  /* Preconditions that depend on the kind. */
  smelt_conv2d_desc d = e.desc;
  d.kind = DGRAD;
  d.epilogue.act = SMELT_ACT_RELU;
  expect_bad("dgrad relu", &e, &d, &e.d, &e.b, NULL, &e.a, NULL, SMELT_STATUS_UNSUPPORTED, "fprop only");
  d.epilogue.act = SMELT_ACT_IDENTITY;
  d.iterator = SMELT_CONV2D_ITER_FEW_CHANNELS;
  expect_bad("dgrad few_channels", &e, &d, &e.d, &e.b, NULL, &e.a, NULL, SMELT_STATUS_UNSUPPORTED,
             "few_channels needs fprop");
  bad_env_free(&e);
}

static void test_bad_tensors(void) {
  bad_env e;
  bad_env_new(&e);
  const smelt_status SHAPE = SMELT_STATUS_SHAPE_MISMATCH;
  smelt_conv2d_desc d = e.desc;
  smelt_tensor t;
  expect_bad("A NULL", &e, &d, NULL, &e.b, NULL, &e.d, NULL, SMELT_STATUS_NULL_POINTER, "A is NULL");
  expect_bad("D NULL", &e, &d, &e.a, &e.b, NULL, NULL, NULL, SMELT_STATUS_NULL_POINTER, "D is NULL");
  t = e.a, t.dtype = SMELT_DTYPE_I8;
  expect_bad("A i8", &e, &d, &t, &e.b, NULL, &e.d, NULL, SMELT_STATUS_DTYPE_MISMATCH, "A.dtype=i8 is not supported");
  t = e.b, t.dtype = F16;
  expect_bad("B f16", &e, &d, &e.a, &t, NULL, &e.d, NULL, SMELT_STATUS_DTYPE_MISMATCH, "B.dtype=f16 must equal");
  d.math = SMELT_GEMM_MATH_TF32;
  t = e.b, t.dtype = F16;
  smelt_tensor t2 = e.a;
  t2.dtype = F16;
  expect_bad("tf32 f16", &e, &d, &t2, &t, NULL, &e.d, NULL, SMELT_STATUS_DTYPE_MISMATCH, "TF32 needs f32 A and B");
  d = e.desc;
  t = e.a, t.ndim = 3;
  expect_bad("A 3-D", &e, &d, &t, &e.b, NULL, &e.d, NULL, SHAPE, "A (x).shape=[2, 5, 6] must be 4-D [N, H, W, C]");
  t = e.b, t.shape[3] = 2;
  expect_bad("B channels", &e, &d, &e.a, &t, NULL, &e.d, NULL, SHAPE, "B (w).shape=[4, 3, 3, 2] must be [K, R, S, C]");
  t = e.d, t.shape[1] = 4;
  expect_bad("D rows", &e, &d, &e.a, &e.b, NULL, &t, NULL, SHAPE, "D (y).shape=[2, 4, 6, 4] must be [N, P, Q, K]");
  t = e.a, t.shape[0] = 0;
  expect_bad("N 0", &e, &d, &t, &e.b, NULL, &e.d, NULL, SHAPE, "every dim of [N, H, W, C] must be >= 1");
  d.pad_h0 = d.pad_h1 = 0;
  d.dilation_h = 3;
  expect_bad("filter too large", &e, &d, &e.a, &e.b, NULL, &e.d, NULL, SHAPE, "larger than the padded input");
  d = e.desc;
  d.epilogue.beta = 1;
  expect_bad("C NULL", &e, &d, &e.a, &e.b, NULL, &e.d, NULL, SMELT_STATUS_NULL_POINTER, "C is NULL but");
  t = e.tc, t.shape[3] = 3;
  expect_bad("C shape", &e, &d, &e.a, &e.b, &t, &e.d, NULL, SHAPE, "C.shape=[2, 5, 6, 3] must equal D (y).shape");
  t = e.tc, t.dtype = BF16;
  expect_bad("C dtype", &e, &d, &e.a, &e.b, &t, &e.d, NULL, SMELT_STATUS_DTYPE_MISMATCH, "C.dtype=bf16 must equal");
  d = e.desc;
  t = e.bias, t.shape[0] = 3;
  expect_bad("bias shape", &e, &d, &e.a, &e.b, NULL, &e.d, &t, SHAPE, "bias.shape=[3] must be [K]=[4]");
  d.kind = WGRAD; /* dy [2,5,6,4], x [2,5,6,3] -> dw [4,3,3,3] */
  expect_bad("wgrad bias", &e, &d, &e.d, &e.a, NULL, &e.b, &e.bias, SMELT_STATUS_INVALID_ARGUMENT,
             "wgrad: bias is given");
  t = e.d, t.shape[2] = 5;
  expect_bad("wgrad dy", &e, &d, &t, &e.a, NULL, &e.b, NULL, SHAPE, "A (dy).shape=[2, 5, 5, 4] must be [N, P, Q, K]");
  d.kind = DGRAD;
  t = e.a, t.shape[3] = 2;
  expect_bad("dgrad dx", &e, &d, &e.d, &e.b, NULL, &t, NULL, SHAPE, "D (dx).shape=[2, 5, 6, 2] must be [N, H, W, C]");
  d = e.desc;
  /* D over x's memory, and D's elements sharing memory. */
  t = e.d, t.data = e.x.buf.data, t.shape[0] = 1;
  smelt_tensor x1 = e.a;
  x1.shape[0] = 1;
  expect_bad("D overlaps A", &e, &d, &x1, &e.b, NULL, &t, NULL, SMELT_STATUS_INVALID_ARGUMENT, "D overlaps A");
  t = e.d, t.strides[0] = 0;
  expect_bad("D stride 0", &e, &d, &e.a, &e.b, NULL, &t, NULL, SMELT_STATUS_BAD_LAYOUT, "must be distinct");
  /* H + padding past INT64_MAX: x [1, 2^63 - 2, 1, 1] of stride 0 (a
   * valid broadcast input) and w [4, 3, 3, 1]. */
  t = e.a, t.shape[0] = t.shape[2] = t.shape[3] = 1, t.shape[1] = INT64_MAX - 1, t.strides[0] = t.strides[1] = 0;
  t2 = e.b, t2.shape[3] = 1;
  expect_bad("H + padding overflows", &e, &d, &t, &t2, NULL, &e.d, NULL, SMELT_STATUS_OVERFLOW,
             "the padded input (A (x): H=9223372036854775806, W=1, pads 1+1, 1+1) or the dilated filter");
  /* Nothing on the context's device. */
  t = e.a, t.device = SMELT_DEVICE_CUDA;
  expect_bad("A on cuda", &e, &d, &t, &e.b, NULL, &e.d, NULL, SMELT_STATUS_WRONG_DEVICE, "A is on cuda:0");
  bad_env_free(&e);
}

/* A plan runs tensors of its shapes at other addresses, refuses others
 * and other families' plans, and writes nothing when it refuses. */
static void test_plan_run(void) {
  bad_env e, f;
  bad_env_new(&e);
  bad_env_new(&f);
  e.desc.epilogue.beta = 0.5;
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_conv2d_plan(th_cpu(), &e.desc, &e.a, &e.b, &e.tc, &e.d, &e.bias, &plan));
  REQUIRE(plan);
  CHECK(strstr(smelt_plan_describe(plan), "conv2d fprop f32->f32 3x3 s1x1 d1x1") != NULL);
  CHECK_OK(smelt_conv2d_run(plan, &f.a, &f.b, &f.tc, &f.d, &f.bias));
  th_check_output("plan_run", "y", &f.y.view, &f.y.buf, F32, NULL);
  smelt_tensor t = e.d;
  t.strides[0] += 1;
  CHECK_STATUS(smelt_conv2d_run(plan, &e.a, &e.b, &e.tc, &t, &e.bias), SMELT_STATUS_BAD_LAYOUT);
  CHECK_STATUS(smelt_conv2d_run(plan, &e.a, &e.b, NULL, &e.d, &e.bias), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("C is NULL but the plan was made with one");
  CHECK_STATUS(smelt_conv2d_run(plan, &e.a, &e.b, &e.tc, &e.d, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("bias is NULL");
  CHECK(th_buf_untouched(&e.y.buf));
  smelt_plan *other = NULL;
  const int64_t n = 4;
  smelt_tensor v = smelt_tensor_make(e.bias_buf.data, F32, SMELT_DEVICE_CPU, 0, 1, &n);
  smelt_activation_desc ad = {SMELT_ACT_RELU, 0.01f};
  smelt_tensor y1 = smelt_tensor_make(e.c.buf.data, F32, SMELT_DEVICE_CPU, 0, 1, &n);
  CHECK_OK(smelt_activation_plan(th_cpu(), &ad, &v, &y1, &other));
  CHECK_STATUS(smelt_conv2d_run(other, &e.a, &e.b, &e.tc, &e.d, &e.bias), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("the plan is not a conv2d plan");
  CHECK_STATUS(smelt_conv2d_run(NULL, &e.a, &e.b, &e.tc, &e.d, &e.bias), SMELT_STATUS_NULL_POINTER);
  CHECK(th_buf_untouched(&e.y.buf));
  smelt_plan_destroy(other);
  smelt_plan_destroy(plan);
  bad_env_free(&e);
  bad_env_free(&f);
}

/* ---------------------------------------------------------------- CUDA */

/* Every case of the table: the CPU against the f64 formulation, then the GPU
 * against the CPU, on the same
 * inputs. */
static void test_gpu_cases(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  for (int i = 0; i < NCASES; i++) run_case(&cases[i], cu);
}

/* The case named `name` of the table. */
static const ccase *case_named(const char *name) {
  for (int i = 0; i < NCASES; i++)
    if (!strcmp(cases[i].name, name)) return &cases[i];
  th_fail(__FILE__, __LINE__, "no case %s", name);
  return &cases[0];
}

/* cs planned on cu describes itself with `want` in it. */
static void check_describe(smelt_ctx *cu, const ccase *cs, const char *want) {
  case_ops o, dev;
  case_ops_new(&o, cs);
  case_ops_clone(&dev, &o, cu);
  const smelt_conv2d_desc d = case_desc(cs);
  const smelt_tensor ta = opnd_tensor(cs->kind == FPROP ? &dev.x : &dev.dy),
                     tb = opnd_tensor(cs->kind == WGRAD ? &dev.x : &dev.w), tc = opnd_tensor(&dev.c),
                     td = opnd_tensor(&dev.out);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_conv2d_plan(cu, &d, &ta, &tb, d.epilogue.beta != 0 ? &tc : NULL, &td, NULL, &plan));
  if (plan && !strstr(smelt_plan_describe(plan), want))
    th_fail(__FILE__, __LINE__, "%s: describe \"%s\" lacks \"%s\"", cs->name, smelt_plan_describe(plan), want);
  smelt_plan_destroy(plan);
  case_ops_free(&dev);
  case_ops_free(&o);
}

/* The ping-pong schedule of the Hopper implicit GEMM (fprop, dgrad, the
 * strided dgrad's phases; 128 x 128 and 128 x 64), taken unasked only by
 * problems of at least an SM's worth of tiles, asked for here through the
 * debug override on cases of ragged tiles, short and long K walks, phases
 * of unequal rows and f32 dx. */
static void test_gpu_pingpong(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  static const char *const names[] = {"hopper fprop bf16 1x1 wide tiles", "hopper fprop f16 s2 d2 C=96 K=136",
                                      "hopper dgrad f16 1x1 wide tiles", "hopper dgrad bf16 d2 K=112 C=136",
                                      "hopper dgrad bf16 s2 phases", "hopper dgrad bf16 s3 d2 phases"};
  static const char *const names64[] = {"hopper fprop bf16 1x1 C=128 -> f32", "hopper dgrad bf16 3x3 K=64",
                                        "hopper dgrad f16 s2 phases uneven pads -> f32"};
  const size_t n128 = sizeof names / sizeof *names, n = n128 + sizeof names64 / sizeof *names64;
  for (size_t i = 0; i < n && !th_failed_now; i++) {
    const ccase *cs = case_named(i < n128 ? names[i] : names64[i - n128]);
    setenv("SMELT_CONV2D_TILE", i < n128 ? "128x128pp" : "128x64pp", 1);
    check_describe(cu, cs, i < n128 ? "128x128x64_s6_pp_conv_" : "128x64x64_s8_pp_conv_");
    run_case(cs, cu);
  }
  unsetenv("SMELT_CONV2D_TILE");
}

/* The reference kernel too ignores the description's kernel choices. */
static void test_gpu_choices_same_bits(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  choices_same_bits(th_cuda());
}

/* The plan says which kernel serves it, and that the description's
 * choices are kept (not specialized) by the reference path. */
static void test_gpu_plan(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  const ccase *cs = &cases[2];
  case_ops o, dev;
  case_ops_new(&o, cs);
  case_ops_clone(&dev, &o, cu);
  smelt_conv2d_desc d = case_desc(cs);
  d.split_k_mode = SMELT_CONV2D_SPLIT_K_PARALLEL;
  d.split_k_slices = 4;
  const smelt_tensor tx = opnd_tensor(&dev.x), tw = opnd_tensor(&dev.w), ty = opnd_tensor(&dev.dy);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_conv2d_plan(cu, &d, &tx, &tw, NULL, &ty, NULL, &plan));
  REQUIRE(plan);
  const char *why = smelt_plan_describe(plan);
  if (!strstr(why, "conv2d_direct_fprop_f32 (analytic reference): conv2d fprop f32->f32 3x3 s2x2") ||
      !strstr(why, "split-K parallel x4"))
    th_fail(__FILE__, __LINE__, "describe: \"%s\"", why);
  CHECK(th_buf_untouched(&dev.dy.buf));
  CHECK_OK(smelt_conv2d_run(plan, &tx, &tw, NULL, &ty, NULL));
  CHECK_OK(smelt_ctx_synchronize(cu));
  th_check_output("gpu_plan", "y", &dev.dy.view, &dev.dy.buf, F32, NULL);
  smelt_plan_destroy(plan);
  case_ops_free(&dev);
  case_ops_free(&o);
}

/* Which kernel the implicit GEMM's problems plan to: the right layout per
 * kind, smelt's own split for wgrad's long sums, the asked-for split kept,
 * any iterator (AUTO's fixed channels for C = 8), the reference kernel for
 * a strided view it cannot fold; the explicit path's problems to it, with
 * their chunks. */
static void test_gpu_igemm_plan(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  static const struct {
    const char *name, *want;
  } rows[] = {
      {"igemm fprop bf16 3x3", "implicit GEMM gemm_sm80_bf16_RC_64x64x32_s4_w2x2_conv_fprop, no split x1"},
      {"igemm dgrad bf16 3x3", "implicit GEMM gemm_sm80_bf16_RR_64x64x32_s4_w2x2_conv_dgrad"},
      {"igemm wgrad bf16 long sums", "implicit GEMM gemm_sm80_bf16_CR_64x64x32_s4_w2x2_conv_wgrad, serial x"},
      {"igemm fprop bf16 serial x3", ", serial x3"},
      {"igemm wgrad bf16 parallel x5", ", parallel x"},
      {"igemm fprop f16 strided views", "conv2d_direct_fprop_f16 (analytic reference)"},
      {"igemm fprop f16 C=8 (auto: fixed channels)", "implicit GEMM gemm_sm80_f16_RC_64x64x32_s4_w2x2_conv_fprop"},
      {"explicit fprop bf16 7x7 s2 C=3 bias relu", "explicit im2col+GEMM gemm_"},
      {"explicit fprop bf16 7x7 s2 C=3 bias relu", ", chunks 3: conv2d fprop bf16->bf16 7x7 s2x2"},
      {"explicit fprop f16 3x3 C=5 alpha beta", ", chunks 1: conv2d fprop f16->f16 3x3"},
      {"explicit dgrad bf16 7x7 s2 C=3 alpha beta", "explicit GEMM+col2im gemm_"},
      {"explicit dgrad bf16 7x7 s2 C=3 alpha beta", ", chunks 3: conv2d dgrad"},
      {"explicit dgrad f16 s2 C=5 -> f32 in place", ", chunks 1: conv2d dgrad"},
      {"explicit wgrad bf16 7x7 s2 C=3 chunks", "explicit im2col+GEMM gemm_"},
      {"explicit wgrad bf16 7x7 s2 C=3 chunks", ", chunks 4: conv2d wgrad"},
      {"explicit wgrad f16 5x5 C=5 parallel x2 chunks", ", chunks 6: conv2d wgrad"},
      {"explicit wgrad f16 C=5 into C", ", chunks 1: conv2d wgrad"},
  };
  /* On Hopper: the kernels the Hopper implicit GEMM's cases take. */
  static const struct {
    const char *name, *want;
  } hopper_rows[] = {
      {"hopper fprop bf16 3x3 C=64 all", "implicit GEMM gemm_sm90_bf16_RC_128x64x64_s8_conv_fprop, no split x1"},
      {"hopper fprop bf16 1x1 wide tiles", "implicit GEMM gemm_sm90_bf16_RC_128x128x64_s6_conv_fprop, no split x1"},
      {"hopper dgrad f16 1x1 wide tiles", "implicit GEMM gemm_sm90_f16_RR_128x128x64_s6_conv_dgrad, no split"},
      {"hopper dgrad f16 s2 K=128 alpha beta", "implicit GEMM gemm_sm90_f16_RR_128x128x64_s6_conv_dgrad_gather"},
      {"hopper dgrad bf16 3x3 K=64", "implicit GEMM gemm_sm90_bf16_RR_128x64x64_s8_conv_dgrad"},
      {"hopper dgrad bf16 s2 phases", "implicit GEMM gemm_sm90_bf16_RR_128x64x64_s8_conv_dgrad_phases, 2x2 phases, no split x1"},
      {"hopper dgrad f16 s2 phases uneven pads -> f32", "gemm_sm90_f16_RR_128x64x64_s8_conv_dgrad_phases, 2x2 phases"},
      {"hopper dgrad bf16 s3 d2 phases", "gemm_sm90_bf16_RR_128x64x64_s8_conv_dgrad_phases, 3x3 phases"},
      {"hopper dgrad bf16 1x1 s2 gathers", "gemm_sm90_bf16_RR_128x128x64_s6_conv_dgrad_gather"},
      {"hopper wgrad bf16 C=64 own split", "implicit GEMM gemm_sm90_bf16_CR_64x128x64_s8_conv_wgrad, parallel x"},
      {"hopper wgrad bf16 parallel x3", "implicit GEMM gemm_sm90_bf16_CR_64x128x64_s8_conv_wgrad, parallel x3"},
      {"hopper wgrad bf16 split tail", "implicit GEMM gemm_sm90_bf16_CR_128x128x64_s6_conv_wgrad, no split"},
      {"hopper wgrad f16 s2 C=128 into C", "implicit GEMM gemm_sm90_f16_CR_64x128x64_s8_conv_wgrad"},
  };
  const size_t nrows = sizeof rows / sizeof *rows, nall = nrows + (th_cuda_sm90() ? sizeof hopper_rows / sizeof *hopper_rows : 0);
  for (size_t i = 0; i < nall; i++) {
    const char *name = i < nrows ? rows[i].name : hopper_rows[i - nrows].name,
               *want = i < nrows ? rows[i].want : hopper_rows[i - nrows].want;
    check_describe(cu, case_named(name), want);
  }
}

/* The strided dgrad's phases (smelt__conv9_phase_axis), which the Hopper
 * kernel walks, against the taps found by division: over strides 1-4,
 * dilations 1-3, 1-7 taps, pads 0-4 and extents 1-30, every dx position of
 * a phase reads exactly the taps whose dy position divides, at the dy
 * position the axis gives; a phase is refused only when it has positions
 * and no tap. */
static void test_phase_axes(void) {
  int checked = 0;
  for (int64_t st = 1; st <= 4; st++)
    for (int64_t dil = 1; dil <= 3; dil++)
      for (int64_t taps = 1; taps <= 7; taps++)
        for (int64_t pad = 0; pad <= 4; pad++)
          for (int64_t ext = 1; ext <= 30; ext += 3)
            for (int64_t ph = 0; ph < st; ph++) {
              smelt__conv9_axis a;
              const int ok = smelt__conv9_phase_axis(ph, st, pad, dil, taps, ext, &a);
              int64_t want_taps = 0; /* the same for every position of the phase */
              for (int64_t r = 0; r < taps; r++) want_taps += ((ph + pad - r * dil) % st + st) % st == 0;
              const int64_t rows = ext > ph ? (ext - ph + st - 1) / st : 0;
              if (!ok) {
                if (!(rows > 0 && want_taps == 0))
                  th_fail(__FILE__, __LINE__, "st %lld dil %lld taps %lld pad %lld ext %lld ph %lld refused",
                          (long long)st, (long long)dil, (long long)taps, (long long)pad, (long long)ext, (long long)ph);
                continue;
              }
              CHECK_EQ_INT(a.n, rows);
              if (!rows) continue;
              CHECK_EQ_INT(a.t, want_taps);
              for (int64_t i = 0; i < rows; i++)
                for (int k = 0; k < a.t; k++) {
                  const int64_t r = a.f0 + (int64_t)k * a.step, h = i * st + ph, num = h + pad - r * dil;
                  const int64_t dy = i + a.first + (int64_t)(a.t - 1 - k) * a.off;
                  if (r >= taps || num % st != 0 || num / st != dy) {
                    th_fail(__FILE__, __LINE__, "st %lld dil %lld taps %lld pad %lld ph %lld: tap %d of row %lld",
                            (long long)st, (long long)dil, (long long)taps, (long long)pad, (long long)ph, k,
                            (long long)i);
                    return;
                  }
                  checked++;
                }
            }
  CHECK(checked > 10000);
}

const th_test th_tests_conv2d[] = {
    {"cpu_cases", test_cpu_cases},
    {"adjoint", test_adjoint},
    {"choices_same_bits", test_choices_same_bits},
    {"auto_choices", test_auto_choices},
    {"out_size", test_out_size},
    {"phase_axes", test_phase_axes},
    {"bad_desc", test_bad_desc},
    {"bad_tensors", test_bad_tensors},
    {"plan_run", test_plan_run},
    {"gpu_cases", test_gpu_cases},
    {"gpu_pingpong", test_gpu_pingpong},
    {"gpu_plan", test_gpu_plan},
    {"gpu_igemm_plan", test_gpu_igemm_plan},
    {"gpu_choices_same_bits", test_gpu_choices_same_bits},
    {0, 0},
};
