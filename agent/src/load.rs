//! Loading the kernel programs with aya and attaching them.

use std::path::Path;

use anyhow::{Context, Result};
use aya::maps::{Array, HashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::BtfTracePoint;
use aya::{Btf, Ebpf, EbpfLoader};
use xpuscope_common::{Config, DROP_SLOTS, TARGET_GEN_AGENT, TaskOffsets, globals, maps};

/// The kernel programs, embedded at build time (empty if not built).
pub static EBPF_OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xpuscope-ebpf.o"));

/// Program name in the object -> kernel tracepoint it attaches to.
const PROGRAMS: &[(&str, &str)] = &[
    ("sched_process_fork", "sched_process_fork"),
    ("sched_process_exec", "sched_process_exec"),
    ("sched_process_exit", "sched_process_exit"),
    ("task_rename", "task_rename"),
    ("sched_waking", "sched_waking"),
    ("sched_wakeup_new", "sched_wakeup_new"),
    ("sched_switch", "sched_switch"),
];

/// The loaded and attached programs; dropping it detaches everything.
pub struct Probes {
    pub bpf: Ebpf,
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
}

pub struct LoadOptions<'a> {
    pub offsets: TaskOffsets,
    pub ring_bytes: u32,
    pub device_ring_bytes: u32,
    pub config: Config,
    pub kernel_btf: &'a Path,
}

pub fn load_and_attach(opts: &LoadOptions) -> Result<Probes> {
    let agent_tgid = std::process::id();
    let mut bpf = EbpfLoader::new()
        .override_global(globals::AGENT_TGID, &agent_tgid, true)
        .override_global(globals::TASK_OFFSETS, &opts.offsets, true)
        .map_max_entries(maps::EVENTS, opts.ring_bytes)
        .map_max_entries(maps::DEVICE_EVENTS, opts.device_ring_bytes)
        .load(EBPF_OBJECT)
        .context(
            "loading the eBPF programs failed (is BPF enabled in this kernel, and not blocked by \
             lockdown or a seccomp/LSM policy?)",
        )?;
    // Kernel-side warnings (e.g. the target map filling up) go to our log.
    let logger = match aya_log::EbpfLogger::init(&mut bpf) {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::debug!("no eBPF logger: {e}");
            None
        }
    };
    set_config(&mut bpf, opts.config)?;
    let btf = Btf::parse_file(opts.kernel_btf, aya::Endianness::default())
        .with_context(|| format!("reading kernel BTF from {}", opts.kernel_btf.display()))?;
    for (name, tracepoint) in PROGRAMS {
        let program: &mut BtfTracePoint = bpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the eBPF object"))?
            .try_into()?;
        program
            .load(tracepoint, &btf)
            .with_context(|| format!("verifying/loading {name}"))?;
        program
            .attach()
            .with_context(|| format!("attaching {name} to tracepoint {tracepoint}"))?;
    }
    Ok(Probes { bpf, logger })
}

pub fn set_config(bpf: &mut Ebpf, config: Config) -> Result<()> {
    let mut array: Array<&mut MapData, Config> =
        Array::try_from(bpf.map_mut(maps::CONFIG).context("CONFIG map missing")?)?;
    array.set(0, config, 0).context("writing CONFIG")?;
    Ok(())
}

/// Adds `tgid` to the traced set (`TARGETS`).
pub fn add_target(bpf: &mut Ebpf, tgid: u32) -> Result<()> {
    let mut targets: HashMap<&mut MapData, u32, u32> =
        HashMap::try_from(bpf.map_mut(maps::TARGETS).context("TARGETS map missing")?)?;
    targets
        .insert(tgid, 1, 0)
        .with_context(|| format!("adding pid {tgid} to the traced set"))?;
    // Invalidate the kernel's per-CPU answers about who is traced.
    let mut generation: Array<&mut MapData, u64> = Array::try_from(
        bpf.map_mut(maps::TARGET_GEN)
            .context("TARGET_GEN map missing")?,
    )?;
    let next = generation.get(&TARGET_GEN_AGENT, 0).unwrap_or(0) + 1;
    generation
        .set(TARGET_GEN_AGENT, next, 0)
        .context("bumping the target generation")
}

impl Probes {
    pub fn add_target(&mut self, tgid: u32) -> Result<()> {
        add_target(&mut self.bpf, tgid)
    }

    /// The traced tgids (including children the kernel added on fork).
    pub fn targets(&self) -> Vec<u32> {
        let Some(map) = self.bpf.map(maps::TARGETS) else {
            return Vec::new();
        };
        let Ok(targets) = HashMap::<&MapData, u32, u32>::try_from(map) else {
            return Vec::new();
        };
        targets.keys().filter_map(|k| k.ok()).collect()
    }

    /// Drop counters: for each slot (`EventKind` value), per CPU.
    pub fn drops(&self) -> Vec<Vec<u64>> {
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

    /// Detaches and unloads every program (maps stay readable).
    /// Events the kernel skipped because a program would have re-entered
    /// itself on a CPU (per `EventKind` slot). Read before detaching.
    pub fn kernel_skips(&self) -> Vec<u64> {
        use std::os::fd::{AsFd, AsRawFd};
        use xpuscope_common::EventKind;
        let kind_of = |name: &str| match name {
            "sched_switch" => Some(EventKind::SchedSwitch),
            "sched_waking" => Some(EventKind::SchedWaking),
            "sched_wakeup_new" => Some(EventKind::SchedWakeupNew),
            "sched_process_fork" => Some(EventKind::ProcessFork),
            "sched_process_exec" => Some(EventKind::ProcessExec),
            "sched_process_exit" => Some(EventKind::ProcessExit),
            "task_rename" => Some(EventKind::TaskRename),
            _ => None,
        };
        let mut out = vec![0; DROP_SLOTS as usize];
        for (name, _) in PROGRAMS {
            let (Some(kind), Some(program)) = (kind_of(name), self.bpf.program(name)) else {
                continue;
            };
            if let Ok(fd) = program.fd()
                && let Some(n) = crate::kernel_misses::recursion_misses(fd.as_fd().as_raw_fd())
            {
                out[kind as usize] += n;
            }
        }
        out
    }

    pub fn detach_all(&mut self) {
        for (name, _) in PROGRAMS {
            if let Some(program) = self.bpf.program_mut(name)
                && let Ok(p) = <&mut BtfTracePoint>::try_from(program)
                && let Err(e) = p.unload()
            {
                tracing::warn!("detaching {name}: {e}");
            }
        }
    }

    /// Forwards kernel-side log records to the agent's log.
    pub fn flush_log(&mut self) {
        if let Some(logger) = &mut self.logger {
            logger.flush();
        }
    }

    /// The scheduler ring and the device-call ring.
    pub fn take_rings(&mut self) -> Result<(RingBuf<MapData>, RingBuf<MapData>)> {
        let mut take = |name: &str| -> Result<RingBuf<MapData>> {
            let map = self
                .bpf
                .take_map(name)
                .with_context(|| format!("{name} map missing"))?;
            Ok(RingBuf::try_from(map)?)
        };
        Ok((take(maps::EVENTS)?, take(maps::DEVICE_EVENTS)?))
    }
}
