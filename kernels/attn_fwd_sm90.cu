/* Hopper (sm_90a) FlashAttention forward: TMA loads on mbarriers, wgmma for
 * both GEMMs, warp specialization.
 *
 * Prelude: SMELT_DT (2 f16, 3 bf16); ATTN_D (64 or 128); ATTN_BN, keys
 * per tile (128); ATTN_CONS, consumer warpgroups (2 or 3); ATTN_STAGES,
 * the K/V ring's depth (2..4); ATTN_PERSISTENT, the schedule (0, 1 or
 * 2, below); the score modifiers' (attn_common.cuh), applied to each tile
 * of S before its softmax as in attn_fwd_sm80.cu. docs/PERF.md has the
 * sweep over these (and over BN 176/192 and an FMA-pipe exp2, both
 * dropped).
 *
 * Schedule: with ATTN_PERSISTENT 0, one CTA per (tile of 64 · ATTN_CONS
 * queries, head, sequence). With 1 or 2, one CTA per SM walks a list of
 * those tiles. 1, static: schedule() (longest first under a causal mask,
 * a head's tiles together otherwise), each CTA taking places of the list
 * in a stride of the grid, back and forth. 2, dynamic: tile_of() (under a
 * causal mask, groups of a few heads, longest first within each; a head's
 * tiles together otherwise), each CTA taking the next tile from a global
 * counter (P.sem, zeroed before every launch): the producer fetches it and
 * hands it to the consumers through a ring of two tile numbers in shared
 * memory. Each CTA has ATTN_CONS + 1 warpgroups:
 *   producer (warpgroup 0, one thread): TMA loads of the Q tile once, then
 *     of K and V tiles into a ring of ATTN_STAGES stages, each tile
 *     completing on its own "full" mbarrier with its byte count; a stage is
 *     refilled once every consumer has released it ("empty"). Three stages
 *     (224 KiB with Q at D 128, BN 128) keep a whole key tile of slack: the
 *     tile after next loads while the consumers work;
 *   consumers (warpgroups 1..ATTN_CONS): each owns 64 query rows. Per key
 *     tile: S = Q Kᵀ with wgmma m64nBNk16, A (Q) and B (K) read from shared
 *     memory; the online softmax of attn_common.cuh on the accumulators
 *     (the mma.sync fragment layout: rows 16 warp + lane/4 (+8), columns
 *     8 i + 2 (lane % 4)); P rounded to the input type in registers and
 *     O += P V with wgmma m64nDk16 taking P as the register A operand and V
 *     (d-contiguous, so "MN-major", transposed) from shared memory.
 *   intra-warpgroup pipelining (FlashAttention-3 §3.2): S of tile i and
 *     P V of tile i - 1 are issued together; the softmax of S_i runs while
 *     P_{i-1} V_{i-1} is still on the tensor cores, and only O's rescale
 *     and the packing of P_i wait for it. O, S and P are live at once.
 *   ping-pong: the consumers take turns, in a ring, issuing those pairs of
 *     GEMMs (one named barrier per consumer, "consumer c may issue"), so
 *     the tensor cores work on one warpgroup's two GEMMs while the others
 *     compute exponentials.
 * setmaxnreg moves registers from the producer to the consumers (FA3's
 * split: 24 / 240 with two consumers, 32 / 160 with three).
 *
 * Shared memory: TMA writes 64-element (128-byte) rows with the 128-byte
 * swizzle, one panel of 64 columns of D after the other (rows x 128 bytes
 * each). K-major operands (Q, K) use the descriptor of gemm_sm90.cu (8-row
 * atoms 1024 bytes apart; k16 steps are 32-byte start offsets); V as an
 * MN-major B has its 8-key atoms 1024 bytes apart along K (SBO) and its
 * 64-column panels BN x 128 bytes apart along N (LBO).
 *
 * The tensor maps are 4-D (D, rows, heads, batches; varlen: one batch of
 * packed rows). Rows past a tensor's end arrive as zeros; rows of the next
 * varlen sequence are masked like any key past the sequence's end. Which
 * key tiles are visited, and which are masked, is decided as in
 * attn_fwd_sm80.cu (attn_key_tiles / attn_key_range), by every thread
 * alike, so producer and consumers agree on the sequence of tiles.
 */
