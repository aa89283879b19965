/*
 * standin_cupti.h: the subset of the CUPTI activity API (cupti_activity.h,
 * CUDA 12.9, CUPTI_API_VERSION 28) that the stand-in libcupti.so.12
 * implements, with the real names, enum values, prototypes and record
 * layouts.
 *
 * Records produced (8-byte aligned, packed as CUPTI's PACKED_ALIGNMENT):
 * - CUPTI_ACTIVITY_KIND_KERNEL (3) / CONCURRENT_KERNEL (10):
 *   CUpti_ActivityKernel9, 208 bytes. A kernel of the stand-in libcudart, and
 *   every NCCL operation of the stand-in libnccl (named
 *   "ncclDevKernel_<Op>_<RedOp>_<type>_RING_LL", "ncclDevKernel_SendRecv").
 *   Records carry kind 10 when CONCURRENT_KERNEL is enabled, else kind 3.
 * - CUPTI_ACTIVITY_KIND_MEMCPY (1): CUpti_ActivityMemcpy6, 96 bytes.
 * - CUPTI_ACTIVITY_KIND_RUNTIME (5): CUpti_ActivityAPI, 40 bytes, one per
 *   stand-in libcudart API call, cbid from cupti_runtime_cbid.h
 *   (e.g. cudaLaunchKernel_v7000 = 211).
 * start/end/queued/submitted and cuptiGetTimestamp are CLOCK_BOOTTIME ns
 * (real CUPTI uses its own GPU-synchronised clock; the stand-in uses the
 * agent's clock). correlationId is the one libcudart gave the API call that
 * enqueued the work (equal to the RUNTIME record's correlationId); streamId
 * equals cudaStreamGetId(); deviceId is the cudaSetDevice ordinal;
 * contextId = deviceId + 1. Names are stable for the life of the process.
 *
 * Delivery, as CUPTI does: when the first record arrives the library calls
 * bufferRequested for a buffer, fills it, and calls
 * bufferCompleted(NULL, 0, buffer, size, validSize) when it cannot take the
 * next record, on cuptiActivityFlushAll (from the calling thread), and every
 * cuptiActivityFlushPeriod ms if set (from a library thread). Iterate a
 * delivered buffer with cuptiActivityGetNextRecord starting from
 * *record = NULL; it returns CUPTI_ERROR_MAX_LIMIT_REACHED at the end.
 */
#ifndef STANDIN_CUPTI_H
#define STANDIN_CUPTI_H

#include <stddef.h>
#include <stdint.h>

#ifndef STANDIN_STATIC_ASSERT
#ifdef __cplusplus
#define STANDIN_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define STANDIN_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define CUPTI_API_VERSION 28
#define ACTIVITY_RECORD_ALIGNMENT 8
#define PACKED_ALIGNMENT __attribute__((__packed__)) __attribute__((aligned(ACTIVITY_RECORD_ALIGNMENT)))
#define CUPTIAPI

typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef uint32_t CUpti_CallbackId;

typedef enum {
    CUPTI_SUCCESS = 0,
    CUPTI_ERROR_INVALID_PARAMETER = 1,
    CUPTI_ERROR_INVALID_DEVICE = 2,
    CUPTI_ERROR_INVALID_CONTEXT = 3,
    CUPTI_ERROR_INVALID_OPERATION = 7,
    CUPTI_ERROR_OUT_OF_MEMORY = 8,
    CUPTI_ERROR_API_NOT_IMPLEMENTED = 11,
    CUPTI_ERROR_MAX_LIMIT_REACHED = 12,
    CUPTI_ERROR_NOT_READY = 13,
    CUPTI_ERROR_NOT_INITIALIZED = 15,
    CUPTI_ERROR_QUEUE_EMPTY = 18,
    CUPTI_ERROR_INVALID_STREAM = 20,
    CUPTI_ERROR_INVALID_KIND = 21,
    CUPTI_ERROR_NOT_SUPPORTED = 27,
    CUPTI_ERROR_UNKNOWN = 999,
    CUPTI_ERROR_FORCE_INT = 0x7fffffff
} CUptiResult;

