/* tshare/share.h - the lifetime protocol: sharing tensors and releasing them.
 *
 * Producer: tshare_share_host() sends a share frame describing a tensor inside
 * a host buffer and keeps a reference on the buffer until the peer releases
 * that share or the channel ends. Incoming releases are applied whenever the
 * channel is driven: tshare_channel_poll(), tshare_channel_wait_released(),
 * tshare_view_recv() or any low-level receive.
 *
 * Consumer: tshare_view_recv() takes the next share and maps its memory. Each
 * allocation is mapped once per channel however many shares point into it
 * (keyed by the producer's allocation id and checked against the fd's inode);
 * it is unmapped when its last view is released. tshare_view_release() is
 * safe from any thread and never blocks (in a forked child, on a view its
 * parent received, it only drops the child's copy). From a thread other than the one
 * driving the channel, the release goes out at once whenever the socket has
 * room: the driving thread may be busy elsewhere. The driving thread's own
 * releases, and those whose GPU work is still queued, go out when the channel
 * is next driven (tshare_view_recv(), poll, wait, bye or close; at once if a
 * thread is blocked in one of them); queued while further shares are already
 * buffered, they go out together, one frame per batch. A driving thread that
 * stops receiving should call tshare_channel_poll() (timeout 0) after its
 * last release. A view's memory is the producer's: writes through a view are
 * visible to the producer (except over a ucx:// channel, where a view is
 * this process's copy: tshare_view_is_copy).
 *
 * Either end of a channel may share and receive.
 */
#ifndef TSHARE_SHARE_H
#define TSHARE_SHARE_H

#include "tshare/channel.h"
#include "tshare/hostmem.h"
#include "tshare/tensor.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Share a tensor that lives in buf (desc->byte_offset is relative to the start
 * of buf). tag is optional (at most TSHARE_TAG_MAX bytes) and arrives with the
 * view; user_data comes back in the channel's on_release callback. Needs a
 * socket channel (TSHARE_E_UNSUPPORTED on pipes). *share_id (optional) gets
 * the id of the share. */
TSHARE_API int tshare_share_host(tshare_channel *ch, tshare_host_buffer *buf, const tshare_tensor_desc *desc,
                                 const char *tag, void *user_data, int timeout_ms, uint64_t *share_id);

/* Runs once when a share is released or dropped with its channel, or at once
 * when the share fails: what the sharer kept alive for it may go then. */
typedef void (*tshare_drop_fn)(void *keep);

/* Shares sent on this channel that the peer has not yet released. */
TSHARE_API size_t tshare_channel_outstanding(const tshare_channel *ch);

/* 1 if share_id was sent on ch and has been released (or dropped), 0 if it is
 * still held, -1 if ch never sent it. */
TSHARE_API int tshare_share_is_released(const tshare_channel *ch, uint64_t share_id);

/* Process incoming frames, waiting up to timeout_ms for the first. TSHARE_OK
 * if something was processed, TSHARE_E_TIMEOUT if nothing came in time (as
 * every call that waits says it), TSHARE_END once the peer said bye, other
 * negative values on errors. Incoming shares are queued for
 * tshare_view_recv(). */
TSHARE_API int tshare_channel_poll(tshare_channel *ch, int timeout_ms);

/* Drive the channel until share_id (or, with 0, every share sent on it) has
 * been released. TSHARE_E_TIMEOUT if that takes longer than timeout_ms;
 * TSHARE_OK also when the peer closed, since its shares are then dropped. */
TSHARE_API int tshare_channel_wait_released(tshare_channel *ch, uint64_t share_id, int timeout_ms);

typedef struct tshare_view tshare_view;

/* Receive the next share as a view. TSHARE_END when the peer said bye,
 * TSHARE_E_TIMEOUT when nothing came in time. On any non-OK return *out is NULL. */
TSHARE_API int tshare_view_recv(tshare_channel *ch, int timeout_ms, tshare_view **out);

