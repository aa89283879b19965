//! Loading the kernel programs with aya and attaching the tracepoint ones;
//! [`Kernel`] is the loaded object, and the [`KernelControl`] the supervisor
//! uses over it.

use std::path::Path;

use anyhow::{Context, Result};
use aya::maps::{Array, HashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::BtfTracePoint;
use aya::{Btf, Ebpf, EbpfLoader};
use xpuscope_common::{
    Config, DROP_SLOTS, EventKind, TARGET_GEN_AGENT, TaskOffsets, globals, maps,
};

use super::config_map;
use super::control::KernelControl;
use super::error::KernelError;
use super::features::{self, KernelFeatures};
use super::object::EBPF_OBJECT;
use super::probes::{AyaAttacher, MultiPrograms};

/// A tracepoint program of the object: attached at load, for the whole run.
#[derive(Clone, Copy, Debug)]
pub struct TracepointProgram {
    /// Its name in the object (the kernel function's name).
    pub name: &'static str,
    /// The BTF tracepoint it attaches to.
    pub tracepoint: &'static str,
    /// The record it pushes: its skipped runs are counted as drops of it.
    pub kind: EventKind,
    /// A program for kernels without a feature this one needs (an older
    /// tracepoint signature).
    pub fallback: Option<Fallback>,
}

/// [`TracepointProgram::fallback`].
#[derive(Clone, Copy, Debug)]
pub struct Fallback {
    /// Its name in the object.
    pub name: &'static str,
    /// Whether the running kernel has what the primary program needs:
    /// without it the fallback is loaded straight away. (With it, the
    /// fallback is still tried if the primary fails to verify.)
    pub primary_runs: fn(&KernelFeatures) -> bool,
}

impl TracepointProgram {
    /// This program's names in the object: itself and its fallback.
    fn names(&self) -> impl Iterator<Item = &'static str> {
        std::iter::once(self.name).chain(self.fallback.map(|f| f.name))
    }
}

/// Every tracepoint program, once. (The device-call uprobes are attached
/// per library by [`super::probes`].)
pub const PROGRAMS: &[TracepointProgram] = &[
    TracepointProgram {
        name: "sched_process_fork",
        tracepoint: "sched_process_fork",
        kind: EventKind::ProcessFork,
        fallback: None,
    },
    TracepointProgram {
        name: "sched_process_exec",
        tracepoint: "sched_process_exec",
        kind: EventKind::ProcessExec,
        fallback: None,
    },
    TracepointProgram {
        name: "sched_process_exit",
        tracepoint: "sched_process_exit",
        kind: EventKind::ProcessExit,
        // Before Linux 6.16 the tracepoint has no `group_dead`: the
        // fallback reads it from the task's `signal->live`.
        fallback: Some(Fallback {
            name: "sched_process_exit_compat",
            primary_runs: |f| f.exit_group_dead,
        }),
    },
    TracepointProgram {
        name: "task_rename",
        tracepoint: "task_rename",
        kind: EventKind::TaskRename,
        fallback: None,
    },
    TracepointProgram {
        name: "sched_waking",
        tracepoint: "sched_waking",
        kind: EventKind::SchedWaking,
        fallback: None,
    },
    TracepointProgram {
        name: "sched_wakeup_new",
        tracepoint: "sched_wakeup_new",
        kind: EventKind::SchedWakeupNew,
        fallback: None,
    },
    TracepointProgram {
        name: "sched_switch",
        tracepoint: "sched_switch",
        kind: EventKind::SchedSwitch,
        // Before Linux 5.18 the tracepoint has no `prev_state`: the
        // fallback reads it from the task (Ubuntu 22.04's 5.15).
        fallback: Some(Fallback {
            name: "sched_switch_compat",
            primary_runs: |f| f.switch_prev_state,
        }),
    },
];

/// The program on the dynamic loader's debugger hook.
pub const LOADER_PROGRAM: &str = "loader_link_map";
/// The loader function it sits on: glibc's `r_debug.r_brk`, called before
/// and after every change to a process's link map (exported in `.dynsym`
/// as `GLIBC_PRIVATE`).
pub const LOADER_HOOK: &str = "_dl_debug_state";
/// The loader programs name in `PT_INTERP` on x86-64 glibc systems.
pub const DEFAULT_LOADER: &str = "/lib64/ld-linux-x86-64.so.2";

