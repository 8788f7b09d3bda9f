/* PEER routing: query normalization, sub-key scores, per-dim top-k, the
 * pairwise candidate combination, the final top-k and the gates, fused in
 * one kernel per chunk of 64 token rows of one head (route_rows: the
 * kernels peer_route_reg, _buf, _wg and peer_route32_pre, and the
 * persistent forms beside the expert kernel); and the backward's routing
 * kernels: scores and gates of given ids (peer_rescore), gates -> scores
 * -> normalized query -> query (peer_route_bwd), and the sub-key gradients
 * as a sorted segment reduction (peer_dkeys). src/cuda/peer_select.c
 * chooses among them.
 *
 * route_rows, per CTA (256 threads, rows t0..t0+63 of head h):
 *   1. each warp normalizes 8 query rows in place in the f32 workspace the
 *      projection GEMM wrote (the rows belong to this CTA alone);
 *   2. per product-key dim i: the rows' slice of dq/p values goes to shared
 *      memory split into two bf16 parts (hi = bf16(q), lo = bf16(q - hi)),
 *      then tiles of 64 sub-keys, split the same way once per call
 *      (peer_split_keys, L2-normalized first when asked) and copied by
 *      cp.async behind the previous tile's merge, are scored on tensor
 *      cores (mma.sync m16n8k16, f32 accumulators): hi·hi + lo·hi + hi·lo,
 *      which is q·k to ~2^-16 relative (the lo·lo term is below that) and
 *      exact whenever q and k have at most 16 significant bits, as with
 *      the tests' exact data; the hi·lo product is skipped for bf16 keys
 *      without L2 normalization (their lo part is zero). The mma order is
 *      fixed, so runs repeat bit for bit. Four threads per row then merge
 *      its 64 scores of the tile, 16 each, into lists of their 16 (k <= 16)
 *      or 32 best held in registers: a (score, id) packed in a u64 whose
 *      order is the ranking (score, then lower id), each candidate tested
 *      against the list's last entry and the few that beat it inserted
 *      (offer_filtered); after the dim's last tile the row's four lists are
 *      merged through shuffles (each thread ends with the row's list);
 *   3. the dim's list is combined with the running list of dims 0..i-1:
 *      all len x k sums, id = prefix * n_i + a, offered (a quarter of the
 *      prefixes per thread) to fresh lists merged by bitonic networks
 *      (smelt/peer.h explains why this pairwise top-k is exact);
 *   4. gates over each row's final k entries; ids, scores, gates written.
 * For k <= 16 the kernels score each dim twice, first for a per-row
 * threshold, then keeping only the scores at or above it (route_rows's THR
 * and REG); reg, the default where wg does not apply, is buf with an
 * approximate first pass, see route_rows. docs/PERF.md records the
 * variants that lost to these (the per-tile split with sorting-network
 * merges, one pass with filtered merges for k <= 16, thr's one-threshold
 * merge), since deleted.
 * Shared memory: the 64x65 score tile (which also holds the dim's lists
 * while they are combined), the running lists (64 x 32 x 8 bytes), and the
 * hi and lo parts of the query slice and of the key tile (64 x DS bf16
 * each, DS = dsub rounded up to 16, plus 8 so that the fragment loads hit
 * 32 distinct banks): SMELT_PEER_SMEM_ROUTE + DS SMELT_PEER_SMEM_ROUTE_DS
 * bytes, the host's size (src/cuda/peer_cuda.h), checked below.
 *
 * 2·T·h·n·dq FLOP of scores (17 GFLOP for 4096 tokens, 8 heads, 1024²
 * experts, dq 256) are compute-bound on the SIMT f32 units and a small
 * part of the forward on tensor cores, three products each included
 * (docs/PERF.md, PEER: floors). */
#include "peer_common.cuh"
#include "smelt_mma.cuh"

#define ROWS 64
/* the tile of a one-tile CTA: grid (token blocks, heads) */
#define TILE_T0 ((i64)blockIdx.x * ROWS)
#define TILE_H ((i64)blockIdx.y)
#define QB 8 /* query values a thread loads at once when splitting a dim's slice */
#define KT 64
#define STS (KT + 1)
#define NT 256
#define NWARPS (NT / 32)
/* route_rows's layout against the host's size (the prelude's, from
 * src/cuda/peer_cuda.h): the score tile and the lists, then per column of
 * DS the query slice's and the key tile's hi and lo rows. */
static_assert(sizeof(float) * (ROWS * STS + ROWS * PEER_MAX_K) + sizeof(u32) * ROWS * PEER_MAX_K == SMELT_PEER_SMEM_ROUTE,
              "route_rows's score tile and lists must take the host's SMELT_PEER_SMEM_ROUTE bytes");
static_assert(sizeof(smelt_h16) * (2 * ROWS + 2 * KT) == SMELT_PEER_SMEM_ROUTE_DS,
              "route_rows's query and key tiles must take the host's SMELT_PEER_SMEM_ROUTE_DS bytes a column");

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

/* split_bf16 of 4 values into hi[0..4), lo[0..4) (8-byte aligned). */
static __device__ __forceinline__ void split4_bf16(float4 v, smelt_h16 *hi, smelt_h16 *lo) {
  smelt_h16 h[4], l[4];
  split_bf16(v.x, &h[0], &l[0]);
  split_bf16(v.y, &h[1], &l[1]);
  split_bf16(v.z, &h[2], &l[2]);
  split_bf16(v.w, &h[3], &l[3]);
  *(uint2 *)hi = make_uint2(h[0] | (u32)h[1] << 16, h[2] | (u32)h[3] << 16);
  *(uint2 *)lo = make_uint2(l[0] | (u32)l[1] << 16, l[2] | (u32)l[3] << 16);
}

/* The sub-key row at element off of dim i's table (zeros when !in), L2-
 * normalized when asked, as bf16 hi and lo parts hi[0, dpad), lo[0, dpad)
 * (zero past dsub). A warp, lanes striding the row; route_rows's tiles and
 * peer_split_keys share it so that both routing variants see the same bits. */
static __device__ __forceinline__ void split_key_row(const peer_route_params &P, int i, i64 off, bool in, int dpad,
                                                     int lane, smelt_h16 *hi, smelt_h16 *lo) {
  float v[PEER_MAX_DSUB / 32], ss = 0.f;
#pragma unroll
  for (int m = 0; m < PEER_MAX_DSUB / 32; m++) {
    const i64 d = lane + 32 * m;
    v[m] = in && d < P.dsub ? peer_ld(P.keys[i], off + d, P.key_dt) : 0.f;
    ss += v[m] * v[m];
  }
  const float sc = P.key_l2 ? 1.f / fmaxf(sqrtf(smelt_warp_sum(ss)), P.l2_eps) : 1.f;
#pragma unroll
  for (int m = 0; m < PEER_MAX_DSUB / 32; m++) {
    const int d = lane + 32 * m;
    if (d < dpad) split_bf16(P.key_l2 ? v[m] * sc : v[m], &hi[d], &lo[d]);
  }
}

/* The 32-bit word of two bf16 at row r, column c (even) of a [.][DS] array. */
static __device__ __forceinline__ u32 w32(const smelt_h16 *a, int ds, int r, int c) {
  return *(const u32 *)&a[r * ds + c];
}

/* Lists of candidates as u64 arrays in registers, sorted descending by
 * bitonic networks (every index static once n is a literal). */
static __device__ __forceinline__ void cmp_swap(u64 *a, int i, int j) { /* a[i] >= a[j] after */
  const u64 x = a[i], y = a[j];
  a[i] = x > y ? x : y;
  a[j] = x > y ? y : x;
}

/* sort_desc##SUF (a bitonic sort of n entries, descending) and
 * merge_desc##SUF (a bitonic sequence of n sorted descending) over T with
 * the compare-exchange CMP (a[i] >= a[j] after), for the u64 candidates
 * and for plain floats. */
#define PEER_BITONIC(SUF, T, CMP)                                              \
  static __device__ __forceinline__ void sort_desc##SUF(T *a, int n) {         \
    _Pragma("unroll") for (int size = 2; size <= n; size <<= 1)                \
      _Pragma("unroll") for (int stride = size >> 1; stride > 0; stride >>= 1) \
        _Pragma("unroll") for (int i = 0; i < n; i++) {                        \
      const int j = i ^ stride;                                                \
      if (j > i) {                                                             \
        if ((i & size) == 0) CMP(a, i, j);                                     \
        else CMP(a, j, i);                                                     \
      }                                                                        \
    }                                                                          \
  }                                                                            \
  static __device__ __forceinline__ void merge_desc##SUF(T *a, int n) {        \
    _Pragma("unroll") for (int stride = n >> 1; stride > 0; stride >>= 1)      \
      _Pragma("unroll") for (int i = 0; i < n; i++) {                          \
      const int j = i ^ stride;                                                \
      if (j > i) CMP(a, i, j);                                                 \
    }                                                                          \
  }
PEER_BITONIC(, u64, cmp_swap)

/* L (kl, descending) becomes the kl best of L and the CN candidates c
 * (descending): max(L[i], c[kl-1-i]) is bitonic and holds them. */
#define CN 16 /* candidates per thread and step: a quarter of a 64-key tile row */
static __device__ __forceinline__ void merge_into(u64 *L, const u64 *c, int kl) {
#pragma unroll
  for (int i = 0; i < kl; i++) {
    const int j = kl - 1 - i;
    if (j < CN) L[i] = L[i] > c[j] ? L[i] : c[j];
  }
  merge_desc(L, kl);
}

/* Offers the CN candidates c (any order, 0 = none) to L. */
static __device__ __forceinline__ void offer(u64 *L, u64 *c, int kl) {
  u64 m = c[0];
#pragma unroll
  for (int j = 1; j < CN; j++) m = m > c[j] ? m : c[j];
  if (m <= L[kl - 1]) return;
  sort_desc(c, CN);
  merge_into(L, c, kl);
}

/* Lanes l and l ^ o end with the same list: the kl best of their two. */
static __device__ __forceinline__ void row_merge_step(u64 *L, int kl, int o) {
  u64 other[PEER_MAX_K];
#pragma unroll
  for (int i = 0; i < kl; i++) other[i] = __shfl_xor_sync(PEER_FULL, L[i], o);
#pragma unroll
  for (int i = 0; i < kl; i++) L[i] = L[i] > other[kl - 1 - i] ? L[i] : other[kl - 1 - i];
  merge_desc(L, kl);
}

/* The four threads of a row (lanes 4r..4r+3) end with the same list: the
 * kl best of their four. */
static __device__ __forceinline__ void row_merge(u64 *L, int kl) {
  row_merge_step(L, kl, 1);
  row_merge_step(L, kl, 2);
}

/* sort_desc, merge_desc and row_merge on plain floats, for REG's
 * thresholds (values without ids, no NaN among them): a compare-exchange
 * is fmaxf and fminf, 2 instructions against 6 for a u64 (two compares,
 * four selects), and a shuffle moves 4 bytes instead of 8. */
static __device__ __forceinline__ void cmp_swap_f(float *a, int i, int j) {
  const float x = a[i], y = a[j];
  a[i] = fmaxf(x, y);
  a[j] = fminf(x, y);
}

PEER_BITONIC(_f, float, cmp_swap_f)

static __device__ __forceinline__ void row_merge_f(float *L, int kl) {
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    float other[CN];
#pragma unroll
    for (int i = 0; i < kl; i++) other[i] = __shfl_xor_sync(PEER_FULL, L[i], o);
#pragma unroll
    for (int i = 0; i < kl; i++) L[i] = fmaxf(L[i], other[kl - 1 - i]);
    merge_desc_f(L, kl);
  }
}

/* L (kl, descending) becomes the kl best of L and x: x sinks through the
 * list (a candidate that no longer beats L[kl-1] falls off the end). */
static __device__ __forceinline__ void insert_desc(u64 *L, u64 x, int kl) {
#pragma unroll
  for (int i = 0; i < kl; i++) {
    const u64 a = L[i];
    L[i] = a > x ? a : x;
    x = a > x ? x : a;
  }
}

