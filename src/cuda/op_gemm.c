/* smelt_gemm on CUDA: plan (pick the kernel, decide split-K, load the
 * modules) and run (fill the launch parameters, take workspace from the
 * context's pool, launch).
 *
 * Modes map onto one launch of the main kernel, whose blocks find their work
 * from the grid (kernels/gemm_common.cuh, gemm_locate):
 *   plain       grid (tiles, 1, 1)
 *   batched     grid (tiles, 1, L), z = the batch (in chunks of 65535)
 *   array       grid (tiles, 1, count), pointers from the device arrays
 *   split-K     grid (tiles, 1, slices); serial: one M x N workspace and one
 *               semaphore per tile; parallel: slices x M x N partial sums,
 *               then gemm_reduce
 *   grouped     grid (total tiles of all groups): the host lists the
 *               problems and each group's first tile (host scheduling), and
 *               each block finds its group by binary search.
 *   grouped by offsets  grid ((ceil(T / BM) + G) x tiles along N), an
 *               upper bound the host knows without reading the offsets;
 *               each block finds its group and tile from the device
 *               offsets (gemm_locate_offs) or exits (device scheduling);
 *               on Hopper, persistent CTAs walk the tiles of all groups
 *               from the offsets and stop past the last group's.
 * A run whose operands do not fit the planned kernel (a less aligned pointer,
 * a group with other strides) takes the selector's choice for them instead,
 * loaded once and kept in the plan. */
#include "gemm_cuda.h"
#include "gemm_tune.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { F_MAIN, F_REDUCE, F_PREP, F_EPI };

/* Split-K for a plain GEMM with few output tiles and a long K: enough slices
 * to give every SM work, each at least 1024 deep, at most 16. */
static int choose_split(const smelt__gemm_kernel *k, int64_t m, int64_t n, int64_t kk, int sm_count) {
  const int64_t tiles = smelt__ceil_div(m, k->bm) * smelt__ceil_div(n, k->bn);
  if (tiles == 0 || 2 * tiles > sm_count || kk < 2048) return 1;
  int64_t s = sm_count / tiles;
  if (s > kk / 1024) s = kk / 1024;
  if (s > 16) s = 16;
  return s < 2 ? 1 : (int)s;
}

int smelt__gemm_sm90_auto_split(const smelt__gemm_state *st, const smelt__gemm_kernel *k, const smelt__gemm_facts *f,
                                int sm_count) {
  if (8 * smelt__ceil_div(f->m, k->bm) * smelt__ceil_div(f->n, k->bn) > sm_count) return 1;
  smelt__gemm_state split = *st;
  split.mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
  return smelt__gemm_fits(k, &split, f) ? choose_split(k, f->m, f->n, f->k, sm_count) : 1;
}

/* K per slice: a whole number of the kernel's K tiles. */
static int64_t k_slice_of(const smelt__gemm_kernel *k, int64_t kk, int splits) {
  int64_t s = smelt__ceil_div(smelt__ceil_div(kk, splits), k->bk) * k->bk;
  return s > 0 ? s : k->bk;
}

static smelt_status load(smelt_ctx *ctx, const smelt__gemm_state *st, const smelt__gemm_kernel *k, void **func) {
  smelt__kernel_src src;
  smelt__gemm_src_for(st, k, &src);
  CUfunction f;
  static const char *const entry[] = {[SMELT__GK_SIMT] = "gemm_simt", [SMELT__GK_SM80] = "gemm_tc",
                                      [SMELT__GK_SM90] = "gemm_sm90", [SMELT__GK_REDUCE] = "gemm_reduce",
                                      [SMELT__GK_GEMV] = "gemm_gemv"};
  smelt_status s = smelt__cuda_function(ctx, &src, entry[k->fam], &f);
  if (!s) *func = f;
  return s;
}

/* Bytes of alignment of a pointer, up to 16 (all a kernel asks for). */
static int ptr_align(const void *p) {
  const uintptr_t bits = (uintptr_t)p | 16;
  return (int)(bits & (~bits + 1));
}

/* Hopper with the operand pre-pass (smelt__gemm_prep_choose): the main
 * kernel is the selector's Hopper choice for the prepped operands, a plain
 * GEMM (a batched one runs as one per entry) without split or tuning
 * record (a record could name the Hopper kernel without the pre-pass,
 * which truncates). Returns 0 (and clears cp->prep) when the selector
 * gives them no Hopper kernel, e.g. for a tile only mma.sync has or a
 * problem too small for the wide tf32 tile: the plan then goes on with the
 * operands as they are. */
static int plan_prepped(smelt_plan *plan, const smelt__gemm_args *args, const smelt__gemm_facts *f,
                        const smelt__gemm_kernel *table, int n, smelt_status *s) {
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  smelt__gemm_cuda_plan *cp = (smelt__gemm_cuda_plan *)plan->backend;
  smelt__gemm_state ps;
  smelt__gemm_facts pf;
  smelt__gemm_prep_facts(st, &args->prob, f, cp->prep, &ps, &pf);
  char why[96];
  int ki;
  if (smelt__gemm_select(&ps, &pf, &plan->ctx->cuda->info, table, n, &ki, why, sizeof why) != SMELT_OK ||
      table[ki].fam != SMELT__GK_SM90) {
    cp->prep[0] = cp->prep[1] = SMELT__PREP_NONE;
    return 0;
  }
  cp->mode = st->mode; /* plain or batched, run one problem at a time */
  cp->split_k = 1;
  cp->kernel = ki;
  cp->fallback = -1;
  cp->align[0] = ptr_align(args->prob.a.data);
  cp->align[1] = ptr_align(args->prob.b.data);
  cp->align[2] = ptr_align(args->prob.d.data);
  CUfunction prep;
  if ((*s = load(plan->ctx, st, &table[ki], &plan->func[F_MAIN])) ||
      (*s = smelt__gemm_prep_load(plan->ctx, cp->prep, &prep)))
    return 1;
  plan->func[F_PREP] = prep;
  plan->variant = ki;
  plan->block = table[ki].threads;
  smelt__kernel_src src;
  smelt__gemm_kernel_src(&table[ki], &src);
  static const char *const what[] = {"", "K-major copy", "tf32 rounding", "3xtf32 split", "128-byte row copy"};
  snprintf(plan->describe, sizeof plan->describe, "%.60s (%.40s; pre-pass: A %s, B %s)", src.name, why,
           cp->prep[0] ? what[cp->prep[0]] : "none", cp->prep[1] ? what[cp->prep[1]] : "none");
  return 1;
}

/* An epilogue graph: its code must fit the prelude of any kernel the plan
 * may load (smelt__gemm_src_for relies on it), and the reductions' second
 * pass is loaded. */
