/*
 * standin_nvml.h: the subset of nvml.h (NVML 12.x) that the stand-in
 * libnvidia-ml.so.1 implements, with the real names, types, enum values
 * and prototypes, and the state file through which a simulated job plays
 * the GPUs.
 *
 * Semantics of the stand-in (see tests/standins/README.md):
 * - STANDIN_NVML_DEVICE_COUNT GPUs (default 8), "NVIDIA H100 80GB HBM3",
 *   SM clock 1980 MHz at most, 80 GiB of memory, idle and unthrottled.
 * - Each GPU's state is read, at each call, from the text file
 *   $STANDIN_NVML_DIR/gpu<index> (absent: the idle GPU above), one
 *   "key value" a line (standin_nvml_write_state writes one):
 *     pid N            a process running on it (repeatable, 64 at most)
 *     sm_mhz N         its SM clock now
 *     max_sm_mhz N     its highest SM clock
 *     reasons N        its clock-event reasons (NVML_CLOCKS_EVENT_REASON_*)
 *     util_gpu N       percent of the last period a kernel ran
 *     mem_used N       bytes in use
 *     mem_total N      bytes
 *     ecc_uncorrected N  volatile uncorrected ECC errors
 *     xid N            an Xid error it raised (repeatable, in order)
 *   The file is replaced whole (written aside, then renamed), so a reader
 *   never sees half of one.
 * - Event sets deliver each Xid listed after the device was registered
 *   (nvmlEventTypeXidCriticalError, eventData = the Xid) once, in order;
 *   nvmlEventSetWait_v2 polls the files every 10 ms up to its timeout.
 */
#ifndef STANDIN_NVML_H
#define STANDIN_NVML_H

#include <stdio.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum nvmlReturn_enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_UNKNOWN = 999,
} nvmlReturn_t;

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;

typedef enum nvmlClockType_enum {
    NVML_CLOCK_GRAPHICS = 0,
    NVML_CLOCK_SM = 1,
    NVML_CLOCK_MEM = 2,
    NVML_CLOCK_VIDEO = 3,
} nvmlClockType_t;

typedef enum nvmlMemoryErrorType_enum {
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1,
} nvmlMemoryErrorType_t;

typedef enum nvmlEccCounterType_enum {
    NVML_VOLATILE_ECC = 0,
    NVML_AGGREGATE_ECC = 1,
} nvmlEccCounterType_t;

typedef struct nvmlUtilization_st {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

/* nvmlProcessInfo_v2_t, what the _v2 and _v3 process queries fill. */
typedef struct nvmlProcessInfo_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct nvmlEventData_st {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

#define nvmlEventTypeSingleBitEccError 0x0000000000000001LL
#define nvmlEventTypeDoubleBitEccError 0x0000000000000002LL
#define nvmlEventTypeXidCriticalError 0x0000000000000008LL

#define nvmlClocksEventReasonGpuIdle 0x0000000000000001ULL
#define nvmlClocksEventReasonSwPowerCap 0x0000000000000004ULL
#define nvmlClocksEventReasonHwSlowdown 0x0000000000000008ULL
#define nvmlClocksEventReasonSwThermalSlowdown 0x0000000000000020ULL
#define nvmlClocksEventReasonHwThermalSlowdown 0x0000000000000040ULL

#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 80

nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
const char *nvmlErrorString(nvmlReturn_t result);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device);
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length);
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length);
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock);
nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                       unsigned int *clock);
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                    unsigned long long *clocksEventReasons);
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                       unsigned long long *clocksThrottleReasons);
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType,
                                         unsigned long long *eccCounts);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos);
nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set);
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                      nvmlEventSet_t set);
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                 unsigned int timeoutms);
nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set);

/* ---- The state file (not part of NVML) ---- */

#define STANDIN_NVML_MAX_PIDS 64
#define STANDIN_NVML_MAX_XIDS 64

/* One GPU's state as the state file holds it. */
struct standin_nvml_state {
    unsigned int pids[STANDIN_NVML_MAX_PIDS];
    unsigned int npids;
    unsigned int sm_mhz, max_sm_mhz, util_gpu;
    unsigned long long reasons, mem_used, mem_total, ecc_uncorrected;
    unsigned int xids[STANDIN_NVML_MAX_XIDS];
    unsigned int nxids;
};

/* Writes GPU `index`'s state file in `dir` (aside, then renamed over the
 * old one). Returns 0, or -1 with errno set. */
static inline int standin_nvml_write_state(const char *dir, unsigned int index,
                                           const struct standin_nvml_state *s) {
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/gpu%u", dir, index);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    for (unsigned int i = 0; i < s->npids && i < STANDIN_NVML_MAX_PIDS; i++)
        fprintf(f, "pid %u\n", s->pids[i]);
    fprintf(f, "sm_mhz %u\nmax_sm_mhz %u\nreasons %llu\nutil_gpu %u\n", s->sm_mhz,
            s->max_sm_mhz, s->reasons, s->util_gpu);
    fprintf(f, "mem_used %llu\nmem_total %llu\necc_uncorrected %llu\n", s->mem_used,
            s->mem_total, s->ecc_uncorrected);
    for (unsigned int i = 0; i < s->nxids && i < STANDIN_NVML_MAX_XIDS; i++)
        fprintf(f, "xid %u\n", s->xids[i]);
    if (fclose(f) != 0) return -1;
    return rename(tmp, path);
}

#ifdef __cplusplus
}
#endif

#endif
