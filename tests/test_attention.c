/* Attention tests, forward and backward, batched and varlen, on every backend
 * (the CPU always, CUDA when present) against a double-precision reference
 * written here, apart from the library's CPU reference: it materializes S
 * and P per (sequence, head) with its own mask test. Every case draws fresh
 * seeded inputs, uses ragged lengths (1, 17, 127, 1000, Sq != Sk both ways),
 * GQA ratios 1, 4 and 8, causal and sliding-window masks with fully masked
 * rows, custom (also negative) scales, varlen batches with empty sequences,
 * and non-contiguous layouts (padded rows and heads, head-major storage).
 * Outputs are poisoned, every element must be written and nothing between
 * them or past the guards. The backward takes the reference's O and LSE as
 * inputs, so it is checked on its own. A finite-difference test checks the
 * CPU reference's gradients in f64; on the GPU, the deterministic mode must
 * give identical bits in two runs. Bad-input tests cover every public entry
 * point: status, a message naming the tensor and the constraint, and
 * outputs left untouched. */
#include "core/error_bound.h"
#include "harness.h"

#include <math.h>

static smelt_ctx *backend(int b) { return b == 0 ? th_cpu() : th_cuda(); }
static int is_cuda(smelt_ctx *ctx) { return smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA; }
#define FOR_EACH_BACKEND(ctx)          \
  for (int th_b = 0; th_b < 2; th_b++) \
    for (smelt_ctx *ctx = backend(th_b); ctx; ctx = NULL)

/* ---------------------------------------------------------------- layouts */

/* A tensor's memory: logical shape, strides, the element its data starts at
 * in the buffer and the elements the buffer holds. */
typedef th_view tlay;

/* Storage element of row-major linear index i, offset included. */
static int64_t lay_off(const tlay *l, int64_t i) { return l->offset + th_view_off(l, i); }

/* order: the logical dims from outermost to innermost in memory; pad: spare
 * elements after each line of every dim but the innermost (8 keeps 16-bit
 * rows 16-byte aligned). */
static tlay lay_make(int ndim, const int64_t *shape, const int *order, int64_t pad, int64_t offset) {
  int64_t strides[SMELT_MAX_DIMS], s = 1;
  for (int p = ndim - 1; p >= 0; p--) {
    strides[order[p]] = s;
    s = s * shape[order[p]] + pad;
  }
  return th_view_make(ndim, shape, strides, offset);
}


/* ---------------------------------------------------------------- a case */

#define MAXSEQ 6

typedef struct acase {
  int64_t B, Sq, Sk, H, Hk, D; /* varlen: B = nseq, Sq/Sk unused (from lq/lk) */
  int causal;
  int64_t wl, wr;
  float scale; /* 0 = default */
  int varlen;
  int64_t lq[MAXSEQ], lk[MAXSEQ];
  int layout; /* 0 contiguous, 1 padded rows and heads, 2 head-major */
} acase;

enum { LAY_CONTIG, LAY_PADDED, LAY_HEADMAJOR };
static const char *const lay_names[] = {"contig", "padded", "head-major"};

/* The geometry of a case: each sequence's first packed row and length. */
typedef struct ageom {
  int64_t B, q0[MAXSEQ + 1], k0[MAXSEQ + 1], sq[MAXSEQ], sk[MAXSEQ];
  int64_t rows_q, rows_k, max_q, max_k;
  double scale;
} ageom;

static ageom geom_of(const acase *c) {
  ageom g;
  memset(&g, 0, sizeof g);
  g.B = c->B;
  for (int64_t b = 0; b < c->B; b++) {
    g.sq[b] = c->varlen ? c->lq[b] : c->Sq;
    g.sk[b] = c->varlen ? c->lk[b] : c->Sk;
    g.q0[b + 1] = g.q0[b] + g.sq[b];
    g.k0[b + 1] = g.k0[b] + g.sk[b];
    if (g.sq[b] > g.max_q) g.max_q = g.sq[b];
    if (g.sk[b] > g.max_k) g.max_k = g.sk[b];
  }
  g.rows_q = g.q0[c->B];
  g.rows_k = g.k0[c->B];
  g.scale = c->scale != 0 ? (double)c->scale : 1.0 / sqrt((double)c->D);
  return g;
}

/* Layouts of the q-like (heads = H) or k-like (heads = Hk) tensors and lse. */
static tlay qk_lay(const acase *c, const ageom *g, int kv, int64_t offset) {
  const int64_t heads = kv ? c->Hk : c->H, rows = kv ? g->rows_k : g->rows_q, S = kv ? c->Sk : c->Sq;
  const int64_t pad = c->layout == LAY_PADDED ? 8 : 0;
  if (c->varlen) {
    const int64_t shape[3] = {rows, heads, c->D};
    static const int rowmajor[3] = {0, 1, 2}, headmajor[3] = {1, 0, 2};
    return lay_make(3, shape, c->layout == LAY_HEADMAJOR ? headmajor : rowmajor, pad, offset);
  }
  const int64_t shape[4] = {c->B, S, heads, c->D};
  static const int rowmajor[4] = {0, 1, 2, 3}, headmajor[4] = {0, 2, 1, 3};
  return lay_make(4, shape, c->layout == LAY_HEADMAJOR ? headmajor : rowmajor, pad, offset);
}

static tlay lse_lay(const acase *c, const ageom *g) {
  const int64_t pad = c->layout == LAY_PADDED ? 3 : 0;
  if (c->varlen) {
    const int64_t shape[2] = {c->H, g->rows_q};
    static const int o1[2] = {0, 1}, o2[2] = {1, 0};
    return lay_make(2, shape, c->layout == LAY_HEADMAJOR ? o2 : o1, pad, 0);
  }
  const int64_t shape[3] = {c->B, c->H, c->Sq};
  static const int o1[3] = {0, 1, 2}, o2[3] = {0, 2, 1};
  return lay_make(3, shape, c->layout == LAY_HEADMAJOR ? o2 : o1, pad, 0);
}

/* Dense index of lse (packed row r, head h) in lse's logical order. */
static int64_t lse_index(const acase *c, const ageom *g, int64_t r, int64_t h) {
  if (c->varlen) return h * g->rows_q + r;
  const int64_t b = r / c->Sq, i = r % c->Sq;
  return (b * c->H + h) * c->Sq + i;
}

/* ---------------------------------------------------------------- the reference */

/* Query i of a sequence of sq queries sees key j of sk. Written apart from
 * the library's smelt__attn_key_range on purpose. */
static int visible(const acase *c, int64_t sq, int64_t sk, int64_t i, int64_t j) {
  const int64_t diag = i + sk - sq;
  if (c->causal && j > diag) return 0;
  if (c->wl >= 0 && c->wl < diag - j) return 0; /* j < diag - wl, without overflow */
  if (c->wr >= 0 && j - diag > c->wr) return 0;
  return 1;
}

/* Dense tensors are [packed rows][heads][D], which is the logical row-major
 * order of both the batched and the varlen shapes. */
