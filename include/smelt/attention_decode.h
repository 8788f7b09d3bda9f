/* smelt attention decode: attention of a few new queries per sequence over
 * a paged KV cache (decode and chunked prefill), and the append that
 * writes new keys and values into their pages. The math is the attention
 * forward's (attention.h, SEMANTICS.md "Attention") with Sk the sequence's
 * cache length; the keys and values are read through a block table.
 *
 * Shapes (row-major indices; any non-negative strides, but unit stride along D):
 *   q             [B, Sq, H, D]          o like q      lse [B, H, Sq] (f32, optional)
 *   k_cache, v_cache [num_pages, page_size, Hk, D]   (vLLM / FlashInfer "NHD" pages)
 *   block_table   i32 [B, max_pages]: the pages of sequence b, in order
 *   cache_seqlens i32 [B]: the tokens of sequence b in the cache
 * Cache position p of sequence b is row p % page_size of page
 * block_table[b][p / page_size]. Every sequence has the same Sq (1..64):
 * its queries are the last Sq tokens of its cache_seqlens[b], which already
 * include them (append first). GQA: query head h reads kv head h / (H / Hk).
 *
 * Mask: with causal (the default), query i of sequence b sees positions
 * 0 .. cache_seqlens[b] - Sq + i (attention's bottom-right causal with
 * Sk = cache_seqlens[b]); without, every position below cache_seqlens[b].
 * A query that sees nothing (cache_seqlens[b] < Sq - i) gets O = 0 and
 * LSE = +inf, as in attention.
 *
 * Element types: q, k_cache, v_cache and o share one dtype: f16 or bf16 on
 * CUDA (f32 accumulation); f32 and f64 as well on the CPU (double inside).
 *
 * Device data: block_table and cache_seqlens live in the context's memory.
 * The CPU checks them before writing anything (INVALID_ARGUMENT): every
 * cache_seqlens[b] in [0, max_pages * page_size], every page a sequence
 * uses in [0, num_pages). CUDA does not read them on the host (that would
 * stall the stream); there a length is clamped to [0, max_pages *
 * page_size] and a page id outside [0, num_pages) reads as zeros: wrong
 * results, never an access outside the cache.
 *
 * CUDA: compute capability 8.0 or newer; head dims 64 and 128; any
 * page_size >= 1; q, k_cache, v_cache and o 16-byte aligned (pointers and
 * every stride but D's); B, Hk at most 65535. The keys of a sequence are
 * split over CTAs (flash-decoding) when B × Hk alone would not fill the
 * device; their partial results meet in a workspace from the context's
 * pool and are combined by their LSE.
 *
 * Outputs must not overlap any input or each other.
 */
#ifndef SMELT_ATTENTION_DECODE_H
#define SMELT_ATTENTION_DECODE_H

#include "../smelt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct smelt_attention_decode_desc {
  float scale; /* softmax scale; 0 = 1/sqrt(D). Any other finite value. */
  int causal;  /* 1 (the default): query i sees positions <= cache_seqlens[b] - Sq + i */
} smelt_attention_decode_desc;

/* scale 0 (1/sqrt(D)), causal. */
SMELT_API smelt_attention_decode_desc smelt_attention_decode_desc_default(void);

/* desc may be NULL (the defaults); lse may be NULL when it is not wanted. */
SMELT_API smelt_status smelt_attention_decode_plan(smelt_ctx *ctx, const smelt_attention_decode_desc *desc,
                                                   const smelt_tensor *q, const smelt_tensor *k_cache,
                                                   const smelt_tensor *v_cache, const smelt_tensor *block_table,
                                                   const smelt_tensor *cache_seqlens, const smelt_tensor *o,
                                                   const smelt_tensor *lse, smelt_plan **out);
SMELT_API smelt_status smelt_attention_decode_run(smelt_plan *plan, const smelt_tensor *q, const smelt_tensor *k_cache,
                                                  const smelt_tensor *v_cache, const smelt_tensor *block_table,
                                                  const smelt_tensor *cache_seqlens, const smelt_tensor *o,
                                                  const smelt_tensor *lse);
SMELT_API smelt_status smelt_attention_decode(smelt_ctx *ctx, const smelt_attention_decode_desc *desc,
                                              const smelt_tensor *q, const smelt_tensor *k_cache,
                                              const smelt_tensor *v_cache, const smelt_tensor *block_table,
                                              const smelt_tensor *cache_seqlens, const smelt_tensor *o,
                                              const smelt_tensor *lse);

/* Append: k_new and v_new [B, Snew, Hk, D] (the cache's dtype) go to cache
 * positions cache_seqlens[b] .. cache_seqlens[b] + Snew - 1 of sequence b,
 * through block_table as above. cache_seqlens holds the lengths before the
 * append and is not changed (the caller adds Snew). The positions written
 * must be distinct cache rows (no two sequences sharing a page there).
 * k_cache and v_cache are written in place: they must not overlap each
 * other or an input. Any dtype. The CPU checks cache_seqlens[b] + Snew <=
 * max_pages * page_size and the pages touched (INVALID_ARGUMENT, nothing
 * written); CUDA skips the rows whose position or page is out of range.
 * CUDA: rows of D elements a multiple of 16 bytes, 16-byte aligned
 * pointers and strides (but D's). */
SMELT_API smelt_status smelt_kv_cache_append_plan(smelt_ctx *ctx, const smelt_tensor *k_new, const smelt_tensor *v_new,
                                                  const smelt_tensor *block_table, const smelt_tensor *cache_seqlens,
                                                  const smelt_tensor *k_cache, const smelt_tensor *v_cache,
                                                  smelt_plan **out);
SMELT_API smelt_status smelt_kv_cache_append_run(smelt_plan *plan, const smelt_tensor *k_new, const smelt_tensor *v_new,
                                                 const smelt_tensor *block_table, const smelt_tensor *cache_seqlens,
                                                 const smelt_tensor *k_cache, const smelt_tensor *v_cache);
SMELT_API smelt_status smelt_kv_cache_append(smelt_ctx *ctx, const smelt_tensor *k_new, const smelt_tensor *v_new,
                                             const smelt_tensor *block_table, const smelt_tensor *cache_seqlens,
                                             const smelt_tensor *k_cache, const smelt_tensor *v_cache);

#ifdef __cplusplus
}
#endif

#endif /* SMELT_ATTENTION_DECODE_H */
