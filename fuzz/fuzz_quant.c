/* Fuzz entry point for the quantizers (smelt_quantize*, smelt_dequantize):
 * a format (now and then out of range), x [rows, cols] and the format's q,
 * scale and tensor_scale shapes, mostly right and now and then off by one
 * or of another dtype; an output aliasing x now and then (must be refused).
 * rows reaches past 128 so FP8_128X128 has more than one block row, cols
 * past 128 and odd so ragged blocks and NVFP4's half byte are drawn; rows ·
 * cols stays under a few thousand. */
#include "fuzz.h"

#include <stdint.h>
#include <string.h>

#define WORK_CAP 4096

static int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 && a <= INT64_MAX - b ? (a + b - 1) / b : a; }

/* A size drawn mostly right (want), now and then any other. */
static int64_t near(fz *f, int64_t want) {
  uint8_t b = fz_u8(f);
  if (b < 232) return want;
  return b < 244 && want < INT64_MAX ? want + 1 : fz_size(f, 4);
}

enum { X, Q, SCALE, TSCALE, Y, NT };

void fz_quant(fz *f) {
  int64_t rows = fz_size(f, 150), cols = fz_size(f, 200);
  while (rows > 0 && cols > 0 && rows <= 200 && cols <= 200 && rows * cols > WORK_CAP)
    *(rows > cols ? &rows : &cols) /= 2;
  const smelt_quant_format fmt = (smelt_quant_format)fz_enum(f, SMELT_QUANT_FORMAT_COUNT);
  const int known = fmt >= 0 && fmt < SMELT_QUANT_FORMAT_COUNT, nvfp4 = fmt == SMELT_QUANT_NVFP4;
  /* The table of quant.h: q's columns, the scale's shape and dtype. */
  int64_t qs[2] = {rows, nvfp4 ? ceil_div(cols, 2) : cols}, ss[2] = {1, 1}, one = 1;
  int sdims = 1;
  smelt_dtype sdt = SMELT_DTYPE_F32, qdt = nvfp4 ? SMELT_DTYPE_U8 : (fz_u8(f) & 1 ? SMELT_DTYPE_E5M2 : SMELT_DTYPE_E4M3);
  switch (known ? fmt : SMELT_QUANT_FP8_TENSOR) {
  case SMELT_QUANT_FP8_TENSOR: sdims = fz_u8(f) & 1 ? 2 : 1; break;
  case SMELT_QUANT_FP8_ROW: ss[0] = rows, sdims = fz_u8(f) & 1 ? 2 : 1; break;
  case SMELT_QUANT_FP8_1X128: ss[0] = rows, ss[1] = ceil_div(cols, 128), sdims = 2; break;
  case SMELT_QUANT_FP8_128X128: ss[0] = ceil_div(rows, 128), ss[1] = ceil_div(cols, 128), sdims = 2; break;
  case SMELT_QUANT_MXFP8: ss[0] = rows, ss[1] = ceil_div(cols, 32), sdims = 2, sdt = SMELT_DTYPE_U8; break;
  default: ss[0] = rows, ss[1] = ceil_div(cols, 16), sdims = 2, sdt = SMELT_DTYPE_E4M3; break;
  }
  for (int i = 0; i < 2; i++) qs[i] = near(f, qs[i]), ss[i] = near(f, ss[i]);
  if (fz_one_in(f, 16)) qdt = (smelt_dtype)fz_enum(f, SMELT_DTYPE_COUNT);
  if (fz_one_in(f, 16)) sdt = (smelt_dtype)fz_enum(f, SMELT_DTYPE_COUNT);
  const smelt_dtype xdt = fz_float_dtype(f), ydt = fz_u8(f) & 1 ? SMELT_DTYPE_BF16 : SMELT_DTYPE_F32;
  /* NVFP4 needs the tensor scale, the others refuse one. */
  const int with_ts = nvfp4 != fz_one_in(f, 16), dequant = fz_u8(f) % 4 == 0, mode = fz_mode(f);
  const int alias = fz_one_in(f, 16) ? 1 + fz_u8(f) % 3 : 0;
  unsigned nulls = fz_nulls(f, 3);
  smelt_tensor t[NT];
  memset(t, 0, sizeof t);
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    const int64_t xs[2] = {rows, cols};
    t[X] = fz_view(f, xdt, 2, xs, 0);
    t[Q] = fz_view(f, qdt, 2, qs, !dequant);
    t[SCALE] = fz_view(f, sdt, sdims, ss, !dequant);
    t[TSCALE] = fz_view(f, SMELT_DTYPE_F32, fz_u8(f) & 1 ? 2 : 1, (const int64_t[2]){one, one}, !dequant);
    t[Y] = fz_view(f, ydt, 2, xs, dequant);
    /* An output over an input (or over another output): refused. */
    if (alias == 1) t[Q].data = dequant ? t[Y].data : t[X].data;
    if (alias == 2) t[SCALE].data = dequant ? t[Y].data : t[X].data;
    if (alias == 3) t[SCALE].data = t[dequant ? Y : Q].data;
    const smelt_tensor *q = fz_maybe_null(nulls, t, Q), *sc = fz_maybe_null(nulls, t, SCALE),
                       *ts = with_ts ? &t[TSCALE] : NULL, *x = fz_maybe_null(nulls, t, X);
    if (dequant) {
      FZ_CALL(s, "smelt_dequantize", t, smelt_dequantize(f->ctx, fmt, q, sc, ts, x ? &t[Y] : NULL));
      return;
    }
    FZ_ROUND(s, r, mode, plan, t, "smelt_quantize", smelt_quantize(f->ctx, fmt, x, q, sc, ts),
             smelt_quantize_plan(f->ctx, fmt, x, q, sc, ts, &plan), smelt_quantize_run(plan, x, q, sc, ts));
  }
  smelt_plan_destroy(plan);
}

