/* The attention backward's two small kernels, around attn_bwd
 * (kernels/attn_bwd_sm80.cu).
 *
 * Prelude: SMELT_DT (2 f16, 3 bf16); ATTN_SINKS 1 adds attn_bwd_dsink.
 *
 *   attn_bwd_pre  per (query row r of all sequences, head h):
 *                   dsum_ws[h][r] = Σ_d dO ∘ O  (f32, from the 16-bit inputs)
 *                   lse_ws[h][r]  = LSE · log2(e) (+inf stays +inf)
 *                   dq_acc[r][h][:] = 0
 *   attn_bwd_dq   dq[r][h][:] = scale · dq_acc[r][h][:], rounded to the dtype.
 *   attn_bwd_dsink  dsinks[h] = -Σ_r 2^(σ_h log2 e - lse_ws[h][r]) dsum_ws[h][r]
 *                 (after attn_bwd_pre; one block per head, in a fixed order,
 *                 so it is bitwise repeatable in every mode).
 * Half a warp per (row, head), eight elements per lane per step in
 * 16-byte accesses (two per lane in 4-byte ones where a row is not 16-byte
 * aligned or D is not a multiple of 8): these are bound by memory (O, dO
 * and dq_acc's zeros, then dq_acc and dq), and wide accesses move more
 * bytes per instruction in flight. Rows are global (see attn_common.cuh),
 * so varlen needs no sequence lookup: batched row r is sequence r / Sq,
 * row r % Sq.
 */
#include "attn_common.cuh"

#define NT 256

/* Element offset of global row r, head h in t (D has unit stride). */
static __device__ __forceinline__ i64 row_off(const attn_params &P, const attn_tensor &t, i64 r, int h) {
  if (P.cu_q) return r * t.rs + (i64)h * t.hs;
  return (r / P.seqlen_q) * t.bs + (r % P.seqlen_q) * t.rs + (i64)h * t.hs;
}

static __device__ __forceinline__ float2 load2(const elem_t *p) {
  const u32 w = *(const u32 *)p;
  return make_float2(load_elem((elem_t)(w & 0xffffu)), load_elem((elem_t)(w >> 16)));
}

/* Σ over the 16 lanes of a half warp. */
static __device__ __forceinline__ float half_warp_sum(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

static __device__ __forceinline__ bool aligned16(const void *a, const void *b) {
  return (((unsigned long long)a | (unsigned long long)b) & 15) == 0;
}

/* (row, head) pairs: half warp hw of global warp gw takes pair 2 gw + hw,
 * then every 2 x (warps in the grid)-th. */
static __device__ __forceinline__ i64 first_pair() {
  return 2 * (((i64)blockIdx.x * NT + threadIdx.x) >> 5) + ((threadIdx.x >> 4) & 1);
}
static __device__ __forceinline__ i64 pair_stride() { return 2 * (i64)gridDim.x * (NT / 32); }

extern "C" __global__ void __launch_bounds__(NT) attn_bwd_pre(const attn_params P) {
  const i64 total = P.rows_q * P.H;
  const int hl = threadIdx.x & 15;
  /* The bound is the warp's first pair, so both halves run every
   * iteration (the shuffles need the whole warp). */
  for (i64 w = first_pair(); w - ((threadIdx.x >> 4) & 1) < total; w += pair_stride()) {
    const bool ok = w < total;
    const i64 r = ok ? w / P.H : 0;
    const int h = ok ? (int)(w % P.H) : 0;
    const elem_t *o = (const elem_t *)P.o.p + row_off(P, P.o, r, h);
    const elem_t *d_o = (const elem_t *)P.d_o.p + row_off(P, P.d_o, r, h);
    float *acc = (float *)P.dq_acc + (r * P.H + h) * P.D;
    float s = 0.f;
    if (ok && P.D % 8 == 0 && aligned16(o, d_o)) {
      for (int d = 8 * hl; d < P.D; d += 128) {
        const uint4 a = *(const uint4 *)(o + d), b = *(const uint4 *)(d_o + d);
        const u32 aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int k = 0; k < 4; k++)
          s += load_elem((elem_t)(aw[k] & 0xffffu)) * load_elem((elem_t)(bw[k] & 0xffffu)) +
               load_elem((elem_t)(aw[k] >> 16)) * load_elem((elem_t)(bw[k] >> 16));
        *(float4 *)(acc + d) = make_float4(0.f, 0.f, 0.f, 0.f);
        *(float4 *)(acc + d + 4) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    } else if (ok) {
      for (int d = 2 * hl; d < P.D; d += 32) {
        const float2 a = load2(o + d), b = load2(d_o + d);
        s += a.x * b.x + a.y * b.y;
        *(float2 *)(acc + d) = make_float2(0.f, 0.f);
      }
    }
    s = half_warp_sum(s);
    if (ok && hl == 0) {
      const i64 lo = P.cu_q ? (i64)h * P.lse_hs + r * P.lse_rs
                            : (r / P.seqlen_q) * P.lse_bs + (i64)h * P.lse_hs + (r % P.seqlen_q) * P.lse_rs;
      ((float *)P.dsum_ws)[(i64)h * P.rows_q + r] = s;
      ((float *)P.lse_ws)[(i64)h * P.rows_q + r] = ((const float *)P.lse)[lo] * 1.4426950408889634f;
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT) attn_bwd_dq(const attn_params P) {
  const i64 total = P.rows_q * P.H;
  const int hl = threadIdx.x & 15;
  for (i64 w = first_pair(); w < total; w += pair_stride()) {
    const i64 r = w / P.H;
    const int h = (int)(w % P.H);
    const float *acc = (const float *)P.dq_acc + (r * P.H + h) * P.D;
    elem_t *dq = (elem_t *)P.dq.p + row_off(P, P.dq, r, h);
    if (P.D % 8 == 0 && aligned16(dq, acc)) {
      for (int d = 8 * hl; d < P.D; d += 128) {
        const float4 a = *(const float4 *)(acc + d), b = *(const float4 *)(acc + d + 4);
        *(uint4 *)(dq + d) = make_uint4(ATTN_PACK(a.x * P.scale, a.y * P.scale), ATTN_PACK(a.z * P.scale, a.w * P.scale),
                                        ATTN_PACK(b.x * P.scale, b.y * P.scale), ATTN_PACK(b.z * P.scale, b.w * P.scale));
      }
    } else {
      for (int d = 2 * hl; d < P.D; d += 32) {
        const float2 a = *(const float2 *)(acc + d);
        *(u32 *)(dq + d) = ATTN_PACK(a.x * P.scale, a.y * P.scale);
      }
    }
  }
}

#ifdef ATTN_SINKS
extern "C" __global__ void __launch_bounds__(NT) attn_bwd_dsink(const attn_params P) {
  __shared__ float part[NT / 32];
  const int h = blockIdx.x;
  const float s2 = ((const float *)P.sinks)[h] * 1.4426950408889634f;
  const float *l2 = (const float *)P.lse_ws + (i64)h * P.rows_q, *ds = (const float *)P.dsum_ws + (i64)h * P.rows_q;
  float acc = 0.f;
  /* A row without keys has LSE +inf: its term is 0. */
  for (i64 r = threadIdx.x; r < P.rows_q; r += NT) acc += attn_ex2(s2 - l2[r]) * ds[r];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; w++) t += part[w];
    ((float *)P.dsinks)[h] = -t;
  }
}
#endif
