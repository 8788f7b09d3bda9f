/* CPU reference for smelt_bem and smelt_bem_backward (smelt/bem.h), in
 * double, rounding each output once. Segment by segment: the adapter's V
 * and U are read into double scratch once, then each row of the segment
 * runs the definition's steps in order (A, H, ΔY; or dH, dcodes, dA, dx,
 * and its terms of dV and dU). dV and dU are summed in double scratch over
 * all rows and stored at the end; rows in no segment get zeros. */
#include "../core/bem_internal.h"
#include "../core/checked.h"

#include <stdlib.h>
#include <string.h>

/* The element (i, j) of a 2-D view, or of adapter a's matrix in a 3-D one. */
static int64_t at(const smelt_tensor *t, int64_t a, int64_t i, int64_t j) {
  const int d = t->ndim - 2;
  return (d ? a * t->strides[0] : 0) + i * t->strides[d] + j * t->strides[d + 1];
}
static double ld(const smelt_tensor *t, int64_t off) { return smelt__load_f64(t->data, t->dtype, off); }
static void st(const smelt_tensor *t, int64_t off, double v) { smelt__store_f64(t->data, t->dtype, off, v); }

/* Adapter a's matrix [rows, r] of a 2-D or 3-D view into w (row-major double). */
static void load_mat(const smelt_tensor *t, int64_t a, int64_t rows, int64_t r, double *w) {
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < r; j++) w[i * r + j] = ld(t, at(t, a, i, j));
}

/* The double scratch for V, U and (backward) dV and dU, all checked first. */
typedef struct scratch {
  double *v, *u, *dv, *du;
} scratch;

static smelt_status scratch_alloc(const smelt__bem_state *s, int grads, scratch *w) {
  memset(w, 0, sizeof *w);
  size_t vb = 0, ub = 0, dvb = 0, dub = 0;
  int64_t vn, un, dvn, dun;
  smelt_status e;
  if ((e = smelt__mul_i64(s->din, s->r, &vn, "smelt_bem", "the reference's V scratch")) ||
      (e = smelt__mul_i64(s->dout, s->r, &un, "smelt_bem", "the reference's U scratch")) ||
      (e = smelt__bytes(vn, sizeof(double), &vb, "smelt_bem", "the reference's V scratch")) ||
      (e = smelt__bytes(un, sizeof(double), &ub, "smelt_bem", "the reference's U scratch")))
    return e;
  if (grads && ((e = smelt__mul_i64(vn, s->A, &dvn, "smelt_bem", "the reference's dV scratch")) ||
                (e = smelt__mul_i64(un, s->A, &dun, "smelt_bem", "the reference's dU scratch")) ||
                (e = smelt__bytes(dvn, sizeof(double), &dvb, "smelt_bem", "the reference's dV scratch")) ||
                (e = smelt__bytes(dun, sizeof(double), &dub, "smelt_bem", "the reference's dU scratch"))))
    return e;
  w->v = (double *)malloc(vb ? vb : 1);
  w->u = (double *)malloc(ub ? ub : 1);
  w->dv = grads ? (double *)calloc(dvb ? dvb / sizeof(double) : 1, sizeof(double)) : NULL;
  w->du = grads ? (double *)calloc(dub ? dub / sizeof(double) : 1, sizeof(double)) : NULL;
  if (!w->v || !w->u || (grads && (!w->dv || !w->du)))
    return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_bem: out of host memory for the reference's scratch");
  return SMELT_OK;
}

static void scratch_free(scratch *w) {
  free(w->v);
  free(w->u);
  free(w->dv);
  free(w->du);
}

/* Adapter a's scale. */
static double scale_of(const smelt__bem_state *s, const smelt_tensor *scales, int64_t a) {
  return s->desc.scale * (scales ? ld(scales, a * scales->strides[0]) : 1.0);
}

/* A = x[m]·V and H = A ∘ codes[m] for one row. */
static void row_ah(const smelt__bem_state *s, const smelt_tensor *x, const smelt_tensor *codes, const double *v,
                   int64_t m, double *A, double *H) {
  for (int64_t j = 0; j < s->r; j++) A[j] = 0;
  for (int64_t k = 0; k < s->din; k++) {
    const double xk = ld(x, at(x, 0, m, k));
    for (int64_t j = 0; j < s->r; j++) A[j] += xk * v[k * s->r + j];
  }
  for (int64_t j = 0; j < s->r; j++) H[j] = A[j] * ld(codes, at(codes, 0, m, j));
}

/* y[m] = ΔY[m] (or += with accumulate); H NULL: a row in no segment. */
static void row_forward(const smelt__bem_state *s, const smelt_tensor *y, const double *u, double sc, int64_t m,
                        const double *H) {
  for (int64_t n = 0; n < s->dout; n++) {
    double d = 0;
    if (H) {
      for (int64_t j = 0; j < s->r; j++) d += H[j] * u[n * s->r + j];
      d *= sc;
    }
    const int64_t off = at(y, 0, m, n);
    if (s->desc.accumulate) {
      if (H) st(y, off, ld(y, off) + d);
    } else {
      st(y, off, d);
    }
  }
}

