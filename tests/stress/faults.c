/* Fault trials: a consumer killed at random points, a producer killed under
 * its consumer, a stopped consumer, SIGINT to the launcher. */
#include "stress.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define GPU_SETTLE_MS 5000      /* a dead process's GPU memory comes back on the driver's time */
#define GPU_SLACK (4ll << 20)   /* what free GPU memory may differ by between two looks */
#define RSS_GROWTH_MAX_KIB 8192 /* allocator noise a trial may leave, far below one trial's traffic */

static int64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Wait for free GPU memory to come back to at least base (minus slack). */
static long long gpu_settle(long long base) {
  long long now = stress_gpu_free_bytes();
  for (int64_t t0 = now_ms(); base >= 0 && now + GPU_SLACK < base && now_ms() - t0 < GPU_SETTLE_MS;) {
    usleep(20 * 1000);
    now = stress_gpu_free_bytes();
  }
  return now;
}

/* ---- kill -9 the consumer ------------------------------------------------ */

/* One trial: stream `shares` shares, SIGKILL the consumer after share
 * kill_at, go on until the channel says the peer is gone, then check that
 * every share came back. */
static int consumer_trial(stress_mem mem, int shares, int kill_at, uint32_t seed, int *sent_out) {
  char why[256], arg[32];
  snprintf(arg, sizeof arg, "%u", seed);
  stress_peer p;
  if (stress_peer_start("consumer", mem, arg, &p, why, sizeof why) != 0) {
    fprintf(stderr, "  %s\n", why);
    return -1;
  }
  stress_source *s = stress_source_create(mem, seed, why, sizeof why);
  if (!s) {
    fprintf(stderr, "  %s\n", why);
    return -1;
  }
  int rc = TSHARE_OK, sent = 0;
  for (int i = 0; i < shares && rc == TSHARE_OK; i++) {
    if (i == kill_at) tshare_process_signal(p.proc, SIGKILL);
    rc = stress_source_share(s, p.ch, (uint64_t)i, true, STRESS_TIMEOUT_MS);
    if (rc == TSHARE_OK) sent++;
  }
  int ok = 0;
  if (rc != TSHARE_OK && rc != TSHARE_E_PEER_CLOSED) {
    fprintf(stderr, "  share after the kill: %s: %s\n", tshare_status_name(rc), tshare_channel_last_error(p.ch));
    ok = -1;
  }
  /* Everything the dead consumer held is dropped once the channel sees EOF. */
  rc = tshare_channel_wait_released(p.ch, 0, STRESS_TIMEOUT_MS);
  if (rc != TSHARE_OK || tshare_channel_outstanding(p.ch) != 0) {
    fprintf(stderr, "  after the kill: %s, %zu shares still outstanding\n", tshare_status_name(rc),
            tshare_channel_outstanding(p.ch));
    ok = -1;
  }
  tshare_channel_close(p.ch);
  stress_source_destroy(s);
  int code = stress_peer_wait(&p, STRESS_TIMEOUT_MS);
  if (code != 128 + SIGKILL) {
    fprintf(stderr, "  the consumer ended with %d, not SIGKILL\n", code);
    ok = -1;
  }
  *sent_out = sent;
  return ok;
}

