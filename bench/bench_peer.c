/* Baselines that run as other programs: torch.multiprocessing (python3) and
 * the LibTorch bridge's hand-off. Each prints "result p50_us=... p99_us=...
 * n=..." or "skip: why" (exit 77); their rows sit beside tshare's. */
#include "bench.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PEER_TIMEOUT_MS 300000

int bench_run_capture(char *const *argv, char *last, size_t cap, char *why, size_t why_cap) {
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) {
    snprintf(why, why_cap, "pipe: %s", strerror(errno));
    return -1;
  }
  tshare_fd_map fds[1] = {{1, out[1]}};
  tshare_spawn_options so = {.file = argv[0], .argv = argv, .fds = fds, .nfds = 1};
  tshare_process *p = NULL;
  tshare_error err;
  int rc = tshare_spawn(&so, &p, &err);
  close(out[1]);
  if (rc != TSHARE_OK) {
    close(out[0]);
    snprintf(why, why_cap, "%s", err.message);
    return -1;
  }
  char buf[8192];
  size_t len = 0;
  uint64_t deadline = bs_now_ns() + (uint64_t)PEER_TIMEOUT_MS * 1000000u;
  for (;;) {
    struct pollfd pfd = {.fd = out[0], .events = POLLIN, .revents = 0};
    uint64_t now = bs_now_ns();
    if (now >= deadline) break;
    int n = poll(&pfd, 1, (int)((deadline - now) / 1000000u) + 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (len == sizeof buf - 1) { /* keep the tail: the result line comes last */
      memmove(buf, buf + sizeof buf / 2, len - sizeof buf / 2);
      len -= sizeof buf / 2;
    }
    ssize_t r = read(out[0], buf + len, sizeof buf - 1 - len);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    len += (size_t)r;
  }
  close(out[0]);
  buf[len] = 0;
  while (len && buf[len - 1] == '\n') buf[--len] = 0;
  char *nl = strrchr(buf, '\n');
  bs_copy(last, cap, nl ? nl + 1 : buf);
  tshare_exit_status st;
  if (tshare_process_wait(p, 5000, &st) != TSHARE_OK) tshare_process_terminate(p, 1000, &st);
  tshare_process_destroy(p);
  if (st.kind == TSHARE_EXIT_CODE && st.value == 0 && strncmp(last, "result", 6) == 0) return 0;
  char how[64];
  if (strncmp(last, "skip: ", 6) == 0) snprintf(why, why_cap, "%s", last + 6);
  else snprintf(why, why_cap, "%s%s%s", tshare_exit_describe(st, how, sizeof how), *last ? ": " : "", last);
  return -1;
}

static void peer_row(bench *b, char *const *argv, const char *key, const char *label, const char *floor_key,
                     const char *peer_key) {
  char last[512], why[600];
  if (bench_run_capture(argv, last, sizeof last, why, sizeof why) != 0) {
    br_skip(&b->rep, BR_LATENCY, "latency", key, label, why);
    return;
  }
  br_row *row = br_add(&b->rep, BR_LATENCY, "latency", key, label, "us");
  row->value = bp_field(last, "p50_us");
  row->p99 = bp_field(last, "p99_us");
  row->n = (long)bp_field(last, "n");
  snprintf(row->floor_key, sizeof row->floor_key, "%s", floor_key);
  snprintf(row->peer_key, sizeof row->peer_key, "%s", peer_key ? peer_key : "");
  const char *torch = strstr(last, "torch=");
  if (torch) snprintf(row->note, sizeof row->note, "%s", torch);
}

/* An environment variable set for the programs run next, then put back. */
typedef struct saved_env {
  const char *name;
  int had;
  char value[256];
} saved_env;

static saved_env env_set(const char *name, const char *value) {
  saved_env s = {.name = name, .had = 0, .value = ""};
  const char *old = getenv(name);
  if (old) {
    s.had = 1;
    snprintf(s.value, sizeof s.value, "%s", old);
  }
  setenv(name, value, 1);
  return s;
}

