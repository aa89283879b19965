//! Per-sequence incremental state as the importer keeps it: the cleared flag,
//! interned data and packet defaults, keyed by (machine, sequence id).

use std::collections::HashMap;

use perfetto_protos::interned_data::InternedData;
use perfetto_protos::trace_packet::TracePacket;

use super::wire;

/// `TracePacket.SequenceFlags`.
pub(crate) const SEQ_INCREMENTAL_STATE_CLEARED: u32 = 1;
pub(crate) const SEQ_NEEDS_INCREMENTAL_STATE: u32 = 2;

/// An interned `Mapping`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct MappingDef {
    pub build_id: u64,
    pub path_ids: Vec<u64>,
    pub start: u64,
    pub end: u64,
}

/// An interned `Frame`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct FrameDef {
    pub function: u64,
    pub mapping: u64,
    pub rel_pc: u64,
}

/// A callstack frame with its interned references resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedFrame {
    /// Function name.
    pub function: String,
    /// Mapping path components joined with '/' ("kernel" for the kernel).
    pub mapping: String,
    /// Build id of the mapping, raw bytes (empty when none).
    pub build_id: Vec<u8>,
    /// pc relative to the mapping.
    pub rel_pc: u64,
}

/// Interned tables of one sequence generation.
#[derive(Default, Debug)]
pub(crate) struct Interned {
    pub event_names: HashMap<u64, String>,
    pub categories: HashMap<u64, String>,
    pub annotation_names: HashMap<u64, String>,
    pub function_names: HashMap<u64, String>,
    pub mapping_paths: HashMap<u64, String>,
    pub build_ids: HashMap<u64, Vec<u8>>,
    pub mappings: HashMap<u64, MappingDef>,
    pub frames: HashMap<u64, FrameDef>,
    pub callstacks: HashMap<u64, Vec<u64>>,
}

/// Inserts `iid -> value`, reporting iid 0 and conflicting redefinitions.
fn define<V: PartialEq + std::fmt::Debug>(
    kind: &str,
    map: &mut HashMap<u64, V>,
    iid: u64,
    value: V,
    errors: &mut Vec<String>,
) {
    if iid == 0 {
        errors.push(format!("interned {kind} with iid 0"));
        return;
    }
    if let Some(old) = map.get(&iid).filter(|old| **old != value) {
        errors.push(format!(
            "interned {kind} {iid} redefined: {old:?} then {value:?}"
        ));
    }
    map.insert(iid, value);
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

impl Interned {
    /// Adds the definitions in `data`; returns problems found.
    pub(crate) fn add(&mut self, data: &InternedData) -> Vec<String> {
        let mut e = Vec::new();
        for n in &data.event_names {
            define(
                "event name",
                &mut self.event_names,
                n.iid(),
                n.name().to_owned(),
                &mut e,
            );
        }
        for n in &data.event_categories {
            define(
                "category",
                &mut self.categories,
                n.iid(),
                n.name().to_owned(),
                &mut e,
            );
        }
        for n in &data.debug_annotation_names {
            let name = n.name().to_owned();
            define(
                "annotation name",
                &mut self.annotation_names,
                n.iid(),
                name,
                &mut e,
            );
        }
        for s in &data.function_names {
            let name = text(s.str());
            define(
                "function name",
                &mut self.function_names,
                s.iid(),
                name,
                &mut e,
            );
        }
        for s in &data.mapping_paths {
            define(
                "mapping path",
                &mut self.mapping_paths,
                s.iid(),
                text(s.str()),
                &mut e,
            );
        }
        for s in &data.build_ids {
            define(
                "build id",
                &mut self.build_ids,
                s.iid(),
                s.str().to_vec(),
                &mut e,
            );
        }
        for m in &data.mappings {
            let def = MappingDef {
                build_id: m.build_id(),
                path_ids: m.path_string_ids.clone(),
                start: m.start(),
                end: m.end(),
            };
            define("mapping", &mut self.mappings, m.iid(), def, &mut e);
        }
        for f in &data.frames {
            let def = FrameDef {
                function: f.function_name_id(),
                mapping: f.mapping_id(),
                rel_pc: f.rel_pc(),
            };
            define("frame", &mut self.frames, f.iid(), def, &mut e);
        }
        for c in &data.callstacks {
            define(
                "callstack",
                &mut self.callstacks,
                c.iid(),
                c.frame_ids.clone(),
                &mut e,
            );
        }
        e
    }

    fn mapping(&self, iid: u64) -> Result<(String, Vec<u8>), String> {
        let m = self
            .mappings
            .get(&iid)
            .ok_or_else(|| format!("mapping {iid} not defined"))?;
        let mut parts = Vec::new();
        for p in &m.path_ids {
            let s = self.mapping_paths.get(p);
            parts.push(
                s.ok_or_else(|| format!("mapping path {p} not defined"))?
                    .as_str(),
            );
        }
        let build_id = if m.build_id == 0 {
            Vec::new()
        } else {
            let b = self.build_ids.get(&m.build_id);
            b.ok_or_else(|| format!("build id {} not defined", m.build_id))?
                .clone()
        };
        Ok((parts.join("/"), build_id))
    }

    /// The frames of callstack `iid`, root first, all references resolved.
    pub(crate) fn resolve_callstack(&self, iid: u64) -> Result<Vec<ResolvedFrame>, String> {
        let ids = self
            .callstacks
            .get(&iid)
            .ok_or_else(|| format!("callstack {iid} not defined"))?;
        ids.iter()
            .map(|fid| {
                let f = self
                    .frames
                    .get(fid)
                    .ok_or_else(|| format!("frame {fid} not defined"))?;
                let function = self
                    .function_names
                    .get(&f.function)
                    .ok_or_else(|| format!("function name {} not defined", f.function))?;
                let (mapping, build_id) = self.mapping(f.mapping)?;
                Ok(ResolvedFrame {
                    function: function.clone(),
                    mapping,
                    build_id,
                    rel_pc: f.rel_pc,
                })
            })
            .collect()
    }
}

/// `StackSampleDefaults` (schema v58+, `TracePacketDefaults` field 100).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct StackSampleDefaults {
    pub source: Option<String>,
    /// Name and unit enum of the primary counter, if declared.
    pub primary: Option<(String, Option<u64>)>,
}

