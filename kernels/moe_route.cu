/* The MoE router after its GEMM: per token, the noise (noisy top-k), the
 * scores, the group-limited top-k of score + bias and the routing weights
 * (moe_route, one warp per token); then each expert's token count and the
 * offsets, their exclusive prefix sum (moe_counts, one block); and the aux
 * losses' values (moe_aux_columns, moe_aux_final: double sums in a fixed
 * order, so they repeat bit for bit). Nothing waits for the host: the
 * counts never leave the device.
 *
 * The backward (moe_route_bwd, one warp per token): d logits from the
 * routing weights' gradient through scaling, renormalization and the score
 * function, the selection a constant (the forward's, before drops, given),
 * plus the aux losses' gradients; moe_noise_grad: the gradient of the
 * noise's scale projection, n · sigmoid(x·Wnoise) · d logits.
 *
 * The selection itself (its order, ties and arithmetic) is moe_route.cuh's,
 * which the decode path's routing (moe_decode.cu) shares. The noise is
 * Philox-4x32-10 keyed by the seed, counter (e, token, 0, 0), Box-Muller
 * in double: the CPU's definition.
 *
 * Prelude: MOE_ITEMS (experts per lane: E <= 32 MOE_ITEMS). */
#include "moe_route.cuh"
#include "philox.cuh"

static __device__ float normal(u64 seed, i64 token, int e) {
  return (float)smelt_philox_normal(seed, (u64)token, (u32)e);
}

/* logits [T, E] f32 (in: x·Wr; out: with the noise when zpre is given),
 * zpre [T, E] f32 x·Wnoise or NULL, bias [E] f32 or NULL; ids [T, k] i32
 * and weights [T, k] f32 out; lse [T] (or NULL, without aux losses) the
 * logsumexp of each token's logits, in double. */
extern "C" __global__ void moe_route(float *logits, const float *zpre, const float *bias, int *ids, float *weights,
                                     i64 T, int E, int k, int sigmoid, int renorm, float scaling, int groups,
                                     int topk_groups, u64 seed, i64 token0, double *lse) {
  const int lane = threadIdx.x & 31;
  const i64 t = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= T) return;
  float l[MOE_ITEMS];
  unsigned valid = 0;
  float m = NEG_INF;
#pragma unroll
  for (int j = 0; j < MOE_ITEMS; j++) {
    const int e = lane + 32 * j;
    l[j] = NEG_INF;
    if (e < E) {
      valid |= 1u << j;
      l[j] = logits[t * E + e];
      if (zpre) {
        const float z = zpre[t * E + e];
        l[j] += normal(seed, token0 + t, e) * (z > 30.f ? z : log1pf(expf(z)));
        logits[t * E + e] = l[j];
      }
      m = fmaxf(m, l[j]);
    }
  }
  if (lse) { /* for the aux losses: in double, as the CPU's */
    const float ml = smelt_warp_max(m);
    double sum = 0.0;
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++)
      if (((valid >> j) & 1u) && ml != NEG_INF) sum += exp((double)l[j] - (double)ml);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL, sum, o);
    if (lane == 0) lse[t] = ml == NEG_INF ? (double)NEG_INF : (double)ml + log(sum);
  }
  int my_id;
  float my_w;
  route_select(l, valid, bias, lane, E, k, sigmoid, renorm, scaling, groups, topk_groups, &my_id, &my_w);
  if (lane < k) {
    ids[t * k + lane] = my_id;
    weights[t * k + lane] = my_w;
  }
}

/* counts [E] and offsets [E+1] (i32 or i64 each) of ids [n] (entries
 * outside [0, E) are not counted), and dropped [1] = n - the kept ones (or
 * NULL). One block; shared memory E ints. */
extern "C" __global__ void moe_counts(const int *ids, i64 n, int E, void *counts, int counts64, void *offsets,
                                      int offsets64, void *dropped, int dropped64) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (i64 a = threadIdx.x; a < n; a += blockDim.x) {
    const int e = ids[a];
    if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  if (threadIdx.x) return;
  i64 at = 0;
  store_index(offsets, offsets64, 0, 0);
  for (int e = 0; e < E; e++) {
    store_index(counts, counts64, e, hist[e]);
    at += hist[e];
    store_index(offsets, offsets64, e + 1, at);
  }
  if (dropped) store_index(dropped, dropped64, 0, n - at);
}

