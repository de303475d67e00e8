/* BYTES tensors: walking the 4-byte little-endian length prefixes in C.
 *
 * Why: a BYTES tensor is prod(shape) elements, each a 4-byte little-endian
 * length and that many bytes (Triton's layout). The broker checks every BYTES
 * input before accepting it, on its single thread; a Python loop over the
 * elements took 1.75 s for one tensor of 4M empty strings on the development
 * VM (5 s on a slower one), during which the broker answered nobody. This
 * walk takes milliseconds for it, and large buffers are walked without the
 * GIL.
 *
 * The buffer may be shared memory that a client writes while we read it, so
 * each length prefix is read exactly once, into a local, and every bound is
 * checked against that copy: whatever the client does, nothing is read
 * outside the buffer. (A client can still make a later reader see different
 * elements; every reader checks again.)
 *
 * Functions (ValueError, with the element and the byte position, when the
 * layout is broken):
 *   scan(buf, count, max_bytes) -> int   exactly `count` elements fill `buf`
 *                                        exactly; returns the sum of their
 *                                        lengths, at most max_bytes
 *   skip(buf, start, count) -> int       the offset just after `count`
 *                                        elements that begin at `start`
 *   split(buf, count) -> list[bytes]     the elements (count -1: all there are)
 *
 * And one walk of a JSON document, for the gateway (http_binary.load_json):
 *   json_scan(buf, max_depth, max_containers) -> (containers, deepest, stop)
 *       counts the arrays and objects of a JSON document and how deep they
 *       nest, without making anything of it, and stops at the first one that
 *       is deeper than max_depth or more than max_containers (stop: the byte
 *       where it stopped, len(buf) when it walked it all). json.loads makes a
 *       Python object of each (72-80 bytes, GC-tracked): 60 MiB of "[],"
 *       took 1.4 GiB and 16 s to parse. It checks nothing else (json.loads
 *       does, afterwards): brackets in strings are skipped, a broken document
 *       is walked to its end.
 *   json_prune(buf, max_depth, replacement) -> bytes
 *       the document with each array or object that opens deeper than
 *       max_depth replaced, whole, by `replacement` (a control request's
 *       value nested too deeply, read as a wrong value: http_binary.load_json
 *       with deep_values). The same walk; a Python regular expression took
 *       0.1-0.2 s for a 1 MiB document, on the gateway's event loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Buffers from this size are walked without the GIL: below it, releasing
 * and taking the GIL back costs more than the walk. */
#define NOGIL_BYTES (64 * 1024)

struct walk {
    Py_ssize_t pos;         /* the byte after the last whole element */
    Py_ssize_t elements;    /* whole elements walked */
    Py_ssize_t cut;         /* -1, or bytes left when a prefix or an element was cut off */
    uint32_t claim;         /* what the cut-off element claimed (if its prefix was whole) */
    int prefix_cut;         /* the cut-off was in a length prefix */
};

static inline uint32_t read_le32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);       /* once: the memory may be changing under us */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

/* Walk at most `count` elements (count < 0: until the end) from w->pos. */
static void walk(const unsigned char *buf, Py_ssize_t len, Py_ssize_t count, struct walk *w)
{
    Py_ssize_t pos = w->pos, n = 0;
    w->cut = -1;
    while (count < 0 ? pos < len : n < count) {
        Py_ssize_t left = len - pos;
        if (left < 4) {
            w->cut = left;
            w->prefix_cut = 1;
            break;
        }
        uint32_t claim = read_le32(buf + pos);
        if ((Py_ssize_t)claim > left - 4) {
            w->cut = left - 4;
            w->claim = claim;
            w->prefix_cut = 0;
            break;
        }
        pos += 4 + (Py_ssize_t)claim;
        n++;
    }
    w->pos = pos;
    w->elements = n;
}

static void walk_maybe_nogil(const unsigned char *buf, Py_ssize_t len, Py_ssize_t count,
                             struct walk *w)
{
    if (len - w->pos >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        walk(buf, len, count, w);
        Py_END_ALLOW_THREADS
    } else {
        walk(buf, len, count, w);
    }
}

