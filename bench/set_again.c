/* tshare-set-again: a model's state_dict (290 tensors, each in its own host
 * buffer, as a CPU state_dict's storages are) sent again and again, updated
 * in place: the set sent as one frame (TSHARE_SET_AGAIN) against the same
 * set sent whole (a consumer opened with TSHARE_SET_AGAIN=0, the debugging
 * switch), paired in one run: one builder, two channels to two consumers,
 * each round sent on both in turn. Per row: the producer's send call, and
 * the round trip (send, the consumer's tshare_set_recv and release, the
 * release back).
 *
 *   tshare-set-again [N]   N rounds (default 2000) after 100 of warm-up */
#include "bench_stats.h"

#include <tshare/tshare.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define TENSORS 290
#define FLOATS 1024
#define WARMUP 100
#define TIMEOUT_MS 10000

static void die(const char *what, tshare_channel *ch) {
  fprintf(stderr, "tshare-set-again: %s: %s\n", what, ch ? tshare_channel_last_error(ch) : "");
  exit(1);
}

static tshare_channel *open_end(int fd, const char *name) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = name;
  tshare_channel *ch = NULL;
  tshare_error err;
  if (tshare_channel_open_socket(fd, &o, &ch, &err) != TSHARE_OK) {
    fprintf(stderr, "tshare-set-again: open: %s\n", err.message);
    exit(1);
  }
  return ch;
}

/* The consumer: takes each set, reads a member of it, lets it go. */
static void consume(int fd) {
  tshare_channel *ch = open_end(fd, "consumer");
  volatile float sink = 0;
  for (;;) {
    tshare_set *s;
    int rc = tshare_set_recv(ch, TIMEOUT_MS, &s);
    if (rc == TSHARE_END) break;
    if (rc != TSHARE_OK) die("receive", ch);
    sink += ((const float *)tshare_set_data(s, tshare_set_count(s) - 1))[0];
    tshare_set_release(s);
  }
  tshare_channel_close(ch);
}

/* A consumer in a child process (with TSHARE_SET_AGAIN=0 when whole), and
 * this end's channel to it. */
static tshare_channel *start_consumer(bool whole, pid_t *pid) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) die("socketpair", NULL);
  if (whole) setenv("TSHARE_SET_AGAIN", "0", 1);
  *pid = fork();
  if (*pid == 0) {
    close(sv[0]);
    consume(sv[1]);
    _exit(0);
  }
  close(sv[1]);
  tshare_channel *ch = open_end(sv[0], "producer");
  unsetenv("TSHARE_SET_AGAIN");
  return ch;
}

typedef struct row {
  const char *name;
  tshare_channel *ch;
  pid_t pid;
  bs_samples send_ns, round_ns;
} row;

static void one_round(row *r, tshare_set_builder *b, bool measured) {
  uint64_t id, t0 = bs_now_ns();
  if (tshare_set_send(r->ch, b, NULL, TIMEOUT_MS, &id) != TSHARE_OK) die("send", r->ch);
  uint64_t t1 = bs_now_ns();
  if (tshare_channel_wait_released(r->ch, id, TIMEOUT_MS) != TSHARE_OK) die("wait", r->ch);
  uint64_t t2 = bs_now_ns();
  if (!measured) return;
  bs_add(&r->send_ns, (double)(t1 - t0));
  bs_add(&r->round_ns, (double)(t2 - t0));
}

int main(int argc, char **argv) {
  long rounds = argc > 1 ? strtol(argv[1], NULL, 10) : 2000;
  if (rounds <= 0) rounds = 2000;
  tshare_host_buffer *bufs[TENSORS];
  tshare_set_builder *b = tshare_set_builder_create();
  for (int i = 0; i < TENSORS; i++) {
    if (tshare_host_buffer_create(FLOATS * sizeof(float), "tshare-set-again", &bufs[i], NULL) != TSHARE_OK)
      die("buffer", NULL);
    int64_t n = FLOATS;
    tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &n, 0);
    char name[64];
    snprintf(name, sizeof name, "model.layers.%d.mlp.weight", i);
    if (tshare_set_builder_add_host(b, name, bufs[i], &d, NULL) != TSHARE_OK) die("add", NULL);
  }
  row rows[2] = {{.name = "sent again (one frame)"}, {.name = "sent whole (TSHARE_SET_AGAIN=0)"}};
  for (int i = 0; i < 2; i++) rows[i].ch = start_consumer(i == 1, &rows[i].pid);
  for (long n = 0; n < rounds + WARMUP; n++) {
    float v = (float)n;
    for (int i = 0; i < TENSORS; i++) ((float *)tshare_host_buffer_data(bufs[i]))[0] = v; /* in place */
    if (tshare_set_builder_set_meta(b, &v, sizeof v, NULL) != TSHARE_OK) die("meta", NULL);
    for (int i = 0; i < 2; i++) one_round(&rows[(n + i) % 2], b, n >= WARMUP); /* each goes first in turn */
  }
  printf("%d tensors in %d host buffers, %ld rounds, p50 (p99) in us\n", TENSORS, TENSORS, rounds);
  double p50[2];
  for (int i = 0; i < 2; i++) {
    p50[i] = bs_percentile(&rows[i].round_ns, 50) / 1e3;
    printf("  %-34s send %8.1f (%8.1f)   round trip %8.1f (%8.1f)\n", rows[i].name,
           bs_percentile(&rows[i].send_ns, 50) / 1e3, bs_percentile(&rows[i].send_ns, 99) / 1e3, p50[i],
           bs_percentile(&rows[i].round_ns, 99) / 1e3);
  }
  printf("  round trip, whole / again: %.1fx; send call: %.1fx\n", p50[1] / p50[0],
         bs_percentile(&rows[1].send_ns, 50) / bs_percentile(&rows[0].send_ns, 50));
  for (int i = 0; i < 2; i++) {
    tshare_channel_send_bye(rows[i].ch, 0, TIMEOUT_MS);
    tshare_channel_close(rows[i].ch);
    waitpid(rows[i].pid, NULL, 0);
    bs_free(&rows[i].send_ns);
    bs_free(&rows[i].round_ns);
  }
  tshare_set_builder_destroy(b);
  for (int i = 0; i < TENSORS; i++) tshare_host_buffer_destroy(bufs[i]);
  return 0;
}
