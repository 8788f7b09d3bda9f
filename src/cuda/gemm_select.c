/* The GEMM kernel table and its selector.
 *
 * The table lists every variant that exists; the variant enumerator (for
 * precompile and the compile test) walks the table, and the selector only
 * ever returns table entries, so "which kernels can be picked" and "which
 * kernels are compiled in CI" cannot drift apart. The selector answers both
 * "is it supported?" and "which kernel?": one function, used by plan and by
 * runs whose operands no longer fit the planned kernel.
 *
 * Choice, in order:
 *   on sm_80 and newer, the GEMV kernel for f16/bf16 plain, batched and
 *   parallel split GEMMs with M <= 16 (per problem) and row-major A and
 *   column-major B (K-major), 16-byte aligned, unless the description asks
 *   for another tile or for SIMT: such a GEMM does at most 16 multiply-adds
 *   per element of B, far below any tensor-core kernel's balance point, so
 *   its time is the time to read B; a 64-row wgmma tile would leave at
 *   least three quarters of its rows empty and keep too little of B in
 *   flight, while one m16n8k16 fragment pair covers all 16 rows (above 16
 *   the 64-row tiles waste less and keep up with cuBLAS);
 *   on Hopper (sm_90a), the TMA + wgmma kernel for plain f16/bf16, tf32 and
 *   fp8 (16- or 8-bit D) GEMMs, grouped and batched ones (batched: not
 *   tf32) with 16-bit row-major D whose rows are whole 16-byte units (N a
 *   multiple of 8) and no C, and f16/bf16 ones grouped by offsets with such
 *   a D (or f32 D), with A and B 16-byte aligned and K-major (row-major A,
 *   column-major B), or for f16/bf16 either one MN-major, K >= 1 (and
 *   parallel splits of such plain GEMMs when asked for, N a multiple of 4): the
 *   cooperative schedule with 128 x 256 tiles when they keep at least half
 *   the SMs busy, else (16-bit types) 128 x 64 tiles, or 64 x 64 tiles
 *   (one consumer warpgroup) when M <= 64 or the 128 x 64 ones would leave
 *   at least half the SMs idle; 64 x 128 tiles when asked for; its 128 x 128
 *   ping-pong schedule (RC, RR, CR) for plain runs of K <= 1024 that fill
 *   the SMs with such tiles (not padding N much), or when the description
 *   asks for that tile; and
 *   its cluster variants (TMA multicast) only when it asks for a cluster;
 *   block-scaled fp8 (desc.scales BLOCK) only on Hopper's block-scaled
 *   kernel (128 x 128 tiles; its 2 x 1 cluster when asked for), in plain,
 *   batched and grouped-by-offsets GEMMs with K-major A and B, else
 *   UNSUPPORTED (K = 0 has nothing to scale: any kernel);
 *   an mma.sync kernel when the dtypes have one (f16, bf16, fp8 with an f32
 *   accumulator; f32 with math TF32 or 3XTF32; i8), the device is sm_80 or
 *   newer, and A and B are 16-byte aligned with a unit stride along K or
 *   along M/N (8-bit: along K); K-major layouts first, then the 128 x 128
 *   tile unless it would leave SMs idle;
 *   otherwise the SIMT kernel of the accumulator type, which takes anything. */
#include "gemm_cuda.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* The Hopper kernel's ping-pong schedule (kernels/gemm_sm90.cu,
 * GEMM_PINGPONG), as its table entries say; the others are cooperative. */
static int pingpong(const smelt__gemm_kernel *k) { return k->fam == SMELT__GK_SM90 && k->pingpong; }

static int clustered(const smelt__gemm_kernel *k) { return k->cluster_m * k->cluster_n > 1; }

/* Whether tiles `width` columns wide pad N by a third more than 64-wide
 * ones would (the padding is tensor work thrown away). */
static int pads_n_over(int64_t n, int64_t width) {
  return 3 * smelt__ceil_div(n, width) * width >= 4 * smelt__ceil_div(n, 64) * 64;
}

int smelt__gemm_short_k_pingpong(int64_t k, int64_t tiles, int64_t sms) { return k <= 1024 && tiles >= sms; }

static void add(smelt__gemm_kernel *out, int *n, smelt__gemm_kernel k) {
  if (k.fam == SMELT__GK_SM90) {
    /* As gemm_sm90.cu lays it out: alignment slack, stages (128-byte K
     * rows), the epilogue region (EPI_REGION: the general epilogue's 64 x
     * 40 f32 buffer a consumer, or the fast one's two 8 KiB buffers a
     * consumer and BN f32 of bias, a row a consumer in ping-pong, one row
     * shared otherwise), 2 x stages mbarriers. */
    const int general = k.wm * 64 * 40 * 4, fast = k.wm * 2 * 8192 + (pingpong(&k) ? k.wm : 1) * k.bn * 4;
    k.threads = 128 * (k.wm + 1);
    k.smem = 1024 + k.stages * (k.bm + k.bn) * 128 + (general > fast ? general : fast) + 2 * k.stages * 8;
  } else if (k.fam == SMELT__GK_SM80) {
    k.threads = k.wm * k.wn * 32;
    int stages = k.stages * (k.bm + k.bn) * 64, tile = k.bm * (k.bn + 8) * 4; /* as SMEM_BYTES in gemm_sm80.cu */
    k.smem = stages > tile ? stages : tile;
  } else {
    k.threads = 256;
    k.smem = 0;
  }
  out[(*n)++] = k;
}

/* The tile shapes of the entries, as designated initializers. */
typedef struct tile {
  int bm, bn, bk, stages, wm, wn, cluster_m, cluster_n;
} tile;

/* A Hopper entry: A row-major, B column-major, f32 accumulation. */
static smelt__gemm_kernel sm90(int tc, tile t) {
  return (smelt__gemm_kernel){.fam = SMELT__GK_SM90, .acc = SMELT_GEMM_ACC_F32, .tc = tc, .a_kmajor = 1,
                              .b_kmajor = 1, .bm = t.bm, .bn = t.bn, .bk = t.bk, .stages = t.stages, .wm = t.wm,
                              .wn = 1, .cluster_m = t.cluster_m ? t.cluster_m : 1,
                              .cluster_n = t.cluster_n ? t.cluster_n : 1};
}

/* A Hopper entry with MN-major operands (16-bit types; 1: K-major). */
static smelt__gemm_kernel sm90_layout(int tc, tile t, int a_kmajor, int b_kmajor) {
  smelt__gemm_kernel k = sm90(tc, t);
  k.a_kmajor = a_kmajor;
  k.b_kmajor = b_kmajor;
  return k;
}

/* An mma.sync entry with its layouts (1: K-major). */
static smelt__gemm_kernel sm80(smelt_gemm_acc acc, int tc, int a_kmajor, int b_kmajor, tile t) {
  return (smelt__gemm_kernel){.fam = SMELT__GK_SM80, .acc = acc, .tc = tc, .a_kmajor = a_kmajor,
                              .b_kmajor = b_kmajor, .bm = t.bm, .bn = t.bn, .bk = t.bk, .stages = t.stages,
                              .wm = t.wm, .wn = t.wn, .cluster_m = 1, .cluster_n = 1};
}

