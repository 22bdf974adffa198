/* When a ring receive spins: the policy's decisions with injected inputs
 * (CPUs available, cgroup cpu.max text, whether the peer sleeps, how recent
 * spins ended), and real ring channels whose receives must not spin where
 * spinning cannot pay (one CPU, a peer asleep in its own receive) and must
 * cost next to nothing while nothing comes. */
#include "session.h"
#include "harness.h"
#include "proc_util.h"
#include "spin_policy.h"
#include "transport_ring.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>

/* ---- the policy's decisions ------------------------------------------------- */

TS_TEST(fewer_than_two_cpus_means_sleeping_at_once) {
  ts_spin_policy p;
  ts_spin_init(&p, -1);
  CHECK_EQ(ts_spin_plan(&p, 1000, false), 0u); /* pinned to one CPU */
  CHECK_EQ(ts_spin_plan(&p, 1500, false), 0u); /* a quota of 1.5 CPUs */
  CHECK_EQ(ts_spin_plan(&p, 2000, false), TS_SPIN_MAX_NS);
  CHECK_EQ(ts_spin_plan(&p, 0, false), TS_SPIN_MAX_NS); /* not known: as many as it takes */
  CHECK_EQ(p.spins, 2u);
}

TS_TEST(a_sleeping_peer_means_sleeping_at_once) {
  ts_spin_policy p;
  ts_spin_init(&p, -1);
  CHECK_EQ(ts_spin_plan(&p, 16000, true), 0u);
  CHECK_EQ(ts_spin_plan(&p, 16000, false), TS_SPIN_MAX_NS);
  /* A spin stops as soon as the peer falls asleep, and that costs the budget nothing. */
  CHECK_EQ(ts_spin_should_stop(&p, 1000, 1000, TS_SPIN_MAX_NS, true), TS_SPIN_PEER_SLEPT);
  ts_spin_learn(&p, TS_SPIN_PEER_SLEPT);
  CHECK_EQ(p.budget_ns, TS_SPIN_MAX_NS);
}

TS_TEST(the_budget_shrinks_on_time_outs_and_grows_on_catches) {
  ts_spin_policy p;
  ts_spin_init(&p, -1);
  CHECK_EQ(ts_spin_should_stop(&p, 1000, 1000, TS_SPIN_MAX_NS, false), TS_SPIN_GOING);
  CHECK_EQ(ts_spin_should_stop(&p, TS_SPIN_MAX_NS, 1000, TS_SPIN_MAX_NS, false), TS_SPIN_TIMED_OUT);
  uint32_t expect = TS_SPIN_MAX_NS;
  int timeouts = 0;
  while (p.budget_ns > 0) {
    ts_spin_learn(&p, TS_SPIN_TIMED_OUT);
    expect = expect / 2 < TS_SPIN_FLOOR_NS ? 0 : expect / 2;
    CHECK_EQ(p.budget_ns, expect);
    CHECK(++timeouts < 20);
  }
  /* At zero, waits sleep at once but for one probe in TS_SPIN_PROBE_EVERY. */
  unsigned probes = 0;
  for (unsigned i = 0; i < 4 * TS_SPIN_PROBE_EVERY; i++) {
    uint32_t b = ts_spin_plan(&p, 4000, false);
    CHECK(b == 0 || b == TS_SPIN_PROBE_NS);
    probes += b != 0;
  }
  CHECK_EQ(probes, 4u);
  /* A probe that catches a frame brings the budget back, half way up each time. */
  ts_spin_learn(&p, TS_SPIN_CAUGHT);
  CHECK_EQ(p.budget_ns, TS_SPIN_MAX_NS / 2);
  ts_spin_learn(&p, TS_SPIN_CAUGHT);
  CHECK_EQ(p.budget_ns, TS_SPIN_MAX_NS / 2 + TS_SPIN_MAX_NS / 4);
  for (int i = 0; i < 40; i++) ts_spin_learn(&p, TS_SPIN_CAUGHT);
  CHECK_EQ(p.budget_ns, TS_SPIN_MAX_NS);
  CHECK_EQ(p.caught, 42u);
}

TS_TEST(a_spin_that_lost_its_cpu_stops_and_spins_no_more) {
  ts_spin_policy p;
  ts_spin_init(&p, -1);
  CHECK_EQ(ts_spin_should_stop(&p, 30000, TS_SPIN_PREEMPTED_NS, TS_SPIN_MAX_NS, false), TS_SPIN_PREEMPTED);
  ts_spin_learn(&p, TS_SPIN_PREEMPTED);
  CHECK_EQ(p.budget_ns, 0u);
  CHECK_EQ(ts_spin_plan(&p, 4000, false), 0u);
}

