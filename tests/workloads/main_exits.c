/*
 * A live process whose main thread has exited: main starts a thread and
 * calls pthread_exit, as some servers and launchers do. The process lives
 * on in that thread while /proc/PID/stat (the leader's) reads 'Z'.
 *
 *   xpuscope-main-exits SECS
 *
 * The surviving thread (named "survivor") waits until the leader shows as
 * a zombie, prints {"pid":P,"survivor_tid":T} on stdout, then sleeps 5 ms
 * and spins ~1 ms in a loop for SECS seconds and exits the process.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double secs = 5;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The state letter of /proc/self/stat (the thread group leader's). */
static char leader_state(void) {
    char buf[512];
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f) return '?';
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *close = strrchr(buf, ')');
    return close && close[1] == ' ' ? close[2] : '?';
}

static void *survivor(void *arg) {
    (void)arg;
    prctl(PR_SET_NAME, "survivor");
    for (int i = 0; i < 1000 && leader_state() != 'Z'; i++) usleep(1000);
    printf("{\"pid\":%d,\"survivor_tid\":%ld,\"leader_state\":\"%c\"}\n", getpid(),
           (long)syscall(SYS_gettid), leader_state());
    fflush(stdout);
    uint64_t end = now_ns() + (uint64_t)(secs * 1e9);
    volatile uint64_t sink = 0;
    while (now_ns() < end) {
        usleep(5000);
        uint64_t spin_end = now_ns() + 1000000;
        while (now_ns() < spin_end) sink++;
    }
    exit(0);
}

int main(int argc, char **argv) {
    if (argc > 1) secs = atof(argv[1]);
    pthread_t t;
    if (pthread_create(&t, NULL, survivor, NULL) != 0) return 1;
    pthread_exit(NULL);
}
