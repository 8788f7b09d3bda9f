/* MoE tests: the layer and its parts on the CPU backend against an oracle
 * written here in double from the definitions of smelt/moe.h (logits,
 * scores, group-limited top-k, weights, capacity under both policies, the
 * experts' FFN per token, the weighted sum); edge shapes (an expert with no
 * token, every token on one expert, k = E, T = 1, T prime); noisy top-k
 * repeatable and independent of how a batch is cut; the aux losses against
 * their formulas; finite-difference gradient checks in f64 of the router
 * (with the aux losses), the FFN (SwiGLU and MLP) and the whole layer;
 * batch invariance (a token's row bit for bit across batches); the parts
 * chained equal to the layer; bad inputs that write nothing; and, with a
 * GPU, the CUDA router, permute, unpermute, expert FFN and layer forward
 * against the CPU reference (odd sizes, drops, row strides, every copy
 * width, experts with no token, one expert for all, k = E, T = 1), the
 * decode path's layer forward (T·k <= 16: T = 1 and 3 top-2, E = 64 top-6,
 * f16, bf16 and f32, tokens sharing an expert, split K; its routing
 * against the CPU router's); the backward's cases are in
 * tests/test_moe_bwd.c.
 *
 * Inputs are fresh seeded random data (ties have probability ~0). Outputs
 * are guarded, poisoned buffers. */
#include "core/error_bound.h"
#include "cpu/moe_cpu.h"
#include "harness.h"
#include "test_moe.h"

#include <math.h>

/* ---------------------------------------------------------------- problems */


arr arr_new(smelt_dtype dt, int64_t n, double lo, double hi) {
  arr a = {dt, n, calloc((size_t)(n ? n : 1), smelt_dtype_size(dt)), calloc((size_t)(n ? n : 1), sizeof(double))};
  for (int64_t i = 0; i < n; i++) {
    th_set(a.h, dt, i, th_rand_uniform(lo, hi));
    a.v[i] = th_get(a.h, dt, i);
  }
  return a;
}

void arr_set(arr *a, int64_t i, double v) {
  th_set(a->h, a->dt, i, v);
  a->v[i] = th_get(a->h, a->dt, i);
}

void arr_free(arr *a) {
  free(a->h);
  free(a->v);
}



smelt_tensor host_tensor(void *p, smelt_dtype dt, int n, int64_t a, int64_t b, int64_t c) {
  int64_t shape[3] = {a, b, c};
  return smelt_tensor_make(p, dt, SMELT_DEVICE_CPU, 0, n, shape);
}

static void mp_tensors(mp *p) {
  const int64_t d = p->d, E = p->E, F = p->F;
  p->tx = host_tensor(p->x.h, p->xdt, 2, p->T, d, 0);
  p->twr = host_tensor(p->wr.h, p->wdt, 2, d, E, 0);
  memset(&p->w, 0, sizeof p->w);
  p->w.wr = &p->twr;
  if (p->sp.bias) {
    p->teb = host_tensor(p->eb.h, SMELT_DTYPE_F32, 1, E, 0, 0);
    p->w.expert_bias = &p->teb;
  }
  if (p->sp.noise) {
    p->twn = host_tensor(p->wn.h, p->wdt, 2, d, E, 0);
    p->w.wnoise = &p->twn;
  }
  p->tw1 = host_tensor(p->w1.h, p->wdt, 3, E, d, F);
  p->tw2 = host_tensor(p->w2.h, p->wdt, 3, E, F, d);
  p->w.w1 = &p->tw1;
  p->w.w2 = &p->tw2;
  if (p->sp.ffn == SMELT_MOE_FFN_SWIGLU) {
    p->tw3 = host_tensor(p->w3.h, p->wdt, 3, E, d, F);
    p->w.w3 = &p->tw3;
  } else if (p->sp.b1) {
    p->tb1 = host_tensor(p->b1.h, p->wdt, 2, E, F, 0);
    p->w.b1 = &p->tb1;
  }
}

void mp_init(mp *p, const spec *sp) {
  memset(p, 0, sizeof *p);
  p->sp = *sp;
  p->T = sp->T, p->d = sp->d, p->E = sp->E, p->k = sp->k, p->F = sp->F, p->R = sp->T * sp->k;
  p->xdt = sp->f64 ? SMELT_DTYPE_F64 : sp->xdt ? sp->xdt : SMELT_DTYPE_F32;
  p->wdt = sp->f64 ? SMELT_DTYPE_F64 : sp->wdt ? sp->wdt : SMELT_DTYPE_F32;
  p->rdt = sp->f64 ? SMELT_DTYPE_F64 : SMELT_DTYPE_F32;
  smelt_moe_config *c = &p->cfg;
  *c = smelt_moe_config_default();
  c->num_experts = sp->E, c->top_k = sp->k, c->d_model = sp->d, c->ffn_dim = sp->F;
  c->score = sp->score;
  c->renormalize = !sp->no_renorm;
  c->scaling_factor = sp->scale ? sp->scale : 1.0;
  c->num_groups = sp->groups, c->topk_groups = sp->topk_groups;
  c->capacity_factor = sp->cap, c->drop_policy = sp->drop;
  c->aux_loss_coeff = sp->aux, c->z_loss_coeff = sp->z;
  c->ffn = sp->ffn, c->activation = sp->act;
  c->noise_seed = 0x5EEDull + th_rand_u64() % 1000;
  const double sx = 1.0, sw = 1.0 / sqrt((double)sp->d), sf = 1.0 / sqrt((double)sp->F);
  p->x = arr_new(p->xdt, p->T * p->d, -sx, sx);
  p->wr = arr_new(p->wdt, p->d * p->E, -2 * sw, 2 * sw);
  p->eb = arr_new(SMELT_DTYPE_F32, p->E, -0.1, 0.1);
  p->wn = arr_new(p->wdt, p->d * p->E, -sw, sw);
  p->w1 = arr_new(p->wdt, p->E * p->d * p->F, -sw, sw);
  p->w3 = arr_new(p->wdt, p->E * p->d * p->F, -sw, sw);
  p->w2 = arr_new(p->wdt, p->E * p->F * p->d, -sf, sf);
  p->b1 = arr_new(p->wdt, p->E * p->F, -0.2, 0.2);
  mp_tensors(p);
}

void mp_free(mp *p) {
  arr *all[] = {&p->x, &p->wr, &p->eb, &p->wn, &p->w1, &p->w3, &p->w2, &p->b1};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) arr_free(all[i]);
}

/* ---------------------------------------------------------------- the oracle */

typedef struct oracle {
  double *logits, *w, *y, *yp_tok; /* yp_tok [T, k, d]: each assignment's expert output */
  int64_t *sel, *count, *selcount;
  int *kept;
  double aux[2];
} oracle;

static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

/* The index of the largest v[i] over allowed i (ties: lower i), or -1. */
static int64_t argmax(const double *v, const int *allowed, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; i++)
    if ((!allowed || allowed[i]) && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

static void oracle_route_token(const mp *p, oracle *o, int64_t t, const double *s) {
  const int64_t E = p->E, k = p->k;
  double key[64];
  int allowed[64];
  for (int64_t e = 0; e < E; e++) {
    key[e] = s[e] + (p->sp.bias ? p->eb.v[e] : 0.0);
    allowed[e] = 1;
  }
  if (p->sp.groups) {
    const int64_t G = p->sp.groups, size = E / G, per = k / p->sp.topk_groups;
    double gs[64];
    int gallowed[64];
    for (int64_t g = 0; g < G; g++) {
      int in[64] = {0};
      for (int64_t e = g * size; e < (g + 1) * size; e++) in[e] = 1;
      gs[g] = 0;
      for (int64_t j = 0; j < per; j++) {
        int64_t b = argmax(key, in, E);
        gs[g] += key[b];
        in[b] = 0;
      }
      gallowed[g] = 1;
    }
    int chosen[64] = {0};
    for (int64_t j = 0; j < p->sp.topk_groups; j++) {
      int64_t b = argmax(gs, gallowed, G);
      chosen[b] = 1;
      gallowed[b] = 0;
    }
    for (int64_t e = 0; e < E; e++) allowed[e] = chosen[e / size];
  }
  double z = p->sp.score == SMELT_MOE_SCORE_SIGMOID ? 1e-20 : 0.0;
  for (int64_t i = 0; i < k; i++) {
    int64_t b = argmax(key, allowed, E);
    allowed[b] = 0;
    o->sel[t * k + i] = b;
    o->w[t * k + i] = s[b];
    z += s[b];
    o->selcount[b]++;
  }
  const int norm = p->sp.score == SMELT_MOE_SCORE_SOFTMAX ? !p->sp.no_renorm : k > 1;
  for (int64_t i = 0; i < k; i++) o->w[t * k + i] = (norm ? o->w[t * k + i] / z : o->w[t * k + i]) * p->cfg.scaling_factor;
}

static void oracle_capacity(const mp *p, oracle *o) {
  for (int64_t a = 0; a < p->R; a++) o->kept[a] = 1;
  int64_t cap = -1;
  if (p->sp.cap > 0) {
    cap = (int64_t)ceil((double)p->R / (double)p->E * p->sp.cap);
    if (cap > p->T) cap = p->T;
  }
  for (int64_t e = 0; e < p->E; e++) {
    int64_t n = o->selcount[e];
    o->count[e] = cap >= 0 && n > cap ? cap : n;
    if (cap < 0 || n <= cap) continue;
    int *mine = calloc((size_t)p->R, sizeof(int));
    for (int64_t a = 0; a < p->R; a++) mine[a] = o->sel[a] == e;
    for (int64_t j = 0; j < cap; j++) { /* mark the kept ones as 2 */
      int64_t b = -1;
      for (int64_t a = 0; a < p->R; a++)
        if (mine[a] == 1 && (b < 0 || (p->sp.drop == SMELT_MOE_DROP_PROBS && o->w[a] > o->w[b]))) b = a;
      mine[b] = 2;
    }
    for (int64_t a = 0; a < p->R; a++)
      if (mine[a] == 1) o->kept[a] = 0;
    free(mine);
  }
}

/* Expert e's FFN of x row t into out [d]. */
static void oracle_ffn(const mp *p, int64_t e, const double *xt, double *out) {
  const int64_t d = p->d, F = p->F;
  for (int64_t c = 0; c < d; c++) out[c] = 0;
  for (int64_t f = 0; f < F; f++) {
    double h1 = 0, h3 = 0;
    for (int64_t c = 0; c < d; c++) {
      h1 += xt[c] * p->w1.v[(e * d + c) * F + f];
      h3 += xt[c] * p->w3.v[(e * d + c) * F + f];
    }
    double a;
    if (p->sp.ffn == SMELT_MOE_FFN_SWIGLU) a = h1 * sigm(h1) * h3;
    else a = smelt_act_apply(p->sp.act, h1 + (p->sp.b1 ? p->b1.v[e * F + f] : 0.0), 0.01);
    for (int64_t c = 0; c < d; c++) out[c] += a * p->w2.v[(e * F + f) * d + c];
  }
}

static void oracle_run(const mp *p, oracle *o) {
  const int64_t T = p->T, E = p->E, k = p->k, d = p->d;
  o->logits = calloc((size_t)(T * E + 1), sizeof(double));
  o->w = calloc((size_t)(p->R + 1), sizeof(double));
  o->y = calloc((size_t)(T * d + 1), sizeof(double));
  o->yp_tok = calloc((size_t)(p->R * d + 1), sizeof(double));
  o->sel = calloc((size_t)(p->R + 1), sizeof(int64_t));
  o->kept = calloc((size_t)(p->R + 1), sizeof(int));
  o->count = calloc((size_t)E, sizeof(int64_t));
  o->selcount = calloc((size_t)E, sizeof(int64_t));
  double s[64], lb = 0, zl = 0, P[64] = {0};
  for (int64_t t = 0; t < T; t++) {
    double m = -INFINITY, sum = 0;
    for (int64_t e = 0; e < E; e++) {
      double v = 0;
      for (int64_t c = 0; c < d; c++) v += p->x.v[t * d + c] * p->wr.v[c * E + e];
      o->logits[t * E + e] = p->rdt == SMELT_DTYPE_F32 ? (double)(float)v : v;
      m = fmax(m, o->logits[t * E + e]);
    }
    for (int64_t e = 0; e < E; e++) sum += exp(o->logits[t * E + e] - m);
    for (int64_t e = 0; e < E; e++) {
      const double pe = exp(o->logits[t * E + e] - m) / sum;
      P[e] += pe;
      s[e] = p->sp.score == SMELT_MOE_SCORE_SOFTMAX ? pe : sigm(o->logits[t * E + e]);
    }
    zl += (m + log(sum)) * (m + log(sum));
    oracle_route_token(p, o, t, s);
  }
  oracle_capacity(p, o);
  for (int64_t e = 0; e < E; e++) lb += (double)o->selcount[e] * P[e];
  o->aux[0] = T ? p->sp.aux * (double)E / ((double)k * (double)T * (double)T) * lb : 0;
  o->aux[1] = T ? p->sp.z * zl / (double)T : 0;
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < k; i++) {
      double *yt = o->yp_tok + (t * k + i) * d;
      oracle_ffn(p, o->sel[t * k + i], p->x.v + t * d, yt);
      if (!o->kept[t * k + i]) continue;
      for (int64_t c = 0; c < d; c++) o->y[t * d + c] += o->w[t * k + i] * yt[c];
    }
}

static void oracle_free(oracle *o) {
  free(o->logits), free(o->w), free(o->y), free(o->yp_tok), free(o->sel), free(o->kept), free(o->count),
      free(o->selcount);
}

/* ---------------------------------------------------------------- running the layer */

/* The layer's outputs in guarded buffers, downloaded as doubles. */
typedef struct fwd {
  th_buf b[8]; /* y, logits, ids, weights, counts, offsets, dropped, aux */
  smelt_tensor t[8];
  double *v[8];
  int64_t n[8];
  smelt_moe_stats stats;
} fwd;

enum { F_Y, F_LOGITS, F_IDS, F_WEIGHTS, F_COUNTS, F_OFFSETS, F_DROPPED, F_AUX };

