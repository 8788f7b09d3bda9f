/* Conv2d on Hopper as implicit GEMM: the GEMM engine's TMA + wgmma kernel
 * (kernels/gemm_sm90.cu) with the activation loaded by TMA in im2col mode,
 * or for a strided dgrad gathered by the producer warpgroup
 * (kernels/conv2d_sm90.cuh), so the pipeline, the consumers, every epilogue
 * and the parallel split are the GEMM's. Taken on cc 9.0 for f16 and bf16
 * when the activation's channels are a multiple of 8 and fill at least
 * three quarters of their 64-channel blocks (fprop's C, dgrad's K; wgrad
 * needs C a multiple of 64), the filter's taps fold to one stride, the
 * strides are 16-byte multiples, the im2col pixel box fits TMA's corner
 * range, and C and D fold to the GEMM's [M, N] matrix; the rest goes to the
 * mma.sync implicit GEMM (conv2d_igemm.c) or the reference kernel. A
 * serial split asked for also goes there (this kernel splits in parallel,
 * which is deterministic too: the slices are added in order). */
#include "conv2d_cuda.h"
#include "gemm_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* kernels/conv2d_sm90.cuh's conv9_phase and conv9_geom, field for field. */
typedef struct smelt__conv9_kphase {
  int64_t d_off;
  int oh, ow, y0, x0, tr, ts, r0, s0, rst, sst, oy, ox;
} smelt__conv9_kphase;

#define CONV9_PHASES 16

typedef struct smelt__conv9_kgeom {
  uint64_t x;
  int64_t xs_n, xs_h, xs_w;
  uint64_t d;
  int64_t ds_n, ds_h, ds_w;
  int xh, xw, xc;
  int oh, ow;
  int r, s;
  int pad_h, pad_w, st_h, st_w, dil_h, dil_w;
  int y0, x0;
  int cb;
  smelt__conv9_kphase ph[CONV9_PHASES];
} smelt__conv9_kgeom;

_Static_assert(sizeof(smelt__conv9_kphase) == 56 && sizeof(smelt__conv9_kgeom) == 128 + CONV9_PHASES * 56,
               "smelt__conv9_kgeom must match conv9_geom");

/* The variants: per 16-bit type, fprop and dgrad at 128 x 128 (six stages)
 * and 128 x 64 (eight: a layer of 64 output channels), the strided dgrad's
 * phases at both (their rows scattered by the threads: a variant of its
 * own, so the unit-stride dgrad's TMA stores carry no branch) and its
 * gather at 128 x 128, fprop at 128 x 256 (four stages, as the GEMM's wide
 * tile: half the reads of the operand shared along N), wgrad at 128 x 128
 * and at 64 x 128 (eight; one consumer) for K <= 64 output channels, whose
 * 128-row tiles would be half zeros. (wgrad's 128 x 256 and 64 x 256 lost
 * to these on the ResNet layers on the H100, at their best split: 0.75-0.95
 * and 0.66 of their rate.) fprop, dgrad and the phases have ping-pong twins
 * at 128 x 128 and 128 x 64 for short K walks. */
typedef struct conv9_variant {
  smelt_conv2d_kind kind;
  int consumers, bn, stages, gather, rowmap, pp;
} conv9_variant;

enum {
  V_FPROP,
  V_FPROP_N64,
  V_DGRAD,
  V_DGRAD_N64,
  V_DGRAD_GATHER,
  V_WGRAD,
  V_FPROP_WIDE,
  V_WGRAD_M64,
  V_DGRAD_PHASES,
  V_DGRAD_PHASES_N64
};
static const conv9_variant variants[] = {
    [V_FPROP] = {SMELT_CONV2D_FPROP, 2, 128, 6, 0},        [V_FPROP_N64] = {SMELT_CONV2D_FPROP, 2, 64, 8, 0},
    [V_DGRAD] = {SMELT_CONV2D_DGRAD, 2, 128, 6, 0},        [V_DGRAD_N64] = {SMELT_CONV2D_DGRAD, 2, 64, 8, 0},
    [V_DGRAD_GATHER] = {SMELT_CONV2D_DGRAD, 2, 128, 6, 1}, [V_WGRAD] = {SMELT_CONV2D_WGRAD, 2, 128, 6, 0},
    [V_FPROP_WIDE] = {SMELT_CONV2D_FPROP, 2, 256, 4, 0},
    [V_WGRAD_M64] = {SMELT_CONV2D_WGRAD, 1, 128, 8, 0},    [V_DGRAD_PHASES] = {SMELT_CONV2D_DGRAD, 2, 128, 6, 0, 1},
    [V_DGRAD_PHASES_N64] = {SMELT_CONV2D_DGRAD, 2, 64, 8, 0, 1},
    /* The ping-pong twins (the same fields, pp 1). */
    {SMELT_CONV2D_FPROP, 2, 128, 6, 0, 0, 1},               {SMELT_CONV2D_DGRAD, 2, 128, 6, 0, 0, 1},
    {SMELT_CONV2D_DGRAD, 2, 128, 6, 0, 1, 1},               {SMELT_CONV2D_FPROP, 2, 64, 8, 0, 0, 1},
    {SMELT_CONV2D_DGRAD, 2, 64, 8, 0, 0, 1},                {SMELT_CONV2D_DGRAD, 2, 64, 8, 0, 1, 1},
};
#define NVARIANTS ((int)(sizeof variants / sizeof *variants))

static const char *const kind_tags[SMELT_CONV2D_KIND_COUNT] = {"fprop", "dgrad", "wgrad"};

/* Variant v's kernel: A K-major (gathered) but for wgrad (dy MN-major), B
 * K-major for fprop (w), MN-major otherwise. */