/* The GEMV entry (kernels/gemm_gemv.cu): A row-major, B column-major, all of
 * M <= 16 in one 16-row tile, 32 columns of D and 8 warps a block, K in
 * chunks of 128; 256 threads and static shared memory (add's default). */
static smelt__gemm_kernel gemv(int tc) {
  return (smelt__gemm_kernel){.fam = SMELT__GK_GEMV, .acc = SMELT_GEMM_ACC_F32, .tc = tc, .a_kmajor = 1,
                              .b_kmajor = 1, .bm = 16, .bn = 32, .bk = 128, .stages = 1, .wm = 8, .wn = 1,
                              .cluster_m = 1, .cluster_n = 1};
}

/* k as the fp8 kernel for A of type a and B of type b. */
static smelt__gemm_kernel fp8(smelt__gemm_kernel k, smelt_dtype a, smelt_dtype b) {
  k.fp8_a = a;
  k.fp8_b = b;
  return k;
}

/* k with block scales (GEMM_BLOCK_SCALE). */
static smelt__gemm_kernel block_scaled(smelt__gemm_kernel k) {
  k.blk = 1;
  return k;
}

int smelt__gemm_table(smelt__gemm_kernel *out) {
  int n = 0;
  static const smelt_gemm_acc simt_acc[] = {SMELT_GEMM_ACC_F32, SMELT_GEMM_ACC_F16, SMELT_GEMM_ACC_F64,
                                            SMELT_GEMM_ACC_I32};
  for (int i = 0; i < 4; i++)
    add(out, &n, (smelt__gemm_kernel){.fam = SMELT__GK_SIMT, .acc = simt_acc[i], .bm = 64, .bn = 64, .bk = 16,
                                      .stages = 1, .wm = 8, .wn = 1, .cluster_m = 1, .cluster_n = 1});
  static const smelt_gemm_acc red_acc[] = {SMELT_GEMM_ACC_F32, SMELT_GEMM_ACC_F64, SMELT_GEMM_ACC_I32};
  for (int i = 0; i < 3; i++)
    add(out, &n, (smelt__gemm_kernel){.fam = SMELT__GK_REDUCE, .acc = red_acc[i], .cluster_m = 1, .cluster_n = 1});
  /* Hopper: A row-major and B column-major; BK is one 128-byte row of K
   * (64 16-bit, 32 tf32, 128 fp8 elements). The wide tiles first (the
   * selector takes the first that fits), then a narrow 16-bit tile for
   * skinny problems, with twice the stages (they fit, and such problems
   * are bound by streaming B). */
  const tile wide = {.bm = 128, .bn = 256, .bk = 64, .stages = 4, .wm = 2};
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++) add(out, &n, sm90(tc, wide));
  add(out, &n, sm90(SMELT__TC_TF32, (tile){.bm = 128, .bn = 256, .bk = 32, .stages = 4, .wm = 2}));
  static const smelt_dtype f8[] = {SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2};
  const tile fp8_wide = {.bm = 128, .bn = 256, .bk = 128, .stages = 4, .wm = 2};
  for (int a = 0; a < 2; a++)
    for (int b = 0; b < 2; b++)
      add(out, &n, fp8(sm90(SMELT__TC_FP8, fp8_wide), f8[a], f8[b]));
  const tile narrow = {.bm = 128, .bn = 64, .bk = 64, .stages = 8, .wm = 2};
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++) add(out, &n, sm90(tc, narrow));
  /* 16-bit: every layout, a large and a small tile. */
  const tile large = {.bm = 128, .bn = 128, .bk = 32, .stages = 4, .wm = 2, .wn = 4};
  const tile small = {.bm = 64, .bn = 64, .bk = 32, .stages = 4, .wm = 2, .wn = 2};
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++)
    for (int ak = 1; ak >= 0; ak--)
      for (int bk = 1; bk >= 0; bk--) {
        add(out, &n, sm80(SMELT_GEMM_ACC_F32, tc, ak, bk, large));
        add(out, &n, sm80(SMELT_GEMM_ACC_F32, tc, ak, bk, small));
      }
  /* tf32 and 3xtf32: every layout. */
  const tile tf32 = {.bm = 128, .bn = 128, .bk = 16, .stages = 4, .wm = 2, .wn = 4};
  for (int tc = SMELT__TC_TF32; tc <= SMELT__TC_3XTF32; tc++)
    for (int ak = 1; ak >= 0; ak--)
      for (int bk = 1; bk >= 0; bk--) add(out, &n, sm80(SMELT_GEMM_ACC_F32, tc, ak, bk, tf32));
  /* 8-bit: K-major only (the mma's byte fragments run along K). */
  const tile bytes = {.bm = 128, .bn = 128, .bk = 64, .stages = 4, .wm = 2, .wn = 4};
  add(out, &n, sm80(SMELT_GEMM_ACC_I32, SMELT__TC_I8, 1, 1, bytes));
  for (int a = 0; a < 2; a++)
    for (int b = 0; b < 2; b++) add(out, &n, fp8(sm80(SMELT_GEMM_ACC_F32, SMELT__TC_FP8, 1, 1, bytes), f8[a], f8[b]));
  /* The ping-pong schedule (its only tile: 128 x 128, each consumer owning
   * whole tiles, so one consumer's epilogue overlaps the other's main
   * loop), 16-bit types, six stages of 32 KiB; taken when asked for (the
   * selector prefers the cooperative kernel, which ran faster on H100).
   * Appended last so that the entries before keep their indices. */
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++) {
    smelt__gemm_kernel k = sm90(tc, (tile){.bm = 128, .bn = 128, .bk = 64, .stages = 6, .wm = 2});
    k.pingpong = 1;
    add(out, &n, k);
  }
  /* Clusters with TMA multicast (16-bit types, cooperative schedule): the
   * wide tile in pairs along M sharing B (square problems), the narrow tile
   * in pairs and quads along N sharing A (skinny M: every CTA needs the same
   * rows of A). Appended last, as the ping-pong entries. */
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++) {
    tile w2 = wide, n2 = narrow, n4 = narrow;
    w2.cluster_m = 2;
    n2.cluster_n = 2;
    n4.cluster_n = 4;
    add(out, &n, sm90(tc, w2));
    add(out, &n, sm90(tc, n2));
    add(out, &n, sm90(tc, n4));
  }
  /* 64-row tiles (one consumer warpgroup, 16-bit types): twice the CTAs of
   * the 128-row tiles for a skinny M, as cuBLAS's 64 x 64 tile with 13
   * stages of 16 KiB; 64 x 128 with 8 stages. (The 64 x 64 tile in 2 x 1
   * clusters sharing B, as cuBLAS runs it, was no faster on H100:
   * docs/PERF.md, GEMM: decisions.) Appended last, as the entries above. */
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++) {
    add(out, &n, sm90(tc, (tile){.bm = 64, .bn = 64, .bk = 64, .stages = 13, .wm = 1}));
    add(out, &n, sm90(tc, (tile){.bm = 64, .bn = 128, .bk = 64, .stages = 8, .wm = 1}));
  }
  /* The other layouts of 16-bit types (RR, CR, CC): the same pipeline with
   * MN-major boxes and descriptors, in the three tiles the selector takes
   * unasked (wide, narrow, 64 x 64). Appended last, as the entries above. */
  const tile rows64 = {.bm = 64, .bn = 64, .bk = 64, .stages = 13, .wm = 1};
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++)
    for (int l = 0; l < 3; l++) {
      const int ak = l == 0, bk = l == 1; /* RR, CC, CR (storage orders of A and B) */
      add(out, &n, sm90_layout(tc, wide, ak, bk));
      add(out, &n, sm90_layout(tc, narrow, ak, bk));
      add(out, &n, sm90_layout(tc, rows64, ak, bk));
    }
  /* tf32 promoting its sums every 4 stages (GEMM_PROMOTE), for the 3xtf32
   * split: cooperative 128 x 128 (twice the accumulators), 5 stages. */
  {
    smelt__gemm_kernel k = sm90(SMELT__TC_TF32, (tile){.bm = 128, .bn = 128, .bk = 32, .stages = 5, .wm = 2});
    k.promote = 4;
    add(out, &n, k);
  }
  /* Skinny M (<= 16): the GEMV kernel, 16-bit types. Appended last, as the
   * entries above. */
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++) add(out, &n, gemv(tc));
  /* Block-scaled fp8 (GEMM_BLOCK_SCALE), every fp8 pair: 128 x 128 tiles,
   * whose B scale is one value a k block, and twice the accumulators (the
   * promoted sums), with the six 32 KiB stages that fit; e4m3 x e4m3 also
   * in 2 x 1 clusters sharing B (a quarter less from L2, which a 128 x 128
   * fp8 tile at full rate draws near its limit), taken when asked for.
   * Appended last, as the entries above. */
  const tile blk = {.bm = 128, .bn = 128, .bk = 128, .stages = 6, .wm = 2};
  for (int a = 0; a < 2; a++)
    for (int b = 0; b < 2; b++) add(out, &n, block_scaled(fp8(sm90(SMELT__TC_FP8, blk), f8[a], f8[b])));
  tile pair = blk;
  pair.cluster_m = 2;
  add(out, &n, block_scaled(fp8(sm90(SMELT__TC_FP8, pair), f8[0], f8[0])));
  /* The ping-pong schedule for RR and CR (B MN-major: the backward's dX =
   * dY W and dW = dY^T X), 16-bit types, as the RC entries. Appended last,
   * as the entries above. */
  for (int tc = SMELT__TC_F16; tc <= SMELT__TC_BF16; tc++)
    for (int ak = 1; ak >= 0; ak--) {
      smelt__gemm_kernel k = sm90_layout(tc, (tile){.bm = 128, .bn = 128, .bk = 64, .stages = 6, .wm = 2}, ak, 0);
      k.pingpong = 1;
      add(out, &n, k);
    }
  return n;
}

