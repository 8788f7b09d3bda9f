/* MoE backward tests: with a GPU, the CUDA backward of the whole layer
 * (dx, dWr, dWnoise, dW1, dW3, dW2, db1) against the CPU reference's on the
 * same inputs (odd token counts, experts with no token, all tokens on one
 * expert, top-1, 2 and 6, capacity drops by position and by probs, the aux
 * and z losses, SwiGLU and the MLP with a bias, sigmoid scores, noisy
 * top-k, dx with a row stride whose padding stays untouched; dx in one
 * pass with the router's part (E <= 16, no noise) and through the router's
 * products over an f32 dx (noise, E > 16)), bit for bit
 * equal across two runs; each backward part (router, aux losses, unpermute,
 * permute, expert FFN) against the CPU's; and the clear refusals of what
 * CUDA does not take. On the CPU: the layer's backward repeats bit for bit.
 *
 * Bounds: relative L2 against the CPU's double arithmetic of 1e-4 in f32,
 * 1e-2 in f16 and 4e-2 in bf16 (the backward rounds more intermediates to
 * the input type than the forward: h1, h3, a, dA, dh1, dh3, dyp). Outputs
 * are guarded buffers poisoned with NaN, so an element left unwritten
 * fails the comparison. */
#include "test_moe.h"

#include <math.h>
#include <string.h>

enum { G_DX, G_DWR, G_DWN, G_DW1, G_DW3, G_DW2, G_DB1, G_N };
static const char *const grad_names[G_N] = {"dx", "dwr", "dwnoise", "dw1", "dw3", "dw2", "db1"};

/* The layer's gradients in guarded buffers of one context, each present
 * when p has its weight; dx [T, d] with rows d + pad apart. */
typedef struct grads {
  th_buf b[G_N];
  smelt_tensor t[G_N];
  int on[G_N];
  int64_t pad;
} grads;

static void grads_new(grads *g, const mp *p, smelt_ctx *ctx, int64_t pad) {
  memset(g, 0, sizeof *g);
  g->pad = pad;
  const smelt_device_kind kind = ctx == th_cpu() ? SMELT_DEVICE_CPU : SMELT_DEVICE_CUDA;
  const int swiglu = p->sp.ffn == SMELT_MOE_FFN_SWIGLU;
  const int64_t T = p->T, d = p->d, E = p->E, F = p->F;
  const struct {
    int on, nd;
    int64_t s[3];
  } sh[G_N] = {{1, 2, {T, d, 0}},          {1, 2, {d, E, 0}},  {p->sp.noise, 2, {d, E, 0}},
               {1, 3, {E, d, F}},          {swiglu, 3, {E, d, F}}, {1, 3, {E, F, d}},
               {!swiglu && p->sp.b1, 2, {E, F, 0}}};
  for (int i = 0; i < G_N; i++) {
    if (!(g->on[i] = sh[i].on)) continue;
    const smelt_dtype dt = i == G_DX ? p->xdt : p->wdt;
    const int64_t rows = i == G_DX ? T * (d + pad) : sh[i].s[0] * sh[i].s[1] * (sh[i].nd == 3 ? sh[i].s[2] : 1);
    g->b[i] = th_buf_new(ctx, (size_t)(rows ? rows : 1) * smelt_dtype_size(dt));
    g->t[i] = smelt_tensor_make(g->b[i].data, dt, kind, smelt_ctx_device_index(ctx), sh[i].nd, sh[i].s);
    if (i == G_DX) g->t[i].strides[0] = d + pad;
  }
}

static smelt_moe_grads grads_view(const grads *g) {
  const smelt_tensor *v[G_N];
  for (int i = 0; i < G_N; i++) v[i] = g->on[i] ? &g->t[i] : NULL;
  return (smelt_moe_grads){.dx = v[G_DX], .dwr = v[G_DWR], .dwnoise = v[G_DWN], .dw1 = v[G_DW1], .dw3 = v[G_DW3],
                           .dw2 = v[G_DW2], .db1 = v[G_DB1]};
}

/* Gradient i's logical elements as doubles (dx without its padding, which
 * must be untouched); *n their count. */
static double *grads_read(const grads *g, int i, int64_t *n) {
  const smelt_tensor *t = &g->t[i];
  const size_t es = smelt_dtype_size(t->dtype);
  const int64_t rows = t->shape[0], cols = smelt_tensor_numel(t) / (rows ? rows : 1), stride = cols + (i == G_DX ? g->pad : 0);
  char *h = malloc(g->b[i].bytes + 1);
  th_buf_download(&g->b[i], h, g->b[i].bytes);
  CHECK(th_buf_guards_ok(&g->b[i]));
  *n = rows * cols;
  double *v = calloc((size_t)(*n + 1), sizeof(double));
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t c = 0; c < cols; c++) v[r * cols + c] = th_get(h, t->dtype, r * stride + c);
    if (stride > cols && !th_all_ff(h + (size_t)(r * stride + cols) * es, (size_t)(stride - cols) * es))
      th_fail(__FILE__, __LINE__, "%s: the padding of row %lld written", grad_names[i], (long long)r);
  }
  free(h);
  return v;
}

/* Whether two runs' gradients are the same bytes. */
static int grads_same(const grads *a, const grads *b) {
  int same = 1;
  for (int i = 0; i < G_N && same; i++) {
    if (!a->on[i]) continue;
    char *x = malloc(a->b[i].bytes + 1), *y = malloc(a->b[i].bytes + 1);
    th_buf_download(&a->b[i], x, a->b[i].bytes);
    th_buf_download(&b->b[i], y, b->b[i].bytes);
    if (memcmp(x, y, a->b[i].bytes)) {
      fprintf(stderr, "    %s differs between two runs\n", grad_names[i]);
      same = 0;
    }
    free(x), free(y);
  }
  return same;
}

