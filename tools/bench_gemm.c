/* Bench op `gemm`: D = epilogue(alpha · A @ B + beta · C) in every dtype,
 * layout, epilogue and mode smelt_gemm has, timed the way the GEMM targets
 * (docs/PERF.md) are judged: random data (never zeros), one plan, the run call
 * between device events, inputs rotated past L2, median of many runs, and
 * TFLOP/s counted as 2·M·N·K per problem (summed over groups and batches).
 * --check compares one run against the CPU backend on windows of the output
 * (all of it when the problem is small), so a fast but wrong kernel never
 * reaches a results table.
 *
 * Memory of one set, as a model lays it out:
 *   A [M, K]  row-major (layout letter 1 = R) or column-major (C)
 *   B [K, N]  row-major (letter 2 = R) or column-major (C): "RC" is a linear
 *             layer's x @ W^T with W stored [N, K], the layout cuBLAS
 *             benchmarks quote as "TN"
 *   C, D [M, N] row-major; bias [N]
 *   --rowwise: f32 row scales of A [M] and column scales of B [N]
 *             (smelt_gemm_scales, torch._scaled_mm's row-wise form)
 * Batched operands are stacked densely ([L, M, K] ...). Grouped problems are
 * stacked as MoE expert GEMMs keep them: A and D along rows (tokens sorted by
 * expert), one B [K, N] per group. --group-offs runs them as
 * smelt_gemm_grouped_offs: the same memory as one stacked A [rows, K] and D,
 * B [G, K, N], bias and column scales [G, N], the row counts in a device tensor of int32
 * offsets (device scheduling; the host's plan never sees them). The CPU
 * backend has no tensor cores:
 * tf32 there is exact f32, which is also what the check compares against.
 * --autotune runs smelt_gemm_autotune on the problem first (its table goes
 * to stderr) and then times the plan that takes the recorded winner.
 * --epi-graph runs a plain GEMM's bias + activation as an epilogue graph
 * (smelt/epilogue.h) that also stores acc + bias (D's dtype, [M, N]) and a
 * row abs-max of D's values (f32 [M]): a layer's forward keeping what its
 * backward and an fp8 quantizer need. Its --check compares D with the
 * fixed epilogue's on the CPU (the same function). */
#include "bench.h"
#include "core/error_bound.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int64_t opt_m = 4096, opt_n = 4096, opt_k = 4096, opt_batch = 1, opt_groups = 0, opt_split_k = 0;
static const char *opt_dtype = "bf16", *opt_out_dtype = NULL, *opt_layout = "RC", *opt_epilogue = "none";
static const char *opt_alpha = "1", *opt_beta = "0", *opt_split_mode = NULL, *opt_opclass = "auto";
static const char *opt_tile = NULL, *opt_cluster = NULL, *opt_group_ms = NULL;
static int opt_check, opt_autotune, opt_group_offs, opt_rowwise, opt_epi_graph;

static const cli_opt options[] = {
    {"m", CLI_OPT_INT, &opt_m, "M", "rows of A and D (per group) (default 4096)"},
    {"n", CLI_OPT_INT, &opt_n, "N", "columns of B and D (default 4096)"},
    {"k", CLI_OPT_INT, &opt_k, "K", "inner dimension (default 4096)"},
    {"dtype", CLI_OPT_STRING, &opt_dtype, "DT",
     "A and B: bf16, f16, f32, tf32, 3xtf32, f64, e4m3, e5m2, i8 (default bf16)"},
    {"out-dtype", CLI_OPT_STRING, &opt_out_dtype, "DT",
     "C and D (default: the input type; bf16 for fp8, i32 for i8, f32 for tf32)"},
    {"layout", CLI_OPT_STRING, &opt_layout, "XY", "A and B row- (R) or column-major (C): RR, RC, CR, CC (default RC)"},
    {"epilogue", CLI_OPT_STRING, &opt_epilogue, "E",
     "none, bias, ACT or bias+ACT; ACT = relu, gelu, gelu_tanh, silu, ... (default none)"},
    {"alpha", CLI_OPT_STRING, &opt_alpha, "X", "scale of A @ B (default 1)"},
    {"beta", CLI_OPT_STRING, &opt_beta, "X", "scale of C; 0 leaves C out (default 0)"},
    {"split-k", CLI_OPT_INT, &opt_split_k, "S", "slices of K, 1 = none (default 0: smelt chooses)"},
    {"split-k-mode", CLI_OPT_STRING, &opt_split_mode, "MODE", "serial or parallel (default: AUTO mode)"},
    {"opclass", CLI_OPT_STRING, &opt_opclass, "OC", "auto, simt or tensorop (default auto)"},
    {"tile", CLI_OPT_STRING, &opt_tile, "MxNxK[sS]", "threadblock tile (and stages S) to ask for (default: smelt chooses)"},
    {"cluster", CLI_OPT_STRING, &opt_cluster, "MxN", "thread block cluster to ask for, e.g. 2x1 (default: smelt chooses)"},
    {"batch", CLI_OPT_INT, &opt_batch, "L", "batched GEMM of L problems, strided (default 1: plain)"},
    {"groups", CLI_OPT_INT, &opt_groups, "G", "grouped GEMM of G problems of M x N x K (default 0: not grouped)"},
    {"group-ms", CLI_OPT_STRING, &opt_group_ms, "M1,M2,..",
     "grouped GEMM with these rows per group, sharing N and K"},
    {"group-offs", CLI_OPT_FLAG, &opt_group_offs, NULL,
     "grouped GEMM scheduled on the device from int32 row offsets (smelt_gemm_grouped_offs; A row-major)"},
    {"rowwise", CLI_OPT_FLAG, &opt_rowwise, NULL,
     "f32 row scales of A [M] and column scales of B [N] (per group with --group-offs) instead of per-tensor ones"},
    {"epi-graph", CLI_OPT_FLAG, &opt_epi_graph, NULL,
     "--epilogue bias+ACT as an epilogue graph that also stores acc + bias and a row abs-max (plain GEMMs)"},
    {"check", CLI_OPT_FLAG, &opt_check, NULL, "compare one run against the CPU backend (windows of D)"},
    {"autotune", CLI_OPT_FLAG, &opt_autotune, NULL,
     "time every candidate kernel first (table on stderr), record the winner in the cache folder, then bench the "
     "plan that uses it"},
    {NULL, CLI_OPT_FLAG, NULL, NULL, NULL},
};