static void fwd_alloc(fwd *f, const mp *p, smelt_dtype cdt) {
  memset(f, 0, sizeof *f);
  const smelt_dtype dts[8] = {p->xdt, p->rdt, SMELT_DTYPE_I32, p->rdt, cdt, cdt, cdt, p->rdt};
  const int64_t shapes[8][2] = {{p->T, p->d}, {p->T, p->E}, {p->T, p->k}, {p->T, p->k},
                                {p->E, 0},    {p->E + 1, 0}, {1, 0},     {2, 0}};
  for (int i = 0; i < 8; i++) {
    const int nd = shapes[i][1] ? 2 : 1;
    f->n[i] = shapes[i][0] * (nd == 2 ? shapes[i][1] : 1);
    f->b[i] = th_buf_new(th_cpu(), (size_t)f->n[i] * smelt_dtype_size(dts[i]));
    f->t[i] = smelt_tensor_make(f->b[i].data, dts[i], SMELT_DEVICE_CPU, 0, nd, shapes[i]);
    f->v[i] = calloc((size_t)(f->n[i] + 1), sizeof(double));
  }
}

/* Checks buffers [first, 8) were written whole and reads them. */
static void fwd_read_from(fwd *f, int first) {
  for (int i = first; i < 8; i++) {
    CHECK(th_buf_guards_ok(&f->b[i]));
    for (int64_t j = 0; j < f->n[i]; j++) f->v[i][j] = th_get(f->b[i].data, f->t[i].dtype, j);
    if (f->t[i].dtype == SMELT_DTYPE_F32 || f->t[i].dtype == SMELT_DTYPE_F64)
      for (int64_t j = 0; j < f->n[i]; j++) CHECK(!isnan(f->v[i][j]));
  }
}

static void fwd_read(fwd *f) { fwd_read_from(f, 0); }

static void fwd_free(fwd *f) {
  for (int i = 0; i < 8; i++) {
    th_buf_free(&f->b[i]);
    free(f->v[i]);
  }
}

static smelt_moe_routing routing_of(const fwd *f) {
  return (smelt_moe_routing){&f->t[F_LOGITS], &f->t[F_IDS],     &f->t[F_WEIGHTS], &f->t[F_COUNTS],
                             &f->t[F_OFFSETS], &f->t[F_DROPPED], &f->t[F_AUX]};
}

static smelt_status run_forward(const mp *p, fwd *f, smelt_dtype cdt) {
  fwd_alloc(f, p, cdt);
  smelt_moe_routing r = routing_of(f);
  smelt_status s = smelt_moe_forward(th_cpu(), &p->cfg, &p->w, &p->tx, &f->t[F_Y], &r, &f->stats);
  if (!s) fwd_read(f);
  return s;
}

double bound(smelt_dtype dt) {
  smelt__bound_query q = {.family = "moe", .metric = SMELT__METRIC_REL_L2, .device = SMELT_DEVICE_CPU, .dtype = dt};
  return smelt__error_bound(&q);
}

/* The layer against the oracle: routing exactly, values within bounds. */
static void check_layer(const spec *sp, const char *what) {
  mp p;
  mp_init(&p, sp);
  oracle o;
  oracle_run(&p, &o);
  fwd f;
  CHECK_OK(run_forward(&p, &f, SMELT_DTYPE_I32));
  int64_t kept = 0, at = 0;
  for (int64_t a = 0; a < p.R; a++) {
    if (f.v[F_IDS][a] != (o.kept[a] ? (double)o.sel[a] : -1.0)) {
      th_fail(__FILE__, __LINE__, "%s: ids[%lld]=%g, oracle %lld (kept %d)", what, (long long)a, f.v[F_IDS][a],
              (long long)o.sel[a], o.kept[a]);
      break;
    }
    if (!o.kept[a]) o.w[a] = 0;
    kept += o.kept[a];
  }
  for (int64_t e = 0; e < p.E; e++) {
    CHECK_EQ_INT(f.v[F_COUNTS][e], o.count[e]);
    CHECK_EQ_INT(f.v[F_OFFSETS][e], at);
    at += o.count[e];
  }
  CHECK_EQ_INT(f.v[F_OFFSETS][p.E], at);
  CHECK_EQ_INT(f.v[F_DROPPED][0], p.R - kept);
  CHECK_EQ_INT(f.stats.dropped, p.R - kept);
  CHECK_EQ_INT(f.stats.kept, kept);
  CHECK(th_compare("logits", f.v[F_LOGITS], o.logits, p.T * p.E, p.rdt == SMELT_DTYPE_F64 ? 1e-13 : 1e-7, 0));
  CHECK(th_compare("weights", f.v[F_WEIGHTS], o.w, p.R, p.rdt == SMELT_DTYPE_F64 ? 1e-13 : 1e-6, 1e-7));
  CHECK(th_compare("aux", f.v[F_AUX], o.aux, 2, 1e-6, 1e-12));
  CHECK(th_compare(what, f.v[F_Y], o.y, p.T * p.d, bound(p.xdt), 1e-6));
  fwd_free(&f);
  oracle_free(&o);
  mp_free(&p);
}

static spec base(int64_t T, int64_t E, int64_t k) {
  return (spec){.T = T, .d = 12, .E = E, .k = k, .F = 10};
}

/* ---------------------------------------------------------------- forward */

static void test_moe_forward(void) {
  spec s = base(37, 8, 2);
  check_layer(&s, "softmax top2 T37");
  s.no_renorm = 1, s.scale = 2.5, s.bias = 1;
  check_layer(&s, "softmax no renorm, scale, bias");
  s = base(19, 8, 3);
  s.score = SMELT_MOE_SCORE_SIGMOID, s.bias = 1;
  check_layer(&s, "sigmoid + bias top3");
  s.k = 1;
  check_layer(&s, "sigmoid top1 (no renormalization)");
  s = base(23, 8, 4);
  s.groups = 4, s.topk_groups = 2, s.score = SMELT_MOE_SCORE_SIGMOID, s.bias = 1;
  check_layer(&s, "group-limited 4 groups top2 groups top4");
  s = base(29, 6, 2);
  s.ffn = SMELT_MOE_FFN_MLP, s.act = SMELT_ACT_GELU, s.b1 = 1;
  check_layer(&s, "mlp gelu + b1");
  s.act = SMELT_ACT_RELU, s.b1 = 0;
  check_layer(&s, "mlp relu");
  s = base(31, 8, 2);
  s.aux = 0.01, s.z = 0.001;
  check_layer(&s, "aux losses");
}

static void test_moe_dtypes(void) {
  const smelt_dtype dts[][2] = {{SMELT_DTYPE_BF16, SMELT_DTYPE_BF16}, {SMELT_DTYPE_F16, SMELT_DTYPE_F16},
                                {SMELT_DTYPE_F32, SMELT_DTYPE_BF16}, {SMELT_DTYPE_BF16, SMELT_DTYPE_F32}};
  for (size_t i = 0; i < sizeof dts / sizeof *dts; i++) {
    spec s = base(17, 8, 2);
    s.xdt = dts[i][0], s.wdt = dts[i][1];
    check_layer(&s, smelt_dtype_name(dts[i][0]));
  }
  spec s = base(13, 6, 2);
  s.f64 = 1;
  check_layer(&s, "f64");
}

static void test_moe_edges(void) {
  spec s = base(1, 8, 2);
  check_layer(&s, "T = 1");
  s = base(41, 5, 5);
  check_layer(&s, "k = E");
  s = base(3, 16, 2);
  check_layer(&s, "T = 3, E = 16: experts with no token");
  s = base(0, 4, 2);
  check_layer(&s, "T = 0");
  s = base(7, 1, 1);
  check_layer(&s, "E = 1");
  s.score = SMELT_MOE_SCORE_SIGMOID;
  check_layer(&s, "E = 1 sigmoid (weight s itself)");
}

/* A bias that decides: expert 0 never chosen, every token on expert 3. */
static void test_moe_skew(void) {
  spec s = base(13, 6, 1);
  s.bias = 1;
  mp p;
  mp_init(&p, &s);
  for (int64_t e = 0; e < p.E; e++) arr_set(&p.eb, e, e == 3 ? 100.0 : e == 0 ? -100.0 : 0.0);
  oracle o;
  oracle_run(&p, &o);
  fwd f;
  CHECK_OK(run_forward(&p, &f, SMELT_DTYPE_I64));
  CHECK_EQ_INT(f.v[F_COUNTS][3], p.T);
  CHECK_EQ_INT(f.v[F_COUNTS][0], 0);
  CHECK_EQ_INT(f.stats.empty_experts, p.E - 1);
  CHECK_EQ_INT(f.stats.max_count, p.T);
  CHECK(fabs(f.stats.imbalance - (double)p.E) < 1e-12);
  for (int64_t t = 0; t < p.T; t++) CHECK_EQ_INT(f.v[F_IDS][t], 3);
  CHECK(th_compare("all on one expert", f.v[F_Y], o.y, p.T * p.d, bound(p.xdt), 1e-6));
  /* The stats of the routing again, from the counts alone. */
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &plan));
  smelt_moe_stats st;
  CHECK_OK(smelt_moe_stats_get(plan, &f.t[F_COUNTS], NULL, &st));
  CHECK_EQ_INT(st.kept, p.T);
  CHECK_EQ_INT(st.dropped, 0);
  smelt_plan_destroy(plan);
  fwd_free(&f);
  oracle_free(&o);
  mp_free(&p);
}

/* Capacity under both policies, against the oracle and by hand. */
static void test_moe_capacity(void) {
  const smelt_moe_drop pol[2] = {SMELT_MOE_DROP_PROBS, SMELT_MOE_DROP_POSITION};
  for (int i = 0; i < 2; i++) {
    spec s = base(31, 4, 2);
    s.cap = 0.75, s.drop = pol[i], s.bias = 1;
    check_layer(&s, i ? "capacity position" : "capacity probs");
    s.cap = 0.3, s.k = 1, s.aux = 0.1;
    check_layer(&s, i ? "capacity position, tight" : "capacity probs, tight");
  }
  /* By hand: 4 tokens, all on expert 1 (k 1, E 2, capacity ceil(4/2 · 0.5) = 1):
   * position keeps token 0, probs the token of the largest weight. */
  for (int i = 0; i < 2; i++) {
    spec s = base(4, 2, 1);
    s.cap = 0.5, s.drop = pol[i], s.bias = 1, s.no_renorm = 1;
    mp p;
    mp_init(&p, &s);
    arr_set(&p.eb, 0, -100), arr_set(&p.eb, 1, 100);
    fwd f;
    CHECK_OK(run_forward(&p, &f, SMELT_DTYPE_I32));
    oracle o;
    oracle_run(&p, &o);
    int64_t best = 0;
    for (int64_t t = 1; t < 4; t++) best = o.w[t] > o.w[best] ? t : best;
    const int64_t keep = pol[i] == SMELT_MOE_DROP_POSITION ? 0 : best;
    for (int64_t t = 0; t < 4; t++) {
      CHECK_EQ_INT(f.v[F_IDS][t], t == keep ? 1 : -1);
      CHECK(t == keep ? f.v[F_WEIGHTS][t] > 0 : f.v[F_WEIGHTS][t] == 0);
      for (int64_t c = 0; t != keep && c < p.d; c++) CHECK(f.v[F_Y][t * p.d + c] == 0);
    }
    CHECK_EQ_INT(f.v[F_DROPPED][0], 3);
    CHECK_EQ_INT(f.v[F_COUNTS][1], 1);
    fwd_free(&f);
    oracle_free(&o);
    mp_free(&p);
  }
}

/* ---------------------------------------------------------------- noise */

