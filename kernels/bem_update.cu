/* The fused BEM update y (+)= s·((x·V)∘codes)·Uᵀ (smelt/bem.h) in one
 * kernel: H never reaches global memory.
 *
 * A CTA owns BM rows of one adapter. 16-bit types (bem_update_mma, 8
 * warps, BM 128, each warp 16 rows): x and V stream through a cp.async
 * ring of BK-wide stages into shared memory and meet on mma.sync m16n8k16
 * with f32 accumulators; A = x·V stays in registers, where the accumulator
 * layout of m16n8 is the A-operand layout of the next m16n8k16, so
 * H = s·A∘codes becomes the second product's A fragments without leaving
 * the registers (codes are read in that layout, a few bytes a row). Then
 * the CTA walks d_out in BN-wide tiles of U (double-buffered), each warp
 * multiplies its H fragments by the tile, stages the f32 result in its own
 * slice of shared memory and writes y rows with 16-byte stores (adding the
 * old y first when accumulating: ΔY is rounded once, after the addition).
 * x is read once, y written once; V and U come from L2.
 *
 * The rank is padded to RP (a multiple of 16) with zeros in shared memory;
 * every tail (rows, d_in, d_out, rank) is masked or zero-filled, so
 * padding lanes never multiply a stray value. Layouts: x, codes and y rows
 * of unit column stride; 16-byte paths where the host found the rows
 * aligned (x_vec, y_vec), element paths otherwise. V and U take any
 * strides: cp.async along whichever dim is contiguous in 16-byte runs,
 * kept in shared memory in that orientation (V [rank][k] or [k][rank],
 * U [n][rank] or [rank][n]; the transposed tiles' B fragments are built
 * from 16-bit reads), element loads for any other strides.
 *
 * f32 (bem_update_fma): the same structure with FMA on BM = 32 rows, H in
 * shared memory; not a bandwidth path.
 *
 * Segments: the host launches ceil(M / BM) + A + 2 CTAs without reading
 * the offsets. Each CTA's warps scan them (bem_find_tile) and split the
 * row range at segment boundaries: the CTA's rows lie in one segment, so
 * it uses one adapter; CTAs past the last tile exit. Rows before the first
 * segment or after the last form two segments of their own without an
 * adapter, which write zeros (or nothing when accumulating). */
#include "smelt_mma.cuh"

typedef struct bem_params {
  u64 x, v, codes, u, offs, scales, y;
  i64 M, din, dout;
  i64 x_rs, codes_rs, y_rs;
  i64 v_a, v_k, v_j; /* V strides: adapter, d_in, rank */
  i64 u_a, u_n, u_j; /* U strides: adapter, d_out, rank */
  i64 scales_s, offs_s;
  float scale;
  int r, A, segs, offs64, accumulate;
  int x_vec, y_vec, v_vec, u_vec, v_t, u_t;
} bem_params;

/* ---------------------------------------------------------------- segments */

static __device__ __forceinline__ i64 bem_offset_at(const bem_params &P, int k) {
  const i64 i = (i64)k * P.offs_s;
  return P.offs64 ? ((const i64 *)P.offs)[i] : (i64)((const int *)P.offs)[i];
}

/* The inclusive prefix over the warp's lanes: maximum (max 1) or sum. */
static __device__ __forceinline__ i64 bem_scan(i64 v, int max) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const i64 o = __shfl_up_sync(0xffffffffu, v, d);
    if ((threadIdx.x & 31) >= d) v = max ? (o > v ? o : v) : v + o;
  }
  return v;
}

/* This CTA's rows [*r0, *r1) and adapter (-1: rows of no adapter), or 0
 * when the CTA has no tile. Segment k of the A + 2 ends at e_k: the
 * clamped running maximum of offsets[0..k] for k <= A, then M; it starts
 * where segment k - 1 ends (0 for k = 0) and belongs to adapter k - 1
 * when 1 <= k <= A. Every warp computes the same answer with shuffles, 32
 * segments at a time. */
