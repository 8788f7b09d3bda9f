/* smelt MoE: a Mixture-of-Experts layer (Megatron-LM / Mixtral conventions,
 * ../shared/SEMANTICS.md "MoE"), as one layer and as its parts: router, aux
 * losses, permute, expert FFN, unpermute, and the backward of each.
 *
 * What is computed, for x [T, d] and E experts of which each token uses k:
 *   logits  = x · Wr  (+ noise, below)                     [T, E], kept in f32
 *   s       = softmax(logits) | sigmoid(logits)            [T, E]
 *   sel     = the k experts of the largest s + bias        (bias: selection only;
 *             (group-limited: only within the topk_groups   equal keys rank by lower id)
 *             groups of the largest group scores)
 *   w_i     = s[sel_i], divided by Σ_i s[sel_i] when renormalizing (softmax with
 *             cfg.renormalize; sigmoid when k > 1, the sum + 1e-20), times
 *             cfg.scaling_factor
 *   capacity C = min(T, ceil(T·k/E · capacity_factor)), computed in double: an
 *             expert keeps at most C of its tokens, those of the largest w
 *             ("probs", equal w by lower token) or of the lowest token index
 *             ("position"); a dropped assignment has id -1 and weight 0 and
 *             contributes nothing
 *   y[t]    = Σ_i w_i · FFN_{sel_i}(x[t])                  in slot order i = 0..k-1
 *   FFN_e   = (silu(x·W1ₑ) ∘ (x·W3ₑ))·W2ₑ  (SwiGLU)  or  act(x·W1ₑ + b1ₑ)·W2ₑ  (MLP)
 *
 * Noisy top-k (Shazeer 2017), when weights.wnoise is given:
 *   logits[t, e] = (x·Wr)[t, e] + n(seed, t0 + t, e) · softplus((x·Wnoise)[t, e])
 * n is a standard normal drawn from Philox-4x32-10 (key = the 64-bit seed,
 * counter = (e, token, 0, 0) with token = t0 + t as two 32-bit words; Box-Muller
 * on the first two outputs: sqrt(-2 ln((u0 + 1) 2^-32)) · cos(2π u1 2^-32)), so
 * it depends only on (seed, token, e): results repeat, and a batch cut into
 * pieces routes like the whole when each piece passes its first row's index
 * as cfg.noise_token_offset. Everything after the logits is a function of
 * the logits tensor (which includes the noise). The layer's backward
 * differentiates through the noise's scale (dx and dWnoise, n a constant);
 * the router's part stops at d logits.
 *
 * Aux losses (values in aux [2] = {L_lb, L_z}, gradients added to dlogits):
 *   L_lb = aux_loss_coeff · E/(k·T²) · Σ_e count_e · Σ_t p[t, e]
 *          p = softmax(logits) (whatever the score function), count_e = the
 *          tokens that selected e before capacity drops; gradient through p only
 *   L_z  = z_loss_coeff · (1/T) Σ_t (logsumexp_e logits[t, e])²
 *
 * Dispatch. Permuted rows are expert-major and stable: expert e owns rows
 * [offsets[e], offsets[e+1]) holding its kept tokens in ascending order;
 * offsets [E+1] is the exclusive prefix sum of counts [E]; row_map[t, i] is
 * the row of token t's i-th assignment (-1 when dropped). Permuted tensors
 * have T·k rows (every assignment could be kept); rows at or past
 * offsets[E] are neither read nor written.
 *
 * dtypes. x, xp, y, dy, dx and the weights Wr, Wnoise, W1, W3, W2, b1: f32, f16
 * or bf16 (f64 too on the CPU backend, for gradient checks), each weight
 * independently of x; x, xp, y, dy, dx share x's dtype. Permuted expert
 * outputs yp and their gradients (dyp, dxp): any of those float types. logits,
 * weights, aux and their gradients: f32 (or f64 on the CPU backend). ids and
 * row_map: i32. counts, offsets, dropped: i32 or i64. expert_bias: f32 [E].
 * Arithmetic is f32 or wider; the CPU reference computes in double and rounds
 * once; sums over a token's k choices follow slot order, so a token's output
 * does not depend on the other tokens of its batch.
 *
 * Layouts. Every tensor is contiguous (row-major) except that x, y, dy and dx
 * may have any row stride with unit column stride; other strides are
 * refused (BAD_LAYOUT). Weights: Wr [d, E], Wnoise [d, E], W1 and W3 [E, d, F],
 * W2 [E, F, d], b1 [E, F].
 *
 * CUDA: every run. The router (logits by the GEMM engine, then one warp
 * per token; counts, offsets and the aux losses' values on the device;
 * capacity by either policy), permute, unpermute, the expert FFN (grouped
 * GEMMs by the device offsets; intermediates of x's dtype) and the layer's
 * forward never wait for the host. The backward runs (each part's and the
 * layer's) do the same except the expert FFN's weight gradients, whose
 * per-expert row ranges are read on the host (one wait for the stream per
 * FFN or layer backward: the grouped-by-offsets GEMM groups rows, not the
 * K of dW = Xᵀ·dY). Every gradient is summed in a fixed order without
 * float atomics: runs repeat bit for bit. Planning needs E <= 1024,
 * top_k <= 32, num_groups <= 32 and no f64 (else UNSUPPORTED); f64
 * routing tensors and permuted tensors are UNSUPPORTED there, naming the
 * tensor: nothing falls back to the CPU. Index tensors are not read by the
 * host there: ids outside [0, E) and rows outside [0, T·k) count as
 * dropped instead of being refused.
 */
