//! One call, not two: libcudart makes its calls through the driver
//! (`libcuda.so.1`), on the same thread, inside its own call
//! (`cudaLaunchKernel` -> `cuLaunchKernel`, `cudaMalloc` ->
//! `cuMemAlloc_v2`, `cudaStreamSynchronize` -> `cuStreamSynchronize`).
//! A driver call made inside a runtime call of the same sort is that
//! runtime call's own work: it is folded into it (the runtime call is what
//! the application made, and it keeps its own arguments, memory effect and
//! times; a folded launch lends it the kernel's name). A driver call made
//! directly (NCCL, cuBLAS, Triton) or inside a runtime call of another sort
//! (a lazy `cuModuleGetFunction` inside a first launch) stays a call.

use crate::catalog::{CallKind, LaunchKind, Library};

/// Whether driver call `inner`, made inside runtime call `outer` on the
/// same thread, is `outer`'s own work.
pub fn folds_into(inner: (Library, CallKind), outer: (Library, CallKind)) -> bool {
    if inner.0 != Library::Cuda || outer.0 != Library::Cudart {
        return false;
    }
    sort(inner.1).is_some() && sort(inner.1) == sort(outer.1)
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
}
