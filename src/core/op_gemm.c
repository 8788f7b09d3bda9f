/* smelt_gemm: validation, plan/run and the one-shot calls for every mode.
 *
 * Everything that can be checked without touching memory is checked here,
 * before a backend sees the operation, so a failed call writes nothing. The
 * description is resolved once (mode, split-K, accumulator) into the plan's
 * smelt__gemm_state; operands are resolved to (pointer, row stride, column
 * stride, batch stride), which is all the CPU reference and the kernels use. */
#include "error_bound.h"
#include "gemm_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_gemm"

smelt_gemm_desc smelt_gemm_desc_default(void) {
  smelt_gemm_desc d;
  memset(&d, 0, sizeof d);
  d.epilogue.alpha = 1.0;
  d.epilogue.beta = 0.0;
  d.epilogue.act = SMELT_ACT_IDENTITY;
  d.epilogue.slope = 0.01f;
  d.epilogue.scale_a = d.epilogue.scale_b = d.epilogue.scale_d = 1.0f;
  return d;
}

/* ---------------------------------------------------------------- the description */

static const char *const mode_names[SMELT_GEMM_MODE_COUNT] = {"AUTO",  "PLAIN", "SPLIT_K_SERIAL", "SPLIT_K_PARALLEL",
                                                              "BATCHED", "ARRAY", "GROUPED", "GROUPED_OFFS"};

static smelt_status check_range(const char *field, int v, int lo, int hi, const char *what) {
  if (v < lo || v > hi)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.%s=%d is not %s (%d..%d)", field, v, what, lo, hi);
  return SMELT_OK;
}

static smelt_status check_finite(const char *field, double v) {
  if (!isfinite(v))
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.epilogue.%s=%g must be finite", field, v);
  return SMELT_OK;
}

static smelt_status check_desc(const smelt_gemm_desc *d) {
  smelt_status s;
  const smelt_gemm_tile *t = &d->tile;
  const smelt_gemm_epilogue *e = &d->epilogue;
  if ((s = check_range("math.opclass", (int)d->math.opclass, 0, SMELT_GEMM_OPCLASS_COUNT - 1, "a smelt_gemm_opclass")) ||
      (s = check_range("math.op", (int)d->math.op, 0, SMELT_GEMM_MATH_COUNT - 1, "a smelt_gemm_math_op")) ||
      (s = check_range("math.acc", (int)d->math.acc, 0, SMELT_GEMM_ACC_COUNT - 1, "a smelt_gemm_acc")) ||
      (s = check_range("mode", (int)d->mode, 0, SMELT_GEMM_MODE_COUNT - 1, "a smelt_gemm_mode")) ||
      (s = check_range("split_k", d->split_k, 0, SMELT_GEMM_MAX_SPLIT_K, "a slice count")) ||
      (s = check_range("scales", (int)d->scales, 0, SMELT_GEMM_SCALES_COUNT - 1, "a smelt_gemm_scale_kind")) ||
      (s = check_range("tile.m", t->m, 0, 1024, "a tile size")) ||
      (s = check_range("tile.n", t->n, 0, 1024, "a tile size")) ||
      (s = check_range("tile.k", t->k, 0, 1024, "a tile size")) ||
      (s = check_range("tile.stages", t->stages, 0, 16, "a stage count")) ||
      (s = check_range("tile.warps_m", t->warps_m, 0, 16, "a warp count")) ||
      (s = check_range("tile.warps_n", t->warps_n, 0, 16, "a warp count")) ||
      (s = check_range("tile.cluster_m", t->cluster_m, 0, 16, "a cluster size")) ||
      (s = check_range("tile.cluster_n", t->cluster_n, 0, 16, "a cluster size")) ||
      (s = check_range("tile.swizzle", t->swizzle, 0, 1024, "a band height in tiles")) ||
      (s = check_range("epilogue.act", (int)e->act, 0, SMELT_ACT_COUNT - 1, "a smelt_act")) ||
      (s = check_finite("alpha", e->alpha)) || (s = check_finite("beta", e->beta)) ||
      (s = check_finite("slope", e->slope)) || (s = check_finite("scale_a", e->scale_a)) ||
      (s = check_finite("scale_b", e->scale_b)) || (s = check_finite("scale_d", e->scale_d)))
    return s;
  /* Clusters exist along one axis, of 2 or 4 CTAs (the Hopper kernels
   * with TMA multicast; the CUDA selector says which tiles have which). */
  const int cm = t->cluster_m > 1 ? t->cluster_m : 1, cn = t->cluster_n > 1 ? t->cluster_n : 1;
  if ((cm > 1 && cn > 1) || (cm != 1 && cm != 2 && cm != 4) || (cn != 1 && cn != 2 && cn != 4))
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": desc.tile.cluster=%dx%d is not available (supported: 1x1, 2x1, 1x2, 1x4)", t->cluster_m,
                        t->cluster_n);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- dtypes */

static const smelt_dtype in_types[] = {SMELT_DTYPE_F64,  SMELT_DTYPE_F32,  SMELT_DTYPE_F16, SMELT_DTYPE_BF16,
                                       SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2, SMELT_DTYPE_I8};
static const smelt_dtype out_types[] = {SMELT_DTYPE_F64,  SMELT_DTYPE_F32,  SMELT_DTYPE_F16, SMELT_DTYPE_BF16,
                                        SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2, SMELT_DTYPE_I8,  SMELT_DTYPE_I32};
static const smelt_dtype bias_types[] = {SMELT_DTYPE_F64, SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16,
                                         SMELT_DTYPE_I32};
#define NELEM(a) ((int)(sizeof(a) / sizeof *(a)))
static const smelt_dtype offs_types[] = {SMELT_DTYPE_I32, SMELT_DTYPE_I64};
static const smelt_dtype scale_types[] = {SMELT_DTYPE_F32};
/* The planned views a run is checked against, by role (C only when the
 * plan's beta is not 0; offs only grouped by offsets; the scale vectors
 * only when planned with them). D may be C exactly. */
enum { R_A, R_B, R_C, R_D, R_BIAS, R_OFFS, R_SA, R_SB, R_COUNT };
static const smelt__role roles[R_COUNT] = {
    [R_A] = {"A", 0, in_types, NELEM(in_types), 0},
    [R_B] = {"B", 0, in_types, NELEM(in_types), 0},
    [R_C] = {"C", SMELT__ROLE_OPTIONAL, out_types, NELEM(out_types), 0},
    [R_D] = {"D", SMELT__ROLE_OUTPUT | SMELT__ROLE_IN_PLACE, out_types, NELEM(out_types), R_C},
    [R_BIAS] = {"bias", SMELT__ROLE_OPTIONAL, bias_types, NELEM(bias_types), 0},
    [R_OFFS] = {"offs", SMELT__ROLE_OPTIONAL, offs_types, NELEM(offs_types), 0},
    [R_SA] = {"scales->a", SMELT__ROLE_OPTIONAL, scale_types, NELEM(scale_types), 0},
    [R_SB] = {"scales->b", SMELT__ROLE_OPTIONAL, scale_types, NELEM(scale_types), 0},
};

