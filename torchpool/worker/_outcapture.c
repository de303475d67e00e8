/* Output capture: torch's large CPU allocations served from a shared-memory
 * region while a worker runs its model, so the output tensor `forward`
 * returns already lies where the broker reads it and is never copied again.
 *
 * How: torch's CPU allocator (c10::alloc_cpu / c10::free_cpu, in libc10.so)
 * calls posix_memalign and free through libc10's global offset table. We
 * rewrite those GOT slots of libc10.so only (found with dl_iterate_phdr, by
 * walking its dynamic section's relocations) to point at two hooks:
 *
 *   posix_memalign: while capturing is on and the size is at least the
 *     threshold, a block of the target region (first fit; when nothing
 *     fits, the real posix_memalign). Otherwise the real one.
 *   free: a pointer inside a region goes back to that region; anything
 *     else to the real free (two compares on every free libc10 makes).
 *
 * Why GOT patching rather than the alternatives:
 *   - LD_PRELOAD (or any process-wide malloc interposer) would see every
 *     library's allocations, Python's and ZeroMQ's included, and must be set
 *     before the worker's template process starts;
 *   - a torch C++ extension (a c10::Allocator swapped in with
 *     SetCPUAllocator) needs torch's headers at build time, and every
 *     extension of this package builds without torch: a client-only install
 *     builds the same extensions;
 *   - only libc10's two slots change, in the worker process only, after the
 *     model is loaded: weights and everything else torch allocated stay where
 *     they were, and other libraries never see the hooks.
 *
 * Regions: a table of up to MAX_REGIONS, each a mapping with its own
 * allocator. Capturing allocates from one of them, the target, which the
 * worker chooses per batch: its own region for most batches, and for a
 * batch of one local session that session's own region (worker/lending.py),
 * so that memory lent to a client holds nothing of anyone else's. A free
 * finds the region its pointer lies in (a quick reject first: every region
 * lies in [span_lo, span_hi)). Python allocates in a region too (alloc /
 * release) for outputs it copies there.
 *
 * Each region's bookkeeping lives outside the region (two sorted arrays of
 * ranges, fixed capacity: outcapture_heap.c), under one mutex: torch's
 * intra-op threads allocate too. The capturing flag is process-wide. A
 * region stays mapped while it is in the table (this module keeps a buffer
 * export of it), and it leaves the table only once no block of it is in
 * use, so a tensor freed late can never touch unmapped memory. The hooks
 * are never taken out: a pointer from a region may be freed at any time.
 *
 * Module:
 *   Heap(size, min_block=64)   the allocator alone, over offsets (for tests):
 *       .alloc(n, align=64) -> offset | None, .free(offset) -> bool,
 *       .used_bytes, .free_bytes, .largest_free, .blocks
 *   add_region(buffer, min_block) -> index   a writable, page-aligned mapping
 *       joins the table (RuntimeError when the table is full)
 *   remove_region(index) -> bool   it leaves the table (and its export is
 *       dropped) when no block of it is in use; False otherwise
 *   install(threshold) -> int  map the hooks (allocations of at least
 *       `threshold` bytes are captured); returns the GOT slots rewritten.
 *       Raises OSError when libc10.so or its slots cannot be found.
 *   capture(index)             capture into region `index` (process-wide);
 *       -1 turns capturing off
 *   alloc(index, n) -> offset | None, release(index, offset) -> bool
 *                              a block of a region for Python's own use
 *   base(index) -> int         where a region is mapped
 *   stats(index) -> (used_bytes, blocks, misses)   misses: large allocations
 *       made while capturing that did not fit (in any region)
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "outcapture_heap.h"

/* ------------------------------------------------------------ the regions and the hooks */

#define MAX_REGIONS 64

typedef struct {
    char *base;                          /* NULL: the slot is free */
    size_t size;
    Heap heap;
    Py_buffer view;                      /* keeps the mapping alive while in the table */
} Region;

