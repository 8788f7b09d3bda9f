/* Bench op `peer`: product-key expert retrieval (PEER, include/smelt/peer.h),
 * forward or backward, timed the way the PEER targets (docs/PERF.md) are
 * judged: random weights (never zeros), one plan, the run call between
 * device events, x, y and the per-run buffers rotated past L2, median of
 * many runs.
 *
 * Bandwidth counts the bytes a run must move, the expert rows as actually
 * read: every (token, head, expert) use reads one U row [d_in, h_e] and one
 * V row [h_e, d_out], T·h·k·(d_in + d_out)·h_e elements, plus x, y, Wq and
 * the sub-keys. The backward reads the same rows again plus x, dy, Wq, the
 * sub-keys and ids, writes dx, dWq and the sub-key gradients, and, without a
 * store, the dense dU and dV (every N rows: the API's gradients are dense).
 * The copy ceiling moves the same traffic, so "% of copy" is the figure to
 * compare; with 1M experts the rows are gathered at random, one expert row
 * per use, which no cache can help.
 *
 * --cache-mb 0 keeps U and V dense in device memory; a positive value puts
 * them in a hierarchical store (host tables, an HBM cache of that size) and
 * the report adds the store's counters over every timed and warm-up batch.
 *
 * --routing zipf skews selection the way trained routers are skewed: one
 * coordinate of every query chunk is a constant 1 (its Wq column is zero,
 * its bias 1) and sub-key a of every product-key dim carries -1.1·σ·ln(a+1)
 * there, σ the spread of the random part of a sub-key score. Popular experts
 * are then the products of low sub-key ids, with Zipf-like (not exactly
 * Zipf) frequencies; uniform routing is plain random weights.
 *
 * --zipf S benches the store alone on expert ids drawn from an exact
 * Zipf(S) distribution over the N experts (rank r with probability
 * r^-S / H(N, S), ranks mapped to ids by a fixed bijection r -> (A r + B)
 * mod N so that hot experts lie scattered over the host tables): the
 * forward's routing cannot be steered to exact Zipf ids, so each timed run
 * is one batch of T·h·k such ids through smelt_peer_store_prefetch, the
 * code path the forward runs between routing and the expert kernel (count,
 * look up, CLOCK, stage the admitted misses into HBM slots). Nothing reads
 * the experts afterwards: misses not admitted are counted as "mapped"
 * (bytes the expert kernel would read through the mapping), not moved.
 * The runner's GB/s then counts only the ids read per batch; the miss
 * path's rate is the store's staged bytes over the batch time, reported
 * after the counters as a sustained figure (host clock over consecutive
 * batches, launch gaps and the policy's own kernels included, so a lower
 * bound on the copy's rate). Every rotated set is an independent draw.
 *
 * Large expert tables are filled by tiling one random pattern whose length
 * (2^22 + 13 elements) is prime to every row size, so rows differ and the
 * fill costs one pattern, not N rows, of random numbers.
 *
 * With a store, every rotated set holds its own tokens (the store keys on
 * expert ids, so identical sets would hit after one pass); batches repeat
 * after --rotate sets, which bounds how cold the cache can stay.
 *
 * --check compares --check-tokens tokens (the first and the last half of
 * them) of set 0 against the CPU backend, computed in double from the same
 * rounded weights: y and, with --bwd, dx (the backward of those tokens with
 * the device's ids), each within its bound (src/core/error_bound.c).
 * Retrieval ids are compared too and mismatches reported (near-equal scores
 * may rank differently under f32 and f64 arithmetic).
 *
 * --route, --expert-kernel, --overlap, --head-groups and --projection set
 * cfg.kernels, for comparing the CUDA variants; the case's kernel line is
 * the plan's description of what runs. */
#include "bench.h"
#include "core/error_bound.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int64_t opt_tokens = 4096, opt_d_model = 1024, opt_d_out = 0, opt_experts = 1 << 20, opt_heads = 8;
static int64_t opt_top_k = 16, opt_query_dim = 256, opt_hidden = 1, opt_dims = 2, opt_cache_mb = 0;
static int64_t opt_check_tokens = 8;
static const char *opt_dtype = "bf16", *opt_routing = "uniform", *opt_zipf = NULL, *opt_act = "gelu";
static const char *opt_route = "auto", *opt_expert_kernel = "auto", *opt_overlap = "auto", *opt_projection = "auto";
static int64_t opt_head_groups = 0;
static int opt_bwd, opt_check, opt_sparse;

