/* The device backend the training loop runs on: one implementation per flavor
 * (device_nvidia.c: CUDA runtime + NCCL + CUPTI; device_ascend.c: AscendCL +
 * HCCL + MSPTI), linked into separate rank binaries. Every function returns
 * the library's own status code (0 = success) so the rank can log it. */
#ifndef SIM_DEVICE_H
#define SIM_DEVICE_H

#include <stddef.h>
#include <stdint.h>

/* A named kernel: `entry` is a distinct host function per kernel (the host
 * stub nvcc would generate); `handle` is what the launch passes, filled in by
 * dev_register_kernel (the stub itself for CUDA) or at the kernel's first
 * launch (an aclrtFuncHandle for ACL, as operators load their kernels at
 * their first call). */
struct sim_kernel {
    const char *name;
    void (*entry)(void);
    void *handle;
};

const char *dev_flavor(void);
const char *dev_strerror(int err);
int dev_is_oom(int err);

int dev_init(int local_rank);
int dev_stream_create(void **stream);
int dev_stream_sync(void *stream);
int dev_malloc(void **ptr, size_t bytes);
int dev_free(void *ptr);
int dev_memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream);
/* Register the kernel's name with the runtime, as generated code does at
 * start-up (CUDA), or prepare its handle to be got at its first launch
 * (ACL); skipped (handle = entry) with real libraries. */
int dev_register_kernel(struct sim_kernel *k, int with_runtime);
int dev_launch(struct sim_kernel *k, uint64_t duration_ns, void *stream);

/* Communicators: the identity blob (ncclUniqueId / HcclRootInfo) is made by
 * comm rank 0 and shared through the launcher's rendezvous directory. */
size_t dev_comm_id_size(void);
int dev_comm_id_create(void *id);
int dev_comm_init(void **comm, int nranks, const void *id, int rank);
int dev_comm_destroy(void *comm);
/* Counts are fp32 elements. */
int dev_allreduce(void *buf, size_t count, void *comm, void *stream);
int dev_allgather(void *send, void *recv, size_t send_count, void *comm, void *stream);
int dev_reducescatter(void *send, void *recv, size_t recv_count, void *comm, void *stream);
int dev_broadcast(void *buf, size_t count, int root, void *comm, void *stream);
int dev_send(void *buf, size_t count, int peer, void *comm, void *stream);
int dev_recv(void *buf, size_t count, int peer, void *comm, void *stream);

/* The activity consumer (CUPTI / MSPTI): register buffer callbacks and
 * enable the device-work kinds, plus the host API kind (CUPTI RUNTIME /
 * MSPTI API) when api_records is set; drain flushes and returns how many
 * records were read with *ActivityGetNextRecord since the last drain. Each
 * record read also goes to actlog_write (sim.h), a no-op unless the rank
 * has an activity log. */
int dev_activity_start(int api_records);
/* Host range markers around a training step (mstx on Ascend; none on NVIDIA,
 * whose NVTX library is not part of the job). */
uint64_t dev_range_start(const char *message);
void dev_range_end(uint64_t id);
uint64_t dev_activity_drain(void);

/* The layer below the runtime, as libraries that bypass the runtime use it.
 * NVIDIA, the CUDA driver: a kernel's handle is got at its first launch
 * (cuModuleGetFunction, or cuLibraryGetKernel + cuKernelGetFunction with
 * `library` set), as Triton loads its kernels at their first call; `ex`
 * launches with cuLaunchKernelEx, as NCCL and Triton do, else
 * cuLaunchKernel, as cuBLAS does. Ascend, the CANN runtime: at the first
 * launch the operator library registers the kernel's stub
 * (rtFunctionRegister; with `library` set it then finds it again by name,
 * rtGetFunctionByName); `ex` launches with rtKernelLaunchWithFlag, else
 * rtKernelLaunch. */
struct sim_driver_kernel {
    const char *name;
    int library; /* through the library API */
    int ex;      /* cuLaunchKernelEx */
    void *handle;
};
int dev_driver_launch(struct sim_driver_kernel *k, uint64_t duration_ns, void *stream);
/* A graph of the kernels' nodes (built at the first launch), launched
 * whole with cuGraphLaunch; the nodes take duration_ns each (NVIDIA only:
 * the Ascend backend returns -1). */
int dev_graph_launch(void **exec, struct sim_driver_kernel *nodes, int n, uint64_t duration_ns,
                     void *stream);

/* Expandable segments (PyTorch's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True):
 * a reserved address range grown by creating and mapping pages
 * (cuMemCreate + cuMemMap + cuMemSetAccess) and shrunk by unmapping pages
 * (cuMemUnmap of the range, then cuMemRelease of each page). */
int dev_segment_reserve(uint64_t *base, size_t bytes);
int dev_segment_page_size(size_t *bytes);
int dev_segment_map(uint64_t addr, size_t bytes, uint64_t *handle);
int dev_segment_unmap(uint64_t addr, size_t bytes, const uint64_t *handles, int n);

#endif
