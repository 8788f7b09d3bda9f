/* PEER experts: y[t] = Σ_{uses u of token t} g_u · act(x[t] · U_e) · V_e
 * (peer_expert_fwd) and the per-token part of the backward
 * (peer_expert_bwd): per use a = g act(z), dz, d gate, and dx[t].
 *
 * One CTA (256 threads) per token; its h·k uses are staged in rounds of
 * `chunk` (shared memory holds their gates, pointers and hidden values):
 *   down  a warp per use streams U_e (d_in·h_e contiguous elements) in
 *         16-byte loads (SMELT_VEC elements; 1 = scalar loads for rows that
 *         are not 16-byte aligned), the token's x in shared memory; lane l
 *         accumulates flat positions l·VEC + e (mod 32·VEC), which all
 *         belong to hidden unit (l·VEC + e) mod h_e when h_e divides
 *         32·VEC, so a butterfly over the lanes finishes each z_j;
 *   up    threads own VEC-column chunks of y and stream V_e rows; when
 *         d_out/VEC leaves threads idle, `groups_out` groups split the uses
 *         and their partial rows are added in a fixed order at the end.
 * Every expert row is read once per use with many loads in flight (8 warps
 * x 4 unrolled loads in the down phase, a whole CTA in the up phase).
 * These "round" kernels take any shape; the warp-streamed kernels at the
 * end (h_e <= VEC, rows a lane can keep in registers) stream the rows
 * with cp.async and no CTA barrier per use, and are the faster ones
 * (docs/PERF.md, PEER: expert kernel).
 * A third variant, CTA-wide cp.async stages between barriers, measured
 * slower than the round kernels (per-stage barrier latency) and was removed.
 *
 * Expert rows come from the store's HBM slot when the table says the
 * expert is cached, else from the full table (a dense tensor, or the
 * store's host tables through the mapping). Both hold the same bytes and
 * the arithmetic does not depend on where they came from, so cached and
 * uncached runs are bit-identical.
 *
 * Prelude: SMELT_WDT (expert weights dtype), SMELT_VEC (8 for 16-bit
 * weights, 4 for f32, or 1). */
#include "peer_common.cuh"
#include "smelt_mma.cuh"

#if !defined(SMELT_WDT) || !defined(SMELT_VEC)
#error "peer_expert.cu needs SMELT_WDT and SMELT_VEC"
#endif

#if SMELT_WDT == SMELT_DT_F32
typedef float welem;
static __device__ __forceinline__ float wcvt(welem v) { return v; }
#elif SMELT_WDT == SMELT_DT_F16
typedef smelt_h16 welem;
static __device__ __forceinline__ float wcvt(welem v) { return smelt_f16_to_f32(v); }
#elif SMELT_WDT == SMELT_DT_BF16
typedef smelt_h16 welem;
static __device__ __forceinline__ float wcvt(welem v) { return smelt_bf16_to_f32(v); }
#else
#error "SMELT_WDT must be 1 (f32), 2 (f16) or 3 (bf16)"
#endif

#define VEC SMELT_VEC
#if SMELT_WDT == SMELT_DT_F16
#define PEER_MMA mma_16816_f16
#elif SMELT_WDT == SMELT_DT_BF16
#define PEER_MMA mma_16816_bf16
#endif
#define NT 256
#define NWARPS (NT / 32)
/* The host sizes shared memory from the prelude's layout constants
 * (src/cuda/peer_cuda.h); the layouts below must match them. */
static_assert(NWARPS == SMELT_PEER_WS_WARPS, "the warp kernels' rings must be the host's SMELT_PEER_WS_WARPS");
static_assert(2 * sizeof(const welem *) == SMELT_PEER_SMEM_USE_PTRS,
              "a use's U and V row pointers must take the host's SMELT_PEER_SMEM_USE_PTRS bytes");
#define UP_BATCH 4 /* uses whose V rows one thread loads together */

#if VEC > 1
static_assert(VEC * sizeof(welem) == 16, "SMELT_VEC must make 16-byte loads");
#endif

#if VEC > 1
/* 16 bytes of weights (VEC of them) as f32. */
static __device__ __forceinline__ void raw_vec(uint4 raw, float *w) {
  const u32 r[4] = {raw.x, raw.y, raw.z, raw.w};
#if SMELT_WDT == SMELT_DT_F32
#pragma unroll
  for (int i = 0; i < 4; i++) w[i] = __uint_as_float(r[i]);
#else
#pragma unroll
  for (int i = 0; i < 4; i++) {
    w[2 * i] = wcvt((smelt_h16)(r[i] & 0xffffu));
    w[2 * i + 1] = wcvt((smelt_h16)(r[i] >> 16));
  }
#endif
}
#endif

/* VEC consecutive weights as f32. */
static __device__ __forceinline__ void load_vec(const welem *p, float *w) {
#if VEC == 1
  w[0] = wcvt(*p);
#else
  raw_vec(*(const uint4 *)p, w);
#endif
}

/* Where expert e's rows are: its cache slot, or the full tables. */
static __device__ __forceinline__ void expert_rows(const peer_expert_params &P, i64 e, const welem **u,
                                                   const welem **v) {
  const int slot = P.table ? ((const int *)P.table)[e] : -1;
  if (slot >= 0) {
    *u = (const welem *)P.u_cache + (i64)slot * P.din * P.he;
    *v = (const welem *)P.v_cache + (i64)slot * P.he * P.dout;
  } else {
    *u = (const welem *)P.u_host + e * P.din * P.he;
    *v = (const welem *)P.v_host + e * P.he * P.dout;
  }
}

/* Round j's uses: gates and row pointers into shared memory (NULL for an
 * id outside [0, N): such a use contributes nothing). */
static __device__ void stage_uses(const peer_expert_params &P, i64 t, i64 u0, i64 nu, float *gs, const welem **up,
                                  const welem **vp) {
  for (i64 j = threadIdx.x; j < nu; j += NT) {
    const i64 use = t * P.hk + u0 + j, e = ((const i64 *)P.ids)[use];
    if (e >= 0 && e < P.N) {
      expert_rows(P, e, &up[j], &vp[j]);
      gs[j] = ((const float *)P.gates)[use];
    } else {
      up[j] = vp[j] = 0;
      gs[j] = 0.f;
    }
  }
}

/* z[e] (every lane) = the sum over the warp of the lanes' acc entries of
 * hidden unit e < h_e: flat position f VEC + e is hidden unit e mod h_e
 * (h_e divides VEC); 0 for e >= h_e. */