smelt__gemm_kernel smelt__gemm_sm90_kernel(int tc, int consumers, int bn, int stages, int a_kmajor, int b_kmajor,
                                           int pingpong) {
  smelt__gemm_kernel t = sm90_layout(
                         tc, (tile){.bm = 64 * consumers, .bn = bn, .bk = 64, .stages = stages, .wm = consumers},
                         a_kmajor, b_kmajor),
                     k;
  int n = 0;
  t.pingpong = pingpong;
  add(&k, &n, t); /* threads and shared memory as the table's */
  return k;
}

static const char *const tc_names[] = {"", "f16", "bf16", "tf32", "3xtf32", "i8", "fp8"};
static const char *const acc_names[] = {"auto", "f32", "f16", "f64", "i32"};

void smelt__gemm_kernel_src(const smelt__gemm_kernel *k, smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  smelt__prelude_define(src, "GEMM_ACC", k->acc);
  switch (k->fam) {
    case SMELT__GK_SIMT:
      snprintf(src->name, sizeof src->name, "gemm_simt_acc%s", acc_names[k->acc]);
      src->body = "gemm_simt.cu";
      return;
    case SMELT__GK_REDUCE:
      snprintf(src->name, sizeof src->name, "gemm_reduce_acc%s", acc_names[k->acc]);
      src->body = "gemm_reduce.cu";
      return;
    case SMELT__GK_SM90: {
      char kind[32];
      if (k->tc == SMELT__TC_FP8)
        snprintf(kind, sizeof kind, "%sx%s", smelt_dtype_name(k->fp8_a), smelt_dtype_name(k->fp8_b));
      else
        snprintf(kind, sizeof kind, "%s", tc_names[k->tc]);
      char cl[16] = "";
      if (clustered(k)) snprintf(cl, sizeof cl, "_c%dx%d", k->cluster_m, k->cluster_n);
      snprintf(src->name, sizeof src->name, "gemm_sm90_%s_%c%c_%dx%dx%d_s%d%s%s", kind, k->a_kmajor ? 'R' : 'C',
               k->b_kmajor ? 'C' : 'R', k->bm, k->bn, k->bk, k->stages, pingpong(k) ? "_pp" : "", cl);
      if (k->promote || k->blk) {
        const size_t len = strlen(src->name);
        if (k->promote) snprintf(src->name + len, sizeof src->name - len, "_pr%d", k->promote);
        else snprintf(src->name + len, sizeof src->name - len, "_blk");
      }
      src->body = "gemm_sm90.cu";
      /* GEMM_AB: the operands' dtype code (f32 for tf32; e4m3 stands for fp8). */
      const smelt_dtype ab = k->tc == SMELT__TC_BF16  ? SMELT_DTYPE_BF16
                             : k->tc == SMELT__TC_F16 ? SMELT_DTYPE_F16
                             : k->tc == SMELT__TC_TF32 ? SMELT_DTYPE_F32
                                                       : SMELT_DTYPE_E4M3;
      smelt__prelude_define(src, "GEMM_AB", ab);
      if (k->tc == SMELT__TC_FP8) {
        smelt__prelude_define(src, "GEMM_FP8_A", k->fp8_a);
        smelt__prelude_define(src, "GEMM_FP8_B", k->fp8_b);
      }
      smelt__prelude_define(src, "GEMM_BN", k->bn);
      smelt__prelude_define(src, "GEMM_STAGES", k->stages);
      /* Two consumers when absent (the 128-row variants' sources, and so
       * their cache keys, stay as they were). */
      if (k->wm != 2) smelt__prelude_define(src, "GEMM_CONSUMERS", k->wm);
      if (pingpong(k)) smelt__prelude_define(src, "GEMM_PINGPONG", 1);
      if (k->promote) smelt__prelude_define(src, "GEMM_PROMOTE", k->promote);
      if (k->blk) smelt__prelude_define(src, "GEMM_BLOCK_SCALE", 1);
      if (!k->a_kmajor) smelt__prelude_define(src, "GEMM_A_MN", 1);
      if (!k->b_kmajor) smelt__prelude_define(src, "GEMM_B_MN", 1);
      if (k->cluster_m > 1) smelt__prelude_define(src, "GEMM_CLUSTER_M", k->cluster_m);
      if (k->cluster_n > 1) smelt__prelude_define(src, "GEMM_CLUSTER_N", k->cluster_n);
      return;
    }
    case SMELT__GK_GEMV:
      snprintf(src->name, sizeof src->name, "gemm_gemv_%s_RC_%dx%d", tc_names[k->tc], k->bm, k->bn);
      src->body = "gemm_gemv.cu";
      smelt__prelude_define(src, "GEMM_TC", k->tc);
      return;
    case SMELT__GK_SM80: break;
  }
  char kind[32];
  if (k->tc == SMELT__TC_FP8)
    snprintf(kind, sizeof kind, "%sx%s", smelt_dtype_name(k->fp8_a), smelt_dtype_name(k->fp8_b));
  else
    snprintf(kind, sizeof kind, "%s", tc_names[k->tc]);
  /* Layout letters as BLAS users say them: A row-major is K-major, B row-major is N-major. */
  snprintf(src->name, sizeof src->name, "gemm_sm80_%s_%c%c_%dx%dx%d_s%d_w%dx%d", kind, k->a_kmajor ? 'R' : 'C',
           k->b_kmajor ? 'C' : 'R', k->bm, k->bn, k->bk, k->stages, k->wm, k->wn);
  src->body = "gemm_sm80.cu";
  smelt__prelude_define(src, "GEMM_TC", k->tc);
  if (k->tc == SMELT__TC_FP8) {
    smelt__prelude_define(src, "GEMM_FP8_A", k->fp8_a);
    smelt__prelude_define(src, "GEMM_FP8_B", k->fp8_b);
  }
  smelt__prelude_define(src, "GEMM_A_KMAJOR", k->a_kmajor);
  smelt__prelude_define(src, "GEMM_B_KMAJOR", k->b_kmajor);
  smelt__prelude_define(src, "GEMM_BM", k->bm);
  smelt__prelude_define(src, "GEMM_BN", k->bn);
  smelt__prelude_define(src, "GEMM_WM", k->wm);
  smelt__prelude_define(src, "GEMM_WN", k->wn);
  smelt__prelude_define(src, "GEMM_STAGES", k->stages);
}

