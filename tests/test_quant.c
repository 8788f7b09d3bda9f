/* The quantizers (include/smelt/quant.h). The shared scalar encoders are
 * checked against the library's host fp8 conversions; hand-computed cases
 * pin every format's bits (saturation, NaN, ±0, subnormals, E2M1's 0.5, the
 * E8M0 extremes, blocks of zeros); random matrices with ragged K round-trip
 * within each format's error bound, through strided views; bad arguments
 * fail naming the tensor and write nothing. With a GPU, the same random
 * cases (and NaN/inf/zero blocks) are compared bit for bit with the CPU
 * reference, quantized and dequantized, outputs poisoned and guarded. */
#include "harness.h"

#include "../kernels/quant_math.cuh"

/* ---------------------------------------------------------------- running one */

/* A format's shapes, as include/smelt/quant.h states them. */
typedef struct qshape {
  int64_t qcols, sr, sc;
  smelt_dtype sdt;
} qshape;

static qshape shape_of(smelt_quant_format f, int64_t rows, int64_t cols) {
  static const int64_t br[] = {0, 1, 1, 128, 1, 1}, bk[] = {0, 0, 128, 128, 32, 16};
  qshape s = {f == SMELT_QUANT_NVFP4 ? (cols + 1) / 2 : cols, 1, 1, SMELT_DTYPE_F32};
  if (br[f]) s.sr = (rows + br[f] - 1) / br[f];
  if (bk[f]) s.sc = (cols + bk[f] - 1) / bk[f];
  if (f == SMELT_QUANT_MXFP8) s.sdt = SMELT_DTYPE_U8;
  if (f == SMELT_QUANT_NVFP4) s.sdt = SMELT_DTYPE_E4M3;
  return s;
}

/* One quantization's inputs and layout choices. */
typedef struct qcase {
  smelt_quant_format f;
  smelt_dtype xdt, qdt; /* qdt: e4m3 or e5m2 (ignored for NVFP4) */
  int64_t rows, cols;
  int x_cols_major;     /* x as the transpose of a column-major buffer */
  int64_t q_pad;        /* extra bytes per row of q (row stride > qcols) */
  int scale_k_major;    /* 2-D scales stored column-major (DeepGEMM's layout) */
} qcase;

/* What came out, on the host: q rows packed (qcols bytes each), scales
 * row-major [sr, sc] as raw elements, the tensor scale. */
typedef struct qout {
  uint8_t *q;
  uint8_t *scale;
  float ts;
  qshape s;
} qout;

static void qout_free(qout *o) {
  free(o->q);
  free(o->scale);
}

static smelt_dtype q_dtype(const qcase *c) { return c->f == SMELT_QUANT_NVFP4 ? SMELT_DTYPE_U8 : c->qdt; }

static th_view x_view(const qcase *c) {
  const int64_t shape[2] = {c->rows, c->cols};
  const int64_t strides[2] = {c->x_cols_major ? 1 : c->cols, c->x_cols_major ? c->rows : 1};
  return th_view_make(2, shape, strides, c->x_cols_major); /* contiguous x stays 16-byte aligned */
}

static th_view scale_view(const qcase *c, const qshape *s) {
  const int64_t shape[2] = {s->sr, s->sc};
  const int64_t strides[2] = {c->scale_k_major ? 1 : s->sc, c->scale_k_major ? s->sr : 1};
  return th_view_make(2, shape, strides, 0);
}

/* Quantizes x (row-major host floats, rounded to c->xdt) on ctx; checks
 * that every output element was written and nothing else; fills o. */
static smelt_status quantize_on(smelt_ctx *ctx, const qcase *c, const float *x, qout *o) {
  const size_t xes = smelt_dtype_size(c->xdt);
  const qshape s = shape_of(c->f, c->rows, c->cols);
  th_view xv = x_view(c), sv = scale_view(c, &s);
  const int64_t qshape2[2] = {c->rows, s.qcols}, qstrides[2] = {s.qcols + c->q_pad, 1};
  th_view qv = th_view_make(2, qshape2, qstrides, 0);
  const int64_t one[1] = {1}, unit[1] = {1};
  th_view tv = th_view_make(1, one, unit, 0);
  uint8_t *hx = calloc((size_t)xv.storage, xes);
  for (int64_t i = 0; i < c->rows * c->cols; i++) th_set(hx, c->xdt, xv.offset + th_view_off(&xv, i), x[i]);
  th_buf bx = th_buf_new(ctx, (size_t)xv.storage * xes), bq = th_buf_new(ctx, (size_t)qv.storage);
  th_buf bs = th_buf_new(ctx, (size_t)sv.storage * smelt_dtype_size(s.sdt)), bt = th_buf_new(ctx, 4);
  th_buf_upload(&bx, hx, (size_t)xv.storage * xes);
  smelt_tensor tx = th_view_tensor(&xv, &bx, c->xdt), tq = th_view_tensor(&qv, &bq, q_dtype(c));
  smelt_tensor ts = th_view_tensor(&sv, &bs, s.sdt), tt = th_view_tensor(&tv, &bt, SMELT_DTYPE_F32);
  smelt_status st = smelt_quantize(ctx, c->f, &tx, &tq, &ts, c->f == SMELT_QUANT_NVFP4 ? &tt : NULL);
  if (!st) st = smelt_ctx_synchronize(ctx);
  memset(o, 0, sizeof *o);
  o->s = s;
  o->q = malloc((size_t)(c->rows * s.qcols) + 1);
  o->scale = malloc((size_t)(s.sr * s.sc) * 4);
  uint8_t *hq = malloc((size_t)qv.storage + 1), *hs = malloc((size_t)sv.storage * 4 + 1);
  th_buf_download(&bq, hq, (size_t)qv.storage);
  th_buf_download(&bs, hs, (size_t)sv.storage * smelt_dtype_size(s.sdt));
  th_buf_download(&bt, &o->ts, 4);
  const size_t ses = smelt_dtype_size(s.sdt);
  for (int64_t r = 0; r < c->rows; r++) memcpy(o->q + r * s.qcols, hq + r * qstrides[0], (size_t)s.qcols);
  for (int64_t i = 0; i < s.sr * s.sc; i++) memcpy(o->scale + i * (int64_t)ses, hs + th_view_off(&sv, i) * (int64_t)ses, ses);
  if (!st) {
    for (int64_t r = 0; r + 1 < c->rows && c->q_pad; r++) CHECK(th_all_ff(hq + r * qstrides[0] + s.qcols, (size_t)c->q_pad));
    CHECK(th_buf_guards_ok(&bq) && th_buf_guards_ok(&bs) && th_buf_guards_ok(&bt));
    if (c->f != SMELT_QUANT_NVFP4) CHECK(th_buf_untouched(&bt));
  }
  free(hx);
  free(hq);
  free(hs);
  th_buf_free(&bx);
  th_buf_free(&bq);
  th_buf_free(&bs);
  th_buf_free(&bt);
  return st;
}

