/* The ops as the C layer exposes them: positional arguments, explicit outputs
 * (None = allocate through the input's framework, else a smelt.Tensor), the
 * context and the stream. smelt/__init__.py wraps them with keywords and
 * docstrings; these are the fast path it calls.
 *
 * Each call: import x (which picks the context and the launch stream), make
 * or import the outputs, find or make the plan, run it on the launch stream,
 * release the DLPack imports. */
#include "smelt_py.h"
#include "smelt/attention.h"
#include "smelt/attention_decode.h"
#include "smelt/conv2d.h"
#include "smelt/gemm.h"
#include "smelt/quant.h"
#include "smelt/qgemm.h"

#include <limits.h>
#include <string.h>

static PyObject *act_names; /* dict: name -> smelt_act */
static PyObject *act_tuple; /* the names, in enum order */

enum {
  OP_ACTIVATION = 1,
  OP_SOFTMAX,
  OP_TOPK,
  OP_GEMM,
  OP_GEMM_OFFS,
  OP_ATTN_FWD,
  OP_ATTN_VARLEN_FWD,
  OP_ATTN_BWD,
  OP_ATTN_VARLEN_BWD,
  OP_CONV2D,
  OP_ATTN_DECODE,
  OP_KV_APPEND,
  OP_NORM,
  OP_NORM_BWD,
  OP_RESIDUAL_ADD,
  OP_ROTARY,
  OP_QGEMM
};

typedef struct op_args {
  int op;
  int nt; /* tensors in t (0 = 3, the small ops) */
  smelt_activation_desc desc;
  int64_t k;
  smelt_gemm_desc gemm;
  smelt_attention_desc attn;
  smelt_conv2d_desc conv;
  smelt_norm_desc norm;
  smelt_rotary_desc rot;
  smelt_qgemm_desc qgemm;
  smelt_quant_format format;
  /* Op-specific order; NULL = absent.
   *   gemm:           a, b, c, d, bias, -, scale_a, scale_b
   *   gemm by offsets: a, b, c, d, bias, offs, scale_a, scale_b
   *   conv2d:         a, b, c, d, bias (A and B as the kind takes them: smelt/conv2d.h)
   *   attention fwd:  q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k
   *   attention bwd:  q, k, v, o, d_o, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k
   *   attention decode: q, k_cache, v_cache, block_table, cache_seqlens, o, lse (attn: scale, causal)
   *   kv cache append:  k_new, v_new, block_table, cache_seqlens, k_cache, v_cache
   *   norm:           x, residual, weight, bias, y, h_out, mean, rstd
   *   norm backward:  dy, x, weight, mean, rstd, dh, dx, dweight, dbias
   *   residual add:   x, residual, y
   *   rotary:         x, cos, sin, positions, y
   *   qgemm:          x, w.q, w.scale, w.tensor_scale, bias, d (format, qgemm)
   * (attention's modifier tensors are in attn: alibi_slopes, sinks, dsinks) */
  const smelt_tensor *t[SMPY_KEY_TENSORS];
} op_args;

/* The GEMM's row and column scales (slots 6 and 7; NULL when neither). */
static const smelt_gemm_scales *gemm_scales(const op_args *o, smelt_gemm_scales *sc) {
  sc->a = o->t[6];
  sc->b = o->t[7];
  return sc->a || sc->b ? sc : NULL;
}

static smelt_status make_plan(smelt_ctx *ctx, const void *arg, smelt_plan **plan) {
  const op_args *o = (const op_args *)arg;
  smelt_gemm_scales sc;
  switch (o->op) {
    case OP_ACTIVATION: return smelt_activation_plan(ctx, &o->desc, o->t[0], o->t[1], plan);
    case OP_SOFTMAX: return smelt_softmax_plan(ctx, o->t[0], o->t[1], o->t[2], plan);
    case OP_TOPK: return smelt_topk_plan(ctx, o->k, o->t[0], o->t[1], o->t[2], plan);
    case OP_GEMM:
      return smelt_gemm_scaled_plan(ctx, &o->gemm, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], gemm_scales(o, &sc),
                                    plan);
    case OP_GEMM_OFFS:
      return smelt_gemm_grouped_offs_scaled_plan(ctx, &o->gemm, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5],
                                                 gemm_scales(o, &sc), plan);
    case OP_ATTN_FWD: return smelt_attention_fwd_plan(ctx, &o->attn, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], plan);
    case OP_ATTN_VARLEN_FWD:
      return smelt_attention_varlen_fwd_plan(ctx, &o->attn, o->t[0], o->t[1], o->t[2], o->t[5], o->t[6], o->t[3], o->t[4],
                                             plan);
    case OP_ATTN_BWD:
      return smelt_attention_bwd_plan(ctx, &o->attn, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5], o->t[6],
                                      o->t[7], o->t[8], plan);
    case OP_ATTN_VARLEN_BWD:
      return smelt_attention_varlen_bwd_plan(ctx, &o->attn, o->t[0], o->t[1], o->t[2], o->t[9], o->t[10], o->t[3],
                                             o->t[4], o->t[5], o->t[6], o->t[7], o->t[8], plan);
    case OP_CONV2D: return smelt_conv2d_plan(ctx, &o->conv, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], plan);
    case OP_ATTN_DECODE: {
      const smelt_attention_decode_desc d = {o->attn.scale, o->attn.causal};
      return smelt_attention_decode_plan(ctx, &d, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5], o->t[6], plan);
    }
    case OP_KV_APPEND:
      return smelt_kv_cache_append_plan(ctx, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5], plan);
    case OP_NORM:
      return smelt_norm_plan(ctx, &o->norm, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5], o->t[6], o->t[7],
                             plan);
    case OP_NORM_BWD:
      return smelt_norm_bwd_plan(ctx, &o->norm, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5], o->t[6],
                                 o->t[7], o->t[8], plan);
    case OP_RESIDUAL_ADD: return smelt_residual_add_plan(ctx, o->t[0], o->t[1], o->t[2], plan);
    case OP_ROTARY: return smelt_rotary_plan(ctx, &o->rot, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], plan);
    case OP_QGEMM: {
      const smelt_qgemm_weights w = {o->format, o->t[1], o->t[2], o->t[3]};
      return smelt_qgemm_plan(ctx, &o->qgemm, o->t[0], &w, o->t[4], o->t[5], plan);
    }
    default: return SMELT_STATUS_INTERNAL;
  }
}

