//! `agent diagnose`: the detectors over recorded traces (the offline
//! driver; `agent attach` and the service are the online one). Each
//! trace is read back into the records the detectors take
//! ([`TraceRecords`]: identities, device calls with all their arguments,
//! exits, failed allocations, step counters, the main threads' off-CPU
//! intervals, device work); calls still open at the end become in-flight
//! snapshots. They are fed, in the order the live agent gets them, into
//! the same [`Detectors`]. Several traces of one job (one per node) meet
//! on communicator hash + sequence number; process ids are kept apart per
//! trace. The clocks of different nodes are taken as they are (arrival
//! delays across nodes include their offset).

use std::path::PathBuf;

use anyhow::{Context, Result};
use xpuscope_probes::decode::DeviceCall;
use xpuscope_probes::decode::args::CallArgs;

use crate::model::finding::FindingsDoc;
use crate::model::{Finding, InFlightSnapshot, OpenCall, Record, ThreadNow};
use crate::sinks::detect::{DetectConfig, Detectors, incidents};
use crate::trace_schema::read::{OpenAtEnd, TraceRecords};

pub struct DiagnoseOptions {
    pub traces: Vec<PathBuf>,
    pub json: Option<PathBuf>,
    pub detect: DetectConfig,
}

/// How often the live pipeline snapshots the calls in flight (ns).
const OFFLINE_TICK_NS: u64 = 1_000_000_000;

/// One trace's pid as the detectors see it: unique across traces.
fn job_pid(trace: usize, pid: i32) -> u32 {
    ((trace as u32) << 22) | (pid as u32 & 0x3f_ffff)
}

fn open_call(c: DeviceCall) -> OpenCall {
    // A send or receive still open counts as entered: its peer with it.
    let peer = match &c.args {
        CallArgs::SendRecv(s) => u32::try_from(s.peer).ok(),
        _ => None,
    };
    OpenCall {
        tgid: c.tgid,
        tid: c.tid,
        library: c.library,
        function: c.function,
        kind: c.kind,
        start_ts: c.start_ts,
        comm: c.comm,
        peer,
        thread: ThreadNow::Unknown,
    }
}

/// A call that never returned: open when the trace ended, or running when
/// its thread or process died.
struct Stuck {
    call: OpenCall,
    died: bool,
}

/// Every trace through the detectors: the findings, most important first.
pub fn diagnose(traces: &[PathBuf], cfg: DetectConfig) -> Result<Vec<Finding>> {
    let mut reader = TraceRecords::default();
    let mut records = Vec::new();
    let mut read_open = Vec::new();
    let mut end = 0;
    for (i, path) in traces.iter().enumerate() {
        end = end.max(reader.read(
            path,
            move |pid| job_pid(i, pid),
            &mut records,
            &mut read_open,
        )?);
    }
    let open: Vec<Stuck> = read_open
        .into_iter()
        .map(|OpenAtEnd { call, died }| Stuck {
            call: open_call(call),
            died,
        })
        .collect();
    // The calls that never returned, as the snapshots the live agent takes
    // of what runs (once a second, from when the oldest is past the hang
    // timeout): each holds the calls begun by then and not yet ended, a
    // call ending when its process died (or with the trace). Their age
    // against the timeout decides, as it would live.
    let until = |s: &Stuck| -> u64 {
        if !s.died {
            return end;
        }
        records
            .iter()
            .filter_map(|(ts, r)| match r {
                Record::Exit { exit, .. } if exit.tgid == s.call.tgid && *ts >= s.call.start_ts => {
                    Some(*ts)
                }
                _ => None,
            })
            .min()
            .unwrap_or(end)
    };
    let stuck: Vec<(OpenCall, u64)> = open
        .into_iter()
        .map(|s| {
            let u = until(&s);
            (s.call, u)
        })
        .collect();
    let timeout = cfg.hang_timeout.as_nanos() as u64;
    if let (Some(oldest), Some(last)) = (
        stuck.iter().map(|(c, _)| c.start_ts).min(),
        stuck.iter().map(|(_, u)| *u).max(),
    ) {
        let mut at = oldest.saturating_add(timeout);
        let mut snapshots = 0u64;
        while at < last {
            let calls: Vec<OpenCall> = stuck
                .iter()
                .filter(|(c, u)| c.start_ts <= at && *u > at)
                .map(|(c, _)| c.clone())
                .collect();
            if !calls.is_empty() {
                records.push((
                    at,
                    Record::InFlight(Box::new(InFlightSnapshot {
                        ts: at,
                        calls,
                        main_threads: Vec::new(),
                    })),
                ));
            }
            // A second apart, as live; further apart past an hour of them.
            snapshots += 1;
            at += OFFLINE_TICK_NS * (1 + snapshots / 3600);
        }
    }
    // Identities first (time 0), then calls as they returned.
    records.sort_by_key(|r| r.0);
    let mut d = Detectors::new(cfg);
    let mut found = Vec::new();
    for (ts, r) in &records {
        d.record(r, &mut found);
        if matches!(r, Record::InFlight(_)) {
            d.tick(*ts, &mut found);
        }
    }
    d.finish(end, &mut found);
    d.extend_spans(&mut found);
    // Roots first (most important first), each with its consequences.
    incidents::group(&mut found);
    Ok(found)
}

/// `agent diagnose`'s exit status when it reports a root finding (a
/// fault, not only its consequences): a pipeline gates on it. 1 is an
/// error, 2 a usage error (clap's).
pub const EXIT_ROOT_FINDING: u8 = 3;

/// `--json -`: the document goes to stdout (and the text to stderr).
pub const JSON_TO_STDOUT: &str = "-";

/// What `agent diagnose` reported.
pub struct Outcome {
    /// Findings that are a fault of their own, not another's consequence.
    pub roots: usize,
}

pub fn run(opts: &DiagnoseOptions) -> Result<Outcome> {
    let found = diagnose(&opts.traces, opts.detect.clone())?;
    let json_to_stdout = opts
        .json
        .as_deref()
        .is_some_and(|p| p.as_os_str() == JSON_TO_STDOUT);
    // With the JSON on stdout, the text is for a person: stderr.
    let mut text = String::new();
    if found.is_empty() {
        text += &format!("no findings in {} trace(s)\n", opts.traces.len());
    }
    text += &incidents::text(&found);
    if json_to_stdout {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
    if let Some(path) = &opts.json {
        let json = serde_json::to_string_pretty(&FindingsDoc::new(&found))?;
        if json_to_stdout {
            println!("{json}");
        } else {
            std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(Outcome {
        roots: found.iter().filter(|f| f.link.cause.is_none()).count(),
    })
}
