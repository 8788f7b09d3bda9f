/* PEER routing: query normalization, sub-key scores, per-dim top-k, the
 * pairwise candidate combination, the final top-k and the gates, fused in
 * one kernel per chunk of 64 token rows of one head (peer_route); and the
 * backward's routing kernels: scores and gates of given ids (peer_rescore),
 * gates -> scores -> normalized query -> query (peer_route_bwd), and the
 * sub-key gradients as a sorted segment reduction (peer_dkeys).
 *
 * peer_route, per CTA (256 threads, rows t0..t0+63 of head h):
 *   1. each warp normalizes 8 query rows in place in the f32 workspace the
 *      projection GEMM wrote (the rows belong to this CTA alone);
 *   2. per product-key dim i: the rows' slice of dq/p values goes to shared
 *      memory split into two bf16 parts (hi = bf16(q), lo = bf16(q - hi)),
 *      then tiles of 64 sub-keys (L2-normalized on load when asked, split
 *      the same way) are scored on tensor cores (mma.sync m16n8k16, f32
 *      accumulators): hi·hi + lo·hi + hi·lo, which is q·k to ~2^-16
 *      relative (the lo·lo term is below that) and exact whenever q and k
 *      have at most 16 significant bits, as with the tests' exact data; the
 *      hi·lo product is skipped for bf16 keys without L2 normalization
 *      (their lo part is zero). The mma order is fixed, so runs repeat bit
 *      for bit. Each warp then merges its 8 rows' scores of the 64x64 tile
 *      into per-row top-k lists held in registers, lane j holding the j-th
 *      best (score, id) packed in a u64 whose order is the ranking (score,
 *      then lower id): a candidate above the list's k-th entry is inserted
 *      with one ballot and one shuffle;
 *   3. the dim's list is combined with the running list of dims 0..i-1:
 *      all len x k sums, id = prefix * n_i + a, offered to a fresh list
 *      (smelt/peer.h explains why this pairwise top-k is exact);
 *   4. gates over each row's final k entries; ids, scores, gates written.
 * Shared memory: the hi and lo parts of the query slice and of the key
 * tile (64 x DS bf16 each, DS = dsub rounded up to 16, plus 8 so that the
 * fragment loads hit 32 distinct banks), the 64x65 score tile, and the
 * running lists (64 x 32 x 8 bytes).
 *
 * 2·T·h·n·dq FLOP of scores (17 GFLOP for 4096 tokens, 8 heads, 1024²
 * experts, dq 256) take ~0.5 ms on the SIMT f32 units and tens of
 * microseconds on tensor cores, three products each included. */
#include "peer_common.cuh"
#include "smelt_mma.cuh"

#define ROWS 64
#define KT 64
#define STS (KT + 1)
#define NT 256
#define NWARPS (NT / 32)
#define RPW (ROWS / NWARPS) /* rows per warp */

/* ---------------------------------------------------------------- helpers */

/* Normalizes the query row of head hh in place: a warp, lanes striding dq. */
static __device__ void normalize_row(const peer_route_params &P, float *row, i64 hh, int lane) {
  const i64 dq = P.dq;
  if (P.norm == NORM_NONE) return;
  if (P.norm == NORM_L2) {
    float ss = 0.f;
    for (i64 c = lane; c < dq; c += 32) ss += row[c] * row[c];
    const float s = 1.f / fmaxf(sqrtf(smelt_warp_sum(ss)), P.l2_eps);
    for (i64 c = lane; c < dq; c += 32) row[c] *= s;
    return;
  }
  const i64 po = hh * P.param_hs;
  if (P.norm == NORM_LAYERNORM) {
    float m = 0.f, v = 0.f;
    for (i64 c = lane; c < dq; c += 32) m += row[c];
    m = smelt_warp_sum(m) / (float)dq;
    for (i64 c = lane; c < dq; c += 32) v += (row[c] - m) * (row[c] - m);
    const float rstd = rsqrtf(smelt_warp_sum(v) / (float)dq + P.norm_eps);
    for (i64 c = lane; c < dq; c += 32) {
      const float w = P.norm_w ? peer_ld(P.norm_w, po + c, P.param_dt) : 1.f;
      const float b = P.norm_b ? peer_ld(P.norm_b, po + c, P.param_dt) : 0.f;
      row[c] = (row[c] - m) * rstd * w + b;
    }
    return;
  }
  for (i64 c = lane; c < dq; c += 32) { /* batchnorm with running statistics */
    const float rs = rsqrtf(peer_ld(P.bn_var, po + c, P.param_dt) + P.norm_eps);
    const float w = P.norm_w ? peer_ld(P.norm_w, po + c, P.param_dt) : 1.f;
    const float b = P.norm_b ? peer_ld(P.norm_b, po + c, P.param_dt) : 0.f;
    row[c] = (row[c] - peer_ld(P.bn_mean, po + c, P.param_dt)) * rs * w + b;
  }
}

