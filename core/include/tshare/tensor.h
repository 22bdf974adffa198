/* tshare/tensor.h - how a shared tensor is described: dtype, device, layout.
 *
 * Dtype and device codes are DLPack's (dlpack.h: DLDataTypeCode, DLDeviceType),
 * so a descriptor converts to a DLTensor field by field. A descriptor does not
 * own or point at memory: it says where inside an allocation the tensor lives
 * (byte_offset) and how its elements are laid out (shape, strides in elements).
 */
#ifndef TSHARE_TENSOR_H
#define TSHARE_TENSOR_H

#include "tshare/errors.h"
#include "tshare/version.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Hard maximum of dimensions a descriptor can hold; the wire limit
 * (tshare_wire_limits.max_ndim) may be lower, never higher. */
#define TSHARE_MAX_NDIM 32

/* DLPack DLDataTypeCode values. */
enum {
  TSHARE_DTYPE_INT = 0,
  TSHARE_DTYPE_UINT = 1,
  TSHARE_DTYPE_FLOAT = 2,
  TSHARE_DTYPE_OPAQUE_HANDLE = 3, /* rejected: not a tensor element */
  TSHARE_DTYPE_BFLOAT = 4,
  TSHARE_DTYPE_COMPLEX = 5,
  TSHARE_DTYPE_BOOL = 6
};

/* DLPack DLDeviceType values that tshare can share. */
enum { TSHARE_DEVICE_CPU = 1, TSHARE_DEVICE_CUDA = 2 };

typedef struct tshare_dtype {
  uint8_t code;   /* TSHARE_DTYPE_* */
  uint8_t bits;   /* bits per lane: 8, 16, 32, 64, 128 */
  uint16_t lanes; /* 1 for scalars */
} tshare_dtype;

typedef struct tshare_tensor_desc {
  tshare_dtype dtype;
  int32_t ndim;                     /* 0 .. TSHARE_MAX_NDIM */
  int64_t shape[TSHARE_MAX_NDIM];   /* each >= 0 */
  int64_t strides[TSHARE_MAX_NDIM]; /* in elements, may be negative or zero */
  uint64_t byte_offset;             /* of element [0,...,0] from the allocation base */
} tshare_tensor_desc;

/* Bytes per element, or 0 if the dtype is not one tshare accepts
 * (unknown code, bits not a multiple of 8, zero lanes, bool not 8 bits). */
TSHARE_API size_t tshare_dtype_itemsize(tshare_dtype dtype);

/* Short name such as "float32", "bfloat16", "complex64", "int8x4"; never NULL. */
TSHARE_API const char *tshare_dtype_name(tshare_dtype dtype, char *buf, size_t cap);

/* Number of elements (product of shape); 0 on overflow or for a bad shape. */
TSHARE_API uint64_t tshare_tensor_numel(const tshare_tensor_desc *desc);

/* Fill row-major contiguous strides for desc->shape. */
TSHARE_API void tshare_tensor_set_contiguous(tshare_tensor_desc *desc);

/* A row-major contiguous descriptor of ndim dims (shape[0..ndim)) starting
 * byte_offset bytes into its allocation. An ndim outside 0..TSHARE_MAX_NDIM is
 * kept as given (only the first TSHARE_MAX_NDIM sizes are copied), so sharing
 * it fails with TSHARE_E_TOO_LARGE instead of overflowing here. */
TSHARE_API tshare_tensor_desc tshare_tensor_contiguous(tshare_dtype dtype, int32_t ndim, const int64_t *shape,
                                                       uint64_t byte_offset);

/* Check a descriptor against an allocation of alloc_size bytes: dtype valid,
 * ndim in range, shape non-negative, no overflow in shape/stride/itemsize
 * arithmetic, and every byte any element touches inside [0, alloc_size).
 * On success span_begin and span_end (optional) get the byte range touched
 * (equal for an empty tensor). On failure returns TSHARE_E_MALFORMED,
 * TSHARE_E_OVERFLOW or TSHARE_E_OUT_OF_BOUNDS and err (optional) says which
 * field. */
TSHARE_API int tshare_tensor_check(const tshare_tensor_desc *desc, uint64_t alloc_size, uint64_t *span_begin,
                                   uint64_t *span_end, tshare_error *err);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_TENSOR_H */
