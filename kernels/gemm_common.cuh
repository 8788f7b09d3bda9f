/* What every GEMM kernel shares: the launch parameters, locating a block's
 * work (problem, output tile, K range) in every mode, element loads and
 * stores of any dtype, the epilogue, and the split-K protocols.
 *
 * Prelude: GEMM_ACC, the accumulator (values of smelt_gemm_acc: 1 f32,
 * 2 f16, 3 f64, 4 i32). The epilogue computes in EPI_T: double for f64 and
 * i32 accumulators (exact for every int32), float otherwise. Split-K
 * partial sums are WS_T: f32 for f32 and f16 accumulators, else the
 * accumulator type.
 *
 * Dtype codes are smelt_dtype's (0 f64, 1 f32, 2 f16, 3 bf16, 4 e4m3,
 * 5 e5m2, 6 i8, 7 i32); C, D and bias dtypes are run-time parameters, so one
 * module serves every output type: a uniform branch per element in the
 * epilogue costs nothing next to the main loop.
 */
#ifndef SMELT_GEMM_COMMON_CUH
#define SMELT_GEMM_COMMON_CUH

#include "smelt_device.cuh"

#if !defined(GEMM_ACC)
#error "GEMM kernels need GEMM_ACC"
#endif

#define DT_F64 0
#define DT_F32 1
#define DT_F16 2
#define DT_BF16 3
#define DT_E4M3 4
#define DT_E5M2 5
#define DT_I8 6
#define DT_I32 7

#define ACC_F32 1
#define ACC_F16 2
#define ACC_F64 3
#define ACC_I32 4

/* Modes as the host encodes them. */
#define MODE_PLAIN 0
#define MODE_SERIAL 1   /* split-K, slices add in turn into the workspace */
#define MODE_PARALLEL 2 /* split-K, slices write partials; gemm_reduce finishes */
#define MODE_BATCHED 3
#define MODE_ARRAY 4
#define MODE_GROUPED 5
#define MODE_GROUPED_OFFS 6 /* grouped by device offsets: blocks find their group from P.offs */

#if GEMM_ACC == ACC_F64 || GEMM_ACC == ACC_I32
typedef double epi_t;
#define EPI_DOUBLE 1
#else
typedef float epi_t;
#define EPI_DOUBLE 0
#endif
#if GEMM_ACC == ACC_F64
typedef double ws_t;
#elif GEMM_ACC == ACC_I32
typedef int ws_t;
#else
typedef float ws_t;
#endif

/* One problem (layout mirrored by smelt__gemm_kprob in src/cuda/gemm_cuda.h).
 * Element (r, c) of X is at X + (r * X_rs + c * X_cs) * size. */
typedef struct gemm_prob {
  i64 m, n, k;
  u64 a, b, c, d, bias;
  i64 a_rs, a_cs, b_rs, b_cs, c_rs, c_cs, d_rs, d_cs, bias_s;
  u64 sa, sb;    /* f32 row scales of A [m] and column scales of B [n] (has_sa, has_sb) */
  i64 sa_s, sb_s;
} gemm_prob;

/* Launch parameters (mirrored by smelt__gemm_kparams). */
typedef struct gemm_params {
  gemm_prob p;                  /* the problem (array mode: the template) */
  i64 a_bs, b_bs, c_bs, d_bs;   /* batched: batch strides in elements */
  i64 k_slice;                  /* split-K: K per slice, a multiple of the tile's K */
  u64 groups;                   /* grouped: gemm_prob[count] in device memory */
  u64 group_tiles;              /* grouped: i64[count + 1], first tile of each group */
  u64 ptr_a, ptr_b, ptr_c, ptr_d; /* array: device arrays of count pointers */
  u64 workspace;                /* split-K partial sums (ws_t) */
  u64 semaphores;               /* split-K serial: one int per output tile */
  double alpha_ab;              /* alpha * scale_a * scale_b */
  double beta;
  float scale_d, slope;
  int mode, count, splits, batch_base;
  int dt_a, dt_b, dt_c, dt_d, dt_bias;
  int act, clamp, has_c, has_bias;
  int swizzle;                  /* rasterization band height in tiles (>= 1) */
  int tiles_m, tiles_n;         /* output tiles of p (all modes but grouped; grouped by offsets: tiles_n) */
  u64 offs;                     /* grouped by offsets: count row ends, i32 or i64 (offs_i64) */
  i64 bias_gs;                  /* grouped by offsets: stride between the groups' bias rows */
  int offs_i64, offs_pad;
  i64 sb_gs;                    /* grouped by offsets: stride between the groups' sb rows */
  int has_sa, has_sb;           /* p.sa, p.sb are read */
  int sk_tiles, sk_chunks;      /* Hopper, plain: the last sk_tiles tiles run in sk_chunks K chunks (0: none) */
} gemm_params;