static smelt_status run_plan(smelt_plan *plan, const void *arg) {
  const op_args *o = (const op_args *)arg;
  smelt_gemm_scales sc;
  switch (o->op) {
    case OP_ACTIVATION: return smelt_activation_run(plan, o->t[0], o->t[1]);
    case OP_SOFTMAX: return smelt_softmax_run(plan, o->t[0], o->t[1], o->t[2]);
    case OP_TOPK: return smelt_topk_run(plan, o->t[0], o->t[1], o->t[2]);
    case OP_GEMM:
      return smelt_gemm_scaled_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], gemm_scales(o, &sc));
    case OP_GEMM_OFFS:
      return smelt_gemm_grouped_offs_scaled_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5],
                                                gemm_scales(o, &sc));
    case OP_ATTN_FWD: return smelt_attention_fwd_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4]);
    case OP_ATTN_VARLEN_FWD:
      return smelt_attention_varlen_fwd_run(plan, o->t[0], o->t[1], o->t[2], o->t[5], o->t[6], o->t[3], o->t[4]);
    case OP_ATTN_BWD:
      return smelt_attention_bwd_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5], o->t[6], o->t[7],
                                     o->t[8]);
    case OP_ATTN_VARLEN_BWD:
      return smelt_attention_varlen_bwd_run(plan, o->t[0], o->t[1], o->t[2], o->t[9], o->t[10], o->t[3], o->t[4],
                                            o->t[5], o->t[6], o->t[7], o->t[8]);
    case OP_CONV2D: return smelt_conv2d_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4]);
    case OP_ATTN_DECODE:
      return smelt_attention_decode_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5], o->t[6]);
    case OP_KV_APPEND: return smelt_kv_cache_append_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5]);
    case OP_NORM:
      return smelt_norm_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5], o->t[6], o->t[7]);
    case OP_NORM_BWD:
      return smelt_norm_bwd_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4], o->t[5], o->t[6], o->t[7],
                                o->t[8]);
    case OP_RESIDUAL_ADD: return smelt_residual_add_run(plan, o->t[0], o->t[1], o->t[2]);
    case OP_ROTARY: return smelt_rotary_run(plan, o->t[0], o->t[1], o->t[2], o->t[3], o->t[4]);
    case OP_QGEMM: {
      const smelt_qgemm_weights w = {o->format, o->t[1], o->t[2], o->t[3]};
      return smelt_qgemm_run(plan, o->t[0], &w, o->t[4], o->t[5]);
    }
    default: return SMELT_STATUS_INTERNAL;
  }
}

/* The conv2d description's parameters in the plan key: alpha, beta, the
 * activation and slope where GEMM keeps them, and every integer field in
 * i[] (two 32-bit fields a slot; each fits, and the packing is one-to-one). */
static int64_t key_pair(int hi, int lo) { return (int64_t)(((uint64_t)(uint32_t)hi << 32) | (uint32_t)lo); }

static void conv2d_key(const smelt_conv2d_desc *d, smpy_pkey *key) {
  key->f[0] = d->epilogue.alpha;
  key->f[1] = d->epilogue.beta;
  key->act = (int32_t)d->epilogue.act;
  key->slope = d->epilogue.slope;
  key->i[0] = key_pair((int)d->kind, (int)d->math);
  key->i[1] = key_pair(d->pad_h0, d->pad_h1);
  key->i[2] = key_pair(d->pad_w0, d->pad_w1);
  key->i[3] = key_pair(d->stride_h, d->stride_w);
  key->i[4] = key_pair(d->dilation_h, d->dilation_w);
}

/* Plans (cached) and runs the op on the call's context and stream. */
static int execute(smpy_call *call, const op_args *o) {
  smpy_ctx *c = call->ctx;
  smpy_pkey key;
  memset(&key, 0, sizeof key);
  key.op = o->op;
  key.act = (int32_t)o->desc.act;
  key.slope = o->desc.slope;
  key.k = o->k;
  key.deterministic = c->deterministic;
  if (o->op == OP_GEMM || o->op == OP_GEMM_OFFS) {
    key.f[0] = o->gemm.epilogue.alpha;
    key.f[1] = o->gemm.epilogue.beta;
    key.act = (int32_t)o->gemm.epilogue.act;
    key.slope = o->gemm.epilogue.slope;
    key.i[0] = (int64_t)o->gemm.math.op;
    key.i[1] = (int64_t)o->gemm.scales;
  } else if (o->op == OP_CONV2D) {
    conv2d_key(&o->conv, &key);
  } else if (o->op == OP_QGEMM) {
    key.f[0] = o->qgemm.alpha;
    key.act = (int32_t)o->qgemm.act;
    key.slope = o->qgemm.slope;
    key.i[0] = (int64_t)o->format;
  } else if (o->op >= OP_NORM) {
    key.f[0] = o->norm.eps;
    key.i[0] = o->op == OP_ROTARY ? (int64_t)o->rot.layout : (int64_t)o->norm.kind;
    key.i[1] = o->rot.inverse;
  } else if (o->op >= OP_ATTN_FWD) {
    key.f[0] = o->attn.scale;
    key.f[1] = o->attn.softcap;
    key.i[5] = o->attn.deterministic;
    key.i[0] = o->attn.causal;
    key.i[1] = o->attn.window_left;
    key.i[2] = o->attn.window_right;
    key.i[3] = o->attn.max_seqlen_q;
    key.i[4] = o->attn.max_seqlen_k;
  }
  key.ntensors = o->nt ? o->nt : 3;
  for (int i = 0; i < key.ntensors; i++) {
    if (o->t[i])
      smpy_tkey_fill(&key.t[i], o->t[i]);
    else
      key.t[i].ndim = -1;
  }
  if (o->op >= OP_ATTN_FWD && o->op <= OP_ATTN_VARLEN_BWD) {
    /* The modifier tensors' layouts and memory: an attention plan keeps
     * the memory it was made with (smelt/attention.h). */
    const smelt_tensor *m[3] = {o->attn.alibi_slopes, o->attn.sinks, o->attn.dsinks};
    for (int i = 0; i < 3; i++) {
      if (m[i]) smpy_tkey_fill(&key.t[key.ntensors + i], m[i]);
      else key.t[key.ntensors + i].ndim = -1;
      key.mod_data[i] = m[i] ? (uint64_t)(uintptr_t)m[i]->data : 0;
    }
    key.ntensors += 3;
  }
  const smelt_status s = smpy_cached_run(call, &key, make_plan, run_plan, o);
  if (s) {
    smpy_raise_status(s);
    return -1;
  }
  return 0;
}

/* The start of every op: o zeroed for op (nt tensors; 0: the small ops'
 * 3) and the call's n positional arguments in a. */
static int op_begin(PyObject *args, const char *name, Py_ssize_t n, PyObject **a, op_args *o, int op, int nt) {
  memset(o, 0, sizeof *o);
  o->op = op;
  o->nt = nt;
  if (PyTuple_Size(args) != n) {
    PyErr_Format(PyExc_TypeError, "_smelt.%s takes %zd positional arguments", name, n);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) a[i] = PyTuple_GetItem(args, i);
  return 0;
}

/* Imports the output obj (writable) into slot of o. */
static int import_out(smpy_call *call, op_args *o, int slot, PyObject *obj, const char *name) {
  smelt_tensor *t;
  if (smpy_call_import(call, obj, name, 1, &t) < 0) return -1;
  o->t[slot] = t;
  return 0;
}

/* The end of a call with one output (slot out_slot of o): imports it, runs,
 * returns it (a new reference). */
static PyObject *run_out(smpy_call *call, op_args *o, int out_slot, PyObject *out) {
  if (import_out(call, o, out_slot, out, "out") < 0 || execute(call, o) < 0) return NULL;
  Py_INCREF(out);
  return out;
}

static int parse_act(PyObject *o, smelt_act *act) {
  if (PyLong_Check(o)) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *act = (smelt_act)v; /* range checked by smelt */
    return 0;
  }
  PyObject *v = PyDict_GetItemWithError(act_names, o);
  if (!v) {
    if (PyErr_Occurred()) return -1;
    PyObject *msg = PyUnicode_FromFormat("smelt.activation: act=%R is not one of %R", o, act_tuple);
    PyObject *b = msg ? PyUnicode_AsUTF8String(msg) : NULL;
    if (b) smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "%s", PyBytes_AsString(b));
    Py_XDECREF(msg);
    Py_XDECREF(b);
    return -1;
  }
  *act = (smelt_act)PyLong_AsLong(v);
  return 0;
}

