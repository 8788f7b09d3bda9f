/* Conv2d as implicit GEMM on the Hopper kernel: gemm_sm90.cu includes this
 * file when GEMM_CONV is set (1 fprop, 2 dgrad, 3 wgrad; 16-bit operands,
 * the cooperative 128-row tile, no clusters). The operand that is a gather
 * of an NHWC tensor cannot come by a tiled TMA box, so the producer is the
 * whole first warpgroup: each of its 128 threads copies eight 16-byte
 * chunks a stage with cp.async, straight into the 128-byte swizzled layout
 * the wgmma descriptors read (the layout TMA would have written), and the
 * other operand still comes by TMA from thread 0. Everything else (the
 * ring, the consumers, the epilogues, the parallel split) is the GEMM's.
 *
 * The GEMMs (smelt/conv2d.h's table), with K in taps of 64-channel blocks
 * for fprop and dgrad: K' = R S cb 64 where cb = ceil(channels / 64), so a
 * K step is one tap (r, s) and one block of 64 channels, and the channels
 * past the tensor's (cb 64 > channels) are zeros on both sides:
 *   GEMM_CONV 1, fprop: M = NPQ, N = K, K'. A gathered from x (K-major);
 *     B = w [K, R, S, C] through a 3-D map (C, RS, K) whose box {64, 1, BN}
 *     lands as BN K-major rows.
 *   GEMM_CONV 2, dgrad: M = NHW, N = C, K' over (r, s, k). A gathered from
 *     dy (a tap reaches dy's pixel (h + pad - r dil) / stride when that
 *     divides; others are zeros); B = w through a 3-D map (C, K, RS) whose
 *     boxes {64, 64, 1} land as the MN-major panels of 64 columns of C.
 *   GEMM_CONV 3, wgrad: M = K, N = R S C (C a multiple of 64: a panel of 64
 *     columns is one tap), K = NPQ. A = dy as [K, NPQ] MN-major by TMA; B
 *     gathered from x, MN-major.
 * The host guarantees: 16-bit operands; the gathered tensor's channels a
 * multiple of 8 with unit stride and its other strides 16-byte multiples
 * (a 16-byte chunk never crosses a tap or the channels' end); every index
 * below fits an int.
 *
 * cp.async writes shared memory through the generic proxy and wgmma reads
 * it through the async one, so the bytes must pass a proxy fence between
 * the two, and the writing thread's fence is the one that orders them. So
 * a producer thread commits each stage's copies as a group and signals a
 * stage CONV_LAG stages later: it waits for that stage's group
 * (cp.async.wait_group), fences, and its warp arrives on the stage's full
 * barrier once (5 arrivals a phase with thread 0's expect_tx); after its
 * last tile it signals the stages still pending. Any lag below the
 * ring's depth is free of deadlock (the stage a producer waits to refill
 * was signalled CONV_LAG steps before); half the ring leaves the copies a
 * few steps to land before the producer waits on them. */
#ifndef SMELT_CONV2D_SM90_CUH
#define SMELT_CONV2D_SM90_CUH

#if GEMM_CONV < 1 || GEMM_CONV > 3 || AB_SIZE != 2 || BM != 128 || PINGPONG || CLUSTER > 1 || PROMOTE ||             \
    BLOCK_SCALE || (GEMM_CONV == 3 && BN != 128) || A_MN != (GEMM_CONV == 3) || B_MN != (GEMM_CONV >= 2)
#error "GEMM_CONV: 1 fprop (RC), 2 dgrad (RR), 3 wgrad (CR, BN 128); 16-bit, 128-row cooperative tiles"
#endif