/* Dequantizes o (as quantize_on left it) to dtype ydt on ctx into y
 * (row-major floats), through a y of row stride cols + 3, whose gaps must
 * stay poisoned. */
static void dequantize_on(smelt_ctx *ctx, const qcase *c, const qout *o, smelt_dtype ydt, float *y) {
  const int64_t qshape2[2] = {c->rows, o->s.qcols}, sshape[2] = {o->s.sr, o->s.sc}, one[1] = {1};
  const int64_t yshape[2] = {c->rows, c->cols}, ystrides[2] = {c->cols + 3, 1}, ones[1] = {1};
  const int64_t qstrides[2] = {o->s.qcols, 1}, sstrides[2] = {o->s.sc, 1};
  const size_t qb = (size_t)(c->rows * o->s.qcols), sb = (size_t)(o->s.sr * o->s.sc) * smelt_dtype_size(o->s.sdt);
  th_view qv = th_view_make(2, qshape2, qstrides, 0), sv = th_view_make(2, sshape, sstrides, 0);
  th_view tv = th_view_make(1, one, ones, 0), yv = th_view_make(2, yshape, ystrides, 0);
  th_buf bq = th_buf_new(ctx, qb + 1), bs = th_buf_new(ctx, sb), bt = th_buf_new(ctx, 4);
  th_buf by = th_buf_new(ctx, (size_t)yv.storage * smelt_dtype_size(ydt));
  th_buf_upload(&bq, o->q, qb);
  th_buf_upload(&bs, o->scale, sb);
  th_buf_upload(&bt, &o->ts, 4);
  smelt_tensor tq = th_view_tensor(&qv, &bq, q_dtype(c)), ts = th_view_tensor(&sv, &bs, o->s.sdt);
  smelt_tensor tt = th_view_tensor(&tv, &bt, SMELT_DTYPE_F32), ty = th_view_tensor(&yv, &by, ydt);
  CHECK_OK(smelt_dequantize(ctx, c->f, &tq, &ts, c->f == SMELT_QUANT_NVFP4 ? &tt : NULL, &ty));
  CHECK_OK(smelt_ctx_synchronize(ctx));
  double *got = malloc((size_t)(c->rows * c->cols) * sizeof(double));
  th_check_output("dequantize", "y", &yv, &by, ydt, got);
  for (int64_t i = 0; i < c->rows * c->cols; i++) y[i] = (float)got[i];
  free(got);
  th_buf_free(&bq);
  th_buf_free(&bs);
  th_buf_free(&bt);
  th_buf_free(&by);
}

static void dequantize_cpu(const qcase *c, const qout *o, smelt_dtype ydt, float *y) {
  dequantize_on(th_cpu(), c, o, ydt, y);
}

static float bits_f(uint32_t u) { return smelt_q_u2f(u); }
static uint32_t f_bits(float f) { return smelt_q_f2u(f); }

/* ---------------------------------------------------------------- the shared encoders */

/* smelt_q_encode with no shift is the library's host fp8 conversion, on
 * random bit patterns and on every value near the codes' midpoints. */
