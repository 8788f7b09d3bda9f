/* What the two paged-cache ops check alike: the caches, the block table
 * and the lengths against the new rows (q or k_new), and the geometry all
 * backends read off the planned views. */
#include "attn_decode_internal.h"

#include <stdio.h>

void smelt__paged_geom_of(const smelt_tensor *x, const smelt_tensor *cache, const smelt_tensor *table,
                          smelt__paged_geom *g) {
  g->B = x->shape[0];
  g->Sq = x->shape[1];
  g->H = x->shape[2];
  g->D = x->shape[3];
  g->pages = cache->shape[0];
  g->page_size = cache->shape[1];
  g->Hk = cache->shape[2];
  g->max_pages = table->shape[1];
}

static smelt_status want_ndim(const char *op, const char *name, const smelt_tensor *t, int nd, const char *shape) {
  if (t->ndim != nd)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.ndim=%d must be %d (%s)", op, name, t->ndim, nd, shape);
  return SMELT_OK;
}

static smelt_status want_dim(const char *op, const char *name, const smelt_tensor *t, int d, int64_t want,
                             const char *what) {
  if (t->shape[d] != want)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape[%d]=%lld must equal %s=%lld", op, name, d,
                        (long long)t->shape[d], what, (long long)want);
  return SMELT_OK;
}

/* D has unit stride (what every kernel vectorizes over). */
smelt_status smelt__paged_unit_d(const char *op, const char *name, const smelt_tensor *t) {
  if (t->shape[3] > 1 && smelt_tensor_numel(t) > 0 && t->strides[3] != 1)
    return smelt__error(SMELT_STATUS_BAD_LAYOUT, "%s: %s.strides[3]=%lld must be 1 (unit stride along D)", op, name,
                        (long long)t->strides[3]);
  return SMELT_OK;
}

smelt_status smelt__paged_check_shapes(const char *op, const char *xname, const smelt_tensor *x, const smelt_tensor *kc,
                                       const smelt_tensor *vc, const smelt_tensor *table, const smelt_tensor *seqlens) {
  smelt_status s;
  if ((s = want_ndim(op, xname, x, 4, "[B, S, heads, D]")) ||
      (s = want_ndim(op, "k_cache", kc, 4, "[num_pages, page_size, Hk, D]")) ||
      (s = want_ndim(op, "v_cache", vc, 4, "[num_pages, page_size, Hk, D]")) ||
      (s = want_ndim(op, "block_table", table, 2, "[B, max_pages]")) ||
      (s = want_ndim(op, "cache_seqlens", seqlens, 1, "[B]")))
    return s;
  if ((s = smelt__check_same_shape(op, "k_cache", kc, "v_cache", vc))) return s;
  if (x->shape[3] < 1) return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: %s.shape[3]=0 (head dim D) must be >= 1", op, xname);
  if (kc->shape[2] < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: k_cache.shape[2]=0 (kv heads Hk) must be >= 1", op);
  if (kc->shape[1] < 1)
    return smelt__error(SMELT_STATUS_SHAPE_MISMATCH, "%s: k_cache.shape[1]=0 (page_size) must be >= 1", op);
  if ((s = want_dim(op, "k_cache", kc, 3, x->shape[3], "the head dim D")) ||
      (s = want_dim(op, "block_table", table, 0, x->shape[0], "the batch B")) ||
      (s = want_dim(op, "cache_seqlens", seqlens, 0, x->shape[0], "the batch B")))
    return s;
  if (table->shape[1] > 0 && kc->shape[1] > INT32_MAX / table->shape[1])
    return smelt__error(SMELT_STATUS_UNSUPPORTED,
                        "%s: max_pages * page_size = %lld * %lld must stay below 2^31 (cache_seqlens are int32)", op,
                        (long long)table->shape[1], (long long)kc->shape[1]);
  if ((s = smelt__paged_unit_d(op, xname, x)) || (s = smelt__paged_unit_d(op, "k_cache", kc)) ||
      (s = smelt__paged_unit_d(op, "v_cache", vc)))
    return s;
  return SMELT_OK;
}
