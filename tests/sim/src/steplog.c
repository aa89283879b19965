/* Clocks and the per-rank JSON-lines log of steps and events. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "sim.h"

static FILE *log_file;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t clock_ns(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t sim_boot_ns(void) { return clock_ns(CLOCK_BOOTTIME); }
uint64_t sim_real_ns(void) { return clock_ns(CLOCK_REALTIME); }

void sim_sleep_ns(uint64_t ns) {
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull),
                          .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* Burns `us` microseconds of this thread's CPU time (not wall time), so CPU
 * contention stretches it the way it stretches real host-side work. */
void sim_cpu_work_us(long us) {
    if (us <= 0)
        return;
    uint64_t end = clock_ns(CLOCK_THREAD_CPUTIME_ID) + (uint64_t)us * 1000u;
    volatile uint64_t x = 0x9e3779b97f4a7c15ull;
    while (clock_ns(CLOCK_THREAD_CPUTIME_ID) < end)
        for (int i = 0; i < 2000; i++)
            x = x * 6364136223846793005ull + 1442695040888963407ull;
}

int steplog_open(const char *path, int rank) {
    (void)rank;
    log_file = fopen(path, "a");
    return log_file ? 0 : -1;
}

void steplog_printf(const char *fmt, ...) {
    if (!log_file)
        return;
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&log_lock);
    vfprintf(log_file, fmt, ap);
    fputc('\n', log_file);
    fflush(log_file);
    pthread_mutex_unlock(&log_lock);
    va_end(ap);
}

void steplog_flush(void) {
    if (!log_file)
        return;
    pthread_mutex_lock(&log_lock);
    fflush(log_file);
    pthread_mutex_unlock(&log_lock);
}

/* ---- activity log ---- */

static FILE *actlog_file;
static pthread_mutex_t actlog_lock = PTHREAD_MUTEX_INITIALIZER;

int actlog_open(const char *path) {
    actlog_file = fopen(path, "w");
    return actlog_file ? 0 : -1;
}

static void put_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

static void put_opt(FILE *f, const char *key, int64_t v) {
    if (v >= 0)
        fprintf(f, ",\"%s\":%lld", key, (long long)v);
}

/* Called from the activity library's completion callback, which may run on
 * any thread (the one flushing, or the one that filled the buffer). */
void actlog_write(const struct sim_activity *a) {
    if (!actlog_file)
        return;
    pthread_mutex_lock(&actlog_lock);
    fprintf(actlog_file, "{\"kind\":\"%s\",\"raw_kind\":%u,\"start\":%llu,\"end\":%llu", a->kind,
            a->raw_kind, (unsigned long long)a->start, (unsigned long long)a->end);
    put_opt(actlog_file, "device", a->device);
    put_opt(actlog_file, "stream", a->stream);
    put_opt(actlog_file, "correlation", a->correlation);
    put_opt(actlog_file, "pid", a->pid);
    put_opt(actlog_file, "tid", a->tid);
    put_opt(actlog_file, "cbid", a->cbid);
    put_opt(actlog_file, "bytes", a->bytes);
    if (a->name) {
        fputs(",\"name\":", actlog_file);
        put_json_string(actlog_file, a->name);
    }
    fputs("}\n", actlog_file);
    pthread_mutex_unlock(&actlog_lock);
}

void actlog_flush(void) {
    if (!actlog_file)
        return;
    pthread_mutex_lock(&actlog_lock);
    fflush(actlog_file);
    pthread_mutex_unlock(&actlog_lock);
}
