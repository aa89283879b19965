//! A [`ProcessSource`] made of plain data, for tests: processes' maps as
//! `/proc/PID/maps` text, library files as (device, inode) and the
//! functions each exports at which file offset.

use std::collections::HashMap;

use xpuscope_probes::catalog::{Level, Library};
use xpuscope_probes::discover::LoadedLibrary;
use xpuscope_probes::maps::ProcessMaps;
use xpuscope_probes::placement::{Placement, ProbeCost};
use xpuscope_probes::resolve::{ResolvedLibrary, ResolvedProbe};

use super::plan::{FileId, Predicted, ProcessSource};
use crate::model::RankIdentity;

pub const CUDART: &str = "/opt/cuda/lib/libcudart.so.12";
pub const CUPTI: &str = "/opt/cuda/lib/libcupti.so.12";
/// Where the fake files' text starts (file offset and size).
const TEXT: (u64, u64) = (0x1000, 0x8000);
/// Probes sit this far past each function's start (past `endbr64`).
pub const PAST_ENDBR: u64 = 4;

#[derive(Default)]
pub struct FakeSource {
    /// pid -> its maps, as `/proc/PID/maps` text.
    pub maps: HashMap<u32, String>,
    /// path -> (device, inode) of the file there now.
    pub files: HashMap<String, FileId>,
    /// path -> (function, file offset of its start).
    pub exports: HashMap<String, Vec<(&'static str, u64)>>,
    /// Paths resolved, in order.
    pub resolved: Vec<String>,
    /// pid -> what its program will load.
    pub predicted: HashMap<u32, Predicted>,
    /// Predictions asked for, by pid, in order.
    pub predictions: Vec<u32>,
    /// Reads of each pid's maps.
    pub maps_reads: HashMap<u32, usize>,
}

impl FakeSource {
    /// The stand-in CUDA runtime (cudaMalloc L0 at 0x1100,
    /// cudaMemcpyAsync L1 at 0x1200) and CUPTI (its next-record call L2 at
    /// 0x2100), at inode 11 and 21 of device 1.
    pub fn nvidia() -> Self {
        let mut s = FakeSource::default();
        s.files.insert(CUDART.into(), (1, 11));
        s.files.insert(CUPTI.into(), (1, 21));
        s.exports.insert(
            CUDART.into(),
            vec![("cudaMalloc", 0x1100), ("cudaMemcpyAsync", 0x1200)],
        );
        s.exports
            .insert(CUPTI.into(), vec![("cuptiActivityGetNextRecord", 0x2100)]);
        s
    }

    /// [`Self::nvidia`] whose runtime also exports `cudaLaunchKernel` (a
    /// level-1 launch the kernel counts at every level) at 0x1300.
    pub fn nvidia_with_launch() -> Self {
        let mut s = Self::nvidia();
        s.exports
            .get_mut(CUDART)
            .expect("cudart")
            .push(("cudaLaunchKernel", 0x1300));
        s
    }

    /// `pid` maps each of `libs` (path, inode, base).
    pub fn map(&mut self, pid: u32, libs: &[(&str, u64, u64)]) {
        let mut text =
            String::from("55d000000000-55d000001000 r-xp 00000000 fe:01 5 /usr/bin/python3\n");
        for &(path, inode, base) in libs {
            text.push_str(&format!(
                "{:x}-{:x} r--p 00000000 01:00 {inode} {path}\n{:x}-{:x} r-xp {:08x} 01:00 {inode} {path}\n",
                base,
                base + TEXT.0,
                base + TEXT.0,
                base + TEXT.0 + TEXT.1,
                TEXT.0,
            ));
        }
        self.maps.insert(pid, text);
    }

    /// The address of `function`'s probe in a library mapped at `base`.
    pub fn probe_address(&self, path: &str, function: &str, base: u64) -> u64 {
        let (_, off) = self.exports[path]
            .iter()
            .find(|(f, _)| *f == function)
            .expect("exported");
        base + off + PAST_ENDBR
    }
}

impl ProcessSource for FakeSource {
    fn maps(&mut self, pid: u32) -> Option<ProcessMaps> {
        *self.maps_reads.entry(pid).or_default() += 1;
        self.maps.get(&pid).map(|t| ProcessMaps::parse(t))
    }

    fn identity(&mut self, pid: u32) -> RankIdentity {
        RankIdentity {
            rank: Some(pid.to_string()),
            ..RankIdentity::default()
        }
    }

    fn open_path(&mut self, _pid: u32, lib: &LoadedLibrary) -> Option<String> {
        Some(lib.path.clone())
    }

    fn file_id(&mut self, path: &str) -> std::io::Result<FileId> {
        self.files
            .get(path)
            .copied()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
    }

    fn resolve(&mut self, path: &str, library: Library) -> Result<ResolvedLibrary, String> {
        self.resolved.push(path.to_string());
        let exports = self.exports.get(path).ok_or("not an ELF file")?;
        let probes = exports
            .iter()
            .map(|&(name, off)| ResolvedProbe {
                function: library.function(name).expect("a catalog function"),
                symbol: name.to_string(),
                other_names: Vec::new(),
                vaddr: off,
                file_offset: off,
                placement: Placement {
                    offset: PAST_ENDBR,
                    first_insn: "endbr64".into(),
                    probed_insn: "push %rbp".into(),
                    emulated: true,
                    cost: ProbeCost::Emulated,
                    sp_delta: 0,
                    skipped: vec!["endbr64".into()],
                },
            })
            .collect();
        Ok(ResolvedLibrary {
            library,
            path: path.into(),
            probes,
            skipped: Vec::new(),
            missing: Vec::new(),
        })
    }

    fn predict(&mut self, pid: u32) -> Option<Predicted> {
        self.predictions.push(pid);
        self.predicted.get(&pid).cloned()
    }
}

/// The level bit of a catalog function.
pub fn level_bit(library: Library, function: &str) -> u32 {
    let level: Level = library.function(function).expect("catalog").level;
    level.bit()
}