#ifndef SMELT_MOE_H
#define SMELT_MOE_H

#include "../smelt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum smelt_moe_score {
  SMELT_MOE_SCORE_SOFTMAX = 0, /* softmax over the E logits of a token */
  SMELT_MOE_SCORE_SIGMOID,     /* 1 / (1 + exp(-logit)) each (DeepSeek-V3) */
  SMELT_MOE_SCORE_COUNT
} smelt_moe_score;

typedef enum smelt_moe_drop {
  SMELT_MOE_DROP_NONE = 0, /* no capacity (capacity_factor must be 0) */
  SMELT_MOE_DROP_PROBS,    /* an expert keeps its tokens of the largest routing weight */
  SMELT_MOE_DROP_POSITION, /* an expert keeps its tokens of the lowest index */
  SMELT_MOE_DROP_COUNT
} smelt_moe_drop;

typedef enum smelt_moe_ffn {
  SMELT_MOE_FFN_SWIGLU = 0, /* (silu(x·W1) ∘ (x·W3))·W2 */
  SMELT_MOE_FFN_MLP,        /* act(x·W1 + b1)·W2 (b1 optional) */
  SMELT_MOE_FFN_COUNT
} smelt_moe_ffn;

typedef struct smelt_moe_config {
  int64_t num_experts; /* E >= 1 */
  int64_t top_k;       /* k, 1 <= k <= E */
  int64_t d_model;     /* d >= 1 */
  int64_t ffn_dim;     /* F >= 1: each expert's hidden width */
  smelt_moe_score score;
  int renormalize;       /* softmax: the k chosen weights divided by their sum (default 1) */
  double scaling_factor; /* routing weights times this (default 1), finite */
  /* Group-limited routing (DeepSeek): E experts in num_groups equal groups; a
   * group's score is the sum of its k/topk_groups largest selection keys
   * (s + bias); a token picks its experts from its topk_groups best groups
   * only. 0 and 0: off. Else num_groups divides E, 1 <= topk_groups <=
   * min(num_groups, k), and k <= topk_groups · E/num_groups. */
  int64_t num_groups, topk_groups;
  uint64_t noise_seed;        /* noisy top-k (with weights.wnoise) */
  int64_t noise_token_offset; /* the global index of x's row 0 for the noise, >= 0 */
  double capacity_factor;     /* 0: no capacity; > 0 with a drop policy */
  smelt_moe_drop drop_policy;
  double aux_loss_coeff; /* L_lb's coefficient (0: none), finite, >= 0 */
  double z_loss_coeff;   /* L_z's coefficient (0: none), finite, >= 0 */
  smelt_moe_ffn ffn;
  smelt_act activation; /* MLP only */
} smelt_moe_config;

/* Softmax scores with renormalization (Mixtral), scaling 1, no groups, no
 * capacity, no aux losses, SwiGLU (MLP activation gelu). The four sizes are
 * 0 and must be set. */
SMELT_API smelt_moe_config smelt_moe_config_default(void);

/* The parameters, on the context's device (NULL = absent):
 *   wr           [d, E]     router, required
 *   expert_bias  [E] f32    selection bias, optional
 *   wnoise       [d, E]     noise scale projection: noisy top-k, optional
 *   w1           [E, d, F]  required by the FFN runs
 *   w3           [E, d, F]  SwiGLU only, required there
 *   w2           [E, F, d]  required by the FFN runs
 *   b1           [E, F]     MLP only, optional */
typedef struct smelt_moe_weights {
  const smelt_tensor *wr, *expert_bias, *wnoise;
  const smelt_tensor *w1, *w3, *w2, *b1;
} smelt_moe_weights;

/* The router's outputs (the layer's, when a caller wants them):
 *   logits   [T, E]   f32, required
 *   ids      [T, k]   i32, the selected experts best first, -1 where dropped, required
 *   weights  [T, k]   f32, the routing weights, 0 where dropped, required
 *   counts   [E]      i32|i64, kept tokens per expert, required
 *   offsets  [E+1]    i32|i64, the exclusive prefix sum of counts, required
 *   dropped  [1]      i32|i64, dropped assignments, optional
 *   aux      [2]      f32, {L_lb, L_z} (0 for a zero coefficient), optional */