static smelt_status plan_graph(smelt_plan *plan, const smelt__gemm_kernel *table, int n) {
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  smelt__kernel_src src;
  smelt_dtype dt[SMELT_EPI_MAX_TENSORS];
  for (int s = 0; s < SMELT_EPI_MAX_TENSORS; s++) dt[s] = st->epi_t[s].dtype;
  for (int i = 0; i < n; i++)
    if (smelt__gemm_graph_src(&table[i], &st->graph, dt, &src))
      return smelt__error(SMELT_STATUS_UNSUPPORTED,
                          "smelt_gemm: the epilogue graph's code (%d nodes) is too long for a kernel's prelude",
                          st->graph.count);
  smelt__gemm_epi_reduce_src(&src);
  CUfunction f;
  smelt_status s = smelt__cuda_function(plan->ctx, &src, "gemm_epi_reduce", &f);
  if (!s) plan->func[F_EPI] = f;
  return s;
}

static smelt_status plan_gemm(smelt_plan *plan, const void *run_args) {
  const smelt__gemm_args *args = (const smelt__gemm_args *)run_args;
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  const smelt_device_info *dev = &plan->ctx->cuda->info;
  smelt__gemm_cuda_plan *cp = (smelt__gemm_cuda_plan *)calloc(1, sizeof *cp);
  if (!cp) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_gemm: out of host memory");
  plan->backend = cp;
  plan->backend_free = free;
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int n = smelt__gemm_table(table);
  smelt_status gs = st->has_graph ? plan_graph(plan, table, n) : SMELT_OK;
  if (gs) return gs;
  smelt__gemm_facts f;
  smelt__gemm_facts_of(st, args, &f);
  smelt_status s = SMELT_OK;
  if (smelt__gemm_prep_choose(st, &args->prob, &f, dev, cp->prep) && plan_prepped(plan, args, &f, table, n, &s))
    return s;
  char why[96];
  int ki;
  s = smelt__gemm_select(st, &f, dev, table, n, &ki, why, sizeof why);
  if (s) return s;
  /* A tuning record (src/cuda/gemm_tune.c) may name a faster kernel and
   * split; grouped by offsets is not tuned (as host-scheduled grouped runs
   * are not), nor are block scales (one kernel). */
  const int tuned_split = st->mode == SMELT_GEMM_MODE_GROUPED_OFFS || st->blk
                              ? 0
                              : smelt__gemm_tune_choice(st, &f, dev, table, n, &ki, why, sizeof why);
  const smelt__gemm_kernel *k = &table[ki];
  const int split_mode = st->mode == SMELT_GEMM_MODE_SPLIT_K_SERIAL || st->mode == SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
  cp->mode = st->mode;
  cp->split_k = st->split_k;
  if (cp->split_k == 0) {
    /* AUTO left it open (a plain GEMM may become a parallel split) or a
     * split mode asked us to choose (a tuning record's split comes first).
     * The persistent Hopper kernel splits by itself only when its tiles
     * would busy at most an eighth of the SMs (a MoE router's logits, 1 x 8
     * x 4096: 26.7 -> 13.5 us in 4 slices); a skinny M on 64 SMs in two or
     * four slices plus gemm_reduce ran slower than unsplit (docs/PERF.md,
     * GEMM: decisions, third round); a split mode asked for gets
     * choose_split's slices. */
    cp->split_k = tuned_split                                 ? tuned_split
                  : k->fam == SMELT__GK_SM90 && !split_mode ? smelt__gemm_sm90_auto_split(st, k, &f, dev->sm_count)
                                                            : choose_split(k, f.m, f.n, f.k, dev->sm_count);
    if (!split_mode && cp->split_k > 1) cp->mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
  }
  cp->kernel = ki;
  cp->fallback = -1;
  cp->align[0] = ptr_align(args->prob.a.data);
  cp->align[1] = ptr_align(args->prob.b.data);
  cp->align[2] = ptr_align(args->prob.d.data);
  if ((s = load(plan->ctx, st, k, &plan->func[F_MAIN]))) return s;
  if (cp->mode == SMELT_GEMM_MODE_SPLIT_K_PARALLEL) {
    int r = smelt__gemm_reduce_kernel(table, n, st->acc);
    if ((s = load(plan->ctx, st, &table[r], &plan->func[F_REDUCE]))) return s;
  }
  plan->variant = ki;
  plan->block = k->threads;
  smelt__kernel_src src;
  smelt__gemm_kernel_src(k, &src);
  char split[32] = "";
  if (cp->split_k > 1)
    snprintf(split, sizeof split, ", split-K %s %d", cp->mode == SMELT_GEMM_MODE_SPLIT_K_SERIAL ? "serial" : "parallel",
             cp->split_k);
  snprintf(plan->describe, sizeof plan->describe, "%.60s (%.64s%s)", src.name, why, split);
  return SMELT_OK;
}

static void kprob_of(smelt__gemm_kprob *kp, const smelt__gemm_prob *p) {
  kp->m = p->m;
  kp->n = p->n;
  kp->k = p->k;
  kp->a = (uint64_t)(uintptr_t)p->a.data;
  kp->b = (uint64_t)(uintptr_t)p->b.data;
  kp->c = (uint64_t)(uintptr_t)p->c.data;
  kp->d = (uint64_t)(uintptr_t)p->d.data;
  kp->bias = (uint64_t)(uintptr_t)p->bias;
  kp->a_rs = p->a.rs;
  kp->a_cs = p->a.cs;
  kp->b_rs = p->b.rs;
  kp->b_cs = p->b.cs;
  kp->c_rs = p->c.rs;
  kp->c_cs = p->c.cs;
  kp->d_rs = p->d.rs;
  kp->d_cs = p->d.cs;
  kp->bias_s = p->bias_s;
  kp->sa = (uint64_t)(uintptr_t)p->sa;
  kp->sb = (uint64_t)(uintptr_t)p->sb;
  kp->sa_s = p->sa_s;
  kp->sb_s = p->sb_s;
}

/* The kernel to run these operands with: the planned one when the run's
 * pointers are as aligned as the planned ones (everything else about the
 * operands was checked equal to the plan), else the planned one if they
 * still fit it, else the selector's choice for them through the same table
 * (loaded once, kept in the plan). Grouped runs bring new operands each
 * time, so theirs are always looked at. */
