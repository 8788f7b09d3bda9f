/* Attention decode over a paged KV cache (flash-decoding), sm_80 and later:
 * mma.sync m16n8k16 with f32 accumulation, cp.async loads of K and V rows
 * gathered through the block table, double-buffered.
 *
 * Prelude: SMELT_DT (2 f16, 3 bf16); ATTN_D, the head dim (64, 128);
 * DEC_RW, the warps along query rows (1, 2 or 4; the other 4 / DEC_RW
 * split each key tile between them); DEC_MAX_SPLITS, the most splits the
 * host asks for (a multiple of 32).
 *
 * The rows of a CTA are the queries of one kv head of one sequence: the
 * group's query heads times Sq (row r is query r / group of head
 * hk * group + r % group), so K and V are read once per group, not once
 * per query head. Grid (row blocks × splits, Hk, B): each CTA takes
 * 16 · DEC_RW of those rows and one split of the sequence's key tiles
 * (BN keys each; the split count comes from the host, which sizes it to
 * fill the device). Per tile, each warp works on its 16 rows and its
 * BN / KW keys:
 *   S = Q Kᵀ, the online softmax (attn_softmax, attn_common.cuh), O += P V
 * with P kept in registers as in the forward. Tiles are gathered row by
 * row: position p of the sequence is row p % page_size of page
 * block_table[b][p / page_size], so any page size works and a tile may
 * cross pages. Each thread reads the page ids of its rows one tile ahead
 * of their loads, so the table lookup's latency hides behind a tile of
 * work. Rows past the sequence's length, and rows of a page id outside the
 * cache, are zero-filled (their keys are masked; a zero V meets P = 0).
 *
 * The end: each warp leaves its unnormalized O (f32), its row maxima (log2
 * units) and row sums in shared memory; the CTA merges the key warps of
 * each row and writes either the final O and LSE (one split) or the
 * split's normalized O and natural-log LSE to the workspace, which
 * dec_combine then merges by their LSE (a split that saw no key has LSE
 * -inf and weight 0). A row that saw no key at all gets O = 0, LSE = +inf.
 *
 * dec_combine: one warp per (sequence, kv head, row), each lane 4 columns.
 * On sm_90 it is launched as dec_fwd's programmatic dependent: dec_fwd lets
 * it start once all its CTAs run, and it waits in griddepcontrol.wait for
 * dec_fwd's end and memory, which saves the launch gap between the two.
 */
#include "attn_common.cuh"

#if !defined(ATTN_D) || !defined(DEC_RW) || !defined(DEC_MAX_SPLITS)
#error "attn_decode.cu needs ATTN_D, DEC_RW and DEC_MAX_SPLITS"
#endif

#define D ATTN_D
#define BN 64
#define NT 128
#define RW DEC_RW
#define KW (4 / RW)  /* warps per row block, along keys */
#define BM (16 * RW) /* rows per CTA */
#define BNW (BN / KW) /* keys per warp per tile */
#define DP ((D + 63) / 64 * 64)
#define RB (DP * 2) /* bytes per shared-memory row */
#define CH (D / 8)  /* 16-byte chunks of a row */
#define KS (D / 16)
#define NO (D / 8)
#define NSW (BNW / 8)
#define LR (BN * CH / NT) /* tile rows each thread loads */
#define RSTEP (NT / CH)   /* between them */

static_assert(D == 64 || D == 128, "attn_decode.cu supports head dims 64 and 128");
static_assert(RW == 1 || RW == 2 || RW == 4, "DEC_RW is 1, 2 or 4");
static_assert(DEC_MAX_SPLITS % 32 == 0, "DEC_MAX_SPLITS is a multiple of 32");
static_assert(NT % CH == 0 && BNW % 16 == 0, "tile shapes");

/* Mirrored byte for byte by smelt__dec_kparams in src/cuda/op_attn_decode.c.
 * Strides in elements; the caches' are (page, row in page, head). */
typedef struct dec_params {
  u64 q, k, v, o, lse, table, seqlens, o_part, lse_part;
  i64 q_bs, q_rs, q_hs;
  i64 o_bs, o_rs, o_hs;
  i64 k_ps, k_rs, k_hs;
  i64 v_ps, v_rs, v_hs;
  i64 lse_bs, lse_hs, lse_rs;
  i64 t_bs, t_ps, sl_s;
  int B, H, Hk, group, Sq, M; /* M = group * Sq rows per (sequence, kv head) */
  int pages, page_size, max_pages, splits;
  int causal, row_blocks;
  float scale_log2, pad;
} dec_params;

