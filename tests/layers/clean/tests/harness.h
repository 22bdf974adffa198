#include "tshare/errors.h"
