/* Rotary position embedding over x [B, S, H, D] (include/smelt/rotary.h):
 * pairs of each head turned by the angle of the token's position, read from
 * f32 cos/sin tables [P, R/2]; elements R..D-1 copied (skipped in place).
 *
 * Prelude: SMELT_DT. The layout (NeoX halves or GPT-J neighbours) and the
 * direction (sign = -1 for the inverse) are run-time arguments, uniform
 * over the launch. A head is one row of units, each unit a 16-byte vector
 * of x (*_vec: every row start, D and R/2 aligned to it) or one pair
 * (*_unit); a NeoX vector unit takes matching vectors from both halves.
 * TPR threads share a row (the power of two at or above its units, at most
 * 32), so short heads still fill a warp and neighbouring threads touch
 * neighbouring memory. The op is memory-bound: x read once, y written
 * once; the table rows of a token are shared by its H heads and come from
 * L1/L2. y may be x itself: each element is read before it is written, by
 * the thread that writes it.
 */
#include "smelt_device.cuh"

#if !defined(SMELT_DT)
#error "rotary.cu needs SMELT_DT"
#endif

#define BLOCK 256
#define VW SMELT_VW


typedef struct rot_args {
  const elem_t *x;
  elem_t *y;
  const float *cs, *sn;
  const void *pos;
  int pos64, gptj, copy, tpr_log2;
  float sign;
  i64 B, S, H, D, half, P;
  i64 xs0, xs1, xs2, ys0, ys1, ys2, cs0, ss0, ps0, ps1;
} rot_args;

/* (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). */
static __device__ __forceinline__ void turn(float *x1, float *x2, float c, float s) {
  const float a = *x1, b = *x2;
  *x1 = a * c - b * s;
  *x2 = b * c + a * s;
}

/* Unit u of a row's rotated part. */
static __device__ __forceinline__ void rotate_vec(const rot_args &a, const elem_t *xr, elem_t *yr, const float *cr,
                                                  const float *sr, i64 u) {
  if (!a.gptj) {
    const i64 i0 = u * VW;
    smelt_vec16 p, q;
    p.u = *(const uint4 *)(xr + i0);
    q.u = *(const uint4 *)(xr + a.half + i0);
#pragma unroll
    for (int e = 0; e < VW; e++) {
      float x1 = load_elem(p.e[e]), x2 = load_elem(q.e[e]);
      turn(&x1, &x2, cr[i0 + e], a.sign * sr[i0 + e]);
      p.e[e] = store_elem(x1);
      q.e[e] = store_elem(x2);
    }
    *(uint4 *)(yr + i0) = p.u;
    *(uint4 *)(yr + a.half + i0) = q.u;
  } else {
    const i64 j0 = u * VW;
    smelt_vec16 p;
    p.u = *(const uint4 *)(xr + j0);
#pragma unroll
    for (int e = 0; e < VW / 2; e++) {
      float x1 = load_elem(p.e[2 * e]), x2 = load_elem(p.e[2 * e + 1]);
      turn(&x1, &x2, cr[j0 / 2 + e], a.sign * sr[j0 / 2 + e]);
      p.e[2 * e] = store_elem(x1);
      p.e[2 * e + 1] = store_elem(x2);
    }
    *(uint4 *)(yr + j0) = p.u;
  }
}

static __device__ __forceinline__ void rotate_unit(const rot_args &a, const elem_t *xr, elem_t *yr, const float *cr,
                                                   const float *sr, i64 i) {
  const i64 j1 = a.gptj ? 2 * i : i, j2 = a.gptj ? 2 * i + 1 : i + a.half;
  float x1 = load_elem(xr[j1]), x2 = load_elem(xr[j2]);
  turn(&x1, &x2, cr[i], a.sign * sr[i]);
  yr[j1] = store_elem(x1);
  yr[j2] = store_elem(x2);
}

/* The table row of token (b, s): positions[b, s] clamped to [0, P), or s. */
static __device__ __forceinline__ i64 position(const rot_args &a, i64 b, i64 s) {
  if (!a.pos) return s;
  const i64 off = b * a.ps0 + s * a.ps1;
  const i64 p = a.pos64 ? ((const long long *)a.pos)[off] : (i64)((const int *)a.pos)[off];
  return p < 0 ? 0 : p >= a.P ? a.P - 1 : p;
}

static __device__ __forceinline__ void rotary_rows(const rot_args &a, bool vec) {
  const int tpr = 1 << a.tpr_log2, lane = threadIdx.x & (tpr - 1);
  const i64 rpb = BLOCK >> a.tpr_log2, rows = a.B * a.S * a.H;
  const i64 rot = 2 * a.half;
  const i64 pairs = vec ? (a.gptj ? rot : a.half) / VW : a.half;
  const i64 units = pairs + (a.copy ? (vec ? (a.D - rot) / VW : a.D - rot) : 0);
  for (i64 r = (i64)blockIdx.x * rpb + (threadIdx.x >> a.tpr_log2); r < rows; r += (i64)gridDim.x * rpb) {
    const i64 h = r % a.H, bs = r / a.H, s = bs % a.S, b = bs / a.S;
    const elem_t *xr = a.x + b * a.xs0 + s * a.xs1 + h * a.xs2;
    elem_t *yr = a.y + b * a.ys0 + s * a.ys1 + h * a.ys2;
    const i64 p = position(a, b, s);
    const float *cr = a.cs + p * a.cs0, *sr = a.sn + p * a.ss0;
    for (i64 u = lane; u < units; u += tpr) {
      if (u < pairs) {
        if (vec) {
          rotate_vec(a, xr, yr, cr, sr, u);
        } else {
          rotate_unit(a, xr, yr, cr, sr, u);
        }
      } else if (vec) {
        const i64 j = rot + (u - pairs) * VW;
        *(uint4 *)(yr + j) = *(const uint4 *)(xr + j);
      } else {
        const i64 j = rot + (u - pairs);
        yr[j] = xr[j];
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK) rotary_vec(rot_args a) { rotary_rows(a, true); }
extern "C" __global__ void __launch_bounds__(BLOCK) rotary_unit(rot_args a) { rotary_rows(a, false); }
