/* Tests of tf32 rounding and 3xtf32 accuracy, and of the operand pre-pass
 * that gives them (and fp8 stored MN-major) to the Hopper kernel
 * (kernels/gemm_prep.cu, src/cuda/gemm_prep.c).
 *
 * The GPU cases measure against references computed here in double: the
 * exact product of the inputs, and for tf32 the exact product of the
 * inputs rounded to the nearest tf32 by the host twin of the kernels'
 * rounding. Against the second, a correctly rounded tf32 GEMM differs only
 * by its f32 accumulation (a few 1e-6), while truncating the inputs moves
 * it by about 7e-4; the mean signed error (the least-squares scale of the
 * error on the result) catches a bias of that kind on its own. 3xtf32 must
 * come within 4x of an exact f32 (SIMT) GEMM on the same inputs. */
#include "core/error_bound.h"
#include "cuda/gemm_cuda.h"
#include "harness.h"

#include <float.h>
#include <math.h>

/* ---------------------------------------------------------------- the bit logic (CPU) */

static uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

static float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

/* Round to nearest tf32 the long way: the two tf32 neighbours of x by
 * magnitude, the nearer one, ties to the larger magnitude. */
static uint32_t rna_slow(uint32_t u) {
  const uint32_t lo = u & 0xffffe000u, hi = lo + 0x2000u;
  const double x = fabs((double)float_of(u)), dl = x - fabs((double)float_of(lo));
  if ((hi & 0x7f800000u) == 0x7f800000u) /* hi is an infinity: the halfway point is FLT_MAX's next tf32 half-unit */
    return dl < ldexp(1.0, 127 - 11) ? lo : hi;
  const double dh = fabs((double)float_of(hi)) - x;
  return dl < dh ? lo : hi;
}

static void test_tf32_bits(void) {
  static const struct {
    uint32_t in, out;
  } fixed[] = {
      {0x3f800000u, 0x3f800000u}, /* 1 */
      {0x3f800fffu, 0x3f800000u}, /* below half a unit */
      {0x3f801000u, 0x3f802000u}, /* a tie: away from zero */
      {0xbf801000u, 0xbf802000u}, /* a negative tie: away from zero */
      {0x3f803000u, 0x3f804000u}, /* a tie with an odd last bit (even would keep it down too) */
      {0x3fffffffu, 0x40000000u}, /* carries into the next binade */
      {0x7f7fffffu, 0x7f800000u}, /* FLT_MAX rounds to infinity */
      {0x7f800000u, 0x7f800000u}, /* infinity stays */
      {0x00000fffu, 0x00000000u}, /* subnormals round like the rest */
      {0x00001000u, 0x00002000u},
      {0x80000000u, 0x80000000u}, /* -0 */
  };
  for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++)
    if (smelt__tf32_rna(fixed[i].in) != fixed[i].out)
      th_fail(__FILE__, __LINE__, "rna(%08x) = %08x, want %08x", fixed[i].in, smelt__tf32_rna(fixed[i].in),
              fixed[i].out);
  /* NaN stays NaN, even one whose payload is only in the low bits. */
  CHECK(isnan(float_of(smelt__tf32_rna(0x7f800001u))));
  CHECK(isnan(float_of(smelt__tf32_rna(0xffc00000u))));
  /* Random bit patterns (every exponent) against the long way. */
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)th_rand_u64();
    if ((u & 0x7f800000u) == 0x7f800000u) continue;
    const uint32_t r = smelt__tf32_rna(u);
    if ((r & 0x1fffu) || r != rna_slow(u)) {
      th_fail(__FILE__, __LINE__, "rna(%08x) = %08x, the long way gives %08x", u, r, rna_slow(u));
      return;
    }
  }
}

/* The split: big and small are tf32, x - big is exact in f32, and big +
 * small is within 2^-21 of x (what three products rely on), or within
 * 2^-137 where the small part is subnormal (tf32's spacing there is
 * 2^-136: x below about 2^-105). */
static void test_tf32_split(void) {
  for (int i = 0; i < 200000; i++) {
    const float x = (float)(th_rand_normal() * ldexp(1.0, (int)(th_rand_u64() % 200) - 100));
    float big, small;
    smelt__tf32_split(x, &big, &small);
    if ((bits_of(big) & 0x1fffu) || (bits_of(small) & 0x1fffu)) {
      th_fail(__FILE__, __LINE__, "split(%a): big %a or small %a is not a tf32", x, big, small);
      return;
    }
    if ((double)x - (double)big != (double)(x - big)) {
      th_fail(__FILE__, __LINE__, "split(%a): x - big is not exact in f32", x);
      return;
    }
    if (fabs((double)x - (double)big - (double)small) > fmax(ldexp(fabs((double)x), -21), ldexp(1.0, -137))) {
      th_fail(__FILE__, __LINE__, "split(%a): big %a + small %a is too far from x", x, big, small);
      return;
    }
  }
  float big, small;
  smelt__tf32_split(INFINITY, &big, &small);
  CHECK(isinf(big) && small == 0.0f);
  smelt__tf32_split(FLT_MAX, &big, &small); /* rounds to infinity: no small part */
  CHECK(isinf(big) && small == 0.0f);
}

/* ---------------------------------------------------------------- the selector's rule (CPU) */

static smelt_device_info fake_device(int major, int minor) {
  smelt_device_info dev;
  memset(&dev, 0, sizeof dev);
  dev.cc_major = major;
  dev.cc_minor = minor;
  dev.sm_count = major == 9 ? 132 : 108;
  snprintf(dev.arch, sizeof dev.arch, "sm_%d%d%s", major, minor, major == 9 ? "a" : "");
  return dev;
}

/* The kernel the selector gives the prepped operands ("" when none). */
static const char *prepped_pick(const smelt__gemm_state *st, const smelt__gemm_prob *p, const smelt__gemm_facts *f,
                                const smelt__gemm_prep prep[2], const smelt_device_info *dev) {
  static smelt__kernel_src src;
  smelt__gemm_kernel table[SMELT__GEMM_MAX_KERNELS];
  const int n = smelt__gemm_table(table);
  smelt__gemm_state ps;
  smelt__gemm_facts pf;
  smelt__gemm_prep_facts(st, p, f, prep, &ps, &pf);
  char why[96];
  int ki;
  if (smelt__gemm_select(&ps, &pf, dev, table, n, &ki, why, sizeof why) != SMELT_OK) return "";
  smelt__gemm_kernel_src(&table[ki], &src);
  return src.name;
}

