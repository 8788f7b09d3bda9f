/* The MoE layer from Python: one entry point, _smelt.moe(mode, cfg, x,
 * weights, extra, outs, ctx, stream), for the forward (mode 0), the
 * backward (mode 1), the saved forward (mode 2) and the saved backward
 * (mode 3); and _smelt.moe_saved_bytes(cfg, T, dtype, cuda), the saved
 * state's size. smelt/__init__.py resolves names and sizes into cfg, so
 * this layer only converts.
 *
 *   cfg      (num_experts, top_k, d_model, ffn_dim, score, renormalize,
 *            scaling_factor, num_groups, topk_groups, noise_seed,
 *            noise_token_offset, capacity_factor, drop_policy,
 *            aux_loss_coeff, z_loss_coeff, ffn, activation): the
 *            smelt_moe_config fields in order, enums as their values
 *   weights  (wr, expert_bias, wnoise, w1, w3, w2, b1), None where absent
 *   extra    (); the backward (dy,); the saved backward (dy, saved)
 *   outs     forward (y, logits, ids, weights, counts, offsets, dropped,
 *            aux); backward (dx, dwr, dwnoise, dw1, dw3, dw2, db1). Each
 *            None (not computed), True (allocated here: y and dx like x,
 *            logits [T, E] f32, ids [T, k] i32, weights [T, k] f32, counts
 *            [E] and offsets [E+1] i64, dropped [1] i64, aux [2] f32, a
 *            weight gradient like its weight) or a tensor to write. The
 *            forward's routing outputs come all five (logits to offsets)
 *            or none. The saved forward's outs are the forward's (logits,
 *            ids, weights and offsets None) then saved (True: u8 of
 *            smelt_moe_saved_bytes_for); the saved backward's, the
 *            backward's.
 * Returns outs with the allocated tensors in place of True.
 *
 * Plans are made per call (plan, run, destroy), as PEER's: the layer's
 * GEMMs dwarf planning, whose kernels come from the in-memory module
 * table after the first call. */
#include "smelt_py.h"
#include "smelt/moe.h"

enum { W_WR, W_BIAS, W_WNOISE, W_W1, W_W3, W_W2, W_B1, W_COUNT };
enum { O_Y, O_LOGITS, O_IDS, O_WEIGHTS, O_COUNTS, O_OFFSETS, O_DROPPED, O_AUX, O_FWD, O_SAVED = O_FWD, O_ALL };
enum { G_DX, G_DWR, G_DWNOISE, G_DW1, G_DW3, G_DW2, G_DB1, G_COUNT };

static const char *const w_names[W_COUNT] = {"wr", "expert_bias", "wnoise", "w1", "w3", "w2", "b1"};
static const char *const o_names[O_ALL] = {"out",     "logits",  "ids", "weights", "counts",
                                           "offsets", "dropped", "aux", "saved"};
static const char *const g_names[G_COUNT] = {"dx", "dwr", "dwnoise", "dw1", "dw3", "dw2", "db1"};
/* The weight each gradient differentiates (-1: dx, like x). */
static const int g_like[G_COUNT] = {-1, W_WR, W_WNOISE, W_W1, W_W3, W_W2, W_B1};

static int parse_cfg(PyObject *t, smelt_moe_config *c) {
  *c = smelt_moe_config_default();
  long long E, k, d, F, groups, tg, token0;
  unsigned long long seed;
  int score, renorm, drop, ffn, act;
  double scaling, cap, aux, z;
  if (!PyArg_ParseTuple(t, "LLLLipdLLKLdiddii:moe cfg", &E, &k, &d, &F, &score, &renorm, &scaling, &groups, &tg,
                        &seed, &token0, &cap, &drop, &aux, &z, &ffn, &act))
    return -1;
  c->num_experts = E, c->top_k = k, c->d_model = d, c->ffn_dim = F;
  c->score = (smelt_moe_score)score, c->renormalize = renorm, c->scaling_factor = scaling;
  c->num_groups = groups, c->topk_groups = tg, c->noise_seed = seed, c->noise_token_offset = token0;
  c->capacity_factor = cap, c->drop_policy = (smelt_moe_drop)drop;
  c->aux_loss_coeff = aux, c->z_loss_coeff = z, c->ffn = (smelt_moe_ffn)ffn, c->activation = (smelt_act)act;
  return 0;
}

