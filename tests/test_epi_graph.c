/* Epilogue graphs (smelt/epilogue.h). Three graphs cover every node kind:
 * bias + GELU with the pre-activation stored and a row abs-max and column
 * sum (the FP8-quantizer and backward case), a scaled residual add of an
 * auxiliary input with clamp and a cast to e4m3, and a mix of C, row and
 * column vectors, every binary op and two activations. The CPU reference
 * is checked against formulas written out here in f64; with a GPU, each
 * kernel that takes a graph (mma.sync, SIMT, the Hopper kernel's general
 * epilogue) against the CPU reference at odd sizes and edge tiles, every
 * output poisoned and guarded (each element written, nothing else), and
 * its reductions bitwise equal over two runs. Bad graphs and bad slot
 * tensors fail with a clear message and write nothing. */
#include "core/error_bound.h"
#include "cuda/gemm_cuda.h"
#include "harness.h"

/* ---------------------------------------------------------------- the graphs */

enum { G_BIAS_GELU, G_RESIDUAL, G_MIXED, G_COUNT };

/* Slots: G_BIAS_GELU 0 pre-activation (bf16 [M, N], stored), 1 row amax
 * [M], 2 column sum [N]. G_RESIDUAL: 0 residual (bf16 [M, N], read), 1
 * column max [N], 2 row sum [M]. G_MIXED: 0 row vector f32 [M], 1 column
 * vector bf16 [N], 2 f16 store [M, N], 3 column amax [N]. */
static smelt_epi_graph graph_of(int which) {
  smelt_epi_graph g = smelt_epi_graph_empty();
  const int acc = smelt_epi_input(&g, SMELT_EPI_ACC, 0);
  switch (which) {
    case G_BIAS_GELU: {
      const int pre = smelt_epi_binary(&g, SMELT_EPI_ADD, acc, smelt_epi_input(&g, SMELT_EPI_BIAS, 0));
      smelt_epi_store(&g, pre, 0);
      g.out = smelt_epi_act(&g, SMELT_ACT_GELU, 0, pre);
      smelt_epi_reduce_node(&g, SMELT_EPI_ROW_REDUCE, SMELT_EPI_AMAX, g.out, 1);
      smelt_epi_reduce_node(&g, SMELT_EPI_COL_REDUCE, SMELT_EPI_SUM, pre, 2);
      break;
    }
    case G_RESIDUAL: {
      const int half = smelt_epi_binary(&g, SMELT_EPI_MUL, acc, smelt_epi_scalar(&g, 0.5f));
      const int sum = smelt_epi_binary(&g, SMELT_EPI_ADD, half, smelt_epi_input(&g, SMELT_EPI_AUX, 0));
      const int cl = smelt_epi_clamp(&g, sum, -1.5f, 1.25f);
      g.out = smelt_epi_cast(&g, cl, SMELT_DTYPE_E4M3);
      smelt_epi_reduce_node(&g, SMELT_EPI_COL_REDUCE, SMELT_EPI_RMAX, sum, 1);
      smelt_epi_reduce_node(&g, SMELT_EPI_ROW_REDUCE, SMELT_EPI_SUM, g.out, 2);
      break;
    }
    default: {
      const int lin = smelt_epi_binary(&g, SMELT_EPI_ADD, acc, smelt_epi_input(&g, SMELT_EPI_C, 0));
      /* One node a statement (an argument order is unspecified): the node
       * numbers match the variant list's graph (src/cuda/gemm_epi.c), whose
       * kernels the cache then holds. */
      const int row = smelt_epi_input(&g, SMELT_EPI_ROW, 0);
      const int col = smelt_epi_input(&g, SMELT_EPI_COL, 1);
      const int rc = smelt_epi_binary(&g, SMELT_EPI_MUL, row, col);
      const int x = smelt_epi_binary(&g, SMELT_EPI_SUB, lin, rc);
      const int y = smelt_epi_binary(&g, SMELT_EPI_MAX, x, smelt_epi_scalar(&g, -0.75f));
      const int z = smelt_epi_binary(&g, SMELT_EPI_MIN, y, smelt_epi_input(&g, SMELT_EPI_COL, 1));
      const int q = smelt_epi_binary(&g, SMELT_EPI_DIV, z, smelt_epi_scalar(&g, 3.0f));
      const int lr = smelt_epi_act(&g, SMELT_ACT_LEAKY_RELU, 0.1f, x);
      smelt_epi_store(&g, lr, 2);
      g.out = smelt_epi_binary(&g, SMELT_EPI_ADD, q, smelt_epi_act(&g, SMELT_ACT_SILU, 0, lr));
      smelt_epi_reduce_node(&g, SMELT_EPI_COL_REDUCE, SMELT_EPI_AMAX, g.out, 3);
      break;
    }
  }
  return g;
}

/* The slots each graph uses: dtype and kind (0 [M, N], 1 [M], 2 [N]); out
 * says whether the graph writes it. */
typedef struct slotdef {
  smelt_dtype dt;
  int kind, out;
} slotdef;

