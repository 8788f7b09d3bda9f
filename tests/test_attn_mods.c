/* Attention's score modifiers (softcap, ALiBi, sinks) and causal ∩ window,
 * apart from tests/test_attention.c, whose cases know none of them.
 *
 * The CPU reference (f64) is checked against a naive reference written
 * here, forward, and its gradients against central finite differences of
 * the loss Σ O ∘ G (q, k, v and the sinks: no derivation is trusted). The
 * CUDA kernels are checked against the CPU reference on the same rounded
 * inputs, for every modifier set, forward and backward, on each kernel the
 * machine has (the Hopper ones on sm_90 where the head dim has one, the
 * mma.sync ones for the other head dims and for the deterministic
 * backward), with poisoned outputs and guard regions. Bad modifier
 * arguments are rejected with the tensor and the constraint named. */
#include "core/error_bound.h"
#include "harness.h"

#include <math.h>

/* ---------------------------------------------------------------- a case */

enum { M_CAP = 1, M_ALIBI = 2, M_SINKS = 4 };

typedef struct mcase {
  int64_t B, Sq, Sk, H, Hk, D;
  int causal;
  int64_t wl, wr;
  float scale; /* 0 = 1/sqrt(D) */
  int mods;    /* M_* */
  float softcap;
} mcase;

/* Host data of a case, dense and row-major: q, o [B, Sq, H, D]; k, v
 * [B, Sk, Hk, D]; lse [B, H, Sq]; slopes, sinks [H]. */
typedef struct mdata {
  int64_t nq, nk, nl;
  double *q, *k, *v, *slopes, *sinks;
} mdata;

static double scale_of(const mcase *c) { return c->scale != 0 ? (double)c->scale : 1.0 / sqrt((double)c->D); }

static double *dalloc(int64_t n) { return (double *)calloc((size_t)(n > 0 ? n : 1), sizeof(double)); }

/* Random inputs; the modifiers' values on the scale of the scores. */
static mdata mdata_new(const mcase *c) {
  mdata d;
  d.nq = c->B * c->Sq * c->H * c->D;
  d.nk = c->B * c->Sk * c->Hk * c->D;
  d.nl = c->B * c->H * c->Sq;
  d.q = dalloc(d.nq);
  d.k = dalloc(d.nk);
  d.v = dalloc(d.nk);
  d.slopes = dalloc(c->H);
  d.sinks = dalloc(c->H);
  for (int64_t i = 0; i < d.nq; i++) d.q[i] = th_rand_uniform(-2, 2);
  for (int64_t i = 0; i < d.nk; i++) d.k[i] = th_rand_uniform(-2, 2);
  for (int64_t i = 0; i < d.nk; i++) d.v[i] = th_rand_uniform(-1, 1);
  for (int64_t h = 0; h < c->H; h++) {
    d.slopes[h] = (c->mods & M_ALIBI) ? ldexp(1.0, -(int)(h % 8) - 1) : 0;
    d.sinks[h] = (c->mods & M_SINKS) ? (double)(float)th_rand_uniform(-1, 3) : -INFINITY; /* f32 in the API */
  }
  return d;
}

static void mdata_free(mdata *d) {
  free(d->q);
  free(d->k);
  free(d->v);
  free(d->slopes);
  free(d->sinks);
}

/* Rounds the inputs to dt, as the device will see them. */
static void mdata_round(mdata *d, smelt_dtype dt) {
  double *all[3] = {d->q, d->k, d->v};
  const int64_t n[3] = {d->nq, d->nk, d->nk};
  uint16_t tmp;
  for (int a = 0; a < 3; a++)
    for (int64_t i = 0; i < n[a]; i++) {
      th_set(&tmp, dt, 0, all[a][i]);
      all[a][i] = th_get(&tmp, dt, 0);
    }
}

/* ---------------------------------------------------------------- the naive reference */

/* Written apart from the library: the mask as FlashAttention states it. */
static int visible(const mcase *c, int64_t i, int64_t j) {
  const int64_t diag = i + c->Sk - c->Sq;
  if (c->causal && j > diag) return 0;
  if (c->wl >= 0 && j < diag - c->wl) return 0;
  if (c->wr >= 0 && j > diag + c->wr) return 0;
  return 1;
}

