/* smelt_rotary on CUDA: kernels/rotary.cu, one module per dtype (the layout
 * and the direction are run-time arguments). Each run takes rotary_vec
 * when every head's start, D and the rotated part's vectors are 16-byte
 * aligned, rotary_unit otherwise, and sizes the threads per head to its
 * units of work. */
#include "dtype_module.h"

#include <string.h>

enum { F_VEC, F_UNIT, F_COUNT };
static const char *const entry[F_COUNT] = {"rotary_vec", "rotary_unit"};
#define BLOCK 256

/* The kernel's argument, field for field as rot_args in kernels/rotary.cu. */
typedef struct rot_args {
  const void *x;
  void *y;
  const float *cs, *sn;
  const void *pos;
  int pos64, gptj, copy, tpr_log2;
  float sign;
  int64_t B, S, H, D, half, P;
  int64_t xs0, xs1, xs2, ys0, ys1, ys2, cs0, ss0, ps0, ps1;
} rot_args;

static const smelt__dtype_module module = {"rotary.cu", "rotary", entry, F_COUNT};

int smelt__rotary_variants(smelt__kernel_src *out, int max) { return smelt__dtype_module_variants(&module, out, max); }

static smelt_status plan_rotary(smelt_plan *plan, const void *args) {
  (void)args;
  plan->block = BLOCK;
  return smelt__dtype_module_plan(&module, plan);
}

/* 16-byte units fit: D and the rotated vectors are whole vectors of vw
 * elements, and so is every head's start in x and y (strides of dims of
 * size 1 never move a pointer). */
static int vec_fits(const rot_args *a, const smelt_tensor *x, const smelt_tensor *y, int64_t vw) {
  if (a->D % vw || (a->gptj ? 2 * a->half : a->half) % vw || ((uintptr_t)a->x | (uintptr_t)a->y) % 16) return 0;
  for (int d = 0; d < 3; d++)
    if (x->shape[d] > 1 && (x->strides[d] % vw || y->strides[d] % vw)) return 0;
  return 1;
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *pos = t[3], *y = t[4];
  const smelt_rotary_desc *d = (const smelt_rotary_desc *)plan->opdata;
  const int64_t rows = x->shape[0] * x->shape[1] * x->shape[2];
  if (rows == 0 || x->shape[3] == 0) return SMELT_OK;
  rot_args a;
  memset(&a, 0, sizeof a);
  a.x = x->data;
  a.y = y->data;
  a.cs = (const float *)t[1]->data;
  a.sn = (const float *)t[2]->data;
  a.pos = pos ? pos->data : NULL;
  a.pos64 = pos && pos->dtype == SMELT_DTYPE_I64;
  a.gptj = d->layout == SMELT_ROTARY_GPTJ;
  a.copy = x->data != y->data;
  a.sign = d->inverse ? -1.f : 1.f;
  a.B = x->shape[0], a.S = x->shape[1], a.H = x->shape[2], a.D = x->shape[3];
  a.half = t[1]->shape[1], a.P = t[1]->shape[0];
  a.xs0 = x->strides[0], a.xs1 = x->strides[1], a.xs2 = x->strides[2];
  a.ys0 = y->strides[0], a.ys1 = y->strides[1], a.ys2 = y->strides[2];
  a.cs0 = t[1]->strides[0], a.ss0 = t[2]->strides[0];
  a.ps0 = pos ? pos->strides[0] : 0, a.ps1 = pos ? pos->strides[1] : 0;
  const int64_t vw = 16 / (int64_t)smelt_dtype_size(x->dtype), rot = 2 * a.half;
  const int vec = vec_fits(&a, x, y, vw);
  const int64_t units = vec ? (a.gptj ? rot : a.half) / vw + (a.copy ? (a.D - rot) / vw : 0)
                            : a.half + (a.copy ? a.D - rot : 0);
  while (a.tpr_log2 < 5 && ((int64_t)1 << a.tpr_log2) < units) a.tpr_log2++;
  const int64_t g = smelt__ceil_div(rows, BLOCK >> a.tpr_log2);
  const unsigned grid = (unsigned)(g > 0x7fffffff ? 0x7fffffff : g);
  void *params[] = {&a};
  smelt__nvtx_push("smelt_rotary");
  smelt_status s = smelt__cuda_launch(plan->ctx, "smelt_rotary", (CUfunction)plan->func[vec ? F_VEC : F_UNIT], grid, 1,
                                      1, BLOCK, 0, params);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_rotary = {.plan = plan_rotary, .run = run};