/// State of one sequence.
#[derive(Default, Debug)]
pub(crate) struct SeqState {
    pub cleared: bool,
    pub interned: Interned,
    pub stack_defaults: Option<StackSampleDefaults>,
    pub default_track_uuid: Option<u64>,
}

/// Every sequence's state, updated packet by packet in file order.
#[derive(Default)]
pub(crate) struct Sequences {
    map: HashMap<(u32, u32), SeqState>,
}

fn parse_stack_defaults(bytes: &[u8]) -> Result<StackSampleDefaults, String> {
    let f = wire::fields(bytes)?;
    let primary = match wire::all_bytes(&f, 2).last() {
        Some(desc) => {
            let d = wire::fields(desc)?;
            Some((
                wire::last_string(&d, 2).unwrap_or_default(),
                wire::last_u64(&d, 3),
            ))
        }
        None => None,
    };
    Ok(StackSampleDefaults {
        source: wire::last_string(&f, 1),
        primary,
    })
}

impl Sequences {
    /// Applies `packet`'s flags, defaults and interned data to its
    /// sequence, like the importer does before parsing the payload.
    /// Returns the sequence state and the problems found.
    pub(crate) fn on_packet(
        &mut self,
        machine: u32,
        packet: &TracePacket,
    ) -> (&SeqState, Vec<String>) {
        let mut errors = Vec::new();
        let seq = packet.trusted_packet_sequence_id();
        let flags = packet.sequence_flags();
        let state = self.map.entry((machine, seq)).or_default();
        let clears =
            flags & SEQ_INCREMENTAL_STATE_CLEARED != 0 || packet.incremental_state_cleared();
        if clears {
            if seq == 0 {
                errors.push("incremental state cleared on sequence id 0".into());
            }
            // The importer starts a new generation: interned data and
            // packet defaults are gone (this packet may bring new ones).
            state.cleared = true;
            state.interned = Interned::default();
            state.stack_defaults = None;
            state.default_track_uuid = None;
        }
        if let Some(defaults) = packet.trace_packet_defaults.as_ref() {
            if seq == 0 {
                errors.push("trace_packet_defaults on sequence id 0".into());
            }
            state.default_track_uuid = defaults
                .track_event_defaults
                .as_ref()
                .and_then(|d| d.track_uuid);
            let unknown = defaults.special_fields.unknown_fields();
            state.stack_defaults = match wire::unknown_bytes(unknown, 100) {
                Some(b) => match parse_stack_defaults(b) {
                    Ok(d) => Some(d),
                    Err(e) => {
                        errors.push(format!("undecodable stack_sample_defaults: {e}"));
                        None
                    }
                },
                None => None,
            };
        }
        if let Some(data) = packet.interned_data.as_ref() {
            if seq == 0 {
                errors.push("interned data on sequence id 0".into());
            } else if !state.cleared {
                errors.push(format!(
                    "interned data on sequence {seq} before any packet with SEQ_INCREMENTAL_STATE_CLEARED"
                ));
            }
            errors.extend(state.interned.add(data));
        }
        if flags & SEQ_NEEDS_INCREMENTAL_STATE != 0 && !state.cleared {
            errors.push(format!(
                "SEQ_NEEDS_INCREMENTAL_STATE on sequence {seq} before SEQ_INCREMENTAL_STATE_CLEARED (the importer drops the packet)"
            ));
        }
        (state, errors)
    }
}
