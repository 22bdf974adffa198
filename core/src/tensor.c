#include "tshare/tensor.h"

#include "error_detail.h"
#include "wire_checks.h"
#include "tshare/errors.h"

#include <stdio.h>
#include <string.h>

size_t tshare_dtype_itemsize(tshare_dtype dtype) {
  if (dtype.lanes == 0 || dtype.bits == 0 || dtype.bits % 8 != 0) return 0;
  switch (dtype.code) {
  case TSHARE_DTYPE_INT:
  case TSHARE_DTYPE_UINT:
    if (dtype.bits > 64) return 0;
    break;
  case TSHARE_DTYPE_FLOAT:
    if (dtype.bits != 8 && dtype.bits != 16 && dtype.bits != 32 && dtype.bits != 64) return 0;
    break;
  case TSHARE_DTYPE_BFLOAT:
    if (dtype.bits != 16) return 0;
    break;
  case TSHARE_DTYPE_COMPLEX:
    if (dtype.bits != 32 && dtype.bits != 64 && dtype.bits != 128) return 0;
    break;
  case TSHARE_DTYPE_BOOL:
    if (dtype.bits != 8) return 0;
    break;
  default:
    return 0; /* opaque handles and unknown codes are not tensor elements */
  }
  return (size_t)(dtype.bits / 8) * dtype.lanes;
}

const char *tshare_dtype_name(tshare_dtype dtype, char *buf, size_t cap) {
  static const char *const names[] = {"int", "uint", "float", "handle", "bfloat", "complex", "bool"};
  if (!buf || cap == 0) return "";
  const char *base = dtype.code < sizeof names / sizeof names[0] ? names[dtype.code] : "dtype?";
  if (dtype.code == TSHARE_DTYPE_BOOL && dtype.lanes == 1)
    snprintf(buf, cap, "bool");
  else if (dtype.lanes == 1)
    snprintf(buf, cap, "%s%u", base, (unsigned)dtype.bits);
  else
    snprintf(buf, cap, "%s%ux%u", base, (unsigned)dtype.bits, (unsigned)dtype.lanes);
  return buf;
}

uint64_t tshare_tensor_numel(const tshare_tensor_desc *desc) {
  if (!desc || desc->ndim < 0 || desc->ndim > TSHARE_MAX_NDIM) return 0;
  uint64_t n = 1;
  for (int i = 0; i < desc->ndim; i++) {
    if (desc->shape[i] < 0) return 0;
    if (__builtin_mul_overflow(n, (uint64_t)desc->shape[i], &n)) return 0;
  }
  return n;
}

void tshare_tensor_set_contiguous(tshare_tensor_desc *desc) {
  int64_t stride = 1;
  for (int i = desc->ndim - 1; i >= 0; i--) {
    desc->strides[i] = stride;
    stride *= desc->shape[i] > 0 ? desc->shape[i] : 1;
  }
}

tshare_tensor_desc tshare_tensor_contiguous(tshare_dtype dtype, int32_t ndim, const int64_t *shape,
                                            uint64_t byte_offset) {
  tshare_tensor_desc d;
  memset(&d, 0, sizeof d);
  d.dtype = dtype;
  d.ndim = ndim;
  d.byte_offset = byte_offset;
  int32_t copy = ndim < 0 ? 0 : ndim > TSHARE_MAX_NDIM ? TSHARE_MAX_NDIM : ndim;
  for (int32_t i = 0; i < copy; i++) d.shape[i] = shape[i];
  if (copy == ndim) tshare_tensor_set_contiguous(&d);
  return d;
}

