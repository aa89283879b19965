/*
 * cupti.c: the stand-in libcupti.so.12 activity API (see
 * include/standin_cupti.h). libcudart feeds it through
 * __standin_cupti_record; records go to the consumer's buffers.
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <string.h>

#include "common/actbuf.h"
#include "common/hooks.h"
#include "common/util.h"
#include "standin_cupti.h"

#define API SD_EXPORT

_Static_assert(offsetof(CUpti_ActivityKernel9, start) == 16, "Kernel9.start");
_Static_assert(offsetof(CUpti_ActivityKernel9, deviceId) == 40, "Kernel9.deviceId");
_Static_assert(offsetof(CUpti_ActivityKernel9, streamId) == 48, "Kernel9.streamId");
_Static_assert(offsetof(CUpti_ActivityKernel9, correlationId) == 92, "Kernel9.correlationId");
_Static_assert(offsetof(CUpti_ActivityKernel9, name) == 104, "Kernel9.name");
_Static_assert(offsetof(CUpti_ActivityKernel9, maxActiveClusters) == 204, "Kernel9.maxActiveClusters");
_Static_assert(offsetof(CUpti_ActivityMemcpy6, bytes) == 8, "Memcpy6.bytes");
_Static_assert(offsetof(CUpti_ActivityMemcpy6, correlationId) == 44, "Memcpy6.correlationId");
_Static_assert(offsetof(CUpti_ActivityMemcpy6, copyCount) == 88, "Memcpy6.copyCount");
_Static_assert(offsetof(CUpti_ActivityAPI, correlationId) == 32, "API.correlationId");

static struct sd_actbuf actbuf = SD_ACTBUF_INIT;
static CUpti_BuffersCallbackCompleteFunc user_complete;
static volatile int enabled[CUPTI_ACTIVITY_KIND_NAME + 1];

static int is_enabled(CUpti_ActivityKind k)
{
    return __atomic_load_n(&enabled[k], __ATOMIC_RELAXED) != 0;
}

static void complete_adapter(uint8_t *buffer, size_t size, size_t valid)
{
    CUpti_BuffersCallbackCompleteFunc cb = __atomic_load_n(&user_complete, __ATOMIC_ACQUIRE);
    if (cb != NULL) {
        cb(NULL, 0, buffer, size, valid);
    }
}

static size_t record_size(uint32_t kind)
{
    switch (kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        return sizeof(CUpti_ActivityKernel9);
    case CUPTI_ACTIVITY_KIND_MEMCPY:
        return sizeof(CUpti_ActivityMemcpy6);
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER:
        return sizeof(CUpti_ActivityAPI);
    default:
        return 0;
    }
}

API void __standin_cupti_record(const struct standin_cuda_activity *a)
{
    if (a == NULL || a->size < sizeof(*a) || !sd_actbuf_ready(&actbuf)) {
        return;
    }
    switch (a->type) {
    case STANDIN_CUDA_ACT_KERNEL: {
        CUpti_ActivityKind kind = is_enabled(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
                                      ? CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
                                  : is_enabled(CUPTI_ACTIVITY_KIND_KERNEL)
                                      ? CUPTI_ACTIVITY_KIND_KERNEL
                                      : CUPTI_ACTIVITY_KIND_INVALID;
        if (kind == CUPTI_ACTIVITY_KIND_INVALID) {
            return;
        }
        CUpti_ActivityKernel9 r;
        memset(&r, 0, sizeof(r));
        r.kind = kind;
        r.partitionedGlobalCacheRequested = CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_NOT_SUPPORTED;
        r.partitionedGlobalCacheExecuted = CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_NOT_SUPPORTED;
        r.registersPerThread = 32;
        r.start = a->start_ns;
        r.end = a->end_ns;
        r.completed = a->end_ns;
        r.deviceId = a->device_id;
        r.contextId = a->device_id + 1;
        r.streamId = a->stream_id;
        r.gridX = a->grid[0];
        r.gridY = a->grid[1];
        r.gridZ = a->grid[2];
        r.blockX = a->block[0];
        r.blockY = a->block[1];
        r.blockZ = a->block[2];
        r.dynamicSharedMemory = a->dynamic_shared_mem;
        r.correlationId = a->correlation_id;
        r.gridId = (int64_t)a->correlation_id;
        r.name = a->name;
        r.queued = a->queued_ns;
        r.submitted = a->submitted_ns;
        r.channelType = CUPTI_CHANNEL_TYPE_COMPUTE;
        sd_actbuf_append(&actbuf, &r, sizeof(r));
        break;
    }
    case STANDIN_CUDA_ACT_MEMCPY: {
        if (!is_enabled(CUPTI_ACTIVITY_KIND_MEMCPY)) {
            return;
        }
        CUpti_ActivityMemcpy6 r;
        memset(&r, 0, sizeof(r));
        r.kind = CUPTI_ACTIVITY_KIND_MEMCPY;
        r.copyKind = (uint8_t)a->copy_kind;
        r.srcKind = (uint8_t)a->src_kind;
        r.dstKind = (uint8_t)a->dst_kind;
        r.bytes = a->bytes;
        r.start = a->start_ns;
        r.end = a->end_ns;
        r.deviceId = a->device_id;
        r.contextId = a->device_id + 1;
        r.streamId = a->stream_id;
        r.correlationId = a->correlation_id;
        r.channelType = CUPTI_CHANNEL_TYPE_ASYNC_MEMCPY;
        r.copyCount = 1;
        sd_actbuf_append(&actbuf, &r, sizeof(r));
        break;
    }
    case STANDIN_CUDA_ACT_API: {
        if (!is_enabled(CUPTI_ACTIVITY_KIND_RUNTIME)) {
            return;
        }
        CUpti_ActivityAPI r;
        memset(&r, 0, sizeof(r));
        r.kind = CUPTI_ACTIVITY_KIND_RUNTIME;
        r.cbid = a->cbid;
        r.start = a->start_ns;
        r.end = a->end_ns;
        r.processId = a->pid;
        r.threadId = a->tid;
        r.correlationId = a->correlation_id;
        r.returnValue = a->return_value;
        sd_actbuf_append(&actbuf, &r, sizeof(r));
        break;
    }
    default:
        break;
    }
}

API CUptiResult cuptiActivityEnable(CUpti_ActivityKind kind)
{
    if (record_size((uint32_t)kind) == 0 || kind == CUPTI_ACTIVITY_KIND_DRIVER) {
        return CUPTI_ERROR_NOT_SUPPORTED;
    }
    __atomic_store_n(&enabled[kind], 1, __ATOMIC_RELAXED);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityDisable(CUpti_ActivityKind kind)
{
    if (record_size((uint32_t)kind) == 0 || kind == CUPTI_ACTIVITY_KIND_DRIVER) {
        return CUPTI_ERROR_NOT_SUPPORTED;
    }
    __atomic_store_n(&enabled[kind], 0, __ATOMIC_RELAXED);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc funcBufferRequested,
                                               CUpti_BuffersCallbackCompleteFunc funcBufferCompleted)
{
    if (funcBufferRequested == NULL || funcBufferCompleted == NULL) {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    __atomic_store_n(&user_complete, funcBufferCompleted, __ATOMIC_RELEASE);
    sd_actbuf_set_callbacks(&actbuf, funcBufferRequested, complete_adapter);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityGetNextRecord(uint8_t *buffer, size_t validBufferSizeBytes,
                                           CUpti_Activity **record)
{
    if (buffer == NULL || record == NULL) {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    uint8_t *next = buffer;
    if (*record != NULL) {
        uint8_t *cur = (uint8_t *)*record;
        size_t size = record_size((*record)->kind);
        if (cur < buffer || size == 0) {
            return CUPTI_ERROR_INVALID_KIND;
        }
        next = cur + size;
    }
    if (next + sizeof(CUpti_Activity) > buffer + validBufferSizeBytes) {
        return CUPTI_ERROR_MAX_LIMIT_REACHED;
    }
    size_t size = record_size(((CUpti_Activity *)(void *)next)->kind);
    if (size == 0 || next + size > buffer + validBufferSizeBytes) {
        return CUPTI_ERROR_MAX_LIMIT_REACHED;
    }
    *record = (CUpti_Activity *)(void *)next;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext context, uint32_t streamId,
                                                  size_t *dropped)
{
    (void)context;
    (void)streamId;
    if (dropped == NULL) {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    *dropped = (size_t)sd_actbuf_dropped(&actbuf);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityFlushAll(uint32_t flag)
{
    (void)flag; /* every record is complete when written */
    sd_actbuf_flush(&actbuf);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityFlushPeriod(uint32_t time)
{
    sd_actbuf_set_period(&actbuf, time);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiGetTimestamp(uint64_t *timestamp)
{
    if (timestamp == NULL) {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    *timestamp = sd_now_ns();
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiGetStreamId(CUcontext context, CUstream stream, uint32_t *streamId)
{
    (void)context;
    if (streamId == NULL) {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    typedef int (*get_id_fn)(CUstream, unsigned long long *);
    get_id_fn get_id = (get_id_fn)sd_lookup("cudaStreamGetId", "libcudart.so.12", 0);
    unsigned long long id = 0;
    if (get_id == NULL || get_id(stream, &id) != 0) {
        return CUPTI_ERROR_INVALID_STREAM;
    }
    *streamId = (uint32_t)id;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiGetResultString(CUptiResult result, const char **str)
{
    if (str == NULL) {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    switch (result) {
    case CUPTI_SUCCESS:
        *str = "CUPTI_SUCCESS";
        break;
    case CUPTI_ERROR_INVALID_PARAMETER:
        *str = "CUPTI_ERROR_INVALID_PARAMETER";
        break;
    case CUPTI_ERROR_MAX_LIMIT_REACHED:
        *str = "CUPTI_ERROR_MAX_LIMIT_REACHED";
        break;
    case CUPTI_ERROR_NOT_SUPPORTED:
        *str = "CUPTI_ERROR_NOT_SUPPORTED";
        break;
    case CUPTI_ERROR_INVALID_KIND:
        *str = "CUPTI_ERROR_INVALID_KIND";
        break;
    case CUPTI_ERROR_INVALID_STREAM:
        *str = "CUPTI_ERROR_INVALID_STREAM";
        break;
    default:
        *str = "CUPTI_ERROR_UNKNOWN";
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    return CUPTI_SUCCESS;
}
