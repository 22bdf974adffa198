/* tshare/channel.h - a connected, framed endpoint between two processes.
 *
 * A channel is one end of a Unix stream socketpair (frames can carry fds
 * with SCM_RIGHTS), a pair of pipes (no fds), or, across hosts, a ucx://
 * connection (tshare_connect, docs/ucx.md: no fds, memory read remotely). Opening a channel runs the
 * hello exchange: both ends send versions, pid, uid, boot id, capabilities and
 * a name, and a peer on another major version or another boot is refused with
 * TSHARE_E_VERSION or TSHARE_E_PEER_MISMATCH. On a socket, the kernel's word
 * on who the peer is (SO_PEERCRED) is checked before anything is sent: a
 * peer running as another user is refused with TSHARE_E_PERMISSION unless
 * allowed, and one whose hello claims another uid than the kernel's is a
 * TSHARE_E_PROTOCOL error.
 *
 * Sends and receives are blocking with a timeout in milliseconds (< 0 waits
 * forever, 0 never waits), retry on EINTR, and never raise SIGPIPE: a dead
 * peer is TSHARE_E_PEER_CLOSED. The lifetime protocol (share.h) runs on top.
 *
 * Threads: one thread at a time calls a channel (send, receive, poll, share,
 * bye); which thread may change from call to call. A call made while another
 * thread is inside one on the same channel does nothing and returns
 * TSHARE_E_BUSY (its detail: tshare_channel_last_error() on the refused
 * thread). A callback run inside a call (on_release, a drop function) may
 * call the channel again. Releasing a view (share.h) is the exception: it is
 * safe from any thread at any time and never blocks, and so are
 * tshare_channel_outstanding and tshare_share_is_released (share.h), which
 * read under the channel's lock: a thread may poll for a release while
 * another is inside a call. The other accessors (kind_of, peer, transport,
 * last_error) are never refused; they read what a call changes, so they
 * belong to the calling thread too.
 *
 * fork(): a channel and its views belong to the process that opened it. In a
 * child forked while it was open, tshare_view_release() and
 * tshare_channel_close() send nothing and change nothing the parent uses
 * (they drop the child's own copies of mappings and fds); every other call
 * returns TSHARE_E_STATE naming the owning process. A child opens its own
 * channels.
 */
#ifndef TSHARE_CHANNEL_H
#define TSHARE_CHANNEL_H

#include "tshare/errors.h"
#include "tshare/wire.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tshare_channel tshare_channel;

typedef enum tshare_channel_kind {
  TSHARE_CHANNEL_SOCKET = 1, /* Unix stream socket: frames may carry fds */
  TSHARE_CHANNEL_PIPES = 2,  /* a read pipe and a write pipe: no fds */
  TSHARE_CHANNEL_UCX = 4     /* UCX active messages, to a peer that may be on another host (docs/transport.md) */
} tshare_channel_kind;

/* How a socket channel's frames travel (tshare_channel_options.transport). */
typedef enum tshare_transport {
  TSHARE_TRANSPORT_DEFAULT = 0, /* TSHARE_TRANSPORT from the environment ("ring" or "socket"), else ring */
  TSHARE_TRANSPORT_SOCKET = 1,  /* every frame through the socket */
  /* Frames without fds through a shared-memory ring per direction (set up in
   * the hello when both ends ask for it, else the socket carries all);
   * frames with fds on the socket, in order. Pipe channels never use it. */
  TSHARE_TRANSPORT_RING = 2,
  /* UCX active messages (a channel of a ucx:// address; only reported by
   * tshare_channel_transport(), never asked for in the options). */
  TSHARE_TRANSPORT_UCX = 3
} tshare_transport;

/* Called on the driving thread when a share this end sent is released by the
 * peer (status TSHARE_OK) or dropped because the peer went away
 * (TSHARE_E_PEER_CLOSED). user_data is what the share call was given. */