static double dot(const double *a, const double *b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

static void ref_forward(const acase *c, const ageom *g, const double *q, const double *k, const double *v, double *o,
                        double *lse) {
  const int64_t H = c->H, Hk = c->Hk, D = c->D, G = H / Hk;
  double *s = (double *)malloc((size_t)(g->max_k > 0 ? g->max_k : 1) * sizeof *s);
  for (int64_t b = 0; b < g->B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < g->sq[b]; i++) {
        const int64_t r = g->q0[b] + i;
        double m = -INFINITY;
        for (int64_t j = 0; j < g->sk[b]; j++) {
          s[j] = -INFINITY;
          if (!visible(c, g->sq[b], g->sk[b], i, j)) continue;
          s[j] = g->scale * dot(q + (r * H + h) * D, k + ((g->k0[b] + j) * Hk + h / G) * D, D);
          if (s[j] > m) m = s[j];
        }
        double *orow = o + (r * H + h) * D;
        for (int64_t d = 0; d < D; d++) orow[d] = 0;
        if (m == -INFINITY) {
          lse[r * H + h] = INFINITY;
          continue;
        }
        double l = 0;
        for (int64_t j = 0; j < g->sk[b]; j++) l += exp(s[j] - m);
        for (int64_t j = 0; j < g->sk[b]; j++) {
          double p = exp(s[j] - m) / l;
          for (int64_t d = 0; d < D; d++) orow[d] += p * v[((g->k0[b] + j) * Hk + h / G) * D + d];
        }
        lse[r * H + h] = m + log(l);
      }
  free(s);
}

/* dq [rows_q][H][D]; dk, dv [rows_k][Hk][D] (summed over each group). */
static void ref_backward(const acase *c, const ageom *g, const double *q, const double *k, const double *v,
                         const double *o, const double *d_o, const double *lse, double *dq, double *dk, double *dv) {
  const int64_t H = c->H, Hk = c->Hk, D = c->D, G = H / Hk;
  memset(dk, 0, (size_t)(g->rows_k * Hk * D) * sizeof *dk);
  memset(dv, 0, (size_t)(g->rows_k * Hk * D) * sizeof *dv);
  for (int64_t b = 0; b < g->B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < g->sq[b]; i++) {
        const int64_t r = g->q0[b] + i;
        const double *qr = q + (r * H + h) * D, *dor = d_o + (r * H + h) * D;
        const double di = dot(dor, o + (r * H + h) * D, D);
        double *dqr = dq + (r * H + h) * D;
        for (int64_t d = 0; d < D; d++) dqr[d] = 0;
        for (int64_t j = 0; j < g->sk[b]; j++) {
          if (!visible(c, g->sq[b], g->sk[b], i, j)) continue;
          const int64_t kr = ((g->k0[b] + j) * Hk + h / G) * D;
          const double p = exp(g->scale * dot(qr, k + kr, D) - lse[r * H + h]);
          const double ds = p * (dot(dor, v + kr, D) - di);
          for (int64_t d = 0; d < D; d++) {
            dqr[d] += g->scale * ds * k[kr + d];
            dk[kr + d] += g->scale * ds * qr[d];
            dv[kr + d] += p * dor[d];
          }
        }
      }
}

/* ---------------------------------------------------------------- running a case */

/* Relative L2 bounds. The CPU computes in double and rounds once to the
 * output type; the GPU rounds P and dS to the 16-bit input type on their
 * way into the tensor cores and accumulates in f32. */
static double bound_of(smelt_ctx *ctx, smelt_dtype dt, int output) {
  const smelt__bound_query q = {.family = "attention", .device = smelt_ctx_device(ctx), .dtype = dt, .output = output};
  return smelt__error_bound(&q);
}
static double bound(smelt_ctx *ctx, smelt_dtype dt) { return bound_of(ctx, dt, 0); }
static double lse_bound(smelt_ctx *ctx) { return bound_of(ctx, SMELT_DTYPE_F32, 1); }

/* A host buffer for layout l: random values (the gaps too), and the dense
 * doubles of its elements after rounding to dt. */
static uint8_t *random_host(const tlay *l, smelt_dtype dt, double lo, double hi, double *dense) {
  uint8_t *h = (uint8_t *)malloc((size_t)l->storage * smelt_dtype_size(dt) + 1);
  th_fill_uniform(h, dt, l->storage, lo, hi);
  for (int64_t i = 0; i < l->numel; i++) dense[i] = th_get(h, dt, lay_off(l, i));
  return h;
}

static th_buf upload(smelt_ctx *ctx, const tlay *l, smelt_dtype dt, const void *host) {
  th_buf b = th_buf_new(ctx, (size_t)l->storage * smelt_dtype_size(dt));
  th_buf_upload(&b, host, (size_t)l->storage * smelt_dtype_size(dt));
  return b;
}

static th_buf cu_upload(smelt_ctx *ctx, const int64_t *starts, int64_t B, smelt_tensor *t) {
  int32_t host[MAXSEQ + 1];
  for (int64_t b = 0; b <= B; b++) host[b] = (int32_t)starts[b];
  th_buf buf = th_buf_new(ctx, (size_t)(B + 1) * 4);
  th_buf_upload(&buf, host, (size_t)(B + 1) * 4);
  const int64_t n = B + 1;
  *t = smelt_tensor_make(buf.data, SMELT_DTYPE_I32, smelt_ctx_device(ctx), smelt_ctx_device_index(ctx), 1, &n);
  return buf;
}

/* The Hopper forward's schedule every case's desc asks for (the schedule
 * tests set it, and put AUTO back after). */
static smelt_attention_schedule fwd_schedule = SMELT_ATTENTION_SCHEDULE_AUTO;

static smelt_attention_desc desc_of(const acase *c, const ageom *g) {
  smelt_attention_desc d = smelt_attention_desc_default();
  d.fwd_schedule = fwd_schedule;
  d.scale = c->scale;
  d.causal = c->causal;
  d.window_left = c->wl;
  d.window_right = c->wr;
  d.max_seqlen_q = g->max_q;
  d.max_seqlen_k = g->max_k;
  return d;
}

static const char *case_text(const acase *c, smelt_ctx *ctx, smelt_dtype dt, char *buf, size_t n) {
  size_t u = (size_t)snprintf(buf, n, "attention %s %s B=%lld H=%lld Hk=%lld D=%lld", is_cuda(ctx) ? "cuda" : "cpu",
                              smelt_dtype_name(dt), (long long)c->B, (long long)c->H, (long long)c->Hk,
                              (long long)c->D);
  if (c->varlen) {
    u += (size_t)snprintf(buf + u, n - u, " varlen q/k lens");
    for (int64_t b = 0; b < c->B && u < n; b++)
      u += (size_t)snprintf(buf + u, n - u, " %lld/%lld", (long long)c->lq[b], (long long)c->lk[b]);
  } else if (u < n) {
    u += (size_t)snprintf(buf + u, n - u, " Sq=%lld Sk=%lld", (long long)c->Sq, (long long)c->Sk);
  }
  if (u < n)
    snprintf(buf + u, n - u, "%s window=(%lld,%lld) scale=%g %s", c->causal ? " causal" : "", (long long)c->wl,
             (long long)c->wr, (double)c->scale, lay_names[c->layout]);
  return buf;
}

/* Forward, then backward from the reference's O and LSE. */
static void run_case(smelt_ctx *ctx, smelt_dtype dt, const acase *c, int bwd) {
  const ageom g = geom_of(c);
  char what[320];
  case_text(c, ctx, dt, what, sizeof what);
  const tlay lq = qk_lay(c, &g, 0, 0), lk = qk_lay(c, &g, 1, 0), lv = qk_lay(c, &g, 1, c->layout == LAY_PADDED ? 8 : 0);
  const tlay lo = qk_lay(c, &g, 0, c->layout == LAY_PADDED ? 8 : 0), ll = lse_lay(c, &g);
  const int64_t nq = lq.numel, nk = lk.numel, nl = ll.numel;
  double *qd = (double *)malloc((size_t)(nq + 1) * sizeof(double)), *kd = (double *)malloc((size_t)(nk + 1) * 8);
  double *vd = (double *)malloc((size_t)(nk + 1) * 8), *oref = (double *)malloc((size_t)(nq + 1) * 8);
  double *lref = (double *)malloc((size_t)(nl + 1) * 8), *got = (double *)malloc((size_t)(nq + nk + nl + 1) * 8);
  double *lgot = (double *)malloc((size_t)(nl + 1) * 8), *lden = (double *)malloc((size_t)(nl + 1) * 8);
  uint8_t *qh = random_host(&lq, dt, -2, 2, qd), *kh = random_host(&lk, dt, -2, 2, kd);
  uint8_t *vh = random_host(&lv, dt, -1, 1, vd);
  ref_forward(c, &g, qd, kd, vd, oref, lden);
  for (int64_t r = 0; r < g.rows_q; r++)
    for (int64_t h = 0; h < c->H; h++) lref[lse_index(c, &g, r, h)] = lden[r * c->H + h];

  th_buf qb = upload(ctx, &lq, dt, qh), kb = upload(ctx, &lk, dt, kh), vb = upload(ctx, &lv, dt, vh);
  th_buf ob = th_buf_new(ctx, (size_t)lo.storage * smelt_dtype_size(dt)), lb = th_buf_new(ctx, (size_t)ll.storage * 4);
  smelt_tensor qt = th_view_tensor(&lq, &qb, dt), kt = th_view_tensor(&lk, &kb, dt), vt = th_view_tensor(&lv, &vb, dt);
  smelt_tensor ot = th_view_tensor(&lo, &ob, dt), lt = th_view_tensor(&ll, &lb, SMELT_DTYPE_F32), cqt, ckt;
  th_buf cqb, ckb;
  memset(&cqb, 0, sizeof cqb);
  memset(&ckb, 0, sizeof ckb);
  if (c->varlen) {
    cqb = cu_upload(ctx, g.q0, c->B, &cqt);
    ckb = cu_upload(ctx, g.k0, c->B, &ckt);
  }
  const smelt_attention_desc desc = desc_of(c, &g);
  smelt_status s = c->varlen ? smelt_attention_varlen_fwd(ctx, &desc, &qt, &kt, &vt, &cqt, &ckt, &ot, &lt)
                             : smelt_attention_fwd(ctx, &desc, &qt, &kt, &vt, &ot, &lt);
  if (s) th_fail(__FILE__, __LINE__, "%s: fwd: %s (%s)", what, smelt_status_name(s), smelt_last_error());
  th_check_output(what, "o", &lo, &ob, dt, got);
  if (!th_compare(what, got, oref, nq, bound(ctx, dt), 0)) th_fail(__FILE__, __LINE__, "%s: o differs", what);
  th_check_output(what, "lse", &ll, &lb, SMELT_DTYPE_F32, lgot);
  if (!th_compare(what, lgot, lref, nl, lse_bound(ctx), 0)) th_fail(__FILE__, __LINE__, "%s: lse differs", what);

  if (bwd) {
    /* Inputs o and lse: the reference's, rounded like a forward's outputs. */
    uint8_t *oh = (uint8_t *)malloc((size_t)lo.storage * smelt_dtype_size(dt) + 1), *lh;
    th_fill_uniform(oh, dt, lo.storage, -1, 1);
    double *od = (double *)malloc((size_t)(nq + 1) * 8), *dod = (double *)malloc((size_t)(nq + 1) * 8);
    for (int64_t i = 0; i < nq; i++) {
      th_set(oh, dt, lay_off(&lo, i), oref[i]);
      od[i] = th_get(oh, dt, lay_off(&lo, i));
    }
    lh = (uint8_t *)malloc((size_t)ll.storage * 4 + 1);
    th_fill_uniform(lh, SMELT_DTYPE_F32, ll.storage, -1, 1);
    for (int64_t r = 0; r < g.rows_q; r++)
      for (int64_t h = 0; h < c->H; h++) {
        const int64_t at = lay_off(&ll, lse_index(c, &g, r, h));
        th_set(lh, SMELT_DTYPE_F32, at, lden[r * c->H + h]);
        lden[r * c->H + h] = th_get(lh, SMELT_DTYPE_F32, at);
      }
    uint8_t *doh = random_host(&lo, dt, -1, 1, dod);
    double *dqr = (double *)malloc((size_t)(nq + 1) * 8), *dkr = (double *)malloc((size_t)(nk + 1) * 8);
    double *dvr = (double *)malloc((size_t)(nk + 1) * 8);
    ref_backward(c, &g, qd, kd, vd, od, dod, lden, dqr, dkr, dvr);
    th_buf oib = upload(ctx, &lo, dt, oh), lib = upload(ctx, &ll, SMELT_DTYPE_F32, lh), dob = upload(ctx, &lo, dt, doh);
    const tlay ldq = qk_lay(c, &g, 0, c->layout == LAY_PADDED ? 8 : 0), ldk = qk_lay(c, &g, 1, 0),
               ldv = qk_lay(c, &g, 1, c->layout == LAY_PADDED ? 16 : 0);
    th_buf dqb = th_buf_new(ctx, (size_t)ldq.storage * smelt_dtype_size(dt)),
           dkb = th_buf_new(ctx, (size_t)ldk.storage * smelt_dtype_size(dt)),
           dvb = th_buf_new(ctx, (size_t)ldv.storage * smelt_dtype_size(dt));
    smelt_tensor oit = th_view_tensor(&lo, &oib, dt), lit = th_view_tensor(&ll, &lib, SMELT_DTYPE_F32),
                 dot_ = th_view_tensor(&lo, &dob, dt);
    smelt_tensor dqt = th_view_tensor(&ldq, &dqb, dt), dkt = th_view_tensor(&ldk, &dkb, dt), dvt = th_view_tensor(&ldv, &dvb, dt);
    s = c->varlen ? smelt_attention_varlen_bwd(ctx, &desc, &qt, &kt, &vt, &cqt, &ckt, &oit, &dot_, &lit, &dqt, &dkt, &dvt)
                  : smelt_attention_bwd(ctx, &desc, &qt, &kt, &vt, &oit, &dot_, &lit, &dqt, &dkt, &dvt);
    if (s) th_fail(__FILE__, __LINE__, "%s: bwd: %s (%s)", what, smelt_status_name(s), smelt_last_error());
    th_check_output(what, "dq", &ldq, &dqb, dt, got);
    if (!th_compare(what, got, dqr, nq, bound(ctx, dt), 0)) th_fail(__FILE__, __LINE__, "%s: dq differs", what);
    th_check_output(what, "dk", &ldk, &dkb, dt, got);
    if (!th_compare(what, got, dkr, nk, bound(ctx, dt), 0)) th_fail(__FILE__, __LINE__, "%s: dk differs", what);
    th_check_output(what, "dv", &ldv, &dvb, dt, got);
    if (!th_compare(what, got, dvr, nk, bound(ctx, dt), 0)) th_fail(__FILE__, __LINE__, "%s: dv differs", what);
    th_buf_free(&oib);
    th_buf_free(&lib);
    th_buf_free(&dob);
    th_buf_free(&dqb);
    th_buf_free(&dkb);
    th_buf_free(&dvb);
    free(oh);
    free(lh);
    free(doh);
    free(od);
    free(dod);
    free(dqr);
    free(dkr);
    free(dvr);
  }
  th_buf_free(&qb);
  th_buf_free(&kb);
  th_buf_free(&vb);
  th_buf_free(&ob);
  th_buf_free(&lb);
  if (c->varlen) {
    th_buf_free(&cqb);
    th_buf_free(&ckb);
  }
  free(qh);
  free(kh);
  free(vh);
  free(qd);
  free(kd);
  free(vd);
  free(oref);
  free(lref);
  free(got);
  free(lgot);
  free(lden);
}

/* ---------------------------------------------------------------- value tests */

/* Head dims the CUDA kernels take (forward; the backward lacks 256). */
static int cuda_takes(const acase *c, int bwd) {
  return c->D == 64 || c->D == 96 || c->D == 128 || (c->D == 256 && !bwd);
}

/* Runs a case on every backend: the CPU in each of cpu_dts, CUDA in bf16
 * and f16, forward and backward (where the backend has a kernel for it). */
static void run_everywhere(const acase *c, const smelt_dtype *cpu_dts, int ncpu) {
  static const smelt_dtype gpu_dts[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16};
  FOR_EACH_BACKEND(ctx) {
    const int cuda = is_cuda(ctx);
    if (cuda && !cuda_takes(c, 0)) continue;
    for (int i = 0; i < (cuda ? 2 : ncpu); i++) run_case(ctx, cuda ? gpu_dts[i] : cpu_dts[i], c, !cuda || cuda_takes(c, 1));
  }
}

#define NSEQ0 {0}
/* B, Sq, Sk, H, Hk, D, causal, window left, right, scale, varlen, q lens, k lens, layout */
static const acase small_cases[] = {
    {2, 1, 1, 2, 2, 64, 0, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},         /* length 1 */
    {2, 1, 17, 2, 1, 64, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED},        /* one query, causal: sees all */
    {2, 17, 17, 4, 1, 64, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED},       /* GQA 4, causal */
    {1, 17, 127, 2, 2, 64, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_HEADMAJOR},   /* Sq < Sk, causal */
    {1, 127, 17, 2, 1, 64, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},      /* Sq > Sk: fully masked rows */
    {1, 127, 127, 8, 1, 64, 0, 16, 0, 0, 0, NSEQ0, NSEQ0, LAY_PADDED},      /* GQA 8, sliding window */
    {2, 127, 100, 2, 2, 64, 0, 5, 3, 0.3f, 0, NSEQ0, NSEQ0, LAY_HEADMAJOR}, /* two-sided window, custom scale */
    {1, 100, 130, 2, 1, 64, 0, -1, 7, -0.2f, 0, NSEQ0, NSEQ0, LAY_CONTIG},  /* right window, negative scale */
    {1, 40, 300, 2, 1, 64, 1, 20, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED},      /* causal + left window, Sq < Sk */
    {4, 0, 0, 4, 2, 64, 1, -1, -1, 0, 1, {5, 0, 17, 64}, {7, 4, 0, 100}, LAY_PADDED},          /* varlen, empty seqs */
    {3, 0, 0, 2, 1, 64, 0, 30, -1, 0, 1, {1, 33, 129}, {40, 1, 129}, LAY_HEADMAJOR},          /* varlen, window */
    {5, 0, 0, 8, 8, 64, 1, -1, -1, 0.1f, 1, {3, 70, 0, 17, 1}, {3, 70, 5, 17, 0}, LAY_CONTIG}, /* varlen, MHA */
    {2, 33, 20, 2, 1, 64, 0, INT64_MAX, INT64_MAX, 0, 0, NSEQ0, NSEQ0, LAY_PADDED}, /* windows as wide as none */
    {2, 0, 0, 2, 2, 64, 1, INT64_MAX, -1, 0, 1, {9, 30}, {40, 2}, LAY_CONTIG},      /* varlen, causal, huge left */
};

static void test_values_small(void) {
  static const smelt_dtype cpu_dts[] = {SMELT_DTYPE_F32, SMELT_DTYPE_BF16};
  for (size_t i = 0; i < sizeof small_cases / sizeof *small_cases; i++) run_everywhere(&small_cases[i], cpu_dts, 2);
}

/* Other head dims: every one a CUDA kernel exists for, ragged both ways. */
static void test_values_head_dims(void) {
  static const acase cases[] = {
      {1, 130, 70, 2, 1, 96, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
      {2, 65, 200, 2, 2, 128, 0, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED},
      {1, 200, 200, 4, 1, 128, 1, 64, -1, 0, 0, NSEQ0, NSEQ0, LAY_HEADMAJOR},
      {3, 0, 0, 4, 2, 128, 1, -1, -1, 0, 1, {0, 90, 33}, {17, 150, 33}, LAY_CONTIG},
      {1, 70, 130, 2, 1, 256, 0, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED},
      {1, 129, 129, 2, 2, 256, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
  };
  static const smelt_dtype cpu_dts[] = {SMELT_DTYPE_F32};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) run_everywhere(&cases[i], cpu_dts, 1);
}

/* Length 1000, causal and full: many tiles in both directions. */
static void test_values_long(void) {
  static const acase causal = {1, 1000, 1000, 2, 1, 64, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG};
  static const smelt_dtype cpu_dts[] = {SMELT_DTYPE_F32};
  run_everywhere(&causal, cpu_dts, 1);
  if (!th_cuda()) return;
  /* GPU only (the CPU reference takes a while): full attention, D 128, GQA 4. */
  static const acase full = {1, 1000, 1003, 4, 1, 128, 0, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED};
  run_case(th_cuda(), SMELT_DTYPE_BF16, &full, 1);
}

/* CPU-only dtypes (f64, f16) and head dims no kernel has. */
static void test_values_cpu_dtypes(void) {
  static const acase cases[] = {
      {2, 17, 23, 4, 2, 16, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED},
      {1, 9, 9, 3, 1, 3, 0, 2, 2, 0.7f, 0, NSEQ0, NSEQ0, LAY_HEADMAJOR},
      {3, 0, 0, 2, 2, 5, 1, -1, -1, 0, 1, {4, 0, 9}, {6, 3, 9}, LAY_CONTIG},
  };
  static const smelt_dtype dts[] = {SMELT_DTYPE_F64, SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (int d = 0; d < 4; d++) run_case(th_cpu(), dts[d], &cases[i], 1);
}

/* ---------------------------------------------------------------- finite differences */

/* L = Σ d_o ∘ o(q, k, v) on the CPU in f64; the library's backward must be
 * its gradient. Central differences with step 1e-5 are good to ~1e-9. */
typedef struct fd_env {
  acase c;
  ageom g;
  smelt_attention_desc desc;
  double *q, *k, *v, *o, *d_o;
  smelt_tensor tq, tk, tv, to, tl, tdo;
} fd_env;

static double fd_loss(fd_env *e) {
  CHECK_OK(smelt_attention_fwd(th_cpu(), &e->desc, &e->tq, &e->tk, &e->tv, &e->to, &e->tl));
  return dot(e->o, e->d_o, e->to.shape[0] * e->to.shape[1] * e->to.shape[2] * e->to.shape[3]);
}

static smelt_tensor host_tensor(double *p, int ndim, const int64_t *shape) {
  return smelt_tensor_make(p, SMELT_DTYPE_F64, SMELT_DEVICE_CPU, 0, ndim, shape);
}

static void fd_case(const acase *c) {
  fd_env e;
  memset(&e, 0, sizeof e);
  e.c = *c;
  e.g = geom_of(c);
  e.desc = desc_of(c, &e.g);
  const int64_t qs[4] = {c->B, c->Sq, c->H, c->D}, ks[4] = {c->B, c->Sk, c->Hk, c->D}, ls[3] = {c->B, c->H, c->Sq};
  const int64_t nq = c->B * c->Sq * c->H * c->D, nk = c->B * c->Sk * c->Hk * c->D;
  e.q = (double *)malloc((size_t)nq * 8);
  e.o = (double *)malloc((size_t)nq * 8);
  e.d_o = (double *)malloc((size_t)nq * 8);
  e.k = (double *)malloc((size_t)nk * 8);
  e.v = (double *)malloc((size_t)nk * 8);
  float *lse32 = (float *)malloc((size_t)(c->B * c->H * c->Sq) * 4);
  double *grad[3] = {(double *)malloc((size_t)nq * 8), (double *)malloc((size_t)nk * 8), (double *)malloc((size_t)nk * 8)};
  th_fill_uniform(e.q, SMELT_DTYPE_F64, nq, -1.5, 1.5);
  th_fill_uniform(e.k, SMELT_DTYPE_F64, nk, -1.5, 1.5);
  th_fill_uniform(e.v, SMELT_DTYPE_F64, nk, -1, 1);
  th_fill_uniform(e.d_o, SMELT_DTYPE_F64, nq, -1, 1);
  e.tq = host_tensor(e.q, 4, qs);
  e.tk = host_tensor(e.k, 4, ks);
  e.tv = host_tensor(e.v, 4, ks);
  e.to = host_tensor(e.o, 4, qs);
  e.tdo = host_tensor(e.d_o, 4, qs);
  e.tl = smelt_tensor_make(lse32, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, ls);
  fd_loss(&e);
  smelt_tensor tdq = host_tensor(grad[0], 4, qs), tdk = host_tensor(grad[1], 4, ks), tdv = host_tensor(grad[2], 4, ks);
  /* LSE is f32 by definition: P = exp(S - LSE) carries its rounding
   * (~1e-7 relative), which the bound below leaves room for. */
  CHECK_OK(smelt_attention_bwd(th_cpu(), &e.desc, &e.tq, &e.tk, &e.tv, &e.to, &e.tdo, &e.tl, &tdq, &tdk, &tdv));
  double *x[3] = {e.q, e.k, e.v};
  const int64_t n[3] = {nq, nk, nk};
  static const char *const names[3] = {"dq", "dk", "dv"};
  for (int t = 0; t < 3; t++) {
    double *fd = (double *)malloc((size_t)n[t] * 8);
    for (int64_t i = 0; i < n[t]; i++) {
      const double keep = x[t][i], h = 1e-5;
      x[t][i] = keep + h;
      const double lp = fd_loss(&e);
      x[t][i] = keep - h;
      const double lm = fd_loss(&e);
      x[t][i] = keep;
      fd[i] = (lp - lm) / (2 * h);
    }
    char what[200];
    snprintf(what, sizeof what, "finite differences %s Sq=%lld Sk=%lld causal=%d window=(%lld,%lld)", names[t],
             (long long)c->Sq, (long long)c->Sk, c->causal, (long long)c->wl, (long long)c->wr);
    if (!th_compare(what, grad[t], fd, n[t], 1e-6, 1e-9)) th_fail(__FILE__, __LINE__, "%s differ", what);
    free(fd);
  }
  for (int t = 0; t < 3; t++) free(grad[t]);
  free(e.q);
  free(e.k);
  free(e.v);
  free(e.o);
  free(e.d_o);
  free(lse32);
}

static void test_finite_differences(void) {
  static const acase cases[] = {
      {1, 5, 7, 2, 1, 4, 1, 3, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},    /* causal + window, GQA */
      {2, 6, 4, 2, 2, 3, 1, -1, -1, 0.8f, 0, NSEQ0, NSEQ0, LAY_CONTIG}, /* Sq > Sk: two rows see nothing */
      {1, 4, 6, 4, 2, 5, 0, 1, 2, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},     /* two-sided window */
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) fd_case(&cases[i]);
}

/* ---------------------------------------------------------------- determinism, reuse, empty */

/* Backward inputs of a case on one context, kept for several runs. */
typedef struct bwd_env {
  acase c;
  ageom g;
  smelt_dtype dt;
  tlay lq, lk, ll;
  th_buf b[11];
  smelt_tensor q, k, v, o, d_o, lse, dq, dk, dv, cq, ck;
} bwd_env;

static void bwd_env_new(bwd_env *e, smelt_ctx *ctx, smelt_dtype dt, const acase *c) {
  memset(e, 0, sizeof *e);
  e->c = *c;
  e->g = geom_of(c);
  e->dt = dt;
  e->lq = qk_lay(c, &e->g, 0, 0);
  e->lk = qk_lay(c, &e->g, 1, 0);
  e->ll = lse_lay(c, &e->g);
  smelt_tensor *in[5] = {&e->q, &e->k, &e->v, &e->o, &e->d_o};
  const tlay *lays[5] = {&e->lq, &e->lk, &e->lk, &e->lq, &e->lq};
  for (int i = 0; i < 5; i++) {
    double *dense = (double *)malloc((size_t)(lays[i]->numel + 1) * 8);
    uint8_t *h = random_host(lays[i], dt, -2, 2, dense);
    e->b[i] = upload(ctx, lays[i], dt, h);
    *in[i] = th_view_tensor(lays[i], &e->b[i], dt);
    free(h);
    free(dense);
  }
  /* Any finite LSE makes a valid backward input; near the scores' range keeps P moderate. */
  float *lh = (float *)malloc((size_t)e->ll.storage * 4 + 4);
  for (int64_t i = 0; i < e->ll.storage; i++) lh[i] = (float)th_rand_uniform(2, 4);
  e->b[5] = upload(ctx, &e->ll, SMELT_DTYPE_F32, lh);
  e->lse = th_view_tensor(&e->ll, &e->b[5], SMELT_DTYPE_F32);
  free(lh);
  smelt_tensor *out[3] = {&e->dq, &e->dk, &e->dv};
  const tlay *olays[3] = {&e->lq, &e->lk, &e->lk};
  for (int i = 0; i < 3; i++) {
    e->b[6 + i] = th_buf_new(ctx, (size_t)olays[i]->storage * smelt_dtype_size(dt));
    *out[i] = th_view_tensor(olays[i], &e->b[6 + i], dt);
  }
  if (c->varlen) {
    e->b[9] = cu_upload(ctx, e->g.q0, c->B, &e->cq);
    e->b[10] = cu_upload(ctx, e->g.k0, c->B, &e->ck);
  }
}

static void bwd_env_free(bwd_env *e) {
  for (int i = 0; i < 11; i++)
    if (e->b[i].base) th_buf_free(&e->b[i]);
}

static smelt_status bwd_env_run(bwd_env *e, smelt_ctx *ctx, int det) {
  smelt_attention_desc d = desc_of(&e->c, &e->g);
  d.deterministic = det;
  if (e->c.varlen)
    return smelt_attention_varlen_bwd(ctx, &d, &e->q, &e->k, &e->v, &e->cq, &e->ck, &e->o, &e->d_o, &e->lse, &e->dq,
                                      &e->dk, &e->dv);
  return smelt_attention_bwd(ctx, &d, &e->q, &e->k, &e->v, &e->o, &e->d_o, &e->lse, &e->dq, &e->dk, &e->dv);
}

/* The three gradients' bytes, one after the other. */
static uint8_t *bwd_env_bytes(const bwd_env *e, size_t *n) {
  const size_t es = smelt_dtype_size(e->dt);
  const size_t a = (size_t)e->lq.storage * es, b = (size_t)e->lk.storage * es;
  uint8_t *h = (uint8_t *)malloc(a + 2 * b + 1);
  th_buf_download(&e->b[6], h, a);
  th_buf_download(&e->b[7], h + a, b);
  th_buf_download(&e->b[8], h + a + b, b);
  *n = a + 2 * b;
  return h;
}

/* Deterministic mode (by the desc or by the context): identical bits in
 * two runs; and close to the atomic mode's result. */
static void test_deterministic(void) {
  smelt_ctx *ctx = th_cuda();
  if (!ctx) SKIP("no CUDA device");
  static const acase cases[] = {
      {2, 300, 300, 4, 2, 64, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
      {1, 513, 1000, 8, 1, 128, 0, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
      {3, 0, 0, 4, 4, 96, 1, 100, -1, 0, 1, {300, 0, 129}, {200, 7, 400}, LAY_CONTIG},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    bwd_env e;
    bwd_env_new(&e, ctx, SMELT_DTYPE_BF16, &cases[i]);
    size_t n1, n2, n3, n4;
    CHECK_OK(bwd_env_run(&e, ctx, 1));
    uint8_t *a = bwd_env_bytes(&e, &n1);
    CHECK_OK(bwd_env_run(&e, ctx, 1));
    uint8_t *b = bwd_env_bytes(&e, &n2);
    smelt_ctx_set_deterministic(ctx, 1);
    CHECK_OK(bwd_env_run(&e, ctx, 0));
    smelt_ctx_set_deterministic(ctx, 0);
    uint8_t *c = bwd_env_bytes(&e, &n3);
    CHECK_OK(bwd_env_run(&e, ctx, 0));
    uint8_t *d = bwd_env_bytes(&e, &n4);
    if (memcmp(a, b, n1)) th_fail(__FILE__, __LINE__, "case %zu: two deterministic runs differ", i);
    if (memcmp(a, c, n1)) th_fail(__FILE__, __LINE__, "case %zu: the context's deterministic flag gives other bits", i);
    double *x = (double *)malloc(n1 / 2 * 8), *y = (double *)malloc(n1 / 2 * 8);
    int64_t m = 0;
    for (size_t j = 0; j < n1 / 2; j++) {
      x[m] = th_get(a, SMELT_DTYPE_BF16, (int64_t)j);
      y[m] = th_get(d, SMELT_DTYPE_BF16, (int64_t)j);
      if (!isnan(x[m]) || !isnan(y[m])) m++; /* skip the poison between elements */
    }
    CHECK(th_compare("deterministic vs atomic", y, x, m, 1e-2, 0));
    free(x);
    free(y);
    free(a);
    free(b);
    free(c);
    free(d);
    bwd_env_free(&e);
  }
}

/* One plan, runs on other buffers of the planned layout. */
static void test_plan_reuse(void) {
  static const acase c = {2, 33, 47, 4, 2, 64, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED};
  FOR_EACH_BACKEND(ctx) {
    const smelt_dtype dt = is_cuda(ctx) ? SMELT_DTYPE_F16 : SMELT_DTYPE_F32;
    const ageom g = geom_of(&c);
    const tlay lq = qk_lay(&c, &g, 0, 0), lk = qk_lay(&c, &g, 1, 0), ll = lse_lay(&c, &g);
    const smelt_attention_desc desc = desc_of(&c, &g);
    smelt_plan *plan = NULL;
    for (int r = 0; r < 3; r++) {
      double *qd = (double *)malloc((size_t)lq.numel * 8), *kd = (double *)malloc((size_t)lk.numel * 8),
             *vd = (double *)malloc((size_t)lk.numel * 8);
      double *oref = (double *)malloc((size_t)lq.numel * 8), *lden = (double *)malloc((size_t)ll.numel * 8);
      double *got = (double *)malloc((size_t)lq.numel * 8);
      uint8_t *qh = random_host(&lq, dt, -2, 2, qd), *kh = random_host(&lk, dt, -2, 2, kd),
              *vh = random_host(&lk, dt, -1, 1, vd);
      ref_forward(&c, &g, qd, kd, vd, oref, lden);
      th_buf qb = upload(ctx, &lq, dt, qh), kb = upload(ctx, &lk, dt, kh), vb = upload(ctx, &lk, dt, vh);
      th_buf ob = th_buf_new(ctx, (size_t)lq.storage * smelt_dtype_size(dt));
      smelt_tensor qt = th_view_tensor(&lq, &qb, dt), kt = th_view_tensor(&lk, &kb, dt), vt = th_view_tensor(&lk, &vb, dt),
                   ot = th_view_tensor(&lq, &ob, dt);
      if (r == 0) {
        CHECK_OK(smelt_attention_fwd_plan(ctx, &desc, &qt, &kt, &vt, &ot, NULL, &plan));
        if (plan) CHECK(strstr(smelt_plan_describe(plan), "attention") != NULL);
      }
      if (plan) {
        CHECK_OK(smelt_attention_fwd_run(plan, &qt, &kt, &vt, &ot, NULL));
        th_check_output("attention plan reuse", "o", &lq, &ob, dt, got);
        CHECK(th_compare("attention plan reuse", got, oref, lq.numel, bound(ctx, dt), 0));
      }
      th_buf_free(&qb);
      th_buf_free(&kb);
      th_buf_free(&vb);
      th_buf_free(&ob);
      free(qd);
      free(kd);
      free(vd);
      free(oref);
      free(lden);
      free(got);
      free(qh);
      free(kh);
      free(vh);
    }
    smelt_plan_destroy(plan);
  }
}

/* The CUDA context when its device is an sm_90 (the Hopper kernels'), else
 * NULL and why not. */
static smelt_ctx *hopper_ctx(const char **why) {
  smelt_ctx *ctx = th_cuda();
  smelt_device_info di;
  *why = "no CUDA device";
  if (!ctx) return NULL;
  *why = "not an sm_90 device";
  if (smelt_device_info_get(smelt_ctx_device_index(ctx), &di) != SMELT_OK || di.cc_major != 9 || di.cc_minor != 0)
    return NULL;
  return ctx;
}

/* The Hopper backward (kernels/attn_bwd_sm90.cu: D 128 on cc 9.0, the
 * atomic mode): the plan must name it, and its cases cut every edge of
 * its tiles (128 keys, 64 queries): several of each, causal with Sq != Sk
 * both ways (fully masked rows), GQA 2 and 8, a two-sided window with a
 * negative scale, ragged ends, padded and head-major layouts, varlen with
 * empty sequences. Deterministic mode (test_deterministic) stays on the
 * mma.sync kernel and is compared with this one there. */
static void test_values_hopper_bwd(void) {
  const char *why;
  smelt_ctx *ctx = hopper_ctx(&why);
  if (!ctx) SKIP(why);
  static const acase cases[] = {
      {2, 300, 300, 4, 2, 128, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
      {1, 130, 400, 2, 1, 128, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED},
      {1, 400, 130, 2, 2, 128, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_HEADMAJOR},
      {1, 257, 257, 8, 1, 128, 0, 70, 10, -0.15f, 0, NSEQ0, NSEQ0, LAY_PADDED},
      {4, 0, 0, 4, 2, 128, 0, -1, -1, 0, 1, {1, 200, 0, 65}, {130, 129, 9, 0}, LAY_CONTIG},
      {3, 0, 0, 2, 1, 128, 1, -1, -1, 0, 1, {64, 129, 300}, {64, 250, 300}, LAY_HEADMAJOR},
  };
  bwd_env e;
  bwd_env_new(&e, ctx, SMELT_DTYPE_BF16, &cases[0]);
  smelt_attention_desc d = desc_of(&e.c, &e.g);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_attention_bwd_plan(ctx, &d, &e.q, &e.k, &e.v, &e.o, &e.d_o, &e.lse, &e.dq, &e.dk, &e.dv, &plan));
  if (plan && !strstr(smelt_plan_describe(plan), "attn_bwd_sm90"))
    th_fail(__FILE__, __LINE__, "the D 128 backward on sm_90 took %s", smelt_plan_describe(plan));
  smelt_plan_destroy(plan);
  bwd_env_free(&e);
  static const smelt_dtype dts[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (int t = 0; t < 2; t++) run_case(ctx, dts[t], &cases[i], 1);
}

/* The Hopper forward's three schedules (desc.fwd_schedule TILES,
 * PERSISTENT, DYNAMIC: kernels/attn_fwd_sm90.cu with ATTN_PERSISTENT 0, 1,
 * 2), each forced whatever the mask (the default picks by it): the
 * forward cases of the head dims it has (64, 128) against the CPU
 * reference as in run_case, and cases with more query tiles than SMs, so
 * that a CTA walks several tiles (the K/V ring's and Q's phases running
 * on across them), causal (longest first) and full, and varlen with
 * sequences past their end and without keys (tiles skipped, tiles of
 * zeros between others). */
static void test_values_fwd_persistent(void) {
  const char *why;
  smelt_ctx *ctx = hopper_ctx(&why);
  if (!ctx) SKIP(why);
  const acase *c0 = &small_cases[2];
  bwd_env e;
  bwd_env_new(&e, ctx, SMELT_DTYPE_BF16, c0);
  smelt_attention_desc d = desc_of(&e.c, &e.g);
  smelt_plan *plan = NULL;
  /* The end of the kernel's name each schedule must plan (c0 is D 64:
   * attn_fwd_sm90_bf16_d64_n128_c3_s4 with one CTA per tile). */
  static const smelt_attention_schedule scheds[3] = {
      SMELT_ATTENTION_SCHEDULE_TILES, SMELT_ATTENTION_SCHEDULE_PERSISTENT, SMELT_ATTENTION_SCHEDULE_DYNAMIC};
  static const char *const names[3] = {"_s4 (", "_s4_persistent (", "_s4_dynamic ("};
  for (int sc = 0; sc < 3; sc++) {
    d.fwd_schedule = scheds[sc];
    CHECK_OK(smelt_attention_fwd_plan(ctx, &d, &e.q, &e.k, &e.v, &e.o, &e.lse, &plan));
    if (plan && (!strstr(smelt_plan_describe(plan), "attn_fwd_sm90") || !strstr(smelt_plan_describe(plan), names[sc])))
      th_fail(__FILE__, __LINE__, "fwd_schedule %d on sm_90 took %s", (int)scheds[sc], smelt_plan_describe(plan));
    smelt_plan_destroy(plan);
    plan = NULL;
  }
  bwd_env_free(&e);
  static const smelt_dtype dts[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16};
  static const acase cases[] = {
      {2, 65, 200, 2, 2, 128, 0, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_PADDED},
      {1, 200, 200, 4, 1, 128, 1, 64, -1, 0, 0, NSEQ0, NSEQ0, LAY_HEADMAJOR},
      {3, 0, 0, 4, 2, 128, 1, -1, -1, 0, 1, {0, 90, 33}, {17, 150, 33}, LAY_CONTIG},
      {1, 257, 257, 8, 1, 128, 0, 70, 10, -0.15f, 0, NSEQ0, NSEQ0, LAY_PADDED},
      {1, 1000, 1000, 2, 1, 64, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
      /* more tiles than SMs: 240 causal, 240 full (Sq < Sk), 320 varlen */
      {3, 600, 600, 16, 4, 128, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
      {2, 300, 500, 40, 8, 128, 0, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_HEADMAJOR},
      {5, 0, 0, 16, 2, 64, 1, -1, -1, 0, 1, {600, 1, 0, 333, 257}, {600, 5, 3, 0, 300}, LAY_PADDED},
  };
  /* The small cases in both dtypes on every schedule; the larger ones,
   * whose CPU reference dominates the suite's time, on the two persistent
   * schedules only (every other test runs the tile-per-CTA one), in one
   * dtype each. */
  for (int sc = 0; sc < 3; sc++) {
    fwd_schedule = scheds[sc];
    for (size_t i = 0; i < sizeof small_cases / sizeof *small_cases; i++)
      for (int t = 0; t < 2; t++) run_case(ctx, dts[t], &small_cases[i], 0);
    if (sc == 0) continue;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) run_case(ctx, dts[sc - 1], &cases[i], 0);
  }
  fwd_schedule = SMELT_ATTENTION_SCHEDULE_AUTO;
}

/* O's and LSE's bytes after a forward of e's inputs into its o and lse
 * buffers, poisoned first (a tile left out stays poison). plan: run on it,
 * else plan and run once. */
static uint8_t *fwd_bytes(bwd_env *e, smelt_ctx *ctx, smelt_plan *plan, size_t *n) {
  const size_t a = (size_t)e->lq.storage * smelt_dtype_size(e->dt), b = (size_t)e->ll.storage * 4;
  uint8_t *h = (uint8_t *)malloc(a + b + 1);
  memset(h, 0xFF, a + b);
  th_buf_upload(&e->b[3], h, a);
  th_buf_upload(&e->b[5], h + a, b);
  const smelt_attention_desc d = desc_of(&e->c, &e->g);
  smelt_status s;
  if (plan)
    s = e->c.varlen ? smelt_attention_varlen_fwd_run(plan, &e->q, &e->k, &e->v, &e->cq, &e->ck, &e->o, &e->lse)
                    : smelt_attention_fwd_run(plan, &e->q, &e->k, &e->v, &e->o, &e->lse);
  else
    s = e->c.varlen ? smelt_attention_varlen_fwd(ctx, &d, &e->q, &e->k, &e->v, &e->cq, &e->ck, &e->o, &e->lse)
                    : smelt_attention_fwd(ctx, &d, &e->q, &e->k, &e->v, &e->o, &e->lse);
  if (s) th_fail(__FILE__, __LINE__, "forward: %s (%s)", smelt_status_name(s), smelt_last_error());
  th_buf_download(&e->b[3], h, a);
  th_buf_download(&e->b[5], h + a, b);
  *n = a + b;
  return h;
}

/* The persistent schedules change which CTA computes a tile, never how:
 * O and LSE equal the one-CTA-per-tile schedule's bit for bit. Cases too
 * large for the CPU reference: many tiles per SM, causal with several
 * groups of heads (GQA 4), full with Sq != Sk, a sliding window, varlen
 * with empty and key-less sequences; one plan of each run three times
 * (the dynamic one's counter must count from 0 at every launch). */
static void test_fwd_schedules_bitwise(void) {
  const char *why;
  smelt_ctx *ctx = hopper_ctx(&why);
  if (!ctx) SKIP(why);
  static const acase cases[] = {
      {4, 1024, 1024, 16, 4, 128, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
      {2, 3000, 3000, 8, 8, 64, 1, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_HEADMAJOR},
      {3, 700, 900, 12, 3, 128, 0, -1, -1, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
      {2, 2000, 2000, 8, 2, 64, 0, 300, 0, 0, 0, NSEQ0, NSEQ0, LAY_CONTIG},
      {6, 0, 0, 16, 2, 128, 1, -1, -1, 0, 1, {1000, 0, 1, 700, 129, 2500}, {1000, 5, 0, 900, 129, 2500}, LAY_CONTIG},
      {5, 0, 0, 12, 4, 64, 1, -1, -1, 0, 1, {2000, 0, 64, 1, 777}, {2000, 0, 0, 300, 777}, LAY_CONTIG},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const smelt_dtype dt = i % 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16;
    bwd_env e;
    bwd_env_new(&e, ctx, dt, &cases[i]);
    char what[320];
    case_text(&cases[i], ctx, dt, what, sizeof what);
    fwd_schedule = SMELT_ATTENTION_SCHEDULE_TILES;
    size_t n = 0, m = 0;
    uint8_t *want = fwd_bytes(&e, ctx, NULL, &n);
    static const smelt_attention_schedule scheds[2] = {SMELT_ATTENTION_SCHEDULE_PERSISTENT,
                                                       SMELT_ATTENTION_SCHEDULE_DYNAMIC};
    static const char *const sched_names[2] = {"persistent", "dynamic"};
    for (int sc = 0; sc < 2; sc++) {
      fwd_schedule = scheds[sc];
      const smelt_attention_desc d = desc_of(&e.c, &e.g);
      smelt_plan *plan = NULL;
      CHECK_OK(e.c.varlen
                   ? smelt_attention_varlen_fwd_plan(ctx, &d, &e.q, &e.k, &e.v, &e.cq, &e.ck, &e.o, &e.lse, &plan)
                   : smelt_attention_fwd_plan(ctx, &d, &e.q, &e.k, &e.v, &e.o, &e.lse, &plan));
      if (plan && !strstr(smelt_plan_describe(plan), sched_names[sc]))
        th_fail(__FILE__, __LINE__, "%s: the %s schedule took %s", what, sched_names[sc], smelt_plan_describe(plan));
      for (int r = 0; r < 3 && plan; r++) {
        uint8_t *got = fwd_bytes(&e, ctx, plan, &m);
        size_t at = 0;
        while (at < n && got[at] == want[at]) at++;
        if (m != n || at < n)
          th_fail(__FILE__, __LINE__, "%s: run %d of the %s schedule differs from the tiles schedule at byte %zu of %zu",
                  what, r, sched_names[sc], at, n);
        free(got);
      }
      smelt_plan_destroy(plan);
    }
    free(want);
    bwd_env_free(&e);
  }
  fwd_schedule = SMELT_ATTENTION_SCHEDULE_AUTO;
}

/* Empty batches and sequences plan and run; no keys means O = 0, LSE = +inf,
 * dq = 0. */
static void test_empty(void) {
  FOR_EACH_BACKEND(ctx) {
    const smelt_dtype dt = is_cuda(ctx) ? SMELT_DTYPE_BF16 : SMELT_DTYPE_F32;
    const size_t es = smelt_dtype_size(dt);
    const int64_t qs[4] = {2, 3, 2, 64}, ks0[4] = {2, 0, 1, 64}, ls[3] = {2, 2, 3};
    th_buf qb = th_buf_new(ctx, 2 * 3 * 2 * 64 * es), ob = th_buf_new(ctx, 2 * 3 * 2 * 64 * es),
           lb = th_buf_new(ctx, 12 * 4), dqb = th_buf_new(ctx, 2 * 3 * 2 * 64 * es), dob = th_buf_new(ctx, 2 * 3 * 2 * 64 * es);
    uint8_t *h = (uint8_t *)malloc(2 * 3 * 2 * 64 * es);
    th_fill_uniform(h, dt, 2 * 3 * 2 * 64, -1, 1);
    th_buf_upload(&qb, h, 2 * 3 * 2 * 64 * es);
    th_buf_upload(&dob, h, 2 * 3 * 2 * 64 * es);
    const smelt_device_kind dk = smelt_ctx_device(ctx);
    const int di = smelt_ctx_device_index(ctx);
    smelt_tensor q = smelt_tensor_make(qb.data, dt, dk, di, 4, qs), o = smelt_tensor_make(ob.data, dt, dk, di, 4, qs);
    smelt_tensor k = smelt_tensor_make(NULL, dt, dk, di, 4, ks0), lse = smelt_tensor_make(lb.data, SMELT_DTYPE_F32, dk, di, 3, ls);
    smelt_tensor dq = smelt_tensor_make(dqb.data, dt, dk, di, 4, qs), d_o = smelt_tensor_make(dob.data, dt, dk, di, 4, qs);
    smelt_attention_desc desc = smelt_attention_desc_default();
    desc.causal = 1;
    CHECK_OK(smelt_attention_fwd(ctx, &desc, &q, &k, &k, &o, &lse));
    double *got = (double *)malloc(2 * 3 * 2 * 64 * 8);
    const int64_t on = 2 * 3 * 2 * 64;
    tlay lo, ll;
    static const int o4[4] = {0, 1, 2, 3}, o3[3] = {0, 1, 2};
    lo = lay_make(4, qs, o4, 0, 0);
    ll = lay_make(3, ls, o3, 0, 0);
    th_check_output("attention Sk=0", "o", &lo, &ob, dt, got);
    int64_t bad = -1;
    for (int64_t i = 0; i < on && bad < 0; i++)
      if (got[i] != 0) bad = i;
    if (bad >= 0) th_fail(__FILE__, __LINE__, "Sk=0: o[%lld]=%g, want 0", (long long)bad, got[bad]);
    th_check_output("attention Sk=0", "lse", &ll, &lb, SMELT_DTYPE_F32, got);
    for (int64_t i = 0; i < 12; i++)
      if (got[i] != INFINITY) th_fail(__FILE__, __LINE__, "Sk=0: lse[%lld]=%g, want +inf", (long long)i, got[i]);
    /* dk and dv are empty views: they hold nothing and so overlap nothing. */
    smelt_tensor dk0 = k, dv0 = k;
    CHECK_OK(smelt_attention_bwd(ctx, &desc, &q, &k, &k, &o, &d_o, &lse, &dq, &dk0, &dv0));
    th_check_output("attention Sk=0", "dq", &lo, &dqb, dt, got);
    for (int64_t i = 0; i < on; i++)
      if (got[i] != 0) {
        th_fail(__FILE__, __LINE__, "Sk=0: dq[%lld]=%g, want 0", (long long)i, got[i]);
        break;
      }
    /* No batch, no queries, no rows at all (varlen): nothing to do. */
    const int64_t q0[4] = {0, 3, 2, 64}, q1[4] = {2, 0, 2, 64}, l0[3] = {0, 2, 3}, l1[3] = {2, 2, 0};
    smelt_tensor eq = smelt_tensor_make(NULL, dt, dk, di, 4, q0), el = smelt_tensor_make(NULL, SMELT_DTYPE_F32, dk, di, 3, l0);
    CHECK_OK(smelt_attention_fwd(ctx, &desc, &eq, &eq, &eq, &eq, &el));
    eq = smelt_tensor_make(NULL, dt, dk, di, 4, q1);
    el = smelt_tensor_make(NULL, SMELT_DTYPE_F32, dk, di, 3, l1);
    smelt_tensor ek = smelt_tensor_make(qb.data, dt, dk, di, 4, qs);
    CHECK_OK(smelt_attention_fwd(ctx, &desc, &eq, &ek, &ek, &eq, &el));
    const int64_t vq[3] = {0, 2, 64}, vl[2] = {2, 0}, cs[1] = {3};
    int32_t zeros[3] = {0, 0, 0};
    th_buf cb = th_buf_new(ctx, 12);
    th_buf_upload(&cb, zeros, 12);
    smelt_tensor vqt = smelt_tensor_make(NULL, dt, dk, di, 3, vq), vlt = smelt_tensor_make(NULL, SMELT_DTYPE_F32, dk, di, 2, vl);
    smelt_tensor cu = smelt_tensor_make(cb.data, SMELT_DTYPE_I32, dk, di, 1, cs);
    CHECK_OK(smelt_attention_varlen_fwd(ctx, &desc, &vqt, &vqt, &vqt, &cu, &cu, &vqt, &vlt));
    CHECK_OK(smelt_attention_varlen_bwd(ctx, &desc, &vqt, &vqt, &vqt, &cu, &cu, &vqt, &vqt, &vlt, &vqt, &vqt, &vqt));
    th_buf_free(&cb);
    free(got);
    free(h);
    th_buf_free(&qb);
    th_buf_free(&ob);
    th_buf_free(&lb);
    th_buf_free(&dqb);
    th_buf_free(&dob);
  }
}

/* ---------------------------------------------------------------- bad inputs */

/* A small valid setup on one context: B 1, Sq 3, Sk 4, H 2, Hk 1, D 64
 * (f32 on the CPU, bf16 on CUDA), contiguous. The same buffers serve the
 * varlen calls as [rows, heads, D]. Outputs (o, lse, dq, dk, dv) are
 * poisoned and must stay so through every failing call. */
typedef struct bad_env {
  smelt_ctx *ctx;
  smelt_dtype dt;
  th_buf b[13];
  smelt_tensor q, k, v, o, lse, oi, li, d_o, dq, dk, dv, cq, ck; /* oi, li: o and lse as backward inputs */
  smelt_tensor vq, vk, vv, vo, vlse, voi, vli, vdo, vdq, vdk, vdv;
} bad_env;

enum { BO, BL, BDQ, BDK, BDV }; /* the output buffers, b[0..4] */

static bad_env bad_env_new(smelt_ctx *ctx) {
  bad_env e;
  memset(&e, 0, sizeof e);
  e.ctx = ctx;
  e.dt = is_cuda(ctx) ? SMELT_DTYPE_BF16 : SMELT_DTYPE_F32;
  const size_t es = smelt_dtype_size(e.dt);
  const int64_t qs[4] = {1, 3, 2, 64}, ks[4] = {1, 4, 1, 64}, ls[3] = {1, 2, 3};
  const int64_t nq = 3 * 2 * 64, nk = 4 * 64;
  e.b[BO] = th_buf_new(ctx, (size_t)nq * es);
  e.b[BL] = th_buf_new(ctx, 6 * 4);
  e.b[BDQ] = th_buf_new(ctx, (size_t)nq * es);
  e.b[BDK] = th_buf_new(ctx, (size_t)nk * es);
  e.b[BDV] = th_buf_new(ctx, (size_t)nk * es);
  const int64_t sizes[6] = {nq, nk, nk, nq, nq, 6};
  for (int i = 0; i < 6; i++) { /* q, k, v, o input, d_o, lse input */
    const smelt_dtype dt = i == 5 ? SMELT_DTYPE_F32 : e.dt;
    uint8_t *h = (uint8_t *)malloc((size_t)sizes[i] * smelt_dtype_size(dt));
    th_fill_uniform(h, dt, sizes[i], 1, 2);
    e.b[5 + i] = th_buf_new(ctx, (size_t)sizes[i] * smelt_dtype_size(dt));
    th_buf_upload(&e.b[5 + i], h, (size_t)sizes[i] * smelt_dtype_size(dt));
    free(h);
  }
  const smelt_device_kind dk = smelt_ctx_device(ctx);
  const int di = smelt_ctx_device_index(ctx);
  e.q = smelt_tensor_make(e.b[5].data, e.dt, dk, di, 4, qs);
  e.k = smelt_tensor_make(e.b[6].data, e.dt, dk, di, 4, ks);
  e.v = smelt_tensor_make(e.b[7].data, e.dt, dk, di, 4, ks);
  e.oi = smelt_tensor_make(e.b[8].data, e.dt, dk, di, 4, qs);
  e.d_o = smelt_tensor_make(e.b[9].data, e.dt, dk, di, 4, qs);
  e.li = smelt_tensor_make(e.b[10].data, SMELT_DTYPE_F32, dk, di, 3, ls);
  e.o = smelt_tensor_make(e.b[BO].data, e.dt, dk, di, 4, qs);
  e.lse = smelt_tensor_make(e.b[BL].data, SMELT_DTYPE_F32, dk, di, 3, ls);
  e.dq = smelt_tensor_make(e.b[BDQ].data, e.dt, dk, di, 4, qs);
  e.dk = smelt_tensor_make(e.b[BDK].data, e.dt, dk, di, 4, ks);
  e.dv = smelt_tensor_make(e.b[BDV].data, e.dt, dk, di, 4, ks);
  int64_t q0[2] = {0, 3}, k0[2] = {0, 4};
  e.b[11] = cu_upload(ctx, q0, 1, &e.cq);
  e.b[12] = cu_upload(ctx, k0, 1, &e.ck);
  /* varlen views: drop the batch dim ([1, S, h, D] -> [S, h, D]), lse [1, H, S] -> [H, S]. */
  smelt_tensor *from[11] = {&e.q, &e.k, &e.v, &e.o, &e.lse, &e.oi, &e.li, &e.d_o, &e.dq, &e.dk, &e.dv};
  smelt_tensor *to[11] = {&e.vq, &e.vk, &e.vv, &e.vo, &e.vlse, &e.voi, &e.vli, &e.vdo, &e.vdq, &e.vdk, &e.vdv};
  for (int i = 0; i < 11; i++) {
    *to[i] = *from[i];
    to[i]->ndim--;
    for (int d = 0; d < to[i]->ndim; d++) {
      to[i]->shape[d] = from[i]->shape[d + 1];
      to[i]->strides[d] = from[i]->strides[d + 1];
    }
  }
  return e;
}

static void bad_env_free(bad_env *e) {
  for (int i = 0; i < 13; i++) th_buf_free(&e->b[i]);
}

static int outputs_untouched(const bad_env *e) {
  for (int i = BO; i <= BDV; i++)
    if (!th_buf_untouched(&e->b[i])) return 0;
  return 1;
}

/* The status, both fragments in the message, and nothing written. */
#define CHECK_REJECT(call, want, frag1, frag2) \
  do {                                         \
    CHECK_STATUS(call, want);                  \
    CHECK_MSG(frag1);                          \
    CHECK_MSG(frag2);                          \
    CHECK(outputs_untouched(&e));              \
  } while (0)

/* Mutations of a valid tensor every entry point rejects (tensor checks). */
enum { M_NDIM9, M_NEG, M_MISALIGNED, M_NULLDATA, M_COUNT };
static const struct {
  const char *msg;
  smelt_status want;
} mutations[M_COUNT] = {
    {".ndim=9", SMELT_STATUS_INVALID_ARGUMENT},
    {".shape[0]=-1", SMELT_STATUS_INVALID_ARGUMENT},
    {".data", SMELT_STATUS_MISALIGNED},
    {".data is NULL", SMELT_STATUS_NULL_POINTER},
};

static smelt_tensor mutate(smelt_tensor t, int m) {
  switch (m) {
    case M_NDIM9: t.ndim = 9; break;
    case M_NEG: t.shape[0] = -1; break;
    case M_MISALIGNED: t.data = (uint8_t *)t.data + 1; break;
    case M_NULLDATA: t.data = NULL; break;
  }
  return t;
}

static void test_fwd_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    bad_env e = bad_env_new(ctx);
    const smelt_attention_desc dd = smelt_attention_desc_default();
    const smelt_attention_desc *d = &dd;
    smelt_plan *plan = (smelt_plan *)&e; /* must be reset to NULL on failure */
    CHECK_REJECT(smelt_attention_fwd_plan(NULL, d, &e.q, &e.k, &e.v, &e.o, &e.lse, &plan), SMELT_STATUS_NULL_POINTER,
                 "smelt_attention_fwd", "ctx is NULL");
    CHECK(plan == NULL);
    CHECK_REJECT(smelt_attention_fwd_plan(ctx, d, &e.q, &e.k, &e.v, &e.o, &e.lse, NULL), SMELT_STATUS_NULL_POINTER,
                 "smelt_attention_fwd", "out is NULL");
    CHECK_REJECT(smelt_attention_fwd(NULL, d, &e.q, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_NULL_POINTER,
                 "smelt_attention_fwd", "ctx");
    CHECK_REJECT(smelt_attention_fwd(ctx, d, NULL, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_NULL_POINTER, "q is NULL", "fwd");
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, NULL, &e.v, &e.o, &e.lse), SMELT_STATUS_NULL_POINTER, "k is NULL", "fwd");
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, NULL, &e.o, &e.lse), SMELT_STATUS_NULL_POINTER, "v is NULL", "fwd");
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &e.v, NULL, &e.lse), SMELT_STATUS_NULL_POINTER, "o is NULL", "fwd");
    for (int m = 0; m < M_COUNT; m++) {
      smelt_tensor bq = mutate(e.q, m), bk = mutate(e.k, m), bo = mutate(e.o, m), bl = mutate(e.lse, m);
      CHECK_REJECT(smelt_attention_fwd(ctx, d, &bq, &e.k, &e.v, &e.o, &e.lse), mutations[m].want, "q", mutations[m].msg);
      CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &bk, &e.v, &e.o, &e.lse), mutations[m].want, "k", mutations[m].msg);
      CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &e.v, &bo, &e.lse), mutations[m].want, "o", mutations[m].msg);
      CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &e.v, &e.o, &bl), mutations[m].want, "lse", mutations[m].msg);
    }
    smelt_tensor t = e.q, t2;
    t.dtype = SMELT_DTYPE_I32;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &t, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_DTYPE_MISMATCH,
                 "q.dtype=i32 is not supported", "f16, bf16");
    t = e.k;
    t.dtype = e.dt == SMELT_DTYPE_F32 ? SMELT_DTYPE_F64 : SMELT_DTYPE_F16;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &t, &e.o, &e.lse), SMELT_STATUS_DTYPE_MISMATCH, "v.dtype=",
                 "must equal q.dtype");
    t = e.lse;
    t.dtype = SMELT_DTYPE_F16;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &e.v, &e.o, &t), SMELT_STATUS_DTYPE_MISMATCH, "lse.dtype=f16",
                 "must be f32");
    t = e.q;
    t.ndim = 3;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &t, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_SHAPE_MISMATCH, "q.ndim=3",
                 "[B, S, heads, D]");
    t = e.k;
    t.shape[3] = 32;
    t2 = t;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &t, &t2, &e.o, &e.lse), SMELT_STATUS_SHAPE_MISMATCH,
                 "k.shape[3]=32", "head dim D=64");
    t = e.k;
    t.shape[0] = 2;
    t2 = t;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &t, &t2, &e.o, &e.lse), SMELT_STATUS_SHAPE_MISMATCH, "k.shape[0]=2",
                 "q.shape[0] (B)=1");
    smelt_tensor k3 = e.k;
    k3.shape[1] = 1;
    k3.shape[2] = 3; /* 3 kv heads of one key each: same memory */
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &k3, &k3, &e.o, &e.lse), SMELT_STATUS_SHAPE_MISMATCH,
                 "q.shape[2]=2 (heads H) must be a multiple of k.shape[2]=3", "Hk");
    t = e.v;
    t.shape[1] = 3;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &t, &e.o, &e.lse), SMELT_STATUS_SHAPE_MISMATCH,
                 "v.shape=[1, 3, 1, 64]", "k.shape=[1, 4, 1, 64]");
    t = e.o;
    t.shape[1] = 2;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &e.v, &t, &e.lse), SMELT_STATUS_SHAPE_MISMATCH,
                 "o.shape=[1, 2, 2, 64]", "q.shape=[1, 3, 2, 64]");
    t = e.lse;
    t.shape[2] = 4;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &e.v, &e.o, &t), SMELT_STATUS_SHAPE_MISMATCH,
                 "lse.shape=[1, 2, 4]", "[B, H, Sq]=[1, 2, 3]");
    t = e.q;
    t.shape[3] = 32;
    t.strides[3] = 2;
    t2 = e.k;
    t2.shape[3] = 32;
    smelt_tensor o2 = e.o;
    o2.shape[3] = 32;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &t, &t2, &t2, &o2, NULL), SMELT_STATUS_BAD_LAYOUT, "q.strides[3]=2",
                 "unit stride along D");
    smelt_attention_desc bd = dd;
    bd.scale = NAN;
    CHECK_REJECT(smelt_attention_fwd(ctx, &bd, &e.q, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_INVALID_ARGUMENT,
                 "desc->scale=nan", "finite");
    bd = dd;
    bd.window_left = -2;
    CHECK_REJECT(smelt_attention_fwd(ctx, &bd, &e.q, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_INVALID_ARGUMENT,
                 "desc->window_left=-2", ">= -1");
    bd = dd;
    bd.fwd_schedule = (smelt_attention_schedule)7;
    CHECK_REJECT(smelt_attention_fwd(ctx, &bd, &e.q, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_INVALID_ARGUMENT,
                 "desc->fwd_schedule=7", "PERSISTENT");
    t = e.o;
    t.data = e.q.data;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &e.v, &t, &e.lse), SMELT_STATUS_INVALID_ARGUMENT,
                 "o overlaps q", "must not");
    t = e.lse;
    t.data = e.o.data;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &e.v, &e.o, &t), SMELT_STATUS_INVALID_ARGUMENT,
                 "lse overlaps o", "must not");
    t = e.o;
    t.strides[1] = 0;
    CHECK_REJECT(smelt_attention_fwd(ctx, d, &e.q, &e.k, &e.v, &t, &e.lse), SMELT_STATUS_BAD_LAYOUT, "o.strides=",
                 "distinct");
    if (is_cuda(ctx)) {
      t = e.q;
      t.device = SMELT_DEVICE_CPU;
      t.device_index = 0;
      CHECK_REJECT(smelt_attention_fwd(ctx, d, &t, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_WRONG_DEVICE, "q is on cpu",
                   "cuda");
    }
    /* Runs: a NULL or foreign plan, tensors other than the planned ones. */
    CHECK_REJECT(smelt_attention_fwd_run(NULL, &e.q, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_NULL_POINTER,
                 "smelt_attention_fwd_run", "plan is NULL");
    smelt_tensor sx = e.oi, sy = e.o;
    sx.dtype = sy.dtype = SMELT_DTYPE_F32;
    smelt_plan *sp = NULL;
    if (!is_cuda(ctx)) {
      CHECK_OK(smelt_softmax_plan(ctx, &sx, &sy, NULL, &sp));
      CHECK_REJECT(smelt_attention_fwd_run(sp, &e.q, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_INVALID_ARGUMENT,
                   "not a smelt_attention_fwd plan", "another op");
      smelt_plan_destroy(sp);
    }
    CHECK_OK(smelt_attention_bwd_plan(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, &e.dv, &sp));
    CHECK_REJECT(smelt_attention_fwd_run(sp, &e.q, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_INVALID_ARGUMENT,
                 "not a smelt_attention_fwd plan", "smelt_attention_bwd");
    smelt_plan_destroy(sp);
    CHECK_OK(smelt_attention_fwd_plan(ctx, d, &e.q, &e.k, &e.v, &e.o, &e.lse, &plan));
    REQUIRE(plan);
    CHECK_REJECT(smelt_attention_fwd_run(plan, &e.q, &e.k, &e.v, &e.o, NULL), SMELT_STATUS_NULL_POINTER, "lse is NULL",
                 "plan was made with one");
    CHECK_REJECT(smelt_attention_fwd_run(plan, NULL, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_NULL_POINTER, "q is NULL",
                 "fwd");
    t = e.q;
    t.shape[1] = 2;
    CHECK_REJECT(smelt_attention_fwd_run(plan, &t, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_SHAPE_MISMATCH,
                 "q.shape=[1, 2, 2, 64]", "planned");
    t = e.k;
    t.strides[1] = 128;
    CHECK_REJECT(smelt_attention_fwd_run(plan, &e.q, &t, &e.v, &e.o, &e.lse), SMELT_STATUS_BAD_LAYOUT,
                 "k.strides[1]=128", "planned");
    t = e.o;
    t.data = e.q.data;
    CHECK_REJECT(smelt_attention_fwd_run(plan, &e.q, &e.k, &e.v, &t, &e.lse), SMELT_STATUS_INVALID_ARGUMENT,
                 "o overlaps q", "must not");
    t = mutate(e.o, M_NULLDATA);
    CHECK_REJECT(smelt_attention_fwd_run(plan, &e.q, &e.k, &e.v, &t, &e.lse), SMELT_STATUS_NULL_POINTER, "o.data",
                 "NULL");
    smelt_plan_destroy(plan);
    CHECK_OK(smelt_attention_fwd_plan(ctx, NULL, &e.q, &e.k, &e.v, &e.o, NULL, &plan));
    CHECK_REJECT(smelt_attention_fwd_run(plan, &e.q, &e.k, &e.v, &e.o, &e.lse), SMELT_STATUS_INVALID_ARGUMENT, "lse",
                 "without");
    smelt_plan_destroy(plan);
    bad_env_free(&e);
  }
}

static void test_varlen_fwd_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    bad_env e = bad_env_new(ctx);
    smelt_attention_desc dd = smelt_attention_desc_default();
    dd.max_seqlen_q = 3;
    dd.max_seqlen_k = 4;
    const smelt_attention_desc *d = &dd;
    smelt_plan *plan = (smelt_plan *)&e;
    CHECK_REJECT(smelt_attention_varlen_fwd_plan(NULL, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse, &plan),
                 SMELT_STATUS_NULL_POINTER, "smelt_attention_varlen_fwd", "ctx is NULL");
    CHECK(plan == NULL);
    CHECK_REJECT(smelt_attention_varlen_fwd_plan(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse, NULL),
                 SMELT_STATUS_NULL_POINTER, "smelt_attention_varlen_fwd", "out is NULL");
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, NULL, &e.ck, &e.vo, &e.vlse),
                 SMELT_STATUS_NULL_POINTER, "cu_seqlens_q is NULL", "varlen");
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, NULL, &e.vo, &e.vlse),
                 SMELT_STATUS_NULL_POINTER, "cu_seqlens_k is NULL", "varlen");
    for (int m = 0; m < M_COUNT; m++) {
      smelt_tensor bc = mutate(e.cq, m);
      CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, &bc, &e.ck, &e.vo, &e.vlse),
                   mutations[m].want, "cu_seqlens_q", mutations[m].msg);
    }
    smelt_tensor t = e.cq;
    t.dtype = SMELT_DTYPE_I64;
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, &t, &e.ck, &e.vo, &e.vlse),
                 SMELT_STATUS_DTYPE_MISMATCH, "cu_seqlens_q.dtype=i64", "must be i32");
    t = e.ck;
    t.shape[0] = 1;
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &t, &e.vo, &e.vlse),
                 SMELT_STATUS_SHAPE_MISMATCH, "cu_seqlens_k.shape=[1]", "cu_seqlens_q.shape=[2]");
    smelt_tensor t0 = e.cq; /* batch 0 with rows: no sequence would own (and write) them */
    t0.shape[0] = 1;
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, &t0, &t, &e.vo, &e.vlse),
                 SMELT_STATUS_SHAPE_MISMATCH, "(batch 0) but q has 3", "must have 0");
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.q, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse),
                 SMELT_STATUS_SHAPE_MISMATCH, "q.ndim=4", "[rows, heads, D]");
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.lse),
                 SMELT_STATUS_SHAPE_MISMATCH, "lse.ndim=3", "[H, rows of q]");
    t = e.vlse;
    t.shape[1] = 2;
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &t),
                 SMELT_STATUS_SHAPE_MISMATCH, "lse.shape=[2, 2]", "[H, rows of q]=[2, 3]");
    smelt_attention_desc bd = dd;
    bd.max_seqlen_k = -1;
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, &bd, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse),
                 SMELT_STATUS_INVALID_ARGUMENT, "desc->max_seqlen_k=-1", ">= 0");
    bd = dd;
    bd.max_seqlen_q = 0;
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, &bd, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse),
                 SMELT_STATUS_INVALID_ARGUMENT, "desc->max_seqlen_q=0", "3 rows");
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, NULL, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse),
                 SMELT_STATUS_INVALID_ARGUMENT, "desc->max_seqlen_q=0", "longest");
    t = e.vv; /* v inside o's (larger) buffer: o overlaps v and nothing else */
    t.data = e.vo.data;
    CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &t, &e.cq, &e.ck, &e.vo, &e.vlse),
                 SMELT_STATUS_INVALID_ARGUMENT, "o overlaps v", "must not");
    if (!is_cuda(ctx)) {
      /* The CPU checks cu_seqlens' values (the GPU cannot without a sync). */
      int32_t *cq = (int32_t *)e.cq.data;
      cq[1] = 2;
      CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse),
                   SMELT_STATUS_INVALID_ARGUMENT, "cu_seqlens_q[1]=2", "q row count 3");
      cq[1] = 3;
      bd = dd;
      bd.max_seqlen_k = 3;
      CHECK_REJECT(smelt_attention_varlen_fwd(ctx, &bd, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse),
                   SMELT_STATUS_INVALID_ARGUMENT, "sequence 0 has 4 rows in cu_seqlens_k", "max_seqlen_k=3");
      cq[0] = 1;
      CHECK_REJECT(smelt_attention_varlen_fwd(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse),
                   SMELT_STATUS_INVALID_ARGUMENT, "cu_seqlens_q[0]=1", "must be 0");
      cq[0] = 0;
    }
    CHECK_REJECT(smelt_attention_varlen_fwd_run(NULL, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse),
                 SMELT_STATUS_NULL_POINTER, "smelt_attention_varlen_fwd_run", "plan is NULL");
    CHECK_OK(smelt_attention_fwd_plan(ctx, NULL, &e.q, &e.k, &e.v, &e.o, &e.lse, &plan));
    CHECK_REJECT(smelt_attention_varlen_fwd_run(plan, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse),
                 SMELT_STATUS_INVALID_ARGUMENT, "not a smelt_attention_varlen_fwd plan", "smelt_attention_fwd");
    smelt_plan_destroy(plan);
    CHECK_OK(smelt_attention_varlen_fwd_plan(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, &e.vlse, &plan));
    REQUIRE(plan);
    t = e.ck;
    t.strides[0] = 2;
    CHECK_REJECT(smelt_attention_varlen_fwd_run(plan, &e.vq, &e.vk, &e.vv, &e.cq, &t, &e.vo, &e.vlse),
                 SMELT_STATUS_BAD_LAYOUT, "cu_seqlens_k.strides[0]=2", "planned");
    CHECK_REJECT(smelt_attention_varlen_fwd_run(plan, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.vo, NULL),
                 SMELT_STATUS_NULL_POINTER, "lse is NULL", "plan");
    smelt_plan_destroy(plan);
    bad_env_free(&e);
  }
}

