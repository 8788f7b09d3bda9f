/* Host-side data: seeded random inputs (never zeros: zeros hide wrong
 * indexing and make kernels look faster than they are), element access for
 * the dtypes the commands read back, and the comparison against the CPU
 * reference. Conversions go through the library's own host converters so the
 * tool rounds exactly as the library does. */
#include "cli.h"

#include <math.h>
#include <string.h>

/* splitmix64: tiny, fast, and good enough for test inputs. */
static uint64_t next_u64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void cli_fill_uniform(void *buf, smelt_dtype dt, size_t n, uint64_t seed, double lo, double hi) {
  uint64_t state = seed;
  for (size_t i = 0; i < n; i++) {
    double u = (double)(next_u64(&state) >> 11) * 0x1.0p-53;
    double v = lo + (hi - lo) * u;
    switch (dt) {
    case SMELT_DTYPE_F64: ((double *)buf)[i] = v; break;
    case SMELT_DTYPE_F32: ((float *)buf)[i] = (float)v; break;
    case SMELT_DTYPE_F16: ((uint16_t *)buf)[i] = smelt_f32_to_f16((float)v); break;
    case SMELT_DTYPE_BF16: ((uint16_t *)buf)[i] = smelt_f32_to_bf16((float)v); break;
    default: cli_fatal("cannot fill dtype %s with random values", smelt_dtype_name(dt));
    }
  }
}

void *cli_host_uniform(smelt_dtype dt, size_t n, uint64_t seed, double lo, double hi) {
  void *h = cli_malloc(n * smelt_dtype_size(dt));
  cli_fill_uniform(h, dt, n, seed, lo, hi);
  return h;
}

void cli_fill_bytes(void *buf, size_t bytes, uint64_t seed) {
  uint64_t state = seed;
  unsigned char *p = buf;
  for (size_t i = 0; i < bytes; i += 8) {
    uint64_t v = next_u64(&state);
    memcpy(p + i, &v, bytes - i < 8 ? bytes - i : 8);
  }
}

double cli_load(const void *buf, smelt_dtype dt, size_t i) {
  switch (dt) {
  case SMELT_DTYPE_F64: return ((const double *)buf)[i];
  case SMELT_DTYPE_F32: return ((const float *)buf)[i];
  case SMELT_DTYPE_F16: return smelt_f16_to_f32(((const uint16_t *)buf)[i]);
  case SMELT_DTYPE_BF16: return smelt_bf16_to_f32(((const uint16_t *)buf)[i]);
  case SMELT_DTYPE_I32: return ((const int32_t *)buf)[i];
  case SMELT_DTYPE_I64: return (double)((const int64_t *)buf)[i];
  default: cli_fatal("cannot read dtype %s", smelt_dtype_name(dt));
  }
}

cli_diff cli_compare(const void *got, const void *ref, smelt_dtype dt, size_t n) {
  cli_diff d = {0.0, 0, 0.0, 0};
  for (size_t i = 0; i < n; i++) {
    double g = cli_load(got, dt, i), r = cli_load(ref, dt, i);
    double e;
    if (isnan(g) || isnan(r))
      e = (isnan(g) && isnan(r)) ? 0.0 : INFINITY; /* NaN parity: both or neither */
    else if (g == r)
      e = 0.0; /* also covers equal infinities, whose difference is NaN */
    else
      e = fabs(g - r);
    if (e != 0.0) d.mismatches++;
    if (e > d.max_abs) {
      d.max_abs = e;
      d.where = i;
    }
    if (isfinite(r) && fabs(r) > d.max_ref) d.max_ref = fabs(r);
  }
  return d;
}
