//! Writing a dump: the window's records replayed through the Perfetto sink
//! into `<job>-<host>-<UTC time>-<trigger>.pftrace` in the dump directory,
//! with its summary JSON next to it. Names are built from sanitized labels
//! and checked to stay inside the directory; files are created new (never
//! through a symlink); the directory is kept under its byte bound by
//! removing the oldest dumps; a write that fails (a full disk) leaves the
//! trace cut back to its last complete packet.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use xpuscope_perfetto::TraceWriter;

use super::state::{ProcessTable, owner, span};
use super::{Batch, Retention, Trigger};
use crate::model::Record;
use crate::model::finding::{Finding, FindingsDoc};
use crate::sinks::perfetto::PerfettoSink;
use crate::sinks::summary::{DeviceRecordCounts, FunctionCalls, SummarySink};
use crate::sinks::{Sink, SinkCounters};
use crate::trace_schema::names as n;

pub const TRACE_SUFFIX: &str = ".pftrace";
pub const SUMMARY_SUFFIX: &str = ".summary.json";
/// Longest label (job, host) in a dump name.
const MAX_LABEL: usize = 64;

/// A label made safe for a file name: ASCII letters, digits, `.`, `_` and
/// `-` kept, anything else `_`, no leading dot, at most 64 characters.
pub fn file_label(s: &str) -> String {
    let mut out: String = s
        .chars()
        .take(MAX_LABEL)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    while out.starts_with('.') {
        out.replace_range(..1, "_");
    }
    if out.is_empty() {
        "unknown".into()
    } else {
        out
    }
}

/// Whether a job label given over the API may name a dump (it is also a
/// filter: it must be a label a process could carry, not a path).
pub fn check_job_label(job: &str) -> Result<(), String> {
    if job.is_empty() || job.len() > MAX_LABEL {
        return Err(format!("job label must be 1 to {MAX_LABEL} characters"));
    }
    if job.contains('/') || job.contains('\0') || job.starts_with('.') {
        return Err(format!(
            "job label `{job}` may not contain `/` or start with `.`: it names a file in the dump \
             directory, never a path"
        ));
    }
    Ok(())
}

/// `dir/name`, refused unless `name` is one plain file name.
pub fn path_in(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0');
    let path = dir.join(name);
    if !plain || path.parent() != Some(dir) {
        return Err(format!("`{name}` would leave the dump directory"));
    }
    Ok(path)
}

const HOUR: Duration = Duration::from_secs(3600);

/// At most `per_hour` dumps in any hour.
#[derive(Debug)]
pub struct RateLimiter {
    per_hour: u32,
    starts: VecDeque<Instant>,
}

impl RateLimiter {
    pub fn new(per_hour: u32) -> Self {
        Self {
            per_hour,
            starts: VecDeque::new(),
        }
    }

    /// Takes a slot at `now`, or says how long until one frees.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        self.check(now)?;
        self.starts.push_back(now);
        Ok(())
    }

    /// Whether a slot is free at `now` (none taken), or how long until one
    /// frees.
    pub fn check(&mut self, now: Instant) -> Result<(), Duration> {
        while self
            .starts
            .front()
            .is_some_and(|t| now.duration_since(*t) >= HOUR)
        {
            self.starts.pop_front();
        }
        if self.starts.len() >= self.per_hour as usize {
            let oldest = self.starts.front().copied().unwrap_or(now);
            return Err(HOUR.saturating_sub(now.duration_since(oldest)));
        }
        Ok(())
    }

    /// No slot taken in the hour before `now`.
    pub fn idle(&self, now: Instant) -> bool {
        self.starts
            .back()
            .is_none_or(|t| now.duration_since(*t) >= HOUR)
    }
}

