/* Core tests: status names, dtype conversions (exhaustive round trips for the
 * narrow formats), tensor validation, contexts and their bad inputs. */
#include "harness.h"
#include "core/internal.h"

#include <float.h>

static void test_status_names(void) {
  CHECK(!strcmp(smelt_status_name(SMELT_OK), "SMELT_STATUS_OK"));
  CHECK(!strcmp(smelt_status_name(SMELT_STATUS_SHAPE_MISMATCH), "SMELT_STATUS_SHAPE_MISMATCH"));
  CHECK(!strcmp(smelt_status_name((smelt_status)12345), "SMELT_STATUS_UNKNOWN"));
  CHECK(!strcmp(smelt_status_string(SMELT_STATUS_OUT_OF_MEMORY), "out of memory"));
  CHECK_EQ_INT(smelt_version(), 100);
  CHECK(!strcmp(smelt_version_string(), SMELT_VERSION_STRING));
  smelt__error(SMELT_STATUS_INVALID_ARGUMENT, "op: x.shape[%d]=%d", 1, -3);
  CHECK(!strcmp(smelt_last_error(), "op: x.shape[1]=-3"));
  smelt_clear_error();
  CHECK(!strcmp(smelt_last_error(), ""));
}

static void test_dtype_table(void) {
  static const struct { smelt_dtype dt; const char *name; size_t size; } want[] = {
      {SMELT_DTYPE_F64, "f64", 8}, {SMELT_DTYPE_F32, "f32", 4}, {SMELT_DTYPE_F16, "f16", 2},
      {SMELT_DTYPE_BF16, "bf16", 2}, {SMELT_DTYPE_E4M3, "e4m3", 1}, {SMELT_DTYPE_E5M2, "e5m2", 1},
      {SMELT_DTYPE_I8, "i8", 1}, {SMELT_DTYPE_I32, "i32", 4}, {SMELT_DTYPE_I64, "i64", 8},
      {SMELT_DTYPE_U8, "u8", 1}, {SMELT_DTYPE_BOOL, "bool", 1}};
  for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
    CHECK_EQ_INT(smelt_dtype_size(want[i].dt), want[i].size);
    CHECK(!strcmp(smelt_dtype_name(want[i].dt), want[i].name));
    smelt_dtype got;
    CHECK_OK(smelt_dtype_from_name(want[i].name, &got));
    CHECK_EQ_INT(got, want[i].dt);
  }
  CHECK_EQ_INT(smelt_dtype_size(SMELT_DTYPE_COUNT), 0);
  CHECK(!strcmp(smelt_dtype_name((smelt_dtype)-1), "?"));
  smelt_dtype d;
  CHECK_STATUS(smelt_dtype_from_name("f12", &d), SMELT_STATUS_NOT_FOUND);
  CHECK_MSG("f12");
  CHECK_STATUS(smelt_dtype_from_name(NULL, &d), SMELT_STATUS_NULL_POINTER);
}

/* Reference rounding: the nearest representable value by search over every
 * finite code (ties to the even code), saturating or overflowing per format. */
static double nearest(float (*dec)(uint8_t), int ncodes, double x, double maxv, int saturate) {
  double best = NAN, bestd = INFINITY;
  int bestc = -1;
  for (int c = 0; c < ncodes; c++) {
    double v = dec((uint8_t)c);
    if (isnan(v) || isinf(v)) continue;
    double d = fabs(v - x);
    if (d < bestd || (d == bestd && (c & 1) == 0 && (bestc & 1))) {
      bestd = d;
      best = v;
      bestc = c;
    }
  }
  if (fabs(x) > maxv) return saturate ? copysign(maxv, x) : copysign(INFINITY, x);
  return best;
}