static void grads_free(grads *g) {
  for (int i = 0; i < G_N; i++)
    if (g->on[i]) th_buf_free(&g->b[i]);
}

/* n elements of host data of dtype dt as doubles. */
static double *doubles(const void *h, smelt_dtype dt, int64_t n) {
  double *v = calloc((size_t)(n + 1), sizeof(double));
  for (int64_t i = 0; i < n; i++) v[i] = th_get(h, dt, i);
  return v;
}

static double bwd_bound(smelt_dtype dt) {
  return dt == SMELT_DTYPE_F32 ? 1e-4 : dt == SMELT_DTYPE_F16 ? 1e-2 : 4e-2;
}

/* ---------------------------------------------------------------- the layer */

/* The layer's backward on CUDA against the CPU's, twice (bit for bit). */
static void gpu_backward_case(const spec *sp, int one_expert, int64_t pad, const char *what) {
  mp p;
  mp_init(&p, sp);
  if (one_expert) all_to_three(&p);
  arr dy = arr_new(p.xdt, p.T * p.d, -1, 1);
  const smelt_tensor tdy = host_tensor(dy.h, p.xdt, 2, p.T, p.d, 0);
  grads c, g1, g2;
  grads_new(&c, &p, th_cpu(), 0);
  const smelt_moe_grads gc = grads_view(&c);
  CHECK_OK(smelt_moe_backward(th_cpu(), &p.cfg, &p.w, &p.tx, &tdy, &gc));
  dev_weights w;
  dev_all_new(&p, &w);
  dev gdy = dev_new(p.xdt, 2, p.T, p.d, dy.h);
  grads_new(&g1, &p, th_cuda(), pad);
  grads_new(&g2, &p, th_cuda(), pad);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &w.w, &w.x.t, &plan));
  const smelt_moe_grads v1 = grads_view(&g1), v2 = grads_view(&g2);
  CHECK_OK(smelt_moe_backward_run(plan, &w.w, &w.x.t, &gdy.t, &v1));
  CHECK_OK(smelt_moe_backward_run(plan, &w.w, &w.x.t, &gdy.t, &v2));
  CHECK_OK(smelt_ctx_synchronize(th_cuda()));
  for (int i = 0; i < G_N; i++) {
    if (!c.on[i]) continue;
    int64_t n = 0, m = 0;
    double *got = grads_read(&g1, i, &n), *ref = grads_read(&c, i, &m);
    char name[160];
    snprintf(name, sizeof name, "%s: %s", what, grad_names[i]);
    CHECK(th_compare(name, got, ref, n, bwd_bound(p.xdt), 1e-6));
    free(got), free(ref);
  }
  if (!grads_same(&g1, &g2)) th_fail(__FILE__, __LINE__, "%s: two runs differ", what);
  /* The saved path: the forward's y and the backward's gradients, bit for
   * bit, from two backwards over one saved state (which they only read). */
  int64_t sb = -1;
  CHECK_OK(smelt_moe_saved_bytes(plan, &sb));
  CHECK(sb > 0);
  dev saved = dev_new(SMELT_DTYPE_U8, 1, sb > 0 ? sb : 1, 0, NULL), y1 = dev_new(p.xdt, 2, p.T, p.d, NULL),
      y2 = dev_new(p.xdt, 2, p.T, p.d, NULL);
  grads g3, g4;
  grads_new(&g3, &p, th_cuda(), pad);
  grads_new(&g4, &p, th_cuda(), pad);
  const smelt_moe_grads v3 = grads_view(&g3), v4 = grads_view(&g4);
  dev c1 = dev_new(SMELT_DTYPE_I64, 1, p.E, 0, NULL), c2 = dev_new(SMELT_DTYPE_I64, 1, p.E, 0, NULL),
      a1 = dev_new(SMELT_DTYPE_F32, 1, 2, 0, NULL), a2 = dev_new(SMELT_DTYPE_F32, 1, 2, 0, NULL);
  const smelt_moe_routing r1 = {.counts = &c1.t, .aux = &a1.t}, r2 = {.counts = &c2.t, .aux = &a2.t};
  CHECK_OK(smelt_moe_forward_run(plan, &w.w, &w.x.t, &y1.t, &r1, NULL));
  CHECK_OK(smelt_moe_forward_save_run(plan, &w.w, &w.x.t, &y2.t, &saved.t, &r2));
  CHECK_OK(smelt_moe_backward_saved_run(plan, &w.w, &w.x.t, &gdy.t, &saved.t, &v3));
  CHECK_OK(smelt_moe_backward_saved_run(plan, &w.w, &w.x.t, &gdy.t, &saved.t, &v4));
  CHECK_OK(smelt_ctx_synchronize(th_cuda()));
  /* SwiGLU's y is the same bits; the MLP's saved forward rounds h1 to x's
   * dtype before the activation (the pre-activation it keeps), where the
   * plain forward applies bias and activation in the GEMM's epilogue: the
   * same y within the dtype's rounding (it differed on the H100 in bf16). */
  void *h1 = dev_read(&y1), *h2 = dev_read(&y2);
  if (sp->ffn != SMELT_MOE_FFN_MLP && memcmp(h1, h2, y1.b.bytes))
    th_fail(__FILE__, __LINE__, "%s: the saved forward's y differs", what);
  double *d1 = doubles(h1, p.xdt, p.T * p.d), *d2 = doubles(h2, p.xdt, p.T * p.d);
  char yname[160];
  snprintf(yname, sizeof yname, "%s: the saved forward's y", what);
  CHECK(th_compare(yname, d2, d1, p.T * p.d, bwd_bound(p.xdt), 1e-6));
  free(d1), free(d2), free(h1), free(h2);
  if (!grads_same(&g1, &g3) || !grads_same(&g1, &g4))
    th_fail(__FILE__, __LINE__, "%s: the saved backward's gradients differ", what);
  CHECK(th_buf_guards_ok(&saved.b));
  /* The saved forward's counts and aux losses are the plain forward's. */
  void *hc1 = dev_read(&c1), *hc2 = dev_read(&c2), *ha1 = dev_read(&a1), *ha2 = dev_read(&a2);
  if (memcmp(hc1, hc2, c1.b.bytes) || memcmp(ha1, ha2, a1.b.bytes))
    th_fail(__FILE__, __LINE__, "%s: the saved forward's counts or aux differ", what);
  free(hc1), free(hc2), free(ha1), free(ha2);
  grads_free(&g3), grads_free(&g4);
  devs_free((dev[]){saved, y1, y2, c1, c2, a1, a2}, 7);
  smelt_plan_destroy(plan);
  grads_free(&c), grads_free(&g1), grads_free(&g2);
  devs_free(&gdy, 1);
  dev_weights_free(&w);
  arr_free(&dy);
  mp_free(&p);
}

