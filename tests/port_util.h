/* port_util.h - a loopback TCP port for a test's listener. */
#ifndef TSHARE_TESTS_PORT_UTIL_H
#define TSHARE_TESTS_PORT_UTIL_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* A port on 127.0.0.1 that nothing holds now, below the kernel's ephemeral
 * range: the connections of tests running in parallel take their own ports
 * from that range, and one of them once held the port a listener here was
 * given (EADDRINUSE). Candidates start at a place that differs per process
 * and each is bound once and let go; another test's listener could still
 * take it in between, which the spread of starts makes rare. */
static inline unsigned free_loopback_port(void) {
  unsigned first_ephemeral = 32768;
  FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  if (f) {
    unsigned lo, hi;
    if (fscanf(f, "%u %u", &lo, &hi) == 2) first_ephemeral = lo;
    fclose(f);
  }
  const unsigned base = 10000;
  unsigned span = first_ephemeral > base + 1000 ? first_ephemeral - base : 1000;
  unsigned start = (unsigned)getpid() % span;
  for (unsigned i = 0; i < span; i++) {
    unsigned port = base + (start + i) % span;
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) break;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int bound = bind(s, (struct sockaddr *)&a, sizeof a) == 0;
    close(s);
    if (bound) return port;
  }
  return base + start;
}

#endif
