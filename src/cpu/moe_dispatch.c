/* Dispatch and combine on the CPU: permute (expert-major, tokens ascending
 * within an expert), unpermute (a token's k rows summed in slot order in
 * double, rounded once) and their backward. The CPU reads the index
 * tensors before writing anything, so inconsistent ones (an id outside
 * [-1, E), offsets that do not match the ids, a row outside [0, T·k)) are
 * refused with nothing written. */
#include "../core/checked.h"
#include "moe_cpu.h"

#include <stdlib.h>

/* The row map of ids under offsets into rm (T·k entries), checked. */
static smelt_status row_map_of(const smelt__moe_state *ms, const smelt_tensor *ids, const smelt_tensor *offsets,
                               int64_t *rm) {
  int64_t *next = (int64_t *)malloc((size_t)(ms->E + 1) * sizeof(int64_t));
  if (!next) return smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the permutation");
  smelt_status s = smelt__moe_offsets(ms, offsets, next + 1);
  next[0] = 0;
  int64_t *cursor = (int64_t *)calloc((size_t)ms->E, sizeof(int64_t));
  if (!s && !cursor) s = smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the permutation");
  for (int64_t a = 0; !s && a < ms->rows; a++) {
    const int64_t e = smelt__moe_geti(ids, a);
    if (e < -1 || e >= ms->E)
      s = smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": ids[%lld]=%lld must be in [-1, num_experts=%lld)",
                       (long long)a, (long long)e, (long long)ms->E);
    else if (e >= 0 && next[e] + cursor[e] >= next[e + 1])
      s = smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                       MOE_OP ": expert %lld has more assignments in ids than offsets give it (%lld)", (long long)e,
                       (long long)(next[e + 1] - next[e]));
    else rm[a] = e < 0 ? -1 : next[e] + cursor[e]++;
  }
  for (int64_t e = 0; !s && e < ms->E; e++)
    if (cursor[e] != next[e + 1] - next[e])
      s = smelt__error(SMELT_STATUS_INVALID_ARGUMENT,
                       MOE_OP ": expert %lld has %lld assignments in ids but offsets give it %lld", (long long)e,
                       (long long)cursor[e], (long long)(next[e + 1] - next[e]));
  free(next);
  free(cursor);
  return s;
}

/* The row map read from a row_map tensor, checked. */
static smelt_status read_row_map(const smelt__moe_state *ms, const smelt_tensor *row_map, int64_t *rm) {
  for (int64_t a = 0; a < ms->rows; a++) {
    rm[a] = smelt__moe_geti(row_map, a);
    if (rm[a] < -1 || rm[a] >= ms->rows)
      return smelt__error(SMELT_STATUS_INVALID_ARGUMENT, MOE_OP ": row_map[%lld]=%lld must be in [-1, T * top_k=%lld)",
                          (long long)a, (long long)rm[a], (long long)ms->rows);
  }
  return SMELT_OK;
}

static int64_t *rows_alloc(const smelt__moe_state *ms, smelt_status *s) {
  size_t bytes = 0;
  *s = smelt__bytes(ms->rows, sizeof(int64_t), &bytes, MOE_OP, "the row map");
  if (*s) return NULL;
  int64_t *rm = (int64_t *)malloc(bytes ? bytes : 1);
  if (!rm) *s = smelt__error(SMELT_STATUS_OUT_OF_MEMORY, MOE_OP ": no host memory for the row map");
  return rm;
}

smelt_status smelt__moe_cpu_permute(const smelt__moe_state *ms, const smelt_tensor *const *t) {
  smelt_status s;
  int64_t *rm = rows_alloc(ms, &s);
  if (!s) s = row_map_of(ms, t[SMELT__MT_IDS_IN], t[SMELT__MT_OFFSETS_IN], rm);
  for (int64_t a = 0; !s && a < ms->rows; a++) {
    smelt__moe_set(t[SMELT__MT_ROW_MAP], a, (double)rm[a]);
    for (int64_t c = 0; rm[a] >= 0 && c < ms->d; c++)
      smelt__moe_set2(t[SMELT__MT_XP], rm[a], c, smelt__moe_get2(t[SMELT__MT_X], a / ms->k, c));
  }
  free(rm);
  return s;
}

/* out[t] = Σ_i w[t, i] · in[row_map[t, i]] over the kept slots in slot
 * order (w NULL: 1), summed in double. */
static smelt_status combine(const smelt__moe_state *ms, const smelt_tensor *in, const smelt_tensor *row_map,
                            const smelt_tensor *w, const smelt_tensor *out) {
  smelt_status s;
  int64_t *rm = rows_alloc(ms, &s);
  if (!s) s = read_row_map(ms, row_map, rm);
  for (int64_t tk = 0; !s && tk < ms->T; tk++)
    for (int64_t c = 0; c < ms->d; c++) {
      double acc = 0;
      for (int64_t a = tk * ms->k; a < (tk + 1) * ms->k; a++)
        if (rm[a] >= 0) acc += (w ? smelt__moe_get(w, a) : 1.0) * smelt__moe_get2(in, rm[a], c);
      smelt__moe_set2(out, tk, c, acc);
    }
  free(rm);
  return s;
}

smelt_status smelt__moe_cpu_permute_bwd(const smelt__moe_state *ms, const smelt_tensor *const *t) {
  return combine(ms, t[SMELT__MT_DXP_IN], t[SMELT__MT_ROW_MAP_IN], NULL, t[SMELT__MT_DX]);
}

smelt_status smelt__moe_cpu_unpermute(const smelt__moe_state *ms, const smelt_tensor *const *t) {
  return combine(ms, t[SMELT__MT_YP_IN], t[SMELT__MT_ROW_MAP_IN], t[SMELT__MT_WEIGHTS_IN], t[SMELT__MT_Y]);
}

smelt_status smelt__moe_cpu_unpermute_bwd(const smelt__moe_state *ms, const smelt_tensor *const *t) {
  smelt_status s;
  int64_t *rm = rows_alloc(ms, &s);
  if (!s) s = read_row_map(ms, t[SMELT__MT_ROW_MAP_IN], rm);
  for (int64_t a = 0; !s && a < ms->rows; a++) {
    const int64_t tk = a / ms->k;
    const double w = smelt__moe_get(t[SMELT__MT_WEIGHTS_IN], a);
    double dot = 0;
    for (int64_t c = 0; rm[a] >= 0 && c < ms->d; c++) {
      const double g = smelt__moe_get2(t[SMELT__MT_DY_IN], tk, c);
      smelt__moe_set2(t[SMELT__MT_DYP], rm[a], c, w * g);
      dot += g * smelt__moe_get2(t[SMELT__MT_YP_IN], rm[a], c);
    }
    if (t[SMELT__MT_DWEIGHTS]) smelt__moe_set(t[SMELT__MT_DWEIGHTS], a, dot);
  }
  free(rm);
  return s;
}
