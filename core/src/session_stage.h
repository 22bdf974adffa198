/* GPU memory to a peer on another host (a channel over UCX): CUDA handles
 * open only on the machine that made them, so the bytes are staged in host
 * memory this end registers, the peer reads them (UCX get) and places them
 * on a GPU of its own (backend_ucx_device.c). The share or set memory
 * travels as remote host memory whose device_type is TSHARE_DEVICE_CUDA.
 *
 * Staging buffers are tshare host buffers kept per channel, one per source
 * (a device pointer for a share, an allocation for a set's memory), and
 * written again for the next send of the same source once nothing reads
 * them: a model updated in place is registered with UCX, and its keys sent,
 * once. A buffer still read by the peer is never written: the send stages
 * into a new one. */
#ifndef TSHARE_SESSION_STAGE_H
#define TSHARE_SESSION_STAGE_H

#include "session.h"

#include <stdbool.h>
#include <stdint.h>

/* Whether GPU memory sent on ch is staged: ch crosses hosts and carries
 * host memory there. */
bool ts_stage_applies(tshare_channel *ch);

/* A share of len..desc's bytes of device memory at ptr (device's memory,
 * ordered after stream): staged, then shared as remote host memory. */
int ts_stage_share(tshare_channel *ch, const ts_backend *device, const void *ptr, const tshare_tensor_desc *desc,
                   void *stream, const char *tag, void *user_data, int timeout_ms, uint64_t *share_id);

/* Whether ch's peer takes src staged (an error in ch->err). */
int ts_stage_set_check(tshare_channel *ch, const ts_set_source *src);
/* A set's memory src staged (after the work on stream) and sent as memory
 * frame f; *hold gets what the set keeps until its release. */
int ts_stage_set_mem(tshare_channel *ch, const ts_set_source *src, void *stream, tshare_frame *f, ts_keep_ref *hold,
                     int timeout_ms);

/* The channel goes: its staging buffers go once nothing reads them. In a
 * forked child only the child's bookkeeping goes. */
void ts_stage_free(tshare_channel *ch);
void ts_stage_free_in_child(tshare_channel *ch);

#endif
