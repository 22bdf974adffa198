/* Hand-offs where CPUs are scarce: the producer and its consumer pinned to
 * one CPU, and a busy loop on every CPU this process may use. Each is
 * measured over the default transport (the ring, its waiting policy as a
 * user gets it) and over the socket in the same run, so the target can say
 * whether the default is ever slower than the socket. */
#include "bench.h"

#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct scene {
  const char *key, *label;
  cpu_set_t saved; /* the producer's affinity before the scene */
  pid_t busy[CPU_SETSIZE];
  int nbusy;
} scene;

static void pin_to_first_cpu(scene *s) {
  cpu_set_t one;
  CPU_ZERO(&one);
  for (unsigned cpu = 0; cpu < (unsigned)CPU_SETSIZE; cpu++)
    if (CPU_ISSET(cpu, &s->saved)) {
      CPU_SET(cpu, &one);
      break;
    }
  if (sched_setaffinity(0, sizeof one, &one) != 0) perror("tshare-bench: sched_setaffinity");
}

/* One child per CPU of the mask, pinned there, spinning until killed. */
static void start_busy_loops(scene *s) {
  for (unsigned cpu = 0; cpu < (unsigned)CPU_SETSIZE; cpu++) {
    if (!CPU_ISSET(cpu, &s->saved)) continue;
    pid_t pid = fork();
    if (pid == 0) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      (void)sched_setaffinity(0, sizeof one, &one);
      for (volatile unsigned long n = 0;; n++) {
      }
    }
    if (pid > 0) s->busy[s->nbusy++] = pid;
  }
}

static void scene_begin(scene *s, int busy) {
  s->nbusy = 0;
  sched_getaffinity(0, sizeof s->saved, &s->saved);
  if (busy)
    start_busy_loops(s);
  else
    pin_to_first_cpu(s); /* the consumers spawned next inherit it */
}

static void scene_end(scene *s) {
  for (int i = 0; i < s->nbusy; i++) kill(s->busy[i], SIGKILL);
  for (int i = 0; i < s->nbusy; i++) waitpid(s->busy[i], NULL, 0);
  s->nbusy = 0;
  sched_setaffinity(0, sizeof s->saved, &s->saved);
}

/* The frame round trip and the host hand-off over one transport, with one
 * consumer started inside the scene. */
static void scene_rows(bench *b, scene *s, const char *transport) {
  char why[512];
  snprintf(b->rep.key_suffix, sizeof b->rep.key_suffix, "_%s_%s", s->key, transport);
  snprintf(b->rep.label_suffix, sizeof b->rep.label_suffix, " [%s, %s]", s->label, transport);
  if (bp_start(&b->peers[0], "/proc/self/exe", 0, transport, -1, why, sizeof why) != 0) {
    br_skip(&b->rep, BR_LATENCY, "latency", "floor", "floor: frame round trip, a CUDA share's size", why);
    return;
  }
  b->npeers = 1;
  bench_host_handoffs(b, 0);
  bp_stop(&b->peers[0]);
  b->npeers = 0;
}

/* The default transport against the socket, row by row, in one scene. */
static void scene_target(bench *b, const scene *s) {
  static const char *rows[] = {"floor", "floor_fd", "host_reused"};
  char text[120], measured[160] = "";
  int met = 1, measured_rows = 0;
  for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
    char rk[64], sk[64];
    snprintf(rk, sizeof rk, "%s_%s_ring", rows[i], s->key);
    snprintf(sk, sizeof sk, "%s_%s_socket", rows[i], s->key);
    br_row *r = br_find(&b->rep, rk), *k = br_find(&b->rep, sk);
    if (!r || !k) continue;
    measured_rows++;
    met = met && r->value <= 1.1 * k->value && r->p99 <= 2 * k->p99;
    size_t used = strlen(measured);
    snprintf(measured + used, sizeof measured - used, "%s%s p50 %.1f/%.1f, p99 %.1f/%.1f us", used ? "; " : "", rows[i],
             r->value, k->value, r->p99, k->p99);
  }
  snprintf(text, sizeof text, "%s: default p50 <= 1.1x socket, p99 <= 2x (ring/socket)", s->label);
  if (measured_rows == 0)
    br_target_add(&b->rep, text, -1, "not measured");
  else
    br_target_add(&b->rep, text, met, "%s", measured);
}

void bench_contention(bench *b) {
  scene scenes[] = {{.key = "pinned", .label = "one CPU"}, {.key = "busy", .label = "all CPUs busy"}};
  for (size_t i = 0; i < sizeof scenes / sizeof *scenes; i++) {
    scene *s = &scenes[i];
    scene_begin(s, strcmp(s->key, "busy") == 0);
    scene_rows(b, s, "ring");
    scene_rows(b, s, "socket");
    scene_end(s);
  }
  b->rep.key_suffix[0] = b->rep.label_suffix[0] = '\0';
  for (size_t i = 0; i < sizeof scenes / sizeof *scenes; i++) scene_target(b, &scenes[i]);
}