static void test_quant_encoders_match_host(void) {
  for (int i = 0; i < 400000; i++) {
    float x = bits_f((uint32_t)th_rand_u64());
    if (i & 1) x = (float)th_rand_normal() * ldexpf(1.0f, (int)(th_rand_u64() % 40) - 24);
    if (smelt_q_isnan(x)) continue;
    CHECK_EQ_INT(smelt_q_encode(x, 0, SMELT_Q_E4M3), smelt_f32_to_e4m3(x));
    CHECK_EQ_INT(smelt_q_encode(x, 0, SMELT_Q_E5M2), smelt_f32_to_e5m2(x));
    if (th_failed_now) return;
  }
  for (uint32_t code = 0; code < 256; code++) {
    float a = smelt_q_decode(code, SMELT_Q_E4M3), b = smelt_e4m3_to_f32((uint8_t)code);
    CHECK(f_bits(a) == f_bits(b) || (isnan(a) && isnan(b)));
    a = smelt_q_decode(code, SMELT_Q_E5M2), b = smelt_e5m2_to_f32((uint8_t)code);
    CHECK(f_bits(a) == f_bits(b) || (isnan(a) && isnan(b)));
    if (!isnan(a) && !isinf(a)) CHECK_EQ_INT(smelt_q_encode(a, 0, SMELT_Q_E5M2), code);
  }
  static const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (uint32_t code = 0; code < 16; code++) {
    float v = (code & 8) ? -e2m1[code & 7] : e2m1[code & 7];
    CHECK(f_bits(smelt_q_decode(code, SMELT_Q_E2M1)) == f_bits(v));
    CHECK_EQ_INT(smelt_q_encode(v, 0, SMELT_Q_E2M1), code);
  }
  /* E2M1 rounding: ties to even, saturation, below half of 0.5. */
  CHECK_EQ_INT(smelt_q_encode(0.25f, 0, SMELT_Q_E2M1), 0);
  CHECK_EQ_INT(smelt_q_encode(0.2500001f, 0, SMELT_Q_E2M1), 1);
  CHECK_EQ_INT(smelt_q_encode(0.75f, 0, SMELT_Q_E2M1), 2);
  CHECK_EQ_INT(smelt_q_encode(2.5f, 0, SMELT_Q_E2M1), 4);
  CHECK_EQ_INT(smelt_q_encode(5.0f, 0, SMELT_Q_E2M1), 6);
  CHECK_EQ_INT(smelt_q_encode(-1e30f, 0, SMELT_Q_E2M1), 0xf);
  CHECK_EQ_INT(smelt_q_encode(bits_f(0x7f800000u), 0, SMELT_Q_E2M1), 7);
  /* A shift scales exactly, rounding once: f32 subnormals scaled up. */
  CHECK_EQ_INT(smelt_q_encode(ldexpf(1.0f, -140), -127, SMELT_Q_E5M2), smelt_f32_to_e5m2(ldexpf(1.0f, -13)));
  CHECK_EQ_INT(smelt_q_encode(ldexpf(1.5f, -146), -127, SMELT_Q_E4M3), smelt_f32_to_e4m3(ldexpf(1.5f, -19)));
  CHECK_EQ_INT(smelt_q_encode(ldexpf(1.0f, 120), 119, SMELT_Q_E4M3), 0x40);
}

/* ---------------------------------------------------------------- hand-computed cases */

static void run_cpu(const qcase *c, const float *x, qout *o) { CHECK_OK(quantize_on(th_cpu(), c, x, o)); }

static float scale_f(const qout *o, int64_t i) {
  float f;
  memcpy(&f, o->scale + 4 * i, 4);
  return f;
}

/* E2M1's comparison encoder (smelt_q_e2m1_code, what the NVFP4 kernels
 * run) against the generic one: every 4099th f32 bit pattern and 8 ulps on
 * either side of each rounding boundary, 0 and 6 (the whole f32 range
 * agreed when it was written; 4.3 billion values take too long here). */
static void test_quant_e2m1_encoders_agree(void) {
  static const float edges[] = {0.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f};
  int64_t bad = 0;
  for (uint64_t b = 0; b <= 0xffffffffu; b += 4099) {
    const uint32_t u = (uint32_t)b;
    float v;
    memcpy(&v, &u, 4);
    if (!smelt_q_isnan(v)) bad += smelt_q_e2m1_code(v) != smelt_q_encode(v, 0, SMELT_Q_E2M1);
  }
  for (size_t i = 0; i < sizeof edges / sizeof *edges; i++)
    for (int sgn = 0; sgn < 2; sgn++)
      for (int d = -8; d <= 8; d++) {
        uint32_t u;
        memcpy(&u, &edges[i], 4);
        u = (uint32_t)((int64_t)u + d) | (uint32_t)sgn << 31;
        float v;
        memcpy(&v, &u, 4);
        if (!smelt_q_isnan(v)) bad += smelt_q_e2m1_code(v) != smelt_q_encode(v, 0, SMELT_Q_E2M1);
      }
  CHECK_EQ_INT(bad, 0);
}

/* FP8 per row: values at the format's points, ±0, a row of zeros (scale
 * 1), NaN of either sign, ±inf (scale +inf: inf elements NaN, others ±0). */
