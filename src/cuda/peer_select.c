/* smelt_peer on CUDA, the plan and the backend (smelt__cuda_peer): the
 * kernel modules and their variant list, and the selector, which chooses
 * once, from the problem, the device and cfg.kernels, every kernel a run
 * launches with its shared memory and launch shape (smelt__peer_variant),
 * loads them, and describes them. The runs (peer_fwd.c, peer_bwd.c)
 * launch what it chose.
 *
 *   routing     reg (mma.sync scores in two passes; its buffered form for
 *               dq/p > 128, its lists of 32 for k > 16) or wg (reg's scores
 *               on wgmma, Hopper), on whole tiles, persistent beside the
 *               experts, or a tile's two dims as two units (split)
 *   projection  the GEMM engine before the routing, or inside it (fused)
 *   expert      bulk (Hopper, persistent, TMA bulk copies), warp-streamed,
 *               or rounds of staged uses; one module per weight dtype and
 *               load width: 16-byte loads need d_in and d_out multiples of
 *               16 bytes of weights and 16-byte aligned tables, else scalar
 *               loads (then h_e <= 32)
 *   overlap     the forward's expert kernel beside the routing or after it */
#include "../core/gemm_internal.h"
#include "gemm_cuda.h"
#include "peer_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OP "smelt_peer"

static const smelt_dtype weight_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* ---------------------------------------------------------------- sources */

/* The shared-memory layout constants a module's kernels check
 * (peer_cuda.h), into its prelude. */
typedef struct layout_define {
  const char *name;
  long long value;
} layout_define;

static void define_layouts(smelt__kernel_src *src, const layout_define *d, size_t n) {
  for (size_t i = 0; i < n; i++) smelt__prelude_define(src, d[i].name, d[i].value);
}

void smelt__peer_route_src(smelt__kernel_src *src) {
  static const layout_define layouts[] = {{"SMELT_PEER_SMEM_ROUTE", SMELT__PEER_SMEM_ROUTE},
                                          {"SMELT_PEER_SMEM_ROUTE_DS", SMELT__PEER_SMEM_ROUTE_DS},
                                          {"SMELT_PEER_SMEM_ROUTE_WG", SMELT__PEER_SMEM_ROUTE_WG},
                                          {"SMELT_PEER_SMEM_RBWD_DQ", SMELT__PEER_SMEM_RBWD_DQ},
                                          {"SMELT_PEER_SMEM_RBWD", SMELT__PEER_SMEM_RBWD}};
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "peer_route");
  src->body = "peer_route.cu";
  define_layouts(src, layouts, sizeof layouts / sizeof *layouts);
}

void smelt__peer_util_src(smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "peer_util");
  src->body = "peer_util.cu";
}

void smelt__peer_expert_src(smelt_dtype wdt, int vec, smelt__kernel_src *src) {
  static const layout_define layouts[] = {{"SMELT_PEER_SMEM_USE_PTRS", SMELT__PEER_SMEM_USE_PTRS},
                                          {"SMELT_PEER_WS_WARPS", SMELT__PEER_WS_WARPS},
                                          {"SMELT_PEER_WS_CH", SMELT__PEER_WS_CH},
                                          {"SMELT_PEER_SMEM_BULK_WIN", SMELT__PEER_SMEM_BULK_WIN},
                                          {"SMELT_PEER_SMEM_BULK8_BARS", SMELT__PEER_SMEM_BULK8_BARS}};
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "peer_expert_%s_%s", smelt_dtype_name(wdt), vec > 1 ? "v16" : "scalar");
  src->body = "peer_expert.cu";
  smelt__prelude_define(src, "SMELT_WDT", wdt);
  smelt__prelude_define(src, "SMELT_VEC", vec);
  define_layouts(src, layouts, sizeof layouts / sizeof *layouts);
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

/* ---------------------------------------------------------------- shared memory */

static int64_t r4(int64_t n) { return (n + 3) & ~(int64_t)3; }

/* The round kernels: x (dy), G rows of y (dx), the round's activations,
 * gates and row pointers. */
static unsigned fwd_smem(const smelt__peer_state *ps, int gout, int64_t chunk) {
  return (unsigned)(4 * (r4(ps->din) + gout * r4(ps->dout) + r4(chunk * ps->he) + r4(chunk)) +
                    SMELT__PEER_SMEM_USE_PTRS * chunk);
}
static unsigned bwd_smem(const smelt__peer_state *ps, int gin, int64_t chunk) {
  return (unsigned)(4 * (r4(ps->din) + r4(ps->dout) + gin * r4(ps->din) + 2 * r4(chunk * ps->he) + r4(chunk)) +
                    SMELT__PEER_SMEM_USE_PTRS * chunk);
}

/* The warp-streamed kernels: a ring of `slots` uses' rows a warp, x (and
 * dy), gates and row pointers. */
