//! What a device library's status code means: its name, whether it says
//! the device is out of memory, and whether it is a routine answer that is
//! no failure at all ("not ready yet").
//!
//! Why the detectors need it: a failed allocation is not always out of
//! memory (a driver that lost the device fails `cudaMalloc` with
//! `cudaErrorNoDevice`, an earlier kernel's illegal access makes every
//! later call return `cudaErrorIllegalAddress`); reporting those as
//! `device_oom` sends a user looking for a leak that is not there.
//!
//! Codes from the libraries' public headers (`driver_types.h`'s
//! `cudaError`, `nccl.h`'s `ncclResult_t`, AscendCL's `acl_base.h` and
//! the runtime's `rt_error_codes.h`, HCCL's `hccl_types.h`).

use super::Library;

/// `(code, name)` of the CUDA runtime's errors a training job meets.
const CUDART: &[(i64, &str)] = &[
    (1, "cudaErrorInvalidValue"),
    (2, "cudaErrorMemoryAllocation"),
    (3, "cudaErrorInitializationError"),
    (4, "cudaErrorCudartUnloading"),
    (9, "cudaErrorInvalidConfiguration"),
    (17, "cudaErrorInvalidDevicePointer"),
    (21, "cudaErrorInvalidMemcpyDirection"),
    (34, "cudaErrorStubLibrary"),
    (35, "cudaErrorInsufficientDriver"),
    (36, "cudaErrorCallRequiresNewerDriver"),
    (46, "cudaErrorDevicesUnavailable"),
    (98, "cudaErrorInvalidDeviceFunction"),
    (100, "cudaErrorNoDevice"),
    (101, "cudaErrorInvalidDevice"),
    (214, "cudaErrorECCUncorrectable"),
    (400, "cudaErrorInvalidResourceHandle"),
    (600, "cudaErrorNotReady"),
    (700, "cudaErrorIllegalAddress"),
    (701, "cudaErrorLaunchOutOfResources"),
    (702, "cudaErrorLaunchTimeout"),
    (704, "cudaErrorPeerAccessAlreadyEnabled"),
    (714, "cudaErrorHardwareStackError"),
    (715, "cudaErrorIllegalInstruction"),
    (716, "cudaErrorMisalignedAddress"),
    (717, "cudaErrorInvalidAddressSpace"),
    (718, "cudaErrorInvalidPc"),
    (719, "cudaErrorLaunchFailure"),
    (800, "cudaErrorNotPermitted"),
    (801, "cudaErrorNotSupported"),
    (802, "cudaErrorSystemNotReady"),
    (803, "cudaErrorSystemDriverMismatch"),
    (900, "cudaErrorStreamCaptureUnsupported"),
    (999, "cudaErrorUnknown"),
];

const NCCL: &[(i64, &str)] = &[
    (1, "ncclUnhandledCudaError"),
    (2, "ncclSystemError"),
    (3, "ncclInternalError"),
    (4, "ncclInvalidArgument"),
    (5, "ncclInvalidUsage"),
    (6, "ncclRemoteError"),
    (7, "ncclInProgress"),
];

const ACL: &[(i64, &str)] = &[
    (100000, "ACL_ERROR_INVALID_PARAM"),
    (100001, "ACL_ERROR_UNINITIALIZE"),
    (100002, "ACL_ERROR_REPEAT_INITIALIZE"),
    (107000, "ACL_ERROR_RT_PARAM_INVALID"),
    (107001, "ACL_ERROR_RT_INVALID_DEVICEID"),
    (107017, "ACL_ERROR_RT_INVALID_HANDLE"),
    (107019, "ACL_ERROR_RT_WAIT_TIMEOUT"),
    (107020, "ACL_ERROR_RT_TASK_TIMEOUT"),
    (200000, "ACL_ERROR_BAD_ALLOC"),
    (207001, "ACL_ERROR_RT_MEMORY_ALLOCATION"),
    (207004, "ACL_ERROR_RT_NO_DEVICE"),
    (207018, "ACL_ERROR_RT_DEVICE_OOM"),
    (507000, "ACL_ERROR_RT_INTERNAL_ERROR"),
    (507004, "ACL_ERROR_RT_STREAM_NOT_COMPLETE"),
    (507006, "ACL_ERROR_RT_EVENT_NOT_COMPLETE"),
    (507010, "ACL_ERROR_RT_LOST_HEARTBEAT"),
    (507011, "ACL_ERROR_RT_MODEL_EXECUTE"),
    (507014, "ACL_ERROR_RT_AICORE_TIMEOUT"),
    (507015, "ACL_ERROR_RT_AICORE_EXCEPTION"),
    (507034, "ACL_ERROR_RT_VECTOR_CORE_TIMEOUT"),
    (507035, "ACL_ERROR_RT_VECTOR_CORE_EXCEPTION"),
    (507046, "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT"),
    (507053, "ACL_ERROR_RT_DEVICE_MEM_ERROR"),
    (507054, "ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR"),
    (507056, "ACL_ERROR_RT_LINK_ERROR"),
    (507899, "ACL_ERROR_RT_DRV_INTERNAL_ERROR"),
];

