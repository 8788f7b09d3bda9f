/* The Hopper GEMM (sm_90a) for f16, bf16, tf32 and fp8, f32 accumulation,
 * every epilogue. A row-major and B column-major (both K-major, which
 * wgmma needs for tf32 and fp8), or for 16-bit types either operand
 * MN-major (GEMM_A_MN 1: A column-major; GEMM_B_MN 1: B row-major, as
 * x @ W with W [K, N]): wgmma reads a transposed 16-bit operand from
 * shared memory at full rate, so all four layouts run the same pipeline
 * and differ only in the TMA boxes and the descriptors (below).
 *
 * Prelude: GEMM_ACC 1 (f32); GEMM_AB 1 (f32 operands, tf32 math), 2 (f16),
 * 3 (bf16) or 4 (fp8, with GEMM_FP8_A and GEMM_FP8_B each 4 e4m3 or
 * 5 e5m2); GEMM_BN, the tile width: 256, or 64 for problems with too few
 * wide tiles to fill the GPU (a skinny M), or 128 with GEMM_PINGPONG 1
 * (the ping-pong schedule, below); GEMM_STAGES; GEMM_CONSUMERS, the
 * consumer warpgroups (2 if absent, or 1: the tile is 64 x 64 consumers
 * rows, so a skinny M gets twice the CTAs of the 128-row tile; BN 64 or
 * 128 then).
 *
 * Every element type uses the same bytes: a K step (BK) is one 128-byte
 * row of each operand row (32 tf32, 64 16-bit or 128 fp8 elements), and
 * each of its four wgmma steps reads 32 bytes of it (k8, k16 or k32), so
 * the stages, descriptors and pipeline are the same for all of them.
 * tf32 wgmma reads the top 19 bits of each f32 (truncation, as cuBLAS's
 * tf32 does on Hopper). fp8 wgmma adds its products to the accumulator
 * with fewer bits than f32 (about 14 bits of mantissa kept at each
 * addition), so the selector takes this kernel for fp8 only when D is
 * 16-bit or 8-bit, whose rounding is larger.
 *
 * One persistent CTA per SM walks the output tiles (BM x BN, BM = 64 x
 * consumers) in the banded order of gemm_raster, so the tiles in flight
 * share A rows and B columns in L2; a grouped run (host scheduling) walks
 * the tiles of all groups in order, with each group's tensor maps in
 * device memory (sm90_locate). One warpgroup per consumer and one more:
 *   producer (warpgroup 0, one thread): TMA loads of the A (BM x BK) and B
 *     (BN x BK) tiles of each K step into a ring of STAGES shared-memory
 *     stages, each completing on the stage's "full" mbarrier with its byte
 *     count; before reusing a stage it waits on the stage's "empty" mbarrier;
 *   consumers (warpgroups 1 .. consumers): each multiplies its 64 rows of
 *     the A tile by the whole B tile with four wgmma m64nBN per stage (the
 *     accumulator lives in BN / 2 registers per thread), releases a stage as
 *     soon as the wgmmas reading it are done, and after the last K step
 *     applies the epilogue (below).
 * With two consumers, setmaxnreg moves registers from the producer (40) to
 * the consumers (232); one consumer (256 threads) has registers to spare.
 * The producer runs ahead into the next tile while the consumers store the
 * previous one, so loads overlap the epilogue, but the tensor cores idle
 * during it (the consumers finish their main loops together).
 *
 * GEMM_PINGPONG 1 (tile 128 x 128): the consumers take this CTA's tiles in
 * turn, each multiplying both 64-row halves of its own tile (two wgmma
 * m64n128 per step, 128 accumulators per thread), so one consumer's
 * epilogue overlaps the other's main loop. Named barriers hand the main
 * loop from one consumer to the other (pp_wait, pp_pass); the producer is
 * unchanged. It ran behind the cooperative schedule (its tiles move a
 * third more bytes from L2 per multiply-add: docs/PERF.md, GEMM: decisions,
 * third round), so the selector takes it only when asked.
 *
 * Clusters (GEMM_CLUSTER_M or GEMM_CLUSTER_N, 2 or 4, the other 1;
 * cooperative schedule only): the CTAs of a cluster take output tiles
 * side by side, CM consecutive tile rows of one tile column (they share
 * the B tile) or CN consecutive tile columns of one tile row (they share
 * the A tile). Each CTA loads 1/CM of the shared tile with a multicast TMA
 * load that lands in every CTA of the cluster at the same shared-memory
 * offset and completes on every CTA's full barrier there, so L2 sends the
 * shared operand once per cluster instead of once per CTA. A full barrier
 * expects the whole stage's bytes (its own loads plus its peers'
 * multicasts); a stage may be refilled only when the consumers of every
 * CTA have released it (a peer's multicast writes into our shared
 * memory), so each consumer warp arrives on the empty barrier of every CTA
 * in the cluster (lane r on rank r's, through mapa). The cluster walks
 * tile groups ("units", rastered like tiles) together; a unit's tile past
 * the matrix edge (odd tile counts) still loads (TMA fills zeros), runs
 * and arrives like any other, but stores nothing, so the CTAs' pipelines
 * stay in step. A cluster barrier after the barriers' init (before any
 * remote arrival or multicast); before exit, the producer waits until
 * every stage's last fill was released by all the cluster's consumers,
 * so no CTA leaves while a peer may still arrive on its barriers (as
 * CUTLASS's load tail does).
 *
 * Grouped by device offsets (MODE_GROUPED_OFFS, the MoE form; no
 * clusters or ping-pong): the host knows T, N, K and G but not the rows
 * per group, so it launches one CTA per SM and passes A and D as maps over
 * all T rows and B as a 3-D map (K, N, G). The tiles are numbered group
 * after group (group g: ceil(rows_g / BM) x ceil(N / BN), rastered as a
 * plain problem); each thread that locates tiles (the producer and every
 * consumer) keeps a forward cursor over the groups, reading one offset per
 * group it passes and clamping the ends as smelt/gemm.h says, so all of
 * them see the same tiles and stop together past the last group's
 * (sm90_locate). A tile's A rows start at its group's first row (rows past
 * the group's end are the next group's or TMA's zeros: they only reach
 * rows that are not stored); B's box is at z = the group. A piece whose 64
 * rows cross the group's end goes out through the threads, row-masked,
 * instead of the TMA store (piece_out).
 *
 * Parallel split-K (plain runs): tiles are numbered slice by slice, each
 * slice's K range loaded from its first K tile, and the fast epilogue
 * writes the slice's f32 partial sums into the workspace through a 3-D map
 * (sm90_locate); gemm_reduce finishes.
 *
 * Batched (fast epilogue only, no clusters or ping-pong): tiles are
 * numbered entry by entry, and A, B and D come through 3-D maps whose z is
 * the entry (a broadcast A or B, batch stride 0, through a 2-D map).
 *
 * Conv2d (GEMM_CONV 1 fprop, 2 dgrad, 3 wgrad; conv2d_sm90.cuh): the
 * implicit GEMM on this pipeline, the activation loaded by TMA in im2col
 * mode; a strided dgrad runs as unit-stride phases whose pieces the
 * threads scatter to dx (piece_out), or, where a phase would have no tap,
 * with the whole producer warpgroup gathering dy by cp.async
 * (GEMM_CONV_GATHER; it moves no registers).
 *
 * Shared memory: TMA writes each 128-byte row of K with the 128-byte
 * swizzle, which is the K-major layout wgmma reads with SBO = 1024 (eight
 * rows); stages are 1024-byte aligned so the swizzle phase starts at 0, and
 * the wgmma steps inside a 128-byte row are start-address offsets of 32 bytes.
 * Ragged M, N and K need nothing: TMA fills out-of-bounds elements with
 * zeros, TMA stores clip at the matrix edge and the general epilogue skips
 * rows and columns past the matrix. K >= 1 (the host sends K = 0 elsewhere).
 * TMA stores clip in whole 16-byte units, though: a partial unit at a row's
 * end is written in full, past column N - 1. So the host takes the fast
 * epilogue only for rows of whole units (smelt__gemm_sm90_fast_d).
 *
 * Two epilogues. The fast one (`fast` != 0: 16-bit or f32 row-major D with
 * 16-byte aligned rows of whole 16-byte units, no C) works on the
 * accumulators in registers: the bias, loaded once per tile, comes from
 * shared memory, the activation runs in f32 with its switch outside the
 * per-element loop (for 16-bit D, exp and erfc in MUFU forms: act16), and
 * each 64 x 64
 * piece goes (packed to 16 bits, or as f32 in two halves) into a swizzled
 * shared buffer that one thread hands to a TMA store; the next piece's math
 * overlaps that store. The general one serves every other output (any dtype
 * and layout, C): accumulators go through a shared buffer and each element
 * through gemm_epilogue.
 */
#include "gemm_common.cuh"
#include "smelt_mma.cuh"

#if !defined(GEMM_AB) || !defined(GEMM_STAGES) || GEMM_ACC != ACC_F32
#error "gemm_sm90.cu needs GEMM_AB (1 tf32, 2 f16, 3 bf16, 4 fp8), GEMM_STAGES and GEMM_ACC 1"
#endif
/* The wgmma shape and types, and the operands after the descriptors:
 * scale-d, the input scales (1) and, for 16-bit types only, the transpose
 * flags (0: both K-major). */
#if !defined(GEMM_A_MN)
#define GEMM_A_MN 0
#endif
#if !defined(GEMM_B_MN)
#define GEMM_B_MN 0
#endif
#define A_MN GEMM_A_MN
#define B_MN GEMM_B_MN
/* The 16-bit wgmma's transpose flags: 1 reads that operand MN-major. */
#if A_MN && B_MN
#define WG_TRANS "1, 1"
#elif A_MN
#define WG_TRANS "1, 0"
#elif B_MN
#define WG_TRANS "0, 1"
#else
#define WG_TRANS "0, 0"
#endif
#if GEMM_AB == DT_F32
#define WG_KIND "k8.f32.tf32.tf32"
#define WG_TAIL "1, 1"
#define AB_SIZE 4
#elif GEMM_AB == DT_F16
#define WG_KIND "k16.f32.f16.f16"
#define WG_TAIL "1, 1, " WG_TRANS
#define AB_SIZE 2
#elif GEMM_AB == DT_BF16
#define WG_KIND "k16.f32.bf16.bf16"
#define WG_TAIL "1, 1, " WG_TRANS
#define AB_SIZE 2
#elif GEMM_AB == DT_E4M3 && defined(GEMM_FP8_A) && defined(GEMM_FP8_B)
#if GEMM_FP8_A == DT_E4M3 && GEMM_FP8_B == DT_E4M3
#define WG_KIND "k32.f32.e4m3.e4m3"
#elif GEMM_FP8_A == DT_E4M3
#define WG_KIND "k32.f32.e4m3.e5m2"
#elif GEMM_FP8_B == DT_E4M3
#define WG_KIND "k32.f32.e5m2.e4m3"
#else
#define WG_KIND "k32.f32.e5m2.e5m2"
#endif
#define WG_TAIL "1, 1"
#define AB_SIZE 1
#else
#error "gemm_sm90.cu: GEMM_AB must be 1, 2, 3, or 4 with GEMM_FP8_A and GEMM_FP8_B"
#endif