static unsigned warp_fwd_smem(const smelt__peer_state *ps, int64_t slots, int64_t row_bytes) {
  const int64_t hk = ps->h * ps->k;
  return (unsigned)(SMELT__PEER_WS_WARPS * slots * row_bytes + 4 * (r4(ps->din) + r4(hk)) +
                    SMELT__PEER_SMEM_USE_PTRS * hk);
}
static unsigned warp_bwd_smem(const smelt__peer_state *ps, int64_t slots, int64_t row_bytes) {
  const int64_t hk = ps->h * ps->k;
  return (unsigned)(SMELT__PEER_WS_WARPS * slots * row_bytes + 4 * (r4(ps->din) + r4(ps->dout) + r4(hk)) +
                    SMELT__PEER_SMEM_USE_PTRS * hk);
}

/* peer_expert_fwd_bulk: CTAs of `warps` warps (16, or 8 for
 * peer_expert_fwd_bulk8), each with a ring of `slots` uses' rows and a
 * window of codes and gates. */
#define PEER_BK_WARPS 16
#define PEER_BK8_WARPS 8
#define PEER_BK_SLOTS_MAX 8
static unsigned bulk_fwd_smem(int warps, int64_t slots, int64_t row_bytes) {
  return (unsigned)(warps * (slots * row_bytes + SMELT__PEER_SMEM_BULK_WIN));
}

/* The least shared memory over half an SM's of sm_smem bytes (a CTA
 * reserves 1 KiB more): a CTA that takes it has the SM's to itself. */
static int64_t over_half(int sm_smem) { return sm_smem / 2 - 1024 + 128; }

/* ---------------------------------------------------------------- the selector */

static smelt_status cannot(const char *field, const char *value, const char *needs) {
  return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": cfg.kernels.%s=%s needs %s", field, value, needs);
}

/* Thread groups over the uses when the columns (in vec chunks) leave
 * threads idle: the largest power of two <= 8 that still gives every
 * thread a column. */
static int groups_for(int64_t chunks) {
  int g = 1;
  while (g < 8 && chunks * 2 * g <= 256) g *= 2;
  return g;
}

/* Hopper with the warp kernels' shape: the forward persistent, one CTA an
 * SM with as many slots a warp (<= 8) as its shared memory holds, at least
 * 2; and its 8-warp form with as many slots (>= 2) as leave room on the SM
 * for a routing CTA of over half its shared memory (over_half; the form's
 * barriers and 1 KiB a CTA reserved), else none. Returns 0 where it does
 * not apply. */
static smelt_status choose_bulk(smelt_ctx *ctx, const smelt__peer_state *ps, int64_t row_bytes, smelt__peer_expert *ev,
                                int *fits) {
  const smelt_device_info *dev = &ctx->cuda->info;
  *fits = 0;
  if (dev->cc_major != 9 || row_bytes > INT32_MAX || ps->N > INT32_MAX) /* the kernel's row codes are 32-bit */
    return SMELT_OK;
  int64_t slots = PEER_BK_SLOTS_MAX;
  while (slots >= 2 && bulk_fwd_smem(PEER_BK_WARPS, slots, row_bytes) + 1024 > (unsigned)dev->smem_per_block_optin)
    slots--;
  if (slots < 2) return SMELT_OK;
  *fits = 1;
  ev->kind = SMELT_PEER_EXPERT_BULK;
  ev->fwd_slots = (int)slots;
  ev->fwd_smem = bulk_fwd_smem(PEER_BK_WARPS, slots, row_bytes);
  SMELT__CU_CHECK(smelt__cu(NULL)->cuDeviceGetAttribute(&ev->sm_smem, SMELT__CU_DEV_ATTR_SMEM_PER_SM, ctx->cuda->dev),
                  OP);
  const int64_t room = ev->sm_smem - over_half(ev->sm_smem) - 1024 - SMELT__PEER_SMEM_BULK8_BARS - 1024;
  for (slots = PEER_BK_SLOTS_MAX; slots >= 2; slots--)
    if ((int64_t)bulk_fwd_smem(PEER_BK8_WARPS, slots, row_bytes) <= room) break;
  if (slots >= 2) {
    ev->fwd8_slots = (int)slots;
    ev->fwd8_smem = bulk_fwd_smem(PEER_BK8_WARPS, slots, row_bytes);
  }
  return SMELT_OK;
}

/* The expert kernel for weights of wdt at vec elements a load: bulk, else
 * warp-streamed when h_e <= the load width, the rows a lane keeps (y and
 * dx) fit its WS_CH chunks, and three (else two) slots a warp fit half the
 * SM's shared memory (two CTAs an SM), else rounds of up to 256 uses,
 * fewer while that keeps shared memory under 96 KiB (two CTAs an SM on
 * Hopper and Ampere). */
