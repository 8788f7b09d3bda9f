/* CPU reference for smelt_gemm: the oracle the kernels are checked against.
 *
 * Naive on purpose. Inputs are converted exactly to double (f16, bf16 and
 * fp8 all fit), products of float types accumulate in double in ascending k
 * order, and i8 x i8 accumulates exactly in int64. The epilogue follows
 * smelt/gemm.h step by step in double:
 *   v = alpha · scale_a · scale_b · sa[m] · sb[n] · acc + beta · C + bias;
 * (with block scales, acc sums each 128-deep block of K apart, weighted
 * by its scales, and sa, sb are not applied again);
 *   v = act(v);
 *   D = convert(scale_d · v)
 * or, with an epilogue graph, v = alpha · scales · acc goes through the graph
 * (src/cpu/epi_graph.c) and D gets its output node's value.
 * Every mode reduces to a list of single problems (grouped by offsets: one
 * per group, over its clamped row range); split-K only changes the
 * summation order on a GPU, so here it is the plain GEMM. An f16
 * accumulator is computed in double as well: the reference is the exact
 * result, and the tests bound how far an f16 accumulator may drift from it. */
#include "../core/checked.h"
#include "../core/gemm_internal.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Round to nearest even, saturate to [lo, hi]; NaN becomes 0. */
static double to_int(double v, double lo, double hi) {
  if (isnan(v)) return 0;
  v = nearbyint(v);
  return v < lo ? lo : v > hi ? hi : v;
}

/* Stores v into D with the conversion rules of smelt/gemm.h. */
static void store(void *base, smelt_dtype dt, int64_t off, double v, int clamp) {
  if (clamp) v = smelt__clamp_finite(dt, v);
  switch (dt) {
    case SMELT_DTYPE_I8: ((int8_t *)base)[off] = (int8_t)to_int(v, -128, 127); break;
    case SMELT_DTYPE_I32: ((int32_t *)base)[off] = (int32_t)to_int(v, -2147483648.0, 2147483647.0); break;
    /* f64 as is; f32, f16, bf16 and fp8 through f32 (fp8 saturates). */
    default: smelt__store_f64(base, dt, off, v); break;
  }
}

/* Scratch for one problem at a time: B converted once (K x N), one row of A
 * (K) and the accumulators (N), as doubles and, for i8, as int64. Sized
 * for the largest problem of the call and taken before any D is written,
 * so a grouped call never writes some groups and then fails on memory. */
typedef struct {
  double *d;
  int64_t *i;
} scratch;

static int64_t scratch_elems(const smelt__gemm_prob *p) {
  int64_t e, kn;
  if (__builtin_mul_overflow(p->k, p->n, &e) || __builtin_add_overflow(p->k, p->n, &kn) ||
      __builtin_add_overflow(e, kn, &e))
    return -1;
  return e;
}

static smelt_status scratch_new(const smelt__gemm_state *st, const smelt__gemm_args *args, scratch *sc) {
  sc->d = NULL;
  sc->i = NULL;
  int64_t most = 0;
  const int grouped = st->mode == SMELT_GEMM_MODE_GROUPED;
  for (int64_t g = 0; g < (grouped ? args->count : 1); g++) {
    const smelt__gemm_prob *p = grouped ? &args->groups[g] : &args->prob;
    int64_t e = p->m == 0 || p->n == 0 ? 0 : scratch_elems(p);
    /* A graph's column reductions: N doubles a slot, before the rest. */
    if (st->has_graph && e >= 0 && __builtin_add_overflow(e, SMELT_EPI_MAX_TENSORS * p->n, &e)) e = -1;
    /* The i32 accumulator doubles the scratch: 16 bytes an element at most. */
    if (e < 0 || e > (int64_t)(SIZE_MAX / (2 * sizeof(double))))
      return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_gemm: K=%lld x N=%lld is too large for the CPU reference",
                          (long long)p->k, (long long)p->n);
    if (e > most) most = e;
  }
  if (most == 0) return SMELT_OK;
  smelt_status s = smelt__host_fits(sizeof(double) * (size_t)most * (st->acc == SMELT_GEMM_ACC_I32 ? 2 : 1),
                                    "smelt_gemm", "the CPU reference's scratch");
  if (s) return s;
  sc->d = (double *)malloc(sizeof(double) * (size_t)most);
  sc->i = st->acc == SMELT_GEMM_ACC_I32 ? (int64_t *)malloc(sizeof(int64_t) * (size_t)most) : NULL;
  if (!sc->d || (st->acc == SMELT_GEMM_ACC_I32 && !sc->i)) {
    free(sc->d);
    free(sc->i);
    return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_gemm: out of host memory for the CPU reference");
  }
  return SMELT_OK;
}

