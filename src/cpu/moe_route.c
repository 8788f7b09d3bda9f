/* The router's CPU reference: logits from the GEMM engine (plus the noise),
 * then each token's scores, its group-limited top-k of score + bias, its
 * weights, and the experts' capacity, all in double from the logits
 * tensor. The backward and the aux losses call the same routing of the
 * same logits, so they see exactly the forward's selection. */
#include "../core/checked.h"
#include "moe_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int smelt__moe_renormalizes(const smelt__moe_state *ms) {
  return ms->cfg.score == SMELT_MOE_SCORE_SOFTMAX ? ms->cfg.renormalize != 0 : ms->k > 1;
}

void smelt__moe_route_free(smelt__moe_route *r) {
  free(r->s);
  free(r->sel);
  free(r->w);
  free(r->kept);
  free(r->sel_count);
  free(r->count);
  memset(r, 0, sizeof *r);
}

static smelt_status route_alloc(const smelt__moe_state *ms, smelt__moe_route *r) {
  memset(r, 0, sizeof *r);
  size_t b_s = 0, b_k = 0;
  smelt_status s = smelt__bytes(ms->T * ms->E, sizeof(double), &b_s, MOE_OP, "the routing's scores");
  if (s || (s = smelt__bytes(ms->rows, sizeof(double), &b_k, MOE_OP, "the routing's choices"))) return s;
  r->s = (double *)malloc(b_s ? b_s : 1);
  r->sel = (int64_t *)malloc(b_k ? b_k : 1);
  r->w = (double *)malloc(b_k ? b_k : 1);
  r->kept = (unsigned char *)malloc(ms->rows ? (size_t)ms->rows : 1);
  r->sel_count = (int64_t *)calloc((size_t)ms->E, sizeof(int64_t));
  r->count = (int64_t *)calloc((size_t)ms->E, sizeof(int64_t));
  if (r->s && r->sel && r->w && r->kept && r->sel_count && r->count) return SMELT_OK;
  smelt__moe_route_free(r);
  return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the routing");
}

/* Token t's scores from its logits. A softmax row of -inf only has no mass (0). */
static void scores(const smelt__moe_state *ms, const smelt_tensor *logits, int64_t t, double *s) {
  const int64_t E = ms->E;
  for (int64_t e = 0; e < E; e++) s[e] = smelt__moe_get(logits, t * E + e);
  if (ms->cfg.score == SMELT_MOE_SCORE_SIGMOID) {
    for (int64_t e = 0; e < E; e++) s[e] = 1.0 / (1.0 + exp(-s[e]));
    return;
  }
  double m = -INFINITY, sum = 0;
  for (int64_t e = 0; e < E; e++) m = s[e] > m || isnan(s[e]) ? s[e] : m;
  for (int64_t e = 0; e < E; e++) sum += s[e] = m == -INFINITY ? 0.0 : exp(s[e] - m);
  for (int64_t e = 0; e < E; e++) s[e] = sum > 0 ? s[e] / sum : 0.0;
}

/* The candidates of group-limited routing: the experts of the topk_groups
 * groups of the largest score (the sum of a group's k/topk_groups largest
 * keys); all experts without groups. Returns how many are in cand. */
static int64_t candidates(const smelt__moe_state *ms, const double *key, smelt__rank *cand, smelt__rank *scratch) {
  const int64_t E = ms->E, G = ms->cfg.num_groups;
  for (int64_t e = 0; e < E; e++) cand[e] = (smelt__rank){key[e], e};
  if (!G) return E;
  const int64_t size = E / G, per = ms->k / ms->cfg.topk_groups;
  smelt__rank *groups = scratch + E;
  for (int64_t g = 0; g < G; g++) {
    memcpy(scratch, cand + g * size, (size_t)size * sizeof *scratch);
    qsort(scratch, (size_t)size, sizeof *scratch, smelt__rank_cmp);
    double sum = 0;
    for (int64_t j = 0; j < per; j++) sum += scratch[j].v;
    groups[g] = (smelt__rank){sum, g};
  }
  qsort(groups, (size_t)G, sizeof *groups, smelt__rank_cmp);
  int64_t n = 0;
  for (int64_t j = 0; j < ms->cfg.topk_groups; j++)
    for (int64_t e = groups[j].i * size; e < (groups[j].i + 1) * size; e++) scratch[n++] = (smelt__rank){key[e], e};
  memcpy(cand, scratch, (size_t)n * sizeof *cand);
  return n;
}

/* Token t's choices: top-k of score + bias among the candidates, weights. */
static void select_token(const smelt__moe_state *ms, const smelt_tensor *bias, int64_t t, smelt__moe_route *r,
                         double *key, smelt__rank *cand, smelt__rank *scratch) {
  const int64_t E = ms->E, k = ms->k;
  const double *s = r->s + t * E;
  for (int64_t e = 0; e < E; e++) key[e] = s[e] + (bias ? smelt__moe_get(bias, e) : 0.0);
  const int64_t n = candidates(ms, key, cand, scratch);
  qsort(cand, (size_t)n, sizeof *cand, smelt__rank_cmp);
  double z = ms->cfg.score == SMELT_MOE_SCORE_SIGMOID ? 1e-20 : 0.0;
  for (int64_t i = 0; i < k; i++) {
    r->sel[t * k + i] = cand[i].i;
    r->w[t * k + i] = s[cand[i].i];
    z += s[cand[i].i];
    r->sel_count[cand[i].i]++;
  }
  const int norm = smelt__moe_renormalizes(ms);
  for (int64_t i = 0; i < k; i++) {
    const double w = r->w[t * k + i];
    r->w[t * k + i] = (norm ? w / z : w) * ms->cfg.scaling_factor;
  }
}

