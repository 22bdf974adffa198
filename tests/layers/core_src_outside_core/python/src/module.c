#include "tshare/tshare.h"

#include "../../core/src/conn.h"
