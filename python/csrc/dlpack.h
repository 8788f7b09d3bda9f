/* The DLPack ABI as the binding consumes and produces it: DLPack 1.x
 * (DLManagedTensorVersioned, the legacy DLManagedTensor, and the 1.2+
 * "exchange API" function table that frameworks expose on their tensor type).
 *
 * These are our own declarations of the published ABI, written from the
 * DLPack specification (dlpack.h 1.1-1.3), prefixed smpy_dl_ so they can never
 * clash with a framework's copy of the header. Only the layout matters: every
 * struct here must match the specification field for field. */
#ifndef SMPY_DLPACK_H
#define SMPY_DLPACK_H

#include <stdint.h>

/* Device types (DLDeviceType). */
enum {
  SMPY_DL_CPU = 1,
  SMPY_DL_CUDA = 2,
  SMPY_DL_CUDA_HOST = 3, /* pinned host memory: CPU-accessible */
  SMPY_DL_OPENCL = 4,
  SMPY_DL_VULKAN = 7,
  SMPY_DL_METAL = 8,
  SMPY_DL_ROCM = 10,
  SMPY_DL_ROCM_HOST = 11,
  SMPY_DL_CUDA_MANAGED = 13, /* cudaMallocManaged: treated as the CUDA device */
  SMPY_DL_ONEAPI = 14
};

/* Type codes (DLDataTypeCode); the fp8 codes arrived in DLPack 1.1. */
enum {
  SMPY_DL_INT = 0,
  SMPY_DL_UINT = 1,
  SMPY_DL_FLOAT = 2,
  SMPY_DL_OPAQUE = 3,
  SMPY_DL_BFLOAT = 4,
  SMPY_DL_COMPLEX = 5,
  SMPY_DL_BOOL = 6,
  SMPY_DL_FLOAT8_E3M4 = 7,
  SMPY_DL_FLOAT8_E4M3 = 8,
  SMPY_DL_FLOAT8_E4M3B11FNUZ = 9,
  SMPY_DL_FLOAT8_E4M3FN = 10,
  SMPY_DL_FLOAT8_E4M3FNUZ = 11,
  SMPY_DL_FLOAT8_E5M2 = 12,
  SMPY_DL_FLOAT8_E5M2FNUZ = 13,
  SMPY_DL_FLOAT8_E8M0FNU = 14
};

/* DLManagedTensorVersioned.flags bits. */
#define SMPY_DL_FLAG_READ_ONLY ((uint64_t)1 << 0)
#define SMPY_DL_FLAG_IS_COPIED ((uint64_t)1 << 1)

typedef struct smpy_dl_version {
  uint32_t major;
  uint32_t minor;
} smpy_dl_version;

typedef struct smpy_dl_device {
  int32_t device_type; /* an enum in the specification; int32_t-sized */
  int32_t device_id;
} smpy_dl_device;

typedef struct smpy_dl_dtype {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} smpy_dl_dtype;

typedef struct smpy_dl_tensor {
  void *data;
  smpy_dl_device device;
  int32_t ndim;
  smpy_dl_dtype dtype;
  int64_t *shape;
  int64_t *strides; /* in elements; NULL means row-major contiguous */
  uint64_t byte_offset;
} smpy_dl_tensor;

/* Legacy (pre-1.0) managed tensor: capsule name "dltensor". */
typedef struct smpy_dl_managed {
  smpy_dl_tensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct smpy_dl_managed *self);
} smpy_dl_managed;

/* DLPack 1.x managed tensor: capsule name "dltensor_versioned". */
typedef struct smpy_dl_managed_v {
  smpy_dl_version version;
  void *manager_ctx;
  void (*deleter)(struct smpy_dl_managed_v *self);
  uint64_t flags;
  smpy_dl_tensor dl_tensor;
} smpy_dl_managed_v;

/* ---- The exchange API (DLPack 1.2+): a table of C functions a framework
 * publishes on its tensor type (torch >= 2.10: type(t).__dlpack_c_exchange_api__,
 * a PyCapsule named "dlpack_exchange_api"; newer spelling
 * __c_dlpack_exchange_api__ as an int). None of these synchronize: the consumer
 * asks current_work_stream for the producer's stream and launches on it. */
typedef int (*smpy_dl_allocator_fn)(smpy_dl_tensor *prototype, smpy_dl_managed_v **out, void *error_ctx,
                                    void (*set_error)(void *error_ctx, const char *kind, const char *message));
typedef int (*smpy_dl_from_py_managed_fn)(void *py_object, smpy_dl_managed_v **out);
typedef int (*smpy_dl_to_py_fn)(smpy_dl_managed_v *tensor, void **out_py_object);
typedef int (*smpy_dl_from_py_view_fn)(void *py_object, smpy_dl_tensor *out);
typedef int (*smpy_dl_current_stream_fn)(int32_t device_type, int32_t device_id, void **out_stream);

typedef struct smpy_dl_api_header {
  smpy_dl_version version;
  struct smpy_dl_api_header *prev_api;
} smpy_dl_api_header;

typedef struct smpy_dl_exchange_api {
  smpy_dl_api_header header;
  smpy_dl_allocator_fn managed_tensor_allocator;
  smpy_dl_from_py_managed_fn managed_tensor_from_py_object_no_sync;
  smpy_dl_to_py_fn managed_tensor_to_py_object_no_sync;
  smpy_dl_from_py_view_fn dltensor_from_py_object_no_sync; /* may be NULL */
  smpy_dl_current_stream_fn current_work_stream;
} smpy_dl_exchange_api;

#endif /* SMPY_DLPACK_H */
