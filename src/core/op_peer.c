/* smelt_peer_*: the configuration, PEER's half of the op-family interface
 * (its tensor roles and the checks the shared code cannot make), and
 * plan/run/one-shot for retrieval, forward and backward.
 *
 * One plan serves three kinds of run, each with tensors of its own, and
 * the weights come as a struct, so PEER has entry points of its own around
 * the shared pieces (src/core/family.c), as GEMM and attention do.
 * Everything static is checked when planning (config, weight layouts, x);
 * a run checks its tensors against the plan and its outputs against the
 * config before a backend sees anything, so a failed call writes nothing. */
#include "error_bound.h"
#include "peer_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_peer"

smelt_peer_config smelt_peer_config_default(void) {
  smelt_peer_config c;
  memset(&c, 0, sizeof c);
  c.num_experts_per_tok = 16;
  c.num_heads = 8;
  c.expert_hidden_size = 1;
  c.product_key_dims = 2;
  c.activation = SMELT_ACT_GELU;
  c.query_norm = SMELT_PEER_NORM_NONE;
  c.norm_eps = 1e-5;
  c.l2_eps = 1e-12;
  c.gate = SMELT_PEER_GATE_SOFTMAX;
  return c;
}

/* ---------------------------------------------------------------- the config */

#define DIM_MAX ((int64_t)1 << 31)

/* cfg.<field> = v in [1, 2^31), kept in *out. */
static smelt_status take_dim(const char *field, int64_t v, int64_t *out) {
  if (v < 1 || v >= DIM_MAX)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": cfg.%s=%lld must be in [1, 2^31)", field, (long long)v);
  *out = v;
  return SMELT_OK;
}

/* n^(1/p) when it is a whole number, else 0. */
static int64_t exact_root(int64_t n, int p) {
  int64_t r = (int64_t)llround(pow((double)n, 1.0 / p));
  for (int64_t c = r > 1 ? r - 1 : 1; c <= r + 1; c++) {
    int64_t v = 1;
    for (int i = 0; i < p && v <= n; i++) v *= c;
    if (v == n) return c;
  }
  return 0;
}

