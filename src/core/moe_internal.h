/* MoE internals shared by the core (validation, plans, runs) and the
 * backends: the tensor roles, what a run hands the backend, and the plan's
 * resolved description. One plan serves every part and the layer, each a
 * run with tensors of its own, as PEER's plan does. */
#ifndef SMELT_MOE_INTERNAL_H
#define SMELT_MOE_INTERNAL_H

#include "internal.h"

/* MoE's tensor roles (smelt__family_moe's, by index): x and the weights,
 * which runs bind as planned, then each run's own. A tensor that is one
 * run's output and another's input has two roles (FOO and FOO_IN). */
enum {
  SMELT__MT_X = 0, SMELT__MT_WR, SMELT__MT_BIAS, SMELT__MT_WNOISE, SMELT__MT_W1, SMELT__MT_W3, SMELT__MT_W2,
  SMELT__MT_B1,
  SMELT__MT_COUNT, /* the planned roles */
  /* the router's outputs */
  SMELT__MT_LOGITS = SMELT__MT_COUNT, SMELT__MT_IDS, SMELT__MT_WEIGHTS, SMELT__MT_COUNTS, SMELT__MT_OFFSETS,
  SMELT__MT_DROPPED, SMELT__MT_AUX,
  /* the parts' inputs */
  SMELT__MT_LOGITS_IN, SMELT__MT_IDS_IN, SMELT__MT_WEIGHTS_IN, SMELT__MT_COUNTS_IN, SMELT__MT_OFFSETS_IN,
  SMELT__MT_DROPPED_IN, SMELT__MT_ROW_MAP_IN, SMELT__MT_XP_IN, SMELT__MT_YP_IN, SMELT__MT_DY_IN,
  SMELT__MT_DYP_IN, SMELT__MT_DXP_IN, SMELT__MT_DWEIGHTS_IN, SMELT__MT_SAVED_IN,
  /* the parts' and the layer's outputs */
  SMELT__MT_Y, SMELT__MT_XP, SMELT__MT_ROW_MAP, SMELT__MT_YP, SMELT__MT_DLOGITS, SMELT__MT_DYP,
  SMELT__MT_DWEIGHTS, SMELT__MT_DX, SMELT__MT_DXP, SMELT__MT_DWR, SMELT__MT_DWNOISE, SMELT__MT_DW1, SMELT__MT_DW3,
  SMELT__MT_DW2, SMELT__MT_DB1, SMELT__MT_SAVED,
  SMELT__MT_ROLES
};

/* What a run asks of the backend. */
typedef enum smelt__moe_mode {
  SMELT__MOE_ROUTE, SMELT__MOE_AUX, SMELT__MOE_ROUTE_BWD, SMELT__MOE_PERMUTE, SMELT__MOE_PERMUTE_BWD,
  SMELT__MOE_UNPERMUTE, SMELT__MOE_UNPERMUTE_BWD, SMELT__MOE_FFN, SMELT__MOE_FFN_BWD, SMELT__MOE_FORWARD,
  SMELT__MOE_BACKWARD, SMELT__MOE_STATS, SMELT__MOE_FORWARD_SAVE, SMELT__MOE_BACKWARD_SAVED, SMELT__MOE_MODES
} smelt__moe_mode;

typedef struct smelt__moe_args {
  smelt__moe_mode mode;
  const smelt_tensor *t[SMELT__MT_ROLES]; /* by role, validated; NULL where absent */
  smelt_moe_stats *stats;                 /* the forward's and STATS's (may be NULL in the forward) */
} smelt__moe_args;

/* The plan's resolved description (plan->opdata). */
typedef struct smelt__moe_state {
  smelt_moe_config cfg;
  int64_t T, d, E, k, F;
  int64_t rows;      /* T·k: the permuted tensors' rows */
  int64_t capacity;  /* tokens an expert keeps; -1: no capacity */
  smelt_dtype route_dt; /* f32, or f64 when x is f64: the internal logits and weights */
  int64_t saved_bytes;  /* smelt_moe_saved_bytes: the backend's (CUDA: its kept state; CPU: 0) */
  smelt_tensor t[SMELT__MT_ROLES]; /* planned views by role; ndim -1 = absent */
  /* CUDA backend state (src/cuda/op_moe.c), freed with cuda_free. */
  void *cuda;
  void (*cuda_free)(void *cuda);
} smelt__moe_state;

#define MOE_OP "smelt_moe"

/* smelt_moe_saved_bytes_for's work (src/core/op_moe.c); the CUDA layout's
 * size (src/cuda/moe_bwd.c, which every build compiles). */
smelt_status smelt__moe_saved_bytes_for(const smelt_moe_config *cfg, int64_t tokens, smelt_dtype x_dtype,
                                        smelt_device_kind device, int64_t *bytes);
size_t smelt__moe_cuda_saved_bytes(const smelt__moe_state *ms);

/* The roles' names, flags and dtypes (src/core/moe_roles.c). */
extern const smelt__role smelt__moe_roles[SMELT__MT_ROLES];
/* x and the weights by role (NULL = absent). */
void smelt__moe_weight_list(const smelt_moe_weights *w, const smelt_tensor *x, const smelt_tensor **out);
/* Role r's tensor t (validated, of the role's dtypes) has the shape and
 * layout ms's sizes give it, and x's dtype xdt where it must. */
smelt_status smelt__moe_check_shape(const smelt__moe_state *ms, int r, const smelt_tensor *t, smelt_dtype xdt);

/* Statistics from counts [E] and dropped [1] (or NULL: T·k - kept), both
 * readable on the host (src/core/moe_stats.c). */
void smelt__moe_stats_of(const smelt__moe_state *ms, const smelt_tensor *counts, const smelt_tensor *dropped,
                         smelt_moe_stats *st);

/* dw [E, a, b] (contiguous): dw[e] = lhs_eᵀ · rhs_e over the rows
 * [start[e], start[e+1]) of lhs [rows, a] and rhs [rows, b] (contiguous),
 * start [E+1] on the host (src/core/op_moe_wgrad.c). */
smelt_status smelt__moe_weight_grad(smelt_ctx *ctx, const smelt__moe_state *ms, const int64_t *start,
                                    const smelt_tensor *lhs, const smelt_tensor *rhs, const smelt_tensor *dw);

#endif /* SMELT_MOE_INTERNAL_H */