static void test_fp8_conversions(void) {
  /* Every code round-trips; decoded values match the format definitions. */
  for (int c = 0; c < 256; c++) {
    float v = smelt_e4m3_to_f32((uint8_t)c);
    if (!isnan(v)) CHECK_EQ_INT(smelt_f32_to_e4m3(v), (v == 0 && c == 0x80) ? 0x80 : c);
    float w = smelt_e5m2_to_f32((uint8_t)c);
    if (!isnan(w) && !isinf(w)) CHECK_EQ_INT(smelt_f32_to_e5m2(w), c);
  }
  CHECK(smelt_e4m3_to_f32(0x7e) == 448.0f);
  CHECK(isnan(smelt_e4m3_to_f32(0x7f)));
  CHECK(smelt_e4m3_to_f32(0x01) == 0x1p-9f);
  CHECK(smelt_e5m2_to_f32(0x7b) == 57344.0f);
  CHECK(isinf(smelt_e5m2_to_f32(0x7c)));
  /* Saturation and NaN. */
  CHECK(smelt_e4m3_to_f32(smelt_f32_to_e4m3(1e6f)) == 448.0f);
  CHECK(smelt_e4m3_to_f32(smelt_f32_to_e4m3(-INFINITY)) == -448.0f);
  CHECK(smelt_e5m2_to_f32(smelt_f32_to_e5m2(1e9f)) == 57344.0f);
  CHECK(isnan(smelt_e4m3_to_f32(smelt_f32_to_e4m3(NAN))));
  CHECK(isnan(smelt_e5m2_to_f32(smelt_f32_to_e5m2(NAN))));
  /* Random values round to the nearest code, ties to even. */
  for (int i = 0; i < 3000; i++) {
    double x = th_rand_normal() * pow(2.0, (double)(int)th_rand_uniform(-12, 12));
    if (i % 7 == 0) x = 0.5 * (smelt_e4m3_to_f32((uint8_t)(i % 126)) + smelt_e4m3_to_f32((uint8_t)(i % 126 + 1)));
    float xf = (float)x;
    double want = nearest(smelt_e4m3_to_f32, 256, xf, 448.0, 1);
    double got = smelt_e4m3_to_f32(smelt_f32_to_e4m3(xf));
    if (!(got == want)) th_fail(__FILE__, __LINE__, "e4m3(%.9g) = %.9g, want %.9g", (double)xf, got, want);
    want = nearest(smelt_e5m2_to_f32, 256, xf, 57344.0, 1);
    got = smelt_e5m2_to_f32(smelt_f32_to_e5m2(xf));
    if (!(got == want)) th_fail(__FILE__, __LINE__, "e5m2(%.9g) = %.9g, want %.9g", (double)xf, got, want);
    if (th_failed_now) return;
  }
}

