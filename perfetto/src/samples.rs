//! Callstack samples (off-CPU stacks) as `StackSample` or `PerfSample`
//! packets, see [`crate::SampleFormat`].

use std::io::{self, Write};

use crate::TraceWriter;
use crate::proto;
use crate::sched::MAX_CPUS;
use crate::types::{Frame, SampleFormat};

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
        if cpu >= MAX_CPUS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cpu {cpu} is not below {MAX_CPUS}"),
            ));
        }
        let callstack_iid = self.seq.interner.callstack(frames);
        // Off-CPU stacks with kernel frames stopped in the kernel.
        let in_kernel = (!frames.is_empty()).then(|| frames.iter().any(|f| f.mapping.is_kernel()));
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