static const cli_opt options[] = {
    {"tokens", CLI_OPT_INT, &opt_tokens, "T", "tokens per run (default 4096)"},
    {"d-model", CLI_OPT_INT, &opt_d_model, "D", "input dim d_in (default 1024)"},
    {"d-out", CLI_OPT_INT, &opt_d_out, "DO", "output dim d_out (default: d_in)"},
    {"experts", CLI_OPT_INT, &opt_experts, "N", "experts, a whole p-th power (default 1M = 1024^2)"},
    {"heads", CLI_OPT_INT, &opt_heads, "H", "retrieval heads (default 8)"},
    {"top-k", CLI_OPT_INT, &opt_top_k, "K", "experts per token and head (default 16)"},
    {"query-dim", CLI_OPT_INT, &opt_query_dim, "DQ", "query dim per head (default 256)"},
    {"expert-hidden", CLI_OPT_INT, &opt_hidden, "HE", "expert hidden size (default 1: singleton MLPs)"},
    {"product-dims", CLI_OPT_INT, &opt_dims, "P", "product-key dims (default 2)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT", "bf16, f16 or f32 for x, y and every weight (default bf16)"},
    {"activation", CLI_OPT_STRING, &opt_act, "A", "the experts' activation, gelu or relu (default gelu)"},
    {"cache-mb", CLI_OPT_INT, &opt_cache_mb, "MB",
     "0: U, V dense in device memory; > 0: a store with host tables and an HBM cache of MB MiB (default 0)"},
    {"routing", CLI_OPT_STRING, &opt_routing, "R", "uniform or zipf (skewed sub-key scores; default uniform)"},
    {"zipf", CLI_OPT_STRING, &opt_zipf, "S",
     "bench the store alone (needs --cache-mb > 0) on batches of tokens x heads x top-k expert ids drawn from an "
     "exact Zipf(S) distribution over the experts, S > 0 (e.g. 1.1)"},
    {"bwd", CLI_OPT_FLAG, &opt_bwd, NULL, "time the backward (dx, dWq, d sub-keys, dU, dV) instead of the forward"},
    {"sparse-grads", CLI_OPT_FLAG, &opt_sparse, NULL,
     "with --bwd: dU, dV as the distinct experts' rows (grad_ids, du_rows, dv_rows) instead of dense tables; "
     "always so with a store"},
    {"check", CLI_OPT_FLAG, &opt_check, NULL, "compare a few tokens of one run against the CPU backend"},
    {"check-tokens", CLI_OPT_INT, &opt_check_tokens, "N", "tokens checked (default 8)"},
    {"route", CLI_OPT_STRING, &opt_route, "K", "routing kernel: auto, reg or wg (cfg.kernels.route; default auto)"},
    {"expert-kernel", CLI_OPT_STRING, &opt_expert_kernel, "K",
     "expert kernel: auto, bulk, warp or rows (cfg.kernels.expert; default auto)"},
    {"overlap", CLI_OPT_STRING, &opt_overlap, "O",
     "the forward's expert kernel beside the routing or after it: auto, beside or after (default auto)"},
    {"head-groups", CLI_OPT_INT, &opt_head_groups, "G",
     "beside the experts, a token block's heads routed in G groups, 1 or 2; 0 = auto (default 0)"},
    {"projection", CLI_OPT_STRING, &opt_projection, "P",
     "the query projection: auto, fused (inside the routing) or gemm (default auto)"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

enum {
  SEED_X = 0x5EED1601u, SEED_WQ = 0x5EED1602u, SEED_KEYS = 0x5EED1603u, SEED_U = 0x5EED1604u,
  SEED_V = 0x5EED1605u, SEED_DY = 0x5EED1606u
};
#define PATTERN_ELEMS (((size_t)1 << 22) + 13)

static struct {
  smelt_peer_config cfg;
  smelt_dtype dt;
  int zipf;
  double zipf_s; /* > 0: --zipf, the store alone on exact Zipf ids */
  int64_t T, din, dout, N, H, K, dq, he, P, n; /* n: sub-keys per dim */
  size_t es, nx, ny, nids, nwq, nkey, nu, nv;  /* element counts; nkey per dim */
  uint64_t expert_bytes;                       /* U and V rows read per run */
  smelt_ctx *ctx;
  int sets;
  void **x, **y, **ids, **dy, **dx;
  void *wq, *bq, *keys[SMELT_PEER_MAX_DIMS], *u, *v;
  void *dwq, *dbq, *dkeys[SMELT_PEER_MAX_DIMS], *du, *dv, *gids; /* du, dv: dense or the sparse rows */
  smelt_peer_store *store;
  smelt_plan *plan;
  cli_bench_case *c; /* the runner's case: teardown adds the store's counters */
} st;

/* ---------------------------------------------------------------- options */

static int64_t int_root(int64_t N, int64_t p) {
  int64_t r = (int64_t)llround(pow((double)N, 1.0 / (double)p));
  for (int64_t c = r > 1 ? r - 1 : 1; c <= r + 1; c++) {
    int64_t prod = 1;
    for (int64_t i = 0; i < p; i++) prod *= c;
    if (prod == N) return c;
  }
  return 0;
}

/* The index of value in names (a kernel choice's enum), else a usage error. */
static int choice(const cli_doc *doc, const char *flag, const char *value, const char *const *names, int n) {
  for (int i = 0; i < n; i++)
    if (strcmp(value, names[i]) == 0) return i;
  cli_usage_error(doc->command, "--%s '%s' is not one of: %s", flag, value, names[n]);
}

static void choose_kernels(const cli_doc *doc, smelt_peer_kernels *k) {
  static const char *const route[] = {"auto", "reg", "wg", "auto, reg, wg"};
  static const char *const expert[] = {"auto", "bulk", "warp", "rows", "auto, bulk, warp, rows"};
  static const char *const overlap[] = {"auto", "beside", "after", "auto, beside, after"};
  static const char *const projection[] = {"auto", "fused", "gemm", "auto, fused, gemm"};
  k->route = (smelt_peer_route_kernel)choice(doc, "route", opt_route, route, SMELT_PEER_ROUTE_COUNT);
  k->expert = (smelt_peer_expert_kernel)choice(doc, "expert-kernel", opt_expert_kernel, expert, SMELT_PEER_EXPERT_COUNT);
  k->overlap = (smelt_peer_overlap)choice(doc, "overlap", opt_overlap, overlap, SMELT_PEER_OVERLAP_COUNT);
  k->projection = (smelt_peer_projection)choice(doc, "projection", opt_projection, projection, SMELT_PEER_PROJECTION_COUNT);
  k->head_groups = (int)cli_require_range(doc, "head-groups", opt_head_groups, 0, 2);
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  static const smelt_dtype allowed[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16, SMELT_DTYPE_F32};
  st.dt = cli_require_dtype(doc, "dtype", opt_dtype, allowed, 3);
  st.T = cli_require_range(doc, "tokens", opt_tokens, 1, (int64_t)1 << 24);
  st.din = cli_require_range(doc, "d-model", opt_d_model, 1, 1 << 16);
  st.dout = opt_d_out ? cli_require_range(doc, "d-out", opt_d_out, 1, 1 << 16) : st.din;
  st.P = cli_require_range(doc, "product-dims", opt_dims, 2, SMELT_PEER_MAX_DIMS);
  st.N = cli_require_range(doc, "experts", opt_experts, 4, (int64_t)1 << 32);
  st.n = int_root(st.N, st.P);
  if (!st.n)
    cli_usage_error(doc->command, "--experts %lld is not n^%lld for a whole n (--product-dims; 1048576 = 1024^2 is)",
                    (long long)st.N, (long long)st.P);
  st.H = cli_require_range(doc, "heads", opt_heads, 1, 65535);
  st.K = cli_require_range(doc, "top-k", opt_top_k, 1, st.N < 1024 ? st.N : 1024);
  st.dq = cli_require_range(doc, "query-dim", opt_query_dim, st.P, 1 << 16);
  if (st.dq % st.P)
    cli_usage_error(doc->command, "--query-dim %lld is not a multiple of --product-dims %lld", (long long)st.dq,
                    (long long)st.P);
  st.he = cli_require_range(doc, "expert-hidden", opt_hidden, 1, 4096);
  cli_require_range(doc, "cache-mb", opt_cache_mb, 0, (int64_t)1 << 24);
  cli_require_range(doc, "check-tokens", opt_check_tokens, 1, 4096);
  if (strcmp(opt_routing, "uniform") == 0) st.zipf = 0;
  else if (strcmp(opt_routing, "zipf") == 0) st.zipf = 1;
  else cli_usage_error(doc->command, "--routing '%s' is not one of: uniform, zipf", opt_routing);
  if (st.T * st.H * st.K > ((int64_t)1 << 34) / st.he)
    cli_usage_error(doc->command, "tokens x heads x top-k x expert-hidden exceeds 2^34");
  if (opt_zipf) {
    char *end;
    st.zipf_s = strtod(opt_zipf, &end);
    if (*end || !(st.zipf_s > 0) || !isfinite(st.zipf_s))
      cli_usage_error(doc->command, "--zipf '%s' is not an exponent > 0 (e.g. 1.1)", opt_zipf);
    if (!opt_cache_mb || opt_bwd || opt_check)
      cli_usage_error(doc->command, "--zipf benches the store alone: it needs --cache-mb > 0, without --bwd or --check");
  }

  if (opt_sparse && !opt_bwd) cli_usage_error(doc->command, "--sparse-grads is an option of --bwd");
  st.cfg = smelt_peer_config_default();
  st.cfg.input_dim = st.din;
  st.cfg.output_dim = st.dout;
  st.cfg.num_experts = st.N;
  st.cfg.num_experts_per_tok = st.K;
  st.cfg.num_heads = st.H;
  st.cfg.expert_hidden_size = st.he;
  st.cfg.query_dim = st.dq;
  st.cfg.product_key_dims = (int)st.P;
  if (strcmp(opt_act, "gelu") == 0) st.cfg.activation = SMELT_ACT_GELU;
  else if (strcmp(opt_act, "relu") == 0) st.cfg.activation = SMELT_ACT_RELU;
  else cli_usage_error(doc->command, "--activation '%s' is not one of: gelu, relu", opt_act);
  choose_kernels(doc, &st.cfg.kernels);

  st.es = smelt_dtype_size(st.dt);
  st.nx = (size_t)(st.T * st.din);
  st.ny = (size_t)(st.T * st.dout);
  st.nids = (size_t)(st.T * st.H * st.K);
  st.nwq = (size_t)(st.din * st.H * st.dq);
  st.nkey = (size_t)(st.n * (st.dq / st.P));
  st.nu = (size_t)st.N * (size_t)(st.din * st.he);
  st.nv = (size_t)st.N * (size_t)(st.he * st.dout);
  const uint64_t es = st.es, keys = es * st.nkey * (uint64_t)st.P, wq = es * (st.nwq + (uint64_t)(st.H * st.dq));
  st.expert_bytes = (uint64_t)st.nids * (uint64_t)((st.din + st.dout) * st.he) * es;
  if (st.zipf_s > 0) {
    /* The batch reads its ids; what it stages is counted by the store. */
    c->traffic_bytes = 8 * (uint64_t)st.nids;
    c->set_bytes = 8 * (uint64_t)st.nids;
  } else if (opt_bwd) {
    /* Reads x, dy, ids, Wq, bq, sub-keys and the rows; writes dx, dWq, dbq,
     * d sub-keys, and the dense dU, dV when there is no store. */
    c->traffic_bytes = st.expert_bytes + es * (2 * st.nx + st.ny) + 8 * (uint64_t)st.nids + 2 * (wq + keys) +
                       (opt_cache_mb ? 0 : es * (st.nu + st.nv));
    c->set_bytes = es * (2 * st.nx + st.ny) + 8 * (uint64_t)st.nids;
  } else {
    c->traffic_bytes = st.expert_bytes + es * (st.nx + st.ny) + wq + keys;
    c->set_bytes = es * (st.nx + st.ny);
  }
  /* U and V (dense or the store's host tables), their gradients (dense, or
   * one row per use), and the host copies a check keeps. */
  const uint64_t tables = es * (st.nu + st.nv);
  c->fixed_bytes = tables + wq + keys + (opt_check ? tables : 0);
  if (opt_bwd)
    c->fixed_bytes += opt_cache_mb || opt_sparse ? st.expert_bytes + 8 * (uint64_t)st.nids : tables;
  /* Scores: h·(d_in·dq + n·dq) per token; experts: 2·(d_in + d_out)·h_e per use. */
  c->flops = 2.0 * (double)st.T * (double)st.H * (double)st.dq * (double)(st.din + st.n) +
             2.0 * (double)st.nids * (double)((st.din + st.dout) * st.he);
  if (opt_bwd) c->flops *= 2.0;
  if (st.zipf_s > 0) c->flops = 0;
  char routing[48];
  if (st.zipf_s > 0) snprintf(routing, sizeof routing, "zipf_ids(%g)", st.zipf_s);
  else snprintf(routing, sizeof routing, "%s", opt_routing);

  snprintf(c->params_text, sizeof c->params_text,
           "%s tokens=%lld d_in=%lld d_out=%lld experts=%lld (%lld^%lld) heads=%lld top_k=%lld query_dim=%lld "
           "expert_hidden=%lld activation=%s dtype=%s cache_mb=%lld routing=%s",
           st.zipf_s > 0 ? "store" : opt_bwd ? (st.store || opt_sparse ? "bwd(sparse dU dV)" : "bwd") : "fwd", (long long)st.T, (long long)st.din, (long long)st.dout, (long long)st.N,
           (long long)st.n, (long long)st.P, (long long)st.H, (long long)st.K, (long long)st.dq, (long long)st.he,
           opt_act, smelt_dtype_name(st.dt), (long long)opt_cache_mb, routing);
  snprintf(c->params_json, sizeof c->params_json,
           "\"tokens\":%lld,\"d_in\":%lld,\"d_out\":%lld,\"experts\":%lld,\"product_dims\":%lld,\"heads\":%lld,"
           "\"top_k\":%lld,\"query_dim\":%lld,\"expert_hidden\":%lld,\"activation\":\"%s\",\"dtype\":\"%s\","
           "\"cache_mb\":%lld,\"routing\":\"%s\",\"bwd\":%s,\"sparse_grads\":%s,\"expert_bytes\":%llu",
           (long long)st.T, (long long)st.din, (long long)st.dout, (long long)st.N, (long long)st.P, (long long)st.H,
           (long long)st.K, (long long)st.dq, (long long)st.he, opt_act, smelt_dtype_name(st.dt),
           (long long)opt_cache_mb, routing, opt_bwd ? "true" : "false",
           opt_bwd && (st.store || opt_sparse) ? "true" : "false",
           (unsigned long long)st.expert_bytes);
}

/* ---------------------------------------------------------------- views and runs */

static smelt_tensor dense_on(smelt_ctx *ctx, void *p, smelt_dtype dt, int nd, int64_t a, int64_t b, int64_t c) {
  int64_t shape[3] = {a, b, c};
  return smelt_tensor_make(p, dt, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), nd, shape);
}

static smelt_tensor dense(void *p, smelt_dtype dt, int nd, int64_t a, int64_t b, int64_t c) {
  return dense_on(st.ctx, p, dt, nd, a, b, c);
}

/* The weight views (device), kept in file scope so smelt_peer_weights can
 * point at them. */
static struct {
  smelt_tensor wq, bq, keys[SMELT_PEER_MAX_DIMS], u, v;
  smelt_tensor dwq, dbq, dkeys[SMELT_PEER_MAX_DIMS], du, dv, gids;
  smelt_peer_weights w;
  smelt_peer_grads g;
} wv;

/* Views shaped as Wq, bq and the sub-keys (the weights or their
 * gradients) at wq, bq and keys, pointed at by *pwq, *pbq and pkeys. */
static void bind_query(void *wq, void *bq, void *const *keys, smelt_tensor *twq, smelt_tensor *tbq, smelt_tensor *tkeys,
                       const smelt_tensor **pwq, const smelt_tensor **pbq, const smelt_tensor **pkeys) {
  *twq = dense(wq, st.dt, 2, st.din, st.H * st.dq, 0);
  *tbq = dense(bq, st.dt, 1, st.H * st.dq, 0, 0);
  *pwq = twq;
  *pbq = tbq;
  for (int i = 0; i < st.P; i++) {
    tkeys[i] = dense(keys[i], st.dt, 2, st.n, st.dq / st.P, 0);
    pkeys[i] = &tkeys[i];
  }
}

static void bind_weights(void) {
  memset(&wv, 0, sizeof wv);
  bind_query(st.wq, st.bq, st.keys, &wv.wq, &wv.bq, wv.keys, &wv.w.wq, &wv.w.bq, wv.w.sub_keys);
  if (st.store) {
    wv.w.store = st.store;
  } else {
    wv.u = dense(st.u, st.dt, 3, st.N, st.din, st.he);
    wv.v = dense(st.v, st.dt, 3, st.N, st.he, st.dout);
    wv.w.u = &wv.u;
    wv.w.v = &wv.v;
  }
  if (!opt_bwd) return;
  bind_query(st.dwq, st.dbq, st.dkeys, &wv.dwq, &wv.dbq, wv.dkeys, &wv.g.dwq, &wv.g.dbq, wv.g.dsub_keys);
  if (st.gids) {
    const int64_t nids = (int64_t)st.nids;
    wv.gids = dense(st.gids, SMELT_DTYPE_I64, 1, nids, 0, 0);
    wv.du = dense(st.du, st.dt, 3, nids, st.din, st.he);
    wv.dv = dense(st.dv, st.dt, 3, nids, st.he, st.dout);
    wv.g.grad_ids = &wv.gids;
    wv.g.du_rows = &wv.du;
    wv.g.dv_rows = &wv.dv;
  } else {
    wv.du = dense(st.du, st.dt, 3, st.N, st.din, st.he);
    wv.dv = dense(st.dv, st.dt, 3, st.N, st.he, st.dout);
    wv.g.du = &wv.du;
    wv.g.dv = &wv.dv;
  }
}

static void run_fwd(int set, int with_ids) {
  smelt_tensor x = dense(st.x[set], st.dt, 2, st.T, st.din, 0), y = dense(st.y[set], st.dt, 2, st.T, st.dout, 0);
  smelt_tensor ids = dense(st.ids[set], SMELT_DTYPE_I64, 3, st.T, st.H, st.K);
  CLI_TRY(smelt_peer_forward_run(st.plan, &wv.w, &x, &y, with_ids ? &ids : NULL, NULL));
}

static void run_bwd(int set) {
  smelt_tensor x = dense(st.x[set], st.dt, 2, st.T, st.din, 0), dy = dense(st.dy[set], st.dt, 2, st.T, st.dout, 0);
  smelt_tensor dx = dense(st.dx[set], st.dt, 2, st.T, st.din, 0);
  smelt_tensor ids = dense(st.ids[set], SMELT_DTYPE_I64, 3, st.T, st.H, st.K);
  smelt_peer_grads g = wv.g;
  g.dx = &dx;
  CLI_TRY(smelt_peer_backward_run(st.plan, &wv.w, &x, &ids, &dy, &g));
}

static void run_zipf(int set) {
  smelt_tensor ids = dense(st.ids[set], SMELT_DTYPE_I64, 3, st.T, st.H, st.K);
  CLI_TRY(smelt_peer_store_prefetch(st.store, &ids));
}

static void run(int set) {
  if (st.zipf_s > 0) run_zipf(set);
  else if (opt_bwd) run_bwd(set);
  else run_fwd(set, 0);
}

/* ---------------------------------------------------------------- data */

static void *host_fill(size_t n, smelt_dtype dt, uint64_t seed, double lo, double hi) {
  void *h = cli_malloc((n ? n : 1) * smelt_dtype_size(dt));
  cli_fill_uniform(h, dt, n, seed, lo, hi);
  return h;
}

static void set_elem(void *buf, smelt_dtype dt, size_t i, double v) {
  cli_fill_uniform((char *)buf + i * smelt_dtype_size(dt), dt, 1, 0, v, v);
}

/* Fills n elements at dst (host memory, or device memory of ctx when ctx is
 * not NULL) with repeats of the pattern. */
static void tile(smelt_ctx *ctx, void *dst, size_t n, const void *pat, size_t pat_n) {
  const size_t es = st.es;
  for (size_t at = 0; at < n; at += pat_n) {
    size_t m = n - at < pat_n ? n - at : pat_n;
    if (ctx) CLI_TRY(smelt_memcpy_h2d(ctx, (char *)dst + at * es, pat, m * es));
    else memcpy((char *)dst + at * es, pat, m * es);
  }
}

/* Random weights, scaled so every score and expert activation is of unit
 * order: x in [-1, 1), Wq columns and sub-keys with unit-variance dot
 * products, U scaled by 1/sqrt(d_in), V by 1/sqrt(h_e). */
typedef struct host_weights {
  void *wq, *bq, *keys[SMELT_PEER_MAX_DIMS], *upat, *vpat;
} host_weights;

static host_weights make_weights(void) {
  host_weights h;
  memset(&h, 0, sizeof h);
  const int64_t dc = st.dq / st.P;
  const double aw = sqrt(3.0 / (double)st.din), ak = sqrt(3.0 / (double)dc);
  h.wq = host_fill(st.nwq, st.dt, SEED_WQ, -aw, aw);
  h.bq = host_fill((size_t)(st.H * st.dq), st.dt, SEED_WQ + 100, -0.1, 0.1);
  for (int i = 0; i < st.P; i++) h.keys[i] = host_fill(st.nkey, st.dt, SEED_KEYS + (uint64_t)i, -ak, ak);
  if (st.zipf) {
    /* q·c over a chunk: q has variance 1/3 (x var 1/3, Wq var 1/d_in), c var 1/dc. */
    const double sigma = sqrt(1.0 / 3.0);
    for (int64_t hd = 0; hd < st.H; hd++)
      for (int i = 0; i < st.P; i++) {
        const size_t col = (size_t)(hd * st.dq + i * dc);
        for (int64_t r = 0; r < st.din; r++) set_elem(h.wq, st.dt, (size_t)r * (size_t)(st.H * st.dq) + col, 0.0);
        set_elem(h.bq, st.dt, col, 1.0);
      }
    for (int i = 0; i < st.P; i++)
      for (int64_t a = 0; a < st.n; a++) set_elem(h.keys[i], st.dt, (size_t)(a * dc), -1.1 * sigma * log((double)(a + 1)));
  }
  const double au = sqrt(3.0 / (double)st.din), av = 1.0 / sqrt((double)st.he);
  h.upat = host_fill(PATTERN_ELEMS, st.dt, SEED_U, -au, au);
  h.vpat = host_fill(PATTERN_ELEMS, st.dt, SEED_V, -av, av);
  return h;
}

static void free_weights(host_weights *h) {
  free(h->wq);
  free(h->bq);
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) free(h->keys[i]);
  free(h->upat);
  free(h->vpat);
}