/* Problems whose M x N x K is at most this are checked whole; larger ones
 * on two windows (the first and the last rows and columns, so the ragged
 * edge tiles are covered). */
#define CHECK_WHOLE_MACS ((int64_t)1 << 24)
#define CHECK_WINDOW 64
#define MAX_ELEMS ((int64_t)1 << 36)

static struct {
  smelt_gemm_desc desc;
  smelt_dtype dt_a, dt_b, dt_d, dt_bias; /* C has D's dtype */
  int a_col, b_col, has_bias, has_c, grouped;
  int64_t count;     /* problems: the groups, or 1 */
  int64_t batch;     /* L of a batched GEMM; 0 for 2-D operands */
  int64_t *ms, *row0; /* per problem: rows, and first row in the stacked A, C, D */
  int64_t rows;      /* sum of ms */
  size_t a_elems, b_elems, cd_elems, bias_elems; /* per set */
  size_t sa_elems, sb_elems; /* --rowwise: rows of A, columns of B (per group) */
  smelt_ctx *ctx;
  int sets;
  void **A, **B, **C, **D, **bias;
  void **SA, **SB; /* --rowwise */
  void **offs; /* --group-offs: int32 [count] cumulative row ends, one buffer */
  void **PRE, **AMAX;   /* --epi-graph: acc + bias [M, N] (D's dtype), row abs-max [M] (f32) */
  smelt_epi_graph graph; /* --epi-graph */
  smelt_tensor *ta, *tb, *tc, *td, *tbias; /* one view per problem, rebound per run */
  smelt_plan *plan;
} st;

/* ---------------------------------------------------------------- options */

static double parse_double(const cli_doc *doc, const char *name, const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end != '\0' || !isfinite(v))
    cli_usage_error(doc->command, "--%s: '%s' is not a finite number", name, s);
  return v;
}

static void parse_dtypes(const cli_doc *doc) {
  static const smelt_dtype in[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16,  SMELT_DTYPE_F32, SMELT_DTYPE_F64,
                                   SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2, SMELT_DTYPE_I8};
  static const smelt_dtype out[] = {SMELT_DTYPE_BF16, SMELT_DTYPE_F16,  SMELT_DTYPE_F32, SMELT_DTYPE_F64,
                                    SMELT_DTYPE_E4M3, SMELT_DTYPE_E5M2, SMELT_DTYPE_I8,  SMELT_DTYPE_I32};
  if (strcmp(opt_dtype, "tf32") == 0 || strcmp(opt_dtype, "3xtf32") == 0) {
    st.dt_a = SMELT_DTYPE_F32;
    st.desc.math.op = opt_dtype[0] == 't' ? SMELT_GEMM_MATH_TF32 : SMELT_GEMM_MATH_3XTF32;
  } else {
    smelt_dtype dt;
    int ok = smelt_dtype_from_name(opt_dtype, &dt) == SMELT_OK;
    for (int i = 0; ok && i < (int)(sizeof in / sizeof in[0]); i++)
      if (in[i] == dt) ok = 2;
    if (ok != 2)
      cli_usage_error(doc->command, "--dtype '%s' is not one of: bf16, f16, f32, tf32, 3xtf32, f64, e4m3, e5m2, i8",
                      opt_dtype);
    st.dt_a = dt;
  }
  st.dt_b = st.dt_a;
  if (opt_out_dtype)
    st.dt_d = cli_require_dtype(doc, "out-dtype", opt_out_dtype, out, (int)(sizeof out / sizeof out[0]));
  else
    st.dt_d = st.dt_a == SMELT_DTYPE_E4M3 || st.dt_a == SMELT_DTYPE_E5M2 ? SMELT_DTYPE_BF16
           : st.dt_a == SMELT_DTYPE_I8                             ? SMELT_DTYPE_I32
                                                                : st.dt_a;
  /* The bias a model would keep: the output's type when it is a float of 16
   * bits or more, i32 beside an integer accumulator, else f32. */
  if (st.dt_a == SMELT_DTYPE_I8) st.dt_bias = SMELT_DTYPE_I32;
  else if (st.dt_d == SMELT_DTYPE_F64 || st.dt_d == SMELT_DTYPE_F32 || st.dt_d == SMELT_DTYPE_F16 ||
           st.dt_d == SMELT_DTYPE_BF16)
    st.dt_bias = st.dt_d;
  else st.dt_bias = SMELT_DTYPE_F32;
}

static void parse_epilogue(const cli_doc *doc) {
  smelt_gemm_epilogue *e = &st.desc.epilogue;
  const char *s = opt_epilogue;
  if (strcmp(s, "none") == 0) return;
  if (strncmp(s, "bias", 4) == 0 && (s[4] == '\0' || s[4] == '+')) {
    st.has_bias = 1;
    s += s[4] ? 5 : 4;
  }
  if (*s && smelt_act_from_name(s, &e->act) != SMELT_OK)
    cli_usage_error(doc->command, "--epilogue '%s': '%s' is not an activation smelt knows", opt_epilogue, s);
}