static void test_moe_philox(void) {
  /* Random123's known-answer vectors for philox4x32-10. */
  uint32_t c0[4] = {0, 0, 0, 0}, k0[2] = {0, 0};
  smelt__philox4x32_10(c0, k0);
  CHECK(c0[0] == 0x6627e8d5u && c0[1] == 0xe169c58du && c0[2] == 0xbc57ac4cu && c0[3] == 0x9b00dbd8u);
  uint32_t c1[4] = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, k1[2] = {0xffffffffu, 0xffffffffu};
  smelt__philox4x32_10(c1, k1);
  CHECK(c1[0] == 0x408f276du && c1[1] == 0x41c83b0eu && c1[2] == 0xa20bc7c6u && c1[3] == 0x6d5451fdu);
  uint32_t c2[4] = {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, k2[2] = {0xa4093822u, 0x299f31d0u};
  smelt__philox4x32_10(c2, k2);
  CHECK(c2[0] == 0xd16cfe09u && c2[1] == 0x94fdccebu && c2[2] == 0x5001e420u && c2[3] == 0x24126ea1u);
  /* The normals have mean ~0 and variance ~1. */
  double m = 0, v = 0;
  const int n = 20000;
  for (int i = 0; i < n; i++) {
    const double z = smelt__moe_normal(42, i / 8, i % 8);
    m += z;
    v += z * z;
  }
  m /= n, v = v / n - m * m;
  CHECK(fabs(m) < 0.05 && fabs(v - 1) < 0.05);
}

/* Rows [r0, r0 + n) of p routed alone (with the offset) give the same
 * logits and ids as the whole batch, and a second run repeats them. */
static void test_moe_noise(void) {
  spec s = base(21, 8, 2);
  s.noise = 1;
  mp p;
  mp_init(&p, &s);
  fwd whole, again;
  CHECK_OK(run_forward(&p, &whole, SMELT_DTYPE_I32));
  CHECK_OK(run_forward(&p, &again, SMELT_DTYPE_I32));
  CHECK(!memcmp(whole.b[F_LOGITS].data, again.b[F_LOGITS].data, (size_t)(p.T * p.E) * 4));
  CHECK(!memcmp(whole.b[F_Y].data, again.b[F_Y].data, (size_t)(p.T * p.d) * 4));
  /* The noise moved the logits away from x·Wr. */
  oracle o;
  oracle_run(&p, &o);
  double moved = 0;
  for (int64_t i = 0; i < p.T * p.E; i++) moved = fmax(moved, fabs(whole.v[F_LOGITS][i] - o.logits[i]));
  CHECK(moved > 0.01);
  const int64_t cut = 8;
  for (int part = 0; part < 2; part++) {
    const int64_t r0 = part ? cut : 0, n = part ? p.T - cut : cut;
    mp q = p;
    q.T = n, q.R = n * p.k;
    q.cfg.noise_token_offset = r0;
    q.tx = smelt_tensor_make((char *)p.x.h + (size_t)(r0 * p.d) * 4, p.xdt, SMELT_DEVICE_CPU, 0, 2,
                             (int64_t[]){n, p.d});
    fwd f;
    CHECK_OK(run_forward(&q, &f, SMELT_DTYPE_I32));
    CHECK(!memcmp(f.b[F_LOGITS].data, (char *)whole.b[F_LOGITS].data + (size_t)(r0 * p.E) * 4, (size_t)(n * p.E) * 4));
    for (int64_t a = 0; a < n * p.k; a++) CHECK(f.v[F_IDS][a] == whole.v[F_IDS][r0 * p.k + a]);
    CHECK(!memcmp(f.b[F_Y].data, (char *)whole.b[F_Y].data + (size_t)(r0 * p.d) * 4, (size_t)(n * p.d) * 4));
    fwd_free(&f);
  }
  /* Another seed, other noise. */
  p.cfg.noise_seed++;
  fwd other;
  CHECK_OK(run_forward(&p, &other, SMELT_DTYPE_I32));
  CHECK(memcmp(whole.b[F_LOGITS].data, other.b[F_LOGITS].data, (size_t)(p.T * p.E) * 4));
  fwd_free(&other);
  fwd_free(&whole);
  fwd_free(&again);
  oracle_free(&o);
  mp_free(&p);
}

/* ---------------------------------------------------------------- aux losses */

/* The aux losses of given logits against their formulas, the counts taken
 * from the routing's ids (no capacity: every selection is kept). */
static void test_moe_aux_losses(void) {
  const smelt_moe_score sc[2] = {SMELT_MOE_SCORE_SOFTMAX, SMELT_MOE_SCORE_SIGMOID};
  for (int i = 0; i < 2; i++) {
    spec s = base(23, 7, 3);
    s.score = sc[i], s.aux = 0.01, s.z = 0.003;
    mp p;
    mp_init(&p, &s);
    fwd f;
    CHECK_OK(run_forward(&p, &f, SMELT_DTYPE_I32));
    const int64_t T = p.T, E = p.E;
    double count[8] = {0}, P[8] = {0}, zsum = 0;
    for (int64_t a = 0; a < p.R; a++) count[(int64_t)f.v[F_IDS][a]] += 1;
    for (int64_t t = 0; t < T; t++) {
      double m = -INFINITY, sum = 0;
      for (int64_t e = 0; e < E; e++) m = fmax(m, f.v[F_LOGITS][t * E + e]);
      for (int64_t e = 0; e < E; e++) sum += exp(f.v[F_LOGITS][t * E + e] - m);
      for (int64_t e = 0; e < E; e++) P[e] += exp(f.v[F_LOGITS][t * E + e] - m) / sum;
      zsum += (m + log(sum)) * (m + log(sum));
    }
    double lb = 0;
    for (int64_t e = 0; e < E; e++) lb += count[e] * P[e];
    const double want[2] = {0.01 * (double)E / (3.0 * (double)T * (double)T) * lb, 0.003 * zsum / (double)T};
    for (int j = 0; j < 2; j++)
      if (fabs(f.v[F_AUX][j] - want[j]) > 1e-6 * fabs(want[j]))
        th_fail(__FILE__, __LINE__, "aux[%d]=%.9g, formula %.9g", j, f.v[F_AUX][j], want[j]);
    /* The standalone part agrees with the router's. */
    smelt_plan *plan = NULL;
    CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &plan));
    th_buf ab = th_buf_new(th_cpu(), 8);
    smelt_tensor at = smelt_tensor_make(ab.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, (int64_t[]){2});
    CHECK_OK(smelt_moe_aux_losses_run(plan, &p.w, &f.t[F_LOGITS], &at, NULL));
    CHECK(!memcmp(ab.data, f.b[F_AUX].data, 8));
    th_buf_free(&ab);
    smelt_plan_destroy(plan);
    fwd_free(&f);
    mp_free(&p);
  }
}

/* ---------------------------------------------------------------- gradient checks (f64) */

static smelt_tensor f64_tensor(double *v, int n, int64_t a, int64_t b, int64_t c) {
  return host_tensor(v, SMELT_DTYPE_F64, n, a, b, c);
}

static double dot(const double *a, const double *b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

/* |fd - g| within 1e-6 |g| + 2e-8: f64 central differences of step 1e-6
 * carry ~1e-9 of the objective's rounding (its terms are ~1). */
static int grad_close(const char *what, int64_t i, double fd, double g) {
  if (fabs(fd - g) <= 1e-6 * fabs(g) + 2e-8) return 1;
  th_fail(__FILE__, __LINE__, "%s[%lld]: analytic %.12g, finite difference %.12g", what, (long long)i, g, fd);
  return 0;
}

/* FD of J over `tries` random entries of v (n of them) against g. An entry
 * whose one-sided differences disagree sits on a kink of the routing (a
 * choice flips within the step: top-k's selection is piecewise) and is
 * drawn again; at most a quarter of the tries may be such. */
static void fd_entries(const char *what, double *v, const double *g, int64_t n, int tries,
                       double (*J)(void *), void *user) {
  const double h = 1e-6, j0 = J(user);
  int kinks = 0;
  for (int t = 0; t < tries && n > 0; t++) {
    const int64_t i = (int64_t)(th_rand_u64() % (uint64_t)n);
    const double v0 = v[i];
    v[i] = v0 + h;
    const double jp = J(user);
    v[i] = v0 - h;
    const double jm = J(user);
    v[i] = v0;
    if (fabs((jp - j0) - (j0 - jm)) > 1e-3 * h * (1.0 + fabs(g[i])) && kinks++ < tries / 4) {
      t--;
      continue;
    }
    if (!grad_close(what, i, (jp - jm) / (2 * h), g[i])) return;
  }
}

/* J = Σ gw·weights + L_lb + L_z of the routing of x (logits = x·I). */
static double router_objective(const mp *p, smelt_plan *plan, const double *gw) {
  double logits[256], w[256], aux[2];
  smelt_tensor tl = f64_tensor(logits, 2, p->T, p->E, 0), tw = f64_tensor(w, 2, p->T, p->k, 0),
               ta = f64_tensor(aux, 1, 2, 0, 0);
  int32_t ids[256];
  smelt_tensor ti = host_tensor(ids, SMELT_DTYPE_I32, 2, p->T, p->k, 0);
  int64_t c64[16], o64[17];
  smelt_tensor tc = host_tensor(c64, SMELT_DTYPE_I64, 1, p->E, 0, 0), to = host_tensor(o64, SMELT_DTYPE_I64, 1, p->E + 1, 0, 0);
  smelt_moe_routing r = {&tl, &ti, &tw, &tc, &to, NULL, &ta};
  CHECK_OK(smelt_moe_route_run(plan, &p->w, &p->tx, &r));
  return dot(gw, w, p->R) + aux[0] + aux[1];
}

typedef struct router_ctx {
  smelt_plan *plan;
  const mp *p;
  const double *gw;
} router_ctx;

static double router_j(void *u) {
  const router_ctx *c = (const router_ctx *)u;
  return router_objective(c->p, c->plan, c->gw);
}

static void test_moe_gradcheck_router(void) {
  const struct {
    smelt_moe_score score;
    int no_renorm;
    double cap;
    smelt_moe_drop drop;
    int64_t groups, tg;
  } cases[] = {
      {SMELT_MOE_SCORE_SOFTMAX, 0, 0, SMELT_MOE_DROP_NONE, 0, 0},
      {SMELT_MOE_SCORE_SOFTMAX, 1, 0, SMELT_MOE_DROP_NONE, 0, 0},
      {SMELT_MOE_SCORE_SIGMOID, 0, 0, SMELT_MOE_DROP_NONE, 2, 1},
      {SMELT_MOE_SCORE_SOFTMAX, 0, 0.6, SMELT_MOE_DROP_PROBS, 0, 0},
      {SMELT_MOE_SCORE_SIGMOID, 0, 0.6, SMELT_MOE_DROP_POSITION, 0, 0},
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    spec s = {.T = 9, .d = 6, .E = 6, .k = 2, .F = 4, .f64 = 1, .score = cases[c].score,
              .no_renorm = cases[c].no_renorm, .cap = cases[c].cap, .drop = cases[c].drop, .scale = 1.7,
              .groups = cases[c].groups, .topk_groups = cases[c].tg, .aux = 0.05, .z = 0.02, .bias = 1};
    mp p;
    mp_init(&p, &s);
    for (int64_t i = 0; i < p.d; i++)
      for (int64_t e = 0; e < p.E; e++) arr_set(&p.wr, i * p.E + e, i == e ? 1.0 : 0.0);
    for (int64_t i = 0; i < p.T * p.d; i++) arr_set(&p.x, i, th_rand_uniform(-2, 2));
    smelt_plan *plan = NULL;
    CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &plan));
    double gw[256], logits[256], dl[256];
    for (int64_t i = 0; i < p.R; i++) gw[i] = th_rand_uniform(-1, 1);
    for (int64_t i = 0; i < p.T * p.E; i++) logits[i] = p.x.v[i];
    smelt_tensor tl = f64_tensor(logits, 2, p.T, p.E, 0), tg = f64_tensor(gw, 2, p.T, p.k, 0),
                 td = f64_tensor(dl, 2, p.T, p.E, 0);
    CHECK_OK(smelt_moe_route_backward_run(plan, &p.w, &tl, &tg, &td));
    router_ctx rc = {plan, &p, gw};
    fd_entries("dlogits", (double *)p.x.h, dl, p.T * p.E, 24, router_j, &rc);
    smelt_plan_destroy(plan);
    mp_free(&p);
  }
}

/* J = Σ gy·yp over the kept rows of the FFN of xp (rows [0, total)). */
static double ffn_objective(smelt_plan *plan, const mp *p, const smelt_tensor *xp, const smelt_tensor *offs,
                            const double *gy, int64_t total) {
  double *yp = calloc((size_t)(p->R * p->d), sizeof(double));
  smelt_tensor ty = f64_tensor(yp, 2, p->R, p->d, 0);
  CHECK_OK(smelt_moe_ffn_run(plan, &p->w, xp, offs, &ty));
  const double j = dot(gy, yp, total * p->d);
  free(yp);
  return j;
}

typedef struct ffn_ctx {
  smelt_plan *plan;
  const mp *p;
  const smelt_tensor *xp, *offs;
  const double *gy;
  int64_t total;
} ffn_ctx;

static double ffn_j(void *u) {
  const ffn_ctx *c = (const ffn_ctx *)u;
  return ffn_objective(c->plan, c->p, c->xp, c->offs, c->gy, c->total);
}

static void test_moe_gradcheck_ffn(void) {
  const smelt_moe_ffn kinds[3] = {SMELT_MOE_FFN_SWIGLU, SMELT_MOE_FFN_MLP, SMELT_MOE_FFN_MLP};
  const smelt_act acts[3] = {SMELT_ACT_IDENTITY, SMELT_ACT_GELU, SMELT_ACT_GELU_TANH};
  for (int c = 0; c < 3; c++) {
    spec s = {.T = 7, .d = 5, .E = 4, .k = 2, .F = 6, .f64 = 1, .ffn = kinds[c], .act = acts[c], .b1 = c == 1};
    mp p;
    mp_init(&p, &s);
    /* Rows per expert 5, 0, 6, 1 (an empty expert), 2 rows of T·k unused. */
    int64_t offs[5] = {0, 5, 5, 11, 12};
    const int64_t total = offs[4];
    smelt_tensor to = host_tensor(offs, SMELT_DTYPE_I64, 1, 5, 0, 0);
    double *xp = calloc((size_t)(p.R * p.d), sizeof(double)), *gy = calloc((size_t)(p.R * p.d), sizeof(double));
    for (int64_t i = 0; i < p.R * p.d; i++) xp[i] = th_rand_uniform(-1, 1), gy[i] = th_rand_uniform(-1, 1);
    smelt_tensor txp = f64_tensor(xp, 2, p.R, p.d, 0), tgy = f64_tensor(gy, 2, p.R, p.d, 0);
    smelt_plan *plan = NULL;
    CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &plan));
    const int64_t nw1 = p.E * p.d * p.F, nb1 = p.E * p.F;
    double *dxp = calloc((size_t)(p.R * p.d), sizeof(double)), *dw1 = calloc((size_t)nw1, sizeof(double)),
           *dw3 = calloc((size_t)nw1, sizeof(double)), *dw2 = calloc((size_t)nw1, sizeof(double)),
           *db1 = calloc((size_t)nb1, sizeof(double));
    smelt_tensor tdx = f64_tensor(dxp, 2, p.R, p.d, 0), t1 = f64_tensor(dw1, 3, p.E, p.d, p.F),
                 t3 = f64_tensor(dw3, 3, p.E, p.d, p.F), t2 = f64_tensor(dw2, 3, p.E, p.F, p.d),
                 tb = f64_tensor(db1, 2, p.E, p.F, 0);
    smelt_moe_grads g = {.dx = &tdx, .dw1 = &t1, .dw2 = &t2};
    if (kinds[c] == SMELT_MOE_FFN_SWIGLU) g.dw3 = &t3;
    if (s.b1) g.db1 = &tb;
    CHECK_OK(smelt_moe_ffn_backward_run(plan, &p.w, &txp, &to, &tgy, &g));
    ffn_ctx fc = {plan, &p, &txp, &to, gy, total};
    fd_entries("dxp", xp, dxp, total * p.d, 12, ffn_j, &fc);
    fd_entries("dw1", (double *)p.w1.h, dw1, nw1, 12, ffn_j, &fc);
    fd_entries("dw2", (double *)p.w2.h, dw2, nw1, 12, ffn_j, &fc);
    if (g.dw3) fd_entries("dw3", (double *)p.w3.h, dw3, nw1, 12, ffn_j, &fc);
    if (g.db1) fd_entries("db1", (double *)p.b1.h, db1, nb1, 12, ffn_j, &fc);
    /* The empty expert's weight gradients are zeros. */
    for (int64_t i = 0; i < p.d * p.F; i++) CHECK(dw1[p.d * p.F + i] == 0 && dw2[p.d * p.F + i] == 0);
    free(xp), free(gy), free(dxp), free(dw1), free(dw3), free(dw2), free(db1);
    smelt_plan_destroy(plan);
    mp_free(&p);
  }
}

