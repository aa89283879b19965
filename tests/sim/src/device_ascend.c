/* Ascend flavor of the device backend: AscendCL runtime, HCCL, MSPTI, and
 * the CANN runtime below AscendCL for operator libraries' launches. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "sim.h"
#include "standin_acl.h"
#include "standin_hccl.h"
#include "standin_mspti.h"
#include "standin_rt.h"

#define ACTIVITY_BUFFER_BYTES (256u * 1024u)

static atomic_uint_fast64_t activity_records;

const char *dev_flavor(void) { return "ascend"; }

const char *dev_strerror(int err) {
    static __thread char buf[32];
    snprintf(buf, sizeof buf, "aclError/HcclResult %d", err);
    return buf;
}

int dev_is_oom(int err) { return err == ACL_ERROR_RT_MEMORY_ALLOCATION; }

int dev_init(int local_rank) {
    int err = aclInit(NULL);
    if (err != ACL_SUCCESS)
        return err;
    uint32_t count = 0;
    err = aclrtGetDeviceCount(&count);
    if (err != ACL_SUCCESS)
        return err;
    return aclrtSetDevice(count > 0 ? (int32_t)((uint32_t)local_rank % count) : 0);
}

int dev_stream_create(void **stream) { return aclrtCreateStream(stream); }
int dev_stream_sync(void *stream) { return aclrtSynchronizeStream(stream); }

int dev_malloc(void **ptr, size_t bytes) {
    return aclrtMalloc(ptr, bytes, ACL_MEM_MALLOC_HUGE_FIRST);
}

int dev_free(void *ptr) { return aclrtFree(ptr); }

int dev_memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream) {
    return aclrtMemcpyAsync(dst, bytes, src, bytes, ACL_MEMCPY_HOST_TO_DEVICE, stream);
}

int dev_register_kernel(struct sim_kernel *k, int with_runtime) {
    /* With the runtime the handle is got at the first launch. */
    k->handle = with_runtime ? NULL : (void *)k->entry;
    return 0;
}

int dev_launch(struct sim_kernel *k, uint64_t duration_ns, void *stream) {
    int err;
    if (!k->handle && (err = aclrtBinaryGetFunction(NULL, k->name, &k->handle)))
        return err;
    struct standin_kernel_spec spec = standin_kernel_spec_make(STANDIN_KERNEL_SLEEP, duration_ns);
    return aclrtLaunchKernel(k->handle, 48, &spec, sizeof spec, stream);
}

size_t dev_comm_id_size(void) { return sizeof(HcclRootInfo); }
int dev_comm_id_create(void *id) { return HcclGetRootInfo(id); }

int dev_comm_init(void **comm, int nranks, const void *id, int rank) {
    return HcclCommInitRootInfo((uint32_t)nranks, id, (uint32_t)rank, comm);
}

int dev_comm_destroy(void *comm) { return HcclCommDestroy(comm); }

int dev_allreduce(void *buf, size_t count, void *comm, void *stream) {
    return HcclAllReduce(buf, buf, count, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, comm, stream);
}

int dev_allgather(void *send, void *recv, size_t send_count, void *comm, void *stream) {
    return HcclAllGather(send, recv, send_count, HCCL_DATA_TYPE_FP32, comm, stream);
}

int dev_reducescatter(void *send, void *recv, size_t recv_count, void *comm, void *stream) {
    return HcclReduceScatter(send, recv, recv_count, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, comm,
                             stream);
}

int dev_broadcast(void *buf, size_t count, int root, void *comm, void *stream) {
    return HcclBroadcast(buf, count, HCCL_DATA_TYPE_FP32, (uint32_t)root, comm, stream);
}

int dev_send(void *buf, size_t count, int peer, void *comm, void *stream) {
    return HcclSend(buf, count, HCCL_DATA_TYPE_FP32, (uint32_t)peer, comm, stream);
}

int dev_recv(void *buf, size_t count, int peer, void *comm, void *stream) {
    return HcclRecv(buf, count, HCCL_DATA_TYPE_FP32, (uint32_t)peer, comm, stream);
}

/* ---- MSPTI activity consumer, as torch_npu's profiler and sysTrace do ---- */

static void buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, ACTIVITY_BUFFER_BYTES);
    *size = *buffer ? ACTIVITY_BUFFER_BYTES : 0;
    *max_records = 0;
}