static int slots_of(int which, slotdef *s) {
  static const slotdef defs[G_COUNT][4] = {
      {{SMELT_DTYPE_BF16, 0, 1}, {SMELT_DTYPE_F32, 1, 1}, {SMELT_DTYPE_F32, 2, 1}},
      {{SMELT_DTYPE_BF16, 0, 0}, {SMELT_DTYPE_F32, 2, 1}, {SMELT_DTYPE_F32, 1, 1}},
      {{SMELT_DTYPE_F32, 1, 0}, {SMELT_DTYPE_BF16, 2, 0}, {SMELT_DTYPE_F16, 0, 1}, {SMELT_DTYPE_F32, 2, 1}},
  };
  memcpy(s, defs[which], sizeof defs[which]);
  return which == G_MIXED ? 4 : 3;
}

/* ---------------------------------------------------------------- a case */

typedef struct ecase {
  int graph;
  smelt_dtype ab, d;
  int64_t m, n, k;
  int b_col, ld16;      /* column-major B; leading dimensions rounded up to 16 elements */
  smelt_gemm_desc desc; /* the tile and opclass pick the kernel */
  const char *kernel;   /* with a GPU: a substring of the plan's description, or NULL */
} ecase;

static ecase make(int graph, smelt_dtype ab, smelt_dtype d, int64_t m, int64_t n, int64_t k) {
  ecase e = {.graph = graph, .ab = ab, .d = d, .m = m, .n = n, .k = k, .desc = smelt_gemm_desc_default()};
  e.desc.epilogue.alpha = 1.25;
  if (graph == G_MIXED) e.desc.epilogue.beta = 0.5;
  return e;
}

static th_view mat_view(int64_t rows, int64_t cols, int col_major, int ld16) {
  int64_t ld = col_major ? rows : cols;
  if (ld16) ld = (ld + 15) / 16 * 16;
  if (ld < 1) ld = 1;
  const int64_t shape[2] = {rows, cols}, strides[2] = {col_major ? 1 : ld, col_major ? ld : 1};
  return th_view_make(2, shape, strides, ld16 ? 16 : 1);
}

static th_view vec_view(int64_t n, int64_t stride) {
  const int64_t shape[1] = {n}, strides[1] = {stride};
  return th_view_make(1, shape, strides, 0);
}

typedef struct einputs {
  th_view va, vb, vc, vd, vbias, vslot[4];
  slotdef sd[4];
  int nslots;
  void *a, *b, *c, *bias, *slot[4]; /* host storage; output slots unused */
} einputs;

static void *filled(const th_view *v, smelt_dtype dt, double lo, double hi) {
  void *p = malloc((size_t)(v->storage + 1) * smelt_dtype_size(dt));
  th_fill_uniform(p, dt, v->storage + 1, lo, hi);
  return p;
}

static void inputs_new(const ecase *e, einputs *in) {
  in->va = mat_view(e->m, e->k, 0, e->ld16);
  in->vb = mat_view(e->k, e->n, e->b_col, e->ld16);
  in->vc = mat_view(e->m, e->n, 0, e->ld16);
  in->vd = mat_view(e->m, e->n, 0, e->ld16);
  in->vbias = vec_view(e->n, 1);
  in->nslots = slots_of(e->graph, in->sd);
  in->a = filled(&in->va, e->ab, -1, 1);
  in->b = filled(&in->vb, e->ab, -1, 1);
  in->c = filled(&in->vc, e->d, -1, 1);
  in->bias = filled(&in->vbias, SMELT_DTYPE_F32, -1, 1);
  for (int s = 0; s < in->nslots; s++) {
    const slotdef *d = &in->sd[s];
    /* Inputs with strides of their own: the residual column-major, the row
     * vector every other element; reductions contiguous. */
    in->vslot[s] = d->kind == 0 ? mat_view(e->m, e->n, !d->out, e->ld16)
                                : vec_view(d->kind == 1 ? e->m : e->n, d->out ? 1 : 2);
    in->slot[s] = filled(&in->vslot[s], d->dt, -1, 1);
  }
}

static void inputs_free(einputs *in) {
  free(in->a);
  free(in->b);
  free(in->c);
  free(in->bias);
  for (int s = 0; s < in->nslots; s++) free(in->slot[s]);
}

static double mat_at(const void *p, smelt_dtype dt, const th_view *v, int64_t r, int64_t c) {
  return th_get(p, dt, v->offset + r * v->strides[0] + c * v->strides[1]);
}

static double vec_at(const void *p, smelt_dtype dt, const th_view *v, int64_t i) {
  return th_get(p, dt, v->offset + i * v->strides[0]);
}

/* What a tensor of type dt keeps of v. */
static double kept(double v, smelt_dtype dt) {
  uint8_t tmp[8];
  th_set(tmp, dt, 0, (float)v);
  return th_get(tmp, dt, 0);
}

/* Outputs, decoded: D [M*N], and each slot [M*N], [M] or [N]. */
typedef struct eout {
  double *d, *slot[4];
} eout;

