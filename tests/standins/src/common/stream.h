/*
 * stream.h: the device-stream engine shared by libcudart and libascendcl.
 *
 * A stream is a worker thread with a FIFO of operations, run one at a time
 * in order. An operation is a delay (kernel or copy: sleep or spin for a
 * duration), a call (a function run on the worker, e.g. a collective that
 * blocks until every rank arrives), an event record or an event wait.
 * Completion counts let callers block until everything enqueued before
 * their call is done. Each library gets its own private copy.
 */
#ifndef STANDIN_STREAM_H
#define STANDIN_STREAM_H

#include <pthread.h>
#include <stdint.h>

#include "util.h"

enum sd_op_type {
    SD_OP_DELAY,
    SD_OP_CALL,
    SD_OP_EVENT_RECORD,
    SD_OP_EVENT_WAIT,
    SD_OP_STOP,
};

/* What the library reports when an operation completes (opaque here). */
struct sd_report {
    int kind; /* library-defined; 0 = nothing to report */
    const char *name;
    uint64_t correlation_id;
    int32_t grid[3];
    int32_t block[3];
    int32_t shared_mem;
    uint64_t bytes;
    int copy_kind;
};

struct sd_event {
    uint32_t magic;
    unsigned flags;
    int device;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t recorded; /* number of records enqueued */
    uint64_t done;     /* number of records reached */
    uint64_t ts_ns;    /* when the latest record was reached */
};

struct sd_op {
    struct sd_op *next;
    enum sd_op_type type;
    int spin;
    uint64_t duration_ns;
    void (*fn)(void *arg);
    void *arg;
    struct sd_event *event;
    uint64_t event_seq;
    uint64_t queued_ns;
    struct sd_report report;
};

struct sd_stream {
    uint32_t magic;
    uint32_t id;
    int device;
    unsigned flags;
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    pthread_cond_t done_cv;
    struct sd_op *head, *tail;
    uint64_t enqueued;
    uint64_t completed;
    int refs;    /* the owner, plus callers waiting through the global list */
    int stopped; /* the worker has exited */
    struct sd_stream *next_all;
};

/* Called on the worker thread when an operation finishes, before the
 * stream counts it complete (so a sync that returns has seen the report). */
typedef void (*sd_complete_fn)(const struct sd_stream *s, const struct sd_op *op,
                               uint64_t start_ns, uint64_t end_ns);

/* Configures this library's copy: its completion callback, thread-name
 * prefix (<= 8 chars) and the first stream id to hand out. */
SD_HIDDEN void sd_streams_init(sd_complete_fn on_complete, const char *thread_prefix,
                               uint32_t first_id);

/* Creates a stream (and its worker). NULL on failure. */
SD_HIDDEN struct sd_stream *sd_stream_create(int device, unsigned flags, uint32_t id);
SD_HIDDEN uint32_t sd_stream_next_id(void);
/* Is `p` a live stream of this library? */
SD_HIDDEN int sd_stream_valid(const void *p);
/* Lets the stream finish its queued work, then frees it. */
SD_HIDDEN void sd_stream_destroy(struct sd_stream *s);

/* Allocates a zeroed op of `type` (NULL on out-of-memory). */
SD_HIDDEN struct sd_op *sd_op_new(enum sd_op_type type);
/* Enqueues op (ownership passes) and returns its ticket. */
SD_HIDDEN uint64_t sd_stream_enqueue(struct sd_stream *s, struct sd_op *op);
/* Blocks until the op with `ticket` (and all before it) completed. */
SD_HIDDEN void sd_stream_wait(struct sd_stream *s, uint64_t ticket);
/* Blocks until everything enqueued so far completed. */
SD_HIDDEN void sd_stream_sync(struct sd_stream *s);
/* 1 when everything enqueued so far completed. */
SD_HIDDEN int sd_stream_idle(struct sd_stream *s);
/* Synchronises every stream of `device` (-1: all devices). */
SD_HIDDEN void sd_device_sync(int device);

SD_HIDDEN struct sd_event *sd_event_create(int device, unsigned flags);
SD_HIDDEN int sd_event_valid(const void *p);
SD_HIDDEN void sd_event_destroy(struct sd_event *e);
/* Enqueues a record of e on s. */
SD_HIDDEN int sd_event_record(struct sd_event *e, struct sd_stream *s);
/* Makes s wait for e's latest record (as of now). */
SD_HIDDEN int sd_event_wait_on(struct sd_stream *s, struct sd_event *e);
/* Blocks until e's latest record (as of now) is reached. */
SD_HIDDEN void sd_event_sync(struct sd_event *e);
/* 1 when e's latest record is reached (or it was never recorded). */
SD_HIDDEN int sd_event_done(struct sd_event *e, uint64_t *ts_ns, uint64_t *recorded);

#endif /* STANDIN_STREAM_H */