int ts_tensor_check(const tshare_tensor_desc *desc, uint64_t alloc_size, uint64_t *span_begin, uint64_t *span_end,
                        char *err, size_t err_cap) {
  if (!desc) return ts_errf(err, err_cap, TSHARE_E_INVALID_ARG, "tensor descriptor is NULL");
  size_t itemsize = tshare_dtype_itemsize(desc->dtype);
  if (itemsize == 0)
    return ts_errf(err, err_cap, TSHARE_E_MALFORMED,
                   "dtype {code %u, bits %u, lanes %u} is not a supported element type", (unsigned)desc->dtype.code,
                   (unsigned)desc->dtype.bits, (unsigned)desc->dtype.lanes);
  if (desc->ndim < 0 || desc->ndim > TSHARE_MAX_NDIM)
    return ts_errf(err, err_cap, TSHARE_E_TOO_LARGE, "ndim %d outside 0..%d", (int)desc->ndim, TSHARE_MAX_NDIM);

  /* Element offsets (in elements, relative to element [0..0]) reached by the
   * view lie in [lo, hi]; negative strides move lo down. */
  int64_t lo = 0, hi = 0;
  int empty = 0;
  for (int i = 0; i < desc->ndim; i++) {
    if (desc->shape[i] < 0)
      return ts_errf(err, err_cap, TSHARE_E_MALFORMED, "shape[%d] = %lld is negative", i, (long long)desc->shape[i]);
    if (desc->shape[i] == 0) empty = 1;
  }
  if (tshare_tensor_numel(desc) == 0 && !empty)
    return ts_errf(err, err_cap, TSHARE_E_OVERFLOW, "element count overflows 64 bits");
  if (!empty) {
    for (int i = 0; i < desc->ndim; i++) {
      int64_t reach;
      if (__builtin_mul_overflow(desc->shape[i] - 1, desc->strides[i], &reach))
        return ts_errf(err, err_cap, TSHARE_E_OVERFLOW, "shape[%d] * strides[%d] overflows", i, i);
      if (reach >= 0 ? __builtin_add_overflow(hi, reach, &hi) : __builtin_add_overflow(lo, reach, &lo))
        return ts_errf(err, err_cap, TSHARE_E_OVERFLOW, "extent of dimension %d overflows", i);
    }
  }
  /* Byte span: [byte_offset + lo*itemsize, byte_offset + (hi+1)*itemsize). */
  int64_t lo_bytes, hi_bytes;
  if (__builtin_mul_overflow(lo, (int64_t)itemsize, &lo_bytes) ||
      __builtin_mul_overflow(hi + 1, (int64_t)itemsize, &hi_bytes))
    return ts_errf(err, err_cap, TSHARE_E_OVERFLOW, "extent times itemsize %zu overflows", itemsize);
  if (desc->byte_offset > alloc_size)
    return ts_errf(err, err_cap, TSHARE_E_OUT_OF_BOUNDS, "byte_offset %llu past allocation size %llu",
                   (unsigned long long)desc->byte_offset, (unsigned long long)alloc_size);
  uint64_t begin = desc->byte_offset, end = desc->byte_offset;
  if (!empty) {
    /* lo_bytes <= 0; its magnitude taken in unsigned arithmetic, where
     * INT64_MIN (a peer's stride) has one and negating it would be UB. */
    uint64_t below = 0u - (uint64_t)lo_bytes;
    if (below > desc->byte_offset)
      return ts_errf(err, err_cap, TSHARE_E_OUT_OF_BOUNDS, "negative strides reach %llu bytes before byte_offset %llu",
                     (unsigned long long)below, (unsigned long long)desc->byte_offset);
    begin = desc->byte_offset - below;
    if (__builtin_add_overflow(desc->byte_offset, (uint64_t)hi_bytes, &end))
      return ts_errf(err, err_cap, TSHARE_E_OVERFLOW, "byte_offset + extent overflows");
    if (end > alloc_size)
      return ts_errf(err, err_cap, TSHARE_E_OUT_OF_BOUNDS, "view ends at byte %llu, past allocation size %llu",
                     (unsigned long long)end, (unsigned long long)alloc_size);
  }
  if (span_begin) *span_begin = begin;
  if (span_end) *span_end = end;
  return TSHARE_OK;
}

int tshare_tensor_check(const tshare_tensor_desc *desc, uint64_t alloc_size, uint64_t *span_begin, uint64_t *span_end,
                        tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  int rc = ts_tensor_check(desc, alloc_size, span_begin, span_end, msg, sizeof msg);
  ts_error_fill(err, rc, msg);
  return rc;
}