static __device__ __forceinline__ void hidden_sums(float *acc, i64 he, float *z) {
#pragma unroll
  for (int s = VEC / 2; s >= 1; s >>= 1)
    if (s >= he) {
#pragma unroll
      for (int e = 0; e < s; e++) acc[e] += acc[e + s];
    }
#pragma unroll
  for (int e = 0; e < VEC; e++) z[e] = e < he ? smelt_warp_sum(acc[e]) : 0.f;
}

/* z = x · U_e for one use (a warp): writes z_j, or f(z_j) when `fn` says
 * so, to out[0..he). xs: the token's x (f32, shared). */
static __device__ __forceinline__ void down(const peer_expert_params &P, const welem *ue, const float *xs, float *out,
                                            float gate, int apply_act, int lane) {
  const i64 he = P.he, nvec = P.din * he / VEC;
  const int sh = P.he_shift;
  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; e++) acc[e] = 0.f;
#pragma unroll 4
  for (i64 f = lane; f < nvec; f += 32) {
    float w[VEC];
    load_vec(ue + f * VEC, w);
    const i64 base = f * VEC;
    if (he >= VEC) {
      const float xv = xs[base >> sh];
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[e] = fmaf(xv, w[e], acc[e]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[e] = fmaf(xs[(base + e) >> sh], w[e], acc[e]);
    }
  }
  if (he <= VEC) {
    float z[VEC];
    hidden_sums(acc, he, z);
#pragma unroll
    for (int e = 0; e < VEC; e++)
      if (e < he && lane == 0) out[e] = apply_act ? gate * peer_act(P.act, z[e]) : z[e];
  } else {
    /* lanes l and l + m·(he/VEC) hold the same units */
    for (int o = 16; o >= (int)(he / VEC); o >>= 1)
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[e] += __shfl_xor_sync(PEER_FULL, acc[e], o);
    if (lane < he / VEC)
#pragma unroll
      for (int e = 0; e < VEC; e++) out[lane * VEC + e] = apply_act ? gate * peer_act(P.act, acc[e]) : acc[e];
  }
}

static __device__ __forceinline__ i64 round4(i64 n) { return (n + 3) & ~(i64)3; }

/* ---------------------------------------------------------------- forward */

/* One round of nu uses (pointers and gates from index 0 of up, vp, gs):
 * as[j] = g act(x · U_e) per use (a warp each), then the up phase adds
 * Σ_j as[j] V_e into the groups' partial rows ys. The caller synchronizes
 * before (rows, x and the staged uses ready; the last round's readers of
 * as done). */
static __device__ void fwd_round(const peer_expert_params &P, i64 nu, const welem *const *up, const welem *const *vp,
                                 const float *gs, const float *xs, float *as, float *ys) {
  const i64 he = P.he, dout = P.dout;
  const int G = P.groups_out, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = NT / G; /* threads per group */
  const int grp = tid / per, lt = tid - grp * per;
  const i64 nch = dout / VEC;
  for (i64 j = warp; j < nu; j += NWARPS) {
    if (up[j]) down(P, up[j], xs, as + j * he, gs[j], 1, lane);
  }
  __syncthreads();
  float *yg = ys + grp * round4(dout);
  for (i64 cc = lt; cc < nch; cc += per) {
    float acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; e++) acc[e] = yg[cc * VEC + e];
    /* UP_BATCH uses at a time: their loads are issued before the FMAs */
    for (i64 j0 = grp; j0 < nu; j0 += UP_BATCH * G) {
      const welem *vb[UP_BATCH];
#pragma unroll
      for (int b = 0; b < UP_BATCH; b++) vb[b] = j0 + b * G < nu ? vp[j0 + b * G] : 0;
      for (i64 jj = 0; jj < he; jj++) {
        float w[UP_BATCH][VEC];
#pragma unroll
        for (int b = 0; b < UP_BATCH; b++) {
          if (vb[b]) load_vec(vb[b] + jj * dout + cc * VEC, w[b]);
        }
#pragma unroll
        for (int b = 0; b < UP_BATCH; b++) {
          if (!vb[b]) continue;
          const float a = as[(j0 + b * G) * he + jj];
#pragma unroll
          for (int e = 0; e < VEC; e++) acc[e] = fmaf(a, w[b][e], acc[e]);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < VEC; e++) yg[cc * VEC + e] = acc[e];
  }
}

/* y[t] = the groups' rows summed in group order. */
static __device__ void fwd_store(const peer_expert_params &P, i64 t, const float *ys) {
  __syncthreads();
  for (i64 c = threadIdx.x; c < P.dout; c += NT) {
    float s = 0.f;
    for (int g = 0; g < P.groups_out; g++) s += ys[g * round4(P.dout) + c];
    peer_st(P.y, t * P.y_rs + c, P.y_dt, s);
  }
}

extern "C" __global__ void __launch_bounds__(NT, 2) peer_expert_fwd(peer_expert_params P) {
  extern __shared__ __align__(16) float smem[];
  const i64 t = blockIdx.x, chunk = P.chunk, he = P.he, dout = P.dout;
  float *xs = smem;                          /* [din] */
  float *ys = xs + round4(P.din);            /* [G][dout] */
  float *as = ys + P.groups_out * round4(dout); /* [chunk][he]: g act(z) */
  float *gs = as + round4(chunk * he);       /* [chunk] */
  const welem **up = (const welem **)(gs + round4(chunk)); /* [chunk]; every region is a multiple of 16 bytes */
  const welem **vp = up + chunk;
  const int tid = threadIdx.x;
  for (i64 i = tid; i < P.din; i += NT) xs[i] = peer_ld(P.x, t * P.x_rs + i, P.x_dt);
  for (i64 i = tid; i < P.groups_out * round4(dout); i += NT) ys[i] = 0.f;
  for (i64 u0 = 0; u0 < P.hk; u0 += chunk) {
    const i64 nu = P.hk - u0 < chunk ? P.hk - u0 : chunk;
    __syncthreads(); /* x is staged; the last round's readers of as, gs, up, vp are done */
    stage_uses(P, t, u0, nu, gs, up, vp);
    __syncthreads();
    fwd_round(P, nu, up, vp, gs, xs, as, ys);
  }
  fwd_store(P, t, ys);
}


/* ---------------------------------------------------------------- backward */

/* dx[i0 .. i0+VEC) += Σ_j dz_j U_e[i, j] for one use, h_e < VEC: each load
 * covers VEC / h_e rows. HE is a literal at every call, so the indices are
 * static after inlining. */
static __device__ __forceinline__ void dx_small(const welem *ue, i64 i0, const float *dz, float *acc, int HE) {
#pragma unroll
  for (int m = 0; m < HE; m++) {
    float w[VEC];
    load_vec(ue + i0 * HE + m * VEC, w);
#pragma unroll
    for (int e = 0; e < VEC; e++) acc[(m * VEC + e) / HE] = fmaf(dz[(m * VEC + e) % HE], w[e], acc[(m * VEC + e) / HE]);
  }
}

/* The same for h_e >= VEC: row i0 + ii is h_e / VEC loads. */
static __device__ __forceinline__ void dx_wide(const welem *ue, i64 i0, const float *dz, float *acc, i64 he) {
#pragma unroll
  for (int ii = 0; ii < VEC; ii++) {
    const welem *row = ue + (i0 + ii) * he;
    float s = 0.f;
    for (i64 m = 0; m < he; m += VEC) {
      float w[VEC];
      load_vec(row + m, w);
#pragma unroll
      for (int e = 0; e < VEC; e++) s = fmaf(dz[m + e], w[e], s);
    }
    acc[ii] += s;
  }
}

/* One round of the backward's nu uses (index 0 = use u0 of token t):
 * per use (a warp) z (recomputed), da = dy · V_e[j], and
 *   ua = g act(z), udz = da g act'(z), dg = Σ_j da act(z)
 * to global memory (the expert-gradient and routing kernels read them);
 * then, when P.dx is set, the groups' partial rows dxs += Σ_j udz_j U_e[:, j].
 * The caller synchronizes before, as for fwd_round. */
static __device__ void bwd_round(const peer_expert_params &P, i64 t, i64 u0, i64 nu, const welem *const *up,
                                 const welem *const *vp, const float *gs, const float *xs, const float *dys, float *zs,
                                 float *dzs, float *dxs) {
  const i64 he = P.he, din = P.din, dout = P.dout;
  const int G = P.groups_in, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = NT / G;
  const int grp = tid / per, lt = tid - grp * per;
  const i64 nin = din / VEC, nvo = dout / VEC;
  for (i64 j = warp; j < nu; j += NWARPS) {
    const i64 use = t * P.hk + u0 + j;
    const welem *ue = up[j];
    if (!ue) {
      for (i64 jj = lane; jj < he; jj += 32) {
        dzs[j * he + jj] = 0.f;
        ((float *)P.ua)[use * he + jj] = 0.f;
        ((float *)P.udz)[use * he + jj] = 0.f;
      }
      if (lane == 0) ((float *)P.dg)[use] = 0.f;
      continue;
    }
    down(P, ue, xs, zs + j * he, 0.f, 0, lane);
    __syncwarp();
    const welem *ve = vp[j];
    const float g = gs[j];
    float dg = 0.f;
    for (i64 jj = 0; jj < he; jj++) {
      const welem *vr = ve + jj * dout;
      float s = 0.f;
#pragma unroll 4
      for (i64 f = lane; f < nvo; f += 32) {
        float w[VEC];
        load_vec(vr + f * VEC, w);
#pragma unroll
        for (int e = 0; e < VEC; e++) s = fmaf(dys[f * VEC + e], w[e], s);
      }
      const float da = smelt_warp_sum(s), z = zs[j * he + jj], av = peer_act(P.act, z);
      const float dz = da * g * peer_act_grad(P.act, z);
      dg = fmaf(da, av, dg);
      if (lane == 0) {
        dzs[j * he + jj] = dz;
        ((float *)P.ua)[use * he + jj] = g * av;
        ((float *)P.udz)[use * he + jj] = dz;
      }
    }
    if (lane == 0) ((float *)P.dg)[use] = dg;
  }
  if (!P.dx) return;
  __syncthreads();
  float *dxg = dxs + grp * round4(din);
  for (i64 ic = lt; ic < nin; ic += per) {
    float acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; e++) acc[e] = dxg[ic * VEC + e];
    for (i64 j = grp; j < nu; j += G) {
      const welem *ue = up[j];
      if (!ue) continue;
      const float *dz = dzs + j * he;
      if (he >= VEC) dx_wide(ue, ic * VEC, dz, acc, he);
#if VEC >= 2
      else if (he == 1) dx_small(ue, ic * VEC, dz, acc, 1);
#endif
#if VEC >= 4
      else if (he == 2) dx_small(ue, ic * VEC, dz, acc, 2);
#endif
#if VEC >= 8
      else if (he == 4) dx_small(ue, ic * VEC, dz, acc, 4);
#endif
    }
#pragma unroll
    for (int e = 0; e < VEC; e++) dxg[ic * VEC + e] = acc[e];
  }
}

