/* One rank of the simulated training job.
 *
 * Per step: take a batch from the dataloader thread, copy it to the device,
 * some host-side dispatch work, forward (PP recv, kernels, TP all-gather, PP
 * send per microbatch), backward (the reverse, TP reduce-scatter), gradient
 * all-reduce over the DP communicator on the comm stream, optimizer kernels,
 * then one JSON line with the step's times. Faults are injected here (slow
 * compute, hang, late arrival, leak, crash) and in the dataloader (stall).
 *
 * The loop's functions (train_step, forward, backward, allreduce_gradients,
 * optimizer_step, the fault sites) are noinline and exported (-rdynamic) so
 * stacks name them and tests can place uprobes on them. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "device.h"
#include "sim.h"

/* Kernel entry points: distinct host functions, one per kernel name. */
#define SIM_KERNEL_ENTRY(fn)                                                                      \
    SIM_NOINLINE void fn(void) { __asm__ volatile("" ::: "memory"); }
SIM_KERNEL_ENTRY(sim_kernel_embedding_fwd)
SIM_KERNEL_ENTRY(sim_kernel_attention_fwd)
SIM_KERNEL_ENTRY(sim_kernel_mlp_fwd)
SIM_KERNEL_ENTRY(sim_kernel_attention_bwd)
SIM_KERNEL_ENTRY(sim_kernel_mlp_bwd)
SIM_KERNEL_ENTRY(sim_kernel_adam)
SIM_KERNEL_ENTRY(sim_kernel_grad_scale)

static struct sim_kernel fwd_kernels[] = {
    {"embedding_fwd", sim_kernel_embedding_fwd, NULL},
    {"attention_fwd", sim_kernel_attention_fwd, NULL},
    {"mlp_fwd", sim_kernel_mlp_fwd, NULL},
};
static struct sim_kernel bwd_kernels[] = {
    {"mlp_bwd", sim_kernel_mlp_bwd, NULL},
    {"attention_bwd", sim_kernel_attention_bwd, NULL},
};
static struct sim_kernel opt_kernels[] = {
    {"grad_scale", sim_kernel_grad_scale, NULL},
    {"adam", sim_kernel_adam, NULL},
};

#ifdef SIM_FLAVOR_ASCEND
/* Kernels of operator libraries that launch through the CANN runtime, not
 * AscendCL: a matmul whose stub the library registers and launches
 * (rtFunctionRegister + rtKernelLaunch) and a fused Adam found again by
 * name (rtGetFunctionByName) and launched with its arguments in an
 * rtArgsEx_t (rtKernelLaunchWithFlag). No graphs. */
static struct sim_driver_kernel driver_kernels[] = {
    {"sim_tbe_matmul", 0, 0, NULL},
    {"sim_tbe_fused_adam", 1, 1, NULL},
};
#else
/* Kernels of libraries that launch through the driver, not the runtime: a
 * cuBLAS GEMM (cuModuleGetFunction + cuLaunchKernel) and a Triton kernel
 * (cuLibraryGetKernel + cuKernelGetFunction + cuLaunchKernelEx); and the
 * nodes of a CUDA graph launched whole (cuGraphLaunch). */
static struct sim_driver_kernel driver_kernels[] = {
    {"sim_cublas_gemm", 0, 0, NULL},
    {"sim_triton_fused_adam", 1, 1, NULL},
};
static struct sim_driver_kernel graph_nodes[] = {
    {"sim_graph_rmsnorm", 0, 0, NULL},
    {"sim_graph_rotary", 0, 0, NULL},
};
#endif
/* Most pages of the expandable segment. */
#define SEGMENT_PAGES 64

/* The rank's state: configuration, streams, communicators, buffers. */
static struct {
    struct sim_config cfg;
    void *compute, *comm_stream;
    struct sim_comm comms[SIM_MAX_COMMS];
    int ncomms;
    struct sim_comm *dp, *tp, *pp_prev, *pp_next;
    void *params, *grads, *input, *act, *act_grad, *tp_gather;
    size_t grad_count, act_count;
    uint64_t mem_bytes;
    void **leaked;
    size_t nleaked, leaked_cap;
    long step;
    uint64_t step_kernel_ns;
    /* Launches this step: through the runtime, straight through the
     * driver, graphs. */
    uint64_t step_runtime_launches, step_driver_launches, step_graph_launches;
    void *graph_exec;
    /* The expandable segment: reserved range, page size, mapped pages. */
    uint64_t seg_base;
    size_t seg_page;
    int seg_pages;
    uint64_t seg_handles[SEGMENT_PAGES];
    int hang_inside_logged;
} R;

