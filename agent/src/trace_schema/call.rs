//! A device call's arguments on its slice: written from the decoded call,
//! read back into the same call. What the live record carries comes back,
//! except what the slice does not hold (see [`read_call`]).

use xpuscope_common::uprobe::LaunchCounts;
use xpuscope_perfetto::Arg;
use xpuscope_perfetto::rewrite::EventView;
use xpuscope_probes::catalog::{CallKind, CommOp, LaunchKind, Library, SyncKind};
use xpuscope_probes::decode::DeviceCall;
use xpuscope_probes::decode::args::{
    AllocArgs, CallArgs, CollectiveArgs, CommInitArgs, KernelHandleArgs, LaunchArgs, MemcpyArgs,
    SendRecvArgs, VmmArgs,
};
use xpuscope_probes::decode::comm::CommContext;
use xpuscope_probes::decode::enums::{DataType, MemcpyKind, RedOp};
use xpuscope_probes::decode::memory::{Device, MemoryEffect};

use super::keys as k;
use super::names;

/// What a synchronisation waits for, as the `sync` argument says it.
fn sync_target(kind: CallKind) -> &'static str {
    match kind {
        CallKind::Sync(SyncKind::Stream) => "stream",
        CallKind::Sync(SyncKind::Device) => "device",
        CallKind::Sync(SyncKind::Event) => "event",
        _ => "other",
    }
}

fn dims(d: [u32; 3]) -> String {
    format!("({},{},{})", d[0], d[1], d[2])
}

fn parse_dims(s: &str) -> Option<[u32; 3]> {
    let mut it = s.strip_prefix('(')?.strip_suffix(')')?.split(',');
    let d = [
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
    ];
    it.next().is_none().then_some(d)
}

