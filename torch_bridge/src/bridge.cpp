// torch::Tensor in, share out; share in, torch::Tensor out.
//
// Memory is recognised by the deleter of its storage's DataPtr: free_host_buffer
// (a memfd of empty_shared/share_memory_), release_view (a received tensor),
// set_recv.cpp's (a member of a received set) or anything else (the caching allocator, plain CPU memory). That decides
// how it travels: a host buffer share, a forward of the received view, or a
// CUDA IPC export of the allocation around the pointer.
#include "bridge_internal.h"

#include <ATen/MapAllocator.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Storage.h>

#ifdef TSHARE_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace tshare {
namespace torch {
namespace detail {

void fail(int code, const std::string &message) { throw Error(code, "tshare: " + message); }

void fail_channel(tshare_channel *ch, int code, const char *what) {
  throw Error(code, std::string("tshare: ") + what + ": " + tshare_channel_last_error(ch));
}

} // namespace detail

namespace {

using detail::describe;
using detail::fail;
using detail::fail_channel;

// The deleters that mark tshare memory. Their addresses are the identity.
void free_host_buffer(void *buffer) { tshare_host_buffer_destroy(static_cast<tshare_host_buffer *>(buffer)); }
void release_view(void *view) { tshare_view_release(static_cast<tshare_view *>(view)); }
// What a share of foreign or received memory keeps alive: the storage.
void drop_storage(void *storage) { delete static_cast<c10::Storage *>(storage); }

c10::DeleterFnPtr deleter_of(const at::Tensor &t) { return t.storage().data_ptr().get_deleter(); }
void *context_of(const at::Tensor &t) { return t.storage().data_ptr().get_context(); }

// A received tensor sent on: the part of the view it covers, held by keep
// until the forward is released.
uint64_t send_view_part(tshare_channel *ch, const at::Tensor &t, tshare_view *view, tshare_drop_fn drop, void *keep,
                        void *stream, const SendOptions &o) {
  tshare_tensor_desc d = describe(t, tshare_view_data(view));
  uint64_t id = 0;
  int rc = tshare_share_view_part(ch, view, &d, stream, o.tag.c_str(), drop, keep, nullptr, o.timeout_ms, &id);
  if (rc != TSHARE_OK) fail_channel(ch, rc, "send (a received tensor, on)");
  return id;
}

// False for a tensor that was not received. A single share's storage
// holds its view, and the forward holds the storage; a set member's forward
// holds a view of its own, which holds the set.
bool send_if_received(tshare_channel *ch, const at::Tensor &t, void *stream, const SendOptions &o, uint64_t *id) {
  if (deleter_of(t) == &release_view) {
    *id = send_view_part(ch, t, static_cast<tshare_view *>(context_of(t)), drop_storage, new c10::Storage(t.storage()),
                         stream, o);
    return true;
  }
  if (tshare_view *member = detail::set_member_view(t)) {
    *id = send_view_part(ch, t, member, release_view, member, stream, o);
    return true;
  }
  return false;
}

// Torch's own shared memory (Tensor::share_memory_(), torch.multiprocessing's
// file_descriptor strategy) is an at::MapAllocator over a file it keeps open:
// that file travels as itself, the share holding the storage until released.
uint64_t send_torch_shared(tshare_channel *ch, const at::Tensor &t, at::MapAllocator *map, const SendOptions &o) {
  tshare_host_buffer *buffer = detail::wrap_torch_shared(t, map);
  tshare_tensor_desc d = describe(t, tshare_host_buffer_data(buffer));
  uint64_t id = 0;
  int rc = tshare_share_host(ch, buffer, &d, o.tag.c_str(), nullptr, o.timeout_ms, &id);
  tshare_host_buffer_destroy(buffer); // the share holds its own reference, and through it the storage
  if (rc != TSHARE_OK) fail_channel(ch, rc, "send (CPU tensor in torch shared memory)");
  return id;
}

uint64_t send_cpu(tshare_channel *ch, const at::Tensor &t, const SendOptions &o) {
  uint64_t id = 0;
  if (send_if_received(ch, t, nullptr, o, &id)) return id;
  if (at::MapAllocator *map = detail::torch_shared_map(t)) return send_torch_shared(ch, t, map, o);
  if (deleter_of(t) != &free_host_buffer) {
    if (!o.move_to_shared_memory)
      fail(TSHARE_E_UNSUPPORTED, "the CPU tensor is not in shared memory: allocate it with empty_shared(), call "
                                 "share_memory_(), or allow SendOptions::move_to_shared_memory");
    share_memory_(t);
  }
  auto *buffer = static_cast<tshare_host_buffer *>(context_of(t));
  tshare_tensor_desc d = describe(t, tshare_host_buffer_data(buffer));
  // The share holds the memfd itself: the storage may go before the consumer.
  int rc = tshare_share_host(ch, buffer, &d, o.tag.c_str(), nullptr, o.timeout_ms, &id);
  if (rc != TSHARE_OK) fail_channel(ch, rc, "send (CPU tensor)");
  return id;
}

#ifdef TSHARE_TORCH_CUDA
void *current_stream(int device) { return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(); }

uint64_t send_cuda(tshare_channel *ch, const at::Tensor &t, const SendOptions &o) {
  void *stream = current_stream(t.device().index());
  uint64_t id = 0;
  if (send_if_received(ch, t, stream, o, &id)) return id;
  int rc;
  if (t.storage().data() == nullptr) {
    // An empty storage has no allocation to export: a small owned buffer
    // carries the (empty) layout instead. Legacy: it holds no data, and a
    // VMM buffer would round 256 bytes up to 2 MiB.
    tshare_cuda_buffer *buffer = nullptr;
    tshare_error err;
    rc = tshare_cuda_buffer_create_kind(t.device().index(), 256, TSHARE_CUDA_HANDLE_LEGACY, &buffer, &err);
    if (rc != TSHARE_OK) fail(rc, std::string("send (empty CUDA tensor): ") + err.message);
    tshare_tensor_desc d = describe(t, nullptr);
    rc = tshare_share_cuda_buffer(ch, buffer, &d, stream, o.tag.c_str(), nullptr, o.timeout_ms, &id);
    tshare_cuda_buffer_release(buffer);
  } else {
    const void *base = t.storage().data();
    tshare_tensor_desc d = describe(t, base);
    rc = tshare_share_cuda_keep(ch, base, &d, stream, o.tag.c_str(), drop_storage, new c10::Storage(t.storage()),
                                nullptr, o.timeout_ms, &id);
  }
  if (rc != TSHARE_OK) fail_channel(ch, rc, "send (CUDA tensor)");
  return id;
}
#endif

// The stream a CUDA share is received on: the current stream of the device
// that will map it, so the caller's later work is ordered after the producer.
void *receive_stream(const tshare_share_info &info, const RecvOptions &o) {
  if (info.device_type != TSHARE_DEVICE_CUDA) return nullptr;
#ifdef TSHARE_TORCH_CUDA
  int count = static_cast<int>(c10::cuda::device_count());
  int device = o.device >= 0 ? o.device : info.cuda_device >= 0 ? info.cuda_device : c10::cuda::current_device();
  if (device >= count)
    fail(TSHARE_E_INVALID_ARG, "recv: device " + std::to_string(device) + " does not exist here (" +
                                   std::to_string(count) + " visible)");
  return current_stream(device);
#else
  (void)o;
  return nullptr;
#endif
}

} // namespace

namespace detail {

static std::string device_name(const at::Tensor &t) { return t.device().str(); }

void check_shareable(const at::Tensor &t) {
  if (!t.defined()) fail(TSHARE_E_INVALID_ARG, "cannot send an undefined tensor");
  if (t.is_sparse() || t.layout() == at::kSparseCsr)
    fail(TSHARE_E_UNSUPPORTED, "cannot send a sparse tensor: send its indices and values, or .to_dense()");
  if (t.is_quantized())
    fail(TSHARE_E_UNSUPPORTED, "cannot send a quantized tensor: send int_repr() with its scale and zero point");
  if (t.is_nested()) fail(TSHARE_E_UNSUPPORTED, "cannot send a nested tensor: send its components");
  if (t.is_meta()) fail(TSHARE_E_UNSUPPORTED, "cannot send a meta tensor: it has no memory to share");
  if (t.layout() != at::kStrided)
    fail(TSHARE_E_UNSUPPORTED, "cannot send a tensor with a non-strided layout; convert it with .to_dense()");
  if (!t.is_cpu() && !t.is_cuda())
    fail(TSHARE_E_UNSUPPORTED, "cannot send a tensor on " + device_name(t) + ": tshare shares CPU and CUDA memory");
  if (t.is_conj())
    fail(TSHARE_E_UNSUPPORTED, "cannot send a lazily conjugated view: call .resolve_conj() first");
  if (t.is_neg()) fail(TSHARE_E_UNSUPPORTED, "cannot send a lazily negated view: call .resolve_neg() first");
  if (!t.unsafeGetTensorImpl()->has_storage())
    fail(TSHARE_E_UNSUPPORTED, "cannot send a tensor without storage (a functional or fake tensor)");
  if (t.dim() > TSHARE_MAX_NDIM)
    fail(TSHARE_E_TOO_LARGE, "cannot send a tensor of " + std::to_string(t.dim()) + " dimensions (at most " +
                                 std::to_string(TSHARE_MAX_NDIM) + ")");
  (void)to_tshare_dtype(t.scalar_type());
}

tshare_tensor_desc describe(const at::Tensor &t, const void *base) {
  tshare_tensor_desc d;
  std::memset(&d, 0, sizeof d);
  d.dtype = to_tshare_dtype(t.scalar_type());
  d.ndim = static_cast<int32_t>(t.dim());
  for (int64_t i = 0; i < t.dim(); i++) {
    d.shape[i] = t.size(i);
    d.strides[i] = t.stride(i);
  }
  if (t.numel() > 0)
    d.byte_offset = static_cast<uint64_t>(static_cast<const char *>(t.data_ptr()) - static_cast<const char *>(base));
  return d;
}

tshare_host_buffer *wrap_torch_shared(const at::Tensor &t, at::MapAllocator *map) {
  tshare_host_buffer *buffer = nullptr;
  tshare_error err;
  auto *keep = new c10::Storage(t.storage());
  int rc = tshare_host_buffer_wrap_fd(map->fd(), static_cast<size_t>(map->size()), map->data(), drop_storage, keep,
                                      &buffer, &err);
  if (rc != TSHARE_OK) {
    delete keep;
    fail(rc, std::string("CPU tensor in torch shared memory: ") + err.message);
  }
  return buffer;
}

at::MapAllocator *torch_shared_map(const at::Tensor &t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage() || !t.is_cpu() || t.storage().data() == nullptr)
    return nullptr;
  at::MapAllocator *map = at::MapAllocator::fromDataPtr(t.storage().data_ptr());
  return map && map->fd() >= 0 && map->size() > 0 ? map : nullptr;
}

tshare_host_buffer *host_buffer_of(const at::Tensor &t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage() || !t.is_cpu()) return nullptr;
  return deleter_of(t) == &free_host_buffer ? static_cast<tshare_host_buffer *>(context_of(t)) : nullptr;
}

