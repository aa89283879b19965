/* The public AscendCL runtime, HCCL and MSPTI entry points the simulated rank
 * calls, declared from the public CANN API (same names, types and ABI as
 * libascendcl.so, libhccl.so and libmspti.so). Only what the rank uses. */
#ifndef SIM_API_ASCEND_H
#define SIM_API_ASCEND_H

#include <stddef.h>
#include <stdint.h>

/* ---- AscendCL runtime ---- */
typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtFuncHandle;
typedef enum { ACL_MEM_MALLOC_HUGE_FIRST = 0 } aclrtMemMallocPolicy;
typedef enum { ACL_MEMCPY_HOST_TO_DEVICE = 1 } aclrtMemcpyKind;
enum { ACL_SUCCESS = 0, ACL_ERROR_RT_MEMORY_ALLOCATION = 207001 };

aclError aclInit(const char *configPath);
aclError aclFinalize(void);
aclError aclrtSetDevice(int32_t deviceId);
aclError aclrtGetDeviceCount(uint32_t *count);
aclError aclrtCreateStream(aclrtStream *stream);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                          aclrtMemcpyKind kind, aclrtStream stream);
aclError aclrtLaunchKernel(aclrtFuncHandle funcHandle, uint32_t numBlocks, const void *argsData,
                           size_t argsSize, aclrtStream stream);

/* ---- HCCL ---- */
typedef int HcclResult;
typedef void *HcclComm;
#define HCCL_ROOT_INFO_BYTES 4108
typedef struct {
    char internal[HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;
typedef enum { HCCL_DATA_TYPE_FP32 = 4 } HcclDataType;
typedef enum { HCCL_REDUCE_SUM = 0 } HcclReduceOp;

HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo);
HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                                HcclComm *comm);
HcclResult HcclCommDestroy(HcclComm comm);
HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
                         HcclReduceOp op, HcclComm comm, aclrtStream stream);
HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, HcclDataType dataType,
                         HcclComm comm, aclrtStream stream);
HcclResult HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount,
                             HcclDataType dataType, HcclReduceOp op, HcclComm comm,
                             aclrtStream stream);
HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType, uint32_t root,
                         HcclComm comm, aclrtStream stream);
HcclResult HcclSend(void *sendBuf, uint64_t count, HcclDataType dataType, uint32_t destRank,
                    HcclComm comm, aclrtStream stream);
HcclResult HcclRecv(void *recvBuf, uint64_t count, HcclDataType dataType, uint32_t srcRank,
                    HcclComm comm, aclrtStream stream);

/* ---- MSPTI activity API ---- */
typedef int msptiResult;
enum { MSPTI_SUCCESS = 0, MSPTI_ERROR_INVALID_PARAMETER = 1, MSPTI_ERROR_MAX_LIMIT_REACHED = 3 };
typedef enum {
    MSPTI_ACTIVITY_KIND_MARKER = 1,
    MSPTI_ACTIVITY_KIND_KERNEL = 2,
    MSPTI_ACTIVITY_KIND_API = 3,
    MSPTI_ACTIVITY_KIND_HCCL = 4,
    MSPTI_ACTIVITY_KIND_MEMORY = 5,
    MSPTI_ACTIVITY_KIND_COMMUNICATION = 9,
} msptiActivityKind;
typedef struct {
    msptiActivityKind kind;
} msptiActivity;
typedef void (*msptiBuffersCallbackRequestFunc)(uint8_t **buffer, size_t *size,
                                                size_t *maxNumRecords);
typedef void (*msptiBuffersCallbackCompleteFunc)(uint8_t *buffer, size_t size, size_t validSize);

msptiResult msptiActivityRegisterCallbacks(msptiBuffersCallbackRequestFunc funcBufferRequested,
                                           msptiBuffersCallbackCompleteFunc funcBufferCompleted);
msptiResult msptiActivityEnable(msptiActivityKind kind);
msptiResult msptiActivityGetNextRecord(uint8_t *buffer, size_t validBufferSize,
                                       msptiActivity **record);
msptiResult msptiActivityFlushAll(uint32_t flag);

#endif
