/* Fuzz entry points for the first op families (activation, softmax, top-k)
 * and the helpers around them: tensor views, dtypes and their conversions,
 * names, the context's memory calls and events. Shapes are drawn small
 * (mostly under 8 per dim) so the CPU backend's work stays tiny. */
#include "fuzz.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A shape of nd dims, each mostly in [0, max]. */
static void draw_shape(fz *f, int nd, int64_t *shape, int64_t max) {
  for (int i = 0; i < nd; i++) shape[i] = fz_size(f, max);
}

void fz_activation(fz *f) {
  int nd = (int)fz_small(f, 4);
  int64_t shape[SMELT_MAX_DIMS];
  draw_shape(f, nd, shape, 6);
  smelt_dtype dt = fz_float_dtype(f);
  smelt_activation_desc d = {(smelt_act)fz_enum(f, SMELT_ACT_COUNT), (float)fz_double(f)};
  const smelt_activation_desc *dp = fz_one_in(f, 16) ? NULL : &d;
  int in_place = fz_one_in(f, 4), mode = fz_mode(f);
  unsigned nulls = fz_nulls(f, 2);
  smelt_tensor t[2];
  t[0] = fz_view(f, dt, nd, shape, 0);
  t[1] = in_place ? t[0] : fz_view(f, dt, nd, shape, 1);
  if (in_place) fz_output(&t[1]);
  smelt_status s;
  if (mode == 0) {
    FZ_CALL(s, "smelt_activation", t, smelt_activation(f->ctx, dp, fz_maybe_null(nulls, t, 0), fz_maybe_null(nulls, t, 1)));
    return;
  }
  smelt_plan *plan;
  FZ_PLAN(s, "smelt_activation_plan", t, plan,
          smelt_activation_plan(f->ctx, dp, fz_maybe_null(nulls, t, 0), fz_maybe_null(nulls, t, 1), &plan));
  if (s) return;
  for (int r = 0; r < mode; r++) {
    if (r) {
      fz_reset_outputs();
      t[0] = fz_view(f, dt, nd, shape, 0);
      t[1] = fz_view(f, dt, nd, shape, 1);
    }
    FZ_CALL(s, "smelt_activation_run", t, smelt_activation_run(plan, &t[0], &t[1]));
  }
  fz_count("smelt_plan_describe");
  if (!smelt_plan_describe(plan)) abort();
  smelt_plan_destroy(plan);
}

void fz_softmax(fz *f) {
  int nd = 1 + (int)fz_small(f, 3);
  int64_t shape[SMELT_MAX_DIMS];
  draw_shape(f, nd, shape, 7);
  smelt_dtype dt = fz_float_dtype(f);
  int mode = fz_mode(f), with_lse = !fz_one_in(f, 3);
  unsigned nulls = fz_nulls(f, 2);
  smelt_tensor t[3];
  smelt_plan *plan = NULL;
  for (int r = 0; fz_round(r, mode); r++) {
    t[0] = fz_view(f, dt, nd, shape, 0);
    t[1] = fz_view(f, dt, nd, shape, 1);
    t[2] = fz_view(f, SMELT_DTYPE_F32, nd - 1, shape, 1);
    const smelt_tensor *x = fz_maybe_null(nulls, t, 0), *y = fz_maybe_null(nulls, t, 1),
                       *lse = with_lse ? &t[2] : NULL;
    smelt_status s;
    FZ_ROUND(s, r, mode, plan, t, "smelt_softmax", smelt_softmax(f->ctx, x, y, lse),
             smelt_softmax_plan(f->ctx, x, y, lse, &plan), smelt_softmax_run(plan, &t[0], &t[1], lse));
  }
  smelt_plan_destroy(plan);
}