const HCCL: &[(i64, &str)] = &[
    (1, "HCCL_E_PARA"),
    (2, "HCCL_E_PTR"),
    (3, "HCCL_E_MEMORY"),
    (4, "HCCL_E_INTERNAL"),
    (5, "HCCL_E_NOT_SUPPORT"),
    (6, "HCCL_E_NOT_FOUND"),
    (7, "HCCL_E_UNAVAIL"),
    (8, "HCCL_E_SYSCALL"),
    (9, "HCCL_E_TIMEOUT"),
    (10, "HCCL_E_OPEN_FILE_FAILURE"),
    (11, "HCCL_E_TCP_CONNECT"),
    (12, "HCCL_E_ROCE_CONNECT"),
    (13, "HCCL_E_TCP_TRANSFER"),
    (14, "HCCL_E_ROCE_TRANSFER"),
    (15, "HCCL_E_RUNTIME"),
    (16, "HCCL_E_DRV"),
    (17, "HCCL_E_PROFILING"),
    (18, "HCCL_E_CCE"),
    (19, "HCCL_E_NETWORK"),
    (20, "HCCL_E_AGAIN"),
    (21, "HCCL_E_REMOTE"),
    (22, "HCCL_E_SUSPENDING"),
    (23, "HCCL_E_OPRETRY_FAIL"),
    (24, "HCCL_E_OOM"),
];

/// `(code, name)` of the CUDA driver's errors (`cuda.h`'s `CUresult`).
const CUDA: &[(i64, &str)] = &[
    (1, "CUDA_ERROR_INVALID_VALUE"),
    (2, "CUDA_ERROR_OUT_OF_MEMORY"),
    (3, "CUDA_ERROR_NOT_INITIALIZED"),
    (4, "CUDA_ERROR_DEINITIALIZED"),
    (100, "CUDA_ERROR_NO_DEVICE"),
    (101, "CUDA_ERROR_INVALID_DEVICE"),
    (201, "CUDA_ERROR_INVALID_CONTEXT"),
    (214, "CUDA_ERROR_ECC_UNCORRECTABLE"),
    (400, "CUDA_ERROR_INVALID_HANDLE"),
    (500, "CUDA_ERROR_NOT_FOUND"),
    (600, "CUDA_ERROR_NOT_READY"),
    (700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
    (701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"),
    (702, "CUDA_ERROR_LAUNCH_TIMEOUT"),
    (719, "CUDA_ERROR_LAUNCH_FAILED"),
    (801, "CUDA_ERROR_NOT_SUPPORTED"),
    (999, "CUDA_ERROR_UNKNOWN"),
];

fn table(library: Library) -> &'static [(i64, &'static str)] {
    match library {
        Library::Cudart => CUDART,
        Library::Cuda => CUDA,
        Library::Nccl => NCCL,
        // The runtime returns AscendCL's external ACL_ERROR_RT_* codes.
        Library::AscendCl | Library::AscendRuntime => ACL,
        Library::Hccl => HCCL,
        Library::Cupti | Library::Mspti => &[],
    }
}

/// The code's name in its library's header ("cudaErrorIllegalAddress"),
/// or "<library> error <code>" for a code the table lacks.
pub fn status_name(library: Library, code: i64) -> String {
    match table(library).iter().find(|(c, _)| *c == code) {
        Some((_, name)) => (*name).to_string(),
        None => format!("{} error {code}", library.name()),
    }
}

