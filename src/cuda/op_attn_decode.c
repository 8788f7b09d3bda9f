/* smelt_attention_decode on CUDA: kernels/attn_decode.cu, one module per
 * (dtype, head dim, row warps), each with dec_fwd and dec_combine.
 *
 * The plan fixes a typed config once: the row warps (by the rows a kv
 * head's group brings, group × Sq: one warp of rows and four along the
 * keys for up to 16 rows, two and two up to 32, four warps of rows past
 * that), the shared memory, and the split count. Splits follow
 * FlashAttention's heuristic on the CTAs the device holds at once (SMs ×
 * CTAs per SM by shared memory, at most 2 by registers: about 200 a
 * thread at D 128), counting only the splits that get tiles: the fewest
 * splits whose last wave is at least 85% as full as the best count's, with
 * at least two key tiles per split of the longest sequence the block table
 * can hold (the host never reads cache_seqlens, which live on the
 * device). One split writes O and LSE directly; more write partial rows to
 * a pool workspace that dec_combine merges (on sm_90 launched as dec_fwd's
 * programmatic dependent). */
#include "../core/attn_decode_internal.h"
#include "cuda_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The host twin of dec_params in kernels/attn_decode.cu, byte for byte. */
typedef struct smelt__dec_kparams {
  uint64_t q, k, v, o, lse, table, seqlens, o_part, lse_part;
  int64_t q_bs, q_rs, q_hs;
  int64_t o_bs, o_rs, o_hs;
  int64_t k_ps, k_rs, k_hs;
  int64_t v_ps, v_rs, v_hs;
  int64_t lse_bs, lse_hs, lse_rs;
  int64_t t_bs, t_ps, sl_s;
  int B, H, Hk, group, Sq, M;
  int pages, page_size, max_pages, splits;
  int causal, row_blocks;
  float scale_log2, pad;
} smelt__dec_kparams;

_Static_assert(sizeof(smelt__dec_kparams) == 272, "smelt__dec_kparams must match dec_params");

#define DEC_BN 64      /* keys per tile (BN in the kernel) */
#define DEC_THREADS 128
#define DEC_MAX_SPLITS 128 /* the kernel's prelude gets it too: dec_combine's lanes hold 4 splits each */

static const smelt_dtype dec_dtypes[] = {SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const int dec_dims[] = {64, 128};
static const int dec_rws[] = {1, 2, 4};

/* What a plan decided. */
typedef struct dec_config {
  int rw, bm, row_blocks, splits, smem;
} dec_config;

/* The one place a variant's source is made (plan and enumerator). */
static void make_src(smelt_dtype dt, int d, int rw, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "attn_decode_%s_d%d_rw%d", smelt_dtype_name(dt), d, rw);
  src->body = "attn_decode.cu";
  smelt__prelude_define(src, "SMELT_DT", dt);
  smelt__prelude_define(src, "ATTN_D", d);
  smelt__prelude_define(src, "DEC_RW", rw);
  smelt__prelude_define(src, "DEC_MAX_SPLITS", DEC_MAX_SPLITS);
}

int smelt__attention_decode_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  for (int t = 0; t < 2; t++)
    for (int d = 0; d < 2; d++)
      for (int r = 0; r < 3; r++, n++)
        if (n < max) make_src(dec_dtypes[t], dec_dims[d], dec_rws[r], &out[n]);
  return n;
}

/* Shared memory of dec_fwd: Q (bm rows) and two stages of K and V (BN
 * rows each), rows of D rounded up to 64 elements; or, if larger, the
 * merge at the end (f32 O of 64 rows and two floats per row and warp). */
static int dec_smem(int d, int rw) {
  const int rb = (d + 63) / 64 * 64 * 2, main = (16 * rw + 4 * DEC_BN) * rb, merge = 64 * d * 4 + 2 * 64 * 4;
  return main > merge ? main : merge;
}

/* Splits that share tiles tiles out ceil(tiles / s) each use only
 * ceil(tiles / that) CTAs: the count that actually runs. */
static int64_t used_splits(int64_t tiles, int64_t s) { return smelt__ceil_div(tiles, smelt__ceil_div(tiles, s)); }

