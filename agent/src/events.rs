//! Decoding of raw ring-buffer records into typed events: the one place
//! that knows the byte layout of each record kind.

use xpuscope_common::uprobe::{UprobeEntry, UprobeReturn, UprobeStack};
use xpuscope_common::{
    EXIT_CODE_KNOWN, EXIT_GROUP_DEAD, EXIT_GROUP_KNOWN, EventHeader, EventKind, LinkMapChange,
    MAX_PENDING_RETURNS, MAX_STACK_DEPTH, OffCpuStackOf, ProcessExec, ProcessExit, ProcessFork,
    SHORT_STACK_COPIES, SchedSwitch, SchedWaking, TaskRename, USER_STACK_COPY, UserStackCopyOf,
    switch_flags,
};

// The scheduler and process events are the model's types: decoding fills
// them here, and every later stage reads them from the model.
pub use crate::model::sched::{Comm, Exec, Exit, Fork, LinkMap, Rename, Switch, Waking};

/// Stacks of a thread leaving the CPU (addresses leaf first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackCapture {
    pub cpu: u32,
    pub ts: u64,
    pub tid: u32,
    pub tgid: u32,
    /// Kernel addresses, or the negative errno the kernel returned.
    pub kernel: Result<Vec<u64>, i32>,
    /// User addresses by frame pointers (the fallback of `user_copy`).
    pub user: Result<Vec<u64>, i32>,
    /// Registers and stack top for the CFI unwind.
    pub user_copy: Option<UserCopy>,
    /// Bytes of the ring record it came in (its size class; 0 when not
    /// from a ring).
    pub record_bytes: u32,
}

/// A thread's user registers and a copy of the top of its user stack (from
/// `sp` up), to unwind from the code's CFI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserCopy {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// The bytes from `sp` up, or the negative errno of the first read.
    pub stack: Result<Vec<u8>, i32>,
    /// Return addresses put back where the uretprobe trampoline stood.
    pub restored_returns: u32,
}

impl UserCopy {
    /// The heap bytes of the stack copy.
    fn bytes(&self) -> usize {
        self.stack.as_ref().map_or(0, Vec::capacity)
    }

    /// The copy as the thread's stack really is: each pending
    /// return-probed call's return address, which the kernel replaced with
    /// its uretprobe trampoline in the copied slot, put back (the unwind
    /// would stop at the trampoline, which has no CFI).
    fn decode<const COPY: usize>(c: &UserStackCopyOf<COPY>) -> Self {
        let mut restored = 0;
        let stack = if c.stack_len < 0 {
            Err(c.stack_len)
        } else {
            // Never past the bytes the record holds, whatever it says.
            let n = (c.stack_len as usize).min(COPY);
            let mut bytes = c.stack[..n].to_vec();
            let pending = (c.returns_len as usize).min(MAX_PENDING_RETURNS);
            for &[slot, ret] in &c.returns[..pending] {
                let at = slot.wrapping_sub(c.sp) as usize;
                if slot >= c.sp && at.checked_add(8).is_some_and(|end| end <= n) {
                    bytes[at..at + 8].copy_from_slice(&ret.to_le_bytes());
                    restored += 1;
                }
            }
            Ok(bytes)
        };
        UserCopy {
            ip: c.ip,
            sp: c.sp,
            bp: c.bp,
            stack,
            restored_returns: restored,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Switch(Switch),
    Waking(Waking),
    Fork(Fork),
    Exec(Exec),
    Exit(Exit),
    Rename(Rename),
    Stack(Box<StackCapture>),
    /// A device-library call entered; decoded to meaning by `xpuscope-probes`.
    ProbeEntry(Box<UprobeEntry>),
    /// A device-library call returned.
    ProbeReturn(Box<UprobeReturn>),
    /// The user stack of a thread returning from a device-library call
    /// (before that call's `ProbeReturn`).
    ProbeStack(Box<CallStack>),
    /// A process's link map changed.
    LinkMap(LinkMap),
}

/// A caller's user stack at a probed function's return (addresses leaf
/// first: the return address in the caller, then its callers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallStack {
    pub ts: u64,
    pub tid: u32,
    pub tgid: u32,
    pub probe_ip: u64,
    /// Addresses by frame pointers, or the negative errno the kernel
    /// returned (the fallback of `user_copy`).
    pub user: Result<Vec<u64>, i32>,
    /// Registers (the caller's, at the return) and stack top for the CFI
    /// unwind.
    pub user_copy: Option<UserCopy>,
}

impl Event {
    pub fn kind(&self) -> EventKind {
        match self {
            Event::Switch(s) if s.is_bystander() => EventKind::BystanderSwitch,
            Event::Switch(_) => EventKind::SchedSwitch,
            Event::Waking(w) if w.new_task => EventKind::SchedWakeupNew,
            Event::Waking(_) => EventKind::SchedWaking,
            Event::Fork(_) => EventKind::ProcessFork,
            Event::Exec(_) => EventKind::ProcessExec,
            Event::Exit(_) => EventKind::ProcessExit,
            Event::Rename(_) => EventKind::TaskRename,
            Event::Stack(_) => EventKind::OffCpuStack,
            Event::ProbeEntry(_) => EventKind::UprobeEntry,
            Event::ProbeReturn(_) => EventKind::UprobeReturn,
            Event::ProbeStack(_) => EventKind::UprobeStack,
            Event::LinkMap(_) => EventKind::LinkMapChange,
        }
    }

