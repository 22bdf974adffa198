/* Fuzz target: a channel on the ring transport against a hand-written peer
 * that the input drives, in this process, over a socketpair. The peer puts
 * frames (well formed, or not) into its ring and on the socket, with or
 * without fds and their SOCKET_NEXT entries, floods nudges, repeats share
 * ids with chunk frames, and reads the channel's ring or leaves it full
 * while the channel sends; the channel is driven as an event loop drives it.
 *
 * Besides crashes, sanitizer reports and hangs, it fails (abort) when:
 * - the channel says the peer closed while the peer's socket is still open;
 * - an event loop that drained the channel (timeout 0 until
 *   TSHARE_E_TIMEOUT) finds its fd readable again with nothing new sent
 *   (it would spin);
 * - an fd the peer sent is still open after the channel closed.
 *
 * Input: a list of operations, each an opcode byte and its argument bytes
 * (see the OP_ list). */
#include "fd_util.h"
#include "frame_util.h"
#include "fuzz_input.h"
#include "log.h"
#include "ring.h"
#include "tshare/share.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#define PEER_RING_CAP TS_RING_CAP_MIN /* small: the peer's ring fills after a few frames */
#define PEER_BUFFER 4096              /* bytes of the host buffer every share names */
#define FD_BUDGET 8                   /* max_unclaimed_fds of the channel */
#define PEER_MEMFD_NAME "tshare-fuzz-peer"

typedef struct peer {
  int sock;                            /* its end of the socketpair, non-blocking */
  uint8_t owed[TSHARE_WIRE_FRAME_MAX]; /* the end of a frame the socket took only the start of */
  size_t owed_len;
  ts_ring out; /* the ring it writes and the channel reads */
  ts_ring in;  /* the channel's ring, once its setup frame came (ctl NULL before) */
  int mem;     /* a host buffer's memfd: every fd it sends is this one */
} peer;

typedef struct harness {
  peer p;
  tshare_channel *ch;
  bool fd_asked; /* tshare_channel_fd() was called: the event-loop checks apply */
} harness;

/* ---- the peer's side ------------------------------------------------------ */

/* 0: the encoder refuses the frame (a ring setup without its fd flag, say);
 * the raw-byte operations send what no encoder writes. */
static size_t encode(const tshare_frame *f, uint8_t *buf, size_t cap) {
  size_t len = 0;
  return tshare_wire_encode(f, buf, cap, &len, NULL) == TSHARE_OK ? len : 0;
}

/* The end of a frame a full socket cut: sent before anything else, so the
 * stream stays whole (only the raw operations break it). */
static bool pay_owed(peer *p) {
  while (p->owed_len > 0) {
    ssize_t w = send_with_fd(p->sock, p->owed, p->owed_len, -1, MSG_DONTWAIT);
    if (w <= 0) return false;
    memmove(p->owed, p->owed + w, p->owed_len - (size_t)w);
    p->owed_len -= (size_t)w;
  }
  return true;
}

/* Messages of `unit` bytes each (len a multiple of it) on the socket, fd (or
 * -1) riding on the first byte, as many as the socket takes now; one cut
 * short is finished later. The count of bytes sent or owed. */
static size_t peer_send_units(peer *p, const uint8_t *buf, size_t len, size_t unit, int fd) {
  if (!pay_owed(p)) return 0;
  ssize_t w = send_with_fd(p->sock, buf, len, fd, MSG_DONTWAIT);
  if (w <= 0) return 0;
  size_t cut = (size_t)w % unit;
  if (cut) {
    p->owed_len = unit - cut;
    memcpy(p->owed, buf + w, p->owed_len);
    return (size_t)w + p->owed_len;
  }
  return (size_t)w;
}

static void peer_send(peer *p, const void *buf, size_t len, int fd) {
  if (len) (void)peer_send_units(p, buf, len, len, fd);
}

static void peer_send_frame(peer *p, const tshare_frame *f, int fd) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  peer_send(p, buf, encode(f, buf, sizeof buf), fd);
}

/* What the channel writes on the socket: its ring's setup (the only fd it
 * sends here: it shares nothing) is mapped, the rest dropped. */
static void peer_read_socket(peer *p) {
  for (;;) {
    uint8_t buf[16384];
    union {
      char space[CMSG_SPACE(sizeof(int) * 8)];
      struct cmsghdr align;
    } ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.space;
    msg.msg_controllen = sizeof ctl.space;
    if (recvmsg(p->sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) <= 0) return;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; i++) {
        int fd;
        memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        char err[256];
        if (!p->in.ctl && ts_ring_attach(&p->in, fd, TS_RING_CAP_DEFAULT, err, sizeof err) != 0) abort();
        close(fd);
      }
    }
  }
}

