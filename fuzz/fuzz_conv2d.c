/* Fuzz entry point for Conv2d (smelt_conv2d*): a kind, then x [N,H,W,C],
 * w [K,R,S,C] and y [N,P,Q,K] in the kind's roles (A, B, C/D), P and Q
 * mostly from the drawn padding, stride and dilation and now and then any
 * size; the description's fields drawn whole (hostile pads, strides,
 * dilations and enums); N·H·W·C·K·R·S under a few thousand so the CPU
 * reference's direct sums stay small. */
#include "fuzz.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define WORK_CAP 2048

/* An int field: mostly in [0, max], sometimes hostile (clamped to int). */
static int draw_int(fz *f, int64_t max) {
  int64_t v = fz_size(f, max);
  return v > INT_MAX ? INT_MAX : v < INT_MIN ? INT_MIN : (int)v;
}

static smelt_conv2d_desc draw_desc(fz *f) {
  smelt_conv2d_desc d = smelt_conv2d_desc_default();
  d.kind = (smelt_conv2d_kind)fz_enum(f, SMELT_CONV2D_KIND_COUNT);
  uint8_t which = fz_u8(f);
  if (which & 1) {
    d.pad_h0 = draw_int(f, 3);
    d.pad_h1 = draw_int(f, 3);
    d.pad_w0 = draw_int(f, 3);
    d.pad_w1 = draw_int(f, 3);
  }
  if (which & 2) d.stride_h = draw_int(f, 3), d.stride_w = draw_int(f, 3);
  if (which & 4) d.dilation_h = draw_int(f, 3), d.dilation_w = draw_int(f, 3);
  if (which & 8) {
    d.iterator = (smelt_conv2d_iterator)fz_enum(f, SMELT_CONV2D_ITER_COUNT);
    d.stride_support = (smelt_conv2d_stride_support)fz_enum(f, SMELT_CONV2D_STRIDE_COUNT);
    d.split_k_mode = (smelt_conv2d_split_k_mode)fz_enum(f, SMELT_CONV2D_SPLIT_K_COUNT);
    d.split_k_slices = draw_int(f, 8);
    d.math = (smelt_gemm_math_op)fz_enum(f, SMELT_GEMM_MATH_COUNT);
  }
  if (which & 16) {
    d.epilogue.alpha = fz_double(f);
    d.epilogue.act = (smelt_act)fz_enum(f, SMELT_ACT_COUNT);
    d.epilogue.slope = (float)fz_double(f);
    d.epilogue.clamp = fz_u8(f) & 1;
  }
  if (which & 32) d.epilogue.beta = fz_double(f);
  if (which & 64) d.epilogue.scale_d = (float)fz_double(f);
  return d;
}

enum { A, B, C, D, BIAS, NT };

void fz_conv2d(fz *f) {
  int64_t dims[7];
  for (int i = 0; i < 7; i++) dims[i] = fz_size(f, 5);
  fz_cap_work(dims, 7, WORK_CAP);
  const int64_t n = dims[0], h = dims[1], w = dims[2], c = dims[3], k = dims[4], r = dims[5], s_ = dims[6];
  smelt_conv2d_desc desc = draw_desc(f);
  const smelt_conv2d_desc *dp = fz_one_in(f, 16) ? NULL : &desc;
  int64_t p = smelt_conv2d_out_size(dp, 0, h, r), q = smelt_conv2d_out_size(dp, 1, w, s_);
  if (p < 0 || fz_one_in(f, 8)) p = fz_size(f, 5);
  if (q < 0 || fz_one_in(f, 8)) q = fz_size(f, 5);
  int mode = fz_mode(f), in_place = fz_one_in(f, 8);
  smelt_dtype da = fz_float_dtype(f), db = fz_one_in(f, 8) ? fz_float_dtype(f) : da, dd = fz_float_dtype(f),
              dc = fz_one_in(f, 8) ? fz_float_dtype(f) : dd, dbias = fz_float_dtype(f);
  int with_c = desc.epilogue.beta != 0 || fz_one_in(f, 4), with_bias = fz_one_in(f, 3);
  unsigned nulls = fz_nulls(f, 4);
  const int64_t xs[4] = {n, h, w, c}, ws[4] = {k, r, s_, c}, ys[4] = {n, p, q, k};
  const int kind = desc.kind >= 0 && desc.kind < SMELT_CONV2D_KIND_COUNT ? (int)desc.kind : 0;
  const int64_t *as = kind == 0 ? xs : ys, *bs = kind == 2 ? xs : ws, *ds = kind == 0 ? ys : kind == 1 ? xs : ws;
  smelt_tensor t[NT];
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int rr = 0; fz_round(rr, mode); rr++) {
    t[A] = fz_view(f, da, 4, as, 0);
    t[B] = fz_view(f, db, 4, bs, 0);
    t[C] = fz_view(f, dc, 4, ds, 0);
    t[D] = in_place ? t[C] : fz_view(f, dd, 4, ds, 0);
    fz_output(&t[D]);
    t[BIAS] = fz_view(f, dbias, 1, &k, 0);
    const smelt_tensor *a = fz_maybe_null(nulls, t, A), *b = fz_maybe_null(nulls, t, B), *cc = with_c ? &t[C] : NULL,
                       *d = fz_maybe_null(nulls, t, D), *bias = with_bias ? &t[BIAS] : NULL;
    FZ_ROUND(s, rr, mode, plan, t, "smelt_conv2d", smelt_conv2d(f->ctx, dp, a, b, cc, d, bias),
             smelt_conv2d_plan(f->ctx, dp, a, b, cc, d, bias, &plan), smelt_conv2d_run(plan, a, b, cc, d, bias));
  }
  smelt_plan_destroy(plan);
}
