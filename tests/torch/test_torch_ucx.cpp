// The LibTorch bridge across a ucx:// channel (127.0.0.1, or two network
// namespaces joined by a veth pair where root may make them): a tensor and
// a state_dict arrive as copies in the consumer's memory (is_copy), equal
// to what was sent, and the producer's tensors are its own again once the
// release came. CUDA tensors (where LibTorch has CUDA and a GPU is usable)
// are staged through host memory and arrive on the consumer's GPU. Both
// ends are processes forked before either touches CUDA. Without UCX the
// cases skip.
#include "torch_test_util.h"
#include "tshare/torch_set.h"
#include "ucx_pair.h"

#ifdef TSHARE_TEST_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

static const int TIMEOUT = 20000;

static at::Device device_of_case(bool cuda) { return cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU); }

// The model both ends build: 290 tensors of a small network, each of its own.
static tt::TensorDict model(bool cuda, double add) {
  tt::TensorDict d;
  for (int i = 0; i < 290; i++) {
    at::Tensor t = at::arange(16 + i % 7, at::kFloat) * 0.5 + double(i) + add;
    if (i % 3 == 0) t = t.to(at::kBFloat16);
    t = cuda ? t.to(device_of_case(true)) : tt::share_memory_(t.clone());
    d.insert("layers." + std::to_string(i / 2) + (i % 2 ? ".bias" : ".weight"), t);
  }
  return d;
}

static bool use_cuda = false;

static void skip_without_gpu_in_child() {
#ifdef TSHARE_TEST_TORCH_CUDA
  if (use_cuda && c10::cuda::device_count() == 0) {
    printf("SKIP: LibTorch sees no CUDA device\n");
    _exit(77);
  }
#endif
}

static void producer() {
  skip_without_gpu_in_child();
  tshare_channel *ch = accept_one(TOKEN);
  at::Tensor t = use_cuda ? at::arange(1000, at::kInt).to(device_of_case(true)) : tt::empty_shared({1000}, at::kInt);
  if (!use_cuda) t.copy_(at::arange(1000, at::kInt));
  tt::SendOptions so;
  so.tag = "single";
  uint64_t id = tt::send(ch, t.narrow(0, 10, 900), so);
  tt::TensorDict m = model(use_cuda, 0);
  tt::SetOptions o;
  o.meta = "step=1";
  uint64_t set_id = tt::send_set(ch, m, o);
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, set_id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  t.fill_(-1); // released: the consumer's copy is its own
  for (auto &e : m) e.value().fill_(-1);
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void consumer() {
  skip_without_gpu_in_child();
  tshare_channel *ch = connect_one(TOKEN);
  auto r = tt::recv(ch, {TIMEOUT});
  CHECK(r);
  CHECK(r->is_copy);
  CHECK(r->tag == "single");
  CHECK(r->tensor.device() == device_of_case(use_cuda));
  auto s = tt::recv_set(ch, {TIMEOUT});
  CHECK(s);
  CHECK(s->is_copy);
  CHECK(s->meta == "step=1");
  // Read after the producer wrote -1 over its own (once both were released).
  usleep(200000);
  CHECK(at::equal(r->tensor.cpu(), at::arange(10, 910, at::kInt)));
  tt::TensorDict want = model(false, 0);
  CHECK_EQ(s->tensors.size(), want.size());
  for (size_t i = 0; i < want.size(); i++) {
    const auto &got = s->tensors[i];
    if (got.key() != want[i].key()) TS_FAIL("name %zu is '%s'", i, got.key().c_str());
    CHECK(got.value().device() == device_of_case(use_cuda));
    if (!at::equal(got.value().cpu(), want[i].value())) TS_FAIL("tensor %zu ('%s') differs", i, got.key().c_str());
  }
  r.reset();
  s.reset();
  tshare_channel_close(ch);
}

TS_TEST(a_tensor_and_a_state_dict_cross_as_copies_loopback) {
  use_loopback();
  run_pair(producer, consumer);
}

TS_TEST(a_tensor_and_a_state_dict_cross_as_copies_netns) {
  make_namespaces();
  run_pair(producer, consumer);
}

TS_TEST(cuda_tensors_cross_staged_onto_the_consumers_gpu_loopback) {
#ifndef TSHARE_TEST_TORCH_CUDA
  TS_SKIP("this LibTorch has no CUDA");
#endif
  use_cuda = true;
  use_loopback();
  run_pair(producer, consumer);
}

TS_TEST_MAIN
