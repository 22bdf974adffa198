/* tshare-bench: what one run measures and the pieces that measure it.
 *
 * bench_host.c   the floors (bare frames), host-memory hand-offs, the
 *                pipelined-share pump, host memory over a long stream
 * bench_cuda.c   CUDA hand-offs (new allocation, reused, slab), raw IPC,
 *                throughput, bandwidth, GPU memory over a long stream
 * bench_contention.c  the same hand-offs with both ends on one CPU, and
 *                with a busy loop on every CPU: ring against socket
 * bench_ucx.c    host memory across two network namespaces over UCX, beside
 *                raw UCP
 * bench_peer.c   baselines run as other programs (torch.multiprocessing,
 *                the LibTorch bridge) and read back as result lines
 * bench_main.c   options, the consumers, targets, output */
#ifndef TSHARE_BENCH_H
#define TSHARE_BENCH_H

#include "bench_peers.h"
#include "bench_report.h"
#include "bench_stats.h"
#include "tshare/tshare.h"

#include <stdbool.h>

#define BENCH_MAX_CONSUMERS 4
#define BENCH_TIMEOUT_MS 60000
#define BENCH_SMALL_ELEMS 1024 /* the hand-off tensor: 1024 float32, 4 KiB */

typedef struct bench_opts {
  long iters;         /* timed hand-offs per latency row */
  long warmup;        /* untimed hand-offs before them */
  long pipelined;     /* shares per consumer in a throughput row */
  long memory_shares; /* shares between the memory snapshots */
  size_t bw_bytes;    /* the bandwidth tensor */
  int window;         /* shares in flight per consumer when pipelining */
  const char *python; /* interpreter for the torch.multiprocessing peer */
  const char *peer_script;
  const char *py_script;   /* the Python package's hand-off (tshare_py_peer.py) */
  const char *torch_bench; /* the LibTorch bridge's hand-off program, or NULL */
  const char *torch_sets_bench; /* the bridge's state_dict hand-off (bench_torch_sets), or NULL */
  const char *sets_py_script;   /* the state_dict from Python and torch.mp (sets_py_peer.py) */
  long set_iters, set_warmup;   /* timed and untimed hand-offs of a whole model, per row */
  int set_hidden_cpu;           /* the CPU rows' hidden size (the GPU's model scaled down) */
  const char *set_device;       /* "cuda" or "cpu": the state_dict rows of that device alone; NULL: both */
} bench_opts;

typedef struct bench {
  bench_opts opt;
  br_report rep;
  bp_peer peers[BENCH_MAX_CONSUMERS];
  int npeers;
  int have_gpu;
  double pump_share_us; /* last pump: mean time of one share call */
  double pump_busy;     /* last pump: share calls' share of each thread's time */
  char no_gpu_why[200];
} bench;

/* A share call for the pump: share src on ch once. lane: which consumer's
 * thread calls (0..npeers-1), e.g. to pick a stream of its own. */
typedef int (*bench_share_fn)(tshare_channel *ch, void *src, int lane, uint64_t *share_id);

/* Share through every one of the first npeers consumers at once (a thread
 * each, window shares in flight), per_peer shares each, the consumers
 * receiving and releasing. Shares per second overall, or a negative value
 * with why filled. */
double bench_pump(bench *b, int npeers, bench_share_fn share, void *src, long per_peer, char *why, size_t cap);

/* Where the last pump's producer time went, for the throughput rows' note. */
void bench_pump_note(const bench *b, br_row *row);

/* The throughput rows of one kind ("host", "cuda"): to 1 and to 4
 * consumers; unavailable (non-NULL) skips both with that reason. */
void bench_throughput_rows(bench *b, const char *what, bench_share_fn share, void *src, const char *unavailable);

/* A memory row: a figure before and after the long stream. */
br_row *bench_memory_row(bench *b, const char *key, const char *label, double before, double after, const char *unit);

/* A latency row from samples in nanoseconds. */
br_row *bench_latency_row(bench *b, const char *key, const char *label, bs_samples *ns, const char *floor_key,
                          const char *peer_key);

/* Note where a hand-off's time goes: the producer's share call (share_ns)
 * and the consumer's receive and release (its "recvt" answer). */
void bench_breakdown(br_row *row, bs_samples *share_ns, const char *reply);

/* One command to consumer 0 and its answer; a failure skips the row key. */
int bench_ask(bench *b, int peer, char *reply, size_t cap, const char *fmt, ...) __attribute__((format(printf, 5, 6)));

void bench_host(bench *b);
void bench_host_handoffs(bench *b, int throughput); /* floors, host hand-off, (throughput) */
void bench_idle_row(bench *b, int ms);
void bench_cuda(bench *b);
void bench_cuda_handoffs(bench *b, int throughput); /* (b), (c), (throughput) */
void bench_peers_external(bench *b);
void bench_contention(bench *b); /* one CPU for both ends; a busy loop on every CPU */
void bench_sets(bench *b);         /* a model's state_dict: the bridge, Python, torch.mp */
void bench_sets_targets(bench *b); /* their four targets */
/* Host memory over UCX across a veth pair beside raw UCP, with its two targets (bench_ucx.c). */
void bench_ucx(bench *b);

/* Run argv (another program), keep the last line it printed: 0 when it ran
 * to exit 0 and that line starts with "result"; else why says what it said. */
int bench_run_capture(char *const *argv, char *last, size_t cap, char *why, size_t why_cap);
/* A GPU row where there is no GPU (gpu set, none here): skipped saying why,
 * and true. */
bool bench_skipped_without_gpu(bench *b, int gpu, const char *key, const char *label);

/* Consumer side: commands the two halves answer (0 ok, -1 error, 1 not theirs). */
int bench_host_consumer(tshare_channel *ch, const char *cmd, char *reply, size_t cap);
int bench_cuda_consumer(tshare_channel *ch, const char *cmd, char *reply, size_t cap);
void *bench_cuda_consumer_stream(void); /* the consumer's stream, NULL without a GPU */
int bench_cuda_probe(char *why, size_t cap); /* 1 if a GPU is usable here */
void bench_cuda_describe(char *out, size_t cap);

#endif
