//! The kernel effects the supervisor uses besides the device probes: the
//! traced set, and the drop and skip counters. (The runtime configuration
//! is written at load, and its device levels by the device probes'
//! [`super::probes::Attacher`].)
//! [`super::Kernel`] does them over aya; [`FakeKernel`] (tests) keeps them
//! in memory, so supervisor logic is tested without root.

use xpuscope_common::DROP_SLOTS;

use super::error::KernelError;

pub trait KernelControl {
    /// Adds `tgid` to the traced set (`TARGETS`); its children follow on
    /// fork, and it leaves the set when its last thread exits.
    fn add_target(&mut self, tgid: u32) -> Result<(), KernelError>;

    /// The traced tgids now (children the kernel added on fork included,
    /// processes that exited removed).
    fn targets(&self) -> Vec<u32>;

    /// Records that could not be reserved: per `EventKind` slot, per CPU.
    fn drops(&self) -> Vec<Vec<u64>>;

    /// Runs the kernel skipped because a program would have re-entered
    /// itself on a CPU, per `EventKind` slot. Read before detaching.
    fn kernel_skips(&self) -> Vec<u64>;

    /// Drops per `EventKind` slot, summed over CPUs.
    fn drops_by_kind(&self) -> Vec<u64> {
        let mut out = vec![0; DROP_SLOTS as usize];
        for (slot, cpus) in self.drops().iter().enumerate() {
            if let Some(o) = out.get_mut(slot) {
                *o = cpus.iter().sum();
            }
        }
        out
    }
}

/// The kernel side in memory, for tests: targets, counters and the
/// configuration are plain fields the test sets and reads.
#[cfg(test)]
#[derive(Debug, Default)]
pub struct FakeKernel {
    pub targets: std::collections::BTreeSet<u32>,
    /// Bumped at every change of `targets`, like `TARGET_GEN`.
    pub generation: u64,
    pub drops: Vec<Vec<u64>>,
    pub skips: Vec<u64>,
    /// `add_target` fails (a full `TARGETS` map).
    pub full: bool,
}

#[cfg(test)]
impl KernelControl for FakeKernel {
    fn add_target(&mut self, tgid: u32) -> Result<(), KernelError> {
        if self.full {
            return Err(KernelError::Injected(format!("TARGETS full at {tgid}")));
        }
        self.targets.insert(tgid);
        self.generation += 1;
        Ok(())
    }

    fn targets(&self) -> Vec<u32> {
        self.targets.iter().copied().collect()
    }

    fn drops(&self) -> Vec<Vec<u64>> {
        self.drops.clone()
    }

    fn kernel_skips(&self) -> Vec<u64> {
        self.skips.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_by_kind_sums_cpus_per_slot() {
        let mut k = FakeKernel {
            drops: vec![vec![1, 2], vec![], vec![0, 5, 5]],
            ..FakeKernel::default()
        };
        let by_kind = k.drops_by_kind();
        assert_eq!(by_kind.len(), DROP_SLOTS as usize);
        assert_eq!(&by_kind[..4], &[3, 0, 10, 0]);
        k.add_target(7).unwrap();
        k.add_target(7).unwrap();
        assert_eq!(k.targets(), vec![7]);
        assert_eq!(k.generation, 2);
        k.full = true;
        assert!(k.add_target(8).unwrap_err().to_string().contains("TARGETS"));
    }
}
