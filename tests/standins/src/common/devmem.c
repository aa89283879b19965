/* devmem.c: see devmem.h. */
#include "devmem.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define DEV_SPAN (1ull << 40)
#define ALIGN 512ull

struct block {
    uint64_t addr;
    uint64_t size;
};

struct device_heap {
    struct block *blocks; /* sorted by addr */
    size_t len, cap;
    uint64_t used;
};

static pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t mem_base;
static uint64_t mem_capacity;
static struct device_heap heaps[SD_MAX_DEVICES];

void sd_devmem_init(uint64_t base, uint64_t capacity)
{
    pthread_mutex_lock(&mem_mu);
    mem_base = base;
    mem_capacity = capacity < DEV_SPAN ? capacity : DEV_SPAN;
    pthread_mutex_unlock(&mem_mu);
}

int sd_devmem_alloc(int device, size_t size, void **out)
{
    if (size == 0) {
        *out = NULL;
        return 0;
    }
    if (device < 0 || device >= SD_MAX_DEVICES) {
        return -1;
    }
    uint64_t rounded = ((uint64_t)size + ALIGN - 1) & ~(ALIGN - 1);
    pthread_mutex_lock(&mem_mu);
    struct device_heap *h = &heaps[device];
    if (rounded > mem_capacity || h->used + rounded > mem_capacity) {
        pthread_mutex_unlock(&mem_mu);
        return -1;
    }
    /* First fit in the device's span (fragmentation aside, room exists). */
    uint64_t lo = mem_base + (uint64_t)device * DEV_SPAN;
    uint64_t cursor = lo;
    size_t pos = 0;
    for (; pos < h->len; pos++) {
        if (h->blocks[pos].addr - cursor >= rounded) {
            break;
        }
        cursor = h->blocks[pos].addr + h->blocks[pos].size;
    }
    if (cursor + rounded > lo + DEV_SPAN) {
        pthread_mutex_unlock(&mem_mu);
        return -1;
    }
    if (h->len == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        struct block *b = realloc(h->blocks, cap * sizeof(*b));
        if (b == NULL) {
            pthread_mutex_unlock(&mem_mu);
            return -1;
        }
        h->blocks = b;
        h->cap = cap;
    }
    memmove(&h->blocks[pos + 1], &h->blocks[pos], (h->len - pos) * sizeof(struct block));
    h->blocks[pos].addr = cursor;
    h->blocks[pos].size = rounded;
    h->len++;
    h->used += rounded;
    pthread_mutex_unlock(&mem_mu);
    *out = (void *)(uintptr_t)cursor;
    return 0;
}

/* Caller holds mem_mu. Index of the block containing a (exact start when
 * exact is set), or -1; *dev receives its device. */
static long find_block(uint64_t a, int exact, int *dev)
{
    if (a < mem_base) {
        return -1;
    }
    uint64_t d = (a - mem_base) / DEV_SPAN;
    if (d >= SD_MAX_DEVICES) {
        return -1;
    }
    struct device_heap *h = &heaps[d];
    size_t lo = 0, hi = h->len;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (h->blocks[mid].addr + h->blocks[mid].size <= a) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if (lo < h->len && h->blocks[lo].addr <= a &&
        (exact ? h->blocks[lo].addr == a : a < h->blocks[lo].addr + h->blocks[lo].size)) {
        *dev = (int)d;
        return (long)lo;
    }
    return -1;
}

int sd_devmem_free(void *p, int *device)
{
    int dev = 0;
    pthread_mutex_lock(&mem_mu);
    long i = find_block((uint64_t)(uintptr_t)p, 1, &dev);
    if (i < 0) {
        pthread_mutex_unlock(&mem_mu);
        return -1;
    }
    struct device_heap *h = &heaps[dev];
    h->used -= h->blocks[i].size;
    memmove(&h->blocks[i], &h->blocks[i + 1], (h->len - (size_t)i - 1) * sizeof(struct block));
    h->len--;
    pthread_mutex_unlock(&mem_mu);
    if (device != NULL) {
        *device = dev;
    }
    return 0;
}

void sd_devmem_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    pthread_mutex_lock(&mem_mu);
    uint64_t used = (device >= 0 && device < SD_MAX_DEVICES) ? heaps[device].used : 0;
    if (free_bytes != NULL) {
        *free_bytes = (size_t)(mem_capacity - used);
    }
    if (total_bytes != NULL) {
        *total_bytes = (size_t)mem_capacity;
    }
    pthread_mutex_unlock(&mem_mu);
}

int sd_devmem_is_device(const void *p)
{
    int dev = 0;
    pthread_mutex_lock(&mem_mu);
    long i = find_block((uint64_t)(uintptr_t)p, 0, &dev);
    pthread_mutex_unlock(&mem_mu);
    return i >= 0;
}
