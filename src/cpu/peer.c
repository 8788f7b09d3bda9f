/* CPU reference for PEER: retrieval, forward and backward, naive on purpose
 * and in double throughout. It is the oracle the CUDA kernels are checked
 * against (ids, scores, y, every gradient) and a working backend.
 *
 * Selection follows the definition of smelt/peer.h literally: each dim's
 * scores sorted in full by (value descending, NaN first, index ascending),
 * the top-k kept, then dims combined pairwise (k·k sums, sorted the same
 * way). The tests check this equals the exhaustive top-k over all N experts.
 *
 * The backward recomputes q, the scores of the given ids and the gates;
 * expert gradients are summed per expert in (token, head, slot) order
 * after sorting the uses by expert, so du and dv (dense or sparse) need
 * memory for the uses and one row, not N rows of doubles. */
#include "../core/checked.h"
#include "../core/peer_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_peer"

static double ld(const smelt_tensor *t, int64_t i) {
  return smelt__load_f64(t->data, t->dtype, smelt__tensor_offset(t, i));
}
static void st(const smelt_tensor *t, int64_t i, double v) {
  smelt__store_f64(t->data, t->dtype, smelt__tensor_offset(t, i), v);
}

/* Everything one call needs, with the normalized sub-keys in double. */
typedef struct ref {
  const smelt__peer_state *ps;
  const smelt_peer_weights *w;
  const smelt_tensor *x;
  int kh;                           /* key tables: h with per-head keys, else 1 */
  double *keys[SMELT_PEER_MAX_DIMS]; /* Cn_i [kh, n_i, dsub] */
  double *knorm[SMELT_PEER_MAX_DIMS]; /* ||C_i row|| [kh, n_i] */
  const void *u, *v;                /* expert tables (dense tensors or the store's host tables) */
  smelt_dtype wdt;
  smelt__rank *dimbuf, *combbuf, *list, *next; /* selection scratch */
  double *q, *qn;                    /* [h*dq] of the current token, [dq] of the current head */
} ref;

static void ref_free(ref *r) {
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) {
    free(r->keys[i]);
    free(r->knorm[i]);
  }
  free(r->dimbuf);
  free(r->combbuf);
  free(r->list);
  free(r->next);
  free(r->q);
  free(r->qn);
}

/* Scratch of n elements; the first failure (a size that overflows, or no
 * memory) is kept in *s and later calls do nothing. */
static void *scratch(int64_t n, size_t elem, const char *what, smelt_status *s) {
  size_t bytes = 0;
  if (*s || (*s = smelt__bytes(n, elem, &bytes, OP, what))) return NULL;
  void *p = malloc(bytes ? bytes : 1);
  if (!p) *s = smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": no host memory for the CPU reference's %s", what);
  return p;
}