static void test_prep_select(void) {
  CHECK_EQ_INT(smelt__gemm_prep_kp(5, SMELT_DTYPE_F32), 8);
  CHECK_EQ_INT(smelt__gemm_prep_kp(16, SMELT_DTYPE_F32), 16);
  CHECK_EQ_INT(smelt__gemm_prep_kp(5, SMELT_DTYPE_E4M3), 16);
  CHECK_EQ_INT(smelt__gemm_prep_ld(SMELT__PREP_SPLIT, 1023, SMELT_DTYPE_F32), 3 * 1024);
  CHECK_EQ_INT(smelt__gemm_prep_ld(SMELT__PREP_TF32, 1023, SMELT_DTYPE_F32), 1024);
  const smelt_device_info h100 = fake_device(9, 0), a100 = fake_device(8, 0);
  /* f32 RR (B row-major, N-major), 8192^3, odd row strides (not 16-byte units). */
  smelt__gemm_state st;
  memset(&st, 0, sizeof st);
  st.desc = smelt_gemm_desc_default();
  st.desc.math.op = SMELT_GEMM_MATH_TF32;
  st.mode = SMELT_GEMM_MODE_PLAIN;
  st.split_k = 1;
  st.acc = SMELT_GEMM_ACC_F32;
  st.dt_a = st.dt_b = st.dt_d = SMELT_DTYPE_F32;
  smelt__gemm_prob p;
  memset(&p, 0, sizeof p);
  p.m = p.n = p.k = 8192;
  p.a.rs = 8193;
  p.a.cs = 1;
  p.b.rs = 8193;
  p.b.cs = 1;
  p.d.rs = 8192;
  p.d.cs = 1;
  smelt__gemm_facts f = {.a_k = 0, .a_mn = 0, .b_k = 0, .b_mn = 0, .tma_a = {0, 0}, .tma_b = {0, 0}, .m = 8192, .n = 8192, .k = 8192,
                         .batch = 1, .sm90_d = 1, .k_min = 8192};
  smelt__gemm_prep prep[2];
  CHECK(smelt__gemm_prep_choose(&st, &p, &f, &h100, prep));
  CHECK(prep[0] == SMELT__PREP_TF32 && prep[1] == SMELT__PREP_TF32);
  CHECK(!strcmp(prepped_pick(&st, &p, &f, prep, &h100), "gemm_sm90_tf32_RC_128x256x32_s4"));
  CHECK_EQ_INT(smelt__gemm_prep_gemm_k(&st, prep, 8192), 8192);
  /* 3xtf32: the split, then the tf32 kernel over 3 K. */
  st.desc.math.op = SMELT_GEMM_MATH_3XTF32;
  CHECK(smelt__gemm_prep_choose(&st, &p, &f, &h100, prep));
  CHECK(prep[0] == SMELT__PREP_SPLIT && prep[1] == SMELT__PREP_SPLIT);
  CHECK(!strcmp(prepped_pick(&st, &p, &f, prep, &h100), "gemm_sm90_tf32_RC_128x128x32_s5_pr4"));
  CHECK_EQ_INT(smelt__gemm_prep_gemm_k(&st, prep, 8191), 3 * 8192);
  /* Batched GEMMs too (one entry at a time). Not on other GPUs (mma.sync
   * rounds in registers), not in the split and grouped modes, not for SIMT
   * as asked. */
  st.mode = SMELT_GEMM_MODE_BATCHED;
  CHECK(smelt__gemm_prep_choose(&st, &p, &f, &h100, prep));
  CHECK(!strcmp(prepped_pick(&st, &p, &f, prep, &h100), "gemm_sm90_tf32_RC_128x128x32_s5_pr4"));
  st.mode = SMELT_GEMM_MODE_PLAIN;
  CHECK(!smelt__gemm_prep_choose(&st, &p, &f, &a100, prep) && !prep[0] && !prep[1]);
  static const smelt_gemm_mode others[] = {SMELT_GEMM_MODE_SPLIT_K_SERIAL, SMELT_GEMM_MODE_SPLIT_K_PARALLEL,
                                           SMELT_GEMM_MODE_ARRAY, SMELT_GEMM_MODE_GROUPED,
                                           SMELT_GEMM_MODE_GROUPED_OFFS};
  for (int i = 0; i < 5; i++) {
    st.mode = others[i];
    CHECK(!smelt__gemm_prep_choose(&st, &p, &f, &h100, prep));
  }
  st.mode = SMELT_GEMM_MODE_PLAIN;
  st.desc.math.opclass = SMELT_GEMM_OPCLASS_SIMT;
  CHECK(!smelt__gemm_prep_choose(&st, &p, &f, &h100, prep));
  st.desc.math.opclass = SMELT_GEMM_OPCLASS_AUTO;
  /* A small problem: the selector gives the prepped operands mma.sync (no
   * narrow tf32 tile on Hopper), and the plan keeps them as they are. */
  smelt__gemm_facts small = f;
  small.m = small.n = 256;
  CHECK(smelt__gemm_prep_choose(&st, &p, &small, &h100, prep));
  CHECK(!strncmp(prepped_pick(&st, &p, &small, prep, &h100), "gemm_sm80_", 10));
  /* An mma.sync tile asked for: likewise. */
  st.desc.tile.k = 16;
  CHECK(!strncmp(prepped_pick(&st, &p, &f, prep, &h100), "gemm_sm80_", 10));
  st.desc.tile.k = 0;
  /* fp8 with B N-major: only B is copied K-major. */
  st.desc.math.op = SMELT_GEMM_MATH_DEFAULT;
  st.dt_a = st.dt_b = SMELT_DTYPE_E4M3;
  st.dt_d = SMELT_DTYPE_BF16;
  p.a.rs = 8192;
  f.a_k = f.tma_a[1] = 1;
  f.b_mn = f.tma_b[0] = 1;
  CHECK(smelt__gemm_prep_choose(&st, &p, &f, &h100, prep));
  CHECK(prep[0] == SMELT__PREP_NONE && prep[1] == SMELT__PREP_COPY);
  CHECK(!strcmp(prepped_pick(&st, &p, &f, prep, &h100), "gemm_sm90_e4m3xe4m3_RC_128x256x128_s4"));
  CHECK_EQ_INT(smelt__gemm_prep_gemm_k(&st, prep, 8191), 8191);
  /* ... and nothing when both are K-major already. */
  f.b_k = 1;
  CHECK(!smelt__gemm_prep_choose(&st, &p, &f, &h100, prep));
  /* The variant list ends with the pre-pass module. */
  const int nv = smelt__gemm_variants(NULL, 0);
  smelt__kernel_src *all = (smelt__kernel_src *)calloc((size_t)nv, sizeof *all);
  smelt__gemm_variants(all, nv);
  CHECK(!strcmp(all[nv - 1].name, "gemm_prep"));
  free(all);
}