/* Validates cfg and fills ps's sizes (sub_key_sizes resolved). */
static smelt_status resolve_config(const smelt_peer_config *cfg, smelt__peer_state *ps) {
  smelt_status s;
  memset(ps, 0, sizeof *ps);
  ps->cfg = *cfg;
  if ((s = take_dim("input_dim", cfg->input_dim, &ps->din)) ||
      (s = take_dim("output_dim", cfg->output_dim, &ps->dout)) || (s = take_dim("num_experts", cfg->num_experts, &ps->N)) ||
      (s = take_dim("num_heads", cfg->num_heads, &ps->h)) ||
      (s = take_dim("expert_hidden_size", cfg->expert_hidden_size, &ps->he)) ||
      (s = take_dim("query_dim", cfg->query_dim, &ps->dq)))
    return s;
  const int p = cfg->product_key_dims;
  if (p < 2 || p > SMELT_PEER_MAX_DIMS)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": cfg.product_key_dims=%d must be in [2, %d]", p,
                        SMELT_PEER_MAX_DIMS);
  if (cfg->num_experts_per_tok < 1 || cfg->num_experts_per_tok > cfg->num_experts)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": cfg.num_experts_per_tok=%lld must be in [1, num_experts=%lld]",
                        (long long)cfg->num_experts_per_tok, (long long)cfg->num_experts);
  if (cfg->query_dim % p)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": cfg.query_dim=%lld must be a multiple of product_key_dims=%d", (long long)cfg->query_dim,
                        p);
  if (cfg->activation != SMELT_ACT_GELU && cfg->activation != SMELT_ACT_RELU)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": cfg.activation=%s is not supported (supported: gelu, relu)",
                        smelt_act_name(cfg->activation));
  if ((unsigned)cfg->query_norm >= SMELT_PEER_NORM_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": cfg.query_norm=%d is not a smelt_peer_norm (none, layernorm, batchnorm, l2)",
                        (int)cfg->query_norm);
  if ((unsigned)cfg->gate >= SMELT_PEER_GATE_COUNT)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": cfg.gate=%d is not a smelt_peer_gate (softmax, sigmoid, relu)", (int)cfg->gate);
  const smelt_peer_kernels *kc = &cfg->kernels;
  if ((unsigned)kc->route >= SMELT_PEER_ROUTE_COUNT || (unsigned)kc->expert >= SMELT_PEER_EXPERT_COUNT ||
      (unsigned)kc->overlap >= SMELT_PEER_OVERLAP_COUNT || (unsigned)kc->projection >= SMELT_PEER_PROJECTION_COUNT ||
      kc->head_groups < 0 || kc->head_groups > 2)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": cfg.kernels route=%d expert=%d overlap=%d projection=%d head_groups=%d: each must be "
                           "one of its enum's values (0 = auto), head_groups 0, 1 or 2",
                        (int)kc->route, (int)kc->expert, (int)kc->overlap, (int)kc->projection, kc->head_groups);
  if (!isfinite(cfg->norm_eps) || cfg->norm_eps < 0 || !isfinite(cfg->l2_eps) || cfg->l2_eps < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": cfg.norm_eps=%g and cfg.l2_eps=%g must be finite and >= 0",
                        cfg->norm_eps, cfg->l2_eps);
  int all_zero = 1;
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) all_zero &= cfg->sub_key_sizes[i] == 0;
  for (int i = p; i < SMELT_PEER_MAX_DIMS; i++)
    if (cfg->sub_key_sizes[i])
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                          OP ": cfg.sub_key_sizes[%d]=%lld must be 0 (product_key_dims=%d)", i,
                          (long long)cfg->sub_key_sizes[i], p);
  if (all_zero) {
    int64_t r = exact_root(cfg->num_experts, p);
    if (!r)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                          OP ": cfg.num_experts=%lld is not a %d-th power; set cfg.sub_key_sizes",
                          (long long)cfg->num_experts, p);
    for (int i = 0; i < p; i++) ps->cfg.sub_key_sizes[i] = r;
  }
  int64_t prod = 1;
  for (int i = 0; i < p; i++) {
    int64_t n = ps->cfg.sub_key_sizes[i];
    if (n < 1 || n > cfg->num_experts)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": cfg.sub_key_sizes[%d]=%lld must be in [1, num_experts]",
                          i, (long long)n);
    if (__builtin_mul_overflow(prod, n, &prod))
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                          OP ": the product of cfg.sub_key_sizes overflows, so it cannot be num_experts=%lld",
                          (long long)cfg->num_experts);
    ps->n[i] = n;
  }
  if (prod != cfg->num_experts)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": the product of cfg.sub_key_sizes is %lld but num_experts=%lld", (long long)prod,
                        (long long)cfg->num_experts);
  ps->k = cfg->num_experts_per_tok;
  ps->p = p;
  ps->dsub = cfg->query_dim / p;
  if (ps->h * ps->dq >= DIM_MAX || ps->h * ps->k >= DIM_MAX)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": num_heads * query_dim = %lld and num_heads * k = %lld must be < 2^31",
                        (long long)(ps->h * ps->dq), (long long)(ps->h * ps->k));
  return SMELT_OK;
}

/* ---------------------------------------------------------------- tensors */