#if !defined(GEMM_PINGPONG)
#define GEMM_PINGPONG 0
#endif
/* GEMM_PROMOTE P (cooperative, tf32): every P stages the consumers wait for
 * their wgmmas, add the accumulators into f32 registers (round to nearest)
 * and start the tensor cores' sum afresh. The tensor cores' running sum
 * drops low bits at each addition (about 2^-22 relative, biased: 3xtf32
 * over K = 1024 came out at 2.4e-6 against f32's 5.7e-7 on H100, growing
 * with K), which is noise for tf32 inputs but not for the 3xtf32 split,
 * whose three products restore f32 accuracy only if their sum keeps it
 * (DeepGEMM promotes fp8 the same way). Twice the accumulator registers:
 * tiles of BN 128 at most. */
#if !defined(GEMM_PROMOTE)
#define GEMM_PROMOTE 0
#endif
#define PROMOTE GEMM_PROMOTE
#if !defined(GEMM_CONSUMERS)
#define GEMM_CONSUMERS 2
#endif
#if GEMM_CONSUMERS != 1 && GEMM_CONSUMERS != 2
#error "gemm_sm90.cu needs GEMM_CONSUMERS 1 or 2"
#endif
#if GEMM_PINGPONG ? ((GEMM_BN != 128 && GEMM_BN != 64) || GEMM_CONSUMERS != 2)                                    \
                  : (!defined(GEMM_BN) || (GEMM_BN != 256 && GEMM_BN != 128 && GEMM_BN != 64))
#error "gemm_sm90.cu needs GEMM_BN 256, 128 or 64 (cooperative) or 128 or 64 with two consumers (GEMM_PINGPONG 1)"
#endif
#define PINGPONG GEMM_PINGPONG
#if !defined(GEMM_CLUSTER_M)
#define GEMM_CLUSTER_M 1
#endif
#if !defined(GEMM_CLUSTER_N)
#define GEMM_CLUSTER_N 1
#endif
#define CM GEMM_CLUSTER_M
#define CN GEMM_CLUSTER_N
#define CLUSTER (CM * CN)
#if CLUSTER > 1 && (PINGPONG || (CM > 1 && CN > 1) || (CLUSTER != 2 && CLUSTER != 4))
#error "gemm_sm90.cu: a cluster is 2 or 4 CTAs along M or along N, cooperative schedule only"
#endif
#define CONSUMERS GEMM_CONSUMERS
#if PROMOTE && (PINGPONG || CLUSTER > 1 || GEMM_BN > 128)
#error "gemm_sm90.cu: GEMM_PROMOTE needs the cooperative schedule, no cluster, GEMM_BN <= 128"
#endif
/* GEMM_BLOCK_SCALE 1 (fp8, cooperative, BN 128 or 64): the block scales
 * of smelt/gemm.h (DeepGEMM's form), one k block a stage (BK is 128 fp8
 * elements), each stage's sum promoted into f32 registers with its scales
 * (blk_main). The scales come as the kernel's last parameter (sm90_blk);
 * the epilogue's row and column vectors are absent. */
#if !defined(GEMM_BLOCK_SCALE)
#define GEMM_BLOCK_SCALE 0
#endif
#define BLOCK_SCALE GEMM_BLOCK_SCALE
#if BLOCK_SCALE && (AB_SIZE != 1 || PINGPONG || PROMOTE || GEMM_BN > 128)
#error "gemm_sm90.cu: GEMM_BLOCK_SCALE needs fp8, the cooperative schedule, no GEMM_PROMOTE, GEMM_BN <= 128"
#endif
/* MN-major operands (wgmma transposes 16-bit types only), without clusters. */
#if (A_MN || B_MN) && (AB_SIZE != 2 || CLUSTER > 1)
#error "gemm_sm90.cu: MN-major A or B (GEMM_A_MN, GEMM_B_MN) for 16-bit types, no cluster"
#endif
#define BM (64 * CONSUMERS)
#define BN GEMM_BN
/* Two B matrices (the MoE's fused products; grouped by offsets, the fast
 * epilogue, no bias or scales: the host sees to it). GEMM_GLU 1, the gated
 * up projection (cooperative, BN 256, B MN-major): B is the gate G (B's
 * map) and the up U (B2's), and a tile covers TILE_N = BN / 2 columns of
 * each, its accumulator columns 0 .. 127 A·G's and 128 .. 255 A·U's
 * (panels of 64 from either map), so one thread holds both values of an
 * element; the epilogue stores silu(g)·u to D and, when X.keep is set, g
 * and u to the keep matrix at columns c and X.keep_up + c. GEMM_KCAT 1,
 * K in two parts (B K-major): B's rows below X.kcat come from B's map, the
 * rest from B2's, A one matrix over all of K, so D = A[:, :kc]·B +
 * A[:, kc:]·B2 in one accumulator (kc a whole number of K steps).
 * GEMM_DGLU 1, SwiGLU's backward in the epilogue of dA = dy·W2ᵀ
 * (cooperative, 16-bit): h1 and h3 (the aux matrix through B2's map: h1 at
 * column c, h3 at X.keep_up + c) reach the epilogue through the main
 * loop's ring, after a tile's K steps one stage a 64-column piece (both
 * consumers' 64 x 64 boxes of each), so their loads overlap the main loop
 * as the operands' do; it stores dh1 and dh3 to the keep matrix at the
 * same columns (it may be the aux matrix: a tile reads its elements before
 * it writes them) and silu(h1)·h3 to D; dA never reaches memory. */
#if !defined(GEMM_GLU)
#define GEMM_GLU 0
#endif
#if !defined(GEMM_KCAT)
#define GEMM_KCAT 0
#endif
#if !defined(GEMM_DGLU)
#define GEMM_DGLU 0
#endif
#if GEMM_DGLU && (PINGPONG || CLUSTER > 1 || AB_SIZE != 2 || BLOCK_SCALE || GEMM_GLU || GEMM_KCAT)
#error "gemm_sm90.cu: GEMM_DGLU needs 16-bit types and the cooperative schedule"
#endif
#if GEMM_GLU && (PINGPONG || CLUSTER > 1 || !B_MN || GEMM_BN != 256 || AB_SIZE != 2 || BLOCK_SCALE || GEMM_KCAT)
#error "gemm_sm90.cu: GEMM_GLU needs 16-bit types, the cooperative schedule, BN 256, B MN-major"
#endif
#if GEMM_KCAT && (B_MN || CLUSTER > 1 || BLOCK_SCALE)
#error "gemm_sm90.cu: GEMM_KCAT needs B K-major, no cluster or block scales"
#endif
#define TILE_N (GEMM_GLU ? BN / 2 : BN) /* D's columns a tile covers */
#if GEMM_GLU || GEMM_KCAT || GEMM_DGLU
/* The second B's and the pair matrices' parameters (mirrored by smelt__moe_b2 in src/cuda/moe_cuda.h). */
typedef struct gemm_b2 {
  u64 keep;         /* GLU, DGLU: the keep matrix (D's dtype), or 0 */
  i64 keep_rs;      /* its row stride, elements */
  i64 keep_up;      /* its (and aux's) first column of U's values */
  i64 kcat;         /* KCAT: the K elements from B's map */
} gemm_b2;
#define B2_KPARAM , const __grid_constant__ tmap_t tma_b2, const __grid_constant__ tmap_t tma_k, const gemm_b2 X
#else
#define B2_KPARAM
#endif
/* Accumulators per consumer thread: its 64 x BN rows of the tile
 * (cooperative) or its whole 128 x BN tile (ping-pong: the two 64-row
 * halves BN / 2 apart). */
#define ACCS (PINGPONG ? BN : BN / 2)
#define BK (128 / AB_SIZE) /* elements: one 128-byte swizzle row of K */
#define THREADS (128 * (CONSUMERS + 1))
#define A_BYTES (BM * 128)
#define B_BYTES (BN * 128)
#define STAGE_BYTES (A_BYTES + B_BYTES)

/* ---------------------------------------------------------------- PTX wrappers */

/* Shared-memory layouts of a stage's operands (128-byte swizzle both):
 * K-major, one 128-byte row of K per row of the operand, 8-row atoms 1024
 * bytes apart (wgmma_desc_kmajor), a k step (32 bytes of K) a start offset
 * of 32 bytes; MN-major (16-bit A column-major or B row-major), panels of
 * 64 columns of M or N (128 bytes) by the stage's BK rows of K, one
 * after the other, each a TMA box: 8-row atoms of K 1024 bytes apart
 * (SBO), panels PANEL_BYTES apart (LBO), a k step (16 rows of K) a start
 * offset of 2048 bytes. Both come to the same bytes per stage. */