typedef struct layer_ctx {
  smelt_plan *plan;
  const mp *p;
  const double *gy;
} layer_ctx;

/* J = Σ gy·y + L_lb + L_z. */
static double layer_j(void *u) {
  const layer_ctx *c = (const layer_ctx *)u;
  const mp *p = c->p;
  double *y = calloc((size_t)(p->T * p->d), sizeof(double)), aux[2];
  smelt_tensor ty = f64_tensor(y, 2, p->T, p->d, 0), ta = f64_tensor(aux, 1, 2, 0, 0);
  double logits[512], w[128];
  int32_t ids[128];
  int64_t cnt[16], off[17];
  smelt_tensor tl = f64_tensor(logits, 2, p->T, p->E, 0), tw = f64_tensor(w, 2, p->T, p->k, 0),
               ti = host_tensor(ids, SMELT_DTYPE_I32, 2, p->T, p->k, 0),
               tc = host_tensor(cnt, SMELT_DTYPE_I64, 1, p->E, 0, 0), to = host_tensor(off, SMELT_DTYPE_I64, 1, p->E + 1, 0, 0);
  smelt_moe_routing r = {&tl, &ti, &tw, &tc, &to, NULL, &ta};
  CHECK_OK(smelt_moe_forward_run(c->plan, &p->w, &p->tx, &ty, &r, NULL));
  const double j = dot(c->gy, y, p->T * p->d) + aux[0] + aux[1];
  free(y);
  return j;
}

static void test_moe_gradcheck_layer(void) {
  const struct {
    smelt_moe_ffn ffn;
    smelt_moe_score score;
    double cap;
    int noise;
  } cases[] = {{SMELT_MOE_FFN_SWIGLU, SMELT_MOE_SCORE_SOFTMAX, 0, 0},
               {SMELT_MOE_FFN_SWIGLU, SMELT_MOE_SCORE_SIGMOID, 0.7, 0},
               {SMELT_MOE_FFN_MLP, SMELT_MOE_SCORE_SOFTMAX, 0.7, 0},
               {SMELT_MOE_FFN_SWIGLU, SMELT_MOE_SCORE_SOFTMAX, 0, 1}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    spec s = {.T = 11, .d = 6, .E = 5, .k = 2, .F = 7, .f64 = 1, .ffn = cases[c].ffn, .act = SMELT_ACT_SILU,
              .b1 = 1, .score = cases[c].score, .cap = cases[c].cap,
              .drop = cases[c].cap > 0 ? SMELT_MOE_DROP_POSITION : SMELT_MOE_DROP_NONE, .aux = 0.05, .z = 0.01,
              .bias = 1, .noise = cases[c].noise};
    mp p;
    mp_init(&p, &s);
    smelt_plan *plan = NULL;
    CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &plan));
    double *gy = calloc((size_t)(p.T * p.d), sizeof(double));
    for (int64_t i = 0; i < p.T * p.d; i++) gy[i] = th_rand_uniform(-1, 1);
    const int64_t nx = p.T * p.d, nr = p.d * p.E, nw = p.E * p.d * p.F, nb = p.E * p.F;
    double *dx = calloc((size_t)nx, 8), *dwr = calloc((size_t)nr, 8), *dw1 = calloc((size_t)nw, 8),
           *dw3 = calloc((size_t)nw, 8), *dw2 = calloc((size_t)nw, 8), *db1 = calloc((size_t)nb, 8),
           *dwn = calloc((size_t)nr, 8);
    smelt_tensor tdx = f64_tensor(dx, 2, p.T, p.d, 0), tr = f64_tensor(dwr, 2, p.d, p.E, 0),
                 t1 = f64_tensor(dw1, 3, p.E, p.d, p.F), t3 = f64_tensor(dw3, 3, p.E, p.d, p.F),
                 t2 = f64_tensor(dw2, 3, p.E, p.F, p.d), tb = f64_tensor(db1, 2, p.E, p.F, 0),
                 tgy = f64_tensor(gy, 2, p.T, p.d, 0), tn = f64_tensor(dwn, 2, p.d, p.E, 0);
    const int swiglu = cases[c].ffn == SMELT_MOE_FFN_SWIGLU;
    smelt_moe_grads g = {.dx = &tdx, .dwr = &tr, .dw1 = &t1, .dw3 = swiglu ? &t3 : NULL, .dw2 = &t2,
                         .db1 = swiglu ? NULL : &tb, .dwnoise = s.noise ? &tn : NULL};
    CHECK_OK(smelt_moe_backward_run(plan, &p.w, &p.tx, &tgy, &g));
    layer_ctx lc = {plan, &p, gy};
    fd_entries("dx", (double *)p.x.h, dx, nx, 16, layer_j, &lc);
    fd_entries("dwr", (double *)p.wr.h, dwr, nr, 16, layer_j, &lc);
    fd_entries("dw1", (double *)p.w1.h, dw1, nw, 10, layer_j, &lc);
    fd_entries("dw2", (double *)p.w2.h, dw2, nw, 10, layer_j, &lc);
    if (swiglu) fd_entries("dw3", (double *)p.w3.h, dw3, nw, 10, layer_j, &lc);
    else fd_entries("db1", (double *)p.b1.h, db1, nb, 10, layer_j, &lc);
    if (s.noise) fd_entries("dwnoise", (double *)p.wn.h, dwn, nr, 16, layer_j, &lc);
    free(gy), free(dx), free(dwr), free(dw1), free(dw3), free(dw2), free(db1), free(dwn);
    smelt_plan_destroy(plan);
    mp_free(&p);
  }
}

/* ---------------------------------------------------------------- batch invariance, parts */

/* Token rows of one batch, copied into another batch at other positions
 * among other tokens, give bitwise the same output rows. */
static void test_moe_batch_invariance(void) {
  const smelt_dtype dts[2] = {SMELT_DTYPE_F32, SMELT_DTYPE_BF16};
  for (int i = 0; i < 2; i++) {
    spec s = base(13, 8, 2);
    s.xdt = s.wdt = dts[i], s.bias = 1;
    mp a;
    mp_init(&a, &s);
    s.T = 6;
    mp b;
    mp_init(&b, &s);
    /* b gets a's weights and a's tokens 2 and 11 at rows 4 and 0. */
    b.w = a.w;
    const size_t row = (size_t)a.d * smelt_dtype_size(a.xdt);
    memcpy((char *)b.x.h + 4 * row, (char *)a.x.h + 2 * row, row);
    memcpy((char *)b.x.h + 0 * row, (char *)a.x.h + 11 * row, row);
    fwd fa, fb;
    CHECK_OK(run_forward(&a, &fa, SMELT_DTYPE_I32));
    CHECK_OK(run_forward(&b, &fb, SMELT_DTYPE_I32));
    CHECK(!memcmp((char *)fb.b[F_Y].data + 4 * row, (char *)fa.b[F_Y].data + 2 * row, row));
    CHECK(!memcmp((char *)fb.b[F_Y].data + 0 * row, (char *)fa.b[F_Y].data + 11 * row, row));
    fwd_free(&fa);
    fwd_free(&fb);
    mp_free(&a);
    mp_free(&b);
  }
}

/* route, permute, FFN, unpermute as parts give the layer's y bit for bit;
 * the parts' backward chained (unpermute, FFN, permute, router) gives the
 * layer's gradients. Unused permuted rows are left unwritten. */
static void test_moe_parts(void) {
  spec s = base(19, 6, 2);
  s.cap = 0.8, s.drop = SMELT_MOE_DROP_PROBS, s.aux = 0.01, s.z = 0.01;
  mp p;
  mp_init(&p, &s);
  fwd f;
  CHECK_OK(run_forward(&p, &f, SMELT_DTYPE_I64));
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &plan));
  fwd r;
  fwd_alloc(&r, &p, SMELT_DTYPE_I64);
  smelt_moe_routing rt = routing_of(&r);
  CHECK_OK(smelt_moe_route_run(plan, &p.w, &p.tx, &rt));
  fwd_read_from(&r, F_LOGITS);
  for (int i = F_LOGITS; i <= F_AUX; i++)
    CHECK(!memcmp(r.b[i].data, f.b[i].data, (size_t)f.n[i] * smelt_dtype_size(f.t[i].dtype)));
  const int64_t R = p.R, d = p.d, kept = (int64_t)r.v[F_OFFSETS][p.E];
  CHECK(kept < R);
  th_buf bxp = th_buf_new(th_cpu(), (size_t)(R * d) * 4), brm = th_buf_new(th_cpu(), (size_t)R * 4),
         byp = th_buf_new(th_cpu(), (size_t)(R * d) * 4), by = th_buf_new(th_cpu(), (size_t)(p.T * d) * 4);
  smelt_tensor xp = smelt_tensor_make(bxp.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){R, d}),
               rm = smelt_tensor_make(brm.data, SMELT_DTYPE_I32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.T, p.k}),
               yp = smelt_tensor_make(byp.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){R, d}),
               y = smelt_tensor_make(by.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.T, d});
  CHECK_OK(smelt_moe_permute_run(plan, &p.tx, &r.t[F_IDS], &r.t[F_OFFSETS], &xp, &rm));
  CHECK_OK(smelt_moe_ffn_run(plan, &p.w, &xp, &r.t[F_OFFSETS], &yp));
  CHECK_OK(smelt_moe_unpermute_run(plan, &yp, &rm, &r.t[F_WEIGHTS], &y));
  CHECK(!memcmp(by.data, f.b[F_Y].data, (size_t)(p.T * d) * 4));
  CHECK(th_all_ff((char *)bxp.data + kept * d * 4, (size_t)((R - kept) * d) * 4));
  CHECK(th_all_ff((char *)byp.data + kept * d * 4, (size_t)((R - kept) * d) * 4));
  /* The row map: expert-major, tokens ascending within an expert, -1 where dropped. */
  int64_t prev_row = -1;
  for (int64_t e = 0; e < p.E; e++)
    for (int64_t a = 0; a < R; a++)
      if (r.v[F_IDS][a] == (double)e) {
        const int32_t j = ((int32_t *)brm.data)[a];
        CHECK_EQ_INT(j, prev_row + 1);
        prev_row = j;
      }
  for (int64_t a = 0; a < R; a++)
    if (r.v[F_IDS][a] < 0) CHECK_EQ_INT(((int32_t *)brm.data)[a], -1);
  th_buf bufs[4] = {bxp, brm, byp, by};
  for (int i = 0; i < 4; i++) th_buf_free(&bufs[i]);
  fwd_free(&r);
  fwd_free(&f);
  smelt_plan_destroy(plan);
  mp_free(&p);
}

/* The layer's backward through the noise's scale with x not f64 (the
 * noise's z and dz in the routing dtype, paired with x in the GEMMs): f32
 * and bf16 x with Wnoise, dx and dwnoise asked for, against the same
 * values in f64 (a fuzz finding: z and dz in f64 made the f32 backward
 * fail after it had written dw1). */
static void test_moe_noise_backward_dtypes(void) {
  smelt_ctx *cpu = th_cpu();
  const int64_t T = 5, E = 4, k = 2, d = 8, F = 8;
  static const int64_t dims[11][3] = {{T, d, 0}, {d, E, 0}, {d, E, 0}, {E, d, F}, {E, d, F}, {E, F, d},
                                      {T, d, 0}, {E, d, F}, {E, d, F}, {E, F, d}, {d, E, 0}};
  smelt_moe_config c = smelt_moe_config_default();
  c.num_experts = E, c.top_k = k, c.d_model = d, c.ffn_dim = F;
  c.noise_seed = 7;
  double got[2][2][64], ref[2][64]; /* [dtype][dx, dwnoise][...] */
  static const smelt_dtype dts[3] = {SMELT_DTYPE_F64, SMELT_DTYPE_F32, SMELT_DTYPE_BF16};
  for (int di = 0; di < 3; di++) {
    const smelt_dtype dt = dts[di];
    uint8_t *mem[11];
    smelt_tensor t[11];
    for (int i = 0; i < 11; i++) {
      const int nd = dims[i][2] ? 3 : 2;
      const int64_t n = dims[i][0] * dims[i][1] * (nd == 3 ? dims[i][2] : 1);
      mem[i] = (uint8_t *)calloc((size_t)n, 8);
      for (int64_t j = 0; j < n; j++) th_set(mem[i], dt, j, (double)((j * 7 + i) % 13) / 16.0 - 0.375);
      t[i] = smelt_tensor_make(mem[i], dt, SMELT_DEVICE_CPU, 0, nd, dims[i]);
    }
    smelt_moe_weights w = {&t[1], NULL, &t[2], &t[3], &t[4], &t[5], NULL};
    smelt_moe_grads g = {&t[0], NULL, &t[10], &t[7], &t[8], &t[9], NULL};
    uint8_t *dx = (uint8_t *)calloc((size_t)(T * d), 8);
    smelt_tensor tdx = smelt_tensor_make(dx, dt, SMELT_DEVICE_CPU, 0, 2, dims[0]);
    g.dx = &tdx;
    CHECK_OK(smelt_moe_backward(cpu, &c, &w, &t[0], &t[6], &g));
    for (int64_t j = 0; j < T * d; j++) (di ? got[di - 1][0] : ref[0])[j] = th_get(dx, dt, j);
    for (int64_t j = 0; j < d * E; j++) (di ? got[di - 1][1] : ref[1])[j] = th_get(mem[10], dt, j);
    free(dx);
    for (int i = 0; i < 11; i++) free(mem[i]);
  }
  th_compare("noise backward f32 dx", got[0][0], ref[0], T * d, 1e-5, 0);
  th_compare("noise backward f32 dwnoise", got[0][1], ref[1], d * E, 1e-5, 0);
  th_compare("noise backward bf16 dx", got[1][0], ref[0], T * d, 3e-2, 0);
  th_compare("noise backward bf16 dwnoise", got[1][1], ref[1], d * E, 3e-2, 0);
}

