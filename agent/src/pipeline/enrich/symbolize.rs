//! Stack symbolization with blazesym, cached per address.
//!
//! User addresses are symbolized while the process is alive (when the stack
//! arrives), through `/proc/PID/maps` (ELF symbols, DWARF where present);
//! when the process has gone by then (a rank that exits right after its
//! OOM), through the file its cached mappings name, by file offset, if the
//! file on disk is still the one mapped (same inode);
//! kernel addresses through kallsyms. Results are cached per (process,
//! address) and per kernel address, so steady-state cost is a hash lookup.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesym::symbolize::evict::{self, Evict};
use blazesym::symbolize::source::{Elf, Kernel, Process, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};
use rustc_hash::{FxHashMap, FxHashSet};
use xpuscope_probes::maps::ProcessMaps;

use crate::model::SymFrame;

/// Leading kernel frames that belong to the tracing machinery, not to the
/// task: the BPF program, the tracepoint trampoline.
fn is_tracing_frame(name: &str) -> bool {
    name.starts_with("bpf_prog_")
        || name.starts_with("bpf_trace_run")
        || name.starts_with("__bpf_trace_")
        || name.starts_with("__traceiter_")
        || name.starts_with("bpf_get_stack")
        || name == "__bpf_get_stack"
        || name == "bpf_get_stack_raw_tp"
}

const MAPS_REFRESH: Duration = Duration::from_millis(200);

struct ProcessMapsCache {
    maps: ProcessMaps,
    read_at: Instant,
}

pub struct StackSymbolizer {
    symbolizer: Symbolizer,
    kernel: FxHashMap<u64, SymFrame>,
    /// Per process: address -> frame (forgotten with the process).
    user: FxHashMap<u32, FxHashMap<u64, SymFrame>>,
    maps: HashMap<u32, ProcessMapsCache>,
    /// Processes forked (not exec'd) from another: same address space at
    /// fork, so the parent can stand in once the child is gone.
    forked_from: HashMap<u32, u32>,
    /// Per process: the paths blazesym was given for it (its mappings'
    /// `/proc/PID/map_files/START-END`, files read after it exited).
    /// blazesym keeps each file open, mapped and parsed for as long as any
    /// path names it, so they are evicted with the process: a service
    /// tracing job after job would otherwise hold every binary it ever saw.
    files: FxHashMap<u32, FxHashSet<PathBuf>>,
    kernel_name: Arc<str>,
    pub lookups: u64,
    pub cache_hits: u64,
}

impl Default for StackSymbolizer {
    fn default() -> Self {
        Self::new()
    }
}

impl StackSymbolizer {
    pub fn new() -> Self {
        Self {
            symbolizer: Symbolizer::new(),
            kernel: FxHashMap::default(),
            user: FxHashMap::default(),
            maps: HashMap::new(),
            forked_from: HashMap::new(),
            files: FxHashMap::default(),
            kernel_name: Arc::from("kernel"),
            lookups: 0,
            cache_hits: 0,
        }
    }

    /// Kernel frames, leaf first, with the tracing machinery removed.
    pub fn kernel_frames(&mut self, addrs: &[u64]) -> Vec<SymFrame> {
        let missing: Vec<u64> = addrs
            .iter()
            .copied()
            .filter(|a| !self.kernel.contains_key(a))
            .collect();
        self.lookups += addrs.len() as u64;
        self.cache_hits += (addrs.len() - missing.len()) as u64;
        if !missing.is_empty() {
            let src = Source::Kernel(Kernel::default());
            // Return addresses point after the call: look up the call itself.
            let lookup: Vec<u64> = missing.iter().map(|a| a.saturating_sub(1)).collect();
            let results = self
                .symbolizer
                .symbolize(&src, Input::AbsAddr(&lookup))
                .unwrap_or_default();
            for (i, addr) in missing.iter().enumerate() {
                let function: Arc<str> = match results.get(i) {
                    Some(Symbolized::Sym(sym)) => Arc::from(&*sym.name),
                    _ => Arc::from(format!("[kernel {addr:#x}]")),
                };
                self.kernel.insert(
                    *addr,
                    SymFrame {
                        function,
                        module: self.kernel_name.clone(),
                        module_start: 0,
                        module_end: 0,
                        module_offset: 0,
                        rel_pc: *addr,
                    },
                );
            }
        }
        let frames: Vec<SymFrame> = addrs
            .iter()
            .filter_map(|a| self.kernel.get(a).cloned())
            .collect();
        let skip = frames
            .iter()
            .take_while(|f| is_tracing_frame(&f.function))
            .count();
        frames[skip..].to_vec()
    }