#define PANEL_BYTES (BK * 128)
static __device__ __forceinline__ u64 desc_mnmajor(u32 addr) {
  return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(PANEL_BYTES >> 4) << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
#define A_STEP (A_MN ? 2048 / 16 : 2)
#define B_STEP (B_MN ? 2048 / 16 : 2)

/* d (64 x BN per warpgroup) += A (64 x k) * B (k x BN), k = 32 bytes of K;
 * wgmma_first: d = A * B, the first step of a tile. d is only written
 * there, so the previous tile's accumulators are dead once its epilogue has
 * read them. The accumulator lists per tile width come from smelt_mma.cuh. */
#if BN == 256
#define WG_N "m64n256"
#define WG_REGS WG_REGS128
#define WG_AB "%128, %129"
#define WG_D WG_D128
#elif BN == 128
#define WG_N "m64n128"
#define WG_REGS WG_REGS64
#define WG_AB "%64, %65"
#define WG_D WG_D64
#else
#define WG_N "m64n64"
#define WG_REGS WG_REGS32
#define WG_AB "%32, %33"
#define WG_D WG_D32
#endif
static __device__ __forceinline__ void wgmma_step(float *d, u64 da, u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned." WG_N WG_KIND " {" WG_REGS "}, " WG_AB ", 1, " WG_TAIL ";\n"
               : WG_D(WG_RW)
               : "l"(da), "l"(db));
}
static __device__ __forceinline__ void wgmma_first(float *d, u64 da, u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned." WG_N WG_KIND " {" WG_REGS "}, " WG_AB ", 0, " WG_TAIL ";\n"
               : WG_D(WG_W)
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
  if (c == 0) BAR_SYNC(1, 128);
  else BAR_SYNC(2, 128);
}

/* Every cooperative consumer (named barrier 5; one consumer: its own
 * warpgroup's barrier): around the shared bias row. */
static __device__ __forceinline__ void pair_sync(void) {
#if CONSUMERS > 1
  BAR_SYNC(5, 256);
#else
  wg_sync(0);
#endif
}

/* Ping-pong turns: a consumer starts a tile's main loop only after the
 * other consumer has passed every stage wait of the tile before (named
 * barriers 3 and 4: one consumer arrives, the other waits). Besides
 * keeping the tensor cores on one main loop at a time, this is what makes
 * the skipped stages safe: an mbarrier wait knows only the parity of the
 * phase it waits for, so a consumer that jumped past the other's tile
 * (ktiles stages, many laps of the ring) must not test a stage's full
 * barrier while that barrier is more than one phase behind. */
static __device__ __forceinline__ void pp_wait(int c) {
  if (c == 0) BAR_SYNC(4, 256);
  else BAR_SYNC(3, 256);
}
static __device__ __forceinline__ void pp_pass(int c) {
  if (c == 0) BAR_ARRIVE(3, 256);
  else BAR_ARRIVE(4, 256);
}

/* Consumer c (thread tid) hands a filled buffer to a TMA store: piece_end
 * makes every thread's writes visible to the async proxy and stores the
 * box at (x, y), or (x, y, z) when z >= 0, unless its rows
 * start past M (`rows_in` 0). */
static __device__ __forceinline__ void piece_end(int c, int tid, const tmap_t *map, int x, int y, int z, int rows_in,
                                                 u32 buf) {
  fence_proxy_async();
  /* The consumer's pieces alternate between its two buffers, so the next
   * piece goes where the previous piece's store (thread 0's only one in
   * flight) reads: once that read is done, the barrier tells every thread.
   * That store had this whole piece's math to finish in. */
  if (tid == 0) bulk_wait_read();
  wg_sync(c);
  if (tid == 0 && rows_in) {
    if (z >= 0) {
      tma_store_3d(map, x, y, z, buf);
      bulk_commit();
    } else {
      tma_store(map, x, y, buf);
      bulk_commit();
    }
  }
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
    if (P.dt_d == DT_BF16) w = pack_bf16x2(e0, e1);
    else w = pack_f16x2(e0, e1);
    *(u32 *)((smelt_h16 *)p.d + off) = w;
    return;
  }
  gemm_epilogue(P, p, r, c, v0);
  if (c + 1 < p.n) gemm_epilogue(P, p, r, c + 1, v1);
}

/* The fast epilogue works on pieces of 64 rows x 64 columns. They reach D
 * through a buffer of 64 rows of 128 bytes in the layout of the D tensor
 * map's box (128-byte swizzle: the 16-byte chunk j of row r sits at chunk
 * j ^ (r % 8), which also spreads a warp's eight rows over all banks): a
 * 16-bit piece in one store, an f32 piece in two of 32 columns. Each
 * consumer has two buffers (1024-byte aligned; see piece_end), then come
 * the tile's BN columns of bias in f32: one row for both cooperative
 * consumers (they share the tile's columns), one per consumer in
 * ping-pong. The general epilogue's buffers (CONSUMERS x EPI_BYTES) use the
 * same space. */
#define PIECE 64
#define BUF_BYTES (64 * 128)
#define BIAS_ROWS (PINGPONG ? CONSUMERS : 1)
#define FAST_BYTES (CONSUMERS * 2 * BUF_BYTES + BIAS_ROWS * BN * 4)
/* Consumer c's next piece buffer (`pieces` counts its stores so far). */
#define NEXT_BUF(c) (epi + (u32)(2 * (c) + (pieces++ & 1)) * BUF_BYTES)
#define EPI_REGION (CONSUMERS * EPI_BYTES > FAST_BYTES ? CONSUMERS * EPI_BYTES : FAST_BYTES)

/* v[i] = act(v[i]) for one piece's 32 values per thread, with the switch
 * outside the loop so that each case is straight-line code with eight
 * independent chains. Rolled over four groups of eight, each pass working
 * on v[0 .. 7] and rotating the array by eight: a case's code exists once
 * per eight values, not 32 (the accurate functions are long, and ptxas
 * time grows with them). */
static __device__ __forceinline__ void act_piece_n(float *v, int act, float slope) {
#pragma unroll 1
  for (int g = 0; g < 4; g++) {
    float r[8];
#pragma unroll
    for (int i = 0; i < 8; i++) r[i] = gemm_act(v[i], act, slope);
#pragma unroll
    for (int i = 0; i < 24; i++) v[i] = v[i + 8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[24 + i] = r[i];
  }
}

/* The activations with an exp for 16-bit D, in the MUFU forms of
 * smelt_device.cuh: gelu through smelt_gelu16 (within 2e-5 relative),
 * sigmoid, silu and gelu_tanh as x / (1 + e^-y) with smelt_fast_exp and
 * smelt_fast_div (within 1e-5 relative while e^-y and its reciprocal stay
 * above 2^-126; past that, results under max(1, |x|) 2^-126 flush to 0, an
 * absolute error below 2e-37 for |x| <= 16). f16 rounds at 2^-11 and bf16
 * at 2^-8 relative, so at most an output whose exact value lies within
 * 2e-5 of a rounding boundary rounds the other way (tests/test_gemm.c
 * checks it element by element over [-16, 16]). They are a third to a half
 * of the accurate forms' instructions, so they run unrolled (no rotation
 * moves). f32 D keeps gemm_act's accurate functions. */
static __device__ __forceinline__ float act16(float x, int act) {
  switch (act) {
    case ACT_SIGMOID: return smelt_fast_div(1.f, 1.f + smelt_fast_exp(-x));
    case ACT_SILU: return smelt_fast_div(x, 1.f + smelt_fast_exp(-x));
    case ACT_GELU: return smelt_gelu16(x);
    default: { /* ACT_GELU_TANH */
      const float z = 0.7978845608f * (x + 0.044715f * x * x * x);
      return smelt_fast_div(x, 1.f + smelt_fast_exp(-2.f * z));
    }
  }
}
static __device__ __forceinline__ void act_piece16_n(float *v, int act) {
#pragma unroll
  for (int i = 0; i < 32; i++) v[i] = act16(v[i], act);
}

static __device__ __forceinline__ void act_piece(float *v, int act, float slope, int short_d) {
  switch (act) {
    case ACT_RELU: act_piece_n(v, ACT_RELU, slope); break;
    case ACT_LEAKY_RELU: act_piece_n(v, ACT_LEAKY_RELU, slope); break;
    case ACT_TANH: act_piece_n(v, ACT_TANH, slope); break;
    case ACT_SIGMOID:
      if (short_d) act_piece16_n(v, ACT_SIGMOID);
      else act_piece_n(v, ACT_SIGMOID, slope);
      break;
    case ACT_SILU:
      if (short_d) act_piece16_n(v, ACT_SILU);
      else act_piece_n(v, ACT_SILU, slope);
      break;
    case ACT_HARDSWISH: act_piece_n(v, ACT_HARDSWISH, slope); break;
    case ACT_GELU:
      if (short_d) act_piece16_n(v, ACT_GELU);
      else act_piece_n(v, ACT_GELU, slope);
      break;
    case ACT_GELU_TANH:
      if (short_d) act_piece16_n(v, ACT_GELU_TANH);
      else act_piece_n(v, ACT_GELU_TANH, slope);
      break;
    default: break;
  }
}

/* v = alpha * acc + bias for piece q's accumulators d[0 .. 31] (the
 * layout of fast_piece). */
static __device__ __forceinline__ void lin_piece(float alpha, const float *d, int q, const float *bias, int lane,
                                                 float *v) {
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const float2 b = *(const float2 *)&bias[PIECE * q + 8 * j + 2 * (lane & 3)];
#pragma unroll
    for (int e = 0; e < 4; e++) v[4 * j + e] = alpha * d[4 * j + e] + (e & 1 ? b.y : b.x);
  }
}

/* The rest of fast_piece after the linear combination: v = scale_d *
 * act(v), clamped if asked. */
static __device__ __forceinline__ void act_scale_piece(const gemm_params &P, float *v) {
  act_piece(v, P.act, P.slope, P.dt_d != DT_F32);
  const float m = P.dt_d == DT_F16 ? 65504.f : P.dt_d == DT_BF16 ? GEMM_BF16_MAX : GEMM_F32_MAX;
#pragma unroll
  for (int k = 0; k < 32; k++) {
    v[k] *= P.scale_d;
    if (P.clamp) v[k] = gemm_clampf(v[k], m);
  }
}

/* Piece q (tile columns 64q .. 64q + 63), whose accumulators the caller
 * has moved to d[0 .. 31], as v = scale_d * act(alpha_ab * acc + bias),
 * clamped if asked. v[k] is at row 16 warp + lane/4 + 8 ((k/2) % 2) and
 * piece column 8 (k/4) + 2 (lane%4) + k%2. `bias` is the tile's BN columns
 * (zeros without a bias). */
static __device__ __forceinline__ void fast_piece(const gemm_params &P, const float *d, int q, const float *bias,
                                                  int lane, float *v) {
  lin_piece((float)P.alpha_ab, d, q, bias, lane, v);
  act_scale_piece(P, v);
}

/* A 16-bit piece into the buffer: v[k] and v[k + 1] (k even) packed into
 * one word, row 16 warp + lane/4 + 8 ((k/2) % 2), chunk k/4. */
