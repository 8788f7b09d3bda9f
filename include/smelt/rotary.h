/* smelt rotary position embedding (RoPE), forward and backward. Included by
 * smelt.h.
 *
 * The contract: cos and sin come as f32 tables [P, R/2] (row p holds the
 * angles of position p), which fixes the rotary width R = 2 · cos.shape[1];
 * smelt_rotary_tables fills them from a base theta the usual way. A token's
 * position is its index s along S, or positions[b, s] when given. Pair i
 * (i < R/2) of a head turns by the angle a = angle(p, i):
 *   y1 = x1 · cos a − x2 · sin a,   y2 = x2 · cos a + x1 · sin a
 * where (x1, x2) is, by layout,
 *   NEOX  (x[i], x[i + R/2])   the GPT-NeoX / Llama half split
 *   GPTJ  (x[2i], x[2i + 1])   the GPT-J interleaved pairs
 * Elements R..D−1 pass through unchanged (partial rotary, R < D). The
 * backward is the rotation by −a (desc.inverse = 1): dx = rotary⁻¹(dy).
 * Math in f32, rounded once to the dtype.
 *
 * Shapes and layouts:
 *   x          [B, S, H, D]  f32, f16 or bf16; unit stride along D, any
 *                            non-negative strides otherwise (Q or K as a
 *                            view into a packed QKV buffer works)
 *   cos, sin   [P, R/2]      f32, unit stride along R/2; 2 <= R <= D, R even
 *   positions  [B, S]        i32 or i64 (any strides), or NULL: then S <= P.
 *                            Values outside [0, P) are clamped into it (the
 *                            GPU cannot refuse them without a host read).
 *   y          [B, S, H, D]  x's dtype; may be x exactly (in place)
 * On an error nothing is written. Every backend supports every case.
 */
#ifndef SMELT_ROTARY_H
#define SMELT_ROTARY_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum smelt_rotary_layout {
  SMELT_ROTARY_NEOX = 0, /* pairs (i, i + R/2) */
  SMELT_ROTARY_GPTJ = 1, /* pairs (2i, 2i + 1) */
  SMELT_ROTARY_LAYOUT_COUNT
} smelt_rotary_layout;

/* "neox", "gptj"; "?" if invalid. */
SMELT_API const char *smelt_rotary_layout_name(smelt_rotary_layout l);

typedef struct smelt_rotary_desc {
  smelt_rotary_layout layout;
  int inverse; /* 0: rotate by +angle (forward); 1: by −angle (backward) */
} smelt_rotary_desc;

/* Host tables for positions 0..P−1 and rotary width R (even, >= 2):
 * cos[p·R/2 + i] = cos(p · theta^(−2i/R)), sin likewise, computed in double
 * and rounded to f32. cos and sin hold P·R/2 floats each (host memory);
 * copy them to the device for a CUDA context. theta > 0 (10000 in most
 * models). */
SMELT_API smelt_status smelt_rotary_tables(double theta, int64_t P, int64_t R, float *cos, float *sin);

SMELT_API smelt_status smelt_rotary_plan(smelt_ctx *ctx, const smelt_rotary_desc *desc, const smelt_tensor *x,
                                         const smelt_tensor *cos, const smelt_tensor *sin,
                                         const smelt_tensor *positions, const smelt_tensor *y, smelt_plan **out);
SMELT_API smelt_status smelt_rotary_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *cos,
                                        const smelt_tensor *sin, const smelt_tensor *positions,
                                        const smelt_tensor *y);
SMELT_API smelt_status smelt_rotary(smelt_ctx *ctx, const smelt_rotary_desc *desc, const smelt_tensor *x,
                                    const smelt_tensor *cos, const smelt_tensor *sin, const smelt_tensor *positions,
                                    const smelt_tensor *y);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_ROTARY_H */