static void test_f16_bf16_conversions(void) {
  /* Every f16 code round-trips through f32. */
  for (int c = 0; c < 65536; c++) {
    float v = smelt_f16_to_f32((uint16_t)c);
    if (isnan(v)) CHECK(isnan(smelt_f16_to_f32(smelt_f32_to_f16(v))));
    else if (smelt_f32_to_f16(v) != c) {
      th_fail(__FILE__, __LINE__, "f16 code %#x -> %g -> %#x", c, (double)v, smelt_f32_to_f16(v));
      return;
    }
    float b = smelt_bf16_to_f32((uint16_t)c);
    if (!isnan(b) && smelt_f32_to_bf16(b) != c) {
      th_fail(__FILE__, __LINE__, "bf16 code %#x -> %g -> %#x", c, (double)b, smelt_f32_to_bf16(b));
      return;
    }
  }
  CHECK(smelt_f16_to_f32(0x7bff) == 65504.0f);
  CHECK(smelt_f16_to_f32(0x0001) == 0x1p-24f);
  CHECK(isinf(smelt_f16_to_f32(smelt_f32_to_f16(65520.0f))));   /* halfway to 2^16 rounds up: inf */
  CHECK(smelt_f16_to_f32(smelt_f32_to_f16(65519.0f)) == 65504.0f);
  CHECK(smelt_f16_to_f32(smelt_f32_to_f16(1.0f + 0x1p-11f)) == 1.0f);            /* tie to even */
  CHECK(smelt_f16_to_f32(smelt_f32_to_f16(1.0f + 3 * 0x1p-11f)) == 1.0f + 0x1p-9f); /* tie to even, up */
  CHECK(smelt_bf16_to_f32(smelt_f32_to_bf16(1.0f + 0x1p-8f)) == 1.0f);
  CHECK(smelt_bf16_to_f32(smelt_f32_to_bf16(1.0f + 3 * 0x1p-8f)) == 1.0f + 0x1p-6f);
  CHECK(isinf(smelt_bf16_to_f32(smelt_f32_to_bf16(FLT_MAX))));
  CHECK(isnan(smelt_bf16_to_f32(smelt_f32_to_bf16(NAN))));
  CHECK(signbit(smelt_f16_to_f32(smelt_f32_to_f16(-0.0f))));
  /* Random values: f16 is within half an ulp. */
  for (int i = 0; i < 5000; i++) {
    float x = (float)(th_rand_normal() * 100);
    float r = smelt_f16_to_f32(smelt_f32_to_f16(x));
    int e;
    frexp(x, &e);
    double ulp = ldexp(1.0, (e - 1 < -14 ? -14 : e - 1) - 10);
    if (fabs((double)r - x) > 0.5 * ulp) {
      th_fail(__FILE__, __LINE__, "f16(%.9g) = %.9g off by more than half an ulp", (double)x, (double)r);
      return;
    }
  }
}

static void test_tensor_views(void) {
  int64_t shape[3] = {2, 3, 4};
  float buf[24];
  smelt_tensor t = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, shape);
  CHECK_EQ_INT(t.ndim, 3);
  CHECK_EQ_INT(t.strides[0], 12);
  CHECK_EQ_INT(t.strides[2], 1);
  CHECK_EQ_INT(smelt_tensor_numel(&t), 24);
  CHECK(smelt_tensor_is_contiguous(&t));
  CHECK_EQ_INT(smelt__tensor_offset(&t, 23), 23);
  smelt_tensor tr = t;
  tr.shape[1] = 4;
  tr.shape[2] = 3;
  tr.strides[1] = 1;
  tr.strides[2] = 4;
  CHECK(!smelt_tensor_is_contiguous(&tr));
  CHECK_EQ_INT(smelt__tensor_offset(&tr, 5), 9); /* (0, 1, 2) -> 1*1 + 2*4 */
  CHECK_EQ_INT(smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 9, shape).ndim, -1);
  smelt_tensor s = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 0, NULL);
  CHECK_EQ_INT(smelt_tensor_numel(&s), 1);
  CHECK_OK(smelt__check_tensor("op", "s", &s));
  /* More than 2^63 elements: strides saturate instead of wrapping (a signed
   * overflow, which UBSan reports), the view is not contiguous, and
   * validation fails as an overflow. */
  int64_t huge[3] = {(int64_t)1 << 31, (int64_t)1 << 32, 2};
  smelt_tensor h = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 3, huge);
  CHECK_EQ_INT(h.strides[0], (int64_t)1 << 33);
  CHECK_EQ_INT(smelt_tensor_numel(&h), -1);
  CHECK(!smelt_tensor_is_contiguous(&h));
  CHECK_STATUS(smelt__check_tensor("op", "h", &h), SMELT_STATUS_OVERFLOW);
  int64_t huger[4] = {2, (int64_t)1 << 31, (int64_t)1 << 32, 2};
  h = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 4, huger);
  CHECK_EQ_INT(h.strides[0], INT64_MAX);
  CHECK_STATUS(smelt__check_tensor("op", "h", &h), SMELT_STATUS_OVERFLOW);
}

