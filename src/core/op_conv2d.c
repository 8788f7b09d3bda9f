/* smelt_conv2d: the description's checks, the problem's shapes, and the
 * plan/run/one-shot entry points on the op-family interface.
 *
 * The tensors are CUTLASS's A, B, C, D of the implicit GEMM, whose roles are
 * the same for every kind (A and B read, C read when beta != 0, D written,
 * maybe in place of C), so the shared code (src/core/family.c) checks them;
 * what each is (x, w, dy, ...) depends on the kind, and the messages here
 * say so ("A (dy)"). Everything is checked before a backend sees the plan,
 * so a failed call writes nothing. The error bound is GEMM's for the
 * equivalent GEMM (smelt/conv2d.h's table), whose description the caller
 * gives the bound query (math op and epilogue). */
#include "conv2d_internal.h"
#include "error_bound.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define OP "smelt_conv2d"

smelt_conv2d_desc smelt_conv2d_desc_default(void) {
  smelt_conv2d_desc d;
  memset(&d, 0, sizeof d);
  d.kind = SMELT_CONV2D_FPROP;
  d.stride_h = d.stride_w = 1;
  d.dilation_h = d.dilation_w = 1;
  d.epilogue = smelt_gemm_desc_default().epilogue;
  return d;
}

static const char *const kind_names[SMELT_CONV2D_KIND_COUNT] = {"fprop", "dgrad", "wgrad"};
static const char *const iter_names[SMELT_CONV2D_ITER_COUNT] = {"auto", "analytic", "optimized", "fixed_channels",
                                                                "few_channels"};
static const char *const stride_names[SMELT_CONV2D_STRIDE_COUNT] = {"auto", "strided", "unity"};
static const char *const split_names[SMELT_CONV2D_SPLIT_K_COUNT] = {"auto", "serial", "parallel"};

/* What each tensor is in each kind, for messages, and its dims' letters. */
static const char *const role_what[SMELT_CONV2D_KIND_COUNT][SMELT__CONV2D_ROLES] = {
    {"A (x)", "B (w)", "C", "D (y)", "bias"},
    {"A (dy)", "B (w)", "C", "D (dx)", "bias"},
    {"A (dy)", "B (x)", "C", "D (dw)", "bias"},
};
static const char *const dims_nhwc = "[N, H, W, C]", *const dims_krsc = "[K, R, S, C]",
                         *const dims_npqk = "[N, P, Q, K]";

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const smelt__role roles[SMELT__CONV2D_ROLES] = {
    [SMELT__CONV2D_A] = {"A", 0, float_types, 3, 0},
    [SMELT__CONV2D_B] = {"B", SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    [SMELT__CONV2D_C] = {"C", SMELT__ROLE_OPTIONAL, float_types, 3, 0},
    [SMELT__CONV2D_D] = {"D", SMELT__ROLE_OUTPUT | SMELT__ROLE_IN_PLACE, float_types, 3, SMELT__CONV2D_C},
    [SMELT__CONV2D_BIAS] = {"bias", SMELT__ROLE_OPTIONAL, float_types, 3, 0},
};

/* ---------------------------------------------------------------- the description */

/* Every field in its range and every epilogue value finite, from tables:
 * enums within their counts, sizes at their least. */
static smelt_status check_desc(const smelt_conv2d_desc *d) {
  const smelt_gemm_epilogue *e = &d->epilogue;
  const struct {
    const char *field;
    int v, lo, hi; /* hi INT_MAX: no upper bound */
  } ints[] = {
      {"kind", (int)d->kind, 0, SMELT_CONV2D_KIND_COUNT - 1},
      {"pad_h0", d->pad_h0, 0, INT_MAX},
      {"pad_h1", d->pad_h1, 0, INT_MAX},
      {"pad_w0", d->pad_w0, 0, INT_MAX},
      {"pad_w1", d->pad_w1, 0, INT_MAX},
      {"stride_h", d->stride_h, 1, INT_MAX},
      {"stride_w", d->stride_w, 1, INT_MAX},
      {"dilation_h", d->dilation_h, 1, INT_MAX},
      {"dilation_w", d->dilation_w, 1, INT_MAX},
      {"math", (int)d->math, 0, SMELT_GEMM_MATH_COUNT - 1},
      {"iterator", (int)d->iterator, 0, SMELT_CONV2D_ITER_COUNT - 1},
      {"stride_support", (int)d->stride_support, 0, SMELT_CONV2D_STRIDE_COUNT - 1},
      {"split_k_mode", (int)d->split_k_mode, 0, SMELT_CONV2D_SPLIT_K_COUNT - 1},
      {"split_k_slices", d->split_k_slices, 0, SMELT_GEMM_MAX_SPLIT_K},
      {"epilogue.act", (int)e->act, 0, SMELT_ACT_COUNT - 1},
  };
  for (size_t i = 0; i < sizeof ints / sizeof *ints; i++) {
    if (ints[i].v >= ints[i].lo && ints[i].v <= ints[i].hi) continue;
    if (ints[i].hi == INT_MAX)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.%s=%d must be >= %d", ints[i].field, ints[i].v,
                          ints[i].lo);
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.%s=%d is out of range (%d..%d)", ints[i].field,
                        ints[i].v, ints[i].lo, ints[i].hi);
  }
  const struct {
    const char *field;
    double v;
  } reals[] = {{"alpha", e->alpha},     {"beta", e->beta},       {"slope", e->slope},
               {"scale_a", e->scale_a}, {"scale_b", e->scale_b}, {"scale_d", e->scale_d}};
  for (size_t i = 0; i < sizeof reals / sizeof *reals; i++)
    if (!isfinite(reals[i].v))
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.epilogue.%s=%g must be finite", reals[i].field,
                          reals[i].v);
  if (d->math == SMELT_GEMM_MATH_3XTF32)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": desc.math=3XTF32 is not offered for conv2d (supported: "
                                                     "DEFAULT, TF32)");
  if (d->stride_support == SMELT_CONV2D_STRIDE_UNITY && (d->stride_h != 1 || d->stride_w != 1))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": desc.stride_support=unity needs stride 1x1 (desc.stride_h=%d, stride_w=%d)", d->stride_h,
                        d->stride_w);
  if (d->kind != SMELT_CONV2D_FPROP && e->act != SMELT_ACT_IDENTITY)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": %s: desc.epilogue.act=%s: activations are fused into fprop only (use identity)",
                        kind_names[d->kind], smelt_act_name(e->act));
  return SMELT_OK;
}

