/*
 * cuda_probe: exercises the stand-in libcudart.so.12 / libcupti.so.12 and
 * prints one JSON object with what it measured, for the Rust tests.
 *
 *   cuda_probe kernel   stream ordering, kernel durations, sync blocking
 *   cuda_probe memory   capacity (run with STANDIN_DEVICE_MEM_BYTES=1 GiB)
 *   cuda_probe events   event record/query/sync/elapsed time
 *   cuda_probe cupti    CUPTI activity records of kernels, copies, API calls
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "standin_cuda.h"
#include "standin_cupti.h"

#define MS 1000000ull

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Host stubs whose addresses identify kernels. */
void probe_gemm_kernel(void) {}
void probe_relu_kernel(void) {}

static cudaError_t launch(const void *fn, uint64_t ns, int spin, cudaStream_t s)
{
    struct standin_kernel_spec spec =
        standin_kernel_spec_make(spin ? STANDIN_KERNEL_SPIN : STANDIN_KERNEL_SLEEP, ns);
    void *args[] = {&spec};
    dim3 grid = {4, 2, 1}, block = {128, 1, 1};
    return cudaLaunchKernel(fn, grid, block, args, 256, s);
}

static int run_kernel(void)
{
    cudaStream_t s;
    if (cudaStreamCreate(&s) != cudaSuccess) {
        return 1;
    }
    uint64_t t0 = now_ns();
    for (int i = 0; i < 3; i++) {
        if (launch((const void *)probe_gemm_kernel, 50 * MS, 0, s) != cudaSuccess) {
            return 1;
        }
    }
    uint64_t t1 = now_ns();
    int query_busy = cudaStreamQuery(s);
    cudaStreamSynchronize(s);
    uint64_t t2 = now_ns();
    int query_idle = cudaStreamQuery(s);

    /* Two streams run concurrently: a device sync waits for the longer. */
    cudaStream_t s2;
    cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
    uint64_t p0 = now_ns();
    launch((const void *)probe_gemm_kernel, 60 * MS, 0, s);
    launch((const void *)probe_relu_kernel, 60 * MS, 0, s2);
    cudaDeviceSynchronize();
    uint64_t p1 = now_ns();

    /* Per-thread default stream, spin mode, through the _ptsz entry points. */
    struct standin_kernel_spec spec = standin_kernel_spec_make(STANDIN_KERNEL_SPIN, 20 * MS);
    void *args[] = {&spec};
    dim3 one = {1, 1, 1};
    uint64_t q0 = now_ns();
    int ptsz_rc = cudaLaunchKernel_ptsz((const void *)probe_relu_kernel, one, one, args, 0, NULL);
    cudaStreamSynchronize_ptsz(NULL);
    uint64_t q1 = now_ns();

    /* Legacy default stream via __cudaLaunchKernel, waited by cudaMemcpy. */
    uint64_t r0 = now_ns();
    spec = standin_kernel_spec_make(STANDIN_KERNEL_SLEEP, 30 * MS);
    int legacy_rc = __cudaLaunchKernel((const void *)probe_relu_kernel, one, one, args, 0, NULL);
    char host[64];
    int memcpy_rc = cudaMemcpy(host, host, sizeof(host), cudaMemcpyHostToHost);
    uint64_t r1 = now_ns();

    int bad_stream_rc = launch((const void *)probe_gemm_kernel, 0, 0, (cudaStream_t)host);
    int destroy_rc = cudaStreamDestroy(s2);

    printf("{\"launch_ns\": %llu, \"sync_wait_ns\": %llu, \"total_ns\": %llu, "
           "\"query_busy\": %d, \"query_idle\": %d, \"parallel_ns\": %llu, "
           "\"ptsz_rc\": %d, \"ptsz_ns\": %llu, \"legacy_rc\": %d, \"memcpy_rc\": %d, "
           "\"legacy_ns\": %llu, \"bad_stream_rc\": %d, \"destroy_rc\": %d}\n",
           (unsigned long long)(t1 - t0), (unsigned long long)(t2 - t1),
           (unsigned long long)(t2 - t0), query_busy, query_idle,
           (unsigned long long)(p1 - p0), ptsz_rc, (unsigned long long)(q1 - q0), legacy_rc,
           memcpy_rc, (unsigned long long)(r1 - r0), bad_stream_rc, destroy_rc);
    return 0;
}