/// The kernel's ring buffers, taken once by the collect stage.
pub struct KernelRings {
    /// The traced job's switches and wakings, process lifetimes, renames
    /// and off-CPU stacks.
    pub sched: RingBuf<MapData>,
    /// Device-library call records.
    pub device: RingBuf<MapData>,
    /// Switches where neither task is traced.
    pub bystander: RingBuf<MapData>,
}

/// The loaded object with its tracepoint programs attached; dropping it
/// detaches everything.
pub struct Kernel {
    bpf: Ebpf,
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    /// Loader files (device, inode) whose debugger hook was tried.
    loader_hooks: std::collections::HashSet<(u64, u64)>,
    /// Those whose hook is attached (`stat`'s device, inode).
    loaders_hooked: Vec<(u64, u64)>,
    /// The loader hooks' links, owned here so the stop hands them to the
    /// closer (closing a uprobe waits for RCU grace periods, which a
    /// switch storm starves: stops of over a minute were seen).
    loader_links: Vec<aya::programs::uprobe::UProbeLink>,
    /// The device-call programs as uprobe-multi programs, once loaded.
    multi: MultiPrograms,
}

pub struct LoadOptions<'a> {
    pub offsets: TaskOffsets,
    pub ring_bytes: u32,
    pub device_ring_bytes: u32,
    pub bystander_ring_bytes: u32,
    pub config: Config,
    pub kernel_btf: &'a Path,
}

