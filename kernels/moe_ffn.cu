/* The elementwise steps of the MoE expert FFN between its grouped GEMMs,
 * over the rows the router kept:
 *   moe_swiglu      out = silu(a) · b (out may be a: the forward, in place),
 *                   where the fused up projection (src/cuda/moe_gemm_sm90.c)
 *                   does not run;
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
 * SwiGLU's [rows, F] operands have row strides of their own (h1 and h3,
 * g1 and g3 are the halves of one [rows, 2F] matrix, which the fused up
 * projection writes and the fused input gradient reads): the kernels walk
 * the kept rows' elements in 16-byte units (a grid-stride loop, f32 math)
 * when F and every stride are whole units, else element by element. The
 * MLP's operands are contiguous: its kernels walk them as one flat run.
 * The count of kept rows is read here, from the
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

/* Whether the rows of F elements, `s` apart, at p walk in whole units. */
static __device__ __forceinline__ bool units_ok(const void *p, i64 s, i64 F) {
  return (unsigned long long)p % 16 == 0 && s % UNIT == 0 && F % UNIT == 0;
}

/* Element offset of unit u of rows of upr units (u < 2^32: 64 GiB). */
static __device__ __forceinline__ void unit_at(i64 u, i64 upr, i64 *r, i64 *c) {
  const unsigned q = (unsigned)u / (unsigned)upr;
  *r = q;
  *c = (u - (i64)q * upr) * UNIT;
}

/* out = silu(a)·b, rows os, as, bs apart; out may be a. */
extern "C" __global__ void moe_swiglu(elem_t *out, const elem_t *a, const elem_t *b, const void *offsets,
                                      int offsets64, int E, i64 rows, i64 F, i64 os, i64 as, i64 bs) {
  const i64 n = kept_elems(offsets, offsets64, E, rows, F), stride = (i64)gridDim.x * blockDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (units_ok(out, os, F) && units_ok(a, as, F) && units_ok(b, bs, F) && n / UNIT < (1ll << 32)) {
    for (i64 u = first, upr = F / UNIT; u < n / UNIT; u += stride) {
      i64 r, c;
      unit_at(u, upr, &r, &c);
      unit16 x, y;
      x.v = *(const uint4 *)(a + r * as + c);
      y.v = *(const uint4 *)(b + r * bs + c);
#pragma unroll
      for (int j = 0; j < UNIT; j++) x.e[j] = store_elem(silu_mul(load_elem(x.e[j]), load_elem(y.e[j])));
      *(uint4 *)(out + r * os + c) = x.v;
    }
    return;
  }
  for (i64 i = first; i < n; i += stride) {
    const i64 r = i / F, c = i - r * F;
    out[r * os + c] = store_elem(silu_mul(load_elem(a[r * as + c]), load_elem(b[r * bs + c])));
  }
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

/* [rows, F] each: h1 and h3 rows hs apart, g1 and g3 (h1 and h3, or apart)
 * gs apart, da contiguous. */
extern "C" __global__ void moe_swiglu_bwd(const elem_t *h1, const elem_t *h3, elem_t *da, elem_t *g1, elem_t *g3,
                                          const void *offsets, int offsets64, int E, i64 rows, i64 F, i64 hs, i64 gs) {
  const i64 n = kept_elems(offsets, offsets64, E, rows, F), stride = (i64)gridDim.x * blockDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (units_ok(h1, hs, F) && units_ok(h3, hs, F) && units_ok(g1, gs, F) && units_ok(g3, gs, F) &&
      units_ok(da, F, F) && n / UNIT < (1ll << 32)) {
    for (i64 u = first, upr = F / UNIT; u < n / UNIT; u += stride) {
      i64 r, c;
      unit_at(u, upr, &r, &c);
      unit16 x, y, g;
      x.v = *(const uint4 *)(h1 + r * hs + c);
      y.v = *(const uint4 *)(h3 + r * hs + c);
      g.v = ((const uint4 *)da)[u];
#pragma unroll
      for (int j = 0; j < UNIT; j++) swiglu_grad(x.e[j], y.e[j], g.e[j]);
      *(uint4 *)(g1 + r * gs + c) = x.v;
      *(uint4 *)(g3 + r * gs + c) = y.v;
      ((uint4 *)da)[u] = g.v;
    }
    return;
  }
  for (i64 i = first; i < n; i += stride) {
    const i64 r = i / F, c = i - r * F;
    elem_t x = h1[r * hs + c], y = h3[r * hs + c], g = da[i];
    swiglu_grad(x, y, g);
    g1[r * gs + c] = x;
    g3[r * gs + c] = y;
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
