/* The elementwise steps of the MoE expert FFN between its grouped GEMMs,
 * over the rows the router kept:
 *   moe_swiglu      out = silu(a) · b (out may be a: the forward, in place);
 *   moe_act         out = act(h) (the MLP's activation, when the backward
 *                   keeps the pre-activation h for its gradient);
 *   moe_swiglu_bwd  from h1, h3 and dA = dyp·W2ᵀ: g1 ← dh1, g3 ← dh3,
 *                   dA ← silu(h1)·h3 (the activation dW2 needs, recomputed
 *                   rather than kept from the forward); g1 and g3 may be h1
 *                   and h3 (in place) or apart (a saved forward's h1 and h3
 *                   stay as they were);
 *   moe_act_bwd     the MLP's: g ← dA · act'(h), dA ← act(h) (g may be h);
 *   moe_bias_grad   db1[e] = the column sums of dh1 over expert e's rows.
 *
 * The [rows, F] operands are contiguous, so their first offsets[E] rows are
 * one flat run of offsets[E] · F elements: the elementwise kernels walk it
 * in 16-byte units (a grid-stride loop, f32 math), then the few elements
 * past the last whole unit. The count of kept rows is read here, from the
 * device offsets, so the host launches for every row that could be kept and
 * needs no synchronization; a count outside [0, rows] (offsets that are the
 * caller's bug) is clamped so nothing outside the operands is touched. The
 * bias gradient sums each column in row order in one thread: no atomics,
 * the same bits on every run. elem_t is the prelude's SMELT_DT. */
#include "smelt_device.cuh"

#define UNIT ((int)(16 / sizeof(elem_t))) /* elements per 16-byte access */

typedef union unit16 {
  uint4 v;
  elem_t e[UNIT];
} unit16;

static __device__ __forceinline__ float silu_mul(float a, float b) { return a / (1.f + expf(-a)) * b; }

/* The kept rows' element count: offsets [E+1] i32 or i64, clamped to [0, rows]. */
static __device__ __forceinline__ i64 kept_elems(const void *offsets, int offsets64, int E, i64 rows, i64 F) {
  i64 kept = offsets64 ? ((const i64 *)offsets)[E] : (i64)((const int *)offsets)[E];
  kept = kept < 0 ? 0 : kept > rows ? rows : kept;
  return kept * F;
}

/* out, a, b 16-byte aligned; out may be a. */
extern "C" __global__ void moe_swiglu(elem_t *out, const elem_t *a, const elem_t *b, const void *offsets,
                                      int offsets64, int E, i64 rows, i64 F) {
  const i64 n = kept_elems(offsets, offsets64, E, rows, F), units = n / UNIT, stride = (i64)gridDim.x * blockDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  for (i64 u = first; u < units; u += stride) {
    unit16 x, y;
    x.v = ((const uint4 *)a)[u];
    y.v = ((const uint4 *)b)[u];
#pragma unroll
    for (int j = 0; j < UNIT; j++) x.e[j] = store_elem(silu_mul(load_elem(x.e[j]), load_elem(y.e[j])));
    ((uint4 *)out)[u] = x.v;
  }
  for (i64 i = units * UNIT + first; i < n; i += stride) out[i] = store_elem(silu_mul(load_elem(a[i]), load_elem(b[i])));
}

/* smelt_act_apply's functions in f32 (slope: leaky_relu's). */
static __device__ float act_f(int act, float x, float slope) {
  switch (act) {
    case ACT_RELU: return x < 0.f ? 0.f : x;
    case ACT_LEAKY_RELU: return x >= 0.f ? x : slope * x;
    case ACT_TANH: return tanhf(x);
    case ACT_SIGMOID: return 1.f / (1.f + expf(-x));
    case ACT_SILU: return x / (1.f + expf(-x));
    case ACT_HARDSWISH: return x * fminf(fmaxf(x + 3.f, 0.f), 6.f) / 6.f;
    case ACT_GELU: return 0.5f * x * erfcf(-x * 0.70710678118654752f);
    case ACT_GELU_TANH: return x / (1.f + expf(-2.f * 0.7978845608f * (x + 0.044715f * x * x * x)));
    default: return x;
  }
}

