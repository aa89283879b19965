/*
 * actbuf.h: activity-buffer delivery shared by libcupti and libmspti.
 *
 * Records are appended to the buffer the consumer handed over through its
 * "buffer requested" callback; a buffer that cannot take the next record is
 * handed back through "buffer completed" (the caller's thread, outside the
 * record lock), as are partly filled buffers on flush. Records that find no
 * buffer are counted as dropped.
 */
#ifndef STANDIN_ACTBUF_H
#define STANDIN_ACTBUF_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "util.h"

typedef void (*sd_buf_request_fn)(uint8_t **buffer, size_t *size, size_t *max_records);
typedef void (*sd_buf_complete_fn)(uint8_t *buffer, size_t size, size_t valid);

struct sd_actbuf {
    pthread_mutex_t slow; /* serialises calls into the consumer */
    pthread_mutex_t fast; /* guards the current buffer */
    sd_buf_request_fn request;
    sd_buf_complete_fn complete;
    uint8_t *buf;
    size_t size, used;
    uint64_t dropped;
    uint32_t period_ms;
    int flusher_started;
};

#define SD_ACTBUF_INIT                                                                     \
    {                                                                                      \
        PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, NULL, NULL, NULL, 0, 0, 0, 0, 0 \
    }

SD_HIDDEN void sd_actbuf_set_callbacks(struct sd_actbuf *ab, sd_buf_request_fn request,
                                       sd_buf_complete_fn complete);
/* 1 once callbacks are registered. */
SD_HIDDEN int sd_actbuf_ready(struct sd_actbuf *ab);
/* Appends one record of len bytes (a multiple of 8). */
SD_HIDDEN void sd_actbuf_append(struct sd_actbuf *ab, const void *record, size_t len);
/* Hands back the current buffer if it holds any record. */
SD_HIDDEN void sd_actbuf_flush(struct sd_actbuf *ab);
/* Flushes every period_ms from a library thread (0 stops). */
SD_HIDDEN void sd_actbuf_set_period(struct sd_actbuf *ab, uint32_t period_ms);
SD_HIDDEN uint64_t sd_actbuf_dropped(struct sd_actbuf *ab);

#endif /* STANDIN_ACTBUF_H */
