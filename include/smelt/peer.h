/* smelt PEER: product-key expert retrieval over up to millions of singleton
 * experts (Mixture of A Million Experts, He 2024), with a hierarchical expert
 * store for expert tables larger than the GPU's memory.
 *
 * What is computed (../shared/SEMANTICS.md, PEER), per token t and head h:
 *   q      = x[t] · Wq + bq                       [h, dq], split per head
 *   qn     = norm(q[h])                           none | layernorm | batchnorm (running stats) | L2
 *   qn_i   = qn[i·dq/p : (i+1)·dq/p]              p chunks, one per product-key dim
 *   Cn_i   = C_i, or C_i with L2-normalized rows  [n_i, dq/p] (or one table per head)
 *   s_i    = qn_i · Cn_iᵀ                         [n_i]
 *   ids    = the k experts e = (a_1, ..., a_p) (mixed radix: e = ((a_1·n_2 + a_2)·n_3 + a_3)...)
 *            with the largest score Σ_i s_i[a_i]; equal scores rank by lower id
 *   g      = softmax over the k scores | sigmoid | relu
 *   y[t]   = Σ_h Σ_{e ∈ ids} g_e · act(x[t] · U_e) · V_e     U_e [d_in, h_e], V_e [h_e, d_out]
 *
 * Selection is computed pairwise, which is exact: the top-k of each s_i is
 * taken, dims 1 and 2 are combined (the k·k sums, id a·n_2 + b) keeping the
 * top-k, that list is combined with dim 3 the same way, and so on. A
 * combination in the global top-k has every prefix in the prefix's top-k
 * (k better prefixes would give k better full combinations, ties included,
 * because ids order lexicographically), so this equals the exhaustive top-k
 * over all N combinations for finite scores. Non-finite scores rank like
 * smelt_topk (NaN above +inf).
 *
 * Layouts. x, y, dy, dx: [T, d] rows with unit column stride (any row
 * stride). ids [T, h, k] i64 and scores [T, h, k] f32: contiguous. Wq
 * [d_in, h·dq] and bq [h·dq]: any non-negative strides. Everything else (norm params,
 * sub-keys, U, V and their gradients): contiguous.
 *
 * dtypes. x, y, dy, dx, Wq, bq, norm params, sub-keys, U and V: f32, f16 or
 * bf16, each independently (U and V share one), plus f64 on the CPU backend
 * (for gradient checks). Math is f32 on the GPU (f64 on the CPU reference),
 * whatever the storage type.
 *
 * CUDA limits (planning fails with UNSUPPORTED otherwise): k <= 32,
 * query_dim / product_key_dims <= 256, num_heads <= 65535, no f64, and
 * expert_hidden_size a power of two, at most 32 or, when expert rows allow
 * 16-byte loads (input_dim and output_dim multiples of 16 bytes of weights,
 * 16-byte aligned tables), at most 32 * (16 / weight dtype size).
 */
#ifndef SMELT_PEER_H
#define SMELT_PEER_H

#include "../smelt.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SMELT_PEER_MAX_DIMS 4

typedef enum smelt_peer_norm {
  SMELT_PEER_NORM_NONE = 0,
  SMELT_PEER_NORM_LAYERNORM, /* (q - mean) / sqrt(var + eps) · weight + bias over dq (biased var) */
  SMELT_PEER_NORM_BATCHNORM, /* inference: (q - running_mean) / sqrt(running_var + eps) · weight + bias */
  SMELT_PEER_NORM_L2,        /* q / max(||q||, l2_eps) over dq */
  SMELT_PEER_NORM_COUNT
} smelt_peer_norm;

typedef enum smelt_peer_gate {
  SMELT_PEER_GATE_SOFTMAX = 0, /* softmax over the k scores of a head */
  SMELT_PEER_GATE_SIGMOID,     /* 1 / (1 + exp(-s)) each */
  SMELT_PEER_GATE_RELU,        /* max(s, 0) each */
  SMELT_PEER_GATE_COUNT
} smelt_peer_gate;

