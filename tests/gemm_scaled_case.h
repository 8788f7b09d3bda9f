/* One smelt_gemm_scaled case, run on a context and checked: shared by the
 * suites of its two forms (gemm_scales: row and column vectors;
 * gemm_fp8blk: block scales). A case holds every operand's view and host
 * storage; a run uploads them, plans and runs with D poisoned and guarded
 * (every element written, nothing else), and a check compares the CPU
 * reference with the suite's naive loop and CUDA with the CPU reference. */
#ifndef SMELT_TESTS_GEMM_SCALED_CASE_H
#define SMELT_TESTS_GEMM_SCALED_CASE_H

#include "harness.h"

/* The operands, in the order the scaled plan takes them. */
enum { TGS_A, TGS_B, TGS_C, TGS_D, TGS_BIAS, TGS_SA, TGS_SB, TGS_N };

typedef struct tgs_case {
  smelt_dtype dt[TGS_N];
  th_view v[TGS_N];
  void *host[TGS_N]; /* random storage of each view (D's unused) */
  int has[TGS_N];    /* C, bias and the scales: given to the plan */
  smelt_gemm_desc desc;
  const char *kernel; /* with CUDA: a substring of the plan's description, or NULL */
} tgs_case;

/* A view's whole storage (and one more element), uniform in [lo, hi). */
void *tgs_filled(const th_view *v, smelt_dtype dt, double lo, double hi);
void tgs_free(tgs_case *c);
/* Element (l, r, c) of a 2-D or 3-D view's host storage. */
double tgs_at(const void *p, smelt_dtype dt, const th_view *v, int64_t l, int64_t r, int64_t c);
/* The activations the suites use, in double. */
double tgs_act(smelt_act a, double x);
/* What D holds after storing v (float outputs through f32, fp8 saturating). */
double tgs_stored(double v, smelt_dtype dt);
/* The expected D [L,] M x N (the sizes of D's view) in double:
 * smelt/gemm.h's epilogue around acc(user, l, i, j), the product with the
 * suite's form of scales applied. */
void tgs_naive(const tgs_case *c, double (*acc)(const void *user, int64_t l, int64_t i, int64_t j), const void *user,
               double *out);
th_buf tgs_upload(smelt_ctx *ctx, const th_view *v, const void *host, smelt_dtype dt);
/* Runs c on ctx; D decoded into out (numel of D). Returns the status. */
smelt_status tgs_run(smelt_ctx *ctx, const tgs_case *c, double *out, const char *what);
/* The operands of a grouped-by-offsets run, in tgs_run_offs's order. */
enum { TGS_OA, TGS_OB, TGS_OSA, TGS_OSB, TGS_OFFS, TGS_ON };

/* smelt_gemm_grouped_offs_scaled on ctx: A, B, the scales and the offsets
 * from the host storage of their views (dtypes dt), D [T, N] row-major of
 * dtype dt_d (view vd). With CUDA the plan must run a kernel whose
 * description holds `kernel` (NULL: any). Rows of D before `last` (the
 * last group's end) are decoded into got; every row after must keep the
 * poison. Returns the status. */
smelt_status tgs_run_offs(smelt_ctx *ctx, const smelt_gemm_desc *desc, const th_view *v, void *const *host,
                          const smelt_dtype *dt, const th_view *vd, smelt_dtype dt_d, int64_t last, const char *kernel,
                          double *got);
/* The CPU reference against naive(user, out) when naive is not NULL
 * (relative bound naive_bound), then on gpu (NULL: none) CUDA against the
 * CPU reference (relative bound gpu_bound, or max abs error abs_bound; a
 * negative abs_bound counts codes of D's 8-bit float format at the
 * reference's largest magnitude: an f32 sum summed in another order may
 * round to the neighbouring code). Returns 0 on a failure, after a line
 * naming the case. */
int tgs_check(const tgs_case *c, const char *label, void (*naive)(const void *user, double *out), const void *user,
              double naive_bound, smelt_ctx *gpu, double gpu_bound, double abs_bound);

#endif
