/* A model's state_dict handed over whole: 290 bf16 tensors of a 24-layer
 * transformer, through the LibTorch bridge (bench_torch_sets) and from
 * Python (sets_py_peer.py), as one tensor set and as one send per tensor,
 * beside torch.multiprocessing's q.put(state_dict), to 1 and 4 consumers,
 * CPU and CUDA. Each program measures the first hand-off (a new model) and
 * the repeated update (storages updated in place, sent again) in one run;
 * each gives two rows. On the CPU the model is scaled down (a smaller
 * hidden size) so a small machine copes; the rows say so. */
#include "bench.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define SETS_GPU_HIDDEN 1232 /* 290 bf16 tensors, ~836 MiB: the GPU rows' model */

typedef struct sets_run {
  const char *impl;  /* row key part: bridge, bridge_rebuilt, bridge_loop, python, python_loop, torch_mp */
  const char *what;  /* label part */
  const char *way;   /* --way (bridge) or --impl (Python) */
  int python;        /* run by the Python peer */
  int consumers;
  int pack;          /* --pack: the model's tensors packed into one allocation (share_model_ / share_module_) */
  int into;          /* each version into the consumer's tensors: Python recv into=, the bridge's recv_into */
} sets_run;

static const sets_run RUNS[] = {
    {"bridge", "bridge, one set", "set", 0, 1, 0, 0},
    {"bridge", "bridge, one set", "set", 0, 4, 0, 0},
    {"bridge_packed", "bridge, one set of a packed module", "set", 0, 1, 1, 0},
    {"bridge_into", "bridge, one set into the same tensors", "set", 0, 1, 0, 1},
    {"bridge_packed_into", "bridge, a packed module's set into the same tensors", "set", 0, 1, 1, 1},
    {"bridge_rebuilt", "bridge, one set built per send", "set-free", 0, 1, 0, 0},
    {"bridge_loop", "bridge, send per tensor", "loop", 0, 1, 0, 0},
    {"python", "Python, one set", "tshare", 1, 1, 0, 0},
    {"python", "Python, one set", "tshare", 1, 4, 0, 0},
    {"python_packed", "Python, one set of a packed module", "tshare", 1, 1, 1, 0},
    {"python_into", "Python, one set into the same tensors", "tshare", 1, 1, 0, 1},
    {"python_packed_into", "Python, a packed module's set into the same tensors", "tshare", 1, 1, 1, 1},
    {"python_loop", "Python, send per tensor", "tshare-loop", 1, 1, 0, 0},
    {"torch_mp", "torch.mp q.put(state_dict)", "torch-mp", 1, 1, 0, 0},
    {"torch_mp", "torch.mp q.put(state_dict)", "torch-mp", 1, 4, 0, 0},
};
static const char *const MODES[2] = {"first", "update"};

static void row_key(char *out, size_t cap, const char *impl, const char *dev, const char *mode, int consumers) {
  snprintf(out, cap, "sets_%s_%s_%s_%d", impl, dev, mode, consumers);
}

static void row_label(char *out, size_t cap, const sets_run *r, const char *dev, const char *mode) {
  snprintf(out, cap, "%s, %s, %s, %d consumer%s", r->what, dev, mode, r->consumers, r->consumers > 1 ? "s" : "");
}

/* Both rows of a run skipped, saying why. */
static void skip_run(bench *b, const sets_run *r, const char *dev, const char *why) {
  for (int m = 0; m < 2; m++) {
    char key[48], label[80];
    row_key(key, sizeof key, r->impl, dev, MODES[m], r->consumers);
    row_label(label, sizeof label, r, dev, MODES[m]);
    br_skip(&b->rep, BR_LATENCY, "sets", key, label, why);
  }
}

static void add_rows(bench *b, const sets_run *r, const char *dev, int hidden, const char *line) {
  for (int m = 0; m < 2; m++) {
    char key[48], label[80], field[32];
    row_key(key, sizeof key, r->impl, dev, MODES[m], r->consumers);
    row_label(label, sizeof label, r, dev, MODES[m]);
    br_row *row = br_add(&b->rep, BR_LATENCY, "sets", key, label, "us");
    snprintf(field, sizeof field, "%s_p50_us", MODES[m]);
    row->value = bp_field(line, field);
    snprintf(field, sizeof field, "%s_p99_us", MODES[m]);
    row->p99 = bp_field(line, field);
    row->n = (long)bp_field(line, "n");
    if (strcmp(r->impl, "torch_mp") != 0)
      row_key(row->peer_key, sizeof row->peer_key, "torch_mp", dev, MODES[m], r->consumers > 1 ? 4 : 1);
    snprintf(row->note, sizeof row->note, "%.0f bf16 tensors, %.1f MiB, hidden %d%s", bp_field(line, "tensors"),
             bp_field(line, "mib"), hidden,
             strcmp(dev, "cpu") == 0 ? " (scaled down from the GPU rows' 1232 for the CPU)" : "");
  }
}

