/* CPU reference for smelt_norm and smelt_norm_bwd, in double: the
 * definitions of include/smelt/norm.h step by step. h is rounded to x's
 * dtype before the statistics (as h_out stores it), so the fused form
 * equals the residual add followed by the norm. The backward reads the
 * forward's f32 statistics, as the kernels do, and sums dweight and dbias
 * over the rows in double. */
#include "../core/checked.h"
#include "../core/internal.h"

#include <math.h>
#include <stdlib.h>

/* v rounded to dtype dt. */
static double round_to(smelt_dtype dt, double v) {
  uint64_t cell = 0;
  smelt__store_f64(&cell, dt, 0, v);
  return smelt__load_f64(&cell, dt, 0);
}

static double load(const smelt_tensor *t, int64_t i) {
  return smelt__load_f64(t->data, t->dtype, smelt__tensor_offset(t, i));
}

static void store(const smelt_tensor *t, int64_t i, double v) {
  smelt__store_f64(t->data, t->dtype, smelt__tensor_offset(t, i), v);
}

/* Roles: x, residual, weight, bias, y, h_out, mean, rstd; h: C doubles of scratch. */
static void forward_row(const smelt_norm_desc *d, const smelt_tensor *const *t, int64_t r, int64_t C, double *h) {
  const smelt_tensor *x = t[0], *res = t[1], *w = t[2], *b = t[3];
  double sum = 0.0;
  for (int64_t j = 0; j < C; j++) {
    h[j] = res ? round_to(x->dtype, load(x, r * C + j) + load(res, r * C + j)) : load(x, r * C + j);
    sum += h[j];
  }
  const double mean = d->kind == SMELT_NORM_LAYER ? sum / (double)C : 0.0;
  double sq = 0.0;
  for (int64_t j = 0; j < C; j++) sq += (h[j] - mean) * (h[j] - mean);
  const double rstd = 1.0 / sqrt(sq / (double)C + (double)d->eps);
  for (int64_t j = 0; j < C; j++) {
    if (t[5]) store(t[5], r * C + j, h[j]);
    store(t[4], r * C + j, (h[j] - mean) * rstd * (w ? load(w, j) : 1.0) + (b ? load(b, j) : 0.0));
  }
  if (t[6]) store(t[6], r, mean);
  if (t[7]) store(t[7], r, rstd);
}

static smelt_status run_fwd(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt_tensor *x = t[0];
  const int64_t C = x->shape[x->ndim - 1], rows = smelt_tensor_numel(x) / C;
  size_t bytes = 0;
  smelt_status s = smelt__bytes(C, sizeof(double), &bytes, "smelt_norm", "the row scratch");
  if (s) return s;
  double *h = (double *)malloc(bytes);
  if (!h) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_norm: out of host memory for the row scratch");
  for (int64_t r = 0; r < rows; r++) forward_row((const smelt_norm_desc *)plan->opdata, t, r, C, h);
  free(h);
  return SMELT_OK;
}

const smelt__backend smelt__cpu_norm = {.run = run_fwd};

/* Roles: dy, x, weight, mean, rstd, dh, dx, dweight, dbias; dw, db: the
 * sums over rows so far. */
static void backward_row(const smelt_tensor *const *t, int64_t r, int64_t C, double *dw, double *db) {
  const smelt_tensor *dy = t[0], *x = t[1], *w = t[2];
  const double mean = t[3] ? load(t[3], r) : 0.0, rstd = load(t[4], r);
  double sg = 0.0, sgx = 0.0;
  for (int64_t j = 0; j < C; j++) {
    const double g = load(dy, r * C + j) * (w ? load(w, j) : 1.0), xhat = (load(x, r * C + j) - mean) * rstd;
    sg += g;
    sgx += g * xhat;
  }
  const double mg = t[3] ? sg / (double)C : 0.0, mgx = sgx / (double)C;
  for (int64_t j = 0; j < C; j++) {
    const double dyj = load(dy, r * C + j), xhat = (load(x, r * C + j) - mean) * rstd;
    const double g = dyj * (w ? load(w, j) : 1.0);
    dw[j] += dyj * xhat;
    db[j] += dyj;
    store(t[6], r * C + j, rstd * (g - mg - xhat * mgx) + (t[5] ? load(t[5], r * C + j) : 0.0));
  }
}

static smelt_status run_bwd(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt_tensor *dy = t[0];
  const int64_t C = dy->shape[dy->ndim - 1], rows = smelt_tensor_numel(dy) / C;
  (void)plan;
  size_t bytes = 0;
  smelt_status s = smelt__bytes(C, 2 * sizeof(double), &bytes, "smelt_norm_bwd", "the column sums");
  if (s) return s;
  double *dw = (double *)calloc((size_t)C * 2, sizeof(double)), *db = dw + C;
  if (!dw) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_norm_bwd: out of host memory for the column sums");
  for (int64_t r = 0; r < rows; r++) backward_row(t, r, C, dw, db);
  for (int64_t j = 0; j < C; j++) {
    if (t[7]) store(t[7], j, dw[j]);
    if (t[8]) store(t[8], j, db[j]);
  }
  free(dw);
  return SMELT_OK;
}

const smelt__backend smelt__cpu_norm_bwd = {.run = run_bwd};