/* Offers the up to CN scores sr[0..nv) (ids id0 + j) to L. Only those
 * that beat L's last entry as the step began can enter; with THR, only
 * those at or above the row's threshold rthr (NaN included: !(s < rthr))
 * are offered instead (~9 of 256 a thread and dim with random scores, too
 * few to fill L, so the test against L's last entry would only cost;
 * inserting one that no longer beats L leaves L as it was). After a dim's
 * first tiles few do, so they are inserted one at a time (~100
 * instructions each against ~1200 for offer's sort and merge). The warp
 * runs as many insertions as its busiest thread needs, so when some
 * thread has more than FILTER_CUT (a dim's first tiles) the warp takes
 * offer instead: a warp-uniform choice, the same list either way. With
 * random scores this is ~40% fewer instructions per dim than offer alone
 * (a simulation of 16 tiles of 16 candidates a thread). */
#define FILTER_CUT 8
#define BCAP 31 /* THR 2's buffer slots a row: 64 x 31 u64 and 64 counters fit the score tile */
#define RCAP 64 /* combine_dim's survivor slots a row; rows RCAP + 1 apart, so a warp's 8 rows read 8 bank pairs */
static __device__ __forceinline__ void offer_filtered(u64 *L, const float *sr, u32 id0, int nv, int kl, int THR,
                                                      float rthr) {
  const u64 thr = L[kl - 1];
  u32 mask = 0;
#pragma unroll
  for (int j = 0; j < CN; j++)
    if (j < nv && (THR ? !(sr[j] < rthr) : peer_pack(sr[j], id0 + j) > thr)) mask |= 1u << j;
  if (__reduce_max_sync(PEER_FULL, (unsigned)__popc(mask)) > FILTER_CUT) {
    u64 c[CN];
#pragma unroll
    for (int j = 0; j < CN; j++) c[j] = j < nv ? peer_pack(sr[j], id0 + j) : 0ull;
    offer(L, c, kl);
    return;
  }
  while (mask) {
    const int j = __ffs(mask) - 1;
    mask &= mask - 1;
    insert_desc(L, peer_pack(sr[j], id0 + j), kl);
  }
}

/* THR 2: the buffered scores of merge row mr (each of its four threads
 * the slots j = mq mod 4: at most 8 of the BCAP) as the row's list, the
 * same in the four threads (CN = 16 entries, sorted), unless some row of
 * the CTA overflowed its buffer (rows past T, real = 0, all zeros, do not
 * count; L is then left as it was); returns whether one did (CTA-uniform).
 * Each thread sorts its 8, the pairs l, l ^ 1 merge theirs into 16 (one
 * list and the other reversed are a bitonic 16) and row_merge's second
 * step takes the best 16 of the pairs' lists: ~700 instructions a thread
 * against ~1400 for inserting the slots one at a time into lists of 16
 * (~100 each, the warp as many as its busiest thread) and row_merge. */
static __device__ __forceinline__ int buffer_list(u64 *L, const u64 *buf, const u32 *cnt, int mr, int mq, bool real) {
  const u32 n = cnt[mr];
  if (__syncthreads_or(n > BCAP && real)) return 1;
  u64 c[8];
#pragma unroll
  for (int jj = 0; jj < 8; jj++) {
    const u32 j = mq + 4 * jj;
    c[jj] = j < n && j < BCAP ? buf[mr * BCAP + j] : 0ull;
  }
  sort_desc(c, 8);
#pragma unroll
  for (int i = 0; i < 8; i++) {
    L[i] = c[i];
    L[8 + i] = __shfl_xor_sync(PEER_FULL, c[7 - i], 1);
  }
  merge_desc(L, CN);
  row_merge_step(L, CN, 2);
  return 0;
}

/* REG's filter of the combination: a value at or below the row's k-th
 * best sum of running entry a (values va[a], a < len) and dim entry b (L,
 * b < ki), both lists sorted best first: the k-th largest of the sums of
 * the pairs in row or column 0 or 1, 2 (len + ki) - 4 distinct pairs
 * (fewer than k: -inf, nothing is filtered). Thread mq of the row takes
 * (0, b) b >= 0, (a, 0) a >= 1, (1, b) b >= 1 or (a, 1) a >= 2, 16 in
 * order of the varying index, so its sums are non-increasing (float
 * addition is monotonic; with NaN counted as +inf, as it ranks highest:
 * NaN entries lead their list, and inf - inf comes only from a +inf that
 * leads its list or a -inf paired with the other list's +inf, itself at
 * the head), pairs past the lists' ends -inf at the tail; row_merge_f
 * then gives the row's 16 best without a sort. With random scores ~16.4
 * of the 256 sums pass (the staircase bound a < len, b < k / (a + 1) this
 * replaced let ~83 through; a simulation of 20000 rows of normal scores).
 * Every thread of the row returns the same value. */
static __device__ __forceinline__ float combine_threshold(const u64 *L, const float *va, int len, int ki, int k,
                                                          int mq) {
  const int col = mq & 1, fix = mq >> 1, v0 = fix + col; /* varying a (col) or b, from v0; the other is fix */
  const float vf = col ? peer_packed_value(fix ? L[1] : L[0]) : va[fix];
  const int vlim = col ? len : ki, on_fix = fix < (col ? ki : len);
  float x[CN];
#pragma unroll
  for (int j = 0; j < CN; j++) {
    const float s = col ? va[v0 + j] + vf : vf + peer_packed_value(j + 1 < CN && v0 ? L[j + 1] : L[j]);
    x[j] = on_fix && v0 + j < vlim ? (s == s ? s : __int_as_float(0x7f800000)) : PEER_NEG_INF;
  }
  row_merge_f(x, CN);
  float t = x[0];
#pragma unroll
  for (int j = 1; j < CN; j++)
    if (j < k) t = x[j]; /* x[k - 1] (an index would put x in local memory) */
  return t;
}

/* REG's combination: the sums at or above t (NaN too) into F, a row's
 * pairs dealt to its four threads by (a + b) mod 4. Running entry a
 * (values va, ids ia; a < len), dim entry b (dl, packed; b < ki), both
 * sorted best first: for each a the passing b are a prefix (the sums are
 * non-increasing but for NaN, which passes and leads), and once (a, 0)
 * fails so does every later a (see combine_threshold), so the loops stop
 * at the first failure. */
static __device__ __forceinline__ void combine_survivors(u64 *F, const float *va, const u32 *ia, const u64 *dl,
                                                         int len, int ki, u32 ni, float t, int mq, int kl) {
  const float vb0 = peer_packed_value(dl[0]);
  for (int a = 0; a < len; a++) {
    const float v = va[a];
    if (v + vb0 < t) break;
    const u32 pa = ia[a] * ni;
    for (int b = (mq - a) & 3; b < ki; b += 4) {
      const u64 e = dl[b];
      const float s = v + peer_packed_value(e);
      if (s < t) break;
      insert_desc(F, peer_pack(s, pa + peer_packed_id(e)), kl);
    }
  }
}

/* combine_survivors's sums at or above t (NaN too), the same set, into
 * the row's slots rs (at most RCAP): thread mq of the row tests every
 * pair (a, b), a < len, b = mq + 4 j < ki (b <= 15, KL 16), without
 * branches (the loops above, each a pass of a few pairs, diverge and
 * wait on every load: docs/PERF.md, PEER: routing); the four threads'
 * counts give each its first slot (no atomics). Returns the row's count. */
static __device__ __forceinline__ u32 combine_slots(const float *va, const u32 *ia, const u64 *dl, int len, int ki,
                                                    u32 ni, float t, int mq, u64 *rs) {
  float vb[4];
#pragma unroll
  for (int j = 0; j < 4; j++) vb[j] = peer_packed_value(dl[mq + 4 * j]);
  u32 m[2] = {0u, 0u}; /* bit 4 a + j of pair (a, mq + 4 j), a < 8 in m[0] */
#pragma unroll
  for (int a = 0; a < 16; a++) {
    const float v = va[a];
#pragma unroll
    for (int j = 0; j < 4; j++)
      if (a < len && mq + 4 * j < ki && !(v + vb[j] < t)) m[a >> 3] |= 1u << (4 * (a & 7) + j);
  }
  const u32 c = __popc(m[0]) + __popc(m[1]);
  u32 p = c; /* inclusive prefix over the row's four lanes */
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    const u32 y = __shfl_up_sync(PEER_FULL, p, o, 4);
    if (mq >= o) p += y;
  }
  u32 slot = p - c;
#pragma unroll
  for (int h = 0; h < 2; h++)
    while (m[h]) {
      const int bit = __ffs(m[h]) - 1, a = 8 * h + (bit >> 2), b = mq + 4 * (bit & 3);
      m[h] &= m[h] - 1;
      const u64 e = dl[b];
      const float s = va[a] + peer_packed_value(e);
      if (slot < RCAP) rs[slot] = peer_pack(s, ia[a] * ni + peer_packed_id(e));
      slot++;
    }
  return __shfl_sync(PEER_FULL, p, 3, 4);
}

/* The row's list (kl entries, the same in its four threads, zeros past
 * the survivors) from its n survivors in slots rs: each goes to its rank
 * among them, counted against all n (the packed candidates are distinct:
 * one id a pair), through the row's dl; n <= RCAP. ~n^2 / 4 compares a
 * thread (n ~ 17 with random scores, combine_threshold) where inserting
 * them into the threads' lists and row_merge took ~2000 instructions. */