/* ---------------------------------------------------------------- shapes */

/* P or Q (smelt/conv2d.h) with checked arithmetic: 0 when the dilated
 * filter is larger than the padded input, -1 when a step overflows int64
 * (no message: the public helper below reports nothing). */
static int64_t out_extent(int64_t in, int pad0, int pad1, int dil, int stride, int64_t f) {
  int64_t span, padded;
  if (__builtin_mul_overflow((int64_t)dil, f - 1, &span) ||
      __builtin_add_overflow(in, (int64_t)pad0 + (int64_t)pad1, &padded))
    return -1;
  return padded - span - 1 < 0 ? 0 : (padded - span - 1) / stride + 1;
}

int64_t smelt_conv2d_out_size(const smelt_conv2d_desc *desc, int axis, int64_t in, int64_t f) {
  const smelt_conv2d_desc d = desc ? *desc : smelt_conv2d_desc_default();
  if ((axis != 0 && axis != 1) || in < 1 || f < 1 || d.pad_h0 < 0 || d.pad_h1 < 0 || d.pad_w0 < 0 || d.pad_w1 < 0 ||
      d.stride_h < 1 || d.stride_w < 1 || d.dilation_h < 1 || d.dilation_w < 1)
    return -1;
  return axis == 0 ? out_extent(in, d.pad_h0, d.pad_h1, d.dilation_h, d.stride_h, f)
                   : out_extent(in, d.pad_w0, d.pad_w1, d.dilation_w, d.stride_w, f);
}

/* t is 4-D with every dim >= 1. */
static smelt_status check_4d(const char *what, const char *dims, const smelt_tensor *t) {
  char sh[160];
  if (t->ndim != 4)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": %s.shape=%s must be 4-D %s", what,
                        smelt__shape_str(t, sh, sizeof sh), dims);
  for (int i = 0; i < 4; i++)
    if (t->shape[i] < 1)
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": %s.shape=%s: every dim of %s must be >= 1", what,
                          smelt__shape_str(t, sh, sizeof sh), dims);
  return SMELT_OK;
}

/* t is [e0, e1, e2, e3]. */
static smelt_status check_dims(const char *what, const char *dims, const smelt_tensor *t, int64_t e0, int64_t e1,
                               int64_t e2, int64_t e3) {
  if (t->shape[0] == e0 && t->shape[1] == e1 && t->shape[2] == e2 && t->shape[3] == e3) return SMELT_OK;
  char sh[160];
  return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                      OP ": %s.shape=%s must be %s=[%lld, %lld, %lld, %lld] (P, Q from H, W, R, S, padding, stride "
                      "and dilation: smelt/conv2d.h)",
                      what, smelt__shape_str(t, sh, sizeof sh), dims, (long long)e0, (long long)e1, (long long)e2,
                      (long long)e3);
}

