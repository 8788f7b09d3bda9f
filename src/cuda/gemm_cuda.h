/* The CUDA GEMM's internal interface: the kernel table (one entry per
 * compiled variant), the selector that picks from it, and the launch
 * parameters shared with kernels/gemm_common.cuh. */
#ifndef SMELT_GEMM_CUDA_H
#define SMELT_GEMM_CUDA_H

#include "../core/gemm_internal.h"
#include "cuda_internal.h"
#include "gemm_prep.h"

typedef enum smelt__gemm_family {
  SMELT__GK_SIMT,   /* kernels/gemm_simt.cu: any dtype, layout and mode */
  SMELT__GK_SM80,   /* kernels/gemm_sm80.cu: mma.sync, sm_80 and later */
  SMELT__GK_SM90,   /* kernels/gemm_sm90.cu: TMA + wgmma, persistent, sm_90a */
  SMELT__GK_REDUCE, /* kernels/gemm_reduce.cu: the second kernel of a parallel split-K */
  SMELT__GK_GEMV    /* kernels/gemm_gemv.cu: M <= 16 streaming B (mma.sync), sm_80 and later */
} smelt__gemm_family;

/* Tensor-op element kinds (GEMM_TC in gemm_sm80.cu). */
enum { SMELT__TC_NONE = 0, SMELT__TC_F16, SMELT__TC_BF16, SMELT__TC_TF32, SMELT__TC_3XTF32, SMELT__TC_I8, SMELT__TC_FP8 };

typedef struct smelt__gemm_kernel {
  smelt__gemm_family fam;
  smelt_gemm_acc acc;
  int tc;                   /* SMELT__TC_*; 0 for SIMT and the reduction */
  smelt_dtype fp8_a, fp8_b; /* SMELT__TC_FP8: e4m3 or e5m2 each */
  int a_kmajor, b_kmajor;   /* tensor ops: which axis of A and B has unit stride */
  int bm, bn, bk, stages, wm, wn; /* sm90: wm = consumer warpgroups */
  int threads, smem;        /* launch: block size and dynamic shared memory bytes */
  int cluster_m, cluster_n; /* sm90: CTAs per cluster along M (sharing B) or N (sharing A), else 1 */
  int promote;              /* sm90 tf32: stages per accumulator promotion (GEMM_PROMOTE), else 0 */
  int pingpong;             /* sm90: the ping-pong schedule (GEMM_PINGPONG; its tile 128 x 128) */
  int blk;                  /* sm90 fp8: block scales, promoted every 128 of K (GEMM_BLOCK_SCALE) */
} smelt__gemm_kernel;

/* Every kernel the selector can pick, in a fixed order; returns the count. */
#define SMELT__GEMM_MAX_KERNELS 128
int smelt__gemm_table(smelt__gemm_kernel *out);
/* A 16-bit Hopper kernel outside the table, 64 x consumers rows (1 or 2)
 * by bn (tc F16 or BF16, 1: K-major; pingpong 1: the ping-pong schedule,
 * 2 consumers, bn 128 or 64), its threads and shared memory laid out as
 * the table's (conv2d's implicit GEMM builds its variants on it). */
smelt__gemm_kernel smelt__gemm_sm90_kernel(int tc, int consumers, int bn, int stages, int a_kmajor, int b_kmajor,
                                           int pingpong);
/* Whether a K walk of k (at most 1024: 16 K steps of 64) over `tiles`
 * tiles, at least an SM's worth, takes the ping-pong schedule (the GEMM's
 * plain runs, conv2d's implicit GEMM): the cooperative kernel's consumers
 * run their epilogue together while the tensor cores wait, a tenth of a
 * tile's time at such K, which ping-pong overlaps with the other
 * consumer's main loop. On H100 RC and RR at K 512-1024 ran 8-12% faster
 * on it (4096 x 14336 x 1024: 651 -> 718 TFLOP/s), CR 640 -> 679 at 8192^2
 * x 1024; at K 2048 it lost 12% (a third more L2 -> SM bytes per MAC). */