/* ---------------------------------------------------------------- bad inputs */

static void test_moe_bad_config(void) {
  spec s = base(5, 4, 2);
  s.bias = 1;
  mp p;
  mp_init(&p, &s);
  smelt_plan *plan = (smelt_plan *)&p; /* must come back NULL */
  smelt_moe_config c = p.cfg;
  c.top_k = 5;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &c, &p.w, &p.tx, &plan), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("top_k=5");
  CHECK(plan == NULL);
  c = p.cfg, c.num_groups = 3, c.topk_groups = 1;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &c, &p.w, &p.tx, &plan), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("num_groups=3");
  c = p.cfg, c.num_groups = 2, c.topk_groups = 1, c.top_k = 3;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &c, &p.w, &p.tx, &plan), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("topk_groups");
  c = p.cfg, c.capacity_factor = 1.0;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &c, &p.w, &p.tx, &plan), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("drop policy");
  c = p.cfg, c.aux_loss_coeff = NAN;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &c, &p.w, &p.tx, &plan), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("aux_loss_coeff");
  c = p.cfg, c.score = (smelt_moe_score)7;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &c, &p.w, &p.tx, &plan), SMELT_STATUS_INVALID_ARGUMENT);
  /* The noise's token numbers past 2^63 - 1 (a fuzz finding: signed overflow). */
  c = p.cfg, c.noise_token_offset = INT64_MAX - 2;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &c, &p.w, &p.tx, &plan), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("noise_token_offset");
  /* Weights: shape, dtype, partial FFN set, f64 mixed, x layout. */
  smelt_moe_weights w = p.w;
  smelt_tensor bad = p.twr;
  bad.shape[1] = 5;
  w.wr = &bad;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &p.cfg, &w, &p.tx, &plan), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("wr.shape");
  w = p.w, w.w3 = NULL;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &p.cfg, &w, &p.tx, &plan), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("w3");
  bad = p.teb, bad.dtype = SMELT_DTYPE_BF16;
  w = p.w, w.expert_bias = &bad;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &p.cfg, &w, &p.tx, &plan), SMELT_STATUS_DTYPE_MISMATCH);
  bad = p.tw2, bad.dtype = SMELT_DTYPE_F64;
  w = p.w, w.w2 = &bad;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &p.cfg, &w, &p.tx, &plan), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("f64 pairs only with f64");
  bad = p.tw1, bad.strides[2] = 2, bad.strides[1] = 2 * p.F, bad.strides[0] = 2 * p.F * p.d;
  w = p.w, w.w1 = &bad;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &p.cfg, &w, &p.tx, &plan), SMELT_STATUS_BAD_LAYOUT);
  CHECK_MSG("w1 must be contiguous");
  bad = p.tx, bad.strides[1] = 2, bad.shape[1] = p.d / 2;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &bad, &plan), SMELT_STATUS_SHAPE_MISMATCH);
  /* T·k past 2^31 (i32 rows) and T·E past 2^63: refused before anything is read. */
  bad = p.tx, bad.shape[0] = (int64_t)1 << 30, bad.strides[0] = 0;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &bad, &plan), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("2^31");
  bad.shape[0] = INT64_MAX / 2;
  CHECK_STATUS(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &bad, &plan), SMELT_STATUS_OVERFLOW);
  CHECK(plan == NULL);
  mp_free(&p);
}

/* Runs with a bad tensor fail and leave every output poisoned. */
static void test_moe_bad_runs(void) {
  spec s = base(5, 4, 2);
  mp p;
  mp_init(&p, &s);
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &plan));
  fwd f;
  fwd_alloc(&f, &p, SMELT_DTYPE_I32);
  smelt_moe_routing r = routing_of(&f);
  /* The forward: y of another dtype; ids of another shape; offsets [E]. */
  smelt_tensor y = f.t[F_Y];
  y.dtype = SMELT_DTYPE_BF16;
  CHECK_STATUS(smelt_moe_forward_run(plan, &p.w, &p.tx, &y, &r, NULL), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("y.dtype");
  smelt_tensor ids = f.t[F_IDS];
  ids.shape[1] = 3;
  r.ids = &ids;
  CHECK_STATUS(smelt_moe_forward_run(plan, &p.w, &p.tx, &f.t[F_Y], &r, NULL), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("ids.shape");
  r = routing_of(&f);
  smelt_tensor offs = f.t[F_OFFSETS];
  offs.shape[0] = p.E;
  r.offsets = &offs;
  CHECK_STATUS(smelt_moe_route_run(plan, &p.w, &p.tx, &r), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("num_experts + 1");
  /* An output overlapping another. */
  r = routing_of(&f);
  smelt_tensor wts = smelt_tensor_make(f.b[F_LOGITS].data, p.rdt, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.T, p.k});
  r.weights = &wts;
  CHECK_STATUS(smelt_moe_route_run(plan, &p.w, &p.tx, &r), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("overlaps");
  /* A run with the weights of another layout than planned. */
  smelt_moe_weights w = p.w;
  w.expert_bias = &p.teb;
  r = routing_of(&f);
  CHECK_STATUS(smelt_moe_route_run(plan, &w, &p.tx, &r), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("plan was made without");
  for (int i = 0; i < 8; i++) CHECK(th_buf_untouched(&f.b[i]));
  /* Index tensors with bad values (the CPU reads them first). */
  int32_t idv[10] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 7};
  int64_t offv[5] = {0, 3, 5, 7, 9};
  smelt_tensor ti = host_tensor(idv, SMELT_DTYPE_I32, 2, p.T, p.k, 0), to = host_tensor(offv, SMELT_DTYPE_I64, 1, 5, 0, 0);
  th_buf bxp = th_buf_new(th_cpu(), (size_t)(p.R * p.d) * 4), brm = th_buf_new(th_cpu(), (size_t)p.R * 4);
  smelt_tensor xp = smelt_tensor_make(bxp.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.R, p.d}),
               rm = smelt_tensor_make(brm.data, SMELT_DTYPE_I32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.T, p.k});
  CHECK_STATUS(smelt_moe_permute_run(plan, &p.tx, &ti, &to, &xp, &rm), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("ids[9]=7");
  idv[9] = 1;
  CHECK_STATUS(smelt_moe_permute_run(plan, &p.tx, &ti, &to, &xp, &rm), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("expert 1");
  offv[2] = 2;
  CHECK_STATUS(smelt_moe_permute_run(plan, &p.tx, &ti, &to, &xp, &rm), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("offsets[2]=2");
  /* An i64 offset near 2^63 is read as an integer (through a double it was
   * 2^63, past int64_t: a fuzz finding) and refused. */
  offv[2] = INT64_MAX;
  CHECK_STATUS(smelt_moe_permute_run(plan, &p.tx, &ti, &to, &xp, &rm), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("9223372036854775807");
  offv[2] = 2;
  smelt_tensor nc = xp;
  nc.shape[0] = p.R / 2, nc.strides[0] = 2 * p.d;
  CHECK_STATUS(smelt_moe_permute_run(plan, &p.tx, &ti, &to, &nc, &rm), SMELT_STATUS_SHAPE_MISMATCH);
  int32_t rmv[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 10};
  smelt_tensor trm = host_tensor(rmv, SMELT_DTYPE_I32, 2, p.T, p.k, 0);
  CHECK_STATUS(smelt_moe_unpermute_run(plan, &xp, &trm, &f.t[F_WEIGHTS], &f.t[F_Y]), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("row_map[9]=10");
  CHECK(th_buf_untouched(&bxp) && th_buf_untouched(&brm) && th_buf_untouched(&f.b[F_Y]));
  /* The FFN's backward refuses dwr; the plan refuses other families' runs. */
  smelt_moe_grads g = {.dwr = &p.twr};
  CHECK_STATUS(smelt_moe_ffn_backward_run(plan, &p.w, &xp, &to, &xp, &g), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(smelt_topk_run(plan, &p.tx, &p.tx, NULL), SMELT_STATUS_INVALID_ARGUMENT);
  /* A plan without expert weights serves the router but not the FFN. */
  smelt_moe_weights wr_only = {.wr = &p.twr};
  smelt_plan *rplan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &wr_only, &p.tx, &rplan));
  CHECK_STATUS(smelt_moe_forward_run(rplan, &wr_only, &p.tx, &f.t[F_Y], NULL, NULL), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("without the expert weights");
  r = routing_of(&f);
  CHECK_OK(smelt_moe_route_run(rplan, &wr_only, &p.tx, &r));
  smelt_plan_destroy(rplan);
  th_buf_free(&bxp);
  th_buf_free(&brm);
  fwd_free(&f);
  smelt_plan_destroy(plan);
  mp_free(&p);
}

/* ---------------------------------------------------------------- CUDA */


dev dev_new(smelt_dtype dt, int nd, int64_t a, int64_t b, const void *host) {
  smelt_ctx *cu = th_cuda();
  dev d;
  const int64_t shape[2] = {a, b}, n = a * (nd == 2 ? b : 1);
  d.b = th_buf_new(cu, (size_t)(n ? n : 1) * smelt_dtype_size(dt));
  if (host) th_buf_upload(&d.b, host, (size_t)n * smelt_dtype_size(dt));
  d.t = smelt_tensor_make(d.b.data, dt, SMELT_DEVICE_CUDA, smelt_ctx_device_index(cu), nd, shape);
  return d;
}

void *dev_read(const dev *d) {
  const size_t bytes = (size_t)smelt_tensor_numel(&d->t) * smelt_dtype_size(d->t.dtype);
  void *h = malloc(bytes ? bytes : 1);
  th_buf_download(&d->b, h, bytes);
  CHECK(th_buf_guards_ok(&d->b));
  return h;
}


void dev_weights_new(const mp *p, dev_weights *g) {
  memset(g, 0, sizeof *g);
  g->x = dev_new(p->xdt, 2, p->T, p->d, p->x.h);
  g->wr = dev_new(p->wdt, 2, p->d, p->E, p->wr.h);
  g->w.wr = &g->wr.t;
  if (p->sp.bias) g->eb = dev_new(SMELT_DTYPE_F32, 1, p->E, 0, p->eb.h), g->w.expert_bias = &g->eb.t;
  if (p->sp.noise) g->wn = dev_new(p->wdt, 2, p->d, p->E, p->wn.h), g->w.wnoise = &g->wn.t;
}

void dev_weights_free(dev_weights *g) {
  dev *all[] = {&g->x, &g->wr, &g->eb, &g->wn, &g->w1, &g->w3, &g->w2, &g->b1};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    if (all[i]->b.base) th_buf_free(&all[i]->b);
}

/* The CPU's selection key of expert e for token t, from its logits. */
static double cpu_key(const mp *p, const double *logits, int64_t t, int64_t e) {
  const double *l = logits + t * p->E;
  double s;
  if (p->sp.score == SMELT_MOE_SCORE_SIGMOID) s = sigm(l[e]);
  else {
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < p->E; j++) m = fmax(m, l[j]);
    for (int64_t j = 0; j < p->E; j++) sum += exp(l[j] - m);
    s = exp(l[e] - m) / sum;
  }
  return s + (p->sp.bias ? p->eb.v[e] : 0.0);
}

/* Counts [E] (cdt) and offsets [E+1] (odt) read back from the GPU are
 * those of the histogram of its ids, and dropped the rest; returns the kept
 * assignments. */
static int64_t check_counts(const mp *p, const int64_t *hist, const void *counts, smelt_dtype cdt, const void *offs,
                            smelt_dtype odt, int64_t dropped) {
  int64_t at = 0;
  for (int64_t e = 0; e < p->E; e++) {
    CHECK_EQ_INT(th_get(counts, cdt, e), hist[e]);
    CHECK_EQ_INT(th_get(offs, odt, e), at);
    at += hist[e];
  }
  CHECK_EQ_INT(th_get(offs, odt, p->E), at);
  CHECK_EQ_INT(dropped, p->R - at);
  return at;
}

/* The GPU's routing (logits gl, ids gi, weights gw) against the CPU's c:
 * logits to 1e-5, ids equal but at near-ties (keys within 1e-4; drops
 * must agree), weights of the tokens routed alike to 1e-5; hist [E] gets
 * the histogram of the GPU's kept ids. */
static void compare_routing(const mp *p, const fwd *c, const float *gl, const int32_t *gi, const float *gw,
                            int64_t *hist, const char *what) {
  double *gld = calloc((size_t)(p->T * p->E + 1), sizeof(double));
  for (int64_t i = 0; i < p->T * p->E; i++) gld[i] = gl[i];
  CHECK(th_compare(what, gld, c->v[F_LOGITS], p->T * p->E, 1e-5, 1e-6));
  free(gld);
  int64_t ties = 0;
  for (int64_t t = 0; t < p->T; t++) {
    int same = 1;
    for (int64_t i = 0; i < p->k; i++) {
      const int64_t a = t * p->k + i, ge = gi[a], ce = (int64_t)c->v[F_IDS][a];
      REQUIRE(ge >= -1 && ge < p->E);
      if (ge >= 0) hist[ge]++;
      if (ge == ce) continue;
      same = 0;
      ties++;
      if (ge < 0 || ce < 0) {
        th_fail(__FILE__, __LINE__, "%s: token %lld slot %lld: GPU %lld, CPU %lld (a drop differs)", what,
                (long long)t, (long long)i, (long long)ge, (long long)ce);
        continue;
      }
      const double gap = fabs(cpu_key(p, c->v[F_LOGITS], t, ge) - cpu_key(p, c->v[F_LOGITS], t, ce));
      if (gap > 1e-4) th_fail(__FILE__, __LINE__, "%s: token %lld slot %lld: GPU %lld, CPU %lld, keys %.3g apart", what,
                              (long long)t, (long long)i, (long long)ge, (long long)ce, gap);
    }
    for (int64_t i = 0; same && i < p->k; i++) {
      const double cw = c->v[F_WEIGHTS][t * p->k + i];
      if (fabs(gw[t * p->k + i] - cw) > 1e-5 * fmax(1.0, fabs(cw)))
        th_fail(__FILE__, __LINE__, "%s: weights[%lld] GPU %.9g CPU %.9g", what, (long long)(t * p->k + i),
                gw[t * p->k + i], cw);
    }
  }
  if (ties) fprintf(stderr, "    %s: %lld near-tie choices differ\n", what, (long long)ties);
}

/* The router on CUDA against the CPU reference: logits to 1e-5, ids equal
 * but at near-ties (keys within 1e-4; drops must agree), weights of the
 * tokens routed alike to 1e-5, counts, offsets and dropped those of the
 * GPU's own ids, the aux losses to 1e-5 of the CPU's and 1e-6 of their
 * formulas over the GPU's logits. */
static void gpu_route_case(const spec *sp_in, const char *what) {
  spec sp1 = *sp_in;
  sp1.aux = 0.01, sp1.z = 0.001;
  const spec *sp = &sp1;
  mp p;
  mp_init(&p, sp);
  fwd c;
  fwd_alloc(&c, &p, SMELT_DTYPE_I64);
  smelt_moe_routing rc = routing_of(&c);
  smelt_plan *cplan = NULL, *gplan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &cplan));
  CHECK_OK(smelt_moe_route_run(cplan, &p.w, &p.tx, &rc));
  fwd_read_from(&c, F_LOGITS);
  dev_weights g;
  dev_weights_new(&p, &g);
  dev lg = dev_new(SMELT_DTYPE_F32, 2, p.T, p.E, NULL), id = dev_new(SMELT_DTYPE_I32, 2, p.T, p.k, NULL),
      wt = dev_new(SMELT_DTYPE_F32, 2, p.T, p.k, NULL), cn = dev_new(SMELT_DTYPE_I32, 1, p.E, 0, NULL),
      of = dev_new(SMELT_DTYPE_I64, 1, p.E + 1, 0, NULL), dr = dev_new(SMELT_DTYPE_I32, 1, 1, 0, NULL),
      ax = dev_new(SMELT_DTYPE_F32, 1, 2, 0, NULL);
  smelt_moe_routing rg = {&lg.t, &id.t, &wt.t, &cn.t, &of.t, &dr.t, &ax.t};
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &g.w, &g.x.t, &gplan));
  CHECK_OK(smelt_moe_route_run(gplan, &g.w, &g.x.t, &rg));
  CHECK_OK(smelt_ctx_synchronize(th_cuda()));
  float *gl = dev_read(&lg), *gw = dev_read(&wt), *ga = dev_read(&ax);
  int32_t *gi = dev_read(&id), *gc = dev_read(&cn), *gd = dev_read(&dr);
  int64_t *go = dev_read(&of);
  int64_t hist[1024] = {0};
  compare_routing(&p, &c, gl, gi, gw, hist, what);
  double *gld = calloc((size_t)(p.T * p.E + 1), sizeof(double));
  for (int64_t i = 0; i < p.T * p.E; i++) gld[i] = gl[i];
  const int64_t at = check_counts(&p, hist, gc, SMELT_DTYPE_I32, go, SMELT_DTYPE_I64, gd[0]);
  smelt_moe_stats st;
  CHECK_OK(smelt_moe_stats_get(gplan, &cn.t, &dr.t, &st));
  CHECK_EQ_INT(st.kept, at);
  CHECK_EQ_INT(st.dropped, p.R - at);
  /* The aux losses: against the CPU's, and (without drops, where the kept
   * ids are the selections) their formulas over the GPU's own logits. */
  const double cpu_aux[2] = {c.v[F_AUX][0], c.v[F_AUX][1]};
  for (int j = 0; j < 2; j++)
    if (fabs(ga[j] - cpu_aux[j]) > 1e-5 * fabs(cpu_aux[j]))
      th_fail(__FILE__, __LINE__, "%s: aux[%d] GPU %.9g CPU %.9g", what, j, ga[j], cpu_aux[j]);
  if (p.sp.cap == 0) {
    double P[1024] = {0}, zsum = 0, lb = 0;
    for (int64_t t = 0; t < p.T; t++) {
      double m = -INFINITY, sum = 0;
      for (int64_t e = 0; e < p.E; e++) m = fmax(m, gld[t * p.E + e]);
      for (int64_t e = 0; e < p.E; e++) sum += exp(gld[t * p.E + e] - m);
      for (int64_t e = 0; e < p.E; e++) P[e] += exp(gld[t * p.E + e] - m) / sum;
      zsum += (m + log(sum)) * (m + log(sum));
    }
    for (int64_t e = 0; e < p.E; e++) lb += (double)hist[e] * P[e];
    const double want[2] = {0.01 * (double)p.E / ((double)p.k * (double)p.T * (double)p.T) * lb, 0.001 * zsum / (double)p.T};
    for (int j = 0; j < 2; j++)
      if (fabs(ga[j] - want[j]) > 1e-6 * fabs(want[j]))
        th_fail(__FILE__, __LINE__, "%s: aux[%d] GPU %.9g, formula %.9g", what, j, ga[j], want[j]);
  }
  free(gl), free(gw), free(ga), free(gi), free(gc), free(gd), free(go), free(gld);
  dev all[] = {lg, id, wt, cn, of, dr, ax};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) th_buf_free(&all[i].b);
  dev_weights_free(&g);
  smelt_plan_destroy(cplan);
  smelt_plan_destroy(gplan);
  fwd_free(&c);
  mp_free(&p);
}

