/* smelt graphs: the fusion planner. The caller lists ops over tensors; smelt
 * groups them into the fewest kernels its fused kernels allow, plans each
 * group once on the context (CPU or CUDA alike, through the public ops of
 * the other headers) and runs them in order. Included by smelt.h.
 *
 * Tensors are numbered from 0 in the order they are declared:
 *   input         a caller's tensor the graph reads
 *   output        a caller's tensor the graph writes
 *   intermediate  a tensor of the graph's own: an op writes it, others read
 *                 it; shape and dtype only. One that is fused away is never
 *                 materialized; the others get workspace the graph owns,
 *                 from the context's pool, at plan time.
 * Every output and intermediate is written by exactly one op; inputs by
 * none. Outputs share no memory with each other or with inputs.
 *
 * Ops and their shapes (every op's output has its input's dtype):
 *   gemm      d = alpha · a @ b           a [M, K], b [K, N], d [M, N]; the dtypes
 *                                         smelt_gemm takes; desc math, tile and
 *                                         alpha (bias, activation and residual
 *                                         are ops of their own)
 *   bias      y = x + bias[n]             x, y [M, N]; bias [N] f32, f16 or bf16
 *   act       y = act(x)                  any shape; f32, f16, bf16
 *   binary    y = a op b                  add, sub, mul, div, max, min; a, b, y
 *                                         one shape and dtype (f32, f16, bf16)
 *   residual  y = x + residual            as binary add (the residual stream)
 *   norm      y = norm(x) · w + b         smelt_norm: x, y [..., C]; weight,
 *                                         bias [C] or absent
 *   rotary    y = rope(x)                 smelt_rotary: x, y [B, S, H, D]; cos,
 *                                         sin f32 [P, R/2]; positions or absent
 *   attention o = attn(q, k, v)           smelt_attention_fwd (no modifier
 *                                         tensors, no lse)
 *   softmax   y = softmax(x)              over the last dim
 * An absent optional tensor is -1.
 *
 * The fusion rules (docs/OPS.md, "Fusion planner", has the reasons):
 *   1. An elementwise chain (bias, act, binary, residual) after a GEMM
 *      becomes that GEMM's epilogue: the fixed one (bias, one [M, N] add as
 *      C, then one activation) when the chain fits it, else an epilogue
 *      graph (smelt/epilogue.h; a [M, N] operand as C or an AUX slot, a
 *      [N] one as BIAS or a COL slot). A chain also starts at an
 *      elementwise op that no GEMM absorbed: a GEMM with K = 0 carries it.
 *   2. A link of a chain is fused when the value passed on is read by that
 *      op alone: an intermediate is then never materialized; an output is
 *      written by the epilogue's STORE and passed on as well.
 *   3. A residual add (or binary add) whose sum is normalized next becomes
 *      smelt_norm's fused residual form; the sum is written (h_out) only
 *      when something else reads it.
 *   4. Everything else is a kernel of its own: norms, rotary, attention and
 *      softmax read whole rows or pairs, which no epilogue can; a lone
 *      activation or add runs smelt_activation or smelt_residual_add.
 * Each rule's legality is checked (shapes, dtypes, the epilogue graph's
 * 32 nodes and 8 slots, the norm's unit-stride rows), and
 * smelt_graph_describe says what went into which kernel and why the rest
 * did not fuse.
 *
 * Fused values keep the epilogue's precision (f32 on GPUs, f64 on the CPU)
 * between ops instead of rounding to the intermediate's dtype, so a fused
 * result differs from the op-by-op one within the ops' error bounds.
 *
 * Errors: an op whose tensors do not fit fails at once, names the op and
 * the tensor, and leaves the graph broken: smelt_graph_plan then reports
 * that first error. smelt_graph_plan checks the whole graph (every
 * intermediate and output written once, no cycle) before planning
 * anything; smelt_graph_run checks every bound tensor before running
 * anything. A failed call writes no tensor.
 */
#ifndef SMELT_GRAPH_H
#define SMELT_GRAPH_H

#include "../smelt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct smelt_graph smelt_graph;

typedef enum smelt_graph_binop {
  SMELT_GRAPH_ADD = 0,
  SMELT_GRAPH_SUB,
  SMELT_GRAPH_MUL,
  SMELT_GRAPH_DIV,
  SMELT_GRAPH_MAX, /* NaN propagates */
  SMELT_GRAPH_MIN,
  SMELT_GRAPH_BINOP_COUNT
} smelt_graph_binop;