static double score(const mcase *c, const mdata *d, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t hk = h / (c->H / c->Hk);
  const double *q = d->q + ((b * c->Sq + i) * c->H + h) * c->D, *k = d->k + ((b * c->Sk + j) * c->Hk + hk) * c->D;
  double s = 0;
  for (int64_t x = 0; x < c->D; x++) s += q[x] * k[x];
  s *= scale_of(c);
  if (c->mods & M_CAP) s = c->softcap * tanh(s / c->softcap);
  if (c->mods & M_ALIBI) s -= d->slopes[h] * fabs((double)(i + c->Sk - c->Sq - j));
  return s;
}

/* o [B, Sq, H, D], lse [B, H, Sq]. */
static void naive_forward(const mcase *c, const mdata *d, double *o, double *lse) {
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t h = 0; h < c->H; h++)
      for (int64_t i = 0; i < c->Sq; i++) {
        double *orow = o + ((b * c->Sq + i) * c->H + h) * c->D, l = 0, m = -INFINITY;
        for (int64_t x = 0; x < c->D; x++) orow[x] = 0;
        int any = 0;
        for (int64_t j = 0; j < c->Sk; j++)
          if (visible(c, i, j)) {
            any = 1;
            m = fmax(m, score(c, d, b, h, i, j));
          }
        double *lr = lse + (b * c->H + h) * c->Sq + i;
        if (!any) {
          *lr = INFINITY;
          continue;
        }
        m = fmax(m, d->sinks[h]);
        l = exp(d->sinks[h] - m);
        for (int64_t j = 0; j < c->Sk; j++)
          if (visible(c, i, j)) l += exp(score(c, d, b, h, i, j) - m);
        for (int64_t j = 0; j < c->Sk; j++) {
          if (!visible(c, i, j)) continue;
          const double p = exp(score(c, d, b, h, i, j) - m) / l;
          const double *v = d->v + ((b * c->Sk + j) * c->Hk + h / (c->H / c->Hk)) * c->D;
          for (int64_t x = 0; x < c->D; x++) orow[x] += p * v[x];
        }
        *lr = m + log(l);
      }
}

/* ---------------------------------------------------------------- calls */

static smelt_attention_desc desc_of(const mcase *c) {
  smelt_attention_desc d = smelt_attention_desc_default();
  d.scale = c->scale;
  d.causal = c->causal;
  d.window_left = c->wl;
  d.window_right = c->wr;
  d.softcap = (c->mods & M_CAP) ? c->softcap : 0;
  return d;
}

static smelt_tensor host_t(double *p, int ndim, const int64_t *shape) {
  return smelt_tensor_make(p, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, ndim, shape);
}

/* The modifier tensors' views (f32 [H]) of a call, over the given buffers. */
typedef struct mods_t {
  smelt_tensor slopes, sinks, dsinks;
} mods_t;

static void desc_mods(const mcase *c, mods_t *m, smelt_attention_desc *d, int want_dsinks) {
  if (c->mods & M_ALIBI) d->alibi_slopes = &m->slopes;
  if (c->mods & M_SINKS) d->sinks = &m->sinks;
  if ((c->mods & M_SINKS) && want_dsinks) d->dsinks = &m->dsinks;
}

/* The CPU reference in f64: o, lse (dense) and, when d_o is given, the
 * gradients (dq like q, dk and dv like k, dsinks [H]) from o and lse. */
static void cpu_run(const mcase *c, const mdata *d, double *o, double *lse, const double *d_o, double *dq, double *dk,
                    double *dv, double *dsinks) {
  smelt_ctx *ctx = th_cpu();
  const int64_t sq[4] = {c->B, c->Sq, c->H, c->D}, sk[4] = {c->B, c->Sk, c->Hk, c->D}, sl[3] = {c->B, c->H, c->Sq};
  const int64_t sh[1] = {c->H};
  float slopes[64], sinks[64], ds[64];
  for (int64_t h = 0; h < c->H; h++) {
    slopes[h] = (float)d->slopes[h];
    sinks[h] = (float)d->sinks[h];
  }
  mods_t m = {smelt_tensor_make(slopes, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sh),
              smelt_tensor_make(sinks, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sh),
              smelt_tensor_make(ds, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sh)};
  smelt_attention_desc desc = desc_of(c);
  desc_mods(c, &m, &desc, 1);
  smelt_tensor q = host_t(d->q, 4, sq), k = host_t(d->k, 4, sk), v = host_t(d->v, 4, sk), ot = host_t(o, 4, sq);
  float *lf = (float *)malloc((size_t)(d->nl + 1) * 4);
  smelt_tensor lt = smelt_tensor_make(lf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, sl);
  if (!d_o) {
    CHECK_OK(smelt_attention_fwd(ctx, &desc, &q, &k, &v, &ot, &lt));
    for (int64_t i = 0; i < d->nl; i++) lse[i] = lf[i];
  } else {
    for (int64_t i = 0; i < d->nl; i++) lf[i] = (float)lse[i];
    smelt_tensor dot = host_t((double *)d_o, 4, sq), dqt = host_t(dq, 4, sq), dkt = host_t(dk, 4, sk),
                 dvt = host_t(dv, 4, sk);
    CHECK_OK(smelt_attention_bwd(ctx, &desc, &q, &k, &v, &ot, &dot, &lt, &dqt, &dkt, &dvt));
    for (int64_t h = 0; dsinks && h < c->H; h++) dsinks[h] = (c->mods & M_SINKS) ? ds[h] : 0;
  }
  free(lf);
}