/* Capacity: each expert over it keeps the assignments first in its policy's
 * order (the largest weight, equal weights by lower token; or the lowest
 * token). list holds an expert's assignments t·k + i in token order. */
static void apply_capacity(const smelt__moe_state *ms, smelt__moe_route *r, smelt__rank *list) {
  memset(r->kept, 1, (size_t)ms->rows);
  for (int64_t e = 0; e < ms->E; e++) {
    int64_t n = 0;
    for (int64_t a = 0; a < ms->rows; a++)
      if (r->sel[a] == e) list[n++] = (smelt__rank){r->w[a], a};
    r->count[e] = n;
    if (ms->capacity < 0 || n <= ms->capacity) continue;
    if (ms->cfg.drop_policy == SMELT_MOE_DROP_PROBS) qsort(list, (size_t)n, sizeof *list, smelt__rank_cmp);
    for (int64_t j = ms->capacity; j < n; j++) r->kept[list[j].i] = 0;
    r->count[e] = ms->capacity;
  }
}

smelt_status smelt__moe_route_compute(const smelt__moe_state *ms, const smelt_tensor *logits,
                                      const smelt_tensor *bias, smelt__moe_route *r) {
  smelt_status s = route_alloc(ms, r);
  if (s) return s;
  const int64_t E = ms->E;
  size_t bytes = 0;
  const int64_t n = E * 3 + ms->rows + 1;
  if ((s = smelt__bytes(n, sizeof(smelt__rank), &bytes, MOE_OP, "the routing's scratch"))) {
    smelt__moe_route_free(r);
    return s;
  }
  smelt__rank *work = (smelt__rank *)malloc(bytes);
  double *key = (double *)malloc((size_t)E * sizeof(double));
  if (!work || !key) {
    free(work);
    free(key);
    smelt__moe_route_free(r);
    return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the routing");
  }
  for (int64_t t = 0; t < ms->T; t++) {
    scores(ms, logits, t, r->s + t * E);
    select_token(ms, bias, t, r, key, work, work + E);
  }
  apply_capacity(ms, r, work);
  free(work);
  free(key);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- the router's run */

static double softplus(double z) { return z > 30 ? z : log1p(exp(z)); }

/* logits = x·Wr (+ n · softplus(x·Wnoise)), each product in double. */
static smelt_status logits_of(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t) {
  const smelt_tensor *x = t[SMELT__MT_X], *wn = t[SMELT__MT_WNOISE], *logits = t[SMELT__MT_LOGITS];
  smelt_tensor clean = {0}, noise = {0};
  const smelt_gemm_desc desc = smelt_gemm_desc_default();
  smelt_status s = smelt__moe_scratch(&clean, SMELT_DTYPE_F64, ms->T, ms->E, "the router's logits");
  if (!s && wn) s = smelt__moe_scratch(&noise, SMELT_DTYPE_F64, ms->T, ms->E, "the noise's scale");
  if (!s) s = smelt_gemm(ctx, &desc, x, t[SMELT__MT_WR], NULL, &clean, NULL);
  if (!s && wn) s = smelt_gemm(ctx, &desc, x, wn, NULL, &noise, NULL);
  if (!s) {
    const double *c = (const double *)clean.data, *z = (const double *)noise.data;
    for (int64_t tk = 0; tk < ms->T; tk++)
      for (int64_t e = 0; e < ms->E; e++) {
        const int64_t i = tk * ms->E + e;
        double v = c[i];
        if (wn) v += smelt__moe_normal(ms->cfg.noise_seed, ms->cfg.noise_token_offset + tk, e) * softplus(z[i]);
        smelt__moe_set(logits, i, v);
      }
  }
  free(clean.data);
  free(noise.data);
  return s;
}

/* ids, weights, counts, offsets and dropped from the routing. */
static void write_routing(const smelt__moe_state *ms, const smelt_tensor *const *t, const smelt__moe_route *r) {
  int64_t dropped = 0, at = 0;
  for (int64_t a = 0; a < ms->rows; a++) {
    smelt__moe_set(t[SMELT__MT_IDS], a, r->kept[a] ? (double)r->sel[a] : -1.0);
    smelt__moe_set(t[SMELT__MT_WEIGHTS], a, r->kept[a] ? r->w[a] : 0.0);
    dropped += !r->kept[a];
  }
  smelt__moe_set(t[SMELT__MT_OFFSETS], 0, 0.0);
  for (int64_t e = 0; e < ms->E; e++) {
    smelt__moe_set(t[SMELT__MT_COUNTS], e, (double)r->count[e]);
    smelt__moe_set(t[SMELT__MT_OFFSETS], e + 1, (double)(at += r->count[e]));
  }
  if (t[SMELT__MT_DROPPED]) smelt__moe_set(t[SMELT__MT_DROPPED], 0, (double)dropped);
}

smelt_status smelt__moe_cpu_route(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t) {
  smelt_status s = logits_of(ctx, ms, t);
  if (s) return s;
  smelt__moe_route r;
  if ((s = smelt__moe_route_compute(ms, t[SMELT__MT_LOGITS], t[SMELT__MT_BIAS], &r))) return s;
  write_routing(ms, t, &r);
  const smelt_tensor *aux_args[SMELT__MT_ROLES] = {NULL};
  aux_args[SMELT__MT_LOGITS_IN] = t[SMELT__MT_LOGITS];
  aux_args[SMELT__MT_AUX] = t[SMELT__MT_AUX];
  if (t[SMELT__MT_AUX]) s = smelt__moe_cpu_aux(ms, aux_args, &r, NULL);
  smelt__moe_route_free(&r);
  return s;
}
