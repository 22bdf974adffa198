/* tshare/hostmem.h - host memory that can be shared: sealed memfd buffers.
 *
 * A host buffer is a memfd mapped read-write in the creating process. It is
 * sealed against shrinking, growing and further sealing once sized, so a
 * consumer that maps it can never be made to fault by a truncation. Tensors
 * are shared out of it with tshare_share_host() (share.h); the fd travels
 * beside each share frame.
 *
 * Lifetime: the creator holds one reference, every share not yet released
 * holds one. tshare_host_buffer_destroy() drops the creator's; the memory is
 * unmapped and the fd closed when the last share is released (or its channel
 * closed). After destroy the creator must not touch the buffer again.
 *
 * A consumer may keep a buffer mapped after its shares were released, so the
 * buffer's next shares travel without the fd (wire.md: kept host mappings).
 * The channel then also holds the buffer, and lets go of it (and tells the
 * consumer to unmap it) once nothing else does: at the release that leaves it
 * unused, or, for a buffer destroyed after its last release, the next time
 * the channel receives or waits for releases, or when it closes.
 */
#ifndef TSHARE_HOSTMEM_H
#define TSHARE_HOSTMEM_H

#include "tshare/errors.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tshare_host_buffer tshare_host_buffer;

/* Create a buffer of size bytes (rounded up to the page size), zero-filled.
 * name shows in /proc/PID/fd and may be NULL. On failure *out is NULL. */
TSHARE_API int tshare_host_buffer_create(size_t size, const char *name, tshare_host_buffer **out, tshare_error *err);

TSHARE_API void *tshare_host_buffer_data(const tshare_host_buffer *buf);
TSHARE_API size_t tshare_host_buffer_size(const tshare_host_buffer *buf); /* after rounding */
/* The allocation's identity, unique in the process. */
TSHARE_API uint64_t tshare_host_buffer_id(const tshare_host_buffer *buf);
TSHARE_API int tshare_host_buffer_fd(const tshare_host_buffer *buf); /* the memfd; still owned by the buffer */

/* Shares of this buffer, on all channels, that are not yet released. */
TSHARE_API size_t tshare_host_buffer_outstanding(const tshare_host_buffer *buf);

/* A buffer over an existing fd's file instead of a new memfd: size bytes
 * from offset 0 of fd, a regular file (a memfd, or a tmpfs or /dev/shm file
 * such as torch's shared CPU memory) of at least size bytes; anything else
 * is refused with TSHARE_E_INVALID_ARG or TSHARE_E_OUT_OF_BOUNDS. fd is
 * duplicated (the caller keeps its own). data is the caller's mapping of the
 * file, used as the buffer's data and never unmapped by tshare; NULL maps it
 * here. on_last(ctx), when not NULL, runs once the last reference went (the
 * creator's and every share's), on whatever thread released it: the caller's
 * mapping must stay valid until then.
 *
 * A file not sealed against shrinking (anything but a sealed memfd) travels
 * as TSHARE_MEM_HOST_FD, only to a peer that takes it (TSHARE_CAP_HOST_FD)
 * and is never kept mapped past its shares. Its owner can still truncate it,
 * and a consumer touching the lost pages gets SIGBUS: consumers accept such
 * files only from a peer of their own uid (docs/security.md). */
TSHARE_API int tshare_host_buffer_wrap_fd(int fd, size_t size, void *data, void (*on_last)(void *ctx), void *ctx,
                                          tshare_host_buffer **out, tshare_error *err);

/* 1 for a sealed memfd (tshare_host_buffer_create), 0 for a wrapped file
 * not sealed against shrinking (it travels as TSHARE_MEM_HOST_FD). */
TSHARE_API int tshare_host_buffer_is_sealed(const tshare_host_buffer *buf);

/* Drop the creator's reference. NULL is a no-op. */
TSHARE_API void tshare_host_buffer_destroy(tshare_host_buffer *buf);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_HOSTMEM_H */
