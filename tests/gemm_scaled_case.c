/* The shared runner of smelt_gemm_scaled cases (tests/gemm_scaled_case.h). */
#include "gemm_scaled_case.h"

void *tgs_filled(const th_view *v, smelt_dtype dt, double lo, double hi) {
  void *p = malloc((size_t)(v->storage + 1) * smelt_dtype_size(dt));
  if (dt == SMELT_DTYPE_I8)
    for (int64_t i = 0; i <= v->storage; i++) th_set(p, dt, i, (double)(int)th_rand_uniform(-128, 128));
  else th_fill_uniform(p, dt, v->storage + 1, lo, hi);
  return p;
}

void tgs_free(tgs_case *c) {
  for (int i = 0; i < TGS_N; i++) {
    free(c->host[i]);
    c->host[i] = NULL;
  }
}

double tgs_at(const void *p, smelt_dtype dt, const th_view *v, int64_t l, int64_t r, int64_t c) {
  const int o = v->ndim - 2;
  return th_get(p, dt, v->offset + (o ? l * v->strides[0] : 0) + r * v->strides[o] + c * v->strides[o + 1]);
}

double tgs_act(smelt_act a, double x) {
  switch (a) {
    case SMELT_ACT_RELU: return x > 0 ? x : 0;
    case SMELT_ACT_GELU: return 0.5 * x * erfc(-x / sqrt(2.0));
    default: return x;
  }
}

double tgs_stored(double v, smelt_dtype dt) {
  if (dt == SMELT_DTYPE_F64) return v;
  uint8_t tmp[8];
  th_set(tmp, dt, 0, (float)v);
  return th_get(tmp, dt, 0);
}

void tgs_naive(const tgs_case *c, double (*acc)(const void *user, int64_t l, int64_t i, int64_t j), const void *user,
               double *out) {
  const smelt_gemm_epilogue *e = &c->desc.epilogue;
  const th_view *vd = &c->v[TGS_D];
  const int nd = vd->ndim;
  const int64_t L = nd == 3 ? vd->shape[0] : 1, M = vd->shape[nd - 2], N = vd->shape[nd - 1];
  const smelt_dtype dt = c->dt[TGS_D];
  for (int64_t l = 0; l < L; l++)
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        double v = e->alpha * e->scale_a * e->scale_b * acc(user, l, i, j);
        if (c->has[TGS_C]) v += e->beta * tgs_at(c->host[TGS_C], dt, &c->v[TGS_C], l, i, j);
        if (c->has[TGS_BIAS]) v += ((const float *)c->host[TGS_BIAS])[j];
        out[(l * M + i) * N + j] = tgs_stored(tgs_act(e->act, v) * e->scale_d, dt);
      }
}

th_buf tgs_upload(smelt_ctx *ctx, const th_view *v, const void *host, smelt_dtype dt) {
  th_buf b = th_buf_new(ctx, (size_t)(v->storage + 1) * smelt_dtype_size(dt));
  if (host) th_buf_upload(&b, host, b.bytes);
  return b;
}

smelt_status tgs_run(smelt_ctx *ctx, const tgs_case *c, double *out, const char *what) {
  th_buf buf[TGS_N];
  smelt_tensor t[TGS_N];
  const smelt_tensor *arg[TGS_N];
  for (int i = 0; i < TGS_N; i++) {
    buf[i] = tgs_upload(ctx, &c->v[i], i == TGS_D ? NULL : c->host[i], c->dt[i]);
    t[i] = th_view_tensor(&c->v[i], &buf[i], c->dt[i]);
    arg[i] = i <= TGS_B || i == TGS_D || c->has[i] ? &t[i] : NULL;
  }
  const smelt_gemm_scales sc = {arg[TGS_SA], arg[TGS_SB]};
  smelt_plan *plan = NULL;
  smelt_status st = smelt_gemm_scaled_plan(ctx, &c->desc, arg[TGS_A], arg[TGS_B], arg[TGS_C], arg[TGS_D],
                                           arg[TGS_BIAS], &sc, &plan);
  if (st == SMELT_OK && c->kernel && smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA &&
      !strstr(smelt_plan_describe(plan), c->kernel))
    th_fail(__FILE__, __LINE__, "%s: the plan runs %s, want %s", what, smelt_plan_describe(plan), c->kernel);
  if (st == SMELT_OK)
    st = smelt_gemm_scaled_run(plan, arg[TGS_A], arg[TGS_B], arg[TGS_C], arg[TGS_D], arg[TGS_BIAS], &sc);
  if (st == SMELT_OK) st = smelt_ctx_synchronize(ctx);
  smelt_plan_destroy(plan);
  if (st == SMELT_OK) th_check_output(what, "D", &c->v[TGS_D], &buf[TGS_D], c->dt[TGS_D], out);
  for (int i = 0; i < TGS_N; i++) th_buf_free(&buf[i]);
  return st;
}

