/* The README's example: a row-wise softmax with its logsumexp on whichever
 * device SMELT_DEVICE names (cpu by default), checked by printing one row. */
#include <smelt.h>

#include <stdio.h>

int main(void) {
  smelt_ctx *ctx;
  smelt_ctx_options opts = smelt_ctx_options_default(); /* honours SMELT_DEVICE=cpu|cuda[:N] */
  if (smelt_ctx_create(&ctx, &opts) != SMELT_OK) {
    fprintf(stderr, "smelt: %s\n", smelt_last_error());
    return 1;
  }
  enum { ROWS = 2, COLS = 4 };
  float host_x[ROWS * COLS] = {1, 2, 3, 4, -1, 0, 1, 2}, host_y[ROWS * COLS], host_lse[ROWS];
  void *x, *y, *lse;
  smelt_alloc(ctx, sizeof host_x, &x);
  smelt_alloc(ctx, sizeof host_y, &y);
  smelt_alloc(ctx, sizeof host_lse, &lse);
  smelt_memcpy_h2d(ctx, x, host_x, sizeof host_x);

  smelt_device_kind dev = smelt_ctx_device(ctx);
  int idx = smelt_ctx_device_index(ctx);
  int64_t shape[2] = {ROWS, COLS}, rows[1] = {ROWS};
  smelt_tensor tx = smelt_tensor_make(x, SMELT_DTYPE_F32, dev, idx, 2, shape);
  smelt_tensor ty = smelt_tensor_make(y, SMELT_DTYPE_F32, dev, idx, 2, shape);
  smelt_tensor tl = smelt_tensor_make(lse, SMELT_DTYPE_F32, dev, idx, 1, rows);
  if (smelt_softmax(ctx, &tx, &ty, &tl) != SMELT_OK) {
    fprintf(stderr, "smelt: %s\n", smelt_last_error());
    return 1;
  }
  smelt_memcpy_d2h(ctx, host_y, y, sizeof host_y); /* waits for the stream */
  smelt_memcpy_d2h(ctx, host_lse, lse, sizeof host_lse);
  printf("softmax row 0: %.4f %.4f %.4f %.4f  lse %.4f\n", host_y[0], host_y[1], host_y[2], host_y[3], host_lse[0]);
  smelt_free(ctx, x);
  smelt_free(ctx, y);
  smelt_free(ctx, lse);
  smelt_ctx_destroy(ctx);
  return 0;
}
