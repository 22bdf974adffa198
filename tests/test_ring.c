/* The shared-memory ring on its own: one ring mapped twice in this process,
 * as its writer and as its reader, with the test playing the peer that
 * writes the words of the control page. What the fast path leaves out (the
 * head, read only when the room runs out; the reader's waiting word, on a
 * line of its own) must not cost a check or a wake-up: a head moved
 * anywhere is still refused before a byte goes past it, and a reader of
 * either layout that says it sleeps is woken. */
#include "harness.h"
#include "ring.h"

#include <stddef.h>

typedef struct ring_pair {
  ts_ring writer, reader;
} ring_pair;

static void open_pair(ring_pair *p) {
  int fd;
  char err[256];
  if (ts_ring_create(&p->writer, TS_RING_CAP_MIN, &fd, err, sizeof err) != 0) TS_FAIL("create: %s", err);
  if (ts_ring_attach(&p->reader, fd, TS_RING_CAP_MIN, err, sizeof err) != 0) TS_FAIL("attach: %s", err);
  close(fd);
}

static void close_pair(ring_pair *p) {
  ts_ring_unmap(&p->writer);
  ts_ring_unmap(&p->reader);
}

TS_TEST(the_writer_reads_the_head_only_when_its_room_runs_out_and_never_writes_past_it) {
  ring_pair p;
  open_pair(&p);
  uint8_t frame[64], out[TS_RING_CAP_MIN];
  memset(frame, 0x5a, sizeof frame);
  for (int i = 0; i < 16; i++) CHECK_EQ(ts_ring_write(&p.writer, frame, sizeof frame), 1);
  CHECK_EQ(ts_ring_read(&p.reader, out, sizeof out), 16 * 64); /* the reader's head: 1024 */
  /* A hostile head: past everything written. The writer still has the room
   * it saw (the whole ring) and does not look: a peer's line is pulled over
   * only when it must be. */
  atomic_store(&p.writer.ctl->head, UINT64_C(1) << 40);
  uint64_t written = 16 * 64;
  int w;
  while ((w = ts_ring_write(&p.writer, frame, sizeof frame)) == 1) {
    written += sizeof frame;
    if (written - p.writer.seen > TS_RING_CAP_MIN) TS_FAIL("wrote %llu bytes past the head it accepted",
                                                            (unsigned long long)(written - p.writer.seen));
  }
  CHECK_EQ(w, TS_RING_CORRUPT); /* once the room ran out, the head it read is refused */
  CHECK_EQ(written, TS_RING_CAP_MIN); /* every byte the reader had not freed, none more */
  CHECK_EQ(ts_ring_room(&p.writer, 1), TS_RING_CORRUPT);
  close_pair(&p);
}

TS_TEST(frames_built_in_place_stop_at_the_rings_end_and_the_room_left) {
  ring_pair p;
  open_pair(&p);
  uint8_t *slot, out[TS_RING_CAP_MIN];
  CHECK_EQ(ts_ring_slot(&p.writer, 4096, &slot), TS_RING_CAP_MIN);
  CHECK(slot == p.writer.data);
  memset(slot, 7, 1000);
  ts_ring_publish(&p.writer, 1000);
  CHECK_EQ(ts_ring_read(&p.reader, out, sizeof out), 1000);
  for (int i = 0; i < 1000; i++) CHECK_EQ(out[i], 7);
  /* In one piece: up to the ring's end, though the whole ring is free. */
  CHECK_EQ(ts_ring_slot(&p.writer, 4096, &slot), TS_RING_CAP_MIN - 1000);
  ts_ring_publish(&p.writer, TS_RING_CAP_MIN - 1000);
  CHECK_EQ(ts_ring_slot(&p.writer, 1, &slot), 1000); /* the bytes the reader freed, from the start */
  CHECK(slot == p.writer.data);
  ts_ring_publish(&p.writer, 1000);
  CHECK_EQ(ts_ring_slot(&p.writer, 1, &slot), 0); /* full */
  /* A head moved backwards is refused when the writer must read it. */
  atomic_store(&p.writer.ctl->head, 0);
  CHECK_EQ(ts_ring_slot(&p.writer, 1, &slot), TS_RING_CORRUPT);
  /* And one moved past what was written. */
  atomic_store(&p.writer.ctl->head, p.writer.mine + 1);
  CHECK_EQ(ts_ring_slot(&p.writer, 1, &slot), TS_RING_CORRUPT);
  atomic_store(&p.writer.ctl->head, p.writer.mine); /* all read: the whole ring is free again */
  CHECK_EQ(ts_ring_slot(&p.writer, 1, &slot), TS_RING_CAP_MIN - 1000);
  close_pair(&p);
}

TS_TEST(the_readers_waiting_word_shares_no_line_with_the_indices) {
  size_t own = offsetof(ts_ring_ctl, reader_waits_own) / 64;
  CHECK(own != offsetof(ts_ring_ctl, head) / 64);
  CHECK(own != offsetof(ts_ring_ctl, tail) / 64);
  CHECK(own != offsetof(ts_ring_ctl, bell) / 64);
  ring_pair p;
  open_pair(&p);
  CHECK_EQ(atomic_load(&p.writer.ctl->reader_waits_own), TS_RING_WAITS_UNUSED); /* until the reader says */
  ts_ring_reader_waits(&p.reader, TS_RING_FUTEX);
  CHECK_EQ(atomic_load(&p.reader.ctl->reader_waits_own), TS_RING_FUTEX);
  CHECK_EQ(atomic_load(&p.reader.ctl->reader_waits), TS_RING_FUTEX); /* for writers of the first layout */
  CHECK(ts_ring_reader_asleep(&p.writer));
  uint32_t bell = atomic_load(&p.reader.ctl->bell);
  CHECK_EQ(ts_ring_wake_reader(&p.writer), TS_RING_FUTEX);
  CHECK_EQ(atomic_load(&p.reader.ctl->bell), bell + 1);
  CHECK_EQ(atomic_load(&p.reader.ctl->reader_waits_own), TS_RING_AWAKE);
  CHECK(!ts_ring_reader_asleep(&p.writer));
  CHECK_EQ(ts_ring_wake_reader(&p.writer), TS_RING_AWAKE); /* one sleep, one wake-up */
  close_pair(&p);
}

TS_TEST(a_reader_of_the_first_layout_is_woken_through_its_word) {
  ring_pair p;
  open_pair(&p);
  /* Such a reader writes only reader_waits: its own line's word stays as
   * the writer created it. */
  atomic_store(&p.reader.ctl->reader_waits, TS_RING_FUTEX);
  CHECK(ts_ring_reader_asleep(&p.writer));
  uint32_t bell = atomic_load(&p.reader.ctl->bell);
  CHECK_EQ(ts_ring_wake_reader(&p.writer), TS_RING_FUTEX);
  CHECK_EQ(atomic_load(&p.reader.ctl->bell), bell + 1);
  CHECK_EQ(atomic_load(&p.reader.ctl->reader_waits), TS_RING_AWAKE);
  atomic_store(&p.reader.ctl->reader_waits, TS_RING_SOCKET);
  CHECK_EQ(ts_ring_wake_reader(&p.writer), TS_RING_SOCKET);
  CHECK_EQ(ts_ring_wake_reader(&p.writer), TS_RING_AWAKE);
  close_pair(&p);
}

TS_TEST_MAIN