/* The saved state's size for x on the context's device; -1 with an error set. */
static int saved_bytes(const smelt_moe_config *cfg, const smelt_tensor *x, smelt_device_kind dev, int64_t *bytes) {
  smelt_status s = smelt_moe_saved_bytes_for(cfg, x->ndim >= 1 ? x->shape[0] : 0, x->dtype, dev, bytes);
  if (s) smpy_raise_status(s);
  return s ? -1 : 0;
}

/* The forward's outputs' dtypes and shapes. */
static void fwd_out(int i, const smelt_tensor *x, const smelt_moe_config *c, smelt_dtype *dt, int *nd,
                    int64_t *shape) {
  const int64_t T = x->ndim >= 1 ? x->shape[0] : 0;
  static const smelt_dtype dts[O_FWD] = {SMELT_DTYPE_F32, SMELT_DTYPE_F32, SMELT_DTYPE_I32, SMELT_DTYPE_F32,
                                         SMELT_DTYPE_I64, SMELT_DTYPE_I64, SMELT_DTYPE_I64, SMELT_DTYPE_F32};
  const int64_t rows[O_FWD] = {T, T, T, T, c->num_experts, c->num_experts + 1, 1, 2};
  const int64_t cols[O_FWD] = {c->d_model, c->num_experts, c->top_k, c->top_k, 0, 0, 0, 0};
  *dt = i == O_Y ? x->dtype : dts[i];
  /* f64 inputs (the CPU backend) route in f64, as the layer does when the
   * routing is not asked for: asking must not change y. */
  if (dts[i] == SMELT_DTYPE_F32 && x->dtype == SMELT_DTYPE_F64) *dt = SMELT_DTYPE_F64;
  *nd = cols[i] ? 2 : 1;
  shape[0] = rows[i];
  shape[1] = cols[i];
}

/* The plan cache's op id: past ops.c's enum and bem.c's. */
enum { KEY_OP_MOE = 1100 };

/* The plan's key: the config (E and d are wr's and x's shapes, which the
 * plan must match) and the layouts of x and every weight. */
static void plan_key(smpy_ctx *c, const smelt_moe_config *cfg, const smelt_moe_weights *w, const smelt_tensor *x,
                     smpy_pkey *key) {
  memset(key, 0, sizeof *key);
  key->op = KEY_OP_MOE;
  key->deterministic = c->deterministic;
  key->k = cfg->ffn_dim;
  key->f[0] = cfg->scaling_factor;
  key->f[1] = cfg->capacity_factor;
  key->f[2] = cfg->aux_loss_coeff;
  key->f[3] = cfg->z_loss_coeff;
  key->i[0] = cfg->top_k;
  key->i[1] = cfg->num_groups;
  key->i[2] = cfg->topk_groups;
  key->i[3] = (int64_t)cfg->noise_seed;
  key->i[4] = cfg->noise_token_offset;
  /* the enums and the flag, each well under 256 */
  key->i[5] = (int64_t)cfg->score | (int64_t)(cfg->renormalize != 0) << 8 | (int64_t)cfg->drop_policy << 16 |
              (int64_t)cfg->ffn << 24 | (int64_t)cfg->activation << 32;
  const smelt_tensor *t[1 + W_COUNT] = {x, w->wr, w->expert_bias, w->wnoise, w->w1, w->w3, w->w2, w->b1};
  key->ntensors = 1 + W_COUNT;
  for (int i = 0; i < key->ntensors; i++) {
    if (t[i]) smpy_tkey_fill(&key->t[i], t[i]);
    else key->t[i].ndim = -1;
  }
}

/* What a cached MoE call binds: the mode (0 forward, 1 backward, 2 saved
 * forward, 3 saved backward), the config and the call's tensors. */