static __device__ __forceinline__ void put_piece16(u32 buf, const float *v, int bf16, int warp, int lane) {
  const u32 row = buf + (u32)(16 * warp + (lane >> 2)) * 128u + 4u * (u32)(lane & 3), sw = (u32)(lane >> 2);
#pragma unroll
  for (int k = 0; k < 32; k += 2) {
    const u32 j = (u32)(k / 4), h = (u32)((k / 2) % 2);
    u32 w;
    if (bf16) w = pack_bf16x2(v[k], v[k + 1]);
    else w = pack_f16x2(v[k], v[k + 1]);
    sts32(row + h * 8u * 128u + ((j ^ sw) << 4), w);
  }
}

/* Half `half` (piece columns 32 half .. 32 half + 31) of an f32 piece into
 * the buffer: v[k], v[k + 1] (k even, k/4 in that half) as one 8-byte
 * store at chunk 2 (k/4 % 4) + (lane%4)/2 of its row. */
static __device__ __forceinline__ void put_half32(u32 buf, const float *v, int half, int warp, int lane) {
  const u32 row = buf + (u32)(16 * warp + (lane >> 2)) * 128u + 8u * (u32)(lane & 1), sw = (u32)(lane >> 2);
#pragma unroll
  for (int k = 16 * half; k < 16 * half + 16; k += 2) {
    const u32 c = (u32)(2 * ((k / 4) % 4) + ((lane & 3) >> 1)), h = (u32)((k / 2) % 2);
    sts_f32x2(row + h * 8u * 128u + ((c ^ sw) << 4), v[k], v[k + 1]);
  }
}

/* ---------------------------------------------------------------- the main loop */

/* One stage for consumer c. Cooperative: its 64 rows of A (stage + c * 64
 * rows of 128 bytes) times the stage's B, four wgmma steps 32 bytes apart.
 * Ping-pong: the stage is c's alone; both 64-row halves of A times B, the
 * half h into d[64 h ..]. `first` (a constant at each call) starts the
 * tile's accumulators. */
static __device__ __forceinline__ void mma_stage(float *d, u32 stage, int c, int first) {
  /* A k step is a descriptor + A_STEP / B_STEP (the address field counts
   * 16 bytes; shared addresses stay below 2^18, so it never carries). */
  const u64 db = B_MN ? desc_mnmajor(stage + A_BYTES) : wgmma_desc_kmajor(stage + A_BYTES);
  wgmma_fence();
#if PINGPONG
  (void)c;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    /* MN-major A: a half's four K steps in a row (its panel's rows of K
     * one after the other); K-major: both halves at each K step. */
    const int kk = A_MN ? i % 4 : i / 2, h = A_MN ? i / 4 : i % 2;
    /* Half h of A: rows 64h.. of a K-major tile, or its panel h. */
    const u64 da = (A_MN ? desc_mnmajor(stage + h * PANEL_BYTES) : wgmma_desc_kmajor(stage + h * (64 * 128))) +
                   A_STEP * kk;
    if (first && kk == 0) wgmma_first(d + (BN / 2) * h, da, db);
    else wgmma_step(d + (BN / 2) * h, da, db + B_STEP * kk);
  }
#else
  /* Consumer c's 64 rows of A: rows 64c.. of a K-major tile, or its panel c. */
  const u64 da = A_MN ? desc_mnmajor(stage + c * PANEL_BYTES) : wgmma_desc_kmajor(stage + c * (64 * 128));
  if (first) wgmma_first(d, da, db);
  else wgmma_step(d, da, db);
#pragma unroll
  for (int kk = 1; kk < 4; kk++) wgmma_step(d, da + A_STEP * kk, db + B_STEP * kk);
#endif
  wgmma_commit();
}

/* A consumer warp is done reading a stage: one arrival per warp, on this
 * CTA's empty barrier or, in a cluster, on every CTA's (lane r on rank r's). */
static __device__ __forceinline__ void release(u32 bar, int lane) {
  __syncwarp();
#if CLUSTER > 1
  if (lane < CLUSTER) mbar_arrive_rank(bar, (u32)lane);
#else
  if (lane == 0) mbar_arrive(bar);
#endif
}

/* ---------------------------------------------------------------- locating a tile */

/* What a tile needs to know about its problem. Plain mode: the launch's
 * problem and the tensor maps passed by value. Parallel split-K (plain
 * with slices): tiles are numbered slice by slice, slice z taking the K
 * tiles from kt0 = z k_slice / BK on and writing its partial sums (the host
 * passes an identity epilogue with f32 D) at z of the 3-D D map over the
 * workspace; gemm_reduce adds the slices and applies the epilogue. Grouped
 * mode (host
 * scheduling, fast epilogue only): tiles are numbered over all groups in
 * order, group g owning [first[g], first[g + 1]) of P.group_tiles, and its
 * A, B and D maps are gmaps[3g .. 3g + 2] in device memory. */
typedef struct sm90_tile {
  int tm, tn, kt0, ktiles;
  int slice; /* -1 unless a parallel split */
  int sk;    /* split tail: 0 a whole tile, else 1 + the K chunk of tile sk_slot of the tail (sk_locate) */
  int sk_slot;
  int grp;   /* grouped (host scheduling): the group, else 0 */
  int az;    /* batched: A's entry (z of its 3-D map), else -1 (a 2-D map) */
  int bz;    /* grouped by offsets: B's group, batched: B's entry (z of its 3-D map), else -1 */
  i64 row0;  /* A's and D's row of the tile's first row */
  i64 m, n;  /* grouped by offsets: m is the group's end row in D */
  u64 bias;
  i64 bias_s;
  const tmap_t *ma, *mb, *md;
  const tmap_t *mb2; /* GEMM_GLU, GEMM_KCAT: the producer's second B map */
  i64 kcat;          /* GEMM_KCAT: the K elements from mb */
} sm90_tile;

/* Units: a cluster's CM x CN tiles (one tile without clusters), rastered
 * as tiles are (the band counted in units); the tile of cluster rank
 * `rank` in unit (um, un). */
static __device__ __forceinline__ void unit_tile(int t, int tiles_m, int tiles_n, int band, u32 rank, sm90_tile *w) {
  int um, un;
  gemm_raster(t, (tiles_m + CM - 1) / CM, (tiles_n + CN - 1) / CN, (band + CM - 1) / CM, &um, &un);
  w->tm = um * CM + (CM > 1 ? (int)rank : 0);
  w->tn = un * CN + (CN > 1 ? (int)rank : 0);
}

/* A CTA's forward cursor over the groups (each thread keeps its own; the
 * units it asks for come in increasing order). Host scheduling: the group
 * g. Grouped by offsets: g groups read so far, the last of them owning
 * rows [r0, r1) of A and D and the units [first, first + units). It
 * starts zeroed. */
typedef struct sm90_cursor {
  int g, first, units;
  i64 r0, r1;
} sm90_cursor;

/* Grouped by offsets: moves the cursor to the group of unit t, reading
 * one offset per group passed (the same few bytes for every CTA, from L2,
 * and for the consumers from L1 after the producer's read); 0 when t lies
 * past the last group's units. Each end is clamped as smelt/gemm.h says
 * (to the running maximum and to T), so every thread that walks the same
 * units finds the same tiles, and the host needs no total. */
static __device__ __forceinline__ int offs_advance(const gemm_params &P, int t, sm90_cursor *c) {
  while (t >= c->first + c->units) {
    if (c->g == P.count) return 0;
    const i64 e = P.offs_i64 ? (i64)__ldg((const long long *)P.offs + c->g) : (i64)__ldg((const int *)P.offs + c->g);
    c->r0 = c->r1;
    c->r1 = e < c->r0 ? c->r0 : e > P.p.m ? P.p.m : e;
    c->first += c->units;
    c->units = (int)((c->r1 - c->r0 + BM - 1) / BM) * P.tiles_n;
    c->g++;
  }
  return 1;
}

/* Split tail (plain runs, no clusters or ping-pong): the first dp =
 * tiles - P.sk_tiles tiles run whole; the last sk_tiles tiles (the part
 * of the last wave that leaves SMs idle) run in P.sk_chunks (2 to 4) equal
 * K ranges each, chunk by chunk (units dp + chunk x sk_tiles + tile), so
 * the CTAs on a chunk read the same K range of A and B at about the same
 * time, as whole tiles do (L2 serves the rest). Every chunk but the last
 * stores its f32 partial sums in a slot of its own and counts itself in
 * the tile's flag; the last waits for the count, adds the slots in chunk
 * order (results are deterministic) and runs the epilogue. A unit waits
 * only on units of lower number, which their CTAs (every CTA is resident:
 * one a SM) take no later than the waiter's CTA takes the waiter, and
 * which never wait, so the waits end. *t becomes the unit's tile; 0 past
 * the last unit. */
static __device__ __forceinline__ int sk_locate(const gemm_params &P, sm90_tile *w, int *t) {
  const int dp = P.tiles_m * P.tiles_n - P.sk_tiles;
  if (*t < dp) return 1; /* a whole tile (sm90_locate cleared w->sk) */
  const int v = *t - dp, chunk = v / P.sk_tiles, tile = v % P.sk_tiles;
  if (chunk >= P.sk_chunks) return 0;
  const int kt = w->ktiles, k0 = (int)((i64)chunk * kt / P.sk_chunks), k1 = (int)((i64)(chunk + 1) * kt / P.sk_chunks);
  w->kt0 = k0;
  w->ktiles = k1 - k0;
  w->sk = chunk + 1;
  w->sk_slot = tile;
  *t = dp + tile;
  return 1;
}

/* Unit t (a tile without clusters); g is the caller's group cursor: units
 * come in increasing order, so the search moves forward (past empty
 * groups) and costs a load or two. Grouped: P.group_tiles counts units.
 * Grouped by offsets (no clusters): the group's tiles in A's and D's rows
 * from its first row on, B at z = the group; 0 past the last group's
 * tiles (the caller stops), else 1. */
