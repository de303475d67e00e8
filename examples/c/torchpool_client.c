/* A torchpool client in C, written from docs/protocol.md alone.
 *
 *     torchpool_client [--hex] [--timeout-ms N] URL
 *
 * Connects a ZeroMQ DEALER socket to the daemon (URL: ipc:///path or
 * tcp://host:port), runs the example model `addsub` on two inline FP32
 * [1,16] tensors and prints OUTPUT0 and OUTPUT1; then sends a request whose
 * shape is wrong and prints the daemon's error. `--hex` also prints each
 * request header as hex (compare it with docs/protocol.md, "Test vectors").
 *
 * Exit status: 0 when the daemon answered both as the protocol says (the
 * outputs, then an INVALID_ARG error); 1 otherwise; 2 for bad usage.
 *
 * The wire, in short: a request is [header, payload...] where the header is
 * a msgpack map; the answer has the same layout and carries the request's
 * id. Tensor bytes are little-endian, inline in the header (`data` is a
 * bin) or, when large, in payload frame n (`data` is the integer n).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tp_msgpack.h"
#include "zmq_api.h"

#define MAX_FRAMES 64       /* payload frames in one answer this client accepts */
#define MAX_OUTPUTS 16
#define MAX_DIMS 8
#define COLS 16             /* addsub: INPUT0/INPUT1 are FP32 [batch, 16] */

/* --- tensors and requests ------------------------------------------------ */

typedef struct {
    const char *name;
    const float *values;
    int64_t cols;           /* shape [1, cols] */
} input_tensor;

/* tensor bytes are little-endian whatever the host's order */
static void put_le_f32(unsigned char *out, float v)
{
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    for (int k = 0; k < 4; k++)
        out[k] = (unsigned char)(bits >> (8 * k));
}