static PyObject *py_activation(PyObject *self, PyObject *args) {
  PyObject *a[6]; /* x, out, act, slope, ctx, stream */
  op_args o;
  if (op_begin(args, "activation", 6, a, &o, OP_ACTIVATION, 0) < 0 || parse_act(a[2], &o.desc.act) < 0) return NULL;
  double slope = PyFloat_AsDouble(a[3]);
  if (slope == -1.0 && PyErr_Occurred()) return NULL;
  o.desc.slope = (float)slope;

  smpy_call call;
  PyObject *out = a[1], *made = NULL, *result = NULL;
  smelt_tensor *x;
  if (smpy_call_begin(&call, "smelt.activation", a[4], a[5]) < 0) return NULL;
  if (smpy_call_import(&call, a[0], "x", 0, &x) < 0) goto done;
  if (out == Py_None) {
    if (!(out = made = smpy_call_alloc(&call, x->dtype, x->ndim, x->shape))) goto done;
  }
  o.t[0] = x;
  result = run_out(&call, &o, 1, out);
done:
  smpy_call_end(&call);
  Py_XDECREF(made);
  return result;
}

/* The end of a call with an output and an optional lse (slots out_slot and
 * out_slot + 1 of o): makes those not given (out like `like`; lse f32 of
 * lse_nd dims lse_shape, when wanted), imports them, runs, ends the call and
 * returns out, or (out, lse) when asked for. */
static PyObject *end_out_lse(smpy_call *call, op_args *o, int out_slot, PyObject *out, PyObject *lse, int want_lse,
                             const smelt_tensor *like, int lse_nd, const int64_t *lse_shape) {
  PyObject *made_out = NULL, *made_lse = NULL, *result = NULL;
  if (out == Py_None && !(out = made_out = smpy_call_alloc(call, like->dtype, like->ndim, like->shape))) goto done;
  if (lse == Py_None && want_lse && !(lse = made_lse = smpy_call_alloc(call, SMELT_DTYPE_F32, lse_nd, lse_shape)))
    goto done;
  if (import_out(call, o, out_slot, out, "out") < 0) goto done;
  if (lse != Py_None && import_out(call, o, out_slot + 1, lse, "lse") < 0) goto done;
  if (execute(call, o) < 0) goto done;
  if (want_lse) {
    result = PyTuple_Pack(2, out, lse);
  } else {
    Py_INCREF(out);
    result = out;
  }
done:
  smpy_call_end(call);
  Py_XDECREF(made_out);
  Py_XDECREF(made_lse);
  return result;
}

static PyObject *py_softmax(PyObject *self, PyObject *args) {
  PyObject *a[6]; /* x, out, lse, want_lse, ctx, stream */
  op_args o;
  if (op_begin(args, "softmax", 6, a, &o, OP_SOFTMAX, 0) < 0) return NULL;
  int want_lse = PyObject_IsTrue(a[3]);
  if (want_lse < 0) return NULL;

  smpy_call call;
  PyObject *out = a[1], *lse = a[2];
  smelt_tensor *x;
  if (smpy_call_begin(&call, "smelt.softmax", a[4], a[5]) < 0) return NULL;
  if (smpy_call_import(&call, a[0], "x", 0, &x) < 0) goto fail;
  if ((out == Py_None || (lse == Py_None && want_lse)) && x->ndim < 1) {
    smpy_raise(SMELT_STATUS_SHAPE_MISMATCH, "smelt.softmax: x must have at least 1 dim, got a scalar");
    goto fail;
  }
  o.t[0] = x;
  return end_out_lse(&call, &o, 1, out, lse, want_lse, x, x->ndim - 1, x->shape);
fail:
  smpy_call_end(&call);
  return NULL;
}

/* Raises s with fmt, whose one %s gets o's repr; returns -1. */
static int raise_repr(smelt_status s, const char *fmt, PyObject *o) {
  PyObject *r = PyObject_Repr(o);
  PyObject *b = r ? PyUnicode_AsUTF8String(r) : NULL;
  smpy_raise(s, fmt, b ? PyBytes_AsString(b) : "?");
  Py_XDECREF(r);
  Py_XDECREF(b);
  return -1;
}

static int parse_index_dtype(PyObject *o, int *want, smelt_dtype *dt) {
  *want = 1;
  if (o == Py_None) {
    *want = 0;
    return 0;
  }
  if (PyUnicode_Check(o)) {
    if (!PyUnicode_CompareWithASCIIString(o, "int64") || !PyUnicode_CompareWithASCIIString(o, "i64")) {
      *dt = SMELT_DTYPE_I64;
      return 0;
    }
    if (!PyUnicode_CompareWithASCIIString(o, "int32") || !PyUnicode_CompareWithASCIIString(o, "i32")) {
      *dt = SMELT_DTYPE_I32;
      return 0;
    }
  }
  return raise_repr(SMELT_STATUS_DTYPE_MISMATCH, "smelt.topk: index_dtype=%s is not 'int64', 'int32' or None", o);
}

static PyObject *py_topk(PyObject *self, PyObject *args) {
  PyObject *a[7]; /* x, k, values, indices, index_dtype, ctx, stream */
  op_args o;
  if (op_begin(args, "topk", 7, a, &o, OP_TOPK, 0) < 0) return NULL;
  o.k = PyLong_AsLongLong(a[1]);
  if (o.k == -1 && PyErr_Occurred()) return NULL;
  int want_idx;
  smelt_dtype idt = SMELT_DTYPE_I64;
  if (parse_index_dtype(a[4], &want_idx, &idt) < 0) return NULL;

  smpy_call call;
  PyObject *vals = a[2], *idx = a[3], *made_v = NULL, *made_i = NULL, *result = NULL;
  smelt_tensor *x, *v, *ix = NULL;
  if (smpy_call_begin(&call, "smelt.topk", a[5], a[6]) < 0) return NULL;
  if (smpy_call_import(&call, a[0], "x", 0, &x) < 0) goto done;
  if (vals == Py_None || (idx == Py_None && want_idx)) {
    if (x->ndim < 1) {
      smpy_raise(SMELT_STATUS_SHAPE_MISMATCH, "smelt.topk: x must have at least 1 dim, got a scalar");
      goto done;
    }
    if (o.k < 0 || o.k > x->shape[x->ndim - 1]) {
      smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.topk: k=%lld must be in [1, %lld] (x.shape[-1])",
                 (long long)o.k, (long long)x->shape[x->ndim - 1]);
      goto done;
    }
  }
  int64_t shape[SMELT_MAX_DIMS];
  for (int i = 0; i < x->ndim; i++) shape[i] = x->shape[i];
  if (x->ndim >= 1) shape[x->ndim - 1] = o.k;
  if (vals == Py_None && !(vals = made_v = smpy_call_alloc(&call, x->dtype, x->ndim, shape))) goto done;
  if (idx == Py_None && want_idx && !(idx = made_i = smpy_call_alloc(&call, idt, x->ndim, shape))) goto done;
  if (smpy_call_import(&call, vals, "values", 1, &v) < 0) goto done;
  if (idx != Py_None && smpy_call_import(&call, idx, "indices", 1, &ix) < 0) goto done;
  o.t[0] = x;
  o.t[1] = v;
  o.t[2] = ix;
  if (execute(&call, &o) < 0) goto done;
  result = PyTuple_Pack(2, vals, idx);
done:
  smpy_call_end(&call);
  Py_XDECREF(made_v);
  Py_XDECREF(made_i);
  return result;
}

/* ---- gemm and attention */