static_assert(sizeof(dec_params) == 272, "dec_params must match smelt__dec_kparams");

/* Sequence b's length, clamped into what its block table row addresses. */
static __device__ __forceinline__ int dec_seqlen(const dec_params &P, int b) {
  const int len = ((const int *)P.seqlens)[(i64)b * P.sl_s];
  const int cap = P.max_pages * P.page_size;
  return len < 0 ? 0 : len > cap ? cap : len;
}

/* The page ids of this thread's rows of tile n; -1 past the length. */
static __device__ __forceinline__ void dec_pages(const dec_params &P, int b, int n, int len, int tid, int *pg) {
  const int *tab = (const int *)P.table + (i64)b * P.t_bs;
#pragma unroll
  for (int j = 0; j < LR; j++) {
    const int key = n * BN + tid / CH + j * RSTEP;
    pg[j] = key < len ? __ldg(tab + (i64)(key / P.page_size) * P.t_ps) : -1;
  }
}

/* Tile n of K and V (this thread's rows, pages pg) into the stage at sK, sV. */
static __device__ __forceinline__ void dec_load(const dec_params &P, int hk, int n, const int *pg, u32 sK, u32 sV,
                                                int tid) {
  const elem_t *K = (const elem_t *)P.k + (i64)hk * P.k_hs, *V = (const elem_t *)P.v + (i64)hk * P.v_hs;
  const int c = tid % CH;
#pragma unroll
  for (int j = 0; j < LR; j++) {
    const int r = tid / CH + j * RSTEP, in = (n * BN + r) % P.page_size;
    const bool ok = pg[j] >= 0 && pg[j] < P.pages;
    const i64 page = ok ? pg[j] : 0;
    cp_async16(attn_sw(sK, RB, r, c), K + page * P.k_ps + (i64)in * P.k_rs + c * 8, ok ? 16 : 0);
    cp_async16(attn_sw(sV, RB, r, c), V + page * P.v_ps + (i64)in * P.v_rs + c * 8, ok ? 16 : 0);
  }
}

/* The last position query i of a sequence of len tokens sees. */
static __device__ __forceinline__ int dec_hi(const dec_params &P, int len, int i) {
  return P.causal ? len - P.Sq + i : len - 1;
}

extern "C" __global__ void __launch_bounds__(NT, 2) dec_fwd(const dec_params P) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int split = blockIdx.x % P.splits, r0 = blockIdx.x / P.splits * BM;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int rw = warp / KW, kw = warp % KW;
  const u32 sQ = smem_u32(smem), sKV = sQ + BM * RB; /* stage s: K at sKV + 2 s BN RB, V after it */
  /* Q's rows (query i of head hk * group + hg, zeros past M), issued before
   * anything waits on the length, as a group of their own (the waits below
   * cover it; an uncommitted copy no wait would). */
  for (int c = tid; c < BM * CH; c += NT) {
    const int r = r0 + c / CH, ch = c % CH, i = r / P.group, h = hk * P.group + r % P.group;
    const bool ok = r < P.M;
    const elem_t *src = (const elem_t *)P.q + (ok ? (i64)b * P.q_bs + (i64)i * P.q_rs + (i64)h * P.q_hs + ch * 8 : 0);
    cp_async16(attn_sw(sQ, RB, c / CH, ch), src, ok ? 16 : 0);
  }
  cp_async_commit();
  const int len = dec_seqlen(P, b);
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  /* This CTA's key tiles: the split's share of those its rows see. */
  const int r_last = (r0 + BM < P.M ? r0 + BM : P.M) - 1;
  const int kend = dec_hi(P, len, r_last / P.group) + 1;
  const int ntiles = kend > 0 ? (kend + BN - 1) / BN : 0, per = (ntiles + P.splits - 1) / P.splits;
  const int t0 = split * per, t1 = t0 + per < ntiles ? t0 + per : ntiles;

  /* This thread's two rows (r0 + rw * 16 + g and + 8): the keys they see.
   * Padding rows past M see none. Every row of the CTA sees [0, hi_first]. */
  attn_rows R;
  R.t4 = t4;
  R.lo_last = 0;
  R.hi_first = dec_hi(P, len, r0 / P.group);
#pragma unroll
  for (int e = 0; e < 2; e++) {
    const int r = r0 + rw * 16 + g + 8 * e;
    R.lo[e] = 0;
    R.hi[e] = r < P.M ? dec_hi(P, len, r / P.group) : -1;
  }

  float o[NO][4];
