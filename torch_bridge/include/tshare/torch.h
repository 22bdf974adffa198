// tshare/torch.h - LibTorch tensors over tshare channels (target tshare::torch).
//
// Producer: send(ch, tensor) shares a CPU or CUDA tensor of any layout the
// strided layout allows (any strides, a storage offset, non-contiguous views)
// without copying it. The tensor's storage is kept alive until the peer has
// released the share, however long the producer's own tensor lives.
//
//   - CUDA tensors (LibTorch's caching allocator, or any device memory) travel
//     as the allocation's IPC handle plus an offset. The producer's current
//     stream on the tensor's device is ordered before the consumer's use with
//     an inter-process event: no host synchronisation. The zeroing guard
//     (tshare/cuda.h) applies where it is on.
//   - CPU tensors must live in shared memory: host memory travels as a memfd.
//     empty_shared() allocates there; send() moves any other CPU storage there
//     first, once (like Tensor.share_memory_()): one copy, after which the
//     producer's tensor and every consumer's view are the same memory.
//   - A received tensor, or any view of one, can be sent on: the original
//     producer's memory travels, not a copy.
//
// Consumer: recv(ch) returns the next tensor, built with from_blob over the
// producer's memory. Its deleter releases the share exactly once, from any
// thread, without waiting for the producer. Writes through it are visible to
// the producer. A CUDA tensor arrives on the device that holds it (matched by
// UUID, whatever CUDA_VISIBLE_DEVICES says), and that device's current stream
// waits for the producer's event; the release waits for the work queued on
// that stream before the tensor died.
//
// Errors are thrown as tshare::torch::Error with a tshare status code. Tensors
// that cannot be shared (sparse, quantized, nested, meta or other devices,
// conjugate or negative views that are not resolved, dtypes without a DLPack
// code) are refused with a message that says what to do instead.
//
// Threads: as in the C API, one thread drives a channel (send, recv); a
// received tensor may die on any thread.
#ifndef TSHARE_TORCH_H
#define TSHARE_TORCH_H

#include <ATen/core/Tensor.h>
#include <tshare/tshare.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

// Marks the bridge's API: libtshare_torch.so is built with hidden
// visibility and exports only this (a test checks the symbols).
#ifndef TSHARE_TORCH_API
#if defined(__GNUC__)
#define TSHARE_TORCH_API __attribute__((visibility("default")))
#else
#define TSHARE_TORCH_API
#endif
#endif

namespace tshare {
namespace torch {

class TSHARE_TORCH_API Error : public std::runtime_error {
 public:
  Error(int code, const std::string &message) : std::runtime_error(message), code_(code) {}
  int code() const noexcept { return code_; } // a tshare_status value
 private:
  int code_;
};

struct SendOptions {
  std::string tag;                   // arrives with the tensor; at most TSHARE_TAG_MAX bytes
  int timeout_ms = -1;               // for the send itself; < 0 waits forever
  bool move_to_shared_memory = true; // CPU tensors outside shared memory: move them (else: Error)
};

// Share t on ch and return the share id (see tshare_share_is_released and
// tshare_channel_wait_released). The channel's on_release callback, if any,
// still gets these shares, with a user_data of nullptr.
TSHARE_TORCH_API uint64_t send(tshare_channel *ch, const at::Tensor &t, const SendOptions &options = {});

struct RecvOptions {
  int timeout_ms = -1; // < 0 waits forever; Error with TSHARE_E_TIMEOUT when nothing came
  int device = -1;     // CUDA: map on this device (peer access) instead of the one holding the memory
};

struct Received {
  at::Tensor tensor;
  std::string tag;
  uint64_t share_id = 0;
  // A copy in this process's memory (read over a ucx:// channel, a GPU
  // tensor placed on this end's GPU); false: the producer's memory, mapped.
  bool is_copy = false;
};

// The next tensor on ch, or std::nullopt once the peer said bye. A share
// that cannot become a tensor here (e.g. negative strides from a C producer)
// is released back and reported as an Error; the channel stays usable.
TSHARE_TORCH_API std::optional<Received> recv(tshare_channel *ch, const RecvOptions &options = {});

// A tensor over a view received with the C API; it takes the view (released
// by the tensor's deleter, or here if this throws).
TSHARE_TORCH_API at::Tensor tensor_from_view(tshare_view *view);

// A CPU tensor in shared memory (a memfd), zero-filled; sent without a copy.
TSHARE_TORCH_API at::Tensor empty_shared(at::IntArrayRef sizes, const at::TensorOptions &options = {});

// Move t's storage into shared memory in place (a no-op when it is there
// already) and return t. Other tensors on the same storage move with it. Not
// while another thread uses the storage: its data pointer changes.
TSHARE_TORCH_API const at::Tensor &share_memory_(const at::Tensor &t);

// True when t can be sent without a copy: CUDA memory, a received tensor, or
// CPU memory from empty_shared()/share_memory_().
TSHARE_TORCH_API bool is_shared(const at::Tensor &t);

// tshare's DLPack dtype for a LibTorch dtype; Error for dtypes it cannot carry.
TSHARE_TORCH_API tshare_dtype to_tshare_dtype(at::ScalarType type);
TSHARE_TORCH_API at::ScalarType to_scalar_type(tshare_dtype dtype);

// Closes a channel; for std::unique_ptr<tshare_channel, ChannelCloser>.
struct ChannelCloser {
  void operator()(tshare_channel *ch) const noexcept { tshare_channel_close(ch); }
};
using ChannelPtr = std::unique_ptr<tshare_channel, ChannelCloser>;

} // namespace torch
} // namespace tshare

#endif // TSHARE_TORCH_H