const smelt__family smelt__family_gemm = {
    .name = "gemm",
    .op = OP,
    .what = "a GEMM",
    .nroles = R_COUNT,
    .roles = roles,
    .cpu = &smelt__cpu_gemm,
    .cuda = &smelt__cuda_gemm,
    .bound = smelt__bound_gemm,
};

static const char *const acc_names[SMELT_GEMM_ACC_COUNT] = {"auto", "f32", "f16", "f64", "i32"};

/* The accumulator and math op the dtypes of A and B allow. */
static smelt_status resolve_types(const smelt_gemm_desc *d, smelt_dtype da, smelt_dtype db, smelt_gemm_acc *acc) {
  const int a64 = da == SMELT_DTYPE_F64, b64 = db == SMELT_DTYPE_F64;
  const int a8 = da == SMELT_DTYPE_I8, b8 = db == SMELT_DTYPE_I8;
  if (a64 != b64 || a8 != b8)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH,
                        OP ": A.dtype=%s and B.dtype=%s do not combine (f64 pairs with f64, i8 with i8; f32, f16, "
                        "bf16, e4m3 and e5m2 mix freely)",
                        smelt_dtype_name(da), smelt_dtype_name(db));
  smelt_gemm_acc natural = a64 ? SMELT_GEMM_ACC_F64 : a8 ? SMELT_GEMM_ACC_I32 : SMELT_GEMM_ACC_F32;
  smelt_gemm_acc want = d->math.acc == SMELT_GEMM_ACC_AUTO ? natural : d->math.acc;
  int ok = want == natural || (want == SMELT_GEMM_ACC_F16 && da == SMELT_DTYPE_F16 && db == SMELT_DTYPE_F16);
  if (!ok)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH,
                        OP ": desc.math.acc=%s does not fit A.dtype=%s x B.dtype=%s (supported: %s%s)",
                        acc_names[want], smelt_dtype_name(da), smelt_dtype_name(db), acc_names[natural],
                        da == SMELT_DTYPE_F16 && db == SMELT_DTYPE_F16 ? ", f16" : "");
  if (d->math.op != SMELT_GEMM_MATH_DEFAULT && (da != SMELT_DTYPE_F32 || db != SMELT_DTYPE_F32 || want != SMELT_GEMM_ACC_F32))
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH,
                        OP ": desc.math.op=%s needs f32 A and B with an f32 accumulator (got %s x %s, acc %s)",
                        d->math.op == SMELT_GEMM_MATH_TF32 ? "TF32" : "3XTF32", smelt_dtype_name(da),
                        smelt_dtype_name(db), acc_names[want]);
  *acc = want;
  return SMELT_OK;
}

/* ---------------------------------------------------------------- operands */

/* Checks t (validated already) is [rows, cols] (with a leading batch dim when
 * batch >= 0) and resolves it. The message names the dims by letter. */
static smelt_status to_mat(const char *op, const char *name, const smelt_tensor *t, int64_t batch, int64_t rows,
                           int64_t cols, const char *rn, const char *cn, smelt__gemm_mat *m) {
  const int nd = batch >= 0 ? 3 : 2, o = nd - 2;
  if (t->ndim != nd)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.ndim=%d must be %d (%s[%s%s, %s])", op, name, t->ndim,
                        nd, name, batch >= 0 ? "L, " : "", rn, cn);
  if (batch >= 0 && t->shape[0] != batch)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape[0]=%lld must equal the batch L=%lld", op, name,
                        (long long)t->shape[0], (long long)batch);
  if (t->shape[o] != rows)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape[%d]=%lld must equal %s=%lld", op, name, o,
                        (long long)t->shape[o], rn, (long long)rows);
  if (t->shape[o + 1] != cols)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape[%d]=%lld must equal %s=%lld", op, name, o + 1,
                        (long long)t->shape[o + 1], cn, (long long)cols);
  m->data = t->data;
  m->bs = batch >= 0 ? t->strides[0] : 0;
  m->rs = t->strides[o];
  m->cs = t->strides[o + 1];
  return SMELT_OK;
}

/* Outputs share no memory with inputs (D may be C exactly). The byte-range
 * test is conservative: interleaved views of one buffer count as
 * overlapping. */
static smelt_status check_disjoint(const char *op, const smelt_tensor *d, const smelt_tensor *a,
                                   const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *bias,
                                   const smelt_tensor *offs) {
  const smelt_tensor *t[R_COUNT] = {a, b, c, d, bias, offs, NULL, NULL};
  return smelt__check_roles_disjoint(&smelt__family_gemm, op, t);
}

static smelt_status check_one(const char *op, int role, const char *name, const smelt_tensor *t,
                              const smelt_ctx *ctx) {
  smelt__role r = roles[role];
  if (name) r.name = name;
  return smelt__check_role(op, &r, t, ctx);
}

/* Validates one problem's tensors and resolves them. batch < 0: 2-D
 * operands; else 3-D with that leading size. c is used only when has_c.
 * templates: a, b, c, d only describe memory (array mode), so whether they
 * overlap means nothing. */
static smelt_status resolve_prob(const char *op, const smelt_ctx *ctx, int64_t batch, const smelt_tensor *a,
                                 const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                 const smelt_tensor *bias, int has_c, int templates, smelt__gemm_prob *p) {
  smelt_status s;
  if (!a || !b || !d)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL", op, !a ? "A" : !b ? "B" : "D");
  if ((s = check_one(op, R_A, NULL, a, ctx)) || (s = check_one(op, R_B, NULL, b, ctx)) ||
      (s = check_one(op, R_D, NULL, d, ctx)) || (has_c && (s = check_one(op, R_C, NULL, c, ctx))) ||
      (bias && (s = check_one(op, R_BIAS, NULL, bias, ctx))))
    return s;
  memset(p, 0, sizeof *p);
  const int nd = batch >= 0 ? 3 : 2;
  if (a->ndim != nd)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: A.ndim=%d must be %d (A[%sM, K])", op, a->ndim, nd,
                        batch >= 0 ? "L, " : "");
  if (batch >= 0) batch = a->shape[0];
  p->m = a->shape[nd - 2];
  p->k = a->shape[nd - 1];
  if (b->ndim == nd) p->n = b->shape[nd - 1];
  if ((s = to_mat(op, "A", a, batch, p->m, p->k, "M", "K", &p->a)) ||
      (s = to_mat(op, "B", b, batch, p->k, b->ndim == nd ? b->shape[nd - 1] : 0, "K", "N", &p->b)) ||
      (s = to_mat(op, "D", d, batch, p->m, p->n, "M", "N", &p->d)) ||
      (has_c && (s = to_mat(op, "C", c, batch, p->m, p->n, "M", "N", &p->c))))
    return s;
  if (bias) {
    if (bias->ndim != 1 || bias->shape[0] != p->n) {
      char sh[160];
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: bias.shape=%s must be [N]=[%lld]", op,
                          smelt__shape_str(bias, sh, sizeof sh), (long long)p->n);
    }
    p->bias = bias->data;
    p->bias_s = bias->strides[0];
  }
  if ((s = smelt__check_output(op, "D", d)) ||
      (!templates && (s = check_disjoint(op, d, a, b, has_c ? c : NULL, bias, NULL))))
    return s;
  return SMELT_OK;
}