static void env_restore(const saved_env *s) {
  if (s->had) setenv(s->name, s->value, 1);
  else unsetenv(s->name);
}

/* One before -> after figure of a pipelined bridge run, when it reported it. */
static void bridge_memory_row(bench *b, const char *line, const char *field, const char *key_prefix,
                              const char *key_suffix, const char *label, const char *unit, long n) {
  char before_f[64], after_f[64], key[96];
  snprintf(before_f, sizeof before_f, "%s_before", field);
  snprintf(after_f, sizeof after_f, "%s_after", field);
  double before = bp_field(line, before_f), after = bp_field(line, after_f);
  if (isnan(before) || isnan(after) || before < 0 || after < 0) return;
  snprintf(key, sizeof key, "%s_%s", key_prefix, key_suffix);
  bench_memory_row(b, key, label, before, after, unit)->n = n;
}

/* The bridge pipelined (64 in flight): shares/s, and the figures that must
 * not grow over the run (fds on both sides, the consumer's mappings, the
 * GPU's free memory). */
static void bridge_throughput_row(bench *b, const char *dev, long n, const char *key, const char *label,
                                  const char *what) {
  char count[32], last[512], why[600];
  snprintf(count, sizeof count, "%ld", n);
  char *argv[] = {(char *)b->opt.torch_bench, (char *)"--device", (char *)dev, (char *)"--pipelined", count, NULL};
  if (bench_run_capture(argv, last, sizeof last, why, sizeof why) != 0) {
    br_skip(&b->rep, BR_VALUE, "throughput", key, label, why);
    return;
  }
  br_row *row = br_add(&b->rep, BR_VALUE, "throughput", key, label, "shares/s");
  row->value = bp_field(last, "shares_per_s");
  row->n = (long)bp_field(last, "n");
  snprintf(row->note, sizeof row->note, "producer open fds %.0f -> %.0f over the run", bp_field(last, "fds_before"),
           bp_field(last, "fds_after"));
  char label_m[128], stem[32]; /* row keys hold 47 characters */
  snprintf(stem, sizeof stem, "bridge_%s", what);
  for (char *c = stem; *c; c++)
    if (*c == ' ') *c = '_';
  const struct {
    const char *field, *suffix, *label, *unit;
  } figures[] = {{"gpu_free", "gpu_free", "GPU memory free", "MiB"},
                 {"fds", "producer_fds", "producer open fds", ""},
                 {"consumer_fds", "consumer_fds", "consumer open fds", ""},
                 {"consumer_mappings", "consumer_mappings", "consumer GPU mappings open", ""}};
  for (size_t i = 0; i < sizeof figures / sizeof *figures; i++) {
    if (strcmp(what, "cpu") == 0 && strcmp(figures[i].field, "consumer_mappings") == 0) continue; /* host memory */
    snprintf(label_m, sizeof label_m, "bridge %s: %s", what, figures[i].label);
    bridge_memory_row(b, last, figures[i].field, stem, figures[i].suffix, label_m, figures[i].unit, n);
  }
}

bool bench_skipped_without_gpu(bench *b, int gpu, const char *key, const char *label) {
  if (!gpu || b->have_gpu) return false;
  char why[256];
  snprintf(why, sizeof why, "no GPU: %s", b->no_gpu_why);
  br_skip(&b->rep, BR_LATENCY, "latency", key, label, why);
  return true;
}

