/* What the MoE test files share (tests/test_moe.c defines it): a problem
 * (its spec, host data and tensors), device copies of it, and the bounds. */
#ifndef SMELT_TEST_MOE_H
#define SMELT_TEST_MOE_H

#include "harness.h"

/* A host array in its dtype, with its values as doubles. */
typedef struct arr {
  smelt_dtype dt;
  int64_t n;
  void *h;
  double *v;
} arr;

arr arr_new(smelt_dtype dt, int64_t n, double lo, double hi);
void arr_set(arr *a, int64_t i, double v);
void arr_free(arr *a);

typedef struct spec {
  int64_t T, d, E, k, F;
  smelt_moe_score score;
  int no_renorm;
  double scale; /* 0: 1 */
  int64_t groups, topk_groups;
  double cap;
  smelt_moe_drop drop;
  double aux, z;
  smelt_moe_ffn ffn;
  smelt_act act;
  int bias, b1, noise;
  smelt_dtype xdt, wdt; /* 0 (f64) is taken as f32 unless f64 is asked: f64 = 1 */
  int f64;
} spec;

typedef struct mp {
  spec sp;
  smelt_moe_config cfg;
  int64_t T, d, E, k, F, R;
  smelt_dtype xdt, wdt, rdt;
  arr x, wr, eb, wn, w1, w3, w2, b1;
  smelt_tensor tx, twr, teb, twn, tw1, tw3, tw2, tb1;
  smelt_moe_weights w;
} mp;

/* A contiguous host tensor of n dims [a, b, c]. */
smelt_tensor host_tensor(void *p, smelt_dtype dt, int n, int64_t a, int64_t b, int64_t c);
/* Fresh seeded inputs for sp: x, every weight and the config. */
void mp_init(mp *p, const spec *sp);
void mp_free(mp *p);
/* A bias that sends every token to expert 3 and none to expert 0 (E > 3). */
void all_to_three(mp *p);

/* A device copy of host data (guarded, poisoned buffer) and its view. */
typedef struct dev {
  th_buf b;
  smelt_tensor t;
} dev;

dev dev_new(smelt_dtype dt, int nd, int64_t a, int64_t b, const void *host);
/* A contiguous [a, b, c] device copy of host data. */
dev dev3_new(smelt_dtype dt, int64_t a, int64_t b, int64_t c, const void *host);
/* The device data on the host (malloc'd), its guards checked. */
void *dev_read(const dev *d);
void devs_free(dev *all, size_t n);

/* p's x and weights on the device. */
typedef struct dev_weights {
  dev x, wr, eb, wn, w1, w3, w2, b1;
  smelt_moe_weights w;
} dev_weights;

/* p's x and router weights on the device; dev_all_new: all its weights. */
void dev_weights_new(const mp *p, dev_weights *g);
void dev_all_new(const mp *p, dev_weights *g);
void dev_weights_free(dev_weights *g);

/* The family's relative L2 bounds on the CPU and on CUDA. */
double bound(smelt_dtype dt);
double cuda_bound(smelt_dtype dt);

#endif /* SMELT_TEST_MOE_H */
