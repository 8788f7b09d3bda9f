/* What the attention kernels share: the launch parameters (mirrored byte for
 * byte by smelt__attn_kparams in src/cuda/op_attention.c), locating a
 * sequence of a batched or varlen call, the mask, and small PTX helpers.
 *
 * Prelude: SMELT_DT (2 f16, 3 bf16); the kernel files add their own; the
 * score modifiers' variants add ATTN_SOFTCAP, ATTN_ALIBI and ATTN_SINKS
 * (each 1 when the variant has it; see "score modifiers" below). All their
 * code sits under #ifdef, so a variant without them preprocesses to the
 * plain kernel's text.
 *
 * Rows: a tensor's element (sequence b, row i, head h, d) is at
 *   batched  p + b * bs + i * rs + h * hs + d
 *   varlen   p + (cu[b] + i) * rs + h * hs + d      (bs unused)
 * and the backward's workspaces index rows globally: row b * seqlen_q + i
 * (batched) or cu_q[b] + i (varlen), rows_q of them in all.
 *
 * The mask, the one definition (as smelt__attn_key_range on the host):
 * query i of a sequence with sq queries and sk keys sees keys
 * [max(0, i + sk - sq - wl), min(sk - 1, i + sk - sq + wr)], a bound with a
 * window of -1 being the edge itself. Both ends grow with i, and a row's
 * range is either empty (only the first rows, when the diagonal starts
 * left of key 0) or overlaps the next row's, so the keys a block of rows
 * sees are the single range [lo(first row), hi(last row)].
 */
#ifndef SMELT_ATTN_COMMON_CUH
#define SMELT_ATTN_COMMON_CUH

#include "smelt_mma.cuh"

#if !defined(SMELT_DT) || (SMELT_DT != SMELT_DT_F16 && SMELT_DT != SMELT_DT_BF16)
#error "attention kernels need SMELT_DT 2 (f16) or 3 (bf16)"
#endif

#if SMELT_DT == SMELT_DT_BF16
#define ATTN_MMA mma_16816_bf16
#define ATTN_PACK pack_bf16x2
#define ATTN_DT_PTX "bf16"
#else
#define ATTN_MMA mma_16816_f16
#define ATTN_PACK pack_f16x2
#define ATTN_DT_PTX "f16"
#endif

/* The Hopper kernels' d (64 x 128) += A (registers: 4 words of the
 * mma.sync A fragment) B (a descriptor, shared memory). */