/* A nudge on the socket: what a ring writer sends when the reader sleeps in
 * poll(). */
static void peer_nudge(peer *p) {
  tshare_frame n = ring_op_frame(TSHARE_RING_NUDGE);
  peer_send_frame(p, &n, -1);
}

/* Bytes into the peer's ring, whole or not at all, and the nudge a sleeping
 * reader asked for (or, with `nudge` set, one anyway). */
static void peer_ring_put(peer *p, const void *buf, size_t len, bool nudge) {
  if (len == 0 || ts_ring_write(&p->out, buf, len) <= 0) return;
  if (ts_ring_wake_reader(&p->out) == TS_RING_SOCKET || nudge) peer_nudge(p);
}

/* The channel's ring read to its end, as a peer that keeps up does. */
static void peer_drain_ring(peer *p) {
  peer_read_socket(p);
  if (!p->in.ctl) return;
  static uint8_t sink[1 << 16];
  while (ts_ring_read(&p->in, sink, sizeof sink) > 0) {
  }
  if (ts_ring_wake_writer(&p->in) == TS_RING_SOCKET) peer_nudge(p);
}

static tshare_tensor_desc ints(int64_t n) {
  return tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, &n, 0);
}

/* A frame picked by the input: share ids, chunk indexes and ids come from
 * small ranges, so that repeats and near misses are common. */
static tshare_frame frame_of(input *in) {
  uint8_t kind = take(in), a = take(in), b = take(in);
  tshare_frame f;
  memset(&f, 0, sizeof f);
  switch (kind % 9) {
  case 0: /* a host share of the peer's buffer */
    f = memfd_share_frame(PEER_BUFFER, ints(1 + a % (PEER_BUFFER / 4)));
    f.u.share.share_id = 1 + b % 4;
    break;
  case 1: /* a chunk of VMM memory that spans several (index 1..count-1) */
    f.type = TSHARE_FRAME_CHUNK;
    f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
    f.u.chunk.alloc_id = 9 + a % 2;
    f.u.chunk.index = 1 + b % 3;
    f.u.chunk.count = 4;
    f.u.chunk.size = PEER_BUFFER;
    break;
  case 2: /* the share that carries chunk 0 of such memory */
    f = memfd_share_frame(4 * PEER_BUFFER, ints(16));
    f.u.share.share_id = 1 + b % 4;
    f.u.share.alloc_id = 9 + a % 2;
    f.u.share.mem_kind = TSHARE_MEM_CUDA_FD;
    f.u.share.device_type = TSHARE_DEVICE_CUDA;
    f.u.share.share_flags = TSHARE_SHARE_FLAG_CHUNKS;
    break;
  case 3:
    f.type = TSHARE_FRAME_RELEASE;
    f.u.release.count = 1 + a % 4;
    for (uint32_t i = 0; i < f.u.release.count; i++) f.u.release.share_ids[i] = b + i;
    break;
  case 4:
    f.type = TSHARE_FRAME_RETIRE;
    f.u.retire.closed = a % 3;
    f.u.retire.count = 1;
    f.u.retire.alloc_ids[0] = 9 + b % 2;
    break;
  case 5:
    f = ring_op_frame((uint8_t)(a % 4));
    break;
  case 6:
    f.type = TSHARE_FRAME_ERROR;
    f.u.error.code = TSHARE_E_STATE;
    snprintf(f.u.error.message, sizeof f.u.error.message, "fuzz %u", (unsigned)a);
    break;
  case 7:
    f.type = TSHARE_FRAME_BYE;
    break;
  default: /* a share whose fd flag is off: the fd that may ride on it is not its own */
    f = memfd_share_frame(PEER_BUFFER, ints(16));
    f.flags = 0;
    f.u.share.share_id = 1 + b % 4;
    break;
  }
  return f;
}

/* ---- the channel's side --------------------------------------------------- */

static void check_rc(const harness *h, int rc) {
  (void)h;
  if (rc == TSHARE_E_PEER_CLOSED) abort(); /* the peer's socket is open: a live peer blamed */
}

/* One event-loop turn: frames processed, views taken and dropped. */
static int drive(harness *h) {
  int rc = tshare_channel_poll(h->ch, 0);
  check_rc(h, rc);
  for (int i = 0; i < 4; i++) {
    tshare_view *v = NULL;
    int vr = tshare_view_recv(h->ch, 0, &v);
    check_rc(h, vr);
    if (vr != TSHARE_OK) break;
    const volatile uint8_t *data = tshare_view_data(v);
    if (data && tshare_view_desc(v)->ndim > 0) (void)data[0]; /* mapped and readable */
    tshare_view_release(v);
  }
  return rc;
}