static uint64_t now(void) { return sim_boot_ns(); }

static void check(int err, const char *what) {
    if (err == 0 || R.cfg.tolerate_errors)
        return;
    fprintf(stderr, "sim rank %d: %s failed at step %ld: %d (%s)\n", R.cfg.rank, what, R.step,
            err, dev_strerror(err));
    steplog_printf("{\"event\":\"error\",\"what\":\"%s\",\"status\":%d,\"step\":%ld}", what, err,
                   R.step);
    exit(1);
}

static void log_fault(const char *kind, const char *extra) {
    steplog_printf("{\"event\":\"fault\",\"kind\":\"%s\",\"step\":%ld%s,\"boot_ns\":%llu,"
                   "\"real_ns\":%llu}",
                   kind, R.step, extra, (unsigned long long)sim_boot_ns(),
                   (unsigned long long)sim_real_ns());
}

/* ---- faults ---- */

/* A rank that stops issuing work: stuck in host code before a collective, so
 * its peers wait inside that collective forever. */
SIM_NOINLINE void stuck_before_collective(void) {
    for (;;)
        pause();
}

/* A rank that arrives late at a collective (e.g. a slow host-side step). */
SIM_NOINLINE void late_before_collective(long ms) {
    sim_sleep_ns((uint64_t)ms * 1000000ull);
}

SIM_NOINLINE void crash_now(int sig) {
    prctl(PR_SET_DUMPABLE, 0); /* no core file from an injected crash */
    raise(sig);
    abort();
}

/* Called before every operation on a communicator; `seq` is the operation's
 * 0-based index on that communicator (the stand-ins number collectives the
 * same way, and no communicator here mixes collectives with send/recv). */
static void before_collective(struct sim_comm *c, const char *op, int grad_sync) {
    const struct sim_faults *f = &R.cfg.faults;
    uint64_t seq = c->seq++;
    char extra[256];
    snprintf(extra, sizeof extra, ",\"comm\":\"%s\",\"seq\":%llu,\"op\":\"%s\"", c->name,
             (unsigned long long)seq, op);
    int delay = (f->delay_seq >= 0 && seq == (uint64_t)f->delay_seq &&
                 !strcmp(c->name, f->delay_comm)) ||
                (grad_sync && f->delay_step == R.step);
    if (delay && f->delay_ms > 0) {
        char e2[300];
        snprintf(e2, sizeof e2, "%s,\"ms\":%ld", extra, f->delay_ms);
        log_fault("delay", e2);
        late_before_collective(f->delay_ms);
    }
    int hang = (f->hang_seq >= 0 && seq == (uint64_t)f->hang_seq &&
                !strcmp(c->name, f->hang_comm)) ||
               (grad_sync && f->hang_step == R.step);
    if (hang) {
        log_fault("hang", extra);
        stuck_before_collective();
    }
    /* STANDIN_*_HANG_AT_SEQ blocks inside the first collective (not send/recv)
     * reaching that index; say which one it is. */
    if (f->hang_inside_seq >= 0 && seq == (uint64_t)f->hang_inside_seq &&
        strcmp(c->kind, "pp") != 0 && !R.hang_inside_logged) {
        R.hang_inside_logged = 1;
        log_fault("hang_inside", extra);
    }
}

static uint64_t kernel_time(uint64_t base_ns) {
    const struct sim_faults *f = &R.cfg.faults;
    if (f->slow_from_step >= 0 && R.step >= f->slow_from_step)
        base_ns = (uint64_t)((double)base_ns * f->slow_factor);
    /* A GPU at a lower clock runs the same kernel longer, in proportion. */
    if (f->throttle_from_step >= 0 && R.step >= f->throttle_from_step)
        base_ns = base_ns * SIM_GPU_MAX_MHZ / (uint64_t)f->throttle_mhz;
    return base_ns;
}

