/* smelt_bem on CUDA: kernels/bem_update.cu, one module per (dtype, rank
 * padded to 16, 32, 64 or 128). The plan picks the module and its entry
 * point (bem_update_mma on tensor cores for f16 and bf16, bem_update_fma
 * for f32); each run decides the 16-byte paths from its own pointers and
 * strides, so a run with less aligned data than the planned one still
 * runs. The backward of one adapter is composed from GEMMs and Hadamard
 * passes (src/core/bem_compose.c); with segments it is not on CUDA yet:
 * planning it fails with UNSUPPORTED rather than falling back to the CPU
 * behind the caller. */
#include "../core/bem_internal.h"
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

#define OP "smelt_bem"

static const int ranks[] = {16, 32, 64, 128};
enum { NRANKS = (int)(sizeof ranks / sizeof *ranks) };
static const smelt_dtype bem_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* The tile config the kernel's prelude gets: rows per CTA, the d_in stage
 * width, the ring depth, the d_out tile and its ring depth (tensor-core
 * kernel). */
enum { MMA_BM = 128, MMA_BK = 64, MMA_STAGES = 4, MMA_BN = 64, MMA_TB = 3, MMA_WARPS = 8, FMA_BM = 32, THREADS = 256 };

static unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }

/* Dynamic shared memory of bem_update_mma, as it lays it out: phase 1 a
 * ring of stages of x [BM][BK + 8] and V [RP][BK + 8] (or [BK][RP + 8]);
 * phase 2 (the same memory) a ring of MMA_TB U tiles [BN][RP + 8] (or
 * [RP][BN + 8]), one f32 staging [16][BN + 8] per warp and, when
 * accumulating, a ring of old-y tiles [BM][BN + 8]. */
static unsigned mma_smem(unsigned rp, int accumulate) {
  const unsigned v = umax(rp * (MMA_BK + 8), MMA_BK * (rp + 8)), u = umax(MMA_BN * (rp + 8), rp * (MMA_BN + 8));
  const unsigned p1 = MMA_STAGES * (MMA_BM * (MMA_BK + 8) + v) * 2;
  const unsigned p2 = MMA_TB * u * 2 + MMA_WARPS * 16 * (MMA_BN + 8) * 4 +
                      (accumulate ? MMA_TB * MMA_BM * (MMA_BN + 8) * 2 : 0);
  return p1 > p2 ? p1 : p2;
}

/* The one place a variant's source is made (plan and enumerator). */
static void make_src(smelt_dtype dt, int rb, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "bem_update_%s_r%d", smelt_dtype_name(dt), ranks[rb]);
  src->body = "bem_update.cu";
  smelt__prelude_define(src, "SMELT_DT", dt);
  smelt__prelude_define(src, "SMELT_RP", ranks[rb]);
  smelt__prelude_define(src, "SMELT_BM", dt == SMELT_DTYPE_F32 ? FMA_BM : MMA_BM);
  smelt__prelude_define(src, "SMELT_BK", MMA_BK);
  smelt__prelude_define(src, "SMELT_STAGES", MMA_STAGES);
  smelt__prelude_define(src, "SMELT_BN", MMA_BN);
  smelt__prelude_define(src, "SMELT_TB", MMA_TB);
}

int smelt__bem_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  for (size_t d = 0; d < sizeof bem_dtypes / sizeof *bem_dtypes; d++)
    for (int rb = 0; rb < NRANKS; rb++, n++)
      if (n < max) make_src(bem_dtypes[d], rb, &out[n]);
  return n;
}

/* t's columns (dim 1) have unit stride, or there is at most one. */
static smelt_status unit_columns(const smelt_tensor *t, const char *name) {
  if (t->shape[1] <= 1 || t->strides[1] == 1) return SMELT_OK;
  return smelt__error(SMELT_STATUS_BAD_LAYOUT, OP ": %s.strides[1]=%lld must be 1 on CUDA (rows of unit stride)", name,
                      (long long)t->strides[1]);
}

/* What the forward kernel cannot take: strided columns of x, codes or y,
 * a grid beyond 2^31 - 1 CTAs, more shared memory than the device allows
 * a CTA. rb: the rank bucket. */
static smelt_status check_forward(const smelt_plan *plan, const smelt_tensor *const *t, int rb) {
  const smelt__bem_state *st = (const smelt__bem_state *)plan->opdata;
  smelt_status s;
  if ((s = unit_columns(t[SMELT__BT_X], "x")) || (s = unit_columns(t[SMELT__BT_CODES], "codes")) ||
      (s = unit_columns(t[SMELT__BT_Y], "y")))
    return s;
  const int f32 = t[SMELT__BT_X]->dtype == SMELT_DTYPE_F32;
  if (smelt__ceil_div(st->M, f32 ? FMA_BM : MMA_BM) + (t[SMELT__BT_OFFSETS] ? st->A + 2 : 0) > 0x7fffffff)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": M=%lld with %lld adapters needs more than 2^31 - 1 CTAs",
                        (long long)st->M, (long long)st->A);
  const int optin = plan->ctx->cuda->info.smem_per_block_optin;
  const unsigned smem = mma_smem((unsigned)ranks[rb], st->desc.accumulate);
  if (!f32 && optin > 0 && smem > (unsigned)optin)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": rank %lld needs %u bytes of shared memory a CTA; this device allows %d", (long long)st->r,
                        smem, optin);
  return SMELT_OK;
}

