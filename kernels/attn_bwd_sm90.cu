/* Hopper (sm_90a) FlashAttention backward, in the manner of FlashAttention-3:
 * TMA loads on mbarriers, wgmma for all five GEMMs, warp specialization.
 *
 * Prelude: SMELT_DT (2 f16, 3 bf16); ATTN_D (128); ATTN_DQ_TMA (0 or 1);
 * ATTN_STAGES (2 or 3); ATTN_SPREAD (0 or 1: the query tile order, below);
 * the score modifiers' (attn_common.cuh), as in attn_bwd_sm80.cu: Sᵀ and
 * dPᵀ are modified together (attn_mod_tile_bwd), so with a modifier Pᵀ
 * waits for dPᵀ instead of overlapping it.
 *
 * One CTA per (tile of 128 keys, kv head, sequence), like attn_bwd_sm80.cu,
 * looping over every (query head of the kv head's group, tile of 64
 * queries) that sees one of its keys (with ATTN_SPREAD from a query tile
 * that depends on the key tile: next_step below); dK and dV stay in registers over the
 * whole loop (the GQA sum included) and are written once. Three warpgroups:
 *   producer (warpgroup 0, warp 0; 24 registers): TMA loads of K and V
 *     once, then per step of Q and dO into a ring of STAGES stages, each
 *     completing on its "full" mbarrier; the warp's lanes copy the step's
 *     LSE·log2 e and rowsum(dO ∘ O) (attn_bwd_pre) into the stage with
 *     plain loads and arrive on the same barrier (these rows are not
 *     16-byte aligned in varlen batches, which TMA would need). A stage is
 *     refilled once both consumers have released it ("empty").
 *   consumers (warpgroups 1 and 2, 240 registers): consumer c owns keys
 *     64 c .. 64 c + 63 and works in the transposed frame, keys as rows, so
 *     that Pᵀ and dSᵀ come out of wgmma in the register A layout that the
 *     dV and dK GEMMs take:
 *       Sᵀ  = K Qᵀ, dPᵀ = V dOᵀ      m64n64, both operands K-major in smem
 *       Pᵀ  = 2^(Sᵀ·scale·log2 e - LSE·log2 e), 0 where masked
 *       dSᵀ = Pᵀ ∘ (dPᵀ - rowsum(dO ∘ O))
 *       dV += Pᵀ dO, dK += dSᵀ Q     m64nD, A in registers, B (d
 *                                    contiguous) MN-major from smem
 *       dQ  = dS K                   dSᵀ of both consumers through smem
 *                                    (after a named barrier); consumer c
 *                                    takes d columns D/2 c .., A and B both
 *                                    MN-major; m64n(D/2)
 *     and adds dQ (before the scale) to dq_acc: with red.global.add.v2.f32,
 *     or (ATTN_DQ_TMA 1) through a 128-byte-swizzled f32 tile in shared
 *     memory and one TMA reduce-add (cp.reduce.async.bulk.tensor) per 32
 *     columns, issued by the warpgroup's first thread; rows past the
 *     sequence add zeros (their dS is 0) or are clipped at rows_q. The host
 *     picks (BWD90_DQ_TMA in src/cuda/op_attention.c): TMA, 1.1x faster on
 *     the H100 (docs/PERF.md).
 *     Issue order per step: Sᵀ and dPᵀ; dV (so that the tensor cores work
 *     while dSᵀ is stored and the consumers meet); dQ, then dK (which runs
 *     while dQ is added). dSᵀ alternates between two buffers, so one
 *     barrier per step is enough: a consumer overwrites a buffer only after
 *     the barrier of the step after, by which the other has finished
 *     reading it.
 * attn_bwd_dq (kernels/attn_bwd_aux.cu) scales dq_acc into dq.
 *
 * Masks and ragged ends as in attn_bwd_sm80.cu: a thread's two keys see the
 * queries [qlo, qhi] (attn_key_range inverted); a step cut by no mask
 * skips the test. Rows past a tensor's end arrive as zeros, rows of the
 * next varlen sequence are masked; their LSE is +inf and their rowsum 0.
 *
 * Shared memory (TMA's 128-byte swizzle, 64-column panels of D one after
 * the other, as in attn_fwd_sm90.cu): K, V (128 rows), STAGES x Q and dO
 * (64 rows), 2 x dSᵀ (128 key rows of 64 queries, the same swizzle),
 * STAGES x LSE and rowsum (64 f32 each), the mbarriers.
 */
