/*
 * cudart.c: the stand-in libcudart.so.12 (see include/standin_cuda.h).
 *
 * A runtime over the stand-in driver, libcuda.so.1 (cuda.c), which owns the
 * devices: launches, allocations, frees and synchronisations are made
 * through the driver's calls on the caller's thread, inside the runtime
 * call, as the real runtime makes them. Kernels get their driver handle
 * from cuLibraryGetKernel at their first launch (as CUDA 12's lazy loading
 * does). Every API call gets a correlation id and, when libcupti is loaded,
 * a RUNTIME activity record; completed kernels and copies are reported to
 * libcupti through __standin_cupti_record.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cudrv.h"
#include "common/devmem.h"
#include "common/hooks.h"
#include "common/stream.h"
#include "common/util.h"
#include "standin_cu.h"
#include "standin_cuda.h"
#include "standin_cupti.h"

#define API SD_EXPORT

#define REPORT_KERNEL SD_CU_REPORT_KERNEL
#define REPORT_MEMCPY SD_CU_REPORT_MEMCPY

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int device_count;
static double pcie_gbps, hbm_gbps;
static uint64_t memcpy_lat_ns;
static uint32_t correlation_counter;
static struct sd_hook cupti_hook = {STANDIN_CUPTI_RECORD, "libcupti.so.12", NULL, 0};

/* The library every registered kernel is in (one per process, as if every
 * fat binary were one). */
static CUlibrary kernels_library;

static __thread int tls_device;
static __thread cudaError_t tls_last_error;

static void on_complete(const struct sd_stream *s, const struct sd_op *op, uint64_t start,
                        uint64_t end);

static void init(void)
{
    device_count = (int)sd_env_u64("STANDIN_DEVICE_COUNT", 8);
    if (device_count < 0) {
        device_count = 0;
    }
    if (device_count > SD_MAX_DEVICES) {
        device_count = SD_MAX_DEVICES;
    }
    pcie_gbps = sd_env_double("STANDIN_PCIE_GBPS", 25.0);
    hbm_gbps = sd_env_double("STANDIN_HBM_GBPS", 1000.0);
    if (!(pcie_gbps > 0.0)) {
        pcie_gbps = 25.0;
    }
    if (!(hbm_gbps > 0.0)) {
        hbm_gbps = 1000.0;
    }
    memcpy_lat_ns = sd_env_u64("STANDIN_MEMCPY_LAT_US", 2) * 1000ull;
    /* The driver's engine, with the runtime's stream names and its CUPTI
     * reports (before any stream exists). */
    cuInit(0);
    sd_streams_init(on_complete, "cudastrm", SD_CU_FIRST_STREAM_ID);
    cuLibraryLoadData(&kernels_library, NULL, NULL, NULL, 0, NULL, NULL, 0);
}

static void ensure_init(void)
{
    pthread_once(&init_once, init);
}

static uint32_t next_correlation(void)
{
    return __atomic_add_fetch(&correlation_counter, 1, __ATOMIC_RELAXED);
}

/* ---- API records ---- */

struct api_call {
    uint32_t cbid;
    uint32_t corr;
    uint64_t start;
};

static struct api_call api_begin(uint32_t cbid)
{
    ensure_init();
    struct api_call c = {cbid, next_correlation(), sd_now_ns()};
    return c;
}

static cudaError_t api_end(const struct api_call *c, cudaError_t rv)
{
    if (rv != cudaSuccess) {
        tls_last_error = rv;
    }
    standin_cupti_record_fn record = (standin_cupti_record_fn)sd_hook_get(&cupti_hook);
    if (record != NULL && c->cbid != CUPTI_RUNTIME_TRACE_CBID_INVALID) {
        struct standin_cuda_activity a;
        memset(&a, 0, sizeof(a));
        a.size = sizeof(a);
        a.type = STANDIN_CUDA_ACT_API;
        a.start_ns = c->start;
        a.end_ns = sd_now_ns();
        a.correlation_id = c->corr;
        a.cbid = c->cbid;
        a.pid = (uint32_t)getpid();
        a.tid = sd_gettid();
        a.return_value = (uint32_t)rv;
        record(&a);
    }
    return rv;
}

