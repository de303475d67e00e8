/* libzmq's C API, the few calls this example uses.
 *
 * With libzmq's development headers installed (Debian: libzmq3-dev) this
 * is simply <zmq.h>. A machine may have the library without its headers,
 * as every Python environment with pyzmq does (the wheel ships libzmq in
 * site-packages/pyzmq.libs/): the declarations below are zmq.h's own for
 * those calls, whose ABI has been stable since libzmq 4.0.
 */
#ifndef TP_ZMQ_API_H
#define TP_ZMQ_API_H

#if defined(__has_include)
#if __has_include(<zmq.h>)
#include <zmq.h>
#define TP_HAVE_ZMQ_H 1
#endif
#endif

#ifndef TP_HAVE_ZMQ_H
#include <stddef.h>

#define ZMQ_DEALER 5
#define ZMQ_SNDMORE 2
#define ZMQ_LINGER 17
#define ZMQ_RCVTIMEO 27

typedef struct zmq_msg_t {
    _Alignas(void *) unsigned char _[64];
} zmq_msg_t;

void *zmq_ctx_new(void);
int zmq_ctx_term(void *context);
void *zmq_socket(void *context, int type);
int zmq_close(void *socket);
int zmq_setsockopt(void *socket, int option, const void *value, size_t size);
int zmq_connect(void *socket, const char *endpoint);
int zmq_send(void *socket, const void *buf, size_t len, int flags);
int zmq_msg_init(zmq_msg_t *msg);
int zmq_msg_recv(zmq_msg_t *msg, void *socket, int flags);
void *zmq_msg_data(zmq_msg_t *msg);
size_t zmq_msg_size(const zmq_msg_t *msg);
int zmq_msg_more(const zmq_msg_t *msg);
int zmq_msg_close(zmq_msg_t *msg);
int zmq_errno(void);
const char *zmq_strerror(int errnum);
#endif

#endif
