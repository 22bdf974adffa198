// Tensor sets through the bridge, the consumer's half: a received set in, one
// tensor per member out, all of them holding the set through one counted
// hold: the set handle, released once when the last tensor (and every
// tensor derived from them) is gone, on whichever thread that is.
//
// Per member that is one storage over the set's own pointer and a tensor
// on it (the device given, so nothing asks the driver where the pointer
// lives) and one count on the hold: no view, lock or allocation of the
// core's per member. A member sent on with send() gets its view then, on demand.
//
// release() gives the set back while the tensors stay: the hold trades the
// set handle for a pin of its memories (tshare_set_pin_memories), and a
// SetReceiver's recv_into puts the next set of the same layout into the
// same hold, under the same tensors.
#include "tshare/torch_set.h"

#include "bridge_internal.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/TensorImpl.h>

#ifdef TSHARE_TORCH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

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
// tensor, plus recv_set's own while it builds them; or, once released with
// release(), the pins that keep its memories mapped under the tensors.
struct SetHold {
  std::atomic<size_t> refs{1};
  // nullptr while a SetReceiver's prepared tensors wait for their set, or
  // while released; written under lock, and read without it only by drop()
  // (the last count: no one else can reach the hold then).
  tshare_set *set;
  std::unique_ptr<MemberContext[]> members;
  size_t count;
  uint64_t layout = 0; // tshare_set_layout of the sets it holds (0: none kept), for recv_into
  tshare_channel *ch = nullptr; // the channel a SetReceiver took it on (recv_into refuses another)
  std::mutex lock;     // set and pin: release(), a hand-over and a member sent on
  tshare_set_pin *pin = nullptr; // while released: every memory of the set, kept mapped

  SetHold(tshare_set *s, size_t n) : set(s), members(new MemberContext[n]), count(n) {
    for (size_t i = 0; i < n; i++) members[i] = {this, i};
  }
  void drop() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    tshare_set_release(set); // never blocks: the release goes out from here or the channel's next call
    tshare_set_pin_release(pin);
    delete this;
  }
};

// The deleter that marks a set member's storage; its address is the identity.
void drop_member(void *context) { static_cast<MemberContext *>(context)->hold->drop(); }

std::string member_label(const tshare_set *set, size_t i) {
  return "tensor " + std::to_string(i) + " ('" + tshare_set_name(set, i) + "') of set " +
         std::to_string(tshare_set_id(set));
}

// What a member's tensor is made of: read from its set, or kept from the
// set before by a SetReceiver.
struct MemberSpec {
  void *data;
  at::ScalarType type;
  at::Device device;
  at::IntArrayRef sizes, strides;
};

at::Device member_device(const tshare_set *set, size_t i) {
  int index = tshare_set_cuda_device(set, i);
  if (index < 0) return at::Device(at::kCPU);
#ifdef TSHARE_TORCH_CUDA
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
#else
  fail(TSHARE_E_UNSUPPORTED,
       "received set: " + member_label(set, i) + " is GPU memory and this LibTorch (or tshare) was built without CUDA");
#endif
}

// Member i of a set as a tensor can have it, or Error saying why not.
MemberSpec member_spec(const tshare_set *set, size_t i) {
  const tshare_tensor_desc *d = tshare_set_desc(set, i);
  for (int32_t k = 0; k < d->ndim; k++)
    if (d->strides[k] < 0)
      fail(TSHARE_E_UNSUPPORTED, "received set: " + member_label(set, i) + " has a negative stride (" +
                                     std::to_string(d->strides[k]) + " in dimension " + std::to_string(k) +
                                     "), which LibTorch tensors cannot have");
  auto ndim = static_cast<size_t>(d->ndim);
  return {tshare_set_data(set, i), to_scalar_type(d->dtype), member_device(set, i), at::IntArrayRef(d->shape, ndim),
          at::IntArrayRef(d->strides, ndim)};
}

