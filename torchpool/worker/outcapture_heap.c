/* The capture region's allocator: see outcapture_heap.h. */
#include <stdlib.h>
#include <string.h>

#include "outcapture_heap.h"

static size_t round_up(size_t n, size_t to) { return (n + to - 1) & ~(to - 1); }

int heap_init(Heap *h, size_t size, size_t min_block) {
    h->size = size & ~(size_t)(GRANULE - 1);
    h->min_block = round_up(min_block < GRANULE ? GRANULE : min_block, GRANULE);
    /* used blocks are at least min_block each; free ranges lie between them */
    h->capacity = h->size / h->min_block + 2;
    h->free_ranges = malloc(h->capacity * sizeof(Range));
    h->used = malloc(h->capacity * sizeof(Range));
    if (h->free_ranges == NULL || h->used == NULL) {
        free(h->free_ranges);
        free(h->used);
        h->free_ranges = h->used = NULL;
        return -1;
    }
    h->nfree = h->size ? 1 : 0;
    h->free_ranges[0].start = 0;
    h->free_ranges[0].size = h->size;
    h->nused = 0;
    h->used_bytes = 0;
    return 0;
}

void heap_destroy(Heap *h) {
    free(h->free_ranges);
    free(h->used);
    h->free_ranges = h->used = NULL;
}

/* First index whose start is >= start. */
static size_t lower_bound(const Range *a, size_t n, size_t start) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (a[mid].start < start)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void insert_at(Range *a, size_t *n, size_t i, size_t start, size_t size) {
    memmove(a + i + 1, a + i, (*n - i) * sizeof(Range));
    a[i].start = start;
    a[i].size = size;
    (*n)++;
}

static void remove_at(Range *a, size_t *n, size_t i) {
    memmove(a + i, a + i + 1, (*n - i - 1) * sizeof(Range));
    (*n)--;
}

size_t heap_alloc(Heap *h, size_t n, size_t align) {
    if (n == 0 || n > h->size || align == 0 || (align & (align - 1)) || align > MAX_ALIGN)
        return NONE;
    if (align < GRANULE)
        align = GRANULE;
    size_t need = round_up(n < h->min_block ? h->min_block : n, GRANULE);
    if (h->nused == h->capacity - 2)
        return NONE;
    for (size_t i = 0; i < h->nfree; i++) {
        Range *r = &h->free_ranges[i];
        size_t start = round_up(r->start, align);
        size_t pad = start - r->start;
        if (pad > r->size || r->size - pad < need)
            continue;
        size_t end = r->start + r->size;
        size_t tail = end - (start + need);
        if (pad == 0) {
            if (tail == 0) {
                remove_at(h->free_ranges, &h->nfree, i);
            } else {
                r->start = start + need;
                r->size = tail;
            }
        } else {
            r->size = pad;          /* the padding stays free, before the block */
            if (tail)
                insert_at(h->free_ranges, &h->nfree, i + 1, start + need, tail);
        }
        insert_at(h->used, &h->nused, lower_bound(h->used, h->nused, start), start, need);
        h->used_bytes += need;
        return start;
    }
    return NONE;
}

int heap_free(Heap *h, size_t start) {
    size_t i = lower_bound(h->used, h->nused, start);
    if (i == h->nused || h->used[i].start != start)
        return -1;
    size_t size = h->used[i].size;
    remove_at(h->used, &h->nused, i);
    h->used_bytes -= size;
    size_t j = lower_bound(h->free_ranges, h->nfree, start);
    int merge_next = j < h->nfree && start + size == h->free_ranges[j].start;
    int merge_prev = j > 0 && h->free_ranges[j - 1].start + h->free_ranges[j - 1].size == start;
    if (merge_prev && merge_next) {
        h->free_ranges[j - 1].size += size + h->free_ranges[j].size;
        remove_at(h->free_ranges, &h->nfree, j);
    } else if (merge_prev) {
        h->free_ranges[j - 1].size += size;
    } else if (merge_next) {
        h->free_ranges[j].start = start;
        h->free_ranges[j].size += size;
    } else {
        insert_at(h->free_ranges, &h->nfree, j, start, size);
    }
    return 0;
}

size_t heap_largest_free(const Heap *h) {
    size_t best = 0;
    for (size_t i = 0; i < h->nfree; i++)
        if (h->free_ranges[i].size > best)
            best = h->free_ranges[i].size;
    return best;
}