static const smelt_dtype float_types[] = {SMELT_DTYPE_F64, SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt_dtype i64_type[] = {SMELT_DTYPE_I64}, f32_type[] = {SMELT_DTYPE_F32};

/* Which roles a call takes depends on the config and the run, so this file
 * checks presence; the shared code checks each tensor, its dtype and
 * device, a run's weights against the plan's, and the outputs' overlaps. */
#define FLOAT(n, f) {.name = n, .flags = f, .dtypes = float_types, .ndtypes = 4}
#define ONE(n, f, dt) {.name = n, .flags = f, .dtypes = dt, .ndtypes = 1}
#define OUT SMELT__ROLE_OUTPUT
static const smelt__role roles[SMELT__PT_ROLES] = {
    [SMELT__PT_X] = FLOAT("x", 0),
    [SMELT__PT_WQ] = FLOAT("wq", 0),
    [SMELT__PT_BQ] = FLOAT("bq", 0),
    [SMELT__PT_NORM_W] = FLOAT("norm_weight", 0),
    [SMELT__PT_NORM_B] = FLOAT("norm_bias", 0),
    [SMELT__PT_BN_MEAN] = FLOAT("bn_mean", 0),
    [SMELT__PT_BN_VAR] = FLOAT("bn_var", 0),
    [SMELT__PT_KEY0] = FLOAT("sub_keys[0]", 0),
    [SMELT__PT_KEY0 + 1] = FLOAT("sub_keys[1]", 0),
    [SMELT__PT_KEY0 + 2] = FLOAT("sub_keys[2]", 0),
    [SMELT__PT_KEY0 + 3] = FLOAT("sub_keys[3]", 0),
    [SMELT__PT_U] = FLOAT("u", 0),
    [SMELT__PT_V] = FLOAT("v", 0),
    [SMELT__PT_Y] = FLOAT("y", OUT),
    [SMELT__PT_IDS] = ONE("ids", OUT, i64_type),
    [SMELT__PT_SCORES] = ONE("scores", OUT, f32_type),
    [SMELT__PT_IDS_IN] = ONE("ids", 0, i64_type),
    [SMELT__PT_DY] = FLOAT("dy", 0),
    [SMELT__PT_DX] = FLOAT("dx", OUT),
    [SMELT__PT_DWQ] = FLOAT("dwq", OUT),
    [SMELT__PT_DBQ] = FLOAT("dbq", OUT),
    [SMELT__PT_DNORM_W] = FLOAT("dnorm_weight", OUT),
    [SMELT__PT_DNORM_B] = FLOAT("dnorm_bias", OUT),
    [SMELT__PT_DKEY0] = FLOAT("dsub_keys[0]", OUT),
    [SMELT__PT_DKEY0 + 1] = FLOAT("dsub_keys[1]", OUT),
    [SMELT__PT_DKEY0 + 2] = FLOAT("dsub_keys[2]", OUT),
    [SMELT__PT_DKEY0 + 3] = FLOAT("dsub_keys[3]", OUT),
    [SMELT__PT_DU] = FLOAT("du", OUT),
    [SMELT__PT_DV] = FLOAT("dv", OUT),
    [SMELT__PT_GRAD_IDS] = ONE("grad_ids", OUT, i64_type),
    [SMELT__PT_GRAD_COUNT] = ONE("grad_count", OUT, i64_type),
    [SMELT__PT_DU_ROWS] = FLOAT("du_rows", OUT),
    [SMELT__PT_DV_ROWS] = FLOAT("dv_rows", OUT),
};
#undef FLOAT
#undef ONE
#undef OUT

/* The planned role each dense gradient's role differentiates. */
static const int differentiates[SMELT__PT_ROLES] = {
    [SMELT__PT_DWQ] = SMELT__PT_WQ,         [SMELT__PT_DBQ] = SMELT__PT_BQ,
    [SMELT__PT_DNORM_W] = SMELT__PT_NORM_W, [SMELT__PT_DNORM_B] = SMELT__PT_NORM_B,
    [SMELT__PT_DKEY0] = SMELT__PT_KEY0,     [SMELT__PT_DKEY0 + 1] = SMELT__PT_KEY0 + 1,
    [SMELT__PT_DKEY0 + 2] = SMELT__PT_KEY0 + 2, [SMELT__PT_DKEY0 + 3] = SMELT__PT_KEY0 + 3,
    [SMELT__PT_DU] = SMELT__PT_U,           [SMELT__PT_DV] = SMELT__PT_V,
};

const smelt__family smelt__family_peer = {
    .name = "peer",
    .op = OP,
    .what = "a PEER",
    .nroles = SMELT__PT_ROLES,
    .roles = roles,
    .cpu = &smelt__cpu_peer,
    .cuda = &smelt__cuda_peer,
    .bound = smelt__bound_peer,
};

/* t has exactly the n dims given. */
static smelt_status check_shape(const char *name, const smelt_tensor *t, int n, const int64_t *dims,
                                const char *what) {
  return smelt__check_dims(OP, name, t, n, dims, what);
}

static smelt_status check_contiguous(const char *name, const smelt_tensor *t) {
  if (!smelt_tensor_is_contiguous(t))
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, OP ": %s must be contiguous (row-major)", name);
  return SMELT_OK;
}