static void test_moe_bwd_gpu_layer(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  const smelt_dtype bf = SMELT_DTYPE_BF16, h = SMELT_DTYPE_F16;
  spec s = {.T = 37, .d = 64, .E = 8, .k = 2, .F = 96, .xdt = bf, .wdt = bf, .aux = 0.01, .z = 0.001};
  gpu_backward_case(&s, 0, 8, "bwd T37 d64 F96 E8 top2 bf16, aux + z, dx rows 72 apart");
  s = (spec){.T = 29, .d = 24, .E = 5, .k = 1, .F = 40, .aux = 0.02};
  gpu_backward_case(&s, 0, 3, "bwd T29 E5 top1 f32 (no renormalization effect), aux, dx rows 27 apart");
  s = (spec){.T = 1, .d = 32, .E = 8, .k = 2, .F = 32, .xdt = h, .wdt = h};
  gpu_backward_case(&s, 0, 0, "bwd T1 f16");
  s = (spec){.T = 3, .d = 32, .E = 16, .k = 2, .F = 48, .xdt = bf, .wdt = bf, .z = 0.01};
  gpu_backward_case(&s, 0, 0, "bwd T3 E16 bf16: experts with no token");
  s = (spec){.T = 41, .d = 48, .E = 12, .k = 6, .F = 40, .xdt = bf, .wdt = bf, .bias = 1, .aux = 0.01};
  gpu_backward_case(&s, 0, 0, "bwd T41 E12 top6 bf16 + bias");
  s = (spec){.T = 33, .d = 64, .E = 8, .k = 1, .F = 64, .xdt = bf, .wdt = bf, .bias = 1};
  gpu_backward_case(&s, 1, 0, "bwd all tokens on expert 3, bf16");
  s = (spec){.T = 101, .d = 32, .E = 8, .k = 2, .F = 48, .cap = 0.8, .drop = SMELT_MOE_DROP_POSITION, .aux = 0.01};
  gpu_backward_case(&s, 0, 0, "bwd T101 f32 capacity 0.8 position, aux");
  s = (spec){.T = 101, .d = 64, .E = 8, .k = 2, .F = 64, .xdt = bf, .wdt = bf, .cap = 0.7,
             .drop = SMELT_MOE_DROP_PROBS, .aux = 0.01, .z = 0.001};
  gpu_backward_case(&s, 0, 0, "bwd T101 bf16 capacity 0.7 probs, aux + z");
  s = (spec){.T = 45, .d = 32, .E = 6, .k = 2, .F = 40, .xdt = bf, .wdt = bf, .ffn = SMELT_MOE_FFN_MLP,
             .act = SMELT_ACT_GELU, .b1 = 1, .score = SMELT_MOE_SCORE_SIGMOID};
  gpu_backward_case(&s, 0, 0, "bwd mlp gelu + b1, sigmoid, bf16");
  s = (spec){.T = 23, .d = 20, .E = 4, .k = 2, .F = 12, .ffn = SMELT_MOE_FFN_MLP, .act = SMELT_ACT_TANH,
             .no_renorm = 1, .scale = 2.5};
  gpu_backward_case(&s, 0, 0, "bwd mlp tanh f32, no renormalization, scaling 2.5");
  s = (spec){.T = 31, .d = 32, .E = 16, .k = 4, .F = 24, .noise = 1, .groups = 4, .topk_groups = 2, .aux = 0.01};
  gpu_backward_case(&s, 0, 0, "bwd f32 noisy top-4 of 2 of 4 groups, aux");
  s = (spec){.T = 53, .d = 40, .E = 20, .k = 3, .F = 24, .xdt = bf, .wdt = bf, .aux = 0.01};
  gpu_backward_case(&s, 0, 8, "bwd T53 E20 top3 bf16: dx through the router's products, dx rows 48 apart");
  s = (spec){.T = 300, .d = 128, .E = 8, .k = 2, .F = 192, .xdt = h, .wdt = h, .aux = 0.01};
  gpu_backward_case(&s, 0, 8, "bwd T300 d128 F192 f16 (Hopper: the fused up projection and input gradient)");
}

/* ---------------------------------------------------------------- the parts */

/* The router's backward and the aux losses' run on CUDA against the CPU's
 * over the GPU's own logits. */