/* ---------------------------------------------------------------- kernel choices (CUDA) */

/* For comparing the CUDA variants on a device: AUTO (0) is the selector's
 * pick; a choice that cannot run on the device, the config or the planned
 * tensors is rejected by smelt_peer_plan (UNSUPPORTED, naming the
 * condition). All choices give the same results bit for bit but where
 * noted. smelt_plan_describe says what a plan runs. The CPU backend
 * ignores them. */
typedef enum smelt_peer_route_kernel {
  SMELT_PEER_ROUTE_AUTO = 0, /* wg where it applies, else reg */
  SMELT_PEER_ROUTE_REG,      /* scores on mma.sync in two passes (peer_route_reg); its buffered form for
                                dq/p > 128 (peer_route_buf), its lists of 32 for k > 16 (peer_route32_pre) */
  SMELT_PEER_ROUTE_WG,       /* reg with the scores on wgmma: sm_90a, k <= 16, 112 < dq/p <= 128, bf16 sub-keys
                                without key_l2_norm; the same ids as reg's but at near-ties */
  SMELT_PEER_ROUTE_COUNT
} smelt_peer_route_kernel;

typedef enum smelt_peer_expert_kernel {
  SMELT_PEER_EXPERT_AUTO = 0, /* bulk where it fits, else warp where it fits, else rows */
  SMELT_PEER_EXPERT_BULK,     /* the forward persistent with TMA bulk copies (sm_90), the backward as warp's */
  SMELT_PEER_EXPERT_WARP,     /* warp-streamed: 16-byte expert rows, h_e <= 16 / weight size, d_in * h_e and
                                 d_out <= 128 loads of 16 bytes, two slots a warp in half an SM's shared memory */
  SMELT_PEER_EXPERT_ROWS,     /* rounds of staged uses: any shape the plan takes */
  SMELT_PEER_EXPERT_COUNT
} smelt_peer_expert_kernel;

typedef enum smelt_peer_overlap {
  SMELT_PEER_OVERLAP_AUTO = 0, /* beside where it applies, else after */
  SMELT_PEER_OVERLAP_BESIDE,   /* the forward's expert kernel shares the SMs with the routing (sm_90, expert
                                  kernel bulk with room for its 8-warp form, routing reg or wg with k <= 16 and
                                  dq/p <= 128, dense expert tables) */
  SMELT_PEER_OVERLAP_AFTER,    /* the expert kernel after the routing */
  SMELT_PEER_OVERLAP_COUNT
} smelt_peer_overlap;

typedef enum smelt_peer_projection {
  SMELT_PEER_PROJECTION_AUTO = 0, /* fused where it applies and the expert kernel has its 8-warp form, else gemm */
  SMELT_PEER_PROJECTION_FUSED,    /* x Wq inside the routing: routing wg, bf16 x, Wq and sub-keys, p 2, no query
                                     norm, dq/p 128, d_in a multiple of 64, a Hopper GEMM for Wq's K-major copy,
                                     x 16-byte aligned with rows of whole 16-byte vectors and bq unit-stride; the
                                     ids agree with gemm's but at near-ties */
  SMELT_PEER_PROJECTION_GEMM,     /* x Wq by the GEMM engine before the routing */
  SMELT_PEER_PROJECTION_COUNT
} smelt_peer_projection;

typedef struct smelt_peer_kernels {
  smelt_peer_route_kernel route;
  smelt_peer_expert_kernel expert;
  smelt_peer_overlap overlap;
  smelt_peer_projection projection;
  int head_groups; /* beside the experts, a token block's heads are routed in this many groups, 1 or 2 (2 needs
                      an even num_heads); 0 = auto (2 where h is even) */
} smelt_peer_kernels;