static void out_new(const ecase *e, const einputs *in, eout *o) {
  o->d = (double *)calloc((size_t)(e->m * e->n + 1), sizeof(double));
  for (int s = 0; s < 4; s++)
    o->slot[s] = s < in->nslots ? (double *)calloc((size_t)(in->vslot[s].numel + 1), sizeof(double)) : NULL;
}

static void out_free(eout *o) {
  free(o->d);
  for (int s = 0; s < 4; s++) free(o->slot[s]);
}

static double gelu(double x) { return 0.5 * x * erfc(-x / sqrt(2.0)); }
static double vmax(double a, double b) { return isnan(a) || isnan(b) ? NAN : a > b ? a : b; }

/* The graphs written out as formulas, in f64. */
static void naive(const ecase *e, const einputs *in, eout *o) {
  const int64_t M = e->m, N = e->n;
  const smelt_gemm_epilogue *ep = &e->desc.epilogue;
  for (int64_t s = 0; s < in->nslots; s++)
    if (in->sd[s].kind)
      for (int64_t i = 0; i < in->vslot[s].numel; i++)
        o->slot[s][i] = e->graph == G_RESIDUAL && s == 1 ? -INFINITY : 0.0;
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double acc = 0;
      for (int64_t k = 0; k < e->k; k++) acc += mat_at(in->a, e->ab, &in->va, i, k) * mat_at(in->b, e->ab, &in->vb, k, j);
      acc *= ep->alpha;
      double dv;
      if (e->graph == G_BIAS_GELU) {
        const double pre = acc + ((const float *)in->bias)[j];
        o->slot[0][i * N + j] = kept(pre, SMELT_DTYPE_BF16);
        dv = gelu(pre);
        o->slot[1][i] = vmax(o->slot[1][i], fabs(dv));
        o->slot[2][j] += pre;
      } else if (e->graph == G_RESIDUAL) {
        const double sum = 0.5 * acc + mat_at(in->slot[0], SMELT_DTYPE_BF16, &in->vslot[0], i, j);
        dv = kept(sum < -1.5 ? -1.5 : sum > 1.25 ? 1.25 : sum, SMELT_DTYPE_E4M3);
        o->slot[1][j] = vmax(o->slot[1][j], sum);
        o->slot[2][i] += dv;
      } else {
        const double col = vec_at(in->slot[1], SMELT_DTYPE_BF16, &in->vslot[1], j);
        const double x = acc + ep->beta * mat_at(in->c, e->d, &in->vc, i, j) -
                         vec_at(in->slot[0], SMELT_DTYPE_F32, &in->vslot[0], i) * col;
        double z = x > -0.75 ? x : -0.75;
        z = z < col ? z : col;
        const double lr = x >= 0 ? x : (double)0.1f * x; /* the node's f32 slope */
        o->slot[2][i * N + j] = kept(lr, SMELT_DTYPE_F16);
        dv = z / 3.0 + lr / (1.0 + exp(-lr));
        o->slot[3][j] = vmax(o->slot[3][j], fabs(dv));
      }
      o->d[i * N + j] = kept(dv, e->d);
    }
  for (int s = 0; s < in->nslots; s++)
    if (in->sd[s].kind)
      for (int64_t i = 0; i < in->vslot[s].numel; i++) o->slot[s][i] = kept(o->slot[s][i], SMELT_DTYPE_F32);
}

/* ---------------------------------------------------------------- running a case */

static th_buf upload(smelt_ctx *ctx, const th_view *v, const void *host, smelt_dtype dt) {
  th_buf b = th_buf_new(ctx, (size_t)(v->storage + 1) * smelt_dtype_size(dt));
  if (host) th_buf_upload(&b, host, b.bytes);
  return b;
}

/* Runs e on ctx `runs` times (outputs decoded into o after each run, every
 * element written and nothing else); returns the status. */