static smelt__gemm_kernel kernel_of(int tc, const conv9_variant *v) {
  return smelt__gemm_sm90_kernel(tc, v->consumers, v->bn, v->stages, v->kind != SMELT_CONV2D_WGRAD,
                                 v->kind == SMELT_CONV2D_FPROP, v->pp);
}

static void make_src(const smelt__gemm_kernel *k, const conv9_variant *v, smelt__kernel_src *src) {
  smelt__gemm_kernel_src(k, src);
  const size_t len = strlen(src->name);
  snprintf(src->name + len, sizeof src->name - len, "_conv_%s%s", kind_tags[v->kind],
           v->gather ? "_gather" : v->rowmap ? "_phases" : "");
  smelt__prelude_define(src, "GEMM_CONV", (int)v->kind + 1);
  if (v->gather) smelt__prelude_define(src, "GEMM_CONV_GATHER", 1);
  if (v->rowmap) smelt__prelude_define(src, "GEMM_CONV_ROWMAP", 1);
}

int smelt__conv2d_sm90_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++)
    for (int v = 0; v < NVARIANTS; v++, n++)
      if (n < max) {
        const smelt__gemm_kernel k = kernel_of(tc, &variants[v]);
        make_src(&k, &variants[v], &out[n]);
      }
  return n;
}

/* ---------------------------------------------------------------- preconditions */

#define CONV9_MAX_PHASES 4 /* a stride up to 4 runs by phases; a longer one gathers */

/* What the plan decided (plan->backend). */
typedef struct conv9_plan {
  smelt__gemm_kernel k;
  int gather;       /* the strided dgrad's gather (GEMM_CONV_GATHER) */
  int phases[2];    /* dgrad by TMA: phases along h and w (the strides; 1 1 for a unit stride) */
  smelt__conv9_axis ax[2][CONV9_MAX_PHASES];
  int64_t m, n, kk; /* the GEMM; kk is K' (fprop, dgrad: taps x cb x 64) */
  int cb;           /* fprop, dgrad: 64-channel blocks a tap */
  int y0, x0;       /* fprop, wgrad: im2col's first tap position for the GEMM's pixel (0, 0) */
  int upper[2];     /* fprop, wgrad: the pixel box's upper corner (w, h); its lower is (x0, y0) */
  int splits;       /* parallel slices (1: none) */
  int64_t k_slice;
} conv9_plan;

static int fits_int(int64_t v) { return v >= 0 && v < ((int64_t)1 << 31); }

/* A strided dgrad by phases (dgrad_phases set more than one). */
static int strided_phases(const conv9_plan *cp) { return cp->phases[0] * cp->phases[1] > 1; }

/* ch channels fill at least three quarters of their 64-channel blocks (the
 * rest of a block is zeros the tensor cores multiply). */
static int dense_blocks(int64_t ch) { return ch % 8 == 0 && ch * 4 >= smelt__ceil_div(ch, 64) * 64 * 3; }

/* The filter w [K, R, S, C]: channels unit-strided, taps (r, s) folded to
 * one stride, both strides 16-byte multiples (a TMA map over it). */
static int filter_ok(const smelt_tensor *w) {
  const int64_t rs = smelt__conv2d_fold(w, 1, 2);
  return w->strides[3] == 1 && rs > 0 && rs % 8 == 0 && w->strides[0] % 8 == 0 && w->strides[0] > 0;
}

/* TMA's im2col pixel box for a conv whose first tap sits at (y0, x0) for
 * the GEMM's pixel (0, 0) of a (rows x cols) grid at the traversal stride,
 * over a (h x w) tensor: the upper corner that makes the walk visit exactly
 * rows x cols positions; 0 when a corner or the tap offsets (up to
 * max_off) fall outside TMA's range (rank 4: [-128, 127]; offsets 16-bit). */
static int pixel_box(int64_t y0, int64_t x0, int64_t rows, int64_t cols, int64_t st_h, int64_t st_w, int64_t h,
                     int64_t w, int64_t max_off, int upper[2]) {
  const int64_t uh = (rows - 1) * st_h + 1 - h + y0, uw = (cols - 1) * st_w + 1 - w + x0;
  if (y0 < -128 || y0 > 127 || x0 < -128 || x0 > 127 || uh < -128 || uh > 127 || uw < -128 || uw > 127 ||
      max_off >= 65536)
    return 0;
  upper[0] = (int)uw, upper[1] = (int)uh;
  return 1;
}

static int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    const int64_t t = a % b;
    a = b, b = t;
  }
  return a;
}

/* A phase with positions but no tap makes the plan gather: its dx is the
 * epilogue of a zero sum, which the gather's zero taps give. */
int smelt__conv9_phase_axis(int64_t ph, int64_t st, int64_t pad, int64_t dil, int64_t taps, int64_t ext,
                            smelt__conv9_axis *a) {
  memset(a, 0, sizeof *a);
  a->n = ext > ph ? (int)((ext - ph + st - 1) / st) : 0;
  int64_t r0 = 0;
  while (r0 < taps && ((ph + pad - r0 * dil) % st + st) % st != 0) r0++;
  if (r0 == taps) return a->n == 0;
  const int64_t step = st / gcd64(st, dil), t = (taps - 1 - r0) / step + 1, last = r0 + (t - 1) * step;
  a->t = (int)t, a->f0 = (int)r0, a->step = (int)step, a->off = (int)(step * dil / st);
  a->first = (int)((ph + pad - last * dil) / st);
  return 1;
}