/// Removes whole dumps (a trace and its summary) until the directory's
/// dumps take at most `max_bytes`: routine dumps first, oldest first, then
/// incidents, oldest first. `keep` is never removed; other files are never
/// touched. Returns the files removed.
pub fn enforce_dir_bound(dir: &Path, max_bytes: u64, keep: &[&Path]) -> io::Result<u64> {
    struct OnDisk {
        oldest: std::time::SystemTime,
        files: Vec<(PathBuf, u64)>,
    }
    let mut dumps: BTreeMap<String, OnDisk> = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let Some(base) = name
            .strip_suffix(TRACE_SUFFIX)
            .or_else(|| name.strip_suffix(SUMMARY_SUFFIX))
        else {
            continue;
        };
        let meta = entry.path().symlink_metadata()?;
        if !meta.is_file() {
            continue;
        }
        let modified = meta.modified()?;
        let d = dumps.entry(base.to_string()).or_insert(OnDisk {
            oldest: modified,
            files: Vec::new(),
        });
        d.oldest = d.oldest.min(modified);
        d.files.push((entry.path(), meta.len()));
    }
    let mut total: u64 = dumps.values().flat_map(|d| &d.files).map(|f| f.1).sum();
    if total <= max_bytes {
        return Ok(0);
    }
    let mut order: Vec<(Retention, std::time::SystemTime, OnDisk)> = dumps
        .into_iter()
        .map(|(base, d)| {
            let class = class_on_disk(dir, &base);
            (class, d.oldest, d)
        })
        .collect();
    // Routine before incident, then oldest first.
    order.sort_by_key(|(class, oldest, _)| (*class == Retention::Incident, *oldest));
    let mut removed = 0;
    for (_, _, dump) in order {
        if total <= max_bytes {
            break;
        }
        if dump.files.iter().any(|(p, _)| keep.contains(&p.as_path())) {
            continue;
        }
        for (path, len) in dump.files {
            std::fs::remove_file(&path)?;
            total -= len;
            removed += 1;
        }
    }
    Ok(removed)
}

/// A dump's class, from the start of its summary (`retention` is its first
/// field); a dump without one (written before classes, or its summary
/// lost) by the trigger its name ends with.
fn class_on_disk(dir: &Path, base: &str) -> Retention {
    use std::io::Read;
    let mut head = [0u8; 256];
    let read = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(dir.join(format!("{base}{SUMMARY_SUFFIX}")))
        .and_then(|mut f| f.read(&mut head));
    if let Ok(len) = read {
        let head = String::from_utf8_lossy(&head[..len]);
        if head.contains("\"retention\": \"routine\"") {
            return Retention::Routine;
        }
        if head.contains("\"retention\": \"incident\"") {
            return Retention::Incident;
        }
    }
    // `<job>-<host>-<time>-<trigger>[-N]`.
    let trigger = base
        .trim_end_matches(|c: char| c.is_ascii_digit())
        .trim_end_matches('-')
        .rsplit('-')
        .next()
        .unwrap_or_default();
    match trigger {
        "hang" | "oom" | "manual" => Retention::Incident,
        _ => Retention::Routine,
    }
}

/// A file that refuses writes past a quota with ENOSPC: a full disk, for
/// tests (`None` in the agent).
pub struct QuotaFile {
    file: File,
    left: Option<u64>,
}

impl Write for QuotaFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = match self.left {
            Some(0) => return Err(io::Error::from_raw_os_error(libc::ENOSPC)),
            Some(left) => buf.len().min(left as usize),
            None => buf.len(),
        };
        let n = self.file.write(&buf[..n])?;
        if let Some(left) = &mut self.left {
            *left -= n as u64;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

/// Everything a dump needs, taken from the recorder without copying
/// records (the batches are shared).
pub struct DumpJob {
    pub trigger: Trigger,
    pub retention: Retention,
    /// Records the recorder itself lost in the window: (time, count).
    pub recorder_losses: Vec<(u64, u64)>,
    /// The finding that triggered it.
    pub finding: Option<Box<Finding>>,
    pub job: Option<String>,
    /// The window, CLOCK_BOOTTIME ns, inclusive.
    pub start: u64,
    pub end: u64,
    /// The state before the oldest kept record.
    pub table: ProcessTable,
    /// Kept batches and the index of the first kept record in each.
    pub batches: Vec<(Batch, usize)>,
    /// Records were evicted by the memory bound after this time: a window
    /// starting earlier misses them.
    pub evicted_until: Option<u64>,
    pub dir: PathBuf,
    pub dir_max_bytes: u64,
    pub host: String,
    /// Testing aid: the disk is full after this many bytes.
    pub write_limit: Option<u64>,
}

/// What a dump wrote.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct DumpOutcome {
    pub trace: PathBuf,
    pub summary: PathBuf,
    pub trigger: &'static str,
    /// `incident` or `routine`: routine dumps are removed first when the
    /// directory is over its bound.
    pub retention: &'static str,
    pub window_start_ns: u64,
    pub window_end_ns: u64,
    pub records: u64,
    pub trace_bytes: u64,
    /// Writing failed part-way (a full disk): the trace was cut back to its
    /// last complete packet and is still valid.
    pub truncated: Option<String>,
    /// Records of the window were evicted by the memory bound before the
    /// dump: the trace is complete only from this time.
    pub complete_from_ns: Option<u64>,
    /// Old dumps removed to keep the directory under its bound.
    pub removed_old_dumps: u64,
    /// Records of the window the recorder never got (it lagged behind
    /// the pipeline and the fan-out dropped them): the trace is missing
    /// them, and shows the count on a counter track.
    pub lost_records: u64,
}

