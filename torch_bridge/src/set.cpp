// Tensor sets through the bridge, the producer's half: named tensors in, one
// tensor set out (a C builder filled with each CPU tensor's host buffer and
// each CUDA tensor's memory and storage, with its layout), sent to one
// channel or to many; and share_module_, which lays a module out for sets.
//
// Every tensor is checked before anything moves or goes out, so a refused
// set names the tensor at fault and leaves the channel as it was; names and
// bounds are the core builder's to check, as each tensor is added.
#include "tshare/torch_set.h"

#include "bridge_internal.h"
#include "set_internal.h"

#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#ifdef TSHARE_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <unordered_map>
#include <unordered_set>

namespace tshare {
namespace torch {
namespace {

using detail::fail;
using detail::fail_channel;

using detail::BuilderPtr;
using detail::MemberRefs;
using detail::refs_of;

// "tensor 3 ('fc.weight')": names up to 1 KiB are cut short in messages.
std::string member_label(size_t i, const std::string &name) {
  constexpr size_t shown = 80;
  std::string label = "tensor " + std::to_string(i) + " ('";
  for (char c : name.substr(0, shown)) label += c ? std::string(1, c) : std::string("\\0"); // a message is a C string
  if (name.size() > shown) label += "...' of " + std::to_string(name.size()) + " bytes";
  else label += "'";
  return label + ")";
}

// What the bridge refuses in a member; names, bounds and duplicates are the
// core's to check (tshare_set_builder_add_*).
void check_member(size_t i, const std::string &name, const at::Tensor &t, bool move) {
  try {
    detail::check_shareable(t);
  } catch (const Error &e) {
    throw Error(e.code(), "tshare: set: " + member_label(i, name) + ": " + (e.what() + 8)); // past "tshare: "
  }
  if (name.find('\0') != std::string::npos)
    fail(TSHARE_E_INVALID_ARG, "set: " + member_label(i, name) + ": a name cannot hold a NUL byte");
  if (detail::is_received(t))
    fail(TSHARE_E_UNSUPPORTED, "set: " + member_label(i, name) +
                                   " was received from a peer: a set carries this process's own shared memory; "
                                   "send it on alone with send(), or copy it into empty_shared() first");
  if (t.is_cuda()) {
#ifndef TSHARE_TORCH_CUDA
    fail(TSHARE_E_UNSUPPORTED,
         "set: " + member_label(i, name) + " is a CUDA tensor and this build of the bridge has no CUDA");
#endif
    return; // the caching allocator's memory travels as it is: the core describes it
  }
  if (!detail::host_buffer_of(t) && !detail::torch_shared_map(t) && !move)
    fail(TSHARE_E_UNSUPPORTED, "set: " + member_label(i, name) +
                                   " is not in shared memory: call tshare::torch::share_module_(module) once (the "
                                   "module's parameters and buffers move there in place), share_memory_() the "
                                   "tensor, or set SetOptions::move_to_shared_memory");
}

#ifdef TSHARE_TORCH_CUDA
// What keeps a CUDA member's memory alive: its storage, counted, as the
// builder and each sent set take their own reference (from any thread).
struct StorageKeep {
  std::atomic<int> refs{1};
  c10::Storage storage;
  explicit StorageKeep(c10::Storage s) : storage(std::move(s)) {}
};
void retain_storage(void *keep) { static_cast<StorageKeep *>(keep)->refs.fetch_add(1); }
void drop_storage(void *keep) {
  auto *k = static_cast<StorageKeep *>(keep);
  if (k->refs.fetch_sub(1) == 1) delete k;
}

int add_cuda_member(tshare_set_builder *b, const std::string &name, const at::Tensor &t, tshare_error *err) {
  if (t.storage().data() == nullptr) {
    // An empty storage has no allocation to export: a small owned buffer
    // carries the (empty) layout instead, as send() does.
    tshare_cuda_buffer *buffer = nullptr;
    int rc = tshare_cuda_buffer_create_kind(t.device().index(), 256, TSHARE_CUDA_HANDLE_LEGACY, &buffer, err);
    if (rc != TSHARE_OK) return rc;
    tshare_tensor_desc d = detail::describe(t, nullptr);
    rc = tshare_set_builder_add_cuda_buffer(b, name.c_str(), buffer, &d, err);
    tshare_cuda_buffer_release(buffer); // the builder holds it
    return rc;
  }
  const void *base = t.storage().data();
  tshare_tensor_desc d = detail::describe(t, base);
  return tshare_set_builder_add_cuda_keep(b, name.c_str(), const_cast<void *>(base), &d, retain_storage,
                                          drop_storage, new StorageKeep(t.storage()), err);
}
#endif

void add_member(tshare_set_builder *b, size_t i, const std::string &name, const at::Tensor &t, bool move) {
  tshare_error err;
  int rc;
  if (t.is_cpu()) {
    if (at::MapAllocator *map = detail::torch_shared_map(t)) { // torch's own shared memory: its file, no copy
      tshare_host_buffer *buffer = detail::wrap_torch_shared(t, map);
      tshare_tensor_desc d = detail::describe(t, tshare_host_buffer_data(buffer));
      rc = tshare_set_builder_add_host(b, name.c_str(), buffer, &d, &err);
      tshare_host_buffer_destroy(buffer); // the builder holds its own reference
    } else {
      if (move) share_memory_(t); // a no-op where it is shared already
      tshare_host_buffer *buffer = detail::host_buffer_of(t);
      tshare_tensor_desc d = detail::describe(t, tshare_host_buffer_data(buffer));
      rc = tshare_set_builder_add_host(b, name.c_str(), buffer, &d, &err);
    }
  } else {
#ifdef TSHARE_TORCH_CUDA
    rc = add_cuda_member(b, name, t, &err);
#else
    rc = TSHARE_E_UNSUPPORTED; // refused by check_member already
    std::snprintf(err.message, sizeof err.message, "set: no CUDA in this build");
#endif
  }
  if (rc != TSHARE_OK) {
    std::string why = err.message;
    if (why.rfind("set: ", 0) == 0) why.erase(0, 5);
    fail(rc, "set: " + member_label(i, name) + ": " + why);
  }
}

// The device's work done: every stream of it (CUDA tensors exist only in a
// build with CUDA).
void synchronize(at::Device device) {
#ifdef TSHARE_TORCH_CUDA
  c10::cuda::CUDAGuard guard(device);
  c10::cuda::device_synchronize();
#else
  (void)device;
#endif
}

// Each tensor's storage copied whole into one new arena, and the tensor set_()
// onto it in place (its identity kept: optimizers and hooks holding it go on
// working). Tensors of one storage stay on one storage (tied weights). The
// arena is a shared buffer for CPU tensors (a set of the module travels with
// one fd) or one allocation of the tensors' CUDA device (one segment of the
// caching allocator: a consumer opens one IPC mapping, not one per segment;
// CUDA tensors already on one storage stay where they are).
void move_into_one_arena(std::vector<at::Tensor> &tensors, bool cuda) {
  constexpr size_t align = 64;                        // a multiple of every element size
  std::vector<std::pair<c10::Storage, size_t>> places; // each storage and its byte offset, first-seen order
  std::unordered_map<c10::StorageImpl *, size_t> index;
  size_t total = 0;
  std::vector<size_t> at_byte;
  for (const at::Tensor &t : tensors) {
    auto found = index.emplace(t.storage().unsafeGetStorageImpl(), places.size());
    if (found.second) {
      places.emplace_back(t.storage(), total);
      total += (t.storage().nbytes() + align - 1) / align * align;
    }
    at_byte.push_back(places[found.first->second].second);
  }
  if (cuda && places.size() < 2) return; // one allocation already: nothing to gain
  int64_t bytes = static_cast<int64_t>(std::max<size_t>(total, 1));
  at::Tensor arena = cuda ? at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(tensors[0].device()))
                          : empty_shared({bytes}, at::kByte);
  c10::AutoGradMode no_grad(false); // parameters that require grad move too
  // Every stream's writes to the tensors done before the copies, and the
  // copies done before the old blocks go back to the caching allocator
  // (which hands them out again on their own streams at once).
  if (cuda) synchronize(arena.device());
  for (auto &place : places) { // each storage's bytes as they are, whatever its tensors read them as
    int64_t nbytes = static_cast<int64_t>(place.first.nbytes());
    if (!nbytes) continue;
    at::Tensor source = at::empty({0}, arena.options()).set_(place.first, 0, {nbytes}, {1});
    arena.narrow(0, static_cast<int64_t>(place.second), nbytes).copy_(source);
  }
  if (cuda) synchronize(arena.device());
  for (size_t i = 0; i < tensors.size(); i++) {
    at::Tensor &t = tensors[i];
    int64_t item = static_cast<int64_t>(t.element_size());
    t.set_(arena.storage(), static_cast<int64_t>(at_byte[i]) / item + t.storage_offset(), t.sizes(), t.strides());
  }
}

} // namespace

namespace detail {

MemberRefs refs_of(const NamedTensors &tensors) {
  MemberRefs refs;
  refs.reserve(tensors.size());
  for (const auto &e : tensors) refs.emplace_back(&e.first, &e.second);
  return refs;
}

MemberRefs refs_of(const TensorDict &tensors) {
  MemberRefs refs;
  refs.reserve(tensors.size());
  for (const auto &item : tensors) refs.emplace_back(&item.key(), &item.value());
  return refs;
}

// A set carries one device's memory: the core refuses a second device,
// naming the tensor, so the first CUDA member's device is the set's.
int cuda_device_of(const MemberRefs &members) {
  for (const auto &m : members)
    if (m.second->is_cuda()) return m.second->device().index();
  return -1;
}

void *current_stream_of(int device) {
#ifdef TSHARE_TORCH_CUDA
  if (device >= 0) return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
#endif
  return nullptr;
}

// The CUDA members are ordered after the work queued so far on the current
// stream of their device.
BuilderPtr build_set(const MemberRefs &members, const SetOptions &o) {
  if (members.empty()) fail(TSHARE_E_INVALID_ARG, "set: no tensors to send");
  for (size_t i = 0; i < members.size(); i++)
    check_member(i, *members[i].first, *members[i].second, o.move_to_shared_memory);
  BuilderPtr b(tshare_set_builder_create());
  if (!b) fail(TSHARE_E_NOMEM, "set: out of memory");
  tshare_error err;
  int rc = tshare_set_builder_set_meta(b.get(), o.meta.data(), o.meta.size(), &err);
  if (rc != TSHARE_OK) fail(rc, err.message);
  for (size_t i = 0; i < members.size(); i++)
    add_member(b.get(), i, *members[i].first, *members[i].second, o.move_to_shared_memory);
  int device = cuda_device_of(members);
  if (device >= 0) tshare_set_builder_set_stream(b.get(), current_stream_of(device));
  return b;
}

uint64_t send_builder(tshare_channel *ch, const tshare_set_builder *b, int timeout_ms) {
  uint64_t id = 0;
  int rc = tshare_set_send(ch, b, nullptr, timeout_ms, &id);
  if (rc != TSHARE_OK) fail_channel(ch, rc, "send_set");
  return id;
}

// Fan-out through the C calls: one send per channel, then one wait for all
// the releases together; each consumer's outcome stays its own.
std::vector<SendResult> send_builder_all(const std::vector<tshare_channel *> &channels, const tshare_set_builder *b,
                                         int timeout_ms, int release_timeout_ms) {
  size_t n = channels.size();
  std::vector<uint64_t> ids(n, 0);
  std::vector<tshare_error> sent(n), waited(n);
  std::vector<SendResult> results(n);
  if (n == 0) return results;
  tshare_set_send_all(b, channels.data(), n, nullptr, timeout_ms, ids.data(), sent.data());
  for (size_t i = 0; i < n; i++) {
    results[i].set_id = ids[i];
    results[i].code = sent[i].code;
    if (!results[i].ok()) results[i].error = std::string("tshare: send_set_all: ") + sent[i].message;
  }
  if (release_timeout_ms == 0) return results;
  tshare_set_wait_all(channels.data(), ids.data(), n, release_timeout_ms, waited.data());
  for (size_t i = 0; i < n; i++) {
    SendResult &r = results[i];
    if (!r.ok()) continue;
    if (waited[i].code == TSHARE_OK) {
      r.released = true;
    } else {
      r.code = waited[i].code;
      r.error = std::string("tshare: send_set_all: ") + waited[i].message;
    }
  }
  return results;
}

} // namespace detail

namespace {

uint64_t send_once(tshare_channel *ch, const MemberRefs &members, const SetOptions &o) {
  if (!ch) fail(TSHARE_E_INVALID_ARG, "send_set: no channel");
  return detail::send_builder(ch, detail::build_set(members, o).get(), o.timeout_ms);
}

std::vector<SendResult> send_once_all(const std::vector<tshare_channel *> &channels, const MemberRefs &members,
                                      const SetOptions &o, int release_timeout_ms) {
  return detail::send_builder_all(channels, detail::build_set(members, o).get(), o.timeout_ms, release_timeout_ms);
}

} // namespace

uint64_t send_set(tshare_channel *ch, const NamedTensors &tensors, const SetOptions &options) {
  return send_once(ch, refs_of(tensors), options);
}

uint64_t send_set(tshare_channel *ch, const TensorDict &tensors, const SetOptions &options) {
  return send_once(ch, refs_of(tensors), options);
}

std::vector<SendResult> send_set_all(const std::vector<tshare_channel *> &channels, const NamedTensors &tensors,
                                     const SetOptions &options, int release_timeout_ms) {
  return send_once_all(channels, refs_of(tensors), options, release_timeout_ms);
}

std::vector<SendResult> send_set_all(const std::vector<tshare_channel *> &channels, const TensorDict &tensors,
                                     const SetOptions &options, int release_timeout_ms) {
  return send_once_all(channels, refs_of(tensors), options, release_timeout_ms);
}

::torch::nn::Module &share_module_(::torch::nn::Module &module, bool pack_cuda) {
  std::vector<at::Tensor> host;
  std::map<int, std::vector<at::Tensor>> cuda; // by device index
  std::unordered_set<const void *> seen;
  for (auto list : {module.parameters(/*recurse=*/true), module.buffers(/*recurse=*/true)})
    for (const at::Tensor &t : list) {
      if (!t.defined() || t.layout() != at::kStrided || !t.unsafeGetTensorImpl()->has_storage() ||
          !seen.insert(t.unsafeGetTensorImpl()).second)
        continue;
      if (t.is_cpu() && !is_shared(t)) host.push_back(t);
      else if (pack_cuda && t.is_cuda()) cuda[t.device().index()].push_back(t);
    }
  if (!host.empty()) move_into_one_arena(host, false);
  for (auto &device : cuda) move_into_one_arena(device.second, true);
  return module;
}

::torch::nn::Module &share_module_(::torch::nn::Module &module) { return share_module_(module, false); }

} // namespace torch
} // namespace tshare
