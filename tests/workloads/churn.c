/*
 * Process churn, for the bounded-state test: after "go" on stdin, forks
 * N children at an even pace over SECS seconds; each child exits at once
 * and is reaped before the next fork. Prints "done <forked> <failed>",
 * then waits for EOF on stdin (so it is still alive, and still traced,
 * when the test looks at the agent's traced set).
 *
 *   xpuscope-churn N SECS
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t) {
    uint64_t now = now_ns();
    if (t <= now) return;
    struct timespec ts = {(time_t)((t - now) / 1000000000ull), (long)((t - now) % 1000000000ull)};
    nanosleep(&ts, NULL);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CHILDREN SECONDS\n", argv[0]);
        return 2;
    }
    long n = atol(argv[1]);
    double secs = atof(argv[2]);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 3;
    uint64_t start = now_ns();
    uint64_t step = (uint64_t)(secs * 1e9 / (double)(n > 0 ? n : 1));
    long forked = 0, failed = 0;
    for (long i = 0; i < n; i++) {
        /* Batches of 10 between sleeps: fewer timer wakeups, same pace. */
        if (i % 10 == 0) sleep_until(start + (uint64_t)i * step);
        pid_t child = fork();
        if (child == 0) _exit(0);
        if (child < 0) {
            failed++;
            continue;
        }
        int status;
        if (waitpid(child, &status, 0) == child) forked++;
        else failed++;
    }
    printf("done %ld %ld\n", forked, failed);
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
    }
    return 0;
}