/* what: the op in the message ("smelt.gemm"). */
static int parse_math(PyObject *o, const char *what, smelt_gemm_math_op *op) {
  static const char *names[] = {"default", "tf32", "3xtf32"};
  if (PyUnicode_Check(o))
    for (int i = 0; i < 3; i++)
      if (!PyUnicode_CompareWithASCIIString(o, names[i])) {
        *op = (smelt_gemm_math_op)i;
        return 0;
      }
  char fmt[128];
  snprintf(fmt, sizeof fmt, "%s: math=%%s is not 'default', 'tf32' or '3xtf32'", what);
  return raise_repr(SMELT_STATUS_INVALID_ARGUMENT, fmt, o);
}

/* None keeps *dt; otherwise a smelt dtype name ('f32', 'bf16', ...). */
static int parse_dtype_name(PyObject *o, const char *what, smelt_dtype *dt) {
  if (o == Py_None) return 0;
  PyObject *b = PyUnicode_Check(o) ? PyUnicode_AsUTF8String(o) : NULL;
  if (b && !smelt_dtype_from_name(PyBytes_AsString(b), dt)) {
    Py_DECREF(b);
    return 0;
  }
  Py_XDECREF(b);
  PyErr_Clear();
  char fmt[160];
  snprintf(fmt, sizeof fmt, "%s: %%s is not a smelt dtype name ('f32', 'f16', 'bf16', ...)", what);
  return raise_repr(SMELT_STATUS_DTYPE_MISMATCH, fmt, o);
}

/* The GEMM description from the five arguments alpha, beta, activation,
 * slope and math that smelt.gemm and smelt.gemm_grouped pass in that order. */
static int gemm_desc_from(PyObject *const *a, smelt_gemm_desc *d) {
  *d = smelt_gemm_desc_default();
  double alpha = PyFloat_AsDouble(a[0]), beta = PyFloat_AsDouble(a[1]), slope = PyFloat_AsDouble(a[3]);
  if (PyErr_Occurred()) return -1;
  d->epilogue.alpha = alpha;
  d->epilogue.beta = beta;
  d->epilogue.slope = (float)slope;
  if (parse_act(a[2], &d->epilogue.act) < 0 || parse_math(a[4], "smelt.gemm", &d->math.op) < 0) return -1;
  return 0;
}

/* desc.scales from an int (a smelt_gemm_scale_kind; range checked by smelt). */
static int gemm_scale_kind(PyObject *v, smelt_gemm_desc *d) {
  const long kind = PyLong_AsLong(v);
  if (kind == -1 && PyErr_Occurred()) return -1;
  d->scales = (smelt_gemm_scale_kind)kind;
  return 0;
}

/* Imports the GEMM operands a, b, offs (with_offs only), c and bias, in that
 * order from consecutive arguments in, and the row and column scales from
 * scales[0] and [1], into o's slots; c, bias and the scales may be None. */
static int import_gemm_operands(smpy_call *call, op_args *o, PyObject *const *in, PyObject *const *scales,
                                int with_offs) {
  static const char *names[] = {"a", "b", "offs", "c", "bias", "scale_a", "scale_b"};
  static const int slots[] = {0, 1, 5, 2, 4, 6, 7};
  for (int i = 0; i < 7; i++) {
    if (i == 2 && !with_offs) continue;
    PyObject *obj = i >= 5 ? scales[i - 5] : *in++;
    smelt_tensor *t;
    if (i >= 3 && obj == Py_None) continue;
    if (smpy_call_import(call, obj, names[i], 0, &t) < 0) return -1;
    o->t[slots[i]] = t;
  }
  return 0;
}

static PyObject *py_gemm(PyObject *self, PyObject *args) {
  PyObject *a[16]; /* a, b, c, bias, out, alpha, beta, act, slope, math, out_dtype, ctx, stream, scale_a, scale_b,
                      scales (a smelt_gemm_scale_kind) */
  op_args o;
  if (op_begin(args, "gemm", 16, a, &o, OP_GEMM, 8) < 0 || gemm_desc_from(a + 5, &o.gemm) < 0 ||
      gemm_scale_kind(a[15], &o.gemm) < 0)
    return NULL;

  smpy_call call;
  PyObject *out = a[4], *made = NULL, *result = NULL;
  if (smpy_call_begin(&call, "smelt.gemm", a[11], a[12]) < 0) return NULL;
  if (import_gemm_operands(&call, &o, a, a + 13, 0) < 0) goto done;
  if (out == Py_None) {
    const smelt_tensor *ta = o.t[0], *tb = o.t[1];
    smelt_dtype dt = ta->dtype;
    if (parse_dtype_name(a[10], "smelt.gemm: out_dtype", &dt) < 0) goto done;
    if (ta->ndim < 2 || ta->ndim > 3 || tb->ndim != ta->ndim) {
      smpy_raise(SMELT_STATUS_SHAPE_MISMATCH,
                 "smelt.gemm: a and b must both be 2-D [M, K] x [K, N] or 3-D [L, M, K] x [L, K, N], got %d-D and %d-D",
                 ta->ndim, tb->ndim);
      goto done;
    }
    int64_t shape[3];
    int nd = ta->ndim;
    if (nd == 3) shape[0] = ta->shape[0];
    shape[nd - 2] = ta->shape[nd - 2];
    shape[nd - 1] = tb->shape[nd - 1];
    if (!(out = made = smpy_call_alloc(&call, dt, nd, shape))) goto done;
  }
  result = run_out(&call, &o, 3, out);
done:
  smpy_call_end(&call);
  Py_XDECREF(made);
  return result;
}

/* The MoE form: out is required (smelt.gemm_grouped makes a zero-filled one,
 * since rows at or past offs[-1] are not written). The plan key holds every
 * tensor's shape and strides and offs' dtype, as a run needs; the offsets'
 * values are read on the device and are not part of it. */
static PyObject *py_gemm_grouped(PyObject *self, PyObject *args) {
  PyObject *a[16]; /* a, b, offs, c, bias, out, alpha, beta, act, slope, math, ctx, stream, scale_a, scale_b,
                      scales */
  op_args o;
  if (op_begin(args, "gemm_grouped", 16, a, &o, OP_GEMM_OFFS, 8) < 0 || gemm_desc_from(a + 6, &o.gemm) < 0 ||
      gemm_scale_kind(a[15], &o.gemm) < 0)
    return NULL;

  smpy_call call;
  if (smpy_call_begin(&call, "smelt.gemm_grouped", a[11], a[12]) < 0) return NULL;
  PyObject *result = import_gemm_operands(&call, &o, a, a + 13, 1) < 0 ? NULL : run_out(&call, &o, 3, a[5]);
  smpy_call_end(&call);
  return result;
}

/* ---- conv2d */

/* The description from kind, the geometry tuple (pad_h0, pad_h1, pad_w0,
 * pad_w1, stride_h, stride_w, dilation_h, dilation_w) and the epilogue's
 * alpha, beta, activation, slope and math, as smelt.conv2d* pass them
 * (smelt checks the values). */
