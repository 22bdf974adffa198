/* tshare-stress COMMAND MEM [OPTIONS]: fault trials and the load test. */
#include "stress.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char usage[] =
    "usage: tshare-stress COMMAND host|cuda [OPTIONS]\n"
    "  kill-consumer   kill -9 the consumer at a random point of a stream, over and over:\n"
    "                  every share comes back, memory returns to its baseline\n"
    "                  (--trials 100 --shares 10000 --seed S)\n"
    "  kill-producer   kill -9 the producer under a consumer: TSHARE_E_PEER_CLOSED, no hang;\n"
    "                  views held stay intact (--trials 20)\n"
    "  sigstop         SIGSTOP the consumer: sends time out, memory stays bounded; SIGCONT\n"
    "                  resumes (--stop-ms 2000)\n"
    "  sigint-launcher SIGINT to tshare-launch mid-stream: every role stops, none is left\n"
    "                  (TSHARE_LAUNCH=path; --trials 10)\n"
    "  load            K consumers x N shares, random sizes and release order: no error, no\n"
    "                  leak, no growth (--consumers 4 --shares 100000 --seed S)\n"
    "Exit 0 when every check held, 1 when one failed, 77 when the memory kind is unusable here.\n";

long stress_opt(int argc, char **argv, const char *name, long def) {
  for (int i = 0; i + 1 < argc; i++)
    if (strcmp(argv[i], name) == 0) return strtol(argv[i + 1], NULL, 10);
  return def;
}

int stress_mem_arg(int argc, char **argv, stress_mem *mem) {
  if (argc < 1 || stress_mem_parse(argv[0], mem) != 0) {
    fputs(usage, stderr);
    return -1;
  }
  return 0;
}

static int open_fd3(tshare_channel **ch) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "stress-role";
  tshare_error err;
  if (tshare_channel_open_socket(3, &o, ch, &err) != TSHARE_OK) {
    fprintf(stderr, "role: %s\n", err.message);
    return -1;
  }
  return 0;
}

typedef struct launched_lane {
  tshare_channel *ch;
  stress_mem mem;
  char seed[16];
  int rc;
} launched_lane;

static void *launched_producer_lane(void *arg) {
  launched_lane *l = arg;
  l->rc = stress_role_producer(l->ch, l->mem, l->seed);
  return NULL;
}

/* Roles under tshare-launch: channels from the environment; the producer
 * streams to every consumer, one thread per channel, until stopped. */
static int launched(const char *which, stress_mem mem) {
  tshare_role role;
  tshare_error err;
  if (tshare_role_from_env(&role, &err) != TSHARE_OK) {
    fprintf(stderr, "launched: %s\n", err.message);
    return 1;
  }
  launched_lane lanes[TSHARE_ROLE_CHANNELS_MAX];
  pthread_t threads[TSHARE_ROLE_CHANNELS_MAX];
  for (int i = 0; i < role.nchannels; i++) {
    if (tshare_role_open_channel(&role, i, NULL, &lanes[i].ch, &err) != TSHARE_OK) {
      fprintf(stderr, "launched: %s\n", err.message);
      return 1;
    }
    lanes[i].mem = mem;
    snprintf(lanes[i].seed, sizeof lanes[i].seed, "%d", role.rank * 100 + i + 1);
  }
  if (strcmp(which, "consumer") == 0) return stress_role_consumer(lanes[0].ch, mem, lanes[0].seed);
  for (int i = 0; i < role.nchannels; i++) pthread_create(&threads[i], NULL, launched_producer_lane, &lanes[i]);
  int rc = 0;
  for (int i = 0; i < role.nchannels; i++) {
    pthread_join(threads[i], NULL);
    rc |= lanes[i].rc;
  }
  return rc;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* Roles run this binary again, also under tshare-launch, where
   * /proc/self/exe would be the launcher. */
  static char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    stress_self = self;
  }
  if (argc < 2) {
    fputs(usage, stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if ((strcmp(cmd, "role") == 0 || strcmp(cmd, "launched") == 0) && argc >= 4) {
    stress_mem mem;
    if (stress_mem_parse(argv[3], &mem) != 0) return 2;
    if (mem == STRESS_CUDA) {
      char why[256];
      if (stress_mem_ready(mem, why, sizeof why) != 0) {
        fprintf(stderr, "role: %s\n", why);
        return 1;
      }
    }
    if (strcmp(cmd, "launched") == 0) return launched(argv[2], mem);
    tshare_channel *ch;
    if (open_fd3(&ch) != 0) return 1;
    const char *arg = argc >= 5 ? argv[4] : "1";
    int rc = strcmp(argv[2], "consumer") == 0 ? stress_role_consumer(ch, mem, arg) : stress_role_producer(ch, mem, arg);
    tshare_channel_close(ch);
    return rc;
  }
  if (strcmp(cmd, "kill-consumer") == 0) return stress_kill_consumer(argc - 2, argv + 2);
  if (strcmp(cmd, "kill-producer") == 0) return stress_kill_producer(argc - 2, argv + 2);
  if (strcmp(cmd, "sigstop") == 0) return stress_sigstop(argc - 2, argv + 2);
  if (strcmp(cmd, "sigint-launcher") == 0) return stress_sigint_launcher(argc - 2, argv + 2);
  if (strcmp(cmd, "load") == 0) return stress_load(argc - 2, argv + 2);
  fputs(usage, stderr);
  return 2;
}
