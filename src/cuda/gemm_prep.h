/* The GEMM operand pre-pass (kernels/gemm_prep.cu): one operand, stored
 * with any strides, copied into a K-major workspace, rounded to tf32 or
 * split into the 3xtf32 parts on the way, so that the Hopper kernel (TMA +
 * wgmma, K-major operands only, tf32 read by truncation) can run every
 * layout and round correctly.
 *
 * Why a pass of its own and not a change to the kernel: rounding the
 * staged tiles in shared memory would cost the shared-memory bandwidth the
 * wgmma needs, and transposing there the same; the pass costs one read of
 * the operand and one write per part (tf32: 8 bytes per element, 3xtf32:
 * 16, fp8 transpose: 2), bandwidth-bound and small next to the GEMM's
 * O(MNK) work when M, N and K are all large.
 *
 * The host twins of the kernel's rounding (smelt__tf32_rna and
 * smelt__tf32_split) are here for the tests and anyone who wants the bits
 * the GPU gives. */
#ifndef SMELT_GEMM_PREP_H
#define SMELT_GEMM_PREP_H

#include "cuda_internal.h"

#include <stdint.h>
#include <string.h>

/* What the pre-pass does to an operand (PREP_* in kernels/gemm_prep.cu). */
typedef enum smelt__gemm_prep {
  SMELT__PREP_NONE = 0, /* the operand is used as it is */
  SMELT__PREP_COPY,     /* copied K-major (fp8 stored MN-major) */
  SMELT__PREP_TF32,     /* copied K-major, rounded to the nearest tf32 */
  SMELT__PREP_SPLIT     /* copied K-major as the three 3xtf32 parts */
} smelt__gemm_prep;

/* K of one part in the workspace: k rounded up to 16 bytes of elements. */
int64_t smelt__gemm_prep_kp(int64_t k, smelt_dtype dt);
/* The workspace row stride (elements) of an operand prepped with `prep`:
 * three parts of kp for SPLIT, one otherwise. */
int64_t smelt__gemm_prep_ld(smelt__gemm_prep prep, int64_t k, smelt_dtype dt);
/* The pre-pass module (one variant: form, element size and layout are
 * run-time parameters). */
void smelt__gemm_prep_src(smelt__kernel_src *src);
smelt_status smelt__gemm_prep_load(smelt_ctx *ctx, CUfunction *f);
/* Runs the pre-pass on the context's stream: operand `which` (0: A, whose
 * rows are M; 1: B, whose rows are N) of dtype dt, rows x k elements,
 * element (r, kk) at src + (r * s_r + kk * s_k) * size, into dst (16-byte
 * aligned, rows x smelt__gemm_prep_ld elements). */
smelt_status smelt__gemm_prep_run(smelt_ctx *ctx, CUfunction f, smelt__gemm_prep prep, int which, const void *src,
                                  smelt_dtype dt, int64_t rows, int64_t k, int64_t s_r, int64_t s_k, void *dst);

/* The host twin of the kernel's tf32 rounding: the bits of x rounded to the
 * nearest tf32 (ties away from zero, as cvt.rna.tf32.f32), low 13 bits
 * zero; NaN stays NaN. */
static inline uint32_t smelt__tf32_rna(uint32_t u) {
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x007fffffu) ? (u | 0x00400000u) & 0xffffe000u : u;
  return (u + 0x1000u) & 0xffffe000u;
}

static inline float smelt__tf32_round(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  u = smelt__tf32_rna(u);
  memcpy(&x, &u, 4);
  return x;
}

/* x = big + small (+ what tf32 cannot hold of small): the 3xtf32 split. */
static inline void smelt__tf32_split(float x, float *big, float *small) {
  *big = smelt__tf32_round(x);
  uint32_t b;
  memcpy(&b, big, 4);
  *small = (b & 0x7f800000u) == 0x7f800000u ? 0.0f : smelt__tf32_round(x - *big);
}

#endif /* SMELT_GEMM_PREP_H */
