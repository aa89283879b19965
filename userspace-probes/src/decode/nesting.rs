//! One call, not two: the libraries applications call make their calls
//! through a library below, on the same thread, inside their own call.
//! libcudart calls the CUDA driver (`libcuda.so.1`: `cudaLaunchKernel` ->
//! `cuLaunchKernel`, `cudaMalloc` -> `cuMemAlloc_v2`,
//! `cudaStreamSynchronize` -> `cuStreamSynchronize`); AscendCL calls the
//! CANN runtime (`libruntime.so`: `aclrtLaunchKernel` ->
//! `rtLaunchKernelByFuncHandleV3`, `aclrtMalloc` -> `rtMalloc`, `aclrtFree`
//! -> `rtFree`, `aclrtSynchronizeStream` -> `rtStreamSynchronize`, ...).
//! A lower call made inside an upper call of the same sort is that upper
//! call's own work: it is folded into it (the upper call is what the
//! application made, and it keeps its own arguments, memory effect and
//! times; a folded launch lends it the kernel's name). A lower call made
//! directly (NCCL, cuBLAS, Triton; HCCL, operator libraries) or inside an
//! upper call of another sort (a lazy `cuModuleGetFunction` inside a first
//! launch) stays a call.

use xpuscope_common::uprobe::{COUNT_GRAPH, COUNT_LAUNCH_LOWER, COUNT_LAUNCH_UPPER};

use crate::catalog::{CallKind, LaunchKind, Library};

/// Whether call `inner`, made inside call `outer` on the same thread, is
/// `outer`'s own work.
pub fn folds_into(inner: (Library, CallKind), outer: (Library, CallKind)) -> bool {
    below(outer.0) == Some(inner.0) && sort(inner.1).is_some() && sort(inner.1) == sort(outer.1)
}

/// The kernel's launch-counting flags of a function (`ProbeSpec::flags`):
/// the kernel counts every launch at every level, and a lower launch made
/// inside an upper one counts once, as the fold above does for records.
pub fn launch_count_flags(library: Library, kind: CallKind) -> u16 {
    let graph = match sort(kind) {
        Some(Sort::KernelLaunch) => 0,
        Some(Sort::GraphLaunch) => COUNT_GRAPH,
        _ => return 0,
    };
    let layer = if below(library).is_some() {
        COUNT_LAUNCH_UPPER
    } else if Library::ALL.into_iter().any(|l| below(l) == Some(library)) {
        COUNT_LAUNCH_LOWER
    } else {
        return 0;
    };
    layer | graph
}

/// Whether a call's return carries its process's launch counts: the calls
/// a step boundary can be (syncs, collectives, the job's markers); other
/// returns skip the kernel's lookup.
pub fn stamps_launch_counts(kind: CallKind) -> bool {
    matches!(
        kind,
        CallKind::Sync(_)
            | CallKind::Collective(_)
            | CallKind::Mark
            | CallKind::RangeStart
            | CallKind::RangeEnd
    )
}

/// The library `upper` makes its launches, allocations and syncs through.
fn below(upper: Library) -> Option<Library> {
    match upper {
        Library::Cudart => Some(Library::Cuda),
        Library::AscendCl => Some(Library::AscendRuntime),
        _ => None,
    }
}

/// Calls of one sort at both levels.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sort {
    KernelLaunch,
    GraphLaunch,
    Alloc,
    Free,
    Sync,
}