smelt_status tgs_run_offs(smelt_ctx *ctx, const smelt_gemm_desc *desc, const th_view *v, void *const *host,
                          const smelt_dtype *dt, const th_view *vd, smelt_dtype dt_d, int64_t last, const char *kernel,
                          double *got) {
  th_buf buf[TGS_ON];
  smelt_tensor t[TGS_ON];
  for (int i = 0; i < TGS_ON; i++) {
    buf[i] = tgs_upload(ctx, &v[i], host[i], dt[i]);
    t[i] = th_view_tensor(&v[i], &buf[i], dt[i]);
  }
  const int64_t rows = vd->shape[0], n = vd->shape[1], es = (int64_t)smelt_dtype_size(dt_d);
  th_buf D = th_buf_new(ctx, (size_t)(rows * n * es));
  const smelt_tensor td = th_view_tensor(vd, &D, dt_d);
  const smelt_gemm_scales sc = {&t[TGS_OSA], &t[TGS_OSB]};
  smelt_plan *plan = NULL;
  smelt_status st = smelt_gemm_grouped_offs_scaled_plan(ctx, desc, &t[TGS_OA], &t[TGS_OB], NULL, &td, NULL,
                                                        &t[TGS_OFFS], &sc, &plan);
  if (st == SMELT_OK && kernel && smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA &&
      !strstr(smelt_plan_describe(plan), kernel))
    th_fail(__FILE__, __LINE__, "grouped offs: the plan runs %s, want %s", smelt_plan_describe(plan), kernel);
  if (st == SMELT_OK)
    st = smelt_gemm_grouped_offs_scaled_run(plan, &t[TGS_OA], &t[TGS_OB], NULL, &td, NULL, &t[TGS_OFFS], &sc);
  if (st == SMELT_OK) st = smelt_ctx_synchronize(ctx);
  smelt_plan_destroy(plan);
  if (st == SMELT_OK) {
    /* Rows before the last end are D's; those after keep the poison. */
    uint8_t *h = (uint8_t *)malloc(D.bytes);
    th_buf_download(&D, h, D.bytes);
    CHECK(th_buf_guards_ok(&D));
    CHECK(th_all_ff(h + last * n * es, (size_t)((rows - last) * n * es)));
    for (int64_t i = 0; i < last * n; i++) got[i] = th_get(h, dt_d, i);
    free(h);
  }
  for (int i = 0; i < TGS_ON; i++) th_buf_free(&buf[i]);
  th_buf_free(&D);
  return st;
}

/* One code of the 8-bit float format dt at magnitude v (normal or not). */
static double code_step(smelt_dtype dt, double v) {
  const int mant = dt == SMELT_DTYPE_E4M3 ? 3 : 2, emin = dt == SMELT_DTYPE_E4M3 ? -6 : -14;
  int e = v > 0 ? ilogb(v) : emin;
  if (e < emin) e = emin;
  return ldexp(1.0, e - mant);
}

int tgs_check(const tgs_case *c, const char *label, void (*naive)(const void *user, double *out), const void *user,
              double naive_bound, smelt_ctx *gpu, double gpu_bound, double abs_bound) {
  const int64_t n = c->v[TGS_D].numel;
  double *ref = (double *)malloc(sizeof(double) * (size_t)(n + 1)),
         *cpu = (double *)malloc(sizeof(double) * (size_t)(n + 1)),
         *dev = (double *)malloc(sizeof(double) * (size_t)(n + 1));
  const int fails = th_failed_now;
  smelt_status st = tgs_run(th_cpu(), c, cpu, label);
  if (st != SMELT_OK) {
    th_fail(__FILE__, __LINE__, "%s: cpu: %s (%s)", label, smelt_status_name(st), smelt_last_error());
  } else if (naive) {
    naive(user, ref);
    if (!th_compare(label, cpu, ref, n, naive_bound, 0)) th_fail(__FILE__, __LINE__, "%s: cpu vs naive", label);
  }
  if (abs_bound < 0) { /* codes of D's 8-bit format at the reference's largest magnitude */
    double top = 0;
    for (int64_t i = 0; i < n; i++)
      if (isfinite(cpu[i]) && fabs(cpu[i]) > top) top = fabs(cpu[i]);
    abs_bound = -abs_bound * code_step(c->dt[TGS_D], top);
  }
  if (th_failed_now == fails && gpu) {
    st = tgs_run(gpu, c, dev, label);
    if (st != SMELT_OK)
      th_fail(__FILE__, __LINE__, "%s: cuda: %s (%s)", label, smelt_status_name(st), smelt_last_error());
    else if (!th_compare(label, dev, cpu, n, gpu_bound, abs_bound))
      th_fail(__FILE__, __LINE__, "%s: cuda vs cpu", label);
  }
  const int ok = th_failed_now == fails;
  if (!ok) th_fail(__FILE__, __LINE__, "case failed: %s", label);
  free(ref);
  free(cpu);
  free(dev);
  return ok;
}