/* dx[t] = the groups' rows summed in group order (f32). */
static __device__ void bwd_store(const peer_expert_params &P, i64 t, const float *dxs) {
  if (!P.dx) return;
  __syncthreads();
  for (i64 i = threadIdx.x; i < P.din; i += NT) {
    float s = 0.f;
    for (int g = 0; g < P.groups_in; g++) s += dxs[g * round4(P.din) + i];
    ((float *)P.dx)[t * P.din + i] = s;
  }
}

/* Loads the token's x and dy into shared memory and zeroes the dx rows. */
static __device__ void bwd_prologue(const peer_expert_params &P, i64 t, float *xs, float *dys, float *dxs) {
  for (i64 i = threadIdx.x; i < P.din; i += NT) xs[i] = peer_ld(P.x, t * P.x_rs + i, P.x_dt);
  for (i64 i = threadIdx.x; i < P.dout; i += NT) dys[i] = peer_ld(P.dy, t * P.dy_rs + i, P.dy_dt);
  for (i64 i = threadIdx.x; i < P.groups_in * round4(P.din); i += NT) dxs[i] = 0.f;
}

extern "C" __global__ void __launch_bounds__(NT, 2) peer_expert_bwd(peer_expert_params P) {
  extern __shared__ __align__(16) float smem[];
  const i64 t = blockIdx.x, chunk = P.chunk, he = P.he, din = P.din;
  float *xs = smem;                          /* [din] */
  float *dys = xs + round4(din);             /* [dout] */
  float *dxs = dys + round4(P.dout);         /* [G][din] */
  float *zs = dxs + P.groups_in * round4(din); /* [chunk][he] */
  float *dzs = zs + round4(chunk * he);      /* [chunk][he] */
  float *gs = dzs + round4(chunk * he);      /* [chunk] */
  const welem **up = (const welem **)(gs + round4(chunk));
  const welem **vp = up + chunk;
  bwd_prologue(P, t, xs, dys, dxs);
  for (i64 u0 = 0; u0 < P.hk; u0 += chunk) {
    const i64 nu = P.hk - u0 < chunk ? P.hk - u0 : chunk;
    __syncthreads();
    stage_uses(P, t, u0, nu, gs, up, vp);
    __syncthreads();
    bwd_round(P, t, u0, nu, up, vp, gs, xs, dys, zs, dzs, dxs);
  }
  bwd_store(P, t, dxs);
}