/* dgrad through TMA's im2col mode, phase by phase (cp->phases, cp->ax):
 * every phase with dx positions has taps and a pixel box TMA takes, and a
 * strided dgrad's pieces can be scattered by the threads (16-bit or f32 D
 * of 16-byte units and strides, no C; no split asked for, the phases'
 * sums being short). */
/* D as the TMA-store epilogue's pieces can write it (the phases' thread
 * stores and the ping-pong kernels have no other): no C, 16-bit or f32,
 * channels unit-strided, pixel strides whole 16-byte units. */
static int d_pieces(const smelt__conv2d_state *st, const smelt_tensor *dd) {
  const int64_t es = (int64_t)smelt_dtype_size(dd->dtype);
  return !st->has_c &&
         (dd->dtype == SMELT_DTYPE_F32 || dd->dtype == SMELT_DTYPE_F16 || dd->dtype == SMELT_DTYPE_BF16) &&
         dd->strides[3] == 1 && (dd->strides[0] * es) % 16 == 0 && (dd->strides[1] * es) % 16 == 0 &&
         (dd->strides[2] * es) % 16 == 0;
}

static int dgrad_phases(const smelt__conv2d_state *st, const smelt_tensor *dd, conv9_plan *cp) {
  const smelt_conv2d_desc *d = &st->desc;
  const int64_t sh = d->stride_h, sw = d->stride_w;
  if (sh > CONV9_MAX_PHASES || sw > CONV9_MAX_PHASES) return 0;
  if (sh * sw > 1 && (!d_pieces(st, dd) || (!st->auto_split && d->split_k_slices > 1))) return 0;
  for (int64_t ph = 0; ph < sh; ph++)
    if (!smelt__conv9_phase_axis(ph, sh, d->pad_h0, d->dilation_h, st->r, st->h, &cp->ax[0][ph])) return 0;
  for (int64_t pw = 0; pw < sw; pw++)
    if (!smelt__conv9_phase_axis(pw, sw, d->pad_w0, d->dilation_w, st->s, st->w, &cp->ax[1][pw])) return 0;
  for (int64_t ph = 0; ph < sh; ph++)
    for (int64_t pw = 0; pw < sw; pw++) {
      const smelt__conv9_axis *ah = &cp->ax[0][ph], *aw = &cp->ax[1][pw];
      int upper[2];
      if (ah->n && aw->n &&
          !pixel_box(ah->first, aw->first, ah->n, aw->n, 1, 1, st->p, st->q,
                     (int64_t)(ah->t - 1) * ah->off + (int64_t)(aw->t - 1) * aw->off, upper))
        return 0;
    }
  cp->phases[0] = (int)sh, cp->phases[1] = (int)sw;
  return 1;
}

/* Whether this kernel serves the plan's problem; the GEMM's sizes. */
static int serves(const smelt_plan *plan, const smelt_tensor *t, conv9_plan *cp) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_conv2d_desc *d = &st->desc;
  const smelt_device_info *dev = &plan->ctx->cuda->info;
  const smelt_tensor *a = &t[SMELT__CONV2D_A], *b = &t[SMELT__CONV2D_B], *dd = &t[SMELT__CONV2D_D];
  if (dev->cc_major != 9 || dev->cc_minor != 0) return 0;
  if ((a->dtype != SMELT_DTYPE_F16 && a->dtype != SMELT_DTYPE_BF16) || b->dtype != a->dtype ||
      d->math == SMELT_GEMM_MATH_TF32)
    return 0;
  if (!st->auto_split && d->split_k_slices > 1 && d->split_k_mode != SMELT_CONV2D_SPLIT_K_PARALLEL) return 0;
  switch (d->kind) {
    case SMELT_CONV2D_FPROP: /* x in im2col mode; w through a map (C, RS, K) */
      if (!smelt__conv2d_gatherable(a) || !dense_blocks(st->c) || !filter_ok(b)) return 0;
      cp->cb = (int)smelt__ceil_div(st->c, 64);
      cp->m = st->n * st->p * st->q, cp->n = st->k, cp->kk = st->r * st->s * cp->cb * 64;
      cp->y0 = -d->pad_h0, cp->x0 = -d->pad_w0;
      if (!pixel_box(cp->y0, cp->x0, st->p, st->q, d->stride_h, d->stride_w, st->h, st->w,
                     (st->r - 1) * d->dilation_h + (st->s - 1) * d->dilation_w, cp->upper))
        return 0;
      break;
    case SMELT_CONV2D_DGRAD: /* dy in im2col mode (unit stride) or gathered; w through a map (C, K, RS) */
      if (!smelt__conv2d_gatherable(a) || !dense_blocks(st->k) || !filter_ok(b) || st->c % 8 != 0) return 0;
      cp->cb = (int)smelt__ceil_div(st->k, 64);
      cp->n = st->c;
      cp->gather = !dgrad_phases(st, &t[SMELT__CONV2D_D], cp);
      if (cp->gather) {
        /* dx's pixel h reads dy's row (h + pad - r dil) / st where that divides. */
        cp->m = st->n * st->h * st->w, cp->kk = st->r * st->s * cp->cb * 64;
      } else {
        /* Phase (0, 0) has the most rows and taps: the tile choice's GEMM. */
        cp->m = st->n * cp->ax[0][0].n * cp->ax[1][0].n, cp->kk = 0;
        for (int ph = 0; ph < cp->phases[0]; ph++)
          for (int pw = 0; pw < cp->phases[1]; pw++) {
            const int64_t kk = (int64_t)cp->ax[0][ph].t * cp->ax[1][pw].t * cp->cb * 64;
            if (kk > cp->kk) cp->kk = kk;
          }
      }
      break;
    default: { /* wgrad: dy as [K, NPQ] MN-major through a map; x in im2col mode */
      const int64_t pix = smelt__conv2d_fold(a, 0, 2);
      if (st->c % 64 != 0 || !smelt__conv2d_gatherable(b) || a->strides[3] != 1 || pix <= 0 || pix % 8 != 0)
        return 0;
      cp->cb = 0;
      cp->m = st->k, cp->n = st->r * st->s * st->c, cp->kk = st->n * st->p * st->q;
      cp->y0 = -d->pad_h0, cp->x0 = -d->pad_w0;
      if (!pixel_box(cp->y0, cp->x0, st->p, st->q, d->stride_h, d->stride_w, st->h, st->w,
                     (st->r - 1) * d->dilation_h + (st->s - 1) * d->dilation_w, cp->upper))
        return 0;
      break;
    }
  }
  int64_t rs, cs;
  const int wgrad = d->kind == SMELT_CONV2D_WGRAD;
  if (!smelt__conv2d_as_matrix(dd, wgrad, &rs, &cs)) return 0;
  if (st->has_c && !smelt__conv2d_as_matrix(&t[SMELT__CONV2D_C], wgrad, &rs, &cs)) return 0;
  /* Every index the gather and the tile walk compute fits an int. */
  return fits_int(cp->m) && fits_int(cp->n) && fits_int(cp->kk + 64) && fits_int(st->n * st->h * st->w) &&
         fits_int(st->n * st->p * st->q) && st->h < 32768 && st->w < 32768 && st->p < 32768 && st->q < 32768;
}