#include "attn_common.cuh"

#if !defined(ATTN_D) || ATTN_D != 128 || !defined(ATTN_DQ_TMA) || !defined(ATTN_STAGES) || !defined(ATTN_SPREAD)
#error "attn_bwd_sm90.cu needs ATTN_D 128, ATTN_DQ_TMA, ATTN_STAGES and ATTN_SPREAD"
#endif

#define D ATTN_D
#define BN 128 /* keys per CTA */
#define BM 64  /* queries per step */
#define PANELS (D / 64)
#define CONSUMERS 2
#define THREADS (128 * (CONSUMERS + 1))
#define STAGES ATTN_STAGES
#define KV_BYTES (BN * D * 2)
#define QD_BYTES (BM * D * 2)
#define DS_BYTES (BN * BM * 2)
#define NQ (BM / 8)  /* n8 column groups of Sᵀ (queries) */
#define NO (D / 8)   /* of dK, dV */
#define NDQ (D / 16) /* of a consumer's half of dQ */

#define S_K 0
#define S_V (S_K + KV_BYTES)
#define S_Q (S_V + KV_BYTES)
#define S_DO (S_Q + STAGES * QD_BYTES)
#define S_DS (S_DO + STAGES * QD_BYTES)
#if ATTN_DQ_TMA
#define DQ_BYTES (BM * (D / 2) * 4) /* a consumer's dQ, f32 */
#define S_DQ (S_DS + 2 * DS_BYTES)
#define S_LSE (S_DQ + CONSUMERS * DQ_BYTES)
#else
#define S_LSE (S_DS + 2 * DS_BYTES)
#endif
#define S_DSUM (S_LSE + STAGES * BM * 4)
#define S_BAR (S_DSUM + STAGES * BM * 4)


/* ---------------------------------------------------------------- wgmma */

/* d (64 x 64) = / += A B from shared memory (acc 0: =). kk: both operands
 * K-major; tt: both MN-major (transposed). */
#define WGMMA_SS(trans)                                                                                                \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"                                                              \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." ATTN_DT_PTX "." ATTN_DT_PTX " {" WG_REGS32                \
               "}, %32, %33, p, 1, 1, " trans "; }\n"                                                                  \
               : WG_D32(WG_RW)                                                                                         \
               : "l"(da), "l"(db), "r"(acc))
static __device__ __forceinline__ void wgmma_ss_kk(float *d, u64 da, u64 db, int acc) { WGMMA_SS("0, 0"); }
static __device__ __forceinline__ void wgmma_ss_tt(float *d, u64 da, u64 db, int acc) { WGMMA_SS("1, 1"); }

/* MN-major, 128-byte swizzle: 8-row atoms along K 1024 bytes apart (SBO),
 * 64-column panels along M or N lbo bytes apart. */
