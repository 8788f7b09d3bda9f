/* BEM internals shared by the core (validation, plans, the check and
 * benchmark functions), the CPU reference and the CUDA backend: the tensor
 * roles and the plan's resolved description. */
#ifndef SMELT_BEM_INTERNAL_H
#define SMELT_BEM_INTERNAL_H

#include "internal.h"

/* BEM's tensor roles (smelt__family_bem's, by index): the inputs every
 * call takes, the forward's output, then the backward's dy and gradients.
 * A backend's plan and run get the role-indexed array (NULL where absent). */
enum {
  SMELT__BT_X = 0, SMELT__BT_V, SMELT__BT_CODES, SMELT__BT_U, SMELT__BT_OFFSETS, SMELT__BT_SCALES,
  SMELT__BT_Y,
  SMELT__BT_DY, SMELT__BT_DX, SMELT__BT_DV, SMELT__BT_DU, SMELT__BT_DCODES,
  SMELT__BT_ROLES
};

/* The plan's resolved description (plan->opdata). */
typedef struct smelt__bem_state {
  smelt_bem_desc desc;
  int backward;
  int64_t M, din, dout, r, A;                /* A = 1 without offsets */
  smelt_tensor planned[SMELT__BT_ROLES];      /* the planned views; ndim -1 where absent */
} smelt__bem_state;

/* The segment bounds of smelt/bem.h from the offsets (host memory of
 * offsets' dtype and strides): o[0..A], each in [0, M], non-decreasing. */
void smelt__bem_bounds(const smelt_tensor *offsets, int64_t A, int64_t M, int64_t *o);

/* The backward composed from public ops (src/core/bem_compose.c), for a
 * plan of one adapter: plan attaches the sub-plans as plan->backend, run
 * runs them on the role-indexed tensors. */
smelt_status smelt__bem_compose_plan(smelt_plan *plan, const smelt_tensor *const *t);
smelt_status smelt__bem_compose_run(smelt_plan *plan, const smelt_tensor *const *t);

#endif /* SMELT_BEM_INTERNAL_H */
