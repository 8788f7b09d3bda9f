/* The CUDA PEER backend's internal interface: the launch parameter blocks
 * (host twins of the structs in kernels/peer_common.cuh, byte for byte),
 * the kernel sources, and the sort and scan helpers the op and the store
 * share. */
#ifndef SMELT_PEER_CUDA_H
#define SMELT_PEER_CUDA_H

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

#endif /* SMELT_PEER_CUDA_H */