static const char *case_text(const mcase *c, const char *where, char *buf, size_t n) {
  snprintf(buf, n, "%s B=%lld Sq=%lld Sk=%lld H=%lld Hk=%lld D=%lld%s window=(%lld,%lld) scale=%g%s%s%s", where,
           (long long)c->B, (long long)c->Sq, (long long)c->Sk, (long long)c->H, (long long)c->Hk, (long long)c->D,
           c->causal ? " causal" : "", (long long)c->wl, (long long)c->wr, (double)c->scale,
           (c->mods & M_CAP) ? " softcap" : "", (c->mods & M_ALIBI) ? " alibi" : "", (c->mods & M_SINKS) ? " sinks" : "");
  return buf;
}

/* ---------------------------------------------------------------- CPU */

/* Small cases for the CPU checks: every modifier alone and together, with
 * causal ∩ window (right window > 0), fully masked rows (Sq > Sk, causal),
 * Sq < Sk, GQA and a negative scale. */
static const mcase cpu_cases[] = {
    {2, 5, 7, 2, 1, 4, 0, -1, -1, 0, M_CAP, 1.5f},
    {1, 6, 9, 4, 2, 4, 1, 2, 3, 0, M_ALIBI, 0},
    {2, 7, 5, 2, 2, 4, 1, -1, -1, 0, M_SINKS, 0},
    {1, 9, 6, 4, 1, 4, 1, 3, 5, -0.4f, M_CAP | M_ALIBI | M_SINKS, 2.0f},
    {1, 8, 8, 2, 1, 4, 0, 2, 1, 0.7f, M_CAP | M_SINKS, 0.8f},
    {1, 4, 11, 2, 2, 4, 1, 4, 2, 0, 0, 0},
};

static void test_cpu_forward_vs_naive(void) {
  for (size_t ci = 0; ci < sizeof cpu_cases / sizeof *cpu_cases; ci++) {
    const mcase *c = &cpu_cases[ci];
    mdata d = mdata_new(c);
    double *o = dalloc(d.nq), *lse = dalloc(d.nl), *on = dalloc(d.nq), *ln = dalloc(d.nl);
    cpu_run(c, &d, o, lse, NULL, NULL, NULL, NULL, NULL);
    naive_forward(c, &d, on, ln);
    char what[256];
    case_text(c, "cpu vs naive", what, sizeof what);
    if (!th_compare(what, o, on, d.nq, 1e-12, 0)) th_fail(__FILE__, __LINE__, "%s: o differs", what);
    /* lse is stored as f32 */
    if (!th_compare(what, lse, ln, d.nl, 1e-6, 0)) th_fail(__FILE__, __LINE__, "%s: lse differs", what);
    free(o);
    free(lse);
    free(on);
    free(ln);
    mdata_free(&d);
  }
}

/* Σ O ∘ G of the naive forward. */
static double loss(const mcase *c, const mdata *d, const double *g) {
  double *o = dalloc(d->nq), *lse = dalloc(d->nl), l = 0;
  naive_forward(c, d, o, lse);
  for (int64_t i = 0; i < d->nq; i++) l += o[i] * g[i];
  free(o);
  free(lse);
  return l;
}

/* d loss / d x[i] by central differences. */
static double fd(const mcase *c, mdata *d, const double *g, double *x, int64_t i) {
  const double h = 1e-6, x0 = x[i];
  x[i] = x0 + h;
  const double a = loss(c, d, g);
  x[i] = x0 - h;
  const double b = loss(c, d, g);
  x[i] = x0;
  return (a - b) / (2 * h);
}

