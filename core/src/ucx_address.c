/* Parsing "ucx://HOST:PORT/NAME" (ucx_address.h). */
#include "ucx_address.h"

#include "error_detail.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

bool ts_ucx_is_address(const char *s) { return s && strncmp(s, TS_UCX_SCHEME, strlen(TS_UCX_SCHEME)) == 0; }

static bool name_char(char ch) {
  return isalnum((unsigned char)ch) || ch == '.' || ch == '_' || ch == '-';
}

static int parse_port(const char *p, size_t n, const char *s, unsigned *port, char *msg, size_t cap) {
  unsigned long v = 0;
  for (size_t i = 0; i < n && v <= 65535; i++) {
    if (!isdigit((unsigned char)p[i])) n = 0; /* not a number */
    else v = v * 10 + (unsigned long)(p[i] - '0');
  }
  if (n == 0 || v == 0 || v > 65535)
    return ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "address '%.80s': the port must be a number from 1 to 65535", s);
  *port = (unsigned)v;
  return TSHARE_OK;
}

/* HOST:PORT, the part before the name's '/'. */
static int parse_host_port(const char *hp, size_t len, const char *s, ts_ucx_address *a, char *msg, size_t cap) {
  const char *colon = memchr(hp, ':', len);
  if (!colon)
    return ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "address '%.80s': no port (write ucx://HOST:PORT/NAME)", s);
  size_t host_len = (size_t)(colon - hp);
  if (host_len == 0)
    return ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "address '%.80s': no host (write ucx://HOST:PORT/NAME)", s);
  if (host_len > TS_UCX_HOST_MAX)
    return ts_errf(msg, cap, TSHARE_E_TOO_LARGE, "address '%.80s': the host is over %d bytes", s, TS_UCX_HOST_MAX);
  for (size_t i = 0; i < host_len; i++)
    if (!name_char(hp[i]))
      return ts_errf(msg, cap, TSHARE_E_INVALID_ARG,
                     "address '%.80s': the host may hold letters, digits, '.', '_' and '-' only", s);
  memcpy(a->host, hp, host_len);
  a->host[host_len] = '\0';
  return parse_port(colon + 1, len - host_len - 1, s, &a->port, msg, cap);
}

int ts_ucx_parse_address(const char *s, ts_ucx_address *a, char *msg, size_t cap) {
  memset(a, 0, sizeof *a);
  if (!ts_ucx_is_address(s))
    return ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "address '%.80s' does not start with %s", s ? s : "(null)",
                   TS_UCX_SCHEME);
  const char *hp = s + strlen(TS_UCX_SCHEME);
  const char *slash = strchr(hp, '/');
  if (!slash || slash[1] == '\0')
    return ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "address '%.80s': no channel name (write ucx://HOST:PORT/NAME)", s);
  int rc = parse_host_port(hp, (size_t)(slash - hp), s, a, msg, cap);
  if (rc != TSHARE_OK) return rc;
  const char *name = slash + 1;
  size_t name_len = strlen(name);
  if (name_len > TS_UCX_NAME_MAX)
    return ts_errf(msg, cap, TSHARE_E_TOO_LARGE, "address '%.64s...': the channel name is over %d bytes", s,
                   TS_UCX_NAME_MAX);
  for (size_t i = 0; i < name_len; i++)
    if (!name_char(name[i]))
      return ts_errf(msg, cap, TSHARE_E_INVALID_ARG,
                     "address '%.80s': the channel name may hold letters, digits, '.', '_' and '-' only", s);
  memcpy(a->name, name, name_len + 1);
  return TSHARE_OK;
}