    fn maps_for(&mut self, tgid: u32, addr: u64) -> Option<&ProcessMaps> {
        let stale = match self.maps.get(&tgid) {
            None => true,
            Some(c) => c.maps.find(addr).is_none() && c.read_at.elapsed() > MAPS_REFRESH,
        };
        if stale && let Ok(maps) = ProcessMaps::read(tgid) {
            self.maps.insert(
                tgid,
                ProcessMapsCache {
                    maps,
                    read_at: Instant::now(),
                },
            );
        }
        self.maps.get(&tgid).map(|c| &c.maps)
    }

    /// Maps of process `tgid` read elsewhere while it was alive (newer than
    /// any cached).
    pub fn remember_maps(&mut self, tgid: u32, maps: ProcessMaps) {
        self.maps.insert(
            tgid,
            ProcessMapsCache {
                maps,
                read_at: Instant::now(),
            },
        );
    }

    /// User frames of process `tgid`, leaf first.
    pub fn user_frames(&mut self, tgid: u32, addrs: &[u64]) -> Vec<SymFrame> {
        let missing: Vec<u64> = addrs
            .iter()
            .copied()
            .filter(|a| !self.user.get(&tgid).is_some_and(|m| m.contains_key(a)))
            .collect();
        self.lookups += addrs.len() as u64;
        self.cache_hits += (addrs.len() - missing.len()) as u64;
        if !missing.is_empty() {
            let pid = self.live_stand_in(tgid, missing[0]);
            self.note_map_files(pid, &missing);
            let lookup: Vec<u64> = missing.iter().map(|a| a.saturating_sub(1)).collect();
            let names: Vec<Option<String>> = self
                .symbolize_process(pid, &lookup)
                .iter()
                .map(|r| match r {
                    Symbolized::Sym(sym) => Some(sym.name.to_string()),
                    Symbolized::Unknown(_) => None,
                })
                .collect();
            for (i, addr) in missing.iter().enumerate() {
                let mapping = self
                    .maps_for(pid, *addr)
                    .and_then(|m| m.find(*addr))
                    .cloned();
                let (module, start, end, offset, rel_pc): (Arc<str>, u64, u64, u64, u64) =
                    match &mapping {
                        Some(m) if !m.path.is_empty() => (
                            Arc::from(m.path.as_str()),
                            m.start,
                            m.end,
                            m.offset,
                            m.file_offset_of(*addr),
                        ),
                        Some(m) => (Arc::from("[anon]"), m.start, m.end, 0, addr - m.start),
                        None => (Arc::from("[unknown]"), 0, 0, 0, *addr),
                    };
                let name = match names.get(i) {
                    Some(Some(name)) => Some(name.clone()),
                    _ => mapping
                        .as_ref()
                        .and_then(|m| self.symbol_in_file_for(pid, m, rel_pc.saturating_sub(1))),
                };
                let function: Arc<str> = match name {
                    Some(name) => Arc::from(name.as_str()),
                    None => Arc::from(format!(
                        "[{} {rel_pc:#x}]",
                        short_module(module.trim_start_matches('[').trim_end_matches(']'))
                    )),
                };
                self.user.entry(tgid).or_default().insert(
                    *addr,
                    SymFrame {
                        function,
                        module,
                        module_start: start,
                        module_end: end,
                        module_offset: offset,
                        rel_pc,
                    },
                );
            }
        }
        addrs
            .iter()
            .filter_map(|a| self.user.get(&tgid).and_then(|m| m.get(a)).cloned())
            .collect()
    }
}

