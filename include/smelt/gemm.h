/* smelt GEMM: D = epilogue(alpha · (A @ B) + beta · C).
 *
 * The operation is described the way the CUTLASS Python interface describes
 * it, in four parts plus a mode:
 *   math     which units and which arithmetic: SIMT or tensor cores, the
 *            accumulator type, and for f32 operands exact f32, tf32 or 3xtf32;
 *   tile     threadblock tile, pipeline stages, warp layout, cluster and
 *            rasterization swizzle (0 everywhere = let smelt choose);
 *   operands the tensors themselves: each carries its dtype, and its strides
 *            say row- or column-major; alignment is derived from the data
 *            pointer and the strides (unaligned operands take a slower path);
 *   epilogue alpha, beta, bias, activation, output clamp, fp8 scales (per
 *            tensor, or per row of A and per column of B, or per block:
 *            desc.scales, smelt_gemm_scales);
 *   mode     plain, split-K (serial or parallel), batched, array, grouped
 *            (host scheduling), grouped by offsets (device scheduling).
 *
 * Shapes (row-major indices; any non-negative strides, one of them usually 1):
 *   A [M, K]   B [K, N]   C [M, N]   D [M, N]   bias [N]
 *   batched:   A [L, M, K]  B [L, K, N]  C, D [L, M, N]  (bias [N], shared)
 * Any M, N, K >= 0 (K = 0 gives D = epilogue(beta · C)). Input strides may
 * be 0 (broadcast, e.g. one B for every batch); D must not overlap itself,
 * A, B or bias. D may be C exactly (same pointer and strides: in place).
 *
 * Element types (A and B):
 *   f64 x f64                     acc f64
 *   f32, f16, bf16, e4m3, e5m2    any mix, acc f32 (f16 x f16 may ask for acc f16)
 *   i8 x i8                       acc i32 (exact; wraps past 2^31 as hardware does)
 * C and D: f64, f32, f16, bf16, e4m3, e5m2, i8 or i32, independently.
 * bias: f64, f32, f16, bf16 or i32.
 *
 * The epilogue, per element, in f64 for f64 and i32 accumulators and in f32
 * otherwise (the CPU reference does everything in f64):
 *   v = alpha · scale_a · scale_b · sa[m] · sb[n] · acc + beta · C[m,n] + bias[n]
 *   v = act(v)                      (identity, relu, leaky_relu(slope), ...)
 *   D[m,n] = convert(scale_d · v)
 * sa and sb are the optional row scales of A and column scales of B
 * (smelt_gemm_scales; 1 where absent): they scale the product only, before
 * C and bias are added, as torch._scaled_mm's row-wise form does.
 * C is not read when beta == 0 (it may then be NULL; NaN in it is ignored).
 * convert rounds to nearest even. Float outputs overflow to +-inf unless
 * `clamp` is set, which saturates them to the type's largest finite value;
 * fp8 and integer outputs always saturate (NaN becomes 0 for integers, and
 * stays NaN for floats and fp8).
 */
#ifndef SMELT_GEMM_H
#define SMELT_GEMM_H

#include "../smelt.h"
#include "epilogue.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- math */

typedef enum smelt_gemm_opclass {
  SMELT_GEMM_OPCLASS_AUTO = 0,  /* tensor cores where dtypes, math and alignment allow, else SIMT */
  SMELT_GEMM_OPCLASS_SIMT,      /* CUDA cores only */
  SMELT_GEMM_OPCLASS_TENSOR_OP, /* tensor cores; planning fails (UNSUPPORTED) when they cannot serve */
  SMELT_GEMM_OPCLASS_COUNT
} smelt_gemm_opclass;

/* How f32 operands are multiplied (other dtypes accept only DEFAULT). */
typedef enum smelt_gemm_math_op {
  SMELT_GEMM_MATH_DEFAULT = 0, /* exact products in the accumulator type */
  SMELT_GEMM_MATH_TF32,        /* operands rounded to tf32 (10-bit mantissa): tensor cores, ~3e-4 rel */
  SMELT_GEMM_MATH_3XTF32,      /* each operand split into big + small tf32 parts, 3 products: ~f32 accuracy */
  SMELT_GEMM_MATH_COUNT
} smelt_gemm_math_op;