/// The call's arguments, communicator and memory effect as slice
/// arguments.
pub fn call_args(call: &DeviceCall) -> Vec<Arg> {
    let mut a = vec![k::LIBRARY.arg(call.library.name())];
    match &call.args {
        CallArgs::Collective(c) => {
            if let Some(b) = c.bytes {
                a.push(k::BYTES.arg(b));
            }
            if let Some(n) = c.count {
                a.push(k::COUNT.arg(n));
            }
            if let Some(t) = c.dtype {
                a.push(k::DTYPE.arg(t.to_string()));
            }
            if let Some(op) = c.red_op {
                a.push(k::RED_OP.arg(op.to_string()));
                if let Some(v) = op.custom_value() {
                    a.push(k::RED_OP_VALUE.arg(v.into()));
                }
            }
            if let Some(r) = c.root {
                a.push(k::ROOT.arg(r.into()));
            }
            if let Some(s) = c.stream {
                a.push(k::STREAM.arg(s));
            }
            if let Some(b) = c.send {
                a.push(k::SEND_BUF.arg(b));
            }
            if let Some(b) = c.recv {
                a.push(k::RECV_BUF.arg(b));
            }
        }
        CallArgs::SendRecv(s) => {
            if let Some(b) = s.bytes {
                a.push(k::BYTES.arg(b));
            }
            a.push(k::COUNT.arg(s.count));
            a.push(k::DTYPE.arg(s.dtype.to_string()));
            a.push(k::PEER.arg(s.peer.into()));
            if let Some(st) = s.stream {
                a.push(k::STREAM.arg(st));
            }
            a.push(k::BUF.arg(s.buf));
        }
        CallArgs::CommInit(i) => {
            if let Some(n) = i.nranks {
                a.push(k::NRANKS.arg(n.into()));
            }
            if let Some(r) = i.rank {
                a.push(k::INIT_RANK.arg(r.into()));
            }
            if let Some(h) = i.id_hash {
                a.push(k::ID_HASH.arg(h));
            }
        }
        CallArgs::Malloc(m) => {
            a.push(k::BYTES.arg(m.size));
            if let Some(p) = m.ptr {
                a.push(k::PTR.arg(p));
            }
            if let Some(s) = m.stream {
                a.push(k::STREAM.arg(s));
            }
        }
        CallArgs::Free { ptr, stream } => {
            a.push(k::PTR.arg(*ptr));
            if let Some(s) = stream {
                a.push(k::STREAM.arg(*s));
            }
        }
        CallArgs::SetDevice { device } => a.push(k::SET_DEVICE.arg((*device).into())),
        CallArgs::Memcpy(m) => {
            a.push(k::BYTES.arg(m.bytes));
            a.push(k::MEMCPY_KIND.arg(format!("{:?}", m.kind)));
            if let Some(s) = m.stream {
                a.push(k::STREAM.arg(s));
            }
            a.push(k::MEMCPY_DST.arg(m.dst));
            a.push(k::MEMCPY_SRC.arg(m.src));
        }
        CallArgs::Memset {
            ptr,
            value,
            bytes,
            stream,
        } => {
            a.push(k::PTR.arg(*ptr));
            a.push(k::MEMSET_VALUE.arg((*value).into()));
            a.push(k::BYTES.arg(*bytes));
            if let Some(s) = stream {
                a.push(k::STREAM.arg(*s));
            }
        }
        CallArgs::Launch(l) => {
            a.push(k::FUNC.arg(l.func));
            if let Some(name) = &l.kernel {
                a.push(k::KERNEL.arg(name.as_str()));
            }
            if let Some(g) = l.grid {
                a.push(k::GRID.arg(dims(g)));
            }
            if let Some(b) = l.block {
                a.push(k::BLOCK.arg(dims(b)));
            }
            if let Some(n) = l.blocks {
                a.push(k::BLOCKS.arg(n.into()));
            }
            if let Some(m) = l.shared_mem {
                a.push(k::SHARED_MEM.arg(m));
            }
            if let Some(s) = l.stream {
                a.push(k::STREAM.arg(s));
            }
        }
        CallArgs::Graph { exec, stream } => {
            a.push(k::GRAPH_EXEC.arg(*exec));
            if let Some(s) = stream {
                a.push(k::STREAM.arg(*s));
            }
        }
        CallArgs::Vmm(v) => {
            if let Some(p) = v.ptr {
                a.push(k::PTR.arg(p));
            }
            if let Some(b) = v.size {
                a.push(k::BYTES.arg(b));
            }
            if let Some(h) = v.handle {
                a.push(k::MEM_HANDLE.arg(h));
            }
            if let Some(o) = v.offset {
                a.push(k::MEM_OFFSET.arg(o));
            }
        }
        CallArgs::KernelHandle(h) => {
            if let Some(name) = &h.name {
                a.push(k::KERNEL.arg(name.as_str()));
            }
            if let Some(handle) = h.handle {
                a.push(k::HANDLE.arg(handle));
            }
            if let Some(from) = h.from {
                a.push(k::FROM_KERNEL.arg(from));
            }
        }
        CallArgs::Sync { stream, event } => {
            a.push(k::SYNC.arg(sync_target(call.kind)));
            if let Some(s) = stream {
                a.push(k::STREAM.arg(*s));
            }
            if let Some(e) = event {
                a.push(k::EVENT.arg(*e));
            }
        }
        CallArgs::EventRecord { event, stream } => {
            a.push(k::EVENT.arg(*event));
            if let Some(s) = stream {
                a.push(k::STREAM.arg(*s));
            }
        }
        CallArgs::StreamWaitEvent { stream, event } => {
            a.push(k::STREAM.arg(*stream));
            a.push(k::EVENT.arg(*event));
        }
        CallArgs::HostFunc { stream, func } => {
            a.push(k::STREAM.arg(*stream));
            a.push(k::FUNC.arg(*func));
        }
        CallArgs::CommEnd { comm } => a.push(k::COMM.arg(*comm)),
        CallArgs::CommQuery { comm, value } => {
            a.push(k::COMM.arg(*comm));
            if let Some(v) = value {
                a.push(k::QUERY_VALUE.arg((*v).into()));
            }
        }
        CallArgs::UniqueId { id_hash } => {
            if let Some(h) = id_hash {
                a.push(k::ID_HASH.arg(*h));
            }
        }
        CallArgs::ActivityEnable { kind } => a.push(k::ACTIVITY_KIND.arg((*kind).into())),
        CallArgs::ClockSample { timestamp } => {
            if let Some(t) = timestamp {
                a.push(k::TIMESTAMP.arg(*t));
            }
        }
        CallArgs::Marker { message, range_id } => {
            if let Some(m) = message {
                a.push(k::MESSAGE.arg(m.as_str()));
            }
            if let Some(r) = range_id {
                a.push(k::RANGE_ID.arg(*r));
            }
        }
        CallArgs::None => {}
    }
    if let Some(c) = &call.comm {
        // (A communicator end or query has named its handle already; the
        // trace has always carried it twice there.)
        a.push(k::COMM.arg(c.handle));
        if let Some(h) = c.id_hash {
            a.push(k::COMM_HASH.arg(h));
        }
        if let Some(r) = c.rank {
            a.push(k::COMM_RANK.arg(r.into()));
        }
        if let Some(s) = c.size {
            a.push(k::COMM_SIZE.arg(s.into()));
        }
        if let Some(s) = c.seq {
            a.push(k::SEQ.arg(s));
            a.push(k::SEQ_EXACT.arg(c.seq_exact));
        }
    }
    if let Some(m) = &call.memory {
        a.push(k::DEVICE.arg(m.device.index.into()));
        a.push(k::DEVICE_BYTES_HELD.arg(m.held_after));
        // What the call added or released, and at which allocation site:
        // `agent diagnose` rebuilds each site's live bytes from these.
        if m.delta != 0 {
            a.push(k::DEVICE_BYTES_DELTA.arg(m.delta));
        }
        if let Some(site) = m.site {
            a.push(k::ALLOC_SITE.arg(site));
        }
        if m.untracked {
            a.push(k::UNTRACKED.arg(true));
        }
    }
    if let Some(l) = call.launches {
        a.push(k::LAUNCHES_SO_FAR.arg(l.kernels));
        a.push(k::GRAPH_LAUNCHES_SO_FAR.arg(l.graphs));
    }
    if let Some(r) = call.ret {
        a.push(k::RETURN.arg(r));
    }
    if call.error {
        a.push(k::ERROR.arg(call.ret.unwrap_or(0)));
    }
    a
}

