/*
 * hccl.c: the stand-in libhccl.so (see include/standin_hccl.h).
 *
 * Operations run on the stand-in libascendcl's streams through
 * __standin_acl_stream_enqueue, over the rendezvous/collective engine
 * shared with libnccl; each completed operation is reported to libmspti as
 * one HCCL and one COMMUNICATION record.
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
#include "standin_hccl.h"

#define API SD_EXPORT
#define ROOT_MAGIC 0x4c434853u /* "SHCL" */

struct hccl_comm {
    uint32_t magic;
    struct sd_comm c;
    const char *name; /* interned: the same on every rank */
};

struct root_layout {
    uint32_t magic;
    uint32_t reserved;
    char name[SD_RDV_NAME_MAX];
};
_Static_assert(sizeof(struct root_layout) <= HCCL_ROOT_INFO_BYTES, "root info fits");
_Static_assert(sizeof(HcclRootInfo) == 4108, "HcclRootInfo is 4108 bytes");

static struct sd_hook mspti_hook = {STANDIN_MSPTI_RECORD, "libmspti.so", NULL, 0};

static standin_acl_stream_enqueue_fn acl_enqueue(void)
{
    static standin_acl_stream_enqueue_fn fn;
    standin_acl_stream_enqueue_fn f = __atomic_load_n(&fn, __ATOMIC_ACQUIRE);
    if (f == NULL) {
        f = (standin_acl_stream_enqueue_fn)sd_lookup(STANDIN_ACL_STREAM_ENQUEUE,
                                                     "libascendcl.so", 1);
        __atomic_store_n(&fn, f, __ATOMIC_RELEASE);
    }
    return f;
}

static int valid_comm(const struct hccl_comm *comm)
{
    return comm != NULL && comm->magic == ROOT_MAGIC;
}

static struct hccl_comm *comm_of(struct sd_comm *c)
{
    return (struct hccl_comm *)(void *)((char *)c - offsetof(struct hccl_comm, c));
}

static size_t dtype_size(HcclDataType t)
{
    switch (t) {
    case HCCL_DATA_TYPE_INT8:
    case HCCL_DATA_TYPE_UINT8:
        return 1;
    case HCCL_DATA_TYPE_INT16:
    case HCCL_DATA_TYPE_UINT16:
    case HCCL_DATA_TYPE_FP16:
    case HCCL_DATA_TYPE_BFP16:
        return 2;
    case HCCL_DATA_TYPE_INT32:
    case HCCL_DATA_TYPE_UINT32:
    case HCCL_DATA_TYPE_FP32:
        return 4;
    case HCCL_DATA_TYPE_INT64:
    case HCCL_DATA_TYPE_UINT64:
    case HCCL_DATA_TYPE_FP64:
        return 8;
    default:
        return 0;
    }
}

static const char *op_name(enum sd_coll_kind k)
{
    switch (k) {
    case SD_ALLREDUCE:
        return "HcclAllReduce";
    case SD_ALLGATHER:
        return "HcclAllGather";
    case SD_REDUCESCATTER:
        return "HcclReduceScatter";
    case SD_BROADCAST:
        return "HcclBroadcast";
    case SD_REDUCE:
        return "HcclReduce";
    case SD_SEND:
        return "HcclSend";
    case SD_RECV:
        return "HcclRecv";
    case SD_BARRIER:
        return "HcclBarrier";
    }
    return "Hccl";
}

/* The enqueue info lives in the batch (written before the op can run). */
static struct standin_enqueue_info *batch_info(struct sd_coll_batch *b)
{
    _Static_assert(sizeof(struct standin_enqueue_info) <= sizeof(b->user), "info fits");
    return (struct standin_enqueue_info *)(void *)b->user;
}

static int enqueue_batch(struct sd_coll_batch *b)
{
    standin_acl_stream_enqueue_fn enq = acl_enqueue();
    if (enq == NULL) {
        return HCCL_E_RUNTIME;
    }
    int rc = enq(b->stream, NULL, sd_coll_run, b, batch_info(b));
    return rc == 0 ? HCCL_SUCCESS : HCCL_E_RUNTIME;
}

