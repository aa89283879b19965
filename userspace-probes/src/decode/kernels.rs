//! Kernel names by handle, per process.
//!
//! The CUDA driver's launches (`cuLaunchKernel(CUfunction f, ...)`) and the
//! CANN runtime's (`rtKernelLaunch(stubFunc, ...)`,
//! `rtLaunchKernelByFuncHandleV3(funcHandle, ...)`) carry a handle, not a
//! name. The calls that hand handles out name them:
//! `cuModuleGetFunction(&f, module, "name")` and
//! `cuLibraryGetKernel(&k, library, "name")` (a `CUkernel` may be launched
//! as a `CUfunction`), and `cuKernelGetFunction(&f, k)` gives `f` the name
//! of `k`; `rtFunctionRegister(bin, stub, "name", ...)` (the stub is passed
//! in), `rtGetFunctionByName("name", &stub)`, `rtsFuncGetByName(bin,
//! "name", &h)`. Both libraries' handles share one table per process: each
//! is an address in that process, so two live handles never coincide.
//! Names are the traced process's bytes: cut at the entry copy's length,
//! and at most [`MAX_KERNEL_HANDLES`] handles are remembered per process
//! (the table goes with the process).

use foldhash::HashMap;
use std::sync::Arc;

/// Most handles named per process (a large model has thousands of kernels).
pub const MAX_KERNEL_HANDLES: usize = 1 << 16;

/// Handle -> kernel name of one process.
#[derive(Clone, Debug, Default)]
pub struct KernelNames {
    names: HashMap<u64, Arc<str>>,
    /// Handles not named because of [`MAX_KERNEL_HANDLES`].
    pub unremembered: u64,
}

impl KernelNames {
    /// `handle` names kernel `name` (a handle given out again names the
    /// latest kernel: the driver reused it after a module was unloaded).
    pub fn learn(&mut self, handle: u64, name: &str) {
        if handle == 0 || name.is_empty() {
            return;
        }
        self.insert(handle, Arc::from(name));
    }

    /// `handle` runs the kernel `of` names (`cuKernelGetFunction`).
    pub fn alias(&mut self, handle: u64, of: u64) {
        if handle == 0 {
            return;
        }
        if let Some(name) = self.names.get(&of).cloned() {
            self.insert(handle, name);
        }
    }

    pub fn name(&self, handle: u64) -> Option<&str> {
        self.names.get(&handle).map(|n| &**n)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    fn insert(&mut self, handle: u64, name: Arc<str>) {
        if self.names.len() >= MAX_KERNEL_HANDLES && !self.names.contains_key(&handle) {
            self.unremembered += 1;
            return;
        }
        self.names.insert(handle, name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_name_kernels_and_aliases_follow() {
        let mut k = KernelNames::default();
        k.learn(0x5000, "gemm_bf16");
        k.learn(0x6000, "softmax");
        // cuKernelGetFunction: a CUfunction of the CUkernel 0x6000.
        k.alias(0x7000, 0x6000);
        assert_eq!(k.name(0x5000), Some("gemm_bf16"));
        assert_eq!(k.name(0x7000), Some("softmax"));
        // An alias of an unknown kernel, a null handle, an empty name: nothing.
        k.alias(0x8000, 0x9999);
        k.learn(0, "null");
        k.learn(0xa000, "");
        assert_eq!(
            (k.name(0x8000), k.name(0), k.name(0xa000)),
            (None, None, None)
        );
        // A handle given out again names the latest kernel.
        k.learn(0x5000, "gemm_fp8");
        assert_eq!(k.name(0x5000), Some("gemm_fp8"));
        assert_eq!(k.len(), 3);
    }

    #[test]
    fn the_table_is_capped() {
        let mut k = KernelNames::default();
        for h in 1..=MAX_KERNEL_HANDLES as u64 {
            k.learn(h, "k");
        }
        k.learn(u64::MAX, "one too many");
        assert_eq!((k.len(), k.unremembered), (MAX_KERNEL_HANDLES, 1));
        assert_eq!(k.name(u64::MAX), None);
        // Known handles are still renamed.
        k.learn(1, "renamed");
        assert_eq!(k.name(1), Some("renamed"));
    }
}
