/* The input language of fuzz_sets.c, shared with gen_corpus.c (which writes
 * its seeds): each operation is an opcode byte (taken modulo SET_OP_COUNT)
 * followed by the argument bytes listed beside it. */
#ifndef TSHARE_FUZZ_SETS_OPS_H
#define TSHARE_FUZZ_SETS_OPS_H

enum {
  SET_OP_BEGIN,     /* id, count, mem_count, names_bytes (bits 2-4 also the layout slot, mod 5), meta_bytes */
  SET_OP_MEM,       /* id, index, how (bit 0: no fd, bit 1: CUDA kind, bits 2-3: alloc_size pick, bit 4: offered to
                       be kept, bit 5: named as kept: TSHARE_MEM_HOST_KEPT, no fd) */
  SET_OP_MEMBER,    /* id, index, mem_index, name pick, offset, shape pick */
  SET_OP_META,      /* id, offset, len */
  SET_OP_END,       /* id */
  SET_OP_SHARE,     /* id: a single host share of the peer's memory */
  SET_OP_RAW,       /* len, then that many bytes straight onto the socket */
  SET_OP_RECV_SET,  /* the consumer takes a set if one waits: every tensor read, views taken and dropped */
  SET_OP_RECV_VIEW, /* the consumer takes a single share if one waits */
  SET_OP_PEER_EXIT, /* the peer hangs up: what is left is drained, the rest of the input ignored */
  SET_OP_AGAIN,     /* id, layout slot (mod 6: 0 and 5 are refused by the encoder), layout id pick, meta_bytes */
  SET_OP_DROPPED,   /* id, layout slot (mod 6, as AGAIN's), layout id pick (odd: the id, even: another, which the
                       encoder refuses): the peer says it lost a layout of this end's sets */
  SET_OP_COUNT
};

#define SET_FUZZ_IDS 4       /* set ids 1..4: repeats and near misses are common */
#define SET_FUZZ_MEM 4096    /* bytes of the peer's memfd */

#endif
