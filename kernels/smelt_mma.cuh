/* PTX wrappers for the tensor-core kernels (GEMM and attention): shared
 * memory addresses, cp.async, ldmatrix, the m16n8k16 mma.sync, mbarriers,
 * TMA loads and the wgmma fences. Only what does not depend on a kernel's
 * prelude lives here; each kernel keeps the wrappers shaped by its own
 * layout (MN-major wgmma descriptors, the wgmma instructions themselves).
 *
 * Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4), which the
 * kernels rely on when they move values between operands in registers:
 *   A (16 x 16, 4 registers of two 16-bit values): a[0] = (row g, k 2t..2t+1),
 *     a[1] = (g + 8, 2t..), a[2] = (g, 2t + 8..), a[3] = (g + 8, 2t + 8..);
 *   B (16 x 8, 2 registers): b[0] = (k 2t..2t+1, col g), b[1] = (k 2t + 8.., g);
 *   C/D (16 x 8 f32): d[0], d[1] = (row g, cols 2t, 2t+1); d[2], d[3] = (g + 8, ...).
 */
#ifndef SMELT_MMA_CUH
#define SMELT_MMA_CUH

#include "smelt_device.cuh"

static __device__ __forceinline__ u32 smem_u32(const void *p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

/* ---------------------------------------------------------------- cp.async */

/* 16 bytes global -> shared; bytes < 16 reads that many and zero-fills the rest. */
static __device__ __forceinline__ void cp_async16(u32 dst, const void *src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
/* 4 bytes global -> shared; bytes 0 writes a zero. */
static __device__ __forceinline__ void cp_async4(u32 dst, const void *src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }
#define CP_ASYNC_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")

/* ---------------------------------------------------------------- ldmatrix */

static __device__ __forceinline__ void ldsm_x4(u32 addr, u32 *r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
static __device__ __forceinline__ void ldsm_x4_t(u32 addr, u32 *r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* ---------------------------------------------------------------- mma.sync */

/* d += a * b for one m16n8k16 fragment, f32 accumulators. */
static __device__ __forceinline__ void mma_16816_f16(float *d, const u32 *a, const u32 *b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
static __device__ __forceinline__ void mma_16816_bf16(float *d, const u32 *a, const u32 *b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* Two f32 as one register of two 16-bit values, lo in the low half (the
 * lower k or column index of a fragment). */
static __device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
static __device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

/* ---------------------------------------------------------------- mbarrier */

static __device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
/* Arrives and announces the bytes the stage's TMA loads will deliver. */
static __device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
/* Waits until the phase with parity `parity` has completed. */
static __device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      " .reg .pred done;\n"
      " wait:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

/* Lets the mbarrier's current phase wait for this thread's cp.async copies
 * issued so far: one more pending arrival now, which each copy's
 * completion (all of them) takes back. */
static __device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

/* ---------------------------------------------------------------- TMA */

/* A CUtensorMap, passed by value as a __grid_constant__ parameter (TMA
 * reads it from parameter space; it must be 64-byte aligned there). */
typedef struct __align__(64) tmap_t {
  u64 q[16];
} tmap_t;

/* The box at (x = innermost offset, y) of a 2-D tensor map into dst. */
static __device__ __forceinline__ void tma_load(u32 dst, const tmap_t *map, int x, int y, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(dst),
      "l"((u64)map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
/* The box at (x, y, z, w) of a 4-D tensor map into dst. */
static __device__ __forceinline__ void tma_load_4d(u32 dst, const tmap_t *map, int x, int y, int z, int w, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];" ::"r"(dst),
      "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(w), "r"(bar)
      : "memory");
}

/* bytes (a multiple of 16, both addresses 16-byte aligned) of contiguous
 * global memory into dst by one bulk copy, completing on bar. */
static __device__ __forceinline__ void bulk_load(u32 dst, const void *src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

/* ---------------------------------------------------------------- wgmma */

/* The shared-memory descriptor of a K-major wgmma operand with the
 * 128-byte swizzle: 8-row atoms 1024 bytes apart (SBO); the leading offset
 * is unused for this layout. (MN-major descriptors depend on a kernel's
 * panel widths and stay with it.) */
static __device__ __forceinline__ u64 wgmma_desc_kmajor(u32 addr) {
  return (u64)((addr & 0x3ffffu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

static __device__ __forceinline__ void wgmma_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit(void) {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
#define WGMMA_WAIT(n) asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(n) : "memory")

#endif /* SMELT_MMA_CUH */
