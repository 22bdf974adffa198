#include "bench_report.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static void copy(char *dst, size_t cap, const char *src) { snprintf(dst, cap, "%s", src ? src : ""); }

/* A row is filled after br_add returns: it is done when the next one starts
 * (or the table is printed), and then says so on stderr, so a run of a
 * minute or more shows its progress. */
static void say_done(const br_report *r) {
  if (r->nrows == 0 || r->progress_said >= r->nrows) return;
  const br_row *row = &r->rows[r->nrows - 1];
  ((br_report *)r)->progress_said = r->nrows;
  if (row->skipped[0])
    fprintf(stderr, "bench [%2d] %-48s skipped: %s\n", r->nrows, row->label, row->skipped);
  else if (row->kind == BR_LATENCY)
    fprintf(stderr, "bench [%2d] %-48s p50 %.2f us, p99 %.2f us\n", r->nrows, row->label, row->value, row->p99);
  else if (row->kind == BR_MEMORY)
    fprintf(stderr, "bench [%2d] %-48s %.1f -> %.1f %s\n", r->nrows, row->label, row->before, row->value, row->unit);
  else
    fprintf(stderr, "bench [%2d] %-48s %.4g %s\n", r->nrows, row->label, row->value, row->unit);
}

br_row *br_add(br_report *r, br_kind kind, const char *group, const char *key, const char *label, const char *unit) {
  static br_row spare;
  say_done(r);
  br_row *row = r->nrows < BR_ROWS_MAX ? &r->rows[r->nrows++] : &spare;
  memset(row, 0, sizeof *row);
  row->kind = kind;
  copy(row->group, sizeof row->group, group);
  snprintf(row->key, sizeof row->key, "%s%s", key ? key : "", r->key_suffix);
  snprintf(row->label, sizeof row->label, "%s%s", label ? label : "", r->label_suffix);
  copy(row->unit, sizeof row->unit, unit);
  row->value = row->p99 = row->before = NAN;
  return row;
}

br_row *br_skip(br_report *r, br_kind kind, const char *group, const char *key, const char *label, const char *why) {
  br_row *row = br_add(r, kind, group, key, label, "");
  copy(row->skipped, sizeof row->skipped, why && *why ? why : "skipped");
  return row;
}

br_row *br_find(br_report *r, const char *key) {
  for (int i = 0; key && *key && i < r->nrows; i++)
    if (strcmp(r->rows[i].key, key) == 0) return r->rows[i].skipped[0] || isnan(r->rows[i].value) ? NULL : &r->rows[i];
  return NULL;
}

void br_target_add(br_report *r, const char *text, int met, const char *measured_fmt, ...) {
  if (r->ntargets == BR_TARGETS_MAX) return;
  br_target *t = &r->targets[r->ntargets++];
  copy(t->text, sizeof t->text, text);
  va_list ap;
  va_start(ap, measured_fmt);
  vsnprintf(t->measured, sizeof t->measured, measured_fmt, ap);
  va_end(ap);
  t->met = met;
}

/* value / base's value, NaN when there is no base. */
static double ratio_to(const br_report *r, const br_row *row, const char *key, int inverse) {
  br_row *base = br_find((br_report *)r, key);
  if (!base || row->skipped[0] || isnan(row->value) || base->value == 0 || row->value == 0) return NAN;
  return inverse ? base->value / row->value : row->value / base->value;
}

static void fmt_num(char *buf, size_t cap, double v) {
  if (isnan(v))
    snprintf(buf, cap, "-");
  else if (fabs(v) >= 1e6)
    snprintf(buf, cap, "%.3g", v);
  else if (fabs(v) >= 1000)
    snprintf(buf, cap, "%.0f", v);
  else if (fabs(v) >= 100)
    snprintf(buf, cap, "%.1f", v);
  else
    snprintf(buf, cap, "%.2f", v);
}

