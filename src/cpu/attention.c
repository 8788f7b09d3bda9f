/* CPU reference for attention, in double. Per sequence b and query head h
 * (kv head hk = h / (H / Hk)) it materializes the whole score matrix:
 *   S[i][j] = mod(scale · q_i · k_j) for visible (i, j), -inf otherwise
 * with mod the desc's modifiers (softcap, then ALiBi; identity without).
 * forward:  m_i = max(max_j S[i][j], σ) (σ the head's sink, -inf without);
 *           a row with no visible key gets O = 0 and LSE = +inf; else
 *           P = exp(S - m) / l with l = Σ exp(S - m) + exp(σ - m),
 *           O = P v, LSE = m + log l.
 * backward: P = exp(S - LSE) from the given LSE (0 where masked or LSE = +inf),
 *           D_i = Σ_d dO ∘ O (the given O), dP = dO vᵀ,
 *           dS = P ∘ (dP - D) ∘ mod' (1 - tanh² under softcap),
 *           dq = scale · dS k, and per kv head dk = scale · Σ_group dSᵀ q,
 *           dv = Σ_group Pᵀ dO, stored once the group is done;
 *           dsinks[h] = -Σ_i exp(σ - LSE_i) D_i over all sequences.
 * Naive on purpose: it is the oracle the GPU kernels are checked against. */
#include "../core/attention_internal.h"
#include "../core/checked.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* One sequence: its first packed row and length, for queries and keys. */
typedef struct seq {
  int64_t q0, sq, k0, sk;
} seq;

static int64_t cu_at(const smelt_tensor *t, int64_t i) { return ((const int32_t *)t->data)[i * t->strides[0]]; }

/* Varlen: the sequences from cu_seqlens, checked against what the header
 * promises (start at 0, never decrease, end at the row count, no sequence
 * longer than max_seqlen) before anything is written. */
static smelt_status varlen_seqs(const smelt__attn_state *st, const smelt__attn_args *a, seq *out) {
  for (int w = 0; w < 2; w++) {
    const smelt_tensor *cu = a->t[w ? SMELT__ATT_CU_K : SMELT__ATT_CU_Q];
    const char *name = w ? "cu_seqlens_k" : "cu_seqlens_q";
    const int64_t rows = w ? st->rows_k : st->rows_q, maxlen = w ? st->Sk : st->Sq;
    if (cu_at(cu, 0) != 0)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s[0]=%lld must be 0", st->op, name,
                          (long long)cu_at(cu, 0));
    for (int64_t b = 0; b < st->B; b++) {
      const int64_t lo = cu_at(cu, b), hi = cu_at(cu, b + 1);
      if (hi < lo)
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s[%lld]=%lld is less than %s[%lld]=%lld (must not decrease)",
                            st->op, name, (long long)(b + 1), (long long)hi, name, (long long)b, (long long)lo);
      if (hi - lo > maxlen)
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                            "%s: sequence %lld has %lld rows in %s, more than desc->max_seqlen_%s=%lld", st->op,
                            (long long)b, (long long)(hi - lo), name, w ? "k" : "q", (long long)maxlen);
      if (w) {
        out[b].k0 = lo;
        out[b].sk = hi - lo;
      } else {
        out[b].q0 = lo;
        out[b].sq = hi - lo;
      }
    }
    if (cu_at(cu, st->B) != rows)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s[%lld]=%lld must equal the %s row count %lld", st->op,
                          name, (long long)st->B, (long long)cu_at(cu, st->B), w ? "k" : "q", (long long)rows);
  }
  return SMELT_OK;
}

/* Element offset of (b, packed row r, head h, d). */
static int64_t at(const smelt__attn_view *v, int64_t b, int64_t r, int64_t h, int64_t d) {
  return b * v->bs + r * v->rs + h * v->hs + d;
}

/* rows x D elements of one head of one sequence into dst (double). */
static void load_rows(const smelt__attn_view *v, smelt_dtype dt, int64_t b, int64_t r0, int64_t rows, int64_t h,
                      int64_t D, double *dst) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t d = 0; d < D; d++) dst[r * D + d] = smelt__load_f64(v->data, dt, at(v, b, r0 + r, h, d));
}

static void store_rows(const smelt__attn_view *v, smelt_dtype dt, int64_t b, int64_t r0, int64_t rows, int64_t h,
                       int64_t D, const double *src) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t d = 0; d < D; d++) smelt__store_f64(v->data, dt, at(v, b, r0 + r, h, d), src[r * D + d]);
}

