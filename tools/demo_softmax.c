/* Demo section: row softmax with logsumexp over [tokens, d_model], the shape
 * of attention-score and vocabulary-logit rows. The logsumexp is the second
 * output a fused backward pass needs, so it is checked as its own row. */
#include "demo.h"

#include <stdlib.h>

static const smelt_dtype dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

typedef struct softmax_case {
  cli_demo_case base;
  smelt_dtype dt;
  void *x, *y, *lse; /* device: [tokens, d_model] twice, lse [tokens] f32 */
} softmax_case;

static void run_block(void *user, int64_t row0, int64_t rows, int slot) {
  softmax_case *c = user;
  smelt_ctx *ctx = c->base.env->ctx;
  smelt_plan **plan = &c->base.plan[slot];
  smelt_tensor x = cli_demo_rows(ctx, c->x, c->dt, row0, rows, c->base.env->d_model);
  smelt_tensor y = cli_demo_rows(ctx, c->y, c->dt, row0, rows, c->base.env->d_model);
  smelt_tensor lse = cli_demo_rows(ctx, c->lse, SMELT_DTYPE_F32, row0, rows, 0);
  if (!*plan) CLI_TRY(smelt_softmax_plan(ctx, &x, &y, &lse, plan));
  CLI_TRY(smelt_softmax_run(*plan, &x, &y, &lse));
}

void cli_demo_softmax(cli_demo_env *env) {
  char shapes[128];
  snprintf(shapes, sizeof shapes, "y = softmax(x), lse = logsumexp(x) per row, x and y [%lld, %lld]",
           (long long)env->tokens, (long long)env->d_model);
  cli_demo_table("softmax", shapes);
  size_t rows = (size_t)env->tokens, n = rows * (size_t)env->d_model;
  size_t lse_bytes = rows * sizeof(float);
  int64_t shape[2] = {env->tokens, env->d_model};
  float *lse_ref = cli_malloc(lse_bytes), *lse_got = cli_malloc(lse_bytes);

  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    smelt_dtype dt = dtypes[i];
    size_t bytes = n * smelt_dtype_size(dt);
    void *x_host = cli_malloc(bytes), *ref = cli_malloc(bytes), *got = cli_malloc(bytes);
    /* Logits spread like real ones: a few dominate each row, most do not. */
    cli_fill_uniform(x_host, dt, n, 0x5EED0101u + i, -8.0, 8.0);
    smelt_tensor xr = smelt_tensor_make(x_host, dt, SMELT_DEVICE_CPU, 0, 2, shape);
    smelt_tensor yr = smelt_tensor_make(ref, dt, SMELT_DEVICE_CPU, 0, 2, shape);
    smelt_tensor lr = smelt_tensor_make(lse_ref, SMELT_DTYPE_F32, SMELT_DEVICE_CPU, 0, 1, shape);
    CLI_TRY(smelt_softmax(env->cpu, &xr, &yr, &lr));

    softmax_case c = {{env, run_block, {NULL, NULL}}, dt, NULL, NULL, NULL};
    c.x = cli_dev_upload(env->ctx, x_host, bytes);
    c.y = cli_dev_alloc(env->ctx, bytes);
    c.lse = cli_dev_alloc(env->ctx, lse_bytes);
    cli_demo_run_all(&c, 0);
    cli_dev_download(env->ctx, got, c.y, bytes);
    cli_dev_download(env->ctx, lse_got, c.lse, lse_bytes);
    cli_diff dy = cli_compare(got, ref, dt, n);
    cli_diff dl = cli_compare(lse_got, lse_ref, SMELT_DTYPE_F32, rows);
    cli_timing t = cli_demo_time(&c.base);

    char label[64];
    snprintf(label, sizeof label, "%s y", smelt_dtype_name(dt));
    cli_demo_row(env, label, &dy, cli_demo_bound(&dy, "softmax", dt), env->d_model, &t,
                 2.0 * (double)bytes + (double)lse_bytes, smelt_plan_describe(c.base.plan[0]));
    snprintf(label, sizeof label, "%s lse", smelt_dtype_name(dt));
    double lse_bound = cli_demo_bound(&dl, "softmax", SMELT_DTYPE_F32);
    cli_demo_row(env, label, &dl, lse_bound, 1, NULL, 0.0, "f32");

    cli_demo_case_reset(&c.base);
    CLI_TRY(smelt_free(env->ctx, c.x));
    CLI_TRY(smelt_free(env->ctx, c.y));
    CLI_TRY(smelt_free(env->ctx, c.lse));
    free(x_host);
    free(ref);
    free(got);
  }
  free(lse_ref);
  free(lse_got);
}