static smelt_status choose_expert(smelt_ctx *ctx, const smelt__peer_state *ps, smelt_dtype wdt, int vec,
                                  smelt_peer_expert_kernel want, smelt__peer_expert *ev) {
  static const char *const names[] = {"auto", "bulk", "warp", "rows"};
  const int smem_max = ctx->cuda->info.smem_per_block_optin;
  const int64_t hk = ps->h * ps->k, row_bytes = (ps->din + ps->dout) * ps->he * (int64_t)smelt_dtype_size(wdt);
  memset(ev, 0, sizeof *ev);
  ev->vec = vec;
  ev->wdt = wdt;
  ev->gout = groups_for(ps->dout / vec);
  ev->gin = groups_for(ps->din / vec);
  const unsigned half = (unsigned)(smem_max / 2 - 1024);
  int64_t slots = 0;
  if (vec > 1 && ps->he <= vec && ps->din * ps->he <= 32 * SMELT__PEER_WS_CH * vec &&
      ps->dout <= 32 * SMELT__PEER_WS_CH * vec && hk > 0)
    for (slots = 3; slots >= 2; slots--)
      if (warp_fwd_smem(ps, slots, row_bytes) <= half && warp_bwd_smem(ps, slots, row_bytes) <= half) break;
  if (slots < 2 && (want == SMELT_PEER_EXPERT_WARP || want == SMELT_PEER_EXPERT_BULK))
    return cannot("expert", names[want],
                  "16-byte expert rows, h_e <= 16 / weight size, d_in * h_e and d_out of at most 128 16-byte loads, "
                  "and two slots a warp in half the SM's shared memory");
  if (slots >= 2 && want != SMELT_PEER_EXPERT_ROWS) {
    ev->kind = SMELT_PEER_EXPERT_WARP;
    ev->stage_uses = slots;
    ev->chunk = hk;
    ev->fwd_smem = warp_fwd_smem(ps, slots, row_bytes);
    ev->bwd_smem = warp_bwd_smem(ps, slots, row_bytes);
    int bulk = 0;
    smelt_status s = want != SMELT_PEER_EXPERT_WARP ? choose_bulk(ctx, ps, row_bytes, ev, &bulk) : SMELT_OK;
    if (!s && !bulk && want == SMELT_PEER_EXPERT_BULK)
      s = cannot("expert", "bulk", "an sm_90 device, 32-bit row codes and two slots a warp of 16 warps in a CTA");
    return s;
  }
  const unsigned budget = smem_max < 96 * 1024 ? (unsigned)smem_max : 96 * 1024;
  ev->kind = SMELT_PEER_EXPERT_ROWS;
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
  return SMELT_OK;
}

/* The bulk forward's tensor-core forms (kernels/peer_expert.cu's
 * bk_tensor): the literal shape (h_e 1, d_in = d_out = 32 WS_CH 8) with
 * 16-bit weights, h k even, and x of the weights' type with rows 4-byte
 * aligned. */
static int expert_tc(const smelt__peer_state *ps, const smelt__peer_expert *ev, const smelt__peer_facts *f) {
  const smelt_tensor *x = &ps->t[SMELT__PT_X];
  const int64_t lit = 32 * SMELT__PEER_WS_CH * 8;
  return ev->kind == SMELT_PEER_EXPERT_BULK && ev->wdt != SMELT_DTYPE_F32 && ev->vec == 8 && ps->he == 1 &&
         ps->din == lit && ps->dout == lit && ps->h * ps->k % 2 == 0 && x->dtype == ev->wdt && f->x4 &&
         x->strides[0] % 2 == 0;
}

/* The routing kernel on whole tiles: wg (wgmma, sm_90a, on a dsub padded
 * to exactly 128, keys without lo parts: bf16, not L2-normalized) where it
 * applies, else reg's family: reg holds a query slice's fragments in
 * registers (k <= 16, dsub <= 128), its buffered form takes dsub > 128, its
 * lists of 32 k > 16. */
static smelt_status choose_route(smelt_ctx *ctx, const smelt__peer_state *ps, smelt_peer_route_kernel want,
                                 smelt__peer_variant *v) {
  const smelt_device_info *dev = &ctx->cuda->info;
  v->kmax = ps->k <= 16 && ps->dsub <= 128;
  const int wg_ok = v->kmax && dev->cc_major == 9 && dev->cc_minor == 0 && ps->dsub > 112 &&
                    ps->t[SMELT__PT_KEY0].dtype == SMELT_DTYPE_BF16 && !ps->cfg.key_l2_norm;
  if (want == SMELT_PEER_ROUTE_WG && !wg_ok)
    return cannot("route", "wg",
                  "an sm_90a device, k <= 16, 112 < query_dim / product_key_dims <= 128, bf16 sub-keys and no "
                  "key_l2_norm");
  v->route = want != SMELT_PEER_ROUTE_REG && wg_ok ? SMELT_PEER_ROUTE_WG : SMELT_PEER_ROUTE_REG;
  return SMELT_OK;
}