static void on_complete(const struct sd_stream *s, const struct sd_op *op, uint64_t start,
                        uint64_t end)
{
    standin_cupti_record_fn record = (standin_cupti_record_fn)sd_hook_get(&cupti_hook);
    if (record == NULL) {
        return;
    }
    struct standin_cuda_activity a;
    memset(&a, 0, sizeof(a));
    a.size = sizeof(a);
    a.type = op->report.kind == REPORT_KERNEL ? STANDIN_CUDA_ACT_KERNEL : STANDIN_CUDA_ACT_MEMCPY;
    a.start_ns = start;
    a.end_ns = end;
    a.queued_ns = op->queued_ns;
    a.submitted_ns = op->queued_ns;
    a.device_id = (uint32_t)s->device;
    a.stream_id = s->id;
    a.correlation_id = (uint32_t)op->report.correlation_id;
    a.name = op->report.name;
    memcpy(a.grid, op->report.grid, sizeof(a.grid));
    memcpy(a.block, op->report.block, sizeof(a.block));
    a.dynamic_shared_mem = op->report.shared_mem;
    a.bytes = op->report.bytes;
    switch (op->report.copy_kind) {
    case cudaMemcpyHostToDevice:
        a.copy_kind = CUPTI_ACTIVITY_MEMCPY_KIND_HTOD;
        a.src_kind = CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE;
        a.dst_kind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
        break;
    case cudaMemcpyDeviceToHost:
        a.copy_kind = CUPTI_ACTIVITY_MEMCPY_KIND_DTOH;
        a.src_kind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
        a.dst_kind = CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE;
        break;
    case cudaMemcpyDeviceToDevice:
        a.copy_kind = CUPTI_ACTIVITY_MEMCPY_KIND_DTOD;
        a.src_kind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
        a.dst_kind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
        break;
    default:
        a.copy_kind = CUPTI_ACTIVITY_MEMCPY_KIND_HTOH;
        a.src_kind = CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE;
        a.dst_kind = CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE;
        break;
    }
    a.pid = (uint32_t)getpid();
    record(&a);
}

/* ---- streams ---- */

/* The stream a handle names, or NULL (and *err) when it names none. */
static struct sd_stream *resolve(cudaStream_t stream, int per_thread, cudaError_t *err)
{
    *err = cudaSuccess;
    if (stream == NULL) {
        stream = per_thread ? cudaStreamPerThread : cudaStreamLegacy;
    }
    struct sd_stream *s = NULL;
    if (stream == cudaStreamLegacy) {
        s = sd_cu_legacy_stream(tls_device);
    } else if (stream == cudaStreamPerThread) {
        s = sd_cu_per_thread_stream(tls_device);
    } else if (sd_stream_valid(stream)) {
        s = (struct sd_stream *)stream;
    } else {
        *err = cudaErrorInvalidResourceHandle;
        return NULL;
    }
    if (s == NULL) {
        *err = cudaErrorMemoryAllocation;
    }
    return s;
}

/* ---- kernel names ---- */

struct name_entry {
    const void *func;
    const char *name;
    CUfunction driver; /* the driver's handle, from the first launch */
};
static pthread_rwlock_t names_lock = PTHREAD_RWLOCK_INITIALIZER;
static struct name_entry *names;
static size_t names_len, names_cap;

static const char *lookup_name_locked(const void *func)
{
    for (size_t i = 0; i < names_len; i++) {
        if (names[i].func == func) {
            return names[i].name;
        }
    }
    return NULL;
}

