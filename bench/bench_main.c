/* tshare-bench: tshare against the floor and against torch.multiprocessing,
 * in one run on one machine. See bench.h for the parts and README.md
 * ("Benchmarks") for what each row measures.
 *
 *   tshare-bench [--quick] [--out DIR] [--iters N] [--warmup N]
 *                [--pipelined N] [--memory-shares N] [--bw-mib N]
 *                [--python PATH] [--no-peers] [--no-sets] [--sets-only] [--ucx-only]
 *                [--contention-only]
 */
#include "bench.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef TSHARE_BENCH_VERSION
#define TSHARE_BENCH_VERSION "?"
#endif
#ifndef TSHARE_BENCH_PYTHON
#define TSHARE_BENCH_PYTHON "python3"
#endif
#ifndef TSHARE_BENCH_PY_SCRIPT
#define TSHARE_BENCH_PY_SCRIPT "tshare_py_peer.py"
#endif
#ifndef TSHARE_BENCH_SETS_PY_SCRIPT
#define TSHARE_BENCH_SETS_PY_SCRIPT "sets_py_peer.py"
#endif
#ifndef TSHARE_BENCH_PEER_SCRIPT
#define TSHARE_BENCH_PEER_SCRIPT "torch_mp_peer.py"
#endif

static int consumer_command(tshare_channel *ch, const char *cmd, char *reply, size_t cap) {
  int rc = bench_host_consumer(ch, cmd, reply, cap);
  if (rc == 1) rc = bench_cuda_consumer(ch, cmd, reply, cap);
  if (rc == 1) {
    snprintf(reply, cap, "unknown command '%s'", cmd);
    rc = -1;
  }
  return rc;
}

static int consumer_main(int rank, const char *transport, int spin_us) {
  char why[256], name[48];
  (void)bench_cuda_probe(why, sizeof why); /* host rows run without a GPU */
  snprintf(name, sizeof name, "bench consumer %d", rank);
  tshare_channel_options o;
  bp_channel_options(&o, name, transport, spin_us);
  tshare_channel *ch = NULL;
  tshare_error err;
  if (tshare_channel_open_socket(BP_DATA_FD, &o, &ch, &err) != TSHARE_OK) {
    fprintf(stderr, "tshare-bench consumer %d: %s\n", rank, err.message);
    return 1;
  }
  int rc = bp_consumer_loop(ch, consumer_command);
  tshare_channel_close(ch);
  return rc;
}

static int start_consumers(bench *b, const char *transport, int spin_us) {
  for (int i = 0; i < BENCH_MAX_CONSUMERS; i++) {
    char why[512];
    if (bp_start(&b->peers[i], "/proc/self/exe", i, transport, spin_us, why, sizeof why) != 0) {
      fprintf(stderr, "tshare-bench: starting consumer %d (%s): %s\n", i, transport, why);
      for (int j = 0; j < b->npeers; j++) bp_stop(&b->peers[j]);
      b->npeers = 0;
      return -1;
    }
    b->npeers++;
  }
  return 0;
}

static void stop_consumers(bench *b) {
  for (int i = 0; i < b->npeers; i++) bp_stop(&b->peers[i]);
  b->npeers = 0;
}

static void usage(FILE *out) {
  fprintf(out, "usage: tshare-bench [--quick] [--out DIR] [--iters N] [--warmup N] [--pipelined N]\n"
               "                    [--memory-shares N] [--bw-mib N] [--python PATH] [--no-peers]\n"
               "                    [--set-iters N] [--set-device cuda|cpu] [--no-sets] [--sets-only] [--ucx-only]\n"
               "                    [--contention-only]\n"
               "  --quick           few iterations: checks that every row runs, numbers are rough\n"
               "  --out DIR         write bench.json and bench.csv there (default: bench-results)\n"
               "  --iters N         timed hand-offs per latency row (default 20000)\n"
               "  --warmup N        untimed hand-offs before them (default 2000)\n"
               "  --pipelined N     shares per consumer in a throughput row (default 200000)\n"
               "  --memory-shares N shares between the memory snapshots (default 1000000)\n"
               "  --bw-mib N        size of the bandwidth tensor (default 1024)\n"
               "  --python PATH     interpreter for the torch.multiprocessing peer (default python3)\n"
               "  --no-peers        skip the rows run by other programs\n"
               "  --set-iters N     timed hand-offs per state_dict row (default 200; a tenth untimed first)\n"
               "  --set-device DEV  the state_dict rows of DEV (cuda or cpu) alone (default both)\n"
               "  --no-sets         skip the state_dict rows (the longest part of a run)\n"
               "  --sets-only       only the state_dict rows and their targets\n"
               "  --ucx-only        only the UCX rows (host memory across a veth pair; root)\n"
               "  --contention-only only the rows where CPUs are scarce (one CPU, every CPU busy)\n");
}