typedef struct smelt_moe_routing {
  const smelt_tensor *logits, *ids, *weights, *counts, *offsets, *dropped, *aux;
} smelt_moe_routing;

/* Weight gradients of the FFN and the layer (each optional; all overwritten;
 * shaped like their weights and contiguous). Accumulated in a fixed order. */
typedef struct smelt_moe_grads {
  const smelt_tensor *dx;  /* [T, d] (layer) */
  const smelt_tensor *dwr; /* [d, E] (layer) */
  const smelt_tensor *dwnoise; /* [d, E] (layer, noisy top-k) */
  const smelt_tensor *dw1, *dw3, *dw2, *db1;
} smelt_moe_grads;

/* Statistics of one routing: from counts and dropped. */
typedef struct smelt_moe_stats {
  int64_t tokens;      /* T */
  int64_t assignments; /* T·k */
  int64_t kept;        /* Σ counts */
  int64_t dropped;     /* assignments - kept */
  int64_t max_count, min_count;
  int64_t empty_experts; /* experts with no token */
  double imbalance;      /* max count / mean count (mean = kept / E); 0 when nothing is kept */
} smelt_moe_stats;

/* ---------------------------------------------------------------- plan */

/* A plan for one config, one set of weight layouts and one x layout
 * [T, d]; every run below binds weights and x of exactly those layouts
 * (data pointers may change) and its own tensors of the shapes given. */
SMELT_API smelt_status smelt_moe_plan(smelt_ctx *ctx, const smelt_moe_config *cfg, const smelt_moe_weights *w,
                                      const smelt_tensor *x, smelt_plan **out);

/* ---------------------------------------------------------------- the layer */

/* y [T, d] = the layer's output. routing: the router's outputs as well
 * (NULL: kept internally); stats (NULL: not wanted) filled from them (on
 * CUDA this would wait for the stream). */
SMELT_API smelt_status smelt_moe_forward_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *x,
                                             const smelt_tensor *y, const smelt_moe_routing *routing,
                                             smelt_moe_stats *stats);
/* Gradients of sum(y ∘ dy) + L_lb + L_z: dx, dwr, dwnoise, dw1, dw3, dw2, db1
 * (each optional). The forward is recomputed from x and the weights (the routing
 * is a function of them), so only x is kept between the passes. Dropped
 * assignments contribute zero. */
SMELT_API smelt_status smelt_moe_backward_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *x,
                                              const smelt_tensor *dy, const smelt_moe_grads *grads);
/* Training without the backward's recomputation: a saved forward keeps
 * what the backward needs (the routing, the permuted rows, the expert
 * outputs and the FFN's pre-activations h1 and h3) in the caller's `saved`,
 * a contiguous u8 tensor [smelt_moe_saved_bytes] on the plan's device whose
 * data is 256-byte aligned, and the saved backward reads it instead of
 * running the forward again: on CUDA about T·k·(2·d + 2·F) elements of x's
 * dtype (T·k·(2·d + F) for the MLP, which has no h3), for a backward that
 * skips a forward's work. The state fits the plan that wrote it (or one of
 * the same config): read by a plan of another routing or loss config, of
 * the same size, it gives wrong gradients, unchecked. The saved forward
 * writes, where routing asks for them, the aux losses' values, counts and
 * dropped (the rest of the routing stays in saved: routing's logits, ids,
 * weights and offsets must be NULL). The gradients are
 * those of smelt_moe_backward_run, bit for bit; x and the weights must be
 * the forward's. y is smelt_moe_forward_run's, bit for bit with SwiGLU; the
 * MLP's saved forward rounds its pre-activation to x's dtype (as it keeps
 * it) before the activation, which the plain forward applies in the GEMM's
 * epilogue, so there y agrees within that rounding. saved is only read by the backward, so it serves any
 * number of them. The CPU backend keeps nothing (0 bytes) and recomputes. */
SMELT_API smelt_status smelt_moe_saved_bytes(smelt_plan *plan, int64_t *bytes);
/* The same count without a plan, for a config, T tokens of x_dtype and a
 * device kind (a framework sizing the state before it has data, e.g. in
 * torch's fake-tensor tracing). */
SMELT_API smelt_status smelt_moe_saved_bytes_for(const smelt_moe_config *cfg, int64_t tokens, smelt_dtype x_dtype,
                                                 smelt_device_kind device, int64_t *bytes);
SMELT_API smelt_status smelt_moe_forward_save_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *x,
                                                  const smelt_tensor *y, const smelt_tensor *saved,
                                                  const smelt_moe_routing *routing);