/* The table's kernels, then the epilogue graphs' (src/cuda/gemm_epi.c),
 * then the operand pre-pass. */
int smelt__gemm_variants(smelt__kernel_src *out, int max) {
  smelt__gemm_kernel t[SMELT__GEMM_MAX_KERNELS];
  int n = smelt__gemm_table(t);
  for (int i = 0; i < n && i < max; i++) smelt__gemm_kernel_src(&t[i], &out[i]);
  n += smelt__gemm_graph_variants(max > n ? out + n : NULL, max > n ? max - n : 0);
  if (n < max) smelt__gemm_prep_src(&out[n]);
  return n + 1;
}

/* ---------------------------------------------------------------- facts */

/* 1 if axis `unit` (0 rows, 1 columns) of x has unit stride (or one
 * element) and the pointer and the other strides are 16-byte aligned. */
static int fits_axis(const smelt__gemm_mat *x, smelt_dtype dt, int64_t rows, int64_t cols, int64_t batch, int unit) {
  int64_t ext = unit ? cols : rows, s = unit ? x->cs : x->rs;
  if (ext > 1 && s != 1) return 0;
  return smelt__gemm_mat_align(x, dt, rows, cols, batch, unit) >= 16;
}

int smelt__gemm_sm90_fast_d(const smelt__gemm_state *st, const smelt__gemm_prob *p) {
  const smelt_dtype d = st->dt_d;
  const int64_t es = (int64_t)smelt_dtype_size(d);
  if (st->has_graph || st->has_c || (d != SMELT_DTYPE_BF16 && d != SMELT_DTYPE_F16 && d != SMELT_DTYPE_F32)) return 0;
  if (p->n > 1 && p->d.cs != 1) return 0;
  if (p->m > 1 && p->d.rs < p->n) return 0;
  if (p->m >= ((int64_t)1 << 31) || p->n >= ((int64_t)1 << 31)) return 0; /* TMA coordinates are int32 */
  /* A TMA store clips at the tensor's edge only in whole 16-byte units: a
   * row whose last unit is partial gets that unit written in full, past
   * column N - 1 (into the row's padding, the next tensor, or past the
   * buffer). So every row must end on a 16-byte boundary: N a multiple of
   * 8 (16-bit) or 4 (f32) elements, which also rules out N = 1. */
  if (p->n * es % 16 != 0 || (p->m > 1 && p->d.rs * es % 16 != 0) || (uintptr_t)p->d.data % 16 != 0) return 2;
  return 1;
}

static void prob_facts(const smelt__gemm_state *st, const smelt__gemm_prob *p, int64_t batch, smelt__gemm_facts *f) {
  f->a_k &= fits_axis(&p->a, st->dt_a, p->m, p->k, batch, 1);
  f->a_mn &= fits_axis(&p->a, st->dt_a, p->m, p->k, batch, 0);
  f->b_k &= fits_axis(&p->b, st->dt_b, p->k, p->n, batch, 0);
  f->b_mn &= fits_axis(&p->b, st->dt_b, p->k, p->n, batch, 1);
  f->tma_a[1] &= p->m <= 1 || p->a.rs >= p->k;
  f->tma_a[0] &= p->k <= 1 || p->a.cs >= p->m;
  f->tma_b[1] &= p->n <= 1 || p->b.cs >= p->k;
  f->tma_b[0] &= p->k <= 1 || p->b.rs >= p->n;
  f->sm90_d &= smelt__gemm_sm90_fast_d(st, p) == 1;
  if (p->k < f->k_min) f->k_min = p->k;
}

void smelt__gemm_facts_of(const smelt__gemm_state *st, const smelt__gemm_args *args, smelt__gemm_facts *f) {
  memset(f, 0, sizeof *f); /* promote: the pre-pass's facts set it (smelt__gemm_prep_facts) */
  f->a_k = f->a_mn = f->b_k = f->b_mn = f->sm90_d = 1;
  f->tma_a[0] = f->tma_a[1] = f->tma_b[0] = f->tma_b[1] = 1;
  f->k_min = INT64_MAX;
  f->batch = args->count;
  if (st->mode == SMELT_GEMM_MODE_GROUPED) {
    for (int64_t g = 0; g < args->count; g++) prob_facts(st, &args->groups[g], 1, f);
    const smelt__gemm_prob *p = args->count ? &args->groups[0] : &st->prob;
    f->m = p->m;
    f->n = p->n;
    f->k = p->k;
    return;
  }
  /* Grouped by offsets: B steps by its batch stride from group to group
   * (A, C and D by rows, which the row stride's alignment covers); TMA
   * reads B's groups through one 3-D map, which wants a positive stride. */
  prob_facts(st, &args->prob,
             st->mode == SMELT_GEMM_MODE_BATCHED || st->mode == SMELT_GEMM_MODE_GROUPED_OFFS ? args->count : 1, f);
  if (st->mode == SMELT_GEMM_MODE_GROUPED_OFFS && args->count > 1 && args->prob.b.bs < 1) f->tma_b[0] = f->tma_b[1] = 0;
  f->batch_d16 = st->mode == SMELT_GEMM_MODE_BATCHED &&
                 (args->count <= 1 || (args->prob.d.bs > 0 && args->prob.d.bs * (int64_t)smelt_dtype_size(st->dt_d) % 16 == 0));
  f->m = args->prob.m;
  f->n = args->prob.n;
  f->k = args->prob.k;
}

