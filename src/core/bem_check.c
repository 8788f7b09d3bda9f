/* smelt_bem_validate and smelt_bem_benchmark: the two calls the seed's
 * users had beside the kernel. Validation runs the op where the context
 * runs it and the CPU reference on host copies of the same bytes, so it
 * checks the caller's own layouts. The benchmark's unfused execution is
 * built from smelt's own pieces the way torch eager runs the update: a
 * GEMM to A, the Hadamard product to H (a BEM call with identity V and U:
 * an elementwise pass over A and codes), a GEMM to y. The frozen base
 * layer it is quoted against is a GEMM y = x·Wᵀ with a W of its own. */
#include "bem_internal.h"
#include "checked.h"
#include "error_bound.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_bem_validate"
#define BOP "smelt_bem_benchmark"

/* ---------------------------------------------------------------- host copies */

/* A host copy of t's bytes (numel 0: nothing) as a CPU view of the same
 * shape and strides. */
static smelt_status to_host(smelt_ctx *ctx, const smelt_tensor *t, smelt_tensor *h, void **buf) {
  *buf = NULL;
  *h = *t;
  h->device = SMELT_DEVICE_CPU;
  h->device_index = 0;
  int64_t lo, hi;
  smelt__tensor_span(t, &lo, &hi);
  smelt_status s = smelt__host_fits((size_t)(hi - lo), OP, "a host copy of a tensor");
  if (s) return s;
  *buf = malloc((size_t)(hi - lo) + 1);
  if (!*buf) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  h->data = (char *)*buf - lo;
  return hi > lo ? smelt_memcpy_d2h(ctx, *buf, (const char *)t->data + lo, (size_t)(hi - lo)) : SMELT_OK;
}

enum { H_X, H_V, H_CODES, H_U, H_OFFS, H_SCALES, H_Y, H_GOT, H_COUNT };

typedef struct host_set {
  smelt_tensor t[H_COUNT];
  void *buf[H_COUNT];
} host_set;

static void host_free(host_set *h) {
  for (int i = 0; i < H_COUNT; i++) free(h->buf[i]);
}

/* The inputs and y as they are before the run. */
static smelt_status inputs_to_host(smelt_ctx *ctx, const smelt_bem_inputs *in, const smelt_tensor *y, host_set *h) {
  const smelt_tensor *src[H_GOT] = {in->x, in->v, in->codes, in->u, in->offsets, in->scales, y};
  smelt_status s = SMELT_OK;
  for (int i = 0; i < H_GOT && !s; i++)
    if (src[i]) s = to_host(ctx, src[i], &h->t[i], &h->buf[i]);
  return s;
}

/* ---------------------------------------------------------------- comparison */

static void compare(const smelt_tensor *got, const smelt_tensor *ref, double tol, smelt_bem_check *out) {
  const int64_t M = ref->shape[0], N = ref->shape[1];
  double max_abs = 0, max_ref = 0, num = 0, den = 0;
  int parity = 1;
  out->worst = 0;
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      const double g = smelt__load_f64(got->data, got->dtype, m * got->strides[0] + n * got->strides[1]);
      const double r = smelt__load_f64(ref->data, ref->dtype, m * ref->strides[0] + n * ref->strides[1]);
      if (!isfinite(g) || !isfinite(r)) {
        parity &= (isnan(g) && isnan(r)) || g == r;
        continue;
      }
      const double d = fabs(g - r);
      if (d > max_abs) {
        max_abs = d;
        out->worst = m * N + n;
      }
      if (fabs(r) > max_ref) max_ref = fabs(r);
      num += d * d;
      den += r * r;
    }
  out->max_abs = max_abs;
  out->max_rel = max_ref > 0 ? max_abs / max_ref : max_abs;
  out->rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
  out->tolerance = tol;
  out->passed = parity && out->max_rel <= tol;
}

smelt_status smelt_bem_validate(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                const smelt_tensor *y, double tolerance, smelt_bem_check *out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": out is NULL");
  memset(out, 0, sizeof *out);
  smelt_plan *plan = NULL;
  smelt_status s = smelt_bem_plan(ctx, desc, in, y, &plan);
  if (s) return s;
  host_set h;
  memset(&h, 0, sizeof h);
  smelt_ctx *cpu = NULL;
  smelt_ctx_options o = smelt_ctx_options_default();
  o.device = SMELT_DEVICE_CPU;
  o.use_env = 0;
  if (!(s = inputs_to_host(ctx, in, y, &h)) && !(s = smelt_bem_run(plan, in, y)) &&
      !(s = smelt_ctx_synchronize(ctx)) && !(s = to_host(ctx, y, &h.t[H_GOT], &h.buf[H_GOT])) &&
      !(s = smelt_ctx_create(&cpu, &o))) {
    const smelt_bem_inputs hin = {&h.t[H_X], &h.t[H_V], &h.t[H_CODES], &h.t[H_U],
                                  in->offsets ? &h.t[H_OFFS] : NULL, in->scales ? &h.t[H_SCALES] : NULL};
    s = smelt_bem(cpu, desc, &hin, &h.t[H_Y]);
  }
  if (!s) {
    if (tolerance <= 0) {
      const smelt__bound_query q = {.family = "bem", .metric = SMELT__METRIC_MAX_REL, .device = ctx->device,
                                    .dtype = y->dtype};
      tolerance = smelt__error_bound(&q);
    }
    compare(&h.t[H_GOT], &h.t[H_Y], tolerance, out);
  }
  smelt_ctx_destroy(cpu);
  host_free(&h);
  smelt_plan_destroy(plan);
  return s;
}

