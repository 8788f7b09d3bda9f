/* The GEMM autotuner's internal interface (src/cuda/gemm_tune.c): the
 * tuning record (key, file format, where it lives) and the hook planning
 * calls to learn whether a record, or a tuning run in progress, names the
 * kernel to use instead of the heuristic's. */
#ifndef SMELT_GEMM_TUNE_H
#define SMELT_GEMM_TUNE_H

#include "gemm_cuda.h"

#define SMELT__TUNE_KEY_MAX 768 /* room for any 255-character device name */

/* One record: the winner for a key. */
typedef struct smelt__gemm_tune_record {
  char key[SMELT__TUNE_KEY_MAX];
  char version[32];     /* smelt's version that wrote it */
  char kernel[96];      /* module name of the winner (smelt__gemm_kernel_src) */
  int split_k;          /* >= 1 */
  double median_ms;     /* the winner's time */
  char heuristic[96];   /* what the heuristic picked, and its time (for people reading the file) */
  int heuristic_split_k;
  double heuristic_ms;
  int64_t m, n, k, l;   /* the exact problem that was tuned */
} smelt__gemm_tune_record;

/* Why a record was not used. */
typedef enum smelt__tune_verdict {
  SMELT__TUNE_USED = 0,
  SMELT__TUNE_ABSENT,   /* no file (or no cache folder) */
  SMELT__TUNE_CORRUPT,  /* does not parse */
  SMELT__TUNE_VERSION,  /* written by another version of smelt */
  SMELT__TUNE_FOREIGN,  /* made for another device or problem (its key differs) */
  SMELT__TUNE_UNFIT,    /* its kernel is unknown or cannot run these operands */
  SMELT__TUNE_OFF       /* SMELT_GEMM_TUNE=off */
} smelt__tune_verdict;

/* The key of st's problem on dev (st as the core resolved it, before the
 * backend fixes split-K). Returns 0, or -1 for modes that are not tuned
 * (array, grouped). */
int smelt__gemm_tune_key(const smelt__gemm_state *st, const smelt_device_info *dev, char *key, size_t n);
/* The record file for a key under the cache folder ("" when there is none). */
void smelt__gemm_tune_path(const char *key, char *path, size_t n);

/* Record <-> file text. format returns the length written (< n). parse
 * returns 0, or -1 with the reason in why. */
int smelt__gemm_tune_format(const smelt__gemm_tune_record *r, char *text, size_t n);
int smelt__gemm_tune_parse(const char *text, smelt__gemm_tune_record *r, char *why, size_t why_n);

/* Writes r to its path (atomically). SMELT_OK, or CACHE_ERROR / IO_ERROR. */
smelt_status smelt__gemm_tune_store(const smelt__gemm_tune_record *r);
/* Reads the record for key. USED when it parsed and its key and version
 * match; otherwise a verdict, with a log line for CORRUPT, VERSION and
 * FOREIGN. */
smelt__tune_verdict smelt__gemm_tune_load(const char *key, smelt__gemm_tune_record *r);

/* The planning hook (src/cuda/op_gemm.c), after the heuristic chose
 * *kernel: while smelt_gemm_autotune plans a candidate on this thread,
 * that candidate; else a valid record's kernel when it is one of the
 * candidates for these operands. Updates *kernel and why and returns the
 * split_k to use when the plan leaves it to smelt (0: decide as usual). */
int smelt__gemm_tune_choice(const smelt__gemm_state *st, const smelt__gemm_facts *f, const smelt_device_info *dev,
                            const smelt__gemm_kernel *table, int n, int *kernel, char *why, size_t why_n);
/* The same decision with its verdict (for tests): USED when it changed the choice. */
smelt__tune_verdict smelt__gemm_tune_lookup(const smelt__gemm_state *st, const smelt__gemm_facts *f,
                                            const smelt_device_info *dev, const smelt__gemm_kernel *table, int n,
                                            int *kernel, int *split_k);

#endif /* SMELT_GEMM_TUNE_H */
