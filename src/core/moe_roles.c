/* MoE's tensor roles: their names and dtypes (what the shared checks of
 * src/core/family.c ask), and the one place each role's shape and layout
 * are stated (smelt/moe.h's layouts), for the plan's weights and every
 * run's own tensors alike. */
#include "moe_internal.h"

#include <stdio.h>
#include <string.h>

static const smelt_dtype float_types[] = {SMELT_DTYPE_F64, SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype route_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F64};
static const smelt_dtype index_types[] = {SMELT_DTYPE_I32, SMELT_DTYPE_I64};
static const smelt_dtype i32_type[] = {SMELT_DTYPE_I32}, f32_type[] = {SMELT_DTYPE_F32}, u8_type[] = {SMELT_DTYPE_U8};

#define FLOAT(n, f) {.name = n, .flags = f, .dtypes = float_types, .ndtypes = 4}
#define ROUTE(n, f) {.name = n, .flags = f, .dtypes = route_types, .ndtypes = 2}
#define INDEX(n, f) {.name = n, .flags = f, .dtypes = index_types, .ndtypes = 2}
#define ONE(n, f, dt) {.name = n, .flags = f, .dtypes = dt, .ndtypes = 1}
#define OUT SMELT__ROLE_OUTPUT
const smelt__role smelt__moe_roles[SMELT__MT_ROLES] = {
    [SMELT__MT_X] = FLOAT("x", 0),
    [SMELT__MT_WR] = FLOAT("wr", 0),
    [SMELT__MT_BIAS] = ONE("expert_bias", 0, f32_type),
    [SMELT__MT_WNOISE] = FLOAT("wnoise", 0),
    [SMELT__MT_W1] = FLOAT("w1", 0),
    [SMELT__MT_W3] = FLOAT("w3", 0),
    [SMELT__MT_W2] = FLOAT("w2", 0),
    [SMELT__MT_B1] = FLOAT("b1", 0),
    [SMELT__MT_LOGITS] = ROUTE("logits", OUT),
    [SMELT__MT_IDS] = ONE("ids", OUT, i32_type),
    [SMELT__MT_WEIGHTS] = ROUTE("weights", OUT),
    [SMELT__MT_COUNTS] = INDEX("counts", OUT),
    [SMELT__MT_OFFSETS] = INDEX("offsets", OUT),
    [SMELT__MT_DROPPED] = INDEX("dropped", OUT),
    [SMELT__MT_AUX] = ROUTE("aux", OUT),
    [SMELT__MT_LOGITS_IN] = ROUTE("logits", 0),
    [SMELT__MT_IDS_IN] = ONE("ids", 0, i32_type),
    [SMELT__MT_WEIGHTS_IN] = ROUTE("weights", 0),
    [SMELT__MT_COUNTS_IN] = INDEX("counts", 0),
    [SMELT__MT_OFFSETS_IN] = INDEX("offsets", 0),
    [SMELT__MT_DROPPED_IN] = INDEX("dropped", 0),
    [SMELT__MT_ROW_MAP_IN] = ONE("row_map", 0, i32_type),
    [SMELT__MT_XP_IN] = FLOAT("xp", 0),
    [SMELT__MT_YP_IN] = FLOAT("yp", 0),
    [SMELT__MT_DY_IN] = FLOAT("dy", 0),
    [SMELT__MT_DYP_IN] = FLOAT("dyp", 0),
    [SMELT__MT_DXP_IN] = FLOAT("dxp", 0),
    [SMELT__MT_DWEIGHTS_IN] = ROUTE("dweights", 0),
    [SMELT__MT_SAVED_IN] = ONE("saved", 0, u8_type),
    [SMELT__MT_Y] = FLOAT("y", OUT),
    [SMELT__MT_XP] = FLOAT("xp", OUT),
    [SMELT__MT_ROW_MAP] = ONE("row_map", OUT, i32_type),
    [SMELT__MT_YP] = FLOAT("yp", OUT),
    [SMELT__MT_DLOGITS] = ROUTE("dlogits", OUT),
    [SMELT__MT_DYP] = FLOAT("dyp", OUT),
    [SMELT__MT_DWEIGHTS] = ROUTE("dweights", OUT),
    [SMELT__MT_DX] = FLOAT("dx", OUT),
    [SMELT__MT_DXP] = FLOAT("dxp", OUT),
    [SMELT__MT_DWR] = FLOAT("dwr", OUT),
    [SMELT__MT_DWNOISE] = FLOAT("dwnoise", OUT),
    [SMELT__MT_DW1] = FLOAT("dw1", OUT),
    [SMELT__MT_DW3] = FLOAT("dw3", OUT),
    [SMELT__MT_DW2] = FLOAT("dw2", OUT),
    [SMELT__MT_DB1] = FLOAT("db1", OUT),
    [SMELT__MT_SAVED] = ONE("saved", OUT, u8_type),
};
#undef FLOAT
#undef ROUTE
#undef INDEX
#undef ONE
#undef OUT