/* One row's gradients: dx[m] and dcodes[m] stored, its terms added to the
 * dV and dU scratch of adapter a. */
static void row_backward(const smelt__bem_state *s, const smelt_tensor *const *t, const scratch *w, double sc,
                         int64_t a, int64_t m, const double *A, const double *H) {
  const smelt_tensor *x = t[SMELT__BT_X], *codes = t[SMELT__BT_CODES], *dy = t[SMELT__BT_DY];
  const smelt_tensor *dx = t[SMELT__BT_DX], *dcodes = t[SMELT__BT_DCODES];
  const int64_t r = s->r;
  double dH[SMELT_BEM_MAX_RANK] = {0}, dA[SMELT_BEM_MAX_RANK];
  double *du = w->du + a * s->dout * r, *dv = w->dv + a * s->din * r;
  for (int64_t n = 0; n < s->dout; n++) {
    const double g = sc * ld(dy, at(dy, 0, m, n));
    for (int64_t j = 0; j < r; j++) {
      dH[j] += g * w->u[n * r + j];
      du[n * r + j] += g * H[j];
    }
  }
  for (int64_t j = 0; j < r; j++) {
    if (dcodes) st(dcodes, at(dcodes, 0, m, j), dH[j] * A[j]);
    dA[j] = dH[j] * ld(codes, at(codes, 0, m, j));
  }
  for (int64_t k = 0; k < s->din; k++) {
    const double xk = ld(x, at(x, 0, m, k));
    double d = 0;
    for (int64_t j = 0; j < r; j++) {
      d += dA[j] * w->v[k * r + j];
      dv[k * r + j] += xk * dA[j];
    }
    if (dx) st(dx, at(dx, 0, m, k), d);
  }
}

/* dx and dcodes rows of a row in no segment. */
static void row_zero_grads(const smelt__bem_state *s, const smelt_tensor *const *t, int64_t m) {
  const smelt_tensor *dx = t[SMELT__BT_DX], *dcodes = t[SMELT__BT_DCODES];
  for (int64_t k = 0; dx && k < s->din; k++) st(dx, at(dx, 0, m, k), 0.0);
  for (int64_t j = 0; dcodes && j < s->r; j++) st(dcodes, at(dcodes, 0, m, j), 0.0);
}

/* Stores adapter-major double scratch g [A, rows, r] into a gradient view. */
static void store_grad(const smelt__bem_state *s, const smelt_tensor *d, const double *g, int64_t rows) {
  for (int64_t a = 0; a < s->A; a++)
    for (int64_t i = 0; i < rows; i++)
      for (int64_t j = 0; j < s->r; j++) st(d, at(d, a, i, j), g[(a * rows + i) * s->r + j]);
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt__bem_state *s = (const smelt__bem_state *)plan->opdata;
  size_t ob = 0;
  smelt_status e = smelt__bytes(s->A + 1, sizeof(int64_t), &ob, "smelt_bem", "the reference's segment bounds");
  int64_t *o = e ? NULL : (int64_t *)malloc(ob);
  scratch w = {0};
  if (!e) e = o ? scratch_alloc(s, s->backward, &w)
                : smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_bem: out of host memory");
  if (e) {
    scratch_free(&w);
    free(o);
    return e;
  }
  smelt__bem_bounds(t[SMELT__BT_OFFSETS], s->A, s->M, o);
  double A[SMELT_BEM_MAX_RANK], H[SMELT_BEM_MAX_RANK];
  for (int64_t m = 0; m < o[0]; m++)
    s->backward ? row_zero_grads(s, t, m) : row_forward(s, t[SMELT__BT_Y], NULL, 0, m, NULL);
  for (int64_t a = 0; a < s->A; a++) {
    if (o[a] == o[a + 1]) continue;
    load_mat(t[SMELT__BT_V], a, s->din, s->r, w.v);
    load_mat(t[SMELT__BT_U], a, s->dout, s->r, w.u);
    const double sc = scale_of(s, t[SMELT__BT_SCALES], a);
    for (int64_t m = o[a]; m < o[a + 1]; m++) {
      row_ah(s, t[SMELT__BT_X], t[SMELT__BT_CODES], w.v, m, A, H);
      if (s->backward) row_backward(s, t, &w, sc, a, m, A, H);
      else row_forward(s, t[SMELT__BT_Y], w.u, sc, m, H);
    }
  }
  for (int64_t m = o[s->A]; m < s->M; m++)
    s->backward ? row_zero_grads(s, t, m) : row_forward(s, t[SMELT__BT_Y], NULL, 0, m, NULL);
  if (t[SMELT__BT_DV]) store_grad(s, t[SMELT__BT_DV], w.dv, s->din);
  if (t[SMELT__BT_DU]) store_grad(s, t[SMELT__BT_DU], w.du, s->dout);
  scratch_free(&w);
  free(o);
  return SMELT_OK;
}

const smelt__backend smelt__cpu_bem = {.run = run};