static void test_bwd_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    bad_env e = bad_env_new(ctx);
    const smelt_attention_desc dd = smelt_attention_desc_default();
    const smelt_attention_desc *d = &dd;
    smelt_plan *plan = (smelt_plan *)&e;
    CHECK_REJECT(smelt_attention_bwd_plan(NULL, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, &e.dv, &plan),
                 SMELT_STATUS_NULL_POINTER, "smelt_attention_bwd", "ctx is NULL");
    CHECK(plan == NULL);
    CHECK_REJECT(smelt_attention_bwd_plan(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, &e.dv, NULL),
                 SMELT_STATUS_NULL_POINTER, "smelt_attention_bwd", "out is NULL");
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, NULL, &e.li, &e.dq, &e.dk, &e.dv),
                 SMELT_STATUS_NULL_POINTER, "d_o is NULL", "bwd");
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, NULL, &e.dq, &e.dk, &e.dv),
                 SMELT_STATUS_NULL_POINTER, "lse is NULL", "bwd");
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, NULL, &e.dk, &e.dv),
                 SMELT_STATUS_NULL_POINTER, "dq is NULL", "bwd");
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, NULL, &e.dv),
                 SMELT_STATUS_NULL_POINTER, "dk is NULL", "bwd");
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, NULL),
                 SMELT_STATUS_NULL_POINTER, "dv is NULL", "bwd");
    for (int m = 0; m < M_COUNT; m++) {
      smelt_tensor bdo = mutate(e.d_o, m), bdq = mutate(e.dq, m), bdv = mutate(e.dv, m);
      CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &bdo, &e.li, &e.dq, &e.dk, &e.dv),
                   mutations[m].want, "d_o", mutations[m].msg);
      CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &bdq, &e.dk, &e.dv),
                   mutations[m].want, "dq", mutations[m].msg);
      CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, &bdv),
                   mutations[m].want, "dv", mutations[m].msg);
    }
    smelt_tensor t = e.dk;
    t.dtype = e.dt == SMELT_DTYPE_F32 ? SMELT_DTYPE_F16 : SMELT_DTYPE_F16;
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &t, &e.dv),
                 SMELT_STATUS_DTYPE_MISMATCH, "dk.dtype=f16", "must equal q.dtype");
    t = e.li;
    t.dtype = SMELT_DTYPE_BF16;
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &t, &e.dq, &e.dk, &e.dv),
                 SMELT_STATUS_DTYPE_MISMATCH, "lse.dtype=bf16", "must be f32");
    t = e.dq;
    t.shape[2] = 1;
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &t, &e.dk, &e.dv),
                 SMELT_STATUS_SHAPE_MISMATCH, "dq.shape=[1, 3, 1, 64]", "q.shape=[1, 3, 2, 64]");
    t = e.d_o;
    t.shape[1] = 1;
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &t, &e.li, &e.dq, &e.dk, &e.dv),
                 SMELT_STATUS_SHAPE_MISMATCH, "d_o.shape=[1, 1, 2, 64]", "o.shape");
    t = e.dk;
    t.data = e.dq.data;
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &t, &e.dv),
                 SMELT_STATUS_INVALID_ARGUMENT, "dk overlaps dq", "must not");
    /* lse inside dv's buffer: dv then overlaps lse and nothing else (dv
     * moved onto lse's smaller buffer would also reach whatever the
     * allocator put after it). */
    t = e.li;
    t.data = e.dv.data;
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &t, &e.dq, &e.dk, &e.dv),
                 SMELT_STATUS_INVALID_ARGUMENT, "dv overlaps lse", "must not");
    t = e.dq;
    t.strides[2] = 0;
    CHECK_REJECT(smelt_attention_bwd(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &t, &e.dk, &e.dv),
                 SMELT_STATUS_BAD_LAYOUT, "dq.strides=", "distinct");
    CHECK_REJECT(smelt_attention_bwd_run(NULL, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, &e.dv),
                 SMELT_STATUS_NULL_POINTER, "smelt_attention_bwd_run", "plan is NULL");
    CHECK_OK(smelt_attention_fwd_plan(ctx, d, &e.q, &e.k, &e.v, &e.o, &e.lse, &plan));
    CHECK_REJECT(smelt_attention_bwd_run(plan, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, &e.dv),
                 SMELT_STATUS_INVALID_ARGUMENT, "not a smelt_attention_bwd plan", "smelt_attention_fwd");
    smelt_plan_destroy(plan);
    CHECK_OK(smelt_attention_bwd_plan(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, &e.dv, &plan));
    REQUIRE(plan);
    t = e.dv;
    t.strides[1] = 32;
    t.shape[3] = 32;
    CHECK_REJECT(smelt_attention_bwd_run(plan, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, &t),
                 SMELT_STATUS_SHAPE_MISMATCH, "dv.shape=[1, 4, 1, 32]", "planned");
    t = e.dv;
    t.strides[1] = 32;
    t.shape[1] = 2;
    smelt_tensor tk = e.dk, tv = e.dv, kk = e.k;
    tk.shape[1] = tv.shape[1] = kk.shape[1] = 2;
    smelt_plan *p2 = NULL;
    CHECK_OK(smelt_attention_bwd_plan(ctx, d, &e.q, &kk, &kk, &e.oi, &e.d_o, &e.li, &e.dq, &tk, &tv, &p2));
    CHECK_REJECT(smelt_attention_bwd_run(p2, &e.q, &kk, &kk, &e.oi, &e.d_o, &e.li, &e.dq, &tk, &t),
                 SMELT_STATUS_BAD_LAYOUT, "dv.strides[1]=32", "planned");
    smelt_plan_destroy(p2);
    CHECK_REJECT(smelt_attention_bwd_run(plan, &e.q, &e.k, &e.v, &e.oi, &e.d_o, NULL, &e.dq, &e.dk, &e.dv),
                 SMELT_STATUS_NULL_POINTER, "lse is NULL", "plan");
    t = e.dq;
    t.data = e.d_o.data;
    CHECK_REJECT(smelt_attention_bwd_run(plan, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &t, &e.dk, &e.dv),
                 SMELT_STATUS_INVALID_ARGUMENT, "dq overlaps d_o", "must not");
    smelt_plan_destroy(plan);
    bad_env_free(&e);
  }
}