static __device__ __forceinline__ void rank_survivors(u64 *L, const u64 *rs, u32 n, u64 *dl, int mq, const int kl) {
#pragma unroll
  for (int j = 0; j < kl; j++)
    if ((j & 3) == mq && (u32)j >= n) dl[j] = 0;
  for (u32 e = mq; e < n; e += 4) {
    const u64 x = rs[e];
    int r = 0;
    for (u32 f = 0; f < n; f++) r += rs[f] > x;
    if (r < kl) dl[r] = x;
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kl; j++) L[j] = dl[j];
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

/* The first key row of dim i (head hh) in peer_split_keys's layout: the
 * dims' tables one after another, each [heads (1 when shared)][n_i]. */
static __device__ __forceinline__ i64 split_row0(const peer_route_params &P, int i, i64 hh) {
  i64 r = 0;
  for (int j = 0; j < i; j++) r += (P.key_hs[j] ? P.h : 1) * P.n[j];
  return r + (P.key_hs[i] ? hh * P.n[i] : 0);
}

/* The index of dim i's table (head hh's, when per head) among all the
 * dims' tables, in split_row0's order: peer_split_keys's kmax entries. */
static __device__ __forceinline__ i64 key_group(const peer_route_params &P, int i, i64 hh) {
  i64 r = 0;
  for (int j = 0; j < i; j++) r += P.key_hs[j] ? P.h : 1;
  return r + (P.key_hs[i] ? hh : 0);
}

/* Starts the copies of split key rows row0 + c0 .. + KT-1 (dpad bf16 each,
 * 16 bytes a copy) into kh (and kl), one cp.async group; rows past ni are
 * zero-filled. */
static __device__ __forceinline__ void tile_copy(smelt_h16 *kh, smelt_h16 *kl, u64 khi, u64 klo, i64 row0, i64 c0,
                                                 i64 ni, int dpad, int ds, int key_lo, int tid) {
  const int nch = dpad >> 3;
  for (int x = tid; x < KT * nch; x += NT) {
    const int r = x / nch, cc = x - r * nch;
    const bool in = c0 + r < ni;
    const i64 e = (row0 + (in ? c0 + r : 0)) * dpad + cc * 8;
    cp_async16(smem_u32(kh + r * ds + cc * 8), (const smelt_h16 *)khi + e, in ? 16 : 0);
    if (key_lo) cp_async16(smem_u32(kl + r * ds + cc * 8), (const smelt_h16 *)klo + e, in ? 16 : 0);
  }
  cp_async_commit();
}

/* tile_copy_pow2 of a tile with all KT rows in (no row test or zero
 * fill), from src, the thread's first row and chunk in the table
 * (tile_copy_pow2's r0 and cc): the rows' offsets are immediates. */
static __device__ __forceinline__ void tile_copy_full(u32 dst, const smelt_h16 *src, int dpad, int ds, int tid) {
  const int nch = dpad >> 3, sh = dpad == 128 ? 4 : __ffs(nch) - 1, cc = tid & (nch - 1);
  const int r0 = (tid >> sh) & ((NT >> sh) - 1);
  const u32 d0 = dst + (u32)(r0 * ds + cc * 8) * 2;
#pragma unroll
  for (int u = 0; u < (KT * nch + NT - 1) / NT; u++)
    if (r0 + u * (NT >> sh) < KT) cp_async16(d0 + (u32)(u * (NT >> sh) * ds) * 2, src + u * (NT >> sh) * dpad, 16);
  cp_async_commit();
}

/* tile_copy of hi rows alone into the buffer at shared address dst, for
 * REG when a row's 16-byte chunks are a power of two (dpad 16, 32, ...,
 * 256): a thread's chunk and rows follow from shifts and masks, and its
 * source from one 64-bit address a tile (tile_copy divides per chunk). */
static __device__ __forceinline__ void tile_copy_pow2(u32 dst, u64 khi, i64 row0, i64 c0, i64 ni, int dpad, int ds,
                                                      int tid) {
  const int nch = dpad >> 3, sh = dpad == 128 ? 4 : __ffs(nch) - 1, cc = tid & (nch - 1);
  const smelt_h16 *src = (const smelt_h16 *)khi + (row0 + c0) * dpad + cc * 8;
  const int lim = ni - c0 < KT ? (int)(ni - c0) : KT;
  const int r0 = (tid >> sh) & ((NT >> sh) - 1); /* = tid >> sh (tid < NT); the mask bounds it for the compiler */
  const u32 d0 = dst + (u32)(r0 * ds + cc * 8) * 2;
  /* a literal trip count when dpad is one (as route_rows passes 128), the
   * rows' offsets immediates: the loop with its per-copy address
   * arithmetic was ~21 instructions a copy (ncu, v6). A full tile (every
   * tile at the acceptance shape) needs no row test or zero fill: one
   * source address and immediate offsets (SASS, dpad 128: ~15
   * instructions a tile against ~59 with the per-row selects). */
  if (lim == KT) {
    tile_copy_full(dst, src + r0 * dpad, dpad, ds, tid);
    return;
  }
#pragma unroll
  for (int u = 0; u < (KT * nch + NT - 1) / NT; u++) {
    const int r = r0 + u * (NT >> sh);
    if (r < KT) {
      const bool in = r < lim; /* rows past the dim's end: zero-filled from the tile's first row (c0 < ni) */
      cp_async16(d0 + (u32)(u * (NT >> sh) * ds) * 2, src + (in ? r : 0) * dpad, in ? 16 : 0);
    }
  }
  cp_async_commit();
}

/* The warp's 16 x 32 block of a tile's scores (rows rm.., keys cn..) as
 * route_rows's w32 loop computes them, the same mma on the same fragments
 * in the same order (so the same bits), with the fragments loaded by
 * ldmatrix: per 16-wide k step 4 ldmatrix.x4 (6 with lo keys) instead of
 * 16 (24) 32-bit loads. Rows of DS bf16 are 16-byte aligned and 8 rows at
 * DS = dpad + 8 hit distinct 16-byte bank groups. Matrices of an x4: for
 * A (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15,
 * k 8-15) = a0..a3; for B, keys of nt and nt + 1 at k 0-7 and 8-15 = the
 * b0, b1 of nt and of nt + 1. */
static __device__ __forceinline__ void score_tile_ldsm(float (*acc)[4], const smelt_h16 *qh, const smelt_h16 *ql,
                                                       const smelt_h16 *kh, const smelt_h16 *kl, int ds, int dpad,
                                                       int rm, int cn, int lane, int key_lo) {
  const int lr = lane & 7, lm = lane >> 3;
  const int arow = rm + lr + (lm & 1) * 8, acol = (lm >> 1) * 8;
  const int brow = cn + (lm >> 1) * 8 + lr, bcol = (lm & 1) * 8;
  for (int k0 = 0; k0 < dpad; k0 += 16) {
    u32 ah[4], al[4];
    ldsm_x4(smem_u32(qh + arow * ds + k0 + acol), ah);
    ldsm_x4(smem_u32(ql + arow * ds + k0 + acol), al);
#pragma unroll
    for (int np = 0; np < 4; np += 2) {
      u32 bh[4], bl[4];
      ldsm_x4(smem_u32(kh + (brow + np * 8) * ds + k0 + bcol), bh);
      if (key_lo) ldsm_x4(smem_u32(kl + (brow + np * 8) * ds + k0 + bcol), bl);
#pragma unroll
      for (int h = 0; h < 2; h++) {
        mma_16816_bf16(acc[np + h], ah, bh + 2 * h);
        mma_16816_bf16(acc[np + h], al, bh + 2 * h);
        if (key_lo) mma_16816_bf16(acc[np + h], ah, bl + 2 * h);
      }
    }
  }
}

/* REG: the hi query fragments of the warp's 16 rows (rm..) for k steps
 * 0..QK-1 (dpad <= 16 QK), loaded at the start of the first pass by the
 * same ldmatrix.x4 as score_tile_ldsm's. (Held through the second pass
 * too, with or without the lo parts, they spill: 128 registers.) */
#define QK 8
static __device__ __forceinline__ void load_query_frags(u32 (*ah)[4], const smelt_h16 *qh, int ds, int dpad, int rm,
                                                        int lane) {
  const int lr = lane & 7, lm = lane >> 3;
  const int arow = rm + lr + (lm & 1) * 8, acol = (lm >> 1) * 8;
#pragma unroll
  for (int s = 0; s < QK; s++) {
#pragma unroll
    for (int j = 0; j < 4; j++) ah[s][j] = 0u; /* steps past dpad: no value lives on from before */
    if (16 * s < dpad) ldsm_x4(smem_u32(qh + arow * ds + 16 * s + acol), ah[s]);
  }
}

/* REG's first pass over a tile: the approximate scores (hi query x hi key,
 * one mma a fragment, the hi query fragments ah from registers; row_err
 * bounds the difference to the exact ones) of the warp's 16 rows x 32
 * keys (cn..), into the column maxima gm as pass 0 keeps them (columns at
 * or past lim, the dim's end, skipped; full, a literal: the tile has all
 * KT keys, no column test). Two n tiles at a time, so that 8
 * accumulators are live instead of 16 (the order of the mma no longer
 * matters: these scores only bound the threshold). */
static __device__ __forceinline__ void colmax_tile_reg(float (*gm)[4], const u32 (*ah)[4], u32 kh, int ds, int dpad,
                                                       int cn, int lane, int tq, int lim, int full) {
  const int lr = lane & 7, lm = lane >> 3;
  const u32 b0 = kh + (u32)((cn + (lm >> 1) * 8 + lr) * ds + (lm & 1) * 8) * 2, b1 = b0 + (u32)(16 * ds) * 2;
  const int ns = dpad >> 4; /* k steps */
  /* each key fragment is loaded one step ahead of its mma (the asm
   * statements keep their order, so this is what hides ldmatrix's latency);
   * shared addresses as u32, the steps as immediate offsets */
  u32 cur[4], nxt[4];
  ldsm_x4(b0, cur);
#pragma unroll
  for (int np = 0; np < 4; np += 2) {
    float acc[2][4];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[h][e] = 0.f;
#pragma unroll
    for (int s = 0; s < QK; s++) {
      if (s >= ns) break;
      if (s + 1 < ns) ldsm_x4((np ? b1 : b0) + 32 * (s + 1), nxt);
      else if (np == 0) ldsm_x4(b1, nxt);
      mma_16816_bf16(acc[0], ah[s], cur);
      mma_16816_bf16(acc[1], ah[s], cur + 2);
#pragma unroll
      for (int j = 0; j < 4; j++) cur[j] = nxt[j];
    }
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        if (full || cn + (np + h) * 8 + 2 * tq + (e & 1) < lim) gm[np + h][e] = fmaxf(gm[np + h][e], acc[h][e]);
  }
}

/* REG's second pass over a tile without lo keys: score_tile_ldsm's mma in
 * its order (the same bits), k steps unrolled (dpad <= 16 QK), shared
 * addresses as u32 with the steps as immediate offsets, each step's four
 * fragments loaded before its eight mma. qh, kh: shared addresses of the
 * hi query slice and the key tile; the lo slice is ROWS rows after qh. */
static __device__ __forceinline__ void score_tile_u32(float (*acc)[4], u32 qh, u32 kh, int ds, int dpad, int rm,
                                                      int cn, int lane) {
  const int lr = lane & 7, lm = lane >> 3;
  const u32 a = qh + (u32)((rm + lr + (lm & 1) * 8) * ds + (lm >> 1) * 8) * 2, al = a + (u32)(ROWS * ds) * 2;
  const u32 b0 = kh + (u32)((cn + (lm >> 1) * 8 + lr) * ds + (lm & 1) * 8) * 2, b1 = b0 + (u32)(16 * ds) * 2;
#pragma unroll
  for (int s = 0; s < QK; s++) {
    if (16 * s >= dpad) break;
    u32 fh[4], fl[4], bh[2][4];
    ldsm_x4(a + 32 * s, fh);
    ldsm_x4(al + 32 * s, fl);
    ldsm_x4(b0 + 32 * s, bh[0]);
    ldsm_x4(b1 + 32 * s, bh[1]);
#pragma unroll
    for (int np = 0; np < 2; np++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        mma_16816_bf16(acc[2 * np + h], fh, bh[np] + 2 * h);
        mma_16816_bf16(acc[2 * np + h], fl, bh[np] + 2 * h);
      }
  }
}

/* a[j] of the n (a literal, 16 or 32) values a in registers, by selects
 * on j's bits, lowest first (indexing a at run time would put it in local
 * memory). */
static __device__ __forceinline__ float pick(const float *a, const int n, int j) {
  float s16[16], s8[8], s4[4], s2[2];
#pragma unroll
  for (int x = 0; x < n / 2; x++) s16[x] = j & 1 ? a[2 * x + 1] : a[2 * x];
#pragma unroll
  for (int x = 0; x < n / 4; x++) s8[x] = j & 2 ? s16[2 * x + 1] : s16[2 * x];
#pragma unroll
  for (int x = 0; x < n / 8; x++) s4[x] = j & 4 ? s8[2 * x + 1] : s8[2 * x];
#pragma unroll
  for (int x = 0; x < n / 16; x++) s2[x] = j & 8 ? s4[2 * x + 1] : s4[2 * x];
  return n == 32 && (j & 16) ? s2[1] : s2[0];
}

/* REG's second pass: the tile's scores at or above their row's threshold
 * rt (NaN too), as THR 2's pass 1 keeps them, into the rows' buffers. A
 * thread's passing entries are a mask walked one entry a round, so the
 * warp runs as many rounds as its busiest thread has entries (~1.8 a tile
 * with random scores) instead of 16 warp-uniform branches each taken, with
 * its atomic, when any lane passes (46% of them: ~240 instructions a tile,
 * the most of any part of reg; ncu, v6). The slots' order changes, not
 * their contents, and the buffer's insertion does not depend on it. full
 * (a literal): all KT keys in, no column test. */
static __device__ __forceinline__ void buffer_tile(const float (*acc)[4], const float *rt, u64 *buf, u32 *cnt, u32 c0,
                                                   int rm, int cn, int g, int tq, int lim, int full) {
  u32 mask = 0; /* bit 4 nt + e: acc[nt][e] */
#pragma unroll
  for (int nt = 0; nt < 4; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      if ((full || cn + nt * 8 + 2 * tq + (e & 1) < lim) && !(acc[nt][e] < rt[e >> 1])) mask |= 1u << (4 * nt + e);
  while (mask) {
    const int j = __ffs(mask) - 1;
    mask &= mask - 1;
    const float s = pick((const float *)acc, 16, j); /* acc[j >> 2][j & 3] */
    const int col = cn + (j >> 2) * 8 + 2 * tq + (j & 1), r = rm + g + 8 * ((j >> 1) & 1);
    const u32 slot = atomicAdd(&cnt[r], 1u);
    if (slot < BCAP) buf[r * BCAP + slot] = peer_pack(s, c0 + (u32)col);
  }
}

/* Adds the squares of the 8 bf16 of vh to *sh and of vl to *sl. */
static __device__ __forceinline__ void add_squares(uint4 vh, uint4 vl, float *sh, float *sl) {
  const u32 wh[4] = {vh.x, vh.y, vh.z, vh.w}, wl[4] = {vl.x, vl.y, vl.z, vl.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float h0 = __uint_as_float(wh[j] << 16), h1 = __uint_as_float(wh[j] & 0xffff0000u);
    const float l0 = __uint_as_float(wl[j] << 16), l1 = __uint_as_float(wl[j] & 0xffff0000u);
    *sh += h0 * h0 + h1 * h1;
    *sl += l0 * l0 + l1 * l1;
  }
}

/* The bound from the four merge threads' partial sums of squares sh, sl
 * (add_squares over a quarter of the row's 16-byte chunks each). */
static __device__ __forceinline__ float err_bound(float sh, float sl, int dpad, float kmh, float kml) {
  sh += __shfl_xor_sync(PEER_FULL, sh, 1);
  sl += __shfl_xor_sync(PEER_FULL, sl, 1);
  sh += __shfl_xor_sync(PEER_FULL, sh, 2);
  sl += __shfl_xor_sync(PEER_FULL, sl, 2);
  const float nh = sqrtf(sh), nl = sqrtf(sl);
  const float steps = (float)(dpad / 16);
  return (nl * kmh + nh * kml + steps * 4.f * 0x1p-16f * (nh + nl) * (kmh + kml) + 0x1p-100f) * (1.f + 0x1p-8f);
}

/* REG: a bound on |exact - approximate| over the scores of merge row mr,
 * exact as the second pass computes them (hi·hi + lo·hi (+ hi·lo) in
 * mma's f32 arithmetic), approximate as the first pass does (hi·hi). The
 * difference is lo·hi + hi·lo plus both computations' rounding; by
 * Cauchy-Schwarz |lo_q·hi_k| <= |lo_q| |hi_k| <= |lo_q| kmh (kmh, kml: the
 * largest L2 norms of the dim's hi and lo key rows, from peer_split_keys),
 * and each mma rounds by less than 2^-16 of the sum of its terms'
 * magnitudes, itself <= (|hi_q| + |lo_q|)(kmh + kml), over at most 4 mma a
 * k step in the two passes together (2^-100 more for underflow). The last
 * factor covers the rounding of this computation. Non-finite parts give a non-finite bound (the
 * threshold then drops to -inf). Every thread of the row gets the same
 * bits (the four partial sums are added in the same pairs). */
static __device__ __forceinline__ float row_err(const smelt_h16 *qh, const smelt_h16 *ql, int ds, int dpad, int mr,
                                                int mq, float kmh, float kml) {
  float sh = 0.f, sl = 0.f;
  for (int c = mq * 8; c < dpad; c += 32)
    add_squares(*(const uint4 *)&qh[mr * ds + c], *(const uint4 *)&ql[mr * ds + c], &sh, &sl);
  return err_bound(sh, sl, dpad, kmh, kml);
}

/* A threshold at or below t - err, rounded down; -inf when that is NaN. */
static __device__ __forceinline__ float lower_by(float t, float err) {
  const float r = __fsub_rd(t, err);
  return r == r ? r : PEER_NEG_INF;
}

/* THR 2's threshold of merge row mr: the exact k-th largest of the row's
 * 64 column maxima gm (k <= 16), at or below the row's k-th best since the
 * k largest are k distinct candidates. The maxima go to the score tile
 * (free in the first pass), each of the row's four merge threads sorts its
 * 16 and row_merge_f takes the row's 16 best (plain floats: the maxima
 * are never NaN, fmaxf skips NaN scores, and only the value matters, so
 * no column ids; a -0 for +0 changes no test). Every merge thread
 * returns the threshold; it is also left at column 64 of the row. With
 * REG's approximate first pass, the maxima are approximate and the
 * threshold is lowered by the row's bound err (row_err): the k columns'
 * maxima are then k distinct candidates whose exact scores are at or
 * above it. */
static __device__ __forceinline__ float row_kth(float (*gm)[4], float *st, int k, int rm, int cn, int g, int tq, int mr,
                                                int mq, float err) {
#pragma unroll
  for (int nt = 0; nt < 4; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) st[(rm + g + 8 * (e >> 1)) * STS + cn + nt * 8 + 2 * tq + (e & 1)] = gm[nt][e];
  __syncthreads();
  float c[CN];
#pragma unroll
  for (int j = 0; j < CN; j++) c[j] = st[mr * STS + mq * CN + j];
  sort_desc_f(c, CN);
  row_merge_f(c, CN);
  float m = c[0]; /* c[k - 1] (an index would put c in local memory) */
#pragma unroll
  for (int j = 1; j < CN; j++)
    if (j < k) m = c[j];
  const float t = err > 0.f || err != err ? lower_by(m, err) : m;
  if (mq == 0) st[mr * STS + KT] = t;
  return t;
}

/* THR 2 after its first pass: the threshold of merge row mr (returned)
 * and of the thread's mma rows (rt), row_kth's with err, then the buffer's
 * counters zeroed. rm, cn: the thread's gm rows and columns in the score
 * tile (route_rows's and wg_dim's warps hold different ones). */
static __device__ __forceinline__ float buf_threshold(float (*gm)[4], float *st, u32 *cnt, int k, int rm, int cn,
                                                      int g, int tq, int mr, int mq, float err, float *rt) {
  const float t = row_kth(gm, st, k, rm, cn, g, tq, mr, mq, err);
  __syncthreads(); /* column KT holds the rows' thresholds */
  rt[0] = st[(rm + g) * STS + KT];
  rt[1] = st[(rm + g + 8) * STS + KT];
  __syncthreads(); /* read before the counters are zeroed (the buffer is over the score tile) */
  if (threadIdx.x < ROWS) cnt[threadIdx.x] = 0;
  return t;
}

/* ---------------------------------------------------------------- WG: wgmma scores (Hopper) */

/* WG (route_rows with WG, peer_route_wg, Hopper): THR 2 / REG's two passes
 * with the scores on wgmma. A CTA's two warpgroups take 64 keys each of a
 * 128-key chunk (m64n64k16: the warpgroup's 64 rows, as every CTA's); a
 * chunk's hi key rows (dpad 128) come by cp.async into one of two stages
 * in wgmma's K-major 128-byte-swizzled layout. The hi query fragments
 * stay in registers for both passes (wgmma's register A operand, the
 * mma.sync layout, loaded by ldmatrix); the lo part is read from shared
 * memory (a descriptor). Pass 0 scores hi x hi, pass 1 hi x hi + lo x hi
 * (in that order in each k step): one instruction a warpgroup for 64 x 64
 * x 16 products where mma.sync took 16 a warp, and no fragment loads.
 * Against reg: the same thresholds (row_err's bound, row_kth), buffers,
 * lists and combination; the scores are wgmma's sums, so at near-ties
 * the ids can differ from reg's (with data exact in the products, as the
 * tests' exact cases, they are the same bits). Shared memory after the
 * score tile and the lists: the lo query slice (16 KiB) and two key
 * stages (32 KiB each), 1024-byte aligned. */
#define WG_CH 128 /* keys a chunk */
#define WG_STAGE (WG_CH * 256) /* bytes of a stage: 2 panels of WG_CH rows x 128 bytes */
#define WG_QPANEL (ROWS * 128)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* d (64 x 64 a warpgroup, f32) = / += a b: a from registers (4 words of
 * the mma.sync A fragment) or a K-major descriptor, b a K-major
 * descriptor; acc 0 overwrites d. */
static __device__ __forceinline__ void wg_rs(float *d, const u32 *a, u64 db, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_REGS32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
               : WG_D32(WG_RW)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}
static __device__ __forceinline__ void wg_ss(float *d, u64 da, u64 db, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_REGS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : WG_D32(WG_RW)
               : "l"(da), "l"(db), "r"(acc));
}
#endif