/* The drive ended because nothing came: the receive's own timeout. (A
 * drive whose releases found the peer's ring full still receives after
 * their send timed out, so its timeout is the receive's too.) */
static bool nothing_came(const harness *h, int rc) {
  return rc == TSHARE_E_TIMEOUT && strncmp(tshare_channel_last_error(h->ch), "receive", 7) == 0;
}

/* An event loop's rule: after a wake, drive until nothing more comes
 * (TSHARE_E_TIMEOUT); then poll() on the fd must sleep until the peer sends
 * something new. A channel that ended (bye, an error it keeps reporting) is
 * left alone: its fd is for the caller to stop watching. */
static void drain_then_expect_quiet(harness *h) {
  if (!h->fd_asked) return;
  int rc = TSHARE_OK;
  for (int turns = 0; turns < 64 && rc != TSHARE_E_TIMEOUT; turns++) rc = drive(h);
  if (!nothing_came(h, rc)) return;
  struct pollfd p = {.fd = tshare_channel_fd(h->ch), .events = POLLIN, .revents = 0};
  if (poll(&p, 1, 0) == 1 && (p.revents & POLLIN)) {
    /* Readable after a drain: one more drive must take what woke it. */
    rc = drive(h);
    if (nothing_came(h, rc) && poll(&p, 1, 0) == 1 && (p.revents & POLLIN)) abort(); /* a poll loop spins */
  }
}

/* Releases until the channel's ring is full (a send that would wait). */
static void fill_channel_ring(harness *h) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = TSHARE_RELEASE_MAX;
  for (uint32_t i = 0; i < TSHARE_RELEASE_MAX; i++) f.u.release.share_ids[i] = 1000 + i;
  for (int i = 0; i < 1 << 14; i++) {
    int rc = tshare_channel_send_frame(h->ch, &f, -1, 0);
    check_rc(h, rc);
    if (rc != TSHARE_OK) return;
  }
}

static void send_waiting(harness *h, int timeout_ms) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = 1;
  f.u.release.share_ids[0] = 2000;
  check_rc(h, tshare_channel_send_frame(h->ch, &f, -1, timeout_ms));
}

/* Nudges on the socket until it takes no more. */
static void flood_nudges(peer *p) {
  static uint8_t burst[1 << 16];
  static size_t burst_len, nudge_len;
  if (!burst_len) {
    tshare_frame n = ring_op_frame(TSHARE_RING_NUDGE);
    uint8_t one[64];
    nudge_len = encode(&n, one, sizeof one);
    for (; burst_len + nudge_len <= sizeof burst; burst_len += nudge_len) memcpy(burst + burst_len, one, nudge_len);
  }
  while (peer_send_units(p, burst, burst_len, nudge_len, -1) == burst_len) {
  }
}

/* ---- operations ----------------------------------------------------------- */

enum {
  OP_RING_FRAME,          /* a frame into the peer's ring (kind, a, b, nudge anyway) */
  OP_SOCKET_FRAME,        /* a frame on the socket (kind, a, b, flags: bit 0 with an fd, bit 1 then its SOCKET_NEXT) */
  OP_RAW_RING,            /* len, then that many bytes into the ring */
  OP_RAW_SOCKET,          /* len, then that many bytes on the socket */
  OP_NUDGE_FLOOD,         /* the socket filled with nudges */
  OP_DRIVE,               /* one event-loop turn */
  OP_ASK_FD,              /* tshare_channel_fd(): the channel is watched by poll() from now on */
  OP_EXPECT_QUIET,        /* drain, then the fd must not be readable */
  OP_FILL_CHANNEL_RING,   /* the channel sends until its ring is full */
  OP_SEND_WAITING,        /* a send that waits up to arg % 3 ms for room */
  OP_FLOOD_WHILE_WAITING, /* arg % 8 + 1 rounds: nudges fill the socket, then a send waits 1 ms */
  OP_PEER_READS,          /* the peer reads the channel's ring to its end */
  OP_COUNT
};

static void op_socket_frame(harness *h, input *in) {
  tshare_frame f = frame_of(in);
  uint8_t flags = take(in);
  bool with_fd = flags & 1;
  if (with_fd) f.flags |= TSHARE_FRAME_FLAG_FD_ATTACHED;
  peer_send_frame(&h->p, &f, with_fd ? h->p.mem : -1);
  if (flags & 2) {
    uint8_t buf[64];
    tshare_frame next = ring_op_frame(TSHARE_RING_SOCKET_NEXT);
    peer_ring_put(&h->p, buf, encode(&next, buf, sizeof buf), false);
  }
}

