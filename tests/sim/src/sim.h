/* Shared declarations of the simulated training rank. */
#ifndef SIM_H
#define SIM_H

#include <stddef.h>
#include <stdint.h>

#define SIM_NOINLINE __attribute__((noinline))
#define SIM_MAX_COMMS 8
#define SIM_MAX_MEMBERS 256
#define SIM_NAME_LEN 64

/* One communicator this rank belongs to (a line of the launcher's comm file). */
struct sim_comm {
    char name[SIM_NAME_LEN]; /* e.g. "dp0", "tp3", "pp0-1.2" */
    char kind[8];            /* "dp", "tp" or "pp" */
    int size;
    int rank; /* this process's rank inside the communicator */
    int members[SIM_MAX_MEMBERS];
    void *handle; /* ncclComm_t / HcclComm */
    uint64_t seq; /* operations issued so far = 0-based seq of the next one */
};

/* Faults this rank injects into itself; a field < 0 (or empty name) = off. */
struct sim_faults {
    double slow_factor;
    long slow_from_step;
    long host_work_ms;        /* extra host CPU work per step... */
    long host_work_from_step; /* ...from this step */
    long stall_step;
    long stall_ms;
    long leak_from_step;
    long leak_mb;
    long crash_step;
    long device_error_step; /* allocations fail with device_error_code from this step */
    long device_error_code;
    int crash_signal;
    char hang_comm[SIM_NAME_LEN]; /* hang before operation hang_seq (0-based) of hang_comm */
    long hang_seq;
    long hang_inside_seq; /* STANDIN_*_HANG_AT_SEQ is set to this (logged only) */
    long hang_step; /* or before the gradient all-reduce of this step */
    char delay_comm[SIM_NAME_LEN];
    long delay_seq;
    long delay_step;
    long delay_ms;
    long throttle_mhz;       /* the GPU's SM clock drops to this... */
    long throttle_from_step; /* ...from this step (a thermal clock event) */
    long xid_code;           /* the GPU raises this Xid error... */
    long xid_step;           /* ...at the start of this step */
};

struct sim_config {
    int rank, local_rank, world_size;
    long steps;
    int microbatches;
    int layers;           /* forward kernels per microbatch */
    long kernel_us;       /* forward kernel time; backward kernels take twice */
    int opt_kernels;      /* optimizer kernels per step */
    long opt_kernel_us;
    long host_us;         /* CPU time the main thread spends per step (dispatch) */
    long loader_us;       /* CPU time the dataloader spends per batch */
    int prefetch;         /* dataloader queue depth */
    long grad_mb;         /* gradient bucket all-reduced over DP each step */
    long act_kb;          /* activation per microbatch (PP send/recv, TP gather) */
    long start_delay_ms;  /* pause after init so an agent can attach */
    long init_delay_ms;   /* pause before the first device call (probes before comm set-up) */
    const char *start_gate; /* or wait until this file exists */
    const char *comm_file;
    const char *rdv_dir;
    const char *step_log;
    int tolerate_errors;  /* keep going when the device library fails (real libs) */
    int activity_api;     /* the activity consumer also enables host API records */
    const char *activity_log; /* every activity record read, one JSON line each */
    int expandable_segments; /* activations in a segment grown and shrunk by VMM mapping (NVIDIA) */
    int driver_launches;     /* library kernels launched below the runtime (+ a graph on NVIDIA) */
    struct sim_faults faults;
};

/* clocks */
uint64_t sim_boot_ns(void);
uint64_t sim_real_ns(void);
void sim_sleep_ns(uint64_t ns);
void sim_cpu_work_us(long us);

/* gpu_state.c: this rank's GPU as the stand-in NVML shows it */
#define SIM_GPU_MAX_MHZ 1980u
void gpu_state_start(int local_rank, unsigned int pid);
void gpu_state_memory(uint64_t used);
void gpu_state_throttle(unsigned int mhz);
void gpu_state_xid(unsigned int code);
void gpu_state_exit(void);

/* config.c */
int sim_parse_args(struct sim_config *cfg, int argc, char **argv);

/* steplog.c: JSON lines, one writer shared by the threads */
int steplog_open(const char *path, int rank);
void steplog_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void steplog_flush(void);

/* steplog.c: the activity log, what the rank's CUPTI/MSPTI consumer read
 * (the ground truth for a tool that decodes the same records). A field
 * the record kind does not have is -1 (numbers) or NULL (name). */
struct sim_activity {
    const char *kind; /* "kernel", "memcpy", "api", "hccl", "communication", "marker" */
    uint32_t raw_kind;
    uint64_t start, end;
    int64_t device, stream, correlation;
    int64_t pid, tid; /* API records: the calling thread */
    int64_t cbid;     /* CUPTI API records: the runtime callback id */
    int64_t bytes;    /* copies */
    const char *name;
};
int actlog_open(const char *path);
void actlog_write(const struct sim_activity *a);
void actlog_flush(void);

/* comms.c */
int comms_load(const char *path, struct sim_comm *comms, int max);
int comms_rendezvous_init(struct sim_comm *comms, int n, const char *rdv_dir, int tolerate);

/* dataloader.c */
struct sim_batch {
    long index;
    size_t bytes;
    unsigned char *data;
};
int dataloader_start(const struct sim_config *cfg);
struct sim_batch *dataloader_next(void);
void dataloader_release(struct sim_batch *b);

#endif