impl Kernel {
    /// Loads the object and attaches every [`PROGRAMS`] entry.
    pub fn load_and_attach(opts: &LoadOptions) -> Result<Kernel> {
        // What the programs need, named with the release that brought it,
        // before the verifier gets to fail on it.
        let features = features::check(&crate::btf::Btf::from_file(opts.kernel_btf)?)?;
        let agent_tgid = std::process::id();
        let mut bpf = EbpfLoader::new()
            .override_global(globals::AGENT_TGID, &agent_tgid, true)
            .override_global(globals::TASK_OFFSETS, &opts.offsets, true)
            .map_max_entries(maps::EVENTS, opts.ring_bytes)
            .map_max_entries(maps::DEVICE_EVENTS, opts.device_ring_bytes)
            .map_max_entries(maps::BYSTANDER_EVENTS, opts.bystander_ring_bytes)
            .load(EBPF_OBJECT)
            .context(
                "loading the eBPF programs failed (is BPF enabled in this kernel, and not blocked \
                 by lockdown or a seccomp/LSM policy?)",
            )?;
        // Kernel-side warnings (e.g. the target map filling up) go to our log.
        let logger = match aya_log::EbpfLogger::init(&mut bpf) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::debug!("no eBPF logger: {e}");
                None
            }
        };
        config_map::write(&mut bpf, opts.config)?;
        let btf = Btf::parse_file(opts.kernel_btf, aya::Endianness::default())
            .with_context(|| format!("reading kernel BTF from {}", opts.kernel_btf.display()))?;
        for p in PROGRAMS {
            let name = match p.fallback {
                Some(f) if !(f.primary_runs)(&features) => {
                    load_tracepoint(&mut bpf, f.name, p.tracepoint, &btf)?;
                    f.name
                }
                fallback => match (
                    load_tracepoint(&mut bpf, p.name, p.tracepoint, &btf),
                    fallback,
                ) {
                    (Ok(()), _) => p.name,
                    (Err(e), Some(f)) => {
                        tracing::warn!(
                            "{} does not load on this kernel ({e:#}); using {}",
                            p.name,
                            f.name
                        );
                        load_tracepoint(&mut bpf, f.name, p.tracepoint, &btf)?;
                        f.name
                    }
                    (Err(e), None) => return Err(e),
                },
            };
            let program: &mut BtfTracePoint = bpf
                .program_mut(name)
                .ok_or_else(|| KernelError::Missing(format!("program {name}")))?
                .try_into()?;
            program
                .attach()
                .with_context(|| format!("attaching {name} to tracepoint {}", p.tracepoint))?;
        }
        Ok(Kernel {
            bpf,
            logger,
            loader_hooks: Default::default(),
            loaders_hooked: Vec::new(),
            loader_links: Vec::new(),
            multi: MultiPrograms::default(),
        })
    }

    /// Probes the debugger hook of the dynamic loader at `path` for every
    /// process (traced ones report each change of their link map: the
    /// supervisor rescans their maps at once). Once per loader file;
    /// `Ok(false)` if it was tried before. Without the hook, libraries
    /// `dlopen` maps are found by the periodic rescan only.
    pub fn hook_loader(&mut self, path: &str) -> Result<bool> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).with_context(|| format!("loader {path}"))?;
        if !self.loader_hooks.insert((meta.dev(), meta.ino())) {
            return Ok(false);
        }
        let offset = xpuscope_probes::resolve::exported_functions(Path::new(path))?
            .into_iter()
            .find(|f| f.name == LOADER_HOOK)
            .map(|f| f.file_offset)
            .with_context(|| {
                format!(
                    "{path} exports no {LOADER_HOOK}: libraries loaded with dlopen are found \
                     by the periodic rescan only"
                )
            })?;
        let program: &mut aya::programs::UProbe = self
            .bpf
            .program_mut(LOADER_PROGRAM)
            .ok_or_else(|| KernelError::Missing(format!("program {LOADER_PROGRAM}")))?
            .try_into()?;
        if program.fd().is_err() {
            program
                .load()
                .with_context(|| format!("verifying/loading {LOADER_PROGRAM}"))?;
        }
        let point = aya::programs::uprobe::UProbeAttachPoint {
            location: offset.into(),
            cookie: None,
        };
        let id = program
            .attach(
                point,
                path,
                aya::programs::uprobe::UProbeScope::AllProcesses,
            )
            .with_context(|| format!("attaching {LOADER_PROGRAM} at {path}+{offset:#x}"))?;
        self.loader_links.push(
            program
                .take_link(id)
                .with_context(|| format!("taking the link of {LOADER_PROGRAM} at {path}"))?,
        );
        tracing::info!("loader hook: {path}+{offset:#x} ({LOADER_HOOK})");
        self.loaders_hooked.push((meta.dev(), meta.ino()));
        Ok(true)
    }

    /// The loader files (`stat`'s device, inode) whose debugger hook is
    /// attached: a traced process mapping one reports each change of its
    /// link map from then on.
    pub fn hooked_loaders(&self) -> &[(u64, u64)] {
        &self.loaders_hooked
    }

    /// The device-call probes' kernel effects over this object.
    pub fn attacher(&mut self) -> AyaAttacher<'_> {
        AyaAttacher::new(&mut self.bpf, &mut self.multi)
    }

    /// Detaches and unloads every tracepoint program and the loader hook
    /// (maps stay readable).
    pub fn detach_all(&mut self) {
        // The hook's links close in the closer, after the agent exits (the
        // program, unloaded below, stays alive with them until then; what
        // it pushes meanwhile nobody reads).
        crate::kernel::probes::closer::close_after_exit(std::mem::take(&mut self.loader_links));
        if let Some(program) = self.bpf.program_mut(LOADER_PROGRAM)
            && program.fd().is_ok()
            && let Ok(up) = <&mut aya::programs::UProbe>::try_from(program)
            && let Err(e) = up.unload()
        {
            tracing::warn!("detaching {LOADER_PROGRAM}: {e}");
        }
        for name in PROGRAMS.iter().flat_map(|p| p.names()) {
            if let Some(program) = self.bpf.program_mut(name)
                && program.fd().is_ok()
                && let Ok(tp) = <&mut BtfTracePoint>::try_from(program)
                && let Err(e) = tp.unload()
            {
                tracing::warn!("detaching {name}: {e}");
            }
        }
    }

    /// Changes how off-CPU stacks are taken (a `stack_mode` value); the
    /// programs read `CONFIG` at every run, so it applies at once.
    pub fn set_stack_mode(&mut self, mode: u32) -> Result<(), KernelError> {
        config_map::update(&mut self.bpf, |c| c.stack_mode = mode)
    }

    /// Turns the scheduler programs' records of the traced processes off
    /// (or on again), at runtime.
    pub fn set_sched_off(&mut self, off: bool) -> Result<(), KernelError> {
        config_map::update(&mut self.bpf, |c| c.sched_off = off as u32)
    }

    /// Forwards kernel-side log records to the agent's log.
    pub fn flush_log(&mut self) {
        if let Some(logger) = &mut self.logger {
            logger.flush();
        }
    }

    /// A handle on the threads' learned stack ends, for the pipeline.
    pub fn stack_ends(&self) -> Result<super::stack_ends::StackEndsMap, KernelError> {
        super::stack_ends::open(&self.bpf)
    }

    /// The scheduler, device-call and bystander rings.
    pub fn take_rings(&mut self) -> Result<KernelRings> {
        let mut take = |name: &str| -> Result<RingBuf<MapData>> {
            let map = self
                .bpf
                .take_map(name)
                .ok_or_else(|| KernelError::Missing(format!("map {name}")))?;
            // The device-call programs loaded later push into these rings.
            self.multi
                .keep_map(name, &map)
                .with_context(|| format!("duplicating the descriptor of map {name}"))?;
            Ok(RingBuf::try_from(map)?)
        };
        Ok(KernelRings {
            sched: take(maps::EVENTS)?,
            device: take(maps::DEVICE_EVENTS)?,
            bystander: take(maps::BYSTANDER_EVENTS)?,
        })
    }
}