/* ---------------------------------------------------------------- check */

typedef struct err_sums {
  double diff2, ref2, max_abs;
  int64_t nan;
} err_sums;

static void err_add(err_sums *s, double got, double ref) {
  if (isnan(got) != isnan(ref) || (isinf(ref) && got != ref)) {
    s->nan++;
    return;
  }
  if (!isfinite(ref)) return;
  const double d = fabs(got - ref);
  s->diff2 += d * d;
  s->ref2 += ref * ref;
  if (d > s->max_abs) s->max_abs = d;
}

static double rel_l2(const err_sums *s) { return s->ref2 > 0 ? sqrt(s->diff2 / s->ref2) : sqrt(s->diff2); }

/* The relative L2 bound of y (output 0) or dx (1) against the CPU backend. */
static double bound_of(int output) {
  const smelt__bound_query q = {.family = "peer", .device = smelt_ctx_device(st.ctx), .dtype = st.dt, .output = output};
  return smelt__error_bound(&q);
}

/* Token t of the checked ones: the first half from the start, the rest from the end. */
static int64_t checked_token(int64_t i, int64_t nc) {
  const int64_t head = (nc + 1) / 2;
  return i < head ? i : st.T - (nc - i);
}

static void gather_rows(void *dst, const void *src, int64_t cols, int64_t nc, size_t es) {
  for (int64_t i = 0; i < nc; i++)
    memcpy((char *)dst + (size_t)(i * cols) * es, (const char *)src + (size_t)(checked_token(i, nc) * cols) * es,
           (size_t)cols * es);
}