static smelt_status pick(smelt_plan *plan, const smelt__gemm_kernel *table, int n, const smelt__gemm_args *args,
                         int *ki, CUfunction *main) {
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  smelt__gemm_cuda_plan *cp = (smelt__gemm_cuda_plan *)plan->backend;
  *ki = cp->kernel;
  *main = (CUfunction)plan->func[F_MAIN];
  /* Prepped operands live in a workspace of the kernel's layout. */
  if (cp->prep[0] || cp->prep[1]) return SMELT_OK;
  if (st->mode != SMELT_GEMM_MODE_GROUPED && ptr_align(args->prob.a.data) >= cp->align[0] &&
      ptr_align(args->prob.b.data) >= cp->align[1] && ptr_align(args->prob.d.data) >= cp->align[2])
    return SMELT_OK;
  /* The selector sees the state as the plan decided it. */
  smelt__gemm_state decided = *st;
  decided.mode = cp->mode;
  decided.split_k = cp->split_k;
  smelt__gemm_facts f;
  smelt__gemm_facts_of(&decided, args, &f);
  if (smelt__gemm_fits(&table[cp->kernel], &decided, &f)) return SMELT_OK;
  if (cp->fallback < 0 || !smelt__gemm_fits(&table[cp->fallback], &decided, &f)) {
    char why[96];
    int fb;
    smelt_status s = smelt__gemm_select(&decided, &f, &plan->ctx->cuda->info, table, n, &fb, why, sizeof why);
    if (s) return s;
    if ((s = load(plan->ctx, st, &table[fb], &cp->fallback_func))) return s;
    cp->fallback = fb;
    smelt__log(SMELT__LOG_INFO, "smelt_gemm: operands do not fit %s's kernel; using table entry %d (%s)",
               plan->describe, fb, why);
  }
  *ki = cp->fallback;
  *main = (CUfunction)cp->fallback_func;
  return SMELT_OK;
}

static size_t ws_size(smelt_gemm_acc acc) { return acc == SMELT_GEMM_ACC_F64 ? 8 : 4; }

/* A 2-D tensor map over a K-major operand (or a row-major D, with k its
 * columns; or an MN-major operand, with K its rows and M or N its k):
 * rows x k elements, rows `rs` elements apart, boxes of box_rows x bk (bk
 * elements are 128 bytes) with the 128-byte swizzle. With batch >= 1, a
 * 3-D map of `batch` such matrices `bs` elements apart, boxes of one
 * matrix's box_rows x bk. */
smelt_status smelt__gemm_tensor_map_batched(smelt__cu_tensor_map *map, smelt_dtype dt, const void *data, int64_t rows,
                                            int64_t k, int64_t rs, int64_t batch, int64_t bs, int box_rows, int bk) {
  const uint64_t es = smelt_dtype_size(dt);
  /* With one row the stride is never used; TMA still wants a valid one.
   * So with one matrix: the batch stride. */
  uint64_t stride = rows > 1 ? (uint64_t)rs * es : ((uint64_t)k * es + 15) / 16 * 16;
  const uint64_t dims[3] = {(uint64_t)k, (uint64_t)rows, (uint64_t)batch},
                 strides[2] = {stride, batch > 1 ? (uint64_t)bs * es : stride * (uint64_t)rows};
  const unsigned box[3] = {(unsigned)bk, (unsigned)box_rows, 1}, ones[3] = {1, 1, 1};
  /* fp8 travels as bytes and f32 (tf32 math) as f32: TMA copies bits, the
   * wgmma reads them as its types. */
  const int tdt = dt == SMELT_DTYPE_BF16  ? SMELT__TMA_BF16
                  : dt == SMELT_DTYPE_F16 ? SMELT__TMA_F16
                  : dt == SMELT_DTYPE_F32 ? SMELT__TMA_F32
                                          : SMELT__TMA_U8;
  CUresult r = smelt__cu(NULL)->cuTensorMapEncodeTiled(map, tdt, batch >= 1 ? 3 : 2, (void *)data, dims, strides, box,
                                                        ones, SMELT__TMA_INTERLEAVE_NONE, SMELT__TMA_SWIZZLE_128B,
                                                        SMELT__TMA_L2_256B, SMELT__TMA_OOB_FILL_NONE);
  if (r) return smelt__cu_error(r, "smelt_gemm", "cuTensorMapEncodeTiled");
  return SMELT_OK;
}

smelt_status smelt__gemm_tensor_map(smelt__cu_tensor_map *map, smelt_dtype dt, const void *data, int64_t rows,
                                    int64_t k, int64_t rs, int box_rows, int bk) {
  return smelt__gemm_tensor_map_batched(map, dt, data, rows, k, rs, 0, 0, box_rows, bk);
}

/* The Hopper kernel's A and B maps for problem p: a K-major operand in
 * boxes of the tile's rows (a multicast operand: a cluster rank's share)
 * by one 128-byte row of K; an MN-major one (16-bit A column-major or B
 * row-major) in boxes of 64 columns of M or N (128 bytes) by BK rows of
 * K, one per panel of the stage (kernels/gemm_sm90.cu).
 * With `batch` entries (batch >= 1; 0 for a plain problem), an operand
 * with a batch stride gets a 3-D map (its entries the z), a broadcast one
 * (stride 0) a 2-D map. */
static smelt_status operand_maps(const smelt__gemm_state *st, const smelt__gemm_kernel *k,
                                         const smelt__gemm_prob *p, int64_t batch, smelt__cu_tensor_map *ta,
                                         smelt__cu_tensor_map *tb) {
  const int64_t la = p->a.bs ? batch : 0, lb = p->b.bs ? batch : 0;
  smelt_status s =
      k->a_kmajor
          ? smelt__gemm_tensor_map_batched(ta, st->dt_a, p->a.data, p->m, p->k, p->a.rs, la, p->a.bs, k->bm / k->cluster_n, k->bk)
          : smelt__gemm_tensor_map_batched(ta, st->dt_a, p->a.data, p->k, p->m, p->a.cs, la, p->a.bs, k->bk, 64);
  if (s) return s;
  return k->b_kmajor
             ? smelt__gemm_tensor_map_batched(tb, st->dt_b, p->b.data, p->n, p->k, p->b.cs, lb, p->b.bs, k->bn / k->cluster_m, k->bk)
             : smelt__gemm_tensor_map_batched(tb, st->dt_b, p->b.data, p->k, p->n, p->b.rs, lb, p->b.bs, k->bk, 64);
}

/* Hopper: output tiles of an m x n problem in units of a cluster's tiles
 * (kernels/gemm_sm90.cu walks units; one tile without clusters). */
static int64_t sm90_units(const smelt__gemm_kernel *k, int64_t m, int64_t n) {
  return smelt__ceil_div(smelt__ceil_div(m, k->bm), k->cluster_m) *
         smelt__ceil_div(smelt__ceil_div(n, k->bn), k->cluster_n);
}

/* Hopper launch: one persistent CTA per SM (or per unit, when there are
 * fewer); with clusters, as many clusters as can run at once (a cluster
 * needs its CTAs in one GPC, so that can be fewer than SMs / size). */
