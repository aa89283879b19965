//! Symbolized off-CPU stacks kept by their addresses, so a thread that
//! blocks again where it blocked before gets the same [`Stack`] (one `Arc`)
//! without symbolizing it again, and sinks that key on the `Arc` (the
//! Perfetto sink's callstack ids) skip their conversion as well.
//!
//! A training thread blocks at a handful of places, thousands of times a
//! second with stacks at every switch: symbolizing each stack anew (frames
//! built, names cloned, dropped again) was most of the agent's cost per
//! stack.
//!
//! Only what the addresses alone decide is kept: a stack with Python frames
//! read from the live process is not (those frames change while the
//! addresses stay). Entries of a process go when it ends, execs or changes
//! its link map (its addresses may mean other code then); the whole memo
//! is bounded in entries.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHasher};

use crate::model::Stack;

/// Most stacks kept (all processes); past it the memo starts over.
pub const MAX_STACKS: usize = 16_384;

struct Entry {
    tgid: u32,
    kernel: Box<[u64]>,
    user: Box<[u64]>,
    truncated: bool,
    stack: Arc<Stack>,
}

impl Entry {
    fn is(&self, key: &StackKey<'_>) -> bool {
        self.tgid == key.tgid
            && self.truncated == key.truncated
            && *self.kernel == *key.kernel
            && *self.user == *key.user
    }
}

/// A stack's identity: its process and addresses (leaf first), and whether
/// the user part was cut short.
#[derive(Clone, Copy, Debug)]
pub struct StackKey<'a> {
    pub tgid: u32,
    pub kernel: &'a [u64],
    pub user: &'a [u64],
    pub truncated: bool,
}

impl StackKey<'_> {
    fn hash(&self) -> u64 {
        let mut h = FxHasher::default();
        self.tgid.hash(&mut h);
        self.kernel.hash(&mut h);
        self.user.hash(&mut h);
        self.truncated.hash(&mut h);
        h.finish()
    }
}

/// Symbolized stacks by their addresses (see the module docs).
#[derive(Default)]
pub struct StackMemo {
    /// By the key's hash; a colliding key replaces the entry.
    entries: FxHashMap<u64, Entry>,
    pub hits: u64,
}

impl StackMemo {
    /// The stack symbolized before for `key`, if any.
    pub fn get(&mut self, key: &StackKey<'_>) -> Option<Arc<Stack>> {
        let e = self.entries.get(&key.hash()).filter(|e| e.is(key))?;
        self.hits += 1;
        Some(e.stack.clone())
    }

    /// Keeps `stack` as what `key` symbolizes to.
    pub fn insert(&mut self, key: &StackKey<'_>, stack: Arc<Stack>) {
        if self.entries.len() >= MAX_STACKS {
            self.entries.clear();
        }
        self.entries.insert(
            key.hash(),
            Entry {
                tgid: key.tgid,
                kernel: key.kernel.into(),
                user: key.user.into(),
                truncated: key.truncated,
                stack,
            },
        );
    }

    /// Forgets the stacks of process `tgid` (it ended, exec'd or mapped
    /// other code).
    pub fn forget_process(&mut self, tgid: u32) {
        self.entries.retain(|_, e| e.tgid != tgid);
    }

    /// Stacks kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SymFrame;

    fn stack(name: &str) -> Arc<Stack> {
        Arc::new(Stack {
            kernel: vec![],
            user: vec![SymFrame::named(name)],
        })
    }

    fn key<'a>(tgid: u32, kernel: &'a [u64], user: &'a [u64]) -> StackKey<'a> {
        StackKey {
            tgid,
            kernel,
            user,
            truncated: false,
        }
    }

    #[test]
    fn the_same_addresses_give_the_same_stack_and_any_difference_misses() {
        let mut m = StackMemo::default();
        let a = stack("a");
        m.insert(&key(1, &[10, 11], &[20, 21]), a.clone());
        let got = m.get(&key(1, &[10, 11], &[20, 21])).unwrap();
        assert!(Arc::ptr_eq(&got, &a));
        assert!(
            m.get(&key(2, &[10, 11], &[20, 21])).is_none(),
            "other process"
        );
        assert!(m.get(&key(1, &[10], &[20, 21])).is_none(), "kernel differs");
        assert!(
            m.get(&key(1, &[10, 11], &[20, 22])).is_none(),
            "user differs"
        );
        assert!(
            m.get(&key(1, &[10, 11, 20], &[21])).is_none(),
            "split differs"
        );
        let mut truncated = key(1, &[10, 11], &[20, 21]);
        truncated.truncated = true;
        assert!(m.get(&truncated).is_none(), "truncation differs");
        assert_eq!(m.hits, 1);
    }

    #[test]
    fn a_process_s_stacks_go_with_it_and_the_memo_is_bounded() {
        let mut m = StackMemo::default();
        m.insert(&key(1, &[1], &[2]), stack("a"));
        m.insert(&key(2, &[1], &[2]), stack("b"));
        m.forget_process(1);
        assert!(m.get(&key(1, &[1], &[2])).is_none());
        assert!(m.get(&key(2, &[1], &[2])).is_some());
        for i in 0..(MAX_STACKS as u64 + 10) {
            m.insert(&key(3, &[i], &[]), stack("c"));
            assert!(m.len() <= MAX_STACKS);
        }
    }
}
