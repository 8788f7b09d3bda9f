/* smelt_peer on CUDA: the plan picks and loads the kernels and plans the
 * query projection on the GEMM engine; runs take workspace from the
 * context's pool and launch, all stream-ordered (no host synchronization,
 * the store's batch policy included).
 *
 *   retrieve  GEMM q = x Wq + bq (f32) -> peer_route (ids, scores)
 *   forward   ... -> peer_route (+ gates) -> store batch -> expert forward
 *   backward  GEMM q -> peer_rescore (qn, scores, gates of the given ids)
 *             -> expert backward (per use a, dz, d gate; dx from experts)
 *             -> peer_route_bwd (d score, d q, norm-parameter terms)
 *             -> GEMM dx = dq Wqᵀ + dx_experts, GEMM dWq = xᵀ dq,
 *                column sums (dbq, norm params), sorted segment sums
 *                (du, dv: a warp per expert row, every row written;
 *                the sparse rows: the runs listed in expert order, a warp
 *                per distinct expert;
 *                d sub-keys: a CTA per key row).
 *
 * The expert kernels come in one module per weight dtype and load width:
 * 16-byte loads need d_in and d_out to be multiples of 16 bytes of weights
 * and 16-byte aligned tables; otherwise scalar loads (then h_e <= 32). A
 * run whose dense tables are less aligned than planned takes the scalar
 * variant, loaded on first use. With 16-byte loads the warp-streamed
 * kernels are taken where they fit (expert_load), else the round kernels. */
#include "peer_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_peer"

static const smelt_dtype weight_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* ---------------------------------------------------------------- sources */

void smelt__peer_route_src(smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "peer_route");
  src->body = "peer_route.cu";
}

void smelt__peer_util_src(smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "peer_util");
  src->body = "peer_util.cu";
}

void smelt__peer_expert_src(smelt_dtype wdt, int vec, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "peer_expert_%s_%s", smelt_dtype_name(wdt), vec > 1 ? "v16" : "scalar");
  src->body = "peer_expert.cu";
  smelt__prelude_define(src, "SMELT_WDT", wdt);
  smelt__prelude_define(src, "SMELT_VEC", vec);
}

static int vec_of(smelt_dtype wdt) { return (int)(16 / smelt_dtype_size(wdt)); }

int smelt__peer_variants(smelt__kernel_src *out, int max) {
  int n = 0;
  if (n < max) smelt__peer_route_src(&out[n]);
  n++;
  if (n < max) smelt__peer_util_src(&out[n]);
  n++;
  for (size_t d = 0; d < sizeof weight_dtypes / sizeof *weight_dtypes; d++)
    for (int v = 0; v < 2; v++, n++)
      if (n < max) smelt__peer_expert_src(weight_dtypes[d], v ? 1 : vec_of(weight_dtypes[d]), &out[n]);
  return n;
}

smelt_status smelt__peer_util_load(smelt_ctx *ctx, smelt__peer_util *u) {
  smelt__kernel_src src;
  smelt__peer_util_src(&src);
  const struct {
    CUfunction *f;
    const char *name;
  } fns[] = {{&u->scan, "peer_scan"},
             {&u->scan_sums, "peer_scan_sums"},
             {&u->scan_add, "peer_scan_add"},
             {&u->sort_hist, "peer_sort_hist"},
             {&u->sort_scatter, "peer_sort_scatter"},
             {&u->use_keys, "peer_use_keys"},
             {&u->seg_bounds, "peer_seg_bounds"},
             {&u->seg_heads, "peer_seg_heads"},
             {&u->seg_compact, "peer_seg_compact"},
             {&u->du, "peer_du"},
             {&u->dv, "peer_dv"},
             {&u->colsum_partial, "peer_colsum_partial"},
             {&u->colsum_final, "peer_colsum_final"},
             {&u->transpose16, "peer_transpose16"},
             {&u->store_count, "peer_store_count"},
             {&u->store_lookup, "peer_store_lookup"},
             {&u->store_misses, "peer_store_misses"},
             {&u->store_slot_count, "peer_store_slot_count"},
             {&u->store_slot_rank, "peer_store_slot_rank"},
             {&u->store_assign, "peer_store_assign"},
             {&u->store_finish, "peer_store_finish"}};
  for (size_t i = 0; i < sizeof fns / sizeof *fns; i++) {
    smelt_status s = smelt__cuda_function(ctx, &src, fns[i].name, fns[i].f);
    if (s) return s;
  }
  return SMELT_OK;
}

smelt_status smelt__peer_scan(smelt_ctx *ctx, const smelt__peer_util *u, void *data, int64_t count, void *total) {
  void *params[] = {&data, &count, &total};
  return smelt__cuda_launch(ctx, OP, u->scan, 1, 1, 1, 256, 0, params);
}

/* ---------------------------------------------------------------- plan state */

/* The expert kernels of kernels/peer_expert.cu, in order of preference. */
typedef enum expert_kind { EK_WARP, EK_ROWS } expert_kind;

/* An expert-kernel variant with its launch shape: stage_uses is the slots
 * per warp (EK_WARP); chunk the uses per round (EK_ROWS). fwd_bulk: the
 * forward runs peer_expert_fwd_bulk instead (Hopper, where EK_WARP fits),
 * persistent, with fwd_slots slots a warp; fwd8 (NULL when its slots do
 * not fit) is its 8-warp form for sharing the SMs with the routing
 * (launch_route), fwd8_slots a warp; sm_smem the SM's shared memory. */
typedef struct expert_variant {
  int vec;
  expert_kind kind;
  CUfunction fwd, bwd, fwd8;
  CUfunction fwd_tc, fwd8_tc; /* their tensor-core forms, or NULL (bulk_forward) */
  smelt_dtype wdt;            /* the weights' type */
  int64_t chunk, stage_uses;
  int gout, gin;
  unsigned fwd_smem, bwd_smem, fwd8_smem;
  int fwd_bulk, fwd_slots, fwd8_slots, sm_smem;
} expert_variant;

/* The routing kernel when SMELT_PEER_ROUTE_KERNEL is unset: wg, which is
 * reg (buf's two passes with the first one approximate and its query
 * fragments in registers; docs/PERF.md's version 6) with the scores on
 * wgmma where it can (cc 9.0, dsub 113-128, and at run time bf16 keys
 * without L2 normalization; else reg itself). buf was the fastest of
 * version 5 on an H100 at the acceptance shape (forward 1.621 ms against
 * presplit's 1.692 and thr's 1.681, c70e843). For k > 16 reg, buf and thr
 * take presplit's kernel; for dsub > 128 reg takes buf's. */
#define PEER_ROUTE_DEFAULT "wg"

typedef struct peer_cuda {
  CUfunction route, rescore, route_bwd, dkeys;
  CUfunction split_keys; /* peer_split_keys when route is a presplit variant, else NULL */
  int route_kmax;        /* route is peer_route_reg: split_keys also takes the tables' largest key norms */
  CUfunction route_beside; /* reg's persistent form beside the expert kernel (Hopper; else NULL) */
  /* wg (Hopper): peer_route_wg and its persistent form, taken for runs
   * whose keys are bf16 without L2 normalization (else route and
   * route_beside, reg's); NULL when not planned */
  CUfunction route_wg, route_wg_beside;
  /* peer_route_wg_split: route_wg_beside with a tile's two dims as two
   * units, for p = 2 without query normalization (Hopper; else NULL) */
  CUfunction route_wg_split;
  /* peer_route_wg_split_pj: the same with each unit's queries projected in
   * it (route_pj); NULL when not planned */
  CUfunction route_wg_split_pj, route_prep; /* and peer_route_prep (the key split and Wq's K-major copy) */
  smelt__peer_util util;
  expert_variant ev[2]; /* [0] as planned, [1] scalar fallback (vec 0 until loaded) */
  smelt_dtype wdt;
  unsigned route_smem, route_wg_smem, rbwd_smem;
  smelt_plan *gemm_q; /* q = x Wq + bq; NULL when T = 0 */
  int wq_t;           /* gemm_q multiplies by a K-major copy of Wq (plan_projection) */
  int pj;             /* route_pj's conditions known to the plan hold */
} peer_cuda;

static void peer_cuda_free(void *p) {
  peer_cuda *pc = (peer_cuda *)p;
  if (!pc) return;
  smelt_plan_destroy(pc->gemm_q);
  free(pc);
}

static int64_t r4(int64_t n) { return (n + 3) & ~(int64_t)3; }

/* Thread groups over the uses when the columns (in vec chunks) leave
 * threads idle: the largest power of two <= 8 that still gives every
 * thread a column. */
static int groups_for(int64_t chunks) {
  int g = 1;
  while (g < 8 && chunks * 2 * g <= 256) g *= 2;
  return g;
}

static unsigned fwd_smem(const smelt__peer_state *ps, int gout, int64_t chunk) {
  return (unsigned)(4 * (r4(ps->din) + gout * r4(ps->dout) + r4(chunk * ps->he) + r4(chunk)) + 16 * chunk);
}
static unsigned bwd_smem(const smelt__peer_state *ps, int gin, int64_t chunk) {
  return (unsigned)(4 * (r4(ps->din) + r4(ps->dout) + gin * r4(ps->din) + 2 * r4(chunk * ps->he) + r4(chunk)) +
                    16 * chunk);
}

/* The warp-streamed kernels: NWARPS rings of `slots` uses' rows, x (and
 * dy), gates and row pointers. */
#define PEER_WS_CH 4 /* kernels/peer_expert.cu's WS_CH */
static unsigned warp_fwd_smem(const smelt__peer_state *ps, int64_t slots, int64_t row_bytes) {
  const int64_t hk = ps->h * ps->k;
  return (unsigned)(8 * slots * row_bytes + 4 * (r4(ps->din) + r4(hk)) + 16 * hk);
}
static unsigned warp_bwd_smem(const smelt__peer_state *ps, int64_t slots, int64_t row_bytes) {
  const int64_t hk = ps->h * ps->k;
  return (unsigned)(8 * slots * row_bytes + 4 * (r4(ps->din) + r4(ps->dout) + r4(hk)) + 16 * hk);
}
/* peer_expert_fwd_bulk: CTAs of `warps` warps (16, or 8 for
 * peer_expert_fwd_bulk8), each with a ring of `slots` uses' rows and a
 * window of 64 codes and gates (BK_WIN). */
