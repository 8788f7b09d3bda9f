/* Bench op `attention`: scaled dot-product attention, forward or backward,
 * timed the way the attention targets (docs/PERF.md) are judged: random
 * data (never zeros), one plan, the run call between device events, inputs
 * rotated past L2, median of many runs. TFLOP/s by the FlashAttention
 * convention: 4·D per visible (query, key) pair and head (two GEMMs of 2
 * flops per multiply-add),
 * which is 4·B·H·Sq·Sk·D for a full mask and exactly half of it for a causal
 * mask with Sq == Sk; other masks count their visible pairs. The backward
 * counts 2.5x the forward (five GEMMs instead of two) and times the backward
 * run alone: O and LSE come from one forward done in setup.
 *
 * Layout of one set, as a model keeps it: q, o, d_o, dq [B, Sq, H, D];
 * k, v, dk, dv [B, Sk, Hk, D]; lse [B, H, Sq] f32.
 *
 * --check compares the device's results with the CPU backend's reference,
 * computed in double from the same (rounded) inputs, on slices small enough
 * for a naive host loop: batches 0 and B-1, query heads 0 and H-1, the
 * first and the last --check-rows query rows (O, LSE, dq), and for the
 * backward kv heads 0 and Hk-1 at the first and the last --check-rows keys
 * (dk, dv). A slice is a smaller attention problem whose mask is the full
 * problem's mask restricted to it: see sub_desc(). */
#include "bench.h"
#include "core/error_bound.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int64_t opt_batch = 4, opt_heads = 16, opt_kv_heads = 0, opt_seq_q = 4096, opt_seq_k = 0, opt_head_dim = 128;
static int64_t opt_wl = -1, opt_wr = -1, opt_check_rows = 64;
static const char *opt_dtype = "bf16", *opt_schedule = "auto";
static int opt_causal, opt_bwd, opt_det, opt_check;

