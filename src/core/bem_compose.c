/* The BEM backward composed from smelt's own ops, for a backend without a
 * fused backward kernel (CUDA, one adapter): the GEMM engine for the five
 * products and the BEM op itself for the three Hadamard products (a BEM
 * call with identity V and U is s·x∘codes, one pass over its operands).
 * With dH' = dy·U (so dH = s·dH'):
 *   A = x·V;  Hs = s·A∘codes;  dcodes = s·dH'∘A;  dA = s·dH'∘codes;
 *   dV = xᵀ·dA;  dx = dA·Vᵀ;  dU = dyᵀ·Hs.
 * The four [M, r] intermediates live in the input dtype, as an autograd
 * engine keeps them, in scratch taken from the context for each run. It
 * uses only public entry points, so it runs on any context (the CPU tests
 * check the composition there). Segments are not composable this way (dV
 * and dU would sum over each adapter's rows): the caller refuses them. */
#include "bem_internal.h"

#include <stdio.h>
#include <stdlib.h>

/* The sub-plans, by step. */
enum { P_A, P_DH, P_HS, P_DCODES, P_DA, P_DV, P_DX, P_DU, P_COUNT };
enum { S_A, S_DH, S_HS, S_DA, S_COUNT }; /* the [M, r] scratch */

typedef struct compose {
  smelt_ctx *ctx;
  smelt_plan *p[P_COUNT];
  void *eye; /* the identity [r, r] in the dtype */
} compose;

static void compose_free(void *p) {
  compose *c = (compose *)p;
  if (!c) return;
  for (int i = 0; i < P_COUNT; i++) smelt_plan_destroy(c->p[i]);
  if (c->eye) smelt_free(c->ctx, c->eye);
  free(c);
}

/* The views one call uses: the caller's tensors, the scratch at `mem`
 * (NULL when planning: only the layout matters), the identity, and the
 * transposed views the products need. */
typedef struct views {
  smelt_tensor s[S_COUNT], eye, xt, vt, dyt;
} views;

static void make_views(const smelt__bem_state *st, const smelt_ctx *ctx, const smelt_tensor *const *t, void *mem,
                       void *eye, views *w) {
  const smelt_dtype dt = t[SMELT__BT_X]->dtype;
  const int64_t mr[2] = {st->M, st->r}, rr[2] = {st->r, st->r};
  const size_t bytes = (size_t)(st->M * st->r) * smelt_dtype_size(dt);
  for (int i = 0; i < S_COUNT; i++)
    w->s[i] = smelt_tensor_make(mem ? (char *)mem + i * bytes : NULL, dt, ctx->device, ctx->device_index, 2, mr);
  w->eye = smelt_tensor_make(eye, dt, ctx->device, ctx->device_index, 2, rr);
  w->xt = smelt__tensor_swap_axes(t[SMELT__BT_X], 0, 1);
  w->vt = smelt__tensor_swap_axes(t[SMELT__BT_V], 0, 1);
  w->dyt = smelt__tensor_swap_axes(t[SMELT__BT_DY], 0, 1);
}

/* The Hadamard steps' inputs: x·I ∘ codes · I. */
static smelt_bem_inputs hadamard(const smelt_tensor *x, const smelt_tensor *codes, const views *w,
                                 const smelt_tensor *scales) {
  return (smelt_bem_inputs){x, &w->eye, codes, &w->eye, NULL, scales};
}