/* The ValueError for a walk that stopped early; `first` numbers its first
 * element, `count` is what was expected (-1: any number). Returns NULL. */
static PyObject *walk_error(const struct walk *w, Py_ssize_t first, Py_ssize_t count)
{
    Py_ssize_t index = first + w->elements;
    if (w->prefix_cut && w->cut == 0)
        PyErr_Format(PyExc_ValueError, "%zd elements expected but the data ends after %zd",
                     first + count, index);
    else if (w->prefix_cut)
        PyErr_Format(PyExc_ValueError, "element %zd: its 4-byte length prefix is cut off "
                     "(%zd bytes remain at byte %zd)", index, w->cut, w->pos);
    else
        PyErr_Format(PyExc_ValueError, "element %zd claims %u bytes but only %zd remain",
                     index, (unsigned)w->claim, w->cut);
    return NULL;
}

static PyObject *scan(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t count, max_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nn:scan", &view, &count, &max_bytes))
        return NULL;
    PyObject *result = NULL;
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "scan: count must be >= 0, not %zd", count);
        goto done;
    }
    /* every element takes at least its 4-byte prefix: a count the buffer
     * cannot hold is refused without walking it */
    if (count > view.len / 4) {
        PyErr_Format(PyExc_ValueError, "%zd elements expected but %zd bytes hold at most %zd",
                     count, view.len, view.len / 4);
        goto done;
    }
    struct walk w = {0};
    walk_maybe_nogil(view.buf, view.len, count, &w);
    if (w.cut >= 0) {
        walk_error(&w, 0, count);
        goto done;
    }
    if (w.pos != view.len) {
        PyErr_Format(PyExc_ValueError, "%zd bytes follow the last of the %zd elements",
                     view.len - w.pos, count);
        goto done;
    }
    Py_ssize_t total = view.len - 4 * count;
    if (total > max_bytes) {
        PyErr_Format(PyExc_ValueError, "the %zd elements hold %zd bytes, more than %zd",
                     count, total, max_bytes);
        goto done;
    }
    result = PyLong_FromSsize_t(total);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyObject *skip(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t start, count;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nn:skip", &view, &start, &count))
        return NULL;
    PyObject *result = NULL;
    if (start < 0 || start > view.len || count < 0) {
        PyErr_Format(PyExc_ValueError, "skip: start %zd or count %zd out of range for %zd bytes",
                     start, count, view.len);
        goto done;
    }
    struct walk w = {0};
    w.pos = start;
    walk_maybe_nogil(view.buf, view.len, count, &w);
    if (w.cut >= 0) {
        /* numbered within this call: the caller knows where it started */
        walk_error(&w, 0, count);
        goto done;
    }
    result = PyLong_FromSsize_t(w.pos);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyObject *split(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t count;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*n:split", &view, &count))
        return NULL;
    PyObject *list = NULL;
    const unsigned char *buf = view.buf;
    struct walk w = {0};
    walk_maybe_nogil(buf, view.len, count, &w);
    if (w.cut >= 0) {
        walk_error(&w, 0, count);
        goto done;
    }
    if (w.pos != view.len) {
        PyErr_Format(PyExc_ValueError, "%zd bytes follow the last of the %zd elements",
                     view.len - w.pos, count);
        goto done;
    }
    list = PyList_New(w.elements);
    if (list == NULL)
        goto done;
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < w.elements; i++) {
        /* checked again: shared memory may have changed since the walk */
        uint32_t n = pos <= view.len - 4 ? read_le32(buf + pos) : UINT32_MAX;
        if ((Py_ssize_t)n > view.len - pos - 4) {
            PyErr_SetString(PyExc_ValueError, "the elements changed while they were read");
            Py_CLEAR(list);
            goto done;
        }
        PyObject *item = PyBytes_FromStringAndSize((const char *)buf + pos + 4, (Py_ssize_t)n);
        if (item == NULL) {
            Py_CLEAR(list);
            goto done;
        }
        PyList_SET_ITEM(list, i, item);
        pos += 4 + (Py_ssize_t)n;
    }
done:
    PyBuffer_Release(&view);
    return list;
}