static void gpu_router_parts_case(const spec *sp, const char *what) {
  mp p;
  mp_init(&p, sp);
  dev_weights w;
  dev_weights_new(&p, &w);
  smelt_plan *gplan = NULL, *cplan = NULL;
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &w.w, &w.x.t, &gplan));
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &cplan));
  dev lg = dev_new(SMELT_DTYPE_F32, 2, p.T, p.E, NULL), id = dev_new(SMELT_DTYPE_I32, 2, p.T, p.k, NULL),
      wt = dev_new(SMELT_DTYPE_F32, 2, p.T, p.k, NULL), cn = dev_new(SMELT_DTYPE_I32, 1, p.E, 0, NULL),
      of = dev_new(SMELT_DTYPE_I32, 1, p.E + 1, 0, NULL);
  smelt_moe_routing r = {&lg.t, &id.t, &wt.t, &cn.t, &of.t, NULL, NULL};
  CHECK_OK(smelt_moe_route_run(gplan, &w.w, &w.x.t, &r));
  float *hl = dev_read(&lg);
  arr dw = arr_new(SMELT_DTYPE_F32, p.R, -1, 1);
  dev gdw = dev_new(SMELT_DTYPE_F32, 2, p.T, p.k, dw.h), gdl = dev_new(SMELT_DTYPE_F32, 2, p.T, p.E, NULL),
      gdl2 = dev_new(SMELT_DTYPE_F32, 2, p.T, p.E, NULL), gax = dev_new(SMELT_DTYPE_F32, 1, 2, 0, NULL);
  CHECK_OK(smelt_moe_route_backward_run(gplan, &w.w, &lg.t, &gdw.t, &gdl.t));
  CHECK_OK(smelt_moe_aux_losses_run(gplan, &w.w, &lg.t, &gax.t, &gdl2.t));
  float *got[3] = {dev_read(&gdl), dev_read(&gdl2), dev_read(&gax)};
  const smelt_tensor tl = host_tensor(hl, SMELT_DTYPE_F32, 2, p.T, p.E, 0), tdw = host_tensor(dw.h, SMELT_DTYPE_F32, 2, p.T, p.k, 0);
  float *ref[3] = {calloc((size_t)(p.T * p.E + 1), 4), calloc((size_t)(p.T * p.E + 1), 4), calloc(2, 4)};
  const smelt_tensor cdl = host_tensor(ref[0], SMELT_DTYPE_F32, 2, p.T, p.E, 0),
                     cdl2 = host_tensor(ref[1], SMELT_DTYPE_F32, 2, p.T, p.E, 0),
                     cax = host_tensor(ref[2], SMELT_DTYPE_F32, 1, 2, 0, 0);
  CHECK_OK(smelt_moe_route_backward_run(cplan, &p.w, &tl, &tdw, &cdl));
  CHECK_OK(smelt_moe_aux_losses_run(cplan, &p.w, &tl, &cax, &cdl2));
  const int64_t n[3] = {p.T * p.E, p.T * p.E, 2};
  const char *names[3] = {"route backward dlogits", "aux losses dlogits", "aux losses"};
  for (int i = 0; i < 3; i++) {
    double *a = calloc((size_t)n[i], 8), *b = calloc((size_t)n[i], 8);
    for (int64_t j = 0; j < n[i]; j++) a[j] = got[i][j], b[j] = ref[i][j];
    char name[160];
    snprintf(name, sizeof name, "%s: %s", what, names[i]);
    CHECK(th_compare(name, a, b, n[i], 1e-5, 1e-9));
    free(a), free(b), free(got[i]), free(ref[i]);
  }
  free(hl);
  arr_free(&dw);
  devs_free((dev[]){lg, id, wt, cn, of, gdw, gdl, gdl2, gax}, 9);
  smelt_plan_destroy(gplan);
  smelt_plan_destroy(cplan);
  dev_weights_free(&w);
  mp_free(&p);
}

static void test_moe_bwd_gpu_router(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  spec s = {.T = 57, .d = 32, .E = 8, .k = 2, .F = 8, .aux = 0.01, .z = 0.001};
  gpu_router_parts_case(&s, "router T57 E8 top2 softmax, aux + z");
  s = (spec){.T = 130, .d = 32, .E = 40, .k = 6, .F = 8, .score = SMELT_MOE_SCORE_SIGMOID, .bias = 1, .aux = 0.1,
             .cap = 1.0, .drop = SMELT_MOE_DROP_PROBS};
  gpu_router_parts_case(&s, "router T130 E40 top6 sigmoid + bias, capacity probs (dropped dweights ignored)");
  s = (spec){.T = 1, .d = 16, .E = 300, .k = 3, .F = 8, .no_renorm = 1, .scale = 0.5, .z = 0.01};
  gpu_router_parts_case(&s, "router T1 E300 (the wide module) top3 no renormalization, z");
}

/* A host routing by the CPU reference: ids and offsets (i64), row_map and
 * the weights (f32) of p, with xp. */
typedef struct routed {
  th_buf ids, offs, rm, w, xp;
  smelt_tensor tids, toffs, trm, tw, txp;
} routed;

static void routed_new(routed *r, const mp *p, smelt_plan *cplan) {
  r->ids = th_buf_new(th_cpu(), (size_t)p->R * 4), r->offs = th_buf_new(th_cpu(), (size_t)(p->E + 1) * 8);
  r->rm = th_buf_new(th_cpu(), (size_t)p->R * 4), r->w = th_buf_new(th_cpu(), (size_t)p->R * 4);
  r->xp = th_buf_new(th_cpu(), (size_t)(p->R * p->d) * smelt_dtype_size(p->xdt));
  th_buf lg = th_buf_new(th_cpu(), (size_t)(p->T * p->E) * 4), cn = th_buf_new(th_cpu(), (size_t)p->E * 8);
  r->tids = host_tensor(r->ids.data, SMELT_DTYPE_I32, 2, p->T, p->k, 0);
  r->toffs = host_tensor(r->offs.data, SMELT_DTYPE_I64, 1, p->E + 1, 0, 0);
  r->trm = host_tensor(r->rm.data, SMELT_DTYPE_I32, 2, p->T, p->k, 0);
  r->tw = host_tensor(r->w.data, SMELT_DTYPE_F32, 2, p->T, p->k, 0);
  r->txp = host_tensor(r->xp.data, p->xdt, 2, p->R, p->d, 0);
  const smelt_tensor tl = host_tensor(lg.data, SMELT_DTYPE_F32, 2, p->T, p->E, 0),
                     tc = host_tensor(cn.data, SMELT_DTYPE_I64, 1, p->E, 0, 0);
  const smelt_moe_routing rt = {&tl, &r->tids, &r->tw, &tc, &r->toffs, NULL, NULL};
  CHECK_OK(smelt_moe_route_run(cplan, &p->w, &p->tx, &rt));
  CHECK_OK(smelt_moe_permute_run(cplan, &p->tx, &r->tids, &r->toffs, &r->txp, &r->trm));
  th_buf_free(&lg), th_buf_free(&cn);
}