static Region regions[MAX_REGIONS];
static int target = -1;                  /* the region capturing allocates from */
static uintptr_t span_lo = UINTPTR_MAX, span_hi = 0;    /* every region lies inside */
static size_t threshold;
static int installed;
static int capturing;                    /* read by every thread that allocates */
static unsigned long misses;
static pthread_mutex_t region_lock = PTHREAD_MUTEX_INITIALIZER;
static int forked;                       /* this process is a fork of the one that installed */

/* A process forked from a worker (a model that starts one) has a private copy
 * of the bookkeeping but shares the region's pages: it must never allocate
 * there. Its frees of inherited region pointers only update its own copy,
 * which the lock, held across fork(), leaves consistent. */
static void lock_for_fork(void) { pthread_mutex_lock(&region_lock); }
static void unlock_after_fork(void) { pthread_mutex_unlock(&region_lock); }
static void stop_capturing_in_child(void) {
    __atomic_store_n(&capturing, 0, __ATOMIC_RELAXED);
    forked = 1;
    pthread_mutex_unlock(&region_lock);
}

static int hooked_posix_memalign(void **out, size_t align, size_t size) {
    if (__atomic_load_n(&capturing, __ATOMIC_RELAXED) && size >= threshold) {
        pthread_mutex_lock(&region_lock);
        Region *r = target >= 0 ? &regions[target] : NULL;
        size_t offset = r != NULL && r->base != NULL ? heap_alloc(&r->heap, size, align) : NONE;
        pthread_mutex_unlock(&region_lock);
        if (offset != NONE) {
            *out = r->base + offset;
            return 0;
        }
        __atomic_add_fetch(&misses, 1, __ATOMIC_RELAXED);
    }
    return posix_memalign(out, align, size);
}

/* The region `p` lies in (under the lock), or NULL. */
static Region *region_of(const void *p) {
    for (int i = 0; i < MAX_REGIONS; i++) {
        Region *r = &regions[i];
        if (r->base != NULL && (uintptr_t)p - (uintptr_t)r->base < r->size)
            return r;
    }
    return NULL;
}

static void hooked_free(void *p) {
    /* two compares for a pointer outside every region (below span_lo wraps around) */
    uintptr_t lo = __atomic_load_n(&span_lo, __ATOMIC_ACQUIRE);
    uintptr_t hi = __atomic_load_n(&span_hi, __ATOMIC_ACQUIRE);
    if ((uintptr_t)p - lo < hi - lo) {
        pthread_mutex_lock(&region_lock);
        Region *r = region_of(p);
        if (r != NULL) {
            heap_free(&r->heap, (size_t)((char *)p - r->base));
            pthread_mutex_unlock(&region_lock);
            return;
        }
        pthread_mutex_unlock(&region_lock);
    }
    free(p);
}

/* Under the lock: the span again, after a region left the table. */
static void recompute_span(void) {
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int i = 0; i < MAX_REGIONS; i++) {
        if (regions[i].base == NULL)
            continue;
        uintptr_t start = (uintptr_t)regions[i].base, end = start + regions[i].size;
        lo = start < lo ? start : lo;
        hi = end > hi ? end : hi;
    }
    __atomic_store_n(&span_lo, lo, __ATOMIC_RELEASE);
    __atomic_store_n(&span_hi, hi, __ATOMIC_RELEASE);
}

/* ------------------------------------------------------------ rewriting libc10's GOT */

#if defined(__x86_64__)
#define R_JUMP_SLOT R_X86_64_JUMP_SLOT
#define R_GLOB_DAT R_X86_64_GLOB_DAT
#elif defined(__aarch64__)
#define R_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define R_GLOB_DAT R_AARCH64_GLOB_DAT
#endif

typedef struct {
    int found;                  /* libc10.so is loaded */
    int memalign_slots, free_slots;
    int error;                  /* errno of a failed mprotect */
} PatchResult;

#ifdef R_JUMP_SLOT
/* Write one GOT slot. A slot inside the RELRO segment sits on a page the
 * loader made read-only: it is made writable for the store and read-only
 * again. The loader protects only whole pages (the start and the end of
 * PT_GNU_RELRO rounded down, as glibc's _dl_protect_relro does): a slot on
 * the last, partial page is already writable and its page is left alone. */
