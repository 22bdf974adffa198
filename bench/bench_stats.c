#include "bench_stats.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

uint64_t bs_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void bs_add(bs_samples *s, double value) {
  if (s->n == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 1024;
    double *v = realloc(s->v, cap * sizeof *v);
    if (!v) return;
    s->v = v;
    s->cap = cap;
  }
  s->v[s->n++] = value;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double bs_percentile(bs_samples *s, double p) {
  if (s->n == 0) return NAN;
  qsort(s->v, s->n, sizeof *s->v, cmp_double);
  size_t rank = (size_t)ceil(p / 100.0 * (double)s->n);
  if (rank < 1) rank = 1;
  if (rank > s->n) rank = s->n;
  return s->v[rank - 1];
}

void bs_clear(bs_samples *s) { s->n = 0; }

void bs_free(bs_samples *s) {
  free(s->v);
  s->v = NULL;
  s->n = s->cap = 0;
}

void bs_copy(char *dst, size_t cap, const char *src) {
  if (!cap) return;
  size_t n = strnlen(src ? src : "", cap - 1);
  memcpy(dst, src ? src : "", n);
  dst[n] = 0;
}

long bs_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  long n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

long bs_rss_kib(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return -1;
  long size = 0, resident = 0;
  int got = fscanf(f, "%ld %ld", &size, &resident);
  fclose(f);
  return got == 2 ? resident * (sysconf(_SC_PAGESIZE) / 1024) : -1;
}
