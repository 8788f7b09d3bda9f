/* The MoE's three fused expert products on the Hopper GEMM kernel
 * (kernels/gemm_sm90.cu, GEMM_GLU, GEMM_DGLU and GEMM_KCAT), grouped by the device
 * offsets as smelt_gemm_grouped_offs runs them (A over all rows, B a 3-D
 * map with the expert as z, one persistent CTA an SM):
 *   glu   a = silu(xp·W1ₑ)·(xp·W3ₑ) in one GEMM whose tiles hold the gate's
 *         and the up projection's columns side by side, so h1 and h3 reach
 *         HBM only when the backward keeps them (keep [rows, 2F]: h1 in its
 *         columns 0 .. F-1, h3 in F .. 2F-1), and SwiGLU's own pass (two
 *         reads and a write of [rows, F]) is gone;
 *   dglu  dA = dyp·W2ₑᵀ with SwiGLU's backward in its epilogue: from h1 and
 *         h3 (h13, through B2's map: the kernel loads them into its ring
 *         after each tile's K steps) it stores dh1 | dh3 (g13, which may be
 *         h13) and a = silu(h1)·h3 (for dW2), so dA is never written and
 *         read back;
 *   kcat  dxp = g1·W1ₑᵀ + g3·W3ₑᵀ as one GEMM over K = 2F (g13 = [g1 | g3]
 *         [rows, 2F], W1ₑᵀ's rows then W3ₑᵀ's), one f32 part instead of two
 *         written and read back.
 * Taken where they fit (fits_plan, smelt__moe_sm90_fits); otherwise the
 * callers run the separate GEMMs and the SwiGLU kernels. */
#include "moe_cuda.h"

#include <stdio.h>
#include <string.h>

/* The three products: their kernel's prelude switch and name. */
enum { P_GLU, P_DGLU, P_KCAT, P_COUNT };
static const char *const switches[P_COUNT] = {"GEMM_GLU", "GEMM_DGLU", "GEMM_KCAT"};
static const char *const tags[P_COUNT] = {"glu", "dglu", "kcat"};

/* The tile: 128 rows (two consumers) by 256 accumulator columns, 4 stages,
 * A K-major; B MN-major for glu (W1 as [d, F] rows), K-major (Wᵀ) else. */
static smelt__gemm_kernel kernel_of(int tc, int prod) {
  return smelt__gemm_sm90_kernel(tc, 2, 256, 4, 1, prod != P_GLU, 0);
}

static void make_src(int tc, int prod, smelt__kernel_src *src) {
  const smelt__gemm_kernel k = kernel_of(tc, prod);
  smelt__gemm_kernel_src(&k, src);
  const size_t len = strlen(src->name);
  snprintf(src->name + len, sizeof src->name - len, "_moe_%s", tags[prod]);
  smelt__prelude_define(src, switches[prod], 1);
}

int smelt__moe_sm90_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++)
    for (int prod = 0; prod < P_COUNT; prod++, n++)
      if (n < max) make_src(tc, prod, &out[n]);
  return n;
}

/* The plan's part of the rule: Hopper, a 16-bit SwiGLU without b1, F a
 * whole number of 64-column pieces and K steps, d of 16-byte rows. */
static int fits_plan(const smelt_ctx *ctx, const smelt__moe_state *ms) {
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  return ctx->cuda->info.cc_major == 9 && ctx->cuda->info.cc_minor == 0 && ms->cfg.ffn == SMELT_MOE_FFN_SWIGLU &&
         (xdt == SMELT_DTYPE_BF16 || xdt == SMELT_DTYPE_F16) && ms->t[SMELT__MT_B1].ndim < 0 && ms->F % 64 == 0 &&
         ms->d % 8 == 0 && ms->rows > 0;
}

smelt_status smelt__moe_sm90_load(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_sm90 *m) {
  memset(m, 0, sizeof *m);
  if (!fits_plan(ctx, ms)) return SMELT_OK;
  const int tc = ms->t[SMELT__MT_X].dtype == SMELT_DTYPE_BF16 ? SMELT__TC_BF16 : SMELT__TC_F16;
  CUfunction *f[P_COUNT] = {&m->glu, &m->dglu, &m->kcat};
  smelt_status s = SMELT_OK;
  for (int prod = 0; prod < P_COUNT && !s; prod++) {
    smelt__kernel_src src;
    make_src(tc, prod, &src);
    s = smelt__cuda_function(ctx, &src, "gemm_sm90", f[prod]);
  }
  if (s) m->glu = m->dglu = m->kcat = NULL;
  else m->k = kernel_of(tc, P_GLU); /* threads and shared memory: the same for all */
  return s;
}

