/* Minimal test harness. A test binary holds several TS_TEST(name) functions;
 * `binary name` runs one (ctest registers each as its own entry, with the
 * names read from the source), `binary --list` lists them. A failed check
 * prints where and why and exits 1; exit 77 means skipped. */
#ifndef TSHARE_TEST_HARNESS_H
#define TSHARE_TEST_HARNESS_H

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct ts_test_case {
  const char *name;
  void (*fn)(void);
  struct ts_test_case *next;
} ts_test_case;

extern ts_test_case *ts_tests;

/* A test binary may also act as a program that tests start: `binary --role
 * ARGS...` calls this hook when a test file sets it (from a constructor). */
extern int (*ts_role_main)(int argc, char **argv);

#define TS_TEST(name)                                                                                                  \
  static void test_##name(void);                                                                                       \
  static ts_test_case tcase_##name = {#name, test_##name, NULL};                                                       \
  __attribute__((constructor)) static void register_##name(void) {                                                     \
    tcase_##name.next = ts_tests;                                                                                      \
    ts_tests = &tcase_##name;                                                                                          \
  }                                                                                                                    \
  static void test_##name(void)

#define TS_FAIL(...)                                                                                                   \
  do {                                                                                                                 \
    fprintf(stderr, "%s:%d: FAILED: ", __FILE__, __LINE__);                                                            \
    fprintf(stderr, __VA_ARGS__);                                                                                      \
    fprintf(stderr, "\n");                                                                                             \
    exit(1);                                                                                                           \
  } while (0)

#define CHECK(cond)                                                                                                    \
  do {                                                                                                                 \
    if (!(cond)) TS_FAIL("%s", #cond);                                                                                 \
  } while (0)

#define CHECK_EQ(a, b)                                                                                                 \
  do {                                                                                                                 \
    long long ts_a_ = (long long)(a), ts_b_ = (long long)(b);                                                          \
    if (ts_a_ != ts_b_) TS_FAIL("%s == %s (%lld != %lld)", #a, #b, ts_a_, ts_b_);                                      \
  } while (0)

/* Check a tshare status, printing its name and the object's detail. */
#define CHECK_RC(expr, want, detail)                                                                                   \
  do {                                                                                                                 \
    int ts_rc_ = (expr);                                                                                               \
    if (ts_rc_ != (want))                                                                                              \
      TS_FAIL("%s returned %s, expected %s (%s)", #expr, tshare_status_name(ts_rc_), tshare_status_name(want),         \
              (detail));                                                                                               \
  } while (0)

#define TS_SKIP(...)                                                                                                   \
  do {                                                                                                                 \
    printf("SKIP: ");                                                                                                  \
    printf(__VA_ARGS__);                                                                                               \
    printf("\n");                                                                                                      \
    exit(77);                                                                                                          \
  } while (0)

#define TS_TEST_MAIN                                                                                                   \
  ts_test_case *ts_tests;                                                                                              \
  int (*ts_role_main)(int argc, char **argv);                                                                          \
  int main(int argc, char **argv) {                                                                                    \
    if (argc >= 2 && strcmp(argv[1], "--role") == 0 && ts_role_main) return ts_role_main(argc, argv);                  \
    if (argc == 2 && strcmp(argv[1], "--list") == 0) {                                                                 \
      for (ts_test_case *t = ts_tests; t; t = t->next) printf("%s\n", t->name);                                        \
      return 0;                                                                                                        \
    }                                                                                                                  \
    if (argc != 2) {                                                                                                   \
      fprintf(stderr, "usage: %s TEST | --list\n", argv[0]);                                                           \
      return 2;                                                                                                        \
    }                                                                                                                  \
    for (ts_test_case *t = ts_tests; t; t = t->next)                                                                   \
      if (strcmp(t->name, argv[1]) == 0) {                                                                             \
        t->fn();                                                                                                       \
        printf("PASS: %s\n", t->name);                                                                                 \
        return 0;                                                                                                      \
      }                                                                                                                \
    fprintf(stderr, "no test named %s\n", argv[1]);                                                                    \
    return 2;                                                                                                          \
  }

#endif
