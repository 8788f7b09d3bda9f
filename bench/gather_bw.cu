/* Read bandwidth of random row gathers, the expert kernel's access pattern,
 * against sequential reads and a device-to-device copy on the same GPU: the
 * ceiling the PEER forward's expert rows can reach (docs/PERF.md, PEER).
 * Standalone (CUDA runtime), run on the GPU machine:
 *   nvcc -O3 -arch=sm_90a -o /tmp/gather_bw bench/gather_bw.cu && /tmp/gather_bw
 * Tables: two of 2^20 rows × 1024 bf16 (2 KiB a row, 4 GiB in all, the
 * issue's U and V); uses: 524288 uniform random ids, each reading its U and
 * its V row (2.15 GB). Every kernel folds what it reads into one word a
 * warp so nothing is optimized away. Median of 20 after 3 warm-ups. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "probe.cuh"

#define ROWS (1 << 20)
#define ROW_BYTES 2048
#define USES 524288

/* Reads UNR 2 KiB rows (lane: 4 x 16 B of each, all loads issued before
 * any is used) and folds them into acc. */
#define UNR 4
static __device__ __forceinline__ uint32_t fold_rows(const char *const *base, int lane, uint32_t acc) {
  uint4 x[UNR][4];
#pragma unroll
  for (int i = 0; i < UNR; i++)
#pragma unroll
    for (int c = 0; c < 4; c++) x[i][c] = ldg_nc(base[i] + (c * 32 + lane) * 16);
#pragma unroll
  for (int i = 0; i < UNR; i++)
#pragma unroll
    for (int c = 0; c < 4; c++) acc ^= x[i][c].x ^ x[i][c].y ^ x[i][c].z ^ x[i][c].w;
  return acc;
}

/* Sequential: warp w reads rows w, w + W, ... of the first 2·USES rows of
 * U then V (the same bytes as the gather, in order). U lanes per use:
 * each lane 4 × 16 B of a 2 KiB row, UNR rows in flight. */
__global__ void seq_read(const char *u, const char *v, uint32_t *out) {
  const int lane = threadIdx.x & 31;
  const long w = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * (long)blockDim.x) >> 5;
  uint32_t acc = 0;
  for (long r0 = w * UNR; r0 < 2L * USES; r0 += nw * UNR) {
    const char *base[UNR];
#pragma unroll
    for (int i = 0; i < UNR; i++) {
      const long r = r0 + i;
      base[i] = r < USES ? u + r * ROW_BYTES : v + (r - USES) * ROW_BYTES;
    }
    acc = fold_rows(base, lane, acc);
  }
  if (acc == 0x12345678u) out[w] = acc;
}

/* Gather by loads: warp w takes uses w, w + W, ...; per use its U row and
 * its V row, UNR / 2 uses (UNR rows) in flight a warp. */
__global__ void gather_ld(const char *u, const char *v, const int *ids, uint32_t *out) {
  const int lane = threadIdx.x & 31;
  const long w = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * (long)blockDim.x) >> 5;
  uint32_t acc = 0;
  for (long j0 = w * (UNR / 2); j0 < USES; j0 += nw * (UNR / 2)) {
    const char *base[UNR];
#pragma unroll
    for (int i = 0; i < UNR; i++) base[i] = (i & 1 ? v : u) + (long)ids[j0 + i / 2] * ROW_BYTES;
    acc = fold_rows(base, lane, acc);
  }
  if (acc == 0x12345678u) out[w] = acc;
}

/* Gather by bulk copies (TMA, cp.async.bulk): each warp a ring of STG
 * slots of one use (U row + V row, 4 KiB), one mbarrier a slot; lane 0
 * issues both rows' copies, the warp waits for the slot and folds it. */
