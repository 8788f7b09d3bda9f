/* smelt attention on CUDA: the kernel table, the selector, plan and run.
 *
 * The table lists every kernel that exists: per dtype (f16, bf16) the
 * FlashAttention-2 forward (kernels/attn_fwd_sm80.cu) for head dims 64, 96,
 * 128, 256, the backward (kernels/attn_bwd_sm80.cu) for 64, 96, 128, its
 * pre/post kernels (kernels/attn_bwd_aux.cu), the Hopper forward
 * (kernels/attn_fwd_sm90.cu) for 64 and 128 and the Hopper backward
 * (kernels/attn_bwd_sm90.cu) for 128; and each of them again per set of
 * score modifiers it can run (variant_mods: the field `mods`, which
 * make_src turns into ATTN_SOFTCAP / ATTN_ALIBI / ATTN_SINKS, the
 * #ifdef'd modifier code of attn_common.cuh; a kernel without modifiers
 * is the plain one, text for text). The variant enumerator walks
 * the table and the selector only returns its entries, so what can be
 * picked is what the compile test builds.
 *
 * Selection: the Hopper kernel on sm_90 when the head dim has one and the
 * tensors suit TMA (the same 16-byte rules), else the mma.sync kernel; the
 * backward likewise, except that its deterministic mode (which the
 * context's flag may turn on after planning) always runs the mma.sync
 * kernel: a Hopper backward plan loads both and run picks. Everything the kernels need
 * that the core does not check is checked here, with UNSUPPORTED and the
 * supported set: compute capability 8.0+, the head dim, 16-byte aligned
 * 16-bit tensors (pointers and strides), the grid's limits and the
 * device's shared memory.
 *
 * Run: the forward is one launch, grid (query tiles, H, B), or on Hopper
 * with a persistent schedule (fwd90_schedule(), desc.fwd_schedule)
 * one CTA per SM walking the query tiles; the dynamic one first zeroes
 * its tile counter, a pool allocation of its own. The backward
 * takes one workspace from the context's pool (dq's f32 accumulator, LSE ·
 * log2 e, rowsum(dO ∘ O), and in deterministic mode one counter per
 * (sequence, head, query tile)), then launches attn_bwd_pre, attn_bwd or
 * attn_bwd_sm90 (grid (key tiles, Hk, B)) and attn_bwd_dq, and frees the workspace in
 * stream order. */
#include "../core/attention_internal.h"
#include "cuda_internal.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* Launch parameters: the host twins of attn_tensor and attn_params in
 * kernels/attn_common.cuh, byte for byte (both sides assert the sizes). */
typedef struct smelt__attn_ktensor {
  uint64_t p;
  int64_t bs, rs, hs;
} smelt__attn_ktensor;

typedef struct smelt__attn_kparams {
  smelt__attn_ktensor q, k, v, o, d_o, dq, dk, dv;
  uint64_t lse;
  int64_t lse_bs, lse_hs, lse_rs;
  uint64_t cu_q, cu_k;
  uint64_t dq_acc, lse_ws, dsum_ws, sem;
  int64_t rows_q, rows_k;
  int64_t wl, wr;
  int B, H, Hk, group;
  int seqlen_q, seqlen_k;
  int m_tiles;
  int deterministic;
  int D;
  int pad;
  float scale, scale_log2;
  /* The modifier variants' tail (ATTN_MODS): the others' attn_params ends
   * before it, and a launch copies only the kernel's own parameter size. */
  uint64_t alibi, sinks, dsinks;
  float softcap;
  int pad_mods;
} smelt__attn_kparams;

_Static_assert(sizeof(smelt__attn_ktensor) == 32, "smelt__attn_ktensor must match attn_tensor");
_Static_assert(offsetof(smelt__attn_kparams, alibi) == 416, "smelt__attn_kparams must match attn_params");
_Static_assert(sizeof(smelt__attn_kparams) == 448, "smelt__attn_kparams must match attn_params with ATTN_MODS");

/* ---------------------------------------------------------------- the table */

enum { AK_FWD80, AK_FWD90, AK_BWD80, AK_BWD90, AK_AUX };

typedef struct attn_kernel {
  int fam;
  smelt_dtype dt;
  int d, bn;          /* head dim; keys per tile (forward), per CTA (backward) */
  int bm;             /* queries per CTA (forward), per step (backward) */
  int threads, smem;  /* block size, dynamic shared memory bytes */
  int cons, stages;   /* Hopper forward: consumer warpgroups, K/V ring depth */
  int persist;        /* Hopper forward: its schedule, FWD90_TILES, _STATIC or _DYNAMIC */
  int mods;           /* the score modifiers it applies, SMELT__ATT_MOD_* */
} attn_kernel;

#define MAX_KERNELS 160
#define BWD_BM 64 /* queries per step of attn_bwd and attn_bwd_sm90 (BM in both files) */
/* attn_bwd_sm90's options (docs/PERF.md has their timings): STAGES, the
 * depth of the Q/dO ring (2 or 3); DQ_TMA, dQ added with
 * red.global.add.v2.f32 (0) or through a shared f32 tile and TMA
 * reduce-add (1, 32 KiB more shared memory). */