static smelt_status run_case(smelt_ctx *ctx, const ecase *e, const einputs *in, eout *o, int runs, eout *first,
                             const char *what) {
  th_buf A = upload(ctx, &in->va, in->a, e->ab), B = upload(ctx, &in->vb, in->b, e->ab),
         C = upload(ctx, &in->vc, in->c, e->d), Bias = upload(ctx, &in->vbias, in->bias, SMELT_DTYPE_F32),
         D = upload(ctx, &in->vd, NULL, e->d), S[4];
  const smelt_tensor ta = th_view_tensor(&in->va, &A, e->ab), tb = th_view_tensor(&in->vb, &B, e->ab),
                     tc = th_view_tensor(&in->vc, &C, e->d), td = th_view_tensor(&in->vd, &D, e->d),
                     tbias = th_view_tensor(&in->vbias, &Bias, SMELT_DTYPE_F32);
  smelt_tensor ts[4];
  smelt_epi_tensors epi = {.count = in->nslots};
  for (int s = 0; s < in->nslots; s++) {
    S[s] = upload(ctx, &in->vslot[s], in->sd[s].out ? NULL : in->slot[s], in->sd[s].dt);
    ts[s] = th_view_tensor(&in->vslot[s], &S[s], in->sd[s].dt);
    epi.t[s] = &ts[s];
  }
  const smelt_epi_graph g = graph_of(e->graph);
  smelt_gemm_desc desc = e->desc;
  desc.epilogue.graph = &g;
  const int has_c = desc.epilogue.beta != 0.0, has_bias = e->graph == G_BIAS_GELU;
  smelt_plan *plan = NULL;
  smelt_status st = smelt_gemm_epi_plan(ctx, &desc, &ta, &tb, has_c ? &tc : NULL, &td, has_bias ? &tbias : NULL, NULL,
                                        &epi, &plan);
  if (st == SMELT_OK && e->kernel && smelt_ctx_device(ctx) == SMELT_DEVICE_CUDA &&
      !strstr(smelt_plan_describe(plan), e->kernel))
    th_fail(__FILE__, __LINE__, "%s: the plan runs %s, want %s", what, smelt_plan_describe(plan), e->kernel);
  for (int r = 0; r < runs && st == SMELT_OK; r++) {
    st = smelt_gemm_epi_run(plan, &ta, &tb, has_c ? &tc : NULL, &td, has_bias ? &tbias : NULL, NULL, &epi);
    if (st == SMELT_OK) st = smelt_ctx_synchronize(ctx);
    if (st != SMELT_OK) break;
    eout *dst = r == 0 && runs > 1 ? first : o;
    th_check_output(what, "D", &in->vd, &D, e->d, dst->d);
    for (int s = 0; s < in->nslots; s++)
      if (in->sd[s].out) th_check_output(what, "a graph output", &in->vslot[s], &S[s], in->sd[s].dt, dst->slot[s]);
  }
  smelt_plan_destroy(plan);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&C);
  th_buf_free(&Bias);
  th_buf_free(&D);
  for (int s = 0; s < in->nslots; s++) th_buf_free(&S[s]);
  return st;
}

static double bound_of(const ecase *e, smelt_dtype out) {
  smelt_gemm_desc d = e->desc;
  const smelt__bound_query q = {.family = "gemm", .dtype = out, .dt_a = e->ab, .gemm = &d, .has_c = e->graph == G_MIXED};
  return smelt__error_bound(&q);
}

/* Compares every output of got against ref: stored tensors within the
 * GEMM's bound for their dtype, reductions within a looser one (sums
 * cancel; e4m3 values step by an eighth). */
static int compare(const ecase *e, const einputs *in, const eout *got, const eout *ref, double scale,
                   const char *label) {
  const double dbound = e->d == SMELT_DTYPE_E4M3 ? 0.07 : bound_of(e, e->d);
  /* The residual graph's D holds e4m3 values (at most 1.5): an f32
   * difference may round one of them a step (1/8) the other way. */
  const double dabs = e->d == SMELT_DTYPE_E4M3 ? 0.51 : e->graph == G_RESIDUAL ? 0.13 : 0;
  int ok = th_compare(label, got->d, ref->d, e->m * e->n, scale * dbound, dabs);
  for (int s = 0; s < in->nslots && ok; s++) {
    if (!in->sd[s].out) continue;
    const double b = in->sd[s].kind ? 1e-3 + bound_of(e, SMELT_DTYPE_F32) : bound_of(e, in->sd[s].dt);
    /* A row sum of e4m3 values moves by a whole step when one value rounds
     * the other way. */
    const double abs_b = e->graph == G_RESIDUAL && s == 2 ? 0.51 : 0;
    ok = th_compare(label, got->slot[s], ref->slot[s], in->vslot[s].numel, scale * b, abs_b);
  }
  return ok;
}

#define NAIVE_MACS ((int64_t)1 << 22)

/* The CPU reference against the formulas (small cases) and, with a GPU
 * (and `gpu`), CUDA against the CPU reference, run twice: the second run's
 * outputs bitwise equal to the first's. Returns 0 on a failure. */
