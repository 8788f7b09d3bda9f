/* The GEMM operand pre-pass on the host: workspace sizes, the module and
 * the launch (kernels/gemm_prep.cu; the why is in gemm_prep.h). */
#include "gemm_prep.h"

#include <stdio.h>
#include <string.h>

enum { TILE = 64, THREADS = 256 };

/* Launch parameters: the host twin of prep_params in kernels/gemm_prep.cu. */
typedef struct smelt__gemm_prep_params {
  uint64_t src, dst;
  int64_t rows, k, s_r, s_k, kp, ld, tiles_k;
  int es, form, small_part, mn_unit;
} smelt__gemm_prep_params;

_Static_assert(sizeof(smelt__gemm_prep_params) == 88, "smelt__gemm_prep_params must match prep_params");

int64_t smelt__gemm_prep_kp(int64_t k, smelt_dtype dt) {
  const int64_t unit = 16 / (int64_t)smelt_dtype_size(dt);
  return smelt__ceil_div(k, unit) * unit;
}

int64_t smelt__gemm_prep_ld(smelt__gemm_prep prep, int64_t k, smelt_dtype dt) {
  return (prep == SMELT__PREP_SPLIT ? 3 : 1) * smelt__gemm_prep_kp(k, dt);
}

void smelt__gemm_prep_src(smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "gemm_prep");
  src->body = "gemm_prep.cu";
}

smelt_status smelt__gemm_prep_load(smelt_ctx *ctx, CUfunction *f) {
  smelt__kernel_src src;
  smelt__gemm_prep_src(&src);
  return smelt__cuda_function(ctx, &src, "gemm_prep", f);
}

smelt_status smelt__gemm_prep_run(smelt_ctx *ctx, CUfunction f, smelt__gemm_prep prep, int which, const void *src,
                                  smelt_dtype dt, int64_t rows, int64_t k, int64_t s_r, int64_t s_k, void *dst) {
  smelt__gemm_prep_params p;
  memset(&p, 0, sizeof p);
  p.src = (uint64_t)(uintptr_t)src;
  p.dst = (uint64_t)(uintptr_t)dst;
  p.rows = rows;
  p.k = k;
  /* One row or one K element: that axis's stride is never used. */
  p.s_r = rows > 1 ? s_r : 0;
  p.s_k = k > 1 ? s_k : 0;
  p.kp = smelt__gemm_prep_kp(k, dt);
  p.ld = smelt__gemm_prep_ld(prep, k, dt);
  p.tiles_k = smelt__ceil_div(p.kp, TILE);
  p.es = (int)smelt_dtype_size(dt);
  p.form = (int)prep;
  p.small_part = which; /* A: [small | big | big]; B: [big | small | big] */
  p.mn_unit = rows > 1 && s_r == 1 && !(k > 1 && s_k == 1);
  const int64_t blocks = smelt__ceil_div(rows, TILE) * p.tiles_k;
  if (blocks == 0) return SMELT_OK;
  if (blocks > 0x7fffffff)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm: the operand pre-pass's %lld tiles exceed 2^31 - 1",
                        (long long)blocks);
  void *params[] = {&p};
  return smelt__cuda_launch(ctx, "smelt_gemm (operand pre-pass)", f, (unsigned)blocks, 1, 1, THREADS, 0, params);
}