static void test_varlen_bwd_bad_inputs(void) {
  FOR_EACH_BACKEND(ctx) {
    bad_env e = bad_env_new(ctx);
    smelt_attention_desc dd = smelt_attention_desc_default();
    dd.max_seqlen_q = 3;
    dd.max_seqlen_k = 4;
    const smelt_attention_desc *d = &dd;
    smelt_plan *plan = (smelt_plan *)&e;
    CHECK_REJECT(smelt_attention_varlen_bwd_plan(NULL, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.voi, &e.vdo, &e.vli,
                                                 &e.vdq, &e.vdk, &e.vdv, &plan),
                 SMELT_STATUS_NULL_POINTER, "smelt_attention_varlen_bwd", "ctx is NULL");
    CHECK(plan == NULL);
    CHECK_REJECT(smelt_attention_varlen_bwd_plan(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.voi, &e.vdo, &e.vli,
                                                 &e.vdq, &e.vdk, &e.vdv, NULL),
                 SMELT_STATUS_NULL_POINTER, "smelt_attention_varlen_bwd", "out is NULL");
    CHECK_REJECT(smelt_attention_varlen_bwd(ctx, d, &e.vq, &e.vk, &e.vv, NULL, &e.ck, &e.voi, &e.vdo, &e.vli, &e.vdq,
                                            &e.vdk, &e.vdv),
                 SMELT_STATUS_NULL_POINTER, "cu_seqlens_q is NULL", "varlen_bwd");
    CHECK_REJECT(smelt_attention_varlen_bwd(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.voi, &e.vdo, &e.vli, &e.dq,
                                            &e.vdk, &e.vdv),
                 SMELT_STATUS_SHAPE_MISMATCH, "dq.ndim=4", "[rows, heads, D]");
    smelt_tensor t = e.vdv;
    t.shape[0] = 3;
    CHECK_REJECT(smelt_attention_varlen_bwd(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.voi, &e.vdo, &e.vli, &e.vdq,
                                            &e.vdk, &t),
                 SMELT_STATUS_SHAPE_MISMATCH, "dv.shape=[3, 1, 64]", "k.shape=[4, 1, 64]");
    t = e.cq;
    t.data = e.vdq.data;
    CHECK_REJECT(smelt_attention_varlen_bwd(ctx, d, &e.vq, &e.vk, &e.vv, &t, &e.ck, &e.voi, &e.vdo, &e.vli, &e.vdq,
                                            &e.vdk, &e.vdv),
                 SMELT_STATUS_INVALID_ARGUMENT, "dq overlaps cu_seqlens_q", "must not");
    CHECK_REJECT(smelt_attention_varlen_bwd_run(NULL, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.voi, &e.vdo, &e.vli,
                                                &e.vdq, &e.vdk, &e.vdv),
                 SMELT_STATUS_NULL_POINTER, "smelt_attention_varlen_bwd_run", "plan is NULL");
    CHECK_OK(smelt_attention_bwd_plan(ctx, d, &e.q, &e.k, &e.v, &e.oi, &e.d_o, &e.li, &e.dq, &e.dk, &e.dv, &plan));
    CHECK_REJECT(smelt_attention_varlen_bwd_run(plan, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.voi, &e.vdo, &e.vli,
                                                &e.vdq, &e.vdk, &e.vdv),
                 SMELT_STATUS_INVALID_ARGUMENT, "not a smelt_attention_varlen_bwd plan", "smelt_attention_bwd");
    smelt_plan_destroy(plan);
    CHECK_OK(smelt_attention_varlen_bwd_plan(ctx, d, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.voi, &e.vdo, &e.vli, &e.vdq,
                                             &e.vdk, &e.vdv, &plan));
    REQUIRE(plan);
    t = e.vk;
    t.shape[0] = 3;
    CHECK_REJECT(smelt_attention_varlen_bwd_run(plan, &e.vq, &t, &e.vv, &e.cq, &e.ck, &e.voi, &e.vdo, &e.vli, &e.vdq,
                                                &e.vdk, &e.vdv),
                 SMELT_STATUS_SHAPE_MISMATCH, "k.shape=[3, 1, 64]", "planned");
    /* A valid run writes the gradients (and nothing else). */
    CHECK_OK(smelt_attention_varlen_bwd_run(plan, &e.vq, &e.vk, &e.vv, &e.cq, &e.ck, &e.voi, &e.vdo, &e.vli, &e.vdq,
                                            &e.vdk, &e.vdv));
    CHECK(!th_buf_untouched(&e.b[BDQ]) && !th_buf_untouched(&e.b[BDK]) && !th_buf_untouched(&e.b[BDV]));
    CHECK(th_buf_untouched(&e.b[BO]) && th_buf_untouched(&e.b[BL]));
    smelt_plan_destroy(plan);
    bad_env_free(&e);
  }
}