typedef enum {
    CUPTI_ACTIVITY_KIND_INVALID = 0,
    CUPTI_ACTIVITY_KIND_MEMCPY = 1,
    CUPTI_ACTIVITY_KIND_MEMSET = 2,
    CUPTI_ACTIVITY_KIND_KERNEL = 3,
    CUPTI_ACTIVITY_KIND_DRIVER = 4,
    CUPTI_ACTIVITY_KIND_RUNTIME = 5,
    CUPTI_ACTIVITY_KIND_EVENT = 6,
    CUPTI_ACTIVITY_KIND_METRIC = 7,
    CUPTI_ACTIVITY_KIND_DEVICE = 8,
    CUPTI_ACTIVITY_KIND_CONTEXT = 9,
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL = 10,
    CUPTI_ACTIVITY_KIND_NAME = 11,
    CUPTI_ACTIVITY_KIND_FORCE_INT = 0x7fffffff
} CUpti_ActivityKind;

typedef enum {
    CUPTI_ACTIVITY_FLAG_NONE = 0,
    CUPTI_ACTIVITY_FLAG_FLUSH_FORCED = 1 << 0
} CUpti_ActivityFlag;

typedef enum {
    CUPTI_ACTIVITY_MEMCPY_KIND_UNKNOWN = 0,
    CUPTI_ACTIVITY_MEMCPY_KIND_HTOD = 1,
    CUPTI_ACTIVITY_MEMCPY_KIND_DTOH = 2,
    CUPTI_ACTIVITY_MEMCPY_KIND_HTOA = 3,
    CUPTI_ACTIVITY_MEMCPY_KIND_ATOH = 4,
    CUPTI_ACTIVITY_MEMCPY_KIND_ATOA = 5,
    CUPTI_ACTIVITY_MEMCPY_KIND_ATOD = 6,
    CUPTI_ACTIVITY_MEMCPY_KIND_DTOA = 7,
    CUPTI_ACTIVITY_MEMCPY_KIND_DTOD = 8,
    CUPTI_ACTIVITY_MEMCPY_KIND_HTOH = 9,
    CUPTI_ACTIVITY_MEMCPY_KIND_PTOP = 10
} CUpti_ActivityMemcpyKind;

typedef enum {
    CUPTI_ACTIVITY_MEMORY_KIND_UNKNOWN = 0,
    CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE = 1,
    CUPTI_ACTIVITY_MEMORY_KIND_PINNED = 2,
    CUPTI_ACTIVITY_MEMORY_KIND_DEVICE = 3
} CUpti_ActivityMemoryKind;

typedef enum {
    CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_UNKNOWN = 0,
    CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_NOT_SUPPORTED = 1,
    CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_OFF = 2,
    CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_ON = 3
} CUpti_ActivityPartitionedGlobalCacheConfig;

typedef enum {
    CUPTI_CHANNEL_TYPE_INVALID = 0,
    CUPTI_CHANNEL_TYPE_COMPUTE = 1,
    CUPTI_CHANNEL_TYPE_ASYNC_MEMCPY = 2
} CUpti_ChannelType;

typedef enum {
    CUPTI_FUNC_SHMEM_LIMIT_DEFAULT = 0x00,
    CUPTI_FUNC_SHMEM_LIMIT_OPTIN = 0x01
} CUpti_FuncShmemLimitConfig;

