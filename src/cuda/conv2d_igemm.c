/* Conv2d on CUDA as implicit GEMM: the GEMM engine's mma.sync kernel
 * (kernels/gemm_sm80.cu) with the gathered operand loaded by
 * kernels/conv2d_igemm.cuh, so every epilogue, split-K and the tile
 * pipeline are the GEMM's own. Taken for f16 and bf16 when the gathered
 * tensors' channels are a multiple of 8 (a 16-byte chunk never crosses a
 * tap), their other strides 16-byte multiples, the plain operand K-major
 * or MN-major as its kind needs, and C and D collapsible to the GEMM's
 * [M, N] matrix; everything else runs the reference kernel, and the plan's
 * description says which ran. The gather finds each chunk's tap by
 * division, the analytic iterator; every iterator takes it (they differ
 * only in how a kernel walks the taps, and AUTO picks fixed channels for
 * an f16 or bf16 fprop with C = 8). */
#include "conv2d_cuda.h"
#include "gemm_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* kernels/conv2d_igemm.cuh's conv_geom, field for field. */
typedef struct smelt__conv_kgeom {
  uint64_t x;
  int64_t xs_n, xs_h, xs_w;
  uint64_t wt;
  int64_t ws_k, ws_r, ws_s;
  int xh, xw, xc;
  int oh, ow;
  int r, s;
  int pad_h, pad_w, st_h, st_w, dil_h, dil_w;
  int pad;
} smelt__conv_kgeom;

_Static_assert(sizeof(smelt__conv_kgeom) == 120, "smelt__conv_kgeom must match conv_geom");

/* The GEMM tiles it takes: 128 x 128 (8 warps), and 64 x 64 for problems
 * with fewer such tiles than SMs. */
static const int tile_bm[2] = {128, 64};

smelt_status smelt__conv2d_load_reduce(smelt_plan *plan) {
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int tn = smelt__gemm_table(table);
  smelt__kernel_src src;
  smelt__gemm_kernel_src(&table[smelt__gemm_reduce_kernel(table, tn, SMELT_GEMM_ACC_F32)], &src);
  CUfunction f;
  smelt_status s = smelt__cuda_function(plan->ctx, &src, "gemm_reduce", &f);
  if (!s) plan->func[SMELT__CONV_F_REDUCE] = f;
  return s;
}

void smelt__conv2d_take(smelt_plan *plan, void *backend, const char *kernel, const char *split, int splits) {
  plan->backend = backend;
  plan->backend_free = free;
  char core[sizeof plan->describe];
  snprintf(core, sizeof core, "%s", plan->describe);
  snprintf(plan->describe, sizeof plan->describe, "implicit GEMM %.64s, %s x%d: %.120s", kernel, split, splits, core);
}

/* What the plan decided (plan->backend). */
typedef struct igemm_plan {
  smelt__gemm_kernel k;
  int64_t m, n, kk;    /* the GEMM */
  int splits, mode;    /* SMELT__KMODE_PLAIN, _SERIAL or _PARALLEL */
  int64_t k_slice;
} igemm_plan;

/* The table's mma.sync kernel for 16-bit tc, the kind's layouts and tile t. */
static int table_kernel(int tc, smelt_conv2d_kind kind, int t, smelt__gemm_kernel *out) {
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int n = smelt__gemm_table(table);
  /* fprop: A K-major (gathered), B K-major (w); dgrad: A K-major, B MN-major
   * (both gathered); wgrad: A MN-major (dy), B MN-major (gathered). */
  const int ak = kind != SMELT_CONV2D_WGRAD, bk = kind == SMELT_CONV2D_FPROP;
  for (int i = 0; i < n; i++) {
    const smelt__gemm_kernel *k = &table[i];
    if (k->fam == SMELT__GK_SM80 && k->tc == tc && k->a_kmajor == ak && k->b_kmajor == bk && k->bm == tile_bm[t] &&
        k->bn == tile_bm[t]) {
      *out = *k;
      return 1;
    }
  }
  return 0;
}

static const char *const kind_tags[SMELT_CONV2D_KIND_COUNT] = {"fprop", "dgrad", "wgrad"};

static void make_src(const smelt__gemm_kernel *k, smelt_conv2d_kind kind, smelt__kernel_src *src) {
  smelt__gemm_kernel_src(k, src);
  const size_t len = strlen(src->name);
  snprintf(src->name + len, sizeof src->name - len, "_conv_%s", kind_tags[kind]);
  smelt__prelude_define(src, "GEMM_CONV", (int)kind + 1);
}