static void check(const host_weights *hw, const void *hx, const void *hdy, const void *hu, const void *hv,
                  cli_bench_case *c) {
  const int64_t nc = opt_check_tokens < st.T ? opt_check_tokens : st.T;
  const size_t es = st.es, nid = (size_t)(nc * st.H * st.K);
  smelt_ctx *cpu = cli_ctx_open_cpu();
  smelt_tensor wq = dense_on(cpu, hw->wq, st.dt, 2, st.din, st.H * st.dq, 0);
  smelt_tensor bq = dense_on(cpu, hw->bq, st.dt, 1, st.H * st.dq, 0, 0);
  smelt_tensor keys[SMELT_PEER_MAX_DIMS];
  smelt_tensor u = dense_on(cpu, (void *)hu, st.dt, 3, st.N, st.din, st.he);
  smelt_tensor v = dense_on(cpu, (void *)hv, st.dt, 3, st.N, st.he, st.dout);
  smelt_peer_weights w;
  memset(&w, 0, sizeof w);
  w.wq = &wq;
  w.bq = &bq;
  for (int i = 0; i < st.P; i++) {
    keys[i] = dense_on(cpu, hw->keys[i], st.dt, 2, st.n, st.dq / st.P, 0);
    w.sub_keys[i] = &keys[i];
  }
  w.u = &u;
  w.v = &v;

  /* The device's results for the checked tokens. */
  void *full_y = cli_malloc(st.ny * es), *full_ids = cli_malloc(st.nids * 8);
  cli_dev_download(st.ctx, full_y, st.y[0], st.ny * es);
  cli_dev_download(st.ctx, full_ids, st.ids[0], st.nids * 8);
  void *xs = cli_malloc((size_t)(nc * st.din) * es), *ys = cli_malloc((size_t)(nc * st.dout) * es);
  int64_t *ids_dev = cli_malloc(nid * 8), *ids_ref = cli_malloc(nid * 8);
  gather_rows(xs, hx, st.din, nc, es);
  gather_rows(ys, full_y, st.dout, nc, es);
  gather_rows(ids_dev, full_ids, st.H * st.K, nc, 8);

  double *yref = cli_malloc((size_t)(nc * st.dout) * sizeof *yref);
  smelt_tensor tx = dense_on(cpu, xs, st.dt, 2, nc, st.din, 0);
  smelt_tensor ty = dense_on(cpu, yref, SMELT_DTYPE_F64, 2, nc, st.dout, 0);
  smelt_tensor tids = dense_on(cpu, ids_ref, SMELT_DTYPE_I64, 3, nc, st.H, st.K);
  CLI_TRY(smelt_peer_forward(cpu, &st.cfg, &w, &tx, &ty, &tids, NULL));
  err_sums ey = {0, 0, 0, 0}, edx = {0, 0, 0, 0};
  for (size_t i = 0; i < (size_t)(nc * st.dout); i++) err_add(&ey, cli_load(ys, st.dt, i), yref[i]);
  int64_t id_mismatch = 0;
  for (size_t i = 0; i < nid; i++) id_mismatch += ids_dev[i] != ids_ref[i];

  if (opt_bwd) {
    /* dx of the checked tokens, with the device's ids. */
    void *full_dx = cli_malloc(st.nx * es), *dxs = cli_malloc((size_t)(nc * st.din) * es);
    void *dys = cli_malloc((size_t)(nc * st.dout) * es);
    double *dxref = cli_malloc((size_t)(nc * st.din) * sizeof *dxref);
    cli_dev_download(st.ctx, full_dx, st.dx[0], st.nx * es);
    gather_rows(dxs, full_dx, st.din, nc, es);
    gather_rows(dys, hdy, st.dout, nc, es);
    smelt_tensor tdy = dense_on(cpu, dys, st.dt, 2, nc, st.dout, 0);
    smelt_tensor tdx = dense_on(cpu, dxref, SMELT_DTYPE_F64, 2, nc, st.din, 0);
    smelt_tensor tid = dense_on(cpu, ids_dev, SMELT_DTYPE_I64, 3, nc, st.H, st.K);
    smelt_peer_grads g;
    memset(&g, 0, sizeof g);
    g.dx = &tdx;
    CLI_TRY(smelt_peer_backward(cpu, &st.cfg, &w, &tx, &tid, &tdy, &g));
    for (size_t i = 0; i < (size_t)(nc * st.din); i++) err_add(&edx, cli_load(dxs, st.dt, i), dxref[i]);
    free(full_dx);
    free(dxs);
    free(dys);
    free(dxref);
  }
  smelt_ctx_destroy(cpu);

  const double bound = bound_of(0), dx_bound = bound_of(1), ry = rel_l2(&ey), rdx = rel_l2(&edx);
  const int ok = ey.nan + edx.nan == 0 && ry <= bound && rdx <= dx_bound;
  c->check_failed = !ok;
  char dx_text[64] = "";
  if (opt_bwd) snprintf(dx_text, sizeof dx_text, ", dx %.2e (bound %.0e)", rdx, dx_bound);
  snprintf(c->check_text, sizeof c->check_text,
           "%lld tokens: rel_l2 y %.2e (bound %.0e)%s, max_abs y %.2e, %lld NaN/inf mismatches, ids %lld of %zu "
           "differ: %s",
           (long long)nc, ry, bound, dx_text, ey.max_abs, (long long)(ey.nan + edx.nan), (long long)id_mismatch, nid,
           ok ? "ok" : "FAIL");
  snprintf(c->check_json, sizeof c->check_json,
           "\"check\":\"%s\",\"check_tokens\":%lld,\"check_rel_l2\":%.4e,\"check_bound\":%.1e,"
           "\"check_max_abs\":%.4e,\"check_nan\":%lld,\"check_id_mismatches\":%lld",
           ok ? "ok" : "fail", (long long)nc, ry, bound, ey.max_abs, (long long)(ey.nan + edx.nan),
           (long long)id_mismatch);
  if (opt_bwd) {
    size_t len = strlen(c->check_json);
    snprintf(c->check_json + len, sizeof c->check_json - len, ",\"check_dx_rel_l2\":%.4e,\"check_dx_bound\":%.1e", rdx,
             dx_bound);
  }
  free(full_y);
  free(full_ids);
  free(xs);
  free(ys);
  free(ids_dev);
  free(ids_ref);
  free(yref);
}

