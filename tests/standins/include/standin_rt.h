/*
 * standin_rt.h: the subset of the CANN runtime below AscendCL
 * (runtime/kernel.h, mem.h, stream.h, event.h, dev.h, rts/rts_kernel.h)
 * that the stand-in libruntime.so implements, with the real names, types
 * and prototypes. Statuses are AscendCL's external ACL_ERROR_RT_* codes,
 * as the real runtime returns them (0 is RT_ERROR_NONE).
 *
 * The stand-in runtime owns the devices of the Ascend stand-ins: streams,
 * events, device memory (STANDIN_DEVICE_MEM_BYTES per device, default
 * 64 GiB; STANDIN_DEVICE_COUNT devices, default 8). AscendCL launches,
 * allocates, frees and syncs through it on the caller's thread; HCCL and
 * operator libraries may call it directly. Kernels: args (rtKernelLaunch)
 * or argsInfo->args (the rtArgsEx_t launches) point at a struct
 * standin_kernel_spec (standin_kernel.h) giving the duration. Names: a stub
 * function registered by rtFunctionRegister launches the kernel of its
 * stubName; rtsFuncGetByName hands out one function handle per name.
 */
#ifndef STANDIN_RT_H
#define STANDIN_RT_H

#include <stddef.h>
#include <stdint.h>

#include "standin_kernel.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t rtError_t;
typedef void *rtStream_t;
typedef void *rtEvent_t;
typedef void *rtBinHandle;
typedef void *rtFuncHandle;
typedef uint32_t rtMemType_t;
typedef struct tagRtSmCtrl rtSmDesc_t; /* never dereferenced here */
typedef struct tagRtTaskCfgInfo rtTaskCfgInfo_t;

#define RT_ERROR_NONE 0
/* RT_MEMORY_HBM: device high-bandwidth memory. */
#define RT_MEMORY_HBM 0x2u

/* The launch arguments of the rtArgsEx_t launches (runtime/base.h). */
typedef struct tagRtArgsEx {
    void *args;
    void *hostInputInfoPtr;
    uint32_t argsSize;
    uint32_t tilingAddrOffset;
    uint32_t tilingDataOffset;
    uint16_t hostInputInfoNum;
    uint8_t hasTiling;
    uint8_t isNoNeedH2DCopy;
    uint8_t reserved[4];
} rtArgsEx_t;

rtError_t rtSetDevice(int32_t devId);
rtError_t rtMalloc(void **devPtr, uint64_t size, rtMemType_t type, uint16_t moduleId);
rtError_t rtFree(void *devPtr);
rtError_t rtStreamSynchronize(rtStream_t stm);
rtError_t rtEventSynchronize(rtEvent_t evt);
rtError_t rtDeviceSynchronize(void);
rtError_t rtFunctionRegister(void *binHandle, const void *stubFunc, const char *stubName,
                             const void *kernelInfoExt, uint32_t funcMode);
rtError_t rtGetFunctionByName(const char *stubName, void **stubFunc);
rtError_t rtsFuncGetByName(const rtBinHandle binHandle, const char *kernelName,
                           rtFuncHandle *funcHandle);
rtError_t rtKernelLaunch(const void *stubFunc, uint32_t numBlocks, void *args, uint32_t argsSize,
                         rtSmDesc_t *smDesc, rtStream_t stm);
rtError_t rtKernelLaunchWithFlag(const void *stubFunc, uint32_t numBlocks, rtArgsEx_t *argsInfo,
                                 rtSmDesc_t *smDesc, rtStream_t stm, uint32_t flags);
rtError_t rtLaunchKernelByFuncHandleV3(rtFuncHandle funcHandle, uint32_t numBlocks,
                                       const rtArgsEx_t *const argsInfo, rtStream_t stm,
                                       const rtTaskCfgInfo_t *const cfgInfo);

#ifdef __cplusplus
}
#endif

#endif /* STANDIN_RT_H */
