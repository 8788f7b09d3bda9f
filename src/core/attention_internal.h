/* Attention internals shared by the core (validation, plan/run), the CPU
 * reference and the CUDA backend: the plan's resolved description, the
 * tensors of a run, and the geometry helpers all backends agree on. */
#ifndef SMELT_ATTENTION_INTERNAL_H
#define SMELT_ATTENTION_INTERNAL_H

#include "internal.h"

/* The tensors of every attention call, by role. */
enum {
  SMELT__ATT_Q,
  SMELT__ATT_K,
  SMELT__ATT_V,
  SMELT__ATT_O,
  SMELT__ATT_LSE,
  SMELT__ATT_CU_Q, /* varlen only */
  SMELT__ATT_CU_K,
  SMELT__ATT_DO, /* backward only */
  SMELT__ATT_DQ,
  SMELT__ATT_DK,
  SMELT__ATT_DV,
  SMELT__ATT_ALIBI, /* the desc's score modifiers, when given */
  SMELT__ATT_SINKS,
  SMELT__ATT_DSINKS, /* backward only */
  SMELT__ATT_COUNT
};

/* The score modifiers a call uses, as bits: what the CUDA variants are
 * generated for (src/cuda/op_attention.c). */
enum { SMELT__ATT_MOD_SOFTCAP = 1, SMELT__ATT_MOD_ALIBI = 2, SMELT__ATT_MOD_SINKS = 4 };

/* The plan's resolved description (plan->opdata). */
typedef struct smelt__attn_state {
  const char *op;            /* "smelt_attention_fwd", "smelt_attention_varlen_bwd", ... */
  int bwd, varlen;
  smelt_attention_desc desc; /* as given (the defaults when NULL) */
  double scale;              /* resolved: never 0 */
  int64_t wl, wr;            /* resolved windows, -1 unbounded; causal made wr 0 */
  int mods;                  /* SMELT__ATT_MOD_* of the desc */
  double softcap;            /* 0 = none */
  int64_t B, H, Hk, D;
  int64_t Sq, Sk;            /* batched: the lengths; varlen: max_seqlen_q, max_seqlen_k */
  int64_t rows_q, rows_k;    /* query / key rows of all sequences: B * Sq or Tq (B * Sk or Tk) */
  smelt_tensor t[SMELT__ATT_COUNT]; /* the planned views (data ignored); ndim -1 = absent */
} smelt__attn_state;

/* What a run binds: every role's tensor, NULL when absent (the modifiers'
 * are the plan's own views). */
typedef struct smelt__attn_args {
  const smelt_tensor *t[SMELT__ATT_COUNT];
} smelt__attn_args;

/* A q/k/v/o-like tensor as strides in elements: element (b, r, h, d) at
 * data + b * bs + r * rs + h * hs + d (D has unit stride). Varlen tensors
 * are [rows, heads, D]: bs = 0 and r counts packed rows. */
typedef struct smelt__attn_view {
  void *data;
  int64_t bs, rs, hs;
} smelt__attn_view;
void smelt__attn_view_of(const smelt__attn_state *st, const smelt_tensor *t, smelt__attn_view *v);
/* lse as strides: element (b, h, r) at data + b * bs + h * hs + r * rs
 * (varlen: [H, Tq], bs = 0). */
void smelt__attn_lse_view_of(const smelt__attn_state *st, const smelt_tensor *t, smelt__attn_view *v);

/* The keys query i may see: [*lo, *hi] (empty when hi < lo), for a sequence
 * of sq queries and sk keys. The one definition of the mask. */
void smelt__attn_key_range(int64_t wl, int64_t wr, int64_t sq, int64_t sk, int64_t i, int64_t *lo, int64_t *hi);

/* The backends (smelt__cpu_attention in src/cpu/attention.c,
 * smelt__cuda_attention in src/cuda/op_attention.c) run a
 * `const smelt__attn_args *`; the plan reads only plan->opdata. */

#endif /* SMELT_ATTENTION_INTERNAL_H */