/* The scale vectors (smelt_gemm_scales; may be NULL) for a problem of
 * `rows` x `cols` (M x N; grouped by offsets, T x N with groups >= 0: b is
 * then [G, N]), checked and resolved into p. */
static smelt_status resolve_scales(const char *op, const smelt_ctx *ctx, const smelt_gemm_scales *sc,
                                   const smelt_tensor *d, int64_t groups, smelt__gemm_prob *p) {
  const smelt_tensor *sa = sc ? sc->a : NULL, *sb = sc ? sc->b : NULL;
  smelt_status s;
  char sh[160];
  const char *rn = groups >= 0 ? "T" : "M";
  if (sa) {
    if ((s = check_one(op, R_SA, NULL, sa, ctx))) return s;
    if (!((sa->ndim == 1 && sa->shape[0] == p->m) || (sa->ndim == 2 && sa->shape[0] == p->m && sa->shape[1] == 1)))
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: scales->a.shape=%s must be [%s]=[%lld] or [%s, 1]", op,
                          smelt__shape_str(sa, sh, sizeof sh), rn, (long long)p->m, rn);
    if ((s = smelt__check_disjoint(op, "D", d, "scales->a", sa, 0))) return s;
    p->sa = (const float *)sa->data;
    p->sa_s = sa->strides[0];
  }
  if (sb) {
    if ((s = check_one(op, R_SB, NULL, sb, ctx))) return s;
    if (groups >= 0) {
      if (sb->ndim != 2 || sb->shape[0] != groups || sb->shape[1] != p->n)
        return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: scales->b.shape=%s must be [G, N]=[%lld, %lld]", op,
                            smelt__shape_str(sb, sh, sizeof sh), (long long)groups, (long long)p->n);
    } else if (!((sb->ndim == 1 && sb->shape[0] == p->n) ||
                 (sb->ndim == 2 && sb->shape[0] == 1 && sb->shape[1] == p->n))) {
      return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: scales->b.shape=%s must be [N]=[%lld] or [1, N]", op,
                          smelt__shape_str(sb, sh, sizeof sh), (long long)p->n);
    }
    if ((s = smelt__check_disjoint(op, "D", d, "scales->b", sb, 0))) return s;
    p->sb = (const float *)sb->data;
    p->sb_s = sb->strides[sb->ndim - 1];
    p->sb_gs = groups >= 0 ? sb->strides[0] : 0;
  }
  return SMELT_OK;
}

/* Block scales (desc.scales BLOCK) for problem p of A and B types da, db:
 * a [M, KB] and b [NB, KB], with a leading batch dim of its size where
 * a_batch, b_batch >= 0 (batched: both L; grouped by offsets: a [T, KB]
 * per row of the stacked A, b [G, NB, KB]); both required, checked and
 * resolved into p (b's batch stride also as sb_gs, the groups' stride). */
static smelt_status resolve_block_scales(const char *op, const smelt_ctx *ctx, const smelt_gemm_scales *sc,
                                         const smelt_tensor *d, int64_t a_batch, int64_t b_batch, smelt_dtype da,
                                         smelt_dtype db, smelt__gemm_prob *p) {
  const int f8a = da == SMELT_DTYPE_E4M3 || da == SMELT_DTYPE_E5M2;
  const int f8b = db == SMELT_DTYPE_E4M3 || db == SMELT_DTYPE_E5M2;
  if (!f8a || !f8b)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH,
                        "%s: block scales need fp8 A and B (e4m3 or e5m2; got A.dtype=%s, B.dtype=%s)", op,
                        smelt_dtype_name(da), smelt_dtype_name(db));
  if (!sc->a || !sc->b)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: block scales need both scales->a and scales->b (%s is NULL)",
                        op, !sc->a ? "scales->a" : "scales->b");
  const int64_t kb = smelt__ceil_div(p->k, 128), nb = smelt__ceil_div(p->n, 128);
  smelt__gemm_mat ma, mb;
  smelt_status s;
  if ((s = check_one(op, R_SA, NULL, sc->a, ctx)) || (s = check_one(op, R_SB, NULL, sc->b, ctx)) ||
      (s = to_mat(op, "scales->a", sc->a, a_batch, p->m, kb, b_batch >= 0 && a_batch < 0 ? "T" : "M", "ceil(K/128)",
                  &ma)) ||
      (s = to_mat(op, "scales->b", sc->b, b_batch, nb, kb, "ceil(N/128)", "ceil(K/128)", &mb)) ||
      (s = smelt__check_disjoint(op, "D", d, "scales->a", sc->a, 0)) ||
      (s = smelt__check_disjoint(op, "D", d, "scales->b", sc->b, 0)))
    return s;
  p->sa = (const float *)ma.data;
  p->sa_s = ma.rs;
  p->sa_ks = ma.cs;
  p->sa_bs = ma.bs;
  p->sb = (const float *)mb.data;
  p->sb_s = mb.rs;
  p->sb_ks = mb.cs;
  p->sb_bs = p->sb_gs = mb.bs;
  return SMELT_OK;
}

/* ---------------------------------------------------------------- plans */

static void state_free(void *p) { free(p); }

/* The checks every entry point shares: ctx, out, desc, C vs beta. */
static smelt_status begin(const char *op, smelt_ctx *ctx, const smelt_gemm_desc *desc, smelt_plan **out,
                          smelt_gemm_desc *d) {
  if (!out) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: out is NULL", op);
  *out = NULL;
  if (!ctx) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: ctx is NULL", op);
  *d = desc ? *desc : smelt_gemm_desc_default();
  return check_desc(d);
}

/* begin() for the entry points of one mode (array, grouped, grouped by
 * offsets): desc.mode is AUTO or that mode, and split-K is not asked for. */
