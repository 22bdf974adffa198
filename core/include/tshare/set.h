/* tshare/set.h - tensor sets: many named tensors and metadata in one hand-off.
 *
 * A model is hundreds of named tensors. A tensor set hands them over at once:
 * N tensors, each with a name of 1 to TSHARE_SET_NAME_MAX bytes (UTF-8, unique
 * in the set), plus an optional opaque metadata blob (a version, a step). Each
 * memory the tensors live in travels once however many of them point into it,
 * and the whole set is released as one unit: when the consumer has let go of
 * the set handle and of every view taken from it. Bounds (tensors, names,
 * metadata) are those of wire.h's TSHARE_SET_* and refused with a clear error.
 *
 * Producer: build a set (tshare_set_builder_*), send it with tshare_set_send()
 * (the builder may be sent again, on this or other channels, and destroyed at
 * once: a sent set keeps its own references on the buffers), and wait for its
 * release like a share's: tshare_channel_wait_released(ch, set_id, ...),
 * tshare_share_is_released(), the channel's on_release callback.
 *
 * A builder sent again on a channel costs one frame (plus its metadata and
 * end) when nothing but its metadata changed since the last send there and
 * the consumer keeps every memory of it mapped (tshare host buffers, and
 * VMM memory the consumer keeps: wire 1.6, docs/wire.md): keep the builder
 * between sends and update its tensors in place for that. Any other change
 * (add_*, set_stream to another stream) or a new builder sends the set whole
 * once more; the consumer keeps the layouts of the last four builders sent
 * on a channel.
 *
 * Consumer: tshare_set_recv() takes the next complete set; sets and single
 * shares are received by their own calls, each in the order it was sent. A
 * set's tensors are the producer's memory: writes through them are visible to
 * the producer (on a ucx:// channel they are this process's copy instead:
 * tshare_set_is_copy, docs/ucx.md).
 *
 * A set carries host memory (tshare host buffers, sent as memfds over a
 * socket channel) and CUDA memory of one device (tshare CUDA buffers, and
 * another allocator's memory: cudaMalloc segments as legacy IPC handles, VMM
 * memory as fds), mixed as needed, and needs a peer of wire 1.3 or newer
 * (for CUDA members one with TSHARE_CAP_SET_CUDA: an older peer is refused
 * with TSHARE_E_PEER_MISMATCH before anything is sent). Each CUDA allocation
 * travels once however many members point into it, and the consumer maps it
 * once (its import cache: a set sent again maps nothing new where the
 * producer keeps the memory alive for it: tshare buffers, and members added
 * with a keep). The consumer's work on the set is ordered after the
 * producer's stream (tshare_set_builder_set_stream) by one event per set:
 * tensors received are ready for work on the default stream of their device
 * (the legacy stream 0, and every stream that synchronizes with it); the
 * set's release waits for the work queued there when the last reference
 * goes.
 */
#ifndef TSHARE_SET_H
#define TSHARE_SET_H

#include "tshare/channel.h"
#include "tshare/cuda.h"
#include "tshare/errors.h"
#include "tshare/hostmem.h"
#include "tshare/share.h"
#include "tshare/tensor.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- producer ------------------------------------------------------------ */

typedef struct tshare_set_builder tshare_set_builder;

/* NULL when out of memory. */
TSHARE_API tshare_set_builder *tshare_set_builder_create(void);
/* Drops the builder's references on its buffers; sets already sent keep
 * theirs. NULL is a no-op. */
TSHARE_API void tshare_set_builder_destroy(tshare_set_builder *b);

/* Add a tensor named name (1..TSHARE_SET_NAME_MAX bytes of UTF-8, NUL-ended,
 * unique in the set) that lives in buf (desc->byte_offset relative to buf's
 * start; the layout must lie inside it). The builder holds a reference on buf
 * until it is destroyed. On failure nothing is added and err says why. */
TSHARE_API int tshare_set_builder_add_host(tshare_set_builder *b, const char *name, tshare_host_buffer *buf,
                                           const tshare_tensor_desc *desc, tshare_error *err);