bool is_received(const at::Tensor &t) {
  return t.defined() && t.unsafeGetTensorImpl()->has_storage() && (deleter_of(t) == &release_view || is_set_member(t));
}

} // namespace detail

uint64_t send(tshare_channel *ch, const at::Tensor &t, const SendOptions &options) {
  if (!ch) fail(TSHARE_E_INVALID_ARG, "send: no channel");
  detail::check_shareable(t);
  if (options.tag.size() > TSHARE_TAG_MAX)
    fail(TSHARE_E_TOO_LARGE,
         "send: tag of " + std::to_string(options.tag.size()) + " bytes (at most " + std::to_string(TSHARE_TAG_MAX) + ")");
  if (t.is_cpu()) return send_cpu(ch, t, options);
#ifdef TSHARE_TORCH_CUDA
  return send_cuda(ch, t, options);
#else
  fail(TSHARE_E_UNSUPPORTED, "send: this build of the bridge has no CUDA (LibTorch or tshare built without it)");
#endif
}

std::optional<Received> recv(tshare_channel *ch, const RecvOptions &options) {
  if (!ch) fail(TSHARE_E_INVALID_ARG, "recv: no channel");
  tshare_share_info info;
  int rc = tshare_channel_peek_share(ch, options.timeout_ms, &info);
  if (rc == TSHARE_END) return std::nullopt;
  if (rc != TSHARE_OK) fail_channel(ch, rc, "recv");
  void *stream = receive_stream(info, options);
  tshare_view *view = nullptr;
  rc = tshare_view_recv_stream(ch, stream, 0, &view); // already queued: no wait
  if (rc != TSHARE_OK) fail_channel(ch, rc, "recv");
  Received r;
  r.tag = tshare_view_tag(view);
  r.share_id = tshare_view_share_id(view);
  r.is_copy = tshare_view_is_copy(view) == 1;
  r.tensor = tensor_from_view(view);
  return r;
}

