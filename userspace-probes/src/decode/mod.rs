//! Raw uprobe records -> typed device-library calls.
//!
//! The kernel pushes a [`UprobeEntry`] when a probed function is entered and
//! a [`UprobeReturn`] when it returns, both keyed by the absolute probe
//! address. The [`Decoder`] looks the address up in its [`ProbeTable`],
//! pairs entries and returns per thread (a stack: the innermost open call
//! with the same probe address matches), and turns each pair into a
//! [`DeviceCall`] with typed arguments, its communicator (identity, rank,
//! size, collective sequence number) and its effect on device memory.
//! Activity iterators (`cuptiActivityGetNextRecord`, ...) yield
//! [`ActivityEvent`]s instead of calls. Nothing is dropped silently:
//! returns without an entry, entries whose return never came, and unknown
//! probe addresses come out as [`Unmatched`], and [`DecoderStats`] counts
//! them.
//!
//! Records carry the traced process's memory: every length is bounded,
//! every read checked, and state per process, thread and call is capped.
//!
//! ```
//! use xpuscope_common::{EventHeader, uprobe::{UprobeEntry, UprobeReturn}};
//! use xpuscope_probes::catalog::Library;
//! use xpuscope_probes::decode::{Decoded, Decoder, table::{ProbeTable, ProbeTarget}};
//!
//! let function = Library::Nccl.function("ncclAllReduce").unwrap();
//! let mut table = ProbeTable::new();
//! table.insert(42, 0x7f00_1000, ProbeTarget { library: Library::Nccl, function, sp_delta: 0 });
//! let mut decoder = Decoder::new(table);
//!
//! let header = |ts| EventHeader { kind: 0, cpu: 0, ts };
//! let entry = UprobeEntry {
//!     header: header(1_000), tid: 43, tgid: 42, probe_ip: 0x7f00_1000,
//!     // send, recv, count, ncclBfloat16, ncclSum, comm; the stream is on the stack.
//!     args: [0xa000, 0xb000, 32 << 20, 9, 0, 0xc0c0], sp: 0, stack: [0; 8],
//!     deref_len: 0, slot: 0, deref: [0; 128],
//! };
//! let ret = UprobeReturn {
//!     header: header(9_000), tid: 43, tgid: 42, probe_ip: 0x7f00_1000, ret: 0,
//!     deref_len: 0, slot: 0, launches: Default::default(), deref: [0; 128],
//! };
//! let mut out = Vec::new();
//! decoder.on_entry(&entry, &mut out);
//! assert_eq!(decoder.in_flight().count(), 1);
//! decoder.on_return(&ret, &mut out);
//! let Decoded::Call(call) = &out[0] else { panic!() };
//! assert_eq!(call.name, "ncclAllReduce 64 MiB bf16 sum");
//! assert_eq!(call.comm.unwrap().seq, Some(0));
//! ```

pub mod args;
pub mod comm;
// The data types, reduction ops and copy kinds are shared with the activity
// records (a crate-level module both read); kept here under their old path.
pub use crate::enums;
pub mod kernels;
pub mod memory;
pub mod nesting;
pub mod table;

use foldhash::{HashMap, HashMapExt};

use xpuscope_common::uprobe::{LaunchCounts, UprobeEntry, UprobeReturn};

use crate::activity::{self, ActivityApi, DeviceActivity};
use crate::catalog::{CallKind, CommInit, HandleKind, Library, RetKind, Role, VmmOp};
use args::{CallArgs, Raw};
use comm::{CommContext, CommRegistry, Communicator, comm_id_hash, split_hash};
use kernels::KernelNames;
use memory::{MemoryEffect, MemoryLedger};
use table::{ProbeTable, ProbeTarget};

/// Most open (entered, not returned) calls kept per thread.
pub const MAX_DEPTH: usize = 32;
/// Most threads with open calls.
pub const MAX_THREADS: usize = 1 << 16;
/// Most processes with state (communicators, memory).
pub const MAX_PROCESSES: usize = xpuscope_common::MAX_TARGETS as usize;

