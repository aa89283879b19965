//! The smallest sink: counts records per kind. It proves the seam (tests
//! check its counts against the summary's) and is the template for new
//! sinks.

use std::collections::BTreeMap;

use anyhow::Result;

use super::{Sink, SinkCounters};
use crate::model::Record;

/// Records seen per [`Record::kind`].
#[derive(Debug, Default)]
pub struct CountingSink {
    counts: BTreeMap<&'static str, u64>,
    /// Device calls per function name (checked against the summary).
    calls: BTreeMap<&'static str, u64>,
}

/// What a [`CountingSink`] saw.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub per_kind: BTreeMap<&'static str, u64>,
    pub calls_per_function: BTreeMap<&'static str, u64>,
}

impl Sink for CountingSink {
    type Output = Counts;

    fn on_batch(&mut self, batch: &[Record], _lost: &SinkCounters) -> Result<()> {
        for r in batch {
            *self.counts.entry(r.kind()).or_default() += 1;
            if let Record::DeviceCall(c) = r {
                *self.calls.entry(c.call.function).or_default() += 1;
            }
        }
        Ok(())
    }

    fn finish(self, _end: u64, _lost: &SinkCounters) -> Result<Counts> {
        Ok(Counts {
            per_kind: self.counts,
            calls_per_function: self.calls,
        })
    }
}