void bench_peers_external(bench *b) {
  char iters[32], warmup[32];
  snprintf(iters, sizeof iters, "%ld", b->opt.iters);
  snprintf(warmup, sizeof warmup, "%ld", b->opt.warmup);
  const char *devices[2] = {"cuda", "cpu"};
  for (int i = 0; i < 2; i++) {
    const char *dev = devices[i];
    int gpu = i == 0;
    char key[48], label[80], peer_key[48];
    snprintf(peer_key, sizeof peer_key, "torch_mp_%s", dev);
    snprintf(label, sizeof label, "torch.multiprocessing Queue, %s tensor (the peer)", dev);
    if (!bench_skipped_without_gpu(b, gpu, peer_key, label)) {
      char *argv[] = {(char *)b->opt.python, (char *)b->opt.peer_script, (char *)"--device", (char *)dev,
                      (char *)"--iters", iters, (char *)"--warmup", warmup, NULL};
      peer_row(b, argv, peer_key, label, gpu ? "floor" : "floor_fd", NULL);
    }
    snprintf(key, sizeof key, "tshare_python_%s", dev);
    snprintf(label, sizeof label, "tshare Python package, %s tensor", dev);
    if (!bench_skipped_without_gpu(b, gpu, key, label)) {
      char *argv[] = {(char *)b->opt.python, (char *)b->opt.py_script, (char *)"--device", (char *)dev,
                      (char *)"--iters", iters, (char *)"--warmup", warmup, NULL};
      peer_row(b, argv, key, label, gpu ? "floor" : "floor_fd", peer_key);
      if (gpu) { /* the caching allocator's other mode, as in the bridge's row below */
        saved_env conf = env_set("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True");
        peer_row(b, argv, "tshare_python_cuda_expandable", "tshare Python package, cuda tensor, expandable segments",
                 "floor", peer_key);
        env_restore(&conf);
      }
    }
    snprintf(key, sizeof key, "torch_bridge_%s", dev);
    snprintf(label, sizeof label, "tshare LibTorch bridge, %s tensor", dev);
    if (!b->opt.torch_bench) {
      br_skip(&b->rep, BR_LATENCY, "latency", key, label, "built without LibTorch");
    } else if (!bench_skipped_without_gpu(b, gpu, key, label)) {
      char *argv[] = {(char *)b->opt.torch_bench, (char *)"--device", (char *)dev, (char *)"--iters", iters,
                      (char *)"--warmup", warmup, NULL};
      /* Over the default transport (the ring), then the socket alone: the
       * program's channels pick theirs from TSHARE_TRANSPORT. */
      saved_env transport = env_set("TSHARE_TRANSPORT", "ring");
      snprintf(label, sizeof label, "tshare LibTorch bridge, %s tensor [ring]", dev);
      peer_row(b, argv, key, label, gpu ? "floor" : "floor_fd", peer_key);
      if (!gpu)
        bridge_throughput_row(b, dev, b->opt.pipelined, "torch_bridge_pipelined_cpu",
                              "bridge: cpu tensors/s to 1 consumer", "cpu");
      else /* the default caching allocator: segments kept mapped between hand-offs */
        bridge_throughput_row(b, dev, b->opt.memory_shares, "torch_bridge_pipelined_cuda",
                              "bridge: cuda tensors/s to 1 consumer, default allocator", "cuda");
      setenv("TSHARE_TRANSPORT", "socket", 1);
      snprintf(key, sizeof key, "torch_bridge_%s_socket", dev);
      snprintf(label, sizeof label, "tshare LibTorch bridge, %s tensor [socket]", dev);
      peer_row(b, argv, key, label, gpu ? "floor_socket" : "floor_fd_socket", peer_key);
      env_restore(&transport);
      if (gpu) { /* the caching allocator's expandable segments: VMM chunks as fds, kept mapped by the consumer */
        saved_env conf = env_set("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True");
        snprintf(key, sizeof key, "torch_bridge_%s_expandable", dev);
        snprintf(label, sizeof label, "tshare LibTorch bridge, %s tensor, expandable segments", dev);
        peer_row(b, argv, key, label, "floor", peer_key);
        bridge_throughput_row(b, dev, b->opt.memory_shares, "torch_bridge_pipelined_cuda_expandable",
                              "bridge: cuda tensors/s to 1 consumer, expandable segments", "cuda expandable");
        env_restore(&conf);
      }
    }
  }
}
