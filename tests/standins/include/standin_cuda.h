/*
 * standin_cuda.h: the subset of the CUDA runtime API (cuda_runtime_api.h,
 * CUDA 12) that the stand-in libcudart.so.12 implements, with the real
 * names, types, enum values and prototypes.
 *
 * Semantics of the stand-in (see tests/standins/README.md):
 * - Every stream (created, the per-device legacy default stream, and one
 *   per-thread default stream per device and thread) is a worker thread that
 *   runs its work in order. Kernels take the time encoded in their arguments
 *   (standin_kernel.h); copies take bytes / bandwidth; no data moves and
 *   device pointers are opaque (never dereference them).
 * - cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize /
 *   cudaMemcpy block the caller until the work they wait for is done.
 * - The NULL stream is the device's legacy default stream (an ordinary
 *   in-order stream: it does not serialise with other streams); NULL passed
 *   to a *_ptsz / *_ptds entry point (or cudaStreamPerThread anywhere) is the
 *   calling thread's per-thread default stream.
 * - Device memory: STANDIN_DEVICE_MEM_BYTES per device and process (default
 *   80 GiB); beyond it cudaMalloc returns cudaErrorMemoryAllocation.
 * - Device count: STANDIN_DEVICE_COUNT (default 8).
 * - All times (CUPTI records, cuptiGetTimestamp) are CLOCK_BOOTTIME ns.
 *
 * Define CUDA_API_PER_THREAD_DEFAULT_STREAM before including this header to
 * route the stream-taking calls to their *_ptsz / *_ptds variants, as
 * nvcc --default-stream per-thread does.
 */
#ifndef STANDIN_CUDA_H
#define STANDIN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "standin_kernel.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CUDART_VERSION 12090

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorInsufficientDriver = 35,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotPermitted = 800,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorUnknown = 999
} cudaError_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef void (*cudaHostFn_t)(void *userData);

struct dim3 {
    unsigned int x, y, z;
};
typedef struct dim3 dim3;

struct uint3 {
    unsigned int x, y, z;
};
typedef struct uint3 uint3;

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)

#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaEventInterprocess 0x04

#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
#define cudaLaunchKernel cudaLaunchKernel_ptsz
#define cudaMemcpyAsync cudaMemcpyAsync_ptsz
#define cudaMemcpy cudaMemcpy_ptds
#define cudaStreamSynchronize cudaStreamSynchronize_ptsz
#define cudaStreamWaitEvent cudaStreamWaitEvent_ptsz
#define cudaEventRecord cudaEventRecord_ptsz
#define cudaMallocAsync cudaMallocAsync_ptsz
#define cudaFreeAsync cudaFreeAsync_ptsz
#define cudaStreamQuery cudaStreamQuery_ptsz
#define cudaLaunchHostFunc cudaLaunchHostFunc_ptsz
#endif

/* Devices */
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDriverGetVersion(int *driverVersion);
cudaError_t cudaRuntimeGetVersion(int *runtimeVersion);

/* Errors */
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t error);
const char *cudaGetErrorName(cudaError_t error);

/* Memory */
cudaError_t cudaMalloc(void **devPtr, size_t size);
cudaError_t cudaFree(void *devPtr);
cudaError_t cudaMemGetInfo(size_t *free, size_t *total);
cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream);
cudaError_t cudaMallocAsync_ptsz(void **devPtr, size_t size, cudaStream_t hStream);
cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream);
cudaError_t cudaFreeAsync_ptsz(void *devPtr, cudaStream_t hStream);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpy_ptds(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                 cudaStream_t stream);

/* Streams */
cudaError_t cudaStreamCreate(cudaStream_t *pStream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamQuery_ptsz(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
/* The stream's CUPTI streamId (the streamId of its kernel/memcpy records). */
cudaError_t cudaStreamGetId(cudaStream_t hStream, unsigned long long *streamId);
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData);
cudaError_t cudaLaunchHostFunc_ptsz(cudaStream_t stream, cudaHostFn_t fn, void *userData);

/* Events */
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t event);

/* Launch. x86-64: grid and block each travel in two registers, args is the
 * 5th register argument, sharedMem and stream are on the stack. */
cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                             size_t sharedMem, cudaStream_t stream);
cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                  size_t sharedMem, cudaStream_t stream);
/* What nvcc-generated launch stubs call (CUDA 12.x); same behaviour. */
cudaError_t __cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                               size_t sharedMem, cudaStream_t stream);
cudaError_t __cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream);

/* Registration, as nvcc-generated host code does it; used here for names. */
void **__cudaRegisterFatBinary(void *fatCubin);
void __cudaRegisterFatBinaryEnd(void **fatCubinHandle);
void __cudaUnregisterFatBinary(void **fatCubinHandle);
void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun,
                            const char *deviceName, int thread_limit, uint3 *tid, uint3 *bid,
                            dim3 *bDim, dim3 *gDim, int *wSize);

/* Stand-in convenience (not in the real API): name the kernel whose host
 * stub is `func` (the name appears in CUPTI kernel records). */
static inline void standin_cuda_register_kernel(const void *func, const char *name)
{
    void **handle = __cudaRegisterFatBinary((void *)0);
    __cudaRegisterFunction(handle, (const char *)func, (char *)name, name, -1, (uint3 *)0,
                           (uint3 *)0, (dim3 *)0, (dim3 *)0, (int *)0);
    __cudaRegisterFatBinaryEnd(handle);
}

#ifdef __cplusplus
}
#endif

#endif /* STANDIN_CUDA_H */