/* --- JSON ------------------------------------------------------------------- */

struct jscan {
    Py_ssize_t containers, deepest, stop;
};

/* The next byte from p that is a quote or a bracket ([ { ] }: those are
 * 0x5B 0x7B 0x5D 0x7D, so with bit 0x20 set, 0x7B or 0x7D), or end: 16 bytes
 * a step with SSE2 (every x86-64), a byte a step elsewhere. */
static inline const unsigned char *next_special(const unsigned char *p, const unsigned char *end)
{
#if defined(__SSE2__)
    const __m128i quote = _mm_set1_epi8('"'), open = _mm_set1_epi8(0x7B),
                  close = _mm_set1_epi8(0x7D), bit = _mm_set1_epi8(0x20);
    while (end - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        __m128i w = _mm_or_si128(v, bit);
        __m128i hit = _mm_or_si128(_mm_cmpeq_epi8(v, quote),
                                   _mm_or_si128(_mm_cmpeq_epi8(w, open), _mm_cmpeq_epi8(w, close)));
        int mask = _mm_movemask_epi8(hit);
        if (mask)
            return p + __builtin_ctz((unsigned)mask);
        p += 16;
    }
#endif
    for (; p < end; p++) {
        unsigned char w = *p | 0x20;
        if (*p == '"' || w == 0x7B || w == 0x7D)
            return p;
    }
    return end;
}

/* Where a string whose opening quote is just before p ends: after its
 * closing quote, or end (an unterminated string runs to the end). */
static inline const unsigned char *string_end(const unsigned char *p, const unsigned char *end)
{
    while (p < end) {
        /* most strings are short (names, keys, BYTES elements): a
         * few bytes by hand before memchr's setup */
        const unsigned char *q = p, *near = end - p > 16 ? p + 16 : end;
        while (q < near && *q != '"')
            q++;
        if (q == near)
            q = memchr(q, '"', (size_t)(end - q));
        if (q == NULL)
            return end;
        /* escaped if an odd number of backslashes precede it */
        const unsigned char *b = q;
        while (b > p && b[-1] == '\\')
            b--;
        p = q + 1;
        if (((q - b) & 1) == 0)
            break;
    }
    return p;
}

static void json_walk(const unsigned char *buf, Py_ssize_t len, Py_ssize_t max_depth,
                      Py_ssize_t max_containers, struct jscan *r)
{
    const unsigned char *p = buf, *end = buf + len;
    Py_ssize_t depth = 0, deepest = 0, containers = 0;
    while ((p = next_special(p, end)) < end) {
        unsigned char c = *p;
        if (c == '"') {                         /* a string: to its closing quote */
            p = string_end(p + 1, end);
            continue;
        }
        if (c == '[' || c == '{') {
            containers++;
            depth++;
            if (depth > deepest)
                deepest = depth;
            if (depth > max_depth || containers > max_containers)
                break;
        } else if (depth > 0) {                 /* ] or } */
            depth--;
        }
        p++;
    }
    r->containers = containers;
    r->deepest = deepest;
    r->stop = p - buf;
}

static PyObject *json_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t max_depth, max_containers;
    struct jscan r;
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "json_scan() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    max_depth = PyLong_AsSsize_t(args[1]);
    if (max_depth == -1 && PyErr_Occurred())
        return NULL;
    max_containers = PyLong_AsSsize_t(args[2]);
    if (max_containers == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        json_walk(view.buf, view.len, max_depth, max_containers, &r);
        Py_END_ALLOW_THREADS
    } else {
        json_walk(view.buf, view.len, max_depth, max_containers, &r);
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("nnn", r.containers, r.deepest, r.stop);
}

/* json_prune's walk: with out NULL, the size of what it makes; else that
 * written into out (out_len bytes), or -1 if it would not fit (the buffer
 * changed since the walk that sized out). Strings and brackets as json_walk;
 * kept: where the bytes not yet copied begin; cut: where the array or object
 * that opened past max_depth began (NULL: none is open). */
