/*
 * standin_kernel.h: how a stand-in "kernel" says how long it runs.
 *
 * The stand-in runtimes (libcudart.so.12, libascendcl.so) execute no device
 * code. A launched kernel occupies its stream's worker thread for a duration
 * that the launch arguments carry, in this struct:
 *
 *   struct standin_kernel_spec { uint32_t magic; uint32_t mode; uint64_t duration_ns; }
 *
 * - CUDA:   cudaLaunchKernel(func, grid, block, args, shmem, stream) with
 *           args[0] pointing at a struct standin_kernel_spec (the kernel's
 *           first parameter is the spec, passed by value as CUDA does).
 * - Ascend: aclrtLaunchKernel(funcHandle, numBlocks, argsData, argsSize, stream)
 *           with argsData pointing at a struct standin_kernel_spec and
 *           argsSize >= sizeof(struct standin_kernel_spec).
 *
 * A launch whose arguments are missing or whose magic does not match runs for
 * 0 ns (it still completes in stream order and is reported to CUPTI/MSPTI).
 *
 * mode STANDIN_KERNEL_SLEEP: the stream worker sleeps (no CPU used);
 * mode STANDIN_KERNEL_SPIN:  the stream worker busy-spins on CLOCK_BOOTTIME
 *                            (burns one CPU for the duration).
 * Either way the kernel's device start/end (CUPTI/MSPTI records) are the
 * CLOCK_BOOTTIME instants at which the worker began and finished it.
 *
 * Kernel names:
 * - CUDA: __cudaRegisterFunction(handle, hostFun, deviceFun, deviceName, ...)
 *   (as nvcc-generated code does; handle may be anything, e.g. the result of
 *   __cudaRegisterFatBinary(NULL)) maps the host function pointer to
 *   deviceName; standin_cuda_register_kernel() below wraps it. Unregistered
 *   functions are named through dladdr() (the symbol of that address, so
 *   link the program with -rdynamic or use exported functions), else
 *   "kernel_0x<address>".
 * - Ascend: aclrtBinaryGetFunction(anyBinHandle, "name", &funcHandle) returns
 *   a handle that names the kernel; any other pointer is named via dladdr().
 */
#ifndef STANDIN_KERNEL_H
#define STANDIN_KERNEL_H

#include <stdint.h>

#ifndef STANDIN_STATIC_ASSERT
#ifdef __cplusplus
#define STANDIN_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define STANDIN_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The bytes 'S','K','R','N' read as a little-endian uint32_t. */
#define STANDIN_KERNEL_MAGIC 0x4E524B53u

enum standin_kernel_mode {
    STANDIN_KERNEL_SLEEP = 0,
    STANDIN_KERNEL_SPIN = 1,
};

struct standin_kernel_spec {
    uint32_t magic;       /* STANDIN_KERNEL_MAGIC */
    uint32_t mode;        /* enum standin_kernel_mode */
    uint64_t duration_ns; /* how long the kernel occupies its stream */
};

STANDIN_STATIC_ASSERT(sizeof(struct standin_kernel_spec) == 16, "standin_kernel_spec is 16 bytes");

static inline struct standin_kernel_spec standin_kernel_spec_make(enum standin_kernel_mode mode,
                                                                  uint64_t duration_ns)
{
    struct standin_kernel_spec spec = {STANDIN_KERNEL_MAGIC, (uint32_t)mode, duration_ns};
    return spec;
}

#ifdef __cplusplus
}
#endif

#endif /* STANDIN_KERNEL_H */
