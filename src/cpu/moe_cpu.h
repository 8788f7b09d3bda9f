/* The MoE CPU reference's pieces, shared by its files: the routing of a
 * logits tensor, the noise, host scratch tensors, and the parts, each a
 * function of the role-indexed tensors of a run (src/core/moe_internal.h)
 * so the layer composes them exactly as a caller composes the parts'
 * runs. Everything computes in double and rounds once into its outputs. */
#ifndef SMELT_MOE_CPU_H
#define SMELT_MOE_CPU_H

#include "../core/moe_internal.h"

/* Philox-4x32-10 (Salmon et al. 2011, Random123's constants): ctr
 * encrypted under key, in place. */
void smelt__philox4x32_10(uint32_t ctr[4], const uint32_t key[2]);
/* The noise n(seed, token, e) of smelt/moe.h: a standard normal. */
double smelt__moe_normal(uint64_t seed, int64_t token, int64_t e);

/* A routing of logits [T, E] (smelt/moe.h), before it is written out. */
typedef struct smelt__moe_route {
  double *s;           /* [T, E] scores */
  int64_t *sel;        /* [T, k] the selected experts, best first (dropped ones too) */
  double *w;           /* [T, k] their weights as selected (before drops) */
  unsigned char *kept; /* [T, k] 0 where dropped */
  int64_t *sel_count;  /* [E] selections before drops (the load-balance loss's count_e) */
  int64_t *count;      /* [E] kept */
} smelt__moe_route;

smelt_status smelt__moe_route_compute(const smelt__moe_state *ms, const smelt_tensor *logits,
                                      const smelt_tensor *bias, smelt__moe_route *r);
void smelt__moe_route_free(smelt__moe_route *r);
/* Whether a token's weights are divided by their sum (smelt/moe.h). */
int smelt__moe_renormalizes(const smelt__moe_state *ms);

/* A zeroed contiguous host tensor [d0] (d1 < 0) or [d0, d1]; free its data. */
smelt_status smelt__moe_scratch(smelt_tensor *t, smelt_dtype dt, int64_t d0, int64_t d1, const char *what);

/* Element i (row-major) of t as double, and a store. */
double smelt__moe_get(const smelt_tensor *t, int64_t i);
/* Element i of an integer tensor (i32 or i64: ids, counts, offsets),
 * exactly: through a double, an i64 near 2^63 would not convert back. */
int64_t smelt__moe_geti(const smelt_tensor *t, int64_t i);
void smelt__moe_set(const smelt_tensor *t, int64_t i, double v);
/* Element (r, c) of a [rows, cols] view with any row stride. */
double smelt__moe_get2(const smelt_tensor *t, int64_t r, int64_t c);
void smelt__moe_set2(const smelt_tensor *t, int64_t r, int64_t c, double v);

/* The parts (t: role-indexed; validated by the core). ctx runs the GEMMs. */
smelt_status smelt__moe_cpu_route(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t);
/* The aux losses of t[LOGITS_IN] into t[AUX] (if present); their gradient
 * added to dlogits (double [T, E]) when it is not NULL. */
smelt_status smelt__moe_cpu_aux(const smelt__moe_state *ms, const smelt_tensor *const *t, const smelt__moe_route *r,
                                double *dlogits);
smelt_status smelt__moe_cpu_aux_run(const smelt__moe_state *ms, const smelt_tensor *const *t);
smelt_status smelt__moe_cpu_route_bwd(const smelt__moe_state *ms, const smelt_tensor *const *t);
smelt_status smelt__moe_cpu_permute(const smelt__moe_state *ms, const smelt_tensor *const *t);
smelt_status smelt__moe_cpu_permute_bwd(const smelt__moe_state *ms, const smelt_tensor *const *t);
smelt_status smelt__moe_cpu_unpermute(const smelt__moe_state *ms, const smelt_tensor *const *t);
smelt_status smelt__moe_cpu_unpermute_bwd(const smelt__moe_state *ms, const smelt_tensor *const *t);
smelt_status smelt__moe_cpu_ffn(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t);
smelt_status smelt__moe_cpu_ffn_bwd(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt_tensor *const *t);
/* The expert row ranges of offsets [E+1] (i32 or i64), checked: 0 first,
 * non-decreasing, at most T·k rows. ends[e] = offsets[e+1]. */
smelt_status smelt__moe_offsets(const smelt__moe_state *ms, const smelt_tensor *offsets, int64_t *ends);

#endif /* SMELT_MOE_CPU_H */
