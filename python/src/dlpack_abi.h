/* dlpack_abi.h - the DLPack structs as the DLPack specification lays them out
 * (v1.0: DLManagedTensor and DLManagedTensorVersioned). Declared here rather
 * than vendored: only the layout matters, and it is a stable ABI that every
 * framework reads the same way. */
#ifndef TSHARE_PY_DLPACK_ABI_H
#define TSHARE_PY_DLPACK_ABI_H

#include <stdint.h>

typedef struct {
  int32_t device_type; /* kDLCPU = 1, kDLCUDA = 2: tshare's TSHARE_DEVICE_* */
  int32_t device_id;
} DLDevice;

typedef struct {
  uint8_t code; /* tshare's TSHARE_DTYPE_* are DLPack's codes */
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides; /* in elements */
  uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* Capsule names: a consumer renames the capsule once it owns the tensor. */
#define DLPACK_CAPSULE "dltensor"
#define DLPACK_CAPSULE_USED "used_dltensor"
#define DLPACK_CAPSULE_VERSIONED "dltensor_versioned"
#define DLPACK_CAPSULE_VERSIONED_USED "used_dltensor_versioned"

#endif /* TSHARE_PY_DLPACK_ABI_H */
