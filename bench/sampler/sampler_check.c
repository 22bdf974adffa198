/* The sampler's test program: the parent spins in parent_spins() for
 * about 300 ms of CPU time and sleeps 300 ms in parent_sleeps(); a forked
 * child spins in child_spins(). check_sampler.sh reads what the sampler
 * made of it. */
#define _GNU_SOURCE
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double cpu_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static volatile unsigned long sink;

__attribute__((noinline)) static void spin_for(double seconds) {
  double until = cpu_seconds() + seconds;
  while (cpu_seconds() < until)
    for (int i = 0; i < 10000; i++) sink += (unsigned long)i;
}

/* Each wraps its work in a frame of its own (no tail call): a sample in it names it. */
__attribute__((noinline)) void parent_spins(void) {
  spin_for(0.3);
  sink++;
}
__attribute__((noinline)) void child_spins(void) {
  spin_for(0.3);
  sink++;
}
__attribute__((noinline)) void parent_sleeps(void) {
  struct timespec t = {0, 300 * 1000 * 1000};
  while (nanosleep(&t, &t) != 0) {
  }
  sink++;
}

int main(void) {
  pid_t pid = fork();
  if (pid == 0) {
    child_spins();
    _exit(0);
  }
  parent_spins();
  parent_sleeps();
  int status;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