static __device__ __forceinline__ u64 desc_mn(u32 addr, u32 lbo) {
  return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

#if !ATTN_DQ_TMA
static __device__ __forceinline__ void red_add2(float *p, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}
#endif

/* Sᵀ or dPᵀ (64 keys x BM queries) = A Bᵀ, both K-major: A's 64 rows at a
 * (K's or V's rows of this consumer, panels BN x 128 bytes apart), B's BM
 * rows at b (Q or dO of a stage, panels BM x 128 bytes apart). */
static __device__ __forceinline__ void gemm_s(float *d, u32 a, u32 b) {
#pragma unroll
  for (int p = 0; p < PANELS; p++)
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
      wgmma_ss_kk(d, wgmma_desc_kmajor(a + p * (BN * 128) + kk * 32), wgmma_desc_kmajor(b + p * (BM * 128) + kk * 32), p + kk);
}

/* Whether query tile m (rows m BM .. of sq) sees key tile nt. */
static __device__ __forceinline__ bool tile_sees(const attn_params &P, const attn_seq &s, int m, int nt) {
  const int r0 = m * BM, r1 = (r0 + BM < s.sq ? r0 + BM : s.sq) - 1;
  int a, z;
  attn_key_tiles(P, s.sq, s.sk, r0, r1, BN, &a, &z);
  return nt >= a && nt < z;
}

/* The query tiles that see key tile nt (for every head of the group):
 * [*m_lo, *m_hi]. They are contiguous: a tile's first key tile grows with
 * it, and so does its last once its range is non-empty (only the first
 * rows have empty ranges). Candidates as in attn_bwd_sm80.cu, widened by a
 * tile each way; the ends are found by testing exactly with
 * attn_key_tiles from each end of the candidates inwards (a few tests,
 * where testing every candidate took thousands of instructions per thread
 * at 16k queries, before the first load). */
static __device__ __forceinline__ void query_tiles(const attn_params &P, const attn_seq &s, int nt, int *m_lo,
                                                   int *m_hi) {
  const i64 off = (i64)s.sk - s.sq, n0 = (i64)nt * BN;
  i64 i_min = P.wr < 0 ? 0 : n0 - off - P.wr, i_max = P.wl < 0 ? s.sq - 1 : n0 + BN - 1 - off + P.wl;
  i_min = i_min < 0 ? 0 : i_min;
  i_max = i_max > s.sq - 1 ? s.sq - 1 : i_max;
  const int m_tiles = (s.sq + BM - 1) / BM;
  int m_first = (int)(i_min / BM) - 1, m_last = i_max < 0 ? -1 : (int)(i_max / BM) + 1;
  m_first = m_first < 0 ? 0 : m_first;
  m_last = m_last > m_tiles - 1 ? m_tiles - 1 : m_last;
  if (i_min > i_max) m_last = -1;
  int m = m_first;
  while (m <= m_last && !tile_sees(P, s, m, nt)) m++;
  int z = m_last;
  while (z > m && !tile_sees(P, s, z, nt)) z--;
  *m_lo = m <= m_last ? m : 0;
  *m_hi = m <= m_last ? z : -1;
}

/* The step after (query tile m_lo + j, head h): tiles from rot up to the
 * last, then from the first, then the next head. With ATTN_SPREAD, rot
 * spreads over the key tiles of the grid, so that the key tiles of a head,
 * which run at the same time, add their dQ into different query tiles of
 * dq_acc instead of all into the same one; without it rot is 0. Counters,
 * not i / nm and i % nm: no divisions per step. */
static __device__ __forceinline__ void next_step(int *j, int *h, int nm, int rot) {
  *j = *j + 1 == nm ? 0 : *j + 1;
  *h += *j == rot;
}

/* ---------------------------------------------------------------- the kernel */

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    attn_bwd_sm90(const __grid_constant__ tmap_t tq, const __grid_constant__ tmap_t tk,
                  const __grid_constant__ tmap_t tv, const __grid_constant__ tmap_t tdo,
                  const __grid_constant__ tmap_t tdq, const attn_params P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  /* 1024-aligned for the swizzle; the host adds 1 KiB of slack. Barriers:
   * K and V full, then full and empty per stage. */
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  unsigned char *smem = smem_raw + (base - smem_u32(smem_raw));
  const u32 sK = base + S_K, sV = base + S_V, sDS = base + S_DS;
  const u32 fullKV = base + S_BAR, full = fullKV + 8, empty = full + 8 * STAGES;
  attn_seq s;
  const int b = blockIdx.z, hk = blockIdx.y, nt = blockIdx.x, n0 = nt * BN;
  attn_locate(P, b, s);
  if (n0 >= s.sk) return;
  int m_lo, m_hi;
  query_tiles(P, s, nt, &m_lo, &m_hi);
  const int nm = m_hi - m_lo + 1, steps = P.group * nm;
  const int rot = ATTN_SPREAD ? (int)((i64)nt * nm / gridDim.x) : 0; /* < nm, or 0 */

  if (threadIdx.x == 0) {
    mbar_init(fullKV, 1);
    for (int st = 0; st < STAGES; st++) {
      mbar_init(full + 8 * st, 32);              /* the producer warp's lanes */
      mbar_init(empty + 8 * st, CONSUMERS * 128); /* one arrival per consumer thread (see the release below) */
    }
    fence_mbar_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, lane = tid & 31;

  /* setmaxnreg trades within the registers the launch holds (168 per
   * thread, the cap of 384 threads): what the producer gives up must cover
   * what the consumers take, or their setmaxnreg.inc waits forever. */
  static_assert(24 * 128 + 240 * 128 * CONSUMERS <= 168 * THREADS, "setmaxnreg: over the launch's registers");
  if (wg == 0) {
    SETMAXNREG_DEC(24);
    if (tid >= 32 || steps == 0) return;
    /* Tensor coordinates: (d, row, head, batch); varlen rows are packed. */
    const int qy = P.cu_q ? (int)s.qrow : 0, ky = P.cu_q ? (int)s.krow : 0, bw = P.cu_q ? 0 : b;
    if (lane == 0) {
      mbar_expect_tx(fullKV, 2 * KV_BYTES);
#pragma unroll
      for (int p = 0; p < PANELS; p++) {
        tma_load_4d(sK + p * (BN * 128), &tk, p * 64, ky + n0, hk, bw, fullKV);
        tma_load_4d(sV + p * (BN * 128), &tv, p * 64, ky + n0, hk, bw, fullKV);
      }
    }
    for (int i = 0, j = rot, h = hk * P.group; i < steps; i++, next_step(&j, &h, nm, rot)) {
      const int st = i % STAGES, m0 = (m_lo + j) * BM;
      /* A fresh barrier counts as having completed the phase before phase
       * 0, so the first pass over the ring does not wait. */
      mbar_wait(empty + 8 * st, ((i / STAGES) & 1) ^ 1);
      const float *lse = (const float *)P.lse_ws + (i64)h * P.rows_q + s.qrow + m0;
      const float *dsum = (const float *)P.dsum_ws + (i64)h * P.rows_q + s.qrow + m0;
      float *slse = (float *)(smem + S_LSE) + st * BM, *sdsum = (float *)(smem + S_DSUM) + st * BM;
#pragma unroll
      for (int r = lane; r < BM; r += 32) {
        const bool ok = m0 + r < s.sq;
        slse[r] = ok ? lse[r] : ATTN_POS_INF;
        sdsum[r] = ok ? dsum[r] : 0.f;
      }
      if (lane == 0) {
        mbar_expect_tx(full + 8 * st, 2 * QD_BYTES);
#pragma unroll
        for (int p = 0; p < PANELS; p++) {
          tma_load_4d(base + S_Q + st * QD_BYTES + p * (BM * 128), &tq, p * 64, qy + m0, h, bw, full + 8 * st);
          tma_load_4d(base + S_DO + st * QD_BYTES + p * (BM * 128), &tdo, p * 64, qy + m0, h, bw, full + 8 * st);
        }
      } else {
        mbar_arrive(full + 8 * st);
      }
    }
    return;
  }

  SETMAXNREG_INC(240);
  const int c = wg - 1, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  float dk[NO][4], dv[NO][4];
#pragma unroll
  for (int i = 0; i < NO; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) dk[i][e] = dv[i][e] = 0.f;

  /* The queries that see this thread's keys j (rows g and g + 8 of its
   * warp's 16): [qlo, qhi], none past the last key. */
  const i64 off = (i64)s.sk - s.sq;
  int qlo[2], qhi[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const i64 j = n0 + c * 64 + warp * 16 + g + 8 * r;
    const i64 a = P.wr < 0 ? 0 : j - off - P.wr, z = P.wl < 0 ? s.sq - 1 : j - off + P.wl;
    qlo[r] = (int)attn_clamp(a, 0, s.sq);
    qhi[r] = j < s.sk ? (int)attn_clamp(z, -1, s.sq - 1) : -1;
  }

  if (steps > 0) mbar_wait(fullKV, 0);
  float sp[NQ][4], dp[NQ][4], dq[NDQ][4];
  u32 pa[BM / 16][4], da[BM / 16][4];
  /* Every wgmma group is waited for in the step that issues it: with an
   * Sᵀ issued for the next step in flight across the loop's back edge
   * (dK, dV and dQ live), ptxas serialized every wgmma of the kernel
   * (C7515; docs/PERF.md). */
#pragma unroll 1
  for (int i = 0, j = rot, h = hk * P.group; i < steps; i++, next_step(&j, &h, nm, rot)) {
    const int st = i % STAGES, m0 = (m_lo + j) * BM;
    const int r1 = (m0 + BM < s.sq ? m0 + BM : s.sq) - 1;
    const u32 sQ = base + S_Q + st * QD_BYTES, sDO = base + S_DO + st * QD_BYTES, ds = sDS + (i & 1) * DS_BYTES;
    int lo_last, hi_first, unused;
    attn_key_range(P, s.sq, s.sk, r1, &lo_last, &unused);
    attn_key_range(P, s.sq, s.sk, m0, &unused, &hi_first);
    const bool all = r1 == m0 + BM - 1 && n0 >= lo_last && n0 + BN - 1 <= hi_first;

    /* Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, this consumer's 64 keys. */
    mbar_wait(full + 8 * st, (i / STAGES) & 1);
    wgmma_fence();
    gemm_s(&sp[0][0], sK + c * (64 * 128), sQ);
    wgmma_commit();
    gemm_s(&dp[0][0], sV + c * (64 * 128), sDO);
    wgmma_commit();

    /* Pᵀ while dPᵀ is still on the tensor cores. Entry e of tile qt: key
     * row g + 8 (e / 2), query m0 + 8 qt + 2 t4 + e % 2. */
    const float *slse = (const float *)(smem + S_LSE) + st * BM, *sdsum = (const float *)(smem + S_DSUM) + st * BM;
    WGMMA_WAIT(1);
    fence_f32(&sp[0][0], NQ * 4);
#ifdef ATTN_MODS
    WGMMA_WAIT(0);
    fence_f32(&dp[0][0], NQ * 4);
    attn_mod_tile_bwd(sp, dp, NQ, (float)((i64)m0 + 2 * t4 + off - (n0 + c * 64 + warp * 16 + g)), sdsum, t4,
                      attn_mod_of(P, h));
#endif
#pragma unroll
    for (int qt = 0; qt < NQ; qt++) {
      const float2 l2 = *(const float2 *)(slse + qt * 8 + 2 * t4);
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int q = m0 + qt * 8 + 2 * t4 + (e & 1);
        const bool vis = all || (q >= qlo[e >> 1] && q <= qhi[e >> 1]);
        const float x = sp[qt][e] * P.scale_log2 - ((e & 1) ? l2.y : l2.x);
        sp[qt][e] = vis ? attn_ex2(x) : 0.f;
      }
    }
    WGMMA_WAIT(0);
    fence_f32(&dp[0][0], NQ * 4);
#pragma unroll
    for (int qt = 0; qt < NQ; qt++) {
      const float2 d2 = *(const float2 *)(sdsum + qt * 8 + 2 * t4);
#pragma unroll
      for (int e = 0; e < 4; e++) dp[qt][e] = sp[qt][e] * (dp[qt][e] - ((e & 1) ? d2.y : d2.x));
    }

    /* Pᵀ and dSᵀ rounded to the input type as A fragments (k16 steps over
     * queries); dSᵀ also to shared memory, row = key, for dQ. */
    const int krow = c * 64 + warp * 16 + g;
    attn_pack_p(sp, pa, BM / 16);
    attn_pack_p(dp, da, BM / 16);
    /* dV += Pᵀ dO goes to the tensor cores first, so that they work while
     * dSᵀ is stored and the consumers meet. B is d-contiguous, 64-column
     * panels BM x 128 bytes apart; k16 steps are 16 query rows. */
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; kk++) wgmma_rs_n128(&dv[0][0], pa[kk], desc_mn(sDO + kk * (16 * 128), BM * 128));
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < BM / 16; kk++) {
      sts32(attn_sw(ds, 128, krow, 2 * kk) + 4 * t4, da[kk][0]);
      sts32(attn_sw(ds, 128, krow + 8, 2 * kk) + 4 * t4, da[kk][1]);
      sts32(attn_sw(ds, 128, krow, 2 * kk + 1) + 4 * t4, da[kk][2]);
      sts32(attn_sw(ds, 128, krow + 8, 2 * kk + 1) + 4 * t4, da[kk][3]);
    }

    /* Both consumers' dSᵀ are in shared memory (and visible to wgmma). */
    fence_proxy_async();
#if ATTN_DQ_TMA
    if (tid == 0) bulk_wait_read();
#endif
    BAR_SYNC(1, 256);
    /* dQ (this consumer's D/2 columns) = dS K: A = dSᵀ (queries
     * contiguous), B = K's panel c (d contiguous); k16 steps are 16 keys.
     * Then dK += dSᵀ Q, which runs while dQ is added. */
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
      wgmma_ss_tt(&dq[0][0], desc_mn(ds + kk * (16 * 128), BN * 128),
                  desc_mn(sK + c * (BN * 128) + kk * (16 * 128), BN * 128), kk);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < BM / 16; kk++) wgmma_rs_n128(&dk[0][0], da[kk], desc_mn(sQ + kk * (16 * 128), BM * 128));
    wgmma_commit();
    /* dV and dQ done (groups retire in order); dK still running. */
    WGMMA_WAIT(1);
    fence_f32(&dv[0][0], NO * 4);
    fence_f32(&dq[0][0], NDQ * 4);
    fence_u32(&pa[0][0], BM / 4);

