#include "u64map.h"