    /// The memory the event holds, itself and what it owns: what a batch
    /// of them costs while queued (a stack event owns a copy of the
    /// thread's stack, several KiB; a switch owns nothing).
    pub fn bytes(&self) -> usize {
        let owned = match self {
            Event::Stack(s) => {
                size_of::<StackCapture>()
                    + words(&s.kernel)
                    + words(&s.user)
                    + s.user_copy.as_ref().map_or(0, UserCopy::bytes)
            }
            Event::ProbeEntry(_) => size_of::<UprobeEntry>(),
            Event::ProbeReturn(_) => size_of::<UprobeReturn>(),
            Event::ProbeStack(s) => {
                size_of::<CallStack>()
                    + words(&s.user)
                    + s.user_copy.as_ref().map_or(0, UserCopy::bytes)
            }
            Event::Switch(_)
            | Event::Waking(_)
            | Event::Fork(_)
            | Event::Exec(_)
            | Event::Exit(_)
            | Event::Rename(_)
            | Event::LinkMap(_) => 0,
        };
        size_of::<Event>() + owned
    }

    /// When the kernel stamped the record.
    pub fn ts(&self) -> u64 {
        match self {
            Event::Switch(e) => e.ts,
            Event::Waking(e) => e.ts,
            Event::Fork(e) => e.ts,
            Event::Exec(e) => e.ts,
            Event::Exit(e) => e.ts,
            Event::Rename(e) => e.ts,
            Event::Stack(e) => e.ts,
            Event::ProbeEntry(e) => e.header.ts,
            Event::ProbeReturn(e) => e.header.ts,
            Event::ProbeStack(e) => e.ts,
            Event::LinkMap(e) => e.ts,
        }
    }
}

/// The heap bytes of a list of addresses.
fn words(addresses: &Result<Vec<u64>, i32>) -> usize {
    addresses
        .as_ref()
        .map_or(0, |a| a.capacity() * size_of::<u64>())
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("record of {0} bytes is shorter than its header")]
    Short(usize),
    #[error("unknown record kind {0}")]
    UnknownKind(u32),
    #[error("{kind:?} record has {got} bytes, expected {want}")]
    Size {
        kind: EventKind,
        got: usize,
        want: usize,
    },
    #[error("off-CPU stack record has {0} bytes, the size of none of its classes")]
    StackClass(usize),
}

