/*
 * Workloads with a known pattern, for xpuscope's end-to-end tests, demo and
 * benchmarks. One binary, one mode per first argument:
 *
 *   pattern        wait for "go" on stdin, then run the known pattern once
 *                  (~1.5 s) and print its ground truth as one JSON line:
 *                  a sleeper (known total sleep), a spinner, a holder and a
 *                  waiter on a contended mutex, a thread that renames
 *                  itself, a forked child process, and a "victim" thread
 *                  pinned to CPU 1 that spins (to be preempted by a hog).
 *   loop SECS      the same pattern, repeated for SECS seconds, no "go".
 *   pingpong N CPU two threads pinned to CPU exchange a byte over pipes N
 *                  times after "go"; prints round trips per second.
 *   hog CPU SECS   a busy loop pinned to CPU, named "cpu-hog".
 *   renamer N      after "go", renames its thread N times, then exits.
 *   threads N      after "go", starts and joins N short-lived threads one
 *                  after another (each sleeps 100 us once, then exits).
 *   dlopen LIB DELAY_MS CALLS INTERVAL_US
 *                  after "go", dlopens LIB (a CUDA runtime), waits DELAY_MS
 *                  after dlopen returned, then calls cudaSetDevice(i) for
 *                  i = 0..CALLS-1, INTERVAL_US apart; prints the CLOCK_BOOTTIME
 *                  of dlopen's return and of the first call as JSON.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static pid_t gettid_(void) { return (pid_t)syscall(SYS_gettid); }

static void pin_to(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof(set), &set);
}

static void wait_for_go(void) {
    char line[64];
    if (!fgets(line, sizeof line, stdin)) exit(3);
}

static volatile uint64_t sink;

NOINLINE static void spin_for_ns(uint64_t ns) {
    uint64_t end = now_ns() + ns;
    while (now_ns() < end) sink++;
}

/* ---- the known pattern ---- */

struct truth {
    pid_t sleeper_tid, spinner_tid, holder_tid, waiter_tid, renamed_tid, victim_tid;
    uint64_t sleep_ns;     /* time the sleeper spent inside nanosleep */
    uint64_t lock_wait_ns; /* time the waiter spent inside pthread_mutex_lock */
    pid_t child_pid;
};

static struct truth truth;
static pthread_mutex_t contended = PTHREAD_MUTEX_INITIALIZER;
static uint64_t pattern_ns = 1200000000ull;
static volatile int stop_flag;
static pthread_barrier_t start_line;

NOINLINE static void sleep_a_known_time(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    uint64_t t0 = now_ns();
    nanosleep(&ts, NULL);
    truth.sleep_ns += now_ns() - t0;
}

static void *sleeper_main(void *arg) {
    (void)arg;
    truth.sleeper_tid = gettid_();
    pthread_barrier_wait(&start_line);
    uint64_t end = now_ns() + pattern_ns;
    while (now_ns() < end) {
        sleep_a_known_time(50000000ull); /* 50 ms */
        spin_for_ns(2000000ull);         /* 2 ms on CPU */
    }
    return NULL;
}

static void *spinner_main(void *arg) {
    (void)arg;
    truth.spinner_tid = gettid_();
    pthread_barrier_wait(&start_line);
    spin_for_ns(pattern_ns / 4);
    return NULL;
}

NOINLINE static void hold_the_lock(void) {
    pthread_mutex_lock(&contended);
    struct timespec ts = {0, 20000000}; /* hold it 20 ms, asleep */
    nanosleep(&ts, NULL);
    pthread_mutex_unlock(&contended);
}

