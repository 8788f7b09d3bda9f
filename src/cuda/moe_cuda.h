/* The MoE CUDA backend's pieces shared by its files: the expert FFN
 * (src/cuda/moe_ffn.c: its grouped GEMM plans, made once per MoE plan, and
 * its run over permuted rows), the FFN's backward (src/cuda/moe_ffn_bwd.c),
 * the decode step's forward (src/cuda/moe_decode.c), the backend's state, and the forward's runs the backward's (src/cuda/
 * moe_bwd.c) chain again. */
#ifndef SMELT_MOE_CUDA_H
#define SMELT_MOE_CUDA_H

#include "../core/gemm_internal.h"
#include "../core/moe_internal.h"
#include "cuda_internal.h"
#include "gemm_cuda.h"

/* The fused expert products on Hopper (src/cuda/moe_gemm_sm90.c): the
 * kernels where the plan fits their rule (else NULL: the separate GEMMs
 * run) and their launch shape. */
typedef struct smelt__moe_sm90 {
  CUfunction glu, dglu, kcat;
  smelt__gemm_kernel k;
} smelt__moe_sm90;

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
                                const smelt__moe_sm90 *m, const smelt_tensor *const *t, const smelt_tensor *xp,
                                const smelt_tensor *offsets, const smelt_tensor *yp);
/* The grouped-by-offsets GEMM plan d = act(a·b + bias) over the row ends. */
smelt_status smelt__moe_plan_offs_gemm(smelt_ctx *ctx, const smelt_tensor *a, const smelt_tensor *b,
                                       const smelt_tensor *d, const smelt_tensor *bias, smelt_act act,
                                       const smelt_tensor *ends, smelt_plan **out);
/* The offsets GEMM's group ends [E]: offsets [E+1] past its leading 0. */
smelt_tensor smelt__moe_row_ends(const smelt_ctx *ctx, const smelt_tensor *offsets, int64_t E);
/* v rounded up to the pool's 256-byte blocks. */
uintptr_t smelt__moe_round_up(uintptr_t v);
/* The grid of the elementwise kernels over [rows, F] (grid-stride loops). */
unsigned smelt__moe_elementwise_grid(const smelt_ctx *ctx, const smelt__moe_state *ms);
/* out = silu(h1)·h3 over the kept rows (their count read on the device),
 * [rows, F] each with row strides of their own; out may be h1. */
smelt_status smelt__moe_swiglu(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_ffn_cuda *fc,
                               const smelt_tensor *out, const smelt_tensor *h1, const smelt_tensor *h3,
                               const smelt_tensor *offsets);
/* The halves [rows, F] (row stride 2F) of pair [rows, 2F]: columns 0 .. F-1 and F .. 2F-1. */
void smelt__moe_pair_halves(const smelt_tensor *pair, smelt_tensor *lo, smelt_tensor *hi);
/* The FFN's kernel variants (one a dtype), for the enumerator. */
int smelt__moe_ffn_variants(smelt__kernel_src *out, int max);

/* The FFN backward's GEMM plans, made on its first run for the offsets'
 * dtype (0: i32, 1: i64) and the dtype of dyp (its smelt_dtype value):
 * the up projections without an activation (the MLP's + b1), the down
 * projection into yp of x's dtype (the layer's), dA = dyp·W2ᵀ, and dxp's
 * products g1·W1ᵀ and g3·W3ᵀ (f32). */
typedef struct smelt__moe_ffn_bwd_cuda {
  smelt_plan *up1[2], *up3[2], *down[2], *da[2][4], *dx1[2], *dx3[2];
  CUfunction swiglu_bwd, act, act_bwd, bias_grad;
} smelt__moe_ffn_bwd_cuda;

/* The router's GEMMs, each planned on its first run and kept
 * (smelt__gemm_reuse): the logits x·Wr and the noise's x·Wnoise (forward
 * and backward); and the backward's products with an f32 gradient g
 * (dlogits through Wr, dz through Wnoise: src/cuda/moe_bwd.c's
 * grad_products), dW = xᵀ·g and g·Wᵀ, in one product each (GG_DW, GG_D) or,
 * g split into bf16 hi + lo, in two (the _HI and _LO ones). */