static void test_moe_gpu_route(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  spec s = {.T = 1, .d = 64, .E = 8, .k = 2, .F = 8};
  gpu_route_case(&s, "T1 E8 top2 f32");
  s = (spec){.T = 1001, .d = 128, .E = 64, .k = 6, .F = 8, .xdt = SMELT_DTYPE_BF16, .wdt = SMELT_DTYPE_BF16, .bias = 1};
  gpu_route_case(&s, "T1001 E64 top6 bf16 + bias");
  s = (spec){.T = 257, .d = 64, .E = 256, .k = 8, .F = 8, .xdt = SMELT_DTYPE_BF16, .wdt = SMELT_DTYPE_BF16,
             .score = SMELT_MOE_SCORE_SIGMOID, .bias = 1, .groups = 8, .topk_groups = 4, .scale = 2.5};
  gpu_route_case(&s, "T257 E256 top8 sigmoid groups 8/4");
  s = (spec){.T = 33, .d = 48, .E = 300, .k = 4, .F = 8, .no_renorm = 1, .noise = 1};
  gpu_route_case(&s, "T33 E300 top4 no renorm, noise");
  s = (spec){.T = 77, .d = 32, .E = 16, .k = 16, .F = 8, .xdt = SMELT_DTYPE_F16, .wdt = SMELT_DTYPE_F16,
             .score = SMELT_MOE_SCORE_SIGMOID};
  gpu_route_case(&s, "T77 k = E = 16 sigmoid f16");
  s = (spec){.T = 300, .d = 64, .E = 8, .k = 2, .F = 8, .bias = 1, .cap = 0.8, .drop = SMELT_MOE_DROP_POSITION};
  gpu_route_case(&s, "T300 E8 top2 capacity 0.8 position");
  s = (spec){.T = 1000, .d = 128, .E = 64, .k = 6, .F = 8, .xdt = SMELT_DTYPE_BF16, .wdt = SMELT_DTYPE_BF16,
             .score = SMELT_MOE_SCORE_SIGMOID, .bias = 1, .cap = 1.0, .drop = SMELT_MOE_DROP_POSITION};
  gpu_route_case(&s, "T1000 E64 top6 sigmoid capacity 1.0 position");
  s = (spec){.T = 301, .d = 64, .E = 8, .k = 2, .F = 8, .bias = 1, .cap = 0.7, .drop = SMELT_MOE_DROP_PROBS};
  gpu_route_case(&s, "T301 E8 top2 capacity 0.7 probs");
  s = (spec){.T = 999, .d = 128, .E = 64, .k = 6, .F = 8, .xdt = SMELT_DTYPE_BF16, .wdt = SMELT_DTYPE_BF16,
             .cap = 1.0, .drop = SMELT_MOE_DROP_PROBS, .scale = -1.5};
  gpu_route_case(&s, "T999 E64 top6 capacity 1.0 probs, negative scaling (the smallest weights kept)");
}

/* The CPU routing of p (with capacity drops where p has them), its
 * offsets i64. */
typedef struct cpu_routing {
  fwd f;
} cpu_routing;

static void cpu_routing_new(const mp *p, smelt_plan *cplan, cpu_routing *r) {
  fwd_alloc(&r->f, p, SMELT_DTYPE_I64);
  smelt_moe_routing rt = routing_of(&r->f);
  CHECK_OK(smelt_moe_route_run(cplan, &p->w, &p->tx, &rt));
  fwd_read_from(&r->f, F_LOGITS);
}

/* permute on CUDA against the CPU: row_map equal, the kept rows bit for
 * bit, the rest of xp untouched; x with a row stride (pad elements). */
static void gpu_permute_case(const spec *sp, int64_t pad, const char *what) {
  mp p;
  mp_init(&p, sp);
  const size_t es = smelt_dtype_size(p.xdt);
  const int64_t xs = p.d + pad;
  smelt_plan *cplan = NULL, *gplan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &cplan));
  cpu_routing r;
  cpu_routing_new(&p, cplan, &r);
  th_buf cxp = th_buf_new(th_cpu(), (size_t)(p.R * p.d) * es), crm = th_buf_new(th_cpu(), (size_t)p.R * 4);
  smelt_tensor txp = smelt_tensor_make(cxp.data, p.xdt, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.R, p.d}),
               trm = smelt_tensor_make(crm.data, SMELT_DTYPE_I32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.T, p.k});
  CHECK_OK(smelt_moe_permute_run(cplan, &p.tx, &r.f.t[F_IDS], &r.f.t[F_OFFSETS], &txp, &trm));
  /* x on the device with rows xs apart. */
  char *xh = calloc((size_t)(p.T * xs + 1), es);
  for (int64_t t = 0; t < p.T; t++) memcpy(xh + (size_t)(t * xs) * es, (char *)p.x.h + (size_t)(t * p.d) * es, (size_t)p.d * es);
  dev xd = dev_new(p.xdt, 2, p.T, xs, xh);
  smelt_tensor xv = xd.t;
  xv.shape[1] = p.d;
  dev wr = dev_new(p.wdt, 2, p.d, p.E, p.wr.h);
  smelt_moe_weights w = {.wr = &wr.t};
  int32_t *ids32 = malloc((size_t)p.R * 4);
  for (int64_t a = 0; a < p.R; a++) ids32[a] = (int32_t)r.f.v[F_IDS][a];
  dev ids = dev_new(SMELT_DTYPE_I32, 2, p.T, p.k, ids32), offs = dev_new(SMELT_DTYPE_I64, 1, p.E + 1, 0, r.f.b[F_OFFSETS].data),
      gxp = dev_new(p.xdt, 2, p.R, p.d, NULL), grm = dev_new(SMELT_DTYPE_I32, 2, p.T, p.k, NULL);
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &w, &xv, &gplan));
  CHECK_OK(smelt_moe_permute_run(gplan, &xv, &ids.t, &offs.t, &gxp.t, &grm.t));
  CHECK_OK(smelt_ctx_synchronize(th_cuda()));
  char *hx = dev_read(&gxp);
  int32_t *hrm = dev_read(&grm);
  const int64_t kept = (int64_t)r.f.v[F_OFFSETS][p.E];
  CHECK(!memcmp(hrm, crm.data, (size_t)p.R * 4));
  if (memcmp(hx, cxp.data, (size_t)(kept * p.d) * es)) th_fail(__FILE__, __LINE__, "%s: permuted rows differ", what);
  if (!th_all_ff(hx + (size_t)(kept * p.d) * es, (size_t)((p.R - kept) * p.d) * es))
    th_fail(__FILE__, __LINE__, "%s: rows past offsets[E] written", what);
  free(hx), free(hrm), free(xh), free(ids32);
  dev all[] = {xd, wr, ids, offs, gxp, grm};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) th_buf_free(&all[i].b);
  th_buf_free(&cxp);
  th_buf_free(&crm);
  fwd_free(&r.f);
  smelt_plan_destroy(cplan);
  smelt_plan_destroy(gplan);
  mp_free(&p);
}

static void test_moe_gpu_permute(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  spec s = {.T = 300, .d = 64, .E = 8, .k = 2, .F = 8, .xdt = SMELT_DTYPE_BF16, .wdt = SMELT_DTYPE_BF16,
            .cap = 0.8, .drop = SMELT_MOE_DROP_PROBS};
  gpu_permute_case(&s, 0, "T300 d64 bf16, capacity: 16-byte rows");
  s = (spec){.T = 129, .d = 7, .E = 5, .k = 3, .F = 8};
  gpu_permute_case(&s, 3, "T129 d7 f32, rows 10 apart: 4-byte units");
  s = (spec){.T = 1, .d = 5, .E = 4, .k = 4, .F = 8, .xdt = SMELT_DTYPE_F16, .wdt = SMELT_DTYPE_F16};
  gpu_permute_case(&s, 0, "T1 d5 f16 k = E: 2-byte units");
  s = (spec){.T = 1000, .d = 256, .E = 64, .k = 6, .F = 8, .xdt = SMELT_DTYPE_BF16, .wdt = SMELT_DTYPE_BF16,
             .cap = 1.0, .drop = SMELT_MOE_DROP_POSITION};
  gpu_permute_case(&s, 8, "T1000 d256 E64 top6 bf16, capacity position");
}

/* unpermute on CUDA against the CPU (rows of drops skipped): yp and y in
 * f32, bf16 and f16; d and y's row stride with and without the 16-byte
 * path (d 264: a partial second round of 256 columns); y's padding left
 * alone. */