/* t has exactly the n dims given and is contiguous. */
static smelt_status check_dense(const char *name, const smelt_tensor *t, int n, const int64_t *dims,
                                const char *what) {
  smelt_status s = check_shape(name, t, n, dims, what);
  return s ? s : check_contiguous(name, t);
}

/* [rows, cols] rows with unit column stride. */
static smelt_status check_rows(const char *name, const smelt_tensor *t, int64_t rows, int64_t cols,
                               const char *what) {
  int64_t dims[2] = {rows, cols};
  smelt_status s = check_shape(name, t, 2, dims, what);
  if (s) return s;
  if (cols > 1 && rows > 0 && t->strides[1] != 1)
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, OP ": %s.strides[1]=%lld must be 1 (rows of unit stride)", name,
                        (long long)t->strides[1]);
  return SMELT_OK;
}

/* Norm parameter: [dq] or [h, dq], contiguous. Sets *per_head. */
static smelt_status check_norm_param(const char *name, const smelt_tensor *t, const smelt__peer_state *ps,
                                     int *per_head) {
  smelt_status s;
  if ((s = check_contiguous(name, t))) return s;
  if (t->ndim == 1 && t->shape[0] == ps->dq) {
    *per_head = 0;
    return SMELT_OK;
  }
  if (t->ndim == 2 && t->shape[0] == ps->h && t->shape[1] == ps->dq) {
    *per_head = 1;
    return SMELT_OK;
  }
  char a[160];
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": %s.shape=%s must be [query_dim]=[%lld] or [num_heads, query_dim]=[%lld, %lld]",
                      name, smelt__shape_str(t, a, sizeof a), (long long)ps->dq, (long long)ps->h, (long long)ps->dq);
}

/* x and the weights by role (NULL = absent). */
static void weight_list(const smelt_peer_weights *w, const smelt_tensor *x, const smelt_tensor **out) {
  out[SMELT__PT_X] = x;
  out[SMELT__PT_WQ] = w->wq;
  out[SMELT__PT_BQ] = w->bq;
  out[SMELT__PT_NORM_W] = w->norm_weight;
  out[SMELT__PT_NORM_B] = w->norm_bias;
  out[SMELT__PT_BN_MEAN] = w->bn_mean;
  out[SMELT__PT_BN_VAR] = w->bn_var;
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) out[SMELT__PT_KEY0 + i] = w->sub_keys[i];
  out[SMELT__PT_U] = w->u;
  out[SMELT__PT_V] = w->v;
}

/* The norm parameters (layernorm's and batchnorm's affine pair, batchnorm's
 * running statistics): which the config takes, one shape and one dtype. */
