/* Demo section: PEER, product-key retrieval over a million singleton experts
 * (1024^2, 8 heads, top-16, query dim 256, d_model in and out) held in the
 * hierarchical expert store: the full U and V tables in host memory, an HBM
 * cache of 512 MiB. A few batches of fresh tokens show the routing (distinct
 * experts per batch) and the cache warming up (hits, misses, bytes from
 * host); the first batch's first tokens are checked against the CPU backend,
 * which reads the store's host tables as dense tensors. On the CPU backend
 * the problem shrinks (4096 experts, 4 heads, top-8, at most 32 tokens and
 * d_model 256) so the section stays well under a second. Weights are bf16;
 * the large tables repeat one random pattern (its length prime to the row
 * size), which keeps the fill to a second on a million experts. */
#include "demo.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { NBATCH = 4, CHECK_TOKENS = 4 };
#define PATTERN_ELEMS (((size_t)1 << 22) + 13)

typedef struct peer_case {
  cli_demo_env *env;
  smelt_peer_config cfg;
  smelt_dtype dt;
  int64_t T, din, dout, n, dq, H;
  smelt_peer_store *store;
  void *wq, *keys[2], *x[NBATCH], *y, *ids;
  smelt_tensor twq, tkeys[2];
  smelt_peer_weights w;
  smelt_plan *plan;
} peer_case;

static smelt_tensor view(smelt_ctx *ctx, void *p, smelt_dtype dt, int nd, int64_t a, int64_t b, int64_t c) {
  int64_t shape[3] = {a, b, c};
  return smelt_tensor_make(p, dt, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), nd, shape);
}

static void forward(peer_case *c, int batch) {
  smelt_ctx *ctx = c->env->ctx;
  smelt_tensor x = view(ctx, c->x[batch], c->dt, 2, c->T, c->din, 0);
  smelt_tensor y = view(ctx, c->y, c->dt, 2, c->T, c->dout, 0);
  smelt_tensor ids = view(ctx, c->ids, SMELT_DTYPE_I64, 3, c->T, c->H, c->cfg.num_experts_per_tok);
  if (!c->plan) CLI_TRY(smelt_peer_plan(ctx, &c->cfg, &c->w, &x, &c->plan));
  CLI_TRY(smelt_peer_forward_run(c->plan, &c->w, &x, &y, &ids, NULL));
}

static void run_one(void *user, int iter) { forward(user, iter % NBATCH); }

/* One timed forward of a chosen batch. */
typedef struct one_batch {
  peer_case *c;
  int batch;
} one_batch;

static void run_batch(void *user, int iter) {
  one_batch *o = user;
  (void)iter;
  forward(o->c, o->batch);
}

static void tile(void *dst, size_t n, size_t es, const void *pat) {
  for (size_t at = 0; at < n; at += PATTERN_ELEMS) {
    size_t m = n - at < PATTERN_ELEMS ? n - at : PATTERN_ELEMS;
    memcpy((char *)dst + at * es, pat, m * es);
  }
}

/* Checks the first tokens of batch 0 (y of the last forward of batch 0). */
static void check(peer_case *c, const void *hwq, void *const hkeys[2], const void *hx0, const void *hu,
                  const void *hv) {
  cli_demo_env *env = c->env;
  const size_t es = smelt_dtype_size(c->dt);
  const int64_t nc = c->T < CHECK_TOKENS ? c->T : CHECK_TOKENS, K = c->cfg.num_experts_per_tok;
  smelt_ctx *cpu = env->cpu;
  smelt_tensor wq = view(cpu, (void *)hwq, c->dt, 2, c->din, c->H * c->dq, 0), keys[2];
  smelt_tensor u = view(cpu, (void *)hu, c->dt, 3, c->cfg.num_experts, c->din, 1);
  smelt_tensor v = view(cpu, (void *)hv, c->dt, 3, c->cfg.num_experts, 1, c->dout);
  smelt_peer_weights w;
  memset(&w, 0, sizeof w);
  w.wq = &wq;
  for (int i = 0; i < 2; i++) {
    keys[i] = view(cpu, hkeys[i], c->dt, 2, c->n, c->dq / 2, 0);
    w.sub_keys[i] = &keys[i];
  }
  w.u = &u;
  w.v = &v;
  void *yref = cli_malloc((size_t)(nc * c->dout) * es), *ygot = cli_malloc((size_t)(nc * c->dout) * es);
  int64_t *iref = cli_malloc((size_t)(nc * c->H * K) * 8), *igot = cli_malloc((size_t)(nc * c->H * K) * 8);
  smelt_tensor x = view(cpu, (void *)hx0, c->dt, 2, nc, c->din, 0), y = view(cpu, yref, c->dt, 2, nc, c->dout, 0);
  smelt_tensor ids = view(cpu, iref, SMELT_DTYPE_I64, 3, nc, c->H, K);
  CLI_TRY(smelt_peer_forward(cpu, &c->cfg, &w, &x, &y, &ids, NULL));

  forward(c, 0);
  cli_dev_download(env->ctx, ygot, c->y, (size_t)(nc * c->dout) * es);
  cli_dev_download(env->ctx, igot, c->ids, (size_t)(nc * c->H * K) * 8);
  cli_diff dy = cli_compare(ygot, yref, c->dt, (size_t)(nc * c->dout));
  cli_diff di = cli_compare(igot, iref, SMELT_DTYPE_I64, (size_t)(nc * c->H * K));
  char label[32], note[96];
  snprintf(label, sizeof label, "%s y, %lld tok", smelt_dtype_name(c->dt), (long long)nc);
  snprintf(note, sizeof note, "forward through the store vs CPU on its host tables");
  cli_demo_row(env, label, &dy, cli_demo_bound(&dy, "peer", c->dt), c->dout, NULL, 0.0, note);
  snprintf(note, sizeof note, "%lld of %lld differ (near-equal scores may swap)", (long long)di.mismatches,
           (long long)(nc * c->H * K));
  cli_demo_row(env, "ids", &di, INFINITY, c->H * K, NULL, 0.0, note);
  free(yref);
  free(ygot);
  free(iref);
  free(igot);
}

