/* smelt_peer_*: the configuration, validation of every tensor against it,
 * and plan/run/one-shot for retrieval, forward and backward.
 *
 * Everything static is checked when planning (config, weight layouts, x);
 * a run checks its tensors against the plan and its outputs against the
 * config before a backend sees anything, so a failed call writes nothing. */
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

static smelt_status check_dim(const char *field, int64_t v, int64_t lo) {
  if (v < lo || v >= DIM_MAX)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": cfg.%s=%lld must be in [%lld, 2^31)", field, (long long)v,
                        (long long)lo);
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
  if ((s = check_dim("input_dim", cfg->input_dim, 1)) || (s = check_dim("output_dim", cfg->output_dim, 1)) ||
      (s = check_dim("num_experts", cfg->num_experts, 1)) || (s = check_dim("num_heads", cfg->num_heads, 1)) ||
      (s = check_dim("expert_hidden_size", cfg->expert_hidden_size, 1)) ||
      (s = check_dim("query_dim", cfg->query_dim, 1)))
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
  memset(ps, 0, sizeof *ps);
  ps->cfg = *cfg;
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
  ps->din = cfg->input_dim;
  ps->dout = cfg->output_dim;
  ps->N = cfg->num_experts;
  ps->k = cfg->num_experts_per_tok;
  ps->h = cfg->num_heads;
  ps->he = cfg->expert_hidden_size;
  ps->dq = cfg->query_dim;
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
#define NFLOAT 4

static smelt_status check_one(const char *name, const smelt_tensor *t, const smelt_ctx *ctx) {
  smelt_status s;
  if ((s = smelt__check_tensor(OP, name, t)) || (s = smelt__check_device(OP, name, t, ctx)) ||
      (s = smelt__check_dtype(OP, name, t, float_types, NFLOAT)))
    return s;
  return SMELT_OK;
}

/* t has exactly the n dims given. */
static smelt_status check_shape(const char *name, const smelt_tensor *t, int n, const int64_t *dims,
                                const char *what) {
  int same = t->ndim == n;
  for (int d = 0; same && d < n; d++) same = t->shape[d] == dims[d];
  if (!same) {
    smelt_tensor want;
    memset(&want, 0, sizeof want);
    want.ndim = n;
    for (int d = 0; d < n; d++) want.shape[d] = dims[d];
    char a[160], b[160];
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": %s.shape=%s must be %s=%s", name,
                        smelt__shape_str(t, a, sizeof a), what, smelt__shape_str(&want, b, sizeof b));
  }
  return SMELT_OK;
}

static smelt_status check_contiguous(const char *name, const smelt_tensor *t) {
  if (!smelt_tensor_is_contiguous(t))
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, OP ": %s must be contiguous (row-major)", name);
  return SMELT_OK;
}

