//! Track descriptors and track events (slices, instants, counters) on the
//! writer's incremental-state sequence.

use std::io::{self, Write};

use crate::TraceWriter;
use crate::proto::{self, DebugAnnotation, TrackDescriptor, TrackEvent};
use crate::sequence::TrackKind;
use crate::types::{Arg, ArgValue, CounterUnit, Frame, TrackUuid};

impl<W: Write> TraceWriter<W> {
    fn write_descriptor(&mut self, descriptor: TrackDescriptor) -> io::Result<()> {
        let mut p = self.seq.packet(None, false);
        p.track_descriptor = Some(descriptor);
        self.sink.write(&mut p)
    }

    fn write_event(&mut self, ts: u64, event: TrackEvent) -> io::Result<()> {
        let mut p = self.seq.packet(Some(ts), true);
        p.track_event = Some(event);
        self.sink.write(&mut p)
    }

    /// The track of process `pid`, named `name` with `labels` (e.g. the
    /// job's rank). The uuid depends only on `pid` (and the machine id):
    /// calling again re-describes the same track.
    pub fn process_track(
        &mut self,
        pid: i32,
        name: &str,
        labels: &[String],
    ) -> io::Result<TrackUuid> {
        let uuid = self.seq.uuid(TrackKind::Process, pid as u32 as u64, 0);
        self.write_descriptor(TrackDescriptor {
            uuid: Some(uuid.0),
            process: Some(proto::ProcessDescriptor {
                pid: Some(pid),
                process_name: (!name.is_empty()).then(|| name.to_owned()),
                process_labels: labels.to_vec(),
            }),
            ..TrackDescriptor::default()
        })?;
        Ok(uuid)
    }

    /// The track of thread `tid` of process `pid`; it merges with the
    /// scheduler's view of that thread. The uuid depends only on the ids.
    pub fn thread_track(&mut self, pid: i32, tid: i32, name: &str) -> io::Result<TrackUuid> {
        let uuid = self
            .seq
            .uuid(TrackKind::Thread, pid as u32 as u64, tid as u32 as u64);
        self.write_descriptor(TrackDescriptor {
            uuid: Some(uuid.0),
            thread: Some(proto::ThreadDescriptor {
                pid: Some(pid),
                tid: Some(tid),
                thread_name: (!name.is_empty()).then(|| name.to_owned()),
            }),
            ..TrackDescriptor::default()
        })?;
        Ok(uuid)
    }

    /// A new named track for slices and instants, nested under `parent`
    /// (e.g. a process track) when given. Slices on one track must nest.
    pub fn custom_track(
        &mut self,
        parent: Option<TrackUuid>,
        name: &str,
        description: Option<&str>,
    ) -> io::Result<TrackUuid> {
        let uuid = self.seq.new_uuid();
        self.write_descriptor(TrackDescriptor {
            uuid: Some(uuid.0),
            name: Some(name.to_owned()),
            parent_uuid: parent.map(|p| p.0),
            description: description.map(str::to_owned),
            ..TrackDescriptor::default()
        })?;
        Ok(uuid)
    }

    /// A new counter track; feed it with [`Self::counter`].
    pub fn counter_track(
        &mut self,
        parent: Option<TrackUuid>,
        name: &str,
        unit: CounterUnit,
    ) -> io::Result<TrackUuid> {
        let uuid = self.seq.new_uuid();
        let counter = match unit {
            CounterUnit::TimeNs => unit_code(proto::UNIT_TIME_NS),
            CounterUnit::Count => unit_code(proto::UNIT_COUNT),
            CounterUnit::SizeBytes => unit_code(proto::UNIT_SIZE_BYTES),
            CounterUnit::Other(name) => proto::CounterDescriptor {
                unit: None,
                unit_name: Some(name),
            },
        };
        self.write_descriptor(TrackDescriptor {
            uuid: Some(uuid.0),
            name: Some(name.to_owned()),
            parent_uuid: parent.map(|p| p.0),
            counter: Some(counter),
            ..TrackDescriptor::default()
        })?;
        Ok(uuid)
    }

