/* CPU reference for smelt_kv_cache_append: each new row copied, element by
 * element, to its cache position through the block table, after the table
 * and lengths were checked (nothing is written when they are bad). */
#include "../core/attn_decode_internal.h"

#include <string.h>

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const smelt_tensor *tab = t[SMELT__APP_TABLE];
  smelt__paged_geom g;
  smelt__paged_geom_of(t[SMELT__APP_K], t[SMELT__APP_KC], tab, &g);
  smelt_status s = smelt__paged_check_host(smelt__family_kv_cache_append.op, &g, tab, t[SMELT__APP_SEQLENS], g.Sq, NULL);
  if (s) return s;
  const size_t es = smelt_dtype_size(t[SMELT__APP_K]->dtype);
  (void)plan;
  for (int w = 0; w < 2; w++) {
    const smelt_tensor *x = t[w ? SMELT__APP_V : SMELT__APP_K], *c = t[w ? SMELT__APP_VC : SMELT__APP_KC];
    for (int64_t b = 0; b < g.B; b++) {
      const int64_t len = smelt__i32_at(t[SMELT__APP_SEQLENS], b);
      for (int64_t j = 0; j < g.Sq; j++) {
        const int64_t p = len + j, page = smelt__i32_at2(tab, b, p / g.page_size);
        for (int64_t h = 0; h < g.Hk; h++) {
          const int64_t xo = b * x->strides[0] + j * x->strides[1] + h * x->strides[2];
          const int64_t co = page * c->strides[0] + (p % g.page_size) * c->strides[1] + h * c->strides[2];
          for (int64_t d = 0; d < g.D; d++)
            memcpy((char *)c->data + (size_t)(co + d * c->strides[3]) * es,
                   (const char *)x->data + (size_t)(xo + d * x->strides[3]) * es, es);
        }
      }
    }
  }
  return SMELT_OK;
}

const smelt__backend smelt__cpu_kv_cache_append = {.run = run};
