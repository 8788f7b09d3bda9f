/* smelt_residual_add: y = x + residual, elementwise, the residual stream's
 * add between a transformer block's sublayers. Its half of the op-family
 * interface: the tensors (y may be the residual exactly, the stream updated
 * in place) and the one shape check (src/core/family.c does the rest). */
#include "error_bound.h"
#include "internal.h"

#include <stdio.h>

static const smelt_dtype float_types[] = {SMELT_DTYPE_F32, SMELT_DTYPE_F16, SMELT_DTYPE_BF16};

static const smelt__role roles[] = {
    {"x", 0, float_types, 3, 0},
    {"residual", SMELT__ROLE_DTYPE_OF_0, NULL, 0, 0},
    {"y", SMELT__ROLE_OUTPUT | SMELT__ROLE_IN_PLACE | SMELT__ROLE_DTYPE_OF_0, NULL, 0, 1},
};

static smelt_status check(smelt_plan *plan, const void *params, const smelt_tensor *const *t) {
  const char *op = smelt__family_residual.op;
  (void)params;
  smelt_status s;
  if ((s = smelt__check_same_shape(op, "x", t[0], "residual", t[1])) ||
      (s = smelt__check_same_shape(op, "x", t[0], "y", t[2])))
    return s;
  snprintf(plan->describe, sizeof plan->describe, "residual_add %s n=%lld (cpu reference)",
           smelt_dtype_name(t[0]->dtype), (long long)smelt_tensor_numel(t[0]));
  return SMELT_OK;
}

const smelt__family smelt__family_residual = {
    .name = "residual",
    .op = "smelt_residual_add",
    .what = "a residual add",
    .nroles = 3,
    .roles = roles,
    .check = check,
    .cpu = &smelt__cpu_residual,
    .cuda = &smelt__cuda_residual,
    .bound = smelt__bound_norm,
};

smelt_status smelt_residual_add_plan(smelt_ctx *ctx, const smelt_tensor *x, const smelt_tensor *residual,
                                     const smelt_tensor *y, smelt_plan **out) {
  const smelt_tensor *t[] = {x, residual, y};
  return smelt__family_plan(&smelt__family_residual, ctx, NULL, t, out);
}

smelt_status smelt_residual_add_run(smelt_plan *plan, const smelt_tensor *x, const smelt_tensor *residual,
                                    const smelt_tensor *y) {
  const smelt_tensor *t[] = {x, residual, y};
  return smelt__family_run(&smelt__family_residual, plan, t);
}

smelt_status smelt_residual_add(smelt_ctx *ctx, const smelt_tensor *x, const smelt_tensor *residual,
                                const smelt_tensor *y) {
  SMELT__ONE_SHOT(smelt_residual_add_plan(ctx, x, residual, y, &plan), smelt_residual_add_run(plan, x, residual, y));
}
