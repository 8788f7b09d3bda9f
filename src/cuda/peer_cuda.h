/* The CUDA PEER backend's internal interface: the launch parameter blocks
 * (host twins of the structs in kernels/peer_common.cuh, byte for byte),
 * the kernel sources and their shared-memory layouts, the plan's variant
 * (what the selector chose), and the helpers the selector, the forward,
 * the backward and the store share. */
#ifndef SMELT_PEER_CUDA_H
#define SMELT_PEER_CUDA_H

#include "../core/gemm_internal.h"
#include "../core/peer_internal.h"
#include "cuda_internal.h"

typedef struct smelt__peer_route_params {
  uint64_t q, keys[SMELT_PEER_MAX_DIMS], norm_w, norm_b, bn_mean, bn_var, ids, scores, gates, qn, dg, ds, dqo, pgamma,
      pbeta, dq16;
  int64_t T, h, dq, dsub, k, N, n[SMELT_PEER_MAX_DIMS], param_hs, key_hs[SMELT_PEER_MAX_DIMS];
  float norm_eps, l2_eps;
  int p, norm, key_l2, gate, key_dt, param_dt, dq16_dt, ready_groups, ready_round;
  uint64_t x, wt, bq;
  int64_t x_rs, din;
  int bq_dt, pad;
} smelt__peer_route_params;
_Static_assert(sizeof(smelt__peer_route_params) == 368, "smelt__peer_route_params must match peer_route_params");

typedef struct smelt__peer_expert_params {
  uint64_t x, y, dy, ids, gates, u_host, v_host, u_cache, v_cache, table, ua, udz, dg, dx;
  int64_t T, hk, din, dout, he, N, x_rs, y_rs, dy_rs, chunk;
  int x_dt, y_dt, dy_dt, act, groups_out, groups_in, he_shift, stage_uses;
  uint64_t ready;
  int ready_need, ready_shift, ready_groups, ready_gu;
} smelt__peer_expert_params;
_Static_assert(sizeof(smelt__peer_expert_params) == 248, "smelt__peer_expert_params must match peer_expert_params");

/* Module sources (the op's selector and the variant enumerator share them). */
void smelt__peer_route_src(smelt__kernel_src *src);
void smelt__peer_util_src(smelt__kernel_src *src);
/* vec: elements per 16-byte load, or 1 for scalar loads. */
void smelt__peer_expert_src(smelt_dtype wdt, int vec, smelt__kernel_src *src);

/* Kernel scan tiles (kernels/peer_util.cu). */
#define SMELT__PEER_TILE 1024
#define SMELT__PEER_SORT_TILE 4096
#define SMELT__PEER_CS_CHUNKS 32
#define SMELT__PEER_SCAN_TILE 1024 /* keys a block of the two-level scans (peer_util.cu's TILE) */

/* The util module's functions a caller needs. */
typedef struct smelt__peer_util {
  CUfunction scan, scan_sums, scan_add, sort_hist, sort_scatter, use_keys, seg_bounds, seg_heads, seg_compact, du, dv, colsum_partial,
      colsum_final, transpose16;
  CUfunction store_count, store_lookup, store_misses, store_slot_count, store_slot_rank, store_assign, store_finish;
} smelt__peer_util;
smelt_status smelt__peer_util_load(smelt_ctx *ctx, smelt__peer_util *u);

/* In-place exclusive scan of count u32 at data; the sum to *total (u64,
 * device) when total is not NULL. */
smelt_status smelt__peer_scan(smelt_ctx *ctx, const smelt__peer_util *u, void *data, int64_t count, void *total);

/* ---- shared-memory layouts */

/* The host sizes each kernel's dynamic shared memory from these; the
 * selector writes them into the modules' preludes (SMELT_PEER_SMEM_*),
 * where each kernel checks its own layout against them at compile time,
 * so the two sides cannot drift. Layouts whose size depends on the shape
 * carry their fixed part and their per-unit part. */
/* route_rows (peer_route_reg, _buf, 32_pre): the 64 x 65 f32 score tile and
 * the running lists (64 x 32 scores and ids), then per column of DS
 * (dq/p rounded up to 16, plus 8) the hi and lo bf16 parts of the query
 * slice's 64 rows and of the key tile's 64. */
#define SMELT__PEER_SMEM_ROUTE (4 * (64 * 65 + 64 * 32 * 2))
#define SMELT__PEER_SMEM_ROUTE_DS (2 * 4 * 64)
/* peer_route_wg: the score tile, lists of 16, then (1024-byte aligned) the
 * lo query slice and two stages of 128 key rows, 256 bytes each. */
#define SMELT__PEER_SMEM_ROUTE_WG (4 * (64 * 65 + 64 * 16 * 2) + 1024 + 64 * 256 + 2 * 128 * 256)
/* peer_route_bwd, per warp of 8: dq f32, then 32 x 4 digits (i64) and key scales (f32). */
#define SMELT__PEER_SMEM_RBWD_DQ (4 * 8)
#define SMELT__PEER_SMEM_RBWD (8 * 32 * 4 * 8 + 8 * 32 * 4 * 4)
/* The expert kernels: a use's two row pointers (the round and warp
 * kernels), the warp kernels' warps (a ring of slots each) and their
 * lanes' 16-byte chunks, and the bulk kernel's window of codes and gates a
 * warp and the 8-warp form's barriers. */
#define SMELT__PEER_SMEM_USE_PTRS 16
#define SMELT__PEER_WS_WARPS 8
#define SMELT__PEER_WS_CH 4
#define SMELT__PEER_SMEM_BULK_WIN (64 * 8)
#define SMELT__PEER_SMEM_BULK8_BARS (8 * 8 * 8)

/* ---- the plan's variant */