int smelt__gemm_short_k_pingpong(int64_t k, int64_t tiles, int64_t sms);
/* The source of table entry k; "gemm_sm80_bf16_RC_128x128x32_s4" etc. */
void smelt__gemm_kernel_src(const smelt__gemm_kernel *k, smelt__kernel_src *src);

/* What the selector looks at: the plan's state plus facts about the
 * operands of every problem (for grouped runs, all of them must hold). */
typedef struct smelt__gemm_facts {
  int a_k, a_mn, b_k, b_mn; /* A / B usable K-major or MN-major by the tensor-op kernels */
  int tma_a[2], tma_b[2];   /* [1] K-major, [0] MN-major: rows at least a row apart (TMA wants no overlap) */
  int64_t m, n, k, batch;   /* the (first) problem's sizes; batch = problems per launch */
  int sm90_d;               /* every problem's D takes gemm_sm90's TMA stores (smelt__gemm_sm90_fast_d 1) */
  int64_t k_min;            /* the smallest K over the problems */
  int promote;              /* 3xtf32 split operands: only a kernel that promotes its sums (kernel.promote) */
  int batch_d16;            /* batched: D's entries a whole number of 16-byte units apart (TMA's 3-D map) */
} smelt__gemm_facts;

/* How gemm_sm90's fast epilogue can write p's D (16-bit or f32,
 * row-major, rows not overlapping, sizes below 2^31, no C, no epilogue
 * graph; else 0, the
 * general epilogue): 1 through TMA stores, which need rows whole 16-byte
 * units apart, each row N elements of whole 16-byte units (a TMA store
 * writes a partial unit at the row's end in full) and a 16-byte aligned
 * start; 2 through the threads' element stores otherwise (N odd, say). */
int smelt__gemm_sm90_fast_d(const smelt__gemm_state *st, const smelt__gemm_prob *p);

void smelt__gemm_facts_of(const smelt__gemm_state *st, const smelt__gemm_args *args, smelt__gemm_facts *f);

/* The CUDA backend's decisions (plan->backend), made once at plan time;
 * the core's smelt__gemm_state stays as the core resolved it. */
typedef struct smelt__gemm_cuda_plan {
  smelt_gemm_mode mode; /* the launch's mode: the core's, or a parallel split chosen for AUTO */
  int split_k;          /* slices, >= 1 */
  int kernel;           /* the main kernel (table index) */
  int align[3];         /* the planned A, B and D pointers' alignment (bytes, up to 16) */
  /* For runs whose pointers are less aligned than planned: the kernel the
   * selector gave them (-1 until one came) and its function. */
  int fallback;
  void *fallback_func;
  /* Hopper: the pre-pass each operand (A, B) gets before the main kernel
   * (smelt__gemm_prep_choose); the main kernel then runs the prepped
   * operands: K-major, or (16-bit PITCH copies) of their own major-ness. */
  smelt__gemm_prep prep[2];
} smelt__gemm_cuda_plan;

/* Picks the main kernel (index into the table) for st on the context's
 * device, or fails with UNSUPPORTED saying why (a tile or opclass that no
 * kernel serves). `why` gets a short reason for the choice. */
smelt_status smelt__gemm_select(const smelt__gemm_state *st, const smelt__gemm_facts *f, const smelt_device_info *dev,
                                const smelt__gemm_kernel *table, int n, int *kernel, char *why, size_t why_n);
/* Every main kernel the selector may pick for st on dev under the
 * description's opclass and tile, in table order (the autotuner's
 * candidates, src/cuda/gemm_tune.c): writes up to max table indices and
 * returns the count. */
int smelt__gemm_candidates(const smelt__gemm_state *st, const smelt__gemm_facts *f, const smelt_device_info *dev,
                           const smelt__gemm_kernel *table, int n, int *out, int max);