static smelt_status begin_family(const char *op, smelt_ctx *ctx, const smelt_gemm_desc *desc, smelt_plan **out,
                                 smelt_gemm_desc *d, smelt_gemm_mode mode) {
  smelt_status s = begin(op, ctx, desc, out, d);
  if (s) return s;
  if (d->epilogue.graph)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: desc.epilogue.graph serves plain GEMMs only (smelt_gemm_epi_plan)",
                        op);
  if (d->mode != SMELT_GEMM_MODE_AUTO && d->mode != mode)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc.mode=%s must be AUTO or %s", op, mode_names[d->mode],
                        mode_names[mode]);
  if (d->split_k > 1)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: desc.split_k=%d: split-K serves plain GEMMs only", op,
                        d->split_k);
  if (d->scales == SMELT_GEMM_SCALES_BLOCK && mode != SMELT_GEMM_MODE_GROUPED_OFFS)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        "%s: desc.scales=BLOCK serves plain, batched and grouped-by-offsets GEMMs (the scaled calls)",
                        op);
  return SMELT_OK;
}

/* The entry points of the modes smelt_gemm_plan does not take. */
static const char *family_of(smelt_gemm_mode mode) {
  return mode == SMELT_GEMM_MODE_ARRAY ? "array" : mode == SMELT_GEMM_MODE_GROUPED ? "grouped" : "grouped_offs";
}

static smelt_status need_c(const char *op, const smelt_gemm_desc *d, const void *c) {
  if (d->epilogue.beta != 0.0 && !c)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: C is NULL but desc.epilogue.beta=%g is not 0", op,
                        d->epilogue.beta);
  return SMELT_OK;
}

/* The planned views a run is checked against (absent: ndim -1). */
static void keep_tensors(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b, const smelt_tensor *c,
                         const smelt_tensor *d, const smelt_tensor *bias, const smelt_tensor *offs,
                         const smelt_gemm_scales *sc) {
  const smelt_tensor *t[R_COUNT] = {a, b, c, d, bias, offs, sc ? sc->a : NULL, sc ? sc->b : NULL};
  for (int r = 0; r < R_COUNT; r++)
    if (t[r]) plan->t[r] = *t[r];
}

/* Makes the plan around a resolved state and lets the backend pick. */
static smelt_status finish(smelt_ctx *ctx, smelt__gemm_state *st, const smelt__gemm_args *args, smelt_plan **out) {
  char describe[160];
  snprintf(describe, sizeof describe, "gemm %s %s x %s -> %s acc %s (cpu reference)", mode_names[st->mode],
           smelt_dtype_name(st->dt_a), smelt_dtype_name(st->dt_b), smelt_dtype_name(st->dt_d), acc_names[st->acc]);
  return smelt__family_plan_state(&smelt__family_gemm, ctx, st, state_free, describe, args, out);
}

static smelt_status new_state(const smelt_gemm_desc *d, const smelt_tensor *a, const smelt_tensor *b,
                              const smelt_tensor *c, const smelt_tensor *dd, const smelt_tensor *bias,
                              smelt__gemm_state **out) {
  smelt_gemm_acc acc;
  smelt_status s = resolve_types(d, a->dtype, b->dtype, &acc);
  if (s) return s;
  smelt__gemm_state *st = (smelt__gemm_state *)calloc(1, sizeof *st);
  if (!st) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  st->desc = *d;
  st->acc = acc;
  st->dt_a = a->dtype;
  st->dt_b = b->dtype;
  st->dt_d = dd->dtype;
  st->has_c = d->epilogue.beta != 0.0;
  st->dt_c = st->has_c ? c->dtype : dd->dtype;
  st->has_bias = bias != NULL;
  st->dt_bias = bias ? bias->dtype : SMELT_DTYPE_F32;
  if (d->epilogue.graph) {
    st->has_graph = 1;
    st->graph = *d->epilogue.graph;
    st->desc.epilogue.graph = &st->graph;
  }
  *out = st;
  return SMELT_OK;
}

/* A graph (desc.epilogue.graph) against the description: a plain GEMM of
 * 2-D operands that fits the graph's C and BIAS nodes. */
static smelt_status check_graph_desc(const smelt_gemm_desc *d, const smelt_tensor *a, const smelt_tensor *bias) {
  if (!d->epilogue.graph) return SMELT_OK;
  if ((d->mode != SMELT_GEMM_MODE_AUTO && d->mode != SMELT_GEMM_MODE_PLAIN) || d->split_k > 1 || a->ndim != 2)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": desc.epilogue.graph serves plain GEMMs only (2-D operands, mode AUTO or PLAIN, split_k "
                        "0 or 1; got mode %s, split_k %d, A.ndim %d)",
                        mode_names[d->mode], d->split_k, a->ndim);
  return smelt__epi_check_desc(OP, d->epilogue.graph, d, bias != NULL);
}

