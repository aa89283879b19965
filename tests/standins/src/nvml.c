/*
 * nvml.c: the stand-in libnvidia-ml.so.1 (see include/standin_nvml.h).
 * Every GPU's clocks, clock-event reasons, processes and Xid errors come
 * from its state file, which the simulated job's fault injector writes, so
 * an agent loading this library from its own process sees what the job
 * plays.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/util.h"
#include "standin_nvml.h"

#define API SD_EXPORT

#define MAX_DEVICES 64
#define DEFAULT_MAX_MHZ 1980u
#define DEFAULT_MEM_TOTAL (80ULL << 30)

struct nvmlDevice_st {
    unsigned int index;
};

struct nvmlEventSet_st {
    unsigned long long registered[MAX_DEVICES];
    /* Xids of each device already delivered (or raised before it was
     * registered). */
    unsigned int delivered[MAX_DEVICES];
};

static struct nvmlDevice_st devices[MAX_DEVICES];
static int initialized;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned int device_count(void) {
    uint64_t n = sd_env_u64("STANDIN_NVML_DEVICE_COUNT", 8);
    return n > MAX_DEVICES ? MAX_DEVICES : (unsigned int)n;
}

static int valid(nvmlDevice_t d) {
    return initialized && d >= devices && d < devices + device_count();
}

/* GPU `index`'s state: the idle defaults, then what its file says. */
static void read_state(unsigned int index, struct standin_nvml_state *s) {
    memset(s, 0, sizeof *s);
    s->sm_mhz = s->max_sm_mhz = DEFAULT_MAX_MHZ;
    s->mem_total = DEFAULT_MEM_TOTAL;
    const char *dir = getenv("STANDIN_NVML_DIR");
    if (!dir || !*dir) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/gpu%u", dir, index);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char key[32];
    unsigned long long v;
    while (fscanf(f, "%31s %llu", key, &v) == 2) {
        if (!strcmp(key, "pid") && s->npids < STANDIN_NVML_MAX_PIDS)
            s->pids[s->npids++] = (unsigned int)v;
        else if (!strcmp(key, "sm_mhz"))
            s->sm_mhz = (unsigned int)v;
        else if (!strcmp(key, "max_sm_mhz"))
            s->max_sm_mhz = (unsigned int)v;
        else if (!strcmp(key, "reasons"))
            s->reasons = v;
        else if (!strcmp(key, "util_gpu"))
            s->util_gpu = (unsigned int)v;
        else if (!strcmp(key, "mem_used"))
            s->mem_used = v;
        else if (!strcmp(key, "mem_total"))
            s->mem_total = v;
        else if (!strcmp(key, "ecc_uncorrected"))
            s->ecc_uncorrected = v;
        else if (!strcmp(key, "xid") && s->nxids < STANDIN_NVML_MAX_XIDS)
            s->xids[s->nxids++] = (unsigned int)v;
    }
    fclose(f);
}

API nvmlReturn_t nvmlInit_v2(void) {
    pthread_mutex_lock(&lock);
    for (unsigned int i = 0; i < MAX_DEVICES; i++) devices[i].index = i;
    initialized = 1;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlShutdown(void) {
    initialized = 0;
    return NVML_SUCCESS;
}

API const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    default: return "Unknown Error";
    }
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = device_count();
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= device_count()) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_string(const char *s, char *out, unsigned int length) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
    return copy_string("NVIDIA H100 80GB HBM3", name, length);
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
    char s[64];
    snprintf(s, sizeof s, "GPU-5374616e-6469-6e00-0000-%012x", device->index);
    return copy_string(s, uuid, length);
}

API nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                        unsigned int *clock) {
    if (!valid(device) || !clock) return NVML_ERROR_INVALID_ARGUMENT;
    if (type != NVML_CLOCK_SM && type != NVML_CLOCK_GRAPHICS) return NVML_ERROR_NOT_SUPPORTED;
    struct standin_nvml_state s;
    read_state(device->index, &s);
    *clock = s.sm_mhz;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                           unsigned int *clock) {
    if (!valid(device) || !clock) return NVML_ERROR_INVALID_ARGUMENT;
    if (type != NVML_CLOCK_SM && type != NVML_CLOCK_GRAPHICS) return NVML_ERROR_NOT_SUPPORTED;
    struct standin_nvml_state s;
    read_state(device->index, &s);
    *clock = s.max_sm_mhz;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                        unsigned long long *reasons) {
    if (!valid(device) || !reasons) return NVML_ERROR_INVALID_ARGUMENT;
    struct standin_nvml_state s;
    read_state(device->index, &s);
    /* An idle GPU says so, as a real one does. */
    *reasons = s.reasons | (s.npids == 0 ? nvmlClocksEventReasonGpuIdle : 0);
    return NVML_SUCCESS;
}

/* The older name of the same query (deprecated in 12.2, still exported). */
API nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                           unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                               nvmlUtilization_t *utilization) {
    if (!valid(device) || !utilization) return NVML_ERROR_INVALID_ARGUMENT;
    struct standin_nvml_state s;
    read_state(device->index, &s);
    utilization->gpu = s.util_gpu;
    utilization->memory = s.util_gpu / 2;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!valid(device) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    struct standin_nvml_state s;
    read_state(device->index, &s);
    memory->total = s.mem_total;
    memory->used = s.mem_used;
    memory->free = s.mem_total > s.mem_used ? s.mem_total - s.mem_used : 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                             nvmlEccCounterType_t counterType,
                                             unsigned long long *eccCounts) {
    (void)counterType;
    if (!valid(device) || !eccCounts) return NVML_ERROR_INVALID_ARGUMENT;
    struct standin_nvml_state s;
    read_state(device->index, &s);
    *eccCounts = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? s.ecc_uncorrected : 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                         unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos) {
    if (!valid(device) || !infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    struct standin_nvml_state s;
    read_state(device->index, &s);
    unsigned int room = *infoCount;
    *infoCount = s.npids;
    if (room < s.npids || (s.npids > 0 && !infos)) return NVML_ERROR_INSUFFICIENT_SIZE;
    for (unsigned int i = 0; i < s.npids; i++) {
        infos[i].pid = s.pids[i];
        infos[i].usedGpuMemory = s.npids ? s.mem_used / s.npids : 0;
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    return *set ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                          nvmlEventSet_t set) {
    if (!valid(device) || !set) return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~(unsigned long long)nvmlEventTypeXidCriticalError)
        return NVML_ERROR_NOT_SUPPORTED;
    struct standin_nvml_state s;
    read_state(device->index, &s);
    set->registered[device->index] |= eventTypes;
    set->delivered[device->index] = s.nxids;
    return NVML_SUCCESS;
}

/* The next Xid not yet delivered on any registered device. */
static int next_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    for (unsigned int i = 0; i < device_count(); i++) {
        if (!(set->registered[i] & nvmlEventTypeXidCriticalError)) continue;
        struct standin_nvml_state s;
        read_state(i, &s);
        if (s.nxids > set->delivered[i]) {
            data->device = &devices[i];
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = s.xids[set->delivered[i]++];
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
            return 1;
        }
    }
    return 0;
}

API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                     unsigned int timeoutms) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = sd_now_ns() + (uint64_t)timeoutms * 1000000ULL;
    for (;;) {
        if (next_event(set, data)) return NVML_SUCCESS;
        uint64_t now = sd_now_ns();
        if (now >= deadline) return NVML_ERROR_TIMEOUT;
        uint64_t step = deadline - now < 10000000ULL ? deadline - now : 10000000ULL;
        sd_sleep_until(now + step);
    }
}

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    free(set);
    return NVML_SUCCESS;
}
