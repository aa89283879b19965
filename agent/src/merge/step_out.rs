//! The step breakdown's outputs, written as each rank's steps finish
//! during the second pass (memory stays bounded however many steps): a
//! slice per step on a "steps" track under each rank's process track, a
//! row of the `--steps-csv` table, and a row of the stats JSON's `steps`
//! (kept in an unlinked scratch file beside the output until the report
//! is written). Rows come in the order steps finish (node by node, ranks
//! interleaved), not sorted.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Seek, Write};
use std::path::Path;

use anyhow::{Context, Result};
use rustc_hash::FxHashMap as HashMap;
use serde::ser::{Error as _, SerializeSeq};
use xpuscope_perfetto::rewrite::{IdMap, Packet};
use xpuscope_perfetto::{Arg, ArgValue};

use super::ids::{MERGE_TRACK_SEQUENCE, NodeMap};
use super::mix::mix;
use super::output::Output;
use super::scan::NodeScan;
use crate::analysis::steps::Step;
use crate::trace_schema::{keys, names};

/// Slowest steps the summary lists.
const SLOWEST: usize = 5;

/// One step of one rank, in the merged trace's time base.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepRow {
    pub rank: u32,
    pub node: String,
    #[serde(flatten)]
    pub step: Step,
}

pub struct StepOut {
    /// Global rank -> its "steps" track.
    tracks: HashMap<u32, u64>,
    csv: Option<(BufWriter<File>, std::path::PathBuf)>,
    table: BufWriter<File>,
    rows: u64,
    slowest: Vec<(u32, Step)>,
    first_slice: bool,
    line: String,
}

impl StepOut {
    /// The "steps" tracks of every rank (written to `out` now), the CSV
    /// table with its header, and the scratch file of the JSON rows.
    pub fn create(
        output: &Path,
        csv: Option<&Path>,
        scans: &[NodeScan],
        maps: &mut [NodeMap],
        out: &mut Output,
    ) -> Result<StepOut> {
        let mut tracks = HashMap::default();
        for (k, s) in scans.iter().enumerate() {
            for p in s.processes.values() {
                if let (Some(rank), Some(track)) = (p.rank, p.track) {
                    let parent = maps[k].track(track);
                    let uuid = mix(parent ^ 0x0073_7465_7073).max(1);
                    out.write(&Packet::new_track(
                        MERGE_TRACK_SEQUENCE,
                        uuid,
                        Some(parent),
                        names::STEPS_TRACK,
                        -1,
                    ))?;
                    tracks.insert(rank, uuid);
                }
            }
        }
        let csv = match csv {
            Some(path) => {
                let file =
                    File::create(path).with_context(|| format!("creating {}", path.display()))?;
                let mut w = BufWriter::new(file);
                let mut header = String::from("rank,node,step,start_ns,end_ns");
                for (name, _) in Step::default().parts() {
                    header.push(',');
                    header.push_str(name);
                }
                writeln!(w, "{header}").with_context(|| format!("writing {}", path.display()))?;
                Some((w, path.to_owned()))
            }
            None => None,
        };
        let mut scratch = output.as_os_str().to_owned();
        scratch.push(".steps.tmp");
        let scratch = std::path::PathBuf::from(scratch);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&scratch)
            .with_context(|| format!("creating {}", scratch.display()))?;
        // Unlinked at once: it goes with the process, whatever happens.
        std::fs::remove_file(&scratch)
            .with_context(|| format!("removing {}", scratch.display()))?;
        Ok(StepOut {
            tracks,
            csv,
            table: BufWriter::with_capacity(1 << 16, file),
            rows: 0,
            slowest: Vec::new(),
            first_slice: true,
            line: String::new(),
        })
    }

    /// One finished step of `rank` on node `node`, times already moved
    /// into the merged time base.
    pub fn add(&mut self, rank: u32, node: &str, step: Step, out: &mut Output) -> Result<()> {
        if let Some(&track) = self.tracks.get(&rank) {
            let mut args = vec![keys::STEP.arg(step.step)];
            args.extend(
                step.parts()
                    .into_iter()
                    .map(|(name, v)| Arg::new(name, ArgValue::Uint(v))),
            );
            let name = format!("{}{}", names::STEP_EVENT, step.step);
            out.write(&Packet::new_slice_event(
                MERGE_TRACK_SEQUENCE,
                self.first_slice,
                step.start_ns,
                track,
                Some(&name),
                &args,
            ))?;
            self.first_slice = false;
            out.write(&Packet::new_slice_event(
                MERGE_TRACK_SEQUENCE,
                false,
                step.end_ns,
                track,
                None,
                &[],
            ))?;
        }
        if let Some((w, path)) = &mut self.csv {
            self.line.clear();
            let _ = write!(
                self.line,
                "{rank},{node},{},{},{}",
                step.step, step.start_ns, step.end_ns
            );
            for (_, v) in step.parts() {
                let _ = write!(self.line, ",{v}");
            }
            writeln!(w, "{}", self.line).with_context(|| format!("writing {}", path.display()))?;
        }
        let row = StepRow {
            rank,
            node: node.to_owned(),
            step,
        };
        serde_json::to_writer(&mut self.table, &row).context("writing the step table")?;
        self.table
            .write_all(b"\n")
            .context("writing the step table")?;
        self.rows += 1;
        self.slowest.push((rank, row.step));
        if self.slowest.len() > 4 * SLOWEST {
            self.keep_slowest();
        }
        Ok(())
    }

    fn keep_slowest(&mut self) {
        self.slowest
            .sort_by_key(|(r, s)| (std::cmp::Reverse(s.dur_ns), *r, s.step));
        self.slowest.truncate(SLOWEST);
    }

    /// Closes the CSV; the JSON rows, to be read back when the report is
    /// written.
    pub fn finish(mut self) -> Result<StepTable> {
        if let Some((mut w, path)) = self.csv.take() {
            w.flush()
                .with_context(|| format!("writing {}", path.display()))?;
        }
        self.keep_slowest();
        let mut file = self
            .table
            .into_inner()
            .map_err(|e| anyhow::anyhow!("writing the step table: {}", e.error()))?;
        file.rewind().context("reading the step table back")?;
        Ok(StepTable {
            file,
            rows: self.rows,
            slowest: self.slowest,
        })
    }
}

/// Every rank's steps (the first step of each rank has no start marker
/// and is left out): serialized as a JSON array read back from the
/// scratch file, row by row.
pub struct StepTable {
    file: File,
    pub rows: u64,
    /// The slowest steps: (rank, step).
    pub slowest: Vec<(u32, Step)>,
}

impl std::fmt::Debug for StepTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepTable({} rows)", self.rows)
    }
}

impl serde::Serialize for StepTable {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut file = &self.file;
        file.rewind().map_err(S::Error::custom)?;
        let mut seq = serializer.serialize_seq(Some(self.rows as usize))?;
        for line in BufReader::new(file).lines() {
            let line = line.map_err(S::Error::custom)?;
            let row: serde_json::Value = serde_json::from_str(&line).map_err(S::Error::custom)?;
            seq.serialize_element(&row)?;
        }
        seq.end()
    }
}