static void test_quant_fp8_row_hand(void) {
  const float nan = bits_f(0x7fc00000u), nneg = bits_f(0xffc00000u), inf = bits_f(0x7f800000u);
  const float x[4 * 5] = {1, -2, 4, 0, -0.0f, 0, 0, -0.0f, 0, 0, nan, 1, nneg, -0.5f, 0, inf, 3, -inf, -1, 0};
  qcase c = {SMELT_QUANT_FP8_ROW, SMELT_DTYPE_F32, SMELT_DTYPE_E4M3, 4, 5, 0, 0, 0};
  qout o;
  run_cpu(&c, x, &o);
  static const uint8_t want[20] = {0x6e, 0xf6, 0x7e, 0x00, 0x80, 0, 0, 0x80, 0, 0,
                                   0x7f, 0x7e, 0xff, 0xf6, 0, 0x7f, 0x00, 0xff, 0x80, 0};
  for (int i = 0; i < 20; i++) CHECK_EQ_INT(o.q[i], want[i]);
  CHECK(f_bits(scale_f(&o, 0)) == f_bits(4.0f / 448.0f));
  CHECK(scale_f(&o, 1) == 1.0f);
  CHECK(f_bits(scale_f(&o, 2)) == f_bits(1.0f / 448.0f));
  CHECK(isinf(scale_f(&o, 3)));
  qout_free(&o);
  /* e5m2: its NaN is S.11111.10, its max 57344 (0x7b). */
  c.qdt = SMELT_DTYPE_E5M2;
  run_cpu(&c, x, &o);
  CHECK_EQ_INT(o.q[10], 0x7e);
  CHECK_EQ_INT(o.q[11], 0x7b);
  CHECK_EQ_INT(o.q[12], 0xfe);
  CHECK_EQ_INT(o.q[2], 0x7b);
  CHECK(f_bits(scale_f(&o, 0)) == f_bits(4.0f / 57344.0f));
  qout_free(&o);
}

/* Per tensor, 1x128 and 128x128 scale grids over ragged shapes: each block
 * has the scale of its own amax. */
static void test_quant_fp8_blocks_hand(void) {
  const int64_t rows = 130, cols = 260;
  float *x = calloc((size_t)(rows * cols), sizeof(float));
  x[0] = 448.0f;             /* block (0, 0) */
  x[1 * cols + 200] = -56.0f; /* row 1, k-block 1 */
  x[129 * cols + 259] = 7.0f; /* last row, last (4-wide) k-block */
  qout o;
  qcase c = {SMELT_QUANT_FP8_TENSOR, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, rows, cols, 0, 0, 0};
  run_cpu(&c, x, &o);
  CHECK(scale_f(&o, 0) == 1.0f);
  CHECK_EQ_INT(o.q[0], 0x7e);
  CHECK_EQ_INT(o.q[1 * cols + 200], smelt_f32_to_e4m3(-56.0f));
  qout_free(&o);
  c.f = SMELT_QUANT_FP8_1X128;
  run_cpu(&c, x, &o);
  CHECK_EQ_INT(o.s.sr * o.s.sc, 130 * 3);
  CHECK(scale_f(&o, 0) == 1.0f);
  CHECK(scale_f(&o, 1) == 1.0f);           /* row 0, k-block 1: zeros */
  CHECK(scale_f(&o, 3 + 1) == 0.125f);     /* row 1, k-block 1: 56 / 448 */
  CHECK(scale_f(&o, 129 * 3 + 2) == 7.0f / 448.0f);
  CHECK_EQ_INT(o.q[1 * cols + 200], 0xfe);
  CHECK_EQ_INT(o.q[129 * cols + 259], 0x7e);
  qout_free(&o);
  c.f = SMELT_QUANT_FP8_128X128;
  c.scale_k_major = 1;
  run_cpu(&c, x, &o);
  CHECK_EQ_INT(o.s.sr * o.s.sc, 2 * 3);
  CHECK(scale_f(&o, 0) == 1.0f);
  CHECK(scale_f(&o, 1) == 0.125f);
  CHECK(scale_f(&o, 2) == 1.0f);
  CHECK(scale_f(&o, 5) == 7.0f / 448.0f);
  CHECK_EQ_INT(o.q[1 * cols + 200], 0xfe);
  qout_free(&o);
  free(x);
}

/* MXFP8: saturation of a block whose amax rounds past the max, e4m3 and
 * e5m2 subnormals, NaN, the E8M0 floor 2^-127 (zeros and tiny blocks, f32
 * subnormals scaled up exactly), a block holding inf (scale NaN). */
