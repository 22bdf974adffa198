#include "tshare/share.h"
#include "log.h"