/* What the CPU takes but the CUDA kernels do not: UNSUPPORTED or
 * DTYPE_MISMATCH with the supported set in the message. */
static void test_cuda_limits(void) {
  smelt_ctx *ctx = th_cuda();
  if (!ctx) SKIP("no CUDA device");
  bad_env e = bad_env_new(ctx);
  const smelt_attention_desc dd = smelt_attention_desc_default();
  const smelt_attention_desc *d = &dd;
  smelt_tensor q = e.q, k = e.k, o = e.o;
  q.dtype = k.dtype = o.dtype = SMELT_DTYPE_F32;
  CHECK_REJECT(smelt_attention_fwd(ctx, d, &q, &k, &k, &o, NULL), SMELT_STATUS_DTYPE_MISMATCH,
               "q.dtype=f32 is not supported on cuda", "f16, bf16");
  q = e.q;
  k = e.k;
  o = e.o;
  q.shape[3] = k.shape[3] = o.shape[3] = 48;
  CHECK_REJECT(smelt_attention_fwd(ctx, d, &q, &k, &k, &o, NULL), SMELT_STATUS_UNSUPPORTED, "D=48", "64, 96, 128, 256");
  smelt_tensor dq = e.dq, dk = e.dk, dv = e.dv, d_o = e.d_o, oi = e.oi;
  q = e.q;
  k = e.k;
  q.shape[3] = k.shape[3] = dq.shape[3] = dk.shape[3] = dv.shape[3] = d_o.shape[3] = oi.shape[3] = 32;
  CHECK_REJECT(smelt_attention_bwd(ctx, d, &q, &k, &k, &oi, &d_o, &e.li, &dq, &dk, &dv), SMELT_STATUS_UNSUPPORTED,
               "D=32", "64, 96, 128");
  q = e.q;
  q.shape[1] = 2;
  q.strides[1] = 132; /* rows 264 bytes apart: not a multiple of 16 */
  o = e.o;
  o.shape[1] = 2;
  smelt_tensor lse = e.lse;
  lse.shape[2] = 2;
  CHECK_REJECT(smelt_attention_fwd(ctx, d, &q, &e.k, &e.v, &o, &lse), SMELT_STATUS_UNSUPPORTED, "q.strides[1]=132",
               "16 bytes");
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_attention_fwd_plan(ctx, d, &e.q, &e.k, &e.v, &e.o, &e.lse, &plan));
  REQUIRE(plan);
  smelt_tensor k2 = e.k;
  k2.data = (uint8_t *)k2.data + 2;
  k2.shape[1] = 3; /* stays inside the buffer */
  smelt_tensor kk = e.k;
  kk.shape[1] = 3;
  smelt_plan *p3 = NULL;
  CHECK_OK(smelt_attention_fwd_plan(ctx, d, &e.q, &kk, &kk, &e.o, &e.lse, &p3));
  CHECK_REJECT(smelt_attention_fwd_run(p3, &e.q, &k2, &kk, &e.o, &e.lse), SMELT_STATUS_MISALIGNED, "k.data",
               "16 bytes");
  smelt_plan_destroy(p3);
  smelt_plan_destroy(plan);
  bad_env_free(&e);
}

