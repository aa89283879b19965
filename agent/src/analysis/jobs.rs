//! Which job a traced process belongs to, by the job label of its rank
//! identity (`RankIdentity::job`): a process takes its own label, else
//! the label of the traced process it was forked from (a rank's data
//! loader workers are of the rank's job). A preemptor traced along with
//! a rank but labelled with another job is not the rank's own business:
//! a service traces every job on its node, and one job's threads taking
//! another's CPUs is interference. Unlabelled processes are taken as of
//! the job (a job launched without a label, its launcher, its helpers).
//!
//! Both drivers keep one: the live interpreter from its identity records
//! and forks, the offline reader from the trace's process labels and
//! new-task events.

use rustc_hash::FxHashMap;
use std::sync::Arc;

/// Processes forked from traced ones, kept to label them: at most this
/// many (the oldest links go first past it).
const MAX_LINKS: usize = 1 << 16;

#[derive(Default)]
pub struct JobLabels {
    labels: FxHashMap<u32, Arc<str>>,
    /// Process -> the process it was forked from.
    parents: FxHashMap<u32, u32>,
}

impl JobLabels {
    /// `tgid`'s identity names job `job` (None: no label): its label, and
    /// that of the processes forked from it (transitively) before it was
    /// known, unless they have their own.
    pub fn identified(&mut self, tgid: u32, job: Option<&str>) {
        let Some(job) = job.filter(|j| !j.is_empty()) else {
            return;
        };
        let job: Arc<str> = Arc::from(job);
        self.labels.insert(tgid, job.clone());
        let mut from = vec![tgid];
        // Bounded: each process is labelled once here.
        while let Some(p) = from.pop() {
            let children: Vec<u32> = self
                .parents
                .iter()
                .filter(|&(c, parent)| *parent == p && !self.labels.contains_key(c))
                .map(|(c, _)| *c)
                .collect();
            for c in children {
                self.labels.insert(c, job.clone());
                from.push(c);
            }
        }
    }

    /// Process `child` was forked from `parent`: of its job.
    pub fn forked(&mut self, child: u32, parent: u32) {
        if child == parent {
            return;
        }
        if self.parents.len() >= MAX_LINKS {
            self.parents.clear();
        }
        self.parents.insert(child, parent);
        if let Some(job) = self.labels.get(&parent).cloned() {
            self.labels.entry(child).or_insert(job);
        }
    }

    /// Process `tgid` ended (its pid may come back as another process).
    pub fn ended(&mut self, tgid: u32) {
        self.labels.remove(&tgid);
        self.parents.remove(&tgid);
    }

    /// Whether `a` and `b` are labelled with two different jobs.
    pub fn different(&self, a: u32, b: u32) -> bool {
        match (self.labels.get(&a), self.labels.get(&b)) {
            (Some(x), Some(y)) => x != y,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_of_its_label_or_of_the_process_it_was_forked_from() {
        let mut j = JobLabels::default();
        j.identified(10, Some("job-a"));
        // A worker forked from rank 10 after its identity, another from
        // rank 20 before its identity was known.
        j.forked(11, 10);
        j.forked(21, 20);
        j.forked(22, 21);
        j.identified(20, Some("job-b"));
        assert!(j.different(10, 20));
        assert!(j.different(10, 22), "a grandchild of job b's rank");
        assert!(!j.different(10, 11), "its own worker");
        assert!(!j.different(20, 21));
        // Unlabelled: the job's launcher, an unlabelled job.
        assert!(!j.different(10, 99));
        // No label, or an empty one, labels nothing.
        j.identified(30, None);
        j.identified(31, Some(""));
        assert!(!j.different(10, 30) && !j.different(10, 31));
        // A pid back as another process is of no job until told.
        j.ended(20);
        assert!(!j.different(10, 20));
        // A worker with a label of its own keeps it.
        j.identified(40, Some("job-c"));
        j.forked(41, 10);
        j.identified(41, Some("job-c"));
        assert!(j.different(10, 41) && !j.different(40, 41));
    }
}
