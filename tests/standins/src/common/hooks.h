/*
 * hooks.h: the internal interfaces between the stand-in libraries.
 *
 * The libraries never link against each other; each looks the other's
 * exported hook up by name at run time (dlsym(RTLD_DEFAULT), then the
 * library by SONAME), so the real dependency structure holds: libnccl does
 * not need libcudart.so, and libcudart works with or without libcupti.
 *
 *   libcudart.so.12: __standin_cuda_stream_enqueue  (used by libnccl)
 *   libascendcl.so:  __standin_acl_stream_enqueue   (used by libhccl)
 *   libcupti.so.12:  __standin_cupti_record         (fed by libcudart)
 *   libmspti.so:     __standin_mspti_record         (fed by libascendcl, libhccl)
 */
#ifndef STANDIN_HOOKS_H
#define STANDIN_HOOKS_H

#include <stdint.h>

/* ---- stream enqueue (libcudart, libascendcl) ---- */

typedef void (*standin_stream_fn)(void *arg);

struct standin_enqueue_info {
    uint32_t device_id;
    uint32_t stream_id;
    uint64_t correlation_id; /* a fresh id from the runtime's API counter */
};

/* Runs fn(arg) on `stream`'s worker, in stream order. stream NULL is the
 * legacy default stream (per_thread 0) or the thread's per-thread stream
 * (per_thread 1), of the calling thread's current device. A non-NULL
 * kernel_name reports the span of fn as a kernel of that name (CUPTI).
 * Returns a cudaError_t value. */
typedef int (*standin_cuda_stream_enqueue_fn)(void *stream, int per_thread,
                                              const char *kernel_name, standin_stream_fn fn,
                                              void *arg, struct standin_enqueue_info *info);
#define STANDIN_CUDA_STREAM_ENQUEUE "__standin_cuda_stream_enqueue"

/* Same for AscendCL (stream NULL: the device's default stream); returns an
 * aclError value. kernel_name is reported as an MSPTI kernel when set. */
typedef int (*standin_acl_stream_enqueue_fn)(void *stream, const char *kernel_name,
                                             standin_stream_fn fn, void *arg,
                                             struct standin_enqueue_info *info);
#define STANDIN_ACL_STREAM_ENQUEUE "__standin_acl_stream_enqueue"

/* ---- activity sinks (libcupti, libmspti) ---- */

enum standin_cuda_activity_type {
    STANDIN_CUDA_ACT_KERNEL = 1,
    STANDIN_CUDA_ACT_MEMCPY = 2,
    STANDIN_CUDA_ACT_API = 3,
};

struct standin_cuda_activity {
    uint32_t size; /* sizeof(struct standin_cuda_activity) */
    uint32_t type; /* enum standin_cuda_activity_type */
    uint64_t start_ns, end_ns;
    uint64_t queued_ns, submitted_ns;
    uint32_t device_id, stream_id, correlation_id, cbid;
    const char *name; /* interned: valid for the life of the process */
    int32_t grid[3], block[3];
    int32_t dynamic_shared_mem;
    uint64_t bytes;
    uint32_t copy_kind, src_kind, dst_kind; /* CUPTI enum values */
    uint32_t pid, tid, return_value;
};
typedef void (*standin_cupti_record_fn)(const struct standin_cuda_activity *a);
#define STANDIN_CUPTI_RECORD "__standin_cupti_record"

enum standin_npu_activity_type {
    STANDIN_NPU_ACT_KERNEL = 1,
    STANDIN_NPU_ACT_API = 2,
    STANDIN_NPU_ACT_HCCL = 3,
    STANDIN_NPU_ACT_COMMUNICATION = 4,
};

struct standin_npu_activity {
    uint32_t size; /* sizeof(struct standin_npu_activity) */
    uint32_t type; /* enum standin_npu_activity_type */
    uint64_t start_ns, end_ns;
    uint32_t device_id, stream_id;
    uint64_t correlation_id;
    uint32_t pid, tid;
    const char *name; /* interned strings */
    const char *kernel_type;
    const char *comm_name;
    const char *alg_type;
    double bandwidth_gbps;
    uint32_t data_type;
    uint64_t count;
};
typedef void (*standin_mspti_record_fn)(const struct standin_npu_activity *a);
#define STANDIN_MSPTI_RECORD "__standin_mspti_record"

#endif /* STANDIN_HOOKS_H */
