/*
 * standin_nccl.h: the subset of nccl.h (NCCL 2.21) that the stand-in
 * libnccl.so.2 implements, with the real names, types, enum values and
 * prototypes. Every function is exported twice at one address: a strong
 * pnccl* and a weak nccl* symbol, as in the real library.
 *
 * Semantics of the stand-in (see tests/standins/README.md):
 * - ncclGetUniqueId makes a fresh id; ncclCommInitRank blocks until all
 *   nranks ranks (processes on this machine, or ranks of ncclCommInitAll)
 *   have joined with the same id. The id names a POSIX shared-memory
 *   rendezvous segment (/dev/shm/standin-nccl-*), unlinked once all joined.
 * - Every collective and send/recv is enqueued on the given cudaStream_t of
 *   the stand-in libcudart and completes on that stream only when every rank
 *   of the communicator has reached it (collectives are matched by their
 *   per-communicator sequence number, send/recv by (peer, count)). A rank
 *   that never arrives hangs the others' streams, for real; a late rank
 *   delays the others by its lateness.
 * - After all ranks have arrived the operation "transfers" for
 *   latency + bytes * algo_factor / bandwidth * slowdown, where
 *   bandwidth = STANDIN_NCCL_BW_GBPS (GB/s, default 100), latency =
 *   STANDIN_NCCL_LAT_US (default 5), slowdown = the largest
 *   STANDIN_LINK_SLOWDOWN (default 1.0) among the ranks taking part, and
 *   algo_factor is NCCL's bus-bandwidth factor: AllReduce 2(n-1)/n on
 *   count*size, AllGather (n-1)/n on sendcount*size*n, ReduceScatter (n-1)/n
 *   on recvcount*size*n, Broadcast/Reduce/Send/Recv 1 on count*size.
 * - STANDIN_NCCL_HANG_AT_SEQ=<n>: this rank's n-th collective (0-based, per
 *   communicator) blocks forever on its stream without arriving, so every
 *   rank hangs in that collective (ncclCommAbort releases it).
 * - No data moves; buffers are opaque.
 */
#ifndef STANDIN_NCCL_H
#define STANDIN_NCCL_H

#include <stddef.h>

#include "standin_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NCCL_MAJOR 2
#define NCCL_MINOR 21
#define NCCL_PATCH 5
#define NCCL_VERSION_CODE 22105
#define NCCL_UNIQUE_ID_BYTES 128

typedef struct ncclComm *ncclComm_t;
#define NCCL_COMM_NULL NULL

typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
    ncclNumResults = 8
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclChar = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclInt = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclHalf = 6,
    ncclFloat32 = 7,
    ncclFloat = 7,
    ncclFloat64 = 8,
    ncclDouble = 8,
    ncclBfloat16 = 9,
    ncclNumTypes = 10
} ncclDataType_t;

typedef enum {
    ncclSum = 0,
    ncclProd = 1,
    ncclMax = 2,
    ncclMin = 3,
    ncclAvg = 4,
    ncclNumOps = 5
} ncclRedOp_t;

ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);

/* x86-64: the 7th argument (stream) of ncclAllReduce / ncclReduceScatter and
 * the 8th of ncclReduce are on the stack. */
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream);
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                        ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                        cudaStream_t stream);
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

/* The strong aliases (same addresses). */
ncclResult_t pncclGetVersion(int *version);
ncclResult_t pncclGetUniqueId(ncclUniqueId *uniqueId);
ncclResult_t pncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t pncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist);
ncclResult_t pncclCommDestroy(ncclComm_t comm);
ncclResult_t pncclCommAbort(ncclComm_t comm);
ncclResult_t pncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int *device);
ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank);
ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
const char *pncclGetErrorString(ncclResult_t result);
const char *pncclGetLastError(ncclComm_t comm);
ncclResult_t pncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                            ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                            cudaStream_t stream);
ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                            ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                cudaStream_t stream);
ncclResult_t pncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                            ncclDataType_t datatype, int root, ncclComm_t comm,
                            cudaStream_t stream);
ncclResult_t pncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                         ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                         cudaStream_t stream);
ncclResult_t pncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                       ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                       ncclComm_t comm, cudaStream_t stream);
ncclResult_t pncclGroupStart(void);
ncclResult_t pncclGroupEnd(void);

#ifdef __cplusplus
}
#endif

#endif /* STANDIN_NCCL_H */
