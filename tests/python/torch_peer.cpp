// A LibTorch role for tshare-launch, the C++ side of the Python interop tests:
// it produces or consumes the tensors of cases.py, built the same way (element
// k of the 4x6 base is k % 61; bool: k % 3 == 0; a layout is a view of it).
//
//   torch_peer produce [--device cpu|cuda]     torch_peer consume [--device cpu|cuda]
//   torch_peer produce-set                     torch_peer consume-set
//
// The set modes hand every case over in one tensor set (CPU): names are the
// case names, the metadata "cases", the layouts of one dtype views of one
// shared base.
#include <tshare/torch.h>
#include <tshare/torch_set.h>

#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <map>
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

const char kSetMeta[] = "cases"; // what peer.py expects of a set

// The Python peers import torch before they answer the hello: on a loaded
// machine that takes longer than the default 10 s (well within the test's
// 100 s launcher timeout).
const tshare_channel_options *hello_options() {
  static tshare_channel_options opts = [] {
    tshare_channel_options o;
    tshare_channel_options_init(&o);
    o.handshake_timeout_ms = 60000;
    return o;
  }();
  return &opts;
}

// Every case, the layouts of one dtype on one shared base.
tshare::torch::NamedTensors all_cases() {
  tshare::torch::NamedTensors out;
  for (const auto &d : kDtypes) {
    at::Tensor b = base(d.second, "cpu");
    for (const auto &l : kLayouts) out.emplace_back(d.first + "/" + l, layout(b, l));
  }
  return out;
}

std::vector<tshare::torch::ChannelPtr> open_channels(tshare_role &role) {
  std::vector<tshare::torch::ChannelPtr> channels;
  for (int i = 0; i < role.nchannels; i++) {
    tshare_channel *ch = nullptr;
    tshare_error err;
    if (tshare_role_open_channel(&role, i, hello_options(), &ch, &err) != TSHARE_OK)
      throw std::runtime_error(err.message);
    channels.emplace_back(ch);
  }
  return channels;
}

int wait_all_released(std::vector<tshare::torch::ChannelPtr> &channels) {
  for (auto &ch : channels)
    if (tshare_channel_wait_released(ch.get(), 0, 60000) != TSHARE_OK) {
      std::fprintf(stderr, "torch_peer: %s\n", tshare_channel_last_error(ch.get()));
      return 1;
    }
  return 0;
}

int produce_set(tshare_role &role) {
  auto channels = open_channels(role);
  tshare::torch::NamedTensors cases = all_cases();
  tshare::torch::SetOptions o;
  o.meta = kSetMeta;
  o.timeout_ms = 30000;
  for (auto &ch : channels) tshare::torch::send_set(ch.get(), cases, o);
  if (wait_all_released(channels) != 0) return 1;
  tshare_role_report(&role, "shared", static_cast<long long>(cases.size()));
  std::printf("LibTorch producer: shared %zu tensors in one set\n", cases.size());
  return 0;
}

int consume_sets(tshare_role &role) {
  tshare_channel *raw = nullptr;
  tshare_error err;
  if (tshare_role_open_channel(&role, 0, hello_options(), &raw, &err) != TSHARE_OK) throw std::runtime_error(err.message);
  tshare::torch::ChannelPtr ch(raw);
  tshare::torch::RecvOptions o;
  o.timeout_ms = 60000;
  int verified = 0;
  while (auto r = tshare::torch::recv_set(ch.get(), o)) {
    if (r->meta != kSetMeta) {
      std::fprintf(stderr, "LibTorch consumer: WRONG set metadata '%s'\n", r->meta.c_str());
      return 1;
    }
    for (const auto &item : r->tensors) {
      std::string why = check(item.key(), item.value(), "cpu");
      if (!why.empty()) {
        std::fprintf(stderr, "LibTorch consumer: WRONG %s\n", why.c_str());
        return 1;
      }
      verified++;
    }
  }
  tshare_role_report(&role, "verified", verified);
  std::printf("LibTorch consumer: verified %d tensors in sets\n", verified);
  return 0;
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
    if (mode == "produce-set") return produce_set(role);
    if (mode == "consume-set") return consume_sets(role);
    if (mode == "produce") {
      auto channels = open_channels(role);
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
      if (wait_all_released(channels) != 0) return 1;
      tshare_role_report(&role, "shared", shared);
      std::printf("LibTorch producer: shared %d tensors\n", shared);
      return 0;
    }
    tshare_channel *raw = nullptr;
    if (tshare_role_open_channel(&role, 0, hello_options(), &raw, &err) != TSHARE_OK) {
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