static void parse_mode(const cli_doc *doc) {
  smelt_gemm_desc *d = &st.desc;
  cli_require_range(doc, "split-k", opt_split_k, 0, SMELT_GEMM_MAX_SPLIT_K);
  d->split_k = (int)opt_split_k;
  if (opt_split_mode) {
    if (strcmp(opt_split_mode, "serial") == 0) d->mode = SMELT_GEMM_MODE_SPLIT_K_SERIAL;
    else if (strcmp(opt_split_mode, "parallel") == 0) d->mode = SMELT_GEMM_MODE_SPLIT_K_PARALLEL;
    else cli_usage_error(doc->command, "--split-k-mode '%s' is not one of: serial, parallel", opt_split_mode);
  }
  if (strcmp(opt_opclass, "auto") == 0) d->math.opclass = SMELT_GEMM_OPCLASS_AUTO;
  else if (strcmp(opt_opclass, "simt") == 0) d->math.opclass = SMELT_GEMM_OPCLASS_SIMT;
  else if (strcmp(opt_opclass, "tensorop") == 0) d->math.opclass = SMELT_GEMM_OPCLASS_TENSOR_OP;
  else cli_usage_error(doc->command, "--opclass '%s' is not one of: auto, simt, tensorop", opt_opclass);
  if (opt_tile) {
    int used = 0, used_s = 0;
    int ok = sscanf(opt_tile, "%dx%dx%d%n", &d->tile.m, &d->tile.n, &d->tile.k, &used) == 3 && d->tile.m >= 1 &&
             d->tile.n >= 1 && d->tile.k >= 1;
    if (ok && opt_tile[used] == 's') {
      ok = sscanf(opt_tile + used + 1, "%d%n", &d->tile.stages, &used_s) == 1 && d->tile.stages >= 1;
      used += 1 + used_s;
    }
    if (!ok || opt_tile[used] != '\0')
      cli_usage_error(doc->command, "--tile '%s' is not MxNxK or MxNxKsS (e.g. 128x256x64, 128x256x64s3)", opt_tile);
  }
  if (opt_cluster) {
    int used = 0;
    if (sscanf(opt_cluster, "%dx%d%n", &d->tile.cluster_m, &d->tile.cluster_n, &used) != 2 ||
        opt_cluster[used] != '\0' || d->tile.cluster_m < 1 || d->tile.cluster_n < 1)
      cli_usage_error(doc->command, "--cluster '%s' is not MxN (e.g. 2x1)", opt_cluster);
  }
  int split = opt_split_mode || opt_split_k > 1;
  if ((opt_batch > 1 || st.grouped) && split)
    cli_usage_error(doc->command, "split-K serves plain GEMMs only (not --batch or grouped)");
  if (opt_batch > 1 && st.grouped) cli_usage_error(doc->command, "--batch and grouped mode do not combine");
  if (opt_rowwise && st.grouped && !opt_group_offs)
    cli_usage_error(doc->command, "--rowwise takes plain, batched or --group-offs GEMMs (grouped ones take no scales)");
  if (opt_rowwise && opt_autotune) cli_usage_error(doc->command, "--rowwise and --autotune do not combine");
  if (opt_autotune && st.grouped)
    cli_usage_error(doc->command, "--autotune tunes plain, split-K and batched GEMMs, not grouped ones");
  if (opt_group_offs && !st.grouped) cli_usage_error(doc->command, "--group-offs needs --groups or --group-ms");
  if (opt_group_offs && st.rows > 0x7fffffff)
    cli_usage_error(doc->command, "--group-offs: %lld rows do not fit its int32 offsets", (long long)st.rows);
  if (opt_group_offs) d->mode = SMELT_GEMM_MODE_GROUPED_OFFS;
  else if (st.grouped) d->mode = SMELT_GEMM_MODE_GROUPED;
  else if (opt_batch > 1) d->mode = SMELT_GEMM_MODE_BATCHED;
}

/* Rows per problem: --group-ms, or --groups copies of --m, or one --m. */
static void parse_groups(const cli_doc *doc) {
  cli_require_range(doc, "groups", opt_groups, 0, 1 << 20);
  if (opt_group_ms) {
    int64_t n = 1;
    for (const char *p = opt_group_ms; *p; p++) n += *p == ',';
    st.ms = cli_malloc((size_t)n * sizeof *st.ms);
    const char *p = opt_group_ms;
    for (int64_t g = 0; g < n; g++) {
      char *end;
      long long v = strtoll(p, &end, 10);
      if (end == p || (*end != ',' && *end != '\0') || v < 0 || v > ((int64_t)1 << 31))
        cli_usage_error(doc->command, "--group-ms: group %lld is not a row count in [0, 2^31]", (long long)g);
      st.ms[g] = v;
      p = *end ? end + 1 : end;
    }
    if (opt_groups && opt_groups != n)
      cli_usage_error(doc->command, "--groups %lld disagrees with the %lld values of --group-ms", (long long)opt_groups,
                      (long long)n);
    st.count = n;
    st.grouped = 1;
  } else {
    st.count = opt_groups ? opt_groups : 1;
    st.grouped = opt_groups > 0;
    st.ms = cli_malloc((size_t)st.count * sizeof *st.ms);
    for (int64_t g = 0; g < st.count; g++) st.ms[g] = opt_m;
  }
  st.row0 = cli_malloc((size_t)st.count * sizeof *st.row0);
  st.rows = 0;
  for (int64_t g = 0; g < st.count; g++) {
    st.row0[g] = st.rows;
    st.rows += st.ms[g];
  }
  if (st.rows == 0) cli_usage_error(doc->command, "every group is empty: nothing to time");
}

static const char *mode_name(void) {
  switch (st.desc.mode) {
    case SMELT_GEMM_MODE_GROUPED: return "grouped";
    case SMELT_GEMM_MODE_GROUPED_OFFS: return "grouped_offs";
    case SMELT_GEMM_MODE_BATCHED: return "batched";
    case SMELT_GEMM_MODE_SPLIT_K_SERIAL: return "split_k_serial";
    case SMELT_GEMM_MODE_SPLIT_K_PARALLEL: return "split_k_parallel";
    default: return st.desc.split_k > 1 ? "split_k_parallel" : st.desc.split_k == 1 ? "plain" : "auto";
  }
}

static const char *opclass_name(void) {
  static const char *const names[] = {"auto", "simt", "tensorop"};
  return names[st.desc.math.opclass];
}