smelt_status smelt__gemm_sm90_launch(smelt_ctx *ctx, const char *op, const smelt__gemm_kernel *k, CUfunction f,
                                     int64_t units, void **params) {
  const int cl = k->cluster_m * k->cluster_n;
  if (cl == 1) {
    const int64_t sms = ctx->cuda->info.sm_count;
    return smelt__cuda_launch(ctx, op, f, (unsigned)(units < sms ? units : sms), 1, 1, (unsigned)k->threads,
                              (unsigned)k->smem, params);
  }
  int most;
  smelt_status s = smelt__cuda_max_clusters(ctx, op, f, (unsigned)cl, (unsigned)k->threads, (unsigned)k->smem, &most);
  if (s) return s;
  const int64_t clusters = units < most ? units : most;
  return smelt__cuda_launch_cluster(ctx, op, f, (unsigned)(clusters * cl), (unsigned)cl, (unsigned)k->threads,
                                    (unsigned)k->smem, params);
}

/* Grouped on Hopper: every group's A, B and D tensor maps (D in the fast
 * epilogue's boxes; a multicast operand in boxes of a cluster rank's
 * share), three per group in group order; groups without tiles get none
 * (their maps are never read). */
static smelt_status sm90_group_maps(const smelt__gemm_state *st, const smelt__gemm_kernel *k,
                                    const smelt__gemm_args *args, smelt__cu_tensor_map *maps) {
  for (int64_t g = 0; g < args->count; g++) {
    const smelt__gemm_prob *p = &args->groups[g];
    smelt__cu_tensor_map *m = maps + 3 * g;
    memset(m, 0, 3 * sizeof *m);
    if (p->m < 1 || p->n < 1) continue;
    smelt_status s;
    if ((s = operand_maps(st, k, p, 0, &m[0], &m[1])) ||
        (s = smelt__gemm_tensor_map(&m[2], st->dt_d, p->d.data, p->m, p->n, p->d.rs, 64, 128 / (int)smelt_dtype_size(st->dt_d))))
      return s;
  }
  return SMELT_OK;
}

smelt_status smelt__gemm_grouped_upload(smelt_ctx *ctx, const char *op, const void *host, size_t maps, int64_t count,
                                       smelt__gemm_kparams *kp, void **dev) {
  const size_t probs = (size_t)count * sizeof(smelt__gemm_kprob),
               bytes = maps + probs + (size_t)(count + 1) * sizeof(int64_t);
  smelt_status s = smelt__cuda_alloc(ctx, bytes, dev);
  if (s) return s;
  CUresult r = smelt__cu(NULL)->cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)*dev, host, bytes, ctx->cuda->stream);
  if (r) return smelt__cu_error(r, op, "uploading the problem list");
  kp->groups = (uint64_t)(uintptr_t)*dev + maps;
  kp->group_tiles = kp->groups + probs;
  kp->count = (int)count;
  return SMELT_OK;
}

/* Grouped: uploads the problem list and each group's first tile (and, for
 * the Hopper kernel, the groups' tensor maps), then one launch: a block per
 * tile, or on Hopper one persistent CTA per SM walking all the tiles. */
static smelt_status run_grouped(smelt_plan *plan, const smelt__gemm_kernel *k, CUfunction f, smelt__gemm_kparams *kp,
                                const smelt__gemm_args *args) {
  smelt_ctx *ctx = plan->ctx;
  const int64_t count = args->count;
  if (count > 0x7fffffff)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm_grouped: count=%lld exceeds 2^31 - 1", (long long)count);
  /* Device layout: the tensor maps first (they need 64-byte alignment),
   * then the problems and the first tiles. */
  const int sm90 = k->fam == SMELT__GK_SM90;
  const size_t maps = sm90 ? (size_t)count * 3 * sizeof(smelt__cu_tensor_map) : 0;
  const size_t probs = (size_t)count * sizeof(smelt__gemm_kprob), firsts = (size_t)(count + 1) * sizeof(int64_t);
  uint8_t *host = (uint8_t *)malloc(maps + probs + firsts);
  if (!host) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_gemm_grouped: out of host memory");
  smelt__gemm_kprob *kps = (smelt__gemm_kprob *)(host + maps);
  int64_t *first = (int64_t *)(host + maps + probs), total = 0;
  for (int64_t g = 0; g < count; g++) {
    kprob_of(&kps[g], &args->groups[g]);
    first[g] = total;
    /* Hopper: units (a cluster's tiles), which the kernel walks. */
    total += sm90 ? sm90_units(k, args->groups[g].m, args->groups[g].n)
                  : smelt__ceil_div(args->groups[g].m, k->bm) * smelt__ceil_div(args->groups[g].n, k->bn);
  }
  first[count] = total;
  smelt_status s = SMELT_OK;
  void *dev = NULL;
  if (total > 0x7fffffff)
    s = smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm_grouped: %lld output tiles exceed 2^31 - 1",
                     (long long)total);
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  if (!s && total > 0 && sm90) s = sm90_group_maps(st, k, args, (smelt__cu_tensor_map *)host);
  if (!s && total > 0) s = smelt__gemm_grouped_upload(ctx, "smelt_gemm_grouped", host, maps, count, kp, &dev);
  if (!s && total > 0) {
    if (sm90) {
      /* The kernel reads only the group maps; its by-value maps are unused,
       * and tiles_m carries the total unit count. */
      kp->tiles_m = (int)total;
      kp->tiles_n = 1;
      smelt__cu_tensor_map unused;
      memset(&unused, 0, sizeof unused);
      int fast = 1;
      const void *gmaps = dev;
      void *params[] = {&unused, &unused, &unused, kp, &fast, &gmaps};
      s = smelt__gemm_sm90_launch(ctx, "smelt_gemm_grouped", k, f, total, params);
    } else {
      void *params[] = {kp};
      s = smelt__cuda_launch(ctx, "smelt_gemm_grouped", f, (unsigned)total, 1, 1, (unsigned)k->threads,
                             (unsigned)k->smem, params);
    }
  }
  if (dev) {
    smelt_status s2 = smelt__cuda_free(ctx, dev);
    if (!s) s = s2;
  }
  free(host);
  return s;
}

/* The block scales of problem p (zeros without them); batched, sb_bs steps
 * from entry to entry, grouped by offsets from group to group. */
static smelt__gemm_kblk blk_of(const smelt__gemm_prob *p) {
  return (smelt__gemm_kblk){.sa = (uint64_t)(uintptr_t)p->sa, .sb = (uint64_t)(uintptr_t)p->sb, .sa_rs = p->sa_s,
                            .sa_ks = p->sa_ks, .sa_bs = p->sa_bs, .sb_rs = p->sb_s, .sb_ks = p->sb_ks,
                            .sb_bs = p->sb_bs};
}

/* Grouped by offsets on Hopper (the fast epilogue only, no clusters): A
 * and D as maps over all T rows, B as a 3-D map (K, N, G) whose box is in
 * one group; one persistent CTA per SM, each walking the tiles of all
 * groups from the device offsets until past the last group's
 * (kernels/gemm_sm90.cu, sm90_locate), so the host needs no tile count.
 * kp->tiles_m x tiles_n is an upper bound on the tiles. */
