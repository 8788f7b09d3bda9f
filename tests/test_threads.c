/* Threads, as include/smelt.h's rule allows them, on the CPU backend:
 * contexts used apart on several threads give the single-threaded results
 * bit for bit; one context handed from thread to thread between calls works;
 * a PEER store entered from two threads at once reports it instead of
 * racing. `make tsan` runs this suite under ThreadSanitizer, so a data race
 * on these paths fails CI. Workers only record what they saw; the main
 * thread checks it, since the harness itself is single-threaded. */
#include "harness.h"

#include <pthread.h>

enum { ROWS = 37, COLS = 29 };                           /* softmax */
enum { GM = 17, GK = 19, GN = 13 };                      /* gemm */
enum { T = 24, DIN = 16, DOUT = 8, NSUB = 8, H = 2, DQ = 8, K = 4, NEXP = NSUB * NSUB }; /* peer, p = 2 */
enum { WORKERS = 3, ROUNDS = 4 };

/* The inputs every thread reads (filled once, before any thread starts). */
static struct {
  float sx[ROWS * COLS], a[GM * GK], b[GK * GN];
  float x[T * DIN], wq[DIN * H * DQ], keys[2][NSUB * DQ / 2], u[NEXP * DIN], v[NEXP * DOUT];
} in;

typedef struct outputs {
  float sy[ROWS * COLS], d[GM * GN], y[T * DOUT];
} outputs;

static void fill_inputs(void) {
  th_fill_uniform(in.sx, SMELT_DTYPE_F32, ROWS * COLS, -4, 4);
  th_fill_uniform(in.a, SMELT_DTYPE_F32, GM * GK, -1, 1);
  th_fill_uniform(in.b, SMELT_DTYPE_F32, GK * GN, -1, 1);
  th_fill_uniform(in.x, SMELT_DTYPE_F32, T * DIN, -1, 1);
  th_fill_uniform(in.wq, SMELT_DTYPE_F32, DIN * H * DQ, -1, 1);
  th_fill_uniform(in.keys, SMELT_DTYPE_F32, 2 * NSUB * DQ / 2, -1, 1);
  th_fill_uniform(in.u, SMELT_DTYPE_F32, NEXP * DIN, -1, 1);
  th_fill_uniform(in.v, SMELT_DTYPE_F32, NEXP * DOUT, -1, 1);
}

static smelt_tensor f32(const float *p, int ndim, int64_t d0, int64_t d1) {
  const int64_t shape[2] = {d0, d1};
  return smelt_tensor_make((void *)p, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, ndim, shape);
}

static smelt_ctx *cpu_ctx(void) {
  smelt_ctx_options o = smelt_ctx_options_default();
  o.use_env = 0;
  smelt_ctx *ctx = NULL;
  return smelt_ctx_create(&ctx, &o) ? NULL : ctx;
}

/* A store of the experts in.u, in.v with a cache of 16 of them (so batches
 * evict), or NULL. */
static smelt_peer_store *store_new(smelt_ctx *ctx) {
  smelt_peer_store_options o = smelt_peer_store_options_default();
  o.num_experts = NEXP;
  o.input_dim = DIN;
  o.output_dim = DOUT;
  o.expert_hidden_size = 1;
  o.dtype = SMELT_DTYPE_F32;
  o.cache_mb = 16.0 * (DIN + DOUT) * 4 / 1048576.0;
  o.use_env = 0;
  smelt_peer_store *st = NULL;
  if (smelt_peer_store_create(ctx, &o, &st)) return NULL;
  if (smelt_peer_store_write(st, 0, NEXP, in.u, in.v)) {
    smelt_peer_store_destroy(st);
    return NULL;
  }
  return st;
}

static smelt_peer_config peer_cfg(void) {
  smelt_peer_config c = smelt_peer_config_default();
  c.input_dim = DIN;
  c.output_dim = DOUT;
  c.num_experts = NEXP;
  c.num_experts_per_tok = K;
  c.num_heads = H;
  c.expert_hidden_size = 1;
  c.query_dim = DQ;
  c.product_key_dims = 2;
  c.sub_key_sizes[0] = c.sub_key_sizes[1] = NSUB;
  return c;
}

/* The PEER weights' tensors (kept alive by the caller) and the weights over them. */
typedef struct peer_args {
  smelt_tensor x, wq, k0, k1;
  smelt_peer_weights w;
} peer_args;