at::Tensor tensor_from_view(tshare_view *view) {
  if (!view) fail(TSHARE_E_INVALID_ARG, "tensor_from_view: no view");
  at::ScalarType type;
  at::Device device(at::kCPU);
  std::vector<int64_t> sizes, strides;
  try {
    const tshare_tensor_desc *d = tshare_view_desc(view);
    type = to_scalar_type(d->dtype);
    for (int32_t i = 0; i < d->ndim; i++) {
      if (d->strides[i] < 0)
        fail(TSHARE_E_UNSUPPORTED, "share " + std::to_string(tshare_view_share_id(view)) + " has a negative stride (" +
                                       std::to_string(d->strides[i]) + " in dimension " + std::to_string(i) +
                                       "), which LibTorch tensors cannot have");
      sizes.push_back(d->shape[i]);
      strides.push_back(d->strides[i]);
    }
    if (tshare_view_device_type(view) == TSHARE_DEVICE_CUDA) {
#ifdef TSHARE_TORCH_CUDA
      device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(tshare_view_cuda_device(view)));
#else
      fail(TSHARE_E_UNSUPPORTED, "share " + std::to_string(tshare_view_share_id(view)) +
                                     " is GPU memory and this LibTorch (or tshare) was built without CUDA");
#endif
    }
  } catch (...) {
    tshare_view_release(view); // it is given back to the producer
    throw;
  }
  // From here the maker owns the view: its context deleter releases it even
  // if make_tensor throws, and the tensor's storage owns it afterwards.
  return at::for_blob(tshare_view_data(view), sizes)
      .strides(strides)
      .context(view, &release_view)
      .options(at::TensorOptions().dtype(type).device(device))
      .target_device(device)
      .make_tensor();
}