/* v = hi + lo + O(2^-16 |v|), both bf16; lo = 0 for non-finite hi. */
static __device__ __forceinline__ void split_bf16(float v, smelt_h16 *hi, smelt_h16 *lo) {
  const smelt_h16 h = smelt_f32_to_bf16(v);
  const float hv = smelt_bf16_to_f32(h);
  *hi = h;
  *lo = smelt_f32_to_bf16(isfinite(hv) ? v - hv : 0.f);
}

/* The 32-bit word of two bf16 at row r, column c (even) of a [.][DS] array. */
static __device__ __forceinline__ u32 w32(const smelt_h16 *a, int ds, int r, int c) {
  return *(const u32 *)&a[r * ds + c];
}

/* Inserts cand (warp-uniform, not in the list, above its k-th entry) into
 * the descending list whose j-th entry lane j holds; lanes >= k hold 0. */
static __device__ __forceinline__ void list_insert(u64 &mine, u64 cand, int k, int lane) {
  const int pos = __popc(__ballot_sync(PEER_FULL, mine > cand));
  const u64 up = __shfl_up_sync(PEER_FULL, mine, 1);
  if (lane == pos) mine = cand;
  else if (lane > pos) mine = up;
  if (lane >= k) mine = 0;
}

/* Every lane offers one candidate (0 = none); those above the list's k-th
 * entry go in, in lane order (the result does not depend on the order). */
static __device__ __forceinline__ void list_offer(u64 &mine, u64 cand, int k, int lane) {
  u64 thr = __shfl_sync(PEER_FULL, mine, k - 1);
  unsigned m = __ballot_sync(PEER_FULL, cand > thr);
  while (m) {
    const int src = __ffs(m) - 1;
    m &= m - 1;
    const u64 c = __shfl_sync(PEER_FULL, cand, src);
    if (c > thr) {
      list_insert(mine, c, k, lane);
      thr = __shfl_sync(PEER_FULL, mine, k - 1);
    }
  }
}

/* Gates of a row's scores, lane j holding score j (lanes >= k: on = 0). */
static __device__ __forceinline__ float gate_of(int gate, float s, bool on) {
  if (gate == GATE_SOFTMAX) {
    const float m = smelt_warp_max(on ? s : PEER_NEG_INF);
    const float e = on ? expf(s - m) : 0.f;
    return e / smelt_warp_sum(e);
  }
  return gate == GATE_SIGMOID ? 1.f / (1.f + expf(-s)) : fmaxf(s, 0.f);
}

/* ---------------------------------------------------------------- peer_route */