static void test_quant_mxfp8_hand(void) {
  const int64_t cols = 5 * 32 + 3;
  float x[5 * 32 + 3] = {0};
  x[0] = ldexpf(1.99f, 20);                  /* block 0: shared_exp 12; 1.99 * 2^8 saturates */
  x[1] = ldexpf(1.0f, 3);                    /* 2^-9 after scaling: e4m3's least subnormal */
  x[2] = ldexpf(1.0f, 2);                    /* 2^-10: a tie, to even 0 */
  x[3] = ldexpf(3.0f, 2);                    /* 1.5 * 2^-9: a tie, to even 2 * 2^-9 */
  x[4] = bits_f(0xffc00000u);                /* -NaN */
  x[32] = ldexpf(1.0f, -126);                /* block 1: tiny; clamps to 2^-127 */
  x[33] = ldexpf(1.0f, -130);                /* f32 subnormal, 2^-3 after scaling */
  x[34] = -ldexpf(1.0f, -149);               /* 2^-22 after scaling: 0 */
  x[96] = bits_f(0x7f800000u);               /* block 3: inf */
  x[97] = 1.0f;
  x[160] = -448.0f;                          /* block 5, ragged (3 wide): shared_exp 0 */
  x[161] = 0.5f;
  qcase c = {SMELT_QUANT_MXFP8, SMELT_DTYPE_F32, SMELT_DTYPE_E4M3, 1, cols, 0, 0, 0};
  qout o;
  run_cpu(&c, x, &o);
  static const uint8_t scales[6] = {127 + 12, 0, 0, 255, 0, 127};
  for (int i = 0; i < 6; i++) CHECK_EQ_INT(o.scale[i], scales[i]);
  CHECK_EQ_INT(o.q[0], 0x7e);
  CHECK_EQ_INT(o.q[1], 0x01);
  CHECK_EQ_INT(o.q[2], 0x00);
  CHECK_EQ_INT(o.q[3], 0x02);
  CHECK_EQ_INT(o.q[4], 0xff);
  CHECK_EQ_INT(o.q[5], 0x00);
  CHECK_EQ_INT(o.q[32], 0x40);
  CHECK_EQ_INT(o.q[33], 0x20);
  CHECK_EQ_INT(o.q[34], 0x80);
  CHECK_EQ_INT(o.q[64], 0x00); /* zeros: scale byte 0, elements 0 */
  CHECK_EQ_INT(o.q[96], 0x7f);
  CHECK_EQ_INT(o.q[97], 0x7f);
  CHECK_EQ_INT(o.q[160], 0xfe);
  CHECK_EQ_INT(o.q[161], 0x30);
  qout_free(&o);
  c.qdt = SMELT_DTYPE_E5M2;
  x[0] = ldexpf(1.0f, 20);       /* e5m2: block 0's shared_exp is 20 - 15 = 5... */
  x[1] = ldexpf(1.0f, 5 - 16);   /* ...so 2^-11 scales to 2^-16, the least subnormal */
  run_cpu(&c, x, &o);
  CHECK_EQ_INT(o.scale[0], 127 + 5);
  CHECK_EQ_INT(o.q[0], 0x78); /* 2^15: exponent field 30 */
  CHECK_EQ_INT(o.q[1], 0x01);
  CHECK_EQ_INT(o.q[4], 0xfe);
  CHECK_EQ_INT(o.q[96], 0x7e);
  qout_free(&o);
}

/* E8M0's extremes read back: byte 254 is 2^127, byte 0 is 2^-127 (an f32
 * subnormal), 255 is NaN. */
static void test_quant_mxfp8_dequant_extremes(void) {
  uint8_t q[3 * 32], s[3] = {254, 0, 255};
  memset(q, 0x38, sizeof q); /* 1.0 */
  float y[96];
  const int64_t qs[2] = {1, 96}, ss[2] = {1, 3}, ys[2] = {1, 96};
  smelt_tensor tq = smelt_tensor_make(q, SMELT_DTYPE_E4M3, SMELT_DEVICE_CPU, 0, 2, qs);
  smelt_tensor ts = smelt_tensor_make(s, SMELT_DTYPE_U8, SMELT_DEVICE_CPU, 0, 2, ss);
  smelt_tensor ty = smelt_tensor_make(y, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, ys);
  CHECK_OK(smelt_dequantize(th_cpu(), SMELT_QUANT_MXFP8, &tq, &ts, NULL, &ty));
  CHECK(y[0] == ldexpf(1.0f, 127));
  CHECK(y[32] == ldexpf(1.0f, -127));
  CHECK(isnan(y[64]));
}

/* NVFP4 with a tensor scale of exactly 1 (amax 2688) so that ties stay
 * ties: E2M1's points and 0.5, ties to even, saturation, NaN (+6), ±0, a
 * block of zeros (scale 0: elements ±0), an odd number of columns. */
static void test_quant_nvfp4_hand(void) {
  const int64_t cols = 3 * 16 + 1;
  float x[3 * 16 + 1] = {0};
  const float b0[16] = {6, 3, -1.5f, 0.5f, 0.25f, 0.75f, 5, -0.0f, 2.5f, 1, 4, -6, bits_f(0xffc00000u), 2, 0, 0.2f};
  memcpy(x, b0, sizeof b0);
  x[16] = 2688.0f; /* block 1: scale e4m3(448), divisor 448 */
  x[17] = -224.0f;
  x[33] = -0.0f;   /* block 2: zeros */
  x[48] = 1.0f;    /* block 3: one element; scale e4m3(1/6) */
  qcase c = {SMELT_QUANT_NVFP4, SMELT_DTYPE_F32, SMELT_DTYPE_E4M3, 1, cols, 0, 0, 0};
  qout o;
  run_cpu(&c, x, &o);
  CHECK_EQ_INT(o.s.qcols, 25);
  CHECK(o.ts == 1.0f);
  CHECK_EQ_INT(o.scale[0], 0x38); /* 6 / 6 = 1 */
  CHECK_EQ_INT(o.scale[1], 0x7e);
  CHECK_EQ_INT(o.scale[2], 0x00);
  CHECK_EQ_INT(o.scale[3], smelt_f32_to_e4m3(1.0f / 6.0f));
  static const uint8_t want[8] = {0x57, 0x1b, 0x20, 0x86, 0x24, 0xf6, 0x47, 0x00};
  for (int i = 0; i < 8; i++) CHECK_EQ_INT(o.q[i], want[i]);
  CHECK_EQ_INT(o.q[8], 0x97);  /* 2688 / 448 = 6 (0x7), -224 / 448 = -0.5 (0x9) */
  CHECK_EQ_INT(o.q[16], 0x80); /* 0, -0 */
  float d = smelt_q_nvfp4_divisor(o.scale[3], 1.0f);
  CHECK_EQ_INT(o.q[24], smelt_q_encode(1.0f / d, 0, SMELT_Q_E2M1)); /* high nibble 0 */
  qout_free(&o);
}