/* ---------------------------------------------------------------- setup */

static void poison(void *dev, size_t bytes) {
  void *p = cli_malloc(bytes);
  memset(p, 0xFF, bytes); /* NaN in every float type */
  CLI_TRY(smelt_memcpy_h2d(st.ctx, dev, p, bytes));
  free(p);
}

/* ---------------------------------------------------------------- exact Zipf ids */

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t gcd_u64(uint64_t a, uint64_t b) {
  while (b) {
    const uint64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/* Sets of st.nids expert ids, each an independent draw from Zipf(s) over
 * ranks 1..N (inverse CDF: binary search in the cumulative weights), rank
 * r -> id (A (r-1) + B) mod N with A prime to N (a bijection). */
static void zipf_setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  const int64_t N = st.N;
  double *cdf = cli_malloc((size_t)N * sizeof *cdf), sum = 0;
  for (int64_t r = 0; r < N; r++) cdf[r] = sum += pow((double)(r + 1), -st.zipf_s);
  uint64_t A = ((uint64_t)((double)N * 0.6180339887498949) | 1u) % (uint64_t)N;
  while (A == 0 || gcd_u64(A, (uint64_t)N) != 1) A = (A + 1) % (uint64_t)N;
  const uint64_t B = (uint64_t)N / 3;
  int64_t *h = cli_malloc(st.nids * 8);
  uint64_t rng = 0x5EED1607u;
  st.ids = cli_bench_alloc_sets(ctx, st.nids * 8, sets);
  for (int s = 0; s < sets; s++) {
    for (size_t i = 0; i < st.nids; i++) {
      const double u = (double)(splitmix64(&rng) >> 11) * 0x1.0p-53 * sum;
      int64_t lo = 0, hi = N - 1; /* the first rank whose cumulative weight exceeds u */
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (cdf[mid] > u) hi = mid;
        else lo = mid + 1;
      }
      h[i] = (int64_t)(((uint64_t)lo * A + B) % (uint64_t)N);
    }
    CLI_TRY(smelt_memcpy_h2d(ctx, st.ids[s], h, st.nids * 8));
  }
  free(h);
  free(cdf);
  snprintf(c->kernel, sizeof c->kernel, "smelt_peer_store_prefetch (the forward's store batch) on exact Zipf(%g) ids",
           st.zipf_s);
}