static int64_t dec_splits(int64_t ctas, int64_t tiles, int sms, int occ) {
  int64_t cap = tiles / 2 < DEC_MAX_SPLITS ? tiles / 2 : DEC_MAX_SPLITS;
  if (cap < 1 || ctas < 1) return 1;
  const double slots = (double)sms * occ;
  double eff[DEC_MAX_SPLITS + 1], best = 0.0;
  for (int64_t s = 1; s <= cap; s++) {
    const double waves = (double)(ctas * used_splits(tiles, s)) / slots;
    eff[s] = waves / (double)(int64_t)(waves + 0.999999);
    if (eff[s] > best) best = eff[s];
  }
  for (int64_t s = 1; s <= cap; s++)
    if (eff[s] >= 0.85 * best) return used_splits(tiles, s);
  return 1;
}

static const int dec_roles16[] = {SMELT__DEC_Q, SMELT__DEC_K, SMELT__DEC_V, SMELT__DEC_O};
static const char *const dec_names16[] = {"q", "k_cache", "v_cache", "o"};

/* Strides but D's a whole number of 16 bytes (8 elements). */
static smelt_status check_strides(const char *op, const smelt_tensor *planned) {
  for (int i = 0; i < 4; i++) {
    const smelt_tensor *t = &planned[dec_roles16[i]];
    if (smelt_tensor_numel(t) == 0) continue;
    for (int d = 0; d < 3; d++)
      if (t->shape[d] > 1 && t->strides[d] % 8)
        return smelt__error(SMELT_STATUS_UNSUPPORTED,
                            "%s: %s.strides[%d]=%lld: the CUDA kernels need every stride but D's to be a multiple of "
                            "16 bytes (8 elements)",
                            op, dec_names16[i], d, (long long)t->strides[d]);
  }
  return SMELT_OK;
}

static smelt_status check_pointers(const char *op, const smelt_tensor *const *t) {
  for (int i = 0; i < 4; i++) {
    const smelt_tensor *x = t[dec_roles16[i]];
    if (smelt_tensor_numel(x) > 0 && (uintptr_t)x->data % 16)
      return smelt__error(SMELT_STATUS_MISALIGNED, "%s: %s.data=%p must be aligned to 16 bytes for the CUDA kernels",
                          op, dec_names16[i], x->data);
  }
  return SMELT_OK;
}

/* The config for the planned call on dev, or UNSUPPORTED with the supported set. */
static smelt_status configure(const smelt_plan *plan, const smelt_device_info *dev, dec_config *cfg) {
  const char *op = smelt__family_attention_decode.op;
  const smelt_tensor *q = &plan->t[SMELT__DEC_Q];
  smelt__paged_geom g;
  smelt__paged_geom_of(q, &plan->t[SMELT__DEC_K], &plan->t[SMELT__DEC_TABLE], &g);
  if (dev->cc_major < 8)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: the CUDA kernels need compute capability 8.0 or newer (device is %s)",
                        op, dev->arch);
  if (q->dtype != SMELT_DTYPE_F16 && q->dtype != SMELT_DTYPE_BF16)
    return smelt__error(SMELT_STATUS_DTYPE_MISMATCH, "%s: q.dtype=%s is not supported on cuda (supported: f16, bf16)", op,
                        smelt_dtype_name(q->dtype));
  if (g.D != 64 && g.D != 128)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: head dim D=%lld has no CUDA decode kernel (supported: 64, 128)",
                        op, (long long)g.D);
  if (g.B > 65535 || g.Hk > 65535)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: B=%lld and Hk=%lld must be at most 65535 on CUDA (grid limits)",
                        op, (long long)g.B, (long long)g.Hk);
  smelt_status s = check_strides(op, plan->t);
  if (s) return s;
  const int64_t M = g.H / g.Hk * g.Sq;
  cfg->rw = M <= 16 ? 1 : M <= 32 ? 2 : 4;
  cfg->bm = 16 * cfg->rw;
  cfg->row_blocks = (int)smelt__ceil_div(M, cfg->bm);
  cfg->smem = dec_smem((int)g.D, cfg->rw);
  if (cfg->smem > dev->smem_per_block_optin)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: the D=%lld kernel needs %d bytes of shared memory per block; %s offers %d",
                        op, (long long)g.D, cfg->smem, dev->name, dev->smem_per_block_optin);
  int occ = (dev->smem_per_block_optin + 1024) / (cfg->smem + 1024);
  occ = occ < 1 ? 1 : occ > 2 ? 2 : occ;
  const int64_t ctas = g.B * g.Hk * cfg->row_blocks, tiles = smelt__ceil_div(g.max_pages * g.page_size, DEC_BN);
  cfg->splits = (int)dec_splits(ctas, tiles, dev->sm_count, occ);
  /* SMELT_DECODE_SPLITS=N, a debug override for sweeps: N splits (at most
   * the key tiles and DEC_MAX_SPLITS) instead of the heuristic's. */
  const char *forced = smelt__getenv("SMELT_DECODE_SPLITS");
  const long want = forced ? strtol(forced, NULL, 10) : 0;
  if (want >= 1 && tiles >= 1) cfg->splits = (int)used_splits(tiles, want < DEC_MAX_SPLITS ? want : DEC_MAX_SPLITS);
  if (smelt__ceil_div(g.B * g.Hk * M, DEC_THREADS / 32) > INT32_MAX)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: B * Hk * H / Hk * Sq = %lld query rows are too many for one grid",
                        op, (long long)(g.B * g.Hk * M));
  return SMELT_OK;
}