static int check(const ecase *e, int gpu, const char *what) {
  char label[256];
  snprintf(label, sizeof label, "%s graph %d %s->%s B%c m%lld n%lld k%lld", what, e->graph, smelt_dtype_name(e->ab),
           smelt_dtype_name(e->d), e->b_col ? 'C' : 'R', (long long)e->m, (long long)e->n, (long long)e->k);
  einputs in;
  inputs_new(e, &in);
  eout ref, cpu, dev, dev1;
  out_new(e, &in, &ref);
  out_new(e, &in, &cpu);
  out_new(e, &in, &dev);
  out_new(e, &in, &dev1);
  const int fails = th_failed_now;
  smelt_status st = run_case(th_cpu(), e, &in, &cpu, 1, NULL, label);
  if (st != SMELT_OK) {
    th_fail(__FILE__, __LINE__, "%s: cpu: %s (%s)", label, smelt_status_name(st), smelt_last_error());
  } else if (e->m * e->n * e->k <= NAIVE_MACS) {
    naive(e, &in, &ref);
    if (!compare(e, &in, &cpu, &ref, 1e-3, label)) th_fail(__FILE__, __LINE__, "%s: cpu vs naive", label);
  }
  smelt_ctx *cu = th_cuda();
  if (th_failed_now == fails && gpu && cu) {
    st = run_case(cu, e, &in, &dev, 2, &dev1, label);
    if (st != SMELT_OK) {
      th_fail(__FILE__, __LINE__, "%s: cuda: %s (%s)", label, smelt_status_name(st), smelt_last_error());
    } else {
      if (!compare(e, &in, &dev, &cpu, 1.0, label)) th_fail(__FILE__, __LINE__, "%s: cuda vs cpu", label);
      for (int s = 0; s < in.nslots; s++)
        if (in.sd[s].out && memcmp(dev.slot[s], dev1.slot[s], sizeof(double) * (size_t)in.vslot[s].numel))
          th_fail(__FILE__, __LINE__, "%s: slot %d differs between two runs (not deterministic)", label, s);
    }
  }
  const int ok = th_failed_now == fails;
  if (!ok) th_fail(__FILE__, __LINE__, "case failed: %s", label);
  out_free(&ref);
  out_free(&cpu);
  out_free(&dev);
  out_free(&dev1);
  inputs_free(&in);
  return ok;
}

/* ---------------------------------------------------------------- CPU reference */

static const smelt_dtype d_of[G_COUNT] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F32, SMELT_DTYPE_BF16};

static void test_cpu_graphs(void) {
  static const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 9}, {33, 17, 40}, {65, 31, 3}, {5, 6, 0}};
  for (int g = 0; g < G_COUNT; g++)
    for (int si = 0; si < 5; si++) {
      ecase e = make(g, si % 2 ? SMELT_DTYPE_BF16 : SMELT_DTYPE_F32, d_of[g], shapes[si][0], shapes[si][1],
                     shapes[si][2]);
      e.b_col = si % 2;
      if (g == G_RESIDUAL && si == 2) e.d = SMELT_DTYPE_E4M3;
      if (!check(&e, 0, "cpu")) return;
    }
}

/* M or N = 0: reductions over an empty axis are written (0 for SUM and
 * AMAX, -inf for MAX); nothing else is. */
static void test_cpu_empty(void) {
  static const int64_t shapes[][3] = {{0, 5, 3}, {4, 0, 3}};
  for (int g = 0; g < G_COUNT; g++)
    for (int si = 0; si < 2; si++) {
      ecase e = make(g, SMELT_DTYPE_F32, d_of[g], shapes[si][0], shapes[si][1], shapes[si][2]);
      if (!check(&e, 1, "empty")) return;
    }
}

/* ---------------------------------------------------------------- bad graphs and tensors */