/// One device-library call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCall {
    pub library: Library,
    /// The public name (`ncclAllReduce`, `cudaLaunchKernel_ptsz`).
    pub function: &'static str,
    pub kind: CallKind,
    pub tgid: u32,
    pub tid: u32,
    /// CLOCK_BOOTTIME ns at entry.
    pub start_ts: u64,
    /// CLOCK_BOOTTIME ns at return; None when no return was seen.
    pub end_ts: Option<u64>,
    pub args: CallArgs,
    /// The return value: a status (sign-extended from 32 bits) or a value;
    /// None for `void` or when no return was seen.
    pub ret: Option<i64>,
    /// A nonzero status (cudaSuccess, ncclSuccess, HCCL_SUCCESS,
    /// ACL_SUCCESS are 0).
    pub error: bool,
    /// The slice name ("ncclAllReduce 64 MiB bf16 sum").
    pub name: String,
    pub comm: Option<CommContext>,
    pub memory: Option<MemoryEffect>,
    /// The caller's stack (an id from [`Decoder::on_call_site`]), when the
    /// kernel took one for this call.
    pub site: Option<u64>,
    /// The process's launches so far, as the kernel counted them when the
    /// call returned (None: no launch counted yet, or no return).
    pub launches: Option<LaunchCounts>,
}

/// An activity record the application read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActivityEvent {
    pub tgid: u32,
    pub tid: u32,
    /// When the application read it (CLOCK_BOOTTIME ns).
    pub ts: u64,
    pub library: Library,
    pub activity: DeviceActivity,
}

/// Why an entry is reported without its return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenReason {
    /// An outer call of the thread returned first (this return was lost:
    /// ring-buffer drop, longjmp, exception).
    OuterReturned,
    /// The thread had [`MAX_DEPTH`] open calls.
    DepthLimit,
    ThreadExited,
    ProcessExited,
    /// [`MAX_THREADS`] threads already had open calls.
    ThreadLimit,
}

/// Records that did not pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unmatched {
    /// No probe is known at this address in this process.
    UnknownProbe {
        tgid: u32,
        tid: u32,
        probe_ip: u64,
        ts: u64,
        at_return: bool,
    },
    /// A return whose entry was not seen (attached mid-call, or dropped).
    ReturnWithoutEntry {
        tgid: u32,
        tid: u32,
        ts: u64,
        probe_ip: u64,
        library: Option<Library>,
        function: Option<&'static str>,
        ret: u64,
    },
    /// An entry whose return will not come (`call.end_ts` is None).
    EntryWithoutReturn {
        call: Box<DeviceCall>,
        reason: OpenReason,
    },
}

/// Decoder output.
// Calls are nearly every value: boxing them would add an allocation per
// call to save space only on the rarer activity records.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Decoded {
    Call(DeviceCall),
    Activity(ActivityEvent),
    Unmatched(Unmatched),
}

/// A call that has entered and not returned (for hang detection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlight {
    pub tgid: u32,
    pub tid: u32,
    pub library: Library,
    pub function: &'static str,
    pub kind: CallKind,
    pub start_ts: u64,
    /// The communicator and collective number, for collectives.
    pub comm: Option<u64>,
    pub seq: Option<u64>,
    /// The communicator as the call's record will carry it (identity,
    /// rank, size, sequence number), for collectives and send/recv.
    pub context: Option<CommContext>,
    /// The peer's rank on the communicator, for send/recv (None when the
    /// argument is unread or negative).
    pub peer: Option<u32>,
}

/// Counters: nothing is dropped without being counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecoderStats {
    pub calls: u64,
    pub activities: u64,
    pub unknown_probes: u64,
    pub returns_without_entry: u64,
    pub entries_without_return: u64,
    /// Activity iterations whose record could not be read (the copy failed,
    /// or only the 8-byte pointer came) or was empty.
    pub activity_unread: u64,
    /// Activity records that did not decode (short, empty).
    pub activity_errors: u64,
    /// Activity records of kinds the agent does not draw (an application's
    /// profiler enables many: PyTorch's asks CUPTI for driver calls,
    /// synchronizations, overheads, external correlations, ...): read
    /// and left, not lost.
    pub activity_other_kinds: u64,
    /// Process state not kept because of [`MAX_PROCESSES`].
    pub process_limit: u64,
    /// Calls of `cuptiActivityGetNextRecord` / `msptiActivityGetNextRecord`
    /// (each a call whatever it returned; a record read is in `activities`).
    pub cupti_reads: u64,
    pub mspti_reads: u64,
    /// Calls of the library below (CUDA driver, CANN runtime) folded into
    /// the call of the library above they were made in (see [`nesting`]):
    /// counted here, not as calls.
    pub folded: u64,
}

