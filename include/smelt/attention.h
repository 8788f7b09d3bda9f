/* smelt attention: scaled dot-product attention with FlashAttention-2
 * semantics (the definitions are in SEMANTICS.md, "Attention").
 *
 *   S = scale · q · kᵀ    P = softmax(S) row-wise over the visible keys    O = P · v
 *   LSE = logsumexp of each row of S over the visible keys (natural log, f32)
 *
 * Shapes (row-major indices; any non-negative strides, but unit stride along D):
 *   batched   q [B, Sq, H, D]   k, v [B, Sk, Hk, D]   o [B, Sq, H, D]   lse [B, H, Sq]
 *   varlen    q [Tq, H, D]      k, v [Tk, Hk, D]      o [Tq, H, D]      lse [H, Tq]
 *             cu_seqlens_q, cu_seqlens_k: i32 [B + 1], in the context's device
 *             memory. Sequence b holds rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1
 *             of q (and likewise of k and v); each of its lengths may be 0.
 * GQA / MQA: H must be a multiple of Hk; query head h reads kv head h / (H / Hk).
 * Gradients have the shapes of what they are the gradient of:
 *   dq like q, dk and dv like k; d_o like o.
 *
 * Masking (per sequence, with Sq and Sk its lengths): query i sees key j iff
 *   j >= i + Sk - Sq - window_left   (when window_left  >= 0)
 *   j <= i + Sk - Sq + window_right  (when window_right >= 0)
 *   j <= i + Sk - Sq                 (when causal)
 * so causal is aligned to the bottom-right corner (the last query sees every
 * key). causal with a window is the intersection of the two masks (a right
 * window > 0 then changes nothing, as in FlashAttention). A query row that
 * sees no key gets O = 0 and LSE = +inf (sinks or not); its gradients are 0.
 * Rows are never rejected for length: any Sq, Sk >= 0.
 *
 * Score modifiers (desc fields; each off by default), applied to the scaled
 * score s = scale · q_i · k_j of a visible (i, j), in this order:
 *   softcap c > 0   s <- c · tanh(s / c)
 *   alibi_slopes    s <- s - slope[h] · |i + Sk - Sq - j|   (FlashAttention's
 *                   convention: the distance to query i's bottom-right diagonal)
 * and then masked. sinks (one logit σ[h] per query head) join every row's
 * softmax denominator without a value:
 *   LSE = log(Σ_visible j exp(s_j) + exp(σ[h])),   P_j = exp(s_j - LSE),   O = Σ_j P_j v_j
 * so the rows' weights sum to 1 - exp(σ[h] - LSE).
 * Backward with modifiers: dS = P ∘ (dP - D) as below, times ds/du =
 * 1 - (s / c)² with softcap (u the scaled score before the cap);
 * the slopes get no gradient. dsinks (when given) receives
 *   dsinks[h] = -Σ_rows i exp(σ[h] - LSE_i) · D_i,   D_i = Σ_d dO_i ∘ O_i,
 * summed over every sequence's rows of head h (the derivation is in
 * docs/API.md). slopes, sinks and dsinks are f32 [H], contiguous, in the
 * context's memory; a plan keeps the views it was made with: its runs read
 * (and write) the memory they named at plan time.
 *
 * Element types: q, k, v, o (and d_o, dq, dk, dv) share one dtype: f16 or
 * bf16 on CUDA (f32 accumulation); f32 and f64 as well on the CPU, whose
 * reference computes everything in double. lse is always f32.
 *
 * CUDA: head dims 64, 96, 128 and 256 forward, 64, 96 and 128 backward;
 * compute capability 8.0 or newer; q, k, v, o, d_o, dq, dk, dv 16-byte
 * aligned (pointers and every stride but the unit one); B and H at most
 * 65535. The backward for D 96 and 128 needs 145 KiB of shared memory per
 * block (A100, H100; not sm_86/sm_89). Hopper (sm_90a) runs a TMA + wgmma
 * forward for head dims 64 and 128. The CPU takes any D >= 1. The score
 * modifiers run on every CUDA kernel (softcap with tanh.approx, 2^-11
 * relative).
 *
 * varlen on CUDA: cu_seqlens stay on the device and are not validated there
 * (FlashAttention's contract); they must start at 0, never decrease, end at
 * Tq (Tk), and no sequence may be longer than the desc's max_seqlen_q (_k).
 * Violations cannot reach memory outside the tensors but give wrong
 * results. The CPU backend checks them and fails with INVALID_ARGUMENT.
 *
 * Backward: from q, k, v, o, d_o and lse (the forward's outputs) it computes
 *   Dᵢ = rowsum(d_o ∘ o), P = exp(S - LSE), dv = Pᵀ d_o, dP = d_o vᵀ,
 *   dS = P ∘ (dP - D), dq = scale · dS k, dk = scale · dSᵀ q,
 * dk and dv summed over the query heads of each kv head's group. dq's
 * partial sums meet in an f32 workspace (from the context's pool); by
 * default they are added with atomics, whose order varies from run to run in
 * the last bits. The deterministic mode (desc.deterministic, or the
 * context's smelt_ctx_set_deterministic) adds them in a fixed order: the
 * gradients are then bitwise repeatable, at some cost in speed.
 *
 * Outputs must not overlap any input or each other; inputs may share memory
 * (q, k and v as views of one packed qkv tensor, for instance).
 */
