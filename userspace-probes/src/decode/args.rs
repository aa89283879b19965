//! Typed arguments of one call, from its entry record (registers, stack
//! words, entry copy) and return record (out-parameter copy), and the slice
//! name people read on the timeline.
//!
//! `int` and enum arguments come from registers whose upper 32 bits the
//! System V ABI leaves undefined: they are read as the low 32 bits only.

use xpuscope_common::uprobe::{DEREF_BYTES, ENTRY_STACK_WORDS, UprobeEntry, UprobeReturn};

use super::enums::{DataType, MemcpyKind, RedOp, human_bytes};
use super::memory::MemoryEffect;
use crate::bytes::{c_string, u32_at, u64_at};
use crate::catalog::{
    ArgLoc, CallKind, Collective, CommInit, DerefSource, Direction, FunctionSpec, HandleKind,
    LaunchKind, Library, Role, VmmOp,
};

/// Arguments of a collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveArgs {
    pub op: Collective,
    /// Elements (per rank input for AllGather, per rank output for
    /// ReduceScatter, as the APIs define `count`); None for a barrier.
    pub count: Option<u64>,
    pub dtype: Option<DataType>,
    /// `count * sizeof(dtype)`.
    pub bytes: Option<u64>,
    pub red_op: Option<RedOp>,
    pub root: Option<i32>,
    pub send: Option<u64>,
    pub recv: Option<u64>,
    pub comm: u64,
    pub stream: Option<u64>,
}

/// Arguments of a point-to-point send or receive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendRecvArgs {
    pub direction: Direction,
    pub buf: u64,
    pub count: u64,
    pub dtype: DataType,
    pub bytes: Option<u64>,
    pub peer: i32,
    pub comm: u64,
    pub stream: Option<u64>,
}

/// Arguments of a communicator init, with what it returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommInitArgs {
    pub kind: CommInit,
    /// `nranks` (for `ncclCommInitAll`: `ndev`).
    pub nranks: Option<u32>,
    pub rank: Option<u32>,
    /// Identity of the communicator (see [`super::comm::comm_id_hash`]).
    pub id_hash: Option<u64>,
    /// Handles written at return (several for `ncclCommInitAll`).
    pub comms: Vec<u64>,
    /// `ncclCommSplit`: the parent and color.
    pub parent: Option<u64>,
    pub color: Option<i32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocArgs {
    pub size: u64,
    /// The allocation (read at return; None on failure).
    pub ptr: Option<u64>,
    pub stream: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemcpyArgs {
    pub dst: u64,
    pub src: u64,
    pub bytes: u64,
    pub kind: MemcpyKind,
    pub stream: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchArgs {
    pub func: u64,
    pub grid: Option<[u32; 3]>,
    pub block: Option<[u32; 3]>,
    /// The block count of AscendCL's and the CANN runtime's launches.
    pub blocks: Option<u32>,
    pub shared_mem: Option<u64>,
    pub stream: Option<u64>,
    /// The kernel's name, from the call that handed out the handle `func`
    /// (a CUDA driver handle, a CANN runtime stub or function handle; set
    /// by the decoder; for a launch of the library above, from the launch
    /// nested in it).
    pub kernel: Option<String>,
}

/// Arguments of a driver virtual-memory call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmmArgs {
    pub op: VmmOp,
    /// The address (for `cuMemAddressReserve`, the reserved range read at
    /// return; None on failure).
    pub ptr: Option<u64>,
    /// Bytes (none for `cuMemRelease`).
    pub size: Option<u64>,
    /// The physical allocation (for `cuMemCreate`, read at return).
    pub handle: Option<u64>,
    /// `cuMemMap`'s offset into the physical allocation.
    pub offset: Option<u64>,
}

/// Arguments of a call handing out a kernel handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelHandleArgs {
    pub kind: HandleKind,
    /// The name asked for (entry copy; cut at the copy's length).
    pub name: Option<String>,
    /// The handle written at return, or the stub registered
    /// (`rtFunctionRegister`); None on failure.
    pub handle: Option<u64>,
    /// `cuKernelGetFunction`'s kernel.
    pub from: Option<u64>,
}

