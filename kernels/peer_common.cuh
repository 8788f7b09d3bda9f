/* Device helpers shared by the PEER kernels (peer_route.cu, peer_expert.cu,
 * peer_util.cu): launch parameter blocks (twins of the host structs in
 * src/cuda/peer_cuda.h, byte for byte; both sides assert the sizes),
 * loads and stores of a run-time dtype, the activations, and warp
 * reductions.
 *
 * Only the expert weights' dtype is a compile-time parameter (it is the
 * stream that decides the speed); activations, parameters and gradients
 * are read and written through a dtype switch that is uniform across the
 * grid, so it costs a predictable branch, not a variant. */
#ifndef SMELT_PEER_COMMON_CUH
#define SMELT_PEER_COMMON_CUH

#include "smelt_device.cuh"

typedef unsigned char u8;

#define PEER_FULL 0xffffffffu
#define PEER_MAX_DIMS 4
#define PEER_MAX_K 32
#define PEER_MAX_DSUB 256 /* query_dim / product_key_dims */
#define PEER_NEG_INF __int_as_float(0xff800000)

/* The values of smelt_peer_norm and smelt_peer_gate (include/smelt/peer.h). */
#define NORM_NONE 0
#define NORM_LAYERNORM 1
#define NORM_BATCHNORM 2
#define NORM_L2 3
#define GATE_SOFTMAX 0
#define GATE_SIGMOID 1
#define GATE_RELU 2

/* Routing kernels (peer_route.cu). Pointers are device addresses, 0 = absent. */
typedef struct peer_route_params {
  u64 q;                    /* f32 [T, h*dq]: projected queries (peer_route normalizes them in place) */
  u64 keys[PEER_MAX_DIMS];  /* sub-key tables, key_dt */
  u64 norm_w, norm_b, bn_mean, bn_var; /* param_dt, [dq] or [h, dq] */
  u64 ids;                  /* i64 [T*h, k]: output of peer_route, input of the others */
  u64 scores, gates;        /* f32 [T*h, k] */
  u64 qn;                   /* f32 [T*h, dq]: normalized queries (rescore writes, backward reads) */
  u64 dg, ds;               /* f32 [T*h, k]: d loss / d gate, d loss / d score */
  u64 dqo;                  /* f32 [T, h*dq]: d loss / d q */
  u64 pgamma, pbeta;        /* f32 [T*h, dq]: per-row terms of the norm parameters' gradients */
  u64 dq16;                 /* dq16_dt [T, h*dq]: dqo rounded for the tensor-core GEMMs, 0 = not wanted */
  i64 T, h, dq, dsub, k, N;
  i64 n[PEER_MAX_DIMS];
  i64 param_hs;             /* head stride of the norm parameters: dq, or 0 when shared */
  i64 key_hs[PEER_MAX_DIMS];/* head stride of each sub-key table: n_i*dsub, or 0 when shared */
  float norm_eps, l2_eps;
  int p, norm, key_l2, gate, key_dt, param_dt, dq16_dt;
  int ready_groups;         /* beside the experts: a block's heads in this many groups, counted apart */
  int ready_round;          /* with groups > 1: blocks a round of the tile order (route_tile) */
  /* peer_route_wg_split_pj: q computed by each unit (q = 0) from x (bf16
   * [T, din] rows at x_rs), wt (bf16 [h*dq, din]: Wq's K-major copy) and
   * bq (bq_dt [h*dq], 0 = none) */
  u64 x, wt, bq;
  i64 x_rs, din;
  int bq_dt, pad;
} peer_route_params;
static_assert(sizeof(peer_route_params) == 368, "peer_route_params must match the host's smelt__peer_route_params");

/* Expert kernels (peer_expert.cu). */
typedef struct peer_expert_params {
  u64 x, y, dy;             /* [T, din], [T, dout], [T, dout] rows at x_rs, y_rs, dy_rs */
  u64 ids, gates;           /* i64 / f32 [T, hk] */
  u64 u_host, v_host;       /* the full tables [N, ...] (dense tensors or the store's mapped host tables) */
  u64 u_cache, v_cache;     /* the store's HBM slots [S, ...] */
  u64 table;                /* i32 [N]: slot of each expert, -1 = not cached; 0 = no cache */
  u64 ua, udz, dg;          /* backward: f32 [T*hk, he], [T*hk, he], [T*hk] */
  u64 dx;                   /* backward: f32 [T, din], 0 = not wanted */
  i64 T, hk, din, dout, he, N;
  i64 x_rs, y_rs, dy_rs;
  i64 chunk;                /* uses staged per round in shared memory */
  int x_dt, y_dt, dy_dt, act;
  int groups_out, groups_in;/* thread groups splitting the uses of the up (dout) and dx (din) phases */
  int he_shift, stage_uses;  /* log2(h_e); slots per warp of the warp-streamed kernels */
  u64 ready;                /* peer_expert_fwd_bulk beside the routing: i32 [T >> ready_shift][ready_groups] counters, 0 = none */
  int ready_need, ready_shift; /* a head group's ids and gates are written once its counter reaches ready_need */
  int ready_groups, ready_gu; /* a token's heads in groups of h / ready_groups, ready_gu uses each */
} peer_expert_params;
static_assert(sizeof(peer_expert_params) == 248, "peer_expert_params must match the host's smelt__peer_expert_params");

