/* Fuzz entry points for PEER: retrieval, forward and backward (one-shot
 * and plan + run, with expert tables or a store), and the expert store's
 * own calls. Configs are drawn small and consistent with the weights (so
 * the CPU reference computes), then now and then one field is made hostile;
 * store tables stay under 64 KiB unless their size overflows. */
#include "fuzz.h"

#include <stdlib.h>
#include <string.h>

#define STORE_BYTES ((int64_t)1 << 16)

static int64_t ipow(int64_t n, int64_t p) {
  int64_t r = 1;
  for (int64_t i = 0; i < p; i++) r = fz_mul(r, n);
  return r;
}

static smelt_dtype draw_dtype(fz *f) {
  static const smelt_dtype common[4] = {SMELT_DTYPE_F32, SMELT_DTYPE_F64, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  return fz_one_in(f, 16) ? fz_float_dtype(f) : common[fz_u8(f) % 4];
}

static smelt_peer_config draw_config(fz *f, int64_t *T) {
  smelt_peer_config c = smelt_peer_config_default();
  c.product_key_dims = 2 + (int)fz_small(f, 2);
  c.num_experts = 1;
  for (int i = 0; i < c.product_key_dims; i++) {
    c.sub_key_sizes[i] = 1 + fz_small(f, 3);
    c.num_experts *= c.sub_key_sizes[i];
  }
  if (fz_one_in(f, 4)) {
    int64_t n = 1 + fz_small(f, 3), all = 1;
    for (int i = 0; i < c.product_key_dims; i++) c.sub_key_sizes[i] = 0, all *= n;
    c.num_experts = all;
  }
  c.query_dim = c.product_key_dims * (1 + fz_small(f, 3));
  c.num_heads = 1 + fz_small(f, 2);
  c.num_experts_per_tok = 1 + fz_small(f, c.num_experts < 6 ? c.num_experts - 1 : 5);
  c.input_dim = 1 + fz_small(f, 7);
  c.output_dim = 1 + fz_small(f, 7);
  c.expert_hidden_size = 1 + fz_small(f, 3);
  c.activation = fz_u8(f) & 1 ? SMELT_ACT_RELU : SMELT_ACT_GELU;
  c.query_norm = (smelt_peer_norm)fz_enum(f, SMELT_PEER_NORM_COUNT);
  c.gate = (smelt_peer_gate)fz_enum(f, SMELT_PEER_GATE_COUNT);
  c.key_l2_norm = fz_u8(f) & 1;
  c.per_head_keys = fz_u8(f) & 1;
  *T = fz_size(f, 5);
  if (fz_one_in(f, 6)) {
    /* One field hostile (or out of its set). */
    int64_t v = fz_size(f, 9);
    switch (fz_u8(f) % 14) {
    case 0: c.input_dim = v; break;
    case 1: c.output_dim = v; break;
    case 2: c.num_experts = v; break;
    case 3: c.num_experts_per_tok = v; break;
    case 4: c.num_heads = v; break;
    case 5: c.expert_hidden_size = v; break;
    case 6: c.query_dim = v; break;
    case 7: c.product_key_dims = (int)v; break;
    case 8: c.sub_key_sizes[fz_u8(f) % SMELT_PEER_MAX_DIMS] = v; break;
    case 9: c.activation = (smelt_act)fz_enum(f, SMELT_ACT_COUNT); break;
    case 10: c.norm_eps = fz_double(f); break;
    case 11: c.l2_eps = fz_double(f); break;
    case 12: c.gate = (smelt_peer_gate)fz_enum(f, 1000); break;
    case 13: c.kernels.route = (smelt_peer_route_kernel)fz_enum(f, SMELT_PEER_ROUTE_COUNT); break;
    }
  }
  return c;
}

/* The store's options for cfg, or hostile ones; the tables stay small
 * unless their size overflows (which creation must refuse). */
static smelt_peer_store_options store_options(fz *f, const smelt_peer_config *c, smelt_dtype dt) {
  smelt_peer_store_options o = smelt_peer_store_options_default();
  o.num_experts = c ? c->num_experts : fz_size(f, 40);
  o.input_dim = c ? c->input_dim : fz_size(f, 9);
  o.output_dim = c ? c->output_dim : fz_size(f, 9);
  o.expert_hidden_size = c ? c->expert_hidden_size : fz_size(f, 4);
  o.dtype = dt;
  o.cache_mb = fz_one_in(f, 2) ? fz_double(f) : (double)fz_small(f, 3) / 64.0;
  o.use_managed_memory = fz_u8(f) & 1;
  o.use_env = fz_u8(f) & 1;
  int64_t slot, bytes;
  int in_range = o.num_experts >= 1 && o.input_dim >= 1 && o.output_dim >= 1 && o.expert_hidden_size >= 1 &&
                 o.num_experts < ((int64_t)1 << 31) && o.input_dim < ((int64_t)1 << 31) &&
                 o.output_dim < ((int64_t)1 << 31) && o.expert_hidden_size < ((int64_t)1 << 31);
  int fits = in_range && !__builtin_mul_overflow(o.expert_hidden_size, o.input_dim + o.output_dim, &slot) &&
             !__builtin_mul_overflow(slot, (int64_t)(smelt_dtype_size(dt) ? smelt_dtype_size(dt) : 8), &slot) &&
             !__builtin_mul_overflow(slot, o.num_experts, &bytes);
  /* A valid store of real size: a caller's request for memory, not a bug. */
  if (fits && (bytes > STORE_BYTES || o.num_experts > 4096))
    o.num_experts = 1, o.input_dim = o.output_dim = o.expert_hidden_size = 4;
  return o;
}

enum {
  WQ, BQ, NW, NB, BM, BV, K0, K1, K2, K3, U, V, X, Y, IDS, SC, DY,
  DX, DWQ, DBQ, DNW, DNB, DK0, DK1, DK2, DK3, DU, DV, GIDS, GCNT, DUR, DVR, NT
};

static void views(fz *f, smelt_tensor *t, const smelt_peer_config *c, int64_t T, const smelt_dtype *dt, int bwd) {
  int64_t h = c->num_heads, hdq = fz_mul(h, c->query_dim), p = c->product_key_dims > 0 ? c->product_key_dims : 1;
  int64_t sub = c->query_dim / p, thk = fz_mul(fz_mul(T, h), c->num_experts_per_tok);
  int norm_heads = fz_u8(f) & 1;
  int64_t wq[2] = {c->input_dim, hdq}, norm[2] = {h, c->query_dim};
  int64_t u[3] = {c->num_experts, c->input_dim, c->expert_hidden_size};
  int64_t v[3] = {c->num_experts, c->expert_hidden_size, c->output_dim};
  int64_t x[2] = {T, c->input_dim}, y[2] = {T, c->output_dim}, ids[3] = {T, h, c->num_experts_per_tok};
  int64_t ur[3] = {thk, c->input_dim, c->expert_hidden_size}, vr[3] = {thk, c->expert_hidden_size, c->output_dim};
  int64_t one = 1;
  t[WQ] = fz_view(f, dt[0], 2, wq, 0);
  t[BQ] = fz_view(f, dt[0], 1, &hdq, 0);
  t[DWQ] = fz_view(f, dt[0], 2, wq, bwd);
  t[DBQ] = fz_view(f, dt[0], 1, &hdq, bwd);
  for (int i = 0; i < 2; i++) {
    t[NW + i] = fz_view(f, dt[1], 1 + norm_heads, norm + !norm_heads, 0);
    t[DNW + i] = fz_view(f, dt[1], 1 + norm_heads, norm + !norm_heads, bwd);
  }
  t[BM] = fz_view(f, dt[1], 1 + norm_heads, norm + !norm_heads, 0);
  t[BV] = fz_view(f, dt[1], 1 + norm_heads, norm + !norm_heads, 0);
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) {
    int64_t n = c->sub_key_sizes[i] ? c->sub_key_sizes[i] : c->num_experts > 1 ? 2 : 1;
    int64_t k[3] = {h, n, sub};
    if (!c->sub_key_sizes[0]) {
      /* Each N^(1/p): the sizes the config leaves to the library. */
      n = 1;
      while (n < 8 && ipow(n + 1, p < 8 ? p : 8) <= c->num_experts) n++;
      k[1] = n;
    }
    t[K0 + i] = fz_view(f, dt[2], 2 + c->per_head_keys, k + !c->per_head_keys, 0);
    t[DK0 + i] = fz_view(f, dt[2], 2 + c->per_head_keys, k + !c->per_head_keys, bwd);
  }
  t[U] = fz_view(f, dt[3], 3, u, 0);
  t[V] = fz_view(f, dt[3], 3, v, 0);
  t[DU] = fz_view(f, dt[3], 3, u, bwd);
  t[DV] = fz_view(f, dt[3], 3, v, bwd);
  t[X] = fz_view(f, dt[4], 2, x, 0);
  t[Y] = fz_view(f, dt[4], 2, y, !bwd);
  t[DY] = fz_view(f, dt[4], 2, y, 0);
  t[DX] = fz_view(f, dt[4], 2, x, bwd);
  t[IDS] = fz_one_in(f, 8) ? fz_view(f, SMELT_DTYPE_I64, 3, ids, !bwd) : fz_view_plain(f, SMELT_DTYPE_I64, 3, ids, !bwd);
  t[SC] = fz_view(f, SMELT_DTYPE_F32, 3, ids, !bwd);
  t[GIDS] = fz_view_plain(f, SMELT_DTYPE_I64, 1, &thk, bwd);
  t[GCNT] = fz_view(f, SMELT_DTYPE_I64, 1, &one, bwd);
  t[DUR] = fz_view(f, dt[3], 3, ur, bwd);
  t[DVR] = fz_view(f, dt[3], 3, vr, bwd);
  if (bwd) {
    /* The forward's ids: experts in [0, N) mostly. */
    int64_t vals[256];
    for (int i = 0; i < 256; i++) {
      uint8_t b = fz_u8(f);
      vals[i] = b < 248 || c->num_experts <= 0 ? (c->num_experts > 0 ? b % c->num_experts : b) : fz_size(f, 9);
    }
    fz_fill_ints(&t[IDS], vals, 256);
  }
}

