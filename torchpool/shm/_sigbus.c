/* A SIGBUS guard for shared memory that a client owns.
 *
 * Why: a client registers a POSIX shm segment it owns and the daemon maps it.
 * The client can ftruncate the segment smaller at any moment; the daemon's
 * next access to a page beyond the new end raises SIGBUS, whose default
 * action kills the daemon. No size check can prevent it (the client may
 * shrink the segment between the check and the access), so the access itself
 * must be made survivable. This is what Wayland compositors do for a client's
 * wl_shm pool:
 *
 *   - a process-wide SIGBUS handler (sigaction, SA_SIGINFO) looks the faulting
 *     address (si_addr) up in a table of guarded ranges;
 *   - if it is in one, the handler maps anonymous zero pages over that whole
 *     range (MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, read-write), marks the
 *     range faulted and returns: the faulting instruction runs again and now
 *     succeeds, reading zeros or writing into throwaway pages. The caller sees
 *     the flag afterwards and fails the request; the range no longer shows the
 *     client's segment at all, so the caller treats it as broken from then on;
 *   - if it is in none (a genuine bug, or memory nobody guarded), the handler
 *     puts the previous SIGBUS action back (Python's faulthandler, the default
 *     action, ...) and returns: the fault happens again and is handled exactly
 *     as if this module did not exist. A fault is never swallowed.
 *
 * The handler runs on whichever thread faulted (a torch intra-op thread as
 * well as the interpreter's), at any point, possibly while the interpreter is
 * adding or removing a range. So the table takes no lock: it is a fixed array
 * of slots, changed only by Python code holding the GIL (one writer at a
 * time) and read by the handler through C11 atomics. Each slot has a sequence
 * counter (a seqlock): the writer makes it odd, writes the fields, makes it
 * even again; the handler ignores a slot whose counter is odd or changed while
 * it read the fields, so it never acts on half a range or on a slot being
 * reused for another one.
 *
 * The handler is installed on the first protect() and installed again by a
 * later protect() when something replaced it (faulthandler.enable() or
 * .disable() after us). A SIGBUS that is not a synchronous memory fault (sent
 * with kill() or raise(), including the raise() with which faulthandler ends
 * its own handler when it was installed on top of this one and chained back
 * here) gets the default action, so no two handlers can pass it back and forth.
 *
 * mmap() is not on POSIX's list of async-signal-safe functions, but on Linux
 * it is one system call with no lock in user space; Wayland relies on the same.
 *
 * Module functions (all with the GIL):
 *   add(buf) -> (slot, serial)   guard the pages of a page-aligned buffer
 *   faulted(slot, serial) -> bool
 *   remove(slot, serial) -> bool  idempotent; returns whether it had faulted
 *   CAPACITY                      slots in the table
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* A worker maps each registered region it serves once; 4096 at a time is far
 * more than one worker sees (128 regions per session by default). A fault
 * scans the slots in use, up to the highest one ever used. */
#define CAPACITY 4096

struct slot {
    atomic_uint seq;            /* odd while the writer changes the slot */
    atomic_int live;            /* the slot guards [start, start + len) */
    atomic_int faulted;         /* set by the handler */
    atomic_uintptr_t start;
    atomic_size_t len;
    unsigned long long serial;  /* which protect() owns the slot (GIL only) */
};

static struct slot slots[CAPACITY];
static atomic_int used;                 /* 1 + highest slot index ever used */
static unsigned long long next_serial = 1;

/* The action that was there before ours: two copies, so that a re-install
 * never rewrites the one the handler might be reading at that moment. */
static struct sigaction previous[2];
static atomic_int current_previous;
static int installed;                   /* GIL only */

static void write_begin(struct slot *s)
{
    atomic_fetch_add_explicit(&s->seq, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
}

static void write_end(struct slot *s)
{
    atomic_fetch_add_explicit(&s->seq, 1, memory_order_release);
}

/* The guarded slot holding addr, or NULL; its range in *start, *len as read
 * in one consistent snapshot. */
static struct slot *find(uintptr_t addr, uintptr_t *range_start, size_t *range_len)
{
    int n = atomic_load_explicit(&used, memory_order_acquire);
    for (int i = 0; i < n; i++) {
        struct slot *s = &slots[i];
        /* a slot changing under us: read it again (the writer is a thread
         * that holds the GIL and is never stopped for long) */
        for (int tries = 0; tries < 1000; tries++) {
            unsigned before = atomic_load_explicit(&s->seq, memory_order_acquire);
            if (before & 1)
                continue;
            int live = atomic_load_explicit(&s->live, memory_order_relaxed);
            uintptr_t start = atomic_load_explicit(&s->start, memory_order_relaxed);
            size_t len = atomic_load_explicit(&s->len, memory_order_relaxed);
            atomic_thread_fence(memory_order_acquire);
            if (atomic_load_explicit(&s->seq, memory_order_relaxed) != before)
                continue;
            if (live && addr - start < len) {
                *range_start = start;
                *range_len = len;
                return s;
            }
            break;
        }
    }
    return NULL;
}

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    int saved_errno = errno;
    (void)context;
    if (info->si_code == BUS_ADRERR) {
        uintptr_t start;
        size_t len;
        struct slot *s = find((uintptr_t)info->si_addr, &start, &len);
        if (s != NULL) {
            if (mmap((void *)start, len, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0) != MAP_FAILED) {
                atomic_store_explicit(&s->faulted, 1, memory_order_release);
                errno = saved_errno;
                return;                 /* the access runs again, on zero pages */
            }
        }
    }
    if (info->si_code == BUS_ADRALN || info->si_code == BUS_ADRERR || info->si_code == BUS_OBJERR
            || info->si_code == BUS_MCEERR_AR) {
        /* a memory fault that is not ours: the previous action gets it when
         * the instruction runs again */
        sigaction(sig, &previous[atomic_load_explicit(&current_previous, memory_order_acquire)], NULL);
    } else {
        /* sent, not caused: returning would lose it */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(sig, &dfl, NULL);
        raise(sig);                     /* delivered when this handler returns */
    }
    errno = saved_errno;
}