static void test_cpu_gradients_fd(void) {
  for (size_t ci = 0; ci < sizeof cpu_cases / sizeof *cpu_cases; ci++) {
    const mcase *c = &cpu_cases[ci];
    mdata d = mdata_new(c);
    double *o = dalloc(d.nq), *lse = dalloc(d.nl), *g = dalloc(d.nq);
    for (int64_t i = 0; i < d.nq; i++) g[i] = th_rand_uniform(-1, 1);
    naive_forward(c, &d, o, lse);
    /* The backward takes LSE as the forward stores it (f32). */
    for (int64_t i = 0; i < d.nl; i++) lse[i] = (double)(float)lse[i];
    double *dq = dalloc(d.nq), *dk = dalloc(d.nk), *dv = dalloc(d.nk), ds[64];
    cpu_run(c, &d, o, lse, g, dq, dk, dv, ds);
    double *fq = dalloc(d.nq), *fk = dalloc(d.nk), *fv = dalloc(d.nk), fs[64];
    for (int64_t i = 0; i < d.nq; i++) fq[i] = fd(c, &d, g, d.q, i);
    for (int64_t i = 0; i < d.nk; i++) fk[i] = fd(c, &d, g, d.k, i);
    for (int64_t i = 0; i < d.nk; i++) fv[i] = fd(c, &d, g, d.v, i);
    for (int64_t h = 0; h < c->H; h++) fs[h] = (c->mods & M_SINKS) ? fd(c, &d, g, d.sinks, h) : 0;
    char what[256];
    case_text(c, "cpu gradients vs finite differences", what, sizeof what);
    /* LSE's f32 rounding (2^-24 relative) bounds the agreement. */
    if (!th_compare(what, dq, fq, d.nq, 1e-5, 1e-7)) th_fail(__FILE__, __LINE__, "%s: dq differs", what);
    if (!th_compare(what, dk, fk, d.nk, 1e-5, 1e-7)) th_fail(__FILE__, __LINE__, "%s: dk differs", what);
    if (!th_compare(what, dv, fv, d.nk, 1e-5, 1e-7)) th_fail(__FILE__, __LINE__, "%s: dv differs", what);
    if ((c->mods & M_SINKS) && !th_compare(what, ds, fs, c->H, 1e-5, 1e-7))
      th_fail(__FILE__, __LINE__, "%s: dsinks differs", what);
    free(o);
    free(lse);
    free(g);
    free(dq);
    free(dk);
    free(dv);
    free(fq);
    free(fk);
    free(fv);
    mdata_free(&d);
  }
}

/* Causal with a right window > 0 is the causal mask (∩), with a left
 * window the band below the diagonal: equal to the explicit windows. */
static void test_causal_window_intersection(void) {
  const mcase a = {2, 13, 21, 2, 1, 8, 1, 4, 6, 0, 0, 0}, b = {2, 13, 21, 2, 1, 8, 0, 4, 0, 0, 0, 0};
  mdata d = mdata_new(&a);
  double *o1 = dalloc(d.nq), *l1 = dalloc(d.nl), *o2 = dalloc(d.nq), *l2 = dalloc(d.nl);
  cpu_run(&a, &d, o1, l1, NULL, NULL, NULL, NULL, NULL);
  cpu_run(&b, &d, o2, l2, NULL, NULL, NULL, NULL, NULL);
  CHECK(!memcmp(o1, o2, (size_t)d.nq * 8));
  CHECK(!memcmp(l1, l2, (size_t)d.nl * 8));
  free(o1);
  free(l1);
  free(o2);
  free(l2);
  mdata_free(&d);
}

/* ---------------------------------------------------------------- bad arguments */

#define CHECK_REJECT(call, want, sub1, sub2) \
  do {                                       \
    CHECK_STATUS(call, want);                \
    CHECK_MSG(sub1);                         \
    CHECK_MSG(sub2);                         \
  } while (0)