/* Which optional weights and gradients take part: bit i for tensor i. */
static void weights(const smelt_tensor *t, uint64_t use, const smelt_peer_config *c, smelt_peer_store *store,
                    smelt_peer_weights *w, smelt_peer_grads *g) {
  /* What the config uses, unless the input says otherwise (bit 63). */
  if (!(use >> 63 & 1)) {
    int affine = c->query_norm == SMELT_PEER_NORM_LAYERNORM || c->query_norm == SMELT_PEER_NORM_BATCHNORM;
    int bn = c->query_norm == SMELT_PEER_NORM_BATCHNORM;
    uint64_t off = 0;
    if (!affine) off |= 1ull << NW | 1ull << NB | 1ull << DNW | 1ull << DNB;
    if (!bn) off |= 1ull << BM | 1ull << BV;
    else use |= 1ull << BM | 1ull << BV;
    for (int i = c->product_key_dims > 0 ? c->product_key_dims : 0; i < SMELT_PEER_MAX_DIMS; i++)
      off |= 1ull << (K0 + i) | 1ull << (DK0 + i);
    if (store) off |= 1ull << DU | 1ull << DV;
    if (!(use >> GIDS & 1)) off |= 1ull << DUR | 1ull << DVR;
    use &= ~off;
    for (int i = 0; i < (c->product_key_dims < SMELT_PEER_MAX_DIMS ? c->product_key_dims : 0); i++)
      use |= 1ull << (K0 + i);
  }
#define OPT(i) ((use >> (i) & 1) ? &t[i] : NULL)
  memset(w, 0, sizeof *w);
  w->wq = &t[WQ];
  w->bq = OPT(BQ);
  w->norm_weight = OPT(NW);
  w->norm_bias = OPT(NB);
  w->bn_mean = OPT(BM);
  w->bn_var = OPT(BV);
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) w->sub_keys[i] = OPT(K0 + i);
  w->u = store ? NULL : &t[U];
  w->v = store ? NULL : &t[V];
  w->store = store;
  memset(g, 0, sizeof *g);
  g->dx = OPT(DX);
  g->dwq = OPT(DWQ);
  g->dbq = OPT(DBQ);
  g->dnorm_weight = OPT(DNW);
  g->dnorm_bias = OPT(DNB);
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) g->dsub_keys[i] = OPT(DK0 + i);
  g->du = OPT(DU);
  g->dv = OPT(DV);
  g->grad_ids = OPT(GIDS);
  g->grad_count = OPT(GCNT);
  g->du_rows = OPT(DUR);
  g->dv_rows = OPT(DVR);