static smelt_status run_offs_sm90(smelt_ctx *ctx, const smelt__gemm_state *st, const smelt__gemm_kernel *k,
                                  CUfunction f, smelt__gemm_kparams *kp, const smelt__gemm_args *args) {
  const smelt__gemm_prob *p = &args->prob;
  const int64_t bound = (int64_t)kp->tiles_m * kp->tiles_n;
  smelt__cu_tensor_map ta, tb, td;
  smelt_status s;
  /* K-major A and B (smelt__gemm_fits asks it of this mode). */
  if ((s = smelt__gemm_tensor_map(&ta, st->dt_a, p->a.data, p->m, p->k, p->a.rs, k->bm, k->bk)) ||
      (s = k->b_kmajor
               ? smelt__gemm_tensor_map_batched(&tb, st->dt_b, p->b.data, p->n, p->k, p->b.cs, args->count, p->b.bs, k->bn, k->bk)
               : smelt__gemm_tensor_map_batched(&tb, st->dt_b, p->b.data, p->k, p->n, p->b.rs, args->count, p->b.bs, k->bk, 64)) ||
      (s = smelt__gemm_tensor_map(&td, st->dt_d, p->d.data, p->m, p->n, p->d.rs, 64, 128 / (int)smelt_dtype_size(st->dt_d))))
    return s;
  int fast = 1;
  const void *gmaps = NULL;
  const smelt__gemm_kblk blk = blk_of(p); /* the block-scaled kernels' last parameter (run_sm90) */
  void *params[] = {&ta, &tb, &td, kp, &fast, &gmaps, (void *)&blk};
  return smelt__gemm_sm90_launch(ctx, "smelt_gemm_grouped_offs", k, f, bound, params);
}

smelt_status smelt__gemm_offs_grid(smelt_ctx *ctx, const char *op, int sm90, int64_t m, int64_t n, int bm, int bn,
                                   int64_t count, const void *ends, int ends_i64, smelt__gemm_kparams *kp) {
  if (count > 0x7fffffff)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: G=%lld groups exceed 2^31 - 1", op, (long long)count);
  const int64_t tiles_n = smelt__ceil_div(n, bn), tiles_m = smelt__ceil_div(m, bm) + count;
  if (tiles_n > 0x7fffffff || tiles_m > 0x7fffffff / tiles_n)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        "%s: (ceil(T/%d) + G) x ceil(N/%d) = %lld x %lld tiles exceed 2^31 - 1", op, bm, bn,
                        (long long)tiles_m, (long long)tiles_n);
  /* Hopper: each CTA's unit index runs up to a grid's width past the last tile. */
  if (sm90 && tiles_m * tiles_n > 0x7fffffff - (int64_t)ctx->cuda->info.sm_count)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: %lld tiles (bound) exceed 2^31 - 1 - SMs", op,
                        (long long)(tiles_m * tiles_n));
  kp->mode = SMELT__KMODE_GROUPED_OFFS;
  kp->count = (int)count;
  kp->tiles_m = (int)tiles_m;
  kp->tiles_n = (int)tiles_n;
  kp->offs = (uint64_t)(uintptr_t)ends;
  kp->offs_i64 = ends_i64;
  return SMELT_OK;
}

/* Grouped by offsets: one launch over the worst case of tiles (the SIMT
 * and mma.sync kernels: a block per tile; Hopper: run_offs_sm90). */
static smelt_status run_offs(smelt_ctx *ctx, const smelt__gemm_state *st, const smelt__gemm_kernel *k, CUfunction f,
                             smelt__gemm_kparams *kp, const smelt__gemm_args *args) {
  const char *op = "smelt_gemm_grouped_offs";
  const smelt__gemm_prob *p = &args->prob;
  if (k->fam != SMELT__GK_SIMT && k->fam != SMELT__GK_SM80 && k->fam != SMELT__GK_SM90)
    return smelt__error(SMELT_STATUS_INTERNAL, "%s: kernel family %d does not take device offsets", op, (int)k->fam);
  if (p->m == 0 || p->n == 0 || args->count == 0) return SMELT_OK;
  smelt_status s = smelt__gemm_offs_grid(ctx, op, k->fam == SMELT__GK_SM90, p->m, p->n, k->bm, k->bn, args->count,
                                         args->offs, st->dt_offs == SMELT_DTYPE_I64, kp);
  if (s) return s;
  kp->bias_gs = p->bias_gs;
  kp->sb_gs = p->sb_gs;
  if (k->fam == SMELT__GK_SM90) return run_offs_sm90(ctx, st, k, f, kp, args);
  void *params[] = {kp};
  return smelt__cuda_launch(ctx, op, f, (unsigned)((int64_t)kp->tiles_m * kp->tiles_n), 1, 1, (unsigned)k->threads,
                            (unsigned)k->smem, params);
}

/* A parallel split's partial sums as the fast epilogue stores them: the
 * f32 workspace [splits][M][N] as a 3-D map (so each slice's rows clip at
 * M), boxes of one slice x 64 rows x 32 columns (128 bytes) with the
 * 128-byte swizzle. N is a multiple of 4 (smelt__gemm_fits asks it of a
 * Hopper split), so the strides are whole 16-byte units. */
smelt_status smelt__gemm_workspace_map(smelt__cu_tensor_map *map, const void *ws, int64_t m, int64_t n, int splits) {
  const uint64_t dims[3] = {(uint64_t)n, (uint64_t)m, (uint64_t)splits},
                 strides[2] = {(uint64_t)n * 4, (uint64_t)(m * n) * 4};
  const unsigned box[3] = {32, 64, 1}, ones[3] = {1, 1, 1};
  CUresult r = smelt__cu(NULL)->cuTensorMapEncodeTiled(map, SMELT__TMA_F32, 3, (void *)ws, dims, strides, box, ones,
                                                        SMELT__TMA_INTERLEAVE_NONE, SMELT__TMA_SWIZZLE_128B,
                                                        SMELT__TMA_L2_256B, SMELT__TMA_OOB_FILL_NONE);
  if (r) return smelt__cu_error(r, "smelt_gemm", "cuTensorMapEncodeTiled (split-K workspace)");
  return SMELT_OK;
}

