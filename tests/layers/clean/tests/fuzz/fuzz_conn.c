#include "conn.h"
#include "ring.h"