static void routed_free(routed *r) {
  th_buf_free(&r->ids), th_buf_free(&r->offs), th_buf_free(&r->rm), th_buf_free(&r->w), th_buf_free(&r->xp);
}

static void compare_host(const char *what, const void *got, smelt_dtype gdt, const void *ref, smelt_dtype rdt,
                         int64_t n, double rel) {
  double *a = doubles(got, gdt, n), *b = doubles(ref, rdt, n);
  CHECK(th_compare(what, a, b, n, rel, 1e-7));
  free(a), free(b);
}

/* unpermute's and permute's backward on CUDA against the CPU's over the
 * CPU's routing (drops by probs): dyp's kept rows and dweights, dx; dyp's
 * other rows untouched. */
static void test_moe_bwd_gpu_combine(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  const struct {
    smelt_dtype x, yp;
    int64_t d;
  } cases[] = {{SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 264}, {SMELT_DTYPE_F32, SMELT_DTYPE_F32, 100},
               {SMELT_DTYPE_F16, SMELT_DTYPE_F32, 136}};
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    spec s = {.T = 123, .d = cases[ci].d, .E = 16, .k = 4, .F = 8, .xdt = cases[ci].x, .wdt = cases[ci].x,
              .cap = 0.9, .drop = SMELT_MOE_DROP_PROBS};
    mp p;
    mp_init(&p, &s);
    smelt_plan *cplan = NULL, *gplan = NULL;
    CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &cplan));
    routed r;
    routed_new(&r, &p, cplan);
    const int64_t kept = ((int64_t *)r.offs.data)[p.E];
    arr dy = arr_new(p.xdt, p.T * p.d, -1, 1), yp = arr_new(cases[ci].yp, p.R * p.d, -1, 1);
    const size_t yes = smelt_dtype_size(cases[ci].yp);
    th_buf cdyp = th_buf_new(th_cpu(), (size_t)(p.R * p.d) * yes), cdw = th_buf_new(th_cpu(), (size_t)p.R * 4),
           cdx = th_buf_new(th_cpu(), (size_t)(p.T * p.d) * smelt_dtype_size(p.xdt));
    const smelt_tensor tdy = host_tensor(dy.h, p.xdt, 2, p.T, p.d, 0), typ = host_tensor(yp.h, yp.dt, 2, p.R, p.d, 0),
                       tdyp = host_tensor(cdyp.data, yp.dt, 2, p.R, p.d, 0),
                       tdw = host_tensor(cdw.data, SMELT_DTYPE_F32, 2, p.T, p.k, 0),
                       tdx = host_tensor(cdx.data, p.xdt, 2, p.T, p.d, 0);
    CHECK_OK(smelt_moe_unpermute_backward_run(cplan, &tdy, &typ, &r.trm, &r.tw, &tdyp, &tdw));
    CHECK_OK(smelt_moe_permute_backward_run(cplan, &typ, &r.trm, &tdx));
    dev x = dev_new(p.xdt, 2, p.T, p.d, p.x.h), wr = dev_new(p.wdt, 2, p.d, p.E, p.wr.h),
        gdy = dev_new(p.xdt, 2, p.T, p.d, dy.h), gyp = dev_new(yp.dt, 2, p.R, p.d, yp.h),
        grm = dev_new(SMELT_DTYPE_I32, 2, p.T, p.k, r.rm.data), gw = dev_new(SMELT_DTYPE_F32, 2, p.T, p.k, r.w.data),
        gdyp = dev_new(yp.dt, 2, p.R, p.d, NULL), gdw = dev_new(SMELT_DTYPE_F32, 2, p.T, p.k, NULL),
        gdx = dev_new(p.xdt, 2, p.T, p.d, NULL);
    smelt_moe_weights w = {.wr = &wr.t};
    CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &w, &x.t, &gplan));
    CHECK_OK(smelt_moe_unpermute_backward_run(gplan, &gdy.t, &gyp.t, &grm.t, &gw.t, &gdyp.t, &gdw.t));
    CHECK_OK(smelt_moe_permute_backward_run(gplan, &gyp.t, &grm.t, &gdx.t));
    char *hdyp = dev_read(&gdyp), *hdw = dev_read(&gdw), *hdx = dev_read(&gdx);
    const double rel = p.xdt == SMELT_DTYPE_F32 ? 1e-6 : cuda_bound(p.xdt);
    compare_host("unpermute backward dyp", hdyp, yp.dt, cdyp.data, yp.dt, kept * p.d, rel);
    compare_host("unpermute backward dweights", hdw, SMELT_DTYPE_F32, cdw.data, SMELT_DTYPE_F32, p.R, 1e-5);
    compare_host("permute backward dx", hdx, p.xdt, cdx.data, p.xdt, p.T * p.d, rel);
    if (!th_all_ff(hdyp + (size_t)(kept * p.d) * yes, (size_t)((p.R - kept) * p.d) * yes))
      th_fail(__FILE__, __LINE__, "unpermute backward: dyp rows past offsets[E] written");
    free(hdyp), free(hdw), free(hdx);
    devs_free((dev[]){x, wr, gdy, gyp, grm, gw, gdyp, gdw, gdx}, 9);
    th_buf_free(&cdyp), th_buf_free(&cdw), th_buf_free(&cdx);
    arr_free(&dy), arr_free(&yp);
    routed_free(&r);
    smelt_plan_destroy(cplan);
    smelt_plan_destroy(gplan);
    mp_free(&p);
  }
}

