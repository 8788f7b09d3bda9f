/* Conv2d as implicit GEMM on the Hopper kernel: gemm_sm90.cu includes this
 * file when GEMM_CONV is set (1 fprop, 2 dgrad, 3 wgrad; 16-bit operands,
 * the cooperative 128-row tiles, wgrad's also 64-row for K <= 64 output
 * channels; no clusters). Everything but the producer's loads (the ring,
 * the consumers, the epilogues, the parallel split) is the GEMM's.
 *
 * The GEMMs (smelt/conv2d.h's table), with K in taps of 64-channel blocks
 * for fprop and dgrad: K' = R S cb 64 where cb = ceil(channels / 64), so a
 * K step is one tap (r, s) and one block of 64 channels, and the channels
 * past the tensor's are zeros on both sides:
 *   GEMM_CONV 1, fprop: M = NPQ, N = K, K'. A = x in TMA's im2col mode;
 *     B = w [K, R, S, C] through a 3-D map (C, RS, K) whose box {64, 1, BN}
 *     lands as BN K-major rows.
 *   GEMM_CONV 2, dgrad: M = NHW, N = C, K' over (r, s, k). A = dy: in
 *     im2col mode for a unit stride (dx's pixel h reads dy's row h + pad -
 *     r dil, the flipped filter's im2col); a strided dgrad as st_h st_w
 *     unit-stride phases, each over its own taps, its rows scattered to dx
 *     (conv9_piece_out); gathered by the threads where a phase would have
 *     no tap (GEMM_CONV_GATHER 1; below); B = w through a 3-D map
 *     (C, K, RS) whose boxes {64, 64, 1} land as the MN-major panels of 64
 *     columns of C.
 *   GEMM_CONV 3, wgrad: M = K, N = R S C (C a multiple of 64: a panel of 64
 *     columns is one tap), K = NPQ. A = dy as [K, NPQ] MN-major through a
 *     tiled map; B = x in im2col mode, 64 pixels a box: one MN-major panel.
 *
 * TMA's im2col mode: a map over the NHWC tensor (dims C, W, H, N) with a
 * pixel box (lower and upper corners: the positions of the filter's first
 * tap that the conv visits, at the traversal stride), channelsPerPixel 64
 * and pixelsPerColumn the box's rows. A load names the first row's pixel
 * (c, w, h, n), its first tap's position, and the tap's offset (s, r)
 * within the filter; TMA walks the rows through the pixel box in w, h, n
 * order, and positions outside the tensor read zeros, which is the padding.
 * Each row lands as 128 bytes with the 128-byte swizzle, the K-major
 * (fprop, dgrad A) or MN-major panel (wgrad B) layout the wgmma reads. The
 * host's conv9_geom carries the first tap's position per GEMM row:
 * fprop and wgrad (p st - pad_h, q st - pad_w); dgrad the position of the
 * walk's last tap, the others at offsets ((tr - 1 - i) oy, ...): for a
 * unit stride every tap (tr = R, oy = dil_h), the first at h + pad_h -
 * (R - 1) dil_h; for phase ph of stride st the taps r whose ph + pad_h -
 * r dil_h divides by st (every rst-th from r0, oy = rst dil_h / st), at
 * dy's row i + (ph + pad_h - r dil_h) / st for the phase's row i.
 *
 * The strided dgrad's gather (GEMM_CONV_GATHER): dy's row for dx's pixel
 * h and tap r is (h + pad - r dil) / stride when that divides (others read
 * zeros), which no TMA mode walks; the whole producer warpgroup copies it
 * with cp.async, eight 16-byte chunks a thread a stage, into the swizzled
 * K-major layout, while thread 0 loads B by TMA. cp.async writes through
 * the generic proxy and wgmma reads through the async one, so the bytes
 * must pass the writing thread's proxy fence: a producer thread commits
 * each stage's copies as a group and signals a stage CONV_LAG stages later
 * (cp.async.wait_group, the fence, one arrival a warp: 5 arrivals a phase
 * with thread 0's expect_tx); after its last tile it signals the stages
 * still pending. Any lag below the ring's depth is free of deadlock (the
 * stage a producer waits to refill was signalled CONV_LAG steps before).
 * (Every pass ran on such a gather at first: 150-215 TFLOP/s on the
 * H100's ResNet 3x3 layers, a step every ~1.2 us whatever the tile's
 * work; TMA's loads replaced it where a TMA mode walks the operand.)
 *
 * The host guarantees: 16-bit operands; the im2col tensor's channels a
 * multiple of 8 with unit stride, its other strides 16-byte multiples;
 * the pixel box's corners within TMA's [-128, 127] and tap offsets below
 * 2^16; every index below fits an int. */
