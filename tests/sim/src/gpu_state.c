/*
 * gpu_state.c: the rank plays its GPU for the stand-in libnvidia-ml.so.1.
 * It writes the GPU's state file (tests/standins/include/standin_nvml.h)
 * under $STANDIN_NVML_DIR, GPU index = LOCAL_RANK: its pid, clocks,
 * clock-event reasons, utilization, memory and the Xid errors the
 * throttle and xid faults inject. Without the variable it writes nothing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"
#include "standin_nvml.h"

static struct standin_nvml_state gpu;
static const char *dir;
static unsigned int index_;

static void publish(void) {
    if (dir && standin_nvml_write_state(dir, index_, &gpu) != 0)
        fprintf(stderr, "sim: cannot write the GPU state in %s: ", dir), perror("");
}

void gpu_state_start(int local_rank, unsigned int pid) {
    dir = getenv("STANDIN_NVML_DIR");
    if (!dir || !*dir) {
        dir = NULL;
        return;
    }
    index_ = (unsigned int)local_rank;
    memset(&gpu, 0, sizeof gpu);
    gpu.pids[0] = pid;
    gpu.npids = 1;
    gpu.sm_mhz = gpu.max_sm_mhz = SIM_GPU_MAX_MHZ;
    gpu.util_gpu = 90;
    gpu.mem_total = 80ULL << 30;
    publish();
}

void gpu_state_memory(uint64_t used) {
    gpu.mem_used = used;
    publish();
}

void gpu_state_throttle(unsigned int mhz) {
    gpu.sm_mhz = mhz;
    gpu.reasons = nvmlClocksEventReasonSwThermalSlowdown;
    publish();
}

void gpu_state_xid(unsigned int code) {
    if (gpu.nxids < STANDIN_NVML_MAX_XIDS)
        gpu.xids[gpu.nxids++] = code;
    publish();
}

void gpu_state_exit(void) {
    /* The process is gone from the GPU, as NVML shows it. */
    gpu.npids = 0;
    gpu.util_gpu = 0;
    gpu.mem_used = 0;
    publish();
}