static void launch(struct sim_kernel *k, uint64_t base_ns) {
    uint64_t ns = kernel_time(base_ns);
    R.step_kernel_ns += ns;
    check(dev_launch(k, ns, R.compute), "kernel launch");
    R.step_runtime_launches++;
}

/* Library kernels launched through the driver (the CANN runtime on
 * Ascend), and the graph (NVIDIA). */
SIM_NOINLINE void library_kernels(uint64_t base_ns) {
    uint64_t ns = kernel_time(base_ns);
    for (size_t i = 0; i < sizeof driver_kernels / sizeof driver_kernels[0]; i++) {
        check(dev_driver_launch(&driver_kernels[i], ns, R.compute), "driver launch");
        R.step_driver_launches++;
        R.step_kernel_ns += ns;
    }
#ifndef SIM_FLAVOR_ASCEND
    int nodes = (int)(sizeof graph_nodes / sizeof graph_nodes[0]);
    check(dev_graph_launch(&R.graph_exec, graph_nodes, nodes, ns, R.compute), "graph launch");
    R.step_graph_launches++;
    R.step_kernel_ns += (uint64_t)nodes * ns;
#endif
}

/* The expandable segment grows to `pages` mapped pages, one page at a time. */
SIM_NOINLINE void grow_segment(int pages) {
    if (pages > SEGMENT_PAGES)
        pages = SEGMENT_PAGES;
    while (R.seg_pages < pages) {
        uint64_t addr = R.seg_base + (uint64_t)R.seg_pages * R.seg_page;
        check(dev_segment_map(addr, R.seg_page, &R.seg_handles[R.seg_pages]), "segment map");
        R.seg_pages++;
        R.mem_bytes += R.seg_page;
    }
}

/* ... and shrinks to `pages`: its top pages unmapped in one call, then
 * released. */
SIM_NOINLINE void shrink_segment(int pages) {
    if (R.seg_pages <= pages)
        return;
    int n = R.seg_pages - pages;
    uint64_t addr = R.seg_base + (uint64_t)pages * R.seg_page;
    check(dev_segment_unmap(addr, (size_t)n * R.seg_page, &R.seg_handles[pages], n),
          "segment unmap");
    R.seg_pages = pages;
    R.mem_bytes -= (uint64_t)n * R.seg_page;
}

static int device_alloc(void **p, size_t bytes, const char *what) {
    int err = dev_malloc(p, bytes);
    if (err == 0)
        R.mem_bytes += bytes;
    else if (!R.cfg.tolerate_errors && !dev_is_oom(err))
        check(err, what);
    return err;
}

/* The leak: an activation cache that grows every step and is never freed. */
SIM_NOINLINE void cache_activations(void) {
    const struct sim_faults *f = &R.cfg.faults;
    if (f->leak_from_step < 0 || R.step < f->leak_from_step)
        return;
    if (R.step == f->leak_from_step)
        log_fault("mem_leak", "");
    size_t bytes = (size_t)f->leak_mb << 20;
    void *p = NULL;
    int err = device_alloc(&p, bytes, "leak alloc");
    if (err && dev_is_oom(err)) {
        fprintf(stderr,
                "sim rank %d: out of memory at step %ld: tried to allocate %zu bytes with "
                "%llu bytes in use (%s)\n",
                R.cfg.rank, R.step, bytes, (unsigned long long)R.mem_bytes, dev_strerror(err));
        steplog_printf("{\"event\":\"oom\",\"step\":%ld,\"request_bytes\":%zu,"
                       "\"in_use_bytes\":%llu,\"status\":%d,\"boot_ns\":%llu,\"real_ns\":%llu}",
                       R.step, bytes, (unsigned long long)R.mem_bytes, err,
                       (unsigned long long)sim_boot_ns(), (unsigned long long)sim_real_ns());
        exit(1);
    }
    if (R.nleaked == R.leaked_cap) {
        R.leaked_cap = R.leaked_cap ? 2 * R.leaked_cap : 64;
        R.leaked = realloc(R.leaked, R.leaked_cap * sizeof *R.leaked);
        if (!R.leaked)
            abort();
    }
    R.leaked[R.nleaked++] = p;
}