static void set_name(const void *func, const char *name)
{
    pthread_rwlock_wrlock(&names_lock);
    for (size_t i = 0; i < names_len; i++) {
        if (names[i].func == func) {
            names[i].name = name;
            pthread_rwlock_unlock(&names_lock);
            return;
        }
    }
    if (names_len == names_cap) {
        size_t cap = names_cap ? names_cap * 2 : 64;
        struct name_entry *n = realloc(names, cap * sizeof(*n));
        if (n == NULL) {
            pthread_rwlock_unlock(&names_lock);
            return;
        }
        names = n;
        names_cap = cap;
    }
    names[names_len].func = func;
    names[names_len].name = name;
    names[names_len].driver = NULL;
    names_len++;
    pthread_rwlock_unlock(&names_lock);
}

static const char *kernel_name(const void *func)
{
    pthread_rwlock_rdlock(&names_lock);
    const char *name = lookup_name_locked(func);
    pthread_rwlock_unlock(&names_lock);
    if (name != NULL) {
        return name;
    }
    Dl_info info;
    if (dladdr(func, &info) != 0 && info.dli_sname != NULL && info.dli_saddr == func) {
        name = sd_intern(info.dli_sname);
    } else {
        char buf[40];
        snprintf(buf, sizeof(buf), "kernel_%p", func);
        name = sd_intern(buf);
    }
    set_name(func, name);
    return name;
}

/* The driver's handle of the kernel whose host stub is `func`: asked of the
 * driver at its first launch (cuLibraryGetKernel, inside that launch, as
 * CUDA 12's lazy loading does), then remembered. */
static CUfunction driver_function(const void *func)
{
    pthread_rwlock_rdlock(&names_lock);
    CUfunction f = NULL;
    for (size_t i = 0; i < names_len; i++) {
        if (names[i].func == func) {
            f = names[i].driver;
            break;
        }
    }
    pthread_rwlock_unlock(&names_lock);
    if (f != NULL) {
        return f;
    }
    const char *name = kernel_name(func);
    CUkernel k = NULL;
    if (cuLibraryGetKernel(&k, kernels_library, name) != CUDA_SUCCESS) {
        return NULL;
    }
    f = (CUfunction)k;
    pthread_rwlock_wrlock(&names_lock);
    for (size_t i = 0; i < names_len; i++) {
        if (names[i].func == func) {
            names[i].driver = f;
        }
    }
    pthread_rwlock_unlock(&names_lock);
    return f;
}

/* ---- devices and errors ---- */

API cudaError_t cudaGetDeviceCount(int *count)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaGetDeviceCount_v3020);
    if (count == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    *count = device_count;
    return api_end(&c, device_count > 0 ? cudaSuccess : cudaErrorNoDevice);
}

API cudaError_t cudaSetDevice(int device)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaSetDevice_v3020);
    if (device < 0 || device >= device_count) {
        return api_end(&c, cudaErrorInvalidDevice);
    }
    CUcontext ctx = NULL;
    if (cuDevicePrimaryCtxRetain(&ctx, device) != CUDA_SUCCESS ||
        cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        return api_end(&c, cudaErrorInvalidDevice);
    }
    tls_device = device;
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaGetDevice(int *device)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaGetDevice_v3020);
    if (device == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    *device = tls_device;
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaDeviceSynchronize(void)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaDeviceSynchronize_v3020);
    return api_end(&c, (cudaError_t)cuCtxSynchronize());
}

API cudaError_t cudaDriverGetVersion(int *driverVersion)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaDriverGetVersion_v3020);
    if (driverVersion == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    *driverVersion = CUDART_VERSION;
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaRuntimeGetVersion(int *runtimeVersion)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaRuntimeGetVersion_v3020);
    if (runtimeVersion == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    *runtimeVersion = CUDART_VERSION;
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaGetLastError(void)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaGetLastError_v3020);
    cudaError_t e = tls_last_error;
    tls_last_error = cudaSuccess;
    api_end(&c, cudaSuccess);
    return e;
}

API cudaError_t cudaPeekAtLastError(void)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaPeekAtLastError_v3020);
    api_end(&c, cudaSuccess);
    return tls_last_error;
}

