/*
 * mspti.c: the stand-in libmspti.so activity API and mstx markers (see
 * include/standin_mspti.h). libascendcl and libhccl feed it through
 * __standin_mspti_record; records go to the consumer's buffers.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/actbuf.h"
#include "common/hooks.h"
#include "common/util.h"
#include "standin_mspti.h"

#define API SD_EXPORT

_Static_assert(offsetof(msptiActivityKernel, start) == 4, "Kernel.start");
_Static_assert(offsetof(msptiActivityKernel, end) == 12, "Kernel.end");
_Static_assert(offsetof(msptiActivityKernel, ds.deviceId) == 20, "Kernel.deviceId");
_Static_assert(offsetof(msptiActivityKernel, ds.streamId) == 24, "Kernel.streamId");
_Static_assert(offsetof(msptiActivityKernel, correlationId) == 28, "Kernel.correlationId");
_Static_assert(offsetof(msptiActivityKernel, type) == 36, "Kernel.type");
_Static_assert(offsetof(msptiActivityKernel, name) == 44, "Kernel.name");
_Static_assert(offsetof(msptiActivityHccl, bandWidth) == 28, "Hccl.bandWidth");
_Static_assert(offsetof(msptiActivityHccl, name) == 36, "Hccl.name");
_Static_assert(offsetof(msptiActivityHccl, commName) == 44, "Hccl.commName");
_Static_assert(offsetof(msptiActivityCommunication, count) == 8, "Communication.count");
_Static_assert(offsetof(msptiActivityCommunication, start) == 24, "Communication.start");
_Static_assert(offsetof(msptiActivityCommunication, algType) == 40, "Communication.algType");
_Static_assert(offsetof(msptiActivityCommunication, correlationId) == 64, "Communication.corr");
_Static_assert(offsetof(msptiActivityMarker, timestamp) == 12, "Marker.timestamp");
_Static_assert(offsetof(msptiActivityMarker, id) == 20, "Marker.id");
_Static_assert(offsetof(msptiActivityMarker, objectId) == 28, "Marker.objectId");
_Static_assert(offsetof(msptiActivityMarker, name) == 36, "Marker.name");
_Static_assert(offsetof(msptiActivityMarker, domain) == 44, "Marker.domain");
_Static_assert(offsetof(msptiActivityApi, pt.processId) == 20, "Api.processId");
_Static_assert(offsetof(msptiActivityApi, correlationId) == 28, "Api.correlationId");
_Static_assert(offsetof(msptiActivityApi, name) == 36, "Api.name");

static struct sd_actbuf actbuf = SD_ACTBUF_INIT;
static volatile int enabled[MSPTI_ACTIVITY_KIND_COUNT];

static int is_enabled(msptiActivityKind k)
{
    return __atomic_load_n(&enabled[k], __ATOMIC_RELAXED) != 0;
}

static size_t record_size(uint32_t kind)
{
    switch (kind) {
    case MSPTI_ACTIVITY_KIND_MARKER:
        return sizeof(msptiActivityMarker);
    case MSPTI_ACTIVITY_KIND_KERNEL:
        return sizeof(msptiActivityKernel);
    case MSPTI_ACTIVITY_KIND_API:
        return sizeof(msptiActivityApi);
    case MSPTI_ACTIVITY_KIND_HCCL:
        return sizeof(msptiActivityHccl);
    case MSPTI_ACTIVITY_KIND_COMMUNICATION:
        return sizeof(msptiActivityCommunication);
    default:
        return 0;
    }
}

static int ready(msptiActivityKind kind)
{
    return sd_actbuf_ready(&actbuf) && is_enabled(kind);
}

API void __standin_mspti_record(const struct standin_npu_activity *a)
{
    if (a == NULL || a->size < sizeof(*a)) {
        return;
    }
    switch (a->type) {
    case STANDIN_NPU_ACT_KERNEL: {
        if (!ready(MSPTI_ACTIVITY_KIND_KERNEL)) {
            return;
        }
        msptiActivityKernel r;
        memset(&r, 0, sizeof(r));
        r.kind = MSPTI_ACTIVITY_KIND_KERNEL;
        r.start = a->start_ns;
        r.end = a->end_ns;
        r.ds.deviceId = a->device_id;
        r.ds.streamId = a->stream_id;
        r.correlationId = a->correlation_id;
        r.type = a->kernel_type;
        r.name = a->name;
        sd_actbuf_append(&actbuf, &r, sizeof(r));
        break;
    }
    case STANDIN_NPU_ACT_API: {
        if (!ready(MSPTI_ACTIVITY_KIND_API)) {
            return;
        }
        msptiActivityApi r;
        memset(&r, 0, sizeof(r));
        r.kind = MSPTI_ACTIVITY_KIND_API;
        r.start = a->start_ns;
        r.end = a->end_ns;
        r.pt.processId = a->pid;
        r.pt.threadId = a->tid;
        r.correlationId = a->correlation_id;
        r.name = a->name;
        sd_actbuf_append(&actbuf, &r, sizeof(r));
        break;
    }
    case STANDIN_NPU_ACT_HCCL: {
        if (!ready(MSPTI_ACTIVITY_KIND_HCCL)) {
            return;
        }
        msptiActivityHccl r;
        memset(&r, 0, sizeof(r));
        r.kind = MSPTI_ACTIVITY_KIND_HCCL;
        r.start = a->start_ns;
        r.end = a->end_ns;
        r.ds.deviceId = a->device_id;
        r.ds.streamId = a->stream_id;
        r.bandWidth = a->bandwidth_gbps;
        r.name = a->name;
        r.commName = a->comm_name;
        sd_actbuf_append(&actbuf, &r, sizeof(r));
        break;
    }
    case STANDIN_NPU_ACT_COMMUNICATION: {
        if (!ready(MSPTI_ACTIVITY_KIND_COMMUNICATION)) {
            return;
        }
        msptiActivityCommunication r;
        memset(&r, 0, sizeof(r));
        r.kind = MSPTI_ACTIVITY_KIND_COMMUNICATION;
        r.dataType = (msptiCommunicationDataType)a->data_type;
        r.count = a->count;
        r.ds.deviceId = a->device_id;
        r.ds.streamId = a->stream_id;
        r.start = a->start_ns;
        r.end = a->end_ns;
        r.algType = a->alg_type;
        r.name = a->name;
        r.commName = a->comm_name;
        r.correlationId = a->correlation_id;
        sd_actbuf_append(&actbuf, &r, sizeof(r));
        break;
    }
    default:
        break;
    }
}

API msptiResult msptiActivityRegisterCallbacks(msptiBuffersCallbackRequestFunc funcBufferRequested,
                                               msptiBuffersCallbackCompleteFunc funcBufferCompleted)
{
    if (funcBufferRequested == NULL || funcBufferCompleted == NULL) {
        return MSPTI_ERROR_INVALID_PARAMETER;
    }
    sd_actbuf_set_callbacks(&actbuf, funcBufferRequested, funcBufferCompleted);
    return MSPTI_SUCCESS;
}

API msptiResult msptiActivityEnable(msptiActivityKind kind)
{
    if (record_size((uint32_t)kind) == 0) {
        return MSPTI_ERROR_INVALID_PARAMETER;
    }
    __atomic_store_n(&enabled[kind], 1, __ATOMIC_RELAXED);
    return MSPTI_SUCCESS;
}

API msptiResult msptiActivityDisable(msptiActivityKind kind)
{
    if (record_size((uint32_t)kind) == 0) {
        return MSPTI_ERROR_INVALID_PARAMETER;
    }
    __atomic_store_n(&enabled[kind], 0, __ATOMIC_RELAXED);
    return MSPTI_SUCCESS;
}

API msptiResult msptiActivityGetNextRecord(uint8_t *buffer, size_t validBufferSizeBytes,
                                           msptiActivity **record)
{
    if (buffer == NULL || record == NULL) {
        return MSPTI_ERROR_INVALID_PARAMETER;
    }
    uint8_t *next = buffer;
    if (*record != NULL) {
        uint8_t *cur = (uint8_t *)*record;
        size_t size = record_size((*record)->kind);
        if (cur < buffer || size == 0) {
            return MSPTI_ERROR_INVALID_PARAMETER;
        }
        next = cur + size;
    }
    if (next + sizeof(msptiActivity) > buffer + validBufferSizeBytes) {
        return MSPTI_ERROR_MAX_LIMIT_REACHED;
    }
    size_t size = record_size(((msptiActivity *)(void *)next)->kind);
    if (size == 0 || next + size > buffer + validBufferSizeBytes) {
        return MSPTI_ERROR_MAX_LIMIT_REACHED;
    }
    *record = (msptiActivity *)(void *)next;
    return MSPTI_SUCCESS;
}

API msptiResult msptiActivityFlushAll(uint32_t flag)
{
    (void)flag;
    sd_actbuf_flush(&actbuf);
    return MSPTI_SUCCESS;
}

API msptiResult msptiActivityFlushPeriod(uint32_t time)
{
    sd_actbuf_set_period(&actbuf, time);
    return MSPTI_SUCCESS;
}

/* ---- mstx markers ---- */