static void test_tensor_validation(void) {
  int64_t shape[2] = {3, 5};
  float buf[16];
  smelt_tensor t = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 2, shape);
  CHECK_OK(smelt__check_tensor("op", "x", &t));
  CHECK_STATUS(smelt__check_tensor("op", "x", NULL), SMELT_STATUS_NULL_POINTER);
  smelt_tensor bad = t;
  bad.ndim = 9;
  CHECK_STATUS(smelt__check_tensor("op", "x", &bad), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("op: x.ndim=9 must be in [0, 8]");
  bad = t;
  bad.shape[1] = -1;
  CHECK_STATUS(smelt__check_tensor("op", "x", &bad), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("x.shape[1]=-1");
  bad = t;
  bad.shape[0] = (int64_t)1 << 62;
  bad.shape[1] = 4;
  CHECK_STATUS(smelt__check_tensor("op", "x", &bad), SMELT_STATUS_OVERFLOW);
  bad = t;
  bad.strides[0] = (int64_t)1 << 62;
  CHECK_STATUS(smelt__check_tensor("op", "x", &bad), SMELT_STATUS_OVERFLOW);
  bad = t;
  bad.data = NULL;
  CHECK_STATUS(smelt__check_tensor("op", "x", &bad), SMELT_STATUS_NULL_POINTER);
  CHECK_MSG("x.data is NULL");
  bad = t;
  bad.data = (char *)buf + 1;
  CHECK_STATUS(smelt__check_tensor("op", "x", &bad), SMELT_STATUS_MISALIGNED);
  CHECK_MSG("not aligned");
  bad = t;
  bad.dtype = (smelt_dtype)99;
  CHECK_STATUS(smelt__check_tensor("op", "x", &bad), SMELT_STATUS_DTYPE_MISMATCH);
  bad = t;
  bad.strides[1] = -1;
  CHECK_STATUS(smelt__check_tensor("op", "x", &bad), SMELT_STATUS_BAD_LAYOUT);
  /* Empty tensors may have a NULL pointer. */
  bad = t;
  bad.shape[0] = 0;
  bad.data = NULL;
  CHECK_OK(smelt__check_tensor("op", "x", &bad));
  /* Overlap. */
  smelt_tensor a = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, (int64_t[]){8});
  smelt_tensor b = smelt_tensor_make(buf + 7, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, (int64_t[]){8});
  smelt_tensor c = smelt_tensor_make(buf + 8, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, (int64_t[]){8});
  CHECK(smelt__tensors_overlap(&a, &b));
  CHECK(!smelt__tensors_overlap(&a, &c));
  smelt_dtype ok[] = {SMELT_DTYPE_F16, SMELT_DTYPE_BF16};
  CHECK_STATUS(smelt__check_dtype("op", "x", &t, ok, 2), SMELT_STATUS_DTYPE_MISMATCH);
  CHECK_MSG("x.dtype=f32 is not supported (supported: f16, bf16)");
  smelt_tensor u = t;
  u.shape[1] = 6;
  CHECK_STATUS(smelt__check_same_shape("op", "x", &t, "y", &u), SMELT_STATUS_SHAPE_MISMATCH);
  CHECK_MSG("op: y.shape=[3, 6] must equal x.shape=[3, 5]");
}