struct error_text {
    cudaError_t code;
    const char *name;
    const char *text;
};

static const struct error_text error_texts[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver", "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorInvalidDeviceFunction, "cudaErrorInvalidDeviceFunction", "invalid device function"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotPermitted, "cudaErrorNotPermitted", "operation not permitted"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

static const struct error_text *find_error(cudaError_t e)
{
    for (size_t i = 0; i < sizeof(error_texts) / sizeof(error_texts[0]); i++) {
        if (error_texts[i].code == e) {
            return &error_texts[i];
        }
    }
    return NULL;
}

API const char *cudaGetErrorString(cudaError_t error)
{
    const struct error_text *t = find_error(error);
    return t != NULL ? t->text : "unrecognized error code";
}

API const char *cudaGetErrorName(cudaError_t error)
{
    const struct error_text *t = find_error(error);
    return t != NULL ? t->name : "cudaErrorUnknown";
}

/* ---- memory ---- */

API cudaError_t cudaMalloc(void **devPtr, size_t size)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaMalloc_v3020);
    if (devPtr == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    int64_t injected = sd_injected_malloc_error();
    if (injected != 0) {
        *devPtr = NULL;
        return api_end(&c, (cudaError_t)injected);
    }
    /* The driver writes a local: the caller's pointer is written here, in
     * the runtime (a fault writing it lands in cudaMalloc, after the
     * driver's call returned). */
    CUdeviceptr d = 0;
    CUresult rv = cuMemAlloc_v2(&d, size);
    *devPtr = (void *)(uintptr_t)d;
    return api_end(&c, rv == CUDA_SUCCESS ? cudaSuccess : cudaErrorMemoryAllocation);
}

API cudaError_t cudaFree(void *devPtr)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaFree_v3020);
    if (devPtr == NULL) {
        return api_end(&c, cudaSuccess);
    }
    /* The driver's free waits for the device's work, as the real one does. */
    if (cuMemFree_v2((CUdeviceptr)(uintptr_t)devPtr) != CUDA_SUCCESS) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaMemGetInfo(size_t *free, size_t *total)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaMemGetInfo_v3020);
    if (free == NULL || total == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    return api_end(&c, (cudaError_t)cuMemGetInfo_v2(free, total));
}