static void peer_args_init(peer_args *p, smelt_peer_store *st) {
  p->x = f32(in.x, 2, T, DIN);
  p->wq = f32(in.wq, 2, DIN, H * DQ);
  p->k0 = f32(in.keys[0], 2, NSUB, DQ / 2);
  p->k1 = f32(in.keys[1], 2, NSUB, DQ / 2);
  memset(&p->w, 0, sizeof p->w);
  p->w.wq = &p->wq;
  p->w.sub_keys[0] = &p->k0;
  p->w.sub_keys[1] = &p->k1;
  p->w.store = st;
}

/* Softmax, GEMM and a PEER forward through st, one-shot, into o. */
static smelt_status run_all(smelt_ctx *ctx, smelt_peer_store *st, outputs *o) {
  smelt_tensor sx = f32(in.sx, 2, ROWS, COLS), sy = f32(o->sy, 2, ROWS, COLS);
  smelt_tensor a = f32(in.a, 2, GM, GK), b = f32(in.b, 2, GK, GN), d = f32(o->d, 2, GM, GN);
  smelt_tensor y = f32(o->y, 2, T, DOUT);
  peer_args p;
  peer_args_init(&p, st);
  const smelt_peer_config cfg = peer_cfg();
  smelt_status s = smelt_softmax(ctx, &sx, &sy, NULL);
  if (!s) s = smelt_gemm(ctx, NULL, &a, &b, NULL, &d, NULL);
  if (!s) s = smelt_peer_forward(ctx, &cfg, &p.w, &p.x, &y, NULL, NULL);
  return s;
}

/* What a worker saw: its first failure's status and message, and how many
 * of its runs differed from the reference. */
typedef struct worker {
  pthread_t thread;
  const outputs *ref;
  smelt_plan *sm, *peer;  /* shared plans (handed over) */
  smelt_peer_store *store;
  pthread_mutex_t *turn; /* held while a worker uses the shared context */
  smelt_status status;
  char message[256];
  int mismatches, ok;
} worker;

static void worker_failed(worker *w, smelt_status s) {
  if (w->status) return;
  w->status = s;
  snprintf(w->message, sizeof w->message, "%s", smelt_last_error());
}

static int same(const outputs *a, const outputs *b) { return !memcmp(a, b, sizeof *a); }

static void check_workers(const worker *w, int n) {
  for (int i = 0; i < n; i++) {
    if (w[i].status)
      th_fail(__FILE__, __LINE__, "worker %d: %s (%s)", i, smelt_status_name(w[i].status), w[i].message);
    CHECK_EQ_INT(w[i].mismatches, 0);
  }
}

/* ---- contexts apart: each thread its own context and store */

static void *apart_main(void *arg) {
  worker *w = (worker *)arg;
  smelt_ctx *ctx = cpu_ctx();
  smelt_peer_store *st = ctx ? store_new(ctx) : NULL;
  if (!st) worker_failed(w, SMELT_STATUS_INTERNAL);
  for (int r = 0; st && r < ROUNDS; r++) {
    outputs o;
    smelt_status s = run_all(ctx, st, &o);
    if (s) worker_failed(w, s);
    else w->mismatches += !same(&o, w->ref);
  }
  smelt_peer_store_destroy(st);
  smelt_ctx_destroy(ctx);
  return NULL;
}

static void test_contexts_apart(void) {
  fill_inputs();
  smelt_ctx *ctx = cpu_ctx();
  smelt_peer_store *st = ctx ? store_new(ctx) : NULL;
  REQUIRE(st != NULL);
  static outputs ref;
  CHECK_OK(run_all(ctx, st, &ref));
  worker w[WORKERS];
  memset(w, 0, sizeof w);
  for (int i = 0; i < WORKERS; i++) {
    w[i].ref = &ref;
    REQUIRE(pthread_create(&w[i].thread, NULL, apart_main, &w[i]) == 0);
  }
  for (int i = 0; i < WORKERS; i++) pthread_join(w[i].thread, NULL);
  check_workers(w, WORKERS);
  smelt_peer_store_destroy(st);
  smelt_ctx_destroy(ctx);
}

/* ---- one context handed between threads: plans made on the main thread,
 * run by each worker in turn */