#ifndef SMELT_CONV2D_SM90_CUH
#define SMELT_CONV2D_SM90_CUH

#if !defined(GEMM_CONV_GATHER)
#define GEMM_CONV_GATHER 0
#endif
#if !defined(GEMM_CONV_ROWMAP)
#define GEMM_CONV_ROWMAP 0
#endif
#if GEMM_CONV < 1 || GEMM_CONV > 3 || AB_SIZE != 2 || (BM != 128 && !(GEMM_CONV == 3 && BM == 64)) ||               \
    (PINGPONG && (GEMM_CONV == 3 || GEMM_CONV_GATHER)) || CLUSTER > 1 || PROMOTE || BLOCK_SCALE ||                     \
    (GEMM_CONV == 3 && BN < 128) || A_MN != (GEMM_CONV == 3) ||                                                        \
    B_MN != (GEMM_CONV >= 2) || (GEMM_CONV_GATHER && GEMM_CONV != 2) || (GEMM_CONV_ROWMAP && (GEMM_CONV != 2 || GEMM_CONV_GATHER))
#error "GEMM_CONV: 1 fprop (RC), 2 dgrad (RR; GEMM_CONV_GATHER 1 or GEMM_CONV_ROWMAP 1 strided), 3 wgrad (CR, BN >= 128); 16-bit, 128 rows (wgrad 64 too); ping-pong for fprop and dgrad by TMA"
#endif

/* A dgrad phase (mirrored by smelt__conv9_kphase): its GEMM rows number
 * the (n, i, j) grid of oh x ow dx pixels it computes; its K walk visits
 * tr x ts taps, tap (i, j) the filter's (r0 + i rst, s0 + j sst), read at
 * im2col offset ((tr - 1 - i) oy, (ts - 1 - j) ox) from the first tap's
 * position (y0 + i, x0 + j) for grid pixel (i, j); dx's pixel (n, i, j)
 * at d + d_off + n ds_n + i ds_h + j ds_w elements (GEMM_CONV_ROWMAP). */
typedef struct conv9_phase {
  i64 d_off;
  int oh, ow, y0, x0, tr, ts, r0, s0, rst, sst, oy, ox;
} conv9_phase;

#define CONV9_PHASES 16 /* stride up to 4 on each axis */

/* The geometry (mirrored by smelt__conv9_kgeom in src/cuda/conv2d_sm90.c). */
typedef struct conv9_geom {
  u64 x;                /* the gather's tensor: dy */
  i64 xs_n, xs_h, xs_w; /* its strides in elements; its channels have unit stride */
  u64 d;                /* dgrad by phases: dx, and its pixel strides (in elements) between the */
  i64 ds_n, ds_h, ds_w; /* pixels of a phase's grid */
  int xh, xw, xc;       /* the im2col (or gathered) tensor's spatial extents and channels */
  int oh, ow;           /* the spatial extents that number the GEMM's rows (fprop P, Q; the gather's
                           H, W) or wgrad's K (P, Q) */
  int r, s;             /* the filter's taps per column and row */
  int pad_h, pad_w, st_h, st_w, dil_h, dil_w;
  int y0, x0;           /* fprop, wgrad: the first tap's position for the GEMM row (or K) pixel (0, 0) */
  int cb;               /* fprop, dgrad: 64-channel blocks a tap */
  conv9_phase ph[CONV9_PHASES]; /* dgrad by TMA: the phases, one a group of the grouped mode (a unit
                                   stride: one, the plain mode) */
} conv9_geom;

