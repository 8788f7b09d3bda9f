/* The quantizers (include/smelt/quant.h) on the GPU, bit-identical to the
 * CPU reference because both run kernels/quant_math.cuh's definitions.
 *
 * One module per (SMELT_DT x dtype, SMELT_QFMT element format, SMELT_QKIND
 * smelt_quant_format). A lane owns 16 consecutive elements of a row: two or
 * four 16-byte loads where x's rows are contiguous and aligned, one 16-byte
 * store of fp8 codes (8 bytes of NVFP4 pairs) where q allows it, element by
 * element otherwise (strided x, ragged K). The block maximum is an exact
 * operation, so its order (warp shuffles, shared memory, atomics on the
 * bits of non-negative floats) cannot change a bit. Entry points:
 *   quant_seg     blocks of 16, 32 or 128 along K in one row (NVFP4, MXFP8,
 *                 1x128) and the per-tensor scale: a warp per 512 columns
 *                 of a row, a block's amax over its 1, 2 or 8 lanes.
 *   quant_row     per-row scales: tpr threads a row (a power of two, 32
 *                 to 256: enough for the row at HOLD chunks of 16 a thread
 *                 where they suffice), the row's amax over them, then the
 *                 codes from the same registers.
 *   quant_tile    128x128 scales: a CTA of 256 threads per block, 64
 *                 elements a thread held in registers, the block's amax,
 *                 then the codes from them.
 * Both thus read x once, as quant_seg does, with 32 (f16/bf16) or 64 bytes (f32) a
 * lane in flight per 16 elements and up to HOLD of them: the amax passes
 * that read a row or a tile and then read it again (by then evicted from
 * L2 by the other CTAs' rows) moved 5 bytes an element for the 3 counted.
 * A row longer than 256 x HOLD x 16 reads its further chunks twice.
 *   quant_amax    the tensor's amax into one f32 (per-tensor FP8, NVFP4's
 *                 tensor scale): a warp's maximum, one atomicMax per warp.
 *   quant_scalar  mode 0 zeroes that f32 before quant_amax; mode 1 turns
 *                 the amax into the scale in place.
 *   dequant       the way back, for checking: a thread per element. */
#include "smelt_device.cuh"
#include "quant_math.cuh"

#if !defined(SMELT_DT) || !defined(SMELT_QFMT) || !defined(SMELT_QKIND)
#error "quant.cu needs SMELT_DT, SMELT_QFMT and SMELT_QKIND"
#endif

/* The values of smelt_quant_format. */
#define QK_TENSOR 0
#define QK_ROW 1
#define QK_1X128 2
#define QK_128X128 3
#define QK_MXFP8 4
#define QK_NVFP4 5

#define EPL 16        /* elements per lane */
#define HOLD 4        /* chunks of 16 a thread holds from the amax to the codes (op_quant.c: HOLD_COLS) */
#define SEG (32 * EPL) /* columns per warp in quant_seg */
#define BLOCK 256

#if SMELT_QKIND == QK_NVFP4
#define BK 16
#elif SMELT_QKIND == QK_MXFP8
#define BK 32
#else
#define BK 128
#endif
#define GROUP (BK / EPL) /* lanes per scale block in quant_seg */

#define QUANT_PARAMS                                                                                   \
  const elem_t *__restrict__ x, i64 rows, i64 cols, i64 xrs, i64 xcs, int xvec, unsigned char *__restrict__ q, \
      i64 qrs, int qvec, void *scale, i64 srs, i64 scs, float *slot

/* An element as f32, keeping a NaN's sign (it picks the sign of the NaN
 * code) as the CPU reference's conversion does, whatever cvt does with it. */
static __device__ __forceinline__ float load_x(elem_t h) {
  const float f = load_elem(h);
#if SMELT_DT == SMELT_DT_F16
  if (smelt_q_isnan(f)) return __uint_as_float(0x7fc00000u | ((u32)h & 0x8000u) << 16);
#endif
  return f;
}