/* Buffers of one (sequence, head): sized for the longest sequence. */
typedef struct work {
  double *q, *k, *v, *o, *d_o, *s, *dq, *dk, *dv, *lse;
} work;

static void work_free(work *w) {
  free(w->q);
  free(w->k);
  free(w->v);
  free(w->o);
  free(w->d_o);
  free(w->s);
  free(w->dq);
  free(w->dk);
  free(w->dv);
  free(w->lse);
}

/* One sequence's scratch; OVERFLOW when its sizes do not fit (the rows of
 * a broadcast q or k can be many), OUT_OF_MEMORY when malloc fails. */
static smelt_status work_new(work *w, int64_t sq, int64_t sk, int64_t D, const char *op) {
  memset(w, 0, sizeof *w);
  if (sq < 1) sq = 1;
  if (sk < 1) sk = 1;
  int64_t qn, kn, sn;
  size_t qb = 0, kb = 0, lb = 0, sb = 0;
  smelt_status s;
  if ((s = smelt__mul_i64(sq, D, &qn, op, "the CPU reference's query rows")) ||
      (s = smelt__mul_i64(sk, D, &kn, op, "the CPU reference's key rows")) ||
      (s = smelt__mul_i64(sq, sk, &sn, op, "the CPU reference's score matrix")) ||
      (s = smelt__bytes(qn, sizeof(double), &qb, op, "the query scratch")) ||
      (s = smelt__bytes(kn, sizeof(double), &kb, op, "the key scratch")) ||
      (s = smelt__bytes(sq, sizeof(double), &lb, op, "the LSE scratch")) ||
      (s = smelt__bytes(sn, sizeof(double), &sb, op, "the score scratch")))
    return s;
  w->q = malloc(qb);
  w->o = malloc(qb);
  w->d_o = malloc(qb);
  w->dq = malloc(qb);
  w->k = malloc(kb);
  w->v = malloc(kb);
  w->dk = malloc(kb);
  w->dv = malloc(kb);
  w->lse = malloc(lb);
  w->s = malloc(sb);
  if (w->q && w->o && w->d_o && w->dq && w->k && w->v && w->dk && w->dv && w->lse && w->s) return SMELT_OK;
  return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
}

/* One query head's modifier values: its ALiBi slope and sink (0 and
 * -inf when the desc has none). */
typedef struct head_mods {
  double slope, sink;
} head_mods;

static head_mods head_mods_of(const smelt__attn_args *a, int64_t h) {
  const smelt_tensor *al = a->t[SMELT__ATT_ALIBI], *si = a->t[SMELT__ATT_SINKS];
  head_mods m = {0.0, -INFINITY};
  if (al) m.slope = smelt__load_f64(al->data, SMELT_DTYPE_F32, h * al->strides[0]);
  if (si) m.sink = smelt__load_f64(si->data, SMELT_DTYPE_F32, h * si->strides[0]);
  return m;
}

/* The modified score of a visible (i, j) from its scaled score u, at
 * distance dist = i + sk - sq - j from the diagonal; *dsdu its derivative. */
static double modified(const smelt__attn_state *st, const head_mods *m, int64_t dist, double u, double *dsdu) {
  *dsdu = 1;
  if (st->softcap > 0) {
    const double th = tanh(u / st->softcap);
    u = st->softcap * th;
    *dsdu = 1 - th * th;
  }
  return u - m->slope * fabs((double)dist);
}

static double scaled_dot(const smelt__attn_state *st, const work *w, int64_t i, int64_t j) {
  double acc = 0;
  for (int64_t d = 0; d < st->D; d++) acc += w->q[i * st->D + d] * w->k[j * st->D + d];
  return acc * st->scale;
}

/* S for one head: the modified scaled scores where visible, -inf elsewhere. [sq][sk] */
static void scores(const smelt__attn_state *st, const seq *sq, const work *w, const head_mods *m) {
  for (int64_t i = 0; i < sq->sq; i++) {
    int64_t lo, hi;
    smelt__attn_key_range(st->wl, st->wr, sq->sq, sq->sk, i, &lo, &hi);
    for (int64_t j = 0; j < sq->sk; j++) {
      double acc = -INFINITY, unused;
      if (j >= lo && j <= hi) acc = modified(st, m, i + sq->sk - sq->sq - j, scaled_dot(st, w, i, j), &unused);
      w->s[i * sq->sk + j] = acc;
    }
  }
}