/* Orders this thread's shared-memory writes (st.shared, cp.async) before
 * later reads by wgmma, which go through the async proxy. */
static __device__ __forceinline__ void wg_fence_proxy(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  fence_proxy_async();
#endif
}

/* Byte offset of 16-byte chunk c (0..15: elements 8c..8c+7) of row r in a
 * swizzled [2 panels][rows][128 B] array. */
static __device__ __forceinline__ u32 wg_off(int r, int c, int rows) {
  return (u32)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* One cp.async group: the split hi key rows c0 .. c0 + WG_CH - 1 of the
 * table at row row0 (dpad 128) into the stage at dst, rows at or past ni
 * zero-filled. Thread tid copies chunk tid % 16 of rows tid / 16 + 16 u:
 * the same swizzle for all its rows, so the offsets are immediates. */
static __device__ __forceinline__ void wg_copy(u32 dst, u64 khi, i64 row0, i64 c0, i64 ni, int tid) {
  const int c = tid & 15, r0 = tid >> 4;
  const smelt_h16 *tbl = (const smelt_h16 *)khi + row0 * 128 + c * 8, *src = tbl + (c0 + r0) * 128;
  const u32 d0 = dst + wg_off(r0, c, WG_CH);
  const i64 left = ni - c0 - r0; /* the dim's rows from this thread's first: row r0 + 16 u is in when 16 u < left */
  if (c0 + WG_CH <= ni) {
#pragma unroll
    for (int u = 0; u < WG_CH / 16; u++) cp_async16(d0 + (u32)(u * 16 * 128), src + u * 16 * 128, 16);
    cp_async_commit();
    return;
  }
#pragma unroll
  for (int u = 0; u < WG_CH / 16; u++) {
    const bool in = 16 * u < left; /* rows past the dim: the zero fill reads nothing; a valid address all the same */
    cp_async16(d0 + (u32)(u * 16 * 128), in ? src + u * 16 * 128 : tbl, in ? 16 : 0);
  }
  cp_async_commit();
}

/* The chunk's scores of the warpgroup's 64 rows x 64 keys (keys 64 wg ..
 * of the stage at kst): hi x hi (pass 0) or hi x hi + lo x hi (pass 1, lo
 * from the swizzled slice at qls), k steps in order. LO is a literal at
 * every call: a wgmma under a run-time branch makes ptxas serialize them
 * all (C7520). */
static __device__ __forceinline__ void wg_scores(float *acc, const u32 (*qf)[4], u32 qls, u32 kst, int wg, const int LO) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const u32 kb = kst + (u32)(wg * 64 * 128);
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 8; s++) {
    const u64 db = wgmma_desc_kmajor(kb + (u32)((s >> 2) * WG_CH * 128 + (s & 3) * 32));
    wg_rs(acc, qf[s], db, s > 0);
    if (LO) wg_ss(acc, wgmma_desc_kmajor(qls + (u32)((s >> 2) * WG_QPANEL + (s & 3) * 32)), db, 1);
  }
  wgmma_commit();
  WGMMA_WAIT(0);
#else
  __trap(); /* wgmma is sm_90a's; peer_select.c picks WG on cc 9.0 only */
#endif
}

/* Item it of wg_dim's two passes (chunk it mod nc, stage it & 1): waits
 * for its copy, makes it visible to wgmma (the async proxy) and to every
 * thread, then issues the next item's copy into the other stage, which
 * every warpgroup is done with by this barrier. */
static __device__ __forceinline__ void wg_next(u32 stg, u64 khi, i64 row0, int it, int nc, i64 ni, int tid) {
  CP_ASYNC_WAIT(0);
  wg_fence_proxy();
  __syncthreads();
  if (it + 1 < 2 * nc)
    wg_copy(stg + (u32)(((it + 1) & 1) * WG_STAGE), khi, row0, (i64)((it + 1) % nc) * WG_CH, ni, tid);
}

#define PJ_STAGE (3 * ROWS * 128) /* bytes of a projection stage: x's 64 rows and wt's 128, 64 elements each */
/* WG's layout against the host's size: the score tile, lists of 16, up to
 * 1 KiB of alignment, the lo query slice and two key stages; wg_project's
 * three stages take the room of the last two. */
static_assert(sizeof(float) * (ROWS * STS + ROWS * 16) + sizeof(u32) * ROWS * 16 + 1024 + 2 * WG_QPANEL +
                      2 * WG_STAGE ==
                  SMELT_PEER_SMEM_ROUTE_WG,
              "peer_route_wg's layout must take the host's SMELT_PEER_SMEM_ROUTE_WG bytes");
