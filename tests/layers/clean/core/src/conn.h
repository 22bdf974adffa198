#include "tshare/errors.h"
int ts_conn_open(void);