typedef enum smelt_gemm_acc {
  SMELT_GEMM_ACC_AUTO = 0, /* f64 for f64, i32 for i8, f32 otherwise */
  SMELT_GEMM_ACC_F32,
  SMELT_GEMM_ACC_F16,      /* f16 x f16 only: products and sums rounded to f16 (SIMT) */
  SMELT_GEMM_ACC_F64,      /* f64 x f64 only */
  SMELT_GEMM_ACC_I32,      /* i8 x i8 only */
  SMELT_GEMM_ACC_COUNT
} smelt_gemm_acc;

typedef struct smelt_gemm_math {
  smelt_gemm_opclass opclass;
  smelt_gemm_math_op op;
  smelt_gemm_acc acc;
} smelt_gemm_math;

/* ---------------------------------------------------------------- tile */

/* Every field 0 = choose. A non-zero field restricts the choice to kernels
 * with that value; when none matches, planning fails with UNSUPPORTED and
 * the message lists what exists. The CPU backend ignores the tile. */
typedef struct smelt_gemm_tile {
  int m, n, k;              /* threadblock tile in elements */
  int stages;               /* shared-memory pipeline depth */
  int warps_m, warps_n;     /* warp layout over the tile */
  int cluster_m, cluster_n; /* thread block cluster: 1 x 1, or 2 or 4 along one axis (Hopper, TMA multicast) */
  int swizzle;              /* rasterization: output tiles are visited in bands of `swizzle` tile rows
                               (1 = row by row), so concurrently running tiles share A and B in L2 */
} smelt_gemm_tile;

/* ---------------------------------------------------------------- epilogue */

typedef struct smelt_gemm_epilogue {
  double alpha, beta;  /* defaults 1 and 0 */
  smelt_act act;       /* applied after alpha, beta and bias */
  float slope;         /* leaky_relu slope (default 0.01) */
  int clamp;           /* saturate float outputs to their finite range instead of +-inf */
  float scale_a, scale_b, scale_d; /* per-tensor scales (fp8 style), default 1 */
  const smelt_epi_graph *graph;    /* NULL, or an epilogue graph (smelt/epilogue.h; copied by planning):
                                      plain GEMMs through smelt_gemm_epi_plan, act IDENTITY, scale_d 1 */
} smelt_gemm_epilogue;

/* ---------------------------------------------------------------- mode */

typedef enum smelt_gemm_mode {
  SMELT_GEMM_MODE_AUTO = 0,         /* batched for 3-D operands; for 2-D ones plain, or a parallel
                                       split-K when split_k > 1 or when smelt chooses one (split_k 0) */
  SMELT_GEMM_MODE_PLAIN,            /* one GEMM; split_k must be 0 or 1 */
  SMELT_GEMM_MODE_SPLIT_K_SERIAL,   /* K cut into split_k slices that add into one f32/f64/i32 buffer in
                                       slice order, the last one applying the epilogue */
  SMELT_GEMM_MODE_SPLIT_K_PARALLEL, /* slices write partial sums to a workspace; a reduction kernel adds
                                       them in slice order and applies the epilogue */
  SMELT_GEMM_MODE_BATCHED,          /* L independent GEMMs of one shape, strided (3-D operands) */
  SMELT_GEMM_MODE_ARRAY,            /* `count` GEMMs of one shape at pointers from device arrays */
  SMELT_GEMM_MODE_GROUPED,          /* `count` GEMMs of their own shapes, tiles scheduled on the host */
  SMELT_GEMM_MODE_GROUPED_OFFS,     /* G GEMMs over row ranges of one stacked A and D, the ranges read
                                       from a device tensor of offsets (device scheduling) */
  SMELT_GEMM_MODE_COUNT
} smelt_gemm_mode;

#define SMELT_GEMM_MAX_SPLIT_K 64

/* What the tensors of smelt_gemm_scales are (see there). */
typedef enum smelt_gemm_scale_kind {
  SMELT_GEMM_SCALES_VECTOR = 0, /* row scales of A [M], column scales of B [N] */
  SMELT_GEMM_SCALES_BLOCK,      /* DeepGEMM's 1 x 128 scales of A and 128 x 128 scales of B */
  SMELT_GEMM_SCALES_COUNT
} smelt_gemm_scale_kind;