/* Block scales (desc.scales BLOCK): row i of A (a, K values)
 * times column j of B (b, K values), each 128-deep block of K summed
 * apart and weighted by sa[i, kb] sb[j / 128, kb], k ascending. */
static double block_dot(const smelt__gemm_prob *p, const double *a, const double *b, int64_t i, int64_t j) {
  double sum = 0;
  for (int64_t k0 = 0, kb = 0; k0 < p->k; k0 += 128, kb++) {
    double part = 0;
    for (int64_t k = k0; k < k0 + 128 && k < p->k; k++) part += a[k] * b[k];
    sum += (double)p->sa[i * p->sa_s + kb * p->sa_ks] * (double)p->sb[(j / 128) * p->sb_s + kb * p->sb_ks] * part;
  }
  return sum;
}

/* Whether st's graph reduces rows (an output a row, written even for an
 * empty row). */
static int row_reduces(const smelt__gemm_state *st) {
  for (int k = 0; st->has_graph && k < st->graph.count; k++)
    if (st->graph.node[k].op == SMELT_EPI_ROW_REDUCE) return 1;
  return 0;
}

/* One problem. Shapes: A [m,k], B [k,n], C and D [m,n], bias, sb [n], sa [m]. */
static void gemm_one(const smelt__gemm_state *st, const smelt__gemm_prob *p, const scratch *sc) {
  const int64_t M = p->m, N = p->n, K = p->k;
  /* A graph's reductions over an empty axis still write their outputs. */
  double *red = sc->d;
  if (st->has_graph) smelt__cpu_epi_begin(st, p, red);
  if (M == 0 || N == 0) {
    /* Only row reductions have anything to write for an empty row (M may
     * be as large as any extent when N is 0: the fuzzer's 2^33 rows took
     * minutes here). */
    for (int64_t i = 0; row_reduces(st) && i < M; i++) smelt__cpu_epi_row(st, p, i, NULL, red);
    if (st->has_graph) smelt__cpu_epi_end(st, p, red);
    return;
  }
  const int ints = st->acc == SMELT_GEMM_ACC_I32;
  /* B converted once and transposed, bd[j*K + k], so each dot product reads
   * both rows contiguously (the sums' order, k ascending, is unchanged); one
   * row of A and of accumulators at a time. */
  double *bd = sc->d + (st->has_graph ? SMELT_EPI_MAX_TENSORS * N : 0);
  int64_t *bi = sc->i;
  double *ad = bd + K * N, *acc = ad + K;
  int64_t *ai = ints ? bi + K * N : NULL, *acci = ints ? ai + K : NULL;
  for (int64_t k = 0; k < K; k++)
    for (int64_t j = 0; j < N; j++) {
      double v = smelt__load_f64(p->b.data, st->dt_b, k * p->b.rs + j * p->b.cs);
      bd[j * K + k] = v;
      if (ints) bi[j * K + k] = (int64_t)v;
    }
  const smelt_gemm_epilogue *e = &st->desc.epilogue;
  const double ab = e->alpha * (double)e->scale_a * (double)e->scale_b;
  for (int64_t i = 0; i < M; i++) {
    for (int64_t k = 0; k < K; k++) {
      ad[k] = smelt__load_f64(p->a.data, st->dt_a, i * p->a.rs + k * p->a.cs);
      if (ints) ai[k] = (int64_t)ad[k];
    }
    for (int64_t j = 0; j < N; j++) { /* acc[j] = sum_k A[i,k] * B[k,j], k ascending */
      if (ints) {
        int64_t s = 0;
        const int64_t *bj = bi + j * K;
        for (int64_t k = 0; k < K; k++) s += ai[k] * bj[k];
        acci[j] = s;
      } else if (st->blk) {
        acc[j] = block_dot(p, ad, bd + j * K, i, j);
      } else {
        double s = 0;
        const double *bj = bd + j * K;
        for (int64_t k = 0; k < K; k++) s += ad[k] * bj[k];
        acc[j] = s;
      }
    }
    const double abi = p->sa && !st->blk ? ab * (double)p->sa[i * p->sa_s] : ab;
    if (st->has_graph) {
      for (int64_t j = 0; j < N; j++)
        acc[j] = (p->sb ? abi * (double)p->sb[j * p->sb_s] : abi) * (ints ? (double)acci[j] : acc[j]);
      smelt__cpu_epi_row(st, p, i, acc, red);
      for (int64_t j = 0; j < N; j++) store((void *)p->d.data, st->dt_d, i * p->d.rs + j * p->d.cs, acc[j], e->clamp);
      continue;
    }
    for (int64_t j = 0; j < N; j++) {
      const double s = p->sb && !st->blk ? abi * (double)p->sb[j * p->sb_s] : abi;
      double v = s * (ints ? (double)acci[j] : acc[j]);
      if (st->has_c) v += e->beta * smelt__load_f64(p->c.data, st->dt_c, i * p->c.rs + j * p->c.cs);
      if (st->has_bias) v += smelt__load_f64(p->bias, st->dt_bias, j * p->bias_s);
      v = smelt_act_apply(e->act, v, e->slope) * (double)e->scale_d;
      store((void *)p->d.data, st->dt_d, i * p->d.rs + j * p->d.cs, v, e->clamp);
    }
  }
  if (st->has_graph) smelt__cpu_epi_end(st, p, red);
}

