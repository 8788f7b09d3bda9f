/* The attention ops: forward and backward, batched and varlen. One
 * validation serves all four (they differ in which tensors take part and
 * how many dims they have); the plan resolves the description (scale,
 * windows, sizes) into smelt__attn_state, the run checks the bound tensors
 * against the plan before anything is written, and the one-shot calls do
 * both. */
#include "attention_internal.h"
#include "error_bound.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const role_name[SMELT__ATT_COUNT] = {"q",  "k",  "v",  "o",  "lse", "cu_seqlens_q", "cu_seqlens_k",
                                                        "d_o", "dq", "dk", "dv", "desc->alibi_slopes",
                                                        "desc->sinks", "desc->dsinks"};

/* The roles by name for the shared run check; which are outputs depends on
 * the direction (is_output), so this file checks disjointness itself. */
static const smelt__role roles[SMELT__ATT_COUNT] = {
    {.name = "q"},   {.name = "k"},  {.name = "v"},  {.name = "o"},  {.name = "lse"}, {.name = "cu_seqlens_q"},
    {.name = "cu_seqlens_k"}, {.name = "d_o"}, {.name = "dq"}, {.name = "dk"}, {.name = "dv"},
    {.name = "desc->alibi_slopes"}, {.name = "desc->sinks"}, {.name = "desc->dsinks"},
};

const smelt__family smelt__family_attention = {
    .name = "attention",
    .op = "smelt_attention",
    .what = "an attention",
    .nroles = SMELT__ATT_COUNT,
    .roles = roles,
    .cpu = &smelt__cpu_attention,
    .cuda = &smelt__cuda_attention,
    .bound = smelt__bound_attention,
};

smelt_attention_desc smelt_attention_desc_default(void) {
  smelt_attention_desc d;
  memset(&d, 0, sizeof d);
  d.window_left = -1;
  d.window_right = -1;
  return d;
}

static const char *op_name(int bwd, int varlen) {
  return bwd ? (varlen ? "smelt_attention_varlen_bwd" : "smelt_attention_bwd")
             : (varlen ? "smelt_attention_varlen_fwd" : "smelt_attention_fwd");
}

/* 1: required, 2: optional, 0: not part of this op. */
static int role_use(int role, int bwd, int varlen) {
  switch (role) {
    case SMELT__ATT_LSE: return bwd ? 1 : 2;
    case SMELT__ATT_CU_Q:
    case SMELT__ATT_CU_K: return varlen;
    case SMELT__ATT_DO:
    case SMELT__ATT_DQ:
    case SMELT__ATT_DK:
    case SMELT__ATT_DV: return bwd;
    case SMELT__ATT_ALIBI:
    case SMELT__ATT_SINKS: return 2;
    case SMELT__ATT_DSINKS: return bwd ? 2 : 0;
    default: return 1;
  }
}

/* Roles shaped like q or k: [B, S, heads, D] or [rows, heads, D]. */
static int qkv_like(int role) { return role <= SMELT__ATT_O || (role >= SMELT__ATT_DO && role <= SMELT__ATT_DV); }

/* The modifiers' per-head vectors: f32 [H]. */
static int per_head(int role) { return role >= SMELT__ATT_ALIBI; }

static int is_output(int role, int bwd) {
  return bwd ? role == SMELT__ATT_DQ || role == SMELT__ATT_DK || role == SMELT__ATT_DV || role == SMELT__ATT_DSINKS
             : role == SMELT__ATT_O || role == SMELT__ATT_LSE;
}

/* Outputs share memory with no input and no other output. */
static smelt_status check_disjoint(const char *op, int bwd, const smelt_tensor *const *t) {
  for (int a = 0; a < SMELT__ATT_COUNT; a++) {
    if (!t[a] || !is_output(a, bwd)) continue;
    for (int b = 0; b < SMELT__ATT_COUNT; b++) {
      if (b == a || !t[b] || (is_output(b, bwd) && b > a)) continue;
      if (smelt__tensors_overlap(t[a], t[b]))
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                            "%s: %s overlaps %s; outputs must not share memory with an input or each other", op,
                            role_name[a], role_name[b]);
    }
  }
  return SMELT_OK;
}

static smelt_status dim_eq(const char *op, int role, const smelt_tensor *t, int d, int64_t want, const char *what) {
  if (t->shape[d] != want)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape[%d]=%lld must equal %s=%lld", op, role_name[role], d,
                        (long long)t->shape[d], what, (long long)want);
  return SMELT_OK;
}