static __device__ __forceinline__ int sm90_locate(const gemm_params &P, const tmap_t *tma_a, const tmap_t *tma_b,
                                                  const tmap_t *tma_d, const tmap_t *gmaps, int t, sm90_cursor *g,
                                                  u32 rank, sm90_tile *w) {
  w->az = w->bz = -1;
  w->sk = w->grp = 0;
  if (P.mode == MODE_GROUPED_OFFS) {
    if (!offs_advance(P, t, g)) return 0;
    w->m = g->r1;
    w->n = P.p.n;
    w->kt0 = 0;
    w->ktiles = (int)((P.p.k + BK - 1) / BK);
    w->slice = -1;
    w->bz = g->g - 1;
    w->bias = gemm_offset(P.p.bias, (i64)w->bz * P.bias_gs, P.dt_bias);
    w->bias_s = P.p.bias_s;
    w->ma = tma_a;
    w->mb = tma_b;
    w->md = tma_d;
    unit_tile(t - g->first, (int)((g->r1 - g->r0 + BM - 1) / BM), P.tiles_n, P.swizzle, rank, w);
    w->row0 = g->r0 + (i64)w->tm * BM;
    return 1;
  }
  if (P.mode == MODE_GROUPED) {
    const i64 *first = (const i64 *)P.group_tiles;
    while (first[g->g + 1] <= t) ++g->g;
    const gemm_prob *pg = (const gemm_prob *)P.groups + g->g;
    w->grp = g->g;
    w->m = pg->m;
    w->n = pg->n;
    w->kt0 = 0;
    w->ktiles = (int)((pg->k + BK - 1) / BK);
    w->slice = -1;
    w->bias = pg->bias;
    w->bias_s = pg->bias_s;
    w->ma = gmaps + 3 * g->g;
    w->mb = w->ma + 1;
    w->md = w->ma + 2;
    unit_tile((int)(t - first[g->g]), (int)((w->m + BM - 1) / BM), (int)((w->n + BN - 1) / BN), P.swizzle, rank, w);
    w->row0 = (i64)w->tm * BM;
    return 1;
  }
  w->m = P.p.m;
  w->n = P.p.n;
  w->kt0 = 0;
  w->ktiles = (int)((P.p.k + BK - 1) / BK);
  w->slice = -1;
  if (P.mode == MODE_PARALLEL) {
    const int per = ((P.tiles_m + CM - 1) / CM) * ((P.tiles_n + CN - 1) / CN);
    w->slice = t / per;
    t -= w->slice * per;
    /* k_slice is a whole number of K tiles, and every slice starts below K. */
    const i64 k0 = (i64)w->slice * P.k_slice, k1 = k0 + P.k_slice < P.p.k ? k0 + P.k_slice : P.p.k;
    w->kt0 = (int)(k0 / BK);
    w->ktiles = (int)((k1 - k0 + BK - 1) / BK);
  } else if (P.mode == MODE_BATCHED) {
    /* Tiles numbered entry by entry; D's map is 3-D (the entry its z, as a
     * split's slice), A's and B's too unless broadcast (batch stride 0). */
    const int per = P.tiles_m * P.tiles_n, e = t / per;
    t -= e * per;
    w->slice = e;
    w->az = P.a_bs ? e : -1;
    w->bz = P.b_bs ? e : -1;
  }
  w->bias = P.p.bias;
  w->bias_s = P.p.bias_s;
  w->ma = tma_a;
  w->mb = tma_b;
  w->md = tma_d;
  if (P.sk_tiles && !sk_locate(P, w, &t)) return 0;
  unit_tile(t, P.tiles_m, P.tiles_n, P.swizzle, rank, w);
  w->row0 = (i64)w->tm * BM;
  return 1;
}

/* The box at (x, y, z) of a 3-D tensor map into dst. */
static __device__ __forceinline__ void tma_load_3d(u32 dst, const tmap_t *map, int x, int y, int z, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(dst),
      "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
}

/* Tile w's A box(es) of the K step at x into dst (no clusters): from A's
 * 3-D map at z = the entry when batched. */
static __device__ __forceinline__ void load_a(u32 dst, const sm90_tile &w, int x, u32 bar) {
#if A_MN
#pragma unroll
  for (int p = 0; p < BM / 64; p++) {
    if (w.az >= 0) tma_load_3d(dst + p * PANEL_BYTES, w.ma, (int)w.row0 + 64 * p, x, w.az, bar);
    else tma_load(dst + p * PANEL_BYTES, w.ma, (int)w.row0 + 64 * p, x, bar);
  }
#else
  if (w.az >= 0) tma_load_3d(dst, w.ma, x, (int)w.row0, w.az, bar);
  else tma_load(dst, w.ma, x, (int)w.row0, bar);
#endif
}

/* Tile w's B box of the K step at x into dst (no clusters): from B's 3-D
 * map at z = the group when grouped by offsets, the entry when batched. */
static __device__ __forceinline__ void load_b(u32 dst, const sm90_tile &w, int x, u32 bar) {
#if B_MN
#pragma unroll
  for (int p = 0; p < BN / 64; p++) {
#if GEMM_GLU
    /* The first half of the panels from G, the second from U, each at the
     * tile's TILE_N columns. */
    const tmap_t *m = p < BN / 128 ? w.mb : w.mb2;
    const int col = w.tn * TILE_N + 64 * (p % (BN / 128));
#else
    const tmap_t *m = w.mb;
    const int col = w.tn * BN + 64 * p;
#endif
    if (w.bz >= 0) tma_load_3d(dst + p * PANEL_BYTES, m, col, x, w.bz, bar);
    else tma_load(dst + p * PANEL_BYTES, m, col, x, bar);
  }
#else
  const tmap_t *m = w.mb;
#if GEMM_KCAT
  if (x >= w.kcat) {
    m = w.mb2;
    x -= (int)w.kcat;
  }
#endif
  if (w.bz >= 0) tma_load_3d(dst, m, x, w.tn * BN, w.bz, bar);
  else tma_load(dst, m, x, w.tn * BN, bar);
#endif
}

#if defined(GEMM_CONV)
#include "conv2d_sm90.cuh" /* smelt-key: if GEMM_CONV (only conv variants' cache keys hash it) */
#define PIECE_CONV_ARG , const conv9_geom &G
#define PIECE_CONV_PASS , G
#else
#define GEMM_CONV 0
#define GEMM_CONV_GATHER 0
#define GEMM_CONV_ROWMAP 0
#define GEMM_CONV_PARAM
#define PIECE_CONV_ARG
#define PIECE_CONV_PASS
#endif

#if GEMM_DGLU
/* An aux stage: consumer c's 64 x 64 boxes of h1 and h3 at c * 2 BOX. */
#define AUX_BOX (64 * 128)
static_assert(2 * CONSUMERS * AUX_BOX <= STAGE_BYTES, "an aux stage fits a ring stage");

/* Element e (0 low, 1 high) of a pair of 16-bit values in f32. */
static __device__ __forceinline__ float pair_elem(u32 v, int e, int bf) {
  const smelt_h16 h = (smelt_h16)(e ? v >> 16 : v & 0xffffu);
  return bf ? smelt_bf16_to_f32(h) : smelt_f16_to_f32(h);
}
#endif

/* piece_out's whole-unit cases for a matrix at d (rows rs elements apart,
 * columns below ncols; D's dtype) through map: the TMA store, or for a
 * piece crossing its group's end row the rows before it by the threads. */
static __device__ __forceinline__ void piece_to(const gemm_params &P, int c, int tid, const sm90_tile &w,
                                                const tmap_t *map, u64 d, i64 rs, i64 ncols, i64 x, i64 y, u32 buf) {
  if (P.mode != MODE_GROUPED_OFFS || y + 64 <= w.m) {
    piece_end(c, tid, map, (int)x, (int)y, w.slice, y < w.m, buf);
    return;
  }
  piece_end(c, tid, map, (int)x, (int)y, w.slice, 0, buf);
  const int es = gemm_esize(P.dt_d);
#pragma unroll
  for (int e = tid; e < 64 * 8; e += 128) {
    const int r = e / 8, j = e % 8;
    const i64 col = x + j * (16 / es);
    if (y + r < w.m && col < ncols) {
      const uint4 v = lds128(buf + (u32)r * 128u + ((u32)(j ^ (r % 8)) << 4));
      *(uint4 *)(d + (u64)(((y + r) * rs + col) * es)) = v;
    }
  }
}

/* Consumer c's filled piece buffer to D at column x, row y, through
 * piece_end's TMA store; except in two cases, where after piece_end's
 * barrier (which makes the buffer whole; it stores nothing then) the
 * threads copy the piece out of the buffer (its 128-byte rows swizzled as
 * piece_end's box). Grouped by offsets, a piece whose 64 rows reach past
 * its group's end row w.m (the rows after it are the next group's, or past
 * the last group's end): the rows before w.m, in 16-byte units (D's rows
 * are whole units, smelt__gemm_sm90_fast_d). And `fast` 2, D's rows not
 * whole 16-byte units (N odd, say) or not 16-byte aligned, which a TMA
 * store cannot clip: element by element, a warp storing 32 consecutive
 * elements of a row, rows and columns masked at M and N. The buffer's
 * next writer waits for these reads at its own piece's barrier, as for a
 * TMA store's. */
static __device__ __forceinline__ void piece_out(const gemm_params &P, int fast, int c, int tid, const sm90_tile &w,
                                                 i64 x, i64 y, u32 buf PIECE_CONV_ARG) {
#if GEMM_CONV_ROWMAP
  /* A strided dgrad's phase: rows scattered to dx (conv2d_sm90.cuh). */
  piece_end(c, tid, w.md, (int)x, (int)y, w.slice, 0, buf);
  conv9_piece_out(G, gemm_esize(P.dt_d), tid, w, x, y, buf);
  return;
#endif
  if (fast == 2) {
    piece_end(c, tid, w.md, (int)x, (int)y, w.slice, 0, buf);
    const int es = gemm_esize(P.dt_d), sh = es == 2 ? 6 : 5; /* elements a row: 64 or 32 */
#pragma unroll 4
    for (int e = tid; e < 64 << sh; e += 128) {
      const int r = e >> sh, j = e & ((1 << sh) - 1), b = j * es;
      if (y + r < w.m && x + j < w.n) {
        const u32 a = buf + (u32)r * 128u + ((u32)((b >> 4) ^ (r % 8)) << 4) + (u32)(b & 15);
        const u64 dst = P.p.d + (u64)(((y + r) * P.p.d_rs + x + j) * es);
        if (es == 2) *(unsigned short *)dst = lds16(a);
        else *(u32 *)dst = lds32(a);
      }
    }
    return;
  }
  piece_to(P, c, tid, w, w.md, P.p.d, P.p.d_rs, w.n, x, y, buf);
}