/* P and Q of st's H, W, R, S, both >= 1; `input` names the tensor H and W
 * come from. */
static smelt_status resolve_pq(smelt__conv2d_state *st, const char *input) {
  const smelt_conv2d_desc *d = &st->desc;
  st->p = out_extent(st->h, d->pad_h0, d->pad_h1, d->dilation_h, d->stride_h, st->r);
  st->q = out_extent(st->w, d->pad_w0, d->pad_w1, d->dilation_w, d->stride_w, st->s);
  if (st->p < 0 || st->q < 0)
    return smelt__error(SMELT_STATUS_OVERFLOW,
                        OP ": %s: the padded input (%s: H=%lld, W=%lld, pads %d+%d, %d+%d) or the dilated filter "
                        "(R=%lld, S=%lld, dilation %dx%d) overflows int64",
                        kind_names[d->kind], input, (long long)st->h, (long long)st->w, d->pad_h0, d->pad_h1,
                        d->pad_w0, d->pad_w1, (long long)st->r, (long long)st->s, d->dilation_h, d->dilation_w);
  if (st->p < 1 || st->q < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH,
                        OP ": %s: the dilated filter (R=%lld, S=%lld, dilation %dx%d) is larger than the padded "
                        "input (%s: H=%lld, W=%lld, pads %d+%d, %d+%d): no output (P=%lld, Q=%lld)",
                        kind_names[d->kind], (long long)st->r, (long long)st->s, d->dilation_h, d->dilation_w, input,
                        (long long)st->h, (long long)st->w, d->pad_h0, d->pad_h1, d->pad_w0, d->pad_w1,
                        (long long)st->p, (long long)st->q);
  return SMELT_OK;
}

/* The problem's sizes from the kind's tensors (smelt/conv2d.h's table). */
static smelt_status resolve_shapes(smelt__conv2d_state *st, const smelt_tensor *const *t) {
  const smelt_conv2d_kind kind = st->desc.kind;
  const char *const *what = role_what[kind];
  const smelt_tensor *a = t[SMELT__CONV2D_A], *b = t[SMELT__CONV2D_B], *d = t[SMELT__CONV2D_D];
  const char *dims_a = kind == SMELT_CONV2D_FPROP ? dims_nhwc : dims_npqk;
  const char *dims_b = kind == SMELT_CONV2D_WGRAD ? dims_nhwc : dims_krsc;
  const char *dims_d = kind == SMELT_CONV2D_FPROP ? dims_npqk : kind == SMELT_CONV2D_DGRAD ? dims_nhwc : dims_krsc;
  smelt_status s;
  if ((s = check_4d(what[SMELT__CONV2D_A], dims_a, a)) || (s = check_4d(what[SMELT__CONV2D_B], dims_b, b)) ||
      (s = check_4d(what[SMELT__CONV2D_D], dims_d, d)))
    return s;
  st->n = kind == SMELT_CONV2D_WGRAD ? b->shape[0] : a->shape[0];
  if (kind == SMELT_CONV2D_FPROP) {
    st->h = a->shape[1], st->w = a->shape[2], st->c = a->shape[3];
    st->k = b->shape[0], st->r = b->shape[1], st->s = b->shape[2];
    if ((s = check_dims(what[SMELT__CONV2D_B], dims_b, b, st->k, st->r, st->s, st->c)) ||
        (s = resolve_pq(st, what[SMELT__CONV2D_A])))
      return s;
    return check_dims(what[SMELT__CONV2D_D], dims_d, d, st->n, st->p, st->q, st->k);
  }
  st->k = a->shape[3];
  if (kind == SMELT_CONV2D_DGRAD) {
    st->r = b->shape[1], st->s = b->shape[2], st->c = b->shape[3];
    st->h = d->shape[1], st->w = d->shape[2];
    if ((s = check_dims(what[SMELT__CONV2D_B], dims_b, b, st->k, st->r, st->s, st->c)) ||
        (s = check_dims(what[SMELT__CONV2D_D], dims_d, d, st->n, st->h, st->w, st->c)))
      return s;
  } else {
    st->h = b->shape[1], st->w = b->shape[2], st->c = b->shape[3];
    st->r = d->shape[1], st->s = d->shape[2];
    if ((s = check_dims(what[SMELT__CONV2D_D], dims_d, d, st->k, st->r, st->s, st->c))) return s;
  }
  if ((s = resolve_pq(st, what[kind == SMELT_CONV2D_DGRAD ? SMELT__CONV2D_D : SMELT__CONV2D_B]))) return s;
  return check_dims(what[SMELT__CONV2D_A], dims_a, a, st->n, st->p, st->q, st->k);
}