#define PEER_BK_WARPS 16
#define PEER_BK8_WARPS 8
#define PEER_BK_SLOTS_MAX 8
static unsigned bulk_fwd_smem(int warps, int64_t slots, int64_t row_bytes) {
  return (unsigned)(warps * (slots * row_bytes + 64 * 8));
}

/* The least shared memory over half an SM's of sm_smem bytes (a CTA
 * reserves 1 KiB more): a CTA that takes it has the SM's to itself. */
static int64_t over_half(int sm_smem) { return sm_smem / 2 - 1024 + 128; }

/* Switches a warp-streamed variant's forward to peer_expert_fwd_bulk on
 * Hopper: one CTA an SM with as many slots a warp (<= 8) as its shared
 * memory holds, at least 2; and loads peer_expert_fwd_bulk8 with as many
 * slots (>= 2) as leave room on the SM for a routing CTA of over half its
 * shared memory (over_half; 512 bytes of the kernel's barriers and 1 KiB a
 * CTA reserved). SMELT_PEER_EXPERT_KERNEL=warp (kind_env)
 * keeps the warp kernel's forward (for comparing the two on a device). */
static smelt_status bulk_forward(smelt_ctx *ctx, const smelt__peer_state *ps, const smelt__kernel_src *src,
                                 const char *kind_env, int64_t row_bytes, expert_variant *ev) {
  ev->fwd_tc = ev->fwd8_tc = NULL;
  const smelt_device_info *dev = &ctx->cuda->info;
  if (dev->cc_major != 9 || (kind_env && strcmp(kind_env, "warp") == 0) || row_bytes > INT32_MAX ||
      ps->N > INT32_MAX) /* the kernel's row codes are 32-bit */
    return SMELT_OK;
  int64_t slots = PEER_BK_SLOTS_MAX;
  while (slots >= 2 && bulk_fwd_smem(PEER_BK_WARPS, slots, row_bytes) + 1024 > (unsigned)dev->smem_per_block_optin)
    slots--;
  if (slots < 2) return SMELT_OK;
  smelt_status s = smelt__cuda_function(ctx, src, "peer_expert_fwd_bulk", &ev->fwd);
  if (s) return s;
  /* the literal shape with 16-bit weights: the tensor-core forms too
   * (kernels/peer_expert.cu's bk_tensor; expert_fn picks them per call) */
  const int lit_tc = ev->wdt != SMELT_DTYPE_F32 && ev->vec == 8 && ps->he == 1 && ps->din == 32 * PEER_WS_CH * 8 &&
                     ps->dout == 32 * PEER_WS_CH * 8 && ps->h * ps->k % 2 == 0;
  if (lit_tc && (s = smelt__cuda_function(ctx, src, "peer_expert_fwd_bulk_tc", &ev->fwd_tc))) return s;
  ev->fwd_bulk = 1;
  ev->fwd_slots = (int)slots;
  ev->fwd_smem = bulk_fwd_smem(PEER_BK_WARPS, slots, row_bytes);
  const smelt__cu_api *cu = smelt__cu(NULL);
  SMELT__CU_CHECK(cu->cuDeviceGetAttribute(&ev->sm_smem, SMELT__CU_DEV_ATTR_SMEM_PER_SM, ctx->cuda->dev), OP);
  const int64_t room = ev->sm_smem - over_half(ev->sm_smem) - 1024 - 512 - 1024;
  ev->fwd8 = NULL;
  for (slots = PEER_BK_SLOTS_MAX; slots >= 2; slots--)
    if ((int64_t)bulk_fwd_smem(PEER_BK8_WARPS, slots, row_bytes) <= room) break;
  if (slots < 2) return SMELT_OK;
  ev->fwd8_slots = (int)slots;
  ev->fwd8_smem = bulk_fwd_smem(PEER_BK8_WARPS, slots, row_bytes);
  if ((s = smelt__cuda_function(ctx, src, "peer_expert_fwd_bulk8", &ev->fwd8))) return s;
  return lit_tc ? smelt__cuda_function(ctx, src, "peer_expert_fwd_bulk8_tc", &ev->fwd8_tc) : SMELT_OK;
}

/* The forward's bulk kernel for this call: fwd (or fwd8 beside the
 * routing), or its tensor-core form where x allows it: x of the weights'
 * type, rows 4-byte aligned (kernels/peer_expert.cu's bk_tensor). */
static CUfunction expert_fn(const expert_variant *ev, const smelt__peer_expert_params *E, int beside) {
  const int tc = (beside ? ev->fwd8_tc : ev->fwd_tc) && E->x_dt == (int)ev->wdt && (E->x & 3) == 0 && E->x_rs % 2 == 0;
  if (beside) return tc ? ev->fwd8_tc : ev->fwd8;
  return tc ? ev->fwd_tc : ev->fwd;
}

/* Chooses the launch shape of a variant and loads it. */
static smelt_status expert_load(smelt_ctx *ctx, const smelt__peer_state *ps, smelt_dtype wdt, int vec,
                                expert_variant *ev) {
  const int smem_max = ctx->cuda->info.smem_per_block_optin;
  const int64_t hk = ps->h * ps->k;
  ev->vec = vec;
  ev->wdt = wdt;
  ev->gout = groups_for(ps->dout / vec);
  ev->gin = groups_for(ps->din / vec);
  /* Shared memory under 96 KiB keeps two CTAs per SM on Hopper and Ampere. */
  const unsigned budget = smem_max < 96 * 1024 ? (unsigned)smem_max : 96 * 1024;
  smelt__kernel_src src;
  smelt__peer_expert_src(wdt, vec, &src);
  smelt_status s;
  /* SMELT_PEER_EXPERT_KERNEL=rows takes the round kernels even where the
   * warp-streamed ones fit (for comparing the two on a device). */
  const char *kind_env = smelt__getenv("SMELT_PEER_EXPERT_KERNEL");
  const expert_kind first = kind_env && strcmp(kind_env, "rows") == 0 ? EK_ROWS : EK_WARP;
  const int64_t row_bytes = (ps->din + ps->dout) * ps->he * (int64_t)smelt_dtype_size(wdt);
  ev->stage_uses = 0;
  ev->fwd_bulk = 0;
  /* Warp-streamed when h_e <= the load width, the rows a lane keeps (y and
   * dx) fit its WS_CH chunks, and three (else two) slots a warp fit half
   * the SM's shared memory (two CTAs per SM). */
  const unsigned half = (unsigned)(smem_max / 2 - 1024);
  if (first == EK_WARP && vec > 1 && ps->he <= vec && ps->din * ps->he <= 32 * PEER_WS_CH * vec &&
      ps->dout <= 32 * PEER_WS_CH * vec && hk > 0) {
    for (int64_t slots = 3; slots >= 2; slots--) {
      if (warp_fwd_smem(ps, slots, row_bytes) > half || warp_bwd_smem(ps, slots, row_bytes) > half) continue;
      ev->kind = EK_WARP;
      ev->stage_uses = slots;
      ev->chunk = hk;
      ev->fwd_smem = warp_fwd_smem(ps, slots, row_bytes);
      ev->bwd_smem = warp_bwd_smem(ps, slots, row_bytes);
      if ((s = smelt__cuda_function(ctx, &src, "peer_expert_fwd_warp", &ev->fwd)) ||
          (s = smelt__cuda_function(ctx, &src, "peer_expert_bwd_warp", &ev->bwd)))
        return s;
      return bulk_forward(ctx, ps, &src, kind_env, row_bytes, ev);
    }
  }
  /* Up to 256 uses staged at a time, fewer while that keeps shared memory
   * under the budget. */
  ev->kind = EK_ROWS;
  int64_t chunk = hk < 256 ? hk : 256;
  while (chunk > 1 && (fwd_smem(ps, ev->gout, chunk) > budget || bwd_smem(ps, ev->gin, chunk) > budget)) chunk /= 2;
  ev->chunk = chunk;
  ev->fwd_smem = fwd_smem(ps, ev->gout, chunk);
  ev->bwd_smem = bwd_smem(ps, ev->gin, chunk);
  const unsigned need = ev->fwd_smem > ev->bwd_smem ? ev->fwd_smem : ev->bwd_smem;
  if (need > (unsigned)smem_max)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": input_dim=%lld and output_dim=%lld need %u bytes of shared memory per CTA on CUDA; the "
                           "device allows %d",
                        (long long)ps->din, (long long)ps->dout, need, smem_max);
  if ((s = smelt__cuda_function(ctx, &src, "peer_expert_fwd", &ev->fwd)) ||
      (s = smelt__cuda_function(ctx, &src, "peer_expert_bwd", &ev->bwd)))
    return s;
  return SMELT_OK;
}

/* peer_route_beside, and the shared-memory carveout of it and of
 * peer_expert_fwd_bulk8 at its largest: an SM's L1/shared split is set for
 * the CTAs it runs, and one a routing CTA alone would get (the least that
 * holds it) leaves no room for an expert CTA beside it. */