SMELT_API smelt_status smelt_moe_backward_saved_run(smelt_plan *plan, const smelt_moe_weights *w,
                                                    const smelt_tensor *x, const smelt_tensor *dy,
                                                    const smelt_tensor *saved, const smelt_moe_grads *grads);
/* One-shot calls: plan, run, destroy. */
SMELT_API smelt_status smelt_moe_forward(smelt_ctx *ctx, const smelt_moe_config *cfg, const smelt_moe_weights *w,
                                         const smelt_tensor *x, const smelt_tensor *y, const smelt_moe_routing *routing,
                                         smelt_moe_stats *stats);
SMELT_API smelt_status smelt_moe_backward(smelt_ctx *ctx, const smelt_moe_config *cfg, const smelt_moe_weights *w,
                                          const smelt_tensor *x, const smelt_tensor *dy, const smelt_moe_grads *grads);

/* ---------------------------------------------------------------- the parts */

/* Router: logits, selection, weights, capacity, counts, offsets, aux losses. */
SMELT_API smelt_status smelt_moe_route_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *x,
                                           const smelt_moe_routing *routing);
/* Aux losses of logits [T, E]: aux [2] = {L_lb, L_z}; dlogits [T, E] (optional)
 * = their gradient. The selection counts come from the routing of logits. */
SMELT_API smelt_status smelt_moe_aux_losses_run(smelt_plan *plan, const smelt_moe_weights *w,
                                                const smelt_tensor *logits, const smelt_tensor *aux,
                                                const smelt_tensor *dlogits);
/* Router backward: dlogits [T, E] = the gradient through scores, top-k,
 * renormalization and scaling of the routing weights' gradient dweights [T, k]
 * (entries of dropped assignments ignored), plus the aux losses' gradients.
 * The routing is recomputed from logits (the forward's output). */
SMELT_API smelt_status smelt_moe_route_backward_run(smelt_plan *plan, const smelt_moe_weights *w,
                                                    const smelt_tensor *logits, const smelt_tensor *dweights,
                                                    const smelt_tensor *dlogits);
/* xp [T·k, d] = x's rows in expert-major order; row_map [T, k] i32 (-1 where
 * ids is -1). ids [T, k] and offsets [E+1] as the router wrote them. */
SMELT_API smelt_status smelt_moe_permute_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *ids,
                                             const smelt_tensor *offsets, const smelt_tensor *xp,
                                             const smelt_tensor *row_map);
/* dx [T, d] = Σ_i dxp[row_map[t, i]] over the kept assignments, slot order. */
SMELT_API smelt_status smelt_moe_permute_backward_run(smelt_plan *plan, const smelt_tensor *dxp,
                                                      const smelt_tensor *row_map, const smelt_tensor *dx);
/* y [T, d] = Σ_i weights[t, i] · yp[row_map[t, i]], slot order, f32 or wider. */
SMELT_API smelt_status smelt_moe_unpermute_run(smelt_plan *plan, const smelt_tensor *yp, const smelt_tensor *row_map,
                                               const smelt_tensor *weights, const smelt_tensor *y);
/* dyp [T·k, d]: row row_map[t, i] = weights[t, i] · dy[t]; dweights [T, k]
 * (optional) = dy[t] · yp[row_map[t, i]] (0 where dropped). */
SMELT_API smelt_status smelt_moe_unpermute_backward_run(smelt_plan *plan, const smelt_tensor *dy,
                                                        const smelt_tensor *yp, const smelt_tensor *row_map,
                                                        const smelt_tensor *weights, const smelt_tensor *dyp,
                                                        const smelt_tensor *dweights);
/* yp [T·k, d] = FFN_e(xp) on each expert's rows [offsets[e], offsets[e+1]). */
SMELT_API smelt_status smelt_moe_ffn_run(smelt_plan *plan, const smelt_moe_weights *w, const smelt_tensor *xp,
                                         const smelt_tensor *offsets, const smelt_tensor *yp);
/* The FFN's gradients from dyp [T·k, d]: grads->dx is dxp [T·k, d]; dw1, dw3,
 * dw2, db1 (dwr and dwnoise must be NULL). Intermediates are recomputed from xp. */
SMELT_API smelt_status smelt_moe_ffn_backward_run(smelt_plan *plan, const smelt_moe_weights *w,
                                                  const smelt_tensor *xp, const smelt_tensor *offsets,
                                                  const smelt_tensor *dyp, const smelt_moe_grads *grads);

/* Statistics from counts [E] and dropped [1] (optional) of a routing by
 * this plan; reads them on the host (on CUDA it waits for the stream). */
SMELT_API smelt_status smelt_moe_stats_get(smelt_plan *plan, const smelt_tensor *counts, const smelt_tensor *dropped,
                                           smelt_moe_stats *out);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_MOE_H */