/* The split tail of a plain run on Hopper (kernels/gemm_sm90.cu,
 * sk_locate): when the tiles leave the last wave of one CTA per SM partly
 * idle, its tiles (or those and one wave more) run in S = 2 to 4 K chunks
 * each, chunk by chunk over all CTAs. Chosen by waves of work, a whole
 * tile being one: ceil(tiles / W) without; with, whole waves +
 * ceil(tail x S / W) / S, plus 0.02 of a wave and 0.03 for each slot the
 * last chunk reads (128 KB at the ~100 GB/s one SM draws from L2, against
 * the ~60 us a wave of 128 x 256 tiles takes at K = 5000); taken when
 * that saves over 0.15 of a wave and over 5% of the time (4096^3 on 132
 * SMs, 512 tiles, would save none; on H100 a predicted 1.6-1.8% at 8192^3
 * and 14336 x 4096 x 4096 came to +0.4% and -0.2%, against +6% at 5000^3,
 * which saves 9%). At least 2 K steps a chunk. SMELT_GEMM_SPLIT_TAIL=on takes
 * the best split whatever it saves, =off never splits (debugging; read only
 * when a split is possible, so plain runs do not pay for it).
 * Cooperative tiles without clusters only. The workspace: S - 1 slots of
 * partial sums a tail tile, then the tiles' flags (zeroed here). */
smelt_status smelt__gemm_split_tail(smelt_ctx *ctx, const char *op, const smelt__gemm_kernel *k, int64_t kk,
                                   int64_t tiles, smelt__gemm_kparams *kq, void **ws) {
  const int64_t W = ctx->cuda->info.sm_count, steps = smelt__ceil_div(kk, k->bk);
  if (k->pingpong || k->cluster_m * k->cluster_n > 1 || tiles % W == 0 || tiles > 0x7fffffff / 4 || steps < 4)
    return SMELT_OK;
  const double whole = (double)smelt__ceil_div(tiles, W);
  double best = whole;
  int64_t best_tail = 0, best_s = 0;
  for (int64_t tail = tiles % W; tail <= tiles && tail <= tiles % W + W; tail += W)
    for (int64_t sc = 2; sc <= 4 && 2 * sc <= steps; sc++) {
      const double cost = (double)((tiles - tail) / W) + (double)smelt__ceil_div(tail * sc, W) / (double)sc + 0.02 +
                          0.03 * (double)(sc - 1);
      if (cost < best - 1e-9) {
        best = cost;
        best_tail = tail;
        best_s = sc;
      }
    }
  if (!best_s) return SMELT_OK;
  const char *env = smelt__getenv("SMELT_GEMM_SPLIT_TAIL");
  const int on = env && !strcmp(env, "on"), off = env && !strcmp(env, "off");
  if (off || (!on && (whole - best <= 0.15 || whole - best <= 0.05 * whole))) return SMELT_OK;
  kq->sk_tiles = (int)best_tail;
  kq->sk_chunks = (int)best_s;
  const size_t slots = (size_t)(best_tail * (best_s - 1)) * (size_t)k->bm * (size_t)k->bn * 4,
               flags = (size_t)best_tail * 2 * sizeof(int);
  smelt_status s = smelt__cuda_alloc(ctx, slots + flags, ws);
  if (s) return s;
  kq->workspace = (uint64_t)(uintptr_t)*ws;
  kq->semaphores = kq->workspace + slots;
  CUresult r = smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)kq->semaphores, 0, flags, ctx->cuda->stream);
  return r ? smelt__cu_error(r, op, "clearing the split tail's flags") : SMELT_OK;
}

int64_t smelt__gemm_sk_units(const smelt__gemm_kparams *kq, int64_t tiles) {
  return kq->sk_tiles ? tiles + (int64_t)kq->sk_tiles * (kq->sk_chunks - 1) : tiles;
}

/* Hopper: persistent CTAs (smelt__gemm_sm90_launch). A multicast operand's map has
 * boxes of a cluster rank's share of the tile's rows. A parallel split
 * runs the slices' tiles in one launch with an identity epilogue into the
 * workspace (kp->workspace, set by the caller); the caller then launches
 * gemm_reduce with the real one. */
static smelt_status run_sm90(smelt_ctx *ctx, const smelt__gemm_state *st, const smelt__gemm_kernel *k, CUfunction f,
                             const smelt__gemm_kparams *kp, const smelt__gemm_prob *p, const smelt__epi_kptrs *E) {
  smelt__cu_tensor_map ta, tb, td;
  smelt_status s;
  const int64_t batch = kp->mode == SMELT__KMODE_BATCHED ? kp->count : 0;
  if ((s = operand_maps(st, k, p, batch, &ta, &tb))) return s;
  smelt__gemm_kparams kq = *kp;
  int64_t tiles = sm90_units(k, p->m, p->n);
  int fast;
  if (batch) {
    /* Entry by entry (the selector gives batched runs the fast epilogue
     * only): D through a 3-D map. */
    tiles *= batch;
    if (tiles > 0x7fffffff)
      return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm: %lld batched tiles exceed 2^31 - 1", (long long)tiles);
    fast = 1;
    if ((s = smelt__gemm_tensor_map_batched(&td, st->dt_d, p->d.data, p->m, p->n, p->d.rs, batch, p->d.bs, 64,
                                128 / (int)smelt_dtype_size(st->dt_d))))
      return s;
  } else if (kp->mode == SMELT__KMODE_PARALLEL) {
    kq.alpha_ab = 1.0;
    kq.scale_d = 1.0f;
    kq.act = SMELT_ACT_IDENTITY;
    kq.clamp = kq.has_c = kq.has_bias = kq.has_sa = kq.has_sb = 0;
    kq.dt_d = SMELT_DTYPE_F32;
    fast = 1;
    tiles *= kp->splits;
    if (tiles > 0x7fffffff)
      return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm: %lld split-K tiles exceed 2^31 - 1", (long long)tiles);
    if ((s = smelt__gemm_workspace_map(&td, (const void *)(uintptr_t)kp->workspace, p->m, p->n, kp->splits))) return s;
  } else {
    /* D as boxes of 64 rows of 128 bytes (64 16-bit or 32 f32 columns), the
     * TMA stores of the fast epilogue; otherwise the map is not read. */
    fast = smelt__gemm_sm90_fast_d(st, p);
    const int d_cols = 128 / (int)smelt_dtype_size(st->dt_d);
    if (fast == 1 && (s = smelt__gemm_tensor_map(&td, st->dt_d, p->d.data, p->m, p->n, p->d.rs, 64, d_cols))) return s;
    if (fast != 1) td = ta;
  }
  const void *gmaps = NULL; /* grouped runs only */
  /* The last parameter: the block scales of a block-scaled kernel, or a
   * graph kernel's tensors (never both: the core refuses that); the driver
   * reads as many parameters as the kernel has, so others skip it. */
  const smelt__gemm_kblk blk = blk_of(p);
  void *params[] = {&ta, &tb, &td, &kq, &fast, &gmaps, st->blk ? (void *)&blk : (void *)E};
  void *ws = NULL;
  if (!batch && kp->mode == SMELT__KMODE_PLAIN && (s = smelt__gemm_split_tail(ctx, "smelt_gemm", k, p->k, tiles, &kq, &ws)))
    return s;
  s = smelt__gemm_sm90_launch(ctx, "smelt_gemm", k, f, smelt__gemm_sk_units(&kq, tiles), params);
  if (ws) {
    smelt_status s2 = smelt__cuda_free(ctx, ws);
    if (!s) s = s2;
  }
  return s;
}