static void test_bad_graphs(void) {
  smelt_epi_graph g = graph_of(G_BIAS_GELU);
  CHECK_OK(smelt_epi_graph_check(&g));
  g.node[2].a = 2; /* a node reading itself: a cycle */
  CHECK_STATUS(smelt_epi_graph_check(&g), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("node 2 (ADD): operands a=2, b=1 must be earlier nodes (0..1)");
  g = graph_of(G_BIAS_GELU);
  g.node[4].lo = 1.0f; /* a field the op does not use */
  CHECK_STATUS(smelt_epi_graph_check(&g), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("lo and hi must be 0");
  g = graph_of(G_BIAS_GELU);
  g.node[3].slot = 2; /* the store writes the column sum's slot */
  CHECK_STATUS(smelt_epi_graph_check(&g), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("slot 2 is already used");
  g = graph_of(G_BIAS_GELU);
  g.out = 9;
  CHECK_STATUS(smelt_epi_graph_check(&g), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("out=9 is not a node");
  g = graph_of(G_RESIDUAL);
  g.node[6].dtype = SMELT_DTYPE_I8;
  CHECK_STATUS(smelt_epi_graph_check(&g), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("dtype=i8 is not one of");
  g = graph_of(G_RESIDUAL);
  g.node[5].lo = 2.0f; /* lo > hi */
  CHECK_STATUS(smelt_epi_graph_check(&g), SMELT_STATUS_INVALID_ARGUMENT);
  g = smelt_epi_graph_empty();
  for (int i = 0; i < SMELT_EPI_MAX_NODES + 1; i++) smelt_epi_input(&g, SMELT_EPI_ACC, 0);
  CHECK_STATUS(smelt_epi_graph_check(&g), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("count=33 is not 1..32");
}

/* Plans that must fail, each with D and every output slot untouched. */
static void test_bad_tensors(void) {
  smelt_ctx *cpu = th_cpu();
  const int64_t M = 6, N = 5, K = 4;
  th_buf A = th_buf_new(cpu, M * K * 4), B = th_buf_new(cpu, K * N * 4), D = th_buf_new(cpu, M * N * 4),
         P = th_buf_new(cpu, M * N * 2), R = th_buf_new(cpu, 2 * M * 4), S = th_buf_new(cpu, N * 4),
         Bias = th_buf_new(cpu, N * 4);
  float ones[64];
  for (int i = 0; i < 64; i++) ones[i] = 1.0f;
  th_buf_upload(&A, ones, A.bytes);
  th_buf_upload(&B, ones, B.bytes);
  th_buf_upload(&Bias, ones, Bias.bytes);
  const int64_t sa[2] = {M, K}, sb[2] = {K, N}, sd[2] = {M, N}, sm[1] = {M}, sn[1] = {N};
  const smelt_tensor ta = smelt_tensor_make(A.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sa),
                     tb = smelt_tensor_make(B.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sb),
                     td = smelt_tensor_make(D.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sd),
                     tp = smelt_tensor_make(P.data, SMELT_DTYPE_BF16, SMELT_DEVICE_CPU, 0, 2, sd),
                     tr = smelt_tensor_make(R.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sm),
                     ts = smelt_tensor_make(S.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sn),
                     tbias = smelt_tensor_make(Bias.data, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sn);
  const smelt_epi_graph g = graph_of(G_BIAS_GELU);
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.epilogue.graph = &g;
  smelt_epi_tensors epi = {3, {&tp, &tr, &ts}};
  smelt_plan *plan = NULL;
  /* The slots swapped: the row amax gets an [N] vector. */
  smelt_epi_tensors swapped = {3, {&tp, &ts, &tr}};
  CHECK_STATUS(smelt_gemm_epi_plan(cpu, &desc, &ta, &tb, NULL, &td, &tbias, NULL, &swapped, &plan),
               SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("epi->t[1].shape=[5] must be [M]=[6] (ROW_REDUCE)");
  /* A reduction with a stride. */
  smelt_tensor strided = tr;
  strided.strides[0] = 2;
  smelt_epi_tensors st2 = {3, {&tp, &strided, &ts}};
  CHECK_STATUS(smelt_gemm_epi_plan(cpu, &desc, &ta, &tb, NULL, &td, &tbias, NULL, &st2, &plan), SMELT_STATUS_BAD_LAYOUT);
  CHECK_MSG("epi->t[1].strides[0]=2 must be 1");
  /* The pre-activation store over D. */
  smelt_tensor over = td;
  over.dtype = SMELT_DTYPE_BF16;
  smelt_epi_tensors ov = {3, {&over, &tr, &ts}};
  CHECK_STATUS(smelt_gemm_epi_plan(cpu, &desc, &ta, &tb, NULL, &td, &tbias, NULL, &ov, &plan),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("overlaps D");
  /* A missing slot; a bias the graph does not read; no bias for its BIAS node. */
  smelt_epi_tensors few = {2, {&tp, &tr}};
  CHECK_STATUS(smelt_gemm_epi_plan(cpu, &desc, &ta, &tb, NULL, &td, &tbias, NULL, &few, &plan),
               SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("the graph uses slot 2");
  CHECK_STATUS(smelt_gemm_epi_plan(cpu, &desc, &ta, &tb, NULL, &td, NULL, NULL, &epi, &plan),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("the graph has a BIAS node but bias is NULL");
  /* An activation or a beta the graph does not express. */
  desc.epilogue.act = SMELT_ACT_RELU;
  CHECK_STATUS(smelt_gemm_epi_plan(cpu, &desc, &ta, &tb, NULL, &td, &tbias, NULL, &epi, &plan),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("must be identity and 1 with a graph");
  desc.epilogue.act = SMELT_ACT_IDENTITY;
  desc.epilogue.beta = 1.0;
  CHECK_STATUS(smelt_gemm_epi_plan(cpu, &desc, &ta, &tb, &td, &td, &tbias, NULL, &epi, &plan),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("has no C node but desc.epilogue.beta=1");
  desc.epilogue.beta = 0.0;
  /* Split-K and the other modes. */
  desc.split_k = 2;
  CHECK_STATUS(smelt_gemm_epi_plan(cpu, &desc, &ta, &tb, NULL, &td, &tbias, NULL, &epi, &plan),
               SMELT_STATUS_UNSUPPORTED);
  CHECK_MSG("serves plain GEMMs only");
  desc.split_k = 0;
  CHECK_STATUS(smelt_gemm_grouped(cpu, &desc, 1, &ta, &tb, NULL, &td, NULL), SMELT_STATUS_UNSUPPORTED);
  /* Tensors without a graph. */
  smelt_gemm_desc plain = smelt_gemm_desc_default();
  CHECK_STATUS(smelt_gemm_epi_plan(cpu, &plain, &ta, &tb, NULL, &td, NULL, NULL, &epi, &plan),
               SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("desc.epilogue.graph is NULL");
  CHECK(plan == NULL);
  CHECK(th_buf_untouched(&D) && th_buf_untouched(&P) && th_buf_untouched(&R) && th_buf_untouched(&S));
  /* A plan, then runs: a slot of another layout fails and writes nothing;
   * another pointer of the same layout runs. */
  CHECK_OK(smelt_gemm_epi_plan(cpu, &desc, &ta, &tb, NULL, &td, &tbias, NULL, &epi, &plan));
  smelt_tensor other = tr;
  other.strides[0] = 2;
  smelt_epi_tensors bad_run = {3, {&tp, &other, &ts}};
  CHECK_STATUS(smelt_gemm_epi_run(plan, &ta, &tb, NULL, &td, &tbias, NULL, &bad_run), SMELT_STATUS_BAD_LAYOUT);
  CHECK_STATUS(smelt_gemm_epi_run(plan, &ta, &tb, NULL, &td, &tbias, NULL, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_gemm_run(plan, &ta, &tb, NULL, &td, &tbias), SMELT_STATUS_NULL_POINTER);
  CHECK(th_buf_untouched(&D) && th_buf_untouched(&P) && th_buf_untouched(&R) && th_buf_untouched(&S));
  smelt_tensor moved = tr;
  moved.data = (float *)R.data + M;
  smelt_epi_tensors ok_run = {3, {&tp, &moved, &ts}};
  CHECK_OK(smelt_gemm_epi_run(plan, &ta, &tb, NULL, &td, &tbias, NULL, &ok_run));
  /* Every element of A @ B is K = 4, plus the bias 1: gelu(5) = 5 Phi(5). */
  float row[6];
  th_buf_download(&R, row, sizeof row);
  CHECK(th_all_ff(row, sizeof row));
  memcpy(row, (float *)R.data + M, sizeof row);
  for (int i = 0; i < M; i++) CHECK(fabs(row[i] - 5.0 * 0.5 * erfc(-5.0 / sqrt(2.0))) < 1e-6);
  smelt_plan_destroy(plan);
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
  th_buf_free(&P);
  th_buf_free(&R);
  th_buf_free(&S);
  th_buf_free(&Bias);
}

/* Row and column scales of A and B reach the graph's ACC node. */
static void test_cpu_scales(void) {
  smelt_ctx *cpu = th_cpu();
  const int64_t M = 3, N = 2, K = 1;
  float a[3] = {1, 2, 3}, b[2] = {4, 5}, sa[3] = {1, 0.5f, 2}, sb[2] = {3, -1}, d[6], amax[3];
  const int64_t sA[2] = {M, K}, sB[2] = {K, N}, sD[2] = {M, N}, sM[1] = {M}, sN[1] = {N};
  const smelt_tensor ta = smelt_tensor_make(a, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sA),
                     tb = smelt_tensor_make(b, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sB),
                     td = smelt_tensor_make(d, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, sD),
                     tsa = smelt_tensor_make(sa, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sM),
                     tsb = smelt_tensor_make(sb, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sN),
                     tamax = smelt_tensor_make(amax, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, sM);
  smelt_epi_graph g = smelt_epi_graph_empty();
  g.out = smelt_epi_input(&g, SMELT_EPI_ACC, 0);
  smelt_epi_reduce_node(&g, SMELT_EPI_ROW_REDUCE, SMELT_EPI_AMAX, g.out, 0);
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  desc.epilogue.graph = &g;
  desc.epilogue.alpha = 2.0;
  const smelt_gemm_scales sc = {&tsa, &tsb};
  const smelt_epi_tensors epi = {1, {&tamax}};
  CHECK_OK(smelt_gemm_epi(cpu, &desc, &ta, &tb, NULL, &td, NULL, &sc, &epi));
  for (int i = 0; i < M; i++) {
    double want = 0;
    for (int j = 0; j < N; j++) {
      const double v = 2.0 * sa[i] * sb[j] * a[i] * b[j];
      CHECK(fabs(d[i * N + j] - v) < 1e-5);
      want = fabs(v) > want ? fabs(v) : want;
    }
    CHECK(fabs(amax[i] - want) < 1e-5);
  }
}

/* The generator: a graph's kernel keeps the table kernel's prelude and
 * adds the graph's code, its name the table name and "_g" + 12 hex digits
 * of the code's hash; equal graphs give equal sources, different ones
 * different names; the longest graph fits the prelude. */
static void test_generator(void) {
  smelt__gemm_kernel t[SMELT__GEMM_MAX_KERNELS];
  const int n = smelt__gemm_table(t);
  REQUIRE(n > 0);
  static smelt__kernel_src base, s0, s1, s2;
  smelt_dtype dt[SMELT_EPI_MAX_TENSORS];
  for (int i = 0; i < SMELT_EPI_MAX_TENSORS; i++) dt[i] = SMELT_DTYPE_BF16;
  for (int k = 0; k < n; k++) {
    smelt__gemm_kernel_src(&t[k], &base);
    const smelt_epi_graph g0 = graph_of(G_BIAS_GELU), g1 = graph_of(G_MIXED);
    REQUIRE(smelt__gemm_graph_src(&t[k], &g0, dt, &s0) == 0 && smelt__gemm_graph_src(&t[k], &g0, dt, &s1) == 0 &&
            smelt__gemm_graph_src(&t[k], &g1, dt, &s2) == 0);
    CHECK(!strcmp(s0.name, s1.name) && !strcmp(s0.prelude, s1.prelude) && strcmp(s0.name, s2.name));
    CHECK(!strncmp(s0.name, base.name, strlen(base.name)) && strlen(s0.name) == strlen(base.name) + 14);
    CHECK(!strncmp(s0.prelude, base.prelude, strlen(base.prelude)) && strstr(s0.prelude, "#define SMELT_EPI_GRAPH 1"));
    CHECK(strstr(s0.prelude, "gemm_act(v2, ACT_GELU,") && strstr(s2.prelude, "epi_min("));
  }
  /* 32 nodes of the longest kind: clamps with two constants each. */
  smelt_epi_graph big = smelt_epi_graph_empty();
  int x = smelt_epi_input(&big, SMELT_EPI_ACC, 0);
  while (big.count < SMELT_EPI_MAX_NODES) x = smelt_epi_clamp(&big, x, -1.23456789e-30f, 9.87654321e+30f);
  big.out = x;
  CHECK_OK(smelt_epi_graph_check(&big));
  for (int k = 0; k < n; k++) CHECK(smelt__gemm_graph_src(&t[k], &big, dt, &s0) == 0);
  /* Stores, whose two lines a node are the longest code. */
  big = smelt_epi_graph_empty();
  x = smelt_epi_input(&big, SMELT_EPI_ACC, 0);
  while (big.count < SMELT_EPI_MAX_NODES) x = smelt_epi_store(&big, x, big.count % SMELT_EPI_MAX_TENSORS);
  big.out = x;
  for (int k = 0; k < n; k++) CHECK(smelt__gemm_graph_src(&t[k], &big, dt, &s0) == 0);
}

/* ---------------------------------------------------------------- GPU */

/* mma.sync (K tile 32: no Hopper tile has it), bf16 with B column-major,
 * and once B row-major and once f16, at odd M, N and K with a tile half
 * past each edge; SIMT for f32. Few distinct kernels: each graph is a
 * module of its own, compiled on first use. */
static void test_gpu_mma_simt(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  static const int64_t shapes[][3] = {{7, 13, 9}, {129, 131, 200}, {257, 75, 520}};
  for (int g = 0; g < G_COUNT; g++)
    for (int si = 0; si < 3; si++) {
      ecase e = make(g, g == G_MIXED && si == 2 ? SMELT_DTYPE_F16 : SMELT_DTYPE_BF16, d_of[g], shapes[si][0],
                     shapes[si][1], shapes[si][2]);
      e.b_col = !(g == G_BIAS_GELU && si == 1);
      e.ld16 = 1;
      e.desc.math.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
      e.desc.tile.k = 32;
      e.kernel = "gemm_sm80";
      if (g == G_RESIDUAL && si == 2) e.d = SMELT_DTYPE_E4M3;
      if (!check(&e, 1, "mma.sync")) return;
    }
  for (int g = 0; g < G_COUNT; g++) {
    ecase e = make(g, SMELT_DTYPE_F32, SMELT_DTYPE_F32, 67, 70, 33);
    e.desc.math.opclass = SMELT_GEMM_OPCLASS_SIMT;
    e.kernel = "gemm_simt";
    if (!check(&e, 1, "simt")) return;
  }
}

/* The Hopper kernel's general epilogue on its wide bf16 tile (the compile
 * suite's graph variants): M past a tile's half, N not a multiple of 8,
 * operands through the row-pitch copy (K 200, 130) and as they are (K 256:
 * rows whole 128-byte lines apart); then the 64-row tile for one row, and
 * more tiles than SMs (each CTA runs several). */
static void test_gpu_sm90(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  if (!th_cuda_sm90()) SKIP("not an sm_90 device");
  static const int64_t shapes[][3] = {{129, 264, 200}, {60, 136, 130}, {300, 517, 256}, {1, 40, 128},
                                      {2100, 2304, 16}};
  for (int g = 0; g < G_COUNT; g++)
    for (int si = 0; si < 5; si++) {
      if (si >= 3 && g != G_BIAS_GELU) continue;
      ecase e = make(g, SMELT_DTYPE_BF16, d_of[g], shapes[si][0], shapes[si][1], shapes[si][2]);
      e.b_col = 1;
      e.ld16 = 1;
      e.desc.tile.m = si == 3 ? 64 : 128;
      e.desc.tile.n = si == 3 ? 64 : 256;
      e.kernel = "gemm_sm90";
      if (!check(&e, 1, "sm90")) return;
    }
}

const th_test th_tests_epi_graph[] = {
    {"cpu_graphs", test_cpu_graphs},
    {"cpu_empty", test_cpu_empty},
    {"bad_graphs", test_bad_graphs},
    {"bad_tensors", test_bad_tensors},
    {"cpu_scales", test_cpu_scales},
    {"generator", test_generator},
    {"gpu_mma_simt", test_gpu_mma_simt},
    {"gpu_sm90", test_gpu_sm90},
    {0, 0},
};
