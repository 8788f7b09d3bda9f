/* Fuzz entry point for the fusion planner (smelt/graph.h): a small graph
 * over x [M, K], w [K, N], b [N], r [M, N] and outputs y, y2 [M, N]
 * (views as fz_view makes them, broken now and then), three [M, N]
 * intermediates, and up to six ops whose kinds and tensor numbers come
 * from the input (numbers out of range now and then), so chains, cycles,
 * unwritten tensors and broken graphs all occur; then a plan, fused or
 * not, and a run or two. Every call goes through the checks: adding and
 * planning write nothing; a run writes only y and y2. */
#include "fuzz.h"

#include <string.h>

enum { G_X, G_W, G_B, G_R, G_Y, G_Y2, G_NT };
#define G_TENSORS (G_NT + 3)

/* A tensor number: mostly `want`, now and then any of the graph's, -1 or 99. */
static int pick(fz *f, int want) {
  const uint8_t b = fz_u8(f);
  if (b < 192) return want;
  return b >= 250 ? (b & 1 ? 99 : -1) : b % G_TENSORS;
}

/* One op of a kind the input picks. The caller goes on whatever its
 * status: a failed op breaks the graph, which the plan then reports. */
static smelt_status add_op(fz *f, smelt_graph *g, smelt_tensor (*tp)[G_NT], int i, int nops) {
  /* Mostly a chain: a GEMM of x and w first, then ops on the value so
   * far with r or b, into h0, h1, ... and y and y2 last. */
  const int kind = i == 0 && !fz_one_in(f, 4) ? 0 : (int)fz_small(f, 6);
  const int value = i == 0 ? G_X : i - 1 < 3 ? G_NT + i - 1 : G_Y;
  const int target = i == nops - 1 ? G_Y2 : i == nops - 2 ? G_Y : i < 3 ? G_NT + i : G_Y2;
  const int a = pick(f, kind == 0 && i == 0 ? G_X : value);
  const int b = pick(f, kind == 0 ? G_W : kind == 1 || kind == 5 ? G_B : G_R), y = pick(f, target);
  smelt_status s;
  switch (kind) {
    case 0: FZ_CALL(s, "smelt_graph_gemm", (*tp), smelt_graph_gemm(g, NULL, a, b, y)); break;
    case 1: FZ_CALL(s, "smelt_graph_bias", (*tp), smelt_graph_bias(g, a, b, y)); break;
    case 2:
      FZ_CALL(s, "smelt_graph_act", (*tp), smelt_graph_act(g, (smelt_act)fz_enum(f, SMELT_ACT_COUNT), 0.01f, a, y));
      break;
    case 3:
      FZ_CALL(s, "smelt_graph_binary", (*tp),
              smelt_graph_binary(g, (smelt_graph_binop)fz_enum(f, SMELT_GRAPH_BINOP_COUNT), a, b, y));
      break;
    case 4: FZ_CALL(s, "smelt_graph_residual_add", (*tp), smelt_graph_residual_add(g, a, b, y)); break;
    case 5: {
      const smelt_norm_desc d = {(smelt_norm_kind)fz_enum(f, 2), 1e-5f};
      FZ_CALL(s, "smelt_graph_norm", (*tp), smelt_graph_norm(g, &d, a, b, -1, y));
      break;
    }
    default: FZ_CALL(s, "smelt_graph_softmax", (*tp), smelt_graph_softmax(g, a, y)); break;
  }
  return s;
}

void fz_graph(fz *f) {
  int64_t dims[3] = {fz_size(f, 8), fz_size(f, 8), fz_size(f, 8)};
  fz_cap_work(dims, 3, 512);
  const int64_t M = dims[0], K = dims[1], N = dims[2];
  const int64_t mk[2] = {M, K}, kn[2] = {K, N}, mn[2] = {M, N};
  const smelt_dtype dt = fz_float_dtype(f);
  const unsigned flags = fz_u8(f) & 1;
  const int runs = 1 + (int)fz_small(f, 1), nops = 2 + (int)fz_small(f, 4);
  smelt_tensor t[G_NT];
  t[G_X] = fz_view(f, dt, 2, mk, 0);
  t[G_W] = fz_view(f, dt, 2, kn, 0);
  t[G_B] = fz_view(f, dt, 1, &N, 0);
  t[G_R] = fz_view(f, dt, 2, mn, 0);
  t[G_Y] = fz_view(f, dt, 2, mn, 1);
  t[G_Y2] = fz_view(f, dt, 2, mn, 1);
  smelt_graph *g = NULL;
  smelt_status s;
  FZ_CHECKED(fz_end_pure, s, "smelt_graph_create", t, smelt_graph_create(f->ctx, &g));
  if (s) return;
  static const char *const names[G_NT] = {"x", "w", "b", "r", "y", "y2"};
  int id;
  for (int i = 0; i < G_NT; i++)
    FZ_CHECKED(fz_end_pure, s, i < G_Y ? "smelt_graph_input" : "smelt_graph_output", t,
               i < G_Y ? smelt_graph_input(g, names[i], &t[i], &id) : smelt_graph_output(g, names[i], &t[i], &id));
  static const char *const mids[3] = {"h0", "h1", "h2"};
  for (int i = 0; i < 3; i++)
    FZ_CHECKED(fz_end_pure, s, "smelt_graph_tensor", t, smelt_graph_tensor(g, mids[i], dt, 2, mn, &id));
  for (int i = 0; i < nops; i++) add_op(f, g, &t, i, nops);
  FZ_CHECKED(fz_end_pure, s, "smelt_graph_plan", t, smelt_graph_plan(g, flags));
  for (int r = 0; r < runs; r++) FZ_CALL(s, "smelt_graph_run", t, smelt_graph_run(g, NULL));
  smelt_graph_destroy(g);
}