static void op_raw(harness *h, input *in, bool ring) {
  uint8_t want = take(in);
  uint8_t buf[256];
  size_t n = 0;
  while (n < want && in->n) buf[n++] = take(in);
  if (ring)
    peer_ring_put(&h->p, buf, n, false);
  else
    peer_send(&h->p, buf, n, -1);
}

static void run_op(harness *h, input *in) {
  uint8_t op = take(in) % OP_COUNT;
  peer_read_socket(&h->p); /* its receive buffer never fills: the channel's socket sends never wait on it */
  switch (op) {
  case OP_RING_FRAME: {
    tshare_frame f = frame_of(in);
    uint8_t buf[TSHARE_WIRE_FRAME_MAX];
    peer_ring_put(&h->p, buf, encode(&f, buf, sizeof buf), take(in) & 1);
    break;
  }
  case OP_SOCKET_FRAME:
    op_socket_frame(h, in);
    break;
  case OP_RAW_RING:
    op_raw(h, in, true);
    break;
  case OP_RAW_SOCKET:
    op_raw(h, in, false);
    break;
  case OP_NUDGE_FLOOD:
    flood_nudges(&h->p);
    break;
  case OP_DRIVE:
    (void)drive(h);
    break;
  case OP_ASK_FD:
    (void)tshare_channel_fd(h->ch);
    h->fd_asked = true;
    break;
  case OP_EXPECT_QUIET:
    drain_then_expect_quiet(h);
    break;
  case OP_FILL_CHANNEL_RING:
    fill_channel_ring(h);
    break;
  case OP_SEND_WAITING:
    send_waiting(h, take(in) % 3);
    break;
  case OP_FLOOD_WHILE_WAITING:
    for (int rounds = take(in) % 8 + 1; rounds > 0; rounds--) {
      flood_nudges(&h->p);
      send_waiting(h, 1);
    }
    break;
  case OP_PEER_READS:
    peer_drain_ring(&h->p);
    break;
  }
}

/* ---- setup and teardown --------------------------------------------------- */

/* The peer's hello and ring, written before the channel opens: the channel's
 * hello finds them waiting. */
static void peer_start(peer *p, int sock) {
  memset(p, 0, sizeof *p);
  p->sock = sock;
  p->mem = memfd_create(PEER_MEMFD_NAME, MFD_CLOEXEC);
  if (p->mem < 0 || ftruncate(p->mem, 4 * PEER_BUFFER) != 0) abort();
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_HELLO;
  f.u.hello.major = TSHARE_WIRE_MAJOR;
  f.u.hello.minor = TSHARE_WIRE_MINOR;
  f.u.hello.pid = (uint32_t)getpid();
  f.u.hello.uid = (uint32_t)getuid();
  f.u.hello.capabilities = TSHARE_CAP_RING | TSHARE_CAP_CUDA_FD;
  snprintf(f.u.hello.name, sizeof f.u.hello.name, "fuzz peer");
  peer_send_frame(p, &f, -1);
  int ring_fd;
  char err[256];
  if (ts_ring_create(&p->out, PEER_RING_CAP, &ring_fd, err, sizeof err) != 0) abort();
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RING;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  f.u.ring.op = TSHARE_RING_SETUP;
  f.u.ring.capacity = PEER_RING_CAP;
  peer_send_frame(p, &f, ring_fd);
  close(ring_fd);
}

static void peer_stop(peer *p) {
  close(p->sock);
  ts_ring_unmap(&p->out);
  ts_ring_unmap(&p->in);
  close(p->mem);
}

static tshare_channel *channel_open(int sock) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "fuzzed channel";
  o.transport = TSHARE_TRANSPORT_RING;
  o.max_unclaimed_fds = FD_BUDGET;
  o.handshake_timeout_ms = 5000;
  o.spin_us = 0; /* nothing runs beside it: spinning would only wait */
  tshare_channel *ch = NULL;
  tshare_error err;
  if (tshare_channel_open_socket(sock, &o, &ch, &err) != TSHARE_OK) abort(); /* the peer's hello and ring are valid */
  return ch;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  atomic_store(&ts_log_level, -1); /* below warn: refusals would be logged thousands of times a second */
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) abort();
  if (fcntl(sv[1], F_SETFL, O_NONBLOCK) != 0) abort();
  harness h;
  memset(&h, 0, sizeof h);
  peer_start(&h.p, sv[1]);
  h.ch = channel_open(sv[0]);
  input in = {data, size};
  while (in.n) run_op(&h, &in);
  tshare_channel_close(h.ch);
  peer_stop(&h.p);
  if (count_memfds_named(PEER_MEMFD_NAME) != 0) abort(); /* the channel kept an fd the peer sent */
  return 0;
}
