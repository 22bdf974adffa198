/* Internal little-endian put/get helpers. Fields are never read by casting a
 * struct onto a buffer: every multi-byte value goes through these. */
#ifndef TSHARE_BYTES_H
#define TSHARE_BYTES_H

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
  uint8_t b[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
  ts_put_bytes(w, b, 2);
}
static inline void ts_put_u32(ts_writer *w, uint32_t v) {
  uint8_t b[4];
  for (int i = 0; i < 4; i++) b[i] = (uint8_t)(v >> (8 * i));
  ts_put_bytes(w, b, 4);
}
static inline void ts_put_u64(ts_writer *w, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
  ts_put_bytes(w, b, 8);
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
  uint8_t b[2];
  ts_get_bytes(r, b, 2);
  return (uint16_t)(b[0] | (b[1] << 8));
}
static inline uint32_t ts_get_u32(ts_reader *r) {
  uint8_t b[4];
  ts_get_bytes(r, b, 4);
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)b[i] << (8 * i);
  return v;
}
static inline uint64_t ts_get_u64(ts_reader *r) {
  uint8_t b[8];
  ts_get_bytes(r, b, 8);
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)b[i] << (8 * i);
  return v;
}

#endif
