/*
 * coll.h: collective operations over the rendezvous engine, shared by
 * libnccl and libhccl: communicator state, sequence numbering, group
 * batching, the timing model and the function that runs a batch on a
 * stream worker.
 *
 * Timing: once every rank arrived (the barrier's release instant, the same
 * on every rank), an operation lasts
 *   latency + bytes * factor / bandwidth * slowdown
 * with bandwidth in GB/s (1 byte/ns per GB/s), factor NCCL's bus-bandwidth
 * factor (AllReduce 2(n-1)/n, AllGather and ReduceScatter (n-1)/n, others 1)
 * and slowdown the largest link slowdown among the ranks taking part.
 */
#ifndef STANDIN_COLL_H
#define STANDIN_COLL_H

#include <pthread.h>
#include <stdint.h>

#include "rendezvous.h"
#include "util.h"

enum sd_coll_kind {
    SD_ALLREDUCE,
    SD_ALLGATHER,
    SD_REDUCESCATTER,
    SD_BROADCAST,
    SD_REDUCE,
    SD_SEND,
    SD_RECV,
    SD_BARRIER,
};

struct sd_coll_op {
    enum sd_coll_kind kind;
    uint64_t count; /* elements, as the caller passed them */
    int dtype;      /* the library's data type value */
    int redop;      /* the library's reduction value */
    int peer;       /* send/recv peer, broadcast/reduce root */
    uint64_t bytes; /* payload the timing model uses */
    uint64_t seq;   /* collectives: per-communicator sequence number */
    uint64_t ticket;   /* send/recv: match ticket (set when run) */
    uint64_t start_ns; /* set when run */
    uint64_t end_ns;
    int failed; /* aborted */
};

struct sd_comm {
    struct sd_rdv *rdv;
    int rank;
    int nranks;
    double bw_gbps;
    uint64_t lat_ns;
    int64_t hang_seq; /* -1: none */
    pthread_mutex_t mu;
    pthread_cond_t idle_cv;
    uint64_t next_seq;
    uint64_t inflight;
    int aborted_seen;
};

struct sd_coll_batch;
/* Called on the stream worker for each op once it completed. */
typedef void (*sd_coll_done_fn)(struct sd_coll_batch *b, struct sd_coll_op *op);

struct sd_coll_batch {
    struct sd_comm *comm;
    void *stream; /* the library's stream handle */
    sd_coll_done_fn on_done;
    uint64_t user[4]; /* library data: device, stream id, correlation id */
    int n, cap;
    struct sd_coll_op *ops;
};

/* Enqueues b on b->stream to run sd_coll_run(b). 0 or a library error. */
typedef int (*sd_coll_enqueue_fn)(struct sd_coll_batch *b);

/* Initialises c (after sd_rdv_join). env_prefix: "NCCL" or "HCCL" for
 * STANDIN_<p>_BW_GBPS, STANDIN_<p>_LAT_US, STANDIN_<p>_HANG_AT_SEQ. */
SD_HIDDEN void sd_comm_init(struct sd_comm *c, struct sd_rdv *rdv, int rank, int nranks,
                            const char *env_prefix);
/* Blocks until no operation of c is in flight. */
SD_HIDDEN void sd_comm_wait_idle(struct sd_comm *c);

SD_HIDDEN void sd_group_start(void);
SD_HIDDEN int sd_group_depth(void);
/* Submits op on (c, stream): queued in the open group, or enqueued now.
 * Assigns collective sequence numbers in call order. 0 or enqueue's error. */
SD_HIDDEN int sd_coll_submit(struct sd_comm *c, void *stream, const struct sd_coll_op *op,
                             sd_coll_done_fn on_done, sd_coll_enqueue_fn enqueue);
/* Closes a group level; at the outermost, enqueues one batch per
 * (communicator, stream) in order of first use. 0 or the first error. */
SD_HIDDEN int sd_group_end(void);

/* Runs a batch (the stream worker's function) and frees it. */
SD_HIDDEN void sd_coll_run(void *batch);

#endif /* STANDIN_COLL_H */
