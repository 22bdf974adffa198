// What the set modules share inside the bridge (hidden: not exported): a
// set built from named tensors into a C builder, and one builder sent to
// one channel or to many.
#ifndef TSHARE_TORCH_SET_INTERNAL_H
#define TSHARE_TORCH_SET_INTERNAL_H

#include "tshare/torch_set.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tshare {
namespace torch {
namespace detail {

struct BuilderDeleter {
  void operator()(tshare_set_builder *b) const noexcept { tshare_set_builder_destroy(b); }
};
using BuilderPtr = std::unique_ptr<tshare_set_builder, BuilderDeleter>;

// A set's members by reference, whichever container the caller holds them in.
using MemberRefs = std::vector<std::pair<const std::string *, const at::Tensor *>>;
MemberRefs refs_of(const NamedTensors &tensors);
MemberRefs refs_of(const TensorDict &tensors);

// Every member checked, then a builder holding each one's memory, with the
// options' metadata. Throws naming the member at fault; nothing was sent.
BuilderPtr build_set(const MemberRefs &members, const SetOptions &options);

// The CUDA device of the set's CUDA members, or -1 when it has none.
int cuda_device_of(const MemberRefs &members);
// The current stream of that device (what the set is ordered after), or
// nullptr for -1.
void *current_stream_of(int device);

// One built set on one channel: its id, or Error naming what the channel said.
uint64_t send_builder(tshare_channel *ch, const tshare_set_builder *b, int timeout_ms);
// The fan-out of send_set_all with a built set.
std::vector<SendResult> send_builder_all(const std::vector<tshare_channel *> &channels, const tshare_set_builder *b,
                                         int timeout_ms, int release_timeout_ms);

} // namespace detail
} // namespace torch
} // namespace tshare

#endif