/* The store of --cache-mb MiB for the bench's shape (tables zeroed). */
static void create_store(smelt_ctx *ctx) {
  smelt_peer_store_options o = smelt_peer_store_options_default();
  o.num_experts = st.N;
  o.input_dim = st.din;
  o.output_dim = st.dout;
  o.expert_hidden_size = st.he;
  o.dtype = st.dt;
  o.cache_mb = (double)opt_cache_mb;
  o.use_env = 0;
  CLI_TRY(smelt_peer_store_create(ctx, &o, &st.store));
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  st.ctx = ctx;
  st.sets = sets;
  st.c = c;
  if (st.zipf_s > 0) {
    /* The store alone: its tables stay as created (zeroed); the copies
     * move the same bytes whatever they hold. */
    create_store(ctx);
    zipf_setup(ctx, sets, c);
    return;
  }
  const size_t es = st.es;
  host_weights hw = make_weights();
  void *hx = host_fill(st.nx, st.dt, SEED_X, -1.0, 1.0);
  void *hdy = opt_bwd ? host_fill(st.ny, st.dt, SEED_DY, -1.0, 1.0) : NULL;

  st.wq = cli_dev_upload(ctx, hw.wq, st.nwq * es);
  st.bq = cli_dev_upload(ctx, hw.bq, (size_t)(st.H * st.dq) * es);
  for (int i = 0; i < st.P; i++) st.keys[i] = cli_dev_upload(ctx, hw.keys[i], st.nkey * es);

  /* The expert tables: on the device, or in the store's host tables. The
   * check needs host copies: the store's tables serve as they are. */
  void *hu = NULL, *hv = NULL;
  int own_host_tables = 0;
  if (opt_cache_mb > 0) {
    create_store(ctx);
    smelt_tensor tu, tv;
    CLI_TRY(smelt_peer_store_tables(st.store, &tu, &tv));
    tile(NULL, tu.data, st.nu, hw.upat, PATTERN_ELEMS);
    tile(NULL, tv.data, st.nv, hw.vpat, PATTERN_ELEMS);
    CLI_TRY(smelt_peer_store_invalidate(st.store));
    hu = tu.data;
    hv = tv.data;
  } else {
    st.u = cli_dev_alloc(ctx, st.nu * es);
    st.v = cli_dev_alloc(ctx, st.nv * es);
    tile(ctx, st.u, st.nu, hw.upat, PATTERN_ELEMS);
    tile(ctx, st.v, st.nv, hw.vpat, PATTERN_ELEMS);
    if (opt_check) {
      hu = cli_malloc(st.nu * es);
      hv = cli_malloc(st.nv * es);
      tile(NULL, hu, st.nu, hw.upat, PATTERN_ELEMS);
      tile(NULL, hv, st.nv, hw.vpat, PATTERN_ELEMS);
      own_host_tables = 1;
    }
  }

  st.x = cli_bench_upload_sets(ctx, hx, st.nx * es, sets);
  /* The store sees ids, not addresses: each set gets its own tokens so
   * consecutive batches route differently (set 0 keeps hx, the checked one). */
  for (int s = 1; st.store && s < sets; s++) {
    void *h = host_fill(st.nx, st.dt, SEED_X + 1000u * (uint64_t)s, -1.0, 1.0);
    CLI_TRY(smelt_memcpy_h2d(ctx, st.x[s], h, st.nx * es));
    free(h);
  }
  st.y = cli_bench_alloc_sets(ctx, st.ny * es, sets);
  st.ids = cli_bench_alloc_sets(ctx, st.nids * 8, sets);
  if (opt_bwd) {
    st.dy = cli_bench_upload_sets(ctx, hdy, st.ny * es, sets);
    st.dx = cli_bench_alloc_sets(ctx, st.nx * es, sets);
    st.dwq = cli_dev_alloc(ctx, st.nwq * es);
    st.dbq = cli_dev_alloc(ctx, (size_t)(st.H * st.dq) * es);
    for (int i = 0; i < st.P; i++) st.dkeys[i] = cli_dev_alloc(ctx, st.nkey * es);
    if (st.store || opt_sparse) { /* rows for every use: the distinct experts are at most that many */
      st.gids = cli_dev_alloc(ctx, st.nids * 8);
      st.du = cli_dev_alloc(ctx, st.nids * (size_t)(st.din * st.he) * es);
      st.dv = cli_dev_alloc(ctx, st.nids * (size_t)(st.he * st.dout) * es);
    } else {
      st.du = cli_dev_alloc(ctx, st.nu * es);
      st.dv = cli_dev_alloc(ctx, st.nv * es);
    }
  }
  bind_weights();
  smelt_tensor x0 = dense(st.x[0], st.dt, 2, st.T, st.din, 0);
  CLI_TRY(smelt_peer_plan(ctx, &st.cfg, &wv.w, &x0, &st.plan));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(st.plan));

  if (opt_check) {
    poison(st.y[0], st.ny * es);
    poison(st.ids[0], st.nids * 8);
  }
  /* The backward's ids: one forward per set. */
  for (int s = 0; s < (opt_bwd ? sets : opt_check ? 1 : 0); s++) run_fwd(s, 1);
  if (opt_check) {
    if (opt_bwd) {
      poison(st.dx[0], st.nx * es);
      run_bwd(0);
    }
    CLI_TRY(smelt_ctx_synchronize(ctx));
    check(&hw, hx, hdy, hu, hv, c);
  }
  /* The store's counters cover the timed and warm-up batches only. */
  if (st.store) CLI_TRY(smelt_peer_store_stats_reset(st.store));
  if (own_host_tables) {
    free(hu);
    free(hv);
  }
  free_weights(&hw);
  free(hx);
  free(hdy);
}