enum { SMELT__MOE_G_LOGITS, SMELT__MOE_G_NOISE, SMELT__MOE_G_COUNT };
enum { SMELT__MOE_GG_DW, SMELT__MOE_GG_D, SMELT__MOE_GG_DW_HI, SMELT__MOE_GG_DW_LO, SMELT__MOE_GG_D_HI,
       SMELT__MOE_GG_D_LO, SMELT__MOE_GG_COUNT };

/* The decode step's forward (src/cuda/moe_decode.c, kernels/moe_decode.cu):
 * its functions (route NULL where the plan takes the general path), the
 * rows of a group (1 at T = 1, else 4), a tile's columns and each GEMV's
 * tiles and split of K. */
typedef struct smelt__moe_decode_cuda {
  CUfunction route, up, down;
  int rows, tile;
  int up_tiles, up_splits, up_slice, down_tiles, down_splits, down_slice;
} smelt__moe_decode_cuda;

/* Loads the decode path's kernels where the plan's config, sizes and
 * dtypes fit its rule (else leaves dc->route NULL). */
smelt_status smelt__moe_decode_plan(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_decode_cuda *dc);
/* Whether a forward run with the tensors t takes the decode path. */
int smelt__moe_decode_fits(const smelt__moe_decode_cuda *dc, const smelt_tensor *const *t);
/* The layer's forward in three launches into t's routing roles (f32
 * logits and weights), row_map and y. */
smelt_status smelt__moe_decode_forward(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_decode_cuda *dc,
                                       const smelt_tensor *const *t);
/* The decode kernels' variants (dtype x rows of a group), for the enumerator. */
int smelt__moe_decode_variants(smelt__kernel_src *out, int max);

/* The kernel's second-B parameters (kernels/gemm_sm90.cu's gemm_b2). */
typedef struct smelt__moe_b2 {
  uint64_t keep;
  int64_t keep_rs, keep_up, kcat;
} smelt__moe_b2;

smelt_status smelt__moe_sm90_load(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_sm90 *m);
/* Whether a run with the weights of t and the activation operand a (xp for
 * glu, dyp for dglu; NULL: the layer's own) takes them: the plan loaded
 * them (SwiGLU on sm_90, ...), and the operands' layout and alignment
 * (16-byte rows of x's dtype). */
int smelt__moe_sm90_fits(const smelt__moe_sm90 *m, const smelt__moe_state *ms, const smelt_tensor *const *t,
                         const smelt_tensor *a);
/* a [rows, F] = silu(xp·W1ₑ)·(xp·W3ₑ) over the experts' rows, and with
 * keep [rows, 2F] (may be NULL) h1 = xp·W1ₑ in its first F columns, h3 =
 * xp·W3ₑ in the rest. */
smelt_status smelt__moe_glu_run(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_sm90 *m,
                                const smelt_tensor *const *t, const smelt_tensor *xp, const smelt_tensor *offsets,
                                const smelt_tensor *keep, const smelt_tensor *a);
/* From dyp [rows, d] and h13 = [h1 | h3] [rows, 2F]: dA = dyp·W2ₑᵀ, then
 * g13 = [dh1 | dh3] (g13 may be h13) and a = silu(h1)·h3 [rows, F]. */
smelt_status smelt__moe_dglu_run(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_sm90 *m,
                                 const smelt_tensor *const *t, const smelt_tensor *dyp, const smelt_tensor *offsets,
                                 const smelt_tensor *h13, const smelt_tensor *g13, const smelt_tensor *a);
/* part [rows, d] f32 = g1·W1ₑᵀ + g3·W3ₑᵀ, g13 = [g1 | g3] [rows, 2F]. */
smelt_status smelt__moe_kcat_run(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_sm90 *m,
                                 const smelt_tensor *const *t, const smelt_tensor *g13, const smelt_tensor *offsets,
                                 const smelt_tensor *part);
/* Their variants (f16 and bf16; glu, dglu and kcat), for the enumerator. */
int smelt__moe_sm90_variants(smelt__kernel_src *out, int max);