/* Step i of the composition: plans it (plan_it) or runs it. */
static smelt_status step(compose *c, int i, int plan_it, const smelt__bem_state *st, const smelt_tensor *const *t,
                         const views *w) {
  const smelt_tensor *x = t[SMELT__BT_X], *v = t[SMELT__BT_V], *u = t[SMELT__BT_U], *dy = t[SMELT__BT_DY];
  const smelt_tensor *codes = t[SMELT__BT_CODES], *scales = t[SMELT__BT_SCALES];
  smelt_gemm_desc g = smelt_gemm_desc_default();
  smelt_bem_desc h = st->desc;
  h.accumulate = 0;
  const smelt_tensor *ga = NULL, *gb = NULL, *gd = NULL, *hx = NULL, *hc = NULL, *hy = NULL;
  switch (i) {
    case P_A: ga = x, gb = v, gd = &w->s[S_A]; break;
    case P_DH: ga = dy, gb = u, gd = &w->s[S_DH]; break;
    case P_HS: hx = &w->s[S_A], hc = codes, hy = &w->s[S_HS]; break;
    case P_DCODES: hx = &w->s[S_DH], hc = &w->s[S_A], hy = t[SMELT__BT_DCODES]; break;
    case P_DA: hx = &w->s[S_DH], hc = codes, hy = &w->s[S_DA]; break;
    case P_DV: ga = &w->xt, gb = &w->s[S_DA], gd = t[SMELT__BT_DV]; break;
    case P_DX: ga = &w->s[S_DA], gb = &w->vt, gd = t[SMELT__BT_DX]; break;
    default: ga = &w->dyt, gb = &w->s[S_HS], gd = t[SMELT__BT_DU]; break;
  }
  if (!gd && !hy) return SMELT_OK; /* a gradient not asked for */
  if (gd)
    return plan_it ? smelt_gemm_plan(c->ctx, &g, ga, gb, NULL, gd, NULL, &c->p[i])
                   : smelt_gemm_run(c->p[i], ga, gb, NULL, gd, NULL);
  const smelt_bem_inputs in = hadamard(hx, hc, w, scales);
  return plan_it ? smelt_bem_plan(c->ctx, &h, &in, hy, &c->p[i]) : smelt_bem_run(c->p[i], &in, hy);
}

/* Plans or runs every step, with fresh scratch from the context (planning
 * too: plans want real views). */
static smelt_status steps(compose *c, int plan_it, const smelt__bem_state *st, const smelt_tensor *const *t) {
  const size_t bytes = (size_t)(st->M * st->r) * smelt_dtype_size(t[SMELT__BT_X]->dtype);
  void *mem = NULL;
  smelt_status s = smelt_alloc(c->ctx, S_COUNT * bytes + 16, &mem);
  if (s) return s;
  views w;
  make_views(st, c->ctx, t, mem, c->eye, &w);
  for (int i = 0; i < P_COUNT && !s; i++) s = step(c, i, plan_it, st, t, &w);
  smelt_free(c->ctx, mem);
  return s;
}

smelt_status smelt__bem_compose_plan(smelt_plan *plan, const smelt_tensor *const *t) {
  const smelt__bem_state *st = (const smelt__bem_state *)plan->opdata;
  compose *c = (compose *)calloc(1, sizeof *c);
  if (!c) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_bem_backward: out of host memory");
  c->ctx = plan->ctx;
  plan->backend = c;
  plan->backend_free = compose_free;
  const smelt_dtype dt = t[SMELT__BT_X]->dtype;
  const size_t es = smelt_dtype_size(dt), rr = (size_t)(st->r * st->r);
  unsigned char *eye = (unsigned char *)calloc(rr, es);
  if (!eye) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_bem_backward: out of host memory");
  for (int64_t j = 0; j < st->r; j++) smelt__store_f64(eye, dt, j * st->r + j, 1.0);
  /* 16 bytes past the end: the kernel's cp.async of a short tail (src-size
   * below 16) names a 16-byte source, which compute-sanitizer checks in full
   * (a rank-1 identity is 2 bytes). */
  smelt_status s = smelt_alloc(c->ctx, rr * es + 16, &c->eye);
  if (!s) s = smelt_memcpy_h2d(c->ctx, c->eye, eye, rr * es);
  free(eye);
  if (!s) s = steps(c, 1, st, t);
  if (!s)
    snprintf(plan->describe, sizeof plan->describe,
             "bem backward %s M=%lld r=%lld composed: 5 GEMMs and 3 BEM Hadamard passes", smelt_dtype_name(dt),
             (long long)st->M, (long long)st->r);
  return s;
}

smelt_status smelt__bem_compose_run(smelt_plan *plan, const smelt_tensor *const *t) {
  return steps((compose *)plan->backend, 0, (const smelt__bem_state *)plan->opdata, t);
}