void fz_topk(fz *f) {
  int nd = 1 + (int)fz_small(f, 3);
  int64_t shape[SMELT_MAX_DIMS], kshape[SMELT_MAX_DIMS];
  draw_shape(f, nd, shape, 9);
  int64_t k = fz_size(f, 5);
  if (fz_one_in(f, 3) && shape[nd - 1] > 0 && shape[nd - 1] < 64) k = shape[nd - 1];
  memcpy(kshape, shape, sizeof shape);
  kshape[nd - 1] = k;
  smelt_dtype dt = fz_float_dtype(f);
  smelt_dtype it = fz_u8(f) & 1 ? SMELT_DTYPE_I64 : SMELT_DTYPE_I32;
  int mode = fz_mode(f), with_indices = !fz_one_in(f, 4);
  unsigned nulls = fz_nulls(f, 2);
  smelt_tensor t[3];
  smelt_plan *plan = NULL;
  for (int r = 0; fz_round(r, mode); r++) {
    t[0] = fz_view(f, dt, nd, shape, 0);
    t[1] = fz_view(f, dt, nd, kshape, 1);
    t[2] = fz_view(f, it, nd, kshape, 1);
    const smelt_tensor *x = fz_maybe_null(nulls, t, 0), *v = fz_maybe_null(nulls, t, 1),
                       *ix = with_indices ? &t[2] : NULL;
    smelt_status s;
    FZ_ROUND(s, r, mode, plan, t, "smelt_topk", smelt_topk(f->ctx, k, x, v, ix),
             smelt_topk_plan(f->ctx, k, x, v, ix, &plan), smelt_topk_run(plan, &t[0], &t[1], ix));
  }
  smelt_plan_destroy(plan);
}

/* A NUL-terminated string of up to 600 bytes from the input. */
static void draw_string(fz *f, char *buf, size_t cap) {
  size_t n = (size_t)fz_u8(f);
  if (n >= 250) n = 200 + (size_t)fz_u8(f) * 2;
  if (n >= cap) n = cap - 1;
  static const char *const words[] = {"f32", "bf16", "e4m3", "relu", "gelu_tanh", "sm_90a", "sm_"};
  size_t used = 0;
  if (fz_one_in(f, 2)) {
    const char *w = words[fz_u8(f) % 7];
    used = strlen(w);
    memcpy(buf, w, used);
  }
  while (used < n) buf[used++] = (char)(fz_u8(f) % 4 ? 'a' + fz_u8(f) % 26 : fz_u8(f));
  buf[used] = 0;
}

/* Views with any fields at all: the helpers only read the struct. */
static smelt_tensor raw_tensor(fz *f) {
  smelt_tensor t;
  memset(&t, 0, sizeof t);
  t.dtype = (smelt_dtype)fz_enum(f, SMELT_DTYPE_COUNT);
  t.ndim = (int)(fz_u8(f) % 11) - 1;
  for (int i = 0; i < SMELT_MAX_DIMS; i++) {
    t.shape[i] = fz_size(f, 5);
    t.strides[i] = fz_one_in(f, 4) ? fz_size(f, 100) : 1;
  }
  return t;
}

static void helpers_tensor(fz *f) {
  int64_t shape[SMELT_MAX_DIMS];
  for (int i = 0; i < SMELT_MAX_DIMS; i++) shape[i] = fz_size(f, 9);
  int nd = (int)(fz_u8(f) % 11) - 1;
  smelt_tensor t = smelt_tensor_make(fz_arena, (smelt_dtype)fz_enum(f, SMELT_DTYPE_COUNT), SMELT_DEVICE_CPU, 0, nd,
                                     fz_one_in(f, 16) ? NULL : shape);
  fz_count("smelt_tensor_make");
  if (nd >= 0 && nd <= SMELT_MAX_DIMS && t.ndim != nd && t.ndim != -1) abort();
  smelt_tensor r = raw_tensor(f);
  const smelt_tensor *ts[3] = {&t, &r, NULL};
  for (int i = 0; i < 3; i++) {
    smelt_tensor before;
    if (ts[i]) before = *ts[i];
    int64_t n = smelt_tensor_numel(ts[i]);
    int c = smelt_tensor_is_contiguous(ts[i]);
    fz_count("smelt_tensor_numel");
    fz_count("smelt_tensor_is_contiguous");
    if (ts[i]) fz_same("smelt_tensor_numel", &before, ts[i], sizeof before);
    if (n < -1 || (c != 0 && c != 1) || (c && n < 0)) abort();
    /* A contiguous view's furthest element is numel - 1 away. */
    if (c && n > 0) {
      int64_t extent = 0;
      for (int d = 0; d < ts[i]->ndim; d++)
        if (ts[i]->shape[d] > 1) extent += (ts[i]->shape[d] - 1) * ts[i]->strides[d];
      if (extent != n - 1) abort();
    }
  }
}

