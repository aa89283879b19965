/* NVIDIA flavor of the device backend: CUDA runtime, NCCL, CUPTI activity. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "sim.h"
#include "standin_cuda.h"
#include "standin_cupti.h"
#include "standin_nccl.h"

#define ACTIVITY_BUFFER_BYTES (256u * 1024u)

static atomic_uint_fast64_t activity_records;

const char *dev_flavor(void) { return "nvidia"; }

const char *dev_strerror(int err) {
    const char *s = cudaGetErrorString(err);
    return s ? s : "unknown";
}

int dev_is_oom(int err) { return err == cudaErrorMemoryAllocation; }

int dev_init(int local_rank) {
    int count = 0;
    int err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess)
        return err;
    return cudaSetDevice(count > 0 ? local_rank % count : 0);
}

int dev_stream_create(void **stream) {
    return cudaStreamCreateWithFlags((cudaStream_t *)stream, cudaStreamNonBlocking);
}

int dev_stream_sync(void *stream) { return cudaStreamSynchronize(stream); }
int dev_malloc(void **ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
int dev_free(void *ptr) { return cudaFree(ptr); }

int dev_memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
}

int dev_register_kernel(struct sim_kernel *k, int with_runtime) {
    k->handle = (void *)k->entry;
    if (with_runtime)
        standin_cuda_register_kernel((const void *)k->entry, k->name);
    return 0;
}

int dev_launch(const struct sim_kernel *k, uint64_t duration_ns, void *stream) {
    /* The launch is asynchronous: the argument block must outlive the call
     * until the library has copied it, which cudaLaunchKernel does. */
    struct standin_kernel_spec spec = standin_kernel_spec_make(STANDIN_KERNEL_SLEEP, duration_ns);
    void *args[] = {&spec};
    dim3 grid = {108, 1, 1}, block = {256, 1, 1};
    return cudaLaunchKernel(k->handle, grid, block, args, 0, stream);
}

size_t dev_comm_id_size(void) { return sizeof(ncclUniqueId); }
int dev_comm_id_create(void *id) { return ncclGetUniqueId(id); }

int dev_comm_init(void **comm, int nranks, const void *id, int rank) {
    ncclUniqueId uid;
    memcpy(&uid, id, sizeof uid);
    return ncclCommInitRank((ncclComm_t *)comm, nranks, uid, rank);
}

int dev_comm_destroy(void *comm) { return ncclCommDestroy(comm); }

int dev_allreduce(void *buf, size_t count, void *comm, void *stream) {
    return ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, comm, stream);
}

int dev_allgather(void *send, void *recv, size_t send_count, void *comm, void *stream) {
    return ncclAllGather(send, recv, send_count, ncclFloat32, comm, stream);
}

int dev_reducescatter(void *send, void *recv, size_t recv_count, void *comm, void *stream) {
    return ncclReduceScatter(send, recv, recv_count, ncclFloat32, ncclSum, comm, stream);
}

int dev_broadcast(void *buf, size_t count, int root, void *comm, void *stream) {
    return ncclBroadcast(buf, buf, count, ncclFloat32, root, comm, stream);
}

int dev_send(void *buf, size_t count, int peer, void *comm, void *stream) {
    return ncclSend(buf, count, ncclFloat32, peer, comm, stream);
}

int dev_recv(void *buf, size_t count, int peer, void *comm, void *stream) {
    return ncclRecv(buf, count, ncclFloat32, peer, comm, stream);
}

/* ---- CUPTI activity consumer, as profilers built on CUPTI do it ---- */

static void buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, ACTIVITY_BUFFER_BYTES);
    *size = *buffer ? ACTIVITY_BUFFER_BYTES : 0;
    *max_records = 0;
}

/* What the consumer read, for the activity log. */
static void log_record(const CUpti_Activity *record) {
    struct sim_activity a = {.raw_kind = record->kind, .device = -1, .stream = -1,
                             .correlation = -1, .pid = -1, .tid = -1, .cbid = -1, .bytes = -1};
    switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const CUpti_ActivityKernel9 *k = (const void *)record;
        a.kind = "kernel";
        a.start = k->start, a.end = k->end;
        a.device = k->deviceId, a.stream = k->streamId, a.correlation = k->correlationId;
        a.name = k->name;
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const CUpti_ActivityMemcpy6 *m = (const void *)record;
        a.kind = "memcpy";
        a.start = m->start, a.end = m->end;
        a.device = m->deviceId, a.stream = m->streamId, a.correlation = m->correlationId;
        a.bytes = (int64_t)m->bytes;
        break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
        const CUpti_ActivityAPI *r = (const void *)record;
        a.kind = "api";
        a.start = r->start, a.end = r->end;
        a.pid = r->processId, a.tid = r->threadId, a.correlation = r->correlationId;
        a.cbid = r->cbid;
        break;
    }
    default:
        a.kind = "other";
        break;
    }
    actlog_write(&a);
}

static void buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer, size_t size,
                             size_t valid) {
    (void)ctx;
    (void)stream_id;
    (void)size;
    CUpti_Activity *record = NULL;
    uint64_t n = 0;
    while (buffer && valid > 0 && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        log_record(record);
        n++;
    }
    atomic_fetch_add(&activity_records, n);
    free(buffer);
}

int dev_activity_start(int api_records) {
    int err = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (err != CUPTI_SUCCESS)
        return err;
    static const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                               CUPTI_ACTIVITY_KIND_MEMCPY,
                                               CUPTI_ACTIVITY_KIND_RUNTIME};
    /* The API kind comes last: left out unless asked for. */
    size_t n = sizeof kinds / sizeof kinds[0] - (api_records ? 0 : 1);
    for (size_t i = 0; i < n; i++) {
        err = cuptiActivityEnable(kinds[i]);
        if (err != CUPTI_SUCCESS)
            return err;
    }
    return 0;
}

uint64_t dev_activity_drain(void) {
    cuptiActivityFlushAll(0);
    return atomic_exchange(&activity_records, 0);
}

uint64_t dev_range_start(const char *message) {
    (void)message;
    return 0;
}

void dev_range_end(uint64_t id) { (void)id; }
