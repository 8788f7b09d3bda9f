/* The Hopper GEMM (sm_90a) for f16 and bf16, A row-major and B column-major
 * (both K-major), f32 accumulation, every epilogue.
 *
 * Prelude: GEMM_ACC 1 (f32); GEMM_AB 2 (f16) or 3 (bf16); GEMM_STAGES.
 *
 * One persistent CTA per SM walks the output tiles (128 x 256) in the
 * banded order of gemm_raster, so the tiles in flight share A rows and B
 * columns in L2. Three warpgroups:
 *   producer (warpgroup 0, one thread): TMA loads of the A (128 x 64) and B
 *     (256 x 64) tiles of each K step into a ring of STAGES shared-memory
 *     stages, each completing on the stage's "full" mbarrier with its byte
 *     count; before reusing a stage it waits on the stage's "empty" mbarrier;
 *   consumers (warpgroups 1 and 2): each multiplies its 64-row half of the
 *     A tile by the whole B tile with four wgmma m64n256k16 per stage (the
 *     accumulator lives in 128 registers per thread), releases a stage as
 *     soon as the wgmmas reading it are done, and after the last K step
 *     applies the epilogue (through a small shared-memory buffer, below).
 * setmaxnreg moves registers from the producer (40) to the consumers (232).
 * The producer runs ahead into the next tile while the consumers store the
 * previous one, so loads overlap the epilogue.
 *
 * Shared memory: TMA writes each 64-element (128-byte) row with the 128-byte
 * swizzle, which is the K-major layout wgmma reads with SBO = 1024 (eight
 * rows); stages are 1024-byte aligned so the swizzle phase starts at 0, and
 * the k16 steps inside a 128-byte row are start-address offsets of 32 bytes.
 * Ragged M, N and K need nothing: TMA fills out-of-bounds elements with
 * zeros and the epilogue skips rows and columns past the matrix. K >= 1 (the
 * host sends K = 0 elsewhere).
 */
#include "gemm_common.cuh"

#if !defined(GEMM_AB) || !defined(GEMM_STAGES) || GEMM_ACC != ACC_F32
#error "gemm_sm90.cu needs GEMM_AB (2 f16, 3 bf16), GEMM_STAGES and GEMM_ACC 1"
#endif
#if GEMM_AB == DT_BF16
#define AB_PTX "bf16"
#else
#define AB_PTX "f16"
#endif

#define BM 128
#define BN 256
#define BK 64 /* one 128-byte swizzle row of K */
#define CONSUMERS 2
#define THREADS (128 * (CONSUMERS + 1))
#define A_BYTES (BM * BK * 2)
#define B_BYTES (BN * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)

/* A CUtensorMap, passed by value as a __grid_constant__ parameter (TMA
 * reads it from parameter space; it must be 64-byte aligned there). */
typedef struct __align__(64) tmap_t {
  u64 q[16];
} tmap_t;

/* ---------------------------------------------------------------- PTX wrappers */

