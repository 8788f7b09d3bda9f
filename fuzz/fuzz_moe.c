/* Fuzz entry point for MoE (smelt_moe_*): a config drawn field by field
 * (sizes, score, groups, noise, capacity and drop policy, aux
 * coefficients, FFN kind and activation: hostile values now and then),
 * the weights each of their own dtype and each optional one present or
 * not, then the layer (one-shot or plan + runs, forward or backward) or
 * one of the parts on a plan. The index tensors the parts read (ids,
 * offsets, row_map, counts) hold a routing the entry builds itself, well
 * formed mostly, with a hostile value now and then. T·k·d·F·E stays under a
 * few thousand for the CPU reference. */
#include "fuzz.h"

#include <string.h>

#define WORK_CAP 4096

enum {
  X, Y, DY, DX, WR, EB, WN, W1, W3, W2, B1,
  LOGITS, IDS, WTS, COUNTS, OFFS, DROPPED, AUX, DLOGITS, DWTS,
  XP, ROWMAP, YP, DXP, DYP, DWR, DWN, DW1, DW3, DW2, DB1, SAVED, NT
};

/* The parts run on a plan, after the layer's forward and backward. */
enum { FWD, BWD, ROUTE, AUX_LOSSES, ROUTE_BWD, PERMUTE, PERMUTE_BWD, UNPERMUTE, UNPERMUTE_BWD, FFN, FFN_BWD, STATS,
       FWD_SAVE, BWD_SAVED, SAVED_BYTES, NOPS };

static smelt_moe_config draw_config(fz *f, const int64_t *dims) {
  smelt_moe_config c = smelt_moe_config_default();
  c.num_experts = dims[0], c.top_k = dims[1], c.d_model = dims[2], c.ffn_dim = dims[3];
  uint8_t which = fz_u8(f);
  if (which & 1) c.score = (smelt_moe_score)fz_enum(f, SMELT_MOE_SCORE_COUNT), c.renormalize = fz_u8(f) % 3;
  if (which & 2) c.scaling_factor = fz_double(f);
  if (which & 4) {
    /* Groups that divide E and a topk_groups within them, mostly. */
    c.num_groups = fz_size(f, 4), c.topk_groups = fz_size(f, 4);
    if (c.num_groups > 0 && c.num_groups <= 4 && c.num_experts > 0 && !fz_one_in(f, 4)) {
      if (c.num_experts % c.num_groups) c.num_groups = 1;
      c.topk_groups = 1 + c.topk_groups % c.num_groups;
      if (c.top_k > 0 && c.topk_groups > c.top_k) c.topk_groups = c.top_k;
    }
  }
  if (which & 8) c.noise_seed = fz_u64(f), c.noise_token_offset = fz_size(f, 100);
  if (which & 16) {
    c.drop_policy = (smelt_moe_drop)fz_enum(f, SMELT_MOE_DROP_COUNT);
    c.capacity_factor = fz_one_in(f, 4) ? fz_double(f) : (double)(fz_u8(f) % 8) / 4;
  }
  if (which & 32) c.aux_loss_coeff = fz_double(f), c.z_loss_coeff = fz_double(f);
  if (which & 64) c.ffn = (smelt_moe_ffn)fz_enum(f, SMELT_MOE_FFN_COUNT), c.activation = (smelt_act)fz_enum(f, SMELT_ACT_COUNT);
  return c;
}

/* A routing of T tokens over E experts, k slots each: ids, offsets, counts
 * and row_map as the router writes them, with a hostile value now and then. */
static void fill_routing(fz *f, const smelt_tensor *t, int64_t T, int64_t E, int64_t k) {
  int64_t ids[256], rows[256], counts[65] = {0}, offs[66] = {0};
  const int64_t n = T > 0 && T <= 256 && k > 0 && k <= 256 && E > 0 && E <= 64 && T * k <= 256 ? T * k : 0;
  for (int64_t i = 0; i < n; i++) {
    uint8_t b = fz_u8(f);
    ids[i] = b % 16 == 15 ? -1 : b % E;
    if (ids[i] >= 0) counts[ids[i]]++;
  }
  for (int64_t e = 0; e < E && e < 65; e++) offs[e + 1] = offs[e] + counts[e];
  int64_t at[65];
  memcpy(at, offs, sizeof at);
  for (int64_t i = 0; i < n; i++) rows[i] = ids[i] < 0 ? -1 : at[ids[i]]++;
  if (n && fz_one_in(f, 8)) ids[fz_u8(f) % n] = fz_size(f, 70);
  if (n && fz_one_in(f, 8)) rows[fz_u8(f) % n] = fz_size(f, 300);
  if (E > 0 && E <= 64 && fz_one_in(f, 8)) offs[fz_u8(f) % (E + 1)] = fz_size(f, 300);
  if (E > 0 && E <= 64 && fz_one_in(f, 8)) counts[fz_u8(f) % E] = fz_size(f, 300);
  fz_fill_ints(&t[IDS], ids, n);
  fz_fill_ints(&t[ROWMAP], rows, n);
  fz_fill_ints(&t[OFFS], offs, E > 0 && E <= 64 ? E + 1 : 0);
  fz_fill_ints(&t[COUNTS], counts, E > 0 && E <= 64 ? E : 0);
}