at::Tensor empty_shared(at::IntArrayRef sizes, const at::TensorOptions &options) {
  if (options.has_device() && options.device().type() != at::kCPU)
    fail(TSHARE_E_INVALID_ARG, "empty_shared: allocates CPU memory, not " + options.device().str());
  if (options.has_layout() && options.layout() != at::kStrided)
    fail(TSHARE_E_INVALID_ARG, "empty_shared: only the strided layout lives in shared memory");
  at::ScalarType type = c10::typeMetaToScalarType(options.dtype());
  (void)to_tshare_dtype(type);
  uint64_t numel = 1;
  for (int64_t s : sizes) {
    if (s < 0) fail(TSHARE_E_INVALID_ARG, "empty_shared: negative size " + std::to_string(s));
    if (s && numel > UINT64_MAX / static_cast<uint64_t>(s)) fail(TSHARE_E_OVERFLOW, "empty_shared: size overflows");
    numel *= static_cast<uint64_t>(s);
  }
  uint64_t itemsize = c10::elementSize(type);
  if (numel > UINT64_MAX / itemsize) fail(TSHARE_E_OVERFLOW, "empty_shared: size overflows");
  tshare_host_buffer *buffer = nullptr;
  tshare_error err;
  int rc = tshare_host_buffer_create(std::max<size_t>(numel * itemsize, 1), "tshare-torch", &buffer, &err);
  if (rc != TSHARE_OK) fail(rc, std::string("empty_shared: ") + err.message);
  return at::for_blob(tshare_host_buffer_data(buffer), sizes)
      .context(buffer, &free_host_buffer)
      .options(options.device(at::kCPU).dtype(type))
      .target_device(at::Device(at::kCPU))
      .make_tensor();
}

const at::Tensor &share_memory_(const at::Tensor &t) {
  if (!t.defined() || !t.is_cpu() || !t.unsafeGetTensorImpl()->has_storage())
    fail(TSHARE_E_INVALID_ARG, "share_memory_: needs a CPU tensor with storage");
  if (is_shared(t)) return t;
  const c10::Storage &storage = t.storage();
  size_t bytes = storage.nbytes();
  tshare_host_buffer *buffer = nullptr;
  tshare_error err;
  int rc = tshare_host_buffer_create(std::max<size_t>(bytes, 1), "tshare-torch", &buffer, &err);
  if (rc != TSHARE_OK) fail(rc, std::string("share_memory_: ") + err.message);
  if (bytes) std::memcpy(tshare_host_buffer_data(buffer), storage.data_ptr().get(), bytes);
  c10::StorageImpl *impl = storage.unsafeGetStorageImpl();
  // Every tensor on this storage now sees the memfd; the old memory is freed.
  impl->set_data_ptr_noswap(
      c10::DataPtr(tshare_host_buffer_data(buffer), buffer, &free_host_buffer, at::Device(at::kCPU)));
  // A resize would move it back to private memory behind the consumers' backs.
  impl->set_resizable(false);
  return t;
}

bool is_shared(const at::Tensor &t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage()) return false;
  if (t.is_cuda()) return true;
  c10::DeleterFnPtr d = deleter_of(t);
  return d == &free_host_buffer || detail::is_received(t) || detail::torch_shared_map(t) != nullptr;
}

} // namespace torch
} // namespace tshare
