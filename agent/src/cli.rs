//! Command-line interface. Defaults come from [`AttachConfig::default`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::{self, AttachConfig, StackPolicy};
use crate::sinks::detect::host_config;

#[derive(Parser, Debug)]
#[command(
    name = "agent",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("XPUSCOPE_COMMIT"), ")"),
    about = "xpuscope: eBPF observability for AI training nodes",
    long_about = "xpuscope attaches to a running training process (no restart, no LD_PRELOAD) and \
                  writes a native Perfetto trace (open it at https://ui.perfetto.dev) of its \
                  scheduling: what ran on each CPU, every thread's state, who woke and who \
                  preempted it, and symbolized off-CPU stacks."
)]
pub struct Cli {
    /// More logging (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Trace a running process (and its threads and children) until the
    /// duration ends, Ctrl-C/SIGTERM, or the process exits.
    Attach(AttachArgs),
    /// List the device libraries a process has mapped and where each
    /// probed function's probe goes; with --duration, also count each
    /// probe's hits for that long (attached, recording nothing else).
    Probes(ProbesArgs),
    /// Run as the node's always-on agent (what the systemd unit runs):
    /// finds training processes by itself (device libraries they map, or
    /// the configured selectors), keeps a flight recorder, serves metrics
    /// and the control API.
    Service(crate::service::ServiceArgs),
    /// Talk to a running `agent service` over its control socket.
    Ctl(crate::service::control::client::CtlArgs),
    /// Merge the traces of one job's nodes (one `agent attach` trace per
    /// node) into one trace: clocks aligned on the job's collectives,
    /// processes kept apart per node, ranks labelled with their parallel
    /// groups and ordered by global rank.
    Merge(MergeArgs),
    /// Run the detectors (hang, crash, device OOM, slow rank, late
    /// arrival, slow link) over recorded traces of one job (one per node,
    /// or one of all ranks) and print the findings, most important first.
    Diagnose(DiagnoseArgs),
    /// Print the manual page (roff), as the package installs it:
    /// `agent man | man -l -`.
    Man,
    /// Print the completion script for a shell (bash, zsh, fish, ...), as
    /// the package installs it.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Args, Debug)]
pub struct DiagnoseArgs {
    /// `agent attach` traces of one job.
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// Also write the findings as JSON (`xpuscope-findings/1`); `-`
    /// writes it to stdout (the text then goes to stderr).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A call still open at the end of the trace for longer than this is
    /// a hang.
    #[arg(long, default_value = "60s", value_parser = parse_hang_timeout)]
    pub hang_timeout: Duration,
    /// See `agent attach --late-min`.
    #[arg(long, default_value = "10ms", value_parser = config::parse_duration)]
    pub late_min: Duration,
    /// See `agent attach --slow-rank-persist`.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub slow_rank_persist: u32,
    /// See `agent attach --slow-link-ratio`.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub slow_link_ratio: u32,
}

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// One trace per node (`agent attach` output).
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// The merged trace to write.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Also write the summary (offsets, groups, warnings) as JSON.
    #[arg(long)]
    pub stats_json: Option<PathBuf>,
    /// Also write each rank's step breakdown as CSV.
    #[arg(long)]
    pub steps_csv: Option<PathBuf>,
    /// Merge even if the traces' job labels differ.
    #[arg(long)]
    pub force: bool,
    /// Leave scheduler data out (needed when the nodes have more than
    /// 1024 CPUs in all).
    #[arg(long)]
    pub no_sched: bool,
}

#[derive(Args, Debug)]
pub struct ProbesArgs {
    /// The process to inspect.
    #[arg(short, long)]
    pub pid: u32,
    /// Attach every probe (all levels) this long and list how often each
    /// was hit (e.g. 5s). Needs root. Without it nothing is attached.
    #[arg(short, long, value_parser = config::parse_duration)]
    pub duration: Option<std::time::Duration>,
}

