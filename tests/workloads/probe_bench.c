/*
 * xpuscope-probe-bench LIBCUDART [CPU]: the target of the device-probe benchmarks
 * (`cargo xtask bench probes`). It loads a CUDA runtime (a stand-in, or a
 * real one) with dlopen and answers commands on stdin, one per line, so the
 * benchmark can attach and detach probes on one live process between
 * measurements:
 *
 *   calls N   call cudaSetDevice(0) N times, timed in batches of CALL_BATCH;
 *             prints "ns_per_call MEAN LEAST": ns per call over all N, and
 *             in the least disturbed batch
 *   launches N  call the CUDA driver's cuLaunchKernel N times, straight (as
 *             cuBLAS, NCCL and Triton launch), a 0 ns kernel on the legacy
 *             stream, timed as `calls`; prints "ns_per_call MEAN LEAST"
 *             (needs libcuda.so.1 loaded with the runtime, as the stand-in
 *             runtime loads it)
 *   steps K   run K simulated training steps; prints "step_ns S1 S2 ..." (wall
 *             time per step) and then "step_cpu_ns C1 C2 ..." (the calling
 *             thread's CPU time per step, user and system: what probes and
 *             scheduler programs running in its context add, without the
 *             time it waits for the stream)
 *   quit
 *
 * With CPU, the calling (main) thread is pinned to that CPU and the
 * library's stream threads to the other CPUs, once they exist: device work
 * then runs elsewhere, as on a GPU, and the main thread does not context
 * switch at each launch. (Run with STANDIN_STREAM_POLL_US set, the stream
 * threads poll for work and launches do not wake them either.)
 *
 * A step is LAUNCHES kernel launches, one every LAUNCH_PERIOD_NS: host work
 * between them makes up the period with what a launch itself costs (a fixed
 * amount of computation calibrated at start, not a wait for a deadline, so
 * that any added cost lengthens the step), then a stream synchronize and a
 * 1 MiB allocation and free: 20 k launches per second with the calls the
 * agent's default level probes (syncs and memory). PROBE_BENCH_LAUNCH_NS in
 * the environment sets another period (10000: 100 k launches per second).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <sched.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LAUNCHES 1000
#define DEFAULT_LAUNCH_PERIOD_NS 50000

/* ns between launches in a step (PROBE_BENCH_LAUNCH_NS). */
static uint64_t launch_period_ns = DEFAULT_LAUNCH_PERIOD_NS;

typedef struct {
    unsigned x, y, z;
} dim3;

typedef int (*set_device_fn)(int);
typedef int (*launch_fn)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*sync_fn)(void *);
typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);

typedef int (*cu_module_load_fn)(void **, const void *);
typedef int (*cu_get_function_fn)(void **, void *, const char *);
typedef int (*cu_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, void *, void **, void **);

static set_device_fn set_device;
static cu_launch_fn cu_launch;
static void *cu_function;
static launch_fn launch_kernel;
static sync_fn stream_sync;
static malloc_fn dev_malloc;
static free_fn dev_free;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static volatile uint64_t sink;

/* Host work: `iters` rounds of dependent arithmetic. */
static void host_work(uint64_t iters)
{
    uint64_t x = sink + 1;
    for (uint64_t i = 0; i < iters; i++)
        x = x * 6364136223846793005u + 1442695040888963407u;
    sink = x;
}

/* Rounds of host_work() that take about `ns` (best of a few tries). */
static uint64_t calibrate(uint64_t ns)
{
    uint64_t iters = 1u << 20, best = UINT64_MAX;
    for (int i = 0; i < 5; i++) {
        uint64_t t0 = now_ns();
        host_work(iters);
        uint64_t dt = now_ns() - t0;
        if (dt < best)
            best = dt;
    }
    return iters * ns / (best ? best : 1);
}

/* Pins this thread to `cpu` and every other thread of the process to the
 * remaining CPUs. */
static void pin_device_elsewhere(int cpu)
{
    cpu_set_t mine, others;
    CPU_ZERO(&mine);
    CPU_SET(cpu, &mine);
    if (sched_getaffinity(0, sizeof others, &others) != 0) {
        perror("probe-bench: sched_getaffinity");
        exit(2);
    }
    CPU_CLR(cpu, &others);
    if (sched_setaffinity(0, sizeof mine, &mine) != 0) {
        perror("probe-bench: sched_setaffinity");
        exit(2);
    }
    if (CPU_COUNT(&others) == 0)
        return;
    pid_t self = gettid();
    DIR *d = opendir("/proc/self/task");
    if (!d) {
        perror("probe-bench: /proc/self/task");
        exit(2);
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        pid_t tid = (pid_t)atoi(e->d_name);
        if (tid > 0 && tid != self && sched_setaffinity(tid, sizeof others, &others) != 0) {
            perror("probe-bench: sched_setaffinity (stream thread)");
            exit(2);
        }
    }
    closedir(d);
}

static void *must_sym(void *lib, const char *name)
{
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "probe-bench: %s: %s\n", name, dlerror());
        exit(2);
    }
    return f;
}

/* Calls per timed batch in `calls`: long enough (~10-30 ms traced) to
 * dwarf the clock reads, short enough that most batches see no
 * interference from the rest of a shared VM. */
#define CALL_BATCH 10000