static int write_slot(void **slot, void *value, uintptr_t relro_lo, uintptr_t relro_hi) {
    uintptr_t page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t page = (uintptr_t)slot & ~(page_size - 1);
    int protected_page = page >= (relro_lo & ~(page_size - 1)) && page < (relro_hi & ~(page_size - 1));
    if (protected_page && mprotect((void *)page, page_size, PROT_READ | PROT_WRITE) != 0)
        return -1;
    __atomic_store_n(slot, value, __ATOMIC_RELEASE);
    if (protected_page)
        mprotect((void *)page, page_size, PROT_READ);
    return 0;
}

/* The loader has relocated most dynamic entries to addresses on glibc
 * (x86-64, aarch64); some ports leave them as offsets from the load base. */
static uintptr_t dyn_address(ElfW(Addr) value, uintptr_t base) {
    return value < base ? value + base : value;
}

static int patch_relocations(uintptr_t base, const ElfW(Rela) *rela, size_t bytes, const ElfW(Sym) *symtab,
                             const char *strtab, uintptr_t relro_lo, uintptr_t relro_hi, PatchResult *res) {
    for (size_t i = 0; i < bytes / sizeof(ElfW(Rela)); i++) {
        unsigned long type = ELF64_R_TYPE(rela[i].r_info);
        if (type != R_JUMP_SLOT && type != R_GLOB_DAT)
            continue;
        const char *name = strtab + symtab[ELF64_R_SYM(rela[i].r_info)].st_name;
        void *hook = NULL;
        if (strcmp(name, "posix_memalign") == 0)
            hook = (void *)hooked_posix_memalign;
        else if (strcmp(name, "free") == 0)
            hook = (void *)hooked_free;
        if (hook == NULL)
            continue;
        if (write_slot((void **)(base + rela[i].r_offset), hook, relro_lo, relro_hi) != 0)
            return -1;
        if (hook == (void *)hooked_free)
            res->free_slots++;
        else
            res->memalign_slots++;
    }
    return 0;
}

static int patch_libc10(struct dl_phdr_info *info, size_t info_size, void *data) {
    (void)info_size;
    PatchResult *res = data;
    const char *name = info->dlpi_name ? info->dlpi_name : "";
    const char *slash = strrchr(name, '/');
    if (strcmp(slash ? slash + 1 : name, "libc10.so") != 0)
        return 0;
    res->found = 1;
    uintptr_t base = info->dlpi_addr, relro_lo = 0, relro_hi = 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(base + ph->p_vaddr);
        else if (ph->p_type == PT_GNU_RELRO) {
            relro_lo = base + ph->p_vaddr;
            relro_hi = relro_lo + ph->p_memsz;
        }
    }
    if (dyn == NULL)
        return 1;
    uintptr_t jmprel = 0, rela = 0, symtab = 0, strtab = 0;
    size_t pltrelsz = 0, relasz = 0;
    long pltrel = DT_RELA;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_JMPREL: jmprel = dyn_address(dyn->d_un.d_ptr, base); break;
        case DT_PLTRELSZ: pltrelsz = dyn->d_un.d_val; break;
        case DT_PLTREL: pltrel = (long)dyn->d_un.d_val; break;
        case DT_RELA: rela = dyn_address(dyn->d_un.d_ptr, base); break;
        case DT_RELASZ: relasz = dyn->d_un.d_val; break;
        case DT_SYMTAB: symtab = dyn_address(dyn->d_un.d_ptr, base); break;
        case DT_STRTAB: strtab = dyn_address(dyn->d_un.d_ptr, base); break;
        }
    }
    if (symtab == 0 || strtab == 0 || pltrel != DT_RELA)
        return 1;
    const ElfW(Sym) *syms = (const ElfW(Sym) *)symtab;
    const char *strs = (const char *)strtab;
    if ((jmprel && patch_relocations(base, (const ElfW(Rela) *)jmprel, pltrelsz, syms, strs,
                                     relro_lo, relro_hi, res) != 0)
        || (rela && patch_relocations(base, (const ElfW(Rela) *)rela, relasz, syms, strs,
                                      relro_lo, relro_hi, res) != 0))
        res->error = errno;
    return 1;
}
#endif

