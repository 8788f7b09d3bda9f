/* The MoE layer's forward for the decode step on CUDA: three launches
 * (kernels/moe_decode.cu: routing, then the up and the down projection as
 * GEMVs that stream the chosen experts' weights) in place of the general
 * path's router GEMM, routing, ranking, copy, grouped GEMMs, SwiGLU and
 * combine, whose launches and gaps cost about as much as a fifth of the
 * T = 1 step's weight reads (docs/PERF.md, MoE).
 *
 * When it runs (the rule, decided per plan and checked per run):
 *   - at most MAX_ROWS assignments (T·k <= 16) and at least one token;
 *   - E <= 64 (the routing warp's two experts a lane);
 *   - SwiGLU, no noisy top-k, no capacity (nothing to drop), and no aux
 *     losses asked of the run (the decode step does not train);
 *   - Wr, W1, W3 and W2 of x's dtype, d and F whole 16-byte units of it,
 *     and W1, W3, W2 16-byte aligned in the run.
 * Everything else, the saved forward and the backward keep the general
 * path. The routing is the router's own selection code on logits summed
 * in another order (so ids agree with the CPU reference but at near-ties,
 * as the general path's do); h is kept in f32 and y rounded once.
 *
 * The split of K: each GEMV gets about two waves of CTAs at the T = 1
 * count of groups (k), slices of at most MAX_SLICE rows; the slices are
 * fixed by the config alone, so a token's output does not depend on the
 * rest of its batch. */
#include "moe_cuda.h"

#include <stdio.h>
#include <string.h>

/* kernels/moe_decode.cu's MAXR, THREADS, CT, MAX_SLICE, ROUTE_THREADS,
 * its occupancy (CTAs an SM, by rows a group) and its meta's ints. */
#define MAX_ROWS 16
#define THREADS 256
#define CT 8
#define MAX_SLICE 2048
#define ROUTE_THREADS 512
#define META_INTS (1 + 3 * MAX_ROWS + 2 * MAX_ROWS)
#define MAX_E 64

static const smelt_dtype dec_dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
static const int dec_rows[] = {1, 4};

/* The one place a variant's source is made (plan and enumerator). */
static void make_src(smelt_dtype dt, int rows, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "moe_decode_%s_r%d", smelt_dtype_name(dt), rows);
  src->body = "moe_decode.cu";
  smelt__prelude_define(src, "SMELT_DT", dt);
  smelt__prelude_define(src, "MOE_ITEMS", 2);
  smelt__prelude_define(src, "MOE_ROWS", rows);
}

int smelt__moe_decode_variants(smelt__kernel_src *out, int max) {
  const int nd = (int)(sizeof dec_dtypes / sizeof *dec_dtypes), nr = (int)(sizeof dec_rows / sizeof *dec_rows);
  for (int v = 0; v < nd * nr && v < max; v++) make_src(dec_dtypes[v / nr], dec_rows[v % nr], &out[v]);
  return nd * nr;
}

/* The rule's parts that the plan fixes. */
static int plan_fits(const smelt__moe_state *ms) {
  const smelt_dtype xdt = ms->t[SMELT__MT_X].dtype;
  const int64_t unit = 16 / (int64_t)smelt_dtype_size(xdt);
  if (ms->T < 1 || ms->rows > MAX_ROWS || ms->E > MAX_E || ms->cfg.ffn != SMELT_MOE_FFN_SWIGLU ||
      ms->t[SMELT__MT_W1].ndim < 0 || ms->t[SMELT__MT_WNOISE].ndim >= 0 || ms->capacity >= 0)
    return 0;
  const int roles[] = {SMELT__MT_WR, SMELT__MT_W1, SMELT__MT_W3, SMELT__MT_W2};
  for (size_t i = 0; i < sizeof roles / sizeof *roles; i++)
    if (ms->t[roles[i]].dtype != xdt) return 0;
  return ms->d % unit == 0 && ms->F % unit == 0;
}

/* Slices of K rows for a GEMV of `tiles` column tiles: about two waves of
 * CTAs (`occ` an SM) at k groups, at most MAX_SLICE rows, at least 256
 * (a thread's batches), a multiple of 32 (the K lanes). */
