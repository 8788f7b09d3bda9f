/* CPU reference for smelt_attention_decode, in double. For sequence b,
 * query i and head h (kv head h / (H / Hk)) it gathers the visible cache
 * positions p = 0 .. hi (hi = cache_seqlens[b] - Sq + i when causal, else
 * cache_seqlens[b] - 1) through the block table, and computes
 *   s_p = scale · q · k_p,  m = max s,  l = Σ exp(s - m),
 *   O = Σ exp(s_p - m) v_p / l,  LSE = m + log l
 * (a query that sees nothing: O = 0, LSE = +inf). Naive on purpose: it is
 * the oracle the CUDA kernels are checked against. */
#include "../core/checked.h"
#include "../core/attn_decode_internal.h"

#include <math.h>
#include <stdlib.h>

/* Element offset of (position p, kv head hk, d = 0) of sequence b's cache. */
static int64_t cache_at(const smelt_tensor *c, const smelt_tensor *table, int64_t page_size, int64_t b, int64_t p,
                        int64_t hk) {
  const int64_t page = smelt__i32_at2(table, b, p / page_size);
  return page * c->strides[0] + (p % page_size) * c->strides[1] + hk * c->strides[2];
}

static int64_t row_at(const smelt_tensor *t, int64_t b, int64_t i, int64_t h) {
  return b * t->strides[0] + i * t->strides[1] + h * t->strides[2];
}

/* One query row: scores into s (hi + 1 of them), then O and the LSE. */
static void one_row(const smelt_tensor *const *t, const smelt__paged_geom *g, double scale, int64_t b, int64_t i,
                    int64_t h, int64_t hi, double *s, double *acc) {
  const smelt_tensor *q = t[SMELT__DEC_Q], *kc = t[SMELT__DEC_K], *vc = t[SMELT__DEC_V], *tab = t[SMELT__DEC_TABLE];
  const smelt_tensor *o = t[SMELT__DEC_O], *lse = t[SMELT__DEC_LSE];
  const smelt_dtype dt = q->dtype;
  const int64_t hk = h / (g->H / g->Hk), D = g->D, qo = row_at(q, b, i, h);
  double m = -INFINITY;
  for (int64_t p = 0; p <= hi; p++) {
    const int64_t ko = cache_at(kc, tab, g->page_size, b, p, hk);
    double dot = 0.0;
    for (int64_t d = 0; d < D; d++) dot += smelt__load_f64(q->data, dt, qo + d) * smelt__load_f64(kc->data, dt, ko + d);
    s[p] = scale * dot;
    if (s[p] > m) m = s[p];
  }
  double l = 0.0;
  for (int64_t d = 0; d < D; d++) acc[d] = 0.0;
  for (int64_t p = 0; p <= hi; p++) {
    const double e = exp(s[p] - m);
    const int64_t vo = cache_at(vc, tab, g->page_size, b, p, hk);
    l += e;
    for (int64_t d = 0; d < D; d++) acc[d] += e * smelt__load_f64(vc->data, dt, vo + d);
  }
  const int64_t oo = row_at(o, b, i, h);
  for (int64_t d = 0; d < D; d++) smelt__store_f64(o->data, dt, oo + d, hi < 0 ? 0.0 : acc[d] / l);
  if (lse) {
    const int64_t lo = b * lse->strides[0] + h * lse->strides[1] + i * lse->strides[2];
    ((float *)lse->data)[lo] = hi < 0 ? INFINITY : (float)(m + log(l));
  }
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const char *op = smelt__family_attention_decode.op;
  smelt__paged_geom g;
  smelt__paged_geom_of(t[SMELT__DEC_Q], t[SMELT__DEC_K], t[SMELT__DEC_TABLE], &g);
  int64_t longest;
  smelt_status s = smelt__paged_check_host(op, &g, t[SMELT__DEC_TABLE], t[SMELT__DEC_SEQLENS], 0, &longest);
  if (s) return s;
  const double scale = smelt__decode_scale(plan);
  const int causal = ((const smelt_attention_decode_desc *)plan->opdata)->causal;
  /* The scores of the longest sequence (checked against its table above;
   * the table's capacity may be far larger), then D sums. */
  size_t bytes = 0;
  if ((s = smelt__bytes(longest + g.D + 1, sizeof(double), &bytes, op, "the CPU reference's scores"))) return s;
  double *buf = malloc(bytes);
  if (!buf) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  for (int64_t b = 0; b < g.B; b++) {
    const int64_t len = smelt__i32_at(t[SMELT__DEC_SEQLENS], b);
    for (int64_t i = 0; i < g.Sq; i++)
      for (int64_t h = 0; h < g.H; h++)
        one_row(t, &g, scale, b, i, h, causal ? len - g.Sq + i : len - 1, buf + g.D, buf);
  }
  free(buf);
  return SMELT_OK;
}

const smelt__backend smelt__cpu_attention_decode = {.run = run};