/* Install the handler unless it is the current SIGBUS action. */
static int ensure_installed(void)
{
    struct sigaction now;
    if (installed) {
        if (sigaction(SIGBUS, NULL, &now) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)
            return 0;
    }
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    int spare = 1 - atomic_load_explicit(&current_previous, memory_order_relaxed);
    if (sigaction(SIGBUS, &ours, &previous[spare]) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    atomic_store_explicit(&current_previous, spare, memory_order_release);
    installed = 1;
    return 0;
}

static PyObject *add(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    /* only the address and length are kept: the buffer is released at once,
     * so an mmap stays closable (callers remove the range before closing) */
    uintptr_t start = (uintptr_t)view.buf;
    size_t len = (size_t)view.len;
    PyBuffer_Release(&view);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (len == 0) {
        PyErr_SetString(PyExc_ValueError, "protect: the buffer is empty");
        return NULL;
    }
    if (start % page != 0) {
        PyErr_SetString(PyExc_ValueError, "protect: the buffer does not start on a page boundary "
                                          "(pass the whole mmap)");
        return NULL;
    }
    len = (len + page - 1) / page * page;  /* a mapping covers whole pages */
    if (ensure_installed() != 0)
        return NULL;
    int n = atomic_load_explicit(&used, memory_order_relaxed);
    int i = 0;
    while (i < n && atomic_load_explicit(&slots[i].live, memory_order_relaxed))
        i++;
    if (i == CAPACITY) {
        PyErr_Format(PyExc_RuntimeError, "protect: all %d guarded ranges are in use", CAPACITY);
        return NULL;
    }
    struct slot *s = &slots[i];
    write_begin(s);
    atomic_store_explicit(&s->start, start, memory_order_relaxed);
    atomic_store_explicit(&s->len, len, memory_order_relaxed);
    atomic_store_explicit(&s->faulted, 0, memory_order_relaxed);
    atomic_store_explicit(&s->live, 1, memory_order_relaxed);
    write_end(s);
    s->serial = next_serial++;
    if (i == n)
        atomic_store_explicit(&used, n + 1, memory_order_release);
    return Py_BuildValue("(iK)", i, s->serial);
}

/* The live slot that protect() call owns, or NULL. */
static struct slot *owned(PyObject *args, const char *format)
{
    int i;
    unsigned long long serial;
    if (!PyArg_ParseTuple(args, format, &i, &serial))
        return NULL;
    if (i < 0 || i >= CAPACITY) {
        PyErr_SetString(PyExc_ValueError, "no such guarded range");
        return NULL;
    }
    struct slot *s = &slots[i];
    if (s->serial != serial || !atomic_load_explicit(&s->live, memory_order_relaxed))
        return NULL;
    return s;
}

static PyObject *faulted(PyObject *self, PyObject *args)
{
    (void)self;
    struct slot *s = owned(args, "iK:faulted");
    if (s == NULL) {
        if (PyErr_Occurred())
            return NULL;
        PyErr_SetString(PyExc_ValueError, "faulted: the range was removed");
        return NULL;
    }
    return PyBool_FromLong(atomic_load_explicit(&s->faulted, memory_order_acquire));
}

static PyObject *remove_range(PyObject *self, PyObject *args)
{
    (void)self;
    struct slot *s = owned(args, "iK:remove");
    if (s == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_FALSE;            /* removed before: nothing to do */
    }
    write_begin(s);
    atomic_store_explicit(&s->live, 0, memory_order_relaxed);
    write_end(s);
    s->serial = 0;
    return PyBool_FromLong(atomic_load_explicit(&s->faulted, memory_order_acquire));
}

static PyMethodDef methods[] = {
    {"add", add, METH_O,
     "add(buf) -> (slot, serial): guard the pages of a page-aligned buffer against SIGBUS."},
    {"faulted", faulted, METH_VARARGS,
     "faulted(slot, serial) -> bool: a SIGBUS hit the range and it now holds zero pages."},
    {"remove", remove_range, METH_VARARGS,
     "remove(slot, serial) -> bool: stop guarding (idempotent); whether the range had faulted."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "torchpool.shm._sigbus",
    "A SIGBUS guard for mappings of shared memory that a client can shrink.", -1, methods,
};

PyMODINIT_FUNC PyInit__sigbus(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "CAPACITY", CAPACITY) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