smelt_status smelt_gemm_epi_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                 const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                 const smelt_tensor *bias, const smelt_gemm_scales *scales, const smelt_epi_tensors *epi,
                                 smelt_plan **out) {
  smelt_gemm_desc dd;
  smelt_status s = begin(OP, ctx, desc, out, &dd);
  if (s || (s = need_c(OP, &dd, c))) return s;
  if (!a) return smelt__error(SMELT_STATUS_NULL_POINTER, OP ": A is NULL");
  if ((s = smelt__check_tensor(OP, "A", a)) || (s = check_graph_desc(&dd, a, bias))) return s;
  if (!dd.epilogue.graph && epi && epi->count)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": epi has tensors but desc.epilogue.graph is NULL");
  smelt_gemm_mode mode = dd.mode;
  if (mode == SMELT_GEMM_MODE_ARRAY || mode == SMELT_GEMM_MODE_GROUPED || mode == SMELT_GEMM_MODE_GROUPED_OFFS)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, OP ": desc.mode=%s belongs to smelt_gemm_%s_plan",
                        mode_names[mode], family_of(mode));
  if (mode == SMELT_GEMM_MODE_AUTO) {
    if (a->ndim == 3) mode = SMELT_GEMM_MODE_BATCHED;
    else if (dd.split_k > 1) mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
    else mode = SMELT_GEMM_MODE_PLAIN;
  }
  const int batched = mode == SMELT_GEMM_MODE_BATCHED;
  if (batched && a->ndim != 3)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": desc.mode=BATCHED needs 3-D operands (A.ndim=%d)", a->ndim);
  if (!batched && a->ndim != 2)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, OP ": A.ndim=%d must be 2 (A[M, K]), or 3 for a batched GEMM",
                        a->ndim);
  const int split = mode == SMELT_GEMM_MODE_SPLIT_K_SERIAL || mode == SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
  if (!split && dd.split_k > 1)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": desc.split_k=%d needs mode SPLIT_K_SERIAL, SPLIT_K_PARALLEL or AUTO (mode is %s)",
                        dd.split_k, mode_names[mode]);
  const int blk = dd.scales == SMELT_GEMM_SCALES_BLOCK;
  if (blk && split)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": block scales serve plain and batched GEMMs (mode is %s, split_k %d)", mode_names[mode],
                        dd.split_k);
  if (blk && dd.epilogue.graph)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": block scales take the fixed epilogue, not an epilogue graph");
  const smelt_gemm_scales block_sc = scales ? *scales : (smelt_gemm_scales){NULL, NULL};
  smelt__gemm_args args;
  memset(&args, 0, sizeof args);
  const int has_c = dd.epilogue.beta != 0.0;
  const smelt_tensor *const operands[] = {a, b, has_c ? c : NULL, d, bias, scales ? scales->a : NULL,
                                           scales ? scales->b : NULL};
  smelt_tensor planned[SMELT_EPI_MAX_TENSORS];
  if ((s = resolve_prob(OP, ctx, batched ? a->shape[0] : -1, a, b, c, d, bias, has_c, 0, &args.prob)) ||
      (s = blk ? resolve_block_scales(OP, ctx, &block_sc, d, batched ? a->shape[0] : -1, batched ? a->shape[0] : -1,
                                      a->dtype, b->dtype, &args.prob)
               : resolve_scales(OP, ctx, scales, d, -1, &args.prob)) ||
      (dd.epilogue.graph && (s = smelt__epi_resolve(OP, ctx, dd.epilogue.graph, epi, operands, 7, &args.prob, planned))))
    return s;
  args.count = batched ? a->shape[0] : 1;
  smelt__gemm_state *st;
  if ((s = new_state(&dd, a, b, c, d, bias, &st))) return s;
  if (st->has_graph) memcpy(st->epi_t, planned, sizeof planned);
  st->has_sa = args.prob.sa != NULL;
  st->has_sb = args.prob.sb != NULL;
  st->blk = blk;
  st->mode = mode;
  /* 0 slices in AUTO (no explicit split) or a split mode: the backend
   * chooses; block scales never split. */
  st->split_k = dd.split_k ? dd.split_k : (split || dd.mode == SMELT_GEMM_MODE_AUTO) && !batched && !blk ? 0 : 1;
  if ((ctx->device == SMELT_DEVICE_CPU || st->has_graph) && st->split_k == 0) st->split_k = 1;
  st->count = args.count;
  st->prob = args.prob;
  smelt_plan *plan;
  if ((s = finish(ctx, st, &args, &plan))) return s;
  keep_tensors(plan, a, b, has_c ? c : NULL, d, bias, NULL, scales);
  *out = plan;
  return SMELT_OK;
}

smelt_status smelt_gemm_scaled_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                    const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                    const smelt_tensor *bias, const smelt_gemm_scales *scales, smelt_plan **out) {
  return smelt_gemm_epi_plan(ctx, desc, a, b, c, d, bias, scales, NULL, out);
}

smelt_status smelt_gemm_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                             const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                             const smelt_tensor *bias, smelt_plan **out) {
  return smelt_gemm_scaled_plan(ctx, desc, a, b, c, d, bias, NULL, out);
}

static smelt_status check_plan(const char *op, const smelt_plan *plan) {
  return smelt__check_plan(&smelt__family_gemm, op, plan);
}

static smelt_status check_bias_presence(const char *op, const smelt__gemm_state *st, const void *bias) {
  if (bias && !st->has_bias)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: bias is given but the plan was made without one", op);
  if (!bias && st->has_bias)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: bias is NULL but the plan was made with one", op);
  return SMELT_OK;
}

/* The planned problem with a run's pointers (plain and grouped by offsets). */
static smelt__gemm_args bound_args(const smelt__gemm_state *st, const smelt_tensor *a, const smelt_tensor *b,
                                   const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias,
                                   const smelt_gemm_scales *sc) {
  smelt__gemm_args args;
  memset(&args, 0, sizeof args);
  args.prob = st->prob;
  args.count = st->count;
  args.prob.a.data = a->data;
  args.prob.b.data = b->data;
  args.prob.c.data = st->has_c ? c->data : NULL;
  args.prob.d.data = d->data;
  args.prob.bias = bias ? bias->data : NULL;
  args.prob.sa = st->has_sa ? (const float *)sc->a->data : NULL;
  args.prob.sb = st->has_sb ? (const float *)sc->b->data : NULL;
  return args;
}

/* A run of the plain and grouped-by-offsets modes: every tensor as planned. */
static smelt_status check_run(const char *op, const smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b,
                              const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias,
                              const smelt_tensor *offs, const smelt_gemm_scales *sc) {
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  if (st->has_c && !c)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: C is NULL but the plan's beta=%g is not 0", op,
                        st->desc.epilogue.beta);
  const smelt_tensor *t[R_COUNT] = {a, b, st->has_c ? c : NULL, d, bias, offs, sc ? sc->a : NULL, sc ? sc->b : NULL};
  smelt_status s = smelt__check_views(&smelt__family_gemm, op, plan->t, t);
  return s ? s : smelt__check_roles_disjoint(&smelt__family_gemm, op, t);
}

smelt_status smelt_gemm_epi_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b, const smelt_tensor *c,
                                const smelt_tensor *d, const smelt_tensor *bias, const smelt_gemm_scales *scales,
                                const smelt_epi_tensors *epi) {
  const char *op = OP "_run";
  smelt_status s = check_plan(op, plan);
  if (s) return s;
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  if (st->mode == SMELT_GEMM_MODE_ARRAY || st->mode == SMELT_GEMM_MODE_GROUPED ||
      st->mode == SMELT_GEMM_MODE_GROUPED_OFFS)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: the plan is a %s plan; use smelt_gemm_%s_run", op,
                        mode_names[st->mode], family_of(st->mode));
  if ((s = check_run(op, plan, a, b, c, d, bias, NULL, scales))) return s;
  smelt__gemm_args args = bound_args(st, a, b, c, d, bias, scales);
  if (st->has_graph) {
    const smelt_tensor *const operands[] = {a, b, st->has_c ? c : NULL, d, bias, st->has_sa ? scales->a : NULL,
                                             st->has_sb ? scales->b : NULL};
    if ((s = smelt__epi_check_run(op, &st->graph, st->epi_t, epi, operands, 7, &args.prob))) return s;
  } else if (epi && epi->count) {
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: epi has tensors but the plan has no graph", op);
  }
  return smelt__plan_dispatch(plan, &args);
}

smelt_status smelt_gemm_scaled_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b,
                                   const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias,
                                   const smelt_gemm_scales *scales) {
  return smelt_gemm_epi_run(plan, a, b, c, d, bias, scales, NULL);
}

