/* The CPU's check of the paged-cache ops' device data (block table and
 * lengths), which the core cannot see at plan time: done before anything
 * is written, so that a bad table fails the call and changes nothing. */
#include "../core/attn_decode_internal.h"

smelt_status smelt__paged_check_host(const char *op, const smelt__paged_geom *g, const smelt_tensor *table,
                                     const smelt_tensor *seqlens, int64_t extra, int64_t *longest) {
  const int64_t cap = g->max_pages * g->page_size;
  if (longest) *longest = 0;
  for (int64_t b = 0; b < g->B; b++) {
    const int64_t len = smelt__i32_at(seqlens, b);
    if (longest && len > *longest) *longest = len;
    if (len < 0 || len + extra > cap)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                          "%s: cache_seqlens[%lld]=%lld%s must lie in [0, max_pages * page_size = %lld]", op,
                          (long long)b, (long long)len, extra ? " plus the new rows" : "", (long long)cap);
    for (int64_t p = 0; p < smelt__ceil_div(len + extra, g->page_size); p++) {
      const int64_t page = smelt__i32_at2(table, b, p);
      if (page < 0 || page >= g->pages)
        return smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                            "%s: block_table[%lld][%lld]=%lld is not a page of the cache (num_pages=%lld)", op,
                            (long long)b, (long long)p, (long long)page, (long long)g->pages);
    }
  }
  return SMELT_OK;
}