static void test_moe_gpu_unpermute(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  const struct {
    smelt_dtype yp, y;
    int64_t d, pad;
  } cases[] = {{SMELT_DTYPE_F32, SMELT_DTYPE_F32, 100, 0},
               {SMELT_DTYPE_F32, SMELT_DTYPE_F32, 128, 0},
               {SMELT_DTYPE_BF16, SMELT_DTYPE_BF16, 264, 8},
               {SMELT_DTYPE_F32, SMELT_DTYPE_F16, 136, 3}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    spec s = {.T = 333, .d = cases[c].d, .E = 16, .k = 4, .F = 8, .xdt = cases[c].y, .wdt = cases[c].y, .cap = 0.9,
              .drop = SMELT_MOE_DROP_PROBS};
    mp p;
    mp_init(&p, &s);
    const int64_t ys = p.d + cases[c].pad;
    const size_t es = smelt_dtype_size(p.xdt);
    smelt_plan *cplan = NULL, *gplan = NULL;
    CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &cplan));
    cpu_routing r;
    cpu_routing_new(&p, cplan, &r);
    arr yp = arr_new(cases[c].yp, p.R * p.d, -1, 1);
    th_buf crm = th_buf_new(th_cpu(), (size_t)p.R * 4), cy = th_buf_new(th_cpu(), (size_t)(p.T * p.d) * es),
           cxp = th_buf_new(th_cpu(), (size_t)(p.R * p.d) * es);
    smelt_tensor trm = smelt_tensor_make(crm.data, SMELT_DTYPE_I32, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.T, p.k}),
                 typ = host_tensor(yp.h, yp.dt, 2, p.R, p.d, 0),
                 ty = smelt_tensor_make(cy.data, p.xdt, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.T, p.d}),
                 txp = smelt_tensor_make(cxp.data, p.xdt, SMELT_DEVICE_CPU, 0, 2, (int64_t[]){p.R, p.d});
    CHECK_OK(smelt_moe_permute_run(cplan, &p.tx, &r.f.t[F_IDS], &r.f.t[F_OFFSETS], &txp, &trm));
    CHECK_OK(smelt_moe_unpermute_run(cplan, &typ, &trm, &r.f.t[F_WEIGHTS], &ty));
    float *w32 = malloc((size_t)p.R * 4);
    for (int64_t a = 0; a < p.R; a++) w32[a] = (float)r.f.v[F_WEIGHTS][a];
    dev x = dev_new(p.xdt, 2, p.T, p.d, p.x.h), wr = dev_new(p.wdt, 2, p.d, p.E, p.wr.h),
        gyp = dev_new(yp.dt, 2, p.R, p.d, yp.h), grm = dev_new(SMELT_DTYPE_I32, 2, p.T, p.k, crm.data),
        gw = dev_new(SMELT_DTYPE_F32, 2, p.T, p.k, w32), gy = dev_new(p.xdt, 2, p.T, ys, NULL);
    smelt_tensor yv = gy.t;
    yv.shape[1] = p.d;
    smelt_moe_weights w = {.wr = &wr.t};
    CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &w, &x.t, &gplan));
    CHECK_OK(smelt_moe_unpermute_run(gplan, &gyp.t, &grm.t, &gw.t, &yv));
    CHECK_OK(smelt_ctx_synchronize(th_cuda()));
    char *hy = dev_read(&gy);
    double *got = calloc((size_t)(p.T * p.d), 8), *ref = calloc((size_t)(p.T * p.d), 8);
    for (int64_t t = 0; t < p.T; t++) {
      for (int64_t j = 0; j < p.d; j++)
        got[t * p.d + j] = th_get(hy, p.xdt, t * ys + j), ref[t * p.d + j] = th_get(cy.data, p.xdt, t * p.d + j);
      if (cases[c].pad && !th_all_ff(hy + (size_t)(t * ys + p.d) * es, (size_t)cases[c].pad * es))
        th_fail(__FILE__, __LINE__, "unpermute d %lld: y's padding of row %lld written", (long long)p.d, (long long)t);
    }
    CHECK(th_compare("unpermute", got, ref, p.T * p.d, p.xdt == SMELT_DTYPE_F32 ? 1e-6 : bound(p.xdt), 1e-6));
    free(hy), free(got), free(ref), free(w32);
    dev all[] = {x, wr, gyp, grm, gw, gy};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) th_buf_free(&all[i].b);
    th_buf_free(&crm), th_buf_free(&cy), th_buf_free(&cxp);
    arr_free(&yp);
    fwd_free(&r.f);
    smelt_plan_destroy(cplan);
    smelt_plan_destroy(gplan);
    mp_free(&p);
  }
}

/* ---------------------------------------------------------------- CUDA: the expert FFN and the layer */

double cuda_bound(smelt_dtype dt) {
  smelt__bound_query q = {.family = "moe", .metric = SMELT__METRIC_REL_L2, .device = SMELT_DEVICE_CUDA, .dtype = dt};
  return smelt__error_bound(&q);
}

void devs_free(dev *all, size_t n) {
  for (size_t i = 0; i < n; i++) th_buf_free(&all[i].b);
}

/* A contiguous [a, b, c] device copy of host data. */
dev dev3_new(smelt_dtype dt, int64_t a, int64_t b, int64_t c, const void *host) {
  dev d = dev_new(dt, 2, a * b, c, host);
  const int64_t shape[3] = {a, b, c};
  d.t = smelt_tensor_make(d.b.data, dt, SMELT_DEVICE_CUDA, smelt_ctx_device_index(th_cuda()), 3, shape);
  return d;
}

/* p's x and all its weights on the device. */
void dev_all_new(const mp *p, dev_weights *g) {
  dev_weights_new(p, g);
  g->w1 = dev3_new(p->wdt, p->E, p->d, p->F, p->w1.h);
  g->w2 = dev3_new(p->wdt, p->E, p->F, p->d, p->w2.h);
  g->w.w1 = &g->w1.t, g->w.w2 = &g->w2.t;
  if (p->sp.ffn == SMELT_MOE_FFN_SWIGLU) g->w3 = dev3_new(p->wdt, p->E, p->d, p->F, p->w3.h), g->w.w3 = &g->w3.t;
  else if (p->sp.b1) g->b1 = dev_new(p->wdt, 2, p->E, p->F, p->b1.h), g->w.b1 = &g->b1.t;
}

/* A bias that sends every token to expert 3 and none to expert 0 (E > 3). */
void all_to_three(mp *p) {
  for (int64_t e = 0; e < p->E; e++) arr_set(&p->eb, e, e == 3 ? 100.0 : e == 0 ? -100.0 : 0.0);
}

/* The expert FFN on CUDA against the CPU's over the CPU's routing
 * (offsets of dtype odt, yp of dtype ydt): the kept rows within the CUDA
 * bound, the rows past offsets[E] untouched. */
static void gpu_ffn_case(const spec *sp, int one_expert, smelt_dtype odt, smelt_dtype ydt, const char *what) {
  mp p;
  mp_init(&p, sp);
  if (one_expert) all_to_three(&p);
  const size_t es = smelt_dtype_size(p.xdt), ys = smelt_dtype_size(ydt);
  smelt_plan *cplan = NULL, *gplan = NULL;
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &cplan));
  cpu_routing r;
  cpu_routing_new(&p, cplan, &r);
  th_buf cxp = th_buf_new(th_cpu(), (size_t)(p.R * p.d) * es), crm = th_buf_new(th_cpu(), (size_t)p.R * 4),
         cyp = th_buf_new(th_cpu(), (size_t)(p.R * p.d) * 4);
  smelt_tensor txp = host_tensor(cxp.data, p.xdt, 2, p.R, p.d, 0), trm = host_tensor(crm.data, SMELT_DTYPE_I32, 2, p.T, p.k, 0),
               typ = host_tensor(cyp.data, SMELT_DTYPE_F32, 2, p.R, p.d, 0);
  CHECK_OK(smelt_moe_permute_run(cplan, &p.tx, &r.f.t[F_IDS], &r.f.t[F_OFFSETS], &txp, &trm));
  CHECK_OK(smelt_moe_ffn_run(cplan, &p.w, &txp, &r.f.t[F_OFFSETS], &typ));
  const int64_t kept = (int64_t)r.f.v[F_OFFSETS][p.E];
  if (one_expert) CHECK_EQ_INT(r.f.v[F_OFFSETS][4] - r.f.v[F_OFFSETS][3], kept);
  int64_t oh[1025];
  for (int64_t e = 0; e <= p.E; e++) th_set(oh, odt, e, r.f.v[F_OFFSETS][e]);
  dev_weights g;
  dev_all_new(&p, &g);
  dev gxp = dev_new(p.xdt, 2, p.R, p.d, cxp.data), gof = dev_new(odt, 1, p.E + 1, 0, oh),
      gyp = dev_new(ydt, 2, p.R, p.d, NULL);
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &g.w, &g.x.t, &gplan));
  CHECK_OK(smelt_moe_ffn_run(gplan, &g.w, &gxp.t, &gof.t, &gyp.t));
  CHECK_OK(smelt_ctx_synchronize(th_cuda()));
  char *hy = dev_read(&gyp);
  double *got = calloc((size_t)(kept * p.d + 1), 8), *ref = calloc((size_t)(kept * p.d + 1), 8);
  for (int64_t i = 0; i < kept * p.d; i++) got[i] = th_get(hy, ydt, i), ref[i] = th_get(cyp.data, SMELT_DTYPE_F32, i);
  CHECK(th_compare(what, got, ref, kept * p.d, cuda_bound(p.xdt), 1e-6));
  if (!th_all_ff(hy + (size_t)(kept * p.d) * ys, (size_t)((p.R - kept) * p.d) * ys))
    th_fail(__FILE__, __LINE__, "%s: yp rows past offsets[E] written", what);
  free(hy), free(got), free(ref);
  smelt_plan_destroy(gplan);
  smelt_plan_destroy(cplan);
  devs_free((dev[]){gxp, gof, gyp}, 3);
  th_buf_free(&cxp), th_buf_free(&crm), th_buf_free(&cyp);
  dev_weights_free(&g), fwd_free(&r.f), mp_free(&p);
}

static void test_moe_gpu_ffn(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  const smelt_dtype bf = SMELT_DTYPE_BF16, h = SMELT_DTYPE_F16, f = SMELT_DTYPE_F32, i32 = SMELT_DTYPE_I32,
                    i64 = SMELT_DTYPE_I64;
  spec s = {.T = 37, .d = 64, .E = 8, .k = 2, .F = 96, .xdt = bf, .wdt = bf};
  gpu_ffn_case(&s, 0, i64, bf, "ffn T37 d64 F96 E8 top2 bf16, i64 offsets");
  gpu_ffn_case(&s, 0, i32, f, "ffn T37 bf16, i32 offsets, yp f32");
  s = (spec){.T = 1, .d = 32, .E = 8, .k = 2, .F = 48, .xdt = h, .wdt = h};
  gpu_ffn_case(&s, 0, i32, h, "ffn T1 f16");
  s = (spec){.T = 23, .d = 40, .E = 5, .k = 2, .F = 35, .xdt = bf, .wdt = bf};
  gpu_ffn_case(&s, 0, i64, bf, "ffn bf16 F35: rows of 70 bytes, 46 rows end mid 16-byte unit (a SwiGLU tail)");
  s = (spec){.T = 50, .d = 20, .E = 4, .k = 4, .F = 12, .ffn = SMELT_MOE_FFN_MLP, .act = SMELT_ACT_GELU, .b1 = 1};
  gpu_ffn_case(&s, 0, i64, f, "ffn k = E = 4 f32 d20 F12, mlp gelu + b1");
  s = (spec){.T = 29, .d = 64, .E = 6, .k = 1, .F = 40, .xdt = bf, .wdt = bf, .bias = 1};
  gpu_ffn_case(&s, 1, i32, bf, "ffn all tokens on expert 3, bf16");
  s = (spec){.T = 101, .d = 32, .E = 8, .k = 2, .F = 64, .xdt = bf, .wdt = bf, .cap = 0.8,
             .drop = SMELT_MOE_DROP_POSITION, .ffn = SMELT_MOE_FFN_MLP, .act = SMELT_ACT_RELU};
  gpu_ffn_case(&s, 0, i64, bf, "ffn capacity 0.8 position, mlp relu bf16");
  /* F a multiple of 64 (not of 128: a tile's second 64 columns past F), 16-bit: on Hopper the fused up projection */
  s = (spec){.T = 300, .d = 128, .E = 8, .k = 2, .F = 192, .xdt = bf, .wdt = bf};
  gpu_ffn_case(&s, 0, i32, bf, "ffn T300 d128 F192 E8 top2 bf16 (Hopper: gate and up fused with SwiGLU)");
  s = (spec){.T = 300, .d = 64, .E = 8, .k = 2, .F = 128, .xdt = h, .wdt = h};
  gpu_ffn_case(&s, 0, i64, f, "ffn T300 d64 F128 f16, i64 offsets, yp f32 (fused)");
}

/* The layer's forward on CUDA against the CPU parts chained over the GPU's
 * own routing (so near-ties routed otherwise do not matter; the router's
 * own cases compare the routing): y within the CUDA bound, y's row padding
 * untouched (rows pad elements apart), counts and offsets those of the
 * GPU's ids, the statistics those of its counts. With_routing: the
 * caller's routing tensors (i64 counts and offsets); else the layer's
 * own, read back through a second run with them. */