static void test_bad_modifiers(void) {
  smelt_ctx *ctx = th_cpu();
  const int64_t sq[4] = {1, 3, 2, 4}, sl[3] = {1, 2, 3}, s2[1] = {2}, s3[1] = {3}, s22[2] = {2, 1};
  double q[24] = {0}, o[24], dq[24], dk[24], dv[24];
  float lse[6] = {0}, f2[4] = {0}, f3[3] = {0}, g2[2];
  double d2[2];
  smelt_tensor qt = host_t(q, 4, sq), ot = host_t(o, 4, sq), dqt = host_t(dq, 4, sq), dkt = host_t(dk, 4, sq),
               dvt = host_t(dv, 4, sq);
  smelt_tensor lt = smelt_tensor_make(lse, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, sl);
  smelt_tensor ok = smelt_tensor_make(f2, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, s2);
  smelt_tensor dsk = smelt_tensor_make(g2, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, s2);
  smelt_tensor wrong_n = smelt_tensor_make(f3, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, s3);
  smelt_tensor wrong_dt = smelt_tensor_make(d2, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, 1, s2);
  smelt_tensor wrong_nd = smelt_tensor_make(f2, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, s22);
  smelt_tensor strided = ok;
  strided.strides[0] = 2;
  smelt_attention_desc d = smelt_attention_desc_default();
  d.softcap = -1;
  CHECK_REJECT(smelt_attention_fwd(ctx, &d, &qt, &qt, &qt, &ot, &lt), SMELT_STATUS_INVALID_ARGUMENT,
               "desc->softcap=-1", ">= 0");
  d.softcap = INFINITY;
  CHECK_REJECT(smelt_attention_fwd(ctx, &d, &qt, &qt, &qt, &ot, &lt), SMELT_STATUS_INVALID_ARGUMENT,
               "desc->softcap=inf", "finite");
  d = smelt_attention_desc_default();
  d.alibi_slopes = &wrong_n;
  CHECK_REJECT(smelt_attention_fwd(ctx, &d, &qt, &qt, &qt, &ot, &lt), SMELT_STATUS_SHAPE_MISMATCH,
               "desc->alibi_slopes.shape[0]=3", "H=2");
  d.alibi_slopes = &wrong_dt;
  CHECK_REJECT(smelt_attention_fwd(ctx, &d, &qt, &qt, &qt, &ot, &lt), SMELT_STATUS_DTYPE_MISMATCH,
               "desc->alibi_slopes.dtype=f64", "f32");
  d.alibi_slopes = NULL;
  d.sinks = &wrong_nd;
  CHECK_REJECT(smelt_attention_fwd(ctx, &d, &qt, &qt, &qt, &ot, &lt), SMELT_STATUS_SHAPE_MISMATCH,
               "desc->sinks.ndim=2", "[H]");
  d.sinks = &strided;
  CHECK_REJECT(smelt_attention_fwd(ctx, &d, &qt, &qt, &qt, &ot, &lt), SMELT_STATUS_BAD_LAYOUT,
               "desc->sinks.strides[0]=2", "contiguous");
  d.sinks = NULL;
  d.dsinks = &dsk;
  CHECK_REJECT(smelt_attention_bwd(ctx, &d, &qt, &qt, &qt, &qt, &qt, &lt, &dqt, &dkt, &dvt),
               SMELT_STATUS_INVALID_ARGUMENT, "desc->dsinks", "without desc->sinks");
  d.sinks = &ok;
  d.dsinks = &ok;
  CHECK_REJECT(smelt_attention_bwd(ctx, &d, &qt, &qt, &qt, &qt, &qt, &lt, &dqt, &dkt, &dvt),
               SMELT_STATUS_INVALID_ARGUMENT, "desc->dsinks overlaps desc->sinks", "must not share");
  /* The forward ignores dsinks (one desc serves both directions). */
  CHECK_OK(smelt_attention_fwd(ctx, &d, &qt, &qt, &qt, &ot, &lt));
  (void)dkt;
}

/* ---------------------------------------------------------------- CUDA */

/* A device call's buffers: inputs and outputs with guards and poison. */
typedef struct gpu_env {
  smelt_ctx *ctx;
  smelt_dtype dt;
  th_buf b[12]; /* q k v o lse d_o dq dk dv slopes sinks dsinks */
  smelt_tensor q, k, v, o, lse, d_o, dq, dk, dv;
  mods_t m;
  th_view vq, vk, vl, vh;
} gpu_env;

static th_buf up(smelt_ctx *ctx, smelt_dtype dt, const double *x, int64_t n) {
  const size_t es = smelt_dtype_size(dt);
  uint8_t *h = (uint8_t *)malloc((size_t)n * es + 1);
  for (int64_t i = 0; i < n; i++) th_set(h, dt, i, x[i]);
  th_buf b = th_buf_new(ctx, (size_t)n * es);
  th_buf_upload(&b, h, (size_t)n * es);
  free(h);
  return b;
}

static th_view dense_view(int ndim, const int64_t *shape) {
  int64_t st[SMELT_MAX_DIMS], s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    st[i] = s;
    s *= shape[i];
  }
  return th_view_make(ndim, shape, st, 0);
}