/* The backend's state (smelt__moe_state.cuda). */
typedef struct smelt__moe_cuda {
  CUfunction route, counts, aux_columns, aux_final, chunk_counts, chunk_bases, rank, copy_rows, drop, unpermute;
  CUfunction probs_list, probs_rank, unpermute_bwd, add, route_bwd, noise_grad, router_wgrad, router_wgrad_sum;
  smelt__moe_ffn_cuda ffn;     /* planned when the plan has the expert weights */
  smelt__moe_ffn_bwd_cuda bwd; /* its functions loaded with ffn, its plans on the first backward */
  smelt__moe_decode_cuda dec;  /* the decode step's forward, where it fits */
  smelt__moe_sm90 sm90;        /* the fused expert products, where they fit */
  smelt_plan *gemm[SMELT__MOE_G_COUNT];
  smelt_plan *grad_gemm[2][SMELT__MOE_GG_COUNT]; /* [0] through Wr, [1] through Wnoise */
  CUfunction split_bf16;
} smelt__moe_cuda;

/* ---------------------------------------------------------------- the FFN's backward (moe_ffn_bwd.c) */

/* Loads the backward's kernels (the FFN's module, x's dtype). */
smelt_status smelt__moe_ffn_bwd_load(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_ffn_bwd_cuda *bc);
void smelt__moe_ffn_bwd_free(smelt__moe_ffn_bwd_cuda *bc);
/* The FFN's intermediates over permuted rows, [rows, F] each of x's dtype:
 * h1 (the up projection before the activation: + b1 for the MLP), h3
 * (SwiGLU's second; for SwiGLU h1 and h3 are the halves of h13 [rows,
 * 2F], as the fused up projection keeps them), a (the activation; the
 * backward's dA and then a
 * again), and the backward's gradients of h1 and h3, g1 and g3: the same
 * memory as h1 and h3 (in place), or apart where h1 and h3 must outlive
 * the backward (a saved forward's). */
typedef struct smelt__moe_ffn_inter {
  smelt_tensor h1, h3, a, g1, g3;
  smelt_tensor h13, g13; /* SwiGLU: [rows, 2F], h1 | h3 and g1 | g3 (h1 .. g3 their halves) */
} smelt__moe_ffn_inter;
/* fi's three [rows, F] tensors in one workspace at *ws (free it), SwiGLU's
 * h1 and h3 the halves of h13; g1 and g3 are h1 and h3. */
smelt_status smelt__moe_ffn_inter_alloc(smelt_ctx *ctx, const smelt__moe_state *ms, char **ws,
                                        smelt__moe_ffn_inter *fi);
/* yp = FFN_e(xp), keeping the intermediates in fi (the layer's backward,
 * which needs both). */
smelt_status smelt__moe_ffn_forward_keep(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                         const smelt_tensor *const *t, const smelt_tensor *xp,
                                         const smelt_tensor *offsets, const smelt__moe_ffn_inter *fi,
                                         const smelt_tensor *yp);
/* The FFN's gradients from dyp over fi (h1 and h3 as the forward left
 * them; a, g1 and g3 are written): t[DW1], t[DW3], t[DW2], t[DB1] where present,
 * and, parts given (two f32 [rows, d]; the MLP writes only parts[0]), the
 * parts of its input gradient, whose sum smelt__moe_dx_sum takes. Reads the
 * offsets on the host for the weight gradients (smelt_gemm_grouped) before
 * its first launch, so it waits for the stream once, for the work before it. */
smelt_status smelt__moe_ffn_backward(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                     const smelt_tensor *const *t, const smelt_tensor *xp,
                                     const smelt_tensor *offsets, const smelt_tensor *dyp,
                                     const smelt__moe_ffn_inter *fi, const smelt_tensor *parts);
/* How many parts smelt__moe_ffn_backward writes for the weights of t: 2
 * for SwiGLU off the fused path, else 1. */
int smelt__moe_dx_parts(const smelt__moe_cuda *mc, const smelt__moe_state *ms, const smelt_tensor *const *t);
/* The FFN's input gradient from smelt__moe_ffn_backward's nparts parts
 * (moe_add): row_map NULL, dxp = their sum by row (out [rows, d]
 * contiguous, the kept rows written); else out [T, d] (any row stride) =
 * permute's backward of it through row_map [T, k], plus g·wᵀ where g (f32
 * [T, E]) is given with w [d, E] (any strides): the layer's dx, in one
 * pass over the parts. */