static void forward_head(const smelt__attn_state *st, const seq *sq, const work *w, const head_mods *hm) {
  const int64_t D = st->D, sk = sq->sk;
  for (int64_t i = 0; i < sq->sq; i++) { /* o[i][:], lse[i] */
    const double *s = w->s + i * sk;
    double m = -INFINITY;
    for (int64_t j = 0; j < sk; j++)
      if (s[j] > m) m = s[j];
    double *o = w->o + i * D;
    for (int64_t d = 0; d < D; d++) o[d] = 0;
    if (m == -INFINITY) {
      w->lse[i] = INFINITY;
      continue;
    }
    if (hm->sink > m) m = hm->sink;
    double l = exp(hm->sink - m);
    for (int64_t j = 0; j < sk; j++) l += exp(s[j] - m);
    for (int64_t j = 0; j < sk; j++) {
      const double p = exp(s[j] - m) / l;
      if (p == 0) continue;
      for (int64_t d = 0; d < D; d++) o[d] += p * w->v[j * D + d];
    }
    w->lse[i] = m + log(l);
  }
}

/* dq for this head; dk, dv accumulate over the group, *dsink over the
 * head's rows. S becomes dS. */
static void backward_head(const smelt__attn_state *st, const seq *sq, const work *w, const head_mods *hm,
                          double *dsink) {
  const int64_t D = st->D, sk = sq->sk;
  for (int64_t i = 0; i < sq->sq; i++) {
    double *s = w->s + i * sk; /* S -> P -> dS, row i */
    const double *dor = w->d_o + i * D;
    double di = 0;
    for (int64_t d = 0; d < D; d++) di += dor[d] * w->o[i * D + d];
    *dsink -= exp(hm->sink - w->lse[i]) * di;
    for (int64_t j = 0; j < sk; j++) {
      const double p = s[j] == -INFINITY ? 0.0 : exp(s[j] - w->lse[i]);
      double dp = 0, dsdu = 1;
      for (int64_t d = 0; d < D; d++) dp += dor[d] * w->v[j * D + d];
      for (int64_t d = 0; d < D; d++) w->dv[j * D + d] += p * dor[d];
      if (p != 0 && st->softcap > 0) modified(st, hm, 0, scaled_dot(st, w, i, j), &dsdu);
      s[j] = p * (dp - di) * dsdu;
    }
    for (int64_t d = 0; d < D; d++) {
      double acc = 0;
      for (int64_t j = 0; j < sk; j++) acc += s[j] * w->k[j * D + d];
      w->dq[i * D + d] = st->scale * acc;
    }
    for (int64_t j = 0; j < sk; j++)
      for (int64_t d = 0; d < D; d++) w->dk[j * D + d] += st->scale * s[j] * w->q[i * D + d];
  }
}

