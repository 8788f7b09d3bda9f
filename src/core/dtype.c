/* The dtype table and exact host conversions between f32 and the narrow float
 * formats. One generic encoder (round to nearest even in double, where scaling
 * by powers of two is exact) serves f16 and both fp8 formats, so their rounding
 * rules cannot drift apart; bf16 uses the usual bit trick. */
#include "internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

static const struct {
  const char *name;
  size_t size;
} dtypes[SMELT_DTYPE_COUNT] = {
    [SMELT_DTYPE_F64] = {"f64", 8},  [SMELT_DTYPE_F32] = {"f32", 4},   [SMELT_DTYPE_F16] = {"f16", 2},
    [SMELT_DTYPE_BF16] = {"bf16", 2}, [SMELT_DTYPE_E4M3] = {"e4m3", 1}, [SMELT_DTYPE_E5M2] = {"e5m2", 1},
    [SMELT_DTYPE_I8] = {"i8", 1},    [SMELT_DTYPE_I32] = {"i32", 4},   [SMELT_DTYPE_I64] = {"i64", 8},
    [SMELT_DTYPE_U8] = {"u8", 1},    [SMELT_DTYPE_BOOL] = {"bool", 1},
};

size_t smelt_dtype_size(smelt_dtype dt) {
  return ((unsigned)dt < SMELT_DTYPE_COUNT) ? dtypes[dt].size : 0;
}

const char *smelt_dtype_name(smelt_dtype dt) {
  return ((unsigned)dt < SMELT_DTYPE_COUNT) ? dtypes[dt].name : "?";
}

smelt_status smelt_dtype_from_name(const char *name, smelt_dtype *out) {
  if (!name || !out) return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_dtype_from_name: name or out is NULL");
  for (int i = 0; i < SMELT_DTYPE_COUNT; i++)
    if (!strcmp(name, dtypes[i].name)) {
      *out = (smelt_dtype)i;
      return SMELT_OK;
    }
  return smelt__error(SMELT_STATUS_NOT_FOUND,
                      "smelt_dtype_from_name: unknown dtype \"%s\" (supported: f64 f32 f16 bf16 e4m3 "
                      "e5m2 i8 i32 i64 u8 bool)",
                      name);
}

/* A binary float format with `mbits` mantissa bits and exponent bias `bias`. */
typedef struct fmt {
  int ebits, mbits, bias;
  double max;    /* largest finite value */
  int has_inf;   /* overflow gives inf (f16) or saturates to max (fp8) */
  int saturate;
} fmt;

static const fmt F16 = {5, 10, 15, 65504.0, 1, 0};
static const fmt E4M3 = {4, 3, 7, 448.0, 0, 1};
static const fmt E5M2 = {5, 2, 15, 57344.0, 1, 1};

static uint32_t encode(const fmt *f, double x) {
  uint32_t sign = signbit(x) ? 1u : 0u;
  uint32_t sbit = sign << (f->ebits + f->mbits);
  uint32_t emask = (1u << f->ebits) - 1;
  if (isnan(x)) {
    /* e4m3fn has a single NaN pattern, all ones; IEEE-like formats use a quiet NaN. */
    return f->has_inf ? (sbit | emask << f->mbits | 1u << (f->mbits - 1)) : (sbit | 0x7fu);
  }
  double a = fabs(x);
  int emin = 1 - f->bias;
  if (a == 0) return sbit;
  int e;
  frexp(a, &e);
  e -= 1; /* a = m * 2^e with m in [1, 2) */
  if (e < emin) e = emin;
  double q = ldexp(1.0, e - f->mbits);
  double r = nearbyint(a / q) * q; /* default rounding mode: ties to even */
  if (r > f->max || isinf(a)) {
    if (f->saturate) r = f->max;
    else return sbit | emask << f->mbits; /* inf */
  }
  if (r == 0) return sbit;
  frexp(r, &e);
  e -= 1;
  if (e < emin) return sbit | (uint32_t)ldexp(r, f->mbits - emin); /* subnormal */
  uint32_t mant = (uint32_t)(ldexp(r, f->mbits - e) - ldexp(1.0, f->mbits));
  return sbit | (uint32_t)(e + f->bias) << f->mbits | mant;
}

