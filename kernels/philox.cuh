/* Counter-based random numbers written once for both sides: the CPU
 * reference includes this file as C (src/cpu/moe_noise.c), the kernels as
 * CUDA (kernels/moe_route.cu), so a value depends only on its key and
 * counter and both sides draw the same one. Philox-4x32-10 (Salmon et al.
 * 2011) with Random123's constants; its known-answer vectors are in
 * tests/test_moe.c. */
#ifndef SMELT_PHILOX_CUH
#define SMELT_PHILOX_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
typedef unsigned int smelt_ph_u32;
typedef unsigned long long smelt_ph_u64;
#define SMELT_PHF static __device__ __forceinline__
#else
#include <math.h>
#include <stdint.h>
typedef uint32_t smelt_ph_u32;
typedef uint64_t smelt_ph_u64;
#define SMELT_PHF static inline
#endif

/* ctr encrypted under key, in place. */
SMELT_PHF void smelt_philox4x32_10(smelt_ph_u32 ctr[4], const smelt_ph_u32 key_in[2]) {
  smelt_ph_u32 k0 = key_in[0], k1 = key_in[1];
  for (int round = 0; round < 10; round++) {
    if (round) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const smelt_ph_u64 p0 = (smelt_ph_u64)0xD2511F53u * ctr[0], p1 = (smelt_ph_u64)0xCD9E8D57u * ctr[2];
    const smelt_ph_u32 c1 = ctr[1], c3 = ctr[3];
    ctr[0] = (smelt_ph_u32)(p1 >> 32) ^ c1 ^ k0;
    ctr[1] = (smelt_ph_u32)p1;
    ctr[2] = (smelt_ph_u32)(p0 >> 32) ^ c3 ^ k1;
    ctr[3] = (smelt_ph_u32)p0;
  }
}

/* A standard normal for (seed, a 64-bit index, a 32-bit index): Box-Muller
 * on the first two words of the block, u0 in (0, 1] so the log stays
 * finite. In double on both sides. */
SMELT_PHF double smelt_philox_normal(smelt_ph_u64 seed, smelt_ph_u64 i, smelt_ph_u32 j) {
  smelt_ph_u32 ctr[4] = {j, (smelt_ph_u32)i, (smelt_ph_u32)(i >> 32), 0u};
  const smelt_ph_u32 key[2] = {(smelt_ph_u32)seed, (smelt_ph_u32)(seed >> 32)};
  smelt_philox4x32_10(ctr, key);
  const double u0 = ((double)ctr[0] + 1.0) * 2.3283064365386963e-10, u1 = (double)ctr[1] * 2.3283064365386963e-10;
  return sqrt(-2.0 * log(u0)) * cos(6.283185307179586 * u1);
}

#endif