static void *handed_main(void *arg) {
  worker *w = (worker *)arg;
  smelt_tensor sx = f32(in.sx, 2, ROWS, COLS);
  for (int r = 0; r < ROUNDS; r++) {
    outputs o;
    memcpy(&o, w->ref, sizeof o); /* gemm is not run here: its part stays the reference's */
    smelt_tensor sy = f32(o.sy, 2, ROWS, COLS), y = f32(o.y, 2, T, DOUT);
    peer_args p;
    peer_args_init(&p, w->store);
    pthread_mutex_lock(w->turn);
    smelt_status s = smelt_softmax_run(w->sm, &sx, &sy, NULL);
    if (!s) s = smelt_peer_forward_run(w->peer, &p.w, &p.x, &y, NULL, NULL);
    pthread_mutex_unlock(w->turn);
    if (s) worker_failed(w, s);
    else w->mismatches += !same(&o, w->ref);
  }
  return NULL;
}

static void test_context_handed_over(void) {
  fill_inputs();
  smelt_ctx *ctx = cpu_ctx();
  smelt_peer_store *st = ctx ? store_new(ctx) : NULL;
  REQUIRE(st != NULL);
  static outputs ref;
  CHECK_OK(run_all(ctx, st, &ref));
  smelt_tensor sx = f32(in.sx, 2, ROWS, COLS), sy = f32(ref.sy, 2, ROWS, COLS);
  peer_args p;
  peer_args_init(&p, st);
  const smelt_peer_config cfg = peer_cfg();
  smelt_plan *sm = NULL, *pp = NULL;
  CHECK_OK(smelt_softmax_plan(ctx, &sx, &sy, NULL, &sm));
  CHECK_OK(smelt_peer_plan(ctx, &cfg, &p.w, &p.x, &pp));
  CHECK_OK(smelt_peer_store_stats_reset(st));
  pthread_mutex_t turn = PTHREAD_MUTEX_INITIALIZER;
  worker w[WORKERS];
  memset(w, 0, sizeof w);
  for (int i = 0; sm && pp && i < WORKERS; i++) {
    w[i] = (worker){.ref = &ref, .sm = sm, .peer = pp, .store = st, .turn = &turn};
    REQUIRE(pthread_create(&w[i].thread, NULL, handed_main, &w[i]) == 0);
  }
  for (int i = 0; sm && pp && i < WORKERS; i++) pthread_join(w[i].thread, NULL);
  check_workers(w, WORKERS);
  smelt_peer_store_stats c;
  CHECK_OK(smelt_peer_store_stats_get(st, &c));
  CHECK_EQ_INT(c.batches, WORKERS * ROUNDS);
  CHECK_EQ_INT(c.uses, (int64_t)WORKERS * ROUNDS * T * H * K);
  smelt_plan_destroy(sm);
  smelt_plan_destroy(pp);
  smelt_peer_store_destroy(st);
  smelt_ctx_destroy(ctx);
}

/* ---- a store from two threads at once: each call either runs or fails
 * with the misuse error, and the counters count exactly the calls that ran */

/* A call that failed for the overlap: 1; failed otherwise: records it. */
static int overlapped(worker *w, smelt_status s) {
  if (s == SMELT_STATUS_INVALID_ARGUMENT && strstr(smelt_last_error(), "used from two threads at once")) return 1;
  worker_failed(w, s);
  return 0;
}

typedef struct prefetcher {
  worker w;
  const smelt_tensor *ids;
  int done; /* atomic: the prefetch returned */
  int overlaps;
} prefetcher;

