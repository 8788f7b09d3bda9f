/* FlashAttention-2 backward for sm_80 and later: mma.sync m16n8k16,
 * ldmatrix, cp.async.
 *
 * Prelude: SMELT_DT (2 f16, 3 bf16); ATTN_D, the head dim (64, 96, 128);
 * the score modifiers' (attn_common.cuh): Sᵀ is modified before Pᵀ, and
 * dSᵀ takes the modifier's derivative (attn_mod_tile_bwd). Sinks change
 * nothing here (they are in the LSE); attn_bwd_dsink has their gradient.
 *
 * One CTA per (tile of 128 keys, kv head, sequence): grid (key tiles of the
 * longest sequence, Hk, B). K and V stay in shared memory; eight warps each
 * own 16 keys and accumulate their rows of dK and dV in registers over
 * every query head of the kv head's group (the GQA sum, in a fixed order)
 * and every tile of 64 queries that sees one of the CTA's keys. The CTA
 * works in the transposed frame, keys as rows, so that P and dS come out of
 * one mma in the A-operand layout the next one needs:
 *   Sᵀ  = K Qᵀ                    16 keys x 64 queries per warp
 *   Pᵀ  = 2^(Sᵀ·scale·log2 e - LSE·log2 e)   0 where masked
 *   dPᵀ = V dOᵀ
 *   dSᵀ = Pᵀ ∘ (dPᵀ - D)          D = rowsum(dO ∘ O) per query
 *   dV += Pᵀ dO,  dK += dSᵀ Q     (Pᵀ, dSᵀ rounded to the input type)
 *   dQ += dS K                    through shared memory: dSᵀ goes there,
 *                                 each warp then takes 16 queries x D/2 and
 *                                 adds its f32 result to dq_acc.
 * LSE·log2(e) and D come from attn_bwd_pre (kernels/attn_bwd_aux.cu), which
 * also zeroes dq_acc; attn_bwd_dq scales it by the softmax scale into dq.
 *
 * dq_acc: atomics (red.global.add.f32) by default, so the order of the
 * key tiles' contributions varies. Deterministic mode orders them: a
 * counter per (sequence, head, query tile) says how many key tiles have
 * added theirs; tile n waits until the count is its rank among the tiles
 * that see the query tile (n minus the first such tile, attn_key_tiles,
 * the same function that decides which query tiles a CTA visits), adds,
 * and counts up. Tiles wait only on lower tiles of the same (kv head,
 * sequence), which are earlier in launch order and never wait on later
 * ones, so this cannot deadlock; each element gets its additions in key
 * tile order, a fixed sequence of f32 adds.
 *
 * Q, dO, LSE and D of the next query tile load (cp.async, double-buffered)
 * while the current one is worked on. Rows past a sequence's end load as
 * zeros and are masked. dK (times the scale) and dV leave through the K and
 * V tiles in shared memory as 16-byte rows.
 *
 * Shared memory: K, V (128 rows each), Q and dO (2 x 64 rows each) of DP
 * elements (D rounded up to 64), dSᵀ (128 x 64), LSE and D (2 x 64 f32 each).
 */
#include "attn_common.cuh"

#if !defined(ATTN_D)
#error "attn_bwd_sm80.cu needs ATTN_D"
#endif

#define D ATTN_D
#define WARPS 8
#define NT (WARPS * 32)
#define BN (16 * WARPS) /* keys per CTA */
#define BM 64           /* queries per step */
#define DP ((D + 63) / 64 * 64)
#define RB (DP * 2)
#define CH (D / 8)
#define KS (D / 16)
#define NO (D / 8)
#define NH (BM / 16)  /* n8 tiles of a half (32) of the query columns */
#define DQW (D / 2)   /* dQ columns per warp */
#define DQT (DQW / 8) /* its n8 tiles */
#define DQPT (DQT % 4 == 0 ? 4 : 2) /* n8 tiles per pass */
#define SROW (BM * 2) /* bytes per dSᵀ row */

static_assert(D % 32 == 0, "the dQ split needs D a multiple of 32");
static_assert(WARPS == 2 * (BM / 16), "dQ: 4 query groups x 2 column halves");