static smelt_dtype index_dtype(fz *f) {
  return fz_one_in(f, 16) ? (smelt_dtype)fz_enum(f, SMELT_DTYPE_COUNT) : fz_u8(f) & 1 ? SMELT_DTYPE_I64 : SMELT_DTYPE_I32;
}

static smelt_dtype float_or_f64(fz *f) { return fz_one_in(f, 6) ? SMELT_DTYPE_F64 : fz_float_dtype(f); }

static smelt_tensor index_view(fz *f, smelt_dtype dt, int nd, const int64_t *shape) {
  return fz_one_in(f, 8) ? fz_view(f, dt, nd, shape, 0) : fz_view_plain(f, dt, nd, shape, 0);
}

static void make_views(fz *f, smelt_tensor *t, int64_t T, int64_t E, int64_t k, int64_t d, int64_t F,
                       const smelt_dtype *wdt, smelt_dtype xdt, smelt_dtype ypdt, smelt_dtype idt) {
  const int64_t Tk = fz_mul(T, k), Ep1 = E < INT64_MAX ? E + 1 : E, one = 1, two = 2;
  const int64_t td[2] = {T, d}, de[2] = {d, E}, edf[3] = {E, d, F}, efd[3] = {E, F, d}, ef[2] = {E, F},
                te[2] = {T, E}, tk[2] = {T, k}, tkd[2] = {Tk, d};
  t[X] = fz_view(f, xdt, 2, td, 0);
  t[Y] = fz_view(f, xdt, 2, td, 0);
  t[DY] = fz_view(f, xdt, 2, td, 0);
  t[DX] = fz_view(f, xdt, 2, td, 0);
  t[WR] = fz_view(f, wdt[0], 2, de, 0);
  t[EB] = fz_view(f, SMELT_DTYPE_F32, 1, &E, 0);
  t[WN] = fz_view(f, wdt[1], 2, de, 0);
  t[W1] = fz_view(f, wdt[2], 3, edf, 0);
  t[W3] = fz_view(f, wdt[3], 3, edf, 0);
  t[W2] = fz_view(f, wdt[4], 3, efd, 0);
  t[B1] = fz_view(f, wdt[5], 2, ef, 0);
  t[LOGITS] = fz_view(f, SMELT_DTYPE_F32, 2, te, 0);
  t[IDS] = index_view(f, fz_one_in(f, 16) ? idt : SMELT_DTYPE_I32, 2, tk);
  t[WTS] = fz_view(f, SMELT_DTYPE_F32, 2, tk, 0);
  t[COUNTS] = index_view(f, idt, 1, &E);
  t[OFFS] = index_view(f, idt, 1, &Ep1);
  t[DROPPED] = index_view(f, idt, 1, &one);
  t[AUX] = fz_view(f, SMELT_DTYPE_F32, 1, &two, 0);
  t[DLOGITS] = fz_view(f, SMELT_DTYPE_F32, 2, te, 0);
  t[DWTS] = fz_view(f, SMELT_DTYPE_F32, 2, tk, 0);
  t[XP] = fz_view(f, xdt, 2, tkd, 0);
  t[ROWMAP] = index_view(f, fz_one_in(f, 16) ? idt : SMELT_DTYPE_I32, 2, tk);
  t[YP] = fz_view(f, ypdt, 2, tkd, 0);
  t[DXP] = fz_view(f, ypdt, 2, tkd, 0);
  t[DYP] = fz_view(f, ypdt, 2, tkd, 0);
  t[DWR] = fz_view(f, wdt[0], 2, de, 0);
  t[DWN] = fz_view(f, wdt[1], 2, de, 0);
  t[DW1] = fz_view(f, wdt[2], 3, edf, 0);
  t[DW3] = fz_view(f, wdt[3], 3, edf, 0);
  t[DW2] = fz_view(f, wdt[4], 3, efd, 0);
  t[DB1] = fz_view(f, wdt[5], 2, ef, 0);
  /* The saved state: 0 bytes on the CPU, mostly; sometimes another size or dtype. */
  const int64_t sb = fz_one_in(f, 4) ? fz_size(f, 9) : 0;
  t[SAVED] = fz_view(f, fz_one_in(f, 8) ? fz_float_dtype(f) : SMELT_DTYPE_U8, 1, &sb, 0);
}