static Py_ssize_t prune_walk(const unsigned char *buf, Py_ssize_t len, Py_ssize_t max_depth,
                             const unsigned char *repl, Py_ssize_t repl_len,
                             unsigned char *out, Py_ssize_t out_len)
{
    const unsigned char *p = buf, *end = buf + len, *kept = buf, *cut = NULL;
    Py_ssize_t depth = 0, n = 0;
#define EMIT(src, size) do {                                        \
        Py_ssize_t size_ = (size);                                  \
        if (out != NULL) {                                          \
            if (size_ > out_len - n)                                \
                return -1;                                          \
            memcpy(out + n, (src), (size_t)size_);                  \
        }                                                           \
        n += size_;                                                 \
    } while (0)
    while ((p = next_special(p, end)) < end) {
        unsigned char c = *p;
        if (c == '"') {
            p = string_end(p + 1, end);
            continue;
        }
        if (c == '[' || c == '{') {
            depth++;
            if (depth == max_depth + 1)
                cut = p;
        } else if (depth > 0) {                 /* ] or } */
            depth--;
            if (depth == max_depth && cut != NULL) {
                EMIT(kept, cut - kept);
                EMIT(repl, repl_len);
                kept = p + 1;
                cut = NULL;
            }
        }
        p++;
    }
    /* an array or object still open at the end is left out, unclosed */
    EMIT(kept, (cut != NULL ? cut : end) - kept);
#undef EMIT
    return n;
}

static PyObject *json_prune(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view, repl;
    Py_ssize_t max_depth, size, written;
    PyObject *result = NULL;
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "json_prune() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    max_depth = PyLong_AsSsize_t(args[1]);
    if (max_depth == -1 && PyErr_Occurred())
        return NULL;
    if (max_depth < 0) {
        PyErr_SetString(PyExc_ValueError, "json_prune(): max_depth must not be negative");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &repl, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (view.len >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        size = prune_walk(view.buf, view.len, max_depth, repl.buf, repl.len, NULL, 0);
        Py_END_ALLOW_THREADS
    } else {
        size = prune_walk(view.buf, view.len, max_depth, repl.buf, repl.len, NULL, 0);
    }
    result = PyBytes_FromStringAndSize(NULL, size);
    if (result == NULL)
        goto done;
    /* the new bytes object is ours alone until it is returned */
    if (view.len >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        written = prune_walk(view.buf, view.len, max_depth, repl.buf, repl.len,
                             (unsigned char *)PyBytes_AS_STRING(result), size);
        Py_END_ALLOW_THREADS
    } else {
        written = prune_walk(view.buf, view.len, max_depth, repl.buf, repl.len,
                             (unsigned char *)PyBytes_AS_STRING(result), size);
    }
    if (written != size) {
        Py_CLEAR(result);
        PyErr_SetString(PyExc_ValueError, "json_prune(): the buffer changed while it was walked");
    }
done:
    PyBuffer_Release(&repl);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(buf, count, max_bytes) -> int: check that exactly count length-prefixed elements "
     "fill buf; the sum of their lengths (at most max_bytes)."},
    {"skip", skip, METH_VARARGS,
     "skip(buf, start, count) -> int: the offset after count elements that begin at start."},
    {"split", split, METH_VARARGS,
     "split(buf, count) -> list[bytes]: the elements of buf (count -1: as many as there are)."},
    {"json_scan", (PyCFunction)(void (*)(void))json_scan, METH_FASTCALL,
     "json_scan(buf, max_depth, max_containers) -> (containers, deepest, stop): the arrays and "
     "objects of a JSON document and their deepest nesting, counted until one is over a limit."},
    {"json_prune", (PyCFunction)(void (*)(void))json_prune, METH_FASTCALL,
     "json_prune(buf, max_depth, replacement) -> bytes: the JSON document with each array or "
     "object that opens deeper than max_depth replaced, whole, by replacement."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "torchpool.protocol._bytescan",
    "Walks of BYTES tensors (4-byte little-endian length + bytes per element) and of JSON documents.", -1, methods,
};

PyMODINIT_FUNC PyInit__bytescan(void)
{
    return PyModule_Create(&module);
}