static void gpu_env_new(gpu_env *e, smelt_ctx *ctx, smelt_dtype dt, const mcase *c, const mdata *d) {
  memset(e, 0, sizeof *e);
  e->ctx = ctx;
  e->dt = dt;
  const int64_t sq[4] = {c->B, c->Sq, c->H, c->D}, sk[4] = {c->B, c->Sk, c->Hk, c->D}, sl[3] = {c->B, c->H, c->Sq};
  const int64_t sh[1] = {c->H};
  e->vq = dense_view(4, sq);
  e->vk = dense_view(4, sk);
  e->vl = dense_view(3, sl);
  e->vh = dense_view(1, sh);
  const size_t es = smelt_dtype_size(dt);
  e->b[0] = up(ctx, dt, d->q, d->nq);
  e->b[1] = up(ctx, dt, d->k, d->nk);
  e->b[2] = up(ctx, dt, d->v, d->nk);
  e->b[3] = th_buf_new(ctx, (size_t)d->nq * es);
  e->b[4] = th_buf_new(ctx, (size_t)d->nl * 4);
  e->b[9] = up(ctx, SMELT_DTYPE_F32, d->slopes, c->H);
  e->b[10] = up(ctx, SMELT_DTYPE_F32, d->sinks, c->H);
  e->b[11] = th_buf_new(ctx, (size_t)c->H * 4);
  e->q = th_view_tensor(&e->vq, &e->b[0], dt);
  e->k = th_view_tensor(&e->vk, &e->b[1], dt);
  e->v = th_view_tensor(&e->vk, &e->b[2], dt);
  e->o = th_view_tensor(&e->vq, &e->b[3], dt);
  e->lse = th_view_tensor(&e->vl, &e->b[4], SMELT_DTYPE_F32);
  e->m.slopes = th_view_tensor(&e->vh, &e->b[9], SMELT_DTYPE_F32);
  e->m.sinks = th_view_tensor(&e->vh, &e->b[10], SMELT_DTYPE_F32);
  e->m.dsinks = th_view_tensor(&e->vh, &e->b[11], SMELT_DTYPE_F32);
}

/* The backward's buffers: o and lse replaced by the given (reference) ones. */
static void gpu_env_bwd(gpu_env *e, const mcase *c, const mdata *d, const double *o, const double *lse,
                        const double *d_o) {
  const size_t es = smelt_dtype_size(e->dt);
  th_buf_free(&e->b[3]);
  th_buf_free(&e->b[4]);
  e->b[3] = up(e->ctx, e->dt, o, d->nq);
  e->b[4] = up(e->ctx, SMELT_DTYPE_F32, lse, d->nl);
  e->b[5] = up(e->ctx, e->dt, d_o, d->nq);
  e->b[6] = th_buf_new(e->ctx, (size_t)d->nq * es);
  e->b[7] = th_buf_new(e->ctx, (size_t)d->nk * es);
  e->b[8] = th_buf_new(e->ctx, (size_t)d->nk * es);
  e->o = th_view_tensor(&e->vq, &e->b[3], e->dt);
  e->lse = th_view_tensor(&e->vl, &e->b[4], SMELT_DTYPE_F32);
  e->d_o = th_view_tensor(&e->vq, &e->b[5], e->dt);
  e->dq = th_view_tensor(&e->vq, &e->b[6], e->dt);
  e->dk = th_view_tensor(&e->vk, &e->b[7], e->dt);
  e->dv = th_view_tensor(&e->vk, &e->b[8], e->dt);
  (void)c;
}

static void gpu_env_free(gpu_env *e) {
  for (int i = 0; i < 12; i++)
    if (e->b[i].base) th_buf_free(&e->b[i]);
}

static smelt_status gpu_bwd(gpu_env *e, const mcase *c, int det) {
  smelt_attention_desc desc = desc_of(c);
  desc.deterministic = det;
  desc_mods(c, &e->m, &desc, 1);
  return smelt_attention_bwd(e->ctx, &desc, &e->q, &e->k, &e->v, &e->o, &e->d_o, &e->lse, &e->dq, &e->dk, &e->dv);
}

static double bound_of(smelt_dtype dt, int output) {
  const smelt__bound_query q = {.family = "attention", .device = SMELT_DEVICE_CUDA, .dtype = dt, .output = output};
  return smelt__error_bound(&q);
}