struct Pending {
    target: ProbeTarget,
    entry: UprobeEntry,
    seq: (Option<u64>, bool),
    /// The caller's stack, as the site id given to [`Decoder::on_call_site`].
    site: Option<u64>,
    /// An upper launch's kernel name, from the launch folded into it.
    kernel: Option<String>,
}

#[derive(Default)]
struct Process {
    comms: CommRegistry,
    memory: MemoryLedger,
    kernels: KernelNames,
}

/// Pairs and decodes the uprobe records of all traced processes.
pub struct Decoder {
    probes: ProbeTable,
    threads: HashMap<(u32, u32), Vec<Pending>>,
    processes: HashMap<u32, Process>,
    /// Used when a process is over [`MAX_PROCESSES`]: decoded, not remembered.
    scratch: Process,
    stats: DecoderStats,
}

impl Decoder {
    pub fn new(probes: ProbeTable) -> Self {
        Self {
            probes,
            threads: HashMap::new(),
            processes: HashMap::new(),
            scratch: Process::default(),
            stats: DecoderStats::default(),
        }
    }

    pub fn probes(&self) -> &ProbeTable {
        &self.probes
    }

    /// The probe table, to add or remove libraries as they are attached.
    pub fn probes_mut(&mut self) -> &mut ProbeTable {
        &mut self.probes
    }

    pub fn stats(&self) -> DecoderStats {
        self.stats
    }

    /// A communicator of process `tgid`.
    pub fn communicator(&self, tgid: u32, handle: u64) -> Option<&Communicator> {
        self.processes.get(&tgid)?.comms.get(handle)
    }

    /// The communicators of process `tgid`.
    pub fn communicators(&self, tgid: u32) -> Option<&CommRegistry> {
        self.processes.get(&tgid).map(|p| &p.comms)
    }

    /// Device memory of process `tgid`.
    pub fn memory(&self, tgid: u32) -> Option<&MemoryLedger> {
        self.processes.get(&tgid).map(|p| &p.memory)
    }

    /// Kernel names by driver handle of process `tgid`.
    pub fn kernels(&self, tgid: u32) -> Option<&KernelNames> {
        self.processes.get(&tgid).map(|p| &p.kernels)
    }