static __device__ __forceinline__ u32 smem_u32(const void *p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

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

/* TMA: the box at (x = K offset, y = row) of the tensor map into dst. */
static __device__ __forceinline__ void tma_load(u32 dst, const tmap_t *map, int x, int y, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(dst),
      "l"((u64)map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

/* wgmma shared-memory descriptor: K-major, 128-byte swizzle, 8-row groups
 * 1024 bytes apart (SBO); the leading offset is unused for this layout. */
static __device__ __forceinline__ u64 wgmma_desc(u32 addr) {
  return (u64)((addr & 0x3ffffu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

static __device__ __forceinline__ void wgmma_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit(void) {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
#define WGMMA_WAIT(n) asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(n) : "memory")

/* d (64 x 256 per warpgroup) += A (64 x 16) * B (16 x 256). */
static __device__ __forceinline__ void wgmma_step(float *d, u64 da, u64 db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." AB_PTX "." AB_PTX " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db));
}

/* d = A * B: the first step of a tile. d is only written, so the previous
 * tile's accumulators are dead once its epilogue has read them. */
static __device__ __forceinline__ void wgmma_first(float *d, u64 da, u64 db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." AB_PTX "." AB_PTX " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, 0, 1, 1, 0, 0;\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
        "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]),
        "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]),
        "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]),
        "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]),
        "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]),
        "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]),
        "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63]),
        "=f"(d[64]), "=f"(d[65]), "=f"(d[66]), "=f"(d[67]), "=f"(d[68]), "=f"(d[69]), "=f"(d[70]), "=f"(d[71]),
        "=f"(d[72]), "=f"(d[73]), "=f"(d[74]), "=f"(d[75]), "=f"(d[76]), "=f"(d[77]), "=f"(d[78]), "=f"(d[79]),
        "=f"(d[80]), "=f"(d[81]), "=f"(d[82]), "=f"(d[83]), "=f"(d[84]), "=f"(d[85]), "=f"(d[86]), "=f"(d[87]),
        "=f"(d[88]), "=f"(d[89]), "=f"(d[90]), "=f"(d[91]), "=f"(d[92]), "=f"(d[93]), "=f"(d[94]), "=f"(d[95]),
        "=f"(d[96]), "=f"(d[97]), "=f"(d[98]), "=f"(d[99]), "=f"(d[100]), "=f"(d[101]), "=f"(d[102]), "=f"(d[103]),
        "=f"(d[104]), "=f"(d[105]), "=f"(d[106]), "=f"(d[107]), "=f"(d[108]), "=f"(d[109]), "=f"(d[110]), "=f"(d[111]),
        "=f"(d[112]), "=f"(d[113]), "=f"(d[114]), "=f"(d[115]), "=f"(d[116]), "=f"(d[117]), "=f"(d[118]), "=f"(d[119]),
        "=f"(d[120]), "=f"(d[121]), "=f"(d[122]), "=f"(d[123]), "=f"(d[124]), "=f"(d[125]), "=f"(d[126]), "=f"(d[127])
      : "l"(da), "l"(db));
}

/* ---------------------------------------------------------------- epilogue */

/* The epilogue goes through a per-consumer buffer of 64 rows x EPI_COLS
 * columns in shared memory (the stages may already hold the next tile):
 * threads drop their accumulators in with plain stores, then walk the
 * buffer row by row, so the epilogue's code exists once and D is written in
 * whole rows. EPI_LD's pad of 8 words keeps the accumulator stores of a
 * half-warp (4 rows x 8 pairs) on distinct banks. */
#define EPI_COLS 32
#define EPI_LD (EPI_COLS + 8)
#define EPI_BYTES (64 * EPI_LD * 4)

/* Named barrier of one consumer warpgroup (id 0 is __syncthreads). */
static __device__ __forceinline__ void wg_sync(int c) {
  if (c == 0) asm volatile("bar.sync 1, 128;" ::: "memory");
  else asm volatile("bar.sync 2, 128;" ::: "memory");
}

/* D[r, c] and D[r, c + 1] from two accumulators. 16-bit row-major outputs
 * take one 4-byte store; anything else goes element by element. */
static __device__ __forceinline__ void store_pair(const gemm_params &P, i64 r, i64 c, float v0, float v1) {
  const gemm_prob &p = P.p;
  const i64 off = r * p.d_rs + c * p.d_cs;
  if ((P.dt_d == DT_BF16 || P.dt_d == DT_F16) && p.d_cs == 1 && c + 1 < p.n && ((p.d + (u64)off * 2) & 3) == 0) {
    float e0 = gemm_epi_value(P, p, r, c, v0), e1 = gemm_epi_value(P, p, r, c + 1, v1);
    if (P.clamp) {
      const float m = P.dt_d == DT_F16 ? 65504.f : GEMM_BF16_MAX;
      e0 = gemm_clampf(e0, m);
      e1 = gemm_clampf(e1, m);
    }
    u32 w;
    if (P.dt_d == DT_BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(e1), "f"(e0));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(e1), "f"(e0));
    *(u32 *)((smelt_h16 *)p.d + off) = w;
    return;
  }
  gemm_epilogue(P, p, r, c, v0);
  if (c + 1 < p.n) gemm_epilogue(P, p, r, c + 1, v1);
}

/* ---------------------------------------------------------------- the main loop */

/* One stage for consumer c: its 64 rows of A (stage + c * 64 rows of 128
 * bytes) times the stage's B, four k16 steps 32 bytes apart. `first`
 * (a constant at each call) starts the tile's accumulators. */
static __device__ __forceinline__ void mma_stage(float *d, u32 stage, int c, int first) {
  const u32 sa = stage + c * (64 * 128), sb = stage + A_BYTES;
  wgmma_fence();
  if (first) wgmma_first(d, wgmma_desc(sa), wgmma_desc(sb));
  else wgmma_step(d, wgmma_desc(sa), wgmma_desc(sb));
#pragma unroll
  for (int kk = 1; kk < BK / 16; kk++) wgmma_step(d, wgmma_desc(sa + kk * 32), wgmma_desc(sb + kk * 32));
  wgmma_commit();
}

/* A consumer warp is done reading a stage: one arrival per warp. */
static __device__ __forceinline__ void release(u32 bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}

/* ---------------------------------------------------------------- the kernel */

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    gemm_sm90(const __grid_constant__ tmap_t tma_a, const __grid_constant__ tmap_t tma_b, const gemm_params P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  /* Stage s: A at base + s * STAGE_BYTES, B A_BYTES later, all 1024-aligned;
   * then the consumers' epilogue buffers and the mbarriers. The host asks
   * for 1024 bytes of alignment slack on top (smelt__gemm_table). */
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 epi = base + GEMM_STAGES * STAGE_BYTES;
  const u32 full = epi + CONSUMERS * EPI_BYTES, empty = full + GEMM_STAGES * 8;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int tiles_m = P.tiles_m, tiles_n = P.tiles_n, tiles = tiles_m * tiles_n;
  const int ktiles = (int)((P.p.k + BK - 1) / BK);

  if (threadIdx.x == 0) {
    for (int s = 0; s < GEMM_STAGES; s++) {
      mbar_init(full + 8 * s, 1);              /* the producer's expect_tx */
      mbar_init(empty + 8 * s, CONSUMERS * 4); /* one arrival per consumer warp */
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid != 0) return;
    int stage = 0;
    u32 phase = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      int tm, tn;
      gemm_raster(t, tiles_m, tiles_n, P.swizzle, &tm, &tn);
      for (int kt = 0; kt < ktiles; kt++) {
        /* A fresh barrier counts as having completed the phase before phase
         * 0, so the first pass over the ring does not wait. */
        mbar_wait(empty + 8 * stage, phase ^ 1);
        const u32 bar = full + 8 * stage, sa = base + stage * STAGE_BYTES;
        mbar_expect_tx(bar, STAGE_BYTES);
        tma_load(sa, &tma_a, kt * BK, tm * BM, bar);
        tma_load(sa + A_BYTES, &tma_b, kt * BK, tn * BN, bar);
        if (++stage == GEMM_STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1, warp = tid / 32, lane = tid % 32;
  int stage = 0;
  u32 phase = 0;
  float d[128];
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    int tm, tn;
    gemm_raster(t, tiles_m, tiles_n, P.swizzle, &tm, &tn);
    /* K step 0 (peeled, so the first wgmma, which overwrites d, has a call
     * site of its own and d is never merged from two definitions). */
    mbar_wait(full + 8 * stage, phase);
    mma_stage(d, base + stage * STAGE_BYTES, c, 1);
    int prev = stage;
    if (++stage == GEMM_STAGES) {
      stage = 0;
      phase ^= 1;
    }
    for (int kt = 1; kt < ktiles; kt++) {
      mbar_wait(full + 8 * stage, phase);
      mma_stage(d, base + stage * STAGE_BYTES, c, 0);
      /* The previous stage's wgmmas are done once at most this one's group
       * is pending: hand that stage back to the producer. */
      WGMMA_WAIT(1);
      release(empty + 8 * prev, lane);
      prev = stage;
      if (++stage == GEMM_STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
    WGMMA_WAIT(0);
    release(empty + 8 * prev, lane);
    /* Accumulator i holds row 16 warp + lane/4 + 8 ((i/2) % 2) of this
     * consumer's 64 rows and column 8 (i/4) + 2 (lane%4) + i%2 of the tile;
     * EPI_COLS columns at a time go through the buffer. */
    float *buf = (float *)(smem_raw + (epi - smem_u32(smem_raw))) + c * (EPI_BYTES / 4);
    const i64 m0 = (i64)tm * BM + c * 64, n0 = (i64)tn * BN;
    const int rows = P.p.m - m0 < 64 ? (int)(P.p.m - m0) : 64;
#pragma unroll
    for (int q = 0; q < BN / EPI_COLS; q++) {
      if (n0 + q * EPI_COLS >= P.p.n) break; /* uniform: the rest of the tile is past N */
#pragma unroll
      for (int j = 0; j < EPI_COLS / 8; j++) {
        const int i = 4 * (q * (EPI_COLS / 8) + j), row = warp * 16 + (lane >> 2), col = 8 * j + 2 * (lane & 3);
        float2 lo, hi;
        lo.x = d[i];
        lo.y = d[i + 1];
        hi.x = d[i + 2];
        hi.y = d[i + 3];
        *(float2 *)&buf[row * EPI_LD + col] = lo;
        *(float2 *)&buf[(row + 8) * EPI_LD + col] = hi;
      }
      wg_sync(c);
      const int cols = P.p.n - (n0 + q * EPI_COLS) < EPI_COLS ? (int)(P.p.n - (n0 + q * EPI_COLS)) : EPI_COLS;
      /* Column pairs: a warp stores two rows of EPI_COLS columns. */
#pragma unroll 1
      for (int e = tid; e < 64 * (EPI_COLS / 2); e += 128) {
        const int r = e / (EPI_COLS / 2), cc = 2 * (e % (EPI_COLS / 2));
        if (r < rows && cc < cols)
          store_pair(P, m0 + r, n0 + q * EPI_COLS + cc, buf[r * EPI_LD + cc], buf[r * EPI_LD + cc + 1]);
      }
      wg_sync(c);
    }
  }
#else
  /* wgmma and setmaxnreg exist on sm_90a only. The variant list is compiled
   * for every arch, so elsewhere the kernel is a stub the selector never
   * picks (it offers this kernel on cc 9.0 only). */
  __trap();
#endif
}