/* The expert FFN's backward on CUDA against the CPU's over the CPU's
 * routing (i64 offsets), dyp f32 (another dtype than x's): dxp's kept rows
 * (the rest untouched) and the weight gradients. */
static void gpu_ffn_bwd_case(const spec *sp, int one_expert, const char *what) {
  mp p;
  mp_init(&p, sp);
  if (one_expert) all_to_three(&p);
  smelt_plan *cplan = NULL, *gplan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &cplan));
  routed r;
  routed_new(&r, &p, cplan);
  const int64_t kept = ((int64_t *)r.offs.data)[p.E];
  const size_t es = smelt_dtype_size(p.xdt);
  arr dyp = arr_new(SMELT_DTYPE_F32, p.R * p.d, -1, 1);
  grads c, g;
  grads_new(&c, &p, th_cpu(), 0);
  grads_new(&g, &p, th_cuda(), 0);
  th_buf cdxp = th_buf_new(th_cpu(), (size_t)(p.R * p.d) * es);
  const smelt_tensor tdyp = host_tensor(dyp.h, SMELT_DTYPE_F32, 2, p.R, p.d, 0),
                     tdxp = host_tensor(cdxp.data, p.xdt, 2, p.R, p.d, 0);
  smelt_moe_grads gc = grads_view(&c), gg = grads_view(&g);
  gc.dx = &tdxp, gc.dwr = NULL, gc.dwnoise = NULL;
  CHECK_OK(smelt_moe_ffn_backward_run(cplan, &p.w, &r.txp, &r.toffs, &tdyp, &gc));
  dev_weights w;
  dev_all_new(&p, &w);
  dev gxp = dev_new(p.xdt, 2, p.R, p.d, r.xp.data), gof = dev_new(SMELT_DTYPE_I64, 1, p.E + 1, 0, r.offs.data),
      gdyp = dev_new(SMELT_DTYPE_F32, 2, p.R, p.d, dyp.h), gdxp = dev_new(p.xdt, 2, p.R, p.d, NULL);
  gg.dx = &gdxp.t, gg.dwr = NULL, gg.dwnoise = NULL;
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &w.w, &w.x.t, &gplan));
  CHECK_OK(smelt_moe_ffn_backward_run(gplan, &w.w, &gxp.t, &gof.t, &gdyp.t, &gg));
  char *hdxp = dev_read(&gdxp);
  char name[160];
  snprintf(name, sizeof name, "%s: dxp", what);
  compare_host(name, hdxp, p.xdt, cdxp.data, p.xdt, kept * p.d, bwd_bound(p.xdt));
  if (!th_all_ff(hdxp + (size_t)(kept * p.d) * es, (size_t)((p.R - kept) * p.d) * es))
    th_fail(__FILE__, __LINE__, "%s: dxp rows past offsets[E] written", what);
  for (int i = G_DW1; i < G_N; i++) {
    if (!c.on[i]) continue;
    int64_t n = 0, m = 0;
    double *got = grads_read(&g, i, &n), *ref = grads_read(&c, i, &m);
    snprintf(name, sizeof name, "%s: %s", what, grad_names[i]);
    CHECK(th_compare(name, got, ref, n, bwd_bound(p.xdt), 1e-6));
    free(got), free(ref);
  }
  free(hdxp);
  devs_free((dev[]){gxp, gof, gdyp, gdxp}, 4);
  th_buf_free(&cdxp);
  grads_free(&c), grads_free(&g);
  dev_weights_free(&w);
  arr_free(&dyp);
  routed_free(&r);
  smelt_plan_destroy(cplan);
  smelt_plan_destroy(gplan);
  mp_free(&p);
}

static void test_moe_bwd_gpu_ffn(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  const smelt_dtype bf = SMELT_DTYPE_BF16;
  spec s = {.T = 37, .d = 64, .E = 8, .k = 2, .F = 96, .xdt = bf, .wdt = bf};
  gpu_ffn_bwd_case(&s, 0, "ffn bwd T37 d64 F96 E8 top2 bf16");
  s = (spec){.T = 23, .d = 40, .E = 5, .k = 2, .F = 35, .xdt = bf, .wdt = bf};
  gpu_ffn_bwd_case(&s, 0, "ffn bwd bf16 F35: kept rows end mid 16-byte unit (the elementwise tails)");
  s = (spec){.T = 29, .d = 64, .E = 6, .k = 1, .F = 40, .xdt = bf, .wdt = bf, .bias = 1};
  gpu_ffn_bwd_case(&s, 1, "ffn bwd all tokens on expert 3 (five empty experts: zero weight gradients)");
  s = (spec){.T = 50, .d = 20, .E = 4, .k = 4, .F = 12, .ffn = SMELT_MOE_FFN_MLP, .act = SMELT_ACT_HARDSWISH, .b1 = 1};
  gpu_ffn_bwd_case(&s, 0, "ffn bwd k = E = 4 f32, mlp hardswish + b1");
  s = (spec){.T = 71, .d = 32, .E = 8, .k = 2, .F = 64, .xdt = SMELT_DTYPE_F16, .wdt = SMELT_DTYPE_F16,
             .ffn = SMELT_MOE_FFN_MLP, .act = SMELT_ACT_GELU_TANH, .b1 = 1, .cap = 0.8, .drop = SMELT_MOE_DROP_POSITION};
  gpu_ffn_bwd_case(&s, 0, "ffn bwd f16 mlp gelu_tanh + b1, capacity 0.8 position");
  s = (spec){.T = 300, .d = 128, .E = 8, .k = 2, .F = 192, .xdt = bf, .wdt = bf};
  gpu_ffn_bwd_case(&s, 0, "ffn bwd T300 d128 F192 bf16 (Hopper: the fused input gradient over g1 | g3)");
}