/* The store's counters go into the case's text and JSON, which the runner
 * prints after teardown. */
static void report_store(void) {
  smelt_peer_store_stats s;
  CLI_TRY(smelt_peer_store_stats_get(st.store, &s));
  cli_bench_case *c = st.c;
  char staged[32], mapped[32];
  size_t len = strlen(c->kernel);
  if (!s.batches) {
    /* The backward reads experts through the store without changing it. */
    snprintf(c->kernel + len, sizeof c->kernel - len, "; store: read only (backward)");
    return;
  }
  snprintf(c->kernel + len, sizeof c->kernel - len, "; store: hit rate %.1f%%, %s staged, %s mapped",
           100.0 * s.hit_rate, cli_fmt_bytes(s.bytes_staged, staged, sizeof staged),
           cli_fmt_bytes(s.bytes_mapped, mapped, sizeof mapped));
  char more[384];
  more[0] = 0;
  if (st.zipf_s <= 0) /* --zipf reports its warm-cache counters instead (params_json has room for one set) */
    snprintf(more, sizeof more,
           ",\"store_batches\":%llu,\"store_lookups\":%llu,\"store_hits\":%llu,\"store_evictions\":%llu,"
           "\"store_uses_mapped\":%llu,\"store_bytes_staged\":%llu,\"store_bytes_mapped\":%llu,"
           "\"store_slots\":%lld,\"store_hit_rate\":%.6f",
           (unsigned long long)s.batches, (unsigned long long)s.lookups, (unsigned long long)s.hits,
           (unsigned long long)s.evictions, (unsigned long long)s.uses_mapped, (unsigned long long)s.bytes_staged,
           (unsigned long long)s.bytes_mapped, (long long)s.slots, s.hit_rate);
  len = strlen(c->params_json);
  if (len + strlen(more) < sizeof c->params_json) memcpy(c->params_json + len, more, strlen(more) + 1);
  /* The full report, for the text output (stderr keeps --json one object per line). */
  char buf[1024];
  CLI_TRY(smelt_peer_store_report(st.store, buf, sizeof buf));
  fprintf(stderr, "%s%s", buf, buf[0] && buf[strlen(buf) - 1] == '\n' ? "" : "\n");
}

