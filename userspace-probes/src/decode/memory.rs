//! Device memory accounting per process: bytes held per device, from the
//! allocation and free calls seen (`cudaMalloc`/`cudaFree`,
//! `cudaMallocAsync`/`cudaFreeAsync`, `ncclMemAlloc`/`ncclMemFree`,
//! `aclrtMalloc`/`aclrtFree`, the driver's `cuMemAlloc_v2`/`cuMemFree_v2`)
//! and the driver's virtual memory: a `cuMemMap` of `size` bytes at `ptr`
//! holds them until a `cuMemUnmap` of a range containing `ptr` (reserved
//! address space and created but unmapped physical memory hold nothing:
//! what a job holds on the device is what it has mapped, as PyTorch's
//! expandable segments grow and shrink by mapping and unmapping pages).
//!
//! The device of an allocation is the calling thread's current device, set
//! per thread by `cudaSetDevice` / `aclrtSetDevice` (default 0). Memory
//! allocated before the agent attached is unknown: its frees are counted as
//! untracked, never subtracted.
//!
//! Each allocation may carry an allocation site: an opaque id the caller
//! gives (the agent interns the allocating user stack). Bytes held are also
//! kept per (device, site), so the largest live allocation sites are known
//! at any time (at an OOM, at the end of a trace).

use foldhash::HashMap;
use std::collections::{BTreeMap, BTreeSet};

use crate::catalog::Vendor;

/// Most live allocations remembered per process.
pub const MAX_ALLOCATIONS: usize = 1 << 20;
/// Most threads whose current device is remembered per process.
pub const MAX_THREADS: usize = 1 << 16;

/// A device of one vendor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Device {
    pub vendor: Vendor,
    pub index: u32,
}

/// What one call did to device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEffect {
    pub device: Device,
    /// Bytes added (allocation) or removed (free); 0 for a failed
    /// allocation or an untracked free.
    pub delta: i64,
    /// Bytes held on `device` after the call (as far as seen).
    pub held_after: u64,
    /// A failed allocation's requested size.
    pub failed_request: Option<u64>,
    /// A free of memory allocated before the agent attached (or not
    /// remembered): its size is unknown.
    pub untracked: bool,
    /// The allocation site: of this allocation, or of the allocation this
    /// free released (None: allocated without a known site).
    pub site: Option<u64>,
}

/// Live bytes allocated at one site on one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SiteUsage {
    /// Bytes of this site's allocations not yet freed.
    pub bytes: u64,
    /// Its live allocations.
    pub allocations: u64,
}

/// One row of [`MemoryLedger::largest_sites`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveSite {
    pub device: Device,
    /// None: allocations whose site is unknown (no stack was taken).
    pub site: Option<u64>,
    pub usage: SiteUsage,
}

#[derive(Clone, Copy, Debug)]
struct Allocation {
    device: Device,
    size: u64,
    site: Option<u64>,
}

/// Device memory of one process.
#[derive(Clone, Debug, Default)]
pub struct MemoryLedger {
    allocations: HashMap<u64, Allocation>,
    /// The addresses in `allocations` that are mappings (`cuMemMap`), in
    /// order, so an unmapped range finds them.
    mappings: BTreeSet<u64>,
    held: BTreeMap<Device, u64>,
    /// Live bytes per (device, site); entries leave when they reach 0.
    sites: HashMap<(Device, Option<u64>), SiteUsage>,
    current: HashMap<(u32, Vendor), u32>,
    /// Failed allocations.
    pub failures: u64,
    /// Frees of unknown pointers.
    pub untracked_frees: u64,
    /// Allocations not remembered because of [`MAX_ALLOCATIONS`].
    pub unremembered: u64,
}

impl MemoryLedger {
    /// Bytes held on `device`.
    pub fn held(&self, device: Device) -> u64 {
        self.held.get(&device).copied().unwrap_or(0)
    }