/* ---------------------------------------------------------------- selection */

static int tc_kind(const smelt__gemm_state *st) {
  const smelt_dtype a = st->dt_a, b = st->dt_b;
  const int f8a = a == SMELT_DTYPE_E4M3 || a == SMELT_DTYPE_E5M2, f8b = b == SMELT_DTYPE_E4M3 || b == SMELT_DTYPE_E5M2;
  if (st->acc == SMELT_GEMM_ACC_I32) return SMELT__TC_I8;
  if (st->acc != SMELT_GEMM_ACC_F32) return SMELT__TC_NONE;
  if (a == SMELT_DTYPE_F16 && b == SMELT_DTYPE_F16) return SMELT__TC_F16;
  if (a == SMELT_DTYPE_BF16 && b == SMELT_DTYPE_BF16) return SMELT__TC_BF16;
  if (f8a && f8b) return SMELT__TC_FP8;
  if (a == SMELT_DTYPE_F32 && b == SMELT_DTYPE_F32) {
    if (st->desc.math.op == SMELT_GEMM_MATH_TF32) return SMELT__TC_TF32;
    if (st->desc.math.op == SMELT_GEMM_MATH_3XTF32) return SMELT__TC_3XTF32;
  }
  return SMELT__TC_NONE;
}

int smelt__gemm_fits(const smelt__gemm_kernel *k, const smelt__gemm_state *st, const smelt__gemm_facts *f) {
  /* Block scales take the block-scaled kernels, and only they do; with K =
   * 0 there is nothing to scale, and any kernel writes the epilogue. */
  if (k->blk != (st->blk && f->k > 0)) return 0;
  switch (k->fam) {
    case SMELT__GK_SIMT: return k->acc == st->acc;
    case SMELT__GK_REDUCE: return 0;
    case SMELT__GK_SM90: {
      const int tma = f->tma_a[k->a_kmajor] && f->tma_b[k->b_kmajor];
      /* Plain GEMMs with K >= 1 whose sizes TMA can address (< 2^32);
       * parallel splits of them whose f32 partial sums the fast epilogue
       * can store (N a multiple of 4: rows of whole 16-byte units), except
       * on the ping-pong and cluster kernels; and grouped ones (host scheduling) whose
       * every group has K >= 1 and a D for the fast epilogue (the only one
       * grouped runs have). */
      if (st->mode == SMELT_GEMM_MODE_GROUPED) {
        if (!f->sm90_d || f->k_min < 1 || f->k_min == INT64_MAX || !tma) return 0;
      } else if (st->mode == SMELT_GEMM_MODE_GROUPED_OFFS) {
        /* Grouped by offsets: 16-bit types or block-scaled fp8, the fast
         * epilogue (D as smelt__gemm_sm90_fast_d wants it, T and N below
         * 2^31, no C), K >= 1 and B's groups at a positive batch stride (one
         * 3-D map; its 16-byte alignment is in f->b_k or f->b_mn); K-major A
         * (the groups' rows stacked), B either way; not on the ping-pong or
         * cluster kernels, whose schedules need the tile count. */
        if ((k->tc != SMELT__TC_F16 && k->tc != SMELT__TC_BF16 && !k->blk) || !k->a_kmajor || pingpong(k) ||
            clustered(k) || !f->sm90_d || f->k < 1 || f->k >= ((int64_t)1 << 31) || !tma)
          return 0;
      } else if (st->mode == SMELT_GEMM_MODE_BATCHED) {
        /* Batched: the fast epilogue through a 3-D map of D, below 2^31
         * tiles in all; not on the ping-pong or cluster kernels, nor tf32
         * (its operands come rounded, one entry at a time, through the
         * pre-pass: src/cuda/gemm_prep.c). */
        if (pingpong(k) || clustered(k) || k->tc == SMELT__TC_TF32 || !f->sm90_d || !f->batch_d16 || f->k < 1 ||
            !tma || f->m >= ((int64_t)1 << 31) || f->n >= ((int64_t)1 << 31) || f->k >= ((int64_t)1 << 32) ||
            smelt__ceil_div(f->m, k->bm) * smelt__ceil_div(f->n, k->bn) * f->batch >= ((int64_t)1 << 31))
          return 0;
      } else if (st->mode == SMELT_GEMM_MODE_SPLIT_K_PARALLEL) {
        if (pingpong(k) || clustered(k) || f->n % 4 != 0 || f->k < 1 || !tma || f->m >= ((int64_t)1 << 31) ||
            f->n >= ((int64_t)1 << 31) || f->k >= ((int64_t)1 << 32))
          return 0;
      } else if (st->mode != SMELT_GEMM_MODE_PLAIN || st->split_k > 1 || f->k < 1 || !tma ||
                 f->m >= ((int64_t)1 << 32) || f->n >= ((int64_t)1 << 32) || f->k >= ((int64_t)1 << 32)) {
        return 0;
      }
      /* fp8 wgmma accumulates with fewer bits than f32 (gemm_sm90.cu): only
       * for outputs whose own rounding is larger, or with the block-scaled
       * kernel's promotion every 128 of K. */
      if (k->tc == SMELT__TC_FP8 && !k->blk && st->dt_d != SMELT_DTYPE_F16 && st->dt_d != SMELT_DTYPE_BF16 &&
          st->dt_d != SMELT_DTYPE_E4M3 && st->dt_d != SMELT_DTYPE_E5M2)
        return 0;
      /* 3xtf32 split operands take the kernel that promotes its sums, and
       * only they do. */
      if ((k->promote != 0) != (f->promote != 0)) return 0;
      /* The ping-pong kernel has only the fast epilogue. */
      if (pingpong(k) && !f->sm90_d) return 0;
      break;
    }
    case SMELT__GK_GEMV:
      /* At most its 16 rows a problem; plain, batched, or a parallel split
       * (slices of whole chunks, partial sums through gemm_reduce). */
      if (st->has_graph || f->m > k->bm || (st->mode != SMELT_GEMM_MODE_PLAIN && st->mode != SMELT_GEMM_MODE_BATCHED &&
                           st->mode != SMELT_GEMM_MODE_SPLIT_K_PARALLEL))
        return 0;
      break;
    case SMELT__GK_SM80: break;
  }
  if (k->tc != tc_kind(st)) return 0;
  if (k->tc == SMELT__TC_FP8 && (k->fp8_a != st->dt_a || k->fp8_b != st->dt_b)) return 0;
  return (k->a_kmajor ? f->a_k : f->a_mn) && (k->b_kmajor ? f->b_k : f->b_mn);
}

static int tile_ok(const smelt__gemm_kernel *k, const smelt_gemm_tile *t) {
  return (!t->m || t->m == k->bm) && (!t->n || t->n == k->bn) && (!t->k || t->k == k->bk) &&
         (!t->stages || t->stages == k->stages) && (!t->warps_m || t->warps_m == k->wm) &&
         (!t->warps_n || t->warps_n == k->wn) && (!t->cluster_m || t->cluster_m == k->cluster_m) &&
         (!t->cluster_n || t->cluster_n == k->cluster_n);
}

