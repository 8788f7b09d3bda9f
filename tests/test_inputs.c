/* What a new user's first inputs met (issue 26): allocations larger than
 * the machine refused before they are attempted, empty views with the
 * strides numpy gives them (all 0) accepted by every op, environment
 * variables with values the library does not know refused by name, and
 * warnings printed by default. */
#include "core/internal.h"
#include "harness.h"

#include <unistd.h>

/* More bytes than this machine's physical memory. */
static size_t beyond_host(void) {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return ((size_t)pages + 1) * (size_t)page;
}

static void test_alloc_beyond_host(void) {
  void *p = (void *)1;
  CHECK_STATUS(smelt_alloc(th_cpu(), beyond_host(), &p), SMELT_STATUS_OUT_OF_MEMORY);
  CHECK(p == NULL);
  CHECK_MSG("smelt_alloc");
  char bytes[48];
  snprintf(bytes, sizeof bytes, "%zu bytes", beyond_host());
  CHECK_MSG(bytes);
  CHECK_MSG("more than this machine's");
  CHECK_OK(smelt_alloc(th_cpu(), 4096, &p));
  CHECK_OK(smelt_free(th_cpu(), p));
}

static void test_peer_store_beyond_host(void) {
  smelt_peer_store_options o = smelt_peer_store_options_default();
  o.use_env = 0;
  o.num_experts = (int64_t)1 << 30;
  o.input_dim = o.output_dim = 1 << 12;
  o.expert_hidden_size = 1;
  o.dtype = SMELT_DTYPE_F32;
  smelt_peer_store *st = NULL;
  CHECK_STATUS(smelt_peer_store_create(th_cpu(), &o, &st), SMELT_STATUS_OUT_OF_MEMORY);
  CHECK(st == NULL);
  CHECK_MSG("host tables");
}

/* An empty view as numpy hands it over: every stride 0, no data. */
static smelt_tensor empty_view(smelt_dtype dt, int ndim, const int64_t *shape) {
  smelt_tensor t = smelt_tensor_make(NULL, dt, SMELT_DEVICE_CPU, 0, ndim, shape);
  memset(t.strides, 0, sizeof t.strides);
  return t;
}

static void test_empty_views_contiguous(void) {
  smelt_tensor t = empty_view(SMELT_DTYPE_F32, 3, (int64_t[]){4, 0, 8});
  CHECK(smelt_tensor_is_contiguous(&t));
  t.strides[2] = -3;
  CHECK(smelt_tensor_is_contiguous(&t));
}

/* q and o with no rows against k, v with some: o and lse stay empty. */
static void test_attention_empty_zero_strides(void) {
  float kv[1 * 3 * 2 * 8];
  for (size_t i = 0; i < sizeof kv / sizeof *kv; i++) kv[i] = (float)th_rand_uniform(-1, 1);
  smelt_tensor q = empty_view(SMELT_DTYPE_F32, 4, (int64_t[]){1, 0, 2, 8});
  smelt_tensor o = empty_view(SMELT_DTYPE_F32, 4, (int64_t[]){1, 0, 2, 8});
  smelt_tensor lse = empty_view(SMELT_DTYPE_F32, 3, (int64_t[]){1, 2, 0});
  smelt_tensor k = smelt_tensor_make(kv, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 4, (int64_t[]){1, 3, 2, 8});
  smelt_attention_desc d = smelt_attention_desc_default();
  CHECK_OK(smelt_attention_fwd(th_cpu(), &d, &q, &k, &k, &o, &lse));
  /* A plan made for the empty q runs with other strides for it. */
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_attention_fwd_plan(th_cpu(), &d, &q, &k, &k, &o, &lse, &plan));
  smelt_tensor q2 = smelt_tensor_make(NULL, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 4, (int64_t[]){1, 0, 2, 8});
  CHECK_OK(smelt_attention_fwd_run(plan, &q2, &k, &k, &o, &lse));
  smelt_plan_destroy(plan);
  /* Varlen: one sequence with no queries. */
  int32_t cu[2] = {0, 0}, cuk[2] = {0, 3};
  smelt_tensor cq = smelt_tensor_make(cu, SMELT_DTYPE_I32, SMELT_DEVICE_CPU, 0, 1, (int64_t[]){2});
  smelt_tensor ck = smelt_tensor_make(cuk, SMELT_DTYPE_I32, SMELT_DEVICE_CPU, 0, 1, (int64_t[]){2});
  smelt_tensor vq = empty_view(SMELT_DTYPE_F32, 3, (int64_t[]){0, 2, 8});
  smelt_tensor vo = empty_view(SMELT_DTYPE_F32, 3, (int64_t[]){0, 2, 8});
  smelt_tensor vk = smelt_tensor_make(kv, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){3, 2, 8});
  d.max_seqlen_q = 0;
  d.max_seqlen_k = 3;
  CHECK_OK(smelt_attention_varlen_fwd(th_cpu(), &d, &vq, &vk, &vk, &cq, &ck, &vo, NULL));
}

