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

smelt_status smelt__gemm_prep_load(smelt_ctx *ctx, const smelt__gemm_prep prep[2], CUfunction *f) {
  smelt__kernel_src src;
  smelt__gemm_prep_src(&src);
  const int pitch = prep[0] == SMELT__PREP_PITCH || prep[1] == SMELT__PREP_PITCH;
  return smelt__cuda_function(ctx, &src, pitch ? "gemm_prep_pitch" : "gemm_prep", f);
}

int smelt__gemm_prep_geom_of(int which, const smelt__gemm_prob *p, smelt__gemm_prep_geom *g) {
  /* A: M along rs, K along cs; B: K along rs, N along cs. */
  const smelt__gemm_mat *x = which ? &p->b : &p->a;
  const int64_t mn = which ? p->n : p->m, s_k = which ? x->rs : x->cs, s_mn = which ? x->cs : x->rs;
  if (p->k <= 1 || s_k == 1)
    *g = (smelt__gemm_prep_geom){.kmajor = 1, .rows = mn, .cols = p->k, .pitch = s_mn};
  else if (mn <= 1 || s_mn == 1)
    *g = (smelt__gemm_prep_geom){.kmajor = 0, .rows = p->k, .cols = mn, .pitch = s_k};
  else
    return 0;
  return 1;
}

int64_t smelt__gemm_prep_pitch_ld(int64_t cols) { return smelt__ceil_div(cols, 64) * 64; }

size_t smelt__gemm_prep_bytes(smelt__gemm_prep prep, int which, const smelt__gemm_prob *p, smelt_dtype dt) {
  int64_t elems = 0;
  if (prep == SMELT__PREP_PITCH) {
    smelt__gemm_prep_geom g;
    if (smelt__gemm_prep_geom_of(which, p, &g)) elems = g.rows * smelt__gemm_prep_pitch_ld(g.cols);
  } else if (prep) {
    elems = (which ? p->n : p->m) * smelt__gemm_prep_ld(prep, p->k, dt);
  }
  return ((size_t)elems * smelt_dtype_size(dt) + 255) / 256 * 256;
}

/* Runs the pre-pass on the context's stream: operand `which` (0: A, whose
 * rows are M; 1: B, whose rows are N) of dtype dt, rows x k elements,
 * element (r, kk) at src + (r * s_r + kk * s_k) * size, into dst (16-byte
 * aligned, rows x smelt__gemm_prep_ld elements). */
static smelt_status run_form(smelt_ctx *ctx, CUfunction f, smelt__gemm_prep prep, int which, const void *src,
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

/* One copy of gemm_prep_pitch (pitch_copy in kernels/gemm_prep.cu). */
typedef struct smelt__gemm_pitch_copy {
  uint64_t src, dst;
  int64_t s_src, s_dst;
  uint32_t rows, cols, units, blocks;
} smelt__gemm_pitch_copy;

/* Launch parameters: the host twin of pitch_params. */
typedef struct smelt__gemm_pitch_params {
  smelt__gemm_pitch_copy c[2];
} smelt__gemm_pitch_params;

_Static_assert(sizeof(smelt__gemm_pitch_params) == 96, "smelt__gemm_pitch_params must match pitch_params");

enum { PITCH_UNITS = THREADS * 4 }; /* 16-byte units a block moves (NT * PU) */

/* Fills c for operand `which` of p into dst and points the operand at it;
 * UNSUPPORTED when the copy is too large for the kernel's 32-bit unit
 * numbering (2^31 units: 32 GiB). */
static smelt_status pitch_copy_of(int which, smelt__gemm_prob *p, void *dst, smelt__gemm_pitch_copy *c) {
  smelt__gemm_mat *x = which ? &p->b : &p->a;
  smelt__gemm_prep_geom g;
  if (!smelt__gemm_prep_geom_of(which, p, &g))
    return smelt__error(SMELT_STATUS_INTERNAL, "smelt_gemm: the 16-bit pre-pass got an operand with no unit stride");
  const int64_t units = smelt__ceil_div(g.cols, 8), ld = smelt__gemm_prep_pitch_ld(g.cols);
  if (g.rows * units >= ((int64_t)1 << 31))
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm: the 16-bit pre-pass's %lld x %lld operand is too large",
                        (long long)g.rows, (long long)g.cols);
  c->src = (uint64_t)(uintptr_t)x->data;
  c->dst = (uint64_t)(uintptr_t)dst;
  c->s_src = g.rows > 1 ? g.pitch : 0;
  c->s_dst = ld;
  c->rows = (uint32_t)g.rows;
  c->cols = (uint32_t)g.cols;
  c->units = (uint32_t)units;
  c->blocks = (uint32_t)smelt__ceil_div(g.rows * units, PITCH_UNITS);
  x->data = dst;
  /* The copy's unit stride is along rs for an M-major A or a K-major B
   * (A's rs runs along M, B's along K). */
  const int rs_unit = which ? g.kmajor : !g.kmajor;
  x->rs = rs_unit ? 1 : ld;
  x->cs = rs_unit ? ld : 1;
  return SMELT_OK;
}

/* Both PITCH copies of a plan in one launch (an operand without one gets
 * no blocks). */
static smelt_status run_pitch(smelt_ctx *ctx, CUfunction f, const smelt__gemm_prep prep[2], smelt__gemm_prob *p,
                              char *ws, size_t a_bytes) {
  smelt__gemm_pitch_params pp;
  memset(&pp, 0, sizeof pp);
  smelt_status s = SMELT_OK;
  for (int w = 0; w < 2 && !s; w++)
    if (prep[w] == SMELT__PREP_PITCH) s = pitch_copy_of(w, p, ws + (w ? a_bytes : 0), &pp.c[w]);
  if (s) return s;
  const int64_t blocks = (int64_t)pp.c[0].blocks + pp.c[1].blocks;
  if (blocks == 0) return SMELT_OK;
  if (blocks > 0x7fffffff)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm: the 16-bit pre-pass's %lld blocks exceed 2^31 - 1",
                        (long long)blocks);
  void *params[] = {&pp};
  return smelt__cuda_launch(ctx, "smelt_gemm (16-bit operand pre-pass)", f, (unsigned)blocks, 1, 1, THREADS, 0,
                            params);
}

smelt_status smelt__gemm_prep_operands(smelt_ctx *ctx, CUfunction f, const smelt__gemm_prep prep[2], smelt_dtype dt_a,
                                       smelt_dtype dt_b, smelt__gemm_prob *p, char *ws) {
  const size_t a_bytes = smelt__gemm_prep_bytes(prep[0], 0, p, dt_a);
  if (prep[0] == SMELT__PREP_PITCH || prep[1] == SMELT__PREP_PITCH) return run_pitch(ctx, f, prep, p, ws, a_bytes);
  smelt_status s = SMELT_OK;
  if (prep[0]) {
    s = run_form(ctx, f, prep[0], 0, p->a.data, dt_a, p->m, p->k, p->a.rs, p->a.cs, ws);
    p->a.data = ws;
    p->a.rs = smelt__gemm_prep_ld(prep[0], p->k, dt_a);
    p->a.cs = 1;
  }
  if (!s && prep[1]) {
    s = run_form(ctx, f, prep[1], 1, p->b.data, dt_b, p->n, p->k, p->b.cs, p->b.rs, ws + a_bytes);
    p->b.data = ws + a_bytes;
    p->b.cs = smelt__gemm_prep_ld(prep[1], p->k, dt_b);
    p->b.rs = 1;
  }
  return s;
}
