#include "conn.h"
#include "session.h"
#include "error_detail.h"
#include "backend_host.h"