static void test_context_cpu(void) {
  smelt_ctx *ctx = NULL;
  smelt_ctx_options o = smelt_ctx_options_default();
  o.use_env = 0;
  CHECK_OK(smelt_ctx_create(&ctx, &o));
  REQUIRE(ctx);
  CHECK_EQ_INT(smelt_ctx_device(ctx), SMELT_DEVICE_CPU);
  void *p = NULL;
  CHECK_OK(smelt_alloc(ctx, 100, &p));
  CHECK(p && ((uintptr_t)p % 64) == 0);
  char src[100], back[100];
  for (int i = 0; i < 100; i++) src[i] = (char)i;
  CHECK_OK(smelt_memcpy_h2d(ctx, p, src, 100));
  CHECK_OK(smelt_memcpy_d2h(ctx, back, p, 100));
  CHECK(!memcmp(src, back, 100));
  CHECK_OK(smelt_free(ctx, p));
  smelt_pool_stats ps;
  CHECK_OK(smelt_pool_stats_get(ctx, &ps));
  CHECK_STATUS(smelt_ctx_set_stream(ctx, (void *)1), SMELT_STATUS_WRONG_DEVICE);
  CHECK_OK(smelt_ctx_synchronize(ctx));
  smelt_event *a, *b;
  float ms = -1;
  CHECK_OK(smelt_event_create(ctx, &a));
  CHECK_OK(smelt_event_create(ctx, &b));
  CHECK_OK(smelt_event_record(a));
  CHECK_OK(smelt_event_record(b));
  CHECK_OK(smelt_event_elapsed_ms(a, b, &ms));
  CHECK(ms >= 0);
  smelt_event_destroy(a);
  smelt_event_destroy(b);
  smelt_ctx_destroy(ctx);
}

