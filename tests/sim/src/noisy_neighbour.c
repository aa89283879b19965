/* A noisy neighbour: THREADS threads named "noisy" spinning on one CPU for
 * DURATION_MS (0 = until killed), to steal CPU time from the rank pinned there;
 * CPU -1 keeps the CPUs it was started on (a hog of every CPU of the job).
 * usage: noisy_neighbour CPU THREADS DURATION_MS */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long duration_ms;

static double elapsed_ms(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

static __attribute__((noinline)) void *spin(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "noisy");
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    volatile unsigned long x = 1;
    for (;;) {
        for (int i = 0; i < 100000; i++)
            x = x * 2862933555777941757ul + 3037000493ul;
        if (duration_ms > 0 && elapsed_ms(&t0) >= (double)duration_ms)
            return NULL;
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: noisy_neighbour CPU THREADS DURATION_MS\n");
        return 2;
    }
    int cpu = atoi(argv[1]), threads = atoi(argv[2]);
    duration_ms = atol(argv[3]);
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (cpu >= 0 && sched_setaffinity(0, sizeof set, &set) != 0) {
        perror("sched_setaffinity");
        return 1;
    }
    if (threads < 1)
        threads = 1;
    pthread_t *t = calloc((size_t)threads, sizeof *t);
    for (int i = 1; i < threads; i++)
        pthread_create(&t[i], NULL, spin, NULL);
    spin(NULL);
    return 0;
}
