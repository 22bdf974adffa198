/* Deadlines: read mostly from the coarse clock, they must still never end
 * before their timeout, say no more time is left than there is, and end. */
#include "clock.h"
#include "harness.h"

#include <time.h>

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)ms * 1000000};
  nanosleep(&ts, NULL);
}

TS_TEST(no_deadline_and_a_zero_timeout) {
  CHECK_EQ(ts_deadline(-1), -1);
  CHECK_EQ(ts_remaining(-1), -1);
  CHECK_EQ(ts_remaining(ts_deadline(0)), 0);
}

TS_TEST(the_time_left_is_never_more_than_the_timeout) {
  static const int timeouts[] = {1, 2, 5, 9, 50, 1000, 10000, 0x7fffffff};
  for (size_t i = 0; i < sizeof timeouts / sizeof *timeouts; i++) {
    int64_t before = ts_now_ms();
    int left = ts_remaining(ts_deadline(timeouts[i]));
    int64_t taken = ts_now_ms() - before;
    if (left > timeouts[i] || left < 0) TS_FAIL("a %d ms timeout says %d ms are left", timeouts[i], left);
    if (timeouts[i] >= 50 && left + taken < timeouts[i] - 10)
      TS_FAIL("a %d ms timeout says only %d ms are left %lld ms in", timeouts[i], left, (long long)taken);
  }
}

/* Waited out by the precise clock, in the steps a poll loop takes (what
 * ts_remaining says, at most 1 ms at a time): never shorter than asked, and
 * it ends (the test's timeout bounds how long). */
TS_TEST(a_timeout_is_never_shorter_than_asked_and_ends) {
  static const int timeouts[] = {1, 3, 8, 20, 60};
  for (size_t i = 0; i < sizeof timeouts / sizeof *timeouts; i++) {
    int64_t start = ts_now_us(), deadline = ts_deadline(timeouts[i]);
    int left;
    while ((left = ts_remaining(deadline)) != 0) sleep_ms(1);
    int64_t waited = ts_now_us() - start;
    if (waited < (int64_t)timeouts[i] * 1000 - 1000) /* the precise clock's ms are whole: 1 ms of rounding */
      TS_FAIL("a %d ms timeout ended after %lld us", timeouts[i], (long long)waited);
  }
}

/* A look: passed without a clock read. A turn's deadline: short turns (a
 * backend's "look again in a millisecond") by the precise clock, so they are
 * not over before they begin (a receive's wait would become a spin); long
 * ones by the coarse clock, at most two of its ticks (10 ms at most each)
 * longer. */
TS_TEST(a_look_and_a_turn_of_the_library_own_work) {
  CHECK_EQ(ts_remaining(TS_DEADLINE_PASSED), 0);
  CHECK_EQ(ts_turn_deadline(0) <= ts_now_ms(), 1);
  int passed_at_once = 0;
  for (int i = 0; i < 200; i++) {
    int64_t start = ts_now_us(), deadline = ts_turn_deadline(1);
    if (ts_remaining(deadline) == 0 && ts_now_us() - start < 500) passed_at_once++;
    int left = ts_remaining(ts_turn_deadline(TS_TURN_COARSE_MS));
    if (left < 0 || left > TS_TURN_COARSE_MS + 20)
      TS_FAIL("a %d ms turn says %d ms are left", TS_TURN_COARSE_MS, left);
  }
  /* A 1 ms turn read from a clock a tick behind would always be over. */
  if (passed_at_once > 100) TS_FAIL("a 1 ms turn was over at once %d times of 200", passed_at_once);
  /* A long turn is never over sooner than asked (a coarse clock a whole
   * turn behind would make every turn a spin), and ends. */
  for (int i = 0; i < 5; i++) {
    int64_t start = ts_now_us(), deadline = ts_turn_deadline(TS_TURN_COARSE_MS);
    while (ts_remaining(deadline) != 0) sleep_ms(1);
    int64_t took = ts_now_us() - start;
    if (took < (TS_TURN_COARSE_MS - 1) * 1000) /* the precise clock's ms are whole */
      TS_FAIL("a %d ms turn was over after %lld us", TS_TURN_COARSE_MS, (long long)took);
    if (took > (TS_TURN_COARSE_MS + 60) * 1000) TS_FAIL("a %d ms turn lasted %lld us", TS_TURN_COARSE_MS, (long long)took);
  }
}

TS_TEST(the_coarse_clock_is_the_same_timeline_behind_the_precise_one) {
  for (int i = 0; i < 1000; i++) {
    int64_t coarse = ts_coarse_now_us(), precise = ts_now_us();
    if (coarse > precise) TS_FAIL("the coarse clock (%lld us) is ahead of the precise one (%lld us)", (long long)coarse,
                                  (long long)precise);
    if (precise - coarse > 100000)
      TS_FAIL("the coarse clock is %lld us behind the precise one", (long long)(precise - coarse));
  }
}

TS_TEST_MAIN
