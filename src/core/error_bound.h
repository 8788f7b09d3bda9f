/* The error bounds: how far a result may lie from the CPU reference, one
 * definition per op and dtype, used by the tests, the GEMM autotuner, the
 * benches' --check and the demo, so that no two of them can drift apart.
 * Each family names its bound function in its smelt__family;
 * smelt__error_bound finds it by op. This header needs only the public
 * API, so the tests and the CLI include it without the library's
 * internals. */
#ifndef SMELT_ERROR_BOUND_H
#define SMELT_ERROR_BOUND_H

#include "smelt.h"

/* How an error is measured. */
typedef enum smelt__metric {
  SMELT__METRIC_REL_L2,  /* ||got - ref|| / ||ref|| over the output, in double */
  SMELT__METRIC_MAX_REL  /* max |got - ref| / max(max |ref|, 1): one element's worst error */
} smelt__metric;

/* What was computed, and where. */
typedef struct smelt__bound_query {
  const char *family;         /* its name in src/core/families.h: "gemm" */
  smelt__metric metric;
  smelt_device_kind device;   /* the backend checked against the CPU reference; SMELT_DEVICE_CPU: the
                                 reference itself against an exact computation in double */
  smelt_dtype dtype;          /* the checked output's dtype */
  int output;                 /* 0: the main output; 1: the f32 logsumexp (softmax, attention), a gradient (PEER) */
  int64_t k;                  /* the reduction length (3xtf32's GEMM bound grows with it) */
  /* GEMM: A's dtype, the description and whether C is read. */
  smelt_dtype dt_a;
  const smelt_gemm_desc *gemm;
  int has_c;
} smelt__bound_query;

/* The bound for q; a negative value when the op has none. */
double smelt__error_bound(const smelt__bound_query *q);

/* The families' bound functions (src/core/error_bound.c). */
double smelt__bound_elementwise(const smelt__bound_query *q); /* activation, softmax, top-k */
double smelt__bound_gemm(const smelt__bound_query *q);
double smelt__bound_attention(const smelt__bound_query *q);
double smelt__bound_peer(const smelt__bound_query *q);
double smelt__bound_moe(const smelt__bound_query *q);
double smelt__bound_norm(const smelt__bound_query *q); /* norm, norm_bwd, residual, rotary */

#endif /* SMELT_ERROR_BOUND_H */
