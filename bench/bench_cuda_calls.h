/* The driver calls tshare makes, counted and timed per phase of a hand-off.
 *
 * This program defines stand-ins for the driver entry points on the
 * hand-off path and exports them (ENABLE_EXPORTS): the core looks each
 * entry point up in the global scope before libcuda (core/src/cuda_driver.c),
 * so its driver table calls these, which call the driver. While a phase is
 * set, each call is counted and timed under it; with none set a stand-in
 * only forwards. The library itself is unchanged: the counting exists in
 * this program alone. */
#ifndef TSHARE_BENCH_CUDA_CALLS_H
#define TSHARE_BENCH_CUDA_CALLS_H

#include <stddef.h>

typedef enum bc_phase { BC_OFF, BC_SHARE, BC_IMPORT, BC_RELEASE, BC_PHASES } bc_phase;

/* Calls per hand-off of one phase, function by function. */
#define BC_FUNCS_MAX 32
typedef struct bc_tally {
  int n; /* functions */
  double calls[BC_FUNCS_MAX], us[BC_FUNCS_MAX];
} bc_tally;

/* Whether the core's driver table calls the stand-ins (table: the core's
 * table, as ts_cuda returned it); why says why not. */
int bc_active(const void *table, char *why, size_t cap);
void bc_set_phase(bc_phase phase);
void bc_reset(void);
const char *bc_name(int fn);

/* This process's counts of phase, per hand-off of n, as text (for a
 * consumer's answer) and back: "idx:calls:ns,..." totals. */
void bc_encode(bc_phase phase, char *out, size_t cap);
void bc_decode(const char *text, long n, bc_tally *out);
void bc_tally_of(bc_phase phase, long n, bc_tally *out);

/* Totals of a tally: driver time and calls per hand-off. */
double bc_tally_us(const bc_tally *t);
double bc_tally_calls(const bc_tally *t);
/* "cuCtxPushCurrent 1, cuStreamQuery 1, ..." (calls per hand-off). */
void bc_tally_describe(const bc_tally *t, char *out, size_t cap);

/* The driver's own entry point (not the stand-in) by ABI name; NULL if absent. */
void *bc_real(const char *abi_name);

#endif
