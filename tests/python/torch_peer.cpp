// A LibTorch role for tshare-launch, the C++ side of the Python interop tests:
// it produces or consumes the tensors of cases.py, built the same way (element
// k of the 4x6 base is k % 61; bool: k % 3 == 0; a layout is a view of it).
//
//   torch_peer produce [--device cpu|cuda]     torch_peer consume [--device cpu|cuda]
#include <tshare/torch.h>

#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

const std::vector<std::pair<std::string, at::ScalarType>> kDtypes = {
  {"bool", at::kBool},       {"uint8", at::kByte},     {"int8", at::kChar},          {"int16", at::kShort},
  {"int32", at::kInt},       {"int64", at::kLong},     {"float16", at::kHalf},       {"bfloat16", at::kBFloat16},
  {"float32", at::kFloat},   {"float64", at::kDouble}, {"complex64", at::kComplexFloat},
  {"complex128", at::kComplexDouble}};
const std::vector<std::string> kLayouts = {"contiguous", "transposed", "sliced",  "strided",
                                           "expanded",   "scalar",     "empty",   "permuted3d"};

using torch::indexing::None;
using torch::indexing::Slice;

at::Tensor layout(const at::Tensor &b, const std::string &name) {
  if (name == "contiguous") return b;
  if (name == "transposed") return b.t();
  if (name == "sliced") return b.index({Slice(1, 3), Slice(2, 5)});
  if (name == "strided") return b.index({Slice(), Slice(None, None, 2)});
  if (name == "expanded") return b.index({Slice(1, 2)}).expand({3, 6});
  if (name == "scalar") return b.index({2, 3});
  if (name == "empty") return b.index({Slice(None, 0)});
  return b.view({2, 2, 6}).permute({2, 0, 1});
}

// The base, in memory that travels without a copy: shared memory on the CPU.
at::Tensor base(at::ScalarType type, const std::string &device) {
  at::Tensor k = torch::arange(24, torch::kLong);
  at::Tensor values = type == at::kBool ? (k.remainder(3) == 0) : k.remainder(61).to(type);
  values = values.view({4, 6});
  if (device == "cuda") return values.to(at::kCUDA);
  at::Tensor shared = tshare::torch::empty_shared({4, 6}, at::TensorOptions().dtype(type));
  shared.copy_(values);
  return shared;
}

at::Tensor make_case(const std::string &tag, const std::string &device) {
  size_t slash = tag.find('/');
  std::string dtype = tag.substr(0, slash), lay = tag.substr(slash + 1);
  for (const auto &d : kDtypes)
    if (d.first == dtype) return layout(base(d.second, device), lay);
  throw std::runtime_error("unknown case " + tag);
}

std::string check(const std::string &tag, const at::Tensor &t, const std::string &device) {
  at::Tensor want = make_case(tag, "cpu");
  if (t.scalar_type() != want.scalar_type()) return tag + ": dtype differs";
  if (t.sizes() != want.sizes() || (t.numel() && t.strides() != want.strides())) return tag + ": shape or strides differ";
  if ((device == "cuda") != t.is_cuda()) return tag + ": wrong device";
  if (!torch::equal(t.cpu(), want)) return tag + ": values differ";
  return "";
}

} // namespace

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  std::string mode = argv[1], device = "cpu";
  for (int i = 2; i + 1 < argc; i++)
    if (!std::strcmp(argv[i], "--device")) device = argv[i + 1];
  if (device == "cuda" && !torch::cuda::is_available()) {
    std::printf("SKIP: no CUDA device for LibTorch here\n");
    return 77;
  }
  tshare_role role;
  tshare_error err;
  if (tshare_role_from_env(&role, &err) != TSHARE_OK) {
    std::fprintf(stderr, "torch_peer: %s\n", err.message);
    return 2;
  }
  try {
    if (mode == "produce") {
      std::vector<tshare::torch::ChannelPtr> channels;
      for (int i = 0; i < role.nchannels; i++) {
        tshare_channel *ch = nullptr;
        if (tshare_role_open_channel(&role, i, nullptr, &ch, &err) != TSHARE_OK) {
          std::fprintf(stderr, "torch_peer: %s\n", err.message);
          return 1;
        }
        channels.emplace_back(ch);
      }
      int shared = 0;
      for (const auto &d : kDtypes) {
        for (const auto &l : kLayouts) {
          at::Tensor t = make_case(d.first + "/" + l, device);
          tshare::torch::SendOptions o;
          o.tag = d.first + "/" + l;
          o.timeout_ms = 30000;
          for (auto &ch : channels) tshare::torch::send(ch.get(), t, o);
          shared++;
        }
      }
      for (auto &ch : channels)
        if (tshare_channel_wait_released(ch.get(), 0, 60000) != TSHARE_OK) {
          std::fprintf(stderr, "torch_peer: %s\n", tshare_channel_last_error(ch.get()));
          return 1;
        }
      tshare_role_report(&role, "shared", shared);
      std::printf("LibTorch producer: shared %d tensors\n", shared);
      return 0;
    }
    tshare_channel *raw = nullptr;
    if (tshare_role_open_channel(&role, 0, nullptr, &raw, &err) != TSHARE_OK) {
      std::fprintf(stderr, "torch_peer: %s\n", err.message);
      return 1;
    }
    tshare::torch::ChannelPtr ch(raw);
    tshare::torch::RecvOptions o;
    o.timeout_ms = 60000;
    int verified = 0;
    while (auto r = tshare::torch::recv(ch.get(), o)) {
      std::string why = check(r->tag, r->tensor, device);
      if (!why.empty()) {
        std::fprintf(stderr, "LibTorch consumer: WRONG %s\n", why.c_str());
        return 1;
      }
      verified++;
    }
    tshare_role_report(&role, "verified", verified);
    std::printf("LibTorch consumer: verified %d tensors\n", verified);
    return 0;
  } catch (const std::exception &e) {
    std::fprintf(stderr, "torch_peer: %s\n", e.what());
    return 1;
  }
}