/* Attention over empty tensors with a huge head dim, batch or head count
 * computes nothing, so it may neither allocate nor loop for them. The CPU
 * used to size its scratch by D alone (buffers of D doubles, 2^40 here) and
 * its sequence table by B, failing with OUT_OF_MEMORY, and visited every
 * head of an empty q (found by fuzz/). */
static void test_empty_huge_head_dim(void) {
  smelt_ctx *ctx = th_cpu();
  const int64_t D = (int64_t)1 << 40;
  float buf[1];
  smelt_tensor x = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 4, (int64_t[]){1, 0, 1, D});
  smelt_tensor lse = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){1, 1, 0});
  CHECK_OK(smelt_attention_fwd(ctx, NULL, &x, &x, &x, &x, &lse));
  CHECK_OK(smelt_attention_bwd(ctx, NULL, &x, &x, &x, &x, &x, &lse, &x, &x, &x));
  /* So does a batch of 2^40 empty sequences (its table of sequences was 2^40 entries). */
  smelt_tensor xb = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 4, (int64_t[]){D, 0, 1, 4});
  smelt_tensor lb = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){D, 1, 0});
  CHECK_OK(smelt_attention_fwd(ctx, NULL, &xb, &xb, &xb, &xb, &lb));
  /* And 2^40 heads without queries over one key: the CPU visited each head. */
  float kv[4] = {1, 2, 3, 4}, dkv[8];
  smelt_tensor qh = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 4, (int64_t[]){1, 0, D, 4});
  smelt_tensor kh = smelt_tensor_make(kv, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 4, (int64_t[]){1, 1, 1, 4});
  smelt_tensor dkh = smelt_tensor_make(dkv, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 4, (int64_t[]){1, 1, 1, 4});
  smelt_tensor dvh = smelt_tensor_make(dkv + 4, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 4, (int64_t[]){1, 1, 1, 4});
  smelt_tensor lh = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){1, D, 0});
  CHECK_OK(smelt_attention_fwd(ctx, NULL, &qh, &kh, &kh, &qh, &lh));
  for (int i = 0; i < 8; i++) dkv[i] = NAN;
  CHECK_OK(smelt_attention_bwd(ctx, NULL, &qh, &kh, &kh, &qh, &qh, &lh, &qh, &dkh, &dvh));
  for (int i = 0; i < 8; i++) CHECK(dkv[i] == 0);
  int32_t cu[1] = {0};
  smelt_tensor xv = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, (int64_t[]){0, 1, D});
  smelt_tensor lv = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){1, 0});
  smelt_tensor tc = smelt_tensor_make(cu, SMELT_DTYPE_I32, SMELT_DEVICE_CPU, 0, 1, (int64_t[]){1});
  smelt_attention_desc desc = smelt_attention_desc_default();
  CHECK_OK(smelt_attention_varlen_fwd(ctx, &desc, &xv, &xv, &xv, &tc, &tc, &xv, &lv));
}

const th_test th_tests_attention[] = {
    {"values_small", test_values_small},
    {"values_head_dims", test_values_head_dims},
    {"values_long", test_values_long},
    {"values_cpu_dtypes", test_values_cpu_dtypes},
    {"finite_differences", test_finite_differences},
    {"values_hopper_bwd", test_values_hopper_bwd},
    {"values_fwd_persistent", test_values_fwd_persistent},
    {"fwd_schedules_bitwise", test_fwd_schedules_bitwise},
    {"deterministic", test_deterministic},
    {"plan_reuse", test_plan_reuse},
    {"empty", test_empty},
    {"fwd_bad_inputs", test_fwd_bad_inputs},
    {"varlen_fwd_bad_inputs", test_varlen_fwd_bad_inputs},
    {"bwd_bad_inputs", test_bwd_bad_inputs},
    {"varlen_bwd_bad_inputs", test_varlen_bwd_bad_inputs},
    {"cuda_limits", test_cuda_limits},
    {"empty_huge_head_dim", test_empty_huge_head_dim},
    {0, 0},
};
