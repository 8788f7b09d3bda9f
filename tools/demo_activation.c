/* Demo section: elementwise activations on the [tokens, d_model] hidden
 * state, as an MLP applies them after its up-projection. The activations are
 * the ones transformer MLPs use; f32 and bf16 cover the exact and the
 * low-precision storage paths. */
#include "demo.h"

#include <stdlib.h>

static const smelt_act acts[] = {SMELT_ACT_RELU, SMELT_ACT_SILU, SMELT_ACT_GELU, SMELT_ACT_GELU_TANH};
static const smelt_dtype dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_BF16};

typedef struct act_case {
  cli_demo_case base;
  smelt_activation_desc desc;
  smelt_dtype dt;
  void *x, *y; /* device buffers [tokens, d_model] */
} act_case;

static void run_block(void *user, int64_t row0, int64_t rows, int slot) {
  act_case *c = user;
  smelt_ctx *ctx = c->base.env->ctx;
  smelt_plan **plan = &c->base.plan[slot];
  smelt_tensor x = cli_demo_rows(ctx, c->x, c->dt, row0, rows, c->base.env->d_model);
  smelt_tensor y = cli_demo_rows(ctx, c->y, c->dt, row0, rows, c->base.env->d_model);
  if (!*plan) CLI_TRY(smelt_activation_plan(ctx, &c->desc, &x, &y, plan));
  CLI_TRY(smelt_activation_run(*plan, &x, &y));
}

static void run_case(act_case *c, const void *x_host, void *ref, void *got, size_t n) {
  cli_demo_env *env = c->base.env;
  size_t bytes = n * smelt_dtype_size(c->dt);
  int64_t shape[2] = {env->tokens, env->d_model};
  smelt_tensor xr = smelt_tensor_make((void *)x_host, c->dt, SMELT_DEVICE_CPU, 0, 2, shape);
  smelt_tensor yr = smelt_tensor_make(ref, c->dt, SMELT_DEVICE_CPU, 0, 2, shape);
  CLI_TRY(smelt_activation(env->cpu, &c->desc, &xr, &yr));

  cli_demo_run_all(c, 0);
  cli_dev_download(env->ctx, got, c->y, bytes);
  cli_diff d = cli_compare(got, ref, c->dt, n);
  cli_timing t = cli_demo_time(&c->base);

  char label[64];
  snprintf(label, sizeof label, "%s %s", smelt_act_name(c->desc.act), smelt_dtype_name(c->dt));
  double bound = cli_demo_bound(&d, "activation", c->dt);
  cli_demo_row(env, label, &d, bound, env->d_model, &t, 2.0 * (double)bytes,
               smelt_plan_describe(c->base.plan[0]));
  cli_demo_case_reset(&c->base);
}

void cli_demo_activation(cli_demo_env *env) {
  char shapes[96];
  snprintf(shapes, sizeof shapes, "y = act(x), x and y [%lld, %lld]", (long long)env->tokens,
           (long long)env->d_model);
  cli_demo_table("activations", shapes);
  size_t n = (size_t)(env->tokens * env->d_model);
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    smelt_dtype dt = dtypes[i];
    size_t bytes = n * smelt_dtype_size(dt);
    void *x_host = cli_malloc(bytes), *ref = cli_malloc(bytes), *got = cli_malloc(bytes);
    /* Wide enough to reach the saturating tails of every activation. */
    cli_fill_uniform(x_host, dt, n, 0x5EED0001u + i, -6.0, 6.0);
    act_case c = {{env, run_block, {NULL, NULL}}, {SMELT_ACT_IDENTITY, 0.01f}, dt, NULL, NULL};
    c.x = cli_dev_upload(env->ctx, x_host, bytes);
    c.y = cli_dev_alloc(env->ctx, bytes);
    for (size_t a = 0; a < sizeof acts / sizeof acts[0]; a++) {
      c.desc.act = acts[a];
      run_case(&c, x_host, ref, got, n);
    }
    CLI_TRY(smelt_free(env->ctx, c.x));
    CLI_TRY(smelt_free(env->ctx, c.y));
    free(x_host);
    free(ref);
    free(got);
  }
}