#[derive(Args, Debug)]
pub struct AttachArgs {
    /// The process to trace.
    #[arg(short, long, required_unless_present = "system")]
    pub pid: Option<u32>,
    /// Trace file to write (native Perfetto protobuf).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Stop after this long (e.g. 30s, 500ms, 2m).
    #[arg(short, long, value_parser = config::parse_duration)]
    pub duration: Option<Duration>,
    /// Record scheduling of every process on every CPU (host-bound analysis).
    #[arg(long)]
    pub system: bool,
    /// Off-CPU stack policy.
    #[arg(long, value_enum, default_value_t = AttachConfig::default().stacks)]
    pub stacks: StackPolicy,
    /// Sampled policy: stacks per second per thread (average).
    #[arg(long, default_value_t = config::DEFAULT_STACK_RATE)]
    pub stack_rate: u32,
    /// Sampled policy: burst of stacks a thread may take at once.
    #[arg(long, default_value_t = config::DEFAULT_STACK_BURST)]
    pub stack_burst: u32,
    /// Kernel ring buffer size for scheduling records (power of two, e.g. 32M).
    /// It is mapped into the agent twice (so records can wrap) and costs
    /// about twice its size in resident memory: 32M about 64 MB, 1G about
    /// 2 GB.
    #[arg(long, value_parser = config::parse_ring_size, default_value = "32M")]
    pub ring_size: u32,
    /// Kernel ring buffer size for device-library calls (power of two).
    /// Larger absorbs longer reader stalls at bursts of calls; past the CPU
    /// caches each traced call costs more. Like --ring-size it costs about
    /// twice its size in memory.
    #[arg(long, value_parser = config::parse_ring_size, default_value = "2M")]
    pub device_ring_size: u32,
    /// Kernel ring buffer size for switches between two untraced tasks
    /// (power of two): what ran between the traced threads on their CPUs
    /// (with --system and no --pid, every switch). Kept apart so that a
    /// neighbour's switch storm can only lose these records, never the
    /// traced job's; what does not fit is counted as bystander_switch
    /// drops. Like --ring-size it costs about twice its size in memory.
    #[arg(long, value_parser = config::parse_ring_size, default_value = "8M")]
    pub bystander_ring_size: u32,
    /// Read kernel struct layouts from this BTF file instead of /sys/kernel/btf/vmlinux.
    #[arg(long, default_value = crate::btf::VMLINUX_BTF)]
    pub kernel_btf: PathBuf,
    /// Also write a machine-readable summary (JSON) here.
    #[arg(long)]
    pub stats_json: Option<PathBuf>,
    /// Device-library calls to record: 0 collectives, syncs, memory and
    /// communicator set-up; 1 adds kernel launches and copies; 2 adds
    /// activity records (CUPTI/MSPTI).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub probe_level: u8,
    /// Do not count launches below --probe-level 1. By default every kernel
    /// and graph launch is counted in the kernel (an entry probe per launch
    /// function, no record; about a microsecond of the launching thread per
    /// launch, two for a runtime launch) and each step shows its launches;
    /// off, launches cost nothing below level 1 and steps show none.
    #[arg(long)]
    pub no_launch_counts: bool,
    /// Device calls recorded one by one per second, per process and
    /// function; past it a thread's calls of that function are summarized
    /// per 100 ms (a count and the time in them), so a pathological loop
    /// cannot blow up memory or the trace. Collectives, communicator
    /// set-up, device memory and failed calls are always recorded. 0: no
    /// limit.
    #[arg(long, default_value_t = config::DEFAULT_DEVICE_CALL_RATE)]
    pub device_call_rate: u32,
    /// A collective, point-to-point call or sync running longer than this
    /// is reported as a hang (in the summary, `--stats-json` and the
    /// trace's `xpuscope findings` track), e.g. `30s`, `5m`.
    #[arg(long, default_value = "300s", value_parser = parse_hang_timeout)]
    pub hang_timeout: Duration,
    /// host_contention: a step counts as contended when outsiders (not
    /// the job's other ranks, not the agent) kept the rank's training
    /// thread off its CPU for at least this percentage of it above what it
    /// usually loses (1-100; and `contention_min_lost`, 3 steps in a row
    /// spanning `contention_min_span`: the service's `[detect]` keys).
    #[arg(long, default_value_t = host_config::DEFAULT_CONTENTION_MIN_SHARE_PCT,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub contention_min_share: u32,
    /// dataloader_stall: the shortest wait for the data loader reported
    /// (also 4x the rank's usual wait), e.g. `50ms`.
    #[arg(long, default_value = "50ms", value_parser = config::parse_duration)]
    pub stall_min: Duration,
    /// memory_leak: the growth per step of one allocation site that counts
    /// (5 steps in a row), e.g. `1M`.
    #[arg(long, default_value = "1M", value_parser = parse_leak_rate)]
    pub leak_min_per_step: u64,
    /// The floor of the lateness threshold: the last member to enter a
    /// collective is late when it came, beyond its own usual offset, more
    /// than the largest of this, 5 MADs of the others' arrivals, 5 MADs of
    /// its own on-time offsets and a quarter of its usual step after the
    /// others' median arrival (`slow_rank`; a lone `late_arrival` must also
    /// cost half a step).
    #[arg(long, default_value = "10ms", value_parser = config::parse_duration)]
    pub late_min: Duration,
    /// A rank late at this many of the last twice as many collectives of a
    /// communicator is a slow rank.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub slow_rank_persist: u32,
    /// Collectives this many times slower per byte than the fastest
    /// communicator's, nobody late, are a slow link.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub slow_link_ratio: u32,
    /// A rank whose compute kernels per step take this percentage of its
    /// data-parallel peers' or more, --slow-rank-persist steps in a row, is
    /// a slow rank (needs activity records: --probe-level 2).
    #[arg(long, default_value_t = 150, value_parser = clap::value_parser!(u32).range(101..=100_000))]
    pub slow_compute_pct: u32,
    /// Testing aid: switch the device level while recording, e.g.
    /// `0,1@1s` (level 0 from the start, 1 after 1 s).
    #[arg(long, hide = true, value_parser = config::parse_level_schedule)]
    pub probe_level_schedule: Option<config::LevelSchedule>,
    /// Testing aid: print the kernel's traced set (TARGETS) when stopping.
    #[arg(long, hide = true)]
    pub report_targets: bool,
    /// Testing aid: pause the reader this long (e.g. 5ms) after each batch.
    #[arg(long, hide = true, value_parser = config::parse_duration)]
    pub reader_delay: Option<Duration>,
    /// Testing aid: no probe on the dynamic loader's debugger hook, so a
    /// library `dlopen` maps is found by the periodic rescan alone (the
    /// before/after measurement of the hook).
    #[arg(long, hide = true)]
    pub no_loader_hook: bool,
    /// How often device health (clocks, clock-event reasons, utilization,
    /// memory, ECC, Xid errors) is read from NVML, and its Ascend
    /// equivalent (AI Core frequency, utilization, HBM, health, error
    /// codes) from DCMI; 0 turns both off.
    #[arg(long, default_value = "1s", value_parser = config::parse_duration)]
    pub gpu_health_interval: Duration,
    /// The NVML library to load [default: $XPUSCOPE_NVML_LIBRARY, else
    /// libnvidia-ml.so.1].
    #[arg(long)]
    pub nvml_library: Option<PathBuf>,
    /// The DCMI library (Ascend NPUs) to load [default: $XPUSCOPE_DCMI_LIBRARY,
    /// else the first of libdcmi.so, /usr/local/Ascend/driver/lib64/driver/
    /// and .../lib64/common/libdcmi.so that loads].
    #[arg(long)]
    pub dcmi_library: Option<PathBuf>,
}

