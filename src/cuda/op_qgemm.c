/* smelt_qgemm on CUDA: the kernel manager's pick for NVFP4 weights and
 * 16-bit activations. One module per x dtype (kernels/qgemm_w4.cu) holds
 * both entry points:
 *   M <= 16  qgemm_w4_gemv streams the 4-bit weights once, with K split
 *            over CTAs (a deterministic reduction in the kernel) when N is
 *            too small to fill the SMs;
 *   M > 16   qgemm_w4_dequant writes W in x's dtype (exact) to a workspace
 *            from the context's pool, then smelt's 16-bit GEMM, planned
 *            with the qgemm plan, runs x · Wᵀ with the epilogue: alpha,
 *            the tensor scale as a column scale of stride 0 (it stays on
 *            the device), bias, activation. A dequantizing main loop
 *            (4-bit W in shared memory feeding wgmma) would save the
 *            workspace's write and read; that is future work.
 * Each run decides the GEMV's 16-byte paths from its own pointers and
 * strides. */
#include "../core/qgemm_internal.h"
#include "cuda_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_qgemm"

/* The GEMV's tile (kernels/qgemm_w4.cu): threads, columns of D and K per
 * chunk, blocks an SM holds (its launch bounds). */
enum { NT = 256, BN = 128, CHUNK = 512, BLOCKS_PER_SM = 3, GEMV_MAX_M = 16 };
enum { F_GEMV, F_DEQUANT };

static const smelt_dtype x_dtypes[] = {SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* The launch parameters (qg_params in kernels/qgemm_w4.cu). */
typedef struct qg_kparams {
  uint64_t x, q, scale, ts, bias, d, ws, cnt;
  int64_t m, n, k, x_rs, x_cs, q_rs, s_rs, s_cs, bias_s, d_rs, d_cs, k_slice;
  double alpha;
  float slope;
  int act, dt_bias, dt_d, has_bias, splits, vec, pad;
} qg_kparams;

_Static_assert(sizeof(qg_kparams) == 200, "qg_kparams must match qg_params");

/* The plan's own state: the GEMM of the M > 16 path (NULL otherwise). */
typedef struct qg_cuda {
  smelt_plan *gemm;
} qg_cuda;

static void qg_cuda_free(void *p) {
  qg_cuda *c = (qg_cuda *)p;
  if (c) smelt_plan_destroy(c->gemm);
  free(c);
}

/* The one place a variant's source is made (plan and enumerator). */
static void make_src(smelt_dtype xdt, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "qgemm_w4_%s", smelt_dtype_name(xdt));
  src->body = "qgemm_w4.cu";
  smelt__prelude_define(src, "QG_DT", xdt);
  smelt__prelude_define(src, "GEMM_ACC", 1);
}

int smelt__qgemm_variants(smelt__kernel_src *out, int max) {
  const int n = (int)(sizeof x_dtypes / sizeof *x_dtypes);
  for (int v = 0; v < n && v < max; v++) make_src(x_dtypes[v], &out[v]);
  return n;
}

/* An address past every tensor of the plan, 256-byte aligned like the
 * pool's blocks: the placeholder of the dequantized W while planning (the
 * GEMM plan reads no data; each run binds the real workspace). */
static void *past_all(const smelt_plan *plan) {
  uintptr_t at = 0;
  for (int r = 0; r < SMELT__QG_COUNT; r++) {
    const smelt_tensor *t = &plan->t[r];
    if (t->ndim < 0) continue;
    int64_t lo, hi;
    smelt__tensor_span(t, &lo, &hi);
    if ((uintptr_t)t->data + (uintptr_t)hi > at) at = (uintptr_t)t->data + (uintptr_t)hi;
  }
  return (void *)((at + 511) & ~(uintptr_t)255);
}

/* W' [N, K] as the GEMM's B [K, N] (K contiguous: the fast layout). */
static smelt_tensor w_view(const smelt_plan *plan, void *data) {
  const int64_t K = plan->t[SMELT__QG_X].shape[1], N = plan->t[SMELT__QG_D].shape[1];
  const int64_t shape[2] = {K, N};
  smelt_tensor b = smelt_tensor_make(data, plan->t[SMELT__QG_X].dtype, SMELT_DEVICE_CUDA, plan->ctx->device_index,
                                     2, shape);
  b.strides[0] = 1;
  b.strides[1] = K;
  return b;
}

