#include "ring.h"
#include "clock.h"
