/* bench_report: the rows a bench run measured, printed as a table a person
 * reads at a glance and written as JSON and CSV for machines.
 *
 * Ratios are taken between rows of the same run only (the machines are
 * noisy): a latency row names its floor and its peer baseline by key, any
 * row may name another row to divide by. A row whose baseline is missing or
 * skipped shows no ratio. */
#ifndef TSHARE_BENCH_REPORT_H
#define TSHARE_BENCH_REPORT_H

#include <stdio.h>

typedef enum br_kind {
  BR_LATENCY = 1, /* value = p50, p99 set; microseconds */
  BR_VALUE = 2,   /* value in unit; ratio to ratio_key */
  BR_MEMORY = 3   /* before and value (after) */
} br_kind;

typedef struct br_row {
  br_kind kind;
  char group[16]; /* section of the table: "latency", "sets", "throughput", "bandwidth", "memory" */
  char key[48];   /* stable name for machines */
  char label[80]; /* what a person reads */
  char unit[16];
  double value;       /* p50 for latency rows, the figure otherwise, "after" for memory rows */
  double p99;         /* latency rows */
  double before;      /* memory rows */
  long n;             /* iterations or shares behind the figure */
  char floor_key[48]; /* latency: value / floor's value */
  char peer_key[48];  /* latency: peer's value / value ("x faster") */
  char ratio_key[48]; /* value / that row's value */
  char skipped[200];  /* non-empty: not measured, and why */
  char note[200];
} br_row;

typedef struct br_target {
  char text[120];     /* the target, as stated */
  char measured[160]; /* what this run measured against it */
  int met;            /* 1 met, 0 missed, -1 not measured */
} br_target;

#define BR_ROWS_MAX 200
#define BR_TARGETS_MAX 32

typedef struct br_report {
  char title[320];
  char device[240]; /* "NVIDIA H100 80GB HBM3, driver 580.159.04" or "no GPU: ..." */
  br_row rows[BR_ROWS_MAX];
  int nrows;
  br_target targets[BR_TARGETS_MAX];
  int ntargets;
  int progress_said; /* rows already reported as done on stderr */
  /* Appended to the keys and labels of rows added from now on: the same
   * rows measured again over another transport stand side by side. */
  char key_suffix[24];
  char label_suffix[32];
} br_report;

/* A new row (zeroed, NaN figures); a static spare when the table is full. */
br_row *br_add(br_report *r, br_kind kind, const char *group, const char *key, const char *label, const char *unit);
br_row *br_skip(br_report *r, br_kind kind, const char *group, const char *key, const char *label, const char *why);
br_row *br_find(br_report *r, const char *key); /* NULL when absent or skipped */

void br_target_add(br_report *r, const char *text, int met, const char *measured_fmt, ...)
    __attribute__((format(printf, 4, 5)));

void br_print(const br_report *r, FILE *out);
int br_write_json(const br_report *r, const char *path); /* 0 on success */
int br_write_csv(const br_report *r, const char *path);

#endif