/* Beside the routing, peer_expert_fwd_bulk8 shares every SM with a routing
 * CTA: the routing is compute-bound (tensor cores, shared memory), the
 * expert rows memory-bound. The routing runs persistent, one CTA an SM
 * (its shared memory over half the SM's), raising a counter per block of
 * 64 tokens (and head group) as each head of it is done; the expert
 * kernel is its programmatic dependent, one CTA of 8 warps an SM in the
 * room left, and its warps wait on those counters for their uses. The
 * dependent's CTAs are placed only once every routing CTA has started
 * (kernels/peer_route.cu), so no wait can hold back a routing CTA that
 * never got an SM: where CUDA runs the two one after the other
 * (CUDA_LAUNCH_BLOCKING=1, tools that serialize kernels, an MPS SM limit)
 * the forward is as correct, only slower. Only for the bulk kernel and
 * reg's family at k <= 16, dsub <= 128 without a store (the store's batch
 * needs every id first). */
static int beside_fits(smelt_ctx *ctx, const smelt__peer_state *ps, const smelt__peer_variant *v,
                       unsigned route_smem, int64_t *rs) {
  const smelt__peer_expert *ev = &v->ev;
  if (ev->kind != SMELT_PEER_EXPERT_BULK || !ev->fwd8_slots || !v->kmax || ps->store) return 0;
  *rs = (int64_t)route_smem > over_half(ev->sm_smem) ? (int64_t)route_smem : over_half(ev->sm_smem);
  return *rs <= ctx->cuda->info.smem_per_block_optin &&
         *rs + 1024 + ev->fwd8_smem + SMELT__PEER_SMEM_BULK8_BARS + 1024 <= ev->sm_smem;
}

/* The routing computes the queries itself (peer_route_wg_split_pj: no
 * projection GEMM, no q in HBM): bf16 x and Wq with Wq's K-major copy
 * planned, p = 2 without query normalization, wg's keys, dq/p 128, d_in a
 * multiple of 64, x's rows 16-byte vectors and bq of unit stride. */
static int fused_fits(const smelt__peer_state *ps, const smelt__peer_cuda *pc, const smelt__peer_variant *v) {
  const smelt_tensor *x = &ps->t[SMELT__PT_X], *wq = &ps->t[SMELT__PT_WQ], *bq = &ps->t[SMELT__PT_BQ];
  return v->route == SMELT_PEER_ROUTE_WG && pc->wq_t && x->dtype == SMELT_DTYPE_BF16 &&
         wq->dtype == SMELT_DTYPE_BF16 && ps->p == 2 && ps->cfg.query_norm == SMELT_PEER_NORM_NONE &&
         ps->dsub == 128 && ps->din % 64 == 0 && v->facts.x16 && x->strides[0] % 8 == 0 &&
         (bq->ndim < 0 || bq->strides[0] == 1);
}

/* The routing's launch for the forward beside the experts (beside) or
 * alone (retrieval, the forward after): rs, its shared memory beside. */
static void route_launch(smelt_ctx *ctx, const smelt__peer_state *ps, const smelt__peer_variant *v, int beside,
                         unsigned route_smem, unsigned rs, smelt__peer_route_launch *L) {
  const int64_t gx = (ps->T + 63) / 64, tiles = gx * ps->h, sms = ctx->cuda->info.sm_count;
  const int wg = v->route == SMELT_PEER_ROUTE_WG, fused = v->projection == SMELT_PEER_PROJECTION_FUSED;
  /* beside, wg with p = 2 and no query normalization, and fused beside or
   * not: a tile's dims as two units; alone two CTAs an SM */
  L->split = fused || (beside && wg && ps->p == 2 && ps->cfg.query_norm == SMELT_PEER_NORM_NONE);
  L->grid[1] = 1;
  if (L->split) {
    const int64_t ctas = beside ? sms : 2 * sms;
    L->name = fused ? "peer_route_wg_split_pj" : "peer_route_wg_split";
    L->grid[0] = (unsigned)(2 * tiles < ctas ? 2 * tiles : ctas);
    L->smem = beside ? rs : SMELT__PEER_SMEM_ROUTE_WG;
  } else if (beside) {
    L->name = wg ? "peer_route_wg_beside" : "peer_route_beside";
    L->grid[0] = (unsigned)(tiles < sms ? tiles : sms);
    L->smem = rs;
  } else {
    L->name = wg ? "peer_route_wg" : ps->k > 16 ? "peer_route32_pre" : ps->dsub > 128 ? "peer_route_buf" : "peer_route_reg";
    L->grid[0] = (unsigned)gx;
    L->grid[1] = (unsigned)ps->h;
    L->smem = wg ? SMELT__PEER_SMEM_ROUTE_WG : route_smem;
  }
}

static int ev_has8(const smelt__peer_variant *v) {
  return v->ev.kind == SMELT_PEER_EXPERT_BULK && v->ev.fwd8_slots;
}

/* Fills *v for the facts f from cfg.kernels; fused_auto: the projection's
 * AUTO takes fused (where it fits) only when the planned expert kernel
 * has its 8-warp form (-1: v's own is the planned one). */