static smelt_status check_norm_params(const smelt_tensor *const *list, smelt__peer_state *ps) {
  const smelt_peer_norm norm = ps->cfg.query_norm;
  const int affine = norm == SMELT_PEER_NORM_LAYERNORM || norm == SMELT_PEER_NORM_BATCHNORM;
  int per_head = -1;
  smelt_dtype param_dt = SMELT_DTYPE_F32;
  smelt_status s;
  for (int r = SMELT__PT_NORM_W; r <= SMELT__PT_BN_VAR; r++) {
    const char *name = roles[r].name;
    const smelt_tensor *t = list[r];
    const int allowed = r <= SMELT__PT_NORM_B ? affine : norm == SMELT_PEER_NORM_BATCHNORM;
    if (!t) {
      if (r > SMELT__PT_NORM_B && allowed)
        return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights.%s is NULL but query_norm is batchnorm", name);
      continue;
    }
    if (!allowed)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": weights.%s is given but cfg.query_norm does not use it",
                          name);
    int ph = 0;
    if ((s = check_norm_param(name, t, ps, &ph))) return s;
    if (per_head >= 0 && ph != per_head)
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                          OP ": weights.%s is %s but an earlier norm parameter is %s; use one shape for all", name,
                          ph ? "[num_heads, query_dim]" : "[query_dim]", per_head ? "[num_heads, query_dim]" : "[query_dim]");
    if (per_head >= 0 && t->dtype != param_dt)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH,
                          OP ": weights.%s.dtype=%s differs from an earlier norm parameter's %s; use one dtype for all",
                          name, smelt_dtype_name(t->dtype), smelt_dtype_name(param_dt));
    per_head = ph;
    param_dt = t->dtype;
  }
  ps->norm_per_head = per_head == 1;
  return SMELT_OK;
}

/* The sub-keys: p tables of the config's sizes, one dtype. */
static smelt_status check_keys(const smelt_tensor *const *list, const smelt__peer_state *ps) {
  smelt_dtype key_dt = SMELT_DTYPE_COUNT;
  smelt_status s;
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) {
    const char *name = roles[SMELT__PT_KEY0 + i].name;
    const smelt_tensor *c = list[SMELT__PT_KEY0 + i];
    if (i >= ps->p) {
      if (c)
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": weights.%s is given but product_key_dims=%d", name,
                            ps->p);
      continue;
    }
    if (!c) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights.%s is NULL", name);
    int64_t dims[3] = {ps->h, ps->n[i], ps->dsub};
    if ((s = ps->cfg.per_head_keys
                 ? check_dense(name, c, 3, dims, "[num_heads, n_i, query_dim / product_key_dims]")
                 : check_dense(name, c, 2, dims + 1, "[n_i, query_dim / product_key_dims]")))
      return s;
    if (i > 0 && c->dtype != key_dt)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": weights.%s.dtype=%s must equal sub_keys[0].dtype=%s",
                          name, smelt_dtype_name(c->dtype), smelt_dtype_name(key_dt));
    key_dt = c->dtype;
  }
  return SMELT_OK;
}

/* The experts: dense u and v of the config's sizes and one dtype, or a
 * store of the same context holding them. */
static smelt_status check_experts(const smelt_ctx *ctx, const smelt_peer_weights *w, const smelt__peer_state *ps) {
  smelt_status s;
  if ((w->u != NULL) != (w->v != NULL))
    return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights.%s is NULL but weights.%s is given", w->u ? "v" : "u",
                        w->u ? "u" : "v");
  if (w->u && w->store)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": weights.u/v and weights.store are both given; the experts come from one of them");
  if (!w->u && !w->store)
    return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights.u, weights.v and weights.store are all NULL");
  if (w->u) {
    int64_t ud[3] = {ps->N, ps->din, ps->he}, vd[3] = {ps->N, ps->he, ps->dout};
    if ((s = check_dense("u", w->u, 3, ud, "[num_experts, input_dim, expert_hidden_size]")) ||
        (s = check_dense("v", w->v, 3, vd, "[num_experts, expert_hidden_size, output_dim]")))
      return s;
    if (w->u->dtype != w->v->dtype)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": v.dtype=%s must equal u.dtype=%s",
                          smelt_dtype_name(w->v->dtype), smelt_dtype_name(w->u->dtype));
    return SMELT_OK;
  }
  const smelt_peer_store *st = w->store;
  if (st->ctx != ctx)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": weights.store belongs to another context");
  if (st->N != ps->N || st->din != ps->din || st->dout != ps->dout || st->he != ps->he)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                        OP ": weights.store holds %lld experts of [%lld, %lld] x [%lld, %lld] but the config needs "
                        "%lld of [%lld, %lld] x [%lld, %lld]",
                        (long long)st->N, (long long)st->din, (long long)st->he, (long long)st->he,
                        (long long)st->dout, (long long)ps->N, (long long)ps->din, (long long)ps->he,
                        (long long)ps->he, (long long)ps->dout);
  return SMELT_OK;
}