/* ---------------------------------------------------------------- random round trips */

static void fill_random(float *x, int64_t n, smelt_dtype dt) {
  for (int64_t i = 0; i < n; i++) {
    double v = th_rand_normal() * ldexp(1.0, (int)(th_rand_u64() % 9) - 4);
    x[i] = (float)v;
    if (dt != SMELT_DTYPE_F32) {
      uint16_t h = dt == SMELT_DTYPE_BF16 ? smelt_f32_to_bf16(x[i]) : smelt_f32_to_f16(x[i]);
      x[i] = dt == SMELT_DTYPE_BF16 ? smelt_bf16_to_f32(h) : smelt_f16_to_f32(h);
    }
  }
}

static const qcase random_cases[] = {
    {SMELT_QUANT_FP8_TENSOR, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, 7, 300, 0, 0, 0},
    {SMELT_QUANT_FP8_ROW, SMELT_DTYPE_F16, SMELT_DTYPE_E5M2, 9, 77, 1, 3, 0},
    {SMELT_QUANT_FP8_1X128, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, 5, 300, 0, 16, 1},
    {SMELT_QUANT_FP8_1X128, SMELT_DTYPE_F32, SMELT_DTYPE_E5M2, 3, 128, 1, 0, 0},
    {SMELT_QUANT_FP8_128X128, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, 130, 260, 0, 0, 1},
    {SMELT_QUANT_MXFP8, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, 6, 100, 0, 0, 0},
    {SMELT_QUANT_MXFP8, SMELT_DTYPE_F32, SMELT_DTYPE_E5M2, 4, 33, 1, 5, 1},
    {SMELT_QUANT_NVFP4, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, 5, 77, 0, 0, 0},
    {SMELT_QUANT_NVFP4, SMELT_DTYPE_F16, SMELT_DTYPE_E4M3, 3, 512, 1, 7, 1},
};
#define NRANDOM ((int)(sizeof random_cases / sizeof *random_cases))

/* Every y within half an element ulp (relative 2^-(mbits+1), doubled for
 * slack) plus the block's least subnormal step, and for NVFP4 the block
 * scale's own rounding (a 2^-4 relative step of the block's amax). */
static void check_round_trip(const qcase *c, const float *x, const float *y) {
  const int mbits = c->f == SMELT_QUANT_NVFP4 ? 1 : c->qdt == SMELT_DTYPE_E4M3 ? 3 : 2;
  const int sub = c->f == SMELT_QUANT_NVFP4 ? -1 : c->qdt == SMELT_DTYPE_E4M3 ? -9 : -16;
  double amax = 0;
  for (int64_t i = 0; i < c->rows * c->cols; i++) amax = fmax(amax, fabs(x[i]));
  const double fmaxv = c->f == SMELT_QUANT_NVFP4 ? 6 : c->qdt == SMELT_DTYPE_E4M3 ? 448 : 57344;
  for (int64_t i = 0; i < c->rows * c->cols; i++) {
    double step = amax / fmaxv * 2 * ldexp(1.0, sub); /* the coarsest block's subnormal step */
    double bound = ldexp(fabs(x[i]), -mbits) + step + (c->f == SMELT_QUANT_NVFP4 ? amax / 8 : 0);
    if (!(fabs((double)y[i] - x[i]) <= bound)) {
      th_fail(__FILE__, __LINE__, "%s [%lld]: x=%g y=%g beyond %g", smelt_quant_format_name(c->f), (long long)i, x[i],
              y[i], bound);
      return;
    }
  }
}

static void test_quant_round_trip(void) {
  for (int k = 0; k < NRANDOM; k++) {
    const qcase *c = &random_cases[k];
    const int64_t n = c->rows * c->cols;
    float *x = malloc((size_t)n * 4), *y = malloc((size_t)n * 4), *yb = malloc((size_t)n * 4);
    fill_random(x, n, c->xdt);
    qout o, o2;
    run_cpu(c, x, &o);
    dequantize_cpu(c, &o, SMELT_DTYPE_F32, y);
    check_round_trip(c, x, y);
    dequantize_cpu(c, &o, SMELT_DTYPE_BF16, yb);
    for (int64_t i = 0; i < n; i++) CHECK_EQ_INT(f_bits(yb[i]), f_bits(smelt_bf16_to_f32(smelt_f32_to_bf16(y[i]))));
    /* The layout changes nothing: the same case contiguous gives the same bits. */
    qcase plain = *c;
    plain.x_cols_major = 0;
    plain.q_pad = 0;
    plain.scale_k_major = 0;
    run_cpu(&plain, x, &o2);
    CHECK(!memcmp(o.q, o2.q, (size_t)(c->rows * o.s.qcols)));
    CHECK(!memcmp(o.scale, o2.scale, (size_t)(o.s.sr * o.s.sc) * smelt_dtype_size(o.s.sdt)));
    qout_free(&o);
    qout_free(&o2);
    free(x);
    free(y);
    free(yb);
    if (th_failed_now) return;
  }
}

/* ---------------------------------------------------------------- validation */

/* Each bad call fails with the status and a message naming the tensor, and
 * leaves every output as it was. */
