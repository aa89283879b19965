/*
 * rt.c: the stand-in libruntime.so, CANN's runtime below AscendCL (see
 * include/standin_rt.h).
 *
 * It owns the Ascend devices: the stream engine and device memory
 * (exported to libascendcl, src/common/rtdrv.h), kernel registration and
 * launches. Completed kernels are reported to libmspti through
 * __standin_mspti_record, with the correlation id of the AscendCL call that
 * launched them (or the runtime's own, for a direct launch).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/devmem.h"
#include "common/hooks.h"
#include "common/rtdrv.h"
#include "common/stream.h"
#include "common/util.h"
#include "standin_acl.h"
#include "standin_rt.h"

#define API SD_EXPORT
#define FUNC_MAGIC 0x464e5452u /* "RTNF" */
/* Most stubs rtFunctionRegister remembers (an operator library registers
 * one per kernel). */
#define MAX_STUBS 4096

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int device_count;
static struct sd_hook mspti_hook = {STANDIN_MSPTI_RECORD, "libmspti.so", NULL, 0};

static pthread_mutex_t default_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sd_stream *default_streams[SD_MAX_DEVICES];

static __thread int tls_device;
static __thread uint64_t tls_correlation;
/* Direct launches' ids, apart from AscendCL's. */
static uint64_t runtime_correlation = 1ull << 40;

/* Stubs registered by rtFunctionRegister: stub -> kernel name. */
static pthread_mutex_t stubs_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    const void *stub;
    const char *name;
} stubs[MAX_STUBS];
static size_t nstubs;

/* What rtsFuncGetByName returns: a named handle. */
struct rt_func {
    uint32_t magic;
    const char *name;
};

static void on_complete(const struct sd_stream *s, const struct sd_op *op, uint64_t start,
                        uint64_t end)
{
    standin_mspti_record_fn record = (standin_mspti_record_fn)sd_hook_get(&mspti_hook);
    if (record == NULL || op->report.kind != SD_RT_REPORT_KERNEL) {
        return;
    }
    struct standin_npu_activity a;
    memset(&a, 0, sizeof(a));
    a.size = sizeof(a);
    a.type = STANDIN_NPU_ACT_KERNEL;
    a.start_ns = start;
    a.end_ns = end;
    a.device_id = (uint32_t)s->device;
    a.stream_id = s->id;
    a.correlation_id = op->report.correlation_id;
    a.name = op->report.name;
    a.kernel_type = "KERNEL_AICORE";
    record(&a);
}

static void init(void)
{
    device_count = (int)sd_env_u64("STANDIN_DEVICE_COUNT", 8);
    if (device_count < 0) {
        device_count = 0;
    }
    if (device_count > SD_MAX_DEVICES) {
        device_count = SD_MAX_DEVICES;
    }
    sd_streams_init(on_complete, "npustrm", 2);
    sd_devmem_init(0x500000000000ull, sd_env_u64("STANDIN_DEVICE_MEM_BYTES", 64ull << 30));
}

static void ensure_init(void)
{
    pthread_once(&init_once, init);
}

/* ---- what libascendcl uses (rtdrv.h) ---- */

int sd_rt_device_count(void)
{
    ensure_init();
    return device_count;
}

struct sd_stream *sd_rt_default_stream(int device)
{
    ensure_init();
    if (device < 0 || device >= SD_MAX_DEVICES) {
        return NULL;
    }
    pthread_mutex_lock(&default_mu);
    if (default_streams[device] == NULL) {
        default_streams[device] = sd_stream_create(device, 0, sd_stream_next_id());
    }
    struct sd_stream *s = default_streams[device];
    pthread_mutex_unlock(&default_mu);
    return s;
}

void sd_rt_set_correlation(uint64_t correlation_id)
{
    tls_correlation = correlation_id;
}

static uint64_t correlation(void)
{
    if (tls_correlation != 0) {
        return tls_correlation;
    }
    return __atomic_add_fetch(&runtime_correlation, 1, __ATOMIC_RELAXED);
}