/* Everything static about a call; fills st. t[role] is NULL for absent roles. */
static smelt_status validate(smelt_ctx *ctx, const smelt_attention_desc *desc_in, int bwd, int varlen,
                             const smelt_tensor *const *t, smelt__attn_state *st) {
  const char *op = op_name(bwd, varlen);
  smelt_status s;
  for (int r = 0; r < SMELT__ATT_COUNT; r++) {
    const int use = role_use(r, bwd, varlen);
    if (use == 1 && !t[r]) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL", op, role_name[r]);
    if (!t[r]) continue;
    if ((s = smelt__check_tensor(op, role_name[r], t[r])) || (s = smelt__check_device(op, role_name[r], t[r], ctx)))
      return s;
  }
  const smelt_tensor *q = t[SMELT__ATT_Q], *k = t[SMELT__ATT_K];

  /* dtypes */
  const int cuda = ctx->device == SMELT_DEVICE_CUDA;
  const smelt_dtype qt = q->dtype;
  if (!(qt == SMELT_DTYPE_F16 || qt == SMELT_DTYPE_BF16 || (!cuda && (qt == SMELT_DTYPE_F32 || qt == SMELT_DTYPE_F64))))
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: q.dtype=%s is not supported on %s (supported: %s)", op,
                        smelt_dtype_name(qt), cuda ? "cuda" : "cpu", cuda ? "f16, bf16" : "f16, bf16, f32, f64");
  for (int r = 0; r < SMELT__ATT_COUNT; r++) {
    if (!t[r] || r == SMELT__ATT_Q) continue;
    smelt_dtype want = r == SMELT__ATT_LSE || per_head(r)                ? SMELT_DTYPE_F32
                       : r == SMELT__ATT_CU_Q || r == SMELT__ATT_CU_K ? SMELT_DTYPE_I32
                                                                        : qt;
    if (t[r]->dtype == want) continue;
    if (qkv_like(r))
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%s must equal q.dtype=%s", op, role_name[r],
                          smelt_dtype_name(t[r]->dtype), smelt_dtype_name(qt));
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%s must be %s", op, role_name[r],
                        smelt_dtype_name(t[r]->dtype), smelt_dtype_name(want));
  }

  /* ranks */
  const int qnd = varlen ? 3 : 4;
  for (int r = 0; r < SMELT__ATT_COUNT; r++) {
    if (!t[r]) continue;
    int want = qkv_like(r) ? qnd : r == SMELT__ATT_LSE ? qnd - 1 : 1;
    if (t[r]->ndim != want)
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.ndim=%d must be %d (%s)", op, role_name[r], t[r]->ndim,
                          want,
                          qkv_like(r) ? (varlen ? "[rows, heads, D]" : "[B, S, heads, D]")
                          : r == SMELT__ATT_LSE ? (varlen ? "[H, rows of q]" : "[B, H, Sq]")
                          : per_head(r)         ? "[H]"
                                                : "[B + 1]");
  }

  /* sizes */
  const int hd = qnd - 2, dd = qnd - 1; /* the heads and D dims */
  memset(st, 0, sizeof *st);
  st->op = op;
  st->bwd = bwd;
  st->varlen = varlen;
  st->H = q->shape[hd];
  st->D = q->shape[dd];
  st->Hk = k->shape[hd];
  if (st->H < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: q.shape[%d]=0 (heads H) must be >= 1", op, hd);
  if (st->D < 1) return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: q.shape[%d]=0 (head dim D) must be >= 1", op, dd);
  if (st->Hk < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: k.shape[%d]=0 (kv heads Hk) must be >= 1", op, hd);
  if ((s = dim_eq(op, SMELT__ATT_K, k, dd, st->D, "q's head dim D"))) return s;
  if (st->H % st->Hk)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                        "%s: q.shape[%d]=%lld (heads H) must be a multiple of k.shape[%d]=%lld (kv heads Hk)", op, hd,
                        (long long)st->H, hd, (long long)st->Hk);
  if (varlen) {
    const smelt_tensor *cq = t[SMELT__ATT_CU_Q], *ck = t[SMELT__ATT_CU_K];
    if (cq->shape[0] < 1)
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: cu_seqlens_q.shape[0]=0 must be B + 1 >= 1", op);
    if ((s = smelt__check_same_shape(op, "cu_seqlens_q", cq, "cu_seqlens_k", ck))) return s;
    st->B = cq->shape[0] - 1;
    st->rows_q = q->shape[0];
    st->rows_k = k->shape[0];
    /* cu_seqlens[0] = 0 = cu_seqlens[B]: with no sequence no row is owned,
     * and rows no sequence owns would stay unwritten. */
    if (st->B == 0 && (st->rows_q || st->rows_k))
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                          "%s: cu_seqlens_q.shape[0]=1 (batch 0) but q has %lld and k %lld rows; with no sequence both "
                          "must have 0",
                          op, (long long)st->rows_q, (long long)st->rows_k);
  } else {
    st->B = q->shape[0];
    st->Sq = q->shape[1];
    st->Sk = k->shape[1];
    if ((s = dim_eq(op, SMELT__ATT_K, k, 0, st->B, "q.shape[0] (B)"))) return s;
    st->rows_q = st->B * st->Sq;
    st->rows_k = st->B * st->Sk;
  }
  if ((s = smelt__check_same_shape(op, "k", k, "v", t[SMELT__ATT_V])) ||
      (s = smelt__check_same_shape(op, "q", q, "o", t[SMELT__ATT_O])))
    return s;
  if (bwd && ((s = smelt__check_same_shape(op, "o", t[SMELT__ATT_O], "d_o", t[SMELT__ATT_DO])) ||
              (s = smelt__check_same_shape(op, "q", q, "dq", t[SMELT__ATT_DQ])) ||
              (s = smelt__check_same_shape(op, "k", k, "dk", t[SMELT__ATT_DK])) ||
              (s = smelt__check_same_shape(op, "k", k, "dv", t[SMELT__ATT_DV]))))
    return s;
  if (t[SMELT__ATT_LSE]) {
    const smelt_tensor *l = t[SMELT__ATT_LSE];
    int ok = varlen ? l->shape[0] == st->H && l->shape[1] == st->rows_q
                    : l->shape[0] == st->B && l->shape[1] == st->H && l->shape[2] == st->Sq;
    if (!ok) {
      char a[160];
      if (varlen)
        return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: lse.shape=%s must equal [H, rows of q]=[%lld, %lld]", op,
                            smelt__shape_str(l, a, sizeof a), (long long)st->H, (long long)st->rows_q);
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: lse.shape=%s must equal [B, H, Sq]=[%lld, %lld, %lld]", op,
                          smelt__shape_str(l, a, sizeof a), (long long)st->B, (long long)st->H, (long long)st->Sq);
    }
  }

  for (int r = SMELT__ATT_ALIBI; r < SMELT__ATT_COUNT; r++) {
    if (!t[r]) continue;
    if (t[r]->shape[0] != st->H)
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape[0]=%lld must equal q's heads H=%lld", op,
                          role_name[r], (long long)t[r]->shape[0], (long long)st->H);
    if (st->H > 1 && t[r]->strides[0] != 1)
      return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[0]=%lld must be 1 (contiguous)", op, role_name[r],
                          (long long)t[r]->strides[0]);
  }
  if (t[SMELT__ATT_DSINKS] && !t[SMELT__ATT_SINKS])
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->dsinks is given without desc->sinks", op);

  /* layouts: D has unit stride (it is what every kernel vectorizes over) */
  for (int r = 0; r < SMELT__ATT_COUNT; r++)
    if (t[r] && qkv_like(r) && st->D > 1 && smelt_tensor_numel(t[r]) > 0 && t[r]->strides[dd] != 1)
      return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[%d]=%lld must be 1 (unit stride along D)", op,
                          role_name[r], dd, (long long)t[r]->strides[dd]);

  /* the description */
  smelt_attention_desc d = desc_in ? *desc_in : smelt_attention_desc_default();
  if (!isfinite(d.scale))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->scale=%g must be finite (0 = 1/sqrt(D))", op,
                        (double)d.scale);
  if (d.window_left < -1 || d.window_right < -1)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->window_%s=%lld must be >= -1 (-1 = unbounded)", op,
                        d.window_left < -1 ? "left" : "right",
                        (long long)(d.window_left < -1 ? d.window_left : d.window_right));
  if ((unsigned)d.fwd_schedule >= SMELT_ATTENTION_SCHEDULE_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: desc->fwd_schedule=%d is not a smelt_attention_schedule (supported: AUTO, TILES, "
                        "PERSISTENT, DYNAMIC)",
                        op, (int)d.fwd_schedule);
  if (!isfinite(d.softcap) || d.softcap < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->softcap=%g must be finite and >= 0 (0 = none)", op,
                        (double)d.softcap);
  if (varlen) {
    if (d.max_seqlen_q < 0 || d.max_seqlen_k < 0)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc->max_seqlen_%s=%lld must be >= 0", op,
                          d.max_seqlen_q < 0 ? "q" : "k",
                          (long long)(d.max_seqlen_q < 0 ? d.max_seqlen_q : d.max_seqlen_k));
    if (d.max_seqlen_q == 0 && st->rows_q > 0 && st->B > 0)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                          "%s: desc->max_seqlen_q=0 but q has %lld rows; give the longest query sequence's length", op,
                          (long long)st->rows_q);
    if (d.max_seqlen_k == 0 && st->rows_k > 0 && st->B > 0)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                          "%s: desc->max_seqlen_k=0 but k has %lld rows; give the longest key sequence's length", op,
                          (long long)st->rows_k);
    st->Sq = d.max_seqlen_q;
    st->Sk = d.max_seqlen_k;
  }
  const int64_t lim = (int64_t)1 << 31;
  if (st->Sq >= lim || st->Sk >= lim)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: sequence lengths Sq=%lld, Sk=%lld must be below 2^31", op,
                        (long long)st->Sq, (long long)st->Sk);
  st->desc = d;
  st->scale = d.scale != 0.0f ? (double)d.scale : 1.0 / sqrt((double)st->D);
  st->wl = d.window_left;
  /* causal ∩ a right window: the causal bound is the tighter one. */
  st->wr = d.causal ? 0 : d.window_right;
  st->softcap = d.softcap;
  st->mods = (d.softcap > 0 ? SMELT__ATT_MOD_SOFTCAP : 0) | (t[SMELT__ATT_ALIBI] ? SMELT__ATT_MOD_ALIBI : 0) |
             (t[SMELT__ATT_SINKS] ? SMELT__ATT_MOD_SINKS : 0);
  /* The desc's tensors live in the plan (st->t); the copy must not point at the caller's. */
  st->desc.alibi_slopes = st->desc.sinks = st->desc.dsinks = NULL;

  /* outputs */
  for (int r = 0; r < SMELT__ATT_COUNT; r++)
    if (t[r] && is_output(r, bwd) && (s = smelt__check_output(op, role_name[r], t[r]))) return s;
  if ((s = check_disjoint(op, bwd, t))) return s;
  for (int r = 0; r < SMELT__ATT_COUNT; r++) {
    if (t[r]) st->t[r] = *t[r];
    else st->t[r].ndim = -1;
  }
  return SMELT_OK;
}