static __device__ int bem_find_tile(const bem_params &P, i64 tile, i64 *r0, i64 *r1, int *adapter) {
  if (!P.segs) {
    *r0 = tile * SMELT_BM;
    *r1 = *r0 + SMELT_BM < P.M ? *r0 + SMELT_BM : P.M;
    *adapter = 0;
    return 1;
  }
  const unsigned full = 0xffffffffu;
  const int lane = threadIdx.x & 31, nseg = P.A + 2;
  i64 end = 0, tiles = 0; /* the end and the tile count of the segments before this chunk */
  for (int base = 0; base < nseg; base += 32) {
    const int k = base + lane;
    i64 e = k <= P.A ? bem_offset_at(P, k) : P.M;
    e = bem_scan(e < end ? end : e > P.M ? P.M : e, 1);
    i64 s = __shfl_up_sync(full, e, 1);
    if (lane == 0) s = end;
    const i64 n = k < nseg ? (e - s + SMELT_BM - 1) / SMELT_BM : 0;
    const i64 c = bem_scan(n, 0), first = tiles + c - n;
    const unsigned hit = __ballot_sync(full, tile >= first && tile < first + n);
    if (hit) {
      const int src = __ffs(hit) - 1, seg = base + src;
      const i64 s0 = __shfl_sync(full, s, src), e0 = __shfl_sync(full, e, src);
      *r0 = s0 + (tile - __shfl_sync(full, first, src)) * SMELT_BM;
      *r1 = *r0 + SMELT_BM < e0 ? *r0 + SMELT_BM : e0;
      *adapter = seg >= 1 && seg <= P.A ? seg - 1 : -1;
      return 1;
    }
    end = __shfl_sync(full, e, 31);
    tiles += __shfl_sync(full, c, 31);
  }
  return 0;
}

/* Adapter a's scale. */
static __device__ __forceinline__ float bem_scale(const bem_params &P, int a) {
  return P.scales ? P.scale * ((const float *)P.scales)[(i64)a * P.scales_s] : P.scale;
}

#if SMELT_DT != SMELT_DT_F32
/* ---------------------------------------------------------------- 16-bit: tensor cores */

/* The host's tile config (src/cuda/op_bem.c sizes the shared memory from it). */
#define NT 256
#define BK SMELT_BK
#define STAGES SMELT_STAGES
#define BN SMELT_BN
#define TB SMELT_TB /* phase 2's ring of U (and old-y) tiles */
#if SMELT_BM != 16 * (NT / 32) || BK % 16 || BN % 16 || SMELT_RP % 16 || STAGES < 2 || TB < 2
#error "bem_update_mma: each warp owns 16 rows, tiles are whole mma steps, rings hold two or more"
#endif
#define XP (BK + 8)     /* x and V stage pitch (elements): 16-byte rows, conflict-free fragment reads */
#define UP (SMELT_RP + 8) /* U tile pitch */
#define WP (BN + 8)     /* f32 staging pitch: 64-bit stores of a half-warp hit distinct banks */
#define NR (SMELT_RP / 8)  /* n8 tiles of the rank */
#define KR (SMELT_RP / 16) /* k16 steps of the rank */

/* V's stage and a U tile hold [RP][BK + 8] and [BN][RP + 8], or their
 * transposes [BK][RP + 8] and [RP][BN + 8] (v_t, u_t), whichever is larger. */
#define MAXI(a, b) ((a) > (b) ? (a) : (b))
#define VB MAXI(SMELT_RP * XP, BK * UP)
#define UB MAXI(BN * UP, SMELT_RP * WP)
#define STAGE_ELEMS (SMELT_BM * XP + VB)

/* Two 16-bit elements (one mma fragment register) from shared memory. */
static __device__ __forceinline__ u32 ld_pair(const smelt_h16 *p) { return *(const u32 *)p; }