/* The device fails (a lost device, a sticky error): the step's workspace
 * allocation returns the fault's status, which is not out of memory, and
 * the rank gives up as a framework's error check would. */
SIM_NOINLINE void lose_device(void) {
    void *p = NULL;
    size_t bytes = 64u << 20;
    int err = dev_malloc(&p, bytes);
    if (err == 0)
        return;
    fprintf(stderr, "sim rank %d: device error at step %ld: %s (%d)\n", R.cfg.rank, R.step,
            dev_strerror(err), err);
    steplog_printf("{\"event\":\"device_error\",\"step\":%ld,\"status\":%d,\"boot_ns\":%llu,"
                   "\"real_ns\":%llu}",
                   R.step, err, (unsigned long long)sim_boot_ns(), (unsigned long long)sim_real_ns());
    exit(1);
}

/* ---- the training step ---- */

SIM_NOINLINE void forward(void) {
    uint64_t k_ns = (uint64_t)R.cfg.kernel_us * 1000u;
    cache_activations();
    /* Activations: a page per microbatch, and more on some steps. */
    if (R.cfg.expandable_segments)
        grow_segment(R.cfg.microbatches + (int)(R.step % 3));
    for (int mb = 0; mb < R.cfg.microbatches; mb++) {
        if (R.pp_prev) {
            before_collective(R.pp_prev, "recv", 0);
            check(dev_recv(R.act, R.act_count, 0, R.pp_prev->handle, R.comm_stream), "pp recv");
            check(dev_stream_sync(R.comm_stream), "comm stream sync");
        }
        for (int l = 0; l < R.cfg.layers; l++)
            launch(&fwd_kernels[l % 3], k_ns);
        if (R.tp) {
            before_collective(R.tp, "all_gather", 0);
            check(dev_allgather(R.act, R.tp_gather, R.act_count, R.tp->handle, R.compute),
                  "tp all-gather");
        }
        if (R.pp_next) {
            check(dev_stream_sync(R.compute), "compute stream sync");
            before_collective(R.pp_next, "send", 0);
            check(dev_send(R.act, R.act_count, 1, R.pp_next->handle, R.comm_stream), "pp send");
        }
    }
    check(dev_stream_sync(R.compute), "compute stream sync");
    check(dev_stream_sync(R.comm_stream), "comm stream sync");
}

SIM_NOINLINE void backward(void) {
    uint64_t k_ns = 2u * (uint64_t)R.cfg.kernel_us * 1000u;
    for (int mb = R.cfg.microbatches - 1; mb >= 0; mb--) {
        if (R.pp_next) {
            before_collective(R.pp_next, "recv", 0);
            check(dev_recv(R.act_grad, R.act_count, 1, R.pp_next->handle, R.comm_stream),
                  "pp recv");
            check(dev_stream_sync(R.comm_stream), "comm stream sync");
        }
        for (int l = 0; l < R.cfg.layers; l++)
            launch(&bwd_kernels[l % 2], k_ns);
        if (R.tp) {
            before_collective(R.tp, "reduce_scatter", 0);
            check(dev_reducescatter(R.tp_gather, R.act_grad, R.act_count, R.tp->handle,
                                    R.compute),
                  "tp reduce-scatter");
        }
        if (R.pp_prev) {
            check(dev_stream_sync(R.compute), "compute stream sync");
            before_collective(R.pp_prev, "send", 0);
            check(dev_send(R.act_grad, R.act_count, 0, R.pp_prev->handle, R.comm_stream),
                  "pp send");
        }
    }
    check(dev_stream_sync(R.compute), "compute stream sync");
    check(dev_stream_sync(R.comm_stream), "comm stream sync");
}

/* Data-parallel gradient all-reduce on the comm stream, as DDP does. */
SIM_NOINLINE void allreduce_gradients(void) {
    const struct sim_faults *f = &R.cfg.faults;
    if (!R.dp) {
        /* No DP peers: the step-based hang/delay still happen at this point. */
        if (f->delay_step == R.step && f->delay_ms > 0) {
            log_fault("delay", "");
            late_before_collective(f->delay_ms);
        }
        if (f->hang_step == R.step) {
            log_fault("hang", "");
            stuck_before_collective();
        }
        return;
    }
    before_collective(R.dp, "all_reduce", 1);
    check(dev_allreduce(R.grads, R.grad_count, R.dp->handle, R.comm_stream), "dp all-reduce");
    check(dev_stream_sync(R.comm_stream), "comm stream sync");
}