/* A 16-bit problem for the selection tests: A [m, k] and B [k, n] row-
 * (0) or column-major (1) with leading dimensions exactly their lines, D
 * [m, n] row-major, at made-up 256-byte aligned addresses. */
static smelt__gemm_prob prob16(int64_t m, int64_t n, int64_t k, int a_col, int b_col) {
  smelt__gemm_prob p;
  memset(&p, 0, sizeof p);
  p.m = m;
  p.n = n;
  p.k = k;
  p.a = (smelt__gemm_mat){.data = (const void *)(uintptr_t)0x100000, .rs = a_col ? 1 : k, .cs = a_col ? m : 1};
  p.b = (smelt__gemm_mat){.data = (const void *)(uintptr_t)0x40000000, .rs = b_col ? 1 : n, .cs = b_col ? k : 1};
  p.d = (smelt__gemm_mat){.data = (const void *)(uintptr_t)0x80000000, .rs = n, .cs = 1};
  return p;
}

/* The rule on p in st (bf16 unless st says otherwise) on h100: the pre-pass
 * it gives each operand, and the kernel the selector then picks ("" when
 * none is prepped). */
static void choose16(const smelt__gemm_state *st, const smelt__gemm_prob *p, const smelt_device_info *dev,
                     smelt__gemm_prep prep[2], const char **pick) {
  smelt__gemm_args args;
  memset(&args, 0, sizeof args);
  args.prob = *p;
  args.count = st->mode == SMELT_GEMM_MODE_BATCHED ? 4 : 1;
  smelt__gemm_facts f;
  smelt__gemm_facts_of(st, &args, &f);
  *pick = smelt__gemm_prep_choose(st, p, &f, dev, prep) ? prepped_pick(st, p, &f, prep, dev) : "";
}

/* The 16-bit copy (PITCH): the operands whose rows are not 128 bytes apart
 * get it, the others keep their layout, and the selector gives the copies
 * the Hopper kernel in the problem's own layout. */