static void describe(const cli_doc *doc, cli_bench_case *c) {
  st.desc = smelt_gemm_desc_default();
  cli_require_range(doc, "m", opt_m, 1, (int64_t)1 << 31);
  cli_require_range(doc, "n", opt_n, 1, (int64_t)1 << 31);
  cli_require_range(doc, "k", opt_k, 1, (int64_t)1 << 31);
  cli_require_range(doc, "batch", opt_batch, 1, 1 << 20);
  parse_dtypes(doc);
  parse_epilogue(doc);
  parse_groups(doc);
  parse_mode(doc);
  if (strlen(opt_layout) != 2 || !strchr("RC", opt_layout[0]) || !strchr("RC", opt_layout[1]))
    cli_usage_error(doc->command, "--layout '%s' is not one of: RR, RC, CR, CC", opt_layout);
  st.a_col = opt_layout[0] == 'C';
  if (opt_group_offs && st.a_col)
    cli_usage_error(doc->command, "--group-offs stacks A by rows: --layout must be RR or RC");
  st.b_col = opt_layout[1] == 'C';
  smelt_gemm_epilogue *e = &st.desc.epilogue;
  e->alpha = parse_double(doc, "alpha", opt_alpha);
  e->beta = parse_double(doc, "beta", opt_beta);
  st.has_c = e->beta != 0.0;
  if ((st.dt_a == SMELT_DTYPE_E4M3 || st.dt_a == SMELT_DTYPE_E5M2) && !opt_rowwise) {
    /* Per-tensor scales as fp8 training sets them; their product is not 1,
     * so a kernel that ignored both would show in --check. */
    e->scale_a = 0.5f;
    e->scale_b = 0.25f;
  }
  st.batch = opt_batch > 1 ? opt_batch : 0;
  const int64_t L = opt_batch, N = opt_n, K = opt_k;
  if (st.rows > MAX_ELEMS / K / L || st.rows > MAX_ELEMS / N / L || K > MAX_ELEMS / N / L / st.count)
    cli_usage_error(doc->command, "an operand exceeds 2^36 elements");
  st.a_elems = (size_t)(L * st.rows * K);
  st.b_elems = (size_t)(L * st.count * K * N);
  st.cd_elems = (size_t)(L * st.rows * N);
  st.bias_elems = (size_t)(st.grouped ? st.count * N : N);
  st.sa_elems = opt_rowwise ? (size_t)st.rows : 0;
  st.sb_elems = opt_rowwise ? st.bias_elems : 0;
  c->set_bytes = st.a_elems * smelt_dtype_size(st.dt_a) + st.b_elems * smelt_dtype_size(st.dt_b) +
                 st.cd_elems * smelt_dtype_size(st.dt_d) * (st.has_c ? 2 : 1) +
                 (st.has_bias ? st.bias_elems * smelt_dtype_size(st.dt_bias) : 0) +
                 (st.sa_elems + st.sb_elems) * sizeof(float);
  if (opt_epi_graph) {
    if (st.grouped || L > 1 || !st.has_bias || opt_rowwise || opt_autotune || opt_split_k > 1)
      cli_usage_error(doc->command, "--epi-graph takes a plain GEMM with --epilogue bias or bias+ACT (no --rowwise, "
                                    "--autotune or split-K)");
    c->set_bytes += st.cd_elems * smelt_dtype_size(st.dt_d) + (size_t)st.rows * sizeof(float);
  }
  c->traffic_bytes = c->set_bytes;
  c->flops = 2.0 * (double)st.rows * (double)N * (double)K * (double)L;

  /* "m" is the rows of each problem; with uneven groups, all the rows. */
  const int64_t m = opt_group_ms ? st.rows : opt_m;
  char extra[160] = "", tile[48] = "auto";
  if (opt_tile) snprintf(tile, sizeof tile, "%dx%dx%d", st.desc.tile.m, st.desc.tile.n, st.desc.tile.k);
  size_t len = 0;
  if (L > 1) len += (size_t)snprintf(extra + len, sizeof extra - len, " batch=%lld", (long long)L);
  if (st.grouped)
    len += (size_t)snprintf(extra + len, sizeof extra - len, " groups=%lld rows=%lld%s", (long long)st.count,
                            (long long)st.rows, opt_group_ms ? " (uneven)" : "");
  if (e->alpha != 1.0 || e->beta != 0.0)
    len += (size_t)snprintf(extra + len, sizeof extra - len, " alpha=%g beta=%g", e->alpha, e->beta);
  if (opt_split_k) len += (size_t)snprintf(extra + len, sizeof extra - len, " split_k=%lld", (long long)opt_split_k);
  if (st.desc.math.opclass) len += (size_t)snprintf(extra + len, sizeof extra - len, " opclass=%s", opclass_name());
  if (opt_tile) len += (size_t)snprintf(extra + len, sizeof extra - len, " tile=%s", tile);
  if (opt_cluster) len += (size_t)snprintf(extra + len, sizeof extra - len, " cluster=%s", opt_cluster);
  if (opt_rowwise) len += (size_t)snprintf(extra + len, sizeof extra - len, " rowwise");
  if (opt_epi_graph) snprintf(extra + len, sizeof extra - len, " epi-graph");
  snprintf(c->params_text, sizeof c->params_text,
           "m=%lld n=%lld k=%lld dtype=%s out=%s layout=%s epilogue=%s mode=%s%s",
           (long long)m, (long long)N, (long long)K, opt_dtype, smelt_dtype_name(st.dt_d), opt_layout, opt_epilogue,
           mode_name(), extra);
  snprintf(c->params_json, sizeof c->params_json,
           "\"m\":%lld,\"n\":%lld,\"k\":%lld,\"batch\":%lld,\"groups\":%lld,\"rows\":%lld,\"dtype\":\"%s\","
           "\"out_dtype\":\"%s\",\"layout\":\"%s\",\"epilogue\":\"%s\",\"alpha\":%.17g,\"beta\":%.17g,"
           "\"mode\":\"%s\",\"split_k\":%lld,\"opclass\":\"%s\",\"tile\":\"%s\",\"rowwise\":%d,\"epi_graph\":%d",
           (long long)m, (long long)N, (long long)K, (long long)L, (long long)(st.grouped ? st.count : 0),
           (long long)st.rows, opt_dtype, smelt_dtype_name(st.dt_d), opt_layout, opt_epilogue, e->alpha, e->beta,
           mode_name(), (long long)opt_split_k, opclass_name(), tile, opt_rowwise, opt_epi_graph);
}

/* ---------------------------------------------------------------- data */

/* Seeded random values of any operand dtype: uniform floats in [lo, hi)
 * (fp8 through f32 in chunks), every i8, i32 in [-1000, 1000]. */
static void fill(void *buf, smelt_dtype dt, size_t n, uint64_t seed, double lo, double hi) {
  enum { CHUNK = 1 << 16 };
  switch (dt) {
    case SMELT_DTYPE_I8: cli_fill_bytes(buf, n, seed); return;
    case SMELT_DTYPE_I32: {
      cli_fill_bytes(buf, n * sizeof(int32_t), seed);
      int32_t *p = buf;
      for (size_t i = 0; i < n; i++) p[i] = (int32_t)((uint32_t)p[i] % 2001u) - 1000;
      return;
    }
    case SMELT_DTYPE_E4M3:
    case SMELT_DTYPE_E5M2: {
      float *tmp = cli_malloc(CHUNK * sizeof *tmp);
      uint8_t *p = buf;
      for (size_t i = 0; i < n; i += CHUNK) {
        size_t len = n - i < CHUNK ? n - i : CHUNK;
        cli_fill_uniform(tmp, SMELT_DTYPE_F32, len, seed + i, lo, hi);
        for (size_t j = 0; j < len; j++)
          p[i + j] = dt == SMELT_DTYPE_E4M3 ? smelt_f32_to_e4m3(tmp[j]) : smelt_f32_to_e5m2(tmp[j]);
      }
      free(tmp);
      return;
    }
    default: cli_fill_uniform(buf, dt, n, seed, lo, hi); return;
  }
}

