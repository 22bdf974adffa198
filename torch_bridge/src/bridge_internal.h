// What the bridge's modules share inside the library (hidden: not exported):
// errors with the "tshare: " prefix, the checks every sent tensor passes, a
// tensor's layout on the wire, and which memory a CPU tensor lives in.
#ifndef TSHARE_TORCH_BRIDGE_INTERNAL_H
#define TSHARE_TORCH_BRIDGE_INTERNAL_H

#include "tshare/torch.h"

#include <ATen/MapAllocator.h>

#include <string>

namespace tshare {
namespace torch {
namespace detail {

[[noreturn]] void fail(int code, const std::string &message);
[[noreturn]] void fail_channel(tshare_channel *ch, int code, const char *what);

// Everything a send refuses (undefined, sparse, quantized, ...), each with
// what to do instead.
void check_shareable(const at::Tensor &t);

// t's layout with byte_offset measured from base (empty tensors: 0).
tshare_tensor_desc describe(const at::Tensor &t, const void *base);

// The tshare host buffer (memfd) t's storage lives in, or nullptr.
tshare_host_buffer *host_buffer_of(const at::Tensor &t);
// The at::MapAllocator of a CPU tensor in torch's own shared memory with its
// fd kept open (Tensor::share_memory_(), the file_descriptor strategy), else null.
at::MapAllocator *torch_shared_map(const at::Tensor &t);
// A host buffer over that file (the caller's reference), holding the storage until its last share goes.
tshare_host_buffer *wrap_torch_shared(const at::Tensor &t, at::MapAllocator *map);
// True when t's storage is a tensor received from a peer (alone or in a set).
bool is_received(const at::Tensor &t);
// True when t's storage is a member of a set received from a peer.
bool is_set_member(const at::Tensor &t);
// A new view of the set member t's storage is (the caller's to release), or
// nullptr when t is no set member: what sending it on needs.
tshare_view *set_member_view(const at::Tensor &t);

} // namespace detail
} // namespace torch
} // namespace tshare

#endif
