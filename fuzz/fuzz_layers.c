/* Fuzz entry points for a transformer layer's smaller ops: the row norms
 * (smelt_norm forward with or without the residual, smelt_norm_bwd),
 * smelt_residual_add and smelt_rotary. Shapes stay small for the CPU
 * reference; each optional tensor is present or not, in place now and
 * then (y over x, h_out over the residual, dx over dy), and the rotary
 * tables' width and the positions' values are anything now and then (the
 * library clamps positions and must reject a table wider than the head). */
#include "fuzz.h"

#include <string.h>

enum { N_X, N_RES, N_W, N_B, N_Y, N_H, N_MEAN, N_RSTD, N_DY, N_DH, N_DX, N_DW, N_DB, NN };

void fz_norm(fz *f) {
  int64_t dims[3] = {fz_size(f, 6), fz_size(f, 5), fz_size(f, 40)};
  fz_cap_work(dims, 3, 2048);
  const int nd = 1 + (int)fz_small(f, 2);
  const int64_t *shape = dims + 3 - nd, c = dims[2];
  smelt_norm_desc desc = {(smelt_norm_kind)fz_enum(f, 2), fz_one_in(f, 8) ? (float)fz_double(f) : 1e-5f};
  const smelt_norm_desc *dp = fz_one_in(f, 16) ? NULL : &desc;
  const smelt_dtype dt = fz_float_dtype(f), wdt = fz_u8(f) & 1 ? SMELT_DTYPE_F32 : dt;
  const uint8_t has = fz_u8(f); /* which optional tensors take part */
  const int bwd = fz_u8(f) & 1, in_place = fz_one_in(f, 6), mode = fz_mode(f);
  unsigned nulls = fz_nulls(f, 2);
  smelt_tensor t[NN];
  memset(t, 0, sizeof t);
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    for (int i = 0; i < NN; i++) {
      const int vec = i == N_W || i == N_B || i == N_DW || i == N_DB, stat = i == N_MEAN || i == N_RSTD;
      const smelt_dtype d = vec ? wdt : stat ? SMELT_DTYPE_F32 : dt;
      t[i] = vec ? fz_view(f, d, 1, &c, 0) : fz_view(f, d, stat ? nd - 1 : nd, shape, 0);
    }
    if (in_place) t[bwd ? N_DX : N_Y] = t[bwd ? N_DY : N_X];
    /* The outputs this call writes (the checks allow changes there only). */
    const int outs[4][2] = {{N_Y, N_DX}, {N_H, N_DW}, {N_MEAN, N_DB}, {N_RSTD, -1}};
    const uint8_t bit[4][2] = {{0, 0}, {8, 128}, {16, 4}, {32, 0}};
    for (int i = 0; i < 4; i++)
      if (outs[i][bwd] >= 0 && (!bit[i][bwd] || has & bit[i][bwd])) fz_output(&t[outs[i][bwd]]);
    const smelt_tensor *res = has & 1 ? &t[N_RES] : NULL, *w = has & 2 ? &t[N_W] : NULL,
                       *b = has & 4 ? &t[N_B] : NULL, *h = has & 8 ? &t[N_H] : NULL,
                       *mean = has & 16 ? &t[N_MEAN] : NULL, *rstd = has & 32 ? &t[N_RSTD] : NULL;
    if (!bwd) {
      const smelt_tensor *x = fz_maybe_null(nulls, t, N_X), *y = fz_maybe_null(nulls >> 1, t, N_Y);
      FZ_ROUND(s, r, mode, plan, t, "smelt_norm", smelt_norm(f->ctx, dp, x, res, w, b, y, h, mean, rstd),
               smelt_norm_plan(f->ctx, dp, x, res, w, b, y, h, mean, rstd, &plan),
               smelt_norm_run(plan, x, res, w, b, y, h, mean, rstd));
    } else {
      const smelt_tensor *dy = fz_maybe_null(nulls, t, N_DY), *dx = fz_maybe_null(nulls >> 1, t, N_DX),
                         *dh = has & 64 ? &t[N_DH] : NULL, *dw = has & 128 ? &t[N_DW] : NULL,
                         *db = has & 4 ? &t[N_DB] : NULL, *x = &t[N_X];
      FZ_ROUND(s, r, mode, plan, t, "smelt_norm_bwd", smelt_norm_bwd(f->ctx, dp, dy, x, w, mean, rstd, dh, dx, dw, db),
               smelt_norm_bwd_plan(f->ctx, dp, dy, x, w, mean, rstd, dh, dx, dw, db, &plan),
               smelt_norm_bwd_run(plan, dy, x, w, mean, rstd, dh, dx, dw, db));
    }
  }
  smelt_plan_destroy(plan);
}