static __device__ __forceinline__ void prefetch_l1(const void *p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

/* Before the main loop: the L1 lines of the scales tile w's epilogue
 * (rows from m0, columns from n0) reads. */
static __device__ __forceinline__ void prefetch_scales(const gemm_params &P, const sm90_tile &w, i64 m0, i64 n0,
                                                       int tid) {
  if (P.has_sa && tid < (PINGPONG ? 128 : 64) && m0 + tid < w.m) prefetch_l1((const float *)P.p.sa + (m0 + tid) * P.p.sa_s);
  if (P.has_sb) {
    const float *sb = (const float *)P.p.sb + (w.bz >= 0 ? (i64)w.bz * P.sb_gs : 0);
    for (int c = tid; c < BN; c += 128)
      if (n0 + c < w.n) prefetch_l1(sb + (n0 + c) * P.p.sb_s);
  }
}

/* lin_piece with the row and column scales of smelt_gemm_scales, for
 * piece q of tile w whose first row is y (D's row; the tile's first column
 * n0): v = alpha_ab sa[row] sb[col] acc + bias. There is no room for a
 * second BN-float row in shared memory (the wide tile's four stages leave
 * less than 1 KiB of the 227 KiB), and registers held from piece to piece
 * spill, so both vectors are read here through L1, where prefetch_scales
 * put them before the main loop. Rows and columns past D's read 1. */
static __device__ __forceinline__ void lin_piece_sv(const gemm_params &P, const sm90_tile &w, i64 y, i64 n0,
                                                    const float *d, int q, const float *bias, int warp, int lane,
                                                    float *v) {
  const float alpha = (float)P.alpha_ab;
  const i64 r = y + 16 * warp + (lane >> 2);
  float rs0 = alpha, rs1 = alpha;
  if (P.has_sa) {
    if (r < w.m) rs0 *= __ldg((const float *)P.p.sa + r * P.p.sa_s);
    if (r + 8 < w.m) rs1 *= __ldg((const float *)P.p.sa + (r + 8) * P.p.sa_s);
  }
  const float *sb = (const float *)P.p.sb + (w.bz >= 0 ? (i64)w.bz * P.sb_gs : 0) + n0 * P.p.sb_s;
  const int cols = w.n - n0 < BN ? (int)(w.n - n0) : BN;
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const int col = PIECE * q + 8 * j + 2 * (lane & 3);
    const float2 b = *(const float2 *)&bias[col];
    float s0 = 1.f, s1 = 1.f;
    if (P.has_sb) {
      if (col < cols) s0 = __ldg(sb + col * P.p.sb_s);
      if (col + 1 < cols) s1 = __ldg(sb + (col + 1) * P.p.sb_s);
    }
    v[4 * j] = (rs0 * s0) * d[4 * j] + b.x;
    v[4 * j + 1] = (rs0 * s1) * d[4 * j + 1] + b.y;
    v[4 * j + 2] = (rs1 * s0) * d[4 * j + 2] + b.x;
    v[4 * j + 3] = (rs1 * s1) * d[4 * j + 3] + b.y;
  }
}

/* ---------------------------------------------------------------- the kernel */

#if !PINGPONG && CLUSTER == 1
/* The split tail's partial sums (sk_locate): chunk j (< sk_chunks - 1)
 * of tail tile s keeps, for consumer c, ACCS / 4 rows of 128 float4 in
 * slot (s x (sk_chunks - 1) + j) x CONSUMERS + c (thread tid's in column
 * tid, so a warp moves 512 contiguous bytes), and flag s x CONSUMERS + c
 * counts the chunks stored (zeroed by the host before each launch).
 * Returns 1 when the chunk's sums went to its slot (no epilogue), 0 for
 * the last chunk, whose d then holds the tile's whole sum. */
static __device__ __forceinline__ int sk_fixup(const gemm_params &P, const sm90_tile &w, float *d, int c, int tid) {
  const int chunk = w.sk - 1, rest = P.sk_chunks - 1;
  int *flag = (int *)P.semaphores + w.sk_slot * CONSUMERS + c;
  float4 *slots = (float4 *)P.workspace + tid;
#define SK_SLOT(j) (slots + (size_t)(((w.sk_slot * rest) + (j)) * CONSUMERS + c) * (ACCS / 4) * 128)
  if (chunk < rest) {
    float4 *slot = SK_SLOT(chunk);
#pragma unroll
    for (int i = 0; i < ACCS / 4; i++) __stcg(slot + i * 128, make_float4(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]));
    __threadfence();
    wg_sync(c);
    if (tid == 0) smelt_add_release(flag, 1);
    return 1;
  }
  if (tid == 0)
    while (smelt_ld_acquire(flag) < rest) {
    }
  wg_sync(c);
  for (int j = 0; j < rest; j++) {
    const float4 *slot = SK_SLOT(j);
#pragma unroll
    for (int i = 0; i < ACCS / 4; i++) {
      const float4 v = __ldcg(slot + i * 128);
      d[4 * i] += v.x;
      d[4 * i + 1] += v.y;
      d[4 * i + 2] += v.z;
      d[4 * i + 3] += v.w;
    }
  }
#undef SK_SLOT
  return 0;
}
#endif

#if BLOCK_SCALE
/* The block scales (mirrored by smelt__gemm_kblk in src/cuda/gemm_cuda.h):
 * sa [M, KB] and sb [NB, KB] f32, strides in elements. */
typedef struct sm90_blk {
  u64 sa, sb;
  i64 sa_rs, sa_ks, sa_bs;
  i64 sb_rs, sb_ks, sb_bs;
} sm90_blk;
static_assert(sizeof(sm90_blk) == 64, "sm90_blk must match smelt__gemm_kblk");

/* The block-scaled main loop of consumer c over tile w (its rows from m0,
 * the tile's columns from n0, its ktiles k blocks from w.kt0 on): each
 * stage is one 128-deep k block, whose wgmmas start a fresh sum in d;
 * after their wait the sum is scaled by sa[row, kb] sb[n0 / 128, kb] and
 * added into f32 registers (DeepGEMM's promotion: the tensor cores keep
 * about 14 bits of an fp8 sum, so their sums stay 128 products long and
 * the long one is f32). A thread's accumulators lie on two rows, 16 warp +
 * lane/4 and 8 below (accumulator i on the second when bit 1 of i is
 * set), so a block needs two A scales and the tile's one B scale, loaded
 * while its wgmmas run (after the first block mostly from L1: a row's
 * scales are contiguous in the quantizer's layout). Batched, both scales
 * are the entry's; grouped by offsets, A's rows are the stacked A's and
 * B's scales the group's. Rows past M (or the group's end) read the last
 * row's scales and a cluster's tile past N the last column block's (their
 * sums are zeros, or the next group's rows, and never stored). Leaves the tile's sum in d and
 * the ring's position in *stage and *phase. */
static __device__ __forceinline__ void blk_main(float *d, const sm90_blk &B, const gemm_params &P, const sm90_tile &w,
                                                int ktiles, i64 m0, i64 n0, int c, int warp, int lane, u32 base,
                                                u32 full, u32 empty, int *stage, u32 *phase) {
  const i64 e = P.mode == MODE_BATCHED ? w.slice : 0, r = m0 + 16 * warp + (lane >> 2), last = w.m - 1;
  const float *sa = (const float *)B.sa + e * B.sa_bs + (i64)w.kt0 * B.sa_ks;
  const float *sa_lo = sa + (r < last ? r : last) * B.sa_rs, *sa_hi = sa + (r + 8 < last ? r + 8 : last) * B.sa_rs;
  const i64 nb = (n0 < w.n ? n0 : w.n - 1) / 128, g = P.mode == MODE_GROUPED_OFFS ? w.bz : e;
  const float *sb = (const float *)B.sb + g * B.sb_bs + nb * B.sb_rs + (i64)w.kt0 * B.sb_ks;
  float sum[ACCS];
#pragma unroll
  for (int i = 0; i < ACCS; i++) sum[i] = 0.f;
  for (int kt = 0; kt < ktiles; kt++) {
    mbar_wait(full + 8 * *stage, *phase);
    mma_stage(d, base + *stage * STAGE_BYTES, c, 1);
    const float s_b = __ldg(sb + kt * B.sb_ks);
    const float lo = __ldg(sa_lo + kt * B.sa_ks) * s_b, hi = __ldg(sa_hi + kt * B.sa_ks) * s_b;
    WGMMA_WAIT(0);
    fence_f32(d, ACCS);
    release(empty + 8 * *stage, lane);
#pragma unroll
    for (int i = 0; i < ACCS; i++) sum[i] = fmaf(d[i], i & 2 ? hi : lo, sum[i]);
    if (++*stage == GEMM_STAGES) {
      *stage = 0;
      *phase ^= 1;
    }
  }
#pragma unroll
  for (int i = 0; i < ACCS; i++) d[i] = sum[i];
}
#endif


extern "C" __global__ void __launch_bounds__(THREADS, 1)
    gemm_sm90(const __grid_constant__ tmap_t tma_a, const __grid_constant__ tmap_t tma_b,
              const __grid_constant__ tmap_t tma_d, const gemm_params P, const int fast, const tmap_t *gmaps GEMM_CONV_PARAM
              B2_KPARAM
#if BLOCK_SCALE
              , const sm90_blk B
#endif
                  EPI_KPARAM) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  /* Stage s: A at base + s * STAGE_BYTES, B A_BYTES later, all 1024-aligned;
   * then the consumers' epilogue buffers (EPI_REGION: the general
   * epilogue's or the fast one's, in the same space) and the mbarriers. The host asks for 1024 bytes of alignment slack on
   * top (smelt__gemm_table). */
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 epi = base + GEMM_STAGES * STAGE_BYTES;
  const u32 full = epi + EPI_REGION, empty = full + GEMM_STAGES * 8;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  /* Grouped: the host puts the total unit count in tiles_m (tiles_n 1).
   * Split or batched: the units of a slice or entry times their count. */
  const int copies = P.mode == MODE_PARALLEL ? P.splits : P.mode == MODE_BATCHED ? P.count : 1;
  /* A split tail: sk_locate ends each CTA's walk. */
  const int tiles = P.sk_tiles          ? 0x7fffffff - (int)gridDim.x
                    : P.mode == MODE_GROUPED ? P.tiles_m
                                        : ((P.tiles_m + CM - 1) / CM) * ((P.tiles_n + CN - 1) / CN) * copies;
  /* The cluster walks units together: cluster c of gridDim.x / CLUSTER. */
  const u32 rank = CLUSTER > 1 ? cluster_rank() : 0;
  const int unit0 = blockIdx.x / CLUSTER, units_step = gridDim.x / CLUSTER;

  if (threadIdx.x == 0) {
    for (int s = 0; s < GEMM_STAGES; s++) {
#if GEMM_CONV_GATHER
      mbar_init(full + 8 * s, CONV_FULL_COUNT); /* expect_tx and the gathering warps */
#else
      mbar_init(full + 8 * s, 1);              /* the producer's expect_tx */
#endif
      /* One arrival per warp of the consumers that read the stage, in
       * every CTA of the cluster. */
      mbar_init(empty + 8 * s, PINGPONG ? 4 : CONSUMERS * 4 * CLUSTER);
    }
    fence_mbar_init();
  }
