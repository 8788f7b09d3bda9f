/* smelt_residual_add on CUDA: kernels/residual.cu, one module per dtype;
 * each run takes add_vec when all three tensors are contiguous and 16-byte
 * aligned, add_gen otherwise. */
#include "dtype_module.h"

#include <string.h>

enum { F_VEC, F_GEN, F_COUNT };
static const char *const entry[F_COUNT] = {"add_vec", "add_gen"};
#define BLOCK 256
#define BLOCKS_PER_SM 16

static const smelt__dtype_module module = {"residual.cu", "residual_add", entry, F_COUNT};

int smelt__residual_variants(smelt__kernel_src *out, int max) { return smelt__dtype_module_variants(&module, out, max); }

static smelt_status plan_add(smelt_plan *plan, const void *args) {
  (void)args;
  plan->block = BLOCK;
  return smelt__dtype_module_plan(&module, plan);
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  int64_t n = smelt_tensor_numel(t[0]);
  if (n == 0) return SMELT_OK;
  const void *xp = t[0]->data, *rp = t[1]->data, *yp = t[2]->data;
  const int vec = smelt_tensor_is_contiguous(t[0]) && smelt_tensor_is_contiguous(t[1]) &&
                  smelt_tensor_is_contiguous(t[2]) && ((uintptr_t)xp | (uintptr_t)rp | (uintptr_t)yp) % 16 == 0;
  smelt__kshape xs, rs, ys;
  smelt__kshape_rows(t[0], t[0]->ndim, &xs);
  smelt__kshape_rows(t[1], t[1]->ndim, &rs);
  smelt__kshape_rows(t[2], t[2]->ndim, &ys);
  void *p_vec[] = {&xp, &rp, &yp, &n};
  void *p_gen[] = {&xp, &rp, &yp, &n, &xs, &rs, &ys};
  const int64_t work = vec ? n / (16 / (int64_t)smelt_dtype_size(t[0]->dtype)) + 1 : n;
  const int64_t cap = (int64_t)plan->ctx->cuda->info.sm_count * BLOCKS_PER_SM, g = smelt__ceil_div(work, BLOCK);
  const unsigned grid = (unsigned)(g < cap ? g : cap);
  smelt__nvtx_push("smelt_residual_add");
  smelt_status s = smelt__cuda_launch(plan->ctx, "smelt_residual_add", (CUfunction)plan->func[vec ? F_VEC : F_GEN], grid,
                                      1, 1, BLOCK, 0, vec ? p_vec : p_gen);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_residual = {.plan = plan_add, .run = run};