SIM_NOINLINE void optimizer_step(void) {
    uint64_t k_ns = (uint64_t)R.cfg.opt_kernel_us * 1000u;
    for (int i = 0; i < R.cfg.opt_kernels; i++)
        launch(&opt_kernels[i % 2], k_ns);
    if (R.cfg.driver_launches)
        library_kernels(k_ns);
    check(dev_stream_sync(R.compute), "compute stream sync");
    /* The allocator gives memory back: the segment shrinks. */
    if (R.cfg.expandable_segments)
        shrink_segment((int)(R.step % 2));
}

/* Host-side work of the step: graph dispatch, Python overhead; more of
 * it from the host_work fault's step on (a rank turned host-bound). */
SIM_NOINLINE void dispatch_host_work(void) {
    const struct sim_faults *f = &R.cfg.faults;
    long us = R.cfg.host_us;
    if (f->host_work_from_step >= 0 && R.step >= f->host_work_from_step)
        us += f->host_work_ms * 1000;
    sim_cpu_work_us(us);
}

SIM_NOINLINE void train_step(void) {
    const struct sim_faults *f = &R.cfg.faults;
    uint64_t t0 = now(), real0 = sim_real_ns();
    R.step_kernel_ns = 0;
    R.step_runtime_launches = R.step_driver_launches = R.step_graph_launches = 0;
    steplog_printf("{\"event\":\"step_begin\",\"step\":%ld,\"boot_ns\":%llu}", R.step,
                   (unsigned long long)t0);
    if (R.step == f->crash_step) {
        char extra[32];
        snprintf(extra, sizeof extra, ",\"signal\":%d", f->crash_signal);
        log_fault("crash", extra);
        crash_now(f->crash_signal);
    }
    if (R.step == f->device_error_step) {
        char code[24];
        snprintf(code, sizeof code, "%ld", f->device_error_code);
        setenv("STANDIN_MALLOC_ERROR", code, 1);
        log_fault("device_error", "");
        lose_device();
    }
    if (R.step == f->host_work_from_step) {
        char extra[48];
        snprintf(extra, sizeof extra, ",\"ms\":%ld", f->host_work_ms);
        log_fault("host_work", extra);
    }
    if (R.step == f->throttle_from_step) {
        char extra[48];
        snprintf(extra, sizeof extra, ",\"mhz\":%ld", f->throttle_mhz);
        gpu_state_throttle((unsigned int)f->throttle_mhz);
        log_fault("throttle", extra);
    }
    if (R.step == f->xid_step) {
        char extra[48];
        snprintf(extra, sizeof extra, ",\"code\":%ld", f->xid_code);
        gpu_state_xid((unsigned int)f->xid_code);
        log_fault("xid", extra);
    }
    if (R.step == f->slow_from_step) {
        char extra[48];
        snprintf(extra, sizeof extra, ",\"factor\":%g", f->slow_factor);
        log_fault("slow", extra);
    }

    char range_name[32];
    snprintf(range_name, sizeof range_name, "step %ld", R.step);
    uint64_t range = dev_range_start(range_name);
    struct sim_batch *batch = dataloader_next();
    uint64_t t_data = now();
    check(dev_memcpy_h2d(R.input, batch->data, batch->bytes, R.compute), "h2d copy");
    dispatch_host_work();
    uint64_t t_host = now();
    forward();
    uint64_t t_fwd = now();
    backward();
    uint64_t t_bwd = now();
    allreduce_gradients();
    uint64_t t_sync = now();
    optimizer_step();
    uint64_t t1 = now();
    dev_range_end(range);
    dataloader_release(batch);
    uint64_t records = dev_activity_drain();
    actlog_flush();
    steplog_printf(
        "{\"event\":\"step\",\"rank\":%d,\"step\":%ld,\"start_boot_ns\":%llu,"
        "\"end_boot_ns\":%llu,\"start_real_ns\":%llu,\"dur_ns\":%llu,\"data_wait_ns\":%llu,"
        "\"host_ns\":%llu,\"fwd_ns\":%llu,\"bwd_ns\":%llu,\"grad_sync_ns\":%llu,"
        "\"opt_ns\":%llu,\"kernel_ns\":%llu,\"mem_bytes\":%llu,\"activity_records\":%llu,"
        "\"segment_bytes\":%llu,\"runtime_launches\":%llu,\"driver_launches\":%llu,"
        "\"graph_launches\":%llu}",
        R.cfg.rank, R.step, (unsigned long long)t0, (unsigned long long)t1,
        (unsigned long long)real0, (unsigned long long)(t1 - t0),
        (unsigned long long)(t_data - t0), (unsigned long long)(t_host - t_data),
        (unsigned long long)(t_fwd - t_host), (unsigned long long)(t_bwd - t_fwd),
        (unsigned long long)(t_sync - t_bwd), (unsigned long long)(t1 - t_sync),
        (unsigned long long)R.step_kernel_ns, (unsigned long long)R.mem_bytes,
        (unsigned long long)records, (unsigned long long)R.seg_pages * R.seg_page,
        (unsigned long long)R.step_runtime_launches, (unsigned long long)R.step_driver_launches,
        (unsigned long long)R.step_graph_launches);
}