static const void *at(const void *base, smelt_dtype dt, int64_t elems) {
  return base ? (const char *)base + elems * (int64_t)smelt_dtype_size(dt) : NULL;
}

/* Array mode reads pointers the plan never saw: all are checked before
 * anything is written. */
static smelt_status check_ptrs(const smelt__gemm_state *st, const smelt__gemm_args *args) {
  const smelt_gemm_ptrs *q = args->ptrs;
  const smelt__gemm_prob *p = &args->prob;
  if (p->m == 0 || p->n == 0) return SMELT_OK;
  for (int64_t l = 0; l < args->count; l++) {
    const struct { const char *n; const void *v; smelt_dtype dt; int used; } x[] = {
        {"a", q->a[l], st->dt_a, p->k > 0}, {"b", q->b[l], st->dt_b, p->k > 0},
        {"c", st->has_c ? q->c[l] : NULL, st->dt_c, st->has_c}, {"d", q->d[l], st->dt_d, 1}};
    for (int i = 0; i < 4; i++) {
      if (!x[i].used) continue;
      if (!x[i].v)
        return smelt__error(SMELT_STATUS_NULL_POINTER, "smelt_gemm_array_run: ptrs->%s[%lld] is NULL", x[i].n,
                            (long long)l);
      if ((uintptr_t)x[i].v % smelt_dtype_size(x[i].dt))
        return smelt__error(SMELT_STATUS_MISALIGNED,
                            "smelt_gemm_array_run: ptrs->%s[%lld]=%p is not aligned to its dtype %s", x[i].n,
                            (long long)l, x[i].v, smelt_dtype_name(x[i].dt));
    }
  }
  return SMELT_OK;
}

