/* NVIDIA flavor of the device backend: CUDA runtime, the CUDA driver where
 * libraries bypass the runtime, NCCL, CUPTI activity. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "sim.h"
#include "standin_cu.h"
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

int dev_launch(struct sim_kernel *k, uint64_t duration_ns, void *stream) {
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

/* ---- the driver API, as cuBLAS, NCCL and Triton use it ---- */

static CUmodule driver_module;
static CUlibrary driver_library;

static int driver_handle(struct sim_driver_kernel *k) {
    if (k->handle)
        return 0;
    CUresult rv;
    if (k->library) {
        if (!driver_library &&
            (rv = cuLibraryLoadData(&driver_library, "sim", NULL, NULL, 0, NULL, NULL, 0)))
            return rv;
        CUkernel kernel = NULL;
        if ((rv = cuLibraryGetKernel(&kernel, driver_library, k->name)))
            return rv;
        CUfunction f = NULL;
        if ((rv = cuKernelGetFunction(&f, kernel)))
            return rv;
        k->handle = f;
    } else {
        if (!driver_module && (rv = cuModuleLoadData(&driver_module, "sim")))
            return rv;
        CUfunction f = NULL;
        if ((rv = cuModuleGetFunction(&f, driver_module, k->name)))
            return rv;
        k->handle = f;
    }
    return 0;
}

int dev_driver_launch(struct sim_driver_kernel *k, uint64_t duration_ns, void *stream) {
    int err = driver_handle(k);
    if (err)
        return err;
    struct standin_kernel_spec spec = standin_kernel_spec_make(STANDIN_KERNEL_SLEEP, duration_ns);
    void *params[] = {&spec};
    if (k->ex) {
        CUlaunchConfig config = {.gridDimX = 64, .gridDimY = 1, .gridDimZ = 1,
                                 .blockDimX = 128, .blockDimY = 1, .blockDimZ = 1,
                                 .sharedMemBytes = 4096, .hStream = stream};
        return cuLaunchKernelEx(&config, k->handle, params, NULL);
    }
    return cuLaunchKernel(k->handle, 32, 4, 1, 256, 1, 1, 0, stream, params, NULL);
}

int dev_graph_launch(void **exec, struct sim_driver_kernel *nodes, int n, uint64_t duration_ns,
                     void *stream) {
    if (!*exec) {
        CUgraph graph = NULL;
        CUresult rv = cuGraphCreate(&graph, 0);
        if (rv)
            return rv;
        CUgraphNode prev = NULL;
        for (int i = 0; i < n; i++) {
            if ((rv = driver_handle(&nodes[i])))
                return rv;
            struct standin_kernel_spec spec =
                standin_kernel_spec_make(STANDIN_KERNEL_SLEEP, duration_ns);
            void *params[] = {&spec};
            CUDA_KERNEL_NODE_PARAMS p = {.func = nodes[i].handle, .gridDimX = 16, .gridDimY = 1,
                                         .gridDimZ = 1, .blockDimX = 128, .blockDimY = 1,
                                         .blockDimZ = 1, .kernelParams = params};
            CUgraphNode node = NULL;
            if ((rv = cuGraphAddKernelNode_v2(&node, graph, prev ? &prev : NULL, prev ? 1 : 0, &p)))
                return rv;
            prev = node;
        }
        if ((rv = cuGraphInstantiateWithFlags((CUgraphExec *)exec, graph, 0)))
            return rv;
    }
    return cuGraphLaunch(*exec, stream);
}

/* ---- expandable segments ---- */

static CUmemAllocationProp segment_prop(void) {
    CUdevice dev = 0;
    cuCtxGetDevice(&dev);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    return prop;
}

int dev_segment_page_size(size_t *bytes) {
    CUmemAllocationProp prop = segment_prop();
    return cuMemGetAllocationGranularity(bytes, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
}

int dev_segment_reserve(uint64_t *base, size_t bytes) {
    CUdeviceptr p = 0;
    CUresult rv = cuMemAddressReserve(&p, bytes, 0, 0, 0);
    *base = p;
    return rv;
}

int dev_segment_map(uint64_t addr, size_t bytes, uint64_t *handle) {
    CUmemAllocationProp prop = segment_prop();
    CUmemGenericAllocationHandle h = 0;
    CUresult rv = cuMemCreate(&h, bytes, &prop, 0);
    if (rv)
        return rv;
    if ((rv = cuMemMap(addr, bytes, 0, h, 0))) {
        cuMemRelease(h);
        return rv;
    }
    CUmemAccessDesc access = {.location = prop.location,
                              .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if ((rv = cuMemSetAccess(addr, bytes, &access, 1)))
        return rv;
    *handle = h;
    return 0;
}

int dev_segment_unmap(uint64_t addr, size_t bytes, const uint64_t *handles, int n) {
    CUresult rv = cuMemUnmap(addr, bytes);
    if (rv)
        return rv;
    for (int i = 0; i < n; i++)
        if ((rv = cuMemRelease(handles[i])))
            return rv;
    return 0;
}
