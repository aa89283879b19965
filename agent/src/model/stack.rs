//! Symbolized stacks: off-CPU stacks and device-memory allocation sites.

use std::sync::Arc;

/// One symbolized frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymFrame {
    pub function: Arc<str>,
    /// The backing file, `"kernel"`, or a pseudo name (`[vdso]`, `[anon]`).
    pub module: Arc<str>,
    pub module_start: u64,
    pub module_end: u64,
    /// File offset at which the module's mapping starts.
    pub module_offset: u64,
    /// Offset in the module's file (kernel: the address itself).
    pub rel_pc: u64,
}

impl SymFrame {
    pub fn is_kernel(&self) -> bool {
        &*self.module == "kernel"
    }
}

/// A symbolized off-CPU stack.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Stack {
    /// Leaf first.
    pub kernel: Vec<SymFrame>,
    /// Leaf first.
    pub user: Vec<SymFrame>,
}

impl Stack {
    /// All frames leaf first: kernel frames (innermost) then user frames.
    pub fn leaf_first(&self) -> impl Iterator<Item = &SymFrame> {
        self.kernel.iter().chain(self.user.iter())
    }
}

/// A device-memory allocation site: a distinct user stack of a process that
/// allocated device memory, with an id unique in the recording.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    pub id: u64,
    pub tgid: u32,
    /// Leaf (the allocating call's caller) first.
    pub frames: Vec<SymFrame>,
    /// "cache_activations < forward < train_step < main".
    pub label: String,
}

/// The label of an optional site ("(unknown)" for allocations without a
/// stack).
pub fn site_label(site: Option<&Arc<Site>>) -> String {
    site.map(|s| s.label.clone())
        .unwrap_or_else(|| "(unknown)".into())
}