/* [rows, cols] rows with unit column stride. */
static smelt_status check_rows(const char *name, const smelt_tensor *t, int64_t rows, int64_t cols,
                               const char *what) {
  int64_t dims[2] = {rows, cols};
  smelt_status s = check_shape(name, t, 2, dims, what);
  if (s) return s;
  if (cols > 1 && t->strides[1] != 1)
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

static const char *const key_names[SMELT_PEER_MAX_DIMS] = {"sub_keys[0]", "sub_keys[1]", "sub_keys[2]", "sub_keys[3]"};
static const char *const dkey_names[SMELT_PEER_MAX_DIMS] = {"dsub_keys[0]", "dsub_keys[1]", "dsub_keys[2]",
                                                            "dsub_keys[3]"};

/* The weights' tensors in planned-array order (NULL = absent). */
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

static const char *tensor_name(int i) {
  static const char *const names[SMELT__PT_COUNT] = {
      [SMELT__PT_X] = "x",           [SMELT__PT_WQ] = "wq",         [SMELT__PT_BQ] = "bq",
      [SMELT__PT_NORM_W] = "norm_weight", [SMELT__PT_NORM_B] = "norm_bias", [SMELT__PT_BN_MEAN] = "bn_mean",
      [SMELT__PT_BN_VAR] = "bn_var", [SMELT__PT_KEY0] = "sub_keys[0]", [SMELT__PT_KEY0 + 1] = "sub_keys[1]",
      [SMELT__PT_KEY0 + 2] = "sub_keys[2]", [SMELT__PT_KEY0 + 3] = "sub_keys[3]", [SMELT__PT_U] = "u",
      [SMELT__PT_V] = "v"};
  return names[i];
}

/* Validates the weights and x against the resolved config; fills ps->t. */
static smelt_status check_weights(smelt_ctx *ctx, const smelt_peer_weights *w, const smelt_tensor *x,
                                  smelt__peer_state *ps) {
  if (!w) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights is NULL");
  if (!x) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": x is NULL");
  if (!w->wq) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights.wq is NULL");
  const smelt_tensor *list[SMELT__PT_COUNT];
  weight_list(w, x, list);
  smelt_status s;
  for (int i = 0; i < SMELT__PT_COUNT; i++)
    if (list[i] && (s = check_one(tensor_name(i), list[i], ctx))) return s;
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
      (w->bq && (s = check_shape("bq", w->bq, 1, &hd, "[num_heads * query_dim]"))))
    return s;
  const smelt_peer_norm norm = ps->cfg.query_norm;
  const int affine = norm == SMELT_PEER_NORM_LAYERNORM || norm == SMELT_PEER_NORM_BATCHNORM;
  const smelt_tensor *np[4] = {w->norm_weight, w->norm_bias, w->bn_mean, w->bn_var};
  static const char *const nn[4] = {"norm_weight", "norm_bias", "bn_mean", "bn_var"};
  int per_head = -1;
  smelt_dtype param_dt = SMELT_DTYPE_F32;
  for (int i = 0; i < 4; i++) {
    const int allowed = i < 2 ? affine : norm == SMELT_PEER_NORM_BATCHNORM;
    if (!np[i]) {
      if (i >= 2 && allowed)
        return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights.%s is NULL but query_norm is batchnorm", nn[i]);
      continue;
    }
    if (!allowed)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": weights.%s is given but cfg.query_norm does not use it",
                          nn[i]);
    int ph = 0;
    if ((s = check_norm_param(nn[i], np[i], ps, &ph))) return s;
    if (per_head >= 0 && ph != per_head)
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                          OP ": weights.%s is %s but an earlier norm parameter is %s; use one shape for all", nn[i],
                          ph ? "[num_heads, query_dim]" : "[query_dim]", per_head ? "[num_heads, query_dim]" : "[query_dim]");
    if (per_head >= 0 && np[i]->dtype != param_dt)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH,
                          OP ": weights.%s.dtype=%s differs from an earlier norm parameter's %s; use one dtype for all",
                          nn[i], smelt_dtype_name(np[i]->dtype), smelt_dtype_name(param_dt));
    per_head = ph;
    param_dt = np[i]->dtype;
  }
  ps->norm_per_head = per_head == 1;
  smelt_dtype key_dt = SMELT_DTYPE_COUNT;
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) {
    const smelt_tensor *c = w->sub_keys[i];
    if (i >= ps->p) {
      if (c)
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": weights.%s is given but product_key_dims=%d",
                            key_names[i], ps->p);
      continue;
    }
    if (!c) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights.%s is NULL", key_names[i]);
    int64_t dims[3] = {ps->h, ps->n[i], ps->dsub};
    if ((s = ps->cfg.per_head_keys
                 ? check_shape(key_names[i], c, 3, dims, "[num_heads, n_i, query_dim / product_key_dims]")
                 : check_shape(key_names[i], c, 2, dims + 1, "[n_i, query_dim / product_key_dims]")) ||
        (s = check_contiguous(key_names[i], c)))
      return s;
    if (i > 0 && c->dtype != key_dt)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": weights.%s.dtype=%s must equal sub_keys[0].dtype=%s",
                          key_names[i], smelt_dtype_name(c->dtype), smelt_dtype_name(key_dt));
    key_dt = c->dtype;
  }
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
    if ((s = check_shape("u", w->u, 3, ud, "[num_experts, input_dim, expert_hidden_size]")) ||
        (s = check_shape("v", w->v, 3, vd, "[num_experts, expert_hidden_size, output_dim]")) ||
        (s = check_contiguous("u", w->u)) || (s = check_contiguous("v", w->v)))
      return s;
    if (w->u->dtype != w->v->dtype)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": v.dtype=%s must equal u.dtype=%s",
                          smelt_dtype_name(w->v->dtype), smelt_dtype_name(w->u->dtype));
  } else {
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
  }
  for (int i = 0; i < SMELT__PT_COUNT; i++) {
    if (list[i]) ps->t[i] = *list[i];
    else ps->t[i].ndim = -1;
  }
  ps->store = w->store;
  return SMELT_OK;
}

