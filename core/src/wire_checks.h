/* The wire encoder's and the tensor checks' own forms, with the detail in a
 * caller's buffer (err may be NULL): what the library calls inside, where
 * every object keeps its detail in a char array. The public forms (wire.h,
 * tensor.h) fill an optional tshare_error, as every call without a handle
 * does (errors.h). */
#ifndef TSHARE_WIRE_CHECKS_H
#define TSHARE_WIRE_CHECKS_H

#include "tshare/wire.h"

int ts_wire_encode(const tshare_frame *frame, uint8_t *buf, size_t cap, size_t *len, char *err, size_t err_cap);
int ts_wire_check_share(const tshare_share_frame *share, const tshare_wire_limits *limits, char *err, size_t err_cap);
int ts_wire_check_set(const tshare_set_frame *set, uint8_t flags, const tshare_wire_limits *limits, char *err,
                      size_t err_cap);
/* The library's decoder call: tshare_decoder_next, except that a set frame
 * breaking a rule inside a sound frame (its header checked, its whole
 * payload there, its op and a set_id other than 0 read) does not fail the
 * stream. It is consumed and handed out with op TS_SET_OP_REFUSED, only its
 * set_id and the header's fields kept, and *refused gets the status (the
 * detail: tshare_decoder_last_error); the decoder goes on with the next
 * frame. *refused is TSHARE_OK otherwise. Only broken framing sticks. */
#define TS_SET_OP_REFUSED 0 /* never a set op on the wire */
int ts_decoder_next(tshare_decoder *d, tshare_frame *out, int *refused);

/* Zero a frame of this type for building or decoding it: the header and its
 * type's union member, a release's or retire's ids only up to their arrays
 * (filled up to the count, never read past it). A whole tshare_frame is over
 * 2 KiB, which zeroed for every share sent and every frame read cost more
 * than encoding or decoding it. Returns f. */
tshare_frame *ts_frame_clear(tshare_frame *f, uint8_t type);

int ts_tensor_check(const tshare_tensor_desc *desc, uint64_t alloc_size, uint64_t *span_begin, uint64_t *span_end,
                    char *err, size_t err_cap);

#endif