/* The mma and the pair packing of the input type. */
#if SMELT_DT == SMELT_DT_F16
#define bem_mma mma_16816_f16
#define bem_pack pack_f16x2
#else
#define bem_mma mma_16816_bf16
#define bem_pack pack_bf16x2
#endif

/* The B fragment (rank or output column n, k..k+1 and k+8..k+9) of a
 * tile stored [n][k] (pitch elements a row), or [k][n] when trans. */
static __device__ __forceinline__ void bem_bfrag(const smelt_h16 *s, int trans, int pitch, int n, int k, u32 *b) {
  if (!trans) {
    b[0] = ld_pair(s + n * pitch + k);
    b[1] = ld_pair(s + n * pitch + k + 8);
  } else {
    const smelt_h16 *p = s + k * pitch + n;
    b[0] = (u32)p[0] | ((u32)p[pitch] << 16);
    b[1] = (u32)p[8 * pitch] | ((u32)p[9 * pitch] << 16);
  }
}

/* 8 elements from p with element stride `step`, the first n valid (the rest 0). */
static __device__ __forceinline__ uint4 bem_gather8(const smelt_h16 *p, i64 step, int n) {
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const u32 lo = 2 * i < n ? p[(2 * i) * step] : 0, hi = 2 * i + 1 < n ? p[(2 * i + 1) * step] : 0;
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/* Rows [r0, r1) x columns [c0, c0 + 8·w8) of a matrix of unit column
 * stride (row stride rs, `cols` columns) into s [BM][pitch], zeros
 * outside: cp.async where the rows allow 16-byte copies (vec), element
 * loads otherwise. */
static __device__ __forceinline__ void bem_load_rows(const smelt_h16 *base, i64 rs, i64 r0, i64 r1, i64 c0, i64 cols,
                                                     int w8, int pitch, int vec, smelt_h16 *s) {
#pragma unroll 4
  for (int id = threadIdx.x; id < SMELT_BM * w8; id += NT) {
    const int row = id / w8, c = (id % w8) * 8;
    const i64 gr = r0 + row, gc = c0 + c;
    const int n = gr < r1 && gc < cols ? (int)(cols - gc < 8 ? cols - gc : 8) : 0;
    const smelt_h16 *src = n ? base + gr * rs + gc : base;
    if (vec) cp_async16(smem_u32(s + row * pitch + c), src, 2 * n);
    else *(uint4 *)(s + row * pitch + c) = bem_gather8(src, 1, n);
  }
}

/* One stage: x rows [r0, r1) x cols [k0, k0 + BK) into xs [BM][XP], and
 * V's [k0, k0 + BK) x [0, r) transposed into vs [RP][XP]; zeros outside. */
static __device__ __forceinline__ void bem_load_stage(const bem_params &P, const smelt_h16 *v, i64 r0, i64 r1, i64 k0,
                                                      smelt_h16 *xs, smelt_h16 *vs) {
  bem_load_rows((const smelt_h16 *)P.x, P.x_rs, r0, r1, k0, P.din, BK / 8, XP, P.x_vec, xs);
  if (P.v_t) { /* rank-contiguous V: [BK][RP + 8] */
    for (int id = threadIdx.x; id < BK * (SMELT_RP / 8); id += NT) {
      const int kk = id / (SMELT_RP / 8), c = (id % (SMELT_RP / 8)) * 8;
      const i64 gk = k0 + kk;
      const int n = gk < P.din && c < P.r ? (P.r - c < 8 ? P.r - c : 8) : 0;
      cp_async16(smem_u32(vs + kk * UP + c), n ? v + gk * P.v_k + c : v, 2 * n);
    }
    return;
  }
  for (int id = threadIdx.x; id < SMELT_RP * (BK / 8); id += NT) {
    /* cp.async reads 8 consecutive k of one rank column; the element path
     * lets neighbouring threads read neighbouring rank columns. */
    const int j = P.v_vec ? id / (BK / 8) : id % SMELT_RP, c = (P.v_vec ? id % (BK / 8) : id / SMELT_RP) * 8;
    const i64 gk = k0 + c;
    const int n = j < P.r && gk < P.din ? (int)(P.din - gk < 8 ? P.din - gk : 8) : 0;
    const smelt_h16 *src = n ? v + gk * P.v_k + j * P.v_j : v;
    if (P.v_vec) cp_async16(smem_u32(vs + j * XP + c), src, 2 * n);
    else *(uint4 *)(vs + j * XP + c) = bem_gather8(src, P.v_k, n);
  }
}

/* U rows [n0, n0 + BN) x rank [0, r) into us [BN][UP], or [RP][WP] for
 * column-contiguous U (u_t, the pre-transposed layout); zeros outside. */
static __device__ __forceinline__ void bem_load_u(const bem_params &P, const smelt_h16 *u, i64 n0, smelt_h16 *us) {
  if (P.u_t) {
    for (int id = threadIdx.x; id < SMELT_RP * (BN / 8); id += NT) {
      const int j = id / (BN / 8), c = (id % (BN / 8)) * 8;
      const i64 gn = n0 + c;
      const int n = j < P.r && gn < P.dout ? (int)(P.dout - gn < 8 ? P.dout - gn : 8) : 0;
      cp_async16(smem_u32(us + j * WP + c), n ? u + gn + j * P.u_j : u, 2 * n);
    }
    return;
  }
  for (int id = threadIdx.x; id < BN * (SMELT_RP / 8); id += NT) {
    const int row = P.u_vec ? id / (SMELT_RP / 8) : id % BN, c = (P.u_vec ? id % (SMELT_RP / 8) : id / BN) * 8;
    const i64 gn = n0 + row;
    const int n = gn < P.dout && c < P.r ? (P.r - c < 8 ? P.r - c : 8) : 0;
    const smelt_h16 *src = n ? u + gn * P.u_n + c * P.u_j : u;
    if (P.u_vec) cp_async16(smem_u32(us + row * UP + c), src, 2 * n);
    else *(uint4 *)(us + row * UP + c) = bem_gather8(src, P.u_j, n);
  }
}

/* acc [NR][4] += x rows · V over all of d_in (the warp's 16 rows). */
static __device__ __forceinline__ void bem_xv(const bem_params &P, const smelt_h16 *v, i64 r0, i64 r1, smelt_h16 *sm,
                                              float (*acc)[4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane / 4, t = lane % 4;
  const int nk = (int)((P.din + BK - 1) / BK);
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < nk) bem_load_stage(P, v, r0, r1, (i64)s * BK, sm + s * STAGE_ELEMS, sm + s * STAGE_ELEMS + SMELT_BM * XP);
    cp_async_commit();
  }
  for (int kt = 0; kt < nk; kt++) {
    CP_ASYNC_WAIT(STAGES - 2);
    __syncthreads();
    const int pf = kt + STAGES - 1; /* its buffer was read in step kt - 1, which every thread has left */
    if (pf < nk) {
      smelt_h16 *st = sm + (pf % STAGES) * STAGE_ELEMS;
      bem_load_stage(P, v, r0, r1, (i64)pf * BK, st, st + SMELT_BM * XP);
    }
    cp_async_commit();
    const smelt_h16 *xs = sm + (kt % STAGES) * STAGE_ELEMS + warp * 16 * XP, *vs = sm + (kt % STAGES) * STAGE_ELEMS + SMELT_BM * XP;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      u32 a[4];
      a[0] = ld_pair(xs + g * XP + kk + 2 * t);
      a[1] = ld_pair(xs + (g + 8) * XP + kk + 2 * t);
      a[2] = ld_pair(xs + g * XP + kk + 2 * t + 8);
      a[3] = ld_pair(xs + (g + 8) * XP + kk + 2 * t + 8);
#pragma unroll
      for (int j = 0; j < NR; j++) {
        u32 b[2];
        bem_bfrag(vs, P.v_t, P.v_t ? UP : XP, j * 8 + g, kk + 2 * t, b);
        bem_mma(acc[j], a, b);
      }
    }
  }
  CP_ASYNC_WAIT(0);
  __syncthreads(); /* the stages are free: phase 2 reuses the memory */
}