static_assert(sizeof(conv9_phase) == 56 && sizeof(conv9_geom) == 128 + CONV9_PHASES * 56,
              "conv9_geom must match smelt__conv9_kgeom");

#define GEMM_CONV_PARAM , const __grid_constant__ conv9_geom G

/* ---------------------------------------------------------------- TMA loads */

/* The im2col box at (c, w, h, n), the filter offset (ow, oh), into dst. */
static __device__ __forceinline__ void tma_load_im2col(u32 dst, const tmap_t *map, int c, int w, int h, int n, int ow,
                                                       int oh, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6], {%7, %8};" ::"r"(dst),
      "l"((u64)map), "r"(c), "r"(w), "r"(h), "r"(n), "r"(bar), "h"((unsigned short)ow), "h"((unsigned short)oh)
      : "memory");
}

/* The first tap's position (y, x) and image n of GEMM row (or K) pixel g. */
static __device__ __forceinline__ void conv9_pixel(const conv9_geom &G, i64 g, int *n, int *y, int *x) {
  const int hw = G.oh * G.ow, gg = (int)g, nn = gg / hw, rem = gg - nn * hw, oy = rem / G.ow;
  *n = nn;
  *y = G.y0 + oy * G.st_h;
  *x = G.x0 + (rem - oy * G.ow) * G.st_w;
}

/* One K step ks of tile w into the stage at sa, completing on bar (thread
 * 0; the caller expects STAGE_BYTES, or B_BYTES for the gather). */
static __device__ __forceinline__ void conv9_load(u32 sa, const conv9_geom &G, const sm90_tile &w, int ks, u32 bar) {
#if GEMM_CONV == 3
  /* A: dy's MN-major panels; B: one im2col box a 64-column panel. */
  load_a(sa, w, ks * BK, bar);
  int n, y, x;
  conv9_pixel(G, (i64)ks * BK, &n, &y, &x);
#pragma unroll
  for (int p = 0; p < BN / 64; p++) {
    const i64 col = (i64)w.tn * BN + 64 * p;
    /* A panel past N (R S C, a multiple of 64) reads channel C on: zeros. */
    const int real = col < w.n, cc = real ? (int)col : 0, tap = cc / G.xc, r = tap / G.s, s = tap - r * G.s;
    tma_load_im2col(sa + A_BYTES + p * PANEL_BYTES, w.mb, real ? cc - tap * G.xc : G.xc, x, y, n, s * G.dil_w,
                    r * G.dil_h, bar);
  }
#else
  const int tap = ks / G.cb, c0 = (ks - tap * G.cb) * 64;
#if GEMM_CONV == 1
  const int r = tap / G.s, s = tap - r * G.s;
  int n, y, x;
  conv9_pixel(G, w.row0, &n, &y, &x);
  tma_load_im2col(sa, w.ma, c0, x, y, n, s * G.dil_w, r * G.dil_h, bar);
  tma_load_3d(sa + A_BYTES, w.mb, c0, tap, w.tn * BN, bar);
#else
#if GEMM_CONV_GATHER
  const int ftap = tap; /* the gather walks every tap of the filter */
#else
  /* The phase's tap (i, j), whose dy pixel lies (tr - 1 - i) oy rows and
   * (ts - 1 - j) ox columns past the first tap's (the flipped filter's
   * im2col). */
  const conv9_phase &F = G.ph[w.grp];
  const int i = tap / F.ts, j = tap - i * F.ts, ftap = (F.r0 + i * F.rst) * G.s + F.s0 + j * F.sst;
  const int hw = F.oh * F.ow, g = (int)w.row0, n = g / hw, rem = g - n * hw, oy = rem / F.ow;
  tma_load_im2col(sa, w.ma, c0, F.x0 + rem - oy * F.ow, F.y0 + oy, n, (F.ts - 1 - j) * F.ox, (F.tr - 1 - i) * F.oy,
                  bar);
#endif
#pragma unroll
  for (int p = 0; p < BN / 64; p++)
    tma_load_3d(sa + A_BYTES + p * PANEL_BYTES, w.mb, w.tn * BN + 64 * p, c0, ftap, bar);
#endif
#endif
}

