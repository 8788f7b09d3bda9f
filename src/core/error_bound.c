/* The error bounds (src/core/error_bound.h). Each is the arithmetic's own
 * error plus about one rounding of the output type: the two sides round
 * values that differ in their last bits. */
#include "error_bound.h"
#include "internal.h"

#include <string.h>

double smelt__error_bound(const smelt__bound_query *q) {
  for (int i = 0; i < smelt__family_count; i++)
    if (!strcmp(smelt__families[i]->name, q->family)) return smelt__families[i]->bound(q);
  return -1.0;
}

/* One element's worst error as a multiple of the larger of its row's
 * scale and 1: two units in the last place of the 16-bit types, room for
 * fast intrinsics in f32. */
static double max_rel(smelt_dtype dt) {
  switch (dt) {
    case SMELT_DTYPE_F16: return 0x1.0p-9;
    case SMELT_DTYPE_BF16: return 0x1.0p-6;
    default: return 1e-5;
  }
}

/* Elementwise and row-wise ops compute in f32 (the CPU in double) and
 * round once: a few f32 units in the last place, about one rounding of a
 * 16-bit output. The logsumexp is f32 after a sum over the row. */
double smelt__bound_elementwise(const smelt__bound_query *q) {
  if (q->metric == SMELT__METRIC_MAX_REL) return max_rel(q->output ? SMELT_DTYPE_F32 : q->dtype);
  if (q->output) return 4e-6;
  switch (q->dtype) {
    case SMELT_DTYPE_F64: return 1e-12;
    case SMELT_DTYPE_F32: return 2e-6;
    case SMELT_DTYPE_F16: return 1e-3;
    default: return 8e-3;
  }
}

/* The products' error (exact in f64 and i8; f16 accumulation; tf32
 * operands; 3xtf32 as f32, whose bound grows with K as an f32 sum's does
 * and stays below what a biased sum leaves, 7e-6 at K 1024; else f32
 * accumulation of exact products) plus one rounding of D. Integer outputs
 * are exact when nothing but the integer product passes through the
 * epilogue's float scales. */
double smelt__bound_gemm(const smelt__bound_query *q) {
  if (q->metric == SMELT__METRIC_MAX_REL) return max_rel(q->dtype); /* q->gemm may be NULL here */
  const smelt_gemm_desc *d = q->gemm;
  const smelt_gemm_epilogue *e = &d->epilogue;
  const double in = q->dt_a == SMELT_DTYPE_F64 || q->dt_a == SMELT_DTYPE_I8 ? 1e-12
                    : d->math.acc == SMELT_GEMM_ACC_F16                    ? 3e-2
                    : d->math.op == SMELT_GEMM_MATH_TF32                   ? 2e-3
                    : d->math.op == SMELT_GEMM_MATH_3XTF32 ? 2e-6 + 1e-9 * (double)q->k
                                                           : 1e-5;
  switch (q->dtype) {
    case SMELT_DTYPE_F64: return in;
    case SMELT_DTYPE_F32: return in + 1e-6;
    case SMELT_DTYPE_F16: return in + 2e-3;
    case SMELT_DTYPE_BF16: return in + 1e-2;
    case SMELT_DTYPE_E4M3: return in + 0.08;
    case SMELT_DTYPE_E5M2: return in + 0.15;
    default:
      return in + (q->dt_a == SMELT_DTYPE_I8 && e->act == SMELT_ACT_IDENTITY && e->scale_a == 1.0f &&
                           e->scale_b == 1.0f && e->scale_d == 1.0f
                       ? 0.0
                       : 1e-2);
  }
}

/* The CPU computes in double and rounds once to the output type; the GPU
 * rounds P and dS to the 16-bit input type on their way into the tensor
 * cores and accumulates in f32. */
