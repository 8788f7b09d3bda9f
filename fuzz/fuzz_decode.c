/* Fuzz entry points for attention decode over a paged KV cache
 * (smelt_attention_decode) and the append into its pages
 * (smelt_kv_cache_append): small batches, pages and heads for the CPU
 * reference; the block table's page ids and the cache lengths are mostly
 * in range and now and then anything (the CPU must refuse those with
 * nothing written); GQA ratios that do and do not divide. */
#include "fuzz.h"

#include <string.h>

/* Page ids in [0, pages) and lengths in [0, cap] (cap = max_pages ·
 * page_size), with a hostile value now and then. */
static void fill_paging(fz *f, const smelt_tensor *table, const smelt_tensor *lens, int64_t pages, int64_t cap) {
  int64_t ids[16], ls[16];
  for (int i = 0; i < 16; i++) {
    ids[i] = fz_one_in(f, 16) ? fz_size(f, 9) : pages > 0 ? fz_u8(f) % pages : 0;
    ls[i] = fz_one_in(f, 16) ? fz_size(f, 40) : cap >= 0 && cap < 256 ? fz_u8(f) % (cap + 1) : fz_u8(f);
  }
  fz_fill_ints(table, ids, 16);
  fz_fill_ints(lens, ls, 16);
}

enum { Q, KC, VC, TAB, LEN, O, LSE, KN, VN, ND };

void fz_attention_decode(fz *f) {
  int64_t d[8] = {fz_size(f, 3), fz_size(f, 3), fz_size(f, 4), fz_size(f, 2), fz_size(f, 8),
                  fz_size(f, 5), fz_size(f, 4), fz_size(f, 3)}; /* B, Sq, H, Hk, D, pages, page_size, max_pages */
  fz_cap_work(d, 8, 4096);
  const int64_t B = d[0], Sq = d[1], H = d[2], Hk = d[3], D = d[4], P = d[5], PS = d[6], MP = d[7];
  const int64_t qs[4] = {B, Sq, H, D}, cs[4] = {P, PS, Hk, D}, ts[2] = {B, MP}, ls[3] = {B, H, Sq}, ns[4] = {B, Sq, Hk, D};
  smelt_attention_decode_desc desc = smelt_attention_decode_desc_default();
  if (fz_u8(f) & 1) desc.scale = (float)fz_double(f);
  if (fz_u8(f) & 1) desc.causal = fz_one_in(f, 8) ? (int)fz_u32(f) : 0;
  const smelt_attention_decode_desc *dp = fz_one_in(f, 16) ? NULL : &desc;
  const smelt_dtype dt = fz_float_dtype(f), it = fz_one_in(f, 16) ? SMELT_DTYPE_I64 : SMELT_DTYPE_I32;
  const int append = fz_u8(f) & 1, with_lse = fz_u8(f) & 1, mode = fz_mode(f);
  unsigned nulls = fz_nulls(f, 4);
  smelt_tensor t[ND];
  memset(t, 0, sizeof t);
  smelt_plan *plan = NULL;
  smelt_status s;
  for (int r = 0; fz_round(r, mode); r++) {
    t[Q] = fz_view(f, dt, 4, qs, 0);
    t[KC] = fz_view(f, dt, 4, cs, append);
    t[VC] = fz_view(f, dt, 4, cs, append);
    t[TAB] = fz_view_plain(f, it, 2, ts, 0);
    t[LEN] = fz_view_plain(f, it, 1, &B, 0);
    fill_paging(f, &t[TAB], &t[LEN], P, fz_mul(MP, PS));
    t[O] = fz_view(f, dt, 4, qs, !append);
    t[LSE] = fz_view(f, SMELT_DTYPE_F32, 3, ls, !append && with_lse);
    t[KN] = fz_view(f, dt, 4, ns, 0);
    t[VN] = fz_view(f, dt, 4, ns, 0);
    const smelt_tensor *a = fz_maybe_null(nulls, t, append ? KN : Q), *kc = fz_maybe_null(nulls >> 1, t, KC),
                       *tab = fz_maybe_null(nulls >> 2, t, TAB), *len = fz_maybe_null(nulls >> 3, t, LEN),
                       *lse = with_lse ? &t[LSE] : NULL;
    if (append) {
      FZ_ROUND(s, r, mode, plan, t, "smelt_kv_cache_append",
               smelt_kv_cache_append(f->ctx, a, &t[VN], tab, len, kc, &t[VC]),
               smelt_kv_cache_append_plan(f->ctx, a, &t[VN], tab, len, kc, &t[VC], &plan),
               smelt_kv_cache_append_run(plan, a, &t[VN], tab, len, kc, &t[VC]));
    } else {
      FZ_ROUND(s, r, mode, plan, t, "smelt_attention_decode",
               smelt_attention_decode(f->ctx, dp, a, kc, &t[VC], tab, len, &t[O], lse),
               smelt_attention_decode_plan(f->ctx, dp, a, kc, &t[VC], tab, len, &t[O], lse, &plan),
               smelt_attention_decode_run(plan, a, kc, &t[VC], tab, len, &t[O], lse));
    }
  }
  smelt_plan_destroy(plan);
}
