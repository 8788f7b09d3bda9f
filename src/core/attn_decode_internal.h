/* Internals of the paged-cache ops (smelt_attention_decode and
 * smelt_kv_cache_append) shared by the core's checks, the CPU reference
 * and the CUDA backend: the roles, and the geometry every backend reads
 * off the planned tensors the same way. */
#ifndef SMELT_ATTN_DECODE_INTERNAL_H
#define SMELT_ATTN_DECODE_INTERNAL_H

#include "internal.h"

/* smelt_attention_decode's tensors, by role. */
enum { SMELT__DEC_Q, SMELT__DEC_K, SMELT__DEC_V, SMELT__DEC_TABLE, SMELT__DEC_SEQLENS, SMELT__DEC_O, SMELT__DEC_LSE };
/* smelt_kv_cache_append's. */
enum { SMELT__APP_K, SMELT__APP_V, SMELT__APP_TABLE, SMELT__APP_SEQLENS, SMELT__APP_KC, SMELT__APP_VC };

/* The sizes of a call: q (or k_new) [B, Sq, H, D], the caches [pages,
 * page_size, Hk, D], block_table [B, max_pages]. H is Hk for the append. */
typedef struct smelt__paged_geom {
  int64_t B, Sq, H, Hk, D;
  int64_t pages, page_size, max_pages;
} smelt__paged_geom;

/* From the planned views: x is q (decode) or k_new (append), cache a cache. */
void smelt__paged_geom_of(const smelt_tensor *x, const smelt_tensor *cache, const smelt_tensor *table,
                          smelt__paged_geom *g);

/* The checks both ops share (src/core/paged.c): x (q or k_new, named
 * xname) [B, S, heads, D], the caches [pages, page_size, Hk, D] with x's D,
 * block_table [B, max_pages], cache_seqlens [B], max_pages * page_size
 * below 2^31, unit stride along D. */
smelt_status smelt__paged_check_shapes(const char *op, const char *xname, const smelt_tensor *x, const smelt_tensor *kc,
                                       const smelt_tensor *vc, const smelt_tensor *table, const smelt_tensor *seqlens);
/* t's D (dim 3) has unit stride. */
smelt_status smelt__paged_unit_d(const char *op, const char *name, const smelt_tensor *t);

/* The resolved softmax scale of a decode plan (plan->opdata holds the desc). */
double smelt__decode_scale(const smelt_plan *plan);

/* Element i of a 1-D i32 tensor, and (b, j) of a 2-D one (host memory). */
static inline int64_t smelt__i32_at(const smelt_tensor *t, int64_t i) {
  return ((const int32_t *)t->data)[i * t->strides[0]];
}
static inline int64_t smelt__i32_at2(const smelt_tensor *t, int64_t i, int64_t j) {
  return ((const int32_t *)t->data)[i * t->strides[0] + j * t->strides[1]];
}

/* CPU: the block table and lengths of a call hold what the header promises
 * for positions [0, cache_seqlens[b] + extra) of every sequence (extra: the
 * append's Snew, 0 for decode); else INVALID_ARGUMENT naming the entry.
 * *longest (may be NULL): the largest cache_seqlens[b]. */
smelt_status smelt__paged_check_host(const char *op, const smelt__paged_geom *g, const smelt_tensor *table,
                                     const smelt_tensor *seqlens, int64_t extra, int64_t *longest);

#endif /* SMELT_ATTN_DECODE_INTERNAL_H */