static_assert(sizeof(gemm_prob) == 168, "gemm_prob must match smelt__gemm_kprob");
static_assert(sizeof(gemm_params) == 408, "gemm_params must match smelt__gemm_kparams");

static __device__ __forceinline__ int gemm_esize(int dt) {
  return dt == DT_F64 ? 8 : (dt == DT_F32 || dt == DT_I32) ? 4 : (dt == DT_F16 || dt == DT_BF16) ? 2 : 1;
}

/* ---------------------------------------------------------------- fp8 */

/* Exact fp8 -> f32. e4m3: all-ones exponent and mantissa is NaN, no inf.
 * e5m2 is the high byte of an f16. */
static __device__ __forceinline__ float gemm_e4m3_to_f32(u32 b) {
  if ((b & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);
  /* The bits placed in an f16 with bias 15 instead of 7: the value times 2^-8,
   * subnormals included. */
  smelt_h16 h = (smelt_h16)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
  return smelt_f16_to_f32(h) * 256.0f;
}
static __device__ __forceinline__ float gemm_e5m2_to_f32(u32 b) { return smelt_f16_to_f32((smelt_h16)(b << 8)); }

/* f32 -> fp8, round to nearest even, saturating to +-max (inf too); NaN stays
 * NaN. The same rule as the host's smelt_f32_to_e4m3 / _e5m2. */
static __device__ __forceinline__ u32 gemm_f32_to_fp8(float x, int mbits, int bias, float maxv, u32 maxcode,
                                                      u32 nancode) {
  u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
  if (x != x) return sign | nancode;
  float a = fabsf(x);
  if (a >= maxv) return sign | maxcode;
  const int emin = 1 - bias;
  int e = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;
  if (e < emin) e = emin;
  /* r counts quanta of 2^(e - mbits); scaling by a power of two is exact. */
  float r = rintf(a * __uint_as_float((u32)(127 - (e - mbits)) << 23));
  if (r == 0.f) return sign;
  /* r in [1, 2^(mbits+1)]: below 2^mbits only at emin (a subnormal code, whose
   * value is r itself); 2^(mbits+1) is the next binade. */
  if (r >= (float)(2 << mbits)) {
    r *= 0.5f;
    e += 1;
  }
  u32 ri = (u32)r;
  if (ri < (1u << mbits)) return sign | ri;
  return sign | ((u32)(e + bias) << mbits) | (ri - (1u << mbits));
}
static __device__ __forceinline__ u32 gemm_f32_to_e4m3(float x) { return gemm_f32_to_fp8(x, 3, 7, 448.f, 0x7eu, 0x7fu); }
static __device__ __forceinline__ u32 gemm_f32_to_e5m2(float x) {
  return gemm_f32_to_fp8(x, 2, 15, 57344.f, 0x7bu, 0x7eu);
}

/* ---------------------------------------------------------------- element access */

/* Any float dtype as f32 (exact for all but f64, which rounds). */
static __device__ __forceinline__ float gemm_loadf(const void *base, int dt, i64 off) {
  switch (dt) {
    case DT_F64: return (float)((const double *)base)[off];
    case DT_F32: return ((const float *)base)[off];
    case DT_F16: return smelt_f16_to_f32(((const smelt_h16 *)base)[off]);
    case DT_BF16: return smelt_bf16_to_f32(((const smelt_h16 *)base)[off]);
    case DT_E4M3: return gemm_e4m3_to_f32(((const unsigned char *)base)[off]);
    case DT_E5M2: return gemm_e5m2_to_f32(((const unsigned char *)base)[off]);
    case DT_I8: return (float)((const signed char *)base)[off];
    default: return (float)((const int *)base)[off];
  }
}

/* Any dtype in the epilogue type. */
static __device__ __forceinline__ epi_t gemm_load_epi(const void *base, int dt, i64 off) {
#if EPI_DOUBLE
  if (dt == DT_F64) return ((const double *)base)[off];
  if (dt == DT_I32) return (double)((const int *)base)[off];
#endif
  return (epi_t)gemm_loadf(base, dt, off);
}

static __device__ __forceinline__ float gemm_clampf(float v, float m) { return v > m ? m : v < -m ? -m : v; }

/* Round to nearest even and saturate to [lo, hi]; NaN gives 0. */
static __device__ __forceinline__ int gemm_to_int(epi_t v, int lo, int hi) {
  if (v != v) return 0;
#if EPI_DOUBLE
  epi_t r = rint(v);
#else
  epi_t r = rintf(v);
#endif
  /* (float)INT_MAX is 2^31: anything at or past it saturates. */
  if (r <= (epi_t)lo) return lo;
  if (r >= (epi_t)hi) return hi;
  return (int)r;
}

#define GEMM_F32_MAX __uint_as_float(0x7f7fffffu)
#define GEMM_BF16_MAX __uint_as_float(0x7f7f0000u)

/* Stores v with the conversion rules of smelt/gemm.h. */
static __device__ __forceinline__ void gemm_store(void *base, int dt, i64 off, epi_t v, int clamp) {
  switch (dt) {
    case DT_F64: ((double *)base)[off] = (double)v; return;
    case DT_I8: ((signed char *)base)[off] = (signed char)gemm_to_int(v, -128, 127); return;
    case DT_I32: ((int *)base)[off] = gemm_to_int(v, -2147483647 - 1, 2147483647); return;
    default: break;
  }
  float f = (float)v;
  switch (dt) {
    case DT_F32: ((float *)base)[off] = clamp ? gemm_clampf(f, GEMM_F32_MAX) : f; return;
    case DT_F16: ((smelt_h16 *)base)[off] = smelt_f32_to_f16(clamp ? gemm_clampf(f, 65504.f) : f); return;
    case DT_BF16: ((smelt_h16 *)base)[off] = smelt_f32_to_bf16(clamp ? gemm_clampf(f, GEMM_BF16_MAX) : f); return;
    case DT_E4M3: ((unsigned char *)base)[off] = (unsigned char)gemm_f32_to_e4m3(f); return;
    default: ((unsigned char *)base)[off] = (unsigned char)gemm_f32_to_e5m2(f); return;
  }
}

/* ---------------------------------------------------------------- epilogue */

/* Activation codes (ACT_*, the values of smelt_act) come from smelt_device.cuh. */
#if EPI_DOUBLE
#define EPI_EXP exp
#define EPI_TANH tanh
#define EPI_ERFC erfc
#define EPI_MIN fmin
#define EPI_MAX fmax
#else
#define EPI_EXP expf
#define EPI_TANH tanhf
#define EPI_ERFC erfcf
#define EPI_MIN fminf
#define EPI_MAX fmaxf
#endif

/* alpha_ab * sa[r] * sb[c] (smelt_gemm_scales; 1 where absent), in this
 * order so that it is alpha_ab exactly when both are 1. */
static __device__ __forceinline__ epi_t gemm_scale_rc(const gemm_params &P, const gemm_prob &p, i64 r, i64 c) {
  epi_t s = (epi_t)P.alpha_ab;
  if (P.has_sa) s *= (epi_t)((const float *)p.sa)[r * p.sa_s];
  if (P.has_sb) s *= (epi_t)((const float *)p.sb)[c * p.sb_s];
  return s;
}

/* smelt_act_apply in epi_t, in forms without cancellation (gelu through
 * erfc, gelu_tanh as x * sigmoid(2z) = 0.5 x (1 + tanh z)). The accurate
 * math functions: the epilogue runs once per output element, next to K
 * multiply-adds. */
static __device__ __forceinline__ epi_t gemm_act(epi_t x, int act, epi_t slope) {
  switch (act) {
    case ACT_RELU: return x < (epi_t)0 ? (epi_t)0 : x;
    case ACT_LEAKY_RELU: return x >= (epi_t)0 ? x : slope * x;
    case ACT_TANH: return EPI_TANH(x);
    case ACT_SIGMOID: return (epi_t)1 / ((epi_t)1 + EPI_EXP(-x));
    case ACT_SILU: return x / ((epi_t)1 + EPI_EXP(-x));
    case ACT_HARDSWISH: return x * EPI_MIN(EPI_MAX(x + (epi_t)3, (epi_t)0), (epi_t)6) / (epi_t)6;
    case ACT_GELU: return (epi_t)0.5 * x * EPI_ERFC(x * (epi_t)-0.70710678118654752440);
    case ACT_GELU_TANH: {
      epi_t z = (epi_t)0.7978845608 * (x + (epi_t)0.044715 * x * x * x);
      return x / ((epi_t)1 + EPI_EXP((epi_t)-2 * z));
    }
    default: return x;
  }
}

/* The value D[r, c] gets before conversion:
 * scale_d * act(alpha_ab * sa[r] * sb[c] * acc + beta * C[r, c] + bias[c]). */
static __device__ __forceinline__ epi_t gemm_epi_value(const gemm_params &P, const gemm_prob &p, i64 r, i64 c,
                                                       epi_t acc) {
  epi_t v = gemm_scale_rc(P, p, r, c) * acc;
  if (P.has_c) v += (epi_t)P.beta * gemm_load_epi((const void *)p.c, P.dt_c, r * p.c_rs + c * p.c_cs);
  if (P.has_bias) v += gemm_load_epi((const void *)p.bias, P.dt_bias, c * p.bias_s);
  return gemm_act(v, P.act, (epi_t)P.slope) * (epi_t)P.scale_d;
}

static __device__ __forceinline__ void gemm_epilogue(const gemm_params &P, const gemm_prob &p, i64 r, i64 c,
                                                     epi_t acc) {
  gemm_store((void *)p.d, P.dt_d, r * p.d_rs + c * p.d_cs, gemm_epi_value(P, p, r, c, acc), P.clamp);
}

/* ---------------------------------------------------------------- locating the work */

/* A block's work: its problem (pointers moved to its batch or array entry),
 * its output tile, its K range and split slice. */
typedef struct gemm_work {
  gemm_prob p;
  int tm, tn;   /* output tile coordinates */
  i64 k0, k1;   /* K range [k0, k1) */
  int slice;
  i64 tile_id;  /* tm * tiles_n + tn: split-K semaphore and workspace index */
} gemm_work;

/* Tile t of a tiles_m x tiles_n grid in bands of `band` tile rows: within a
 * band, tiles go down the column first, so the blocks running at once share
 * a few B column tiles and a band's A rows (the usual L2 swizzle). Tile
 * counts fit an int (the grid's x dimension holds them). */
static __device__ __forceinline__ void gemm_raster(int t, int tiles_m, int tiles_n, int band, int *tm, int *tn) {
  if (band > tiles_m) band = tiles_m;
  const int span = band * tiles_n;
  const int grp = t / span;
  const int first = grp * band;
  const int rows = tiles_m - first < band ? tiles_m - first : band;
  const int r = t - grp * span;
  *tm = first + r % rows;
  *tn = r / rows;
}

static __device__ __forceinline__ u64 gemm_offset(u64 base, i64 elems, int dt) {
  return base + (u64)(elems * gemm_esize(dt));
}

static __device__ __forceinline__ i64 gemm_offs_at(const gemm_params &P, int g) {
  return P.offs_i64 ? ((const i64 *)P.offs)[g] : (i64)((const int *)P.offs)[g];
}

/* Grouped by offsets (device scheduling): P.p is all T rows of the stacked
 * A, C and D; the host launched an upper bound of tiles, (ceil(T / BM) + G)
 * x tiles_n, without reading the offsets. Linear tile t belongs to the group
 * whose tiles (ceil(rows / BM) x tiles_n, in group order) cover it; blocks
 * past the last real tile get w.tm = -1 and must exit. Each warp scans the
 * offsets 32 groups at a time on its own (a prefix max for the clamped ends
 * of smelt/gemm.h, a prefix sum of the tile counts), so the block agrees
 * without shared memory or a barrier; the offsets are the same few bytes
 * for every block, served from L1/L2. */
static __device__ __forceinline__ void gemm_locate_offs(const gemm_params &P, int BM, gemm_work &w) {
  const unsigned full = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const i64 T = P.p.m, t = blockIdx.x, tn = P.tiles_n;
  w.p = P.p;
  w.tm = -1;
  w.tn = 0;
  w.tile_id = 0;
  w.k1 = P.p.k;
  i64 end = 0, tiles = 0; /* clamped end and tile count of the groups before this chunk */
  for (int base = 0; base < P.count; base += 32) {
    const int g = base + lane, real = g < P.count;
    i64 e = real ? gemm_offs_at(P, g) : end;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const i64 o = __shfl_up_sync(full, e, d);
      if (lane >= d && o > e) e = o;
    }
    e = e < end ? end : e > T ? T : e;
    i64 s = __shfl_up_sync(full, e, 1);
    if (lane == 0) s = end;
    const i64 n = real ? (e - s + BM - 1) / BM * tn : 0;
    i64 c = n;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const i64 o = __shfl_up_sync(full, c, d);
      if (lane >= d) c += o;
    }
    const i64 before = tiles + c - n;
    const unsigned hit = __ballot_sync(full, real && t >= before && t < before + n);
    if (hit) {
      const int src = __ffs(hit) - 1, grp = base + src;
      const i64 r0 = __shfl_sync(full, s, src), r1 = __shfl_sync(full, e, src);
      const i64 first = __shfl_sync(full, before, src);
      w.p.m = r1 - r0;
      w.p.a = gemm_offset(w.p.a, r0 * w.p.a_rs, P.dt_a);
      w.p.b = gemm_offset(w.p.b, (i64)grp * P.b_bs, P.dt_b);
      if (P.has_c) w.p.c = gemm_offset(w.p.c, r0 * w.p.c_rs, P.dt_c);
      w.p.d = gemm_offset(w.p.d, r0 * w.p.d_rs, P.dt_d);
      if (P.has_bias) w.p.bias = gemm_offset(w.p.bias, (i64)grp * P.bias_gs, P.dt_bias);
      if (P.has_sa) w.p.sa = gemm_offset(w.p.sa, r0 * w.p.sa_s, DT_F32);
      if (P.has_sb) w.p.sb = gemm_offset(w.p.sb, (i64)grp * P.sb_gs, DT_F32);
      gemm_raster((int)(t - first), (int)((w.p.m + BM - 1) / BM), P.tiles_n, P.swizzle, &w.tm, &w.tn);
      w.tile_id = (i64)w.tm * P.tiles_n + w.tn;
      return;
    }
    end = __shfl_sync(full, e, 31);
    tiles += __shfl_sync(full, c, 31);
  }
}

