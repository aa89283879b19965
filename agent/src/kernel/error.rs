//! What can fail when the agent talks to the kernel programs and maps.

/// A kernel effect that failed: the map, program or attach point is named,
/// and aya's error (with the syscall and any verifier log) is the source.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The embedded object lacks a map or program the agent expects: the
    /// agent and the eBPF object come from different builds.
    #[error("{0} missing from the eBPF object (rebuild both with `cargo xtask build`)")]
    Missing(String),
    #[error("{what}")]
    Map {
        what: String,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("{what}")]
    Program {
        what: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A `bpf(2)` command the agent issues itself (aya has no call for it).
    #[error("{what}")]
    Syscall {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A failure a test fake was told to report.
    #[cfg(test)]
    #[error("injected failure: {0}")]
    Injected(String),
}

impl KernelError {
    pub(crate) fn map(what: impl Into<String>) -> impl FnOnce(aya::maps::MapError) -> Self {
        let what = what.into();
        move |source| KernelError::Map { what, source }
    }

    pub(crate) fn program(
        what: impl Into<String>,
    ) -> impl FnOnce(aya::programs::ProgramError) -> Self {
        let what = what.into();
        move |source| KernelError::Program { what, source }
    }
}