/* On Hopper, which operands get the pre-pass (src/cuda/gemm_prep.h) so
 * that the TMA + wgmma kernel can run them: f32 with math TF32 both, rounded
 * to the nearest tf32 (the kernel would truncate); math 3XTF32 both, split
 * into three parts along K (one tf32 GEMM over 3 K' then gives the three
 * products); fp8 the operands not K-major (wgmma takes fp8 K-major only);
 * f16/bf16 the operands whose rows are not 128 bytes apart, when that pays
 * (p: the problem, for its strides). Plain and batched GEMMs. Returns 1
 * when any operand gets one. */
int smelt__gemm_prep_choose(const smelt__gemm_state *st, const smelt__gemm_prob *p, const smelt__gemm_facts *f,
                            const smelt_device_info *dev, smelt__gemm_prep prep[2]);
/* The state and facts the selector sees for the prepped operands: K-major
 * (a PITCH copy: its own major-ness), 16-byte aligned, K the GEMM's new K
 * (3 K' for a split), tf32 math. */
void smelt__gemm_prep_facts(const smelt__gemm_state *st, const smelt__gemm_prob *p, const smelt__gemm_facts *f,
                            const smelt__gemm_prep prep[2], smelt__gemm_state *ps, smelt__gemm_facts *pf);
/* The K of the GEMM the main kernel runs on prepped operands. */
int64_t smelt__gemm_prep_gemm_k(const smelt__gemm_state *st, const smelt__gemm_prep prep[2], int64_t k);
/* The reduction kernel for a main kernel's accumulator. */
int smelt__gemm_reduce_kernel(const smelt__gemm_kernel *table, int n, smelt_gemm_acc acc);
/* 1 if table kernel k can run the operands described by f. */
int smelt__gemm_fits(const smelt__gemm_kernel *k, const smelt__gemm_state *st, const smelt__gemm_facts *f);

/* Kernel modes (MODE_* in kernels/gemm_common.cuh). */
enum { SMELT__KMODE_PLAIN, SMELT__KMODE_SERIAL, SMELT__KMODE_PARALLEL, SMELT__KMODE_BATCHED, SMELT__KMODE_ARRAY,
       SMELT__KMODE_GROUPED, SMELT__KMODE_GROUPED_OFFS };

/* Launch parameters: the host twins of gemm_prob and gemm_params in
 * kernels/gemm_common.cuh, byte for byte (both sides assert the sizes). */
typedef struct smelt__gemm_kprob {
  int64_t m, n, k;
  uint64_t a, b, c, d, bias;
  int64_t a_rs, a_cs, b_rs, b_cs, c_rs, c_cs, d_rs, d_cs, bias_s;
  uint64_t sa, sb;
  int64_t sa_s, sb_s;
} smelt__gemm_kprob;

typedef struct smelt__gemm_kparams {
  smelt__gemm_kprob p;
  int64_t a_bs, b_bs, c_bs, d_bs;
  int64_t k_slice;
  uint64_t groups, group_tiles;
  uint64_t ptr_a, ptr_b, ptr_c, ptr_d;
  uint64_t workspace, semaphores;
  double alpha_ab, beta;
  float scale_d, slope;
  int mode, count, splits, batch_base;
  int dt_a, dt_b, dt_c, dt_d, dt_bias;
  int act, clamp, has_c, has_bias;
  int swizzle;
  int tiles_m, tiles_n;
  uint64_t offs;
  int64_t bias_gs;
  int offs_i64, offs_pad;
  int64_t sb_gs;
  int has_sa, has_sb;
  int sk_tiles, sk_chunks;
} smelt__gemm_kparams;

_Static_assert(sizeof(smelt__gemm_kprob) == 168, "smelt__gemm_kprob must match gemm_prob");
_Static_assert(sizeof(smelt__gemm_kparams) == 408, "smelt__gemm_kparams must match gemm_params");

