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
 * 16-bit operands (f16, bf16) get a plain copy instead (SMELT__PREP_PITCH,
 * the kernel's second entry): the Hopper kernel reads them in either
 * major-ness, but its 128-byte TMA box rows run at half speed when the
 * operand's rows are 16 but not 128 bytes apart, and not at all when they
 * are not 16 bytes apart; the copy keeps the major-ness and puts the rows
 * whole 128-byte lines apart (smelt__gemm_prep_choose says when it pays).
 *
 * The host twins of the kernel's rounding (smelt__tf32_rna and
 * smelt__tf32_split) are here for the tests and anyone who wants the bits
 * the GPU gives. */
#ifndef SMELT_GEMM_PREP_H
#define SMELT_GEMM_PREP_H

#include "../core/gemm_internal.h"
#include "cuda_internal.h"

#include <stdint.h>
#include <string.h>

/* What the pre-pass does to an operand (PREP_* in kernels/gemm_prep.cu). */
typedef enum smelt__gemm_prep {
  SMELT__PREP_NONE = 0, /* the operand is used as it is */
  SMELT__PREP_COPY,     /* copied K-major (fp8 stored MN-major) */
  SMELT__PREP_TF32,     /* copied K-major, rounded to the nearest tf32 */
  SMELT__PREP_SPLIT,    /* copied K-major as the three 3xtf32 parts */
  SMELT__PREP_PITCH     /* 16-bit: copied as it is (same major-ness), rows a multiple of 128 bytes apart */
} smelt__gemm_prep;

/* Operand `which` of a problem (0: A [M, K], 1: B [K, N]) as a 2-D array:
 * `rows` of `cols` elements along its unit-stride axis, `pitch` elements
 * apart; kmajor when that axis is K. */
typedef struct smelt__gemm_prep_geom {
  int kmajor;
  int64_t rows, cols, pitch;
} smelt__gemm_prep_geom;

/* The geometry of operand `which` of p; 0 when neither axis has unit
 * stride (an axis of one element counts as unit stride, K first). */
int smelt__gemm_prep_geom_of(int which, const smelt__gemm_prob *p, smelt__gemm_prep_geom *g);
/* The workspace row stride (elements) of a PITCH copy of rows of `cols`:
 * cols rounded up to 64 elements, one 128-byte line. */
int64_t smelt__gemm_prep_pitch_ld(int64_t cols);

/* K of one part in the workspace: k rounded up to 16 bytes of elements. */
int64_t smelt__gemm_prep_kp(int64_t k, smelt_dtype dt);
/* The workspace row stride (elements) of an operand prepped with `prep`:
 * three parts of kp for SPLIT, one otherwise. */
int64_t smelt__gemm_prep_ld(smelt__gemm_prep prep, int64_t k, smelt_dtype dt);
/* The pre-pass module (one variant: form, element size and layout are
 * run-time parameters) and its entry for a plan's pre-passes: gemm_prep,
 * or gemm_prep_pitch for PITCH copies (a plan has one or the other). */
void smelt__gemm_prep_src(smelt__kernel_src *src);
smelt_status smelt__gemm_prep_load(smelt_ctx *ctx, const smelt__gemm_prep prep[2], CUfunction *f);
/* Workspace bytes of operand `which` of p (dtype dt) after `prep`, a
 * multiple of 256 (0 for NONE). */
size_t smelt__gemm_prep_bytes(smelt__gemm_prep prep, int which, const smelt__gemm_prob *p, smelt_dtype dt);
/* Runs the pre-pass of each operand of *p that has one on the context's
 * stream (f from smelt__gemm_prep_load), A's into ws and B's
 * smelt__gemm_prep_bytes(A) further (ws 256-byte aligned), and points *p's
 * operands at their copies. K stays p->k (smelt__gemm_prep_gemm_k gives the
 * main kernel's). */
smelt_status smelt__gemm_prep_operands(smelt_ctx *ctx, CUfunction f, const smelt__gemm_prep prep[2], smelt_dtype dt_a,
                                       smelt_dtype dt_b, smelt__gemm_prob *p, char *ws);

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
