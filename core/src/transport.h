/* The transport table: what the connection (conn.c) asks of the thing that
 * carries its frames, and what a transport may call back in the connection.
 *
 * A transport is one file holding one `ts_transport` table, plus its entry
 * here (a ts_conn_kind and a case of ts_transport_of). Two kinds of table:
 *  - byte streams (socket, pipes, loopback) fill in read/write, the bytes
 *    and fds moved without waiting, and take the connection's stream
 *    functions (ts_stream_*) for the rest: the framing, the tail of a frame
 *    cut short, the read-ahead while a send waits, the fd queue and the
 *    wait in poll() are written once, in conn.c;
 *  - the ring (transport_ring.c) rides on a stream: it is chosen by the
 *    hello, not by the kind, takes over the frame operations and sends its
 *    fd frames and nudges through the stream's read/write.
 *
 * Threads: send, send_now and flush_owed run with the connection's send_lock
 * held; look_begins, fill, recv, wait, buffered and poll_fd on the driving thread; wake
 * from any thread, with wake_lock held; close with both locks held (or, for
 * a forked child's copy, with neither). */
#ifndef TSHARE_TRANSPORT_H
#define TSHARE_TRANSPORT_H

#include "conn_status.h"
#include "fd_queue.h"
#include "tshare/wire.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

/* What a transport can do. The session and the backends ask these (through
 * ts_conn_caps) instead of reading which transport it is. */
#define TS_TRANSPORT_PASSES_FDS (1u << 0)       /* a frame can carry an fd (SCM_RIGHTS or a dup) */
#define TS_TRANSPORT_PEER_CREDENTIALS (1u << 1) /* the kernel names the peer's uid and pid */
#define TS_TRANSPORT_SAME_HOST (1u << 2)        /* the peer runs on this machine, in this boot */
#define TS_TRANSPORT_SHARED_MEMORY (1u << 3)    /* frames travel through memory both ends map */

struct ts_conn;

typedef struct ts_transport {
  const char *name; /* for messages: "socket", "pipes", "ring", "loopback", "ucx" */
  uint32_t caps;    /* TS_TRANSPORT_* */

  /* Byte streams only (NULL in a transport riding on one). */
  int (*check)(struct ts_conn *c); /* at init: whether the fds are what it needs (TSHARE_OK or a status) */
  /* Like recvmsg without waiting: bytes read, 0 at the peer's end, -1 with
   * errno (EAGAIN: nothing yet). fds that come along go to
   * ts_conn_take_fds(); rx_bytes counts the bytes. */
  ssize_t (*read)(struct ts_conn *c, uint8_t *buf, size_t cap);
  /* Like sendmsg without waiting, fd (or -1) riding on the first byte:
   * bytes written, or -1 with errno (EAGAIN: no room; EPIPE: peer gone). */
  ssize_t (*write)(struct ts_conn *c, const uint8_t *buf, size_t len, int fd);

  /* Frames. send: one encoded frame with fd (or -1) beside it, waiting for
   * room until deadline. send_now: the same without waiting; false when
   * nothing went. flush_owed (may be NULL): what the transport still owes
   * before any new frame (owed_pending set), TSHARE_E_TIMEOUT leaving it
   * owed. */
  int (*send)(struct ts_conn *c, const uint8_t *buf, size_t len, int fd, int64_t deadline);
  bool (*send_now)(struct ts_conn *c, const uint8_t *buf, size_t len);
  /* send_frame_now (may be NULL): a frame without an fd encoded straight
   * into where it travels (shared memory) and sent, without waiting and
   * with nothing owed; false when it did not (no room, an encoding error,
   * a check due): the caller encodes and sends as usual. */
  bool (*send_frame_now)(struct ts_conn *c, const tshare_frame *f);
  int (*flush_owed)(struct ts_conn *c, int64_t deadline);
  /* send_wait (may be NULL): a stream send begins (true) or ends (false) a
   * wait for room: a transport whose peer may itself wait on it (a full
   * ring) takes what it can meanwhile. */
  void (*send_wait)(struct ts_conn *c, bool begins);
  /* fill: bytes into the decoder, waiting for them (TSHARE_OK once some
   * came, TS_CONN_WOKEN, or the error). recv: the next frame and the fd that
   * came with it (*found: whether one did). wait: until bytes can be read
   * or ts_conn_wake() was called (TS_CONN_WOKEN). */
  /* look_begins (may be NULL): a receive is about to send what this end
   * owes (releases: they may make the peer send its next frame at once)
   * and then look for frames. A transport whose peer announces new frames
   * on the socket when asked (the ring's nudges) withdraws the ask here:
   * the look sees what comes meanwhile, and a look that finds nothing asks
   * again before it returns. Driving thread. */
  void (*look_begins)(struct ts_conn *c);
  int (*fill)(struct ts_conn *c, int64_t deadline);
  int (*recv)(struct ts_conn *c, tshare_frame *f, ts_fd_entry *e, bool *found, int64_t deadline);
  int (*wait)(struct ts_conn *c, int64_t deadline);
  /* wake (may be NULL): what besides the connection's eventfd wakes a
   * driver blocked in this transport's wait. */
  void (*wake)(struct ts_conn *c);
  int (*poll_fd)(struct ts_conn *c);     /* the fd a poll loop watches */
  size_t (*buffered)(struct ts_conn *c); /* bytes received not yet delivered */
  /* Let go of the transport's fds and state. fork_copy: a forked child's
   * copy, whose locks may be held by a thread that does not exist here:
   * close fds and unmap, free nothing shared. */
  void (*close)(struct ts_conn *c, bool fork_copy);
} ts_transport;

