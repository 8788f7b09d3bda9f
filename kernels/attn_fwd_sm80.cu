/* FlashAttention-2 forward for sm_80 and later: mma.sync m16n8k16 with
 * ldmatrix fragment loads and cp.async tile loads.
 *
 * Prelude: SMELT_DT (2 f16, 3 bf16); ATTN_D, the head dim (64, 96, 128,
 * 256); ATTN_BN, keys per tile; the score modifiers' (attn_common.cuh):
 * each tile of S is modified before the online softmax, the sink joins
 * the softmax state before the first tile.
 *
 * One CTA per (tile of 64 queries, head, sequence): grid (query tiles of
 * the longest sequence, H, B). Four warps each own 16 query rows and keep
 * everything about them in registers: the O accumulator (16 x D), the
 * running max and sum of each row, and (for D <= 128) Q's fragments. Per
 * tile of BN keys:
 *   S = Q Kᵀ            (scores in f32 accumulators)
 *   online softmax      masked entries -inf (only on tiles a mask cuts),
 *                       new row max m', O and the sum rescaled by 2^(m - m'),
 *                       P = 2^(scale·log2(e)·S - m') with one FFMA and one
 *                       ex2 per element (attn_softmax, attn_common.cuh)
 *   O += P V            P rounded to the input type in registers: the
 *                       accumulator layout of two n8 tiles of S is the A
 *                       operand layout of one k16 step, so P never goes
 *                       through shared memory.
 *
 * Loads (FlashAttention-2's order): one K and one V buffer. V[n] is fetched
 * while S = Q K[n]ᵀ and the softmax run, K[n+1] while O += P V[n]; two
 * barriers per tile separate each buffer's writes from its reads. Rows past
 * a sequence's end are zero-filled by cp.async (K's are masked, V's then
 * meet P = 0; zeros keep 0 x garbage from making NaN).
 *
 * Only the key tiles some query of the CTA sees are visited
 * (attn_key_tiles); a CTA none of whose queries sees a key writes O = 0
 * and LSE = +inf and stops. At the end each warp writes its O rows (scaled
 * by 1/sum, 0 for rows that saw nothing) into its own Q rows of shared
 * memory, which no other warp reads, and stores them as 16-byte rows.
 *
 * Shared memory: Q (64 rows), K and V (BN rows each) of DP elements (D
 * rounded up to 64, whole 128-byte swizzle groups), chunk-swizzled.
 */
#include "attn_common.cuh"

#if !defined(ATTN_D) || !defined(ATTN_BN)
#error "attn_fwd_sm80.cu needs ATTN_D and ATTN_BN"
#endif

#define D ATTN_D
#define BN ATTN_BN
#define WARPS 4
#define NT (WARPS * 32)
#define BM (16 * WARPS)
#define DP ((D + 63) / 64 * 64)
#define RB (DP * 2) /* bytes per shared-memory row */
#define CH (D / 8)  /* 16-byte chunks of a row */
#define KS (D / 16) /* k16 steps over D */
#define NO (D / 8)  /* n8 tiles of O */
#define NS (BN / 8) /* n8 tiles of S */
#define Q_IN_REGS (D <= 128)

static_assert(D % 16 == 0 && BN % 16 == 0, "head dim and key tile are multiples of 16");

/* rows x D elements from row r0 of a [rows, D] view (row stride rs) into
 * the tile at s; rows at or past nvalid read as zeros. */
static __device__ __forceinline__ void load_tile(u32 s, const elem_t *g, i64 rs, int r0, int nvalid, int rows,
                                                 int tid) {
  attn_load_tile(s, g, rs, r0, nvalid, rows, tid, RB, CH, NT);
}

