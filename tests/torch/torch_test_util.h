// Helpers shared by the bridge tests (CPU and CUDA): channels in forked
// processes, the tensors both sides build from the same formula, and checks
// that an expression throws tshare::torch::Error with a given code.
#ifndef TSHARE_TEST_TORCH_UTIL_H
#define TSHARE_TEST_TORCH_UTIL_H

#include "harness.h"
#include "proc_util.h"
#include "tshare/torch.h"

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace tt = tshare::torch;

static inline tshare_channel *open_channel(int fd, const char *name, tshare_release_cb cb = nullptr,
                                           void *cb_user = nullptr) {
  return open_socket_channel(fd, name, cb, cb_user);
}

// Say bye, then wait until the peer released everything sent on ch.
static inline void bye_and_wait_released(tshare_channel *ch, int timeout_ms) {
  CHECK_RC(tshare_channel_send_bye(ch, 0, timeout_ms), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, timeout_ms), TSHARE_OK, tshare_channel_last_error(ch));
}

// Every dtype the bridge carries.
static const std::vector<at::ScalarType> all_dtypes = {
    at::kBool,  at::kByte,     at::kChar,  at::kShort,  at::kInt,          at::kLong,
    at::kHalf,  at::kBFloat16, at::kFloat, at::kDouble, at::kComplexFloat, at::kComplexDouble};

// A recognisable pattern of n values in dtype t (exact in every dtype).
static inline at::Tensor pattern(at::ScalarType t, int64_t n, const at::Device &device = at::kCPU) {
  at::Tensor x = at::arange(n, at::TensorOptions().dtype(at::kDouble));
  if (t == at::kBool) return (x.fmod(3) == 0).to(device);
  if (t == at::kByte || t == at::kChar) return x.fmod(100).to(device, t);
  if (t == at::kComplexFloat || t == at::kComplexDouble)
    return at::complex(x, -x).to(device, t);
  return (x - 7).to(device, t);
}

// The layouts tests send, each a view of a 4x5x6 float base.
static inline std::vector<std::pair<std::string, at::Tensor>> layouts_of(const at::Tensor &base) {
  using at::indexing::None;
  using at::indexing::Slice;
  return {
      {"whole", base},
      {"transposed", base.transpose(0, 2)},
      {"step 2", base.index({Slice(), Slice(1, None, 2)})},
      {"offset row", base[2]},
      {"expanded", base[0][0].unsqueeze(0).expand({3, 6})},
      {"scalar", base[1][2][3]},
      {"empty", base.narrow(0, 1, 0)},
      {"permuted narrow", base.permute({1, 0, 2}).narrow(2, 3, 2)},
  };
}

#define CHECK_THROWS_CODE(expr, want_code, want_text)                                                                  \
  do {                                                                                                                 \
    bool thrown_ = false;                                                                                              \
    try {                                                                                                              \
      (void)(expr);                                                                                                    \
    } catch (const tt::Error &e_) {                                                                                    \
      thrown_ = true;                                                                                                  \
      if (e_.code() != (want_code))                                                                                    \
        TS_FAIL("%s threw %s, expected %s: %s", #expr, tshare_status_name(e_.code()), tshare_status_name(want_code),   \
                e_.what());                                                                                            \
      if (!strstr(e_.what(), (want_text))) TS_FAIL("%s: message '%s' lacks '%s'", #expr, e_.what(), (want_text));      \
    }                                                                                                                  \
    if (!thrown_) TS_FAIL("%s did not throw", #expr);                                                                  \
  } while (0)

#endif