static void split_k(int64_t K, int64_t tiles, int64_t k, int64_t sms, int occ, int *splits, int *slice) {
  int64_t s = smelt__ceil_div(2 * sms * occ, tiles * k);
  const int64_t most = K / 256 > 1 ? K / 256 : 1, least = smelt__ceil_div(K, MAX_SLICE);
  s = s > most ? most : s;
  s = s < least ? least : s;
  const int64_t len = smelt__ceil_div(smelt__ceil_div(K, s), 32) * 32;
  *slice = (int)len;
  *splits = (int)smelt__ceil_div(K, len);
}

smelt_status smelt__moe_decode_plan(smelt_ctx *ctx, const smelt__moe_state *ms, smelt__moe_decode_cuda *dc) {
  memset(dc, 0, sizeof *dc);
  if (!plan_fits(ms)) return SMELT_OK;
  dc->rows = ms->T == 1 ? 1 : 4;
  smelt__kernel_src src;
  make_src(ms->t[SMELT__MT_X].dtype, dc->rows, &src);
  smelt_status s;
  if ((s = smelt__cuda_function(ctx, &src, "moe_decode_route", &dc->route)) ||
      (s = smelt__cuda_function(ctx, &src, "moe_decode_up", &dc->up)) ||
      (s = smelt__cuda_function(ctx, &src, "moe_decode_down", &dc->down)))
    return s;
  const int occ = dc->rows == 1 ? 3 : 2;
  dc->tile = CT * 16 / (int)smelt_dtype_size(ms->t[SMELT__MT_X].dtype);
  dc->up_tiles = (int)smelt__ceil_div(ms->F, dc->tile);
  dc->down_tiles = (int)smelt__ceil_div(ms->d, dc->tile);
  const int64_t sms = ctx->cuda->info.sm_count;
  split_k(ms->d, dc->up_tiles, ms->k, sms, occ, &dc->up_splits, &dc->up_slice);
  split_k(ms->F, dc->down_tiles, ms->k, sms, occ, &dc->down_splits, &dc->down_slice);
  return SMELT_OK;
}

int smelt__moe_decode_fits(const smelt__moe_decode_cuda *dc, const smelt_tensor *const *t) {
  if (!dc->route || t[SMELT__MT_AUX]) return 0;
  const int roles[] = {SMELT__MT_W1, SMELT__MT_W3, SMELT__MT_W2};
  for (size_t i = 0; i < sizeof roles / sizeof *roles; i++)
    if ((uintptr_t)t[roles[i]]->data % 16) return 0;
  return 1;
}

/* A launch of the GEMVs: on sm_90 as the dependent of the kernel before. */
static smelt_status launch_gemv(smelt_ctx *ctx, CUfunction f, unsigned grid, void **params) {
  const char *op = MOE_OP "_forward_run";
  if (ctx->cuda->info.cc_major >= 9) return smelt__cuda_launch_dependent(ctx, op, f, grid, THREADS, 0, params);
  return smelt__cuda_launch(ctx, op, f, grid, 1, 1, THREADS, 0, params);
}

/* The workspace: meta, h [T·k, F] f32, the up and down projections'
 * partial sums, their tickets. */
typedef struct dec_ws {
  int *meta, *tickets;
  float *h, *up_part, *down_part;
} dec_ws;

static size_t ws_layout(const smelt__moe_state *ms, const smelt__moe_decode_cuda *dc, char *base, dec_ws *w) {
  const int64_t gmax = ms->rows, rt = (int64_t)dc->rows * dc->tile;
  const size_t sizes[5] = {
      smelt__moe_block_bytes(META_INTS, 4),
      smelt__moe_block_bytes(ms->rows * ms->F, 4),
      dc->up_splits > 1 ? smelt__moe_block_bytes(gmax * dc->up_splits * dc->up_tiles * 2 * rt, 4) : 0,
      smelt__moe_block_bytes(gmax * dc->down_splits * dc->down_tiles * rt, 4),
      smelt__moe_block_bytes(gmax * dc->up_tiles + dc->down_tiles, 4),
  };
  size_t at[5], total = 0;
  for (int i = 0; i < 5; i++) at[i] = total, total += sizes[i];
  if (w) {
    w->meta = (int *)(base + at[0]);
    w->h = (float *)(base + at[1]);
    w->up_part = (float *)(base + at[2]);
    w->down_part = (float *)(base + at[3]);
    w->tickets = (int *)(base + at[4]);
  }
  return total;
}