#if VEC > 1
/* ---------------------------------------------------------------- warp-streamed variants */

/* The warp-streamed kernels (peer_expert_fwd_warp, peer_expert_bwd_warp):
 * each warp takes the token's uses warp, warp + 8, ... and streams their
 * rows (U then V, one use a slot) through a ring of P.stage_uses slots of
 * its own with cp.async, the next slots' copies in flight while it
 * computes one; a use is computed by its warp alone, with the running y
 * (or dx) columns in registers (lane l: 16-byte chunks l + 32 m, m < WS_CH),
 * so no CTA barrier separates one use from the next. The warps' rows are
 * added in warp order at the end. Same products as the round kernels;
 * other summation orders (the results differ by rounding, and repeat bit
 * for bit). For h_e <= VEC and rows of at most 32·WS_CH chunks. The
 * bytes in flight are the slots: 2 a warp, 16 warps an SM, 128 KiB for
 * the issue's 4 KiB uses. */
#define WS_CH 4
static_assert(WS_CH == SMELT_PEER_WS_CH, "a lane's chunks must be the host's SMELT_PEER_WS_CH");

/* y[m] += Σ_{j < h_e} z_j V_e[j] over the lane's 16-byte chunks lane + 32 m
 * of the d_out columns (v: the use's V rows [h_e][d_out]). */
static __device__ __forceinline__ void up_rows(const welem *v, const float *z, float (*y)[VEC], i64 he, i64 dout,
                                               int lane) {
  const i64 nco = dout / VEC;
#pragma unroll
  for (int m = 0; m < WS_CH; m++) {
    const i64 cc = lane + 32 * m;
    if (cc >= nco) break;
#pragma unroll
    for (int jj = 0; jj < VEC; jj++) {
      if (jj >= he) break;
      float w[VEC];
      load_vec(v + jj * dout + cc * VEC, w);
#pragma unroll
      for (int e = 0; e < VEC; e++) y[m][e] = fmaf(z[jj], w[e], y[m][e]);
    }
  }
}

/* A use's rows (U part du elements, then the V part, row elements in all)
 * into shared memory at dst by the warp's cp.async, 16 bytes a copy. */
static __device__ __forceinline__ void copy_rows_async(u32 dst, const welem *u, const welem *v, i64 du, i64 row,
                                                       int lane) {
  for (i64 r = lane; r < row / VEC; r += 32) {
    const welem *src = r * VEC < du ? u + r * VEC : v + (r * VEC - du);
    cp_async16(dst + (u32)(r * 16), src, 16);
  }
}

/* z[e] = x · U[:, e] for e < h_e <= VEC, in every lane. */
static __device__ __forceinline__ void down_all(const peer_expert_params &P, const welem *ue, const float *xs,
                                                float *z, int lane) {
  const i64 he = P.he, nvec = P.din * he / VEC;
  const int sh = P.he_shift;
  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; e++) acc[e] = 0.f;
#pragma unroll 4
  for (i64 f = lane; f < nvec; f += 32) {
    float w[VEC];
    load_vec(ue + f * VEC, w);
    const i64 base = f * VEC;
#pragma unroll
    for (int e = 0; e < VEC; e++) acc[e] = fmaf(xs[(base + e) >> sh], w[e], acc[e]);
  }
  hidden_sums(acc, he, z);
}

/* Copies use n of this warp (use warp + NWARPS n) into its slot n mod S,
 * then a commit (empty past the warp's last use). */
static __device__ __forceinline__ void ws_issue(const peer_expert_params &P, int n, int nw, const welem *const *up,
                                                const welem *const *vp, welem *ring, i64 row, i64 du, int warp,
                                                int lane) {
  if (n < nw) {
    const i64 j = warp + NWARPS * n;
    const welem *u = up[j], *v = vp[j];
    if (u) copy_rows_async(smem_u32(ring + (i64)(n % P.stage_uses) * row), u, v, du, row, lane);
  }
  cp_async_commit();
}

static __device__ __forceinline__ void ws_wait(int slots) {
  if (slots >= 3) CP_ASYNC_WAIT(1);
  else CP_ASYNC_WAIT(0);
  __syncwarp();
}

extern "C" __global__ void __launch_bounds__(NT, 2) peer_expert_fwd_warp(peer_expert_params P) {
  extern __shared__ __align__(16) float smem[];
  const i64 t = blockIdx.x, he = P.he, din = P.din, dout = P.dout, hk = P.hk;
  const int S = P.stage_uses;
  const i64 du = din * he, row = du + he * dout, nco = dout / VEC;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  welem *ring = (welem *)smem + (i64)warp * S * row;           /* [NWARPS][S][row] */
  float *xs = (float *)((welem *)smem + (i64)NWARPS * S * row); /* [din] */
  float *gs = xs + round4(din);                           /* [hk] */
  const welem **up = (const welem **)(gs + round4(hk));  /* [hk] */
  const welem **vp = up + hk;
  for (i64 i = tid; i < din; i += NT) xs[i] = peer_ld(P.x, t * P.x_rs + i, P.x_dt);
  stage_uses(P, t, 0, hk, gs, up, vp);
  __syncthreads();
  const int nw = warp < hk ? (int)((hk - warp + NWARPS - 1) / NWARPS) : 0;
  float y[WS_CH][VEC];
#pragma unroll
  for (int m = 0; m < WS_CH; m++)
#pragma unroll
    for (int e = 0; e < VEC; e++) y[m][e] = 0.f;
  for (int n = 0; n < S - 1; n++) ws_issue(P, n, nw, up, vp, ring, row, du, warp, lane);
  for (int n = 0; n < nw; n++) {
    ws_wait(S);
    ws_issue(P, n + S - 1, nw, up, vp, ring, row, du, warp, lane); /* into the slot use n - 1 left */
    const i64 j = warp + NWARPS * n;
    if (!up[j]) continue;
    const welem *slot = ring + (i64)(n % S) * row;
    float z[VEC];
    down_all(P, slot, xs, z, lane);
    const float g = gs[j];
#pragma unroll
    for (int e = 0; e < VEC; e++) z[e] = e < he ? g * peer_act(P.act, z[e]) : 0.f;
    up_rows(slot + du, z, y, he, dout, lane);
    __syncwarp(); /* the slot is read before a later issue refills it */
  }
  /* the warps' rows, added in warp order (over the ring) */
  __syncthreads();
  float *yp = (float *)smem; /* [NWARPS][dout] */
#pragma unroll
  for (int m = 0; m < WS_CH; m++) {
    const i64 cc = lane + 32 * m;
    if (cc < nco)
#pragma unroll
      for (int e = 0; e < VEC; e++) yp[warp * dout + cc * VEC + e] = y[m][e];
  }
  __syncthreads();
  for (i64 c = tid; c < dout; c += NT) {
    float s = yp[c];
    for (int w = 1; w < NWARPS; w++) s += yp[w * dout + c];
    peer_st(P.y, t * P.y_rs + c, P.y_dt, s);
  }
}