/* Lane's 16 elements of row r from column c0 (0 past the row's end). */
static __device__ __forceinline__ void load16(const elem_t *x, i64 r, i64 c0, i64 cols, i64 xrs, i64 xcs, int xvec,
                                              float v[EPL]) {
  const elem_t *row = x + r * xrs;
  if (xvec && c0 + EPL <= cols) {
    const uint4 *p = (const uint4 *)(row + c0);
#if SMELT_DT == SMELT_DT_F32
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const uint4 u = p[i];
      v[4 * i] = __uint_as_float(u.x);
      v[4 * i + 1] = __uint_as_float(u.y);
      v[4 * i + 2] = __uint_as_float(u.z);
      v[4 * i + 3] = __uint_as_float(u.w);
    }
#else
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const uint4 u = p[i];
      const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        v[8 * i + 2 * j] = load_x((elem_t)(w[j] & 0xffffu));
        v[8 * i + 2 * j + 1] = load_x((elem_t)(w[j] >> 16));
      }
    }
#endif
    return;
  }
#pragma unroll
  for (int i = 0; i < EPL; i++) v[i] = c0 + i < cols ? load_x(row[(c0 + i) * xcs]) : 0.0f;
}

#define WPL (EPL * (int)sizeof(elem_t) / 4) /* 32-bit words a lane's 16 elements take */

/* A chunk past the row's end or of a row past the last: 0 bits, which
 * leave the amax at +0 and are never encoded. */
static __device__ __forceinline__ void zero16w(u32 w[WPL]) {
#pragma unroll
  for (int i = 0; i < WPL; i++) w[i] = 0u;
}

/* Lane's 16 elements of a row from column c0 as their raw bits (0 past the
 * row's end): two to a word for f16 and bf16, one for f32. quant_row and
 * quant_tile hold these words from the amax to the codes rather than the
 * f32 values: half the registers for 16-bit x, so more CTAs fit an SM and
 * more bytes are in flight while others reduce and store. */
static __device__ __forceinline__ void load16w(const elem_t *row, i64 c0, i64 cols, i64 xcs, int xvec, u32 w[WPL]) {
  if (xvec && c0 + EPL <= cols) {
    const uint4 *p = (const uint4 *)(row + c0);
#pragma unroll
    for (int i = 0; i < WPL / 4; i++) {
      const uint4 u = p[i];
      w[4 * i] = u.x;
      w[4 * i + 1] = u.y;
      w[4 * i + 2] = u.z;
      w[4 * i + 3] = u.w;
    }
    return;
  }
  zero16w(w);
#pragma unroll
  for (int i = 0; i < EPL; i++)
    if (c0 + i < cols) {
#if SMELT_DT == SMELT_DT_F32
      w[i] = __float_as_uint(row[(c0 + i) * xcs]);
#else
      w[i / 2] |= (u32)row[(c0 + i) * xcs] << (16 * (i % 2));
#endif
    }
}

/* The f32 values of load16w's words (0 bits are 0.0f). */
static __device__ __forceinline__ void unpack16(const u32 w[WPL], float v[EPL]) {
#pragma unroll
  for (int i = 0; i < EPL; i++) {
#if SMELT_DT == SMELT_DT_F32
    v[i] = __uint_as_float(w[i]);
#else
    v[i] = load_x((elem_t)(w[i / 2] >> (16 * (i % 2))));
#endif
  }
}

/* A lane's 16 FP8 codes, packed four to a word, stored from column c0
 * (nothing past the row's end). */
static __device__ __forceinline__ void store16p(unsigned char *q, i64 r, i64 c0, i64 cols, i64 qrs, int qvec,
                                                const u32 p[4]) {
  unsigned char *row = q + r * qrs + c0;
  if (qvec && c0 + EPL <= cols) {
    *(uint4 *)row = make_uint4(p[0], p[1], p[2], p[3]);
    return;
  }
#pragma unroll
  for (int i = 0; i < EPL; i++)
    if (c0 + i < cols) row[i] = (unsigned char)(p[i / 4] >> (8 * (i % 4)));
}