static int conv2d_desc_from(PyObject *const *a, smelt_conv2d_desc *d) {
  *d = smelt_conv2d_desc_default();
  long kind = PyLong_AsLong(a[0]);
  if (kind == -1 && PyErr_Occurred()) return -1;
  d->kind = (smelt_conv2d_kind)kind;
  if (!PyTuple_Check(a[1]) || PyTuple_Size(a[1]) != 8) {
    PyErr_SetString(PyExc_TypeError, "_smelt.conv2d: geometry must be a tuple of 8 ints");
    return -1;
  }
  int *fields[8] = {&d->pad_h0, &d->pad_h1, &d->pad_w0, &d->pad_w1, &d->stride_h, &d->stride_w, &d->dilation_h,
                    &d->dilation_w};
  for (int i = 0; i < 8; i++) {
    long v = PyLong_AsLong(PyTuple_GetItem(a[1], i));
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT_MIN || v > INT_MAX) {
      smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.conv2d: padding, stride and dilation must fit an int, got %ld",
                 v);
      return -1;
    }
    *fields[i] = (int)v;
  }
  double alpha = PyFloat_AsDouble(a[2]), beta = PyFloat_AsDouble(a[3]), slope = PyFloat_AsDouble(a[5]);
  if (PyErr_Occurred()) return -1;
  d->epilogue.alpha = alpha;
  d->epilogue.beta = beta;
  d->epilogue.slope = (float)slope;
  return parse_act(a[4], &d->epilogue.act) < 0 || parse_math(a[6], "smelt.conv2d", &d->math) < 0 ? -1 : 0;
}

static PyObject *py_conv2d(PyObject *self, PyObject *args) {
  /* kind, a, b, c, bias, out, out_shape, geometry, alpha, beta, act, slope, math, out_dtype, ctx, stream */
  PyObject *a[16];
  op_args o;
  if (op_begin(args, "conv2d", 16, a, &o, OP_CONV2D, 5) < 0) return NULL;
  PyObject *d_in[7] = {a[0], a[7], a[8], a[9], a[10], a[11], a[12]};
  if (conv2d_desc_from(d_in, &o.conv) < 0) return NULL;

  smpy_call call;
  PyObject *out = a[5], *made = NULL, *result = NULL;
  if (smpy_call_begin(&call, "smelt.conv2d", a[14], a[15]) < 0) return NULL;
  static const char *names[] = {"a", "b", "c", "bias"};
  static const int slots[] = {0, 1, 2, 4};
  for (int i = 0; i < 4; i++) {
    smelt_tensor *t;
    if (i >= 2 && a[1 + i] == Py_None) continue;
    if (smpy_call_import(&call, a[1 + i], names[i], 0, &t) < 0) goto done;
    o.t[slots[i]] = t;
  }
  if (out == Py_None) {
    smelt_dtype dt = o.t[0]->dtype;
    int64_t shape[4];
    if (parse_dtype_name(a[13], "smelt.conv2d: out_dtype", &dt) < 0) goto done;
    if (!PyTuple_Check(a[6]) || PyTuple_Size(a[6]) != 4) {
      PyErr_SetString(PyExc_TypeError, "_smelt.conv2d: out_shape must be a tuple of 4 ints when out is None");
      goto done;
    }
    for (int i = 0; i < 4; i++)
      if ((shape[i] = PyLong_AsLongLong(PyTuple_GetItem(a[6], i))) == -1 && PyErr_Occurred()) goto done;
    if (!(out = made = smpy_call_alloc(&call, dt, 4, shape))) goto done;
  }
  result = run_out(&call, &o, 3, out);
done:
  smpy_call_end(&call);
  Py_XDECREF(made);
  return result;
}

/* The modifiers' scalar: softcap (p[0]) and deterministic (p[1], NULL in the forward). */
static int parse_attn_flags(PyObject **p, int bwd, smelt_attention_desc *d) {
  const double cap = PyFloat_AsDouble(p[0]);
  const int det = bwd ? PyObject_IsTrue(p[1]) : 0;
  if (PyErr_Occurred() || det < 0) return -1;
  d->softcap = (float)cap;
  d->deterministic = det;
  return 0;
}

/* The modifier tensors alibi_slopes and sinks (None: absent) into d. */
static int import_mods(smpy_call *call, PyObject *alibi, PyObject *sinks, smelt_attention_desc *d) {
  smelt_tensor *t;
  if (alibi != Py_None) {
    if (smpy_call_import(call, alibi, "alibi_slopes", 0, &t) < 0) return -1;
    d->alibi_slopes = t;
  }
  if (sinks != Py_None) {
    if (smpy_call_import(call, sinks, "sinks", 0, &t) < 0) return -1;
    d->sinks = t;
  }
  return 0;
}

/* scale, causal, window_left, window_right, max_seqlen_q, max_seqlen_k. */
static int parse_attn(PyObject **p, smelt_attention_desc *d) {
  *d = smelt_attention_desc_default();
  double scale = PyFloat_AsDouble(p[0]);
  int causal = PyObject_IsTrue(p[1]);
  long long wl = PyLong_AsLongLong(p[2]), wr = PyLong_AsLongLong(p[3]);
  long long mq = PyLong_AsLongLong(p[4]), mk = PyLong_AsLongLong(p[5]);
  if (PyErr_Occurred() || causal < 0) return -1;
  d->scale = (float)scale;
  d->causal = causal;
  d->window_left = wl;
  d->window_right = wr;
  d->max_seqlen_q = mq;
  d->max_seqlen_k = mk;
  return 0;
}

/* Where the arguments of an attention op stand: n in all, tensors in op_args,
 * cu_seqlens_q (None: the batched form) and the desc's six. */
typedef struct attn_call {
  const char *name;
  Py_ssize_t n;
  int op, varlen_op, nt, cu, desc;
} attn_call;

/* The start of an attention op: op_begin, then the form (*varlen) and the desc. */
static int attn_begin(const attn_call *c, PyObject *args, PyObject **a, op_args *o, int *varlen) {
  if (op_begin(args, c->name, c->n, a, o, c->op, c->nt) < 0) return -1;
  *varlen = a[c->cu] != Py_None;
  if (*varlen) o->op = c->varlen_op;
  return parse_attn(a + c->desc, &o->attn);
}

static PyObject *py_attention(PyObject *self, PyObject *args) {
  static const attn_call fwd = {"attention", 19, OP_ATTN_FWD, OP_ATTN_VARLEN_FWD, 7, 6, 8};
  /* q, k, v, out, lse, want_lse, cu_q, cu_k, scale, causal, wl, wr, max_q, max_k, ctx, stream,
   * softcap, alibi_slopes, sinks */
  PyObject *a[19];
  op_args o;
  int varlen;
  if (attn_begin(&fwd, args, a, &o, &varlen) < 0 || parse_attn_flags(a + 16, 0, &o.attn) < 0) return NULL;
  int want_lse = PyObject_IsTrue(a[5]);
  if (want_lse < 0) return NULL;

  smpy_call call;
  PyObject *out = a[3], *lse = a[4];
  smelt_tensor *q, *k, *v, *cq = NULL, *ck = NULL;
  const char *name = varlen ? "smelt.attention_varlen" : "smelt.attention";
  if (smpy_call_begin(&call, name, a[14], a[15]) < 0) return NULL;
  if (smpy_call_import(&call, a[0], "q", 0, &q) < 0 || smpy_call_import(&call, a[1], "k", 0, &k) < 0 ||
      smpy_call_import(&call, a[2], "v", 0, &v) < 0)
    goto fail;
  if (varlen && (smpy_call_import(&call, a[6], "cu_seqlens_q", 0, &cq) < 0 ||
                 smpy_call_import(&call, a[7], "cu_seqlens_k", 0, &ck) < 0))
    goto fail;
  if (import_mods(&call, a[17], a[18], &o.attn) < 0) goto fail;
  /* The lse a call makes: [H, Tq] (varlen) or [B, H, Sq]. */
  int64_t ls[3] = {0, 0, 0};
  if (out == Py_None || (lse == Py_None && want_lse)) {
    int nd = varlen ? 3 : 4;
    if (q->ndim != nd) {
      smpy_raise(SMELT_STATUS_SHAPE_MISMATCH, "%s: q must be %s, got %d dims", name,
                 varlen ? "3-D [Tq, H, D]" : "4-D [B, Sq, H, D]", q->ndim);
      goto fail;
    }
    if (varlen) {
      ls[0] = q->shape[1];
      ls[1] = q->shape[0];
    } else {
      ls[0] = q->shape[0];
      ls[1] = q->shape[2];
      ls[2] = q->shape[1];
    }
  }
  o.t[0] = q;
  o.t[1] = k;
  o.t[2] = v;
  o.t[5] = cq;
  o.t[6] = ck;
  return end_out_lse(&call, &o, 3, out, lse, want_lse, q, varlen ? 2 : 3, ls);
fail:
  smpy_call_end(&call);
  return NULL;
}