/* A CUDA tensor another allocator made (cudaMalloc, a caching allocator's
 * segment, VMM memory), at ptr (desc->byte_offset relative to ptr). The
 * caller keeps the memory alive until every set sent with it is released:
 * the consumer maps such memory anew for each set (nothing tells this end
 * when the caller frees it). All CUDA members of a set live on one device. */
TSHARE_API int tshare_set_builder_add_cuda(tshare_set_builder *b, const char *name, void *ptr,
                                           const tshare_tensor_desc *desc, tshare_error *err);
/* The same, with what keeps the memory alive: the builder takes over the
 * caller's reference on keep (dropped when it is destroyed), each sent set
 * takes its own with retain(keep) and drops it at its release, and a
 * segment may be held a while longer so the consumer keeps it mapped between
 * sets (docs/cuda.md: the caching allocator's segments). drop(keep) runs
 * at once when the call fails. What a binding uses for a tensor's storage. */
TSHARE_API int tshare_set_builder_add_cuda_keep(tshare_set_builder *b, const char *name, void *ptr,
                                                const tshare_tensor_desc *desc, void (*retain)(void *keep),
                                                tshare_drop_fn drop, void *keep, tshare_error *err);
/* A tensor in a tshare CUDA buffer (desc->byte_offset relative to the
 * buffer's start; the layout must lie inside it). The builder holds a
 * reference on buf until it is destroyed, each sent set one until its
 * release. */
TSHARE_API int tshare_set_builder_add_cuda_buffer(tshare_set_builder *b, const char *name, tshare_cuda_buffer *buf,
                                                  const tshare_tensor_desc *desc, tshare_error *err);
/* The CUDA stream (a CUstream / cudaStream_t of the members' device) whose
 * work wrote the CUDA members: each send orders the consumer after the work
 * queued on it so far. NULL (the default): the legacy default stream. */
TSHARE_API void tshare_set_builder_set_stream(tshare_set_builder *b, void *stream);
/* Set the metadata (copied; at most TSHARE_SET_META_MAX bytes; len 0 clears it). */
TSHARE_API int tshare_set_builder_set_meta(tshare_set_builder *b, const void *meta, size_t len, tshare_error *err);
TSHARE_API size_t tshare_set_builder_count(const tshare_set_builder *b);

/* Send the set built in b on ch (a socket channel whose peer receives tensor
 * sets: TSHARE_E_PEER_MISMATCH otherwise, naming the peer's wire version).
 * *set_id (optional) gets its id, a share id of ch; user_data comes back in
 * the channel's on_release callback. An empty set is refused. On a ucx://
 * channel (a peer of wire 1.6 or newer) each host buffer goes as remote
 * memory, and each CUDA memory is first staged in a host buffer of this
 * process's (after the work on the builder's stream; to a peer that places
 * staged bytes on a GPU); the peer reads each once into memory of its own
 * and then releases the set: docs/ucx.md. */
TSHARE_API int tshare_set_send(tshare_channel *ch, const tshare_set_builder *b, void *user_data, int timeout_ms,
                               uint64_t *set_id);

/* ---- consumer ------------------------------------------------------------ */

typedef struct tshare_set tshare_set;

/* Receive the next complete set. TSHARE_END when the peer said bye,
 * TSHARE_E_TIMEOUT when none came in time; a set the peer got wrong (a tensor
 * outside its memory, a duplicate name, totals that do not add up, a set cut
 * off by other frames) is refused: released back to the peer at once, its fds
 * closed, and the call returns the error, naming the cause. The channel stays
 * usable. On any non-OK return *out is NULL. With timeout_ms 0 (a look, as a
 * binding's "a share or a set, whichever comes first" does) it reads no
 * further than a single share that waits for tshare_view_recv(): the frames
 * behind it stay in the stream rather than in this end's fd budget. */
