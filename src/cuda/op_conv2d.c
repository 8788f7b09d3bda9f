/* smelt_conv2d on CUDA. The implicit GEMMs on the GEMM engine (Hopper's,
 * conv2d_sm90.c, then mma.sync's, conv2d_igemm.c) take the problems their
 * preconditions allow, the explicit im2col path (conv2d_explicit.c) the
 * other 16-bit ones it can read; the rest
 * run kernels/conv2d_direct.cu, the analytic reference path (one thread per
 * output element, f32 sums), one module per (kind, A's dtype, tf32), which
 * serves every description the core accepts: the iterator, stride support
 * and split-K are checked there and do not change what this kernel
 * computes (each element is summed whole, in one thread), so the plan says
 * which kernel runs rather than pretending to specialize. */
#include "conv2d_cuda.h"

#include <stdio.h>
#include <string.h>

/* The kernel's conv_params, field for field. */
typedef struct conv_kparams {
  uint64_t a, b, c, d, bias;
  int64_t a_s[4], b_s[4], c_s[4], d_s[4], bias_s;
  int64_t n, h, w, c_, k, r, s, p, q;
  int64_t total;
  int pad_h0, pad_w0, stride_h, stride_w, dil_h, dil_w;
  double alpha_ab, beta;
  float scale_d, slope;
  int dt_c, dt_d, dt_bias, act, clamp, has_c, has_bias, pad;
} conv_kparams;

_Static_assert(sizeof(conv_kparams) == 336, "conv_kparams must match conv2d_direct.cu's conv_params");

#define BLOCK 256

static const char *const kind_tags[SMELT_CONV2D_KIND_COUNT] = {"fprop", "dgrad", "wgrad"};
static const smelt_dtype cv_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* The one place a variant's source is made (plan and enumerator). */
static void make_src(smelt_conv2d_kind kind, smelt_dtype dt, int tf32, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "conv2d_direct_%s_%s", kind_tags[kind], tf32 ? "tf32" : smelt_dtype_name(dt));
  src->body = "conv2d_direct.cu";
  smelt__prelude_define(src, "SMELT_DT", dt);
  smelt__prelude_define(src, "GEMM_ACC", 1);
  smelt__prelude_define(src, "CONV_KIND", kind);
  smelt__prelude_define(src, "CONV_TF32", tf32);
}

int smelt__conv2d_variants(smelt__kernel_src *out, int max) {
  int n = smelt__conv2d_sm90_variants(out, max);
  n += smelt__conv2d_igemm_variants(max > n ? out + n : NULL, max > n ? max - n : 0);
  for (int kind = 0; kind < SMELT_CONV2D_KIND_COUNT; kind++) {
    for (size_t d = 0; d < sizeof cv_dtypes / sizeof *cv_dtypes; d++, n++)
      if (n < max) make_src((smelt_conv2d_kind)kind, cv_dtypes[d], 0, &out[n]);
    if (n < max) make_src((smelt_conv2d_kind)kind, SMELT_DTYPE_F32, 1, &out[n]);
    n++;
  }
  n += smelt__conv2d_explicit_variants(max > n ? out + n : NULL, max > n ? max - n : 0);
  return n;
}

static smelt_status plan_conv2d(smelt_plan *plan, const void *args) {
  const smelt_conv2d_desc *d = &((const smelt__conv2d_state *)plan->opdata)->desc;
  smelt__kernel_src src;
  make_src(d->kind, plan->t[SMELT__CONV2D_A].dtype, d->math == SMELT_GEMM_MATH_TF32, &src);
  CUfunction f;
  smelt_status s = smelt__cuda_function(plan->ctx, &src, "conv2d_direct", &f);
  if (s) return s;
  plan->func[SMELT__CONV_F_DIRECT] = f;
  plan->block = BLOCK;
  int taken;
  if ((s = smelt__conv2d_sm90_plan(plan, plan->t, &taken)) || taken) return s;
  if ((s = smelt__conv2d_igemm_plan(plan, plan->t, &taken)) || taken) return s;
  if ((s = smelt__conv2d_explicit_plan(plan, (const smelt_tensor *const *)args, &taken)) || taken) return s;
  char core[sizeof plan->describe];
  snprintf(core, sizeof core, "%s", plan->describe);
  snprintf(plan->describe, sizeof plan->describe, "%.32s (analytic reference): %.100s", src.name, core);
  return SMELT_OK;
}