static void test_prep16_select(void) {
  const smelt_device_info h100 = fake_device(9, 0), a100 = fake_device(8, 0);
  smelt__gemm_state st;
  memset(&st, 0, sizeof st);
  st.desc = smelt_gemm_desc_default();
  st.mode = SMELT_GEMM_MODE_PLAIN;
  st.split_k = 1;
  st.acc = SMELT_GEMM_ACC_F32;
  st.dt_a = st.dt_b = st.dt_d = SMELT_DTYPE_BF16;
  static const struct {
    int64_t m, n, k;
    int a_col, b_col;
    smelt__gemm_prep a, b;
    const char *kernel; /* prefix of the main kernel's name */
  } cases[] = {
      /* Rows 10000 bytes apart (16-byte aligned, not 128): both. */
      {5000, 5000, 5000, 0, 1, SMELT__PREP_PITCH, SMELT__PREP_PITCH, "gemm_sm90_bf16_RC_128x256x64"},
      {5000, 5000, 5000, 0, 0, SMELT__PREP_PITCH, SMELT__PREP_PITCH, "gemm_sm90_bf16_RR_128x256x64"},
      {3000, 5000, 7000, 0, 1, SMELT__PREP_PITCH, SMELT__PREP_PITCH, "gemm_sm90_bf16_RC_128x256x64"},
      {3000, 5000, 7000, 0, 0, SMELT__PREP_PITCH, SMELT__PREP_PITCH, "gemm_sm90_bf16_RR_128x256x64"},
      /* K odd: no TMA at all without the copy (SIMT today). */
      {4095, 4097, 4099, 0, 1, SMELT__PREP_PITCH, SMELT__PREP_PITCH, "gemm_sm90_bf16_RC_128x256x64"},
      /* M-major A (rows of 5000 along M) or B of K = 5000, the other whole lines: that one only. */
      {5000, 4096, 4096, 1, 0, SMELT__PREP_PITCH, SMELT__PREP_NONE, "gemm_sm90_bf16_CR_128x256x64"},
      {4096, 4096, 5000, 1, 1, SMELT__PREP_NONE, SMELT__PREP_PITCH, "gemm_sm90_bf16_CC_128x256x64"},
      /* N-major B with N = 5000, A whole lines: B only. */
      {4096, 5000, 4096, 0, 0, SMELT__PREP_NONE, SMELT__PREP_PITCH, "gemm_sm90_bf16_RR_128x256x64"},
      /* Whole 128-byte lines: nothing (only K's pitch matters). */
      {4992, 4992, 4992, 0, 1, SMELT__PREP_NONE, SMELT__PREP_NONE, ""},
      {4096, 4096, 4096, 0, 1, SMELT__PREP_NONE, SMELT__PREP_NONE, ""},
      {4096, 4096, 4096, 0, 0, SMELT__PREP_NONE, SMELT__PREP_NONE, ""},
      {5000, 5000, 5120, 0, 1, SMELT__PREP_NONE, SMELT__PREP_NONE, ""},
      /* Too small to pay for the copy, and skinny M or N (the GEMV kernel). */
      {256, 256, 1000, 0, 1, SMELT__PREP_NONE, SMELT__PREP_NONE, ""},
      {16, 5000, 5000, 0, 1, SMELT__PREP_NONE, SMELT__PREP_NONE, ""},
      {5000, 16, 5000, 0, 1, SMELT__PREP_NONE, SMELT__PREP_NONE, ""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const smelt__gemm_prob p = prob16(cases[i].m, cases[i].n, cases[i].k, cases[i].a_col, cases[i].b_col);
    smelt__gemm_prep prep[2];
    const char *pick;
    choose16(&st, &p, &h100, prep, &pick);
    if (prep[0] != cases[i].a || prep[1] != cases[i].b || strncmp(pick, cases[i].kernel, strlen(cases[i].kernel)) ||
        (!cases[i].kernel[0] && pick[0]))
      th_fail(__FILE__, __LINE__, "%lldx%lldx%lld %c%c: pre-pass A %d B %d, kernel %s; want %d %d, %s",
              (long long)p.m, (long long)p.n, (long long)p.k, cases[i].a_col ? 'C' : 'R', cases[i].b_col ? 'C' : 'R',
              prep[0], prep[1], pick, cases[i].a, cases[i].b, cases[i].kernel);
  }
  /* The workspace: rows rounded up to 64 elements (128 bytes), 256-byte
   * multiples; A K-major [5000, 5056], B of RR N-major [5000 rows of K, 5056]. */
  smelt__gemm_prob p = prob16(5000, 5000, 5000, 0, 0);
  CHECK_EQ_INT((int64_t)smelt__gemm_prep_bytes(SMELT__PREP_PITCH, 0, &p, SMELT_DTYPE_BF16), 5000 * 5056 * 2);
  CHECK_EQ_INT((int64_t)smelt__gemm_prep_bytes(SMELT__PREP_PITCH, 1, &p, SMELT_DTYPE_BF16), 5000 * 5056 * 2);
  CHECK_EQ_INT(smelt__gemm_prep_pitch_ld(4099), 4160);
  CHECK_EQ_INT(smelt__gemm_prep_pitch_ld(64), 64);
  smelt__gemm_prep_geom g;
  CHECK(smelt__gemm_prep_geom_of(1, &p, &g) && !g.kmajor && g.rows == 5000 && g.cols == 5000 && g.pitch == 5000);
  p = prob16(300, 200, 1001, 1, 1);
  CHECK(smelt__gemm_prep_geom_of(0, &p, &g) && !g.kmajor && g.rows == 1001 && g.cols == 300 && g.pitch == 300);
  CHECK(smelt__gemm_prep_geom_of(1, &p, &g) && g.kmajor && g.rows == 200 && g.cols == 1001 && g.pitch == 1001);
  p.a.rs = 2; /* no unit stride: no copy of this kind */
  CHECK(!smelt__gemm_prep_geom_of(0, &p, &g));
  /* f16 as bf16; batched too (one entry at a time); a tile asked for takes
   * the copy at any size; not on other GPUs, not for SIMT as asked. */
  smelt__gemm_prep prep[2];
  const char *pick;
  p = prob16(5000, 5000, 5000, 0, 1);
  st.dt_a = st.dt_b = st.dt_d = SMELT_DTYPE_F16;
  choose16(&st, &p, &h100, prep, &pick);
  CHECK(prep[0] == SMELT__PREP_PITCH && prep[1] == SMELT__PREP_PITCH && !strncmp(pick, "gemm_sm90_f16_RC_", 17));
  st.mode = SMELT_GEMM_MODE_BATCHED;
  p.a.bs = 5000 * 5000;
  choose16(&st, &p, &h100, prep, &pick);
  CHECK(prep[0] == SMELT__PREP_PITCH && prep[1] == SMELT__PREP_PITCH && !strncmp(pick, "gemm_sm90_f16_RC_", 17));
  st.mode = SMELT_GEMM_MODE_PLAIN;
  p = prob16(256, 256, 1000, 0, 1);
  st.desc.tile.n = 256;
  choose16(&st, &p, &h100, prep, &pick);
  CHECK(prep[0] == SMELT__PREP_PITCH && prep[1] == SMELT__PREP_PITCH &&
        !strcmp(pick, "gemm_sm90_f16_RC_128x256x64_s4"));
  st.desc.tile.n = 0;
  p = prob16(5000, 5000, 5000, 0, 1);
  choose16(&st, &p, &a100, prep, &pick);
  CHECK(!prep[0] && !prep[1]);
  st.desc.math.opclass = SMELT_GEMM_OPCLASS_SIMT;
  choose16(&st, &p, &h100, prep, &pick);
  CHECK(!prep[0] && !prep[1]);
}

/* ---------------------------------------------------------------- GPU cases */

/* One case: A [m,k] and B [k,n] row- or column-major with leading
 * dimensions either rounded to 16 elements (what mma.sync takes), one
 * longer than the line (only the pre-pass and SIMT take those; odd_ld 1)
 * or the line itself (odd_ld 2); D [m,n] row-major with 3 spare columns
 * that must keep their poison. A and B start `shift` elements into their
 * buffers, A `run_shift` more at run time than when planned; bias (n
 * values exact in d, or NULL) is added. */
typedef struct pcase {
  smelt_dtype ab, d;
  int a_col, b_col, odd_ld;
  int64_t m, n, k;
  smelt_gemm_desc desc;
  int64_t shift, run_shift;
  const double *bias;
} pcase;

static int64_t ld_of(const pcase *c, int64_t line) {
  return c->odd_ld == 2 ? line : c->odd_ld ? line + 1 : (line + 15) / 16 * 16;
}

/* Runs c on the GPU with the logical A and B (doubles exact in c->ab);
 * got[] gets D. Returns 0 after a failure; *describe the plan's choice. */
static int run_gpu(smelt_ctx *cu, const pcase *c, const double *a, const double *b, double *got, char *describe,
                   size_t describe_n) {
  const size_t es = smelt_dtype_size(c->ab), ed = smelt_dtype_size(c->d);
  const int64_t lda = ld_of(c, c->a_col ? c->m : c->k), ldb = ld_of(c, c->b_col ? c->k : c->n), ldd = c->n + 3;
  const int64_t ao = c->shift + c->run_shift, bo = c->shift;
  const int64_t sa = (c->a_col ? c->k : c->m) * lda + ao, sb = (c->b_col ? c->n : c->k) * ldb + bo, sd = c->m * ldd;
  uint8_t *ha = (uint8_t *)calloc((size_t)sa, es), *hb = (uint8_t *)calloc((size_t)sb, es);
  uint8_t *hd = (uint8_t *)malloc((size_t)sd * ed), *hbias = (uint8_t *)calloc((size_t)c->n, ed);
  for (int64_t i = 0; i < c->m; i++)
    for (int64_t kk = 0; kk < c->k; kk++)
      th_set(ha, c->ab, ao + (c->a_col ? i + kk * lda : i * lda + kk), a[i * c->k + kk]);
  for (int64_t kk = 0; kk < c->k; kk++)
    for (int64_t j = 0; j < c->n; j++)
      th_set(hb, c->ab, bo + (c->b_col ? kk + j * ldb : kk * ldb + j), b[kk * c->n + j]);
  for (int64_t j = 0; c->bias && j < c->n; j++) th_set(hbias, c->d, j, c->bias[j]);
  th_buf A = th_buf_new(cu, (size_t)sa * es), B = th_buf_new(cu, (size_t)sb * es), D = th_buf_new(cu, (size_t)sd * ed);
  th_buf Bias = th_buf_new(cu, (size_t)c->n * ed);
  th_buf_upload(&A, ha, (size_t)sa * es);
  th_buf_upload(&B, hb, (size_t)sb * es);
  th_buf_upload(&Bias, hbias, (size_t)c->n * ed);
  const smelt_device_kind dev = smelt_ctx_device(cu);
  const int di = smelt_ctx_device_index(cu);
  smelt_tensor ta = smelt_tensor_make((uint8_t *)A.data + c->shift * es, c->ab, dev, di, 2, (int64_t[]){c->m, c->k});
  smelt_tensor tb = smelt_tensor_make((uint8_t *)B.data + bo * es, c->ab, dev, di, 2, (int64_t[]){c->k, c->n});
  smelt_tensor td = smelt_tensor_make(D.data, c->d, dev, di, 2, (int64_t[]){c->m, c->n});
  smelt_tensor tbias = smelt_tensor_make(Bias.data, c->d, dev, di, 1, (int64_t[]){c->n});
  ta.strides[0] = c->a_col ? 1 : lda;
  ta.strides[1] = c->a_col ? lda : 1;
  tb.strides[0] = c->b_col ? 1 : ldb;
  tb.strides[1] = c->b_col ? ldb : 1;
  td.strides[0] = ldd;
  smelt_plan *plan = NULL;
  smelt_status s = smelt_gemm_plan(cu, &c->desc, &ta, &tb, NULL, &td, c->bias ? &tbias : NULL, &plan);
  if (!s) {
    snprintf(describe, describe_n, "%s", smelt_plan_describe(plan));
    ta.data = (uint8_t *)A.data + ao * es;
    s = smelt_gemm_run(plan, &ta, &tb, NULL, &td, c->bias ? &tbias : NULL);
  }
  smelt_plan_destroy(plan);
  int ok = 1;
  if (s) {
    th_fail(__FILE__, __LINE__, "m%lld n%lld k%lld: %s (%s)", (long long)c->m, (long long)c->n, (long long)c->k,
            smelt_status_name(s), smelt_last_error());
    ok = 0;
  } else {
    th_buf_download(&D, hd, (size_t)sd * ed);
    CHECK(th_buf_guards_ok(&D) && th_buf_guards_ok(&A) && th_buf_guards_ok(&B));
    for (int64_t i = 0; i < c->m && ok; i++) {
      for (int64_t j = 0; j < c->n; j++) got[i * c->n + j] = th_get(hd, c->d, i * ldd + j);
      if (!th_all_ff(hd + (size_t)(i * ldd + c->n) * ed, 3 * ed)) {
        th_fail(__FILE__, __LINE__, "m%lld n%lld k%lld: D's spare columns of row %lld were written", (long long)c->m,
                (long long)c->n, (long long)c->k, (long long)i);
        ok = 0;
      }
    }
  }
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
  th_buf_free(&Bias);
  free(ha);
  free(hb);
  free(hd);
  free(hbias);
  return ok;
}

/* ref = A B in double, A and B rounded to tf32 first when `rna`. */
static void reference(const double *a, const double *b, int64_t m, int64_t n, int64_t k, int rna, double *ref) {
  double *bt = (double *)malloc(sizeof(double) * (size_t)(n * k));
  for (int64_t kk = 0; kk < k; kk++)
    for (int64_t j = 0; j < n; j++) bt[j * k + kk] = rna ? smelt__tf32_round((float)b[kk * n + j]) : b[kk * n + j];
  double *ar = (double *)malloc(sizeof(double) * (size_t)k);
  for (int64_t i = 0; i < m; i++) {
    for (int64_t kk = 0; kk < k; kk++) ar[kk] = rna ? smelt__tf32_round((float)a[i * k + kk]) : a[i * k + kk];
    for (int64_t j = 0; j < n; j++) {
      double s = 0;
      for (int64_t kk = 0; kk < k; kk++) s += ar[kk] * bt[j * k + kk];
      ref[i * n + j] = s;
    }
  }
  free(ar);
  free(bt);
}

/* ||got - ref|| / ||ref||, and the least-squares scale of the error on
 * the result (sum (got - ref) ref / sum ref^2): the bias a truncation
 * leaves, about -7e-4 for tf32 inputs cut to 10 bits. */
static double rel_l2(const double *got, const double *ref, int64_t n, double *scale) {
  double e = 0, r = 0, x = 0;
  for (int64_t i = 0; i < n; i++) {
    const double d = got[i] - ref[i];
    e += d * d;
    r += ref[i] * ref[i];
    x += d * ref[i];
  }
  if (scale) *scale = r > 0 ? x / r : 0;
  return r > 0 ? sqrt(e / r) : sqrt(e);
}

static void random_f32(double *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] = (double)(float)th_rand_normal();
}

