/* Conv2d on CUDA with an explicit im2col workspace, what CUTLASS calls the
 * few- and fixed-channel iterators done as data movement plus one smelt
 * GEMM: for the f16 and bf16 problems the implicit GEMMs decline (channels
 * not a multiple of 8, such as C = 3 in a network's first layer, or views
 * they cannot gather), which otherwise fall to the reference kernel. The
 * columns are short (R·S·C) and the GEMM engine is fast on them, so the
 * extra pass over memory costs less than a gather that wastes most of a
 * 16-byte access per tap.
 *
 *   fprop  im2col(x) [NPQ, kp] · w' [K, kp]ᵀ -> y [NPQ, K], the conv's
 *          whole epilogue in the GEMM's
 *   wgrad  dyᵀ [K, NPQ] · im2col(x) [NPQ, RSC] -> dw [K, RSC], the
 *          epilogue in the GEMM's (over several chunks: f32 sums in a
 *          workspace, the epilogue by col2im as a 1 x 1 gather)
 *   dgrad  dy [NPQ, K] · w' [K, RSC] -> f32 columns, then col2im gathers
 *          each dx element's taps in a fixed order and applies the epilogue
 *
 * kp is R·S·C rounded up to 8 (16-byte rows); w' is w copied to [K, kp]
 * with zeros past R·S·C by the im2col kernel. The problem runs in chunks
 * (GEMM rows for fprop and wgrad, images for dgrad, whose taps cross rows)
 * so that the workspace stays within min(256 MiB, 4 x the larger
 * activation): never more than a few times what the caller's tensors take.
 * The inner GEMMs (a full chunk, the last partial one, wgrad's later
 * chunks) are planned here with the workspace's real alignment and run
 * through smelt__gemm_reuse. */
#include "../core/gemm_internal.h"
#include "conv2d_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* kernels/conv2d_im2col.cu's im2col_params and col2im_params, field for field. */
typedef struct im2col_kparams {
  uint64_t src, dst;
  int64_t s_n, s_h, s_w, s_c;
  int64_t m0, rows;
  int64_t kp, rsc;
  int h, w, c, p, q, s;
  int pad_h, pad_w, st_h, st_w, dil_h, dil_w;
} im2col_kparams;

_Static_assert(sizeof(im2col_kparams) == 128, "im2col_kparams must match conv2d_im2col.cu's im2col_params");

typedef struct col2im_kparams {
  uint64_t col, c, d;
  int64_t col_n, col_p, col_q;
  int64_t c_s[4], d_s[4];
  int64_t n0, images;
  int h, w, ch, p, q, r, s;
  int pad_h, pad_w, st_h, st_w, dil_h, dil_w, pad0;
  double alpha_ab, beta;
  float scale_d;
  int dt_c, dt_d, clamp, has_c, pad1;
} col2im_kparams;

_Static_assert(sizeof(col2im_kparams) == 224, "col2im_kparams must match conv2d_im2col.cu's col2im_params");

#define OP "smelt_conv2d"
#define BLOCK 256
#define WS_CAP ((int64_t)256 << 20)
#define WS_PER_ACT 4 /* the workspace's bound in activations */

/* The inner GEMMs: a full chunk (wgrad's first), wgrad's later full
 * chunks adding into the f32 sums, and the last chunk when it is shorter. */
enum { G_FIRST, G_NEXT, G_TAIL, G_COUNT };

/* What the plan decided (plan->backend). */
typedef struct explicit_plan {
  int64_t kp, rsc;      /* the columns' row stride and the taps' columns */
  int64_t units, chunk; /* rows (fprop, wgrad) or images (dgrad): all and per chunk */
  int chunks;
  int sums;             /* wgrad over several chunks: f32 sums at off_sums, finished by col2im */
  size_t off_col, off_sums, ws_bytes; /* w's copy (fprop, dgrad) at offset 0 */
  smelt_gemm_desc desc[G_COUNT];
  smelt_plan *gemm[G_COUNT];
  CUfunction col2im;
} explicit_plan;

static void explicit_free(void *p) {
  explicit_plan *ep = (explicit_plan *)p;
  for (int g = 0; g < G_COUNT; g++) smelt_plan_destroy(ep->gemm[g]);
  free(ep);
}

/* The one place the module's source is made (plan and enumerator): the
 * kernels copy bits or read f32, so one module serves f16 and bf16. */
