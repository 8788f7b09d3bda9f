/* Fuzz entry point for BEM (smelt_bem*, forward and backward): x [M, d_in],
 * codes [M, r], y or dy [M, d_out], one adapter's v [d_in, r] and u
 * [d_out, r] or A adapters' [A, d_in, r] and [A, d_out, r] with offsets
 * whose values are anything (the library clamps them, reading nothing on
 * the host), scales now and then; the rank hostile now and then (0, past
 * 128); the backward's gradients each present or not. M·max(d_in, d_out)·r
 * stays under a few thousand for the CPU reference. */
#include "fuzz.h"

#include <string.h>

#define WORK_CAP 4096

enum { X, V, CODES, U, OFFS, SCALES, Y, DX, DV, DU, DCODES, NT };

/* Offsets: mostly ascending within [0, M], now and then any value. */
static void fill_offsets(fz *f, const smelt_tensor *t, int64_t n, int64_t m) {
  int64_t v[16] = {0}, at = 0;
  for (int64_t i = 0; i < n && i < 16; i++) {
    uint8_t b = fz_u8(f);
    if (b >= 240) v[i] = fz_size(f, 8);
    else v[i] = at = at + (m > 0 && m < 64 ? b % (m - at + 1) : 0);
  }
  fz_fill_ints(t, v, 16);
}

void fz_bem(fz *f) {
  int64_t dims[4] = {fz_size(f, 12), fz_size(f, 12), fz_size(f, 12), fz_size(f, 16)};
  fz_cap_work(dims, 4, WORK_CAP);
  const int64_t m = dims[0], din = dims[1], dout = dims[2];
  const int64_t rank = fz_one_in(f, 16) ? fz_size(f, 140) : dims[3];
  const int segments = fz_u8(f) & 1;
  const int64_t na = segments ? fz_small(f, 3) : 1, nofs = fz_one_in(f, 16) ? fz_size(f, 5) : na + 1;
  smelt_bem_desc desc = smelt_bem_desc_default();
  if (fz_u8(f) & 1) desc.scale = fz_double(f);
  if (fz_u8(f) & 1) desc.accumulate = fz_one_in(f, 8) ? (int)fz_u32(f) : 1;
  const smelt_bem_desc *dp = fz_one_in(f, 16) ? NULL : &desc;
  const smelt_dtype dt = fz_float_dtype(f), odt = fz_one_in(f, 16) ? fz_float_dtype(f) : SMELT_DTYPE_I32;
  const int bwd = fz_u8(f) & 1, mode = fz_mode(f), with_scales = fz_one_in(f, 3), in_place = fz_one_in(f, 16);
  const uint8_t want = fz_u8(f); /* which gradients the backward asks for */
  unsigned nulls = fz_nulls(f, 5);
  smelt_tensor t[NT];
  memset(t, 0, sizeof t);
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    const int64_t xs[2] = {m, din}, cs[2] = {m, rank}, ys[2] = {m, dout};
    const int64_t vs[3] = {na, din, rank}, us[3] = {na, dout, rank}, sc = segments ? na : 1;
    t[X] = fz_view(f, dt, 2, xs, 0);
    t[V] = fz_view(f, fz_one_in(f, 16) ? fz_float_dtype(f) : dt, 2 + segments, vs + !segments, 0);
    t[CODES] = fz_view(f, dt, 2, cs, 0);
    t[U] = fz_view(f, dt, 2 + segments, us + !segments, 0);
    t[OFFS] = fz_one_in(f, 8) ? fz_view(f, odt, 1, &nofs, 0) : fz_view_plain(f, odt, 1, &nofs, 0);
    fill_offsets(f, &t[OFFS], nofs, m);
    t[SCALES] = fz_view(f, SMELT_DTYPE_F32, 1, &sc, 0);
    t[Y] = fz_view(f, dt, 2, ys, !bwd);
    t[DX] = in_place && bwd ? t[X] : fz_view(f, dt, 2, xs, 0);
    if (bwd && want & 1) fz_output(&t[DX]);
    t[DV] = fz_view(f, dt, 2 + segments, vs + !segments, bwd && want & 2);
    t[DU] = fz_view(f, dt, 2 + segments, us + !segments, bwd && want & 4);
    t[DCODES] = fz_view(f, dt, 2, cs, bwd && want & 8);
    smelt_bem_inputs in = {fz_maybe_null(nulls, t, X), fz_maybe_null(nulls, t, V), fz_maybe_null(nulls, t, CODES),
                           fz_maybe_null(nulls, t, U), segments ? &t[OFFS] : NULL, with_scales ? &t[SCALES] : NULL};
    /* The backward with no gradient asked for is a call like any other. */
    smelt_bem_grads g = {want & 1 ? &t[DX] : NULL, want & 2 ? &t[DV] : NULL, want & 4 ? &t[DU] : NULL,
                         want & 8 ? &t[DCODES] : NULL};
    const smelt_bem_inputs *ip = nulls >> 4 & 1 ? NULL : &in;
    const smelt_bem_grads *gp = want & 16 && fz_one_in(f, 4) ? NULL : &g;
    const smelt_bem_inputs in_saved = in;
    const smelt_bem_grads g_saved = g;
    if (!bwd) {
      FZ_ROUND(s, r, mode, plan, t, "smelt_bem", smelt_bem(f->ctx, dp, ip, &t[Y]),
               smelt_bem_plan(f->ctx, dp, ip, &t[Y], &plan), smelt_bem_run(plan, ip, &t[Y]));
    } else {
      FZ_ROUND(s, r, mode, plan, t, "smelt_bem_backward", smelt_bem_backward(f->ctx, dp, ip, &t[Y], gp),
               smelt_bem_backward_plan(f->ctx, dp, ip, &t[Y], gp, &plan), smelt_bem_backward_run(plan, ip, &t[Y], gp));
    }
    fz_same("smelt_bem", &in_saved, &in, sizeof in);
    fz_same("smelt_bem", &g_saved, &g, sizeof g);
  }
  smelt_plan_destroy(plan);
}