int stress_kill_consumer(int argc, char **argv) {
  stress_mem mem;
  if (stress_mem_arg(argc, argv, &mem) != 0) return 2;
  int trials = (int)stress_opt(argc, argv, "--trials", 100), shares = (int)stress_opt(argc, argv, "--shares", 10000);
  uint32_t seed = (uint32_t)stress_opt(argc, argv, "--seed", (long)time(NULL));
  char why[256];
  if (stress_mem_ready(mem, why, sizeof why) != 0) {
    printf("SKIP: %s\n", why);
    return STRESS_SKIP;
  }
  printf("kill -9 the consumer (%s memory): %d trials of a %d-share stream, seed %u\n", stress_mem_name(mem), trials,
         shares, seed);
  stress_snapshot base, after, worst;
  memset(&base, 0, sizeof base);
  after = worst = base;
  int clean = 0, min_at = shares, max_at = 0;
  long rss_growth = 0;
  long long gpu_worst = 0;
  uint32_t rng = seed | 1;
  /* Trial 0 warms up (first-time allocations: the CUDA context, allocator
   * arenas) and sets the baseline every later trial must come back to. */
  for (int t = 0; t <= trials; t++) {
    int kill_at = (int)(stress_rand(&rng) % (uint32_t)shares), sent = 0;
    int rc = consumer_trial(mem, shares, kill_at, stress_rand(&rng), &sent);
    if (t == 0) {
      if (rc != 0) return 1;
      base.gpu_free = stress_gpu_free_bytes();
      base.gpu_free = gpu_settle(base.gpu_free); /* the warm-up consumer's memory too */
      stress_snapshot_take(&base);
      worst = base;
      stress_snapshot_print(stdout, "baseline (after warm-up)", &base);
      continue;
    }
    stress_snapshot_take(&after);
    after.gpu_free = gpu_settle(base.gpu_free);
    bool back = after.fds == base.fds && after.cuda_events == base.cuda_events && after.mappings == base.mappings &&
                (base.gpu_free < 0 || after.gpu_free + GPU_SLACK >= base.gpu_free) &&
                after.rss_kib - base.rss_kib <= RSS_GROWTH_MAX_KIB;
    if (after.rss_kib - base.rss_kib > rss_growth) rss_growth = after.rss_kib - base.rss_kib;
    if (base.gpu_free >= 0 && base.gpu_free - after.gpu_free > gpu_worst) gpu_worst = base.gpu_free - after.gpu_free;
    if (after.fds > worst.fds) worst.fds = after.fds;
    if (rc == 0 && back) clean++;
    else {
      printf("  trial %d (killed after share %d, %d sent): %s\n", t, kill_at, sent,
             rc ? "the producer did not get everything back" : "memory not back at the baseline");
      stress_snapshot_print(stdout, "after the trial", &after);
    }
    if (kill_at < min_at) min_at = kill_at;
    if (kill_at > max_at) max_at = kill_at;
  }
  stress_snapshot_print(stdout, "after the last trial", &after);
  printf("kill-consumer %s: %d of %d trials clean (kill points %d..%d); every share came back; fds at most %ld "
         "(baseline %ld), RSS at most +%ld KiB",
         stress_mem_name(mem), clean, trials, min_at, max_at, worst.fds, base.fds, rss_growth);
  if (base.gpu_free >= 0) printf(", GPU free at most %lld KiB under the baseline", gpu_worst >> 10);
  printf("\n");
  return clean == trials ? 0 : 1;
}

/* ---- kill -9 the producer ------------------------------------------------ */

int stress_kill_producer(int argc, char **argv) {
  stress_mem mem;
  if (stress_mem_arg(argc, argv, &mem) != 0) return 2;
  int trials = (int)stress_opt(argc, argv, "--trials", 20);
  uint32_t seed = (uint32_t)stress_opt(argc, argv, "--seed", (long)time(NULL)), rng = seed | 1;
  char why[256];
  if (stress_mem_ready(mem, why, sizeof why) != 0) {
    printf("SKIP: %s\n", why);
    return STRESS_SKIP;
  }
  printf("kill -9 the producer (%s memory): %d trials, seed %u\n", stress_mem_name(mem), trials, seed);
  int clean = 0;
  int64_t worst_ms = 0;
  unsigned long long held_total = 0, held_bad = 0;
  for (int t = 0; t < trials; t++) {
    char arg[32];
    snprintf(arg, sizeof arg, "%u", stress_rand(&rng));
    stress_peer p;
    if (stress_peer_start("producer", mem, arg, &p, why, sizeof why) != 0) {
      fprintf(stderr, "  %s\n", why);
      return 1;
    }
    int kill_after = 1 + (int)(stress_rand(&rng) % 3000), got = 0, rc = TSHARE_OK;
    tshare_view *held[32];
    int nheld = 0;
    int64_t killed_at = 0;
    for (;;) {
      tshare_view *v;
      rc = tshare_view_recv(p.ch, STRESS_TIMEOUT_MS, &v);
      if (rc != TSHARE_OK) break;
      if (nheld < 32 && stress_rand(&rng) % 64 == 0) held[nheld++] = v; /* kept across the producer's death */
      else tshare_view_release(v);
      if (++got == kill_after) {
        tshare_process_signal(p.proc, SIGKILL);
        killed_at = now_ms();
      }
    }
    int64_t took = now_ms() - killed_at;
    /* Views held when the producer died: host memory stays mapped (the
     * memfd lives while mapped), VMM memory stays too (the mapping holds
     * it); their contents must still be what was shared. */
    unsigned long long bad = 0;
    bool readable = mem == STRESS_HOST || tshare_cuda_fd_handles_supported(0) == 1; /* legacy: undefined */
    for (int i = 0; i < nheld; i++) {
      long long b = readable ? stress_view_bad(mem, held[i]) : 0;
      bad += b < 0 ? 1 : (unsigned long long)b;
      tshare_view_release(held[i]);
    }
    held_total += (unsigned long long)nheld;
    held_bad += bad;
    tshare_channel_close(p.ch);
    int code = stress_peer_wait(&p, STRESS_TIMEOUT_MS);
    bool ok = rc == TSHARE_E_PEER_CLOSED && killed_at && code == 128 + SIGKILL && bad == 0;
    if (took > worst_ms) worst_ms = took;
    if (ok) clean++;
    else
      printf("  trial %d: after %d views: %s, producer ended %d, %llu wrong in held views\n", t, got,
             tshare_status_name(rc), code, bad);
  }
  printf("kill-producer %s: %d of %d trials clean: the consumer got TSHARE_E_PEER_CLOSED at most %lld ms after the "
         "kill, no hang; %llu views held across the producer's death, %llu elements wrong\n",
         stress_mem_name(mem), clean, trials, (long long)worst_ms, held_total, held_bad);
  return clean == trials ? 0 : 1;
}