#if ATTN_DQ_TMA
    {
      const u32 sdq = base + S_DQ + c * DQ_BYTES;
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int q = warp * 16 + g + 8 * r;
#pragma unroll
        for (int j = 0; j < NDQ; j++) {
          const u32 a = sdq + (j / 4) * (BM * 128) + q * 128 + (((2 * (j % 4) + (t4 >> 1)) ^ (q & 7)) << 4) + (t4 & 1) * 8;
          sts_f32x2(a, dq[j][2 * r], dq[j][2 * r + 1]);
        }
      }
      fence_proxy_async();
      if (c == 0) BAR_SYNC(2, 128);
      else BAR_SYNC(3, 128);
      if (tid == 0) {
#pragma unroll
        for (int bx = 0; bx < D / 64; bx++)
          tma_add_3d(&tdq, c * (D / 2) + bx * 32, h, (int)(s.qrow + m0), sdq + bx * (BM * 128));
        bulk_commit();
      }
    }
#else
    float *acc = (float *)P.dq_acc + ((s.qrow + m0) * P.H + h) * (i64)D + c * (D / 2) + 2 * t4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int q = warp * 16 + g + 8 * r;
      if (m0 + q <= r1)
#pragma unroll
        for (int j = 0; j < NDQ; j++) red_add2(acc + (i64)q * P.H * D + j * 8, dq[j][2 * r], dq[j][2 * r + 1]);
    }
