#include "tshare/errors.h"

#include "error_detail.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Made from errors.h's list: names and messages cannot drift apart. */
static const struct {
  int status;
  const char *name;
  const char *message;
} status_table[] = {
#define TS_STATUS_ROW(name, value, message) {name, #name, message},
    TSHARE_STATUS_LIST(TS_STATUS_ROW)
#undef TS_STATUS_ROW
};

const char *tshare_version(void) {
#define TS_STR_(x) #x
#define TS_STR(x) TS_STR_(x)
  return TS_STR(TSHARE_VERSION_MAJOR) "." TS_STR(TSHARE_VERSION_MINOR) "." TS_STR(TSHARE_VERSION_PATCH);
}

int tshare_version_number(void) { return TSHARE_VERSION_NUMBER; }

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

int ts_err_text(char *buf, size_t cap, int status, const char *text) {
  if (buf && cap) {
    size_t n = strlen(text);
    if (n >= cap) n = cap - 1;
    memcpy(buf, text, n);
    buf[n] = '\0';
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
  /* Copied, not formatted: every call that succeeds fills its error too. */
  const char *text = detail && detail[0] ? detail : tshare_status_str(status);
  size_t n = strnlen(text, sizeof out->message - 1);
  memcpy(out->message, text, n);
  out->message[n] = '\0';
}