#pragma unroll
  for (int i = 0; i < NO; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mx[2] = {ATTN_NEG_INF, ATTN_NEG_INF}, sum[2] = {0.f, 0.f};

  if (t0 < t1) {
    int pg[LR];
    dec_pages(P, b, t0, len, tid, pg);
    dec_load(P, hk, t0, pg, sKV, sKV + BN * RB, tid);
    cp_async_commit();
    if (t0 + 1 < t1) dec_pages(P, b, t0 + 1, len, tid, pg);

    u32 qf[KS][4];
    const u32 offa = attn_off_a(RB, lane), offb = attn_off_b(RB, lane), offt = attn_off_t(RB, lane);
    for (int n = t0; n < t1; n++) {
      const u32 sK = sKV + ((n - t0) & 1) * 2 * BN * RB, sV = sK + BN * RB;
      /* Tile n + 1 into the other stage (freed by the barrier that ended
       * the last iteration), then the page ids of tile n + 2. */
      if (n + 1 < t1) {
        const u32 nK = sKV + ((n + 1 - t0) & 1) * 2 * BN * RB;
        dec_load(P, hk, n + 1, pg, nK, nK + BN * RB, tid);
      }
      cp_async_commit();
      if (n + 2 < t1) dec_pages(P, b, n + 2, len, tid, pg);
      CP_ASYNC_WAIT(1);
      __syncthreads();
      if (n == t0) {
#pragma unroll
        for (int ks = 0; ks < KS; ks++) ldsm_x4(attn_at(sQ, RB, offa, rw * 16, 2 * ks), qf[ks]);
      }

      float sc[NSW][4];
#pragma unroll
      for (int i = 0; i < NSW; i++) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int nj = 0; nj < NSW / 2; nj++) {
          u32 r[4];
          ldsm_x4(attn_at(sK, RB, offb, kw * BNW + nj * 16, 2 * ks), r);
          attn_mma2(&sc[2 * nj], qf[ks], r);
        }
      float alpha[2];
      attn_softmax(sc, NSW, n * BN + kw * BNW, R, P.scale_log2, mx, sum, alpha);
      attn_rescale(o, NO, alpha);
      u32 pa[BNW / 16][4];
      attn_pack_p(sc, pa, BNW / 16);
#pragma unroll
      for (int kk = 0; kk < BNW / 16; kk++)
#pragma unroll
        for (int dj = 0; dj < NO / 2; dj++) {
          u32 r[4];
          ldsm_x4_t(attn_at(sV, RB, offt, kw * BNW + kk * 16, 2 * dj), r);
          attn_mma2(&o[2 * dj], pa[kk], r);
        }
      /* Every warp is done with this stage before it is loaded again. */
      __syncthreads();
    }
  }
  CP_ASYNC_WAIT(0);
  __syncthreads();

  /* Each warp's rows into shared memory: O unnormalized (f32 [KW][BM][D]),
   * then per row the log2 reference of O and the sum ([KW][BM] each; the
   * reference -inf for a row that saw no key here). */
  float *sO = (float *)smem, *sM = sO + KW * BM * D, *sL = sM + KW * BM;
  const float c = fabsf(P.scale_log2);
#pragma unroll
  for (int e = 0; e < 2; e++) {
    const int row = rw * 16 + g + 8 * e;
    float *dst = sO + (kw * BM + row) * D + 2 * t4;
#pragma unroll
    for (int i = 0; i < NO; i++) *(float2 *)(dst + 8 * i) = make_float2(o[i][2 * e], o[i][2 * e + 1]);
    const float l = attn_quad_sum(sum[e]);
    if (t4 == 0) {
      sM[kw * BM + row] = l > 0.f ? mx[e] * c : ATTN_NEG_INF;
      sL[kw * BM + row] = l;
    }
  }
  __syncthreads();

  /* The key warps of each row merged; 4 columns per thread. */
  for (int idx = tid; idx < BM * (D / 4); idx += NT) {
    const int row = idx / (D / 4), d = idx % (D / 4) * 4, r = r0 + row;
    if (r >= P.M) continue;
    float m = ATTN_NEG_INF;
#pragma unroll
    for (int w = 0; w < KW; w++) m = fmaxf(m, sM[w * BM + row]);
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m != ATTN_NEG_INF)
#pragma unroll
      for (int w = 0; w < KW; w++) {
        const float f = attn_ex2(sM[w * BM + row] - m);
        const float4 v = *(const float4 *)(sO + (w * BM + row) * D + d);
        l += f * sL[w * BM + row];
        acc.x += f * v.x;
        acc.y += f * v.y;
        acc.z += f * v.z;
        acc.w += f * v.w;
      }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    acc.x *= inv;
    acc.y *= inv;
    acc.z *= inv;
    acc.w *= inv;
    const int i = r / P.group, h = hk * P.group + r % P.group;
    if (P.splits == 1) {
      elem_t *O = (elem_t *)P.o + (i64)b * P.o_bs + (i64)i * P.o_rs + (i64)h * P.o_hs + d;
      *(uint2 *)O = make_uint2(ATTN_PACK(acc.x, acc.y), ATTN_PACK(acc.z, acc.w));
      if (P.lse && d == 0)
        ((float *)P.lse)[(i64)b * P.lse_bs + (i64)h * P.lse_hs + (i64)i * P.lse_rs] =
            l > 0.f ? (m + log2f(l)) * ATTN_LN2 : ATTN_POS_INF;
    } else {
      const i64 wrow = (((i64)split * P.B + b) * P.Hk + hk) * P.M + r;
      *(float4 *)((float *)P.o_part + wrow * D + d) = acc;
      if (d == 0) ((float *)P.lse_part)[wrow] = l > 0.f ? (m + log2f(l)) * ATTN_LN2 : ATTN_NEG_INF;
    }
  }
}