/// The typed arguments of a call, by what it means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallArgs {
    None,
    Collective(CollectiveArgs),
    SendRecv(SendRecvArgs),
    CommInit(CommInitArgs),
    CommEnd {
        comm: u64,
    },
    CommQuery {
        comm: u64,
        value: Option<u32>,
    },
    UniqueId {
        id_hash: Option<u64>,
    },
    Malloc(AllocArgs),
    Free {
        ptr: u64,
        stream: Option<u64>,
    },
    SetDevice {
        device: i32,
    },
    Memcpy(MemcpyArgs),
    Memset {
        ptr: u64,
        value: i32,
        bytes: u64,
        stream: Option<u64>,
    },
    Launch(LaunchArgs),
    Graph {
        exec: u64,
        stream: Option<u64>,
    },
    Vmm(VmmArgs),
    KernelHandle(KernelHandleArgs),
    Sync {
        stream: Option<u64>,
        event: Option<u64>,
    },
    EventRecord {
        event: u64,
        stream: Option<u64>,
    },
    StreamWaitEvent {
        stream: u64,
        event: u64,
    },
    HostFunc {
        stream: u64,
        func: u64,
    },
    ActivityEnable {
        kind: u32,
    },
    ClockSample {
        timestamp: Option<u64>,
    },
    Marker {
        message: Option<String>,
        range_id: Option<u64>,
    },
}

/// Read access to one call's raw records.
pub(crate) struct Raw<'a> {
    pub library: Library,
    pub spec: &'static FunctionSpec,
    pub entry: &'a UprobeEntry,
    pub ret: Option<&'a UprobeReturn>,
    pub sp_delta: i64,
}

/// Index into `UprobeEntry::stack` of stack argument `slot` for a probe
/// `sp_delta` bytes below the entry (`sp[0]` is the return address at entry).
pub(crate) fn stack_index(slot: u8, sp_delta: i64) -> Option<usize> {
    if sp_delta < 0 || sp_delta % 8 != 0 {
        return None;
    }
    let i = usize::try_from(sp_delta / 8)
        .ok()?
        .checked_add(1 + slot as usize)?;
    (i < ENTRY_STACK_WORDS).then_some(i)
}

impl Raw<'_> {
    fn at(&self, loc: ArgLoc) -> Option<u64> {
        match loc {
            ArgLoc::Reg(i) => self.entry.args.get(i as usize).copied(),
            ArgLoc::Stack(slot) => self
                .entry
                .stack
                .get(stack_index(slot, self.sp_delta)?)
                .copied(),
        }
    }

    pub(crate) fn u64(&self, role: Role) -> Option<u64> {
        self.at(self.spec.arg(role)?)
    }

    pub(crate) fn u32(&self, role: Role) -> Option<u32> {
        self.u64(role).map(|v| v as u32)
    }

    fn i32(&self, role: Role) -> Option<i32> {
        self.u32(role).map(|v| v as i32)
    }

    /// The entry copy (bounded by the record's buffer).
    pub(crate) fn entry_bytes(&self) -> &[u8] {
        let n = (self.entry.deref_len as usize).min(DEREF_BYTES);
        &self.entry.deref[..n]
    }

    /// The return copy.
    pub(crate) fn return_bytes(&self) -> &[u8] {
        match self.ret {
            Some(r) => &r.deref[..(r.deref_len as usize).min(DEREF_BYTES)],
            None => &[],
        }
    }

    /// The status the call returned succeeded (0), when it returned.
    pub(crate) fn succeeded(&self) -> bool {
        self.ret.is_some_and(|r| r.ret as u32 == 0)
    }

    /// A by-value aggregate on the stack: the entry copy when the kernel
    /// made one, else the stack words the entry record carries.
    fn stack_aggregate(&self, slot: u8) -> Vec<u8> {
        let copy = self.entry_bytes();
        if !copy.is_empty() {
            return copy.to_vec();
        }
        let Some(first) = stack_index(slot, self.sp_delta) else {
            return Vec::new();
        };
        self.entry.stack[first..]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }

    /// Bytes naming a communicator at init: the id by value (NCCL) or the
    /// root info through its pointer (HCCL).
    pub(crate) fn id_bytes(&self) -> Vec<u8> {
        match self.spec.capture.entry.map(|e| e.source) {
            Some(DerefSource::Stack { slot }) => self.stack_aggregate(slot),
            Some(DerefSource::Arg(_)) => self.entry_bytes().to_vec(),
            None => Vec::new(),
        }
    }

    fn dtype(&self) -> Option<DataType> {
        let v = self.u32(Role::Dtype)?;
        Some(match self.library {
            Library::Hccl => DataType::from_hccl(v),
            _ => DataType::from_nccl(v),
        })
    }

    fn red_op(&self) -> Option<RedOp> {
        let v = self.u32(Role::RedOp)?;
        Some(match self.library {
            Library::Hccl => RedOp::from_hccl(v),
            _ => RedOp::from_nccl(v),
        })
    }

    /// `x | y << 32` and `z` registers of a `dim3`.
    fn dim3(&self, xy: Role, z: Role) -> Option<[u32; 3]> {
        let xy = self.u64(xy)?;
        Some([xy as u32, (xy >> 32) as u32, self.u32(z)?])
    }

    /// Three `unsigned int` dimensions (the driver's launches).
    fn dims(&self, x: Role, y: Role, z: Role) -> Option<[u32; 3]> {
        Some([self.u32(x)?, self.u32(y)?, self.u32(z)?])
    }

    /// The u64 an out-parameter received, when the call succeeded.
    fn returned_u64(&self) -> Option<u64> {
        self.succeeded()
            .then(|| u64_at(self.return_bytes(), 0))
            .flatten()
    }

    /// The handles an init wrote at return (only when it succeeded).
    fn returned_handles(&self, max: usize) -> Vec<u64> {
        if !self.succeeded() {
            return Vec::new();
        }
        let b = self.return_bytes();
        (0..max.min(b.len() / 8))
            .filter_map(|i| u64_at(b, i * 8))
            .collect()
    }
}

