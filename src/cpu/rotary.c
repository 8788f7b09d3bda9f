/* CPU reference for smelt_rotary, in double from the f32 tables: each
 * pair of a head turned by its position's angle (by its negative for the
 * inverse), the elements past R copied. Both elements of a pair are read
 * before either is written, so y may be x itself. */
#include "../core/internal.h"

/* Element (b, s, h, j) of a [B, S, H, D] view. */
static int64_t at(const smelt_tensor *t, int64_t b, int64_t s, int64_t h, int64_t j) {
  return b * t->strides[0] + s * t->strides[1] + h * t->strides[2] + j * t->strides[3];
}

/* The table row of token (b, s): positions[b, s] clamped to [0, P), or s. */
static int64_t position(const smelt_tensor *pos, int64_t b, int64_t s, int64_t P) {
  if (!pos) return s;
  /* Clamped as a double first: an i64 position past 2^63 - 1 as a double
   * would not convert back. */
  const double p = smelt__load_f64(pos->data, pos->dtype, b * pos->strides[0] + s * pos->strides[1]);
  return p < 0 ? 0 : p >= (double)P ? P - 1 : (int64_t)p;
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *ct = t[1], *st = t[2], *y = t[4];
  const smelt_rotary_desc *d = (const smelt_rotary_desc *)plan->opdata;
  const int64_t B = x->shape[0], S = x->shape[1], H = x->shape[2], D = x->shape[3], half = ct->shape[1];
  const double sign = d->inverse ? -1.0 : 1.0;
  if (smelt_tensor_numel(x) == 0) return SMELT_OK; /* B may be huge with S or H 0: nothing to loop over */
  for (int64_t b = 0; b < B; b++)
    for (int64_t s = 0; s < S; s++) {
      const int64_t p = position(t[3], b, s, ct->shape[0]);
      for (int64_t h = 0; h < H; h++) {
        for (int64_t i = 0; i < half; i++) {
          const int64_t j1 = d->layout == SMELT_ROTARY_NEOX ? i : 2 * i, j2 = d->layout == SMELT_ROTARY_NEOX ? i + half : 2 * i + 1;
          const double c = smelt__load_f64(ct->data, ct->dtype, p * ct->strides[0] + i * ct->strides[1]);
          const double sn = sign * smelt__load_f64(st->data, st->dtype, p * st->strides[0] + i * st->strides[1]);
          const double x1 = smelt__load_f64(x->data, x->dtype, at(x, b, s, h, j1));
          const double x2 = smelt__load_f64(x->data, x->dtype, at(x, b, s, h, j2));
          smelt__store_f64(y->data, y->dtype, at(y, b, s, h, j1), x1 * c - x2 * sn);
          smelt__store_f64(y->data, y->dtype, at(y, b, s, h, j2), x2 * c + x1 * sn);
        }
        for (int64_t j = 2 * half; j < D; j++)
          smelt__store_f64(y->data, y->dtype, at(y, b, s, h, j), smelt__load_f64(x->data, x->dtype, at(x, b, s, h, j)));
      }
    }
  return SMELT_OK;
}

const smelt__backend smelt__cpu_rotary = {.run = run};
