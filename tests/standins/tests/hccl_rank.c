/*
 * hccl_rank: one rank of a multi-process job on the stand-in libhccl.so.
 *
 *   hccl_rank NRANKS RANK ID_FILE [OP [DELAY_MS]]
 *
 * Rank 0 writes the HcclRootInfo to ID_FILE, the others read it. Every rank
 * prints "ready" once the communicator formed, then runs OP (allreduce,
 * sendrecv, pingpong, all, or skip: never call anything and sleep) after
 * sleeping DELAY_MS, prints "enqueued" when the call returned, and prints
 * "done {json}" once aclrtSynchronizeStream returned. Times: CLOCK_BOOTTIME.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "standin_hccl.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int write_id(const char *path, const HcclRootInfo *id)
{
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (f == NULL || fwrite(id, sizeof(*id), 1, f) != 1 || fclose(f) != 0) {
        return -1;
    }
    return rename(tmp, path);
}

static int read_id(const char *path, HcclRootInfo *id)
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
        int rc_ = (int)(call);                                                         \
        if (rc_ != 0) {                                                                \
            fprintf(stderr, "%s failed: %d\n", #call, rc_);                            \
            return 1;                                                                  \
        }                                                                              \
    } while (0)

static int ring_exchange(HcclComm comm, int nranks, int rank, uint64_t count, aclrtStream s)
{
    CHECK(HcclGroupStart());
    CHECK(HcclSend(NULL, count, HCCL_DATA_TYPE_FP32, (uint32_t)((rank + 1) % nranks), comm, s));
    CHECK(HcclRecv(NULL, count, HCCL_DATA_TYPE_FP32, (uint32_t)((rank + nranks - 1) % nranks),
                   comm, s));
    CHECK(HcclGroupEnd());
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: hccl_rank NRANKS RANK ID_FILE [OP [DELAY_MS]]\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    int nranks = atoi(argv[1]);
    int rank = atoi(argv[2]);
    const char *id_file = argv[3];
    const char *op = argc > 4 ? argv[4] : "allreduce";
    int delay_ms = argc > 5 ? atoi(argv[5]) : 0;

    HcclRootInfo id;
    if (rank == 0) {
        CHECK(HcclGetRootInfo(&id));
        if (write_id(id_file, &id) != 0) {
            perror("write id");
            return 1;
        }
    } else if (read_id(id_file, &id) != 0) {
        fprintf(stderr, "no root info in %s\n", id_file);
        return 1;
    }
    CHECK(aclInit(NULL));
    uint32_t ndev = 0;
    CHECK(aclrtGetDeviceCount(&ndev));
    CHECK(aclrtSetDevice((int32_t)((uint32_t)rank % ndev)));
    HcclComm comm = NULL;
    CHECK(HcclCommInitRootInfo((uint32_t)nranks, &id, (uint32_t)rank, &comm));
    uint32_t count = 0, me = 0;
    CHECK(HcclGetRankSize(comm, &count));
    CHECK(HcclGetRankId(comm, &me));
    char name[HCCL_COMM_NAME_MAX_LENGTH];
    CHECK(HcclGetCommName(comm, name));
    aclrtStream s;
    CHECK(aclrtCreateStream(&s));
    int null_rc = HcclAllReduce(NULL, NULL, 1, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, NULL, s);
    printf("ready {\"rank\": %d, \"count\": %u, \"user_rank\": %u, \"comm_name\": \"%s\", "
           "\"null_comm_rc\": %d}\n",
           rank, count, me, name, null_rc);

    if (strcmp(op, "skip") == 0) {
        for (;;) {
            pause();
        }
    }
    if (delay_ms > 0) {
        usleep((useconds_t)delay_ms * 1000u);
    }
    const uint64_t elems = 1u << 20; /* 4 MiB of fp32 */
    uint64_t t0 = now_ns();
    if (strcmp(op, "allreduce") == 0) {
        CHECK(HcclAllReduce(NULL, NULL, elems, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, comm, s));
    } else if (strcmp(op, "sendrecv") == 0) {
        if (ring_exchange(comm, nranks, rank, elems, s) != 0) {
            return 1;
        }
    } else if (strcmp(op, "all") == 0) {
        CHECK(HcclAllReduce(NULL, NULL, elems, HCCL_DATA_TYPE_BFP16, HCCL_REDUCE_MAX, comm, s));
        CHECK(HcclAllGather(NULL, NULL, elems / (uint64_t)nranks, HCCL_DATA_TYPE_FP16, comm, s));
        CHECK(HcclReduceScatter(NULL, NULL, elems / (uint64_t)nranks, HCCL_DATA_TYPE_FP32,
                                HCCL_REDUCE_SUM, comm, s));
        CHECK(HcclBroadcast(NULL, elems, HCCL_DATA_TYPE_INT8, 0, comm, s));
        CHECK(HcclReduce(NULL, NULL, elems, HCCL_DATA_TYPE_FP64, HCCL_REDUCE_MIN,
                         (uint32_t)nranks - 1, comm, s));
        CHECK(HcclBarrier(comm, s));
        if (ring_exchange(comm, nranks, rank, elems, s) != 0) {
            return 1;
        }
    } else {
        fprintf(stderr, "unknown op %s\n", op);
        return 2;
    }
    uint64_t t1 = now_ns();
    printf("enqueued\n");
    CHECK(aclrtSynchronizeStream(s));
    uint64_t t2 = now_ns();
    CHECK(HcclCommDestroy(comm));
    printf("done {\"rank\": %d, \"call_ns\": %llu, \"enqueue_ns\": %llu, \"done_ns\": %llu, "
           "\"wait_ns\": %llu}\n",
           rank, (unsigned long long)t0, (unsigned long long)(t1 - t0),
           (unsigned long long)t2, (unsigned long long)(t2 - t0));
    return 0;
}