/* Everything a run launches, chosen once by the selector (peer_select.c)
 * from the problem, the device and cfg.kernels; smelt_plan_describe prints
 * it. A run whose pointers are aligned otherwise than planned takes the
 * variant the same selector gives for them (smelt__peer_variant_for). */
typedef struct smelt__peer_expert {
  smelt_peer_expert_kernel kind; /* BULK, WARP or ROWS */
  smelt_dtype wdt;               /* the weights' type */
  int vec;                       /* elements a load: 16 bytes' worth, or 1 (scalar) */
  int tc;                        /* BULK, the literal shape with 16-bit weights and x: the tensor-core forms */
  int64_t chunk;                 /* ROWS: uses a round; else h k */
  int64_t stage_uses;            /* WARP and BULK's backward: slots a warp */
  int gout, gin;                 /* ROWS: thread groups over the uses */
  int fwd_slots, fwd8_slots;     /* BULK: slots a warp of the 16-warp and the 8-warp forms (0: no 8-warp form) */
  unsigned fwd_smem, bwd_smem, fwd8_smem;
  int sm_smem;                   /* BULK: an SM's shared memory */
  CUfunction fwd, bwd, fwd8;     /* fwd, fwd8: the tensor-core forms when tc */
} smelt__peer_expert;

/* What a selection depends on beyond the plan: the pointers' alignment. */
typedef struct smelt__peer_facts {
  int wide;  /* the expert tables allow 16-byte loads */
  int x16;   /* x 16-byte aligned (the fused projection) */
  int x4;    /* x 4-byte aligned (the tensor-core expert forms) */
} smelt__peer_facts;

/* A routing launch: the kernel, its grid (256 threads a CTA) and dynamic
 * shared memory; split: a tile's two dims as two units. */
typedef struct smelt__peer_route_launch {
  const char *name;
  CUfunction f;
  unsigned grid[2], smem;
  int split;
} smelt__peer_route_launch;

typedef struct smelt__peer_variant {
  smelt__peer_facts facts;
  smelt_peer_route_kernel route;    /* REG or WG */
  smelt_peer_projection projection; /* FUSED or GEMM */
  smelt_peer_overlap overlap;       /* BESIDE or AFTER */
  int head_groups;                  /* BESIDE: 1 or 2; else 1 */
  int kmax;                         /* the routing reads the tables' largest key norms (reg and wg) */
  CUfunction prep;                  /* peer_split_keys, or peer_route_prep when fused */
  smelt__peer_route_launch fwd;     /* the forward's routing (beside the experts or not) */
  smelt__peer_route_launch alone;   /* the retrieval's (the forward's when after) */
  smelt__peer_expert ev;
  unsigned expert_grid, expert_block, expert_smem; /* the forward's expert launch */
  int expert_slots;                 /* its slots a warp (stage_uses) */
} smelt__peer_variant;

#define SMELT__PEER_MAX_VARIANTS 8 /* one per combination of facts */

/* The plan's CUDA state (smelt__peer_state.cuda). */
typedef struct smelt__peer_cuda {
  CUfunction rescore, route_bwd, dkeys;
  smelt__peer_util util;
  unsigned rbwd_smem;
  smelt_plan *gemm_q;     /* q = x Wq + bq; NULL when T = 0 */
  int wq_t;               /* gemm_q multiplies by a K-major copy of Wq */
  smelt_plan *gemm_dx, *gemm_dwq; /* the backward's dx += dq Wqᵀ and dWq = xᵀ dq (smelt__gemm_reuse) */
  /* by facts: the planned one and those runs' pointers asked for (fwd.name NULL until selected) */
  smelt__peer_variant v[SMELT__PEER_MAX_VARIANTS];
  int planned; /* v's index of the planned variant */
} smelt__peer_cuda;

/* The variant for a run's tensors: the planned one, or the selection for
 * pointers aligned otherwise (selected and loaded on first use); x NULL:
 * x's facts as planned (the backward, which reads only the expert
 * kernel). */
smelt_status smelt__peer_variant_for(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                     const smelt__peer_variant **out);

/* ---- run helpers (peer_fwd.c), shared by the forward and the backward */

/* One pool allocation carved into n (<= 32) regions of 256-byte aligned sizes. */
smelt_status smelt__peer_ws_alloc(smelt_ctx *ctx, const size_t *bytes, int n, void **base, void **regions);
/* An f32, i64 or 16-bit matrix at p. */
smelt_tensor smelt__peer_dev_tensor(const smelt_ctx *ctx, void *p, smelt_dtype dt, int64_t rows, int64_t cols);
void smelt__peer_fill_route(const smelt__peer_state *ps, const smelt_peer_weights *w, smelt__peer_route_params *P);
void smelt__peer_fill_expert(const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x,
                               const smelt__peer_expert *ev, smelt__peer_expert_params *P);
/* q = x Wq + bq into the f32 workspace q [T, h*dq]. */
smelt_status smelt__peer_project(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x, void *q);

/* ---- the runs (peer_fwd.c, peer_bwd.c): smelt__cuda_peer's run calls them
 * with validated tensors and the variant for them */
smelt_status smelt__cuda_peer_retrieve(smelt_plan *plan, const smelt__peer_variant *v, const smelt_peer_weights *w,
                                       const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *scores);
smelt_status smelt__cuda_peer_forward(smelt_plan *plan, const smelt__peer_variant *v, const smelt_peer_weights *w,
                                      const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *ids,
                                      const smelt_tensor *scores);
smelt_status smelt__cuda_peer_backward(smelt_plan *plan, const smelt__peer_variant *v, const smelt_peer_weights *w,
                                       const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *dy,
                                       const smelt_peer_grads *g);

#endif /* SMELT_PEER_CUDA_H */