// Member i over its memory, counted on the hold until its storage goes.
// Made as at::for_blob would make it (a storage over the member's bytes with
// the context deleter, a tensor on it), without the maker's checks and
// dispatch guard: a model's hundreds of members per hand-off.
at::Tensor member_tensor(SetHold &hold, size_t i, const MemberSpec &m) {
  // The bytes it spans from its first element (the core checked that they
  // lie in its memory), as LibTorch counts a storage's.
  size_t nbytes = at::detail::computeStorageNbytes(m.sizes, m.strides, c10::elementSize(m.type));
  hold.refs.fetch_add(1, std::memory_order_relaxed);
  // From here the data pointer owns the count: its deleter drops it even if
  // what follows throws, and the tensor's storage owns it afterwards.
  c10::DataPtr data(m.data, &hold.members[i], &drop_member, m.device);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::computeDispatchKey(m.type, at::kStrided, m.device)),
      c10::scalarTypeToTypeMeta(m.type));
  impl->set_sizes_and_strides(m.sizes, m.strides);
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

// What a received set says besides its tensors: its id, whether it is a
// copy, its metadata.
void describe_received(ReceivedSet &r, const tshare_set *set) {
  r.set_id = tshare_set_id(set);
  r.is_copy = tshare_set_is_copy(set) == 1;
  size_t meta_len = 0;
  const void *meta = tshare_set_meta(set, &meta_len);
  if (meta_len) r.meta.assign(static_cast<const char *>(meta), meta_len);
}

// The CUDA device of a set's CUDA members, or -1 when it has none.
int cuda_device_of(const tshare_set *set) {
  int device = -1;
  for (size_t i = 0, n = tshare_set_count(set); i < n && device < 0; i++) device = tshare_set_cuda_device(set, i);
  return device;
}

SetHold *hold_of(const at::Tensor &t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage()) return nullptr;
  const c10::DataPtr &p = t.storage().data_ptr();
  return p.get_deleter() == &drop_member ? static_cast<MemberContext *>(p.get_context())->hold : nullptr;
}

// The hold under every tensor of r, each tensor its member of r's place,
// or nullptr where r's tensors are not one received set's as it came (one
// replaced, or pointed elsewhere with set_()).
SetHold *hold_of_set(const ReceivedSet &r) {
  if (r.tensors.is_empty()) return nullptr;
  SetHold *hold = hold_of(r.tensors[0].value());
  if (!hold || hold->count != r.tensors.size()) return nullptr;
  for (size_t i = 0; i < r.tensors.size(); i++) {
    const at::Tensor &t = r.tensors[i].value();
    if (hold_of(t) != hold || static_cast<MemberContext *>(t.storage().data_ptr().get_context())->index != i)
      return nullptr;
  }
  return hold;
}

// The set under hold given back, its memories kept mapped (release()).
void release_hold(SetHold &hold) {
  tshare_set *set;
  {
    std::lock_guard<std::mutex> guard(hold.lock);
    if (!hold.set) return; // released already, and no newer version came since
    tshare_set_pin *pin = nullptr;
    int rc = tshare_set_pin_memories(hold.set, &pin);
    if (rc != TSHARE_OK)
      fail(rc, "release: set " + std::to_string(tshare_set_id(hold.set)) +
                   (rc == TSHARE_E_NOMEM ? ": out of memory" : ": its memory cannot be kept mapped past its release"));
    set = hold.set;
    hold.set = nullptr;
    hold.pin = pin;
  }
  // Outside the lock (a send on of a member waits for it): the pin holds
  // every memory, the tensors' counts hold the hold.
  tshare_set_release(set);
}

} // namespace

void release(ReceivedSet &r) {
  if (r.tensors.is_empty()) return; // nothing held (moved into a later version by recv_into)
  SetHold *hold = hold_of_set(r);
  if (!hold)
    fail(TSHARE_E_INVALID_ARG, "release: the tensors are not one received set's as recv_set or SetReceiver gave them "
                               "(a single tensor is released when it goes)");
  release_hold(*hold);
}