static smelt_status choose(smelt_ctx *ctx, const smelt__peer_state *ps, const smelt__peer_cuda *pc,
                           const smelt__peer_facts *f, unsigned route_smem, int fused_auto, smelt__peer_variant *v) {
  const smelt_peer_kernels *kc = &ps->cfg.kernels;
  const smelt_dtype wdt = ps->store ? ps->store->dtype : ps->t[SMELT__PT_U].dtype;
  memset(v, 0, sizeof *v);
  v->facts = *f;
  smelt_status s = choose_route(ctx, ps, kc->route, v);
  if (!s) s = choose_expert(ctx, ps, wdt, f->wide ? vec_of(wdt) : 1, kc->expert, &v->ev);
  if (s) return s;
  v->ev.tc = expert_tc(ps, &v->ev, f);
  int64_t rs = 0;
  const int beside_ok = beside_fits(ctx, ps, v, route_smem, &rs);
  if (kc->overlap == SMELT_PEER_OVERLAP_BESIDE && !beside_ok)
    return cannot("overlap", "beside",
                  "expert kernel bulk with room for its 8-warp form beside a routing CTA, routing with k <= 16 and "
                  "query_dim / product_key_dims <= 128, and dense expert tables");
  v->overlap = kc->overlap != SMELT_PEER_OVERLAP_AFTER && beside_ok ? SMELT_PEER_OVERLAP_BESIDE
                                                                      : SMELT_PEER_OVERLAP_AFTER;
  const int fused_ok = fused_fits(ps, pc, v);
  if (kc->projection == SMELT_PEER_PROJECTION_FUSED && !fused_ok)
    return cannot("projection", "fused",
                  "routing wg, bf16 x, wq and sub-keys, product_key_dims 2, no query_norm, query_dim / "
                  "product_key_dims 128, input_dim a multiple of 64, the Hopper GEMM for Wq's K-major copy, and x "
                  "16-byte aligned with rows of 16-byte vectors and bq of unit stride");
  if (fused_auto < 0) fused_auto = ev_has8(v);
  v->projection = fused_ok && (kc->projection == SMELT_PEER_PROJECTION_FUSED ||
                               (kc->projection == SMELT_PEER_PROJECTION_AUTO && fused_auto))
                      ? SMELT_PEER_PROJECTION_FUSED
                      : SMELT_PEER_PROJECTION_GEMM;
  if (kc->head_groups == 2 && ps->h % 2)
    return cannot("head_groups", "2", "an even num_heads");
  const int beside = v->overlap == SMELT_PEER_OVERLAP_BESIDE;
  v->head_groups = beside && ps->h % 2 == 0 && kc->head_groups != 1 ? 2 : 1;
  const smelt__peer_expert *ev = &v->ev;
  if (beside) {
    const int64_t need = (ps->T + PEER_BK8_WARPS - 1) / PEER_BK8_WARPS, sms = ctx->cuda->info.sm_count; /* a warp a token */
    v->expert_grid = (unsigned)(need < sms ? need : sms);
    v->expert_block = 32 * PEER_BK8_WARPS;
    v->expert_smem = ev->fwd8_smem;
    v->expert_slots = ev->fwd8_slots;
  } else if (ev->kind == SMELT_PEER_EXPERT_BULK) { /* persistent: a warp a token at a time, one CTA an SM at most */
    const int64_t ctas = (ps->T + PEER_BK_WARPS - 1) / PEER_BK_WARPS, sms = ctx->cuda->info.sm_count;
    v->expert_grid = (unsigned)(ctas < sms ? ctas : sms);
    v->expert_block = 32 * PEER_BK_WARPS;
    v->expert_smem = ev->fwd_smem;
    v->expert_slots = ev->fwd_slots;
  } else {
    v->expert_grid = (unsigned)ps->T;
    v->expert_block = 256;
    v->expert_smem = ev->fwd_smem;
    v->expert_slots = (int)ev->stage_uses;
  }
  route_launch(ctx, ps, v, beside, route_smem, (unsigned)rs, &v->fwd);
  route_launch(ctx, ps, v, 0, route_smem, 0, &v->alone);
  return SMELT_OK;
}

/* ---------------------------------------------------------------- loading and description */

static const char *expert_fwd_name(const smelt__peer_variant *v) {
  const smelt__peer_expert *ev = &v->ev;
  if (v->overlap == SMELT_PEER_OVERLAP_BESIDE) return ev->tc ? "peer_expert_fwd_bulk8_tc" : "peer_expert_fwd_bulk8";
  if (ev->kind == SMELT_PEER_EXPERT_BULK) return ev->tc ? "peer_expert_fwd_bulk_tc" : "peer_expert_fwd_bulk";
  return ev->kind == SMELT_PEER_EXPERT_WARP ? "peer_expert_fwd_warp" : "peer_expert_fwd";
}