#include "attn_common.cuh"

#if !defined(ATTN_D) || !defined(ATTN_BN) || !defined(ATTN_CONS) || !defined(ATTN_STAGES) || !defined(ATTN_PERSISTENT)
#error "attn_fwd_sm90.cu needs ATTN_D, ATTN_BN, ATTN_CONS, ATTN_STAGES and ATTN_PERSISTENT"
#endif
#if (ATTN_D != 64 && ATTN_D != 128) || ATTN_BN != 128 || (ATTN_CONS != 2 && ATTN_CONS != 3) || ATTN_STAGES < 2 || \
    ATTN_STAGES > 4 || ATTN_PERSISTENT < 0 || ATTN_PERSISTENT > 2
#error "attn_fwd_sm90.cu: ATTN_D 64 or 128, ATTN_BN 128, ATTN_CONS 2 or 3, ATTN_STAGES 2..4, ATTN_PERSISTENT 0, 1 or 2"
#endif

#define D ATTN_D
#define BN ATTN_BN
#define CONSUMERS ATTN_CONS
#define STAGES ATTN_STAGES
#define BM (64 * CONSUMERS)
#define PANELS (D / 64)
#define THREADS (128 * (CONSUMERS + 1))
#define Q_BYTES (BM * D * 2)
#define KV_BYTES (BN * D * 2)
#define NS (BN / 8) /* n8 column groups of S */
#define NO (D / 8)  /* of O */
#if CONSUMERS == 2
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#else
#define PRODUCER_REGS 32
#define CONSUMER_REGS 160
#endif

/* ---------------------------------------------------------------- wgmma */

/* S (64 x BN per warpgroup) = / += A (64 x 16) B (16 x BN), both from shared
 * memory; O (64 x D) += P (64 x 16, registers) V (16 x D, shared memory). */
static __device__ __forceinline__ void wgmma_s_first(float *d, u64 da, u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." ATTN_DT_PTX "." ATTN_DT_PTX " {" WG_REGS64
               "}, %64, %65, 0, 1, 1, 0, 0;\n"
               : WG_D64(WG_W)
               : "l"(da), "l"(db));
}
static __device__ __forceinline__ void wgmma_s(float *d, u64 da, u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." ATTN_DT_PTX "." ATTN_DT_PTX " {" WG_REGS64
               "}, %64, %65, 1, 1, 1, 0, 0;\n"
               : WG_D64(WG_RW)
               : "l"(da), "l"(db));
}

