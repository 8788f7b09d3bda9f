/* An epilogue graph's run on CUDA around the GEMM kernel: the slots'
 * pointers and strides for the kernel (epi_ptrs), the reductions' partials
 * in a workspace, and their second pass (kernels/gemm_epi_reduce.cu). Also
 * the graph variants the compile suite builds.
 *
 * Partials: reduction j writes chunks x len f32 values, len M for a row
 * reduction and N for a column one; chunks follow the kernel's epilogue
 * (kernels/gemm_epi_graph.cuh): ceil(N / 32) for rows, and for columns
 * tiles_m x (threads / BN) in gemm_finish_graph (SIMT, mma.sync) or
 * ceil(M / 64) x 4 in the Hopper kernel's 64-row chunks. */
#include "gemm_cuda.h"

#include <stdio.h>
#include <string.h>

static int is_reduce(const smelt_epi_node *n) {
  return n->op == SMELT_EPI_ROW_REDUCE || n->op == SMELT_EPI_COL_REDUCE;
}

static int64_t chunks_of(const smelt__gemm_kernel *k, const smelt_epi_node *n, const smelt__gemm_prob *p) {
  if (n->op == SMELT_EPI_ROW_REDUCE) return smelt__ceil_div(p->n, 32);
  if (k->fam == SMELT__GK_SM90) return smelt__ceil_div(p->m, 64) * 4;
  return smelt__ceil_div(p->m, k->bm) * (k->threads / k->bn);
}

void smelt__gemm_src_for(const smelt__gemm_state *st, const smelt__gemm_kernel *k, smelt__kernel_src *src) {
  smelt_dtype dt[SMELT_EPI_MAX_TENSORS];
  for (int s = 0; s < SMELT_EPI_MAX_TENSORS; s++) dt[s] = st->has_graph ? st->epi_t[s].dtype : SMELT_DTYPE_F32;
  /* The plan checked that the graph fits (smelt__gemm_graph_src). */
  if (!st->has_graph || smelt__gemm_graph_src(k, &st->graph, dt, src)) smelt__gemm_kernel_src(k, src);
}

void smelt__gemm_epi_reduce_src(smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "gemm_epi_reduce");
  src->body = "gemm_epi_reduce.cu";
}

smelt_status smelt__gemm_epi_begin(smelt_ctx *ctx, const smelt__gemm_state *st, const smelt__gemm_kernel *k,
                                   const smelt__gemm_prob *p, smelt__epi_kptrs *E, void **ws) {
  memset(E, 0, sizeof *E);
  *ws = NULL;
  for (int s = 0; s < p->epi.count; s++) {
    E->data[s] = (uint64_t)(uintptr_t)p->epi.data[s];
    E->rs[s] = p->epi.rs[s];
    E->cs[s] = p->epi.cs[s];
  }
  size_t bytes = 0, at[SMELT_EPI_MAX_TENSORS];
  int j = 0;
  for (int i = 0; i < st->graph.count; i++) {
    const smelt_epi_node *n = &st->graph.node[i];
    if (!is_reduce(n)) continue;
    at[j++] = bytes;
    const int64_t len = n->op == SMELT_EPI_ROW_REDUCE ? p->m : p->n;
    bytes += (size_t)(chunks_of(k, n, p) * len) * sizeof(float);
  }
  if (bytes == 0) return SMELT_OK;
  smelt_status s = smelt__cuda_alloc(ctx, bytes, ws);
  if (s) return s;
  for (int r = 0; r < j; r++) E->part[r] = (uint64_t)(uintptr_t)*ws + at[r];
  return SMELT_OK;
}

smelt_status smelt__gemm_epi_end(smelt_ctx *ctx, void *f, const smelt__gemm_state *st, const smelt__gemm_kernel *k,
                                 const smelt__gemm_prob *p, const smelt__epi_kptrs *E, void *ws, smelt_status s) {
  int j = 0;
  for (int i = 0; i < st->graph.count && !s; i++) {
    const smelt_epi_node *n = &st->graph.node[i];
    if (!is_reduce(n)) continue;
    const float *part = (const float *)(uintptr_t)E->part[j++];
    int64_t chunks = chunks_of(k, n, p), len = n->op == SMELT_EPI_ROW_REDUCE ? p->m : p->n;
    /* An empty GEMM writes no partials: the outputs get the identity. */
    if (p->m == 0 || p->n == 0) chunks = 0;
    int kind = n->reduce == SMELT_EPI_SUM ? 0 : n->reduce == SMELT_EPI_RMAX ? 1 : 2;
    void *out = (void *)p->epi.data[n->slot];
    void *params[] = {&part, &chunks, &len, &kind, &out};
    const int64_t blocks = smelt__ceil_div(len, 256) < 1024 ? smelt__ceil_div(len, 256) : 1024;
    if (len > 0) s = smelt__cuda_launch(ctx, "smelt_gemm", (CUfunction)f, (unsigned)blocks, 1, 1, 256, 0, params);
  }
  if (ws) {
    const smelt_status s2 = smelt__cuda_free(ctx, ws);
    if (!s) s = s2;
  }
  return s;
}

/* ---------------------------------------------------------------- the compile suite's graphs */

/* Three graphs that use every kind of node, as tests/test_epi_graph.c
 * runs them: D = gelu(acc + bias) with acc + bias stored (bf16), a row
 * abs-max and a column sum (the bench's graph); D = e4m3(clamp(acc / 2 +
 * aux)) with a column max and a row sum; C, row and column vectors, every
 * binary op, leaky_relu and silu, an f16 store and a column abs-max. */