#ifndef SMELT_ATTENTION_H
#define SMELT_ATTENTION_H

#include "../smelt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How the Hopper forward (D 64 and 128 on cc 9.0) spreads query tiles over
 * CTAs. Every schedule gives the same bits; they differ in speed only. */
typedef enum smelt_attention_schedule {
  SMELT_ATTENTION_SCHEDULE_AUTO = 0,   /* as measured on H100: PERSISTENT without a right window, TILES with one */
  SMELT_ATTENTION_SCHEDULE_TILES,      /* one CTA per query tile, longest first */
  SMELT_ATTENTION_SCHEDULE_PERSISTENT, /* one CTA per SM walking the tiles in a static stride */
  SMELT_ATTENTION_SCHEDULE_DYNAMIC,    /* one CTA per SM taking tiles from a per-launch counter */
  SMELT_ATTENTION_SCHEDULE_COUNT
} smelt_attention_schedule;

typedef struct smelt_attention_desc {
  float scale;            /* softmax scale; 0 = 1/sqrt(D). Any other finite value. */
  int causal;             /* bottom-right aligned causal mask (window_right becomes 0) */
  int64_t window_left;    /* keys left of the diagonal a query sees; -1 = unbounded */
  int64_t window_right;   /* keys right of the diagonal; -1 = unbounded; with causal: intersected */
  int64_t max_seqlen_q;   /* varlen: at least the longest query sequence (ignored when batched) */
  int64_t max_seqlen_k;   /* varlen: at least the longest key sequence */
  int deterministic;      /* backward: bitwise-repeatable gradients (the context can ask too) */
  smelt_attention_schedule fwd_schedule; /* forward on Hopper; AUTO (0) = the measured choice */
  float softcap;          /* > 0: scores capped to softcap · tanh(s / softcap); 0 = none */
  const smelt_tensor *alibi_slopes; /* f32 [H]: ALiBi's slope per query head; NULL = none */
  const smelt_tensor *sinks;        /* f32 [H]: a sink logit per query head; NULL = none */
  const smelt_tensor *dsinks;       /* backward, with sinks: f32 [H] out, their gradient; NULL = not wanted */
} smelt_attention_desc;

/* scale 0 (1/sqrt(D)), not causal, windows -1 (unbounded), max_seqlen 0,
 * not deterministic, schedule AUTO, no modifier. Start from this: a zeroed desc has windows of 0, which
 * lets each query see only the key on its diagonal. */
SMELT_API smelt_attention_desc smelt_attention_desc_default(void);

/* ---------------------------------------------------------------- forward */

/* desc may be NULL (the defaults). lse may be NULL when it is not wanted. */
SMELT_API smelt_status smelt_attention_fwd_plan(smelt_ctx *ctx, const smelt_attention_desc *desc,
                                                const smelt_tensor *q, const smelt_tensor *k, const smelt_tensor *v,
                                                const smelt_tensor *o, const smelt_tensor *lse, smelt_plan **out);
SMELT_API smelt_status smelt_attention_fwd_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k,
                                               const smelt_tensor *v, const smelt_tensor *o, const smelt_tensor *lse);
SMELT_API smelt_status smelt_attention_fwd(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                           const smelt_tensor *k, const smelt_tensor *v, const smelt_tensor *o,
                                           const smelt_tensor *lse);