#if GEMM_CONV_ROWMAP
/* dgrad by phases (GEMM_CONV_ROWMAP): a stride-st dgrad is st_h st_w
 * unit-stride ones, phase (ph, pw) computing dx's pixels (i st_h + ph,
 * j st_w + pw) from the taps whose dy rows divide exactly, so no tap is a
 * zero; the phases are the groups of one grouped launch (each its own A
 * map), so their short K walks overlap each other's loads and epilogues.
 * The phase's GEMM rows number its (n, i, j) grid, which no TMA box
 * walks in dx: each piece goes out through the threads instead (after
 * piece_end's barrier, which makes the buffer whole and stores nothing),
 * a row's 16-byte units to the pixel the grid names. D's rows are whole
 * 16-byte units (the host's fast epilogue). */
static __device__ __forceinline__ void conv9_piece_out(const conv9_geom &G, int es, int tid, const sm90_tile &w,
                                                       i64 x, i64 y, u32 buf) {
  const conv9_phase &F = G.ph[w.grp];
  const int hw = F.oh * F.ow;
  const u64 d = G.d + (u64)(F.d_off * es);
#pragma unroll
  for (int e = tid; e < 64 * 8; e += 128) {
    const int r = e / 8, j = e % 8;
    const i64 col = x + j * (16 / es);
    if (y + r < w.m && col < w.n) {
      const int g = (int)(y + r), n = g / hw, rem = g - n * hw, i = rem / F.ow, jj = rem - i * F.ow;
      const uint4 v = lds128(buf + (u32)r * 128u + ((u32)(j ^ (r % 8)) << 4));
      *(uint4 *)(d + (u64)((n * G.ds_n + i * G.ds_h + jj * G.ds_w + col) * es)) = v;
    }
  }
}
#endif

#if GEMM_CONV_GATHER
/* ---------------------------------------------------------------- the strided dgrad's gather */

#define CONV_FULL_COUNT 5 /* one arrival a producer warp, one expect_tx */
#define CONV_LAG (GEMM_STAGES / 2)
#if CONV_LAG < 1 || CONV_LAG >= GEMM_STAGES
#error "GEMM_CONV_GATHER: the signal lag must lie in [1, GEMM_STAGES)"
#endif

/* A's rows for thread tid: rows tid/8 + 16 i (i < 8) of the tile, each at
 * 16-byte chunk tid % 8 of every K step. Per row: the image (-1: past M)
 * and h + pad, w + pad, from which tap r reaches dy's row (h + pad - r dil)
 * / stride. */
typedef struct conv9_rows {
  int n[8], y[8], x[8];
} conv9_rows;

static __device__ __forceinline__ void conv9_rows_init(const conv9_geom &G, i64 row0, i64 m, int tid, conv9_rows &w) {
  const int hw = G.oh * G.ow;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const i64 r = row0 + (tid >> 3) + 16 * i;
    const int mm = r < m ? (int)r : 0, n = mm / hw, rem = mm - n * hw, oy = rem / G.ow, ox = rem - oy * G.ow;
    w.n[i] = r < m ? n : -1;
    w.y[i] = oy + G.pad_h;
    w.x[i] = ox + G.pad_w;
  }
}

