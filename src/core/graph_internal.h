/* The fusion planner's state (smelt/graph.h), shared by its files:
 * graph.c (tensors and ops as the caller adds them), graph_order.c (the
 * whole graph's checks and its topological order), graph_group.c (the
 * fusion rules: which ops share a kernel), graph_chain.c (an elementwise
 * chain as a GEMM epilogue), graph_kernel.c (each kernel through its
 * public op), graph_plan.c (the plan, the workspace, the description) and
 * graph_run.c (the run's checks). */
#ifndef SMELT_GRAPH_INTERNAL_H
#define SMELT_GRAPH_INTERNAL_H

#include "internal.h"

#define SMELT__GRAPH_NAME 32
#define SMELT__GRAPH_MAX_IN 4    /* an op's input tensors (rotary: x, cos, sin, positions) */
#define SMELT__GRAPH_MAX_ROLES 13 /* a kernel's tensors (an epilogue GEMM: A, B, C, D, bias and 8 slots) */
#define SMELT__GRAPH_MAX_CHAIN 32 /* ops in one kernel */
#define SMELT__GRAPH_WHY 160

typedef enum smelt__graph_tkind { SMELT__GT_INPUT = 0, SMELT__GT_OUTPUT, SMELT__GT_INTER } smelt__graph_tkind;

typedef struct smelt__graph_tensor {
  char name[SMELT__GRAPH_NAME];
  smelt__graph_tkind kind;
  smelt_tensor view; /* declared (inputs, outputs); intermediates: contiguous, data = workspace or NULL */
  int producer;      /* the op that writes it, -1 none */
  int readers;       /* ops that read it (an op reading it twice counts once) */
  int fused;         /* planned: never materialized */
} smelt__graph_tensor;

typedef enum smelt__graph_okind {
  SMELT__GOP_GEMM = 0,
  SMELT__GOP_BIAS,
  SMELT__GOP_ACT,
  SMELT__GOP_BINARY,
  SMELT__GOP_RESIDUAL,
  SMELT__GOP_NORM,
  SMELT__GOP_ROTARY,
  SMELT__GOP_ATTENTION,
  SMELT__GOP_SOFTMAX,
  SMELT__GOP_COUNT
} smelt__graph_okind;

/* One op. in[] by kind (-1 absent): gemm a, b; bias x, bias; act x;
 * binary a, b; residual x, residual; norm x, weight, bias; rotary x, cos,
 * sin, positions; attention q, k, v; softmax x. */
typedef struct smelt__graph_op {
  smelt__graph_okind kind;
  int in[SMELT__GRAPH_MAX_IN];
  int out;
  union {
    smelt_gemm_desc gemm;
    struct {
      smelt_act act;
      float slope;
    } act;
    smelt_graph_binop bin;
    smelt_norm_desc norm;
    smelt_rotary_desc rotary;
    smelt_attention_desc attention;
  } p;
  int group; /* planned: its kernel */
} smelt__graph_op;

/* How a kernel runs: the public op it is planned through. */
typedef enum smelt__graph_gkind {
  SMELT__GK_GEMM = 0, /* smelt_gemm: the fixed epilogue */
  SMELT__GK_GEMM_EPI, /* smelt_gemm_epi: an epilogue graph (K = 0 for a chain without a GEMM) */
  SMELT__GK_ACT,
  SMELT__GK_RESIDUAL,
  SMELT__GK_NORM, /* with or without the residual add */
  SMELT__GK_ROTARY,
  SMELT__GK_ATTENTION,
  SMELT__GK_SOFTMAX
} smelt__graph_gkind;

/* A role's tensor: a graph tensor, none (NULL), or the fixed empty operand
 * of a K = 0 GEMM. */
enum { SMELT__GR_ABSENT = -2, SMELT__GR_FIXED = -1 };

/* One kernel: its ops, and for each of its public op's roles a view
 * template (shape and strides; possibly a 2-D view of an n-D tensor) and
 * the tensor whose data it takes. */
