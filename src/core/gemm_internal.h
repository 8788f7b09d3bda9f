/* GEMM internals shared by the core (validation, plan/run), the CPU reference
 * and the CUDA backend: operands resolved to (pointer, row stride, column
 * stride), the plan's resolved description, and the run's arguments. */
#ifndef SMELT_GEMM_INTERNAL_H
#define SMELT_GEMM_INTERNAL_H

#include "internal.h"

/* A matrix operand: element (r, c) of batch l is at
 * data + (l * bs + r * rs + c * cs) * dtype size. */
typedef struct smelt__gemm_mat {
  const void *data; /* NULL when absent */
  int64_t rs, cs, bs;
} smelt__gemm_mat;

/* An epilogue graph's tensor slots resolved (smelt/epilogue.h): element
 * (m, n) of slot s is at data[s] + (m * rs[s] + n * cs[s]) * dtype size; a
 * row vector [M] has cs 0, a column vector [N] rs 0. */
typedef struct smelt__epi_slots {
  int count;
  smelt_dtype dt[SMELT_EPI_MAX_TENSORS];
  const void *data[SMELT_EPI_MAX_TENSORS];
  int64_t rs[SMELT_EPI_MAX_TENSORS], cs[SMELT_EPI_MAX_TENSORS];
} smelt__epi_slots;

/* One GEMM problem: A [m,k], B [k,n], C and D [m,n], bias [n]. */
typedef struct smelt__gemm_prob {
  int64_t m, n, k;
  smelt__gemm_mat a, b, c, d;
  const void *bias; /* NULL when absent */
  int64_t bias_s;   /* bias stride along n */
  int64_t bias_gs;  /* grouped by offsets: stride between the groups' bias rows */
  const float *sa;  /* row scales of A [m] (smelt_gemm_scales), NULL when absent */
  const float *sb;  /* column scales of B [n], NULL when absent */
  int64_t sa_s, sb_s; /* their strides */
  int64_t sb_gs;    /* grouped by offsets: stride between the groups' sb rows */
  /* Block scales (desc.scales BLOCK): sa [m, kb] at sa_s per row and sa_ks
   * per k block, sb [nb, kb] at sb_s per 128 columns and sb_ks per k block;
   * batched, sa_bs and sb_bs per entry (grouped by offsets, sb_bs and sb_gs
   * per group). */
  int64_t sa_ks, sb_ks, sa_bs, sb_bs;
  smelt__epi_slots epi; /* the epilogue graph's tensors (count 0 without a graph) */
} smelt__gemm_prob;

/* The plan's resolved description (plan->opdata). */
typedef struct smelt__gemm_state {
  smelt_gemm_desc desc;  /* as given (defaults when NULL) */
  smelt_gemm_mode mode;  /* resolved: never AUTO */
  int split_k;           /* resolved: >= 1; > 1 only in the split modes */
  smelt_gemm_acc acc;    /* resolved: never AUTO */
  smelt_dtype dt_a, dt_b, dt_c, dt_d, dt_bias;
  smelt_dtype dt_offs;   /* grouped by offsets: i32 or i64 */
  int has_c, has_bias;   /* C is read (beta != 0); a bias is added */
  int has_sa, has_sb;    /* row scales of A, column scales of B (smelt_gemm_scales) */
  int blk;               /* has_sa and has_sb are block scales (desc.scales BLOCK): 1 x 128 of A, 128 x 128 of B */
  int64_t count;         /* batched L, array count, groups (as planned) */
  int has_graph;         /* desc.epilogue.graph was set: `graph` is its copy, and desc.epilogue.graph
                            points at it */
  smelt_epi_graph graph;
  smelt_tensor epi_t[SMELT_EPI_MAX_TENSORS]; /* the graph slots' planned views */
  smelt__gemm_prob prob; /* planned problem (the template in array mode; group 0 when grouped; when
                            grouped by offsets, all T rows: b.bs and bias_gs step from group to group) */
} smelt__gemm_state;