    /// Every device with its bytes held, in order.
    pub fn devices(&self) -> impl Iterator<Item = (Device, u64)> + '_ {
        self.held.iter().map(|(d, b)| (*d, *b))
    }

    /// Live allocations remembered.
    pub fn live(&self) -> usize {
        self.allocations.len()
    }

    /// The current device of thread `tid` (0 until it sets one).
    pub fn current_device(&self, tid: u32, vendor: Vendor) -> Device {
        Device {
            vendor,
            index: self.current.get(&(tid, vendor)).copied().unwrap_or(0),
        }
    }

    /// `cudaSetDevice` / `aclrtSetDevice` succeeded on `tid`.
    pub fn set_device(&mut self, tid: u32, vendor: Vendor, index: u32) {
        if self.current.len() < MAX_THREADS || self.current.contains_key(&(tid, vendor)) {
            self.current.insert((tid, vendor), index);
        }
    }

    /// A thread exited: forget its current device.
    pub fn thread_exited(&mut self, tid: u32) {
        self.current.retain(|(t, _), _| *t != tid);
    }

    /// An allocation of `size` bytes at `ptr` succeeded on `tid`, made at
    /// `site`.
    pub fn allocated(
        &mut self,
        tid: u32,
        vendor: Vendor,
        ptr: u64,
        size: u64,
        site: Option<u64>,
    ) -> MemoryEffect {
        let device = self.current_device(tid, vendor);
        // A pointer handed out twice without a free seen: the old one was
        // freed unseen; do not count it twice.
        if let Some(old) = self.allocations.remove(&ptr) {
            self.mappings.remove(&ptr);
            self.release(old);
        }
        if self.allocations.len() < MAX_ALLOCATIONS {
            let a = Allocation { device, size, site };
            self.allocations.insert(ptr, a);
            let held = self.held.entry(device).or_insert(0);
            *held = held.saturating_add(size);
            let usage = self.sites.entry((device, site)).or_default();
            usage.bytes = usage.bytes.saturating_add(size);
            usage.allocations += 1;
        } else {
            self.unremembered += 1;
        }
        MemoryEffect {
            device,
            delta: i64::try_from(size).unwrap_or(i64::MAX),
            held_after: self.held(device),
            failed_request: None,
            untracked: false,
            site,
        }
    }

    /// An allocation of `size` bytes failed on `tid` at `site`.
    pub fn failed(
        &mut self,
        tid: u32,
        vendor: Vendor,
        size: u64,
        site: Option<u64>,
    ) -> MemoryEffect {
        self.failures += 1;
        let device = self.current_device(tid, vendor);
        MemoryEffect {
            device,
            delta: 0,
            held_after: self.held(device),
            failed_request: Some(size),
            untracked: false,
            site,
        }
    }

    /// `ptr` was freed by `tid`.
    pub fn freed(&mut self, tid: u32, vendor: Vendor, ptr: u64) -> MemoryEffect {
        self.mappings.remove(&ptr);
        match self.allocations.remove(&ptr) {
            Some(a) => {
                self.release(a);
                MemoryEffect {
                    device: a.device,
                    delta: -i64::try_from(a.size).unwrap_or(i64::MAX),
                    held_after: self.held(a.device),
                    failed_request: None,
                    untracked: false,
                    site: a.site,
                }
            }
            None => {
                self.untracked_frees += 1;
                let device = self.current_device(tid, vendor);
                MemoryEffect {
                    device,
                    delta: 0,
                    held_after: self.held(device),
                    failed_request: None,
                    untracked: true,
                    site: None,
                }
            }
        }
    }

    /// `size` bytes were mapped at `ptr` (`cuMemMap`) by `tid`: held like
    /// an allocation.
    pub fn mapped(
        &mut self,
        tid: u32,
        vendor: Vendor,
        ptr: u64,
        size: u64,
        site: Option<u64>,
    ) -> MemoryEffect {
        let effect = self.allocated(tid, vendor, ptr, size, site);
        if self.allocations.contains_key(&ptr) {
            self.mappings.insert(ptr);
        }
        effect
    }

    /// The range `[ptr, ptr + size)` was unmapped (`cuMemUnmap`): every
    /// mapping starting in it is released. An unmap of nothing seen mapped
    /// (mapped before the agent attached) is untracked.
    pub fn unmapped(&mut self, tid: u32, vendor: Vendor, ptr: u64, size: u64) -> MemoryEffect {
        let end = ptr.saturating_add(size.max(1));
        let starts: Vec<u64> = self.mappings.range(ptr..end).copied().collect();
        let mut released: Option<(Device, u64, Option<u64>)> = None;
        for start in starts {
            self.mappings.remove(&start);
            if let Some(a) = self.allocations.remove(&start) {
                self.release(a);
                let (_, bytes, _) = released.get_or_insert((a.device, 0, a.site));
                *bytes = bytes.saturating_add(a.size);
            }
        }
        match released {
            Some((device, bytes, site)) => MemoryEffect {
                device,
                delta: -i64::try_from(bytes).unwrap_or(i64::MAX),
                held_after: self.held(device),
                failed_request: None,
                untracked: false,
                site,
            },
            None => {
                self.untracked_frees += 1;
                let device = self.current_device(tid, vendor);
                MemoryEffect {
                    device,
                    delta: 0,
                    held_after: self.held(device),
                    failed_request: None,
                    untracked: true,
                    site: None,
                }
            }
        }
    }

    /// The `n` sites holding the most live bytes on `device` (every device
    /// when None), largest first (ties: fewer allocations, then site id,
    /// so the order is stable).
    pub fn largest_sites(&self, device: Option<Device>, n: usize) -> Vec<LiveSite> {
        let mut rows: Vec<LiveSite> = self
            .sites
            .iter()
            .filter(|((d, _), u)| u.bytes > 0 && device.is_none_or(|want| *d == want))
            .map(|(&(device, site), &usage)| LiveSite {
                device,
                site,
                usage,
            })
            .collect();
        rows.sort_by(|a, b| {
            (b.usage.bytes, a.usage.allocations, a.device, a.site).cmp(&(
                a.usage.bytes,
                b.usage.allocations,
                b.device,
                b.site,
            ))
        });
        rows.truncate(n);
        rows
    }

    fn release(&mut self, a: Allocation) {
        self.sub(a.device, a.size);
        let key = (a.device, a.site);
        if let Some(usage) = self.sites.get_mut(&key) {
            usage.bytes = usage.bytes.saturating_sub(a.size);
            usage.allocations = usage.allocations.saturating_sub(1);
            if usage.allocations == 0 {
                self.sites.remove(&key);
            }
        }
    }

    /// The size of the live allocation at `ptr`.
    pub fn size_of(&self, ptr: u64) -> Option<u64> {
        self.allocations.get(&ptr).map(|a| a.size)
    }

    fn sub(&mut self, device: Device, size: u64) {
        if let Some(held) = self.held.get_mut(&device) {
            *held = held.saturating_sub(size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn dev(index: u32) -> Device {
        Device {
            vendor: Vendor::Nvidia,
            index,
        }
    }

    #[test]
    fn per_device_per_thread() {
        let mut m = MemoryLedger::default();
        let e = m.allocated(10, Vendor::Nvidia, 0x1000, GIB, None);
        assert_eq!((e.device, e.delta, e.held_after), (dev(0), GIB as i64, GIB));
        m.set_device(10, Vendor::Nvidia, 3);
        assert_eq!(m.current_device(11, Vendor::Nvidia), dev(0), "per thread");
        let e = m.allocated(10, Vendor::Nvidia, 0x2000, 2 * GIB, None);
        assert_eq!((e.device, e.held_after), (dev(3), 2 * GIB));
        // Freed from another thread: still the allocation's device.
        let e = m.freed(11, Vendor::Nvidia, 0x2000);
        assert_eq!(
            (e.device, e.delta, e.held_after, e.untracked),
            (dev(3), -2 * GIB as i64, 0, false)
        );
        assert_eq!(m.held(dev(0)), GIB);
        assert_eq!(m.live(), 1);
        // Ascend devices are separate.
        m.set_device(10, Vendor::Ascend, 3);
        let e = m.allocated(10, Vendor::Ascend, 0x3000, 5, None);
        assert_eq!(
            e.device,
            Device {
                vendor: Vendor::Ascend,
                index: 3
            }
        );
        assert_eq!(m.held(dev(3)), 0);
        m.thread_exited(10);
        assert_eq!(m.current_device(10, Vendor::Nvidia), dev(0));
    }

    #[test]
    fn failures_and_unknown_frees() {
        let mut m = MemoryLedger::default();
        let e = m.failed(1, Vendor::Nvidia, 100 * GIB, None);
        assert_eq!(
            (e.failed_request, e.delta, e.held_after),
            (Some(100 * GIB), 0, 0)
        );
        let e = m.freed(1, Vendor::Nvidia, 0xdead);
        assert!(e.untracked);
        assert_eq!((m.failures, m.untracked_frees), (1, 1));
        // The same pointer allocated twice without a seen free.
        m.allocated(1, Vendor::Nvidia, 0x10, 7, Some(1));
        m.allocated(1, Vendor::Nvidia, 0x10, 9, Some(2));
        assert_eq!(m.held(dev(0)), 9);
        assert_eq!(m.size_of(0x10), Some(9));
        assert_eq!(m.devices().collect::<Vec<_>>(), [(dev(0), 9)]);
        // The unseen free left site 1; site 2 holds the pointer now.
        let sites = m.largest_sites(None, 10);
        assert_eq!(sites.len(), 1);
        assert_eq!((sites[0].site, sites[0].usage.bytes), (Some(2), 9));
    }

    #[test]
    fn mapped_pages_are_held_until_their_range_is_unmapped() {
        const MIB: u64 = 1 << 20;
        let mut m = MemoryLedger::default();
        // An expandable segment: a reserved range at 0x7000_0000 grows by
        // three 2 MiB pages, shrinks by its last two in one unmap, then by
        // the first.
        let base = 0x7000_0000u64;
        for i in 0..3 {
            let e = m.mapped(1, Vendor::Nvidia, base + i * 2 * MIB, 2 * MIB, None);
            assert_eq!((e.delta, e.held_after), (2 * MIB as i64, (i + 1) * 2 * MIB));
        }
        // A plain allocation inside no mapping is untouched by unmaps.
        m.allocated(1, Vendor::Nvidia, base + 100 * MIB, MIB, None);
        let e = m.unmapped(1, Vendor::Nvidia, base + 2 * MIB, 4 * MIB);
        assert_eq!(
            (e.delta, e.held_after, e.untracked),
            (-4 * MIB as i64, 3 * MIB, false)
        );
        let e = m.unmapped(2, Vendor::Nvidia, base, 2 * MIB);
        assert_eq!((e.delta, e.held_after), (-2 * MIB as i64, MIB));
        // Unmapping it again, or memory mapped before the agent attached.
        let e = m.unmapped(2, Vendor::Nvidia, base, 2 * MIB);
        assert!(e.untracked);
        assert_eq!((e.delta, m.untracked_frees), (0, 1));
        assert_eq!(m.live(), 1);
        // A mapping on the thread's current device.
        m.set_device(3, Vendor::Nvidia, 2);
        let e = m.mapped(3, Vendor::Nvidia, base, MIB, None);
        assert_eq!(e.device, dev(2));
        assert_eq!(m.unmapped(1, Vendor::Nvidia, base, MIB).device, dev(2));
    }

    #[test]
    fn largest_live_sites_by_bytes_held() {
        let mut m = MemoryLedger::default();
        // Site 7: three allocations of 1 GiB; site 8: one of 2 GiB; no site:
        // 512 MiB; site 9 on device 1.
        for (i, ptr) in [0x100u64, 0x200, 0x300].iter().enumerate() {
            let e = m.allocated(1, Vendor::Nvidia, *ptr, GIB, Some(7));
            assert_eq!((e.site, e.held_after), (Some(7), (i as u64 + 1) * GIB));
        }
        m.allocated(1, Vendor::Nvidia, 0x400, 2 * GIB, Some(8));
        m.allocated(1, Vendor::Nvidia, 0x500, GIB / 2, None);
        m.set_device(1, Vendor::Nvidia, 1);
        m.allocated(1, Vendor::Nvidia, 0x600, 5 * GIB, Some(9));
        let rows = m.largest_sites(Some(dev(0)), 2);
        assert_eq!(
            rows.iter()
                .map(|r| (r.site, r.usage.bytes, r.usage.allocations))
                .collect::<Vec<_>>(),
            [(Some(7), 3 * GIB, 3), (Some(8), 2 * GIB, 1)]
        );
        assert_eq!(m.largest_sites(None, 1)[0].site, Some(9));
        // A free is charged back to its site and reports it.
        let e = m.freed(2, Vendor::Nvidia, 0x200);
        assert_eq!((e.site, e.delta), (Some(7), -(GIB as i64)));
        m.freed(2, Vendor::Nvidia, 0x100);
        let rows = m.largest_sites(Some(dev(0)), 3);
        assert_eq!(
            rows.iter()
                .map(|r| (r.site, r.usage.bytes))
                .collect::<Vec<_>>(),
            [(Some(8), 2 * GIB), (Some(7), GIB), (None, GIB / 2)]
        );
        // Fully freed sites disappear.
        m.freed(2, Vendor::Nvidia, 0x400);
        m.freed(2, Vendor::Nvidia, 0x300);
        assert_eq!(m.largest_sites(Some(dev(0)), 3).len(), 1);
        // A failure names its site but holds nothing.
        let e = m.failed(1, Vendor::Nvidia, GIB, Some(7));
        assert_eq!((e.site, e.failed_request), (Some(7), Some(GIB)));
    }
}