/* C (when read) is D's twin; bias is [K], in fprop only. */
static smelt_status check_c_bias(const smelt__conv2d_state *st, const smelt_tensor *const *t) {
  const smelt_tensor *c = t[SMELT__CONV2D_C], *d = t[SMELT__CONV2D_D], *bias = t[SMELT__CONV2D_BIAS];
  const char *const *what = role_what[st->desc.kind];
  smelt_status s;
  if (st->has_c && !c)
    return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": C is NULL but desc.epilogue.beta=%g is not 0",
                        st->desc.epilogue.beta);
  if (c) {
    if ((s = smelt__check_same_shape(OP, what[SMELT__CONV2D_D], d, "C", c))) return s;
    if (c->dtype != d->dtype)
      return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": C.dtype=%s must equal %s.dtype=%s",
                          smelt_dtype_name(c->dtype), what[SMELT__CONV2D_D], smelt_dtype_name(d->dtype));
  }
  if (!bias) return SMELT_OK;
  if (st->desc.kind != SMELT_CONV2D_FPROP)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": %s: bias is given; a bias is fused into fprop only",
                        kind_names[st->desc.kind]);
  char sh[160];
  if (bias->ndim != 1 || bias->shape[0] != st->k)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": bias.shape=%s must be [K]=[%lld]",
                        smelt__shape_str(bias, sh, sizeof sh), (long long)st->k);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- kernel choices */

static int pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

/* The iterator's preconditions (smelt/conv2d.h); AUTO takes the most
 * specialized one that holds. */
static smelt_status resolve_iterator(smelt__conv2d_state *st, smelt_dtype dt) {
  smelt_conv2d_desc *d = &st->desc;
  const int fprop = d->kind == SMELT_CONV2D_FPROP;
  const int fits16 = st->c <= 16 / (int64_t)smelt_dtype_size(dt); /* a tap's channels in one 16-byte access */
  const int unit = d->stride_h == 1 && d->stride_w == 1;
  const int optimized_ok = st->r <= 32 && st->s <= 32 && (d->kind != SMELT_CONV2D_DGRAD || unit);
  if (d->iterator == SMELT_CONV2D_ITER_AUTO)
    d->iterator = fprop && fits16 && pow2(st->c) ? SMELT_CONV2D_ITER_FIXED_CHANNELS
                  : fprop && fits16              ? SMELT_CONV2D_ITER_FEW_CHANNELS
                  : optimized_ok                      ? SMELT_CONV2D_ITER_OPTIMIZED
                                                      : SMELT_CONV2D_ITER_ANALYTIC;
  switch (d->iterator) {
    case SMELT_CONV2D_ITER_OPTIMIZED:
      if (!optimized_ok)
        return smelt__error(SMELT_STATUS_UNSUPPORTED,
                            OP ": %s: desc.iterator=optimized needs R, S <= 32%s (R=%lld, S=%lld, stride %dx%d); "
                            "analytic takes any problem",
                            kind_names[d->kind], d->kind == SMELT_CONV2D_DGRAD ? " and unit stride" : "",
                            (long long)st->r, (long long)st->s, d->stride_h, d->stride_w);
      break;
    case SMELT_CONV2D_ITER_FIXED_CHANNELS:
    case SMELT_CONV2D_ITER_FEW_CHANNELS: {
      const int fixed = d->iterator == SMELT_CONV2D_ITER_FIXED_CHANNELS;
      if (!fprop || !fits16 || (fixed && !pow2(st->c)))
        return smelt__error(SMELT_STATUS_UNSUPPORTED,
                            OP ": %s: desc.iterator=%s needs fprop with C x %zu bytes <= 16%s (C=%lld); analytic "
                            "takes any problem",
                            kind_names[d->kind], iter_names[d->iterator], smelt_dtype_size(dt),
                            fixed ? " and C a power of two" : "", (long long)st->c);
      break;
    }
    default: break;
  }
  return SMELT_OK;
}

/* The CPU reference and the CUDA reference kernel sum each output element
 * whole, so a choice left to smelt is one slice there; the CUDA implicit
 * GEMM picks its own split when auto_split says the choice is its. */
