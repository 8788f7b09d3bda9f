/* Device-side helpers shared by every smelt kernel.
 *
 * Kernels are compiled by NVRTC with nothing but smelt's own headers (no CUDA
 * toolkit headers), so the 16-bit float types are plain unsigned shorts here and
 * conversions are inline PTX. A kernel file is compiled after a generated
 * prelude of #defines (the operation description); SMELT_DT selects the element
 * type with the values of smelt_dtype: 1 f32, 2 f16, 3 bf16. */
#ifndef SMELT_DEVICE_CUH
#define SMELT_DEVICE_CUH

#define SMELT_DT_F32 1
#define SMELT_DT_F16 2
#define SMELT_DT_BF16 3

typedef unsigned short smelt_h16; /* raw f16 or bf16 bits */
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

static __device__ __forceinline__ float smelt_f16_to_f32(smelt_h16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
static __device__ __forceinline__ smelt_h16 smelt_f32_to_f16(float f) {
  smelt_h16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
static __device__ __forceinline__ float smelt_bf16_to_f32(smelt_h16 h) {
  return __int_as_float(((u32)h) << 16);
}
static __device__ __forceinline__ smelt_h16 smelt_f32_to_bf16(float f) {
  smelt_h16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

/* The values of smelt_act (include/smelt.h), for every kernel with an activation. */
#define ACT_IDENTITY 0
#define ACT_RELU 1
#define ACT_LEAKY_RELU 2
#define ACT_TANH 3
#define ACT_SIGMOID 4
#define ACT_SILU 5
#define ACT_HARDSWISH 6
#define ACT_GELU 7
#define ACT_GELU_TANH 8

/* elem_t / load_elem / store_elem for the prelude's SMELT_DT. */
#if defined(SMELT_DT)
#if SMELT_DT == SMELT_DT_F32
typedef float elem_t;
static __device__ __forceinline__ float load_elem(elem_t v) { return v; }
static __device__ __forceinline__ elem_t store_elem(float f) { return f; }
#elif SMELT_DT == SMELT_DT_F16
typedef smelt_h16 elem_t;
static __device__ __forceinline__ float load_elem(elem_t v) { return smelt_f16_to_f32(v); }
static __device__ __forceinline__ elem_t store_elem(float f) { return smelt_f32_to_f16(f); }
#elif SMELT_DT == SMELT_DT_BF16
typedef smelt_h16 elem_t;
static __device__ __forceinline__ float load_elem(elem_t v) { return smelt_bf16_to_f32(v); }
static __device__ __forceinline__ elem_t store_elem(float f) { return smelt_f32_to_bf16(f); }
#else
#error "SMELT_DT must be 1 (f32), 2 (f16) or 3 (bf16)"
#endif
/* 16 bytes of elem_t: the unit of vector loads and stores. */
#define SMELT_VW (16 / (int)sizeof(elem_t))
union smelt_vec16 {
  uint4 u;
  elem_t e[SMELT_VW];
};
#endif

/* A tensor's shape and strides as the host packs them (smelt__kshape). */
typedef struct smelt_kshape {
  i64 shape[8];
  i64 strides[8];
  int ndim;
  int pad;
} smelt_kshape;

/* Element offset of the row-major linear index i. */
static __device__ __forceinline__ i64 smelt_offset(const smelt_kshape &s, i64 i) {
  i64 off = 0;
#pragma unroll
  for (int d = 7; d >= 0; --d) {
    if (d < s.ndim) {
      i64 n = s.shape[d];
      off += (i % n) * s.strides[d];
      i /= n;
    }
  }
  return off;
}

/* e^x and a/b on the MUFU unit with denormals flushed to zero. __expf and
 * __fdividef compile to the same MUFU instruction plus a denormal fix-up
 * around it (a third of the 16-bit gelu's instructions); the flush only
 * turns results below 1.2e-38 into 0. Errors: smelt_fast_exp ~2 ulp plus
 * 6e-8 |x| relative (the rounding of x log2 e), smelt_fast_div 1 ulp plus
 * the product's rounding. For 16-bit outputs (elementwise kernels and the
 * GEMM epilogue), whose rounding is 2^-11 (f16) or 2^-8 (bf16) relative. */
static __device__ __forceinline__ float smelt_fast_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
}
static __device__ __forceinline__ float smelt_fast_div(float a, float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return a * r;
}

/* gelu for 16-bit outputs: x * Phi(x), with Phi(-|x|) = erfc(t)/2, t = |x|/sqrt 2,
 * and erfc(t) = u*q(u)*exp(-t^2), u = 1/(1 + 0.435 t), q a degree-5
 * polynomial fitted to minimise the relative error on [0, 9.5] (3.7e-6; the
 * whole function stays within 2e-5 relative, 0.01 f16 ulp, until the exp
 * flushes to 0 below 2^-126 (x < -13.4), where results under |x| 2^-126
 * become 0). It costs about
 * half of erff and a third of erfcf, and unlike 1 + erf it keeps its
 * relative accuracy in the negative tail. */
static __device__ __forceinline__ float smelt_gelu16(float x) {
  const float t = fabsf(x) * 0.70710678118654752f;
  const float u = smelt_fast_div(1.f, 1.f + 0.435f * t);
  const float q =
      u * (0.245956387f +
           u * (0.236991762f + u * (0.274866623f + u * (0.0100890354f + u * (0.383840751f + u * -0.15174825f)))));
  const float h = 0.5f * q * smelt_fast_exp(-t * t);
  return x * (x < 0.f ? h : 1.f - h);
}

/* A flag in global memory between CTAs: the reads after an acquire load see
 * what was written before the release store that it reads. */
static __device__ __forceinline__ int smelt_ld_acquire(const int *p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
static __device__ __forceinline__ void smelt_st_release(int *p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ void smelt_add_release(int *p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

static __device__ __forceinline__ float smelt_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
static __device__ __forceinline__ float smelt_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

#endif /* SMELT_DEVICE_CUH */