impl KernelControl for Kernel {
    fn add_target(&mut self, tgid: u32) -> Result<(), KernelError> {
        add_target(&mut self.bpf, tgid)
    }

    fn targets(&self) -> Vec<u32> {
        let Some(map) = self.bpf.map(maps::TARGETS) else {
            return Vec::new();
        };
        let Ok(targets) = HashMap::<&MapData, u32, u32>::try_from(map) else {
            return Vec::new();
        };
        targets.keys().filter_map(|k| k.ok()).collect()
    }

    fn drops(&self) -> Vec<Vec<u64>> {
        let Some(map) = self.bpf.map(maps::DROPS) else {
            return Vec::new();
        };
        let Ok(array) = PerCpuArray::<&MapData, u64>::try_from(map) else {
            return Vec::new();
        };
        (0..DROP_SLOTS)
            .map(|slot| {
                array
                    .get(&slot, 0)
                    .map(|v| v.iter().copied().collect())
                    .unwrap_or_default()
            })
            .collect()
    }

    fn kernel_skips(&self) -> Vec<u64> {
        use std::os::fd::{AsFd, AsRawFd};
        let mut out = vec![0; DROP_SLOTS as usize];
        for (p, name) in PROGRAMS.iter().flat_map(|p| p.names().map(move |n| (p, n))) {
            let Some(program) = self.bpf.program(name) else {
                continue;
            };
            if let Ok(fd) = program.fd()
                && let Some(n) = super::misses::recursion_misses(fd.as_fd().as_raw_fd())
            {
                out[p.kind as usize] += n;
            }
        }
        out
    }
}

/// Verifies and loads one tracepoint program.
fn load_tracepoint(bpf: &mut Ebpf, name: &str, tracepoint: &str, btf: &Btf) -> Result<()> {
    let program: &mut BtfTracePoint = bpf
        .program_mut(name)
        .ok_or_else(|| KernelError::Missing(format!("program {name}")))?
        .try_into()?;
    program
        .load(tracepoint, btf)
        .with_context(|| format!("verifying/loading {name}"))
}