#undef OPT
}

void fz_peer(fz *f) {
  int64_t T;
  smelt_peer_config cfg = draw_config(f, &T);
  smelt_dtype dt[5];
  for (int i = 0; i < 5; i++) dt[i] = draw_dtype(f);
  int what = fz_u8(f) % 3, mode = fz_mode(f); /* retrieve, forward, backward */
  uint64_t use = fz_u64(f) & ~(fz_one_in(f, 16) ? 0 : 1ull << 63);
  smelt_peer_store *store = NULL;
  if (fz_one_in(f, 4)) {
    smelt_peer_store_options o = store_options(f, &cfg, dt[3]);
    if (smelt_peer_store_create(f->ctx, &o, &store)) store = NULL;
  }
  smelt_tensor t[NT];
  smelt_peer_weights w;
  smelt_peer_grads g;
  smelt_plan *plan = NULL;
  smelt_status s;
  const smelt_peer_config *cp = fz_one_in(f, 32) ? NULL : &cfg;
  for (int r = 0; fz_round(r, mode); r++) {
    views(f, t, &cfg, T, dt, what == 2);
    weights(t, use, &cfg, store, &w, &g);
    smelt_peer_weights wb = w;
    smelt_peer_grads gb = g;
    const smelt_tensor *ids = what == 1 && !(use >> IDS & 1) ? NULL : &t[IDS];
    const smelt_tensor *sc = what == 1 && !(use >> SC & 1) ? NULL : &t[SC];
    if (mode == 0) {
      if (what == 0) FZ_CALL(s, "smelt_peer_retrieve", t, smelt_peer_retrieve(f->ctx, cp, &w, &t[X], ids, sc));
      if (what == 1)
        FZ_CALL(s, "smelt_peer_forward", t, smelt_peer_forward(f->ctx, cp, &w, &t[X], &t[Y], ids, sc));
      if (what == 2)
        FZ_CALL(s, "smelt_peer_backward", t, smelt_peer_backward(f->ctx, cp, &w, &t[X], &t[IDS], &t[DY], &g));
    } else {
      if (r == 0) FZ_PLAN(s, "smelt_peer_plan", t, plan, smelt_peer_plan(f->ctx, cp, &w, &t[X], &plan));
      if (!plan) break;
      if (what == 0) FZ_CALL(s, "smelt_peer_retrieve_run", t, smelt_peer_retrieve_run(plan, &w, &t[X], ids, sc));
      if (what == 1)
        FZ_CALL(s, "smelt_peer_forward_run", t, smelt_peer_forward_run(plan, &w, &t[X], &t[Y], ids, sc));
      if (what == 2)
        FZ_CALL(s, "smelt_peer_backward_run", t, smelt_peer_backward_run(plan, &w, &t[X], &t[IDS], &t[DY], &g));
    }
    fz_same("smelt_peer weights", &wb, &w, sizeof w);
    fz_same("smelt_peer grads", &gb, &g, sizeof g);
  }
  smelt_plan_destroy(plan);
  smelt_peer_store_destroy(store);
}