#define STG 4
#define WARPS 8
static __device__ __forceinline__ uint32_t s32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__global__ void __launch_bounds__(WARPS * 32) gather_bulk(const char *u, const char *v, const int *ids, uint32_t *out) {
  extern __shared__ __align__(128) char sm[];
  __shared__ __align__(8) uint64_t bar[WARPS][STG];
  const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
  const long w = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * (long)blockDim.x) >> 5;
  char *ring = sm + wi * STG * 2 * ROW_BYTES;
  if (lane == 0)
    for (int s = 0; s < STG; s++) asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(s32(&bar[wi][s])));
  asm volatile("fence.mbarrier_init.release.cluster;");
  __syncwarp();
  const long n = w < USES ? (USES - w + nw - 1) / nw : 0;
  auto issue = [&](long i) {
    if (lane == 0 && i < n) {
      const long e = ids[w + i * nw];
      const int s = (int)(i % STG);
      const uint32_t b = s32(&bar[wi][s]), d = s32(ring + s * 2 * ROW_BYTES);
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(b), "r"(2 * ROW_BYTES));
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
                   "l"(u + e * ROW_BYTES), "r"(ROW_BYTES), "r"(b)
                   : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                       d + ROW_BYTES),
                   "l"(v + e * ROW_BYTES), "r"(ROW_BYTES), "r"(b)
                   : "memory");
    }
  };
  for (int i = 0; i < STG; i++) issue(i);
  uint32_t acc = 0;
  for (long i = 0; i < n; i++) {
    const int s = (int)(i % STG);
    const uint32_t b = s32(&bar[wi][s]), ph = (uint32_t)((i / STG) & 1);
    asm volatile(
        "{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }" ::"r"(b), "r"(ph)
        : "memory");
    const uint4 *p = (const uint4 *)(ring + s * 2 * ROW_BYTES);
#pragma unroll
    for (int c = 0; c < 8; c++) {
      const uint4 x = p[c * 32 + lane];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    __syncwarp();
    issue(i + STG);
  }
  if (acc == 0x12345678u) out[w] = acc;
}

static float time_ms(void (*launch)(void *), void *arg) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  float t[20];
  for (int i = 0; i < 3; i++) launch(arg);
  for (int i = 0; i < 20; i++) {
    CK(cudaEventRecord(a));
    launch(arg);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaEventElapsedTime(&t[i], a, b));
  }
  CK(cudaGetLastError());
  for (int i = 0; i < 20; i++)
    for (int j = i + 1; j < 20; j++)
      if (t[j] < t[i]) {
        float x = t[i];
        t[i] = t[j];
        t[j] = x;
      }
  return (t[9] + t[10]) / 2;
}

static char *U, *V, *dst;
static int *ids;
static uint32_t *out;
static int blocks_ld, blocks_bulk, sms;

static void l_copy(void *) { CK(cudaMemcpyAsync(dst, U, 2L * USES * ROW_BYTES / 2, cudaMemcpyDeviceToDevice)); }
static void l_seq(void *) { seq_read<<<blocks_ld, 256>>>(U, V, out); }
static void l_ld(void *) { gather_ld<<<blocks_ld, 256>>>(U, V, ids, out); }
static void l_bulk(void *) {
  gather_bulk<<<blocks_bulk, WARPS * 32, WARPS * STG * 2 * ROW_BYTES>>>(U, V, ids, out);
}

int main(void) {
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t tb = (size_t)ROWS * ROW_BYTES;
  CK(cudaMalloc(&U, tb));
  CK(cudaMalloc(&V, tb));
  CK(cudaMalloc(&dst, tb));
  CK(cudaMemset(U, 1, tb));
  CK(cudaMemset(V, 2, tb));
  CK(cudaMalloc(&out, 1 << 24));
  int *h = (int *)malloc(USES * sizeof(int));
  uint64_t s = 88172645463325252ull;
  for (int i = 0; i < USES; i++) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    h[i] = (int)(s % ROWS);
  }
  CK(cudaMalloc(&ids, USES * sizeof(int)));
  CK(cudaMemcpy(ids, h, USES * sizeof(int), cudaMemcpyHostToDevice));
  CK(cudaFuncSetAttribute(gather_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, WARPS * STG * 2 * ROW_BYTES));
  const double bytes = 2.0 * USES * ROW_BYTES;
  int occ;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, gather_ld, 256, 0));
  blocks_ld = occ * sms;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, gather_bulk, WARPS * 32, WARPS * STG * 2 * ROW_BYTES));
  blocks_bulk = occ * sms;
  printf("gather_bw: %d SMs, %.2f GB a pass (524288 uses x (U + V) x 2 KiB)\n", sms, bytes / 1e9);
  const float tc = time_ms(l_copy, 0);
  printf("%-34s %8.3f ms %8.1f GB/s (read + write)\n", "d2d copy of the same bytes", tc, bytes / tc / 1e6);
  const float t1 = time_ms(l_seq, 0);
  printf("%-34s %8.3f ms %8.1f GB/s\n", "sequential read (ld.v4)", t1, bytes / t1 / 1e6);
  const float t2 = time_ms(l_ld, 0);
  printf("%-34s %8.3f ms %8.1f GB/s\n", "random rows (ld.v4, 4 rows a warp)", t2, bytes / t2 / 1e6);
  const float t3 = time_ms(l_bulk, 0);
  printf("%-34s %8.3f ms %8.1f GB/s (%d CTAs of %d warps)\n", "random rows (cp.async.bulk ring)", t3,
         bytes / t3 / 1e6, blocks_bulk, WARPS);
  return 0;
}