#endif
    /* dK done: this thread is done with the stage and the A fragments. Its
     * own arrive orders its reads of the stage's LSE and D rows before the
     * producer's next stores there (one arrive a warp after __syncwarp
     * orders them as well, but compute-sanitizer's racecheck reports that
     * as a WAR hazard). */
    WGMMA_WAIT(0);
    fence_f32(&dk[0][0], NO * 4);
    fence_u32(&da[0][0], BM / 4);
    mbar_arrive(empty + 8 * st);
  }
#if ATTN_DQ_TMA
  if (tid == 0) bulk_wait();
#endif

  /* dK · scale and dV, column pairs, keys of this sequence only. */
  elem_t *dK = (elem_t *)P.dk.p + attn_base(P, P.dk, b, s.krow, hk);
  elem_t *dV = (elem_t *)P.dv.p + attn_base(P, P.dv, b, s.krow, hk);
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int j = n0 + c * 64 + warp * 16 + g + 8 * r;
    if (j < s.sk)
#pragma unroll
      for (int i = 0; i < NO; i++) {
        *(u32 *)(dK + (i64)j * P.dk.rs + i * 8 + 2 * t4) = ATTN_PACK(dk[i][2 * r] * P.scale, dk[i][2 * r + 1] * P.scale);
        *(u32 *)(dV + (i64)j * P.dv.rs + i * 8 + 2 * t4) = ATTN_PACK(dv[i][2 * r], dv[i][2 * r + 1]);
      }
  }
#else
  /* wgmma, TMA and setmaxnreg exist on sm_90a only. The variant list is
   * compiled for every arch, so elsewhere the kernel is a stub the
   * selector never picks (it offers this kernel on cc 9.0 only). */
  __trap();
#endif
}