/* Validates the weights and x against the resolved config; fills ps->t. */
static smelt_status check_weights(smelt_ctx *ctx, const smelt_peer_weights *w, const smelt_tensor *x,
                                  smelt__peer_state *ps) {
  if (!w) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights is NULL");
  if (!x) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": x is NULL");
  if (!w->wq) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights.wq is NULL");
  const smelt_tensor *list[SMELT__PT_ROLES] = {NULL};
  weight_list(w, x, list);
  smelt_status s;
  for (int r = 0; r < SMELT__PT_COUNT; r++)
    if (list[r] && (s = smelt__check_role(OP, &roles[r], list[r], ctx))) return s;
  if (x->ndim != 2)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": x.ndim=%d must be 2 (x[T, input_dim])", x->ndim);
  ps->T = x->shape[0];
  if (ps->T >= DIM_MAX / (ps->h * ps->k) + 1)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": x.shape[0]=%lld tokens times num_heads*k exceeds 2^31",
                        (long long)ps->T);
  int64_t hd = ps->h * ps->dq;
  int64_t wq_dims[2] = {ps->din, hd};
  if ((s = check_rows("x", x, ps->T, ps->din, "[T, input_dim]")) ||
      (s = check_shape("wq", w->wq, 2, wq_dims, "[input_dim, num_heads * query_dim]")) ||
      (w->bq && (s = check_shape("bq", w->bq, 1, &hd, "[num_heads * query_dim]"))) ||
      (s = check_norm_params(list, ps)) || (s = check_keys(list, ps)) || (s = check_experts(ctx, w, ps)))
    return s;
  for (int r = 0; r < SMELT__PT_ROLES; r++) {
    if (list[r]) ps->t[r] = *list[r];
    else ps->t[r].ndim = -1;
  }
  ps->store = w->store;
  return SMELT_OK;
}

/* A run's own tensor of role r (validated, of its role's dtype) against
 * the config and the others of the run, t. */
