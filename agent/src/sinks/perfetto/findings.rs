//! Findings -> a `xpuscope findings` track at the top of the trace: a
//! slice per finding over its time span (to its detection when it has no
//! end), with the finding's fields and evidence as arguments, so a user
//! opening the trace lands on it.

use std::io::Write;

use anyhow::Result;
use serde_json::Value;
use xpuscope_perfetto::{Arg, ArgValue, TrackUuid};

use super::PerfettoSink;
use crate::model::Finding;
use crate::trace_schema::keys as k;
use crate::trace_schema::names as n;

/// Lanes of the findings track: slices on one track must nest, findings
/// may overlap, so an overlapping one goes on the next lane.
#[derive(Default)]
pub(super) struct FindingLanes {
    /// (track, end of its last slice).
    lanes: Vec<(TrackUuid, u64)>,
}

/// The evidence as arguments: its scalars by name (`evidence.<key>`,
/// nested objects dotted), arrays as JSON text.
fn evidence_args(prefix: &str, v: &Value, out: &mut Vec<Arg>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                evidence_args(&format!("{prefix}.{k}"), v, out);
            }
        }
        Value::Bool(b) => out.push(Arg::new(prefix.to_owned(), ArgValue::Bool(*b))),
        Value::Number(n) => {
            let value = match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => ArgValue::Uint(u),
                (None, Some(i)) => ArgValue::Int(i),
                _ => ArgValue::Double(n.as_f64().unwrap_or(0.0)),
            };
            out.push(Arg::new(prefix.to_owned(), value));
        }
        Value::String(s) => out.push(Arg::new(prefix.to_owned(), ArgValue::Str(s.clone()))),
        Value::Array(_) => out.push(Arg::new(prefix.to_owned(), ArgValue::Str(v.to_string()))),
        Value::Null => {}
    }
}

impl<W: Write> PerfettoSink<W> {
    pub(super) fn finding(&mut self, f: &Finding) -> Result<()> {
        let start = f.start_ns;
        let end = f.end_ns.unwrap_or(f.detected_ns).max(start);
        let track = match self.findings.lanes.iter_mut().find(|(_, e)| *e <= start) {
            Some(lane) => {
                lane.1 = end;
                lane.0
            }
            None => {
                let t = self.writer.custom_track(
                    None,
                    n::FINDINGS_TRACK,
                    Some("What xpuscope's detectors found (hangs, crashes, device OOMs)"),
                )?;
                self.findings.lanes.push((t, end));
                t
            }
        };
        let mut args = vec![
            k::FINDING_KIND.arg(f.kind.as_str()),
            k::SUMMARY.arg(f.summary.as_str()),
            k::RANKS.arg(
                f.ranks
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            k::DETECTED_NS.arg(f.detected_ns),
        ];
        if let Some(c) = &f.comm {
            args.push(k::FINDING_COMM.arg(c.as_str()));
        }
        if let Some(cause) = &f.link.follows_from {
            args.push(k::FOLLOWS_FROM.arg(cause.as_str()));
        }
        if let Some(s) = f.seq {
            args.push(k::SEQ.arg(s));
        }
        if let Some(s) = f.step {
            args.push(k::STEP.arg(s));
        }
        evidence_args(k::EVIDENCE, &f.evidence, &mut args);
        self.writer.slice_begin(
            track,
            start,
            f.kind.as_str(),
            Some(n::FINDINGS_CATEGORY),
            &args,
            &[],
            None,
        )?;
        self.writer.slice_end(track, end, &[])?;
        Ok(())
    }
}