#define S_K 0
#define S_V (S_K + BN * RB)
#define S_Q (S_V + BN * RB)
#define S_DO (S_Q + 2 * BM * RB)
#define S_DS (S_DO + 2 * BM * RB)
#define S_LSE (S_DS + BN * SROW)
#define S_DSUM (S_LSE + 2 * BM * 4)
#define SMEM_BYTES (S_DSUM + 2 * BM * 4)

static __device__ __forceinline__ void load_tile(u32 s, const elem_t *g, i64 rs, int r0, int nvalid, int rows,
                                                 int tid) {
  attn_load_tile(s, g, rs, r0, nvalid, rows, tid, RB, CH, NT);
}

/* The query tiles a CTA works on, per head: every m in [m_first, m_last]
 * whose key tiles include this one. */
static __device__ __forceinline__ bool visits(const attn_params &P, const attn_seq &s, int m, int nt, int *rank) {
  const int r0 = m * BM, r1 = (r0 + BM < s.sq ? r0 + BM : s.sq) - 1;
  int n0, n1;
  attn_key_tiles(P, s.sq, s.sk, r0, r1, BN, &n0, &n1);
  *rank = nt - n0;
  return nt >= n0 && nt < n1;
}

/* The step after (gi, m): the next visited query tile, wrapping to the
 * next head of the group. Returns 0 after the last. */
static __device__ __forceinline__ bool next_step(const attn_params &P, const attn_seq &s, int nt, int m_first,
                                                 int m_last, int gi, int m, int *ngi, int *nm) {
  int rank;
  for (m++;; m++) {
    if (m > m_last) {
      m = m_first;
      gi++;
    }
    if (gi >= P.group) return false;
    if (visits(P, s, m, nt, &rank)) break;
  }
  *ngi = gi;
  *nm = m;
  return true;
}

