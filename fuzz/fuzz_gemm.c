/* Fuzz entry points for the GEMM family: plain, split-K and batched
 * (smelt_gemm*), array of pointers, grouped, and grouped by offsets. The
 * descs' fields are drawn whole (math, tile, epilogue, mode, split_k), the
 * operand dtypes from the classes gemm.h lists (so most calls get past
 * validation), and M * N * K * L stays under a few thousand. */
#include "fuzz.h"

#include <stdlib.h>
#include <string.h>

#define WORK_CAP 4096
#define MAX_COUNT 4

static smelt_gemm_desc draw_desc(fz *f) {
  smelt_gemm_desc d = smelt_gemm_desc_default();
  uint8_t which = fz_u8(f);
  if (which & 1) {
    d.math.opclass = (smelt_gemm_opclass)fz_enum(f, SMELT_GEMM_OPCLASS_COUNT);
    d.math.op = (smelt_gemm_math_op)fz_enum(f, SMELT_GEMM_MATH_COUNT);
    d.math.acc = (smelt_gemm_acc)fz_enum(f, SMELT_GEMM_ACC_COUNT);
  }
  if (which & 2) {
    int *tile = &d.tile.m;
    for (int i = 0; i < 10; i++) tile[i] = fz_one_in(f, 2) ? 0 : (int)fz_size(f, 256);
  }
  if (which & 4) {
    d.epilogue.alpha = fz_double(f);
    d.epilogue.act = (smelt_act)fz_enum(f, SMELT_ACT_COUNT);
    d.epilogue.slope = (float)fz_double(f);
    d.epilogue.clamp = fz_u8(f) & 1;
    if (fz_one_in(f, 2)) {
      d.epilogue.scale_a = (float)fz_double(f);
      d.epilogue.scale_b = (float)fz_double(f);
      d.epilogue.scale_d = (float)fz_double(f);
    }
  }
  if (which & 8) d.epilogue.beta = fz_double(f);
  if (which & 16) {
    d.mode = (smelt_gemm_mode)fz_enum(f, SMELT_GEMM_MODE_COUNT);
    d.split_k = (int)fz_size(f, 8);
  }
  return d;
}

/* Operand dtypes from one of gemm.h's classes: f64, the float mix, or i8. */
typedef struct dtypes {
  smelt_dtype a, b, c, d, bias;
} dtypes;

static dtypes draw_dtypes(fz *f) {
  static const smelt_dtype floats[5] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16, SMELT_DTYPE_E4M3,
                                        SMELT_DTYPE_E5M2};
  static const smelt_dtype outs[8] = {SMELT_DTYPE_F64, SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16,
                                      SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2, SMELT_DTYPE_I8, SMELT_DTYPE_I32};
  static const smelt_dtype biases[5] = {SMELT_DTYPE_F64, SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16,
                                        SMELT_DTYPE_I32};
  dtypes t;
  uint8_t cls = fz_u8(f) % 8;
  if (cls == 0) t.a = t.b = SMELT_DTYPE_F64;
  else if (cls == 1) t.a = t.b = SMELT_DTYPE_I8;
  else if (cls == 2) t.a = fz_float_dtype(f), t.b = fz_float_dtype(f);
  else t.a = floats[fz_u8(f) % 5], t.b = floats[fz_u8(f) % 5];
  t.c = outs[fz_u8(f) % 8];
  t.d = fz_one_in(f, 2) ? t.c : outs[fz_u8(f) % 8];
  t.bias = biases[fz_u8(f) % 5];
  return t;
}

/* ---------------------------------------------------------------- plain, split-K, batched */

enum { A, B, C, D, BIAS, NT };

static void plain_views(fz *f, smelt_tensor *t, const dtypes *dt, int batched, const int64_t *lmnk, int in_place) {
  int nd = batched ? 3 : 2, o = batched ? 0 : 1;
  int64_t L = lmnk[0], M = lmnk[1], N = lmnk[2], K = lmnk[3];
  int64_t a[3] = {L, M, K}, b[3] = {L, K, N}, c[3] = {L, M, N};
  t[A] = fz_view(f, dt->a, nd, a + o, 0);
  t[B] = fz_view(f, dt->b, nd, b + o, 0);
  t[C] = fz_view(f, dt->c, nd, c + o, 0);
  t[D] = in_place ? t[C] : fz_view(f, dt->d, nd, c + o, 0);
  fz_output(&t[D]);
  t[BIAS] = fz_view(f, dt->bias, 1, &N, 0);
}

