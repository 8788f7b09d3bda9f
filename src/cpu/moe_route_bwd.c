/* The router's gradients on the CPU: the aux losses (values and their
 * gradient through the full softmax p), and d logits from d weights through
 * scaling, renormalization, the selection (a constant) and the score
 * function. Both route the logits again, so they see exactly the forward's
 * selection, drops included. */
#include "../core/checked.h"
#include "moe_cpu.h"

#include <math.h>
#include <stdlib.h>

/* Token t's softmax p (whatever the score function) and its logsumexp. */
static double softmax_row(const smelt__moe_state *ms, const smelt_tensor *logits, int64_t t, double *p) {
  double m = -INFINITY, sum = 0;
  for (int64_t e = 0; e < ms->E; e++) {
    p[e] = smelt__moe_get(logits, t * ms->E + e);
    m = p[e] > m || isnan(p[e]) ? p[e] : m;
  }
  if (m == -INFINITY) return m;
  for (int64_t e = 0; e < ms->E; e++) sum += p[e] = exp(p[e] - m);
  for (int64_t e = 0; e < ms->E; e++) p[e] /= sum;
  return m + log(sum);
}

smelt_status smelt__moe_cpu_aux(const smelt__moe_state *ms, const smelt_tensor *const *t, const smelt__moe_route *r,
                                double *dlogits) {
  const int64_t T = ms->T, E = ms->E;
  const smelt_tensor *logits = t[SMELT__MT_LOGITS_IN];
  size_t bytes = 0;
  smelt_status s = smelt__bytes(T * E + T, sizeof(double), &bytes, MOE_OP, "the aux losses' scratch");
  if (s) return s;
  double *p = (double *)malloc(bytes ? bytes : 1), *lse = p + T * E;
  if (!p) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the aux losses");
  double lb = 0, z = 0;
  const double c_lb = T ? ms->cfg.aux_loss_coeff * (double)E / ((double)ms->k * (double)T * (double)T) : 0.0;
  const double c_z = T ? ms->cfg.z_loss_coeff / (double)T : 0.0;
  for (int64_t tk = 0; tk < T; tk++) {
    lse[tk] = softmax_row(ms, logits, tk, p + tk * E);
    for (int64_t e = 0; e < E; e++) lb += (double)r->sel_count[e] * p[tk * E + e];
    z += lse[tk] * lse[tk];
  }
  if (t[SMELT__MT_AUX]) {
    smelt__moe_set(t[SMELT__MT_AUX], 0, c_lb ? c_lb * lb : 0.0);
    smelt__moe_set(t[SMELT__MT_AUX], 1, c_z ? c_z * z : 0.0);
  }
  for (int64_t tk = 0; dlogits && tk < T; tk++) {
    const double *pt = p + tk * E;
    double dot = 0;
    for (int64_t e = 0; e < E; e++) dot += (double)r->sel_count[e] * pt[e];
    for (int64_t j = 0; j < E; j++) {
      if (c_lb) dlogits[tk * E + j] += c_lb * pt[j] * ((double)r->sel_count[j] - dot);
      if (c_z) dlogits[tk * E + j] += 2.0 * c_z * lse[tk] * pt[j];
    }
  }
  free(p);
  return SMELT_OK;
}

/* Routes t[LOGITS_IN], hands the routing and a zeroed [T, E] gradient to fn,
 * then stores the gradient in t[DLOGITS] (when present). */
static smelt_status with_routing(const smelt__moe_state *ms, const smelt_tensor *const *t,
                                 smelt_status (*fn)(const smelt__moe_state *, const smelt_tensor *const *,
                                                    const smelt__moe_route *, double *)) {
  smelt__moe_route r;
  smelt_status s = smelt__moe_route_compute(ms, t[SMELT__MT_LOGITS_IN], t[SMELT__MT_BIAS], &r);
  if (s) return s;
  const int64_t n = ms->T * ms->E;
  double *g = (double *)calloc(n ? (size_t)n : 1, sizeof(double));
  if (!g) s = smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the logits' gradient");
  if (!s) s = fn(ms, t, &r, g);
  if (!s && t[SMELT__MT_DLOGITS])
    for (int64_t i = 0; i < n; i++) smelt__moe_set(t[SMELT__MT_DLOGITS], i, g[i]);
  free(g);
  smelt__moe_route_free(&r);
  return s;
}

smelt_status smelt__moe_cpu_aux_run(const smelt__moe_state *ms, const smelt_tensor *const *t) {
  return with_routing(ms, t, smelt__moe_cpu_aux);
}

/* d scores of token tk from its weights' gradient (dropped entries ignored). */
static void score_grad(const smelt__moe_state *ms, const smelt_tensor *dw, const smelt__moe_route *r, int64_t tk,
                       double *ds) {
  const int64_t k = ms->k, E = ms->E;
  const double *s = r->s + tk * E, sf = ms->cfg.scaling_factor;
  double z = ms->cfg.score == SMELT_MOE_SCORE_SIGMOID ? 1e-20 : 0.0, gu_dot = 0;
  for (int64_t i = 0; i < k; i++) {
    const double g = r->kept[tk * k + i] ? smelt__moe_get(dw, tk * k + i) : 0.0;
    z += s[r->sel[tk * k + i]];
    gu_dot += g * s[r->sel[tk * k + i]];
  }
  const int norm = smelt__moe_renormalizes(ms);
  for (int64_t e = 0; e < E; e++) ds[e] = 0;
  for (int64_t i = 0; i < k; i++) {
    const double g = r->kept[tk * k + i] ? smelt__moe_get(dw, tk * k + i) : 0.0;
    ds[r->sel[tk * k + i]] += norm ? sf * (g / z - gu_dot / (z * z)) : sf * g;
  }
}

static smelt_status route_grad(const smelt__moe_state *ms, const smelt_tensor *const *t, const smelt__moe_route *r,
                               double *g) {
  const int64_t E = ms->E;
  double *ds = (double *)malloc((size_t)E * sizeof(double));
  if (!ds) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the router's gradient");
  for (int64_t tk = 0; tk < ms->T; tk++) {
    const double *s = r->s + tk * E;
    score_grad(ms, t[SMELT__MT_DWEIGHTS_IN], r, tk, ds);
    double dot = 0;
    for (int64_t e = 0; e < E; e++) dot += ds[e] * s[e];
    for (int64_t j = 0; j < E; j++)
      g[tk * E + j] = ms->cfg.score == SMELT_MOE_SCORE_SOFTMAX ? s[j] * (ds[j] - dot) : ds[j] * s[j] * (1.0 - s[j]);
  }
  free(ds);
  return smelt__moe_cpu_aux(ms, t, r, g);
}

smelt_status smelt__moe_cpu_route_bwd(const smelt__moe_state *ms, const smelt_tensor *const *t) {
  return with_routing(ms, t, route_grad);
}