static smelt_status load_beside(smelt_ctx *ctx, const smelt__kernel_src *src, peer_cuda *pc) {
  smelt_status s = smelt__cuda_function(ctx, src, "peer_route_beside", &pc->route_beside);
  if (!s && pc->route_wg) s = smelt__cuda_function(ctx, src, "peer_route_wg_beside", &pc->route_wg_beside);
  if (!s && pc->route_wg) s = smelt__cuda_function(ctx, src, "peer_route_wg_split", &pc->route_wg_split);
  if (!s && pc->route_wg) s = smelt__cuda_function(ctx, src, "peer_route_wg_split_pj", &pc->route_wg_split_pj);
  if (!s && pc->route_wg) s = smelt__cuda_function(ctx, src, "peer_route_prep", &pc->route_prep);
  if (s) return s;
  const smelt__cu_api *cu = smelt__cu(NULL);
  SMELT__CU_CHECK(cu->cuFuncSetAttribute(pc->route_beside, SMELT__CU_FUNC_ATTR_CARVEOUT, 100), OP);
  if (pc->route_wg) {
    SMELT__CU_CHECK(cu->cuFuncSetAttribute(pc->route_wg_beside, SMELT__CU_FUNC_ATTR_CARVEOUT, 100), OP);
    SMELT__CU_CHECK(cu->cuFuncSetAttribute(pc->route_wg_split, SMELT__CU_FUNC_ATTR_CARVEOUT, 100), OP);
    SMELT__CU_CHECK(cu->cuFuncSetAttribute(pc->route_wg_split_pj, SMELT__CU_FUNC_ATTR_CARVEOUT, 100), OP);
  }
  SMELT__CU_CHECK(cu->cuFuncSetAttribute(pc->ev[0].fwd8, SMELT__CU_FUNC_ATTR_CARVEOUT, 100), OP);
  if (pc->ev[0].fwd8_tc)
    SMELT__CU_CHECK(cu->cuFuncSetAttribute(pc->ev[0].fwd8_tc, SMELT__CU_FUNC_ATTR_CARVEOUT, 100), OP);
  return SMELT_OK;
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* Workspace tensors: an f32 or i64 matrix at p. */
static smelt_tensor dev_tensor(const smelt_ctx *ctx, void *p, smelt_dtype dt, int64_t rows, int64_t cols) {
  int64_t shape[2] = {rows, cols};
  return smelt_tensor_make(p, dt, SMELT_DEVICE_CUDA, ctx->device_index, 2, shape);
}

static int hopper_gemm(const smelt_plan *p) { return strncmp(p->describe, "gemm_sm90", 9) == 0; }

/* The projection's GEMM plan, made against workspaces like the runs'. The
 * Hopper GEMM kernel (TMA + wgmma) takes B K-major only, and Wq [d_in, h*dq]
 * is usually row-major (N-major): planned as given, the projection ran on
 * mma.sync (119 us at the acceptance shape on an H100, docs/PERF.md). When
 * the plan as given is not the Hopper kernel but one with a K-major copy of
 * a 16-bit Wq is, each run first transposes Wq into the workspace
 * (peer_transpose16: 4 MiB at the acceptance shape) and multiplies by the
 * copy (wq_t). The same GEMM on the same values either way; only the
 * kernel (and so the order of its f32 sums) differs. */
static smelt_status plan_projection(smelt_ctx *ctx, const smelt__peer_state *ps, peer_cuda *pc) {
  const smelt_device_info *dev = &ctx->cuda->info;
  const smelt_tensor *x = &ps->t[SMELT__PT_X], *wq = &ps->t[SMELT__PT_WQ];
  const smelt_tensor *bq = ps->t[SMELT__PT_BQ].ndim >= 0 ? &ps->t[SMELT__PT_BQ] : NULL;
  const int64_t hd = ps->h * ps->dq;
  void *q, *wt;
  smelt_status s = smelt__cuda_alloc(ctx, (size_t)(ps->T * hd) * 4, &q);
  if (s) return s;
  smelt_tensor qt = dev_tensor(ctx, q, SMELT_DTYPE_F32, ps->T, hd);
  s = smelt_gemm_plan(ctx, NULL, x, wq, NULL, &qt, bq, &pc->gemm_q);
  const int try_t = !s && !hopper_gemm(pc->gemm_q) && dev->cc_major == 9 && dev->cc_minor == 0 &&
                    (wq->dtype == SMELT_DTYPE_BF16 || wq->dtype == SMELT_DTYPE_F16) && x->dtype == wq->dtype &&
                    (ps->din + 63) / 64 <= 65535;
  if (try_t && !(s = smelt__cuda_alloc(ctx, (size_t)(ps->din * hd) * 2, &wt))) {
    smelt_tensor wtt = dev_tensor(ctx, wt, wq->dtype, ps->din, hd);
    wtt.strides[0] = 1;
    wtt.strides[1] = ps->din;
    /* From 2048 tokens the 128 x 128 tiles (ping-pong warpgroups): twice
     * the 128 x 256 tiles the GEMM's heuristic takes, so fewer SMs idle in
     * the last wave; 33.0 against 37.3 us at the acceptance shape (H200,
     * the GEMM's autotuner, docs/PERF.md PEER version 16). Else, or where
     * no such kernel plans, the heuristic's. */
    smelt_gemm_desc d = smelt_gemm_desc_default();
    d.tile.m = d.tile.n = 128;
    d.tile.k = 64;
    smelt_plan *tp = NULL;
    if (ps->T >= 2048 && (smelt_gemm_plan(ctx, &d, x, &wtt, NULL, &qt, bq, &tp) != SMELT_OK || !hopper_gemm(tp))) {
      smelt_plan_destroy(tp);
      tp = NULL;
      smelt_clear_error();
    }
    if (tp || (smelt_gemm_plan(ctx, NULL, x, &wtt, NULL, &qt, bq, &tp) == SMELT_OK && hopper_gemm(tp))) {
      smelt_plan_destroy(pc->gemm_q);
      pc->gemm_q = tp;
      pc->wq_t = 1;
    } else {
      smelt_plan_destroy(tp);
    }
    s = smelt__cuda_free(ctx, wt);
  }
  smelt_status s2 = smelt__cuda_free(ctx, q);
  return s ? s : s2;
}

smelt_status smelt__cuda_peer_plan(smelt_plan *plan) {
  smelt__peer_state *ps = (smelt__peer_state *)plan->opdata;
  smelt_ctx *ctx = plan->ctx;
  const smelt_device_info *dev = &ctx->cuda->info;
  static const char *const names[SMELT__PT_COUNT] = {"x", "wq", "bq", "norm_weight", "norm_bias", "bn_mean",
                                                     "bn_var", "sub_keys[0]", "sub_keys[1]", "sub_keys[2]",
                                                     "sub_keys[3]", "u", "v"};
  for (int i = 0; i < SMELT__PT_COUNT; i++)
    if (ps->t[i].ndim >= 0 && ps->t[i].dtype == SMELT_DTYPE_F64)
      return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": %s.dtype=f64 is CPU-only (CUDA: f32, f16, bf16)", names[i]);
  if (ps->k > 32)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": num_experts_per_tok=%lld must be <= 32 on CUDA", (long long)ps->k);
  if (ps->dsub > 256)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": query_dim / product_key_dims = %lld must be <= 256 on CUDA", (long long)ps->dsub);
  if (ps->h > 65535)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": num_heads=%lld must be <= 65535 on CUDA", (long long)ps->h);
  if (ps->he & (ps->he - 1))
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": expert_hidden_size=%lld must be a power of two on CUDA",
                        (long long)ps->he);
  const smelt_tensor *u = &ps->t[SMELT__PT_U], *v = &ps->t[SMELT__PT_V];
  const smelt_dtype wdt = ps->store ? ps->store->dtype : u->dtype;
  const int V = vec_of(wdt);
  const int wide = ps->din % V == 0 && ps->dout % V == 0 && ps->he <= 32 * V &&
                   (ps->store || (aligned16(u->data) && aligned16(v->data)));
  if (!wide && ps->he > 32)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": expert_hidden_size=%lld > 32 needs 16-byte expert rows on CUDA: input_dim=%lld and "
                           "output_dim=%lld multiples of %d and 16-byte aligned u, v (and h_e <= %d)",
                        (long long)ps->he, (long long)ps->din, (long long)ps->dout, V, 32 * V);
  peer_cuda *pc = (peer_cuda *)calloc(1, sizeof *pc);
  if (!pc) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  ps->cuda = pc;
  ps->cuda_free = peer_cuda_free;
  pc->wdt = wdt;
  /* As peer_route.cu lays it out: the score tile and the running lists in
   * f32/u32, then hi and lo bf16 parts of the query slice and the key tile,
   * 64 rows of DS = round16(dsub) + 8 each. */
  const int64_t route_ds = ((ps->dsub + 15) & ~(int64_t)15) + 8;
  pc->route_smem = (unsigned)(4 * (64 * 65 + 64 * 32 * 2) + 2 * 4 * 64 * route_ds);
  /* wg: the score tile, lists of 16, then (1024-byte aligned) the lo query
   * slice and two stages of 128 key rows, 256 bytes each */
  pc->route_wg_smem = 4 * (64 * 65 + 64 * 16 * 2) + 1024 + 64 * 256 + 2 * 128 * 256;
  pc->rbwd_smem = (unsigned)(4 * 8 * ps->dq + 8 * 32 * 4 * 8 + 8 * 32 * 4 * 4);
  const unsigned rneed = pc->route_smem > pc->rbwd_smem ? pc->route_smem : pc->rbwd_smem;
  if (rneed > (unsigned)dev->smem_per_block_optin)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": query_dim=%lld (%lld per product-key dim) needs %u bytes of shared memory per CTA; the "
                           "device allows %d",
                        (long long)ps->dq, (long long)ps->dsub, rneed, dev->smem_per_block_optin);
  /* SMELT_PEER_ROUTE_KERNEL=sort takes the routing kernel that splits the
   * key tiles itself and merges by sorting networks; thr (k <= 16) takes
   * peer_route_thr, which scores each dim's tiles twice, first for a
   * per-row threshold, then merging only the scores at or above it; buf (k
   * <= 16) takes peer_route_buf, a tighter threshold whose scores go to
   * per-row buffers, merged once per dim; reg (k <= 16, dsub <= 128) takes
   * peer_route_reg, buf with an approximate first pass from query
   * fragments in registers, one barrier a tile and a filtered combination
   * (for k > 16 these take presplit's kernel, reg with dsub > 128 buf's;
   * the plan's description says which). presplit splits the sub-keys once
   * per call (peer_split_keys), as thr, buf and reg do. Same results bit for
   * bit. wg is reg with the scores on wgmma (see PEER_ROUTE_DEFAULT): the
   * same thresholds and lists, the scores wgmma's sums (the same ids as
   * reg's but at near-ties). Unset: PEER_ROUTE_DEFAULT. */
  const char *route_env = smelt__getenv("SMELT_PEER_ROUTE_KERNEL");
  if (route_env && strcmp(route_env, "sort") != 0 && strcmp(route_env, "presplit") != 0 &&
      strcmp(route_env, "thr") != 0 && strcmp(route_env, "buf") != 0 && strcmp(route_env, "reg") != 0 &&
      strcmp(route_env, "wg") != 0)
    return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                        OP ": SMELT_PEER_ROUTE_KERNEL=\"%.32s\" is not a routing kernel (presplit, sort, thr, buf, reg or wg)",
                        route_env);
  const char *route = route_env ? route_env : PEER_ROUTE_DEFAULT;
  const int thr = strcmp(route, "thr") == 0 && ps->k <= 16;
  /* reg holds a query slice's fragments in registers: dsub <= 128 (else buf) */
  const int regwg = strcmp(route, "reg") == 0 || strcmp(route, "wg") == 0;
  const int reg = regwg && ps->k <= 16 && ps->dsub <= 128;
  const int buf = (strcmp(route, "buf") == 0 || regwg) && ps->k <= 16 && !reg;
  /* wg: wgmma (sm_90a) on a dsub padded to exactly 128 */
  const int wg = reg && strcmp(route, "wg") == 0 && dev->cc_major == 9 && dev->cc_minor == 0 && ps->dsub > 112;
  const int presplit = strcmp(route, "sort") != 0;
  pc->route_kmax = reg;
  smelt__kernel_src src;
  smelt__peer_route_src(&src);
  smelt_status s;
  /* lists of 16 entries per merge thread when k allows, else 32 */
  const char *route_fn = thr        ? "peer_route_thr"
                         : reg      ? "peer_route_reg"
                         : buf      ? "peer_route_buf"
                         : presplit ? (ps->k <= 16 ? "peer_route_pre" : "peer_route32_pre")
                                    : (ps->k <= 16 ? "peer_route" : "peer_route32");
  if ((s = smelt__cuda_function(ctx, &src, route_fn, &pc->route)) ||
      (wg && (s = smelt__cuda_function(ctx, &src, "peer_route_wg", &pc->route_wg))) ||
      (presplit && (s = smelt__cuda_function(ctx, &src, "peer_split_keys", &pc->split_keys))) ||
      (s = smelt__cuda_function(ctx, &src, "peer_rescore", &pc->rescore)) ||
      (s = smelt__cuda_function(ctx, &src, "peer_route_bwd", &pc->route_bwd)) ||
      (s = smelt__cuda_function(ctx, &src, "peer_dkeys", &pc->dkeys)) || (s = smelt__peer_util_load(ctx, &pc->util)) ||
      (s = expert_load(ctx, ps, wdt, wide ? V : 1, &pc->ev[0])))
    return s;
  if (reg && pc->ev[0].fwd8 && (s = load_beside(ctx, &src, pc))) return s;
  if (ps->T > 0 && (s = plan_projection(ctx, ps, pc))) return s;
  /* route_pj's conditions that the plan knows (x's layout is the call's) */
  const smelt_tensor *tx = &ps->t[SMELT__PT_X], *tq = &ps->t[SMELT__PT_WQ], *tk = &ps->t[SMELT__PT_KEY0];
  pc->pj = pc->route_wg_split_pj && pc->wq_t && tx->dtype == SMELT_DTYPE_BF16 && tq->dtype == SMELT_DTYPE_BF16 &&
           ps->p == 2 && ps->cfg.query_norm == SMELT_PEER_NORM_NONE && !ps->cfg.key_l2_norm &&
           tk->dtype == SMELT_DTYPE_BF16 && ps->dsub == 128 && ps->din % 64 == 0;
  smelt__kernel_src es;
  smelt__peer_expert_src(wdt, pc->ev[0].vec, &es);
  char pipe[56];
  if (pc->ev[0].fwd_bulk && pc->ev[0].fwd8 && reg && !ps->store) /* unless SMELT_PEER_OVERLAP=0 */
    snprintf(pipe, sizeof pipe, " (bulk copies, %d slots a warp, beside the routing)", pc->ev[0].fwd8_slots);
  else if (pc->ev[0].fwd_bulk)
    snprintf(pipe, sizeof pipe, " (bulk copies, %d slots a warp)", pc->ev[0].fwd_slots);
  else if (pc->ev[0].kind == EK_WARP)
    snprintf(pipe, sizeof pipe, " (warp-streamed, %lld slots a warp)", (long long)pc->ev[0].stage_uses);
  else
    snprintf(pipe, sizeof pipe, " (rounds of %lld uses)", (long long)pc->ev[0].chunk);
  snprintf(plan->describe, sizeof plan->describe,
           "peer N=%lld (p=%d) h=%lld k=%lld dq=%lld h_e=%lld: %s + %s + %.24s", (long long)ps->N, ps->p,
           (long long)ps->h, (long long)ps->k, (long long)ps->dq, (long long)ps->he,
           pc->pj ? "x*Wq in the routing" : pc->wq_t ? "GEMM x*Wq (Wq K-major)" : "GEMM x*Wq",
           thr ? "split keys + peer_route_thr"
           : wg ? "split keys + peer_route_wg"
           : reg ? "split keys + peer_route_reg"
           : buf ? "split keys + peer_route_buf"
           : presplit ? "split keys + peer_route_pre"
                      : "peer_route (sort)",
           es.name);
  const size_t used = strlen(plan->describe); /* the pipeline last: truncated first when too long */
  snprintf(plan->describe + used, sizeof plan->describe - used, "%s", pipe);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- run helpers */