int smelt__conv2d_igemm_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++)
    for (int kind = 0; kind < SMELT_CONV2D_KIND_COUNT; kind++)
      for (int t = 0; t < 2; t++) {
        smelt__gemm_kernel k;
        if (!table_kernel(tc, (smelt_conv2d_kind)kind, t, &k)) continue;
        if (n < max) make_src(&k, (smelt_conv2d_kind)kind, &out[n]);
        n++;
      }
  return n;
}

/* ---------------------------------------------------------------- preconditions */

int smelt__conv2d_gatherable(const smelt_tensor *x) {
  return x->shape[3] % 8 == 0 && x->strides[3] == 1 && x->strides[0] % 8 == 0 && x->strides[1] % 8 == 0 &&
         x->strides[2] % 8 == 0;
}

int64_t smelt__conv2d_fold(const smelt_tensor *t, int i0, int i1) {
  int64_t stride = t->strides[i1], extent = t->shape[i1];
  for (int j = i1 - 1; j >= i0; j--) {
    if (t->shape[j] == 1) continue;
    if (extent == 1) {
      stride = t->strides[j], extent = t->shape[j];
      continue;
    }
    if (t->strides[j] != extent * stride) return -1;
    extent *= t->shape[j];
  }
  return stride;
}

int smelt__conv2d_as_matrix(const smelt_tensor *t, int wgrad, int64_t *rs, int64_t *cs) {
  *rs = wgrad ? t->strides[0] : smelt__conv2d_fold(t, 0, 2);
  *cs = wgrad ? smelt__conv2d_fold(t, 1, 3) : t->strides[3];
  return *rs >= 0 && *cs >= 0;
}

static int fits_int(int64_t v) { return v >= 0 && v < ((int64_t)1 << 31); }

/* Whether the implicit GEMM serves this plan's problem; its GEMM sizes. */
static int serves(const smelt_plan *plan, const smelt_tensor *t, int64_t *m, int64_t *n, int64_t *kk) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_conv2d_desc *d = &st->desc;
  const smelt_tensor *a = &t[SMELT__CONV2D_A], *b = &t[SMELT__CONV2D_B], *dd = &t[SMELT__CONV2D_D];
  if ((a->dtype != SMELT_DTYPE_F16 && a->dtype != SMELT_DTYPE_BF16) || d->math == SMELT_GEMM_MATH_TF32) return 0;
  int64_t rs, cs;
  switch (d->kind) {
    case SMELT_CONV2D_FPROP: /* x gathered; w [K, RSC] K-major */
      if (!smelt__conv2d_gatherable(a) || smelt__conv2d_fold(b, 1, 3) != 1 || b->strides[0] % 8 != 0) return 0;
      *m = st->n * st->p * st->q, *n = st->k, *kk = st->r * st->s * st->c;
      break;
    case SMELT_CONV2D_DGRAD: /* dy gathered; w gathered by rows (r, s, k) of C */
      if (!smelt__conv2d_gatherable(a) || !smelt__conv2d_gatherable(b)) return 0;
      *m = st->n * st->h * st->w, *n = st->c, *kk = st->r * st->s * st->k;
      break;
    default: /* wgrad: dy as [NPQ, K] MN-major; x gathered */
      if (a->strides[3] != 1 || a->shape[3] % 8 != 0 || smelt__conv2d_fold(a, 0, 2) < 0 || smelt__conv2d_fold(a, 0, 2) % 8 != 0 ||
          !smelt__conv2d_gatherable(b))
        return 0;
      *m = st->k, *n = st->r * st->s * st->c, *kk = st->n * st->p * st->q;
      break;
  }
  if (!smelt__conv2d_as_matrix(dd, d->kind == SMELT_CONV2D_WGRAD, &rs, &cs)) return 0;
  if (st->has_c && !smelt__conv2d_as_matrix(&t[SMELT__CONV2D_C], d->kind == SMELT_CONV2D_WGRAD, &rs, &cs)) return 0;
  /* Every index the gather computes fits an int; so do the image sizes. */
  return fits_int(*m) && fits_int(*n) && fits_int(*kk + 64) && fits_int(st->n * st->h * st->w) &&
         fits_int(st->n * st->p * st->q);
}

