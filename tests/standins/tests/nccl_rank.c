/*
 * nccl_rank: one rank of a multi-process job on the stand-in libnccl.so.2.
 *
 *   nccl_rank NRANKS RANK ID_FILE [OP [DELAY_MS]]
 *
 * Rank 0 writes the ncclUniqueId to ID_FILE, the others read it. Every rank
 * prints "ready" once the communicator formed, then runs OP (allreduce,
 * sendrecv, pingpong, all, or skip: never call anything and sleep) after
 * sleeping DELAY_MS, prints "enqueued" when the call returned, and prints
 * "done {json}" once cudaStreamSynchronize returned. Times: CLOCK_BOOTTIME.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "standin_nccl.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int write_id(const char *path, const ncclUniqueId *id)
{
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (f == NULL || fwrite(id, sizeof(*id), 1, f) != 1 || fclose(f) != 0) {
        return -1;
    }
    return rename(tmp, path);
}

static int read_id(const char *path, ncclUniqueId *id)
{
    for (int i = 0; i < 2000; i++) {
        FILE *f = fopen(path, "rb");
        if (f != NULL) {
            size_t n = fread(id, sizeof(*id), 1, f);
            fclose(f);
            if (n == 1) {
                return 0;
            }
        }
        usleep(5000);
    }
    return -1;
}

#define CHECK(call)                                                                    \
    do {                                                                               \
        ncclResult_t rc_ = (call);                                                     \
        if (rc_ != ncclSuccess) {                                                      \
            fprintf(stderr, "%s failed: %d %s\n", #call, rc_, ncclGetErrorString(rc_)); \
            return 1;                                                                  \
        }                                                                              \
    } while (0)

static int ring_exchange(ncclComm_t comm, int nranks, int rank, size_t count, cudaStream_t s)
{
    CHECK(ncclGroupStart());
    CHECK(ncclSend(NULL, count, ncclFloat32, (rank + 1) % nranks, comm, s));
    CHECK(ncclRecv(NULL, count, ncclFloat32, (rank + nranks - 1) % nranks, comm, s));
    CHECK(ncclGroupEnd());
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: nccl_rank NRANKS RANK ID_FILE [OP [DELAY_MS]]\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    int nranks = atoi(argv[1]);
    int rank = atoi(argv[2]);
    const char *id_file = argv[3];
    const char *op = argc > 4 ? argv[4] : "allreduce";
    int delay_ms = argc > 5 ? atoi(argv[5]) : 0;

    int version = 0;
    CHECK(ncclGetVersion(&version));
    ncclUniqueId id;
    if (rank == 0) {
        CHECK(ncclGetUniqueId(&id));
        if (write_id(id_file, &id) != 0) {
            perror("write id");
            return 1;
        }
    } else if (read_id(id_file, &id) != 0) {
        fprintf(stderr, "no unique id in %s\n", id_file);
        return 1;
    }
    int ndev = 0;
    cudaGetDeviceCount(&ndev);
    cudaSetDevice(rank % ndev);
    ncclComm_t comm = NULL;
    CHECK(ncclCommInitRank(&comm, nranks, id, rank));
    int count = 0, me = -1, dev = -1;
    CHECK(ncclCommCount(comm, &count));
    CHECK(ncclCommUserRank(comm, &me));
    CHECK(ncclCommCuDevice(comm, &dev));
    cudaStream_t s;
    cudaStreamCreate(&s);
    int null_rc = ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, NULL, s);
    int bad_type_rc = ncclAllReduce(NULL, NULL, 1, (ncclDataType_t)42, ncclSum, comm, s);
    printf("ready {\"rank\": %d, \"count\": %d, \"user_rank\": %d, \"device\": %d, "
           "\"version\": %d, \"null_comm_rc\": %d, \"bad_type_rc\": %d}\n",
           rank, count, me, dev, version, null_rc, bad_type_rc);

    if (strcmp(op, "skip") == 0) {
        for (;;) {
            pause();
        }
    }
    if (delay_ms > 0) {
        usleep((useconds_t)delay_ms * 1000u);
    }
    const size_t elems = 1u << 20; /* 4 MiB of float32 */
    uint64_t t0 = now_ns();
    if (strcmp(op, "allreduce") == 0) {
        CHECK(ncclAllReduce(NULL, NULL, elems, ncclFloat32, ncclSum, comm, s));
    } else if (strcmp(op, "sendrecv") == 0) {
        if (ring_exchange(comm, nranks, rank, elems, s) != 0) {
            return 1;
        }
    } else if (strcmp(op, "pingpong") == 0) {
        /* Ungrouped, ordered: even ranks send first, odd ranks receive first. */
        int peer = rank ^ 1;
        if (rank % 2 == 0) {
            CHECK(ncclSend(NULL, elems, ncclFloat32, peer, comm, s));
            CHECK(ncclRecv(NULL, elems, ncclFloat32, peer, comm, s));
        } else {
            CHECK(ncclRecv(NULL, elems, ncclFloat32, peer, comm, s));
            CHECK(ncclSend(NULL, elems, ncclFloat32, peer, comm, s));
        }
    } else if (strcmp(op, "all") == 0) {
        CHECK(ncclAllReduce(NULL, NULL, elems, ncclBfloat16, ncclAvg, comm, s));
        CHECK(ncclAllGather(NULL, NULL, elems / nranks, ncclFloat16, comm, s));
        CHECK(ncclReduceScatter(NULL, NULL, elems / nranks, ncclFloat32, ncclMax, comm, s));
        CHECK(ncclBroadcast(NULL, NULL, elems, ncclInt8, 0, comm, s));
        CHECK(ncclReduce(NULL, NULL, elems, ncclFloat64, ncclMin, nranks - 1, comm, s));
        if (ring_exchange(comm, nranks, rank, elems, s) != 0) {
            return 1;
        }
        CHECK(ncclGroupStart());
        CHECK(ncclAllReduce(NULL, NULL, 16, ncclInt32, ncclSum, comm, s));
        CHECK(ncclAllReduce(NULL, NULL, 16, ncclInt64, ncclProd, comm, s));
        CHECK(ncclGroupEnd());
    } else {
        fprintf(stderr, "unknown op %s\n", op);
        return 2;
    }
    uint64_t t1 = now_ns();
    printf("enqueued\n");
    cudaStreamSynchronize(s);
    uint64_t t2 = now_ns();
    ncclResult_t async = ncclSuccess;
    CHECK(ncclCommGetAsyncError(comm, &async));
    CHECK(ncclCommDestroy(comm));
    printf("done {\"rank\": %d, \"call_ns\": %llu, \"enqueue_ns\": %llu, \"done_ns\": %llu, "
           "\"wait_ns\": %llu, \"async_error\": %d}\n",
           rank, (unsigned long long)t0, (unsigned long long)(t1 - t0),
           (unsigned long long)t2, (unsigned long long)(t2 - t0), (int)async);
    return 0;
}