static void outputs(const smelt_tensor *t, const int *which, int n) {
  for (int i = 0; i < n; i++) fz_output(&t[which[i]]);
}

void fz_moe(fz *f) {
  int64_t dims[5] = {1 + fz_small(f, 7), 1 + fz_small(f, 3), 1 + fz_small(f, 7), 1 + fz_small(f, 7), fz_size(f, 12)};
  fz_cap_work(dims, 5, WORK_CAP);
  for (int i = 0; i < 4; i++)
    if (fz_one_in(f, 24)) dims[i] = fz_size(f, 9); /* 0, past E, or hostile */
  const int64_t E = dims[0], k = dims[1], d = dims[2], F = dims[3], T = dims[4];
  smelt_moe_config cfg = draw_config(f, dims);
  const smelt_moe_config *cp = fz_one_in(f, 16) ? NULL : &cfg;
  /* f64 pairs only with f64: the weights follow x there, mostly. */
  const smelt_dtype xdt = float_or_f64(f), ypdt = float_or_f64(f), idt = index_dtype(f);
  smelt_dtype wdt[6];
  for (int i = 0; i < 6; i++) wdt[i] = xdt == SMELT_DTYPE_F64 && !fz_one_in(f, 16) ? xdt : float_or_f64(f);
  const uint8_t present = fz_u8(f); /* the optional weights and gradients */
  /* w3 with SwiGLU and b1 (optional) with the MLP, mostly: the other way is refused. */
  const int swiglu = cfg.ffn == SMELT_MOE_FFN_SWIGLU, with_w3 = swiglu != fz_one_in(f, 16),
            with_b1 = (!swiglu && present & 8) || fz_one_in(f, 16);
  const int op = fz_u8(f) % NOPS, mode = op <= BWD ? fz_mode(f) : 1 + fz_u8(f) % 2;
  unsigned nulls = fz_nulls(f, 12);
  smelt_tensor t[NT];
  memset(t, 0, sizeof t);
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    make_views(f, t, T, E, k, d, F, wdt, xdt, ypdt, idt);
    fill_routing(f, t, T, E, k);
    const smelt_tensor *p[NT];
    for (int i = 0; i < NT; i++) p[i] = fz_maybe_null(nulls, t, i);
    const int noisy = present & 2;
    smelt_moe_weights w = {p[WR], present & 1 ? &t[EB] : NULL, noisy ? &t[WN] : NULL,
                           p[W1], with_w3 ? &t[W3] : NULL, p[W2], with_b1 ? &t[B1] : NULL};
    smelt_moe_routing ro = {p[LOGITS], p[IDS], p[WTS], p[COUNTS], p[OFFS], present & 16 ? &t[DROPPED] : NULL,
                            present & 32 ? &t[AUX] : NULL};
    smelt_moe_grads g = {present & 64 ? &t[DX] : NULL, present & 128 ? &t[DWR] : NULL, noisy ? &t[DWN] : NULL,
                         &t[DW1], with_w3 ? &t[DW3] : NULL, &t[DW2], with_b1 ? &t[DB1] : NULL};
    smelt_moe_grads fg = {&t[DXP], NULL, NULL, g.dw1, g.dw3, g.dw2, g.db1};
    smelt_moe_stats stats;
    smelt_moe_stats *sp = fz_one_in(f, 16) ? NULL : &stats;
    const smelt_moe_routing *rp = fz_one_in(f, 4) ? NULL : &ro;
    if (op == FWD) {
      fz_output(&t[Y]);
      if (rp) outputs(t, (const int[]){LOGITS, IDS, WTS, COUNTS, OFFS, DROPPED, AUX}, 7);
      FZ_ROUND(s, r, mode, plan, t, "smelt_moe_forward", smelt_moe_forward(f->ctx, cp, &w, p[X], p[Y], rp, sp),
               smelt_moe_plan(f->ctx, cp, &w, p[X], &plan), smelt_moe_forward_run(plan, &w, p[X], p[Y], rp, sp));
      continue;
    }
    if (op == BWD) {
      outputs(t, (const int[]){DX, DWR, DWN, DW1, DW3, DW2, DB1}, 7);
      FZ_ROUND(s, r, mode, plan, t, "smelt_moe_backward", smelt_moe_backward(f->ctx, cp, &w, p[X], p[DY], &g),
               smelt_moe_plan(f->ctx, cp, &w, p[X], &plan),
               smelt_moe_backward_run(plan, &w, p[X], p[DY], &g));
      continue;
    }
    if (r == 0) {
      FZ_PLAN(s, "smelt_moe_plan", t, plan, smelt_moe_plan(f->ctx, cp, &w, p[X], &plan));
      if (s) return;
    }
    switch (op) {
    case ROUTE:
      outputs(t, (const int[]){LOGITS, IDS, WTS, COUNTS, OFFS, DROPPED, AUX}, 7);
      FZ_CALL(s, "smelt_moe_route_run", t, smelt_moe_route_run(plan, &w, p[X], &ro));
      break;
    case AUX_LOSSES:
      outputs(t, (const int[]){AUX, DLOGITS}, 2);
      FZ_CALL(s, "smelt_moe_aux_losses_run", t,
              smelt_moe_aux_losses_run(plan, &w, p[LOGITS], p[AUX], present & 64 ? &t[DLOGITS] : NULL));
      break;
    case ROUTE_BWD:
      fz_output(&t[DLOGITS]);
      FZ_CALL(s, "smelt_moe_route_backward_run", t,
              smelt_moe_route_backward_run(plan, &w, p[LOGITS], p[DWTS], p[DLOGITS]));
      break;
    case PERMUTE:
      outputs(t, (const int[]){XP, ROWMAP}, 2);
      FZ_CALL(s, "smelt_moe_permute_run", t, smelt_moe_permute_run(plan, p[X], p[IDS], p[OFFS], p[XP], p[ROWMAP]));
      break;
    case PERMUTE_BWD:
      fz_output(&t[DX]);
      FZ_CALL(s, "smelt_moe_permute_backward_run", t, smelt_moe_permute_backward_run(plan, p[DXP], p[ROWMAP], p[DX]));
      break;
    case UNPERMUTE:
      fz_output(&t[Y]);
      FZ_CALL(s, "smelt_moe_unpermute_run", t, smelt_moe_unpermute_run(plan, p[YP], p[ROWMAP], p[WTS], p[Y]));
      break;
    case UNPERMUTE_BWD:
      outputs(t, (const int[]){DYP, DWTS}, 2);
      FZ_CALL(s, "smelt_moe_unpermute_backward_run", t,
              smelt_moe_unpermute_backward_run(plan, p[DY], p[YP], p[ROWMAP], p[WTS], p[DYP],
                                               present & 64 ? &t[DWTS] : NULL));
      break;
    case FFN:
      fz_output(&t[YP]);
      FZ_CALL(s, "smelt_moe_ffn_run", t, smelt_moe_ffn_run(plan, &w, p[XP], p[OFFS], p[YP]));
      break;
    case FFN_BWD:
      outputs(t, (const int[]){DXP, DW1, DW3, DW2, DB1}, 5);
      FZ_CALL(s, "smelt_moe_ffn_backward_run", t,
              smelt_moe_ffn_backward_run(plan, &w, p[XP], p[OFFS], p[DYP], present & 128 ? &g : &fg));
      break;
    case FWD_SAVE:
      outputs(t, (const int[]){Y, SAVED, COUNTS, DROPPED, AUX}, 5);
      FZ_CALL(s, "smelt_moe_forward_save_run", t, smelt_moe_forward_save_run(plan, &w, p[X], p[Y], p[SAVED], rp));
      break;
    case BWD_SAVED:
      outputs(t, (const int[]){DX, DWR, DWN, DW1, DW3, DW2, DB1}, 7);
      FZ_CALL(s, "smelt_moe_backward_saved_run", t,
              smelt_moe_backward_saved_run(plan, &w, p[X], p[DY], p[SAVED], &g));
      break;
    case SAVED_BYTES: {
      int64_t bytes = 0;
      FZ_CALL(s, "smelt_moe_saved_bytes", t, smelt_moe_saved_bytes(plan, fz_one_in(f, 8) ? NULL : &bytes));
      const smelt_device_kind dev = (smelt_device_kind)(fz_u8(f) % 4);
      FZ_CALL(s, "smelt_moe_saved_bytes_for", t,
              smelt_moe_saved_bytes_for(cp, fz_one_in(f, 8) ? fz_size(f, 9) : T, fz_float_dtype(f), dev,
                                        fz_one_in(f, 8) ? NULL : &bytes));
      break;
    }
    default:
      FZ_CALL(s, "smelt_moe_stats_get", t,
              smelt_moe_stats_get(plan, p[COUNTS], present & 16 ? &t[DROPPED] : NULL, sp));
      break;
    }
  }
  smelt_plan_destroy(plan);
}