fn read<T: Copy>(bytes: &[u8], kind: EventKind) -> Result<T, DecodeError> {
    let want = size_of::<T>();
    if bytes.len() < want {
        return Err(DecodeError::Size {
            kind,
            got: bytes.len(),
            want,
        });
    }
    // SAFETY: length checked; the record types are plain repr(C) data valid
    // for any bit pattern, read unaligned from the ring buffer.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// Calls `f` on the record in `bytes` in place where it is aligned for `T`
/// (ring-buffer records are 8-byte aligned), else on a copy: a stack
/// record is up to 10 KiB, and copying it whole before copying the part
/// it holds showed in the agent's cost per stack.
fn with_record<T: Copy, R>(
    bytes: &[u8],
    kind: EventKind,
    f: impl FnOnce(&T) -> R,
) -> Result<R, DecodeError> {
    if bytes.len() >= size_of::<T>() && bytes.as_ptr().cast::<T>().is_aligned() {
        // SAFETY: length and alignment checked; the record types are plain
        // repr(C) data valid for any bit pattern, borrowed for the call.
        return Ok(f(unsafe { &*bytes.as_ptr().cast::<T>() }));
    }
    let r: T = read(bytes, kind)?;
    Ok(f(&r))
}

fn stack(bytes_or_err: i32, frames: &[u64]) -> Result<Vec<u64>, i32> {
    if bytes_or_err < 0 {
        return Err(bytes_or_err);
    }
    let n = (bytes_or_err as usize / 8).min(frames.len());
    Ok(frames[..n].iter().copied().filter(|a| *a != 0).collect())
}

/// An off-CPU stack record of any class: its length says which (each
/// class has a size of its own, and the ring gives a record's exact
/// length); any other length is malformed.
fn off_cpu_stack(bytes: &[u8], cpu: u32, ts: u64) -> Result<Event, DecodeError> {
    const S: [usize; 3] = SHORT_STACK_COPIES;
    off_cpu_class::<MAX_STACK_DEPTH, USER_STACK_COPY>(bytes, cpu, ts)
        .or_else(|| off_cpu_class::<0, { S[0] }>(bytes, cpu, ts))
        .or_else(|| off_cpu_class::<0, { S[1] }>(bytes, cpu, ts))
        .or_else(|| off_cpu_class::<0, { S[2] }>(bytes, cpu, ts))
        .ok_or(DecodeError::StackClass(bytes.len()))
}

/// The record in `bytes` if it is exactly of the class with a
/// `WALK`-frame frame-pointer walk and a `COPY`-byte stack copy.
fn off_cpu_class<const WALK: usize, const COPY: usize>(
    bytes: &[u8],
    cpu: u32,
    ts: u64,
) -> Option<Event> {
    if bytes.len() != size_of::<OffCpuStackOf<WALK, COPY>>() {
        return None;
    }
    with_record(
        bytes,
        EventKind::OffCpuStack,
        |r: &OffCpuStackOf<WALK, COPY>| {
            Event::Stack(Box::new(StackCapture {
                cpu,
                ts,
                tid: r.tid,
                tgid: r.tgid,
                kernel: stack(r.kernel_bytes, &r.kernel),
                user: stack(r.user_bytes, &r.user),
                user_copy: Some(UserCopy::decode(&r.copy)),
                record_bytes: bytes.len() as u32,
            }))
        },
    )
    .ok()
}

/// A kernel priority (0-139), saturated into what a switch holds.
fn prio(p: i32) -> i16 {
    p.clamp(i16::MIN.into(), i16::MAX.into()) as i16
}

/// Decodes one ring-buffer record.
pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    if bytes.len() < size_of::<EventHeader>() {
        return Err(DecodeError::Short(bytes.len()));
    }
    // SAFETY: length checked; EventHeader is plain data.
    let header: EventHeader = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    let kind = EventKind::from_u32(header.kind).ok_or(DecodeError::UnknownKind(header.kind))?;
    let (cpu, ts) = (header.cpu, header.ts);
    Ok(match kind {
        EventKind::SchedSwitch | EventKind::BystanderSwitch => {
            let r: SchedSwitch = read(bytes, kind)?;
            Event::Switch(Switch {
                cpu,
                ts,
                prev_tid: r.prev_tid,
                prev_tgid: r.prev_tgid,
                prev_comm: Comm(r.prev_comm),
                prev_state: r.prev_state,
                prev_prio: prio(r.prev_prio),
                next_tid: r.next_tid,
                next_tgid: r.next_tgid,
                next_comm: Comm(r.next_comm),
                next_prio: prio(r.next_prio),
                preempt: r.flags & switch_flags::PREEMPT != 0,
                prev_target: r.flags & switch_flags::PREV_TARGET != 0,
                next_target: r.flags & switch_flags::NEXT_TARGET != 0,
                stack_follows: r.flags & switch_flags::STACK_FOLLOWS != 0,
            })
        }
        EventKind::SchedWaking | EventKind::SchedWakeupNew => {
            let r: SchedWaking = read(bytes, kind)?;
            Event::Waking(Waking {
                cpu,
                ts,
                tid: r.tid,
                tgid: r.tgid,
                comm: Comm(r.comm),
                prio: r.prio,
                target_cpu: r.target_cpu,
                waker_tid: r.waker_tid,
                waker_tgid: r.waker_tgid,
                new_task: kind == EventKind::SchedWakeupNew,
            })
        }
        EventKind::ProcessFork => {
            let r: ProcessFork = read(bytes, kind)?;
            Event::Fork(Fork {
                cpu,
                ts,
                parent_tid: r.parent_tid,
                parent_tgid: r.parent_tgid,
                child_tid: r.child_tid,
                child_tgid: r.child_tgid,
                child_comm: Comm(r.child_comm),
            })
        }
        EventKind::LinkMapChange => {
            let r: LinkMapChange = read(bytes, kind)?;
            Event::LinkMap(LinkMap {
                cpu,
                ts,
                tid: r.tid,
                tgid: r.tgid,
            })
        }
        EventKind::ProcessExec => {
            let r: ProcessExec = read(bytes, kind)?;
            Event::Exec(Exec {
                cpu,
                ts,
                tid: r.tid,
                tgid: r.tgid,
                old_tid: r.old_tid,
                comm: Comm(r.comm),
            })
        }
        EventKind::ProcessExit => {
            let r: ProcessExit = read(bytes, kind)?;
            Event::Exit(Exit {
                cpu,
                ts,
                tid: r.tid,
                tgid: r.tgid,
                prio: r.prio,
                comm: Comm(r.comm),
                group_dead: r.flags & EXIT_GROUP_DEAD != 0,
                group_known: r.flags & EXIT_GROUP_KNOWN != 0,
                exit_code: (r.flags & EXIT_CODE_KNOWN != 0).then_some(r.exit_code),
            })
        }
        EventKind::TaskRename => {
            let r: TaskRename = read(bytes, kind)?;
            Event::Rename(Rename {
                cpu,
                ts,
                tid: r.tid,
                tgid: r.tgid,
                old_comm: Comm(r.old_comm),
                new_comm: Comm(r.new_comm),
            })
        }
        EventKind::OffCpuStack => off_cpu_stack(bytes, cpu, ts)?,
        EventKind::UprobeEntry => Event::ProbeEntry(Box::new(read(bytes, kind)?)),
        EventKind::UprobeReturn => Event::ProbeReturn(Box::new(read(bytes, kind)?)),
        EventKind::UprobeStack => with_record(bytes, kind, |r: &UprobeStack| {
            Event::ProbeStack(Box::new(CallStack {
                ts,
                tid: r.tid,
                tgid: r.tgid,
                probe_ip: r.probe_ip,
                user: stack(r.user_bytes, &r.user),
                user_copy: Some(UserCopy::decode(&r.copy)),
            }))
        })?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use xpuscope_common::{
        COMM_LEN, OffCpuStack, ShortOffCpuStack, USER_STACK_NOT_WALKED, UserStackCopy,
    };

    #[test]
    fn a_comm_reads_up_to_its_nul_borrowed_when_valid_replaced_when_not() {
        let mut b = [0u8; COMM_LEN];
        b[..6].copy_from_slice(b"python");
        let c = Comm(b);
        assert!(matches!(c.as_str(), std::borrow::Cow::Borrowed("python")));
        // All 16 bytes used (no NUL), and a byte that is not UTF-8.
        let mut b = [b'a'; COMM_LEN];
        b[3] = 0xff;
        assert_eq!(Comm(b).as_str(), "aaa\u{fffd}aaaaaaaaaaaa");
    }

    fn as_bytes<T>(v: &T) -> Vec<u8> {
        // SAFETY: test-only view of a plain repr(C) record.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    fn comm(s: &str) -> [u8; COMM_LEN] {
        Comm::from_str_lossy(s).0
    }

    #[test]
    fn decodes_a_switch_with_flags() {
        let rec = SchedSwitch {
            header: EventHeader {
                kind: EventKind::SchedSwitch as u32,
                cpu: 3,
                ts: 42,
            },
            prev_tid: 10,
            prev_tgid: 9,
            next_tid: 0,
            next_tgid: 0,
            prev_state: 1,
            prev_prio: 120,
            next_prio: 120,
            flags: switch_flags::PREEMPT | switch_flags::PREV_TARGET | switch_flags::STACK_FOLLOWS,
            prev_comm: comm("worker"),
            next_comm: comm("swapper/3"),
        };
        let Event::Switch(s) = decode(&as_bytes(&rec)).unwrap() else {
            panic!()
        };
        assert_eq!(
            (s.cpu, s.ts, s.prev_tid, s.prev_tgid, s.prev_state),
            (3, 42, 10, 9, 1)
        );
        assert_eq!(s.prev_comm.as_str(), "worker");
        assert_eq!(s.next_comm.as_str(), "swapper/3");
        assert!(s.preempt && s.prev_target && s.stack_follows && !s.next_target);
    }

    #[test]
    fn a_switch_between_untraced_tasks_is_a_bystander_switch() {
        let mut rec = SchedSwitch {
            header: EventHeader {
                kind: EventKind::BystanderSwitch as u32,
                cpu: 1,
                ts: 7,
            },
            prev_tid: 20,
            prev_tgid: 20,
            next_tid: 21,
            next_tgid: 20,
            prev_state: 1,
            prev_prio: 120,
            next_prio: 120,
            flags: 0,
            prev_comm: comm("ping"),
            next_comm: comm("pong"),
        };
        let event = decode(&as_bytes(&rec)).unwrap();
        assert_eq!(event.kind(), EventKind::BystanderSwitch);
        let Event::Switch(s) = event else { panic!() };
        assert_eq!(
            (s.prev_tid, s.next_tid, s.next_comm.as_str().as_ref()),
            (20, 21, "pong")
        );
        // A traced side makes it the target's own switch.
        rec.header.kind = EventKind::SchedSwitch as u32;
        rec.flags = switch_flags::NEXT_TARGET;
        assert_eq!(
            decode(&as_bytes(&rec)).unwrap().kind(),
            EventKind::SchedSwitch
        );
    }

    #[test]
    fn decodes_an_exit_and_whether_its_process_died() {
        let mut rec = ProcessExit {
            header: EventHeader {
                kind: EventKind::ProcessExit as u32,
                cpu: 2,
                ts: 99,
            },
            tid: 41,
            tgid: 40,
            prio: 120,
            flags: EXIT_GROUP_KNOWN | EXIT_GROUP_DEAD | EXIT_CODE_KNOWN,
            exit_code: 6 | 0x80,
            _pad: 0,
            comm: *b"child\0\0\0\0\0\0\0\0\0\0\0",
        };
        let Event::Exit(e) = decode(&as_bytes(&rec)).unwrap() else {
            panic!()
        };
        assert_eq!((e.cpu, e.ts, e.tid, e.tgid, e.prio), (2, 99, 41, 40, 120));
        assert_eq!(e.comm.as_str(), "child");
        assert!(e.group_dead && e.ends_process());
        assert_eq!(e.killed_by(), Some(6), "SIGABRT, core dumped");
        rec.flags = EXIT_GROUP_KNOWN;
        let Event::Exit(e) = decode(&as_bytes(&rec)).unwrap() else {
            panic!()
        };
        assert!(!e.group_dead, "another thread of a live process");
        assert_eq!(e.exit_code, None, "the code is valid only with its flag");
        assert!(!e.ends_process());
        // An older kernel does not say: the main thread's exit ends it.
        rec.flags = 0;
        rec.tid = rec.tgid;
        let Event::Exit(e) = decode(&as_bytes(&rec)).unwrap() else {
            panic!()
        };
        assert!(e.ends_process());
        // The flag sits where the padding was: the ABI's size is unchanged.
        assert_eq!(std::mem::offset_of!(ProcessExit, flags), 28);
        assert_eq!(size_of::<ProcessExit>(), 56);
    }

    #[test]
    fn decodes_stacks_and_errors() {
        let mut rec = OffCpuStack {
            header: EventHeader {
                kind: EventKind::OffCpuStack as u32,
                cpu: 1,
                ts: 7,
            },
            tid: 5,
            tgid: 5,
            kernel_bytes: 16,
            user_bytes: -14,
            kernel: [0; MAX_STACK_DEPTH],
            user: [0; MAX_STACK_DEPTH],
            copy: UserStackCopy {
                ip: 0x4000,
                sp: 0x7ff0_0000,
                bp: 0x7ff0_0040,
                stack_len: 2048,
                returns_len: 0,
                returns: [[0; 2]; MAX_PENDING_RETURNS],
                stack: [0xab; USER_STACK_COPY],
            },
        };
        rec.kernel[0] = 0xffff_ffff_8100_0000;
        rec.kernel[1] = 0xffff_ffff_8100_0100;
        rec.kernel[2] = 0xdead; // beyond kernel_bytes: ignored
        let Event::Stack(s) = decode(&as_bytes(&rec)).unwrap() else {
            panic!()
        };
        assert_eq!(
            s.kernel,
            Ok(vec![0xffff_ffff_8100_0000, 0xffff_ffff_8100_0100])
        );
        assert_eq!(s.user, Err(-14));
        let copy = s.user_copy.as_ref().expect("a stack copy");
        assert_eq!(
            (copy.ip, copy.sp, copy.bp),
            (0x4000, 0x7ff0_0000, 0x7ff0_0040)
        );
        assert_eq!(copy.stack, Ok(vec![0xab; 2048]), "only the bytes copied");
        assert_eq!(s.record_bytes as usize, size_of::<OffCpuStack>());
        // A record not aligned for its type (not from a ring buffer, whose
        // records are) decodes the same, from a copy.
        let mut unaligned = vec![0u8; 1];
        unaligned.extend(as_bytes(&rec));
        let Event::Stack(u) = decode(&unaligned[1..]).unwrap() else {
            panic!()
        };
        assert_eq!(
            (&u.kernel, &u.user, &u.user_copy.as_ref().unwrap().stack),
            (&s.kernel, &s.user, &copy.stack)
        );

        // Two pending return-probed calls: their real return addresses go
        // back into their slots; a slot outside the copy (or a count past
        // the array: a kernel bug) changes nothing.
        rec.copy.returns_len = 7;
        rec.copy.returns = [
            [0x7ff0_0010, 0x5555_1234],
            [0x7ff0_0100, 0x5555_5678],
            [0x7fef_0000, 0x1],
            [0x7ff0_0000 + 2048 - 4, 0x2],
        ];
        let Event::Stack(s) = decode(&as_bytes(&rec)).unwrap() else {
            panic!()
        };
        let stack = s.user_copy.unwrap().stack.unwrap();
        let word = |at: usize| u64::from_le_bytes(stack[at..at + 8].try_into().unwrap());
        assert_eq!((word(0x10), word(0x100)), (0x5555_1234, 0x5555_5678));
        let mut rest = stack.clone();
        rest[0x10..0x18].fill(0xab);
        rest[0x100..0x108].fill(0xab);
        assert_eq!(rest, vec![0xab; 2048], "nothing else changed");
        rec.copy.returns_len = 0;

        rec.copy.stack_len = -14;
        let Event::Stack(s) = decode(&as_bytes(&rec)).unwrap() else {
            panic!()
        };
        assert_eq!(s.user_copy.unwrap().stack, Err(-14));
        // A length beyond the buffer (a kernel bug) is capped, not trusted.
        rec.copy.stack_len = i32::MAX;
        let Event::Stack(s) = decode(&as_bytes(&rec)).unwrap() else {
            panic!()
        };
        assert_eq!(s.user_copy.unwrap().stack.unwrap().len(), USER_STACK_COPY);
    }

    /// A short-class record as the kernel pushes it: the copy reached the
    /// learned end (`stack_len` bytes of `0xcd`), no frame-pointer walk.
    fn short_stack<const COPY: usize>(stack_len: i32) -> ShortOffCpuStack<COPY> {
        let mut rec = ShortOffCpuStack::<COPY> {
            header: EventHeader {
                kind: EventKind::OffCpuStack as u32,
                cpu: 2,
                ts: 11,
            },
            tid: 6,
            tgid: 5,
            kernel_bytes: 8,
            user_bytes: USER_STACK_NOT_WALKED,
            kernel: [0; MAX_STACK_DEPTH],
            user: [],
            copy: UserStackCopyOf {
                ip: 0x4100,
                sp: 0x7ff0_1000,
                bp: 0,
                stack_len,
                returns_len: 1,
                returns: [[0; 2]; MAX_PENDING_RETURNS],
                stack: [0xcd; COPY],
            },
        };
        rec.kernel[0] = 0xffff_ffff_8100_0200;
        // A pending return-probed call in the last slot of the copy.
        rec.copy.returns[0] = [0x7ff0_1000 + COPY as u64 - 8, 0x5555_0001];
        rec
    }

    /// Decodes a short record of class `COPY` whole, unaligned, and with a
    /// `stack_len` beyond its buffer.
    fn check_short_class<const COPY: usize>() {
        let rec = short_stack::<COPY>(COPY as i32);
        let bytes = as_bytes(&rec);
        assert_eq!(bytes.len(), 32 + 8 * MAX_STACK_DEPTH + 96 + COPY);
        let Event::Stack(s) = decode(&bytes).unwrap() else {
            panic!("class {COPY}: not a stack")
        };
        assert_eq!((s.cpu, s.ts, s.tid, s.tgid), (2, 11, 6, 5));
        assert_eq!(s.record_bytes as usize, bytes.len());
        assert_eq!(s.kernel, Ok(vec![0xffff_ffff_8100_0200]));
        assert_eq!(s.user, Err(USER_STACK_NOT_WALKED));
        let copy = s.user_copy.as_ref().unwrap();
        assert_eq!((copy.ip, copy.sp), (0x4100, 0x7ff0_1000));
        let mut want = vec![0xcd; COPY];
        want[COPY - 8..].copy_from_slice(&0x5555_0001u64.to_le_bytes());
        assert_eq!(copy.stack, Ok(want), "class {COPY}");
        assert_eq!(copy.restored_returns, 1);
        let mut unaligned = vec![0u8; 1];
        unaligned.extend(&bytes);
        assert_eq!(decode(&unaligned[1..]).unwrap(), Event::Stack(s));

        // Less than the class copied (the stack ends within it).
        let half = short_stack::<COPY>(COPY as i32 / 2);
        let Event::Stack(s) = decode(&as_bytes(&half)).unwrap() else {
            panic!()
        };
        assert_eq!(s.user_copy.unwrap().stack, Ok(vec![0xcd; COPY / 2]));
        // A length beyond the class's buffer (a kernel bug, or a full
        // record's length in a short one) never reads past the record.
        for len in [COPY as i32 + 1, USER_STACK_COPY as i32, i32::MAX] {
            let Event::Stack(s) = decode(&as_bytes(&short_stack::<COPY>(len))).unwrap() else {
                panic!()
            };
            assert_eq!(s.user_copy.unwrap().stack.unwrap().len(), COPY);
        }
        // A frame count in a record without a walk yields no frames.
        let mut walked = short_stack::<COPY>(0);
        walked.user_bytes = 64;
        let Event::Stack(s) = decode(&as_bytes(&walked)).unwrap() else {
            panic!()
        };
        assert_eq!(s.user, Ok(vec![]));
    }

    #[test]
    fn decodes_every_short_stack_class() {
        const S: [usize; 3] = SHORT_STACK_COPIES;
        check_short_class::<{ S[0] }>();
        check_short_class::<{ S[1] }>();
        check_short_class::<{ S[2] }>();
        // Every class, the full one included, has a size of its own.
        let mut sizes = vec![
            size_of::<ShortOffCpuStack<{ S[0] }>>(),
            size_of::<ShortOffCpuStack<{ S[1] }>>(),
            size_of::<ShortOffCpuStack<{ S[2] }>>(),
            size_of::<OffCpuStack>(),
        ];
        sizes.dedup();
        assert_eq!(sizes.len(), 4);
        assert!(sizes.is_sorted());
    }

    #[test]
    fn rejects_stack_records_of_no_class() {
        let short = as_bytes(&short_stack::<{ SHORT_STACK_COPIES[0] }>(64));
        let full_len = size_of::<OffCpuStack>();
        let mut full = short.clone();
        full.resize(full_len, 0);
        // Truncated, or with bytes to spare: neither is any class.
        for bytes in [
            &short[..short.len() - 8],
            &short[..size_of::<EventHeader>()],
            &full[..full_len - 1],
        ] {
            assert_eq!(decode(bytes), Err(DecodeError::StackClass(bytes.len())));
        }
        let mut long = short.clone();
        long.extend([0; 8]);
        assert_eq!(decode(&long), Err(DecodeError::StackClass(long.len())));
        long.resize(full_len + 8, 0);
        assert_eq!(decode(&long), Err(DecodeError::StackClass(long.len())));
    }

    #[test]
    fn mutated_stack_records_never_read_past_their_bytes() {
        let mut m = crate::service::fuzzing::Mutator::new(0x57ac_c1a5);
        let seeds = [
            as_bytes(&short_stack::<{ SHORT_STACK_COPIES[0] }>(1024)),
            as_bytes(&short_stack::<{ SHORT_STACK_COPIES[1] }>(2048)),
            as_bytes(&short_stack::<{ SHORT_STACK_COPIES[2] }>(4096)),
        ];
        let mut decoded = 0;
        for round in 0..3000 {
            let seed = &seeds[round % seeds.len()];
            let mut bytes = m.mutate(seed);
            // Also corrupt the lengths the decoder trusts least: the copy's
            // `stack_len` and `returns_len`, and the two frame counts.
            if round % 2 == 0 && bytes.len() >= seed.len() {
                let at = [
                    24,
                    28,
                    32 + 8 * MAX_STACK_DEPTH + 24,
                    32 + 8 * MAX_STACK_DEPTH + 28,
                ][round / 2 % 4];
                bytes[at..at + 4].copy_from_slice(&(round as i32 * 997).to_le_bytes());
            }
            let Ok(Event::Stack(s)) = decode(&bytes) else {
                continue;
            };
            decoded += 1;
            if let Some(Ok(stack)) = s.user_copy.map(|c| c.stack) {
                assert!(stack.len() + 32 + 8 * MAX_STACK_DEPTH + 96 <= bytes.len());
            }
            for frames in [s.kernel, s.user].into_iter().flatten() {
                assert!(frames.len() <= MAX_STACK_DEPTH);
            }
        }
        assert!(
            decoded > 100,
            "the mutations kept some records whole: {decoded}"
        );
    }

    #[test]
    fn decodes_a_link_map_change() {
        let rec = LinkMapChange {
            header: EventHeader {
                kind: EventKind::LinkMapChange as u32,
                cpu: 1,
                ts: 99,
            },
            tid: 7,
            tgid: 5,
        };
        let e = decode(&as_bytes(&rec)).unwrap();
        assert_eq!(
            e,
            Event::LinkMap(LinkMap {
                cpu: 1,
                ts: 99,
                tid: 7,
                tgid: 5
            })
        );
        assert_eq!((e.kind(), e.ts()), (EventKind::LinkMapChange, 99));
        assert!(matches!(
            decode(&as_bytes(&rec)[..20]),
            Err(DecodeError::Size { want: 24, .. })
        ));
    }

    #[test]
    fn rejects_short_and_unknown_records() {
        assert_eq!(decode(&[0; 4]), Err(DecodeError::Short(4)));
        let mut bytes = as_bytes(&EventHeader {
            kind: 99,
            cpu: 0,
            ts: 0,
        });
        assert_eq!(decode(&bytes), Err(DecodeError::UnknownKind(99)));
        bytes = as_bytes(&EventHeader {
            kind: EventKind::TaskRename as u32,
            cpu: 0,
            ts: 0,
        });
        assert!(matches!(
            decode(&bytes),
            Err(DecodeError::Size {
                kind: EventKind::TaskRename,
                ..
            })
        ));
    }

    #[test]
    fn comm_handles_full_and_invalid_names() {
        let full = Comm(*b"0123456789abcdef");
        assert_eq!(full.as_str(), "0123456789abcdef");
        let mut bad = [0u8; COMM_LEN];
        bad[..3].copy_from_slice(&[0x66, 0xff, 0x67]);
        assert_eq!(Comm(bad).as_str(), "f\u{fffd}g");
    }
}
