/* The MoE CUDA backend's expert FFN (src/cuda/moe_ffn.c), shared with the
 * layer's forward in src/cuda/op_moe.c: its grouped GEMM plans, made once
 * per MoE plan, and its run over permuted rows. */
#ifndef SMELT_MOE_CUDA_H
#define SMELT_MOE_CUDA_H

#include "../core/moe_internal.h"
#include "cuda_internal.h"

/* The FFN's GEMMs by the dtype of the offsets (0: i32, 1: i64) and, for
 * the down projection, of yp (its smelt_dtype value, f32 to bf16): each is
 * a grouped-by-offsets plan that binds exactly one dtype of each. The
 * layer's own pair (i32 offsets, yp of x's dtype) is planned with the MoE
 * plan; the others on their first run, then kept. */
typedef struct smelt__moe_ffn_cuda {
  smelt_plan *up1[2], *up3[2], *down[2][4];
  CUfunction swiglu;
} smelt__moe_ffn_cuda;

/* Plans the layer's pair and loads the SwiGLU kernel (ms has the FFN weights). */
smelt_status smelt__moe_ffn_plan(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_ffn_cuda *fc);
void smelt__moe_ffn_free(smelt__moe_ffn_cuda *fc);
/* yp = FFN_e(xp) over each expert's rows [offsets[e], offsets[e+1]), stream
 * ordered, with the weights t[SMELT__MT_W1 ...] as planned. */
smelt_status smelt__moe_ffn_run(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_ffn_cuda *fc,
                                const smelt_tensor *const *t, const smelt_tensor *xp, const smelt_tensor *offsets,
                                const smelt_tensor *yp);
/* The FFN's kernel variants (one a dtype), for the enumerator. */
int smelt__moe_ffn_variants(smelt__kernel_src *out, int max);

/* A contiguous [rows, cols] tensor of dtype dt on the context's device at p. */
static inline smelt_tensor smelt__moe_device_mat(const smelt_ctx *ctx, void *p, smelt_dtype dt, int64_t rows,
                                                 int64_t cols) {
  const int64_t shape[2] = {rows, cols};
  return smelt_tensor_make(p, dt, SMELT_DEVICE_CUDA, ctx->device_index, 2, shape);
}

#endif /* SMELT_MOE_CUDA_H */