/* Grouped by offsets: each group's rows of the stacked A, C and D with its
 * B and bias row, the offsets read from host memory and clamped as
 * smelt/gemm.h says (so no row outside [0, T) is ever touched). */
static void gemm_offs(const smelt__gemm_state *st, const smelt__gemm_args *args, const scratch *sc) {
  const smelt__gemm_prob *t = &args->prob;
  int64_t end = 0;
  for (int64_t g = 0; g < args->count; g++) {
    const int64_t off = st->dt_offs == SMELT_DTYPE_I64 ? ((const int64_t *)args->offs)[g]
                                                       : (int64_t)((const int32_t *)args->offs)[g];
    int64_t r0, r1;
    smelt__gemm_offs_range(end, off, t->m, &r0, &r1);
    end = r1;
    smelt__gemm_prob p = *t;
    p.m = r1 - r0;
    if (p.m == 0 || p.n == 0) continue; /* nothing to write */
    /* With K = 0, A and B are empty (any strides) and never read. */
    p.a.data = p.k ? at(t->a.data, st->dt_a, r0 * t->a.rs) : NULL;
    p.b.data = p.k ? at(t->b.data, st->dt_b, g * t->b.bs) : NULL;
    p.c.data = at(t->c.data, st->dt_c, r0 * t->c.rs);
    p.d.data = at(t->d.data, st->dt_d, r0 * t->d.rs);
    p.bias = at(t->bias, st->dt_bias, g * t->bias_gs);
    p.sa = t->sa ? t->sa + r0 * t->sa_s : NULL;
    p.sb = t->sb ? t->sb + g * t->sb_gs : NULL;
    gemm_one(st, &p, sc);
  }
}

/* Every other mode: a list of single problems. */
static void gemm_list(const smelt__gemm_state *st, const smelt__gemm_args *args, const scratch *sc) {
  /* An empty D has nothing to write however many batches it claims (a
   * [2^40, 0, N] batch is valid), and its operands' batch strides may then
   * be anything: no batch is visited. */
  if (st->mode != SMELT_GEMM_MODE_GROUPED && !st->has_graph && (args->prob.m == 0 || args->prob.n == 0)) return;
  for (int64_t l = 0; l < args->count; l++) {
    smelt__gemm_prob p;
    switch (st->mode) {
      case SMELT_GEMM_MODE_GROUPED: p = args->groups[l]; break;
      case SMELT_GEMM_MODE_ARRAY:
        p = args->prob;
        p.a.data = args->ptrs->a[l];
        p.b.data = args->ptrs->b[l];
        p.c.data = st->has_c ? args->ptrs->c[l] : NULL;
        p.d.data = args->ptrs->d[l];
        break;
      default: /* plain, split-K (count 1) and batched */
        p = args->prob;
        p.a.data = p.k ? at(p.a.data, st->dt_a, l * p.a.bs) : NULL;
        p.b.data = p.k ? at(p.b.data, st->dt_b, l * p.b.bs) : NULL;
        p.c.data = at(p.c.data, st->dt_c, l * p.c.bs);
        p.d.data = at(p.d.data, st->dt_d, l * p.d.bs);
        if (st->blk && p.k) {
          p.sa += l * p.sa_bs;
          p.sb += l * p.sb_bs;
        }
        break;
    }
    gemm_one(st, &p, sc);
  }
}

static smelt_status run(smelt_plan *plan, const void *run_args) {
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  const smelt__gemm_args *args = (const smelt__gemm_args *)run_args;
  smelt_status s = st->mode == SMELT_GEMM_MODE_ARRAY ? check_ptrs(st, args) : SMELT_OK;
  scratch sc;
  if (s || (s = scratch_new(st, args, &sc))) return s;
  if (st->mode == SMELT_GEMM_MODE_GROUPED_OFFS) gemm_offs(st, args, &sc);
  else gemm_list(st, args, &sc);
  free(sc.d);
  free(sc.i);
  return SMELT_OK;
}

const smelt__backend smelt__cpu_gemm = {.run = run};