static int run_memory(void)
{
    const size_t chunk = 600ull << 20;
    void *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    int a_rc = cudaMalloc(&a, chunk);
    int b_rc = cudaMalloc(&b, chunk);
    int last1 = cudaGetLastError();
    int last2 = cudaGetLastError();
    size_t free1 = 0, total = 0;
    cudaMemGetInfo(&free1, &total);
    int free_rc = cudaFree(a);
    int c_rc = cudaMalloc(&c, chunk);
    int bogus_free_rc = cudaFree((void *)0x1234);
    int set_bad_rc = cudaSetDevice(99);
    int set1_rc = cudaSetDevice(1);
    int d_rc = cudaMalloc(&d, chunk); /* another device: its own capacity */
    cudaSetDevice(0);

    cudaStream_t s;
    cudaStreamCreate(&s);
    void *e = NULL;
    int async_rc = cudaMallocAsync(&e, 300ull << 20, s);
    int async_over_rc = cudaMallocAsync(&b, chunk, s);
    int free_async_rc = cudaFreeAsync(e, s);
    cudaStreamSynchronize(s);
    size_t free2 = 0;
    cudaMemGetInfo(&free2, &total);
    printf("{\"alloc_rc\": %d, \"over_rc\": %d, \"last_error\": %d, \"last_error_after\": %d, "
           "\"free_rc\": %d, \"realloc_rc\": %d, \"bogus_free_rc\": %d, \"set_bad_rc\": %d, "
           "\"set1_rc\": %d, \"other_device_rc\": %d, \"async_rc\": %d, \"async_over_rc\": %d, "
           "\"free_async_rc\": %d, \"free_before\": %zu, \"free_after\": %zu, \"total\": %zu, "
           "\"ptr_nonnull\": %s, \"error_string\": \"%s\", \"error_name\": \"%s\"}\n",
           a_rc, b_rc, last1, last2, free_rc, c_rc, bogus_free_rc, set_bad_rc, set1_rc, d_rc,
           async_rc, async_over_rc, free_async_rc, free1, free2, total,
           a != NULL ? "true" : "false", cudaGetErrorString(cudaErrorMemoryAllocation),
           cudaGetErrorName(cudaErrorMemoryAllocation));
    return 0;
}

static int run_events(void)
{
    cudaStream_t s;
    cudaEvent_t e0, e1, never;
    cudaStreamCreate(&s);
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventCreate(&never);
    cudaEventRecord(e0, s);
    launch((const void *)probe_gemm_kernel, 80 * MS, 0, s);
    cudaEventRecord(e1, s);
    int query_busy = cudaEventQuery(e1);
    float ms = -1.0f;
    int elapsed_busy = cudaEventElapsedTime(&ms, e0, e1);
    uint64_t t0 = now_ns();
    int sync_rc = cudaEventSynchronize(e1);
    uint64_t waited = now_ns() - t0;
    int query_done = cudaEventQuery(e1);
    int elapsed_rc = cudaEventElapsedTime(&ms, e0, e1);
    float ms2 = 0;
    int never_rc = cudaEventElapsedTime(&ms2, e0, never);

    /* A second stream waits for an event of the first. */
    cudaStream_t s2;
    cudaStreamCreate(&s2);
    uint64_t w0 = now_ns();
    launch((const void *)probe_gemm_kernel, 60 * MS, 0, s);
    cudaEventRecord(e1, s);
    cudaStreamWaitEvent(s2, e1, 0);
    launch((const void *)probe_relu_kernel, 10 * MS, 0, s2);
    cudaStreamSynchronize(s2);
    uint64_t wait_chain = now_ns() - w0;
    int destroy_rc = cudaEventDestroy(e0);
    printf("{\"query_busy\": %d, \"elapsed_busy\": %d, \"sync_rc\": %d, \"sync_wait_ns\": %llu, "
           "\"query_done\": %d, \"elapsed_rc\": %d, \"elapsed_ms\": %.3f, \"never_rc\": %d, "
           "\"wait_chain_ns\": %llu, \"destroy_rc\": %d}\n",
           query_busy, elapsed_busy, sync_rc, (unsigned long long)waited, query_done, elapsed_rc,
           ms, never_rc, (unsigned long long)wait_chain, destroy_rc);
    return 0;
}

