/* The CUDA conv2d's two kernels: the implicit GEMM on the mma.sync GEMM
 * kernel (src/cuda/conv2d_igemm.c, kernels/conv2d_igemm.cuh), taken where
 * its preconditions hold, and the analytic reference kernel
 * (src/cuda/op_conv2d.c) for everything else. */
#ifndef SMELT_CONV2D_CUDA_H
#define SMELT_CONV2D_CUDA_H

#include "../core/conv2d_internal.h"
#include "cuda_internal.h"

/* Plan functions: the reference kernel in func[0]; the implicit GEMM's in
 * func[1] and, for a parallel split, its reduction in func[2]. */
enum { SMELT__CONV_F_DIRECT, SMELT__CONV_F_IGEMM, SMELT__CONV_F_REDUCE };

/* The implicit GEMM's kernel sources (f16 and bf16, each kind, two tiles). */
int smelt__conv2d_igemm_variants(smelt__kernel_src *out, int max);
/* Plans the implicit GEMM when the problem's dtypes, channels, strides and
 * sizes allow it (*taken = 1: plan->backend holds its launch, describe
 * names it); *taken = 0 leaves the plan to the reference kernel. */
smelt_status smelt__conv2d_igemm_plan(smelt_plan *plan, const smelt_tensor *t, int *taken);
/* Runs a plan the implicit GEMM took; *ran = 0 when a pointer of this run
 * is not 16-byte aligned (the caller runs the reference kernel). */
smelt_status smelt__conv2d_igemm_run(smelt_plan *plan, const smelt_tensor *const *t, int *ran);

#endif /* SMELT_CONV2D_CUDA_H */