/* Their derivatives (smelt__act_grad's). */
static __device__ float act_grad_f(int act, float x, float slope) {
  const float sg = 1.f / (1.f + expf(-x));
  switch (act) {
    case ACT_RELU: return x > 0.f ? 1.f : 0.f;
    case ACT_LEAKY_RELU: return x >= 0.f ? 1.f : slope;
    case ACT_TANH: {
      const float th = tanhf(x);
      return 1.f - th * th;
    }
    case ACT_SIGMOID: return sg * (1.f - sg);
    case ACT_SILU: return sg * (1.f + x * (1.f - sg));
    case ACT_HARDSWISH: return x < -3.f ? 0.f : x > 3.f ? 1.f : (2.f * x + 3.f) / 6.f;
    case ACT_GELU: return 0.5f * (1.f + erff(x * 0.70710678118654752f)) + x * expf(-0.5f * x * x) * 0.39894228040143268f;
    case ACT_GELU_TANH: {
      const float c = 0.7978845608f, th = tanhf(c * (x + 0.044715f * x * x * x));
      return 0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * c * (1.f + 3.f * 0.044715f * x * x);
    }
    default: return 1.f;
  }
}

/* out = act(h), both [rows, F]. */
extern "C" __global__ void moe_act(elem_t *out, const elem_t *h, int act, float slope, const void *offsets,
                                   int offsets64, int E, i64 rows, i64 F) {
  const i64 n = kept_elems(offsets, offsets64, E, rows, F), stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = store_elem(act_f(act, load_elem(h[i]), slope));
}

/* One element of SwiGLU's backward: x = h1, u = h3, g = dA. */
static __device__ __forceinline__ void swiglu_grad(elem_t &h1, elem_t &h3, elem_t &da) {
  const float x = load_elem(h1), u = load_elem(h3), g = load_elem(da);
  const float sg = 1.f / (1.f + expf(-x)), silu = x / (1.f + expf(-x));
  h1 = store_elem(g * u * sg * (1.f + x * (1.f - sg)));
  h3 = store_elem(g * silu);
  da = store_elem(silu_mul(x, u));
}

/* h1, h3, da, g1, g3 16-byte aligned, [rows, F] each (g1, g3: h1, h3 or apart). */
extern "C" __global__ void moe_swiglu_bwd(const elem_t *h1, const elem_t *h3, elem_t *da, elem_t *g1, elem_t *g3,
                                          const void *offsets, int offsets64, int E, i64 rows, i64 F) {
  const i64 n = kept_elems(offsets, offsets64, E, rows, F), units = n / UNIT, stride = (i64)gridDim.x * blockDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  for (i64 u = first; u < units; u += stride) {
    unit16 x, y, g;
    x.v = ((const uint4 *)h1)[u];
    y.v = ((const uint4 *)h3)[u];
    g.v = ((const uint4 *)da)[u];
#pragma unroll
    for (int j = 0; j < UNIT; j++) swiglu_grad(x.e[j], y.e[j], g.e[j]);
    ((uint4 *)g1)[u] = x.v;
    ((uint4 *)g3)[u] = y.v;
    ((uint4 *)da)[u] = g.v;
  }
  for (i64 i = units * UNIT + first; i < n; i += stride) {
    elem_t x = h1[i], y = h3[i], g = da[i];
    swiglu_grad(x, y, g);
    g1[i] = x;
    g3[i] = y;
    da[i] = g;
  }
}

/* g ← dA · act'(h), dA ← act(h); [rows, F] each (g: h or apart). */
extern "C" __global__ void moe_act_bwd(const elem_t *h, elem_t *da, elem_t *g, int act, float slope,
                                       const void *offsets, int offsets64, int E, i64 rows, i64 F) {
  const i64 n = kept_elems(offsets, offsets64, E, rows, F), stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float x = load_elem(h[i]);
    g[i] = store_elem(load_elem(da[i]) * act_grad_f(act, x, slope));
    da[i] = store_elem(act_f(act, x, slope));
  }
}

/* db1 [E, F] (dtype code db1_dt: f32, f16 or bf16) = Σ over expert e's rows
 * of g [rows, F]: block (x, e) sums columns 128 x .. 128 x + 127 in row order. */
extern "C" __global__ void moe_bias_grad(const elem_t *g, const void *offsets, int offsets64, int E, i64 rows, i64 F,
                                         void *db1, int db1_dt) {
  const int e = blockIdx.y;
  const i64 f = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (f >= F) return;
  i64 lo = offsets64 ? ((const i64 *)offsets)[e] : (i64)((const int *)offsets)[e];
  i64 hi = offsets64 ? ((const i64 *)offsets)[e + 1] : (i64)((const int *)offsets)[e + 1];
  lo = lo < 0 ? 0 : lo > rows ? rows : lo;
  hi = hi < lo ? lo : hi > rows ? rows : hi;
  float acc = 0.f;
  for (i64 r = lo; r < hi; r++) acc += load_elem(g[r * F + f]);
  const i64 i = (i64)e * F + f;
  if (db1_dt == SMELT_DT_F32) ((float *)db1)[i] = acc;
  else ((smelt_h16 *)db1)[i] = db1_dt == SMELT_DT_F16 ? smelt_f32_to_f16(acc) : smelt_f32_to_bf16(acc);
}
