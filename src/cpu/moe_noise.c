/* The noise of noisy top-k routing: a standard normal per (seed, token,
 * expert) from a counter-based generator, so a value depends on nothing
 * but its key and counter (not on the batch, its order or its split) and
 * the GPU can draw the same one in any thread. Philox-4x32-10 as Random123
 * defines it (its known-answer vectors are in tests/test_moe.c). */
#include "moe_cpu.h"

#include <math.h>

void smelt__philox4x32_10(uint32_t ctr[4], const uint32_t key_in[2]) {
  uint32_t key[2] = {key_in[0], key_in[1]};
  for (int round = 0; round < 10; round++) {
    if (round) {
      key[0] += 0x9E3779B9u;
      key[1] += 0xBB67AE85u;
    }
    const uint64_t p0 = (uint64_t)0xD2511F53u * ctr[0], p1 = (uint64_t)0xCD9E8D57u * ctr[2];
    const uint32_t c1 = ctr[1], c3 = ctr[3];
    ctr[0] = (uint32_t)(p1 >> 32) ^ c1 ^ key[0];
    ctr[1] = (uint32_t)p1;
    ctr[2] = (uint32_t)(p0 >> 32) ^ c3 ^ key[1];
    ctr[3] = (uint32_t)p0;
  }
}

/* Box-Muller on the first two words: u0 in (0, 1] keeps the log finite. */
double smelt__moe_normal(uint64_t seed, int64_t token, int64_t e) {
  uint32_t ctr[4] = {(uint32_t)e, (uint32_t)(uint64_t)token, (uint32_t)((uint64_t)token >> 32), 0};
  const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  smelt__philox4x32_10(ctr, key);
  const double u0 = ((double)ctr[0] + 1.0) * 0x1.0p-32, u1 = (double)ctr[1] * 0x1.0p-32;
  return sqrt(-2.0 * log(u0)) * cos(2.0 * M_PI * u1);
}