namespace detail {

bool is_set_member(const at::Tensor &t) { return hold_of(t) != nullptr; }

tshare_view *set_member_view(const at::Tensor &t) {
  SetHold *hold = hold_of(t);
  if (!hold) return nullptr;
  auto *member = static_cast<MemberContext *>(t.storage().data_ptr().get_context());
  tshare_view *view = nullptr;
  std::lock_guard<std::mutex> guard(hold->lock);
  if (!hold->set)
    fail(TSHARE_E_STATE, "send: the tensor is of a received set released with release(): its memory is the "
                         "producer's to change until the next version comes into it (SetReceiver::recv_into); send "
                         "it after that, or a copy");
  if (tshare_set_view(hold->set, member->index, &view) != TSHARE_OK)
    fail(TSHARE_E_NOMEM, "send (a tensor of a received set): out of memory");
  return view;
}

} // namespace detail

ReceivedSet adopt_set(tshare_set *set) {
  if (!set) fail(TSHARE_E_INVALID_ARG, "adopt_set: no set");
  SetHold *hold;
  try {
    hold = new SetHold(set, tshare_set_count(set));
  } catch (...) {
    tshare_set_release(set);
    throw;
  }
  hold->layout = tshare_set_layout(set);
  ReceivedSet r;
  size_t count = tshare_set_count(set);
  try {
    describe_received(r, set);
    r.tensors.reserve(count);
    for (size_t i = 0; i < count; i++) {
      // A string of its own, moved into the index: insert() given a char
      // pointer makes three (one to look the name up with).
      std::string name = tshare_set_name(set, i);
      r.tensors.insert(std::move(name), member_tensor(*hold, i, member_spec(set, i)));
    }
  } catch (...) {
    hold->drop(); // r's tensors go with the exception: the last of them releases the set back
    throw;
  }
  int device = cuda_device_of(set);
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

// What a SetReceiver keeps between sets: the members of the last set whose
// layout the core keeps (names, and what their tensors are made of), and the
// tensors made of them ahead, on a hold with no set yet, for the next set of
// that layout. A set sent again from a layout has its members; a member's
// memory is the same when its address is (the core maps a kept memory once),
// so those tensors are that set's, once it is put in their hold.
struct SetReceiver::Kept {
  struct Member {
    std::string name;
    void *data;
    at::ScalarType type;
    at::Device device;
    std::vector<int64_t> sizes, strides;
    int cuda_device; // tshare_set_cuda_device's answer
  };
  // Tensors made for a set not yet received.
  struct Ahead {
    SetHold *hold = nullptr;
    TensorDict tensors;
    void clear() noexcept {
      tensors.clear(); // each drops its count on the hold
      if (hold) hold->drop();
      hold = nullptr;
    }
  };

  std::mutex lock; // held for a whole recv
  uint64_t layout = 0; // tshare_set_layout of members, 0: none kept
  std::vector<Member> members;
  int device = -1;
  Ahead ahead, stale; // stale: made for a set that came otherwise; let go before the next wait
  std::atomic<uint64_t> ready{0}; // read without the lock: a recv() may be waiting
  std::atomic<uint64_t> into{0};  // sets recv_into brought into the caller's tensors
  tshare_channel *waiting_on = nullptr; // the channel of the recv() making tensors ahead

  ~Kept() {
    stale.clear();
    ahead.clear();
  }

  // The tensors for the next set of the kept layout, made while no set is
  // due; on an error (out of memory) none are, and the next set is made as
  // adopt_set makes it.
  void make_ahead() noexcept {
    stale.clear();
    // Tensors made in inference mode are inference tensors, which a recv()
    // outside it would hand out unwritable: made only outside (normal
    // tensors work inside it too).
    if (!layout || ahead.hold || c10::InferenceMode::is_enabled()) return;
    try {
      ahead.hold = new SetHold(nullptr, members.size());
      ahead.hold->layout = layout;
      ahead.hold->ch = waiting_on;
      ahead.tensors.reserve(members.size());
      for (size_t i = 0; i < members.size(); i++) {
        const Member &m = members[i];
        MemberSpec spec{m.data, m.type, m.device, m.sizes, m.strides};
        ahead.tensors.insert(m.name, member_tensor(*ahead.hold, i, spec));
      }
    } catch (...) {
      ahead.clear();
    }
  }

  // The set is one of the kept layout, each member at the address its
  // tensor made ahead points to.
  bool fits(const tshare_set *set) const { return ahead.hold && of_kept_layout(set); }

  // The set is one of the kept layout, each member at the address kept.
  bool of_kept_layout(const tshare_set *set) const {
    if (!layout || tshare_set_layout(set) != layout || tshare_set_count(set) != members.size())
      return false;
    for (size_t i = 0; i < members.size(); i++)
      if (tshare_set_data(set, i) != members[i].data || tshare_set_cuda_device(set, i) != members[i].cuda_device)
        return false;
    return true;
  }

  // The tensors made ahead, now set's: their hold takes the handle.
  ReceivedSet hand_over(tshare_set *set) {
    SetHold *hold = ahead.hold;
    ahead.hold = nullptr;
    hold->set = set;
    ReceivedSet r;
    r.tensors = std::move(ahead.tensors);
    ahead.tensors = TensorDict();
    hold->drop(); // the tensors hold the set from here (an exception below drops them, and the last one releases it)
    describe_received(r, set);
    if (device >= 0) order_current_after_default(device);
    ready++;
    return r;
  }

  // The released set's tensors (hold, r's), now set's: the hold takes the
  // handle and lets go of its pins after it, and the tensors move to the
  // result.
  // nullopt where the hold has a set again (another recv_into took one for
  // the same tensors meanwhile: the set is made anew instead).
  std::optional<ReceivedSet> hand_into(SetHold &hold, ReceivedSet &r, tshare_set *set) {
    tshare_set_pin *pin;
    {
      std::lock_guard<std::mutex> guard(hold.lock);
      if (hold.set) return std::nullopt;
      hold.set = set;
      pin = hold.pin;
      hold.pin = nullptr;
    }
    tshare_set_pin_release(pin); // the set holds the same memories now: nothing is unmapped, nothing waits
    ReceivedSet out;
    out.tensors = std::move(r.tensors);
    r.tensors = TensorDict();
    describe_received(out, set);
    if (device >= 0) order_current_after_default(device);
    into++;
    return out;
  }

  // r's tensors (of hold) can take the next set of the kept layout: made
  // for a set of it, each still on its member's memory.
  bool can_take(const SetHold &hold, const ReceivedSet &r) const {
    if (!layout || hold.layout != layout || r.tensors.size() != members.size()) return false;
    for (size_t i = 0; i < members.size(); i++)
      if (r.tensors[i].value().storage().data_ptr().get() != members[i].data) return false;
    return true;
  }

  // A set that is not the kept layout's (or came with nothing made for it):
  // made as recv_set makes it, and its layout kept for the next.
  ReceivedSet adopt_anew(tshare_set *set, tshare_channel *ch) {
    stale.clear(); // (there is one only where no call made tensors ahead since)
    std::swap(stale, ahead); // let go of after the set is handed over: not on its way
    layout = 0; // a set adopt_set refuses leaves nothing kept
    ReceivedSet r = adopt_set(set);
    if (!r.tensors.is_empty()) hold_of(r.tensors[0].value())->ch = ch;
    try {
      remember(set, r);
    } catch (...) {
      layout = 0; // out of memory: the next set is made as this one was
      members.clear();
    }
    return r;
  }

  // What the next set is made ahead from: set's members when the core keeps
  // its layout, else nothing. set lives (r's tensors hold it).
  void remember(const tshare_set *set, const ReceivedSet &r) {
    layout = 0;
    members.clear();
    uint64_t id = tshare_set_layout(set);
    if (!id) return;
    members.reserve(r.tensors.size());
    for (size_t i = 0; i < r.tensors.size(); i++) {
      const auto &item = r.tensors[i];
      const at::Tensor &t = item.value();
      members.push_back({item.key(), tshare_set_data(set, i), t.scalar_type(), t.device(), t.sizes().vec(),
                         t.strides().vec(), tshare_set_cuda_device(set, i)});
    }
    device = cuda_device_of(set);
    layout = id;
  }

  static void make_ahead_of(void *kept) { static_cast<Kept *>(kept)->make_ahead(); }

  std::optional<ReceivedSet> recv(tshare_channel *ch, const RecvOptions &options) {
    // The core looks first (the releases this thread's drops left for the
    // channel's next call go out: the producer waits for them, not behind
    // the tensors made here; a set that came already is taken), and makes
    // them only where nothing came, inside the one call.
    tshare_set *set = nullptr;
    waiting_on = ch;
    int rc = tshare_set_recv_idle(ch, options.timeout_ms, &Kept::make_ahead_of, this, &set);
    if (rc == TSHARE_END) return std::nullopt;
    if (rc != TSHARE_OK) fail_channel(ch, rc, "SetReceiver::recv");
    if (fits(set)) return hand_over(set);
    return adopt_anew(set, ch);
  }

  std::optional<ReceivedSet> recv_into(tshare_channel *ch, ReceivedSet &r, const RecvOptions &options) {
    SetHold *hold = hold_of_set(r);
    if (!hold)
      fail(TSHARE_E_INVALID_ARG, "SetReceiver::recv_into: r's tensors are not one received set's as recv_set or "
                                 "SetReceiver gave them");
    if (hold->ch && hold->ch != ch)
      fail(TSHARE_E_INVALID_ARG, "SetReceiver::recv_into: r was received on another channel");
    release_hold(*hold);
    if (ahead.hold) { // made for nothing: r's tensors take the next set (rare: a recv() made them)
      stale.clear();
      std::swap(stale, ahead);
    }
    tshare_set *set = nullptr;
    // A plain receive, nothing made while it waits: the look it starts with
    // sends the release above, which the producer waits for.
    int rc = tshare_set_recv(ch, options.timeout_ms, &set);
    if (rc == TSHARE_END) return std::nullopt; // r's tensors stay released
    if (rc != TSHARE_OK) fail_channel(ch, rc, "SetReceiver::recv_into");
    if (can_take(*hold, r) && of_kept_layout(set))
      if (auto into_r = hand_into(*hold, r, set)) return into_r;
    return adopt_anew(set, ch);
  }
};

SetReceiver::SetReceiver() : kept_(new Kept) {}
SetReceiver::~SetReceiver() = default;
SetReceiver::SetReceiver(SetReceiver &&other) noexcept = default;
SetReceiver &SetReceiver::operator=(SetReceiver &&other) noexcept = default;

std::optional<ReceivedSet> SetReceiver::recv(tshare_channel *ch, const RecvOptions &options) {
  if (!ch) fail(TSHARE_E_INVALID_ARG, "SetReceiver::recv: no channel");
  if (!kept_) kept_.reset(new Kept); // a moved-from receiver starts afresh
  std::lock_guard<std::mutex> guard(kept_->lock);
  return kept_->recv(ch, options);
}

void SetReceiver::reset() {
  if (!kept_) return;
  std::lock_guard<std::mutex> guard(kept_->lock);
  kept_->stale.clear();
  kept_->ahead.clear();
  kept_->layout = 0;
  kept_->members.clear();
}

std::optional<ReceivedSet> SetReceiver::recv_into(tshare_channel *ch, ReceivedSet &r, const RecvOptions &options) {
  if (!ch) fail(TSHARE_E_INVALID_ARG, "SetReceiver::recv_into: no channel");
  if (!kept_) kept_.reset(new Kept);
  std::lock_guard<std::mutex> guard(kept_->lock);
  return kept_->recv_into(ch, r, options);
}

uint64_t SetReceiver::ready_made() const { return kept_ ? kept_->ready.load() : 0; }

uint64_t SetReceiver::received_into() const { return kept_ ? kept_->into.load() : 0; }

} // namespace torch
} // namespace tshare