static smelt_status ref_init(ref *r, const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x) {
  memset(r, 0, sizeof *r);
  r->ps = ps;
  r->w = w;
  r->x = x;
  r->kh = ps->cfg.per_head_keys ? (int)ps->h : 1;
  int64_t nmax = 0, rows = 0, cells = 0;
  smelt_status s = SMELT_OK;
  for (int i = 0; i < ps->p && !s; i++) {
    if (ps->n[i] > nmax) nmax = ps->n[i];
    if ((s = smelt__mul_i64(r->kh, ps->n[i], &rows, OP, "the sub-key rows")) ||
        (s = smelt__mul_i64(rows, ps->dsub, &cells, OP, "the sub-key table")))
      break;
    r->keys[i] = (double *)scratch(cells, sizeof(double), "sub-key table", &s);
    r->knorm[i] = (double *)scratch(rows, sizeof(double), "sub-key norms", &s);
    for (int64_t a = 0; !s && a < rows; a++) { /* C_i: [kh * n_i, dsub] */
      double ss = 0;
      for (int64_t d = 0; d < ps->dsub; d++) {
        const double c = ld(w->sub_keys[i], a * ps->dsub + d);
        r->keys[i][a * ps->dsub + d] = c;
        ss += c * c;
      }
      r->knorm[i][a] = sqrt(ss);
      if (ps->cfg.key_l2_norm) {
        const double div = fmax(r->knorm[i][a], ps->cfg.l2_eps);
        for (int64_t d = 0; d < ps->dsub; d++) r->keys[i][a * ps->dsub + d] /= div;
      }
    }
  }
  int64_t kk = 0;
  if (!s) s = smelt__mul_i64(ps->k, ps->k, &kk, OP, "the k x k combination of two dims' candidates");
  r->dimbuf = (smelt__rank *)scratch(nmax, sizeof(smelt__rank), "per-dim candidates", &s);
  r->combbuf = (smelt__rank *)scratch(kk, sizeof(smelt__rank), "k x k combination", &s);
  r->list = (smelt__rank *)scratch(ps->k, sizeof(smelt__rank), "top-k list", &s);
  r->next = (smelt__rank *)scratch(ps->k, sizeof(smelt__rank), "top-k list", &s);
  r->q = (double *)scratch(ps->h * ps->dq, sizeof(double), "queries", &s);
  r->qn = (double *)scratch(ps->dq, sizeof(double), "query", &s);
  if (w->u) {
    r->u = w->u->data;
    r->v = w->v->data;
    r->wdt = w->u->dtype;
  } else {
    r->u = w->store->u_host;
    r->v = w->store->v_host;
    r->wdt = w->store->dtype;
  }
  if (s) ref_free(r);
  return s;
}

/* q = x[t] · Wq + bq  [h*dq] */
static void project(ref *r, int64_t t) {
  const smelt__peer_state *ps = r->ps;
  const int64_t hd = ps->h * ps->dq;
  for (int64_t j = 0; j < hd; j++) r->q[j] = r->w->bq ? ld(r->w->bq, j) : 0.0;
  for (int64_t i = 0; i < ps->din; i++) {
    const double xv = ld(r->x, t * ps->din + i);
    for (int64_t j = 0; j < hd; j++) r->q[j] += xv * ld(r->w->wq, i * hd + j);
  }
}

/* A norm parameter of head hh at column c, or `dflt` when absent. */
static double norm_param(const ref *r, const smelt_tensor *t, int64_t hh, int64_t c, double dflt) {
  if (!t) return dflt;
  return ld(t, (r->ps->norm_per_head ? hh * r->ps->dq : 0) + c);
}

/* Statistics a head's normalization keeps for the backward. */
typedef struct norm_stats {
  double mean, rstd, norm;
} norm_stats;

/* qn = norm(q of head hh)  [dq] */
static void normalize(ref *r, int64_t hh, norm_stats *ns) {
  const smelt__peer_state *ps = r->ps;
  const double *q = r->q + hh * ps->dq;
  double *qn = r->qn;
  const int64_t dq = ps->dq;
  const smelt_peer_weights *w = r->w;
  memset(ns, 0, sizeof *ns);
  switch (ps->cfg.query_norm) {
    case SMELT_PEER_NORM_NONE:
      memcpy(qn, q, (size_t)dq * sizeof *qn);
      break;
    case SMELT_PEER_NORM_LAYERNORM: {
      double m = 0, v = 0;
      for (int64_t c = 0; c < dq; c++) m += q[c];
      m /= (double)dq;
      for (int64_t c = 0; c < dq; c++) v += (q[c] - m) * (q[c] - m);
      v /= (double)dq;
      ns->mean = m;
      ns->rstd = 1.0 / sqrt(v + ps->cfg.norm_eps);
      for (int64_t c = 0; c < dq; c++)
        qn[c] = (q[c] - m) * ns->rstd * norm_param(r, w->norm_weight, hh, c, 1.0) + norm_param(r, w->norm_bias, hh, c, 0.0);
      break;
    }
    case SMELT_PEER_NORM_BATCHNORM:
      for (int64_t c = 0; c < dq; c++) {
        const double rs = 1.0 / sqrt(norm_param(r, w->bn_var, hh, c, 1.0) + ps->cfg.norm_eps);
        qn[c] = (q[c] - norm_param(r, w->bn_mean, hh, c, 0.0)) * rs * norm_param(r, w->norm_weight, hh, c, 1.0) +
                norm_param(r, w->norm_bias, hh, c, 0.0);
      }
      break;
    case SMELT_PEER_NORM_L2: {
      double ss = 0;
      for (int64_t c = 0; c < dq; c++) ss += q[c] * q[c];
      ns->norm = sqrt(ss);
      const double div = fmax(ns->norm, ps->cfg.l2_eps);
      for (int64_t c = 0; c < dq; c++) qn[c] = q[c] / div;
      break;
    }
    default: break;
  }
}