void fz_gemm(fz *f) {
  int64_t lmnk[4] = {fz_size(f, 4), fz_size(f, 17), fz_size(f, 17), fz_size(f, 17)};
  fz_cap_work(lmnk, 4, WORK_CAP);
  int batched = fz_one_in(f, 3), mode = fz_mode(f), in_place = fz_one_in(f, 8);
  dtypes dt = draw_dtypes(f);
  smelt_gemm_desc desc = draw_desc(f);
  const smelt_gemm_desc *dp = fz_one_in(f, 16) ? NULL : &desc;
  int with_c = desc.epilogue.beta != 0 || fz_one_in(f, 4), with_bias = fz_one_in(f, 2);
  unsigned nulls = fz_nulls(f, 4);
  smelt_tensor t[NT];
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    plain_views(f, t, &dt, batched, lmnk, in_place);
    const smelt_tensor *a = fz_maybe_null(nulls, t, A), *b = fz_maybe_null(nulls, t, B),
                       *c = with_c ? &t[C] : NULL, *d = fz_maybe_null(nulls, t, D),
                       *bias = with_bias ? &t[BIAS] : NULL;
    if (mode == 0 && fz_one_in(f, 16)) {
      /* Tuning needs a CUDA context: on the CPU it must fail, writing nothing. */
      static smelt_gemm_tune_result res;
      FZ_CALL(s, "smelt_gemm_autotune", t, smelt_gemm_autotune(f->ctx, dp, a, b, c, d, bias, fz_u8(f), &res));
      if (s == SMELT_OK) abort();
      return;
    }
    FZ_ROUND(s, r, mode, plan, t, "smelt_gemm", smelt_gemm(f->ctx, dp, a, b, c, d, bias),
             smelt_gemm_plan(f->ctx, dp, a, b, c, d, bias, &plan), smelt_gemm_run(plan, a, b, c, d, bias));
  }
  smelt_plan_destroy(plan);
}

/* ---------------------------------------------------------------- array of pointers */

void fz_gemm_array(fz *f) {
  int64_t lmnk[4] = {1, fz_size(f, 12), fz_size(f, 12), fz_size(f, 12)};
  fz_cap_work(lmnk, 4, WORK_CAP / MAX_COUNT);
  int64_t count = fz_size(f, MAX_COUNT);
  if (count > MAX_COUNT) count = MAX_COUNT; /* the arrays hold MAX_COUNT pointers */
  dtypes dt = draw_dtypes(f);
  smelt_gemm_desc desc = draw_desc(f);
  if (fz_u8(f) & 1) desc.mode = SMELT_GEMM_MODE_ARRAY;
  int with_c = desc.epilogue.beta != 0 || fz_one_in(f, 4), with_bias = fz_one_in(f, 2);
  smelt_tensor t[NT];
  plain_views(f, t, &dt, 0, lmnk, 0);
  fz_reset_outputs();
  smelt_plan *plan;
  smelt_status s;
  FZ_PLAN(s, "smelt_gemm_array_plan", t, plan,
          smelt_gemm_array_plan(f->ctx, fz_one_in(f, 16) ? NULL : &desc, count, &t[A], &t[B], with_c ? &t[C] : NULL,
                                &t[D], with_bias ? &t[BIAS] : NULL, &plan));
  if (s) return;
  const void *pa[MAX_COUNT], *pb[MAX_COUNT], *pc[MAX_COUNT];
  void *pd[MAX_COUNT];
  for (int i = 0; i < MAX_COUNT; i++) {
    pa[i] = fz_moved(f, &t[A], 0).data;
    pb[i] = fz_moved(f, &t[B], 0).data;
    pc[i] = fz_moved(f, &t[C], 0).data;
    pd[i] = fz_moved(f, &t[D], i < count).data;
  }
  smelt_gemm_ptrs ptrs = {pa, pb, with_c ? pc : NULL, pd};
  smelt_gemm_ptrs before = ptrs;
  FZ_CALL(s, "smelt_gemm_array_run", t,
          smelt_gemm_array_run(plan, fz_one_in(f, 16) ? NULL : &ptrs, with_bias ? &t[BIAS] : NULL));
  fz_same("smelt_gemm_array_run", &before, &ptrs, sizeof ptrs);
  smelt_plan_destroy(plan);
}

/* ---------------------------------------------------------------- grouped */