/* Values in [-r, r) exact in dt (th_set rounds; read them back). */
static void random_exact(smelt_dtype dt, double r, double *x, int64_t n) {
  uint8_t bytes[8];
  for (int64_t i = 0; i < n; i++) {
    th_set(bytes, dt, 0, th_rand_uniform(-r, r));
    x[i] = th_get(bytes, dt, 0);
  }
}

static void random_e4m3(double *x, int64_t n) { random_exact(SMELT_DTYPE_E4M3, 4, x, n); }

static const char *layout(const pcase *c) {
  static char s[3];
  s[0] = c->a_col ? 'C' : 'R';
  s[1] = c->b_col ? 'C' : 'R';
  s[2] = 0;
  return s;
}

/* tf32 on every layout, odd sizes (K not a multiple of 4), on the kernel
 * the selector picks (mma.sync at these sizes) and, on Hopper, through the
 * rounding pre-pass and wgmma (the wide tile asked for), with odd leading
 * dimensions that only the pre-pass takes, and with leading dimensions of
 * whole 16-byte units (rows ending in a unit cut by K). */
static void test_gpu_tf32(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  const int hopper = th_cuda_sm90();
  static const int64_t shapes[][3] = {{129, 264, 70}, {300, 520, 333}, {77, 1031, 1027}};
  for (int si = 0; si < 3; si++) {
    const int64_t m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
    double *a = (double *)malloc(sizeof(double) * (size_t)(m * k)), *b = (double *)malloc(sizeof(double) * (size_t)(k * n));
    double *exact = (double *)malloc(sizeof(double) * (size_t)(m * n)), *rounded = (double *)malloc(sizeof(double) * (size_t)(m * n));
    double *got = (double *)malloc(sizeof(double) * (size_t)(m * n));
    random_f32(a, m * k);
    random_f32(b, k * n);
    reference(a, b, m, n, k, 0, exact);
    reference(a, b, m, n, k, 1, rounded);
    for (int lay = 0; lay < 4; lay++)
      for (int path = 0; path < 1 + 2 * hopper; path++) {
        pcase c = {.ab = SMELT_DTYPE_F32, .d = SMELT_DTYPE_F32, .a_col = lay >> 1, .b_col = lay & 1,
                   .odd_ld = path == 1, .m = m, .n = n, .k = k, .desc = smelt_gemm_desc_default()};
        c.desc.math.op = SMELT_GEMM_MATH_TF32;
        if (path) c.desc.tile.n = 256;
        char what[200] = "";
        if (!run_gpu(cu, &c, a, b, got, what, sizeof what)) goto done;
        double scale, e_exact = rel_l2(got, exact, m * n, &scale), e_rounded = rel_l2(got, rounded, m * n, NULL);
        /* Against the rounded inputs only the f32 accumulation differs:
         * the tensor cores' sum truncates, about 2e-8 of relative error
         * per accumulating k8 mma (the rate mma.sync 3xtf32 showed on H100,
         * three mmas a k8 step), so the bound grows with K. */
        const double accum = 2e-6 + 6e-9 * (double)k;
        if (e_rounded > accum || fabs(scale) > 1e-4 || e_exact > 6e-4 ||
            !strstr(what, path ? "pre-pass: A tf32 rounding, B tf32 rounding" : "gemm_sm80_tf32"))
          th_fail(__FILE__, __LINE__,
                  "tf32 %s m%lld n%lld k%lld (%s): error %.3g against the rounded inputs (bound %.3g), %.3g against "
                  "the exact product (bound 6e-4), bias %.3g (bound 1e-4)",
                  layout(&c), (long long)m, (long long)n, (long long)k, what, e_rounded, accum, e_exact, scale);
      }
  done:
    free(a);
    free(b);
    free(exact);
    free(rounded);
    free(got);
    if (th_failed_now) return;
  }
}