/* Beside the experts and in a tile's two units, the shared-memory carveout
 * at its largest: an SM's L1/shared split is set for the CTAs it runs, and
 * one a routing CTA alone would get (the least that holds it) leaves no
 * room for an expert CTA beside it. */
static smelt_status carveout(CUfunction f) {
  SMELT__CU_CHECK(smelt__cu(NULL)->cuFuncSetAttribute(f, SMELT__CU_FUNC_ATTR_CARVEOUT, 100), OP);
  return SMELT_OK;
}

static smelt_status load(smelt_ctx *ctx, smelt__peer_variant *v) {
  smelt__kernel_src rs, es;
  smelt__peer_route_src(&rs);
  smelt__peer_expert_src(v->ev.wdt, v->ev.vec, &es);
  const int beside = v->overlap == SMELT_PEER_OVERLAP_BESIDE;
  smelt_status s = smelt__cuda_function(
      ctx, &rs, v->projection == SMELT_PEER_PROJECTION_FUSED ? "peer_route_prep" : "peer_split_keys", &v->prep);
  if (!s) s = smelt__cuda_function(ctx, &rs, v->fwd.name, &v->fwd.f);
  if (!s) s = smelt__cuda_function(ctx, &rs, v->alone.name, &v->alone.f);
  if (!s) s = smelt__cuda_function(ctx, &es, expert_fwd_name(v), &v->ev.fwd);
  if (!s)
    s = smelt__cuda_function(ctx, &es, v->ev.kind == SMELT_PEER_EXPERT_ROWS ? "peer_expert_bwd" : "peer_expert_bwd_warp",
                             &v->ev.bwd);
  if (!s && (beside || v->fwd.split)) s = carveout(v->fwd.f);
  if (!s && v->alone.split) s = carveout(v->alone.f);
  if (!s && beside) s = carveout(v->ev.fwd);
  return s;
}

/* What the plan runs, from its variant: the projection, the forward's
 * routing kernel (and the retrieval's when it differs), the expert module
 * and its forward kernel, beside the routing or not, and its slots a warp
 * or uses a round (last: truncated first when too long). */
static void describe(smelt_plan *plan, const smelt__peer_state *ps, const smelt__peer_cuda *pc,
                     const smelt__peer_variant *v) {
  smelt__kernel_src es;
  smelt__peer_expert_src(v->ev.wdt, v->ev.vec, &es);
  const size_t skip = strlen("peer_");
  char route[64], expert[96];
  if (strcmp(v->alone.name, v->fwd.name))
    snprintf(route, sizeof route, "%.24s (alone %.24s)", v->fwd.name + skip, v->alone.name + skip);
  else
    snprintf(route, sizeof route, "%.24s", v->fwd.name + skip);
  snprintf(expert, sizeof expert, "%.24s %.16s%s, %d %s", es.name + skip, expert_fwd_name(v) + strlen("peer_expert_"),
           v->overlap != SMELT_PEER_OVERLAP_BESIDE ? "" : v->head_groups == 2 ? " beside, 2 head groups" : " beside",
           v->ev.kind == SMELT_PEER_EXPERT_ROWS ? (int)v->ev.chunk : v->expert_slots,
           v->ev.kind == SMELT_PEER_EXPERT_ROWS ? "uses a round" : "slots");
  snprintf(plan->describe, sizeof plan->describe, "peer N=%lld (p=%d) h=%lld k=%lld dq=%lld h_e=%lld: %s + %s + ",
           (long long)ps->N, ps->p, (long long)ps->h, (long long)ps->k, (long long)ps->dq, (long long)ps->he,
           v->projection == SMELT_PEER_PROJECTION_FUSED ? "x Wq fused"
           : pc->wq_t                                   ? "GEMM x Wq (K-major)"
                                                        : "GEMM x Wq",
           route);
  const size_t used = strlen(plan->describe); /* the expert kernel last: truncated first when too long */
  snprintf(plan->describe + used, sizeof plan->describe - used, "%s", expert);
}

/* ---------------------------------------------------------------- the projection */

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* Whether a GEMM plan runs the Hopper kernel (TMA + wgmma). */
static int hopper_gemm(const smelt_plan *p) {
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  smelt__gemm_table(table);
  return table[((const smelt__gemm_cuda_plan *)p->backend)->kernel].fam == SMELT__GK_SM90;
}

/* The projection's GEMM plan, made against workspaces like the runs'. The
 * Hopper GEMM kernel (TMA + wgmma) takes B K-major only, and Wq [d_in, h*dq]
 * is usually row-major (N-major): planned as given, the projection ran on
 * mma.sync (docs/PERF.md, "PEER: overlap and projection"). When
 * the plan as given is not the Hopper kernel but one with a K-major copy of
 * a 16-bit Wq is, each run first transposes Wq into the workspace
 * (peer_transpose16: 4 MiB at the acceptance shape) and multiplies by the
 * copy (wq_t). The same GEMM on the same values either way; only the
 * kernel (and so the order of its f32 sums) differs. */