double smelt__bound_attention(const smelt__bound_query *q) {
  const int cuda = q->device == SMELT_DEVICE_CUDA;
  if (q->metric == SMELT__METRIC_MAX_REL) return max_rel(q->output ? SMELT_DTYPE_F32 : q->dtype);
  if (q->output) return cuda ? 2e-5 : 1e-6;
  if (cuda) return q->dtype == SMELT_DTYPE_BF16 ? 1e-2 : 5e-3;
  switch (q->dtype) {
    case SMELT_DTYPE_F64: return 1e-12;
    case SMELT_DTYPE_F32: return 2e-6;
    case SMELT_DTYPE_F16: return 1e-3;
    default: return 8e-3;
  }
}

/* PEER against the CPU reference (the reference against the exact result:
 * double arithmetic, one rounding). The GPU's routing scores carry the
 * bf16 hi + lo split's ~2^-16 relative error into the gates, which moves
 * an f32 y more than its own sums do; the gradients (output 1) also pass
 * the gates' derivatives and the projection's GEMMs. 16-bit results are
 * dominated by their own rounding. One element's worst error allows four
 * elementwise units: y sums every head's k gated experts before rounding. */
double smelt__bound_peer(const smelt__bound_query *q) {
  if (q->metric == SMELT__METRIC_MAX_REL) return 4 * max_rel(q->dtype);
  if (q->device == SMELT_DEVICE_CPU) {
    switch (q->dtype) {
      case SMELT_DTYPE_F64: return 1e-12;
      case SMELT_DTYPE_F32: return 1e-6;
      case SMELT_DTYPE_F16: return 1e-3;
      default: return 8e-3;
    }
  }
  switch (q->dtype) {
    case SMELT_DTYPE_F32: return q->output ? 1e-4 : 2e-5;
    case SMELT_DTYPE_F16: return 2e-3;
    default: return 1e-2;
  }
}

/* MoE: the CPU reference against the exact result (double arithmetic; the
 * expert FFN's intermediates are f32 for f32 and 16-bit inputs, one more
 * rounding of each; the output rounded once). The CUDA parts (router,
 * permute, unpermute) compute in f32 with one rounding of the output.
 * One element's worst error allows four elementwise units, as PEER's: y
 * sums k weighted experts before rounding. The CUDA expert FFN (and so the
 * layer) rounds its intermediates to x's dtype, as the fast GEMMs take
 * them (h1, h3, silu(h1)·h3, yp: four roundings more than the CPU's, each
 * well under a unit of relative L2): its bounds against the CPU reference
 * are 3 units (2^-8 bf16, 2^-11 f16); f32 only sums in another order. */
double smelt__bound_moe(const smelt__bound_query *q) {
  if (q->metric == SMELT__METRIC_MAX_REL) return 4 * max_rel(q->dtype);
  if (q->device == SMELT_DEVICE_CUDA) {
    switch (q->dtype) {
      case SMELT_DTYPE_F32: return 1e-5;
      case SMELT_DTYPE_F16: return 1.5e-3;
      default: return 1.2e-2;
    }
  }
  switch (q->dtype) {
    case SMELT_DTYPE_F64: return 1e-12;
    case SMELT_DTYPE_F32: return 2e-6;
    case SMELT_DTYPE_F16: return 1e-3;
    default: return 8e-3;
  }
}

/* Norms, their backward and rotary compute in f32 after sums over a row
 * (or, for dweight and dbias, over the rows), then round once: an f32 sum's
 * error over the lengths the tests and models use, about one rounding of a
 * 16-bit output. Output 1 is an f32 row statistic (mean, rstd). */
double smelt__bound_norm(const smelt__bound_query *q) {
  if (q->metric == SMELT__METRIC_MAX_REL) return max_rel(q->output ? SMELT_DTYPE_F32 : q->dtype);
  if (q->output || q->dtype == SMELT_DTYPE_F32) return 1e-5;
  return q->dtype == SMELT_DTYPE_F16 ? 1e-3 : 8e-3;
}