/* Split-K's workspace for launch parameters kp (mode SERIAL or PARALLEL,
 * splits set): the partial sums of an m x n result (every slice's for a
 * parallel split, one for serial) of acc_bytes each and, for serial, one
 * cleared semaphore a tile; sets kp's workspace and semaphores. *ws is the
 * allocation the caller frees (set even when clearing failed). */
smelt_status smelt__gemm_split_workspace(smelt_ctx *ctx, smelt__gemm_kparams *kp, int64_t m, int64_t n,
                                         int64_t tiles, size_t acc_bytes, void **ws);
/* Hopper tensor maps (128-byte swizzle): a 2-D map of rows x k elements,
 * rows rs apart, in boxes of box_rows x bk (a K-major operand, or a
 * row-major D in the fast epilogue's boxes of 64 rows x 128 bytes); a
 * parallel split's f32 workspace [splits][m][n] in boxes of one slice x 64
 * rows x 32 columns. */
smelt_status smelt__gemm_tensor_map(smelt__cu_tensor_map *map, smelt_dtype dt, const void *data, int64_t rows,
                                    int64_t k, int64_t rs, int box_rows, int bk);
/* The same over `batch` such matrices `bs` elements apart (a 3-D map, boxes
 * of one matrix's box_rows x bk; batch 0: the 2-D map). */
smelt_status smelt__gemm_tensor_map_batched(smelt__cu_tensor_map *map, smelt_dtype dt, const void *data, int64_t rows,
                                            int64_t k, int64_t rs, int64_t batch, int64_t bs, int box_rows, int bk);
smelt_status smelt__gemm_workspace_map(smelt__cu_tensor_map *map, const void *ws, int64_t m, int64_t n, int splits);
/* Hopper launch of kernel k's function f over `units` tiles (or clusters'
 * tiles): one persistent CTA an SM, or as many clusters as run at once. */
smelt_status smelt__gemm_sm90_launch(smelt_ctx *ctx, const char *op, const smelt__gemm_kernel *k, CUfunction f,
                                     int64_t units, void **params);
/* Grouped by offsets: kp's mode, group count, device row ends (i32, or i64
 * when ends_i64) and its bound on the tiles, (ceil(m / bm) + count) x
 * ceil(n / bn), refused (op's message) where the kernel's indices would
 * overflow (on Hopper, sm90: with a grid's width more). */
smelt_status smelt__gemm_offs_grid(smelt_ctx *ctx, const char *op, int sm90, int64_t m, int64_t n, int bm, int bn,
                                   int64_t count, const void *ends, int ends_i64, smelt__gemm_kparams *kp);
/* The split tail of a plain Hopper run of `tiles` tiles over K = kk (op_gemm.c
 * says when it is taken): sets kq's sk_tiles, sk_chunks, workspace and
 * semaphores and allocates *ws (the caller frees it after the launch), or
 * leaves them when the last wave is full enough. */
smelt_status smelt__gemm_split_tail(smelt_ctx *ctx, const char *op, const smelt__gemm_kernel *k, int64_t kk,
                                   int64_t tiles, smelt__gemm_kparams *kq, void **ws);
/* The grouped kernel's tables (host scheduling) uploaded from host: the
 * groups' tensor maps (maps bytes: 3 a group on Hopper, else none), then
 * count problems (smelt__gemm_kprob) and count + 1 first tiles (int64),
 * into *dev from the context's pool (the caller frees it after the launch;
 * set also on a failed upload); kp's groups, group_tiles and count point
 * at them. */
smelt_status smelt__gemm_grouped_upload(smelt_ctx *ctx, const char *op, const void *host, size_t maps, int64_t count,
                                       smelt__gemm_kparams *kp, void **dev);
/* The units a launch of `tiles` tiles walks: with a split tail, each tail
 * tile's chunks are units of their own, which the CTAs (one an SM, up to
 * this many) share. */
int64_t smelt__gemm_sk_units(const smelt__gemm_kparams *kq, int64_t tiles);
/* A parallel split's second kernel (f: the table's gemm_reduce): adds the
 * slices in order and applies the epilogue. */
