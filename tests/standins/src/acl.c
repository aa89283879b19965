/*
 * acl.c: the stand-in libascendcl.so (see include/standin_acl.h).
 *
 * As the real AscendCL, it launches, allocates, frees and synchronises
 * through the CANN runtime (the stand-in libruntime.so, linked; src/common/
 * rtdrv.h), on the caller's thread, inside its own call; streams, events
 * and copies use the runtime's device engine directly. API calls are
 * reported to libmspti through __standin_mspti_record (the runtime reports
 * the kernels, with the launching call's correlation id).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/devmem.h"
#include "common/hooks.h"
#include "common/rtdrv.h"
#include "common/stream.h"
#include "common/util.h"
#include "standin_acl.h"
#include "standin_rt.h"

#define API SD_EXPORT

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static double pcie_gbps, hbm_gbps;
static uint64_t memcpy_lat_ns;
static uint64_t correlation_counter;
static struct sd_hook mspti_hook = {STANDIN_MSPTI_RECORD, "libmspti.so", NULL, 0};

static __thread int tls_device;

static void init(void)
{
    /* The runtime's device engine is set up before any stream exists. */
    (void)sd_rt_device_count();
    pcie_gbps = sd_env_double("STANDIN_PCIE_GBPS", 25.0);
    hbm_gbps = sd_env_double("STANDIN_HBM_GBPS", 1000.0);
    if (!(pcie_gbps > 0.0)) {
        pcie_gbps = 25.0;
    }
    if (!(hbm_gbps > 0.0)) {
        hbm_gbps = 1000.0;
    }
    memcpy_lat_ns = sd_env_u64("STANDIN_MEMCPY_LAT_US", 2) * 1000ull;
}

static void ensure_init(void)
{
    pthread_once(&init_once, init);
}

static uint64_t next_correlation(void)
{
    return __atomic_add_fetch(&correlation_counter, 1, __ATOMIC_RELAXED);
}

/* ---- API records ---- */

struct api_call {
    const char *name;
    uint64_t corr;
    uint64_t start;
};

static struct api_call api_begin(const char *name)
{
    ensure_init();
    struct api_call c = {name, next_correlation(), sd_now_ns()};
    return c;
}

static aclError api_end(const struct api_call *c, aclError rv)
{
    standin_mspti_record_fn record = (standin_mspti_record_fn)sd_hook_get(&mspti_hook);
    if (record != NULL) {
        struct standin_npu_activity a;
        memset(&a, 0, sizeof(a));
        a.size = sizeof(a);
        a.type = STANDIN_NPU_ACT_API;
        a.start_ns = c->start;
        a.end_ns = sd_now_ns();
        a.correlation_id = c->corr;
        a.pid = (uint32_t)getpid();
        a.tid = sd_gettid();
        a.name = c->name;
        record(&a);
    }
    return rv;
}

/* ---- streams ---- */

static struct sd_stream *resolve(aclrtStream stream, aclError *err)
{
    *err = ACL_SUCCESS;
    if (stream == NULL) {
        struct sd_stream *s = sd_rt_default_stream(tls_device);
        if (s == NULL) {
            *err = ACL_ERROR_RT_INTERNAL_ERROR;
        }
        return s;
    }
    if (!sd_stream_valid(stream)) {
        *err = ACL_ERROR_INVALID_PARAM;
        return NULL;
    }
    return (struct sd_stream *)stream;
}

/* ---- init and devices ---- */