/* ---------------------------------------------------------------- benchmark */

/* The unfused execution's plans and scratch, and the frozen base layer's. */
typedef struct unfused {
  smelt_plan *gemm1, *hadamard, *gemm2, *base;
  void *mem;  /* A [M, r], H [M, r], the identity [r, r] */
  void *wmem; /* the base's W [d_out, d_in] */
  smelt_tensor a, h, eye, ut, wt;
  smelt_bem_inputs hin;
} unfused;

/* The base layer y = x·Wᵀ with a W [d_out, d_in] of small seeded values. */
static smelt_status base_plan(smelt_ctx *ctx, const smelt_bem_inputs *in, const smelt_tensor *y, unfused *u) {
  const int64_t din = in->x->shape[1], dout = y->shape[1], n = din * dout;
  const smelt_dtype dt = in->x->dtype;
  size_t bytes = 0;
  smelt_status s = smelt__bytes(n, smelt_dtype_size(dt), &bytes, BOP, "the base layer's W");
  if (s || (s = smelt_alloc(ctx, bytes + 16, &u->wmem))) return s;
  unsigned char *w = (unsigned char *)malloc(bytes + 16);
  if (!w) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, BOP ": out of host memory");
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int64_t i = 0; i < n; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    smelt__store_f64(w, dt, i, ((double)(x >> 11) * 0x1.0p-53 - 0.5) * 0.1);
  }
  s = smelt_memcpy_h2d(ctx, u->wmem, w, bytes);
  free(w);
  const int64_t wshape[2] = {din, dout};
  u->wt = smelt_tensor_make(u->wmem, dt, ctx->device, ctx->device_index, 2, wshape);
  u->wt.strides[0] = 1; /* Wᵀ: W [d_out, d_in] read by columns */
  u->wt.strides[1] = din;
  smelt_gemm_desc g = smelt_gemm_desc_default();
  return s ? s : smelt_gemm_plan(ctx, &g, in->x, &u->wt, NULL, y, NULL, &u->base);
}

static smelt_status unfused_plan(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                 const smelt_tensor *y, unfused *u) {
  const int64_t M = in->x->shape[0], r = in->codes->shape[1];
  const smelt_dtype dt = in->x->dtype;
  const size_t es = smelt_dtype_size(dt), mr = (size_t)(M * r) * es, rr = (size_t)(r * r) * es;
  smelt_status s = smelt_alloc(ctx, 2 * mr + rr, &u->mem);
  if (s) return s;
  const int64_t ashape[2] = {M, r}, eshape[2] = {r, r};
  u->a = smelt_tensor_make(u->mem, dt, ctx->device, ctx->device_index, 2, ashape);
  u->h = smelt_tensor_make((char *)u->mem + mr, dt, ctx->device, ctx->device_index, 2, ashape);
  u->eye = smelt_tensor_make((char *)u->mem + 2 * mr, dt, ctx->device, ctx->device_index, 2, eshape);
  unsigned char *eye = (unsigned char *)calloc(1, rr);
  if (!eye) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, BOP ": out of host memory");
  for (int64_t i = 0; i < r; i++) smelt__store_f64(eye, dt, i * r + i, 1.0);
  s = smelt_memcpy_h2d(ctx, u->eye.data, eye, rr);
  free(eye);
  /* Uᵀ [r, d_out] is u's view with its dims swapped. */
  u->ut = *in->u;
  u->ut.shape[0] = in->u->shape[1];
  u->ut.shape[1] = in->u->shape[0];
  u->ut.strides[0] = in->u->strides[1];
  u->ut.strides[1] = in->u->strides[0];
  u->hin = (smelt_bem_inputs){&u->a, &u->eye, in->codes, &u->eye, NULL, in->scales};
  smelt_gemm_desc g1 = smelt_gemm_desc_default(), g2 = smelt_gemm_desc_default();
  smelt_bem_desc hd = *desc;
  hd.accumulate = 0;
  g2.epilogue.beta = desc->accumulate ? 1.0 : 0.0;
  if (!s) s = smelt_gemm_plan(ctx, &g1, in->x, in->v, NULL, &u->a, NULL, &u->gemm1);
  if (!s) s = smelt_bem_plan(ctx, &hd, &u->hin, &u->h, &u->hadamard);
  if (!s) s = smelt_gemm_plan(ctx, &g2, &u->h, &u->ut, desc->accumulate ? y : NULL, y, NULL, &u->gemm2);
  return s;
}

/* What is timed: the fused op, the unfused execution, the base layer. */
enum { FORM_FUSED, FORM_UNFUSED, FORM_BASE };

