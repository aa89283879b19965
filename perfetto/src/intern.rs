//! Per-sequence interning: event names, categories, annotation names,
//! function names, mapping paths, build ids, mappings, frames and callstacks.
//!
//! Ids start at 1 per type. A value seen for the first time is also queued in
//! `pending`, which the next packet of the sequence carries as its
//! `interned_data`, so every id is defined in (or before) the packet using it.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;

use crate::proto;
use crate::types::{Frame, Mapping};

/// Maps values to ids 1, 2, 3, ...
#[derive(Debug)]
pub(crate) struct Interner<K> {
    ids: HashMap<K, u64, foldhash::fast::RandomState>,
}

impl<K> Default for Interner<K> {
    fn default() -> Self {
        Interner {
            ids: HashMap::default(),
        }
    }
}

impl<K: Hash + Eq> Interner<K> {
    /// The id of `key` and whether it is new.
    pub(crate) fn intern<Q>(&mut self, key: &Q) -> (u64, bool)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if let Some(&id) = self.ids.get(key) {
            return (id, false);
        }
        let id = self.ids.len() as u64 + 1;
        self.ids.insert(key.to_owned(), id);
        (id, true)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }
}

/// Yields `frames` (given leaf first: user and kernel parts, each innermost
/// first, in either order) root first: user frames outermost to innermost,
/// then kernel frames outermost to innermost.
pub(crate) fn root_first(frames: &[Frame]) -> impl Iterator<Item = &Frame> {
    let user = frames.iter().rev().filter(|f| !f.mapping.is_kernel());
    let kernel = frames.iter().rev().filter(|f| f.mapping.is_kernel());
    user.chain(kernel)
}

/// The interned state of one packet sequence.
#[derive(Default)]
pub(crate) struct SequenceInterner {
    event_names: Interner<String>,
    categories: Interner<String>,
    annotation_names: Interner<String>,
    function_names: Interner<String>,
    mapping_paths: Interner<String>,
    build_ids: Interner<Vec<u8>>,
    mappings: Interner<Mapping>,
    frames: Interner<(u64, u64, u64)>,
    callstacks: Interner<Vec<u64>>,
    /// Frame ids of the callstack being interned (reused).
    scratch: Vec<u64>,
    pending: proto::InternedData,
}

fn named(iid: u64, name: &str) -> proto::NamedIid {
    proto::NamedIid {
        iid: Some(iid),
        name: Some(name.to_owned()),
    }
}

fn interned_string(iid: u64, bytes: &[u8]) -> proto::InternedString {
    proto::InternedString {
        iid: Some(iid),
        str: Some(bytes.to_vec()),
    }
}

fn nonzero(v: u64) -> Option<u64> {
    (v != 0).then_some(v)
}

