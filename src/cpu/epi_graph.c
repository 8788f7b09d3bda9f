/* CPU reference of an epilogue graph (smelt/epilogue.h): the oracle the
 * generated CUDA epilogues are checked against.
 *
 * Naive on purpose: every node of the graph is evaluated for every element
 * in f64, in node order. Row reductions accumulate in f64 along the row in
 * ascending n and are stored at the row's end; column reductions
 * accumulate in a scratch of N doubles a slot (the caller's, from the GEMM
 * reference's scratch) in ascending m and are stored after the last row.
 * Stores convert as D does (smelt/gemm.h, with the description's clamp);
 * D itself is left to the GEMM reference, which gets each row's values. */
#include "../core/gemm_internal.h"

#include <math.h>
#include <stdint.h>

static double reduce_init(smelt_epi_reduce r) { return r == SMELT_EPI_RMAX ? -INFINITY : 0.0; }

/* One step of a reduction; MAX and AMAX keep a NaN once they see one. */
static double reduce_step(smelt_epi_reduce r, double acc, double v) {
  if (r == SMELT_EPI_SUM) return acc + v;
  if (r == SMELT_EPI_AMAX) v = fabs(v);
  if (isnan(acc) || isnan(v)) return NAN;
  return v > acc ? v : acc;
}

/* v as the value a tensor of type dt would keep. */
static double cast(smelt_dtype dt, double v) {
  uint64_t cell = 0;
  smelt__store_f64(&cell, dt, 0, v);
  return smelt__load_f64(&cell, dt, 0);
}

static double binary(smelt_epi_op op, double a, double b) {
  switch (op) {
    case SMELT_EPI_ADD: return a + b;
    case SMELT_EPI_SUB: return a - b;
    case SMELT_EPI_MUL: return a * b;
    case SMELT_EPI_DIV: return a / b;
    case SMELT_EPI_MAX: return isnan(a) || isnan(b) ? NAN : a > b ? a : b;
    default: return isnan(a) || isnan(b) ? NAN : a < b ? a : b; /* MIN */
  }
}

static const void *at(const smelt__epi_slots *e, int s, int64_t m, int64_t n, int64_t *off) {
  *off = m * e->rs[s] + n * e->cs[s];
  return e->data[s];
}

/* Stores v into a STORE slot (a float dtype) as smelt/gemm.h converts D. */
static void put(void *base, smelt_dtype dt, int64_t off, double v, int clamp) {
  if (clamp) v = smelt__clamp_finite(dt, v);
  smelt__store_f64(base, dt, off, v);
}

void smelt__cpu_epi_begin(const smelt__gemm_state *st, const smelt__gemm_prob *p, double *red) {
  const smelt_epi_graph *g = &st->graph;
  for (int i = 0; i < g->count; i++)
    if (g->node[i].op == SMELT_EPI_COL_REDUCE)
      for (int64_t n = 0; n < p->n; n++) red[g->node[i].slot * p->n + n] = reduce_init(g->node[i].reduce);
}

void smelt__cpu_epi_row(const smelt__gemm_state *st, const smelt__gemm_prob *p, int64_t i, double *acc,
                        double *red) {
  const smelt_epi_graph *g = &st->graph;
  const smelt__epi_slots *e = &p->epi;
  const smelt_gemm_epilogue *ep = &st->desc.epilogue;
  double rowred[SMELT_EPI_MAX_NODES];
  for (int k = 0; k < g->count; k++) rowred[k] = reduce_init(g->node[k].reduce);
  for (int64_t j = 0; j < p->n; j++) {
    double v[SMELT_EPI_MAX_NODES] = {0};
    for (int k = 0; k < g->count; k++) {
      const smelt_epi_node *nd = &g->node[k];
      const double a = v[nd->a], b = v[nd->b];
      int64_t off;
      switch (nd->op) {
        case SMELT_EPI_ACC: v[k] = acc[j]; break;
        case SMELT_EPI_C: v[k] = ep->beta * smelt__load_f64(p->c.data, st->dt_c, i * p->c.rs + j * p->c.cs); break;
        case SMELT_EPI_BIAS: v[k] = smelt__load_f64(p->bias, st->dt_bias, j * p->bias_s); break;
        case SMELT_EPI_ROW:
        case SMELT_EPI_COL:
        case SMELT_EPI_AUX: {
          const void *base = at(e, nd->slot, i, j, &off);
          v[k] = smelt__load_f64(base, e->dt[nd->slot], off);
          break;
        }
        case SMELT_EPI_SCALAR: v[k] = nd->value; break;
        case SMELT_EPI_ACT: v[k] = smelt_act_apply(nd->act, a, nd->slope); break;
        case SMELT_EPI_CLAMP: v[k] = isnan(a) ? a : a < nd->lo ? nd->lo : a > nd->hi ? nd->hi : a; break;
        case SMELT_EPI_CAST: v[k] = cast(nd->dtype, a); break;
        case SMELT_EPI_STORE: {
          void *base = (void *)at(e, nd->slot, i, j, &off);
          put(base, e->dt[nd->slot], off, a, ep->clamp);
          v[k] = a;
          break;
        }
        case SMELT_EPI_ROW_REDUCE:
          rowred[k] = reduce_step(nd->reduce, rowred[k], a);
          v[k] = a;
          break;
        case SMELT_EPI_COL_REDUCE:
          red[nd->slot * p->n + j] = reduce_step(nd->reduce, red[nd->slot * p->n + j], a);
          v[k] = a;
          break;
        default: v[k] = binary(nd->op, a, b); break;
      }
    }
    acc[j] = v[g->out];
  }
  for (int k = 0; k < g->count; k++)
    if (g->node[k].op == SMELT_EPI_ROW_REDUCE) {
      const int s = g->node[k].slot;
      smelt__store_f64((void *)e->data[s], SMELT_DTYPE_F32, i * e->rs[s], rowred[k]);
    }
}

void smelt__cpu_epi_end(const smelt__gemm_state *st, const smelt__gemm_prob *p, const double *red) {
  const smelt_epi_graph *g = &st->graph;
  const smelt__epi_slots *e = &p->epi;
  for (int k = 0; k < g->count; k++)
    if (g->node[k].op == SMELT_EPI_COL_REDUCE) {
      const int s = g->node[k].slot;
      for (int64_t n = 0; n < p->n; n++) smelt__store_f64((void *)e->data[s], SMELT_DTYPE_F32, n * e->cs[s], red[s * p->n + n]);
    }
}