static void run_one(bench *b, const sets_run *r, const char *dev, int hidden) {
  char consumers[16], hid[16], iters[32], warmup[32], last[512], why[600];
  snprintf(consumers, sizeof consumers, "%d", r->consumers);
  snprintf(hid, sizeof hid, "%d", hidden);
  snprintf(iters, sizeof iters, "%ld", b->opt.set_iters);
  snprintf(warmup, sizeof warmup, "%ld", b->opt.set_warmup);
  char *py[] = {(char *)b->opt.python, (char *)b->opt.sets_py_script, (char *)"--impl", (char *)r->way,
                (char *)"--device", (char *)dev, (char *)"--consumers", consumers, (char *)"--hidden", hid,
                (char *)"--iters", iters, (char *)"--warmup", warmup, NULL, NULL, NULL};
  char **flag = &py[sizeof py / sizeof *py - 3];
  if (r->pack) *flag++ = (char *)"--pack";
  if (r->into) *flag++ = (char *)"--into";
  char *bridge[] = {(char *)b->opt.torch_sets_bench, (char *)"--way", (char *)r->way, (char *)"--device", (char *)dev,
                    (char *)"--consumers", consumers, (char *)"--hidden", hid, (char *)"--iters", iters,
                    (char *)"--warmup", warmup, NULL, NULL, NULL, NULL};
  char **bridge_flag = &bridge[sizeof bridge / sizeof *bridge - 4];
  if (r->pack) *bridge_flag++ = (char *)"--pack";
  if (r->into) *bridge_flag++ = (char *)"--consumer", *bridge_flag++ = (char *)"into";
  if (!r->python && !b->opt.torch_sets_bench) {
    skip_run(b, r, dev, "built without LibTorch");
    return;
  }
  if (bench_run_capture(r->python ? py : bridge, last, sizeof last, why, sizeof why) != 0) {
    skip_run(b, r, dev, why);
    return;
  }
  add_rows(b, r, dev, hidden, last);
}

/* The note of row impl against the one set's row of the same mode, in this run. */
static void note_ratio(bench *b, const char *impl, const char *set_impl, const char *dev, const char *what) {
  for (int m = 0; m < 2; m++) {
    char key[48], set_key[48];
    row_key(key, sizeof key, impl, dev, MODES[m], 1);
    row_key(set_key, sizeof set_key, set_impl, dev, MODES[m], 1);
    br_row *row = br_find(&b->rep, key), *set = br_find(&b->rep, set_key);
    if (!row || !set) continue;
    size_t used = strlen(row->note);
    snprintf(row->note + used, sizeof row->note - used, "; %.1fx %s", row->value / set->value, what);
  }
}

/* The loop rows (and the bridge's set built per send): how much longer than
 * the one set (through a kept SetSender for the bridge), in this run. */
static void note_loop_ratios(bench *b, const char *dev) {
  note_ratio(b, "bridge_loop", "bridge", dev, "the one set's time");
  note_ratio(b, "python_loop", "python", dev, "the one set's time");
  note_ratio(b, "bridge_rebuilt", "bridge", dev, "the kept SetSender's time");
  note_ratio(b, "bridge_packed", "bridge", dev, "the unpacked model's time");
  note_ratio(b, "python_packed", "python", dev, "the unpacked model's time");
  note_ratio(b, "bridge_into", "bridge", dev, "tensors made ahead per version");
  note_ratio(b, "bridge_packed_into", "bridge_packed", dev, "tensors made ahead per version");
  note_ratio(b, "python_into", "python", dev, "new tensors per version");
  note_ratio(b, "python_packed_into", "python_packed", dev, "new tensors per version");
}

void bench_sets(bench *b) {
  const char *devices[2] = {"cuda", "cpu"};
  for (int d = 0; d < 2; d++) {
    const char *dev = devices[d];
    int gpu = d == 0, hidden = gpu ? SETS_GPU_HIDDEN : b->opt.set_hidden_cpu;
    for (size_t i = 0; i < sizeof RUNS / sizeof *RUNS; i++) {
      const sets_run *r = &RUNS[i];
      if (b->opt.set_device && strcmp(b->opt.set_device, dev) != 0) {
        char why[64];
        snprintf(why, sizeof why, "--set-device %s", b->opt.set_device);
        skip_run(b, r, dev, why);
        continue;
      }
      if (gpu && !b->have_gpu) {
        char why[256];
        snprintf(why, sizeof why, "no GPU: %s", b->no_gpu_why);
        skip_run(b, r, dev, why);
        continue;
      }
      run_one(b, r, dev, hidden);
    }
    note_loop_ratios(b, dev);
  }
}

