/* CPU reference for smelt_conv2d: direct convolution, the oracle the GPU
 * kernels are checked against.
 *
 * Naive on purpose: each output element gathers its own sum, in double, from
 * the definitions in smelt/conv2d.h (fprop over the taps r, s and channels
 * c; dgrad over the output positions p, q whose window covers the input
 * position, and the filters k; wgrad over n, p, q), then takes GEMM's
 * epilogue in double and rounds once into D. Inputs convert exactly to
 * double; products are exact, so the math op TF32 computes the exact result
 * here too (the error bound says how far tf32 may drift from it). The
 * iterator, stride support and split-K only choose how a GPU walks the
 * implicit GEMM: they do not reach this file, so every choice gives the
 * same bits. */
#include "../core/conv2d_internal.h"

#include <float.h>

/* The views and sizes one sum reads. */
typedef struct conv {
  const smelt__conv2d_state *st;
  const smelt_tensor *a, *b;
} conv;

static double at(const smelt_tensor *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return smelt__load_f64(t->data, t->dtype, smelt__conv2d_off(t, i0, i1, i2, i3));
}

/* The input coordinate output position o reads through tap f, or -1 in the
 * padding. */
static int64_t tap(int64_t o, int64_t f, int stride, int pad0, int dil, int64_t in) {
  const int64_t i = o * stride - pad0 + f * dil;
  return i >= 0 && i < in ? i : -1;
}

/* The output position whose tap f reads input coordinate i, or -1 when
 * none does (i is between strides, or the position is past the output). */
static int64_t untap(int64_t i, int64_t f, int stride, int pad0, int dil, int64_t out) {
  const int64_t t = i + pad0 - f * dil;
  return t >= 0 && t % stride == 0 && t / stride < out ? t / stride : -1;
}

/* fprop and dgrad run over the filter taps (r, s): y[n,p,q,k] sums
 * x[n,h,w,c] · w[k,r,s,c] over (r, s, c), with (h, w) where the tap reads
 * from (p, q); dx[n,h,w,c] sums dy[n,p,q,k] · w[k,r,s,c] over (r, s, k),
 * with (p, q) the output position whose tap reads (h, w). So (i, j) maps
 * to A's (i', j') through each tap, the inner sum runs over A's last dim,
 * and e is the filter's other dim (k in fprop, c in dgrad). */
static double over_taps(const conv *cv, int64_t n, int64_t i, int64_t j, int64_t e) {
  const smelt__conv2d_state *st = cv->st;
  const smelt_conv2d_desc *d = &st->desc;
  const int dgrad = d->kind == SMELT_CONV2D_DGRAD;
  const int64_t inner = dgrad ? st->k : st->c;
  double acc = 0;
  for (int64_t r = 0; r < st->r; r++) {
    const int64_t ai = dgrad ? untap(i, r, d->stride_h, d->pad_h0, d->dilation_h, st->p)
                             : tap(i, r, d->stride_h, d->pad_h0, d->dilation_h, st->h);
    for (int64_t s = 0; s < st->s && ai >= 0; s++) {
      const int64_t aj = dgrad ? untap(j, s, d->stride_w, d->pad_w0, d->dilation_w, st->q)
                               : tap(j, s, d->stride_w, d->pad_w0, d->dilation_w, st->w);
      for (int64_t x = 0; x < inner && aj >= 0; x++)
        acc += at(cv->a, n, ai, aj, x) * (dgrad ? at(cv->b, x, r, s, e) : at(cv->b, e, r, s, x));
    }
  }
  return acc;
}

/* dw[k,r,s,c]: A = dy, B = x. */
static double wgrad(const conv *cv, int64_t k, int64_t r, int64_t s, int64_t c) {
  const smelt__conv2d_state *st = cv->st;
  const smelt_conv2d_desc *d = &st->desc;
  double acc = 0;
  for (int64_t n = 0; n < st->n; n++)
    for (int64_t p = 0; p < st->p; p++) {
      const int64_t h = tap(p, r, d->stride_h, d->pad_h0, d->dilation_h, st->h);
      for (int64_t q = 0; q < st->q && h >= 0; q++) {
        const int64_t w = tap(q, s, d->stride_w, d->pad_w0, d->dilation_w, st->w);
        if (w >= 0) acc += at(cv->a, n, p, q, k) * at(cv->b, n, h, w, c);
      }
    }
  return acc;
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_gemm_epilogue *e = &st->desc.epilogue;
  const smelt_tensor *c = t[SMELT__CONV2D_C], *d = t[SMELT__CONV2D_D], *bias = t[SMELT__CONV2D_BIAS];
  const conv cv = {st, t[SMELT__CONV2D_A], t[SMELT__CONV2D_B]};
  double (*const sum)(const conv *, int64_t, int64_t, int64_t, int64_t) =
      st->desc.kind == SMELT_CONV2D_WGRAD ? wgrad : over_taps;
  const double scale = e->alpha * (double)e->scale_a * (double)e->scale_b;
  for (int64_t i0 = 0; i0 < d->shape[0]; i0++)
    for (int64_t i1 = 0; i1 < d->shape[1]; i1++)
      for (int64_t i2 = 0; i2 < d->shape[2]; i2++)
        for (int64_t i3 = 0; i3 < d->shape[3]; i3++) {
          double v = scale * sum(&cv, i0, i1, i2, i3);
          if (st->has_c) v += e->beta * at(c, i0, i1, i2, i3);
          if (st->has_bias) v += smelt__load_f64(bias->data, bias->dtype, i3 * bias->strides[0]);
          v = smelt_act_apply(e->act, v, e->slope) * (double)e->scale_d;
          if (e->clamp) v = smelt__clamp_finite(d->dtype, v);
          smelt__store_f64(d->data, d->dtype, smelt__conv2d_off(d, i0, i1, i2, i3), v);
        }
  return SMELT_OK;
}

const smelt__backend smelt__cpu_conv2d = {.run = run};