/// Adds `tgid` to the traced set (`TARGETS`) and tells every CPU's cache.
pub fn add_target(bpf: &mut Ebpf, tgid: u32) -> Result<(), KernelError> {
    let map = bpf
        .map_mut(maps::TARGETS)
        .ok_or_else(|| KernelError::Missing(format!("map {}", maps::TARGETS)))?;
    let mut targets: HashMap<&mut MapData, u32, u32> =
        HashMap::try_from(map).map_err(KernelError::map("opening TARGETS"))?;
    targets
        .insert(tgid, 1, 0)
        .map_err(KernelError::map(format!(
            "adding pid {tgid} to the traced set"
        )))?;
    // Invalidate the kernel's per-CPU answers about who is traced.
    let map = bpf
        .map_mut(maps::TARGET_GEN)
        .ok_or_else(|| KernelError::Missing(format!("map {}", maps::TARGET_GEN)))?;
    let mut generation: Array<&mut MapData, u64> =
        Array::try_from(map).map_err(KernelError::map("opening TARGET_GEN"))?;
    let next = generation.get(&TARGET_GEN_AGENT, 0).unwrap_or(0) + 1;
    generation
        .set(TARGET_GEN_AGENT, next, 0)
        .map_err(KernelError::map("bumping the target generation"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tracepoint_program_is_listed_once_with_its_own_kind() {
        let mut names: Vec<&str> = PROGRAMS.iter().flat_map(|p| p.names()).collect();
        let listed = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), listed, "a program listed twice");
        let mut kinds: Vec<u32> = PROGRAMS.iter().map(|p| p.kind as u32).collect();
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(kinds.len(), PROGRAMS.len(), "two programs push one kind");
        assert!(kinds.iter().all(|&k| k < DROP_SLOTS));
    }

    /// Every program of the table, fallbacks included, verifies on the
    /// running kernel (needs root and BPF, like the end-to-end tests: it
    /// fails without them). The exit program's fallback is the one an
    /// older kernel loads, so it is checked here too, where the primary
    /// loads; so are the device-call and loader programs.
    #[test]
    #[cfg(feature = "root-tests")]
    fn every_program_and_fallback_verifies_on_this_kernel() {
        crate::preflight::check_object(EBPF_OBJECT).expect("the eBPF object is built");
        let vmlinux = Path::new(crate::btf::VMLINUX_BTF);
        let offsets = crate::btf::task_offsets(&crate::btf::Btf::from_file(vmlinux).unwrap())
            .expect("task_struct offsets");
        let mut bpf = EbpfLoader::new()
            .override_global(globals::TASK_OFFSETS, &offsets, true)
            .load(EBPF_OBJECT)
            .expect("loading the object (root and BPF are required)");
        let btf = Btf::parse_file(vmlinux, aya::Endianness::default()).unwrap();
        let features =
            features::check(&crate::btf::Btf::from_file(vmlinux).unwrap()).expect("features");
        for p in PROGRAMS {
            // A primary program whose feature the kernel lacks is not
            // loaded there (`cargo xtask test --kernel` runs this on
            // older kernels).
            let primary_runs = p.fallback.is_none_or(|f| (f.primary_runs)(&features));
            for name in p.names().filter(|&n| n != p.name || primary_runs) {
                load_tracepoint(&mut bpf, name, p.tracepoint, &btf)
                    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
            }
        }
        for name in [
            LOADER_PROGRAM,
            crate::kernel::probes::attach::ENTRY_PROGRAM,
            crate::kernel::probes::attach::RETURN_PROGRAM,
        ] {
            let program: &mut aya::programs::UProbe = bpf
                .program_mut(name)
                .unwrap_or_else(|| panic!("no program {name}"))
                .try_into()
                .unwrap();
            program.load().unwrap_or_else(|e| panic!("{name}: {e:#}"));
        }
    }

    /// This machine's loader exports the debugger hook the agent probes
    /// (Debian's glibc does, as `GLIBC_PRIVATE`).
    #[test]
    fn the_default_loader_exports_its_debugger_hook() {
        let functions = xpuscope_probes::resolve::exported_functions(Path::new(DEFAULT_LOADER))
            .expect("the default loader reads");
        assert!(
            functions.iter().any(|f| f.name == LOADER_HOOK),
            "{DEFAULT_LOADER} exports no {LOADER_HOOK}"
        );
    }
}