/* The same on CUDA (bf16, D 64): q, o, lse, dq empty with zero strides and
 * no data, k and v real; the forward writes nothing, the backward zeros dk
 * and dv (no query reads a key) and leaves their guards alone. */
static void test_gpu_attention_empty_zero_strides(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  enum { SK = 5, H = 2, D = 64, N = SK * H * D };
  uint16_t host[N];
  for (int i = 0; i < N; i++) host[i] = smelt_f32_to_bf16((float)th_rand_uniform(-1, 1));
  th_buf kb = th_buf_new(cu, sizeof host), dkb = th_buf_new(cu, sizeof host), dvb = th_buf_new(cu, sizeof host);
  th_buf_upload(&kb, host, sizeof host);
  smelt_tensor q = empty_view(SMELT_DTYPE_BF16, 4, (int64_t[]){1, 0, H, D});
  smelt_tensor o = q, d_o = q, dq = q;
  smelt_tensor lse = empty_view(SMELT_DTYPE_F32, 3, (int64_t[]){1, H, 0});
  q.device = o.device = d_o.device = dq.device = lse.device = SMELT_DEVICE_CUDA;
  smelt_tensor k = smelt_tensor_make(kb.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CUDA, 0, 4, (int64_t[]){1, SK, H, D});
  smelt_tensor dk = k, dv = k;
  dk.data = dkb.data;
  dv.data = dvb.data;
  smelt_attention_desc d = smelt_attention_desc_default();
  CHECK_OK(smelt_attention_fwd(cu, &d, &q, &k, &k, &o, &lse));
  CHECK_OK(smelt_attention_bwd(cu, &d, &q, &k, &k, &o, &d_o, &lse, &dq, &dk, &dv));
  CHECK_OK(smelt_ctx_synchronize(cu));
  uint16_t got[N];
  th_buf_download(&dkb, got, sizeof got);
  for (int i = 0; i < N; i++) CHECK(smelt_bf16_to_f32(got[i]) == 0.0f);
  th_buf_download(&dvb, got, sizeof got);
  for (int i = 0; i < N; i++) CHECK(smelt_bf16_to_f32(got[i]) == 0.0f);
  CHECK(th_buf_guards_ok(&dkb) && th_buf_guards_ok(&dvb));
  th_buf_free(&kb);
  th_buf_free(&dkb);
  th_buf_free(&dvb);
}

/* PEER over no tokens: x, y, ids and scores empty with zero strides. */
static void test_peer_empty_zero_strides(void) {
  enum { DIN = 6, DOUT = 5, H = 2, DQ = 4, NK = 3, K = 2 };
  float wq[DIN * H * DQ], keys[2][NK * DQ / 2], u[NK * NK * DIN], v[NK * NK * DOUT];
  th_fill_uniform(wq, SMELT_DTYPE_F32, DIN * H * DQ, -1, 1);
  th_fill_uniform(keys, SMELT_DTYPE_F32, 2 * NK * DQ / 2, -1, 1);
  th_fill_uniform(u, SMELT_DTYPE_F32, NK * NK * DIN, -1, 1);
  th_fill_uniform(v, SMELT_DTYPE_F32, NK * NK * DOUT, -1, 1);
  smelt_tensor twq = smelt_tensor_make(wq, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){DIN, H * DQ});
  smelt_tensor tk[2];
  for (int i = 0; i < 2; i++)
    tk[i] = smelt_tensor_make(keys[i], SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){NK, DQ / 2});
  smelt_tensor tu = smelt_tensor_make(u, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){NK * NK, DIN, 1});
  smelt_tensor tv = smelt_tensor_make(v, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){NK * NK, 1, DOUT});
  smelt_peer_weights w = {.wq = &twq, .sub_keys = {&tk[0], &tk[1]}, .u = &tu, .v = &tv};
  smelt_peer_config cfg = smelt_peer_config_default();
  cfg.input_dim = DIN;
  cfg.output_dim = DOUT;
  cfg.num_experts = NK * NK;
  cfg.num_experts_per_tok = K;
  cfg.num_heads = H;
  cfg.query_dim = DQ;
  cfg.product_key_dims = 2;
  smelt_tensor x = empty_view(SMELT_DTYPE_F32, 2, (int64_t[]){0, DIN});
  smelt_tensor y = empty_view(SMELT_DTYPE_F32, 2, (int64_t[]){0, DOUT});
  smelt_tensor ids = empty_view(SMELT_DTYPE_I64, 3, (int64_t[]){0, H, K});
  smelt_tensor scores = empty_view(SMELT_DTYPE_F32, 3, (int64_t[]){0, H, K});
  CHECK_OK(smelt_peer_forward(th_cpu(), &cfg, &w, &x, &y, &ids, &scores));
  CHECK_OK(smelt_peer_retrieve(th_cpu(), &cfg, &w, &x, &ids, &scores));
  float dwq[DIN * H * DQ];
  memset(dwq, 0xFF, sizeof dwq);
  smelt_tensor tdwq = smelt_tensor_make(dwq, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){DIN, H * DQ});
  smelt_tensor dx = empty_view(SMELT_DTYPE_F32, 2, (int64_t[]){0, DIN});
  smelt_peer_grads g = {.dx = &dx, .dwq = &tdwq};
  CHECK_OK(smelt_peer_backward(th_cpu(), &cfg, &w, &x, &ids, &y, &g));
  /* No tokens: the weight gradient is all zeros. */
  for (int i = 0; i < DIN * H * DQ; i++) CHECK(dwq[i] == 0.0f);
}