/* Normalized sub-key a of dim i for head hh. */
static const double *key_row(const ref *r, int i, int64_t hh, int64_t a) {
  const int64_t table = r->ps->cfg.per_head_keys ? hh : 0;
  return r->keys[i] + (table * r->ps->n[i] + a) * r->ps->dsub;
}

/* s_i[a] = qn_i · Cn_i[a] */
static double sub_score(const ref *r, int i, int64_t hh, int64_t a) {
  const double *c = key_row(r, i, hh, a), *q = r->qn + i * r->ps->dsub;
  double s = 0;
  for (int64_t d = 0; d < r->ps->dsub; d++) s += q[d] * c[d];
  return s;
}

/* The top-k experts of head hh for the current qn, best first, into r->list. */
static void select_experts(ref *r, int64_t hh) {
  const smelt__peer_state *ps = r->ps;
  const int64_t k = ps->k;
  int64_t len = 0;
  for (int i = 0; i < ps->p; i++) {
    const int64_t n = ps->n[i];
    for (int64_t a = 0; a < n; a++) {
      r->dimbuf[a].v = sub_score(r, i, hh, a);
      r->dimbuf[a].i = a;
    }
    qsort(r->dimbuf, (size_t)n, sizeof(smelt__rank), smelt__rank_cmp);
    const int64_t ki = n < k ? n : k;
    if (i == 0) {
      memcpy(r->list, r->dimbuf, (size_t)ki * sizeof(smelt__rank));
      len = ki;
      continue;
    }
    int64_t m = 0; /* the len x ki sums, id prefix * n_i + a */
    for (int64_t a = 0; a < len; a++)
      for (int64_t b = 0; b < ki; b++, m++) {
        r->combbuf[m].v = r->list[a].v + r->dimbuf[b].v;
        r->combbuf[m].i = r->list[a].i * n + r->dimbuf[b].i;
      }
    qsort(r->combbuf, (size_t)m, sizeof(smelt__rank), smelt__rank_cmp);
    len = m < k ? m : k;
    memcpy(r->list, r->combbuf, (size_t)len * sizeof(smelt__rank));
  }
}

/* Gates of the k scores (in place into g). */
static void gates(smelt_peer_gate gate, const double *s, int64_t k, double *g) {
  if (gate == SMELT_PEER_GATE_SOFTMAX) {
    double m = s[0], sum = 0;
    for (int64_t j = 1; j < k; j++) m = fmax(m, s[j]);
    for (int64_t j = 0; j < k; j++) sum += (g[j] = exp(s[j] - m));
    for (int64_t j = 0; j < k; j++) g[j] /= sum;
  } else {
    for (int64_t j = 0; j < k; j++)
      g[j] = gate == SMELT_PEER_GATE_SIGMOID ? 1.0 / (1.0 + exp(-s[j])) : (s[j] > 0 ? s[j] : 0.0);
  }
}

static double act(smelt_act a, double z) { return smelt_act_apply(a, z, 0.0); }

static double u_at(const ref *r, int64_t e, int64_t i, int64_t j) {
  return smelt__load_f64(r->u, r->wdt, (e * r->ps->din + i) * r->ps->he + j);
}
static double v_at(const ref *r, int64_t e, int64_t j, int64_t c) {
  return smelt__load_f64(r->v, r->wdt, (e * r->ps->he + j) * r->ps->dout + c);
}

