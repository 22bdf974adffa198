// LibTorch dtypes <-> tshare's (DLPack's) dtype codes. Exhaustive both ways:
// anything without a DLPack code is an Error naming what to do instead.
#include "tshare/torch.h"

#include <string>

namespace tshare {
namespace torch {

tshare_dtype to_tshare_dtype(at::ScalarType type) {
  switch (type) {
  case at::kBool: return {TSHARE_DTYPE_BOOL, 8, 1};
  case at::kByte: return {TSHARE_DTYPE_UINT, 8, 1};
  case at::kChar: return {TSHARE_DTYPE_INT, 8, 1};
  case at::kShort: return {TSHARE_DTYPE_INT, 16, 1};
  case at::kInt: return {TSHARE_DTYPE_INT, 32, 1};
  case at::kLong: return {TSHARE_DTYPE_INT, 64, 1};
  case at::kHalf: return {TSHARE_DTYPE_FLOAT, 16, 1};
  case at::kBFloat16: return {TSHARE_DTYPE_BFLOAT, 16, 1};
  case at::kFloat: return {TSHARE_DTYPE_FLOAT, 32, 1};
  case at::kDouble: return {TSHARE_DTYPE_FLOAT, 64, 1};
  case at::kComplexFloat: return {TSHARE_DTYPE_COMPLEX, 64, 1};
  case at::kComplexDouble: return {TSHARE_DTYPE_COMPLEX, 128, 1};
  default:
    break;
  }
  const char *hint = c10::isQIntType(type) ? " (a quantized type: send int_repr() and the scale and zero point)"
                                           : " (convert it with .to() to a type tshare carries)";
  throw Error(TSHARE_E_UNSUPPORTED,
              std::string("tshare: dtype ") + c10::toString(type) + " has no DLPack code tshare carries" + hint);
}

at::ScalarType to_scalar_type(tshare_dtype d) {
  if (d.lanes == 1) {
    switch (d.code) {
    case TSHARE_DTYPE_BOOL:
      if (d.bits == 8) return at::kBool;
      break;
    case TSHARE_DTYPE_UINT:
      if (d.bits == 8) return at::kByte;
      break;
    case TSHARE_DTYPE_INT:
      switch (d.bits) {
      case 8: return at::kChar;
      case 16: return at::kShort;
      case 32: return at::kInt;
      case 64: return at::kLong;
      default: break;
      }
      break;
    case TSHARE_DTYPE_FLOAT:
      switch (d.bits) {
      case 16: return at::kHalf;
      case 32: return at::kFloat;
      case 64: return at::kDouble;
      default: break;
      }
      break;
    case TSHARE_DTYPE_BFLOAT:
      if (d.bits == 16) return at::kBFloat16;
      break;
    case TSHARE_DTYPE_COMPLEX:
      if (d.bits == 64) return at::kComplexFloat;
      if (d.bits == 128) return at::kComplexDouble;
      break;
    default:
      break;
    }
  }
  char name[32];
  throw Error(TSHARE_E_UNSUPPORTED, std::string("tshare: a shared dtype ") + tshare_dtype_name(d, name, sizeof name) +
                                        " has no LibTorch equivalent");
}

} // namespace torch
} // namespace tshare
