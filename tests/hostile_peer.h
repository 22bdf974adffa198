/* What a hostile or hand-rolled peer uses: frames written straight to the
 * socket beside the channel's own, a clock, and ring channels. */
#ifndef TSHARE_TEST_HOSTILE_PEER_H
#define TSHARE_TEST_HOSTILE_PEER_H

#include "fd_util.h"
#include "frame_util.h"
#include "proc_util.h"

#include <time.h>

/* Frame bytes and an fd (or -1) written straight to the socket, as a peer
 * speaking the wire format by hand would: nothing checks that they agree. */
static inline void send_raw(tshare_channel *ch, const tshare_frame *f, int fd) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  CHECK_RC(tshare_wire_encode(f, buf, sizeof buf, &len, NULL), TSHARE_OK, "");
  CHECK(send_with_fd(tshare_channel_fd(ch), buf, len, fd, 0) == (ssize_t)len);
}

static inline int64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static inline tshare_channel *open_ring_channel(int fd, const char *name) {
  tshare_channel *ch = open_channel_over(fd, name, NULL, NULL, TSHARE_TRANSPORT_RING);
  CHECK_EQ(tshare_channel_transport(ch), TSHARE_TRANSPORT_RING);
  return ch;
}

/* A channel that holds at most `budget` of the peer's fds (max_unclaimed_fds). */
static inline tshare_channel *open_with_budget(int fd, const char *name, unsigned budget) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = name;
  o.max_unclaimed_fds = budget;
  tshare_channel *ch;
  tshare_error err;
  CHECK_RC(tshare_channel_open_socket(fd, &o, &ch, &err), TSHARE_OK, err.message);
  return ch;
}

#endif
