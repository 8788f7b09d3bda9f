/* CPU reference for smelt_topk: each row sorted by (value descending, NaN
 * first, -0 == +0, index ascending) with qsort, the first k kept. Values are
 * copied from x byte for byte (NaN payloads and the sign of zero survive);
 * indices are stored as i32 or i64. */
#include "../core/checked.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int smelt__rank_cmp(const void *pa, const void *pb) {
  const smelt__rank *a = (const smelt__rank *)pa, *b = (const smelt__rank *)pb;
  int an = isnan(a->v), bn = isnan(b->v);
  if (an != bn) return an ? -1 : 1;
  if (!an && a->v != b->v) return a->v > b->v ? -1 : 1;
  return (a->i > b->i) - (a->i < b->i);
}

static smelt_status run(smelt_plan *plan, const void *args) {
  const smelt_tensor *const *t = (const smelt_tensor *const *)args, *x = t[0], *values = t[1], *indices = t[2];
  const int64_t k = plan->p.topk.k;
  const int64_t C = x->shape[x->ndim - 1];
  const int64_t rows = smelt_tensor_numel(x) / C;
  if (rows == 0) return SMELT_OK;
  size_t bytes = 0;
  smelt_status s = smelt__bytes(C, sizeof(smelt__rank), &bytes, "smelt_topk", "a row's scratch");
  if (s) return s;
  smelt__rank *row = (smelt__rank *)malloc(bytes);
  if (!row)
    return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, "smelt_topk: no host memory for a row of %lld", (long long)C);
  const size_t es = smelt_dtype_size(x->dtype);
  for (int64_t r = 0; r < rows; r++) { /* x: [rows, C]; values, indices: [rows, k] */
    for (int64_t j = 0; j < C; j++) {
      row[j].v = smelt__load_f64(x->data, x->dtype, smelt__tensor_offset(x, r * C + j));
      row[j].i = j;
    }
    qsort(row, (size_t)C, sizeof *row, smelt__rank_cmp);
    for (int64_t j = 0; j < k; j++) {
      int64_t src = smelt__tensor_offset(x, r * C + row[j].i), dst = smelt__tensor_offset(values, r * k + j);
      memcpy((char *)values->data + dst * (int64_t)es, (const char *)x->data + src * (int64_t)es, es);
      if (indices)
        smelt__store_f64(indices->data, indices->dtype, smelt__tensor_offset(indices, r * k + j), (double)row[j].i);
    }
  }
  free(row);
  return SMELT_OK;
}

const smelt__backend smelt__cpu_topk = {.run = run};