TSHARE_API int tshare_set_recv(tshare_channel *ch, int timeout_ms, tshare_set **out);
/* tshare_set_recv with the caller's own work done where it would wait: a
 * look first, without waiting (it sends the releases queued for this
 * thread's next call, which the peer may wait for, and takes a set that
 * came already); where none came, before_wait(arg) runs once, on this
 * thread, inside the call (it must not call into ch), and the call then
 * waits as tshare_set_recv does for what is left of timeout_ms (with 0 it
 * returns TSHARE_E_TIMEOUT after before_wait). A tshare_channel_close from
 * another thread meanwhile takes effect as the call returns, as for any
 * call. Where a binding makes the next set's tensors (tshare_set_layout). */
TSHARE_API int tshare_set_recv_idle(tshare_channel *ch, int timeout_ms, void (*before_wait)(void *arg), void *arg,
                                    tshare_set **out);

TSHARE_API uint64_t tshare_set_id(const tshare_set *set);
/* The layout this end keeps of the set (its members' names, dtypes, shapes,
 * strides and places in their memories, in order): one number, the same for
 * the set received whole that asked for it to be kept and for every set sent
 * again from it, never reused in this process (a set keeps its number
 * after the layout is replaced); 0 where no layout was kept of it (a set
 * sent once, one with memory this end does not keep mapped, NULL). Sets of
 * one layout have the same members in memories mapped for each; a member
 * kept mapped is at the same address in each (compare tshare_set_data).
 * What a binding makes the next set's tensors by while it waits for it. */
TSHARE_API uint64_t tshare_set_layout(const tshare_set *set);
TSHARE_API size_t tshare_set_count(const tshare_set *set);
/* Tensor i (< count, in the sender's order): its name (NULL past the end),
 * layout and the address of its element [0,...,0]. */
TSHARE_API const char *tshare_set_name(const tshare_set *set, size_t i);
TSHARE_API const tshare_tensor_desc *tshare_set_desc(const tshare_set *set, size_t i);
TSHARE_API void *tshare_set_data(const tshare_set *set, size_t i);
/* The CUDA device tensor i lives on, as this process numbers its devices;
 * -1 for host memory (and past the end). Its data is a device address then. */
TSHARE_API int tshare_set_cuda_device(const tshare_set *set, size_t i);
/* The index of the tensor called name, or -1. */
TSHARE_API long tshare_set_find(const tshare_set *set, const char *name);
/* The metadata (NULL with *len 0 when the set has none); valid while the set
 * handle lives. */
TSHARE_API const void *tshare_set_meta(const tshare_set *set, size_t *len);

/* 1 when the set's tensors are a copy in this process's memory (a set
 * received over UCX: read from the producer, already released back to it,
 * and writing them changes nothing there), 0 when they map the producer's
 * memory or set is NULL. Its views say the same (tshare_view_is_copy). */
TSHARE_API int tshare_set_is_copy(const tshare_set *set);
/* The host buffer of this process's holding tensor i, for a set that is a
 * copy (its landing buffer, which covers the producer's whole memory, so
 * tshare_set_desc(set, i) lies in it as it is), or NULL (memory mapped from
 * the producer, CUDA memory, past the end). Valid while the set lives; to
 * share the tensors on (one network copy per node, docs/ucx.md), add the
 * buffer to a builder, which holds it from then on
 * (tshare_set_builder_add_host), and release the set. */
TSHARE_API tshare_host_buffer *tshare_set_host_buffer(const tshare_set *set, size_t i);

/* A view of tensor i that keeps the set alive until it is released with
 * tshare_view_release() (from any thread): what a binding hands to a tensor
 * library's deleter. Its tag is empty; tshare_view_share_id() is the set id. */
TSHARE_API int tshare_set_view(tshare_set *set, size_t i, tshare_view **out);

/* Let go of the set handle (any thread, never blocking; NULL is a no-op). The
 * set is released to the producer, in one release, once its views are
 * released too. Data pointers taken from the handle are invalid afterwards. */
TSHARE_API void tshare_set_release(tshare_set *set);

/* ---- one set's tensors across versions ---------------------------------- */

/* A member's memory kept mapped past its set's release. */
typedef struct tshare_set_pin tshare_set_pin;

