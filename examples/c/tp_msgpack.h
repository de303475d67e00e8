/* The part of msgpack (https://msgpack.org/) a torchpool client needs.
 *
 * A writer into a caller's fixed buffer, and a reader that walks a message
 * one item at a time. Both check every length against the buffer: a reply
 * that is cut short or malformed sets `failed`, it never reads or writes
 * past the end. The writer picks the shortest encoding of each value, as
 * msgpack-python does, so a header written here is byte for byte the one
 * the Python client writes (docs/protocol.md, "Test vectors").
 */
#ifndef TP_MSGPACK_H
#define TP_MSGPACK_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    unsigned char *buf;
    size_t len;       /* bytes written so far */
    size_t cap;
    int failed;       /* the buffer was too small: nothing more is written */
} mp_writer;

void mp_writer_init(mp_writer *w, unsigned char *buf, size_t cap);
void mp_write_map(mp_writer *w, uint32_t entries);
void mp_write_array(mp_writer *w, uint32_t items);
void mp_write_str(mp_writer *w, const char *s);
void mp_write_bin(mp_writer *w, const void *data, uint32_t size);
void mp_write_int(mp_writer *w, int64_t v);
void mp_write_nil(mp_writer *w);
void mp_write_bool(mp_writer *w, int v);

typedef enum {
    MP_NIL, MP_BOOL, MP_INT, MP_FLOAT, MP_STR, MP_BIN, MP_ARRAY, MP_MAP, MP_EXT
} mp_type;

typedef struct {
    mp_type type;
    int64_t i;                 /* MP_BOOL, MP_INT (a uint64 above INT64_MAX is clamped to it) */
    double f;                  /* MP_FLOAT */
    const unsigned char *ptr;  /* MP_STR, MP_BIN, MP_EXT: the bytes (not NUL-terminated) */
    uint32_t len;              /* their length; MP_ARRAY: items; MP_MAP: key/value pairs */
} mp_item;

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
    int failed;        /* malformed or cut short: every later read fails too */
} mp_reader;

void mp_reader_init(mp_reader *r, const void *data, size_t size);
/* Read the next item. A string or bin comes with its bytes; an array or map
 * only with its count: its items follow. Returns 0 on success, -1 on failure. */
int mp_read(mp_reader *r, mp_item *item);
/* Skip the next value whole (an array or map with everything in it). */
int mp_skip(mp_reader *r);
/* Is this item the string `s`? */
int mp_is_str(const mp_item *item, const char *s);

#endif