static void test_quant_bad_inputs(void) {
  float x[4 * 64];
  for (int i = 0; i < 4 * 64; i++) x[i] = (float)i;
  uint8_t q[4 * 64], s8[4 * 4 * 4];
  float ts = -7.0f;
  memset(q, 0xab, sizeof q);
  memset(s8, 0xab, sizeof s8);
  const int64_t xs[2] = {4, 64}, rs[2] = {4, 1}, ks[2] = {4, 2}, mx[2] = {4, 2}, one[1] = {1};
  smelt_ctx *ctx = th_cpu();
  smelt_tensor tx = smelt_tensor_make(x, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, xs);
  smelt_tensor tq = smelt_tensor_make(q, SMELT_DTYPE_E4M3, SMELT_DEVICE_CPU, 0, 2, xs);
  smelt_tensor srow = smelt_tensor_make(s8, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, rs);
  smelt_tensor sk = smelt_tensor_make(s8, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, ks);
  smelt_tensor smx = smelt_tensor_make(s8, SMELT_DTYPE_U8, SMELT_DEVICE_CPU, 0, 2, mx);
  smelt_tensor tts = smelt_tensor_make(&ts, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, one);
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_FP8_ROW, &tx, &tq, &sk, NULL), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("scale.shape=[4, 2] must be [4, 1] or [4] for format fp8-row");
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_FP8_1X128, &tx, &tq, &srow, NULL), SMELT_STATUS_OK);
  memset(q, 0xab, sizeof q);
  memset(s8, 0xab, sizeof s8);
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_MXFP8, &tx, &tq, &srow, NULL), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("scale.dtype=f32 must be u8 for format mxfp8");
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_FP8_ROW, &tx, &tq, &srow, &tts), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("tensor_scale must be NULL for format fp8-row");
  smelt_tensor q16 = tq;
  q16.dtype = SMELT_DTYPE_U8;
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_FP8_ROW, &tx, &q16, &srow, NULL), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("q.dtype=u8 must be e4m3 or e5m2");
  smelt_tensor qt = tq;
  qt.shape[1] = 32;
  qt.strides[1] = 2;
  qt.dtype = SMELT_DTYPE_U8;
  smelt_tensor s4 = smx;
  s4.dtype = SMELT_DTYPE_E4M3;
  s4.shape[1] = 4;
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_NVFP4, &tx, &qt, &s4, &tts), SMELT_STATUS_BAD_LAYOUT);
  CHECK_MSG("q.strides[1]=2 must be 1");
  qt.strides[1] = 1;
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_NVFP4, &tx, &qt, &s4, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("tensor_scale is NULL");
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_NVFP4, &tx, &tq, &s4, &tts), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("q.dtype=e4m3 must be u8 for format nvfp4");
  CHECK_STATUS(smelt_quantize(ctx, (smelt_quant_format)9, &tx, &tq, &srow, NULL), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("format=9");
  smelt_tensor x3 = tx;
  x3.ndim = 3;
  x3.shape[2] = 1;
  x3.strides[2] = 1;
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_FP8_ROW, &x3, &tq, &srow, NULL), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("x.ndim=3 must be 2");
  smelt_tensor overlap = srow;
  overlap.data = q;
  CHECK_STATUS(smelt_quantize(ctx, SMELT_QUANT_FP8_ROW, &tx, &tq, &overlap, NULL), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("scale overlaps q");
  for (size_t i = 0; i < sizeof q; i++) CHECK_EQ_INT(q[i], 0xab);
  for (size_t i = 0; i < sizeof s8; i++) CHECK_EQ_INT(s8[i], 0xab);
  CHECK(ts == -7.0f);
  /* The dequantizer checks the same shapes against y. */
  float y[4 * 64];
  memset(y, 0xab, sizeof y);
  smelt_tensor ty = smelt_tensor_make(y, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, xs);
  CHECK_STATUS(smelt_dequantize(ctx, SMELT_QUANT_MXFP8, &tq, &sk, NULL, &ty), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("smelt_dequantize: scale.dtype=f32 must be u8");
  ty.dtype = SMELT_DTYPE_F16;
  CHECK_STATUS(smelt_dequantize(ctx, SMELT_QUANT_FP8_ROW, &tq, &srow, NULL, &ty), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("y.dtype=f16");
  for (size_t i = 0; i < sizeof y / 4; i++) CHECK_EQ_INT(f_bits(y[i]), 0xabababab);
}

/* ---------------------------------------------------------------- GPU against the CPU reference */

/* The GPU's dequantization of o against the CPU's, in f32 and bf16: the
 * same bits, any NaN for NaN. */
static void compare_dequant(smelt_ctx *gpu, const qcase *c, const qout *o) {
  const int64_t n = c->rows * c->cols;
  float *yg = malloc((size_t)n * 4), *yc = malloc((size_t)n * 4);
  for (int d = 0; d < 2; d++) {
    const smelt_dtype ydt = d ? SMELT_DTYPE_BF16 : SMELT_DTYPE_F32;
    dequantize_on(gpu, c, o, ydt, yg);
    dequantize_cpu(c, o, ydt, yc);
    for (int64_t i = 0; i < n; i++)
      if (f_bits(yg[i]) != f_bits(yc[i]) && !(isnan(yg[i]) && isnan(yc[i]))) {
        th_fail(__FILE__, __LINE__, "%s y %s [%lld]: gpu %a cpu %a", smelt_quant_format_name(c->f),
                smelt_dtype_name(ydt), (long long)i, yg[i], yc[i]);
        break;
      }
  }
  free(yg);
  free(yc);
}

/* Random cases plus blocks of zeros, NaN and inf, quantized on the GPU and
 * on the CPU: the same bits in q, the scales and the tensor scale; then,
 * where x is f32 (the module the dequantizer loads: no extra compile), the
 * CPU's q and scales dequantized on both. */
static void test_quant_gpu_bit_exact(void) {
  smelt_ctx *gpu = th_cuda();
  if (!gpu) SKIP("no CUDA device");
  static const qcase extra[] = {
      /* Rows of x a multiple of 16 bytes and q padded to 16 (NVFP4: 8): the vector paths, with ragged tails. */
      {SMELT_QUANT_FP8_TENSOR, SMELT_DTYPE_F32, SMELT_DTYPE_E5M2, 300, 1000, 0, 8, 0},
      {SMELT_QUANT_FP8_ROW, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, 33, 4096 + 8, 0, 8, 0},
      {SMELT_QUANT_FP8_ROW, SMELT_DTYPE_F32, SMELT_DTYPE_E4M3, 5, 70, 0, 0, 0},
      /* Rows held by 256 threads, and rows longer than they hold (their further chunks read twice). */
      {SMELT_QUANT_FP8_ROW, SMELT_DTYPE_F16, SMELT_DTYPE_E5M2, 3, 16384, 0, 0, 0},
      {SMELT_QUANT_FP8_ROW, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, 4, 3 * 16384 + 40, 0, 8, 0},
      {SMELT_QUANT_FP8_1X128, SMELT_DTYPE_F16, SMELT_DTYPE_E4M3, 17, 1024, 0, 0, 0},
      {SMELT_QUANT_FP8_128X128, SMELT_DTYPE_F32, SMELT_DTYPE_E5M2, 257, 384 + 8, 0, 8, 0},
      {SMELT_QUANT_FP8_128X128, SMELT_DTYPE_F16, SMELT_DTYPE_E4M3, 129, 256 + 5, 1, 0, 1},
      {SMELT_QUANT_MXFP8, SMELT_DTYPE_F16, SMELT_DTYPE_E4M3, 65, 1000, 0, 8, 1},
      {SMELT_QUANT_NVFP4, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3, 129, 2048 + 24, 0, 4, 0},
      {SMELT_QUANT_NVFP4, SMELT_DTYPE_F32, SMELT_DTYPE_E4M3, 1, 7, 0, 0, 0},
  };
  for (int k = 0; k < NRANDOM + (int)(sizeof extra / sizeof *extra); k++) {
    const qcase *c = k < NRANDOM ? &random_cases[k] : &extra[k - NRANDOM];
    const int64_t n = c->rows * c->cols;
    float *x = malloc((size_t)n * 4);
    fill_random(x, n, c->xdt);
    /* Specials: a zero stretch (whole blocks), NaN, ±0, and in some cases an inf. */
    for (int64_t i = 0; i < n && i < 160; i++) x[i] = 0.0f;
    x[n / 2] = bits_f(0x7fc00000u);
    if (n / 2 + 1 < n) x[n / 2 + 1] = bits_f(0xffc00000u);
    x[n / 3] = -0.0f;
    if (k % 3 == 2 && c->f != SMELT_QUANT_NVFP4 && c->f != SMELT_QUANT_FP8_TENSOR) x[n - 1] = -INFINITY;
    qout og, oc;
    smelt_status st = quantize_on(gpu, c, x, &og);
    CHECK_OK(st);
    run_cpu(c, x, &oc);
    if (!st) {
      for (int64_t i = 0; i < c->rows * og.s.qcols; i++)
        if (og.q[i] != oc.q[i]) {
          th_fail(__FILE__, __LINE__, "case %d %s: q byte %lld gpu 0x%02x cpu 0x%02x", k, smelt_quant_format_name(c->f),
                  (long long)i, og.q[i], oc.q[i]);
          break;
        }
      CHECK(!memcmp(og.scale, oc.scale, (size_t)(og.s.sr * og.s.sc) * smelt_dtype_size(og.s.sdt)));
      if (c->f == SMELT_QUANT_NVFP4) CHECK_EQ_INT(f_bits(og.ts), f_bits(oc.ts));
      if (c->xdt == SMELT_DTYPE_F32) compare_dequant(gpu, c, &oc); /* the dequantizer's module is the f32 one */
    }
    qout_free(&og);
    qout_free(&oc);
    free(x);
    if (th_failed_now) return;
  }
}

const th_test th_tests_quant[] = {
    {"encoders_match_host", test_quant_encoders_match_host},
    {"e2m1_encoders_agree", test_quant_e2m1_encoders_agree},
    {"fp8_row_hand", test_quant_fp8_row_hand},
    {"fp8_blocks_hand", test_quant_fp8_blocks_hand},
    {"mxfp8_hand", test_quant_mxfp8_hand},
    {"nvfp4_hand", test_quant_nvfp4_hand},
    {"round_trip", test_quant_round_trip},
    {"bad_inputs", test_quant_bad_inputs},
    {"gpu_bit_exact", test_quant_gpu_bit_exact},
    {0, 0},
};

const th_test th_tests_dequant[] = {
    {"mxfp8_extremes", test_quant_mxfp8_dequant_extremes},
    {0, 0},
};