static void helpers_names(fz *f) {
  char buf[640];
  draw_string(f, buf, sizeof buf);
  smelt_dtype dt = SMELT_DTYPE_COUNT;
  smelt_act a = SMELT_ACT_COUNT;
  smelt_status s;
  smelt_tensor none[1];
  memset(none, 0, sizeof none);
  FZ_CALL(s, "smelt_dtype_from_name", none, smelt_dtype_from_name(buf, fz_one_in(f, 16) ? NULL : &dt));
  if (s == SMELT_OK && !smelt_dtype_size(dt)) abort();
  FZ_CALL(s, "smelt_act_from_name", none, smelt_act_from_name(buf, fz_one_in(f, 16) ? NULL : &a));
  if (s == SMELT_OK && (unsigned)a >= SMELT_ACT_COUNT) abort();
  int v = fz_enum(f, 20) - 17;
  fz_count("smelt_status_name");
  if (!smelt_status_name((smelt_status)v)[0] || !smelt_status_string((smelt_status)v)[0]) abort();
  fz_count("smelt_dtype_name");
  if (!smelt_dtype_name((smelt_dtype)v)[0] || (smelt_dtype_size((smelt_dtype)v) == 0) != ((unsigned)v >= SMELT_DTYPE_COUNT))
    abort();
  fz_count("smelt_act_name");
  if (!smelt_act_name((smelt_act)v)) abort();
  fz_count("smelt_act_apply");
  (void)smelt_act_apply((smelt_act)fz_enum(f, SMELT_ACT_COUNT), fz_double(f), fz_double(f));
  fz_count("smelt_version");
  if (smelt_version() != SMELT_VERSION_MAJOR * 10000 + SMELT_VERSION_MINOR * 100 + SMELT_VERSION_PATCH ||
      strcmp(smelt_version_string(), SMELT_VERSION_STRING))
    abort();
  /* An arch that is never valid (it holds a character no arch has) must be
   * refused before any compilation, whatever its length. */
  if (fz_one_in(f, 4)) {
    size_t n = strlen(buf);
    if (n + 1 < sizeof buf) buf[n] = '#', buf[n + 1] = 0;
    int count = -7;
    FZ_CALL(s, "smelt_precompile", none, smelt_precompile(buf, NULL, NULL, &count));
    if (s == SMELT_OK) abort();
  }
}

static void helpers_convert(fz *f) {
  uint32_t bits = fz_u32(f);
  float x;
  memcpy(&x, &bits, 4);
  fz_count("smelt_f32_to_f16");
  float h = smelt_f16_to_f32(smelt_f32_to_f16(x)), b = smelt_bf16_to_f32(smelt_f32_to_bf16(x));
  float e4 = smelt_e4m3_to_f32(smelt_f32_to_e4m3(x)), e5 = smelt_e5m2_to_f32(smelt_f32_to_e5m2(x));
  /* NaN stays NaN; the round trip is idempotent. */
  if (isnan(x) != isnan(h) || isnan(x) != isnan(b) || isnan(x) != isnan(e4) || isnan(x) != isnan(e5)) abort();
  if (!isnan(x) && (smelt_f16_to_f32(smelt_f32_to_f16(h)) != h || smelt_bf16_to_f32(smelt_f32_to_bf16(b)) != b ||
                    smelt_e4m3_to_f32(smelt_f32_to_e4m3(e4)) != e4 || smelt_e5m2_to_f32(smelt_f32_to_e5m2(e5)) != e5))
    abort();
  uint16_t u = (uint16_t)bits;
  fz_count("smelt_f16_to_f32");
  (void)smelt_f16_to_f32(u);
  (void)smelt_bf16_to_f32(u);
  (void)smelt_e4m3_to_f32((uint8_t)u);
  (void)smelt_e5m2_to_f32((uint8_t)u);
}