static struct sd_stream *resolve(rtStream_t stm, rtError_t *err)
{
    *err = RT_ERROR_NONE;
    if (stm == NULL) {
        struct sd_stream *s = sd_rt_default_stream(tls_device);
        if (s == NULL) {
            *err = ACL_ERROR_RT_INTERNAL_ERROR;
        }
        return s;
    }
    if (!sd_stream_valid(stm)) {
        *err = ACL_ERROR_RT_PARAM_INVALID;
        return NULL;
    }
    return (struct sd_stream *)stm;
}

/* ---- devices ---- */

API rtError_t rtSetDevice(int32_t devId)
{
    ensure_init();
    if (devId < 0 || devId >= device_count) {
        return ACL_ERROR_RT_INVALID_DEVICEID;
    }
    tls_device = devId;
    return RT_ERROR_NONE;
}

API rtError_t rtDeviceSynchronize(void)
{
    ensure_init();
    sd_device_sync(tls_device);
    return RT_ERROR_NONE;
}

/* ---- memory ---- */

API rtError_t rtMalloc(void **devPtr, uint64_t size, rtMemType_t type, uint16_t moduleId)
{
    (void)type, (void)moduleId;
    ensure_init();
    if (devPtr == NULL || size == 0) {
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    /* Into a local: the caller's pointer is written only on success. */
    void *p = NULL;
    if (sd_devmem_alloc(tls_device, (size_t)size, &p) != 0) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    *devPtr = p;
    return RT_ERROR_NONE;
}

API rtError_t rtFree(void *devPtr)
{
    ensure_init();
    if (devPtr == NULL || sd_devmem_free(devPtr, NULL) != 0) {
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    return RT_ERROR_NONE;
}

/* ---- synchronisation ---- */

API rtError_t rtStreamSynchronize(rtStream_t stm)
{
    rtError_t err;
    struct sd_stream *s = resolve(stm, &err);
    if (s == NULL) {
        return err;
    }
    sd_stream_sync(s);
    return RT_ERROR_NONE;
}

API rtError_t rtEventSynchronize(rtEvent_t evt)
{
    ensure_init();
    if (!sd_event_valid(evt)) {
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    sd_event_sync((struct sd_event *)evt);
    return RT_ERROR_NONE;
}

/* ---- kernel names ---- */

API rtError_t rtFunctionRegister(void *binHandle, const void *stubFunc, const char *stubName,
                                 const void *kernelInfoExt, uint32_t funcMode)
{
    (void)binHandle, (void)kernelInfoExt, (void)funcMode;
    ensure_init();
    if (stubFunc == NULL || stubName == NULL) {
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    const char *name = sd_intern(stubName);
    rtError_t rv = RT_ERROR_NONE;
    pthread_mutex_lock(&stubs_mu);
    size_t i = 0;
    while (i < nstubs && stubs[i].stub != stubFunc) {
        i++;
    }
    if (i < nstubs) {
        stubs[i].name = name; /* registered again: the latest name */
    } else if (nstubs < MAX_STUBS) {
        stubs[nstubs].stub = stubFunc;
        stubs[nstubs].name = name;
        nstubs++;
    } else {
        rv = ACL_ERROR_RT_INTERNAL_ERROR;
    }
    pthread_mutex_unlock(&stubs_mu);
    return rv;
}

static const char *stub_name(const void *stub)
{
    const char *name = NULL;
    pthread_mutex_lock(&stubs_mu);
    for (size_t i = 0; i < nstubs && name == NULL; i++) {
        if (stubs[i].stub == stub) {
            name = stubs[i].name;
        }
    }
    pthread_mutex_unlock(&stubs_mu);
    return name;
}

API rtError_t rtGetFunctionByName(const char *stubName, void **stubFunc)
{
    ensure_init();
    if (stubName == NULL || stubFunc == NULL) {
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    const void *found = NULL;
    pthread_mutex_lock(&stubs_mu);
    for (size_t i = 0; i < nstubs && found == NULL; i++) {
        if (strcmp(stubs[i].name, stubName) == 0) {
            found = stubs[i].stub;
        }
    }
    pthread_mutex_unlock(&stubs_mu);
    if (found == NULL) {
        return ACL_ERROR_RT_INVALID_HANDLE;
    }
    *stubFunc = (void *)found;
    return RT_ERROR_NONE;
}

API rtError_t rtsFuncGetByName(const rtBinHandle binHandle, const char *kernelName,
                               rtFuncHandle *funcHandle)
{
    (void)binHandle;
    ensure_init();
    if (kernelName == NULL || funcHandle == NULL) {
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    struct rt_func *f = calloc(1, sizeof(*f)); /* lives for the process */
    if (f == NULL) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    f->magic = FUNC_MAGIC;
    f->name = sd_intern(kernelName);
    *funcHandle = f;
    return RT_ERROR_NONE;
}

/* A launched kernel's name: a registered stub's, a function handle's, the
 * stub's own symbol (dladdr), else its address. */
static const char *kernel_name(const void *func)
{
    const char *name = stub_name(func);
    if (name != NULL) {
        return name;
    }
    const struct rt_func *f = func;
    if (f != NULL && f->magic == FUNC_MAGIC) {
        return f->name;
    }
    Dl_info info;
    if (func != NULL && dladdr(func, &info) != 0 && info.dli_sname != NULL &&
        info.dli_saddr == func) {
        return sd_intern(info.dli_sname);
    }
    char buf[40];
    snprintf(buf, sizeof(buf), "kernel_%p", func);
    return sd_intern(buf);
}

/* ---- launches ---- */

static rtError_t launch(const void *func, const char *name, uint32_t numBlocks, const void *args,
                        uint64_t argsSize, rtStream_t stm)
{
    ensure_init();
    if (func == NULL || numBlocks == 0) {
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    rtError_t err;
    struct sd_stream *s = resolve(stm, &err);
    if (s == NULL) {
        return err;
    }
    struct sd_op *op = sd_op_new(SD_OP_DELAY);
    if (op == NULL) {
        return ACL_ERROR_RT_INTERNAL_ERROR;
    }
    if (args != NULL && argsSize >= sizeof(struct standin_kernel_spec)) {
        const struct standin_kernel_spec *spec = args;
        if (spec->magic == STANDIN_KERNEL_MAGIC) {
            op->duration_ns = spec->duration_ns;
            op->spin = spec->mode == STANDIN_KERNEL_SPIN;
        }
    }
    op->report.kind = SD_RT_REPORT_KERNEL;
    op->report.name = name != NULL ? name : kernel_name(func);
    op->report.correlation_id = correlation();
    op->report.grid[0] = (int32_t)numBlocks;
    sd_stream_enqueue(s, op);
    return RT_ERROR_NONE;
}

API rtError_t rtKernelLaunch(const void *stubFunc, uint32_t numBlocks, void *args,
                             uint32_t argsSize, rtSmDesc_t *smDesc, rtStream_t stm)
{
    (void)smDesc;
    return launch(stubFunc, NULL, numBlocks, args, argsSize, stm);
}

API rtError_t rtKernelLaunchWithFlag(const void *stubFunc, uint32_t numBlocks,
                                     rtArgsEx_t *argsInfo, rtSmDesc_t *smDesc, rtStream_t stm,
                                     uint32_t flags)
{
    (void)smDesc, (void)flags;
    if (argsInfo == NULL) {
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    return launch(stubFunc, NULL, numBlocks, argsInfo->args, argsInfo->argsSize, stm);
}

API rtError_t rtLaunchKernelByFuncHandleV3(rtFuncHandle funcHandle, uint32_t numBlocks,
                                           const rtArgsEx_t *const argsInfo, rtStream_t stm,
                                           const rtTaskCfgInfo_t *const cfgInfo)
{
    (void)cfgInfo;
    if (argsInfo == NULL) {
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    /* A handle of rtsFuncGetByName has its name; any other pointer is named
     * as a stub (kernel_name). */
    return launch(funcHandle, NULL, numBlocks, argsInfo->args, argsInfo->argsSize, stm);
}