/* Per use: z, da = dy · V_e[j], ua, udz, dg to global memory (as
 * bwd_round), and dx[t] += Σ_j udz_j U_e[:, j] in registers: lane l holds
 * the rows of U's 16-byte chunks l + 32 m (VEC / h_e rows each). */
/* acc[r] += Σ_j dz_j w[r HE + j] over one chunk of U (VEC / HE rows); HE
 * is a literal at every call, so every index is static. */
static __device__ __forceinline__ void dx_chunk(float *acc, const float *w, const float *dz, int HE) {
#pragma unroll
  for (int e = 0; e < VEC; e++) acc[e / HE] = fmaf(dz[e % HE], w[e], acc[e / HE]);
}

extern "C" __global__ void __launch_bounds__(NT, 2) peer_expert_bwd_warp(peer_expert_params P) {
  extern __shared__ __align__(16) float smem[];
  const i64 t = blockIdx.x, he = P.he, din = P.din, dout = P.dout, hk = P.hk;
  const int S = P.stage_uses;
  const i64 du = din * he, row = du + he * dout, ncu = du / VEC, nco = dout / VEC;
  const int sh = P.he_shift;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  welem *ring = (welem *)smem + (i64)warp * S * row;
  float *xs = (float *)((welem *)smem + (i64)NWARPS * S * row); /* [din] */
  float *dys = xs + round4(din);                          /* [dout] */
  float *gs = dys + round4(dout);                         /* [hk] */
  const welem **up = (const welem **)(gs + round4(hk));
  const welem **vp = up + hk;
  for (i64 i = tid; i < din; i += NT) xs[i] = peer_ld(P.x, t * P.x_rs + i, P.x_dt);
  for (i64 i = tid; i < dout; i += NT) dys[i] = peer_ld(P.dy, t * P.dy_rs + i, P.dy_dt);
  stage_uses(P, t, 0, hk, gs, up, vp);
  __syncthreads();
  const int nw = warp < hk ? (int)((hk - warp + NWARPS - 1) / NWARPS) : 0;
  float dxa[WS_CH][VEC]; /* [m][r]: dx of row (lane + 32 m) VEC / h_e + r, r < VEC / h_e */
#pragma unroll
  for (int m = 0; m < WS_CH; m++)
#pragma unroll
    for (int e = 0; e < VEC; e++) dxa[m][e] = 0.f;
  for (int n = 0; n < S - 1; n++) ws_issue(P, n, nw, up, vp, ring, row, du, warp, lane);
  for (int n = 0; n < nw; n++) {
    ws_wait(S);
    ws_issue(P, n + S - 1, nw, up, vp, ring, row, du, warp, lane);
    const i64 j = warp + NWARPS * n, use = t * hk + j;
    if (!up[j]) {
      for (i64 jj = lane; jj < he; jj += 32) {
        ((float *)P.ua)[use * he + jj] = 0.f;
        ((float *)P.udz)[use * he + jj] = 0.f;
      }
      if (lane == 0) ((float *)P.dg)[use] = 0.f;
      continue;
    }
    const welem *slot = ring + (i64)(n % S) * row, *v = slot + du;
    float z[VEC], da[VEC];
    down_all(P, slot, xs, z, lane);
#pragma unroll
    for (int jj = 0; jj < VEC; jj++) {
      float s = 0.f;
      if (jj < he) {
        for (i64 cc = lane; cc < nco; cc += 32) {
          float w[VEC];
          load_vec(v + jj * dout + cc * VEC, w);
#pragma unroll
          for (int e = 0; e < VEC; e++) s = fmaf(dys[cc * VEC + e], w[e], s);
        }
      }
      da[jj] = jj < he ? smelt_warp_sum(s) : 0.f;
    }
    const float g = gs[j];
    float dg = 0.f, dz[VEC];
#pragma unroll
    for (int jj = 0; jj < VEC; jj++) {
      dz[jj] = 0.f;
      if (jj >= he) continue;
      const float av = peer_act(P.act, z[jj]);
      dz[jj] = da[jj] * g * peer_act_grad(P.act, z[jj]);
      dg = fmaf(da[jj], av, dg);
      if (lane == jj) {
        ((float *)P.ua)[use * he + jj] = g * av;
        ((float *)P.udz)[use * he + jj] = dz[jj];
      }
    }
    if (lane == 0) ((float *)P.dg)[use] = dg;
    if (P.dx) {
#pragma unroll
      for (int m = 0; m < WS_CH; m++) {
        const i64 f = lane + 32 * m;
        if (f >= ncu) break;
        float w[VEC];
        load_vec(slot + f * VEC, w);
        if (he == 1) dx_chunk(dxa[m], w, dz, 1);
#if VEC >= 4
        else if (he == 2) dx_chunk(dxa[m], w, dz, 2);
        else if (he == 4) dx_chunk(dxa[m], w, dz, 4);
#endif
#if VEC >= 8
        else if (he == 8) dx_chunk(dxa[m], w, dz, 8);
#endif
      }
    }
    __syncwarp();
  }
  if (!P.dx) return;
  __syncthreads();
  float *dp = (float *)smem; /* [NWARPS][din] */
#pragma unroll
  for (int m = 0; m < WS_CH; m++) {
    const i64 f = lane + 32 * m;
    if (f < ncu)
#pragma unroll
      for (int r = 0; r < VEC; r++)
        if (r < (VEC >> sh)) dp[warp * din + ((f * VEC) >> sh) + r] = dxa[m][r];
  }
  __syncthreads();
  for (i64 i = tid; i < din; i += NT) {
    float s = dp[i];
    for (int w = 1; w < NWARPS; w++) s += dp[w * din + i];
    ((float *)P.dx)[t * din + i] = s;
  }
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/* ---------------------------------------------------------------- persistent bulk-copy forward */

/* peer_expert_fwd_bulk (Hopper): each warp owns whole tokens (gw, gw + W,
 * ... for W warps in the grid, one CTA an SM) and streams their uses'
 * rows, one use a slot, through a ring of P.stage_uses slots of its own:
 * lane 0 fills a slot with two bulk copies (TMA: the U part, then the V
 * part) that complete on the slot's mbarrier; rows the store left in host
 * memory are copied by the lanes' cp.async instead and tracked by the same
 * mbarrier. No CTA barrier at all, and no per-token CTA: the random 2 KiB
 * rows then stream at the copy rate (bench/gather_bw.cu with 8 warps x 4
 * slots an SM: docs/PERF.md, Ceilings), where the CTA-per-token warp kernel
 * above fell short of it (docs/PERF.md, PEER: expert kernel).
 * A token's y lives in the lanes' registers as in the warp kernel, its x
 * in registers too (the lane's down-projection columns), so a use costs
 * the wait, the two dot products and the refill. Ids and gates come
 * through a per-warp window of 64 uses in shared memory that the lanes
 * fill 32 at a time, a batch ahead in registers. Same products as the
 * other kernels, summed per token by one warp in use order (the results
 * differ from theirs by rounding and repeat bit for bit; the store path
 * runs this kernel too, so stored and dense results are identical).
 * Two entry points: 16 warps a CTA, alone on the GPU; and 8 warps
 * (peer_expert_fwd_bulk8, at most 128 registers) to share each SM with a
 * routing CTA (src/cuda/peer_select.c's overlap). */
#define BK_WIN 64 /* uses in a warp's id/gate window: two batches of 32 */
static_assert(BK_WIN * (sizeof(int) + sizeof(float)) == SMELT_PEER_SMEM_BULK_WIN,
              "a warp's window of codes and gates must take the host's SMELT_PEER_SMEM_BULK_WIN bytes");

/* A use's row code: the expert's index in the full tables (>= 0), a cache
 * slot s as -(s + 2), or -1 for an id outside [0, N). */
static __device__ __forceinline__ int bk_code(const peer_expert_params &P, i64 e) {
  if (e < 0 || e >= P.N) return -1;
  const int slot = P.table ? ((const int *)P.table)[e] : -1;
  return slot >= 0 ? -(slot + 2) : (int)e;
}

/* The id and gate of flat use f of warp gw (its tokens in order, hk uses
 * each); -1 and 0 past the warp's last use. Beside the routing (P.ready),
 * first waits until the routing CTAs of the token's block and the use's
 * head group have written them (the group's counter reaches ready_need:
 * kernels/peer_route.cu's route_tile; acquire, so the loads after it
 * see the writes; L2 loads, as the lines were written by other SMs). */
static __device__ __forceinline__ void bk_fetch(const peer_expert_params &P, i64 f, i64 nu, i64 gw, i64 W, i64 *id,
                                                float *g) {
  if (f >= nu) {
    *id = -1;
    *g = 0.f;
    return;
  }
  const u32 i = (u32)f / (u32)P.hk; /* f < the warp's uses, far below 2^32 */
  const i64 t = gw + (i64)i * W, j = f - (i64)i * P.hk, use = t * P.hk + j;
  if (P.ready) {
    /* the counter of the use's head group (of ready_gu uses a token) */
    const int *c = (const int *)P.ready + (t >> P.ready_shift) * P.ready_groups + (u32)j / (u32)P.ready_gu;
    for (;;) {
      if (smelt_ld_acquire(c) >= P.ready_need) break;
      /* 1 us between polls: every waiting warp polls, beside the routing
       * that raises these counters; shorter and longer sleeps measured the
       * same (docs/PERF.md, PEER: overlap and projection), so fewer polls */
      __nanosleep(1000);
    }
  }
  *id = __ldcg((const long long *)P.ids + use);
  *g = __ldcg((const float *)P.gates + use);
}

/* Fills slot n % S with use n's rows (code c). */
static __device__ __forceinline__ void bk_issue(const peer_expert_params &P, int c, welem *dst, u32 bar, i64 du,
                                                i64 dv, int lane) {
  if (c == -1) { /* nothing to copy: the slot zeroed (bulk_fwd's pairs compute such a use
                    * beside its neighbour and only then drop it: no stale bits may reach y) */
    const int n16 = (int)((du + dv) * (i64)sizeof(welem) / 16);
    for (int i = lane; i < n16; i += 32) ((uint4 *)dst)[i] = make_uint4(0u, 0u, 0u, 0u);
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
    return;
  }
  const bool cached = c < -1;
  const i64 r = cached ? -(i64)c - 2 : c;
  const welem *u = (const welem *)(cached ? P.u_cache : P.u_host) + r * du;
  const welem *v = (const welem *)(cached ? P.v_cache : P.v_host) + r * dv;
  if (cached || !P.table) { /* rows in HBM: two bulk copies by lane 0 */
    if (lane == 0) {
      /* no proxy fence: the slot's last reads (generic proxy) have
       * returned their values, consumed before the __syncwarp that
       * precedes this refill */
      const u32 d = smem_u32(dst);
      mbar_expect_tx(bar, (u32)((du + dv) * sizeof(welem)));
      bulk_load(d, u, (u32)(du * sizeof(welem)), bar);
      bulk_load(d + (u32)(du * sizeof(welem)), v, (u32)(dv * sizeof(welem)), bar);
    }
    return;
  }
  /* a row in the store's host tables, read through the mapping */
  copy_rows_async(smem_u32(dst), u, v, du, du + dv, lane);
  cp_async_mbar_arrive(bar);
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}

#if SMELT_WDT != SMELT_DT_F32 && VEC == 8
/* bulk_fwd's tensor-core body (LIT 2): this lane's shares p[u] of x . U
 * for n (1 or 2, a literal) uses whose slots' U rows lane 0 reads at
 * sa[u] - 16 lane (the layout and the diagonal: bulk_fwd), their loads
 * and mma interleaved; a warp sum of a use's shares is its dot. */
static __device__ __forceinline__ void tc_shares(const u32 *sa, const int n, const u32 (*xb)[4][2], bool diag, int g8,
                                                 float *p) {
  float d[2][2][4];
#pragma unroll
  for (int u = 0; u < n; u++)
#pragma unroll
    for (int e = 0; e < 4; e++) d[u][0][e] = d[u][1][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < 4; ks++) {
    u32 a[2][4];
#pragma unroll
    for (int u = 0; u < n; u++) ldsm_x4(sa[u] + 512 * ks, a[u]);
#pragma unroll
    for (int u = 0; u < n; u++) {
      PEER_MMA(d[u][0], a[u], xb[0][ks]);
      PEER_MMA(d[u][1], a[u], xb[1][ks]);
    }
  }
#pragma unroll
  for (int u = 0; u < n; u++) p[u] = diag ? (g8 & 1 ? d[u][0][1] + d[u][1][3] : d[u][0][0] + d[u][1][2]) : 0.f;
}
/* y += h V for a V row held raw (the lane's WS_CH chunks). */
static __device__ __forceinline__ void tc_up(const uint4 *v, float h, float (*y)[VEC]) {
#pragma unroll
  for (int cc = 0; cc < WS_CH; cc++) {
    float w[VEC];
    raw_vec(v[cc], w);
#pragma unroll
    for (int e = 0; e < VEC; e++) y[cc][e] = fmaf(h, w[e], y[cc][e]);
  }
}
#endif

/* The kernel's body, for CTAs of NW warps. LIT: the issue's shape as
 * literals (h_e = 1 and d_in = d_out = 32 WS_CH VEC, every lane's chunks
 * whole: the hidden-unit folds, the chunk bounds, their loops and
 * branches vanish); 2, the same with the down projection on tensor cores
 * (bk_tensor); or 0 for any shape the warp kernels take. Each body has
 * entry points of its own: one function holding two bodies spilled far
 * more than either alone (ptxas), and ran slower (docs/PERF.md, PEER:
 * expert kernel). */
static __device__ __forceinline__ void bulk_fwd(const peer_expert_params &P, float *smem, u64 *bars, const int LIT,
                                                const int NW) {
  const int S = P.stage_uses; /* <= 8 */
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sh = LIT ? 0 : P.he_shift;
  const i64 he = LIT ? 1 : P.he, din = LIT ? 32 * WS_CH * VEC : P.din, dout = LIT ? 32 * WS_CH * VEC : P.dout;
  const i64 hk = P.hk, du = din * he, dv = he * dout, row = du + dv, ncu = du / VEC, nco = dout / VEC;
  const i64 gw = (i64)blockIdx.x * NW + warp, W = (i64)gridDim.x * NW;
  welem *ring = (welem *)smem + (i64)warp * S * row;
  int *codes = (int *)((welem *)smem + (i64)NW * S * row) + warp * 2 * BK_WIN; /* [BK_WIN] */
  float *gates = (float *)(codes + BK_WIN);                                 /* [BK_WIN] */
  const u32 bar0 = smem_u32(bars + warp * 8);
  if (lane < S) mbar_init(bar0 + 8 * lane, 1);
  fence_mbar_init();
  __syncwarp();
  const i64 ntok = gw < P.T ? (P.T - gw + W - 1) / W : 0, nu = ntok * hk;

  /* the batch after the one being written: its ids and gates in flight */
  i64 id_next;
  float g_next;
  bk_fetch(P, lane, nu, gw, W, &id_next, &g_next);
  i64 batch = 0; /* batches written to the window so far */
  /* writes batch `batch` (its values in *_next) and loads the next one */
#define BK_BATCH()                                                           \
  do {                                                                       \
    codes[(batch & 1) * 32 + lane] = bk_code(P, id_next);                    \
    gates[(batch & 1) * 32 + lane] = g_next;                                 \
    batch++;                                                                 \
    bk_fetch(P, batch * 32 + lane, nu, gw, W, &id_next, &g_next);            \
    __syncwarp();                                                            \
  } while (0)

  /* after use mm: refills its slot ss with use mm + S (and the window) */
#define BK_REFILL(mm, ss)                                                                          \
  do {                                                                                             \
    __syncwarp(); /* every lane has read slot ss before it is refilled */                          \
    const i64 n = (mm) + S;                                                                        \
    if (n < nu) {                                                                                  \
      if (n == batch * 32) BK_BATCH();                                                             \
      bk_issue(P, codes[n & (BK_WIN - 1)], ring + (ss) * row, bar0 + 8 * (u32)(ss), du, dv, lane); \
    }                                                                                              \
  } while (0)

  BK_BATCH();
  for (int n = 0; n < S && n < nu; n++) {
    if (n == batch * 32) BK_BATCH();
    bk_issue(P, codes[n & (BK_WIN - 1)], ring + n * row, bar0 + 8 * (u32)n, du, dv, lane);
  }

  int s = 0; /* use m's slot, m % S, and that slot's phase parity, (m / S) & 1 */
  u32 par = 0;
  /* a token at a time: its x loaded and y stored outside the loop over its
   * uses (measured faster beside the routing than one loop over all the
   * warp's uses with the token's start and end as branches in it) */
  for (i64 m = 0, tok = gw; m < nu; tok += W) {
    float x[WS_CH][VEC], y[WS_CH][VEC];
#pragma unroll
    for (int c = 0; c < WS_CH; c++)
#pragma unroll
      for (int e = 0; e < VEC; e++) {
        const i64 f = (lane + 32 * c) * VEC + e;
        x[c][e] = LIT == 2 ? 0.f : LIT || lane + 32 * c < ncu ? peer_ld(P.x, tok * P.x_rs + (f >> sh), P.x_dt) : 0.f;
        y[c][e] = 0.f;
      }
#if SMELT_WDT != SMELT_DT_F32 && VEC == 8
    if (LIT == 2) {
      /* The down projection on tensor cores, beside the routing two uses at
       * a time (docs/PERF.md, PEER version 18). The dot x . U (1024 terms)
       * is the trace of A B with A (16 x 64) the U row, row i's k block kb
       * (8 elements) at 16-byte chunk i + 16 kb of the slot, and B (64 x
       * 16) = x laid out to match:
       * B[k][i] = x[8 i + 128 kb + k % 8]. Four k steps of 16, each A
       * fragment one ldmatrix.x4 of 512 contiguous bytes (no bank conflict),
       * two n tiles of 8; the diagonal's 16 values sit in the lanes with
       * t = g / 2 and a warp sum adds them. x's 16 B fragments stay in
       * registers for the token. The uses' V rows go to registers too, so
       * the slots are refilled before the sums. */
      const int g8 = lane >> 2, tq = lane & 3;
      const bool diag = tq == (g8 >> 1);
      u32 xb[2][4][2];
      {
        const u32 *xr = (const u32 *)((const welem *)P.x + tok * P.x_rs);
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
          for (int ks = 0; ks < 4; ks++)
#pragma unroll
            for (int r = 0; r < 2; r++) xb[nt][ks][r] = xr[(8 * (8 * nt + g8) + 256 * ks + 128 * r + 2 * tq) >> 1];
      }
      /* NU uses at a time: beside the routing (8 warps) two, so that their
       * waits, loads, reductions and activations interleave; 16 warps (alone
       * on the SM) one, as they hide each other's latency and a pair would
       * keep fewer rows in flight a warp (docs/PERF.md, PEER version 18).
       * Each use's sums are the same either way, so the bits are too. */
      const int NU = NW == 8 ? 2 : 1;
      for (i64 j = 0; j < hk; j += NU, m += NU) {
        int su[2], c[2]; /* use m + u's slot and row code */
        float g[2];
        u32 sa[2];
#pragma unroll
        for (int u = 0; u < NU; u++) { /* s, par on past the group */
          su[u] = s;
          mbar_wait(bar0 + 8 * (u32)s, par);
          if (++s == S) {
            s = 0;
            par ^= 1;
          }
          c[u] = codes[(m + u) & (BK_WIN - 1)];
          g[u] = gates[(m + u) & (BK_WIN - 1)];
          sa[u] = smem_u32(ring + su[u] * row) + 16 * lane;
        }
        float p[2];
        tc_shares(sa, NU, xb, diag, g8, p);
        uint4 v[2][WS_CH];
#pragma unroll
        for (int cc = 0; cc < WS_CH; cc++)
#pragma unroll
          for (int u = 0; u < NU; u++) v[u][cc] = *(const uint4 *)(ring + su[u] * row + du + (lane + 32 * cc) * VEC);
        fence_proxy_async();
#pragma unroll
        for (int u = 0; u < NU; u++) BK_REFILL(m + u, su[u]);
        float z[2];
#pragma unroll
        for (int u = 0; u < NU; u++) z[u] = smelt_warp_sum(p[u]);
        /* a use with no row (code -1) adds nothing: its slot was zeroed
         * (bk_issue), so w = 0, and z = 0 whatever x holds */
#pragma unroll
        for (int u = 0; u < NU; u++) tc_up(v[u], c[u] == -1 ? 0.f : g[u] * peer_act(P.act, z[u]), y);
      }
    } else
#endif
    for (i64 j = 0; j < hk; j++, m++) {
      mbar_wait(bar0 + 8 * (u32)s, par);
      const int c = codes[m & (BK_WIN - 1)];
      const float g = gates[m & (BK_WIN - 1)];
      const welem *slot = ring + s * row, *v = slot + du;
      float acc[VEC];
      uint4 vr[WS_CH]; /* LIT: the use's V row, raw, so that its slot is refilled before the sums */
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[e] = 0.f;
      if (c != -1) {
#pragma unroll
        for (int cc = 0; cc < WS_CH; cc++) {
          if (!LIT && lane + 32 * cc >= ncu) break;
          float w[VEC];
          load_vec(slot + (lane + 32 * cc) * VEC, w);
#pragma unroll
          for (int e = 0; e < VEC; e++) acc[e] = fmaf(x[cc][e], w[e], acc[e]);
        }
        if (LIT)
#pragma unroll
          for (int cc = 0; cc < WS_CH; cc++) vr[cc] = *(const uint4 *)(v + (lane + 32 * cc) * VEC);
      }
      /* The refill. With the literal shape it comes as soon as the lanes hold
       * the slot's bytes, before the use's sums (the warp reduction, the
       * activation, the up projection: most of a use's latency), so the slot
       * is back in flight that much sooner; the proxy fence orders each
       * lane's shared reads before the bulk copy's writes (values read but
       * not consumed yet). Otherwise after the whole use, as before. */
      if (LIT) {
        fence_proxy_async();
        BK_REFILL(m, s);
      }
      if (c != -1) {
        float z[VEC];
        hidden_sums(acc, he, z);
#pragma unroll
        for (int e = 0; e < VEC; e++) z[e] = e < he ? g * peer_act(P.act, z[e]) : 0.f;
        if (LIT) {
#pragma unroll
          for (int cc = 0; cc < WS_CH; cc++) {
            float w[VEC];
            raw_vec(vr[cc], w);
#pragma unroll
            for (int e = 0; e < VEC; e++) y[cc][e] = fmaf(z[0], w[e], y[cc][e]);
          }
        } else {
          up_rows(v, z, y, he, dout, lane);
        }
      }
      if (!LIT) BK_REFILL(m, s);
      if (++s == S) {
        s = 0;
        par ^= 1;
      }
    }
#pragma unroll
    for (int cc = 0; cc < WS_CH; cc++) {
      const i64 col = lane + 32 * cc;
      if (LIT || col < nco)
#pragma unroll
        for (int e = 0; e < VEC; e++) peer_st(P.y, tok * P.y_rs + col * VEC + e, P.y_dt, y[cc][e]);
    }
  }
#undef BK_REFILL
#undef BK_BATCH
}

/* The literal body's shape (bulk_fwd's LIT). */
static __device__ __forceinline__ int bk_literal(const peer_expert_params &P) {
  return P.he == 1 && P.din == 32 * WS_CH * VEC && P.dout == 32 * WS_CH * VEC;
}

/* The literal shape with the down projection on tensor cores (LIT 2):
 * 16-bit weights, d_in = d_out = 1024, x of the weights' type with rows
 * 4-byte aligned, h k even (pairs of uses). src/cuda/peer_select.c's
 * expert_tc takes the _tc entry points only then; they trap otherwise,
 * rather than compute from misread x. */
static __device__ __forceinline__ int bk_tensor(const peer_expert_params &P) {
  return SMELT_WDT != SMELT_DT_F32 && VEC == 8 && P.x_dt == SMELT_WDT && (P.x & 3) == 0 && P.x_rs % 2 == 0 &&
         P.hk % 2 == 0 && bk_literal(P);
}

extern "C" __global__ void __launch_bounds__(16 * 32, 1) peer_expert_fwd_bulk(peer_expert_params P) {
  extern __shared__ __align__(16) float smem[];
  __shared__ __align__(8) u64 bars[16 * 8];
  if (bk_literal(P)) bulk_fwd(P, smem, bars, 1, 16);
  else bulk_fwd(P, smem, bars, 0, 16);
}
extern "C" __global__ void __launch_bounds__(8 * 32, 2) peer_expert_fwd_bulk8(peer_expert_params P) {
  extern __shared__ __align__(16) float smem[];
  __shared__ __align__(8) u64 bars[8 * 8];
  static_assert(sizeof bars == SMELT_PEER_SMEM_BULK8_BARS, "the barriers must take the host's SMELT_PEER_SMEM_BULK8_BARS");
  if (bk_literal(P)) bulk_fwd(P, smem, bars, 1, 8);
  else bulk_fwd(P, smem, bars, 0, 8);
}
#if SMELT_WDT != SMELT_DT_F32 && VEC == 8
extern "C" __global__ void __launch_bounds__(16 * 32, 1) peer_expert_fwd_bulk_tc(peer_expert_params P) {
  extern __shared__ __align__(16) float smem[];
  __shared__ __align__(8) u64 bars[16 * 8];
  if (!bk_tensor(P)) __trap();
  bulk_fwd(P, smem, bars, 2, 16);
}
extern "C" __global__ void __launch_bounds__(8 * 32, 2) peer_expert_fwd_bulk8_tc(peer_expert_params P) {
  extern __shared__ __align__(16) float smem[];
  __shared__ __align__(8) u64 bars[8 * 8];
  if (!bk_tensor(P)) __trap();
  bulk_fwd(P, smem, bars, 2, 8);
}
#endif
#endif
#endif