/* Fills w for this block; tile sizes BM x BN. In MODE_GROUPED_OFFS a block
 * without a tile gets w.tm = -1 (the kernel returns at once). */
static __device__ __forceinline__ void gemm_locate(const gemm_params &P, int BM, int BN, gemm_work &w) {
  w.slice = 0;
  w.k0 = 0;
  if (P.mode == MODE_GROUPED_OFFS) {
    gemm_locate_offs(P, BM, w);
    return;
  }
  if (P.mode == MODE_GROUPED) {
    const i64 *first = (const i64 *)P.group_tiles;
    const i64 t = blockIdx.x;
    int lo = 0, hi = P.count - 1; /* the last group whose first tile is <= t */
    while (lo < hi) {
      int mid = (lo + hi + 1) >> 1;
      if (first[mid] <= t) lo = mid;
      else hi = mid - 1;
    }
    w.p = ((const gemm_prob *)P.groups)[lo];
    int tiles_m = (int)((w.p.m + BM - 1) / BM), tiles_n = (int)((w.p.n + BN - 1) / BN);
    gemm_raster((int)(t - first[lo]), tiles_m, tiles_n, P.swizzle, &w.tm, &w.tn);
    w.tile_id = (i64)w.tm * tiles_n + w.tn;
    w.k1 = w.p.k;
    return;
  }
  w.p = P.p;
  const int z = (int)blockIdx.z + P.batch_base;
  if (P.mode == MODE_BATCHED) {
    w.p.a = gemm_offset(w.p.a, z * P.a_bs, P.dt_a);
    w.p.b = gemm_offset(w.p.b, z * P.b_bs, P.dt_b);
    if (P.has_c) w.p.c = gemm_offset(w.p.c, z * P.c_bs, P.dt_c);
    w.p.d = gemm_offset(w.p.d, z * P.d_bs, P.dt_d);
  } else if (P.mode == MODE_ARRAY) {
    w.p.a = ((const u64 *)P.ptr_a)[z];
    w.p.b = ((const u64 *)P.ptr_b)[z];
    if (P.has_c) w.p.c = ((const u64 *)P.ptr_c)[z];
    w.p.d = ((const u64 *)P.ptr_d)[z];
  }
  gemm_raster((int)blockIdx.x, P.tiles_m, P.tiles_n, P.swizzle, &w.tm, &w.tn);
  w.tile_id = (i64)w.tm * P.tiles_n + w.tn;
  w.k1 = w.p.k;
  if (P.mode == MODE_SERIAL || P.mode == MODE_PARALLEL) {
    w.slice = z;
    w.k0 = (i64)z * P.k_slice;
    if (w.k0 > w.p.k) w.k0 = w.p.k;
    w.k1 = w.k0 + P.k_slice < w.p.k ? w.k0 + P.k_slice : w.p.k;
  }
}