/* One pool allocation carved into n regions of 256-byte aligned sizes. */
static smelt_status ws_alloc(smelt_ctx *ctx, const size_t *bytes, int n, void **base, void **regions) {
  size_t total = 0, off[32];
  for (int i = 0; i < n; i++) {
    off[i] = total;
    total += (bytes[i] + 255) & ~(size_t)255;
  }
  smelt_status s = smelt__cuda_alloc(ctx, total, base);
  if (s) return s;
  for (int i = 0; i < n; i++) regions[i] = bytes[i] ? (char *)*base + off[i] : NULL;
  return SMELT_OK;
}

static void route_params(const smelt__peer_state *ps, const smelt_peer_weights *w, smelt__peer_route_params *P) {
  memset(P, 0, sizeof *P);
  for (int i = 0; i < ps->p; i++) {
    P->keys[i] = (uint64_t)(uintptr_t)w->sub_keys[i]->data;
    P->n[i] = ps->n[i];
    P->key_hs[i] = ps->cfg.per_head_keys ? ps->n[i] * ps->dsub : 0;
  }
  const smelt_tensor *np[4] = {w->norm_weight, w->norm_bias, w->bn_mean, w->bn_var};
  uint64_t *dst[4] = {&P->norm_w, &P->norm_b, &P->bn_mean, &P->bn_var};
  P->param_dt = SMELT_DTYPE_F32;
  for (int i = 0; i < 4; i++)
    if (np[i]) {
      *dst[i] = (uint64_t)(uintptr_t)np[i]->data;
      P->param_dt = np[i]->dtype;
    }
  P->T = ps->T;
  P->h = ps->h;
  P->dq = ps->dq;
  P->dsub = ps->dsub;
  P->k = ps->k;
  P->N = ps->N;
  P->param_hs = ps->norm_per_head ? ps->dq : 0;
  P->norm_eps = (float)ps->cfg.norm_eps;
  P->l2_eps = (float)ps->cfg.l2_eps;
  P->p = ps->p;
  P->norm = (int)ps->cfg.query_norm;
  P->key_l2 = ps->cfg.key_l2_norm != 0;
  P->gate = (int)ps->cfg.gate;
  P->key_dt = w->sub_keys[0]->dtype;
  P->ready_groups = 1;
  P->ready_round = 1;
}

/* Run-time tensors the plan did not see (outputs, dy) in f64: CPU-only. */
static smelt_status no_f64(const smelt_tensor *const *t, const char *const *names, int n) {
  for (int i = 0; i < n; i++)
    if (t[i] && t[i]->dtype == SMELT_DTYPE_F64)
      return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": %s.dtype=f64 is CPU-only (CUDA: f32, f16, bf16)", names[i]);
  return SMELT_OK;
}

/* The variant a run's tables can use: the planned one, or the scalar
 * fallback when dense tables are less aligned than planned. */
static smelt_status variant_for(smelt_plan *plan, const smelt_peer_weights *w, const expert_variant **out) {
  smelt__peer_state *ps = (smelt__peer_state *)plan->opdata;
  peer_cuda *pc = (peer_cuda *)ps->cuda;
  if (pc->ev[0].vec == 1 || ps->store || (aligned16(w->u->data) && aligned16(w->v->data))) {
    *out = &pc->ev[0];
    return SMELT_OK;
  }
  if (ps->he > 32)
    return smelt__error(SMELT_STATUS_MISALIGNED,
                        OP ": u.data=%p and v.data=%p must be 16-byte aligned as planned (expert_hidden_size=%lld > 32 "
                           "has no scalar kernel)",
                        w->u->data, w->v->data, (long long)ps->he);
  if (!pc->ev[1].vec) {
    smelt_status s = expert_load(plan->ctx, ps, pc->wdt, 1, &pc->ev[1]);
    if (s) {
      pc->ev[1].vec = 0;
      return s;
    }
  }
  *out = &pc->ev[1];
  return SMELT_OK;
}

static int log2i(int64_t v) {
  int s = 0;
  while (((int64_t)1 << s) < v) s++;
  return s;
}