smelt_status smelt_gemm_epi(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a, const smelt_tensor *b,
                            const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias,
                            const smelt_gemm_scales *scales, const smelt_epi_tensors *epi) {
  SMELT__ONE_SHOT(smelt_gemm_epi_plan(ctx, desc, a, b, c, d, bias, scales, epi, &plan),
                  smelt_gemm_epi_run(plan, a, b, c, d, bias, scales, epi));
}

smelt_status smelt_gemm_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b, const smelt_tensor *c,
                            const smelt_tensor *d, const smelt_tensor *bias) {
  return smelt_gemm_scaled_run(plan, a, b, c, d, bias, NULL);
}

smelt_status smelt_gemm_scaled(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                               const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                               const smelt_tensor *bias, const smelt_gemm_scales *scales) {
  SMELT__ONE_SHOT(smelt_gemm_scaled_plan(ctx, desc, a, b, c, d, bias, scales, &plan),
                  smelt_gemm_scaled_run(plan, a, b, c, d, bias, scales));
}

smelt_status smelt_gemm(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a, const smelt_tensor *b,
                        const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias) {
  return smelt_gemm_scaled(ctx, desc, a, b, c, d, bias, NULL);
}

/* ---------------------------------------------------------------- array of pointers */

smelt_status smelt_gemm_array_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, int64_t count, const smelt_tensor *a,
                                   const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                   const smelt_tensor *bias, smelt_plan **out) {
  const char *op = "smelt_gemm_array";
  smelt_gemm_desc dd;
  smelt_status s = begin_family(op, ctx, desc, out, &dd, SMELT_GEMM_MODE_ARRAY);
  if (s || (s = need_c(op, &dd, c))) return s;
  if (count < 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: count=%lld must be >= 0", op, (long long)count);
  smelt__gemm_args args;
  memset(&args, 0, sizeof args);
  const int has_c = dd.epilogue.beta != 0.0;
  if ((s = resolve_prob(op, ctx, -1, a, b, c, d, bias, has_c, 1, &args.prob))) return s;
  args.count = count;
  smelt__gemm_state *st;
  if ((s = new_state(&dd, a, b, c, d, bias, &st))) return s;
  st->mode = SMELT_GEMM_MODE_ARRAY;
  st->split_k = 1;
  st->count = count;
  st->prob = args.prob;
  smelt_plan *plan;
  if ((s = finish(ctx, st, &args, &plan))) return s;
  keep_tensors(plan, a, b, has_c ? c : NULL, d, bias, NULL, NULL);
  *out = plan;
  return SMELT_OK;
}

smelt_status smelt_gemm_array_run(smelt_plan *plan, const smelt_gemm_ptrs *ptrs, const smelt_tensor *bias) {
  const char *op = "smelt_gemm_array_run";
  smelt_status s = check_plan(op, plan);
  if (s) return s;
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  if (st->mode != SMELT_GEMM_MODE_ARRAY)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: the plan is a %s plan, not an array plan", op,
                        mode_names[st->mode]);
  if (!ptrs) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: ptrs is NULL", op);
  if (st->count > 0 && (!ptrs->a || !ptrs->b || !ptrs->d || (st->has_c && !ptrs->c)))
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: ptrs->%s is NULL", op,
                        !ptrs->a ? "a" : !ptrs->b ? "b" : !ptrs->d ? "d" : "c (the plan's beta is not 0)");
  if ((s = check_bias_presence(op, st, bias)) ||
      (bias && (s = smelt__check_same_layout(op, "bias", &plan->t[4], bias))))
    return s;
  smelt__gemm_args args;
  memset(&args, 0, sizeof args);
  args.prob = st->prob;
  args.prob.bias = bias ? bias->data : NULL;
  args.count = st->count;
  args.ptrs = ptrs;
  return smelt__plan_dispatch(plan, &args);
}

/* ---------------------------------------------------------------- grouped */

/* A group's D as a byte range, for the groups' overlap check. */
typedef struct {
  uintptr_t lo, hi;
  int64_t g;
} group_span;

static int span_cmp(const void *pa, const void *pb) {
  const group_span *a = (const group_span *)pa, *b = (const group_span *)pb;
  return (a->lo > b->lo) - (a->lo < b->lo);
}

static group_span span_of(const smelt_tensor *t, int64_t g) {
  int64_t lo, hi;
  smelt__tensor_span(t, &lo, &hi);
  return (group_span){(uintptr_t)t->data + (uintptr_t)lo, (uintptr_t)t->data + (uintptr_t)hi, g};
}

/* Groups run in no fixed order (on a GPU, at once), so a D may share no
 * byte with another group's A, B, C, bias or D; within a group the
 * per-problem check applies (D may be C exactly). Sorted D ranges make it
 * O(G log G) rather than O(G^2). */
static smelt_status check_groups_disjoint(const char *op, int64_t count, const smelt_tensor *a, const smelt_tensor *b,
                                          const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias) {
  group_span *ds = (group_span *)malloc((size_t)(count ? count : 1) * sizeof *ds);
  if (!ds) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  int64_t n = 0;
  for (int64_t g = 0; g < count; g++)
    if (smelt_tensor_numel(&d[g]) > 0) ds[n++] = span_of(&d[g], g);
  qsort(ds, (size_t)n, sizeof *ds, span_cmp);
  smelt_status s = SMELT_OK;
  for (int64_t i = 1; i < n && !s; i++)
    if (ds[i].lo < ds[i - 1].hi)
      s = smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: group %lld's D overlaps group %lld's D", op,
                       (long long)ds[i].g, (long long)ds[i - 1].g);
  for (int64_t g = 0; g < count && !s; g++) {
    const struct { const char *n; const smelt_tensor *t; } in[] = {
        {"A", &a[g]}, {"B", &b[g]}, {"C", c ? &c[g] : NULL}, {"bias", bias ? &bias[g] : NULL}, {"D", &d[g]}};
    for (int r = 0; r < 5 && !s; r++) {
      if (!in[r].t || smelt_tensor_numel(in[r].t) <= 0) continue;
      const group_span x = span_of(in[r].t, g);
      /* The first D ending past x's start; D ranges are disjoint, so ends
       * ascend with starts. */
      int64_t lo = 0, hi = n;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (ds[mid].hi <= x.lo) lo = mid + 1;
        else hi = mid;
      }
      for (int64_t i = lo; i < n && ds[i].lo < x.hi && !s; i++)
        if (ds[i].g != g)
          s = smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                           "%s: group %lld's %s overlaps group %lld's D; groups run in no fixed order", op,
                           (long long)g, in[r].n, (long long)ds[i].g);
    }
  }
  free(ds);
  return s;
}

/* Validates every group against group 0's dtypes and resolves them into a
 * new array (caller frees). */