/* smelt's own split of K (wgrad's NPQ) into parallel slices: the count
 * that minimizes the modelled time, waves of units (each CTA one unit at a
 * time) times a unit's K steps at ~0.3 us a 128 x 128 x 64 step, plus the
 * slices' f32 partials written and read back at ~3 TB/s and ~5 us for the
 * reduction's launch; at least 8 K steps a slice. (H100: wgrad 28x28x128
 * has 9 tiles, which 14 slices fill to 126 of 132 SMs, where doubling
 * stopped at 8 and 72; 7x7x512's 144 tiles stay whole, a second slice's
 * partials costing more than its wave saves.) */
static int64_t auto_splits(int64_t tiles, int64_t ktiles, int64_t m, int64_t n, int64_t sms, double step,
                           double *time) {
  int64_t best = 1;
  double best_t = 0;
  for (int64_t s = 1; s <= SMELT_GEMM_MAX_SPLIT_K && (s == 1 || ktiles / s >= 8); s++) {
    const double t = (double)smelt__ceil_div(tiles * s, sms) * (double)smelt__ceil_div(ktiles, s) * step +
                     (s > 1 ? 8.0 * (double)s * (double)m * (double)n / 3e12 + 5e-6 : 0.0);
    if (s == 1 || t < best_t) best = s, best_t = t;
  }
  if (time) *time = best_t;
  return best;
}

/* Whether a plain run of `tiles` tiles leaves its last wave to the GEMM's
 * split tail (smelt__gemm_split_tail: up to 4 K chunks a tile, chunk by
 * chunk over every SM), which then busies every SM: taken before a
 * parallel split, which writes and reduces whole slices of partial sums
 * and runs the slices' different K ranges at once (H100, wgrad
 * 14x14x256: 36 tiles plain with the tail 317 TFLOP/s, split 3 287;
 * 7x7x512: 144 tiles of 128 x 128 with the tail 331, the wide tile's 72
 * 296). */
static int tail_fills(int64_t tiles, int64_t sms) { return tiles * 4 >= sms; }

/* A K step's modelled time for variant v (a parallel split's model: only
 * plans of fewer tiles than a quarter of the SMs, whose tiles are 128 or
 * 64 rows by 128 or 64): ~0.3 us for 128 x 128 x 64, the 64-row tile
 * half the work at ~15% less of the tensor cores' rate. */
static double step_time(const conv9_variant *v) { return v->consumers == 1 ? 0.18e-6 : 0.3e-6; }

