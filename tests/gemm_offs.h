/* What tests/test_gemm.c lends the other GEMM test files: the selector's
 * pick on a faked device, and the grouped-by-offsets case with its check
 * (the library's CPU reference against a naive loop, and with a GPU, CUDA
 * against the CPU reference, poison and guards included), which the
 * Hopper kernel's cases (tests/test_gemm_offs_sm90.c) reuse. */
#ifndef SMELT_TEST_GEMM_OFFS_H
#define SMELT_TEST_GEMM_OFFS_H

#include "cuda/gemm_cuda.h"

/* A plan state with bf16 A, B and D, f32 accumulation. */
smelt__gemm_state bf16_state(smelt_gemm_mode mode, int split_k);
/* What the selector picks for a state on a device of compute capability
 * cc_major.cc_minor (132 SMs on 9.x, else 108), as the kernel's name; ""
 * with *status set when it refuses. */
const char *pick_name(const smelt__gemm_state *st, const smelt__gemm_facts *f, int cc_major, int cc_minor,
                      smelt_status *status);

/* A grouped-by-offsets case: A [T, K], B [G, K, N] (or the view of a
 * [G, N, K] tensor), D [T, N], offsets [G]. */
typedef struct ocase {
  smelt_dtype a, b, d, bias;
  int64_t t, n, k, g;
  const int64_t *offs; /* [g] */
  int offs64;          /* int64 offsets, else int32 */
  int b_col;           /* B as the view of a [G, N, K] tensor (K contiguous) */
  int has_c, has_bias;
  int ld16;            /* leading dimensions rounded up to 16 elements (tensor-op alignment) */
  smelt_act act;
  smelt_gemm_opclass opclass;
  int tile_m, tile_n;  /* desc.tile.m and .n (0: the selector's) */
  const char *kernel;  /* with a GPU: the start of the plan's description (its kernel), or NULL */
} ocase;

/* A case of one dtype (bias f32, f64 for f64), no C, bias or activation. */
ocase ocase_make(smelt_dtype dt, int64_t t, int64_t n, int64_t k, int64_t g, const int64_t *offs);
/* CPU against the naive loop; with a GPU, CUDA against the CPU. */
void offs_check(const ocase *o, const char *what);

#endif /* SMELT_TEST_GEMM_OFFS_H */