typedef struct smelt_gemm_desc {
  smelt_gemm_math math;
  smelt_gemm_tile tile;
  smelt_gemm_epilogue epilogue;
  smelt_gemm_mode mode;
  int split_k; /* slices of K, up to SMELT_GEMM_MAX_SPLIT_K; 1 = none; 0 = choose (in AUTO
                  and the split modes; none in the others). Both split modes give the result
                  of the plain GEMM up to the order of the accumulator sums, and both are
                  deterministic (a fixed summation order, no atomics). */
  smelt_gemm_scale_kind scales; /* the form of smelt_gemm_scaled's scales (VECTOR by default) */
} smelt_gemm_desc;

/* Everything chosen automatically, alpha = 1, beta = 0, identity activation,
 * slope 0.01, scales 1. Start from this and change fields. */
SMELT_API smelt_gemm_desc smelt_gemm_desc_default(void);

/* ---------------------------------------------------------------- plain, split-K, batched */

/* desc may be NULL (the defaults). a, b, d are required; c may be NULL when
 * epilogue.beta == 0; bias may be NULL. 2-D operands give a plain (or
 * split-K) GEMM, 3-D operands a batched one (bias stays 1-D). */
SMELT_API smelt_status smelt_gemm_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                       const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                       const smelt_tensor *bias, smelt_plan **out);
/* Binds tensors of exactly the planned dtypes, shapes and strides (data
 * pointers may change). If a pointer is less aligned than the planned one,
 * the run takes a kernel for that alignment (compiled on first use). */
SMELT_API smelt_status smelt_gemm_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b,
                                      const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias);
SMELT_API smelt_status smelt_gemm(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                  const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                  const smelt_tensor *bias);

/* ---------------------------------------------------------------- row and column scales */

/* Per-row scales of A and per-column scales of B, the fp8 "row-wise"
 * (per-token x per-channel) form of torch._scaled_mm, for any dtype:
 *   D[m,n] = epilogue(alpha · scale_a · scale_b · sa[m] · sb[n] · (A @ B)[m,n]
 *                     + beta · C[m,n] + bias[n])
 * Either may be NULL (all ones). Both are f32 vectors of any stride, on
 * the context's device:
 *   a  [M] or [M, 1]   one per row of A (and of D)
 *   b  [N] or [1, N]   one per column of B (and of D)
 * Batched: the same vectors serve every batch entry (like bias).
 * Grouped by offsets: a is [T] or [T, 1], per row of the stacked A; b is
 * [G, N], one row per group (the MoE form). They must not overlap D. */
typedef struct smelt_gemm_scales {
  const smelt_tensor *a; /* row scales of A, or NULL */
  const smelt_tensor *b; /* column scales of B, or NULL */
} smelt_gemm_scales;

/* Block scales (desc.scales = SMELT_GEMM_SCALES_BLOCK, the DeepGEMM form): A and B
 * fp8 (e4m3 or e5m2) as smelt_quantize writes them, A in FP8_1X128 and B
 * (as [N, K], which the [K, N] operand B is a view of) in FP8_128X128,
 * with KB = ceil(K / 128) and NB = ceil(N / 128):
 *   a  [M, KB] f32    one scale per row of A and 128 of K
 *   b  [NB, KB] f32   one scale per 128 columns of B (rows of B's [N, K]) and 128 of K
 *   D[m,n] = epilogue(alpha · scale_a · scale_b ·
 *            sum_kb sa[m,kb] · sb[n/128,kb] · sum_{k in block kb} A[m,k] B[k,n]
 *            + beta · C[m,n] + bias[n])
 * Block kb is K's columns [128 kb, 128 kb + 128); the last one may be
 * short (any K, as the quantizer's ragged last block). Both tensors are
 * required, any non-negative strides. Batched: a [L, M, KB] and b [L, NB,
 * KB] (batch stride 0 shares one). Grouped by offsets
 * (smelt_gemm_grouped_offs_scaled): a [T, KB] per row of the stacked A, b
 * [G, NB, KB] per group's B. Plain, batched and grouped-by-offsets GEMMs
 * (no split-K: desc.split_k 0 or 1). The accumulation follows DeepGEMM: each
 * block's products are summed apart (in the tensor cores on Hopper, with
 * about 14 bits kept) and then scaled and added into an f32 sum, so the
 * blocks' scales may differ by orders of magnitude. CUDA: Hopper (sm_90a)
 * only, A row-major and B column-major (K-major), 16-byte aligned; others
 * fail with UNSUPPORTED. */