/* The run's weights and x against the plan's. */
static smelt_status check_planned(const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x) {
  if (!w) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": weights is NULL");
  if (!x) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": x is NULL");
  const smelt_tensor *list[SMELT__PT_COUNT];
  weight_list(w, x, list);
  smelt_status s;
  for (int i = 0; i < SMELT__PT_COUNT; i++) {
    const int planned = ps->t[i].ndim >= 0;
    if (!list[i] && planned)
      return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": %s is NULL but the plan was made with it", tensor_name(i));
    if (list[i] && !planned)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": %s is given but the plan was made without it",
                          tensor_name(i));
    if (list[i] && (s = smelt__check_same_layout(OP, tensor_name(i), &ps->t[i], list[i]))) return s;
  }
  if (w->store != ps->store)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": weights.store differs from the planned store");
  return SMELT_OK;
}

/* Outputs must not overlap each other or any input. */
static smelt_status check_disjoint(const char *const *onames, const smelt_tensor *const *outs, int nout,
                                   const char *const *inames, const smelt_tensor *const *ins, int nin) {
  for (int i = 0; i < nout; i++) {
    if (!outs[i]) continue;
    for (int j = 0; j < nin; j++)
      if (ins[j] && smelt__tensors_overlap(outs[i], ins[j]))
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": %s overlaps %s; outputs must not share memory with inputs",
                            onames[i], inames[j]);
    for (int j = 0; j < i; j++)
      if (outs[j] && smelt__tensors_overlap(outs[i], outs[j]))
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": %s overlaps %s; outputs must not share memory", onames[i],
                            onames[j]);
  }
  return SMELT_OK;
}

static smelt_status check_out_common(const smelt_plan *plan, const char *name, const smelt_tensor *t) {
  smelt_status s;
  if ((s = smelt__check_tensor(OP, name, t)) || (s = smelt__check_device(OP, name, t, plan->ctx))) return s;
  return SMELT_OK;
}

/* ids / scores [T, h, k]: i64 / f32, contiguous. */
static smelt_status check_topk_tensor(const smelt_plan *plan, const char *name, const smelt_tensor *t, smelt_dtype dt,
                                      int output) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  smelt_status s;
  if ((s = check_out_common(plan, name, t)) || (s = smelt__check_dtype(OP, name, t, &dt, 1))) return s;
  int64_t dims[3] = {ps->T, ps->h, ps->k};
  if ((s = check_shape(name, t, 3, dims, "[T, num_heads, k]")) || (s = check_contiguous(name, t)) ||
      (output && (s = smelt__check_output(OP, name, t))))
    return s;
  return SMELT_OK;
}

static const smelt_dtype i64_type = SMELT_DTYPE_I64, f32_type = SMELT_DTYPE_F32;

/* ---------------------------------------------------------------- plans */

static void state_free(void *p) {
  smelt__peer_state *ps = (smelt__peer_state *)p;
  if (!ps) return;
  if (ps->cuda_free) ps->cuda_free(ps->cuda);
  free(ps);
}