static void make_src(smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "conv2d_im2col");
  src->body = "conv2d_im2col.cu";
  smelt__prelude_define(src, "GEMM_ACC", 1);
}

int smelt__conv2d_explicit_variants(smelt__kernel_src *out, int max) {
  if (max > 0) make_src(out);
  return 1;
}

/* ---------------------------------------------------------------- preconditions and chunks */

static int fits_int(int64_t v) { return v >= 0 && v < ((int64_t)1 << 31); }
static int64_t round_up(int64_t v, int64_t m) { return smelt__ceil_div(v, m) * m; }

/* The chunks and the workspace's layout; 0 when one chunk's unit does not
 * fit the cap (a filter copy or, for dgrad, one image's columns). */
static int plan_chunks(const smelt__conv2d_state *st, explicit_plan *ep) {
  const smelt_conv2d_kind kind = st->desc.kind;
  const int64_t npq = st->n * st->p * st->q;
  ep->rsc = st->r * st->s * st->c;
  ep->kp = round_up(ep->rsc, 8);
  /* w's copy (16-bit) for fprop and dgrad, the f32 sums for wgrad; a
   * unit's columns: a 16-bit row, or an image's f32 rows for dgrad. */
  const int64_t fixed_el = kind == SMELT_CONV2D_WGRAD ? 4 : 2;
  if (ep->kp > WS_CAP || st->k > WS_CAP / (fixed_el * ep->kp) ||
      (kind == SMELT_CONV2D_DGRAD && st->p * st->q > WS_CAP / (4 * ep->kp)))
    return 0;
  const int64_t unit = (kind == SMELT_CONV2D_DGRAD ? 4 * st->p * st->q : 2) * ep->kp;
  const int64_t fixed = round_up(st->k * ep->kp * fixed_el, 256);
  if (fixed + unit > WS_CAP) return 0;
  const int64_t act = st->n * st->h * st->w * st->c > npq * st->k ? st->n * st->h * st->w * st->c : npq * st->k;
  const int64_t budget = act > WS_CAP / (2 * WS_PER_ACT) ? WS_CAP : 2 * WS_PER_ACT * act;
  ep->units = kind == SMELT_CONV2D_DGRAD ? st->n : npq;
  ep->chunk = (budget - fixed) / unit;
  if (ep->chunk < 1) ep->chunk = 1;
  if (kind != SMELT_CONV2D_DGRAD && ep->chunk > 256) ep->chunk -= ep->chunk % 128; /* whole GEMM tiles */
  if (ep->chunk > ep->units) ep->chunk = ep->units;
  ep->chunks = (int)smelt__ceil_div(ep->units, ep->chunk);
  /* wgrad's f32 sums also when smelt splits K and R S C is not a multiple
   * of 4: their kp columns let the Hopper GEMM split in parallel (its f32
   * partials want rows of whole 16-byte units; ResNet's stem, 147 columns
   * and K = NPQ = 802816, ran unsplit at 4.6 TFLOP/s). */
  ep->sums = kind == SMELT_CONV2D_WGRAD && (ep->chunks > 1 || (st->auto_split && ep->rsc % 4 != 0));
  const int64_t col = round_up(ep->chunk * unit, 256);
  ep->off_col = kind == SMELT_CONV2D_WGRAD ? 0 : (size_t)fixed;
  ep->off_sums = ep->off_col + (size_t)col;
  ep->ws_bytes = ep->off_sums + (ep->sums ? (size_t)fixed : 0);
  return 1;
}

/* Whether this path serves the plan's problem: 16-bit operands, every
 * extent an int, and the views the GEMMs read or write as matrices fold
 * (fprop's y and C, dgrad's and wgrad's dy, wgrad's dw and C); x and dgrad's
 * dx and C may have any strides (the kernels index them in 4-D). */