/* ---- set-up ---- */

static void register_kernels(void) {
    struct {
        struct sim_kernel *k;
        size_t n;
    } tables[] = {{fwd_kernels, sizeof fwd_kernels / sizeof fwd_kernels[0]},
                  {bwd_kernels, sizeof bwd_kernels / sizeof bwd_kernels[0]},
                  {opt_kernels, sizeof opt_kernels / sizeof opt_kernels[0]}};
    for (size_t t = 0; t < sizeof tables / sizeof tables[0]; t++)
        for (size_t i = 0; i < tables[t].n; i++)
            check(dev_register_kernel(&tables[t].k[i], !R.cfg.tolerate_errors), "register kernel");
}

static void find_comms(void) {
    for (int i = 0; i < R.ncomms; i++) {
        struct sim_comm *c = &R.comms[i];
        if (!strcmp(c->kind, "dp"))
            R.dp = c;
        else if (!strcmp(c->kind, "tp"))
            R.tp = c;
        else if (!strcmp(c->kind, "pp") && c->size == 2)
            *(c->rank == 0 ? &R.pp_next : &R.pp_prev) = c; /* comm rank 0 = earlier stage */
    }
}

static void allocate_buffers(void) {
    R.grad_count = ((size_t)R.cfg.grad_mb << 20) / sizeof(float);
    R.act_count = ((size_t)R.cfg.act_kb << 10) / sizeof(float);
    size_t tp = R.tp ? (size_t)R.tp->size : 1;
    struct {
        void **p;
        size_t bytes;
        const char *what;
    } bufs[] = {
        {&R.params, R.grad_count * sizeof(float), "alloc params"},
        {&R.grads, R.grad_count * sizeof(float), "alloc grads"},
        {&R.input, 64u * 1024u, "alloc input"},
        {&R.act, R.act_count * sizeof(float), "alloc activations"},
        {&R.act_grad, R.act_count * sizeof(float), "alloc activation grads"},
        {&R.tp_gather, R.act_count * tp * sizeof(float), "alloc tp buffer"},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        int err = device_alloc(bufs[i].p, bufs[i].bytes, bufs[i].what);
        if (err && !R.cfg.tolerate_errors) {
            fprintf(stderr, "sim rank %d: out of memory at start-up (%s)\n", R.cfg.rank,
                    bufs[i].what);
            exit(1);
        }
    }
    /* An expandable segment reserves address space only: nothing mapped. */
    if (R.cfg.expandable_segments) {
        check(dev_segment_page_size(&R.seg_page), "segment granularity");
        check(dev_segment_reserve(&R.seg_base, SEGMENT_PAGES * R.seg_page), "segment reserve");
    }
}