typedef struct smelt_peer_config {
  int64_t input_dim;           /* d_in */
  int64_t output_dim;          /* d_out */
  int64_t num_experts;         /* N = Π sub_key_sizes */
  int64_t num_experts_per_tok; /* k, per head: 1 <= k <= N */
  int64_t num_heads;           /* h */
  int64_t expert_hidden_size;  /* h_e (1: singleton MLPs) */
  int64_t query_dim;           /* dq, a multiple of product_key_dims */
  int product_key_dims;        /* p, 2..SMELT_PEER_MAX_DIMS */
  /* n_i; all 0 = each N^(1/p), which must then be a whole number */
  int64_t sub_key_sizes[SMELT_PEER_MAX_DIMS];
  smelt_act activation;        /* SMELT_ACT_GELU (exact erf form) or SMELT_ACT_RELU */
  smelt_peer_norm query_norm;
  double norm_eps;             /* layernorm / batchnorm epsilon (default 1e-5) */
  double l2_eps;               /* L2 normalization floor (default 1e-12, as torch F.normalize) */
  int key_l2_norm;             /* L2-normalize every sub-key row before scoring */
  int per_head_keys;           /* one sub-key table per head ([h, n_i, dq/p]) instead of shared */
  smelt_peer_gate gate;
  smelt_peer_kernels kernels;  /* CUDA kernel choices (all AUTO by default) */
} smelt_peer_config;

/* k 16, 8 heads, h_e 1, p 2, GELU, no query norm, softmax gates, eps
 * defaults, every kernel choice AUTO; the dims (input_dim, output_dim, num_experts, query_dim) are 0
 * and must be set. */
SMELT_API smelt_peer_config smelt_peer_config_default(void);

/* ---------------------------------------------------------------- the expert store */

/* A hierarchical expert store: the full U and V tables in host memory
 * (CUDA: pinned and mapped into the device's address space, or managed
 * memory on request) and an HBM cache of hot experts.
 *
 * Every forward (and prefetch) batch is one round of a batch CLOCK policy
 * over the batch's distinct experts:
 *   1. a distinct expert resident in the cache is a hit: its slot's
 *      reference bit is set and the slot is pinned for the batch;
 *   2. the misses, in ascending id order, each take the slot under the
 *      CLOCK hand: the hand skips pinned slots, clears set reference bits,
 *      and stops at the first unpinned slot with a clear bit (a free slot
 *      counts as one); the expert is copied there from host, its bit is set
 *      and the slot pinned; replacing a resident expert is an eviction;
 *   3. when every slot is pinned, the remaining misses are not admitted and
 *      the kernels read them through the host mapping.
 * So the policy is exactly sequential CLOCK with pinning (the GPU runs it in
 * parallel with prefix sums; the CPU backend runs it sequentially), and
 * results are bit-identical whether an expert was read from a slot or from
 * host: the same kernel does the same arithmetic on the same bytes.
 * Per-expert heat counters count every use. The backward pass reads experts
 * through the store without changing it. */
typedef struct smelt_peer_store smelt_peer_store;

typedef struct smelt_peer_store_options {
  int64_t num_experts, input_dim, output_dim, expert_hidden_size;
  smelt_dtype dtype;      /* f32, f16 or bf16 (f64 too on the CPU backend) */
  double cache_mb;        /* HBM cache size in MiB (default 1024); 0 = no cache, every expert is read
                             through the mapping; a cache too small for one expert is an error */
  int use_managed_memory; /* host tables in managed memory instead of pinned mapped memory */
  int use_env;            /* SMELT_PEER_HBM_CACHE_MB and SMELT_PEER_USE_MANAGED_MEMORY override the two
                             fields above (default 1) */
} smelt_peer_store_options;

SMELT_API smelt_peer_store_options smelt_peer_store_options_default(void);
/* Allocates the host tables (zeroed) and the cache. OUT_OF_MEMORY names the
 * allocation and its size. The store belongs to ctx and is used on its
 * stream; destroy it before the context. Like its context it is used by one
 * thread at a time (smelt.h); a store call, or a forward's batch of the
 * policy, that starts while another thread is inside the store fails with
 * INVALID_ARGUMENT ("used from two threads at once") and changes nothing. */
