/* A MoE routing's statistics from its counts and dropped tensors in host
 * memory: what smelt_moe_stats_get and the layer's forward report, shared
 * by the backends (CUDA copies the two tensors to the host first). */
#include "moe_internal.h"

#include <string.h>

void smelt__moe_stats_of(const smelt__moe_state *ms, const smelt_tensor *counts, const smelt_tensor *dropped,
                         smelt_moe_stats *st) {
  memset(st, 0, sizeof *st);
  st->tokens = ms->T;
  st->assignments = ms->rows;
  st->min_count = INT64_MAX;
  for (int64_t e = 0; e < ms->E; e++) {
    const int64_t c = (int64_t)smelt__load_f64(counts->data, counts->dtype, smelt__tensor_offset(counts, e));
    st->kept += c;
    st->max_count = c > st->max_count ? c : st->max_count;
    st->min_count = c < st->min_count ? c : st->min_count;
    st->empty_experts += c == 0;
  }
  st->dropped = dropped ? (int64_t)smelt__load_f64(dropped->data, dropped->dtype, 0) : ms->rows - st->kept;
  st->imbalance = st->kept ? (double)st->max_count * (double)ms->E / (double)st->kept : 0.0;
}