/* ------------------------------------------------------------ module functions */

/* The region in the table at `index`, or NULL (the caller holds the lock). */
static Region *live_region(Py_ssize_t index) {
    return index >= 0 && index < MAX_REGIONS && regions[index].base != NULL ? &regions[index] : NULL;
}

/* The region at `index` (raising ValueError when there is none). */
static Region *region_at(Py_ssize_t index) {
    Region *r = live_region(index);
    if (r == NULL)
        PyErr_Format(PyExc_ValueError, "no capture region %zd", index);
    return r;
}

static PyObject *add_region(PyObject *self, PyObject *args) {
    PyObject *buffer;
    Py_ssize_t min_block;
    if (!PyArg_ParseTuple(args, "On", &buffer, &min_block))
        return NULL;
    if (min_block < GRANULE) {
        PyErr_SetString(PyExc_ValueError, "the smallest block must be at least 64 bytes");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE) != 0)
        return NULL;
    if ((uintptr_t)view.buf % MAX_ALIGN != 0 || view.len < GRANULE) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "a region must be page aligned and at least 64 bytes");
        return NULL;
    }
    Heap heap;
    if (heap_init(&heap, (size_t)view.len, (size_t)min_block) != 0) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&region_lock);
    int index = -1;
    for (int i = 0; i < MAX_REGIONS && index < 0; i++)
        if (regions[i].base == NULL)
            index = i;
    if (index >= 0) {
        Region *r = &regions[index];
        r->heap = heap;
        r->size = heap.size;
        r->view = view;
        r->base = view.buf;
        uintptr_t start = (uintptr_t)r->base, end = start + r->size;
        if (start < span_lo)
            __atomic_store_n(&span_lo, start, __ATOMIC_RELEASE);
        if (end > span_hi)
            __atomic_store_n(&span_hi, end, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&region_lock);
    if (index < 0) {
        heap_destroy(&heap);
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_RuntimeError, "the table of capture regions is full (%d)", MAX_REGIONS);
        return NULL;
    }
    return PyLong_FromLong(index);
}

static PyObject *remove_region(PyObject *self, PyObject *arg) {
    Py_ssize_t index = PyLong_AsSsize_t(arg);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&region_lock);
    Region *r = live_region(index);
    if (r == NULL || r->heap.nused != 0) {
        pthread_mutex_unlock(&region_lock);
        if (r == NULL) {
            PyErr_Format(PyExc_ValueError, "no capture region %zd", index);
            return NULL;
        }
        Py_RETURN_FALSE;
    }
    Py_buffer view = r->view;
    heap_destroy(&r->heap);
    r->base = NULL;
    r->size = 0;
    if (target == index) {
        __atomic_store_n(&capturing, 0, __ATOMIC_RELAXED);
        target = -1;
    }
    recompute_span();
    pthread_mutex_unlock(&region_lock);
    PyBuffer_Release(&view);
    Py_RETURN_TRUE;
}