static smelt_status check_plan(const char *op, const smelt_plan *plan) {
  if (!plan) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: plan is NULL", op);
  if (plan->op != SMELT__OP_PEER)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: the plan is not a PEER plan", op);
  return SMELT_OK;
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
  smelt_plan *plan;
  if ((s = smelt__plan_new(ctx, SMELT__OP_PEER, &plan))) {
    free(ps);
    return s;
  }
  plan->opdata = ps;
  plan->opdata_free = state_free;
  snprintf(plan->describe, sizeof plan->describe, "peer N=%lld (p=%d) h=%lld k=%lld dq=%lld h_e=%lld (cpu reference)",
           (long long)ps->N, ps->p, (long long)ps->h, (long long)ps->k, (long long)ps->dq, (long long)ps->he);
  if (ctx->device == SMELT_DEVICE_CUDA && (s = smelt__cuda_peer_plan(plan))) {
    smelt_plan_destroy(plan);
    return s;
  }
  *out = plan;
  return SMELT_OK;
}

/* The inputs a run reads, for the overlap checks. */
#define NIN (SMELT__PT_COUNT + 2)
static void input_list(const smelt_peer_weights *w, const smelt_tensor *x, const smelt_tensor *ids,
                       const smelt_tensor *dy, const smelt_tensor **ins, const char **names) {
  weight_list(w, x, ins);
  for (int i = 0; i < SMELT__PT_COUNT; i++) names[i] = tensor_name(i);
  ins[SMELT__PT_COUNT] = ids;
  names[SMELT__PT_COUNT] = "ids";
  ins[SMELT__PT_COUNT + 1] = dy;
  names[SMELT__PT_COUNT + 1] = "dy";
}

smelt_status smelt_peer_retrieve_run(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                     const smelt_tensor *ids, const smelt_tensor *scores) {
  smelt_status s = check_plan(OP "_retrieve_run", plan);
  if (s) return s;
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  if ((s = check_planned(ps, w, x))) return s;
  if (!ids || !scores)
    return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": %s is NULL", !ids ? "ids" : "scores");
  if ((s = check_topk_tensor(plan, "ids", ids, i64_type, 1)) ||
      (s = check_topk_tensor(plan, "scores", scores, f32_type, 1)))
    return s;
  const smelt_tensor *ins[NIN], *outs[2] = {ids, scores};
  const char *inames[NIN], *onames[2] = {"ids", "scores"};
  input_list(w, x, NULL, NULL, ins, inames);
  if ((s = check_disjoint(onames, outs, 2, inames, ins, NIN))) return s;
  if (plan->ctx->device == SMELT_DEVICE_CUDA) return smelt__cuda_peer_retrieve(plan, w, x, ids, scores);
  return smelt__cpu_peer_retrieve(ps, w, x, ids, scores);
}

smelt_status smelt_peer_forward_run(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                    const smelt_tensor *y, const smelt_tensor *ids, const smelt_tensor *scores) {
  smelt_status s = check_plan(OP "_forward_run", plan);
  if (s) return s;
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  if ((s = check_planned(ps, w, x))) return s;
  if (!y) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": y is NULL");
  if ((s = check_out_common(plan, "y", y)) || (s = smelt__check_dtype(OP, "y", y, float_types, NFLOAT)) ||
      (s = check_rows("y", y, ps->T, ps->dout, "[T, output_dim]")) || (s = smelt__check_output(OP, "y", y)) ||
      (ids && (s = check_topk_tensor(plan, "ids", ids, i64_type, 1))) ||
      (scores && (s = check_topk_tensor(plan, "scores", scores, f32_type, 1))))
    return s;
  const smelt_tensor *ins[NIN], *outs[3] = {y, ids, scores};
  const char *inames[NIN], *onames[3] = {"y", "ids", "scores"};
  input_list(w, x, NULL, NULL, ins, inames);
  if ((s = check_disjoint(onames, outs, 3, inames, ins, NIN))) return s;
  if (plan->ctx->device == SMELT_DEVICE_CUDA) return smelt__cuda_peer_forward(plan, w, x, y, ids, scores);
  return smelt__cpu_peer_forward(ps, w, x, y, ids, scores);
}

