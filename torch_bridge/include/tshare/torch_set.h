// tshare/torch_set.h - a model's named tensors in one hand-off (target tshare::torch).
//
// Producer: send_set(ch, module->named_parameters(), {meta}) hands every
// tensor of a state_dict (an OrderedDict, or a vector of name/tensor pairs)
// to the peer at once, with opaque metadata (a version, a step). Each memory
// travels once however many tensors point into it, and the whole set comes
// back in one release. The builder's bounds are the C API's (tshare/set.h):
// names of 1 to TSHARE_SET_NAME_MAX bytes, unique in the set; at most
// TSHARE_SET_MEMBERS_MAX tensors and TSHARE_SET_META_MAX bytes of metadata.
//
// Whose storage is shared (CPU): a set carries memory that is already in
// tshare's shared memory, the producer's own storage. Call share_module_()
// once on the model (or share_memory_() on each tensor, or allocate with
// empty_shared()): its parameters and buffers then live in memfds, in place,
// and every later in-place update (an optimizer step, copy_ under no_grad)
// is what consumers see. A set with a CPU tensor outside shared memory is
// refused saying so, unless SetOptions::move_to_shared_memory moves it there
// first (in place, as share_memory_()). Nothing is ever copied behind the
// producer's back.
//
// The update pattern: keep the storages, update them in place, send the set
// again with a new version in the metadata, through one SetSender kept
// across steps: it sends the set it built last time again, with the new
// metadata, as long as the tensors are the same (send_set builds anew on
// every call: for sets sent once).
//
// Consumer: recv_set(ch) returns the next set: its tensors in the sender's
// order (looked up by name too) and the metadata. Each tensor keeps the set
// alive (also after the ReceivedSet is gone); the set is released to the
// producer, once, when the last of them, and of tensors derived from them,
// is gone. Writes through them are the producer's memory.
//
// CUDA tensors (of one device, either allocator mode) go as they are: the set
// holds each storage until its release and is ordered after the current
// stream of their device; recv_set gives CUDA tensors ready for work on the
// current stream. The set's release waits for the work queued on the default
// stream: synchronize work on other streams before dropping the tensors.
#ifndef TSHARE_TORCH_SET_H
#define TSHARE_TORCH_SET_H

#include <tshare/set.h>
#include <tshare/torch.h>

#include <torch/ordered_dict.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
} // namespace nn
} // namespace torch

namespace tshare {
namespace torch {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
using TensorDict = ::torch::OrderedDict<std::string, at::Tensor>;

struct SetOptions {
  std::string meta;                   // opaque bytes (a version, a step); at most TSHARE_SET_META_MAX
  int timeout_ms = -1;                // for the send itself; < 0 waits forever
  bool move_to_shared_memory = false; // CPU tensors outside shared memory: move them in place (else: Error)
};

// Send the tensors as one set on ch and return its id (a share id of ch: see
// tshare_channel_wait_released). A refused set sends nothing, and the
// tensors are checked before any moves; only with move_to_shared_memory can
// a refused name leave the tensors before it moved (same values, shared).
TSHARE_TORCH_API uint64_t send_set(tshare_channel *ch, const NamedTensors &tensors, const SetOptions &options = {});
TSHARE_TORCH_API uint64_t send_set(tshare_channel *ch, const TensorDict &tensors, const SetOptions &options = {});
// send_set(ch, {{"w", w}, {"b", b}}, {"version=1"}): a list in place.
inline uint64_t send_set(tshare_channel *ch, std::initializer_list<std::pair<std::string, at::Tensor>> tensors,
                         const SetOptions &options = {}) {
  return send_set(ch, NamedTensors(tensors), options);
}

// One consumer's outcome of send_set_all.
struct SendResult {
  int code = TSHARE_OK;  // a tshare_status value
  std::string error;     // what went wrong, empty when code is TSHARE_OK
  uint64_t set_id = 0;   // 0 when the set was not sent on this channel
  bool released = false; // the consumer released the set within the wait
  bool ok() const noexcept { return code == TSHARE_OK; }
};

// Fan-out (tshare_set_send_all, tshare_set_wait_all): hand the same set to
// every channel, then wait until each consumer released it, on all channels
// at once (release_timeout_ms for all of them together: < 0 forever, 0
// returns at once). One consumer's failure (gone, slow, refusing) is reported
// in its own result, naming the consumer, and does not stop the others; a
// consumer that goes away after the set reached it counts as having released
// it, as for tshare_channel_wait_released. A set that cannot be built (a bad
// name, a tensor outside shared memory) throws, sending nothing.
TSHARE_TORCH_API std::vector<SendResult> send_set_all(const std::vector<tshare_channel *> &channels,
                                                      const NamedTensors &tensors, const SetOptions &options = {},
                                                      int release_timeout_ms = -1);
TSHARE_TORCH_API std::vector<SendResult> send_set_all(const std::vector<tshare_channel *> &channels,
                                                      const TensorDict &tensors, const SetOptions &options = {},
                                                      int release_timeout_ms = -1);
inline std::vector<SendResult> send_set_all(const std::vector<tshare_channel *> &channels,
                                            std::initializer_list<std::pair<std::string, at::Tensor>> tensors,
                                            const SetOptions &options = {}, int release_timeout_ms = -1) {
  return send_set_all(channels, NamedTensors(tensors), options, release_timeout_ms);
}

// A producer that sends the same tensors again and again (a trainer's
// weights, updated in place between versions): keep one SetSender across the
// steps and call send() or send_all() with the state each time. It keeps the
// set it built last (a C builder, tshare/set.h) and what it was built from:
// each member's name, data pointer, sizes, strides, dtype, device and
// storage. When the tensors given are those again, it only sets the new
// metadata (and the current CUDA stream) and sends the same set again: no
// check, lookup or allocation per member. Any change (a tensor reassigned,
// reshaped, moved to other memory; a member added, removed, renamed or
// reordered) builds the set anew, checked as send_set checks it.
//
// What it keeps alive: the kept set holds a reference on every memory in it
// (each CPU tensor's shared buffer, each CUDA tensor's storage), so the
// memory of the last set sent stays allocated until the next rebuild,
// reset() or the sender's end, even when the producer dropped the tensors.
// (That is also why the same data pointer means the same memory.)
//
// Threads: one SetSender may be used from several threads; its calls are
// serialised by a mutex, each send whole. Each channel is still driven by
// one thread at a time (the C rule). Options and results are send_set's and
// send_set_all's.
class TSHARE_TORCH_API SetSender {
 public:
  SetSender();
  ~SetSender();
  SetSender(SetSender &&other) noexcept;
  SetSender &operator=(SetSender &&other) noexcept;
  SetSender(const SetSender &) = delete;
  SetSender &operator=(const SetSender &) = delete;