smelt_status smelt__conv2d_sm90_plan(smelt_plan *plan, const smelt_tensor *t, int *taken) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_conv2d_desc *d = &st->desc;
  *taken = 0;
  conv9_plan c;
  memset(&c, 0, sizeof c);
  if (!serves(plan, t, &c)) return SMELT_OK;
  const int tc = t[SMELT__CONV2D_A].dtype == SMELT_DTYPE_F16 ? SMELT__TC_F16 : SMELT__TC_BF16;
  const int64_t sms = plan->ctx->cuda->info.sm_count;
  /* fprop and dgrad: the 64-wide tile for N <= 64, or when the 128-wide
   * tiles would busy at most half the SMs; fprop's 256-wide one for N >=
   * 256 when its tiles fill the SMs; the strided dgrad's gather and wgrad:
   * 128 x 128, wgrad split. */
  const int rowmap = strided_phases(&c);
  int v = d->kind == SMELT_CONV2D_FPROP   ? V_FPROP
          : d->kind == SMELT_CONV2D_WGRAD ? V_WGRAD
          : c.gather                      ? V_DGRAD_GATHER
          : rowmap                        ? V_DGRAD_PHASES
                                          : V_DGRAD;
  const int64_t ktiles = smelt__ceil_div(c.kk, 64);
  if (v == V_FPROP && c.n >= 256 && smelt__ceil_div(c.m, 128) * smelt__ceil_div(c.n, 256) >= sms) v = V_FPROP_WIDE;
  else if ((v == V_FPROP || v == V_DGRAD || v == V_DGRAD_PHASES) &&
           (c.n <= 64 || smelt__ceil_div(c.m, 128) * smelt__ceil_div(c.n, 128) * 2 <= sms))
    v++;
  else if (v == V_WGRAD && c.m <= 64)
    v = V_WGRAD_M64;
  /* The ping-pong variants have only the TMA-store epilogue: no C, D
   * 16-bit or f32 in rows of whole 16-byte units (a run whose D is less
   * aligned falls back, as for A and B), and no split. */
  const smelt_tensor *dd = &t[SMELT__CONV2D_D];
  const int pp_d = d_pieces(st, dd) && (c.n * (int64_t)smelt_dtype_size(dd->dtype)) % 16 == 0;
  /* Debugging: SMELT_CONV2D_TILE=BMxBN takes the kind's variant of that
   * tile (the same gather or phases; 128x128pp the ping-pong one),
   * SMELT_CONV2D_SPLITS=n that split. */
  const char *tile = smelt__getenv("SMELT_CONV2D_TILE");
  for (int i = 0; tile && i < NVARIANTS; i++) {
    const conv9_variant *u = &variants[i], *o = &variants[v];
    char name[16];
    snprintf(name, sizeof name, "%dx%d%s", 64 * u->consumers, u->bn, u->pp ? "pp" : "");
    if (u->kind == o->kind && u->gather == o->gather && u->rowmap == o->rowmap && (!u->pp || pp_d) &&
        !strcmp(name, tile))
      v = i;
  }
  c.k = kernel_of(tc, &variants[v]);
  const int64_t tiles = smelt__ceil_div(c.m, c.k.bm) * smelt__ceil_div(c.n, c.k.bn);
  /* A strided dgrad's phases scatter their rows, which the split's
   * reduction does not: they run whole (dgrad_phases). */
  const char *forced = rowmap ? NULL : smelt__getenv("SMELT_CONV2D_SPLITS");
  int64_t splits = rowmap || (st->auto_split && tail_fills(tiles, sms)) ? 1
                   : st->auto_split ? auto_splits(tiles, ktiles, c.m, c.n, sms, step_time(&variants[v]), NULL)
                                    : d->split_k_slices;
  if (forced && atoi(forced) >= 1 && atoi(forced) <= SMELT_GEMM_MAX_SPLIT_K) splits = atoi(forced);
  if (variants[v].pp) splits = 1;
  /* A short K walk unsplit (the split tail needs the cooperative kernel):
   * the variant's ping-pong twin, by the GEMM's rule. */
  if (splits == 1 && !tile && pp_d && smelt__gemm_short_k_pingpong(c.kk, tiles, sms))
    for (int i = 0; i < NVARIANTS; i++) {
      const conv9_variant *u = &variants[i], *o = &variants[v];
      if (u->pp && u->kind == o->kind && u->bn == o->bn && u->gather == o->gather && u->rowmap == o->rowmap) {
        v = i;
        c.k = kernel_of(tc, u);
        break;
      }
    }
  c.k_slice = smelt__ceil_div(smelt__ceil_div(c.kk, splits), 64) * 64;
  c.splits = (int)(c.kk > 0 ? smelt__ceil_div(c.kk, c.k_slice) : 1);
  smelt__kernel_src src;
  make_src(&c.k, &variants[v], &src);
  CUfunction f;
  smelt_status s = smelt__cuda_function(plan->ctx, &src, "gemm_sm90", &f);
  if (!s && c.splits > 1) s = smelt__conv2d_load_reduce(plan);
  if (s) return s;
  conv9_plan *cp = (conv9_plan *)malloc(sizeof *cp);
  if (!cp) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_conv2d: the plan's launch record");
  *cp = c;
  plan->func[SMELT__CONV_F_SM90] = f;
  *taken = 1;
  char how[32];
  if (rowmap) snprintf(how, sizeof how, "%dx%d phases, no split", c.phases[0], c.phases[1]);
  else snprintf(how, sizeof how, "%s", c.splits == 1 ? "no split" : "parallel");
  smelt__conv2d_take(plan, cp, src.name, how, c.splits);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- run */

static uint64_t ptr(const smelt_tensor *t) { return t ? (uint64_t)(uintptr_t)t->data : 0; }

/* A tensor map of rank 2 or 3 (dims innermost first, strides in bytes of
 * the outer dims) in boxes `box` with the 128-byte swizzle. */
static smelt_status map_of(smelt__cu_tensor_map *map, int tdt, const void *data, unsigned rank, const uint64_t *dims,
                           const uint64_t *strides, const unsigned *box) {
  static const unsigned ones[3] = {1, 1, 1};
  CUresult r = smelt__cu(NULL)->cuTensorMapEncodeTiled(map, tdt, rank, (void *)data, dims, strides, box, ones,
                                                        SMELT__TMA_INTERLEAVE_NONE, SMELT__TMA_SWIZZLE_128B,
                                                        SMELT__TMA_L2_256B, SMELT__TMA_OOB_FILL_NONE);
  return r ? smelt__cu_error(r, "smelt_conv2d", "cuTensorMapEncodeTiled") : SMELT_OK;
}

static int tma_dtype(smelt_dtype dt) {
  return dt == SMELT_DTYPE_BF16 ? SMELT__TMA_BF16 : dt == SMELT_DTYPE_F16 ? SMELT__TMA_F16 : SMELT__TMA_F32;
}

/* The NHWC tensor x in TMA's im2col mode (kernels/conv2d_sm90.cuh): the
 * pixel box from lower to upper (w, h), 64 channels and `pixels` rows a
 * box, the traversal stride (st_h, st_w). */
