/* The MoE router's selection of one token's experts, a warp's work, shared
 * by the router (moe_route.cu, after its GEMM) and the decode path's
 * routing (moe_decode.cu, after its own x·Wr), so both choose alike.
 *
 * Order (smelt/moe.h, as the CPU reference's): larger key first, NaN above
 * everything, equal keys by lower expert id. Lane l holds experts
 * l + 32 j, j < MOE_ITEMS, in registers; a round of selection is one
 * butterfly reduction of (key, score, id) under that total order, so every
 * lane ends with the same winner. Arithmetic is f32 (the CPU's double), so
 * weights agree to about 1e-6 and ids but at near-ties.
 *
 * Prelude: MOE_ITEMS (experts per lane: E <= 32 MOE_ITEMS). */
#ifndef SMELT_MOE_ROUTE_CUH
#define SMELT_MOE_ROUTE_CUH

#include "smelt_device.cuh"

#if !defined(MOE_ITEMS)
#error "moe_route.cuh needs MOE_ITEMS"
#endif

#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

/* A candidate: its selection key, its score and its expert (-1: none). */
typedef struct cand {
  float key, s;
  int id;
} cand;

static __device__ __forceinline__ bool better(const cand &a, const cand &b) {
  if (b.id < 0) return a.id >= 0;
  if (a.id < 0) return false;
  const bool an = a.key != a.key, bn = b.key != b.key;
  if (an != bn) return an;
  if (!an && a.key != b.key) return a.key > b.key;
  return a.id < b.id;
}

static __device__ __forceinline__ cand warp_best(cand c) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    cand d;
    d.key = __shfl_xor_sync(FULL, c.key, o);
    d.s = __shfl_xor_sync(FULL, c.s, o);
    d.id = __shfl_xor_sync(FULL, c.id, o);
    if (better(d, c)) c = d;
  }
  return c;
}

/* The best of this lane's experts whose bit is set in `open`. */
static __device__ __forceinline__ cand lane_best(const float *key, const float *s, unsigned open, int lane) {
  cand c = {0.f, 0.f, -1};
#pragma unroll
  for (int j = 0; j < MOE_ITEMS; j++) {
    const cand d = {key[j], s[j], lane + 32 * j};
    if (((open >> j) & 1u) && better(d, c)) c = d;
  }
  return c;
}

/* The groups a token may choose from (group-limited routing): a group's
 * score is the sum of its `per` largest keys; the tg best groups win.
 * Returns the mask of this lane's experts in them. G <= 32. */
static __device__ unsigned group_mask(const float *key, const float *s, unsigned valid, int lane, int E, int G, int tg,
                                      int per) {
  const int size = E / G;
  float mine = 0.f; /* lane g: group g's score */
  for (int g = 0; g < G; g++) {
    unsigned open = 0;
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++) open |= (unsigned)((lane + 32 * j) / size == g) << j;
    open &= valid;
    float sum = 0.f;
    for (int i = 0; i < per; i++) {
      const cand w = warp_best(lane_best(key, s, open, lane));
      sum += w.key;
      if (w.id >= 0 && (w.id & 31) == lane) open &= ~(1u << (w.id >> 5));
    }
    if (lane == g) mine = sum;
  }
  unsigned chosen = 0; /* bits over groups, the same in every lane */
  for (int i = 0; i < tg; i++) {
    cand c = {mine, 0.f, lane < G && !((chosen >> lane) & 1u) ? lane : -1};
    chosen |= 1u << warp_best(c).id;
  }
  unsigned mask = 0;
#pragma unroll
  for (int j = 0; j < MOE_ITEMS; j++) {
    const int g = (lane + 32 * j) / size; /* past E (g >= G: invalid experts) no group */
    if (g < G) mask |= ((chosen >> g) & 1u) << j;
  }
  return mask & valid;
}

/* An index output of i32 or i64 (counts, offsets, dropped). */
static __device__ __forceinline__ void store_index(void *p, int is64, i64 i, i64 v) {
  if (is64) ((i64 *)p)[i] = v;
  else ((int *)p)[i] = (int)v;
}

/* One token's routing from its logits, a warp's: lane l holds experts
 * l + 32 j (j < MOE_ITEMS) in l[j], NEG_INF where e >= E (valid's bit j
 * clear). The scores (softmax in f32 over the valid experts, or sigmoid),
 * the keys s + bias, the group-limited top-k of the keys and the weights,
 * renormalized where the config says, times scaling. Lane i < k ends with
 * slot i's expert in *id and its weight in *w (the other lanes' are
 * unspecified). */
static __device__ __forceinline__ void route_select(const float *l, unsigned valid, const float *bias, int lane,
                                                    int E, int k, int sigmoid, int renorm, float scaling,
                                                    int groups, int topk_groups, int *id, float *w) {
  float s[MOE_ITEMS], key[MOE_ITEMS];
  if (!sigmoid) {
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++)
      if ((valid >> j) & 1u) m = fmaxf(m, l[j]);
    m = smelt_warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++) sum += s[j] = ((valid >> j) & 1u) && m != NEG_INF ? expf(l[j] - m) : 0.f;
    sum = smelt_warp_sum(sum);
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++) s[j] = sum > 0.f ? s[j] / sum : 0.f;
  } else {
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++) s[j] = 1.f / (1.f + expf(-l[j]));
  }
#pragma unroll
  for (int j = 0; j < MOE_ITEMS; j++) {
    const int e = lane + 32 * j;
    key[j] = s[j] + (bias && e < E ? bias[e] : 0.f);
  }
  unsigned open = groups ? group_mask(key, s, valid, lane, E, groups, topk_groups, k / topk_groups) : valid;
  int my_id = -1;
  float my_u = 0.f, z = sigmoid ? 1e-20f : 0.f;
  for (int i = 0; i < k; i++) {
    const cand c = warp_best(lane_best(key, s, open, lane));
    if (c.id >= 0 && (c.id & 31) == lane) open &= ~(1u << (c.id >> 5));
    if (lane == i) my_id = c.id, my_u = c.s;
    z += c.s;
  }
  const bool norm = sigmoid ? k > 1 : renorm != 0;
  *id = my_id;
  *w = (norm ? my_u / z : my_u) * scaling;
}

#endif /* SMELT_MOE_ROUTE_CUH */