/* "add", "sub", ...; "?" if invalid. */
SMELT_API const char *smelt_graph_binop_name(smelt_graph_binop op);

/* An empty graph on ctx (the graph must be destroyed before the context). */
SMELT_API smelt_status smelt_graph_create(smelt_ctx *ctx, smelt_graph **out);
SMELT_API void smelt_graph_destroy(smelt_graph *g); /* NULL is a no-op */

/* ---------------------------------------------------------------- tensors */

/* Each returns the new tensor's number in *id. name (1..31 characters)
 * appears in messages and in the description; names are unique. The view
 * of an input or output is checked as an op's would be (on the context's
 * device, non-NULL data); runs bind its data or views of the same layout.
 * An intermediate is [shape] of dtype, contiguous. */
SMELT_API smelt_status smelt_graph_input(smelt_graph *g, const char *name, const smelt_tensor *view, int *id);
SMELT_API smelt_status smelt_graph_output(smelt_graph *g, const char *name, const smelt_tensor *view, int *id);
SMELT_API smelt_status smelt_graph_tensor(smelt_graph *g, const char *name, smelt_dtype dtype, int ndim,
                                          const int64_t *shape, int *id);

/* ---------------------------------------------------------------- ops */

/* desc may be NULL (the defaults); its epilogue must be the default but
 * for alpha and clamp, its mode AUTO or PLAIN without split-K. */
SMELT_API smelt_status smelt_graph_gemm(smelt_graph *g, const smelt_gemm_desc *desc, int a, int b, int d);
SMELT_API smelt_status smelt_graph_bias(smelt_graph *g, int x, int bias, int y);
SMELT_API smelt_status smelt_graph_act(smelt_graph *g, smelt_act act, float slope, int x, int y);
SMELT_API smelt_status smelt_graph_binary(smelt_graph *g, smelt_graph_binop op, int a, int b, int y);
SMELT_API smelt_status smelt_graph_residual_add(smelt_graph *g, int x, int residual, int y);
SMELT_API smelt_status smelt_graph_norm(smelt_graph *g, const smelt_norm_desc *desc, int x, int weight, int bias,
                                        int y);
SMELT_API smelt_status smelt_graph_rotary(smelt_graph *g, const smelt_rotary_desc *desc, int x, int cos, int sin,
                                          int positions, int y);
/* desc may be NULL; its alibi_slopes, sinks and dsinks must be NULL. */
SMELT_API smelt_status smelt_graph_attention(smelt_graph *g, const smelt_attention_desc *desc, int q, int k, int v,
                                             int o);
SMELT_API smelt_status smelt_graph_softmax(smelt_graph *g, int x, int y);

/* ---------------------------------------------------------------- plan, run, describe */

enum {
  SMELT_GRAPH_UNFUSED = 1u << 0 /* one kernel per op: the op-by-op form, to compare against */
};

/* Groups the ops into kernels, materializes what must be and plans every
 * kernel. May be called again (after more ops, or with other flags): the
 * earlier plan is replaced. */
SMELT_API smelt_status smelt_graph_plan(smelt_graph *g, unsigned flags);

/* Runs the planned kernels in order on the context's stream. bind is NULL
 * (the declared views) or one entry per tensor: the view to use for each
 * input and output (the declared dtype, shape and strides; data may
 * change), NULL for each intermediate. */
SMELT_API smelt_status smelt_graph_run(smelt_graph *g, const smelt_tensor *const *bind);

/* The plan in words: one line per kernel (its ops, the epilogue it took,
 * what was not materialized, the kernel smelt chose) and one per link that
 * did not fuse, with the reason. "" before the first plan. */
SMELT_API const char *smelt_graph_describe(const smelt_graph *g);

typedef struct smelt_graph_stats {
  int ops, tensors;           /* as declared */
  int kernels;                /* planned kernels; 0 before the first plan */
  int fused_away;             /* intermediates never materialized */
  uint64_t workspace_bytes;   /* the materialized intermediates' memory */
} smelt_graph_stats;
SMELT_API smelt_status smelt_graph_stats_get(const smelt_graph *g, smelt_graph_stats *out);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_GRAPH_H */