/* What the consumer read, for the activity log. */
static void log_record(const msptiActivity *record) {
    struct sim_activity a = {.raw_kind = record->kind, .device = -1, .stream = -1,
                             .correlation = -1, .pid = -1, .tid = -1, .cbid = -1, .bytes = -1};
    switch (record->kind) {
    case MSPTI_ACTIVITY_KIND_KERNEL: {
        const msptiActivityKernel *k = (const void *)record;
        a.kind = "kernel";
        a.start = k->start, a.end = k->end;
        a.device = k->ds.deviceId, a.stream = k->ds.streamId;
        a.correlation = (int64_t)k->correlationId;
        a.name = k->name;
        break;
    }
    case MSPTI_ACTIVITY_KIND_API: {
        const msptiActivityApi *r = (const void *)record;
        a.kind = "api";
        a.start = r->start, a.end = r->end;
        a.pid = r->pt.processId, a.tid = r->pt.threadId;
        a.correlation = (int64_t)r->correlationId;
        a.name = r->name;
        break;
    }
    case MSPTI_ACTIVITY_KIND_HCCL: {
        const msptiActivityHccl *h = (const void *)record;
        a.kind = "hccl";
        a.start = h->start, a.end = h->end;
        a.device = h->ds.deviceId, a.stream = h->ds.streamId;
        a.name = h->name;
        break;
    }
    case MSPTI_ACTIVITY_KIND_COMMUNICATION: {
        const msptiActivityCommunication *c = (const void *)record;
        a.kind = "communication";
        a.start = c->start, a.end = c->end;
        a.device = c->ds.deviceId, a.stream = c->ds.streamId;
        a.correlation = (int64_t)c->correlationId;
        a.name = c->name;
        break;
    }
    case MSPTI_ACTIVITY_KIND_MARKER: {
        const msptiActivityMarker *m = (const void *)record;
        a.kind = "marker";
        a.start = a.end = m->timestamp;
        a.name = m->name;
        break;
    }
    default:
        a.kind = "other";
        break;
    }
    actlog_write(&a);
}

static void buffer_completed(uint8_t *buffer, size_t size, size_t valid) {
    (void)size;
    msptiActivity *record = NULL;
    uint64_t n = 0;
    while (buffer && valid > 0 && msptiActivityGetNextRecord(buffer, valid, &record) == MSPTI_SUCCESS) {
        log_record(record);
        n++;
    }
    atomic_fetch_add(&activity_records, n);
    free(buffer);
}

int dev_activity_start(int api_records) {
    int err = msptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (err != MSPTI_SUCCESS)
        return err;
    static const msptiActivityKind kinds[] = {MSPTI_ACTIVITY_KIND_KERNEL,
                                              MSPTI_ACTIVITY_KIND_HCCL,
                                              MSPTI_ACTIVITY_KIND_COMMUNICATION,
                                              MSPTI_ACTIVITY_KIND_API};
    /* The API kind comes last: left out unless asked for. */
    size_t n = sizeof kinds / sizeof kinds[0] - (api_records ? 0 : 1);
    for (size_t i = 0; i < n; i++) {
        err = msptiActivityEnable(kinds[i]);
        if (err != MSPTI_SUCCESS)
            return err;
    }
    return 0;
}

uint64_t dev_activity_drain(void) {
    msptiActivityFlushAll(1);
    return atomic_exchange(&activity_records, 0);
}

uint64_t dev_range_start(const char *message) { return mstxRangeStartA(message, NULL); }
void dev_range_end(uint64_t id) { mstxRangeEnd(id); }

/* Operator libraries launch through the CANN runtime (see device.h). The
 * stub a library registers is a host address of its own: here the
 * kernel's descriptor. */
static int operator_binary; /* the binary handle the stubs register under */

int dev_driver_launch(struct sim_driver_kernel *k, uint64_t duration_ns, void *stream) {
    int err;
    if (!k->handle) {
        if ((err = rtFunctionRegister(&operator_binary, k, k->name, NULL, 0)))
            return err;
        k->handle = k;
        if (k->library && (err = rtGetFunctionByName(k->name, &k->handle)))
            return err;
    }
    struct standin_kernel_spec spec = standin_kernel_spec_make(STANDIN_KERNEL_SLEEP, duration_ns);
    if (k->ex) {
        rtArgsEx_t args = {.args = &spec, .argsSize = sizeof spec};
        return rtKernelLaunchWithFlag(k->handle, 24, &args, NULL, stream, 0);
    }
    return rtKernelLaunch(k->handle, 24, &spec, sizeof spec, NULL, stream);
}

int dev_graph_launch(void **exec, struct sim_driver_kernel *nodes, int n, uint64_t duration_ns,
                     void *stream) {
    (void)exec, (void)nodes, (void)n, (void)duration_ns, (void)stream;
    return -1;
}

int dev_segment_reserve(uint64_t *base, size_t bytes) {
    (void)base, (void)bytes;
    return -1;
}

int dev_segment_page_size(size_t *bytes) {
    (void)bytes;
    return -1;
}

int dev_segment_map(uint64_t addr, size_t bytes, uint64_t *handle) {
    (void)addr, (void)bytes, (void)handle;
    return -1;
}

int dev_segment_unmap(uint64_t addr, size_t bytes, const uint64_t *handles, int n) {
    (void)addr, (void)bytes, (void)handles, (void)n;
    return -1;
}
