"""FlashAttention 2's Python entry points, served by smelt.

`flash_attn_func` and friends take the same arguments as in the
flash_attn package (q [B, S, H, D]; packed forms; varlen with cu_seqlens;
the KV-cache call) and call smelt.torch's attention ops, so code written
against FlashAttention (its own test suite included: bench/fa_compat.py
runs it) runs on smelt. What smelt does not offer fails loudly with
NotImplementedError naming the argument, never with a silently different
result: dropout_p > 0, return_attn_probs (FlashAttention returns the
dropout mask and the unnormalized scores), and in flash_attn_with_kvcache
rotary, cache_batch_idx, cache_leftpad, window, softcap and ALiBi.

The differences that remain are FlashAttention's own knobs with no effect
on the result: num_splits is ignored (smelt picks its split-KV count).
"""

import torch

from . import torch as _st
from . import attention_decode as _decode, kv_cache_append as _append

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _unsupported(what):
    raise NotImplementedError("smelt (flash_attn_compat): %s is not supported" % what)


def _common(dropout_p, return_attn_probs):
    if dropout_p:
        _unsupported("dropout_p > 0")
    if return_attn_probs:
        _unsupported("return_attn_probs=True")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [B, Sq, H, D], k and v [B, Sk, Hk, D] -> out [B, Sq, H, D]."""
    _common(dropout_p, return_attn_probs)
    return _st.attention(q, k, v, causal=causal, scale=softmax_scale, window=tuple(window_size), softcap=softcap,
                         alibi_slopes=alibi_slopes, deterministic=deterministic)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """kv [B, Sk, 2, Hk, D]."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv [B, S, 3, H, D]."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q [Tq, H, D], k and v [Tk, Hk, D], cu_seqlens int32 [B + 1]."""
    _common(dropout_p, return_attn_probs)
    if block_table is not None:
        _unsupported("block_table in the varlen call (use flash_attn_with_kvcache)")
    return _st.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                scale=softmax_scale, window=tuple(window_size), softcap=softcap,
                                alibi_slopes=alibi_slopes, deterministic=deterministic)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """kv [Tk, 2, Hk, D]."""
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv [T, 3, H, D]."""
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Decode over a KV cache, FlashAttention's way: k_cache and v_cache
    [B, S_max, Hk, D] (or pages [num_blocks, page_size, Hk, D] with
    block_table [B, max_blocks]); k and v [B, Snew, Hk, D], when given, are
    written into the cache at cache_seqlens (which FlashAttention, and this
    call, leave unchanged) before q attends over cache_seqlens + Snew."""
    for name, val in (("rotary_cos", rotary_cos), ("cache_batch_idx", cache_batch_idx),
                      ("cache_leftpad", cache_leftpad), ("alibi_slopes", alibi_slopes)):
        if val is not None:
            _unsupported(name + " in flash_attn_with_kvcache")
    if tuple(window_size) != (-1, -1) or softcap:
        _unsupported("window_size or softcap in flash_attn_with_kvcache")
    B = q.shape[0]
    if cache_seqlens is None:
        cache_seqlens = torch.full((B,), k_cache.shape[1] if block_table is None else 0, dtype=torch.int32,
                                   device=q.device)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    cache_seqlens = cache_seqlens.to(torch.int32)
    if block_table is None:
        # A contiguous cache is a paged one with one page a sequence.
        block_table = torch.arange(B, dtype=torch.int32, device=q.device).unsqueeze(1)
    block_table = block_table.to(torch.int32)
    lens = cache_seqlens
    if k is not None:
        _append(k, v, block_table, cache_seqlens, k_cache, v_cache)
        lens = cache_seqlens + k.shape[1]
    r = _decode(q, k_cache, v_cache, block_table, lens.to(torch.int32), causal=causal, scale=softmax_scale,
                return_lse=return_softmax_lse)
    return r