/* 3xtf32 against an exact f32 GEMM (SIMT) on the same inputs, K = 1024 and
 * 8192 with small M and N, every layout; on Hopper also through the split
 * pre-pass (3 K) and wgmma. */
static void test_gpu_3xtf32(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  const int hopper = th_cuda_sm90();
  static const int64_t shapes[][3] = {{67, 129, 1024 + 3}, {33, 65, 8192}};
  for (int si = 0; si < 2; si++) {
    const int64_t m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
    double *a = (double *)malloc(sizeof(double) * (size_t)(m * k)), *b = (double *)malloc(sizeof(double) * (size_t)(k * n));
    double *exact = (double *)malloc(sizeof(double) * (size_t)(m * n)), *got = (double *)malloc(sizeof(double) * (size_t)(m * n));
    random_f32(a, m * k);
    random_f32(b, k * n);
    reference(a, b, m, n, k, 0, exact);
    pcase simt = {.ab = SMELT_DTYPE_F32, .d = SMELT_DTYPE_F32, .m = m, .n = n, .k = k, .desc = smelt_gemm_desc_default()};
    simt.desc.math.opclass = SMELT_GEMM_OPCLASS_SIMT;
    char what[200] = "";
    if (!run_gpu(cu, &simt, a, b, got, what, sizeof what)) goto done;
    const double e_f32 = rel_l2(got, exact, m * n, NULL);
    for (int lay = 0; lay < 4; lay++)
      for (int path = 0; path < 1 + 2 * hopper; path++) {
        pcase c = {.ab = SMELT_DTYPE_F32, .d = SMELT_DTYPE_F32, .a_col = lay >> 1, .b_col = lay & 1,
                   .odd_ld = path == 1, .m = m, .n = n, .k = k, .desc = smelt_gemm_desc_default()};
        c.desc.math.op = SMELT_GEMM_MATH_3XTF32;
        if (path) c.desc.tile.n = 128; /* the promoting Hopper kernel's tile */
        if (!run_gpu(cu, &c, a, b, got, what, sizeof what)) goto done;
        double scale, e = rel_l2(got, exact, m * n, &scale);
        if (e > 4 * e_f32 || fabs(scale) > 2 * e_f32 ||
            !strstr(what, path ? "pre-pass: A 3xtf32 split, B 3xtf32 split" : "gemm_sm80_3xtf32"))
          th_fail(__FILE__, __LINE__,
                  "3xtf32 %s m%lld n%lld k%lld (%s): error %.3g, bias %.3g; exact f32 (SIMT) %.3g (bounds 4x and 2x "
                  "that)",
                  layout(&c), (long long)m, (long long)n, (long long)k, what, e, scale, e_f32);
      }
  done:
    free(a);
    free(b);
    free(exact);
    free(got);
    if (th_failed_now) return;
  }
}

