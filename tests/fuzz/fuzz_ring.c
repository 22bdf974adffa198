/* Fuzz target: the ring transport's reader and writer against a peer that
 * wrote anything into the shared memory. The input sets the ring's control
 * page (the peer's tail or head, the wait words) and its data bytes; the
 * reader then copies out and decodes what it accepts, as the connection
 * does, and the writer tries to append a frame past the head the peer set.
 *
 * Input: u64 tail, u64 head, u32 reader_waits, u32 writer_waits, u8 steps,
 * then the ring's bytes (repeated to fill it). The reader's waiting word on
 * its own line is the peer's too: left as created (a reader of the first
 * layout) when steps' bit 3 is clear, else reader_waits turned around. */
#include "ring.h"
#include "tshare/wire.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FUZZ_RING_CAP TS_RING_CAP_MIN

static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static uint32_t get_u32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 25) return 0;
  static ts_ring reader, writer;
  static int ready;
  if (!ready) { /* one ring, mapped twice: as its reader and as its writer */
    int fd;
    char err[256];
    if (ts_ring_create(&writer, FUZZ_RING_CAP, &fd, err, sizeof err) != 0) abort();
    if (ts_ring_attach(&reader, fd, FUZZ_RING_CAP, err, sizeof err) != 0) abort();
    close(fd);
    ready = 1;
  }
  reader.mine = reader.seen = 0;
  writer.mine = writer.seen = 0;
  /* Where each end stands is its own (private) business: start both at an
   * offset the input picks, the peer's words at whatever it says. */
  uint64_t start = get_u64(data + 8) & 0xffff;
  reader.mine = reader.seen = start;
  writer.mine = start + (get_u64(data) & (FUZZ_RING_CAP - 1));
  writer.seen = start;
  atomic_store(&reader.ctl->tail, get_u64(data));
  atomic_store(&writer.ctl->head, get_u64(data + 8));
  atomic_store(&reader.ctl->reader_waits, get_u32(data + 16));
  atomic_store(&reader.ctl->writer_waits, get_u32(data + 20));
  atomic_store(&writer.ctl->reader_waits_own,
               data[24] & 8 ? (get_u32(data + 16) >> 16 | get_u32(data + 16) << 16) : TS_RING_WAITS_UNUSED);
  unsigned steps = data[24] % 8 + 1;
  const uint8_t *bytes = data + 25;
  size_t n = size - 25;
  for (size_t i = 0; n && i < FUZZ_RING_CAP; i++) reader.data[i] = bytes[i % n];

  tshare_decoder *dec = tshare_decoder_create(NULL);
  if (!dec) abort();
  uint64_t taken = 0;
  for (unsigned s = 0; s < steps; s++) {
    uint8_t *space;
    size_t cap;
    if (tshare_decoder_space(dec, &space, &cap) != 0) break;
    long got = ts_ring_read(&reader, space, cap);
    if (got < 0) break; /* the corrupt tail was refused */
    if ((uint64_t)got > cap || (uint64_t)got > FUZZ_RING_CAP) abort();
    taken += (uint64_t)got;
    if (taken > FUZZ_RING_CAP) abort(); /* never more than the peer could have written */
    tshare_decoder_commit(dec, (size_t)got);
    tshare_frame f;
    int rc;
    while ((rc = tshare_decoder_next(dec, &f)) == 0) {
    }
    if (rc < 0) break;
    (void)ts_ring_wake_writer(&reader);
  }
  tshare_decoder_destroy(dec);

  /* The writer facing a head the peer moved anywhere. */
  uint8_t frame[64];
  memset(frame, 0x5a, sizeof frame);
  int w = ts_ring_write(&writer, frame, sizeof frame);
  if (w < TS_RING_CORRUPT || w > 1) abort();
  if (w == 1 && writer.mine - writer.seen > FUZZ_RING_CAP) abort(); /* wrote past what the reader freed */
  int how = ts_ring_wake_reader(&writer);
  if (how != TS_RING_AWAKE && how != TS_RING_FUTEX && how != TS_RING_SOCKET) abort();

  /* A frame built in place: the slot lies inside the ring's data, within
   * what the reader freed, and never wraps. */
  uint8_t *slot;
  long room = ts_ring_slot(&writer, sizeof frame, &slot);
  if (room < TS_RING_CORRUPT) abort();
  if (room > 0) {
    if (slot < writer.data || slot + room > writer.data + FUZZ_RING_CAP) abort();
    if (writer.mine - writer.seen + (uint64_t)room > FUZZ_RING_CAP) abort();
    size_t n = (size_t)room < sizeof frame ? (size_t)room : sizeof frame;
    memcpy(slot, frame, n);
    ts_ring_publish(&writer, n);
  }
  return 0;
}