#if D == 64
static __device__ __forceinline__ void wgmma_pv(float *d, const u32 *a, u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." ATTN_DT_PTX "." ATTN_DT_PTX " {" WG_REGS32
               "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
               : WG_D32(WG_RW)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#else
static __device__ __forceinline__ void wgmma_pv(float *d, const u32 *a, u64 db) { wgmma_rs_n128(d, a, db); }
#endif

/* MN-major (V: d contiguous), 128-byte swizzle: 8-key atoms 1024 bytes
 * apart (SBO), 64-column panels BN x 128 bytes apart (LBO). */
static __device__ __forceinline__ u64 desc_mnmajor(u32 addr) {
  return (u64)((addr & 0x3ffffu) >> 4) | ((u64)((BN * 128) >> 4) << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

/* The ping-pong's turns: named barrier 1 + c (0 is __syncthreads) over
 * 256 threads; the waiting warpgroup's 128 and the passing one's 128
 * complete it. */
static __device__ __forceinline__ void turn_wait(int c) { asm volatile("bar.sync %0, 256;" ::"r"(1 + c) : "memory"); }
static __device__ __forceinline__ void turn_pass(int c) { asm volatile("bar.arrive %0, 256;" ::"r"(1 + c) : "memory"); }

/* S (this consumer's 64 rows x BN keys) = Q Kᵀ, Q at q (the consumer's
 * rows), K at k (a stage). */
static __device__ __forceinline__ void gemm_s(float *s, u32 q, u32 k) {
#pragma unroll
  for (int p = 0; p < PANELS; p++)
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
      const u64 da = wgmma_desc_kmajor(q + p * (BM * 128) + kk * 32);
      const u64 db = wgmma_desc_kmajor(k + p * (BN * 128) + kk * 32);
      if (p == 0 && kk == 0) wgmma_s_first(s, da, db);
      else wgmma_s(s, da, db);
    }
}

/* O += P V, P in registers (the A fragments of attn_pack_p), V at v (a stage). */
static __device__ __forceinline__ void gemm_pv(float *o, u32 (*pa)[4], u32 v) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; kk++) wgmma_pv(o, pa[kk], desc_mnmajor(v + kk * (16 * 128)));
}

/* ptxas schedules wgmma.wait_group as early as it likes within a basic
 * block, which would put "P V done" before the softmax that should
 * overlap it. A wait on an mbarrier phase that has already completed (one
 * try_wait, a loop ptxas cannot remove) ends the block first. */
static __device__ __forceinline__ void softmax_done(u32 bar, u32 parity) { mbar_wait(bar, parity); }

/* ---------------------------------------------------------------- one query tile */

/* A query tile: its sequence, head and first row, its last row r1, the
 * key tiles [n_lo, n_hi) it visits, and where its O and LSE rows go. */
typedef struct fwd_tile {
  attn_seq s;
  int b, h, m0, r1, n_lo, n_hi;
  elem_t *O;
  float *L;
} fwd_tile;

/* Fills t for rows m0.. of head h of sequence b; false when the sequence
 * has no such rows. */
static __device__ __forceinline__ bool tile_at(const attn_params &P, int b, int h, int m0, fwd_tile &t) {
  t.b = b;
  t.h = h;
  t.m0 = m0;
  attn_locate(P, b, t.s);
  if (m0 >= t.s.sq) return false;
  t.r1 = (m0 + BM < t.s.sq ? m0 + BM : t.s.sq) - 1;
  attn_key_tiles(P, t.s.sq, t.s.sk, m0, t.r1, BN, &t.n_lo, &t.n_hi);
  t.O = (elem_t *)P.o.p + attn_base(P, P.o, b, t.s.qrow, h);
  t.L = P.lse ? (float *)P.lse + (P.cu_q ? t.s.qrow * P.lse_rs : (i64)b * P.lse_bs) + (i64)h * P.lse_hs : 0;
  return true;
}

/* No query of the tile sees a key: O = 0 and LSE = +inf, by n threads
 * (this one is number me). */
static __device__ __forceinline__ void zero_tile(const attn_params &P, const fwd_tile &t, int me, int n) {
  const uint4 zero = {0, 0, 0, 0};
  for (int c = me; c < BM * (D / 8); c += n) {
    const int r = c / (D / 8), ch = c % (D / 8);
    if (t.m0 + r <= t.r1) *(uint4 *)(t.O + (i64)(t.m0 + r) * P.o.rs + ch * 8) = zero;
  }
  if (t.L && me < BM && t.m0 + me <= t.r1) t.L[(i64)(t.m0 + me) * P.lse_rs] = ATTN_POS_INF;
}

/* The producer's loads for one tile: Q, then K and V tile by tile into the
 * ring. kv counts the key tiles loaded before this query tile (the ring's
 * stages and phases run on across tiles). */
static __device__ __forceinline__ void produce(const tmap_t *tq, const tmap_t *tk, const tmap_t *tv,
                                               const attn_params &P, const fwd_tile &t, u32 sQ, u32 sK, u32 sV,
                                               u32 fullQ, u32 fullK, u32 fullV, u32 empty, int kv) {
  const int hk = t.h / P.group;
  /* Tensor coordinates: (d, row, head, batch); varlen rows are packed. */
  const int qy = P.cu_q ? (int)t.s.qrow + t.m0 : t.m0, ky = P.cu_q ? (int)t.s.krow : 0, bw = P.cu_q ? 0 : t.b;
  mbar_expect_tx(fullQ, Q_BYTES);
#pragma unroll
  for (int p = 0; p < PANELS; p++) tma_load_4d(sQ + p * (BM * 128), tq, p * 64, qy, t.h, bw, fullQ);
  for (int n = t.n_lo, i = kv; n < t.n_hi; n++, i++) {
    const int st = i % STAGES;
    /* A fresh barrier counts as having completed the phase before phase
     * 0, so the first pass over the ring does not wait. */
    mbar_wait(empty + 8 * st, ((i / STAGES) & 1) ^ 1);
    mbar_expect_tx(fullK + 8 * st, KV_BYTES);
#pragma unroll
    for (int p = 0; p < PANELS; p++)
      tma_load_4d(sK + st * KV_BYTES + p * (BN * 128), tk, p * 64, ky + n * BN, hk, bw, fullK + 8 * st);
    mbar_expect_tx(fullV + 8 * st, KV_BYTES);
#pragma unroll
    for (int p = 0; p < PANELS; p++)
      tma_load_4d(sV + st * KV_BYTES + p * (BN * 128), tv, p * 64, ky + n * BN, hk, bw, fullV + 8 * st);
  }
}

/* One consumer's part of one tile: its 64 query rows against the tile's
 * key tiles, the O rows and LSE out. Q's phase is qpar; kv as in produce.
 * With ATTN_PERSISTENT it also hands Q back (emptyQ) once its last S is
 * computed, and the last K/V stage once its last P V is, for the next
 * tile's loads. */
static __device__ __forceinline__ void consume(const attn_params &P, const fwd_tile &t, int c, u32 sQ, u32 sK, u32 sV,
                                               u32 fullQ, u32 qpar, u32 fullK, u32 fullV, u32 empty, u32 emptyQ,
                                               int kv) {
  const int tid = threadIdx.x % 128, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int m0 = t.m0, r1 = t.r1, n_lo = t.n_lo;
  attn_rows R;
  int unused;
  attn_key_range(P, t.s.sq, t.s.sk, r1, &R.lo_last, &unused);
  attn_key_range(P, t.s.sq, t.s.sk, m0, &unused, &R.hi_first);
  const int row0 = m0 + c * 64 + warp * 16 + g;
  attn_key_range(P, t.s.sq, t.s.sk, row0, &R.lo[0], &R.hi[0]);
  attn_key_range(P, t.s.sq, t.s.sk, row0 + 8, &R.lo[1], &R.hi[1]);
  R.t4 = t4;

  /* O, S and P are live together (P V runs while the next S is
   * exponentiated): 64 + 64 + 32 registers for D 128. */
  float o[NO][4], sc[NS][4], alpha[2];
  u32 pa[BN / 16][4];
#pragma unroll
  for (int i = 0; i < NO; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mx[2] = {ATTN_NEG_INF, ATTN_NEG_INF}, sum[2] = {0.f, 0.f};
#ifdef ATTN_MODS
  const attn_mod M = attn_mod_of(P, t.h);
#endif
#ifdef ATTN_SINKS
  attn_sink_init(M, t4, mx, sum);
#endif
  const u32 qc = sQ + c * (64 * 128);
  mbar_wait(fullQ, qpar);
  /* Consumer 0 has the first turn, then the turn goes round the ring. A
   * consumer takes tiles + 1 turns (S of the first tile; S of tile i with
   * P V of tile i - 1; P V of the last) and each ends with an arrival on
   * the next one's barrier, but for the last consumer's last turn: each
   * barrier then sees as many arrivals as waits, per query tile. */
  const int next = c + 1 == CONSUMERS ? 0 : c + 1;
  if (next == 0) turn_pass(0);
  const int tiles = t.n_hi - n_lo;

  mbar_wait(fullK + 8 * (kv % STAGES), (kv / STAGES) & 1);
  turn_wait(c);
  wgmma_fence();
  gemm_s(&sc[0][0], qc, sK + (kv % STAGES) * KV_BYTES);
  wgmma_commit();
  turn_pass(next);
  WGMMA_WAIT(0);
  fence_f32(&sc[0][0], NS * 4);
#if ATTN_PERSISTENT
  if (tiles == 1) {
    /* This warp's last S is done: the next tile's Q may load. */
    __syncwarp();
    if (lane == 0) mbar_arrive(emptyQ);
  }
#endif
  /* O is still zero: its alpha is not needed. */
#ifdef ATTN_MODS
  attn_mod_tile(sc, NS, n_lo * BN, row0, t.s.sq, t.s.sk, t4, M);
#endif
  attn_softmax(sc, NS, n_lo * BN, R, P.scale_log2, mx, sum, alpha);
  attn_pack_p(sc, pa, BN / 16);

  /* Intra-warpgroup pipelining: in turn i, S_i = Q K_iᵀ and O += P_{i-1} V_{i-1}
   * are issued together; S_i's softmax runs while the tensor cores still
   * work on P_{i-1} V_{i-1} (then on the other consumer's two GEMMs), and
   * only O's rescale and P_i's packing (which overwrites the registers
   * that GEMM reads) wait for it. */
  for (int i = 1; i < tiles; i++) {
    const int st = (kv + i) % STAGES, pst = (kv + i - 1) % STAGES;
    const u32 ph = ((kv + i) / STAGES) & 1, pph = ((kv + i - 1) / STAGES) & 1;
    mbar_wait(fullK + 8 * st, ph);
    mbar_wait(fullV + 8 * pst, pph);
    turn_wait(c);
    wgmma_fence();
    gemm_s(&sc[0][0], qc, sK + st * KV_BYTES);
    wgmma_commit();
    gemm_pv(&o[0][0], pa, sV + pst * KV_BYTES);
    wgmma_commit();
    turn_pass(next);
    WGMMA_WAIT(1);
    fence_f32(&sc[0][0], NS * 4);
#if ATTN_PERSISTENT
    if (i == tiles - 1) {
      __syncwarp();
      if (lane == 0) mbar_arrive(emptyQ);
    }
#endif
#ifdef ATTN_MODS
    attn_mod_tile(sc, NS, (n_lo + i) * BN, row0, t.s.sq, t.s.sk, t4, M);
#endif
    attn_softmax(sc, NS, (n_lo + i) * BN, R, P.scale_log2, mx, sum, alpha);
    /* These fences keep the softmax from sinking below the wait, the next
     * ones O's rescale and P's packing from rising above it. */
    fence_f32(&sc[0][0], NS * 4);
    fence_f32(sum, 2);
    fence_f32(alpha, 2);
    softmax_done(fullV + 8 * pst, pph);
    WGMMA_WAIT(0);
    fence_f32(&o[0][0], NO * 4);
    fence_f32(&sc[0][0], NS * 4);
    /* This warp is done with the stage of tile i - 1. */
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * pst);
    attn_rescale(o, NO, alpha);
    attn_pack_p(sc, pa, BN / 16);
  }

  /* The last tile's P V. One CTA per query tile: the producer loads
   * nothing more, so its stage is not released; persistent: it is, for
   * the next query tile's keys. */
  const int lst = (kv + tiles - 1) % STAGES;
  mbar_wait(fullV + 8 * lst, ((kv + tiles - 1) / STAGES) & 1);
  turn_wait(c);
  wgmma_fence();
  gemm_pv(&o[0][0], pa, sV + lst * KV_BYTES);
  wgmma_commit();
  if (next != 0) turn_pass(next);
  WGMMA_WAIT(0);
  fence_f32(&o[0][0], NO * 4);
#if ATTN_PERSISTENT
  __syncwarp();
  if (lane == 0) mbar_arrive(empty + 8 * lst);
#endif

#ifdef ATTN_SINKS
  attn_sink_end(R, sum);
#endif
  /* O / sum, LSE, and 4-byte stores of column pairs (from registers: the
   * next query tile's loads go on meanwhile). */
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const float l = attn_quad_sum(sum[r]), inv = l > 0.f ? 1.f / l : 0.f;
    const int row = row0 + 8 * r;
    if (row <= r1) {
#pragma unroll
      for (int j = 0; j < NO; j++)
        *(u32 *)(t.O + (i64)row * P.o.rs + j * 8 + 2 * t4) = ATTN_PACK(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
      if (t.L && t4 == 0) t.L[(i64)row * P.lse_rs] = attn_lse(mx[r], l, P.scale_log2);
    }
  }
}

#if ATTN_PERSISTENT
/* One tile of a persistent walk: zeros without keys; else its key tiles,
 * kv (the K/V ring's position) and q (Q's loads) running on across tiles. */
static __device__ __forceinline__ void walk_tile(const attn_params &P, const fwd_tile &t, int c, u32 sQ, u32 sK,
                                                 u32 sV, u32 fullQ, u32 fullK, u32 fullV, u32 empty, u32 emptyQ,
                                                 int *kv, int *q) {
  if (t.n_lo >= t.n_hi) {
    zero_tile(P, t, threadIdx.x - 128, THREADS - 128);
    return;
  }
  consume(P, t, c, sQ, sK, sV, fullQ, *q & 1, fullK, fullV, empty, emptyQ, *kv);
  *kv += t.n_hi - t.n_lo;
  ++*q;
}
#endif

#if ATTN_PERSISTENT == 1
/* The static schedule's i-th query tile of P.m_tiles per (sequence,
 * head). With a right window (causal) the last query tiles see the most
 * keys: tiles run last row block first, all (sequence, head) pairs of one
 * row block together, so the longest start first and the short ones fill
 * the end. Otherwise every tile sees about as many keys: a head's tiles
 * run together, sharing its K and V in L2. */
static __device__ __forceinline__ void schedule(const attn_params &P, i64 i, int *b, int *h, int *m0) {
  const i64 bh = (i64)P.B * P.H;
  i64 r, mb;
  if (P.wr >= 0) {
    mb = P.m_tiles - 1 - i / bh;
    r = i % bh;
  } else {
    r = i / P.m_tiles;
    mb = i % P.m_tiles;
  }
  *b = (int)(r / P.H);
  *h = (int)(r % P.H);
  *m0 = (int)mb * BM;
}

/* This CTA's r-th place in schedule(), -1 past the end: a stride of the
 * grid, back and forth (boustrophedon). Longest first with a plain stride
 * gives CTA 0 the longest tile of every round; back and forth, the CTA
 * with a round's longest tile has the next round's shortest (a model of
 * 132 SMs: causal S16k 0.99 of the ideal makespan, 0.94 with a plain
 * stride; docs/PERF.md). */
static __device__ __forceinline__ i64 my_tile(i64 r, i64 ntiles) {
  const i64 i = r * gridDim.x + (r & 1 ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  return i < ntiles ? i : -1;
}
#endif

#if ATTN_PERSISTENT == 2
/* The dynamic schedule's i-th query tile of P.m_tiles per (sequence,
 * head): false when the sequence has no such rows. The host keeps the
 * number of tiles plus the grid below 2^31, so the list's arithmetic is
 * 32-bit (64-bit division is a subroutine call, and spills).
 *
 * With a right window (causal) the last query tiles see the most keys.
 * The (sequence, head) pairs are cut into groups of g (the last group
 * takes the rest, up to 2g - 1), each group's tiles running last row
 * block first (all pairs of a group's row block together), so that every
 * group starts with its longest tiles and the last group's short tiles
 * fill the end. g * m_tiles is about 1.5 x the CTAs: a model of 132 SMs
 * taking tiles from the counter (docs/PERF.md) reaches 0.97-1.0 of the
 * ideal makespan with groups of that size (0.94 at D 128 S4k with single
 * heads: the last head's longest tile starts too late), while only the K
 * and V of about g + CTAs / m_tiles heads are read at a time (all heads'
 * longest tiles first thrashes L2: docs/PERF.md, Attention forward:
 * persistent schedules).
 * Otherwise every tile sees about as many keys: a head's tiles run
 * together, sharing its K and V in L2. */
static __device__ __forceinline__ bool tile_of(const attn_params &P, int i, fwd_tile &t) {
  const int bh = P.B * P.H, m = P.m_tiles;
  int r, mb;
  if (P.wr >= 0) {
    const int want = (3 * (int)gridDim.x + 2 * m - 1) / (2 * m);
    const int g = want < 1 ? 1 : want > bh ? bh : want, last = bh / g - 1;
    const int q = i / (g * m), grp = q < last ? q : last, a = grp * g, gs = grp == last ? bh - a : g;
    const int j = i - a * m;
    mb = m - 1 - j / gs;
    r = a + j % gs;
  } else {
    r = i / m;
    mb = i % m;
  }
  return tile_at(P, r / P.H, r % P.H, mb * BM, t);
}

/* lds32 with a memory clobber: the ring's entries are written by other
 * warps, so no shared-memory access may move across this read. */
static __device__ __forceinline__ int lds32_ring(u32 addr) {
  int v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

/* The ring of tile numbers, two slots: the producer posts the n-th tile it
 * fetched (-1: no more) in slot n % 2 once the consumers have taken the
 * one two before; every consumer thread takes it and hands the slot back
 * with its own arrive, which orders its read before the producer's next
 * store (one arrive a warp after __syncwarp orders it as well, but
 * compute-sanitizer's racecheck reports that as a WAR hazard). The
 * producer's arrive releases its store, the consumers' wait acquires it. */
static __device__ __forceinline__ void tile_post(u32 ring, u32 tfull, u32 tempty, int n, int i) {
  const int sl = n & 1;
  mbar_wait(tempty + 8 * sl, ((n >> 1) & 1) ^ 1);
  sts32(ring + 4 * sl, (u32)i);
  mbar_arrive(tfull + 8 * sl);
}
static __device__ __forceinline__ int tile_take(u32 ring, u32 tfull, u32 tempty, int n) {
  const int sl = n & 1;
  mbar_wait(tfull + 8 * sl, (n >> 1) & 1);
  const int i = lds32_ring(ring + 4 * sl);
  mbar_arrive(tempty + 8 * sl);
  return i;
}
#endif

/* ---------------------------------------------------------------- the kernel */

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    attn_fwd_sm90(const __grid_constant__ tmap_t tq, const __grid_constant__ tmap_t tk,
                  const __grid_constant__ tmap_t tv, const attn_params P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  /* Q, the K stages, the V stages (all 1024-aligned; the host adds 1 KiB of
   * slack), then the mbarriers: Q full, K full and V full per stage, empty
   * per stage, (persistent) Q empty, and (dynamic) the ring's full and
   * empty per slot, then the ring's two tile numbers (4 bytes each). */
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 sQ = base, sK = sQ + Q_BYTES, sV = sK + STAGES * KV_BYTES, bars = sV + STAGES * KV_BYTES;
  const u32 fullQ = bars, fullK = bars + 8, fullV = fullK + 8 * STAGES, empty = fullV + 8 * STAGES;
  const u32 emptyQ = empty + 8 * STAGES;
#if ATTN_PERSISTENT == 1
  /* One CTA per SM walks the tiles of schedule() in the order of
   * my_tile(); every thread walks the same ones, so producer and
   * consumers agree on the sequence of query tiles and of key tiles. */
  const i64 ntiles = (i64)P.B * P.H * P.m_tiles;
#elif ATTN_PERSISTENT == 2
  /* One CTA per SM takes tiles from the counter until it runs past the
   * list; the producer fetches, the consumers follow the ring, so they
   * agree on the sequence of query tiles and of key tiles. */
  const u32 tfull = emptyQ + 8, tempty = tfull + 16, ring = tempty + 16;
  const int ntiles = P.B * P.H * P.m_tiles;
#else
  /* One CTA per query tile. They run last first: under a causal mask the
   * last see the most keys, and starting the longest CTAs first leaves
   * short ones for the final wave. */
  fwd_tile t;
  if (!tile_at(P, blockIdx.z, blockIdx.y, (gridDim.x - 1 - blockIdx.x) * BM, t)) return;
  if (t.n_lo >= t.n_hi) {
    zero_tile(P, t, threadIdx.x, THREADS);
    return;
  }
#endif

  if (threadIdx.x == 0) {
    mbar_init(fullQ, 1);
    for (int st = 0; st < STAGES; st++) {
      mbar_init(fullK + 8 * st, 1);
      mbar_init(fullV + 8 * st, 1);
      mbar_init(empty + 8 * st, CONSUMERS * 4); /* one arrival per consumer warp */
    }
#if ATTN_PERSISTENT
    mbar_init(emptyQ, CONSUMERS * 4);
#endif
#if ATTN_PERSISTENT == 2
    for (int sl = 0; sl < 2; sl++) {
      mbar_init(tfull + 8 * sl, 1);
      mbar_init(tempty + 8 * sl, CONSUMERS * 128);
    }
#endif
    fence_mbar_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

  if (wg == 0) {
    SETMAXNREG_DEC(PRODUCER_REGS);
    if (tid != 0) return;
#if ATTN_PERSISTENT == 1
    int kv = 0, q = 0;
    for (i64 r = 0, i; (i = my_tile(r, ntiles)) >= 0; r++) {
      int b, h, m0;
      fwd_tile t;
      schedule(P, i, &b, &h, &m0);
      if (!tile_at(P, b, h, m0, t) || t.n_lo >= t.n_hi) continue;
      /* Q is reloaded once every consumer warp has computed its last S
       * of the previous tile (a fresh barrier passes the first wait). */
      mbar_wait(emptyQ, (q & 1) ^ 1);
      produce(&tq, &tk, &tv, P, t, sQ, sK, sV, fullQ, fullK, fullV, empty, kv);
      kv += t.n_hi - t.n_lo;
      q++;
    }
#elif ATTN_PERSISTENT == 2
    int kv = 0, q = 0;
    for (int n = 0;; n++) {
      /* Fetched while the consumers finish the previous tile: the counter's
       * latency hides behind their last key tiles. Tiles past a varlen
       * sequence's end are dropped here. */
      fwd_tile t;
      int i;
      do {
        /* Taken from the parameters at every fetch rather than held: the
         * producer has 24 registers. */
        u64 next = P.sem;
        asm volatile("" : "+l"(next));
        i = (int)atomicAdd((unsigned *)next, 1u);
      } while (i < ntiles && !tile_of(P, i, t));
      tile_post(ring, tfull, tempty, n, i < ntiles ? i : -1);
      if (i >= ntiles) break;
      if (t.n_lo >= t.n_hi) continue; /* the consumers write its zeros */
      /* Q is reloaded once every consumer warp has computed its last S
       * of the previous tile (a fresh barrier passes the first wait). */
      mbar_wait(emptyQ, (q & 1) ^ 1);
      /* Found again rather than held across the waits: in 24 registers
       * that leaves 24 bytes spilled, used once per tile (104 when held). */
      ATTN_OPAQUE(i);
      tile_of(P, i, t);
      produce(&tq, &tk, &tv, P, t, sQ, sK, sV, fullQ, fullK, fullV, empty, kv);
      kv += t.n_hi - t.n_lo;
      q++;
    }
#else
    produce(&tq, &tk, &tv, P, t, sQ, sK, sV, fullQ, fullK, fullV, empty, 0);
#endif
    return;
  }

  SETMAXNREG_INC(CONSUMER_REGS);
#if ATTN_PERSISTENT == 1
  int kv = 0, q = 0;
  for (i64 r = 0, i; (i = my_tile(r, ntiles)) >= 0; r++) {
    int b, h, m0;
    fwd_tile t;
    schedule(P, i, &b, &h, &m0);
    if (tile_at(P, b, h, m0, t)) walk_tile(P, t, wg - 1, sQ, sK, sV, fullQ, fullK, fullV, empty, emptyQ, &kv, &q);
  }
#elif ATTN_PERSISTENT == 2
  int kv = 0, q = 0;
  for (int n = 0;; n++) {
    const int i = tile_take(ring, tfull, tempty, n);
    if (i < 0) break;
    fwd_tile t;
    /* Never false (the producer posts only tiles with rows), but tested:
     * ptxas then knows every field of t to be defined, and so the same
     * across the warp, and keeps the key-tile loop's stage addresses and
     * wgmma descriptors in uniform registers (untested: 16 more R2UR and
     * divergence checks per key tile at D 128, and slower: docs/PERF.md,
     * Attention forward: persistent schedules). */
    if (tile_of(P, i, t)) walk_tile(P, t, wg - 1, sQ, sK, sV, fullQ, fullK, fullV, empty, emptyQ, &kv, &q);
  }
#else
  consume(P, t, wg - 1, sQ, sK, sV, fullQ, 0, fullK, fullV, empty, emptyQ, 0);
#endif
#else
  /* wgmma, TMA and setmaxnreg exist on sm_90a only. The variant list is
   * compiled for every arch, so elsewhere the kernel is a stub the
   * selector never picks (it offers this kernel on cc 9.0 only). */
  __trap();
#endif
}
