/* Grouped GEMM by device offsets on the Hopper kernel (kernels/gemm_sm90.cu,
 * MODE_GROUPED_OFFS: persistent CTAs walk the tiles of all groups from the
 * offsets; pieces that cross a group's end row are stored by the threads
 * with a row mask). The selector's choice is checked on a faked sm_90
 * device on every machine; the GPU cases run on an sm_90 device only and
 * compare against the CPU reference (tests/test_gemm.c's offs_check:
 * poisoned D with padded rows and guards, so rows no group owns, rows of
 * the next group and the padding must stay untouched), each also checking
 * that the plan runs the kernel it names. */
#include "gemm_offs.h"
#include "harness.h"

/* The selector on a faked device: the Hopper kernel for 16-bit grouped
 * runs by offsets whose D its fast epilogue writes, with the wide tile
 * when T's row tiles fill the GPU and the 64-row tile when groups average
 * 64 rows or fewer; mma.sync otherwise (sm_80, a D with a partial 16-byte
 * unit per row or C, K = 0, B's groups without a positive stride, the
 * ping-pong tile asked for, tf32); nothing for a cluster asked for. */
typedef struct pick_case {
  int cc_major;
  smelt_dtype dt; /* A, B and D (f32: tf32 math) */
  int64_t t, n, k, g;
  int sm90_d, tma;
  int tile_m, tile_n, cluster_m;
  const char *want; /* the start of the kernel's name; "" for UNSUPPORTED */
} pick_case;

