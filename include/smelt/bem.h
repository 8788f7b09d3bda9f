/* smelt BEM: the generated low-rank update of a frozen linear layer (LoRA
 * whose rank channels are gated per token by codes), in one fused kernel.
 *
 * What is computed (../shared/SEMANTICS.md, BEM), for row m of adapter a
 * with scale s_a = desc.scale · (scales ? scales[a] : 1):
 *   A[m]  = x[m] · V_a                          [r]
 *   H[m]  = A[m] ∘ codes[m]                     [r]
 *   ΔY[m] = s_a · H[m] · U_aᵀ                    [d_out]
 *   y[m]  = ΔY[m], or y[m] + ΔY[m] with desc.accumulate
 * Backward (gradients of sum(ΔY ∘ dy); each overwritten, each optional):
 *   dH = s·dy·U; dU = s·dyᵀ·H; dcodes = dH ∘ A; dA = dH ∘ codes;
 *   dV = xᵀ·dA; dx = dA·Vᵀ.
 *
 * Shapes (M rows, r = rank in [1, 128], A adapters):
 *   x      [M, d_in]         codes [M, r]          y, dy [M, d_out]
 *   one adapter (offsets NULL):   v [d_in, r],     u [d_out, r]
 *   segments (offsets given):     v [A, d_in, r],  u [A, d_out, r],
 *                                 offsets [A + 1] i32 or i64 on the device
 *   scales [A] f32 (optional; [1] for one adapter)
 *   gradients: dx, dv, du, dcodes shaped as x, v, u, codes.
 * Segments (Punica-style): rows [o_a, o_{a+1}) use adapter a, where
 * o_a = min(M, max(0, offsets[0..a])) (a running maximum clamped to the
 * rows, so any offsets describe disjoint ranges and nothing is read on the
 * host). Rows in no segment (before o_0, from o_A on) get ΔY = 0: y is
 * written with zeros, or left as it is with accumulate, and their dx and
 * dcodes rows are zero.
 *
 * Layouts. Any non-negative strides on the CPU reference. The seed's
 * "pre-transposed" U (stored [r, d_out]) is u [d_out, r] with strides
 * (1, d_out): pass it as that view. On CUDA, x, codes and y need a unit
 * column stride (any row stride); v and u take any strides (fastest with a
 * unit stride along either dim). Everything but offsets and scales has x's
 * dtype: f32, f16 or bf16. Math is f32 on the GPU: x·V accumulates in f32
 * on tensor cores (f16/bf16) or in FMA (f32), H is rounded to the input
 * type for the second product (as an unfused run stores it), ΔY is
 * rounded once (after the addition with accumulate). The CPU reference
 * accumulates in double and rounds once.
 *
 * CUDA limits: the backward of one adapter is composed of five GEMMs and
 * three Hadamard passes (its [M, r] intermediates in the input type, as
 * an autograd engine keeps them), not fused; with segments it is not
 * supported on CUDA yet (planning fails with UNSUPPORTED; the CPU backend
 * runs it). */
#ifndef SMELT_BEM_H
#define SMELT_BEM_H

#include "../smelt.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SMELT_BEM_MAX_RANK 128

typedef struct smelt_bem_desc {
  double scale;   /* s (PEFT: alpha / r); finite */
  int accumulate; /* forward: 0 writes y = ΔY, 1 adds y += ΔY; the backward ignores it */
} smelt_bem_desc;

/* scale 1, no accumulate. */
SMELT_API smelt_bem_desc smelt_bem_desc_default(void);

/* The inputs of every BEM call. x, v, codes and u are required; offsets
 * and scales optional (see above). */
typedef struct smelt_bem_inputs {
  const smelt_tensor *x, *v, *codes, *u;
  const smelt_tensor *offsets, *scales;
} smelt_bem_inputs;

/* The backward's outputs, each optional (NULL = not computed). */
typedef struct smelt_bem_grads {
  const smelt_tensor *dx, *dv, *du, *dcodes;
} smelt_bem_grads;

/* ---------------------------------------------------------------- forward */

/* A plan for one desc and one set of layouts; runs bind tensors of the
 * planned dtypes, shapes and strides (data pointers may change). */
SMELT_API smelt_status smelt_bem_plan(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                      const smelt_tensor *y, smelt_plan **out);
SMELT_API smelt_status smelt_bem_run(smelt_plan *plan, const smelt_bem_inputs *in, const smelt_tensor *y);
/* One-shot: plan, run, destroy. */
SMELT_API smelt_status smelt_bem(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                 const smelt_tensor *y);

/* ---------------------------------------------------------------- backward */

SMELT_API smelt_status smelt_bem_backward_plan(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                               const smelt_tensor *dy, const smelt_bem_grads *grads,
                                               smelt_plan **out);
SMELT_API smelt_status smelt_bem_backward_run(smelt_plan *plan, const smelt_bem_inputs *in, const smelt_tensor *dy,
                                              const smelt_bem_grads *grads);
SMELT_API smelt_status smelt_bem_backward(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                          const smelt_tensor *dy, const smelt_bem_grads *grads);

/* ---------------------------------------------------------------- validation and benchmark */

typedef struct smelt_bem_check {
  double max_abs;   /* max |got - ref| over y */
  double max_rel;   /* max_abs / max |ref| (max_abs itself when ref is all zero) */
  double rel_l2;    /* ||got - ref|| / ||ref|| (the same fallback) */
  int64_t worst;    /* row-major index of the element with max_abs */
  double tolerance; /* the tolerance applied to max_rel */
  int passed;       /* max_rel <= tolerance and NaN/Inf where the reference has them, only there */
} smelt_bem_check;

/* Runs smelt_bem on ctx into y (on ctx's device), copies the inputs and
 * y's before and after to the host, runs the CPU reference there and
 * compares. tolerance <= 0 takes the library's bound for the dtype and
 * device (the one the tests use). Leaves y holding the op's result. */
SMELT_API smelt_status smelt_bem_validate(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                          const smelt_tensor *y, double tolerance, smelt_bem_check *out);

typedef struct smelt_bem_timing {
  double fused_ms;   /* median of the fused op */
  double unfused_ms; /* median of the unfused execution: A = x·V (GEMM), H = s·A∘codes, y = H·Uᵀ (GEMM; with
                        beta 1 when accumulating), three launches with A and H in memory, as torch eager runs it */
  double speedup;    /* unfused_ms / fused_ms */
  double base_ms;    /* median of the frozen base layer x·Wᵀ (a GEMM into y, with a W [d_out, d_in] of its own) */
  double overhead_pct; /* 100 · fused_ms / base_ms: what the update adds to the base layer run before it */
  double fused_gbps; /* bytes of x, codes, v, u and y (read and written when accumulating) / fused time */
} smelt_bem_timing;

/* Times the three on ctx (warmup untimed runs, then the median of iters)
 * with the caller's tensors; y is overwritten. One adapter only (the
 * unfused form has no segments): offsets must be NULL. On the CPU backend
 * the times are the references'. */
SMELT_API smelt_status smelt_bem_benchmark(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                           const smelt_tensor *y, int warmup, int iters, smelt_bem_timing *out);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_BEM_H */
