/* The msgpack subset of tp_msgpack.h. Multi-byte numbers are big-endian on
 * the msgpack wire (unlike tensor bytes, which are little-endian). */
#include "tp_msgpack.h"

#include <string.h>

/* --- writing ------------------------------------------------------------- */

void mp_writer_init(mp_writer *w, unsigned char *buf, size_t cap)
{
    w->buf = buf;
    w->len = 0;
    w->cap = cap;
    w->failed = 0;
}

static void put_bytes(mp_writer *w, const void *data, size_t n)
{
    if (w->failed || n > w->cap - w->len) {
        w->failed = 1;
        return;
    }
    memcpy(w->buf + w->len, data, n);
    w->len += n;
}

/* a type byte followed by `size` bytes of `v`, big-endian */
static void put_typed(mp_writer *w, unsigned char type, uint64_t v, int size)
{
    unsigned char out[9];
    out[0] = type;
    for (int k = 0; k < size; k++)
        out[1 + k] = (unsigned char)(v >> (8 * (size - 1 - k)));
    put_bytes(w, out, (size_t)size + 1);
}

/* a length in the shortest of up to three forms: fix (inside the type byte), 16-bit, 32-bit */
static void put_length(mp_writer *w, uint32_t n, unsigned char fix, uint32_t fix_max,
                       unsigned char type16, unsigned char type32)
{
    if (n <= fix_max)
        put_typed(w, (unsigned char)(fix | n), 0, 0);
    else if (n <= 0xffff)
        put_typed(w, type16, n, 2);
    else
        put_typed(w, type32, n, 4);
}

void mp_write_map(mp_writer *w, uint32_t entries) { put_length(w, entries, 0x80, 15, 0xde, 0xdf); }

void mp_write_array(mp_writer *w, uint32_t items) { put_length(w, items, 0x90, 15, 0xdc, 0xdd); }

void mp_write_str(mp_writer *w, const char *s)
{
    size_t n = strlen(s);
    if (n > 0xffffffffu) {
        w->failed = 1;
        return;
    }
    if (n <= 31)
        put_typed(w, (unsigned char)(0xa0 | n), 0, 0);
    else if (n <= 0xff)
        put_typed(w, 0xd9, n, 1);
    else if (n <= 0xffff)
        put_typed(w, 0xda, n, 2);
    else
        put_typed(w, 0xdb, n, 4);
    put_bytes(w, s, n);
}

void mp_write_bin(mp_writer *w, const void *data, uint32_t size)
{
    if (size <= 0xff)
        put_typed(w, 0xc4, size, 1);
    else if (size <= 0xffff)
        put_typed(w, 0xc5, size, 2);
    else
        put_typed(w, 0xc6, size, 4);
    put_bytes(w, data, size);
}

void mp_write_int(mp_writer *w, int64_t v)
{
    if (v >= 0) {
        uint64_t u = (uint64_t)v;
        if (u <= 0x7f)
            put_typed(w, (unsigned char)u, 0, 0);        /* positive fixint */
        else if (u <= 0xff)
            put_typed(w, 0xcc, u, 1);
        else if (u <= 0xffff)
            put_typed(w, 0xcd, u, 2);
        else if (u <= 0xffffffffu)
            put_typed(w, 0xce, u, 4);
        else
            put_typed(w, 0xcf, u, 8);
    } else if (v >= -32) {
        put_typed(w, (unsigned char)(0xe0 | (v + 32)), 0, 0);   /* negative fixint */
    } else if (v >= INT8_MIN) {
        put_typed(w, 0xd0, (uint64_t)v, 1);
    } else if (v >= INT16_MIN) {
        put_typed(w, 0xd1, (uint64_t)v, 2);
    } else if (v >= INT32_MIN) {
        put_typed(w, 0xd2, (uint64_t)v, 4);
    } else {
        put_typed(w, 0xd3, (uint64_t)v, 8);
    }
}

void mp_write_nil(mp_writer *w) { put_typed(w, 0xc0, 0, 0); }

void mp_write_bool(mp_writer *w, int v) { put_typed(w, v ? 0xc3 : 0xc2, 0, 0); }

/* --- reading ------------------------------------------------------------- */

void mp_reader_init(mp_reader *r, const void *data, size_t size)
{
    r->p = data;
    r->end = r->p + size;
    r->failed = 0;
}

static int fail(mp_reader *r)
{
    r->failed = 1;
    return -1;
}

/* the next `size` bytes as a big-endian unsigned number */
static int take_uint(mp_reader *r, int size, uint64_t *out)
{
    if (r->end - r->p < size)
        return fail(r);
    uint64_t v = 0;
    for (int k = 0; k < size; k++)
        v = (v << 8) | r->p[k];
    r->p += size;
    *out = v;
    return 0;
}