static smelt_status resolve_groups(const char *op, const smelt_ctx *ctx, const smelt__gemm_state *st, int64_t count,
                                   const smelt_tensor *a, const smelt_tensor *b, const smelt_tensor *c,
                                   const smelt_tensor *d, const smelt_tensor *bias, smelt__gemm_prob **out) {
  *out = NULL;
  if (count < 0) return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: count=%lld must be >= 0", op, (long long)count);
  if (count > 0 && (!a || !b || !d))
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: the %s array is NULL", op, !a ? "A" : !b ? "B" : "D");
  if (st->has_c && count > 0 && !c)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: C is NULL but desc.epilogue.beta=%g is not 0", op,
                        st->desc.epilogue.beta);
  if (count > 0 && (bias != NULL) != (st->has_bias != 0))
    return check_bias_presence(op, st, bias);
  smelt__gemm_prob *p = (smelt__gemm_prob *)calloc((size_t)(count ? count : 1), sizeof *p);
  if (!p) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  for (int64_t g = 0; g < count; g++) {
    char gop[96];
    snprintf(gop, sizeof gop, "%s: group %lld", op, (long long)g);
    const smelt_tensor *cg = st->has_c ? &c[g] : NULL, *bg = bias ? &bias[g] : NULL;
    smelt_status s = resolve_prob(gop, ctx, -1, &a[g], &b[g], cg, &d[g], bg, st->has_c, 0, &p[g]);
    const struct { const char *n; const smelt_tensor *t; smelt_dtype want; } same[] = {
        {"A", &a[g], st->dt_a}, {"B", &b[g], st->dt_b}, {"C", cg, st->dt_c}, {"D", &d[g], st->dt_d},
        {"bias", bg, st->dt_bias}};
    for (int i = 0; i < 5 && !s; i++)
      if (same[i].t && same[i].t->dtype != same[i].want)
        s = smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: %s.dtype=%s differs from the planned %s", gop, same[i].n,
                         smelt_dtype_name(same[i].t->dtype), smelt_dtype_name(same[i].want));
    if (s) {
      free(p);
      return s;
    }
  }
  smelt_status s = check_groups_disjoint(op, count, a, b, st->has_c ? c : NULL, d, bias);
  if (s) {
    free(p);
    return s;
  }
  *out = p;
  return SMELT_OK;
}

smelt_status smelt_gemm_grouped_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, int64_t count, const smelt_tensor *a,
                                     const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                     const smelt_tensor *bias, smelt_plan **out) {
  const char *op = "smelt_gemm_grouped";
  smelt_gemm_desc dd;
  smelt_status s = begin_family(op, ctx, desc, out, &dd, SMELT_GEMM_MODE_GROUPED);
  if (s) return s;
  if (count < 1)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        "%s: count=%lld must be >= 1 to plan (the dtypes come from group 0; runs may have 0)", op,
                        (long long)count);
  if (!a || !b || !d) return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: the %s array is NULL", op, !a ? "A" : !b ? "B" : "D");
  if ((s = need_c(op, &dd, c))) return s;
  const int has_c = dd.epilogue.beta != 0.0;
  if ((s = check_one(op, R_A, "group 0: A", &a[0], ctx)) || (s = check_one(op, R_B, "group 0: B", &b[0], ctx)) ||
      (s = check_one(op, R_D, "group 0: D", &d[0], ctx)) ||
      (has_c && (s = check_one(op, R_C, "group 0: C", &c[0], ctx))) ||
      (bias && (s = check_one(op, R_BIAS, "group 0: bias", &bias[0], ctx))))
    return s;
  smelt__gemm_state *st;
  if ((s = new_state(&dd, &a[0], &b[0], has_c ? &c[0] : NULL, &d[0], bias ? &bias[0] : NULL, &st))) return s;
  st->mode = SMELT_GEMM_MODE_GROUPED;
  st->split_k = 1;
  st->count = count;
  smelt__gemm_args args;
  memset(&args, 0, sizeof args);
  smelt__gemm_prob *groups;
  if ((s = resolve_groups(op, ctx, st, count, a, b, c, d, bias, &groups))) {
    free(st);
    return s;
  }
  st->prob = groups[0];
  args.count = count;
  args.groups = groups;
  s = finish(ctx, st, &args, out);
  free(groups);
  return s;
}

smelt_status smelt_gemm_grouped_run(smelt_plan *plan, int64_t count, const smelt_tensor *a, const smelt_tensor *b,
                                    const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias) {
  const char *op = "smelt_gemm_grouped_run";
  smelt_status s = check_plan(op, plan);
  if (s) return s;
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  if (st->mode != SMELT_GEMM_MODE_GROUPED)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: the plan is a %s plan, not a grouped plan", op,
                        mode_names[st->mode]);
  smelt__gemm_prob *groups;
  if ((s = resolve_groups(op, plan->ctx, st, count, a, b, c, d, bias, &groups))) return s;
  smelt__gemm_args args;
  memset(&args, 0, sizeof args);
  args.count = count;
  args.groups = groups;
  s = count ? smelt__plan_dispatch(plan, &args) : SMELT_OK;
  free(groups);
  return s;
}

smelt_status smelt_gemm_grouped(smelt_ctx *ctx, const smelt_gemm_desc *desc, int64_t count, const smelt_tensor *a,
                                const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                const smelt_tensor *bias) {
  SMELT__ONE_SHOT(smelt_gemm_grouped_plan(ctx, desc, count, a, b, c, d, bias, &plan),
                  smelt_gemm_grouped_run(plan, count, a, b, c, d, bias));
}

/* ---------------------------------------------------------------- grouped by offsets */

/* Validates the stacked operands and resolves them into the template
 * problem (all T rows; b.bs and bias_gs step between groups); G into *groups. */