void fz_gemm_grouped(fz *f) {
  int64_t count = fz_size(f, MAX_COUNT);
  if (count > MAX_COUNT) count = MAX_COUNT; /* the arrays hold MAX_COUNT views */
  dtypes dt = draw_dtypes(f);
  smelt_gemm_desc desc = draw_desc(f);
  if (fz_u8(f) & 1) desc.mode = SMELT_GEMM_MODE_GROUPED;
  int with_c = desc.epilogue.beta != 0 || fz_one_in(f, 4), with_bias = fz_one_in(f, 2), mode = fz_mode(f);
  smelt_tensor t[NT * MAX_COUNT];
  smelt_tensor *a = t, *b = t + MAX_COUNT, *c = t + 2 * MAX_COUNT, *d = t + 3 * MAX_COUNT, *bias = t + 4 * MAX_COUNT;
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; r < (mode ? mode : 1); r++) {
    fz_reset_outputs();
    for (int i = 0; i < MAX_COUNT; i++) {
      int64_t lmnk[4] = {1, fz_size(f, 9), fz_size(f, 9), fz_size(f, 9)};
      fz_cap_work(lmnk, 4, WORK_CAP / MAX_COUNT);
      smelt_tensor one[NT];
      plain_views(f, one, &dt, 0, lmnk, fz_one_in(f, 8));
      a[i] = one[A], b[i] = one[B], c[i] = one[C], d[i] = one[D], bias[i] = one[BIAS];
    }
    if (fz_one_in(f, 16)) { /* aliasing across problems */
      int i = fz_u8(f) % MAX_COUNT;
      d[i] = a[fz_u8(f) % MAX_COUNT];
      fz_output(&d[i]);
    }
    const smelt_tensor *cp = with_c ? c : NULL, *bp = with_bias ? bias : NULL;
    const int64_t run_count = mode && fz_one_in(f, 4) ? fz_small(f, MAX_COUNT) : count;
    FZ_ROUND(s, r, mode, plan, t, "smelt_gemm_grouped",
             smelt_gemm_grouped(f->ctx, fz_one_in(f, 16) ? NULL : &desc, count, a, b, cp, d, bp),
             smelt_gemm_grouped_plan(f->ctx, &desc, count, a, b, cp, d, bp, &plan),
             smelt_gemm_grouped_run(plan, run_count, a, b, cp, d, bp));
  }
  smelt_plan_destroy(plan);
}

/* ---------------------------------------------------------------- grouped by offsets */

enum { OA, OB, OC, OD, OBIAS, OOFFS, ONT };

static void offs_views(fz *f, smelt_tensor *t, const dtypes *dt, int64_t T, int64_t G, int64_t N, int64_t K,
                       smelt_dtype offs_dt, int in_place) {
  int64_t a[2] = {T, K}, b[3] = {G, K, N}, c[2] = {T, N}, bias[2] = {G, N};
  t[OA] = fz_view(f, dt->a, 2, a, 0);
  t[OB] = fz_view(f, dt->b, 3, b, 0);
  t[OC] = fz_view(f, dt->c, 2, c, 0);
  t[OD] = in_place ? t[OC] : fz_view(f, dt->d, 2, c, 0);
  fz_output(&t[OD]);
  t[OBIAS] = fz_view(f, dt->bias, 2, bias, 0);
  t[OOFFS] = fz_view(f, offs_dt, 1, &G, 0);
  /* Offsets: ascending ends within [0, T] mostly, anything now and then. */
  int64_t v[64], end = 0;
  for (int g = 0; g < 64; g++) {
    uint8_t b = fz_u8(f);
    if (b < 200 && T >= 0 && T <= 64 && end >= 0 && end <= T) end += b % (T - end + 1);
    else end = fz_size(f, 70);
    v[g] = end;
  }
  fz_fill_ints(&t[OOFFS], v, 64);
}

void fz_gemm_grouped_offs(fz *f) {
  int64_t dims[4] = {fz_size(f, 20), fz_size(f, 5), fz_size(f, 12), fz_size(f, 12)}; /* T, G, N, K */
  fz_cap_work(dims, 4, WORK_CAP);
  dtypes dt = draw_dtypes(f);
  smelt_gemm_desc desc = draw_desc(f);
  if (fz_u8(f) & 1) desc.mode = SMELT_GEMM_MODE_GROUPED_OFFS;
  smelt_dtype offs_dt = fz_one_in(f, 16) ? fz_float_dtype(f) : fz_u8(f) & 1 ? SMELT_DTYPE_I64 : SMELT_DTYPE_I32;
  int with_c = desc.epilogue.beta != 0 || fz_one_in(f, 4), with_bias = fz_one_in(f, 2), mode = fz_mode(f);
  int in_place = fz_one_in(f, 8);
  unsigned nulls = fz_nulls(f, 6);
  smelt_tensor t[ONT];
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    offs_views(f, t, &dt, dims[0], dims[1], dims[2], dims[3], offs_dt, in_place);
    const smelt_tensor *a = fz_maybe_null(nulls, t, OA), *b = fz_maybe_null(nulls, t, OB),
                       *c = with_c ? &t[OC] : NULL, *d = fz_maybe_null(nulls, t, OD),
                       *bias = with_bias ? &t[OBIAS] : NULL, *offs = fz_maybe_null(nulls, t, OOFFS);
    FZ_ROUND(s, r, mode, plan, t, "smelt_gemm_grouped_offs",
             smelt_gemm_grouped_offs(f->ctx, fz_one_in(f, 16) ? NULL : &desc, a, b, c, d, bias, offs),
             smelt_gemm_grouped_offs_plan(f->ctx, &desc, a, b, c, d, bias, offs, &plan),
             smelt_gemm_grouped_offs_run(plan, a, b, c, d, bias, offs));
  }
  smelt_plan_destroy(plan);
}
