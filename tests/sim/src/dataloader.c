/* The dataloader: a thread named "dataloader" that prepares batches (CPU
 * work) and hands them to the training loop through a bounded queue of
 * `prefetch` batches, as a PyTorch DataLoader with workers does. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define BATCH_BYTES (64u * 1024u)
#define QUEUE_MAX 16

static struct {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    struct sim_batch *slots[QUEUE_MAX];
    int head, count, cap;
} queue = {.lock = PTHREAD_MUTEX_INITIALIZER, .changed = PTHREAD_COND_INITIALIZER};

static const struct sim_config *config;

static void queue_push(struct sim_batch *b) {
    pthread_mutex_lock(&queue.lock);
    while (queue.count == queue.cap)
        pthread_cond_wait(&queue.changed, &queue.lock);
    queue.slots[(queue.head + queue.count) % QUEUE_MAX] = b;
    queue.count++;
    pthread_cond_broadcast(&queue.changed);
    pthread_mutex_unlock(&queue.lock);
}

/* The injected stall: slow storage, a remote filesystem hiccup. */
SIM_NOINLINE void read_shard_stalled(long index, long ms) {
    steplog_printf("{\"event\":\"fault\",\"kind\":\"dataloader_stall\",\"step\":%ld,\"ms\":%ld,"
                   "\"boot_ns\":%llu,\"real_ns\":%llu}",
                   index, ms, (unsigned long long)sim_boot_ns(),
                   (unsigned long long)sim_real_ns());
    sim_sleep_ns((uint64_t)ms * 1000000ull);
}

SIM_NOINLINE struct sim_batch *load_batch(long index) {
    const struct sim_faults *f = &config->faults;
    if (index == f->stall_step && f->stall_ms > 0)
        read_shard_stalled(index, f->stall_ms);
    struct sim_batch *b = malloc(sizeof *b);
    if (!b)
        abort();
    b->index = index;
    b->bytes = BATCH_BYTES;
    b->data = malloc(BATCH_BYTES);
    if (!b->data)
        abort();
    memset(b->data, (int)(index & 0xff), BATCH_BYTES);
    sim_cpu_work_us(config->loader_us); /* decode + augment */
    return b;
}

SIM_NOINLINE void *dataloader_main(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "dataloader");
    for (long i = 0; i < config->steps; i++)
        queue_push(load_batch(i));
    return NULL;
}

int dataloader_start(const struct sim_config *cfg) {
    config = cfg;
    queue.cap = cfg->prefetch < QUEUE_MAX ? cfg->prefetch : QUEUE_MAX;
    pthread_t t;
    int err = pthread_create(&t, NULL, dataloader_main, NULL);
    if (err)
        return err;
    pthread_detach(t);
    return 0;
}

SIM_NOINLINE struct sim_batch *dataloader_next(void) {
    pthread_mutex_lock(&queue.lock);
    while (queue.count == 0)
        pthread_cond_wait(&queue.changed, &queue.lock);
    struct sim_batch *b = queue.slots[queue.head];
    queue.head = (queue.head + 1) % QUEUE_MAX;
    queue.count--;
    pthread_cond_broadcast(&queue.changed);
    pthread_mutex_unlock(&queue.lock);
    return b;
}

void dataloader_release(struct sim_batch *b) {
    free(b->data);
    free(b);
}