static smelt_status im2col_map(smelt__cu_tensor_map *map, const smelt_tensor *x, const int lower[2],
                               const int upper[2], unsigned pixels, int st_h, int st_w) {
  const uint64_t dims[4] = {(uint64_t)x->shape[3], (uint64_t)x->shape[2], (uint64_t)x->shape[1],
                            (uint64_t)x->shape[0]},
                 strides[3] = {(uint64_t)x->strides[2] * 2, (uint64_t)x->strides[1] * 2,
                               (uint64_t)x->strides[0] * 2};
  const unsigned elem[4] = {1, (unsigned)st_w, (unsigned)st_h, 1};
  CUresult r = smelt__cu(NULL)->cuTensorMapEncodeIm2col(
      map, tma_dtype(x->dtype), 4, x->data, dims, strides, lower, upper, 64, pixels, elem,
      SMELT__TMA_INTERLEAVE_NONE, SMELT__TMA_SWIZZLE_128B, SMELT__TMA_L2_256B, SMELT__TMA_OOB_FILL_NONE);
  return r ? smelt__cu_error(r, "smelt_conv2d", "cuTensorMapEncodeIm2col") : SMELT_OK;
}

/* The kernel's B map and, but for dgrad, its A map. fprop: x in im2col
 * mode, 128 pixels a box; w as (C, RS, K) in boxes {64, 1, BN} (BN K-major
 * rows). dgrad: w as (C, K, RS) in boxes {64, 64, 1} (a panel of 64
 * columns of C by 64 rows of k); A per phase (phase_map). wgrad: dy as (K,
 * NPQ) in boxes {64, 64} (a panel of 64 columns of M by 64 rows of NPQ); x
 * in im2col mode, 64 pixels a box (a panel of B). */
static smelt_status operand_maps(const smelt__conv2d_state *st, const conv9_plan *cp, const smelt_tensor *const *t,
                                 smelt__cu_tensor_map *ta, smelt__cu_tensor_map *tb) {
  const smelt_tensor *a = t[SMELT__CONV2D_A], *w = t[SMELT__CONV2D_B];
  const smelt_conv2d_desc *d = &st->desc;
  const int tdt = tma_dtype(a->dtype);
  const int lower[2] = {cp->x0, cp->y0};
  if (d->kind == SMELT_CONV2D_WGRAD) {
    const uint64_t dims[2] = {(uint64_t)st->k, (uint64_t)(st->n * st->p * st->q)},
                   strides[1] = {(uint64_t)smelt__conv2d_fold(a, 0, 2) * 2};
    const unsigned box[2] = {64, 64};
    smelt_status s = map_of(ta, tdt, a->data, 2, dims, strides, box);
    return s ? s : im2col_map(tb, t[SMELT__CONV2D_B], lower, cp->upper, 64, d->stride_h, d->stride_w);
  }
  const uint64_t rs = (uint64_t)smelt__conv2d_fold(w, 1, 2) * 2, ks = (uint64_t)w->strides[0] * 2,
                 taps = (uint64_t)(st->r * st->s);
  if (d->kind == SMELT_CONV2D_FPROP) {
    const uint64_t dims[3] = {(uint64_t)st->c, taps, (uint64_t)st->k}, strides[2] = {rs, ks};
    const unsigned box[3] = {64, 1, (unsigned)cp->k.bn};
    smelt_status s = map_of(tb, tdt, w->data, 3, dims, strides, box);
    return s ? s : im2col_map(ta, a, lower, cp->upper, 128, d->stride_h, d->stride_w);
  }
  const uint64_t dims[3] = {(uint64_t)st->c, (uint64_t)st->k, taps}, strides[2] = {ks, rs};
  const unsigned box[3] = {64, 64, 1};
  smelt_status s = map_of(tb, tdt, w->data, 3, dims, strides, box);
  *ta = *tb; /* the gather reads dy itself: A's map is not read */
  return s;
}

/* dgrad phase (ph, pw) by TMA: dy in im2col mode from the walk's last tap,
 * 128 pixels a box at unit stride, and the kernel's geometry for it
 * (kernels/conv2d_sm90.cuh): the phase's grid, its taps, and the offset of
 * its first pixel in dx. */
static smelt_status phase_map(const smelt__conv2d_state *st, const conv9_plan *cp, const smelt_tensor *const *t, int ph,
                              int pw, smelt__cu_tensor_map *ta, smelt__conv9_kphase *f) {
  const smelt__conv9_axis *ah = &cp->ax[0][ph], *aw = &cp->ax[1][pw];
  const smelt_tensor *dd = t[SMELT__CONV2D_D];
  f->d_off = ph * dd->strides[1] + pw * dd->strides[2];
  f->oh = ah->n, f->ow = aw->n;
  f->y0 = ah->first, f->x0 = aw->first;
  f->tr = ah->t, f->ts = aw->t, f->r0 = ah->f0, f->s0 = aw->f0, f->rst = ah->step, f->sst = aw->step;
  f->oy = ah->off, f->ox = aw->off;
  const int lower[2] = {aw->first, ah->first};
  int upper[2];
  pixel_box(ah->first, aw->first, ah->n, aw->n, 1, 1, st->p, st->q,
            (int64_t)(ah->t - 1) * ah->off + (int64_t)(aw->t - 1) * aw->off, upper); /* checked by the plan */
  return im2col_map(ta, t[SMELT__CONV2D_A], lower, upper, 128, 1, 1);
}

/* A strided dgrad's phases in one launch of the grouped mode (host
 * scheduling; kernels/gemm_sm90.cu): each phase with dx pixels a group,
 * the longest K walks first (the last wave's tiles are the short ones),
 * its A map an im2col over dy of its own, B the filter's map, D's map not
 * read (the threads store); the tables uploaded as the GEMM's grouped runs
 * upload theirs (smelt__gemm_grouped_upload). */