static __device__ __forceinline__ float bem_codes(const bem_params &P, i64 row, i64 r1, int j) {
  return row < r1 && j < P.r ? load_elem(((const smelt_h16 *)P.codes)[row * P.codes_rs + j]) : 0.f;
}

/* The warp's 16 rows of y from its f32 staging ws [16][WP] (columns
 * [n0, n0 + BN)), plus the old y from yo [16][WP] when accumulating:
 * 16-byte stores where the row is aligned and whole. */
static __device__ __forceinline__ void bem_store_rows(const bem_params &P, i64 rw, i64 r1, i64 n0, const float *ws,
                                                      const smelt_h16 *yo) {
  smelt_h16 *y = (smelt_h16 *)P.y;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int it = 0; it < 16 * (BN / 8) / 32; it++) {
    const int id = it * 32 + lane, row = id / (BN / 8), c = (id % (BN / 8)) * 8;
    const i64 gr = rw + row, gn = n0 + c;
    if (gr >= r1 || gn >= P.dout) continue;
    const int n = P.dout - gn < 8 ? (int)(P.dout - gn) : 8;
    float f[8];
    *(float4 *)f = *(const float4 *)(ws + row * WP + c);
    *(float4 *)(f + 4) = *(const float4 *)(ws + row * WP + c + 4);
    if (P.accumulate) {
      const uint4 old = *(const uint4 *)(yo + row * WP + c);
      const u32 o[4] = {old.x, old.y, old.z, old.w};
#pragma unroll
      for (int i = 0; i < 4; i++) {
        f[2 * i] += load_elem((smelt_h16)(o[i] & 0xffffu));
        f[2 * i + 1] += load_elem((smelt_h16)(o[i] >> 16));
      }
    }
    smelt_h16 *dst = y + gr * P.y_rs + gn;
    if (P.y_vec && n == 8) {
      *(uint4 *)dst = make_uint4(bem_pack(f[0], f[1]), bem_pack(f[2], f[3]), bem_pack(f[4], f[5]), bem_pack(f[6], f[7]));
    } else {
#pragma unroll
      for (int i = 0; i < 8; i++)
        if (i < n) dst[i] = store_elem(f[i]);
    }
  }
}