static void fmt_ratio(char *buf, size_t cap, double v) {
  if (isnan(v))
    snprintf(buf, cap, "-");
  else
    snprintf(buf, cap, "%.2fx", v);
}

static const char *group_title(const char *group) {
  if (strcmp(group, "latency") == 0) return "hand-off latency, microseconds (share, the peer maps it and releases)";
  if (strcmp(group, "throughput") == 0) return "throughput (pipelined, no per-tensor round trip)";
  if (strcmp(group, "bandwidth") == 0) return "bandwidth (a consumer kernel reads the whole tensor)";
  if (strcmp(group, "memory") == 0) return "memory and handles, before -> after";
  if (strcmp(group, "sets") == 0)
    return "a model's state_dict (290 tensors), microseconds per model (sent, taken by every consumer, released)";
  if (strcmp(group, "idle") == 0) return "a consumer blocked in a receive, nothing coming";
  if (strcmp(group, "profile") == 0)
    return "where a CUDA hand-off's time goes: driver calls alone, and per phase what is not driver work";
  return group;
}

void br_print(const br_report *r, FILE *out) {
  say_done(r);
  fprintf(out, "\n%s\n%s\n", r->title, r->device);
  const char *groups[] = {"latency", "sets", "profile", "throughput", "bandwidth", "idle", "memory"};
  for (size_t g = 0; g < sizeof groups / sizeof *groups; g++) {
    int any = 0;
    for (int i = 0; i < r->nrows; i++) any |= strcmp(r->rows[i].group, groups[g]) == 0;
    if (!any) continue;
    fprintf(out, "\n%s\n", group_title(groups[g]));
    if (strcmp(groups[g], "latency") == 0 || strcmp(groups[g], "sets") == 0)
      fprintf(out, "  %-52s %9s %9s %7s %9s %10s\n", "", "p50", "p99", "n", "vs floor", "peer/this");
    else if (strcmp(groups[g], "memory") == 0)
      fprintf(out, "  %-52s %12s %12s %10s\n", "", "before", "after", "change");
    else
      fprintf(out, "  %-52s %12s %-9s %9s %9s\n", "", "value", "unit", "n", "ratio");
    for (int i = 0; i < r->nrows; i++) {
      const br_row *row = &r->rows[i];
      if (strcmp(row->group, groups[g]) != 0) continue;
      if (row->skipped[0]) {
        fprintf(out, "  %-52s skipped: %s\n", row->label, row->skipped);
        continue;
      }
      char a[32], b[32], c[32], d[32];
      if (row->kind == BR_LATENCY) {
        fmt_num(a, sizeof a, row->value);
        fmt_num(b, sizeof b, row->p99);
        fmt_ratio(c, sizeof c, ratio_to(r, row, row->floor_key, 0));
        fmt_ratio(d, sizeof d, ratio_to(r, row, row->peer_key, 1));
        fprintf(out, "  %-52s %9s %9s %7ld %9s %10s\n", row->label, a, b, row->n, c, d);
      } else if (row->kind == BR_MEMORY) {
        fmt_num(a, sizeof a, row->before);
        fmt_num(b, sizeof b, row->value);
        snprintf(c, sizeof c, "%+.0f", row->value - row->before);
        fprintf(out, "  %-52s %12s %12s %10s %s\n", row->label, a, b, c, row->unit);
      } else {
        fmt_num(a, sizeof a, row->value);
        fmt_ratio(c, sizeof c, ratio_to(r, row, row->ratio_key, 0));
        fprintf(out, "  %-52s %12s %-9s %9ld %9s\n", row->label, a, row->unit, row->n, c);
      }
      if (row->note[0]) fprintf(out, "  %-52s   (%s)\n", "", row->note);
    }
  }
  if (r->ntargets) {
    fprintf(out, "\ntargets\n");
    for (int i = 0; i < r->ntargets; i++) {
      const br_target *t = &r->targets[i];
      fprintf(out, "  [%s] %s: %s\n", t->met > 0 ? " met " : t->met == 0 ? "MISSED" : " n/a ", t->text, t->measured);
    }
  }
  fprintf(out, "\n");
}