static PyObject *py_attention_backward(PyObject *self, PyObject *args) {
  static const attn_call bwd = {"attention_backward", 24, OP_ATTN_BWD, OP_ATTN_VARLEN_BWD, 11, 9, 11};
  /* q, k, v, o, d_o, lse, dq, dk, dv, cu_q, cu_k, scale, causal, wl, wr, max_q, max_k, ctx, stream,
   * softcap, deterministic, alibi_slopes, sinks, dsinks (with sinks: None = allocate; the result then
   * has it fourth) */
  PyObject *a[24];
  op_args o;
  int varlen;
  if (attn_begin(&bwd, args, a, &o, &varlen) < 0 || parse_attn_flags(a + 19, 1, &o.attn) < 0) return NULL;

  static const char *in_names[6] = {"q", "k", "v", "o", "d_o", "lse"};
  static const char *grad_names[4] = {"dq", "dk", "dv", "dsinks"};
  smpy_call call;
  const int with_sinks = a[22] != Py_None;
  PyObject *grads[4] = {a[6], a[7], a[8], a[23]}, *made[4] = {NULL, NULL, NULL, NULL}, *result = NULL;
  smelt_tensor *t[11] = {NULL}, *ds = NULL;
  if (smpy_call_begin(&call, "smelt.attention_backward", a[17], a[18]) < 0) return NULL;
  if (import_mods(&call, a[21], a[22], &o.attn) < 0) goto done;
  for (int i = 0; i < 6; i++)
    if (smpy_call_import(&call, a[i], in_names[i], 0, &t[i]) < 0) goto done;
  if (varlen && (smpy_call_import(&call, a[9], "cu_seqlens_q", 0, &t[9]) < 0 ||
                 smpy_call_import(&call, a[10], "cu_seqlens_k", 0, &t[10]) < 0))
    goto done;
  for (int i = 0; i < 3; i++) {
    const smelt_tensor *like = i == 0 ? t[0] : t[i]; /* dq like q, dk like k, dv like v */
    if (grads[i] == Py_None && !(grads[i] = made[i] = smpy_call_alloc(&call, like->dtype, like->ndim, like->shape)))
      goto done;
    if (smpy_call_import(&call, grads[i], grad_names[i], 1, &t[6 + i]) < 0) goto done;
  }
  if (with_sinks) {
    const smelt_tensor *sk = o.attn.sinks;
    if (grads[3] == Py_None && !(grads[3] = made[3] = smpy_call_alloc(&call, SMELT_DTYPE_F32, sk->ndim, sk->shape)))
      goto done;
    if (smpy_call_import(&call, grads[3], grad_names[3], 1, &ds) < 0) goto done;
    o.attn.dsinks = ds;
  }
  for (int i = 0; i < 11; i++) o.t[i] = t[i];
  if (execute(&call, &o) < 0) goto done;
  result = with_sinks ? PyTuple_Pack(4, grads[0], grads[1], grads[2], grads[3])
                      : PyTuple_Pack(3, grads[0], grads[1], grads[2]);
done:
  smpy_call_end(&call);
  for (int i = 0; i < 4; i++) Py_XDECREF(made[i]);
  return result;
}

static PyObject *py_attention_decode(PyObject *self, PyObject *args) {
  /* q, k_cache, v_cache, block_table, cache_seqlens, out, lse, want_lse, scale, causal, ctx, stream */
  static const char *names[5] = {"q", "k_cache", "v_cache", "block_table", "cache_seqlens"};
  PyObject *a[12];
  op_args o;
  if (op_begin(args, "attention_decode", 12, a, &o, OP_ATTN_DECODE, 7) < 0) return NULL;
  const int want_lse = PyObject_IsTrue(a[7]), causal = PyObject_IsTrue(a[9]);
  const double scale = PyFloat_AsDouble(a[8]);
  if (want_lse < 0 || causal < 0 || (scale == -1.0 && PyErr_Occurred())) return NULL;
  o.attn.scale = (float)scale;
  o.attn.causal = causal;
  smpy_call call;
  smelt_tensor *t;
  if (smpy_call_begin(&call, "smelt.attention_decode", a[10], a[11]) < 0) return NULL;
  for (int i = 0; i < 5; i++) {
    if (smpy_call_import(&call, a[i], names[i], 0, &t) < 0) goto fail;
    o.t[i] = t;
  }
  if (o.t[0]->ndim != 4) {
    smpy_raise(SMELT_STATUS_SHAPE_MISMATCH, "smelt.attention_decode: q must be 4-D [B, Sq, H, D], got %d dims",
               o.t[0]->ndim);
    goto fail;
  }
  const int64_t ls[3] = {o.t[0]->shape[0], o.t[0]->shape[2], o.t[0]->shape[1]};
  return end_out_lse(&call, &o, 5, a[5], a[6], want_lse, o.t[0], 3, ls);
fail:
  smpy_call_end(&call);
  return NULL;
}

static PyObject *py_kv_cache_append(PyObject *self, PyObject *args) {
  /* k_new, v_new, block_table, cache_seqlens, k_cache, v_cache, ctx, stream */
  static const char *names[6] = {"k_new", "v_new", "block_table", "cache_seqlens", "k_cache", "v_cache"};
  PyObject *a[8], *result = NULL;
  op_args o;
  if (op_begin(args, "kv_cache_append", 8, a, &o, OP_KV_APPEND, 6) < 0) return NULL;
  smpy_call call;
  smelt_tensor *t;
  if (smpy_call_begin(&call, "smelt.kv_cache_append", a[6], a[7]) < 0) return NULL;
  for (int i = 0; i < 6; i++) {
    if (smpy_call_import(&call, a[i], names[i], i >= 4, &t) < 0) goto done;
    o.t[i] = t;
  }
  if (execute(&call, &o) < 0) goto done;
  Py_INCREF(Py_None);
  result = Py_None;
done:
  smpy_call_end(&call);
  return result;
}

/* ---- norms, the residual add, rotary */

/* Imports obj (None: absent) into slot of o. */
static int import_opt(smpy_call *call, op_args *o, int slot, PyObject *obj, const char *name, int writable) {
  smelt_tensor *t = NULL;
  if (obj != Py_None && smpy_call_import(call, obj, name, writable, &t) < 0) return -1;
  o->t[slot] = t;
  return 0;
}

/* An int argument (an enum's value, range checked by smelt). */
static int parse_int(PyObject *obj, int *out) {
  long v = PyLong_AsLong(obj);
  if (v == -1 && PyErr_Occurred()) return -1;
  *out = (int)v;
  return 0;
}