static void resolve_modes(smelt__conv2d_state *st) {
  smelt_conv2d_desc *d = &st->desc;
  if (d->stride_support == SMELT_CONV2D_STRIDE_AUTO)
    d->stride_support =
        d->stride_h == 1 && d->stride_w == 1 ? SMELT_CONV2D_STRIDE_UNITY : SMELT_CONV2D_STRIDE_STRIDED;
  st->auto_split = d->split_k_slices == 0 && d->split_k_mode == SMELT_CONV2D_SPLIT_K_AUTO;
  if (d->split_k_slices == 0) d->split_k_slices = 1;
  if (d->split_k_mode == SMELT_CONV2D_SPLIT_K_AUTO)
    d->split_k_mode = d->split_k_slices > 1 ? SMELT_CONV2D_SPLIT_K_PARALLEL : SMELT_CONV2D_SPLIT_K_SERIAL;
}

/* ---------------------------------------------------------------- the family */

static smelt_status check(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  smelt__conv2d_state *st = (smelt__conv2d_state *)plan->opdata;
  const smelt_conv2d_desc *d = &st->desc;
  const smelt_tensor *a = t[SMELT__CONV2D_A];
  smelt_status s;
  if ((s = check_desc(d))) return s;
  if (d->math == SMELT_GEMM_MATH_TF32 && a->dtype != SMELT_DTYPE_F32)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, OP ": desc.math=TF32 needs f32 A and B (%s.dtype=%s)",
                        role_what[d->kind][SMELT__CONV2D_A], smelt_dtype_name(a->dtype));
  st->has_c = d->epilogue.beta != 0.0;
  st->has_bias = t[SMELT__CONV2D_BIAS] != NULL;
  if ((s = resolve_shapes(st, t)) || (s = check_c_bias(st, t)) || (s = resolve_iterator(st, a->dtype))) return s;
  resolve_modes(st);
  snprintf(plan->describe, sizeof plan->describe, "conv2d %s %s->%s %lldx%lld s%dx%d d%dx%d, %s, %s, split-K %s x%d%s%s",
           kind_names[d->kind], smelt_dtype_name(a->dtype), smelt_dtype_name(t[SMELT__CONV2D_D]->dtype),
           (long long)st->r, (long long)st->s, d->stride_h, d->stride_w, d->dilation_h, d->dilation_w,
           iter_names[d->iterator], stride_names[d->stride_support], split_names[d->split_k_mode], d->split_k_slices,
           d->math == SMELT_GEMM_MATH_TF32 ? ", tf32" : "", plan->ctx->device == SMELT_DEVICE_CPU ? " (cpu reference)" : "");
  return SMELT_OK;
}

const smelt__family smelt__family_conv2d = {
    .name = "conv2d",
    .op = OP,
    .what = "a conv2d",
    .nroles = SMELT__CONV2D_ROLES,
    .roles = roles,
    .params_size = sizeof(smelt__conv2d_state),
    .check = check,
    .cpu = &smelt__cpu_conv2d,
    .cuda = &smelt__cuda_conv2d,
    .bound = smelt__bound_gemm,
};

smelt_status smelt_conv2d_plan(smelt_ctx *ctx, const smelt_conv2d_desc *desc, const smelt_tensor *a,
                               const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                               const smelt_tensor *bias, smelt_plan **out) {
  smelt__conv2d_state st;
  memset(&st, 0, sizeof st);
  st.desc = desc ? *desc : smelt_conv2d_desc_default();
  /* C is not read, so not checked, when beta is 0 (as in smelt_gemm). */
  const smelt_tensor *t[SMELT__CONV2D_ROLES] = {a, b, st.desc.epilogue.beta != 0.0 ? c : NULL, d, bias};
  return smelt__family_plan(&smelt__family_conv2d, ctx, &st, t, out);
}

smelt_status smelt_conv2d_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b, const smelt_tensor *c,
                              const smelt_tensor *d, const smelt_tensor *bias) {
  smelt_status s = smelt__check_plan(&smelt__family_conv2d, OP "_run", plan);
  if (s) return s;
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_tensor *t[SMELT__CONV2D_ROLES] = {a, b, st->has_c ? c : NULL, d, bias};
  return smelt__family_run(&smelt__family_conv2d, plan, t);
}

smelt_status smelt_conv2d(smelt_ctx *ctx, const smelt_conv2d_desc *desc, const smelt_tensor *a, const smelt_tensor *b,
                          const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias) {
  SMELT__ONE_SHOT(smelt_conv2d_plan(ctx, desc, a, b, c, d, bias, &plan), smelt_conv2d_run(plan, a, b, c, d, bias));
}