static uint64_t marker_counter;
static pthread_mutex_t range_mu = PTHREAD_MUTEX_INITIALIZER;
static const char **range_names; /* by id - 1 */
static size_t range_cap;

static void marker(msptiActivityFlag flag, uint64_t id, const char *name)
{
    if (!ready(MSPTI_ACTIVITY_KIND_MARKER)) {
        return;
    }
    msptiActivityMarker r;
    memset(&r, 0, sizeof(r));
    r.kind = MSPTI_ACTIVITY_KIND_MARKER;
    r.flag = flag;
    r.sourceKind = MSPTI_ACTIVITY_SOURCE_KIND_HOST;
    r.timestamp = sd_now_ns();
    r.id = id;
    r.objectId.pt.processId = (uint32_t)getpid();
    r.objectId.pt.threadId = sd_gettid();
    r.name = name;
    r.domain = "default";
    sd_actbuf_append(&actbuf, &r, sizeof(r));
}

API void mstxMarkA(const char *message, void *stream)
{
    uint64_t id = __atomic_add_fetch(&marker_counter, 1, __ATOMIC_RELAXED);
    marker(stream != NULL ? MSPTI_ACTIVITY_FLAG_MARKER_INSTANTANEOUS_WITH_DEVICE
                          : MSPTI_ACTIVITY_FLAG_MARKER_INSTANTANEOUS,
           id, sd_intern(message != NULL ? message : ""));
}