/// A leak rate: a size of at least one byte.
fn parse_leak_rate(text: &str) -> Result<u64, String> {
    match config::parse_size(text)? {
        0 => Err(format!(
            "--leak-min-per-step {text}: 0 would call every allocation a leak; give at least 1 \
             (default 1M)"
        )),
        n => Ok(n),
    }
}

/// A hang timeout: a duration of at least 1 ms.
fn parse_hang_timeout(text: &str) -> Result<Duration, String> {
    let d = config::parse_duration(text)?;
    if d < Duration::from_millis(1) {
        return Err(format!(
            "--hang-timeout {text}: too short; give at least 1ms (default 300s)"
        ));
    }
    Ok(d)
}

impl AttachArgs {
    pub fn into_config(self) -> AttachConfig {
        let defaults = AttachConfig::default();
        let schedule = self.probe_level_schedule.unwrap_or_default();
        let output = self.output.unwrap_or_else(|| match self.pid {
            Some(pid) => PathBuf::from(format!("xpuscope-{pid}.pftrace")),
            None => PathBuf::from("xpuscope-system.pftrace"),
        });
        AttachConfig {
            pid: self.pid,
            system_wide: self.system,
            output,
            duration: self.duration,
            stacks: self.stacks,
            stack_rate: self.stack_rate,
            stack_burst: self.stack_burst,
            ring_bytes: self.ring_size,
            device_ring_bytes: self.device_ring_size,
            bystander_ring_bytes: self.bystander_ring_size,
            kernel_btf: self.kernel_btf,
            stats_json: self.stats_json,
            reader_delay: self.reader_delay.unwrap_or(defaults.reader_delay),
            drain_interval: defaults.drain_interval,
            probe_level: schedule
                .initial
                .map_or(self.probe_level, |level| level.get()),
            level_schedule: schedule,
            report_targets: self.report_targets,
            device_call_rate: self.device_call_rate,
            hang_timeout: self.hang_timeout,
            host_detect: host_config::HostDetectConfig {
                contention_min_share_pct: self.contention_min_share,
                stall_min: self.stall_min,
                leak_min_per_step: self.leak_min_per_step,
                ..host_config::HostDetectConfig::default()
            },
            collective: crate::sinks::detect::collective::CollectiveConfig {
                late_min: self.late_min,
                slow_rank_persist: self.slow_rank_persist,
                slow_link_ratio: self.slow_link_ratio,
                slow_compute_pct: self.slow_compute_pct,
                ..Default::default()
            },
            loader_hook: !self.no_loader_hook,
            launch_counts: !self.no_launch_counts,
            gpu_health: {
                let env = crate::health::HealthConfig::from_env();
                crate::health::HealthConfig {
                    library: self.nvml_library.unwrap_or(env.library),
                    dcmi_library: self.dcmi_library.or(env.dcmi_library),
                    interval: self.gpu_health_interval,
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn attach_defaults() {
        let cli = Cli::try_parse_from(["agent", "attach", "--pid", "42"]).unwrap();
        let Command::Attach(args) = cli.command else {
            panic!("not attach")
        };
        let cfg = args.into_config();
        assert_eq!(cfg.pid, Some(42));
        assert_eq!(cfg.output, PathBuf::from("xpuscope-42.pftrace"));
        assert_eq!(cfg.stacks, StackPolicy::Sampled);
        assert_eq!(cfg.ring_bytes, config::DEFAULT_RING_BYTES);
        assert_eq!(cfg.device_ring_bytes, config::DEFAULT_DEVICE_RING_BYTES);
        assert_eq!(
            cfg.bystander_ring_bytes,
            config::DEFAULT_BYSTANDER_RING_BYTES
        );
        assert_eq!(cfg.probe_level, 0);
    }

    #[test]
    fn probe_level_bounded() {
        assert!(Cli::try_parse_from(["agent", "attach", "-p", "1", "--probe-level", "2"]).is_ok());
        assert!(Cli::try_parse_from(["agent", "attach", "-p", "1", "--probe-level", "3"]).is_err());
        assert!(Cli::try_parse_from(["agent", "probes", "--pid", "1"]).is_ok());
        let cli = Cli::try_parse_from(["agent", "probes", "-p", "1", "--duration", "2s"]).unwrap();
        let Command::Probes(args) = cli.command else {
            panic!("not probes")
        };
        assert_eq!(args.duration, Some(std::time::Duration::from_secs(2)));
        assert!(Cli::try_parse_from(["agent", "probes", "-p", "1", "-d", "soon"]).is_err());
    }

    #[test]
    fn ring_sizes_state_their_memory_cost() {
        let help = Cli::command()
            .find_subcommand_mut("attach")
            .expect("attach")
            .render_long_help()
            .to_string();
        for needle in [
            "twice its size in resident memory",
            "1G about 2 GB",
            "Like --ring-size it costs about twice its size in memory",
        ] {
            assert!(help.contains(needle), "{needle:?} in\n{help}");
        }
    }

    #[test]
    fn service_and_ctl() {
        let cli = Cli::try_parse_from(["agent", "service", "--check-config"]).unwrap();
        let Command::Service(args) = cli.command else {
            panic!("not service")
        };
        assert!(args.check_config);
        assert_eq!(args.config, PathBuf::from("/etc/xpuscope/agent.toml"));
        let cli = Cli::try_parse_from([
            "agent",
            "ctl",
            "dump",
            "--job",
            "j",
            "--seconds",
            "30s",
            "--after",
            "5s",
        ])
        .unwrap();
        let Command::Ctl(args) = cli.command else {
            panic!("not ctl")
        };
        let (method, path, body) = crate::service::control::client::command_request(&args.command);
        assert_eq!((method, path), ("POST", "/dump"));
        assert_eq!(
            body.unwrap(),
            serde_json::json!({ "job": "j", "seconds": 30.0, "after": 5.0 })
        );
        assert!(Cli::try_parse_from(["agent", "ctl", "level", "x"]).is_err());
        assert!(
            Cli::try_parse_from([
                "agent",
                "ctl",
                "dump",
                "--after",
                "1s",
                "--at",
                "2026-01-01T00:00:00Z"
            ])
            .is_err()
        );
    }

    #[test]
    fn pid_or_system_required() {
        assert!(Cli::try_parse_from(["agent", "attach"]).is_err());
        assert!(Cli::try_parse_from(["agent", "attach", "--system", "-d", "1s"]).is_ok());
    }

    #[test]
    fn level_schedule_is_hidden_and_sets_the_start_level() {
        let help = Cli::command()
            .find_subcommand_mut("attach")
            .expect("attach")
            .render_long_help()
            .to_string();
        assert!(!help.contains("probe-level-schedule"), "{help}");
        assert!(!help.contains("report-targets"), "{help}");
        let cli = Cli::try_parse_from([
            "agent",
            "attach",
            "-p",
            "1",
            "--probe-level",
            "2",
            "--probe-level-schedule",
            "0,1@1s",
        ])
        .unwrap();
        let Command::Attach(args) = cli.command else {
            panic!("not attach")
        };
        let cfg = args.into_config();
        assert_eq!(cfg.probe_level, 0, "the schedule's first level wins");
        assert_eq!(cfg.level_schedule.initial.map(|l| l.get()), Some(0));
        assert!(
            Cli::try_parse_from([
                "agent",
                "attach",
                "-p",
                "1",
                "--probe-level-schedule",
                "0,1"
            ])
            .is_err()
        );
    }
}