extern "C" __global__ void __launch_bounds__(NT, 1) attn_bwd(const attn_params P) {
  extern __shared__ __align__(128) unsigned char smem[];
  attn_seq s;
  const int b = blockIdx.z, hk = blockIdx.y, nt = blockIdx.x, n0 = nt * BN;
  attn_locate(P, b, s);
  if (n0 >= s.sk) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const u32 base = smem_u32(smem);
  const u32 sK = base + S_K, sV = base + S_V, sDS = base + S_DS;
  const int nk = s.sk - n0 < BN ? s.sk - n0 : BN; /* real keys in this tile */

  /* Candidate query tiles: rows i with lo(i) <= n0 + BN - 1 and hi(i) >= n0,
   * widened by a tile each way; visits() decides exactly. */
  const i64 off = (i64)s.sk - s.sq;
  i64 i_min = P.wr < 0 ? 0 : (i64)n0 - off - P.wr, i_max = P.wl < 0 ? s.sq - 1 : (i64)n0 + BN - 1 - off + P.wl;
  i_min = i_min < 0 ? 0 : i_min;
  i_max = i_max > s.sq - 1 ? s.sq - 1 : i_max;
  int m_first = (int)(i_min / BM) - 1, m_last = i_max < 0 ? -1 : (int)(i_max / BM) + 1;
  const int m_tiles = (s.sq + BM - 1) / BM;
  m_first = m_first < 0 ? 0 : m_first;
  m_last = m_last > m_tiles - 1 ? m_tiles - 1 : m_last;
  if (i_min > i_max) m_last = -1;

  /* The first step: (head gi of the group, query tile m). */
  int gi = 0, m = m_first, rank;
  while (m <= m_last && !visits(P, s, m, nt, &rank)) m++;
  const bool any = m <= m_last;

  const elem_t *Kg = (const elem_t *)P.k.p + attn_base(P, P.k, b, s.krow, hk);
  const elem_t *Vg = (const elem_t *)P.v.p + attn_base(P, P.v, b, s.krow, hk);
  float dk[NO][4], dv[NO][4];
#pragma unroll
  for (int i = 0; i < NO; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) dk[i][e] = dv[i][e] = 0.f;

  /* Loads of step (gi, m) into buffer buf. */
#define LOAD_STEP(gi_, m_, buf_)                                                                                 \
  do {                                                                                                          \
    const int h_ = hk * P.group + (gi_), r0_ = (m_) * BM;                                                        \
    load_tile(base + S_Q + (buf_) * BM * RB, (const elem_t *)P.q.p + attn_base(P, P.q, b, s.qrow, h_), P.q.rs,   \
              r0_, s.sq, BM, tid);                                                                              \
    load_tile(base + S_DO + (buf_) * BM * RB, (const elem_t *)P.d_o.p + attn_base(P, P.d_o, b, s.qrow, h_),     \
              P.d_o.rs, r0_, s.sq, BM, tid);                                                                    \
    if (tid < 2 * BM) {                                                                                         \
      const int r_ = tid % BM;                                                                                  \
      const bool ok_ = r0_ + r_ < s.sq;                                                                         \
      const float *ws_ = (const float *)(tid < BM ? P.lse_ws : P.dsum_ws) + (i64)h_ * P.rows_q + s.qrow + r0_;  \
      cp_async4(base + (tid < BM ? S_LSE : S_DSUM) + ((buf_) * BM + r_) * 4, ok_ ? ws_ + r_ : ws_, ok_ ? 4 : 0); \
    }                                                                                                           \
  } while (0)

  if (any) {
    load_tile(sK, Kg, P.k.rs, n0, s.sk, BN, tid);
    load_tile(sV, Vg, P.v.rs, n0, s.sk, BN, tid);
    LOAD_STEP(gi, m, 0);
    cp_async_commit();
  }
  u32 offa = attn_off_a(RB, lane), offb = attn_off_b(RB, lane), offt = attn_off_t(RB, lane);
  u32 offs = attn_off_b(SROW, lane);
  int buf = 0;
  while (any) {
    /* The next step, prefetched into the other buffer (free since the
     * barrier that ended the previous step). */
    int ngi, nm;
    const bool more = next_step(P, s, nt, m_first, m_last, gi, m, &ngi, &nm);
    if (more) {
      LOAD_STEP(ngi, nm, buf ^ 1);
      cp_async_commit();
      CP_ASYNC_WAIT(1);
    } else {
      CP_ASYNC_WAIT(0);
    }
    __syncthreads();

    ATTN_OPAQUE(offa);
    ATTN_OPAQUE(offb);
    ATTN_OPAQUE(offt);
    ATTN_OPAQUE(offs);
    const int h = hk * P.group + gi, m0 = m * BM;
    const int r1 = (m0 + BM < s.sq ? m0 + BM : s.sq) - 1;
    const u32 sQ = base + S_Q + buf * BM * RB, sDO = base + S_DO + buf * BM * RB;
    const float *lse2 = (const float *)(smem + S_LSE) + buf * BM, *dsum = (const float *)(smem + S_DSUM) + buf * BM;

    /* Whether a mask cuts this (query tile, key tile): the query tile is
     * ragged or some key is outside some query's range. */
    int lo_last, hi_first, unused;
    attn_key_range(P, s.sq, s.sk, r1, &lo_last, &unused);
    attn_key_range(P, s.sq, s.sk, m0, &unused, &hi_first);
    const bool full = r1 == m0 + BM - 1 && n0 >= lo_last && n0 + BN - 1 <= hi_first;
    /* Where it does: the queries that see this thread's keys n0 + warp * 16
     * + g (+ 8) are [qlo, qhi], attn_key_range inverted (none past the last
     * key), which holds no query past the sequence's end. Computed per step,
     * not kept: registers are what this kernel is short of. */
    int qlo[2], qhi[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const i64 j = n0 + warp * 16 + g + 8 * r;
      const i64 a = P.wr < 0 ? 0 : j - off - P.wr, z = P.wl < 0 ? s.sq - 1 : j - off + P.wl;
      qlo[r] = (int)attn_clamp(a, 0, s.sq);
      qhi[r] = j < s.sk ? (int)attn_clamp(z, -1, s.sq - 1) : -1;
    }

    /* Two halves of 32 queries, so that only one half's Sᵀ and dPᵀ are
     * live next to the dK and dV accumulators. */
#pragma unroll 1
    for (int qh = 0; qh < 2; qh++) {
      float st[NH][4], dpt[NH][4]; /* this warp's 16 keys x 32 queries */
      ATTN_OPAQUE(offa); /* K's and V's fragments are reloaded per half, not kept */
#pragma unroll
      for (int i = 0; i < NH; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ks++) {
        u32 ak[4], av[4];
        ldsm_x4(attn_at(sK, RB, offa, warp * 16, 2 * ks), ak);
        ldsm_x4(attn_at(sV, RB, offa, warp * 16, 2 * ks), av);
#pragma unroll
        for (int qj = 0; qj < NH / 2; qj++) {
          u32 r[4];
          ldsm_x4(attn_at(sQ, RB, offb, qh * 32 + qj * 16, 2 * ks), r);
          attn_mma2(&st[2 * qj], ak, r);
          ldsm_x4(attn_at(sDO, RB, offb, qh * 32 + qj * 16, 2 * ks), r);
          attn_mma2(&dpt[2 * qj], av, r);
        }
      }

      /* Pᵀ and dSᵀ. Entry e of tile qt: key n0 + warp * 16 + g + 8 (e / 2),
       * query m0 + qh * 32 + qt * 8 + 2 t4 + e % 2. */
#ifdef ATTN_MODS
      attn_mod_tile_bwd(st, dpt, NH, (float)((i64)m0 + qh * 32 + 2 * t4 + off - (n0 + warp * 16 + g)), dsum + qh * 32,
                        t4, attn_mod_of(P, h));
#endif
#pragma unroll
      for (int qt = 0; qt < NH; qt++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
          const int qc = qh * 32 + qt * 8 + 2 * t4 + c;
          const float l2 = lse2[qc], ds = dsum[qc];
#pragma unroll
          for (int r = 0; r < 2; r++) {
            const bool vis = full || (m0 + qc >= qlo[r] && m0 + qc <= qhi[r]);
            const float p = vis ? attn_ex2(st[qt][2 * r + c] * P.scale_log2 - l2) : 0.f;
            st[qt][2 * r + c] = p;
            dpt[qt][2 * r + c] = p * (dpt[qt][2 * r + c] - ds);
          }
        }

      /* dV += Pᵀ dO and dK += dSᵀ Q; k16 step kk over queries is the
       * half's tiles 2 k2 and 2 k2 + 1. */
#pragma unroll
      for (int k2 = 0; k2 < NH / 2; k2++) {
        const int kk = qh * (NH / 2) + k2;
        u32 ap[4], ad[4];
        ap[0] = ATTN_PACK(st[2 * k2][0], st[2 * k2][1]);
        ap[1] = ATTN_PACK(st[2 * k2][2], st[2 * k2][3]);
        ap[2] = ATTN_PACK(st[2 * k2 + 1][0], st[2 * k2 + 1][1]);
        ap[3] = ATTN_PACK(st[2 * k2 + 1][2], st[2 * k2 + 1][3]);
        ad[0] = ATTN_PACK(dpt[2 * k2][0], dpt[2 * k2][1]);
        ad[1] = ATTN_PACK(dpt[2 * k2][2], dpt[2 * k2][3]);
        ad[2] = ATTN_PACK(dpt[2 * k2 + 1][0], dpt[2 * k2 + 1][1]);
        ad[3] = ATTN_PACK(dpt[2 * k2 + 1][2], dpt[2 * k2 + 1][3]);
        /* dSᵀ to shared memory for dQ: row = key, 8 queries per 16-byte chunk. */
        const int krow = warp * 16 + g;
        sts32(attn_sw(sDS, SROW, krow, 2 * kk) + 4 * t4, ad[0]);
        sts32(attn_sw(sDS, SROW, krow + 8, 2 * kk) + 4 * t4, ad[1]);
        sts32(attn_sw(sDS, SROW, krow, 2 * kk + 1) + 4 * t4, ad[2]);
        sts32(attn_sw(sDS, SROW, krow + 8, 2 * kk + 1) + 4 * t4, ad[3]);
#pragma unroll
        for (int dj = 0; dj < NO / 2; dj++) {
          u32 r[4];
          ldsm_x4_t(attn_at(sDO, RB, offt, kk * 16, 2 * dj), r);
          attn_mma2(&dv[2 * dj], ap, r);
          ldsm_x4_t(attn_at(sQ, RB, offt, kk * 16, 2 * dj), r);
          attn_mma2(&dk[2 * dj], ad, r);
        }
      }
    }

    /* Deterministic: wait for this query tile's turn, which is this key
     * tile's rank among the tiles that see it. */
    int *sem = P.deterministic ? (int *)P.sem + ((i64)b * P.H + h) * P.m_tiles + m : 0;
    if (sem) visits(P, s, m, nt, &rank);
    if (sem && tid == 0) {
      int v;
      do v = smelt_ld_acquire(sem);
      while (v != rank);
    }
    __syncthreads();

    /* dQ (before the scale) += dS K: warp takes queries 16 (warp % 4) ..
     * and columns DQW (warp / 4) .., in passes of DQPT n8 tiles (fewer
     * accumulators live next to dK and dV); A = dS from dSᵀ by transposed
     * loads. */
    {
      const int qg = warp & 3;
      float *acc = (float *)P.dq_acc + ((s.qrow + m0) * P.H + h) * (i64)D;
#pragma unroll 1
      for (int d0 = (warp >> 2) * DQW; d0 < (warp >> 2) * DQW + DQW; d0 += DQPT * 8) {
        float dq[DQPT][4];
#pragma unroll
        for (int i = 0; i < DQPT; i++) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
        ATTN_OPAQUE(offs);
#pragma unroll
        for (int ks = 0; ks < BN / 16; ks++) {
          u32 a[4];
          ldsm_x4_t(attn_at(sDS, SROW, offs, ks * 16, 2 * qg), a);
#pragma unroll
          for (int dj = 0; dj < DQPT / 2; dj++) {
            u32 r[4];
            ldsm_x4_t(attn_at(sK, RB, offt, ks * 16, d0 / 8 + 2 * dj), r);
            attn_mma2(&dq[2 * dj], a, r);
          }
        }
#pragma unroll
        for (int i = 0; i < DQPT; i++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int q = qg * 16 + g + 8 * (e >> 1);
            if (m0 + q <= r1) atomicAdd(acc + (i64)q * P.H * D + d0 + i * 8 + 2 * t4 + (e & 1), dq[i][e]);
          }
      }
    }
    if (sem) __threadfence();
    /* Everyone is done with dSᵀ and this step's buffers. */
    __syncthreads();
    if (sem && tid == 0) smelt_st_release(sem, rank + 1);
    /* The next step again (cheap), rather than kept in registers through
     * this one's. */
    if (!next_step(P, s, nt, m_first, m_last, gi, m, &gi, &m)) break;
    buf ^= 1;
  }
#undef LOAD_STEP

  /* dK · scale and dV through the warp's own K and V rows (the last
   * barrier has every warp done reading them), then 16-byte stores. */
  const int krow = warp * 16 + g;
#pragma unroll
  for (int i = 0; i < NO; i++) {
    sts32(attn_sw(sK, RB, krow, i) + 4 * t4, ATTN_PACK(dk[i][0] * P.scale, dk[i][1] * P.scale));
    sts32(attn_sw(sK, RB, krow + 8, i) + 4 * t4, ATTN_PACK(dk[i][2] * P.scale, dk[i][3] * P.scale));
    sts32(attn_sw(sV, RB, krow, i) + 4 * t4, ATTN_PACK(dv[i][0], dv[i][1]));
    sts32(attn_sw(sV, RB, krow + 8, i) + 4 * t4, ATTN_PACK(dv[i][2], dv[i][3]));
  }
  __syncwarp();
  elem_t *dK = (elem_t *)P.dk.p + attn_base(P, P.dk, b, s.krow, hk);
  elem_t *dV = (elem_t *)P.dv.p + attn_base(P, P.dv, b, s.krow, hk);
#pragma unroll
  for (int c = lane; c < 16 * CH; c += 32) {
    const int r = warp * 16 + c / CH, ch = c % CH;
    if (r < nk) {
      *(uint4 *)(dK + (i64)(n0 + r) * P.dk.rs + ch * 8) = lds128(attn_sw(sK, RB, r, ch));
      *(uint4 *)(dV + (i64)(n0 + r) * P.dv.rs + ch * 8) = lds128(attn_sw(sV, RB, r, ch));
    }
  }
}
