/* coll.c: see coll.h. */
#include "coll.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sd_comm_init(struct sd_comm *c, struct sd_rdv *rdv, int rank, int nranks,
                  const char *env_prefix)
{
    char name[64];
    c->rdv = rdv;
    c->rank = rank;
    c->nranks = nranks;
    snprintf(name, sizeof(name), "STANDIN_%s_BW_GBPS", env_prefix);
    c->bw_gbps = sd_env_double(name, 100.0);
    if (!(c->bw_gbps > 0.0)) {
        c->bw_gbps = 100.0;
    }
    snprintf(name, sizeof(name), "STANDIN_%s_LAT_US", env_prefix);
    c->lat_ns = sd_env_u64(name, 5) * 1000ull;
    snprintf(name, sizeof(name), "STANDIN_%s_HANG_AT_SEQ", env_prefix);
    c->hang_seq = sd_env_i64(name, -1);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->idle_cv, NULL);
    c->next_seq = 0;
    c->inflight = 0;
}

void sd_comm_wait_idle(struct sd_comm *c)
{
    pthread_mutex_lock(&c->mu);
    while (c->inflight > 0) {
        pthread_cond_wait(&c->idle_cv, &c->mu);
    }
    pthread_mutex_unlock(&c->mu);
}

static int is_p2p(enum sd_coll_kind k)
{
    return k == SD_SEND || k == SD_RECV;
}

static uint64_t duration_ns(const struct sd_comm *c, enum sd_coll_kind kind, uint64_t bytes,
                            double slowdown)
{
    double n = (double)c->nranks;
    double factor = 1.0;
    switch (kind) {
    case SD_ALLREDUCE:
        factor = 2.0 * (n - 1.0) / n;
        break;
    case SD_ALLGATHER:
    case SD_REDUCESCATTER:
        factor = (n - 1.0) / n;
        break;
    case SD_BARRIER:
        factor = 0.0;
        break;
    default:
        break;
    }
    return c->lat_ns + (uint64_t)((double)bytes * factor / c->bw_gbps * slowdown);
}

/* The calling thread's open group: pending batches in order of first use. */
static __thread int group_depth;
static __thread struct sd_coll_batch **group_batches;
static __thread int group_len, group_cap;

void sd_group_start(void)
{
    group_depth++;
}

int sd_group_depth(void)
{
    return group_depth;
}

static struct sd_coll_batch *batch_new(struct sd_comm *c, void *stream, sd_coll_done_fn on_done)
{
    struct sd_coll_batch *b = calloc(1, sizeof(*b));
    if (b == NULL) {
        return NULL;
    }
    b->comm = c;
    b->stream = stream;
    b->on_done = on_done;
    return b;
}

static int batch_add(struct sd_coll_batch *b, const struct sd_coll_op *op)
{
    if (b->n == b->cap) {
        int cap = b->cap ? b->cap * 2 : 4;
        struct sd_coll_op *ops = realloc(b->ops, (size_t)cap * sizeof(*ops));
        if (ops == NULL) {
            return -1;
        }
        b->ops = ops;
        b->cap = cap;
    }
    b->ops[b->n++] = *op;
    return 0;
}

static void batch_free(struct sd_coll_batch *b)
{
    free(b->ops);
    free(b);
}

/* Registered per batch so sd_group_end can enqueue them all. */
static __thread sd_coll_enqueue_fn group_enqueue;

static int batch_enqueue(struct sd_coll_batch *b, sd_coll_enqueue_fn enqueue)
{
    struct sd_comm *c = b->comm;
    pthread_mutex_lock(&c->mu);
    c->inflight++;
    pthread_mutex_unlock(&c->mu);
    int rc = enqueue(b);
    if (rc != 0) {
        pthread_mutex_lock(&c->mu);
        c->inflight--;
        pthread_cond_broadcast(&c->idle_cv);
        pthread_mutex_unlock(&c->mu);
        batch_free(b);
    }
    return rc;
}