#if CLUSTER > 1
  cluster_sync(); /* the peers' barriers are initialized before any multicast or remote arrival */
#else
  __syncthreads();
#endif

  if (wg == 0) {
#if GEMM_CONV_GATHER
    /* Every producer thread gathers (conv2d_sm90.cuh); the 128-row tiles'
     * consumers need no registers moved to them. */
    conv9_produce(P, G, &tma_a, &tma_b, &tma_d, base, full, empty, unit0, units_step, tiles, tid);
    return;
#endif
#if CONSUMERS > 1
    SETMAXNREG_DEC(40);
#endif
    if (tid != 0) return;
    int stage = 0;
    sm90_cursor g = {0};
    u32 phase = 0;
    for (int t = unit0; t < tiles; t += units_step) {
      sm90_tile w;
      if (!sm90_locate(P, &tma_a, &tma_b, &tma_d, gmaps, t, &g, rank, &w)) break;
#if GEMM_GLU || GEMM_KCAT
      w.mb2 = &tma_b2;
      w.kcat = X.kcat;
#endif
      for (int kt = 0; kt < w.ktiles; kt++) {
        /* A fresh barrier counts as having completed the phase before phase
         * 0, so the first pass over the ring does not wait. */
        mbar_wait(empty + 8 * stage, phase ^ 1);
        const u32 bar = full + 8 * stage, sa = base + stage * STAGE_BYTES;
        const int x = (w.kt0 + kt) * BK;
        mbar_expect_tx(bar, STAGE_BYTES);
#if GEMM_CONV
        /* Conv2d: TMA's im2col and tiled loads (conv2d_sm90.cuh). */
        conv9_load(sa, G, w, w.kt0 + kt, bar);
#elif CM > 1
        /* B is shared: this CTA's 1/CM of its rows, to every CTA. */
        tma_load(sa, w.ma, x, w.tm * BM, bar);
        tma_load_mc(sa + A_BYTES + rank * (B_BYTES / CM), w.mb, x, w.tn * BN + (int)rank * (BN / CM), bar,
                    (1u << CLUSTER) - 1);
#elif CN > 1
        /* A is shared: this CTA's 1/CN of its rows, to every CTA. */
        tma_load_mc(sa + rank * (A_BYTES / CN), w.ma, x, w.tm * BM + (int)rank * (BM / CN), bar, (1u << CLUSTER) - 1);
        tma_load(sa + A_BYTES, w.mb, x, w.tn * BN, bar);
#else
        /* MN-major: one box per 64-column panel, (M or N, K) coordinates. */
        load_a(sa, w, x, bar);
        load_b(sa + A_BYTES, w, x, bar);
#endif
        if (++stage == GEMM_STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
#if GEMM_DGLU
      /* The epilogue's h1 and h3, a stage for each 64-column piece inside
       * N (rows past T load zeros; past the group's end, rows never stored). */
      for (int p = 0; p < BN / 64 && w.tn * TILE_N + 64 * p < w.n; p++) {
        mbar_wait(empty + 8 * stage, phase ^ 1);
        const u32 bar = full + 8 * stage, sa = base + stage * STAGE_BYTES;
        mbar_expect_tx(bar, 2 * CONSUMERS * AUX_BOX);
#pragma unroll
        for (int q = 0; q < 2 * CONSUMERS; q++)
          tma_load(sa + q * AUX_BOX, &tma_b2, (int)((q & 1) * X.keep_up + w.tn * TILE_N + 64 * p),
                   (int)(w.row0 + 64 * (q >> 1)), bar);
        if (++stage == GEMM_STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
#endif
    }
#if CLUSTER > 1
    /* No exit while a peer may still arrive on this CTA's barriers: wait
     * until the consumers of every CTA have released each stage's last
     * fill (the peers' multicasts into our stages are all awaited by our
     * own consumers). A stage never filled passes at once. */
    for (int s = 0; s < GEMM_STAGES; s++) {
      mbar_wait(empty + 8 * stage, phase ^ 1);
      if (++stage == GEMM_STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
#endif
    return;
  }

#if CONSUMERS > 1 && !GEMM_CONV_GATHER
  SETMAXNREG_INC(232);
#endif
  const int c = wg - 1, warp = tid / 32, lane = tid % 32;
  int stage = 0;
  sm90_cursor g = {0};
  u32 phase = 0, pieces = 0; /* pieces: the fast epilogue's stores so far */
  float d[ACCS];
  for (int t = unit0, j = 0; t < tiles; t += units_step, j++) {
    sm90_tile w;
    if (!sm90_locate(P, &tma_a, &tma_b, &tma_d, gmaps, t, &g, rank, &w)) break;
#if PINGPONG
    /* The consumers take this CTA's tiles in turn; the producer loads them
     * all in order, so the other consumer's tile is its ktiles stages of
     * the ring to step over. */
    if ((j & 1) != c) {
      const int s = stage + w.ktiles;
      phase ^= (u32)((s / GEMM_STAGES) & 1);
      stage = s % GEMM_STAGES;
      continue;
    }
#endif
    const int tn = w.tn, ktiles = w.ktiles;
    const i64 m0 = w.row0 + (PINGPONG ? 0 : c * 64), n0 = (i64)tn * TILE_N;
    /* The fast epilogue's bias, columns tid and tid + 128 of the tile,
     * loaded now so that the load's latency hides behind the main loop. */
    float bias_lo = 0.f, bias_hi = 0.f;
    if ((PINGPONG || fast) && P.has_bias && (PINGPONG || c == 0)) {
      if (tid < BN && n0 + tid < w.n) bias_lo = gemm_load_epi((const void *)w.bias, P.dt_bias, (n0 + tid) * w.bias_s);
      if (tid + 128 < BN && n0 + tid + 128 < w.n)
        bias_hi = gemm_load_epi((const void *)w.bias, P.dt_bias, (n0 + tid + 128) * w.bias_s);
    }
    if ((PINGPONG || fast) && (P.has_sa | P.has_sb)) prefetch_scales(P, w, m0, n0, tid);
#if PINGPONG
    if (j > 0) pp_wait(c);
#endif
#if BLOCK_SCALE
    blk_main(d, B, P, w, ktiles, m0, n0, c, warp, lane, base, full, empty, &stage, &phase);
#else
    /* K step 0 (peeled, so the first wgmma, which overwrites d, has a call
     * site of its own and d is never merged from two definitions). */
    mbar_wait(full + 8 * stage, phase);
    mma_stage(d, base + stage * STAGE_BYTES, c, 1);
    int prev = stage;
    if (++stage == GEMM_STAGES) {
      stage = 0;
      phase ^= 1;
    }
#if PROMOTE
    float sum[ACCS];
#pragma unroll
    for (int i = 0; i < ACCS; i++) sum[i] = 0.f;
#endif
    for (int kt = 1; kt < ktiles; kt++) {
      mbar_wait(full + 8 * stage, phase);
#if PROMOTE
      if (kt % PROMOTE == 0) {
        /* The last P stages' sum into f32 registers, then a fresh one
         * (a call site of its own, as K step 0's). */
        WGMMA_WAIT(0);
        fence_f32(d, ACCS);
        release(empty + 8 * prev, lane);
#pragma unroll
        for (int i = 0; i < ACCS; i++) sum[i] += d[i];
        mma_stage(d, base + stage * STAGE_BYTES, c, 1);
        prev = stage;
        if (++stage == GEMM_STAGES) {
          stage = 0;
          phase ^= 1;
        }
        continue;
      }
#endif
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
#if PINGPONG
    /* The other consumer's next tile (if there is one) may start: this
     * tile's stage waits are all behind. */
    if (t + units_step < tiles) pp_pass(c);
#endif
    WGMMA_WAIT(0);
    release(empty + 8 * prev, lane);
#if PROMOTE
    fence_f32(d, ACCS);
#pragma unroll
    for (int i = 0; i < ACCS; i++) d[i] += sum[i];
#endif
#endif
#if !PINGPONG && CLUSTER == 1
    if (w.sk && sk_fixup(P, w, d, c, tid)) continue;
#endif
    if (PINGPONG || fast) {
      /* The bias row is free once every thread that reads it has finished
       * the previous tile's pieces: this warpgroup's (ping-pong) or both
       * consumers' (cooperative; the first pair barrier). A skipped last
       * piece may still read it, but its values are dropped. */
      float *bias = (float *)(smem_raw + (epi + CONSUMERS * 2 * BUF_BYTES - smem_u32(smem_raw))) + (PINGPONG ? c * BN : 0);
#if PINGPONG
      if (tid < BN) bias[tid] = bias_lo;
      if (tid + 128 < BN) bias[tid + 128] = bias_hi;
      wg_sync(c);
#else
      pair_sync();
      if (c == 0) {
        if (tid < BN) bias[tid] = bias_lo;
        if (tid + 128 < BN) bias[tid + 128] = bias_hi;
      }
      pair_sync();
#endif
#if GEMM_DGLU
      {
        /* Piece p (columns x = n0 + 64p): accumulator i of the piece is
         * row 16 warp + lane/4 + 8 ((i/2) % 2) of this consumer's 64,
         * column 8 (i/4) + 2 (lane%4) + i%2 of the piece; h1 and h3 come in
         * pairs of columns from the piece's aux stage (the boxes' 128-byte
         * rows swizzled as TMA wrote them), which is released at once. */
        const float alpha = (float)P.alpha_ab;
        const int bf = P.dt_d == DT_BF16;
#pragma unroll
        for (int p = 0; p < BN / 64; p++) {
          const i64 x = n0 + 64 * p;
          if (x >= w.n) continue; /* uniform; the producer loaded no stage */
          mbar_wait(full + 8 * stage, phase);
          const u32 box = base + stage * STAGE_BYTES + (u32)(2 * c) * AUX_BOX;
          u32 hv[16], uv[16];
#pragma unroll
          for (int k = 0; k < 16; k++) {
            const u32 r = 16 * warp + (lane >> 2) + 8 * (k % 2), b = 16 * (k / 2) + 4 * (lane & 3);
            const u32 at = box + r * 128u + (((b >> 4) ^ (r % 8)) << 4) + (b & 15);
            hv[k] = lds32(at);
            uv[k] = lds32(at + AUX_BOX);
          }
          release(empty + 8 * stage, lane);
          if (++stage == GEMM_STAGES) {
            stage = 0;
            phase ^= 1;
          }
          float g1[32], g3[32], a[32];
#pragma unroll
          for (int i = 0; i < 32; i++) {
            const int k = 2 * (i / 4) + (i / 2) % 2;
            const float h = pair_elem(hv[k], i % 2, bf), u = pair_elem(uv[k], i % 2, bf), g = alpha * d[32 * p + i];
            const float sg = smelt_fast_div(1.f, 1.f + smelt_fast_exp(-h)), silu = h * sg;
            g1[i] = g * u * sg * (1.f + h * (1.f - sg));
            g3[i] = g * silu;
            a[i] = silu * u;
          }
          u32 buf = NEXT_BUF(c);
          put_piece16(buf, g1, bf, warp, lane);
          piece_to(P, c, tid, w, &tma_k, X.keep, X.keep_rs, w.n, x, m0, buf);
          buf = NEXT_BUF(c);
          put_piece16(buf, g3, bf, warp, lane);
          piece_to(P, c, tid, w, &tma_k, X.keep, X.keep_rs, X.keep_up + w.n, X.keep_up + x, m0, buf);
          buf = NEXT_BUF(c);
          put_piece16(buf, a, bf, warp, lane);
          piece_out(P, fast, c, tid, w, x, m0, buf PIECE_CONV_PASS);
        }
        continue;
      }
#endif
#if GEMM_GLU
      {
        /* Piece p of d is tile columns 64p .. 64p + 63: G's columns n0 +
         * 64p for p < 2, U's n0 + 64 (p - 2) after. The pieces go out as
         * the 16-bit loop's below: g and u to keep (when asked), then
         * silu(g)·u to D, which stays in f32 until its rounding. */
        const float alpha = (float)P.alpha_ab;
        const int bf = P.dt_d == DT_BF16;
        if (X.keep) {
#pragma unroll
          for (int p = 0; p < 4; p++) {
            const i64 x = n0 + 64 * (p % 2), up = p >= 2 ? X.keep_up : 0;
            if (x >= w.n) continue; /* uniform */
            float v[32];
#pragma unroll
            for (int i = 0; i < 32; i++) v[i] = alpha * d[32 * p + i];
            const u32 buf = NEXT_BUF(c);
            put_piece16(buf, v, bf, warp, lane);
            piece_to(P, c, tid, w, &tma_k, X.keep, X.keep_rs, up + w.n, up + x, m0, buf);
          }
        }
#pragma unroll
        for (int q = 0; q < 2; q++) {
          const i64 x = n0 + 64 * q;
          if (x >= w.n) continue; /* uniform */
          float v[32];
#pragma unroll
          for (int i = 0; i < 32; i++) {
            const float gv = alpha * d[32 * q + i], uv = alpha * d[32 * (q + 2) + i];
            v[i] = act16(gv, ACT_SILU) * uv;
          }
          const u32 buf = NEXT_BUF(c);
          put_piece16(buf, v, bf, warp, lane);
          piece_out(P, fast, c, tid, w, x, m0, buf PIECE_CONV_PASS);
        }
        continue;
      }
#endif
      if (P.dt_d != DT_F32 && P.scale_d == 1.f && !P.clamp &&
          (P.act == ACT_IDENTITY || P.act == ACT_GELU || P.act == ACT_SILU)) {
        /* The linear combination (+ bias, + GELU or SiLU, the transformer
         * activations) into 16-bit D, the common cases: unrolled over the
         * pieces, so each reads its accumulators in place (no moves; ~50
         * instructions a thread without an activation). The tensor cores
         * idle while both cooperative consumers are here. Other epilogues
         * take the rolled loop below, which keeps the compile short. */
        const float alpha = (float)P.alpha_ab;
#pragma unroll
        for (int p = 0; p < ACCS / 32; p++) {
          const int q = p % (BN / PIECE);
          const i64 x = n0 + q * PIECE, y = m0 + 64 * (p / (BN / PIECE));
          if (x >= w.n) continue; /* uniform: the piece is past N */
          const u32 buf = NEXT_BUF(c);
          float v[32];
          if (P.has_sa | P.has_sb) lin_piece_sv(P, w, y, n0, d + 32 * p, q, bias, warp, lane, v);
          else lin_piece(alpha, d + 32 * p, q, bias, lane, v);
          if (P.act == ACT_GELU) act_piece16_n(v, ACT_GELU);
          else if (P.act == ACT_SILU) act_piece16_n(v, ACT_SILU);
          put_piece16(buf, v, P.dt_d == DT_BF16, warp, lane);
          piece_out(P, fast, c, tid, w, x, y, buf PIECE_CONV_PASS);
        }
        continue;
      }
      /* Otherwise a rolled loop (the epilogue's code exists once, which
       * keeps the compile short): each pass takes d[0 .. 31] and moves the next
       * piece's accumulators down; d is dead after the epilogue. Piece p
       * is rows 64 (p / (BN / 64)) and columns 64 (p % (BN / 64)) of this
       * consumer's accumulators (one row of pieces when cooperative, two
       * when ping-pong: the m64 halves of d). */
#pragma unroll 1
      for (int p = 0; p < ACCS / 32; p++) {
        const int q = p % (BN / PIECE);
        const i64 x = n0 + q * PIECE, y = m0 + 64 * (p / (BN / PIECE));
        /* The math overlaps the previous piece's store. */
        float v[32];
        if (P.has_sa | P.has_sb) {
          lin_piece_sv(P, w, y, n0, d, q, bias, warp, lane, v);
          act_scale_piece(P, v);
        } else {
          fast_piece(P, d, q, bias, lane, v);
        }
#pragma unroll
        for (int i = 0; i + 32 < ACCS; i++) d[i] = d[i + 32];
        if (x >= w.n) continue; /* uniform: the piece is past N */
        if (P.dt_d != DT_F32) {
          const u32 buf = NEXT_BUF(c);
          put_piece16(buf, v, P.dt_d == DT_BF16, warp, lane);
          piece_out(P, fast, c, tid, w, x, y, buf PIECE_CONV_PASS);
        } else {
#pragma unroll
          for (int half = 0; half < 2; half++) {
            if (x + 32 * half >= w.n) break; /* uniform */
            const u32 buf = NEXT_BUF(c);
            put_half32(buf, v, half, warp, lane);
            piece_out(P, fast, c, tid, w, x + 32 * half, y, buf PIECE_CONV_PASS);
          }
        }
      }
      continue;
    }
#if !PINGPONG
    /* The general epilogue (plain mode only: grouped runs take the fast one).
     * Accumulator i holds row 16 warp + lane/4 + 8 ((i/2) % 2) of this
     * consumer's 64 rows and column 8 (i/4) + 2 (lane%4) + i%2 of the tile;
     * EPI_COLS columns at a time go through the buffer, in a rolled loop
     * (as the fast epilogue's: each pass takes d[0 .. EPI_COLS/2 - 1] and
     * moves the rest down) so that the long general code exists once. */
    float *buf = (float *)(smem_raw + (epi - smem_u32(smem_raw))) + c * (EPI_BYTES / 4);
    const int rows = P.p.m - m0 < 64 ? (int)(P.p.m - m0) : 64;
#pragma unroll 1
    for (int q = 0; q < BN / EPI_COLS; q++) {
      if (n0 + q * EPI_COLS >= P.p.n) break; /* uniform: the rest of the tile is past N */
#pragma unroll
      for (int j = 0; j < EPI_COLS / 8; j++) {
        const int i = 4 * j, row = warp * 16 + (lane >> 2), col = 8 * j + 2 * (lane & 3);
        float2 lo, hi;
        lo.x = d[i];
        lo.y = d[i + 1];
        hi.x = d[i + 2];
        hi.y = d[i + 3];
        *(float2 *)&buf[row * EPI_LD + col] = lo;
        *(float2 *)&buf[(row + 8) * EPI_LD + col] = hi;
      }
#pragma unroll
      for (int i = 0; i + EPI_COLS / 2 < BN / 2; i++) d[i] = d[i + EPI_COLS / 2];
      wg_sync(c);
      const int cols = P.p.n - (n0 + q * EPI_COLS) < EPI_COLS ? (int)(P.p.n - (n0 + q * EPI_COLS)) : EPI_COLS;
#if defined(SMELT_EPI_GRAPH)
      /* An epilogue graph (kernels/gemm_epi_graph.cuh): the host sends
       * every graph here (smelt__gemm_sm90_fast_d is 0 for it). */
      gemm_graph_chunk(P, E, buf, EPI_LD, m0, n0 + q * EPI_COLS, rows, cols, tid);
#else
      /* Column pairs: a warp stores two rows of EPI_COLS columns. */
#pragma unroll 1
      for (int e = tid; e < 64 * (EPI_COLS / 2); e += 128) {
        const int r = e / (EPI_COLS / 2), cc = 2 * (e % (EPI_COLS / 2));
        if (r < rows && cc < cols)
          store_pair(P, m0 + r, n0 + q * EPI_COLS + cc, buf[r * EPI_LD + cc], buf[r * EPI_LD + cc + 1]);
      }
#endif
      wg_sync(c);
    }
#endif
  }
  /* The last TMA stores read shared memory until they complete. */
  if ((PINGPONG || fast) && tid == 0) bulk_wait();
#else
  /* wgmma and setmaxnreg exist on sm_90a only. The variant list is compiled
   * for every arch, so elsewhere the kernel is a stub the selector never
   * picks (it offers this kernel on cc 9.0 only). */
  __trap();
#endif
}