/* ---------------------------------------------------------------- split-K */

/* Workspace access that bypasses L1: the partial sums of a serial split are
 * written and read by different blocks, and L1 is not coherent. */
static __device__ __forceinline__ ws_t gemm_ws_load(const ws_t *p) {
#if GEMM_ACC == ACC_F64
  double v;
  asm volatile("ld.global.cg.f64 %0, [%1];" : "=d"(v) : "l"(p));
#elif GEMM_ACC == ACC_I32
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
#else
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
#endif
  return v;
}

/* Serial split-K: waits until the slices before this one are done with the
 * tile (they run earlier in launch order, so this never deadlocks). */
static __device__ __forceinline__ void gemm_serial_wait(const gemm_params &P, const gemm_work &w) {
  if (threadIdx.x == 0 && w.slice > 0) {
    const int *sem = (const int *)P.semaphores + w.tile_id;
    int v;
    do v = smelt_ld_acquire(sem);
    while (v != w.slice);
  }
  __syncthreads();
}

/* Serial split-K: hands the tile to the next slice once every thread's
 * partial sums are in the workspace. */
static __device__ __forceinline__ void gemm_serial_signal(const gemm_params &P, const gemm_work &w) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    smelt_st_release((int *)P.semaphores + w.tile_id, w.slice + 1);
  }
}

