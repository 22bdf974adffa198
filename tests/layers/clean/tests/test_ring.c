#include "ring.h"
#include "log.h"
#include "harness.h"