/* Lists the tiles of the kernels that fit (for the UNSUPPORTED message). */
static void list_tiles(const smelt__gemm_kernel *table, int n, const smelt__gemm_state *st, const smelt__gemm_facts *f,
                       int tensor_op, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = 0;
  for (int i = 0; i < n && used < len; i++) {
    const smelt__gemm_kernel *k = &table[i];
    if (!smelt__gemm_fits(k, st, f) || (k->fam != SMELT__GK_SIMT) != tensor_op) continue;
    used += (size_t)snprintf(buf + used, len - used, "%s%dx%dx%d stages %d warps %dx%d cluster %dx%d",
                             used ? ", " : "", k->bm, k->bn, k->bk, k->stages, k->wm, k->wn, k->cluster_m,
                             k->cluster_n);
  }
  if (!buf[0]) snprintf(buf, len, "none");
}

/* The GEMV kernel for these operands and this tile description, or -1. */
static int gemv_pick(const smelt__gemm_state *st, const smelt__gemm_facts *f, const smelt__gemm_kernel *table, int n) {
  for (int i = 0; i < n; i++)
    if (table[i].fam == SMELT__GK_GEMV && smelt__gemm_fits(&table[i], st, f) && tile_ok(&table[i], &st->desc.tile))
      return i;
  return -1;
}

smelt_status smelt__gemm_select(const smelt__gemm_state *st, const smelt__gemm_facts *f, const smelt_device_info *dev,
                                const smelt__gemm_kernel *table, int n, int *kernel, char *why, size_t why_n) {
  const smelt_gemm_desc *d = &st->desc;
  const smelt_gemm_tile *t = &d->tile;
  const int tc = tc_kind(st), sm80 = dev->cc_major >= 8;
  const int want_tc = d->math.opclass != SMELT_GEMM_OPCLASS_SIMT && tc && sm80;
  int best = -1, best_score = -1;
  const int skinny = want_tc ? gemv_pick(st, f, table, n) : -1;
  if (skinny >= 0) {
    snprintf(why, why_n, "skinny M: GEMV streaming B");
    *kernel = skinny;
    return SMELT_OK;
  }
  if (want_tc && dev->cc_major == 9 && dev->cc_minor == 0) {
    /* Hopper: the persistent wgmma kernel with 128 x 256 tiles when they
     * keep at least half the SMs busy and do not pad N much, else its 128 x
     * 64 or 64 x 64 tile
     * (16-bit types; the others go to mma.sync), or the tile the
     * description asks for. Grouped and batched runs count the first
     * problem's tiles once per problem (and take its M for the M <= 64
     * rule). Grouped by
     * offsets, whose row counts the host never sees: T's row tiles plus
     * half a tile for each group's ragged end (at most min(G, T) groups
     * have rows), and T / G rows for the M <= 64 rule, which then also
     * rules out the wide tile (groups of a few rows would waste most of
     * its 128 rows' tensor work; the narrower tiles stream B all the same). */
    const int offs = st->mode == SMELT_GEMM_MODE_GROUPED_OFFS;
    const int64_t offs_ends = offs ? (f->batch < f->m ? f->batch : f->m) / 2 : 0;
    const int64_t m_rule = offs && f->batch > 0 ? smelt__ceil_div(f->m, f->batch) : f->m;
    const int per_problem = st->mode == SMELT_GEMM_MODE_GROUPED || st->mode == SMELT_GEMM_MODE_BATCHED;
    const int64_t copies = per_problem && f->batch > 0 ? f->batch : 1;
    const int64_t wide = (smelt__ceil_div(f->m, 128) + offs_ends) * smelt__ceil_div(f->n, 256) * copies;
    /* The 64 x 64 tile (one consumer warpgroup) instead of the 128 x 64
     * one when those would leave at least half the SMs idle: it has up to
     * twice their CTAs, all in one wave (cuBLAS runs 128 x 4096 x 4096 on
     * 64 x 64 tiles); and for M <= 64, where the tile counts are equal:
     * its 13 stages keep more of B in flight than 8 of 128 x 64, half of
     * whose A rows are zeros (on H100, 64 x 4096 x 4096: 18.6 against 29.5
     * us; docs/PERF.md, GEMM: decisions). 64 x 128 only when asked for. */
    const int64_t narrow = (smelt__ceil_div(f->m, 128) + offs_ends) * smelt__ceil_div(f->n, 64) * copies;
    const int rows64 = m_rule <= 64 || 2 * narrow <= dev->sm_count;
    /* Nor the wide tile when it pads N by a third more than the 64-wide
     * ones (N <= 192, 320, 384, 576, ...): the padding is tensor work
     * thrown away, up to 3/4 of it at N = 64 (on H100, the 200704 x 64 x
     * 576 GEMM of a conv layer ran at 120 TFLOP/s on it; the conv's own
     * 128 x 64 tiles at 300). */
    const int pads_n = pads_n_over(f->n, 256);
    const int asked = t->m || t->n || t->k || t->stages || t->warps_m || t->warps_n || t->cluster_m || t->cluster_n;
    /* Short K takes the ping-pong kernel in plain runs where one fits
     * (smelt__gemm_short_k_pingpong: 128 x 128 tiles), unless its 128
     * columns pad N as above (ResNet's stem as im2col, N 64 and K 152, fell
     * from 26.4 to 24.9 TFLOP/s on it). Grouped runs stay cooperative: CR
     * grouped 8 x 4096 x 14336 x 1024 (MoE's weight gradients) lost on it
     * (662 -> 600 TFLOP/s on H100). */
    int want_pp = 0;
    if (!asked && st->mode == SMELT_GEMM_MODE_PLAIN && !pads_n_over(f->n, 128) &&
        smelt__gemm_short_k_pingpong(f->k, smelt__ceil_div(f->m, 128) * smelt__ceil_div(f->n, 128), dev->sm_count))
      for (int i = 0; i < n && !want_pp; i++)
        want_pp = pingpong(&table[i]) && smelt__gemm_fits(&table[i], st, f);
    /* Otherwise the ping-pong kernel only when asked for (or timed by the
     * autotuner): at longer K it ran behind the cooperative one, plain and
     * with bias + GELU alike (docs/PERF.md, GEMM: decisions). The cluster
     * kernels likewise: pairs sharing B matched it on plain squares and
     * lost with bias + GELU and on uneven groups; pairs and quads sharing A
     * lost on skinny M (docs/PERF.md, GEMM: decisions). */
    for (int i = 0; i < n; i++) {
      const smelt__gemm_kernel *k = &table[i];
      if (k->fam != SMELT__GK_SM90 || !smelt__gemm_fits(k, st, f) || !tile_ok(k, t)) continue;
      /* The promoting tf32 kernel as the wide one: when its tiles keep
       * half the SMs busy. */
      if (!asked && k->promote && 2 * smelt__ceil_div(f->m, 128) * smelt__ceil_div(f->n, 128) < dev->sm_count)
        continue;
      if (!asked && (want_pp ? !pingpong(k)
                             : pingpong(k) || clustered(k) ||
                                   (k->bn == 256 && (2 * wide < dev->sm_count || (offs && rows64) || pads_n)) ||
                                   (k->bm == 64 && (k->bn != 64 || !rows64)) || (k->bm == 128 && k->bn == 64 && rows64)))
        continue;
      snprintf(why, why_n, "Hopper: TMA + wgmma, persistent%s%s",
               pingpong(k)    ? ", ping-pong"
               : k->bm == 64  ? ", 64-row tile"
               : k->bn == 256 ? ""
                              : ", narrow tile",
               clustered(k) ? ", cluster multicast" : "");
      *kernel = i;
      return SMELT_OK;
    }
  }
  if (st->blk && f->k > 0)
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        "smelt_gemm: block scales run on Hopper (sm_90a) only, in the tile 128x128x128 stages 6, with "
                        "A row-major and B column-major (K-major) 16-byte aligned, and batched or grouped only into a "
                        "16-bit or f32 row-major D of rows of whole 16-byte units without C (device %s; A K-major %s, "
                        "B K-major %s)",
                        dev->arch, f->a_k ? "ok" : "no", f->b_k ? "ok" : "no");
  if (want_tc) {
    /* The large tile unless it leaves SMs without work. */
    const int64_t big_tiles = smelt__ceil_div(f->m, 128) * smelt__ceil_div(f->n, 128) * (f->batch > 0 ? f->batch : 1);
    const int prefer_big = big_tiles >= dev->sm_count;
    for (int i = 0; i < n; i++) {
      const smelt__gemm_kernel *k = &table[i];
      if (k->fam != SMELT__GK_SM80 || !smelt__gemm_fits(k, st, f) || !tile_ok(k, t)) continue;
      int score = 4 * k->a_kmajor + 2 * k->b_kmajor + ((k->bm == 128) == prefer_big);
      if (score > best_score) {
        best = i;
        best_score = score;
      }
    }
    if (best >= 0) {
      snprintf(why, why_n, "tensor cores, %s", table[best].bm == 128 ? "large tile" : "small tile for few tiles");
      *kernel = best;
      return SMELT_OK;
    }
  }
  if (d->math.opclass == SMELT_GEMM_OPCLASS_TENSOR_OP) {
    char tiles[256];
    if (!sm80)
      return smelt__error(SMELT_STATUS_UNSUPPORTED, "smelt_gemm: tensor-op kernels need sm_80 or newer (device is %s)",
                          dev->arch);
    if (!tc)
      return smelt__error(SMELT_STATUS_UNSUPPORTED,
                          "smelt_gemm: opclass TENSOR_OP: A.dtype=%s x B.dtype=%s with acc %s and math op %d has no "
                          "tensor-op kernel (supported: f16, bf16, e4m3/e5m2 with acc f32; f32 with math TF32 or "
                          "3XTF32; i8 with acc i32)",
                          smelt_dtype_name(st->dt_a), smelt_dtype_name(st->dt_b), acc_names[st->acc],
                          (int)d->math.op);
    list_tiles(table, n, st, f, 1, tiles, sizeof tiles);
    if (!strcmp(tiles, "none"))
      return smelt__error(SMELT_STATUS_UNSUPPORTED,
                          "smelt_gemm: opclass TENSOR_OP needs A and B 16-byte aligned (pointer and strides) with "
                          "unit stride along K%s (A: K-major %s, M-major %s; B: K-major %s, N-major %s)",
                          tc == SMELT__TC_I8 || tc == SMELT__TC_FP8 ? " (8-bit types)" : " or along M/N",
                          f->a_k ? "ok" : "no", f->a_mn ? "ok" : "no", f->b_k ? "ok" : "no", f->b_mn ? "ok" : "no");
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        "smelt_gemm: desc.tile %dx%dx%d stages %d warps %dx%d cluster %dx%d matches no tensor-op kernel "
                        "(available: %s)",
                        t->m, t->n, t->k, t->stages, t->warps_m, t->warps_n, t->cluster_m, t->cluster_n, tiles);
  }
  for (int i = 0; i < n; i++)
    if (table[i].fam == SMELT__GK_SIMT && smelt__gemm_fits(&table[i], st, f) && tile_ok(&table[i], t)) {
      snprintf(why, why_n, "%s",
               !tc || !sm80 ? "SIMT: no tensor-op kernel for these dtypes on this device"
               : d->math.opclass == SMELT_GEMM_OPCLASS_SIMT ? "SIMT as asked"
                                                             : "SIMT: operands not aligned or tile not available for tensor ops");
      *kernel = i;
      return SMELT_OK;
    }
  char tiles[256];
  list_tiles(table, n, st, f, 0, tiles, sizeof tiles);
  return smelt__error(SMELT_STATUS_UNSUPPORTED,
                      "smelt_gemm: desc.tile %dx%dx%d stages %d warps %dx%d cluster %dx%d matches no kernel for these "
                      "operands (SIMT: %s)",
                      t->m, t->n, t->k, t->stages, t->warps_m, t->warps_n, t->cluster_m, t->cluster_n, tiles);
}