#define BWD90_STAGES 2
#define BWD90_DQ_TMA 1
/* SPREAD: each block starts its query tiles at an offset, so that the
 * blocks of a head add into different dQ rows at a time (1: 1.03-1.04x at
 * S4k, 4 bytes spilled), or all walk them from the first (0). */
#define BWD90_SPREAD 1
/* The Hopper forward's schedules (ATTN_PERSISTENT in the kernel): one CTA
 * per query tile; one per SM walking the tiles in a static stride of the
 * grid; one per SM taking them from a counter. desc.fwd_schedule picks
 * one; AUTO, fwd90_schedule() decides by the mask, as measured
 * (docs/PERF.md, Attention forward: persistent schedules). */
enum { FWD90_TILES, FWD90_STATIC, FWD90_DYNAMIC };
/* Hopper's 227 KiB per block at D 128 (the smem formula in add() below). */
_Static_assert(1024 + 4 * 128 * 128 + BWD90_STAGES * 4 * BWD_BM * 128 + 2 * 128 * BWD_BM * 2 +
                       BWD90_STAGES * 8 * BWD_BM + 8 * (1 + 2 * BWD90_STAGES) +
                       BWD90_DQ_TMA * BWD_BM * 128 * 4 <=
                   227 * 1024,
               "attn_bwd_sm90's options take more shared memory than an H100 block has");

/* Shared memory as each kernel file lays it out. */
static int row_bytes(int d) { return (d + 63) / 64 * 64 * 2; }

static void add(attn_kernel *t, int *n, int fam, smelt_dtype dt, int d, int bn) {
  attn_kernel k = {fam, dt, d, bn, 0, 0, 0, 0, 0, 0, 0};
  switch (fam) {
    case AK_FWD80: /* Q (64 rows), K and V (bn rows each) */
      k.bm = 64;
      k.threads = 128;
      k.smem = (64 + 2 * bn) * row_bytes(d);
      break;
    case AK_BWD80: /* K, V (bn rows), Q and dO (2 x 64 rows), dSᵀ (bn x 64), LSE and D (2 x 64 f32) */
      k.bm = BWD_BM;
      k.threads = 256;
      k.smem = 2 * bn * row_bytes(d) + 4 * BWD_BM * row_bytes(d) + bn * BWD_BM * 2 + 4 * BWD_BM * 4;
      break;
    case AK_BWD90: /* 1 KiB alignment slack, K, V (bn rows), stages of Q and dO (64 rows each), 2 x dSᵀ (bn x 64),
                      stages of LSE and rowsum (64 f32 each), 1 + 2 x stages mbarriers, the dQ tiles
                      (64 x d f32) with TMA */
      k.bm = BWD_BM;
      k.threads = 384;
      k.stages = BWD90_STAGES;
      k.smem = 1024 + 2 * bn * d * 2 + BWD90_STAGES * 2 * BWD_BM * d * 2 + 2 * bn * BWD_BM * 2 +
               BWD90_STAGES * 2 * BWD_BM * 4 + 8 * (1 + 2 * BWD90_STAGES) +
               BWD90_DQ_TMA * BWD_BM * d * 4;
      break;
    default: k.threads = 256; break;
  }
  t[(*n)++] = k;
}

/* The Hopper forward's shapes: 64 queries per consumer warpgroup, plus the
 * producer's; 1 KiB alignment slack, Q, the stages of K and V (bn rows
 * each), and the mbarriers (Q full; K full, V full, empty per stage;
 * persistent: Q empty; dynamic: the tile ring's full and empty per slot,
 * and its two 4-byte tile numbers). Each shape in every schedule. */
static void add90(attn_kernel *t, int *n, smelt_dtype dt, int d, int bn, int cons, int stages) {
  for (int sched = FWD90_TILES; sched <= FWD90_DYNAMIC; sched++) {
    attn_kernel k = {AK_FWD90, dt, d, bn, 64 * cons, 128 * (cons + 1), 0, cons, stages, sched, 0};
    k.smem = 1024 + (64 * cons + stages * 2 * bn) * d * 2 + 8 * (1 + 3 * stages + (sched != FWD90_TILES) +
                                                                   5 * (sched == FWD90_DYNAMIC));
    t[(*n)++] = k;
  }
}

/* The modifier set of the variant of family fam that runs a call with
 * modifiers mods: what the family's kernels read of them. The forward's
 * variants all take sinks (they cost no work per score; a sink of -inf
 * adds nothing), the backward's main kernels softcap and ALiBi (sinks are
 * in the LSE), the pre/post kernels sinks (attn_bwd_dsink). Idempotent:
 * its fixed points are the sets the table generates. */
static int variant_mods(int fam, int mods) {
  switch (fam) {
    case AK_FWD80:
    case AK_FWD90: return mods ? mods | SMELT__ATT_MOD_SINKS : 0;
    case AK_BWD80:
    case AK_BWD90: return mods & (SMELT__ATT_MOD_SOFTCAP | SMELT__ATT_MOD_ALIBI);
    default: return mods & SMELT__ATT_MOD_SINKS;
  }
}