/* Channels across hosts (ucx://): receive the next share without reading
 * its bytes, for a consumer that needs only part of it (a shard of a large
 * tensor). tshare_view_data() is NULL; tshare_view_read() reads slices on
 * demand. The producer holds its memory until the view is released (a view
 * from tshare_view_recv() releases it as soon as it was read). On a
 * same-host channel, and for GPU memory the peer staged, TSHARE_E_UNSUPPORTED
 * and the share is released back (it cannot be received again): same-host
 * views map the producer's memory and staged GPU memory lands on a GPU, so
 * take those with tshare_view_recv(). */
TSHARE_API int tshare_view_recv_remote(tshare_channel *ch, int timeout_ms, tshare_view **out);
/* Copy len bytes of a remote view into dst, starting offset bytes from its
 * element [0,...,0] (negative with negative strides); the bytes must lie in
 * the span the view's layout touches (TSHARE_E_OUT_OF_BOUNDS otherwise).
 * Drives the view's channel like a receive (one thread at a time, the
 * channel's rule); a producer that died gives TSHARE_E_PEER_CLOSED, a read
 * not served in 30 s too. The detail: tshare_channel_last_error(). */
TSHARE_API int tshare_view_read(tshare_view *view, int64_t offset, void *dst, size_t len);

TSHARE_API void *tshare_view_data(const tshare_view *view); /* address of element [0,...,0] */
TSHARE_API const tshare_tensor_desc *tshare_view_desc(const tshare_view *view);
TSHARE_API const char *tshare_view_tag(const tshare_view *view); /* "" when none */
TSHARE_API uint64_t tshare_view_share_id(const tshare_view *view);
TSHARE_API int tshare_view_device_type(const tshare_view *view); /* TSHARE_DEVICE_* */
/* 1 when the view holds a copy of the producer's memory, not the memory
 * itself: a share that came over UCX from another host (its bytes were read
 * into this process and the share released at once), 0 otherwise. Writes to
 * a copy stay in this process. */
TSHARE_API int tshare_view_is_copy(const tshare_view *view);

/* Share a received view on to another channel: the producer's memory
 * travels, not a copy (host views need a socket channel, and a channel that
 * received them with keep_host_fds 1, the default; a CUDA view passed on
 * keeps its owner's identity, so a process that gets it from both maps it
 * only once). A view read over a ucx:// channel (a copy) goes as this
 * process's own memory, host or GPU: the one network copy a node's
 * processes then map (docs/ucx.md); a remote view is refused. stream: CUDA only, the stream whose work the third
 * process must wait for (NULL: the view's). tag NULL: the view's tag.
 * The view is consumed: it stays held until the new share is released, and
 * the caller must not release it itself, also when this fails. */
TSHARE_API int tshare_share_view(tshare_channel *ch, tshare_view *view, void *stream, const char *tag, void *user_data,
                                 int timeout_ms, uint64_t *share_id);
/* Share a part of a received view on: desc->byte_offset is relative to
 * tshare_view_data(view), and the layout must lie inside the memory the view's
 * producer shared. The view is not consumed: the caller keeps it alive until
 * drop(keep) runs, which happens exactly once (at once on failure). */
TSHARE_API int tshare_share_view_part(tshare_channel *ch, tshare_view *view, const tshare_tensor_desc *desc,
                                      void *stream, const char *tag, tshare_drop_fn drop, void *keep, void *user_data,
                                      int timeout_ms, uint64_t *share_id);
/* Where the next share lives, without taking it: waits up to timeout_ms like
 * tshare_view_recv() and returns the same codes. A receiver picks its stream
 * with this (a LibTorch consumer: the current stream of that device). */
typedef struct tshare_share_info {
  uint64_t share_id;
  int device_type; /* TSHARE_DEVICE_* */
  int cuda_device; /* CUDA: the ordinal this process sees it as, -1 if none (or host) */
} tshare_share_info;
TSHARE_API int tshare_channel_peek_share(tshare_channel *ch, int timeout_ms, tshare_share_info *info);
/* Release the view: exactly once per view, from any thread, never blocking. */
TSHARE_API void tshare_view_release(tshare_view *view);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_SHARE_H */