static int serves(const smelt__conv2d_state *st, const smelt_tensor *const *t) {
  const smelt_conv2d_desc *d = &st->desc;
  const smelt_tensor *a = t[SMELT__CONV2D_A], *dd = t[SMELT__CONV2D_D], *c = t[SMELT__CONV2D_C];
  int64_t rs, cs;
  if ((a->dtype != SMELT_DTYPE_F16 && a->dtype != SMELT_DTYPE_BF16) || d->math == SMELT_GEMM_MATH_TF32) return 0;
  const int64_t ext[] = {st->n * st->p * st->q, st->h, st->w, st->c, st->k, st->r, st->s, st->p, st->q};
  for (size_t i = 0; i < sizeof ext / sizeof *ext; i++)
    if (!fits_int(ext[i])) return 0;
  switch (d->kind) {
    case SMELT_CONV2D_FPROP:
      return smelt__conv2d_as_matrix(dd, 0, &rs, &cs) && (!st->has_c || smelt__conv2d_as_matrix(c, 0, &rs, &cs));
    case SMELT_CONV2D_DGRAD: return smelt__conv2d_fold(a, 0, 2) >= 0;
    default:
      return smelt__conv2d_fold(a, 0, 2) >= 0 && smelt__conv2d_as_matrix(dd, 1, &rs, &cs) &&
             (!st->has_c || smelt__conv2d_as_matrix(c, 1, &rs, &cs));
  }
}

/* ---------------------------------------------------------------- the inner GEMMs */

/* The conv's split-K as the GEMM's: smelt's choice, or the slices and
 * mode asked for. */
static smelt_gemm_desc base_desc(const smelt__conv2d_state *st) {
  smelt_gemm_desc g = smelt_gemm_desc_default();
  if (st->auto_split) return g;
  g.split_k = st->desc.split_k_slices;
  g.mode = g.split_k == 1                                           ? SMELT_GEMM_MODE_PLAIN
           : st->desc.split_k_mode == SMELT_CONV2D_SPLIT_K_PARALLEL ? SMELT_GEMM_MODE_SPLIT_K_PARALLEL
                                                                    : SMELT_GEMM_MODE_SPLIT_K_SERIAL;
  return g;
}

/* The GEMMs whose output is the conv's own take its epilogue; the others
 * write plain sums (wgrad's later chunks add into them). */
static void make_descs(const smelt__conv2d_state *st, explicit_plan *ep) {
  const smelt_gemm_desc plain = base_desc(st);
  smelt_gemm_desc conv = plain;
  conv.epilogue = st->desc.epilogue;
  conv.epilogue.graph = NULL; /* not a conv's (the other paths ignore it too) */
  const int direct = st->desc.kind == SMELT_CONV2D_FPROP || (st->desc.kind == SMELT_CONV2D_WGRAD && !ep->sums);
  ep->desc[G_FIRST] = ep->desc[G_TAIL] = direct ? conv : plain;
  ep->desc[G_NEXT] = plain;
  if (ep->sums) ep->desc[G_NEXT].epilogue.beta = ep->desc[G_TAIL].epilogue.beta = 1.0;
}

static int slot_of(const explicit_plan *ep, int i) {
  if (i == ep->chunks - 1 && ep->units % ep->chunk) return G_TAIL;
  return i > 0 && ep->sums ? G_NEXT : G_FIRST;
}

/* A 2-D view of rows x cols at byte offset `off` of base. */
static smelt_tensor mat(const void *base, size_t off, smelt_dtype dt, int dev, int64_t rows, int64_t cols, int64_t rs,
                        int64_t cs) {
  const int64_t shape[2] = {rows, cols};
  smelt_tensor m = smelt_tensor_make((char *)(uintptr_t)base + off, dt, SMELT_DEVICE_CUDA, dev, 2, shape);
  m.strides[0] = rs, m.strides[1] = cs;
  return m;
}

/* The operands of chunk i's GEMM: a, b, c (when has_c), d. */
typedef struct gemm_ops {
  smelt_tensor a, b, c, d;
  int has_c;
} gemm_ops;