static float get_le_f32(const unsigned char *p)
{
    uint32_t bits = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The header of an infer request with inline inputs; its length, or 0 when
 * `cap` is too small. The keys are in the Python client's order, so the
 * bytes are the same as its (the documented test vectors). */
static size_t encode_infer(unsigned char *buf, size_t cap, int64_t id, const char *model,
                           const input_tensor *inputs, int count)
{
    mp_writer w;
    unsigned char data[4 * COLS];
    mp_writer_init(&w, buf, cap);
    mp_write_map(&w, 8);
    mp_write_str(&w, "v");          mp_write_int(&w, 1);
    mp_write_str(&w, "op");         mp_write_str(&w, "infer");
    mp_write_str(&w, "id");         mp_write_int(&w, id);
    mp_write_str(&w, "model");      mp_write_str(&w, model);
    mp_write_str(&w, "version");    mp_write_str(&w, "");        /* the highest ready version */
    mp_write_str(&w, "inputs");     mp_write_array(&w, (uint32_t)count);
    for (int t = 0; t < count; t++) {
        const input_tensor *in = &inputs[t];
        if (in->cols > COLS)
            return 0;
        for (int64_t k = 0; k < in->cols; k++)
            put_le_f32(data + 4 * k, in->values[k]);
        mp_write_map(&w, 4);
        mp_write_str(&w, "name");     mp_write_str(&w, in->name);
        mp_write_str(&w, "datatype"); mp_write_str(&w, "FP32");
        mp_write_str(&w, "shape");    mp_write_array(&w, 2); mp_write_int(&w, 1); mp_write_int(&w, in->cols);
        mp_write_str(&w, "data");     mp_write_bin(&w, data, (uint32_t)(4 * in->cols));
    }
    mp_write_str(&w, "outputs");    mp_write_nil(&w);            /* every output of the model */
    mp_write_str(&w, "timeout_us"); mp_write_int(&w, 0);         /* no time limit in the queue */
    return w.failed ? 0 : w.len;
}

/* --- answers ------------------------------------------------------------------ */

typedef struct {
    zmq_msg_t frames[1 + MAX_FRAMES];    /* [0] is the header */
    int count;
} message;

typedef struct {
    mp_item name, datatype;
    int64_t shape[MAX_DIMS];
    int dims;
    const unsigned char *data;           /* inline bytes, or a payload frame's */
    size_t size;
} output_tensor;

typedef struct {
    int64_t id;
    int has_id, ok;
    mp_item code, text;                  /* error.code, error.message */
    output_tensor outputs[MAX_OUTPUTS];
    int n_outputs;
} answer;

static void close_message(message *m)
{
    for (int k = 0; k < m->count; k++)
        zmq_msg_close(&m->frames[k]);
    m->count = 0;
}

/* Receive one whole multipart message; -1 on timeout or error (said on stderr). */
static int receive(void *sock, message *m, const char *url, int timeout_ms)
{
    int more = 1, too_many = 0;
    m->count = 0;
    while (more) {
        zmq_msg_t extra;                 /* a frame past MAX_FRAMES: read, then dropped */
        int keep = m->count < 1 + MAX_FRAMES;
        zmq_msg_t *frame = keep ? &m->frames[m->count] : &extra;
        zmq_msg_init(frame);
        if (zmq_msg_recv(frame, sock, 0) < 0) {
            int err = zmq_errno();
            zmq_msg_close(frame);
            close_message(m);
            if (err == EAGAIN)
                fprintf(stderr, "no answer from torchpool at %s within %d ms (is the daemon running "
                                "and listening there?)\n", url, timeout_ms);
            else
                fprintf(stderr, "receiving from %s failed: %s\n", url, zmq_strerror(err));
            return -1;
        }
        more = zmq_msg_more(frame);
        if (keep) {
            m->count++;
        } else {
            zmq_msg_close(frame);
            too_many = 1;
        }
    }
    if (too_many) {
        fprintf(stderr, "an answer of more than %d payload frames: not for this client\n", MAX_FRAMES);
        close_message(m);
        return -1;
    }
    return 0;
}

/* `data` of a tensor map: inline bin, or the 1-based index of a payload frame */
static int read_data(mp_reader *r, message *m, output_tensor *out)
{
    mp_item v;
    if (mp_read(r, &v))
        return -1;
    if (v.type == MP_BIN) {
        out->data = v.ptr;
        out->size = v.len;
        return 0;
    }
    if (v.type == MP_INT && v.i >= 1 && v.i < m->count) {
        out->data = zmq_msg_data(&m->frames[v.i]);
        out->size = zmq_msg_size(&m->frames[v.i]);
        return 0;
    }
    return -1;
}

static int read_output(mp_reader *r, message *m, output_tensor *out)
{
    mp_item map, key, v;
    if (mp_read(r, &map) || map.type != MP_MAP)
        return -1;
    for (uint32_t k = 0; k < map.len; k++) {
        if (mp_read(r, &key))
            return -1;
        if (mp_is_str(&key, "name") || mp_is_str(&key, "datatype")) {
            if (mp_read(r, &v) || v.type != MP_STR)
                return -1;
            *(mp_is_str(&key, "name") ? &out->name : &out->datatype) = v;
        } else if (mp_is_str(&key, "shape")) {
            if (mp_read(r, &v) || v.type != MP_ARRAY || v.len > MAX_DIMS)
                return -1;
            out->dims = (int)v.len;
            for (int d = 0; d < out->dims; d++) {
                mp_item dim;
                if (mp_read(r, &dim) || dim.type != MP_INT || dim.i < 0)
                    return -1;
                out->shape[d] = dim.i;
            }
        } else if (mp_is_str(&key, "data")) {
            if (read_data(r, m, out))
                return -1;
        } else if (mp_skip(r)) {         /* "shm", "region", ...: not asked for by this client */
            return -1;
        }
    }
    return 0;
}

static int read_error(mp_reader *r, answer *a)
{
    mp_item map, key;
    if (mp_read(r, &map) || map.type != MP_MAP)
        return -1;
    for (uint32_t k = 0; k < map.len; k++) {
        if (mp_read(r, &key))
            return -1;
        if (mp_is_str(&key, "code") || mp_is_str(&key, "message")) {
            mp_item *field = mp_is_str(&key, "code") ? &a->code : &a->text;
            if (mp_read(r, field) || field->type != MP_STR)
                return -1;
        } else if (mp_skip(r)) {
            return -1;
        }
    }
    return 0;
}

/* Parse an answer's header (frame 0); -1 when it is not the documented map. */
static int read_answer(message *m, answer *a)
{
    mp_reader r;
    mp_item map, key, v;
    memset(a, 0, sizeof *a);
    mp_reader_init(&r, zmq_msg_data(&m->frames[0]), zmq_msg_size(&m->frames[0]));
    if (mp_read(&r, &map) || map.type != MP_MAP)
        return -1;
    for (uint32_t k = 0; k < map.len; k++) {
        if (mp_read(&r, &key))
            return -1;
        if (mp_is_str(&key, "id")) {
            if (mp_read(&r, &v))
                return -1;
            a->has_id = v.type != MP_NIL;   /* nil: the daemon could not read our header */
            a->id = v.type == MP_INT ? v.i : -1;
        } else if (mp_is_str(&key, "ok")) {
            if (mp_read(&r, &v) || v.type != MP_BOOL)
                return -1;
            a->ok = (int)v.i;
        } else if (mp_is_str(&key, "outputs")) {
            if (mp_read(&r, &v) || v.type != MP_ARRAY || v.len > MAX_OUTPUTS)
                return -1;
            a->n_outputs = (int)v.len;
            for (int o = 0; o < a->n_outputs; o++)
                if (read_output(&r, m, &a->outputs[o]))
                    return -1;
        } else if (mp_is_str(&key, "error")) {
            if (read_error(&r, a))
                return -1;
        } else if (mp_skip(&r)) {        /* "v", "model_name", "model_version", ... */
            return -1;
        }
    }
    return 0;
}

static void print_output(const output_tensor *out)
{
    int64_t count = 1;
    printf("%.*s %.*s [", (int)out->name.len, (const char *)out->name.ptr,
           (int)out->datatype.len, (const char *)out->datatype.ptr);
    for (int d = 0; d < out->dims; d++) {
        printf(d ? ",%lld" : "%lld", (long long)out->shape[d]);
        count *= out->shape[d];
    }
    printf("]:");
    if (!mp_is_str(&out->datatype, "FP32"))
        printf(" (%zu bytes; this example prints FP32 only)", out->size);
    else if (out->data == NULL || out->size != (size_t)count * 4)
        printf(" (%zu bytes, expected %lld)", out->size, (long long)count * 4);
    else
        for (int64_t k = 0; k < count; k++)
            printf(" %g", get_le_f32(out->data + 4 * k));
    printf("\n");
}

/* --- one request, one answer ----------------------------------------------------- */

static void print_hex(int64_t id, const unsigned char *buf, size_t len)
{
    printf("request %lld:", (long long)id);
    for (size_t k = 0; k < len; k++)
        printf(k ? "%02x" : " %02x", buf[k]);
    printf("\n");
}

/* Send an infer request and print its answer: the outputs, or "error CODE:
 * message". Returns 1 for outputs, 0 for an error answer, -1 for no answer
 * (or one this client cannot read). */
static int infer(void *sock, const char *url, int timeout_ms, int show_hex, int64_t id,
                 const input_tensor *inputs, int count)
{
    unsigned char header[1024];
    message m;
    answer a;
    size_t len = encode_infer(header, sizeof header, id, "addsub", inputs, count);
    if (len == 0) {
        fprintf(stderr, "request %lld does not fit the header buffer\n", (long long)id);
        return -1;
    }
    if (show_hex)
        print_hex(id, header, len);
    if (zmq_send(sock, header, len, 0) < 0) {
        fprintf(stderr, "sending to %s failed: %s\n", url, zmq_strerror(zmq_errno()));
        return -1;
    }
    for (;;) {                           /* answers come with the request's id: skip others */
        if (receive(sock, &m, url, timeout_ms))
            return -1;
        if (read_answer(&m, &a)) {
            fprintf(stderr, "the answer to request %lld is not a torchpool answer header\n", (long long)id);
            close_message(&m);
            return -1;
        }
        if (!a.has_id || a.id == id)     /* one request at a time: an answer without id is ours */
            break;
        close_message(&m);
    }
    int result = a.ok ? 1 : 0;
    if (a.ok)
        for (int o = 0; o < a.n_outputs; o++)
            print_output(&a.outputs[o]);
    else
        printf("error %.*s: %.*s\n", (int)a.code.len, a.code.ptr ? (const char *)a.code.ptr : "",
               (int)a.text.len, a.text.ptr ? (const char *)a.text.ptr : "");
    close_message(&m);
    return result;
}

static int usage(const char *argv0)
{
    fprintf(stderr, "usage: %s [--hex] [--timeout-ms N] URL   (URL: ipc:///path or tcp://host:port)\n", argv0);
    return 2;
}

int main(int argc, char **argv)
{
    const char *url = NULL;
    int show_hex = 0, timeout_ms = 10000, linger = 0;
    for (int k = 1; k < argc; k++) {
        if (strcmp(argv[k], "--hex") == 0) {
            show_hex = 1;
        } else if (strcmp(argv[k], "--timeout-ms") == 0 && k + 1 < argc) {
            char *end;
            long v = strtol(argv[++k], &end, 10);
            if (*end != '\0' || v <= 0 || v > 3600000)
                return usage(argv[0]);
            timeout_ms = (int)v;
        } else if (url == NULL && argv[k][0] != '-') {
            url = argv[k];
        } else {
            return usage(argv[0]);
        }
    }
    if (url == NULL)
        return usage(argv[0]);

    void *ctx = zmq_ctx_new();
    void *sock = ctx ? zmq_socket(ctx, ZMQ_DEALER) : NULL;
    if (sock == NULL || zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger)
        || zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms) || zmq_connect(sock, url)) {
        fprintf(stderr, "cannot connect to %s: %s\n", url, zmq_strerror(zmq_errno()));
        if (sock)
            zmq_close(sock);
        if (ctx)
            zmq_ctx_term(ctx);
        return 1;
    }

    float counting[COLS], ones[COLS];
    for (int k = 0; k < COLS; k++) {
        counting[k] = (float)k;
        ones[k] = 1.0f;
    }
    /* OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 */
    input_tensor good[] = {{"INPUT0", counting, COLS}, {"INPUT1", ones, COLS}};
    /* addsub wants [batch, 16]: [1, 2] is refused with INVALID_ARG naming the input */
    input_tensor bad[] = {{"INPUT0", counting, 2}, {"INPUT1", ones, 2}};

    int status = 0;
    if (infer(sock, url, timeout_ms, show_hex, 1, good, 2) != 1)
        status = 1;
    else if (infer(sock, url, timeout_ms, show_hex, 2, bad, 2) != 0)
        status = 1;

    zmq_close(sock);
    zmq_ctx_term(ctx);
    return status;
}