static smelt_status plan_projection(smelt_ctx *ctx, const smelt__peer_state *ps, smelt__peer_cuda *pc) {
  const smelt_device_info *dev = &ctx->cuda->info;
  const smelt_tensor *x = &ps->t[SMELT__PT_X], *wq = &ps->t[SMELT__PT_WQ];
  const smelt_tensor *bq = ps->t[SMELT__PT_BQ].ndim >= 0 ? &ps->t[SMELT__PT_BQ] : NULL;
  const int64_t hd = ps->h * ps->dq;
  void *q, *wt;
  smelt_status s = smelt__cuda_alloc(ctx, (size_t)(ps->T * hd) * 4, &q);
  if (s) return s;
  smelt_tensor qt = smelt__peer_dev_tensor(ctx, q, SMELT_DTYPE_F32, ps->T, hd);
  s = smelt_gemm_plan(ctx, NULL, x, wq, NULL, &qt, bq, &pc->gemm_q);
  const int try_t = !s && !hopper_gemm(pc->gemm_q) && dev->cc_major == 9 && dev->cc_minor == 0 &&
                    (wq->dtype == SMELT_DTYPE_BF16 || wq->dtype == SMELT_DTYPE_F16) && x->dtype == wq->dtype &&
                    (ps->din + 63) / 64 <= 65535;
  if (try_t && !(s = smelt__cuda_alloc(ctx, (size_t)(ps->din * hd) * 2, &wt))) {
    smelt_tensor wtt = smelt__peer_dev_tensor(ctx, wt, wq->dtype, ps->din, hd);
    wtt.strides[0] = 1;
    wtt.strides[1] = ps->din;
    /* From 2048 tokens the 128 x 128 tiles (ping-pong warpgroups): twice
     * the 128 x 256 tiles the GEMM's heuristic takes, so fewer SMs idle in
     * the last wave (measured by the GEMM's autotuner: docs/PERF.md, "PEER:
     * overlap and projection"). Else, or where
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

/* ---------------------------------------------------------------- plan */

static void peer_cuda_free(void *p) {
  smelt__peer_cuda *pc = (smelt__peer_cuda *)p;
  if (!pc) return;
  smelt_plan_destroy(pc->gemm_q);
  smelt_plan_destroy(pc->gemm_dx);
  smelt_plan_destroy(pc->gemm_dwq);
  free(pc);
}

static int facts_code(const smelt__peer_facts *f) { return f->wide | f->x16 << 1 | f->x4 << 2; }

/* The routing kernels' shared memory on whole tiles (reg's family). */
static unsigned route_smem(const smelt__peer_state *ps) {
  const int64_t ds = ((ps->dsub + 15) & ~(int64_t)15) + 8;
  return (unsigned)(SMELT__PEER_SMEM_ROUTE + SMELT__PEER_SMEM_ROUTE_DS * ds);
}

/* Selects and loads the variant for facts f (pc->v[facts_code(f)]). */
static smelt_status select_variant(smelt_ctx *ctx, const smelt__peer_state *ps, smelt__peer_cuda *pc,
                                   const smelt__peer_facts *f, int fused_auto) {
  smelt__peer_variant *v = &pc->v[facts_code(f)];
  smelt_status s = choose(ctx, ps, pc, f, route_smem(ps), fused_auto, v);
  if (!s) s = load(ctx, v);
  if (s) memset(v, 0, sizeof *v);
  return s;
}

smelt_status smelt__peer_variant_for(smelt_plan *plan, const smelt_peer_weights *w, const smelt_tensor *x,
                                     const smelt__peer_variant **out) {
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  smelt__peer_cuda *pc = (smelt__peer_cuda *)ps->cuda;
  const smelt__peer_variant *planned = &pc->v[pc->planned];
  smelt__peer_facts f = planned->facts;
  f.wide = f.wide && (ps->store || (aligned16(w->u->data) && aligned16(w->v->data)));
  if (x) {
    f.x16 = aligned16(x->data);
    f.x4 = ((uintptr_t)x->data & 3) == 0;
  }
  if (planned->facts.wide && !f.wide && ps->he > 32)
    return smelt__error(SMELT_STATUS_MISALIGNED,
                        OP ": u.data=%p and v.data=%p must be 16-byte aligned as planned (expert_hidden_size=%lld > 32 "
                           "has no scalar kernel)",
                        w->u->data, w->v->data, (long long)ps->he);
  smelt_status s = SMELT_OK;
  if (!pc->v[facts_code(&f)].fwd.name) s = select_variant(plan->ctx, ps, pc, &f, ev_has8(planned));
  *out = &pc->v[facts_code(&f)];
  return s;
}

/* f64 tensors are the CPU backend's alone. */
static smelt_status check_not_f64(int role, smelt_dtype dt) {
  if (dt == SMELT_DTYPE_F64)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, OP ": %s.dtype=f64 is CPU-only (CUDA: f32, f16, bf16)",
                        smelt__family_peer.roles[role].name);
  return SMELT_OK;
}

static smelt_status plan_peer(smelt_plan *plan, const void *args) {
  (void)args;
  smelt__peer_state *ps = (smelt__peer_state *)plan->opdata;
  smelt_ctx *ctx = plan->ctx;
  const smelt_device_info *dev = &ctx->cuda->info;
  smelt_status s;
  for (int r = 0; r < SMELT__PT_COUNT; r++)
    if (ps->t[r].ndim >= 0 && (s = check_not_f64(r, ps->t[r].dtype))) return s;
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
  const smelt_tensor *u = &ps->t[SMELT__PT_U], *v = &ps->t[SMELT__PT_V], *x = &ps->t[SMELT__PT_X];
  const smelt_dtype wdt = ps->store ? ps->store->dtype : u->dtype;
  const int V = vec_of(wdt);
  const int wide = ps->din % V == 0 && ps->dout % V == 0 && ps->he <= 32 * V &&
                   (ps->store || (aligned16(u->data) && aligned16(v->data)));
  if (!wide && ps->he > 32)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": expert_hidden_size=%lld > 32 needs 16-byte expert rows on CUDA: input_dim=%lld and "
                           "output_dim=%lld multiples of %d and 16-byte aligned u, v (and h_e <= %d)",
                        (long long)ps->he, (long long)ps->din, (long long)ps->dout, V, 32 * V);
  smelt__peer_cuda *pc = (smelt__peer_cuda *)calloc(1, sizeof *pc);
  if (!pc) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, OP ": out of host memory");
  ps->cuda = pc;
  ps->cuda_free = peer_cuda_free;
  pc->rbwd_smem = (unsigned)(SMELT__PEER_SMEM_RBWD_DQ * ps->dq + SMELT__PEER_SMEM_RBWD);
  const unsigned rneed = route_smem(ps) > pc->rbwd_smem ? route_smem(ps) : pc->rbwd_smem;
  if (rneed > (unsigned)dev->smem_per_block_optin)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        OP ": query_dim=%lld (%lld per product-key dim) needs %u bytes of shared memory per CTA; the "
                           "device allows %d",
                        (long long)ps->dq, (long long)ps->dsub, rneed, dev->smem_per_block_optin);
  smelt__kernel_src src;
  smelt__peer_route_src(&src);
  if ((s = smelt__cuda_function(ctx, &src, "peer_rescore", &pc->rescore)) ||
      (s = smelt__cuda_function(ctx, &src, "peer_route_bwd", &pc->route_bwd)) ||
      (s = smelt__cuda_function(ctx, &src, "peer_dkeys", &pc->dkeys)) || (s = smelt__peer_util_load(ctx, &pc->util)))
    return s;
  if (ps->T > 0 && (s = plan_projection(ctx, ps, pc))) return s;
  const smelt__peer_facts f = {wide, aligned16(x->data), ((uintptr_t)x->data & 3) == 0};
  pc->planned = facts_code(&f);
  if ((s = select_variant(ctx, ps, pc, &f, -1))) return s;
  describe(plan, ps, pc, &pc->v[pc->planned]);
  return SMELT_OK;
}

