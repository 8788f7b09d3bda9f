/* The CUDA conv2d's four paths, each taken where its preconditions hold,
 * in this order: the implicit GEMM on the Hopper GEMM kernel
 * (src/cuda/conv2d_sm90.c, kernels/conv2d_sm90.cuh), the implicit GEMM on
 * the mma.sync GEMM kernel (src/cuda/conv2d_igemm.c,
 * kernels/conv2d_igemm.cuh), the explicit im2col workspace and a smelt GEMM
 * for the other 16-bit problems (src/cuda/conv2d_explicit.c,
 * kernels/conv2d_im2col.cu), and the analytic reference kernel
 * (src/cuda/op_conv2d.c) for everything else. */
#ifndef SMELT_CONV2D_CUDA_H
#define SMELT_CONV2D_CUDA_H

#include "../core/conv2d_internal.h"
#include "cuda_internal.h"
#include "gemm_cuda.h"

/* Plan functions: the reference kernel in func[0]; the mma.sync implicit
 * GEMM's in func[1] or the Hopper one's in func[3] and, for a parallel
 * split, the reduction in func[2]; or the explicit path's im2col in func[4]. */
enum { SMELT__CONV_F_DIRECT, SMELT__CONV_F_IGEMM, SMELT__CONV_F_REDUCE, SMELT__CONV_F_SM90, SMELT__CONV_F_IM2COL };

/* Facts about the views that both implicit GEMMs ask: x's channels (axis
 * 3) unit-strided and a multiple of 8, its other strides 16-byte multiples
 * (16-bit elements); the stride of dims i0..i1 of t folded into one, or -1
 * if they do not fold (size-1 dims fold whatever their stride); t as the
 * GEMM's [rows, cols] matrix (NPQ or NHW rows of channels, or wgrad's dw as
 * K rows of RSC), 0 if it does not fold. */
int smelt__conv2d_gatherable(const smelt_tensor *x);
int64_t smelt__conv2d_fold(const smelt_tensor *t, int i0, int i1);
int smelt__conv2d_as_matrix(const smelt_tensor *t, int wgrad, int64_t *rs, int64_t *cs);

/* The GEMM launch parameters both implicit GEMMs share: D, C and the bias
 * as the GEMM's [M, N] views and vector, and the epilogue's values. */
void smelt__conv2d_epilogue_kparams(const smelt__conv2d_state *st, const smelt_tensor *const *t,
                                    smelt__gemm_kparams *kp);

/* The implicit GEMMs' plan bookkeeping: the parallel split's reduction
 * into func[SMELT__CONV_F_REDUCE]; the plan's launch record (freed with
 * free) and its description, "implicit GEMM <kernel>, <split> x<slices>:"
 * before the core's. */
smelt_status smelt__conv2d_load_reduce(smelt_plan *plan);
void smelt__conv2d_take(smelt_plan *plan, void *backend, const char *kernel, const char *split, int splits);

/* A dgrad's phase along one axis (kernels/conv2d_sm90.cuh): dx's positions
 * ph, ph + st, ... below its extent (n of them) read the filter's taps r
 * whose ph + pad - r dil divides by st: t of them, every step-th from f0,
 * at im2col offsets off apart, the walk's last tap at dy position first
 * for the phase's position 0 (dy position i + (ph + pad - r dil) / st for
 * the phase's position i and tap r). A unit stride is one phase of every
 * tap. */
typedef struct smelt__conv9_axis {
  int n, t, f0, step, off, first;
} smelt__conv9_axis;
/* Phase ph of stride st along an axis of `taps` filter taps and dx extent
 * ext into *a; 0 when the phase has positions but no tap. */
int smelt__conv9_phase_axis(int64_t ph, int64_t st, int64_t pad, int64_t dil, int64_t taps, int64_t ext,
                            smelt__conv9_axis *a);

/* The Hopper implicit GEMM's kernel sources (f16 and bf16, its variants). */
int smelt__conv2d_sm90_variants(smelt__kernel_src *out, int max);
/* Plans the Hopper implicit GEMM when the device, dtypes, channels, strides
 * and sizes allow it (*taken = 1: plan->backend holds its launch,
 * func[SMELT__CONV_F_SM90] its kernel, describe names it). */
smelt_status smelt__conv2d_sm90_plan(smelt_plan *plan, const smelt_tensor *t, int *taken);
/* Runs a plan the Hopper implicit GEMM took; *ran = 0 when x or w of this
 * run is not 16-byte aligned (the caller runs the reference kernel). */
smelt_status smelt__conv2d_sm90_run(smelt_plan *plan, const smelt_tensor *const *t, int *ran);

/* The implicit GEMM's kernel sources (f16 and bf16, each kind, two tiles). */
int smelt__conv2d_igemm_variants(smelt__kernel_src *out, int max);
/* Plans the implicit GEMM when the problem's dtypes, channels, strides and
 * sizes allow it (*taken = 1: plan->backend holds its launch, describe
 * names it); *taken = 0 leaves the plan to the reference kernel. */
smelt_status smelt__conv2d_igemm_plan(smelt_plan *plan, const smelt_tensor *t, int *taken);
/* Runs a plan the implicit GEMM took; *ran = 0 when a pointer of this run
 * is not 16-byte aligned (the caller runs the reference kernel). */
smelt_status smelt__conv2d_igemm_run(smelt_plan *plan, const smelt_tensor *const *t, int *ran);

/* The explicit path's kernel source (one module for f16 and bf16). */
int smelt__conv2d_explicit_variants(smelt__kernel_src *out, int max);
/* Plans the explicit path for an f16 or bf16 problem whose views it can
 * read (*taken = 1: plan->backend holds its chunks and inner GEMM plans,
 * func[SMELT__CONV_F_IM2COL] its im2col kernel, describe names the GEMM's
 * kernel); t are the plan's tensors, data included (the GEMMs are planned
 * on them). */
smelt_status smelt__conv2d_explicit_plan(smelt_plan *plan, const smelt_tensor *const *t, int *taken);
/* Runs a plan the explicit path took. */
smelt_status smelt__conv2d_explicit_run(smelt_plan *plan, const smelt_tensor *const *t);

#endif /* SMELT_CONV2D_CUDA_H */
