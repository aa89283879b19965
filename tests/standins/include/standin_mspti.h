/*
 * standin_mspti.h: the subset of MSPTI (mspti_activity.h, mspti_result.h,
 * CANN 8) that the stand-in libmspti.so implements, with the real names,
 * enum values, prototypes and packed record layouts, plus the mstx marker
 * calls (in CANN these live in libms_tools_ext.so and feed MSPTI; the
 * stand-in exports them from libmspti.so).
 *
 * Records are packed with 8-byte alignment (64-bit fields at unaligned
 * offsets):
 *   Kernel 56 B, Api 48 B, Hccl 56 B, Communication 72 B, Marker 56 B.
 * Producers: libascendcl (API records for its calls, KERNEL records for
 * launched kernels), libhccl (one HCCL and one COMMUNICATION record per
 * operation), mstx* calls (MARKER records, source HOST). Times are
 * CLOCK_BOOTTIME ns. A kernel's correlationId equals the correlationId of
 * the API record of its aclrtLaunchKernel call; ds.streamId equals
 * aclrtStreamGetId(); ds.deviceId is the aclrtSetDevice id. name, type,
 * commName, algType, domain strings stay valid for the life of the process.
 *
 * Delivery as MSPTI does: the library calls the request callback for a
 * buffer, fills it, and calls the complete callback (buffer, size,
 * validSize) when the buffer is full or on msptiActivityFlushAll (from the
 * calling thread) or every msptiActivityFlushPeriod ms if set. Iterate with
 * msptiActivityGetNextRecord from *record = NULL until it returns
 * MSPTI_ERROR_MAX_LIMIT_REACHED.
 */
#ifndef STANDIN_MSPTI_H
#define STANDIN_MSPTI_H

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

#define MSPTI_PACKED_ALIGNMENT __attribute__((__packed__)) __attribute__((aligned(8)))

typedef enum {
    MSPTI_SUCCESS = 0,
    MSPTI_ERROR_INVALID_PARAMETER = 1,
    MSPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 2,
    MSPTI_ERROR_MAX_LIMIT_REACHED = 3,
    MSPTI_ERROR_DEVICE_OFFLINE = 4,
    MSPTI_ERROR_INNER = 999,
    MSPTI_ERROR_FORCE_INT = 0x7fffffff
} msptiResult;

typedef enum {
    MSPTI_ACTIVITY_KIND_INVALID = 0,
    MSPTI_ACTIVITY_KIND_MARKER = 1,
    MSPTI_ACTIVITY_KIND_KERNEL = 2,
    MSPTI_ACTIVITY_KIND_API = 3,
    MSPTI_ACTIVITY_KIND_HCCL = 4,
    MSPTI_ACTIVITY_KIND_MEMORY = 5,
    MSPTI_ACTIVITY_KIND_MEMSET = 6,
    MSPTI_ACTIVITY_KIND_MEMCPY = 7,
    MSPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION = 8,
    MSPTI_ACTIVITY_KIND_COMMUNICATION = 9,
    MSPTI_ACTIVITY_KIND_COUNT,
    MSPTI_ACTIVITY_KIND_FORCE_INT = 0x7fffffff
} msptiActivityKind;

typedef enum {
    MSPTI_ACTIVITY_FLAG_NONE = 0,
    MSPTI_ACTIVITY_FLAG_MARKER_INSTANTANEOUS = 1 << 0,
    MSPTI_ACTIVITY_FLAG_MARKER_START = 1 << 1,
    MSPTI_ACTIVITY_FLAG_MARKER_END = 1 << 2,
    MSPTI_ACTIVITY_FLAG_MARKER_INSTANTANEOUS_WITH_DEVICE = 1 << 3,
    MSPTI_ACTIVITY_FLAG_MARKER_START_WITH_DEVICE = 1 << 4,
    MSPTI_ACTIVITY_FLAG_MARKER_END_WITH_DEVICE = 1 << 5
} msptiActivityFlag;

typedef enum {
    MSPTI_ACTIVITY_SOURCE_KIND_HOST = 0,
    MSPTI_ACTIVITY_SOURCE_KIND_DEVICE = 1
} msptiActivitySourceKind;

/* Same values as HcclDataType. */
typedef enum {
    MSPTI_ACTIVITY_COMMUNICATION_INT8 = 0,
    MSPTI_ACTIVITY_COMMUNICATION_INT16 = 1,
    MSPTI_ACTIVITY_COMMUNICATION_INT32 = 2,
    MSPTI_ACTIVITY_COMMUNICATION_FP16 = 3,
    MSPTI_ACTIVITY_COMMUNICATION_FP32 = 4,
    MSPTI_ACTIVITY_COMMUNICATION_INT64 = 5,
    MSPTI_ACTIVITY_COMMUNICATION_UINT64 = 6,
    MSPTI_ACTIVITY_COMMUNICATION_UINT8 = 7,
    MSPTI_ACTIVITY_COMMUNICATION_UINT16 = 8,
    MSPTI_ACTIVITY_COMMUNICATION_UINT32 = 9,
    MSPTI_ACTIVITY_COMMUNICATION_FP64 = 10,
    MSPTI_ACTIVITY_COMMUNICATION_BFP16 = 11,
    MSPTI_ACTIVITY_COMMUNICATION_INT128 = 12,
    MSPTI_ACTIVITY_COMMUNICATION_INVALID_TYPE = 0x0000FFFF
} msptiCommunicationDataType;

typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind;
} msptiActivity;

typedef union __attribute__((__packed__)) {
    struct {
        uint32_t processId;
        uint32_t threadId;
    } pt;
    struct {
        uint32_t deviceId;
        uint32_t streamId;
    } ds;
} msptiObjectId;

/* 48 bytes. */
typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind; /* 0 */
    uint64_t start;         /* 4 */
    uint64_t end;           /* 12 */
    struct {
        uint32_t processId; /* 20 */
        uint32_t threadId;  /* 24 (the Linux tid) */
    } pt;
    uint64_t correlationId; /* 28 */
    const char *name;       /* 36 */
} msptiActivityApi;

/* 56 bytes. */
typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind; /* 0 */
    uint64_t start;         /* 4 */
    uint64_t end;           /* 12 */
    struct {
        uint32_t deviceId;  /* 20 */
        uint32_t streamId;  /* 24 */
    } ds;
    uint64_t correlationId; /* 28 */
    const char *type;       /* 36 */
    const char *name;       /* 44 */
} msptiActivityKernel;

/* 56 bytes. */
typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind; /* 0 */
    uint64_t start;         /* 4 */
    uint64_t end;           /* 12 */
    struct {
        uint32_t deviceId;  /* 20 */
        uint32_t streamId;  /* 24 */
    } ds;
    double bandWidth;       /* 28, GB/s */
    const char *name;       /* 36 */
    const char *commName;   /* 44 */
} msptiActivityHccl;

/* 72 bytes. */
typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind;              /* 0 */
    msptiCommunicationDataType dataType; /* 4 */
    uint64_t count;                      /* 8 */
    struct {
        uint32_t deviceId;               /* 16 */
        uint32_t streamId;               /* 20 */
    } ds;
    uint64_t start;                      /* 24 */
    uint64_t end;                        /* 32 */
    const char *algType;                 /* 40 */
    const char *name;                    /* 48 */
    const char *commName;                /* 56 */
    uint64_t correlationId;              /* 64 */
} msptiActivityCommunication;

/* 56 bytes. */
typedef struct MSPTI_PACKED_ALIGNMENT {
    msptiActivityKind kind;             /* 0 */
    msptiActivityFlag flag;             /* 4 */
    msptiActivitySourceKind sourceKind; /* 8 */
    uint64_t timestamp;                 /* 12 */
    uint64_t id;                        /* 20 */
    msptiObjectId objectId;             /* 28 */
    const char *name;                   /* 36 */
    const char *domain;                 /* 44 */
} msptiActivityMarker;

STANDIN_STATIC_ASSERT(sizeof(msptiActivityApi) == 48, "msptiActivityApi is 48 bytes");
STANDIN_STATIC_ASSERT(sizeof(msptiActivityKernel) == 56, "msptiActivityKernel is 56 bytes");
STANDIN_STATIC_ASSERT(sizeof(msptiActivityHccl) == 56, "msptiActivityHccl is 56 bytes");
STANDIN_STATIC_ASSERT(sizeof(msptiActivityCommunication) == 72, "msptiActivityCommunication is 72 bytes");
STANDIN_STATIC_ASSERT(sizeof(msptiActivityMarker) == 56, "msptiActivityMarker is 56 bytes");

typedef void (*msptiBuffersCallbackRequestFunc)(uint8_t **buffer, size_t *size,
                                                size_t *maxNumRecords);
typedef void (*msptiBuffersCallbackCompleteFunc)(uint8_t *buffer, size_t size, size_t validSize);

msptiResult msptiActivityRegisterCallbacks(msptiBuffersCallbackRequestFunc funcBufferRequested,
                                           msptiBuffersCallbackCompleteFunc funcBufferCompleted);
msptiResult msptiActivityEnable(msptiActivityKind kind);
msptiResult msptiActivityDisable(msptiActivityKind kind);
msptiResult msptiActivityGetNextRecord(uint8_t *buffer, size_t validBufferSizeBytes,
                                       msptiActivity **record);
msptiResult msptiActivityFlushAll(uint32_t flag);
msptiResult msptiActivityFlushPeriod(uint32_t time);

/* mstx markers (ms_tools_ext.h). stream NULL: a host marker. */
typedef uint64_t mstxRangeId;
void mstxMarkA(const char *message, void *stream);
mstxRangeId mstxRangeStartA(const char *message, void *stream);
void mstxRangeEnd(mstxRangeId id);

#ifdef __cplusplus
}
#endif

#endif /* STANDIN_MSPTI_H */