typedef void (*tshare_release_cb)(void *cb_user, uint64_t share_id, void *user_data, int status);

typedef struct tshare_channel_options {
  const char *name;                 /* sent in the hello and used in messages; default "tshare" */
  int handshake_timeout_ms;         /* default 10000 */
  const tshare_wire_limits *limits; /* NULL: tshare_wire_limits_default() */
  tshare_release_cb on_release;     /* optional */
  void *cb_user;
  /* Socket channels: the peer's uid as the kernel reports it (SO_PEERCRED)
   * must be this process's uid, or allow_uid when that is >= 0 (default -1).
   * TSHARE_ANY_UID accepts every user: anyone who can reach the socket. */
  long allow_uid;
  /* Socket channels: how many fds of the peer's shares this end holds while
   * they wait for tshare_view_recv() (0: a quarter of the soft RLIMIT_NOFILE,
   * at most 4096). Past it a share is refused on arrival: its fd is closed, it
   * is released back, and the peer gets an error frame naming the limit. */
  unsigned max_unclaimed_fds;
  /* Socket channels: 1 (default) keeps each mapped host allocation's memfd
   * open so its views can be shared on (tshare_share_view): one fd per
   * allocation a view is held into. 0 closes it once mapped, for consumers
   * that hold views into thousands of allocations and never share them on;
   * sharing such a view on is then TSHARE_E_STATE. */
  int keep_host_fds;
  /* Socket channels: tshare_transport (default TSHARE_TRANSPORT_DEFAULT). */
  int transport;
  /* Ring transport: microseconds a receive spins on the ring before it
   * sleeps (a spinning receive burns its core; a sleeping one costs the
   * sender a wake-up, ~10 us); 0 never spins. -1 (default): TSHARE_SPIN_US
   * from the environment, else adaptive: up to 50 us, only while this
   * process may use two CPUs or more, the peer is awake and recent spins
   * caught frames (docs/transport.md). */
  int spin_us;
  /* Channels across hosts (ucx:// addresses of tshare_listen and
   * tshare_connect): the secret both ends must hold, 1-255 bytes. NULL: the
   * environment's TSHARE_TOKEN. It is sent in the clear over TCP
   * (docs/security.md says what it does and does not protect). */
  const char *token;
} tshare_channel_options;

#define TSHARE_ANY_UID (-2L)

TSHARE_API void tshare_channel_options_init(tshare_channel_options *opts);

/* Open a channel on one end of a connected Unix stream socket. The channel
 * owns fd from this call on, also when it fails (fd is closed). opts may be
 * NULL. On failure *out is NULL and err (optional) says why. */
TSHARE_API int tshare_channel_open_socket(int fd, const tshare_channel_options *opts, tshare_channel **out,
                                          tshare_error *err);

/* Same over two pipes: read_fd carries frames from the peer, write_fd to it. */
TSHARE_API int tshare_channel_open_pipes(int read_fd, int write_fd, const tshare_channel_options *opts,
                                         tshare_channel **out, tshare_error *err);

/* A connected socketpair for two channel ends, both close-on-exec. */
TSHARE_API int tshare_socketpair(int fds[2], tshare_error *err);

/* Close the channel: pending releases are flushed and, unless this end sent
 * one, a bye (briefly, best effort: the peer sees a clean end, TSHARE_END,
 * where a process that dies without closing is TSHARE_E_PEER_CLOSED); every
 * share the peer still holds is dropped as if released, and the fds are
 * closed. Views received on it stay valid until released. NULL is a no-op.
 * From any thread: while another thread is inside a call, close returns at
 * once, a receive that call waits in returns TSHARE_E_STATE, and the close
 * happens as that call returns (a send waiting for room waits out its own
 * timeout first). From then on the handle is gone for every thread, the
 * one whose call was cut short included. */
TSHARE_API void tshare_channel_close(tshare_channel *ch);