/* A gradient output shaped like the planned tensor it differentiates. */
static smelt_status check_grad(const smelt_plan *plan, const char *name, const smelt_tensor *g, int like,
                               const char *like_name) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const smelt_tensor *ref = &ps->t[like];
  if (ref->ndim < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": grads.%s is given but weights.%s is absent", name,
                        like_name);
  smelt_status s;
  if ((s = check_out_common(plan, name, g)) || (s = smelt__check_dtype(OP, name, g, float_types, NFLOAT)) ||
      (s = check_shape(name, g, ref->ndim, ref->shape, "the shape of its parameter")) ||
      (s = smelt__check_output(OP, name, g)))
    return s;
  if (like != SMELT__PT_WQ && like != SMELT__PT_BQ && (s = check_contiguous(name, g))) return s;
  return SMELT_OK;
}

/* The sparse expert gradients (smelt/peer.h): [T·h·k] ids and count in
 * i64, rows [T·h·k, ...] in a float dtype, all contiguous outputs. */
static smelt_status check_sparse_grads(const smelt_plan *plan, const smelt_peer_grads *g) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const int64_t nuse = ps->T * ps->h * ps->k;
  smelt_status s;
  if ((g->du_rows || g->dv_rows || g->grad_count) && !g->grad_ids)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": grads.%s needs grads.grad_ids (which expert each row is)",
                        g->du_rows ? "du_rows" : g->dv_rows ? "dv_rows" : "grad_count");
  if (g->grad_ids) {
    int64_t dims[1] = {nuse};
    if ((s = check_out_common(plan, "grad_ids", g->grad_ids)) ||
        (s = smelt__check_dtype(OP, "grad_ids", g->grad_ids, &i64_type, 1)) ||
        (s = check_shape("grad_ids", g->grad_ids, 1, dims, "[T*num_heads*k]")) ||
        (s = check_contiguous("grad_ids", g->grad_ids)) || (s = smelt__check_output(OP, "grad_ids", g->grad_ids)))
      return s;
  }
  if (g->grad_count) {
    int64_t dims[1] = {1};
    if ((s = check_out_common(plan, "grad_count", g->grad_count)) ||
        (s = smelt__check_dtype(OP, "grad_count", g->grad_count, &i64_type, 1)) ||
        (s = check_shape("grad_count", g->grad_count, 1, dims, "[1]")) ||
        (s = smelt__check_output(OP, "grad_count", g->grad_count)))
      return s;
  }
  const smelt_tensor *rows[2] = {g->du_rows, g->dv_rows};
  const char *names[2] = {"du_rows", "dv_rows"};
  const int64_t shapes[2][3] = {{nuse, ps->din, ps->he}, {nuse, ps->he, ps->dout}};
  const char *what[2] = {"[T*num_heads*k, input_dim, expert_hidden]", "[T*num_heads*k, expert_hidden, output_dim]"};
  for (int i = 0; i < 2; i++)
    if (rows[i] && ((s = check_out_common(plan, names[i], rows[i])) ||
                    (s = smelt__check_dtype(OP, names[i], rows[i], float_types, NFLOAT)) ||
                    (s = check_shape(names[i], rows[i], 3, shapes[i], what[i])) ||
                    (s = check_contiguous(names[i], rows[i])) || (s = smelt__check_output(OP, names[i], rows[i]))))
      return s;
  return SMELT_OK;
}