typedef struct moe_call {
  int mode;
  const smelt_moe_config *cfg;
  const smelt_moe_weights *w;
  const smelt_tensor *x, *dy, *saved;
  smelt_tensor *const *o;
} moe_call;

static smelt_status moe_plan(smelt_ctx *ctx, const void *arg, smelt_plan **plan) {
  const moe_call *m = (const moe_call *)arg;
  return smelt_moe_plan(ctx, m->cfg, m->w, m->x, plan);
}

static smelt_status moe_run(smelt_plan *plan, const void *arg) {
  const moe_call *m = (const moe_call *)arg;
  smelt_tensor *const *o = m->o;
  const smelt_moe_routing r = {o[O_LOGITS], o[O_IDS], o[O_WEIGHTS], o[O_COUNTS], o[O_OFFSETS], o[O_DROPPED], o[O_AUX]};
  const smelt_moe_grads g = {.dx = o[G_DX], .dwr = o[G_DWR], .dwnoise = o[G_DWNOISE], .dw1 = o[G_DW1],
                             .dw3 = o[G_DW3], .dw2 = o[G_DW2], .db1 = o[G_DB1]};
  switch (m->mode) {
    case 0: return smelt_moe_forward_run(plan, m->w, m->x, o[O_Y], o[O_LOGITS] ? &r : NULL, NULL);
    case 1: return smelt_moe_backward_run(plan, m->w, m->x, m->dy, &g);
    case 2: return smelt_moe_forward_save_run(plan, m->w, m->x, o[O_Y], o[O_SAVED], &r);
    default: return smelt_moe_backward_saved_run(plan, m->w, m->x, m->dy, m->saved, &g);
  }
}

/* Runs mode on the context's cached plan for these layouts (planned on a miss). */
static smelt_status run(smpy_call *call, int mode, const smelt_moe_config *cfg, const smelt_moe_weights *w,
                        const smelt_tensor *x, smelt_tensor *const *o, const smelt_tensor *dy,
                        const smelt_tensor *saved) {
  smpy_pkey key;
  plan_key(call->ctx, cfg, w, x, &key);
  const moe_call m = {mode, cfg, w, x, dy, saved, o};
  return smpy_cached_run(call, &key, moe_plan, moe_run, &m);
}

