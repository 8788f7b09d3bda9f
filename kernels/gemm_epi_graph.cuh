/* The GEMM kernels' epilogue with an epilogue graph (smelt/epilogue.h),
 * included by gemm_common.cuh when the prelude defines SMELT_EPI_GRAPH.
 *
 * The prelude (src/cuda/epi_graph_gen.c) brings the graph as code:
 * EPI_GRAPH_BODY, the body of epi_graph_value below, which computes every
 * node of one element, does its STOREs, leaves the value each reduction
 * takes in red[] (|x| for abs-max) and returns D's value; EPI_NRED
 * reductions, each described by EPI_RED_ROW(j) (1: a row reduction, over
 * N), EPI_RED_SUM(j) (1: a sum) and EPI_RED_AMAX(j) (1: an abs-max; with
 * neither, a max).
 *
 * Reductions are deterministic without atomics. Each writes f32 partials
 * to E.part[j], [chunks][len] with len M (row reductions) or N (column
 * ones), every partial written by one thread in an order fixed by the
 * kernel's shape; gemm_epi_reduce.cu then combines the chunks of each
 * element in ascending order. A row partial covers 32 columns (one warp,
 * or half-warp in the Hopper kernel, reduced by a fixed butterfly); a
 * column partial covers the rows one thread (or warp) visits in a tile.
 * Chunk counts, as the host sizes them (src/cuda/gemm_epi.c): rows,
 * ceil(N / 32); columns, tiles_m * (NT / BN) in gemm_finish_graph and
 * ceil(M / 64) * 4 in gemm_graph_chunk (the Hopper kernel). */
#ifndef SMELT_GEMM_EPI_GRAPH_CUH
#define SMELT_GEMM_EPI_GRAPH_CUH

#define EPI_MAX_SLOTS 8

/* The run's slot tensors and partials (mirrored by smelt__epi_kptrs in
 * src/cuda/gemm_cuda.h): element (r, c) of slot s is at data[s] +
 * (r * rs[s] + c * cs[s]) * its dtype's size. */
typedef struct epi_ptrs {
  u64 data[EPI_MAX_SLOTS];
  i64 rs[EPI_MAX_SLOTS], cs[EPI_MAX_SLOTS];
  u64 part[EPI_MAX_SLOTS]; /* per reduction: f32 partials [chunks][len] */
} epi_ptrs;

static_assert(sizeof(epi_ptrs) == 256, "epi_ptrs must match smelt__epi_kptrs");

/* The kernels' extra parameter and its forwarding (empty without a graph). */
#define EPI_KPARAM , const __grid_constant__ epi_ptrs E
#define EPI_FPARAM , const epi_ptrs &E
#define EPI_ARG , E

#define EPI_NR (EPI_NRED > 0 ? EPI_NRED : 1)

/* max and min that return NaN when either side is NaN (fmax does not). */
static __device__ __forceinline__ epi_t epi_max(epi_t a, epi_t b) { return a > b || a != a ? a : b; }
static __device__ __forceinline__ epi_t epi_min(epi_t a, epi_t b) { return a < b || a != a ? a : b; }

static __device__ __forceinline__ epi_t epi_clamp(epi_t a, epi_t lo, epi_t hi) {
  return a != a ? a : a < lo ? lo : a > hi ? hi : a;
}

/* The value a tensor of type dt keeps of v (CAST). */
static __device__ __forceinline__ epi_t epi_cast(epi_t v, int dt) {
  const float f = (float)v;
  switch (dt) {
    case DT_F16: return (epi_t)smelt_f16_to_f32(smelt_f32_to_f16(f));
    case DT_BF16: return (epi_t)smelt_bf16_to_f32(smelt_f32_to_bf16(f));
    case DT_E4M3: return (epi_t)gemm_e4m3_to_f32(gemm_f32_to_e4m3(f));
    case DT_E5M2: return (epi_t)gemm_e5m2_to_f32(gemm_f32_to_e5m2(f));
    default: return (epi_t)f;
  }
}

/* The graph at element (r, c); acc is alpha · scales · (A @ B)[r, c]. */
static __device__ __forceinline__ epi_t epi_graph_value(const gemm_params &P, const gemm_prob &p, const epi_ptrs &E,
                                                        i64 r, i64 c, epi_t acc, epi_t *red) {
  EPI_GRAPH_BODY
}

/* Reduction j's identity: 0 for a sum or an abs-max, -inf for a max. */
static __device__ __forceinline__ epi_t epi_red_init(int j) {
  return EPI_RED_SUM(j) || EPI_RED_AMAX(j) ? (epi_t)0 : (epi_t)-__int_as_float(0x7f800000);
}

static __device__ __forceinline__ epi_t epi_red_add(int j, epi_t a, epi_t b) {
  return EPI_RED_SUM(j) ? a + b : epi_max(a, b);
}

/* D[r, c] and the element's reduction values (red[] unchanged outside D). */
static __device__ __forceinline__ void epi_graph_element(const gemm_params &P, const gemm_prob &p, const epi_ptrs &E,
                                                         i64 r, i64 c, epi_t acc, epi_t *red) {
  const epi_t v = epi_graph_value(P, p, E, r, c, gemm_scale_rc(P, p, r, c) * acc, red);
  gemm_store((void *)p.d, P.dt_d, r * p.d_rs + c * p.d_cs, v, P.clamp);
}

