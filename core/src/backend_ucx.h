/* Remote host memory over UCX (TSHARE_MEM_UCX_REMOTE), the backend's own
 * declarations, shared by its files:
 *   backend_ucx.c        the table, the channel's state, the producer: host
 *                        buffers registered (ucp_mem_map) once per channel,
 *                        their rkeys sent once, held until retired
 *   backend_ucx_fetch.c  the consumer's "fetch" mode: rkeys unpacked once
 *                        per allocation, each share read (ucp_get_nbx) into a
 *                        pooled registered buffer and released at once
 *
 * Lifetime: a share holds its host buffer until the peer's release, and the
 * channel holds every buffer it registered (lent, as kept host mappings
 * are) until nothing else holds it, or until the channel is freed, after
 * its worker is gone: over TCP the peer's reads are served by this
 * process's worker, so memory is never let go while a read could come. */
#ifndef TSHARE_BACKEND_UCX_H
#define TSHARE_BACKEND_UCX_H

#include "session.h"
#include "transport_ucx.h"
#include "u64map.h"
#include "ucx_api.h"
#include "vec.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tshare_host_buffer;

/* Producer: a host buffer registered for this channel's peer. */
typedef struct ucx_region {
  struct tshare_host_buffer *buf; /* lent to the channel until retired */
  ts_ucp_mem_h memh;
  void *packed; /* ucp_rkey_pack's key */
  size_t packed_len;
  bool key_sent; /* the peer has its rkey frame */
} ucx_region;

/* Consumer: a remote region whose rkey came (an rkey frame). */
typedef struct ucx_remote {
  ts_ucp_rkey_h rkey;
  uint64_t address, length;
} ucx_remote;

/* Consumer: a registered local buffer fetches land in, a view's `memory`:
 * a tshare host buffer, so that what landed can be shared on to this
 * node's processes without another copy (tshare_set_host_buffer). */
typedef struct ucx_landing {
  struct tshare_host_buffer *buf; /* one reference, this landing's (NULL on a GPU) */
  void *base;                     /* buf's data */
  size_t size;
  ts_ucp_mem_h memh;
  size_t refs; /* the view or set that holds it, and a set's views (ch->lock) */
  /* remote mode (tshare_view_recv_remote): no bytes here, only where they are */
  bool remote;
  uint64_t alloc_id, address; /* the peer's allocation and its region's address */
  uint64_t begin, end;        /* the span the share's layout touches, in the allocation */
  uint64_t origin;            /* where its element [0,...,0] is, in the allocation */
  /* GPU bytes the peer staged, placed on a GPU here (backend_ucx_device.c) */
  bool on_device;
  struct tshare_cuda_buffer *cuda_buf; /* the GPU memory: a tshare CUDA buffer, one reference */
  uint64_t device_ptr;                 /* its device address */
  void *ctx;                           /* that device's primary context */
  int device;
  void *event; /* released: recorded on the view's stream; the buffer goes once it completed */
} ucx_landing;

TS_VEC_DEFINE(ucx_landing_vec, ucx_landing *)

typedef struct ucx_chan {
  const ts_ucx_api *ucx;
  /* producer */
  ts_u64map regions;  /* buffer id -> ucx_region */
  ts_id_vec retired;  /* buffer ids whose region went: the peer hears so (retire, FREED) */
  uint64_t unused_seen; /* ts_host_buffers_unused_generation() when regions were last looked at */
  /* consumer */
  ts_u64map remotes;      /* alloc_id -> ucx_remote, until retired or the peer is gone */
  ucx_landing_vec idle;   /* landing buffers free for the next fetch, under ch->lock */
  ucx_landing_vec stranded; /* a fetch that never finished may still write into these: freed with the channel */
  struct ucx_device *device; /* the GPU side: bounce buffers, a stream (backend_ucx_device.c), NULL until used */
  struct ucx_device *stranded_devices; /* ones a read that never finished may still write into: freed with the channel */
  ucx_landing_vec freeing; /* released GPU landings waiting for their event, under ch->lock */
} ucx_chan;

extern const ts_backend ts_ucx_backend;

