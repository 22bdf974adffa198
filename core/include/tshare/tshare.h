/* tshare/tshare.h - everything: include this, or the one module you use. */
#ifndef TSHARE_TSHARE_H
#define TSHARE_TSHARE_H

#include "tshare/channel.h"
#include "tshare/cuda.h"
#include "tshare/errors.h"
#include "tshare/hostmem.h"
#include "tshare/rendezvous.h"
#include "tshare/role.h"
#include "tshare/set.h"
#include "tshare/share.h"
#include "tshare/spawn.h"
#include "tshare/tensor.h"
#include "tshare/version.h"
#include "tshare/wire.h"

#endif