static void chunk_ops(const smelt_plan *plan, const explicit_plan *ep, const smelt_tensor *const *t, void *ws, int i,
                      gemm_ops *o) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_tensor *a = t[SMELT__CONV2D_A], *c = t[SMELT__CONV2D_C], *dd = t[SMELT__CONV2D_D];
  const smelt_dtype dt = a->dtype;
  const int dev = plan->ctx->device_index;
  const int64_t per = st->desc.kind == SMELT_CONV2D_DGRAD ? st->p * st->q : 1; /* rows per unit */
  const int64_t u0 = (int64_t)i * ep->chunk, m0 = u0 * per;
  const int64_t mr = (u0 + ep->chunk > ep->units ? ep->units - u0 : ep->chunk) * per;
  const size_t dsz = smelt_dtype_size(dd->dtype);
  int64_t rs, cs;
  o->has_c = 0;
  switch (st->desc.kind) {
    case SMELT_CONV2D_FPROP: /* im2col [mr, kp] · w' [K, kp]ᵀ -> y rows m0.. */
      o->a = mat(ws, ep->off_col, dt, dev, mr, ep->kp, ep->kp, 1);
      o->b = mat(ws, 0, dt, dev, ep->kp, st->k, 1, ep->kp);
      smelt__conv2d_as_matrix(dd, 0, &rs, &cs);
      o->d = mat(dd->data, (size_t)(m0 * rs) * dsz, dd->dtype, dev, mr, st->k, rs, cs);
      if ((o->has_c = st->has_c)) {
        smelt__conv2d_as_matrix(c, 0, &rs, &cs);
        o->c = mat(c->data, (size_t)(m0 * rs) * dsz, c->dtype, dev, mr, st->k, rs, cs);
      }
      break;
    case SMELT_CONV2D_DGRAD: /* dy rows m0.. · w' [K, RSC] -> f32 columns */
      rs = smelt__conv2d_fold(a, 0, 2);
      o->a = mat(a->data, (size_t)(m0 * rs) * 2, dt, dev, mr, st->k, rs, a->strides[3]);
      /* kp columns (w's copy is zero past R S C; col2im reads R S C of
       * them), so D's f32 rows are whole 16-byte units for TMA's stores. */
      o->b = mat(ws, 0, dt, dev, st->k, ep->kp, ep->kp, 1);
      o->d = mat(ws, ep->off_col, SMELT_DTYPE_F32, dev, mr, ep->kp, ep->kp, 1);
      break;
    default: /* dyᵀ [K, mr] · im2col [mr, RSC] -> dw, or the f32 sums */
      rs = smelt__conv2d_fold(a, 0, 2);
      o->a = mat(a->data, (size_t)(m0 * rs) * 2, dt, dev, st->k, mr, a->strides[3], rs);
      /* Into the sums: kp columns (the columns' zero padding). */
      o->b = mat(ws, ep->off_col, dt, dev, mr, ep->sums ? ep->kp : ep->rsc, ep->kp, 1);
      if (ep->sums) {
        o->d = mat(ws, ep->off_sums, SMELT_DTYPE_F32, dev, st->k, ep->kp, ep->kp, 1);
        if ((o->has_c = i > 0)) o->c = o->d;
      } else {
        smelt__conv2d_as_matrix(dd, 1, &rs, &cs);
        o->d = mat(dd->data, 0, dd->dtype, dev, st->k, ep->rsc, rs, cs);
        if ((o->has_c = st->has_c)) {
          smelt__conv2d_as_matrix(c, 1, &rs, &cs);
          o->c = mat(c->data, 0, c->dtype, dev, st->k, ep->rsc, rs, cs);
        }
      }
      break;
  }
}

static smelt_status chunk_gemm(smelt_plan *plan, explicit_plan *ep, const smelt_tensor *const *t, void *ws, int i) {
  gemm_ops o;
  chunk_ops(plan, ep, t, ws, i, &o);
  const int g = slot_of(ep, i);
  const smelt_tensor *bias = ((const smelt__conv2d_state *)plan->opdata)->has_bias ? t[SMELT__CONV2D_BIAS] : NULL;
  return smelt__gemm_reuse(plan->ctx, &ep->gemm[g], &ep->desc[g], &o.a, &o.b, o.has_c ? &o.c : NULL, &o.d, bias);
}

/* ---------------------------------------------------------------- plan */

/* Plans the GEMM of every slot some chunk uses, on the plan's tensors and
 * a workspace of the run's size (so the GEMM sees the alignments and the
 * no-overlap the runs will have). */
static smelt_status plan_gemms(smelt_plan *plan, explicit_plan *ep, const smelt_tensor *const *t) {
  void *ws;
  smelt_status s = smelt__cuda_alloc(plan->ctx, ep->ws_bytes, &ws);
  if (s) return s;
  const int firsts[3] = {0, 1, ep->chunks - 1};
  for (int f = 0; f < 3 && !s; f++) {
    if (firsts[f] >= ep->chunks) continue;
    const int g = slot_of(ep, firsts[f]);
    gemm_ops o;
    chunk_ops(plan, ep, t, ws, firsts[f], &o);
    if (!ep->gemm[g])
      s = smelt_gemm_plan(plan->ctx, &ep->desc[g], &o.a, &o.b, o.has_c ? &o.c : NULL, &o.d,
                          ((const smelt__conv2d_state *)plan->opdata)->has_bias ? t[SMELT__CONV2D_BIAS] : NULL,
                          &ep->gemm[g]);
  }
  const smelt_status s2 = smelt__cuda_free(plan->ctx, ws);
  return s ? s : s2;
}