    /// Calls entered and not yet returned, innermost last per thread.
    pub fn in_flight(&self) -> impl Iterator<Item = InFlight> + '_ {
        self.threads.iter().flat_map(|(&(tgid, tid), stack)| {
            let comms = self.processes.get(&tgid).map(|p| &p.comms);
            stack.iter().map(move |p| {
                let raw = p.raw(None);
                let comm = raw.u64(Role::Comm);
                let kind = p.target.function.kind;
                let context = match (kind, comm, comms) {
                    (CallKind::Collective(_) | CallKind::SendRecv(_), Some(h), Some(c)) => {
                        Some(c.context(h, p.seq.0, p.seq.1))
                    }
                    _ => None,
                };
                let peer = match kind {
                    CallKind::SendRecv(_) => {
                        raw.u32(Role::Peer).filter(|&p| i32::try_from(p).is_ok())
                    }
                    _ => None,
                };
                InFlight {
                    tgid,
                    tid,
                    library: p.target.library,
                    function: p.target.function.name,
                    kind,
                    start_ts: p.entry.header.ts,
                    comm,
                    seq: p.seq.0,
                    context,
                    peer,
                }
            })
        })
    }

    fn process(&mut self, tgid: u32) -> &mut Process {
        if !self.processes.contains_key(&tgid) && self.processes.len() >= MAX_PROCESSES {
            self.stats.process_limit += 1;
            return &mut self.scratch;
        }
        self.processes.entry(tgid).or_default()
    }

    /// A probed function was entered.
    pub fn on_entry(&mut self, e: &UprobeEntry, out: &mut Vec<Decoded>) {
        let Some(&target) = self.probes.lookup(e.tgid, e.probe_ip, e.slot) else {
            self.stats.unknown_probes += 1;
            out.push(Decoded::Unmatched(Unmatched::UnknownProbe {
                tgid: e.tgid,
                tid: e.tid,
                probe_ip: e.probe_ip,
                ts: e.header.ts,
                at_return: false,
            }));
            return;
        };
        let mut pending = Pending {
            target,
            entry: *e,
            seq: (None, false),
            site: None,
            kernel: None,
        };
        if let CallKind::Collective(_) = target.function.kind
            && let Some(comm) = pending.raw(None).u64(Role::Comm)
        {
            pending.seq = self.process(e.tgid).comms.next_seq(target.library, comm);
        }
        let key = (e.tgid, e.tid);
        if !self.threads.contains_key(&key) && self.threads.len() >= MAX_THREADS {
            self.report_open(pending, OpenReason::ThreadLimit, out);
            return;
        }
        let stack = self.threads.entry(key).or_default();
        stack.push(pending);
        if stack.len() > MAX_DEPTH {
            let oldest = stack.remove(0);
            self.report_open(oldest, OpenReason::DepthLimit, out);
        }
    }

    /// A probed function returned.
    pub fn on_return(&mut self, r: &UprobeReturn, out: &mut Vec<Decoded>) {
        let key = (r.tgid, r.tid);
        let found = self
            .threads
            .get(&key)
            .and_then(|s| s.iter().rposition(|p| p.entry.probe_ip == r.probe_ip));
        let (Some(i), Some(stack)) = (found, self.threads.get_mut(&key)) else {
            self.stats.returns_without_entry += 1;
            let target = self.probes.lookup(r.tgid, r.probe_ip, r.slot);
            if target.is_none() {
                self.stats.unknown_probes += 1;
            }
            out.push(Decoded::Unmatched(Unmatched::ReturnWithoutEntry {
                tgid: r.tgid,
                tid: r.tid,
                ts: r.header.ts,
                probe_ip: r.probe_ip,
                library: target.map(|t| t.library),
                function: target.map(|t| t.function.name),
                ret: r.ret,
            }));
            return;
        };
        let lost: Vec<Pending> = stack.drain(i + 1..).collect();
        let matched = stack.pop();
        // A call of the library below (CUDA driver, CANN runtime) inside a
        // call of its sort of the library above is that call's own work:
        // folded into it.
        let outer = matched.as_ref().and_then(|m| {
            let inner = (m.target.library, m.target.function.kind);
            stack.iter().rposition(|o| {
                nesting::folds_into(inner, (o.target.library, o.target.function.kind))
            })
        });
        // The upper launch takes the kernel's name from the launch below.
        if let (Some(j), Some(m)) = (outer, matched.as_ref()) {
            let kernels = self.processes.get(&r.tgid).map(|p| &p.kernels);
            let name = Self::launched_kernel(m, kernels);
            if let Some(o) = stack.get_mut(j)
                && o.kernel.is_none()
            {
                o.kernel = name;
            }
        }
        if stack.is_empty() {
            self.threads.remove(&key);
        }
        for p in lost.into_iter().rev() {
            self.report_open(p, OpenReason::OuterReturned, out);
        }
        match matched {
            Some(_) if outer.is_some() => self.stats.folded += 1,
            Some(p) => self.complete(&p, Some(r), out),
            None => {}
        }
    }

    /// The kernel a launch of a library that names kernels by handle (the
    /// CUDA driver, the CANN runtime) runs, by its handle.
    fn launched_kernel(p: &Pending, kernels: Option<&KernelNames>) -> Option<String> {
        if !matches!(p.target.library, Library::Cuda | Library::AscendRuntime)
            || !matches!(p.target.function.kind, CallKind::Launch(_))
        {
            return None;
        }
        let func = p.raw(None).u64(Role::Func)?;
        kernels?.name(func).map(str::to_owned)
    }

    /// The kernel took the user stack of thread `tid` returning from the
    /// probe at `probe_ip` (it comes just before that return record): the
    /// caller interned it as `site`. The call then carries it, and an
    /// allocation is charged to it.
    pub fn on_call_site(&mut self, tgid: u32, tid: u32, probe_ip: u64, site: u64) {
        if let Some(p) = self
            .threads
            .get_mut(&(tgid, tid))
            .and_then(|s| s.iter_mut().rev().find(|p| p.entry.probe_ip == probe_ip))
        {
            p.site = Some(site);
        }
    }

    /// Thread `tid` exited: its open calls will not return.
    pub fn thread_exited(&mut self, tgid: u32, tid: u32, out: &mut Vec<Decoded>) {
        if let Some(stack) = self.threads.remove(&(tgid, tid)) {
            for p in stack.into_iter().rev() {
                self.report_open(p, OpenReason::ThreadExited, out);
            }
        }
        if let Some(p) = self.processes.get_mut(&tgid) {
            p.memory.thread_exited(tid);
        }
    }

    /// Process `tgid` exited: open calls are reported, its state and probes
    /// forgotten.
    pub fn process_exited(&mut self, tgid: u32, out: &mut Vec<Decoded>) {
        let mut keys: Vec<(u32, u32)> = self
            .threads
            .keys()
            .filter(|k| k.0 == tgid)
            .copied()
            .collect();
        keys.sort_unstable();
        for key in keys {
            if let Some(stack) = self.threads.remove(&key) {
                for p in stack.into_iter().rev() {
                    self.report_open(p, OpenReason::ProcessExited, out);
                }
            }
        }
        self.processes.remove(&tgid);
        self.probes.remove_process(tgid);
    }

    fn report_open(&mut self, p: Pending, reason: OpenReason, out: &mut Vec<Decoded>) {
        self.stats.entries_without_return += 1;
        let call = Box::new(self.call(&p, None));
        out.push(Decoded::Unmatched(Unmatched::EntryWithoutReturn {
            call,
            reason,
        }));
    }

    /// A matched pair: a call, or an activity record.
    fn complete(&mut self, p: &Pending, r: Option<&UprobeReturn>, out: &mut Vec<Decoded>) {
        if p.target.function.kind == CallKind::ActivityNextRecord {
            self.activity(p, r, out);
            return;
        }
        self.stats.calls += 1;
        let call = self.call(p, r);
        out.push(Decoded::Call(call));
    }

    fn activity(&mut self, p: &Pending, r: Option<&UprobeReturn>, out: &mut Vec<Decoded>) {
        match p.target.library {
            Library::Cupti => self.stats.cupti_reads += 1,
            Library::Mspti => self.stats.mspti_reads += 1,
            _ => {}
        }
        let raw = p.raw(r);
        // A nonzero status ends the iteration (CUPTI_ERROR_MAX_LIMIT_REACHED
        // 12, MSPTI_ERROR_MAX_LIMIT_REACHED 3): no record.
        if !raw.succeeded() {
            return;
        }
        let bytes = raw.return_bytes();
        let Some(api) = ActivityApi::of(p.target.library) else {
            return;
        };
        // Only a pointer (a kernel without `RETURN_TWICE`) or nothing: unread.
        if bytes.len() <= 8 {
            self.stats.activity_unread += 1;
            return;
        }
        match activity::parse(api, bytes) {
            Ok(activity) => {
                self.stats.activities += 1;
                out.push(Decoded::Activity(ActivityEvent {
                    tgid: p.entry.tgid,
                    tid: p.entry.tid,
                    ts: r.map_or(p.entry.header.ts, |r| r.header.ts),
                    library: p.target.library,
                    activity,
                }));
            }
            // A kind number the API could define (theirs count up from
            // 0: CUPTI's are below 64): not drawn. Past that: garbage.
            Err(activity::ActivityError::UnknownKind { kind, .. }) if kind < 256 => {
                self.stats.activity_other_kinds += 1
            }
            Err(_) => self.stats.activity_errors += 1,
        }
    }

    /// Builds the call and applies its effects (communicators, memory,
    /// current device) when it returned successfully.
    fn call(&mut self, p: &Pending, r: Option<&UprobeReturn>) -> DeviceCall {
        let raw = p.raw(r);
        let spec = p.target.function;
        let library = p.target.library;
        let (tgid, tid) = (p.entry.tgid, p.entry.tid);
        let ok = raw.succeeded();
        let process = self.process(tgid);

        let id_hash = match spec.kind {
            CallKind::CommInit(CommInit::Rank | CommInit::RootInfo) => {
                let id = raw.id_bytes();
                (!id.is_empty()).then(|| comm_id_hash(&id))
            }
            CallKind::CommInit(CommInit::All) if ok => Some(comm_id_hash(raw.return_bytes())),
            CallKind::CommInit(CommInit::Split) => raw
                .u64(Role::Comm)
                .and_then(|parent| process.comms.get(parent)?.id_hash)
                .map(|h| split_hash(h, raw.u32(Role::Color).unwrap_or(0) as i32)),
            CallKind::UniqueId if ok && !raw.return_bytes().is_empty() => {
                Some(comm_id_hash(raw.return_bytes()))
            }
            _ => None,
        };
        let mut args = args::build(&raw, id_hash);
        if let CallArgs::Launch(l) = &mut args {
            l.kernel = p
                .kernel
                .clone()
                .or_else(|| Self::launched_kernel(p, Some(&process.kernels)));
        }

        let vendor = library.vendor();
        let mut memory = None;
        let mut comm = None;
        match &args {
            CallArgs::Malloc(a) if r.is_some() => {
                memory = match a.ptr {
                    Some(ptr) if ok => {
                        Some(process.memory.allocated(tid, vendor, ptr, a.size, p.site))
                    }
                    // Succeeded, but the pointer copy failed: unknown.
                    None if ok => None,
                    _ => Some(process.memory.failed(tid, vendor, a.size, p.site)),
                };
            }
            CallArgs::Free { ptr, .. } if ok && *ptr != 0 => {
                memory = Some(process.memory.freed(tid, vendor, *ptr));
            }
            CallArgs::Vmm(v) if ok => match (v.op, v.ptr, v.size) {
                (VmmOp::Map, Some(ptr), Some(size)) => {
                    memory = Some(process.memory.mapped(tid, vendor, ptr, size, p.site));
                }
                (VmmOp::Unmap, Some(ptr), Some(size)) => {
                    memory = Some(process.memory.unmapped(tid, vendor, ptr, size));
                }
                _ => {}
            },
            CallArgs::KernelHandle(h) if ok => match (h.kind, h.handle, &h.name, h.from) {
                (HandleKind::KernelFunction, Some(handle), _, Some(kernel)) => {
                    process.kernels.alias(handle, kernel);
                }
                (_, Some(handle), Some(name), _) => process.kernels.learn(handle, name),
                _ => {}
            },
            CallArgs::SetDevice { device } if ok => {
                if let Ok(d) = u32::try_from(*device) {
                    process.memory.set_device(tid, vendor, d);
                }
            }
            CallArgs::CommInit(init) if ok => {
                for (i, &handle) in init.comms.iter().enumerate() {
                    let (rank, size) = match init.kind {
                        CommInit::All => (u32::try_from(i).ok(), init.nranks),
                        CommInit::Split => (None, None),
                        _ => (init.rank, init.nranks),
                    };
                    process.comms.init(library, handle, id_hash, rank, size);
                }
                comm = init
                    .comms
                    .first()
                    .map(|&h| process.comms.context(h, None, false));
            }
            CallArgs::CommQuery {
                comm: handle,
                value,
            } => {
                if let Some(v) = value {
                    let (size, rank) = match spec.kind {
                        CallKind::CommQuery(crate::catalog::CommQuery::Size) => (Some(*v), None),
                        _ => (None, Some(*v)),
                    };
                    process.comms.learn(library, *handle, size, rank);
                }
                comm = Some(process.comms.context(*handle, None, false));
            }
            CallArgs::CommEnd { comm: handle } => {
                comm = Some(process.comms.context(*handle, None, false));
                if r.is_some() {
                    process.comms.remove(*handle);
                }
            }
            CallArgs::Collective(c) => comm = Some(process.comms.context(c.comm, p.seq.0, p.seq.1)),
            CallArgs::SendRecv(s) => comm = Some(process.comms.context(s.comm, None, false)),
            _ => {}
        }

        let ret = r.and_then(|r| match spec.ret {
            RetKind::Status => Some(i64::from(r.ret as u32 as i32)),
            RetKind::Value => Some(r.ret as i64),
            RetKind::Void => None,
        });
        let error = spec.ret == RetKind::Status && ret.is_some_and(|v| v != 0);
        let name = args::describe(spec.name, &args, memory.as_ref());
        DeviceCall {
            library,
            function: spec.name,
            kind: spec.kind,
            tgid,
            tid,
            start_ts: p.entry.header.ts,
            end_ts: r.map(|r| r.header.ts),
            args,
            ret,
            error,
            name,
            comm,
            memory,
            site: p.site,
            launches: r
                .map(|r| r.launches)
                .filter(|l| *l != LaunchCounts::default()),
        }
    }
}

impl Pending {
    fn raw<'a>(&'a self, ret: Option<&'a UprobeReturn>) -> Raw<'a> {
        Raw {
            library: self.target.library,
            spec: self.target.function,
            entry: &self.entry,
            ret,
            sp_delta: self.target.sp_delta,
        }
    }
}

#[cfg(test)]
mod tests;