static smelt_status resolve_offs(const char *op, const smelt_ctx *ctx, const smelt_tensor *a, const smelt_tensor *b,
                                 const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias,
                                 const smelt_tensor *offs, int has_c, smelt__gemm_prob *p, int64_t *groups) {
  smelt_status s;
  if (!a || !b || !d || !offs)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL", op, !a ? "A" : !b ? "B" : !d ? "D" : "offs");
  if ((s = check_one(op, R_A, NULL, a, ctx)) || (s = check_one(op, R_B, NULL, b, ctx)) ||
      (s = check_one(op, R_D, NULL, d, ctx)) || (has_c && (s = check_one(op, R_C, NULL, c, ctx))) ||
      (bias && (s = check_one(op, R_BIAS, NULL, bias, ctx))) || (s = check_one(op, R_OFFS, NULL, offs, ctx)))
    return s;
  memset(p, 0, sizeof *p);
  if (a->ndim != 2)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: A.ndim=%d must be 2 (A[T, K], the groups' rows stacked)", op,
                        a->ndim);
  if (b->ndim != 3)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: B.ndim=%d must be 3 (B[G, K, N], one per group)", op,
                        b->ndim);
  const int64_t G = b->shape[0];
  p->m = a->shape[0];
  p->k = a->shape[1];
  p->n = b->shape[2];
  smelt__gemm_mat bias_m;
  if ((s = to_mat(op, "A", a, -1, p->m, p->k, "T", "K", &p->a)) ||
      (s = to_mat(op, "B", b, G, p->k, p->n, "K", "N", &p->b)) ||
      (s = to_mat(op, "D", d, -1, p->m, p->n, "T", "N", &p->d)) ||
      (has_c && (s = to_mat(op, "C", c, -1, p->m, p->n, "T", "N", &p->c))) ||
      (bias && (s = to_mat(op, "bias", bias, -1, G, p->n, "G", "N", &bias_m))))
    return s;
  if (bias) {
    p->bias = bias->data;
    p->bias_s = bias_m.cs;
    p->bias_gs = bias_m.rs;
  }
  if (offs->ndim != 1 || offs->shape[0] != G) {
    char sh[160];
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: offs.shape=%s must be [G]=[%lld] (B.shape[0])", op,
                        smelt__shape_str(offs, sh, sizeof sh), (long long)G);
  }
  /* Every backend reads offs as one contiguous array (the kernels scan it
   * 32 groups at a time), so a strided view is refused, not misread. */
  if (G > 1 && offs->strides[0] != 1)
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: offs.strides[0]=%lld must be 1 (offs is read as a contiguous array)",
                        op, (long long)offs->strides[0]);
  if ((s = smelt__check_output(op, "D", d)) || (s = check_disjoint(op, d, a, b, has_c ? c : NULL, bias, offs)))
    return s;
  *groups = G;
  return SMELT_OK;
}

smelt_status smelt_gemm_grouped_offs_scaled_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                                 const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                                 const smelt_tensor *bias, const smelt_tensor *offs,
                                                 const smelt_gemm_scales *scales, smelt_plan **out) {
  const char *op = "smelt_gemm_grouped_offs";
  smelt_gemm_desc dd;
  smelt_status s = begin_family(op, ctx, desc, out, &dd, SMELT_GEMM_MODE_GROUPED_OFFS);
  if (s || (s = need_c(op, &dd, c))) return s;
  const int has_c = dd.epilogue.beta != 0.0;
  smelt__gemm_args args;
  memset(&args, 0, sizeof args);
  int64_t groups = 0;
  const int blk = dd.scales == SMELT_GEMM_SCALES_BLOCK;
  const smelt_gemm_scales block_sc = scales ? *scales : (smelt_gemm_scales){NULL, NULL};
  if ((s = resolve_offs(op, ctx, a, b, c, d, bias, offs, has_c, &args.prob, &groups)) ||
      (s = blk ? resolve_block_scales(op, ctx, &block_sc, d, -1, groups, a->dtype, b->dtype, &args.prob)
               : resolve_scales(op, ctx, scales, d, groups, &args.prob)))
    return s;
  args.count = groups;
  args.offs = offs->data;
  smelt__gemm_state *st;
  if ((s = new_state(&dd, a, b, c, d, bias, &st))) return s;
  st->has_sa = args.prob.sa != NULL;
  st->has_sb = args.prob.sb != NULL;
  st->blk = blk;
  st->mode = SMELT_GEMM_MODE_GROUPED_OFFS;
  st->split_k = 1;
  st->count = groups;
  st->prob = args.prob;
  st->dt_offs = offs->dtype;
  smelt_plan *plan;
  if ((s = finish(ctx, st, &args, &plan))) return s;
  keep_tensors(plan, a, b, has_c ? c : NULL, d, bias, offs, scales);
  *out = plan;
  return SMELT_OK;
}

smelt_status smelt_gemm_grouped_offs_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                          const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                          const smelt_tensor *bias, const smelt_tensor *offs, smelt_plan **out) {
  return smelt_gemm_grouped_offs_scaled_plan(ctx, desc, a, b, c, d, bias, offs, NULL, out);
}

smelt_status smelt_gemm_grouped_offs_scaled_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b,
                                                const smelt_tensor *c, const smelt_tensor *d,
                                                const smelt_tensor *bias, const smelt_tensor *offs,
                                                const smelt_gemm_scales *scales) {
  const char *op = "smelt_gemm_grouped_offs_run";
  smelt_status s = check_plan(op, plan);
  if (s) return s;
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  if (st->mode != SMELT_GEMM_MODE_GROUPED_OFFS)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "%s: the plan is a %s plan, not a grouped_offs plan", op,
                        mode_names[st->mode]);
  if (!a || !b || !d || !offs)
    return smelt__error(SMELT_STATUS_NULL_POINTER, "%s: %s is NULL", op, !a ? "A" : !b ? "B" : !d ? "D" : "offs");
  if ((s = check_run(op, plan, a, b, c, d, bias, offs, scales))) return s;
  smelt__gemm_args args = bound_args(st, a, b, c, d, bias, scales);
  args.offs = offs->data;
  return smelt__plan_dispatch(plan, &args);
}

smelt_status smelt_gemm_grouped_offs_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b,
                                         const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias,
                                         const smelt_tensor *offs) {
  return smelt_gemm_grouped_offs_scaled_run(plan, a, b, c, d, bias, offs, NULL);
}

smelt_status smelt_gemm_grouped_offs_scaled(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                            const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                            const smelt_tensor *bias, const smelt_tensor *offs,
                                            const smelt_gemm_scales *scales) {
  SMELT__ONE_SHOT(smelt_gemm_grouped_offs_scaled_plan(ctx, desc, a, b, c, d, bias, offs, scales, &plan),
                  smelt_gemm_grouped_offs_scaled_run(plan, a, b, c, d, bias, offs, scales));
}

smelt_status smelt_gemm_grouped_offs(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                     const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                     const smelt_tensor *bias, const smelt_tensor *offs) {
  return smelt_gemm_grouped_offs_scaled(ctx, desc, a, b, c, d, bias, offs, NULL);
}

/* ---------------------------------------------------------------- alignment */

int smelt__gemm_mat_align(const smelt__gemm_mat *x, smelt_dtype dt, int64_t rows, int64_t cols, int64_t batch,
                          int unit_axis) {
  const uint64_t es = smelt_dtype_size(dt);
  uint64_t bits = (uint64_t)(uintptr_t)x->data | 16;
  if (rows > 1 && unit_axis != 0) bits |= (uint64_t)x->rs * es;
  if (cols > 1 && unit_axis != 1) bits |= (uint64_t)x->cs * es;
  if (batch > 1) bits |= (uint64_t)x->bs * es;
  return (int)(bits & (~bits + 1)); /* lowest set bit */
}