/* The byte streams a connection is opened on. The first two have the
 * values of the public tshare_channel_kind's SOCKET and PIPES. */
typedef enum ts_conn_kind {
  TS_CONN_SOCKET = 1,   /* a Unix stream socket (transport_socket.c) */
  TS_CONN_PIPES = 2,    /* a read pipe and a write pipe (transport_pipe.c) */
  TS_CONN_LOOPBACK = 3, /* two ends in one process (transport_loopback.c) */
  TS_CONN_UCX = 4,      /* UCP active messages to a peer that may be on another host (transport_ucx.c) */
} ts_conn_kind;

extern const ts_transport ts_transport_socket, ts_transport_pipes, ts_transport_loopback, ts_transport_ucx;
extern const ts_transport ts_transport_ring; /* chosen by the hello, riding on the socket */

/* A loopback pair: each end's read and write fd (rfd, wfd) for
 * ts_conn_init(TS_CONN_LOOPBACK, ...). TSHARE_OK or a status. */
int ts_loopback_pair(int a[2], int b[2]);

static inline const ts_transport *ts_transport_of(ts_conn_kind kind) {
  switch (kind) {
  case TS_CONN_SOCKET:
    return &ts_transport_socket;
  case TS_CONN_PIPES:
    return &ts_transport_pipes;
  case TS_CONN_LOOPBACK:
    return &ts_transport_loopback;
  case TS_CONN_UCX:
    return &ts_transport_ucx;
  }
  return NULL;
}

/* ---- what a transport may call in the connection (conn.c) ------------- */

/* The stream functions byte-stream tables take for their frame operations. */
int ts_stream_send(struct ts_conn *c, const uint8_t *buf, size_t len, int fd, int64_t deadline);
bool ts_stream_send_now(struct ts_conn *c, const uint8_t *buf, size_t len);
int ts_stream_fill(struct ts_conn *c, int64_t deadline);
int ts_stream_recv(struct ts_conn *c, tshare_frame *f, ts_fd_entry *e, bool *found, int64_t deadline);
/* ts_stream_recv, or with may_read false only what is buffered (TSHARE_AGAIN
 * when no frame is). Ring frames are the ring's: nudges are skipped, its
 * setup frame taken only while in_setup, any other refused. */
int ts_stream_frame(struct ts_conn *c, tshare_frame *f, ts_fd_entry *e, bool *found, int64_t deadline, bool may_read);
int ts_stream_wait(struct ts_conn *c, int64_t deadline);
int ts_stream_poll_fd(struct ts_conn *c);
size_t ts_stream_buffered(struct ts_conn *c);
void ts_stream_close(struct ts_conn *c, bool fork_copy);

/* The frame members of a byte stream's table: the stream functions. */
#define TS_STREAM_FRAME_OPS                                                                                            \
  .send = ts_stream_send, .send_now = ts_stream_send_now, .fill = ts_stream_fill, .recv = ts_stream_recv,              \
  .wait = ts_stream_wait, .poll_fd = ts_stream_poll_fd, .buffered = ts_stream_buffered

/* The next frame of a decoder, calling fill while it has none (the loop
 * every transport's receive shares). may_read false: only what is buffered
 * (TSHARE_AGAIN when no frame is). where: how messages name the source
 * ("" or " (ring)"). */
int ts_conn_decode(struct ts_conn *c, tshare_decoder *dec, int (*fill)(struct ts_conn *, int64_t), const char *where,
                   tshare_frame *f, int64_t deadline, bool may_read);
/* fds a read brought (see ts_fd_queue_take), at the read's last byte. */
void ts_conn_take_fds(struct ts_conn *c, const int *fds, size_t n, bool cut);
/* A begun frame's end kept for later (send_lock held). */
void ts_conn_keep_tail(struct ts_conn *c, const uint8_t *rest, size_t n);
/* Move up to cap bytes read ahead (a spill buffer) to dst; the count. */
static inline size_t ts_take_spilled(const uint8_t *spill, size_t *off, size_t len, uint8_t *dst, size_t cap) {
  size_t n = len - *off < cap ? len - *off : cap;
  memcpy(dst, spill + *off, n);
  *off += n;
  return n;
}
#define TS_SPILL_MAX (16u << 20) /* bytes read ahead while sending; beyond this a send just waits */

/* The driving thread finishes a cut frame or what the transport owes, if
 * the peer takes it now. */
void ts_conn_try_flush(struct ts_conn *c);
/* Stream bytes into the read-ahead buffer (a send waits for room); room
 * left there. */
void ts_conn_spill_read(struct ts_conn *c);
size_t ts_conn_spill_room(const struct ts_conn *c);
/* The receive side's check of a wake-up (true once per ts_conn_wake). */
bool ts_conn_take_woken(struct ts_conn *c);
/* Mark the driver as blocked (true) or not; false when a wake-up came first
 * (then it must not block). */
bool ts_conn_set_waiting(struct ts_conn *c, bool waiting);
/* The peer went away: the detail, TSHARE_E_PEER_CLOSED. */
int ts_conn_peer_closed(struct ts_conn *c, const char *what);
/* Hand a frame and its fd to the caller, checking that they agree. */
int ts_conn_deliver(struct ts_conn *c, const tshare_frame *f, ts_fd_entry e, bool found, int *fd_out, int *fd_lost);

#endif