enum { F_FWD, F_COMBINE };

static smelt_status plan_decode(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  dec_config cfg;
  smelt_status s = configure(plan, &plan->ctx->cuda->info, &cfg);
  if (s || (s = check_pointers(smelt__family_attention_decode.op, t))) return s;
  smelt__kernel_src src;
  make_src(t[SMELT__DEC_Q]->dtype, (int)t[SMELT__DEC_Q]->shape[3], cfg.rw, &src);
  CUfunction f;
  if ((s = smelt__cuda_function(plan->ctx, &src, "dec_fwd", &f))) return s;
  plan->func[F_FWD] = f;
  if ((s = smelt__cuda_function(plan->ctx, &src, "dec_combine", &f))) return s;
  plan->func[F_COMBINE] = f;
  dec_config *keep = malloc(sizeof *keep);
  if (!keep) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "%s: out of host memory", smelt__family_attention_decode.op);
  *keep = cfg;
  plan->backend = keep;
  plan->backend_free = free;
  plan->block = DEC_THREADS;
  snprintf(plan->describe, sizeof plan->describe, "attention decode %.60s (attn_decode.cu, %d row warps, %d split%s)",
           src.name, cfg.rw, cfg.splits, cfg.splits > 1 ? "s + combine" : "");
  return SMELT_OK;
}

