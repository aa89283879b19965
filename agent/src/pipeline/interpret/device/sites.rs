//! Allocation sites: the distinct user stacks device memory is allocated
//! from, per process, interned to the ids the decoder's memory ledger
//! charges live bytes to. A site keeps its symbolized frames and a short
//! label; records carry it shared (`Arc<Site>`).

use foldhash::HashMap;
use std::fmt::Write as _;

use std::sync::Arc;

use xpuscope_probes::decode::memory::LiveSite;

use crate::model::{LiveSiteRow, Site, SymFrame};

/// Most distinct sites remembered (all processes); stacks past it are not
/// given a site (counted).
pub const MAX_SITES: usize = 1 << 16;
/// Frames named in a site's label.
const LABEL_FRAMES: usize = 4;
/// Largest sites named on an OOM marker and at the end.
pub const TOP_SITES: usize = 5;

#[derive(Default)]
pub struct AllocSites {
    ids: HashMap<(u32, Vec<u64>), u64>,
    sites: HashMap<u64, Arc<Site>>,
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
        symbolize: impl FnOnce() -> Vec<SymFrame>,
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
        let frames = symbolize();
        self.next += 1;
        let id = self.next;
        self.ids.insert((tgid, addrs.to_vec()), id);
        let label = label(&frames);
        self.sites.insert(
            id,
            Arc::new(Site {
                id,
                tgid,
                frames,
                label,
            }),
        );
        Some(id)
    }

    #[cfg(test)]
    pub fn get(&self, id: u64) -> Option<&Arc<Site>> {
        self.sites.get(&id)
    }

    /// The site of an optional id, shared.
    pub fn site(&self, id: Option<u64>) -> Option<Arc<Site>> {
        id.and_then(|id| self.sites.get(&id)).cloned()
    }

    /// Process `tgid` exited: its sites go (its addresses may be reused).
    pub fn forget_process(&mut self, tgid: u32) {
        self.ids.retain(|(t, _), _| *t != tgid);
        self.sites.retain(|_, s| s.tgid != tgid);
    }

    /// Rows with their sites, for records.
    pub fn rows(&self, rows: &[LiveSite]) -> Vec<LiveSiteRow> {
        rows.iter()
            .map(|r| LiveSiteRow {
                device: r.device,
                bytes: r.usage.bytes,
                allocations: r.usage.allocations,
                site: self.site(r.site),
            })
            .collect()
    }
}

/// Frames of the frameworks' caching allocators (PyTorch's
/// `c10::cuda::CUDACachingAllocator::*`, torch_npu's
/// `c10_npu::NPUCachingAllocator::*`). Every allocation of a PyTorch job
/// passes through the same four or five of them (seen on an H100 with
/// PyTorch 2.11: `alloc_block < malloc < NativeCachingAllocator::malloc <
/// allocate`), so a label made of them tells no two sites apart.
fn caching_allocator(f: &SymFrame) -> bool {
    f.function.contains("CachingAllocator")
}

/// The first frames' function names, innermost first, without the
/// device libraries' own frames (the interesting part is who called) and
/// without the caching allocator's (when someone called it).
fn label(frames: &[SymFrame]) -> String {
    let inside = frames.iter().take_while(|f| caching_allocator(f)).count();
    let frames = match &frames[inside..] {
        [] => frames,
        callers => callers,
    };
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

    use xpuscope_probes::catalog::Vendor;
    use xpuscope_probes::decode::memory::{Device, SiteUsage};

    use super::*;

    fn sym(name: &str) -> SymFrame {
        SymFrame::named(name)
    }

    #[test]
    fn interned_per_process_and_labelled() {
        let mut s = AllocSites::default();
        let names = ["alloc_cache", "forward", "step", "loop", "main"];
        let calls = std::cell::Cell::new(0);
        let symbolize = || {
            calls.set(calls.get() + 1);
            names.iter().map(|n| sym(n)).collect()
        };
        let a = s.intern(1, &[10, 20], symbolize).unwrap();
        assert_eq!(s.intern(1, &[10, 20], symbolize), Some(a));
        let b = s.intern(2, &[10, 20], symbolize).unwrap();
        assert_ne!(a, b, "per process");
        assert_eq!(calls.get(), 2, "symbolized once per site");
        assert_eq!(
            s.get(a).unwrap().label,
            "alloc_cache < forward < step < loop < ..."
        );
        assert_eq!(crate::model::stack::site_label(None), "(unknown)");
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
        let r = s.rows(&rows);
        assert_eq!((r[0].bytes, r[0].allocations), (4096, 2));
        assert_eq!(r[0].site.as_ref().map(|s| s.id), Some(b));
    }

    /// PyTorch's allocator frames are left out of the label, which then
    /// names who allocated; a stack of nothing else keeps them.
    #[test]
    fn labels_skip_the_caching_allocator() {
        let alloc = [
            "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::alloc_block(c10::cuda::CUDACachingAllocator::Native::(anonymous namespace)::AllocParams&, bool)",
            "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long, CUstream_st*)",
            "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)",
        ];
        let callers = [
            "at::detail::empty_cuda(c10::ArrayRef<long>)",
            "at::native::empty_cuda(c10::ArrayRef<long>)",
            "at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>)",
            "torch::autograd::THPVariable_empty(_object*, _object*, _object*)",
            "_PyEval_EvalFrameDefault",
        ];
        let frames: Vec<SymFrame> = alloc.iter().chain(&callers).map(|n| sym(n)).collect();
        assert_eq!(
            label(&frames),
            format!("{} < ...", callers[..LABEL_FRAMES].join(" < "))
        );
        let only: Vec<SymFrame> = alloc.iter().map(|n| sym(n)).collect();
        assert_eq!(label(&only), alloc.join(" < "));
        // An allocator frame below the callers is no reason to cut.
        let mixed: Vec<SymFrame> = [callers[0], alloc[0]].iter().map(|n| sym(n)).collect();
        assert_eq!(label(&mixed), format!("{} < {}", callers[0], alloc[0]));
    }
}
