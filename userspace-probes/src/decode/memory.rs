//! Device memory accounting per process: bytes held per device, from the
//! allocation and free calls seen (`cudaMalloc`/`cudaFree`,
//! `cudaMallocAsync`/`cudaFreeAsync`, `ncclMemAlloc`/`ncclMemFree`,
//! `aclrtMalloc`/`aclrtFree`).
//!
//! The device of an allocation is the calling thread's current device, set
//! per thread by `cudaSetDevice` / `aclrtSetDevice` (default 0). Memory
//! allocated before the agent attached is unknown: its frees are counted as
//! untracked, never subtracted.

use std::collections::{BTreeMap, HashMap};

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
}

#[derive(Clone, Copy, Debug)]
struct Allocation {
    device: Device,
    size: u64,
}

/// Device memory of one process.
#[derive(Clone, Debug, Default)]
pub struct MemoryLedger {
    allocations: HashMap<u64, Allocation>,
    held: BTreeMap<Device, u64>,
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

    /// An allocation of `size` bytes at `ptr` succeeded on `tid`.
    pub fn allocated(&mut self, tid: u32, vendor: Vendor, ptr: u64, size: u64) -> MemoryEffect {
        let device = self.current_device(tid, vendor);
        // A pointer handed out twice without a free seen: the old one was
        // freed unseen; do not count it twice.
        if let Some(old) = self.allocations.remove(&ptr) {
            self.sub(old.device, old.size);
        }
        if self.allocations.len() < MAX_ALLOCATIONS {
            self.allocations.insert(ptr, Allocation { device, size });
            let held = self.held.entry(device).or_insert(0);
            *held = held.saturating_add(size);
        } else {
            self.unremembered += 1;
        }
        MemoryEffect {
            device,
            delta: i64::try_from(size).unwrap_or(i64::MAX),
            held_after: self.held(device),
            failed_request: None,
            untracked: false,
        }
    }

    /// An allocation of `size` bytes failed on `tid`.
    pub fn failed(&mut self, tid: u32, vendor: Vendor, size: u64) -> MemoryEffect {
        self.failures += 1;
        let device = self.current_device(tid, vendor);
        MemoryEffect {
            device,
            delta: 0,
            held_after: self.held(device),
            failed_request: Some(size),
            untracked: false,
        }
    }

    /// `ptr` was freed by `tid`.
    pub fn freed(&mut self, tid: u32, vendor: Vendor, ptr: u64) -> MemoryEffect {
        match self.allocations.remove(&ptr) {
            Some(a) => {
                self.sub(a.device, a.size);
                MemoryEffect {
                    device: a.device,
                    delta: -i64::try_from(a.size).unwrap_or(i64::MAX),
                    held_after: self.held(a.device),
                    failed_request: None,
                    untracked: false,
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
                }
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
        let e = m.allocated(10, Vendor::Nvidia, 0x1000, GIB);
        assert_eq!((e.device, e.delta, e.held_after), (dev(0), GIB as i64, GIB));
        m.set_device(10, Vendor::Nvidia, 3);
        assert_eq!(m.current_device(11, Vendor::Nvidia), dev(0), "per thread");
        let e = m.allocated(10, Vendor::Nvidia, 0x2000, 2 * GIB);
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
        let e = m.allocated(10, Vendor::Ascend, 0x3000, 5);
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
        let e = m.failed(1, Vendor::Nvidia, 100 * GIB);
        assert_eq!(
            (e.failed_request, e.delta, e.held_after),
            (Some(100 * GIB), 0, 0)
        );
        let e = m.freed(1, Vendor::Nvidia, 0xdead);
        assert!(e.untracked);
        assert_eq!((m.failures, m.untracked_frees), (1, 1));
        // The same pointer allocated twice without a seen free.
        m.allocated(1, Vendor::Nvidia, 0x10, 7);
        m.allocated(1, Vendor::Nvidia, 0x10, 9);
        assert_eq!(m.held(dev(0)), 9);
        assert_eq!(m.size_of(0x10), Some(9));
        assert_eq!(m.devices().collect::<Vec<_>>(), [(dev(0), 9)]);
    }
}