/* Packed sequences: B = cu_seqlens_q.shape[0] - 1; the desc's max_seqlen_q
 * and max_seqlen_k are required (they size the GPU grid). */
SMELT_API smelt_status smelt_attention_varlen_fwd_plan(smelt_ctx *ctx, const smelt_attention_desc *desc,
                                                       const smelt_tensor *q, const smelt_tensor *k,
                                                       const smelt_tensor *v, const smelt_tensor *cu_seqlens_q,
                                                       const smelt_tensor *cu_seqlens_k, const smelt_tensor *o,
                                                       const smelt_tensor *lse, smelt_plan **out);
SMELT_API smelt_status smelt_attention_varlen_fwd_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k,
                                                      const smelt_tensor *v, const smelt_tensor *cu_seqlens_q,
                                                      const smelt_tensor *cu_seqlens_k, const smelt_tensor *o,
                                                      const smelt_tensor *lse);
SMELT_API smelt_status smelt_attention_varlen_fwd(smelt_ctx *ctx, const smelt_attention_desc *desc,
                                                  const smelt_tensor *q, const smelt_tensor *k, const smelt_tensor *v,
                                                  const smelt_tensor *cu_seqlens_q, const smelt_tensor *cu_seqlens_k,
                                                  const smelt_tensor *o, const smelt_tensor *lse);

/* ---------------------------------------------------------------- backward */

/* o and lse are the forward's outputs for the same q, k, v and desc; d_o is
 * the gradient of the loss with respect to o. All arguments are required
 * but desc (NULL = the defaults). */
SMELT_API smelt_status smelt_attention_bwd_plan(smelt_ctx *ctx, const smelt_attention_desc *desc,
                                                const smelt_tensor *q, const smelt_tensor *k, const smelt_tensor *v,
                                                const smelt_tensor *o, const smelt_tensor *d_o,
                                                const smelt_tensor *lse, const smelt_tensor *dq,
                                                const smelt_tensor *dk, const smelt_tensor *dv, smelt_plan **out);
SMELT_API smelt_status smelt_attention_bwd_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k,
                                               const smelt_tensor *v, const smelt_tensor *o, const smelt_tensor *d_o,
                                               const smelt_tensor *lse, const smelt_tensor *dq,
                                               const smelt_tensor *dk, const smelt_tensor *dv);
SMELT_API smelt_status smelt_attention_bwd(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                           const smelt_tensor *k, const smelt_tensor *v, const smelt_tensor *o,
                                           const smelt_tensor *d_o, const smelt_tensor *lse, const smelt_tensor *dq,
                                           const smelt_tensor *dk, const smelt_tensor *dv);

SMELT_API smelt_status smelt_attention_varlen_bwd_plan(smelt_ctx *ctx, const smelt_attention_desc *desc,
                                                       const smelt_tensor *q, const smelt_tensor *k,
                                                       const smelt_tensor *v, const smelt_tensor *cu_seqlens_q,
                                                       const smelt_tensor *cu_seqlens_k, const smelt_tensor *o,
                                                       const smelt_tensor *d_o, const smelt_tensor *lse,
                                                       const smelt_tensor *dq, const smelt_tensor *dk,
                                                       const smelt_tensor *dv, smelt_plan **out);
SMELT_API smelt_status smelt_attention_varlen_bwd_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k,
                                                      const smelt_tensor *v, const smelt_tensor *cu_seqlens_q,
                                                      const smelt_tensor *cu_seqlens_k, const smelt_tensor *o,
                                                      const smelt_tensor *d_o, const smelt_tensor *lse,
                                                      const smelt_tensor *dq, const smelt_tensor *dk,
                                                      const smelt_tensor *dv);
SMELT_API smelt_status smelt_attention_varlen_bwd(smelt_ctx *ctx, const smelt_attention_desc *desc,
                                                  const smelt_tensor *q, const smelt_tensor *k, const smelt_tensor *v,
                                                  const smelt_tensor *cu_seqlens_q, const smelt_tensor *cu_seqlens_k,
                                                  const smelt_tensor *o, const smelt_tensor *d_o,
                                                  const smelt_tensor *lse, const smelt_tensor *dq,
                                                  const smelt_tensor *dk, const smelt_tensor *dv);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_ATTENTION_H */