TSHARE_API tshare_channel_kind tshare_channel_kind_of(const tshare_channel *ch);
TSHARE_API const tshare_hello *tshare_channel_peer(const tshare_channel *ch); /* the peer's hello */
TSHARE_API const char *tshare_channel_last_error(const tshare_channel *ch);   /* never NULL */

/* Low-level frame I/O. fd is -1 or an fd to pass beside the frame (sockets
 * only; the frame must carry TSHARE_FRAME_FLAG_FD_ATTACHED). The caller keeps
 * its fd. On receive *fd_out gets the attached fd (the caller owns it) or -1.
 * Received release frames are applied to the lifetime tables before they are
 * returned, so low-level readers do not break the accounting; ids of shares
 * the caller sent itself with send_frame are left to the caller. A frame
 * whose fd could not be kept (this process is out of fds, or the channel
 * holds max_unclaimed_fds) comes back filled with *fd_out -1 and
 * TSHARE_E_LIMIT; a share is released back to the peer. fds riding on frames
 * that announce none are closed. */
TSHARE_API int tshare_channel_send_frame(tshare_channel *ch, const tshare_frame *frame, int fd, int timeout_ms);
/* A received frame's header and its type's union member are written (as
 * tshare_decoder_next does), not the rest of *frame: a release's ids past
 * its count, and the other members, keep what they held. */
TSHARE_API int tshare_channel_recv_frame(tshare_channel *ch, tshare_frame *frame, int *fd_out, int timeout_ms);

/* Tell the peer the stream is over (reason 0: done). What a turn of the
 * channel would send goes first: releases, and retires of memory this end
 * dropped since its last turn (so the peer unmaps it at the bye, not when it
 * closes). */
TSHARE_API int tshare_channel_send_bye(tshare_channel *ch, uint32_t reason, int timeout_ms);

/* Tell the peer about an error (best effort, never waits long). */
TSHARE_API int tshare_channel_send_error(tshare_channel *ch, int code, const char *message);

/* The fd a poll loop should watch for readability, e.g. to drive several
 * channels from one thread (tshare_channel_poll then does the work). Treat it
 * as edge-triggered: it becomes readable when something new arrives, not
 * while something waits. After first asking for it, and after every wake-up,
 * drive the channel with calls that do not wait (timeout 0) until one reports
 * TSHARE_E_TIMEOUT, and only then wait on the fd again: frames the channel
 * already holds never make it readable (on a channel that was received on
 * before its fd was first asked for, frames may already wait). On a ring
 * channel it becomes readable when frames arrive while no receive runs (the
 * peer nudges the socket), once a call that did not wait asked for it: a
 * receive that waits, or a send that waited for room, watches the ring
 * itself and withdraws that. So the call that reports TSHARE_E_TIMEOUT is
 * the last one before waiting on the fd, also where other threads receive
 * on the channel with a timeout. */
TSHARE_API int tshare_channel_fd(const tshare_channel *ch);

/* The transport in use: TSHARE_TRANSPORT_RING or TSHARE_TRANSPORT_SOCKET
 * (pipe channels say socket: one stream each way), TSHARE_TRANSPORT_UCX for
 * a channel of a ucx:// address. */
TSHARE_API tshare_transport tshare_channel_transport(const tshare_channel *ch);

/* How GPU memory shared on this channel reaches the peer, from the two
 * hellos: mapped in place (CUDA IPC handles or VMM fds, same host), staged
 * through host memory on both ends (a ucx:// channel to a peer that places
 * staged bytes on its GPU: docs/ucx.md), or not at all (a peer without
 * CUDA, or without a usable GPU across hosts: a CUDA share is refused). */
typedef enum tshare_gpu_path {
  TSHARE_GPU_PATH_NONE = 0,
  TSHARE_GPU_PATH_IPC = 1,
  TSHARE_GPU_PATH_STAGED = 2
} tshare_gpu_path;
TSHARE_API tshare_gpu_path tshare_channel_gpu_path(const tshare_channel *ch);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_CHANNEL_H */
