/* What the quantizer families share between the core, the CPU reference and
 * the CUDA backend: a format's block geometry and the reading of its scale
 * tensors' strides. */
#ifndef SMELT_QUANT_INTERNAL_H
#define SMELT_QUANT_INTERNAL_H

#include "internal.h"

/* A format's blocks over a [rows, cols] matrix: br x bk elements share one
 * scale (the last block of a row or column may be short); the scale grid
 * is [sr, sc]; q has qcols columns of dtype elem (SMELT_DTYPE_COUNT: e4m3
 * or e5m2, the caller's pick); the scale's dtype is scale_dtype. */
typedef struct smelt__quant_geom {
  int64_t rows, cols, br, bk, sr, sc, qcols;
  smelt_dtype elem, scale_dtype;
} smelt__quant_geom;

#include "../../kernels/quant_math.cuh"

/* quant_math.cuh's element format (SMELT_Q_*) of a format and q dtype. */
static inline int smelt__quant_elem_fmt(smelt_quant_format f, smelt_dtype q) {
  if (f == SMELT_QUANT_NVFP4) return SMELT_Q_E2M1;
  return q == SMELT_DTYPE_E5M2 ? SMELT_Q_E5M2 : SMELT_Q_E4M3;
}

void smelt__quant_geometry(smelt_quant_format f, int64_t rows, int64_t cols, smelt__quant_geom *g);
/* The format's tensors around a [rows, cols] matrix (q, scale and
 * tensor_scale, which may be NULL): dtypes, shapes, q's unit column
 * stride, the tensor scale present exactly for NVFP4; messages start with
 * op. */
smelt_status smelt__quant_check_format(const char *op, smelt_quant_format f, int64_t rows, int64_t cols,
                                       const smelt_tensor *q, const smelt_tensor *scale, const smelt_tensor *ts);
/* A validated scale tensor's strides as [sr, sc] ([n] and [1] views give
 * a column stride of 0). */
void smelt__quant_scale_strides(const smelt_tensor *s, int64_t *rs, int64_t *cs);
/* The plan's format (kept in opdata by both families). */
static inline smelt_quant_format smelt__quant_format_of(const smelt_plan *plan) {
  return *(const smelt_quant_format *)plan->opdata;
}

#endif /* SMELT_QUANT_INTERNAL_H */