smelt_status smelt__moe_decode_forward(smelt_ctx *ctx, const smelt__moe_state *ms, const smelt__moe_decode_cuda *dc,
                                       const smelt_tensor *const *t) {
  char *base = NULL;
  smelt_status s = smelt__cuda_alloc(ctx, ws_layout(ms, dc, NULL, NULL), (void **)&base);
  if (s) return s;
  dec_ws w;
  ws_layout(ms, dc, base, &w);
  const smelt_tensor *x = t[SMELT__MT_X], *y = t[SMELT__MT_Y], *dr = t[SMELT__MT_DROPPED];
  const void *xd = x->data, *wr = t[SMELT__MT_WR]->data, *w1 = t[SMELT__MT_W1]->data, *w3 = t[SMELT__MT_W3]->data,
             *w2 = t[SMELT__MT_W2]->data, *bias = t[SMELT__MT_BIAS] ? t[SMELT__MT_BIAS]->data : NULL;
  void *logits = t[SMELT__MT_LOGITS]->data, *ids = t[SMELT__MT_IDS]->data, *wts = t[SMELT__MT_WEIGHTS]->data,
       *counts = t[SMELT__MT_COUNTS]->data, *offs = t[SMELT__MT_OFFSETS]->data, *drop = dr ? dr->data : NULL,
       *rm = t[SMELT__MT_ROW_MAP]->data, *yd = y->data, *meta = w.meta, *h = w.h, *up_part = w.up_part,
       *down_part = w.down_part, *up_tickets = w.tickets, *down_tickets = w.tickets + ms->rows * dc->up_tiles;
  int64_t xs = x->strides[0], ys = y->strides[0];
  int c64 = t[SMELT__MT_COUNTS]->dtype == SMELT_DTYPE_I64, o64 = t[SMELT__MT_OFFSETS]->dtype == SMELT_DTYPE_I64,
      d64 = dr && dr->dtype == SMELT_DTYPE_I64;
  int T = (int)ms->T, d = (int)ms->d, E = (int)ms->E, k = (int)ms->k, F = (int)ms->F;
  int n_tickets = (int)(ms->rows * dc->up_tiles + dc->down_tiles), sig = ms->cfg.score == SMELT_MOE_SCORE_SIGMOID;
  int renorm = ms->cfg.renormalize, groups = (int)ms->cfg.num_groups, tg = (int)ms->cfg.topk_groups;
  int vw = 16 / (int)smelt_dtype_size(x->dtype), wr_vec = E % vw == 0 && (uintptr_t)wr % 16 == 0;
  float scaling = (float)ms->cfg.scaling_factor;
  int up_tiles = dc->up_tiles, up_splits = dc->up_splits, up_slice = dc->up_slice;
  int down_tiles = dc->down_tiles, down_splits = dc->down_splits, down_slice = dc->down_slice;
  void *p_route[] = {&xd,   &xs,  &wr,   &wr_vec, &bias, &logits,    &ids, &wts, &counts, &c64, &offs, &o64, &drop,
                     &d64,  &rm,  &meta, &up_tickets, &n_tickets, &T, &d,   &E,   &k,      &sig, &renorm, &scaling,
                     &groups, &tg};
  void *p_up[] = {&xd, &xs, &w1, &w3, &meta, &h, &up_part, &up_tickets, &d, &F, &up_tiles, &up_splits, &up_slice};
  void *p_down[] = {&h,    &w2, &meta, &rm, &wts, &yd, &ys, &down_part, &down_tickets, &T, &k, &d, &F, &down_tiles,
                    &down_splits, &down_slice};
  const unsigned groups_max = (unsigned)ms->rows;
  if (!(s = smelt__cuda_launch(ctx, MOE_OP "_forward_run", dc->route, 1, 1, 1, ROUTE_THREADS, 0, p_route)) &&
      !(s = launch_gemv(ctx, dc->up, groups_max * (unsigned)(up_splits * up_tiles), p_up)))
    s = launch_gemv(ctx, dc->down, groups_max * (unsigned)(down_splits * down_tiles), p_down);
  smelt_status f = smelt__cuda_free(ctx, base);
  return s ? s : f;
}