static void on_op_done(struct sd_coll_batch *b, struct sd_coll_op *op)
{
    standin_mspti_record_fn record = (standin_mspti_record_fn)sd_hook_get(&mspti_hook);
    if (record == NULL) {
        return;
    }
    struct hccl_comm *comm = comm_of(b->comm);
    const struct standin_enqueue_info *info = batch_info(b);
    struct standin_npu_activity a;
    memset(&a, 0, sizeof(a));
    a.size = sizeof(a);
    a.type = STANDIN_NPU_ACT_HCCL;
    a.start_ns = op->start_ns;
    a.end_ns = op->end_ns;
    a.device_id = info->device_id;
    a.stream_id = info->stream_id;
    a.correlation_id = info->correlation_id;
    a.name = op_name(op->kind);
    a.comm_name = comm->name;
    a.alg_type = op->kind == SD_SEND || op->kind == SD_RECV ? "P2P" : "RING";
    uint64_t dur = op->end_ns > op->start_ns ? op->end_ns - op->start_ns : 0;
    a.bandwidth_gbps = dur > 0 ? (double)op->bytes / (double)dur : 0.0;
    a.data_type = (uint32_t)op->dtype;
    a.count = op->count;
    record(&a);
    a.type = STANDIN_NPU_ACT_COMMUNICATION;
    record(&a);
}

static HcclResult submit(struct hccl_comm *comm, enum sd_coll_kind kind, uint64_t count,
                         HcclDataType dtype, int redop, int peer, aclrtStream stream)
{
    if (!valid_comm(comm)) {
        return HCCL_E_PTR;
    }
    size_t esize = dtype_size(dtype);
    if ((esize == 0 && kind != SD_BARRIER) || (unsigned)redop >= HCCL_REDUCE_RESERVED) {
        return HCCL_E_PARA;
    }
    if ((kind == SD_SEND || kind == SD_RECV || kind == SD_BROADCAST || kind == SD_REDUCE) &&
        (peer < 0 || peer >= comm->c.nranks)) {
        return HCCL_E_PARA;
    }
    struct sd_coll_op op;
    memset(&op, 0, sizeof(op));
    op.kind = kind;
    op.count = count;
    op.dtype = dtype;
    op.redop = redop;
    op.peer = peer;
    op.bytes = count * esize;
    if (kind == SD_ALLGATHER || kind == SD_REDUCESCATTER) {
        op.bytes *= (uint64_t)comm->c.nranks;
    }
    int rc = sd_coll_submit(&comm->c, stream, &op, on_op_done, enqueue_batch);
    return rc == 0 ? HCCL_SUCCESS : rc > 0 ? (HcclResult)rc : HCCL_E_INTERNAL;
}

/* ---- public API ---- */

API HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo)
{
    if (rootInfo == NULL) {
        return HCCL_E_PTR;
    }
    struct root_layout r;
    memset(&r, 0, sizeof(r));
    r.magic = ROOT_MAGIC;
    sd_rdv_make_name("hccl", r.name, sizeof(r.name));
    memset(rootInfo, 0, sizeof(*rootInfo));
    memcpy(rootInfo->internal, &r, sizeof(r));
    return HCCL_SUCCESS;
}

API HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                                    HcclComm *comm)
{
    if (rootInfo == NULL || comm == NULL) {
        return HCCL_E_PTR;
    }
    struct root_layout r;
    memcpy(&r, rootInfo->internal, sizeof(r));
    r.name[sizeof(r.name) - 1] = '\0';
    if (r.magic != ROOT_MAGIC || nRanks < 1 || nRanks > SD_RDV_MAX_RANKS || rank >= nRanks) {
        return HCCL_E_PARA;
    }
    struct hccl_comm *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return HCCL_E_MEMORY;
    }
    int err = 0;
    struct sd_rdv *rdv = sd_rdv_join(r.name, (int)nRanks, (int)rank,
                                     sd_env_double("STANDIN_LINK_SLOWDOWN", 1.0), &err);
    if (rdv == NULL) {
        free(c);
        return err == 1 ? HCCL_E_PARA : HCCL_E_SYSCALL;
    }
    c->magic = ROOT_MAGIC;
    c->name = sd_intern(r.name + 1); /* without the leading '/' */
    sd_comm_init(&c->c, rdv, (int)rank, (int)nRanks, "HCCL");
    if (sd_rdv_wait_joined(rdv) != 0) {
        return HCCL_E_REMOTE;
    }
    *comm = c;
    return HCCL_SUCCESS;
}

API HcclResult HcclCommDestroy(HcclComm comm)
{
    struct hccl_comm *c = comm;
    if (!valid_comm(c)) {
        return HCCL_E_PTR;
    }
    sd_comm_wait_idle(&c->c);
    c->magic = 0;
    sd_rdv_leave(c->c.rdv);
    free(c);
    return HCCL_SUCCESS;
}

