/* CPU reference for smelt_quantize and smelt_dequantize: block by block,
 * the block's amax, its scale and its elements, each through the scalar
 * definitions of kernels/quant_math.cuh that the CUDA kernels run too, so
 * that both give the same bits. Any strides on x, y and the scales; q has
 * unit column stride (checked by the core). */
#include "../core/quant_internal.h"

static float load_x(const smelt_tensor *x, int64_t r, int64_t c) {
  return (float)smelt__load_f64(x->data, x->dtype, r * x->strides[0] + c * x->strides[1]);
}

/* The amax of rows [r0, r1) x cols [c0, c1). */
static float block_amax(const smelt_tensor *x, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float m = 0.0f;
  for (int64_t r = r0; r < r1; r++)
    for (int64_t c = c0; c < c1; c++) m = smelt_q_amax(m, load_x(x, r, c));
  return m;
}

static uint8_t *q_at(const smelt_tensor *q, int64_t r, int64_t byte) {
  return (uint8_t *)q->data + r * q->strides[0] + byte;
}

/* Writes one element's code: a byte, or a nibble of NVFP4's pair byte. */
static void store_code(const smelt_tensor *q, int fmt, int64_t r, int64_t c, smelt_q_u32 code) {
  if (fmt != SMELT_Q_E2M1) {
    *q_at(q, r, c) = (uint8_t)code;
    return;
  }
  uint8_t *b = q_at(q, r, c / 2);
  *b = (c & 1) ? (uint8_t)((*b & 0x0f) | code << 4) : (uint8_t)code; /* low nibble first; odd tail: high 0 */
}

static smelt_q_u32 load_code(const smelt_tensor *q, int fmt, int64_t r, int64_t c) {
  if (fmt != SMELT_Q_E2M1) return *q_at(q, r, c);
  return (*q_at(q, r, c / 2) >> ((c & 1) * 4)) & 0x0fu;
}

typedef struct scales {
  const smelt_tensor *t;
  int64_t rs, cs;
} scales;

static void *scale_at(const scales *s, int64_t bi, int64_t bj) {
  return (char *)s->t->data + (bi * s->rs + bj * s->cs) * (int64_t)smelt_dtype_size(s->t->dtype);
}

/* One block: its scale written, then its elements. */
static void quant_block(smelt_quant_format f, int fmt, const smelt_tensor *x, const smelt_tensor *q,
                        const scales *sc, float tensor_scale, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                        int64_t bi, int64_t bj) {
  float amax = block_amax(x, r0, r1, c0, c1);
  float fscale = 0.0f, divisor = 0.0f;
  smelt_q_u32 byte = 0;
  if (f == SMELT_QUANT_MXFP8) {
    byte = smelt_q_e8m0(amax, fmt);
    *(uint8_t *)scale_at(sc, bi, bj) = (uint8_t)byte;
  } else if (f == SMELT_QUANT_NVFP4) {
    byte = smelt_q_nvfp4_block_scale(amax, tensor_scale);
    divisor = smelt_q_nvfp4_divisor(byte, tensor_scale);
    *(uint8_t *)scale_at(sc, bi, bj) = (uint8_t)byte;
  } else {
    fscale = smelt_q_fp8_scale(amax, fmt);
    *(float *)scale_at(sc, bi, bj) = fscale;
  }
  for (int64_t r = r0; r < r1; r++)
    for (int64_t c = c0; c < c1; c++) {
      float v = load_x(x, r, c);
      smelt_q_u32 code = f == SMELT_QUANT_MXFP8   ? smelt_q_mx_elem(v, byte, fmt)
                         : f == SMELT_QUANT_NVFP4 ? smelt_q_e2m1(v, divisor)
                                                  : smelt_q_fp8_elem(v, fscale, fmt);
      store_code(q, fmt, r, c, code);
    }
}

static smelt_status run_quant(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *q = t[1], *ts = t[3];
  const smelt_quant_format f = smelt__quant_format_of(plan);
  smelt__quant_geom g;
  smelt__quant_geometry(f, x->shape[0], x->shape[1], &g);
  if (g.rows == 0 || g.cols == 0) return SMELT_OK;
  scales sc = {t[2], 0, 0};
  smelt__quant_scale_strides(t[2], &sc.rs, &sc.cs);
  const int fmt = smelt__quant_elem_fmt(f, q->dtype);
  float tensor_scale = 0.0f;
  if (ts) {
    tensor_scale = smelt_q_nvfp4_tensor_scale(block_amax(x, 0, g.rows, 0, g.cols));
    *(float *)ts->data = tensor_scale;
  }
  for (int64_t bi = 0; bi < g.sr; bi++)
    for (int64_t bj = 0; bj < g.sc; bj++) {
      int64_t r0 = bi * g.br, c0 = bj * g.bk;
      int64_t r1 = r0 + g.br < g.rows ? r0 + g.br : g.rows, c1 = c0 + g.bk < g.cols ? c0 + g.bk : g.cols;
      quant_block(f, fmt, x, q, &sc, tensor_scale, r0, r1, c0, c1, bi, bj);
    }
  return SMELT_OK;
}

/* The f32 factor of block (bi, bj)'s elements. */
static float dequant_factor(smelt_quant_format f, const scales *sc, float tensor_scale, int64_t bi, int64_t bj) {
  const void *p = scale_at(sc, bi, bj);
  if (f == SMELT_QUANT_MXFP8) return smelt_q_e8m0_value(*(const uint8_t *)p);
  if (f == SMELT_QUANT_NVFP4) return smelt_q_nvfp4_divisor(*(const uint8_t *)p, tensor_scale);
  return *(const float *)p;
}

static smelt_status run_dequant(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *q = t[0], *ts = t[2], *y = t[3];
  const smelt_quant_format f = smelt__quant_format_of(plan);
  smelt__quant_geom g;
  smelt__quant_geometry(f, y->shape[0], y->shape[1], &g);
  if (g.rows == 0 || g.cols == 0) return SMELT_OK;
  scales sc = {t[1], 0, 0};
  smelt__quant_scale_strides(t[1], &sc.rs, &sc.cs);
  const int fmt = smelt__quant_elem_fmt(f, q->dtype);
  const float tensor_scale = ts ? *(const float *)ts->data : 0.0f;
  for (int64_t r = 0; r < g.rows; r++)
    for (int64_t c = 0; c < g.cols; c++) {
      float s = dequant_factor(f, &sc, tensor_scale, r / g.br, c / g.bk);
      float v = SMELT_Q_MUL(smelt_q_decode(load_code(q, fmt, r, c), fmt), s);
      smelt__store_f64(y->data, y->dtype, r * y->strides[0] + c * y->strides[1], v);
    }
  return SMELT_OK;
}

const smelt__backend smelt__cpu_quant = {.run = run_quant};
const smelt__backend smelt__cpu_dequant = {.run = run_dequant};