/// Why a dump was not written.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("{0}")]
    BadRequest(String),
    #[error(
        "rate limit: at most {per_hour} {scope} per hour; the next is possible in {retry_after:?}"
    )]
    RateLimited {
        per_hour: u32,
        /// What the limit applies to ("hang dumps of job x").
        scope: String,
        retry_after: Duration,
    },
    #[error("writing the dump in {dir}: {source}")]
    Io {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the flight recorder stopped")]
    Stopped,
}

#[derive(Debug, Default, Serialize)]
struct ProcessRow {
    pid: u32,
    name: String,
    job: Option<String>,
    rank: Option<String>,
    local_rank: Option<String>,
    /// The process ended within the window.
    exited: bool,
}

/// The window's processes: those present at its start, and those that
/// appear in it: forked or exec'd, or known only by their identity and
/// scheduling, as a process the service discovered after it started is
/// (its start came before the service looked). Exited ones stay, marked.
fn window_processes(table: &ProcessTable, window: &[&Record]) -> Vec<ProcessRow> {
    let mut rows: BTreeMap<u32, ProcessRow> = BTreeMap::new();
    fn entry(rows: &mut BTreeMap<u32, ProcessRow>, pid: u32) -> &mut ProcessRow {
        rows.entry(pid).or_insert_with(|| ProcessRow {
            pid,
            ..ProcessRow::default()
        })
    }
    fn identify(row: &mut ProcessRow, id: &crate::model::RankIdentity) {
        row.job = id.job.clone();
        row.rank = id.rank.clone();
        row.local_rank = id.local_rank.clone();
    }
    for p in table.processes.values() {
        entry(&mut rows, p.pid).name = p.comm.clone();
    }
    for (tgid, id) in &table.identities {
        identify(entry(&mut rows, *tgid), id);
    }
    for r in window {
        match r {
            Record::InitialProcesses { processes, .. } => {
                for p in processes {
                    entry(&mut rows, p.pid).name = p.comm.clone();
                }
            }
            Record::NewTask {
                process: Some(p), ..
            } => entry(&mut rows, p.pid).name = p.name.clone(),
            Record::Exec { process, .. } => {
                entry(&mut rows, process.pid).name = process.name.clone()
            }
            Record::Identity { tgid, identity } => identify(entry(&mut rows, *tgid), identity),
            Record::Exit {
                exit,
                process_ended: true,
            } => entry(&mut rows, exit.tgid).exited = true,
            _ => {}
        }
    }
    // A process known by identity alone is named by its main thread as
    // the scheduler last saw it (a job's launcher forks, then the child
    // execs python3: the first switches still show the launcher's name).
    let unnamed: BTreeSet<u32> = rows
        .values()
        .filter(|r| r.name.is_empty())
        .map(|r| r.pid)
        .collect();
    let mut last: BTreeMap<u32, &crate::events::Comm> = BTreeMap::new();
    if !unnamed.is_empty() {
        for r in window {
            let Record::Switch { switch: s, .. } = r else {
                continue;
            };
            for (tid, tgid, comm) in [
                (s.prev_tid, s.prev_tgid, &s.prev_comm),
                (s.next_tid, s.next_tgid, &s.next_comm),
            ] {
                if tid == tgid && unnamed.contains(&tgid) {
                    last.insert(tgid, comm);
                }
            }
        }
    }
    for (tgid, comm) in last {
        entry(&mut rows, tgid).name = comm.as_str().into_owned();
    }
    rows.into_values().collect()
}