static void expert_params(const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x,
                          const expert_variant *ev, smelt__peer_expert_params *P) {
  memset(P, 0, sizeof *P);
  P->x = (uint64_t)(uintptr_t)x->data;
  P->x_rs = x->strides[0];
  P->x_dt = x->dtype;
  P->T = ps->T;
  P->hk = ps->h * ps->k;
  P->din = ps->din;
  P->dout = ps->dout;
  P->he = ps->he;
  P->N = ps->N;
  P->chunk = ev->chunk;
  P->act = (int)ps->cfg.activation;
  P->groups_out = ev->gout;
  P->groups_in = ev->gin;
  P->he_shift = log2i(ps->he);
  P->stage_uses = (int)ev->stage_uses;
  if (ps->store) {
    const int32_t *table;
    const void *uc, *vc, *uh, *vh;
    smelt__cuda_peer_store_views(ps->store, &table, &uc, &vc, &uh, &vh);
    P->table = (uint64_t)(uintptr_t)table;
    P->u_cache = (uint64_t)(uintptr_t)uc;
    P->v_cache = (uint64_t)(uintptr_t)vc;
    P->u_host = (uint64_t)(uintptr_t)uh;
    P->v_host = (uint64_t)(uintptr_t)vh;
  } else {
    P->u_host = (uint64_t)(uintptr_t)w->u->data;
    P->v_host = (uint64_t)(uintptr_t)w->v->data;
  }
}

/* q = x Wq + bq into the f32 workspace q [T, h*dq]; through a K-major copy
 * of Wq when planned so (wq_t). */
static smelt_status project(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x, void *q) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const peer_cuda *pc = (const peer_cuda *)ps->cuda;
  smelt_ctx *ctx = plan->ctx;
  const int64_t hd = ps->h * ps->dq;
  smelt_tensor qt = dev_tensor(ctx, q, SMELT_DTYPE_F32, ps->T, hd);
  if (!pc->wq_t) return smelt_gemm_run(pc->gemm_q, x, w->wq, NULL, &qt, w->bq);
  void *wt;
  smelt_status s = smelt__cuda_alloc(ctx, (size_t)(ps->din * hd) * 2, &wt);
  if (s) return s;
  void *in = w->wq->data;
  int64_t rows = ps->din, cols = hd, rs = w->wq->strides[0], cs = w->wq->strides[1];
  void *tp[] = {&in, &rows, &cols, &rs, &cs, &wt};
  s = smelt__cuda_launch(ctx, OP, pc->util.transpose16, (unsigned)((cols + 63) / 64), (unsigned)((rows + 63) / 64), 1,
                         256, 0, tp);
  if (!s) {
    smelt_tensor wtt = dev_tensor(ctx, wt, w->wq->dtype, rows, cols);
    wtt.strides[0] = 1;
    wtt.strides[1] = rows;
    s = smelt_gemm_run(pc->gemm_q, x, &wtt, NULL, &qt, w->bq);
  }
  smelt_status s2 = smelt__cuda_free(ctx, wt);
  return s ? s : s2;
}

/* Whether this call's routing projects its own queries
 * (peer_route_wg_split_pj: no projection GEMM, no q in HBM): bf16 x and
 * Wq with Wq's K-major copy planned, p = 2 without query normalization,
 * wg's keys (bf16, not L2-normalized), dq/p 128, d_in a multiple of 64
 * (pc->pj), and x's rows 16-byte vectors. SMELT_PEER_FUSED_PROJECTION=0
 * turns it off (the GEMM, for comparing the two on a device). */
static int route_pj(const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x) {
  const peer_cuda *pc = (const peer_cuda *)ps->cuda;
  const char *env = smelt__getenv("SMELT_PEER_FUSED_PROJECTION");
  if (env && strcmp(env, "0") == 0) return 0;
  return pc->pj && x->strides[1] == 1 && x->strides[0] % 8 == 0 && aligned16(x->data) &&
         (!w->bq || w->bq->strides[0] == 1);
}

/* The workspace's first region: q (f32 [T, h*dq]), or with route_pj the
 * room for Wq's K-major copy (peer_route_prep writes it). */
static size_t qws_bytes(const smelt__peer_state *ps, int pj) {
  return pj ? (size_t)(ps->din * ps->h * ps->dq) * 2 : (size_t)(ps->T * ps->h * ps->dq) * 4;
}

/* Fills P's projection fields for peer_route_wg_split_pj (wt: the room for Wq's K-major copy). */
static void pj_params(const smelt__peer_state *ps, const smelt_peer_weights *w, const smelt_tensor *x, void *wt,
                      smelt__peer_route_params *P) {
  P->q = 0;
  P->x = (uint64_t)(uintptr_t)x->data;
  P->x_rs = x->strides[0];
  P->wt = (uint64_t)(uintptr_t)wt;
  P->din = ps->din;
  P->bq = w->bq ? (uint64_t)(uintptr_t)w->bq->data : 0;
  P->bq_dt = w->bq ? w->bq->dtype : SMELT_DTYPE_F32;
}

/* The forward's expert kernel beside the routing (launch_route). */
typedef struct route_beside {
  smelt__peer_expert_params *E;
  CUfunction fwd;
  unsigned ctas, smem, route_ctas, route_smem;
} route_beside;

/* Beside the routing (the default; SMELT_PEER_OVERLAP=0 turns it off),
 * peer_expert_fwd_bulk8 shares every SM with a routing CTA: the routing is
 * compute-bound (tensor cores, shared memory), the expert rows
 * memory-bound. peer_route_reg runs persistent, one CTA an SM (its shared
 * memory over half the SM's), raising a counter per block of 64 tokens
 * (and head group: head_groups) as each head of it is done; the expert
 * kernel is its programmatic dependent, one CTA of 8 warps an SM in the
 * room left, and its warps wait on those counters for their uses. The
 * dependent's CTAs are placed only once every routing CTA has started
 * (kernels/peer_route.cu), so no wait can hold back a routing CTA that
 * never got an SM: where CUDA runs the
 * two one after the other (CUDA_LAUNCH_BLOCKING=1, tools that serialize
 * kernels, an MPS SM limit) the forward is as correct, only slower. Only
 * for the bulk kernel and routing `reg` without a store (the store's batch
 * needs every id first). Returns 0 (sequential) or fills *bs. */
static int plan_beside(const smelt_ctx *ctx, const smelt__peer_state *ps, const peer_cuda *pc,
                       const expert_variant *ev, smelt__peer_expert_params *E, route_beside *bs) {
  const char *on = smelt__getenv("SMELT_PEER_OVERLAP");
  if (!ev->fwd_bulk || !ev->fwd8 || !pc->route_beside || ps->store || (on && strcmp(on, "0") == 0)) return 0;
  const int64_t rs = pc->route_smem > over_half(ev->sm_smem) ? pc->route_smem : over_half(ev->sm_smem);
  if (rs > ctx->cuda->info.smem_per_block_optin || rs + 1024 + ev->fwd8_smem + 512 + 1024 > ev->sm_smem) return 0;
  const int64_t sms = ctx->cuda->info.sm_count, tiles = (ps->T + 63) / 64 * ps->h;
  const int64_t need = (ps->T + PEER_BK8_WARPS - 1) / PEER_BK8_WARPS; /* a warp a token */
  bs->E = E;
  bs->fwd = expert_fn(ev, E, 1);
  bs->ctas = (unsigned)(need < sms ? need : sms);
  bs->smem = ev->fwd8_smem;
  bs->route_ctas = (unsigned)(tiles < sms ? tiles : sms);
  bs->route_smem = (unsigned)rs;
  E->stage_uses = ev->fwd8_slots;
  return 1;
}

/* Beside the experts, a token's heads routed in two groups when h is even
 * (kernels/peer_route.cu's route_tile): an expert warp starts on a token
 * once its first half of heads is routed. SMELT_PEER_HEAD_GROUPS=1 keeps
 * one group, the tiles in block order (for comparing the two on a
 * device); the results are the same either way. */
static int head_groups(const smelt__peer_state *ps) {
  const char *env = smelt__getenv("SMELT_PEER_HEAD_GROUPS");
  return ps->h % 2 == 0 && !(env && strcmp(env, "1") == 0) ? 2 : 1;
}

/* wq: with P->wt (route_pj), Wq, copied K-major into P->wt beside the key
 * split (peer_route_prep). */
