//! Callstack samples (off-CPU stacks) as `StackSample` or `PerfSample`
//! packets, see [`crate::SampleFormat`].

use std::io::{self, Write};

use crate::TraceWriter;
use crate::proto;
use crate::sched::MAX_CPUS;
use crate::types::{Frame, SampleFormat};

/// A callstack interned by one [`TraceWriter`] (see
/// [`TraceWriter::intern_callstack`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InternedCallstack {
    /// `None` for a stack without frames.
    iid: Option<u64>,
    /// Whether the stack has kernel frames (`None`: no frames).
    in_kernel: Option<bool>,
}

impl InternedCallstack {
    /// A stack without frames (its samples are not written).
    pub fn is_empty(&self) -> bool {
        self.iid.is_none()
    }
}

impl<W: Write> TraceWriter<W> {
    /// One callstack sample of thread `tid` (process `pid`) at `ts`, taken on
    /// `cpu`, that stands for `weight_ns` nanoseconds off CPU.
    ///
    /// `frames` are leaf first, user and kernel parts each innermost first
    /// (see [`Frame`]); they are interned and written root first.
    ///
    /// With [`SampleFormat::StackSample`] (the default) `weight_ns` is the
    /// sample's `primary_weight` for the sequence's "off-cpu time" counter
    /// (unit ns), which Perfetto v58+ sums in area-selection flamegraphs
    /// ("… Samples (off-cpu time)"), next to a plain sample count.
    /// With [`SampleFormat::PerfSample`] it is added to the CPU's cumulative
    /// `timebase_count`; Perfetto then only counts samples.
    pub fn stack_sample(
        &mut self,
        ts: u64,
        cpu: u32,
        pid: i32,
        tid: i32,
        frames: &[Frame],
        weight_ns: u64,
    ) -> io::Result<()> {
        let callstack = self.intern_callstack(frames);
        self.interned_stack_sample(ts, cpu, pid, tid, callstack, weight_ns)
    }

    /// Interns the callstack of `frames` (as [`Self::stack_sample`] does):
    /// the id stays valid for this writer's life, so a caller that sees
    /// the same stack again can write its samples with
    /// [`Self::interned_stack_sample`] without converting its frames again.
    pub fn intern_callstack(&mut self, frames: &[Frame]) -> InternedCallstack {
        InternedCallstack {
            iid: self.seq.interner.callstack(frames),
            // Off-CPU stacks with kernel frames stopped in the kernel.
            in_kernel: (!frames.is_empty()).then(|| frames.iter().any(|f| f.mapping.is_kernel())),
        }
    }

    /// [`Self::stack_sample`] of a callstack interned before by this writer.
    pub fn interned_stack_sample(
        &mut self,
        ts: u64,
        cpu: u32,
        pid: i32,
        tid: i32,
        callstack: InternedCallstack,
        weight_ns: u64,
    ) -> io::Result<()> {
        if cpu >= MAX_CPUS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cpu {cpu} is not below {MAX_CPUS}"),
            ));
        }
        let InternedCallstack {
            iid: callstack_iid,
            in_kernel,
        } = callstack;
        let mut p = self.seq.packet(Some(ts), true);
        match self.sample_format {
            SampleFormat::StackSample => {
                p.stack_sample = Some(proto::StackSample {
                    task_context: Some(proto::SampleTaskContext {
                        pid: Some(pid as u32),
                        tid: Some(tid as u32),
                    }),
                    execution_context: Some(proto::SampleExecutionContext {
                        cpu: Some(cpu),
                        mode: in_kernel.map(|k| {
                            if k {
                                proto::SAMPLE_MODE_KERNEL
                            } else {
                                proto::SAMPLE_MODE_USER
                            }
                        }),
                    }),
                    callstack_iid,
                    primary_weight: Some(weight_ns),
                });
            }
            SampleFormat::PerfSample => {
                let idx = cpu as usize;
                if idx >= self.perf_timebase.len() {
                    self.perf_timebase.resize(idx + 1, 0);
                }
                self.perf_timebase[idx] = self.perf_timebase[idx].saturating_add(weight_ns);
                p.perf_sample = Some(proto::PerfSample {
                    cpu: Some(cpu),
                    pid: Some(pid as u32),
                    tid: Some(tid as u32),
                    callstack_iid,
                    cpu_mode: in_kernel.map(|k| {
                        if k {
                            proto::CPU_MODE_KERNEL
                        } else {
                            proto::CPU_MODE_USER
                        }
                    }),
                    timebase_count: Some(self.perf_timebase[idx]),
                });
            }
        }
        self.sink.write(&mut p)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::types::Mapping;
    use crate::{Frame, TraceWriter};

    fn frames() -> Vec<Frame> {
        let lib = Arc::new(Mapping {
            path: "/usr/lib/libc.so.6".into(),
            start: 0x7000,
            end: 0x9000,
            ..Mapping::default()
        });
        vec![
            Frame::kernel("schedule", 0xffff_ffff_8100_0010),
            Frame::new("read", lib.clone(), 0x100),
            Frame::new("main", lib, 0x200),
        ]
    }

    /// A sample of a callstack interned once writes the same bytes as one
    /// that interns its frames itself, for the first sample of a stack and
    /// for the next.
    #[test]
    fn an_interned_callstack_writes_what_its_frames_would() {
        let mut by_frames = TraceWriter::new(Vec::new());
        let mut by_id = TraceWriter::new(Vec::new());
        let stack = by_id.intern_callstack(&frames());
        assert!(!stack.is_empty());
        for (ts, weight) in [(1_000, 50), (2_000, 70)] {
            by_frames
                .stack_sample(ts, 1, 10, 11, &frames(), weight)
                .unwrap();
            by_id
                .interned_stack_sample(ts, 1, 10, 11, stack, weight)
                .unwrap();
        }
        assert!(by_id.intern_callstack(&[]).is_empty());
        let (a, b) = (by_frames.finish().unwrap(), by_id.finish().unwrap());
        assert!(!a.is_empty());
        assert_eq!(a, b);
    }
}
