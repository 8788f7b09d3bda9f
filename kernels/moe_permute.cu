/* MoE dispatch and combine on the GPU, without a host round trip.
 *
 * permute, stable and expert-major, in three launches over chunks of
 * MOE_CHUNK tokens:
 *   moe_chunk_counts  each chunk's assignments per expert (shared atomics:
 *                     counts do not depend on their order);
 *   moe_chunk_bases   per expert, the chunk's first row: offsets[e] plus the
 *                     earlier chunks' counts (one thread per expert walks the
 *                     chunks in order);
 *   moe_scatter       one warp ranks the chunk's assignments in (token, slot)
 *                     order, 32 at a time (__match_any_sync gives the lanes
 *                     of one expert; a lane's rank is the peers below it),
 *                     writes row_map, then every warp copies rows of x to
 *                     their rows of xp in the widest unit the layout allows.
 * Ids outside [0, E), and rows outside [0, T·k) (offsets that do not
 * match the ids), count as dropped (row -1): the CPU reference refuses
 * them, the GPU cannot without a host read, so it keeps every access in
 * bounds instead.
 *
 * unpermute: a warp per token, y[t] = Σ_i w[t, i] · yp[row_map[t, i]] in
 * slot order in f32, over the rows that are not -1; yp and y in any of f32,
 * f16, bf16 (dtype codes of smelt_dtype, read at run time). */
#include "smelt_device.cuh"

#define FULL 0xffffffffu
#define MOE_CHUNK 128

extern "C" __global__ void moe_chunk_counts(const int *ids, i64 T, int k, int E, int *cc) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const i64 t = (i64)blockIdx.x * MOE_CHUNK + threadIdx.x;
  if (threadIdx.x < MOE_CHUNK && t < T)
    for (int i = 0; i < k; i++) {
      const int e = ids[t * k + i];
      if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
    }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) cc[(i64)blockIdx.x * E + e] = hist[e];
}

/* cc [chunks, E]: counts in, first rows out. offsets [E+1] i32 or i64. */
extern "C" __global__ void moe_chunk_bases(int *cc, i64 chunks, int E, const void *offsets, int offsets64) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  i64 at = offsets64 ? ((const i64 *)offsets)[e] : ((const int *)offsets)[e];
  for (i64 c = 0; c < chunks; c++) {
    const int n = cc[c * E + e];
    cc[c * E + e] = (int)at;
    at += n;
  }
}

/* Copies `bytes` from src to dst by the lanes of a warp in units of `unit`
 * bytes (16, 8, 4 or 2; both addresses and bytes multiples of it). */
static __device__ __forceinline__ void copy_row(char *dst, const char *src, i64 bytes, int unit, int lane) {
  if (unit == 16)
    for (i64 o = (i64)lane * 16; o < bytes; o += 32 * 16) *(uint4 *)(dst + o) = *(const uint4 *)(src + o);
  else if (unit == 8)
    for (i64 o = (i64)lane * 8; o < bytes; o += 32 * 8) *(uint2 *)(dst + o) = *(const uint2 *)(src + o);
  else if (unit == 4)
    for (i64 o = (i64)lane * 4; o < bytes; o += 32 * 4) *(u32 *)(dst + o) = *(const u32 *)(src + o);
  else
    for (i64 o = (i64)lane * 2; o < bytes; o += 32 * 2) *(smelt_h16 *)(dst + o) = *(const smelt_h16 *)(src + o);
}

/* x rows of x_stride bytes (row_bytes used), xp rows of row_bytes; ids and
 * row_map [T, k]; cc from moe_chunk_bases. Shared memory: E + MOE_CHUNK·k ints. */
extern "C" __global__ void moe_scatter(const char *x, i64 x_stride, const int *ids, i64 T, int k, int E, const int *cc,
                                       char *xp, i64 row_bytes, int *row_map, int unit) {
  extern __shared__ int sh[];
  int *next = sh, *rows = sh + E;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const i64 t0 = (i64)blockIdx.x * MOE_CHUNK, a0 = t0 * k;
  const int n = (int)((T - t0 < MOE_CHUNK ? T - t0 : MOE_CHUNK) * k);
  for (int e = threadIdx.x; e < E; e += blockDim.x) next[e] = cc[(i64)blockIdx.x * E + e];
  __syncthreads();
  if (warp == 0)
    for (int base = 0; base < n; base += 32) {
      const int idx = base + lane;
      int e = idx < n ? ids[a0 + idx] : -1;
      if (e >= E) e = -1;
      if (e < -1) e = -1;
      const unsigned peers = __match_any_sync(FULL, e);
      int row = e >= 0 ? next[e] + __popc(peers & ((1u << lane) - 1u)) : -1;
      __syncwarp();
      if (e >= 0 && lane == __ffs(peers) - 1) next[e] += __popc(peers);
      __syncwarp();
      if (row < 0 || row >= T * k) row = -1;
      if (idx < n) {
        row_map[a0 + idx] = row;
        rows[idx] = row;
      }
    }
  __syncthreads();
  for (int idx = warp; idx < n; idx += warps) {
    const int r = rows[idx];
    if (r >= 0) copy_row(xp + (i64)r * row_bytes, x + ((a0 + idx) / k) * x_stride, row_bytes, unit, lane);
  }
}

static __device__ __forceinline__ float load_any(const void *p, int dt, i64 i) {
  if (dt == SMELT_DT_F32) return ((const float *)p)[i];
  if (dt == SMELT_DT_F16) return smelt_f16_to_f32(((const smelt_h16 *)p)[i]);
  return smelt_bf16_to_f32(((const smelt_h16 *)p)[i]);
}

static __device__ __forceinline__ void store_any(void *p, int dt, i64 i, float v) {
  if (dt == SMELT_DT_F32) ((float *)p)[i] = v;
  else if (dt == SMELT_DT_F16) ((smelt_h16 *)p)[i] = smelt_f32_to_f16(v);
  else ((smelt_h16 *)p)[i] = smelt_f32_to_bf16(v);
}

/* yp [T·k, d] contiguous; row_map, w [T, k]; y rows of y_stride elements. */
extern "C" __global__ void moe_unpermute(const void *yp, int yp_dt, const int *row_map, const float *w, void *y,
                                         int y_dt, i64 T, int k, int d, i64 y_stride) {
  const int lane = threadIdx.x & 31;
  const i64 t = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= T) return;
  const int my_row = lane < k ? row_map[t * k + lane] : -1;
  const float my_w = lane < k ? w[t * k + lane] : 0.f;
  for (int c0 = 0; c0 < d; c0 += 32) {
    const int c = c0 + lane;
    float acc = 0.f;
    for (int i = 0; i < k; i++) {
      const int r = __shfl_sync(FULL, my_row, i);
      const float wi = __shfl_sync(FULL, my_w, i);
      if (r >= 0 && r < T * k && c < d) acc += wi * load_any(yp, yp_dt, (i64)r * d + c);
    }
    if (c < d) store_any(y, y_dt, t * y_stride + c, acc);
  }
}