SMELT_API smelt_status smelt_peer_store_create(smelt_ctx *ctx, const smelt_peer_store_options *opts,
                                               smelt_peer_store **out);
SMELT_API void smelt_peer_store_destroy(smelt_peer_store *store); /* NULL is a no-op */
/* Host views of the full tables: u [N, d_in, h_e], v [N, h_e, d_out] (device
 * CPU). Writing through them is allowed while no kernel of the context runs;
 * call smelt_peer_store_invalidate afterwards so no stale copy stays cached. */
SMELT_API smelt_status smelt_peer_store_tables(smelt_peer_store *store, smelt_tensor *u, smelt_tensor *v);
/* Copies `count` experts from host memory (u_rows [count, d_in, h_e] and
 * v_rows [count, h_e, d_out], contiguous, the store's dtype) into the tables
 * from expert `first` on, and refreshes any cached copy. Synchronous. */
SMELT_API smelt_status smelt_peer_store_write(smelt_peer_store *store, int64_t first, int64_t count,
                                              const void *u_rows, const void *v_rows);
/* Empties the cache (no statistics change); synchronous. */
SMELT_API smelt_status smelt_peer_store_invalidate(smelt_peer_store *store);
/* One batch of the policy for ids (any shape, i64, on the context's device),
 * as a forward would run it, without computing anything else: warms the
 * cache, and lets tests drive the policy with chosen id sequences. */
SMELT_API smelt_status smelt_peer_store_prefetch(smelt_peer_store *store, const smelt_tensor *ids);

typedef struct smelt_peer_store_stats {
  uint64_t batches;        /* forward and prefetch batches */
  uint64_t lookups;        /* distinct experts per batch, summed */
  uint64_t hits;           /* lookups resident at the batch's start */
  uint64_t misses;         /* lookups - hits */
  uint64_t evictions;      /* admissions that replaced a resident expert */
  uint64_t uses;           /* expert uses (ids entries), summed */
  uint64_t uses_mapped;    /* uses read through the host mapping (misses not admitted) */
  uint64_t bytes_staged;   /* host -> cache slot copies */
  uint64_t bytes_mapped;   /* read by kernels through the mapping */
  uint64_t bytes_from_host;/* bytes_staged + bytes_mapped */
  int64_t slots;           /* cache capacity in experts */
  int64_t resident;        /* experts in the cache now */
  double hit_rate;         /* hits / lookups (0 before any lookup) */
} smelt_peer_store_stats;

/* Waits for the context's stream, then reads the counters. */
SMELT_API smelt_status smelt_peer_store_stats_get(smelt_peer_store *store, smelt_peer_store_stats *out);
SMELT_API smelt_status smelt_peer_store_stats_reset(smelt_peer_store *store);
/* A few human-readable lines (memory kind, sizes, counters, hit rate) into
 * buf (always NUL-terminated when n > 0). */
SMELT_API smelt_status smelt_peer_store_report(smelt_peer_store *store, char *buf, size_t n);
/* Heat counters (uses since creation) of experts [first, first + count) into
 * the host array out. */
SMELT_API smelt_status smelt_peer_store_heat(smelt_peer_store *store, int64_t first, int64_t count,
                                             uint64_t *out);

/* ---------------------------------------------------------------- weights and gradients */

/* The parameters, as tensors on the context's device (NULL = absent).
 *   wq          [d_in, h·dq]              required
 *   bq          [h·dq]                    optional (0)
 *   norm_weight [dq] or [h, dq]           layernorm / batchnorm scale, optional (1)
 *   norm_bias   [dq] or [h, dq]           layernorm / batchnorm shift, optional (0)
 *   bn_mean     [dq] or [h, dq]           batchnorm running mean, required for batchnorm
 *   bn_var      [dq] or [h, dq]           batchnorm running variance, required for batchnorm
 *   sub_keys[i] [n_i, dq/p], or [h, n_i, dq/p] with per_head_keys; i < p
 *   u, v        [N, d_in, h_e], [N, h_e, d_out]: the experts; or NULL both and `store` */
