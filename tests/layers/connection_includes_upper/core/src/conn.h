#include "tshare/channel.h"
#include "tshare/wire.h"
