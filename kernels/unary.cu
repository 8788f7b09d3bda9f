/* Elementwise activations: y = act(x).
 *
 * One module per (SMELT_DT, SMELT_ACT): the activation is a compile-time
 * constant, so each loop body is a few instructions around the memory traffic.
 * The op is memory-bound; the entry points differ only in how they move bytes:
 *   act_vec      x and y contiguous and 16-byte aligned: 16-byte loads and
 *                stores, UNROLL independent loads in flight per thread, a
 *                grid-stride loop; the n % VEC tail is done element by element.
 *   act_contig   contiguous but not 16-byte aligned: the same loop, one element
 *                at a time (still coalesced).
 *   act_strided  any strides: each row-major index is mapped to an x and a y
 *                offset (the host merges dims first so there are few).
 * The formulas are smelt_act_apply's (the double-precision definition) in
 * float, in forms without cancellation: gelu as 0.5·x·erfc(−x/√2) (f32; a
 * cheaper fit for 16-bit outputs, smelt_gelu16 in smelt_device.cuh), gelu_tanh as x·sigmoid(2z),
 * which equals 0.5·x·(1 + tanh z). exp and the division are single MUFU
 * instructions (smelt_fast_exp: ~2 ulp plus 6e-8·|x| relative; smelt_fast_div: 1 ulp;
 * results below 1.2e-38 flush to 0): f16/bf16 must run at copy bandwidth,
 * where the accurate expf and IEEE division would make the kernel
 * compute-bound. In place (y == x) is
 * allowed, so x and y are not declared __restrict__: each element is read
 * and then written by the same thread, which needs no more than program
 * order.
 */
#include "smelt_device.cuh"

#if !defined(SMELT_DT) || !defined(SMELT_ACT)
#error "unary.cu needs SMELT_DT and SMELT_ACT"
#endif

#define BLOCK 256
#define UNROLL 4
/* On Hopper the 16-bit fast path asks for every thread slot (2048 per SM,
 * so 32 registers) to keep the most loads in flight (docs/PERF.md,
 * Elementwise activations). f32 (whose gelu needs 48 registers),
 * identity (a plain copy, which ptxas then spills) and sm_80 (where the cap
 * spills, and lower bandwidth leaves room) keep the default. */
#if SMELT_DT == SMELT_DT_F32 || SMELT_ACT == ACT_IDENTITY || __CUDA_ARCH__ < 900
#define VEC_BOUNDS __launch_bounds__(BLOCK)
#else
#define VEC_BOUNDS __launch_bounds__(BLOCK, 2048 / BLOCK)
#endif
/* Elements per 16-byte vector. */
#define VEC (16 / (int)sizeof(elem_t))

static __device__ __forceinline__ float act(float x, float slope) {
  (void)slope; /* only leaky_relu reads it */
#if SMELT_ACT == ACT_IDENTITY
  return x;
#elif SMELT_ACT == ACT_RELU
  return x < 0.f ? 0.f : x; /* NaN passes through */
#elif SMELT_ACT == ACT_LEAKY_RELU
  return x >= 0.f ? x : slope * x;
#elif SMELT_ACT == ACT_TANH
  return tanhf(x);
#elif SMELT_ACT == ACT_SIGMOID
  return smelt_fast_div(1.f, 1.f + smelt_fast_exp(-x));
#elif SMELT_ACT == ACT_SILU
  return smelt_fast_div(x, 1.f + smelt_fast_exp(-x));
#elif SMELT_ACT == ACT_HARDSWISH
  return x * fminf(fmaxf(x + 3.f, 0.f), 6.f) * (1.f / 6.f);
#elif SMELT_ACT == ACT_GELU
#if SMELT_DT == SMELT_DT_F32
  return 0.5f * x * erfcf(-0.70710678118654752f * x);
#else
  return smelt_gelu16(x);
#endif
#elif SMELT_ACT == ACT_GELU_TANH
  float z = 0.7978845608f * (x + 0.044715f * x * x * x);
  return smelt_fast_div(x, 1.f + smelt_fast_exp(-2.f * z));
#else
#error "SMELT_ACT is not a smelt_act value"
#endif
}

