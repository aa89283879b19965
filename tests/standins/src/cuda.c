/*
 * cuda.c: the stand-in libcuda.so.1 (see include/standin_cu.h).
 *
 * Owns the device engine (streams, events, device memory) that the stand-in
 * libcudart drives through the calls below (and through cudrv.h): launches,
 * allocations, frees and synchronisations reach the driver on the caller's
 * thread, inside the runtime call, as with the real libraries. Programs
 * (and the simulator's NCCL-, cuBLAS- or Triton-like code) may call the
 * driver directly.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cudrv.h"
#include "common/devmem.h"
#include "common/stream.h"
#include "common/util.h"
#include "standin_cu.h"
#include "standin_kernel.h"

#define API SD_EXPORT

#define FUNC_MAGIC 0x434E5546u  /* "FUNC" */
#define MOD_MAGIC 0x30444F4Du   /* "MOD0" */
#define GRAPH_MAGIC 0x48505247u /* "GRPH" */
#define EXEC_MAGIC 0x43455847u  /* "GXEC" */
#define VA_BASE 0x300000000000ull
#define VA_SPAN (1ull << 44)
#define GRANULARITY (2ull << 20)

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int device_count;
static __thread int tls_device;
static __thread uint32_t tls_correlation;
static uint32_t driver_correlation = 1u << 30; /* apart from the runtime's ids */

static pthread_mutex_t legacy_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sd_stream *legacy_streams[SD_MAX_DEVICES];
static __thread struct sd_stream *tls_streams[SD_MAX_DEVICES];
static pthread_key_t tls_streams_key;

static void destroy_thread_streams(void *unused)
{
    (void)unused;
    for (int i = 0; i < SD_MAX_DEVICES; i++) {
        if (tls_streams[i] != NULL) {
            sd_stream_destroy(tls_streams[i]);
            tls_streams[i] = NULL;
        }
    }
}

static void init(void)
{
    device_count = (int)sd_env_u64("STANDIN_DEVICE_COUNT", 8);
    if (device_count < 0) {
        device_count = 0;
    }
    if (device_count > SD_MAX_DEVICES) {
        device_count = SD_MAX_DEVICES;
    }
    sd_devmem_init(0x200000000000ull, sd_env_u64("STANDIN_DEVICE_MEM_BYTES", 80ull << 30));
    pthread_key_create(&tls_streams_key, destroy_thread_streams);
}

static void ensure_init(void)
{
    pthread_once(&init_once, init);
}

/* ---- engine exports for libcudart (cudrv.h) ---- */

struct sd_stream *sd_cu_legacy_stream(int device)
{
    ensure_init();
    pthread_mutex_lock(&legacy_mu);
    if (legacy_streams[device] == NULL) {
        legacy_streams[device] = sd_stream_create(device, 0, SD_CU_DEFAULT_STREAM_ID);
    }
    struct sd_stream *s = legacy_streams[device];
    pthread_mutex_unlock(&legacy_mu);
    return s;
}

struct sd_stream *sd_cu_per_thread_stream(int device)
{
    ensure_init();
    if (tls_streams[device] == NULL) {
        tls_streams[device] = sd_stream_create(device, 0, sd_stream_next_id());
        pthread_setspecific(tls_streams_key, (void *)1);
    }
    return tls_streams[device];
}

void sd_cu_set_correlation(uint32_t correlation_id)
{
    tls_correlation = correlation_id;
}

static uint32_t correlation(void)
{
    if (tls_correlation != 0) {
        return tls_correlation;
    }
    return __atomic_add_fetch(&driver_correlation, 1, __ATOMIC_RELAXED);
}

/* The stream a handle names (NULL: *err says why). */
static struct sd_stream *resolve(CUstream stream, int per_thread, CUresult *err)
{
    *err = CUDA_SUCCESS;
    if (stream == NULL) {
        stream = per_thread ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY;
    }
    struct sd_stream *s;
    if (stream == CU_STREAM_LEGACY) {
        s = sd_cu_legacy_stream(tls_device);
    } else if (stream == CU_STREAM_PER_THREAD) {
        s = sd_cu_per_thread_stream(tls_device);
    } else if (sd_stream_valid(stream)) {
        s = (struct sd_stream *)stream;
    } else {
        *err = CUDA_ERROR_INVALID_HANDLE;
        return NULL;
    }
    if (s == NULL) {
        *err = CUDA_ERROR_OUT_OF_MEMORY;
    }
    return s;
}

