/* The fuzz target's shared machinery: a reader that turns the input bytes
 * into choices, an arena every tensor view points into, views built the way
 * a careful caller would build them (or broken on purpose in the fields the
 * library must itself reject), and the check run around every call: on an
 * error nothing in the arena changed and the message is not empty; on
 * success only bytes of the declared outputs' elements changed. Each op
 * family's entry points live in their own file (fuzz_ops.c, fuzz_gemm.c,
 * fuzz_attention.c, fuzz_peer.c, fuzz_conv2d.c, fuzz_moe.c, fuzz_bem.c,
 * fuzz_quant.c, fuzz_layers.c, fuzz_decode.c). */
#ifndef SMELT_FUZZ_H
#define SMELT_FUZZ_H

#include <smelt.h>

#include <stddef.h>
#include <stdint.h>

/* Every view lives here. Small enough that comparing it whole after every
 * call stays cheap, large enough for every shape the generators draw. */
#define FZ_ARENA_BYTES ((size_t)256 << 10)
/* A view with more logical elements than this is a caller asking for real
 * work beyond the arena (even through stride-0 broadcasts), so the target
 * never builds one unless its size overflows, which the library must reject. */
#define FZ_MAX_NUMEL ((int64_t)1 << 13)
/* At most this many outputs take part in one call. */
#define FZ_MAX_OUTS 24

typedef struct fz {
  const uint8_t *p;
  size_t n;
  smelt_ctx *ctx;
} fz;

/* Input bytes; 0 once the input is used up, so every input is a full program. */
uint8_t fz_u8(fz *f);
uint32_t fz_u32(fz *f);
uint64_t fz_u64(fz *f);
/* A size: mostly in [0, max], sometimes a hostile value (huge, near 2^31,
 * 2^62 or INT64_MAX, or negative). */
int64_t fz_size(fz *f, int64_t max);
/* Like fz_size, never hostile: for sizes the target itself must bound. */
int64_t fz_small(fz *f, int64_t max);
/* 1 with probability about 1/n. */
int fz_one_in(fz *f, int n);
/* A double that is mostly ordinary, sometimes 0, negative, NaN or inf. */
double fz_double(fz *f);
/* An enum value: mostly in [0, count), sometimes out of range. */
int fz_enum(fz *f, int count);

/* The arena and a view into it. Builds a row-major view of `shape` (ndim
 * dims) with dtype dt; in some calls the input changes its layout
 * (transposed, padded, broadcast), in some it breaks it (dtype, ndim, a
 * shape or stride, NULL or misaligned data, the wrong device). The view is
 * kept only if it is either one the library must reject (a negative size,
 * an element count or span that overflows, ...) or one that fits the
 * arena; otherwise it falls back to the plain row-major view, its hostile
 * sizes made small. `out` marks it as an output of the next call. */
extern uint8_t *fz_arena;
smelt_tensor fz_view(fz *f, smelt_dtype dt, int ndim, const int64_t *shape, int out);
/* A view the input does not break (for index tensors whose values matter). */
smelt_tensor fz_view_plain(fz *f, smelt_dtype dt, int ndim, const int64_t *shape, int out);
/* A copy of t at another place in the arena (same layout), as the views of
 * an array GEMM's problems share one. */
smelt_tensor fz_moved(fz *f, const smelt_tensor *t, int out);
/* Scales down the ordinary sizes among dims[0..n) (those in [0, 64]) until
 * their product is at most cap: the CPU reference's work stays small. */
void fz_cap_work(int64_t *dims, int n, int64_t cap);
/* a * b for sizes, saturated: a hostile size stays hostile (a negative
 * one stays negative) instead of wrapping. */
int64_t fz_mul(int64_t a, int64_t b);
/* Registers t as an output of the calls until fz_reset_outputs (fz_view
 * does this when asked). */
void fz_output(const smelt_tensor *t);
/* Registers n raw bytes at p (in the arena) as an output of the next call. */
void fz_output_bytes(const void *p, size_t n);
/* Room for n bytes in the arena, aligned to 8, for raw outputs. */
void *fz_bytes(fz *f, size_t n);
/* 1 if the view fits the arena and is valid by the library's rules. */
int fz_view_ok(const smelt_tensor *t);
/* Writes integer values into a valid view of i32 or i64 (offsets, sequence
 * bounds, ids) before the call: values[i] for element i. */
void fz_fill_ints(const smelt_tensor *t, const int64_t *values, int64_t n);

