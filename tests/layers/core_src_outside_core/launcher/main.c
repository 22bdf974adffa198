#include "log.h" /* the launcher's own */
#include "session.h"
#include "tshare/channel.h"