static void *prefetch_main(void *arg) {
  prefetcher *p = (prefetcher *)arg;
  smelt_status s = smelt_peer_store_prefetch(p->w.store, p->ids);
  if (!s) p->w.ok++;
  else p->overlaps += overlapped(&p->w, s);
  __atomic_store_n(&p->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* The main thread reads the counters while a worker runs long batches,
 * until one of the two has met the other inside the store. */
static void test_store_prefetch_overlap(void) {
  fill_inputs();
  smelt_ctx *ctx = cpu_ctx();
  smelt_peer_store *st = ctx ? store_new(ctx) : NULL;
  REQUIRE(st != NULL);
  enum { NIDS = 1 << 17 };
  int64_t *ids = (int64_t *)malloc(NIDS * sizeof(int64_t));
  REQUIRE(ids != NULL);
  for (int i = 0; i < NIDS; i++) ids[i] = (int64_t)(th_rand_u64() % NEXP);
  const int64_t shape[1] = {NIDS};
  const smelt_tensor tids = smelt_tensor_make(ids, SMELT_DTYPE_I64, SMELT_DEVICE_CPU, 0, 1, shape);
  prefetcher p;
  memset(&p, 0, sizeof p);
  p.w.store = st;
  p.ids = &tids;
  int seen = 0; /* overlaps the main thread met */
  for (int round = 0; round < 40 && !seen && !p.overlaps && !p.w.status; round++) {
    __atomic_store_n(&p.done, 0, __ATOMIC_RELAXED);
    REQUIRE(pthread_create(&p.w.thread, NULL, prefetch_main, &p) == 0);
    while (!__atomic_load_n(&p.done, __ATOMIC_ACQUIRE)) {
      smelt_peer_store_stats c;
      smelt_status s = smelt_peer_store_stats_get(st, &c);
      if (s) seen += overlapped(&p.w, s);
    }
    pthread_join(p.w.thread, NULL);
  }
  check_workers(&p.w, 1);
  CHECK(seen + p.overlaps > 0);
  smelt_peer_store_stats c;
  CHECK_OK(smelt_peer_store_stats_get(st, &c));
  CHECK_EQ_INT(c.batches, p.w.ok);
  CHECK_EQ_INT(c.uses, (int64_t)p.w.ok * NIDS);
  free(ids);
  smelt_peer_store_destroy(st);
  smelt_ctx_destroy(ctx);
}

static void *forward_main(void *arg) {
  worker *w = (worker *)arg;
  for (int r = 0; r < 8 * ROUNDS; r++) {
    outputs o;
    memcpy(&o, w->ref, sizeof o);
    memset(o.y, 0xFF, sizeof o.y);
    smelt_tensor y = f32(o.y, 2, T, DOUT);
    peer_args p;
    peer_args_init(&p, w->store);
    smelt_status s = smelt_peer_forward_run(w->peer, &p.w, &p.x, &y, NULL, NULL);
    if (!s) {
      w->ok++;
      w->mismatches += !same(&o, w->ref);
    } else if (overlapped(w, s)) {
      w->mismatches += !th_all_ff(o.y, sizeof o.y); /* failed: wrote nothing */
    }
  }
  return NULL;
}

/* Two threads run forwards (each its own plan) through one store at once:
 * every forward that ran is the reference's, every one that met the other
 * failed before writing y. */
static void test_store_forward_overlap(void) {
  fill_inputs();
  smelt_ctx *ctx = cpu_ctx();
  smelt_peer_store *st = ctx ? store_new(ctx) : NULL;
  REQUIRE(st != NULL);
  static outputs ref;
  CHECK_OK(run_all(ctx, st, &ref));
  CHECK_OK(smelt_peer_store_stats_reset(st));
  peer_args p;
  peer_args_init(&p, st);
  const smelt_peer_config cfg = peer_cfg();
  worker w[2];
  memset(w, 0, sizeof w);
  for (int i = 0; i < 2; i++) {
    w[i].ref = &ref;
    w[i].store = st;
    CHECK_OK(smelt_peer_plan(ctx, &cfg, &p.w, &p.x, &w[i].peer));
  }
  for (int i = 0; w[0].peer && w[1].peer && i < 2; i++)
    REQUIRE(pthread_create(&w[i].thread, NULL, forward_main, &w[i]) == 0);
  for (int i = 0; w[0].peer && w[1].peer && i < 2; i++) pthread_join(w[i].thread, NULL);
  check_workers(w, 2);
  smelt_peer_store_stats c;
  CHECK_OK(smelt_peer_store_stats_get(st, &c));
  CHECK_EQ_INT(c.batches, w[0].ok + w[1].ok);
  for (int i = 0; i < 2; i++) smelt_plan_destroy(w[i].peer);
  smelt_peer_store_destroy(st);
  smelt_ctx_destroy(ctx);
}

const th_test th_tests_threads[] = {
    {"contexts_apart", test_contexts_apart},
    {"context_handed_over", test_context_handed_over},
    {"store_prefetch_overlap", test_store_prefetch_overlap},
    {"store_forward_overlap", test_store_forward_overlap},
    {0, 0},
};
