/* PTX wrappers for the tensor-core kernels (GEMM, attention, PEER): shared
 * memory addresses and stores, cp.async, streaming loads, ldmatrix, the
 * m16n8k16 mma.sync, mbarriers, proxy fences, named barriers, setmaxnreg, TMA loads and
 * stores, the cluster, the wgmma fences and accumulator lists. Written
 * once so that every kernel issues the same text with the same clobbers.
 * Only what does not depend on a kernel's prelude lives here; each kernel
 * keeps the wrappers shaped by its own layout (MN-major wgmma descriptors,
 * the wgmma instructions themselves, built from the lists below).
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

/* 32 bits, two f32 (8 bytes) into shared memory at addr; 16, 32 or 128 bits out of it. */
static __device__ __forceinline__ void sts32(u32 addr, u32 v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
static __device__ __forceinline__ void sts_f32x2(u32 addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
static __device__ __forceinline__ unsigned short lds16(u32 addr) {
  unsigned short v;
  asm volatile("ld.shared.b16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}
static __device__ __forceinline__ u32 lds32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
static __device__ __forceinline__ uint4 lds128(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
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

/* ---------------------------------------------------------------- streaming loads */

/* 16 bytes of a stream read once (a GEMV's weights): no L1 allocation,
 * the 256 bytes around it into L2. */
static __device__ __forceinline__ uint4 ld_stream(const void *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

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

/* ---------------------------------------------------------------- fences, barriers, registers */

/* This thread's shared-memory writes (st.shared, cp.async) become visible
 * to the async proxy: TMA stores and bulk copies, wgmma's operand reads. */
static __device__ __forceinline__ void fence_proxy_async(void) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
/* The mbarrier inits so far are visible to the cluster and the async proxy. */
static __device__ __forceinline__ void fence_mbar_init(void) {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* Named barrier `id` (0 is __syncthreads) over n threads: wait for all,
 * or arrive without waiting. Both are literal numbers pasted into the
 * text: given as "n" operands instead, the compiler moved a constant
 * across attn_bwd_sm90's barrier. */
#define BAR_SYNC(id, n) asm volatile("bar.sync " #id ", " #n ";" ::: "memory")
#define BAR_ARRIVE(id, n) asm volatile("bar.arrive " #id ", " #n ";" ::: "memory")

/* A warpgroup gives up registers to, or takes them from, the launch's pool
 * (n a compile-time constant, a multiple of 8). */
#define SETMAXNREG_DEC(n) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(n))
#define SETMAXNREG_INC(n) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(n))

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

/* The store side: bulk copies out of shared memory join this thread's
 * current bulk group; commit closes it, the waits cover every group. */

/* The box at (x = column, y = row) of a 2-D tensor map from shared memory src. */
static __device__ __forceinline__ void tma_store(const tmap_t *map, int x, int y, u32 src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"((u64)map), "r"(x),
               "r"(y), "r"(src)
               : "memory");
}
/* The box at (x, y, z) of a 3-D tensor map from shared memory src. */
static __device__ __forceinline__ void tma_store_3d(const tmap_t *map, int x, int y, int z, u32 src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"((u64)map),
               "r"(x), "r"(y), "r"(z), "r"(src)
               : "memory");
}
/* The box at (x, y, z) of a 3-D tensor map += shared memory src (f32 adds
 * done by the TMA unit). */
static __device__ __forceinline__ void tma_add_3d(const tmap_t *map, int x, int y, int z, u32 src) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
                   (u64)map),
               "r"(x), "r"(y), "r"(z), "r"(src)
               : "memory");
}
static __device__ __forceinline__ void bulk_commit(void) { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
/* This thread's stores have finished reading shared memory (it may be reused). */
static __device__ __forceinline__ void bulk_wait_read(void) {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
/* This thread's stores are complete (before the CTA exits). */
static __device__ __forceinline__ void bulk_wait(void) { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

/* ---------------------------------------------------------------- cluster */

/* This CTA's rank in its cluster. */
static __device__ __forceinline__ u32 cluster_rank(void) {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
/* Every thread of the cluster has arrived. Relaxed: it follows the
 * barriers' init, which fence.mbarrier_init already released to the
 * cluster (a .release arrival would cost a MEMBAR.ALL.GPU). */
static __device__ __forceinline__ void cluster_sync(void) {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
/* Arrives on the mbarrier at this CTA's offset `bar` in CTA `rank` of the
 * cluster. With the default .release.cta semantics, as CUTLASS's consumer
 * release does: what it orders is the end of this warp's wgmma reads of
 * the stage (wgmma.wait_group has returned), and .release.cluster costs a
 * MEMBAR.ALL.GPU per arrival, which on H100 stalled every K step by
 * ~0.4-0.7 us (a first version ran at 0.57 of cuBLAS; docs/PERF.md). */
static __device__ __forceinline__ void mbar_arrive_rank(u32 bar, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
/* tma_load into every CTA of `mask` (bit r: rank r), each at its own
 * offset dst, completing on each one's mbarrier at offset bar. */
static __device__ __forceinline__ void tma_load_mc(u32 dst, const tmap_t *map, int x, int y, u32 bar, u32 mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"((u64)map), "r"(x), "r"(y), "r"(bar), "h"((unsigned short)mask)
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

/* Ordinary arithmetic moves freely across the volatile asm of
 * wgmma.wait_group, and the compiler sees a wgmma's registers as written
 * when it is issued. Tying values to an empty volatile asm pins them on
 * one side of a wait: computed before it, or (for a wgmma's accumulators,
 * and for what is about to overwrite the registers it reads) used after. */
static __device__ __forceinline__ void fence_f32(float *r, int n) {
#pragma unroll
  for (int i = 0; i < n; i++) asm volatile("" : "+f"(r[i]));
}
static __device__ __forceinline__ void fence_u32(u32 *r, int n) {
#pragma unroll
  for (int i = 0; i < n; i++) asm volatile("" : "+r"(r[i]));
}

/* The accumulators of a 64 x N wgmma (N / 2 f32 registers a thread, in
 * d[0..N/2)): as the instruction's operands %0.. (WG_REGS<N/2>) and as the
 * asm's outputs (WG_D<N/2>(WG_RW) to accumulate, WG_D<N/2>(WG_W) to
 * overwrite, which leaves the old values dead). The operands after them
 * are numbered from N/2 on. */
#define WG_REGS32                                                                                                     \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                            \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS64                                                                                                     \
  WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                      \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_REGS128                                                                                                    \
  WG_REGS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                      \
            "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                        \
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "             \
            "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WG_RW(x) "+f"(x)
#define WG_W(x) "=f"(x)
#define WG_D8(F, i) F(d[i]), F(d[i + 1]), F(d[i + 2]), F(d[i + 3]), F(d[i + 4]), F(d[i + 5]), F(d[i + 6]), F(d[i + 7])
#define WG_D32(F) WG_D8(F, 0), WG_D8(F, 8), WG_D8(F, 16), WG_D8(F, 24)
#define WG_D64(F) WG_D32(F), WG_D8(F, 32), WG_D8(F, 40), WG_D8(F, 48), WG_D8(F, 56)
#define WG_D128(F) WG_D64(F), WG_D8(F, 64), WG_D8(F, 72), WG_D8(F, 80), WG_D8(F, 88), WG_D8(F, 96), WG_D8(F, 104), \
                   WG_D8(F, 112), WG_D8(F, 120)

#endif /* SMELT_MMA_CUH */