/* The geometry (mirrored by smelt__conv9_kgeom in src/cuda/conv2d_sm90.c). */
typedef struct conv9_geom {
  u64 x;                /* the gathered tensor: x (fprop, wgrad) or dy (dgrad) */
  i64 xs_n, xs_h, xs_w; /* its strides in elements; its channels have unit stride */
  int xh, xw, xc;       /* its spatial extents and channels */
  int oh, ow;           /* the spatial extents that number the GEMM's rows (fprop P, Q; dgrad H, W) or
                           wgrad's K (P, Q) */
  int s;                /* taps per filter row */
  int pad_h, pad_w, st_h, st_w, dil_h, dil_w;
  int cb;               /* fprop, dgrad: 64-channel blocks a tap */
  int pad;
} conv9_geom;

static_assert(sizeof(conv9_geom) == 88, "conv9_geom must match smelt__conv9_kgeom");

#define GEMM_CONV_PARAM , const conv9_geom G
/* Full-barrier arrivals a phase: one a producer warp, one expect_tx. */
#define CONV_FULL_COUNT 5
#define CONV_LAG (GEMM_STAGES / 2)
#if CONV_LAG < 1 || CONV_LAG >= GEMM_STAGES
#error "GEMM_CONV: the signal lag must lie in [1, GEMM_STAGES)"
#endif

/* This thread's copies of the stage at bar (complete: the caller waited
 * for their group) made visible to the async proxy, then one arrival for
 * the warp. */
static __device__ __forceinline__ void conv9_signal(u32 bar, int tid) {
  fence_proxy_async();
  __syncwarp();
  if ((tid & 31) == 0) mbar_arrive(bar);
}

#if GEMM_CONV != 3
/* A's rows for thread tid: rows tid/8 + 16 i (i < 8) of the tile, each at
 * 16-byte chunk tid % 8 of every K step. Per row: the image (-1: past M)
 * and the window origin (fprop: p stride - pad, the top-left tap's pixel;
 * dgrad: h + pad, from which tap r reaches dy's row (h + pad - r dil) /
 * stride). */
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
#if GEMM_CONV == 1
    w.y[i] = oy * G.st_h - G.pad_h;
    w.x[i] = ox * G.st_w - G.pad_w;
#else
    w.y[i] = oy + G.pad_h;
    w.x[i] = ox + G.pad_w;
#endif
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
#if GEMM_CONV == 1
    const int y = w.y[i] + dy, xx = w.x[i] + dx;
    const bool ok = cok && w.n[i] >= 0 && (unsigned)y < (unsigned)G.xh && (unsigned)xx < (unsigned)G.xw;
#else
    int y = w.y[i] - dy, xx = w.x[i] - dx;
    bool ok = cok && w.n[i] >= 0 && y >= 0 && xx >= 0;
    if (G.st_h > 1) {
      const int q = y / G.st_h;
      ok = ok && q * G.st_h == y;
      y = q;
    }
    if (G.st_w > 1) {
      const int q = xx / G.st_w;
      ok = ok && q * G.st_w == xx;
      xx = q;
    }
    ok = ok && y < G.xh && xx < G.xw;
#endif
    const char *src = ok ? x + ((i64)w.n[i] * G.xs_n + (i64)y * G.xs_h + (i64)xx * G.xs_w + c) * 2 : x;
    cp_async16(dst + (u32)i * 16u * 128u, src, ok ? 16 : 0);
  }
}
#else
/* B's columns for thread tid (wgrad): 16-byte chunk tid % 8 of panel
 * (tid / 8) % 2, rows tid/16 + 8 i (i < 8) of every K step. The column's
 * tap and channel are fixed for the tile. */
typedef struct conv9_cols {
  int c, ry, rx; /* the channel, r dil - pad, s dil - pad */
  bool ok;       /* the column is real */
} conv9_cols;

static __device__ __forceinline__ void conv9_cols_init(const conv9_geom &G, i64 n0, i64 n, int tid, conv9_cols &w) {
  const i64 col = n0 + 64 * ((tid >> 3) & 1) + 8 * (tid & 7);
  w.ok = col < n;
  const int cc = w.ok ? (int)col : 0, tap = cc / G.xc, r = tap / G.s, s = tap - r * G.s;
  w.c = cc - tap * G.xc;
  w.ry = r * G.dil_h - G.pad_h;
  w.rx = s * G.dil_w - G.pad_w;
}

