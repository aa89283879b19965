/*
 * mspti_probe: exercises the stand-in libascendcl.so / libhccl.so /
 * libmspti.so in one process and prints one JSON object: every MSPTI record
 * it received (all fields), plus a few return codes. Run with
 * STANDIN_DEVICE_MEM_BYTES=1073741824 for the capacity checks.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "standin_acl.h"
#include "standin_hccl.h"
#include "standin_mspti.h"

#define MS 1000000ull

static char *out;
static size_t out_len, out_cap;
static int buffers_completed;

static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emit(const char *fmt, ...)
{
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int n = vsnprintf(out + out_len, out_cap - out_len, fmt, ap);
        va_end(ap);
        if (n >= 0 && (size_t)n < out_cap - out_len) {
            out_len += (size_t)n;
            return;
        }
        out_cap = out_cap * 2 + (size_t)n + 1024;
        out = realloc(out, out_cap);
        if (out == NULL) {
            abort();
        }
    }
}

static void buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
    *size = 512;
    *buffer = aligned_alloc(8, *size);
    *max_records = 0;
}

static void buffer_completed(uint8_t *buffer, size_t size, size_t valid)
{
    (void)size;
    buffers_completed++;
    msptiActivity *rec = NULL;
    while (msptiActivityGetNextRecord(buffer, valid, &rec) == MSPTI_SUCCESS) {
        switch (rec->kind) {
        case MSPTI_ACTIVITY_KIND_KERNEL: {
            msptiActivityKernel *k = (msptiActivityKernel *)rec;
            emit("{\"kind\": 2, \"start\": %llu, \"end\": %llu, \"device\": %u, \"stream\": %u, "
                 "\"correlation\": %llu, \"type\": \"%s\", \"name\": \"%s\"},",
                 (unsigned long long)k->start, (unsigned long long)k->end, k->ds.deviceId,
                 k->ds.streamId, (unsigned long long)k->correlationId, k->type, k->name);
            break;
        }
        case MSPTI_ACTIVITY_KIND_API: {
            msptiActivityApi *a = (msptiActivityApi *)rec;
            emit("{\"kind\": 3, \"start\": %llu, \"end\": %llu, \"pid\": %u, \"tid\": %u, "
                 "\"correlation\": %llu, \"name\": \"%s\"},",
                 (unsigned long long)a->start, (unsigned long long)a->end, a->pt.processId,
                 a->pt.threadId, (unsigned long long)a->correlationId, a->name);
            break;
        }
        case MSPTI_ACTIVITY_KIND_HCCL: {
            msptiActivityHccl *h = (msptiActivityHccl *)rec;
            emit("{\"kind\": 4, \"start\": %llu, \"end\": %llu, \"device\": %u, \"stream\": %u, "
                 "\"bandwidth\": %.6f, \"name\": \"%s\", \"comm_name\": \"%s\"},",
                 (unsigned long long)h->start, (unsigned long long)h->end, h->ds.deviceId,
                 h->ds.streamId, h->bandWidth, h->name, h->commName);
            break;
        }
        case MSPTI_ACTIVITY_KIND_COMMUNICATION: {
            msptiActivityCommunication *c = (msptiActivityCommunication *)rec;
            emit("{\"kind\": 9, \"data_type\": %d, \"count\": %llu, \"device\": %u, "
                 "\"stream\": %u, \"start\": %llu, \"end\": %llu, \"alg_type\": \"%s\", "
                 "\"name\": \"%s\", \"comm_name\": \"%s\", \"correlation\": %llu},",
                 (int)c->dataType, (unsigned long long)c->count, c->ds.deviceId, c->ds.streamId,
                 (unsigned long long)c->start, (unsigned long long)c->end, c->algType, c->name,
                 c->commName, (unsigned long long)c->correlationId);
            break;
        }
        case MSPTI_ACTIVITY_KIND_MARKER: {
            msptiActivityMarker *m = (msptiActivityMarker *)rec;
            emit("{\"kind\": 1, \"flag\": %d, \"source_kind\": %d, \"timestamp\": %llu, "
                 "\"id\": %llu, \"pid\": %u, \"tid\": %u, \"name\": \"%s\", \"domain\": \"%s\"},",
                 (int)m->flag, (int)m->sourceKind, (unsigned long long)m->timestamp,
                 (unsigned long long)m->id, m->objectId.pt.processId, m->objectId.pt.threadId,
                 m->name, m->domain);
            break;
        }
        default:
            emit("{\"kind\": %d},", (int)rec->kind);
            break;
        }
    }
    free(buffer);
}

#define CHECK(call)                                                   \
    do {                                                              \
        int rc_ = (int)(call);                                        \
        if (rc_ != 0) {                                               \
            fprintf(stderr, "%s failed: %d\n", #call, rc_);           \
            return 1;                                                 \
        }                                                             \
    } while (0)

int main(void)
{
    CHECK(msptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    const msptiActivityKind kinds[] = {MSPTI_ACTIVITY_KIND_KERNEL, MSPTI_ACTIVITY_KIND_API,
                                       MSPTI_ACTIVITY_KIND_HCCL, MSPTI_ACTIVITY_KIND_MARKER,
                                       MSPTI_ACTIVITY_KIND_COMMUNICATION};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        CHECK(msptiActivityEnable(kinds[i]));
    }
    emit("{\"records\": [");
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(1));
    aclrtStream s;
    CHECK(aclrtCreateStream(&s));
    int32_t sid = -1;
    CHECK(aclrtStreamGetId(s, &sid));

    aclrtFuncHandle fn = NULL;
    CHECK(aclrtBinaryGetFunction(NULL, "add_custom", &fn));
    struct standin_kernel_spec spec = standin_kernel_spec_make(STANDIN_KERNEL_SLEEP, 20 * MS);
    mstxMarkA("step_begin", NULL);
    mstxRangeId range = mstxRangeStartA("forward", NULL);
    CHECK(aclrtLaunchKernel(fn, 8, &spec, sizeof(spec), s));
    CHECK(aclrtLaunchKernel(fn, 8, &spec, sizeof(spec), s));
    mstxRangeEnd(range);

    /* A one-rank communicator needs no other process. */
    HcclRootInfo root;
    CHECK(HcclGetRootInfo(&root));
    HcclComm comm = NULL;
    CHECK(HcclCommInitRootInfo(1, &root, 0, &comm));
    CHECK(HcclAllReduce(NULL, NULL, 1u << 20, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, comm, s));
    CHECK(aclrtSynchronizeStream(s));
    CHECK(HcclCommDestroy(comm));

    /* Capacity (STANDIN_DEVICE_MEM_BYTES) and errors. */
    void *a = NULL, *b = NULL;
    int alloc_rc = aclrtMalloc(&a, 600ull << 20, ACL_MEM_MALLOC_HUGE_FIRST);
    int over_rc = aclrtMalloc(&b, 600ull << 20, ACL_MEM_MALLOC_HUGE_FIRST);
    int free_rc = aclrtFree(a);
    int realloc_rc = aclrtMalloc(&b, 600ull << 20, ACL_MEM_MALLOC_HUGE_FIRST);
    char host[256];
    int copy_rc = aclrtMemcpyAsync(b, 600ull << 20, host, sizeof(host),
                                   ACL_MEMCPY_HOST_TO_DEVICE, s);
    int copy_over_rc = aclrtMemcpyAsync(b, 16, host, sizeof(host), ACL_MEMCPY_HOST_TO_DEVICE, s);
    int bad_device_rc = aclrtSetDevice(1000);
    CHECK(aclrtSynchronizeStream(s));

    CHECK(msptiActivityFlushAll(1));
    if (out[out_len - 1] == ',') {
        out_len--;
    }
    emit("], \"stream_id\": %d, \"buffers\": %d, \"alloc_rc\": %d, \"over_rc\": %d, "
         "\"free_rc\": %d, \"realloc_rc\": %d, \"copy_rc\": %d, \"copy_over_rc\": %d, "
         "\"bad_device_rc\": %d, \"hccl_error\": \"%s\"}\n",
         sid, buffers_completed, alloc_rc, over_rc, free_rc, realloc_rc, copy_rc, copy_over_rc,
         bad_device_rc, HcclGetErrorString(HCCL_E_PARA));
    fwrite(out, 1, out_len, stdout);
    return 0;
}