static smelt_status launch_route(smelt_plan *plan, smelt__peer_route_params *P, const route_beside *bs,
                                 const smelt_tensor *wq) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const peer_cuda *pc = (const peer_cuda *)ps->cuda;
  const int64_t gx = (ps->T + 63) / 64;
  /* wg's kernels where this run's keys allow (bf16, not L2-normalized: no lo part) */
  const int wg = pc->route_wg && !P->key_l2 && P->key_dt == SMELT_DTYPE_BF16;
  if (!pc->split_keys) {
    void *params[] = {P};
    return smelt__cuda_launch(plan->ctx, OP, pc->route, (unsigned)gx, (unsigned)ps->h, 1, 256, pc->route_smem, params);
  }
  /* the split sub-keys, hi and lo parts [rows][dpad] bf16, and for
   * peer_route_reg each table's largest hi and lo row norms (f32 [tables][2],
   * zeroed for split_keys's atomic maxima), live for this call */
  int64_t rows = 0, tables = 0;
  for (int i = 0; i < ps->p; i++) {
    rows += (ps->cfg.per_head_keys ? ps->h : 1) * ps->n[i];
    tables += ps->cfg.per_head_keys ? ps->h : 1;
  }
  const int64_t dpad = (ps->dsub + 15) & ~(int64_t)15;
  /* beside, wg with p = 2 and no query normalization, and with P->wt
   * beside or not: a tile's dims as two units (peer_route_wg_split, _pj),
   * a counter per tile and the next unit's after the blocks', and the
   * units' lists (64 rows x 16 packed entries) */
  const int split = P->wt || (bs && wg && pc->route_wg_split && ps->p == 2 && P->norm == SMELT_PEER_NORM_NONE);
  const int64_t tiles = gx * ps->h;
  if (bs) { /* the tiles' order and the expert warps' counters (route_tile) */
    P->ready_groups = head_groups(ps);
    P->ready_round = (int)((bs->ctas * PEER_BK8_WARPS + 63) / 64);
  }
  const size_t bytes[5] = {(size_t)(rows * dpad) * 2, (size_t)(rows * dpad) * 2,
                           pc->route_kmax ? (size_t)tables * 8 : 0,
                           bs || split ? (size_t)(gx * P->ready_groups + (split ? tiles + 1 : 0)) * 4 : 0,
                           split ? (size_t)tiles * 2 * 64 * 16 * 8 : 0};
  void *base, *r[5];
  smelt_status s = ws_alloc(plan->ctx, bytes, 5, &base, r);
  if (s) return s;
  const smelt__cu_api *cu = smelt__cu(NULL);
  CUstream st = plan->ctx->cuda->stream;
  uint64_t khi = (uint64_t)(uintptr_t)r[0], klo = (uint64_t)(uintptr_t)r[1], kmax = (uint64_t)(uintptr_t)r[2];
  uint64_t ready = bs || split ? (uint64_t)(uintptr_t)r[3] : 0;
  /* kmax and the counters, adjacent in the workspace (either may be
   * absent: NULL): one memset */
  char *z0 = r[2] ? (char *)r[2] : (char *)r[3];
  const size_t zero = r[3] ? (size_t)((char *)r[3] - z0) + bytes[3] : bytes[2];
  if (z0) {
    CUresult e = cu->cuMemsetD8Async((CUdeviceptr)(uintptr_t)z0, 0, zero, st);
    if (e != 0) s = smelt__cu_error(e, OP, "cuMemsetD8Async");
  }
  uint64_t wqp = wq ? (uint64_t)(uintptr_t)wq->data : 0;
  int64_t wrs = wq ? wq->strides[0] : 0, wcs = wq ? wq->strides[1] : 0;
  void *sp[] = {P, &khi, &klo, &rows, &kmax, &wqp, &wrs, &wcs};
  const int64_t tiles16 = P->wt ? (ps->h * ps->dq + 63) / 64 * ((ps->din + 63) / 64) : 0; /* the copy's */
  if (!s)
    s = smelt__cuda_launch(plan->ctx, OP, P->wt ? pc->route_prep : pc->split_keys,
                           (unsigned)(tiles16 + (rows + 7) / 8), 1, 1, 256, 0, sp);
  /* kmax is read by peer_route_reg and the persistent forms only, ready
   * by the latter, xl by peer_route_wg_split (the driver takes as many
   * parameters as the kernel declares) */
  uint64_t xl = (uint64_t)(uintptr_t)r[4];
  void *rp[] = {P, &khi, &klo, &kmax, &ready, &xl};
  const int64_t sms = plan->ctx->cuda->info.sm_count;
  /* split without the experts beside (P->wt only): two CTAs an SM */
  const int64_t sctas = bs ? sms : 2 * sms;
  if (!s && split)
    s = smelt__cuda_launch(plan->ctx, OP, P->wt ? pc->route_wg_split_pj : pc->route_wg_split,
                           (unsigned)(2 * tiles < sctas ? 2 * tiles : sctas), 1, 1, 256,
                           bs ? bs->route_smem : pc->route_wg_smem, rp);
  else if (!s && bs)
    s = smelt__cuda_launch(plan->ctx, OP, wg ? pc->route_wg_beside : pc->route_beside, bs->route_ctas, 1, 1, 256,
                           bs->route_smem, rp);
  else if (!s)
    s = smelt__cuda_launch(plan->ctx, OP, wg ? pc->route_wg : pc->route, (unsigned)gx, (unsigned)ps->h, 1, 256,
                           wg ? pc->route_wg_smem : pc->route_smem, rp);
  if (!s && bs) {
    bs->E->ready = ready;
    bs->E->ready_need = (int)(ps->h / P->ready_groups);
    bs->E->ready_shift = 6; /* kernels/peer_route.cu's ROWS */
    bs->E->ready_groups = P->ready_groups;
    bs->E->ready_gu = (int)(ps->h / P->ready_groups * ps->k);
    void *ep[] = {bs->E};
    s = smelt__cuda_launch_dependent(plan->ctx, OP, bs->fwd, bs->ctas, 32 * PEER_BK8_WARPS, bs->smem, ep);
  }
  smelt_status s2 = smelt__cuda_free(plan->ctx, base);
  return s ? s : s2;
}

/* ---------------------------------------------------------------- retrieve, forward */

smelt_status smelt__cuda_peer_retrieve(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                       const smelt_tensor *ids, const smelt_tensor *scores) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  if (ps->T == 0) return SMELT_OK;
  smelt_ctx *ctx = plan->ctx;
  const int pj = route_pj(ps, w, x);
  const size_t bytes[1] = {qws_bytes(ps, pj)};
  void *base, *q;
  smelt_status s = ws_alloc(ctx, bytes, 1, &base, &q);
  if (s) return s;
  smelt__nvtx_push("smelt_peer_retrieve");
  s = pj ? SMELT_OK : project(plan, w, x, q);
  if (!s) {
    smelt__peer_route_params P;
    route_params(ps, w, &P);
    P.q = (uint64_t)(uintptr_t)q;
    if (pj) pj_params(ps, w, x, q, &P);
    P.ids = (uint64_t)(uintptr_t)ids->data;
    P.scores = (uint64_t)(uintptr_t)scores->data;
    s = launch_route(plan, &P, NULL, pj ? w->wq : NULL);
  }
  smelt__nvtx_pop();
  smelt_status s2 = smelt__cuda_free(ctx, base);
  return s ? s : s2;
}

smelt_status smelt__cuda_peer_forward(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                      const smelt_tensor *y, const smelt_tensor *ids, const smelt_tensor *scores) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const smelt_tensor *outs[1] = {y};
  static const char *const names[1] = {"y"};
  smelt_status s = no_f64(outs, names, 1);
  if (s || ps->T == 0) return s;
  smelt_ctx *ctx = plan->ctx;
  const expert_variant *ev;
  if ((s = variant_for(plan, w, &ev))) return s;
  const int64_t nuse = ps->T * ps->h * ps->k;
  const int pj = route_pj(ps, w, x);
  const size_t bytes[3] = {qws_bytes(ps, pj), (size_t)nuse * 4, ids ? 0 : (size_t)nuse * 8};
  void *base, *r[3];
  if ((s = ws_alloc(ctx, bytes, 3, &base, r))) return s;
  void *q = r[0], *gates = r[1], *idp = ids ? ids->data : r[2];
  smelt__nvtx_push("smelt_peer_forward");
  smelt__peer_expert_params E;
  expert_params(ps, w, x, ev, &E);
  E.y = (uint64_t)(uintptr_t)y->data;
  E.y_rs = y->strides[0];
  E.y_dt = y->dtype;
  E.ids = (uint64_t)(uintptr_t)idp;
  E.gates = (uint64_t)(uintptr_t)gates;
  if (ev->fwd_bulk) E.stage_uses = ev->fwd_slots; /* the backward's E keeps the warp kernel's */
  route_beside bs;
  const int beside = plan_beside(ctx, ps, (const peer_cuda *)ps->cuda, ev, &E, &bs);
  s = pj ? SMELT_OK : project(plan, w, x, q);
  if (!s) {
    smelt__peer_route_params P;
    route_params(ps, w, &P);
    P.q = (uint64_t)(uintptr_t)q;
    if (pj) pj_params(ps, w, x, q, &P);
    P.ids = (uint64_t)(uintptr_t)idp;
    P.scores = scores ? (uint64_t)(uintptr_t)scores->data : 0;
    P.gates = (uint64_t)(uintptr_t)gates;
    s = launch_route(plan, &P, beside ? &bs : NULL, pj ? w->wq : NULL);
  }
  if (!s && ps->store) s = smelt__cuda_peer_store_batch(ps->store, (const int64_t *)idp, nuse);
  if (!s && !beside) {
    void *params[] = {&E};
    if (ev->fwd_bulk) { /* persistent: a warp a token at a time, one CTA an SM at most */
      const int64_t ctas = (ps->T + PEER_BK_WARPS - 1) / PEER_BK_WARPS, sms = ctx->cuda->info.sm_count;
      s = smelt__cuda_launch(ctx, OP, expert_fn(ev, &E, 0), (unsigned)(ctas < sms ? ctas : sms), 1, 1,
                             32 * PEER_BK_WARPS, ev->fwd_smem, params);
    } else {
      s = smelt__cuda_launch(ctx, OP, ev->fwd, (unsigned)ps->T, 1, 1, 256, ev->fwd_smem, params);
    }
  }
  smelt__nvtx_pop();
  smelt_status s2 = smelt__cuda_free(ctx, base);
  return s ? s : s2;
}

/* ---------------------------------------------------------------- backward */

/* Sorts n (key, use) pairs by key (stable, LSD, 8 bits a pass), keys from
 * peer_use_keys with the given mapping; max_key bounds the keys (the
 * sentinel included). On return *keys / *vals point at the sorted arrays
 * (inside the workspace k0/v0/k1/v1). */
typedef struct sort_ws {
  uint32_t *k0, *v0, *k1, *v1, *hist; /* hist: 256 words a tile of keys, then a word a scan tile of those */
} sort_ws;

/* The histograms' exclusive scan: two-level (one block a scan tile) where
 * one block would loop over many tiles; tsum holds a word a scan tile. */
static smelt_status scan_hist(smelt_ctx *ctx, const smelt__peer_util *u, void *hist, int64_t count, void *tsum) {
  const int64_t tiles = (count + SMELT__PEER_SCAN_TILE - 1) / SMELT__PEER_SCAN_TILE;
  if (tiles <= 1) return smelt__peer_scan(ctx, u, hist, count, NULL);
  void *p[] = {&hist, &count, &tsum};
  smelt_status s = smelt__cuda_launch(ctx, OP, u->scan_sums, (unsigned)tiles, 1, 1, 256, 0, p);
  if (!s) s = smelt__peer_scan(ctx, u, tsum, tiles, NULL);
  if (!s) s = smelt__cuda_launch(ctx, OP, u->scan_add, (unsigned)tiles, 1, 1, 256, 0, p);
  return s;
}