static int table(attn_kernel *t) {
  int n = 0;
  static const smelt_dtype dts[] = {SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  for (int i = 0; i < 2; i++) {
    const smelt_dtype dt = dts[i];
    /* Keys per tile keep S's registers level with O's: 128 for D 64, 32 for 256. */
    add(t, &n, AK_FWD80, dt, 64, 128);
    add(t, &n, AK_FWD80, dt, 96, 64);
    add(t, &n, AK_FWD80, dt, 128, 64);
    add(t, &n, AK_FWD80, dt, 256, 32);
    /* Measured on H100 (docs/PERF.md): D 64 is bound by the exponentials
     * and wants a third consumer to overlap them; D 128 fits two. */
    add90(t, &n, dt, 64, 128, 3, 4);
    add90(t, &n, dt, 128, 128, 2, 3);
    add(t, &n, AK_BWD80, dt, 64, 128);
    add(t, &n, AK_BWD80, dt, 96, 128);
    add(t, &n, AK_BWD80, dt, 128, 128);
    add(t, &n, AK_BWD90, dt, 128, 128);
    add(t, &n, AK_AUX, dt, 0, 0);
  }
  /* Each kernel again per modifier set its family runs. */
  const int plain = n;
  for (int i = 0; i < plain; i++)
    for (int m = 1; m < 8; m++)
      if (variant_mods(t[i].fam, m) == m) {
        t[n] = t[i];
        t[n++].mods = m;
      }
  return n;
}

/* The modifier defines (none for a plain kernel: its prelude is unchanged)
 * and the name's suffix. */
static void mods_src(const attn_kernel *k, smelt__kernel_src *src) {
  static const char *const name[3] = {"ATTN_SOFTCAP", "ATTN_ALIBI", "ATTN_SINKS"}, *const suffix[3] = {"_softcap", "_alibi", "_sinks"};
  for (int b = 0; b < 3; b++) {
    if (!(k->mods & (1 << b))) continue;
    smelt__prelude_define(src, name[b], 1);
    const size_t used = strlen(src->name);
    snprintf(src->name + used, sizeof src->name - used, "%s", suffix[b]);
  }
}

/* The one place a variant's source is made (plan and enumerator). */
static void make_src(const attn_kernel *k, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  const char *dt = smelt_dtype_name(k->dt);
  switch (k->fam) {
    case AK_FWD80:
      snprintf(src->name, sizeof src->name, "attn_fwd_sm80_%s_d%d_n%d", dt, k->d, k->bn);
      src->body = "attn_fwd_sm80.cu";
      break;
    case AK_FWD90:
      snprintf(src->name, sizeof src->name, "attn_fwd_sm90_%s_d%d_n%d_c%d_s%d%s", dt, k->d, k->bn, k->cons, k->stages,
               k->persist == FWD90_STATIC ? "_persistent" : k->persist == FWD90_DYNAMIC ? "_dynamic" : "");
      src->body = "attn_fwd_sm90.cu";
      smelt__prelude_define(src, "ATTN_CONS", k->cons);
      smelt__prelude_define(src, "ATTN_STAGES", k->stages);
      smelt__prelude_define(src, "ATTN_PERSISTENT", k->persist);
      break;
    case AK_BWD80:
      snprintf(src->name, sizeof src->name, "attn_bwd_sm80_%s_d%d_n%d", dt, k->d, k->bn);
      src->body = "attn_bwd_sm80.cu";
      break;
    case AK_BWD90:
      snprintf(src->name, sizeof src->name, "attn_bwd_sm90_%s_d%d_n%d", dt, k->d, k->bn);
      src->body = "attn_bwd_sm90.cu";
      break;
    default:
      snprintf(src->name, sizeof src->name, "attn_bwd_aux_%s", dt);
      src->body = "attn_bwd_aux.cu";
      smelt__prelude_define(src, "SMELT_DT", k->dt);
      mods_src(k, src);
      return;
  }
  smelt__prelude_define(src, "SMELT_DT", k->dt);
  smelt__prelude_define(src, "ATTN_D", k->d);
  if (k->fam == AK_BWD90) {
    smelt__prelude_define(src, "ATTN_STAGES", BWD90_STAGES);
    smelt__prelude_define(src, "ATTN_DQ_TMA", BWD90_DQ_TMA);
    smelt__prelude_define(src, "ATTN_SPREAD", BWD90_SPREAD);
  }
  if (k->fam != AK_BWD80 && k->fam != AK_BWD90) smelt__prelude_define(src, "ATTN_BN", k->bn);
  mods_src(k, src);
}

int smelt__attention_variants(smelt__kernel_src *out, int max) {
  attn_kernel t[MAX_KERNELS];
  const int n = table(t);
  for (int i = 0; i < n && i < max; i++) make_src(&t[i], &out[i]);
  return n;
}

/* ---------------------------------------------------------------- selection */

static const int roles16[] = {SMELT__ATT_Q, SMELT__ATT_K, SMELT__ATT_V, SMELT__ATT_O,
                              SMELT__ATT_DO, SMELT__ATT_DQ, SMELT__ATT_DK, SMELT__ATT_DV};
static const char *const role_names[SMELT__ATT_COUNT] = {"q",  "k",  "v",  "o",  "lse", "cu_seqlens_q",
                                                         "cu_seqlens_k", "d_o", "dq", "dk", "dv"};

/* Every stride of a dim with more than one element (but D's) is a whole
 * number of 16 bytes: what cp.async and TMA move. */
static smelt_status check_strides(const smelt__attn_state *st) {
  for (size_t i = 0; i < sizeof roles16 / sizeof *roles16; i++) {
    const smelt_tensor *t = &st->t[roles16[i]];
    if (t->ndim < 0 || smelt_tensor_numel(t) == 0) continue;
    for (int d = 0; d < t->ndim - 1; d++)
      if (t->shape[d] > 1 && t->strides[d] % 8)
        return smelt__error(SMELT_STATUS_UNSUPPORTED,
                            "%s: %s.strides[%d]=%lld: the CUDA kernels need every stride but D's to be a multiple "
                            "of 16 bytes (8 elements)",
                            st->op, role_names[roles16[i]], d, (long long)t->strides[d]);
  }
  return SMELT_OK;
}

/* Data pointers 16-byte aligned (plan: the planned ones; run: the bound ones). */
static smelt_status check_pointers(const char *op, const smelt_tensor *const *t) {
  for (size_t i = 0; i < sizeof roles16 / sizeof *roles16; i++) {
    const smelt_tensor *x = t[roles16[i]];
    if (x && smelt_tensor_numel(x) > 0 && (uintptr_t)x->data % 16)
      return smelt__error(SMELT_STATUS_MISALIGNED, "%s: %s.data=%p must be aligned to 16 bytes for the CUDA kernels",
                          op, role_names[roles16[i]], x->data);
  }
  return SMELT_OK;
}

/* The kernel of family fam for dt and d that runs a call's modifiers
 * mods; the Hopper forward's in schedule persist. */
static int find(const attn_kernel *t, int n, int fam, smelt_dtype dt, int d, int persist, int mods) {
  const int want = variant_mods(fam, mods);
  for (int i = 0; i < n; i++)
    if (t[i].fam == fam && t[i].dt == dt && (fam == AK_AUX || t[i].d == d) && t[i].persist == persist &&
        t[i].mods == want)
      return i;
  return -1;
}

/* The Hopper forward's schedule: the one desc.fwd_schedule names, else
 * (AUTO) by the mask. Measured (docs/PERF.md, Attention forward: persistent
 * schedules): the static persistent schedule beats one CTA per tile without
 * a right window (every query tile sees about as many keys) and loses to it
 * under a causal mask; the dynamic one ties one CTA per tile under a causal
 * mask and trails the static one without. */
static int fwd90_schedule(const smelt__attn_state *st) {
  switch (st->desc.fwd_schedule) {
    case SMELT_ATTENTION_SCHEDULE_TILES: return FWD90_TILES;
    case SMELT_ATTENTION_SCHEDULE_PERSISTENT: return FWD90_STATIC;
    case SMELT_ATTENTION_SCHEDULE_DYNAMIC: return FWD90_DYNAMIC;
    default: break;
  }
  /* A right window (causal) the kernel applies: as in run(). */
  const int right = st->wr >= 0 && st->wr < st->Sq + st->Sk;
  return right ? FWD90_TILES : FWD90_STATIC;
}

/* Picks the kernels for st on dev: *main (forward or backward) and, for
 * the backward, *aux and, when *main is the Hopper backward, *det (the
 * mma.sync backward, for the deterministic mode; else -1). `why` says what
 * was chosen. */
static smelt_status select_kernels(const smelt__attn_state *st, const smelt_device_info *dev, const attn_kernel *t,
                                   int n, int *main, int *aux, int *det, char *why, size_t why_n) {
  const smelt_dtype dt = st->t[SMELT__ATT_Q].dtype;
  if (dev->cc_major < 8)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: the CUDA kernels need compute capability 8.0 or newer (device is %s)",
                        st->op, dev->arch);
  smelt_status s = check_strides(st);
  if (s) return s;
  const int64_t D = st->D;
  if (st->B > 65535 || st->H > 65535)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: B=%lld and H=%lld must be at most 65535 on CUDA (grid limits)",
                        st->op, (long long)st->B, (long long)st->H);
  *aux = -1;
  *det = -1;
  int k = -1;
  if (st->bwd) {
    if (D <= 256) k = find(t, n, AK_BWD80, dt, (int)D, 0, st->mods);
    if (k < 0)
      return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: head dim D=%lld has no CUDA backward kernel (supported: 64, 96, 128)",
                          st->op, (long long)D);
    *aux = find(t, n, AK_AUX, dt, 0, 0, st->mods);
    const int h = dev->cc_major == 9 && dev->cc_minor == 0 ? find(t, n, AK_BWD90, dt, (int)D, 0, st->mods) : -1;
    if (h >= 0 && t[h].smem <= dev->smem_per_block_optin) {
      *det = k;
      k = h;
      snprintf(why, why_n, "Hopper: TMA + wgmma, warp-specialized; deterministic: mma.sync");
    } else {
      snprintf(why, why_n, "FlashAttention-2 backward, mma.sync");
    }
  } else {
    if (D <= 256) k = find(t, n, AK_FWD80, dt, (int)D, 0, st->mods);
    if (k < 0)
      return smelt__error(SMELT_STATUS_UNSUPPORTED,
                          "%s: head dim D=%lld has no CUDA forward kernel (supported: 64, 96, 128, 256)", st->op,
                          (long long)D);
    const int sched = fwd90_schedule(st);
    int h = dev->cc_major == 9 && dev->cc_minor == 0 ? find(t, n, AK_FWD90, dt, (int)D, sched, st->mods) : -1;
    /* The dynamic kernel counts tiles in 32 bits: the tiles (varlen: of
     * the longest sequence, per sequence and head) plus one overshoot per
     * CTA must stay below 2^31; past that, one CTA per tile. */
    const int too_many = h >= 0 && sched == FWD90_DYNAMIC &&
                         smelt__ceil_div(st->Sq, t[h].bm) * st->H * st->B > INT32_MAX - dev->sm_count;
    if (too_many) h = find(t, n, AK_FWD90, dt, (int)D, FWD90_TILES, st->mods);
    if (h >= 0 && t[h].smem <= dev->smem_per_block_optin) {
      k = h;
      snprintf(why, why_n, "Hopper: TMA + wgmma, warp-specialized%s",
               too_many                 ? ", one CTA per tile (too many to count)"
               : sched == FWD90_STATIC  ? ", persistent"
               : sched == FWD90_DYNAMIC ? ", persistent, dynamic"
                                        : "");
    } else {
      snprintf(why, why_n, "FlashAttention-2 forward, mma.sync");
    }
  }
  if (t[*det >= 0 ? *det : k].smem > dev->smem_per_block_optin)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        "%s: the D=%lld kernel needs %d bytes of shared memory per block; %s offers %d", st->op,
                        (long long)D, t[k].smem, dev->name, dev->smem_per_block_optin);
  *main = k;
  return SMELT_OK;
}