/* Lane's codes stored from column c0 (nothing past the row's end; NVFP4's
 * odd tail gets a high nibble of 0, the code of the 0 loaded there). */
static __device__ __forceinline__ void store16(unsigned char *q, i64 r, i64 c0, i64 cols, i64 qrs, int qvec,
                                               const u32 code[EPL]) {
#if SMELT_QKIND == QK_NVFP4
  unsigned char *row = q + r * qrs + c0 / 2;
  u32 w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < EPL; i++) w[i / 8] |= code[i] << (4 * (i % 8));
  if (qvec && c0 + EPL <= cols) {
    *(uint2 *)row = make_uint2(w[0], w[1]);
    return;
  }
  const i64 bytes = ((cols - c0 < EPL ? cols - c0 : EPL) + 1) / 2;
#pragma unroll
  for (int b = 0; b < EPL / 2; b++) /* unrolled: w and code stay in registers */
    if (b < bytes) row[b] = (unsigned char)(w[b / 4] >> (8 * (b % 4)));
#else
  u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < EPL; i++) w[i / 4] |= code[i] << (8 * (i % 4));
  store16p(q, r, c0, cols, qrs, qvec, w);
#endif
}

static __device__ __forceinline__ float amax16(float m, const float v[EPL]) {
#pragma unroll
  for (int i = 0; i < EPL; i++) m = smelt_q_amax(m, v[i]);
  return m;
}

/* amax16 of load16w's words, kept as bits: for f16 and bf16 |x| is the
 * word's halves without their signs and max.{f16,bf16}x2 (sm_80) picks the
 * larger exactly, or the other operand where one is NaN (m starts at +0
 * and is never NaN), as smelt_q_amax does; amax_f32 gives the f32. Not
 * converting here also keeps the compiler from sharing the conversions
 * with encode16w's and so holding the f32 values after all. */
static __device__ __forceinline__ u32 amax16w(u32 m, const u32 w[WPL]) {
#pragma unroll
  for (int i = 0; i < WPL; i++) {
#if SMELT_DT == SMELT_DT_F32
    m = __float_as_uint(smelt_q_amax(__uint_as_float(m), __uint_as_float(w[i])));
#elif SMELT_DT == SMELT_DT_BF16
    asm("max.bf16x2 %0, %0, %1;" : "+r"(m) : "r"(w[i] & 0x7fff7fffu));
#else
    asm("max.f16x2 %0, %0, %1;" : "+r"(m) : "r"(w[i] & 0x7fff7fffu));
#endif
  }
  return m;
}

static __device__ __forceinline__ float amax_f32(u32 m) {
#if SMELT_DT == SMELT_DT_F32
  return __uint_as_float(m);
#else
  return smelt_q_amax(load_elem((elem_t)m), load_elem((elem_t)(m >> 16)));
#endif
}