/* A's K step ks (tap ks / cb, channel block ks % cb) into the stage at sa. */
static __device__ __forceinline__ void conv9_gather_a(u32 sa, const conv9_geom &G, const conv9_rows &w, int ks,
                                                      int tid) {
  const int tap = ks / G.cb, r = tap / G.s, s = tap - r * G.s, c = (ks - tap * G.cb) * 64 + 8 * (tid & 7);
  const bool cok = c < G.xc;
  const int dy = r * G.dil_h, dx = s * G.dil_w;
  /* Row tid/8 + 16 i: its 128 bytes at 128 (tid/8 + 16 i), chunk j at j ^ (row % 8). */
  const u32 dst = sa + (u32)(tid >> 3) * 128u + ((u32)((tid & 7) ^ ((tid >> 3) & 7)) << 4);
  const char *x = (const char *)G.x;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const int yy = w.y[i] - dy, xx = w.x[i] - dx, y = yy / G.st_h, xq = xx / G.st_w;
    const bool ok = cok && w.n[i] >= 0 && yy >= 0 && xx >= 0 && y * G.st_h == yy && xq * G.st_w == xx && y < G.xh &&
                    xq < G.xw;
    const char *src = ok ? x + ((i64)w.n[i] * G.xs_n + (i64)y * G.xs_h + (i64)xq * G.xs_w + c) * 2 : x;
    cp_async16(dst + (u32)i * 16u * 128u, src, ok ? 16 : 0);
  }
}

/* This thread's copies of the stage at bar (complete: the caller waited
 * for their group) made visible to the async proxy, then one arrival for
 * the warp. */
static __device__ __forceinline__ void conv9_signal(u32 bar, int tid) {
  fence_proxy_async();
  __syncwarp();
  if ((tid & 31) == 0) mbar_arrive(bar);
}

/* The producer warpgroup (thread tid of 128) over the CTA's tiles: per K
 * step, thread 0 loads B by TMA, every thread gathers its chunks of A. */
static __device__ __forceinline__ void conv9_produce(const gemm_params &P, const conv9_geom &G, const tmap_t *tma_a,
                                                     const tmap_t *tma_b, const tmap_t *tma_d, u32 base, u32 full,
                                                     u32 empty, int unit0, int units_step, int tiles, int tid) {
  int stage = 0, oldest = 0, pending = 0; /* oldest: the first stage not yet signalled */
  u32 phase = 0;
  sm90_cursor g = {0};
  for (int t = unit0; t < tiles; t += units_step) {
    sm90_tile w;
    if (!sm90_locate(P, tma_a, tma_b, tma_d, NULL, t, &g, 0, &w)) break;
    conv9_rows rows;
    conv9_rows_init(G, w.row0, w.m, tid, rows);
    for (int kt = 0; kt < w.ktiles; kt++) {
      mbar_wait(empty + 8 * stage, phase ^ 1);
      const u32 bar = full + 8 * stage, sa = base + stage * STAGE_BYTES;
      if (tid == 0) {
        mbar_expect_tx(bar, B_BYTES);
        conv9_load(sa, G, w, w.kt0 + kt, bar);
      }
      conv9_gather_a(sa, G, rows, w.kt0 + kt, tid);
      cp_async_commit();
      if (++pending > CONV_LAG) {
        CP_ASYNC_WAIT(CONV_LAG);
        conv9_signal(full + 8 * oldest, tid);
        oldest = oldest + 1 == GEMM_STAGES ? 0 : oldest + 1;
        pending--;
      }
      if (++stage == GEMM_STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
  CP_ASYNC_WAIT(0);
  for (; pending > 0; pending--) {
    conv9_signal(full + 8 * oldest, tid);
    oldest = oldest + 1 == GEMM_STAGES ? 0 : oldest + 1;
  }
}
#endif

#endif /* SMELT_CONV2D_SM90_CUH */