/* The tensor scale as a column scale of every n: [N], stride 0. */
static smelt_tensor ts_view(const smelt_tensor *ts, int64_t N) {
  smelt_tensor v = *ts;
  v.ndim = 1;
  v.shape[0] = N;
  v.strides[0] = 0;
  return v;
}

static smelt_status plan_gemm(smelt_plan *plan, qg_cuda *c) {
  const smelt_qgemm_desc *e = &smelt__qgemm_params_of(plan)->desc;
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.epilogue.alpha = e->alpha;
  desc.epilogue.act = e->act;
  desc.epilogue.slope = e->slope;
  const smelt_tensor b = w_view(plan, past_all(plan));
  const smelt_tensor sb = ts_view(&plan->t[SMELT__QG_TS], plan->t[SMELT__QG_D].shape[1]);
  const smelt_gemm_scales scales = {NULL, &sb};
  const smelt_tensor *bias = plan->t[SMELT__QG_BIAS].ndim >= 0 ? &plan->t[SMELT__QG_BIAS] : NULL;
  return smelt_gemm_scaled_plan(plan->ctx, &desc, &plan->t[SMELT__QG_X], &b, NULL, &plan->t[SMELT__QG_D], bias,
                                &scales, &c->gemm);
}

static smelt_status plan_qgemm(smelt_plan *plan, const void *args) {
  (void)args;
  const int64_t M = plan->t[SMELT__QG_X].shape[0], N = plan->t[SMELT__QG_D].shape[1];
  smelt__kernel_src src;
  make_src(plan->t[SMELT__QG_X].dtype, &src);
  CUfunction f;
  smelt_status s;
  if ((s = smelt__cuda_function(plan->ctx, &src, "qgemm_w4_gemv", &f))) return s;
  plan->func[F_GEMV] = f;
  if ((s = smelt__cuda_function(plan->ctx, &src, "qgemm_w4_dequant", &f))) return s;
  plan->func[F_DEQUANT] = f;
  plan->block = NT;
  qg_cuda *c = calloc(1, sizeof *c);
  if (!c) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  plan->backend = c;
  plan->backend_free = qg_cuda_free;
  const int gemm = M > GEMV_MAX_M && N > 0;
  if (gemm && (s = plan_gemm(plan, c))) return s;
  snprintf(plan->describe, sizeof plan->describe, "%s (qgemm_w4.cu, %s)", src.name,
           gemm ? "qgemm_w4_dequant + the 16-bit GEMM" : "qgemm_w4_gemv");
  return SMELT_OK;
}

/* The fields every launch shares. */
static void params_of(const smelt_plan *plan, const smelt_tensor *const *t, qg_kparams *p) {
  const smelt_qgemm_desc *e = &smelt__qgemm_params_of(plan)->desc;
  const smelt_tensor *x = t[SMELT__QG_X], *q = t[SMELT__QG_Q], *sc = t[SMELT__QG_SCALE], *d = t[SMELT__QG_D];
  const smelt_tensor *bias = t[SMELT__QG_BIAS];
  memset(p, 0, sizeof *p);
  p->x = (uint64_t)(uintptr_t)x->data;
  p->q = (uint64_t)(uintptr_t)q->data;
  p->scale = (uint64_t)(uintptr_t)sc->data;
  p->ts = (uint64_t)(uintptr_t)t[SMELT__QG_TS]->data;
  p->d = (uint64_t)(uintptr_t)d->data;
  p->m = x->shape[0];
  p->k = x->shape[1];
  p->n = d->shape[1];
  p->x_rs = x->strides[0];
  p->x_cs = x->strides[1];
  p->q_rs = q->strides[0];
  smelt__quant_scale_strides(sc, &p->s_rs, &p->s_cs);
  p->d_rs = d->strides[0];
  p->d_cs = d->strides[1];
  p->alpha = e->alpha;
  p->slope = e->slope;
  p->act = (int)e->act;
  p->dt_d = (int)d->dtype;
  p->has_bias = bias != NULL;
  if (bias) {
    p->bias = (uint64_t)(uintptr_t)bias->data;
    p->bias_s = bias->strides[0];
    p->dt_bias = (int)bias->dtype;
  }
  p->splits = 1;
}

/* Whether q's rows are 16-byte units (the 16-byte weight loads). */
static int q_vec(const qg_kparams *p) { return p->q % 16 == 0 && (p->n == 1 || p->q_rs % 16 == 0); }

/* Whether the GEMV's fast paths hold: q as above, x rows of unit stride
 * and 16-byte aligned, scale rows of unit stride and 8-byte aligned. */