static void gpu_layer_case(const spec *sp, int one_expert, int64_t pad, int with_routing, const char *what) {
  mp p;
  mp_init(&p, sp);
  if (one_expert) all_to_three(&p);
  const size_t es = smelt_dtype_size(p.xdt);
  const int64_t ys = p.d + pad;
  dev_weights g;
  dev_all_new(&p, &g);
  dev lg = dev_new(SMELT_DTYPE_F32, 2, p.T, p.E, NULL), id = dev_new(SMELT_DTYPE_I32, 2, p.T, p.k, NULL),
      wt = dev_new(SMELT_DTYPE_F32, 2, p.T, p.k, NULL), cn = dev_new(SMELT_DTYPE_I64, 1, p.E, 0, NULL),
      of = dev_new(SMELT_DTYPE_I64, 1, p.E + 1, 0, NULL), dr = dev_new(SMELT_DTYPE_I32, 1, 1, 0, NULL),
      gy = dev_new(p.xdt, 2, p.T, ys, NULL), gy2 = dev_new(p.xdt, 2, p.T, p.d, NULL);
  smelt_tensor yv = gy.t;
  yv.shape[1] = p.d;
  smelt_moe_routing rg = {&lg.t, &id.t, &wt.t, &cn.t, &of.t, &dr.t, NULL};
  smelt_plan *gplan = NULL, *cplan = NULL;
  smelt_moe_stats st, st2;
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &g.w, &g.x.t, &gplan));
  if (with_routing) {
    CHECK_OK(smelt_moe_forward_run(gplan, &g.w, &g.x.t, &yv, &rg, &st));
  } else {
    /* The layer's own routing; then the same layer with the caller's, for the reference. */
    CHECK_OK(smelt_moe_forward_run(gplan, &g.w, &g.x.t, &yv, NULL, &st));
    CHECK_OK(smelt_moe_forward_run(gplan, &g.w, &g.x.t, &gy2.t, &rg, &st2));
    CHECK_EQ_INT(st2.kept, st.kept);
  }
  CHECK_OK(smelt_ctx_synchronize(th_cuda()));
  char *hy = dev_read(&gy);
  int32_t *gi = dev_read(&id), *gd = dev_read(&dr);
  float *gw = dev_read(&wt);
  int64_t *gc = dev_read(&cn), *go = dev_read(&of);
  /* The CPU parts over the GPU's routing. */
  int64_t hist[1024] = {0};
  for (int64_t a = 0; a < p.R; a++)
    if (gi[a] >= 0) hist[gi[a]]++;
  const int64_t at = check_counts(&p, hist, gc, SMELT_DTYPE_I64, go, SMELT_DTYPE_I64, gd[0]);
  CHECK_EQ_INT(st.kept, at);
  CHECK_EQ_INT(st.dropped, p.R - at);
  if (one_expert) CHECK_EQ_INT(hist[3], p.T); /* every token's first choice */
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &cplan));
  th_buf cxp = th_buf_new(th_cpu(), (size_t)(p.R * p.d) * es), crm = th_buf_new(th_cpu(), (size_t)p.R * 4),
         cyp = th_buf_new(th_cpu(), (size_t)(p.R * p.d) * 4), cy = th_buf_new(th_cpu(), (size_t)(p.T * p.d) * es);
  smelt_tensor tid = host_tensor(gi, SMELT_DTYPE_I32, 2, p.T, p.k, 0), tof = host_tensor(go, SMELT_DTYPE_I64, 1, p.E + 1, 0, 0),
               twt = host_tensor(gw, SMELT_DTYPE_F32, 2, p.T, p.k, 0),
               txp = host_tensor(cxp.data, p.xdt, 2, p.R, p.d, 0), trm = host_tensor(crm.data, SMELT_DTYPE_I32, 2, p.T, p.k, 0),
               typ = host_tensor(cyp.data, SMELT_DTYPE_F32, 2, p.R, p.d, 0), ty = host_tensor(cy.data, p.xdt, 2, p.T, p.d, 0);
  CHECK_OK(smelt_moe_permute_run(cplan, &p.tx, &tid, &tof, &txp, &trm));
  CHECK_OK(smelt_moe_ffn_run(cplan, &p.w, &txp, &tof, &typ));
  CHECK_OK(smelt_moe_unpermute_run(cplan, &typ, &trm, &twt, &ty));
  double *got = calloc((size_t)(p.T * p.d + 1), 8), *ref = calloc((size_t)(p.T * p.d + 1), 8);
  for (int64_t t = 0; t < p.T; t++) {
    for (int64_t j = 0; j < p.d; j++)
      got[t * p.d + j] = th_get(hy, p.xdt, t * ys + j), ref[t * p.d + j] = th_get(cy.data, p.xdt, t * p.d + j);
    if (pad && !th_all_ff(hy + (size_t)(t * ys + p.d) * es, (size_t)pad * es))
      th_fail(__FILE__, __LINE__, "%s: y's padding of row %lld written", what, (long long)t);
  }
  CHECK(th_compare(what, got, ref, p.T * p.d, cuda_bound(p.xdt), 1e-6));
  free(hy), free(gi), free(gd), free(gw), free(gc), free(go), free(got), free(ref);
  smelt_plan_destroy(gplan);
  smelt_plan_destroy(cplan);
  devs_free((dev[]){lg, id, wt, cn, of, dr, gy, gy2}, 8);
  th_buf_free(&cxp), th_buf_free(&crm), th_buf_free(&cyp), th_buf_free(&cy);
  dev_weights_free(&g), mp_free(&p);
}

static void test_moe_gpu_layer(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  const smelt_dtype bf = SMELT_DTYPE_BF16, h = SMELT_DTYPE_F16;
  spec s = {.T = 37, .d = 64, .E = 8, .k = 2, .F = 96, .xdt = bf, .wdt = bf};
  gpu_layer_case(&s, 0, 8, 1, "layer T37 d64 F96 E8 top2 bf16, y rows 72 apart");
  gpu_layer_case(&s, 0, 0, 0, "layer T37 bf16, the layer's own routing");
  s = (spec){.T = 1, .d = 64, .E = 8, .k = 2, .F = 64, .xdt = bf, .wdt = bf};
  gpu_layer_case(&s, 0, 0, 0, "layer T1 bf16");
  s = (spec){.T = 3, .d = 32, .E = 16, .k = 2, .F = 48, .xdt = h, .wdt = h};
  gpu_layer_case(&s, 0, 0, 1, "layer T3 E16 f16: experts with no token");
  s = (spec){.T = 29, .d = 24, .E = 4, .k = 4, .F = 40};
  gpu_layer_case(&s, 0, 3, 1, "layer k = E = 4 f32 d24, y rows 27 apart");
  s = (spec){.T = 33, .d = 64, .E = 8, .k = 1, .F = 64, .xdt = bf, .wdt = bf, .bias = 1};
  gpu_layer_case(&s, 1, 0, 1, "layer all tokens on expert 3, bf16");
  s = (spec){.T = 101, .d = 64, .E = 8, .k = 2, .F = 96, .xdt = bf, .wdt = bf, .cap = 0.8,
             .drop = SMELT_MOE_DROP_POSITION, .bias = 1};
  gpu_layer_case(&s, 0, 0, 1, "layer T101 capacity 0.8 position bf16");
  s = (spec){.T = 45, .d = 32, .E = 6, .k = 2, .F = 40, .xdt = bf, .wdt = bf, .ffn = SMELT_MOE_FFN_MLP,
             .act = SMELT_ACT_SILU, .b1 = 1, .score = SMELT_MOE_SCORE_SIGMOID};
  gpu_layer_case(&s, 0, 0, 1, "layer mlp silu + b1, sigmoid, bf16");
}

/* The decode path (T·k <= 16: src/cuda/moe_decode.c's rule) taken by the
 * plan, its routing through the layer against the CPU router's (logits,
 * ids but at near-ties, weights, counts and offsets of its ids), and y
 * against the CPU parts over that routing (gpu_layer_case). */
static void gpu_decode_case(const spec *sp, int one_expert, int64_t pad, const char *what) {
  mp p;
  mp_init(&p, sp);
  if (one_expert) all_to_three(&p);
  dev_weights g;
  dev_all_new(&p, &g);
  smelt_plan *gplan = NULL, *cplan = NULL;
  CHECK_OK(smelt_moe_plan(th_cuda(), &p.cfg, &g.w, &g.x.t, &gplan));
  if (!strstr(smelt_plan_describe(gplan), "moe_decode"))
    th_fail(__FILE__, __LINE__, "%s: the plan takes the general path: %s", what, smelt_plan_describe(gplan));
  dev lg = dev_new(SMELT_DTYPE_F32, 2, p.T, p.E, NULL), id = dev_new(SMELT_DTYPE_I32, 2, p.T, p.k, NULL),
      wt = dev_new(SMELT_DTYPE_F32, 2, p.T, p.k, NULL), cn = dev_new(SMELT_DTYPE_I32, 1, p.E, 0, NULL),
      of = dev_new(SMELT_DTYPE_I64, 1, p.E + 1, 0, NULL), dr = dev_new(SMELT_DTYPE_I64, 1, 1, 0, NULL),
      gy = dev_new(p.xdt, 2, p.T, p.d, NULL);
  smelt_moe_routing rg = {&lg.t, &id.t, &wt.t, &cn.t, &of.t, &dr.t, NULL};
  CHECK_OK(smelt_moe_forward_run(gplan, &g.w, &g.x.t, &gy.t, &rg, NULL));
  CHECK_OK(smelt_ctx_synchronize(th_cuda()));
  float *gl = dev_read(&lg), *gw = dev_read(&wt);
  int32_t *gi = dev_read(&id), *gc = dev_read(&cn);
  int64_t *go = dev_read(&of), *gd = dev_read(&dr);
  fwd c;
  fwd_alloc(&c, &p, SMELT_DTYPE_I64);
  smelt_moe_routing rc = routing_of(&c);
  CHECK_OK(smelt_moe_plan(th_cpu(), &p.cfg, &p.w, &p.tx, &cplan));
  CHECK_OK(smelt_moe_route_run(cplan, &p.w, &p.tx, &rc));
  fwd_read_from(&c, F_LOGITS);
  int64_t hist[64] = {0};
  compare_routing(&p, &c, gl, gi, gw, hist, what);
  check_counts(&p, hist, gc, SMELT_DTYPE_I32, go, SMELT_DTYPE_I64, gd[0]);
  if (one_expert) CHECK_EQ_INT(hist[3], p.T);
  free(gl), free(gw), free(gi), free(gc), free(go), free(gd);
  devs_free((dev[]){lg, id, wt, cn, of, dr, gy}, 7);
  fwd_free(&c);
  smelt_plan_destroy(gplan);
  smelt_plan_destroy(cplan);
  dev_weights_free(&g), mp_free(&p);
  gpu_layer_case(sp, one_expert, pad, 1, what);
}

static void test_moe_gpu_decode(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  const smelt_dtype bf = SMELT_DTYPE_BF16, h = SMELT_DTYPE_F16;
  /* d 1024 and F 1536 split K in both GEMVs (their tickets) on any GPU of 8 or more SMs. */
  spec s = {.T = 1, .d = 1024, .E = 8, .k = 2, .F = 1536, .xdt = bf, .wdt = bf};
  gpu_decode_case(&s, 0, 0, "decode T1 d1024 F1536 E8 top2 bf16");
  s = (spec){.T = 1, .d = 1024, .E = 8, .k = 2, .F = 1536, .xdt = h, .wdt = h};
  gpu_decode_case(&s, 0, 8, "decode T1 f16, y rows 1032 apart");
  s = (spec){.T = 3, .d = 512, .E = 8, .k = 2, .F = 768, .xdt = bf, .wdt = bf, .bias = 1};
  gpu_decode_case(&s, 0, 0, "decode T3 top2 bf16 + bias");
  s = (spec){.T = 3, .d = 512, .E = 8, .k = 2, .F = 768, .xdt = h, .wdt = h, .no_renorm = 1, .scale = 2.5};
  gpu_decode_case(&s, 0, 0, "decode T3 top2 f16, no renorm, scale");
  s = (spec){.T = 2, .d = 256, .E = 64, .k = 6, .F = 384, .xdt = bf, .wdt = bf};
  gpu_decode_case(&s, 0, 0, "decode T2 E64 top6 bf16");
  /* (The bench's E64 shape, d 2048 F 1408, is 553 M weights to make and
   * check on the host: 30 s of the suite for no path the smaller ones miss.) */
  s = (spec){.T = 1, .d = 512, .E = 64, .k = 6, .F = 384, .xdt = bf, .wdt = bf};
  gpu_decode_case(&s, 0, 0, "decode T1 d512 F384 E64 top6 bf16");
  s = (spec){.T = 4, .d = 256, .E = 64, .k = 4, .F = 256, .xdt = bf, .wdt = bf, .score = SMELT_MOE_SCORE_SIGMOID,
             .bias = 1, .groups = 8, .topk_groups = 2};
  gpu_decode_case(&s, 0, 0, "decode T4 E64 top4 sigmoid groups 8/2");
  /* Every token on expert 3: one expert's rows in groups of four and a rest. */
  s = (spec){.T = 6, .d = 256, .E = 8, .k = 2, .F = 512, .xdt = bf, .wdt = bf, .bias = 1};
  gpu_decode_case(&s, 1, 0, "decode T6 top2, every token's first choice expert 3");
  s = (spec){.T = 16, .d = 128, .E = 8, .k = 1, .F = 256, .xdt = h, .wdt = h, .bias = 1};
  gpu_decode_case(&s, 1, 0, "decode T16 top1 f16, all on expert 3");
  s = (spec){.T = 16, .d = 192, .E = 16, .k = 1, .F = 320, .xdt = bf, .wdt = bf};
  gpu_decode_case(&s, 0, 0, "decode T16 E16 top1 bf16 (four passes of x·Wr)");
  s = (spec){.T = 2, .d = 64, .E = 6, .k = 2, .F = 72, .xdt = bf, .wdt = bf};
  gpu_decode_case(&s, 0, 0, "decode T2 E6 bf16: Wr rows of 12 bytes, tiles cut by F");
  s = (spec){.T = 1, .d = 100, .E = 16, .k = 4, .F = 60};
  gpu_decode_case(&s, 0, 3, "decode T1 E16 top4 f32 d100 F60, y rows 103 apart");
}

const th_test th_tests_moe[] = {
    {"forward", test_moe_forward},
    {"dtypes", test_moe_dtypes},
    {"edges", test_moe_edges},
    {"skew", test_moe_skew},
    {"capacity", test_moe_capacity},
    {"philox", test_moe_philox},
    {"noise", test_moe_noise},
    {"aux_losses", test_moe_aux_losses},
    {"gradcheck_router", test_moe_gradcheck_router},
    {"gradcheck_ffn", test_moe_gradcheck_ffn},
    {"gradcheck_layer", test_moe_gradcheck_layer},
    {"batch_invariance", test_moe_batch_invariance},
    {"parts", test_moe_parts},
    {"noise_backward_dtypes", test_moe_noise_backward_dtypes},
    {"bad_config", test_moe_bad_config},
    {"bad_runs", test_moe_bad_runs},
    {"gpu_route", test_moe_gpu_route},
    {"gpu_permute", test_moe_gpu_permute},
    {"gpu_unpermute", test_moe_gpu_unpermute},
    {"gpu_ffn", test_moe_gpu_ffn},
    {"gpu_layer", test_moe_gpu_layer},
    {"gpu_decode", test_moe_gpu_decode},
    {0, 0},
};
