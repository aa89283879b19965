/* stream.c: see stream.h. */
#define _GNU_SOURCE
#include "stream.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STREAM_MAGIC 0x5354524du /* "STRM" */
#define STREAM_DEAD 0x44454144u  /* "DEAD" */
#define EVENT_MAGIC 0x45564e54u  /* "EVNT" */

static sd_complete_fn complete_cb;
static char thread_prefix[9] = "stream";
static uint32_t next_id = 1;

/* Every live stream, for device-wide synchronisation and validation. */
static pthread_mutex_t all_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sd_stream *all_streams;

void sd_streams_init(sd_complete_fn on_complete, const char *prefix, uint32_t first_id)
{
    complete_cb = on_complete;
    snprintf(thread_prefix, sizeof(thread_prefix), "%s", prefix);
    __atomic_store_n(&next_id, first_id, __ATOMIC_RELAXED);
}

uint32_t sd_stream_next_id(void)
{
    return __atomic_fetch_add(&next_id, 1, __ATOMIC_RELAXED);
}

struct sd_op *sd_op_new(enum sd_op_type type)
{
    struct sd_op *op = calloc(1, sizeof(*op));
    if (op != NULL) {
        op->type = type;
    }
    return op;
}

static void stream_unref_locked_all(struct sd_stream *s)
{
    /* Caller holds all_mu. Frees once the owner and all waiters let go and
     * the worker has exited. */
    if (--s->refs == 0 && s->stopped) {
        struct sd_stream **pp = &all_streams;
        while (*pp != NULL && *pp != s) {
            pp = &(*pp)->next_all;
        }
        if (*pp == s) {
            *pp = s->next_all;
        }
        s->magic = STREAM_DEAD;
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->work_cv);
        pthread_cond_destroy(&s->done_cv);
        free(s);
    }
}

