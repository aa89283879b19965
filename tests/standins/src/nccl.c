/*
 * nccl.c: the stand-in libnccl.so.2 (see include/standin_nccl.h).
 *
 * Each public function is defined once as a strong pnccl* symbol with a
 * weak nccl* alias at the same address. Operations run on the stand-in
 * libcudart's streams through __standin_cuda_stream_enqueue, over the
 * shared rendezvous/collective engine.
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/coll.h"
#include "common/hooks.h"
#include "common/rendezvous.h"
#include "common/util.h"
#include "standin_nccl.h"

#define API SD_EXPORT
/* A weak nccl* alias of the strong pnccl* definition, as NCCL does. */
#define NCCL_ALIAS(name)                                                                  \
    extern __typeof(p##name) name                                                         \
        __attribute__((weak, alias("p" #name), visibility("default")))

#define ID_MAGIC 0x4c434e53u /* "SNCL" */

struct ncclComm {
    uint32_t magic;
    int device;
    struct sd_comm c;
    ncclResult_t async_error;
};

/* Layout of the 128 opaque bytes of an ncclUniqueId made here. */
struct id_layout {
    uint32_t magic;
    uint32_t reserved;
    char name[SD_RDV_NAME_MAX];
};
_Static_assert(sizeof(struct id_layout) <= NCCL_UNIQUE_ID_BYTES, "id fits");

static standin_cuda_stream_enqueue_fn cuda_enqueue(void)
{
    static standin_cuda_stream_enqueue_fn fn;
    standin_cuda_stream_enqueue_fn f = __atomic_load_n(&fn, __ATOMIC_ACQUIRE);
    if (f == NULL) {
        f = (standin_cuda_stream_enqueue_fn)sd_lookup(STANDIN_CUDA_STREAM_ENQUEUE,
                                                      "libcudart.so.12", 1);
        __atomic_store_n(&fn, f, __ATOMIC_RELEASE);
    }
    return f;
}

static int valid_comm(const struct ncclComm *comm)
{
    return comm != NULL && comm->magic == ID_MAGIC;
}

static size_t dtype_size(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8:
    case ncclUint8:
        return 1;
    case ncclFloat16:
    case ncclBfloat16:
        return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
        return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
        return 8;
    default:
        return 0;
    }
}

static const char *dtype_name(ncclDataType_t t)
{
    static const char *const names[] = {"i8", "u8", "i32", "u32", "i64",
                                        "u64", "f16", "f32", "f64", "bf16"};
    return (unsigned)t < ncclNumTypes ? names[t] : "unknown";
}

static const char *redop_name(ncclRedOp_t op)
{
    static const char *const names[] = {"Sum", "Prod", "MinMax", "MinMax", "PreMulSum"};
    return (unsigned)op < ncclNumOps ? names[op] : "Sum";
}

static const char *kind_name(enum sd_coll_kind k)
{
    switch (k) {
    case SD_ALLREDUCE:
        return "AllReduce";
    case SD_ALLGATHER:
        return "AllGather";
    case SD_REDUCESCATTER:
        return "ReduceScatter";
    case SD_BROADCAST:
        return "Broadcast";
    case SD_REDUCE:
        return "Reduce";
    default:
        return "SendRecv";
    }
}

/* The CUPTI kernel name of a batch, as NCCL names its device kernels. */
static const char *batch_kernel_name(const struct sd_coll_batch *b)
{
    char buf[96];
    const struct sd_coll_op *op = &b->ops[0];
    int all_p2p = 1;
    for (int i = 0; i < b->n; i++) {
        if (b->ops[i].kind != SD_SEND && b->ops[i].kind != SD_RECV) {
            all_p2p = 0;
        }
    }
    if (all_p2p) {
        return "ncclDevKernel_SendRecv";
    }
    if (op->kind == SD_ALLGATHER || op->kind == SD_BROADCAST) {
        snprintf(buf, sizeof(buf), "ncclDevKernel_%s_RING_LL", kind_name(op->kind));
    } else {
        snprintf(buf, sizeof(buf), "ncclDevKernel_%s_%s_%s_RING_LL", kind_name(op->kind),
                 redop_name((ncclRedOp_t)op->redop), dtype_name((ncclDataType_t)op->dtype));
    }
    return sd_intern(buf);
}

static int enqueue_batch(struct sd_coll_batch *b)
{
    standin_cuda_stream_enqueue_fn enq = cuda_enqueue();
    if (enq == NULL) {
        return ncclUnhandledCudaError;
    }
    struct standin_enqueue_info info;
    int rc = enq(b->stream, 0, batch_kernel_name(b), sd_coll_run, b, &info);
    return rc == 0 ? ncclSuccess : ncclUnhandledCudaError;
}

static struct ncclComm *comm_of(struct sd_comm *c)
{
    return (struct ncclComm *)(void *)((char *)c - offsetof(struct ncclComm, c));
}

static void on_op_done(struct sd_coll_batch *b, struct sd_coll_op *op)
{
    if (op->failed) {
        comm_of(b->comm)->async_error = ncclRemoteError;
    }
}

static ncclResult_t submit(struct ncclComm *comm, enum sd_coll_kind kind, size_t count,
                           ncclDataType_t dtype, int redop, int peer, cudaStream_t stream)
{
    if (!valid_comm(comm)) {
        return ncclInvalidArgument;
    }
    size_t esize = dtype_size(dtype);
    if (esize == 0 || (unsigned)redop >= ncclNumOps) {
        return ncclInvalidArgument;
    }
    if ((kind == SD_SEND || kind == SD_RECV || kind == SD_BROADCAST || kind == SD_REDUCE) &&
        (peer < 0 || peer >= comm->c.nranks)) {
        return ncclInvalidArgument;
    }
    struct sd_coll_op op;
    memset(&op, 0, sizeof(op));
    op.kind = kind;
    op.count = count;
    op.dtype = dtype;
    op.redop = redop;
    op.peer = peer;
    op.bytes = (uint64_t)count * esize;
    if (kind == SD_ALLGATHER || kind == SD_REDUCESCATTER) {
        op.bytes *= (uint64_t)comm->c.nranks;
    }
    int rc = sd_coll_submit(&comm->c, stream, &op, on_op_done, enqueue_batch);
    return rc == 0 ? ncclSuccess : rc > 0 ? (ncclResult_t)rc : ncclSystemError;
}

/* ---- public API ---- */

API ncclResult_t pncclGetVersion(int *version)
{
    if (version == NULL) {
        return ncclInvalidArgument;
    }
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}
NCCL_ALIAS(ncclGetVersion);

API ncclResult_t pncclGetUniqueId(ncclUniqueId *uniqueId)
{
    if (uniqueId == NULL) {
        return ncclInvalidArgument;
    }
    struct id_layout id;
    memset(&id, 0, sizeof(id));
    id.magic = ID_MAGIC;
    sd_rdv_make_name("nccl", id.name, sizeof(id.name));
    memset(uniqueId, 0, sizeof(*uniqueId));
    memcpy(uniqueId->internal, &id, sizeof(id));
    return ncclSuccess;
}
NCCL_ALIAS(ncclGetUniqueId);

/* Joins without waiting for the other ranks. */
static ncclResult_t join(struct ncclComm **out, int nranks, const ncclUniqueId *uid, int rank,
                         int device)
{
    struct id_layout id;
    memcpy(&id, uid->internal, sizeof(id));
    id.name[sizeof(id.name) - 1] = '\0';
    if (id.magic != ID_MAGIC || nranks < 1 || rank < 0 || rank >= nranks) {
        return ncclInvalidArgument;
    }
    struct ncclComm *comm = calloc(1, sizeof(*comm));
    if (comm == NULL) {
        return ncclSystemError;
    }
    int err = 0;
    struct sd_rdv *rdv =
        sd_rdv_join(id.name, nranks, rank, sd_env_double("STANDIN_LINK_SLOWDOWN", 1.0), &err);
    if (rdv == NULL) {
        free(comm);
        return err == 1 ? ncclInvalidArgument : ncclSystemError;
    }
    comm->magic = ID_MAGIC;
    comm->device = device;
    sd_comm_init(&comm->c, rdv, rank, nranks, "NCCL");
    *out = comm;
    return ncclSuccess;
}

static int current_device(void)
{
    typedef int (*get_device_fn)(int *);
    get_device_fn get = (get_device_fn)sd_lookup("cudaGetDevice", "libcudart.so.12", 0);
    int dev = 0;
    if (get != NULL && get(&dev) != 0) {
        dev = 0;
    }
    return dev;
}

API ncclResult_t pncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank)
{
    if (comm == NULL) {
        return ncclInvalidArgument;
    }
    struct ncclComm *c = NULL;
    ncclResult_t rc = join(&c, nranks, &commId, rank, current_device());
    if (rc != ncclSuccess) {
        return rc;
    }
    if (sd_rdv_wait_joined(c->c.rdv) != 0) {
        return ncclRemoteError;
    }
    *comm = c;
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommInitRank);

API ncclResult_t pncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist)
{
    if (comms == NULL || ndev < 1) {
        return ncclInvalidArgument;
    }
    ncclUniqueId id;
    pncclGetUniqueId(&id);
    for (int i = 0; i < ndev; i++) {
        ncclResult_t rc = join(&comms[i], ndev, &id, i, devlist != NULL ? devlist[i] : i);
        if (rc != ncclSuccess) {
            return rc;
        }
    }
    for (int i = 0; i < ndev; i++) {
        if (sd_rdv_wait_joined(comms[i]->c.rdv) != 0) {
            return ncclRemoteError;
        }
    }
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommInitAll);

API ncclResult_t pncclCommDestroy(ncclComm_t comm)
{
    if (comm == NULL) {
        return ncclSuccess;
    }
    if (!valid_comm(comm)) {
        return ncclInvalidArgument;
    }
    sd_comm_wait_idle(&comm->c);
    comm->magic = 0;
    sd_rdv_leave(comm->c.rdv);
    free(comm);
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommDestroy);

API ncclResult_t pncclCommAbort(ncclComm_t comm)
{
    if (comm == NULL) {
        return ncclSuccess;
    }
    if (!valid_comm(comm)) {
        return ncclInvalidArgument;
    }
    sd_rdv_abort(comm->c.rdv);
    sd_comm_wait_idle(&comm->c);
    comm->magic = 0;
    sd_rdv_leave(comm->c.rdv);
    free(comm);
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommAbort);

API ncclResult_t pncclCommCount(const ncclComm_t comm, int *count)
{
    if (!valid_comm(comm) || count == NULL) {
        return ncclInvalidArgument;
    }
    *count = comm->c.nranks;
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommCount);

API ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int *device)
{
    if (!valid_comm(comm) || device == NULL) {
        return ncclInvalidArgument;
    }
    *device = comm->device;
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommCuDevice);

API ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank)
{
    if (!valid_comm(comm) || rank == NULL) {
        return ncclInvalidArgument;
    }
    *rank = comm->c.rank;
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommUserRank);

API ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError)
{
    if (!valid_comm(comm) || asyncError == NULL) {
        return ncclInvalidArgument;
    }
    *asyncError = sd_rdv_aborted(comm->c.rdv) ? ncclRemoteError : comm->async_error;
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommGetAsyncError);

API const char *pncclGetErrorString(ncclResult_t result)
{
    switch (result) {
    case ncclSuccess:
        return "no error";
    case ncclUnhandledCudaError:
        return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:
        return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
        return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:
        return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:
        return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:
        return "remote process exited or there was a network error";
    case ncclInProgress:
        return "NCCL operation in progress";
    default:
        return "unknown result code";
    }
}
NCCL_ALIAS(ncclGetErrorString);

API const char *pncclGetLastError(ncclComm_t comm)
{
    (void)comm;
    return "";
}
NCCL_ALIAS(ncclGetLastError);

API ncclResult_t pncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                cudaStream_t stream)
{
    (void)sendbuff;
    (void)recvbuff;
    return submit(comm, SD_ALLREDUCE, count, datatype, op, 0, stream);
}
NCCL_ALIAS(ncclAllReduce);

API ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff;
    (void)recvbuff;
    return submit(comm, SD_ALLGATHER, sendcount, datatype, ncclSum, 0, stream);
}
NCCL_ALIAS(ncclAllGather);

API ncclResult_t pncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                    cudaStream_t stream)
{
    (void)sendbuff;
    (void)recvbuff;
    return submit(comm, SD_REDUCESCATTER, recvcount, datatype, op, 0, stream);
}
NCCL_ALIAS(ncclReduceScatter);

API ncclResult_t pncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                ncclDataType_t datatype, int root, ncclComm_t comm,
                                cudaStream_t stream)
{
    (void)sendbuff;
    (void)recvbuff;
    return submit(comm, SD_BROADCAST, count, datatype, ncclSum, root, stream);
}
NCCL_ALIAS(ncclBroadcast);

API ncclResult_t pncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                             ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                             cudaStream_t stream)
{
    (void)sendbuff;
    (void)recvbuff;
    return submit(comm, SD_REDUCE, count, datatype, op, root, stream);
}
NCCL_ALIAS(ncclReduce);

API ncclResult_t pncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                           ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff;
    return submit(comm, SD_SEND, count, datatype, ncclSum, peer, stream);
}
NCCL_ALIAS(ncclSend);

API ncclResult_t pncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                           ncclComm_t comm, cudaStream_t stream)
{
    (void)recvbuff;
    return submit(comm, SD_RECV, count, datatype, ncclSum, peer, stream);
}
NCCL_ALIAS(ncclRecv);

API ncclResult_t pncclGroupStart(void)
{
    sd_group_start();
    return ncclSuccess;
}
NCCL_ALIAS(ncclGroupStart);

API ncclResult_t pncclGroupEnd(void)
{
    int rc = sd_group_end();
    if (rc == -2) {
        return ncclInvalidUsage;
    }
    return rc == 0 ? ncclSuccess : rc > 0 ? (ncclResult_t)rc : ncclSystemError;
}
NCCL_ALIAS(ncclGroupEnd);