static cudaError_t malloc_async(void **devPtr, size_t size, cudaStream_t hStream, int per_thread,
                                uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    if (devPtr == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    struct sd_stream *s = resolve(hStream, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    CUdeviceptr d = 0;
    CUresult rv = per_thread ? cuMemAllocAsync_ptsz(&d, size, (CUstream)s)
                             : cuMemAllocAsync(&d, size, (CUstream)s);
    *devPtr = (void *)(uintptr_t)d;
    return api_end(&c, rv == CUDA_SUCCESS ? cudaSuccess : cudaErrorMemoryAllocation);
}

API cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream)
{
    return malloc_async(devPtr, size, hStream, 0, CUPTI_RUNTIME_TRACE_CBID_cudaMallocAsync_v11020);
}

API cudaError_t cudaMallocAsync_ptsz(void **devPtr, size_t size, cudaStream_t hStream)
{
    return malloc_async(devPtr, size, hStream, 1,
                        CUPTI_RUNTIME_TRACE_CBID_cudaMallocAsync_ptsz_v11020);
}

static cudaError_t free_async(void *devPtr, cudaStream_t hStream, int per_thread, uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    if (devPtr == NULL) {
        return api_end(&c, cudaSuccess);
    }
    struct sd_stream *s = resolve(hStream, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    CUdeviceptr d = (CUdeviceptr)(uintptr_t)devPtr;
    CUresult rv = per_thread ? cuMemFreeAsync_ptsz(d, (CUstream)s) : cuMemFreeAsync(d, (CUstream)s);
    return api_end(&c, (cudaError_t)rv);
}

API cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream)
{
    return free_async(devPtr, hStream, 0, CUPTI_RUNTIME_TRACE_CBID_cudaFreeAsync_v11020);
}

API cudaError_t cudaFreeAsync_ptsz(void *devPtr, cudaStream_t hStream)
{
    return free_async(devPtr, hStream, 1, CUPTI_RUNTIME_TRACE_CBID_cudaFreeAsync_ptsz_v11020);
}

/* Enqueues a copy; *ticket receives its ticket. */
static cudaError_t enqueue_copy(struct sd_stream *s, void *dst, const void *src, size_t count,
                                enum cudaMemcpyKind kind, uint32_t corr, uint64_t *ticket)
{
    if ((unsigned)kind > cudaMemcpyDefault) {
        return cudaErrorInvalidMemcpyDirection;
    }
    if (kind == cudaMemcpyDefault) {
        int d_dev = sd_devmem_is_device(dst), s_dev = sd_devmem_is_device(src);
        kind = d_dev && s_dev ? cudaMemcpyDeviceToDevice
               : d_dev        ? cudaMemcpyHostToDevice
               : s_dev        ? cudaMemcpyDeviceToHost
                              : cudaMemcpyHostToHost;
    }
    struct sd_op *op = sd_op_new(SD_OP_DELAY);
    if (op == NULL) {
        return cudaErrorMemoryAllocation;
    }
    double gbps = kind == cudaMemcpyDeviceToDevice ? hbm_gbps : pcie_gbps;
    op->duration_ns = memcpy_lat_ns + (uint64_t)((double)count / gbps);
    op->report.kind = REPORT_MEMCPY;
    op->report.correlation_id = corr;
    op->report.bytes = count;
    op->report.copy_kind = kind;
    *ticket = sd_stream_enqueue(s, op);
    return cudaSuccess;
}

static cudaError_t memcpy_sync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                               int per_thread, uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    struct sd_stream *s = resolve(NULL, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    uint64_t ticket = 0;
    err = enqueue_copy(s, dst, src, count, kind, c.corr, &ticket);
    if (err == cudaSuccess) {
        sd_stream_wait(s, ticket);
    }
    return api_end(&c, err);
}

API cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    return memcpy_sync(dst, src, count, kind, 0, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020);
}

API cudaError_t cudaMemcpy_ptds(void *dst, const void *src, size_t count,
                                enum cudaMemcpyKind kind)
{
    return memcpy_sync(dst, src, count, kind, 1, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_ptds_v7000);
}

static cudaError_t memcpy_async(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                cudaStream_t stream, int per_thread, uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    struct sd_stream *s = resolve(stream, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    uint64_t ticket = 0;
    return api_end(&c, enqueue_copy(s, dst, src, count, kind, c.corr, &ticket));
}

API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                enum cudaMemcpyKind kind, cudaStream_t stream)
{
    return memcpy_async(dst, src, count, kind, stream, 0,
                        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020);
}

API cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t count,
                                     enum cudaMemcpyKind kind, cudaStream_t stream)
{
    return memcpy_async(dst, src, count, kind, stream, 1,
                        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_ptsz_v7000);
}

/* ---- streams ---- */

static cudaError_t stream_create(cudaStream_t *pStream, unsigned int flags, uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    if (pStream == NULL || flags > cudaStreamNonBlocking) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    struct sd_stream *s = sd_stream_create(tls_device, flags, sd_stream_next_id());
    if (s == NULL) {
        return api_end(&c, cudaErrorMemoryAllocation);
    }
    *pStream = (cudaStream_t)s;
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaStreamCreate(cudaStream_t *pStream)
{
    return stream_create(pStream, 0, CUPTI_RUNTIME_TRACE_CBID_cudaStreamCreate_v3020);
}

API cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags)
{
    return stream_create(pStream, flags, CUPTI_RUNTIME_TRACE_CBID_cudaStreamCreateWithFlags_v5000);
}

API cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaStreamDestroy_v5050);
    if (stream == NULL || stream == cudaStreamLegacy || stream == cudaStreamPerThread ||
        !sd_stream_valid(stream)) {
        return api_end(&c, cudaErrorInvalidResourceHandle);
    }
    sd_stream_destroy((struct sd_stream *)stream);
    return api_end(&c, cudaSuccess);
}

static cudaError_t stream_sync(cudaStream_t stream, int per_thread, uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    struct sd_stream *s = resolve(stream, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    CUresult rv = per_thread ? cuStreamSynchronize_ptsz((CUstream)s)
                             : cuStreamSynchronize((CUstream)s);
    return api_end(&c, (cudaError_t)rv);
}

API cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    return stream_sync(stream, 0, CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_v3020);
}

API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream)
{
    return stream_sync(stream, 1, CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_ptsz_v7000);
}

static cudaError_t stream_query(cudaStream_t stream, int per_thread, uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    struct sd_stream *s = resolve(stream, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    return api_end(&c, sd_stream_idle(s) ? cudaSuccess : cudaErrorNotReady);
}

API cudaError_t cudaStreamQuery(cudaStream_t stream)
{
    return stream_query(stream, 0, CUPTI_RUNTIME_TRACE_CBID_cudaStreamQuery_v3020);
}

API cudaError_t cudaStreamQuery_ptsz(cudaStream_t stream)
{
    return stream_query(stream, 1, CUPTI_RUNTIME_TRACE_CBID_cudaStreamQuery_ptsz_v7000);
}

static cudaError_t stream_wait_event(cudaStream_t stream, cudaEvent_t event, int per_thread,
                                     uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    struct sd_stream *s = resolve(stream, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    if (!sd_event_valid(event)) {
        return api_end(&c, cudaErrorInvalidResourceHandle);
    }
    if (sd_event_wait_on(s, (struct sd_event *)event) != 0) {
        return api_end(&c, cudaErrorMemoryAllocation);
    }
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)
{
    (void)flags;
    return stream_wait_event(stream, event, 0, CUPTI_RUNTIME_TRACE_CBID_cudaStreamWaitEvent_v3020);
}

API cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event,
                                         unsigned int flags)
{
    (void)flags;
    return stream_wait_event(stream, event, 1,
                             CUPTI_RUNTIME_TRACE_CBID_cudaStreamWaitEvent_ptsz_v7000);
}

API cudaError_t cudaStreamGetId(cudaStream_t hStream, unsigned long long *streamId)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaStreamGetId_v12000);
    cudaError_t err;
    if (streamId == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    struct sd_stream *s = resolve(hStream, 0, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    *streamId = s->id;
    return api_end(&c, cudaSuccess);
}

static cudaError_t launch_host_func(cudaStream_t stream, cudaHostFn_t fn, void *userData,
                                    int per_thread, uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    if (fn == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    struct sd_stream *s = resolve(stream, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    struct sd_op *op = sd_op_new(SD_OP_CALL);
    if (op == NULL) {
        return api_end(&c, cudaErrorMemoryAllocation);
    }
    op->fn = fn;
    op->arg = userData;
    sd_stream_enqueue(s, op);
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData)
{
    return launch_host_func(stream, fn, userData, 0,
                            CUPTI_RUNTIME_TRACE_CBID_cudaLaunchHostFunc_v10000);
}

API cudaError_t cudaLaunchHostFunc_ptsz(cudaStream_t stream, cudaHostFn_t fn, void *userData)
{
    return launch_host_func(stream, fn, userData, 1,
                            CUPTI_RUNTIME_TRACE_CBID_cudaLaunchHostFunc_ptsz_v10000);
}

/* ---- events ---- */

static cudaError_t event_create(cudaEvent_t *event, unsigned int flags, uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    if (event == NULL || flags > (cudaEventBlockingSync | cudaEventDisableTiming |
                                  cudaEventInterprocess)) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    struct sd_event *e = sd_event_create(tls_device, flags);
    if (e == NULL) {
        return api_end(&c, cudaErrorMemoryAllocation);
    }
    *event = (cudaEvent_t)e;
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaEventCreate(cudaEvent_t *event)
{
    return event_create(event, cudaEventDefault, CUPTI_RUNTIME_TRACE_CBID_cudaEventCreate_v3020);
}

API cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags)
{
    return event_create(event, flags, CUPTI_RUNTIME_TRACE_CBID_cudaEventCreateWithFlags_v3020);
}

static cudaError_t event_record(cudaEvent_t event, cudaStream_t stream, int per_thread,
                                uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    if (!sd_event_valid(event)) {
        return api_end(&c, cudaErrorInvalidResourceHandle);
    }
    struct sd_stream *s = resolve(stream, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    if (sd_event_record((struct sd_event *)event, s) != 0) {
        return api_end(&c, cudaErrorMemoryAllocation);
    }
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
    return event_record(event, stream, 0, CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_v3020);
}

API cudaError_t cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream)
{
    return event_record(event, stream, 1, CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_ptsz_v7000);
}

API cudaError_t cudaEventQuery(cudaEvent_t event)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaEventQuery_v3020);
    if (!sd_event_valid(event)) {
        return api_end(&c, cudaErrorInvalidResourceHandle);
    }
    return api_end(&c, sd_event_done((struct sd_event *)event, NULL, NULL) ? cudaSuccess
                                                                             : cudaErrorNotReady);
}

API cudaError_t cudaEventSynchronize(cudaEvent_t event)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaEventSynchronize_v3020);
    if (!sd_event_valid(event)) {
        return api_end(&c, cudaErrorInvalidResourceHandle);
    }
    return api_end(&c, (cudaError_t)cuEventSynchronize((CUevent)event));
}

API cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaEventElapsedTime_v3020);
    if (ms == NULL) {
        return api_end(&c, cudaErrorInvalidValue);
    }
    if (!sd_event_valid(start) || !sd_event_valid(end)) {
        return api_end(&c, cudaErrorInvalidResourceHandle);
    }
    struct sd_event *a = (struct sd_event *)start, *b = (struct sd_event *)end;
    if ((a->flags | b->flags) & cudaEventDisableTiming) {
        return api_end(&c, cudaErrorInvalidResourceHandle);
    }
    uint64_t ta = 0, tb = 0, ra = 0, rb = 0;
    int da = sd_event_done(a, &ta, &ra), db = sd_event_done(b, &tb, &rb);
    if (ra == 0 || rb == 0) {
        return api_end(&c, cudaErrorInvalidResourceHandle);
    }
    if (!da || !db) {
        return api_end(&c, cudaErrorNotReady);
    }
    *ms = (float)(((double)tb - (double)ta) / 1e6);
    return api_end(&c, cudaSuccess);
}

API cudaError_t cudaEventDestroy(cudaEvent_t event)
{
    struct api_call c = api_begin(CUPTI_RUNTIME_TRACE_CBID_cudaEventDestroy_v3020);
    if (!sd_event_valid(event)) {
        return api_end(&c, cudaErrorInvalidResourceHandle);
    }
    sd_event_destroy((struct sd_event *)event);
    return api_end(&c, cudaSuccess);
}

/* ---- launch ---- */

static cudaError_t launch(const void *func, dim3 grid, dim3 block, void **args, size_t sharedMem,
                          cudaStream_t stream, int per_thread, uint32_t cbid)
{
    struct api_call c = api_begin(cbid);
    cudaError_t err;
    if (func == NULL) {
        return api_end(&c, cudaErrorInvalidDeviceFunction);
    }
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 ||
        block.z == 0) {
        return api_end(&c, cudaErrorInvalidConfiguration);
    }
    struct sd_stream *s = resolve(stream, per_thread, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    CUfunction f = driver_function(func);
    if (f == NULL) {
        return api_end(&c, cudaErrorInvalidDeviceFunction);
    }
    /* The kernel reports this call's correlation id. */
    sd_cu_set_correlation(c.corr);
    CUresult rv = per_thread ? cuLaunchKernel_ptsz(f, grid.x, grid.y, grid.z, block.x, block.y,
                                                   block.z, (unsigned)sharedMem, (CUstream)s,
                                                   args, NULL)
                             : cuLaunchKernel(f, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                                              (unsigned)sharedMem, (CUstream)s, args, NULL);
    sd_cu_set_correlation(0);
    return api_end(&c, rv == CUDA_SUCCESS ? cudaSuccess : cudaErrorLaunchFailure);
}

API cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                 size_t sharedMem, cudaStream_t stream)
{
    return launch(func, gridDim, blockDim, args, sharedMem, stream, 0,
                  CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000);
}

API cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                      size_t sharedMem, cudaStream_t stream)
{
    return launch(func, gridDim, blockDim, args, sharedMem, stream, 1,
                  CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000);
}

API cudaError_t __cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                   size_t sharedMem, cudaStream_t stream)
{
    return launch(func, gridDim, blockDim, args, sharedMem, stream, 0,
                  CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000);
}

API cudaError_t __cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim,
                                        void **args, size_t sharedMem, cudaStream_t stream)
{
    return launch(func, gridDim, blockDim, args, sharedMem, stream, 1,
                  CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000);
}

/* ---- registration (names) ---- */

static void *fatbin_handle_storage;

API void **__cudaRegisterFatBinary(void *fatCubin)
{
    (void)fatCubin;
    ensure_init();
    return &fatbin_handle_storage;
}

API void __cudaRegisterFatBinaryEnd(void **fatCubinHandle)
{
    (void)fatCubinHandle;
}

API void __cudaUnregisterFatBinary(void **fatCubinHandle)
{
    (void)fatCubinHandle;
}

API void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun,
                                const char *deviceName, int thread_limit, uint3 *tid, uint3 *bid,
                                dim3 *bDim, dim3 *gDim, int *wSize)
{
    (void)fatCubinHandle;
    (void)thread_limit;
    (void)tid;
    (void)bid;
    (void)bDim;
    (void)gDim;
    (void)wSize;
    ensure_init();
    const char *name = deviceName != NULL ? deviceName : deviceFun;
    if (hostFun != NULL && name != NULL) {
        set_name(hostFun, sd_intern(name));
    }
}

/* ---- internal hook for libnccl ---- */

API int __standin_cuda_stream_enqueue(void *stream, int per_thread, const char *kernel_name_,
                                      standin_stream_fn fn, void *arg,
                                      struct standin_enqueue_info *info)
{
    ensure_init();
    cudaError_t err;
    struct sd_stream *s = resolve((cudaStream_t)stream, per_thread, &err);
    if (s == NULL) {
        return err;
    }
    struct sd_op *op = sd_op_new(SD_OP_CALL);
    if (op == NULL) {
        return cudaErrorMemoryAllocation;
    }
    /* NCCL launches its kernels through the runtime (cudaLaunchKernel /
     * cudaLaunchKernelExC): a kernel comes with a RUNTIME API record of the
     * same correlation id, made inside the collective's call. */
    struct api_call c = api_begin(kernel_name_ != NULL ? CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000
                                                       : CUPTI_RUNTIME_TRACE_CBID_INVALID);
    uint32_t corr = c.corr;
    op->fn = fn;
    op->arg = arg;
    if (kernel_name_ != NULL) {
        op->report.kind = REPORT_KERNEL;
        op->report.name = sd_intern(kernel_name_);
        op->report.correlation_id = corr;
        for (int i = 0; i < 3; i++) {
            op->report.grid[i] = 1;
            op->report.block[i] = 1;
        }
    }
    if (info != NULL) {
        info->device_id = (uint32_t)s->device;
        info->stream_id = s->id;
        info->correlation_id = corr;
    }
    sd_stream_enqueue(s, op);
    return api_end(&c, cudaSuccess);
}