static uint64_t ptr(const smelt_tensor *t) { return t ? (uint64_t)(uintptr_t)t->data : 0; }

static void strides4(int64_t *out, const smelt_tensor *t) {
  for (int i = 0; i < 4; i++) out[i] = t ? t->strides[i] : 0;
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt__conv2d_state *st = (const smelt__conv2d_state *)plan->opdata;
  const smelt_conv2d_desc *d = &st->desc;
  const smelt_gemm_epilogue *e = &d->epilogue;
  const smelt_tensor *c = t[SMELT__CONV2D_C], *dd = t[SMELT__CONV2D_D], *bias = t[SMELT__CONV2D_BIAS];
  if (plan->func[SMELT__CONV_F_IM2COL]) {
    smelt__nvtx_push("smelt_conv2d");
    smelt_status s = smelt__conv2d_explicit_run(plan, t);
    smelt__nvtx_pop();
    return s;
  }
  if (plan->backend) {
    int ran;
    smelt__nvtx_push("smelt_conv2d");
    smelt_status s = plan->func[SMELT__CONV_F_SM90] ? smelt__conv2d_sm90_run(plan, t, &ran)
                                                     : smelt__conv2d_igemm_run(plan, t, &ran);
    smelt__nvtx_pop();
    if (s || ran) return s;
  }
  conv_kparams P;
  memset(&P, 0, sizeof P);
  P.a = ptr(t[SMELT__CONV2D_A]);
  P.b = ptr(t[SMELT__CONV2D_B]);
  P.c = ptr(c);
  P.d = ptr(dd);
  P.bias = ptr(bias);
  strides4(P.a_s, t[SMELT__CONV2D_A]);
  strides4(P.b_s, t[SMELT__CONV2D_B]);
  strides4(P.c_s, c);
  strides4(P.d_s, dd);
  P.bias_s = bias ? bias->strides[0] : 0;
  P.n = st->n, P.h = st->h, P.w = st->w, P.c_ = st->c, P.k = st->k, P.r = st->r, P.s = st->s, P.p = st->p,
  P.q = st->q;
  P.total = smelt_tensor_numel(dd);
  P.pad_h0 = d->pad_h0, P.pad_w0 = d->pad_w0;
  P.stride_h = d->stride_h, P.stride_w = d->stride_w;
  P.dil_h = d->dilation_h, P.dil_w = d->dilation_w;
  P.alpha_ab = e->alpha * (double)e->scale_a * (double)e->scale_b;
  P.beta = e->beta;
  P.scale_d = e->scale_d;
  P.slope = e->slope;
  P.dt_c = c ? (int)c->dtype : 0;
  P.dt_d = (int)dd->dtype;
  P.dt_bias = bias ? (int)bias->dtype : 0;
  P.act = (int)e->act;
  P.clamp = e->clamp;
  P.has_c = st->has_c;
  P.has_bias = st->has_bias;
  const int64_t blocks = smelt__ceil_div(P.total, BLOCK);
  const unsigned grid = (unsigned)(blocks > 0x7fffffff ? 0x7fffffff : blocks);
  void *params[] = {&P};
  smelt__nvtx_push("smelt_conv2d");
  smelt_status s = smelt__cuda_launch(plan->ctx, "smelt_conv2d", (CUfunction)plan->func[SMELT__CONV_F_DIRECT], grid, 1, 1, BLOCK, 0,
                                      params);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_conv2d = {.plan = plan_conv2d, .run = run};
