/* actbuf.c: see actbuf.h. */
#define _GNU_SOURCE
#include "actbuf.h"

#include <string.h>
#include <unistd.h>

void sd_actbuf_set_callbacks(struct sd_actbuf *ab, sd_buf_request_fn request,
                             sd_buf_complete_fn complete)
{
    pthread_mutex_lock(&ab->slow);
    pthread_mutex_lock(&ab->fast);
    ab->request = request;
    ab->complete = complete;
    pthread_mutex_unlock(&ab->fast);
    pthread_mutex_unlock(&ab->slow);
}

int sd_actbuf_ready(struct sd_actbuf *ab)
{
    return __atomic_load_n(&ab->request, __ATOMIC_ACQUIRE) != NULL;
}

static int try_append_locked(struct sd_actbuf *ab, const void *record, size_t len)
{
    if (ab->buf != NULL && ab->used + len <= ab->size) {
        memcpy(ab->buf + ab->used, record, len);
        ab->used += len;
        return 1;
    }
    return 0;
}

void sd_actbuf_append(struct sd_actbuf *ab, const void *record, size_t len)
{
    pthread_mutex_lock(&ab->fast);
    int done = try_append_locked(ab, record, len);
    pthread_mutex_unlock(&ab->fast);
    if (done) {
        return;
    }

    pthread_mutex_lock(&ab->slow);
    pthread_mutex_lock(&ab->fast);
    if (try_append_locked(ab, record, len)) {
        pthread_mutex_unlock(&ab->fast);
        pthread_mutex_unlock(&ab->slow);
        return;
    }
    uint8_t *full = ab->buf;
    size_t full_size = ab->size, full_used = ab->used;
    ab->buf = NULL;
    ab->size = ab->used = 0;
    sd_buf_request_fn request = ab->request;
    sd_buf_complete_fn complete = ab->complete;
    pthread_mutex_unlock(&ab->fast);

    if (full != NULL && complete != NULL) {
        complete(full, full_size, full_used);
    }
    uint8_t *nb = NULL;
    size_t nsize = 0, max_records = 0;
    if (request != NULL) {
        request(&nb, &nsize, &max_records);
    }
    pthread_mutex_lock(&ab->fast);
    if (nb != NULL && nsize >= len) {
        ab->buf = nb;
        ab->size = nsize;
        ab->used = 0;
        try_append_locked(ab, record, len);
    } else {
        ab->dropped++;
    }
    pthread_mutex_unlock(&ab->fast);
    pthread_mutex_unlock(&ab->slow);
}

void sd_actbuf_flush(struct sd_actbuf *ab)
{
    pthread_mutex_lock(&ab->slow);
    pthread_mutex_lock(&ab->fast);
    uint8_t *buf = NULL;
    size_t size = 0, used = 0;
    if (ab->buf != NULL && ab->used > 0) {
        buf = ab->buf;
        size = ab->size;
        used = ab->used;
        ab->buf = NULL;
        ab->size = ab->used = 0;
    }
    sd_buf_complete_fn complete = ab->complete;
    pthread_mutex_unlock(&ab->fast);
    if (buf != NULL && complete != NULL) {
        complete(buf, size, used);
    }
    pthread_mutex_unlock(&ab->slow);
}

static void *flusher(void *arg)
{
    struct sd_actbuf *ab = arg;
    for (;;) {
        uint32_t ms = __atomic_load_n(&ab->period_ms, __ATOMIC_RELAXED);
        if (ms == 0) {
            usleep(100000);
            continue;
        }
        usleep(ms * 1000u);
        sd_actbuf_flush(ab);
    }
    return NULL;
}

void sd_actbuf_set_period(struct sd_actbuf *ab, uint32_t period_ms)
{
    __atomic_store_n(&ab->period_ms, period_ms, __ATOMIC_RELAXED);
    pthread_mutex_lock(&ab->fast);
    int start = period_ms > 0 && !ab->flusher_started;
    if (start) {
        ab->flusher_started = 1;
    }
    pthread_mutex_unlock(&ab->fast);
    if (start) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, flusher, ab) == 0) {
            pthread_setname_np(t, "actbuf-flush");
        }
        pthread_attr_destroy(&attr);
    }
}

uint64_t sd_actbuf_dropped(struct sd_actbuf *ab)
{
    pthread_mutex_lock(&ab->fast);
    uint64_t d = ab->dropped;
    pthread_mutex_unlock(&ab->fast);
    return d;
}
