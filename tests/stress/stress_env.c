/* Memory kinds, snapshots of what a process holds, and peer processes. */
#include "stress.h"

#include "bench_stats.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *stress_self = "/proc/self/exe";

const char *stress_mem_name(stress_mem mem) { return mem == STRESS_CUDA ? "cuda" : "host"; }

int stress_mem_parse(const char *text, stress_mem *out) {
  if (strcmp(text, "host") == 0) *out = STRESS_HOST;
  else if (strcmp(text, "cuda") == 0) *out = STRESS_CUDA;
  else return -1;
  return 0;
}

int stress_mem_ready(stress_mem mem, char *why, size_t cap) {
  if (mem == STRESS_HOST) return 0;
  tshare_error err;
  if (tshare_cuda_init(&err) != TSHARE_OK) {
    snprintf(why, cap, "no CUDA device: %s", err.message);
    return STRESS_SKIP;
  }
  stress_gpu_on = true;
  (void)stress_gpu_free_bytes(); /* makes the context now: its fds belong to every baseline */
  return 0;
}

uint32_t stress_rand(uint32_t *s) {
  uint32_t x = *s ? *s : 0x9e3779b9u;
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  return *s = x;
}

void stress_snapshot_take(stress_snapshot *s) {
  memset(s, 0, sizeof *s);
  s->fds = bs_open_fds();
  s->rss_kib = bs_rss_kib();
  s->gpu_free = stress_gpu_free_bytes();
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  s->cuda_events = st.events;
  s->mappings = st.imports + st.fd_imports - st.import_closes;
}

void stress_snapshot_print(FILE *out, const char *label, const stress_snapshot *s) {
  fprintf(out, "  %-22s fds %ld, rss %ld KiB", label, s->fds, s->rss_kib);
  if (s->gpu_free >= 0)
    fprintf(out, ", GPU free %lld MiB, CUDA events %llu, mappings %llu", s->gpu_free >> 20,
            (unsigned long long)s->cuda_events, (unsigned long long)s->mappings);
  fputc('\n', out);
}

int stress_peer_start(const char *role, stress_mem mem, const char *arg, stress_peer *out, char *why, size_t cap) {
  memset(out, 0, sizeof *out);
  int sv[2];
  tshare_error err;
  if (tshare_socketpair(sv, &err) != TSHARE_OK) {
    snprintf(why, cap, "%s", err.message);
    return -1;
  }
  char *argv[] = {(char *)stress_self, (char *)"role", (char *)role, (char *)stress_mem_name(mem), (char *)arg, NULL};
  tshare_fd_map fds[1] = {{3, sv[1]}};
  tshare_spawn_options so = {.file = stress_self, .argv = argv, .fds = fds, .nfds = 1};
  int rc = tshare_spawn(&so, &out->proc, &err);
  close(sv[1]);
  if (rc != TSHARE_OK) {
    close(sv[0]);
    snprintf(why, cap, "spawn: %s", err.message);
    return -1;
  }
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "stress";
  if (tshare_channel_open_socket(sv[0], &o, &out->ch, &err) != TSHARE_OK) {
    snprintf(why, cap, "channel: %s", err.message);
    tshare_process_destroy(out->proc);
    out->proc = NULL;
    return -1;
  }
  return 0;
}

int stress_peer_wait(stress_peer *p, int timeout_ms) {
  tshare_exit_status st;
  int code;
  if (tshare_process_wait(p->proc, timeout_ms, &st) != TSHARE_OK) {
    tshare_process_terminate(p->proc, 500, &st);
    code = -1;
  } else {
    code = st.kind == TSHARE_EXIT_CODE ? st.value : 128 + st.value;
  }
  tshare_process_destroy(p->proc);
  p->proc = NULL;
  return code;
}