/* The splits of each row merged by their LSE: O = Σ e^(lse_s - m) O_s /
 * Σ e^(lse_s - m), LSE = m + log Σ e^(lse_s - m). Lane t holds the LSE and
 * weight of splits t, t + 32, ... (DEC_MAX_SPLITS at most), so the row's
 * LSE values are read at once and reduced by shuffles; the O rows are then
 * read 8 splits at a time, each weight shuffled from its lane. */
#define SPL (DEC_MAX_SPLITS / 32)

extern "C" __global__ void __launch_bounds__(NT) dec_combine(const dec_params P) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const i64 rows = (i64)P.B * P.Hk * P.M;
  const i64 w = (i64)blockIdx.x * (NT / 32) + (threadIdx.x >> 5);
  if (w >= rows) return;
  const int lane = threadIdx.x & 31;
  const float *lp = (const float *)P.lse_part + w;
  float wt[SPL], m = ATTN_NEG_INF;
#pragma unroll
  for (int j = 0; j < SPL; j++) {
    const int sp = lane + 32 * j;
    wt[j] = sp < P.splits ? lp[(i64)sp * rows] : ATTN_NEG_INF;
    m = fmaxf(m, wt[j]);
  }
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
  float l = 0.f;
#pragma unroll
  for (int j = 0; j < SPL; j++) {
    wt[j] = m == ATTN_NEG_INF || wt[j] == ATTN_NEG_INF ? 0.f : __expf(wt[j] - m);
    l += wt[j];
  }
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) l += __shfl_xor_sync(0xffffffffu, l, x);

  float4 acc[(D + 127) / 128];
#pragma unroll
  for (int k = 0; k < (D + 127) / 128; k++) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  const float *src = (const float *)P.o_part + w * D;
#pragma unroll
  for (int j = 0; j < SPL; j++) {
    const int n = P.splits - 32 * j < 32 ? P.splits - 32 * j : 32;
#pragma unroll 8
    for (int t = 0; t < n; t++) {
      const float f = __shfl_sync(0xffffffffu, wt[j], t);
      const int sp = 32 * j + t;
#pragma unroll
      for (int k = 0; k < (D + 127) / 128; k++) {
        const int d = lane * 4 + 128 * k;
        if (d < D) {
          const float4 v = *(const float4 *)(src + (i64)sp * rows * D + d);
          acc[k].x += f * v.x;
          acc[k].y += f * v.y;
          acc[k].z += f * v.z;
          acc[k].w += f * v.w;
        }
      }
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  const int r = (int)(w % P.M), hk = (int)(w / P.M % P.Hk), b = (int)(w / P.M / P.Hk);
  const int i = r / P.group, h = hk * P.group + r % P.group;
  elem_t *O = (elem_t *)P.o + (i64)b * P.o_bs + (i64)i * P.o_rs + (i64)h * P.o_hs;
#pragma unroll
  for (int k = 0; k < (D + 127) / 128; k++) {
    const int d = lane * 4 + 128 * k;
    if (d < D)
      *(uint2 *)(O + d) = make_uint2(ATTN_PACK(acc[k].x * inv, acc[k].y * inv), ATTN_PACK(acc[k].z * inv, acc[k].w * inv));
  }
  if (P.lse && lane == 0)
    ((float *)P.lse)[(i64)b * P.lse_bs + (i64)h * P.lse_hs + (i64)i * P.lse_rs] =
        l > 0.f ? m + __logf(l) : ATTN_POS_INF;
}