/* z_j = x[t] · U_e[:, j]  [h_e] */
static void down(const ref *r, int64_t t, int64_t e, double *z) {
  const smelt__peer_state *ps = r->ps;
  for (int64_t j = 0; j < ps->he; j++) z[j] = 0;
  for (int64_t i = 0; i < ps->din; i++) {
    const double xv = ld(r->x, t * ps->din + i);
    for (int64_t j = 0; j < ps->he; j++) z[j] += xv * u_at(r, e, i, j);
  }
}

/* ids and scores of every (token, head) into host arrays [T*h*k]. */
static void retrieve_all(ref *r, int64_t *ids, double *scores) {
  const smelt__peer_state *ps = r->ps;
  norm_stats ns;
  for (int64_t t = 0; t < ps->T; t++) {
    project(r, t);
    for (int64_t hh = 0; hh < ps->h; hh++) {
      normalize(r, hh, &ns);
      select_experts(r, hh);
      for (int64_t j = 0; j < ps->k; j++) {
        ids[(t * ps->h + hh) * ps->k + j] = r->list[j].i;
        scores[(t * ps->h + hh) * ps->k + j] = r->list[j].v;
      }
    }
  }
}

static void write_topk(const smelt__peer_state *ps, const int64_t *ids, const double *scores, const smelt_tensor *tid,
                       const smelt_tensor *tsc) {
  const int64_t n = ps->T * ps->h * ps->k;
  for (int64_t i = 0; i < n; i++) {
    if (tid) st(tid, i, (double)ids[i]);
    if (tsc) st(tsc, i, scores[i]);
  }
}

/* The selection (ids, scores), and with y the forward (retrieval: y NULL,
 * and no batch of the store's policy). */
static smelt_status select_and_mix(const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x,
                                   const smelt_tensor *y, const smelt_tensor *tid, const smelt_tensor *tsc) {
  ref r;
  smelt_status s = ref_init(&r, ps, w, x);
  if (s) return s;
  int64_t n = 0;
  if ((s = smelt__mul_i64(ps->T, ps->h * ps->k, &n, OP, "tokens x heads x k"))) {
    ref_free(&r);
    return s;
  }
  int64_t *ids = (int64_t *)scratch(n, sizeof(int64_t), "selected ids", &s);
  double *scores = (double *)scratch(n, sizeof(double), "selected scores", &s);
  double *g = (double *)scratch(ps->k, sizeof(double), "gates", &s);
  double *z = (double *)scratch(ps->he, sizeof(double), "expert hidden", &s);
  double *yt = (double *)scratch(ps->dout, sizeof(double), "output row", &s);
  if (s) goto done;
  retrieve_all(&r, ids, scores);
  if (y && ps->store && (s = smelt__peer_store_batch_cpu(ps->store, ids, n, OP))) goto done;
  for (int64_t t = 0; y && t < ps->T; t++) { /* y[t] = Σ_h Σ_j g_j act(x[t] U_e) V_e */
    for (int64_t c = 0; c < ps->dout; c++) yt[c] = 0;
    for (int64_t hh = 0; hh < ps->h; hh++) {
      const int64_t base = (t * ps->h + hh) * ps->k;
      gates(ps->cfg.gate, scores + base, ps->k, g);
      for (int64_t j = 0; j < ps->k; j++) {
        const int64_t e = ids[base + j];
        down(&r, t, e, z);
        for (int64_t jj = 0; jj < ps->he; jj++) {
          const double a = g[j] * act(ps->cfg.activation, z[jj]);
          for (int64_t c = 0; c < ps->dout; c++) yt[c] += a * v_at(&r, e, jj, c);
        }
      }
    }
    for (int64_t c = 0; c < ps->dout; c++) st(y, t * ps->dout + c, yt[c]);
  }
  write_topk(ps, ids, scores, tid, tsc);
done:
  free(ids);
  free(scores);
  free(g);
  free(z);
  free(yt);
  ref_free(&r);
  return s;
}