static smelt_status unfused_run(unfused *u, const smelt_bem_inputs *in, const smelt_tensor *y, int accumulate) {
  smelt_status s = smelt_gemm_run(u->gemm1, in->x, in->v, NULL, &u->a, NULL);
  if (!s) s = smelt_bem_run(u->hadamard, &u->hin, &u->h);
  if (!s) s = smelt_gemm_run(u->gemm2, &u->h, &u->ut, accumulate ? y : NULL, y, NULL);
  return s;
}

static void unfused_free(smelt_ctx *ctx, unfused *u) {
  smelt_plan_destroy(u->gemm1);
  smelt_plan_destroy(u->hadamard);
  smelt_plan_destroy(u->gemm2);
  smelt_plan_destroy(u->base);
  if (u->mem) smelt_free(ctx, u->mem);
  if (u->wmem) smelt_free(ctx, u->wmem);
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median time of iters runs of one form (FORM_*) after warmup untimed
 * ones; times holds iters doubles. */
static smelt_status time_runs(smelt_ctx *ctx, smelt_plan *fused, unfused *u, int form, const smelt_bem_inputs *in,
                              const smelt_tensor *y, int accumulate, int warmup, int iters, double *times,
                              double *median) {
  smelt_event *e0 = NULL, *e1 = NULL;
  smelt_status s = smelt_event_create(ctx, &e0);
  if (!s) s = smelt_event_create(ctx, &e1);
  for (int i = 0; i < warmup + iters && !s; i++) {
    if ((s = smelt_event_record(e0))) break;
    s = form == FORM_FUSED     ? smelt_bem_run(fused, in, y)
        : form == FORM_UNFUSED ? unfused_run(u, in, y, accumulate)
                               : smelt_gemm_run(u->base, in->x, &u->wt, NULL, y, NULL);
    float ms = 0;
    if (!s && !(s = smelt_event_record(e1)) && !(s = smelt_event_elapsed_ms(e0, e1, &ms)) && i >= warmup)
      times[i - warmup] = ms;
  }
  smelt_event_destroy(e0);
  smelt_event_destroy(e1);
  if (s) return s;
  qsort(times, (size_t)iters, sizeof *times, cmp_double);
  *median = times[iters / 2];
  return SMELT_OK;
}

static double fused_bytes(const smelt_bem_inputs *in, const smelt_tensor *y, int accumulate) {
  const smelt_tensor *t[] = {in->x, in->v, in->codes, in->u, y};
  double b = 0;
  for (size_t i = 0; i < sizeof t / sizeof *t; i++)
    b += (double)smelt_tensor_numel(t[i]) * (double)smelt_dtype_size(t[i]->dtype);
  return accumulate ? b + (double)smelt_tensor_numel(y) * (double)smelt_dtype_size(y->dtype) : b;
}

smelt_status smelt_bem_benchmark(smelt_ctx *ctx, const smelt_bem_desc *desc, const smelt_bem_inputs *in,
                                 const smelt_tensor *y, int warmup, int iters, smelt_bem_timing *out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, BOP ": out is NULL");
  memset(out, 0, sizeof *out);
  if (warmup < 0 || iters < 1)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, BOP ": warmup=%d must be >= 0 and iters=%d >= 1", warmup,
                        iters);
  smelt_plan *fused = NULL;
  smelt_status s = smelt_bem_plan(ctx, desc, in, y, &fused);
  if (s) return s;
  if (in->offsets) {
    smelt_plan_destroy(fused);
    return smelt__error(SMELT_STATUS_UNSUPPORTED, BOP ": offsets must be NULL (the unfused form has one adapter)");
  }
  unfused u;
  memset(&u, 0, sizeof u);
  double *times = (double *)malloc((size_t)iters * sizeof *times);
  if (!times) s = smelt__error(SMELT_STATUS_OUT_OF_MEMORY, BOP ": out of host memory");
  if (!s) s = unfused_plan(ctx, desc, in, y, &u);
  if (!s) s = base_plan(ctx, in, y, &u);
  if (!s) s = time_runs(ctx, fused, &u, FORM_FUSED, in, y, desc->accumulate, warmup, iters, times, &out->fused_ms);
  if (!s)
    s = time_runs(ctx, fused, &u, FORM_UNFUSED, in, y, desc->accumulate, warmup, iters, times, &out->unfused_ms);
  if (!s) s = time_runs(ctx, fused, &u, FORM_BASE, in, y, desc->accumulate, warmup, iters, times, &out->base_ms);
  if (!s) {
    out->speedup = out->fused_ms > 0 ? out->unfused_ms / out->fused_ms : 0;
    out->fused_gbps = out->fused_ms > 0 ? fused_bytes(in, y, desc->accumulate) / (out->fused_ms * 1e6) : 0;
    out->overhead_pct = out->base_ms > 0 ? 100.0 * out->fused_ms / out->base_ms : 0;
  }
  free(times);
  unfused_free(ctx, &u);
  smelt_plan_destroy(fused);
  return s;
}