static int gemv_vec(const qg_kparams *p) {
  const int x = p->x_cs == 1 && p->x % 16 == 0 && (p->m == 1 || p->x_rs % 8 == 0);
  const int s = p->s_cs == 1 && p->scale % 8 == 0 && (p->n == 1 || p->s_rs % 8 == 0);
  return x && s && q_vec(p);
}

/* K slices: enough blocks to fill the SMs once, whole chunks per slice. */
static void split_k(const smelt_plan *plan, qg_kparams *p, int64_t col_blocks) {
  const int64_t chunks = smelt__ceil_div(p->k, CHUNK), target = (int64_t)plan->ctx->cuda->info.sm_count * BLOCKS_PER_SM;
  int64_t per = chunks > 0 ? smelt__ceil_div(chunks * col_blocks, target) : 1;
  if (per < 1) per = 1;
  p->splits = chunks > 0 ? (int)smelt__ceil_div(chunks, per) : 1;
  p->k_slice = per * CHUNK;
}

static smelt_status run_gemv(smelt_plan *plan, const smelt_tensor *const *t) {
  smelt_ctx *ctx = plan->ctx;
  qg_kparams p;
  params_of(plan, t, &p);
  p.vec = gemv_vec(&p);
  const int64_t col_blocks = smelt__ceil_div(p.n, BN);
  split_k(plan, &p, col_blocks);
  void *ws = NULL;
  smelt_status s = SMELT_OK;
  if (p.splits > 1) {
    const size_t partial = (size_t)(p.splits * p.m * p.n) * 4, tickets = (size_t)col_blocks * 4;
    if ((s = smelt__cuda_alloc(ctx, partial + tickets, &ws))) return s;
    p.ws = (uint64_t)(uintptr_t)ws;
    p.cnt = p.ws + partial;
    CUresult r = smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)p.cnt, 0, tickets, ctx->cuda->stream);
    if (r) s = smelt__cu_error(r, OP, "clearing the split-K tickets");
  }
  void *params[] = {&p};
  if (!s)
    s = smelt__cuda_launch(ctx, OP, (CUfunction)plan->func[F_GEMV], (unsigned)col_blocks, (unsigned)p.splits, 1, NT, 0,
                           params);
  if (ws) {
    smelt_status f = smelt__cuda_free(ctx, ws);
    if (!s) s = f;
  }
  return s;
}

static smelt_status run_gemm(smelt_plan *plan, const smelt_tensor *const *t) {
  smelt_ctx *ctx = plan->ctx;
  qg_kparams p;
  params_of(plan, t, &p);
  p.vec = q_vec(&p);
  void *w = NULL;
  /* At least one pool block, so that B has a real pointer also when K = 0. */
  const size_t bytes = (size_t)(p.n * p.k) * 2;
  smelt_status s = smelt__cuda_alloc(ctx, bytes > 256 ? bytes : 256, &w);
  if (s) return s;
  const int64_t pieces = p.n * smelt__ceil_div(p.k, 32);
  if (pieces > 0) {
    p.d = (uint64_t)(uintptr_t)w;
    p.d_rs = p.k;
    int64_t blocks = smelt__ceil_div(pieces, NT), cap = (int64_t)ctx->cuda->info.sm_count * 8;
    void *params[] = {&p};
    s = smelt__cuda_launch(ctx, OP, (CUfunction)plan->func[F_DEQUANT], (unsigned)(blocks < cap ? blocks : cap), 1, 1,
                           NT, 0, params);
  }
  const smelt_tensor b = w_view(plan, w), sb = ts_view(t[SMELT__QG_TS], p.n);
  const smelt_gemm_scales scales = {NULL, &sb};
  if (!s)
    s = smelt_gemm_scaled_run(((qg_cuda *)plan->backend)->gemm, t[SMELT__QG_X], &b, NULL, t[SMELT__QG_D],
                              t[SMELT__QG_BIAS], &scales);
  smelt_status f = smelt__cuda_free(ctx, w);
  return s ? s : f;
}

static smelt_status run_qgemm(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  if (t[SMELT__QG_X]->shape[0] == 0 || t[SMELT__QG_D]->shape[1] == 0) return SMELT_OK;
  smelt__nvtx_push(OP);
  smelt_status s = t[SMELT__QG_X]->shape[0] <= GEMV_MAX_M ? run_gemv(plan, t) : run_gemm(plan, t);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_qgemm = {.plan = plan_qgemm, .run = run_qgemm};