/// Whether `code` says the device had no memory for the request: the
/// one status `device_oom` is about (every other failure of an
/// allocation is a device error).
pub fn is_out_of_memory(library: Library, code: i64) -> bool {
    match library {
        // cudaErrorMemoryAllocation (CUDA_ERROR_OUT_OF_MEMORY is 2 too).
        Library::Cudart | Library::Cuda => code == 2,
        // ACL_ERROR_BAD_ALLOC, ACL_ERROR_RT_MEMORY_ALLOCATION.
        Library::AscendCl | Library::AscendRuntime => matches!(code, 200000 | 207001 | 207018),
        // HCCL_E_MEMORY: the library could not get its buffers.
        Library::Hccl => matches!(code, 3 | 24),
        Library::Nccl | Library::Cupti | Library::Mspti => false,
    }
}

/// Whether `code` is a routine answer, not a failure: a query that says
/// "not yet" (`cudaErrorNotReady`, `ACL_ERROR_RT_EVENT_NOT_COMPLETE`), a
/// non-blocking communicator still connecting (`ncclInProgress`,
/// `HCCL_E_AGAIN`), a repeated set-up the library tolerates, the runtime
/// unloading at process exit.
pub fn is_routine(library: Library, code: i64) -> bool {
    match library {
        Library::Cudart => matches!(code, 4 | 600 | 704),
        // CUDA_ERROR_DEINITIALIZED (at exit), CUDA_ERROR_NOT_READY.
        Library::Cuda => matches!(code, 4 | 600),
        Library::Nccl => code == 7,
        Library::AscendCl | Library::AscendRuntime => matches!(code, 100002 | 507004 | 507006),
        Library::Hccl => code == 20,
        Library::Cupti | Library::Mspti => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_is_only_the_memory_codes() {
        assert!(is_out_of_memory(Library::Cudart, 2));
        for sticky in [700, 214, 719, 100, 35] {
            assert!(!is_out_of_memory(Library::Cudart, sticky), "{sticky}");
        }
        assert!(is_out_of_memory(Library::AscendCl, 207001));
        assert!(is_out_of_memory(Library::AscendCl, 207018));
        assert!(!is_out_of_memory(Library::AscendCl, 507000));
        assert!(is_out_of_memory(Library::Hccl, 24));
        assert!(!is_out_of_memory(Library::Hccl, 21));
    }

    /// A query that is not done yet is routine; a vector core's timeout,
    /// one code away, is a failure.
    #[test]
    fn not_ready_answers_are_routine_and_nothing_next_to_them() {
        assert!(is_routine(Library::AscendCl, 507006));
        assert!(is_routine(Library::AscendCl, 507004));
        assert!(!is_routine(Library::AscendCl, 507034));
        assert_eq!(
            status_name(Library::AscendCl, 507034),
            "ACL_ERROR_RT_VECTOR_CORE_TIMEOUT"
        );
    }

    #[test]
    fn codes_are_named_as_the_headers_name_them() {
        assert_eq!(status_name(Library::Cudart, 700), "cudaErrorIllegalAddress");
        assert_eq!(
            status_name(Library::Cudart, 214),
            "cudaErrorECCUncorrectable"
        );
        assert_eq!(
            status_name(Library::AscendCl, 207001),
            "ACL_ERROR_RT_MEMORY_ALLOCATION"
        );
        assert_eq!(status_name(Library::Cudart, 12345), "cudart error 12345");
        assert!(is_routine(Library::Cudart, 600));
        assert_eq!(status_name(Library::Cuda, 2), "CUDA_ERROR_OUT_OF_MEMORY");
        assert!(is_out_of_memory(Library::Cuda, 2));
        assert!(!is_out_of_memory(Library::Cuda, 700));
        assert!(is_routine(Library::Cuda, 600));
        assert!(!is_routine(Library::Cudart, 700));
        // The CANN runtime returns AscendCL's external codes.
        assert_eq!(
            status_name(Library::AscendRuntime, 207001),
            "ACL_ERROR_RT_MEMORY_ALLOCATION"
        );
        assert!(is_out_of_memory(Library::AscendRuntime, 207001));
        assert!(is_routine(Library::AscendRuntime, 507006));
        assert!(!is_out_of_memory(Library::AscendRuntime, 507000));
    }
}