/* Sets name=value (NULL unsets), keeping the old value in keep[] for
 * env_restore. */
static void env_set(const char *name, const char *value, char *keep, size_t n) {
  const char *old = getenv(name);
  snprintf(keep, n, "%s", old ? old : "");
  if (value) setenv(name, value, 1);
  else unsetenv(name);
}

static void env_restore(const char *name, const char *keep) {
  if (keep[0]) setenv(name, keep, 1);
  else unsetenv(name);
}

static void test_env_values(void) {
  static const struct {
    const char *name, *bad, *good;
  } cases[] = {{"SMELT_JIT", "bogus", "on"},      {"SMELT_LOG", "loud", "off"}, {"SMELT_GEMM_TUNE", "no", "off"},
               {"SMELT_NVTX", "yes", "0"},        {"SMELT_DUMP_SOURCE", "true", "1"},
               {"SMELT_DEVICE", "abc", "cpu"}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char keep[256], want[96];
    env_set(cases[i].name, cases[i].bad, keep, sizeof keep);
    smelt_ctx *ctx = NULL;
    CHECK_STATUS(smelt_ctx_create(&ctx, NULL), SMELT_STATUS_INVALID_ARGUMENT);
    snprintf(want, sizeof want, "%s=\"%s\"", cases[i].name, cases[i].bad);
    CHECK_MSG(want);
    CHECK(ctx == NULL);
    if (strcmp(cases[i].name, "SMELT_DEVICE")) {
      CHECK_STATUS(smelt_precompile("sm_80", NULL, NULL, NULL), SMELT_STATUS_INVALID_ARGUMENT);
      CHECK_MSG(want);
    }
    setenv(cases[i].name, cases[i].good, 1);
    smelt_ctx_options o = smelt_ctx_options_default();
    o.device = SMELT_DEVICE_CPU;
    if (!strcmp(cases[i].name, "SMELT_DEVICE")) o.use_env = 1;
    CHECK_OK(smelt_ctx_create(&ctx, &o));
    smelt_ctx_destroy(ctx);
    env_restore(cases[i].name, keep);
  }
}

/* Warnings print unless SMELT_LOG=off (an unusable cache folder went unseen
 * while logging was off by default). */
static void test_log_default_warn(void) {
  char keep[64];
  env_set("SMELT_LOG", NULL, keep, sizeof keep);
  CHECK_EQ_INT(smelt__log_level(), SMELT__LOG_WARN);
  setenv("SMELT_LOG", "off", 1);
  CHECK_EQ_INT(smelt__log_level(), SMELT__LOG_OFF);
  setenv("SMELT_LOG", "debug", 1);
  CHECK_EQ_INT(smelt__log_level(), SMELT__LOG_DEBUG);
  env_restore("SMELT_LOG", keep);
}

/* Precompiling under SMELT_JIT=off is refused with advice that works (it
 * used to advise running precompile). */
static void test_precompile_jit_off(void) {
  char keep[64];
  env_set("SMELT_JIT", "off", keep, sizeof keep);
  int n = -1;
  CHECK_STATUS(smelt_precompile("sm_80", NULL, NULL, &n), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("SMELT_JIT unset");
  CHECK_EQ_INT(n, 0);
  env_restore("SMELT_JIT", keep);
}

const th_test th_tests_inputs[] = {
    {"alloc_beyond_host", test_alloc_beyond_host},
    {"peer_store_beyond_host", test_peer_store_beyond_host},
    {"empty_views_contiguous", test_empty_views_contiguous},
    {"attention_empty_zero_strides", test_attention_empty_zero_strides},
    {"gpu_attention_empty_zero_strides", test_gpu_attention_empty_zero_strides},
    {"peer_empty_zero_strides", test_peer_empty_zero_strides},
    {"env_values", test_env_values},
    {"log_default_warn", test_log_default_warn},
    {"precompile_jit_off", test_precompile_jit_off},
    {0, 0},
};