/* ---------------------------------------------------------------- refusals and the CPU */

/* What CUDA does not take (f64 routing tensors, which the CPU accepts) is
 * refused with UNSUPPORTED naming it, and nothing is written. */
static void test_moe_bwd_gpu_refused(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  spec s = {.T = 6, .d = 16, .E = 4, .k = 2, .F = 8};
  mp p;
  mp_init(&p, &s);
  dev_weights w;
  dev_all_new(&p, &w);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &w.w, &w.x.t, &plan));
  dev lg = dev_new(SMELT_DTYPE_F32, 2, p.T, p.E, NULL), dw64 = dev_new(SMELT_DTYPE_F64, 2, p.T, p.k, NULL),
      dl = dev_new(SMELT_DTYPE_F32, 2, p.T, p.E, NULL), dy = dev_new(p.xdt, 2, p.T, p.d, p.x.h),
      yp = dev_new(p.xdt, 2, p.R, p.d, NULL), rm = dev_new(SMELT_DTYPE_I32, 2, p.T, p.k, NULL),
      wt = dev_new(SMELT_DTYPE_F32, 2, p.T, p.k, NULL), dyp = dev_new(p.xdt, 2, p.R, p.d, NULL),
      dyp64 = dev_new(SMELT_DTYPE_F64, 2, p.R, p.d, NULL), of = dev_new(SMELT_DTYPE_I32, 1, p.E + 1, 0, NULL);
  CHECK_STATUS(smelt_moe_route_backward_run(plan, &w.w, &lg.t, &dw64.t, &dl.t), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("dweights must be f32 on CUDA");
  CHECK_STATUS(smelt_moe_unpermute_backward_run(plan, &dy.t, &yp.t, &rm.t, &wt.t, &dyp.t, &dw64.t),
               SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("dweights must be f32 on CUDA");
  const smelt_moe_grads g = {.dx = &dyp.t};
  CHECK_STATUS(smelt_moe_ffn_backward_run(plan, &w.w, &yp.t, &of.t, &dyp64.t, &g), SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("f64");
  CHECK(th_buf_untouched(&dl.b) && th_buf_untouched(&dyp.b) && th_buf_untouched(&yp.b));
  /* Without the expert weights the layer's backward is refused by the core. */
  smelt_moe_weights wr_only = {.wr = &w.wr.t};
  smelt_plan *rplan = NULL;
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &wr_only, &w.x.t, &rplan));
  dev dx = dev_new(p.xdt, 2, p.T, p.d, NULL);
  const smelt_moe_grads gx = {.dx = &dx.t};
  CHECK_STATUS(smelt_moe_backward_run(rplan, &wr_only, &w.x.t, &dy.t, &gx), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK(th_buf_untouched(&dx.b));
  smelt_plan_destroy(rplan);
  devs_free((dev[]){lg, dw64, dl, dy, yp, rm, wt, dyp, dyp64, of, dx}, 11);
  smelt_plan_destroy(plan);
  dev_weights_free(&w);
  mp_free(&p);
}

/* The saved runs on the CPU: no state (0 bytes), the plain runs' results;
 * a saved tensor of another dtype or size is refused with nothing written. */
static void test_moe_bwd_cpu_saved(void) {
  spec s = {.T = 13, .d = 8, .E = 4, .k = 2, .F = 6, .aux = 0.01};
  mp p;
  mp_init(&p, &s);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &plan));
  int64_t sb = -1;
  CHECK_OK(smelt_moe_saved_bytes(plan, &sb));
  CHECK_EQ_INT(sb, 0);
  uint8_t none[8];
  const int64_t zero[1] = {0}, five[1] = {5};
  const smelt_tensor saved = smelt_tensor_make(none, SMELT_DTYPE_U8, SMELT_DEVICE_CPU, 0, 1, zero),
                     saved5 = smelt_tensor_make(none, SMELT_DTYPE_U8, SMELT_DEVICE_CPU, 0, 1, five),
                     saved_f32 = smelt_tensor_make(none, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, zero);
  arr y1 = arr_new(p.xdt, p.T * p.d, 0, 0), y2 = arr_new(p.xdt, p.T * p.d, 0, 0), dy = arr_new(p.xdt, p.T * p.d, -1, 1);
  const smelt_tensor ty1 = host_tensor(y1.h, p.xdt, 2, p.T, p.d, 0), ty2 = host_tensor(y2.h, p.xdt, 2, p.T, p.d, 0),
                     tdy = host_tensor(dy.h, p.xdt, 2, p.T, p.d, 0);
  memset(y2.h, 0xFF, (size_t)(p.T * p.d) * smelt_dtype_size(p.xdt));
  CHECK_STATUS(smelt_moe_forward_save_run(plan, &p.w, &p.tx, &ty2, &saved5, NULL), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("saved");
  CHECK_STATUS(smelt_moe_forward_save_run(plan, &p.w, &p.tx, &ty2, &saved_f32, NULL), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK(th_all_ff(y2.h, (size_t)(p.T * p.d) * smelt_dtype_size(p.xdt)));
  CHECK_STATUS(smelt_moe_forward_save_run(plan, &p.w, &p.tx, &ty2, NULL, NULL), SMELT_STATUS_NULL_POINTER);
  /* The routing's other fields stay in saved: asking for them is refused. */
  double lg[13 * 4];
  const smelt_tensor tlg = host_tensor(lg, p.rdt, 2, p.T, p.E, 0);
  const smelt_moe_routing bad = {.logits = &tlg};
  CHECK_STATUS(smelt_moe_forward_save_run(plan, &p.w, &p.tx, &ty2, &saved, &bad), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("saved keeps them");
  CHECK(th_all_ff(y2.h, (size_t)(p.T * p.d) * smelt_dtype_size(p.xdt)));
  int64_t c1[4] = {0}, c2[4] = {0};
  double a1[2] = {0}, a2[2] = {0}; /* aux in the routing dtype: f32 fills half */
  const smelt_tensor tc1 = host_tensor(c1, SMELT_DTYPE_I64, 1, p.E, 0, 0), tc2 = host_tensor(c2, SMELT_DTYPE_I64, 1, p.E, 0, 0),
                     ta1 = host_tensor(a1, p.rdt, 1, 2, 0, 0), ta2 = host_tensor(a2, p.rdt, 1, 2, 0, 0);
  const smelt_moe_routing r1 = {.counts = &tc1, .aux = &ta1}, r2 = {.counts = &tc2, .aux = &ta2};
  CHECK_OK(smelt_moe_forward_run(plan, &p.w, &p.tx, &ty1, &r1, NULL));
  CHECK_OK(smelt_moe_forward_save_run(plan, &p.w, &p.tx, &ty2, &saved, &r2));
  CHECK(memcmp(y1.h, y2.h, (size_t)(p.T * p.d) * smelt_dtype_size(p.xdt)) == 0);
  CHECK(memcmp(c1, c2, sizeof c1) == 0 && memcmp(a1, a2, sizeof a1) == 0);
  grads a, b;
  grads_new(&a, &p, th_cpu(), 0);
  grads_new(&b, &p, th_cpu(), 0);
  const smelt_moe_grads ga = grads_view(&a), gb = grads_view(&b);
  CHECK_OK(smelt_moe_backward_run(plan, &p.w, &p.tx, &tdy, &ga));
  CHECK_STATUS(smelt_moe_backward_saved_run(plan, &p.w, &p.tx, &tdy, &saved5, &gb), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_OK(smelt_moe_backward_saved_run(plan, &p.w, &p.tx, &tdy, &saved, &gb));
  CHECK(grads_same(&a, &b));
  grads_free(&a), grads_free(&b);
  arr_free(&y1), arr_free(&y2), arr_free(&dy);
  smelt_plan_destroy(plan);
  mp_free(&p);
}

/* The FFN backward over no rows, the rows' tensors empty with NULL data:
 * zero weight gradients, and no offset applied to the NULL pointers (a
 * fuzz finding: UBSan's pointer-overflow check in the weight gradients). */
static void test_moe_bwd_cpu_ffn_empty(void) {
  spec s = {.T = 0, .d = 8, .E = 4, .k = 2, .F = 6};
  mp p;
  mp_init(&p, &s);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &plan));
  int64_t offs[5] = {0};
  const smelt_tensor rows = host_tensor(NULL, p.xdt, 2, 0, p.d, 0),
                     to = host_tensor(offs, SMELT_DTYPE_I64, 1, p.E + 1, 0, 0);
  grads g;
  grads_new(&g, &p, th_cpu(), 0);
  memset(g.b[G_DW1].data, 0xFF, g.b[G_DW1].bytes);
  smelt_moe_grads gv = grads_view(&g);
  gv.dwr = NULL;
  CHECK_OK(smelt_moe_ffn_backward_run(plan, &p.w, &rows, &to, &rows, &gv));
  int64_t n = 0;
  double *dw1 = grads_read(&g, G_DW1, &n);
  CHECK_EQ_INT(n, p.E * p.d * p.F);
  for (int64_t i = 0; i < n; i++) CHECK(dw1[i] == 0);
  free(dw1);
  grads_free(&g);
  smelt_plan_destroy(plan);
  mp_free(&p);
}

/* The CPU reference's backward repeats bit for bit (fixed summation orders). */
static void test_moe_bwd_cpu_repeat(void) {
  spec s = {.T = 19, .d = 12, .E = 6, .k = 2, .F = 10, .aux = 0.01, .z = 0.001, .noise = 1, .cap = 0.9,
            .drop = SMELT_MOE_DROP_PROBS};
  mp p;
  mp_init(&p, &s);
  arr dy = arr_new(p.xdt, p.T * p.d, -1, 1);
  const smelt_tensor tdy = host_tensor(dy.h, p.xdt, 2, p.T, p.d, 0);
  grads a, b;
  grads_new(&a, &p, th_cpu(), 2);
  grads_new(&b, &p, th_cpu(), 2);
  const smelt_moe_grads ga = grads_view(&a), gb = grads_view(&b);
  CHECK_OK(smelt_moe_backward(th_cpu(), &p.cfg, &p.w, &p.tx, &tdy, &ga));
  CHECK_OK(smelt_moe_backward(th_cpu(), &p.cfg, &p.w, &p.tx, &tdy, &gb));
  CHECK(grads_same(&a, &b));
  int64_t n = 0;
  free(grads_read(&a, G_DX, &n));
  grads_free(&a), grads_free(&b);
  arr_free(&dy);
  mp_free(&p);
}

const th_test th_tests_moe_bwd[] = {
    {"cpu_repeat", test_moe_bwd_cpu_repeat},
    {"cpu_saved", test_moe_bwd_cpu_saved},
    {"cpu_ffn_empty", test_moe_bwd_cpu_ffn_empty},
    {"gpu_layer", test_moe_bwd_gpu_layer},
    {"gpu_router", test_moe_bwd_gpu_router},
    {"gpu_combine", test_moe_bwd_gpu_combine},
    {"gpu_ffn", test_moe_bwd_gpu_ffn},
    {"gpu_refused", test_moe_bwd_gpu_refused},
    {0, 0},
};