#[derive(Serialize)]
struct DumpSummary<'a> {
    /// First, so the directory's bound reads it from the file's start.
    retention: &'static str,
    outcome: &'a DumpOutcome,
    job: Option<&'a str>,
    host: &'a str,
    window_end_utc: String,
    records_per_kind: BTreeMap<&'static str, u64>,
    processes: Vec<ProcessRow>,
    device: DeviceRecordCounts,
    functions: Vec<FunctionCalls>,
    /// The finding that triggered the dump (null for a manual one).
    finding: Option<&'a Finding>,
    /// Every finding in the window, as the `xpuscope-findings/1` document.
    findings: FindingsDoc<'a>,
}

impl DumpJob {
    /// The window's records in stream order, with the process table as of
    /// the window's start (records before it applied).
    fn select(&self) -> (ProcessTable, Vec<&Record>) {
        let mut table = self.table.clone();
        let mut window = Vec::new();
        for (batch, first) in &self.batches {
            for r in &batch[*first..] {
                match span(r) {
                    // The processes present at the start are the prelude's.
                    _ if matches!(r, Record::InitialProcesses { .. }) => table.apply(r),
                    Some((_, end)) if end < self.start => table.apply(r),
                    None if window.is_empty() => table.apply(r),
                    Some((start, _)) if start > self.end => {}
                    _ => window.push(r),
                }
            }
        }
        if let Some(job) = &self.job {
            // The job's processes: by identity as of the start or in the window.
            let mut members: BTreeSet<u32> = table
                .identities
                .iter()
                .filter(|(_, id)| id.job.as_deref() == Some(job))
                .map(|(tgid, _)| *tgid)
                .collect();
            for r in &window {
                if let Record::Identity { tgid, identity } = r
                    && identity.job.as_deref() == Some(job)
                {
                    members.insert(*tgid);
                }
            }
            window.retain(|r| owner(r).is_none_or(|o| members.contains(&o)));
            table.processes.retain(|pid, _| members.contains(pid));
            table.identities.retain(|pid, _| members.contains(pid));
        }
        (table, window)
    }

    /// The dump's base name and the UTC stamp of its window's end. Its
    /// job: the one asked for; else the job of the process the finding
    /// that triggered it names; else the window's one job (`alljobs` for
    /// several, `nojob` for none).
    fn name(&self, rows: &[ProcessRow]) -> (String, String) {
        let finding_job = self
            .finding
            .as_ref()
            .and_then(|f| f.evidence.get("pid")?.as_u64())
            .and_then(|pid| rows.iter().find(|r| u64::from(r.pid) == pid))
            .and_then(|r| r.job.clone());
        let job = self.job.clone().or(finding_job).unwrap_or_else(|| {
            let jobs: BTreeSet<&str> = rows.iter().filter_map(|r| r.job.as_deref()).collect();
            match jobs.len() {
                1 => jobs.into_iter().next().unwrap_or_default().to_string(),
                0 => "nojob".into(),
                _ => "alljobs".into(),
            }
        });
        let realtime = crate::wallclock::realtime_ns();
        let now_boot = crate::host::boottime_ns();
        let end_real = realtime.saturating_sub(now_boot.saturating_sub(self.end));
        let utc = crate::wallclock::compact_utc(end_real);
        let name = format!(
            "{}-{}-{utc}-{}",
            file_label(&job),
            file_label(&self.host),
            self.trigger.as_str()
        );
        (name, utc)
    }

