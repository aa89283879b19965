//! Allocation sites: the distinct user stacks device memory is allocated
//! from, per process, interned to the ids the decoder's memory ledger
//! charges live bytes to. A site keeps its symbolized frames (for the
//! trace's callstacks) and a short label (for annotations and the summary).

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::Serialize;
use xpuscope_perfetto::{Arg, ArgValue, Frame};
use xpuscope_probes::decode::memory::LiveSite;

use crate::symbolize::SymFrame;

/// Most distinct sites remembered (all processes); stacks past it are not
/// given a site (counted).
pub const MAX_SITES: usize = 1 << 16;
/// Frames named in a site's label.
const LABEL_FRAMES: usize = 4;
/// Largest sites named on an OOM marker and at the end.
pub const TOP_SITES: usize = 5;

/// One allocation site.
#[derive(Clone, Debug)]
pub struct Site {
    pub tgid: u32,
    /// Leaf (the allocating call's caller) first.
    pub frames: Vec<Frame>,
    /// "cache_activations < forward < train_step < main".
    pub label: String,
}

/// A site's live bytes, for the summary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SiteReport {
    pub pid: u32,
    pub device: String,
    pub bytes: u64,
    pub allocations: u64,
    /// The allocating stack, innermost caller first ("(unknown)" when no
    /// stack was taken).
    pub stack: String,
}

#[derive(Default)]
pub struct AllocSites {
    ids: HashMap<(u32, Vec<u64>), u64>,
    sites: HashMap<u64, Site>,
    next: u64,
    /// Stacks not given a site because of [`MAX_SITES`].
    pub over_limit: u64,
}

impl AllocSites {
    /// The site of `addrs` (leaf first) in process `tgid`, symbolizing a
    /// new one with `symbolize`. None past [`MAX_SITES`] or for an empty
    /// stack.
    pub fn intern(
        &mut self,
        tgid: u32,
        addrs: &[u64],
        symbolize: impl FnOnce() -> (Vec<SymFrame>, Vec<Frame>),
    ) -> Option<u64> {
        if addrs.is_empty() {
            return None;
        }
        if let Some(&id) = self.ids.get(&(tgid, addrs.to_vec())) {
            return Some(id);
        }
        if self.sites.len() >= MAX_SITES {
            self.over_limit += 1;
            return None;
        }
        let (sym, frames) = symbolize();
        self.next += 1;
        let id = self.next;
        self.ids.insert((tgid, addrs.to_vec()), id);
        self.sites.insert(
            id,
            Site {
                tgid,
                frames,
                label: label(&sym),
            },
        );
        Some(id)
    }

    pub fn get(&self, id: u64) -> Option<&Site> {
        self.sites.get(&id)
    }

    /// The label of `site` ("(unknown)" for allocations without a stack).
    pub fn label(&self, site: Option<u64>) -> String {
        site.and_then(|id| self.sites.get(&id))
            .map(|s| s.label.clone())
            .unwrap_or_else(|| "(unknown)".into())
    }

    /// Process `tgid` exited: its sites go (its addresses may be reused).
    pub fn forget_process(&mut self, tgid: u32) {
        self.ids.retain(|(t, _), _| *t != tgid);
        self.sites.retain(|_, s| s.tgid != tgid);
    }

    /// Annotations naming `rows` (largest first) under `prefix`:
    /// `prefix.1.bytes`, `prefix.1.allocations`, `prefix.1.stack`, ...
    /// (dotted names nest in the UI's argument view).
    pub fn annotations(&self, prefix: &str, rows: &[LiveSite]) -> Vec<Arg> {
        let mut args = Vec::with_capacity(rows.len() * 3);
        for (i, r) in rows.iter().enumerate() {
            let n = i + 1;
            args.push(Arg::new(
                format!("{prefix}.{n}.bytes"),
                ArgValue::Uint(r.usage.bytes),
            ));
            args.push(Arg::new(
                format!("{prefix}.{n}.allocations"),
                ArgValue::Uint(r.usage.allocations),
            ));
            args.push(Arg::new(
                format!("{prefix}.{n}.stack"),
                ArgValue::Str(self.label(r.site)),
            ));
        }
        args
    }

    /// Summary rows for process `tgid`'s `rows`.
    pub fn reports(&self, tgid: u32, rows: &[LiveSite]) -> Vec<SiteReport> {
        rows.iter()
            .map(|r| SiteReport {
                pid: tgid,
                device: format!("{:?} {}", r.device.vendor, r.device.index),
                bytes: r.usage.bytes,
                allocations: r.usage.allocations,
                stack: self.label(r.site),
            })
            .collect()
    }
}

/// The first frames' function names, innermost first, without the
/// device libraries' own frames (the interesting part is who called).
fn label(frames: &[SymFrame]) -> String {
    let mut out = String::new();
    for f in frames.iter().take(LABEL_FRAMES) {
        if !out.is_empty() {
            out.push_str(" < ");
        }
        let _ = write!(out, "{}", f.function);
    }
    if frames.len() > LABEL_FRAMES {
        out.push_str(" < ...");
    }
    if out.is_empty() {
        out.push_str("(no frames)");
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use xpuscope_probes::catalog::Vendor;
    use xpuscope_probes::decode::memory::{Device, SiteUsage};

    use super::*;

    fn sym(name: &str) -> SymFrame {
        SymFrame {
            function: Arc::from(name),
            module: Arc::from("/bin/x"),
            module_start: 0,
            module_end: 0,
            module_offset: 0,
            rel_pc: 0,
        }
    }

    #[test]
    fn interned_per_process_and_labelled() {
        let mut s = AllocSites::default();
        let names = ["alloc_cache", "forward", "step", "loop", "main"];
        let calls = std::cell::Cell::new(0);
        let symbolize = || {
            calls.set(calls.get() + 1);
            (names.iter().map(|n| sym(n)).collect(), Vec::new())
        };
        let a = s.intern(1, &[10, 20], symbolize).unwrap();
        assert_eq!(s.intern(1, &[10, 20], symbolize), Some(a));
        let b = s.intern(2, &[10, 20], symbolize).unwrap();
        assert_ne!(a, b, "per process");
        assert_eq!(calls.get(), 2, "symbolized once per site");
        assert_eq!(
            s.label(Some(a)),
            "alloc_cache < forward < step < loop < ..."
        );
        assert_eq!(s.label(None), "(unknown)");
        assert_eq!(s.intern(1, &[], symbolize), None);
        s.forget_process(1);
        assert!(s.get(a).is_none());
        assert!(s.get(b).is_some());

        let rows = [LiveSite {
            device: Device {
                vendor: Vendor::Nvidia,
                index: 1,
            },
            site: Some(b),
            usage: SiteUsage {
                bytes: 4096,
                allocations: 2,
            },
        }];
        let args = s.annotations("live_sites", &rows);
        let names: Vec<&str> = args.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "live_sites.1.bytes",
                "live_sites.1.allocations",
                "live_sites.1.stack"
            ]
        );
        let r = s.reports(2, &rows);
        assert_eq!((r[0].bytes, r[0].device.as_str()), (4096, "Nvidia 1"));
    }
}
