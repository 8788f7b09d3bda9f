/* Can an expert-major PEER forward beat the token-major one? A probe for
 * docs/PERF.md (PEER, version 13), standalone (CUDA runtime + CUB):
 *   nvcc -O3 -arch=sm_90a -o /tmp/dedup bench/peer_dedup_probe.cu && /tmp/dedup
 * The issue's shape: T 4096 tokens × 128 uses (8 heads × k 16), ids uniform
 * over 2^20 experts, expert hidden 1, d_in = d_out = 1024 bf16. Token-major,
 * every use reads its U and V rows (2.15 GB). Expert-major, each distinct
 * expert reads them once: 1 - e^-0.5 of 2^20 ≈ 412k rows, 21% fewer bytes,
 * but the outputs are scattered: y[t] += w·V_e by f32 atomics into an
 * L2-resident accumulator (T × 1024 f32 = 16 MiB), 2.15 GB of red traffic.
 * Measured here: the counting sort (histogram, scan, scatter), the
 * expert-major rows with red.global.add.v4.f32, the f32 → bf16 pass, and a
 * token-major kernel of the same arithmetic (warp per token, 4 uses in
 * flight) as the reference the expert-major y is checked against. */
#include <cub/cub.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "probe.cuh"

#define NE (1 << 20)
#define D 1024
#define T 4096
#define UPT 128
#define USES (T * UPT)

static __device__ __forceinline__ uint2 ldg_nc2(const void *p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
static __device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
static __device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
static __device__ __forceinline__ float act(float z) { return z > 0.f ? z : 0.f; }

/* Partial dot of a lane's 32 elements (4 × 16 B at (c·32 + lane)·8). */
static __device__ __forceinline__ float dot32(const uint4 *u, const uint4 *x) {
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < 4; c++) {
    const uint32_t a[4] = {u[c].x, u[c].y, u[c].z, u[c].w}, b[4] = {x[c].x, x[c].y, x[c].z, x[c].w};
#pragma unroll
    for (int i = 0; i < 4; i++) s = fmaf(lo(a[i]), lo(b[i]), fmaf(hi(a[i]), hi(b[i]), s));
  }
  return s;
}
static __device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

__global__ void hist(const int *ids, int *cnt) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < USES) atomicAdd(&cnt[ids[i]], 1);
}
/* Scatter uses into their expert's segment; the distinct experts listed by
 * the thread that takes an expert's first slot. Order within a segment is
 * arbitrary: the sums below are atomics anyway. */
__global__ void scatter(const int *ids, const int *off, int *cur, int *seg, int *uniq, int *nuniq) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= USES) return;
  const int e = ids[i], p = atomicAdd(&cur[e], 1);
  seg[off[e] + p] = i;
  if (p == 0) uniq[atomicAdd(nuniq, 1)] = e;
}

/* Warp per distinct expert: U and V rows once, then per use z = x_t·U_e,
 * w = g·act(z), y[t] += w·V_e by vector reds (lane: 8 × 4 floats at
 * (j·32 + lane)·4, so each red is 512 contiguous bytes a warp). */