/* A weight [E, d, F] as TMA reads it: x's dtype, unit column stride, rows
 * and experts 16-byte aligned apart, the data 16-byte aligned. */
static int weight_ok(const smelt_tensor *w, smelt_dtype xdt) {
  return w && w->dtype == xdt && w->strides[2] == 1 && (w->strides[1] * 2) % 16 == 0 && (w->strides[0] * 2) % 16 == 0 &&
         (uintptr_t)w->data % 16 == 0;
}

/* A [rows, cols] matrix of dtype dt with 16-byte rows. */
static int mat_ok(const smelt_tensor *x, smelt_dtype dt) {
  const int64_t es = (int64_t)smelt_dtype_size(dt);
  return x->dtype == dt && x->strides[1] == 1 && (x->strides[0] * es) % 16 == 0 && (uintptr_t)x->data % 16 == 0;
}

int smelt__moe_sm90_fits(const smelt__moe_sm90 *m, const smelt__moe_state *ms, const smelt_tensor *const *t,
                         const smelt_tensor *a) {
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  return m->glu && weight_ok(t[SMELT__MT_W1], xdt) && weight_ok(t[SMELT__MT_W3], xdt) &&
         weight_ok(t[SMELT__MT_W2], xdt) && (!a || mat_ok(a, xdt));
}

/* The grouped-by-offsets launch of f: D (rows d_rs apart) = A·B over all
 * rows, the output's n columns tile_n a tile, K = k, the operands in maps
 * (A, B, D, B2, keep: kernels/gemm_sm90.cu's order), x the second B's
 * parameters. */
static smelt_status launch(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_sm90 *m, CUfunction f,
                           const smelt_tensor *offsets, smelt_dtype ab, int64_t n, int tile_n, int64_t k,
                           const smelt_tensor *d, smelt__cu_tensor_map maps[5], smelt__moe_b2 *x) {
  smelt__gemm_kparams kp;
  memset(&kp, 0, sizeof kp);
  kp.p.m = ms->rows;
  kp.p.n = n;
  kp.p.k = k;
  kp.p.d = (uint64_t)(uintptr_t)d->data;
  kp.p.d_rs = d->strides[0];
  kp.p.d_cs = 1;
  kp.alpha_ab = 1.0;
  kp.scale_d = 1.0f;
  kp.dt_a = kp.dt_b = kp.dt_bias = ab;
  kp.dt_c = kp.dt_d = d->dtype;
  kp.act = SMELT_ACT_IDENTITY;
  kp.swizzle = 8;
  kp.splits = 1;
  /* the row ends: offsets past their leading 0 */
  const char *ends = (const char *)offsets->data + smelt_dtype_size(offsets->dtype);
  smelt_status s = smelt__gemm_offs_grid(ctx, MOE_OP, 1, ms->rows, n, m->k.bm, tile_n, ms->E, ends,
                                         offsets->dtype == SMELT_DTYPE_I64, &kp);
  if (s) return s;
  int fast = 1;
  const void *gmaps = NULL;
  void *params[] = {&maps[0], &maps[1], &maps[2], &kp, &fast, &gmaps, &maps[3], &maps[4], x};
  return smelt__gemm_sm90_launch(ctx, MOE_OP, &m->k, f, (int64_t)kp.tiles_m * kp.tiles_n, params);
}

/* W [E, rows, cols] (unit column stride) as a 3-D map with boxes of
 * box_rows x 64: W1 and W3 MN-major as [d, F] (panels of 64 x 64), Wᵀ
 * K-major as [N rows, K] (boxes of 256 rows). */
static smelt_status weight_map(smelt__cu_tensor_map *map, const smelt_tensor *w, int64_t E, int box_rows) {
  return smelt__gemm_tensor_map_batched(map, w->dtype, w->data, w->shape[1], w->shape[2], w->strides[1], E,
                                        w->strides[0], box_rows, 64);
}