/* Element i of a host buffer of any output dtype, as a double. */
static double load(const void *buf, smelt_dtype dt, size_t i) {
  switch (dt) {
    case SMELT_DTYPE_E4M3: return smelt_e4m3_to_f32(((const uint8_t *)buf)[i]);
    case SMELT_DTYPE_E5M2: return smelt_e5m2_to_f32(((const uint8_t *)buf)[i]);
    case SMELT_DTYPE_I8: return ((const int8_t *)buf)[i];
    default: return cli_load(buf, dt, i);
  }
}

/* A view of `rows` x `cols` at element `off` of base, with a leading batch
 * dimension when st.batch > 0. */
static smelt_tensor view(smelt_device_kind dev, int index, void *base, smelt_dtype dt, size_t off, int64_t rows,
                         int64_t cols, int64_t rs, int64_t cs, int64_t bs) {
  const int b = st.batch > 0;
  int64_t shape[3] = {st.batch, rows, cols};
  smelt_tensor t = smelt_tensor_make((char *)base + off * smelt_dtype_size(dt), dt, dev, index, 2 + b, shape + !b);
  t.strides[b] = rs;
  t.strides[b + 1] = cs;
  if (b) t.strides[0] = bs;
  return t;
}

/* Problem g's operands in buffers a, b, c, d, bias (c, d, bias may be NULL:
 * their views are then left alone). */
static void views_of(smelt_device_kind dev, int index, void *a, void *b, void *c, void *d, void *bias, int64_t g,
                     smelt_tensor *ta, smelt_tensor *tb, smelt_tensor *tc, smelt_tensor *td, smelt_tensor *tbias) {
  const int64_t M = st.ms[g], N = opt_n, K = opt_k, r0 = st.row0[g];
  const int64_t lda = M > 0 ? M : 1;
  *ta = view(dev, index, a, st.dt_a, (size_t)(r0 * K), M, K, st.a_col ? 1 : K, st.a_col ? lda : 1, st.rows * K);
  *tb = view(dev, index, b, st.dt_b, (size_t)(g * K * N), K, N, st.b_col ? 1 : N, st.b_col ? K : 1, K * N);
  if (c) *tc = view(dev, index, c, st.dt_d, (size_t)(r0 * N), M, N, N, 1, st.rows * N);
  if (d) *td = view(dev, index, d, st.dt_d, (size_t)(r0 * N), M, N, N, 1, st.rows * N);
  if (bias) {
    int64_t shape[1] = {N};
    const size_t off = (size_t)((st.grouped ? g : 0) * N) * smelt_dtype_size(st.dt_bias);
    *tbias = smelt_tensor_make((char *)bias + off, st.dt_bias, dev, index, 1, shape);
  }
}

/* --rowwise: the row scales of problem g's rows r0 .. r0 + rows - 1 and
 * the column scales of its columns c0 .. c0 + cols - 1 in buffers sa, sb
 * (--group-offs: all rows, sb [G, N]; g < 0). */
static smelt_gemm_scales scales_of(smelt_device_kind dev, int index, void *sa, void *sb, int64_t g, int64_t r0,
                                   int64_t rows, int64_t c0, int64_t cols, smelt_tensor *tsa, smelt_tensor *tsb) {
  const int64_t N = opt_n, G = st.count;
  int64_t va[1] = {rows}, vb[1] = {cols}, gb[2] = {G, N};
  *tsa = smelt_tensor_make((float *)sa + (g >= 0 ? st.row0[g] : 0) + r0, SMELT_DTYPE_F32, dev, index, 1, va);
  if (g >= 0) *tsb = smelt_tensor_make((float *)sb + (st.grouped ? g * N : 0) + c0, SMELT_DTYPE_F32, dev, index, 1, vb);
  else *tsb = smelt_tensor_make(sb, SMELT_DTYPE_F32, dev, index, 2, gb);
  return (smelt_gemm_scales){tsa, tsb};
}

/* Binds every problem's views to set `set`. */
static void bind(int set) {
  smelt_device_kind dev = smelt_ctx_device(st.ctx);
  int index = smelt_ctx_device_index(st.ctx);
  for (int64_t g = 0; g < st.count; g++)
    views_of(dev, index, st.A[set], st.B[set], st.has_c ? st.C[set] : NULL, st.D[set],
             st.has_bias ? st.bias[set] : NULL, g, &st.ta[g], &st.tb[g], &st.tc[g], &st.td[g], &st.tbias[g]);
}

/* --group-offs: the stacked views of set `set` (A, C, D [rows, ...], B
 * [G, K, N], bias [G, N]) and the offsets. */
static void offs_views(int set, smelt_tensor *ta, smelt_tensor *tb, smelt_tensor *tc, smelt_tensor *td,
                       smelt_tensor *tbias, smelt_tensor *toffs) {
  const smelt_device_kind dev = smelt_ctx_device(st.ctx);
  const int index = smelt_ctx_device_index(st.ctx);
  const int64_t N = opt_n, K = opt_k, G = st.count;
  int64_t sa[2] = {st.rows, K}, sb[3] = {G, K, N}, sd[2] = {st.rows, N}, sbias[2] = {G, N}, so[1] = {G};
  *ta = smelt_tensor_make(st.A[set], st.dt_a, dev, index, 2, sa);
  *tb = smelt_tensor_make(st.B[set], st.dt_b, dev, index, 3, sb);
  if (st.b_col) {
    tb->strides[1] = 1;
    tb->strides[2] = K;
  }
  if (st.has_c) *tc = smelt_tensor_make(st.C[set], st.dt_d, dev, index, 2, sd);
  *td = smelt_tensor_make(st.D[set], st.dt_d, dev, index, 2, sd);
  if (st.has_bias) *tbias = smelt_tensor_make(st.bias[set], st.dt_bias, dev, index, 2, sbias);
  *toffs = smelt_tensor_make(st.offs[0], SMELT_DTYPE_I32, dev, index, 1, so);
}