static smelt_status plan_bem(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt__bem_state *st = (const smelt__bem_state *)plan->opdata;
  if (st->backward && t[SMELT__BT_OFFSETS])
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP "_backward: the backward with segments (offsets) is not supported on CUDA yet (the CPU "
                           "backend runs it)");
  if (st->backward) return smelt__bem_compose_plan(plan, t);
  int rb = 0;
  while (ranks[rb] < st->r) rb++;
  smelt_status s = check_forward(plan, t, rb);
  if (s) return s;
  const smelt_dtype dt = t[SMELT__BT_X]->dtype;
  smelt__kernel_src src;
  make_src(dt, rb, &src);
  const char *entry = dt == SMELT_DTYPE_F32 ? "bem_update_fma" : "bem_update_mma";
  CUfunction f;
  if ((s = smelt__cuda_function(plan->ctx, &src, entry, &f))) return s;
  plan->func[0] = f;
  plan->variant = rb;
  plan->block = THREADS;
  snprintf(plan->describe, sizeof plan->describe, "%.40s.%s (bem_update.cu, %d rows a CTA, rank padded to %d)",
           src.name, entry, dt == SMELT_DTYPE_F32 ? FMA_BM : MMA_BM, ranks[rb]);
  return SMELT_OK;
}

/* The kernel's parameter block (kernels/bem_update.cu, bem_params). */
typedef struct bem_params {
  uint64_t x, v, codes, u, offs, scales, y;
  int64_t M, din, dout;
  int64_t x_rs, codes_rs, y_rs;
  int64_t v_a, v_k, v_j;
  int64_t u_a, u_n, u_j;
  int64_t scales_s, offs_s;
  float scale;
  int r, A, segs, offs64, accumulate;
  int x_vec, y_vec, v_vec, u_vec, v_t, u_t;
} bem_params;

static int aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }

/* A stride along which 8 neighbours form 16 aligned bytes, or unused. */
static int whole8(int64_t stride, int64_t n) { return n <= 1 || stride % 8 == 0; }

/* The strides (adapter, row, rank) of v or u, 2-D or 3-D. */
static void weight_strides(const smelt_tensor *w, int64_t *sa, int64_t *sr, int64_t *sj) {
  const int d = w->ndim - 2;
  *sa = d ? w->strides[0] : 0;
  *sr = w->strides[d];
  *sj = w->strides[d + 1];
}

static void fill_params(const smelt__bem_state *st, const smelt_tensor *const *t, bem_params *P) {
  const smelt_tensor *x = t[SMELT__BT_X], *v = t[SMELT__BT_V], *codes = t[SMELT__BT_CODES], *u = t[SMELT__BT_U];
  const smelt_tensor *offs = t[SMELT__BT_OFFSETS], *scales = t[SMELT__BT_SCALES], *y = t[SMELT__BT_Y];
  memset(P, 0, sizeof *P);
  P->x = (uint64_t)(uintptr_t)x->data;
  P->v = (uint64_t)(uintptr_t)v->data;
  P->codes = (uint64_t)(uintptr_t)codes->data;
  P->u = (uint64_t)(uintptr_t)u->data;
  P->y = (uint64_t)(uintptr_t)y->data;
  P->M = st->M;
  P->din = st->din;
  P->dout = st->dout;
  P->x_rs = x->strides[0];
  P->codes_rs = codes->strides[0];
  P->y_rs = y->strides[0];
  weight_strides(v, &P->v_a, &P->v_k, &P->v_j);
  weight_strides(u, &P->u_a, &P->u_n, &P->u_j);
  P->scale = (float)st->desc.scale;
  P->r = (int)st->r;
  P->A = (int)st->A;
  P->accumulate = st->desc.accumulate;
  if (offs) {
    P->segs = 1;
    P->offs = (uint64_t)(uintptr_t)offs->data;
    P->offs_s = offs->strides[0];
    P->offs64 = offs->dtype == SMELT_DTYPE_I64;
  }
  if (scales) {
    P->scales = (uint64_t)(uintptr_t)scales->data;
    P->scales_s = scales->strides[0];
  }
  /* cp.async and 16-byte stores: rows (x, y) or runs of 8 along the
   * contiguous dim that start 16-byte aligned: V along d_in (v_vec) or
   * the rank (v_t, the seed's V [d_in, r]), U along the rank (u_vec) or
   * d_out (u_t, the pre-transposed U). */
  P->x_vec = aligned16(x->data) && whole8(P->x_rs, st->M);
  P->y_vec = aligned16(y->data) && whole8(P->y_rs, st->M);
  const int va = aligned16(v->data) && whole8(P->v_a, st->A), ua = aligned16(u->data) && whole8(P->u_a, st->A);
  P->v_vec = va && (P->v_k == 1 || st->din == 1) && whole8(P->v_j, st->r);
  P->v_t = !P->v_vec && va && (P->v_j == 1 || st->r == 1) && whole8(P->v_k, st->din);
  P->u_vec = ua && (P->u_j == 1 || st->r == 1) && whole8(P->u_n, st->dout);
  P->u_t = !P->u_vec && ua && (P->u_n == 1 || st->dout == 1) && whole8(P->u_j, st->r);
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt__bem_state *st = (const smelt__bem_state *)plan->opdata;
  if (st->backward) return smelt__bem_compose_run(plan, t);
  if (st->M == 0 || st->dout == 0) return SMELT_OK;
  bem_params P;
  fill_params(st, t, &P);
  const int f32 = t[SMELT__BT_X]->dtype == SMELT_DTYPE_F32;
  const int64_t grid = smelt__ceil_div(st->M, f32 ? FMA_BM : MMA_BM) + (P.segs ? st->A + 2 : 0);
  void *params[] = {&P};
  smelt__nvtx_push(OP);
  smelt_status s = smelt__cuda_launch(plan->ctx, OP, (CUfunction)plan->func[0], (unsigned)grid, 1, 1, THREADS,
                                      f32 ? 0 : mma_smem((unsigned)ranks[plan->variant], st->desc.accumulate), params);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_bem = {.plan = plan_bem, .run = run};
