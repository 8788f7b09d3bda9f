/* Threads, as include/smelt.h's rule allows them, on the CPU backend:
 * contexts used apart on several threads give the single-threaded results
 * bit for bit; one context handed from thread to thread between calls works;
 * a PEER store entered from two threads at once reports it instead of
 * racing. `make tsan` runs this suite under ThreadSanitizer, so a data race
 * on these paths fails CI. Workers only record what they saw; the main
 * thread checks it, since the harness itself is single-threaded. */
#include "harness.h"

#include <pthread.h>

enum { ROWS = 37, COLS = 29 };                                                   /* softmax */
enum { GM = 17, GK = 19, GN = 13 };                                              /* gemm */
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

/* A contiguous f32 view [d0, d1] of host memory. */
static smelt_tensor f32(const float *p, int64_t d0, int64_t d1) {
  const int64_t shape[2] = {d0, d1};
  return smelt_tensor_make((void *)p, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, shape);
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
  const smelt_peer_store_options o = {.num_experts = NEXP, .input_dim = DIN, .output_dim = DOUT,
                                      .expert_hidden_size = 1, .dtype = SMELT_DTYPE_F32,
                                      .cache_mb = 16.0 * (DIN + DOUT) * 4 / 1048576.0};
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
  c.input_dim = DIN, c.output_dim = DOUT, c.num_experts = NEXP, c.num_experts_per_tok = K;
  c.num_heads = H, c.expert_hidden_size = 1, c.query_dim = DQ, c.product_key_dims = 2;
  c.sub_key_sizes[0] = c.sub_key_sizes[1] = NSUB;
  return c;
}

/* The PEER weights' tensors (kept alive by the caller) and the weights over them. */
typedef struct peer_args {
  smelt_tensor x, wq, k0, k1;
  smelt_peer_weights w;
} peer_args;

static void peer_args_init(peer_args *p, smelt_peer_store *st) {
  p->x = f32(in.x, T, DIN);
  p->wq = f32(in.wq, DIN, H * DQ);
  p->k0 = f32(in.keys[0], NSUB, DQ / 2);
  p->k1 = f32(in.keys[1], NSUB, DQ / 2);
  memset(&p->w, 0, sizeof p->w);
  p->w.wq = &p->wq;
  p->w.sub_keys[0] = &p->k0;
  p->w.sub_keys[1] = &p->k1;
  p->w.store = st;
}

/* Softmax, GEMM and a PEER forward through st, one-shot, into o. */
static smelt_status run_all(smelt_ctx *ctx, smelt_peer_store *st, outputs *o) {
  smelt_tensor sx = f32(in.sx, ROWS, COLS), sy = f32(o->sy, ROWS, COLS);
  smelt_tensor a = f32(in.a, GM, GK), b = f32(in.b, GK, GN), d = f32(o->d, GM, GN);
  smelt_tensor y = f32(o->y, T, DOUT);
  peer_args p;
  peer_args_init(&p, st);
  const smelt_peer_config cfg = peer_cfg();
  smelt_status s = smelt_softmax(ctx, &sx, &sy, NULL);
  if (!s) s = smelt_gemm(ctx, NULL, &a, &b, NULL, &d, NULL);
  if (!s) s = smelt_peer_forward(ctx, &cfg, &p.w, &p.x, &y, NULL, NULL);
  return s;
}

/* What every test starts from: fresh inputs, a CPU context, a store on it
 * and the single-threaded results; the store's counters then reset. */
typedef struct fixture {
  smelt_ctx *ctx;
  smelt_peer_store *st;
  outputs ref;
} fixture;

static int fixture_init(fixture *f) {
  fill_inputs();
  f->ctx = cpu_ctx();
  f->st = f->ctx ? store_new(f->ctx) : NULL;
  return f->st && !run_all(f->ctx, f->st, &f->ref) && !smelt_peer_store_stats_reset(f->st);
}

static void fixture_free(fixture *f) {
  smelt_peer_store_destroy(f->st);
  smelt_ctx_destroy(f->ctx);
}

/* A worker: what it is given, and what it saw (its first failure's status
 * and message, how many of its runs ran, differed from the reference, or
 * met another thread inside the store). */
typedef struct worker {
  pthread_t thread;
  void (*body)(struct worker *w);
  const outputs *ref;
  smelt_plan *sm, *peer; /* shared plans (handed over) or its own */
  smelt_peer_store *store;
  pthread_mutex_t *turn; /* held while a worker uses the shared context */
  const smelt_tensor *ids;
  smelt_status status;
  char message[256];
  int ok, mismatches, overlaps;
} worker;