/* One problem on prepped operands: the pre-pass of each operand that has
 * one into ws, then the plain Hopper launch on the copies. */
static smelt_status run_prepped_one(smelt_plan *plan, const smelt__gemm_kernel *k, CUfunction f,
                                    smelt__gemm_kparams *kp, const smelt__gemm_prep prep[2], smelt__gemm_prob p,
                                    char *ws, const smelt__epi_kptrs *E) {
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  smelt_status s =
      smelt__gemm_prep_operands(plan->ctx, (CUfunction)plan->func[F_PREP], prep, st->dt_a, st->dt_b, &p, ws);
  p.k = smelt__gemm_prep_gemm_k(st, prep, p.k);
  kprob_of(&kp->p, &p);
  return s ? s : run_sm90(plan->ctx, st, k, f, kp, &p, E);
}

static const void *moved(const void *x, smelt_dtype dt, int64_t elems) {
  return x ? (const char *)x + elems * (int64_t)smelt_dtype_size(dt) : NULL;
}

/* Hopper with the operand pre-pass, plain or batched: a workspace for one
 * problem's prepped operands from the context's pool, reused by each batch
 * entry in turn (the launches are ordered on the stream), and given back
 * in stream order after the last. */
static smelt_status run_prepped(smelt_plan *plan, const smelt__gemm_kernel *k, CUfunction f, smelt__gemm_kparams *kp,
                                const smelt__gemm_args *args, const smelt__epi_kptrs *E) {
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  const smelt__gemm_cuda_plan *cp = (const smelt__gemm_cuda_plan *)plan->backend;
  const smelt__gemm_prob *p = &args->prob;
  /* A 16-bit plan also copies an operand it planned to read as it is when
   * the run's pointer is less aligned than the planned one (the copy keeps
   * the layout the main kernel was chosen for). */
  smelt__gemm_prep prep[2] = {cp->prep[0], cp->prep[1]};
  if (prep[0] == SMELT__PREP_PITCH || prep[1] == SMELT__PREP_PITCH) {
    if (!prep[0] && ptr_align(p->a.data) < cp->align[0]) prep[0] = SMELT__PREP_PITCH;
    if (!prep[1] && ptr_align(p->b.data) < cp->align[1]) prep[1] = SMELT__PREP_PITCH;
  }
  const size_t a_bytes = smelt__gemm_prep_bytes(prep[0], 0, p, st->dt_a),
               b_bytes = smelt__gemm_prep_bytes(prep[1], 1, p, st->dt_b);
  void *ws = NULL;
  smelt_status s = smelt__cuda_alloc(plan->ctx, a_bytes + b_bytes, &ws);
  if (s) return s;
  kp->mode = SMELT__KMODE_PLAIN;
  const int64_t count = cp->mode == SMELT_GEMM_MODE_BATCHED ? args->count : 1;
  for (int64_t l = 0; l < count && !s; l++) {
    smelt__gemm_prob e = *p;
    e.a.data = moved(p->a.data, st->dt_a, l * p->a.bs);
    e.b.data = moved(p->b.data, st->dt_b, l * p->b.bs);
    e.c.data = moved(p->c.data, st->dt_c, l * p->c.bs);
    e.d.data = moved(p->d.data, st->dt_d, l * p->d.bs);
    s = run_prepped_one(plan, k, f, kp, prep, e, (char *)ws, E);
  }
  smelt_status s2 = smelt__cuda_free(plan->ctx, ws);
  return s ? s : s2;
}

/* A plain GEMM with an epilogue graph (src/cuda/gemm_epi.c): the main
 * kernel gets the graph's slots and partials as its last parameter, then
 * the reductions' second pass runs, also for an empty D (their outputs
 * then hold the identity). */
static smelt_status run_graph(smelt_plan *plan, const smelt__gemm_kernel *k, CUfunction f, smelt__gemm_kparams *kp,
                              const smelt__gemm_args *args) {
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  const smelt__gemm_cuda_plan *cp = (const smelt__gemm_cuda_plan *)plan->backend;
  const smelt__gemm_prob *p = &args->prob;
  const int64_t tiles_m = smelt__ceil_div(p->m, k->bm), tiles = tiles_m * smelt__ceil_div(p->n, k->bn);
  if (tiles > 0x7fffffff)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm: %lld output tiles exceed 2^31 - 1", (long long)tiles);
  kp->tiles_m = (int)tiles_m;
  kp->tiles_n = (int)smelt__ceil_div(p->n, k->bn);
  smelt__epi_kptrs E;
  void *ws;
  smelt_status s = smelt__gemm_epi_begin(plan->ctx, st, k, p, &E, &ws);
  if (s) return s;
  void *params[] = {kp, &E};
  if (tiles == 0) s = SMELT_OK;
  else if (cp->prep[0] || cp->prep[1]) s = run_prepped(plan, k, f, kp, args, &E);
  else if (k->fam == SMELT__GK_SM90) s = run_sm90(plan->ctx, st, k, f, kp, p, &E);
  else s = smelt__cuda_launch(plan->ctx, "smelt_gemm", f, (unsigned)tiles, 1, 1, (unsigned)k->threads, (unsigned)k->smem, params);
  return smelt__gemm_epi_end(plan->ctx, plan->func[F_EPI], st, k, p, &E, ws, s);
}

smelt_status smelt__gemm_split_workspace(smelt_ctx *ctx, smelt__gemm_kparams *kp, int64_t m, int64_t n, int64_t tiles,
                                         size_t acc_bytes, void **ws) {
  const int parallel = kp->mode == SMELT__KMODE_PARALLEL;
  const size_t partial = (size_t)(m * n) * acc_bytes * (parallel ? (size_t)kp->splits : 1);
  const size_t sems = parallel ? 0 : (size_t)tiles * sizeof(int);
  *ws = NULL;
  smelt_status s = smelt__cuda_alloc(ctx, partial + sems, ws);
  if (s) return s;
  kp->workspace = (uint64_t)(uintptr_t)*ws;
  if (!sems) return SMELT_OK;
  kp->semaphores = kp->workspace + partial;
  CUresult r = smelt__cu(NULL)->cuMemsetD8Async((CUdeviceptr)kp->semaphores, 0, sems, ctx->cuda->stream);
  return r ? smelt__cu_error(r, "smelt_gemm", "clearing the split-K semaphores") : SMELT_OK;
}