/* fp8 e4m3 with MN-major operands (A column-major, B row-major, and each
 * alone), ragged K and N: on Hopper the transposing pre-pass and the fp8
 * wgmma kernel; elsewhere whatever the selector takes. */
static void test_gpu_fp8_mn(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  const int hopper = th_cuda_sm90();
  static const int64_t shapes[][3] = {{300, 520, 333}, {129, 261, 70}};
  for (int si = 0; si < 2; si++) {
    const int64_t m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
    double *a = (double *)malloc(sizeof(double) * (size_t)(m * k)), *b = (double *)malloc(sizeof(double) * (size_t)(k * n));
    double *exact = (double *)malloc(sizeof(double) * (size_t)(m * n)), *got = (double *)malloc(sizeof(double) * (size_t)(m * n));
    random_e4m3(a, m * k);
    random_e4m3(b, k * n);
    reference(a, b, m, n, k, 0, exact);
    /* CC (A M-major), RR (B N-major), CR (both), the last with odd
     * leading dimensions (only the pre-pass reads those). */
    for (int lay = 0; lay < 3; lay++) {
      pcase c = {.ab = SMELT_DTYPE_E4M3, .d = SMELT_DTYPE_BF16, .a_col = lay != 1, .b_col = lay == 0, .odd_ld = lay == 2,
                 .m = m, .n = n, .k = k, .desc = smelt_gemm_desc_default()};
      if (hopper) c.desc.tile.n = 256;
      char what[200] = "";
      if (!run_gpu(cu, &c, a, b, got, what, sizeof what)) break;
      const smelt__bound_query q = {.family = "gemm", .dtype = c.d, .dt_a = c.ab, .gemm = &c.desc, .k = k};
      const double e = rel_l2(got, exact, m * n, NULL), bound = smelt__error_bound(&q);
      const char *want = !hopper    ? ""
                         : lay == 0 ? "pre-pass: A K-major copy, B none"
                         : lay == 1 ? "pre-pass: A none, B K-major copy"
                                    : "pre-pass: A K-major copy, B K-major copy";
      if (e > bound || !strstr(what, want))
        th_fail(__FILE__, __LINE__, "e4m3 %s m%lld n%lld k%lld (%s): error %.3g (bound %.3g)", layout(&c),
                (long long)m, (long long)n, (long long)k, what, e, bound);
    }
    free(a);
    free(b);
    free(exact);
    free(got);
    if (th_failed_now) return;
  }
}

/* Batched: A [3, M, K] row-major, one B [K, N] row-major for every entry
 * (batch stride 0), D [3, M, N], with inputs exact in dt (f32: math tf32,
 * against the inputs rounded to tf32); on Hopper through the pre-pass one
 * entry at a time, the wide tile asked for, the plan naming `want`. */
static void batched_case(smelt_dtype dt, int64_t m, int64_t n, int64_t k, const char *want) {
  smelt_ctx *cu = th_cuda();
  const int64_t L = 3;
  const size_t es = smelt_dtype_size(dt);
  const int tf32 = dt == SMELT_DTYPE_F32;
  double *a = (double *)malloc(sizeof(double) * (size_t)(L * m * k)), *b = (double *)malloc(sizeof(double) * (size_t)(k * n));
  double *ref = (double *)malloc(sizeof(double) * (size_t)(L * m * n)), *got = (double *)malloc(sizeof(double) * (size_t)(L * m * n));
  uint8_t *ha = (uint8_t *)malloc(es * (size_t)(L * m * k)), *hb = (uint8_t *)malloc(es * (size_t)(k * n));
  uint8_t *hd = (uint8_t *)malloc(es * (size_t)(L * m * n));
  if (tf32) {
    random_f32(a, L * m * k);
    random_f32(b, k * n);
  } else {
    random_exact(dt, 1, a, L * m * k);
    random_exact(dt, 1, b, k * n);
  }
  for (int64_t i = 0; i < L * m * k; i++) th_set(ha, dt, i, a[i]);
  for (int64_t i = 0; i < k * n; i++) th_set(hb, dt, i, b[i]);
  for (int64_t l = 0; l < L; l++) reference(a + l * m * k, b, m, n, k, tf32, ref + l * m * n);
  th_buf A = th_buf_new(cu, es * (size_t)(L * m * k)), B = th_buf_new(cu, es * (size_t)(k * n));
  th_buf D = th_buf_new(cu, es * (size_t)(L * m * n));
  th_buf_upload(&A, ha, es * (size_t)(L * m * k));
  th_buf_upload(&B, hb, es * (size_t)(k * n));
  const smelt_device_kind dev = smelt_ctx_device(cu);
  const int di = smelt_ctx_device_index(cu);
  smelt_tensor ta = smelt_tensor_make(A.data, dt, dev, di, 3, (int64_t[]){L, m, k});
  smelt_tensor tb = smelt_tensor_make(B.data, dt, dev, di, 3, (int64_t[]){L, k, n});
  smelt_tensor td = smelt_tensor_make(D.data, dt, dev, di, 3, (int64_t[]){L, m, n});
  tb.strides[0] = 0;
  smelt_gemm_desc desc = smelt_gemm_desc_default();
  if (tf32) desc.math.op = SMELT_GEMM_MATH_TF32;
  if (th_cuda_sm90()) desc.tile.n = 256;
  smelt_plan *plan = NULL;
  CHECK_OK(smelt_gemm_plan(cu, &desc, &ta, &tb, NULL, &td, NULL, &plan));
  if (plan) {
    if (th_cuda_sm90() && !strstr(smelt_plan_describe(plan), want))
      th_fail(__FILE__, __LINE__, "batched %s took %s", smelt_dtype_name(dt), smelt_plan_describe(plan));
    CHECK_OK(smelt_gemm_run(plan, &ta, &tb, NULL, &td, NULL));
    smelt_plan_destroy(plan);
    th_buf_download(&D, hd, es * (size_t)(L * m * n));
    CHECK(th_buf_guards_ok(&D));
    for (int64_t i = 0; i < L * m * n; i++) got[i] = th_get(hd, dt, i);
    const smelt__bound_query q = {.family = "gemm", .dtype = dt, .dt_a = dt, .gemm = &desc, .k = k};
    const double e = rel_l2(got, ref, L * m * n, NULL), bound = tf32 ? 2e-6 + 6e-9 * (double)k : smelt__error_bound(&q);
    if (e > bound)
      th_fail(__FILE__, __LINE__, "batched %s: error %.3g (bound %.3g)", smelt_dtype_name(dt), e, bound);
  }
  th_buf_free(&A);
  th_buf_free(&B);
  th_buf_free(&D);
  free(a);
  free(b);
  free(ref);
  free(got);
  free(ha);
  free(hb);
  free(hd);
}