static void describe(smelt_plan *plan, const explicit_plan *ep) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const char *inner = smelt_plan_describe(ep->gemm[G_FIRST]);
  const int klen = (int)strcspn(inner, " ");
  char core[sizeof plan->describe];
  snprintf(core, sizeof core, "%s", plan->describe);
  snprintf(plan->describe, sizeof plan->describe, "explicit %s %.*s, chunks %d: %.80s",
           st->desc.kind == SMELT_CONV2D_DGRAD ? "GEMM+col2im" : "im2col+GEMM", klen < 48 ? klen : 48, inner,
           ep->chunks, core);
}

smelt_status smelt__conv2d_explicit_plan(smelt_plan *plan, const smelt_tensor *const *t, int *taken) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  *taken = 0;
  explicit_plan *ep = (explicit_plan *)calloc(1, sizeof *ep);
  if (!ep) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": the plan's launch record");
  if (!serves(st, t) || !plan_chunks(st, ep)) {
    free(ep);
    return SMELT_OK;
  }
  make_descs(st, ep);
  smelt__kernel_src src;
  make_src(&src);
  CUfunction im2col = NULL;
  smelt_status s = smelt__cuda_function(plan->ctx, &src, "conv2d_im2col", &im2col);
  if (!s) s = smelt__cuda_function(plan->ctx, &src, "conv2d_col2im", &ep->col2im);
  if (!s) s = plan_gemms(plan, ep, t);
  if (s) {
    explicit_free(ep);
    return s;
  }
  plan->func[SMELT__CONV_F_IM2COL] = im2col;
  plan->backend = ep;
  plan->backend_free = explicit_free;
  *taken = 1;
  describe(plan, ep);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- run */

static uint64_t ptr(const void *p, size_t off) { return (uint64_t)(uintptr_t)p + off; }

static unsigned grid_of(int64_t total) {
  const int64_t blocks = smelt__ceil_div(total, BLOCK);
  return (unsigned)(blocks > 0x7fffffff ? 0x7fffffff : blocks);
}

/* im2col of rows m0 .. m0 + rows - 1 of src (x, or w as K images of
 * R x S pixels with one output position) into dst. */
static smelt_status im2col(smelt_plan *plan, const explicit_plan *ep, const smelt_tensor *src, const int64_t pq[2],
                           const int geom[6], int64_t m0, int64_t rows, uint64_t dst) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  im2col_kparams P;
  memset(&P, 0, sizeof P);
  P.src = ptr(src->data, 0), P.dst = dst;
  P.s_n = src->strides[0], P.s_h = src->strides[1], P.s_w = src->strides[2], P.s_c = src->strides[3];
  P.m0 = m0, P.rows = rows, P.kp = ep->kp, P.rsc = ep->rsc;
  P.h = (int)src->shape[1], P.w = (int)src->shape[2], P.c = (int)src->shape[3];
  P.p = (int)pq[0], P.q = (int)pq[1], P.s = (int)st->s;
  P.pad_h = geom[0], P.pad_w = geom[1], P.st_h = geom[2], P.st_w = geom[3], P.dil_h = geom[4], P.dil_w = geom[5];
  void *params[] = {&P};
  return smelt__cuda_launch(plan->ctx, OP, (CUfunction)plan->func[SMELT__CONV_F_IM2COL], grid_of(rows * (ep->kp / 8)),
                            1, 1, BLOCK, 0, params);
}

static void strides4(int64_t *out, const smelt_tensor *t) {
  for (int i = 0; i < 4; i++) out[i] = t ? t->strides[i] : 0;
}

/* col2im into D's images n0 .. n0 + images - 1 from the f32 columns at
 * col (strides col_s: image, output row, output column), through a filter
 * of r x s taps at geom (pads, strides, dilations) whose outputs are
 * pq[0] x pq[1]; then the conv's epilogue. */