smelt_status smelt_peer_backward_run(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                     const smelt_tensor *ids, const smelt_tensor *dy, const smelt_peer_grads *g) {
  smelt_status s = check_plan(OP "_backward_run", plan);
  if (s) return s;
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  if ((s = check_planned(ps, w, x))) return s;
  if (!ids || !dy || !g)
    return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": %s is NULL", !ids ? "ids" : !dy ? "dy" : "grads");
  if ((s = check_topk_tensor(plan, "ids", ids, i64_type, 0)) || (s = check_out_common(plan, "dy", dy)) ||
      (s = smelt__check_dtype(OP, "dy", dy, float_types, NFLOAT)) ||
      (s = check_rows("dy", dy, ps->T, ps->dout, "[T, output_dim]")))
    return s;
  if (g->dx && ((s = check_out_common(plan, "dx", g->dx)) ||
                (s = smelt__check_dtype(OP, "dx", g->dx, float_types, NFLOAT)) ||
                (s = check_rows("dx", g->dx, ps->T, ps->din, "[T, input_dim]")) ||
                (s = smelt__check_output(OP, "dx", g->dx))))
    return s;
  if ((g->dwq && (s = check_grad(plan, "dwq", g->dwq, SMELT__PT_WQ, "wq"))) ||
      (g->dbq && (s = check_grad(plan, "dbq", g->dbq, SMELT__PT_BQ, "bq"))) ||
      (g->dnorm_weight && (s = check_grad(plan, "dnorm_weight", g->dnorm_weight, SMELT__PT_NORM_W, "norm_weight"))) ||
      (g->dnorm_bias && (s = check_grad(plan, "dnorm_bias", g->dnorm_bias, SMELT__PT_NORM_B, "norm_bias"))))
    return s;
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++)
    if (g->dsub_keys[i] && (s = check_grad(plan, dkey_names[i], g->dsub_keys[i], SMELT__PT_KEY0 + i, key_names[i])))
      return s;
  if ((g->du || g->dv) && ps->store)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": grads.du and grads.dv are not available with a store");
  if ((g->du && (s = check_grad(plan, "du", g->du, SMELT__PT_U, "u"))) ||
      (g->dv && (s = check_grad(plan, "dv", g->dv, SMELT__PT_V, "v"))))
    return s;
  if ((s = check_sparse_grads(plan, g))) return s;
  const smelt_tensor *outs[11 + SMELT_PEER_MAX_DIMS] = {g->dx, g->dwq, g->dbq, g->dnorm_weight, g->dnorm_bias, g->du,
                                                         g->dv, g->grad_ids, g->grad_count, g->du_rows, g->dv_rows};
  const char *onames[11 + SMELT_PEER_MAX_DIMS] = {"dx", "dwq", "dbq", "dnorm_weight", "dnorm_bias", "du", "dv",
                                                  "grad_ids", "grad_count", "du_rows", "dv_rows"};
  int nout = 11;
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++, nout++) {
    outs[nout] = g->dsub_keys[i];
    onames[nout] = dkey_names[i];
  }
  const smelt_tensor *ins[NIN];
  const char *inames[NIN];
  input_list(w, x, ids, dy, ins, inames);
  if ((s = check_disjoint(onames, outs, nout, inames, ins, NIN))) return s;
  if (plan->ctx->device == SMELT_DEVICE_CUDA) return smelt__cuda_peer_backward(plan, w, x, ids, dy, g);
  return smelt__cpu_peer_backward(ps, w, x, ids, dy, g);
}

/* The one-shot calls: plan, one run, destroy. mode: 0 retrieve, 1
 * forward, 2 backward (the run's own tensors, NULL where it has none). */
static smelt_status one_shot(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                             const smelt_tensor *x, int mode, const smelt_tensor *y, const smelt_tensor *ids,
                             const smelt_tensor *scores, const smelt_tensor *dy, const smelt_peer_grads *grads) {
  smelt_plan *plan;
  smelt_status s = smelt_peer_plan(ctx, cfg, w, x, &plan);
  if (s) return s;
  s = mode == 0   ? smelt_peer_retrieve_run(plan, w, x, ids, scores)
      : mode == 1 ? smelt_peer_forward_run(plan, w, x, y, ids, scores)
                  : smelt_peer_backward_run(plan, w, x, ids, dy, grads);
  smelt_plan_destroy(plan);
  return s;
}

smelt_status smelt_peer_retrieve(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                 const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *scores) {
  return one_shot(ctx, cfg, w, x, 0, NULL, ids, scores, NULL, NULL);
}

smelt_status smelt_peer_forward(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                const smelt_tensor *x, const smelt_tensor *y, const smelt_tensor *ids,
                                const smelt_tensor *scores) {
  return one_shot(ctx, cfg, w, x, 1, y, ids, scores, NULL, NULL);
}

smelt_status smelt_peer_backward(smelt_ctx *ctx, const smelt_peer_config *cfg, const smelt_peer_weights *w,
                                 const smelt_tensor *x, const smelt_tensor *ids, const smelt_tensor *dy,
                                 const smelt_peer_grads *grads) {
  return one_shot(ctx, cfg, w, x, 2, NULL, ids, NULL, dy, grads);
}