static void run_event_record(struct sd_op *op, uint64_t now)
{
    struct sd_event *e = op->event;
    pthread_mutex_lock(&e->mu);
    if (op->event_seq > e->done) {
        e->done = op->event_seq;
        e->ts_ns = now;
    }
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static void run_event_wait(struct sd_op *op)
{
    struct sd_event *e = op->event;
    pthread_mutex_lock(&e->mu);
    while (e->done < op->event_seq) {
        pthread_cond_wait(&e->cv, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
}

/* STANDIN_STREAM_POLL_US: how long an idle stream worker polls its queue
 * before it sleeps on its condition variable (default 0: it sleeps at
 * once). A GPU picks up launched work without the launching thread waking
 * anything; with polling, launches that follow each other closer than this
 * do not wake the worker either (pthread_cond_signal without waiters makes
 * no system call), as with a real device. */
static uint64_t poll_ns(void)
{
    static uint64_t ns = UINT64_MAX;
    uint64_t v = __atomic_load_n(&ns, __ATOMIC_RELAXED);
    if (v == UINT64_MAX) {
        v = sd_env_u64("STANDIN_STREAM_POLL_US", 0) * 1000;
        __atomic_store_n(&ns, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* Polls for queued work for up to poll_ns(); true if some arrived. */
static int poll_for_work(struct sd_stream *s)
{
    uint64_t limit = poll_ns();
    if (limit == 0) {
        return 0;
    }
    uint64_t deadline = sd_now_ns() + limit;
    do {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(&s->head, __ATOMIC_ACQUIRE) != NULL) {
                return 1;
            }
            __builtin_ia32_pause();
        }
    } while (sd_now_ns() < deadline);
    return 0;
}

static void *stream_worker(void *arg)
{
    struct sd_stream *s = arg;
    for (;;) {
        if (__atomic_load_n(&s->head, __ATOMIC_ACQUIRE) == NULL) {
            poll_for_work(s);
        }
        pthread_mutex_lock(&s->mu);
        while (s->head == NULL) {
            pthread_cond_wait(&s->work_cv, &s->mu);
        }
        struct sd_op *op = s->head;
        s->head = op->next;
        if (s->head == NULL) {
            s->tail = NULL;
        }
        pthread_mutex_unlock(&s->mu);

        uint64_t start = sd_now_ns();
        int stop = 0;
        switch (op->type) {
        case SD_OP_DELAY:
            if (op->spin) {
                sd_spin_until(start + op->duration_ns);
            } else if (op->duration_ns > 0) {
                sd_sleep_until(start + op->duration_ns);
            }
            break;
        case SD_OP_CALL:
            op->fn(op->arg);
            break;
        case SD_OP_EVENT_RECORD:
            run_event_record(op, start);
            break;
        case SD_OP_EVENT_WAIT:
            run_event_wait(op);
            break;
        case SD_OP_STOP:
            stop = 1;
            break;
        }
        uint64_t end = sd_now_ns();
        if (op->report.kind != 0 && complete_cb != NULL) {
            complete_cb(s, op, start, end);
        }
        free(op);

        pthread_mutex_lock(&s->mu);
        s->completed++;
        pthread_cond_broadcast(&s->done_cv);
        pthread_mutex_unlock(&s->mu);
        if (stop) {
            break;
        }
    }
    pthread_mutex_lock(&all_mu);
    s->stopped = 1;
    s->refs++;
    stream_unref_locked_all(s);
    pthread_mutex_unlock(&all_mu);
    return NULL;
}

struct sd_stream *sd_stream_create(int device, unsigned flags, uint32_t id)
{
    struct sd_stream *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return NULL;
    }
    s->magic = STREAM_MAGIC;
    s->id = id;
    s->device = device;
    s->flags = flags;
    s->refs = 1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work_cv, NULL);
    pthread_cond_init(&s->done_cv, NULL);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_t thread;
    pthread_mutex_lock(&all_mu);
    s->next_all = all_streams;
    all_streams = s;
    pthread_mutex_unlock(&all_mu);
    if (pthread_create(&thread, &attr, stream_worker, s) != 0) {
        pthread_attr_destroy(&attr);
        pthread_mutex_lock(&all_mu);
        s->stopped = 1;
        stream_unref_locked_all(s);
        pthread_mutex_unlock(&all_mu);
        return NULL;
    }
    pthread_attr_destroy(&attr);
    char name[16];
    snprintf(name, sizeof(name), "%s-%u", thread_prefix, id);
    pthread_setname_np(thread, name);
    return s;
}

int sd_stream_valid(const void *p)
{
    int found = 0;
    pthread_mutex_lock(&all_mu);
    for (struct sd_stream *s = all_streams; s != NULL; s = s->next_all) {
        if ((const void *)s == p) {
            found = s->magic == STREAM_MAGIC;
            break;
        }
    }
    pthread_mutex_unlock(&all_mu);
    return found;
}

uint64_t sd_stream_enqueue(struct sd_stream *s, struct sd_op *op)
{
    op->next = NULL;
    op->queued_ns = sd_now_ns();
    pthread_mutex_lock(&s->mu);
    if (s->tail != NULL) {
        s->tail->next = op;
    } else {
        s->head = op;
    }
    s->tail = op;
    uint64_t ticket = ++s->enqueued;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    return ticket;
}

void sd_stream_destroy(struct sd_stream *s)
{
    struct sd_op *op = sd_op_new(SD_OP_STOP);
    if (op == NULL) {
        return; /* leak the stream rather than free it under its worker */
    }
    sd_stream_enqueue(s, op);
    pthread_mutex_lock(&all_mu);
    stream_unref_locked_all(s);
    pthread_mutex_unlock(&all_mu);
}

void sd_stream_wait(struct sd_stream *s, uint64_t ticket)
{
    pthread_mutex_lock(&s->mu);
    while (s->completed < ticket) {
        pthread_cond_wait(&s->done_cv, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
}

void sd_stream_sync(struct sd_stream *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t ticket = s->enqueued;
    while (s->completed < ticket) {
        pthread_cond_wait(&s->done_cv, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
}

int sd_stream_idle(struct sd_stream *s)
{
    pthread_mutex_lock(&s->mu);
    int idle = s->completed == s->enqueued;
    pthread_mutex_unlock(&s->mu);
    return idle;
}

void sd_device_sync(int device)
{
    /* Take references and tickets under the list lock, wait outside it. */
    size_t n = 0, cap = 16;
    struct sd_stream **list = malloc(cap * sizeof(*list));
    uint64_t *tickets = malloc(cap * sizeof(*tickets));
    if (list == NULL || tickets == NULL) {
        free(list);
        free(tickets);
        return;
    }
    pthread_mutex_lock(&all_mu);
    for (struct sd_stream *s = all_streams; s != NULL; s = s->next_all) {
        if ((device >= 0 && s->device != device) || s->stopped) {
            continue;
        }
        if (n == cap) {
            cap *= 2;
            struct sd_stream **l2 = realloc(list, cap * sizeof(*list));
            uint64_t *t2 = l2 ? realloc(tickets, cap * sizeof(*tickets)) : NULL;
            if (l2 == NULL || t2 == NULL) {
                list = l2 ? l2 : list;
                break;
            }
            list = l2;
            tickets = t2;
        }
        s->refs++;
        pthread_mutex_lock(&s->mu);
        tickets[n] = s->enqueued;
        pthread_mutex_unlock(&s->mu);
        list[n++] = s;
    }
    pthread_mutex_unlock(&all_mu);
    for (size_t i = 0; i < n; i++) {
        sd_stream_wait(list[i], tickets[i]);
    }
    pthread_mutex_lock(&all_mu);
    for (size_t i = 0; i < n; i++) {
        stream_unref_locked_all(list[i]);
    }
    pthread_mutex_unlock(&all_mu);
    free(list);
    free(tickets);
}

struct sd_event *sd_event_create(int device, unsigned flags)
{
    struct sd_event *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return NULL;
    }
    e->magic = EVENT_MAGIC;
    e->device = device;
    e->flags = flags;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    return e;
}

int sd_event_valid(const void *p)
{
    /* Events are only checked by magic: callers own their lifetime. */
    return p != NULL && ((const struct sd_event *)p)->magic == EVENT_MAGIC;
}

void sd_event_destroy(struct sd_event *e)
{
    /* Pending records/waits may still reference the event: retire it
     * without freeing (events are few and small). */
    e->magic = STREAM_DEAD;
}

int sd_event_record(struct sd_event *e, struct sd_stream *s)
{
    struct sd_op *op = sd_op_new(SD_OP_EVENT_RECORD);
    if (op == NULL) {
        return -1;
    }
    pthread_mutex_lock(&e->mu);
    op->event_seq = ++e->recorded;
    pthread_mutex_unlock(&e->mu);
    op->event = e;
    sd_stream_enqueue(s, op);
    return 0;
}

int sd_event_wait_on(struct sd_stream *s, struct sd_event *e)
{
    struct sd_op *op = sd_op_new(SD_OP_EVENT_WAIT);
    if (op == NULL) {
        return -1;
    }
    pthread_mutex_lock(&e->mu);
    op->event_seq = e->recorded;
    pthread_mutex_unlock(&e->mu);
    op->event = e;
    sd_stream_enqueue(s, op);
    return 0;
}

void sd_event_sync(struct sd_event *e)
{
    pthread_mutex_lock(&e->mu);
    uint64_t target = e->recorded;
    while (e->done < target) {
        pthread_cond_wait(&e->cv, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
}

int sd_event_done(struct sd_event *e, uint64_t *ts_ns, uint64_t *recorded)
{
    pthread_mutex_lock(&e->mu);
    int done = e->done >= e->recorded;
    if (ts_ns != NULL) {
        *ts_ns = e->ts_ns;
    }
    if (recorded != NULL) {
        *recorded = e->recorded;
    }
    pthread_mutex_unlock(&e->mu);
    return done;
}
