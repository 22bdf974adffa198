#include "tshare/errors.h"

#include "error_detail.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* One row per status keeps the name and the message from drifting apart. */
static const struct {
  int status;
  const char *name;
  const char *message;
} status_table[] = {
    {TSHARE_OK, "TSHARE_OK", "success"},
    {TSHARE_AGAIN, "TSHARE_AGAIN", "not finished yet, try again"},
    {TSHARE_END, "TSHARE_END", "the peer ended the stream"},
    {TSHARE_E_INVALID_ARG, "TSHARE_E_INVALID_ARG", "invalid argument"},
    {TSHARE_E_NOMEM, "TSHARE_E_NOMEM", "out of memory"},
    {TSHARE_E_SYSTEM, "TSHARE_E_SYSTEM", "system call failed"},
    {TSHARE_E_TIMEOUT, "TSHARE_E_TIMEOUT", "timed out"},
    {TSHARE_E_PEER_CLOSED, "TSHARE_E_PEER_CLOSED", "peer closed the channel"},
    {TSHARE_E_BAD_MAGIC, "TSHARE_E_BAD_MAGIC", "not a tshare frame (bad magic)"},
    {TSHARE_E_VERSION, "TSHARE_E_VERSION", "incompatible wire version"},
    {TSHARE_E_UNKNOWN_TYPE, "TSHARE_E_UNKNOWN_TYPE", "unknown frame type"},
    {TSHARE_E_TOO_LARGE, "TSHARE_E_TOO_LARGE", "length or count over its limit"},
    {TSHARE_E_TRUNCATED, "TSHARE_E_TRUNCATED", "payload truncated"},
    {TSHARE_E_MALFORMED, "TSHARE_E_MALFORMED", "malformed field"},
    {TSHARE_E_OUT_OF_BOUNDS, "TSHARE_E_OUT_OF_BOUNDS", "tensor view outside its allocation"},
    {TSHARE_E_OVERFLOW, "TSHARE_E_OVERFLOW", "size arithmetic overflow"},
    {TSHARE_E_PROTOCOL, "TSHARE_E_PROTOCOL", "protocol violation"},
    {TSHARE_E_PEER_MISMATCH, "TSHARE_E_PEER_MISMATCH", "peer is not compatible"},
    {TSHARE_E_PEER_ERROR, "TSHARE_E_PEER_ERROR", "peer reported an error"},
    {TSHARE_E_UNSUPPORTED, "TSHARE_E_UNSUPPORTED", "operation not supported here"},
    {TSHARE_E_NOT_FOUND, "TSHARE_E_NOT_FOUND", "not found"},
    {TSHARE_E_SPAWN, "TSHARE_E_SPAWN", "could not start process"},
    {TSHARE_E_STATE, "TSHARE_E_STATE", "object is closed or in the wrong state"},
    {TSHARE_E_NO_DEVICE, "TSHARE_E_NO_DEVICE", "no CUDA device"},
    {TSHARE_E_CUDA, "TSHARE_E_CUDA", "CUDA call failed"},
    {TSHARE_E_PERMISSION, "TSHARE_E_PERMISSION", "peer or path not allowed"},
    {TSHARE_E_LIMIT, "TSHARE_E_LIMIT", "a resource limit was reached"},
};

const char *tshare_status_str(int status) {
  for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
    if (status_table[i].status == status) return status_table[i].message;
  return "unknown tshare status";
}

const char *tshare_status_name(int status) {
  for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
    if (status_table[i].status == status) return status_table[i].name;
  return "TSHARE_UNKNOWN";
}

int ts_errf(char *buf, size_t cap, int status, const char *fmt, ...) {
  if (buf && cap) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
  }
  return status;
}

int ts_errsys(char *buf, size_t cap, int status, int err, const char *fmt, ...) {
  if (buf && cap) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < cap) snprintf(buf + n, cap - (size_t)n, ": %s (errno %d)", strerror(err), err);
  }
  return status;
}

void ts_error_fill(tshare_error *out, int status, const char *detail) {
  if (!out) return;
  out->code = (tshare_status)status;
  snprintf(out->message, sizeof out->message, "%s", detail && detail[0] ? detail : tshare_status_str(status));
}
