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

    /// A user frame of function `name` in `/bin/x` (tests).
    #[cfg(test)]
    pub fn named(name: &str) -> Self {
        SymFrame {
            function: Arc::from(name),
            module: Arc::from("/bin/x"),
            module_start: 0,
            module_end: 0,
            module_offset: 0,
            rel_pc: 0,
        }
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

    /// The kernel function the task waits in (past the scheduler's own).
    pub fn kernel_wait(&self) -> Option<&SymFrame> {
        self.kernel
            .iter()
            .find(|f| !is_scheduler_frame(&f.function))
    }

    /// The job's own frames, innermost first: the Python frames where the
    /// stack has them, else the user frames outside the C library and the
    /// loader (wrappers, not the reason for a wait).
    pub fn own_frames(&self) -> Vec<&SymFrame> {
        let python: Vec<&SymFrame> = self.user.iter().filter(|f| is_python_frame(f)).collect();
        if !python.is_empty() {
            return python;
        }
        self.user
            .iter()
            .filter(|f| !is_system_library(&f.module))
            .collect()
    }

    /// "in do_nanosleep <- stuck_before_collective (rank.py:274) <-
    /// train_step (rank.py:404)": where the task waits, and up to `depth`
    /// of the job's own frames.
    pub fn wait_words(&self, depth: usize) -> String {
        let own: Vec<&str> = self
            .own_frames()
            .into_iter()
            .take(depth)
            .map(|f| &*f.function)
            .collect();
        let mut words = match self.kernel_wait() {
            Some(k) => format!("in {}", k.function),
            None => String::new(),
        };
        for f in own {
            if words.is_empty() {
                words.push_str("in ");
                words.push_str(f);
            } else {
                words.push_str(" <- ");
                words.push_str(f);
            }
        }
        words
    }
}

/// Kernel frames of the scheduler itself, skipped when naming a wait.
pub fn is_scheduler_frame(name: &str) -> bool {
    matches!(
        name,
        "__schedule" | "schedule" | "__switch_to" | "__switch_to_asm" | "preempt_schedule_common"
    ) || name.starts_with("schedule_")
        || name.starts_with("preempt_schedule")
        || name.starts_with("__cond_resched")
        || name.starts_with("entry_SYSCALL")
        || name.starts_with("do_syscall")
}

/// The C library and the dynamic loader: wrappers, not the reason for a wait.
pub fn is_system_library(module: &str) -> bool {
    let file = module.rsplit('/').next().unwrap_or(module);
    [
        "libc.so",
        "libc-",
        "libpthread",
        "ld-linux",
        "libm.so",
        "librt",
    ]
    .iter()
    .any(|p| file.starts_with(p))
}

/// The mapping name prefix of Python frames (`[python] /path/file.py`).
pub const PYTHON_MODULE_PREFIX: &str = "[python] ";

pub fn is_python_frame(f: &SymFrame) -> bool {
    f.module.starts_with(PYTHON_MODULE_PREFIX)
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