extern "C" __global__ void __launch_bounds__(NT) peer_route(peer_route_params P) {
  extern __shared__ __align__(16) float smem[];
  const i64 dsub = P.dsub;
  const int dpad = (int)((dsub + 15) & ~(i64)15), DS = dpad + 8;
  float *st = smem;                           /* [ROWS][STS]: the tile's scores */
  float *lv = st + ROWS * STS;                /* [ROWS][PEER_MAX_K]: running list, scores */
  u32 *li = (u32 *)(lv + ROWS * PEER_MAX_K);  /* [ROWS][PEER_MAX_K]: running list, ids */
  smelt_h16 *qh = (smelt_h16 *)(li + ROWS * PEER_MAX_K); /* [ROWS][DS]: this dim's query slice, hi part */
  smelt_h16 *ql = qh + ROWS * DS;             /* lo part */
  smelt_h16 *kh = ql + ROWS * DS;             /* [KT][DS]: a tile of sub-keys, hi part */
  smelt_h16 *kl = kh + KT * DS;               /* lo part */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;     /* mma fragment coordinates */
  const int rm = (warp >> 1) * 16, cn = (warp & 1) * 32; /* the warp's 16 rows x 32 keys of the tile */
  const i64 t0 = (i64)blockIdx.x * ROWS, hh = blockIdx.y;
  const i64 hd = P.h * P.dq;
  const int k = (int)P.k;
  const int key_lo = P.key_l2 || P.key_dt != SMELT_DT_BF16; /* keys not exact in bf16 */
  float *q = (float *)P.q;

  for (int r = warp; r < ROWS; r += NWARPS)
    if (t0 + r < P.T) normalize_row(P, q + (t0 + r) * hd + hh * P.dq, hh, lane);

  i64 len = 0; /* entries of the running list (min(k, n_0 * ... * n_i)) */
  for (int i = 0; i < P.p; i++) {
    const i64 ni = P.n[i];
    const int ki = (int)(ni < P.k ? ni : P.k);
    __syncthreads(); /* the normalized rows are visible; the previous dim's readers of qh, ql are done */
    for (int x = tid; x < ROWS * dpad; x += NT) {
      const int r = x / dpad, d = x - r * dpad;
      const i64 t = t0 + r;
      const float v = t < P.T && d < dsub ? q[t * hd + hh * P.dq + i * dsub + d] : 0.f;
      split_bf16(v, &qh[r * DS + d], &ql[r * DS + d]);
    }
    u64 list[RPW];
#pragma unroll
    for (int j = 0; j < RPW; j++) list[j] = 0;
    const i64 kbase = hh * P.key_hs[i];
    for (i64 c0 = 0; c0 < ni; c0 += KT) {
      __syncthreads(); /* the last tile's scores were merged (and qh, ql are written) */
      for (int c = warp; c < KT; c += NWARPS) {
        const i64 a = c0 + c;
        float v[PEER_MAX_DSUB / 32], ss = 0.f;
#pragma unroll
        for (int m = 0; m < PEER_MAX_DSUB / 32; m++) {
          const i64 d = lane + 32 * m;
          v[m] = a < ni && d < dsub ? peer_ld(P.keys[i], kbase + a * dsub + d, P.key_dt) : 0.f;
          ss += v[m] * v[m];
        }
        const float sc = P.key_l2 ? 1.f / fmaxf(sqrtf(smelt_warp_sum(ss)), P.l2_eps) : 1.f;
#pragma unroll
        for (int m = 0; m < PEER_MAX_DSUB / 32; m++) {
          const int d = lane + 32 * m;
          if (d < dpad) split_bf16(P.key_l2 ? v[m] * sc : v[m], &kh[c * DS + d], &kl[c * DS + d]);
        }
      }
      __syncthreads();
      {
        float acc[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
          for (int e = 0; e < 4; e++) acc[nt][e] = 0.f;
        for (int k0 = 0; k0 < dpad; k0 += 16) {
          const int ca = k0 + 2 * tq;
          const u32 ah[4] = {w32(qh, DS, rm + g, ca), w32(qh, DS, rm + g + 8, ca), w32(qh, DS, rm + g, ca + 8),
                             w32(qh, DS, rm + g + 8, ca + 8)};
          const u32 al[4] = {w32(ql, DS, rm + g, ca), w32(ql, DS, rm + g + 8, ca), w32(ql, DS, rm + g, ca + 8),
                             w32(ql, DS, rm + g + 8, ca + 8)};
#pragma unroll
          for (int nt = 0; nt < 4; nt++) {
            const int key = cn + nt * 8 + g;
            const u32 bh[2] = {w32(kh, DS, key, ca), w32(kh, DS, key, ca + 8)};
            mma_16816_bf16(acc[nt], ah, bh);
            mma_16816_bf16(acc[nt], al, bh);
            if (key_lo) {
              const u32 bl[2] = {w32(kl, DS, key, ca), w32(kl, DS, key, ca + 8)};
              mma_16816_bf16(acc[nt], ah, bl);
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
          const int col = cn + nt * 8 + 2 * tq;
          st[(rm + g) * STS + col] = acc[nt][0];
          st[(rm + g) * STS + col + 1] = acc[nt][1];
          st[(rm + g + 8) * STS + col] = acc[nt][2];
          st[(rm + g + 8) * STS + col + 1] = acc[nt][3];
        }
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < RPW; j++) {
        const int r = warp * RPW + j;
        const i64 a0 = c0 + lane, a1 = c0 + lane + 32;
        list_offer(list[j], a0 < ni ? peer_pack(st[r * STS + lane], (u32)a0) : 0ull, ki, lane);
        list_offer(list[j], a1 < ni ? peer_pack(st[r * STS + lane + 32], (u32)a1) : 0ull, ki, lane);
      }
    }
    /* combine with the running list; each warp touches only its own rows */
    if (i == 0) {
#pragma unroll
      for (int j = 0; j < RPW; j++) {
        const int r = warp * RPW + j;
        if (lane < ki) {
          lv[r * PEER_MAX_K + lane] = peer_packed_value(list[j]);
          li[r * PEER_MAX_K + lane] = peer_packed_id(list[j]);
        }
      }
      len = ki;
      continue;
    }
    const i64 total = len * ki;
    const int kk = (int)(total < P.k ? total : P.k);
#pragma unroll
    for (int j = 0; j < RPW; j++) {
      const int r = warp * RPW + j;
      u64 fresh = 0;
      for (i64 c0 = 0; c0 < total; c0 += 32) {
        const i64 c = c0 + lane;
        const int a = (int)c / ki, b = (int)c - a * ki;
        const u64 kb = __shfl_sync(PEER_FULL, list[j], (int)(c < total ? b : 0));
        u64 cand = 0;
        if (c < total)
          cand = peer_pack(lv[r * PEER_MAX_K + a] + peer_packed_value(kb),
                           li[r * PEER_MAX_K + a] * (u32)ni + peer_packed_id(kb));
        list_offer(fresh, cand, kk, lane);
      }
      __syncwarp();
      if (lane < kk) {
        lv[r * PEER_MAX_K + lane] = peer_packed_value(fresh);
        li[r * PEER_MAX_K + lane] = peer_packed_id(fresh);
      }
    }
    len = kk;
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < RPW; j++) {
    const int r = warp * RPW + j;
    const i64 t = t0 + r;
    if (t >= P.T) continue;
    const bool on = lane < k;
    const float s = on ? lv[r * PEER_MAX_K + lane] : 0.f;
    const float g = gate_of(P.gate, s, on);
    if (!on) continue;
    const i64 o = (t * P.h + hh) * P.k + lane;
    ((i64 *)P.ids)[o] = (i64)li[r * PEER_MAX_K + lane];
    if (P.scores) ((float *)P.scores)[o] = s;
    if (P.gates) ((float *)P.gates)[o] = g;
  }
}

/* ---------------------------------------------------------------- backward */

#define RB_WARPS 8 /* rows (warps) per CTA of the per-row kernels */

/* Expert e's digit in dim i (e = ((a_0 n_1 + a_1) n_2 + a_2)...), computed
 * alone so no per-dim array needs local memory. */
static __device__ __forceinline__ i64 digit_of(const peer_route_params &P, i64 e, int i) {
  for (int j = P.p - 1; j > i; j--) e /= P.n[j];
  return e % P.n[i];
}

/* Scores and gates of the given ids; the normalized queries to P.qn. A
 * warp per (token, head) row. Ids outside [0, N) score -inf: gate 0, no
 * gradient. */
extern "C" __global__ void __launch_bounds__(NT, 2) peer_rescore(peer_route_params P) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 row = (i64)blockIdx.x * RB_WARPS + warp;
  if (row >= P.T * P.h) return;
  const i64 t = row / P.h, hh = row - t * P.h, dq = P.dq;
  float *qn = (float *)P.qn + row * dq;
  const float *q = (const float *)P.q + t * P.h * dq + hh * dq;
  for (i64 c = lane; c < dq; c += 32) qn[c] = q[c];
  __syncwarp();
  normalize_row(P, qn, hh, lane);
  __syncwarp();
  /* lane j < k finds use j's key rows (the divisions once per lane) */
  const i64 e_mine = lane < P.k ? ((const i64 *)P.ids)[row * P.k + lane] : -1;
  const int ok_mine = e_mine >= 0 && e_mine < P.N;
  i64 kb_mine[PEER_MAX_DIMS];
#pragma unroll
  for (int i = 0; i < PEER_MAX_DIMS; i++)
    kb_mine[i] = ok_mine && i < P.p ? hh * P.key_hs[i] + digit_of(P, e_mine, i) * P.dsub : 0;
  float mine = 0.f;
  for (int j = 0; j < P.k; j++) {
    float s = PEER_NEG_INF;
    if (__shfl_sync(PEER_FULL, ok_mine, j)) {
      s = 0.f;
#pragma unroll
      for (int i = 0; i < PEER_MAX_DIMS; i++) {
        const i64 kb = __shfl_sync(PEER_FULL, kb_mine[i], j);
        if (i >= P.p) continue;
        float dot = 0.f, ss = 0.f;
        for (i64 d = lane; d < P.dsub; d += 32) {
          const float kv = peer_ld(P.keys[i], kb + d, P.key_dt);
          dot += qn[i * P.dsub + d] * kv;
          ss += kv * kv;
        }
        dot = smelt_warp_sum(dot);
        s += P.key_l2 ? dot / fmaxf(sqrtf(smelt_warp_sum(ss)), P.l2_eps) : dot;
      }
    }
    if (lane == j) mine = s;
  }
  const bool on = lane < P.k;
  const float g = gate_of(P.gate, mine, on);
  if (on) {
    ((float *)P.scores)[row * P.k + lane] = mine;
    ((float *)P.gates)[row * P.k + lane] = g;
  }
}

/* d q at flat index i: f32 for the column sums, and rounded to the GEMMs'
 * 16-bit operand dtype when asked (the dx and dWq GEMMs then run on tensor
 * cores instead of mixing f32 with 16-bit operands on the SIMT path). */
static __device__ __forceinline__ void put_dq(const peer_route_params &P, i64 i, float v) {
  ((float *)P.dqo)[i] = v;
  if (P.dq16) peer_st(P.dq16, i, P.dq16_dt, v);
}

/* d gate -> d score (P.ds), -> d normalized query -> d query (P.dq), plus
 * the per-row terms of the norm parameters' gradients. A warp per row;
 * shared memory per warp: dqn [dq], digits [32][4] and key scales [32][4]. */
extern "C" __global__ void __launch_bounds__(NT, 2) peer_route_bwd(peer_route_params P) {
  extern __shared__ __align__(16) float sm[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 dq = P.dq, dsub = P.dsub;
  float *dqn = sm + warp * dq;
  i64 *dig = (i64 *)(sm + RB_WARPS * dq) + warp * PEER_MAX_K * PEER_MAX_DIMS;
  float *ksc = (float *)((i64 *)(sm + RB_WARPS * dq) + RB_WARPS * PEER_MAX_K * PEER_MAX_DIMS) +
               warp * PEER_MAX_K * PEER_MAX_DIMS;
  const i64 row = (i64)blockIdx.x * RB_WARPS + warp;
  if (row >= P.T * P.h) return;
  const i64 t = row / P.h, hh = row - t * P.h;
  const bool on = lane < P.k;
  const i64 o = row * P.k + lane;
  const float s = on ? ((const float *)P.scores)[o] : 0.f;
  const float g = on ? ((const float *)P.gates)[o] : 0.f;
  const float dg = on ? ((const float *)P.dg)[o] : 0.f;
  const i64 e = on ? ((const i64 *)P.ids)[o] : -1;
  const bool valid = on && e >= 0 && e < P.N;
  float ds;
  if (P.gate == GATE_SOFTMAX) ds = g * (dg - smelt_warp_sum(g * dg));
  else if (P.gate == GATE_SIGMOID) ds = dg * g * (1.f - g);
  else ds = s > 0.f ? dg : 0.f;
  if (!valid) ds = 0.f;
  if (on) ((float *)P.ds)[o] = ds;
  if (on)
    for (int i = 0; i < P.p; i++) dig[lane * PEER_MAX_DIMS + i] = digit_of(P, valid ? e : 0, i);
  for (i64 c = lane; c < dq; c += 32) dqn[c] = 0.f;
  __syncwarp();
  for (int j = 0; j < P.k; j++)
    for (int i = 0; i < P.p; i++) {
      float sc = 1.f;
      if (P.key_l2) {
        const i64 kb = hh * P.key_hs[i] + dig[j * PEER_MAX_DIMS + i] * dsub;
        float ss = 0.f;
        for (i64 d = lane; d < dsub; d += 32) {
          const float kv = peer_ld(P.keys[i], kb + d, P.key_dt);
          ss += kv * kv;
        }
        sc = 1.f / fmaxf(sqrtf(smelt_warp_sum(ss)), P.l2_eps);
      }
      if (lane == 0) ksc[j * PEER_MAX_DIMS + i] = sc;
    }
  __syncwarp();
  for (int j = 0; j < P.k; j++) {
    const float dsj = __shfl_sync(PEER_FULL, ds, j);
    if (dsj == 0.f) continue; /* warp-uniform */
    for (int i = 0; i < P.p; i++) {
      const i64 kb = hh * P.key_hs[i] + dig[j * PEER_MAX_DIMS + i] * dsub;
      const float sc = ksc[j * PEER_MAX_DIMS + i];
      for (i64 d = lane; d < dsub; d += 32) dqn[i * dsub + d] += dsj * peer_ld(P.keys[i], kb + d, P.key_dt) * sc;
    }
  }
  __syncwarp();
  /* through the query normalization */
  const float *q = (const float *)P.q + t * P.h * dq + hh * dq;
  const float *qn = (const float *)P.qn + row * dq;
  const i64 qo = t * P.h * dq + hh * dq;
  float *pg = P.pgamma ? (float *)P.pgamma + row * dq : 0;
  float *pb = P.pbeta ? (float *)P.pbeta + row * dq : 0;
  const i64 po = hh * P.param_hs;
  if (P.norm == NORM_NONE) {
    for (i64 c = lane; c < dq; c += 32) put_dq(P, qo + c, dqn[c]);
  } else if (P.norm == NORM_L2) {
    float ss = 0.f, dot = 0.f;
    for (i64 c = lane; c < dq; c += 32) {
      ss += q[c] * q[c];
      dot += qn[c] * dqn[c];
    }
    const float nrm = sqrtf(smelt_warp_sum(ss));
    dot = smelt_warp_sum(dot);
    for (i64 c = lane; c < dq; c += 32) put_dq(P, qo + c, nrm > P.l2_eps ? (dqn[c] - qn[c] * dot) / nrm : dqn[c] / P.l2_eps);
  } else if (P.norm == NORM_LAYERNORM) {
    float m = 0.f, v = 0.f;
    for (i64 c = lane; c < dq; c += 32) m += q[c];
    m = smelt_warp_sum(m) / (float)dq;
    for (i64 c = lane; c < dq; c += 32) v += (q[c] - m) * (q[c] - m);
    const float rstd = rsqrtf(smelt_warp_sum(v) / (float)dq + P.norm_eps);
    float m1 = 0.f, m2 = 0.f;
    for (i64 c = lane; c < dq; c += 32) {
      const float xh = (q[c] - m) * rstd, w = P.norm_w ? peer_ld(P.norm_w, po + c, P.param_dt) : 1.f;
      m1 += dqn[c] * w;
      m2 += dqn[c] * w * xh;
    }
    m1 = smelt_warp_sum(m1) / (float)dq;
    m2 = smelt_warp_sum(m2) / (float)dq;
    for (i64 c = lane; c < dq; c += 32) {
      const float xh = (q[c] - m) * rstd, w = P.norm_w ? peer_ld(P.norm_w, po + c, P.param_dt) : 1.f;
      put_dq(P, qo + c, rstd * (dqn[c] * w - m1 - xh * m2));
      if (pg) pg[c] = dqn[c] * xh;
      if (pb) pb[c] = dqn[c];
    }
  } else {
    for (i64 c = lane; c < dq; c += 32) {
      const float rs = rsqrtf(peer_ld(P.bn_var, po + c, P.param_dt) + P.norm_eps);
      const float xh = (q[c] - peer_ld(P.bn_mean, po + c, P.param_dt)) * rs;
      const float w = P.norm_w ? peer_ld(P.norm_w, po + c, P.param_dt) : 1.f;
      put_dq(P, qo + c, dqn[c] * w * rs);
      if (pg) pg[c] = dqn[c] * xh;
      if (pb) pb[c] = dqn[c];
    }
  }
}

/* Sub-key gradients of dim `dim`, a CTA per key row (all nrows rows are
 * written, zeros where no use selected the row): the row's uses, a run of
 * the uses sorted by key row (bounds from peer_seg_bounds, use indices in
 * svals), are dealt to the warps in a fixed interleave (warp w takes the
 * run's positions w, w + 8, ...); each warp sums ds[use] qn[use's row,
 * slice] in its order and the warps' sums are added in warp order, so the
 * result is deterministic. Then through the key normalization. */
extern "C" __global__ void __launch_bounds__(NT)
    peer_dkeys(peer_route_params P, u64 bounds, u64 svals, int dim, i64 nrows, u64 dkey, int dkey_dt) {
  __shared__ float part[NWARPS][PEER_MAX_DSUB];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 key = blockIdx.x;
  if (key >= nrows) return;
  const u32 b0 = ((const u32 *)bounds)[2 * key], b1 = ((const u32 *)bounds)[2 * key + 1];
  const u32 *vals = (const u32 *)svals;
  const i64 dsub = P.dsub, dq = P.dq;
  float acc[PEER_MAX_DSUB / 32];
#pragma unroll
  for (int m = 0; m < PEER_MAX_DSUB / 32; m++) acc[m] = 0.f;
#pragma unroll 4
  for (u32 s = b0 + warp; s < b1; s += NWARPS) {
    const i64 use = vals[s], row = use / P.k;
    const float dsu = ((const float *)P.ds)[use];
    const float *qr = (const float *)P.qn + row * dq + dim * dsub;
#pragma unroll
    for (int m = 0; m < PEER_MAX_DSUB / 32; m++) {
      const i64 d = lane + 32 * m;
      if (d < dsub) acc[m] += dsu * qr[d];
    }
  }
#pragma unroll
  for (int m = 0; m < PEER_MAX_DSUB / 32; m++) part[warp][lane + 32 * m] = acc[m];
  __syncthreads();
  if (warp) return;
#pragma unroll
  for (int m = 0; m < PEER_MAX_DSUB / 32; m++) {
    acc[m] = part[0][lane + 32 * m];
    for (int w = 1; w < NWARPS; w++) acc[m] += part[w][lane + 32 * m];
  }
  float c[PEER_MAX_DSUB / 32], ss = 0.f, dot = 0.f;
  if (P.key_l2) {
#pragma unroll
    for (int m = 0; m < PEER_MAX_DSUB / 32; m++) {
      const i64 d = lane + 32 * m;
      c[m] = d < dsub ? peer_ld(P.keys[dim], key * dsub + d, P.key_dt) : 0.f;
      ss += c[m] * c[m];
    }
    const float nrm = sqrtf(smelt_warp_sum(ss)), div = fmaxf(nrm, P.l2_eps);
#pragma unroll
    for (int m = 0; m < PEER_MAX_DSUB / 32; m++) dot += c[m] / div * acc[m];
    dot = smelt_warp_sum(dot);
#pragma unroll
    for (int m = 0; m < PEER_MAX_DSUB / 32; m++)
      acc[m] = nrm > P.l2_eps ? (acc[m] - c[m] / div * dot) / nrm : acc[m] / P.l2_eps;
  }
#pragma unroll
  for (int m = 0; m < PEER_MAX_DSUB / 32; m++) {
    const i64 d = lane + 32 * m;
    if (d < dsub) peer_st(dkey, key * dsub + d, dkey_dt, acc[m]);
  }
}