int smelt__gemm_reduce_kernel(const smelt__gemm_kernel *table, int n, smelt_gemm_acc acc) {
  /* f16 accumulators hand over f32 partial sums. */
  smelt_gemm_acc want = acc == SMELT_GEMM_ACC_F16 ? SMELT_GEMM_ACC_F32 : acc;
  for (int i = 0; i < n; i++)
    if (table[i].fam == SMELT__GK_REDUCE && table[i].acc == want) return i;
  return -1;
}

int smelt__gemm_candidates(const smelt__gemm_state *st, const smelt__gemm_facts *f, const smelt_device_info *dev,
                           const smelt__gemm_kernel *table, int n, int *out, int max) {
  const smelt_gemm_desc *d = &st->desc;
  const int tensor_ok = d->math.opclass != SMELT_GEMM_OPCLASS_SIMT && tc_kind(st) && dev->cc_major >= 8;
  const int hopper = dev->cc_major == 9 && dev->cc_minor == 0;
  int count = 0;
  for (int i = 0; i < n; i++) {
    const smelt__gemm_kernel *k = &table[i];
    if (k->fam == SMELT__GK_REDUCE || !smelt__gemm_fits(k, st, f) || !tile_ok(k, &d->tile)) continue;
    if (k->fam == SMELT__GK_SIMT ? d->math.opclass == SMELT_GEMM_OPCLASS_TENSOR_OP
                                 : !tensor_ok || (k->fam == SMELT__GK_SM90 && !hopper))
      continue;
    if (count < max) out[count] = i;
    count++;
  }
  return count;
}

/* ---------------------------------------------------------------- the operand pre-pass */

/* 16-bit operand `which` of p needs the PITCH copy: it has a unit-stride
 * axis (the copy keeps it) and its rows are not whole 128-byte lines apart,
 * or TMA cannot read it at all (rows not 16 bytes apart or overlapping, a
 * start or a batch stride not 16-byte aligned: *no_tma set). */
static int pitch_need(int which, const smelt__gemm_prob *p, const smelt__gemm_facts *f, int *no_tma) {
  smelt__gemm_prep_geom g;
  /* Below 2^31 16-byte units (32 GiB): the copy numbers them in 32 bits. */
  if (!smelt__gemm_prep_geom_of(which, p, &g) || g.rows * smelt__ceil_div(g.cols, 8) >= ((int64_t)1 << 31)) return 0;
  const smelt__gemm_mat *x = which ? &p->b : &p->a;
  const int64_t bytes = g.pitch * 2;
  const int tma = (g.rows <= 1 || (g.pitch >= g.cols && bytes % 16 == 0)) && (uintptr_t)x->data % 16 == 0 &&
                  (f->batch <= 1 || x->bs * 2 % 16 == 0);
  if (!tma) *no_tma = 1;
  return !tma || (g.rows > 1 && bytes % 128 != 0);
}