/* The backend's state in ch, NULL before its init. */
ucx_chan *ts_ucx_chan(tshare_channel *ch);

/* backend_ucx.c: share buf over ch's UCX connection (tshare_share_host on a
 * channel that passes no fds, to a peer with TSHARE_CAP_UCX_REMOTE). */
int ts_ucx_share_host(tshare_channel *ch, struct tshare_host_buffer *buf, const tshare_tensor_desc *desc,
                      int device_type, const char *tag, void *user_data, int timeout_ms, uint64_t *share_id);
int ts_ucx_share_remote(tshare_channel *ch, void *source, const tshare_tensor_desc *desc, int device_type,
                        const char *tag, void *user_data, int timeout_ms, uint64_t *share_id);
/* Whether a host share over ch goes as remote memory. */
bool ts_ucx_carries_host(tshare_channel *ch);
/* A set's host memory on a channel without fds (the host backend's
 * set_remote_check and set_send_remote hooks). */
int ts_ucx_set_remote_check(tshare_channel *ch, void *source);
int ts_ucx_set_send_remote(tshare_channel *ch, void *source, tshare_frame *f, int timeout_ms);

/* backend_ucx_fetch.c */
int ts_ucx_on_rkey(tshare_channel *ch, const tshare_frame *f);
void ts_ucx_drop_remote_locked(ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id);
int ts_ucx_import(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, struct tshare_view *v);
ts_release_done ts_ucx_release(struct tshare_view *v);
int ts_ucx_import_in_set(tshare_channel *ch, const tshare_frame *f, uint64_t *copied, struct tshare_view *v);
int ts_ucx_import_remote(tshare_channel *ch, const tshare_frame *f, struct tshare_view *v);
int ts_ucx_read_remote(tshare_channel *ch, struct tshare_view *v, int64_t offset, void *dst, size_t len);
struct tshare_host_buffer *ts_ucx_memory_host_buffer(void *memory);
void ts_ucx_memory_ref_locked(tshare_channel *ch, void *memory);
void ts_ucx_memory_unref_locked(tshare_channel *ch, void *memory);
void ts_ucx_fetch_peer_gone(tshare_channel *ch, ucx_chan *u);
void ts_ucx_fetch_trim(tshare_channel *ch, ucx_chan *u);
void ts_ucx_fetch_free(ucx_chan *u);
/* Read len bytes at the peer's address in allocation alloc_id (its key
 * came) into dst: TS_UCS_OK, UCX's error, or TS_UCS_INPROGRESS when the
 * peer did not serve it in time (dst may then still be written). */
ts_ucs_status ts_ucx_get_remote(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id,
                                uint64_t address, void *dst, size_t len);
/* The same, given up at until (ts_ucx_now_ms()'s clock) instead of 30 s from now. */
ts_ucs_status ts_ucx_get_remote_until(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id,
                                      uint64_t address, void *dst, size_t len, int64_t until);
int64_t ts_ucx_now_ms(void);

/* backend_ucx_device.c (backend_ucx_device_none.c without CUDA): GPU bytes
 * the peer staged in host memory, placed on a GPU of this process's. */
bool ts_ucx_device_offered(void);      /* a GPU is usable here: the hello offers TSHARE_CAP_UCX_STAGED */
int ts_ucx_device_target(void *stream); /* the device they land on: stream's, the current one, or 0 */
/* len bytes at address of allocation alloc_id read into new GPU memory,
 * *out a landing on_device (refs 1); the bytes are there on return. */
int ts_ucx_device_land(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id, uint64_t address,
                       uint64_t len, void *stream, ucx_landing **out);
/* l's GPU memory let go after the work queued on stream (NULL: the default
 * stream); l goes. Never blocks (ch->lock held). */
void ts_ucx_device_free_locked(ucx_chan *u, ucx_landing *l, void *stream);
/* Housekeeping: landings whose work finished are let go (ch->lock not
 * held); TS_BACKEND_LATER while some still wait. */
ts_backend_wait ts_ucx_device_reap(tshare_channel *ch, ucx_chan *u);
void ts_ucx_device_chan_free(ucx_chan *u);

#endif
