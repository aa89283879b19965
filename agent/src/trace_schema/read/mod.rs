//! Reading a trace back: [`TracePackets`] is the one loop over a trace's
//! packets (`agent merge`'s two passes and [`TraceRecords`] run it);
//! [`TraceRecords`] turns a trace into the records that made it, for the
//! detectors of `agent diagnose`; [`switches`] is how both offline readers
//! of off-CPU time take a trace's scheduler switches. (`agent merge` reads
//! its traces as a stream, in bounded memory: it runs the packet loop and
//! reads events with the schema's keys, not into records.)

mod gpu;
mod offcpu;
mod records;
pub mod switches;

pub use records::{OpenAtEnd, TraceRecords};

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use xpuscope_perfetto::rewrite::{EventView, Interning, Packet, PacketReader, Truncated};

/// The most live sites read from a failed allocation's instant. The sink
/// writes the few largest; each row is looked up among all the instant's
/// arguments, so a trace naming thousands would cost their square.
pub const MAX_LIVE_SITES: usize = 16;

/// A trace's packets in order, decoded, with each packet's interned names
/// taken in before it is handed out (so its events resolve).
pub struct TracePackets<R: Read> {
    reader: PacketReader<R>,
    interning: Interning,
    path: PathBuf,
}

impl TracePackets<File> {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        Ok(Self::new(file, path))
    }
}

impl<R: Read> TracePackets<R> {
    /// Packets of `input`; `path` names it in errors.
    pub fn new(input: R, path: &Path) -> Self {
        TracePackets {
            reader: PacketReader::new(input),
            interning: Interning::default(),
            path: path.to_owned(),
        }
    }

    /// The next packet, or None at the end (of the last complete packet:
    /// see [`Self::truncated`]).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<Packet>> {
        let index = self.reader.packets();
        let path = &self.path;
        let Some(bytes) = self
            .reader
            .next_packet()
            .with_context(|| format!("reading {}", path.display()))?
        else {
            return Ok(None);
        };
        let packet = Packet::decode(bytes, index).with_context(|| {
            format!(
                "reading {}: not an xpuscope trace (agent attach output)?",
                path.display()
            )
        })?;
        self.interning.observe(&packet);
        Ok(Some(packet))
    }

    /// The names interned so far (a packet's own included, once handed out).
    pub fn interning(&self) -> &Interning {
        &self.interning
    }

    /// A packet's track event, its names resolved.
    pub fn event<'a>(&'a self, packet: &'a Packet) -> Option<EventView<'a>> {
        self.interning.event(packet)
    }

    /// Packets handed out so far (the index of the next one).
    pub fn packets(&self) -> u64 {
        self.reader.packets()
    }

    /// Bytes read (to the end of the last packet handed out).
    pub fn offset(&self) -> u64 {
        self.reader.offset()
    }

    /// Where a cut trace's last packet was cut.
    pub fn truncated(&self) -> Option<Truncated> {
        self.reader.truncated()
    }
}
