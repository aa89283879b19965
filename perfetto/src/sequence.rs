//! The writer's one packet sequence with incremental state: track
//! descriptors, track events and callstack samples share it, its interned
//! data and its `TracePacketDefaults`.

use crate::intern::SequenceInterner;
use crate::proto::{
    self, SEQ_INCREMENTAL_STATE_CLEARED, SEQ_NEEDS_INCREMENTAL_STATE, TracePacket,
    TracePacketDefaults,
};
use crate::types::TrackUuid;

/// `trusted_packet_sequence_id` of system packets (SystemInfo, clocks,
/// process trees, ftrace bundles), which carry no incremental state.
pub(crate) const SYSTEM_SEQUENCE_ID: u32 = 1;
/// `trusted_packet_sequence_id` of the track-event and sample sequence.
pub(crate) const TRACK_SEQUENCE_ID: u32 = 2;

/// Kinds of track, mixed into uuids so they never collide.
#[derive(Clone, Copy)]
pub(crate) enum TrackKind {
    Process = 1,
    Thread = 2,
    Custom = 3,
}

/// splitmix64 finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub(crate) struct TrackSequence {
    pub(crate) interner: SequenceInterner,
    started: bool,
    defaults: Option<TracePacketDefaults>,
    uuid_seed: u64,
    next_custom: u64,
}

impl TrackSequence {
    /// `defaults` go on the sequence's first packet; `machine_id` seeds the
    /// track uuids so that merged nodes do not collide.
    pub(crate) fn new(defaults: TracePacketDefaults, machine_id: Option<u32>) -> Self {
        TrackSequence {
            interner: SequenceInterner::default(),
            started: false,
            defaults: Some(defaults),
            uuid_seed: mix(u64::from(machine_id.unwrap_or(0)) ^ 0x7870_7573_636f_7065),
            next_custom: 0,
        }
    }

    /// A deterministic uuid for a process (`a` = pid) or thread (`a` = pid,
    /// `b` = tid) track, so asking twice gives the same track.
    pub(crate) fn uuid(&self, kind: TrackKind, a: u64, b: u64) -> TrackUuid {
        let u = mix(mix(mix(self.uuid_seed ^ kind as u64) ^ a) ^ b);
        TrackUuid(u.max(1))
    }

    /// A fresh uuid for a custom or counter track.
    pub(crate) fn new_uuid(&mut self) -> TrackUuid {
        self.next_custom += 1;
        self.uuid(TrackKind::Custom, self.next_custom, 0)
    }

    /// A packet on this sequence carrying the interned data queued so far.
    /// `uses_state`: the payload refers to interned ids.
    pub(crate) fn packet(&mut self, timestamp: Option<u64>, uses_state: bool) -> TracePacket {
        let mut flags = 0;
        let mut defaults = None;
        if !self.started {
            self.started = true;
            flags |= SEQ_INCREMENTAL_STATE_CLEARED;
            defaults = self.defaults.take();
        }
        let interned_data = self.interner.take_pending();
        if uses_state || interned_data.is_some() {
            flags |= SEQ_NEEDS_INCREMENTAL_STATE;
        }
        TracePacket {
            timestamp,
            trusted_packet_sequence_id: Some(TRACK_SEQUENCE_ID),
            interned_data,
            sequence_flags: (flags != 0).then_some(flags),
            trace_packet_defaults: defaults,
            ..TracePacket::default()
        }
    }
}

/// Defaults declaring what the sequence's samples measure.
pub(crate) fn sample_defaults(format: crate::SampleFormat) -> TracePacketDefaults {
    match format {
        crate::SampleFormat::StackSample => TracePacketDefaults {
            stack_sample_defaults: Some(proto::StackSampleDefaults {
                source: Some(crate::OFF_CPU_SAMPLE_SOURCE.to_owned()),
                primary_descriptor: Some(proto::SampleCounterDescriptor {
                    name: Some(crate::OFF_CPU_COUNTER_NAME.to_owned()),
                    unit: Some(proto::SAMPLE_UNIT_NANOSECONDS),
                    description: Some(
                        "Time the thread spent off CPU, attributed to its stack".to_owned(),
                    ),
                    scope: Some(proto::SAMPLE_SCOPE_GLOBAL),
                }),
            }),
            ..TracePacketDefaults::default()
        },
        crate::SampleFormat::PerfSample => TracePacketDefaults {
            perf_sample_defaults: Some(proto::PerfSampleDefaults {
                timebase: Some(proto::PerfTimebase {
                    name: Some(crate::OFF_CPU_PERF_TIMEBASE_NAME.to_owned()),
                }),
            }),
            ..TracePacketDefaults::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SampleFormat;

    #[test]
    fn first_packet_clears_state_and_carries_defaults() {
        let mut s = TrackSequence::new(sample_defaults(SampleFormat::StackSample), None);
        let first = s.packet(None, false);
        assert_eq!(first.sequence_flags, Some(SEQ_INCREMENTAL_STATE_CLEARED));
        assert!(first.trace_packet_defaults.is_some());
        assert_eq!(first.trusted_packet_sequence_id, Some(TRACK_SEQUENCE_ID));
        let plain = s.packet(Some(5), false);
        assert_eq!(plain.sequence_flags, None);
        assert!(plain.trace_packet_defaults.is_none());
        s.interner.event_name("x");
        let with_data = s.packet(Some(6), true);
        assert_eq!(with_data.sequence_flags, Some(SEQ_NEEDS_INCREMENTAL_STATE));
        assert!(with_data.interned_data.is_some());
    }

    #[test]
    fn uuids_are_stable_distinct_and_machine_scoped() {
        let mut a = TrackSequence::new(TracePacketDefaults::default(), None);
        let b = TrackSequence::new(TracePacketDefaults::default(), Some(1));
        let p = a.uuid(TrackKind::Process, 10, 0);
        assert_eq!(p, a.uuid(TrackKind::Process, 10, 0));
        assert_ne!(p, a.uuid(TrackKind::Thread, 10, 0));
        assert_ne!(p, b.uuid(TrackKind::Process, 10, 0));
        let c1 = a.new_uuid();
        let c2 = a.new_uuid();
        assert_ne!(c1, c2);
        assert_ne!(c1.0, 0);
    }
}