/* cupti_runtime_cbid.h values of the calls the stand-in implements. */
enum {
    CUPTI_RUNTIME_TRACE_CBID_INVALID = 0,
    CUPTI_RUNTIME_TRACE_CBID_cudaDriverGetVersion_v3020 = 1,
    CUPTI_RUNTIME_TRACE_CBID_cudaRuntimeGetVersion_v3020 = 2,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDeviceCount_v3020 = 3,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetLastError_v3020 = 10,
    CUPTI_RUNTIME_TRACE_CBID_cudaPeekAtLastError_v3020 = 11,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetErrorString_v3020 = 12,
    CUPTI_RUNTIME_TRACE_CBID_cudaSetDevice_v3020 = 16,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDevice_v3020 = 17,
    CUPTI_RUNTIME_TRACE_CBID_cudaMalloc_v3020 = 20,
    CUPTI_RUNTIME_TRACE_CBID_cudaFree_v3020 = 22,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemGetInfo_v3020 = 30,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020 = 31,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020 = 41,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamCreate_v3020 = 129,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamDestroy_v3020 = 130,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_v3020 = 131,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamQuery_v3020 = 132,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventCreate_v3020 = 133,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventCreateWithFlags_v3020 = 134,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_v3020 = 135,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventDestroy_v3020 = 136,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventSynchronize_v3020 = 137,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventQuery_v3020 = 138,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventElapsedTime_v3020 = 139,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamWaitEvent_v3020 = 147,
    CUPTI_RUNTIME_TRACE_CBID_cudaDeviceSynchronize_v3020 = 165,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamCreateWithFlags_v5000 = 198,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamDestroy_v5050 = 201,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetErrorName_v6050 = 209,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000 = 211,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000 = 214,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_ptds_v7000 = 215,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_ptsz_v7000 = 225,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_ptsz_v7000 = 239,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamQuery_ptsz_v7000 = 240,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_ptsz_v7000 = 242,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamWaitEvent_ptsz_v7000 = 247,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchHostFunc_v10000 = 284,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchHostFunc_ptsz_v10000 = 285,
    CUPTI_RUNTIME_TRACE_CBID_cudaMallocAsync_v11020 = 373,
    CUPTI_RUNTIME_TRACE_CBID_cudaMallocAsync_ptsz_v11020 = 374,
    CUPTI_RUNTIME_TRACE_CBID_cudaFreeAsync_v11020 = 375,
    CUPTI_RUNTIME_TRACE_CBID_cudaFreeAsync_ptsz_v11020 = 376,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamGetId_v12000 = 441,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamGetId_ptsz_v12000 = 442
};

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
} CUpti_Activity;

/* 208 bytes. */
typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind; /* 0 */
    union {
        uint8_t both;
        struct {
            uint8_t requested : 4;
            uint8_t executed : 4;
        } config;
    } cacheConfig;                                                         /* 4 */
    uint8_t sharedMemoryConfig;                                            /* 5 */
    uint16_t registersPerThread;                                           /* 6 */
    CUpti_ActivityPartitionedGlobalCacheConfig partitionedGlobalCacheRequested; /* 8 */
    CUpti_ActivityPartitionedGlobalCacheConfig partitionedGlobalCacheExecuted;  /* 12 */
    uint64_t start;                      /* 16 */
    uint64_t end;                        /* 24 */
    uint64_t completed;                  /* 32 */
    uint32_t deviceId;                   /* 40 */
    uint32_t contextId;                  /* 44 */
    uint32_t streamId;                   /* 48 */
    int32_t gridX;                       /* 52 */
    int32_t gridY;                       /* 56 */
    int32_t gridZ;                       /* 60 */
    int32_t blockX;                      /* 64 */
    int32_t blockY;                      /* 68 */
    int32_t blockZ;                      /* 72 */
    int32_t staticSharedMemory;          /* 76 */
    int32_t dynamicSharedMemory;         /* 80 */
    uint32_t localMemoryPerThread;       /* 84 */
    uint32_t localMemoryTotal;           /* 88 */
    uint32_t correlationId;              /* 92 */
    int64_t gridId;                      /* 96 */
    const char *name;                    /* 104 */
    void *reserved0;                     /* 112 */
    uint64_t queued;                     /* 120 */
    uint64_t submitted;                  /* 128 */
    uint8_t launchType;                  /* 136 */
    uint8_t isSharedMemoryCarveoutRequested; /* 137 */
    uint8_t sharedMemoryCarveoutRequested;   /* 138 */
    uint8_t padding;                     /* 139 */
    uint32_t sharedMemoryExecuted;       /* 140 */
    uint64_t graphNodeId;                /* 144 */
    CUpti_FuncShmemLimitConfig shmemLimitConfig; /* 152 */
    uint32_t graphId;                    /* 156 */
    void *pAccessPolicyWindow;           /* 160 (CUaccessPolicyWindow *) */
    uint32_t channelID;                  /* 168 */
    CUpti_ChannelType channelType;       /* 172 */
    uint32_t clusterX;                   /* 176 */
    uint32_t clusterY;                   /* 180 */
    uint32_t clusterZ;                   /* 184 */
    uint32_t clusterSchedulingPolicy;    /* 188 */
    uint64_t localMemoryTotal_v2;        /* 192 */
    uint32_t maxPotentialClusterSize;    /* 200 */
    uint32_t maxActiveClusters;          /* 204 */
} CUpti_ActivityKernel9;