/* The maximum over `lanes` neighbouring lanes (a power of two). */
static __device__ __forceinline__ float amax_lanes(float m, int lanes) {
  for (int o = 1; o < lanes; o <<= 1) m = smelt_q_amax(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

/* The codes of 16 elements under one block's factor: the f32 scale (FP8),
 * the E8M0 byte (MXFP8) or the divisor (NVFP4). */
static __device__ __forceinline__ void encode16(const float v[EPL], float s, u32 byte, u32 code[EPL]) {
#pragma unroll
  for (int i = 0; i < EPL; i++) {
#if SMELT_QKIND == QK_MXFP8
    code[i] = smelt_q_mx_elem(v[i], byte, SMELT_QFMT);
#elif SMELT_QKIND == QK_NVFP4
    code[i] = smelt_q_e2m1(v[i], s);
#else
    code[i] = smelt_q_fp8_elem(v[i], s, SMELT_QFMT);
#endif
  }
}

/* quant_row's and quant_tile's FP8 codes of load16w's words under the f32
 * scale s, packed four to a word as they go (the words store16 would make):
 * 4 registers live rather than 16 codes across encode's division calls. */
static __device__ __forceinline__ void encode16w(const u32 w[WPL], float s, u32 p[4]) {
  float v[EPL];
  unpack16(w, v);
#pragma unroll
  for (int i = 0; i < 4; i++) p[i] = 0u;
#pragma unroll
  for (int i = 0; i < EPL; i++) p[i / 4] |= smelt_q_fp8_elem(v[i], s, SMELT_QFMT) << (8 * (i % 4));
}

static __device__ __forceinline__ i64 warp_id() { return (i64)blockIdx.x * (BLOCK / 32) + threadIdx.x / 32; }
static __device__ __forceinline__ i64 warp_count() { return (i64)gridDim.x * (BLOCK / 32); }

extern "C" __global__ void __launch_bounds__(BLOCK) quant_seg(QUANT_PARAMS) {
  const int lane = threadIdx.x & 31;
  const i64 nseg = (cols + SEG - 1) / SEG, tasks = rows * nseg;
  for (i64 t = warp_id(); t < tasks; t += warp_count()) {
    const i64 r = t / nseg, c0 = (t % nseg) * SEG + (i64)lane * EPL;
    float v[EPL];
    u32 code[EPL];
    load16(x, r, c0, cols, xrs, xcs, xvec, v);
    float s = 0.0f;
    u32 byte = 0u;
#if SMELT_QKIND == QK_TENSOR
    s = *slot;
#else
    const float m = amax_lanes(amax16(0.0f, v), GROUP);
    const int writer = lane % GROUP == 0 && c0 < cols;
    const i64 so = r * srs + (c0 / BK) * scs;
#if SMELT_QKIND == QK_MXFP8
    byte = smelt_q_e8m0(m, SMELT_QFMT);
    if (writer) ((unsigned char *)scale)[so] = (unsigned char)byte;
#elif SMELT_QKIND == QK_NVFP4
    byte = smelt_q_nvfp4_block_scale(m, *slot);
    s = smelt_q_nvfp4_divisor(byte, *slot);
    if (writer) ((unsigned char *)scale)[so] = (unsigned char)byte;
#else
    s = smelt_q_fp8_scale(m, SMELT_QFMT);
    if (writer) ((float *)scale)[so] = s;
#endif
#endif
    if (c0 >= cols) continue;
    encode16(v, s, byte, code);
    store16(q, r, c0, cols, qrs, qvec, code);
  }
}

/* The maximum over the `lanes` (a power of two, up to BLOCK) threads that
 * share a row or a block: the warp's, then through red across the warps
 * of the group. Every thread of the CTA calls it, passing red[pass] with
 * pass alternating 0 and 1: a pass's red is refilled two passes on, after
 * every thread has passed the next pass's barrier and so done reading it,
 * so one barrier a pass suffices. */
static __device__ __forceinline__ float amax_group(float m, int lanes, float *red) {
  m = amax_lanes(m, lanes < 32 ? lanes : 32);
  if (lanes <= 32) return m;
  const int warp = threadIdx.x / 32, first = warp & ~(lanes / 32 - 1);
  if (threadIdx.x % 32 == 0) red[warp] = m;
  __syncthreads();
  for (int w = first; w < first + lanes / 32; w++) m = smelt_q_amax(m, red[w]);
  return m;
}

/* quant_row and quant_tile: each thread loads its HOLD chunks before it
 * uses any (a chunk's amax right after its load waited out each load in
 * turn: 32 bytes a thread in flight, not 128), holds them as load16w's
 * words (32 registers for f16 and bf16, not 64 of f32) and so fits
 * ROW_CTAS and TILE_CTAS CTAs an SM, not 2: one CTA's loads overlap the
 * others' reductions and stores. quant_row does not fit 64 registers
 * without spilling (its run-time tpr and its long-row loops), quant_tile
 * does. f32 x holds 64 registers of words and keeps 2 CTAs. op_quant.c
 * sizes the grid to what is resident. */
#if SMELT_DT == SMELT_DT_F32
#define ROW_CTAS 2
#define TILE_CTAS 2
#else
#define ROW_CTAS 3
#define TILE_CTAS 4
#endif

/* Each is compiled only into the modules op_quant.c runs it from. */
#if SMELT_QKIND == QK_ROW
extern "C" __global__ void __launch_bounds__(BLOCK, ROW_CTAS) quant_row(QUANT_PARAMS, int tpr) {
  __shared__ float red[2][BLOCK / 32];
  const int lt = threadIdx.x % tpr, rpc = BLOCK / tpr;
  const i64 step = (i64)tpr * EPL;
  int pass = 0;
  for (i64 r0 = (i64)blockIdx.x * rpc; r0 < rows; r0 += (i64)gridDim.x * rpc, pass ^= 1) {
    const i64 r = r0 + threadIdx.x / tpr;
    const int live = r < rows;
    u32 v[HOLD][WPL], m = 0u, code[4];
    /* The amax of the chunks past those held (rows longer than BLOCK
     * threads hold) first, while nothing is held; read again below. */
    for (i64 c0 = HOLD * step + (i64)lt * EPL; live && c0 < cols; c0 += step) {
      u32 w[WPL];
      load16w(x + r * xrs, c0, cols, xcs, xvec, w);
      m = amax16w(m, w);
    }
#pragma unroll
    for (int j = 0; j < HOLD; j++) {
      const i64 c0 = j * step + (i64)lt * EPL;
      if (live && c0 < cols) load16w(x + r * xrs, c0, cols, xcs, xvec, v[j]);
      else zero16w(v[j]);
    }
#pragma unroll
    for (int j = 0; j < HOLD; j++) m = amax16w(m, v[j]);
    const float s = smelt_q_fp8_scale(amax_group(amax_f32(m), tpr, red[pass]), SMELT_QFMT);
    if (!live) continue;
    if (lt == 0) ((float *)scale)[r * srs] = s;
#pragma unroll
    for (int j = 0; j < HOLD; j++) {
      const i64 c0 = j * step + (i64)lt * EPL;
      if (c0 >= cols) break;
      encode16w(v[j], s, code);
      store16p(q, r, c0, cols, qrs, qvec, code);
    }
    for (i64 c0 = HOLD * step + (i64)lt * EPL; c0 < cols; c0 += step) {
      u32 w[WPL];
      load16w(x + r * xrs, c0, cols, xcs, xvec, w);
      encode16w(w, s, code);
      store16p(q, r, c0, cols, qrs, qvec, code);
    }
  }
}
#endif

#if SMELT_QKIND == QK_128X128
/* quant_tile: 4 rows of a 128-wide block per warp pass, 8 lanes a row,
 * the block's 4 passes held. */
extern "C" __global__ void __launch_bounds__(BLOCK, TILE_CTAS) quant_tile(QUANT_PARAMS) {
  __shared__ float red[2][BLOCK / 32];
  static_assert(HOLD == 128 / (BLOCK / 8), "a thread holds its rows of the block");
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const i64 sr = (rows + 127) / 128, sc = (cols + 127) / 128;
  int pass = 0;
  for (i64 b = blockIdx.x; b < sr * sc; b += gridDim.x, pass ^= 1) {
    const i64 r0 = (b / sc) * 128, c0 = (b % sc) * 128 + (lane % 8) * EPL;
    u32 v[HOLD][WPL], m = 0u, code[4];
#pragma unroll
    for (int j = 0; j < HOLD; j++) {
      const i64 r = r0 + warp * 4 + lane / 8 + 32 * j;
      if (r < rows && c0 < cols) load16w(x + r * xrs, c0, cols, xcs, xvec, v[j]);
      else zero16w(v[j]);
    }
#pragma unroll
    for (int j = 0; j < HOLD; j++) m = amax16w(m, v[j]);
    const float s = smelt_q_fp8_scale(amax_group(amax_f32(m), BLOCK, red[pass]), SMELT_QFMT);
    if (threadIdx.x == 0) ((float *)scale)[(b / sc) * srs + (b % sc) * scs] = s;
#pragma unroll
    for (int j = 0; j < HOLD; j++) {
      const i64 r = r0 + warp * 4 + lane / 8 + 32 * j;
      if (r < rows && c0 < cols) {
        encode16w(v[j], s, code);
        store16p(q, r, c0, cols, qrs, qvec, code);
      }
    }
  }
}
#endif

extern "C" __global__ void __launch_bounds__(BLOCK) quant_amax(QUANT_PARAMS) {
  const int lane = threadIdx.x & 31;
  const i64 nseg = (cols + SEG - 1) / SEG, tasks = rows * nseg;
  float v[EPL], m = 0.0f;
  for (i64 t = warp_id(); t < tasks; t += warp_count()) {
    load16(x, t / nseg, (t % nseg) * SEG + (i64)lane * EPL, cols, xrs, xcs, xvec, v);
    m = amax16(m, v);
  }
  m = amax_lanes(m, 32);
  if (lane == 0 && m > 0.0f) atomicMax((unsigned int *)slot, __float_as_uint(m));
}

extern "C" __global__ void quant_scalar(float *slot, int mode) {
  if (mode == 0) *slot = 0.0f;
#if SMELT_QKIND == QK_NVFP4
  else *slot = smelt_q_nvfp4_tensor_scale(*slot);
#else
  else *slot = smelt_q_fp8_scale(*slot, SMELT_QFMT);
#endif
}

/* The dequantizer, element by element over any strides of y: y = decode(q)
 * times the block's factor, rounded once to f32 or (ybf16) bf16. */
#if SMELT_QKIND == QK_TENSOR
#define DQ_BLOCK(r, c) 0
#elif SMELT_QKIND == QK_ROW
#define DQ_BLOCK(r, c) ((r) * srs)
#elif SMELT_QKIND == QK_128X128
#define DQ_BLOCK(r, c) (((r) / 128) * srs + ((c) / 128) * scs)
#else
#define DQ_BLOCK(r, c) ((r) * srs + ((c) / BK) * scs)
#endif

extern "C" __global__ void __launch_bounds__(BLOCK) dequant(const unsigned char *q, i64 rows, i64 cols, i64 qrs,
                                                          const void *scale, i64 srs, i64 scs, const float *tslot,
                                                          void *y, i64 yrs, i64 ycs, int ybf16) {
  const i64 n = rows * cols;
  for (i64 i = (i64)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (i64)gridDim.x * BLOCK) {
    const i64 r = i / cols, c = i % cols;
#if SMELT_QKIND == QK_NVFP4
    const u32 code = (q[r * qrs + c / 2] >> ((c & 1) * 4)) & 0xfu;
    const float f = smelt_q_nvfp4_divisor(((const unsigned char *)scale)[DQ_BLOCK(r, c)], *tslot);
#elif SMELT_QKIND == QK_MXFP8
    const u32 code = q[r * qrs + c];
    const float f = smelt_q_e8m0_value(((const unsigned char *)scale)[DQ_BLOCK(r, c)]);
#else
    const u32 code = q[r * qrs + c];
    const float f = ((const float *)scale)[DQ_BLOCK(r, c)];
#endif
    const float v = SMELT_Q_MUL(smelt_q_decode(code, SMELT_QFMT), f);
    if (ybf16) ((smelt_h16 *)y)[r * yrs + c * ycs] = smelt_f32_to_bf16(v);
    else ((float *)y)[r * yrs + c * ycs] = v;
  }
}