impl StackSymbolizer {
    /// `addrs` of live process `pid` through blazesym, reading the
    /// process's own files (`/proc/PID/map_files`). Separate debug files
    /// (`.gnu_debuglink`, `/usr/lib/debug`) are looked up in the agent's
    /// root, so only for a process that shares it: a container's
    /// libraries are not described by the host's debug files (a same-named
    /// one fails its checksum, and fails the whole batch). A batch that
    /// still fails is tried once without debug files.
    fn symbolize_process(&self, pid: u32, addrs: &[u64]) -> Vec<Symbolized<'_>> {
        let mut process = Process::new(pid.into());
        process.debug_syms = shares_agent_root(pid);
        let first = self
            .symbolizer
            .symbolize(&Source::Process(process.clone()), Input::AbsAddr(addrs));
        match first {
            Ok(found) => found,
            Err(e) if process.debug_syms => {
                tracing::debug!("symbolizing pid {pid}: {e}; again without debug files");
                process.debug_syms = false;
                self.symbolizer
                    .symbolize(&Source::Process(process), Input::AbsAddr(addrs))
                    .unwrap_or_default()
            }
            Err(e) => {
                tracing::debug!("symbolizing pid {pid}: {e}");
                Vec::new()
            }
        }
    }

    /// The files blazesym opens for `pid`'s addresses: it names each by
    /// `/proc/PID/map_files/START-END` of the mapping it is in.
    fn note_map_files(&mut self, pid: u32, addrs: &[u64]) {
        let Some(maps) = self.maps.get(&pid).map(|c| &c.maps) else {
            return;
        };
        let paths: Vec<PathBuf> = addrs
            .iter()
            .filter_map(|a| maps.find(a.saturating_sub(1)))
            .filter(|m| m.path.starts_with('/'))
            .map(|m| PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end)))
            .collect();
        self.files.entry(pid).or_default().extend(paths);
    }

    /// [`Self::symbol_in_file`] on behalf of process `pid` (the file is
    /// evicted with it).
    fn symbol_in_file_for(
        &mut self,
        pid: u32,
        m: &xpuscope_probes::maps::Mapping,
        file_offset: u64,
    ) -> Option<String> {
        let name = self.symbol_in_file(m, file_offset);
        if m.path.starts_with('/') {
            self.files
                .entry(pid)
                .or_default()
                .insert(PathBuf::from(&m.path));
        }
        name
    }

    /// The function at `file_offset` of the file `m` maps, read from disk:
    /// for a process that has exited (its `/proc` entry is gone) whose
    /// mappings were cached. Only while the path still holds the mapped file
    /// (same inode): a library replaced since would name the wrong code.
    fn symbol_in_file(
        &self,
        m: &xpuscope_probes::maps::Mapping,
        file_offset: u64,
    ) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        if !m.path.starts_with('/') {
            return None;
        }
        // The same file: its inode, on the same device (a container's
        // file of the same path and inode number is another file).
        let meta = std::fs::metadata(&m.path).ok()?;
        let dev = u64::from(libc::major(meta.dev())) << 32 | u64::from(libc::minor(meta.dev()));
        if meta.ino() != m.inode || dev != m.dev {
            return None;
        }
        let src = Source::Elf(Elf::new(&m.path));
        let found = self
            .symbolizer
            .symbolize_single(&src, Input::FileOffset(file_offset))
            .ok()?;
        match found {
            Symbolized::Sym(sym) => Some(sym.name.to_string()),
            Symbolized::Unknown(_) => None,
        }
    }

    /// Forgets what was cached for a process (after exec its addresses
    /// belong to another program).
    pub fn forget_process(&mut self, tgid: u32) {
        self.maps.remove(&tgid);
        self.forked_from.remove(&tgid);
        self.user.remove(&tgid);
        for path in self.files.remove(&tgid).unwrap_or_default() {
            // Never an error (nothing cached is not one); a file another
            // process still names stays open.
            let _ = self.symbolizer.evict(&Evict::Elf(evict::Elf::new(path)));
        }
    }

    /// Sizes of the per-process tables (processes in each).
    #[cfg(test)]
    pub fn table_sizes(&self) -> [(&'static str, usize); 4] {
        [
            ("symbol_frames", self.user.len()),
            ("maps", self.maps.len()),
            ("forked_from", self.forked_from.len()),
            ("files", self.files.len()),
        ]
    }

    /// `child` was forked from `parent` (without exec, so far).
    pub fn process_forked(&mut self, child: u32, parent: u32) {
        self.forked_from.insert(child, parent);
    }

    /// The process whose memory describes `tgid`'s addresses: itself while it
    /// lives, else the live ancestor it was forked from.
    fn live_stand_in(&mut self, tgid: u32, addr: u64) -> u32 {
        let mut pid = tgid;
        for _ in 0..8 {
            // A zombie still has /proc/PID/maps, but empty.
            if self
                .maps_for(pid, addr)
                .is_some_and(|m| m.find(addr).is_some())
            {
                return pid;
            }
            match self.forked_from.get(&pid) {
                Some(parent) => pid = *parent,
                None => break,
            }
        }
        tgid
    }
}