static int parse_long(const char *s, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v <= 0) return -1;
  *out = v;
  return 0;
}

static double value_of(bench *b, const char *key) {
  br_row *row = br_find(&b->rep, key);
  return row ? row->value : NAN;
}

static void targets(bench *b) {
  br_report *r = &b->rep;
  double fl = value_of(b, "floor"), rb = value_of(b, "cuda_reused"), rc = value_of(b, "cuda_slab");
  double ra = value_of(b, "cuda_new_alloc"), open = value_of(b, "open_cost"), mp = value_of(b, "torch_mp_cuda");
  double t1 = value_of(b, "cuda_pipelined_1"), t4 = value_of(b, "cuda_pipelined_4");
  double bws = value_of(b, "bw_shared"), bwl = value_of(b, "bw_local");
  if (isnan(fl) || isnan(rb) || isnan(rc))
    br_target_add(r, "(b) and (c) p50 within 1.3x of the floor", -1, "not measured");
  else
    br_target_add(r, "(b) and (c) p50 within 1.3x of the floor", rb <= 1.3 * fl && rc <= 1.3 * fl,
                  "(b) %.2fx, (c) %.2fx of %.2f us", rb / fl, rc / fl, fl);
  if (isnan(mp) || isnan(rb))
    br_target_add(r, "at least 100x faster than torch.multiprocessing at p50", -1, "not measured");
  else
    br_target_add(r, "at least 100x faster than torch.multiprocessing at p50", mp / rb >= 100 && mp / rc >= 100,
                  "(b) %.1fx, (c) %.1fx (%.1f us vs %.1f / %.1f us)", mp / rb, mp / rc, mp, rb, rc);
  if (isnan(ra) || isnan(open) || isnan(fl))
    br_target_add(r, "(a) no more than the open cost + the floor + 10 us", -1, "not measured");
  else
    br_target_add(r, "(a) no more than the open cost + the floor + 10 us", ra <= open + fl + 10,
                  "%.1f us vs %.1f + %.1f + 10 = %.1f us", ra, open, fl, open + fl + 10);
  if (isnan(t1) || isnan(t4))
    br_target_add(r, "at least 200k shares/s to one consumer, scaling to 4", -1, "not measured");
  else
    br_target_add(r, "at least 200k shares/s to one consumer, scaling to 4", t1 >= 200000 && t4 >= 2 * t1,
                  "%.0f/s to 1, %.0f/s to 4 (%.2fx; scaling asks >= 2x)", t1, t4, t4 / t1);
  if (isnan(bws) || isnan(bwl))
    br_target_add(r, "zero-copy read at least 0.97x local", -1, "not measured");
  else
    br_target_add(r, "zero-copy read at least 0.97x local", bws >= 0.97 * bwl, "%.3fx (%.0f vs %.0f GB/s)",
                  bws / bwl, bws, bwl);
  /* The ring transport's own targets (its floor and hand-offs, idle cost). */
  double hr = value_of(b, "host_reused"), h1 = value_of(b, "host_pipelined_1"), idle = value_of(b, "idle_consumer_cpu");
  double fs = value_of(b, "floor_socket");
  if (isnan(fl))
    br_target_add(r, "ring frame round trip p50 <= 1 us", -1, "not measured");
  else
    br_target_add(r, "ring frame round trip p50 <= 1 us", fl <= 1, "%.2f us (socket %.2f us: %.1fx)", fl, fs, fs / fl);
  if (isnan(hr))
    br_target_add(r, "host share hand-off p50 <= 2.5 us", -1, "not measured");
  else
    br_target_add(r, "host share hand-off p50 <= 2.5 us", hr <= 2.5, "%.2f us", hr);
  if (isnan(rb) || isnan(rc))
    br_target_add(r, "cuda (b) and (c) p50 <= 4.5 us", -1, "not measured");
  else
    br_target_add(r, "cuda (b) and (c) p50 <= 4.5 us", rb <= 4.5 && rc <= 4.5, "(b) %.2f us, (c) %.2f us", rb, rc);
  /* The bridge adds only the tensor's own work to the library's hand-off. */
  double brc = value_of(b, "torch_bridge_cuda");
  if (isnan(brc) || isnan(rc))
    br_target_add(r, "bridge: cuda hand-off p50 <= 1.1x (c)", -1, "not measured");
  else
    br_target_add(r, "bridge: cuda hand-off p50 <= 1.1x (c)", brc <= 1.1 * rc, "%.2fx (%.2f us vs %.2f us)", brc / rc,
                  brc, rc);
  if (isnan(h1))
    br_target_add(r, "host shares/s to one consumer >= 1M", -1, "not measured");
  else
    br_target_add(r, "host shares/s to one consumer >= 1M", h1 >= 1e6, "%.0f/s", h1);
  if (isnan(idle))
    br_target_add(r, "an idle waiting consumer < 1% of a core", -1, "not measured");
  else
    br_target_add(r, "an idle waiting consumer < 1% of a core", idle < 1, "%.3f%%", idle);
  /* The Python package against torch.multiprocessing and the bridge. CUDA:
   * the expandable-segment rows, the fast path a user is told to take (the
   * default allocator's rows pay an IPC open per hand-off in both). */
  const char *py_text = "Python: cpu and cuda (expandable) >= 10x faster than torch.mp, within 1.5x of the bridge";
  char py_detail[200] = "";
  int py_ok = 1, py_measured = 0;
  const char *py_rows[2][3] = {{"tshare_python_cuda_expandable", "torch_mp_cuda", "torch_bridge_cuda_expandable"},
                               {"tshare_python_cpu", "torch_mp_cpu", "torch_bridge_cpu"}};
  const char *py_devs[2] = {"cuda", "cpu"};
  for (int i = 0; i < 2; i++) {
    const char *k_py = py_rows[i][0], *k_mp = py_rows[i][1], *k_br = py_rows[i][2];
    double py = value_of(b, k_py), pmp = value_of(b, k_mp), pbr = value_of(b, k_br);
    if (isnan(py) || isnan(pmp) || isnan(pbr)) continue;
    py_measured++;
    py_ok = py_ok && pmp / py >= 10 && py <= 1.5 * pbr;
    size_t used = strlen(py_detail);
    snprintf(py_detail + used, sizeof py_detail - used, "%s%s %.1fx faster than torch.mp, %.2fx the bridge", used ? "; " : "",
             py_devs[i], pmp / py, py / pbr);
  }
  if (py_measured < 2)
    br_target_add(r, py_text, -1, "not measured");
  else
    br_target_add(r, py_text, py_ok, "%s", py_detail);
  /* Both allocator modes: the caching allocator's segments (kept mapped
   * between hand-offs) and expandable segments (chunks kept mapped, their
   * fds passed again with each share). */
  double bp = value_of(b, "torch_bridge_pipelined_cuda"), bpx = value_of(b, "torch_bridge_pipelined_cuda_expandable");
  const char *bp_text = "bridge: >= 200k cuda shares/s to one consumer (memory already mapped), each allocator mode";
  if (isnan(bp) || isnan(bpx))
    br_target_add(r, bp_text, -1, "not measured");
  else
    br_target_add(r, bp_text, bp >= 200000 && bpx >= 200000, "default allocator %.0f/s, expandable segments %.0f/s",
                  bp, bpx);
  /* No growth: counts not higher, GPU memory not lower by more than half a
   * MiB, RSS within 1% + 1 MiB (the allocator's own slack). */
  int measured = 0, grew = 0;
  char worst[160] = "none";
  for (int i = 0; i < r->nrows; i++) {
    br_row *row = &r->rows[i];
    if (row->kind != BR_MEMORY || row->skipped[0] || isnan(row->value) || isnan(row->before)) continue;
    measured++;
    double d = row->value - row->before;
    int bad = strcmp(row->unit, "KiB") == 0 ? d > 1024 + row->before / 100
              : strcmp(row->unit, "MiB") == 0 ? d < -0.5
                                              : d > 0;
    if (bad && !grew++) snprintf(worst, sizeof worst, "%s %+.0f %s", row->label, d, row->unit);
  }
  if (!measured)
    br_target_add(r, "no growth over the long stream", -1, "not measured");
  else
    br_target_add(r, "no growth over the long stream", !grew, "%d figures, %d grew; first: %s", measured, grew, worst);
}