/* Set `set`'s scales (NULL without --rowwise). */
static const smelt_gemm_scales *set_scales(int set, smelt_gemm_scales *sc, smelt_tensor *tsa, smelt_tensor *tsb) {
  if (!opt_rowwise) return NULL;
  const smelt_device_kind dev = smelt_ctx_device(st.ctx);
  const int index = smelt_ctx_device_index(st.ctx);
  *sc = scales_of(dev, index, st.SA[set], st.SB[set], opt_group_offs ? -1 : 0, 0, st.rows, 0, opt_n, tsa, tsb);
  return sc;
}

/* --epi-graph: D = act(acc + bias), acc + bias stored in slot 0 and the
 * row abs-max of D's values in slot 1. */
static void make_graph(void) {
  smelt_epi_graph *g = &st.graph;
  *g = smelt_epi_graph_empty();
  const int pre = smelt_epi_binary(g, SMELT_EPI_ADD, smelt_epi_input(g, SMELT_EPI_ACC, 0),
                                   smelt_epi_input(g, SMELT_EPI_BIAS, 0));
  smelt_epi_store(g, pre, 0);
  g->out = smelt_epi_act(g, st.desc.epilogue.act, st.desc.epilogue.slope, pre);
  smelt_epi_reduce_node(g, SMELT_EPI_ROW_REDUCE, SMELT_EPI_AMAX, g->out, 1);
}

/* --epi-graph: set `set`'s slot tensors. */
static smelt_epi_tensors epi_of(int set, smelt_tensor t[2]) {
  const smelt_device_kind dev = smelt_ctx_device(st.ctx);
  const int index = smelt_ctx_device_index(st.ctx);
  const int64_t sd[2] = {st.rows, opt_n}, sm[1] = {st.rows};
  t[0] = smelt_tensor_make(st.PRE[set], st.dt_d, dev, index, 2, sd);
  t[1] = smelt_tensor_make(st.AMAX[set], SMELT_DTYPE_F32, dev, index, 1, sm);
  return (smelt_epi_tensors){2, {&t[0], &t[1]}};
}

/* --epi-graph: the description of the plan (the check keeps st.desc's
 * fixed epilogue, which computes the same D). */
static smelt_gemm_desc graph_desc(void) {
  smelt_gemm_desc d = st.desc;
  d.epilogue.act = SMELT_ACT_IDENTITY;
  d.epilogue.graph = &st.graph;
  return d;
}

static void run(int set) {
  if (opt_epi_graph) {
    smelt_tensor t[2];
    const smelt_epi_tensors e = epi_of(set, t);
    bind(set);
    CLI_TRY(smelt_gemm_epi_run(st.plan, st.ta, st.tb, st.has_c ? st.tc : NULL, st.td, st.tbias, NULL, &e));
    return;
  }
  smelt_gemm_scales scb;
  smelt_tensor tsa, tsb;
  const smelt_gemm_scales *sc = set_scales(set, &scb, &tsa, &tsb);
  if (opt_group_offs) {
    smelt_tensor ta, tb, tc, td, tbias, toffs;
    offs_views(set, &ta, &tb, &tc, &td, &tbias, &toffs);
    CLI_TRY(smelt_gemm_grouped_offs_scaled_run(st.plan, &ta, &tb, st.has_c ? &tc : NULL, &td,
                                               st.has_bias ? &tbias : NULL, &toffs, sc));
    return;
  }
  bind(set);
  const smelt_tensor *c = st.has_c ? st.tc : NULL, *bias = st.has_bias ? st.tbias : NULL;
  if (st.grouped)
    CLI_TRY(smelt_gemm_grouped_run(st.plan, st.count, st.ta, st.tb, c, st.td, bias));
  else
    CLI_TRY(smelt_gemm_scaled_run(st.plan, st.ta, st.tb, c, st.td, bias, sc));
}

/* ---------------------------------------------------------------- check */

/* Relative L2 bound against the CPU reference (src/core/error_bound.c). */
static double check_bound(void) {
  const smelt__bound_query q = {
      .family = "gemm", .dtype = st.dt_d, .dt_a = st.dt_a, .gemm = &st.desc, .has_c = st.has_c};
  return smelt__error_bound(&q);
}

typedef struct check_sums {
  double diff2, ref2, max_abs;
  int64_t elems, nan_mismatch;
} check_sums;

/* One window of problem g, batch l: rows [r0, r0 + rows), columns [c0, c0 +
 * cols), computed by the CPU backend from the host inputs and compared with
 * the device's D of set 0. */
static void check_window(smelt_ctx *cpu, const void *ha, const void *hb, const void *hc, const void *hbias,
                         const void *hsa, const void *hsb, int64_t g, int64_t l, int64_t r0, int64_t rows, int64_t c0,
                         int64_t cols, check_sums *s) {
  const int64_t N = opt_n, K = opt_k;
  smelt_tensor ta, tb, tc, td, tbias;
  const int64_t saved = st.batch;
  st.batch = 0; /* the window is one 2-D problem */
  views_of(SMELT_DEVICE_CPU, 0, (void *)ha, (void *)hb, (void *)hc, NULL, (void *)hbias, g, &ta, &tb, &tc, &td,
           &tbias);
  st.batch = saved;
  const int64_t L = opt_batch;
  const size_t es_a = smelt_dtype_size(st.dt_a), es_b = smelt_dtype_size(st.dt_b), es_d = smelt_dtype_size(st.dt_d);
  ta.data = (char *)ta.data + (size_t)(l * st.rows * K + r0 * ta.strides[0]) * es_a;
  ta.shape[0] = rows;
  tb.data = (char *)tb.data + (size_t)(l * K * N + c0 * tb.strides[1]) * es_b; /* batched: one problem */
  tb.shape[1] = cols;
  if (hc) {
    tc.data = (char *)tc.data + (size_t)(l * st.rows * N + r0 * N + c0) * es_d;
    tc.shape[0] = rows;
    tc.shape[1] = cols;
  }
  if (hbias) {
    tbias.data = (char *)tbias.data + (size_t)c0 * smelt_dtype_size(st.dt_bias);
    tbias.shape[0] = cols;
  }
  int64_t dshape[2] = {rows, cols};
  void *ref = cli_malloc((size_t)(rows * cols) * es_d);
  td = smelt_tensor_make(ref, st.dt_d, SMELT_DEVICE_CPU, 0, 2, dshape);
  smelt_gemm_desc rd = st.desc;
  rd.mode = SMELT_GEMM_MODE_PLAIN; /* the exact product; how the device splits the work is its own business */
  rd.split_k = 0;
  smelt_tensor tsa, tsb;
  const smelt_gemm_scales sc = scales_of(SMELT_DEVICE_CPU, 0, (void *)hsa, (void *)hsb, g, r0, rows, c0, cols, &tsa, &tsb);
  CLI_TRY(smelt_gemm_scaled(cpu, &rd, &ta, &tb, hc ? &tc : NULL, &td, hbias ? &tbias : NULL, hsa ? &sc : NULL));

  /* D rows are contiguous: fetch whole rows, compare the window's columns. */
  void *got = cli_malloc((size_t)(rows * N) * es_d);
  const size_t off = (size_t)((L > 1 ? l * st.rows * N : 0) + (st.row0[g] + r0) * N);
  cli_dev_download(st.ctx, got, (const char *)st.D[0] + off * es_d, (size_t)(rows * N) * es_d);
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) {
      double x = load(got, st.dt_d, (size_t)(i * N + c0 + j)), r = load(ref, st.dt_d, (size_t)(i * cols + j));
      s->elems++;
      if (isnan(x) || isnan(r)) {
        s->nan_mismatch += isnan(x) != isnan(r);
        continue;
      }
      double e = x == r ? 0.0 : fabs(x - r);
      s->diff2 += e * e;
      s->ref2 += r * r;
      if (e > s->max_abs) s->max_abs = e;
    }
  free(ref);
  free(got);
}