static smelt_epi_graph compile_graph(int which, smelt_dtype *dt) {
  /* Node by node in the tests' order (one call a statement: the order of
   * a call's arguments is unspecified, and the node numbers name the
   * generated source's values, so another order is another kernel). */
  smelt_epi_graph g = smelt_epi_graph_empty();
  const int acc = smelt_epi_input(&g, SMELT_EPI_ACC, 0);
  for (int s = 0; s < SMELT_EPI_MAX_TENSORS; s++) dt[s] = SMELT_DTYPE_F32;
  dt[0] = which == 2 ? SMELT_DTYPE_F32 : SMELT_DTYPE_BF16;
  if (which == 0) {
    const int bias = smelt_epi_input(&g, SMELT_EPI_BIAS, 0);
    const int pre = smelt_epi_binary(&g, SMELT_EPI_ADD, acc, bias);
    smelt_epi_store(&g, pre, 0);
    g.out = smelt_epi_act(&g, SMELT_ACT_GELU, 0, pre);
    smelt_epi_reduce_node(&g, SMELT_EPI_ROW_REDUCE, SMELT_EPI_AMAX, g.out, 1);
    smelt_epi_reduce_node(&g, SMELT_EPI_COL_REDUCE, SMELT_EPI_SUM, pre, 2);
  } else if (which == 1) {
    const int k = smelt_epi_scalar(&g, 0.5f);
    const int half = smelt_epi_binary(&g, SMELT_EPI_MUL, acc, k);
    const int aux = smelt_epi_input(&g, SMELT_EPI_AUX, 0);
    const int sum = smelt_epi_binary(&g, SMELT_EPI_ADD, half, aux);
    const int cl = smelt_epi_clamp(&g, sum, -1.5f, 1.25f);
    g.out = smelt_epi_cast(&g, cl, SMELT_DTYPE_E4M3);
    smelt_epi_reduce_node(&g, SMELT_EPI_COL_REDUCE, SMELT_EPI_RMAX, sum, 1);
    smelt_epi_reduce_node(&g, SMELT_EPI_ROW_REDUCE, SMELT_EPI_SUM, g.out, 2);
  } else {
    dt[1] = SMELT_DTYPE_BF16;
    dt[2] = SMELT_DTYPE_F16;
    const int c = smelt_epi_input(&g, SMELT_EPI_C, 0);
    const int lin = smelt_epi_binary(&g, SMELT_EPI_ADD, acc, c);
    const int row = smelt_epi_input(&g, SMELT_EPI_ROW, 0);
    const int col = smelt_epi_input(&g, SMELT_EPI_COL, 1);
    const int rc = smelt_epi_binary(&g, SMELT_EPI_MUL, row, col);
    const int x = smelt_epi_binary(&g, SMELT_EPI_SUB, lin, rc);
    const int lo = smelt_epi_scalar(&g, -0.75f);
    const int y = smelt_epi_binary(&g, SMELT_EPI_MAX, x, lo);
    const int col2 = smelt_epi_input(&g, SMELT_EPI_COL, 1);
    const int z = smelt_epi_binary(&g, SMELT_EPI_MIN, y, col2);
    const int three = smelt_epi_scalar(&g, 3.0f);
    const int q = smelt_epi_binary(&g, SMELT_EPI_DIV, z, three);
    const int lr = smelt_epi_act(&g, SMELT_ACT_LEAKY_RELU, 0.1f, x);
    smelt_epi_store(&g, lr, 2);
    const int si = smelt_epi_act(&g, SMELT_ACT_SILU, 0, lr);
    g.out = smelt_epi_binary(&g, SMELT_EPI_ADD, q, si);
    smelt_epi_reduce_node(&g, SMELT_EPI_COL_REDUCE, SMELT_EPI_AMAX, g.out, 3);
  }
  return g;
}

/* Each graph on a kernel of each family that takes one: the Hopper
 * kernel's wide bf16 tile, mma.sync's large bf16 tile (both RC) and the
 * f32 SIMT kernel; then the reductions' second pass. */
int smelt__gemm_graph_variants(smelt__kernel_src *out, int max) {
  smelt__gemm_kernel t[SMELT__GEMM_MAX_KERNELS];
  const int n = smelt__gemm_table(t);
  int pick[3] = {-1, -1, -1}, count = 0;
  for (int i = n - 1; i >= 0; i--) {
    const smelt__gemm_kernel *k = &t[i];
    const int rc = k->a_kmajor && k->b_kmajor && !k->pingpong && k->cluster_m * k->cluster_n == 1;
    if (k->fam == SMELT__GK_SM90 && k->tc == SMELT__TC_BF16 && k->bn == 256 && rc) pick[0] = i;
    if (k->fam == SMELT__GK_SM80 && k->tc == SMELT__TC_BF16 && k->bm == 128 && rc) pick[1] = i;
    if (k->fam == SMELT__GK_SIMT && k->acc == SMELT_GEMM_ACC_F32) pick[2] = i;
  }
  for (int g = 0; g < 3; g++)
    for (int f = 0; f < 3; f++) {
      smelt_dtype dt[SMELT_EPI_MAX_TENSORS];
      const smelt_epi_graph graph = compile_graph(g, dt);
      smelt__kernel_src src;
      if (pick[f] < 0 || smelt__gemm_graph_src(&t[pick[f]], &graph, dt, &src)) continue;
      if (count < max) out[count] = src;
      count++;
    }
  if (count < max) smelt__gemm_epi_reduce_src(&out[count]);
  return count + 1;
}
