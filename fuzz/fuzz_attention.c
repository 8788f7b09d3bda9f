/* Fuzz entry points for attention: batched and varlen, forward and
 * backward, one-shot and plan + run. Windows and max_seqlen take hostile
 * values (INT64_MAX, negative); cu_seqlens are mostly well formed so the
 * CPU reference computes, and B * H * Sq * Sk * D stays small. */
#include "fuzz.h"

#include <stdlib.h>
#include <string.h>

#define WORK_CAP 4096

static smelt_attention_desc draw_desc(fz *f) {
  smelt_attention_desc d = smelt_attention_desc_default();
  uint8_t which = fz_u8(f);
  if (which & 1) d.scale = (float)fz_double(f);
  if (which & 2) d.causal = fz_u8(f) % 3 == 0 ? (int)fz_u32(f) : 1;
  if (which & 4) d.window_left = fz_size(f, 6);
  if (which & 8) d.window_right = fz_size(f, 6);
  if (which & 16) d.deterministic = fz_u8(f);
  if (which & 32) d.fwd_schedule = (smelt_attention_schedule)fz_enum(f, SMELT_ATTENTION_SCHEDULE_COUNT);
  return d;
}

static smelt_dtype draw_dtype(fz *f) {
  static const smelt_dtype common[4] = {SMELT_DTYPE_F32, SMELT_DTYPE_F64, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  return fz_one_in(f, 16) ? fz_float_dtype(f) : common[fz_u8(f) % 4];
}

/* q, k, v, o, lse, d_o, dq, dk, dv; then cu_seqlens_q, cu_seqlens_k (varlen). */
enum { Q, K, V, O, LSE, DO, DQ, DK, DV, CUQ, CUK, NT };

typedef struct shape {
  int64_t B, Sq, Sk, H, Hk, D;
} shape;

static shape draw_shape(fz *f) {
  int64_t dims[5] = {fz_size(f, 3), fz_size(f, 9), fz_size(f, 9), 1 + fz_small(f, 2), fz_size(f, 9)};
  fz_cap_work(dims, 5, WORK_CAP);
  int64_t group = 1 + fz_small(f, 2);
  shape s = {dims[0], dims[1], dims[2], dims[3] * group, dims[3], dims[4]};
  if (fz_one_in(f, 16)) s.H = fz_size(f, 8); /* not a multiple of Hk, or hostile */
  return s;
}

/* The nine views of a call: q-shaped (q, o, d_o, dq), k-shaped (k, v, dk,
 * dv) and lse; the forward's outputs or the backward's. */
static void views(fz *f, smelt_tensor *t, smelt_dtype dt, int nd, const int64_t *q, const int64_t *k,
                  const int64_t *lse, int bwd) {
  t[Q] = fz_view(f, dt, nd, q, 0);
  t[K] = fz_view(f, dt, nd, k, 0);
  t[V] = fz_view(f, dt, nd, k, 0);
  t[O] = fz_view(f, dt, nd, q, !bwd);
  t[LSE] = fz_view(f, SMELT_DTYPE_F32, nd - 1, lse, !bwd);
  t[DO] = fz_view(f, dt, nd, q, 0);
  t[DQ] = fz_view(f, dt, nd, q, bwd);
  t[DK] = fz_view(f, dt, nd, k, bwd);
  t[DV] = fz_view(f, dt, nd, k, bwd);
}

static void batched_views(fz *f, smelt_tensor *t, smelt_dtype dt, const shape *s, int bwd) {
  int64_t q[4] = {s->B, s->Sq, s->H, s->D}, k[4] = {s->B, s->Sk, s->Hk, s->D}, lse[3] = {s->B, s->H, s->Sq};
  views(f, t, dt, 4, q, k, lse, bwd);
}

/* Sequence bounds: cumulative, ending at the total, mostly. */
static void bounds(fz *f, smelt_tensor *t, int64_t B, int64_t total, int64_t *longest) {
  int64_t v[64], at = 0;
  *longest = 0;
  for (int i = 0; i < 64; i++) {
    uint8_t b = fz_u8(f);
    int64_t next;
    if (i == 0) next = 0;
    else if (b >= 240) next = fz_size(f, 40);
    else if (i >= B || total > 4096 || at < 0 || at > total) next = total;
    else next = at + b % (total - at + 1);
    if (next >= 0 && at >= 0 && next - at > *longest) *longest = next - at;
    v[i] = at = next;
  }
  fz_fill_ints(t, v, 64);
}

static void varlen_views(fz *f, smelt_tensor *t, smelt_dtype dt, const shape *s, int bwd, int64_t *max_q,
                         int64_t *max_k) {
  int64_t per = s->B > 0 && s->B < 8 ? s->B : 1, Tq = fz_mul(s->Sq, per), Tk = fz_mul(s->Sk, per);
  int64_t q[3] = {Tq, s->H, s->D}, k[3] = {Tk, s->Hk, s->D}, lse[2] = {s->H, Tq};
  int64_t cu = s->B < INT64_MAX ? s->B + 1 : s->B;
  views(f, t, dt, 3, q, k, lse, bwd);
  smelt_dtype cu_dt = fz_one_in(f, 16) ? SMELT_DTYPE_I64 : SMELT_DTYPE_I32;
  t[CUQ] = fz_one_in(f, 8) ? fz_view(f, cu_dt, 1, &cu, 0) : fz_view_plain(f, cu_dt, 1, &cu, 0);
  t[CUK] = fz_one_in(f, 8) ? fz_view(f, cu_dt, 1, &cu, 0) : fz_view_plain(f, cu_dt, 1, &cu, 0);
  bounds(f, &t[CUQ], s->B, Tq, max_q);
  bounds(f, &t[CUK], s->B, Tk, max_k);
}

void fz_attention(fz *f) {
  shape sh = draw_shape(f);
  smelt_dtype dt = draw_dtype(f);
  smelt_attention_desc desc = draw_desc(f);
  const smelt_attention_desc *dp = fz_one_in(f, 16) ? NULL : &desc;
  int bwd = fz_u8(f) & 1, mode = fz_mode(f), with_lse = bwd || !fz_one_in(f, 4);
  unsigned nulls = fz_nulls(f, 9);
  smelt_tensor t[NT];
  memset(t, 0, sizeof t);
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    batched_views(f, t, dt, &sh, bwd);
    const smelt_tensor *p[NT];
    for (int i = 0; i < NT; i++) p[i] = fz_maybe_null(nulls, t, i);
    if (!with_lse) p[LSE] = NULL;
    if (!bwd && mode == 0)
      FZ_CALL(s, "smelt_attention_fwd", t, smelt_attention_fwd(f->ctx, dp, p[Q], p[K], p[V], p[O], p[LSE]));
    if (bwd && mode == 0)
      FZ_CALL(s, "smelt_attention_bwd", t,
              smelt_attention_bwd(f->ctx, dp, p[Q], p[K], p[V], p[O], p[DO], p[LSE], p[DQ], p[DK], p[DV]));
    if (mode == 0) return;
    if (r == 0 && !bwd)
      FZ_PLAN(s, "smelt_attention_fwd_plan", t, plan,
              smelt_attention_fwd_plan(f->ctx, dp, p[Q], p[K], p[V], p[O], p[LSE], &plan));
    if (r == 0 && bwd)
      FZ_PLAN(s, "smelt_attention_bwd_plan", t, plan,
              smelt_attention_bwd_plan(f->ctx, dp, p[Q], p[K], p[V], p[O], p[DO], p[LSE], p[DQ], p[DK], p[DV],
                                       &plan));
    if (!plan) return;
    if (!bwd)
      FZ_CALL(s, "smelt_attention_fwd_run", t, smelt_attention_fwd_run(plan, p[Q], p[K], p[V], p[O], p[LSE]));
    else
      FZ_CALL(s, "smelt_attention_bwd_run", t,
              smelt_attention_bwd_run(plan, p[Q], p[K], p[V], p[O], p[DO], p[LSE], p[DQ], p[DK], p[DV]));
  }
  smelt_plan_destroy(plan);
}

