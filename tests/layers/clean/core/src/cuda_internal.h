#include "cuda_driver.h"