static smelt_status sort_uses(smelt_ctx *ctx, const smelt__peer_util *u, const sort_ws *ws, const void *ids, int64_t n,
                              int64_t h, int64_t k, int64_t N, int64_t div, int64_t mod, int64_t table_n,
                              uint32_t sentinel, uint32_t **keys, uint32_t **vals) {
  void *kp = ws->k0;
  {
    void *params[] = {(void *)&ids, &n, &h, &k, &N, &div, &mod, &table_n, &sentinel, &kp};
    smelt_status s = smelt__cuda_launch(ctx, OP, u->use_keys, (unsigned)((n + 255) / 256), 1, 1, 256, 0, params);
    if (s) return s;
  }
  int64_t nblocks = (n + SMELT__PEER_SORT_TILE - 1) / SMELT__PEER_SORT_TILE;
  int bits = 1;
  while (bits < 32 && ((uint64_t)sentinel >> bits)) bits++;
  /* ping-pong: the keys are in kbuf[cur]; the values in vbuf[cur], or the
   * identity before the first pass (vin NULL) */
  uint32_t *kbuf[2] = {ws->k0, ws->k1}, *vbuf[2] = {ws->v0, ws->v1};
  int cur = 0;
  void *vin = NULL, *hist = ws->hist;
  for (int shift = 0; shift < bits; shift += 8) {
    void *kin = kbuf[cur], *kout = kbuf[cur ^ 1], *vout = vbuf[cur ^ 1];
    void *hp[] = {&kin, &n, &shift, &hist, &nblocks};
    smelt_status s = smelt__cuda_launch(ctx, OP, u->sort_hist, (unsigned)nblocks, 1, 1, 256, 0, hp);
    if (!s) s = scan_hist(ctx, u, hist, 256 * nblocks, ws->hist + 256 * nblocks);
    void *sp[] = {&kin, &vin, &kout, &vout, &n, &shift, &hist, &nblocks};
    if (!s) s = smelt__cuda_launch(ctx, OP, u->sort_scatter, (unsigned)nblocks, 1, 1, 256, 0, sp);
    if (s) return s;
    cur ^= 1;
    vin = vbuf[cur];
  }
  *keys = kbuf[cur];
  *vals = vbuf[cur];
  return SMELT_OK;
}

/* out[c * stride] = Σ_r in[r, c] (f32 rows x cols), deterministic. */
static smelt_status colsum(smelt_ctx *ctx, const smelt__peer_util *u, const void *in, int64_t rows, int64_t cols,
                           void *part, const smelt_tensor *out) {
  void *pp[] = {(void *)&in, &rows, &cols, &part};
  smelt_status s = smelt__cuda_launch(ctx, OP, u->colsum_partial, (unsigned)((cols + 255) / 256), SMELT__PEER_CS_CHUNKS,
                                      1, 256, 0, pp);
  if (s) return s;
  void *o = out->data;
  int64_t stride = out->ndim == 1 ? out->strides[0] : 1; /* 2-D outputs ([h, dq]) are contiguous */
  int dt = out->dtype;
  void *fp[] = {&part, &cols, &o, &stride, &dt};
  return smelt__cuda_launch(ctx, OP, u->colsum_final, (unsigned)((cols + 255) / 256), 1, 1, 256, 0, fp);
}

/* bounds[2 r], bounds[2 r + 1] = the run of key r in the n sorted keys
 * (empty for rows without uses), r < nrows. */
static smelt_status seg_bounds(smelt_ctx *ctx, const smelt__peer_util *u, void *skeys, int64_t n, int64_t nrows,
                               void *bounds) {
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)(uintptr_t)bounds, 0, (size_t)nrows * 8, ctx->cuda->stream),
                  OP);
  void *params[] = {&skeys, &n, &nrows, &bounds};
  return smelt__cuda_launch(ctx, OP, u->seg_bounds, (unsigned)((n + 255) / 256), 1, 1, 256, 0, params);
}

static smelt_status memset0(smelt_ctx *ctx, const smelt_tensor *t) {
  const size_t bytes = (size_t)smelt_tensor_numel(t) * smelt_dtype_size(t->dtype);
  if (!bytes) return SMELT_OK;
  SMELT__CU_CHECK(smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)(uintptr_t)t->data, 0, bytes, ctx->cuda->stream), OP);
  return SMELT_OK;
}

/* The runs of the n sorted keys < nrows listed in key order (the sparse
 * expert gradients): bounds[2 r], bounds[2 r + 1] and ids[r] for run r,
 * -1 in ids past the runs, their number to *total (u64) and *count (i64,
 * when not NULL). bsum: one u32 a tile of TILE keys. */
static smelt_status seg_compact(smelt_ctx *ctx, const smelt__peer_util *u, void *skeys, int64_t n, int64_t nrows,
                                void *bsum, void *total, void *bounds, void *ids, void *count) {
  const unsigned tiles = (unsigned)((n + SMELT__PEER_SCAN_TILE - 1) / SMELT__PEER_SCAN_TILE);
  void *hp[] = {&skeys, &n, &nrows, &bsum};
  smelt_status s = smelt__cuda_launch(ctx, OP, u->seg_heads, tiles, 1, 1, 256, 0, hp);
  if (!s) s = smelt__peer_scan(ctx, u, bsum, tiles, total);
  void *cp[] = {&skeys, &n, &nrows, &bsum, &total, &bounds, &ids, &count};
  if (!s) s = smelt__cuda_launch(ctx, OP, u->seg_compact, tiles, 1, 1, 256, 0, cp);
  return s;
}

/* Expert gradient rows by sorted segment sums (peer_dv, peer_du): dense
 * (rows = N, bounds by expert, nrun NULL) or sparse (rows = the uses, bounds
 * by rank, nrun the device count of runs). */
static smelt_status expert_grads(smelt_ctx *ctx, const smelt__peer_state *ps, const smelt__peer_util *u, void *bnd,
                                 void *sv, int64_t rows, void *nrun, const smelt_tensor *x, const smelt_tensor *dy,
                                 void *ua, void *udz, const smelt_tensor *du, const smelt_tensor *dv) {
  int64_t hk = ps->h * ps->k, he = ps->he;
  const unsigned grid = (unsigned)((rows + 7) / 8);
  smelt_status s = SMELT_OK;
  if (dv) {
    void *dyp = dy->data, *dvp = dv->data;
    int64_t dy_rs = dy->strides[0], dout = ps->dout;
    int dy_dt = dy->dtype, dv_dt = dv->dtype;
    void *vp[] = {&bnd, &sv, &rows, &nrun, &ua, &dyp, &dy_rs, &dy_dt, &hk, &he, &dout, &dvp, &dv_dt};
    s = smelt__cuda_launch(ctx, OP, u->dv, grid, 1, 1, 256, 0, vp);
  }
  if (!s && du) {
    void *xp = x->data, *dup = du->data;
    int64_t x_rs = x->strides[0], din = ps->din;
    int x_dt = x->dtype, du_dt = du->dtype;
    void *up[] = {&bnd, &sv, &rows, &nrun, &udz, &xp, &x_rs, &x_dt, &hk, &he, &din, &dup, &du_dt};
    s = smelt__cuda_launch(ctx, OP, u->du, grid, 1, 1, 256, 0, up);
  }
  return s;
}

enum { W_Q, W_QN, W_SC, W_G, W_DG, W_DS, W_UA, W_UDZ, W_DQ, W_DQ16, W_DX, W_PG, W_PB, W_K0, W_V0, W_K1, W_V1, W_HIST, W_BND,
       W_PART, W_RSUM, W_RTOT, W_N };

