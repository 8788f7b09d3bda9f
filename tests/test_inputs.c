/* What a new user's first inputs met (issue 26): allocations larger than
 * the machine refused before they are attempted, empty views with the
 * strides numpy gives them (all 0) accepted by every op, and environment
 * variables with values the library does not know refused by name. */
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

const th_test th_tests_inputs[] = {
    {"alloc_beyond_host", test_alloc_beyond_host},
    {"peer_store_beyond_host", test_peer_store_beyond_host},
    {"empty_views_contiguous", test_empty_views_contiguous},
    {"attention_empty_zero_strides", test_attention_empty_zero_strides},
    {"peer_empty_zero_strides", test_peer_empty_zero_strides},
    {0, 0},
};