/* The fields of a row, in the order both files list them. */
typedef struct field {
  const char *name;
  const char *str; /* NULL: a number */
  double num;
} field;

#define ROW_FIELDS 13

static void row_fields(const br_report *r, const br_row *row, field out[ROW_FIELDS]) {
  field f[ROW_FIELDS] = {{"group", row->group, 0},
                         {"key", row->key, 0},
                         {"label", row->label, 0},
                         {"unit", row->unit, 0},
                         {"value", NULL, row->value},
                         {"p99", NULL, row->p99},
                         {"before", NULL, row->before},
                         {"n", NULL, (double)row->n},
                         {"vs_floor", NULL, ratio_to(r, row, row->floor_key, 0)},
                         {"peer_over_this", NULL, ratio_to(r, row, row->peer_key, 1)},
                         {"ratio", NULL, ratio_to(r, row, row->ratio_key, 0)},
                         {"skipped", row->skipped, 0},
                         {"note", row->note, 0}};
  memcpy(out, f, sizeof f);
}

static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\')
      fprintf(f, "\\%c", ch);
    else if (ch < 0x20)
      fprintf(f, "\\u%04x", ch);
    else
      fputc(ch, f);
  }
  fputc('"', f);
}

static void json_num(FILE *f, double v) {
  if (isnan(v) || isinf(v))
    fprintf(f, "null");
  else
    fprintf(f, "%.10g", v);
}

int br_write_json(const br_report *r, const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  fprintf(f, "{\n  \"title\": ");
  json_str(f, r->title);
  fprintf(f, ",\n  \"device\": ");
  json_str(f, r->device);
  fprintf(f, ",\n  \"rows\": [\n");
  for (int i = 0; i < r->nrows; i++) {
    field fields[ROW_FIELDS];
    row_fields(r, &r->rows[i], fields);
    for (int k = 0; k < ROW_FIELDS; k++) {
      fprintf(f, "%s\"%s\": ", k ? ", " : "    {", fields[k].name);
      if (fields[k].str)
        json_str(f, fields[k].str);
      else
        json_num(f, fields[k].num);
    }
    fprintf(f, "}%s\n", i + 1 < r->nrows ? "," : "");
  }
  fprintf(f, "  ],\n  \"targets\": [\n");
  for (int i = 0; i < r->ntargets; i++) {
    fprintf(f, "    {\"target\": ");
    json_str(f, r->targets[i].text);
    fprintf(f, ", \"measured\": ");
    json_str(f, r->targets[i].measured);
    fprintf(f, ", \"met\": %s}%s\n",
            r->targets[i].met > 0    ? "true"
            : r->targets[i].met == 0 ? "false"
                                     : "null",
            i + 1 < r->ntargets ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  return fclose(f) == 0 ? 0 : -1;
}

static void csv_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '"') fputc('"', f);
    fputc(*s, f);
  }
  fputc('"', f);
}

int br_write_csv(const br_report *r, const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  field fields[ROW_FIELDS];
  br_row none;
  memset(&none, 0, sizeof none);
  row_fields(r, &none, fields);
  for (int k = 0; k < ROW_FIELDS; k++) fprintf(f, "%s%s", k ? "," : "", fields[k].name);
  fputc('\n', f);
  for (int i = 0; i < r->nrows; i++) {
    row_fields(r, &r->rows[i], fields);
    for (int k = 0; k < ROW_FIELDS; k++) {
      if (k) fputc(',', f);
      if (fields[k].str)
        csv_str(f, fields[k].str);
      else if (!isnan(fields[k].num) && !isinf(fields[k].num))
        fprintf(f, "%.10g", fields[k].num);
    }
    fputc('\n', f);
  }
  return fclose(f) == 0 ? 0 : -1;
}