smelt_status smelt__conv2d_igemm_plan(smelt_plan *plan, const smelt_tensor *t, int *taken) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_conv2d_desc *d = &st->desc;
  *taken = 0;
  int64_t m, n, kk;
  if (!serves(plan, t, &m, &n, &kk)) return SMELT_OK;
  const int tc = t[SMELT__CONV2D_A].dtype == SMELT_DTYPE_F16 ? SMELT__TC_F16 : SMELT__TC_BF16;
  const int64_t sms = plan->ctx->cuda->info.sm_count;
  /* The large tile unless it leaves SMs idle that the small one would fill. */
  const int64_t big = smelt__ceil_div(m, tile_bm[0]) * smelt__ceil_div(n, tile_bm[0]);
  const int ti = big >= sms ? 0 : 1;
  igemm_plan *ip = (igemm_plan *)calloc(1, sizeof *ip);
  if (!ip) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_conv2d: the plan's launch record");
  if (!table_kernel(tc, d->kind, ti, &ip->k)) {
    free(ip);
    return SMELT_OK;
  }
  ip->m = m, ip->n = n, ip->kk = kk;
  const int64_t tiles = smelt__ceil_div(m, ip->k.bm) * smelt__ceil_div(n, ip->k.bn);
  const int64_t ktiles = smelt__ceil_div(kk, ip->k.bk);
  int64_t splits = d->split_k_slices;
  if (st->auto_split) {
    /* Few output tiles and a long K (wgrad's NPQ): slices of >= 8 K tiles
     * until about two waves, added in slice order (serial: deterministic,
     * one kernel). */
    splits = 1;
    while (tiles * splits < 2 * sms && ktiles / (splits * 2) >= 8 && splits * 2 <= SMELT_GEMM_MAX_SPLIT_K) splits *= 2;
  }
  ip->k_slice = smelt__ceil_div(smelt__ceil_div(kk, splits), ip->k.bk) * ip->k.bk;
  ip->splits = (int)(kk > 0 ? smelt__ceil_div(kk, ip->k_slice) : 1);
  ip->mode = ip->splits == 1                                      ? SMELT__KMODE_PLAIN
             : d->split_k_mode == SMELT_CONV2D_SPLIT_K_PARALLEL ? SMELT__KMODE_PARALLEL
                                                                : SMELT__KMODE_SERIAL;
  smelt__kernel_src src;
  make_src(&ip->k, d->kind, &src);
  CUfunction f;
  smelt_status s = smelt__cuda_function(plan->ctx, &src, "gemm_tc", &f);
  if (!s && ip->mode == SMELT__KMODE_PARALLEL) s = smelt__conv2d_load_reduce(plan);
  if (s) {
    free(ip);
    return s;
  }
  plan->func[SMELT__CONV_F_IGEMM] = f;
  *taken = 1;
  smelt__conv2d_take(plan, ip, src.name,
                     ip->mode == SMELT__KMODE_PLAIN    ? "no split"
                     : ip->mode == SMELT__KMODE_SERIAL ? "serial"
                                                       : "parallel",
                     ip->splits);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- run */

static uint64_t ptr(const smelt_tensor *t) { return t ? (uint64_t)(uintptr_t)t->data : 0; }

static void gather_of(smelt__conv_kgeom *g, const smelt_tensor *x) {
  g->x = ptr(x);
  g->xs_n = x->strides[0], g->xs_h = x->strides[1], g->xs_w = x->strides[2];
  g->xh = (int)x->shape[1], g->xw = (int)x->shape[2], g->xc = (int)x->shape[3];
}

void smelt__conv2d_epilogue_kparams(const smelt__conv2d_state *st, const smelt_tensor *const *t,
                                    smelt__gemm_kparams *kp) {
  const smelt_gemm_epilogue *e = &st->desc.epilogue;
  const smelt_tensor *c = t[SMELT__CONV2D_C], *dd = t[SMELT__CONV2D_D], *bias = t[SMELT__CONV2D_BIAS];
  const int wgrad = st->desc.kind == SMELT_CONV2D_WGRAD;
  kp->p.d = ptr(dd);
  smelt__conv2d_as_matrix(dd, wgrad, &kp->p.d_rs, &kp->p.d_cs);
  if (st->has_c) {
    kp->p.c = ptr(c);
    smelt__conv2d_as_matrix(c, wgrad, &kp->p.c_rs, &kp->p.c_cs);
  }
  if (st->has_bias) {
    kp->p.bias = ptr(bias);
    kp->p.bias_s = bias->strides[0];
    kp->dt_bias = bias->dtype;
  }
  kp->alpha_ab = e->alpha * (double)e->scale_a * (double)e->scale_b;
  kp->beta = e->beta;
  kp->scale_d = e->scale_d;
  kp->slope = e->slope;
  kp->dt_a = kp->dt_b = t[SMELT__CONV2D_A]->dtype;
  kp->dt_c = st->has_c ? (int)c->dtype : 0;
  kp->dt_d = dd->dtype;
  kp->act = e->act;
  kp->clamp = e->clamp != 0;
  kp->has_c = st->has_c;
  kp->has_bias = st->has_bias;
  kp->swizzle = 8;
}