/* 1 when the PITCH copies of the operands in need[] save more time than
 * they cost, by the H100 figures below: the GEMM at 785 TFLOP/s on rows
 * 128 bytes apart against 382 on rows 16 bytes apart (or, rows TMA cannot
 * read, SIMT at a tenth of 785 at best), and the copy at 4 bytes an
 * element moved (read and write) at 3 TB/s plus 4 us of launch and tail.
 * Square problems with rows TMA reads break even near 1600 (rows it cannot
 * read: near 600); 5000^3 saves about 336 us for 71.
 * A tile asked for names the Hopper kernel, which then gets the copy at
 * any size. */
static int pitch_pays(const smelt__gemm_state *st, const smelt__gemm_prob *p, const smelt__gemm_facts *f,
                      const int need[2], int no_tma) {
  const smelt_gemm_tile *t = &st->desc.tile;
  if (t->m || t->n || t->k || t->stages || t->warps_m || t->warps_n || t->cluster_m || t->cluster_n) return 1;
  const double batch = st->mode == SMELT_GEMM_MODE_BATCHED && f->batch > 1 ? (double)f->batch : 1.0;
  const double flops = 2.0 * (double)p->m * (double)p->n * (double)p->k * batch;
  const double elems = ((need[0] ? (double)p->m : 0.0) + (need[1] ? (double)p->n : 0.0)) * (double)p->k;
  const double saved_ns = flops / (no_tma ? 78.5e3 : 382e3) - flops / 785e3;
  return saved_ns > batch * (4.0 * elems / 3000.0 + 4000.0);
}

/* Hopper only: elsewhere mma.sync rounds in registers (cvt.rna) and takes
 * every layout. Chosen for correct rounding: the wgmma reads tf32 by
 * truncation (a bias of about -7e-4 on every result), and rounding the
 * staged tiles in the kernel would spend the shared-memory bandwidth the
 * wgmma needs; 3xtf32 has no Hopper kernel of its own, and its tripled K
 * runs on the tf32 one. The pass moves 8 bytes per operand element for
 * tf32, 16 for 3xtf32 and 2 for an fp8 transpose. Plain and batched
 * GEMMs (a batch runs one entry at a time). A tile that only
 * mma.sync has keeps the operands as they are (the plan falls back when
 * the selector gives the prepped problem no Hopper kernel).
 *
 * 16-bit operands are chosen for speed. Measured on H100, bf16 RC: 5000^3
 * (rows 10000 bytes apart) ran at 382 TFLOP/s, 4992^3 at 785 and m = n =
 * 5000, k = 5120 at 675: the kernel's 128-byte TMA box rows read at half
 * speed when the operands' rows are not whole lines apart (A's and B's
 * pitch matter, D's does not; RR with N = 5000 the same through B's rows).
 * A cp.async producer in place of TMA ran at 261; cuBLAS runs 5000^3 at
 * 657. Rows not 16 bytes apart (K odd) cannot use TMA at all and ran on
 * SIMT. So such an operand is copied, its major-ness kept, into rows a
 * multiple of 128 bytes apart (the kernel reads K in 64-element steps with
 * zero fill past K: the padding costs no math), the operands that need it
 * only, when pitch_pays; never for M or N <= 16 (the GEMV kernel, or a
 * problem too small to pay for a launch). */
int smelt__gemm_prep_choose(const smelt__gemm_state *st, const smelt__gemm_prob *p, const smelt__gemm_facts *f,
                            const smelt_device_info *dev, smelt__gemm_prep prep[2]) {
  prep[0] = prep[1] = SMELT__PREP_NONE;
  if (dev->cc_major != 9 || dev->cc_minor != 0 ||
      (st->mode != SMELT_GEMM_MODE_PLAIN && st->mode != SMELT_GEMM_MODE_BATCHED) || st->split_k > 1 || f->k < 1 ||
      st->desc.math.opclass == SMELT_GEMM_OPCLASS_SIMT || st->blk)
    return 0;
  switch (tc_kind(st)) {
    case SMELT__TC_TF32: prep[0] = prep[1] = SMELT__PREP_TF32; break;
    case SMELT__TC_3XTF32: prep[0] = prep[1] = SMELT__PREP_SPLIT; break;
    case SMELT__TC_FP8:
      if (!f->a_k) prep[0] = SMELT__PREP_COPY;
      if (!f->b_k) prep[1] = SMELT__PREP_COPY;
      break;
    case SMELT__TC_F16:
    case SMELT__TC_BF16: {
      if (p->m <= 16 || p->n <= 16) break;
      int no_tma = 0;
      const int need[2] = {pitch_need(0, p, f, &no_tma), pitch_need(1, p, f, &no_tma)};
      if ((need[0] || need[1]) && pitch_pays(st, p, f, need, no_tma))
        for (int w = 0; w < 2; w++)
          if (need[w]) prep[w] = SMELT__PREP_PITCH;
      break;
    }
    default: break;
  }
  return prep[0] || prep[1];
}

int64_t smelt__gemm_prep_gemm_k(const smelt__gemm_state *st, const smelt__gemm_prep prep[2], int64_t k) {
  /* A split's parts are kp apart, zero-filled between; otherwise TMA's
   * zero fill past K stands in for the workspace's padding. */
  return prep[0] == SMELT__PREP_SPLIT ? 3 * smelt__gemm_prep_kp(k, st->dt_a) : k;
}

void smelt__gemm_prep_facts(const smelt__gemm_state *st, const smelt__gemm_prob *p, const smelt__gemm_facts *f,
                            const smelt__gemm_prep prep[2], smelt__gemm_state *ps, smelt__gemm_facts *pf) {
  *ps = *st;
  *pf = *f;
  ps->mode = SMELT_GEMM_MODE_PLAIN; /* a batched GEMM runs one entry at a time */
  if (prep[0] == SMELT__PREP_SPLIT) ps->desc.math.op = SMELT_GEMM_MATH_TF32;
  pf->k = pf->k_min = smelt__gemm_prep_gemm_k(st, prep, p->k);
  pf->promote = prep[0] == SMELT__PREP_SPLIT;
  /* A prepped operand is a K-major workspace with whole rows (a PITCH
   * copy: of its own major-ness); the others keep their facts. */
  for (int w = 0; w < 2; w++) {
    if (!prep[w]) continue;
    smelt__gemm_prep_geom g = {.kmajor = 1};
    if (prep[w] == SMELT__PREP_PITCH) smelt__gemm_prep_geom_of(w, p, &g);
    int *k_ok = w ? &pf->b_k : &pf->a_k, *mn_ok = w ? &pf->b_mn : &pf->a_mn, *tma = w ? pf->tma_b : pf->tma_a;
    *k_ok = tma[1] = g.kmajor;
    *mn_ok = tma[0] = !g.kmajor;
  }
}