int sd_coll_submit(struct sd_comm *c, void *stream, const struct sd_coll_op *op,
                   sd_coll_done_fn on_done, sd_coll_enqueue_fn enqueue)
{
    struct sd_coll_op o = *op;
    if (!is_p2p(o.kind)) {
        pthread_mutex_lock(&c->mu);
        o.seq = c->next_seq++;
        pthread_mutex_unlock(&c->mu);
    }
    if (group_depth == 0) {
        struct sd_coll_batch *b = batch_new(c, stream, on_done);
        if (b == NULL || batch_add(b, &o) != 0) {
            if (b != NULL) {
                batch_free(b);
            }
            return -1;
        }
        return batch_enqueue(b, enqueue);
    }
    group_enqueue = enqueue;
    for (int i = 0; i < group_len; i++) {
        struct sd_coll_batch *b = group_batches[i];
        if (b->comm == c && b->stream == stream) {
            return batch_add(b, &o);
        }
    }
    if (group_len == group_cap) {
        int cap = group_cap ? group_cap * 2 : 8;
        struct sd_coll_batch **l = realloc(group_batches, (size_t)cap * sizeof(*l));
        if (l == NULL) {
            return -1;
        }
        group_batches = l;
        group_cap = cap;
    }
    struct sd_coll_batch *b = batch_new(c, stream, on_done);
    if (b == NULL || batch_add(b, &o) != 0) {
        if (b != NULL) {
            batch_free(b);
        }
        return -1;
    }
    group_batches[group_len++] = b;
    return 0;
}

int sd_group_end(void)
{
    if (group_depth == 0) {
        return -2; /* not in a group */
    }
    if (--group_depth > 0) {
        return 0;
    }
    int first_error = 0;
    for (int i = 0; i < group_len; i++) {
        int rc = batch_enqueue(group_batches[i], group_enqueue);
        if (rc != 0 && first_error == 0) {
            first_error = rc;
        }
    }
    group_len = 0;
    return first_error;
}

static void finish_op(struct sd_coll_batch *b, struct sd_coll_op *op, uint64_t start, uint64_t end)
{
    op->start_ns = start;
    op->end_ns = end;
    if (b->on_done != NULL) {
        b->on_done(b, op);
    }
}

void sd_coll_run(void *arg)
{
    struct sd_coll_batch *b = arg;
    struct sd_comm *c = b->comm;

    /* Post every send/receive first so grouped pairs cannot deadlock. */
    for (int i = 0; i < b->n; i++) {
        struct sd_coll_op *op = &b->ops[i];
        if (is_p2p(op->kind)) {
            op->ticket = sd_rdv_p2p_post(c->rdv, op->peer, op->kind == SD_SEND);
        }
    }
    for (int i = 0; i < b->n; i++) {
        struct sd_coll_op *op = &b->ops[i];
        if (is_p2p(op->kind)) {
            continue;
        }
        if (c->hang_seq >= 0 && op->seq == (uint64_t)c->hang_seq) {
            /* Injected hang: never arrive, so every rank stays here. */
            sd_rdv_block_until_abort(c->rdv);
        }
        uint64_t release = 0;
        double slowdown = 1.0;
        if (sd_rdv_aborted(c->rdv) || sd_rdv_collective(c->rdv, op->seq, &release, &slowdown) != 0) {
            op->failed = 1;
            uint64_t now = sd_now_ns();
            finish_op(b, op, now, now);
            continue;
        }
        uint64_t end = release + duration_ns(c, op->kind, op->bytes, slowdown);
        sd_sleep_until(end);
        finish_op(b, op, release, end);
    }
    /* Wait for every peer, then move the larger of the sent and received
     * totals at the slowest pair's speed. */
    uint64_t send_bytes = 0, recv_bytes = 0;
    double slowdown = 1.0;
    int any_p2p = 0, failed = 0;
    for (int i = 0; i < b->n; i++) {
        struct sd_coll_op *op = &b->ops[i];
        if (!is_p2p(op->kind)) {
            continue;
        }
        any_p2p = 1;
        if (sd_rdv_p2p_wait(c->rdv, op->peer, op->kind == SD_SEND, op->ticket) != 0) {
            failed = 1;
        }
        if (op->kind == SD_SEND) {
            send_bytes += op->bytes;
        } else {
            recv_bytes += op->bytes;
        }
        double s = sd_rdv_pair_slowdown(c->rdv, op->peer);
        if (s > slowdown) {
            slowdown = s;
        }
    }
    if (any_p2p) {
        uint64_t start = sd_now_ns();
        uint64_t end = start;
        if (!failed) {
            uint64_t bytes = send_bytes > recv_bytes ? send_bytes : recv_bytes;
            end = start + duration_ns(c, SD_SEND, bytes, slowdown);
            sd_sleep_until(end);
        }
        for (int i = 0; i < b->n; i++) {
            struct sd_coll_op *op = &b->ops[i];
            if (is_p2p(op->kind)) {
                op->failed = failed;
                finish_op(b, op, start, end);
            }
        }
    }
    pthread_mutex_lock(&c->mu);
    c->inflight--;
    pthread_cond_broadcast(&c->idle_cv);
    pthread_mutex_unlock(&c->mu);
    batch_free(b);
}
