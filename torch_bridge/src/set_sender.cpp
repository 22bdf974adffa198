// SetSender: the set built last, kept with what each member was when it was
// built, and sent again as it is while the tensors given are the same ones.
//
// The kept builder holds a reference on every member's memory, so while it is
// kept no other tensor can get a member's address: equal data pointers, with
// the same storage, dtype, device and layout, are the same tensor memory, and
// the set already describes it. Only the metadata (and, for CUDA, the stream
// the set is ordered after) changes between such sends.
#include "tshare/torch_set.h"

#include "bridge_internal.h"
#include "set_internal.h"

#include <algorithm>
#include <mutex>

namespace tshare {
namespace torch {
namespace {

using detail::fail;

// What a member was when the set was built.
struct MemberIdentity {
  const void *data;               // its element [0,...,0] (nullptr when empty)
  const c10::StorageImpl *storage;
  c10::DispatchKeySet keys;       // its kind: dense, conjugate or negative view, nested, sparse, ...
  at::ScalarType dtype;
  at::Device device;
  size_t dims;
  size_t layout_at;               // its sizes, then its strides, in Kept::layout
};

MemberIdentity identity_of(const at::Tensor &t, size_t layout_at) {
  return {t.data_ptr(),      t.storage().unsafeGetStorageImpl(), t.unsafeGetTensorImpl()->key_set(),
          t.scalar_type(),   t.device(),                         static_cast<size_t>(t.dim()),
          layout_at};
}

// Compares only: no allocation, no call into the core.
bool same_member(const MemberIdentity &m, const std::string &kept_name, const int64_t *layout,
                 const std::string &name, const at::Tensor &t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage()) return false;
  if (t.unsafeGetTensorImpl()->key_set() != m.keys || t.scalar_type() != m.dtype || t.device() != m.device)
    return false;
  if (t.data_ptr() != m.data || t.storage().unsafeGetStorageImpl() != m.storage) return false;
  at::IntArrayRef sizes = t.sizes(), strides = t.strides();
  if (sizes.size() != m.dims || !std::equal(sizes.begin(), sizes.end(), layout) ||
      !std::equal(strides.begin(), strides.end(), layout + m.dims))
    return false;
  return name == kept_name;
}

const std::string &name_of(const std::pair<std::string, at::Tensor> &e) { return e.first; }
const at::Tensor &tensor_of(const std::pair<std::string, at::Tensor> &e) { return e.second; }
const std::string &name_of(const TensorDict::Item &item) { return item.key(); }
const at::Tensor &tensor_of(const TensorDict::Item &item) { return item.value(); }

} // namespace

struct SetSender::Kept {
  std::mutex lock; // held for a whole send: the builder changes, then goes out
  detail::BuilderPtr builder;
  std::vector<std::string> names;
  std::vector<MemberIdentity> members;
  std::vector<int64_t> layout;
  int cuda_device = -1;
  void *stream = nullptr; // the stream the builder orders the set after
  uint64_t builds = 0;

  template <class Tensors> bool same(const Tensors &tensors) const {
    if (!builder || tensors.size() != members.size()) return false;
    size_t i = 0;
    for (const auto &e : tensors) {
      const MemberIdentity &m = members[i];
      if (!same_member(m, names[i], layout.data() + m.layout_at, name_of(e), tensor_of(e))) return false;
      i++;
    }
    return true;
  }

  void forget() {
    builder.reset(); // its references on the memories go with it
    names.clear();
    members.clear();
    layout.clear();
    cuda_device = -1;
    stream = nullptr;
  }

  // After the build: tensors moved into shared memory by it are remembered where they are now.
  void remember(const detail::MemberRefs &refs) {
    names.reserve(refs.size());
    members.reserve(refs.size());
    for (const auto &r : refs) {
      const at::Tensor &t = *r.second;
      names.push_back(*r.first);
      members.push_back(identity_of(t, layout.size()));
      layout.insert(layout.end(), t.sizes().begin(), t.sizes().end());
      layout.insert(layout.end(), t.strides().begin(), t.strides().end());
    }
  }

  void resend_with(const SetOptions &o) {
    tshare_error err;
    int rc = tshare_set_builder_set_meta(builder.get(), o.meta.data(), o.meta.size(), &err);
    if (rc != TSHARE_OK) fail(rc, err.message);
    void *now = detail::current_stream_of(cuda_device);
    if (now != stream) {
      tshare_set_builder_set_stream(builder.get(), now);
      stream = now;
    }
  }

  template <class Tensors> const tshare_set_builder *prepare(const Tensors &tensors, const SetOptions &o) {
    if (same(tensors)) {
      resend_with(o);
      return builder.get();
    }
    forget(); // the old set's memory goes before the new one is built
    detail::MemberRefs refs = detail::refs_of(tensors);
    detail::BuilderPtr built = detail::build_set(refs, o);
    remember(refs);
    builder = std::move(built);
    cuda_device = detail::cuda_device_of(refs);
    stream = detail::current_stream_of(cuda_device);
    builds++;
    return builder.get();
  }

  template <class Tensors> uint64_t send(tshare_channel *ch, const Tensors &tensors, const SetOptions &o) {
    if (!ch) fail(TSHARE_E_INVALID_ARG, "send_set: no channel");
    std::lock_guard<std::mutex> guard(lock);
    return detail::send_builder(ch, prepare(tensors, o), o.timeout_ms);
  }

  template <class Tensors>
  std::vector<SendResult> send_all(const std::vector<tshare_channel *> &channels, const Tensors &tensors,
                                   const SetOptions &o, int release_timeout_ms) {
    std::lock_guard<std::mutex> guard(lock);
    return detail::send_builder_all(channels, prepare(tensors, o), o.timeout_ms, release_timeout_ms);
  }
};

SetSender::SetSender() : kept_(new Kept) {}
SetSender::~SetSender() = default;
SetSender::SetSender(SetSender &&other) noexcept = default;
SetSender &SetSender::operator=(SetSender &&other) noexcept = default;

// A moved-from sender starts afresh rather than failing.
SetSender::Kept &SetSender::kept() {
  if (!kept_) kept_.reset(new Kept);
  return *kept_;
}

uint64_t SetSender::send(tshare_channel *ch, const NamedTensors &tensors, const SetOptions &options) {
  return kept().send(ch, tensors, options);
}

uint64_t SetSender::send(tshare_channel *ch, const TensorDict &tensors, const SetOptions &options) {
  return kept().send(ch, tensors, options);
}

std::vector<SendResult> SetSender::send_all(const std::vector<tshare_channel *> &channels,
                                            const NamedTensors &tensors, const SetOptions &options,
                                            int release_timeout_ms) {
  return kept().send_all(channels, tensors, options, release_timeout_ms);
}

std::vector<SendResult> SetSender::send_all(const std::vector<tshare_channel *> &channels, const TensorDict &tensors,
                                            const SetOptions &options, int release_timeout_ms) {
  return kept().send_all(channels, tensors, options, release_timeout_ms);
}

void SetSender::reset() {
  if (!kept_) return;
  std::lock_guard<std::mutex> guard(kept_->lock);
  kept_->forget();
}

uint64_t SetSender::builds() const {
  if (!kept_) return 0;
  std::lock_guard<std::mutex> guard(kept_->lock);
  return kept_->builds;
}

} // namespace torch
} // namespace tshare