int main(int argc, char **argv) {
  if (argc == 5 && strcmp(argv[1], "--consumer") == 0) return consumer_main(atoi(argv[2]), argv[3], atoi(argv[4]));
  static bench b;
  b.opt = (bench_opts){.iters = 20000, .warmup = 2000, .pipelined = 200000, .memory_shares = 1000000,
                       .bw_bytes = (size_t)1 << 30, .window = 64, .python = TSHARE_BENCH_PYTHON,
                       .peer_script = TSHARE_BENCH_PEER_SCRIPT,
                       .py_script = TSHARE_BENCH_PY_SCRIPT, .sets_py_script = TSHARE_BENCH_SETS_PY_SCRIPT,
                       .set_iters = 200, .set_warmup = 20, .set_hidden_cpu = 256};
#ifdef TSHARE_BENCH_PYTHONPATH
  { /* the package as built here, ahead of any installed one */
    const char *old = getenv("PYTHONPATH");
    char path[4096];
    snprintf(path, sizeof path, "%s%s%s", TSHARE_BENCH_PYTHONPATH, old && *old ? ":" : "", old ? old : "");
    setenv("PYTHONPATH", path, 1);
  }
#endif
#ifdef TSHARE_BENCH_TORCH
  b.opt.torch_bench = TSHARE_BENCH_TORCH;
  b.opt.torch_sets_bench = TSHARE_BENCH_TORCH_SETS;
#endif
  const char *out_dir = "bench-results";
  int peers = 1, sets = 1, ucx_only = 0, contention_only = 0, sets_only = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    long n = 0;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(a, "--quick") == 0) {
      b.opt.iters = 500;
      b.opt.warmup = 50;
      b.opt.pipelined = 2000;
      b.opt.memory_shares = 5000;
      b.opt.bw_bytes = 64u << 20;
      b.opt.set_iters = 5;
      b.opt.set_warmup = 1;
      b.opt.set_hidden_cpu = 64;
    } else if (strcmp(a, "--no-peers") == 0) {
      peers = 0;
    } else if (strcmp(a, "--no-sets") == 0) {
      sets = 0;
    } else if (strcmp(a, "--ucx-only") == 0) {
      ucx_only = 1;
    } else if (strcmp(a, "--contention-only") == 0) {
      contention_only = 1;
    } else if (strcmp(a, "--sets-only") == 0) {
      sets_only = 1;
    } else if (v && strcmp(a, "--out") == 0) {
      out_dir = v, i++;
    } else if (v && strcmp(a, "--python") == 0) {
      b.opt.python = v, i++;
    } else if (v && parse_long(v, &n) == 0 && strcmp(a, "--iters") == 0) {
      b.opt.iters = n, i++;
    } else if (v && strcmp(a, "--set-device") == 0 && (strcmp(v, "cuda") == 0 || strcmp(v, "cpu") == 0)) {
      b.opt.set_device = v, i++;
    } else if (v && parse_long(v, &n) == 0 && n > 0 && strcmp(a, "--set-iters") == 0) {
      b.opt.set_iters = n, b.opt.set_warmup = n / 10 > 0 ? n / 10 : 1, i++;
    } else if (v && parse_long(v, &n) == 0 && strcmp(a, "--warmup") == 0) {
      b.opt.warmup = n, i++;
    } else if (v && parse_long(v, &n) == 0 && strcmp(a, "--pipelined") == 0) {
      b.opt.pipelined = n, i++;
    } else if (v && parse_long(v, &n) == 0 && strcmp(a, "--memory-shares") == 0) {
      b.opt.memory_shares = n, i++;
    } else if (v && parse_long(v, &n) == 0 && n <= 65536 && strcmp(a, "--bw-mib") == 0) {
      b.opt.bw_bytes = (size_t)n << 20, i++;
    } else {
      fprintf(stderr, "tshare-bench: bad argument '%s'%s\n", a, v ? " (or its value)" : "");
      usage(stderr);
      return 2;
    }
  }

  b.have_gpu = bench_cuda_probe(b.no_gpu_why, sizeof b.no_gpu_why);
  if (b.have_gpu) bench_cuda_describe(b.rep.device, sizeof b.rep.device);
  else snprintf(b.rep.device, sizeof b.rep.device, "no GPU: %s", b.no_gpu_why);
  char host[64] = "?", date[32] = "?";
  gethostname(host, sizeof host);
  time_t now = time(NULL);
  strftime(date, sizeof date, "%Y-%m-%d %H:%M", localtime(&now));
  snprintf(b.rep.title, sizeof b.rep.title,
           "tshare-bench %s on %s, %s: %ld timed hand-offs per latency row, %ld shares per pipelined consumer, %ld "
           "between memory snapshots",
           TSHARE_BENCH_VERSION, host, date, b.opt.iters, b.opt.pipelined, b.opt.memory_shares);

  if (ucx_only) {
    bench_ucx(&b);
    br_print(&b.rep, stdout);
    return 0;
  }
  if (sets_only) { /* a model's state_dict, whole, beside torch.mp: its rows and targets alone */
    bench_sets(&b);
    bench_sets_targets(&b);
    br_print(&b.rep, stdout);
    return 0;
  }
  if (contention_only) { /* what the waiting policy is tuned against, alone */
    bench_contention(&b);
    br_print(&b.rep, stdout);
    return 0;
  }
  if (start_consumers(&b, "ring", -1) != 0) return 1;
  fprintf(stderr, "tshare-bench: %s\n", b.rep.device);
  snprintf(b.rep.label_suffix, sizeof b.rep.label_suffix, " [ring]");
  bench_host(&b);
  if (b.have_gpu) {
    bench_cuda(&b);
  } else {
    const char *rows[][3] = {{"latency", "cuda_new_alloc", "cuda (a), (b), (c) hand-offs and raw CUDA IPC"},
                             {"throughput", "cuda_pipelined_1", "cuda: shares/s to 1 and 4 consumers"},
                             {"bandwidth", "bw_shared", "consumer kernel on shared vs local memory"},
                             {"memory", "cuda_memory", "cuda: memory and handles"},
                             {"profile", "drv_event_record", "cuda: driver calls alone, tshare's own work per phase"}};
    char why[sizeof b.no_gpu_why + 16];
    snprintf(why, sizeof why, "no GPU (%s)", b.no_gpu_why);
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++)
      br_skip(&b.rep, strcmp(rows[i][0], "memory") == 0 ? BR_MEMORY : BR_VALUE, rows[i][0], rows[i][1], rows[i][2],
              why);
  }
  bench_idle_row(&b, 1000);
  stop_consumers(&b);

  /* The same hand-offs over the socket alone, and over the ring without a
   * spin budget (every wait sleeps on the futex): what the ring and the
   * spin each buy, in the same run. */
  static const struct {
    const char *transport, *key, *label;
    int spin_us, throughput;
  } variants[] = {{"socket", "_socket", " [socket]", -1, 1}, {"ring", "_ring_nospin", " [ring, no spin]", 0, 0}};
  for (size_t v = 0; v < sizeof variants / sizeof *variants; v++) {
    if (start_consumers(&b, variants[v].transport, variants[v].spin_us) != 0) return 1;
    snprintf(b.rep.key_suffix, sizeof b.rep.key_suffix, "%s", variants[v].key);
    snprintf(b.rep.label_suffix, sizeof b.rep.label_suffix, "%s", variants[v].label);
    bench_host_handoffs(&b, variants[v].throughput);
    if (b.have_gpu) bench_cuda_handoffs(&b, variants[v].throughput);
    bench_idle_row(&b, 1000);
    stop_consumers(&b);
  }
  b.rep.key_suffix[0] = b.rep.label_suffix[0] = '\0';
  bench_contention(&b);
  bench_ucx(&b);
  if (peers) {
    bench_peers_external(&b);
    if (sets) bench_sets(&b);
  }
  targets(&b);
  bench_sets_targets(&b);

  br_print(&b.rep, stdout);
  if (mkdir(out_dir, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "tshare-bench: cannot create %s: %s\n", out_dir, strerror(errno));
    return 1;
  }
  char json[4096], csv[4096];
  snprintf(json, sizeof json, "%s/bench.json", out_dir);
  snprintf(csv, sizeof csv, "%s/bench.csv", out_dir);
  if (br_write_json(&b.rep, json) != 0 || br_write_csv(&b.rep, csv) != 0) {
    fprintf(stderr, "tshare-bench: cannot write %s or %s\n", json, csv);
    return 1;
  }
  printf("written: %s, %s\n", json, csv);
  return 0;
}
