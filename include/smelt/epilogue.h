/* smelt epilogue graphs: a GEMM's epilogue written as a small DAG, after
 * CUTLASS's Epilogue Visitor Tree.
 *
 * The graph is evaluated once per output element (m, n) of D [M, N], in f64
 * on the CPU and in the kernel's epilogue type on a GPU (f32; f64 for f64
 * and i32 accumulators). Its nodes are numbered 0 .. count - 1 and each
 * operand names an earlier node, so every graph is acyclic by construction.
 *
 * Inputs (a value per element):
 *   ACC     alpha · scale_a · scale_b · sa[m] · sb[n] · (A @ B)[m, n]
 *           (smelt/gemm.h; the scales are 1 where absent)
 *   C       beta · C[m, n]; a graph has a C node exactly when desc beta != 0
 *   BIAS    bias[n], the smelt_gemm bias argument; a graph has a BIAS node
 *           exactly when a bias is given
 *   ROW     tensors.t[slot][m], a vector [M] (one per row, broadcast over N)
 *   COL     tensors.t[slot][n], a vector [N] (broadcast over M)
 *   AUX     tensors.t[slot][m, n], a matrix [M, N] like D (e.g. a residual)
 *   SCALAR  the node's `value`
 * Value ops (a, b: operand node ids):
 *   ADD a + b, SUB a - b, MUL a · b, DIV a / b, MAX, MIN (NaN propagates)
 *   ACT     act(a) with the node's `act` and `slope` (every smelt_act)
 *   CLAMP   min(max(a, lo), hi) (NaN stays NaN)
 *   CAST    a rounded to `dtype` (f32, f16, bf16, e4m3, e5m2: nearest even,
 *           fp8 saturating) and read back: the value a store would keep
 * Outputs (their value is their operand's, so they may feed later nodes):
 *   STORE   tensors.t[slot][m, n] = convert(a), a matrix [M, N] of its own
 *           float dtype (f32, f16, bf16, e4m3, e5m2), converted as D is
 *           (e.g. the pre-activation kept for the backward)
 *   ROW_REDUCE  tensors.t[slot][m] = reduce over n of a: an f32 vector [M]
 *   COL_REDUCE  tensors.t[slot][n] = reduce over m of a: an f32 vector [N]
 *           `reduce` is SUM, MAX or AMAX (max of |a|, the amax an fp8
 *           quantizer needs); MAX and AMAX propagate NaN. A reduction over
 *           an empty axis gives 0 (SUM, AMAX) or -inf (MAX).
 * D[m, n] = convert(value of node `out`) as smelt/gemm.h converts (desc
 * clamp applies, to STOREs too); with a graph, desc act must be IDENTITY
 * and scale_d 1 (the graph says what it wants).
 *
 * Determinism: reductions take no float atomics. On a GPU each tile writes
 * per-chunk partials (32 columns for a row reduction, a fixed band of rows
 * for a column one) in a fixed order and a second pass combines the
 * partials in ascending order, so two runs give bitwise equal results; the
 * sum's order differs from the CPU's, within f32 rounding.
 *
 * Tensor slots: tensors.t[0 .. count-1], each on the context's device, used
 * by at most one kind of node (an input slot is never an output slot). An
 * output must not overlap A, B, C, D, bias, the scales or any other slot.
 * Row and column vectors and reductions are 1-D [M] or [N] (inputs: any
 * dtype of f32, f16, bf16, any stride; reductions: f32, stride 1); AUX and
 * STORE are 2-D [M, N] with any strides (STORE must not overlap itself).
 *
 * Scope: plain GEMMs (2-D operands, mode AUTO or PLAIN, split_k 0 or 1).
 * On CUDA the graph is generated as CUDA C into the mma.sync, SIMT and
 * Hopper wgmma kernels and runs in their general (element-store) epilogue,
 * never the Hopper kernel's TMA-store one; see docs/API.md. Its GPU tests
 * pass on the H100; it is not yet timed against the plain GEMM.
 */