TS_TEST(the_override_spins_its_fixed_budget_whatever_the_machine) {
  ts_spin_policy never, fixed;
  ts_spin_init(&never, 0);
  ts_spin_init(&fixed, 20);
  for (int i = 0; i < 100; i++) CHECK_EQ(ts_spin_plan(&never, 16000, false), 0u);
  CHECK_EQ(ts_spin_plan(&fixed, 1000, true), 20000u);
  /* Neither a lost CPU nor a sleeping peer cuts it short; nothing is learnt. */
  CHECK_EQ(ts_spin_should_stop(&fixed, 5000, 1000000, 20000, true), TS_SPIN_GOING);
  CHECK_EQ(ts_spin_should_stop(&fixed, 20000, 1000, 20000, false), TS_SPIN_TIMED_OUT);
  ts_spin_learn(&fixed, TS_SPIN_PREEMPTED);
  CHECK_EQ(ts_spin_plan(&fixed, 1000, true), 20000u);
}

TS_TEST(cpu_max_text_reads_as_thousandths_of_a_cpu) {
  CHECK_EQ(ts_spin_quota_milli("max 100000\n"), 0);
  CHECK_EQ(ts_spin_quota_milli("150000 100000\n"), 1500);
  CHECK_EQ(ts_spin_quota_milli("200000 100000"), 2000);
  CHECK_EQ(ts_spin_quota_milli("50000 1000000"), 50);
  CHECK_EQ(ts_spin_quota_milli("1 1000000"), 1); /* a tiny quota is still a quota */
  CHECK_EQ(ts_spin_quota_milli(""), 0);
  CHECK_EQ(ts_spin_quota_milli("garbage"), 0);
  CHECK_EQ(ts_spin_quota_milli("12x 100000"), 0);
  CHECK_EQ(ts_spin_quota_milli("-5 100000"), 0);
  CHECK_EQ(ts_spin_quota_milli("50000 0"), 0);
}

static void write_file(const char *dir, const char *name, const char *text) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  fputs(text, f);
  fclose(f);
}

TS_TEST(the_tightest_quota_from_the_cgroup_up_to_the_root_counts) {
  char root[] = "/tmp/tshare-cgroup-XXXXXX", a[600], ab[600];
  CHECK(mkdtemp(root) != NULL);
  snprintf(a, sizeof a, "%s/a", root);
  snprintf(ab, sizeof ab, "%s/a/b", root);
  CHECK(mkdir(a, 0700) == 0 && mkdir(ab, 0700) == 0);
  const char *self = "12:cpu,cpuacct:/elsewhere\n0::/a/b\n";
  CHECK_EQ(ts_spin_cgroup_milli(root, self), 0); /* no cpu.max anywhere */
  write_file(a, "cpu.max", "150000 100000\n");
  write_file(ab, "cpu.max", "max 100000\n");
  CHECK_EQ(ts_spin_cgroup_milli(root, self), 1500); /* the parent's quota caps the child */
  write_file(ab, "cpu.max", "100000 100000\n");
  CHECK_EQ(ts_spin_cgroup_milli(root, self), 1000);
  CHECK_EQ(ts_spin_cgroup_milli(root, "0::/a\n"), 1500);
  CHECK_EQ(ts_spin_cgroup_milli(root, "3:cpu:/a/b\n"), 0); /* cgroup v1 only: not read */
  CHECK_EQ(ts_spin_cgroup_milli(root, "0::\n"), 0);
  CHECK_EQ(ts_spin_limit_milli(1, 0), 1000);
  CHECK_EQ(ts_spin_limit_milli(16, 1500), 1500);
  CHECK_EQ(ts_spin_limit_milli(2, 8000), 2000);
  CHECK_EQ(ts_spin_limit_milli(0, 0), 0);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
  CHECK(system(cmd) == 0);
}

/* ---- real ring channels --------------------------------------------------------- */

static tshare_channel *open_ring(int fd, const char *name) {
  return open_channel_over(fd, name, NULL, NULL, TSHARE_TRANSPORT_RING);
}

static void send_bye_frame(tshare_channel *ch) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_BYE;
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

static void recv_one(tshare_channel *ch, int timeout_ms) {
  tshare_frame f;
  int fd = -1;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, timeout_ms), TSHARE_OK, tshare_channel_last_error(ch));
  if (fd >= 0) close(fd);
}

/* Answers each frame with one of its own after a millisecond (so that every
 * receive on the other end waits), 20 times, then waits for the end. */
