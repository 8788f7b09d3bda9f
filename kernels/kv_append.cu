/* smelt_kv_cache_append on CUDA: new key and value rows copied into their
 * cache pages, 16 bytes per thread. The copy moves bytes, so one module
 * serves every dtype: rows are a whole number of 16-byte chunks (the host
 * checks it), strides are in bytes.
 *
 * Row j of sequence b goes to position p = cache_seqlens[b] + j, row
 * p % page_size of page block_table[b][p / page_size]. A row whose position
 * lies past the block table, or whose page id is outside the cache, is
 * skipped: a bad table loses rows, it never writes outside the cache.
 */
#include "smelt_device.cuh"

/* Mirrored byte for byte by smelt__app_kparams in src/cuda/op_kv_append.c. */
typedef struct app_params {
  u64 k, v, kc, vc, table, seqlens;
  i64 k_bs, k_rs, k_hs, v_bs, v_rs, v_hs;       /* bytes */
  i64 kc_ps, kc_rs, kc_hs, vc_ps, vc_rs, vc_hs; /* bytes: page, row in page, head */
  i64 t_bs, t_ps, sl_s;                         /* elements */
  i64 total;                                    /* chunks of one of k and v: B * S * Hk * chunks */
  int B, S, Hk, chunks;
  int pages, page_size, max_pages, pad;
} app_params;

static_assert(sizeof(app_params) == 208, "app_params must match smelt__app_kparams");

extern "C" __global__ void __launch_bounds__(256) kv_append(const app_params P) {
  const i64 n = 2 * P.total;
  for (i64 x = (i64)blockIdx.x * blockDim.x + threadIdx.x; x < n; x += (i64)gridDim.x * blockDim.x) {
    const int w = x >= P.total;
    i64 y = x - (w ? P.total : 0);
    const int c = (int)(y % P.chunks);
    y /= P.chunks;
    const int h = (int)(y % P.Hk);
    y /= P.Hk;
    const int j = (int)(y % P.S), b = (int)(y / P.S);
    const int len = ((const int *)P.seqlens)[(i64)b * P.sl_s];
    const i64 pos = (i64)(len < 0 ? 0 : len) + j;
    if (pos >= (i64)P.max_pages * P.page_size) continue;
    const int page = ((const int *)P.table)[(i64)b * P.t_bs + pos / P.page_size * P.t_ps];
    if (page < 0 || page >= P.pages) continue;
    const char *src = (const char *)(w ? P.v : P.k) + (i64)b * (w ? P.v_bs : P.k_bs) + (i64)j * (w ? P.v_rs : P.k_rs) +
                      (i64)h * (w ? P.v_hs : P.k_hs) + c * 16;
    char *dst = (char *)(w ? P.vc : P.kc) + (i64)page * (w ? P.vc_ps : P.kc_ps) +
                pos % P.page_size * (w ? P.vc_rs : P.kc_rs) + (i64)h * (w ? P.vc_hs : P.kc_hs) + c * 16;
    *(uint4 *)dst = *(const uint4 *)src;
  }
}
