/* PEER internals shared by the core (validation, plans, the store), the CPU
 * reference and the CUDA backend: the tensor roles, what a run hands the
 * backend, the plan's resolved description, and the store's state and
 * entry points. */
#ifndef SMELT_PEER_INTERNAL_H
#define SMELT_PEER_INTERNAL_H

#include "internal.h"

/* PEER's tensor roles (smelt__family_peer's, by index): the planned ones
 * first, x and the weights, which every run binds as planned; then each
 * run's own. ids is an output of retrieval and the forward, an input of
 * the backward: two roles. */
enum {
  SMELT__PT_X = 0, SMELT__PT_WQ, SMELT__PT_BQ,
  SMELT__PT_NORM_W, SMELT__PT_NORM_B, SMELT__PT_BN_MEAN, SMELT__PT_BN_VAR,
  SMELT__PT_KEY0, /* SMELT__PT_KEY0 + i for dim i */
  SMELT__PT_U = SMELT__PT_KEY0 + SMELT_PEER_MAX_DIMS, SMELT__PT_V,
  SMELT__PT_COUNT, /* the planned roles */
  /* retrieval's and the forward's */
  SMELT__PT_Y = SMELT__PT_COUNT, SMELT__PT_IDS, SMELT__PT_SCORES,
  /* the backward's: its inputs, the dense gradients, the sparse expert gradients */
  SMELT__PT_IDS_IN, SMELT__PT_DY,
  SMELT__PT_DX, SMELT__PT_DWQ, SMELT__PT_DBQ, SMELT__PT_DNORM_W, SMELT__PT_DNORM_B,
  SMELT__PT_DKEY0, /* SMELT__PT_DKEY0 + i for dim i */
  SMELT__PT_DU = SMELT__PT_DKEY0 + SMELT_PEER_MAX_DIMS, SMELT__PT_DV,
  SMELT__PT_GRAD_IDS, SMELT__PT_GRAD_COUNT, SMELT__PT_DU_ROWS, SMELT__PT_DV_ROWS,
  SMELT__PT_ROLES
};

/* What a run asks of the backend (smelt__backend.run's args). */
typedef enum smelt__peer_mode { SMELT__PEER_RETRIEVE, SMELT__PEER_FORWARD, SMELT__PEER_BACKWARD } smelt__peer_mode;
typedef struct smelt__peer_args {
  smelt__peer_mode mode;
  const smelt_peer_weights *w;
  const smelt_peer_grads *g;            /* the backward's */
  const smelt_tensor *t[SMELT__PT_ROLES]; /* by role, validated; NULL where absent */
} smelt__peer_args;

/* The plan's resolved description (plan->opdata). */
typedef struct smelt__peer_state {
  smelt_peer_config cfg;      /* sub_key_sizes filled in */
  int64_t T, din, dout, N, k, h, he, dq, dsub;
  int p;
  int64_t n[SMELT_PEER_MAX_DIMS];
  int norm_per_head;          /* norm params are [h, dq] (else [dq], shared) */
  smelt_tensor t[SMELT__PT_ROLES]; /* planned views by role; ndim -1 = absent (a run's own roles always) */
  smelt_peer_store *store;    /* NULL: dense u, v */
  /* CUDA backend state (src/cuda/peer_select.c), freed with cuda_free. */
  void *cuda;
  void (*cuda_free)(void *cuda);
} smelt__peer_state;

/* ---- the store */
struct smelt__peer_store_cuda;

struct smelt_peer_store {
  smelt_ctx *ctx;
  int64_t N, din, dout, he;
  smelt_dtype dtype;
  int64_t ulen, vlen;  /* elements of U_e and V_e */
  uint64_t slot_bytes; /* (ulen + vlen) * dtype size */
  int64_t slots;
  double cache_mb;
  int managed;
  void *u_host, *v_host; /* the tables (host addresses) */
  /* Policy state. On the CPU backend these are host arrays; on CUDA they
   * live on the device (struct smelt__peer_store_cuda) and these are NULL. */
  int32_t *table;  /* [N] slot of expert, -1 = not resident */
  int32_t *owner;  /* [S] expert in slot, -1 = free */
  uint8_t *ref;    /* [S] reference bits */
  uint32_t *pin;   /* [S] batch number that pinned the slot */
  uint64_t *heat;  /* [N] uses */
  int64_t hand;
  uint32_t batch;  /* batches run; pin[s] == batch means pinned in the current one */
  smelt_peer_store_stats stats; /* CPU backend counters */
  struct smelt__peer_store_cuda *cuda;
  int busy; /* 1 while a call is inside the store; atomic (smelt__peer_store_enter) */
};

/* The store's check of the one-thread rule (include/smelt.h): every call
 * that reads or changes the policy state enters the store first and leaves
 * it after; entering a store another thread is inside fails with
 * INVALID_ARGUMENT, naming `op`, and changes nothing. */
smelt_status smelt__peer_store_enter(smelt_peer_store *st, const char *op);
void smelt__peer_store_leave(smelt_peer_store *st);

/* Runs one batch of the policy on the CPU backend's state (ids validated to
 * be in [0, N)); fails only when the store is in use (`op` names the caller). */
smelt_status smelt__peer_store_batch_cpu(smelt_peer_store *st, const int64_t *ids, int64_t n, const char *op);

/* ---- the backends: smelt__cpu_peer (src/cpu/peer.c) and smelt__cuda_peer
 * (src/cuda/peer_select.c), declared by src/core/internal.h; the store's
 * CUDA half (src/cuda/peer_store_cuda.c). */
smelt_status smelt__cuda_peer_store_create(smelt_peer_store *st);
void smelt__cuda_peer_store_destroy(smelt_peer_store *st);
smelt_status smelt__cuda_peer_store_write(smelt_peer_store *st, int64_t first, int64_t count, const void *u_rows,
                                          const void *v_rows);
smelt_status smelt__cuda_peer_store_invalidate(smelt_peer_store *st);
/* One batch of the policy over n ids at ids_dev (i64, device), then the
 * staging copies; stream-ordered, no host synchronization. Enters the store
 * itself. */
smelt_status smelt__cuda_peer_store_batch(smelt_peer_store *st, const int64_t *ids_dev, int64_t n);
smelt_status smelt__cuda_peer_store_stats(smelt_peer_store *st, smelt_peer_store_stats *out);
smelt_status smelt__cuda_peer_store_stats_reset(smelt_peer_store *st);
smelt_status smelt__cuda_peer_store_heat(smelt_peer_store *st, int64_t first, int64_t count, uint64_t *out);
/* Device addresses the expert kernels read: the table (NULL without a
 * cache), the slots' U and V arrays and the mapped host tables. */
void smelt__cuda_peer_store_views(const smelt_peer_store *st, const int32_t **table, const void **u_cache,
                                  const void **v_cache, const void **u_host, const void **v_host);

#endif /* SMELT_PEER_INTERNAL_H */