/* B's K step ks (pixels 64 ks .. 64 ks + 63 of NPQ, k of them real). */
static __device__ __forceinline__ void conv9_gather_b(u32 sb, const conv9_geom &G, const conv9_cols &w, int ks,
                                                      i64 k, int tid) {
  const int g0 = ks * 64 + (tid >> 4), pq = G.oh * G.ow;
  int n = g0 / pq, rem = g0 - n * pq, oy = rem / G.ow, ox = rem - oy * G.ow;
  const u32 dst = sb + (u32)((tid >> 3) & 1) * PANEL_BYTES + (u32)(tid >> 4) * 128u +
                  ((u32)((tid & 7) ^ ((tid >> 4) & 7)) << 4);
  const char *x = (const char *)G.x;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const int y = oy * G.st_h + w.ry, xx = ox * G.st_w + w.rx;
    const bool ok = w.ok && g0 + 8 * i < k && (unsigned)y < (unsigned)G.xh && (unsigned)xx < (unsigned)G.xw;
    const char *src = ok ? x + ((i64)n * G.xs_n + (i64)y * G.xs_h + (i64)xx * G.xs_w + w.c) * 2 : x;
    cp_async16(dst + (u32)i * 8u * 128u, src, ok ? 16 : 0);
    /* The next row is 8 pixels on. */
    ox += 8;
    while (ox >= G.ow) {
      ox -= G.ow;
      if (++oy == G.oh) {
        oy = 0;
        n++;
      }
    }
  }
}
#endif

/* The producer warpgroup (thread tid of 128) over the CTA's tiles: per K
 * step, thread 0 starts the TMA operand, every thread gathers its chunks,
 * and the stage's full barrier waits for all of them. */
static __device__ __forceinline__ void conv9_produce(const gemm_params &P, const conv9_geom &G, const tmap_t *tma_a,
                                                     const tmap_t *tma_b, const tmap_t *tma_d, u32 base, u32 full,
                                                     u32 empty, int unit0, int units_step, int tiles, int tid) {
  int stage = 0, oldest = 0, pending = 0; /* oldest: the first stage not yet signalled */
  u32 phase = 0;
  sm90_cursor g = {0};
  for (int t = unit0; t < tiles; t += units_step) {
    sm90_tile w;
    if (!sm90_locate(P, tma_a, tma_b, tma_d, NULL, t, &g, 0, &w)) break;
#if GEMM_CONV != 3
    conv9_rows rows;
    conv9_rows_init(G, w.row0, w.m, tid, rows);
#else
    conv9_cols cols;
    conv9_cols_init(G, (i64)w.tn * BN, w.n, tid, cols);
#endif
    for (int kt = 0; kt < w.ktiles; kt++) {
      mbar_wait(empty + 8 * stage, phase ^ 1);
      const u32 bar = full + 8 * stage, sa = base + stage * STAGE_BYTES;
      const int ks = w.kt0 + kt;
      if (tid == 0) {
#if GEMM_CONV == 3
        mbar_expect_tx(bar, A_BYTES);
        load_a(sa, w, ks * BK, bar);
#else
        mbar_expect_tx(bar, B_BYTES);
        const int tap = ks / G.cb, c0 = (ks - tap * G.cb) * 64;
#if GEMM_CONV == 1
        tma_load_3d(sa + A_BYTES, w.mb, c0, tap, w.tn * BN, bar);
#else
#pragma unroll
        for (int p = 0; p < BN / 64; p++) tma_load_3d(sa + A_BYTES + p * PANEL_BYTES, w.mb, w.tn * BN + 64 * p, c0, tap, bar);
#endif
#endif
      }
#if GEMM_CONV == 3
      conv9_gather_b(sa + A_BYTES, G, cols, ks, P.p.k, tid);
#else
      conv9_gather_a(sa, G, rows, ks, tid);
#endif
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

#endif /* SMELT_CONV2D_SM90_CUH */
