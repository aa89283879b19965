/*
 * rtdrv.h: what the stand-in libruntime.so gives the stand-in
 * libascendcl.so besides the runtime API. libascendcl links libruntime.so
 * (as the real one does; the calls are made on the caller's thread): the
 * device engine (streams, events, device memory: the sd_* functions of
 * stream.h, devmem.h and util.h, built with default visibility into
 * libruntime only) and the functions below. The engine's exports make one
 * vendor's stand-ins per process (libcuda.so.1 exports the same names).
 */
#ifndef STANDIN_RTDRV_H
#define STANDIN_RTDRV_H

#include <stdint.h>

#include "stream.h"

/* sd_report.kind values of the Ascend stand-ins. */
#define SD_RT_REPORT_KERNEL 1
#define SD_RT_REPORT_MEMCPY 2

/* Device `device`'s default stream (NULL when out of memory). */
SD_HIDDEN struct sd_stream *sd_rt_default_stream(int device);
/* The AscendCL call the calling thread is in: kernels the runtime enqueues
 * next on this thread report its correlation id (0: none, the runtime
 * numbers them itself). */
SD_HIDDEN void sd_rt_set_correlation(uint64_t correlation_id);
/* The number of devices (STANDIN_DEVICE_COUNT). */
SD_HIDDEN int sd_rt_device_count(void);

#endif /* STANDIN_RTDRV_H */