static void helpers_ctx(fz *f) {
  smelt_status s;
  smelt_tensor none[1];
  memset(none, 0, sizeof none);
  smelt_ctx_options o = smelt_ctx_options_default();
  o.device = fz_one_in(f, 4) ? (smelt_device_kind)fz_enum(f, 5) : SMELT_DEVICE_CPU;
  if (o.device == SMELT_DEVICE_CUDA) o.device = SMELT_DEVICE_CPU;
  o.device_index = fz_one_in(f, 4) ? -1 : 0;
  o.use_env = 0;
  o.deterministic = fz_u8(f);
  smelt_ctx *c = NULL;
  FZ_CALL(s, "smelt_ctx_create", none, smelt_ctx_create(fz_one_in(f, 16) ? NULL : &c, &o));
  if (s != SMELT_OK && c) abort();
  if (s) return;
  size_t n = (size_t)fz_small(f, 4096);
  uint8_t *dst = fz_bytes(f, n), *src = fz_bytes(f, n);
  fz_output_bytes(dst, n);
  switch (fz_u8(f) % 8) {
  case 0: FZ_CALL(s, "smelt_memcpy_h2d", none, smelt_memcpy_h2d(c, dst, src, n)); break;
  case 1: FZ_CALL(s, "smelt_memcpy_d2h", none, smelt_memcpy_d2h(c, dst, src, n)); break;
  case 2: FZ_CALL(s, "smelt_memcpy_d2d", none, smelt_memcpy_d2d(c, dst, src, n)); break;
  case 3: {
    void *p = NULL;
    FZ_CALL(s, "smelt_alloc", none, smelt_alloc(c, (size_t)fz_small(f, 4096), &p));
    if (s == SMELT_OK) FZ_CALL(s, "smelt_free", none, smelt_free(c, p));
    break;
  }
  case 4: {
    smelt_pool_stats ps;
    smelt_cache_stats cs;
    FZ_CALL(s, "smelt_pool_stats_get", none, smelt_pool_stats_get(c, &ps));
    FZ_CALL(s, "smelt_cache_stats_get", none, smelt_cache_stats_get(c, &cs));
    FZ_CALL(s, "smelt_pool_trim", none, smelt_pool_trim(c, (size_t)fz_u64(f)));
    FZ_CALL(s, "smelt_pool_reset_peak", none, smelt_pool_reset_peak(c));
    break;
  }
  case 5: {
    smelt_event *e0 = NULL, *e1 = NULL;
    float ms = 0;
    FZ_CALL(s, "smelt_event_create", none, smelt_event_create(c, &e0));
    FZ_CALL(s, "smelt_event_create", none, smelt_event_create(c, &e1));
    FZ_CALL(s, "smelt_event_record", none, smelt_event_record(fz_one_in(f, 8) ? NULL : e0));
    FZ_CALL(s, "smelt_event_record", none, smelt_event_record(e1));
    FZ_CALL(s, "smelt_event_elapsed_ms", none, smelt_event_elapsed_ms(e0, e1, &ms));
    smelt_event_destroy(e0);
    smelt_event_destroy(e1);
    break;
  }
  case 6: {
    void *stream = fz_one_in(f, 2) ? NULL : (void *)(uintptr_t)fz_u64(f);
    FZ_CALL(s, "smelt_ctx_set_stream", none, smelt_ctx_set_stream(c, stream));
    FZ_CALL(s, "smelt_ctx_synchronize", none, smelt_ctx_synchronize(c));
    smelt_ctx_set_deterministic(c, fz_u8(f));
    fz_count("smelt_ctx_device");
    if (smelt_ctx_device(c) != SMELT_DEVICE_CPU || smelt_ctx_device_index(c) != 0) abort();
    fz_count("smelt_ctx_stream");
    if (smelt_ctx_stream(c)) abort(); /* the CPU has no stream */
    break;
  }
  case 7: {
    smelt_device_info di;
    smelt_system_info si;
    FZ_CALL(s, "smelt_device_info_get", none, smelt_device_info_get((int)fz_size(f, 3), fz_one_in(f, 8) ? NULL : &di));
    /* Slow (it looks for the driver and sizes the cache folder): seldom. */
    if (fz_one_in(f, 16))
      FZ_CALL(s, "smelt_system_info_get", none, smelt_system_info_get(fz_one_in(f, 8) ? NULL : &si));
    break;
  }
  }
  smelt_ctx_destroy(c);
}

void fz_helpers(fz *f) {
  switch (fz_u8(f) % 4) {
  case 0: helpers_tensor(f); break;
  case 1: helpers_names(f); break;
  case 2: helpers_convert(f); break;
  case 3: helpers_ctx(f); break;
  }
}