static smelt_status col2im(smelt_plan *plan, const explicit_plan *ep, const smelt_tensor *const *t, uint64_t col,
                           const int64_t col_s[3], const int64_t pq[2], int r, int s, const int geom[6], int64_t n0,
                           int64_t images) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_gemm_epilogue *e = &st->desc.epilogue;
  const smelt_tensor *c = t[SMELT__CONV2D_C], *dd = t[SMELT__CONV2D_D];
  col2im_kparams P;
  memset(&P, 0, sizeof P);
  P.col = col, P.c = st->has_c ? ptr(c->data, 0) : 0, P.d = ptr(dd->data, 0);
  P.col_n = col_s[0], P.col_p = col_s[1], P.col_q = col_s[2];
  strides4(P.c_s, st->has_c ? c : NULL);
  strides4(P.d_s, dd);
  P.n0 = n0, P.images = images;
  P.h = (int)dd->shape[1], P.w = (int)dd->shape[2], P.ch = (int)dd->shape[3];
  P.p = (int)pq[0], P.q = (int)pq[1], P.r = r, P.s = s;
  P.pad_h = geom[0], P.pad_w = geom[1], P.st_h = geom[2], P.st_w = geom[3], P.dil_h = geom[4], P.dil_w = geom[5];
  P.alpha_ab = e->alpha * (double)e->scale_a * (double)e->scale_b;
  P.beta = e->beta;
  P.scale_d = e->scale_d;
  P.dt_c = st->has_c ? (int)c->dtype : 0;
  P.dt_d = (int)dd->dtype;
  P.clamp = e->clamp != 0;
  P.has_c = st->has_c;
  void *params[] = {&P};
  return smelt__cuda_launch(plan->ctx, OP, ep->col2im, grid_of(images * P.h * P.w * P.ch), 1, 1, BLOCK, 0, params);
}

/* The chunks in order: fprop and wgrad im2col then GEMM; dgrad GEMM then
 * col2im; wgrad's f32 sums finished by col2im over a 1 x 1 filter. */
static smelt_status run_chunks(smelt_plan *plan, explicit_plan *ep, const smelt_tensor *const *t, void *ws) {
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_conv2d_desc *d = &st->desc;
  const smelt_conv2d_kind kind = d->kind;
  const int conv_geom[6] = {d->pad_h0, d->pad_w0, d->stride_h, d->stride_w, d->dilation_h, d->dilation_w};
  const int unit_geom[6] = {0, 0, 1, 1, 1, 1};
  const int64_t out_pq[2] = {st->p, st->q}, one_pq[2] = {1, 1};
  smelt_status s = SMELT_OK;
  if (kind != SMELT_CONV2D_WGRAD) /* w' [K, kp]: w's K images of R x S pixels, one output position each */
    s = im2col(plan, ep, t[SMELT__CONV2D_B], one_pq, unit_geom, 0, st->k, ptr(ws, 0));
  const smelt_tensor *x = t[kind == SMELT_CONV2D_WGRAD ? SMELT__CONV2D_B : SMELT__CONV2D_A];
  for (int i = 0; i < ep->chunks && !s; i++) {
    const int64_t u0 = (int64_t)i * ep->chunk, nu = u0 + ep->chunk > ep->units ? ep->units - u0 : ep->chunk;
    if (kind != SMELT_CONV2D_DGRAD) s = im2col(plan, ep, x, out_pq, conv_geom, u0, nu, ptr(ws, ep->off_col));
    if (!s) s = chunk_gemm(plan, ep, t, ws, i);
    if (!s && kind == SMELT_CONV2D_DGRAD) {
      const int64_t col_s[3] = {st->p * st->q * ep->kp, st->q * ep->kp, ep->kp};
      s = col2im(plan, ep, t, ptr(ws, ep->off_col), col_s, out_pq, (int)st->r, (int)st->s, conv_geom, u0, nu);
    }
  }
  if (!s && ep->sums) { /* dw[k, r, s, c] = epilogue(sums[k, (r·S + s)·C + c]) */
    const int64_t col_s[3] = {ep->kp, st->s * st->c, st->c}, rs_pq[2] = {st->r, st->s};
    s = col2im(plan, ep, t, ptr(ws, ep->off_sums), col_s, rs_pq, 1, 1, unit_geom, 0, st->k);
  }
  return s;
}

smelt_status smelt__conv2d_explicit_run(smelt_plan *plan, const smelt_tensor *const *t) {
  explicit_plan *ep = (explicit_plan *)plan->backend;
  void *ws;
  smelt_status s = smelt__cuda_alloc(plan->ctx, ep->ws_bytes, &ws);
  if (s) return s;
  s = run_chunks(plan, ep, t, ws);
  const smelt_status s2 = smelt__cuda_free(plan->ctx, ws);
  return s ? s : s2;
}