/* P[e] = Σ_t exp(logits[t, e] - lse[t]): the full softmax's column sums
 * (the load-balance loss's importance), a block per expert, summed in
 * double in a fixed order (threads over strided tokens, then a tree). */
extern "C" __global__ void moe_aux_columns(const float *logits, const double *lse, i64 T, int E, double *P) {
  __shared__ double part[256];
  const int e = blockIdx.x;
  double acc = 0.0;
  for (i64 t = threadIdx.x; t < T; t += blockDim.x) acc += exp((double)logits[t * E + e] - lse[t]);
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int h = blockDim.x / 2; h > 0; h >>= 1) {
    if (threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) P[e] = part[0];
}

/* aux [2] = {c_lb · E/(k·T²) · Σ_e count_e · P[e], c_z / T · Σ_t lse[t]²}
 * with count_e the selections before drops; one block of 256, fixed order. */
extern "C" __global__ void moe_aux_final(const int *count, const double *P, const double *lse, i64 T, int E, int k,
                                         double c_lb, double c_z, float *aux) {
  __shared__ double part[256];
  double acc = 0.0;
  for (i64 t = threadIdx.x; t < T; t += blockDim.x) acc += lse[t] * lse[t];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int h = blockDim.x / 2; h > 0; h >>= 1) {
    if (threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x) return;
  double lb = 0.0;
  for (int e = 0; e < E; e++) lb += (double)count[e] * P[e];
  const double Td = (double)T;
  aux[0] = T && c_lb != 0.0 ? (float)(c_lb * (double)E / ((double)k * Td * Td) * lb) : 0.f;
  aux[1] = T && c_z != 0.0 ? (float)(c_z / Td * part[0]) : 0.f;
}

/* Token t's dlogits [E] (f32): sel [T, k] the selected experts before drops,
 * ids [T, k] the same after them (-1: dropped, its dw ignored), dw [T, k]
 * the weights' gradient (NULL: only the aux losses'); counts [E] the
 * selections before drops (NULL when c_lb is 0); c_lb = the load-balance
 * coefficient · E/(k·T²), c_z = the z-loss coefficient / T. Scores are
 * recomputed as moe_route computes them, so z repeats its bits. */
extern "C" __global__ void moe_route_bwd(const float *logits, const int *sel, const int *ids, const float *dw,
                                         const int *counts, float *dlogits, i64 T, int E, int k, int sigmoid,
                                         int renorm, float scaling, double c_lb, double c_z) {
  const int lane = threadIdx.x & 31;
  const i64 t = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= T) return;
  float l[MOE_ITEMS], s[MOE_ITEMS], ds[MOE_ITEMS];
  float m = NEG_INF;