static void *holder_main(void *arg) {
    (void)arg;
    truth.holder_tid = gettid_();
    pthread_barrier_wait(&start_line);
    while (!stop_flag) {
        hold_the_lock();
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

NOINLINE static void wait_for_contended_lock(void) {
    uint64_t t0 = now_ns();
    pthread_mutex_lock(&contended);
    truth.lock_wait_ns += now_ns() - t0;
    pthread_mutex_unlock(&contended);
}

NOINLINE static void *mutex_waiter_main(void *arg) {
    (void)arg;
    truth.waiter_tid = gettid_();
    pthread_barrier_wait(&start_line);
    struct timespec ts = {0, 500000};
    nanosleep(&ts, NULL); /* let the holder take it first */
    while (!stop_flag) {
        wait_for_contended_lock();
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void *renamer_main(void *arg) {
    (void)arg;
    truth.renamed_tid = gettid_();
    prctl(PR_SET_NAME, "before-rename");
    pthread_barrier_wait(&start_line);
    struct timespec ts = {0, 100000000};
    nanosleep(&ts, NULL);
    prctl(PR_SET_NAME, "renamed-worker");
    nanosleep(&ts, NULL);
    return NULL;
}

static void *victim_main(void *arg) {
    (void)arg;
    truth.victim_tid = gettid_();
    pin_to(1 % (int)sysconf(_SC_NPROCESSORS_ONLN));
    pthread_barrier_wait(&start_line);
    spin_for_ns(pattern_ns * 3 / 4);
    return NULL;
}

NOINLINE static void child_process_main(void) {
    prctl(PR_SET_NAME, "pattern-child");
    for (int i = 0; i < 10; i++) {
        struct timespec ts = {0, 20000000};
        nanosleep(&ts, NULL);
        spin_for_ns(1000000);
    }
    _exit(0);
}

static void run_pattern(int print) {
    pthread_t threads[6];
    void *(*mains[6])(void *) = {sleeper_main, spinner_main, holder_main,
                                 mutex_waiter_main, renamer_main, victim_main};
    const char *names[6] = {"sleeper", "spinner", "lock-holder", "lock-waiter", NULL, "victim"};
    memset(&truth, 0, sizeof truth);
    stop_flag = 0;
    pthread_barrier_init(&start_line, NULL, 7);
    for (int i = 0; i < 6; i++) {
        pthread_create(&threads[i], NULL, mains[i], NULL);
        if (names[i]) pthread_setname_np(threads[i], names[i]);
    }
    pthread_barrier_wait(&start_line);
    pid_t child = fork();
    if (child == 0) child_process_main();
    truth.child_pid = child;
    struct timespec ts = {(time_t)(pattern_ns / 1000000000ull), (long)(pattern_ns % 1000000000ull)};
    nanosleep(&ts, NULL);
    stop_flag = 1;
    for (int i = 0; i < 6; i++) pthread_join(threads[i], NULL);
    waitpid(child, NULL, 0);
    pthread_barrier_destroy(&start_line);
    if (print) {
        printf("{\"pid\":%d,\"sleeper_tid\":%d,\"spinner_tid\":%d,\"holder_tid\":%d,"
               "\"waiter_tid\":%d,\"renamed_tid\":%d,\"victim_tid\":%d,\"child_pid\":%d,"
               "\"sleep_ns\":%llu,\"lock_wait_ns\":%llu}\n",
               getpid(), truth.sleeper_tid, truth.spinner_tid, truth.holder_tid,
               truth.waiter_tid, truth.renamed_tid, truth.victim_tid, truth.child_pid,
               (unsigned long long)truth.sleep_ns, (unsigned long long)truth.lock_wait_ns);
        fflush(stdout);
    }
}

/* ---- ping-pong ---- */

struct pp {
    int in, out;
    long iters;
    int cpu;
};

static void *pong_main(void *arg) {
    struct pp *p = arg;
    pin_to(p->cpu);
    char c;
    for (long i = 0; i < p->iters; i++) {
        if (read(p->in, &c, 1) != 1) break;
        if (write(p->out, &c, 1) != 1) break;
    }
    return NULL;
}

static int pingpong(long iters, int cpu) {
    int a[2], b[2];
    if (pipe(a) || pipe(b)) return 1;
    struct pp pong = {a[0], b[1], iters, cpu};
    pthread_t t;
    pthread_create(&t, NULL, pong_main, &pong);
    pthread_setname_np(t, "pong");
    prctl(PR_SET_NAME, "ping");
    pin_to(cpu);
    wait_for_go();
    char c = 'x';
    uint64_t t0 = now_ns();
    for (long i = 0; i < iters; i++) {
        if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1) return 1;
    }
    uint64_t dt = now_ns() - t0;
    pthread_join(t, NULL);
    printf("{\"iters\":%ld,\"ns\":%llu,\"ns_per_round_trip\":%.1f}\n", iters,
           (unsigned long long)dt, (double)dt / (double)iters);
    return 0;
}

static void *short_lived(void *arg) {
    (void)arg;
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
    return NULL;
}

static int thread_churn(long n) {
    wait_for_go();
    for (long i = 0; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, short_lived, NULL) != 0) return 1;
        pthread_join(t, NULL);
    }
    printf("{\"threads\":%ld}\n", n);
    return 0;
}

/* Calls into a library right after dlopen maps it: how soon its probes
 * are in place. */
static int dlopen_calls(const char *path, long delay_ms, long calls, long interval_us) {
    wait_for_go();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    uint64_t opened = now_ns();
    if (!h) {
        fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
        return 2;
    }
    int (*set_device)(int) = (int (*)(int))dlsym(h, "cudaSetDevice");
    if (!set_device) {
        fprintf(stderr, "%s has no cudaSetDevice\n", path);
        return 2;
    }
    if (delay_ms > 0) {
        struct timespec ts = {delay_ms / 1000, (delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    uint64_t first = now_ns();
    for (long i = 0; i < calls; i++) {
        set_device((int)i);
        if (interval_us > 0) {
            struct timespec ts = {interval_us / 1000000, (interval_us % 1000000) * 1000L};
            nanosleep(&ts, NULL);
        }
    }
    printf("{\"dlopen_return_ns\":%llu,\"first_call_ns\":%llu,\"calls\":%ld}\n",
           (unsigned long long)opened, (unsigned long long)first, calls);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "pattern";
    if (!strcmp(mode, "pattern")) {
        wait_for_go();
        /* This thread existed at attach; renaming it now must show. */
        prctl(PR_SET_NAME, "pattern-main");
        run_pattern(1);
        return 0;
    }
    if (!strcmp(mode, "loop")) {
        double secs = argc > 2 ? atof(argv[2]) : 30;
        uint64_t end = now_ns() + (uint64_t)(secs * 1e9);
        while (now_ns() < end) run_pattern(0);
        return 0;
    }
    if (!strcmp(mode, "pingpong")) {
        long iters = argc > 2 ? atol(argv[2]) : 100000;
        int cpu = argc > 3 ? atoi(argv[3]) : 0;
        return pingpong(iters, cpu);
    }
    if (!strcmp(mode, "hog")) {
        int cpu = argc > 2 ? atoi(argv[2]) : 1;
        double secs = argc > 3 ? atof(argv[3]) : 2;
        prctl(PR_SET_NAME, "cpu-hog");
        pin_to(cpu);
        spin_for_ns((uint64_t)(secs * 1e9));
        return 0;
    }
    if (!strcmp(mode, "renamer")) {
        long n = argc > 2 ? atol(argv[2]) : 100000;
        wait_for_go();
        char name[16];
        for (long i = 0; i < n; i++) {
            snprintf(name, sizeof name, "r%ld", i % 100000);
            prctl(PR_SET_NAME, name);
        }
        printf("{\"renames\":%ld}\n", n);
        return 0;
    }
    if (!strcmp(mode, "dlopen") && argc > 5) {
        return dlopen_calls(argv[2], atol(argv[3]), atol(argv[4]), atol(argv[5]));
    }
    if (!strcmp(mode, "threads")) {
        return thread_churn(argc > 2 ? atol(argv[2]) : 1000);
    }
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}