static_assert(3 * PJ_STAGE <= 2 * WG_QPANEL + 2 * WG_STAGE, "wg_project's stages must fit the lo slice's and key stages' room");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* One cp.async group: chunk kc (64 of din) of x's rows t0.. (rows past T
 * zero-filled) and of wt's rows col0.., each 128 bytes a row in the
 * 128-byte swizzle (wg_off's, one panel), x's at dst, wt's after. */
static __device__ __forceinline__ void pj_copy(const peer_route_params &P, u32 dst, i64 t0, i64 col0, int kc, int tid) {
  const int c = tid & 7, r0 = tid >> 3;
  const smelt_h16 *x = (const smelt_h16 *)P.x, *w = (const smelt_h16 *)P.wt;
#pragma unroll
  for (int u = 0; u < 2; u++) {
    const int r = r0 + 32 * u;
    const bool in = t0 + r < P.T;
    cp_async16(dst + wg_off(r, c, ROWS), x + (in ? (t0 + r) * P.x_rs + kc * 64 + c * 8 : 0), in ? 16 : 0);
  }
#pragma unroll
  for (int u = 0; u < 4; u++) {
    const int n = r0 + 32 * u;
    cp_async16(dst + (u32)(ROWS * 128) + wg_off(n, c, 2 * ROWS), w + (col0 + n) * P.din + kc * 64 + c * 8, 16);
  }
  cp_async_commit();
}
#endif

/* PJ: dim i's query slice of rows t0.. of head hh computed here instead of
 * read from q: x's 64 rows times wt's rows col0 .. col0 + 127 (warpgroup
 * wg: 64 wg ..), f32 sums over din in order, k steps of 16, plus bq, split
 * into hi (st) and lo (qls) as wg_dim's loads from q would be. Three
 * stages of PJ_STAGE from qls (the lo slice and the key stages, idle until
 * this returns); the caller's fence and barrier publish the slice. */
static __device__ __forceinline__ void wg_project(const peer_route_params &P, int i, i64 t0, i64 hh, float *st, u32 qls,
                                                  int tid) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const i64 col0 = hh * P.dq + i * P.dsub;
  const int nk = (int)(P.din >> 6);
  float acc[32]; /* zeroed and always accumulated into: with a run-time first-step flag ptxas spilled ~1.5 KB */
#pragma unroll
  for (int s = 0; s < 32; s++) acc[s] = 0.f;
  pj_copy(P, qls, t0, col0, 0, tid);
  if (nk > 1) pj_copy(P, qls + PJ_STAGE, t0, col0, 1, tid);
#pragma unroll 1
  for (int kc = 0; kc < nk; kc++) {
    if (kc + 1 < nk) CP_ASYNC_WAIT(1);
    else CP_ASYNC_WAIT(0);
    wg_fence_proxy();
    __syncthreads(); /* chunk kc is in; every warpgroup is done with chunk kc - 1's stage */
    if (kc + 2 < nk) pj_copy(P, qls + (u32)(((kc + 2) % 3) * PJ_STAGE), t0, col0, kc + 2, tid);
    const u32 a = qls + (u32)((kc % 3) * PJ_STAGE), b = a + (u32)(ROWS * 128 + wg * 64 * 128);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; s++)
      wg_ss(acc, wgmma_desc_kmajor(a + (u32)(s * 32)), wgmma_desc_kmajor(b + (u32)(s * 32)), 1);
    wgmma_commit();
    WGMMA_WAIT(0);
  }
  __syncthreads(); /* every warpgroup's reads of the stages are done: qls is the lo slice again */
  /* acc[4 j + e]: row 16 (warp & 3) + lane / 4 (+ 8 for e >= 2), column 64 wg + 8 j + 2 (lane & 3) + (e & 1) */
  const int r = 16 * (warp & 3) + (lane >> 2);
  const u32 qhs = smem_u32(st);
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const int dd = 64 * wg + 8 * j + 2 * (lane & 3);
    const float b0 = P.bq ? peer_ld(P.bq, col0 + dd, P.bq_dt) : 0.f;
    const float b1 = P.bq ? peer_ld(P.bq, col0 + dd + 1, P.bq_dt) : 0.f;
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
      const u32 o = wg_off(r + 8 * hr, dd >> 3, ROWS) + (u32)(dd & 7) * 2;
      smelt_h16 *hi = (smelt_h16 *)((char *)st + o), *lo = (smelt_h16 *)((char *)st + (o + (qls - qhs)));
      split_bf16(acc[4 * j + 2 * hr] + b0, hi, lo);
      split_bf16(acc[4 * j + 2 * hr + 1] + b1, hi + 1, lo + 1);
    }
  }
#else
  __trap(); /* wgmma is sm_90a's */
#endif
}

/* Dim i of rows t0.. of head hh under WG: the query slice split into hi
 * (over the score tile st) and lo (qls) parts, both swizzled; the hi
 * fragments to registers; the two passes over the dim's chunks through
 * the stages at stg; the rows' lists into L as buffer_list leaves them,
 * or, when some row's buffer overflowed, the exact scores again merged
 * through the score tile (half a chunk at a time) and row_merge'd. */
