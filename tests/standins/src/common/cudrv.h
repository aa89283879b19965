/*
 * cudrv.h: what the stand-in libcuda.so.1 gives the stand-in libcudart.so.12
 * besides the driver API. libcudart links libcuda.so.1 (the real one dlopens
 * it; the calls are the same, made on the caller's thread): the device
 * engine (streams, events, device memory: the sd_* functions of stream.h,
 * devmem.h and util.h, built with default visibility into libcuda only) and
 * the functions below. Other stand-ins keep their own hidden copies.
 */
#ifndef STANDIN_CUDRV_H
#define STANDIN_CUDRV_H

#include <stdint.h>

#include "stream.h"

/* sd_report.kind values of the CUDA stand-ins. */
#define SD_CU_REPORT_KERNEL 1
#define SD_CU_REPORT_MEMCPY 2
/* Stream ids: the legacy default stream, then created streams. */
#define SD_CU_DEFAULT_STREAM_ID 7
#define SD_CU_FIRST_STREAM_ID 13

/* The device's legacy default stream, and the calling thread's per-thread
 * default stream (NULL when out of memory). */
SD_HIDDEN struct sd_stream *sd_cu_legacy_stream(int device);
SD_HIDDEN struct sd_stream *sd_cu_per_thread_stream(int device);
/* The runtime API call the calling thread is in: kernels the driver
 * enqueues next on this thread report its correlation id (0: none, the
 * driver numbers them itself). */
SD_HIDDEN void sd_cu_set_correlation(uint32_t correlation_id);

#endif /* STANDIN_CUDRV_H */