/* ---- SIGSTOP the consumer ------------------------------------------------ */

int stress_sigstop(int argc, char **argv) {
  stress_mem mem;
  if (stress_mem_arg(argc, argv, &mem) != 0) return 2;
  int stop_ms = (int)stress_opt(argc, argv, "--stop-ms", 2000);
  char why[256];
  if (stress_mem_ready(mem, why, sizeof why) != 0) {
    printf("SKIP: %s\n", why);
    return STRESS_SKIP;
  }
  stress_peer p;
  if (stress_peer_start("consumer", mem, "7", &p, why, sizeof why) != 0) {
    fprintf(stderr, "%s\n", why);
    return 1;
  }
  stress_source *s = stress_source_create(mem, 7, why, sizeof why);
  if (!s) return 1;
  uint64_t seq = 0;
  int rc = TSHARE_OK;
  for (; seq < 2000 && rc == TSHARE_OK; seq++) rc = stress_source_share(s, p.ch, seq, false, STRESS_TIMEOUT_MS);
  stress_snapshot before, during;
  stress_snapshot_take(&before);
  tshare_process_signal(p.proc, SIGSTOP);
  /* Share without any window of our own: only the channel pushes back. */
  int64_t t0 = now_ms();
  unsigned long accepted = 0, timeouts = 0;
  size_t peak = 0;
  while (now_ms() - t0 < stop_ms) {
    rc = stress_source_share(s, p.ch, seq++, false, 50);
    if (rc == TSHARE_OK) accepted++;
    else if (rc == TSHARE_E_TIMEOUT) timeouts++;
    else break;
    if (tshare_channel_outstanding(p.ch) > peak) peak = tshare_channel_outstanding(p.ch);
  }
  stress_snapshot_take(&during);
  int stop_rc = rc;
  const char *stop_err = tshare_channel_last_error(p.ch);
  printf("SIGSTOP the consumer (%s memory) for %d ms: %lu shares accepted, then sends timed out (%lu timeouts of "
         "50 ms); outstanding at most %zu; last error: %s\n",
         stress_mem_name(mem), stop_ms, accepted, timeouts, peak, timeouts ? stop_err : "none");
  stress_snapshot_print(stdout, "before the stop", &before);
  stress_snapshot_print(stdout, "after the stop", &during);
  tshare_process_signal(p.proc, SIGCONT);
  /* A send that timed out mid-frame left its end for later: the stream
   * must resume, the consumer see every share, and every share come back. */
  bool usable = stop_rc == TSHARE_OK || stop_rc == TSHARE_E_TIMEOUT;
  if (usable) usable = tshare_channel_send_bye(p.ch, 0, STRESS_TIMEOUT_MS) == TSHARE_OK;
  if (usable) rc = tshare_channel_wait_released(p.ch, 0, STRESS_TIMEOUT_MS);
  size_t left = tshare_channel_outstanding(p.ch);
  tshare_channel_close(p.ch);
  stress_source_destroy(s);
  int code = stress_peer_wait(&p, STRESS_TIMEOUT_MS);
  stress_snapshot end;
  stress_snapshot_take(&end);
  stress_snapshot_print(stdout, "after SIGCONT and bye", &end);
  printf("after SIGCONT: %s, %zu outstanding, consumer exit %d\n", usable ? "stream resumed and ended" : "stream cut",
         left, code);
  bool bounded = timeouts > 0 && peak < 100000 && during.fds - before.fds < 4096 &&
                 during.rss_kib - before.rss_kib < 256 * 1024;
  return bounded && usable && rc == TSHARE_OK && left == 0 && code == 0 ? 0 : 1;
}

