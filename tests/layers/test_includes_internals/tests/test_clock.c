#include "clock.h"
#include "ring.h"