/* A run's tensors the plan did not see (outputs, dy) may not be f64
 * either; then the run launches the variant for its pointers. A
 * retrieval or forward of no tokens has nothing to launch; the backward's
 * dense expert gradients are zeros even then. */
static smelt_status run_peer(smelt_plan *plan, const void *args) {
  const smelt__peer_args *a = (const smelt__peer_args *)args;
  const smelt__peer_state *ps = (const smelt__peer_state *)plan->opdata;
  const smelt_tensor *const *t = a->t;
  const int bwd = a->mode == SMELT__PEER_BACKWARD;
  smelt_status s;
  for (int r = SMELT__PT_COUNT; r < SMELT__PT_ROLES; r++)
    if (t[r] && (s = check_not_f64(r, t[r]->dtype))) return s;
  if (!bwd && ps->T == 0) return SMELT_OK;
  const smelt__peer_variant *v;
  if ((s = smelt__peer_variant_for(plan, a->w, bwd ? NULL : t[SMELT__PT_X], &v))) return s;
  switch (a->mode) {
    case SMELT__PEER_RETRIEVE:
      return smelt__cuda_peer_retrieve(plan, v, a->w, t[SMELT__PT_X], t[SMELT__PT_IDS], t[SMELT__PT_SCORES]);
    case SMELT__PEER_FORWARD:
      return smelt__cuda_peer_forward(plan, v, a->w, t[SMELT__PT_X], t[SMELT__PT_Y], t[SMELT__PT_IDS],
                                      t[SMELT__PT_SCORES]);
    default:
      return smelt__cuda_peer_backward(plan, v, a->w, t[SMELT__PT_X], t[SMELT__PT_IDS_IN], t[SMELT__PT_DY], a->g);
  }
}

const smelt__backend smelt__cuda_peer = {.plan = plan_peer, .run = run_peer};