__global__ void __launch_bounds__(256) rows_atomic(const __nv_bfloat16 *U, const __nv_bfloat16 *V,
                                                   const __nv_bfloat16 *x, const float *g, const int *uniq,
                                                   const int *nuniq, const int *off, const int *cnt,
                                                   const int *seg, float *Y, int mode) {
  const int lane = threadIdx.x & 31;
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
  const int n = *nuniq;
  for (int q = w; q < n; q += nw) {
    const int e = uniq[q];
    uint4 u[4];
    uint2 v[8];
#pragma unroll
    for (int c = 0; c < 4; c++) u[c] = ldg_nc((const char *)(U + (size_t)e * D) + (c * 32 + lane) * 16);
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = ldg_nc2((const char *)(V + (size_t)e * D) + (j * 32 + lane) * 8);
    const int o = off[e], m = cnt[e];
    for (int r = 0; r < m; r++) {
      const int use = seg[o + r], t = use / UPT;
      uint4 xv[4];
#pragma unroll
      for (int c = 0; c < 4; c++) xv[c] = *(const uint4 *)((const char *)(x + (size_t)t * D) + (c * 32 + lane) * 16);
      const float a = g[use] * act(warp_sum(dot32(u, xv)));
      float *y = Y + (size_t)t * D;
      if (mode == 1) {
#pragma unroll
        for (int j = 0; j < 8; j++)
          *(float4 *)(y + (j * 32 + lane) * 4) = make_float4(a * lo(v[j].x), a * hi(v[j].x), a * lo(v[j].y), a * hi(v[j].y));
        continue;
      }
      if (mode == 2) {
        if (a == 12345.f) y[lane] = a;
        continue;
      }
#pragma unroll
      for (int j = 0; j < 8; j++)
        asm volatile("red.global.add.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(y + (j * 32 + lane) * 4),
                     "f"(a * lo(v[j].x)), "f"(a * hi(v[j].x)), "f"(a * lo(v[j].y)), "f"(a * hi(v[j].y))
                     : "memory");
    }
  }
}

__global__ void to_bf16(const float *Y, __nv_bfloat16 *y) {
  const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= (size_t)T * D) return;
  const float4 f = *(const float4 *)(Y + i);
  y[i] = __float2bfloat16(f.x), y[i + 1] = __float2bfloat16(f.y), y[i + 2] = __float2bfloat16(f.z),
  y[i + 3] = __float2bfloat16(f.w);
}