/* out (None: made as dt with the given shape, when `want`) imported into slot. */
static int out_slot(smpy_call *call, op_args *o, int slot, PyObject **out, PyObject **made, const char *name, int want,
                    smelt_dtype dt, int ndim, const int64_t *shape) {
  if (*out == Py_None && want && !(*out = *made = smpy_call_alloc(call, dt, ndim, shape))) return -1;
  return import_opt(call, o, slot, *out, name, 1);
}

/* A tuple of the objects, None where absent. */
static PyObject *tuple_of(PyObject **objs, int n) {
  PyObject *t = PyTuple_New(n);
  for (int i = 0; t && i < n; i++) {
    PyObject *v = objs[i] ? objs[i] : Py_None;
    Py_INCREF(v);
    PyTuple_SetItem(t, i, v); /* steals v */
  }
  return t;
}

static PyObject *py_norm(PyObject *self, PyObject *args) {
  /* x, residual, weight, bias, out, h_out, mean, rstd, kind, eps, want_stats, ctx, stream */
  PyObject *a[13];
  op_args o;
  int kind;
  if (op_begin(args, "norm", 13, a, &o, OP_NORM, 8) < 0 || parse_int(a[8], &kind) < 0) return NULL;
  double eps = PyFloat_AsDouble(a[9]);
  int want = PyObject_IsTrue(a[10]);
  if ((eps == -1.0 && PyErr_Occurred()) || want < 0) return NULL;
  o.norm.kind = (smelt_norm_kind)kind;
  o.norm.eps = (float)eps;
  static const char *const names[8] = {"x", "residual", "weight", "bias", "out", "h_out", "mean", "rstd"};
  PyObject *outs[4] = {a[4], a[5], a[6], a[7]}, *made[4] = {NULL, NULL, NULL, NULL}, *result = NULL;
  smpy_call call;
  if (smpy_call_begin(&call, "smelt.norm", a[11], a[12]) < 0) return NULL;
  for (int i = 0; i < 4; i++)
    if (import_opt(&call, &o, i, a[i], names[i], 0) < 0) goto done;
  const smelt_tensor *x = o.t[0];
  if (x->ndim < 1) {
    smpy_raise(SMELT_STATUS_SHAPE_MISMATCH, "smelt.norm: x must have at least 1 dim, got a scalar");
    goto done;
  }
  for (int i = 0; i < 4; i++) {
    const int rows = i < 2, wanted = i == 0 || (i == 1 && o.t[1]) || (i == 2 && want && kind == SMELT_NORM_LAYER) ||
                                      (i == 3 && want);
    if (out_slot(&call, &o, 4 + i, &outs[i], &made[i], names[4 + i], wanted, rows ? x->dtype : SMELT_DTYPE_F32,
                 rows ? x->ndim : x->ndim - 1, x->shape) < 0)
      goto done;
  }
  if (execute(&call, &o) < 0) goto done;
  result = tuple_of(outs, 4);
done:
  smpy_call_end(&call);
  for (int i = 0; i < 4; i++) Py_XDECREF(made[i]);
  return result;
}

static PyObject *py_norm_backward(PyObject *self, PyObject *args) {
  /* dy, x, weight, mean, rstd, dh, dx, dweight, dbias, kind, want_dweight, want_dbias, ctx, stream */
  PyObject *a[14];
  op_args o;
  int kind;
  if (op_begin(args, "norm_backward", 14, a, &o, OP_NORM_BWD, 9) < 0 || parse_int(a[9], &kind) < 0) return NULL;
  int want_w = PyObject_IsTrue(a[10]), want_b = PyObject_IsTrue(a[11]);
  if (want_w < 0 || want_b < 0) return NULL;
  o.norm.kind = (smelt_norm_kind)kind;
  static const char *const names[9] = {"dy", "x", "weight", "mean", "rstd", "dh", "dx", "dweight", "dbias"};
  PyObject *outs[3] = {a[6], a[7], a[8]}, *made[3] = {NULL, NULL, NULL}, *result = NULL;
  smpy_call call;
  if (smpy_call_begin(&call, "smelt.norm_backward", a[12], a[13]) < 0) return NULL;
  for (int i = 0; i < 6; i++)
    if (import_opt(&call, &o, i, a[i], names[i], 0) < 0) goto done;
  const smelt_tensor *dy = o.t[0], *w = o.t[2];
  if (dy->ndim < 1) {
    smpy_raise(SMELT_STATUS_SHAPE_MISMATCH, "smelt.norm_backward: dy must have at least 1 dim, got a scalar");
    goto done;
  }
  const int64_t *C = dy->shape + dy->ndim - 1;
  const smelt_dtype wdt = w ? w->dtype : dy->dtype;
  if (out_slot(&call, &o, 6, &outs[0], &made[0], "dx", 1, dy->dtype, dy->ndim, dy->shape) < 0 ||
      out_slot(&call, &o, 7, &outs[1], &made[1], "dweight", want_w, wdt, 1, C) < 0 ||
      out_slot(&call, &o, 8, &outs[2], &made[2], "dbias", want_b, wdt, 1, C) < 0 || execute(&call, &o) < 0)
    goto done;
  result = tuple_of(outs, 3);
done:
  smpy_call_end(&call);
  for (int i = 0; i < 3; i++) Py_XDECREF(made[i]);
  return result;
}

static PyObject *py_residual_add(PyObject *self, PyObject *args) {
  PyObject *a[5]; /* x, residual, out, ctx, stream */
  op_args o;
  if (op_begin(args, "residual_add", 5, a, &o, OP_RESIDUAL_ADD, 3) < 0) return NULL;
  smpy_call call;
  PyObject *out = a[2], *made = NULL, *result = NULL;
  if (smpy_call_begin(&call, "smelt.residual_add", a[3], a[4]) < 0) return NULL;
  if (import_opt(&call, &o, 0, a[0], "x", 0) < 0 || import_opt(&call, &o, 1, a[1], "residual", 0) < 0) goto done;
  if (out == Py_None && !(out = made = smpy_call_alloc(&call, o.t[0]->dtype, o.t[0]->ndim, o.t[0]->shape))) goto done;
  result = run_out(&call, &o, 2, out);
done:
  smpy_call_end(&call);
  Py_XDECREF(made);
  return result;
}

static PyObject *py_rotary(PyObject *self, PyObject *args) {
  PyObject *a[9]; /* x, cos, sin, positions, out, layout, inverse, ctx, stream */
  op_args o;
  int layout;
  if (op_begin(args, "rotary", 9, a, &o, OP_ROTARY, 5) < 0 || parse_int(a[5], &layout) < 0 ||
      parse_int(a[6], &o.rot.inverse) < 0)
    return NULL;
  o.rot.layout = (smelt_rotary_layout)layout;
  static const char *const names[4] = {"x", "cos", "sin", "positions"};
  smpy_call call;
  PyObject *out = a[4], *made = NULL, *result = NULL;
  if (smpy_call_begin(&call, "smelt.rotary", a[7], a[8]) < 0) return NULL;
  for (int i = 0; i < 4; i++)
    if (import_opt(&call, &o, i, a[i], names[i], 0) < 0) goto done;
  if (out == Py_None && !(out = made = smpy_call_alloc(&call, o.t[0]->dtype, o.t[0]->ndim, o.t[0]->shape))) goto done;
  result = run_out(&call, &o, 4, out);
done:
  smpy_call_end(&call);
  Py_XDECREF(made);
  return result;
}

/* ---- the quantized GEMM */