/* The next d_out tile's U and, when accumulating, the old y of the CTA's rows. */
static __device__ __forceinline__ void bem_load_tile(const bem_params &P, const smelt_h16 *u, i64 r0, i64 r1, i64 n0,
                                                     smelt_h16 *us, smelt_h16 *yo) {
  bem_load_u(P, u, n0, us);
  if (P.accumulate) bem_load_rows((const smelt_h16 *)P.y, P.y_rs, r0, r1, n0, P.dout, BN / 8, WP, P.y_vec, yo);
}

extern "C" __global__ void __launch_bounds__(NT, SMELT_RP <= 64 ? 2 : 1) bem_update_mma(bem_params P) {
  extern __shared__ __align__(16) unsigned char bem_smem[];
  smelt_h16 *sm = (smelt_h16 *)bem_smem;
  i64 r0, r1;
  int adapter;
  if (!bem_find_tile(P, blockIdx.x, &r0, &r1, &adapter) || r0 >= r1) return;
  if (adapter < 0 && P.accumulate) return; /* rows of no adapter: y stays */
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane / 4, t = lane % 4;
  const int a = adapter < 0 ? 0 : adapter;
  const smelt_h16 *v = (const smelt_h16 *)P.v + (i64)a * P.v_a, *u = (const smelt_h16 *)P.u + (i64)a * P.u_a;

  /* H fragments: s·(x·V)∘codes for the warp's rows, rank-padded with zeros. */
  u32 hf[KR][4];
  {
    float acc[NR][4];
#pragma unroll
    for (int j = 0; j < NR; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    if (adapter >= 0) bem_xv(P, v, r0, r1, sm, acc);
    const float s = adapter >= 0 ? bem_scale(P, adapter) : 0.f;
    const i64 ra = r0 + warp * 16 + g, rb = ra + 8;
#pragma unroll
    for (int j = 0; j < NR; j++) {
      const int c = j * 8 + 2 * t;
      acc[j][0] *= s * bem_codes(P, ra, r1, c);
      acc[j][1] *= s * bem_codes(P, ra, r1, c + 1);
      acc[j][2] *= s * bem_codes(P, rb, r1, c);
      acc[j][3] *= s * bem_codes(P, rb, r1, c + 1);
    }
#pragma unroll
    for (int kc = 0; kc < KR; kc++) {
      hf[kc][0] = bem_pack(acc[2 * kc][0], acc[2 * kc][1]);
      hf[kc][1] = bem_pack(acc[2 * kc][2], acc[2 * kc][3]);
      hf[kc][2] = bem_pack(acc[2 * kc + 1][0], acc[2 * kc + 1][1]);
      hf[kc][3] = bem_pack(acc[2 * kc + 1][2], acc[2 * kc + 1][3]);
    }
  }

  /* ΔY tile by tile over d_out, U (and the old y) through a ring of TB
   * buffers like phase 1's. Phase 2's memory: TB U tiles of UB, the
   * warps' f32 staging [16][WP] each, TB old-y tiles [BM][WP] when
   * accumulating (src/cuda/op_bem.c sizes it). */
  smelt_h16 *us = sm;
  float *ws = (float *)(bem_smem + TB * UB * 2) + warp * 16 * WP;
  smelt_h16 *yo = (smelt_h16 *)(bem_smem + TB * UB * 2 + (NT / 32) * 16 * WP * 4);
  const int nn = (int)((P.dout + BN - 1) / BN);
#pragma unroll
  for (int b = 0; b < TB - 1; b++) {
    if (b < nn) bem_load_tile(P, u, r0, r1, (i64)b * BN, us + b * UB, yo + b * SMELT_BM * WP);
    cp_async_commit();
  }
  for (int nt = 0; nt < nn; nt++) {
    CP_ASYNC_WAIT(TB - 2);
    __syncthreads(); /* tile nt is in; every warp is done with step nt - 1's buffers and its staging */
    const int pf = nt + TB - 1;
    if (pf < nn) bem_load_tile(P, u, r0, r1, (i64)pf * BN, us + (pf % TB) * UB, yo + (pf % TB) * SMELT_BM * WP);
    cp_async_commit();
    const smelt_h16 *ut = us + (nt % TB) * UB;
    float acc[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    if (adapter >= 0) {
#pragma unroll
      for (int kc = 0; kc < KR; kc++)
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
          u32 b[2];
          bem_bfrag(ut, P.u_t, P.u_t ? WP : UP, j * 8 + g, kc * 16 + 2 * t, b);
          bem_mma(acc[j], hf[kc], b);
        }
    }
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
      *(float2 *)(ws + g * WP + j * 8 + 2 * t) = make_float2(acc[j][0], acc[j][1]);
      *(float2 *)(ws + (g + 8) * WP + j * 8 + 2 * t) = make_float2(acc[j][2], acc[j][3]);
    }
    __syncwarp();
    bem_store_rows(P, r0 + warp * 16, r1, (i64)nt * BN, ws, yo + (nt % TB) * SMELT_BM * WP + warp * 16 * WP);
  }
}