static double decode(const fmt *f, uint32_t v) {
  uint32_t sign = (v >> (f->ebits + f->mbits)) & 1u;
  uint32_t ex = (v >> f->mbits) & ((1u << f->ebits) - 1);
  uint32_t mant = v & ((1u << f->mbits) - 1);
  double r;
  if (f->has_inf && ex == (1u << f->ebits) - 1) {
    r = mant ? NAN : INFINITY;
  } else if (!f->has_inf && ex == (1u << f->ebits) - 1 && mant == (1u << f->mbits) - 1) {
    r = NAN;
  } else if (ex == 0) {
    r = ldexp((double)mant, 1 - f->bias - f->mbits);
  } else {
    r = ldexp(1.0 + ldexp((double)mant, -f->mbits), (int)ex - f->bias);
  }
  return sign ? -r : r;
}

uint16_t smelt_f32_to_f16(float x) { return (uint16_t)encode(&F16, x); }
float smelt_f16_to_f32(uint16_t h) { return (float)decode(&F16, h); }
uint8_t smelt_f32_to_e4m3(float x) { return (uint8_t)encode(&E4M3, x); }
float smelt_e4m3_to_f32(uint8_t v) { return (float)decode(&E4M3, v); }
uint8_t smelt_f32_to_e5m2(float x) { return (uint8_t)encode(&E5M2, x); }
float smelt_e5m2_to_f32(uint8_t v) { return (float)decode(&E5M2, v); }

uint16_t smelt_f32_to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even; overflow carries to inf */
  return (uint16_t)(u >> 16);
}

float smelt_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

double smelt__load_f64(const void *base, smelt_dtype dt, int64_t off) {
  const char *p = (const char *)base;
  switch (dt) {
    case SMELT_DTYPE_F64: return ((const double *)p)[off];
    case SMELT_DTYPE_F32: return ((const float *)p)[off];
    case SMELT_DTYPE_F16: return smelt_f16_to_f32(((const uint16_t *)p)[off]);
    case SMELT_DTYPE_BF16: return smelt_bf16_to_f32(((const uint16_t *)p)[off]);
    case SMELT_DTYPE_E4M3: return smelt_e4m3_to_f32(((const uint8_t *)p)[off]);
    case SMELT_DTYPE_E5M2: return smelt_e5m2_to_f32(((const uint8_t *)p)[off]);
    case SMELT_DTYPE_I8: return ((const int8_t *)p)[off];
    case SMELT_DTYPE_I32: return ((const int32_t *)p)[off];
    case SMELT_DTYPE_I64: return (double)((const int64_t *)p)[off];
    case SMELT_DTYPE_U8: return ((const uint8_t *)p)[off];
    case SMELT_DTYPE_BOOL: return ((const uint8_t *)p)[off] != 0;
    default: return NAN;
  }
}

double smelt__clamp_finite(smelt_dtype dt, double v) {
  double m;
  switch (dt) {
    case SMELT_DTYPE_F32: m = FLT_MAX; break;
    case SMELT_DTYPE_F16: m = 65504.0; break;
    case SMELT_DTYPE_BF16: m = 3.3895313892515355e38; break;
    default: return v;
  }
  const double f = (float)v;
  return f > m ? m : f < -m ? -m : f;
}

void smelt__store_f64(void *base, smelt_dtype dt, int64_t off, double v) {
  char *p = (char *)base;
  switch (dt) {
    case SMELT_DTYPE_F64: ((double *)p)[off] = v; break;
    /* Double to f16/bf16/fp8 goes through f32 first, as a GPU kernel with an f32
     * accumulator does; the double rounding this implies is what users get. */
    case SMELT_DTYPE_F32: ((float *)p)[off] = (float)v; break;
    case SMELT_DTYPE_F16: ((uint16_t *)p)[off] = smelt_f32_to_f16((float)v); break;
    case SMELT_DTYPE_BF16: ((uint16_t *)p)[off] = smelt_f32_to_bf16((float)v); break;
    case SMELT_DTYPE_E4M3: ((uint8_t *)p)[off] = smelt_f32_to_e4m3((float)v); break;
    case SMELT_DTYPE_E5M2: ((uint8_t *)p)[off] = smelt_f32_to_e5m2((float)v); break;
    case SMELT_DTYPE_I8: ((int8_t *)p)[off] = (int8_t)v; break;
    case SMELT_DTYPE_I32: ((int32_t *)p)[off] = (int32_t)v; break;
    case SMELT_DTYPE_I64: ((int64_t *)p)[off] = (int64_t)v; break;
    case SMELT_DTYPE_U8: ((uint8_t *)p)[off] = (uint8_t)v; break;
    case SMELT_DTYPE_BOOL: ((uint8_t *)p)[off] = v != 0; break;
    default: break;
  }
}