/* smelt_qgemm (the quantized GEMM manager): x [M, K] times a weight W
 * [N, K] in a format's tensors (NVFP4 mostly, whose K must be a multiple of
 * 16; another format now and then, which must be refused), bias and the
 * epilogue's alpha and activation now and then, shapes off by one now and
 * then. M·N·K stays under a few thousand for the CPU reference. */
enum { G_X, G_Q, G_SCALE, G_TS, G_BIAS, G_D, GNT };

void fz_qgemm(fz *f) {
  int64_t d3[3] = {fz_size(f, 9), fz_size(f, 12), 16 * fz_small(f, 5)};
  fz_cap_work(d3, 2, 256);
  const int64_t m = d3[0], n = d3[1], k = fz_one_in(f, 8) ? fz_size(f, 40) : d3[2];
  const smelt_quant_format fmt =
      fz_one_in(f, 8) ? (smelt_quant_format)fz_enum(f, SMELT_QUANT_FORMAT_COUNT) : SMELT_QUANT_NVFP4;
  int64_t xs[2] = {m, near(f, k)}, qs[2] = {near(f, n), near(f, ceil_div(k, 2))},
          ss[2] = {near(f, n), near(f, ceil_div(k, 16))}, ds[2] = {m, near(f, n)}, one = 1;
  smelt_qgemm_desc desc = smelt_qgemm_desc_default();
  if (fz_u8(f) & 1) desc.alpha = fz_double(f);
  if (fz_u8(f) & 1) desc.act = (smelt_act)fz_enum(f, SMELT_ACT_COUNT);
  const smelt_qgemm_desc *dp = fz_one_in(f, 16) ? NULL : &desc;
  const smelt_dtype xdt = fz_one_in(f, 8) ? fz_float_dtype(f) : fz_u8(f) & 1 ? SMELT_DTYPE_BF16 : SMELT_DTYPE_F16;
  const smelt_dtype ddt = fz_float_dtype(f), bdt = fz_float_dtype(f);
  const int with_bias = fz_u8(f) & 1, mode = fz_mode(f);
  unsigned nulls = fz_nulls(f, 4);
  smelt_tensor t[GNT];
  memset(t, 0, sizeof t);
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    t[G_X] = fz_view(f, xdt, 2, xs, 0);
    t[G_Q] = fz_view(f, fz_one_in(f, 16) ? (smelt_dtype)fz_enum(f, SMELT_DTYPE_COUNT) : SMELT_DTYPE_U8, 2, qs, 0);
    t[G_SCALE] = fz_view(f, SMELT_DTYPE_E4M3, 2, ss, 0);
    t[G_TS] = fz_view(f, SMELT_DTYPE_F32, 1, &one, 0);
    t[G_BIAS] = fz_view(f, bdt, 1, &n, 0);
    t[G_D] = fz_view(f, ddt, 2, ds, 1);
    smelt_qgemm_weights w = {fmt, fz_maybe_null(nulls, t, G_Q), fz_maybe_null(nulls >> 1, t, G_SCALE),
                             fz_maybe_null(nulls >> 2, t, G_TS)};
    const smelt_qgemm_weights *wp = fz_one_in(f, 32) ? NULL : &w, w_saved = w;
    const smelt_tensor *x = fz_maybe_null(nulls >> 3, t, G_X), *bias = with_bias ? &t[G_BIAS] : NULL;
    FZ_ROUND(s, r, mode, plan, t, "smelt_qgemm", smelt_qgemm(f->ctx, dp, x, wp, bias, &t[G_D]),
             smelt_qgemm_plan(f->ctx, dp, x, wp, bias, &t[G_D], &plan), smelt_qgemm_run(plan, x, wp, bias, &t[G_D]));
    fz_same("smelt_qgemm", &w_saved, &w, sizeof w);
  }
  smelt_plan_destroy(plan);
}