static smelt_status check_own(const smelt__peer_state *ps, const smelt_tensor *const *t, int r) {
  const char *name = roles[r].name;
  const int64_t nuse = ps->T * ps->h * ps->k;
  const int64_t topk[3] = {ps->T, ps->h, ps->k}, one = 1;
  const int64_t rows[2][3] = {{nuse, ps->din, ps->he}, {nuse, ps->he, ps->dout}};
  switch (r) {
    case SMELT__PT_Y:
    case SMELT__PT_DY: return check_rows(name, t[r], ps->T, ps->dout, "[T, output_dim]");
    case SMELT__PT_DX: return check_rows(name, t[r], ps->T, ps->din, "[T, input_dim]");
    case SMELT__PT_IDS:
    case SMELT__PT_SCORES:
    case SMELT__PT_IDS_IN: return check_dense(name, t[r], 3, topk, "[T, num_heads, k]");
    case SMELT__PT_GRAD_IDS: return check_dense(name, t[r], 1, &nuse, "[T*num_heads*k]");
    default: break;
  }
  if (r >= SMELT__PT_GRAD_COUNT) { /* the sparse expert gradients (smelt/peer.h) */
    if (!t[SMELT__PT_GRAD_IDS])
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": grads.%s needs grads.grad_ids (which expert each row is)",
                          name);
    if (r == SMELT__PT_GRAD_COUNT) return check_shape(name, t[r], 1, &one, "[1]");
    return r == SMELT__PT_DU_ROWS
               ? check_dense(name, t[r], 3, rows[0], "[T*num_heads*k, input_dim, expert_hidden]")
               : check_dense(name, t[r], 3, rows[1], "[T*num_heads*k, expert_hidden, output_dim]");
  }
  /* a dense gradient, shaped like the planned tensor it differentiates */
  const int like = differentiates[r];
  const smelt_tensor *ref = &ps->t[like];
  if ((r == SMELT__PT_DU || r == SMELT__PT_DV) && ps->store)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": grads.du and grads.dv are not available with a store");
  if (ref->ndim < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": grads.%s is given but weights.%s is absent", name,
                        roles[like].name);
  smelt_status s = check_shape(name, t[r], ref->ndim, ref->shape, "the shape of its parameter");
  if (!s && like != SMELT__PT_WQ && like != SMELT__PT_BQ) s = check_contiguous(name, t[r]);
  return s;
}

/* ---------------------------------------------------------------- plans */

static void state_free(void *p) {
  smelt__peer_state *ps = (smelt__peer_state *)p;
  if (!ps) return;
  if (ps->cuda_free) ps->cuda_free(ps->cuda);
  free(ps);
}

smelt_status smelt_peer_plan(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                             const smelt_tensor *x, smelt_plan **out) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": out is NULL");
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": ctx is NULL");
  if (!cfg) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": cfg is NULL");
  smelt__peer_state *ps = (smelt__peer_state *)calloc(1, sizeof *ps);
  if (!ps) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  smelt_status s = resolve_config(cfg, ps);
  if (!s) s = check_weights(ctx, w, x, ps);
  if (s) {
    free(ps);
    return s;
  }
  char describe[160];
  snprintf(describe, sizeof describe, "peer N=%lld (p=%d) h=%lld k=%lld dq=%lld h_e=%lld (cpu reference)",
           (long long)ps->N, ps->p, (long long)ps->h, (long long)ps->k, (long long)ps->dq, (long long)ps->he);
  return smelt__family_plan_state(&smelt__family_peer, ctx, ps, state_free, describe, NULL, out);
}

/* ---------------------------------------------------------------- runs */

/* Checks run a->mode of plan (`op` names the entry point) with weights w
 * and x, and the run's own tensors already in a->t, then runs it: the
 * weights and x as planned, the run's required tensors present, each of
 * its own valid for its role and the config, outputs disjoint from
 * everything else. */
static smelt_status run(smelt_plan *plan, const char *op, const smelt_peer_weights *w, const smelt_tensor *x,
                        smelt__peer_args *a) {
  smelt_status s = smelt__check_plan(&smelt__family_peer, op, plan);
  if (s) return s;
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  if (!w) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights is NULL");
  if (!x) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": x is NULL");
  const smelt_tensor *planned[SMELT__PT_ROLES] = {NULL};
  weight_list(w, x, planned);
  if ((s = smelt__check_views(&smelt__family_peer, OP, ps->t, planned))) return s;
  if (w->store != ps->store)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": weights.store differs from the planned store");
  static const int required[3][2] = {[SMELT__PEER_RETRIEVE] = {SMELT__PT_IDS, SMELT__PT_SCORES},
                                     [SMELT__PEER_FORWARD] = {SMELT__PT_Y, -1},
                                     [SMELT__PEER_BACKWARD] = {SMELT__PT_IDS_IN, SMELT__PT_DY}};
  for (int i = 0; i < 2; i++) {
    const int r = required[a->mode][i];
    if (r >= 0 && !a->t[r]) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": %s is NULL", roles[r].name);
  }
  if (a->mode == SMELT__PEER_BACKWARD && !a->g) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": grads is NULL");
  for (int r = SMELT__PT_COUNT; r < SMELT__PT_ROLES; r++)
    if (a->t[r] && ((s = smelt__check_role(OP, &roles[r], a->t[r], plan->ctx)) || (s = check_own(ps, a->t, r)) ||
                    ((roles[r].flags & SMELT__ROLE_OUTPUT) && (s = smelt__check_output(OP, roles[r].name, a->t[r])))))
      return s;
  weight_list(w, x, a->t);
  if ((s = smelt__check_roles_disjoint(&smelt__family_peer, OP, a->t))) return s;
  a->w = w;
  return smelt__plan_dispatch(plan, a);
}