/// The slice name of a call: its decoded name, with the error it returned.
pub fn slice_name(call: &DeviceCall) -> String {
    if call.error {
        names::error_slice_name(&call.name, call.ret.unwrap_or(0))
    } else {
        call.name.clone()
    }
}

/// A library by its name in the `library` argument.
pub fn library_named(name: &str) -> Option<Library> {
    Library::ALL.into_iter().find(|l| l.name() == name)
}

/// Whether a slice names a communicator (what the collectives and
/// point-to-point calls carry).
fn has_comm_context(event: &EventView<'_>) -> bool {
    k::COMM_HASH.present(event) || k::SEQ.present(event) || k::COMM.present(event)
}

/// The stream a synchronisation waits on, if the slice is one: a `sync`
/// argument with the stream as `stream`, or (traces of earlier agents)
/// the arguments' debug text `Sync { stream: Some(N), event: .. }`.
pub fn sync_stream(event: &EventView<'_>) -> Option<Option<u64>> {
    if k::SYNC.present(event) {
        return Some(k::STREAM.read(event));
    }
    let rest = k::LEGACY_ARGS.read(event)?.strip_prefix("Sync {")?;
    let stream = rest
        .split_once("stream: Some(")
        .and_then(|(_, r)| r.split_once(')'))
        .and_then(|(n, _)| n.parse().ok());
    Some(stream)
}

/// A call read back from its slice's begin (or an instant read as one)
/// on a thread of process `tgid`: every catalog call the sink wrote, with
/// its arguments, communicator and memory effect. `function` names a
/// function the catalog does not know (traces of other catalogs): it
/// gives the name a `'static` life.
///
/// Not on the slice, so not read back: the end (the slice's end gives
/// it), the handles a communicator init wrote and a split's parent and
/// color, a failed allocation's request (on its own instant:
/// [`super::read`]), and the call's stack (the trace keeps frames, not the
/// agent's ids). A communicator context holding only a handle is read
/// back on collectives and point-to-point calls only.
pub fn read_call(
    event: &EventView<'_>,
    tgid: u32,
    tid: u32,
    function: impl FnOnce(&str) -> &'static str,
) -> Option<DeviceCall> {
    let name = event.name?;
    let fname = names::function_of(name);
    let library_arg = k::LIBRARY.read(event).and_then(library_named);
    let spec = match library_arg {
        Some(l) => l.function(fname),
        None => Library::ALL.into_iter().find_map(|l| l.function(fname)),
    };
    // A communication call by its name and communicator (traces of other
    // catalogs), or a sync by its arguments (earlier agents).
    let named_op = has_comm_context(event)
        .then(|| CommOp::of_name(fname))
        .flatten();
    let kind = match (spec, named_op) {
        (Some(f), _) => f.kind,
        (None, Some(op)) => CallKind::Collective(op.collective()?),
        (None, None) if sync_stream(event).is_some() => CallKind::Sync(SyncKind::Stream),
        (None, None) => return None,
    };
    if library_arg.is_none() && named_op.is_none() && sync_stream(event).is_none() {
        // Not written by the device sink: someone else's slice.
        return None;
    }
    let library = library_arg
        .or_else(|| {
            Library::ALL.into_iter().find(|l| {
                l.functions()
                    .iter()
                    .any(|f| f.kind == kind && f.name == fname)
            })
        })
        .unwrap_or(Library::Nccl);
    let function = match spec {
        Some(f) => f.name,
        None => function(fname),
    };
    let ret = k::RETURN.read(event);
    let error = k::ERROR.present(event);
    let comm = match kind {
        CallKind::Collective(_) | CallKind::SendRecv(_) => read_comm(event, true),
        _ => read_comm(event, false),
    };
    let memory = k::DEVICE_BYTES_HELD.read(event).map(|held| MemoryEffect {
        device: Device {
            vendor: library.vendor(),
            index: k::DEVICE.read(event).unwrap_or(0) as u32,
        },
        delta: k::DEVICE_BYTES_DELTA.read(event).unwrap_or(0),
        held_after: held,
        failed_request: None,
        untracked: k::UNTRACKED.read(event).unwrap_or(false),
        site: k::ALLOC_SITE.read(event),
    });
    // The decoded name, without what the sink added for an error.
    let call_name = match (error, name.rsplit_once(" [error ")) {
        (true, Some((base, _))) => base,
        _ => name,
    };
    Some(DeviceCall {
        library,
        function,
        kind,
        tgid,
        tid,
        start_ts: event.ts,
        end_ts: None,
        args: read_args(kind, event, comm.as_ref()),
        ret,
        error,
        name: call_name.to_owned(),
        comm,
        memory,
        site: None,
        launches: k::LAUNCHES_SO_FAR.read(event).map(|kernels| LaunchCounts {
            kernels,
            graphs: k::GRAPH_LAUNCHES_SO_FAR.read(event).unwrap_or(0),
        }),
    })
}