static __device__ __forceinline__ void wgmma_rs_n128(float *d, const u32 *a, u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." ATTN_DT_PTX "." ATTN_DT_PTX " {" WG_REGS64
               "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
               : WG_D64(WG_RW)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

#if defined(ATTN_SOFTCAP) || defined(ATTN_ALIBI) || defined(ATTN_SINKS)
#define ATTN_MODS 1
#endif

#define ATTN_NEG_INF __uint_as_float(0xff800000u)
#define ATTN_POS_INF __uint_as_float(0x7f800000u)
#define ATTN_LN2 0.69314718055994530942f

/* A q/k/v-like tensor: data pointer and strides in elements (D has unit stride). */
typedef struct attn_tensor {
  u64 p;
  i64 bs, rs, hs;
} attn_tensor;

typedef struct attn_params {
  attn_tensor q, k, v, o, d_o, dq, dk, dv;
  u64 lse;                  /* f32; 0 when the forward is not asked for it */
  i64 lse_bs, lse_hs, lse_rs;
  u64 cu_q, cu_k;           /* varlen: int32 [B + 1]; 0 when batched */
  u64 dq_acc;               /* backward: f32 [rows_q][H][D], dq before the scale */
  u64 lse_ws, dsum_ws;      /* backward: f32 [H][rows_q]: LSE * log2(e), rowsum(dO * O) */
  u64 sem;                  /* deterministic backward: int [B][H][m_tiles], zeroed; dynamic
                               Hopper forward: u32, the next tile, zeroed */
  i64 rows_q, rows_k;       /* rows of all sequences */
  i64 wl, wr;               /* windows; -1 unbounded */
  int B, H, Hk, group;      /* group = H / Hk */
  int seqlen_q, seqlen_k;   /* batched: Sq, Sk; varlen: the longest */
  int m_tiles;              /* backward, persistent forward: query tiles per (sequence, head) */
  int deterministic;
  int D;
  int pad;
  float scale, scale_log2;  /* softmax scale; scale * log2(e) */
#ifdef ATTN_MODS
  u64 alibi, sinks;         /* f32 [H]; 0 when the call has none */
  u64 dsinks;               /* backward: f32 [H], written by attn_bwd_dsink */
  float softcap;            /* > 0 in ATTN_SOFTCAP variants */
  int pad_mods;
#endif
} attn_params;

static_assert(sizeof(attn_tensor) == 32, "attn_tensor must match smelt__attn_ktensor");
#ifdef ATTN_MODS
static_assert(sizeof(attn_params) == 448, "attn_params must match smelt__attn_kparams");
#else
static_assert(sizeof(attn_params) == 416, "attn_params must match smelt__attn_kparams");
#endif

/* One sequence: its first global row and its length, queries and keys. */
typedef struct attn_seq {
  i64 qrow, krow;
  int sq, sk;
} attn_seq;

static __device__ __forceinline__ i64 attn_clamp(i64 v, i64 lo, i64 hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Varlen offsets are clamped into the tensors and lengths to the longest
 * sequence: bad cu_seqlens give wrong results, never stray accesses. */
static __device__ __forceinline__ void attn_locate(const attn_params &P, int b, attn_seq &s) {
  if (P.cu_q) {
    const int *cq = (const int *)P.cu_q, *ck = (const int *)P.cu_k;
    const i64 q0 = attn_clamp(cq[b], 0, P.rows_q), q1 = attn_clamp(cq[b + 1], q0, P.rows_q);
    const i64 k0 = attn_clamp(ck[b], 0, P.rows_k), k1 = attn_clamp(ck[b + 1], k0, P.rows_k);
    s.qrow = q0;
    s.krow = k0;
    s.sq = (int)(q1 - q0 < P.seqlen_q ? q1 - q0 : P.seqlen_q);
    s.sk = (int)(k1 - k0 < P.seqlen_k ? k1 - k0 : P.seqlen_k);
  } else {
    s.qrow = (i64)b * P.seqlen_q;
    s.krow = (i64)b * P.seqlen_k;
    s.sq = P.seqlen_q;
    s.sk = P.seqlen_k;
  }
}

/* Element offset of row 0 of head h of sequence b in t (q rows or k rows). */
static __device__ __forceinline__ i64 attn_base(const attn_params &P, const attn_tensor &t, int b, i64 row0, int h) {
  return (P.cu_q ? row0 * t.rs : (i64)b * t.bs) + (i64)h * t.hs;
}

/* The keys query i may see, [*lo, *hi], clamped to [0, sk] and [-1, sk - 1]. */
static __device__ __forceinline__ void attn_key_range(const attn_params &P, int sq, int sk, i64 i, int *lo, int *hi) {
  const i64 diag = i + sk - sq;
  const i64 l = P.wl < 0 || diag - P.wl < 0 ? 0 : diag - P.wl;
  const i64 h = P.wr < 0 || diag + P.wr > sk - 1 ? sk - 1 : diag + P.wr;
  *lo = (int)(l > sk ? sk : l);
  *hi = (int)(h < -1 ? -1 : h);
}

/* The tiles of bn keys that queries r0..r1 (r1 < sq) see: [*n0, *n1). */
static __device__ __forceinline__ void attn_key_tiles(const attn_params &P, int sq, int sk, int r0, int r1, int bn,
                                                      int *n0, int *n1) {
  int lo0, hi0, lo1, hi1;
  attn_key_range(P, sq, sk, r0, &lo0, &hi0);
  attn_key_range(P, sq, sk, r1, &lo1, &hi1);
  *n0 = lo0 / bn;
  *n1 = hi1 < lo0 ? *n0 : hi1 / bn + 1;
}

/* 2^x in one instruction (ex2.approx: 2 ulp; -inf gives +0). */
static __device__ __forceinline__ float attn_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* ---------------------------------------------------------------- online softmax */

/* One thread's two rows of a tile of S in the mma accumulator layout, which
 * wgmma's accumulators share: entry e of n8 group nt is row e / 2, key
 * c0 + 8 nt + 2 t4 + e % 2. */
typedef struct attn_rows {
  int lo_last, hi_first; /* every row of the block sees keys [lo_last, hi_first] */
  int lo[2], hi[2];      /* this thread's rows' keys */
  int t4;
} attn_rows;

/* The online softmax step on one tile of S (ns n8 groups, keys c0..): masks,
 * updates each row's running max (mx) and sum, leaves P = 2^(scale·log2e·S
 * - ref) in s and the rescale factors of O (and of the sum) in alpha.
 *
 * The max is taken on unscaled scores and the scale folded into one FFMA
 * per exponent: with c = |scale·log2e| and m the row max of sgn·S (sgn the
 * scale's sign), p = 2^(fma(sgn·s, c, -m·c)), as exact as scaling first.
 * Tiles no mask cuts skip the first pass when the scale is positive; the
 * others (and a negative scale) pay one FMUL per element there, masked
 * entries becoming -inf. A row's reference is 0 while it has seen only
 * masked keys, which keeps 2^(-inf - ref) = 0 and never forms inf - inf.
 * mx is in units of sgn·S: the row's log2-sum-exp is mx·c + log2(sum).
 * ns is a compile-time constant at every call. */
static __device__ __forceinline__ void attn_softmax(float (*s)[4], int ns, int c0, const attn_rows &R,
                                                    float scale_log2, float *mx, float *sum, float *alpha) {
  const float c = fabsf(scale_log2);
  if (!(scale_log2 > 0.f && c0 >= R.lo_last && c0 + 8 * ns - 1 <= R.hi_first)) {
    const float sgn = scale_log2 > 0.f ? 1.f : -1.f;
#pragma unroll
    for (int nt = 0; nt < ns; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int key = c0 + nt * 8 + 2 * R.t4 + (e & 1);
        s[nt][e] = key < R.lo[e >> 1] || key > R.hi[e >> 1] ? ATTN_NEG_INF : s[nt][e] * sgn;
      }
  }
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float m = mx[r];
#pragma unroll
    for (int nt = 0; nt < ns; nt++) m = fmaxf(m, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float ref = m == ATTN_NEG_INF ? 0.f : m * c;
    alpha[r] = attn_ex2(__fmul_rn(mx[r], c) - ref); /* 1 exactly when the max stays */
    mx[r] = m;
    float ls = sum[r] * alpha[r];
#pragma unroll
    for (int nt = 0; nt < ns; nt++) {
      const float p0 = attn_ex2(fmaf(s[nt][2 * r], c, -ref)), p1 = attn_ex2(fmaf(s[nt][2 * r + 1], c, -ref));
      s[nt][2 * r] = p0;
      s[nt][2 * r + 1] = p1;
      ls += p0 + p1;
    }
    sum[r] = ls;
  }
}

/* P rounded to the input type as the A operand of O += P V, nk k16 steps:
 * the accumulator layout of two n8 groups of S is the A layout of one k16
 * step (mma.sync and wgmma alike), so P never goes through shared memory. */
static __device__ __forceinline__ void attn_pack_p(float (*s)[4], u32 (*pa)[4], int nk) {
#pragma unroll
  for (int kk = 0; kk < nk; kk++) {
    pa[kk][0] = ATTN_PACK(s[2 * kk][0], s[2 * kk][1]);
    pa[kk][1] = ATTN_PACK(s[2 * kk][2], s[2 * kk][3]);
    pa[kk][2] = ATTN_PACK(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[kk][3] = ATTN_PACK(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

/* A row's LSE (natural log) from its attn_softmax state and its whole sum
 * (+inf for a row that saw no key). */
static __device__ __forceinline__ float attn_lse(float mx, float l, float scale_log2) {
  return l > 0.f ? (mx * fabsf(scale_log2) + log2f(l)) * ATTN_LN2 : ATTN_POS_INF;
}

/* ---------------------------------------------------------------- score modifiers */

#ifdef ATTN_MODS
/* One query head's modifiers in the units the kernels keep scores in: raw
 * q·k, the scale applied later (folded into the exponent). The scaled
 * score u = scale·s becomes softcap·tanh(u / softcap) - slope·|dist|,
 * that is s becomes cap_out·tanh(cap_in·s) + alibi·|dist| (cap_in =
 * scale / softcap, cap_out = softcap / scale, alibi = -slope / scale); the
 * sink's logit σ is σ / |scale| in attn_softmax's units of its running max
 * (sgn·S, whose exponent is multiplied by |scale·log2 e|). */
typedef struct attn_mod {
  float cap_in, cap_out, alibi, sink;
} attn_mod;

static __device__ __forceinline__ attn_mod attn_mod_of(const attn_params &P, int h) {
  attn_mod m;
  m.cap_in = m.cap_out = m.alibi = 0.f;
  m.sink = ATTN_NEG_INF;
#ifdef ATTN_SOFTCAP
  m.cap_in = P.scale / P.softcap;
  m.cap_out = P.softcap / P.scale;
#endif
#ifdef ATTN_ALIBI
  m.alibi = -((const float *)P.alibi)[h] / P.scale;
#endif
#ifdef ATTN_SINKS
  if (P.sinks) m.sink = ((const float *)P.sinks)[h] / fabsf(P.scale);
#endif
  return m;
}

/* tanh in one instruction (tanh.approx: 2^-11 relative; FlashAttention's
 * softcap uses it too). */
static __device__ __forceinline__ float attn_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* Raw score s at distance dist = i + sk - sq - j from query i's diagonal,
 * modified; *dsdu = d(modified)/d(unmodified) of the scaled scores (1 -
 * tanh² under softcap, else 1), the factor the backward's dS takes.
 * Distances are exact in f32 up to 2^24. */
static __device__ __forceinline__ float attn_mod_score(float s, float dist, const attn_mod &M, float *dsdu) {
#ifdef ATTN_SOFTCAP
  const float th = attn_tanh(s * M.cap_in);
  s = th * M.cap_out;
  *dsdu = fmaf(-th, th, 1.f);
#else
  *dsdu = 1.f;
#endif
#ifdef ATTN_ALIBI
  s = fmaf(M.alibi, fabsf(dist), s);
#endif
  return s;
}

/* A forward's tile of S (ns n8 groups, keys c0.., the attn_rows layout:
 * entry e of group nt is row e / 2 and key c0 + 8 nt + 2 t4 + e % 2),
 * this thread's rows row0 and row0 + 8 of a sequence of sq queries and sk
 * keys, modified in place before attn_softmax. */
static __device__ __forceinline__ void attn_mod_tile(float (*s)[4], int ns, int c0, int row0, int sq, int sk, int t4,
                                                     const attn_mod &M) {
  const float d0 = (float)((i64)row0 + sk - sq - c0 - 2 * t4);
#pragma unroll
  for (int nt = 0; nt < ns; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      float unused;
      s[nt][e] = attn_mod_score(s[nt][e], d0 + (float)(8 * (e >> 1) - 8 * nt - (e & 1)), M, &unused);
    }
}

/* A backward's tile of Sᵀ (nq n8 groups of queries: entry e of group qt
 * is key row e / 2 and query 8 qt + 2 t4 + e % 2, d0 the distance i + sk
 * - sq - j of key row 0 and query 2 t4), modified in place before Pᵀ.
 * Under softcap dPᵀ becomes D + (dPᵀ - D) f (D of query q at dsum[q]), so
 * that dSᵀ = Pᵀ ∘ (dPᵀ - D), formed as without modifiers, comes out times
 * f = 1 - tanh². */
static __device__ __forceinline__ void attn_mod_tile_bwd(float (*s)[4], float (*dp)[4], int nq, float d0,
                                                         const float *dsum, int t4, const attn_mod &M) {
#pragma unroll
  for (int qt = 0; qt < nq; qt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      float f;
      s[qt][e] = attn_mod_score(s[qt][e], d0 + (float)(8 * qt + (e & 1) - 8 * (e >> 1)), M, &f);
#ifdef ATTN_SOFTCAP
      const float ds = dsum[8 * qt + 2 * t4 + (e & 1)];
      dp[qt][e] = fmaf(dp[qt][e] - ds, f, ds);
#endif
    }
}

#ifdef ATTN_SINKS
/* The sink joins a row's running softmax state (attn_softmax's mx and
 * sum) before its first key tile: the max starts at the sink and the sum
 * at its weight, 1, held by the first thread of the quad (a sink of -inf
 * adds 0: the first tile's rescale is 0). */
static __device__ __forceinline__ void attn_sink_init(const attn_mod &M, int t4, float *mx, float *sum) {
  mx[0] = mx[1] = M.sink;
  sum[0] = sum[1] = t4 == 0 ? 1.f : 0.f;
}

/* A row that saw no key ends as it would without a sink: sum 0, so O = 0
 * and LSE = +inf. */
static __device__ __forceinline__ void attn_sink_end(const attn_rows &R, float *sum) {
#pragma unroll
  for (int r = 0; r < 2; r++)
    if (R.hi[r] < R.lo[r]) sum[r] = 0.f;
}
#endif
#endif /* ATTN_MODS */

/* Shared-memory tiles of 16-bit rows, RB bytes each (a multiple of 128):
 * 16-byte chunk c of row r sits at chunk c ^ (r % 8), so the 8 rows one
 * ldmatrix phase reads fall in 8 different bank groups. */
static __device__ __forceinline__ u32 attn_sw(u32 base, int rb, int r, int c) {
  return base + (u32)(r * rb) + ((u32)(c ^ (r & 7)) << 4);
}

/* ldmatrix addresses in those tiles. Within a 16-row block a lane's row
 * and chunk parity are fixed by the operand pattern, so a load at row block
 * R (a multiple of 8) and chunk C (even) is tile + R * rb + (off ^ (C << 4))
 * with off = attn_sw(0, rb, row, parity): the swizzle's XOR commutes with
 * an even chunk offset, and C << 4 < rb (rows a power of two apart) never
 * reaches the row bits. One LOP per load, instead of one register for every
 * address the compiler would otherwise hoist out of the main loop. */
static __device__ __forceinline__ u32 attn_off_a(int rb, int lane) { /* A, K-contiguous rows */
  return attn_sw(0, rb, lane & 15, lane >> 4);
}
static __device__ __forceinline__ u32 attn_off_b(int rb, int lane) { /* B from n-rows; A transposed */
  return attn_sw(0, rb, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
}
static __device__ __forceinline__ u32 attn_off_t(int rb, int lane) { /* B transposed, from k-rows */
  return attn_sw(0, rb, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
}
static __device__ __forceinline__ u32 attn_at(u32 tile, int rb, u32 off, int r, int c) {
  return tile + (u32)(r * rb) + (off ^ ((u32)c << 4));
}
/* Hides v's value from the optimizer, so that what is computed from it is
 * not hoisted out of the loop this sits in. */
#define ATTN_OPAQUE(v) asm volatile("" : "+r"(v))

/* A row's sum over the 4 threads of its quad (the lanes that hold its
 * columns in the mma layout). */
static __device__ __forceinline__ float attn_quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

/* d[0] += a b[0..1], d[1] += a b[2..3]: one A fragment against the two
 * n8 B fragments of an ldmatrix.x4. */
static __device__ __forceinline__ void attn_mma2(float (*d)[4], const u32 *a, const u32 *b) {
  ATTN_MMA(d[0], a, b);
  ATTN_MMA(d[1], a, b + 2);
}

/* O's rows scaled by their softmax corrections (alpha[0] for row g, [1]
 * for g + 8), n n8 tiles. */
static __device__ __forceinline__ void attn_rescale(float (*o)[4], int n, const float *alpha) {
#pragma unroll
  for (int i = 0; i < n; i++) {
    o[i][0] *= alpha[0];
    o[i][1] *= alpha[0];
    o[i][2] *= alpha[1];
    o[i][3] *= alpha[1];
  }
}

/* rows x (ch 16-byte chunks) from row r0 of a view (row stride rs
 * elements) into the swizzled tile at s (rb bytes a row) by nt threads;
 * rows at or past nvalid read as zeros (the Ampere kernels' cp.async loads). */
static __device__ __forceinline__ void attn_load_tile(u32 s, const elem_t *g, i64 rs, int r0, int nvalid, int rows,
                                                      int tid, int rb, int ch, int nt) {
#pragma unroll
  for (int c = tid; c < rows * ch; c += nt) {
    const int r = c / ch, k = c % ch;
    const bool ok = r0 + r < nvalid;
    cp_async16(attn_sw(s, rb, r, k), ok ? g + (i64)(r0 + r) * rs + k * 8 : g, ok ? 16 : 0);
  }
}

#endif /* SMELT_ATTN_COMMON_CUH */