fn short_module(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Whether process `pid` has the agent's root directory (not a container's
/// or a chroot's).
fn shares_agent_root(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(theirs), Ok(ours)) = (
        std::fs::metadata(format!("/proc/{pid}/root")),
        std::fs::metadata("/"),
    ) else {
        return false;
    };
    (theirs.dev(), theirs.ino()) == (ours.dev(), ours.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    #[unsafe(no_mangle)]
    extern "C" fn xpuscope_symbolize_probe_target() -> u64 {
        std::hint::black_box(7)
    }

    #[test]
    fn symbolizes_own_function_and_caches() {
        let mut s = StackSymbolizer::new();
        // +1: frames are return addresses, looked up at addr - 1.
        let addr = xpuscope_symbolize_probe_target as *const () as u64 + 1;
        let frames = s.user_frames(std::process::id(), &[addr]);
        assert_eq!(&*frames[0].function, "xpuscope_symbolize_probe_target");
        assert!(frames[0].module.starts_with('/'), "{:?}", frames[0].module);
        let again = s.user_frames(std::process::id(), &[addr]);
        assert_eq!(frames, again);
        assert_eq!(s.cache_hits, 1);
    }

    #[test]
    fn exited_process_frames_come_from_the_mapped_file() {
        let s = StackSymbolizer::new();
        let addr = xpuscope_symbolize_probe_target as *const () as u64;
        let maps = ProcessMaps::read(std::process::id()).expect("own maps");
        let m = maps.find(addr).expect("own code is mapped").clone();
        let name = s.symbol_in_file(&m, m.file_offset_of(addr));
        assert_eq!(name.as_deref(), Some("xpuscope_symbolize_probe_target"));
        // A path that no longer holds the mapped file (another inode) is not read.
        let replaced = xpuscope_probes::maps::Mapping {
            inode: m.inode.wrapping_add(1),
            ..m.clone()
        };
        assert_eq!(
            s.symbol_in_file(&replaced, replaced.file_offset_of(addr)),
            None
        );
        // Nor one on another device (a container's file of that path and
        // inode number).
        let elsewhere = xpuscope_probes::maps::Mapping {
            dev: m.dev ^ 1,
            ..m
        };
        assert_eq!(
            s.symbol_in_file(&elsewhere, elsewhere.file_offset_of(addr)),
            None
        );
    }

    #[test]
    fn frames_of_a_gone_process_come_through_maps_remembered_while_it_lived() {
        let mut s = StackSymbolizer::new();
        let addr = xpuscope_symbolize_probe_target as *const () as u64;
        let maps = ProcessMaps::read(std::process::id()).expect("own maps");
        // No process has this id: only the remembered maps know its code.
        let gone = u32::MAX - 7;
        s.remember_maps(gone, maps);
        // A return address points just past the call: look up addr + 1.
        let frames = s.user_frames(gone, &[addr + 1]);
        assert_eq!(frames.len(), 1);
        assert_eq!(&*frames[0].function, "xpuscope_symbolize_probe_target");
    }

    #[test]
    fn per_process_tables_are_empty_after_many_processes_come_and_go() {
        let mut s = StackSymbolizer::new();
        let addr = xpuscope_symbolize_probe_target as *const () as u64;
        let maps = ProcessMaps::read(std::process::id()).expect("own maps");
        // Stand-ins for 40 processes of the same binary, gone by the time
        // their stacks are symbolized (through the mapped file), some
        // forked from others; then ended.
        let first = u32::MAX - 1000;
        for i in 0..40u32 {
            let pid = first + i;
            s.remember_maps(pid, maps.clone());
            if i % 2 == 1 {
                s.process_forked(pid, pid - 1);
            }
            let frames = s.user_frames(pid, &[addr + 1]);
            assert_eq!(&*frames[0].function, "xpuscope_symbolize_probe_target");
            assert!(
                s.table_sizes().iter().all(|(_, n)| *n <= 2),
                "{:?}",
                s.table_sizes()
            );
            if i % 2 == 1 {
                s.forget_process(pid);
                s.forget_process(pid - 1);
            }
        }
        // A live process (this one) too: its map_files paths are noted and
        // evicted with it.
        let own = std::process::id();
        s.user_frames(own, &[addr + 1]);
        assert!(s.files.get(&own).is_some_and(|f| {
            f.iter()
                .any(|p| p.starts_with(format!("/proc/{own}/map_files/")))
        }));
        s.forget_process(own);
        assert!(
            s.table_sizes().iter().all(|(_, n)| *n == 0),
            "{:?}",
            s.table_sizes()
        );
        // Evicted files are opened again when needed.
        let frames = s.user_frames(own, &[addr + 1]);
        assert_eq!(&*frames[0].function, "xpuscope_symbolize_probe_target");
    }

    #[test]
    fn drops_tracing_frames_from_kernel_stacks() {
        assert!(is_tracing_frame("bpf_prog_6deef7357e7b4530_sched_switch"));
        assert!(is_tracing_frame("bpf_trace_run4"));
        assert!(!is_tracing_frame("__schedule"));
    }
}
