/*
 * standin_hccl.h: the subset of HCCL (hccl/hccl.h, hccl/hccl_types.h,
 * CANN 8) that the stand-in libhccl.so implements, with the real names,
 * types, enum values and prototypes.
 *
 * Semantics: exactly those of the stand-in libnccl (standin_nccl.h), with
 * the same rendezvous/barrier engine: HcclGetRootInfo makes a fresh root
 * info (naming /dev/shm/standin-hccl-*); HcclCommInitRootInfo blocks until
 * all nRanks ranks joined; every operation is enqueued on the given
 * aclrtStream of the stand-in libascendcl and completes only when every
 * rank has reached it. Environment: STANDIN_HCCL_BW_GBPS (default 100),
 * STANDIN_HCCL_LAT_US (default 5), STANDIN_LINK_SLOWDOWN (default 1.0),
 * STANDIN_HCCL_HANG_AT_SEQ=<n> (this rank's n-th collective, 0-based, hangs).
 * MSPTI records (standin_mspti.h): one HCCL and one COMMUNICATION record per
 * operation, with device start/end.
 */
#ifndef STANDIN_HCCL_H
#define STANDIN_HCCL_H

#include <stdint.h>

#include "standin_acl.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HCCL_ROOT_INFO_BYTES 4108
#define HCCL_COMM_NAME_MAX_LENGTH 128

typedef void *HcclComm;

typedef struct HcclRootInfoDef {
    char internal[HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;

typedef enum {
    HCCL_SUCCESS = 0,
    HCCL_E_PARA = 1,
    HCCL_E_PTR = 2,
    HCCL_E_MEMORY = 3,
    HCCL_E_INTERNAL = 4,
    HCCL_E_NOT_SUPPORT = 5,
    HCCL_E_NOT_FOUND = 6,
    HCCL_E_UNAVAIL = 7,
    HCCL_E_SYSCALL = 8,
    HCCL_E_TIMEOUT = 9,
    HCCL_E_OPEN_FILE_FAILURE = 10,
    HCCL_E_TCP_CONNECT = 11,
    HCCL_E_ROCE_CONNECT = 12,
    HCCL_E_TCP_TRANSFER = 13,
    HCCL_E_ROCE_TRANSFER = 14,
    HCCL_E_RUNTIME = 15,
    HCCL_E_DRV = 16,
    HCCL_E_PROFILING = 17,
    HCCL_E_CCE = 18,
    HCCL_E_NETWORK = 19,
    HCCL_E_AGAIN = 20,
    HCCL_E_REMOTE = 21,
    HCCL_E_SUSPENDING = 22,
    HCCL_E_RESERVED
} HcclResult;

typedef enum {
    HCCL_DATA_TYPE_INT8 = 0,
    HCCL_DATA_TYPE_INT16 = 1,
    HCCL_DATA_TYPE_INT32 = 2,
    HCCL_DATA_TYPE_FP16 = 3,
    HCCL_DATA_TYPE_FP32 = 4,
    HCCL_DATA_TYPE_INT64 = 5,
    HCCL_DATA_TYPE_UINT64 = 6,
    HCCL_DATA_TYPE_UINT8 = 7,
    HCCL_DATA_TYPE_UINT16 = 8,
    HCCL_DATA_TYPE_UINT32 = 9,
    HCCL_DATA_TYPE_FP64 = 10,
    HCCL_DATA_TYPE_BFP16 = 11,
    HCCL_DATA_TYPE_RESERVED
} HcclDataType;

typedef enum {
    HCCL_REDUCE_SUM = 0,
    HCCL_REDUCE_PROD = 1,
    HCCL_REDUCE_MAX = 2,
    HCCL_REDUCE_MIN = 3,
    HCCL_REDUCE_RESERVED
} HcclReduceOp;

HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo);
HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                                HcclComm *comm);
HcclResult HcclCommDestroy(HcclComm comm);
HcclResult HcclGetRankSize(HcclComm comm, uint32_t *rankSize);
HcclResult HcclGetRankId(HcclComm comm, uint32_t *rank);
HcclResult HcclGetCommName(HcclComm comm, char *commName);
const char *HcclGetErrorString(HcclResult code);

/* x86-64: the 7th argument (stream) of HcclAllReduce / HcclReduceScatter
 * and the 8th of HcclReduce are on the stack. */
HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
                         HcclReduceOp op, HcclComm comm, aclrtStream stream);
HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount,
                         HcclDataType dataType, HcclComm comm, aclrtStream stream);
HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType, uint32_t root,
                         HcclComm comm, aclrtStream stream);
HcclResult HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount,
                             HcclDataType dataType, HcclReduceOp op, HcclComm comm,
                             aclrtStream stream);
HcclResult HcclReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
                      HcclReduceOp op, uint32_t root, HcclComm comm, aclrtStream stream);
HcclResult HcclSend(void *sendBuf, uint64_t count, HcclDataType dataType, uint32_t destRank,
                    HcclComm comm, aclrtStream stream);
HcclResult HcclRecv(void *recvBuf, uint64_t count, HcclDataType dataType, uint32_t srcRank,
                    HcclComm comm, aclrtStream stream);
HcclResult HcclBarrier(HcclComm comm, aclrtStream stream);
HcclResult HcclGroupStart(void);
HcclResult HcclGroupEnd(void);

#ifdef __cplusplus
}
#endif

#endif /* STANDIN_HCCL_H */