#ifndef SMELT_EPILOGUE_H
#define SMELT_EPILOGUE_H

#include "../smelt.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SMELT_EPI_MAX_NODES 32
#define SMELT_EPI_MAX_TENSORS 8

typedef enum smelt_epi_op {
  SMELT_EPI_ACC = 0,
  SMELT_EPI_C,
  SMELT_EPI_BIAS,
  SMELT_EPI_ROW,
  SMELT_EPI_COL,
  SMELT_EPI_AUX,
  SMELT_EPI_SCALAR,
  SMELT_EPI_ADD,
  SMELT_EPI_SUB,
  SMELT_EPI_MUL,
  SMELT_EPI_DIV,
  SMELT_EPI_MAX,
  SMELT_EPI_MIN,
  SMELT_EPI_ACT,
  SMELT_EPI_CLAMP,
  SMELT_EPI_CAST,
  SMELT_EPI_STORE,
  SMELT_EPI_ROW_REDUCE,
  SMELT_EPI_COL_REDUCE,
  SMELT_EPI_OP_COUNT
} smelt_epi_op;

typedef enum smelt_epi_reduce {
  SMELT_EPI_SUM = 0,
  SMELT_EPI_RMAX, /* max */
  SMELT_EPI_AMAX, /* max of |x| */
  SMELT_EPI_REDUCE_COUNT
} smelt_epi_reduce;

/* One node. Fields an op does not use must be 0 (so equal graphs are equal
 * bytes; smelt_epi_* builders below keep it so). */
typedef struct smelt_epi_node {
  smelt_epi_op op;
  int a, b;                /* operand node ids, each < this node's id (b for binary ops only) */
  int slot;                /* ROW, COL, AUX, STORE, *_REDUCE: index into smelt_epi_tensors.t */
  smelt_act act;           /* ACT */
  float slope;             /* ACT leaky_relu */
  float value, lo, hi;     /* SCALAR; CLAMP bounds (lo <= hi) */
  smelt_dtype dtype;       /* CAST */
  smelt_epi_reduce reduce; /* *_REDUCE */
} smelt_epi_node;

/* The graph, inline (copyable with =, comparable with memcmp). */
typedef struct smelt_epi_graph {
  int count;                              /* nodes used, 1 .. SMELT_EPI_MAX_NODES */
  int out;                                /* the node whose value D gets */
  smelt_epi_node node[SMELT_EPI_MAX_NODES];
} smelt_epi_graph;

/* The tensors the graph's slots name (a run binds the same views). */
typedef struct smelt_epi_tensors {
  int count;
  const smelt_tensor *t[SMELT_EPI_MAX_TENSORS];
} smelt_epi_tensors;

/* Builders: each appends a node to g and returns its id, or -1 when g is
 * full (validation then reports it). */
SMELT_API smelt_epi_graph smelt_epi_graph_empty(void);
SMELT_API int smelt_epi_input(smelt_epi_graph *g, smelt_epi_op op, int slot); /* ACC, C, BIAS, ROW, COL, AUX */
SMELT_API int smelt_epi_scalar(smelt_epi_graph *g, float value);
SMELT_API int smelt_epi_binary(smelt_epi_graph *g, smelt_epi_op op, int a, int b); /* ADD .. MIN */
SMELT_API int smelt_epi_act(smelt_epi_graph *g, smelt_act act, float slope, int a);
SMELT_API int smelt_epi_clamp(smelt_epi_graph *g, int a, float lo, float hi);
SMELT_API int smelt_epi_cast(smelt_epi_graph *g, int a, smelt_dtype dtype);
SMELT_API int smelt_epi_store(smelt_epi_graph *g, int a, int slot);
SMELT_API int smelt_epi_reduce_node(smelt_epi_graph *g, smelt_epi_op op, smelt_epi_reduce how, int a, int slot);

/* Checks g alone (ids, ops, fields), as planning does; the message names
 * the node. */
SMELT_API smelt_status smelt_epi_graph_check(const smelt_epi_graph *g);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_EPILOGUE_H */