static __device__ __forceinline__ ws_t gemm_ws_add(ws_t a, ws_t b) {
#if GEMM_ACC == ACC_I32
  return (int)((u32)a + (u32)b); /* wraps, as the i32 accumulator does */
#else
  return a + b;
#endif
}

#if defined(SMELT_EPI_GRAPH)
#include "gemm_epi_graph.cuh"
#else
#define EPI_KPARAM
#define EPI_FPARAM
#define EPI_ARG
#endif

/* Everything after the main loop, for every kernel and mode. The block's
 * accumulators are in shared memory, tile[r * ld + c] for the BM x BN output
 * tile (synchronized by the caller); consecutive threads take consecutive
 * columns, so D, C and the workspace are accessed in whole rows and the
 * epilogue's code exists once instead of once per accumulator register.
 *   parallel split: write this slice's partial sums, gemm_reduce finishes;
 *   serial split: add the previous slices' sums, pass them on or, in the
 *     last slice, apply the epilogue;
 *   otherwise: apply the epilogue. */
static __device__ __forceinline__ void gemm_finish(const gemm_params &P, const gemm_work &w, const ws_t *tile, int ld,
                                                   int BM, int BN, int NT EPI_FPARAM) {
#if defined(SMELT_EPI_GRAPH)
  /* An epilogue graph: plain mode only (the host plans no other). */
  gemm_finish_graph(P, w, tile, ld, BM, BN, NT, E);
  return;
#endif
  const gemm_prob &p = w.p;
  const i64 m0 = (i64)w.tm * BM, n0 = (i64)w.tn * BN;
  const int rows = p.m - m0 < BM ? (int)(p.m - m0) : BM, cols = p.n - n0 < BN ? (int)(p.n - n0) : BN;
  ws_t *ws = (ws_t *)P.workspace;
  if (P.mode == MODE_PARALLEL) {
    ws += (i64)w.slice * p.m * p.n;
#pragma unroll 2
    for (int e = threadIdx.x; e < BM * BN; e += NT) {
      const int r = e / BN, c = e % BN;
      if (r < rows && c < cols) ws[(m0 + r) * p.n + n0 + c] = tile[r * ld + c];
    }
    return;
  }
  const int serial = P.mode == MODE_SERIAL, last = !serial || w.slice + 1 == P.splits;
  if (serial) gemm_serial_wait(P, w);
#pragma unroll 2
  for (int e = threadIdx.x; e < BM * BN; e += NT) {
    const int r = e / BN, c = e % BN;
    if (r >= rows || c >= cols) continue;
    ws_t v = tile[r * ld + c];
    ws_t *at = ws + (m0 + r) * p.n + n0 + c;
    if (serial && w.slice > 0) v = gemm_ws_add(gemm_ws_load(at), v);
    if (last) gemm_epilogue(P, p, m0 + r, n0 + c, (epi_t)v);
    else *at = v;
  }
  if (!last) gemm_serial_signal(P, w);
}

#endif /* SMELT_GEMM_COMMON_CUH */