/* ---- CUPTI consumer ---- */

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

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
    *size = 1024; /* small, so records span several buffers */
    *buffer = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer,
                                      size_t size, size_t valid)
{
    (void)ctx;
    (void)stream_id;
    (void)size;
    buffers_completed++;
    CUpti_Activity *rec = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            CUpti_ActivityKernel9 *k = (CUpti_ActivityKernel9 *)rec;
            emit("{\"kind\": %d, \"name\": \"%s\", \"start\": %llu, \"end\": %llu, "
                 "\"correlation\": %u, \"stream\": %u, \"device\": %u, \"grid_x\": %d, "
                 "\"block_x\": %d, \"queued\": %llu},",
                 (int)k->kind, k->name, (unsigned long long)k->start,
                 (unsigned long long)k->end, k->correlationId, k->streamId, k->deviceId,
                 k->gridX, k->blockX, (unsigned long long)k->queued);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)rec;
            emit("{\"kind\": 1, \"bytes\": %llu, \"copy_kind\": %u, \"start\": %llu, "
                 "\"end\": %llu, \"correlation\": %u, \"stream\": %u},",
                 (unsigned long long)m->bytes, m->copyKind, (unsigned long long)m->start,
                 (unsigned long long)m->end, m->correlationId, m->streamId);
            break;
        }
        case CUPTI_ACTIVITY_KIND_RUNTIME: {
            CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)rec;
            emit("{\"kind\": 5, \"cbid\": %u, \"start\": %llu, \"end\": %llu, "
                 "\"correlation\": %u, \"pid\": %u, \"tid\": %u, \"rv\": %u},",
                 a->cbid, (unsigned long long)a->start, (unsigned long long)a->end,
                 a->correlationId, a->processId, a->threadId, a->returnValue);
            break;
        }
        default:
            emit("{\"kind\": %d},", (int)rec->kind);
            break;
        }
    }
    free(buffer);
}

static int run_cupti(void)
{
    standin_cuda_register_kernel((const void *)probe_gemm_kernel, "sgemm_128x64_nn");
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS) {
        return 1;
    }
    emit("{\"records\": [");
    cudaStream_t s;
    cudaStreamCreate(&s);
    unsigned long long sid = 0;
    cudaStreamGetId(s, &sid);
    uint32_t cupti_sid = 0;
    cuptiGetStreamId(NULL, s, &cupti_sid);
    uint64_t ts0 = 0;
    cuptiGetTimestamp(&ts0);
    for (int i = 0; i < 3; i++) {
        launch((const void *)probe_gemm_kernel, 20 * MS, 0, s);
        launch((const void *)probe_relu_kernel, 10 * MS, 0, s);
    }
    static char host[1 << 20];
    void *dev = NULL;
    cudaMalloc(&dev, sizeof(host));
    cudaMemcpyAsync(dev, host, sizeof(host), cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);
    uint64_t ts1 = 0;
    cuptiGetTimestamp(&ts1);
    cuptiActivityFlushAll(0);
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(NULL, 0, &dropped);
    if (out[out_len - 1] == ',') {
        out_len--;
    }
    emit("], \"stream_id\": %llu, \"cupti_stream_id\": %u, \"t0\": %llu, \"t1\": %llu, "
         "\"dropped\": %zu, \"buffers\": %d}\n",
         sid, cupti_sid, (unsigned long long)ts0, (unsigned long long)ts1, dropped,
         buffers_completed);
    fwrite(out, 1, out_len, stdout);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: cuda_probe kernel|memory|events|cupti\n");
        return 2;
    }
    if (strcmp(argv[1], "kernel") == 0) {
        return run_kernel();
    }
    if (strcmp(argv[1], "memory") == 0) {
        return run_memory();
    }
    if (strcmp(argv[1], "events") == 0) {
        return run_events();
    }
    if (strcmp(argv[1], "cupti") == 0) {
        return run_cupti();
    }
    fprintf(stderr, "unknown mode %s\n", argv[1]);
    return 2;
}