impl SequenceInterner {
    /// Takes the definitions queued since the last call, if any.
    pub(crate) fn take_pending(&mut self) -> Option<proto::InternedData> {
        if self.pending.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut self.pending))
        }
    }

    pub(crate) fn event_name(&mut self, name: &str) -> u64 {
        let (iid, new) = self.event_names.intern(name);
        if new {
            self.pending.event_names.push(named(iid, name));
        }
        iid
    }

    pub(crate) fn category(&mut self, name: &str) -> u64 {
        let (iid, new) = self.categories.intern(name);
        if new {
            self.pending.event_categories.push(named(iid, name));
        }
        iid
    }

    pub(crate) fn annotation_name(&mut self, name: &str) -> u64 {
        let (iid, new) = self.annotation_names.intern(name);
        if new {
            self.pending.debug_annotation_names.push(named(iid, name));
        }
        iid
    }

    fn mapping(&mut self, m: &Mapping) -> u64 {
        let (iid, new) = self.mappings.intern(m);
        if new {
            let (path_iid, new_path) = self.mapping_paths.intern(m.path.as_str());
            if new_path {
                self.pending
                    .mapping_paths
                    .push(interned_string(path_iid, m.path.as_bytes()));
            }
            let build_id = m.build_id.as_deref().map(|b| {
                let (bid, new_bid) = self.build_ids.intern(b);
                if new_bid {
                    self.pending.build_ids.push(interned_string(bid, b));
                }
                bid
            });
            self.pending.mappings.push(proto::Mapping {
                iid: Some(iid),
                build_id,
                start_offset: nonzero(m.start_offset),
                start: Some(m.start),
                end: Some(m.end),
                load_bias: nonzero(m.load_bias),
                path_string_ids: vec![path_iid],
            });
        }
        iid
    }

    fn frame(&mut self, f: &Frame) -> u64 {
        let (fn_iid, new_fn) = self.function_names.intern(f.function.as_str());
        if new_fn {
            self.pending
                .function_names
                .push(interned_string(fn_iid, f.function.as_bytes()));
        }
        let map_iid = self.mapping(&f.mapping);
        let (iid, new) = self.frames.intern(&(fn_iid, map_iid, f.rel_pc));
        if new {
            self.pending.frames.push(proto::Frame {
                iid: Some(iid),
                function_name_id: Some(fn_iid),
                mapping_id: Some(map_iid),
                rel_pc: Some(f.rel_pc),
            });
        }
        iid
    }

    /// Interns the callstack of `frames` (leaf first, see [`root_first`]);
    /// `None` when there are no frames.
    pub(crate) fn callstack(&mut self, frames: &[Frame]) -> Option<u64> {
        if frames.is_empty() {
            return None;
        }
        let mut ids = std::mem::take(&mut self.scratch);
        ids.clear();
        for f in root_first(frames) {
            ids.push(self.frame(f));
        }
        let (iid, new) = self.callstacks.intern(ids.as_slice());
        if new {
            self.pending.callstacks.push(proto::Callstack {
                iid: Some(iid),
                frame_ids: ids.clone(),
            });
        }
        self.scratch = ids;
        Some(iid)
    }

    /// Distinct callstacks interned so far.
    #[cfg(test)]
    pub(crate) fn callstack_count(&self) -> usize {
        self.callstacks.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn user(name: &str, lib: &Arc<Mapping>) -> Frame {
        Frame::new(name, Arc::clone(lib), 0x100)
    }

    fn names<'a>(it: impl Iterator<Item = &'a Frame>) -> Vec<&'a str> {
        it.map(|f| f.function.as_str()).collect()
    }

    #[test]
    fn interner_ids_start_at_one_and_dedupe() {
        let mut i = Interner::<String>::default();
        assert_eq!(i.intern("a"), (1, true));
        assert_eq!(i.intern("b"), (2, true));
        assert_eq!(i.intern("a"), (1, false));
        assert_eq!(i.len(), 2);
    }

    #[test]
    fn root_first_puts_user_outermost_then_kernel() {
        let lib = Arc::new(Mapping {
            path: "/usr/lib/libc.so.6".into(),
            start: 0x7000,
            end: 0x9000,
            ..Mapping::default()
        });
        let kernel_then_user = vec![
            Frame::kernel("schedule", 1),
            Frame::kernel("do_syscall_64", 2),
            user("futex_wait", &lib),
            user("main", &lib),
        ];
        let want = ["main", "futex_wait", "do_syscall_64", "schedule"];
        assert_eq!(names(root_first(&kernel_then_user)), want);
        let user_then_kernel = vec![
            user("futex_wait", &lib),
            user("main", &lib),
            Frame::kernel("schedule", 1),
            Frame::kernel("do_syscall_64", 2),
        ];
        assert_eq!(names(root_first(&user_then_kernel)), want);
        let kernel_only = vec![Frame::kernel("schedule", 1), Frame::kernel("kthread", 2)];
        assert_eq!(names(root_first(&kernel_only)), ["kthread", "schedule"]);
    }

    #[test]
    fn callstacks_are_deduped_and_defined_once() {
        let lib = Arc::new(Mapping {
            path: "/lib/libx.so".into(),
            build_id: Some(vec![0xab, 0xcd]),
            start: 0x1000,
            end: 0x2000,
            ..Mapping::default()
        });
        let stack = vec![
            Frame::kernel("schedule", 7),
            user("f", &lib),
            user("main", &lib),
        ];
        let mut s = SequenceInterner::default();
        let a = s.callstack(&stack).unwrap();
        let first = s.take_pending().unwrap();
        assert_eq!(first.callstacks.len(), 1);
        assert_eq!(first.frames.len(), 3);
        assert_eq!(first.mappings.len(), 2);
        assert_eq!(first.function_names.len(), 3);
        assert_eq!(first.mapping_paths.len(), 2);
        assert_eq!(first.build_ids.len(), 1);
        // Root first: main, f, schedule.
        let fn_of = |frame_iid: u64| {
            let f = first
                .frames
                .iter()
                .find(|f| f.iid == Some(frame_iid))
                .unwrap();
            let n = first
                .function_names
                .iter()
                .find(|n| n.iid == f.function_name_id)
                .unwrap();
            String::from_utf8(n.str.clone().unwrap()).unwrap()
        };
        let order: Vec<String> = first.callstacks[0]
            .frame_ids
            .iter()
            .map(|&i| fn_of(i))
            .collect();
        assert_eq!(order, ["main", "f", "schedule"]);
        let kernel = first
            .mappings
            .iter()
            .find(|m| m.build_id.is_none())
            .unwrap();
        assert_eq!((kernel.start, kernel.end), (Some(0), Some(0)));

        // Same stack again: same id, nothing new to define.
        assert_eq!(s.callstack(&stack), Some(a));
        assert!(s.take_pending().is_none());
        // A sub-stack reuses frames but is a new callstack.
        let b = s.callstack(&stack[1..]).unwrap();
        assert_ne!(a, b);
        let second = s.take_pending().unwrap();
        assert_eq!(second.callstacks.len(), 1);
        assert!(second.frames.is_empty() && second.mappings.is_empty());
        assert_eq!(s.callstack_count(), 2);
        assert_eq!(s.callstack(&[]), None);
    }

    #[test]
    fn names_are_queued_once() {
        let mut s = SequenceInterner::default();
        assert_eq!(s.event_name("launch"), 1);
        assert_eq!(s.event_name("sync"), 2);
        assert_eq!(s.event_name("launch"), 1);
        assert_eq!(s.category("cuda"), 1);
        assert_eq!(s.annotation_name("bytes"), 1);
        let p = s.take_pending().unwrap();
        assert_eq!(p.event_names.len(), 2);
        assert_eq!(p.event_categories.len(), 1);
        assert_eq!(p.debug_annotation_names.len(), 1);
        assert!(s.take_pending().is_none());
    }
}
