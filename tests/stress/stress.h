/* tshare-stress: fault trials and the load test, between real processes.
 *
 * The other processes are this binary again (`tshare-stress role NAME MEM
 * ARG`), with their channel on fd 3 (or wired by tshare-launch). Every
 * command prints its figures and exits 0 only when every check held; a
 * command on GPU memory exits 77 with the reason where no device is usable. */
#ifndef TSHARE_STRESS_H
#define TSHARE_STRESS_H

#include "tshare/tshare.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#define STRESS_SKIP 77
/* CUDA events tshare may keep per channel: the producer's pool (256) and
 * the releases' spares (64); a consumer opens at most the producer's pool.
 * They grow to what the traffic needs and stay: bounded, not a leak. */
#define STRESS_EVENTS_PER_CHANNEL (256 + 64)
#define STRESS_TIMEOUT_MS 20000

typedef enum stress_mem { STRESS_HOST = 0, STRESS_CUDA = 1 } stress_mem;

const char *stress_mem_name(stress_mem mem);
int stress_mem_parse(const char *text, stress_mem *out); /* "host" / "cuda"; -1 if neither */

/* Usable memory of that kind here; 0 if yes, else why (STRESS_SKIP). */
int stress_mem_ready(stress_mem mem, char *why, size_t cap); /* CUDA: also sets stress_gpu_on */

extern const char *stress_self; /* this binary */

/* ---- what a process holds ---- */

typedef struct stress_snapshot {
  long fds;             /* open fds */
  long rss_kib;         /* resident set */
  long long gpu_free;   /* bytes free on device 0, -1 without CUDA */
  uint64_t cuda_events; /* CUDA events tshare holds */
  uint64_t mappings;    /* CUDA mappings open */
} stress_snapshot;

void stress_snapshot_take(stress_snapshot *s);
void stress_snapshot_print(FILE *out, const char *label, const stress_snapshot *s);

/* ---- GPU helpers (stress_gpu.c; no-ops without CUDA) ---- */

extern bool stress_gpu_on; /* set by runs on GPU memory; until then nothing here touches CUDA */
long long stress_gpu_free_bytes(void);
int stress_gpu_fill(void *dev, size_t n, int32_t base);            /* v[k] = base + k */
long long stress_gpu_count_bad(void *dev, size_t n, int32_t base); /* -1 on a CUDA error */

/* ---- peer processes ---- */

typedef struct stress_peer {
  tshare_process *proc;
  tshare_channel *ch; /* ours */
} stress_peer;

/* Start `role NAME MEM ARG` with a socket channel on its fd 3; ch is ours. */
int stress_peer_start(const char *role, stress_mem mem, const char *arg, stress_peer *out, char *why, size_t cap);
/* Wait for the process to end; its exit code, 128+signal, or -1 (killed after timeout_ms). */
int stress_peer_wait(stress_peer *p, int timeout_ms);

/* ---- the producer's side ---- */

/* Memory to share from, for one channel: 128 slots of 64 KiB in one owned
 * allocation (a slot is reused once its last share is released), and now
 * and then a fresh allocation of random size that only its share holds. */
typedef struct stress_source stress_source;

stress_source *stress_source_create(stress_mem mem, uint32_t seed, char *why, size_t cap);
/* Share tensor number seq, of random size, with the pattern seq names in its
 * tag. windowed: wait (driving ch) for a free slot; otherwise reuse slots
 * without waiting and send a tag that asks for no check. */
int stress_source_share(stress_source *s, tshare_channel *ch, uint64_t seq, bool windowed, int timeout_ms);
void stress_source_destroy(stress_source *s);

uint32_t stress_rand(uint32_t *state); /* xorshift32 */

/* ---- roles ---- */

/* Elements of v that differ from the pattern its tag names (0 when the tag
 * asks for no check; -1 on a CUDA error). */
long long stress_view_bad(stress_mem mem, tshare_view *v);

/* Receive views until bye, check every element, hold a random number of
 * them and release in random order. arg: "seed[,report]"; prints
 * "views=N bad=N" (and memory at 10k views and at the end with report). */
int stress_role_consumer(tshare_channel *ch, stress_mem mem, const char *arg);
/* Share forever (until the peer goes away); arg: the seed. */
int stress_role_producer(tshare_channel *ch, stress_mem mem, const char *arg);

/* ---- commands ---- */

/* "--name VALUE" from argv, or def. */
long stress_opt(int argc, char **argv, const char *name, long def);
/* The memory kind named by the first argument ("host" or "cuda"); prints
 * usage and returns -1 otherwise. */
int stress_mem_arg(int argc, char **argv, stress_mem *mem);

int stress_kill_consumer(int argc, char **argv);
int stress_kill_producer(int argc, char **argv);
int stress_sigstop(int argc, char **argv);
int stress_sigint_launcher(int argc, char **argv);
int stress_load(int argc, char **argv);

#endif