static smelt_status launch_phases(smelt_plan *plan, const conv9_plan *cp, const smelt_tensor *const *t,
                                  smelt__gemm_kparams kp, smelt__conv9_kgeom *g, const smelt__cu_tensor_map *tb) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  smelt_ctx *ctx = plan->ctx;
  const smelt_tensor *dd = t[SMELT__CONV2D_D];
  int order[CONV9_PHASES], count = 0;
  for (int ph = 0; ph < cp->phases[0]; ph++)
    for (int pw = 0; pw < cp->phases[1]; pw++)
      if (cp->ax[0][ph].n && cp->ax[1][pw].n) {
        /* Insert by K walk (taps), longest first. */
        const int taps = cp->ax[0][ph].t * cp->ax[1][pw].t, code = ph * CONV9_MAX_PHASES + pw;
        int at = count++;
        for (; at > 0; at--) {
          const int o = order[at - 1], ot = cp->ax[0][o / CONV9_MAX_PHASES].t * cp->ax[1][o % CONV9_MAX_PHASES].t;
          if (ot >= taps) break;
          order[at] = o;
        }
        order[at] = code;
      }
  if (!count) return SMELT_OK;
  const size_t maps = (size_t)count * 3 * sizeof(smelt__cu_tensor_map), probs = (size_t)count * sizeof(smelt__gemm_kprob);
  _Alignas(64) uint8_t host[CONV9_PHASES * (3 * sizeof(smelt__cu_tensor_map) + sizeof(smelt__gemm_kprob) + sizeof(int64_t)) +
               sizeof(int64_t)];
  smelt__cu_tensor_map *m = (smelt__cu_tensor_map *)host;
  smelt__gemm_kprob *kps = (smelt__gemm_kprob *)(host + maps);
  int64_t *first = (int64_t *)(host + maps + probs), total = 0;
  g->d = ptr(dd);
  g->ds_n = dd->strides[0], g->ds_h = st->desc.stride_h * dd->strides[1], g->ds_w = st->desc.stride_w * dd->strides[2];
  smelt_status s = SMELT_OK;
  for (int i = 0; i < count && !s; i++) {
    const int ph = order[i] / CONV9_MAX_PHASES, pw = order[i] % CONV9_MAX_PHASES;
    s = phase_map(st, cp, t, ph, pw, &m[3 * i], &g->ph[i]);
    m[3 * i + 1] = *tb;
    m[3 * i + 2] = *tb; /* not read */
    kps[i] = kp.p;
    kps[i].m = st->n * g->ph[i].oh * g->ph[i].ow;
    kps[i].k = (int64_t)g->ph[i].tr * g->ph[i].ts * cp->cb * 64;
    first[i] = total;
    total += smelt__ceil_div(kps[i].m, cp->k.bm) * smelt__ceil_div(kps[i].n, cp->k.bn);
  }
  first[count] = total;
  void *dev = NULL;
  if (!s) s = smelt__gemm_grouped_upload(ctx, "smelt_conv2d", host, maps, count, &kp, &dev);
  if (!s) {
    kp.mode = SMELT__KMODE_GROUPED;
    kp.tiles_m = (int)total; /* the grouped kernel's unit count */
    kp.tiles_n = 1;
    int fast = 1;
    const void *gmaps = dev;
    void *params[] = {(void *)tb, (void *)tb, (void *)tb, &kp, &fast, &gmaps, g};
    const int64_t sms = ctx->cuda->info.sm_count;
    s = smelt__cuda_launch(ctx, "smelt_conv2d", (CUfunction)plan->func[SMELT__CONV_F_SM90],
                           (unsigned)(total < sms ? total : sms), 1, 1, (unsigned)cp->k.threads, (unsigned)cp->k.smem,
                           params);
  }
  if (dev) {
    smelt_status s2 = smelt__cuda_free(ctx, dev);
    if (!s) s = s2;
  }
  return s;
}

/* How the fast epilogue can write D (kernels/gemm_sm90.cu): 1 through TMA
 * stores (16-bit or f32 row-major rows of whole 16-byte units, 16-byte
 * aligned, no C), else 0 (the general epilogue, element by element). */
static int fast_d(const smelt__gemm_kparams *kp) {
  const int es = kp->dt_d == SMELT_DTYPE_F32 ? 4 : 2;
  if (kp->has_c || (kp->dt_d != SMELT_DTYPE_F32 && kp->dt_d != SMELT_DTYPE_F16 && kp->dt_d != SMELT_DTYPE_BF16))
    return 0;
  return kp->p.d_cs == 1 && (kp->p.d_rs * es) % 16 == 0 && (kp->p.n * es) % 16 == 0 && kp->p.d % 16 == 0;
}

/* One launch of the kernel over the GEMM kp describes (plus the split's
 * reduction), with A and B's maps and the geometry g. */
