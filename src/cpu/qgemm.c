/* CPU reference for smelt_qgemm: each row of W decoded exactly with the
 * quantizers' own decoders (kernels/quant_math.cuh), the product of E2M1,
 * E4M3 and the f32 tensor scale formed in double (at most 6 + 24
 * significant bits: exact), the dot products summed in double, the
 * epilogue in double, one rounding to D's dtype. One row of W at a time,
 * so the scratch is K doubles whatever N is. */
#include "../core/checked.h"
#include "../core/qgemm_internal.h"

#include <stdlib.h>

static double load(const smelt_tensor *t, int64_t off) { return smelt__load_f64(t->data, t->dtype, off); }

/* Row n of the NVFP4 weights, dequantized into w[K]. */
static void decode_row(const smelt_tensor *q, const smelt_tensor *scale, double ts, int64_t n, int64_t K,
                       double *w) {
  int64_t srs, scs;
  smelt__quant_scale_strides(scale, &srs, &scs);
  const uint8_t *qrow = (const uint8_t *)q->data + n * q->strides[0];
  const uint8_t *srow = (const uint8_t *)scale->data + n * srs;
  for (int64_t k = 0; k < K; k++) {
    const smelt_q_u32 code = (qrow[k / 2] >> ((k & 1) * 4)) & 0x0fu;
    const double bs = smelt_q_decode(srow[(k / 16) * scs], SMELT_Q_E4M3);
    w[k] = (double)smelt_q_decode(code, SMELT_Q_E2M1) * bs * ts;
  }
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt_tensor *x = t[SMELT__QG_X], *d = t[SMELT__QG_D], *bias = t[SMELT__QG_BIAS];
  const smelt_qgemm_desc *e = &smelt__qgemm_params_of(plan)->desc;
  const int64_t M = x->shape[0], K = x->shape[1], N = d->shape[1];
  if (M == 0 || N == 0) return SMELT_OK;
  size_t bytes;
  smelt_status s = smelt__bytes(K > 0 ? K : 1, sizeof(double), &bytes, "smelt_qgemm", "a row of W");
  if (s) return s;
  double *w = malloc(bytes);
  if (!w) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_qgemm: out of host memory (%zu bytes)", bytes);
  const double ts = *(const float *)t[SMELT__QG_TS]->data;
  for (int64_t n = 0; n < N; n++) {
    if (K > 0) decode_row(t[SMELT__QG_Q], t[SMELT__QG_SCALE], ts, n, K, w); /* K = 0: W's views may have no data */
    const double b = bias ? load(bias, n * bias->strides[0]) : 0.0;
    for (int64_t m = 0; m < M; m++) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; k++) acc += load(x, m * x->strides[0] + k * x->strides[1]) * w[k];
      const double v = smelt_act_apply(e->act, e->alpha * acc + b, e->slope);
      smelt__store_f64(d->data, d->dtype, m * d->strides[0] + n * d->strides[1], v);
    }
  }
  free(w);
  return SMELT_OK;
}

const smelt__backend smelt__cpu_qgemm = {.run = run};