typedef struct smelt_peer_weights {
  const smelt_tensor *wq, *bq;
  const smelt_tensor *norm_weight, *norm_bias, *bn_mean, *bn_var;
  const smelt_tensor *sub_keys[SMELT_PEER_MAX_DIMS];
  const smelt_tensor *u, *v;
  smelt_peer_store *store;
} smelt_peer_weights;

/* Gradient outputs, each optional (NULL = not computed), shaped like what
 * they differentiate; all overwritten (du and dv are dense: rows of experts
 * no token used are zero). The backward is deterministic: every gradient
 * element is summed in a fixed order (sorted segment reductions, no
 * floating-point atomics). du and dv are not available with a store.
 *
 * Sparse expert gradients, for tables too large to differentiate densely
 * (and with a store): the M distinct experts of ids, ascending, and only
 * their rows, each bit-identical to the dense gradient's row.
 *   grad_ids   [T·h·k] i64: the M experts, then -1 in the remaining entries
 *   grad_count [1] i64: M (optional)
 *   du_rows    [T·h·k, d_in, h_e]: row r = dU of grad_ids[r], r < M
 *   dv_rows    [T·h·k, h_e, d_out]: row r = dV of grad_ids[r], r < M
 * Rows r >= M of du_rows and dv_rows are zeros (as the dense gradient's
 * rows of unused experts). du_rows and dv_rows need grad_ids. On CUDA, ids
 * outside [0, N) are left out of the M. */
typedef struct smelt_peer_grads {
  const smelt_tensor *dx, *dwq, *dbq;
  const smelt_tensor *dnorm_weight, *dnorm_bias; /* layernorm / batchnorm only */
  const smelt_tensor *dsub_keys[SMELT_PEER_MAX_DIMS];
  const smelt_tensor *du, *dv;
  const smelt_tensor *grad_ids, *grad_count, *du_rows, *dv_rows;
} smelt_peer_grads;

/* ---------------------------------------------------------------- plan and run */

/* A plan for one config, one set of weight layouts and one x layout
 * [T, d_in]; it serves retrieval, forward and backward runs. Runs must bind
 * weights and x of the planned dtypes, shapes and strides (data pointers
 * may change) and the same store. */
SMELT_API smelt_status smelt_peer_plan(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                       const smelt_tensor *x, smelt_plan **out);

/* Retrieval only: ids [T, h, k] i64 and their scores [T, h, k] f32 (the sums
 * Σ_i s_i before gating), best first. */
SMELT_API smelt_status smelt_peer_retrieve_run(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                               const smelt_tensor *ids, const smelt_tensor *scores);
/* y [T, d_out]; ids and scores optional (keep ids for the backward). */
SMELT_API smelt_status smelt_peer_forward_run(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                              const smelt_tensor *y, const smelt_tensor *ids,
                                              const smelt_tensor *scores);
/* Gradients of sum(y ∘ dy) for the experts in ids (the forward's ids
 * output; scores and gates are recomputed from them, the selection itself
 * is not differentiated). Ids outside [0, N) are rejected on the CPU and
 * contribute nothing on CUDA. */
SMELT_API smelt_status smelt_peer_backward_run(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                               const smelt_tensor *ids, const smelt_tensor *dy,
                                               const smelt_peer_grads *grads);

/* One-shot calls: plan, run, destroy. */
SMELT_API smelt_status smelt_peer_retrieve(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                           const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *scores);
SMELT_API smelt_status smelt_peer_forward(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                          const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *ids,
                                          const smelt_tensor *scores);
SMELT_API smelt_status smelt_peer_backward(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                           const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *dy,
                                           const smelt_peer_grads *grads);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_PEER_H */