static __device__ __forceinline__ epi_t epi_shfl(epi_t v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

/* gemm_finish with a graph (plain mode; the SIMT and mma.sync kernels):
 * thread t takes elements t, t + NT, ... of the BM x BN tile, so a warp
 * covers 32 consecutive columns of one row (BN a multiple of 32) and a
 * thread always the same column (NT a multiple of BN), whose rows it
 * reduces in turn. */
static __device__ __forceinline__ void gemm_finish_graph(const gemm_params &P, const gemm_work &w, const ws_t *tile,
                                                         int ld, int BM, int BN, int NT, const epi_ptrs &E) {
  const gemm_prob &p = w.p;
  const i64 m0 = (i64)w.tm * BM, n0 = (i64)w.tn * BN;
  const int rows = p.m - m0 < BM ? (int)(p.m - m0) : BM, cols = p.n - n0 < BN ? (int)(p.n - n0) : BN;
  const int lane = threadIdx.x & 31;
  epi_t col[EPI_NR];
#pragma unroll
  for (int j = 0; j < EPI_NR; j++) col[j] = epi_red_init(j);
#pragma unroll 1
  for (int e = threadIdx.x; e < BM * BN; e += NT) {
    const int r = e / BN, c = e % BN;
    epi_t red[EPI_NR];
#pragma unroll
    for (int j = 0; j < EPI_NR; j++) red[j] = epi_red_init(j);
    if (r < rows && c < cols) epi_graph_element(P, p, E, m0 + r, n0 + c, (epi_t)tile[r * ld + c], red);
#pragma unroll
    for (int j = 0; j < EPI_NRED; j++) {
      if (!EPI_RED_ROW(j)) {
        col[j] = epi_red_add(j, col[j], red[j]);
        continue;
      }
      epi_t v = red[j];
#pragma unroll
      for (int s = 16; s >= 1; s >>= 1) v = epi_red_add(j, v, epi_shfl(v, s));
      if (lane == 0 && r < rows && c < cols) ((float *)E.part[j])[((n0 + c) / 32) * p.m + m0 + r] = (float)v;
    }
  }
  const int c = threadIdx.x % BN;
  const i64 chunk = (i64)w.tm * (NT / BN) + threadIdx.x / BN;
#pragma unroll
  for (int j = 0; j < EPI_NRED; j++)
    if (!EPI_RED_ROW(j) && c < cols) ((float *)E.part[j])[chunk * p.n + n0 + c] = (float)col[j];
}

/* The Hopper kernel's general epilogue with a graph: one consumer's chunk
 * of 64 rows x 32 columns (rows [m0, m0 + rows), columns [n0, n0 + cols))
 * of f32 accumulators in buf (leading dimension ld), 128 threads. Thread
 * t takes rows t / 16 + 8 i (i < 8) and columns 2 (t % 16) and the next,
 * so a half-warp covers one row's 32 columns, and warp w the rows 2w and
 * 2w + 1 modulo 8 of each of its columns. */
static __device__ __forceinline__ void gemm_graph_chunk(const gemm_params &P, const epi_ptrs &E, const float *buf,
                                                        int ld, i64 m0, i64 n0, int rows, int cols, int tid) {
  const gemm_prob &p = P.p;
  const int warp = tid >> 5, lane = tid & 31, cc = 2 * (tid & 15);
  epi_t col[EPI_NR][2];
#pragma unroll
  for (int j = 0; j < EPI_NR; j++) col[j][0] = col[j][1] = epi_red_init(j);
#pragma unroll 1
  for (int i = 0; i < 8; i++) {
    const int r = (tid >> 4) + 8 * i;
    epi_t row[EPI_NR];
#pragma unroll
    for (int j = 0; j < EPI_NR; j++) row[j] = epi_red_init(j);
#pragma unroll
    for (int h = 0; h < 2; h++) {
      epi_t red[EPI_NR];
#pragma unroll
      for (int j = 0; j < EPI_NR; j++) red[j] = epi_red_init(j);
      if (r < rows && cc + h < cols) epi_graph_element(P, p, E, m0 + r, n0 + cc + h, (epi_t)buf[r * ld + cc + h], red);
#pragma unroll
      for (int j = 0; j < EPI_NRED; j++) {
        if (EPI_RED_ROW(j)) row[j] = epi_red_add(j, row[j], red[j]);
        else col[j][h] = epi_red_add(j, col[j][h], red[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < EPI_NRED; j++) {
      if (!EPI_RED_ROW(j)) continue;
      epi_t v = row[j];
#pragma unroll
      for (int s = 8; s >= 1; s >>= 1) v = epi_red_add(j, v, epi_shfl(v, s));
      if ((lane & 15) == 0 && r < rows) ((float *)E.part[j])[(n0 / 32) * p.m + m0 + r] = (float)v;
    }
  }
  const i64 chunk = (m0 / 64) * 4 + warp;
#pragma unroll
  for (int j = 0; j < EPI_NRED; j++) {
    if (EPI_RED_ROW(j)) continue;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const epi_t v = epi_red_add(j, col[j][h], epi_shfl(col[j][h], 16));
      if (lane < 16 && m0 < p.m && cc + h < cols) ((float *)E.part[j])[chunk * p.n + n0 + cc + h] = (float)v;
    }
  }
}

#endif /* SMELT_GEMM_EPI_GRAPH_CUH */