void fz_residual_add(fz *f) {
  int64_t shape[3] = {fz_size(f, 6), fz_size(f, 6), fz_size(f, 12)};
  fz_cap_work(shape, 3, 1024);
  const int nd = 1 + (int)fz_small(f, 2), in_place = fz_one_in(f, 4), mode = fz_mode(f);
  const smelt_dtype dt = fz_float_dtype(f);
  unsigned nulls = fz_nulls(f, 3);
  smelt_tensor t[3];
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    t[0] = fz_view(f, dt, nd, shape + 3 - nd, 0);
    t[1] = fz_view(f, dt, nd, shape + 3 - nd, 0);
    t[2] = in_place ? t[1] : fz_view(f, dt, nd, shape + 3 - nd, 0);
    fz_output(&t[2]);
    const smelt_tensor *x = fz_maybe_null(nulls, t, 0), *res = fz_maybe_null(nulls >> 1, t, 1),
                       *y = fz_maybe_null(nulls >> 2, t, 2);
    FZ_ROUND(s, r, mode, plan, t, "smelt_residual_add", smelt_residual_add(f->ctx, x, res, y),
             smelt_residual_add_plan(f->ctx, x, res, y, &plan), smelt_residual_add_run(plan, x, res, y));
  }
  smelt_plan_destroy(plan);
}

void fz_rotary(fz *f) {
  int64_t x[4] = {fz_size(f, 3), fz_size(f, 6), fz_size(f, 3), fz_size(f, 16)};
  fz_cap_work(x, 4, 1024);
  int64_t tab[2] = {fz_size(f, 8), fz_one_in(f, 8) ? fz_size(f, 10) : (x[3] > 0 && x[3] < 64 ? x[3] / 2 : 1)};
  const int64_t pos[2] = {x[0], x[1]};
  smelt_rotary_desc desc = {(smelt_rotary_layout)fz_enum(f, 2), fz_one_in(f, 8) ? (int)fz_u8(f) : fz_u8(f) & 1};
  const smelt_rotary_desc *dp = fz_one_in(f, 16) ? NULL : &desc;
  const smelt_dtype dt = fz_float_dtype(f), pdt = fz_u8(f) & 1 ? SMELT_DTYPE_I64 : SMELT_DTYPE_I32;
  const int with_pos = fz_u8(f) & 1, in_place = fz_one_in(f, 4), mode = fz_mode(f);
  unsigned nulls = fz_nulls(f, 3);
  smelt_tensor t[5];
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    t[0] = fz_view(f, dt, 4, x, 0);
    t[1] = fz_view(f, SMELT_DTYPE_F32, 2, tab, 0);
    t[2] = fz_view(f, SMELT_DTYPE_F32, 2, tab, 0);
    t[3] = fz_view_plain(f, pdt, 2, pos, 0);
    int64_t v[16];
    for (int i = 0; i < 16; i++) v[i] = fz_one_in(f, 8) ? fz_size(f, 9) : fz_small(f, 8);
    fz_fill_ints(&t[3], v, 16);
    t[4] = in_place ? t[0] : fz_view(f, dt, 4, x, 0);
    fz_output(&t[4]);
    const smelt_tensor *xx = fz_maybe_null(nulls, t, 0), *cs = fz_maybe_null(nulls >> 1, t, 1),
                       *y = fz_maybe_null(nulls >> 2, t, 4), *p = with_pos ? &t[3] : NULL;
    FZ_ROUND(s, r, mode, plan, t, "smelt_rotary", smelt_rotary(f->ctx, dp, xx, cs, &t[2], p, y),
             smelt_rotary_plan(f->ctx, dp, xx, cs, &t[2], p, y, &plan), smelt_rotary_run(plan, xx, cs, &t[2], p, y));
  }
  smelt_plan_destroy(plan);
}
