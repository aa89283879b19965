/*
 * devmem.h: opaque device-memory accounting with a per-device capacity.
 *
 * Addresses are handed out from a reserved, never-mapped range per device
 * (base + device * 1 TiB), first fit, 512-byte aligned; they must never be
 * dereferenced. Each library gets its own private copy.
 */
#ifndef STANDIN_DEVMEM_H
#define STANDIN_DEVMEM_H

#include <stddef.h>
#include <stdint.h>

#include "util.h"

#define SD_MAX_DEVICES 64

/* base: first address of device 0; capacity: bytes per device. */
SD_HIDDEN void sd_devmem_init(uint64_t base, uint64_t capacity);
/* 0 and *out set, or -1 when the device lacks room (size 0 gives NULL). */
SD_HIDDEN int sd_devmem_alloc(int device, size_t size, void **out);
/* 0, or -1 when p is not a live allocation. Sets *device when non-NULL. */
SD_HIDDEN int sd_devmem_free(void *p, int *device);
SD_HIDDEN void sd_devmem_info(int device, size_t *free_bytes, size_t *total_bytes);
/* 1 when p lies inside a live allocation. */
SD_HIDDEN int sd_devmem_is_device(const void *p);

#endif /* STANDIN_DEVMEM_H */
