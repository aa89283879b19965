/* util.c: see util.h. */
#define _GNU_SOURCE
#include "util.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

uint64_t sd_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sd_sleep_until(uint64_t deadline_ns)
{
    struct timespec ts = {(time_t)(deadline_ns / 1000000000ull), (long)(deadline_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_BOOTTIME, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

void sd_spin_until(uint64_t deadline_ns)
{
    while (sd_now_ns() < deadline_ns) {
        __builtin_ia32_pause();
    }
}

uint64_t sd_env_u64(const char *name, uint64_t def)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') {
        return def;
    }
    char *end = NULL;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno != 0 || end == v) {
        return def;
    }
    return x;
}

int64_t sd_env_i64(const char *name, int64_t def)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') {
        return def;
    }
    char *end = NULL;
    errno = 0;
    long long x = strtoll(v, &end, 0);
    if (errno != 0 || end == v) {
        return def;
    }
    return x;
}

double sd_env_double(const char *name, double def)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') {
        return def;
    }
    char *end = NULL;
    double x = strtod(v, &end);
    if (end == v) {
        return def;
    }
    return x;
}

uint32_t sd_gettid(void)
{
    return (uint32_t)syscall(SYS_gettid);
}

void *sd_lookup(const char *sym, const char *lib, int load)
{
    void *fn = dlsym(RTLD_DEFAULT, sym);
    if (fn != NULL || lib == NULL) {
        return fn;
    }
    void *handle = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
    if (handle == NULL && load) {
        handle = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
    }
    if (handle == NULL) {
        return NULL;
    }
    /* The handle stays open: the library is used for the rest of the run. */
    return dlsym(handle, sym);
}

void *sd_hook_get(struct sd_hook *hook)
{
    void *fn = __atomic_load_n(&hook->fn, __ATOMIC_ACQUIRE);
    if (fn != NULL) {
        return fn;
    }
    uint64_t now = sd_now_ns();
    if (now < __atomic_load_n(&hook->next_try_ns, __ATOMIC_RELAXED)) {
        return NULL;
    }
    fn = sd_lookup(hook->sym, hook->lib, 0);
    if (fn != NULL) {
        __atomic_store_n(&hook->fn, fn, __ATOMIC_RELEASE);
    } else {
        __atomic_store_n(&hook->next_try_ns, now + 100000000ull, __ATOMIC_RELAXED);
    }
    return fn;
}

/* A small open hash set of strings that are never freed. */
static pthread_mutex_t intern_mu = PTHREAD_MUTEX_INITIALIZER;
static const char **intern_slots;
static size_t intern_cap, intern_len;

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    }
    return h;
}

const char *sd_intern(const char *s)
{
    if (s == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&intern_mu);
    if ((intern_len + 1) * 2 > intern_cap) {
        size_t cap = intern_cap ? intern_cap * 2 : 256;
        const char **slots = calloc(cap, sizeof(*slots));
        if (slots == NULL) {
            pthread_mutex_unlock(&intern_mu);
            return "<out of memory>";
        }
        for (size_t i = 0; i < intern_cap; i++) {
            if (intern_slots[i] != NULL) {
                size_t j = hash_str(intern_slots[i]) & (cap - 1);
                while (slots[j] != NULL) {
                    j = (j + 1) & (cap - 1);
                }
                slots[j] = intern_slots[i];
            }
        }
        free(intern_slots);
        intern_slots = slots;
        intern_cap = cap;
    }
    size_t j = hash_str(s) & (intern_cap - 1);
    while (intern_slots[j] != NULL) {
        if (strcmp(intern_slots[j], s) == 0) {
            const char *found = intern_slots[j];
            pthread_mutex_unlock(&intern_mu);
            return found;
        }
        j = (j + 1) & (intern_cap - 1);
    }
    const char *copy = strdup(s);
    if (copy == NULL) {
        pthread_mutex_unlock(&intern_mu);
        return "<out of memory>";
    }
    intern_slots[j] = copy;
    intern_len++;
    pthread_mutex_unlock(&intern_mu);
    return copy;
}

int64_t sd_injected_malloc_error(void)
{
    return sd_env_i64("STANDIN_MALLOC_ERROR", 0);
}
