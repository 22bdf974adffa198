/* When a ring receive spins before it sleeps.
 *
 * A spinning receive answers in about half a microsecond, a sleeping one in
 * ~10 us (a futex wake-up). But spinning only pays while the peer runs on
 * another CPU at the same moment: where both share one CPU, or every CPU is
 * busy, the spin takes the CPU the peer needs to answer, and a hand-off costs
 * its whole budget (or a scheduler slice) instead of a wake-up. So a wait
 * spins only when all of these hold, and otherwise sleeps at once:
 *
 *  - this process may use two CPUs or more (its affinity mask, and the cgroup
 *    v2 cpu.max quota of its cgroup and every parent: read when a ring
 *    channel opens, cached process-wide);
 *  - the peer is awake: it has not said it sleeps on this ring's other
 *    direction (the reader_waits word it keeps in the ring we write, see
 *    ring.h), and it does not fall asleep while we spin;
 *  - recent spins caught frames: an adaptive budget, like glibc's adaptive
 *    mutexes. A catch moves it half way up to the maximum, a spin that ran
 *    out halves it, a spin that lost its CPU (a gap between two looks at the
 *    clock: the CPU is shared) drops it to zero. At zero, one wait in
 *    TS_SPIN_PROBE_EVERY spins a short probe, so a machine that quietens
 *    down gets its spinning back.
 *
 * TSHARE_SPIN_US / tshare_channel_options.spin_us stay an override: N >= 0
 * spins exactly N us on every wait (0: never), whatever the above says.
 *
 * The decisions are plain functions of their inputs so tests can inject
 * them; only ts_spin_cpus_milli() and ts_spin_refresh_cpus() read the
 * machine. */
#ifndef TSHARE_SPIN_POLICY_H
#define TSHARE_SPIN_POLICY_H

#include <stdbool.h>
#include <stdint.h>

#define TS_SPIN_MAX_NS 50000u       /* the adaptive budget's ceiling (and its start) */
#define TS_SPIN_FLOOR_NS 1000u      /* a budget halved below this is zero */
#define TS_SPIN_PROBE_EVERY 32u     /* at budget zero, one wait in this many probes */
#define TS_SPIN_PROBE_NS 5000u      /* how long a probe spins */
#define TS_SPIN_MIN_CPUS_MILLI 2000 /* fewer CPUs than two: never spin */
#define TS_SPIN_PREEMPTED_NS 20000u /* a gap this long between two looks at the clock: the spinner lost its CPU */

/* How a spin ended. */
enum { TS_SPIN_GOING = 0, TS_SPIN_CAUGHT, TS_SPIN_TIMED_OUT, TS_SPIN_PREEMPTED, TS_SPIN_PEER_SLEPT };

typedef struct ts_spin_policy {
  int64_t fixed_ns;     /* >= 0: the override, every wait spins this long; -1: adaptive */
  uint32_t budget_ns;   /* adaptive: the longest the next spin may last */
  uint32_t since_probe; /* adaptive, at budget zero: waits that slept at once since the last probe */
  uint64_t spins;       /* waits that spun (for tests and the bench) */
  uint64_t caught;      /* spins that caught a frame */
} ts_spin_policy;

/* spin_us < 0: adaptive; else the override in microseconds. */
void ts_spin_init(ts_spin_policy *p, long spin_us);
static inline bool ts_spin_adaptive(const ts_spin_policy *p) { return p->fixed_ns < 0; }

/* How long the wait about to begin spins (0: sleep at once), given the CPUs
 * this process may use (in thousandths; 0: not known, taken as plenty) and
 * whether the peer said it sleeps. Counts the wait toward a probe. */
uint32_t ts_spin_plan(ts_spin_policy *p, int cpus_milli, bool peer_asleep);
/* Whether a spin should end now (TS_SPIN_GOING: go on), spun_ns into it,
 * gap_ns since the previous look: its budget ran out, or (adaptive only)
 * the spinner was preempted, or the peer fell asleep. */
int ts_spin_should_stop(const ts_spin_policy *p, uint64_t spun_ns, uint64_t gap_ns, uint32_t budget_ns,
                        bool peer_asleep);
/* What the spin ended with (TS_SPIN_CAUGHT, ..._TIMED_OUT, ...): the adaptive
 * budget learns from it. */
void ts_spin_learn(ts_spin_policy *p, int outcome);

/* A cgroup v2 cpu.max text ("max 100000", "150000 100000") as thousandths
 * of a CPU; 0 for no limit or text that says nothing usable. */
int ts_spin_quota_milli(const char *cpu_max);
/* The tightest cpu.max quota on the way from this process's cgroup (named in
 * proc_cgroup, the text of /proc/self/cgroup: its "0::/path" line) up to the
 * root of the cgroup v2 tree mounted at fs_root; 0 when none limits it. */
int ts_spin_cgroup_milli(const char *fs_root, const char *proc_cgroup);
/* What the process may use: affinity_cpus CPUs, capped by a quota (0: none). */
int ts_spin_limit_milli(int affinity_cpus, int quota_milli);

/* The cached figure for this process (read on first use), and a fresh read
 * (sched_getaffinity, /proc/self/cgroup, /sys/fs/cgroup) into the cache. */
int ts_spin_cpus_milli(void);
void ts_spin_refresh_cpus(void);

uint64_t ts_spin_clock_ns(void); /* CLOCK_MONOTONIC in nanoseconds */

#endif