/* --zipf: after the runner's batches (the cache warm), consecutive batches
 * over every set on the host clock: staged bytes over elapsed time is the
 * miss path's sustained rate, policy kernels and launch gaps included. */
static void report_sustained(void) {
  const int rounds = st.sets >= 20 ? 1 : (20 + st.sets - 1) / st.sets;
  CLI_TRY(smelt_peer_store_stats_reset(st.store));
  const double t0 = cli_now_seconds();
  for (int r = 0; r < rounds; r++)
    for (int set = 0; set < st.sets; set++) run_zipf(set);
  CLI_TRY(smelt_ctx_synchronize(st.ctx));
  const double sec = cli_now_seconds() - t0;
  smelt_peer_store_stats s;
  CLI_TRY(smelt_peer_store_stats_get(st.store, &s));
  const double gbps = sec > 0 ? (double)s.bytes_staged / sec / 1e9 : 0;
  const double per = s.batches ? (double)s.bytes_staged / (double)s.batches : 0;
  fprintf(stderr,
          "zipf(%g) ids, warm cache: %llu batches of %zu ids in %.1f ms (%.3f ms a batch), %llu lookups, hit rate "
          "%.1f%%, %.1f MB staged a batch, %.1f MB a batch counted as mapped (not moved: no expert kernel runs); "
          "miss path %.1f GB/s sustained (staged bytes / elapsed)\n",
          st.zipf_s, (unsigned long long)s.batches, st.nids, 1e3 * sec, s.batches ? 1e3 * sec / (double)s.batches : 0,
          (unsigned long long)s.lookups, 100.0 * s.hit_rate, per / 1e6,
          s.batches ? (double)s.bytes_mapped / (double)s.batches / 1e6 : 0, gbps);
  char more[320];
  snprintf(more, sizeof more,
           ",\"warm_batches\":%llu,\"warm_ms\":%.4f,\"warm_lookups\":%llu,\"warm_hit_rate\":%.6f,"
           "\"warm_bytes_staged\":%llu,\"warm_bytes_mapped\":%llu,\"store_slots\":%lld,\"miss_path_gbps\":%.3f",
           (unsigned long long)s.batches, 1e3 * sec, (unsigned long long)s.lookups, s.hit_rate,
           (unsigned long long)s.bytes_staged, (unsigned long long)s.bytes_mapped, (long long)s.slots, gbps);
  cli_bench_case *c = st.c;
  const size_t len = strlen(c->params_json);
  if (len + strlen(more) < sizeof c->params_json) memcpy(c->params_json + len, more, strlen(more) + 1);
}

static void teardown(void) {
  if (st.store) report_store();
  if (st.zipf_s > 0) report_sustained();
  smelt_plan_destroy(st.plan);
  void **bufs[] = {st.x, st.y, st.ids, st.dy, st.dx};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    if (bufs[i]) cli_bench_free_sets(st.ctx, bufs[i], st.sets);
  void *single[] = {st.wq, st.bq, st.u, st.v, st.dwq, st.dbq, st.du, st.dv, st.gids};
  for (size_t i = 0; i < sizeof single / sizeof single[0]; i++)
    if (single[i]) CLI_TRY(smelt_free(st.ctx, single[i]));
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) {
    if (st.keys[i]) CLI_TRY(smelt_free(st.ctx, st.keys[i]));
    if (st.dkeys[i]) CLI_TRY(smelt_free(st.ctx, st.dkeys[i]));
  }
  smelt_peer_store_destroy(st.store);
}

const cli_bench_op cli_bench_peer = {
    "peer",
    "PEER product-key expert retrieval fwd or bwd (dense experts or the host store)",
    options, describe, setup, run, teardown,
};