static void slow_echo(int fd) {
  tshare_channel *ch = open_ring(fd, "slow echo");
  for (int i = 0; i < 20; i++) {
    recv_one(ch, 5000);
    usleep(1000);
    send_bye_frame(ch);
  }
  tshare_frame f;
  int got = -1;
  (void)tshare_channel_recv_frame(ch, &f, &got, 5000);
  tshare_channel_close(ch);
}

static void pin_to_one_cpu(void) {
  cpu_set_t set;
  CHECK(sched_getaffinity(0, sizeof set, &set) == 0);
  unsigned first = 0;
  while (!CPU_ISSET(first, &set)) first++;
  CPU_ZERO(&set);
  CPU_SET(first, &set);
  CHECK(sched_setaffinity(0, sizeof set, &set) == 0);
}

TS_TEST(a_receive_pinned_to_one_cpu_never_spins) {
  int fd;
  pid_t pid = fork_with_socket(slow_echo, &fd);
  pin_to_one_cpu(); /* the peer keeps its CPUs: what counts is this process's */
  tshare_channel *ch = open_ring(fd, "pinned");
  CHECK(ts_conn_uses_ring(&ch->conn));
  CHECK_EQ(ts_spin_cpus_milli(), 1000);
  for (int i = 0; i < 20; i++) {
    send_bye_frame(ch);
    recv_one(ch, 5000);
  }
  CHECK_EQ(ts_ring_link_of(&ch->conn)->spin.spins, 0u);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

/* Sends one frame, then sleeps in a receive until the other end answers. */
static void sends_then_sleeps_in_a_receive(int fd) {
  tshare_channel *ch = open_ring(fd, "sleeper");
  send_bye_frame(ch);
  recv_one(ch, 10000);
  tshare_channel_close(ch);
}

TS_TEST(a_receive_does_not_spin_while_the_peer_sleeps_in_its_own) {
  int fd;
  pid_t pid = fork_with_socket(sends_then_sleeps_in_a_receive, &fd);
  tshare_channel *ch = open_ring(fd, "waker");
  if (ts_spin_cpus_milli() > 0 && ts_spin_cpus_milli() < TS_SPIN_MIN_CPUS_MILLI)
    TS_SKIP("this process may use fewer than two CPUs: no receive spins here anyway");
  recv_one(ch, 5000);
  /* The peer says it sleeps on its ring's bell (the word it keeps in the ring this end writes). */
  ts_ring_ctl *out = ts_ring_link_of(&ch->conn)->out.ctl;
  for (int i = 0; i < 5000 && atomic_load(&out->reader_waits) != TS_RING_FUTEX; i++) usleep(1000);
  CHECK_EQ(atomic_load(&out->reader_waits), (uint32_t)TS_RING_FUTEX);
  uint64_t spins = ts_ring_link_of(&ch->conn)->spin.spins;
  tshare_frame f;
  int got = -1;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 50), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  CHECK_EQ(ts_ring_link_of(&ch->conn)->spin.spins, spins);
  send_bye_frame(ch);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

/* Receives one frame (so it says it is awake), then stays silent outside
 * any call for 1.5 s. */
static void awake_but_silent(int fd) {
  tshare_channel *ch = open_ring(fd, "silent");
  recv_one(ch, 5000);
  usleep(1500000);
  tshare_channel_close(ch);
}

static double thread_cpu_ms(void) {
  struct rusage ru;
  CHECK(getrusage(RUSAGE_THREAD, &ru) == 0);
  return (double)ru.ru_utime.tv_sec * 1e3 + (double)ru.ru_utime.tv_usec / 1e3 + (double)ru.ru_stime.tv_sec * 1e3 +
         (double)ru.ru_stime.tv_usec / 1e3;
}

TS_TEST(an_idle_waiting_consumer_uses_under_5_percent_of_a_core) {
  int fd;
  pid_t pid = fork_with_socket(awake_but_silent, &fd);
  tshare_channel *ch = open_ring(fd, "idle consumer");
  send_bye_frame(ch);
  usleep(20000); /* the peer took it and is awake, silent */
  double before = thread_cpu_ms();
  for (int i = 0; i < 20; i++) { /* 1 s of waiting, in receives of 50 ms: each one may spin */
    tshare_frame f;
    int got = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 50), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  }
  double used = thread_cpu_ms() - before;
  printf("20 receives of 50 ms with nothing coming: %.2f ms of CPU\n", used);
  CHECK(used < 50); /* 5% of the second */
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

TS_TEST_MAIN