static void calls(uint64_t n)
{
    double least = 0;
    uint64_t total = 0;
    for (uint64_t done = 0; done < n;) {
        uint64_t batch = n - done < CALL_BATCH ? n - done : CALL_BATCH;
        uint64_t t0 = now_ns();
        for (uint64_t i = 0; i < batch; i++)
            set_device(0);
        uint64_t dt = now_ns() - t0;
        double per_call = (double)dt / (double)batch;
        if (done == 0 || per_call < least)
            least = per_call;
        total += dt;
        done += batch;
    }
    printf("ns_per_call %.2f %.2f\n", (double)total / (double)n, least);
    fflush(stdout);
}

/* The driver's launch and a kernel handle, from the libcuda.so.1 the runtime
 * loaded; 0 when it has none. */
static int driver_init(void)
{
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!drv)
        return 0;
    cu_module_load_fn load = (cu_module_load_fn)dlsym(drv, "cuModuleLoadData");
    cu_get_function_fn get = (cu_get_function_fn)dlsym(drv, "cuModuleGetFunction");
    cu_launch = (cu_launch_fn)dlsym(drv, "cuLaunchKernel");
    void *module = NULL;
    if (!load || !get || !cu_launch || load(&module, "bench") != 0 ||
        get(&cu_function, module, "bench_driver_kernel") != 0) {
        cu_launch = NULL;
        return 0;
    }
    return 1;
}

static void launches(uint64_t n)
{
    if (!cu_launch && !driver_init()) {
        fprintf(stderr, "probe-bench: no CUDA driver (libcuda.so.1) loaded\n");
        exit(2);
    }
    double least = 0;
    uint64_t total = 0;
    for (uint64_t done = 0; done < n;) {
        uint64_t batch = n - done < CALL_BATCH ? n - done : CALL_BATCH;
        uint64_t t0 = now_ns();
        for (uint64_t i = 0; i < batch; i++)
            cu_launch(cu_function, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
        uint64_t dt = now_ns() - t0;
        double per_call = (double)dt / (double)batch;
        if (done == 0 || per_call < least)
            least = per_call;
        total += dt;
        done += batch;
    }
    printf("ns_per_call %.2f %.2f\n", (double)total / (double)n, least);
    fflush(stdout);
}

/* One training step; returns its duration in ns and stores the calling
 * thread's CPU time in `*cpu_ns` when not NULL. */
static uint64_t one_step(uint64_t gap_iters, uint64_t *cpu_ns)
{
    static char kernel;
    dim3 grid = {1, 1, 1}, block = {128, 1, 1};
    uint64_t c0 = thread_cpu_ns();
    uint64_t t0 = now_ns();
    for (int i = 0; i < LAUNCHES; i++) {
        host_work(gap_iters);
        launch_kernel(&kernel, grid, block, NULL, 0, NULL);
    }
    stream_sync(NULL);
    void *p = NULL;
    if (dev_malloc(&p, 1u << 20) == 0)
        dev_free(p);
    uint64_t wall = now_ns() - t0;
    if (cpu_ns)
        *cpu_ns = thread_cpu_ns() - c0;
    return wall;
}

static void steps(uint64_t k, uint64_t gap_iters)
{
    uint64_t *cpu = calloc(k ? k : 1, sizeof *cpu);
    if (!cpu) {
        fprintf(stderr, "probe-bench: out of memory\n");
        exit(2);
    }
    printf("step_ns");
    for (uint64_t s = 0; s < k; s++)
        printf(" %" PRIu64, one_step(gap_iters, &cpu[s]));
    printf("\nstep_cpu_ns");
    for (uint64_t s = 0; s < k; s++)
        printf(" %" PRIu64, cpu[s]);
    printf("\n");
    free(cpu);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: %s LIBCUDART [CPU]\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "probe-bench: %s\n", dlerror());
        return 2;
    }
    set_device = (set_device_fn)must_sym(lib, "cudaSetDevice");
    launch_kernel = (launch_fn)must_sym(lib, "cudaLaunchKernel");
    stream_sync = (sync_fn)must_sym(lib, "cudaStreamSynchronize");
    dev_malloc = (malloc_fn)must_sym(lib, "cudaMalloc");
    dev_free = (free_fn)must_sym(lib, "cudaFree");
    /* Host work per period: the period less what a launch costs in a step
     * (the stand-in hands it to a stream thread it may have to wake),
     * found by trial steps. */
    uint64_t iters_per_us = calibrate(1000000) / 1000;
    const char *period = getenv("PROBE_BENCH_LAUNCH_NS");
    if (period && strtoull(period, NULL, 10) >= 1000)
        launch_period_ns = strtoull(period, NULL, 10);
    uint64_t gap_ns = launch_period_ns, gap_iters = 0;
    for (int trial = 0; trial < 4; trial++) {
        gap_iters = gap_ns * iters_per_us / 1000;
        uint64_t step = one_step(gap_iters, NULL);
        int64_t over = ((int64_t)step - (int64_t)LAUNCHES * (int64_t)launch_period_ns) / LAUNCHES;
        gap_ns = (int64_t)gap_ns > over ? (uint64_t)((int64_t)gap_ns - over) : 0;
    }
    if (argc == 3)
        pin_device_elsewhere(atoi(argv[2]));
    gap_iters = gap_ns * iters_per_us / 1000;
    printf("ready\n");
    fflush(stdout);

    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        uint64_t n;
        if (sscanf(line, "calls %" SCNu64, &n) == 1)
            calls(n);
        else if (sscanf(line, "launches %" SCNu64, &n) == 1)
            launches(n);
        else if (sscanf(line, "steps %" SCNu64, &n) == 1)
            steps(n, gap_iters);
        else if (strncmp(line, "quit", 4) == 0)
            break;
        else {
            fprintf(stderr, "probe-bench: unknown command: %s", line);
            return 2;
        }
    }
    return 0;
}