  uint64_t send(tshare_channel *ch, const NamedTensors &tensors, const SetOptions &options = {});
  uint64_t send(tshare_channel *ch, const TensorDict &tensors, const SetOptions &options = {});
  std::vector<SendResult> send_all(const std::vector<tshare_channel *> &channels, const NamedTensors &tensors,
                                   const SetOptions &options = {}, int release_timeout_ms = -1);
  std::vector<SendResult> send_all(const std::vector<tshare_channel *> &channels, const TensorDict &tensors,
                                   const SetOptions &options = {}, int release_timeout_ms = -1);
  uint64_t send(tshare_channel *ch, std::initializer_list<std::pair<std::string, at::Tensor>> tensors,
                const SetOptions &options = {}) {
    return send(ch, NamedTensors(tensors), options);
  }
  std::vector<SendResult> send_all(const std::vector<tshare_channel *> &channels,
                                   std::initializer_list<std::pair<std::string, at::Tensor>> tensors,
                                   const SetOptions &options = {}, int release_timeout_ms = -1) {
    return send_all(channels, NamedTensors(tensors), options, release_timeout_ms);
  }

  // Let go of the kept set and the memory it holds; the next send builds anew.
  void reset();
  // How many times a set was built (a send that sent the kept set again
  // does not count): what shows that the tensors were recognised.
  uint64_t builds() const;

