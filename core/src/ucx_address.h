/* Addresses of channels across hosts: "ucx://HOST:PORT/NAME".
 *
 * HOST is a host name or an IPv4 address (0.0.0.0 to listen on every
 * interface), PORT a TCP port (1-65535) the listener's bootstrap socket
 * binds, NAME the channel's name at that port (letters, digits, '.', '_',
 * '-'; at most TS_UCX_NAME_MAX bytes): a connect names the channel it wants,
 * and the listener refuses any other. */
#ifndef TSHARE_UCX_ADDRESS_H
#define TSHARE_UCX_ADDRESS_H

#include <stdbool.h>
#include <stddef.h>

#define TS_UCX_SCHEME "ucx://"
#define TS_UCX_HOST_MAX 255
#define TS_UCX_NAME_MAX 200

typedef struct ts_ucx_address {
  char host[TS_UCX_HOST_MAX + 1];
  unsigned port;
  char name[TS_UCX_NAME_MAX + 1];
} ts_ucx_address;

/* Whether s is meant as a UCX address (starts with "ucx://"). */
bool ts_ucx_is_address(const char *s);

/* Parse s into *a: TSHARE_OK, or TSHARE_E_INVALID_ARG (a bad port, a missing
 * host or name) or TSHARE_E_TOO_LARGE (a host or name over its bound), with
 * the reason in msg. */
int ts_ucx_parse_address(const char *s, ts_ucx_address *a, char *msg, size_t cap);

#endif