smelt_status smelt__gemm_split_reduce(smelt_ctx *ctx, const char *op, void *f, smelt__gemm_kparams *kp,
                                      int64_t m, int64_t n);

/* The block scales of gemm_sm90's block-scaled variants (GEMM_BLOCK_SCALE),
 * their last kernel parameter: the host twin of sm90_blk in
 * kernels/gemm_sm90.cu (sizes asserted on both sides). */
typedef struct smelt__gemm_kblk {
  uint64_t sa, sb;              /* f32 [M, KB] and [NB, KB] (batched: entry at sa_bs, sb_bs) */
  int64_t sa_rs, sa_ks, sa_bs;  /* per row, per k block, per entry */
  int64_t sb_rs, sb_ks, sb_bs;  /* per 128 columns, per k block, per entry */
} smelt__gemm_kblk;

_Static_assert(sizeof(smelt__gemm_kblk) == 64, "smelt__gemm_kblk must match sm90_blk");
/* ---- epilogue graphs (src/cuda/epi_graph_gen.c, src/cuda/gemm_epi.c) */

/* The host twin of epi_ptrs in kernels/gemm_epi_graph.cuh: the slots'
 * pointers and strides, and each reduction's f32 partials. */
typedef struct smelt__epi_kptrs {
  uint64_t data[SMELT_EPI_MAX_TENSORS];
  int64_t rs[SMELT_EPI_MAX_TENSORS], cs[SMELT_EPI_MAX_TENSORS];
  uint64_t part[SMELT_EPI_MAX_TENSORS];
} smelt__epi_kptrs;

_Static_assert(sizeof(smelt__epi_kptrs) == 256, "smelt__epi_kptrs must match epi_ptrs");

/* Table kernel k's source with graph g (slot dtypes slot_dt) in its
 * prelude and the graph's hash in its name; -1 when the graph's code does
 * not fit the prelude. */
int smelt__gemm_graph_src(const smelt__gemm_kernel *k, const smelt_epi_graph *g, const smelt_dtype *slot_dt,
                          smelt__kernel_src *src);
/* The source of kernel k for st: with st's graph when it has one. */
void smelt__gemm_src_for(const smelt__gemm_state *st, const smelt__gemm_kernel *k, smelt__kernel_src *src);
/* The Hopper kernel's own split of a plain GEMM (src/cuda/op_gemm.c's choose_split)
 * when its tiles fill at most an eighth of the SMs and it runs split as
 * well; else 1. */
int smelt__gemm_sm90_auto_split(const smelt__gemm_state *st, const smelt__gemm_kernel *k, const smelt__gemm_facts *f,
                                int sm_count);
/* The second pass of the reductions (kernels/gemm_epi_reduce.cu). */
void smelt__gemm_epi_reduce_src(smelt__kernel_src *src);
/* The graphs the tests run, for the variant list (the compile suite
 * builds them through NVRTC): writes up to max sources, returns the count. */
int smelt__gemm_graph_variants(smelt__kernel_src *out, int max);
/* A graph run around the main kernel k: begin fills E (slots from p, the
 * partials in a workspace from the context's pool, *ws); end launches the
 * reductions' second pass (f: gemm_epi_reduce) unless s (the launches'
 * status) failed, and gives the workspace back; it returns the first
 * failure. */
smelt_status smelt__gemm_epi_begin(smelt_ctx *ctx, const smelt__gemm_state *st, const smelt__gemm_kernel *k,
                                   const smelt__gemm_prob *p, smelt__epi_kptrs *E, void **ws);
smelt_status smelt__gemm_epi_end(smelt_ctx *ctx, void *f, const smelt__gemm_state *st, const smelt__gemm_kernel *k,
                                 const smelt__gemm_prob *p, const smelt__epi_kptrs *E, void *ws, smelt_status s);

#endif /* SMELT_GEMM_CUDA_H */