static void kparams(const smelt_plan *plan, const smelt_tensor *const *t, const dec_config *cfg,
                    smelt__dec_kparams *kp) {
  const smelt_tensor *q = t[SMELT__DEC_Q], *k = t[SMELT__DEC_K], *v = t[SMELT__DEC_V], *o = t[SMELT__DEC_O];
  const smelt_tensor *lse = t[SMELT__DEC_LSE], *tab = t[SMELT__DEC_TABLE], *sl = t[SMELT__DEC_SEQLENS];
  smelt__paged_geom g;
  smelt__paged_geom_of(q, k, tab, &g);
  memset(kp, 0, sizeof *kp);
  kp->q = (uint64_t)(uintptr_t)q->data;
  kp->k = (uint64_t)(uintptr_t)k->data;
  kp->v = (uint64_t)(uintptr_t)v->data;
  kp->o = (uint64_t)(uintptr_t)o->data;
  kp->table = (uint64_t)(uintptr_t)tab->data;
  kp->seqlens = (uint64_t)(uintptr_t)sl->data;
  kp->q_bs = q->strides[0], kp->q_rs = q->strides[1], kp->q_hs = q->strides[2];
  kp->o_bs = o->strides[0], kp->o_rs = o->strides[1], kp->o_hs = o->strides[2];
  kp->k_ps = k->strides[0], kp->k_rs = k->strides[1], kp->k_hs = k->strides[2];
  kp->v_ps = v->strides[0], kp->v_rs = v->strides[1], kp->v_hs = v->strides[2];
  if (lse) {
    kp->lse = (uint64_t)(uintptr_t)lse->data;
    kp->lse_bs = lse->strides[0], kp->lse_hs = lse->strides[1], kp->lse_rs = lse->strides[2];
  }
  kp->t_bs = tab->strides[0], kp->t_ps = tab->strides[1], kp->sl_s = sl->strides[0];
  kp->B = (int)g.B, kp->H = (int)g.H, kp->Hk = (int)g.Hk, kp->group = (int)(g.H / g.Hk), kp->Sq = (int)g.Sq;
  kp->M = kp->group * kp->Sq;
  kp->pages = g.pages > INT32_MAX ? INT32_MAX : (int)g.pages;
  kp->page_size = (int)g.page_size, kp->max_pages = (int)g.max_pages;
  kp->splits = cfg->splits, kp->row_blocks = cfg->row_blocks;
  kp->causal = ((const smelt_attention_decode_desc *)plan->opdata)->causal;
  kp->scale_log2 = (float)(smelt__decode_scale(plan) * 1.4426950408889634);
}

static smelt_status run(smelt_plan *plan, const smelt_tensor *const *t) {
  const char *op = smelt__family_attention_decode.op;
  const dec_config *cfg = (const dec_config *)plan->backend;
  smelt_ctx *ctx = plan->ctx;
  smelt_status s = check_pointers(op, t);
  if (s) return s;
  smelt__dec_kparams kp;
  kparams(plan, t, cfg, &kp);
  if (kp.B == 0) return SMELT_OK;
  void *params[] = {&kp};
  const unsigned gx = (unsigned)(cfg->row_blocks * cfg->splits);
  if (cfg->splits == 1)
    return smelt__cuda_launch(ctx, op, (CUfunction)plan->func[F_FWD], gx, (unsigned)kp.Hk, (unsigned)kp.B, DEC_THREADS,
                              (unsigned)cfg->smem, params);
  /* Partial rows, f32 [splits][B][Hk][M][D], then their LSE [splits][B][Hk][M]. */
  const size_t rows = (size_t)cfg->splits * (size_t)kp.B * (size_t)kp.Hk * (size_t)kp.M;
  const size_t opart = (rows * (size_t)plan->t[SMELT__DEC_Q].shape[3] * 4 + 255) / 256 * 256;
  void *ws = NULL;
  if ((s = smelt__cuda_alloc(ctx, opart + rows * 4, &ws))) return s;
  kp.o_part = (uint64_t)(uintptr_t)ws;
  kp.lse_part = kp.o_part + opart;
  s = smelt__cuda_launch(ctx, op, (CUfunction)plan->func[F_FWD], gx, (unsigned)kp.Hk, (unsigned)kp.B, DEC_THREADS,
                         (unsigned)cfg->smem, params);
  /* The combine as dec_fwd's programmatic dependent on sm_90 (the kernel
   * file says how they meet), a plain launch before. */
  const unsigned cgrid = (unsigned)smelt__ceil_div((int64_t)kp.B * kp.Hk * kp.M, DEC_THREADS / 32);
  CUfunction combine = (CUfunction)plan->func[F_COMBINE];
  if (!s && ctx->cuda->info.cc_major >= 9)
    s = smelt__cuda_launch_dependent(ctx, op, combine, cgrid, DEC_THREADS, 0, params);
  else if (!s)
    s = smelt__cuda_launch(ctx, op, combine, cgrid, 1, 1, DEC_THREADS, 0, params);
  smelt_status s2 = smelt__cuda_free(ctx, ws);
  return s ? s : s2;
}

static smelt_status run_decode(smelt_plan *plan, const void *args) {
  smelt__nvtx_push(smelt__family_attention_decode.op);
  smelt_status s = run(plan, (const smelt_tensor *const *)args);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_attention_decode = {.plan = plan_decode, .run = run_decode};