/* A role's shape: `n` dims, what they are called, whether rows may have
 * any stride (else contiguous), whether the dtype must be x's. */
typedef struct shape_rule {
  int n;
  int64_t dims[3];
  const char *what;
  int rows, x_dtype;
} shape_rule;

/* The dense gradient roles and the planned weight each is shaped like. */
static int differentiates(int r) {
  switch (r) {
    case SMELT__MT_DWR: return SMELT__MT_WR;
    case SMELT__MT_DWNOISE: return SMELT__MT_WNOISE;
    case SMELT__MT_DW1: return SMELT__MT_W1;
    case SMELT__MT_DW3: return SMELT__MT_W3;
    case SMELT__MT_DW2: return SMELT__MT_W2;
    case SMELT__MT_DB1: return SMELT__MT_B1;
    default: return -1;
  }
}

static shape_rule rule_of(const smelt__moe_state *ms, int r) {
  const int64_t T = ms->T, d = ms->d, E = ms->E, k = ms->k, F = ms->F, R = ms->rows;
  switch (r) {
    case SMELT__MT_X: return (shape_rule){2, {T, d}, "[T, d_model]", 1, 1};
    case SMELT__MT_WR:
    case SMELT__MT_WNOISE: return (shape_rule){2, {d, E}, "[d_model, num_experts]", 0, 0};
    case SMELT__MT_BIAS:
    case SMELT__MT_COUNTS:
    case SMELT__MT_COUNTS_IN: return (shape_rule){1, {E}, "[num_experts]", 0, 0};
    case SMELT__MT_W1:
    case SMELT__MT_W3: return (shape_rule){3, {E, d, F}, "[num_experts, d_model, ffn_dim]", 0, 0};
    case SMELT__MT_W2: return (shape_rule){3, {E, F, d}, "[num_experts, ffn_dim, d_model]", 0, 0};
    case SMELT__MT_B1: return (shape_rule){2, {E, F}, "[num_experts, ffn_dim]", 0, 0};
    case SMELT__MT_LOGITS:
    case SMELT__MT_LOGITS_IN:
    case SMELT__MT_DLOGITS: return (shape_rule){2, {T, E}, "[T, num_experts]", 0, 0};
    case SMELT__MT_OFFSETS:
    case SMELT__MT_OFFSETS_IN: return (shape_rule){1, {E + 1}, "[num_experts + 1]", 0, 0};
    case SMELT__MT_DROPPED:
    case SMELT__MT_DROPPED_IN: return (shape_rule){1, {1}, "[1]", 0, 0};
    case SMELT__MT_AUX: return (shape_rule){1, {2}, "[2]", 0, 0};
    case SMELT__MT_SAVED:
    case SMELT__MT_SAVED_IN: return (shape_rule){1, {ms->saved_bytes}, "[smelt_moe_saved_bytes]", 0, 0};
    case SMELT__MT_Y:
    case SMELT__MT_DY_IN:
    case SMELT__MT_DX: return (shape_rule){2, {T, d}, "[T, d_model]", 1, 1};
    case SMELT__MT_XP:
    case SMELT__MT_XP_IN: return (shape_rule){2, {R, d}, "[T * top_k, d_model]", 0, 1};
    case SMELT__MT_YP:
    case SMELT__MT_YP_IN:
    case SMELT__MT_DYP:
    case SMELT__MT_DYP_IN:
    case SMELT__MT_DXP:
    case SMELT__MT_DXP_IN: return (shape_rule){2, {R, d}, "[T * top_k, d_model]", 0, 0};
    default: return (shape_rule){2, {T, k}, "[T, top_k]", 0, 0}; /* ids, weights, row_map, dweights */
  }
}

smelt_status smelt__moe_check_shape(const smelt__moe_state *ms, int r, const smelt_tensor *t, smelt_dtype xdt) {
  const char *name = smelt__moe_roles[r].name;
  shape_rule rule = rule_of(ms, r);
  const int like = differentiates(r);
  if (like >= 0) {
    const smelt_tensor *ref = &ms->t[like];
    if (ref->ndim < 0)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": grads.%s is given but weights.%s is absent", name,
                          smelt__moe_roles[like].name);
    rule = rule_of(ms, like);
  }
  smelt_status s = smelt__check_dims(MOE_OP, name, t, rule.n, rule.dims, rule.what);
  if (s) return s;
  if (rule.x_dtype && t->dtype != xdt)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, MOE_OP ": %s.dtype=%s must equal x.dtype=%s", name,
                        smelt_dtype_name(t->dtype), smelt_dtype_name(xdt));
  if (rule.rows) {
    if (t->shape[1] > 1 && t->shape[0] > 0 && t->strides[1] != 1)
      return smelt__error(SMELT_STATUS_BAD_LAYOUT, MOE_OP ": %s.strides[1]=%lld must be 1 (rows of unit stride)",
                          name, (long long)t->strides[1]);
    return SMELT_OK;
  }
  if (!smelt_tensor_is_contiguous(t))
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, MOE_OP ": %s must be contiguous (row-major)", name);
  return SMELT_OK;
}
