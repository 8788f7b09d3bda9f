/* smelt_activation on CUDA: one module per (activation, dtype) built from
 * kernels/unary.cu. The plan loads its three entry points; each run picks one
 * by layout and alignment, which may change between runs with the same plan:
 *   act_vec      both contiguous and 16-byte aligned (16-byte accesses)
 *   act_contig   both contiguous, not both 16-byte aligned
 *   act_strided  anything else, on the dims left after merging */
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

enum { F_VEC, F_CONTIG, F_STRIDED, F_COUNT };
static const char *const entry[F_COUNT] = {"act_vec", "act_contig", "act_strided"};

/* unary.cu's block size and blocks resident per SM at full occupancy. */
#define BLOCK 256
#define BLOCKS_PER_SM (2048 / BLOCK)

typedef struct act_params {
  smelt_act act;
  smelt_dtype dt;
} act_params;

static const smelt_dtype act_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* The one place a variant's source is made: the plan and the enumerator both
 * call it, so what precompile builds is what the plan loads. */
static void make_src(const act_params *p, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "act_%s_%s", smelt_act_name(p->act), smelt_dtype_name(p->dt));
  src->body = "unary.cu";
  smelt__prelude_define(src, "SMELT_DT", p->dt);
  smelt__prelude_define(src, "SMELT_ACT", p->act);
}

int smelt__activation_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  for (size_t d = 0; d < sizeof act_dtypes / sizeof *act_dtypes; d++)
    for (int a = 0; a < SMELT_ACT_COUNT; a++, n++) {
      act_params p = {(smelt_act)a, act_dtypes[d]};
      if (n < max) make_src(&p, &out[n]);
    }
  return n;
}

static smelt_status plan_act(smelt_plan *plan, const void *args) {
  act_params p = {plan->p.act.act, plan->t[0].dtype};
  smelt__kernel_src src;
  make_src(&p, &src);
  for (int i = 0; i < F_COUNT; i++) {
    CUfunction f;
    smelt_status s = smelt__cuda_function(plan->ctx, &src, entry[i], &f);
    if (s) return s;
    plan->func[i] = f;
  }
  plan->block = BLOCK;
  snprintf(plan->describe, sizeof plan->describe, "%s (unary.cu, vec/contig/strided by layout)", src.name);
  return SMELT_OK;
}

/* Drops size-1 dims and merges neighbours that are contiguous in both x and y,
 * so the strided kernel divides as few times per element as possible. */
static void merge_dims(const smelt_tensor *x, const smelt_tensor *y, smelt__kshape *xs, smelt__kshape *ys) {
  smelt_tensor a = *x, b = *y;
  a.ndim = b.ndim = 0;
  for (int d = 0; d < x->ndim; d++) {
    if (x->shape[d] == 1) continue;
    int last = a.ndim - 1;
    if (last >= 0 && a.strides[last] == x->shape[d] * x->strides[d] && b.strides[last] == y->shape[d] * y->strides[d]) {
      a.shape[last] *= x->shape[d];
      b.shape[last] *= x->shape[d];
      a.strides[last] = x->strides[d];
      b.strides[last] = y->strides[d];
    } else {
      a.shape[a.ndim] = b.shape[b.ndim] = x->shape[d];
      a.strides[a.ndim++] = x->strides[d];
      b.strides[b.ndim++] = y->strides[d];
    }
  }
  smelt__kshape_from(xs, &a);
  smelt__kshape_from(ys, &b);
}

static unsigned grid_for(const smelt_plan *plan, int64_t work) {
  int64_t cap = (int64_t)plan->ctx->cuda->info.sm_count * BLOCKS_PER_SM;
  int64_t g = smelt__ceil_div(work, BLOCK);
  if (g > cap) g = cap;
  return (unsigned)(g > 0 ? g : 1);
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *y = t[1];
  int64_t n = smelt_tensor_numel(x);
  if (n == 0) return SMELT_OK;
  void *xp = x->data, *yp = y->data;
  float slope = plan->p.act.slope;
  smelt__kshape xs, ys;
  void *flat[] = {&xp, &yp, &n, &slope};
  void *strided[] = {&xp, &yp, &n, &xs, &ys, &slope};
  void **params = flat;
  int f;
  unsigned grid;
  if (smelt_tensor_is_contiguous(x) && smelt_tensor_is_contiguous(y)) {
    int64_t vec = 16 / (int64_t)smelt_dtype_size(x->dtype);
    f = ((uintptr_t)xp | (uintptr_t)yp) % 16 == 0 ? F_VEC : F_CONTIG;
    grid = grid_for(plan, f == F_VEC ? n / vec : n);
  } else {
    merge_dims(x, y, &xs, &ys);
    params = strided;
    f = F_STRIDED;
    grid = grid_for(plan, n);
  }
  smelt__nvtx_push("smelt_activation");
  smelt_status s =
      smelt__cuda_launch(plan->ctx, "smelt_activation", (CUfunction)plan->func[f], grid, 1, 1, BLOCK, 0, params);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_activation = {.plan = plan_act, .run = run};