smelt_status smelt__gemm_split_reduce(smelt_ctx *ctx, const char *op, void *f, smelt__gemm_kparams *kp, int64_t m,
                                      int64_t n) {
  kp->batch_base = 0;
  const int64_t total = m * n, cap = (int64_t)ctx->cuda->info.sm_count * 16;
  const int64_t blocks = smelt__ceil_div(total, 256) < cap ? smelt__ceil_div(total, 256) : cap;
  void *params[] = {kp};
  return smelt__cuda_launch(ctx, op, (CUfunction)f, (unsigned)blocks, 1, 1, 256, 0, params);
}

static smelt_status run(smelt_plan *plan, const smelt__gemm_args *args) {
  const smelt__gemm_state *st = (const smelt__gemm_state *)plan->opdata;
  const smelt__gemm_cuda_plan *cp = (const smelt__gemm_cuda_plan *)plan->backend;
  smelt_ctx *ctx = plan->ctx;
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int n = smelt__gemm_table(table);
  int ki;
  CUfunction f;
  smelt_status s = pick(plan, table, n, args, &ki, &f);
  if (s) return s;
  const smelt__gemm_kernel *k = &table[ki];
  const smelt_gemm_epilogue *e = &st->desc.epilogue;

  smelt__gemm_kparams kp;
  memset(&kp, 0, sizeof kp);
  kprob_of(&kp.p, &args->prob);
  kp.a_bs = args->prob.a.bs;
  kp.b_bs = args->prob.b.bs;
  kp.c_bs = args->prob.c.bs;
  kp.d_bs = args->prob.d.bs;
  kp.alpha_ab = e->alpha * (double)e->scale_a * (double)e->scale_b;
  kp.beta = e->beta;
  kp.scale_d = e->scale_d;
  kp.slope = e->slope;
  kp.dt_a = st->dt_a;
  kp.dt_b = st->dt_b;
  kp.dt_c = st->dt_c;
  kp.dt_d = st->dt_d;
  kp.dt_bias = st->dt_bias;
  kp.act = e->act;
  kp.clamp = e->clamp != 0;
  kp.has_c = st->has_c;
  kp.has_bias = st->has_bias;
  /* Block scales reach the kernel apart (blk_of); the epilogue has no vectors. */
  kp.has_sa = st->has_sa && !st->blk;
  kp.has_sb = st->has_sb && !st->blk;
  kp.swizzle = st->desc.tile.swizzle ? st->desc.tile.swizzle : 8;
  kp.splits = 1;
  switch (cp->mode) {
    case SMELT_GEMM_MODE_GROUPED: kp.mode = SMELT__KMODE_GROUPED; return run_grouped(plan, k, f, &kp, args);
    case SMELT_GEMM_MODE_GROUPED_OFFS: return run_offs(ctx, st, k, f, &kp, args);
    case SMELT_GEMM_MODE_ARRAY:
      kp.mode = SMELT__KMODE_ARRAY;
      kp.ptr_a = (uint64_t)(uintptr_t)args->ptrs->a;
      kp.ptr_b = (uint64_t)(uintptr_t)args->ptrs->b;
      kp.ptr_c = (uint64_t)(uintptr_t)args->ptrs->c;
      kp.ptr_d = (uint64_t)(uintptr_t)args->ptrs->d;
      break;
    case SMELT_GEMM_MODE_BATCHED: kp.mode = SMELT__KMODE_BATCHED; break;
    case SMELT_GEMM_MODE_SPLIT_K_SERIAL: kp.mode = SMELT__KMODE_SERIAL; break;
    case SMELT_GEMM_MODE_SPLIT_K_PARALLEL: kp.mode = SMELT__KMODE_PARALLEL; break;
    default: kp.mode = SMELT__KMODE_PLAIN; break;
  }
  const int64_t M = args->prob.m, N = args->prob.n;
  const int64_t tiles_m = smelt__ceil_div(M, k->bm), tiles_n = smelt__ceil_div(N, k->bn), tiles = tiles_m * tiles_n;
  if (st->has_graph) return run_graph(plan, k, f, &kp, args);
  if (tiles == 0 || args->count == 0) return SMELT_OK;
  if (tiles > 0x7fffffff)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm: %lld output tiles exceed 2^31 - 1", (long long)tiles);
  kp.tiles_m = (int)tiles_m;
  kp.tiles_n = (int)tiles_n;
  if (cp->prep[0] || cp->prep[1]) return run_prepped(plan, k, f, &kp, args, NULL);
  if (k->fam == SMELT__GK_SM90 && kp.mode == SMELT__KMODE_PLAIN) return run_sm90(ctx, st, k, f, &kp, &args->prob, NULL);
  if (k->fam == SMELT__GK_SM90 && kp.mode == SMELT__KMODE_BATCHED) {
    kp.count = (int)args->count; /* below 2^31: smelt__gemm_fits */
    return run_sm90(ctx, st, k, f, &kp, &args->prob, NULL);
  }

  void *ws = NULL;
  int64_t z = kp.mode == SMELT__KMODE_BATCHED || kp.mode == SMELT__KMODE_ARRAY ? args->count : 1;
  const int serial = kp.mode == SMELT__KMODE_SERIAL, parallel = kp.mode == SMELT__KMODE_PARALLEL;
  if (serial || parallel) {
    kp.k_slice = k_slice_of(k, args->prob.k, cp->split_k);
    kp.splits = (int)(args->prob.k > 0 ? smelt__ceil_div(args->prob.k, kp.k_slice) : 1);
    z = kp.splits;
    if ((s = smelt__gemm_split_workspace(ctx, &kp, M, N, tiles, ws_size(st->acc), &ws)) && !ws) return s;
  }
  void *params[] = {&kp};
  if (k->fam == SMELT__GK_SM90 && !s) s = run_sm90(ctx, st, k, f, &kp, &args->prob, NULL); /* a parallel split */
  for (int64_t base = 0; base < z && !s && k->fam != SMELT__GK_SM90; base += 65535) {
    kp.batch_base = (int)base;
    const int64_t zc = z - base < 65535 ? z - base : 65535;
    s = smelt__cuda_launch(ctx, "smelt_gemm", f, (unsigned)tiles, 1, (unsigned)zc, (unsigned)k->threads,
                           (unsigned)k->smem, params);
  }
  if (!s && parallel) s = smelt__gemm_split_reduce(ctx, "smelt_gemm", plan->func[F_REDUCE], &kp, M, N);
  if (ws) {
    smelt_status s2 = smelt__cuda_free(ctx, ws);
    if (!s) s = s2;
  }
  return s;
}

static smelt_status run_gemm(smelt_plan *plan, const void *args) {
  smelt__nvtx_push("smelt_gemm");
  smelt_status s = run(plan, (const smelt__gemm_args *)args);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_gemm = {.plan = plan_gemm, .run = run_gemm};
