/* tshare/errors.h - status codes and error details.
 *
 * Every tshare function that can fail returns a tshare_status. Zero is success,
 * small positive values are non-error outcomes (try again, clean end of stream),
 * negative values are errors. tshare_status_str() gives a static, never-NULL
 * message for any value, known or not.
 *
 * Details ("which field, which syscall, which errno") live with the object that
 * failed: each handle type has a *_last_error() accessor. Constructors, which
 * have no object yet when they fail, fill an optional tshare_error instead.
 */
#ifndef TSHARE_ERRORS_H
#define TSHARE_ERRORS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tshare_status {
  TSHARE_OK = 0,
  TSHARE_AGAIN = 1, /* not an error: need more bytes / would block */
  TSHARE_END = 2,   /* not an error: the peer ended the stream cleanly (bye) */

  TSHARE_E_INVALID_ARG = -1,    /* a caller passed a bad argument */
  TSHARE_E_NOMEM = -2,          /* an allocation failed */
  TSHARE_E_SYSTEM = -3,         /* a system call failed; the detail names it and errno */
  TSHARE_E_TIMEOUT = -4,        /* the operation did not finish in time */
  TSHARE_E_PEER_CLOSED = -5,    /* the peer closed the channel (EOF, EPIPE, reset) */
  TSHARE_E_BAD_MAGIC = -6,      /* the bytes are not a tshare frame */
  TSHARE_E_VERSION = -7,        /* the peer speaks another major wire version */
  TSHARE_E_UNKNOWN_TYPE = -8,   /* a frame type this version does not know */
  TSHARE_E_TOO_LARGE = -9,      /* a length or count is over its named limit */
  TSHARE_E_TRUNCATED = -10,     /* a payload ends before its fields do */
  TSHARE_E_MALFORMED = -11,     /* a field holds a value that is not allowed */
  TSHARE_E_OUT_OF_BOUNDS = -12, /* a tensor view reaches outside its allocation */
  TSHARE_E_OVERFLOW = -13,      /* shape, stride or size arithmetic overflows */
  TSHARE_E_PROTOCOL = -14,      /* a valid frame at the wrong time (share before hello, unknown id, missing fd) */
  TSHARE_E_PEER_MISMATCH = -15, /* the peer is not compatible (other boot, missing capability) */
  TSHARE_E_PEER_ERROR = -16,    /* the peer sent an error frame; the detail holds its message */
  TSHARE_E_UNSUPPORTED = -17,   /* the operation is not available here (e.g. fds over pipes) */
  TSHARE_E_NOT_FOUND = -18,     /* a binary, variable or object does not exist */
  TSHARE_E_SPAWN = -19,         /* a process could not be started; the detail has path and errno */
  TSHARE_E_STATE = -20,         /* the object is closed or in the wrong state */
  TSHARE_E_NO_DEVICE = -21,     /* no usable CUDA device */
  TSHARE_E_CUDA = -22,          /* a CUDA call failed */
  TSHARE_E_PERMISSION = -23,    /* the peer runs as a user that is not allowed, or a path is not private */
  TSHARE_E_LIMIT = -24          /* a resource limit was reached (fds, a channel's bound); the detail names it */
} tshare_status;

/* Static description of a status; never NULL, also for unknown values. */
const char *tshare_status_str(int status);

/* Symbolic name of a status ("TSHARE_E_TIMEOUT"); never NULL. */
const char *tshare_status_name(int status);

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