/* DDP broadcasts the initial parameters from DP rank 0. */
SIM_NOINLINE void broadcast_parameters(void) {
    if (!R.dp)
        return;
    before_collective(R.dp, "broadcast", 0);
    check(dev_broadcast(R.params, R.grad_count, 0, R.dp->handle, R.comm_stream), "broadcast");
    check(dev_stream_sync(R.comm_stream), "comm stream sync");
}

static void wait_for_start(void) {
    steplog_printf("{\"event\":\"ready\",\"rank\":%d,\"pid\":%d,\"flavor\":\"%s\","
                   "\"mem_bytes\":%llu,\"boot_ns\":%llu,\"real_ns\":%llu}",
                   R.cfg.rank, (int)getpid(), dev_flavor(), (unsigned long long)R.mem_bytes,
                   (unsigned long long)sim_boot_ns(), (unsigned long long)sim_real_ns());
    if (R.cfg.start_delay_ms > 0)
        sim_sleep_ns((uint64_t)R.cfg.start_delay_ms * 1000000ull);
    struct stat st;
    while (R.cfg.start_gate && stat(R.cfg.start_gate, &st) != 0)
        sim_sleep_ns(10000000);
    steplog_printf("{\"event\":\"start\",\"boot_ns\":%llu,\"real_ns\":%llu}",
                   (unsigned long long)sim_boot_ns(), (unsigned long long)sim_real_ns());
}

int main(int argc, char **argv) {
    setvbuf(stderr, NULL, _IOLBF, 0);
    if (sim_parse_args(&R.cfg, argc, argv))
        return 2;
    if (steplog_open(R.cfg.step_log, R.cfg.rank)) {
        perror(R.cfg.step_log);
        return 2;
    }
    R.step = -1;
    steplog_printf("{\"event\":\"init\",\"rank\":%d,\"local_rank\":%d,\"world_size\":%d,"
                   "\"pid\":%d,\"flavor\":\"%s\",\"lang\":\"c\",\"boot_ns\":%llu,"
                   "\"real_ns\":%llu}",
                   R.cfg.rank, R.cfg.local_rank, R.cfg.world_size, (int)getpid(), dev_flavor(),
                   (unsigned long long)sim_boot_ns(), (unsigned long long)sim_real_ns());

    /* An agent attached to the launcher finds this process's libraries
     * by rescanning its maps: give it time to place its probes before the
     * communicators are set up (their identity is learnt there). */
    if (R.cfg.init_delay_ms > 0)
        sim_sleep_ns((uint64_t)R.cfg.init_delay_ms * 1000000ull);
    check(dev_init(R.cfg.local_rank), "device init");
    gpu_state_start(R.cfg.local_rank, (unsigned int)getpid());
    if (R.cfg.activity_log && actlog_open(R.cfg.activity_log)) {
        perror(R.cfg.activity_log);
        return 2;
    }
    check(dev_activity_start(R.cfg.activity_api), "activity consumer start");
    register_kernels();
    check(dev_stream_create(&R.compute), "compute stream create");
    check(dev_stream_create(&R.comm_stream), "comm stream create");
    if (R.cfg.comm_file) {
        R.ncomms = comms_load(R.cfg.comm_file, R.comms, SIM_MAX_COMMS);
        if (R.ncomms < 0)
            return 2;
        if (comms_rendezvous_init(R.comms, R.ncomms, R.cfg.rdv_dir, R.cfg.tolerate_errors))
            return 1;
        find_comms();
    }
    allocate_buffers();
    broadcast_parameters();
    if (dataloader_start(&R.cfg)) {
        fprintf(stderr, "sim rank %d: cannot start the dataloader thread\n", R.cfg.rank);
        return 1;
    }
    gpu_state_memory(R.mem_bytes);
    wait_for_start();

    for (R.step = 0; R.step < R.cfg.steps; R.step++)
        train_step();

    for (int i = 0; i < R.ncomms; i++)
        dev_comm_destroy(R.comms[i].handle);
    steplog_printf("{\"event\":\"done\",\"steps\":%ld,\"boot_ns\":%llu,\"real_ns\":%llu}",
                   R.cfg.steps, (unsigned long long)sim_boot_ns(),
                   (unsigned long long)sim_real_ns());
    gpu_state_exit();
    actlog_flush();
    steplog_flush();
    return 0;
}