static void state_free(void *p) { free(p); }

/* The call's tensors with the desc's modifier tensors added. */
static void with_desc_roles(const smelt_attention_desc *desc, int bwd, const smelt_tensor *const *t,
                            const smelt_tensor **all) {
  memcpy(all, t, SMELT__ATT_COUNT * sizeof *all);
  all[SMELT__ATT_ALIBI] = desc ? desc->alibi_slopes : NULL;
  all[SMELT__ATT_SINKS] = desc ? desc->sinks : NULL;
  all[SMELT__ATT_DSINKS] = desc && bwd ? desc->dsinks : NULL;
}

static smelt_status plan_any(smelt_ctx *ctx, const smelt_attention_desc *desc, int bwd, int varlen,
                             const smelt_tensor *const *t_call, smelt_plan **out) {
  const char *op = op_name(bwd, varlen);
  const smelt_tensor *t[SMELT__ATT_COUNT];
  with_desc_roles(desc, bwd, t_call, t);
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: out is NULL", op);
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: ctx is NULL", op);
  smelt__attn_state *st = (smelt__attn_state *)calloc(1, sizeof *st);
  if (!st) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  smelt_status s = validate(ctx, desc, bwd, varlen, t, st);
  if (s) {
    free(st);
    return s;
  }
  char describe[160];
  snprintf(describe, sizeof describe, "attention %s %s D=%lld H=%lld Hk=%lld%s (cpu reference)", bwd ? "bwd" : "fwd",
           smelt_dtype_name(t[SMELT__ATT_Q]->dtype), (long long)st->D, (long long)st->H, (long long)st->Hk,
           varlen ? " varlen" : "");
  return smelt__family_plan_state(&smelt__family_attention, ctx, st, state_free, describe, NULL, out);
}