extern "C" __global__ void __launch_bounds__(NT, 2) attn_fwd(const attn_params P) {
  extern __shared__ __align__(128) unsigned char smem[];
  attn_seq s;
  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  attn_locate(P, b, s);
  if (m0 >= s.sq) return;
  const int hk = h / P.group;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const elem_t *Q = (const elem_t *)P.q.p + attn_base(P, P.q, b, s.qrow, h);
  const elem_t *K = (const elem_t *)P.k.p + attn_base(P, P.k, b, s.krow, hk);
  const elem_t *V = (const elem_t *)P.v.p + attn_base(P, P.v, b, s.krow, hk);
  elem_t *O = (elem_t *)P.o.p + attn_base(P, P.o, b, s.qrow, h);
  float *L = P.lse ? (float *)P.lse + (P.cu_q ? s.qrow * P.lse_rs : (i64)b * P.lse_bs) + (i64)h * P.lse_hs : 0;
  const int r1 = (m0 + BM < s.sq ? m0 + BM : s.sq) - 1;
  int n_lo, n_hi;
  attn_key_tiles(P, s.sq, s.sk, m0, r1, BN, &n_lo, &n_hi);

  if (n_lo >= n_hi) {
    /* No query of this tile sees a key. */
    const uint4 zero = {0, 0, 0, 0};
    for (int c = tid; c < BM * CH; c += NT) {
      const int r = c / CH, ch = c % CH;
      if (m0 + r <= r1) *(uint4 *)(O + (i64)(m0 + r) * P.o.rs + ch * 8) = zero;
    }
    if (L && tid < BM && m0 + tid <= r1) L[(i64)(m0 + tid) * P.lse_rs] = ATTN_POS_INF;
    return;
  }

  /* Tiles every key of which every query of the CTA sees need no mask.
   * This thread's rows: warp * 16 + g and + 8. */
  attn_rows R;
  int unused;
  attn_key_range(P, s.sq, s.sk, r1, &R.lo_last, &unused);
  attn_key_range(P, s.sq, s.sk, m0, &unused, &R.hi_first);
  const int row0 = m0 + warp * 16 + g;
  attn_key_range(P, s.sq, s.sk, row0, &R.lo[0], &R.hi[0]);
  attn_key_range(P, s.sq, s.sk, row0 + 8, &R.lo[1], &R.hi[1]);
  R.t4 = t4;

#ifdef ATTN_MODS
  const attn_mod M = attn_mod_of(P, h);
#endif

  const u32 sQ = smem_u32(smem), sK = sQ + BM * RB, sV = sK + BN * RB;
  load_tile(sQ, Q, P.q.rs, m0, s.sq, BM, tid);
  load_tile(sK, K, P.k.rs, n_lo * BN, s.sk, BN, tid);
  cp_async_commit();

  float o[NO][4];
#pragma unroll
  for (int i = 0; i < NO; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mx[2] = {ATTN_NEG_INF, ATTN_NEG_INF}, sum[2] = {0.f, 0.f};
#ifdef ATTN_SINKS
  attn_sink_init(M, t4, mx, sum);
#endif
  u32 offa = attn_off_a(RB, lane), offb = attn_off_b(RB, lane), offt = attn_off_t(RB, lane);
#if Q_IN_REGS
  u32 qf[KS][4];
  CP_ASYNC_WAIT(0);
  __syncthreads();
#pragma unroll
  for (int ks = 0; ks < KS; ks++) ldsm_x4(attn_at(sQ, RB, offa, warp * 16, 2 * ks), qf[ks]);
#endif

  for (int n = n_lo; n < n_hi; n++) {
    /* K[n] has landed and every warp is done with V[n - 1]. */
    CP_ASYNC_WAIT(0);
    __syncthreads();
    load_tile(sV, V, P.v.rs, n * BN, s.sk, BN, tid);
    cp_async_commit();
    ATTN_OPAQUE(offa);
    ATTN_OPAQUE(offb);
    ATTN_OPAQUE(offt);

    float sc[NS][4];
#pragma unroll
    for (int i = 0; i < NS; i++) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
#if Q_IN_REGS
      const u32 *a = qf[ks];
#else
      u32 a[4];
      ldsm_x4(attn_at(sQ, RB, offa, warp * 16, 2 * ks), a);
#endif
#pragma unroll
      for (int nj = 0; nj < NS / 2; nj++) {
        u32 r[4];
        ldsm_x4(attn_at(sK, RB, offb, nj * 16, 2 * ks), r);
        attn_mma2(&sc[2 * nj], a, r);
      }
    }

    /* Online softmax (attn_common.cuh); a row's keys of an n8 tile live in
     * the 4 threads of a quad. */
    float alpha[2];
#ifdef ATTN_MODS
    attn_mod_tile(sc, NS, n * BN, row0, s.sq, s.sk, t4, M);
#endif
    attn_softmax(sc, NS, n * BN, R, P.scale_log2, mx, sum, alpha);
    attn_rescale(o, NO, alpha);
    u32 pa[BN / 16][4];
    attn_pack_p(sc, pa, BN / 16);
    /* V[n] has landed and every warp is done with K[n]. */
    CP_ASYNC_WAIT(0);
    __syncthreads();
    if (n + 1 < n_hi) {
      load_tile(sK, K, P.k.rs, (n + 1) * BN, s.sk, BN, tid);
      cp_async_commit();
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
      for (int dj = 0; dj < NO / 2; dj++) {
        u32 r[4];
        ldsm_x4_t(attn_at(sV, RB, offt, kk * 16, 2 * dj), r);
        attn_mma2(&o[2 * dj], pa[kk], r);
      }
  }

#ifdef ATTN_SINKS
  attn_sink_end(R, sum);
#endif
  /* Row sums over the quad, then O / sum and LSE = ln 2 (m + log2 sum). */
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const float l = attn_quad_sum(sum[r]), inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int i = 0; i < NO; i++) {
      o[i][2 * r] *= inv;
      o[i][2 * r + 1] *= inv;
    }
    const int row = row0 + 8 * r;
    if (L && t4 == 0 && row <= r1) L[(i64)row * P.lse_rs] = attn_lse(mx[r], l, P.scale_log2);
  }

  /* O through this warp's own Q rows (read by no other warp; every cp.async
   * has completed), then 16-byte stores of whole rows. */
  __syncwarp();
#pragma unroll
  for (int i = 0; i < NO; i++) {
    sts32(attn_sw(sQ, RB, warp * 16 + g, i) + 4 * t4, ATTN_PACK(o[i][0], o[i][1]));
    sts32(attn_sw(sQ, RB, warp * 16 + g + 8, i) + 4 * t4, ATTN_PACK(o[i][2], o[i][3]));
  }
  __syncwarp();
#pragma unroll
  for (int c = lane; c < 16 * CH; c += 32) {
    const int r = c / CH, ch = c % CH, row = m0 + warp * 16 + r;
    if (row <= r1) *(uint4 *)(O + (i64)row * P.o.rs + ch * 8) = lds128(attn_sw(sQ, RB, warp * 16 + r, ch));
  }
}