/* dsinks of a call without rows: 0. */
static void zero_dsinks(const smelt__attn_state *st, const smelt__attn_args *a) {
  const smelt_tensor *t = st->bwd ? a->t[SMELT__ATT_DSINKS] : NULL;
  for (int64_t h = 0; t && h < st->H; h++) smelt__store_f64(t->data, SMELT_DTYPE_F32, h * t->strides[0], 0.0);
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt__attn_state *st = (const smelt__attn_state *)plan->opdata;
  const smelt__attn_args *a = (const smelt__attn_args *)args;
  const int64_t B = st->B, H = st->H, Hk = st->Hk, D = st->D, group = H / Hk;
  /* Nothing to write but dsinks (varlen: cu_seqlens are still checked).
   * An empty batch may claim any B, which must not size the sequence table. */
  if (!st->varlen && (B == 0 || (st->Sq == 0 && st->Sk == 0))) {
    zero_dsinks(st, a);
    return SMELT_OK;
  }
  seq *seqs = (seq *)calloc((size_t)(B ? B : 1), sizeof *seqs);
  if (!seqs) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", st->op);
  smelt_status s = SMELT_OK;
  if (st->varlen) {
    s = varlen_seqs(st, a, seqs);
  } else {
    for (int64_t b = 0; b < B; b++) seqs[b] = (seq){0, st->Sq, 0, st->Sk};
  }
  work w;
  int64_t mq = 0, mk = 0;
  for (int64_t b = 0; b < B; b++) {
    if (seqs[b].sq > mq) mq = seqs[b].sq;
    if (seqs[b].sk > mk) mk = seqs[b].sk;
  }
  /* No query or key row anywhere: nothing to write, and D (any size on
   * empty tensors) must not size a scratch that is never used. */
  if (!s && mq == 0 && mk == 0) {
    zero_dsinks(st, a);
    free(seqs);
    return SMELT_OK;
  }
  if (!s && (s = work_new(&w, mq, mk, D, st->op))) work_free(&w);
  if (s) {
    free(seqs);
    return s;
  }
  const smelt_dtype dt = a->t[SMELT__ATT_Q]->dtype;
  smelt__attn_view q, k, v, o, lse, d_o, dq, dk, dv;
  smelt__attn_view_of(st, a->t[SMELT__ATT_Q], &q);
  smelt__attn_view_of(st, a->t[SMELT__ATT_K], &k);
  smelt__attn_view_of(st, a->t[SMELT__ATT_V], &v);
  smelt__attn_view_of(st, a->t[SMELT__ATT_O], &o);
  if (a->t[SMELT__ATT_LSE]) smelt__attn_lse_view_of(st, a->t[SMELT__ATT_LSE], &lse);
  if (st->bwd) {
    smelt__attn_view_of(st, a->t[SMELT__ATT_DO], &d_o);
    smelt__attn_view_of(st, a->t[SMELT__ATT_DQ], &dq);
    smelt__attn_view_of(st, a->t[SMELT__ATT_DK], &dk);
    smelt__attn_view_of(st, a->t[SMELT__ATT_DV], &dv);
  }
  const smelt_tensor *dsinks = st->bwd ? a->t[SMELT__ATT_DSINKS] : NULL;
  double *dsink = dsinks ? (double *)calloc((size_t)H, sizeof *dsink) : NULL;
  if (dsinks && !dsink) {
    work_free(&w);
    free(seqs);
    return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", st->op);
  }
  double unused_dsink = 0;
  for (int64_t b = 0; b < B; b++) {
    const seq *sq = &seqs[b];
    for (int64_t hk = 0; hk < Hk; hk++) {
      load_rows(&k, dt, b, sq->k0, sq->sk, hk, D, w.k);
      load_rows(&v, dt, b, sq->k0, sq->sk, hk, D, w.v);
      for (int64_t j = 0; j < sq->sk * D; j++) w.dk[j] = w.dv[j] = 0;
      /* A sequence without queries reads and writes nothing per head (an
       * empty q may claim any number of heads). */
      for (int64_t h = hk * group; sq->sq > 0 && h < (hk + 1) * group; h++) {
        const head_mods hm = head_mods_of(a, h);
        load_rows(&q, dt, b, sq->q0, sq->sq, h, D, w.q);
        scores(st, sq, &w, &hm);
        if (!st->bwd) {
          forward_head(st, sq, &w, &hm);
          store_rows(&o, dt, b, sq->q0, sq->sq, h, D, w.o);
          if (a->t[SMELT__ATT_LSE])
            for (int64_t i = 0; i < sq->sq; i++)
              smelt__store_f64(lse.data, SMELT_DTYPE_F32, b * lse.bs + h * lse.hs + (sq->q0 + i) * lse.rs, w.lse[i]);
          continue;
        }
        load_rows(&o, dt, b, sq->q0, sq->sq, h, D, w.o);
        load_rows(&d_o, dt, b, sq->q0, sq->sq, h, D, w.d_o);
        for (int64_t i = 0; i < sq->sq; i++)
          w.lse[i] = smelt__load_f64(lse.data, SMELT_DTYPE_F32, b * lse.bs + h * lse.hs + (sq->q0 + i) * lse.rs);
        backward_head(st, sq, &w, &hm, dsink ? &dsink[h] : &unused_dsink);
        store_rows(&dq, dt, b, sq->q0, sq->sq, h, D, w.dq);
      }
      if (st->bwd) {
        store_rows(&dk, dt, b, sq->k0, sq->sk, hk, D, w.dk);
        store_rows(&dv, dt, b, sq->k0, sq->sk, hk, D, w.dv);
      }
    }
  }
  for (int64_t h = 0; dsink && h < H; h++) smelt__store_f64(dsinks->data, SMELT_DTYPE_F32, h * dsinks->strides[0], dsink[h]);
  free(dsink);
  work_free(&w);
  free(seqs);
  return SMELT_OK;
}

const smelt__backend smelt__cpu_attention = {.run = run};
