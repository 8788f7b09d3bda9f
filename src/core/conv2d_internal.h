/* Conv2d internals shared by the core (validation, plan/run), the CPU
 * reference and the CUDA backend: the tensor roles, the plan's resolved
 * description and the problem's sizes. */
#ifndef SMELT_CONV2D_INTERNAL_H
#define SMELT_CONV2D_INTERNAL_H

#include "internal.h"

/* The roles of smelt_conv2d's tensors (smelt/conv2d.h: CUTLASS's A, B, C,
 * D of the implicit GEMM); a run's arguments are this array of views. */
enum { SMELT__CONV2D_A, SMELT__CONV2D_B, SMELT__CONV2D_C, SMELT__CONV2D_D, SMELT__CONV2D_BIAS, SMELT__CONV2D_ROLES };

/* The plan's resolved description (plan->opdata). */
typedef struct smelt__conv2d_state {
  smelt_conv2d_desc desc;      /* as given, but iterator, stride support and split-K resolved (never
                                  AUTO; slices 0 becomes 1) */
  int64_t n, h, w, c, k, r, s; /* the problem */
  int64_t p, q;                /* the output's extents (smelt/conv2d.h) */
  int has_c, has_bias;         /* C is read (beta != 0); a bias is added (fprop) */
  int auto_split;              /* the caller left split-K to smelt (slices 0, mode AUTO) */
} smelt__conv2d_state;

/* Offset in elements of element (i0, i1, i2, i3) of a 4-D view. */
static inline int64_t smelt__conv2d_off(const smelt_tensor *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return i0 * t->strides[0] + i1 * t->strides[1] + i2 * t->strides[2] + i3 * t->strides[3];
}

#endif /* SMELT_CONV2D_INTERNAL_H */