/* smelt_gemm_plan/run/smelt_gemm with row and column scales (scales may be
 * NULL: none). A plan made with a vector must be run with one of the same
 * shape and strides, and one made without must be run without; a plan
 * made with vectors is run only here (smelt_gemm_run passes none). Array
 * and grouped (host) modes take no vectors. */
SMELT_API smelt_status smelt_gemm_scaled_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                              const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                              const smelt_tensor *bias, const smelt_gemm_scales *scales,
                                              smelt_plan **out);
SMELT_API smelt_status smelt_gemm_scaled_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b,
                                             const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias,
                                             const smelt_gemm_scales *scales);
SMELT_API smelt_status smelt_gemm_scaled(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                         const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                         const smelt_tensor *bias, const smelt_gemm_scales *scales);

/* ---------------------------------------------------------------- epilogue graphs */

/* smelt_gemm_scaled_* with the tensors of desc->epilogue.graph's slots
 * (smelt/epilogue.h; epi may be NULL when the graph names no slot). Plain
 * GEMMs only: 2-D operands, desc mode AUTO or PLAIN, split_k 0 or 1. A run
 * binds views of the planned dtypes, shapes and strides in every slot (data
 * pointers may change). Everything is validated before anything is
 * written. The plain entry points take a graph that names no slot. */
SMELT_API smelt_status smelt_gemm_epi_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                           const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                           const smelt_tensor *bias, const smelt_gemm_scales *scales,
                                           const smelt_epi_tensors *epi, smelt_plan **out);
SMELT_API smelt_status smelt_gemm_epi_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b,
                                          const smelt_tensor *c, const smelt_tensor *d, const smelt_tensor *bias,
                                          const smelt_gemm_scales *scales, const smelt_epi_tensors *epi);
SMELT_API smelt_status smelt_gemm_epi(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                      const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                      const smelt_tensor *bias, const smelt_gemm_scales *scales,
                                      const smelt_epi_tensors *epi);

/* ---------------------------------------------------------------- array of pointers */

/* `count` GEMMs that share one shape and layout, each at its own pointers,
 * read from arrays in memory of the context's device (host memory on the
 * CPU backend), as cuBLAS's gemmBatched takes them. */
typedef struct smelt_gemm_ptrs {
  const void *const *a; /* [count] */
  const void *const *b; /* [count] */
  const void *const *c; /* [count]; NULL when beta == 0 */
  void *const *d;       /* [count] */
} smelt_gemm_ptrs;

/* a, b, c, d are 2-D templates: dtype, shape and strides of every problem.
 * Their data pointers are never dereferenced; each stands for the alignment
 * all pointers of its array have (pass e.g. the first problem's pointers).
 * c may be NULL when beta == 0; bias (may be NULL) is one real tensor [N]
 * shared by all problems. */
SMELT_API smelt_status smelt_gemm_array_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, int64_t count,
                                             const smelt_tensor *a, const smelt_tensor *b, const smelt_tensor *c,
                                             const smelt_tensor *d, const smelt_tensor *bias, smelt_plan **out);
SMELT_API smelt_status smelt_gemm_array_run(smelt_plan *plan, const smelt_gemm_ptrs *ptrs, const smelt_tensor *bias);

/* ---------------------------------------------------------------- grouped */

/* `count` independent GEMMs, each with its own M, N, K and tensors: a, b, d
 * are arrays of `count` 2-D tensors (host arrays of views); c and bias are
 * NULL or arrays of `count`. Any problem may be empty (M, N or K = 0). A run
 * must use the planned dtypes and the planned presence of c and bias; its
 * count, sizes and strides may differ from the plan's (a run whose problems
 * do not fit the planned kernel's layout or alignment takes one that fits,
 * compiled on first use). The problems run in no fixed order (on a GPU, at
 * once), so no group's d may share memory with another group's a, b, c,
 * bias or d (INVALID_ARGUMENT); within a group d may be c exactly. Every
 * group is validated, and the run's memory reserved, before any d is
 * written. */