/* ---------------------------------------------------------------- backward */

/* One use of an expert: what its gradient rows need. */
typedef struct use {
  int64_t e, t, pos; /* pos = (t*h + head)*k + slot: the sort's tie-break keeps that order */
} use;

static int use_cmp(const void *pa, const void *pb) {
  const use *a = (const use *)pa, *b = (const use *)pb;
  if (a->e != b->e) return a->e < b->e ? -1 : 1;
  return (a->pos > b->pos) - (a->pos < b->pos);
}

/* dq of head hh from dqn (through the query norm); accumulates dγ, dβ. */
static void norm_backward(const ref *r, int64_t hh, const norm_stats *ns, const double *q, const double *dqn,
                          double *dq, double *dgamma, double *dbeta) {
  const smelt__peer_state *ps = r->ps;
  const smelt_peer_weights *w = r->w;
  const int64_t dq_n = ps->dq, off = ps->norm_per_head ? hh * dq_n : 0;
  switch (ps->cfg.query_norm) {
    case SMELT_PEER_NORM_NONE:
      for (int64_t c = 0; c < dq_n; c++) dq[c] = dqn[c];
      break;
    case SMELT_PEER_NORM_LAYERNORM: {
      double m1 = 0, m2 = 0;
      for (int64_t c = 0; c < dq_n; c++) {
        const double xh = (q[c] - ns->mean) * ns->rstd, dxh = dqn[c] * norm_param(r, w->norm_weight, hh, c, 1.0);
        m1 += dxh;
        m2 += dxh * xh;
        if (dgamma) dgamma[off + c] += dqn[c] * xh;
        if (dbeta) dbeta[off + c] += dqn[c];
      }
      m1 /= (double)dq_n;
      m2 /= (double)dq_n;
      for (int64_t c = 0; c < dq_n; c++) {
        const double xh = (q[c] - ns->mean) * ns->rstd, dxh = dqn[c] * norm_param(r, w->norm_weight, hh, c, 1.0);
        dq[c] = ns->rstd * (dxh - m1 - xh * m2);
      }
      break;
    }
    case SMELT_PEER_NORM_BATCHNORM:
      for (int64_t c = 0; c < dq_n; c++) {
        const double rs = 1.0 / sqrt(norm_param(r, w->bn_var, hh, c, 1.0) + ps->cfg.norm_eps);
        const double xh = (q[c] - norm_param(r, w->bn_mean, hh, c, 0.0)) * rs;
        dq[c] = dqn[c] * norm_param(r, w->norm_weight, hh, c, 1.0) * rs;
        if (dgamma) dgamma[off + c] += dqn[c] * xh;
        if (dbeta) dbeta[off + c] += dqn[c];
      }
      break;
    case SMELT_PEER_NORM_L2: {
      if (ns->norm > ps->cfg.l2_eps) {
        double dot = 0;
        for (int64_t c = 0; c < dq_n; c++) dot += r->qn[c] * dqn[c];
        for (int64_t c = 0; c < dq_n; c++) dq[c] = (dqn[c] - r->qn[c] * dot) / ns->norm;
      } else {
        for (int64_t c = 0; c < dq_n; c++) dq[c] = dqn[c] / ps->cfg.l2_eps;
      }
      break;
    }
    default: break;
  }
}

/* Zero every element of an optional output. */
static void zero(const smelt_tensor *t) {
  if (!t) return;
  const int64_t n = smelt_tensor_numel(t);
  for (int64_t i = 0; i < n; i++) st(t, i, 0.0);
}

