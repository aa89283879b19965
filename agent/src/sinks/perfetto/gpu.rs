//! GPU health on the trace: a top-level track per GPU (`GPU 0`, its model
//! and UUID in the description) with three counters under it (SM clock
//! MHz, utilization %, memory used), a `gpu sample` instant per sample
//! holding every reading with the GPU's pids and ranks (what `agent
//! diagnose` reads back), a `clocks slowed: <reasons>` slice while its
//! clock is slowed for a reason that is not idleness or a setting, and an
//! `Xid N` instant per Xid error.

use std::collections::HashMap;
use std::io::Write;

use anyhow::Result;
use xpuscope_perfetto::{Arg, CounterUnit, TrackUuid};

use super::PerfettoSink;
use crate::model::RankIdentity;
use crate::model::gpu::{GpuSample, GpuXid, reason_names};
use crate::trace_schema::keys as k;
use crate::trace_schema::names as n;

/// One GPU's tracks.
struct Gpu {
    track: TrackUuid,
    sm_clock: TrackUuid,
    utilization: TrackUuid,
    memory: TrackUuid,
    /// The slowdown reasons of the slice open now (0: none open).
    slowed: u64,
}

/// The GPUs' tracks and the ranks of the processes seen (dropped at their
/// exit).
#[derive(Default)]
pub(super) struct GpuTracks {
    gpus: HashMap<u32, Gpu>,
    ranks: HashMap<u32, String>,
}

impl GpuTracks {
    pub(super) fn identity(&mut self, tgid: u32, id: &RankIdentity) {
        if let Some(rank) = &id.rank {
            self.ranks.insert(tgid, rank.clone());
        }
    }

    pub(super) fn process_ended(&mut self, tgid: u32) {
        self.ranks.remove(&tgid);
    }

    /// The known ranks of `pids`, comma-separated.
    fn ranks_of(&self, pids: &[u32]) -> String {
        pids.iter()
            .filter_map(|p| self.ranks.get(p).map(String::as_str))
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn joined(pids: &[u32]) -> String {
    pids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

impl<W: Write> PerfettoSink<W> {
    fn gpu_tracks(&mut self, s: &GpuSample) -> Result<&mut Gpu> {
        if !self.gpus.gpus.contains_key(&s.gpu) {
            let name = n::gpu_track(s.gpu);
            let description = format!("{} {}", s.name, s.uuid);
            let track = self
                .writer
                .custom_track(None, &name, Some(description.trim()))?;
            let sm_clock = self.writer.counter_track(
                Some(track),
                &format!("{name}{}", n::GPU_SM_CLOCK_TRACK),
                CounterUnit::Other("MHz".into()),
            )?;
            let utilization = self.writer.counter_track(
                Some(track),
                &format!("{name}{}", n::GPU_UTILIZATION_TRACK),
                CounterUnit::Other("%".into()),
            )?;
            let memory = self.writer.counter_track(
                Some(track),
                &format!("{name}{}", n::GPU_MEMORY_TRACK),
                CounterUnit::SizeBytes,
            )?;
            self.gpus.gpus.insert(
                s.gpu,
                Gpu {
                    track,
                    sm_clock,
                    utilization,
                    memory,
                    slowed: 0,
                },
            );
        }
        Ok(self
            .gpus
            .gpus
            .get_mut(&s.gpu)
            .expect("inserted above when absent"))
    }

    pub(super) fn gpu_sample(&mut self, s: &GpuSample) -> Result<()> {
        let ranks = self.gpus.ranks_of(&s.pids);
        let g = self.gpu_tracks(s)?;
        let (track, sm, util, mem, was) = (g.track, g.sm_clock, g.utilization, g.memory, g.slowed);
        let slowed = s.slowdown_reasons();
        g.slowed = slowed;
        let mut args: Vec<Arg> = vec![
            k::GPU.arg(u64::from(s.gpu)),
            k::GPU_NAME.arg(s.name.as_str()),
            k::GPU_UUID.arg(s.uuid.as_str()),
            k::GPU_PIDS.arg(joined(&s.pids)),
            k::RANKS.arg(ranks),
        ];
        let mut opt = |key: crate::trace_schema::Key<crate::trace_schema::Uint>, v: Option<u64>| {
            if let Some(v) = v {
                args.push(key.arg(v));
            }
        };
        opt(k::SM_CLOCK_MHZ, s.sm_clock_mhz.map(u64::from));
        opt(k::MAX_SM_CLOCK_MHZ, s.max_sm_clock_mhz.map(u64::from));
        opt(k::CLOCK_EVENT_REASONS, s.clock_event_reasons);
        opt(k::UTILIZATION_PCT, s.utilization_pct.map(u64::from));
        opt(k::MEMORY_USED_BYTES, s.memory_used_bytes);
        opt(k::MEMORY_TOTAL_BYTES, s.memory_total_bytes);
        opt(k::ECC_UNCORRECTED, s.ecc_uncorrected);
        if let Some(bits) = s.clock_event_reasons {
            args.push(k::REASONS.arg(reason_names(bits)));
        }
        self.writer
            .instant(track, s.ts, n::GPU_SAMPLE_EVENT, &args, None)?;
        if let Some(mhz) = s.sm_clock_mhz {
            self.writer.counter(sm, s.ts, f64::from(mhz))?;
        }
        if let Some(pct) = s.utilization_pct {
            self.writer.counter(util, s.ts, f64::from(pct))?;
        }
        if let Some(used) = s.memory_used_bytes {
            self.writer.counter(mem, s.ts, used as f64)?;
        }
        if slowed != was {
            if was != 0 {
                self.writer.slice_end(track, s.ts, &[])?;
            }
            if slowed != 0 {
                let name = format!("{}{}", n::GPU_SLOWED_EVENT, reason_names(slowed));
                let args = [k::CLOCK_EVENT_REASONS.arg(slowed)];
                self.writer
                    .slice_begin(track, s.ts, &name, None, &args, &[], None)?;
            }
        }
        Ok(())
    }

    pub(super) fn gpu_xid(&mut self, x: &GpuXid) -> Result<()> {
        // An Xid before any sample of its GPU: its track from what is known.
        let track = match self.gpus.gpus.get(&x.gpu) {
            Some(g) => g.track,
            None => {
                self.gpu_tracks(&GpuSample {
                    gpu: x.gpu,
                    ..GpuSample::default()
                })?
                .track
            }
        };
        let args = [
            k::GPU.arg(u64::from(x.gpu)),
            k::XID.arg(x.xid),
            k::GPU_PIDS.arg(joined(&x.pids)),
            k::RANKS.arg(self.gpus.ranks_of(&x.pids)),
        ];
        self.writer.instant(
            track,
            x.ts,
            &format!("{}{}", n::GPU_XID_EVENT, x.xid),
            &args,
            None,
        )?;
        Ok(())
    }

    /// Ends the slowed-clock slices still open.
    pub(super) fn gpus_finish(&mut self, end: u64) -> Result<()> {
        for g in self.gpus.gpus.values_mut() {
            if g.slowed != 0 {
                self.writer.slice_end(g.track, end, &[])?;
                g.slowed = 0;
            }
        }
        Ok(())
    }
}