/* Run around every library call: fz_begin snapshots the arena; fz_end
 * checks the result against it (abort() on a violation) and counts the
 * call under `name`. Returns s. */
void fz_begin(void);
smelt_status fz_end(const char *name, smelt_status s);
/* As fz_end, for calls that write no tensor even when they succeed (plans). */
smelt_status fz_end_pure(const char *name, smelt_status s);
/* A plan call's out-pointer: set on success, NULL on failure. */
void fz_check_plan(const char *name, smelt_status s, const smelt_plan *plan);
/* Forgets the outputs registered so far (a run's new views replace them). */
void fz_reset_outputs(void);
/* Whether round r of a call made in `mode` (fz_mode) happens; a later round
 * forgets the earlier round's outputs first. The loop every entry point
 * runs: for (int r = 0; fz_round(r, mode); r++). */
int fz_round(int r, int mode);
/* Checks that the bytes of n host structures (tensor views, descs) passed
 * as const did not change, given copies taken before the call. */
void fz_same(const char *name, const void *before, const void *after, size_t n);
/* With SMELT_FUZZ_VERBOSE set, prints the call's name and views. */
void fz_trace(const char *name, const smelt_tensor *t, int n);
/* Counts a call that has no status (a helper returning a value). */
void fz_count(const char *name);

/* One call through the checks, with the tensor array T (the views passed
 * as const) compared before and after. */
#define FZ_CHECKED(end, s, name, T, expr)                                                                        \
  do {                                                                                                           \
    smelt_tensor fz_saved_[sizeof(T) / sizeof(T[0])];                                                            \
    memcpy(fz_saved_, T, sizeof fz_saved_);                                                                      \
    fz_trace(name, T, (int)(sizeof(T) / sizeof(T[0])));                                                          \
    fz_begin();                                                                                                  \
    s = end(name, (expr));                                                                                       \
    fz_same(name, fz_saved_, T, sizeof fz_saved_);                                                               \
  } while (0)
#define FZ_CALL(s, name, T, expr) FZ_CHECKED(fz_end, s, name, T, expr)
#define FZ_PLAN(s, name, T, plan, expr)                                                                          \
  do {                                                                                                           \
    plan = NULL;                                                                                                 \
    FZ_CHECKED(fz_end_pure, s, name, T, expr);                                                                   \
    fz_check_plan(name, s, plan);                                                                                \
  } while (0)

/* Round r of an entry point NAME called in `mode` (below): the one-shot
 * NAME when mode is 0 (then the caller returns), else NAME_plan in round 0
 * (the caller returns when it fails) and NAME_run. */
#define FZ_ROUND(s, r, mode, plan, T, NAME, ONE_SHOT, PLAN, RUN) \
  if (mode == 0) {                                               \
    FZ_CALL(s, NAME, T, ONE_SHOT);                               \
    return;                                                      \
  }                                                              \
  if (r == 0) {                                                  \
    FZ_PLAN(s, NAME "_plan", T, plan, PLAN);                     \
    if (s) return;                                               \
  }                                                              \
  FZ_CALL(s, NAME "_run", T, RUN)

/* How a call is made: 0 one-shot, 1 plan + run, 2 plan + two runs (the
 * second on fresh views of the same shapes). */
int fz_mode(fz *f);
/* For tensor i of n: NULL now and then, else &t[i] (one NULL per call at most). */
const smelt_tensor *fz_maybe_null(unsigned nulls, smelt_tensor *t, int i);
unsigned fz_nulls(fz *f, int n);
/* A float storage dtype mostly (f32, f16, bf16), now and then any value. */
smelt_dtype fz_float_dtype(fz *f);

/* The op families' entry points. Each consumes what it needs from f and
 * calls one or more public functions through fz_begin/fz_end. */
void fz_activation(fz *f);
void fz_softmax(fz *f);
void fz_topk(fz *f);
void fz_helpers(fz *f);
void fz_gemm(fz *f);
void fz_gemm_array(fz *f);
void fz_gemm_grouped(fz *f);
void fz_gemm_grouped_offs(fz *f);
void fz_attention(fz *f);
void fz_attention_varlen(fz *f);
void fz_attention_decode(fz *f);
void fz_norm(fz *f);
void fz_residual_add(fz *f);
void fz_rotary(fz *f);
void fz_qgemm(fz *f);
void fz_peer(fz *f);
void fz_peer_store(fz *f);
void fz_conv2d(fz *f);
void fz_moe(fz *f);
void fz_bem(fz *f);
void fz_quant(fz *f);
void fz_graph(fz *f);

#endif