smelt_status smelt__cuda_peer_backward(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                       const smelt_tensor *ids, const smelt_tensor *dy, const smelt_peer_grads *g) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const peer_cuda *pc = (const peer_cuda *)ps->cuda;
  smelt_ctx *ctx = plan->ctx;
  const smelt_tensor *ts[8 + SMELT_PEER_MAX_DIMS] = {dy, g->dx, g->dwq, g->dbq, g->dnorm_weight, g->dnorm_bias, g->du,
                                                     g->dv};
  static const char *const names[8 + SMELT_PEER_MAX_DIMS] = {
      "dy", "dx", "dwq", "dbq", "dnorm_weight", "dnorm_bias", "du", "dv", "dsub_keys[0]", "dsub_keys[1]",
      "dsub_keys[2]", "dsub_keys[3]"};
  for (int i = 0; i < SMELT_PEER_MAX_DIMS; i++) ts[8 + i] = g->dsub_keys[i];
  const expert_variant *ev;
  smelt_status s = no_f64(ts, names, 8 + SMELT_PEER_MAX_DIMS);
  if (s || (s = variant_for(plan, w, &ev))) return s;
  const int64_t T = ps->T, h = ps->h, k = ps->k, hd = h * ps->dq, nuse = T * h * k;
  const int want_norm = g->dnorm_weight || g->dnorm_bias;
  int want_keys = 0;
  for (int i = 0; i < ps->p; i++) want_keys |= g->dsub_keys[i] != NULL;
  const int sparse = g->grad_ids != NULL;
  const int want_sort = want_keys || g->du || g->dv || sparse;
  const int64_t nblocks = (nuse + SMELT__PEER_SORT_TILE - 1) / SMELT__PEER_SORT_TILE;
  size_t bytes[W_N] = {0};
  bytes[W_Q] = (size_t)(T * hd) * 4;
  bytes[W_QN] = (size_t)(T * hd) * 4;
  bytes[W_SC] = bytes[W_G] = bytes[W_DG] = bytes[W_DS] = (size_t)nuse * 4;
  bytes[W_UA] = bytes[W_UDZ] = (size_t)(nuse * ps->he) * 4;
  bytes[W_DQ] = (size_t)(T * hd) * 4;
  /* dq also goes out in Wq's dtype when that is 16-bit and a gradient the
   * GEMMs produce is wanted in it too (its own rounding is then as large as
   * dq's): the dx GEMM (dq Wqᵀ) and the dWq GEMM (xᵀ dq, when x has that
   * dtype) then run on tensor cores. f32 gradients keep f32 dq (SIMT). */
  const smelt_dtype qdt = w->wq->dtype;
  const int dx16 = g->dx && g->dx->dtype == qdt, dwq16 = g->dwq && g->dwq->dtype == qdt && x->dtype == qdt;
  const int dq16 = (qdt == SMELT_DTYPE_BF16 || qdt == SMELT_DTYPE_F16) && (dx16 || dwq16);
  bytes[W_DQ16] = dq16 ? (size_t)(T * hd) * 2 : 0;
  bytes[W_DX] = g->dx ? (size_t)(T * ps->din) * 4 : 0;
  bytes[W_PG] = g->dnorm_weight ? (size_t)(T * hd) * 4 : 0;
  bytes[W_PB] = g->dnorm_bias ? (size_t)(T * hd) * 4 : 0;
  if (want_sort) {
    bytes[W_K0] = bytes[W_V0] = bytes[W_K1] = bytes[W_V1] = (size_t)(nuse ? nuse : 1) * 4;
    bytes[W_HIST] = (size_t)(256 * (nblocks ? nblocks : 1) + (nblocks + 3) / 4) * 4; /* + scan_hist's tile sums */
    /* segment bounds of the longest table sorted: experts or a dim's key rows */
    int64_t rows = g->du || g->dv ? ps->N : 1;
    if (sparse && nuse > rows) rows = nuse; /* the sparse rows' bounds, by rank */
    for (int i = 0; i < ps->p; i++)
      if (g->dsub_keys[i] && (ps->cfg.per_head_keys ? h : 1) * ps->n[i] > rows) rows = (ps->cfg.per_head_keys ? h : 1) * ps->n[i];
    bytes[W_BND] = (size_t)rows * 8;
  }
  bytes[W_PART] = (size_t)(SMELT__PEER_CS_CHUNKS * hd) * 4; /* the widest column sum: dbq */
  if (sparse) {
    bytes[W_RSUM] = (size_t)((nuse + SMELT__PEER_SCAN_TILE - 1) / SMELT__PEER_SCAN_TILE + 1) * 4;
    bytes[W_RTOT] = 8;
  }
  void *base, *r[W_N];
  if ((s = ws_alloc(ctx, bytes, W_N, &base, r))) return s;
  smelt__nvtx_push("smelt_peer_backward");
  smelt__peer_route_params P;
  route_params(ps, w, &P);
  P.q = (uint64_t)(uintptr_t)r[W_Q];
  P.qn = (uint64_t)(uintptr_t)r[W_QN];
  P.ids = (uint64_t)(uintptr_t)ids->data;
  P.scores = (uint64_t)(uintptr_t)r[W_SC];
  P.gates = (uint64_t)(uintptr_t)r[W_G];
  P.dg = (uint64_t)(uintptr_t)r[W_DG];
  P.ds = (uint64_t)(uintptr_t)r[W_DS];
  P.dqo = (uint64_t)(uintptr_t)r[W_DQ];
  P.pgamma = (uint64_t)(uintptr_t)r[W_PG];
  P.pbeta = (uint64_t)(uintptr_t)r[W_PB];
  P.dq16 = (uint64_t)(uintptr_t)r[W_DQ16];
  P.dq16_dt = (int)qdt;
  const unsigned rows_grid = (unsigned)((T * h + 7) / 8);
  void *pp[] = {&P};
  if (T > 0) s = project(plan, w, x, r[W_Q]);
  if (!s) s = smelt__cuda_launch(ctx, OP, pc->rescore, rows_grid, 1, 1, 256, 0, pp);
  if (!s) {
    smelt__peer_expert_params E;
    expert_params(ps, w, x, ev, &E);
    E.dy = (uint64_t)(uintptr_t)dy->data;
    E.dy_rs = dy->strides[0];
    E.dy_dt = dy->dtype;
    E.ids = P.ids;
    E.gates = P.gates;
    E.ua = (uint64_t)(uintptr_t)r[W_UA];
    E.udz = (uint64_t)(uintptr_t)r[W_UDZ];
    E.dg = P.dg;
    E.dx = (uint64_t)(uintptr_t)r[W_DX];
    void *ep[] = {&E};
    s = smelt__cuda_launch(ctx, OP, ev->bwd, (unsigned)T, 1, 1, 256, ev->bwd_smem, ep);
  }
  if (!s) s = smelt__cuda_launch(ctx, OP, pc->route_bwd, rows_grid, 1, 1, 256, pc->rbwd_smem, pp);
  smelt_tensor dqt = dev_tensor(ctx, r[W_DQ], SMELT_DTYPE_F32, T, hd);
  smelt_tensor dq16t = dq16 ? dev_tensor(ctx, r[W_DQ16], qdt, T, hd) : dqt;
  if (!s && g->dx) { /* dx = dq Wqᵀ + dx from the experts */
    smelt_tensor wqt = *w->wq, dxe = dev_tensor(ctx, r[W_DX], SMELT_DTYPE_F32, T, ps->din);
    wqt.shape[0] = w->wq->shape[1];
    wqt.shape[1] = w->wq->shape[0];
    wqt.strides[0] = w->wq->strides[1];
    wqt.strides[1] = w->wq->strides[0];
    smelt_gemm_desc d = smelt_gemm_desc_default();
    d.epilogue.beta = 1.0;
    s = smelt_gemm(ctx, &d, dx16 ? &dq16t : &dqt, &wqt, &dxe, g->dx, NULL);
  }
  if (!s && g->dwq) { /* dWq = xᵀ dq */
    smelt_tensor xt = *x;
    xt.shape[0] = x->shape[1];
    xt.shape[1] = x->shape[0];
    xt.strides[0] = x->strides[1];
    xt.strides[1] = x->strides[0];
    s = smelt_gemm(ctx, NULL, &xt, dwq16 ? &dq16t : &dqt, NULL, g->dwq, NULL);
  }
  if (!s && g->dbq) s = colsum(ctx, &pc->util, r[W_DQ], T, hd, r[W_PART], g->dbq);
  if (!s && want_norm) { /* [h, dq] params sum over tokens; [dq] ones over tokens and heads */
    const int64_t rows = ps->norm_per_head ? T : T * h, cols = ps->norm_per_head ? hd : ps->dq;
    if (g->dnorm_weight) s = colsum(ctx, &pc->util, r[W_PG], rows, cols, r[W_PART], g->dnorm_weight);
    if (!s && g->dnorm_bias) s = colsum(ctx, &pc->util, r[W_PB], rows, cols, r[W_PART], g->dnorm_bias);
  }
  sort_ws sw = {(uint32_t *)r[W_K0], (uint32_t *)r[W_V0], (uint32_t *)r[W_K1], (uint32_t *)r[W_V1],
                (uint32_t *)r[W_HIST]};
  if (!s && nuse == 0) {
    if (g->du) s = memset0(ctx, g->du);
    if (!s && g->dv) s = memset0(ctx, g->dv);
    if (!s && g->grad_count) s = memset0(ctx, g->grad_count);
  } else if (!s && (g->du || g->dv || sparse)) {
    uint32_t *sk, *sv;
    void *bnd = r[W_BND];
    s = sort_uses(ctx, &pc->util, &sw, ids->data, nuse, h, k, ps->N, 1, 0, 0, (uint32_t)ps->N, &sk, &sv);
    if (!s && (g->du || g->dv)) { /* every row written: zeros where no use selected the expert */
      s = seg_bounds(ctx, &pc->util, sk, nuse, ps->N, bnd);
      if (!s) s = expert_grads(ctx, ps, &pc->util, bnd, sv, ps->N, NULL, x, dy, r[W_UA], r[W_UDZ], g->du, g->dv);
    }
    if (!s && sparse) { /* the distinct experts' rows, in expert order (bnd reused in stream order) */
      s = seg_compact(ctx, &pc->util, sk, nuse, ps->N, r[W_RSUM], r[W_RTOT], bnd, g->grad_ids->data,
                      g->grad_count ? g->grad_count->data : NULL);
      if (!s)
        s = expert_grads(ctx, ps, &pc->util, bnd, sv, nuse, r[W_RTOT], x, dy, r[W_UA], r[W_UDZ], g->du_rows,
                         g->dv_rows);
    }
  }
  for (int i = 0; i < ps->p && !s; i++) {
    const smelt_tensor *dk = g->dsub_keys[i];
    if (!dk) continue;
    if (nuse == 0) {
      s = memset0(ctx, dk);
      continue;
    }
    int64_t div = 1;
    for (int j = i + 1; j < ps->p; j++) div *= ps->n[j];
    const int64_t table_n = ps->cfg.per_head_keys ? ps->n[i] : 0;
    int64_t nrows = (ps->cfg.per_head_keys ? h : 1) * ps->n[i];
    uint32_t *sk, *sv;
    void *bnd = r[W_BND];
    s = sort_uses(ctx, &pc->util, &sw, ids->data, nuse, h, k, ps->N, div, ps->n[i], table_n, (uint32_t)nrows, &sk, &sv);
    if (!s) s = seg_bounds(ctx, &pc->util, sk, nuse, nrows, bnd);
    if (s) break;
    void *svp = sv, *dkp = dk->data;
    int dim = i, dk_dt = dk->dtype;
    void *kp[] = {&P, &bnd, &svp, &dim, &nrows, &dkp, &dk_dt};
    s = smelt__cuda_launch(ctx, OP, pc->dkeys, (unsigned)nrows, 1, 1, 256, 0, kp);
  }
  smelt__nvtx_pop();
  smelt_status s2 = smelt__cuda_free(ctx, base);
  return s ? s : s2;
}
