/* The ring's waiting policy: see spin_policy.h for when a wait spins and why. */
#include "spin_policy.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void ts_spin_init(ts_spin_policy *p, long spin_us) {
  memset(p, 0, sizeof *p);
  p->fixed_ns = spin_us < 0 ? -1 : (int64_t)spin_us * 1000;
  p->budget_ns = TS_SPIN_MAX_NS; /* an idle machine is fast from the first hand-off */
}

/* At budget zero: one wait in TS_SPIN_PROBE_EVERY spins briefly, so the
 * budget can grow again once spins catch frames. */
static uint32_t probe_or_sleep(ts_spin_policy *p) {
  if (++p->since_probe < TS_SPIN_PROBE_EVERY) return 0;
  p->since_probe = 0;
  return TS_SPIN_PROBE_NS;
}

uint32_t ts_spin_plan(ts_spin_policy *p, int cpus_milli, bool peer_asleep) {
  uint32_t budget;
  if (!ts_spin_adaptive(p))
    budget = (uint32_t)(p->fixed_ns > UINT32_MAX ? UINT32_MAX : p->fixed_ns);
  else if (cpus_milli > 0 && cpus_milli < TS_SPIN_MIN_CPUS_MILLI)
    budget = 0; /* the peer needs our CPU */
  else if (peer_asleep)
    budget = 0; /* it waits for us */
  else
    budget = p->budget_ns > 0 ? p->budget_ns : probe_or_sleep(p);
  if (budget > 0) p->spins++;
  return budget;
}

int ts_spin_should_stop(const ts_spin_policy *p, uint64_t spun_ns, uint64_t gap_ns, uint32_t budget_ns,
                        bool peer_asleep) {
  if (spun_ns >= budget_ns) return TS_SPIN_TIMED_OUT;
  if (!ts_spin_adaptive(p)) return TS_SPIN_GOING; /* the override spins its budget, as asked */
  if (gap_ns >= TS_SPIN_PREEMPTED_NS) return TS_SPIN_PREEMPTED;
  if (peer_asleep) return TS_SPIN_PEER_SLEPT;
  return TS_SPIN_GOING;
}

void ts_spin_learn(ts_spin_policy *p, int outcome) {
  if (outcome == TS_SPIN_CAUGHT) p->caught++;
  if (!ts_spin_adaptive(p)) return;
  switch (outcome) {
  case TS_SPIN_CAUGHT:
    p->budget_ns += (TS_SPIN_MAX_NS - p->budget_ns + 1) / 2;
    break;
  case TS_SPIN_TIMED_OUT:
    p->budget_ns /= 2;
    if (p->budget_ns < TS_SPIN_FLOOR_NS) p->budget_ns = 0;
    break;
  case TS_SPIN_PREEMPTED: /* the CPU is shared: every spin takes the peer's turn */
    p->budget_ns = 0;
    break;
  default: /* the peer fell asleep: it waits for us, no fault of the budget */
    break;
  }
  if (p->budget_ns > 0) p->since_probe = 0;
}

int ts_spin_quota_milli(const char *cpu_max) {
  char quota[32];
  long long period = 0;
  if (sscanf(cpu_max, "%31s %lld", quota, &period) != 2 || period <= 0 || strcmp(quota, "max") == 0) return 0;
  char *end;
  long long q = strtoll(quota, &end, 10);
  if (*end != '\0' || q <= 0) return 0;
  long long milli = q * 1000 / period;
  return milli < 1 ? 1 : milli > 1000000000 ? 1000000000 : (int)milli;
}

/* The tightest of two limits, 0 meaning none. */
static int tighter(int a, int b) { return a == 0 ? b : b == 0 ? a : a < b ? a : b; }

/* This process's cgroup v2 path ("/a/b"), from the "0::" line; false if none. */
static bool cgroup_v2_path(const char *proc_cgroup, char *path, size_t cap) {
  for (const char *line = proc_cgroup; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
    if (strncmp(line, "0::", 3) != 0) continue;
    size_t n = strcspn(line + 3, "\n");
    if (n == 0 || n >= cap || line[3] != '/') return false;
    memcpy(path, line + 3, n);
    path[n] = '\0';
    return true;
  }
  return false;
}

static int quota_at(const char *fs_root, const char *dir) {
  char file[4096], text[128];
  if (snprintf(file, sizeof file, "%s%s/cpu.max", fs_root, dir) >= (int)sizeof file) return 0;
  FILE *f = fopen(file, "re");
  if (!f) return 0; /* the root has no cpu.max; a controller not enabled neither */
  int milli = fgets(text, sizeof text, f) ? ts_spin_quota_milli(text) : 0;
  fclose(f);
  return milli;
}

int ts_spin_cgroup_milli(const char *fs_root, const char *proc_cgroup) {
  char path[4096];
  if (!cgroup_v2_path(proc_cgroup, path, sizeof path)) return 0;
  int limit = 0;
  for (;;) { /* a parent's quota caps every child's */
    limit = tighter(limit, quota_at(fs_root, path));
    char *slash = strrchr(path, '/');
    if (!slash || slash == path) break;
    *slash = '\0';
  }
  return tighter(limit, quota_at(fs_root, ""));
}

int ts_spin_limit_milli(int affinity_cpus, int quota_milli) {
  int milli = affinity_cpus > 0 ? (affinity_cpus > 1000000 ? 1000000000 : affinity_cpus * 1000) : 0;
  return tighter(milli, quota_milli);
}

static int affinity_cpus(void) {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
}

static int read_proc_cgroup_limit(void) {
  char text[8192];
  FILE *f = fopen("/proc/self/cgroup", "re");
  if (!f) return 0;
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  return ts_spin_cgroup_milli("/sys/fs/cgroup", text);
}

/* Process-wide: facts about the machine, not state of a channel. 0: not read. */
static _Atomic int cached_cpus_milli;

void ts_spin_refresh_cpus(void) {
  int milli = ts_spin_limit_milli(affinity_cpus(), read_proc_cgroup_limit());
  atomic_store_explicit(&cached_cpus_milli, milli > 0 ? milli : -1, memory_order_relaxed);
}

int ts_spin_cpus_milli(void) {
  int milli = atomic_load_explicit(&cached_cpus_milli, memory_order_relaxed);
  if (milli == 0) {
    ts_spin_refresh_cpus();
    milli = atomic_load_explicit(&cached_cpus_milli, memory_order_relaxed);
  }
  return milli < 0 ? 0 : milli; /* -1: read, nothing known */
}

uint64_t ts_spin_clock_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
