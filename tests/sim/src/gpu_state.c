/*
 * gpu_state.c: the rank plays its device for the stand-in management
 * library: its GPU for libnvidia-ml.so.1 (NVIDIA flavor; state file
 * standin_nvml.h under $STANDIN_NVML_DIR) or its NPU for libdcmi.so
 * (Ascend flavor; state file standin_dcmi.h under $STANDIN_DCMI_DIR),
 * device index = LOCAL_RANK: its pid, clocks (and, for a GPU, clock-event
 * reasons), utilization, memory and the errors the throttle and xid
 * faults inject (an Xid on a GPU, an error code on an NPU). Without the
 * variable it writes nothing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"
#ifdef SIM_FLAVOR_ASCEND
#include "standin_dcmi.h"
#define STATE_DIR_ENV "STANDIN_DCMI_DIR"
typedef struct standin_dcmi_state state_t;
#else
#include "standin_nvml.h"
#define STATE_DIR_ENV "STANDIN_NVML_DIR"
typedef struct standin_nvml_state state_t;
#endif

static state_t dev;
static const char *dir;
static unsigned int index_;

static void publish(void) {
#ifdef SIM_FLAVOR_ASCEND
    int rc = dir ? standin_dcmi_write_state(dir, index_, &dev) : 0;
#else
    int rc = dir ? standin_nvml_write_state(dir, index_, &dev) : 0;
#endif
    if (rc != 0) fprintf(stderr, "sim: cannot write the device state in %s: ", dir), perror("");
}

void gpu_state_start(int local_rank, unsigned int pid) {
    dir = getenv(STATE_DIR_ENV);
    if (!dir || !*dir) {
        dir = NULL;
        return;
    }
    index_ = (unsigned int)local_rank;
    memset(&dev, 0, sizeof dev);
    dev.pids[0] = pid;
    dev.npids = 1;
#ifdef SIM_FLAVOR_ASCEND
    dev.aicore_mhz = dev.max_aicore_mhz = SIM_GPU_MAX_MHZ;
    dev.util_aicore = 90;
    dev.hbm_total_mb = 64ULL << 10;
#else
    dev.sm_mhz = dev.max_sm_mhz = SIM_GPU_MAX_MHZ;
    dev.util_gpu = 90;
    dev.mem_total = 80ULL << 30;
#endif
    publish();
}

void gpu_state_memory(uint64_t used) {
#ifdef SIM_FLAVOR_ASCEND
    dev.hbm_used_mb = (used + (1 << 20) - 1) >> 20;
#else
    dev.mem_used = used;
#endif
    publish();
}

void gpu_state_throttle(unsigned int mhz) {
#ifdef SIM_FLAVOR_ASCEND
    /* DCMI shows the lower frequency, with no reason. */
    dev.aicore_mhz = mhz;
#else
    dev.sm_mhz = mhz;
    dev.reasons = nvmlClocksEventReasonSwThermalSlowdown;
#endif
    publish();
}

void gpu_state_xid(unsigned int code) {
#ifdef SIM_FLAVOR_ASCEND
    /* The NPU lists the error code and its health turns to a major alarm. */
    if (dev.ncodes < STANDIN_DCMI_MAX_CODES) dev.codes[dev.ncodes++] = code;
    dev.health = 2;
#else
    if (dev.nxids < STANDIN_NVML_MAX_XIDS) dev.xids[dev.nxids++] = code;
#endif
    publish();
}

void gpu_state_exit(void) {
    /* The process is gone from the device, as the library shows it. */
    dev.npids = 0;
#ifdef SIM_FLAVOR_ASCEND
    dev.util_aicore = 0;
    dev.hbm_used_mb = 0;
#else
    dev.util_gpu = 0;
    dev.mem_used = 0;
#endif
    publish();
}