#else
/* ---------------------------------------------------------------- f32: FMA */

#define NT 256
#define BKF 16
#define BNF 32
#define RPF (SMELT_RP + 1) /* pitch of the H and U tiles */

extern "C" __global__ void __launch_bounds__(NT) bem_update_fma(bem_params P) {
  __shared__ float xs[SMELT_BM][BKF + 1];
  __shared__ float vs[BKF][SMELT_RP];
  __shared__ float hs[SMELT_BM][RPF];
  __shared__ float us[BNF][RPF];
  i64 r0, r1;
  int adapter;
  if (!bem_find_tile(P, blockIdx.x, &r0, &r1, &adapter) || r0 >= r1) return;
  if (adapter < 0 && P.accumulate) return;
  const int a = adapter < 0 ? 0 : adapter;
  const float *x = (const float *)P.x, *codes = (const float *)P.codes;
  const float *v = (const float *)P.v + (i64)a * P.v_a, *u = (const float *)P.u + (i64)a * P.u_a;
  float *y = (float *)P.y;
  /* Thread (row, lane8) owns rank columns lane8, lane8 + 8, ... of one row. */
  const int row = threadIdx.x / 8, c8 = threadIdx.x % 8;
  float acc[SMELT_RP / 8];
#pragma unroll
  for (int i = 0; i < SMELT_RP / 8; i++) acc[i] = 0.f;
  for (i64 k0 = 0; adapter >= 0 && k0 < P.din; k0 += BKF) {
    __syncthreads();
    for (int id = threadIdx.x; id < SMELT_BM * BKF; id += NT) {
      const int rr = id / BKF, kk = id % BKF;
      const i64 gr = r0 + rr, gk = k0 + kk;
      xs[rr][kk] = gr < r1 && gk < P.din ? x[gr * P.x_rs + gk] : 0.f;
    }
    for (int id = threadIdx.x; id < BKF * SMELT_RP; id += NT) {
      const int kk = id / SMELT_RP, j = id % SMELT_RP;
      const i64 gk = k0 + kk;
      vs[kk][j] = gk < P.din && j < P.r ? v[gk * P.v_k + j * P.v_j] : 0.f;
    }
    __syncthreads();
    for (int kk = 0; kk < BKF; kk++) {
      const float xv = xs[row][kk];
#pragma unroll
      for (int i = 0; i < SMELT_RP / 8; i++) acc[i] += xv * vs[kk][c8 + 8 * i];
    }
  }
  const float s = adapter >= 0 ? bem_scale(P, adapter) : 0.f;
  const i64 gr = r0 + row;
#pragma unroll
  for (int i = 0; i < SMELT_RP / 8; i++) {
    const int j = c8 + 8 * i;
    hs[row][j] = gr < r1 && j < P.r ? s * acc[i] * codes[gr * P.codes_rs + j] : 0.f;
  }
  for (i64 n0 = 0; n0 < P.dout; n0 += BNF) {
    __syncthreads();
    for (int id = threadIdx.x; id < BNF * SMELT_RP; id += NT) {
      const int nn = id / SMELT_RP, j = id % SMELT_RP;
      const i64 gn = n0 + nn;
      us[nn][j] = gn < P.dout && j < P.r ? u[gn * P.u_n + j * P.u_j] : 0.f;
    }
    __syncthreads();
    if (gr >= r1) continue;
    for (int i = 0; i < BNF / 8; i++) {
      const int nn = c8 + 8 * i;
      const i64 gn = n0 + nn;
      if (gn >= P.dout) continue;
      float d = 0.f;
      for (int j = 0; adapter >= 0 && j < P.r; j++) d += hs[row][j] * us[nn][j];
      float *dst = y + gr * P.y_rs + gn;
      *dst = P.accumulate ? *dst + d : d;
    }
  }
}
#endif