static __device__ __forceinline__ void wg_dim(const peer_route_params &P, int i, i64 t0, i64 hh, u64 khi, u64 kmax,
                                              float *st, u32 qls, u32 stg, u64 *L, int tid, const int PJ) {
  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2, tq = lane & 3, mr = tid >> 2, mq = tid & 3;
  const int rm = (warp & 3) * 16, cn = wg * 32; /* the thread's mma rows; its gm columns in the score tile */
  const i64 ni = P.n[i], dsub = P.dsub, hd = P.h * P.dq;
  const int k = (int)P.k;
  const i64 row0 = split_row0(P, i, hh);
  const int nc = (int)((ni + WG_CH - 1) / WG_CH), nk = (int)ni; /* a dim's keys fit an int (ids are u32) */
  const u32 qhs = smem_u32(st);
  if (PJ) {
    wg_project(P, i, t0, hh, st, qls, tid);
    wg_copy(stg, khi, row0, 0, ni, tid); /* pass 0's first chunk (the stages held the projection's) */
  } else {
    wg_copy(stg, khi, row0, 0, ni, tid); /* pass 0's first chunk, flying while the slice is split */
    const float *q = (const float *)P.q;
    const bool vec = dsub == 128 && (P.dq & 3) == 0 && (P.q & 15) == 0;
    /* every load issued before the first split's stores: the compiler may
     * not move a global load above a store through another generic pointer,
     * and issued one at a time they cost a unit microseconds (docs/PERF.md,
     * PEER: routing) */
    float4 v[ROWS * 128 / 4 / NT];
  #pragma unroll
    for (int u = 0; u < ROWS * 128 / 4 / NT; u++) {
      const int x = 4 * (tid + u * NT), r = x >> 7, dd = x & 127;
      const i64 t = t0 + r;
      const float *src = q + t * hd + hh * P.dq + i * dsub + dd;
      v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (t < P.T) {
        if (vec) v[u] = *(const float4 *)src;
        else {
          v[u].x = dd < dsub ? src[0] : 0.f;
          v[u].y = dd + 1 < dsub ? src[1] : 0.f;
          v[u].z = dd + 2 < dsub ? src[2] : 0.f;
          v[u].w = dd + 3 < dsub ? src[3] : 0.f;
        }
      }
    }
  #pragma unroll
    for (int u = 0; u < ROWS * 128 / 4 / NT; u++) {
      const int x = 4 * (tid + u * NT), r = x >> 7, dd = x & 127;
      const u32 o = wg_off(r, dd >> 3, ROWS) + (u32)(dd & 7) * 2;
      split4_bf16(v[u], (smelt_h16 *)((char *)st + o), (smelt_h16 *)((char *)st + (o + (qls - qhs))));
    }
  }
  wg_fence_proxy(); /* the lo slice is read by wgmma */
  __syncthreads();
  u32 qf[8][4]; /* the warp's hi query fragments: ldmatrix of the swizzled slice, rows rm.., k step s */
  {
    const int lr = lane & 7, lm = lane >> 3, r = rm + lr + (lm & 1) * 8;
#pragma unroll
    for (int s = 0; s < 8; s++) ldsm_x4(qhs + wg_off(r, 2 * s + (lm >> 1), ROWS), qf[s]);
  }
  float err;
  {
    /* row_err's bound on the slice (chunks read from their swizzled places) */
    float sh = 0.f, sl = 0.f;
#pragma unroll
    for (int c = mq; c < 16; c += 4) {
      const u32 o = wg_off(mr, c, ROWS);
      add_squares(*(const uint4 *)((const char *)st + o), *(const uint4 *)((const char *)st + o + (qls - qhs)), &sh,
                  &sl);
    }
    const i64 grp = key_group(P, i, hh);
    err = err_bound(sh, sl, 128, ((const float *)kmax)[2 * grp], ((const float *)kmax)[2 * grp + 1]);
  }
  float gm[4][4];
#pragma unroll
  for (int nt = 0; nt < 4; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) gm[nt][e] = PEER_NEG_INF;
  u64 *buf = (u64 *)st;
  u32 *cnt = (u32 *)(buf + ROWS * BCAP);
  float rt[2], acc[32];
  /* item it: chunk it % nc of pass it / nc, in stage it & 1; its copy was
   * issued one item ahead (wg_next). The passes are two loops so that each
   * calls wg_scores with a literal LO. */
#pragma unroll 1
  for (int ci = 0; ci < nc; ci++) {
    wg_next(stg, khi, row0, ci, nc, ni, tid);
    wg_scores(acc, qf, qls, stg + (u32)((ci & 1) * WG_STAGE), wg, 0);
    const int base = ci * WG_CH + 64 * wg + 2 * tq; /* the key of acc[0]; acc[4 j + e] is key base + 8 j + (e & 1) */
    /* a branch on the chunk being whole, so that whole ones (all but the
     * dim's last, if any) test no key (the tests per score were ~160
     * instructions a chunk) */
    if ((ci + 1) * WG_CH <= nk) {
#pragma unroll
      for (int j = 0; j < 32; j++) gm[(j >> 2) & 3][j & 3] = fmaxf(gm[(j >> 2) & 3][j & 3], acc[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 32; j++)
        if (base + 8 * (j >> 2) + (j & 1) < nk) gm[(j >> 2) & 3][j & 3] = fmaxf(gm[(j >> 2) & 3][j & 3], acc[j]);
    }
  }
  const float rthr = buf_threshold(gm, st, cnt, k, rm, cn, g, tq, mr, mq, err, rt);
#pragma unroll 1
  for (int ci = 0; ci < nc; ci++) {
    const int it = nc + ci;
    wg_next(stg, khi, row0, it, nc, ni, tid);
    wg_scores(acc, qf, qls, stg + (u32)((it & 1) * WG_STAGE), wg, 1);
    const int base = ci * WG_CH + 64 * wg + 2 * tq;
    u32 mask = 0;
    if ((ci + 1) * WG_CH <= nk) {
#pragma unroll
      for (int j = 0; j < 32; j++)
        if (!(acc[j] < rt[(j >> 1) & 1])) mask |= 1u << j;
    } else {
#pragma unroll
      for (int j = 0; j < 32; j++)
        if (base + 8 * (j >> 2) + (j & 1) < nk && !(acc[j] < rt[(j >> 1) & 1])) mask |= 1u << j;
    }
    while (mask) {
      const int j = __ffs(mask) - 1;
      mask &= mask - 1;
      const int r = rm + g + 8 * ((j >> 1) & 1);
      const u32 slot = atomicAdd(&cnt[r], 1u);
      if (slot < BCAP) buf[r * BCAP + slot] = peer_pack(pick(acc, 32, j), (u32)(base + 8 * (j >> 2) + (j & 1)));
    }
  }
  __syncthreads(); /* every buffer entry is in */
  if (!buffer_list(L, buf, cnt, mr, mq, t0 + mr < P.T)) return;
  /* an overflow (CTA-uniform): the exact scores again, every one at or
   * above the row's threshold offered to L (all zeros: buffer_list left
   * it), half a chunk (a warpgroup's 64 keys) at a time through the tile */
#pragma unroll 1
  for (int ci = 0; ci < nc; ci++) {
    const i64 c0 = (i64)ci * WG_CH;
    __syncthreads(); /* the stage's last readers and the tile's are done */
    wg_copy(stg, khi, row0, c0, ni, tid);
    CP_ASYNC_WAIT(0);
    wg_fence_proxy();
    __syncthreads();
    wg_scores(acc, qf, qls, stg, wg, 1);
#pragma unroll 1
    for (int h = 0; h < 2; h++) {
      if (h) __syncthreads(); /* the first half is merged */
      if (wg == h)
#pragma unroll
        for (int j = 0; j < 8; j++) {
          const int col = 8 * j + 2 * tq;
          st[(rm + g) * STS + col] = acc[4 * j];
          st[(rm + g) * STS + col + 1] = acc[4 * j + 1];
          st[(rm + g + 8) * STS + col] = acc[4 * j + 2];
          st[(rm + g + 8) * STS + col + 1] = acc[4 * j + 3];
        }
      __syncthreads();
      const i64 first = c0 + 64 * h + mq * CN, left = ni - first;
      offer_filtered(L, st + mr * STS + mq * CN, (u32)first, left < 0 ? 0 : left < CN ? (int)left : CN, 16, 2, rthr);
    }
  }
  row_merge(L, 16);
}

/* Dim i > 0's combination with the running list (route_rows): row mr's
 * entries a < len (values va, ids ia) with the dim's entries b < ki (L,
 * every thread of the row holding the whole list; ni keys), into L: the
 * row's best min(len ki, k) sums, id = ia[a] * ni + b. The dim's list goes
 * to shared memory over the score tile (st), so every warp must be done
 * with it. REG with rb (KL 16; ROWS x (RCAP + 1) u64 of shared memory
 * free until the call returns): the survivors of combine_threshold go to
 * slots and are ranked (combine_slots, rank_survivors); a warp with a row
 * of more than RCAP inserts them as without rb. The same list either
 * way. */
static __device__ __forceinline__ void combine_dim(u64 *L, float *st, const float *va, const u32 *ia, const int KL,
                                                   const int REG, int len, int ki, i64 ni, int k, int mr, int mq,
                                                   u64 *rb) {
  u64 *dl = (u64 *)st; /* [ROWS][KL] */
  __syncthreads();     /* every warp is done with the score tile */
#pragma unroll
  for (int j = 0; j < KL; j++)
    if ((j & 3) == mq) dl[mr * KL + j] = L[j];
  __syncwarp();
  u64 F[PEER_MAX_K];
#pragma unroll
  for (int j = 0; j < KL; j++) F[j] = 0;
  if (REG) {
    const float t = combine_threshold(L, va, len, ki, k, mq);
    if (rb) { /* the survivors ranked, unless some row of the warp had more than RCAP (warp-uniform) */
      u64 *rs = rb + mr * (RCAP + 1);
      const u32 n = combine_slots(va, ia, dl + mr * KL, len, ki, (u32)ni, t, mq, rs);
      __syncwarp();
      if (!__any_sync(PEER_FULL, n > RCAP)) {
        rank_survivors(L, rs, n, dl + mr * KL, mq, KL);
        return;
      }
    }
    combine_survivors(F, va, ia, dl + mr * KL, len, ki, (u32)ni, t, mq, KL);
  } else {
    for (int a = mq; a < len; a += 4) {
      const float v = va[a];
      const u32 pa = ia[a] * (u32)ni;
#pragma unroll
      for (int b0 = 0; b0 < KL; b0 += CN) {
        if (b0 >= ki) break;
        u64 c[CN];
#pragma unroll
        for (int j = 0; j < CN; j++) {
          const u64 e = b0 + j < ki ? dl[mr * KL + b0 + j] : 0ull;
          c[j] = e ? peer_pack(v + peer_packed_value(e), pa + peer_packed_id(e)) : 0ull;
        }
        offer(F, c, KL);
      }
    }
  }
  row_merge(F, KL);
#pragma unroll
  for (int j = 0; j < KL; j++) L[j] = F[j];
}

/* Row mr of the tile (token t0 + mr, head hh) from its final list L: ids,
 * scores and gates of its k entries. Every thread of the row computes the
 * gates and writes the entries j = its quarter mod 4 (L[j] by selects, so
 * that the warp runs KL / 4 bodies with every lane on instead of KL with a
 * quarter of them). */
static __device__ __forceinline__ void write_row(const peer_route_params &P, const u64 *L, const int KL, i64 t0,
                                                 i64 hh, int mr, int mq) {
  const int k = (int)P.k;
  const i64 t = t0 + mr;
  if (t >= P.T) return;
  float m = PEER_NEG_INF, sum = 0.f;
  if (P.gate == GATE_SOFTMAX) {
#pragma unroll
    for (int j = 0; j < KL; j++)
      if (j < k) m = fmaxf(m, peer_packed_value(L[j]));
#pragma unroll
    for (int j = 0; j < KL; j++)
      if (j < k) sum += expf(peer_packed_value(L[j]) - m);
  }
#pragma unroll
  for (int j0 = 0; j0 < KL; j0 += 4) {
    const int j = j0 + mq;
    if (j >= k) break;
    const u64 e = mq == 0 ? L[j0] : mq == 1 ? L[j0 + 1] : mq == 2 ? L[j0 + 2] : L[j0 + 3];
    const float s = peer_packed_value(e);
    const float g = P.gate == GATE_SOFTMAX ? expf(s - m) / sum
                    : P.gate == GATE_SIGMOID ? 1.f / (1.f + expf(-s))
                                             : fmaxf(s, 0.f);
    const i64 o = (t * P.h + hh) * P.k + j;
    ((i64 *)P.ids)[o] = (i64)peer_packed_id(e);
    if (P.scores) ((float *)P.scores)[o] = s;
    if (P.gates) ((float *)P.gates)[o] = g;
  }
}

/* The kernel body for lists of KL entries (16 or 32, a literal:
 * peer_route_reg, _buf and _wg for k <= 16, peer_route32_pre above). Each
 * row of the CTA's 64 is merged by four threads (row tid / 4, tile columns
 * 16 (tid % 4) ...), each keeping a list of its KL best in registers. The
 * key tiles come from peer_split_keys's bf16 hi/lo tables (khi, klo) by
 * cp.async, the next tile's copy issued as soon as the score phase is done
 * with the buffer so that it flies while the scores are merged, and the
 * tile merge takes offer_filtered.
 *
 * THR (a literal, 0 or 2; 2: peer_route_buf, _reg, _wg) scores each dim's
 * tiles twice. Pass 0 keeps, in registers, the largest score of each
 * accumulator column over the tiles (no score tile, no merge: the mma, 16
 * fmaxf and the barriers the copies need), and turns them into a per-row
 * threshold at or below the row's k-th best (row_kth). Pass 1 scores them
 * again (the same mma in the same order: the same bits) into per-row
 * buffers (~1.8% with random scores), sorted into the rows' lists once
 * per dim (buffer_list); if a row of the CTA overflowed its buffer, the
 * CTA runs pass 2, which merges the scores at or above the threshold
 * through the score tile. Same ids and scores as THR 0 bit for bit: the
 * lists are exact top-k of a subset that holds the row's top k.
 *
 * REG (a literal, with THR 2 and dpad <= 128: peer_route_reg) scores pass
 * 0 with the hi parts alone (one mma a fragment instead of 2 or 3) from
 * each warp's hi query fragments held in registers (loaded once per dim:
 * half the ldmatrix of a tile), lowering the threshold by row_err's bound
 * on the difference; skips the barrier after each tile's scores in passes
 * 0 and 1 but the last (the double-buffered copies need only the barrier
 * before); without lo keys, copies tiles by shifts when dpad is a power of
 * two and scores pass 1 with score_tile_u32 (u32 shared addresses, the
 * same mma order as THR 0's, so the same bits); and filters the dims'
 * combination (combine_threshold). The fallback pass computes the exact
 * scores as THR 0 does. kmax: peer_split_keys's largest key-row norms. */
static __device__ __forceinline__ void route_rows(const peer_route_params &P, const int KL, const int THR, u64 khi,
                                                  u64 klo, const int REG, u64 kmax,
                                                  const i64 t0, const i64 hh, const int LOOP, const int WG) {
  extern __shared__ __align__(16) float smem[];
  const i64 dsub = P.dsub;
  const int dpad = (int)((dsub + 15) & ~(i64)15), DS = dpad + 8;
  float *st = smem;                           /* [ROWS][STS]: the tile's scores */
  const int LS = WG ? 16 : PEER_MAX_K;       /* WG (k <= 16): lists of 16, so that two CTAs fit an SM */
  float *lv = st + ROWS * STS;                /* [ROWS][LS]: running list, scores */
  u32 *li = (u32 *)(lv + ROWS * LS);          /* [ROWS][LS]: running list, ids */
  smelt_h16 *qh = (smelt_h16 *)(li + ROWS * LS); /* [ROWS][DS]: this dim's query slice, hi part */
  smelt_h16 *ql = qh + ROWS * DS;             /* lo part */
  smelt_h16 *kh = ql + ROWS * DS;             /* [KT][DS]: a tile of sub-keys, hi part */
  smelt_h16 *kl = kh + KT * DS;               /* lo part */
  /* In peer_route_beside's tile loop the thread index is read by volatile
   * asm, so that the compiler cannot hoist what derives from it out of the
   * body (held across the loop, those values raised the spill from 20 to
   * 150 bytes; 80 this way). */
  int tid = threadIdx.x;
  if (LOOP) asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;     /* mma fragment coordinates */
  const int rm = (warp >> 1) * 16, cn = (warp & 1) * 32; /* the warp's 16 rows x 32 keys of the tile */
  const i64 hd = P.h * P.dq;
  const int k = (int)P.k;
  const int mr = tid >> 2, mq = tid & 3; /* the merge's row and quarter */
  u64 L[PEER_MAX_K];
  const int key_lo = P.key_l2 || P.key_dt != SMELT_DT_BF16; /* keys not exact in bf16 */
  const u32 qh_s = smem_u32(qh), kh_s = smem_u32(kh), kl_s = smem_u32(kl); /* REG: shared addresses */
  /* WG: the lo slice and the stages past the lists, 1024-byte aligned for wgmma's swizzle */
  const u32 qls = (smem_u32(li + ROWS * LS) + 1023u) & ~1023u, stg = qls + 2 * WG_QPANEL;
  const int pow2 = (dpad & (dpad - 1)) == 0, dsh = __ffs(dpad) - 1; /* REG: tile_copy_pow2 applies; log2(dpad) */
  float *q = (float *)P.q;

  for (int r = warp; r < ROWS; r += NWARPS)
    if (t0 + r < P.T) normalize_row(P, q + (t0 + r) * hd + hh * P.dq, hh, lane);

  i64 len = 0; /* entries of the running list (min(k, n_0 * ... * n_i)) */
  for (int i = 0; i < P.p; i++) {
    const i64 ni = P.n[i];
    const int ki = (int)(ni < P.k ? ni : P.k);
    __syncthreads(); /* the normalized rows are visible; the previous dim's readers of qh, ql are done */
    int overflow = 0; /* THR 2: some row of the CTA had more than BCAP (CTA-uniform) */
    if (WG) {
#pragma unroll
      for (int j = 0; j < KL; j++) L[j] = 0;
      wg_dim(P, i, t0, hh, khi, kmax, st, qls, stg, L, tid, 0);
    } else {
    /* QB loads a thread in flight before the first split: one at a time,
     * each waited for, this loop took ~15% of reg's stall samples (ncu).
     * REG, when the slice is whole 16-byte vectors (dsub = dpad, dq a
     * multiple of 4, q 16-byte aligned): QB float4 loads a thread, at
     * dpad 128 the whole slice in one round of loads, and 8-byte stores of
     * 4 split values (the same split_bf16 per value: the same bits). */
    if (REG && pow2 && dsub == dpad && (P.dq & 3) == 0 && (P.q & 15) == 0) {
      for (int x0 = tid; x0 < ROWS * dpad / 4; x0 += QB * NT) {
        float4 v[QB];
#pragma unroll
        for (int u = 0; u < QB; u++) {
          const int x = 4 * (x0 + u * NT), r = x >> dsh, d = x - (r << dsh);
          const i64 t = t0 + r;
          v[u] = x < ROWS * dpad && t < P.T ? *(const float4 *)&q[t * hd + hh * P.dq + i * dsub + d]
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < QB; u++) {
          const int x = 4 * (x0 + u * NT), r = x >> dsh, d = x - (r << dsh);
          if (x < ROWS * dpad) split4_bf16(v[u], &qh[r * DS + d], &ql[r * DS + d]);
        }
      }
    } else {
      for (int x0 = tid; x0 < ROWS * dpad; x0 += QB * NT) {
        float v[QB];
#pragma unroll
        for (int u = 0; u < QB; u++) {
          const int x = x0 + u * NT;
          const int r = REG && pow2 ? x >> dsh : x / dpad, d = x - r * dpad; /* REG: no division when it can shift */
          const i64 t = t0 + r;
          v[u] = x < ROWS * dpad && t < P.T && d < dsub ? q[t * hd + hh * P.dq + i * dsub + d] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < QB; u++) {
          const int x = x0 + u * NT;
          const int r = REG && pow2 ? x >> dsh : x / dpad, d = x - r * dpad;
          if (x < ROWS * dpad) split_bf16(v[u], &qh[r * DS + d], &ql[r * DS + d]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < KL; j++) L[j] = 0;
    const i64 row0 = split_row0(P, i, hh);
    tile_copy(kh, kl, khi, klo, row0, 0, ni, dpad, DS, key_lo, tid);
    u32 qf[QK][4]; /* REG, pass 0: the warp's hi query fragments */
    float rthr = PEER_NEG_INF; /* THR: the merge row's threshold (<= its ki-th best score) */
    float rt[2];               /* THR 2: the thresholds of the mma rows rm + g and rm + g + 8 */
    float gm[4][4];            /* THR, pass 0: the largest score of each accumulator's column, over the tiles */
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) gm[nt][e] = PEER_NEG_INF;
    u64 *buf = (u64 *)st;                  /* THR 2, pass 1: [ROWS][BCAP] the rows' scores >= threshold */
    u32 *cnt = (u32 *)(buf + ROWS * BCAP); /* [ROWS]: how many each row has (past BCAP: overflow) */
    /* pass 0: THR's column maxima; 1: THR 2's buffered scores; 2: the
     * merge through the score tile (THR 2: only after an overflow) */
#pragma unroll
    for (int pass = THR ? 0 : 2; pass < 3; pass++) {
      if (pass == 2 && THR == 2) {
        if (!overflow) break;
        tile_copy(kh, kl, khi, klo, row0, 0, ni, dpad, DS, key_lo, tid);
      }
      /* THR's passes 0 and 1 without lo keys: kl is free, so the tiles
       * alternate between kh (even) and kl (odd) and each tile's copy is
       * issued before the previous tile's scores (those passes have no
       * merge for a copy to fly behind) */
      const int db = THR && pass < 2 && !key_lo;
      if (REG && pass == 0) {
        __syncthreads(); /* qh, ql are written */
        load_query_frags(qf, qh, DS, dpad, rm, lane);
      }
      /* REG, dpad 128: the thread's row and chunk of the next tile in the
       * split table, advanced a tile an iteration (tile_copy_pow2 would
       * rebuild it from c0: ~20 instructions a tile) */
      const smelt_h16 *knext = (const smelt_h16 *)khi + (row0 + KT + (tid >> 4)) * 128 + (tid & 15) * 8;
      for (i64 c0 = 0; c0 < ni; c0 += KT, knext += KT * 128) {
        const int odd = db && ((c0 / KT) & 1);
        CP_ASYNC_WAIT(0);
        __syncthreads(); /* the last tile's scores were merged (and qh, ql are written) */
        if (db && c0 + KT < ni) { /* into the buffer the last tile used: every warp is past it */
          if (REG && dpad == 128 && c0 + 2 * KT <= ni) tile_copy_full(odd ? kh_s : kl_s, knext, 128, 136, tid);
          else if (REG && dpad == 128) tile_copy_pow2(odd ? kh_s : kl_s, khi, row0, c0 + KT, ni, 128, 136, tid);
          else if (REG && pow2) tile_copy_pow2(odd ? kh_s : kl_s, khi, row0, c0 + KT, ni, dpad, DS, tid);
          else tile_copy(odd ? kh : kl, kl, khi, klo, row0, c0 + KT, ni, dpad, DS, 0, tid);
        }
        const int lim = ni - c0 < KT ? (int)(ni - c0) : KT; /* the tile's keys */
        /* REG: dsub 128 (the common query_dim 256 over 2 dims) as a literal,
         * so that the k steps have no run-time bound to test */
        if (REG && pass == 0) {
          if (dpad == 128 && lim == KT) colmax_tile_reg(gm, qf, odd ? kl_s : kh_s, DS, 128, cn, lane, tq, KT, 1);
          else if (dpad == 128) colmax_tile_reg(gm, qf, odd ? kl_s : kh_s, DS, 128, cn, lane, tq, lim, 0);
          else colmax_tile_reg(gm, qf, odd ? kl_s : kh_s, DS, dpad, cn, lane, tq, lim, 0);
        } else if (REG && pass == 1 && db) {
          float acc[4][4];
#pragma unroll
          for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[nt][e] = 0.f;
          if (dpad == 128) score_tile_u32(acc, qh_s, odd ? kl_s : kh_s, DS, 128, rm, cn, lane);
          else score_tile_u32(acc, qh_s, odd ? kl_s : kh_s, DS, dpad, rm, cn, lane);
          if (lim == KT) buffer_tile(acc, rt, buf, cnt, (u32)c0, rm, cn, g, tq, KT, 1);
          else buffer_tile(acc, rt, buf, cnt, (u32)c0, rm, cn, g, tq, lim, 0);
        } else {
          float acc[4][4];
#pragma unroll
          for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[nt][e] = 0.f;
          if (THR) score_tile_ldsm(acc, qh, ql, odd ? kl : kh, kl, DS, dpad, rm, cn, lane, key_lo);
          for (int k0 = 0; !THR && k0 < dpad; k0 += 16) {
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
          if (pass == 0) { /* THR's first pass: only the column maxima (fmaxf skips NaN) */
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
              for (int e = 0; e < 4; e++)
                if (c0 + cn + nt * 8 + 2 * tq + (e & 1) < ni) gm[nt][e] = fmaxf(gm[nt][e], acc[nt][e]);
          } else if (pass == 1) { /* THR 2: the scores >= the row's threshold (NaN too) to its buffer */
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
              for (int e = 0; e < 4; e++) {
                const int col = cn + nt * 8 + 2 * tq + (e & 1), r = rm + g + 8 * (e >> 1);
                if (c0 + col < ni && !(acc[nt][e] < rt[e >> 1])) {
                  const u32 slot = atomicAdd(&cnt[r], 1u);
                  if (slot < BCAP) buf[r * BCAP + slot] = peer_pack(acc[nt][e], (u32)(c0 + col));
                }
              }
          } else {
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
              const int col = cn + nt * 8 + 2 * tq;
              st[(rm + g) * STS + col] = acc[nt][0];
              st[(rm + g) * STS + col + 1] = acc[nt][1];
              st[(rm + g + 8) * STS + col] = acc[nt][2];
              st[(rm + g + 8) * STS + col + 1] = acc[nt][3];
            }
          }
        }
        /* the scores are in st (or buf); kh, kl are free (REG's passes 0
         * and 1 but the last tile: the next tile's barrier is enough) */
        if (!(REG && db && c0 + KT < ni)) __syncthreads();
        if (c0 + KT < ni) {
          if (!db) tile_copy(kh, kl, khi, klo, row0, c0 + KT, ni, dpad, DS, key_lo, tid);
        } else if (pass == 0) tile_copy(kh, kl, khi, klo, row0, 0, ni, dpad, DS, key_lo, tid); /* the next pass's */
        if (pass < 2) {
          if (c0 + KT < ni) continue;
          if (pass == 1) {
            overflow = buffer_list(L, buf, cnt, mr, mq, t0 + mr < P.T);
          } else if (!REG) {
            rthr = buf_threshold(gm, st, cnt, k, rm, cn, g, tq, mr, mq, 0.f, rt);
          }
          continue;
        }
        const i64 left = ni - c0 - mq * CN;
        offer_filtered(L, st + mr * STS + mq * CN, (u32)(c0 + mq * CN), left < CN ? (int)left : CN, KL, THR, rthr);
      }
      if (REG && pass == 0) { /* after the loop, so that rt and rthr are not carried through it (spills) */
        const i64 grp = key_group(P, i, hh);
        const float err = row_err(qh, ql, DS, dpad, mr, mq, ((const float *)kmax)[2 * grp],
                                  ((const float *)kmax)[2 * grp + 1]);
        rthr = buf_threshold(gm, st, cnt, k, rm, cn, g, tq, mr, mq, err, rt);
      }
    }
    if (THR != 2 || overflow) row_merge(L, KL); /* buffer_list's lists are the rows' already */
    } /* !WG (wg_dim's lists are the rows') */
    if (i > 0) {
      /* WG: the survivors' slots in the stages, idle until the next dim's wg_dim */
      u64 *rb = WG ? (u64 *)((char *)smem + (stg - smem_u32(smem))) : 0;
      combine_dim(L, st, lv + mr * LS, li + mr * LS, KL, REG, (int)len, ki, ni, k, mr, mq, rb);
      const i64 total = len * ki;
      len = total < P.k ? total : P.k;
    } else {
      len = ki;
    }
    if (i + 1 < P.p) {
      __syncwarp();
#pragma unroll
      for (int j = 0; j < KL; j++)
        if ((j & 3) == mq && j < len) {
          lv[mr * LS + j] = peer_packed_value(L[j]);
          li[mr * LS + j] = peer_packed_id(L[j]);
        }
    }
  }
  write_row(P, L, KL, t0, hh, mr, mq);
}

/* The exact k-th column maximum as the threshold, the scores above it to
 * per-row buffers (k <= 16, dsub > 128, where reg's fragments do not fit
 * its registers). At most 128 registers, for 2 CTAs an SM (unbounded it
 * takes more; no spill). */
extern "C" __global__ void __launch_bounds__(NT, 2) peer_route_buf(peer_route_params P, u64 khi, u64 klo) {
  route_rows(P, 16, 2, khi, klo, 0, 0, TILE_T0, TILE_H, 0, 0);
}
/* buf with the query fragments in registers, an approximate first pass and
 * one barrier a tile (k <= 16, dsub <= 128; kmax from peer_split_keys). */
extern "C" __global__ void __launch_bounds__(NT, 2) peer_route_reg(peer_route_params P, u64 khi, u64 klo, u64 kmax) {
  route_rows(P, 16, 2, khi, klo, 1, kmax, TILE_T0, TILE_H, 0, 0);
}
/* reg with wgmma scores (the default on Hopper where it applies: k <= 16,
 * dpad 128, bf16 keys without L2 normalization; route_rows's WG). */
extern "C" __global__ void __launch_bounds__(NT, 2) peer_route_wg(peer_route_params P, u64 khi, u64 klo, u64 kmax) {
  route_rows(P, 16, 2, khi, klo, 1, kmax, TILE_T0, TILE_H, 0, 1);
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/* Beside the experts the routing's tiles (b h + hh: head hh of token block
 * b) run in the order the expert warps need them. A warp takes a token's
 * uses head by head, so with G = P.ready_groups > 1 it can start on the
 * token once the first h / G heads are routed: the tiles then run in
 * rounds of P.ready_round blocks (the blocks of the expert warps' first
 * tokens), each round's first head group for every block, then its
 * second, ..., and `ready` counts each block's groups apart
 * (ready[b G + g]). The first wave of routing units thus feeds every
 * expert warp instead of half of them (docs/PERF.md, PEER version 16).
 * With G = 1 (and any round) the order is b h + hh. Sequence index i ->
 * tile; *b, *hh. */
static __device__ __forceinline__ int route_tile(const peer_route_params &P, int blocks, int i, int *b, int *hh) {
  const int h = (int)P.h, G = P.ready_groups;
  const int R = P.ready_round, hg = h / G, r = i / (R * h), j = i - r * R * h;
  const int nb = min(R, blocks - r * R), g = j / (nb * hg), jj = j - g * nb * hg, bi = jj / hg;
  *b = r * R + bi;
  *hh = g * hg + (jj - bi * hg);
  return *b * h + *hh;
}
/* The counter of head hh's group in block b. */
static __device__ __forceinline__ int ready_index(const peer_route_params &P, int b, int hh) {
  return b * P.ready_groups + hh / ((int)P.h / P.ready_groups);
}
/* reg beside peer_expert_fwd_bulk8 (Hopper; src/cuda/peer_select.c): persistent,
 * the tiles in route_tile's order; `ready` counts a block's (group's)
 * heads done. The expert kernel, launched after this one as its
 * programmatic dependent, is let in once every CTA of this grid has
 * started (launch_dependents): its waits on the counters then cannot hold
 * back a routing CTA that has no SM. */
static __device__ __forceinline__ void route_beside(const peer_route_params &P, u64 khi, u64 klo, u64 kmax, u64 ready,
                                                    const int WG) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int blocks = (int)((P.T + ROWS - 1) / ROWS), tiles = blocks * (int)P.h;
#pragma unroll 1
  for (int i = blockIdx.x; i < tiles; i += gridDim.x) {
    int b, hh;
    route_tile(P, blocks, i, &b, &hh);
    route_rows(P, 16, 2, khi, klo, 1, kmax, (i64)b * ROWS, hh, 1, WG);
    /* count this head of the block done once every thread's ids and
     * gates are visible device-wide (the barrier also ends the tile's
     * reads of shared memory before the next tile writes it) */
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd((int *)ready + ready_index(P, b, hh), 1);
  }
}
extern "C" __global__ void __launch_bounds__(NT, 2) peer_route_beside(peer_route_params P, u64 khi, u64 klo, u64 kmax,
                                                                      u64 ready) {
  route_beside(P, khi, klo, kmax, ready, 0);
}
/* wg's persistent form, as reg's above */
extern "C" __global__ void __launch_bounds__(NT, 2) peer_route_wg_beside(peer_route_params P, u64 khi, u64 klo,
                                                                         u64 kmax, u64 ready) {
  route_beside(P, khi, klo, kmax, ready, 1);
}
/* wg's persistent form with a tile's two dims apart (p = 2 and no query
 * normalization, which would rewrite the rows both units read): unit
 * 2 tile + d scores dim d of the tile (wg_dim) and leaves its rows' lists
 * in xl ([tiles][2][ROWS][16], packed); the tile's second unit to finish
 * (its counter in tcnt) combines the two lists and writes the rows, so a
 * tile's latency is one dim's plus the combination instead of both dims'
 * (the experts beside wait for the first tiles). The lists, the
 * combination and the gates are route_rows's: the same ids, scores and
 * gates bit for bit. Returns whether this unit finished the tile
 * (CTA-uniform). */
static __device__ __forceinline__ int route_dim_unit(const peer_route_params &P, u64 khi, u64 kmax, u64 *xl, int *tcnt,
                                                     int tile, i64 t0, i64 hh, int d, const int PJ) {
  extern __shared__ __align__(16) float smem[];
  float *st = smem, *lv = st + ROWS * STS;
  /* the count this unit saw: past wg_dim's hi query slice (16 KiB), inside
   * the score tile that only wg_dim's overflow pass writes */
  volatile int *last = (volatile int *)(st + ROWS * 64);
  u32 *li = (u32 *)(lv + ROWS * 16);
  int tid; /* read by volatile asm, as route_rows's LOOP does */
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int mr = tid >> 2, mq = tid & 3, k = (int)P.k;
  u64 L[16];
#pragma unroll
  for (int j = 0; j < 16; j++) L[j] = 0;
  const u32 qls = (smem_u32(li + ROWS * 16) + 1023u) & ~1023u, stg = qls + 2 * WG_QPANEL;
  wg_dim(P, d, t0, hh, khi, kmax, st, qls, stg, L, tid, PJ);
  u64 *mine = xl + ((i64)(2 * tile + d) * ROWS + mr) * 16;
#pragma unroll
  for (int j = 0; j < 16; j++)
    if ((j & 3) == mq) __stcg((unsigned long long *)mine + j, L[j]);
  __threadfence(); /* the lists are visible device-wide before the count says so */
  __syncthreads();
  if (tid == 0) *last = atomicAdd(tcnt + tile, 1);
  __syncthreads();
  if (!*last) return 0;
  __threadfence();
  const u64 *other = xl + ((i64)(2 * tile + 1 - d) * ROWS + mr) * 16;
  const int k0 = (int)(P.n[0] < P.k ? P.n[0] : P.k), k1 = (int)(P.n[1] < P.k ? P.n[1] : P.k);
  float *va = lv + mr * 16;
  u32 *ia = li + mr * 16;
  /* dim 0's list to the running list (lv, li), dim 1's in L */
#pragma unroll
  for (int j = 0; j < 16; j++)
    if ((j & 3) == mq && j < k0) {
      const u64 e = d ? __ldcg((const unsigned long long *)other + j) : L[j];
      va[j] = peer_packed_value(e);
      ia[j] = peer_packed_id(e);
    }
  if (!d)
#pragma unroll
    for (int j = 0; j < 16; j++) L[j] = __ldcg((const unsigned long long *)other + j);
  __syncwarp();
  /* the survivors' slots in the stages, idle until the next unit's wg_dim */
  u64 *rb = (u64 *)((char *)smem + (stg - smem_u32(smem)));
  combine_dim(L, st, va, ia, 16, 1, k0, k1, P.n[1], k, mr, mq, rb);
  write_row(P, L, 16, t0, hh, mr, mq);
  return 1;
}
/* Units in order (a tile's two dims together, the tiles in route_tile's
 * order), `ready` counting as route_beside's. Each CTA's first unit is its
 * index, the later ones come from a counter: with a fixed stride the same
 * CTAs would finish the same tiles' pairs, each late by a combination, and
 * fall further behind every round (slower than route_wg_beside's whole
 * tiles: docs/PERF.md, PEER: routing). The tiles' counters and that one
 * follow the blocks' in the same zeroed workspace. */
static __device__ __forceinline__ void route_split(const peer_route_params &P, u64 khi, u64 kmax, u64 ready, u64 xl,
                                                   const int PJ) {
  extern __shared__ __align__(16) float smem[];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int blocks = (int)((P.T + ROWS - 1) / ROWS), tiles = blocks * (int)P.h;
  int *tcnt = (int *)ready + blocks * P.ready_groups, *next = tcnt + tiles;
  volatile int *un = (volatile int *)(smem + ROWS * 64 + 1); /* the next unit (route_dim_unit's word, then this) */
#pragma unroll 1
  for (int u = blockIdx.x; u < 2 * tiles;) {
    int b, hh;
    const int tile = route_tile(P, blocks, u >> 1, &b, &hh);
    const int done = route_dim_unit(P, khi, kmax, (u64 *)xl, tcnt, tile, (i64)b * ROWS, hh, u & 1, PJ);
    __threadfence();
    __syncthreads(); /* every thread's rows are visible; the unit's reads of shared memory are done */
    if (threadIdx.x == 0) {
      if (done) atomicAdd((int *)ready + ready_index(P, b, hh), 1);
      *un = (int)gridDim.x + atomicAdd(next, 1);
    }
    __syncthreads();
    u = *un;
  }
}
extern "C" __global__ void __launch_bounds__(NT, 2) peer_route_wg_split(peer_route_params P, u64 khi, u64 klo,
                                                                        u64 kmax, u64 ready, u64 xl) {
  route_split(P, khi, kmax, ready, xl, 0);
}
/* The same with each unit's query slice projected in the unit (wg_project;
 * P.x, P.wt; bf16): no q in HBM and no projection GEMM before the
 * routing. Both the forward beside the experts and the one without
 * (and retrieve) take it where it applies, so their ids agree bit for bit. */
extern "C" __global__ void __launch_bounds__(NT, 2) peer_route_wg_split_pj(peer_route_params P, u64 khi, u64 klo,
                                                                           u64 kmax, u64 ready, u64 xl) {
  route_split(P, khi, kmax, ready, xl, 1);
}
#endif
/* Lists of 32 for k > 16, one pass over the tiles. At most 128 registers
 * (2 CTAs an SM where the shared memory allows; unbounded it takes 152): 8
 * bytes of spill. */
extern "C" __global__ void __launch_bounds__(NT, 2) peer_route32_pre(peer_route_params P, u64 khi, u64 klo) {
  route_rows(P, 32, 0, khi, klo, 0, 0, TILE_T0, TILE_H, 0, 0);
}

/* Every sub-key row of every dim (and head, when per head), rows in
 * split_row0's order, as bf16 hi and lo parts [rows][dpad] (L2-normalized
 * first when asked, zero past dsub) for the routing kernels: once per call
 * instead of once per CTA and tile. A warp per row. kmax (f32
 * [tables][2], zeroed by the caller; 0 = not wanted): the largest hi and lo
 * row norms of each table (key_group's order), for peer_route_reg. */
static __device__ __forceinline__ void split_keys(const peer_route_params &P, u64 khi, u64 klo, i64 rows, u64 kmax,
                                                  i64 blk) {
  __shared__ float wn[NWARPS][2];
  __shared__ i64 wg[NWARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 row = blk * NWARPS + warp;
  i64 grp = -1;
  if (row < rows) { /* warp-uniform */
    const i64 dsub = P.dsub;
    const int dpad = (int)((dsub + 15) & ~(i64)15);
    int i = 0;
    i64 r = row;
    while (i + 1 < P.p && r >= (P.key_hs[i] ? P.h : 1) * P.n[i]) {
      r -= (P.key_hs[i] ? P.h : 1) * P.n[i];
      i++;
    }
    smelt_h16 *hi = (smelt_h16 *)khi + row * dpad, *lo = (smelt_h16 *)klo + row * dpad;
    split_key_row(P, i, r * dsub, true, dpad, lane, hi, lo);
    if (kmax) {
      /* the row's hi and lo L2 norms (each lane reads back the elements it
       * wrote); non-finite ones as +inf, so that route_rows's bound is +inf
       * too */
      float sh = 0.f, sl = 0.f;
      for (int d = lane; d < dpad; d += 32) {
        const float h = smelt_bf16_to_f32(hi[d]), l = smelt_bf16_to_f32(lo[d]);
        sh += h * h;
        sl += l * l;
      }
      const float nh = sqrtf(smelt_warp_sum(sh)), nl = sqrtf(smelt_warp_sum(sl));
      grp = key_group(P, i, P.key_hs[i] ? r / P.n[i] : 0);
      if (lane == 0) {
        wn[warp][0] = nh <= 3.402823466e38f ? nh : __int_as_float(0x7f800000);
        wn[warp][1] = nl <= 3.402823466e38f ? nl : __int_as_float(0x7f800000);
      }
    }
  }
  if (!kmax) return; /* grid-uniform */
  if (lane == 0) wg[warp] = grp;
  __syncthreads();
  /* into the tables' running maxima, one atomic per table and CTA (a CTA's
   * rows are consecutive, so each table's are one run); non-negative floats
   * order as their bits */
  if (threadIdx.x < 2) {
    const int c = threadIdx.x;
    float m = 0.f;
    for (int w = 0; w < NWARPS; w++) {
      if (wg[w] < 0) break;
      m = fmaxf(m, wn[w][c]);
      if (w + 1 == NWARPS || wg[w + 1] != wg[w]) {
        atomicMax((int *)kmax + 2 * wg[w] + c, __float_as_int(m));
        m = 0.f;
      }
    }
  }
}
extern "C" __global__ void __launch_bounds__(NT) peer_split_keys(peer_route_params P, u64 khi, u64 klo, i64 rows,
                                                                u64 kmax) {
  split_keys(P, khi, klo, rows, kmax, blockIdx.x);
}

/* peer_split_keys and Wq's K-major copy (P.wt, for peer_route_wg_split_pj)
 * in one launch: blocks below the transpose's tiles (ceil(h dq / 64) x
 * ceil(din / 64)) copy a tile of Wq (wq, strides rs, cs), the rest split
 * key rows as peer_split_keys's blocks. One kernel where there were two
 * one after the other (docs/PERF.md, PEER: routing, peer_route_prep). */
extern "C" __global__ void __launch_bounds__(NT) peer_route_prep(peer_route_params P, u64 khi, u64 klo, i64 rows,
                                                                u64 kmax, u64 wq, i64 rs, i64 cs) {
  const i64 hd = P.h * P.dq, tx = (hd + PEER_TR_TILE - 1) / PEER_TR_TILE;
  const i64 nt = tx * ((P.din + PEER_TR_TILE - 1) / PEER_TR_TILE), b = blockIdx.x;
  if (b < nt) peer_transpose_tile(wq, P.din, hd, rs, cs, P.wt, b % tx, b / tx);
  else split_keys(P, khi, klo, rows, kmax, b - nt);
}

/* ---------------------------------------------------------------- backward */

#define RB_WARPS 8 /* rows (warps) per CTA of the per-row kernels */
/* peer_route_bwd's layout against the host's size: dq floats a warp, then
 * a warp's digits (i64) and key scales (f32), PEER_MAX_K x PEER_MAX_DIMS each. */
static_assert(sizeof(float) * RB_WARPS == SMELT_PEER_SMEM_RBWD_DQ &&
                  (sizeof(i64) + sizeof(float)) * RB_WARPS * PEER_MAX_K * PEER_MAX_DIMS == SMELT_PEER_SMEM_RBWD,
              "peer_route_bwd's layout must take the host's SMELT_PEER_SMEM_RBWD_DQ dq + SMELT_PEER_SMEM_RBWD bytes");

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