static __device__ __forceinline__ elem_t act_elem(elem_t v, float slope) {
  return store_elem(act(load_elem(v), slope));
}

/* One 32-bit word holds one f32 or two halves (low half first). The pair
 * conversion rounds both halves in one instruction. */
static __device__ __forceinline__ u32 act_word(u32 w, float slope) {
#if SMELT_ACT == ACT_IDENTITY
  (void)slope;
  return w; /* a copy, bit-exact (NaN payloads included) */
#elif SMELT_DT == SMELT_DT_F32
  return __float_as_uint(act(__uint_as_float(w), slope));
#else
  float lo = act(load_elem((elem_t)(w & 0xffffu)), slope);
  float hi = act(load_elem((elem_t)(w >> 16)), slope);
  u32 r;
#if SMELT_DT == SMELT_DT_F16
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
#endif
}

static __device__ __forceinline__ uint4 act_vec4(uint4 v, float slope) {
  v.x = act_word(v.x, slope);
  v.y = act_word(v.y, slope);
  v.z = act_word(v.z, slope);
  v.w = act_word(v.w, slope);
  return v;
}

/* n elements; x and y 16-byte aligned (the host checks). */
extern "C" __global__ void VEC_BOUNDS act_vec(const elem_t *x, elem_t *y, i64 n, float slope) {
  const uint4 *xv = (const uint4 *)x;
  uint4 *yv = (uint4 *)y;
  const i64 nvec = n / VEC;
  const i64 step = (i64)gridDim.x * BLOCK;
  const i64 tid = (i64)blockIdx.x * BLOCK + threadIdx.x;
  i64 i = tid;
  /* UNROLL independent 16-byte loads per thread per iteration; neighbouring
   * threads read neighbouring vectors (coalesced). */
  for (; i + (UNROLL - 1) * step < nvec; i += UNROLL * step) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) v[u] = xv[i + u * step];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) yv[i + u * step] = act_vec4(v[u], slope);
  }
  for (; i < nvec; i += step) yv[i] = act_vec4(xv[i], slope);
  const i64 t = nvec * VEC + tid; /* the tail: fewer than VEC elements */
  if (t < n) y[t] = act_elem(x[t], slope);
}

/* n contiguous elements at any element-aligned address. */
extern "C" __global__ void __launch_bounds__(BLOCK) act_contig(const elem_t *x, elem_t *y, i64 n, float slope) {
  const i64 step = (i64)gridDim.x * BLOCK;
  i64 i = (i64)blockIdx.x * BLOCK + threadIdx.x;
  for (; i + (UNROLL - 1) * step < n; i += UNROLL * step) {
    elem_t v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) v[u] = x[i + u * step];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) y[i + u * step] = act_elem(v[u], slope);
  }
  for (; i < n; i += step) y[i] = act_elem(x[i], slope);
}

/* n elements of the common shape xs.shape == ys.shape; strides differ. One
 * division per dim serves both offsets. */
extern "C" __global__ void __launch_bounds__(BLOCK)
    act_strided(const elem_t *x, elem_t *y, i64 n, smelt_kshape xs, smelt_kshape ys, float slope) {
  const i64 step = (i64)gridDim.x * BLOCK;
  for (i64 i = (i64)blockIdx.x * BLOCK + threadIdx.x; i < n; i += step) {
    i64 xo = 0, yo = 0, r = i;
#pragma unroll
    for (int d = 7; d >= 0; --d) { /* smelt_kshape holds up to 8 dims */
      if (d < xs.ndim) {
        i64 q = r / xs.shape[d];
        i64 c = r - q * xs.shape[d];
        xo += c * xs.strides[d];
        yo += c * ys.strides[d];
        r = q;
      }
    }
    y[yo] = act_elem(x[xo], slope);
  }
}
