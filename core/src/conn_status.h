/* The connection layer's own statuses: one space beside the public
 * tshare_status list, for what never leaves the library as itself.
 *
 * Public statuses are 0 (TSHARE_OK), 1 (TSHARE_AGAIN) and small negative
 * numbers; errno values are small positive ones. These lie apart from both
 * (at and below -1000), so a value that holds "an errno, or ours" (an fd's
 * `lost` reason) or "a count, or ours" (a ring read) stays unambiguous. At
 * the layer's boundary ts_conn_status_public() names the public status that
 * stands for each, for whoever must report one. */
#ifndef TSHARE_CONN_STATUS_H
#define TSHARE_CONN_STATUS_H

typedef enum ts_conn_status {
  /* A receive's wait was cut short by ts_conn_wake() before a frame came;
   * the session does its queued work and receives again (public: TSHARE_AGAIN). */
  TS_CONN_WOKEN = -1000,
  /* An fd that came with a frame was closed on arrival: the connection held
   * its fd budget (an fd's `lost` reason beside EMFILE/ENFILE; public:
   * TSHARE_E_LIMIT). */
  TS_FD_OVER_BUDGET = -1001,
  /* The peer moved an index of a shared ring outside the ring (a ring call's
   * result beside counts and 1/0; public: TSHARE_E_PROTOCOL). */
  TS_RING_CORRUPT = -1002,
} ts_conn_status;

/* The public tshare_status for a connection status (TSHARE_E_STATE for a
 * value that is none of them: a status that should never have left). */
int ts_conn_status_public(int status);

#endif
