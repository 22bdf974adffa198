/* The CUDA capabilities a hello offers: GPU memory is shared through the
 * driver's inter-process handles, which only a process on the same machine
 * can open, so a transport that may reach another host (UCX) offers none of
 * them. Needs the CUDA backend built, no device: the hello is built from the
 * backends' hooks as a channel's is (session_channel.c). */
#include "backend_cuda.h" /* the backends' table, the transports' caps */
#include "harness.h"

#include <string.h>

#define CUDA_CAPS (TSHARE_CAP_CUDA_IPC | TSHARE_CAP_CUDA_FD | TSHARE_CAP_CUDA_HELD | TSHARE_CAP_SET_CUDA)

/* What a hello over a transport of these caps offers. */
static uint64_t offered(uint32_t transport_caps) {
  tshare_hello self;
  memset(&self, 0, sizeof self);
  return ts_backends_hello(&self, transport_caps);
}

TS_TEST(a_transport_that_may_cross_hosts_offers_no_cuda_capability) {
  uint64_t caps = offered(0); /* UCX's: no fds, not necessarily this host */
  if (caps & CUDA_CAPS) TS_FAIL("a cross-host hello offers CUDA capabilities 0x%llx", (unsigned long long)(caps & CUDA_CAPS));
}

TS_TEST(a_same_host_transport_offers_the_cuda_capabilities) {
  /* A socket (or the ring over it) and a pipe, which carries no fds: the
   * sender of an fd handle checks the channel before it sends one. */
  CHECK_EQ(offered(TS_TRANSPORT_PASSES_FDS | TS_TRANSPORT_PEER_CREDENTIALS | TS_TRANSPORT_SAME_HOST) & CUDA_CAPS,
           CUDA_CAPS);
  CHECK_EQ(offered(TS_TRANSPORT_SAME_HOST) & CUDA_CAPS, CUDA_CAPS);
}

TS_TEST_MAIN