/* 96 bytes. */
typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;       /* 0 */
    uint8_t copyKind;              /* 4  CUpti_ActivityMemcpyKind */
    uint8_t srcKind;               /* 5  CUpti_ActivityMemoryKind */
    uint8_t dstKind;               /* 6  CUpti_ActivityMemoryKind */
    uint8_t flags;                 /* 7 */
    uint64_t bytes;                /* 8 */
    uint64_t start;                /* 16 */
    uint64_t end;                  /* 24 */
    uint32_t deviceId;             /* 32 */
    uint32_t contextId;            /* 36 */
    uint32_t streamId;             /* 40 */
    uint32_t correlationId;        /* 44 */
    uint32_t runtimeCorrelationId; /* 48 */
    uint32_t pad;                  /* 52 */
    void *reserved0;               /* 56 */
    uint64_t graphNodeId;          /* 64 */
    uint32_t graphId;              /* 72 */
    uint32_t channelID;            /* 76 */
    CUpti_ChannelType channelType; /* 80 */
    uint32_t pad2;                 /* 84 */
    uint64_t copyCount;            /* 88 */
} CUpti_ActivityMemcpy6;

/* 40 bytes: CUPTI_ACTIVITY_KIND_RUNTIME / DRIVER. */
typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;  /* 0 */
    CUpti_CallbackId cbid;    /* 4 */
    uint64_t start;           /* 8 */
    uint64_t end;             /* 16 */
    uint32_t processId;       /* 24 */
    uint32_t threadId;        /* 28 (the Linux tid) */
    uint32_t correlationId;   /* 32 */
    uint32_t returnValue;     /* 36 */
} CUpti_ActivityAPI;

STANDIN_STATIC_ASSERT(sizeof(CUpti_ActivityKernel9) == 208, "CUpti_ActivityKernel9 is 208 bytes");
STANDIN_STATIC_ASSERT(sizeof(CUpti_ActivityMemcpy6) == 96, "CUpti_ActivityMemcpy6 is 96 bytes");
STANDIN_STATIC_ASSERT(sizeof(CUpti_ActivityAPI) == 40, "CUpti_ActivityAPI is 40 bytes");

typedef void(CUPTIAPI *CUpti_BuffersCallbackRequestFunc)(uint8_t **buffer, size_t *size,
                                                         size_t *maxNumRecords);
typedef void(CUPTIAPI *CUpti_BuffersCallbackCompleteFunc)(CUcontext context, uint32_t streamId,
                                                          uint8_t *buffer, size_t size,
                                                          size_t validSize);

CUptiResult cuptiActivityEnable(CUpti_ActivityKind kind);
CUptiResult cuptiActivityDisable(CUpti_ActivityKind kind);
CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc funcBufferRequested,
                                           CUpti_BuffersCallbackCompleteFunc funcBufferCompleted);
CUptiResult cuptiActivityGetNextRecord(uint8_t *buffer, size_t validBufferSizeBytes,
                                       CUpti_Activity **record);
CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext context, uint32_t streamId,
                                              size_t *dropped);
CUptiResult cuptiActivityFlushAll(uint32_t flag);
CUptiResult cuptiActivityFlushPeriod(uint32_t time);
CUptiResult cuptiGetTimestamp(uint64_t *timestamp);
CUptiResult cuptiGetStreamId(CUcontext context, CUstream stream, uint32_t *streamId);
CUptiResult cuptiGetResultString(CUptiResult result, const char **str);

#ifdef __cplusplus
}
#endif

#endif /* STANDIN_CUPTI_H */
