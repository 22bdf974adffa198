/* Internal little-endian put/get helpers. Fields are never read by casting a
 * struct onto a buffer: every multi-byte value goes through these, one
 * memcpy and <endian.h>'s conversion each (a no-op on little-endian hosts;
 * a loop over the bytes was not merged by the compiler and cost eight steps
 * per field on every frame). */
#ifndef TSHARE_BYTES_H
#define TSHARE_BYTES_H

#include <endian.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct ts_writer {
  uint8_t *p;
  size_t left;
  bool overflow; /* set once a put did not fit; later puts are dropped */
} ts_writer;

typedef struct ts_reader {
  const uint8_t *p;
  size_t left;
  bool short_read; /* set once a get ran past the end; later gets return 0 */
} ts_reader;

static inline void ts_put_bytes(ts_writer *w, const void *src, size_t n) {
  if (w->overflow || n > w->left) {
    w->overflow = true;
    return;
  }
  if (n) memcpy(w->p, src, n);
  w->p += n;
  w->left -= n;
}
static inline void ts_put_u8(ts_writer *w, uint8_t v) { ts_put_bytes(w, &v, 1); }
static inline void ts_put_u16(ts_writer *w, uint16_t v) {
  v = htole16(v);
  ts_put_bytes(w, &v, 2);
}
static inline void ts_put_u32(ts_writer *w, uint32_t v) {
  v = htole32(v);
  ts_put_bytes(w, &v, 4);
}
static inline void ts_put_u64(ts_writer *w, uint64_t v) {
  v = htole64(v);
  ts_put_bytes(w, &v, 8);
}

static inline bool ts_get_bytes(ts_reader *r, void *dst, size_t n) {
  if (r->short_read || n > r->left) {
    r->short_read = true;
    if (n) memset(dst, 0, n);
    return false;
  }
  if (n) memcpy(dst, r->p, n);
  r->p += n;
  r->left -= n;
  return true;
}
static inline uint8_t ts_get_u8(ts_reader *r) {
  uint8_t v = 0;
  ts_get_bytes(r, &v, 1);
  return v;
}
static inline uint16_t ts_get_u16(ts_reader *r) {
  uint16_t v = 0;
  ts_get_bytes(r, &v, 2);
  return le16toh(v);
}
static inline uint32_t ts_get_u32(ts_reader *r) {
  uint32_t v = 0;
  ts_get_bytes(r, &v, 4);
  return le32toh(v);
}
static inline uint64_t ts_get_u64(ts_reader *r) {
  uint64_t v = 0;
  ts_get_bytes(r, &v, 8);
  return le64toh(v);
}

#endif