/* One case on the device: forward against the CPU reference, then the
 * backward (atomic; with det also the deterministic mode, twice, bitwise)
 * from the reference's O and LSE. */
static void gpu_case(const mcase *c, smelt_dtype dt, smelt_attention_schedule sched, int bwd, int det) {
  smelt_ctx *ctx = th_cuda();
  mdata d = mdata_new(c);
  mdata_round(&d, dt);
  char what[300];
  case_text(c, smelt_dtype_name(dt), what, sizeof what);
  double *o = dalloc(d.nq), *lse = dalloc(d.nl), *got = dalloc(d.nq + d.nk), *lgot = dalloc(d.nl);
  cpu_run(c, &d, o, lse, NULL, NULL, NULL, NULL, NULL);
  gpu_env e;
  gpu_env_new(&e, ctx, dt, c, &d);
  smelt_attention_desc desc = desc_of(c);
  desc.fwd_schedule = sched;
  desc_mods(c, &e.m, &desc, 0);
  smelt_status s = smelt_attention_fwd(ctx, &desc, &e.q, &e.k, &e.v, &e.o, &e.lse);
  if (s) th_fail(__FILE__, __LINE__, "%s: fwd: %s (%s)", what, smelt_status_name(s), smelt_last_error());
  th_check_output(what, "o", &e.vq, &e.b[3], dt, got);
  if (!th_compare(what, got, o, d.nq, bound_of(dt, 0), 0)) th_fail(__FILE__, __LINE__, "%s: o differs", what);
  th_check_output(what, "lse", &e.vl, &e.b[4], SMELT_DTYPE_F32, lgot);
  /* softcap's tanh.approx (2^-11 relative) moves a capped score by up to
   * softcap · 2^-11, and the LSE with it. */
  const double lse_abs = (c->mods & M_CAP) ? c->softcap * 1e-3 : 0;
  if (!th_compare(what, lgot, lse, d.nl, bound_of(SMELT_DTYPE_F32, 1), lse_abs))
    th_fail(__FILE__, __LINE__, "%s: lse differs", what);
  if (bwd) {
    /* The reference's O and LSE, rounded as the device stores them. */
    double *d_o = dalloc(d.nq), *dq = dalloc(d.nq), *dk = dalloc(d.nk), *dv = dalloc(d.nk), ds[64];
    uint16_t tmp;
    for (int64_t i = 0; i < d.nq; i++) {
      th_set(&tmp, dt, 0, o[i]);
      o[i] = th_get(&tmp, dt, 0);
      th_set(&tmp, dt, 0, th_rand_uniform(-1, 1));
      d_o[i] = th_get(&tmp, dt, 0);
    }
    for (int64_t i = 0; i < d.nl; i++) lse[i] = (double)(float)lse[i];
    cpu_run(c, &d, o, lse, d_o, dq, dk, dv, ds);
    gpu_env_bwd(&e, c, &d, o, lse, d_o);
    for (int mode = 0; mode < (det ? 3 : 1); mode++) {
      s = gpu_bwd(&e, c, mode > 0);
      if (s) th_fail(__FILE__, __LINE__, "%s: bwd: %s (%s)", what, smelt_status_name(s), smelt_last_error());
      th_check_output(what, "dq", &e.vq, &e.b[6], dt, got);
      if (!th_compare(what, got, dq, d.nq, bound_of(dt, 0), 0)) th_fail(__FILE__, __LINE__, "%s: dq differs", what);
      th_check_output(what, "dk", &e.vk, &e.b[7], dt, got);
      if (!th_compare(what, got, dk, d.nk, bound_of(dt, 0), 0)) th_fail(__FILE__, __LINE__, "%s: dk differs", what);
      th_check_output(what, "dv", &e.vk, &e.b[8], dt, got);
      if (!th_compare(what, got, dv, d.nk, bound_of(dt, 0), 0)) th_fail(__FILE__, __LINE__, "%s: dv differs", what);
      if (c->mods & M_SINKS) {
        th_check_output(what, "dsinks", &e.vh, &e.b[11], SMELT_DTYPE_F32, got);
        if (!th_compare(what, got, ds, c->H, 1e-4, 1e-6)) th_fail(__FILE__, __LINE__, "%s: dsinks differs", what);
      } else if (!th_buf_untouched(&e.b[11])) {
        th_fail(__FILE__, __LINE__, "%s: dsinks written without sinks", what);
      }
      if (mode == 2) {
        /* The third run repeats the second (deterministic) one bit for bit. */
        const size_t es = smelt_dtype_size(dt);
        uint8_t *x = (uint8_t *)malloc((size_t)d.nq * es), *y = (uint8_t *)malloc((size_t)d.nq * es);
        th_buf_download(&e.b[6], x, (size_t)d.nq * es);
        CHECK_OK(gpu_bwd(&e, c, 1));
        th_buf_download(&e.b[6], y, (size_t)d.nq * es);
        if (memcmp(x, y, (size_t)d.nq * es)) th_fail(__FILE__, __LINE__, "%s: deterministic dq differs", what);
        free(x);
        free(y);
      }
    }
    free(d_o);
    free(dq);
    free(dk);
    free(dv);
  }
  gpu_env_free(&e);
  free(o);
  free(lse);
  free(got);
  free(lgot);
  mdata_free(&d);
}