enum { F_MAIN, F_PRE, F_DQ, F_DET, F_DSINK };

static smelt_status plan_attention(smelt_plan *plan, const void *args) {
  const smelt__attn_state *st = (const smelt__attn_state *)plan->opdata;
  attn_kernel t[MAX_KERNELS];
  const int n = table(t);
  char why[96];
  int main = -1, aux = -1, det = -1;
  smelt_status s = select_kernels(st, &plan->ctx->cuda->info, t, n, &main, &aux, &det, why, sizeof why);
  if (s) return s;
  const smelt_tensor *planned[SMELT__ATT_COUNT];
  for (int r = 0; r < SMELT__ATT_COUNT; r++) planned[r] = st->t[r].ndim >= 0 ? &st->t[r] : NULL;
  if ((s = check_pointers(st->op, planned))) return s;
  smelt__kernel_src src;
  static const char *const entry[] = {[AK_FWD80] = "attn_fwd", [AK_FWD90] = "attn_fwd_sm90", [AK_BWD80] = "attn_bwd",
                                      [AK_BWD90] = "attn_bwd_sm90"};
  make_src(&t[main], &src);
  CUfunction f;
  if ((s = smelt__cuda_function(plan->ctx, &src, entry[t[main].fam], &f))) return s;
  plan->func[F_MAIN] = f;
  if (aux >= 0) {
    smelt__kernel_src asrc;
    make_src(&t[aux], &asrc);
    if ((s = smelt__cuda_function(plan->ctx, &asrc, "attn_bwd_pre", &f))) return s;
    plan->func[F_PRE] = f;
    if ((s = smelt__cuda_function(plan->ctx, &asrc, "attn_bwd_dq", &f))) return s;
    plan->func[F_DQ] = f;
    if (t[aux].mods & SMELT__ATT_MOD_SINKS) {
      if ((s = smelt__cuda_function(plan->ctx, &asrc, "attn_bwd_dsink", &f))) return s;
      plan->func[F_DSINK] = f;
    }
  }
  if (det >= 0) {
    smelt__kernel_src dsrc;
    make_src(&t[det], &dsrc);
    if ((s = smelt__cuda_function(plan->ctx, &dsrc, entry[t[det].fam], &f))) return s;
    plan->func[F_DET] = f;
  }
  plan->variant = main;
  plan->block = t[main].threads;
  snprintf(plan->describe, sizeof plan->describe, "attention %.60s (%.80s)", src.name, why);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- run */

static void ktensor(const smelt__attn_state *st, const smelt_tensor *t, smelt__attn_ktensor *k) {
  if (!t) return;
  smelt__attn_view v;
  smelt__attn_view_of(st, t, &v);
  k->p = (uint64_t)(uintptr_t)v.data;
  k->bs = v.bs;
  k->rs = v.rs;
  k->hs = v.hs;
}

/* A 4-D tensor map over a q/k/v-like tensor for the Hopper kernel: dims
 * (D, rows, heads, batches), boxes of (D, box_rows, 1, 1), the 128-byte
 * swizzle when a row is 128 bytes or more (64-element boxes along D). */
static smelt_status tensor_map(const smelt__attn_state *st, const smelt_tensor *t, int box_rows,
                               smelt__cu_tensor_map *map) {
  if (smelt_tensor_numel(t) == 0) {
    /* No keys: the kernel writes O = 0 and never reads the map. */
    memset(map, 0, sizeof *map);
    return SMELT_OK;
  }
  smelt__attn_view v;
  smelt__attn_view_of(st, t, &v);
  const int64_t heads = st->varlen ? t->shape[1] : t->shape[2];
  const int64_t rows = st->varlen ? t->shape[0] : t->shape[1], batches = st->varlen ? 1 : t->shape[0];
  /* TMA wants every stride a multiple of 16 bytes, even where a dim has one element. */
  const uint64_t rs = rows > 1 ? (uint64_t)v.rs * 2 : (uint64_t)st->D * 2;
  const uint64_t hs = heads > 1 ? (uint64_t)v.hs * 2 : rs * (uint64_t)(rows > 0 ? rows : 1);
  const uint64_t bs = batches > 1 ? (uint64_t)v.bs * 2 : hs * (uint64_t)heads;
  const uint64_t dims[4] = {(uint64_t)st->D, (uint64_t)(rows > 0 ? rows : 1), (uint64_t)heads,
                            (uint64_t)(batches > 0 ? batches : 1)};
  const uint64_t strides[3] = {(rs + 15) / 16 * 16, (hs + 15) / 16 * 16, (bs + 15) / 16 * 16};
  const unsigned box[4] = {64, (unsigned)box_rows, 1, 1}, ones[4] = {1, 1, 1, 1};
  CUresult r = smelt__cu(NULL)->cuTensorMapEncodeTiled(
      map, t->dtype == SMELT_DTYPE_BF16 ? SMELT__TMA_BF16 : SMELT__TMA_F16, 4, t->data, dims, strides, box, ones,
      SMELT__TMA_INTERLEAVE_NONE, SMELT__TMA_SWIZZLE_128B, SMELT__TMA_L2_256B, SMELT__TMA_OOB_FILL_NONE);
  if (r) return smelt__cu_error(r, st->op, "cuTensorMapEncodeTiled");
  return SMELT_OK;
}


/* attn_bwd_sm90: tensor maps over Q and dO (boxes of 64 rows), K and V
 * (boxes of bn rows), then the launch, grid (key tiles, Hk, B). */
static smelt_status launch_bwd90(smelt_plan *plan, const smelt__attn_args *a, const attn_kernel *k,
                                 smelt__attn_kparams *kp) {
  const smelt__attn_state *st = (const smelt__attn_state *)plan->opdata;
  smelt__cu_tensor_map tq, tk, tv, tdo, tdq;
  smelt_status s;
  if ((s = tensor_map(st, a->t[SMELT__ATT_Q], k->bm, &tq)) || (s = tensor_map(st, a->t[SMELT__ATT_K], k->bn, &tk)) ||
      (s = tensor_map(st, a->t[SMELT__ATT_V], k->bn, &tv)) || (s = tensor_map(st, a->t[SMELT__ATT_DO], k->bm, &tdo)))
    return s;
  /* dq_acc, f32 [rows_q][H][D]: boxes of 32 columns x 64 rows of one head, 128-byte swizzle. */
  const uint64_t dims[3] = {(uint64_t)st->D, (uint64_t)st->H, (uint64_t)(st->rows_q > 0 ? st->rows_q : 1)};
  const uint64_t strides[2] = {(uint64_t)st->D * 4, (uint64_t)st->H * (uint64_t)st->D * 4};
  const unsigned box[3] = {32, 1, (unsigned)k->bm}, ones[3] = {1, 1, 1};
  CUresult r = smelt__cu(NULL)->cuTensorMapEncodeTiled(
      &tdq, SMELT__TMA_F32, 3, (void *)(uintptr_t)kp->dq_acc, dims, strides, box, ones, SMELT__TMA_INTERLEAVE_NONE,
      SMELT__TMA_SWIZZLE_128B, SMELT__TMA_L2_256B, SMELT__TMA_OOB_FILL_NONE);
  if (r) return smelt__cu_error(r, st->op, "cuTensorMapEncodeTiled");
  void *p90[] = {&tq, &tk, &tv, &tdo, &tdq, kp};
  return smelt__cuda_launch(plan->ctx, st->op, (CUfunction)plan->func[F_MAIN], (unsigned)smelt__ceil_div(st->Sk, k->bn),
                            (unsigned)st->Hk, (unsigned)st->B, (unsigned)k->threads, (unsigned)k->smem, p90);
}

static smelt_status run(smelt_plan *plan, const smelt__attn_args *a) {
  const smelt__attn_state *st = (const smelt__attn_state *)plan->opdata;
  smelt_ctx *ctx = plan->ctx;
  smelt_status s = check_pointers(st->op, a->t);
  if (s) return s;
  if (st->B == 0 || st->rows_q + st->rows_k == 0) {
    /* No rows: dsinks, a sum over none, is 0. */
    const smelt_tensor *ds = st->bwd ? a->t[SMELT__ATT_DSINKS] : NULL;
    CUresult r = ds ? smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)(uintptr_t)ds->data, 0, (size_t)st->H * 4,
                                                       ctx->cuda->stream)
                    : 0;
    return r ? smelt__cu_error(r, st->op, "clearing dsinks") : SMELT_OK;
  }
  attn_kernel t[MAX_KERNELS];
  const int nt = table(t);
  const attn_kernel *k = &t[plan->variant];

  smelt__attn_kparams kp;
  memset(&kp, 0, sizeof kp);
  ktensor(st, a->t[SMELT__ATT_Q], &kp.q);
  ktensor(st, a->t[SMELT__ATT_K], &kp.k);
  ktensor(st, a->t[SMELT__ATT_V], &kp.v);
  ktensor(st, a->t[SMELT__ATT_O], &kp.o);
  ktensor(st, a->t[SMELT__ATT_DO], &kp.d_o);
  ktensor(st, a->t[SMELT__ATT_DQ], &kp.dq);
  ktensor(st, a->t[SMELT__ATT_DK], &kp.dk);
  ktensor(st, a->t[SMELT__ATT_DV], &kp.dv);
  if (a->t[SMELT__ATT_LSE]) {
    smelt__attn_view v;
    smelt__attn_lse_view_of(st, a->t[SMELT__ATT_LSE], &v);
    kp.lse = (uint64_t)(uintptr_t)v.data;
    kp.lse_bs = v.bs;
    kp.lse_hs = v.hs;
    kp.lse_rs = v.rs;
  }
  if (st->varlen) {
    kp.cu_q = (uint64_t)(uintptr_t)a->t[SMELT__ATT_CU_Q]->data;
    kp.cu_k = (uint64_t)(uintptr_t)a->t[SMELT__ATT_CU_K]->data;
  }
  kp.rows_q = st->rows_q;
  kp.rows_k = st->rows_k;
  /* A window reaching past every key is no window (and keeps the kernels'
   * sums of row, offset and window inside 64 bits trivially). */
  kp.wl = st->wl < 0 || st->wl >= st->Sq + st->Sk ? -1 : st->wl;
  kp.wr = st->wr < 0 || st->wr >= st->Sq + st->Sk ? -1 : st->wr;
  kp.B = (int)st->B;
  kp.H = (int)st->H;
  kp.Hk = (int)st->Hk;
  kp.group = (int)(st->H / st->Hk);
  kp.seqlen_q = (int)st->Sq;
  kp.seqlen_k = (int)st->Sk;
  kp.D = (int)st->D;
  kp.scale = (float)st->scale;
  kp.scale_log2 = (float)(st->scale * 1.4426950408889634);
  if (a->t[SMELT__ATT_ALIBI]) kp.alibi = (uint64_t)(uintptr_t)a->t[SMELT__ATT_ALIBI]->data;
  if (a->t[SMELT__ATT_SINKS]) kp.sinks = (uint64_t)(uintptr_t)a->t[SMELT__ATT_SINKS]->data;
  if (a->t[SMELT__ATT_DSINKS]) kp.dsinks = (uint64_t)(uintptr_t)a->t[SMELT__ATT_DSINKS]->data;
  kp.softcap = (float)st->softcap;
  void *params[] = {&kp};

  if (!st->bwd) {
    const unsigned gx = (unsigned)smelt__ceil_div(st->Sq, k->bm);
    if (gx == 0) return SMELT_OK;
    if (k->fam == AK_FWD90) {
      smelt__cu_tensor_map tq, tk, tv;
      if ((s = tensor_map(st, a->t[SMELT__ATT_Q], k->bm, &tq)) || (s = tensor_map(st, a->t[SMELT__ATT_K], k->bn, &tk)) ||
          (s = tensor_map(st, a->t[SMELT__ATT_V], k->bn, &tv)))
        return s;
      void *p90[] = {&tq, &tk, &tv, &kp};
      if (k->persist != FWD90_TILES) {
        /* One CTA per SM (either shape takes over half an SM's shared
         * memory), or per tile when there are fewer; the kernel walks
         * m_tiles query tiles per (sequence, head). */
        kp.m_tiles = (int)gx;
        const int64_t tiles = (int64_t)gx * st->H * st->B, sms = ctx->cuda->info.sm_count;
        const unsigned grid = (unsigned)(tiles < sms ? tiles : sms);
        if (k->persist == FWD90_STATIC)
          return smelt__cuda_launch(ctx, st->op, (CUfunction)plan->func[F_MAIN], grid, 1, 1, (unsigned)k->threads,
                                    (unsigned)k->smem, p90);
        /* Dynamic: the counter is this launch's own (a pool allocation in
         * stream order) and zeroed on the launch's stream, so launches on
         * other streams and graph replays (which replay the memset) each
         * count from 0. */
        void *next = NULL;
        if ((s = smelt__cuda_alloc(ctx, 4, &next))) return s;
        kp.sem = (uint64_t)(uintptr_t)next;
        CUresult r = smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)kp.sem, 0, 4, ctx->cuda->stream);
        if (r) s = smelt__cu_error(r, st->op, "clearing the dynamic forward's tile counter");
        if (!s)
          s = smelt__cuda_launch(ctx, st->op, (CUfunction)plan->func[F_MAIN], grid, 1, 1, (unsigned)k->threads,
                                 (unsigned)k->smem, p90);
        smelt_status s2 = smelt__cuda_free(ctx, next);
        return s ? s : s2;
      }
      return smelt__cuda_launch(ctx, st->op, (CUfunction)plan->func[F_MAIN], gx, (unsigned)st->H, (unsigned)st->B,
                                (unsigned)k->threads, (unsigned)k->smem, p90);
    }
    return smelt__cuda_launch(ctx, st->op, (CUfunction)plan->func[F_MAIN], gx, (unsigned)st->H, (unsigned)st->B,
                              (unsigned)k->threads, (unsigned)k->smem, params);
  }

  /* Backward: one workspace, 256-byte aligned parts. */
  const int det = st->desc.deterministic || ctx->deterministic;
  const int64_t m_tiles = smelt__ceil_div(st->Sq, BWD_BM);
  const size_t acc = ((size_t)st->rows_q * (size_t)st->H * (size_t)st->D * 4 + 255) / 256 * 256;
  const size_t vec = ((size_t)st->rows_q * (size_t)st->H * 4 + 255) / 256 * 256;
  const size_t sems = det ? (size_t)st->B * (size_t)st->H * (size_t)m_tiles * 4 : 0;
  void *ws = NULL;
  if ((s = smelt__cuda_alloc(ctx, acc + 2 * vec + sems, &ws))) return s;
  kp.dq_acc = (uint64_t)(uintptr_t)ws;
  kp.lse_ws = kp.dq_acc + acc;
  kp.dsum_ws = kp.lse_ws + vec;
  kp.sem = det ? kp.dsum_ws + vec : 0;
  kp.m_tiles = (int)m_tiles;
  kp.deterministic = det;
  if (sems) {
    CUresult r = smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)kp.sem, 0, sems, ctx->cuda->stream);
    if (r) s = smelt__cu_error(r, st->op, "clearing the deterministic mode's counters");
  }
  /* attn_bwd_pre and attn_bwd_dq: 16 (row, head) pairs per block of 8 warps. */
  const int64_t pairs = st->rows_q * st->H, cap = (int64_t)ctx->cuda->info.sm_count * 32;
  const unsigned aux_grid = (unsigned)(smelt__ceil_div(pairs, 16) < cap ? smelt__ceil_div(pairs, 16) : cap);
  if (!s) s = smelt__cuda_launch(ctx, st->op, (CUfunction)plan->func[F_PRE], aux_grid, 1, 1, 256, 0, params);
  /* dsinks: one block per head, from attn_bwd_pre's LSE and rowsums. */
  if (!s && kp.dsinks) s = smelt__cuda_launch(ctx, st->op, (CUfunction)plan->func[F_DSINK], (unsigned)st->H, 1, 1, 256, 0, params);
  if (!s && k->fam == AK_BWD90 && det) {
    /* The deterministic mode runs the mma.sync kernel the plan also loaded. */
    const attn_kernel *k80 = &t[find(t, nt, AK_BWD80, k->dt, k->d, 0, st->mods)];
    s = smelt__cuda_launch(ctx, st->op, (CUfunction)plan->func[F_DET], (unsigned)smelt__ceil_div(st->Sk, k80->bn),
                           (unsigned)st->Hk, (unsigned)st->B, (unsigned)k80->threads, (unsigned)k80->smem, params);
  } else if (!s && k->fam == AK_BWD90) {
    s = launch_bwd90(plan, a, k, &kp);
  } else if (!s) {
    s = smelt__cuda_launch(ctx, st->op, (CUfunction)plan->func[F_MAIN], (unsigned)smelt__ceil_div(st->Sk, k->bn),
                           (unsigned)st->Hk, (unsigned)st->B, (unsigned)k->threads, (unsigned)k->smem, params);
  }
  if (!s) s = smelt__cuda_launch(ctx, st->op, (CUfunction)plan->func[F_DQ], aux_grid, 1, 1, 256, 0, params);
  smelt_status s2 = smelt__cuda_free(ctx, ws);
  return s ? s : s2;
}

static smelt_status run_attention(smelt_plan *plan, const void *args) {
  const smelt__attn_state *st = (const smelt__attn_state *)plan->opdata;
  smelt__nvtx_push(st->op);
  smelt_status s = run(plan, (const smelt__attn_args *)args);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_attention = {.plan = plan_attention, .run = run_attention};