/* Release a set member's view (tshare_set_view) as tshare_view_release()
 * does, but keep its memory mapped where it is until
 * tshare_set_pin_release(*pin): the set goes back to the producer once its
 * handle and other views are gone, and tshare_view_data()'s address stays
 * mapped (reads there do not fault), though from then on the producer may
 * write that memory or give it to other tensors. What a consumer that keeps
 * one set's tensors across versions holds between a version's release and
 * the arrival of the next: a set of the same layout (tshare_set_layout)
 * whose members are at the same addresses (tshare_set_data), whose views
 * its tensors then take (and let go of the pins). Any thread; never
 * blocks (CUDA: where it lets the set go, the release goes to the producer
 * once the work queued on the default stream so far ran). TSHARE_E_INVALID_ARG
 * (nothing released) for a view that is not a set member's or a NULL
 * argument, TSHARE_E_NOMEM (nothing released) without memory for the pin. */
TSHARE_API int tshare_set_view_release_pinned(tshare_view *view, tshare_set_pin **pin);
/* Every memory of the set kept mapped where it is until
 * tshare_set_pin_release(*pin), as one pin: what a consumer that keeps a
 * set's tensors across versions takes before it releases the set (with
 * tshare_set_release), in one call and one lock, without a view per member.
 * The set handle stays the caller's. tshare_set_pin_data() is the first
 * member's data. TSHARE_E_INVALID_ARG for a NULL argument or a set whose
 * memory no pin can hold, TSHARE_E_NOMEM (nothing pinned). */
TSHARE_API int tshare_set_pin_memories(tshare_set *set, tshare_set_pin **pin);
/* The address the pinned view's data was at. */
TSHARE_API void *tshare_set_pin_data(const tshare_set_pin *pin);
/* Let go of the mapping: unmapped here if nothing else maps it (any thread;
 * NULL is a no-op; never blocks). Host memory: a mapping its producer
 * retired goes at the channel's next idle turn. CUDA memory: let go of once
 * the work queued on the default stream of its device so far ran (looked
 * at by the channel's next calls, as a dropped set's release is), since it
 * may still read the memory. */
TSHARE_API void tshare_set_pin_release(tshare_set_pin *pin);

/* ---- fan-out: one set to many consumers --------------------------------- */

/* Send the set built in b to each of the n channels chs[0..n-1], in that
 * order, with what is left of one timeout_ms for each (a slow consumer does
 * not take the others' time away: a channel with room still gets the set
 * after the deadline passed). set_ids[i] (required, n entries) gets the set's
 * id on chs[i], 0 where that send failed; user_data comes back in each
 * channel's on_release callback. A failed send (a dead consumer, a NULL
 * channel, a timeout) does not stop the sends to the others. results
 * (optional, n entries) gets each consumer's outcome: code TSHARE_OK, or the
 * error with a message naming the consumer (its index, hello name and pid)
 * and what its channel said. Returns TSHARE_OK when every send succeeded,
 * else the status of the first failed channel in list order. */
TSHARE_API int tshare_set_send_all(const tshare_set_builder *b, tshare_channel *const *chs, size_t n,
                                   void *user_data, int timeout_ms, uint64_t *set_ids, tshare_error *results);

/* Drive the n channels until each has released set_ids[i], waiting on all of
 * them at once (poll on their fds), up to timeout_ms in all (< 0: no limit).
 * As for tshare_channel_wait_released(), a set counts as released also when
 * its consumer went away (its shares are dropped then). A set id of 0 (a
 * send that failed) is skipped with TSHARE_OK. results (optional, n entries)
 * as for tshare_set_send_all(): a consumer still holding its set at the
 * deadline gets TSHARE_E_TIMEOUT, the others their own outcome. Returns
 * TSHARE_OK when every set came back, else the status of the first failed
 * channel in list order. Single shares sent to many channels can be waited
 * on the same way: their share ids go in set_ids. */
TSHARE_API int tshare_set_wait_all(tshare_channel *const *chs, const uint64_t *set_ids, size_t n, int timeout_ms,
                                   tshare_error *results);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_SET_H */
