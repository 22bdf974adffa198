/* What the wire's own files share and nothing else includes: the limits as a
 * caller's tshare_wire_limits may lower them, which memory kinds travel as an
 * fd, and the ring, chunk and rkey frames' rules, which the encoder and the decoder
 * apply alike. Checks the library calls elsewhere are in wire_checks.h. */
#ifndef TSHARE_WIRE_RULES_H
#define TSHARE_WIRE_RULES_H

#include "tshare/wire.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* in, lowered where it asks for more than the hard maxima allow; the
 * defaults when in is NULL. */
tshare_wire_limits ts_wire_limits_clamp(const tshare_wire_limits *in);

/* A share or set memory of this kind carries its memory as an attached fd. */
static inline bool ts_wire_kind_takes_fd(int kind) {
  return kind == TSHARE_MEM_HOST_MEMFD || kind == TSHARE_MEM_CUDA_FD || kind == TSHARE_MEM_HOST_FD;
}

/* Host memory: a memfd or an unsealed file, attached, or a memfd already mapped by the receiver. */
static inline bool ts_wire_kind_is_host(int kind) {
  return kind == TSHARE_MEM_HOST_MEMFD || kind == TSHARE_MEM_HOST_KEPT || kind == TSHARE_MEM_HOST_FD;
}

/* A set memory of this kind carries share_flags (the CUDA kinds): a host
 * memory's frame stays as wire 1.3 first had it. */
static inline bool ts_wire_set_mem_has_flags(int kind) {
  return kind == TSHARE_MEM_CUDA_IPC || kind == TSHARE_MEM_CUDA_FD || kind == TSHARE_MEM_CUDA_HELD;
}

/* A host set memory's share_flags are appended (minor 5) only when not 0:
 * with none, its frame is byte for byte that of 1.3. */
static inline bool ts_wire_set_mem_appends_flags(int kind, uint32_t share_flags) {
  return ts_wire_kind_is_host(kind) && share_flags != 0;
}

int ts_wire_check_ring(const tshare_ring_frame *ring, uint8_t flags, char *err, size_t err_cap);
int ts_wire_check_chunk(const tshare_chunk_frame *chunk, uint8_t flags, uint64_t max_alloc_size, char *err,
                        size_t err_cap);
int ts_wire_check_rkey(const tshare_rkey_frame *rkey, uint8_t flags, uint64_t max_alloc_size, char *err,
                       size_t err_cap);

#endif
