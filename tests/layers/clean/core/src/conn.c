#include "conn.h"
#include "ring.h"
#include "log.h"
#include "tshare/wire.h"
/* #include "session.h" in a comment is no include */
int ts_conn_open(void) { return ts_ring_size(); }