/* Token-major reference: warp per token, 4 uses' rows in flight. */
#define TU 4
__global__ void __launch_bounds__(256) rows_token(const __nv_bfloat16 *U, const __nv_bfloat16 *V,
                                                  const __nv_bfloat16 *x, const float *g, const int *ids,
                                                  float *Y) {
  const int lane = threadIdx.x & 31;
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
  for (int t = w; t < T; t += nw) {
    uint4 xv[4];
#pragma unroll
    for (int c = 0; c < 4; c++) xv[c] = *(const uint4 *)((const char *)(x + (size_t)t * D) + (c * 32 + lane) * 16);
    float y[32] = {0};
    for (int r0 = 0; r0 < UPT; r0 += TU) {
      uint4 u[TU][4];
      uint2 v[TU][8];
#pragma unroll
      for (int i = 0; i < TU; i++) {
        const size_t e = ids[t * UPT + r0 + i];
#pragma unroll
        for (int c = 0; c < 4; c++) u[i][c] = ldg_nc((const char *)(U + e * D) + (c * 32 + lane) * 16);
#pragma unroll
        for (int j = 0; j < 8; j++) v[i][j] = ldg_nc2((const char *)(V + e * D) + (j * 32 + lane) * 8);
      }
#pragma unroll
      for (int i = 0; i < TU; i++) {
        const float a = g[t * UPT + r0 + i] * act(warp_sum(dot32(u[i], xv)));
#pragma unroll
        for (int j = 0; j < 8; j++) {
          y[4 * j] = fmaf(a, lo(v[i][j].x), y[4 * j]);
          y[4 * j + 1] = fmaf(a, hi(v[i][j].x), y[4 * j + 1]);
          y[4 * j + 2] = fmaf(a, lo(v[i][j].y), y[4 * j + 2]);
          y[4 * j + 3] = fmaf(a, hi(v[i][j].y), y[4 * j + 3]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
      *(float4 *)(Y + (size_t)t * D + (j * 32 + lane) * 4) = make_float4(y[4 * j], y[4 * j + 1], y[4 * j + 2], y[4 * j + 3]);
  }
}

static float med(float *t, int n) {
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++)
      if (t[j] < t[i]) {
        float s = t[i];
        t[i] = t[j];
        t[j] = s;
      }
  return (t[n / 2 - 1] + t[n / 2]) / 2;
}

int main(void) {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  __nv_bfloat16 *U, *V, *x, *yb;
  float *g, *Y, *Yr;
  int *ids, *cnt, *off, *cur, *seg, *uniq, *nuniq;
  CK(cudaMalloc(&U, (size_t)NE * D * 2));
  CK(cudaMalloc(&V, (size_t)NE * D * 2));
  CK(cudaMalloc(&x, (size_t)T * D * 2));
  CK(cudaMalloc(&yb, (size_t)T * D * 2));
  CK(cudaMalloc(&g, USES * 4));
  CK(cudaMalloc(&Y, (size_t)T * D * 4));
  CK(cudaMalloc(&Yr, (size_t)T * D * 4));
  CK(cudaMalloc(&ids, USES * 4));
  CK(cudaMalloc(&cnt, NE * 4));
  CK(cudaMalloc(&off, NE * 4));
  CK(cudaMalloc(&cur, NE * 4));
  CK(cudaMalloc(&seg, USES * 4));
  CK(cudaMalloc(&uniq, USES * 4));
  CK(cudaMalloc(&nuniq, 4));
  {
    /* Small values so f32 sums stay well scaled: U, V, x uniform in ±1/32. */
    const size_t chunk = (size_t)1 << 24;
    uint16_t *h = (uint16_t *)malloc(chunk * 2);
    uint64_t s = 88172645463325252ull;
    for (int tab = 0; tab < 3; tab++) {
      __nv_bfloat16 *dst = tab == 0 ? U : tab == 1 ? V : x;
      const size_t n = tab < 2 ? (size_t)NE * D : (size_t)T * D;
      for (size_t o = 0; o < n; o += chunk) {
        for (size_t i = 0; i < chunk; i++) {
          s ^= s << 13, s ^= s >> 7, s ^= s << 17;
          const float f = ((float)(s >> 40) / (float)(1 << 24) - 0.5f) / 16.f;
          uint32_t b;
          memcpy(&b, &f, 4);
          h[i] = (uint16_t)(b >> 16);
        }
        CK(cudaMemcpy((char *)dst + o * 2, h, (n - o < chunk ? n - o : chunk) * 2, cudaMemcpyHostToDevice));
      }
    }
    free(h);
    int *hi_ = (int *)malloc(USES * 4);
    float *hg = (float *)malloc(USES * 4);
    for (int i = 0; i < USES; i++) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      hi_[i] = (int)(s % NE);
      hg[i] = (float)((s >> 40) & 0xffff) / 65536.f / 16.f;
    }
    CK(cudaMemcpy(ids, hi_, USES * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(g, hg, USES * 4, cudaMemcpyHostToDevice));
    free(hi_);
    free(hg);
  }
  void *tmp = NULL;
  size_t tmpb = 0;
  CK(cub::DeviceScan::ExclusiveSum(tmp, tmpb, cnt, off, NE));
  CK(cudaMalloc(&tmp, tmpb));
  int occ;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, rows_atomic, 256, 0));
  const int ba = occ * sms;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, rows_token, 256, 0));
  const int bt = occ * sms;
  cudaEvent_t ev[5];
  for (int i = 0; i < 5; i++) CK(cudaEventCreate(&ev[i]));
  enum { R = 20 };
  float ts[R], tr[R], tc[R], tt[R], tz[R];
  for (int it = -3; it < R; it++) {
    CK(cudaEventRecord(ev[0]));
    CK(cudaMemsetAsync(cnt, 0, NE * 4));
    CK(cudaMemsetAsync(cur, 0, NE * 4));
    CK(cudaMemsetAsync(nuniq, 0, 4));
    hist<<<USES / 256, 256>>>(ids, cnt);
    CK(cub::DeviceScan::ExclusiveSum(tmp, tmpb, cnt, off, NE));
    scatter<<<USES / 256, 256>>>(ids, off, cur, seg, uniq, nuniq);
    CK(cudaEventRecord(ev[1]));
    CK(cudaMemsetAsync(Y, 0, (size_t)T * D * 4));
    CK(cudaEventRecord(ev[2]));
    rows_atomic<<<ba, 256>>>(U, V, x, g, uniq, nuniq, off, cnt, seg, Y, 0);
    CK(cudaEventRecord(ev[3]));
    to_bf16<<<T * D / 4 / 256, 256>>>(Y, yb);
    CK(cudaEventRecord(ev[4]));
    CK(cudaEventSynchronize(ev[4]));
    if (it >= 0) {
      CK(cudaEventElapsedTime(&ts[it], ev[0], ev[1]));
      CK(cudaEventElapsedTime(&tz[it], ev[1], ev[2]));
      CK(cudaEventElapsedTime(&tr[it], ev[2], ev[3]));
      CK(cudaEventElapsedTime(&tc[it], ev[3], ev[4]));
    }
  }
  float tm[2][R];
  for (int mode = 1; mode <= 2; mode++)
    for (int it = -3; it < R; it++) {
      CK(cudaEventRecord(ev[0]));
      rows_atomic<<<ba, 256>>>(U, V, x, g, uniq, nuniq, off, cnt, seg, Yr, mode);
      CK(cudaEventRecord(ev[1]));
      CK(cudaEventSynchronize(ev[1]));
      if (it >= 0) CK(cudaEventElapsedTime(&tm[mode - 1][it], ev[0], ev[1]));
    }
  for (int it = -3; it < R; it++) {
    CK(cudaEventRecord(ev[0]));
    rows_token<<<bt, 256>>>(U, V, x, g, ids, Yr);
    CK(cudaEventRecord(ev[1]));
    CK(cudaEventSynchronize(ev[1]));
    if (it >= 0) CK(cudaEventElapsedTime(&tt[it], ev[0], ev[1]));
  }
  CK(cudaGetLastError());
  int nu;
  CK(cudaMemcpy(&nu, nuniq, 4, cudaMemcpyDeviceToHost));
  float *a = (float *)malloc((size_t)T * D * 4), *b = (float *)malloc((size_t)T * D * 4);
  CK(cudaMemcpy(a, Y, (size_t)T * D * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b, Yr, (size_t)T * D * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < (size_t)T * D; i++) num += (a[i] - b[i]) * (double)(a[i] - b[i]), den += (double)b[i] * b[i];
  const double gb_tok = 2.0 * USES * D * 2 / 1e9, gb_uni = 2.0 * nu * D * 2 / 1e9;
  printf("dedup probe: %d SMs, %d uses, %d distinct experts (%.1f%%)\n", sms, USES, nu, 100.0 * nu / USES);
  printf("%-44s %8.3f ms\n", "counting sort (hist, scan, scatter)", med(ts, R));
  printf("%-44s %8.3f ms\n", "zero the f32 accumulator", med(tz, R));
  const float mr = med(tr, R), mt = med(tt, R);
  printf("%-44s %8.3f ms  %7.1f GB/s of rows (%d CTAs)\n", "expert-major rows, red.v4.f32 into y", mr,
         gb_uni / mr * 1e3, ba);
  printf("%-44s %8.3f ms\n", "y f32 -> bf16", med(tc, R));
  printf("%-44s %8.3f ms  (timing only: racy plain stores)\n", "expert-major rows, st.v4 instead of red", med(tm[0], R));
  printf("%-44s %8.3f ms  (timing only: no output)\n", "expert-major rows, reads and dots only", med(tm[1], R));
  printf("%-44s %8.3f ms  %7.1f GB/s of rows (%d CTAs)\n", "token-major rows (reference)", mt, gb_tok / mt * 1e3,
         bt);
  printf("expert-major vs token-major y: relative L2 %.3g\n", sqrt(num / den));
  return 0;
}