SMELT_API smelt_status smelt_gemm_grouped_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, int64_t count,
                                               const smelt_tensor *a, const smelt_tensor *b, const smelt_tensor *c,
                                               const smelt_tensor *d, const smelt_tensor *bias, smelt_plan **out);
SMELT_API smelt_status smelt_gemm_grouped_run(smelt_plan *plan, int64_t count, const smelt_tensor *a,
                                              const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                              const smelt_tensor *bias);
SMELT_API smelt_status smelt_gemm_grouped(smelt_ctx *ctx, const smelt_gemm_desc *desc, int64_t count,
                                          const smelt_tensor *a, const smelt_tensor *b, const smelt_tensor *c,
                                          const smelt_tensor *d, const smelt_tensor *bias);

/* ---------------------------------------------------------------- grouped by offsets */

/* The MoE form (torch._grouped_mm's): G GEMMs that share N and K, whose row
 * counts are known only on the device (e.g. tokens per expert from a
 * router), so the host never reads them and the stream never stalls.
 *   A [T, K]      stacked rows of every group (T = total_rows = A.shape[0])
 *   B [G, K, N]   one matrix per group (any non-negative strides; B given as the view of
 *                 a [G, N, K] tensor, K contiguous, is the tensor cores'
 *                 fast layout)
 *   C, D [T, N]   stacked like A (C only when beta != 0; D may be C)
 *   bias [G, N]   one row per group, or NULL
 *   offs [G]      int32 or int64, contiguous (stride 1), on the context's
 *                 device (host memory on the CPU backend): cumulative row
 *                 ends. Group g owns rows
 *                 [offs[g-1], offs[g]) with offs[-1] = 0, and computes
 *                 D[r] = epilogue(A[r] @ B[g] + beta C[r] + bias[g]) there.
 * Rows at or past offs[G-1] are not written. G, N, K and T are the host's;
 * offs is read only by the device, when the GEMM runs, so it may be
 * written by earlier work on the same stream.
 *
 * Offsets are not validated (that would need the host to read them). The
 * rule for offsets that are not non-decreasing within [0, T] (the caller's
 * bug): each end is clamped to the running maximum and to T,
 *   end[g] = min(T, max(0, offs[0], ..., offs[g])),
 * and group g owns [end[g-1], end[g]). So a decreasing or negative offset
 * gives an empty group, one past T ends at T, every row belongs to at most
 * one group, and nothing outside D is ever written.
 *
 * A run binds tensors of exactly the planned dtypes, shapes and strides
 * (data pointers may change; the offsets' values may change freely). The
 * CUDA path serves the SIMT and mma.sync kernels, and on Hopper the wgmma
 * kernel (f16/bf16, B K-major or N-major: RC and RR, D without C whose
 * rows are whole 16-byte units). desc.mode must be AUTO or GROUPED_OFFS;
 * split_k 0 or 1. */
SMELT_API smelt_status smelt_gemm_grouped_offs_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                                    const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                                    const smelt_tensor *bias, const smelt_tensor *offs,
                                                    smelt_plan **out);
SMELT_API smelt_status smelt_gemm_grouped_offs_run(smelt_plan *plan, const smelt_tensor *a, const smelt_tensor *b,
                                                   const smelt_tensor *c, const smelt_tensor *d,
                                                   const smelt_tensor *bias, const smelt_tensor *offs);
SMELT_API smelt_status smelt_gemm_grouped_offs(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                               const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                               const smelt_tensor *bias, const smelt_tensor *offs);
/* The same with row scales of the stacked A (scales->a [T] or [T, 1]) and
 * column scales of each group's B (scales->b [G, N]); see
 * smelt_gemm_scales. */
SMELT_API smelt_status smelt_gemm_grouped_offs_scaled_plan(smelt_ctx *ctx, const smelt_gemm_desc *desc,
                                                           const smelt_tensor *a, const smelt_tensor *b,
                                                           const smelt_tensor *c, const smelt_tensor *d,
                                                           const smelt_tensor *bias, const smelt_tensor *offs,
                                                           const smelt_gemm_scales *scales, smelt_plan **out);
SMELT_API smelt_status smelt_gemm_grouped_offs_scaled_run(smelt_plan *plan, const smelt_tensor *a,
                                                          const smelt_tensor *b, const smelt_tensor *c,
                                                          const smelt_tensor *d, const smelt_tensor *bias,
                                                          const smelt_tensor *offs, const smelt_gemm_scales *scales);