void fz_peer_store(fz *f) {
  smelt_dtype dt = draw_dtype(f);
  smelt_peer_store_options o = store_options(f, NULL, dt);
  smelt_peer_store *st = NULL;
  smelt_tensor none[1];
  memset(none, 0, sizeof none);
  smelt_status s;
  FZ_CALL(s, "smelt_peer_store_create", none, smelt_peer_store_create(f->ctx, fz_one_in(f, 32) ? NULL : &o, &st));
  if (s != SMELT_OK && st) abort();
  if (s) return;
  size_t es = smelt_dtype_size(o.dtype);
  for (int step = 0; step < 4; step++) {
    fz_reset_outputs();
    switch (fz_u8(f) % 7) {
    case 0: {
      smelt_tensor tab[2];
      FZ_CALL(s, "smelt_peer_store_tables", none, smelt_peer_store_tables(st, &tab[0], &tab[1]));
      if (s == SMELT_OK && (smelt_tensor_numel(&tab[0]) != o.num_experts * o.input_dim * o.expert_hidden_size ||
                            smelt_tensor_numel(&tab[1]) != o.num_experts * o.output_dim * o.expert_hidden_size))
        abort();
      break;
    }
    case 1: {
      int64_t first = fz_size(f, o.num_experts), count = fz_size(f, o.num_experts);
      int64_t n = count >= 0 && count <= o.num_experts ? count : 0;
      const void *u = fz_bytes(f, (size_t)(n * o.input_dim * o.expert_hidden_size) * es);
      const void *v = fz_bytes(f, (size_t)(n * o.output_dim * o.expert_hidden_size) * es);
      FZ_CALL(s, "smelt_peer_store_write", none, smelt_peer_store_write(st, first, count, u, v));
      break;
    }
    case 2: FZ_CALL(s, "smelt_peer_store_invalidate", none, smelt_peer_store_invalidate(st)); break;
    case 3: {
      int64_t shape[2] = {fz_size(f, 9), fz_size(f, 4)}, vals[64];
      smelt_tensor ids[1] = {fz_view(f, SMELT_DTYPE_I64, 1 + (fz_u8(f) & 1), shape, 0)};
      for (int i = 0; i < 64; i++) vals[i] = fz_u8(f) < 248 ? fz_u8(f) % o.num_experts : fz_size(f, 9);
      fz_fill_ints(&ids[0], vals, 64);
      FZ_CALL(s, "smelt_peer_store_prefetch", ids, smelt_peer_store_prefetch(st, &ids[0]));
      break;
    }
    case 4: {
      smelt_peer_store_stats ss;
      FZ_CALL(s, "smelt_peer_store_stats_get", none, smelt_peer_store_stats_get(st, &ss));
      if (s == SMELT_OK && (ss.hits + ss.misses != ss.lookups || ss.resident > ss.slots)) abort();
      if (fz_u8(f) & 1) FZ_CALL(s, "smelt_peer_store_stats_reset", none, smelt_peer_store_stats_reset(st));
      break;
    }
    case 5: {
      size_t n = (size_t)fz_small(f, 600);
      char *buf = fz_bytes(f, n);
      fz_output_bytes(buf, n);
      FZ_CALL(s, "smelt_peer_store_report", none, smelt_peer_store_report(st, n ? buf : NULL, n));
      if (s == SMELT_OK && n && !memchr(buf, 0, n)) abort();
      break;
    }
    case 6: {
      int64_t first = fz_size(f, o.num_experts), count = fz_size(f, o.num_experts);
      int64_t n = count >= 0 && count <= o.num_experts ? count : 0;
      uint64_t *out = fz_bytes(f, (size_t)n * 8);
      fz_output_bytes(out, (size_t)n * 8);
      FZ_CALL(s, "smelt_peer_store_heat", none, smelt_peer_store_heat(st, first, count, out));
      break;
    }
    }
  }
  smelt_peer_store_destroy(st);
}
