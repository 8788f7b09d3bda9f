/* The attention backward's two small kernels, around attn_bwd
 * (kernels/attn_bwd_sm80.cu).
 *
 * Prelude: SMELT_DT (2 f16, 3 bf16).
 *
 *   attn_bwd_pre  per (query row r of all sequences, head h):
 *                   dsum_ws[h][r] = Σ_d dO ∘ O  (f32, from the 16-bit inputs)
 *                   lse_ws[h][r]  = LSE · log2(e) (+inf stays +inf)
 *                   dq_acc[r][h][:] = 0
 *   attn_bwd_dq   dq[r][h][:] = scale · dq_acc[r][h][:], rounded to the dtype.
 * One warp per (row, head), two elements per lane per step (D is even);
 * rows are global (see attn_common.cuh), so varlen needs no sequence
 * lookup: batched row r is sequence r / Sq, row r % Sq.
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

extern "C" __global__ void __launch_bounds__(NT) attn_bwd_pre(const attn_params P) {
  const int lane = threadIdx.x & 31;
  const i64 total = P.rows_q * P.H;
  for (i64 w = ((i64)blockIdx.x * NT + threadIdx.x) >> 5; w < total; w += (i64)gridDim.x * (NT / 32)) {
    const i64 r = w / P.H;
    const int h = (int)(w % P.H);
    const elem_t *o = (const elem_t *)P.o.p + row_off(P, P.o, r, h);
    const elem_t *d_o = (const elem_t *)P.d_o.p + row_off(P, P.d_o, r, h);
    float *acc = (float *)P.dq_acc + (r * P.H + h) * P.D;
    float s = 0.f;
    for (int d = 2 * lane; d < P.D; d += 64) {
      const float2 a = load2(o + d), b = load2(d_o + d);
      s += a.x * b.x + a.y * b.y;
      *(float2 *)(acc + d) = make_float2(0.f, 0.f);
    }
    s = smelt_warp_sum(s);
    if (lane == 0) {
      const i64 lo = P.cu_q ? (i64)h * P.lse_hs + r * P.lse_rs
                            : (r / P.seqlen_q) * P.lse_bs + (i64)h * P.lse_hs + (r % P.seqlen_q) * P.lse_rs;
      ((float *)P.dsum_ws)[(i64)h * P.rows_q + r] = s;
      ((float *)P.lse_ws)[(i64)h * P.rows_q + r] = ((const float *)P.lse)[lo] * 1.4426950408889634f;
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT) attn_bwd_dq(const attn_params P) {
  const int lane = threadIdx.x & 31;
  const i64 total = P.rows_q * P.H;
  for (i64 w = ((i64)blockIdx.x * NT + threadIdx.x) >> 5; w < total; w += (i64)gridDim.x * (NT / 32)) {
    const i64 r = w / P.H;
    const int h = (int)(w % P.H);
    const float *acc = (const float *)P.dq_acc + (r * P.H + h) * P.D;
    elem_t *dq = (elem_t *)P.dq.p + row_off(P, P.dq, r, h);
    for (int d = 2 * lane; d < P.D; d += 64) {
      const float2 a = *(const float2 *)(acc + d);
      *(u32 *)(dq + d) = ATTN_PACK(a.x * P.scale, a.y * P.scale);
    }
  }
}