static void test_selector(void) {
  static const pick_case cases[] = {
      {9, SMELT_DTYPE_BF16, 49152, 1408, 2048, 64, 1, 1, 0, 0, 0, "gemm_sm90_bf16_RC_128x256x64_s4"},
      {8, SMELT_DTYPE_BF16, 49152, 1408, 2048, 64, 1, 1, 0, 0, 0, "gemm_sm80_bf16_RC_"},
      {9, SMELT_DTYPE_BF16, 8192, 14336, 4096, 8, 1, 1, 0, 0, 0, "gemm_sm90_bf16_RC_128x256x64_s4"},
      {9, SMELT_DTYPE_F16, 8192, 14336, 4096, 8, 1, 1, 0, 0, 0, "gemm_sm90_f16_RC_128x256x64_s4"},
      /* A decode step: 64 tokens over 8 experts (8 rows a group on average). */
      {9, SMELT_DTYPE_BF16, 64, 14336, 4096, 8, 1, 1, 0, 0, 0, "gemm_sm90_bf16_RC_64x64x64_s13"},
      /* Few wide tiles, groups of 128 rows: the narrow tile. */
      {9, SMELT_DTYPE_BF16, 1024, 1024, 4096, 8, 1, 1, 0, 0, 0, "gemm_sm90_bf16_RC_128x64x64_s8"},
      {9, SMELT_DTYPE_BF16, 8192, 14336, 4096, 8, 0, 1, 0, 0, 0, "gemm_sm80_bf16_RC_"},
      {9, SMELT_DTYPE_BF16, 8192, 14336, 0, 8, 1, 1, 0, 0, 0, "gemm_sm80_bf16_RC_"},
      {9, SMELT_DTYPE_BF16, 8192, 14336, 4096, 8, 1, 0, 0, 0, 0, "gemm_sm80_bf16_RC_"},
      {9, SMELT_DTYPE_BF16, 8192, 14336, 4096, 8, 1, 1, 128, 64, 0, "gemm_sm90_bf16_RC_128x64x64_s8"},
      {9, SMELT_DTYPE_BF16, 8192, 14336, 4096, 8, 1, 1, 128, 128, 0, "gemm_sm80_bf16_RC_128x128x32_s4_w2x4"},
      {9, SMELT_DTYPE_BF16, 8192, 14336, 4096, 8, 1, 1, 0, 0, 2, ""},
      {9, SMELT_DTYPE_F32, 8192, 14336, 4096, 8, 1, 1, 0, 0, 0, "gemm_sm80_tf32_RC_"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const pick_case *c = &cases[i];
    smelt__gemm_state st = bf16_state(SMELT_GEMM_MODE_GROUPED_OFFS, 1);
    st.dt_a = st.dt_b = st.dt_d = c->dt;
    if (c->dt == SMELT_DTYPE_F32) st.desc.math.op = SMELT_GEMM_MATH_TF32;
    st.desc.tile.m = c->tile_m;
    st.desc.tile.n = c->tile_n;
    st.desc.tile.cluster_m = c->cluster_m;
    const smelt__gemm_facts f = {.a_k = 1, .a_mn = 1, .b_k = 1, .b_mn = 1, .tma_a = {c->tma, c->tma},
                                 .tma_b = {c->tma, c->tma}, .m = c->t, .n = c->n, .k = c->k, .batch = c->g,
                                 .sm90_d = c->sm90_d, .k_min = c->k};
    smelt_status s;
    const char *got = pick_name(&st, &f, c->cc_major, 0, &s);
    if (strncmp(got, c->want, strlen(c->want)) || (!c->want[0] && s != SMELT_STATUS_UNSUPPORTED))
      th_fail(__FILE__, __LINE__, "case %zu: picked \"%s\" (%s), want \"%s...\"", i, got, smelt_status_name(s),
              c->want);
  }
  smelt__gemm_state st = bf16_state(SMELT_GEMM_MODE_GROUPED_OFFS, 1);
  st.desc.math.opclass = SMELT_GEMM_OPCLASS_SIMT;
  const smelt__gemm_facts f = {.a_k = 1, .a_mn = 1, .b_k = 1, .b_mn = 1, .tma_a = {1, 1}, .tma_b = {1, 1},
                               .m = 8192, .n = 14336, .k = 4096, .batch = 8, .sm90_d = 1, .k_min = 4096};
  smelt_status s;
  CHECK(!strcmp(pick_name(&st, &f, 9, 0, &s), "gemm_simt_accf32"));
}

/* A bf16 RC case of T x N x K over G groups ending at offs, with the
 * tensor-op alignment, run on `kernel`'s tile (tile_m x tile_n; 0: the
 * selector's). */
static ocase hcase(int64_t t, int64_t n, int64_t k, int64_t g, const int64_t *offs, int tile_m, int tile_n,
                   const char *kernel) {
  ocase o = ocase_make(SMELT_DTYPE_BF16, t, n, k, g, offs);
  o.b_col = o.ld16 = 1;
  o.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
  o.kernel = kernel;
  if (tile_m) { /* asked for (the selector's choice otherwise) */
    o.tile_m = tile_m;
    o.tile_n = tile_n;
  }
  return o;
}

/* Uneven groups on each tile: empty ones (first and inner), one of 2 rows
 * (smaller than a tile), one over many tiles, rows past the last offset
 * (poisoned, left alone), N a multiple of neither 64 nor 256, K of a
 * partial K step; bias per group. */
static void test_gpu_uneven(void) {
  if (!th_cuda_sm90()) SKIP("no sm_90 device");
  static const int64_t offs[] = {0, 5, 133, 133, 400, 402, 640};
  ocase o = hcase(680, 264, 72, 7, offs, 128, 256, "gemm_sm90_bf16_RC_128x256x64_s4");
  o.has_bias = 1;
  o.bias = SMELT_DTYPE_BF16;
  o.act = SMELT_ACT_GELU;
  offs_check(&o, "sm90 wide i32 bias gelu");
  /* f16, int64 offsets, no bias, SiLU, on the narrow tile. */
  o = hcase(680, 264, 72, 7, offs, 128, 64, "gemm_sm90_f16_RC_128x64x64_s8");
  o.a = o.b = o.d = SMELT_DTYPE_F16;
  o.offs64 = 1;
  o.act = SMELT_ACT_SILU;
  offs_check(&o, "sm90 narrow f16 i64 silu");
  /* f32 D (the fast epilogue's two 32-column halves a piece) on the
   * selector's tile for few tiles (64 rows), with an f32 bias. */
  o = hcase(680, 72, 200, 7, offs, 0, 0, "gemm_sm90_bf16_RC_64x64x64_s13");
  o.d = SMELT_DTYPE_F32;
  o.has_bias = 1;
  offs_check(&o, "sm90 64-row f32 D bias");
}

/* Many small uneven groups (some empty, several group ends in one tile's
 * rows) on the wide tile with int32 offsets, and on the narrow one with
 * int64 offsets. */
static void test_gpu_many(void) {
  if (!th_cuda_sm90()) SKIP("no sm_90 device");
  static int64_t offs[70];
  int64_t run = 0;
  for (int g = 0; g < 70; g++) {
    run += g % 7 == 3 ? 0 : (int64_t)th_rand_uniform(0, 60);
    offs[g] = run;
  }
  ocase o = hcase(run + 17, 136, 72, 70, offs, 128, 256, "gemm_sm90_bf16_RC_128x256x64_s4");
  o.has_bias = 1;
  offs_check(&o, "sm90 70 groups");
  /* The epilogue's rolled loop (leaky ReLU) on the narrow tile. */
  o.offs64 = 1;
  o.tile_n = 64;
  o.act = SMELT_ACT_LEAKY_RELU;
  o.kernel = "gemm_sm90_bf16_RC_128x64x64_s8";
  offs_check(&o, "sm90 70 groups narrow i64 leaky");
}

/* RR (B as [G, K, N], N contiguous: the MN-major B through a 3-D map of
 * 64-column panels): uneven groups on every tile the selector has for it,
 * N a multiple of neither 64 nor 256, K of a partial step, bias. */
static void test_gpu_rr(void) {
  if (!th_cuda_sm90()) SKIP("no sm_90 device");
  static const int64_t offs[] = {0, 5, 133, 133, 400, 402, 640};
  static const int tiles[][2] = {{128, 256}, {128, 64}, {64, 64}};
  static const char *const kernels[] = {"gemm_sm90_bf16_RR_128x256x64_s4", "gemm_sm90_bf16_RR_128x64x64_s8",
                                        "gemm_sm90_bf16_RR_64x64x64_s13"};
  for (int i = 0; i < 3; i++) {
    ocase o = hcase(680, 264, 72, 7, offs, tiles[i][0], tiles[i][1], kernels[i]);
    o.b_col = 0;
    o.has_bias = i != 1;
    o.act = i == 0 ? SMELT_ACT_GELU : SMELT_ACT_IDENTITY;
    o.offs64 = i == 2;
    offs_check(&o, "sm90 RR");
  }
}

/* The caller's bug (decreasing, negative and too large offsets, clamped as
 * smelt/gemm.h says: the last group ends at T), one group over every row
 * (on the selector's 64-row tile), and all groups empty: no stray writes. */
static void test_gpu_edges(void) {
  if (!th_cuda_sm90()) SKIP("no sm_90 device");
  static const int64_t bad[] = {300, 100, 2000, -5, 900};
  ocase o = hcase(1000, 136, 64, 5, bad, 128, 256, "gemm_sm90_bf16_RC_128x256x64_s4");
  o.has_bias = 1;
  offs_check(&o, "sm90 clamped");
  o.offs64 = 1;
  offs_check(&o, "sm90 clamped i64");
  static const int64_t one[] = {517}, none[] = {0, 0, 0};
  o = hcase(517, 200, 64, 1, one, 0, 0, "gemm_sm90_bf16_RC_64x64x64_s13");
  offs_check(&o, "sm90 one group, 64-row tile");
  o = hcase(300, 200, 64, 3, none, 128, 256, "gemm_sm90_bf16_RC_128x256x64_s4");
  offs_check(&o, "sm90 all empty");
}

/* N with a partial 16-byte unit per row (bf16 N = 100: 200 bytes) or C:
 * the fast epilogue cannot write D, so the plan takes mma.sync, and the
 * result is still right. */
static void test_gpu_fallback(void) {
  if (!th_cuda_sm90()) SKIP("no sm_90 device");
  static const int64_t offs[] = {0, 70, 300, 301};
  ocase o = hcase(320, 100, 72, 4, offs, 0, 0, "gemm_sm80_bf16_RC_");
  o.has_bias = 1;
  offs_check(&o, "partial unit");
  o = hcase(320, 104, 72, 4, offs, 0, 0, "gemm_sm80_bf16_RC_");
  o.has_c = 1;
  offs_check(&o, "with C");
}

const th_test th_tests_gemm_offs_sm90[] = {
    {"selector", test_selector},         {"gpu_uneven", test_gpu_uneven}, {"gpu_many", test_gpu_many},
    {"gpu_rr", test_gpu_rr},             {"gpu_edges", test_gpu_edges},   {"gpu_fallback", test_gpu_fallback},
    {0, 0},
};
