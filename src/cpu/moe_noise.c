/* The noise of noisy top-k routing: a standard normal per (seed, token,
 * expert) from a counter-based generator (kernels/philox.cuh, which the
 * GPU router runs too), so a value depends on nothing but its key and
 * counter, not on the batch, its order or its split. */
#include "moe_cpu.h"

#include "../../kernels/philox.cuh"

void smelt__philox4x32_10(uint32_t ctr[4], const uint32_t key[2]) { smelt_philox4x32_10(ctr, key); }

double smelt__moe_normal(uint64_t seed, int64_t token, int64_t e) {
  return smelt_philox_normal(seed, (uint64_t)token, (uint32_t)e);
}