static smelt_status run_any(smelt_plan *plan, int bwd, int varlen, const smelt_tensor *const *t_call) {
  const char *op = op_name(bwd, varlen);
  if (!plan) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s_run: plan is NULL", op);
  const smelt__attn_state *st =
      plan->family == &smelt__family_attention ? (const smelt__attn_state *)plan->opdata : NULL;
  if (!st || st->bwd != bwd || st->varlen != varlen)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s_run: the plan is not a %s plan (it was made by %s)", op, op,
                        st ? st->op : "another op");
  /* The modifiers' tensors are the plan's own. */
  const smelt_tensor *t[SMELT__ATT_COUNT];
  memcpy(t, t_call, sizeof t);
  for (int r = SMELT__ATT_ALIBI; r < SMELT__ATT_COUNT; r++) t[r] = st->t[r].ndim >= 0 ? &st->t[r] : NULL;
  smelt_status s;
  if ((s = smelt__check_views(&smelt__family_attention, op, st->t, t)) || (s = check_disjoint(op, bwd, t))) return s;
  smelt__attn_args a;
  for (int r = 0; r < SMELT__ATT_COUNT; r++) a.t[r] = t[r];
  return smelt__plan_dispatch(plan, &a);
}

static smelt_status oneshot(smelt_ctx *ctx, const smelt_attention_desc *desc, int bwd, int varlen,
                            const smelt_tensor *const *t) {
  SMELT__ONE_SHOT(plan_any(ctx, desc, bwd, varlen, t, &plan), run_any(plan, bwd, varlen, t));
}

