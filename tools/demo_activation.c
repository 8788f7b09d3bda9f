/* Demo section: elementwise activations on the [tokens, d_model] hidden
 * state, as an MLP applies them after its up-projection. The activations are
 * the ones transformer MLPs use; f32 and bf16 cover the exact and the
 * low-precision storage paths. */
#include "demo.h"

static const smelt_act acts[] = {SMELT_ACT_RELU, SMELT_ACT_SILU, SMELT_ACT_GELU, SMELT_ACT_GELU_TANH};
static const smelt_dtype dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_BF16};

typedef struct act_case {
  cli_demo_case base; /* x, y [tokens, d_model] */
  smelt_activation_desc desc;
} act_case;

static void run_op(cli_demo_case *base, smelt_ctx *ctx, smelt_plan **plan, const smelt_tensor *t) {
  act_case *c = (act_case *)base;
  if (!*plan) CLI_TRY(smelt_activation_plan(ctx, &c->desc, &t[0], &t[1], plan));
  CLI_TRY(smelt_activation_run(*plan, &t[0], &t[1]));
}

static void run_case(act_case *c) {
  cli_demo_env *env = c->base.env;
  const smelt_dtype dt = c->base.buf[0].dt;
  cli_timing t = cli_demo_case_run(&c->base);
  cli_diff d = cli_demo_case_diff(&c->base, 1);

  char label[64];
  snprintf(label, sizeof label, "%s %s", smelt_act_name(c->desc.act), smelt_dtype_name(dt));
  double bound = cli_demo_bound(&d, "activation", dt);
  cli_demo_row(env, label, &d, bound, env->d_model, &t, 2.0 * (double)cli_demo_case_bytes(&c->base, 0),
               smelt_plan_describe(c->base.plan[0]));
  cli_demo_case_reset(&c->base);
}

void cli_demo_activation(cli_demo_env *env) {
  char shapes[96];
  snprintf(shapes, sizeof shapes, "y = act(x), x and y [%lld, %lld]", (long long)env->tokens,
           (long long)env->d_model);
  cli_demo_table("activations", shapes);
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    smelt_dtype dt = dtypes[i];
    act_case c = {.base = {.env = env, .op = run_op, .nbuf = 2,
                           .buf = {{.dt = dt, .cols = env->d_model}, {.dt = dt, .cols = env->d_model}}},
                  .desc = {SMELT_ACT_IDENTITY, 0.01f}};
    /* Wide enough to reach the saturating tails of every activation. */
    cli_demo_case_load(&c.base, 0x5EED0001u + i, -6.0, 6.0);
    for (size_t a = 0; a < sizeof acts / sizeof acts[0]; a++) {
      c.desc.act = acts[a];
      run_case(&c);
    }
    cli_demo_case_free(&c.base);
  }
}
