/* The quantizers' scalar definitions (include/smelt/quant.h), written once
 * for both sides: src/cpu/quant.c includes this file as C, kernels/quant.cu
 * as CUDA. The CPU reference and the kernels therefore run the same f32
 * operations in the same order (division and multiplication through
 * SMELT_Q_DIV / SMELT_Q_MUL, IEEE round to nearest on both, never fused)
 * and the same integer encoders, which is what makes them bit-identical.
 * The encoders round once from the f32 value, scaled by a power of two
 * where the format asks for one (MXFP8), so no double rounding hides in a
 * subnormal intermediate.
 *
 * Element formats, by index: SMELT_Q_E4M3 (S.EEEE.MMM, bias 7, max 448, NaN
 * S.1111.111), SMELT_Q_E5M2 (S.EEEEE.MM, bias 15, max 57344, NaN
 * S.11111.10 as written), SMELT_Q_E2M1 (S.EE.M, bias 1, max 6, no NaN). */
#ifndef SMELT_QUANT_MATH_CUH
#define SMELT_QUANT_MATH_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
typedef unsigned int smelt_q_u32;
#define SMELT_QF static __device__ __forceinline__
#define SMELT_Q_F2U(f) __float_as_uint(f)
#define SMELT_Q_U2F(u) __uint_as_float(u)
#define SMELT_Q_DIV(a, b) __fdiv_rn((a), (b))
#define SMELT_Q_MUL(a, b) __fmul_rn((a), (b))
#define SMELT_Q_CLZ(u) __clz((int)(u))
#else
#include <stdint.h>
#include <string.h>
typedef uint32_t smelt_q_u32;
#define SMELT_QF static inline
static inline smelt_q_u32 smelt_q_f2u(float f) {
  smelt_q_u32 u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float smelt_q_u2f(smelt_q_u32 u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
#define SMELT_Q_F2U(f) smelt_q_f2u(f)
#define SMELT_Q_U2F(u) smelt_q_u2f(u)
#define SMELT_Q_DIV(a, b) ((float)(a) / (float)(b))
#define SMELT_Q_MUL(a, b) ((float)(a) * (float)(b))
#define SMELT_Q_CLZ(u) __builtin_clz(u)
#endif

#define SMELT_Q_E4M3 0
#define SMELT_Q_E5M2 1
#define SMELT_Q_E2M1 2

/* Per format: mantissa bits, bias, largest finite magnitude code, NaN
 * magnitude code, sign bit position, largest finite value, OCP emax_elem. */
#define SMELT_Q_MBITS(f) ((f) == SMELT_Q_E4M3 ? 3 : (f) == SMELT_Q_E5M2 ? 2 : 1)
#define SMELT_Q_BIAS(f) ((f) == SMELT_Q_E4M3 ? 7 : (f) == SMELT_Q_E5M2 ? 15 : 1)
#define SMELT_Q_MAXCODE(f) ((f) == SMELT_Q_E4M3 ? 0x7eu : (f) == SMELT_Q_E5M2 ? 0x7bu : 0x7u)
#define SMELT_Q_NANCODE(f) ((f) == SMELT_Q_E4M3 ? 0x7fu : 0x7eu)
#define SMELT_Q_SIGNPOS(f) ((f) == SMELT_Q_E2M1 ? 3 : 7)
#define SMELT_Q_FMAX(f) ((f) == SMELT_Q_E4M3 ? 448.0f : (f) == SMELT_Q_E5M2 ? 57344.0f : 6.0f)
#define SMELT_Q_EMAX(f) ((f) == SMELT_Q_E4M3 ? 8 : 15)

SMELT_QF int smelt_q_isnan(float x) { return (SMELT_Q_F2U(x) & 0x7fffffffu) > 0x7f800000u; }

/* The block maximum of |x| so far: NaN never wins (it compares false). */
SMELT_QF float smelt_q_amax(float m, float x) {
  float a = SMELT_Q_U2F(SMELT_Q_F2U(x) & 0x7fffffffu);
  return a > m ? a : m;
}

/* x · 2^-shift in format f, rounded to nearest even once, saturating (±inf
 * included); x is not NaN. Returns the code with its sign bit. */
SMELT_QF smelt_q_u32 smelt_q_encode(float x, int shift, int f) {
  const int mbits = SMELT_Q_MBITS(f), bias = SMELT_Q_BIAS(f);
  smelt_q_u32 u = SMELT_Q_F2U(x), a = u & 0x7fffffffu;
  smelt_q_u32 sign = (u >> 31) << SMELT_Q_SIGNPOS(f);
  if (a >= 0x7f800000u) return sign | SMELT_Q_MAXCODE(f);
  if (a == 0) return sign;
  /* a = sig · 2^(e − 23) with sig's leading one at bit 23. */
  int biased = (int)(a >> 23);
  smelt_q_u32 sig = biased ? (a & 0x7fffffu) | 0x800000u : a;
  int e = (biased ? biased : 1) - 127 - shift;
  int lz = SMELT_Q_CLZ(sig) - 8;
  sig <<= lz;
  e -= lz;
  int qe = (e > 1 - bias ? e : 1 - bias) - mbits; /* the target's quantum is 2^qe */
  int drop = qe - e + 23;
  if (drop >= 25) return sign;
  smelt_q_u32 m = sig >> drop, rem = sig & ((1u << drop) - 1u), half = 1u << (drop - 1);
  if (rem > half || (rem == half && (m & 1u))) m++;
  int top = e + bias > 1 ? e + bias : 1;
  if (top > 64) return sign | SMELT_Q_MAXCODE(f);
  smelt_q_u32 code = ((smelt_q_u32)(top - 1) << mbits) + m;
  return sign | (code > SMELT_Q_MAXCODE(f) ? SMELT_Q_MAXCODE(f) : code);
}

/* The f32 value of a code of format f (NaN codes give 0x7fc00000). */
SMELT_QF float smelt_q_decode(smelt_q_u32 code, int f) {
  const int mbits = SMELT_Q_MBITS(f), bias = SMELT_Q_BIAS(f), sp = SMELT_Q_SIGNPOS(f);
  smelt_q_u32 mag = code & ((1u << sp) - 1u), neg = (code >> sp) & 1u;
  if (f == SMELT_Q_E4M3 && mag == 0x7fu) return SMELT_Q_U2F(0x7fc00000u);
  if (f == SMELT_Q_E5M2 && mag > 0x7cu) return SMELT_Q_U2F(0x7fc00000u);
  smelt_q_u32 ex = mag >> mbits, m = mag & ((1u << mbits) - 1u);
  float v;
  if (f == SMELT_Q_E5M2 && mag == 0x7cu) v = SMELT_Q_U2F(0x7f800000u);
  else if (ex == 0) v = SMELT_Q_MUL((float)m, SMELT_Q_U2F((smelt_q_u32)(127 + 1 - bias - mbits) << 23));
  else v = SMELT_Q_U2F(((ex - (smelt_q_u32)bias + 127u) << 23) | (m << (23 - mbits)));
  return neg ? -v : v;
}

/* sm_89 and later convert f32 to E4M3 and E5M2 in one instruction:
 * cvt.rn.satfinite rounds to nearest even and saturates out-of-range values
 * and ±inf to ±max, exactly as smelt_q_encode with no shift does (NaN is
 * handled before either, so the hardware's own NaN code never appears). The
 * software encoder costs the kernels most of their time; the CPU keeps it. */
#if (defined(__CUDACC__) || defined(__CUDACC_RTC__)) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define SMELT_Q_HW_FP8 1
SMELT_QF smelt_q_u32 smelt_q_hw_fp8(float v, int f) {
  unsigned short r;
  if (f == SMELT_Q_E4M3) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
  else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
  return (smelt_q_u32)(r & 0xffu); /* the second source, v, is the low byte */
}
#endif

/* FP8 with an f32 scale. */
SMELT_QF float smelt_q_fp8_scale(float amax, int f) {
  return amax == 0.0f ? 1.0f : SMELT_Q_DIV(amax, SMELT_Q_FMAX(f));
}
SMELT_QF smelt_q_u32 smelt_q_fp8_elem(float x, float scale, int f) {
  float v = SMELT_Q_DIV(x, scale);
  if (smelt_q_isnan(v)) return ((SMELT_Q_F2U(x) >> 31) << 7) | SMELT_Q_NANCODE(f);
#ifdef SMELT_Q_HW_FP8
  if (f != SMELT_Q_E2M1) return smelt_q_hw_fp8(v, f);
#endif
  return smelt_q_encode(v, 0, f);
}

/* MXFP8: the E8M0 byte of a block (255, NaN, for a block holding ±inf). */
SMELT_QF smelt_q_u32 smelt_q_e8m0(float amax, int f) {
  int biased = (int)(SMELT_Q_F2U(amax) >> 23);
  if (biased == 255) return 255u;
  int se = biased - 127 - SMELT_Q_EMAX(f);
  if (biased == 0 || se < -127) se = -127;
  return (smelt_q_u32)(se + 127);
}
SMELT_QF smelt_q_u32 smelt_q_mx_elem(float x, smelt_q_u32 e8m0, int f) {
  if (e8m0 == 255u || smelt_q_isnan(x)) return ((SMELT_Q_F2U(x) >> 31) << 7) | SMELT_Q_NANCODE(f);
#ifdef SMELT_Q_HW_FP8
  /* x · 2^(127 − e8m0) is exact wherever the result is an f32 normal, and
   * where it is not (below 2^-126) both encoders give ±0: the hardware
   * conversion of the scaled value is the software encoder's code. The
   * block's largest element scales to below 2^(emax + 1): never inf. */
  if (f != SMELT_Q_E2M1) {
    const smelt_q_u32 bits = e8m0 == 254u ? 0x00400000u : (254u - e8m0) << 23; /* 2^-127 is subnormal */
    return smelt_q_hw_fp8(SMELT_Q_MUL(x, SMELT_Q_U2F(bits)), f);
  }
#endif
  return smelt_q_encode(x, (int)e8m0 - 127, f);
}
SMELT_QF float smelt_q_e8m0_value(smelt_q_u32 e8m0) {
  if (e8m0 == 255u) return SMELT_Q_U2F(0x7fc00000u);
  return SMELT_Q_U2F(e8m0 ? e8m0 << 23 : 0x00400000u);
}

/* NVFP4: the tensor scale, a block's e4m3 scale byte, the f32 divisor of
 * its elements, and one element's E2M1 nibble. */
SMELT_QF float smelt_q_nvfp4_tensor_scale(float amax) {
  return amax == 0.0f ? 1.0f : SMELT_Q_DIV(amax, 2688.0f);
}
SMELT_QF smelt_q_u32 smelt_q_nvfp4_block_scale(float amax, float tensor_scale) {
  float v = SMELT_Q_DIV(amax, SMELT_Q_MUL(6.0f, tensor_scale));
  return smelt_q_isnan(v) ? SMELT_Q_NANCODE(SMELT_Q_E4M3) : smelt_q_encode(v, 0, SMELT_Q_E4M3);
}
SMELT_QF float smelt_q_nvfp4_divisor(smelt_q_u32 block_scale, float tensor_scale) {
  return SMELT_Q_MUL(smelt_q_decode(block_scale, SMELT_Q_E4M3), tensor_scale);
}
/* smelt_q_encode(v, 0, SMELT_Q_E2M1) for v not NaN, by comparisons: E2M1's
 * magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6, and each step is taken above
 * the midpoint to it, or at the midpoint when the upper code is even (ties
 * to even), saturating at 6 (inf included). The generic encoder's shifts
 * and count of leading zeros took most of the NVFP4 kernel's time;
 * tests/test_quant.c checks the two agree on every f32. */
SMELT_QF smelt_q_u32 smelt_q_e2m1_code(float v) {
  const smelt_q_u32 u = SMELT_Q_F2U(v);
  const float a = SMELT_Q_U2F(u & 0x7fffffffu);
  const smelt_q_u32 m = (smelt_q_u32)(a > 0.25f) + (smelt_q_u32)(a >= 0.75f) + (smelt_q_u32)(a > 1.25f) +
                        (smelt_q_u32)(a >= 1.75f) + (smelt_q_u32)(a > 2.5f) + (smelt_q_u32)(a >= 3.5f) +
                        (smelt_q_u32)(a > 5.0f);
  return (u >> 31) << 3 | m;
}
SMELT_QF smelt_q_u32 smelt_q_e2m1(float x, float divisor) {
  if (smelt_q_isnan(x)) return SMELT_Q_MAXCODE(SMELT_Q_E2M1);
  if (divisor == 0.0f) return (SMELT_Q_F2U(x) >> 31) << 3;
  float v = SMELT_Q_DIV(x, divisor);
  return smelt_q_isnan(v) ? SMELT_Q_MAXCODE(SMELT_Q_E2M1) : smelt_q_e2m1_code(v);
}

#endif /* SMELT_QUANT_MATH_CUH */