static const cli_opt options[] = {
    {"batch", CLI_OPT_INT, &opt_batch, "B", "sequences (default 4)"},
    {"heads", CLI_OPT_INT, &opt_heads, "H", "query heads (default 16)"},
    {"kv-heads", CLI_OPT_INT, &opt_kv_heads, "HK", "key/value heads, dividing H (default: H)"},
    {"seq-q", CLI_OPT_INT, &opt_seq_q, "SQ", "queries per sequence (default 4096)"},
    {"seq-k", CLI_OPT_INT, &opt_seq_k, "SK", "keys per sequence (default: SQ)"},
    {"head-dim", CLI_OPT_INT, &opt_head_dim, "D", "head dimension (default 128)"},
    {"causal", CLI_OPT_FLAG, &opt_causal, NULL, "bottom-right aligned causal mask"},
    {"window-left", CLI_OPT_INT, &opt_wl, "L", "keys left of the diagonal a query sees (default -1: all)"},
    {"window-right", CLI_OPT_INT, &opt_wr, "R", "keys right of the diagonal (default -1: all)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT", "bf16 or f16; f32, f64 on the CPU backend (default bf16)"},
    {"bwd", CLI_OPT_FLAG, &opt_bwd, NULL, "time the backward (dq, dk, dv) instead of the forward"},
    {"deterministic", CLI_OPT_FLAG, &opt_det, NULL, "backward: the bitwise-repeatable mode"},
    {"schedule", CLI_OPT_STRING, &opt_schedule, "S",
     "Hopper forward: auto, tiles, persistent or dynamic (desc.fwd_schedule; default auto)"},
    {"check", CLI_OPT_FLAG, &opt_check, NULL, "compare slices of one run against the CPU backend"},
    {"check-rows", CLI_OPT_INT, &opt_check_rows, "N", "rows (and keys) per checked slice end (default 64)"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

/* Seeds of the inputs: bench/attention_vs_peers.py regenerates the same
 * values (splitmix64, as cli_fill_uniform) to measure its peers' error on
 * them, so these and the ranges below are part of that contract. */
enum { SEED_Q = 0x5EED1501u, SEED_K = 0x5EED1502u, SEED_V = 0x5EED1503u, SEED_DO = 0x5EED1504u };

static struct {
  smelt_attention_desc desc;
  smelt_dtype dt;
  int64_t B, H, Hk, Sq, Sk, D, wl, wr; /* wr: 0 when causal */
  size_t nq, nk, nl;                   /* elements of q, of k, of lse */
  smelt_ctx *ctx;
  int sets;
  void **q, **k, **v, **o, **lse, **d_o, **dq, **dk, **dv;
  smelt_plan *fwd, *bwd;
} st;

/* ---------------------------------------------------------------- options */

/* Visible (query, key) pairs of one head of one sequence. The causal
 * Sq == Sk case is counted as Sq·Sk/2, the convention every attention
 * benchmark quotes (the exact count adds Sq/2). */
static double visible_pairs(void) {
  if (opt_causal && st.Sq == st.Sk && st.wl < 0) return 0.5 * (double)st.Sq * (double)st.Sk;
  double pairs = 0;
  for (int64_t i = 0; i < st.Sq; i++) {
    const int64_t diag = i + st.Sk - st.Sq;
    int64_t lo = st.wl >= 0 ? diag - st.wl : 0, hi = st.wr >= 0 ? diag + st.wr : st.Sk - 1;
    if (lo < 0) lo = 0;
    if (hi > st.Sk - 1) hi = st.Sk - 1;
    if (hi >= lo) pairs += (double)(hi - lo + 1);
  }
  return pairs;
}

static const char *mask_name(char *buf, size_t n) {
  if (st.wl < 0 && opt_wr < 0) snprintf(buf, n, "%s", opt_causal ? "causal" : "full");
  else snprintf(buf, n, "%swindow(%lld,%lld)", opt_causal ? "causal+" : "", (long long)st.wl, (long long)st.wr);
  return buf;
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  static const smelt_dtype allowed[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16, SMELT_DTYPE_F32, SMELT_DTYPE_F64};
  st.dt = cli_require_dtype(doc, "dtype", opt_dtype, allowed, 4);
  st.B = cli_require_range(doc, "batch", opt_batch, 1, 65535);
  st.H = cli_require_range(doc, "heads", opt_heads, 1, 65535);
  st.Hk = opt_kv_heads ? cli_require_range(doc, "kv-heads", opt_kv_heads, 1, st.H) : st.H;
  if (st.H % st.Hk)
    cli_usage_error(doc->command, "--heads %lld is not a multiple of --kv-heads %lld", (long long)st.H,
                    (long long)st.Hk);
  st.Sq = cli_require_range(doc, "seq-q", opt_seq_q, 1, (int64_t)1 << 30);
  st.Sk = opt_seq_k ? cli_require_range(doc, "seq-k", opt_seq_k, 1, (int64_t)1 << 30) : st.Sq;
  st.D = cli_require_range(doc, "head-dim", opt_head_dim, 1, 1024);
  st.wl = cli_require_range(doc, "window-left", opt_wl, -1, (int64_t)1 << 30);
  st.wr = cli_require_range(doc, "window-right", opt_wr, -1, (int64_t)1 << 30);
  if (opt_causal && st.wr > 0)
    cli_usage_error(doc->command, "--causal with --window-right %lld: a causal mask allows -1 or 0", (long long)st.wr);
  if (opt_causal) st.wr = 0;
  cli_require_range(doc, "check-rows", opt_check_rows, 1, 1 << 16);
  if (opt_det && !opt_bwd) cli_usage_error(doc->command, "--deterministic applies to the backward: add --bwd");
  const int64_t lim = (int64_t)1 << 34;
  if (st.Sq * st.H > lim / st.D / st.B || st.Sk * st.Hk > lim / st.D / st.B)
    cli_usage_error(doc->command, "q or k would exceed 2^34 elements");
  st.nq = (size_t)(st.B * st.Sq * st.H * st.D);
  st.nk = (size_t)(st.B * st.Sk * st.Hk * st.D);
  st.nl = (size_t)(st.B * st.H * st.Sq);
  st.desc = smelt_attention_desc_default();
  st.desc.causal = opt_causal;
  st.desc.window_left = st.wl;
  st.desc.window_right = opt_causal ? -1 : st.wr;
  st.desc.deterministic = opt_det;
  static const char *const schedules[SMELT_ATTENTION_SCHEDULE_COUNT] = {"auto", "tiles", "persistent", "dynamic"};
  int sched = 0;
  while (sched < SMELT_ATTENTION_SCHEDULE_COUNT && strcmp(opt_schedule, schedules[sched])) sched++;
  if (sched == SMELT_ATTENTION_SCHEDULE_COUNT)
    cli_usage_error(doc->command, "--schedule %s is not auto, tiles, persistent or dynamic", opt_schedule);
  st.desc.fwd_schedule = (smelt_attention_schedule)sched;

  const uint64_t es = smelt_dtype_size(st.dt);
  /* Forward: reads q, k, v, writes o, lse. Backward: reads q, k, v, o, d_o,
   * lse, writes dq, dk, dv (the f32 dq workspace is not counted). */
  c->traffic_bytes = opt_bwd ? es * (4 * st.nq + 4 * st.nk) + 4 * st.nl : es * (2 * st.nq + 2 * st.nk) + 4 * st.nl;
  c->set_bytes = c->traffic_bytes;
  const double fwd_flops = 4.0 * (double)st.B * (double)st.H * (double)st.D * visible_pairs();
  c->flops = opt_bwd ? 2.5 * fwd_flops : fwd_flops;

  char mask[64];
  mask_name(mask, sizeof mask);
  snprintf(c->params_text, sizeof c->params_text,
           "%s batch=%lld heads=%lld kv_heads=%lld seq_q=%lld seq_k=%lld head_dim=%lld %s dtype=%s%s",
           opt_bwd ? "bwd" : "fwd", (long long)st.B, (long long)st.H, (long long)st.Hk, (long long)st.Sq,
           (long long)st.Sk, (long long)st.D, mask, smelt_dtype_name(st.dt), opt_det ? " deterministic" : "");
  snprintf(c->params_json, sizeof c->params_json,
           "\"batch\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"seq_q\":%lld,\"seq_k\":%lld,\"head_dim\":%lld,"
           "\"causal\":%s,\"window_left\":%lld,\"window_right\":%lld,\"dtype\":\"%s\",\"bwd\":%s,"
           "\"deterministic\":%s,\"visible_pairs\":%.17g",
           (long long)st.B, (long long)st.H, (long long)st.Hk, (long long)st.Sq, (long long)st.Sk, (long long)st.D,
           opt_causal ? "true" : "false", (long long)st.wl, (long long)(opt_causal ? 0 : st.wr),
           smelt_dtype_name(st.dt), opt_bwd ? "true" : "false", opt_det ? "true" : "false", visible_pairs());
}

/* ---------------------------------------------------------------- views and runs */

static smelt_tensor dense(void *p, smelt_dtype dt, int nd, int64_t a, int64_t b, int64_t c, int64_t d) {
  int64_t shape[4] = {a, b, c, d};
  return smelt_tensor_make(p, dt, smelt_ctx_device(st.ctx), smelt_ctx_device_index(st.ctx), nd, shape);
}

typedef struct views {
  smelt_tensor q, k, v, o, lse, d_o, dq, dk, dv;
} views;

static views views_of(int set) {
  views w;
  memset(&w, 0, sizeof w);
  w.q = dense(st.q[set], st.dt, 4, st.B, st.Sq, st.H, st.D);
  w.k = dense(st.k[set], st.dt, 4, st.B, st.Sk, st.Hk, st.D);
  w.v = dense(st.v[set], st.dt, 4, st.B, st.Sk, st.Hk, st.D);
  w.o = dense(st.o[set], st.dt, 4, st.B, st.Sq, st.H, st.D);
  w.lse = dense(st.lse[set], SMELT_DTYPE_F32, 3, st.B, st.H, st.Sq, 0);
  if (opt_bwd) {
    w.d_o = dense(st.d_o[set], st.dt, 4, st.B, st.Sq, st.H, st.D);
    w.dq = dense(st.dq[set], st.dt, 4, st.B, st.Sq, st.H, st.D);
    w.dk = dense(st.dk[set], st.dt, 4, st.B, st.Sk, st.Hk, st.D);
    w.dv = dense(st.dv[set], st.dt, 4, st.B, st.Sk, st.Hk, st.D);
  }
  return w;
}

static void run_fwd(int set) {
  views w = views_of(set);
  CLI_TRY(smelt_attention_fwd_run(st.fwd, &w.q, &w.k, &w.v, &w.o, &w.lse));
}

static void run_bwd(int set) {
  views w = views_of(set);
  CLI_TRY(smelt_attention_bwd_run(st.bwd, &w.q, &w.k, &w.v, &w.o, &w.d_o, &w.lse, &w.dq, &w.dk, &w.dv));
}

static void run(int set) {
  if (opt_bwd) run_bwd(set);
  else run_fwd(set);
}

/* ---------------------------------------------------------------- check */

/* Rows [r0, r1) and heads [h0, h0 + nh) of batch b of a host [B, S, Hn, D]
 * tensor, as doubles [r1 - r0, nh, D]. */
static double *gather(const void *src, smelt_dtype dt, int64_t S, int64_t Hn, int64_t b, int64_t r0, int64_t r1,
                      int64_t h0, int64_t nh) {
  const int64_t D = st.D, rows = r1 - r0;
  double *out = cli_malloc((size_t)(rows * nh * D + 1) * sizeof *out);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < nh; h++)
      for (int64_t d = 0; d < D; d++)
        out[(r * nh + h) * D + d] = cli_load(src, dt, (size_t)((((b * S + r0 + r) * Hn) + h0 + h) * D + d));
  return out;
}

/* LSE rows [r0, r1) of heads [h0, h0 + nh), batch b, as f32 [nh, r1 - r0]. */
static float *gather_lse(const float *src, int64_t b, int64_t r0, int64_t r1, int64_t h0, int64_t nh) {
  float *out = cli_malloc((size_t)((r1 - r0) * nh + 1) * sizeof *out);
  for (int64_t h = 0; h < nh; h++)
    for (int64_t r = r0; r < r1; r++) out[h * (r1 - r0) + r - r0] = src[(b * st.H + h0 + h) * st.Sq + r];
  return out;
}

/* The desc of the sub-problem made of query rows [i0, i1) and keys [j0, j1)
 * of a sequence. Query i sees key j iff diag(i) - wl <= j <= diag(i) + wr,
 * diag(i) = i + Sk - Sq; in the slice's own indices the diagonal moves by
 * delta = i1 - j1 + Sk - Sq (whatever i0 and j0 are), which the windows take
 * up. Callers choose slices that keep every pair they need and drop only
 * pairs that are invisible or not needed (forward and dq: all keys a kept
 * row sees; dk, dv: all rows that see a kept key), so the windows stay >= 0
 * except for slices with nothing visible, where any window will do. */
static smelt_attention_desc sub_desc(int64_t i1, int64_t j1) {
  smelt_attention_desc d = smelt_attention_desc_default();
  const int64_t delta = i1 - j1 + st.Sk - st.Sq;
  d.scale = st.desc.scale;
  d.window_left = st.wl >= 0 ? (st.wl - delta < 0 ? 0 : st.wl - delta) : -1;
  d.window_right = st.wr >= 0 ? (st.wr + delta < 0 ? 0 : st.wr + delta) : -1;
  return d;
}

typedef struct err_sums {
  double diff2, ref2, max_abs;
  int64_t elems, nan_mismatch;
} err_sums;

static void accumulate(err_sums *s, double got, double ref) {
  s->elems++;
  if (isnan(got) || isnan(ref)) {
    s->nan_mismatch += isnan(got) != isnan(ref);
    return;
  }
  if (got == ref) { /* equal infinities too */
    if (isfinite(ref)) s->ref2 += ref * ref;
    return;
  }
  const double e = fabs(got - ref);
  if (!isfinite(e)) {
    s->nan_mismatch++;
    return;
  }
  s->diff2 += e * e;
  s->ref2 += ref * ref;
  if (e > s->max_abs) s->max_abs = e;
}

static double rel_l2(const err_sums *s) { return s->ref2 > 0 ? sqrt(s->diff2 / s->ref2) : sqrt(s->diff2); }

/* What the check downloads from the device (set 0) and holds on the host. */
typedef struct check_data {
  smelt_ctx *cpu;
  const void *q, *k, *v, *d_o; /* host inputs, st.dt */
  void *o, *dq, *dk, *dv;      /* device results, st.dt */
  float *lse;
  err_sums eo, edq, edk, edv;
  double lse_max_rel;
  int64_t lse_nan;
} check_data;

static smelt_tensor host_t(void *p, smelt_dtype dt, int nd, int64_t a, int64_t b, int64_t c, int64_t d) {
  int64_t shape[4] = {a, b, c, d};
  return smelt_tensor_make(p, dt, SMELT_DEVICE_CPU, 0, nd, shape);
}

/* Query rows [i0, i1) of query head h, batch b, against keys [0, j1): the
 * forward's O and LSE, and with the backward dq (from the device's O and
 * LSE, as the device's backward had them). */
static void check_rows(check_data *cd, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j1) {
  const int64_t rows = i1 - i0, D = st.D, hk = h / (st.H / st.Hk);
  double *q = gather(cd->q, st.dt, st.Sq, st.H, b, i0, i1, h, 1);
  double *k = gather(cd->k, st.dt, st.Sk, st.Hk, b, 0, j1, hk, 1);
  double *v = gather(cd->v, st.dt, st.Sk, st.Hk, b, 0, j1, hk, 1);
  double *o = cli_malloc((size_t)(rows * D + 1) * sizeof *o);
  float *lse = cli_malloc((size_t)(rows + 1) * sizeof *lse);
  smelt_tensor tq = host_t(q, SMELT_DTYPE_F64, 4, 1, rows, 1, D), tk = host_t(k, SMELT_DTYPE_F64, 4, 1, j1, 1, D);
  smelt_tensor tv = host_t(v, SMELT_DTYPE_F64, 4, 1, j1, 1, D), to = host_t(o, SMELT_DTYPE_F64, 4, 1, rows, 1, D);
  smelt_tensor tl = host_t(lse, SMELT_DTYPE_F32, 3, 1, 1, rows, 0);
  const smelt_attention_desc d = sub_desc(i1, j1);
  CLI_TRY(smelt_attention_fwd(cd->cpu, &d, &tq, &tk, &tv, &to, &tl));
  double *got_o = gather(cd->o, st.dt, st.Sq, st.H, b, i0, i1, h, 1);
  float *got_l = gather_lse(cd->lse, b, i0, i1, h, 1);
  for (int64_t i = 0; i < rows * D; i++) accumulate(&cd->eo, got_o[i], o[i]);
  for (int64_t i = 0; i < rows; i++) {
    const double g = got_l[i], r = lse[i];
    if (isnan(g) || isnan(r) || (g != r && !isfinite(g - r))) {
      cd->lse_nan += g != r;
      continue;
    }
    const double e = fabs(g - r) / (fabs(r) > 1.0 ? fabs(r) : 1.0);
    if (e > cd->lse_max_rel) cd->lse_max_rel = e;
  }
  if (opt_bwd) {
    double *dof = gather(cd->d_o, st.dt, st.Sq, st.H, b, i0, i1, h, 1);
    double *dq = cli_malloc((size_t)(rows * D + 1) * sizeof *dq), *dk = cli_malloc((size_t)(j1 * D + 1) * sizeof *dk);
    double *dv = cli_malloc((size_t)(j1 * D + 1) * sizeof *dv);
    smelt_tensor tdo = host_t(dof, SMELT_DTYPE_F64, 4, 1, rows, 1, D), tgo = host_t(got_o, SMELT_DTYPE_F64, 4, 1, rows, 1, D);
    smelt_tensor tgl = host_t(got_l, SMELT_DTYPE_F32, 3, 1, 1, rows, 0);
    smelt_tensor tdq = host_t(dq, SMELT_DTYPE_F64, 4, 1, rows, 1, D), tdk = host_t(dk, SMELT_DTYPE_F64, 4, 1, j1, 1, D);
    smelt_tensor tdv = host_t(dv, SMELT_DTYPE_F64, 4, 1, j1, 1, D);
    CLI_TRY(smelt_attention_bwd(cd->cpu, &d, &tq, &tk, &tv, &tgo, &tdo, &tgl, &tdq, &tdk, &tdv));
    double *got = gather(cd->dq, st.dt, st.Sq, st.H, b, i0, i1, h, 1);
    for (int64_t i = 0; i < rows * D; i++) accumulate(&cd->edq, got[i], dq[i]);
    free(got);
    free(dof);
    free(dq);
    free(dk);
    free(dv);
  }
  free(q);
  free(k);
  free(v);
  free(o);
  free(lse);
  free(got_o);
  free(got_l);
}

/* Keys [j0, j1) of kv head hk, batch b, against query rows [0, i1) of the
 * group's query heads: dk and dv from the device's O and LSE. */
static void check_keys(check_data *cd, int64_t b, int64_t hk, int64_t j0, int64_t j1, int64_t i1) {
  const int64_t keys = j1 - j0, D = st.D, G = st.H / st.Hk, h0 = hk * G;
  double *q = gather(cd->q, st.dt, st.Sq, st.H, b, 0, i1, h0, G);
  double *k = gather(cd->k, st.dt, st.Sk, st.Hk, b, j0, j1, hk, 1);
  double *v = gather(cd->v, st.dt, st.Sk, st.Hk, b, j0, j1, hk, 1);
  double *o = gather(cd->o, st.dt, st.Sq, st.H, b, 0, i1, h0, G);
  double *dof = gather(cd->d_o, st.dt, st.Sq, st.H, b, 0, i1, h0, G);
  float *lse = gather_lse(cd->lse, b, 0, i1, h0, G);
  double *dq = cli_malloc((size_t)(i1 * G * D + 1) * sizeof *dq), *dk = cli_malloc((size_t)(keys * D + 1) * sizeof *dk);
  double *dv = cli_malloc((size_t)(keys * D + 1) * sizeof *dv);
  smelt_tensor tq = host_t(q, SMELT_DTYPE_F64, 4, 1, i1, G, D), tk = host_t(k, SMELT_DTYPE_F64, 4, 1, keys, 1, D);
  smelt_tensor tv = host_t(v, SMELT_DTYPE_F64, 4, 1, keys, 1, D), to = host_t(o, SMELT_DTYPE_F64, 4, 1, i1, G, D);
  smelt_tensor tdo = host_t(dof, SMELT_DTYPE_F64, 4, 1, i1, G, D), tl = host_t(lse, SMELT_DTYPE_F32, 3, 1, G, i1, 0);
  smelt_tensor tdq = host_t(dq, SMELT_DTYPE_F64, 4, 1, i1, G, D), tdk = host_t(dk, SMELT_DTYPE_F64, 4, 1, keys, 1, D);
  smelt_tensor tdv = host_t(dv, SMELT_DTYPE_F64, 4, 1, keys, 1, D);
  const smelt_attention_desc d = sub_desc(i1, j1);
  CLI_TRY(smelt_attention_bwd(cd->cpu, &d, &tq, &tk, &tv, &to, &tdo, &tl, &tdq, &tdk, &tdv));
  double *gk = gather(cd->dk, st.dt, st.Sk, st.Hk, b, j0, j1, hk, 1);
  double *gv = gather(cd->dv, st.dt, st.Sk, st.Hk, b, j0, j1, hk, 1);
  for (int64_t i = 0; i < keys * D; i++) {
    accumulate(&cd->edk, gk[i], dk[i]);
    accumulate(&cd->edv, gv[i], dv[i]);
  }
  free(q);
  free(k);
  free(v);
  free(o);
  free(dof);
  free(lse);
  free(dq);
  free(dk);
  free(dv);
  free(gk);
  free(gv);
}

static int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

/* Relative L2 bounds against the CPU reference (src/core/error_bound.c):
 * output 0 the values, 1 the logsumexp. */
static double check_bound(int output) {
  const smelt__bound_query q = {.family = "attention",
                                .device = smelt_ctx_device(st.ctx),
                                .dtype = output ? SMELT_DTYPE_F32 : st.dt,
                                .output = output};
  return smelt__error_bound(&q);
}

/* check_rows or check_keys: items [i0, i1) of sequence b, head h, seeing
 * the other side's items [0, other). */
typedef void (*check_fn)(check_data *cd, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t other);

/* Checks --check-rows items (query rows, or keys) at both ends of n, whose
 * other side has m items and a window w toward it (-1: unbounded): the
 * first slice needs the other side up to the last item its last one sees. */
static void check_ends(check_data *cd, check_fn fn, int64_t b, int64_t h, int64_t n, int64_t m, int64_t w) {
  const int64_t r = opt_check_rows;
  if (n <= 2 * r) {
    fn(cd, b, h, 0, n, m);
    return;
  }
  fn(cd, b, h, 0, r, w < 0 ? m : clamp(r + m - n + w, 0, m));
  fn(cd, b, h, n - r, n, m);
}

static void check(const void *hq, const void *hk, const void *hv, const void *hdo, cli_bench_case *c) {
  check_data cd;
  memset(&cd, 0, sizeof cd);
  cd.cpu = cli_ctx_open_cpu();
  cd.q = hq;
  cd.k = hk;
  cd.v = hv;
  cd.d_o = hdo;
  const size_t es = smelt_dtype_size(st.dt);
  cd.o = cli_malloc(st.nq * es);
  cd.lse = cli_malloc(st.nl * sizeof(float));
  cli_dev_download(st.ctx, cd.o, st.o[0], st.nq * es);
  cli_dev_download(st.ctx, cd.lse, st.lse[0], st.nl * sizeof(float));
  if (opt_bwd) {
    cd.dq = cli_malloc(st.nq * es);
    cd.dk = cli_malloc(st.nk * es);
    cd.dv = cli_malloc(st.nk * es);
    cli_dev_download(st.ctx, cd.dq, st.dq[0], st.nq * es);
    cli_dev_download(st.ctx, cd.dk, st.dk[0], st.nk * es);
    cli_dev_download(st.ctx, cd.dv, st.dv[0], st.nk * es);
  }
  const int64_t bs[2] = {0, st.B - 1}, hs[2] = {0, st.H - 1}, hks[2] = {0, st.Hk - 1};
  for (int bi = 0; bi < 2; bi++) {
    if (bi && bs[1] == bs[0]) break;
    for (int hi = 0; hi < 2; hi++) {
      if (hi && hs[1] == hs[0]) break;
      check_ends(&cd, check_rows, bs[bi], hs[hi], st.Sq, st.Sk, st.wr);
    }
    for (int hi = 0; opt_bwd && hi < 2; hi++) {
      if (hi && hks[1] == hks[0]) break;
      check_ends(&cd, check_keys, bs[bi], hks[hi], st.Sk, st.Sq, st.wl);
    }
  }
  smelt_ctx_destroy(cd.cpu);

  const double bound = check_bound(0), lbound = check_bound(1);
  const int64_t nan = cd.eo.nan_mismatch + cd.edq.nan_mismatch + cd.edk.nan_mismatch + cd.edv.nan_mismatch + cd.lse_nan;
  const double eo = rel_l2(&cd.eo), edq = rel_l2(&cd.edq), edk = rel_l2(&cd.edk), edv = rel_l2(&cd.edv);
  const double worst = fmax(fmax(eo, edq), fmax(edk, edv));
  const int ok = nan == 0 && worst <= bound && cd.lse_max_rel <= lbound;
  const int64_t elems = cd.eo.elems + cd.edq.elems + cd.edk.elems + cd.edv.elems;
  c->check_failed = !ok;
  if (opt_bwd)
    snprintf(c->check_text, sizeof c->check_text,
             "rel_l2 o %.1e dq %.1e dk %.1e dv %.1e (bound %.0e), lse %.1e (bound %.0e), %lld NaN/inf mismatches, "
             "%lld elements: %s",
             eo, edq, edk, edv, bound, cd.lse_max_rel, lbound, (long long)nan, (long long)elems, ok ? "ok" : "FAIL");
  else
    snprintf(c->check_text, sizeof c->check_text,
             "rel_l2 o %.2e (bound %.0e), max_abs %.2e, lse max rel %.1e (bound %.0e), %lld NaN/inf mismatches, "
             "%lld elements: %s",
             eo, bound, cd.eo.max_abs, cd.lse_max_rel, lbound, (long long)nan, (long long)elems, ok ? "ok" : "FAIL");
  /* check_ref_l2 (the reference O's norm over the slices) lets a peer script
   * confirm it regenerated the same inputs. */
  snprintf(c->check_json, sizeof c->check_json,
           "\"check\":\"%s\",\"check_rel_l2\":%.4e,\"check_bound\":%.1e,\"check_max_abs\":%.4e,"
           "\"check_lse_rel\":%.3e,\"check_ref_l2\":%.12e,\"check_nan\":%lld,\"check_elems\":%lld",
           ok ? "ok" : "fail", worst, bound, fmax(fmax(cd.eo.max_abs, cd.edq.max_abs), fmax(cd.edk.max_abs, cd.edv.max_abs)),
           cd.lse_max_rel, sqrt(cd.eo.ref2), (long long)nan, (long long)elems);
  if (opt_bwd) {
    size_t len = strlen(c->check_json);
    snprintf(c->check_json + len, sizeof c->check_json - len, ",\"check_dq\":%.2e,\"check_dk\":%.2e,\"check_dv\":%.2e",
             edq, edk, edv);
  }
  free(cd.o);
  free(cd.lse);
  free(cd.dq);
  free(cd.dk);
  free(cd.dv);
}

/* ---------------------------------------------------------------- setup */

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  st.ctx = ctx;
  st.sets = sets;
  const size_t es = smelt_dtype_size(st.dt), bq = st.nq * es, bk = st.nk * es, bl = st.nl * sizeof(float);
  /* Scores of a few units, as trained models have (q, k in [-2, 2)). */
  void *hq = cli_host_uniform(st.dt, st.nq, SEED_Q, -2.0, 2.0);
  void *hk = cli_host_uniform(st.dt, st.nk, SEED_K, -2.0, 2.0);
  void *hv = cli_host_uniform(st.dt, st.nk, SEED_V, -1.0, 1.0);
  void *hdo = opt_bwd ? cli_host_uniform(st.dt, st.nq, SEED_DO, -1.0, 1.0) : NULL;
  st.q = cli_bench_upload_sets(ctx, hq, bq, sets);
  st.k = cli_bench_upload_sets(ctx, hk, bk, sets);
  st.v = cli_bench_upload_sets(ctx, hv, bk, sets);
  st.o = cli_bench_alloc_sets(ctx, bq, sets);
  st.lse = cli_bench_alloc_sets(ctx, bl, sets);
  if (opt_bwd) {
    st.d_o = cli_bench_upload_sets(ctx, hdo, bq, sets);
    st.dq = cli_bench_alloc_sets(ctx, bq, sets);
    st.dk = cli_bench_alloc_sets(ctx, bk, sets);
    st.dv = cli_bench_alloc_sets(ctx, bk, sets);
  }
  views w = views_of(0);
  CLI_TRY(smelt_attention_fwd_plan(ctx, &st.desc, &w.q, &w.k, &w.v, &w.o, &w.lse, &st.fwd));
  if (opt_bwd)
    CLI_TRY(smelt_attention_bwd_plan(ctx, &st.desc, &w.q, &w.k, &w.v, &w.o, &w.d_o, &w.lse, &w.dq, &w.dk, &w.dv,
                                     &st.bwd));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(opt_bwd ? st.bwd : st.fwd));

  if (opt_check) {
    cli_bench_poison(ctx, st.o[0], bq);
    cli_bench_poison(ctx, st.lse[0], bl);
  }
  /* The backward's O and LSE: one forward per set. */
  for (int s = 0; s < (opt_bwd ? sets : opt_check ? 1 : 0); s++) run_fwd(s);
  if (opt_check) {
    if (opt_bwd) {
      cli_bench_poison(ctx, st.dq[0], bq);
      cli_bench_poison(ctx, st.dk[0], bk);
      cli_bench_poison(ctx, st.dv[0], bk);
      run_bwd(0);
    }
    CLI_TRY(smelt_ctx_synchronize(ctx));
    check(hq, hk, hv, hdo, c);
  }
  free(hq);
  free(hk);
  free(hv);
  free(hdo);
}

static void teardown(void) {
  smelt_plan_destroy(st.fwd);
  smelt_plan_destroy(st.bwd);
  void **bufs[] = {st.q, st.k, st.v, st.o, st.lse, st.d_o, st.dq, st.dk, st.dv};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    if (bufs[i]) cli_bench_free_sets(st.ctx, bufs[i], st.sets);
}

const cli_bench_op cli_bench_attention = {
    "attention",
    "scaled dot-product attention fwd or bwd (FA-2 semantics, GQA, masks)",
    options, describe, setup, run, teardown,
};