#pragma unroll
  for (int j = 0; j < MOE_ITEMS; j++) {
    const int e = lane + 32 * j;
    l[j] = e < E ? logits[t * E + e] : NEG_INF;
    m = fmaxf(m, l[j]);
    ds[j] = 0.f;
  }
  m = smelt_warp_max(m);
  float sum = 0.f;
  if (!sigmoid) {
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++) sum += lane + 32 * j < E && m != NEG_INF ? expf(l[j] - m) : 0.f;
    sum = smelt_warp_sum(sum);
  }
  /* Lane i < k: slot i's expert, score and weight gradient. */
  int my_e = -1;
  float my_s = 0.f, my_g = 0.f;
  if (lane < k) {
    my_e = sel[t * k + lane];
    if (my_e >= 0 && my_e < E) {
      const float le = logits[t * E + my_e];
      my_s = sigmoid ? 1.f / (1.f + expf(-le)) : (sum > 0.f && m != NEG_INF ? expf(le - m) / sum : 0.f);
    } else {
      my_e = -1;
    }
    my_g = dw && ids[t * k + lane] >= 0 ? dw[t * k + lane] : 0.f;
  }
  float z = sigmoid ? 1e-20f : 0.f, gu = 0.f;
  for (int i = 0; i < k; i++) { /* slot order, as moe_route sums z */
    z += __shfl_sync(FULL, my_s, i);
    gu += __shfl_sync(FULL, my_g, i) * __shfl_sync(FULL, my_s, i);
  }
  const bool norm = sigmoid ? k > 1 : renorm != 0;
  const float mine = norm ? scaling * (my_g / z - gu / (z * z)) : scaling * my_g;
  for (int i = 0; i < k; i++) {
    const int e = __shfl_sync(FULL, my_e, i);
    const float c = __shfl_sync(FULL, mine, i);
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++)
      if (e == lane + 32 * j) ds[j] = c;
  }
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < MOE_ITEMS; j++) {
    s[j] = lane + 32 * j >= E ? 0.f
           : sigmoid          ? 1.f / (1.f + expf(-l[j]))
           : sum > 0.f && m != NEG_INF ? expf(l[j] - m) / sum
                                       : 0.f;
    dot += ds[j] * s[j];
  }
  dot = smelt_warp_sum(dot);
  /* The aux losses: p the full softmax in double, through lse as moe_route's. */
  double lse = (double)NEG_INF, cdot = 0.0, psum = 0.0;
  if (c_lb != 0.0 || c_z != 0.0) {
#pragma unroll
    for (int j = 0; j < MOE_ITEMS; j++)
      if (lane + 32 * j < E && m != NEG_INF) psum += exp((double)l[j] - (double)m);
    for (int o = 16; o > 0; o >>= 1) psum += __shfl_xor_sync(FULL, psum, o);
    if (m != NEG_INF) lse = (double)m + log(psum);
    if (c_lb != 0.0) {
#pragma unroll
      for (int j = 0; j < MOE_ITEMS; j++)
        if (lane + 32 * j < E && m != NEG_INF) cdot += (double)counts[lane + 32 * j] * exp((double)l[j] - lse);
      for (int o = 16; o > 0; o >>= 1) cdot += __shfl_xor_sync(FULL, cdot, o);
    }
  }
#pragma unroll
  for (int j = 0; j < MOE_ITEMS; j++) {
    const int e = lane + 32 * j;
    if (e >= E) continue;
    double g = sigmoid ? (double)(ds[j] * s[j] * (1.f - s[j])) : (double)(s[j] * (ds[j] - dot));
    if (m != NEG_INF && (c_lb != 0.0 || c_z != 0.0)) {
      const double p = exp((double)l[j] - lse);
      if (c_lb != 0.0) g += c_lb * p * ((double)counts[e] - cdot);
      if (c_z != 0.0) g += 2.0 * c_z * lse * p;
    }
    dlogits[t * E + e] = (float)g;
  }
}

/* dz [T, E] = dl · n(seed, token0 + t, e) · sigmoid(z): the gradient of
 * z = x·Wnoise through softplus (f32 all). */
extern "C" __global__ void moe_noise_grad(const float *dl, const float *z, float *dz, i64 T, int E, u64 seed,
                                          i64 token0) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < T * E; i += (i64)gridDim.x * blockDim.x) {
    const i64 t = i / E;
    const int e = (int)(i - t * E);
    dz[i] = dl[i] * normal(seed, token0 + t, e) / (1.f + expf(-z[i]));
  }
}

/* hi, lo [n] bf16 = src [n] f32 as hi + lo: hi its rounding, lo the
 * rounding of the rest (16 of f32's 24 bits, ~4e-6 relative). The router's
 * f32 gradients so split meet 16-bit x and Wr on tensor cores (src/cuda/
 * moe_bwd.c: two products instead of one mixed, SIMT one). */
extern "C" __global__ void moe_split_bf16(const float *src, smelt_h16 *hi, smelt_h16 *lo, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const float v = src[i];
    const smelt_h16 h = smelt_f32_to_bf16(v);
    hi[i] = h;
    lo[i] = smelt_f32_to_bf16(v - smelt_bf16_to_f32(h));
  }
}
