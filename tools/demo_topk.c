/* Demo section: MoE-style routing, the top-k experts of each token's router
 * logits [tokens, num_experts]. Logits are f32 as MoE routers keep them (and
 * bf16 for the low-precision path). Selection copies values, so values and
 * indices must match the reference exactly: both follow one tie rule. */
#include "demo.h"

#include <stdlib.h>

static const smelt_dtype dtypes[] = {SMELT_DTYPE_F32, SMELT_DTYPE_BF16};

typedef struct topk_case {
  cli_demo_case base;
  smelt_dtype dt;
  void *x, *values, *indices; /* device: [tokens, E], [tokens, k] twice (indices i32) */
} topk_case;

static void run_block(void *user, int64_t row0, int64_t rows, int slot) {
  topk_case *c = user;
  cli_demo_env *env = c->base.env;
  smelt_plan **plan = &c->base.plan[slot];
  smelt_tensor x = cli_demo_rows(env->ctx, c->x, c->dt, row0, rows, env->experts);
  smelt_tensor v = cli_demo_rows(env->ctx, c->values, c->dt, row0, rows, env->top_k);
  smelt_tensor ix = cli_demo_rows(env->ctx, c->indices, SMELT_DTYPE_I32, row0, rows, env->top_k);
  if (!*plan) CLI_TRY(smelt_topk_plan(env->ctx, env->top_k, &x, &v, &ix, plan));
  CLI_TRY(smelt_topk_run(*plan, &x, &v, &ix));
}

void cli_demo_topk(cli_demo_env *env) {
  char shapes[128];
  snprintf(shapes, sizeof shapes, "top-%lld of router logits [%lld, %lld] -> values, indices (i32)",
           (long long)env->top_k, (long long)env->tokens, (long long)env->experts);
  cli_demo_table("topk routing", shapes);
  size_t n = (size_t)(env->tokens * env->experts), nk = (size_t)(env->tokens * env->top_k);
  size_t idx_bytes = nk * sizeof(int32_t);
  int64_t xshape[2] = {env->tokens, env->experts}, kshape[2] = {env->tokens, env->top_k};
  int32_t *idx_ref = cli_malloc(idx_bytes), *idx_got = cli_malloc(idx_bytes);

  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    smelt_dtype dt = dtypes[i];
    size_t es = smelt_dtype_size(dt), bytes = n * es, vbytes = nk * es;
    void *x_host = cli_malloc(bytes), *v_ref = cli_malloc(vbytes), *v_got = cli_malloc(vbytes);
    cli_fill_uniform(x_host, dt, n, 0x5EED0201u + i, -4.0, 4.0);
    smelt_tensor xr = smelt_tensor_make(x_host, dt, SMELT_DEVICE_CPU, 0, 2, xshape);
    smelt_tensor vr = smelt_tensor_make(v_ref, dt, SMELT_DEVICE_CPU, 0, 2, kshape);
    smelt_tensor ir = smelt_tensor_make(idx_ref, SMELT_DTYPE_I32, SMELT_DEVICE_CPU, 0, 2, kshape);
    CLI_TRY(smelt_topk(env->cpu, env->top_k, &xr, &vr, &ir));

    topk_case c = {{env, run_block, {NULL, NULL}}, dt, NULL, NULL, NULL};
    c.x = cli_dev_upload(env->ctx, x_host, bytes);
    c.values = cli_dev_alloc(env->ctx, vbytes);
    c.indices = cli_dev_alloc(env->ctx, idx_bytes);
    cli_demo_run_all(&c, 0);
    cli_dev_download(env->ctx, v_got, c.values, vbytes);
    cli_dev_download(env->ctx, idx_got, c.indices, idx_bytes);
    cli_diff dv = cli_compare(v_got, v_ref, dt, nk);
    cli_diff di = cli_compare(idx_got, idx_ref, SMELT_DTYPE_I32, nk);
    cli_timing t = cli_demo_time(&c.base);

    char label[64];
    snprintf(label, sizeof label, "%s values", smelt_dtype_name(dt));
    cli_demo_row(env, label, &dv, 0.0, env->top_k, &t, (double)(bytes + vbytes + idx_bytes),
                 smelt_plan_describe(c.base.plan[0]));
    snprintf(label, sizeof label, "%s indices", smelt_dtype_name(dt));
    char note[64];
    snprintf(note, sizeof note, "%lld of %zu differ", (long long)di.mismatches, nk);
    cli_demo_row(env, label, &di, 0.0, env->top_k, NULL, 0.0, note);

    cli_demo_case_reset(&c.base);
    CLI_TRY(smelt_free(env->ctx, c.x));
    CLI_TRY(smelt_free(env->ctx, c.values));
    CLI_TRY(smelt_free(env->ctx, c.indices));
    free(x_host);
    free(v_ref);
    free(v_got);
  }
  free(idx_ref);
  free(idx_got);
}