/// Builds the typed arguments of a call.
pub(crate) fn build(raw: &Raw<'_>, id_hash: Option<u64>) -> CallArgs {
    use Role::*;
    let spec = raw.spec;
    match spec.kind {
        CallKind::Collective(op) => {
            let count = raw.u64(Count);
            let dtype = raw.dtype();
            CallArgs::Collective(CollectiveArgs {
                op,
                count,
                dtype,
                bytes: count.zip(dtype).and_then(|(c, t)| t.bytes(c)),
                red_op: raw.red_op(),
                root: raw.i32(Root),
                send: raw.u64(SendBuf).or(raw.u64(Buf)),
                recv: raw.u64(RecvBuf).or(raw.u64(Buf)),
                comm: raw.u64(Comm).unwrap_or(0),
                stream: raw.u64(Stream),
            })
        }
        CallKind::SendRecv(direction) => {
            let count = raw.u64(Count).unwrap_or(0);
            let dtype = raw.dtype().unwrap_or(DataType::Unknown(u32::MAX));
            CallArgs::SendRecv(SendRecvArgs {
                direction,
                buf: raw.u64(Buf).unwrap_or(0),
                count,
                dtype,
                bytes: dtype.bytes(count),
                peer: raw.i32(Peer).unwrap_or(-1),
                comm: raw.u64(Comm).unwrap_or(0),
                stream: raw.u64(Stream),
            })
        }
        CallKind::CommInit(kind) => {
            let nranks = raw.u32(NRanks);
            let comms = match kind {
                CommInit::All => raw.returned_handles(nranks.unwrap_or(0) as usize),
                _ => raw.returned_handles(1),
            };
            CallArgs::CommInit(CommInitArgs {
                kind,
                nranks,
                rank: raw.u32(Rank),
                id_hash,
                comms,
                parent: (kind == CommInit::Split).then(|| raw.u64(Comm)).flatten(),
                color: raw.i32(Color),
            })
        }
        CallKind::CommEnd(_) => CallArgs::CommEnd {
            comm: raw.u64(Comm).unwrap_or(0),
        },
        CallKind::CommQuery(_) => CallArgs::CommQuery {
            comm: raw.u64(Comm).unwrap_or(0),
            value: raw
                .succeeded()
                .then(|| u32_at(raw.return_bytes(), 0))
                .flatten(),
        },
        CallKind::UniqueId => CallArgs::UniqueId { id_hash },
        CallKind::Malloc => CallArgs::Malloc(AllocArgs {
            size: raw.u64(Size).unwrap_or(0),
            ptr: raw
                .succeeded()
                .then(|| u64_at(raw.return_bytes(), 0))
                .flatten(),
            stream: raw.u64(Stream),
        }),
        CallKind::Free => CallArgs::Free {
            ptr: raw.u64(DevPtr).unwrap_or(0),
            stream: raw.u64(Stream),
        },
        CallKind::SetDevice => CallArgs::SetDevice {
            device: raw.i32(Device).unwrap_or(-1),
        },
        CallKind::Memcpy => CallArgs::Memcpy(MemcpyArgs {
            dst: raw.u64(Dst).unwrap_or(0),
            src: raw.u64(Src).unwrap_or(0),
            bytes: raw.u64(Size).unwrap_or(0),
            kind: super::enums::MemcpyKind::from_raw(raw.u32(MemcpyKind).unwrap_or(u32::MAX)),
            stream: raw.u64(Stream),
        }),
        CallKind::Memset => CallArgs::Memset {
            ptr: raw.u64(DevPtr).unwrap_or(0),
            value: raw.i32(Value).unwrap_or(0),
            bytes: raw.u64(Size).unwrap_or(0),
            stream: raw.u64(Stream),
        },
        CallKind::Launch(LaunchKind::Graph) => CallArgs::Graph {
            exec: raw.u64(GraphExec).unwrap_or(0),
            stream: raw.u64(Stream),
        },
        CallKind::Launch(LaunchKind::KernelExC) => {
            // cudaLaunchConfig_t: gridDim@0, blockDim@12, size_t
            // dynamicSmemBytes@24, stream@32. CUlaunchConfig: the same
            // offsets with an `unsigned int` sharedMemBytes@24 (then padding).
            let c = raw.entry_bytes();
            let dim = |off| Some([u32_at(c, off)?, u32_at(c, off + 4)?, u32_at(c, off + 8)?]);
            let shared_mem = match raw.library {
                Library::Cuda => u32_at(c, 24).map(u64::from),
                _ => u64_at(c, 24),
            };
            CallArgs::Launch(LaunchArgs {
                func: raw.u64(Func).unwrap_or(0),
                grid: dim(0),
                block: dim(12),
                blocks: None,
                shared_mem,
                stream: u64_at(c, 32),
                kernel: None,
            })
        }
        CallKind::Launch(LaunchKind::Kernel) => CallArgs::Launch(LaunchArgs {
            func: raw.u64(Func).unwrap_or(0),
            grid: raw
                .dim3(GridXY, GridZ)
                .or_else(|| raw.dims(GridX, GridY, GridZ)),
            block: raw
                .dim3(BlockXY, BlockZ)
                .or_else(|| raw.dims(BlockX, BlockY, BlockZ)),
            blocks: raw.u32(NumBlocks),
            shared_mem: match raw.library {
                // `unsigned int sharedMemBytes` in an 8-byte stack slot.
                Library::Cuda => raw.u32(SharedMem).map(u64::from),
                _ => raw.u64(SharedMem),
            },
            stream: raw.u64(Stream),
            kernel: None,
        }),
        CallKind::Vmm(op) => CallArgs::Vmm(VmmArgs {
            op,
            ptr: match op {
                VmmOp::Reserve => raw.returned_u64(),
                _ => raw.u64(DevPtr),
            },
            size: raw.u64(Size),
            handle: match op {
                VmmOp::Create => raw.returned_u64(),
                _ => raw.u64(MemHandle),
            },
            offset: raw.u64(Offset),
        }),
        CallKind::KernelHandle(kind) => CallArgs::KernelHandle(KernelHandleArgs {
            kind,
            name: (!raw.entry_bytes().is_empty()).then(|| c_string(raw.entry_bytes())),
            handle: match kind {
                // The stub is passed in: it names the kernel once registered.
                HandleKind::StubRegister => raw.succeeded().then(|| raw.u64(Func)).flatten(),
                _ => raw.returned_u64(),
            },
            from: match kind {
                HandleKind::KernelFunction => raw.u64(Func),
                _ => None,
            },
        }),
        CallKind::Sync(_) => CallArgs::Sync {
            stream: raw.u64(Stream),
            event: raw.u64(Event),
        },
        CallKind::EventRecord => CallArgs::EventRecord {
            event: raw.u64(Event).unwrap_or(0),
            stream: raw.u64(Stream),
        },
        CallKind::StreamWaitEvent => CallArgs::StreamWaitEvent {
            stream: raw.u64(Stream).unwrap_or(0),
            event: raw.u64(Event).unwrap_or(0),
        },
        CallKind::HostFunc => CallArgs::HostFunc {
            stream: raw.u64(Stream).unwrap_or(0),
            func: raw.u64(HostFn).unwrap_or(0),
        },
        CallKind::ActivityEnable => CallArgs::ActivityEnable {
            kind: raw.u32(ActivityKind).unwrap_or(0),
        },
        CallKind::ClockSample => CallArgs::ClockSample {
            timestamp: raw
                .succeeded()
                .then(|| u64_at(raw.return_bytes(), 0))
                .flatten(),
        },
        CallKind::Mark | CallKind::RangeStart | CallKind::RangeEnd => {
            let message = (!raw.entry_bytes().is_empty()).then(|| c_string(raw.entry_bytes()));
            let range_id = match spec.kind {
                CallKind::RangeStart => raw.ret.map(|r| r.ret),
                CallKind::RangeEnd => raw.u64(RangeId),
                _ => None,
            };
            CallArgs::Marker { message, range_id }
        }
        CallKind::GroupStart
        | CallKind::GroupEnd
        | CallKind::ActivityNextRecord
        | CallKind::ActivityFlush
        | CallKind::ActivityRegister => CallArgs::None,
    }
}