typedef struct smelt__graph_group {
  smelt__graph_gkind kind;
  int nops;
  int ops[SMELT__GRAPH_MAX_CHAIN];
  int nroles;
  int id[SMELT__GRAPH_MAX_ROLES];
  smelt_tensor view[SMELT__GRAPH_MAX_ROLES];
  smelt_gemm_desc gemm; /* GEMM kinds: the description planned (epi points at `epi`) */
  smelt_epi_graph epi;
  char epilogue[96];    /* GEMM kinds: "fixed epilogue (bias, gelu)", "epilogue graph of 6 nodes, 1 slots" */
  char why[SMELT__GRAPH_WHY]; /* why the kernel's output went no further, or why it stands alone */
  smelt_plan *plan;
} smelt__graph_group;

struct smelt_graph {
  smelt_ctx *ctx;
  int ntensors, cap_tensors;
  smelt__graph_tensor *tensors;
  int nops, cap_ops;
  smelt__graph_op *ops;
  smelt_status broken;  /* the first failed op's status (0: none) */
  char broken_msg[512]; /* and its message */
  /* The plan (ngroups 0 before the first). */
  int ngroups;
  smelt__graph_group *groups;
  void **work; /* per tensor: its workspace (intermediates), NULL otherwise */
  uint64_t work_bytes;
  char *describe; /* never NULL after create */
};

/* The op's name for messages: "op 3 (act)". */
const char *smelt__graph_op_label(const smelt_graph *g, int op, char *buf, size_t n);
const char *smelt__graph_kind_name(smelt__graph_okind k);
int smelt__graph_op_reads(const smelt__graph_op *o, int t);
/* The elementwise kinds a chain may hold. */
int smelt__graph_elementwise(smelt__graph_okind k);

/* The ops in an order where every op follows the writers of what it reads
 * (order[nops]); fails naming the tensor never written, the output never
 * written, or an op on a cycle. */
smelt_status smelt__graph_order(const smelt_graph *g, int *order);

/* Destroys the plan's kernels and frees its workspace and description
 * (the graph as before its first plan). */
void smelt__graph_unplan(smelt_graph *g);

/* Appends a line to the description (a printf format). */
void smelt__graph_say(smelt_graph *g, const char *fmt, ...) SMELT__PRINTF(2, 3);

/* Groups the ops (in `order`) into g->groups by the fusion rules, or one
 * op a group with SMELT_GRAPH_UNFUSED; marks the fused-away tensors and
 * says why links did not fuse. */
smelt_status smelt__graph_group_ops(smelt_graph *g, const int *order, unsigned flags);
/* A chain being built: the group it fills, the value so far (a node of
 * the group's epilogue graph, and the tensor holding it), and what its
 * inputs took (C, bias, slots; the node of each input tensor). */
typedef struct smelt__graph_chain {
  smelt__graph_group *gr;
  int value, tensor;
  int k0;           /* no GEMM: K = 0 */
  int has_c, has_bias, nslots, stores;
  int nknown;
  struct {
    int tensor, node;
  } known[SMELT_EPI_MAX_TENSORS + 2];
} smelt__graph_chain;

/* Starts a chain at op (a GEMM or an elementwise op). */
void smelt__graph_chain_begin(smelt__graph_chain *c, smelt_graph *g, smelt__graph_group *gr, int op);
/* Whether op, which reads the chain's value, fits in its kernel; if not,
 * why (for the description). */
int smelt__graph_chain_fits(const smelt__graph_chain *c, const smelt_graph *g, int op, char *why, size_t n);
/* Adds op: the value it reads is fused away, or stored when an output. */
void smelt__graph_chain_add(smelt__graph_chain *c, smelt_graph *g, int op);
/* Ends the chain: D is the value's tensor; the fixed epilogue when the
 * chain fits it, else the graph. */
void smelt__graph_chain_end(smelt__graph_chain *c, const smelt_graph *g);

/* Whether tensor t can be read as a matrix [rows, cols] (all but its last
 * dim collapsed); m gets the view. */
int smelt__graph_as_matrix(const smelt_tensor *t, smelt_tensor *m);

/* The view role r of gr takes, with data from bind (NULL: the declared
 * views) or the workspace. */
smelt_tensor smelt__graph_role_view(const smelt_graph *g, const smelt__graph_group *gr, int r,
                                    const smelt_tensor *const *bind);
/* Plans or runs gr through its public op (plan: gr->plan is set). */
smelt_status smelt__graph_group_plan(smelt_graph *g, smelt__graph_group *gr);
smelt_status smelt__graph_group_run(const smelt_graph *g, smelt__graph_group *gr, const smelt_tensor *const *bind);

#endif /* SMELT_GRAPH_INTERNAL_H */
