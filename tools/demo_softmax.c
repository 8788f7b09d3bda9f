/* Demo section: row softmax with logsumexp over [tokens, d_model], the shape
 * of attention-score and vocabulary-logit rows. The logsumexp is the second
 * output a fused backward pass needs, so it is checked as its own row. */
#include "demo.h"

static const smelt_dtype dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

/* x, y [tokens, d_model], lse [tokens] f32. */
static void run_op(cli_demo_case *c, smelt_ctx *ctx, smelt_plan **plan, const smelt_tensor *t) {
  (void)c;
  if (!*plan) CLI_TRY(smelt_softmax_plan(ctx, &t[0], &t[1], &t[2], plan));
  CLI_TRY(smelt_softmax_run(*plan, &t[0], &t[1], &t[2]));
}

void cli_demo_softmax(cli_demo_env *env) {
  char shapes[128];
  snprintf(shapes, sizeof shapes, "y = softmax(x), lse = logsumexp(x) per row, x and y [%lld, %lld]",
           (long long)env->tokens, (long long)env->d_model);
  cli_demo_table("softmax", shapes);
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    smelt_dtype dt = dtypes[i];
    cli_demo_case c = {.env = env, .op = run_op, .nbuf = 3,
                       .buf = {{.dt = dt, .cols = env->d_model}, {.dt = dt, .cols = env->d_model},
                               {.dt = SMELT_DTYPE_F32, .cols = 0}}};
    /* Logits spread like real ones: a few dominate each row, most do not. */
    cli_demo_case_load(&c, 0x5EED0101u + i, -8.0, 8.0);
    cli_timing t = cli_demo_case_run(&c);
    cli_diff dy = cli_demo_case_diff(&c, 1), dl = cli_demo_case_diff(&c, 2);

    char label[64];
    snprintf(label, sizeof label, "%s y", smelt_dtype_name(dt));
    cli_demo_row(env, label, &dy, cli_demo_bound(&dy, "softmax", dt), env->d_model, &t,
                 2.0 * (double)cli_demo_case_bytes(&c, 0) + (double)cli_demo_case_bytes(&c, 2),
                 smelt_plan_describe(c.plan[0]));
    snprintf(label, sizeof label, "%s lse", smelt_dtype_name(dt));
    double lse_bound = cli_demo_bound(&dl, "softmax", SMELT_DTYPE_F32);
    cli_demo_row(env, label, &dl, lse_bound, 1, NULL, 0.0, "f32");
    cli_demo_case_free(&c);
  }
}