static smelt_status backward(const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x,
                             const smelt_tensor *tid, const smelt_tensor *dy, const smelt_peer_grads *gr) {
  const int64_t T = ps->T, h = ps->h, k = ps->k, he = ps->he, dq_n = ps->dq, hd = h * dq_n, dsub = ps->dsub;
  const int64_t nuse = T * h * k;
  for (int64_t i = 0; i < nuse; i++) {
    const double e = ld(tid, i);
    if (!(e >= 0 && e < (double)ps->N))
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": ids[%lld]=%.0f is outside [0, num_experts=%lld)",
                          (long long)i, e, (long long)ps->N);
  }
  ref r;
  smelt_status s = ref_init(&r, ps, w, x);
  if (s) return s;
  const int kh = r.kh;
  const int64_t nparam = ps->norm_per_head ? hd : dq_n;
  double *dwq = gr->dwq ? (double *)calloc((size_t)(ps->din * hd), sizeof(double)) : NULL;
  double *dbq = gr->dbq ? (double *)calloc((size_t)hd, sizeof(double)) : NULL;
  double *dgamma = gr->dnorm_weight ? (double *)calloc((size_t)nparam, sizeof(double)) : NULL;
  double *dbeta = gr->dnorm_bias ? (double *)calloc((size_t)nparam, sizeof(double)) : NULL;
  double *dkn[SMELT_PEER_MAX_DIMS] = {0};
  int ok = (!gr->dwq || dwq) && (!gr->dbq || dbq) && (!gr->dnorm_weight || dgamma) && (!gr->dnorm_bias || dbeta);
  for (int i = 0; i < ps->p; i++) {
    dkn[i] = (double *)calloc((size_t)(kh * ps->n[i] * dsub), sizeof(double));
    ok &= dkn[i] != NULL;
  }
  double *dxt = (double *)malloc((size_t)ps->din * sizeof(double));
  double *dyt = (double *)malloc((size_t)ps->dout * sizeof(double));
  double *dqt = (double *)malloc((size_t)hd * sizeof(double));
  double *dqn = (double *)malloc((size_t)dq_n * sizeof(double));
  double *sc = (double *)malloc((size_t)k * sizeof(double));
  double *g = (double *)malloc((size_t)k * sizeof(double));
  double *dg = (double *)malloc((size_t)k * sizeof(double));
  double *ds = (double *)malloc((size_t)k * sizeof(double));
  double *z = (double *)malloc((size_t)he * sizeof(double));
  use *uses = (use *)malloc((size_t)(nuse ? nuse : 1) * sizeof(use));
  double *ua = (double *)malloc((size_t)(nuse * he + 1) * sizeof(double));  /* a = g act(z) per use */
  double *udz = (double *)malloc((size_t)(nuse * he + 1) * sizeof(double)); /* dz per use */
  double *row = (double *)malloc((size_t)(ps->din > ps->dout ? ps->din : ps->dout) * (size_t)he * sizeof(double));
  ok &= dxt && dyt && dqt && dqn && sc && g && dg && ds && z && uses && ua && udz && row;
  if (!ok) {
    s = smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": no host memory for the backward's scratch");
    goto done;
  }
  const smelt_act a_fn = ps->cfg.activation;
  norm_stats ns;
  for (int64_t t = 0; t < T; t++) {
    project(&r, t);
    for (int64_t i = 0; i < ps->din; i++) dxt[i] = 0;
    for (int64_t c = 0; c < ps->dout; c++) dyt[c] = ld(dy, t * ps->dout + c);
    for (int64_t hh = 0; hh < h; hh++) {
      const int64_t base = (t * h + hh) * k;
      normalize(&r, hh, &ns);
      /* scores of the given ids: s = Σ_i s_i[digit_i(e)] */
      for (int64_t j = 0; j < k; j++) {
        int64_t digit[SMELT_PEER_MAX_DIMS], e = (int64_t)ld(tid, base + j);
        for (int i = ps->p - 1; i >= 0; i--) {
          digit[i] = e % ps->n[i];
          e /= ps->n[i];
        }
        double v = 0;
        for (int i = 0; i < ps->p; i++) v += sub_score(&r, i, hh, digit[i]);
        sc[j] = v;
      }
      gates(ps->cfg.gate, sc, k, g);
      for (int64_t j = 0; j < k; j++) { /* the expert's backward; dg_j */
        const int64_t e = (int64_t)ld(tid, base + j), u = base + j;
        down(&r, t, e, z);
        dg[j] = 0;
        for (int64_t jj = 0; jj < he; jj++) {
          double da = 0;
          for (int64_t c = 0; c < ps->dout; c++) da += dyt[c] * v_at(&r, e, jj, c);
          const double av = act(a_fn, z[jj]);
          dg[j] += da * av;
          ua[u * he + jj] = g[j] * av;
          udz[u * he + jj] = da * g[j] * smelt__act_grad(a_fn, z[jj], 0.0);
        }
        for (int64_t i = 0; i < ps->din; i++)
          for (int64_t jj = 0; jj < he; jj++) dxt[i] += udz[u * he + jj] * u_at(&r, e, i, jj);
        uses[u].e = e;
        uses[u].t = t;
        uses[u].pos = u;
      }
      /* gates -> scores */
      double gdg = 0;
      for (int64_t j = 0; j < k; j++) gdg += g[j] * dg[j];
      for (int64_t j = 0; j < k; j++)
        ds[j] = ps->cfg.gate == SMELT_PEER_GATE_SOFTMAX   ? g[j] * (dg[j] - gdg)
                : ps->cfg.gate == SMELT_PEER_GATE_SIGMOID ? dg[j] * g[j] * (1.0 - g[j])
                                                          : (sc[j] > 0 ? dg[j] : 0.0);
      /* scores -> qn and the normalized sub-keys */
      for (int64_t c = 0; c < dq_n; c++) dqn[c] = 0;
      const int64_t table = ps->cfg.per_head_keys ? hh : 0;
      for (int64_t j = 0; j < k; j++) {
        int64_t e = (int64_t)ld(tid, base + j);
        for (int i = ps->p - 1; i >= 0; i--) {
          const int64_t a = e % ps->n[i];
          e /= ps->n[i];
          const double *cn = key_row(&r, i, hh, a), *qi = r.qn + i * dsub;
          double *dc = dkn[i] + (table * ps->n[i] + a) * dsub;
          for (int64_t d = 0; d < dsub; d++) {
            dqn[i * dsub + d] += ds[j] * cn[d];
            dc[d] += ds[j] * qi[d];
          }
        }
      }
      norm_backward(&r, hh, &ns, r.q + hh * dq_n, dqn, dqt + hh * dq_n, dgamma, dbeta);
    }
    /* q = x Wq + bq */
    for (int64_t j = 0; j < hd; j++) {
      if (dbq) dbq[j] += dqt[j];
    }
    for (int64_t i = 0; i < ps->din; i++) {
      const double xv = ld(x, t * ps->din + i);
      double acc = 0;
      for (int64_t j = 0; j < hd; j++) {
        acc += ld(w->wq, i * hd + j) * dqt[j];
        if (dwq) dwq[i * hd + j] += xv * dqt[j];
      }
      dxt[i] += acc;
    }
    if (gr->dx)
      for (int64_t i = 0; i < ps->din; i++) st(gr->dx, t * ps->din + i, dxt[i]);
  }
  if (gr->dwq)
    for (int64_t i = 0; i < ps->din * hd; i++) st(gr->dwq, i, dwq[i]);
  if (gr->dbq)
    for (int64_t j = 0; j < hd; j++) st(gr->dbq, j, dbq[j]);
  if (gr->dnorm_weight)
    for (int64_t j = 0; j < nparam; j++) st(gr->dnorm_weight, j, dgamma[j]);
  if (gr->dnorm_bias)
    for (int64_t j = 0; j < nparam; j++) st(gr->dnorm_bias, j, dbeta[j]);
  for (int i = 0; i < ps->p; i++) { /* through the key normalization */
    if (!gr->dsub_keys[i]) continue;
    const int64_t rows = kh * ps->n[i];
    for (int64_t a = 0; a < rows; a++) {
      const double *dc = dkn[i] + a * dsub, *cn = r.keys[i] + a * dsub;
      double dot = 0;
      for (int64_t d = 0; d < dsub; d++) dot += cn[d] * dc[d];
      for (int64_t d = 0; d < dsub; d++) {
        double v = dc[d];
        if (ps->cfg.key_l2_norm)
          v = r.knorm[i][a] > ps->cfg.l2_eps ? (dc[d] - cn[d] * dot) / r.knorm[i][a] : dc[d] / ps->cfg.l2_eps;
        st(gr->dsub_keys[i], a * dsub + d, v);
      }
    }
  }
  /* dU, dV: per expert, its uses in (token, head, slot) order; the sparse
   * form stores the same rows at the expert's rank among the distinct ids */
  zero(gr->du);
  zero(gr->dv);
  if (gr->du || gr->dv || gr->grad_ids) {
    qsort(uses, (size_t)nuse, sizeof(use), use_cmp);
    const int64_t vrow = he * ps->dout, urow = ps->din * he;
    int64_t rank = 0;
    for (int64_t b = 0; b < nuse; rank++) {
      int64_t end = b;
      while (end < nuse && uses[end].e == uses[b].e) end++;
      const int64_t e = uses[b].e;
      if (gr->grad_ids) st(gr->grad_ids, rank, (double)e);
      if (gr->dv || gr->dv_rows) { /* dV_e[j, c] = Σ a_j dy[t, c] */
        for (int64_t i = 0; i < vrow; i++) row[i] = 0;
        for (int64_t m = b; m < end; m++)
          for (int64_t jj = 0; jj < he; jj++)
            for (int64_t c = 0; c < ps->dout; c++)
              row[jj * ps->dout + c] += ua[uses[m].pos * he + jj] * ld(dy, uses[m].t * ps->dout + c);
        for (int64_t i = 0; i < vrow; i++) {
          if (gr->dv) st(gr->dv, e * vrow + i, row[i]);
          if (gr->dv_rows) st(gr->dv_rows, rank * vrow + i, row[i]);
        }
      }
      if (gr->du || gr->du_rows) { /* dU_e[i, j] = Σ dz_j x[t, i] */
        for (int64_t i = 0; i < urow; i++) row[i] = 0;
        for (int64_t m = b; m < end; m++)
          for (int64_t i = 0; i < ps->din; i++) {
            const double xv = ld(x, uses[m].t * ps->din + i);
            for (int64_t jj = 0; jj < he; jj++) row[i * he + jj] += udz[uses[m].pos * he + jj] * xv;
          }
        for (int64_t i = 0; i < urow; i++) {
          if (gr->du) st(gr->du, e * urow + i, row[i]);
          if (gr->du_rows) st(gr->du_rows, rank * urow + i, row[i]);
        }
      }
      b = end;
    }
    if (gr->grad_ids)
      for (int64_t i = rank; i < nuse; i++) st(gr->grad_ids, i, -1.0);
    for (int64_t i = rank * urow; gr->du_rows && i < nuse * urow; i++) st(gr->du_rows, i, 0.0);
    for (int64_t i = rank * vrow; gr->dv_rows && i < nuse * vrow; i++) st(gr->dv_rows, i, 0.0);
    if (gr->grad_count) st(gr->grad_count, 0, (double)rank);
  }
done:
  free(dwq);
  free(dbq);
  free(dgamma);
  free(dbeta);
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) free(dkn[i]);
  free(dxt);
  free(dyt);
  free(dqt);
  free(dqn);
  free(sc);
  free(g);
  free(dg);
  free(ds);
  free(z);
  free(uses);
  free(ua);
  free(udz);
  free(row);
  ref_free(&r);
  return s;
}

/* Retrieval is the forward without y. */
static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt__peer_args *a = (const smelt__peer_args *)args;
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const smelt_tensor *const *t = a->t;
  if (a->mode == SMELT__PEER_BACKWARD) return backward(ps, a->w, t[SMELT__PT_X], t[SMELT__PT_IDS_IN], t[SMELT__PT_DY], a->g);
  return select_and_mix(ps, a->w, t[SMELT__PT_X], t[SMELT__PT_Y], t[SMELT__PT_IDS], t[SMELT__PT_SCORES]);
}

const smelt__backend smelt__cpu_peer = {.run = run};