/* ---- SIGINT to the launcher ---------------------------------------------- */

static int children_of(pid_t parent, pid_t *out, int cap) {
  DIR *d = opendir("/proc");
  int n = 0;
  if (!d) return 0;
  for (struct dirent *e; (e = readdir(d));) {
    char path[300], buf[512];
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    snprintf(path, sizeof path, "/proc/%.255s/stat", e->d_name);
    FILE *f = fopen(path, "re");
    if (!f) continue;
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = '\0';
    char *close_paren = strrchr(buf, ')');
    char state;
    int ppid;
    if (close_paren && sscanf(close_paren + 1, " %c %d", &state, &ppid) == 2 && ppid == parent && state != 'Z' &&
        n < cap)
      out[n++] = (pid_t)atoi(e->d_name);
  }
  closedir(d);
  return n;
}

int stress_sigint_launcher(int argc, char **argv) {
  stress_mem mem;
  if (stress_mem_arg(argc, argv, &mem) != 0) return 2;
  int trials = (int)stress_opt(argc, argv, "--trials", 10);
  const char *launcher = getenv("TSHARE_LAUNCH");
  char why[256];
  if (!launcher || access(launcher, X_OK) != 0) {
    printf("sigint-launcher needs TSHARE_LAUNCH=path/to/tshare-launch\n");
    return 2;
  }
  if (stress_mem_ready(mem, why, sizeof why) != 0) {
    printf("SKIP: %s\n", why);
    return STRESS_SKIP;
  }
  /* Orphans come to us, not to init: a role the launcher leaves behind is
   * then our child, and seen. */
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  uint32_t rng = 12345;
  int clean = 0;
  int64_t worst_ms = 0;
  for (int t = 0; t < trials; t++) {
    char producer[512], consumer[512];
    snprintf(producer, sizeof producer, "%s launched producer %s", stress_self, stress_mem_name(mem));
    snprintf(consumer, sizeof consumer, "%s launched consumer %s", stress_self, stress_mem_name(mem));
    char *args[] = {(char *)launcher, "--producer", producer, "--consumer", consumer, "--consumers", "2", "--grace",
                    "2", NULL};
    tshare_process *lp;
    tshare_error err;
    int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
    tshare_fd_map quiet[2] = {{1, devnull}, {2, devnull}};
    tshare_spawn_options so = {.file = launcher, .argv = args, .fds = quiet, .nfds = 2};
    if (tshare_spawn(&so, &lp, &err) != TSHARE_OK) {
      fprintf(stderr, "%s\n", err.message);
      return 1;
    }
    close(devnull);
    usleep((300 + stress_rand(&rng) % 700) * 1000u); /* mid-stream */
    pid_t roles[16];
    int nroles = children_of(tshare_process_pid(lp), roles, 16);
    int64_t t0 = now_ms();
    tshare_process_signal(lp, SIGINT);
    tshare_exit_status st;
    int wrc = tshare_process_wait(lp, STRESS_TIMEOUT_MS, &st);
    int64_t took = now_ms() - t0;
    if (wrc != TSHARE_OK) tshare_process_terminate(lp, 100, &st);
    tshare_process_destroy(lp);
    usleep(100 * 1000);
    pid_t left[16];
    int nleft = children_of(getpid(), left, 16);
    for (int i = 0; i < nleft; i++) kill(left[i], SIGKILL);
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    bool ok = wrc == TSHARE_OK && nroles == 3 && nleft == 0 && st.kind == TSHARE_EXIT_CODE &&
              st.value == 128 + SIGINT;
    if (took > worst_ms) worst_ms = took;
    if (ok) clean++;
    else
      printf("  trial %d: %d roles seen, launcher %s %d after %lld ms, %d processes left behind\n", t, nroles,
             st.kind == TSHARE_EXIT_CODE ? "exited" : "signal", st.value, (long long)took, nleft);
  }
  printf("sigint-launcher %s: %d of %d trials clean: every role stopped, none left behind, the launcher exited %d "
         "at most %lld ms after SIGINT\n",
         stress_mem_name(mem), clean, trials, 128 + SIGINT, (long long)worst_ms);
  return clean == trials ? 0 : 1;
}