 private:
  struct Kept;
  Kept &kept();
  std::unique_ptr<Kept> kept_;
};

struct ReceivedSet {
  TensorDict tensors;  // in the sender's order; tensors["name"], tensors.find("name")
  std::string meta;    // the metadata, as sent
  uint64_t set_id = 0; // the producer's share id of the whole set
  bool is_copy = false; // a copy in this process's memory (over ucx://), not the producer's memory
};

// The next set on ch, or std::nullopt once the peer said bye. A set the
// bridge cannot turn into tensors (e.g. a dtype LibTorch lacks, from a C
// producer) is released back and reported as an Error; the channel stays usable.
TSHARE_TORCH_API std::optional<ReceivedSet> recv_set(tshare_channel *ch, const RecvOptions &options = {});

// Done reading this version of a set: it is released now (it goes to the
// producer with this thread's next call on the channel, as a dropped set's
// release does; SetReceiver::recv_into is one), while r.tensors stay on the
// same memory, kept mapped. From then on the producer may write that memory:
// the tensors no longer hold this version, and sending one on is refused
// (TSHARE_E_STATE) until SetReceiver::recv_into brought the next version into
// them. Releasing again does nothing while no newer version came, nor does
// releasing an r without tensors (moved into a later version). Error
// TSHARE_E_INVALID_ARG where r.tensors are not one received set's as they
// came (one replaced or pointed elsewhere). A CUDA set is released after the
// work queued on the default stream so far, as a set dropped is; the memory
// stays mapped until the last tensor goes (synchronize other streams first).
TSHARE_TORCH_API void release(ReceivedSet &r);

// The tensors of a set received through the C API (tshare_set_recv): the
// same as recv_set gives. Takes over the handle: the tensors release the set
// (on an Error, it is released at once). For a program that looks at a set
// (its metadata, names, sizes) before it makes tensors of it.
TSHARE_TORCH_API ReceivedSet adopt_set(tshare_set *set);

// A consumer of a producer's updates (the other end of SetSender's pattern):
// keep one SetReceiver across them and call recv() for each. recv() gives
// the sets recv_set gives (its errors say "SetReceiver::recv"). Where no set
// waits yet, it makes the tensors of the next set ahead, from the last set
// whose layout the core keeps (one a SetSender sent, tshare_set_layout): a
// set sent again from that layout has the same members at the same
// addresses, so its tensors are ready when it comes, and only its metadata
// is read then. Any other set is made as recv_set makes it (the tensors made
// ahead are let go of at the next call). They are made inside the core's
// receive (tshare_set_recv_idle), also with timeout_ms 0 (a poll), after a
// look that sends the releases this thread's drops queued. They cost one
// set's tensor objects (no device memory) and hold nothing: the set before
// is released as usual. A producer alternating two layouts on one channel
// never matches, and each wait makes tensors for nothing.
//
// Threads: recv() and reset() are serialised by a mutex (reset() waits for
// a recv() in progress); ready_made() does not wait. One channel is driven
// by one thread at a time (the C rule). A moved-from receiver starts afresh
// on its next recv() (not from two threads at once).
class TSHARE_TORCH_API SetReceiver {
 public:
  SetReceiver();
  ~SetReceiver();
  SetReceiver(SetReceiver &&other) noexcept;
  SetReceiver &operator=(SetReceiver &&other) noexcept;
  SetReceiver(const SetReceiver &) = delete;
  SetReceiver &operator=(const SetReceiver &) = delete;

  std::optional<ReceivedSet> recv(tshare_channel *ch, const RecvOptions &options = {});

  // A consumer that keeps one set's tensors across versions (its model runs
  // on them): r, a set this receiver gave, is released as release(r) does,
  // and the next set, where it is of r's layout (the producer's same set
  // sent again, and r this receiver's last layout), comes into r's own
  // tensors: they move to the result (r is left with none, and its old id
  // and metadata), the same at::Tensor objects (is_same with r's before),
  // with the new version's id and metadata. Between the release and the
  // return the tensors hold whatever the producer writes: do not poll with
  // it. Any other set comes as new tensors, and r keeps its tensors,
  // released, their memory mapped until they go. Ending without a set (a
  // timeout, the peer's bye, a refused set's Error) leaves r released with
  // its tensors. No tensors are made ahead for this call; no other thread
  // may use r itself meanwhile. TSHARE_E_INVALID_ARG (nothing released) for
  // an r whose tensors are not one set's as received, or that came to this
  // receiver on another channel. The loop: auto next = recv_into(ch, *r);
  // stop at std::nullopt, else r = std::move(next).
  std::optional<ReceivedSet> recv_into(tshare_channel *ch, ReceivedSet &r, const RecvOptions &options = {});

  // Forget the kept layout and the tensors made ahead.
  void reset();
  // How many sets came with their tensors made ahead: what shows that a
  // layout was recognised.
  uint64_t ready_made() const;
  // How many sets recv_into brought into the caller's tensors.
  uint64_t received_into() const;

 private:
  struct Kept;
  std::unique_ptr<Kept> kept_;
};

// The C++ counterpart of Python's share_model_: move the module's CPU
// parameters and buffers (its submodules' too) into one shared buffer in
// place, values copied once, so the module itself owns the memory sets carry
// (and a set of its state travels as one memory). Each parameter and buffer
// keeps its identity (optimizers and hooks holding it go on working); tensors
// of one storage stay on one storage. Tensors already shared (and CUDA ones)
// are left as they are; tensors made later (module->to(), a new parameter)
// are private again: call it again after such changes. Views taken of a
// parameter before the call keep the old memory. Not while another thread
// uses the module: data pointers change. Returns the module.
TSHARE_TORCH_API ::torch::nn::Module &share_module_(::torch::nn::Module &module);

// The same, and with pack_cuda each device's CUDA parameters and buffers
// moved likewise into one allocation of that device (the caching
// allocator's), so that a consumer opens one CUDA IPC mapping for the
// module's first hand-off instead of one per segment (tens of microseconds
// each in the driver; a model of hundreds of tensors has tens of segments).
// Whole storages are copied (the device needs room for a second copy of them
// while they move) and the device is synchronized before and after. Pack
// before capturing CUDA graphs, and send the state again after packing (a
// consumer holding a set sent before reads the old memory). For PyTorch's
// default allocator: with expandable segments packing measured slower.
TSHARE_TORCH_API ::torch::nn::Module &share_module_(::torch::nn::Module &module, bool pack_cuda);

} // namespace torch
} // namespace tshare

#endif // TSHARE_TORCH_SET_H
