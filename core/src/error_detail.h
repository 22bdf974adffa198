/* Internal helpers that format per-object error details. */
#ifndef TSHARE_ERROR_DETAIL_H
#define TSHARE_ERROR_DETAIL_H

#include "tshare/errors.h"

#include <stddef.h>

#if defined(__GNUC__)
#define TS_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define TS_PRINTF(f, a)
#endif

/* Write a detail message into buf and return status, so a failing path reads
 * `return ts_errf(obj->err, sizeof obj->err, TSHARE_E_X, "...")`. */
int ts_errf(char *buf, size_t cap, int status, const char *fmt, ...) TS_PRINTF(4, 5);

/* Same for a fixed text, without formatting: for outcomes a caller meets on
 * every turn (a poll with nothing there times out), where vsnprintf cost
 * more than the rest of the call. */
int ts_err_text(char *buf, size_t cap, int status, const char *text);

/* Same, appending ": strerror(err) (errno N)". */
int ts_errsys(char *buf, size_t cap, int status, int err, const char *fmt, ...) TS_PRINTF(5, 6);

/* Copy a status and detail into an optional tshare_error. */
void ts_error_fill(tshare_error *out, int status, const char *detail);

#endif