static void worker_failed(worker *w, smelt_status s) {
  if (w->status) return;
  w->status = s;
  snprintf(w->message, sizeof w->message, "%s", smelt_last_error());
}

/* A store call that failed: 1 if for meeting another thread inside the
 * store, else 0 with the failure recorded. */
static int overlapped(worker *w, smelt_status s) {
  if (s == SMELT_STATUS_INVALID_ARGUMENT && strstr(smelt_last_error(), "used from two threads at once")) return 1;
  worker_failed(w, s);
  return 0;
}

static int same(const outputs *a, const outputs *b) { return !memcmp(a, b, sizeof *a); }

/* Workers finished in the current run_workers (atomic; one run at a time,
 * as the suite runs its tests one after another). */
static int workers_done;

static void *worker_main(void *arg) {
  worker *w = (worker *)arg;
  w->body(w);
  __atomic_add_fetch(&workers_done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* Starts n workers; while they run, reads the counters of `read` (unless
 * NULL) on this thread; joins them and checks what they saw. Returns how
 * many overlaps this thread and the workers met. */
static int run_workers(worker *w, int n, smelt_peer_store *read) {
  int started = 0, met = 0;
  __atomic_store_n(&workers_done, 0, __ATOMIC_RELAXED);
  while (started < n && pthread_create(&w[started].thread, NULL, worker_main, &w[started]) == 0) started++;
  CHECK_EQ_INT(started, n);
  while (read && __atomic_load_n(&workers_done, __ATOMIC_ACQUIRE) < started) {
    smelt_peer_store_stats c;
    smelt_status s = smelt_peer_store_stats_get(read, &c);
    if (s) met += overlapped(&w[0], s);
  }
  for (int i = 0; i < started; i++) {
    pthread_join(w[i].thread, NULL);
    if (w[i].status)
      th_fail(__FILE__, __LINE__, "worker %d: %s (%s)", i, smelt_status_name(w[i].status), w[i].message);
    CHECK_EQ_INT(w[i].mismatches, 0);
    met += w[i].overlaps;
  }
  return met;
}

/* ---- contexts apart: each thread its own context and store */

static void apart_body(worker *w) {
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
}

static void test_contexts_apart(void) {
  static fixture f;
  REQUIRE(fixture_init(&f));
  worker w[WORKERS];
  for (int i = 0; i < WORKERS; i++) w[i] = (worker){.body = apart_body, .ref = &f.ref};
  run_workers(w, WORKERS, NULL);
  fixture_free(&f);
}

/* ---- one context handed between threads: plans made on the main thread,
 * run by each worker in turn */

static void handed_body(worker *w) {
  smelt_tensor sx = f32(in.sx, ROWS, COLS);
  for (int r = 0; r < ROUNDS; r++) {
    outputs o;
    memcpy(&o, w->ref, sizeof o); /* gemm is not run here: its part stays the reference's */
    smelt_tensor sy = f32(o.sy, ROWS, COLS), y = f32(o.y, T, DOUT);
    peer_args p;
    peer_args_init(&p, w->store);
    pthread_mutex_lock(w->turn);
    smelt_status s = smelt_softmax_run(w->sm, &sx, &sy, NULL);
    if (!s) s = smelt_peer_forward_run(w->peer, &p.w, &p.x, &y, NULL, NULL);
    pthread_mutex_unlock(w->turn);
    if (s) worker_failed(w, s);
    else w->mismatches += !same(&o, w->ref);
  }
}

static void test_context_handed_over(void) {
  static fixture f;
  REQUIRE(fixture_init(&f));
  smelt_tensor sx = f32(in.sx, ROWS, COLS), sy = f32(f.ref.sy, ROWS, COLS);
  peer_args p;
  peer_args_init(&p, f.st);
  const smelt_peer_config cfg = peer_cfg();
  smelt_plan *sm = NULL, *pp = NULL;
  CHECK_OK(smelt_softmax_plan(f.ctx, &sx, &sy, NULL, &sm));
  CHECK_OK(smelt_peer_plan(f.ctx, &cfg, &p.w, &p.x, &pp));
  pthread_mutex_t turn = PTHREAD_MUTEX_INITIALIZER;
  worker w[WORKERS];
  for (int i = 0; i < WORKERS; i++)
    w[i] = (worker){.body = handed_body, .ref = &f.ref, .sm = sm, .peer = pp, .store = f.st, .turn = &turn};
  if (sm && pp) run_workers(w, WORKERS, NULL);
  smelt_peer_store_stats c;
  CHECK_OK(smelt_peer_store_stats_get(f.st, &c));
  CHECK_EQ_INT(c.batches, WORKERS * ROUNDS);
  CHECK_EQ_INT(c.uses, (int64_t)WORKERS * ROUNDS * T * H * K);
  smelt_plan_destroy(sm);
  smelt_plan_destroy(pp);
  fixture_free(&f);
}

/* ---- a store from several threads at once: the main thread reads the
 * counters while workers run batches, until some call has met another
 * inside the store; each call either ran or failed with the misuse error
 * (having changed nothing), and the counters count exactly the batches
 * that ran. */

static void prefetch_body(worker *w) {
  smelt_status s = smelt_peer_store_prefetch(w->store, w->ids);
  if (!s) w->ok++;
  else w->overlaps += overlapped(w, s);
}

static void test_store_prefetch_overlap(void) {
  static fixture f;
  REQUIRE(fixture_init(&f));
  enum { NIDS = 1 << 17 }; /* a batch long enough to be met */
  int64_t *ids = (int64_t *)malloc(NIDS * sizeof(int64_t));
  REQUIRE(ids != NULL);
  for (int i = 0; i < NIDS; i++) ids[i] = (int64_t)(th_rand_u64() % NEXP);
  const int64_t shape[1] = {NIDS};
  const smelt_tensor tids = smelt_tensor_make(ids, SMELT_DTYPE_I64, SMELT_DEVICE_CPU, 0, 1, shape);
  worker w = {.body = prefetch_body, .store = f.st, .ids = &tids};
  int met = 0;
  for (int round = 0; round < 40 && !met && !w.status; round++) met += run_workers(&w, 1, f.st);
  CHECK(met > 0);
  smelt_peer_store_stats c;
  CHECK_OK(smelt_peer_store_stats_get(f.st, &c));
  CHECK_EQ_INT(c.batches, w.ok);
  CHECK_EQ_INT(c.uses, (int64_t)w.ok * NIDS);
  free(ids);
  fixture_free(&f);
}

static void forward_body(worker *w) {
  for (int r = 0; r < 8 * ROUNDS; r++) {
    outputs o;
    memcpy(&o, w->ref, sizeof o);
    memset(o.y, 0xFF, sizeof o.y);
    smelt_tensor y = f32(o.y, T, DOUT);
    peer_args p;
    peer_args_init(&p, w->store);
    smelt_status s = smelt_peer_forward_run(w->peer, &p.w, &p.x, &y, NULL, NULL);
    if (!s) {
      w->ok++;
      w->mismatches += !same(&o, w->ref);
    } else if (overlapped(w, s)) {
      w->overlaps++;
      w->mismatches += !th_all_ff(o.y, sizeof o.y); /* failed: wrote nothing */
    }
  }
}

/* Two workers run forwards (each its own plan) through the store: a
 * forward that ran is the reference's, one that met another thread failed
 * before writing y. */
static void test_store_forward_overlap(void) {
  static fixture f;
  REQUIRE(fixture_init(&f));
  peer_args p;
  peer_args_init(&p, f.st);
  const smelt_peer_config cfg = peer_cfg();
  worker w[2];
  int met = 0;
  for (int i = 0; i < 2; i++) {
    w[i] = (worker){.body = forward_body, .ref = &f.ref, .store = f.st};
    CHECK_OK(smelt_peer_plan(f.ctx, &cfg, &p.w, &p.x, &w[i].peer));
  }
  for (int round = 0; round < 40 && w[0].peer && w[1].peer && !met && !w[0].status && !w[1].status; round++)
    met += run_workers(w, 2, f.st);
  CHECK(met > 0);
  smelt_peer_store_stats c;
  CHECK_OK(smelt_peer_store_stats_get(f.st, &c));
  CHECK_EQ_INT(c.batches, w[0].ok + w[1].ok);
  for (int i = 0; i < 2; i++) smelt_plan_destroy(w[i].peer);
  fixture_free(&f);
}

const th_test th_tests_threads[] = {
    {"contexts_apart", test_contexts_apart},
    {"context_handed_over", test_context_handed_over},
    {"store_prefetch_overlap", test_store_prefetch_overlap},
    {"store_forward_overlap", test_store_forward_overlap},
    {0, 0},
};