/* A smelt_quant_format by its name ('nvfp4', 'mxfp8', 'fp8-1x128', ...). */
static int parse_format(PyObject *o, smelt_quant_format *f) {
  for (int i = 0; i < SMELT_QUANT_FORMAT_COUNT && PyUnicode_Check(o); i++)
    if (!PyUnicode_CompareWithASCIIString(o, smelt_quant_format_name((smelt_quant_format)i))) {
      *f = (smelt_quant_format)i;
      return 0;
    }
  return raise_repr(SMELT_STATUS_INVALID_ARGUMENT,
                    "smelt.qgemm: format=%s is not one of 'fp8-tensor', 'fp8-row', 'fp8-1x128', 'fp8-128x128', "
                    "'mxfp8', 'nvfp4'",
                    o);
}

static PyObject *py_qgemm(PyObject *self, PyObject *args) {
  PyObject *a[13]; /* x, w_q, w_scales, w_tensor_scale, bias, out, format, alpha, act, slope, out_dtype, ctx, stream */
  static const char *names[5] = {"x", "w_q", "w_scales", "w_tensor_scale", "bias"};
  op_args o;
  if (op_begin(args, "qgemm", 13, a, &o, OP_QGEMM, 6) < 0 || parse_format(a[6], &o.format) < 0) return NULL;
  o.qgemm = smelt_qgemm_desc_default();
  o.qgemm.alpha = PyFloat_AsDouble(a[7]);
  const double slope = PyFloat_AsDouble(a[9]);
  if (PyErr_Occurred() || parse_act(a[8], &o.qgemm.act) < 0) return NULL;
  o.qgemm.slope = (float)slope;
  smpy_call call;
  PyObject *out = a[5], *made = NULL, *result = NULL;
  if (smpy_call_begin(&call, "smelt.qgemm", a[11], a[12]) < 0) return NULL;
  for (int i = 0; i < 5; i++) {
    smelt_tensor *t;
    if ((i == 3 || i == 4) && a[i] == Py_None) continue;
    if (smpy_call_import(&call, a[i], names[i], 0, &t) < 0) goto done;
    /* numpy has no e4m3: scale bytes may come as uint8. */
    if (i == 2 && t->dtype == SMELT_DTYPE_U8 && o.format == SMELT_QUANT_NVFP4) t->dtype = SMELT_DTYPE_E4M3;
    o.t[i] = t;
  }
  if (out == Py_None) {
    const smelt_tensor *x = o.t[0], *q = o.t[1];
    smelt_dtype dt = x->dtype;
    if (parse_dtype_name(a[10], "smelt.qgemm: out_dtype", &dt) < 0) goto done;
    if (x->ndim != 2 || q->ndim != 2) {
      smpy_raise(SMELT_STATUS_SHAPE_MISMATCH,
                 "smelt.qgemm: x and w_q must be 2-D ([M, K] and [N, K/2]), got %d-D and %d-D", x->ndim, q->ndim);
      goto done;
    }
    const int64_t shape[2] = {x->shape[0], q->shape[0]};
    if (!(out = made = smpy_call_alloc(&call, dt, 2, shape))) goto done;
  }
  result = run_out(&call, &o, 5, out);
done:
  smpy_call_end(&call);
  Py_XDECREF(made);
  return result;
}

PyMethodDef smpy_op_methods[] = {
    {"activation", py_activation, METH_VARARGS, "activation(x, out, act, slope, ctx, stream) -> out"},
    {"softmax", py_softmax, METH_VARARGS, "softmax(x, out, lse, want_lse, ctx, stream) -> out or (out, lse)"},
    {"topk", py_topk, METH_VARARGS, "topk(x, k, values, indices, index_dtype, ctx, stream) -> (values, indices)"},
    {"gemm", py_gemm, METH_VARARGS,
     "gemm(a, b, c, bias, out, alpha, beta, act, slope, math, out_dtype, ctx, stream, scale_a, scale_b, scales) "
     "-> out"},
    {"gemm_grouped", py_gemm_grouped, METH_VARARGS,
     "gemm_grouped(a, b, offs, c, bias, out, alpha, beta, act, slope, math, ctx, stream, scale_a, scale_b, scales) "
     "-> out"},
    {"conv2d", py_conv2d, METH_VARARGS,
     "conv2d(kind, a, b, c, bias, out, out_shape, geometry, alpha, beta, act, slope, math, out_dtype, ctx, stream) "
     "-> out"},
    {"attention", py_attention, METH_VARARGS,
     "attention(q, k, v, out, lse, want_lse, cu_seqlens_q, cu_seqlens_k, scale, causal, window_left, window_right, "
     "max_seqlen_q, max_seqlen_k, ctx, stream, softcap, alibi_slopes, sinks) -> out or (out, lse)"},
    {"attention_backward", py_attention_backward, METH_VARARGS,
     "attention_backward(q, k, v, o, d_o, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, scale, causal, window_left, "
     "window_right, max_seqlen_q, max_seqlen_k, ctx, stream, softcap, deterministic, alibi_slopes, sinks, dsinks) "
     "-> (dq, dk, dv) or, with sinks, (dq, dk, dv, dsinks)"},
    {"attention_decode", py_attention_decode, METH_VARARGS,
     "attention_decode(q, k_cache, v_cache, block_table, cache_seqlens, out, lse, want_lse, scale, causal, ctx, "
     "stream) -> out or (out, lse)"},
    {"kv_cache_append", py_kv_cache_append, METH_VARARGS,
     "kv_cache_append(k_new, v_new, block_table, cache_seqlens, k_cache, v_cache, ctx, stream) -> None"},
    {"norm", py_norm, METH_VARARGS,
     "norm(x, residual, weight, bias, out, h_out, mean, rstd, kind, eps, want_stats, ctx, stream) "
     "-> (out, h_out, mean, rstd)"},
    {"norm_backward", py_norm_backward, METH_VARARGS,
     "norm_backward(dy, x, weight, mean, rstd, dh, dx, dweight, dbias, kind, want_dweight, want_dbias, ctx, stream) "
     "-> (dx, dweight, dbias)"},
    {"residual_add", py_residual_add, METH_VARARGS, "residual_add(x, residual, out, ctx, stream) -> out"},
    {"rotary", py_rotary, METH_VARARGS, "rotary(x, cos, sin, positions, out, layout, inverse, ctx, stream) -> out"},
    {"qgemm", py_qgemm, METH_VARARGS,
     "qgemm(x, w_q, w_scales, w_tensor_scale, bias, out, format, alpha, act, slope, out_dtype, ctx, stream) -> out"},
    {NULL, NULL, 0, NULL}};

int smpy_ops_init(PyObject *module) {
  act_names = PyDict_New();
  if (!act_names) return -1;
  PyObject *names = PyTuple_New(SMELT_ACT_COUNT);
  if (!names) return -1;
  for (int i = 0; i < SMELT_ACT_COUNT; i++) {
    PyObject *n = PyUnicode_FromString(smelt_act_name((smelt_act)i));
    PyObject *v = PyLong_FromLong(i);
    if (!n || !v || PyDict_SetItem(act_names, n, v) < 0) {
      Py_XDECREF(n);
      Py_XDECREF(v);
      Py_DECREF(names);
      return -1;
    }
    Py_DECREF(v);
    PyTuple_SetItem(names, i, n); /* steals n */
  }
  act_tuple = names;
  Py_INCREF(names);
  if (PyModule_AddObject(module, "ACTIVATIONS", names) < 0) {
    Py_DECREF(names);
    return -1;
  }
  return 0;
}