void cli_demo_peer(cli_demo_env *env) {
  const int cuda = smelt_ctx_device(env->ctx) == SMELT_DEVICE_CUDA;
  peer_case c;
  memset(&c, 0, sizeof c);
  c.env = env;
  c.dt = SMELT_DTYPE_BF16;
  c.n = cuda ? 1024 : 64;
  c.H = cuda ? 8 : 4;
  c.dq = cuda ? 256 : 64;
  c.T = cuda ? env->tokens : (env->tokens < 32 ? env->tokens : 32);
  c.din = c.dout = cuda ? env->d_model : (env->d_model < 256 ? env->d_model : 256);
  const double cache_mb = cuda ? 512.0 : 1.0;
  c.cfg = smelt_peer_config_default();
  c.cfg.input_dim = c.din;
  c.cfg.output_dim = c.dout;
  c.cfg.num_experts = c.n * c.n;
  c.cfg.num_heads = c.H;
  c.cfg.num_experts_per_tok = cuda ? 16 : 8;
  c.cfg.query_dim = c.dq;
  const int64_t N = c.cfg.num_experts, K = c.cfg.num_experts_per_tok;
  const size_t es = smelt_dtype_size(c.dt);

  char shapes[192];
  snprintf(shapes, sizeof shapes,
           "x [%lld, %lld] -> y [%lld, %lld]; %lld experts (%lld^2), %lld heads, top-%lld, query %lld, "
           "store cache %.0f MiB",
           (long long)c.T, (long long)c.din, (long long)c.T, (long long)c.dout, (long long)N, (long long)c.n,
           (long long)c.H, (long long)K, (long long)c.dq, cache_mb);
  cli_demo_table("peer", shapes);

  /* Weights: unit-order scores and activations (see bench_peer.c). */
  const double aw = sqrt(3.0 / (double)c.din), ak = sqrt(3.0 / (double)(c.dq / 2));
  void *hwq = cli_malloc((size_t)(c.din * c.H * c.dq) * es), *hkeys[2], *hx[NBATCH];
  cli_fill_uniform(hwq, c.dt, (size_t)(c.din * c.H * c.dq), 0x5EED0601u, -aw, aw);
  for (int i = 0; i < 2; i++) {
    hkeys[i] = cli_malloc((size_t)(c.n * c.dq / 2) * es);
    cli_fill_uniform(hkeys[i], c.dt, (size_t)(c.n * c.dq / 2), 0x5EED0602u + (uint64_t)i, -ak, ak);
  }
  for (int b = 0; b < NBATCH; b++) {
    hx[b] = cli_malloc((size_t)(c.T * c.din) * es);
    cli_fill_uniform(hx[b], c.dt, (size_t)(c.T * c.din), 0x5EED0610u + (uint64_t)b, -1.0, 1.0);
    c.x[b] = cli_dev_upload(env->ctx, hx[b], (size_t)(c.T * c.din) * es);
  }
  void *pat = cli_malloc(PATTERN_ELEMS * es);

  smelt_peer_store_options o = smelt_peer_store_options_default();
  o.num_experts = N;
  o.input_dim = c.din;
  o.output_dim = c.dout;
  o.expert_hidden_size = 1;
  o.dtype = c.dt;
  o.cache_mb = cache_mb;
  o.use_env = 0;
  CLI_TRY(smelt_peer_store_create(env->ctx, &o, &c.store));
  smelt_tensor tu, tv;
  CLI_TRY(smelt_peer_store_tables(c.store, &tu, &tv));
  cli_fill_uniform(pat, c.dt, PATTERN_ELEMS, 0x5EED0603u, -aw, aw);
  tile(tu.data, (size_t)N * (size_t)c.din, es, pat);
  cli_fill_uniform(pat, c.dt, PATTERN_ELEMS, 0x5EED0604u, -1.0, 1.0);
  tile(tv.data, (size_t)N * (size_t)c.dout, es, pat);
  CLI_TRY(smelt_peer_store_invalidate(c.store));

  c.wq = cli_dev_upload(env->ctx, hwq, (size_t)(c.din * c.H * c.dq) * es);
  c.twq = view(env->ctx, c.wq, c.dt, 2, c.din, c.H * c.dq, 0);
  c.w.wq = &c.twq;
  for (int i = 0; i < 2; i++) {
    c.keys[i] = cli_dev_upload(env->ctx, hkeys[i], (size_t)(c.n * c.dq / 2) * es);
    c.tkeys[i] = view(env->ctx, c.keys[i], c.dt, 2, c.n, c.dq / 2, 0);
    c.w.sub_keys[i] = &c.tkeys[i];
  }
  c.w.store = c.store;
  c.y = cli_dev_alloc(env->ctx, (size_t)(c.T * c.dout) * es);
  c.ids = cli_dev_alloc(env->ctx, (size_t)(c.T * c.H * K) * 8);

  /* The batches, one forward each from a cold cache: routing and the store. */
  const double expert_bytes = (double)(c.T * c.H * K) * (double)(c.din + c.dout) * (double)es;
  printf("  routing and the store, one forward per batch from a cold cache, each batch twice:\n");
  printf("    %-6s %8s %9s %9s %9s %8s %11s %10s\n", "batch", "uses", "distinct", "hits", "misses", "hit%",
         "from host", "ms");
  smelt_peer_store_stats prev, s;
  CLI_TRY(smelt_peer_store_stats_get(c.store, &prev));
  for (int b = 0; b < 2 * NBATCH; b++) {
    one_batch ob = {&c, b % NBATCH};
    cli_timing t = cli_time_runs(env->ctx, 0, 1, run_batch, &ob);
    CLI_TRY(smelt_peer_store_stats_get(c.store, &s));
    const uint64_t look = s.lookups - prev.lookups, hits = s.hits - prev.hits;
    char host[32];
    printf("    %-6d %8llu %9llu %9llu %9llu %7.1f%% %11s %10.3f\n", b % NBATCH, (unsigned long long)(s.uses - prev.uses),
           (unsigned long long)look, (unsigned long long)hits, (unsigned long long)(look - hits),
           look ? 100.0 * (double)hits / (double)look : 0.0,
           cli_fmt_bytes(s.bytes_from_host - prev.bytes_from_host, host, sizeof host), t.median_ms);
    prev = s;
  }
  check(&c, hwq, hkeys, hx[0], tu.data, tv.data);

  /* Steady state: the batches in turn, the cache warm. */
  cli_timing t = cli_time_runs(env->ctx, env->warmup, env->iters, run_one, &c);
  cli_diff none = {0, 0, 0, 0};
  char note[160];
  snprintf(note, sizeof note, "expert rows read (%s)", smelt_plan_describe(c.plan));
  cli_demo_row(env, "forward, warm", &none, 0.0, 1, &t, expert_bytes, note);
  char report[1024];
  CLI_TRY(smelt_peer_store_report(c.store, report, sizeof report));
  for (char *line = strtok(report, "\n"); line; line = strtok(NULL, "\n")) printf("  %s\n", line);

  smelt_plan_destroy(c.plan);
  smelt_peer_store_destroy(c.store);
  void *bufs[] = {c.wq, c.keys[0], c.keys[1], c.y, c.ids};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CLI_TRY(smelt_free(env->ctx, bufs[i]));
  for (int b = 0; b < NBATCH; b++) {
    CLI_TRY(smelt_free(env->ctx, c.x[b]));
    free(hx[b]);
  }
  free(hwq);
  free(hkeys[0]);
  free(hkeys[1]);
  free(pat);
}