/* Checks the first and the last non-empty problem (batch 0 and the last
 * batch). */
static void check(const void *ha, const void *hb, const void *hc, const void *hbias, const void *hsa, const void *hsb,
                  cli_bench_case *c) {
  smelt_ctx *cpu = cli_ctx_open_cpu();
  check_sums s = {0, 0, 0, 0, 0};
  int windows = 0;
  const int64_t N = opt_n, K = opt_k, L = opt_batch;
  int64_t first = 0, last = st.count - 1;
  while (st.ms[first] == 0) first++; /* describe made sure one is not empty */
  while (st.ms[last] == 0) last--;
  const int64_t probs[2] = {first, last}, batches[2] = {0, L - 1};
  for (int p = 0; p < 2; p++) {
    if (p == 1 && probs[1] == probs[0] && batches[1] == batches[0]) break;
    const int64_t g = probs[p], l = batches[p], M = st.ms[g];
    if (M * N <= CHECK_WHOLE_MACS / K || (M <= CHECK_WINDOW && N <= CHECK_WINDOW)) {
      check_window(cpu, ha, hb, hc, hbias, hsa, hsb, g, l, 0, M, 0, N, &s);
      windows++;
      continue;
    }
    const int64_t r = M < CHECK_WINDOW ? M : CHECK_WINDOW, w = N < CHECK_WINDOW ? N : CHECK_WINDOW;
    check_window(cpu, ha, hb, hc, hbias, hsa, hsb, g, l, 0, r, 0, w, &s);
    check_window(cpu, ha, hb, hc, hbias, hsa, hsb, g, l, M - r, r, N - w, w, &s);
    windows += 2;
  }
  smelt_ctx_destroy(cpu);
  const double rel = s.ref2 > 0 ? sqrt(s.diff2 / s.ref2) : sqrt(s.diff2), bound = check_bound();
  const int ok = s.nan_mismatch == 0 && rel <= bound;
  c->check_failed = !ok;
  snprintf(c->check_text, sizeof c->check_text,
           "rel_l2 %.2e (bound %.1e), max_abs %.2e, %lld NaN mismatches over %d window%s (%lld elements): %s", rel,
           bound, s.max_abs, (long long)s.nan_mismatch, windows, windows == 1 ? "" : "s", (long long)s.elems,
           ok ? "ok" : "FAIL");
  snprintf(c->check_json, sizeof c->check_json,
           "\"check\":\"%s\",\"check_rel_l2\":%.6g,\"check_bound\":%.3g,\"check_max_abs\":%.6g,"
           "\"check_nan_mismatches\":%lld,\"check_elems\":%lld",
           ok ? "ok" : "fail", rel, bound, s.max_abs, (long long)s.nan_mismatch, (long long)s.elems);
}

/* ---------------------------------------------------------------- autotune */

/* Tunes the problem on set 0 and prints every candidate's time to stderr
 * (stdout stays the results, one line or one JSON object per case). */
static void autotune(smelt_ctx *ctx) {
  smelt_gemm_tune_result *r = cli_malloc(sizeof *r);
  const smelt_tensor *c = st.has_c ? st.tc : NULL, *bias = st.has_bias ? st.tbias : NULL;
  CLI_TRY(smelt_gemm_autotune(ctx, &st.desc, st.ta, st.tb, c, st.td, bias, 0, r));
  fprintf(stderr, "autotune: %d candidates (median of 15 runs each)\n", r->count);
  for (int i = 0; i < r->count; i++) {
    const smelt_gemm_tune_candidate *k = &r->cand[i];
    char what[64];
    if (k->status) snprintf(what, sizeof what, "failed: %s", smelt_status_name(k->status));
    else if (!k->correct) snprintf(what, sizeof what, "WRONG (rel err %.1e): left out", k->rel_err);
    else snprintf(what, sizeof what, "%10.4f ms", (double)k->median_ms);
    fprintf(stderr, "  %c %-44s split-K %2d  %s%s\n", i == r->winner ? '*' : ' ', k->kernel, k->split_k, what,
            k->heuristic ? "  (heuristic)" : "");
  }
  const smelt_gemm_tune_candidate *w = &r->cand[r->winner], *h = &r->cand[r->heuristic];
  fprintf(stderr, "autotune: winner %s split-K %d, %.4f ms vs the heuristic's %.4f ms (%.2fx); record %s\n", w->kernel,
          w->split_k, (double)w->median_ms, (double)h->median_ms,
          w->median_ms > 0 ? (double)(h->median_ms / w->median_ms) : 0.0, r->record_path);
  free(r);
}

/* ---------------------------------------------------------------- setup */

static void *host_fill(smelt_dtype dt, size_t n, uint64_t seed, double lo, double hi) {
  void *h = cli_malloc(n * smelt_dtype_size(dt));
  fill(h, dt, n, seed, lo, hi);
  return h;
}

