/* tshare/errors.h - status codes and error details.
 *
 * Every tshare function that can fail returns a tshare_status. Zero is success,
 * small positive values are non-error outcomes (try again, clean end of stream),
 * negative values are errors. tshare_status_str() gives a static, never-NULL
 * message for any value, known or not.
 *
 * Nothing came in time: every call that waits with a timeout (receive, peek,
 * poll, wait, send, connect, accept) returns TSHARE_E_TIMEOUT when its time
 * ran out, timeout 0 included. TSHARE_AGAIN is only for calls that never wait
 * and are not finished: the decoder needs more bytes, a slab is full.
 *
 * Details ("which field, which syscall, which errno"), one rule for every
 * call: a call on a handle keeps its detail with that handle, read with the
 * handle type's *_last_error() accessor; a call without one (constructors,
 * which have no object yet when they fail, and calls on plain data: the wire
 * encoder, tshare_tensor_check) fills an optional tshare_error. A call on a
 * channel refused before it began (TSHARE_E_BUSY: another thread is inside a
 * call on it; TSHARE_E_STATE: it is being closed, or it belongs to the process
 * this one was forked from) keeps its detail for the refused thread:
 * tshare_channel_last_error() on that thread returns it, while the channel's
 * own detail stays the other thread's.
 */
#ifndef TSHARE_ERRORS_H
#define TSHARE_ERRORS_H

#include "tshare/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One row per status: name, value, static message. The enum, the names and
 * the messages are all made from this list. */
#define TSHARE_STATUS_LIST(X)                                                                                          \
  X(TSHARE_OK, 0, "success")                                                                                           \
  /* not errors: */                                                                                                    \
  X(TSHARE_AGAIN, 1, "not finished yet, try again") /* need more bytes; nothing came without waiting */                \
  X(TSHARE_END, 2, "the peer ended the stream")     /* the peer said bye: a clean end */                               \
  /* errors: */                                                                                                        \
  X(TSHARE_E_INVALID_ARG, -1, "invalid argument")        /* a caller passed a bad argument */                          \
  X(TSHARE_E_NOMEM, -2, "out of memory")                 /* an allocation failed */                                    \
  X(TSHARE_E_SYSTEM, -3, "system call failed")           /* the detail names the call and errno */                     \
  X(TSHARE_E_TIMEOUT, -4, "timed out")                   /* the operation did not finish in time */                    \
  X(TSHARE_E_PEER_CLOSED, -5, "peer closed the channel") /* EOF, EPIPE, reset */                                       \
  X(TSHARE_E_BAD_MAGIC, -6, "not a tshare frame (bad magic)")                                                          \
  X(TSHARE_E_VERSION, -7, "incompatible wire version") /* the peer speaks another major wire version */                \
  X(TSHARE_E_UNKNOWN_TYPE, -8, "unknown frame type")                                                                   \
  X(TSHARE_E_TOO_LARGE, -9, "length or count over its limit")                                                          \
  X(TSHARE_E_TRUNCATED, -10, "payload truncated") /* a payload ends before its fields do */                            \
  X(TSHARE_E_MALFORMED, -11, "malformed field")   /* a field holds a value that is not allowed */                      \
  X(TSHARE_E_OUT_OF_BOUNDS, -12, "tensor view outside its allocation")                                                 \
  X(TSHARE_E_OVERFLOW, -13, "size arithmetic overflow")    /* shape, stride or size arithmetic */                      \
  X(TSHARE_E_PROTOCOL, -14, "protocol violation")          /* a valid frame at the wrong time, unknown id, no fd */    \
  X(TSHARE_E_PEER_MISMATCH, -15, "peer is not compatible") /* other boot, missing capability */                        \
  X(TSHARE_E_PEER_ERROR, -16, "peer reported an error")    /* the detail holds its message */                          \
  X(TSHARE_E_UNSUPPORTED, -17, "operation not supported here") /* e.g. fds over pipes */                               \
  X(TSHARE_E_NOT_FOUND, -18, "not found")                      /* a binary, variable or object */                      \
  X(TSHARE_E_SPAWN, -19, "could not start process")            /* the detail has path and errno */                     \
  X(TSHARE_E_STATE, -20, "object is closed or in the wrong state")                                                     \
  X(TSHARE_E_NO_DEVICE, -21, "no CUDA device")                                                                         \
  X(TSHARE_E_CUDA, -22, "CUDA call failed")                                                                            \
  X(TSHARE_E_PERMISSION, -23, "peer or path not allowed") /* another user, a path that is not private */               \
  X(TSHARE_E_LIMIT, -24, "a resource limit was reached")  /* fds, a channel's bound; the detail names it */            \
  X(TSHARE_E_BUSY, -25, "another thread is inside a call on this channel") /* one thread at a time: channel.h */

typedef enum tshare_status {
#define TSHARE_STATUS_ENUM_(name, value, message) name = value,
  TSHARE_STATUS_LIST(TSHARE_STATUS_ENUM_)
#undef TSHARE_STATUS_ENUM_
} tshare_status;

/* Static description of a status; never NULL, also for unknown values. */
TSHARE_API const char *tshare_status_str(int status);

/* Symbolic name of a status ("TSHARE_E_TIMEOUT"); never NULL. */
TSHARE_API const char *tshare_status_name(int status);

#define TSHARE_ERROR_MSG_MAX 256

/* Filled by constructors that fail before an object exists. On success the
 * code is TSHARE_OK and the message empty. */
typedef struct tshare_error {
  tshare_status code;
  char message[TSHARE_ERROR_MSG_MAX];
} tshare_error;

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_ERRORS_H */