/* The role table of each public signature (absent roles NULL). */
#define FWD_T(q, k, v, cq, ck, o, lse) {q, k, v, o, lse, cq, ck, NULL, NULL, NULL, NULL}
#define BWD_T(q, k, v, cq, ck, o, d_o, lse, dq, dk, dv) {q, k, v, o, lse, cq, ck, d_o, dq, dk, dv}

smelt_status smelt_attention_fwd_plan(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                      const smelt_tensor *k, const smelt_tensor *v, const smelt_tensor *o,
                                      const smelt_tensor *lse, smelt_plan **out) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = FWD_T(q, k, v, NULL, NULL, o, lse);
  return plan_any(ctx, desc, 0, 0, t, out);
}

smelt_status smelt_attention_fwd_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k,
                                     const smelt_tensor *v, const smelt_tensor *o, const smelt_tensor *lse) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = FWD_T(q, k, v, NULL, NULL, o, lse);
  return run_any(plan, 0, 0, t);
}

smelt_status smelt_attention_fwd(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                 const smelt_tensor *k, const smelt_tensor *v, const smelt_tensor *o,
                                 const smelt_tensor *lse) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = FWD_T(q, k, v, NULL, NULL, o, lse);
  return oneshot(ctx, desc, 0, 0, t);
}

smelt_status smelt_attention_varlen_fwd_plan(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                             const smelt_tensor *k, const smelt_tensor *v,
                                             const smelt_tensor *cu_seqlens_q, const smelt_tensor *cu_seqlens_k,
                                             const smelt_tensor *o, const smelt_tensor *lse, smelt_plan **out) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = FWD_T(q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse);
  return plan_any(ctx, desc, 0, 1, t, out);
}

smelt_status smelt_attention_varlen_fwd_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k,
                                            const smelt_tensor *v, const smelt_tensor *cu_seqlens_q,
                                            const smelt_tensor *cu_seqlens_k, const smelt_tensor *o,
                                            const smelt_tensor *lse) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = FWD_T(q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse);
  return run_any(plan, 0, 1, t);
}

smelt_status smelt_attention_varlen_fwd(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                        const smelt_tensor *k, const smelt_tensor *v, const smelt_tensor *cu_seqlens_q,
                                        const smelt_tensor *cu_seqlens_k, const smelt_tensor *o,
                                        const smelt_tensor *lse) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = FWD_T(q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse);
  return oneshot(ctx, desc, 0, 1, t);
}

smelt_status smelt_attention_bwd_plan(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                      const smelt_tensor *k, const smelt_tensor *v, const smelt_tensor *o,
                                      const smelt_tensor *d_o, const smelt_tensor *lse, const smelt_tensor *dq,
                                      const smelt_tensor *dk, const smelt_tensor *dv, smelt_plan **out) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = BWD_T(q, k, v, NULL, NULL, o, d_o, lse, dq, dk, dv);
  return plan_any(ctx, desc, 1, 0, t, out);
}