fn sort(kind: CallKind) -> Option<Sort> {
    Some(match kind {
        CallKind::Launch(LaunchKind::Kernel | LaunchKind::KernelExC) => Sort::KernelLaunch,
        CallKind::Launch(LaunchKind::Graph) => Sort::GraphLaunch,
        CallKind::Malloc => Sort::Alloc,
        CallKind::Free => Sort::Free,
        CallKind::Sync(_) => Sort::Sync,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::SyncKind;

    fn kind(lib: Library, name: &str) -> (Library, CallKind) {
        (lib, lib.function(name).unwrap().kind)
    }

    #[test]
    fn launches_count_at_their_layer_and_nothing_else_counts() {
        let flags = |lib: Library, name: &str| launch_count_flags(lib, kind(lib, name).1);
        assert_eq!(
            flags(Library::Cudart, "cudaLaunchKernel"),
            COUNT_LAUNCH_UPPER
        );
        assert_eq!(
            flags(Library::Cudart, "cudaGraphLaunch"),
            COUNT_LAUNCH_UPPER | COUNT_GRAPH
        );
        assert_eq!(flags(Library::Cuda, "cuLaunchKernel"), COUNT_LAUNCH_LOWER);
        assert_eq!(flags(Library::Cuda, "cuLaunchKernelEx"), COUNT_LAUNCH_LOWER);
        assert_eq!(
            flags(Library::Cuda, "cuGraphLaunch"),
            COUNT_LAUNCH_LOWER | COUNT_GRAPH
        );
        assert_eq!(
            flags(Library::AscendCl, "aclrtLaunchKernel"),
            COUNT_LAUNCH_UPPER
        );
        assert_eq!(flags(Library::Cuda, "cuMemAlloc_v2"), 0);
        assert_eq!(flags(Library::Cudart, "cudaStreamSynchronize"), 0);
        // Every launch of a layered library counts.
        let layered = |lib: Library| {
            below(lib).is_some() || Library::ALL.into_iter().any(|l| below(l) == Some(lib))
        };
        for (lib, f) in crate::catalog::all_functions() {
            if matches!(f.kind, CallKind::Launch(_)) && layered(lib) {
                assert_ne!(launch_count_flags(lib, f.kind), 0, "{}", f.name);
            }
        }
    }

    #[test]
    fn driver_calls_fold_into_runtime_calls_of_their_sort() {
        let folds = [
            ("cuLaunchKernel", "cudaLaunchKernel"),
            ("cuLaunchKernel_ptsz", "cudaLaunchKernel_ptsz"),
            ("cuLaunchKernelEx", "cudaLaunchKernelExC"),
            ("cuLaunchKernel", "__cudaLaunchKernel"),
            ("cuGraphLaunch", "cudaGraphLaunch"),
            ("cuMemAlloc_v2", "cudaMalloc"),
            ("cuMemAllocAsync", "cudaMallocAsync"),
            ("cuMemFree_v2", "cudaFree"),
            ("cuMemFreeAsync", "cudaFreeAsync"),
            ("cuStreamSynchronize", "cudaStreamSynchronize"),
            ("cuEventSynchronize", "cudaEventSynchronize"),
            ("cuCtxSynchronize", "cudaDeviceSynchronize"),
        ];
        for (inner, outer) in folds {
            assert!(
                folds_into(kind(Library::Cuda, inner), kind(Library::Cudart, outer)),
                "{inner} in {outer}"
            );
        }
        let apart = [
            // Another sort: a lazy module load inside a first launch, a
            // sync inside a free, a graph inside a kernel launch.
            ("cuModuleGetFunction", "cudaLaunchKernel"),
            ("cuCtxSynchronize", "cudaFree"),
            ("cuGraphLaunch", "cudaLaunchKernel"),
            ("cuMemMap", "cudaMalloc"),
            ("cuMemAlloc_v2", "cudaFree"),
        ];
        for (inner, outer) in apart {
            assert!(
                !folds_into(kind(Library::Cuda, inner), kind(Library::Cudart, outer)),
                "{inner} in {outer}"
            );
        }
        // Driver calls from NCCL (or any other library) stay calls, and a
        // runtime call is never folded.
        assert!(!folds_into(
            kind(Library::Cuda, "cuLaunchKernelEx"),
            kind(Library::Nccl, "ncclAllReduce")
        ));
        assert!(!folds_into(
            (Library::Cudart, CallKind::Sync(SyncKind::Stream)),
            (Library::Cudart, CallKind::Sync(SyncKind::Stream))
        ));
        assert!(!folds_into(
            kind(Library::Cuda, "cuLaunchKernel"),
            kind(Library::Cuda, "cuLaunchKernel")
        ));
    }

    #[test]
    fn cann_runtime_calls_fold_into_ascendcl_calls_of_their_sort() {
        let rt = Library::AscendRuntime;
        let acl = Library::AscendCl;
        let folds = [
            ("rtLaunchKernelByFuncHandleV3", "aclrtLaunchKernel"),
            ("rtKernelLaunch", "aclrtLaunchKernel"),
            ("rtKernelLaunchWithFlag", "aclrtLaunchKernel"),
            ("rtMalloc", "aclrtMalloc"),
            ("rtFree", "aclrtFree"),
            ("rtStreamSynchronize", "aclrtSynchronizeStream"),
            ("rtStreamSynchronize", "aclrtSynchronizeStreamWithTimeout"),
            ("rtEventSynchronize", "aclrtSynchronizeEvent"),
            ("rtDeviceSynchronize", "aclrtSynchronizeDevice"),
        ];
        for (inner, outer) in folds {
            assert!(
                folds_into(kind(rt, inner), kind(acl, outer)),
                "{inner} in {outer}"
            );
        }
        // Another sort: a name lookup inside a launch, a sync inside a free.
        for (inner, outer) in [
            ("rtsFuncGetByName", "aclrtLaunchKernel"),
            ("rtDeviceSynchronize", "aclrtFree"),
            ("rtMalloc", "aclrtLaunchKernel"),
        ] {
            assert!(
                !folds_into(kind(rt, inner), kind(acl, outer)),
                "{inner} in {outer}"
            );
        }
        // HCCL's and operator libraries' runtime calls stay calls; the
        // libraries do not cross vendors.
        assert!(!folds_into(
            kind(rt, "rtKernelLaunch"),
            kind(Library::Hccl, "HcclAllReduce")
        ));
        assert!(!folds_into(
            kind(rt, "rtKernelLaunch"),
            kind(Library::Cudart, "cudaLaunchKernel")
        ));
        assert!(!folds_into(
            kind(Library::Cuda, "cuLaunchKernel"),
            kind(acl, "aclrtLaunchKernel")
        ));
        assert!(!folds_into(
            kind(acl, "aclrtMalloc"),
            kind(acl, "aclrtMalloc")
        ));
    }
}