/* What a run binds. */
typedef struct smelt__gemm_args {
  smelt__gemm_prob prob;          /* plain, split-K, batched; the template in array mode */
  int64_t count;                  /* batched L, array count, number of groups */
  const smelt_gemm_ptrs *ptrs;    /* array mode */
  const smelt__gemm_prob *groups; /* grouped mode: count problems */
  const void *offs;               /* grouped by offsets: count row ends (i32 or i64, st->dt_offs) */
} smelt__gemm_args;

/* Grouped by offsets: the clamped row range [*r0, *r1) of group g, from the
 * previous group's clamped end (smelt/gemm.h: end[g] = min(T, max(end[g-1],
 * offs[g])), end[-1] = 0). */
static inline void smelt__gemm_offs_range(int64_t prev_end, int64_t off, int64_t total, int64_t *r0, int64_t *r1) {
  const int64_t e = off > prev_end ? off : prev_end;
  *r0 = prev_end;
  *r1 = e < total ? e : total;
}

/* Bytes of alignment of an operand as a kernel sees it: the largest power of
 * two (up to 16) dividing the address and every stride of an axis with more
 * than one element, ignoring `unit_axis` (0 rows, 1 columns, -1 none), whose
 * stride is one element. */
int smelt__gemm_mat_align(const smelt__gemm_mat *x, smelt_dtype dt, int64_t rows, int64_t cols, int64_t batch,
                          int unit_axis);

/* Epilogue graphs (src/core/epi_graph.c). smelt__epi_check_desc: the graph
 * against the rest of the description (a C node exactly when beta != 0, a
 * BIAS node exactly when has_bias, act IDENTITY, scale_d 1).
 * smelt__epi_resolve: the slots' tensors checked against the graph and the
 * problem (p's m, n and operands, which outputs must not overlap) and
 * resolved into p->epi; planned (may be NULL) gets copies of the views.
 * smelt__epi_check_run: a run's slots are the planned views. */
smelt_status smelt__epi_check_desc(const char *op, const smelt_epi_graph *g, const smelt_gemm_desc *d, int has_bias);
smelt_status smelt__epi_resolve(const char *op, const smelt_ctx *ctx, const smelt_epi_graph *g,
                                const smelt_epi_tensors *epi, const smelt_tensor *const *operands, int noperands,
                                smelt__gemm_prob *p, smelt_tensor *planned);
smelt_status smelt__epi_check_run(const char *op, const smelt_epi_graph *g, const smelt_tensor *planned,
                                  const smelt_epi_tensors *epi, const smelt_tensor *const *operands, int noperands,
                                  smelt__gemm_prob *p);
/* The CPU reference of a graph (src/cpu/epi_graph.c), row by row: acc[j]
 * for j < n holds row i's accumulator times alpha and the scales (f64), and
 * gets D's values (before conversion); the row's stores and reductions are
 * done. begin and end bracket the rows: column reductions start in red
 * (SMELT_EPI_MAX_TENSORS x N doubles) and are stored from it. */
void smelt__cpu_epi_row(const smelt__gemm_state *st, const smelt__gemm_prob *p, int64_t i, double *acc, double *red);
void smelt__cpu_epi_begin(const smelt__gemm_state *st, const smelt__gemm_prob *p, double *red);
void smelt__cpu_epi_end(const smelt__gemm_state *st, const smelt__gemm_prob *p, const double *red);

/* The backends (smelt__cpu_gemm in src/cpu/gemm.c, smelt__cuda_gemm in
 * src/cuda/op_gemm.c) plan and run a `const smelt__gemm_args *`. */

/* d = smelt_gemm(ctx, desc, a, b, c, d, bias) through the plan in *slot,
 * made on the first call and again when a call's tensors differ from the
 * planned ones in dtype, shape, strides or device (the caller keeps *slot,
 * NULL at first, and destroys it; one thread at a time, as its context).
 * desc must be the same on every call with one slot. */
smelt_status smelt__gemm_reuse(smelt_ctx *ctx, smelt_plan **slot, const smelt_gemm_desc *desc, const smelt_tensor *a,
                               const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                               const smelt_tensor *bias);

#endif /* SMELT_GEMM_INTERNAL_H */