static void test_context_bad_inputs(void) {
  smelt_ctx *ctx = (smelt_ctx *)1;
  CHECK_STATUS(smelt_ctx_create(NULL, NULL), SMELT_STATUS_NULL_POINTER);
  smelt_ctx_options o = smelt_ctx_options_default();
  o.use_env = 0;
  o.device = (smelt_device_kind)7;
  CHECK_STATUS(smelt_ctx_create(&ctx, &o), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK(ctx == NULL);
  o.device = SMELT_DEVICE_CUDA;
  o.device_index = 1000;
  CHECK(smelt_ctx_create(&ctx, &o) == SMELT_STATUS_NO_DEVICE);
  CHECK(ctx == NULL);
  CHECK_MSG("smelt_ctx_create");
  setenv("SMELT_DEVICE", "cuda:x", 1);
  o = smelt_ctx_options_default();
  CHECK_STATUS(smelt_ctx_create(&ctx, &o), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("SMELT_DEVICE=\"cuda:x\"");
  setenv("SMELT_DEVICE", "cpu", 1);
  o.device = SMELT_DEVICE_CUDA;
  CHECK_OK(smelt_ctx_create(&ctx, &o));
  CHECK_EQ_INT(smelt_ctx_device(ctx), SMELT_DEVICE_CPU);
  smelt_ctx_destroy(ctx);
  unsetenv("SMELT_DEVICE");
  CHECK_STATUS(smelt_alloc(NULL, 4, (void **)&ctx), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_free(NULL, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_memcpy_h2d(th_cpu(), NULL, "x", 1), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_pool_stats_get(NULL, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_event_create(NULL, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_ctx_synchronize(NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_ctx_set_stream(NULL, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_pool_reset_peak(NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_pool_trim(NULL, 0), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_cache_stats_get(NULL, NULL), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_event_record(NULL), SMELT_STATUS_NULL_POINTER);
  float ms;
  CHECK_STATUS(smelt_event_elapsed_ms(NULL, NULL, &ms), SMELT_STATUS_NULL_POINTER);
  CHECK_STATUS(smelt_device_info_get(0, NULL), SMELT_STATUS_NULL_POINTER);
  int count = -1;
  CHECK_STATUS(smelt_precompile("gfx90a", NULL, NULL, &count), SMELT_STATUS_INVALID_ARGUMENT);
  CHECK_MSG("arch=\"gfx90a\"");
  CHECK_EQ_INT(count, 0);
  smelt_ctx_destroy(NULL);
  smelt_plan_destroy(NULL);
  smelt_event_destroy(NULL);
}

/* The stream-ordered pool: used/reserved/peak move as allocations come and go,
 * and memory freed to the pool stays reserved (default threshold: keep all). */
static void test_cuda_pool(void) {
  smelt_ctx *ctx = th_cuda();
  if (!ctx) SKIP("no CUDA device");
  smelt_pool_stats a, b, c;
  CHECK_OK(smelt_ctx_synchronize(ctx));
  CHECK_OK(smelt_pool_stats_get(ctx, &a));
  void *p = NULL;
  CHECK_OK(smelt_alloc(ctx, 64 << 20, &p));
  CHECK_OK(smelt_ctx_synchronize(ctx));
  CHECK_OK(smelt_pool_stats_get(ctx, &b));
  CHECK(b.used >= a.used + (64 << 20));
  CHECK(b.reserved >= b.used && b.peak >= b.used);
  CHECK_OK(smelt_free(ctx, p));
  CHECK_OK(smelt_ctx_synchronize(ctx));
  CHECK_OK(smelt_pool_reset_peak(ctx));
  CHECK_OK(smelt_pool_stats_get(ctx, &c));
  CHECK(c.used + (64 << 20) <= b.used);
  CHECK(c.reserved >= (64 << 20)); /* kept for the next allocation */
  CHECK(c.peak < b.peak);
  CHECK_OK(smelt_pool_trim(ctx, 0));
  CHECK_OK(smelt_pool_stats_get(ctx, &c));
  CHECK(c.reserved < b.reserved);
}

static void test_system_info(void) {
  smelt_system_info si;
  CHECK_OK(smelt_system_info_get(&si));
  if (!si.driver_loaded) CHECK(si.driver_error[0] != 0);
  if (!si.nvrtc_loaded) CHECK(si.nvrtc_error[0] != 0);
  else CHECK(si.nvrtc_major >= 11);
  CHECK_STATUS(smelt_system_info_get(NULL), SMELT_STATUS_NULL_POINTER);
  smelt_device_info di;
  if (si.device_count > 0) {
    CHECK_OK(smelt_device_info_get(0, &di));
    CHECK(di.sm_count > 0 && di.total_memory > 0 && !strncmp(di.arch, "sm_", 3));
  }
  CHECK(smelt_device_info_get(-1, &di) != SMELT_OK);
}

static void test_sha256(void) {
  uint8_t d[32];
  char hex[65];
  smelt__sha256 h;
  smelt__sha256_init(&h);
  smelt__sha256_update(&h, "abc", 3);
  smelt__sha256_final(&h, d);
  smelt__sha256_hex(d, hex);
  CHECK(!strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
  smelt__sha256_init(&h);
  const char *m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  for (size_t i = 0; i < strlen(m); i++) smelt__sha256_update(&h, m + i, 1);
  smelt__sha256_final(&h, d);
  smelt__sha256_hex(d, hex);
  CHECK(!strcmp(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
}

/* A view whose furthest element is exactly INT64_MAX elements away: its
 * span of extent + 1 elements overflows, and the check must say so without
 * overflowing itself (UBSan saw extent + 1 wrap; found by fuzz/). */
static void test_tensor_span_limit(void) {
  float buf[1];
  smelt_tensor t = smelt_tensor_make(buf, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, (int64_t[]){2});
  t.strides[0] = INT64_MAX;
  CHECK_STATUS(smelt__check_tensor("op", "x", &t), SMELT_STATUS_OVERFLOW);
  CHECK_MSG("x spans more than 2^63");
  t.dtype = SMELT_DTYPE_U8;
  CHECK_STATUS(smelt__check_tensor("op", "x", &t), SMELT_STATUS_OVERFLOW);
}

const th_test th_tests_core[] = {
    {"status_names", test_status_names},
    {"dtype_table", test_dtype_table},
    {"fp8_conversions", test_fp8_conversions},
    {"f16_bf16_conversions", test_f16_bf16_conversions},
    {"tensor_views", test_tensor_views},
    {"tensor_validation", test_tensor_validation},
    {"context_cpu", test_context_cpu},
    {"context_bad_inputs", test_context_bad_inputs},
    {"cuda_pool", test_cuda_pool},
    {"system_info", test_system_info},
    {"sha256", test_sha256},
    {"tensor_span_limit", test_tensor_span_limit},
    {0, 0},
};