/// The communicator context a slice names. `handle_only`: a handle alone
/// is a context (on a collective; elsewhere `comm` may be the call's own
/// argument).
fn read_comm(event: &EventView<'_>, handle_only: bool) -> Option<CommContext> {
    let id_hash = k::COMM_HASH.read(event);
    let rank = k::COMM_RANK.read(event).map(|v| v as u32);
    let size = k::COMM_SIZE.read(event).map(|v| v as u32);
    let seq = k::SEQ.read(event);
    let handle = k::COMM.read(event);
    let any = id_hash.is_some() || rank.is_some() || size.is_some() || seq.is_some();
    let named = any || (handle_only && handle.is_some());
    if !named {
        return None;
    }
    Some(CommContext {
        handle: handle.unwrap_or(0),
        id_hash,
        rank,
        size,
        seq,
        seq_exact: k::SEQ_EXACT.read(event).unwrap_or(false),
    })
}

/// A call's typed arguments, by what the call is (as the decoder builds
/// them).
fn read_args(kind: CallKind, e: &EventView<'_>, comm: Option<&CommContext>) -> CallArgs {
    let comm_handle = || k::COMM.read(e).or(comm.map(|c| c.handle)).unwrap_or(0);
    let dtype = || k::DTYPE.read(e).and_then(DataType::from_name);
    let int = |key: super::Key<super::Int>| key.read(e).and_then(|v| i32::try_from(v).ok());
    match kind {
        CallKind::Collective(op) => CallArgs::Collective(CollectiveArgs {
            op,
            count: k::COUNT.read(e),
            dtype: dtype(),
            bytes: k::BYTES.read(e),
            red_op: k::RED_OP
                .read(e)
                .and_then(|s| RedOp::from_name(s, k::RED_OP_VALUE.read(e).map(|v| v as u32))),
            root: int(k::ROOT),
            send: k::SEND_BUF.read(e),
            recv: k::RECV_BUF.read(e),
            comm: comm_handle(),
            stream: k::STREAM.read(e),
        }),
        CallKind::SendRecv(direction) => CallArgs::SendRecv(SendRecvArgs {
            direction,
            buf: k::BUF.read(e).unwrap_or(0),
            count: k::COUNT.read(e).unwrap_or(0),
            dtype: dtype().unwrap_or(DataType::Unknown(u32::MAX)),
            bytes: k::BYTES.read(e),
            peer: int(k::PEER).unwrap_or(-1),
            comm: comm_handle(),
            stream: k::STREAM.read(e),
        }),
        CallKind::CommInit(kind) => CallArgs::CommInit(CommInitArgs {
            kind,
            nranks: k::NRANKS.read(e).map(|v| v as u32),
            rank: k::INIT_RANK.read(e).map(|v| v as u32),
            id_hash: k::ID_HASH.read(e),
            comms: Vec::new(),
            parent: None,
            color: None,
        }),
        CallKind::CommEnd(_) => CallArgs::CommEnd {
            comm: comm_handle(),
        },
        CallKind::CommQuery(_) => CallArgs::CommQuery {
            comm: comm_handle(),
            value: k::QUERY_VALUE.read(e).map(|v| v as u32),
        },
        CallKind::UniqueId => CallArgs::UniqueId {
            id_hash: k::ID_HASH.read(e),
        },
        CallKind::Malloc => CallArgs::Malloc(AllocArgs {
            size: k::BYTES.read(e).unwrap_or(0),
            ptr: k::PTR.read(e),
            stream: k::STREAM.read(e),
        }),
        CallKind::Free => CallArgs::Free {
            ptr: k::PTR.read(e).unwrap_or(0),
            stream: k::STREAM.read(e),
        },
        CallKind::SetDevice => CallArgs::SetDevice {
            device: int(k::SET_DEVICE).unwrap_or(-1),
        },
        CallKind::Memcpy => CallArgs::Memcpy(MemcpyArgs {
            dst: k::MEMCPY_DST.read(e).unwrap_or(0),
            src: k::MEMCPY_SRC.read(e).unwrap_or(0),
            bytes: k::BYTES.read(e).unwrap_or(0),
            kind: k::MEMCPY_KIND
                .read(e)
                .and_then(MemcpyKind::from_debug)
                .unwrap_or(MemcpyKind::Unknown(u32::MAX)),
            stream: k::STREAM.read(e),
        }),
        CallKind::Memset => CallArgs::Memset {
            ptr: k::PTR.read(e).unwrap_or(0),
            value: int(k::MEMSET_VALUE).unwrap_or(0),
            bytes: k::BYTES.read(e).unwrap_or(0),
            stream: k::STREAM.read(e),
        },
        CallKind::Launch(LaunchKind::Graph) => CallArgs::Graph {
            exec: k::GRAPH_EXEC.read(e).unwrap_or(0),
            stream: k::STREAM.read(e),
        },
        CallKind::Launch(_) => CallArgs::Launch(LaunchArgs {
            func: k::FUNC.read(e).unwrap_or(0),
            grid: k::GRID.read(e).and_then(parse_dims),
            block: k::BLOCK.read(e).and_then(parse_dims),
            blocks: k::BLOCKS.read(e).map(|v| v as u32),
            shared_mem: k::SHARED_MEM.read(e),
            stream: k::STREAM.read(e),
            kernel: k::KERNEL.read(e).map(str::to_owned),
        }),
        CallKind::Vmm(op) => CallArgs::Vmm(VmmArgs {
            op,
            ptr: k::PTR.read(e),
            size: k::BYTES.read(e),
            handle: k::MEM_HANDLE.read(e),
            offset: k::MEM_OFFSET.read(e),
        }),
        CallKind::KernelHandle(kind) => CallArgs::KernelHandle(KernelHandleArgs {
            kind,
            name: k::KERNEL.read(e).map(str::to_owned),
            handle: k::HANDLE.read(e),
            from: k::FROM_KERNEL.read(e),
        }),
        CallKind::Sync(_) => CallArgs::Sync {
            stream: sync_stream(e).flatten(),
            event: k::EVENT.read(e),
        },
        CallKind::EventRecord => CallArgs::EventRecord {
            event: k::EVENT.read(e).unwrap_or(0),
            stream: k::STREAM.read(e),
        },
        CallKind::StreamWaitEvent => CallArgs::StreamWaitEvent {
            stream: k::STREAM.read(e).unwrap_or(0),
            event: k::EVENT.read(e).unwrap_or(0),
        },
        CallKind::HostFunc => CallArgs::HostFunc {
            stream: k::STREAM.read(e).unwrap_or(0),
            func: k::FUNC.read(e).unwrap_or(0),
        },
        CallKind::ActivityEnable => CallArgs::ActivityEnable {
            kind: k::ACTIVITY_KIND.read(e).unwrap_or(0) as u32,
        },
        CallKind::ClockSample => CallArgs::ClockSample {
            timestamp: k::TIMESTAMP.read(e),
        },
        CallKind::Mark | CallKind::RangeStart | CallKind::RangeEnd => CallArgs::Marker {
            message: k::MESSAGE.read(e).map(str::to_owned),
            range_id: k::RANGE_ID.read(e),
        },
        CallKind::GroupStart
        | CallKind::GroupEnd
        | CallKind::ActivityNextRecord
        | CallKind::ActivityFlush
        | CallKind::ActivityRegister => CallArgs::None,
    }
}