smelt_status smelt_attention_bwd_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k,
                                     const smelt_tensor *v, const smelt_tensor *o, const smelt_tensor *d_o,
                                     const smelt_tensor *lse, const smelt_tensor *dq, const smelt_tensor *dk,
                                     const smelt_tensor *dv) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = BWD_T(q, k, v, NULL, NULL, o, d_o, lse, dq, dk, dv);
  return run_any(plan, 1, 0, t);
}

smelt_status smelt_attention_bwd(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                 const smelt_tensor *k, const smelt_tensor *v, const smelt_tensor *o,
                                 const smelt_tensor *d_o, const smelt_tensor *lse, const smelt_tensor *dq,
                                 const smelt_tensor *dk, const smelt_tensor *dv) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = BWD_T(q, k, v, NULL, NULL, o, d_o, lse, dq, dk, dv);
  return oneshot(ctx, desc, 1, 0, t);
}

smelt_status smelt_attention_varlen_bwd_plan(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                             const smelt_tensor *k, const smelt_tensor *v,
                                             const smelt_tensor *cu_seqlens_q, const smelt_tensor *cu_seqlens_k,
                                             const smelt_tensor *o, const smelt_tensor *d_o, const smelt_tensor *lse,
                                             const smelt_tensor *dq, const smelt_tensor *dk, const smelt_tensor *dv,
                                             smelt_plan **out) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = BWD_T(q, k, v, cu_seqlens_q, cu_seqlens_k, o, d_o, lse, dq, dk, dv);
  return plan_any(ctx, desc, 1, 1, t, out);
}

smelt_status smelt_attention_varlen_bwd_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k,
                                            const smelt_tensor *v, const smelt_tensor *cu_seqlens_q,
                                            const smelt_tensor *cu_seqlens_k, const smelt_tensor *o,
                                            const smelt_tensor *d_o, const smelt_tensor *lse, const smelt_tensor *dq,
                                            const smelt_tensor *dk, const smelt_tensor *dv) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = BWD_T(q, k, v, cu_seqlens_q, cu_seqlens_k, o, d_o, lse, dq, dk, dv);
  return run_any(plan, 1, 1, t);
}

smelt_status smelt_attention_varlen_bwd(smelt_ctx *ctx, const smelt_attention_desc *desc, const smelt_tensor *q,
                                        const smelt_tensor *k, const smelt_tensor *v, const smelt_tensor *cu_seqlens_q,
                                        const smelt_tensor *cu_seqlens_k, const smelt_tensor *o,
                                        const smelt_tensor *d_o, const smelt_tensor *lse, const smelt_tensor *dq,
                                        const smelt_tensor *dk, const smelt_tensor *dv) {
  const smelt_tensor *t[SMELT__ATT_COUNT] = BWD_T(q, k, v, cu_seqlens_q, cu_seqlens_k, o, d_o, lse, dq, dk, dv);
  return oneshot(ctx, desc, 1, 1, t);
}

/* ---------------------------------------------------------------- geometry */

void smelt__attn_view_of(const smelt__attn_state *st, const smelt_tensor *t, smelt__attn_view *v) {
  v->data = t->data;
  if (st->varlen) {
    v->bs = 0;
    v->rs = t->strides[0];
    v->hs = t->strides[1];
  } else {
    v->bs = t->strides[0];
    v->rs = t->strides[1];
    v->hs = t->strides[2];
  }
}

void smelt__attn_lse_view_of(const smelt__attn_state *st, const smelt_tensor *t, smelt__attn_view *v) {
  v->data = t->data;
  if (st->varlen) {
    v->bs = 0;
    v->hs = t->strides[0];
    v->rs = t->strides[1];
  } else {
    v->bs = t->strides[0];
    v->hs = t->strides[1];
    v->rs = t->strides[2];
  }
}

void smelt__attn_key_range(int64_t wl, int64_t wr, int64_t sq, int64_t sk, int64_t i, int64_t *lo, int64_t *hi) {
  const int64_t diag = i + sk - sq; /* the key on query i's (bottom-right aligned) diagonal */
  /* Compared before subtracting or adding, so a window near INT64_MAX cannot
   * overflow: it is as wide as no window. sk - 1 - diag = sq - 1 - i. */
  *lo = wl < 0 || wl > diag ? 0 : diag - wl;
  *hi = wr < 0 || wr > sq - 1 - i ? sk - 1 : diag + wr;
}