fn dims(d: [u32; 3]) -> String {
    format!("({},{},{})", d[0], d[1], d[2])
}

/// The slice name: "ncclAllReduce 64 MiB bf16 sum",
/// "cudaLaunchKernel grid(7,3,1) block(128,1,1)", "cudaMalloc 1 GiB".
pub(crate) fn describe(function: &str, args: &CallArgs, memory: Option<&MemoryEffect>) -> String {
    let mut s = function.to_string();
    let mut add = |part: String| {
        s.push(' ');
        s.push_str(&part);
    };
    let size = |bytes: Option<u64>, count: Option<u64>, dtype: Option<DataType>| match (
        bytes, count, dtype,
    ) {
        (Some(b), _, Some(t)) => format!("{} {t}", human_bytes(b)),
        (None, Some(c), Some(t)) => format!("{c} x {t}"),
        _ => String::new(),
    };
    match args {
        CallArgs::Collective(c) => {
            if c.op != Collective::Barrier {
                add(size(c.bytes, c.count, c.dtype));
            }
            if let Some(op) = c.red_op {
                add(op.to_string());
            }
            if let Some(root) = c.root {
                add(format!("root {root}"));
            }
        }
        CallArgs::SendRecv(p) => {
            add(size(p.bytes, Some(p.count), Some(p.dtype)));
            add(match p.direction {
                Direction::Send => format!("to {}", p.peer),
                Direction::Recv => format!("from {}", p.peer),
            });
        }
        CallArgs::CommInit(i) => match i.kind {
            CommInit::All => add(format!("{} devices", i.nranks.unwrap_or(0))),
            CommInit::Split => add(format!("color {}", i.color.unwrap_or(0))),
            _ => {
                if let (Some(r), Some(n)) = (i.rank, i.nranks) {
                    add(format!("rank {r}/{n}"));
                }
            }
        },
        CallArgs::Malloc(a) => add(human_bytes(a.size)),
        CallArgs::Free { .. } => {
            if let Some(m) = memory.filter(|m| m.delta < 0) {
                add(human_bytes(m.delta.unsigned_abs()));
            }
        }
        CallArgs::SetDevice { device } => add(device.to_string()),
        CallArgs::Memcpy(m) => {
            add(human_bytes(m.bytes));
            add(m.kind.name().to_string());
        }
        CallArgs::Memset { bytes, .. } => add(human_bytes(*bytes)),
        CallArgs::Launch(l) => {
            if let Some(k) = &l.kernel {
                add(k.clone());
            }
            if let (Some(g), Some(b)) = (l.grid, l.block) {
                add(format!("grid{} block{}", dims(g), dims(b)));
            } else if let Some(n) = l.blocks {
                add(format!("blocks {n}"));
            }
        }
        CallArgs::Marker {
            message: Some(m), ..
        } => add(m.clone()),
        CallArgs::Vmm(v) => {
            if let Some(size) = v.size {
                add(human_bytes(size));
            }
        }
        CallArgs::KernelHandle(KernelHandleArgs { name: Some(n), .. }) => add(n.clone()),
        _ => {}
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_slots_follow_sp_delta() {
        assert_eq!(stack_index(0, 0), Some(1));
        assert_eq!(stack_index(1, 0), Some(2));
        assert_eq!(stack_index(0, 8), Some(2), "a probe after a push");
        assert_eq!(stack_index(6, 0), Some(7));
        assert_eq!(stack_index(7, 0), None, "past the copied words");
        assert_eq!(stack_index(0, 4), None);
        assert_eq!(stack_index(0, -8), None);
        assert_eq!(stack_index(0, i64::MAX - 7), None);
    }
}