smelt_status smelt_peer_retrieve_run(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                     const smelt_tensor *ids, const smelt_tensor *scores) {
  smelt__peer_args a = {.mode = SMELT__PEER_RETRIEVE};
  a.t[SMELT__PT_IDS] = ids;
  a.t[SMELT__PT_SCORES] = scores;
  return run(plan, OP "_retrieve_run", w, x, &a);
}

smelt_status smelt_peer_forward_run(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                    const smelt_tensor *y, const smelt_tensor *ids, const smelt_tensor *scores) {
  smelt__peer_args a = {.mode = SMELT__PEER_FORWARD};
  a.t[SMELT__PT_Y] = y;
  a.t[SMELT__PT_IDS] = ids;
  a.t[SMELT__PT_SCORES] = scores;
  return run(plan, OP "_forward_run", w, x, &a);
}

smelt_status smelt_peer_backward_run(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                     const smelt_tensor *ids, const smelt_tensor *dy, const smelt_peer_grads *g) {
  smelt__peer_args a = {.mode = SMELT__PEER_BACKWARD, .g = g};
  a.t[SMELT__PT_IDS_IN] = ids;
  a.t[SMELT__PT_DY] = dy;
  if (g) {
    a.t[SMELT__PT_DX] = g->dx;
    a.t[SMELT__PT_DWQ] = g->dwq;
    a.t[SMELT__PT_DBQ] = g->dbq;
    a.t[SMELT__PT_DNORM_W] = g->dnorm_weight;
    a.t[SMELT__PT_DNORM_B] = g->dnorm_bias;
    for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) a.t[SMELT__PT_DKEY0 + i] = g->dsub_keys[i];
    a.t[SMELT__PT_DU] = g->du;
    a.t[SMELT__PT_DV] = g->dv;
    a.t[SMELT__PT_GRAD_IDS] = g->grad_ids;
    a.t[SMELT__PT_GRAD_COUNT] = g->grad_count;
    a.t[SMELT__PT_DU_ROWS] = g->du_rows;
    a.t[SMELT__PT_DV_ROWS] = g->dv_rows;
  }
  return run(plan, OP "_backward_run", w, x, &a);
}

smelt_status smelt_peer_retrieve(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                 const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *scores) {
  SMELT__ONE_SHOT(smelt_peer_plan(ctx, cfg, w, x, &plan), smelt_peer_retrieve_run(plan, w, x, ids, scores));
}

smelt_status smelt_peer_forward(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *ids,
                                const smelt_tensor *scores) {
  SMELT__ONE_SHOT(smelt_peer_plan(ctx, cfg, w, x, &plan), smelt_peer_forward_run(plan, w, x, y, ids, scores));
}

smelt_status smelt_peer_backward(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                 const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *dy,
                                 const smelt_peer_grads *grads) {
  SMELT__ONE_SHOT(smelt_peer_plan(ctx, cfg, w, x, &plan), smelt_peer_backward_run(plan, w, x, ids, dy, grads));
}