API aclError aclInit(const char *configPath)
{
    (void)configPath;
    struct api_call c = api_begin("aclInit");
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclFinalize(void)
{
    struct api_call c = api_begin("aclFinalize");
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtSetDevice(int32_t deviceId)
{
    struct api_call c = api_begin("aclrtSetDevice");
    rtError_t err = rtSetDevice(deviceId);
    if (err != RT_ERROR_NONE) {
        return api_end(&c, err);
    }
    tls_device = deviceId;
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtResetDevice(int32_t deviceId)
{
    struct api_call c = api_begin("aclrtResetDevice");
    if (deviceId < 0 || deviceId >= sd_rt_device_count()) {
        return api_end(&c, ACL_ERROR_RT_INVALID_DEVICEID);
    }
    sd_device_sync(deviceId);
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtGetDevice(int32_t *deviceId)
{
    struct api_call c = api_begin("aclrtGetDevice");
    if (deviceId == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    *deviceId = tls_device;
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtGetDeviceCount(uint32_t *count)
{
    struct api_call c = api_begin("aclrtGetDeviceCount");
    if (count == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    *count = (uint32_t)sd_rt_device_count();
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtSynchronizeDevice(void)
{
    struct api_call c = api_begin("aclrtSynchronizeDevice");
    return api_end(&c, rtDeviceSynchronize());
}

/* ---- streams ---- */

API aclError aclrtCreateStream(aclrtStream *stream)
{
    struct api_call c = api_begin("aclrtCreateStream");
    if (stream == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    struct sd_stream *s = sd_stream_create(tls_device, 0, sd_stream_next_id());
    if (s == NULL) {
        return api_end(&c, ACL_ERROR_RT_INTERNAL_ERROR);
    }
    *stream = s;
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtDestroyStream(aclrtStream stream)
{
    struct api_call c = api_begin("aclrtDestroyStream");
    if (stream == NULL || !sd_stream_valid(stream)) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    sd_stream_destroy((struct sd_stream *)stream);
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtSynchronizeStream(aclrtStream stream)
{
    struct api_call c = api_begin("aclrtSynchronizeStream");
    aclError err;
    struct sd_stream *s = resolve(stream, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    return api_end(&c, rtStreamSynchronize(stream));
}

API aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event)
{
    struct api_call c = api_begin("aclrtStreamWaitEvent");
    aclError err;
    struct sd_stream *s = resolve(stream, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    if (!sd_event_valid(event)) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    if (sd_event_wait_on(s, (struct sd_event *)event) != 0) {
        return api_end(&c, ACL_ERROR_RT_INTERNAL_ERROR);
    }
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtStreamGetId(aclrtStream stream, int32_t *streamId)
{
    struct api_call c = api_begin("aclrtStreamGetId");
    aclError err;
    if (streamId == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    struct sd_stream *s = resolve(stream, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    *streamId = (int32_t)s->id;
    return api_end(&c, ACL_SUCCESS);
}

/* ---- memory ---- */

API aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    (void)policy;
    struct api_call c = api_begin("aclrtMalloc");
    if (devPtr == NULL || size == 0) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    int64_t injected = sd_injected_malloc_error();
    if (injected != 0) {
        *devPtr = NULL;
        return api_end(&c, (aclError)injected);
    }
    rtError_t err = rtMalloc(devPtr, size, RT_MEMORY_HBM, 0);
    if (err != RT_ERROR_NONE) {
        *devPtr = NULL;
        return api_end(&c, err);
    }
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtFree(void *devPtr)
{
    struct api_call c = api_begin("aclrtFree");
    if (devPtr == NULL || rtFree(devPtr) != RT_ERROR_NONE) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total)
{
    (void)attr;
    struct api_call c = api_begin("aclrtGetMemInfo");
    if (free == NULL || total == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    sd_devmem_info(tls_device, free, total);
    return api_end(&c, ACL_SUCCESS);
}

static aclError enqueue_copy(struct sd_stream *s, size_t destMax, size_t count,
                             aclrtMemcpyKind kind, uint64_t corr, uint64_t *ticket)
{
    if (count > destMax || (unsigned)kind > ACL_MEMCPY_DEVICE_TO_DEVICE) {
        return ACL_ERROR_INVALID_PARAM;
    }
    struct sd_op *op = sd_op_new(SD_OP_DELAY);
    if (op == NULL) {
        return ACL_ERROR_RT_INTERNAL_ERROR;
    }
    double gbps = kind == ACL_MEMCPY_DEVICE_TO_DEVICE ? hbm_gbps : pcie_gbps;
    op->duration_ns = memcpy_lat_ns + (uint64_t)((double)count / gbps);
    op->report.kind = SD_RT_REPORT_MEMCPY;
    op->report.correlation_id = corr;
    op->report.bytes = count;
    op->report.copy_kind = kind;
    *ticket = sd_stream_enqueue(s, op);
    return ACL_SUCCESS;
}

API aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                         aclrtMemcpyKind kind)
{
    struct api_call c = api_begin("aclrtMemcpy");
    aclError err;
    if (dst == NULL || src == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    struct sd_stream *s = resolve(NULL, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    uint64_t ticket = 0;
    err = enqueue_copy(s, destMax, count, kind, c.corr, &ticket);
    if (err == ACL_SUCCESS) {
        sd_stream_wait(s, ticket);
    }
    return api_end(&c, err);
}

API aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                              aclrtMemcpyKind kind, aclrtStream stream)
{
    struct api_call c = api_begin("aclrtMemcpyAsync");
    aclError err;
    if (dst == NULL || src == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    struct sd_stream *s = resolve(stream, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    uint64_t ticket = 0;
    return api_end(&c, enqueue_copy(s, destMax, count, kind, c.corr, &ticket));
}

/* ---- events ---- */

API aclError aclrtCreateEvent(aclrtEvent *event)
{
    struct api_call c = api_begin("aclrtCreateEvent");
    if (event == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    struct sd_event *e = sd_event_create(tls_device, 0);
    if (e == NULL) {
        return api_end(&c, ACL_ERROR_RT_INTERNAL_ERROR);
    }
    *event = e;
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtDestroyEvent(aclrtEvent event)
{
    struct api_call c = api_begin("aclrtDestroyEvent");
    if (!sd_event_valid(event)) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    sd_event_destroy((struct sd_event *)event);
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream)
{
    struct api_call c = api_begin("aclrtRecordEvent");
    aclError err;
    if (!sd_event_valid(event)) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    struct sd_stream *s = resolve(stream, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    if (sd_event_record((struct sd_event *)event, s) != 0) {
        return api_end(&c, ACL_ERROR_RT_INTERNAL_ERROR);
    }
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtSynchronizeEvent(aclrtEvent event)
{
    struct api_call c = api_begin("aclrtSynchronizeEvent");
    if (!sd_event_valid(event)) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    return api_end(&c, rtEventSynchronize(event));
}

API aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status)
{
    struct api_call c = api_begin("aclrtQueryEventStatus");
    if (!sd_event_valid(event) || status == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    *status = sd_event_done((struct sd_event *)event, NULL, NULL)
                  ? ACL_EVENT_RECORDED_STATUS_COMPLETE
                  : ACL_EVENT_RECORDED_STATUS_NOT_READY;
    return api_end(&c, ACL_SUCCESS);
}

API aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent)
{
    struct api_call c = api_begin("aclrtEventElapsedTime");
    if (ms == NULL || !sd_event_valid(startEvent) || !sd_event_valid(endEvent)) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    uint64_t ta = 0, tb = 0, ra = 0, rb = 0;
    int da = sd_event_done((struct sd_event *)startEvent, &ta, &ra);
    int db = sd_event_done((struct sd_event *)endEvent, &tb, &rb);
    if (ra == 0 || rb == 0) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    if (!da || !db) {
        return api_end(&c, ACL_ERROR_RT_EVENT_NOT_COMPLETE);
    }
    *ms = (float)(((double)tb - (double)ta) / 1e6);
    return api_end(&c, ACL_SUCCESS);
}

/* ---- kernels ---- */

API aclError aclrtBinaryGetFunction(const aclrtBinHandle binHandle, const char *kernelName,
                                    aclrtFuncHandle *funcHandle)
{
    struct api_call c = api_begin("aclrtBinaryGetFunction");
    if (kernelName == NULL || funcHandle == NULL) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    return api_end(&c, rtsFuncGetByName(binHandle, kernelName, funcHandle));
}

API aclError aclrtLaunchKernel(aclrtFuncHandle funcHandle, uint32_t numBlocks,
                               const void *argsData, size_t argsSize, aclrtStream stream)
{
    struct api_call c = api_begin("aclrtLaunchKernel");
    aclError err;
    if (funcHandle == NULL || numBlocks == 0) {
        return api_end(&c, ACL_ERROR_INVALID_PARAM);
    }
    struct sd_stream *s = resolve(stream, &err);
    if (s == NULL) {
        return api_end(&c, err);
    }
    /* As CANN's: the runtime launch by function handle, the arguments in an
     * rtArgsEx_t; the kernel reports this call's correlation id. */
    rtArgsEx_t args;
    memset(&args, 0, sizeof(args));
    args.args = (void *)argsData;
    args.argsSize = (uint32_t)argsSize;
    args.isNoNeedH2DCopy = 1;
    sd_rt_set_correlation(c.corr);
    err = rtLaunchKernelByFuncHandleV3(funcHandle, numBlocks, &args, stream, NULL);
    sd_rt_set_correlation(0);
    return api_end(&c, err);
}

/* ---- internal hook for libhccl ---- */

API int __standin_acl_stream_enqueue(void *stream, const char *kernel_name_,
                                     standin_stream_fn fn, void *arg,
                                     struct standin_enqueue_info *info)
{
    ensure_init();
    aclError err;
    struct sd_stream *s = resolve(stream, &err);
    if (s == NULL) {
        return err;
    }
    struct sd_op *op = sd_op_new(SD_OP_CALL);
    if (op == NULL) {
        return ACL_ERROR_RT_INTERNAL_ERROR;
    }
    /* HCCL launches its tasks through the runtime: its operation's records
     * come with an API record of the same correlation id, made inside the
     * collective's call. */
    struct api_call c = api_begin("aclrtLaunchKernel");
    uint64_t corr = c.corr;
    op->fn = fn;
    op->arg = arg;
    if (kernel_name_ != NULL) {
        op->report.kind = SD_RT_REPORT_KERNEL;
        op->report.name = sd_intern(kernel_name_);
        op->report.correlation_id = corr;
    }
    if (info != NULL) {
        info->device_id = (uint32_t)s->device;
        info->stream_id = s->id;
        info->correlation_id = corr;
    }
    sd_stream_enqueue(s, op);
    return api_end(&c, ACL_SUCCESS);
}
