//! Python frames in user stacks: for a thread of a CPython process
//! (3.10 and later), its Python frames (function, file, line) read from the
//! process's memory (`xpuscope_probes::python`) and put in place of the
//! interpreter's evaluation frames of the native stack ("mixed" stacks, as
//! py-spy `--native` shows them).
//!
//! When: as the pipeline enriches an off-CPU stack, milliseconds after the
//! thread left its CPU. A thread blocked that long (a sleep, a lock, a
//! collective's sync: the waits worth naming) still has those frames; one
//! that already ran again may show newer ones, which the interleave keeps
//! only where the native stack has evaluation frames for them.
//! Allocation stacks stay native: they are interned per native stack, and
//! one native stack serves many Python callers.
//!
//! A process is looked at once, at its first stack (not at exec: a
//! launcher's children exec python only later); one that is not CPython
//! costs that look, cached. Forgotten at exit (pids are reused).

use std::sync::Arc;
use std::time::Instant;

use xpuscope_probes::bounds::CacheStats;
use xpuscope_probes::python::{
    CodeCacheBounds, MixedFrame, PyError, PyFrame, PythonProcesses, StepLocal, interleave, step_of,
};

use crate::model::SymFrame;

use crate::model::stack::PYTHON_MODULE_PREFIX;

/// How one stack went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PyOutcome {
    /// Not a Python process, or a native stack without evaluation frames:
    /// decided by the addresses alone (the same addresses say it again).
    Native,
    /// Evaluation frames in the native stack, but the thread showed no
    /// Python frames when read (it moved on): native now, not always.
    NoPythonNow,
    /// Python frames were interleaved; the step counter they showed.
    Mixed(Option<StepLocal>),
    /// The frames could not be read (the native stack stands).
    Failed,
}

#[derive(Default)]
pub struct PythonStacks {
    procs: PythonProcesses,
    /// Time spent reading Python frames, for the summary.
    pub read_ns: u64,
    pub reads: u64,
}

impl PythonStacks {
    /// Code caches within the default bounds, counting into `stats`.
    pub fn with_stats(stats: Arc<CacheStats>) -> Self {
        Self {
            procs: PythonProcesses::with_bounds(CodeCacheBounds::default(), stats),
            ..Self::default()
        }
    }

    /// `native` symbolized (`frames`, one per address, leaf first) with
    /// thread `tid`'s Python frames in place of its evaluation frames.
    pub fn mix(
        &mut self,
        tgid: u32,
        tid: u32,
        native: &[u64],
        frames: Vec<SymFrame>,
    ) -> (Vec<SymFrame>, PyOutcome) {
        let mixed = self.mix_frames(tgid, tid, native, frames);
        // What the read cached counts against every process's total now,
        // not at the next stack.
        self.procs.trim();
        mixed
    }

    fn mix_frames(
        &mut self,
        tgid: u32,
        tid: u32,
        native: &[u64],
        frames: Vec<SymFrame>,
    ) -> (Vec<SymFrame>, PyOutcome) {
        if frames.len() != native.len() {
            return (frames, PyOutcome::Native);
        }
        let proc = match self.procs.get(tgid) {
            Ok(Some(p)) => p,
            Ok(None) => return (frames, PyOutcome::Native),
            Err(e) => {
                // Once per process (its failure is cached): an interpreter
                // whose layout is not known says so, where frames would be
                // wrong; a read that failed (it exited) is routine.
                if matches!(
                    e,
                    PyError::LayoutNotUnderstood { .. }
                        | PyError::Unsupported { .. }
                        | PyError::NoVersion { .. }
                ) {
                    tracing::warn!("pid {tgid}: no Python frames: {e}");
                } else {
                    tracing::debug!("python frames of pid {tgid}: {e}");
                }
                return (frames, PyOutcome::Failed);
            }
        };
        if !native
            .iter()
            .any(|a| proc.is_eval_frame(a.saturating_sub(1)))
        {
            return (frames, PyOutcome::Native);
        }
        let started = Instant::now();
        let py = proc.frames(tid);
        self.read_ns += started.elapsed().as_nanos() as u64;
        self.reads += 1;
        let py = match py {
            Ok(py) if !py.is_empty() => py,
            Ok(_) => return (frames, PyOutcome::NoPythonNow),
            Err(e) => {
                tracing::debug!("python frames of thread {tid}: {e}");
                return (frames, PyOutcome::Failed);
            }
        };
        // A return address points after the call: the frame is the byte
        // before it (an eval function ending in a call would else miss).
        let step = step_of(&py);
        let mixed = interleave(native, &py, |a| proc.is_eval_frame(a.saturating_sub(1)));
        let by_addr: Vec<(u64, SymFrame)> = native.iter().copied().zip(frames).collect();
        let mut next = 0;
        let out = mixed
            .into_iter()
            .map(|m| match m {
                MixedFrame::Native(addr) => {
                    // In order: the interleave keeps the natives' order.
                    while next < by_addr.len() && by_addr[next].0 != addr {
                        next += 1;
                    }
                    let f = by_addr[next.min(by_addr.len() - 1)].1.clone();
                    next += 1;
                    f
                }
                MixedFrame::Python(f) => python_frame(&f),
            })
            .collect();
        (out, PyOutcome::Mixed(step))
    }

    /// Thread `tid`'s Python frames as they are now, innermost first.
    pub fn frames_now(&mut self, tgid: u32, tid: u32) -> Option<Vec<SymFrame>> {
        let proc = self.procs.get(tgid).ok()??;
        let started = Instant::now();
        let py = proc.frames(tid);
        self.read_ns += started.elapsed().as_nanos() as u64;
        self.reads += 1;
        self.procs.trim();
        let py = py.ok().filter(|p| !p.is_empty())?;
        Some(py.iter().map(python_frame).collect())
    }

    pub fn forget(&mut self, tgid: u32) {
        self.procs.forget(tgid);
    }
}

/// `forward (model.py:12)` in mapping `[python] /path/model.py`.
pub fn python_frame(f: &PyFrame) -> SymFrame {
    let base = f.file.rsplit('/').next().unwrap_or(&f.file);
    let function = match f.line {
        Some(line) => format!("{} ({base}:{line})", f.function),
        None => format!("{} ({base})", f.function),
    };
    SymFrame {
        function: Arc::from(function),
        module: Arc::from(format!("{PYTHON_MODULE_PREFIX}{}", f.file)),
        module_start: 0,
        module_end: 0,
        module_offset: 0,
        rel_pc: f.line.map_or(0, u64::from),
    }
}