void fz_attention_varlen(fz *f) {
  shape sh = draw_shape(f);
  smelt_dtype dt = draw_dtype(f);
  smelt_attention_desc desc = draw_desc(f);
  int bwd = fz_u8(f) & 1, mode = fz_mode(f), with_lse = bwd || !fz_one_in(f, 4);
  int max_from_input = fz_one_in(f, 8);
  unsigned nulls = fz_nulls(f, NT);
  smelt_tensor t[NT];
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    int64_t max_q, max_k;
    varlen_views(f, t, dt, &sh, bwd, &max_q, &max_k);
    if (r == 0) {
      desc.max_seqlen_q = max_from_input ? fz_size(f, 9) : max_q;
      desc.max_seqlen_k = max_from_input ? fz_size(f, 9) : max_k;
    }
    const smelt_tensor *p[NT];
    for (int i = 0; i < NT; i++) p[i] = fz_maybe_null(nulls, t, i);
    if (!with_lse) p[LSE] = NULL;
    if (!bwd && mode == 0)
      FZ_CALL(s, "smelt_attention_varlen_fwd", t,
              smelt_attention_varlen_fwd(f->ctx, &desc, p[Q], p[K], p[V], p[CUQ], p[CUK], p[O], p[LSE]));
    if (bwd && mode == 0)
      FZ_CALL(s, "smelt_attention_varlen_bwd", t,
              smelt_attention_varlen_bwd(f->ctx, &desc, p[Q], p[K], p[V], p[CUQ], p[CUK], p[O], p[DO], p[LSE],
                                         p[DQ], p[DK], p[DV]));
    if (mode == 0) return;
    if (r == 0 && !bwd)
      FZ_PLAN(s, "smelt_attention_varlen_fwd_plan", t, plan,
              smelt_attention_varlen_fwd_plan(f->ctx, &desc, p[Q], p[K], p[V], p[CUQ], p[CUK], p[O], p[LSE], &plan));
    if (r == 0 && bwd)
      FZ_PLAN(s, "smelt_attention_varlen_bwd_plan", t, plan,
              smelt_attention_varlen_bwd_plan(f->ctx, &desc, p[Q], p[K], p[V], p[CUQ], p[CUK], p[O], p[DO], p[LSE],
                                              p[DQ], p[DK], p[DV], &plan));
    if (!plan) return;
    if (!bwd)
      FZ_CALL(s, "smelt_attention_varlen_fwd_run", t,
              smelt_attention_varlen_fwd_run(plan, p[Q], p[K], p[V], p[CUQ], p[CUK], p[O], p[LSE]));
    else
      FZ_CALL(s, "smelt_attention_varlen_bwd_run", t,
              smelt_attention_varlen_bwd_run(plan, p[Q], p[K], p[V], p[CUQ], p[CUK], p[O], p[DO], p[LSE], p[DQ],
                                             p[DK], p[DV]));
  }
  smelt_plan_destroy(plan);
}