smelt_status smelt__moe_dx_sum(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                               const smelt_tensor *parts, int nparts, const smelt_tensor *offsets, const void *row_map,
                               const smelt_tensor *g, const smelt_tensor *w, const smelt_tensor *out);
/* The FFN's backward run (smelt_moe_ffn_backward_run): the forward's
 * intermediates recomputed from xp, then smelt__moe_ffn_backward. */
smelt_status smelt__moe_ffn_backward_run(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                         const smelt_tensor *const *t);

/* ---------------------------------------------------------------- the forward's runs (op_moe.c) */

/* The router's run into t's routing roles; sel (or NULL) [T, k] i32 gets
 * the selections before capacity drops and sel_counts (or NULL) [E] i32
 * their counts, followed by E+1 ints of scratch. */
smelt_status smelt__moe_cuda_route(smelt_plan *plan, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                   const smelt_tensor *const *t, int *sel, int *sel_counts);
/* Ids [T, k] i32 with capacity: dropped assignments get id -1 and weight 0
 * (the config's policy; w [T, k] f32). */
smelt_status smelt__moe_cuda_drop(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc, void *ids,
                                  void *w);
/* counts [E], offsets [E+1] (i32 or i64 each) and dropped (or NULL) of ids [T·k]. */
smelt_status smelt__moe_cuda_count(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                   const void *ids, void *counts, int c64, void *offs, int o64, void *dropped,
                                   int d64);
/* xp and row_map of x, ids and offsets by role (permute's run). */
smelt_status smelt__moe_cuda_permute(smelt_plan *plan, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                     const smelt_tensor *const *t);
/* y [T, d] (any row stride) = Σ_i w[t, i] · (yp [T·k, d])[row_map[t, i]], w f32 [T, k] or NULL (1). */
smelt_status smelt__moe_cuda_combine(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                     const char *op, const smelt_tensor *yp, const void *row_map, const void *w,
                                     const smelt_tensor *y);
/* The backward's runs (moe_bwd.c): route backward, aux, unpermute and
 * permute backward, the FFN's and the layer's backward. */
smelt_status smelt__moe_cuda_backward_part(smelt_plan *plan, const smelt__moe_state *ms, smelt__moe_cuda *mc,
                                           const smelt__moe_args *a);

/* Zeros in the weight gradients t[DWR ... DB1] present (runs without rows). */
smelt_status smelt__moe_zero_grads(smelt_ctx *ctx, const smelt_tensor *const *t);
/* The router's top-k of logits [T, E] f32 (with z = x·Wnoise [T, E] or
 * NULL: the noise added to logits in place) into ids and w [T, k]; lse [T]
 * (or NULL) each token's logsumexp in double. T > 0. */
smelt_status smelt__moe_cuda_select(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                    void *logits, void *z, const smelt_tensor *bias, void *ids, void *w, double *lse);
/* aux [2] f32 = {L_lb, L_z} of logits [T, E] f32, ids before drops [T, k]
 * and lse [T], through a workspace of E doubles and 2E+1 ints. */
smelt_status smelt__moe_cuda_aux_values(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_cuda *mc,
                                        const void *logits, const void *ids, void *aux, double *lse, char *ws);

static inline unsigned smelt__moe_grid(int64_t n, int64_t per) { return (unsigned)smelt__ceil_div(n, per); }

/* Bytes of n elements of es bytes, whole 256-byte blocks (the pool's alignment). */
static inline size_t smelt__moe_block_bytes(int64_t n, size_t es) { return ((size_t)n * es + 255) & ~(size_t)255; }

/* A contiguous [rows, cols] tensor of dtype dt on the context's device at p. */
static inline smelt_tensor smelt__moe_device_mat(const smelt_ctx *ctx, void *p, smelt_dtype dt, int64_t rows,
                                                 int64_t cols) {
  const int64_t shape[2] = {rows, cols};
  return smelt_tensor_make(p, dt, SMELT_DEVICE_CUDA, ctx->device_index, 2, shape);
}

#endif /* SMELT_MOE_CUDA_H */