/* A value of run-time dtype dt (the smelt_dtype values: 1 f32, 2 f16, 3 bf16). */
static __device__ __forceinline__ float peer_ld(u64 base, i64 i, int dt) {
  if (dt == SMELT_DT_F32) return ((const float *)base)[i];
  const smelt_h16 h = ((const smelt_h16 *)base)[i];
  return dt == SMELT_DT_F16 ? smelt_f16_to_f32(h) : smelt_bf16_to_f32(h);
}

static __device__ __forceinline__ void peer_st(u64 base, i64 i, int dt, float v) {
  if (dt == SMELT_DT_F32) ((float *)base)[i] = v;
  else ((smelt_h16 *)base)[i] = dt == SMELT_DT_F16 ? smelt_f32_to_f16(v) : smelt_f32_to_bf16(v);
}

/* The activations of smelt_act the config allows, and their derivatives. */
static __device__ __forceinline__ float peer_act(int act, float z) {
  return act == ACT_RELU ? fmaxf(z, 0.f) : 0.5f * z * (1.f + erff(z * 0.70710678118654752f));
}
static __device__ __forceinline__ float peer_act_grad(int act, float z) {
  if (act == ACT_RELU) return z > 0.f ? 1.f : 0.f;
  return 0.5f * (1.f + erff(z * 0.70710678118654752f)) + z * 0.39894228040143268f * expf(-0.5f * z * z);
}

/* Order-preserving key of a float for "larger is better" ranking (NaN
 * highest, -0 == +0), as kernels/topk.cu; and its inverse. */
static __device__ __forceinline__ u32 peer_order_key(float f) {
  if (f != f) return 0xfffffffeu;
  const u32 u = f == 0.f ? 0u : __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
static __device__ __forceinline__ float peer_key_value(u32 k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* A candidate (score, id) packed so that a larger u64 ranks first: equal
 * scores order by lower id. 0 means "no candidate": every real one is
 * larger (the smallest order key, of -inf, is 0x007fffff). */
static __device__ __forceinline__ u64 peer_pack(float v, u32 id) { return ((u64)peer_order_key(v) << 32) | (u32)~id; }
static __device__ __forceinline__ float peer_packed_value(u64 c) { return peer_key_value((u32)(c >> 32)); }
static __device__ __forceinline__ u32 peer_packed_id(u64 c) { return ~(u32)c; }

/* ---------------------------------------------------------------- transpose */

#define PEER_TR_TILE 64
#define PEER_TR_NT 256 /* threads a block */

/* out[c * rows + r] = in[r * rs + c * cs] for a rows x cols matrix of
 * 16-bit elements (out contiguous, [cols][rows]): tile (bx, by) of
 * (ceil(cols / 64), ceil(rows / 64)), 256 threads (peer_transpose16, and
 * peer_route_prep beside the key split), through shared memory so that
 * reads and writes both run along rows (given row-major input), each
 * thread moving element pairs, as 4-byte words where the strides and
 * addresses allow (faster than the 32 x 32 tile of single elements it
 * replaced: docs/PERF.md, PEER: overlap and projection). */
static __device__ __forceinline__ void peer_transpose_tile(u64 in, i64 rows, i64 cols, i64 rs, i64 cs, u64 out, i64 bx,
                                                           i64 by) {
  __shared__ __align__(4) smelt_h16 tile[PEER_TR_TILE][PEER_TR_TILE + 2]; /* rows of 33 words: conflict-free pairs */
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const i64 c0 = bx * PEER_TR_TILE, r0 = by * PEER_TR_TILE, c = c0 + 2 * tx;
  const smelt_h16 *src = (const smelt_h16 *)in;
  smelt_h16 *dst = (smelt_h16 *)out;
  const bool win = cs == 1 && (rs & 1) == 0 && (cols & 1) == 0 && (in & 3) == 0, wout = (rows & 1) == 0 && (out & 3) == 0;
  if (win) { /* every load issued before the first store (a load per row in turn was slower) */
    u32 v[PEER_TR_TILE / (PEER_TR_NT / 32)];
#pragma unroll
    for (int i = 0; i < PEER_TR_TILE / (PEER_TR_NT / 32); i++) {
      const i64 r = r0 + ty + i * (PEER_TR_NT / 32);
      v[i] = r < rows && c < cols ? *(const u32 *)&src[r * rs + c] : 0u;
    }
#pragma unroll
    for (int i = 0; i < PEER_TR_TILE / (PEER_TR_NT / 32); i++) *(u32 *)&tile[ty + i * (PEER_TR_NT / 32)][2 * tx] = v[i];
  } else {
    for (int y = ty; y < PEER_TR_TILE && r0 + y < rows; y += PEER_TR_NT / 32) {
      const i64 r = r0 + y;
      if (c < cols) tile[y][2 * tx] = src[r * rs + c * cs];
      if (c + 1 < cols) tile[y][2 * tx + 1] = src[r * rs + (c + 1) * cs];
    }
  }
  __syncthreads();
  const i64 r = r0 + 2 * tx;
#pragma unroll
  for (int y = ty; y < PEER_TR_TILE; y += PEER_TR_NT / 32) {
    const i64 oc = c0 + y;
    if (oc >= cols) break;
    if (wout && r + 1 < rows) {
      *(u32 *)&dst[oc * rows + r] = (u32)tile[2 * tx][y] | (u32)tile[2 * tx + 1][y] << 16;
    } else {
      if (r < rows) dst[oc * rows + r] = tile[2 * tx][y];
      if (r + 1 < rows) dst[oc * rows + r + 1] = tile[2 * tx + 1][y];
    }
  }
}

#endif /* SMELT_PEER_COMMON_CUH */
