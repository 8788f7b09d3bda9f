/* smelt_kv_cache_append on CUDA: kernels/kv_append.cu, one module for
 * every dtype (it copies 16-byte chunks). The plan checks what the copy
 * needs: rows of whole 16-byte chunks, 16-byte aligned pointers and
 * strides; the run launches a grid-stride loop over the chunks of k_new
 * and v_new, at most 32 blocks of 256 threads per SM. */
#include "../core/attn_decode_internal.h"
#include "cuda_internal.h"

#include <stdio.h>
#include <string.h>

/* The host twin of app_params in kernels/kv_append.cu, byte for byte. */
typedef struct smelt__app_kparams {
  uint64_t k, v, kc, vc, table, seqlens;
  int64_t k_bs, k_rs, k_hs, v_bs, v_rs, v_hs;
  int64_t kc_ps, kc_rs, kc_hs, vc_ps, vc_rs, vc_hs;
  int64_t t_bs, t_ps, sl_s;
  int64_t total;
  int B, S, Hk, chunks;
  int pages, page_size, max_pages, pad;
} smelt__app_kparams;

_Static_assert(sizeof(smelt__app_kparams) == 208, "smelt__app_kparams must match app_params");

static void make_src(smelt__kernel_src *src) {
  memset(src, 0, sizeof *src);
  snprintf(src->name, sizeof src->name, "kv_append");
  src->body = "kv_append.cu";
}

int smelt__kv_cache_append_variants(smelt__kernel_src *out, int max) {
  if (max > 0) make_src(&out[0]);
  return 1;
}

static const char *const app_names[] = {"k_new", "v_new", "block_table", "cache_seqlens", "k_cache", "v_cache"};
static const int app_rows[] = {SMELT__APP_K, SMELT__APP_V, SMELT__APP_KC, SMELT__APP_VC};

/* Pointers (planned or bound) and strides but D's of the row tensors in
 * whole 16 bytes, rows too. */
static smelt_status check_layout(const char *op, const smelt_tensor *const *t, int strides) {
  for (int i = 0; i < 4; i++) {
    const smelt_tensor *x = t[app_rows[i]];
    const int64_t es = (int64_t)smelt_dtype_size(x->dtype);
    if (smelt_tensor_numel(x) == 0) continue;
    if (!strides && (uintptr_t)x->data % 16)
      return smelt__error(SMELT_STATUS_MISALIGNED, "%s: %s.data=%p must be aligned to 16 bytes for the CUDA kernel", op,
                          app_names[app_rows[i]], x->data);
    if (!strides) continue;
    if (x->shape[3] * es % 16)
      return smelt__error(SMELT_STATUS_UNSUPPORTED,
                          "%s: %s rows of D=%lld %s elements are not a whole number of 16 bytes (the CUDA copy's unit)",
                          op, app_names[app_rows[i]], (long long)x->shape[3], smelt_dtype_name(x->dtype));
    for (int d = 0; d < 3; d++)
      if (x->shape[d] > 1 && x->strides[d] * es % 16)
        return smelt__error(SMELT_STATUS_UNSUPPORTED,
                            "%s: %s.strides[%d]=%lld: the CUDA copy needs every stride but D's to be a multiple of 16 bytes",
                            op, app_names[app_rows[i]], d, (long long)x->strides[d]);
  }
  return SMELT_OK;
}

static smelt_status plan_append(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const char *op = smelt__family_kv_cache_append.op;
  smelt_status s;
  const smelt_tensor *k = t[SMELT__APP_K];
  if (k->shape[0] > INT32_MAX || k->shape[1] > INT32_MAX || k->shape[2] > INT32_MAX)
    return smelt__error(SMELT_STATUS_UNSUPPORTED, "%s: k_new.shape=[%lld, %lld, %lld, ...]: B, Snew and Hk must be below 2^31 on CUDA",
                        op, (long long)k->shape[0], (long long)k->shape[1], (long long)k->shape[2]);
  if ((s = check_layout(op, t, 1)) || (s = check_layout(op, t, 0))) return s;
  smelt__kernel_src src;
  make_src(&src);
  CUfunction f;
  if ((s = smelt__cuda_function(plan->ctx, &src, "kv_append", &f))) return s;
  plan->func[0] = f;
  plan->block = 256;
  snprintf(plan->describe, sizeof plan->describe, "kv cache append (kv_append.cu, 16-byte copies)");
  return SMELT_OK;
}

static smelt_status run_append(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args;
  const char *op = smelt__family_kv_cache_append.op;
  smelt_status s = check_layout(op, t, 0);
  if (s) return s;
  const smelt_tensor *k = t[SMELT__APP_K], *v = t[SMELT__APP_V], *kc = t[SMELT__APP_KC], *vc = t[SMELT__APP_VC];
  const smelt_tensor *tab = t[SMELT__APP_TABLE], *sl = t[SMELT__APP_SEQLENS];
  const int64_t es = (int64_t)smelt_dtype_size(k->dtype);
  smelt__app_kparams kp;
  memset(&kp, 0, sizeof kp);
  kp.k = (uint64_t)(uintptr_t)k->data, kp.v = (uint64_t)(uintptr_t)v->data;
  kp.kc = (uint64_t)(uintptr_t)kc->data, kp.vc = (uint64_t)(uintptr_t)vc->data;
  kp.table = (uint64_t)(uintptr_t)tab->data, kp.seqlens = (uint64_t)(uintptr_t)sl->data;
  kp.k_bs = k->strides[0] * es, kp.k_rs = k->strides[1] * es, kp.k_hs = k->strides[2] * es;
  kp.v_bs = v->strides[0] * es, kp.v_rs = v->strides[1] * es, kp.v_hs = v->strides[2] * es;
  kp.kc_ps = kc->strides[0] * es, kp.kc_rs = kc->strides[1] * es, kp.kc_hs = kc->strides[2] * es;
  kp.vc_ps = vc->strides[0] * es, kp.vc_rs = vc->strides[1] * es, kp.vc_hs = vc->strides[2] * es;
  kp.t_bs = tab->strides[0], kp.t_ps = tab->strides[1], kp.sl_s = sl->strides[0];
  kp.B = (int)k->shape[0], kp.S = (int)k->shape[1], kp.Hk = (int)k->shape[2];
  kp.chunks = (int)(k->shape[3] * es / 16);
  kp.pages = kc->shape[0] > INT32_MAX ? INT32_MAX : (int)kc->shape[0];
  kp.page_size = (int)kc->shape[1], kp.max_pages = (int)tab->shape[1];
  kp.total = (int64_t)kp.B * kp.S * kp.Hk * kp.chunks;
  if (kp.total == 0) return SMELT_OK;
  const int64_t blocks = smelt__ceil_div(2 * kp.total, 256), cap = (int64_t)plan->ctx->cuda->info.sm_count * 32;
  void *params[] = {&kp};
  smelt__nvtx_push(op);
  s = smelt__cuda_launch(plan->ctx, op, (CUfunction)plan->func[0], (unsigned)(blocks < cap ? blocks : cap), 1, 1, 256, 0,
                         params);
  smelt__nvtx_pop();
  return s;
}

const smelt__backend smelt__cuda_kv_cache_append = {.plan = plan_append, .run = run_append};