static const int mod_sets[] = {M_CAP, M_ALIBI, M_SINKS, M_CAP | M_ALIBI | M_SINKS};

/* Every modifier set, forward and backward, at head dims 64 and 128 (on
 * sm_90 the Hopper forward; the Hopper backward at 128) and 96 (mma.sync
 * everywhere); ragged lengths, GQA, fully masked rows, causal ∩ window;
 * the deterministic backward (mma.sync) at 128. */
static void test_gpu_modifiers(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  static const mcase shapes[] = {
      {2, 200, 333, 4, 2, 64, 0, -1, -1, 0, 0, 3.0f},
      {1, 300, 150, 4, 1, 128, 1, 40, 7, 0, 0, 2.5f},
      {2, 129, 257, 2, 2, 96, 1, -1, 5, -0.1f, 0, 4.0f},
  };
  for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++)
    for (size_t mi = 0; mi < sizeof mod_sets / sizeof *mod_sets; mi++) {
      mcase c = shapes[si];
      c.mods = mod_sets[mi];
      gpu_case(&c, SMELT_DTYPE_BF16, SMELT_ATTENTION_SCHEDULE_AUTO, 1, c.D == 128);
    }
  const mcase f16 = {1, 77, 77, 2, 1, 128, 1, -1, -1, 0, M_CAP | M_ALIBI | M_SINKS, 5.0f};
  gpu_case(&f16, SMELT_DTYPE_F16, SMELT_ATTENTION_SCHEDULE_AUTO, 1, 0);
}

/* The Hopper forward's three schedules with every modifier: each is its
 * own variant. */
static void test_gpu_modifiers_schedules(void) {
  if (!th_cuda_sm90()) SKIP("no sm_90 device");
  static const smelt_attention_schedule sc[] = {SMELT_ATTENTION_SCHEDULE_TILES, SMELT_ATTENTION_SCHEDULE_PERSISTENT,
                                                SMELT_ATTENTION_SCHEDULE_DYNAMIC};
  for (int i = 0; i < 3; i++) {
    const mcase c = {3, 250, 250, 2, 1, 64 << (i & 1), i == 1, -1, -1, 0, M_CAP | M_ALIBI | M_SINKS, 3.0f};
    gpu_case(&c, SMELT_DTYPE_BF16, sc[i], 0, 0);
    const mcase s = {2, 190, 300, 4, 2, 128, 0, -1, -1, 0, M_SINKS, 0};
    gpu_case(&s, SMELT_DTYPE_BF16, sc[i], 0, 0);
  }
}

/* causal with a right window > 0 (and a left window) on the device: the
 * intersection, forward and backward, without modifiers. */
static void test_gpu_causal_window(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  static const mcase cases[] = {
      {1, 300, 300, 2, 1, 128, 1, 64, 9, 0, 0, 0},
      {2, 100, 260, 2, 2, 64, 1, -1, 100, 0, 0, 0},
      {1, 260, 100, 4, 2, 96, 1, 30, 1, 0, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    gpu_case(&cases[i], SMELT_DTYPE_BF16, SMELT_ATTENTION_SCHEDULE_AUTO, 1, 0);
}

const th_test th_tests_attn_mods[] = {
    {"cpu_forward_vs_naive", test_cpu_forward_vs_naive},
    {"cpu_gradients_fd", test_cpu_gradients_fd},
    {"causal_window_intersection", test_causal_window_intersection},
    {"bad_modifiers", test_bad_modifiers},
    {"gpu_modifiers", test_gpu_modifiers},
    {"gpu_modifiers_schedules", test_gpu_modifiers_schedules},
    {"gpu_causal_window", test_gpu_causal_window},
    {0, 0},
};
