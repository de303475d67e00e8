/* The capture region's allocator (outcapture_heap.c), used by _outcapture.c.
 *
 * First fit over offsets [0, size), never touching the memory it manages:
 * the bookkeeping is two sorted arrays of ranges (free ranges, coalesced;
 * blocks in use) of fixed capacity, allocated once. Blocks start and end on
 * a 64-byte boundary (GRANULE) and are at least `min_block` bytes, which
 * bounds how many there can be. Not thread-safe: callers lock.
 */
#ifndef TORCHPOOL_OUTCAPTURE_HEAP_H
#define TORCHPOOL_OUTCAPTURE_HEAP_H

#include <stddef.h>

#define GRANULE 64              /* every block starts and ends on a cache line */
#define MAX_ALIGN 4096          /* the region's base is page aligned */
#define NONE ((size_t)-1)

/* Internal to the extension: bound inside it, never to a same-named symbol
 * of another library in the process. */
#define HEAP_API __attribute__((visibility("hidden")))

typedef struct {
    size_t start, size;
} Range;

typedef struct {
    size_t size;                /* bytes managed: offsets [0, size) */
    size_t min_block;           /* no block is smaller: bounds how many there are */
    size_t capacity;            /* entries of each array */
    Range *free_ranges;         /* sorted by start, never adjacent (coalesced) */
    size_t nfree;
    Range *used;                /* sorted by start */
    size_t nused;
    size_t used_bytes;
} Heap;

/* 0, or -1 when out of memory for the bookkeeping. */
HEAP_API int heap_init(Heap *h, size_t size, size_t min_block);
HEAP_API void heap_destroy(Heap *h);
/* The offset of a new block of n bytes aligned to `align` (a power of two,
 * at most MAX_ALIGN), or NONE when nothing fits. */
HEAP_API size_t heap_alloc(Heap *h, size_t n, size_t align);
/* Give back the block that starts at `start`: 0, or -1 when no block does. */
HEAP_API int heap_free(Heap *h, size_t start);
HEAP_API size_t heap_largest_free(const Heap *h);

#endif