SMELT_API smelt_status smelt_gemm_grouped_offs_scaled(smelt_ctx *ctx, const smelt_gemm_desc *desc,
                                                      const smelt_tensor *a, const smelt_tensor *b,
                                                      const smelt_tensor *c, const smelt_tensor *d,
                                                      const smelt_tensor *bias, const smelt_tensor *offs,
                                                      const smelt_gemm_scales *scales);

/* ---------------------------------------------------------------- autotuning */

/* smelt_gemm_autotune times every kernel (and, where smelt may choose one,
 * split-K slice count) that could serve the GEMM smelt_gemm_plan would make
 * for these arguments, on the context's stream: each candidate is planned,
 * run once and compared with the heuristic choice's output (relative L2
 * within the output dtype's tolerance, NaN where it has NaN; a candidate
 * that differs is never a winner), then run 3 times to warm up and 15 times
 * between device events. The fastest correct one wins, and a record of it
 * goes to the cache folder ($SMELT_CACHE_DIR/gemm-tune/, one small JSON
 * file per key, written atomically). Later plans on any context look the
 * record up first and take its kernel when it is valid for this device and
 * this version of smelt and fits the operands; otherwise the heuristic.
 *
 * The record's key: device name, SM count and compute capability; the
 * dtypes of A, B, C, D and bias; accumulator, math op and opclass; the
 * layouts of A and B (row- or column-major); activation; mode and the asked
 * split_k; the asked tile; and the shape class: M, N, K and the batch each
 * rounded up to a power of two. Plain, split-K and batched GEMMs are tuned
 * (2-D or 3-D operands, as smelt_gemm_plan takes them); array and grouped
 * ones use the heuristic.
 *
 * The arguments are smelt_gemm_plan's. D is written many times and holds
 * the GEMM's result on return; C is read; D must not be C (in place), since
 * every run would then read the previous one's output. Needs a CUDA
 * context. `out` (may be NULL) gets every candidate's times. When the
 * record cannot be written (no usable cache folder, a full disk) the call
 * returns SMELT_STATUS_CACHE_ERROR or IO_ERROR, with `out` filled all the
 * same. A candidate must beat the heuristic by 2% to win, so timing noise
 * alone never moves the choice.
 *
 * SMELT_GEMM_TUNE=off makes plans ignore the records (the heuristic
 * always); tuning still runs and writes them. */
#define SMELT_GEMM_TUNE_MAX_CANDIDATES 64

enum {
  SMELT_GEMM_TUNE_NO_RECORD = 1u << 0 /* time and report, but write no record */
};

typedef struct smelt_gemm_tune_candidate {
  char kernel[96];     /* the kernel's module name ("gemm_sm80_bf16_RC_128x128x32_s4_w2x4") */
  int split_k;         /* slices of K; 1 = none */
  int heuristic;       /* 1 for what planning picks without a record */
  smelt_status status; /* SMELT_OK, or why it could not be planned or run */
  int correct;         /* its output matched the heuristic choice's */
  double rel_err;      /* ||D - D_heuristic|| / ||D_heuristic|| (relative L2, f64) */
  float median_ms;     /* median of the timed runs; 0 when not timed */
} smelt_gemm_tune_candidate;

typedef struct smelt_gemm_tune_result {
  int count;             /* candidates (at most SMELT_GEMM_TUNE_MAX_CANDIDATES) */
  int winner;            /* index of the fastest correct candidate */
  int heuristic;         /* index of the heuristic's choice */
  int recorded;          /* 1 when the record was written */
  char record_path[512]; /* where the record is (or would be); "" without a cache folder */
  smelt_gemm_tune_candidate cand[SMELT_GEMM_TUNE_MAX_CANDIDATES];
} smelt_gemm_tune_result;

SMELT_API smelt_status smelt_gemm_autotune(smelt_ctx *ctx, const smelt_gemm_desc *desc, const smelt_tensor *a,
                                           const smelt_tensor *b, const smelt_tensor *c, const smelt_tensor *d,
                                           const smelt_tensor *bias, unsigned flags, smelt_gemm_tune_result *out);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_GEMM_H */