/* ---- targets -------------------------------------------------------------- */

/* torch.mp's time / tshare's for every measured set row of mode (the
 * bridge's and Python's rows of impls, 1 and 4 consumers, both devices): the
 * smallest, and how many. */
static int worst_speedup(bench *b, const char *const impls[2], const char *mode, double *worst, char *which,
                         size_t cap) {
  int measured = 0;
  *worst = INFINITY;
  for (int d = 0; d < 2; d++)
    for (int py = 0; py < 2; py++)
      for (int n = 1; n <= 4; n += 3) {
        const char *dev = d ? "cpu" : "cuda";
        char key[48], mp_key[48];
        row_key(key, sizeof key, impls[py], dev, mode, n);
        row_key(mp_key, sizeof mp_key, "torch_mp", dev, mode, n);
        br_row *row = br_find(&b->rep, key), *mp = br_find(&b->rep, mp_key);
        if (!row || !mp) continue;
        measured++;
        double x = mp->value / row->value;
        if (x < *worst) {
          *worst = x;
          snprintf(which, cap, "%s (%.1f us vs %.1f us)", row->label, row->value, mp->value);
        }
      }
  return measured;
}

static void speedup_target(bench *b, const char *text, const char *const impls[2], const char *mode, double want) {
  double worst;
  char which[160] = "";
  int n = worst_speedup(b, impls, mode, &worst, which, sizeof which);
  if (!n)
    br_target_add(&b->rep, text, -1, "not measured");
  else
    br_target_add(&b->rep, text, worst >= want, "%d rows, the least %.1fx: %s", n, worst, which);
}

static void per_model_target(bench *b, const char *text, const char *impl, double limit_us) {
  char key[48], first_key[48], cpu_key[48];
  row_key(key, sizeof key, impl, "cuda", "update", 1);
  row_key(first_key, sizeof first_key, impl, "cuda", "first", 1);
  row_key(cpu_key, sizeof cpu_key, impl, "cpu", "update", 1);
  br_row *row = br_find(&b->rep, key), *first = br_find(&b->rep, first_key), *cpu = br_find(&b->rep, cpu_key);
  if (row)
    br_target_add(&b->rep, text, row->value <= limit_us, "%.1f us per model (update), first hand-off %.1f us",
                  row->value, first ? first->value : NAN);
  else if (cpu)
    br_target_add(&b->rep, text, -1, "not measured on a GPU (cpu, scaled down: %.1f us)", cpu->value);
  else
    br_target_add(&b->rep, text, -1, "not measured");
}

void bench_sets_targets(bench *b) {
  static const char *const one_set[2] = {"bridge", "python"}, *const packed[2] = {"bridge_packed", "python_packed"};
  static const char *const into[2] = {"bridge_into", "python_into"},
                           *const packed_into[2] = {"bridge_packed_into", "python_packed_into"};
  speedup_target(b, "sets: repeated update >= 100x faster than torch.mp q.put(state_dict)", one_set, "update", 100);
  /* The update pattern's own way for a consumer whose model runs on the
   * tensors: it keeps them and each version comes into them (Python's
   * Received.release and recv into=, the bridge's release and recv_into). */
  speedup_target(b, "sets: repeated update, a consumer receiving into its tensors, >= 100x faster than torch.mp",
                 into, "update", 100);
  speedup_target(b, "sets: repeated update of a packed module, received into the same tensors, >= 100x faster than "
                 "torch.mp", packed_into, "update", 100);
  per_model_target(b, "sets: per model to one consumer on CUDA <= 300 us through the bridge", "bridge", 300);
  per_model_target(b, "sets: per model to one consumer on CUDA <= 1 ms from Python", "python", 1000);
  speedup_target(b, "sets: first hand-off >= 20x faster than torch.mp q.put(state_dict)", one_set, "first", 20);
  /* A new model of the caching allocator's hundreds of blocks lies in tens
   * of segments, and each is one CUDA IPC open on the consumer (35-51 us on
   * an H200, tshare-ipc-costs; opens from several threads are slower): a
   * driver floor torch.mp pays too. A module packed into one allocation
   * opens one. */
  speedup_target(b, "sets: first hand-off of a packed module >= 20x faster than torch.mp q.put(state_dict)", packed,
                 "first", 20);
}
