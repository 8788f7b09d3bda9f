/* The test harness: registration, assertion macros that print the expression
 * and both values, seeded random inputs, guarded + poisoned buffers, and the
 * error measures the op tests use.
 *
 * Every test is a `static void test_x(void)` listed in its file's
 * SMELT_TESTS(X) table; tests/main.c runs them all and ends with the line
 * "N passed, N failed, N skipped". A test may call SKIP("why"). */
#ifndef SMELT_TEST_HARNESS_H
#define SMELT_TEST_HARNESS_H

#include "smelt.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct th_test {
  const char *name;
  void (*fn)(void);
} th_test;

/* Failure bookkeeping for the running test. */
extern int th_failed_now;
extern int th_skipped_now;
extern uint64_t th_seed;
void th_fail(const char *file, int line, const char *fmt, ...);
void th_skip(const char *why);

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) th_fail(__FILE__, __LINE__, "CHECK(%s) failed", #cond); \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                                    \
  do {                                                                                        \
    long long th_a = (long long)(a), th_b = (long long)(b);                                   \
    if (th_a != th_b) th_fail(__FILE__, __LINE__, "%s == %s failed: %lld vs %lld", #a, #b, th_a, th_b); \
  } while (0)

#define CHECK_STATUS(call, want)                                                            \
  do {                                                                                      \
    smelt_status th_s = (call);                                                             \
    if (th_s != (want))                                                                     \
      th_fail(__FILE__, __LINE__, "%s returned %s, want %s (%s)", #call, smelt_status_name(th_s), \
              smelt_status_name(want), smelt_last_error());                                 \
  } while (0)

#define CHECK_OK(call) CHECK_STATUS(call, SMELT_OK)

/* The last error message contains every one of the given substrings. */
#define CHECK_MSG(sub)                                                                     \
  do {                                                                                     \
    if (!strstr(smelt_last_error(), (sub)))                                                \
      th_fail(__FILE__, __LINE__, "message \"%s\" lacks \"%s\"", smelt_last_error(), (sub)); \
  } while (0)

#define SKIP(why)      \
  do {                 \
    th_skip(why);      \
    return;            \
  } while (0)

/* Stop the test here if anything failed so far (avoid cascades). */
#define REQUIRE(cond)                                                       \
  do {                                                                      \
    if (!(cond)) {                                                          \
      th_fail(__FILE__, __LINE__, "REQUIRE(%s) failed", #cond);             \
      return;                                                               \
    }                                                                       \
  } while (0)

/* Runner hooks (tests/main.c). */
void th_seed_set(uint64_t seed);
void th_contexts_destroy(void);

/* ---- random numbers (xoshiro-like, seeded per test and printed on failure) */
uint64_t th_rand_u64(void);
double th_rand_uniform(double lo, double hi);
double th_rand_normal(void);

/* ---- contexts. th_cpu() is always there; th_cuda() is NULL without a GPU. */
smelt_ctx *th_cpu(void);
smelt_ctx *th_cuda(void);
/* 1 if th_cuda()'s device is an sm_90 one (the Hopper kernels' arch). */
int th_cuda_sm90(void);

/* ---- buffers with guard regions on the context's device. The payload is
 * poisoned (0xFF bytes: NaN for floats, -1 for ints) at creation. */
typedef struct th_buf {
  smelt_ctx *ctx;
  size_t bytes;
  uint8_t *base; /* allocation: guard | payload | guard */
  void *data;    /* payload */
} th_buf;
#define TH_GUARD 256
th_buf th_buf_new(smelt_ctx *ctx, size_t bytes);
void th_buf_free(th_buf *b);
/* Copies host memory into the payload / payload out to host. */
void th_buf_upload(th_buf *b, const void *host, size_t bytes);
void th_buf_download(const th_buf *b, void *host, size_t bytes);
/* 1 if both guards still hold their pattern. */
int th_buf_guards_ok(const th_buf *b);
/* 1 if all n bytes at p hold the poison (0xFF). */
int th_all_ff(const void *p, size_t n);
/* 1 if b's payload is still all poison and its guards hold: nothing wrote to it. */
int th_buf_untouched(const th_buf *b);

/* ---- strided views into a th_buf: `offset` elements from the payload start,
 * `storage` elements in the buffer, `numel` the view's element count. */
typedef struct th_view {
  int ndim;
  int64_t shape[SMELT_MAX_DIMS], strides[SMELT_MAX_DIMS];
  int64_t offset, storage, numel;
} th_view;
/* Storage element (relative to offset) of the view's row-major linear index i. */
int64_t th_view_off(const th_view *v, int64_t i);
/* The smelt_tensor of the view over b's payload. */
smelt_tensor th_view_tensor(const th_view *v, const th_buf *b, smelt_dtype dt);
/* The view of this shape and these strides, `offset` elements into its
 * buffer: numel and storage (up to its furthest element) follow from them. */
th_view th_view_make(int ndim, const int64_t *shape, const int64_t *strides, int64_t offset);
/* An output view of b after a run: every element written (not the poison),
 * every other element of the buffer still poison, guards intact; failures
 * name `what` and the output `name`. Fills got[] (doubles) unless NULL. */
void th_check_output(const char *what, const char *name, const th_view *v, const th_buf *b, smelt_dtype dt,
                     double *got);

/* ---- host data helpers */
/* Fills n elements of dtype dt with uniform values in [lo, hi) (rounded to dt). */
void th_fill_uniform(void *host, smelt_dtype dt, int64_t n, double lo, double hi);
double th_get(const void *host, smelt_dtype dt, int64_t i);
void th_set(void *host, smelt_dtype dt, int64_t i, double v);

/* Compares got vs ref (n doubles each): relative L2 error ||got-ref||/||ref||,
 * max abs error and its index, and NaN/Inf parity (a NaN where ref has none or
 * vice versa is a failure). Returns 1 if within bound; prints details if not. */
int th_compare(const char *what, const double *got, const double *ref, int64_t n, double rel_bound,
               double abs_bound);

#endif /* SMELT_TEST_HARNESS_H */
