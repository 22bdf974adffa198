// Tensor sets through the bridge, the consumer's half: a received set in, one
// tensor per member out, all of them holding the set through one counted
// hold: the set handle, released once when the last tensor (and every
// tensor derived from them) is gone, on whichever thread that is.
//
// Per member that is one storage over the set's own pointer and a tensor
// on it (the device given, so nothing asks the driver where the pointer
// lives) and one count on the hold: no view, lock or allocation of the
// core's per member. A member sent on with send() gets its view then, on demand.
#include "tshare/torch_set.h"

#include "bridge_internal.h"

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>

#ifdef TSHARE_TORCH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <atomic>
#include <memory>
#include <string>

namespace tshare {
namespace torch {
namespace {

using detail::fail;
using detail::fail_channel;

struct SetHold;

// A member tensor's storage context: which set, which member (to make a
// view of it when the tensor is sent on).
struct MemberContext {
  SetHold *hold;
  size_t index;
};

// What a received set's tensors share: the set handle and one count per
// tensor, plus recv_set's own while it builds them.
struct SetHold {
  std::atomic<size_t> refs{1};
  tshare_set *set;
  std::unique_ptr<MemberContext[]> members;

  explicit SetHold(tshare_set *s) : set(s), members(new MemberContext[tshare_set_count(s)]) {
    for (size_t i = 0; i < tshare_set_count(s); i++) members[i] = {this, i};
  }
  void drop() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    tshare_set_release(set); // never blocks: the release goes out from here or the channel's next call
    delete this;
  }
};

// The deleter that marks a set member's storage; its address is the identity.
void drop_member(void *context) { static_cast<MemberContext *>(context)->hold->drop(); }

std::string member_label(const SetHold &hold, size_t i) {
  return "tensor " + std::to_string(i) + " ('" + tshare_set_name(hold.set, i) + "') of set " +
         std::to_string(tshare_set_id(hold.set));
}

at::Device member_device(const SetHold &hold, size_t i) {
  int index = tshare_set_cuda_device(hold.set, i);
  if (index < 0) return at::Device(at::kCPU);
#ifdef TSHARE_TORCH_CUDA
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
#else
  fail(TSHARE_E_UNSUPPORTED,
       "received set: " + member_label(hold, i) + " is GPU memory and this LibTorch (or tshare) was built without CUDA");
#endif
}

// The bytes a member's tensor spans from its first element: the core
// checked that they lie in its memory, so nothing here overflows.
size_t member_nbytes(const tshare_tensor_desc *d, size_t item) {
  int64_t last = 0;
  for (int32_t k = 0; k < d->ndim; k++) {
    if (d->shape[k] == 0) return 0;
    last += (d->shape[k] - 1) * d->strides[k];
  }
  return static_cast<size_t>(last + 1) * item;
}

// Member i over the set's memory, counted on the hold until its storage goes.
// Made as at::for_blob would make it (a storage over the member's bytes with
// the context deleter, a tensor on it), without the maker's checks and
// dispatch guard: a model's hundreds of members per hand-off.
at::Tensor member_tensor(SetHold &hold, size_t i) {
  const tshare_tensor_desc *d = tshare_set_desc(hold.set, i);
  at::ScalarType type = to_scalar_type(d->dtype);
  for (int32_t k = 0; k < d->ndim; k++)
    if (d->strides[k] < 0)
      fail(TSHARE_E_UNSUPPORTED, "received set: " + member_label(hold, i) + " has a negative stride (" +
                                     std::to_string(d->strides[k]) + " in dimension " + std::to_string(k) +
                                     "), which LibTorch tensors cannot have");
  at::Device device = member_device(hold, i);
  size_t nbytes = member_nbytes(d, c10::elementSize(type));
  hold.refs.fetch_add(1, std::memory_order_relaxed);
  // From here the data pointer owns the count: its deleter drops it even if
  // what follows throws, and the tensor's storage owns it afterwards.
  c10::DataPtr data(tshare_set_data(hold.set, i), &hold.members[i], &drop_member, device);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::computeDispatchKey(type, at::kStrided, device)),
      c10::scalarTypeToTypeMeta(type));
  impl->set_sizes_and_strides(at::IntArrayRef(d->shape, static_cast<size_t>(d->ndim)),
                              at::IntArrayRef(d->strides, static_cast<size_t>(d->ndim)));
  return at::Tensor(std::move(impl));
}

// A set's CUDA tensors are ready for work on the default stream (the set's
// event is waited for there): a current stream of another kind waits for it
// too, on the GPU.
void order_current_after_default(int device) {
#ifdef TSHARE_TORCH_CUDA
  auto index = static_cast<c10::DeviceIndex>(device);
  c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(index);
  c10::cuda::CUDAStream fallback = c10::cuda::getDefaultCUDAStream(index);
  if (current == fallback) return;
  at::cuda::CUDAEvent ready;
  ready.record(fallback);
  ready.block(current);
#else
  (void)device;
#endif
}

SetHold *hold_of(const at::Tensor &t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage()) return nullptr;
  const c10::DataPtr &p = t.storage().data_ptr();
  return p.get_deleter() == &drop_member ? static_cast<MemberContext *>(p.get_context())->hold : nullptr;
}

} // namespace

namespace detail {

bool is_set_member(const at::Tensor &t) { return hold_of(t) != nullptr; }

tshare_view *set_member_view(const at::Tensor &t) {
  if (!hold_of(t)) return nullptr;
  auto *member = static_cast<MemberContext *>(t.storage().data_ptr().get_context());
  tshare_view *view = nullptr;
  if (tshare_set_view(member->hold->set, member->index, &view) != TSHARE_OK)
    fail(TSHARE_E_NOMEM, "send (a tensor of a received set): out of memory");
  return view;
}

} // namespace detail

ReceivedSet adopt_set(tshare_set *set) {
  if (!set) fail(TSHARE_E_INVALID_ARG, "adopt_set: no set");
  SetHold *hold;
  try {
    hold = new SetHold(set);
  } catch (...) {
    tshare_set_release(set);
    throw;
  }
  ReceivedSet r;
  size_t count = tshare_set_count(set);
  try {
    r.set_id = tshare_set_id(set);
    r.is_copy = tshare_set_is_copy(set) == 1;
    size_t meta_len = 0;
    const void *meta = tshare_set_meta(set, &meta_len);
    if (meta_len) r.meta.assign(static_cast<const char *>(meta), meta_len);
    r.tensors.reserve(count);
    for (size_t i = 0; i < count; i++) {
      // A string of its own, moved into the index: insert() given a char
      // pointer makes three (one to look the name up with).
      std::string name = tshare_set_name(set, i);
      r.tensors.insert(std::move(name), member_tensor(*hold, i));
    }
  } catch (...) {
    hold->drop(); // r's tensors go with the exception: the last of them releases the set back
    throw;
  }
  int device = -1;
  for (size_t i = 0; i < count && device < 0; i++) device = tshare_set_cuda_device(set, i);
  hold->drop(); // the tensors hold the set from here
  if (device >= 0) order_current_after_default(device);
  return r;
}

std::optional<ReceivedSet> recv_set(tshare_channel *ch, const RecvOptions &options) {
  if (!ch) fail(TSHARE_E_INVALID_ARG, "recv_set: no channel");
  tshare_set *set = nullptr;
  int rc = tshare_set_recv(ch, options.timeout_ms, &set);
  if (rc == TSHARE_END) return std::nullopt;
  if (rc != TSHARE_OK) fail_channel(ch, rc, "recv_set");
  return adopt_set(set);
}

} // namespace torch
} // namespace tshare