smelt_status smelt__conv2d_igemm_run(smelt_plan *plan, const smelt_tensor *const *t, int *ran) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_conv2d_desc *d = &st->desc;
  const igemm_plan *ip = (const igemm_plan *)plan->backend;
  const smelt_tensor *a = t[SMELT__CONV2D_A], *b = t[SMELT__CONV2D_B];
  *ran = 0;
  if ((ptr(a) | ptr(b)) % 16) return SMELT_OK;
  *ran = 1;
  smelt__gemm_kparams kp;
  smelt__conv_kgeom g;
  memset(&kp, 0, sizeof kp);
  memset(&g, 0, sizeof g);
  kp.p.m = ip->m, kp.p.n = ip->n, kp.p.k = ip->kk;
  kp.p.a = ptr(a), kp.p.b = ptr(b);
  switch (d->kind) {
    case SMELT_CONV2D_FPROP: /* B = w as [RSC, K]: element (k, n) at k + n·strides[0] */
      gather_of(&g, a);
      kp.p.b_rs = 1, kp.p.b_cs = b->strides[0];
      g.oh = (int)st->p, g.ow = (int)st->q;
      break;
    case SMELT_CONV2D_DGRAD:
      gather_of(&g, a);
      g.wt = ptr(b);
      g.ws_k = b->strides[0], g.ws_r = b->strides[1], g.ws_s = b->strides[2];
      g.oh = (int)st->h, g.ow = (int)st->w;
      break;
    default: /* A = dy as [K, NPQ]: element (m, k) at m + k·(NPQ's folded stride) */
      kp.p.a_rs = 1, kp.p.a_cs = smelt__conv2d_fold(a, 0, 2);
      gather_of(&g, b);
      g.oh = (int)st->p, g.ow = (int)st->q;
      break;
  }
  g.r = (int)st->r, g.s = (int)st->s;
  g.pad_h = d->pad_h0, g.pad_w = d->pad_w0, g.st_h = d->stride_h, g.st_w = d->stride_w;
  g.dil_h = d->dilation_h, g.dil_w = d->dilation_w;
  smelt__conv2d_epilogue_kparams(st, t, &kp);
  kp.mode = ip->mode;
  kp.splits = ip->splits;
  kp.k_slice = ip->k_slice;
  const int64_t tiles_m = smelt__ceil_div(ip->m, ip->k.bm), tiles_n = smelt__ceil_div(ip->n, ip->k.bn);
  kp.tiles_m = (int)tiles_m, kp.tiles_n = (int)tiles_n;
  if (tiles_m * tiles_n == 0) return SMELT_OK;
  smelt_ctx *ctx = plan->ctx;
  void *ws = NULL;
  smelt_status s = SMELT_OK;
  if (ip->mode != SMELT__KMODE_PLAIN &&
      (s = smelt__gemm_split_workspace(ctx, &kp, ip->m, ip->n, tiles_m * tiles_n, sizeof(float), &ws)) && !ws)
    return s;
  void *params[] = {&kp, &g};
  if (!s)
    s = smelt__cuda_launch(ctx, "smelt_conv2d", (CUfunction)plan->func[SMELT__CONV_F_IGEMM],
                           (unsigned)(tiles_m * tiles_n), 1, (unsigned)ip->splits, (unsigned)ip->k.threads,
                           (unsigned)ip->k.smem, params);
  if (!s && ip->mode == SMELT__KMODE_PARALLEL)
    s = smelt__gemm_split_reduce(ctx, "smelt_conv2d", plan->func[SMELT__CONV_F_REDUCE], &kp, ip->m, ip->n);
  if (ws) {
    smelt_status s2 = smelt__cuda_free(ctx, ws);
    if (!s) s = s2;
  }
  return s;
}