    /// Creates `base{suffix}` (or `base-N{suffix}` if taken) new, never
    /// through a symlink.
    fn create(&self, base: &str, suffix: &str) -> Result<(PathBuf, File), DumpError> {
        let io_err = |source| DumpError::Io {
            dir: self.dir.clone(),
            source,
        };
        for n in 0..100 {
            let name = if n == 0 {
                format!("{base}{suffix}")
            } else {
                format!("{base}-{n}{suffix}")
            };
            let path = path_in(&self.dir, &name).map_err(DumpError::BadRequest)?;
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o640)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
            {
                Ok(f) => return Ok((path, f)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(e)),
            }
        }
        Err(io_err(io::Error::other("100 dumps with the same name")))
    }

    /// Renders the window; the trace is always left a valid file.
    pub fn write(self) -> Result<DumpOutcome, DumpError> {
        let io_err = |dir: &Path| {
            let dir = dir.to_path_buf();
            move |source| DumpError::Io { dir, source }
        };
        std::fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        let (table, window) = self.select();
        let processes = window_processes(&table, &window);
        let (base, utc) = self.name(&processes);
        let (trace_path, file) = self.create(&base, TRACE_SUFFIX)?;
        let out = BufWriter::with_capacity(
            1 << 20,
            QuotaFile {
                file,
                left: self.write_limit,
            },
        );
        let mut summary = SummarySink::default();
        let lost = SinkCounters::default();
        let prelude = table.as_records(self.start);
        let records = (prelude.len() + window.len()) as u64;
        let rendered = (|| -> anyhow::Result<u64> {
            let mut sink = PerfettoSink::with_host_header(TraceWriter::new(out))?;
            for r in prelude.iter().chain(window.iter().copied()) {
                sink.record(r)?;
            }
            sink.loss_counter(n::RECORDER_LOSSES_TRACK, &self.recorder_losses)?;
            let written = sink.finish_trace(self.end, &lost)?;
            let file = written.out.into_inner().map_err(|e| e.into_error())?;
            file.file.sync_all()?;
            Ok(written.bytes)
        })();
        let (trace_bytes, truncated) = match rendered {
            Ok(bytes) => (bytes, None),
            Err(e) => {
                let kept = crate::trace_file::cut_to_complete_packets(&trace_path)
                    .map_err(io_err(&self.dir))?;
                (kept, Some(format!("{e:#}")))
            }
        };
        // The summary sink counts what was rendered (the whole window).
        for r in &window {
            let _ = summary.on_batch(std::slice::from_ref(*r), &lost);
        }
        let totals = summary.finish(self.end, &lost).unwrap_or_default();
        let mut outcome = DumpOutcome {
            summary: trace_path.with_file_name(format!(
                "{}{SUMMARY_SUFFIX}",
                trace_path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(TRACE_SUFFIX))
                    .unwrap_or(&base)
            )),
            trace: trace_path.clone(),
            trigger: self.trigger.as_str(),
            retention: self.retention.as_str(),
            window_start_ns: self.start,
            window_end_ns: self.end,
            records,
            trace_bytes,
            truncated,
            complete_from_ns: self.evicted_until.filter(|t| *t >= self.start),
            removed_old_dumps: 0,
            lost_records: self.recorder_losses.iter().map(|(_, n)| n).sum(),
        };
        let summary_name = outcome
            .summary
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let summary_path = path_in(&self.dir, &summary_name).map_err(DumpError::BadRequest)?;
        let in_window: Vec<Finding> = window
            .iter()
            .filter_map(|r| match r {
                Record::Finding(f) => Some((**f).clone()),
                _ => None,
            })
            .collect();
        let json = DumpSummary {
            retention: self.retention.as_str(),
            finding: self.finding.as_deref(),
            findings: FindingsDoc::new(&in_window),
            outcome: &outcome,
            job: self.job.as_deref(),
            host: &self.host,
            window_end_utc: utc,
            records_per_kind: totals.records.clone(),
            processes,
            device: totals.device,
            functions: totals.functions.clone(),
        };
        let text = serde_json::to_vec_pretty(&json).unwrap_or_default();
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o640)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&summary_path)
            .and_then(|mut f| f.write_all(&text));
        if let Err(e) = written {
            // The trace stands on its own; a missing summary is reported.
            let _ = std::fs::remove_file(&summary_path);
            outcome
                .truncated
                .get_or_insert(format!("writing the summary: {e}"));
        }
        outcome.removed_old_dumps = enforce_dir_bound(
            &self.dir,
            self.dir_max_bytes,
            &[&outcome.trace, &outcome.summary],
        )
        .map_err(io_err(&self.dir))?;
        Ok(outcome)
    }
}