smelt_status smelt__moe_glu_run(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_sm90 *m,
                                const smelt_tensor *const *t, const smelt_tensor *xp, const smelt_tensor *offsets,
                                const smelt_tensor *keep, const smelt_tensor *a) {
  const smelt_dtype xdt = xp->dtype;
  smelt__cu_tensor_map maps[5];
  memset(maps, 0, sizeof maps);
  smelt__moe_b2 x = {0};
  smelt_status s;
  if ((s = smelt__gemm_tensor_map(&maps[0], xdt, xp->data, ms->rows, ms->d, xp->strides[0], 128, 64)) ||
      (s = weight_map(&maps[1], t[SMELT__MT_W1], ms->E, 64)) ||
      (s = smelt__gemm_tensor_map(&maps[2], xdt, a->data, ms->rows, ms->F, a->strides[0], 64, 64)) ||
      (s = weight_map(&maps[3], t[SMELT__MT_W3], ms->E, 64)))
    return s;
  if (keep) {
    if ((s = smelt__gemm_tensor_map(&maps[4], xdt, keep->data, ms->rows, 2 * ms->F, keep->strides[0], 64, 64)))
      return s;
    x.keep = (uint64_t)(uintptr_t)keep->data;
    x.keep_rs = keep->strides[0];
    x.keep_up = ms->F;
  }
  return launch(ctx, ms, m, m->glu, offsets, xdt, ms->F, 128, ms->d, a, maps, &x);
}

smelt_status smelt__moe_kcat_run(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_sm90 *m,
                                 const smelt_tensor *const *t, const smelt_tensor *g13, const smelt_tensor *offsets,
                                 const smelt_tensor *part) {
  const smelt_dtype xdt = g13->dtype;
  smelt__cu_tensor_map maps[5];
  memset(maps, 0, sizeof maps);
  smelt__moe_b2 x = {.kcat = ms->F};
  smelt_status s;
  if ((s = smelt__gemm_tensor_map(&maps[0], xdt, g13->data, ms->rows, 2 * ms->F, g13->strides[0], 128, 64)) ||
      (s = weight_map(&maps[1], t[SMELT__MT_W1], ms->E, 256)) ||
      (s = smelt__gemm_tensor_map(&maps[2], SMELT_DTYPE_F32, part->data, ms->rows, ms->d, part->strides[0], 64, 32)) ||
      (s = weight_map(&maps[3], t[SMELT__MT_W3], ms->E, 256)))
    return s;
  maps[4] = maps[2]; /* no keep */
  return launch(ctx, ms, m, m->kcat, offsets, xdt, ms->d, 256, 2 * ms->F, part, maps, &x);
}

smelt_status smelt__moe_dglu_run(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_sm90 *m,
                                 const smelt_tensor *const *t, const smelt_tensor *dyp, const smelt_tensor *offsets,
                                 const smelt_tensor *h13, const smelt_tensor *g13, const smelt_tensor *a) {
  const smelt_dtype xdt = h13->dtype;
  smelt__cu_tensor_map maps[5];
  memset(maps, 0, sizeof maps);
  smelt_status s;
  if ((s = smelt__gemm_tensor_map(&maps[0], xdt, dyp->data, ms->rows, ms->d, dyp->strides[0], 128, 64)) ||
      (s = weight_map(&maps[1], t[SMELT__MT_W2], ms->E, 256)) ||
      (s = smelt__gemm_tensor_map(&maps[2], xdt, a->data, ms->rows, ms->F, a->strides[0], 64, 64)) ||
      (s = smelt__gemm_tensor_map(&maps[3], xdt, h13->data, ms->rows, 2 * ms->F, h13->strides[0], 64, 64)) ||
      (s = smelt__gemm_tensor_map(&maps[4], xdt, g13->data, ms->rows, 2 * ms->F, g13->strides[0], 64, 64)))
    return s;
  smelt__moe_b2 x = {.keep = (uint64_t)(uintptr_t)g13->data, .keep_rs = g13->strides[0], .keep_up = ms->F};
  return launch(ctx, ms, m, m->dglu, offsets, xdt, ms->F, 256, ms->d, a, maps, &x);
}