static void setup(smelt_ctx *ctx, int sets, cli_bench_case *c) {
  st.ctx = ctx;
  st.sets = sets;
  /* fp8 spans a few binades around 1 (the scales bring products back down). */
  const int f8 = st.dt_a == SMELT_DTYPE_E4M3 || st.dt_a == SMELT_DTYPE_E5M2;
  const double lim = f8 ? 2.0 : 1.0;
  void *ha = host_fill(st.dt_a, st.a_elems, 0x5EED1401u, -lim, lim);
  void *hb = host_fill(st.dt_b, st.b_elems, 0x5EED1402u, -lim, lim);
  void *hc = st.has_c ? host_fill(st.dt_d, st.cd_elems, 0x5EED1403u, -1.0, 1.0) : NULL;
  void *hbias = st.has_bias ? host_fill(st.dt_bias, st.bias_elems, 0x5EED1404u, -1.0, 1.0) : NULL;
  /* Row-wise scales as amax scaling gives them: positive, a few binades. */
  void *hsa = opt_rowwise ? host_fill(SMELT_DTYPE_F32, st.sa_elems, 0x5EED1405u, 0.25, 2.0) : NULL;
  void *hsb = opt_rowwise ? host_fill(SMELT_DTYPE_F32, st.sb_elems, 0x5EED1406u, 0.25, 2.0) : NULL;
  const size_t es_d = smelt_dtype_size(st.dt_d);
  st.A = cli_bench_upload_sets(ctx, ha, st.a_elems * smelt_dtype_size(st.dt_a), sets);
  st.B = cli_bench_upload_sets(ctx, hb, st.b_elems * smelt_dtype_size(st.dt_b), sets);
  if (hc) st.C = cli_bench_upload_sets(ctx, hc, st.cd_elems * es_d, sets);
  if (hbias) st.bias = cli_bench_upload_sets(ctx, hbias, st.bias_elems * smelt_dtype_size(st.dt_bias), sets);
  if (hsa) st.SA = cli_bench_upload_sets(ctx, hsa, st.sa_elems * sizeof(float), sets);
  if (hsb) st.SB = cli_bench_upload_sets(ctx, hsb, st.sb_elems * sizeof(float), sets);
  st.D = cli_bench_alloc_sets(ctx, st.cd_elems * es_d, sets);
  const size_t nv = (size_t)st.count;
  st.ta = cli_malloc(nv * sizeof *st.ta);
  st.tb = cli_malloc(nv * sizeof *st.tb);
  st.tc = cli_malloc(nv * sizeof *st.tc);
  st.td = cli_malloc(nv * sizeof *st.td);
  st.tbias = cli_malloc(nv * sizeof *st.tbias);
  bind(0);
  if (opt_autotune) autotune(ctx);
  const smelt_tensor *tc = st.has_c ? st.tc : NULL, *tbias = st.has_bias ? st.tbias : NULL;
  smelt_gemm_scales scb;
  smelt_tensor tsa, tsb;
  const smelt_gemm_scales *sc = set_scales(0, &scb, &tsa, &tsb);
  if (opt_group_offs) {
    int32_t *ends = cli_malloc((size_t)st.count * sizeof *ends);
    for (int64_t g = 0; g < st.count; g++) ends[g] = (int32_t)(st.row0[g] + st.ms[g]);
    st.offs = cli_bench_upload_sets(ctx, ends, (size_t)st.count * sizeof *ends, 1);
    free(ends);
    smelt_tensor ta, tb, tcc, td, tbb, toffs;
    offs_views(0, &ta, &tb, &tcc, &td, &tbb, &toffs);
    CLI_TRY(smelt_gemm_grouped_offs_scaled_plan(ctx, &st.desc, &ta, &tb, st.has_c ? &tcc : NULL, &td,
                                                st.has_bias ? &tbb : NULL, &toffs, sc, &st.plan));
  } else if (opt_epi_graph) {
    st.PRE = cli_bench_alloc_sets(ctx, st.cd_elems * es_d, sets);
    st.AMAX = cli_bench_alloc_sets(ctx, (size_t)st.rows * sizeof(float), sets);
    make_graph();
    const smelt_gemm_desc gd = graph_desc();
    smelt_tensor t[2];
    const smelt_epi_tensors e = epi_of(0, t);
    CLI_TRY(smelt_gemm_epi_plan(ctx, &gd, st.ta, st.tb, tc, st.td, tbias, NULL, &e, &st.plan));
  } else if (st.grouped)
    CLI_TRY(smelt_gemm_grouped_plan(ctx, &st.desc, st.count, st.ta, st.tb, tc, st.td, tbias, &st.plan));
  else
    CLI_TRY(smelt_gemm_scaled_plan(ctx, &st.desc, st.ta, st.tb, tc, st.td, tbias, sc, &st.plan));
  snprintf(c->kernel, sizeof c->kernel, "%s", smelt_plan_describe(st.plan));
  if (opt_check) {
    cli_bench_poison(ctx, st.D[0], st.cd_elems * es_d);
    run(0);
    CLI_TRY(smelt_ctx_synchronize(ctx));
    check(ha, hb, hc, hbias, hsa, hsb, c);
  }
  free(hsa);
  free(hsb);
  free(ha);
  free(hb);
  free(hc);
  free(hbias);
}

static void teardown(void) {
  smelt_plan_destroy(st.plan);
  cli_bench_free_sets(st.ctx, st.A, st.sets);
  cli_bench_free_sets(st.ctx, st.B, st.sets);
  if (st.has_c) cli_bench_free_sets(st.ctx, st.C, st.sets);
  if (st.has_bias) cli_bench_free_sets(st.ctx, st.bias, st.sets);
  if (opt_rowwise) {
    cli_bench_free_sets(st.ctx, st.SA, st.sets);
    cli_bench_free_sets(st.ctx, st.SB, st.sets);
  }
  cli_bench_free_sets(st.ctx, st.D, st.sets);
  if (st.offs) cli_bench_free_sets(st.ctx, st.offs, 1);
  st.offs = NULL;
  if (opt_epi_graph) {
    cli_bench_free_sets(st.ctx, st.PRE, st.sets);
    cli_bench_free_sets(st.ctx, st.AMAX, st.sets);
  }
  free(st.ta);
  free(st.tb);
  free(st.tc);
  free(st.td);
  free(st.tbias);
  free(st.ms);
  free(st.row0);
}

const cli_bench_op cli_bench_gemm = {
    "gemm",
    "D = epilogue(alpha A @ B + beta C): every dtype, layout, epilogue, mode",
    options, describe, setup, run, teardown,
};
