/* Checked arithmetic for sizes, offsets and element counts computed from
 * caller input. A product of valid-looking dimensions can wrap (k * k with
 * k = 2^31, a row of 2^60 elements times 16 bytes); every such computation
 * goes through these, and an overflow becomes SMELT_STATUS_OVERFLOW naming
 * the op and the quantity, before anything is allocated or written. */
#ifndef SMELT_CHECKED_H
#define SMELT_CHECKED_H

#include "internal.h"

#include <stdint.h>
#include <unistd.h>

/* *out = a * b (a, b >= 0); OVERFLOW "<op>: <what> overflows" when it does
 * not fit in int64_t. */
static inline smelt_status smelt__mul_i64(int64_t a, int64_t b, int64_t *out, const char *op, const char *what) {
  if (__builtin_mul_overflow(a, b, out))
    return smelt__error(SMELT_STATUS_OVERFLOW, "%s: %s overflows (%lld x %lld)", op, what, (long long)a, (long long)b);
  return SMELT_OK;
}

/* *out = a + b, checked as above. */
static inline smelt_status smelt__add_i64(int64_t a, int64_t b, int64_t *out, const char *op, const char *what) {
  if (__builtin_add_overflow(a, b, out))
    return smelt__error(SMELT_STATUS_OVERFLOW, "%s: %s overflows (%lld + %lld)", op, what, (long long)a, (long long)b);
  return SMELT_OK;
}

/* Whether a host allocation of `bytes` can succeed at all: more than the
 * machine's physical memory is refused with OUT_OF_MEMORY before it is
 * attempted (an attempt can take the OOM killer's attention, or abort under
 * a sanitizer, instead of returning NULL). */
extern size_t smelt__host_limit; /* bytes; 0: the machine's physical memory (src/core/context.c) */
static inline smelt_status smelt__host_fits(size_t bytes, const char *op, const char *what) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (smelt__host_limit) pages = (long)(smelt__host_limit / (size_t)page);
  if (pages > 0 && page > 0 && bytes / (size_t)page > (size_t)pages)
    return smelt__error(SMELT_STATUS_OUT_OF_MEMORY,
                        "%s: %s needs %zu bytes (%.1f GiB) of host memory, more than this machine's %.1f GiB", op, what,
                        bytes, (double)bytes / 1073741824.0, (double)pages * (double)page / 1073741824.0);
  return SMELT_OK;
}

/* *out = n * elem_bytes as a host allocation size: OVERFLOW when it wraps,
 * OUT_OF_MEMORY when it is more than the machine holds. */
static inline smelt_status smelt__bytes(int64_t n, size_t elem_bytes, size_t *out, const char *op, const char *what) {
  if (n < 0 || __builtin_mul_overflow((uint64_t)n, (uint64_t)elem_bytes, out))
    return smelt__error(SMELT_STATUS_OVERFLOW, "%s: %s of %lld elements of %zu bytes overflows", op, what, (long long)n,
                        elem_bytes);
  return smelt__host_fits(*out, op, what);
}

#endif
