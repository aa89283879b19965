//! Device health on the trace: a top-level track per GPU (`GPU 0`, its
//! model and UUID in the description) or Ascend NPU (`NPU 0`, its chip and
//! card/device) with three counters under it (SM clock or AI Core
//! frequency MHz, utilization %, memory used), a `gpu sample` instant per
//! sample holding every reading with the device's pids and ranks (what
//! `agent diagnose` reads back), a `clocks slowed: <reasons>` slice while a
//! GPU's clock is slowed for a reason that is not idleness or a setting,
//! and an instant per device error (`Xid N`, `error code 0x...`).

use std::collections::HashMap;
use std::io::Write;

use anyhow::Result;
use xpuscope_perfetto::{Arg, CounterUnit, TrackUuid};

use super::PerfettoSink;
use crate::model::RankIdentity;
use crate::model::gpu::{GpuSample, GpuXid, Vendor, reason_names};
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
    gpus: HashMap<(Vendor, u32), Gpu>,
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
        let key = (s.vendor, s.gpu);
        if !self.gpus.gpus.contains_key(&key) {
            let name = n::gpu_track(s.vendor, s.gpu);
            let clock_name = match s.vendor {
                Vendor::Nvidia => n::GPU_SM_CLOCK_TRACK,
                Vendor::Ascend => n::NPU_FREQUENCY_TRACK,
            };
            let description = format!("{} {}", s.name, s.uuid);
            let track = self
                .writer
                .custom_track(None, &name, Some(description.trim()))?;
            let sm_clock = self.writer.counter_track(
                Some(track),
                &format!("{name}{clock_name}"),
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
                key,
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
            .get_mut(&key)
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
        opt(k::HEALTH, s.health.map(u64::from));
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
        let track = match self.gpus.gpus.get(&(x.vendor, x.gpu)) {
            Some(g) => g.track,
            None => {
                self.gpu_tracks(&GpuSample {
                    vendor: x.vendor,
                    gpu: x.gpu,
                    ..GpuSample::default()
                })?
                .track
            }
        };
        let code = match x.vendor {
            Vendor::Nvidia => k::XID.arg(x.xid),
            Vendor::Ascend => k::ERROR_CODE.arg(x.xid),
        };
        let args = [
            k::GPU.arg(u64::from(x.gpu)),
            code,
            k::GPU_PIDS.arg(joined(&x.pids)),
            k::RANKS.arg(self.gpus.ranks_of(&x.pids)),
        ];
        self.writer.instant(
            track,
            x.ts,
            &n::gpu_error_event(x.vendor, x.xid),
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

#[cfg(test)]
mod tests {
    use xpuscope_perfetto::{SystemInfo, TraceWriter};
    use xpuscope_tests::trace_check::{Timeline, TrackKind, check_importer_rules, decode};

    use super::*;
    use crate::model::Record;
    use crate::sinks::SinkCounters;
    use crate::trace_schema::read::TraceRecords;

    fn sample(ts: u64, gpu: u32, mhz: u32, reasons: u64) -> GpuSample {
        GpuSample {
            ts,
            vendor: Vendor::Nvidia,
            gpu,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: format!("GPU-{gpu}"),
            sm_clock_mhz: Some(mhz),
            max_sm_clock_mhz: Some(1980),
            clock_event_reasons: Some(reasons),
            utilization_pct: Some(90),
            memory_used_bytes: Some(1 << 30),
            memory_total_bytes: Some(80 << 30),
            ecc_uncorrected: Some(0),
            health: None,
            pids: vec![4242],
        }
    }

    /// An Ascend NPU's sample, as DCMI's reader makes it.
    fn npu_sample(ts: u64, npu: u32, mhz: u32) -> GpuSample {
        GpuSample {
            ts,
            vendor: Vendor::Ascend,
            gpu: npu,
            name: "Ascend 910B3".into(),
            uuid: format!("card {npu} device 0"),
            sm_clock_mhz: Some(mhz),
            max_sm_clock_mhz: Some(1800),
            clock_event_reasons: None,
            utilization_pct: Some(90),
            memory_used_bytes: Some(1 << 30),
            memory_total_bytes: Some(64 << 30),
            ecc_uncorrected: None,
            health: Some(0),
            pids: vec![4242],
        }
    }

    /// A trace of two GPUs' samples (GPU 1 slowed from the second) and an
    /// Xid, with the process on GPU 1 as rank 1.
    fn trace() -> (Vec<u8>, Vec<Record>) {
        let mut sink = PerfettoSink::new(TraceWriter::new(Vec::new()));
        sink.writer()
            .system_info(&SystemInfo {
                sysname: "Linux".into(),
                release: "6.18.0".into(),
                machine: "x86_64".into(),
                num_cpus: 2,
                ..SystemInfo::default()
            })
            .unwrap();
        let mut records = vec![Record::Identity {
            tgid: 4242,
            identity: Box::new(RankIdentity {
                rank: Some("1".into()),
                ..RankIdentity::default()
            }),
        }];
        for t in 0..3u64 {
            let ts = 1_000_000_000 * (t + 1);
            records.push(Record::GpuSample(Box::new(sample(ts, 0, 1980, 0))));
            let (mhz, reasons) = if t == 0 { (1980, 0) } else { (990, 0x20) };
            records.push(Record::GpuSample(Box::new(sample(ts + 1, 1, mhz, reasons))));
        }
        records.push(Record::GpuXid(GpuXid {
            ts: 3_500_000_000,
            vendor: Vendor::Nvidia,
            gpu: 1,
            xid: 79,
            pids: vec![4242],
        }));
        // NPU 1 beside GPU 1: another device, its own track.
        for t in 0..2u64 {
            let ts = 1_000_000_000 * (t + 1) + 2;
            records.push(Record::GpuSample(Box::new(npu_sample(
                ts,
                1,
                1800 - 900 * t as u32,
            ))));
        }
        records.push(Record::GpuXid(GpuXid {
            ts: 3_600_000_000,
            vendor: Vendor::Ascend,
            gpu: 1,
            xid: 0x80E0_1801,
            pids: vec![4242],
        }));
        for r in &records {
            sink.record(r).unwrap();
        }
        let written = sink
            .finish_trace(4_000_000_000, &SinkCounters::default())
            .unwrap();
        (written.out, records)
    }

    #[test]
    fn samples_round_trip_through_the_trace() {
        let (bytes, records) = trace();
        let decoded = decode(&bytes).unwrap();
        check_importer_rules(&decoded).unwrap();
        let tl = Timeline::new(&decoded);
        let gpu1 = tl
            .tracks
            .values()
            .find(|t| t.name.as_deref() == Some("GPU 1") && t.kind == TrackKind::Custom)
            .expect("GPU 1's track");
        assert_eq!(
            gpu1.description.as_deref(),
            Some("NVIDIA H100 80GB HBM3 GPU-1")
        );
        let clock = tl
            .tracks
            .values()
            .find(|t| t.name.as_deref() == Some("GPU 1 SM clock"))
            .expect("its clock counter");
        assert_eq!(clock.parent, Some(gpu1.uuid));
        let values: Vec<f64> = tl
            .counters
            .iter()
            .filter(|c| c.track == clock.uuid)
            .map(|c| c.value)
            .collect();
        assert_eq!(values, [1980.0, 990.0, 990.0]);
        let npu1 = tl
            .tracks
            .values()
            .find(|t| t.name.as_deref() == Some("NPU 1") && t.kind == TrackKind::Custom)
            .expect("NPU 1's track");
        let frequency = tl
            .tracks
            .values()
            .find(|t| t.name.as_deref() == Some("NPU 1 AI Core frequency"))
            .expect("its frequency counter");
        assert_eq!(frequency.parent, Some(npu1.uuid));
        let values: Vec<f64> = tl
            .counters
            .iter()
            .filter(|c| c.track == frequency.uuid)
            .map(|c| c.value)
            .collect();
        assert_eq!(values, [1800.0, 900.0]);
        assert!(
            tl.instants
                .iter()
                .any(|i| i.track == npu1.uuid && i.name == "error code 0x80E01801")
        );
        let slowed: Vec<_> = tl.slices.iter().filter(|s| s.track == gpu1.uuid).collect();
        assert_eq!(slowed.len(), 1, "{slowed:?}");
        assert_eq!(slowed[0].name, "clocks slowed: sw_thermal_slowdown");
        assert_eq!(
            (slowed[0].ts, slowed[0].end),
            (2_000_000_001, Some(4_000_000_000))
        );

        // Read back: the very records the sink was given.
        let mut out = Vec::new();
        TraceRecords::default()
            .read_bytes(&bytes, |p| p as u32, &mut out, &mut Vec::new())
            .unwrap();
        let back: Vec<&Record> = out
            .iter()
            .map(|(_, r)| r)
            .filter(|r| matches!(r, Record::GpuSample(_) | Record::GpuXid(_)))
            .collect();
        let given: Vec<&Record> = records
            .iter()
            .filter(|r| matches!(r, Record::GpuSample(_) | Record::GpuXid(_)))
            .collect();
        assert_eq!(back, given);
    }

    #[test]
    fn agent_merge_remaps_the_gpu_tracks_with_their_counters() {
        let (bytes, _) = trace();
        let dir = std::env::temp_dir().join(format!("xpuscope-gpu-merge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let node = dir.join("node.pftrace");
        std::fs::write(&node, &bytes).unwrap();
        let merged = dir.join("merged.pftrace");
        crate::merge::run(&crate::merge::MergeOptions {
            inputs: vec![node],
            output: merged.clone(),
            force: false,
            no_sched: false,
            steps_csv: None,
        })
        .unwrap();
        let merged = std::fs::read(&merged).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let decoded = decode(&merged).unwrap();
        check_importer_rules(&decoded).unwrap();
        let before = Timeline::new(&decode(&bytes).unwrap());
        let after = Timeline::new(&decoded);
        for gpu in ["GPU 0", "GPU 1", "NPU 1"] {
            let find = |tl: &Timeline| {
                tl.tracks
                    .values()
                    .find(|t| t.name.as_deref() == Some(gpu))
                    .map(|t| t.uuid)
                    .unwrap_or_else(|| panic!("{gpu}"))
            };
            let (old, new) = (find(&before), find(&after));
            assert_ne!(old, new, "{gpu}: a uuid of the merged trace's own");
            let children = |tl: &Timeline, uuid| {
                let mut c: Vec<String> = tl
                    .tracks
                    .values()
                    .filter(|t| t.parent == Some(uuid))
                    .filter_map(|t| t.name.clone())
                    .collect();
                c.sort();
                c
            };
            assert_eq!(children(&after, new), children(&before, old), "{gpu}");
            assert_eq!(children(&after, new).len(), 3, "{gpu}");
        }
        let samples = |tl: &Timeline| {
            tl.instants
                .iter()
                .filter(|i| i.name == "gpu sample")
                .count()
        };
        assert_eq!(samples(&after), samples(&before));
        assert_eq!(after.counters.len(), before.counters.len());
        // `agent diagnose` reads the merged trace's samples as the node's.
        let mut out = Vec::new();
        TraceRecords::default()
            .read_bytes(&merged, |p| p as u32, &mut out, &mut Vec::new())
            .unwrap();
        let n = out
            .iter()
            .filter(|(_, r)| matches!(r, Record::GpuSample(_)))
            .count();
        assert_eq!(n, 8, "6 GPU samples, 2 NPU samples");
    }
}