static smelt_status launch(smelt_plan *plan, const conv9_plan *cp, const smelt_tensor *dd, smelt__gemm_kparams kp,
                           const smelt__conv9_kgeom *g, const smelt__cu_tensor_map *ta, const smelt__cu_tensor_map *tb) {
  const int64_t m = kp.p.m, n = kp.p.n, tiles_m = smelt__ceil_div(m, cp->k.bm), tiles_n = smelt__ceil_div(n, cp->k.bn);
  kp.mode = cp->splits > 1 ? SMELT__KMODE_PARALLEL : SMELT__KMODE_PLAIN;
  kp.splits = cp->splits;
  kp.k_slice = cp->k_slice;
  kp.tiles_m = (int)tiles_m, kp.tiles_n = (int)tiles_n;
  if (tiles_m * tiles_n == 0) return SMELT_OK;
  smelt_ctx *ctx = plan->ctx;
  smelt__cu_tensor_map td;
  smelt__gemm_kparams kq = kp; /* what the main kernel runs: the split's identity epilogue into f32 slices */
  int fast = fast_d(&kp);
  void *ws = NULL;
  smelt_status s = SMELT_OK;
  if (kp.mode == SMELT__KMODE_PARALLEL) {
    if ((s = smelt__gemm_split_workspace(ctx, &kp, m, n, tiles_m * tiles_n, sizeof(float), &ws)) && !ws) return s;
    if (!s) {
      kq = kp;
      kq.alpha_ab = 1.0;
      kq.scale_d = 1.0f;
      kq.act = SMELT_ACT_IDENTITY;
      kq.clamp = kq.has_c = kq.has_bias = 0;
      kq.dt_d = SMELT_DTYPE_F32;
      fast = 1;
      s = smelt__gemm_workspace_map(&td, (const void *)(uintptr_t)kp.workspace, m, n, cp->splits);
    }
  } else if (fast) {
    s = smelt__gemm_tensor_map(&td, dd->dtype, dd->data, m, n, kp.p.d_rs, 64, 128 / (int)smelt_dtype_size(dd->dtype));
  } else {
    td = *ta; /* not read by the general epilogue */
  }
  const void *gmaps = NULL;
  void *params[] = {(void *)ta, (void *)tb, &td, &kq, &fast, &gmaps, (void *)g};
  const int64_t sms = ctx->cuda->info.sm_count;
  /* A last wave that leaves SMs idle runs in K chunks, as the GEMM's. */
  void *tail_ws = NULL;
  if (!s && kp.mode == SMELT__KMODE_PLAIN)
    s = smelt__gemm_split_tail(ctx, "smelt_conv2d", &cp->k, kp.p.k, tiles_m * tiles_n, &kq, &tail_ws);
  const int64_t units = smelt__gemm_sk_units(&kq, tiles_m * tiles_n * cp->splits);
  if (!s)
    s = smelt__cuda_launch(ctx, "smelt_conv2d", (CUfunction)plan->func[SMELT__CONV_F_SM90],
                           (unsigned)(units < sms ? units : sms), 1, 1, (unsigned)cp->k.threads, (unsigned)cp->k.smem,
                           params);
  if (tail_ws) {
    smelt_status s2 = smelt__cuda_free(ctx, tail_ws);
    if (!s) s = s2;
  }
  if (!s && kp.mode == SMELT__KMODE_PARALLEL)
    s = smelt__gemm_split_reduce(ctx, "smelt_conv2d", plan->func[SMELT__CONV_F_REDUCE], &kp, m, n);
  if (ws) {
    smelt_status s2 = smelt__cuda_free(ctx, ws);
    if (!s) s = s2;
  }
  return s;
}

smelt_status smelt__conv2d_sm90_run(smelt_plan *plan, const smelt_tensor *const *t, int *ran) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_conv2d_desc *d = &st->desc;
  const conv9_plan *cp = (const conv9_plan *)plan->backend;
  const smelt_tensor *a = t[SMELT__CONV2D_A], *b = t[SMELT__CONV2D_B], *dd = t[SMELT__CONV2D_D];
  const int phased = d->kind == SMELT_CONV2D_DGRAD && !cp->gather, rowmap = strided_phases(cp);
  *ran = 0;
  if ((ptr(a) | ptr(b) | (rowmap || cp->k.pingpong ? ptr(dd) : 0)) % 16) return SMELT_OK;
  *ran = 1;
  const int wgrad = d->kind == SMELT_CONV2D_WGRAD;
  smelt__gemm_kparams kp;
  smelt__conv9_kgeom g;
  memset(&kp, 0, sizeof kp);
  memset(&g, 0, sizeof g);
  kp.p.m = cp->m, kp.p.n = cp->n, kp.p.k = cp->kk;
  const smelt_tensor *x = wgrad ? b : a; /* the activation: the gather reads it, wgrad's columns its channels */
  g.x = ptr(x);
  g.xs_n = x->strides[0], g.xs_h = x->strides[1], g.xs_w = x->strides[2];
  g.xh = (int)x->shape[1], g.xw = (int)x->shape[2], g.xc = (int)x->shape[3];
  g.oh = (int)(d->kind == SMELT_CONV2D_DGRAD ? st->h : st->p);
  g.ow = (int)(d->kind == SMELT_CONV2D_DGRAD ? st->w : st->q);
  g.r = (int)st->r, g.s = (int)st->s;
  g.pad_h = d->pad_h0, g.pad_w = d->pad_w0, g.st_h = d->stride_h, g.st_w = d->stride_w;
  g.dil_h = d->dilation_h, g.dil_w = d->dilation_w;
  g.y0 = cp->y0, g.x0 = cp->x0;
  g.cb = cp->cb;
  smelt__conv2d_epilogue_kparams(st, t, &kp);
  smelt__cu_tensor_map ta, tb;
  smelt_status s = operand_maps(st, cp, t, &ta, &tb);
  if (s || !phased) return s ? s : launch(plan, cp, dd, kp, &g, &ta, &tb);
  if (rowmap) return launch_phases(plan, cp, t, kp, &g, &tb);
  /* A unit stride: the plain GEMM of its one phase. */
  s = phase_map(st, cp, t, 0, 0, &ta, &g.ph[0]);
  if (!s) s = launch(plan, cp, dd, kp, &g, &ta, &tb);
  return s;
}