API mstxRangeId mstxRangeStartA(const char *message, void *stream)
{
    uint64_t id = __atomic_add_fetch(&marker_counter, 1, __ATOMIC_RELAXED);
    const char *name = sd_intern(message != NULL ? message : "");
    pthread_mutex_lock(&range_mu);
    if (id > range_cap) {
        size_t cap = range_cap ? range_cap : 64;
        while (cap < id) {
            cap *= 2;
        }
        const char **n = realloc(range_names, cap * sizeof(*n));
        if (n != NULL) {
            memset(n + range_cap, 0, (cap - range_cap) * sizeof(*n));
            range_names = n;
            range_cap = cap;
        }
    }
    if (id <= range_cap) {
        range_names[id - 1] = name;
    }
    pthread_mutex_unlock(&range_mu);
    marker(stream != NULL ? MSPTI_ACTIVITY_FLAG_MARKER_START_WITH_DEVICE
                          : MSPTI_ACTIVITY_FLAG_MARKER_START,
           id, name);
    return id;
}

API void mstxRangeEnd(mstxRangeId id)
{
    const char *name = "";
    pthread_mutex_lock(&range_mu);
    if (id >= 1 && id <= range_cap && range_names[id - 1] != NULL) {
        name = range_names[id - 1];
    }
    pthread_mutex_unlock(&range_mu);
    marker(MSPTI_ACTIVITY_FLAG_MARKER_END, id, name);
}
