//! A trace's scheduler switches, as both offline readers of off-CPU time
//! take them (`agent diagnose`'s intervals, `agent merge`'s step
//! breakdown): which task each CPU runs, so a switch ("CPU 3 now runs
//! task N") says who left a CPU and who came back; and which off-CPU
//! stack was taken at a switch. (The live interpret stage is told both
//! tasks of a switch by the kernel, in order: it needs neither.)

/// Off-CPU stacks within this of a switch were taken at that switch.
pub const SAME_SWITCH_NS: u64 = 2_000;

/// What a switch changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switched {
    /// Not a CPU: past Perfetto's limit (the agent never writes one; a
    /// trace file's CPU number must not size a table).
    NotACpu,
    /// The task already running (nothing left or came back).
    Same,
    /// `left` (None: unknown, the CPU's first switch) left the CPU and
    /// the switch's task came on it.
    Changed { left: Option<i32> },
}

/// The task running on each CPU, by the switches so far.
#[derive(Default)]
pub struct CpuRunning {
    running: Vec<Option<i32>>,
}

impl CpuRunning {
    /// A switch on `cpu` to task `next`.
    pub fn switch(&mut self, cpu: u32, next: i32) -> Switched {
        if cpu >= xpuscope_common::MAX_CPUS {
            return Switched::NotACpu;
        }
        let slot = cpu as usize;
        if slot >= self.running.len() {
            self.running.resize(slot + 1, None);
        }
        let left = self.running[slot].replace(next);
        if left == Some(next) {
            Switched::Same
        } else {
            Switched::Changed { left }
        }
    }
}

/// The stack (or what is kept of it) taken at the switch at `ts`: the
/// nearest of `stacks` (in time order) within [`SAME_SWITCH_NS`].
pub fn taken_at_switch<T>(stacks: &[(u64, T)], ts: u64) -> Option<&T> {
    let i = stacks.partition_point(|(t, _)| *t < ts);
    let before = i.checked_sub(1).and_then(|j| stacks.get(j));
    [before, stacks.get(i)]
        .into_iter()
        .flatten()
        .min_by_key(|(t, _)| t.abs_diff(ts))
        .filter(|(t, _)| t.abs_diff(ts) <= SAME_SWITCH_NS)
        .map(|(_, s)| s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_says_who_left_and_a_stack_near_it_was_taken_at_it() {
        let mut cpus = CpuRunning::default();
        assert_eq!(cpus.switch(2, 10), Switched::Changed { left: None });
        assert_eq!(cpus.switch(2, 10), Switched::Same);
        assert_eq!(cpus.switch(2, 11), Switched::Changed { left: Some(10) });
        assert_eq!(cpus.switch(xpuscope_common::MAX_CPUS, 1), Switched::NotACpu);
        let stacks = [(1_000, 'a'), (5_000, 'b'), (5_500, 'c')];
        assert_eq!(taken_at_switch(&stacks, 2_900), Some(&'a'));
        assert_eq!(taken_at_switch(&stacks, 3_100), Some(&'b'));
        assert_eq!(taken_at_switch(&stacks, 5_400), Some(&'c'));
        assert_eq!(taken_at_switch(&stacks, 9_000), None);
    }
}
