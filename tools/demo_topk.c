/* Demo section: MoE-style routing, the top-k experts of each token's router
 * logits [tokens, num_experts]. Logits are f32 as MoE routers keep them (and
 * bf16 for the low-precision path). Selection copies values, so values and
 * indices must match the reference exactly: both follow one tie rule. */
#include "demo.h"

static const smelt_dtype dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_BF16};

/* x [tokens, E], values and indices (i32) [tokens, k]. */
static void run_op(cli_demo_case *c, smelt_ctx *ctx, smelt_plan **plan, const smelt_tensor *t) {
  if (!*plan) CLI_TRY(smelt_topk_plan(ctx, c->env->top_k, &t[0], &t[1], &t[2], plan));
  CLI_TRY(smelt_topk_run(*plan, &t[0], &t[1], &t[2]));
}

void cli_demo_topk(cli_demo_env *env) {
  char shapes[128];
  snprintf(shapes, sizeof shapes, "top-%lld of router logits [%lld, %lld] -> values, indices (i32)",
           (long long)env->top_k, (long long)env->tokens, (long long)env->experts);
  cli_demo_table("topk routing", shapes);
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    smelt_dtype dt = dtypes[i];
    cli_demo_case c = {.env = env, .op = run_op, .nbuf = 3,
                       .buf = {{.dt = dt, .cols = env->experts}, {.dt = dt, .cols = env->top_k},
                               {.dt = SMELT_DTYPE_I32, .cols = env->top_k}}};
    cli_demo_case_load(&c, 0x5EED0201u + i, -4.0, 4.0);
    cli_timing t = cli_demo_case_run(&c);
    cli_diff dv = cli_demo_case_diff(&c, 1), di = cli_demo_case_diff(&c, 2);

    char label[64];
    snprintf(label, sizeof label, "%s values", smelt_dtype_name(dt));
    double bytes = (double)(cli_demo_case_bytes(&c, 0) + cli_demo_case_bytes(&c, 1) + cli_demo_case_bytes(&c, 2));
    cli_demo_row(env, label, &dv, 0.0, env->top_k, &t, bytes, smelt_plan_describe(c.plan[0]));
    snprintf(label, sizeof label, "%s indices", smelt_dtype_name(dt));
    char note[64];
    snprintf(note, sizeof note, "%lld of %zu differ", (long long)di.mismatches, cli_demo_case_elems(&c, 2));
    cli_demo_row(env, label, &di, 0.0, env->top_k, NULL, 0.0, note);
    cli_demo_case_free(&c);
  }
}