static PyObject *py_moe(PyObject *self, PyObject *args) {
  int mode;
  PyObject *cfg_t, *xo, *wt, *extra, *outs, *ctx, *stream;
  if (!PyArg_ParseTuple(args, "iOOOOOOO:moe", &mode, &cfg_t, &xo, &wt, &extra, &outs, &ctx, &stream)) return NULL;
  if (mode < 0 || mode > 3) {
    PyErr_Format(PyExc_ValueError, "_smelt.moe: mode=%d is not 0 to 3", mode);
    return NULL;
  }
  const int bwd = mode & 1, nextra = mode == 3 ? 2 : bwd;
  const Py_ssize_t nouts = bwd ? G_COUNT : mode == 2 ? O_ALL : O_FWD;
  smelt_moe_config cfg;
  if (parse_cfg(cfg_t, &cfg) < 0) return NULL;
  if (!PyTuple_Check(wt) || PyTuple_Size(wt) != W_COUNT || !PyTuple_Check(extra) ||
      PyTuple_Size(extra) != nextra || !PyTuple_Check(outs) || PyTuple_Size(outs) != nouts) {
    PyErr_Format(PyExc_TypeError, "_smelt.moe: weights, extra and outs must be tuples of %d, %d and %zd", W_COUNT,
                 nextra, nouts);
    return NULL;
  }
  const char *op = bwd ? "smelt.moe_backward" : "smelt.moe";
  smpy_call call;
  PyObject *slots[O_ALL] = {NULL}, *result = NULL;
  smelt_tensor *x, *wts[W_COUNT] = {NULL}, *o[O_ALL] = {NULL}, *dy = NULL, *saved = NULL;
  if (smpy_call_begin(&call, op, ctx, stream) < 0) return NULL;
  if (smpy_call_import(&call, xo, "x", 0, &x) < 0) goto done;
  for (int i = 0; i < W_COUNT; i++) {
    PyObject *t = PyTuple_GetItem(wt, i);
    if (t != Py_None && smpy_call_import(&call, t, w_names[i], 0, &wts[i]) < 0) goto done;
  }
  if (bwd && smpy_call_import(&call, PyTuple_GetItem(extra, 0), "dy", 0, &dy) < 0) goto done;
  if (mode == 3 && smpy_call_import(&call, PyTuple_GetItem(extra, 1), "saved", 0, &saved) < 0) goto done;
  for (int i = 0; i < nouts; i++) {
    PyObject *given = PyTuple_GetItem(outs, i);
    smelt_dtype dt;
    int nd;
    int64_t shape[3];
    const char *name = bwd ? g_names[i] : o_names[i];
    if (!bwd && i == O_SAVED) {
      if (saved_bytes(&cfg, x, smelt_ctx_device(call.ctx->ctx), &shape[0]) < 0) goto done;
      dt = SMELT_DTYPE_U8, nd = 1;
    } else if (!bwd) {
      fwd_out(i, x, &cfg, &dt, &nd, shape);
    } else {
      const smelt_tensor *like = i == G_DX ? x : wts[g_like[i]];
      if (given == Py_True && !like) {
        smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "%s: %s is asked for but %s is absent", op, name,
                   w_names[g_like[i]]);
        goto done;
      }
      dt = like ? like->dtype : SMELT_DTYPE_F32;
      nd = like ? like->ndim : 0;
      for (int j = 0; j < nd && j < 3; j++) shape[j] = like->shape[j];
    }
    if (smpy_out_arg(&call, given, name, dt, nd, shape, &slots[i], &o[i]) < 0) goto done;
  }
  const smelt_moe_weights w = {.wr = wts[W_WR], .expert_bias = wts[W_BIAS], .wnoise = wts[W_WNOISE],
                               .w1 = wts[W_W1], .w3 = wts[W_W3], .w2 = wts[W_W2], .b1 = wts[W_B1]};
  smelt_status s = run(&call, mode, &cfg, &w, x, o, dy, saved);
  if (s) {
    smpy_raise_status(s);
    goto done;
  }
  result = PyTuple_New(nouts);
  for (int i = 0; result && i < nouts; i++) {
    PyTuple_SetItem(result, i, slots[i]); /* steals */
    slots[i] = NULL;
  }
done:
  smpy_call_end(&call);
  for (int i = 0; i < O_ALL; i++) Py_XDECREF(slots[i]);
  return result;
}

static PyObject *py_moe_saved_bytes(PyObject *self, PyObject *args) {
  PyObject *cfg_t;
  long long T;
  const char *dtname;
  int cuda;
  if (!PyArg_ParseTuple(args, "OLsp:moe_saved_bytes", &cfg_t, &T, &dtname, &cuda)) return NULL;
  smelt_moe_config cfg;
  smelt_dtype dt;
  if (parse_cfg(cfg_t, &cfg) < 0) return NULL;
  smelt_status s = smelt_dtype_from_name(dtname, &dt);
  int64_t bytes = 0;
  if (!s) s = smelt_moe_saved_bytes_for(&cfg, T, dt, cuda ? SMELT_DEVICE_CUDA : SMELT_DEVICE_CPU, &bytes);
  if (s) {
    smpy_raise_status(s);
    return NULL;
  }
  return PyLong_FromLongLong(bytes);
}

PyMethodDef smpy_moe_methods[] = {
    {"moe", py_moe, METH_VARARGS,
     "moe(mode, cfg, x, weights, extra, outs, ctx, stream) -> outs (0 forward, 1 backward, 2 saved forward, "
     "3 saved backward)"},
    {"moe_saved_bytes", py_moe_saved_bytes, METH_VARARGS,
     "moe_saved_bytes(cfg, T, dtype, cuda) -> the saved state's bytes (smelt_moe_saved_bytes_for)"},
    {NULL, NULL, 0, NULL}};
