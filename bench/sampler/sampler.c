/* A sampling profiler to preload into a process where perf is not
 * available (the GPU machine has none): every SAMPLE_US microseconds of
 * the process's CPU time, or of the wall clock with SAMPLE_WALL=1 (where a
 * process waits too: in the driver, on a futex), the main thread's
 * backtrace is written raw to $SAMPLE_DIR/s.PID, and the process's mappings
 * to $SAMPLE_DIR/m.PID, for report.py to name.
 *
 *   env SAMPLE_DIR=/tmp/s [SAMPLE_WALL=1] [SAMPLE_US=100] \
 *       LD_PRELOAD=build/bench/libtshare_sampler.so PROGRAM ...
 *   bench/sampler/report.py /tmp/s [--focus FUNCTION]
 *
 * Preload it into the program itself, not into a wrapper such as timeout:
 * a wrapper's exec keeps a CPU timer running with the handler gone, and the
 * first tick kills it. A forked child samples itself into its own files.
 * Everything done in the signal handler is async-signal-safe: backtrace()
 * (its library loaded before the first signal), write, open, read. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* gettid, SIGEV_THREAD_ID: built by hand too (cc -shared -fPIC sampler.c -lrt) */
#endif
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

enum { FRAMES = 64, MAPS_EVERY = 256 };

static int samples_fd = -1;
static char maps_path[512];
static unsigned long taken;

/* The mappings, again now and then: libraries loaded late (the CUDA driver
 * at its first use) are named too. */
static void copy_maps(void) {
  int in = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  int out = open(maps_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  char buf[8192];
  ssize_t n;
  while (in >= 0 && out >= 0 && (n = read(in, buf, sizeof buf)) > 0)
    if (write(out, buf, (size_t)n) != n) break;
  if (in >= 0) close(in);
  if (out >= 0) close(out);
}

/* One sample: the frame count, then the return addresses. */
static void on_tick(int sig) {
  (void)sig;
  int saved = errno;
  void *frames[FRAMES];
  int n = backtrace(frames, FRAMES);
  if (samples_fd >= 0 && write(samples_fd, &n, sizeof n) == (ssize_t)sizeof n)
    (void)!write(samples_fd, frames, sizeof(void *) * (size_t)n);
  if (taken++ % MAPS_EVERY == 0) copy_maps();
  errno = saved;
}

static void start(void) {
  const char *dir = getenv("SAMPLE_DIR");
  if (!dir) return;
  char path[512];
  snprintf(path, sizeof path, "%s/s.%d", dir, (int)getpid());
  snprintf(maps_path, sizeof maps_path, "%s/m.%d", dir, (int)getpid());
  if (samples_fd >= 0) close(samples_fd); /* a forked child's copy of its parent's */
  samples_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (samples_fd < 0) {
    fprintf(stderr, "sampler: %s: %s\n", path, strerror(errno));
    return;
  }
  taken = 0;
  copy_maps();
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_tick;
  sa.sa_flags = SA_RESTART;
  sigaction(SIGPROF, &sa, NULL);
  long us = getenv("SAMPLE_US") ? atol(getenv("SAMPLE_US")) : 100;
  if (us < 10) us = 10;
  if (getenv("SAMPLE_WALL")) { /* this thread alone, on the wall clock (timers are not inherited by fork) */
    timer_t timer;
    struct sigevent ev;
    memset(&ev, 0, sizeof ev);
    ev.sigev_notify = SIGEV_THREAD_ID;
    ev._sigev_un._tid = gettid();
    ev.sigev_signo = SIGPROF;
    struct itimerspec every = {{us / 1000000, (us % 1000000) * 1000}, {us / 1000000, (us % 1000000) * 1000}};
    if (timer_create(CLOCK_MONOTONIC, &ev, &timer) == 0) timer_settime(timer, 0, &every, NULL);
  } else { /* the process's CPU time, whichever thread spends it */
    struct itimerval every = {{us / 1000000, us % 1000000}, {us / 1000000, us % 1000000}};
    setitimer(ITIMER_PROF, &every, NULL);
  }
}

__attribute__((constructor)) static void sampler_start(void) {
  void *warm[4];
  backtrace(warm, 4); /* loads the unwinder now, not in the first signal */
  start();
  pthread_atfork(NULL, NULL, start);
}

__attribute__((destructor)) static void sampler_end(void) {
  if (samples_fd >= 0) copy_maps();
}