static PyObject *install(PyObject *self, PyObject *arg) {
    Py_ssize_t min_size = PyLong_AsSsize_t(arg);
    if (min_size == -1 && PyErr_Occurred())
        return NULL;
#ifndef R_JUMP_SLOT
    PyErr_SetString(PyExc_OSError, "output capture is not supported on this architecture");
    return NULL;
#else
    if (installed) {
        PyErr_SetString(PyExc_RuntimeError, "output capture is already installed in this process");
        return NULL;
    }
    if (min_size < GRANULE) {
        PyErr_SetString(PyExc_ValueError, "the threshold must be at least 64 bytes");
        return NULL;
    }
    threshold = (size_t)min_size;
    PatchResult res = {0, 0, 0, 0};
    dl_iterate_phdr(patch_libc10, &res);
    if (!res.found || res.error || res.memalign_slots == 0 || res.free_slots == 0) {
        /* Slots already rewritten stay so, harmlessly: with capturing off,
         * the hooks pass every call straight on. */
        if (res.error) {
            errno = res.error;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        PyErr_SetString(PyExc_OSError, res.found ? "libc10.so imports no posix_memalign/free to redirect"
                                                 : "libc10.so is not loaded (import torch first)");
        return NULL;
    }
    installed = 1;
    pthread_atfork(lock_for_fork, unlock_after_fork, stop_capturing_in_child);
    return PyLong_FromLong(res.memalign_slots + res.free_slots);
#endif
}

static PyObject *capture(PyObject *self, PyObject *arg) {
    Py_ssize_t index = PyLong_AsSsize_t(arg);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    if (index >= 0) {
        if (!installed || forked) {
            PyErr_SetString(PyExc_RuntimeError, forked ? "output capture belongs to the process that installed it"
                                                       : "output capture is not installed");
            return NULL;
        }
        pthread_mutex_lock(&region_lock);
        int live = index < MAX_REGIONS && regions[index].base != NULL;
        if (live)
            target = (int)index;
        pthread_mutex_unlock(&region_lock);
        if (!live) {
            PyErr_Format(PyExc_ValueError, "no capture region %zd", index);
            return NULL;
        }
    }
    __atomic_store_n(&capturing, index >= 0, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyObject *alloc(PyObject *self, PyObject *args) {
    Py_ssize_t index, n;
    if (!PyArg_ParseTuple(args, "nn", &index, &n))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0");
        return NULL;
    }
    pthread_mutex_lock(&region_lock);
    Region *r = live_region(index);
    size_t offset = r != NULL ? heap_alloc(&r->heap, (size_t)n, GRANULE) : NONE;
    pthread_mutex_unlock(&region_lock);
    if (r == NULL) {
        PyErr_Format(PyExc_ValueError, "no capture region %zd", index);
        return NULL;
    }
    if (offset == NONE)
        Py_RETURN_NONE;
    return PyLong_FromSize_t(offset);
}

static PyObject *release(PyObject *self, PyObject *args) {
    Py_ssize_t index, offset;
    if (!PyArg_ParseTuple(args, "nn", &index, &offset))
        return NULL;
    pthread_mutex_lock(&region_lock);
    Region *r = live_region(index);
    int done = r != NULL && offset >= 0 && heap_free(&r->heap, (size_t)offset) == 0;
    pthread_mutex_unlock(&region_lock);
    return PyBool_FromLong(done);
}

static PyObject *base(PyObject *self, PyObject *arg) {
    Py_ssize_t index = PyLong_AsSsize_t(arg);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    Region *r = region_at(index);
    return r == NULL ? NULL : PyLong_FromVoidPtr(r->base);
}

static PyObject *stats(PyObject *self, PyObject *arg) {
    Py_ssize_t index = PyLong_AsSsize_t(arg);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&region_lock);
    Region *r = live_region(index);
    size_t used = r ? r->heap.used_bytes : 0, blocks = r ? r->heap.nused : 0;
    pthread_mutex_unlock(&region_lock);
    if (r == NULL) {
        PyErr_Format(PyExc_ValueError, "no capture region %zd", index);
        return NULL;
    }
    return Py_BuildValue("nnk", (Py_ssize_t)used, (Py_ssize_t)blocks,
                         __atomic_load_n(&misses, __ATOMIC_RELAXED));
}

/* ------------------------------------------------------------ Heap: the allocator alone, for tests */

typedef struct {
    PyObject_HEAD
    Heap heap;
} HeapObject;

static int Heap_init(HeapObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"size", "min_block", NULL};
    Py_ssize_t size, min_block = GRANULE;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|n", names, &size, &min_block))
        return -1;
    if (size < GRANULE || min_block < 1) {
        PyErr_SetString(PyExc_ValueError, "size must be at least 64 and min_block positive");
        return -1;
    }
    heap_destroy(&self->heap);
    if (heap_init(&self->heap, (size_t)size, (size_t)min_block) != 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Heap_dealloc(HeapObject *self) {
    heap_destroy(&self->heap);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Heap_alloc(HeapObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"n", "align", NULL};
    Py_ssize_t n, align = GRANULE;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|n", names, &n, &align))
        return NULL;
    if (n < 0 || align < 1) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0 and align positive");
        return NULL;
    }
    size_t offset = heap_alloc(&self->heap, (size_t)n, (size_t)align);
    if (offset == NONE)
        Py_RETURN_NONE;
    return PyLong_FromSize_t(offset);
}

static PyObject *Heap_free(HeapObject *self, PyObject *arg) {
    Py_ssize_t offset = PyLong_AsSsize_t(arg);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(offset >= 0 && heap_free(&self->heap, (size_t)offset) == 0);
}

static PyObject *Heap_used_bytes(HeapObject *self, void *unused) { return PyLong_FromSize_t(self->heap.used_bytes); }
static PyObject *Heap_free_bytes(HeapObject *self, void *unused) {
    return PyLong_FromSize_t(self->heap.size - self->heap.used_bytes);
}
static PyObject *Heap_largest_free(HeapObject *self, void *unused) {
    return PyLong_FromSize_t(heap_largest_free(&self->heap));
}
static PyObject *Heap_blocks(HeapObject *self, void *unused) { return PyLong_FromSize_t(self->heap.nused); }
static PyObject *Heap_free_ranges(HeapObject *self, void *unused) { return PyLong_FromSize_t(self->heap.nfree); }

static PyMethodDef Heap_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))Heap_alloc, METH_VARARGS | METH_KEYWORDS,
     "alloc(n, align=64) -> offset of a new block, or None when nothing fits"},
    {"free", (PyCFunction)Heap_free, METH_O, "free(offset) -> whether a block started there"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Heap_getset[] = {
    {"used_bytes", (getter)Heap_used_bytes, NULL, "bytes in blocks (rounded up to 64)", NULL},
    {"free_bytes", (getter)Heap_free_bytes, NULL, "bytes in no block", NULL},
    {"largest_free", (getter)Heap_largest_free, NULL, "the largest free range", NULL},
    {"blocks", (getter)Heap_blocks, NULL, "blocks allocated", NULL},
    {"free_ranges", (getter)Heap_free_ranges, NULL, "free ranges (neighbours are merged)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HeapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchpool.worker._outcapture.Heap",
    .tp_doc = "Heap(size, min_block=64): the region's first-fit allocator over offsets [0, size)",
    .tp_basicsize = sizeof(HeapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Heap_init,
    .tp_dealloc = (destructor)Heap_dealloc,
    .tp_methods = Heap_methods,
    .tp_getset = Heap_getset,
};

static PyMethodDef methods[] = {
    {"add_region", add_region, METH_VARARGS,
     "add_region(buffer, min_block) -> index: a writable, page-aligned mapping joins the regions"},
    {"remove_region", remove_region, METH_O,
     "remove_region(index) -> bool: it leaves the table when no block of it is in use"},
    {"install", install, METH_O,
     "install(threshold) -> slots rewritten: libc10's allocations of at least `threshold` bytes "
     "are captured while capturing is on"},
    {"capture", capture, METH_O, "capture(index): capture into region `index` (process-wide); -1: off"},
    {"alloc", alloc, METH_VARARGS, "alloc(index, n) -> offset of a new block in the region, or None"},
    {"release", release, METH_VARARGS, "release(index, offset) -> whether a block of the region started there"},
    {"base", base, METH_O, "base(index): where the region is mapped"},
    {"stats", stats, METH_O, "stats(index) -> (used_bytes, blocks, misses) of the region"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_outcapture",
    "Torch's large CPU allocations served from a shared-memory region (see the C source's comment).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__outcapture(void) {
    if (PyType_Ready(&HeapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HeapType);
    if (PyModule_AddObject(m, "Heap", (PyObject *)&HeapType) < 0) {
        Py_DECREF(&HeapType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