    fn annotations(&mut self, args: &[Arg]) -> Vec<DebugAnnotation> {
        args.iter()
            .map(|arg| {
                let mut a = DebugAnnotation {
                    name_iid: Some(self.seq.interner.annotation_name(&arg.name)),
                    ..DebugAnnotation::default()
                };
                match &arg.value {
                    ArgValue::Int(v) => a.int_value = Some(*v),
                    ArgValue::Uint(v) => a.uint_value = Some(*v),
                    ArgValue::Double(v) => a.double_value = Some(*v),
                    ArgValue::Str(v) => a.string_value = Some(v.clone()),
                    ArgValue::Bool(v) => a.bool_value = Some(*v),
                    ArgValue::Pointer(v) => a.pointer_value = Some(*v),
                }
                a
            })
            .collect()
    }

    /// Begins a slice named `name` on `track` at `ts`. `flow_ids` link it to
    /// other slices carrying the same id (never reuse an id); `callstack` is
    /// leaf first like [`Self::stack_sample`]'s.
    #[allow(clippy::too_many_arguments)]
    pub fn slice_begin(
        &mut self,
        track: TrackUuid,
        ts: u64,
        name: &str,
        category: Option<&str>,
        args: &[Arg],
        flow_ids: &[u64],
        callstack: Option<&[Frame]>,
    ) -> io::Result<()> {
        let event = TrackEvent {
            r#type: Some(proto::TYPE_SLICE_BEGIN),
            track_uuid: Some(track.0),
            name_iid: Some(self.seq.interner.event_name(name)),
            category_iids: category
                .map(|c| self.seq.interner.category(c))
                .into_iter()
                .collect(),
            debug_annotations: self.annotations(args),
            flow_ids: flow_ids.to_vec(),
            callstack_iid: callstack.and_then(|f| self.seq.interner.callstack(f)),
            ..TrackEvent::default()
        };
        self.write_event(ts, event)
    }

    /// Ends the innermost open slice on `track` at `ts`;
    /// `terminating_flow_ids` end those flows at this slice.
    pub fn slice_end(
        &mut self,
        track: TrackUuid,
        ts: u64,
        terminating_flow_ids: &[u64],
    ) -> io::Result<()> {
        let event = TrackEvent {
            r#type: Some(proto::TYPE_SLICE_END),
            track_uuid: Some(track.0),
            terminating_flow_ids: terminating_flow_ids.to_vec(),
            ..TrackEvent::default()
        };
        self.write_event(ts, event)
    }

    /// A zero-duration event on `track` at `ts`.
    pub fn instant(
        &mut self,
        track: TrackUuid,
        ts: u64,
        name: &str,
        args: &[Arg],
        callstack: Option<&[Frame]>,
    ) -> io::Result<()> {
        let event = TrackEvent {
            r#type: Some(proto::TYPE_INSTANT),
            track_uuid: Some(track.0),
            name_iid: Some(self.seq.interner.event_name(name)),
            debug_annotations: self.annotations(args),
            callstack_iid: callstack.and_then(|f| self.seq.interner.callstack(f)),
            ..TrackEvent::default()
        };
        self.write_event(ts, event)
    }

    /// Sets counter `track` to `value` from `ts` on.
    pub fn counter(&mut self, track: TrackUuid, ts: u64, value: f64) -> io::Result<()> {
        let event = TrackEvent {
            r#type: Some(proto::TYPE_COUNTER),
            track_uuid: Some(track.0),
            double_counter_value: Some(value),
            ..TrackEvent::default()
        };
        self.write_event(ts, event)
    }
}

fn unit_code(unit: i32) -> proto::CounterDescriptor {
    proto::CounterDescriptor {
        unit: Some(unit),
        unit_name: None,
    }
}