/* `len` bytes that belong to the item (a string's, a bin's) */
static int take_bytes(mp_reader *r, mp_item *item, uint64_t len)
{
    if (len > (uint64_t)(r->end - r->p))
        return fail(r);
    item->ptr = r->p;
    item->len = (uint32_t)len;
    r->p += len;
    return 0;
}

static int64_t sign_extend(uint64_t v, int size)
{
    int bits = 8 * size;
    if (bits < 64 && (v >> (bits - 1)) & 1)
        v |= ~0ull << bits;
    return (int64_t)v;
}

int mp_read(mp_reader *r, mp_item *item)
{
    uint64_t n;
    memset(item, 0, sizeof *item);
    if (r->failed || r->p >= r->end)
        return fail(r);
    unsigned char t = *r->p++;

    if (t <= 0x7f) { item->type = MP_INT; item->i = t; return 0; }
    if (t >= 0xe0) { item->type = MP_INT; item->i = (int64_t)t - 256; return 0; }
    if ((t & 0xf0) == 0x80) { item->type = MP_MAP; item->len = t & 0x0f; return 0; }
    if ((t & 0xf0) == 0x90) { item->type = MP_ARRAY; item->len = t & 0x0f; return 0; }
    if ((t & 0xe0) == 0xa0) { item->type = MP_STR; return take_bytes(r, item, t & 0x1f); }

    switch (t) {
    case 0xc0: item->type = MP_NIL; return 0;
    case 0xc2: case 0xc3: item->type = MP_BOOL; item->i = t == 0xc3; return 0;
    case 0xc4: case 0xc5: case 0xc6:                      /* bin 8/16/32 */
        item->type = MP_BIN;
        if (take_uint(r, 1 << (t - 0xc4), &n)) return -1;
        return take_bytes(r, item, n);
    case 0xd9: case 0xda: case 0xdb:                      /* str 8/16/32 */
        item->type = MP_STR;
        if (take_uint(r, 1 << (t - 0xd9), &n)) return -1;
        return take_bytes(r, item, n);
    case 0xcc: case 0xcd: case 0xce: case 0xcf:           /* uint 8/16/32/64 */
        item->type = MP_INT;
        if (take_uint(r, 1 << (t - 0xcc), &n)) return -1;
        item->i = n > INT64_MAX ? INT64_MAX : (int64_t)n;
        return 0;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3:           /* int 8/16/32/64 */
        item->type = MP_INT;
        if (take_uint(r, 1 << (t - 0xd0), &n)) return -1;
        item->i = sign_extend(n, 1 << (t - 0xd0));
        return 0;
    case 0xca: {                                          /* float 32 */
        float f;
        uint32_t bits;
        if (take_uint(r, 4, &n)) return -1;
        bits = (uint32_t)n;
        memcpy(&f, &bits, sizeof f);
        item->type = MP_FLOAT;
        item->f = f;
        return 0;
    }
    case 0xcb:                                            /* float 64 */
        if (take_uint(r, 8, &n)) return -1;
        memcpy(&item->f, &n, sizeof item->f);
        item->type = MP_FLOAT;
        return 0;
    case 0xdc: case 0xdd:                                 /* array 16/32 */
        item->type = MP_ARRAY;
        if (take_uint(r, t == 0xdc ? 2 : 4, &n)) return -1;
        item->len = (uint32_t)n;
        return 0;
    case 0xde: case 0xdf:                                 /* map 16/32 */
        item->type = MP_MAP;
        if (take_uint(r, t == 0xde ? 2 : 4, &n)) return -1;
        item->len = (uint32_t)n;
        return 0;
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:  /* fixext 1..16: type byte + data */
        item->type = MP_EXT;
        return take_bytes(r, item, 1 + (1u << (t - 0xd4)));
    case 0xc7: case 0xc8: case 0xc9:                      /* ext 8/16/32: length, type byte, data */
        item->type = MP_EXT;
        if (take_uint(r, 1 << (t - 0xc7), &n)) return -1;
        return take_bytes(r, item, n + 1);
    default:                                              /* 0xc1: never used */
        return fail(r);
    }
}

int mp_skip(mp_reader *r)
{
    /* no recursion: count the values still to skip (each takes at least one
     * byte, so a forged huge count fails when the bytes run out) */
    uint64_t pending = 1;
    mp_item item;
    while (pending > 0) {
        if (mp_read(r, &item))
            return -1;
        pending--;
        if (item.type == MP_ARRAY)
            pending += item.len;
        else if (item.type == MP_MAP)
            pending += 2 * (uint64_t)item.len;
    }
    return 0;
}

int mp_is_str(const mp_item *item, const char *s)
{
    size_t n = strlen(s);
    return item->type == MP_STR && item->len == n && memcmp(item->ptr, s, n) == 0;
}