API HcclResult HcclGetRankSize(HcclComm comm, uint32_t *rankSize)
{
    struct hccl_comm *c = comm;
    if (!valid_comm(c) || rankSize == NULL) {
        return HCCL_E_PTR;
    }
    *rankSize = (uint32_t)c->c.nranks;
    return HCCL_SUCCESS;
}

API HcclResult HcclGetRankId(HcclComm comm, uint32_t *rank)
{
    struct hccl_comm *c = comm;
    if (!valid_comm(c) || rank == NULL) {
        return HCCL_E_PTR;
    }
    *rank = (uint32_t)c->c.rank;
    return HCCL_SUCCESS;
}

API HcclResult HcclGetCommName(HcclComm comm, char *commName)
{
    struct hccl_comm *c = comm;
    if (!valid_comm(c) || commName == NULL) {
        return HCCL_E_PTR;
    }
    snprintf(commName, HCCL_COMM_NAME_MAX_LENGTH, "%s", c->name);
    return HCCL_SUCCESS;
}

API const char *HcclGetErrorString(HcclResult code)
{
    static const char *const texts[] = {
        "success",           "parameter error",      "empty pointer",
        "memory error",      "internal error",       "not support feature",
        "not found specific resource", "resource unavailable", "call system interface error",
        "timeout",           "open file fail",       "tcp connect fail",
        "roce connect fail", "tcp transfer fail",    "roce transfer fail",
        "call runtime api fail", "call driver api fail", "call profiling api fail",
        "call cce api fail", "call network api fail", "try again",
        "error cqe",         "error communicator suspending",
    };
    if ((unsigned)code < sizeof(texts) / sizeof(texts[0])) {
        return texts[code];
    }
    return "unknown error";
}

API HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
                             HcclReduceOp op, HcclComm comm, aclrtStream stream)
{
    (void)sendBuf;
    (void)recvBuf;
    return submit(comm, SD_ALLREDUCE, count, dataType, op, 0, stream);
}

API HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount,
                             HcclDataType dataType, HcclComm comm, aclrtStream stream)
{
    (void)sendBuf;
    (void)recvBuf;
    return submit(comm, SD_ALLGATHER, sendCount, dataType, HCCL_REDUCE_SUM, 0, stream);
}

API HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType, uint32_t root,
                             HcclComm comm, aclrtStream stream)
{
    (void)buf;
    return submit(comm, SD_BROADCAST, count, dataType, HCCL_REDUCE_SUM, (int)root, stream);
}

API HcclResult HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount,
                                 HcclDataType dataType, HcclReduceOp op, HcclComm comm,
                                 aclrtStream stream)
{
    (void)sendBuf;
    (void)recvBuf;
    return submit(comm, SD_REDUCESCATTER, recvCount, dataType, op, 0, stream);
}

API HcclResult HcclReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
                          HcclReduceOp op, uint32_t root, HcclComm comm, aclrtStream stream)
{
    (void)sendBuf;
    (void)recvBuf;
    return submit(comm, SD_REDUCE, count, dataType, op, (int)root, stream);
}

API HcclResult HcclSend(void *sendBuf, uint64_t count, HcclDataType dataType, uint32_t destRank,
                        HcclComm comm, aclrtStream stream)
{
    (void)sendBuf;
    return submit(comm, SD_SEND, count, dataType, HCCL_REDUCE_SUM, (int)destRank, stream);
}

API HcclResult HcclRecv(void *recvBuf, uint64_t count, HcclDataType dataType, uint32_t srcRank,
                        HcclComm comm, aclrtStream stream)
{
    (void)recvBuf;
    return submit(comm, SD_RECV, count, dataType, HCCL_REDUCE_SUM, (int)srcRank, stream);
}

API HcclResult HcclBarrier(HcclComm comm, aclrtStream stream)
{
    return submit(comm, SD_BARRIER, 0, HCCL_DATA_TYPE_INT8, HCCL_REDUCE_SUM, 0, stream);
}

API HcclResult HcclGroupStart(void)
{
    sd_group_start();
    return HCCL_SUCCESS;
}

API HcclResult HcclGroupEnd(void)
{
    int rc = sd_group_end();
    if (rc == -2) {
        return HCCL_E_PARA;
    }
    return rc == 0 ? HCCL_SUCCESS : rc > 0 ? (HcclResult)rc : HCCL_E_INTERNAL;
}