/* 16-byte rows (mma.sync takes them elsewhere); the bound is against the
 * rounded inputs. */
static void test_gpu_batched_tf32(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  batched_case(SMELT_DTYPE_F32, 129, 264, 72, "pre-pass: A tf32 rounding, B tf32 rounding");
}

/* A's rows 2000 bytes apart, B's 528: both copied, once per entry. */
static void test_gpu_batched_prep16(void) {
  if (!th_cuda()) SKIP("no CUDA device");
  batched_case(SMELT_DTYPE_BF16, 129, 264, 1000, "pre-pass: A 128-byte row copy, B 128-byte row copy");
}

/* The 16-bit row copy on every layout, f16 and bf16, rows 2000 bytes
 * apart (K = 1000: TMA reads them, slowly) and 2002 (K = 1001: TMA cannot),
 * odd M and N (M- and N-major rows not 16 bytes apart), with bias + GELU;
 * then one operand alone (B's rows 600 bytes, A's whole lines), starts
 * 2 bytes past a 16-byte boundary, and a plan made on aligned operands run
 * with A 2 bytes further (the run copies A too). On Hopper the wide tile
 * is asked for (the copy then runs at any size) and the plan must name the
 * copies; elsewhere the selector's kernel checks the same results. */
static void test_gpu_prep16(void) {
  smelt_ctx *cu = th_cuda();
  if (!cu) SKIP("no CUDA device");
  const int hopper = th_cuda_sm90();
  static const struct {
    int64_t m, n, k;
    int lays; /* bit l: layout l (0 RR, 1 RC, 2 CR, 3 CC) */
    int64_t shift, run_shift;
    int act;
    const char *want;
  } cases[] = {
      {131, 264, 1000, 15, 0, 0, 0, "pre-pass: A 128-byte row copy, B 128-byte row copy"},
      {129, 77, 1001, 15, 0, 0, 1, "pre-pass: A 128-byte row copy, B 128-byte row copy"},
      {136, 300, 256, 1, 0, 0, 0, "pre-pass: A none, B 128-byte row copy"},
      {200, 136, 512, 2, 1, 0, 1, "pre-pass: A 128-byte row copy, B 128-byte row copy"},
      {136, 300, 256, 1, 0, 1, 0, "pre-pass: A none, B 128-byte row copy"},
  };
  static const smelt_dtype dts[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16};
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    const int64_t m = cases[ci].m, n = cases[ci].n, k = cases[ci].k;
    double *a = (double *)malloc(sizeof(double) * (size_t)(m * k)), *b = (double *)malloc(sizeof(double) * (size_t)(k * n));
    double *ref = (double *)malloc(sizeof(double) * (size_t)(m * n)), *got = (double *)malloc(sizeof(double) * (size_t)(m * n));
    double *bias = (double *)malloc(sizeof(double) * (size_t)n);
    for (int di = 0; di < 2 && !th_failed_now; di++) {
      const smelt_dtype dt = dts[di];
      random_exact(dt, 1, a, m * k);
      random_exact(dt, 1, b, k * n);
      random_exact(dt, 2, bias, n);
      reference(a, b, m, n, k, 0, ref);
      if (cases[ci].act)
        for (int64_t i = 0; i < m * n; i++) {
          const double x = ref[i] + bias[i % n];
          ref[i] = 0.5 * x * erfc(-x / sqrt(2.0));
        }
      for (int lay = 0; lay < 4; lay++) {
        if (!(cases[ci].lays >> lay & 1)) continue;
        pcase c = {.ab = dt, .d = dt, .a_col = lay >> 1, .b_col = lay & 1, .odd_ld = 2, .m = m, .n = n, .k = k,
                   .desc = smelt_gemm_desc_default(), .shift = cases[ci].shift, .run_shift = cases[ci].run_shift,
                   .bias = cases[ci].act ? bias : NULL};
        if (cases[ci].act) c.desc.epilogue.act = SMELT_ACT_GELU;
        if (hopper) c.desc.tile.n = 256;
        char what[200] = "";
        if (!run_gpu(cu, &c, a, b, got, what, sizeof what)) break;
        const smelt__bound_query q = {.family = "gemm", .dtype = c.d, .dt_a = c.ab, .gemm = &c.desc, .k = k};
        const double e = rel_l2(got, ref, m * n, NULL), bound = smelt__error_bound(&q);
        if (e > bound || (hopper && !strstr(what, cases[ci].want)))
          th_fail(__FILE__, __LINE__, "%s %s m%lld n%lld k%lld shift %lld+%lld (%s): error %.3g (bound %.3g)%s%s",
                  smelt_dtype_name(dt), layout(&c), (long long)m, (long long)n, (long long)k,
                  (long long)c.shift, (long long)c.run_shift, what, e, bound, hopper ? "; want " : "",
                  hopper ? cases[ci].want : "");
      }
    }
    free(a);
    free(b);
    free(ref);
    free(got);
    free(bias);
    if (th_failed_now) return;
  }
}

const th_test th_tests_gemm_prep[] = {
    {"tf32_bits", test_tf32_bits},
    {"tf32_split", test_tf32_split},
    {"select", test_prep_select},
    {"prep16_select", test_prep16_select},
    {"gpu_tf32", test_gpu_tf32},
    {"gpu_3xtf32", test_gpu_3xtf32},
    {"gpu_fp8_mn", test_gpu_fp8_mn},
    {"gpu_batched_tf32", test_gpu_batched_tf32},
    {"gpu_prep16", test_gpu_prep16},
    {"gpu_batched_prep16", test_gpu_batched_prep16},
    {0, 0},
};