/* ---- initialisation, devices, contexts ---- */

API CUresult cuInit(unsigned int flags)
{
    (void)flags;
    ensure_init();
    return device_count > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

API CUresult cuDriverGetVersion(int *driverVersion)
{
    if (driverVersion == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *driverVersion = CUDA_VERSION;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count)
{
    ensure_init();
    if (count == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *count = device_count;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    ensure_init();
    if (device == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (ordinal < 0 || ordinal >= device_count) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    *device = ordinal;
    return CUDA_SUCCESS;
}

/* The primary context of device N is the handle N + 1. */
API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    ensure_init();
    if (pctx == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (dev < 0 || dev >= device_count) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    *pctx = (CUcontext)(uintptr_t)(dev + 1);
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    ensure_init();
    uintptr_t d = (uintptr_t)ctx;
    if (d == 0 || d > (uintptr_t)device_count) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    tls_device = (int)(d - 1);
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (pctx == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pctx = (CUcontext)(uintptr_t)(tls_device + 1);
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetDevice(CUdevice *device)
{
    if (device == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *device = tls_device;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize(void)
{
    ensure_init();
    sd_device_sync(tls_device);
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (pStr == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    switch (error) {
    case CUDA_SUCCESS: *pStr = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *pStr = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *pStr = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_HANDLE: *pStr = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_FOUND: *pStr = "CUDA_ERROR_NOT_FOUND"; break;
    default: *pStr = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* ---- memory ---- */

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    ensure_init();
    if (dptr == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    void *p = NULL;
    if (sd_devmem_alloc(tls_device, bytesize, &p) != 0) {
        *dptr = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    ensure_init();
    if (dptr == 0) {
        return CUDA_SUCCESS;
    }
    /* Like the real call, freeing waits for the device's work. */
    sd_device_sync(tls_device);
    return sd_devmem_free((void *)(uintptr_t)dptr, NULL) == 0 ? CUDA_SUCCESS
                                                               : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    ensure_init();
    if (free == NULL || total == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    sd_devmem_info(tls_device, free, total);
    return CUDA_SUCCESS;
}

static CUresult mem_alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream hStream,
                                int per_thread)
{
    ensure_init();
    CUresult err;
    if (dptr == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (resolve(hStream, per_thread, &err) == NULL) {
        return err;
    }
    return cuMemAlloc_v2(dptr, bytesize);
}

API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return mem_alloc_async(dptr, bytesize, hStream, 0);
}

API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return mem_alloc_async(dptr, bytesize, hStream, 1);
}

static void free_on_stream(void *ptr)
{
    sd_devmem_free(ptr, NULL);
}

static CUresult mem_free_async(CUdeviceptr dptr, CUstream hStream, int per_thread)
{
    ensure_init();
    CUresult err;
    if (dptr == 0) {
        return CUDA_SUCCESS;
    }
    struct sd_stream *s = resolve(hStream, per_thread, &err);
    if (s == NULL) {
        return err;
    }
    if (!sd_devmem_is_device((void *)(uintptr_t)dptr)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct sd_op *op = sd_op_new(SD_OP_CALL);
    if (op == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    op->fn = free_on_stream;
    op->arg = (void *)(uintptr_t)dptr;
    sd_stream_enqueue(s, op);
    return CUDA_SUCCESS;
}

API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    return mem_free_async(dptr, hStream, 0);
}

API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return mem_free_async(dptr, hStream, 1);
}

/* ---- virtual memory ---- */

/* Reserved ranges and mappings, in small bounded tables. */
#define MAX_RANGES 1024
#define MAX_MAPPINGS 65536

struct va_range {
    uint64_t start, size;
};
struct mapping {
    uint64_t start, size, handle;
};

static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t va_next = VA_BASE;
static struct va_range ranges[MAX_RANGES];
static size_t ranges_len;
static struct mapping *mappings;
static size_t mappings_len;

API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                           CUmemAllocationGranularity_flags option)
{
    (void)option;
    if (granularity == NULL || prop == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *granularity = GRANULARITY;
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                 unsigned long long flags)
{
    (void)alignment;
    (void)addr;
    (void)flags;
    ensure_init();
    if (ptr == NULL || size == 0 || size % GRANULARITY != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&vmm_mu);
    if (ranges_len == MAX_RANGES || va_next + size > VA_BASE + VA_SPAN) {
        pthread_mutex_unlock(&vmm_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    ranges[ranges_len].start = va_next;
    ranges[ranges_len].size = size;
    ranges_len++;
    *ptr = va_next;
    va_next += size;
    pthread_mutex_unlock(&vmm_mu);
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    pthread_mutex_lock(&vmm_mu);
    for (size_t i = 0; i < ranges_len; i++) {
        if (ranges[i].start == ptr && ranges[i].size == size) {
            ranges[i] = ranges[--ranges_len];
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&vmm_mu);
    return CUDA_ERROR_INVALID_VALUE;
}

/* The handle is the physical memory's opaque device address. */
API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                         const CUmemAllocationProp *prop, unsigned long long flags)
{
    (void)flags;
    ensure_init();
    if (handle == NULL || prop == NULL || size == 0 || size % GRANULARITY != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    int device = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id
                                                                    : tls_device;
    if (device < 0 || device >= device_count) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    void *p = NULL;
    if (sd_devmem_alloc(device, size, &p) != 0) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
    return CUDA_SUCCESS;
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    return sd_devmem_free((void *)(uintptr_t)handle, NULL) == 0 ? CUDA_SUCCESS
                                                                 : CUDA_ERROR_INVALID_VALUE;
}

static int reserved_locked(uint64_t start, uint64_t size)
{
    for (size_t i = 0; i < ranges_len; i++) {
        if (start >= ranges[i].start && start + size <= ranges[i].start + ranges[i].size) {
            return 1;
        }
    }
    return 0;
}

API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                      unsigned long long flags)
{
    (void)flags;
    if (size == 0 || offset != 0 || !sd_devmem_is_device((void *)(uintptr_t)handle)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&vmm_mu);
    if (mappings == NULL) {
        mappings = calloc(MAX_MAPPINGS, sizeof(*mappings));
    }
    if (mappings == NULL || mappings_len == MAX_MAPPINGS || !reserved_locked(ptr, size)) {
        pthread_mutex_unlock(&vmm_mu);
        return mappings == NULL ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_VALUE;
    }
    for (size_t i = 0; i < mappings_len; i++) {
        if (ptr < mappings[i].start + mappings[i].size && mappings[i].start < ptr + size) {
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_ERROR_INVALID_VALUE; /* already mapped */
        }
    }
    mappings[mappings_len].start = ptr;
    mappings[mappings_len].size = size;
    mappings[mappings_len].handle = handle;
    mappings_len++;
    pthread_mutex_unlock(&vmm_mu);
    return CUDA_SUCCESS;
}

/* Unmaps every mapping inside [ptr, ptr + size); nothing mapped there is an
 * error, as a partly covered mapping is. */
API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult rv = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    for (size_t i = 0; i < mappings_len;) {
        struct mapping *m = &mappings[i];
        if (m->start >= ptr && m->start + m->size <= ptr + size) {
            *m = mappings[--mappings_len];
            rv = CUDA_SUCCESS;
        } else if (m->start < ptr + size && ptr < m->start + m->size) {
            rv = CUDA_ERROR_INVALID_VALUE;
            break;
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&vmm_mu);
    return rv;
}

API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    if (desc == NULL || count == 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&vmm_mu);
    int ok = reserved_locked(ptr, size);
    pthread_mutex_unlock(&vmm_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- synchronisation ---- */

static CUresult stream_sync(CUstream hStream, int per_thread)
{
    ensure_init();
    CUresult err;
    struct sd_stream *s = resolve(hStream, per_thread, &err);
    if (s == NULL) {
        return err;
    }
    sd_stream_sync(s);
    return CUDA_SUCCESS;
}

API CUresult cuStreamSynchronize(CUstream hStream)
{
    return stream_sync(hStream, 0);
}

API CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    return stream_sync(hStream, 1);
}

API CUresult cuEventSynchronize(CUevent hEvent)
{
    if (!sd_event_valid(hEvent)) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    sd_event_sync((struct sd_event *)hEvent);
    return CUDA_SUCCESS;
}

/* ---- modules, libraries, kernels ---- */

/* A module or library: any image; every name is a kernel in it. Function
 * and kernel handles are the same objects (a CUkernel may be launched as a
 * CUfunction), one per (module, name), kept for the process's life. */
struct module {
    uint32_t magic;
    struct function *functions;
};
struct function {
    uint32_t magic;
    const char *name;
    struct function *next;
};

static pthread_mutex_t modules_mu = PTHREAD_MUTEX_INITIALIZER;

static CUresult module_new(void **out)
{
    ensure_init();
    if (out == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct module *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->magic = MOD_MAGIC;
    *out = m;
    return CUDA_SUCCESS;
}

static CUresult function_get(void **out, void *module, const char *name)
{
    struct module *m = module;
    if (out == NULL || m == NULL || m->magic != MOD_MAGIC || name == NULL || name[0] == '\0') {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&modules_mu);
    struct function *f = m->functions;
    while (f != NULL && strcmp(f->name, name) != 0) {
        f = f->next;
    }
    if (f == NULL) {
        f = calloc(1, sizeof(*f));
        if (f == NULL) {
            pthread_mutex_unlock(&modules_mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        f->magic = FUNC_MAGIC;
        f->name = sd_intern(name);
        f->next = m->functions;
        m->functions = f;
    }
    pthread_mutex_unlock(&modules_mu);
    *out = f;
    return CUDA_SUCCESS;
}

static const struct function *as_function(const void *handle)
{
    const struct function *f = handle;
    return f != NULL && f->magic == FUNC_MAGIC ? f : NULL;
}

API CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    (void)image;
    return module_new((void **)module);
}

API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    return function_get((void **)hfunc, hmod, name);
}

API CUresult cuLibraryLoadData(CUlibrary *library, const void *code, void *jitOptions,
                               void **jitOptionsValues, unsigned int numJitOptions,
                               void *libraryOptions, void **libraryOptionValues,
                               unsigned int numLibraryOptions)
{
    (void)code;
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    return module_new((void **)library);
}

API CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    return function_get((void **)pKernel, library, name);
}

API CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    if (pFunc == NULL || as_function(kernel) == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pFunc = (CUfunction)kernel;
    return CUDA_SUCCESS;
}

API CUresult cuFuncGetName(const char **name, CUfunction hfunc)
{
    const struct function *f = as_function(hfunc);
    if (name == NULL || f == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *name = f->name;
    return CUDA_SUCCESS;
}

/* ---- launches ---- */

struct launch_dims {
    unsigned grid[3], block[3], shared_mem;
};

static CUresult launch(const void *func, const struct launch_dims *d, CUstream hStream,
                       int per_thread, void **kernelParams)
{
    ensure_init();
    const struct function *f = as_function(func);
    if (f == NULL) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (int i = 0; i < 3; i++) {
        if (d->grid[i] == 0 || d->block[i] == 0) {
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    CUresult err;
    struct sd_stream *s = resolve(hStream, per_thread, &err);
    if (s == NULL) {
        return err;
    }
    struct sd_op *op = sd_op_new(SD_OP_DELAY);
    if (op == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (kernelParams != NULL && kernelParams[0] != NULL) {
        const struct standin_kernel_spec *spec = kernelParams[0];
        if (spec->magic == STANDIN_KERNEL_MAGIC) {
            op->duration_ns = spec->duration_ns;
            op->spin = spec->mode == STANDIN_KERNEL_SPIN;
        }
    }
    op->report.kind = SD_CU_REPORT_KERNEL;
    op->report.name = f->name;
    op->report.correlation_id = correlation();
    for (int i = 0; i < 3; i++) {
        op->report.grid[i] = (int32_t)d->grid[i];
        op->report.block[i] = (int32_t)d->block[i];
    }
    op->report.shared_mem = (int32_t)d->shared_mem;
    sd_stream_enqueue(s, op);
    return CUDA_SUCCESS;
}

#define DIMS                                                                                      \
    {                                                                                             \
        {gridDimX, gridDimY, gridDimZ}, {blockDimX, blockDimY, blockDimZ}, sharedMemBytes         \
    }

API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                            unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                            unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                            void **kernelParams, void **extra)
{
    (void)extra;
    struct launch_dims d = DIMS;
    return launch(f, &d, hStream, 0, kernelParams);
}

API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                 unsigned int gridDimZ, unsigned int blockDimX,
                                 unsigned int blockDimY, unsigned int blockDimZ,
                                 unsigned int sharedMemBytes, CUstream hStream,
                                 void **kernelParams, void **extra)
{
    (void)extra;
    struct launch_dims d = DIMS;
    return launch(f, &d, hStream, 1, kernelParams);
}

API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                       unsigned int gridDimZ, unsigned int blockDimX,
                                       unsigned int blockDimY, unsigned int blockDimZ,
                                       unsigned int sharedMemBytes, CUstream hStream,
                                       void **kernelParams)
{
    struct launch_dims d = DIMS;
    return launch(f, &d, hStream, 0, kernelParams);
}

API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                            unsigned int gridDimY, unsigned int gridDimZ,
                                            unsigned int blockDimX, unsigned int blockDimY,
                                            unsigned int blockDimZ, unsigned int sharedMemBytes,
                                            CUstream hStream, void **kernelParams)
{
    struct launch_dims d = DIMS;
    return launch(f, &d, hStream, 1, kernelParams);
}

static CUresult launch_ex(const CUlaunchConfig *c, CUfunction f, void **kernelParams,
                          int per_thread)
{
    if (c == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct launch_dims d = {{c->gridDimX, c->gridDimY, c->gridDimZ},
                            {c->blockDimX, c->blockDimY, c->blockDimZ},
                            c->sharedMemBytes};
    return launch(f, &d, c->hStream, per_thread, kernelParams);
}

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                              void **extra)
{
    (void)extra;
    return launch_ex(config, f, kernelParams, 0);
}

API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                   void **kernelParams, void **extra)
{
    (void)extra;
    return launch_ex(config, f, kernelParams, 1);
}

/* ---- graphs: kernel nodes, run in insertion order ---- */

struct graph_node {
    const struct function *func;
    struct launch_dims dims;
    struct standin_kernel_spec spec; /* copied at insertion */
    int has_spec;
    struct graph_node *next;
};
struct graph {
    uint32_t magic;
    struct graph_node *head, **tail;
};
struct graph_exec {
    uint32_t magic;
    struct graph *graph;
};

API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    (void)flags;
    if (phGraph == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct graph *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g->magic = GRAPH_MAGIC;
    g->tail = &g->head;
    *phGraph = (CUgraph)g;
    return CUDA_SUCCESS;
}

API CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                     const CUgraphNode *dependencies, size_t numDependencies,
                                     const CUDA_KERNEL_NODE_PARAMS *p)
{
    (void)dependencies;
    (void)numDependencies;
    struct graph *g = (struct graph *)hGraph;
    if (phGraphNode == NULL || g == NULL || g->magic != GRAPH_MAGIC || p == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    const struct function *f = as_function(p->func != NULL ? (void *)p->func : (void *)p->kern);
    if (f == NULL) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct graph_node *n = calloc(1, sizeof(*n));
    if (n == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    n->func = f;
    n->dims = (struct launch_dims){{p->gridDimX, p->gridDimY, p->gridDimZ},
                                   {p->blockDimX, p->blockDimY, p->blockDimZ},
                                   p->sharedMemBytes};
    if (p->kernelParams != NULL && p->kernelParams[0] != NULL) {
        memcpy(&n->spec, p->kernelParams[0], sizeof(n->spec));
        n->has_spec = 1;
    }
    *g->tail = n;
    g->tail = &n->next;
    *phGraphNode = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                         unsigned long long flags)
{
    (void)flags;
    struct graph *g = (struct graph *)hGraph;
    if (phGraphExec == NULL || g == NULL || g->magic != GRAPH_MAGIC) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct graph_exec *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    e->magic = EXEC_MAGIC;
    e->graph = g;
    *phGraphExec = (CUgraphExec)e;
    return CUDA_SUCCESS;
}

static CUresult graph_launch(CUgraphExec hGraphExec, CUstream hStream, int per_thread)
{
    struct graph_exec *e = (struct graph_exec *)hGraphExec;
    if (e == NULL || e->magic != EXEC_MAGIC) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (struct graph_node *n = e->graph->head; n != NULL; n = n->next) {
        void *params[] = {n->has_spec ? &n->spec : NULL};
        CUresult rv = launch(n->func, &n->dims, hStream, per_thread, params);
        if (rv != CUDA_SUCCESS) {
            return rv;
        }
    }
    return CUDA_SUCCESS;
}

API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream, 0);
}

API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream, 1);
}

API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    struct graph_exec *e = (struct graph_exec *)hGraphExec;
    if (e == NULL || e->magic != EXEC_MAGIC) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}

API CUresult cuGraphDestroy(CUgraph hGraph)
{
    struct graph *g = (struct graph *)hGraph;
    if (g == NULL || g->magic != GRAPH_MAGIC) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (struct graph_node *n = g->head; n != NULL;) {
        struct graph_node *next = n->next;
        free(n);
        n = next;
    }
    g->magic = 0;
    free(g);
    return CUDA_SUCCESS;
}
