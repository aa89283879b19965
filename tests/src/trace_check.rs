//! The independent trace decoder and checker used by every end-to-end test.
//!
//! Decoding uses the official Perfetto schema through `perfetto_protos`
//! (schema v51, rust-protobuf runtime): nothing here depends on the writer or
//! its prost types. Fields newer than v51 (`TracePacket.stack_sample = 135`,
//! `TrackEvent.callstack_iid = 56`, `TrackDescriptor.description = 14`,
//! `TracePacketDefaults.stack_sample_defaults = 100`) arrive as unknown
//! fields and are read with a small wire reader.
//!
//! - [`decode`]: bytes to `perfetto_protos::trace::Trace`.
//! - [`check_importer_rules`]: the importer's rules (see its docs).
//! - [`Timeline`]: what the UI would show: switches with their previous
//!   task, wakings with their waker, thread lifetimes, names and processes,
//!   thread states, slices, counters, callstack samples.
//!
//! ```no_run
//! use xpuscope_tests::trace_check::{check_importer_rules, decode, Timeline};
//! let bytes = std::fs::read("trace.pftrace").unwrap();
//! let trace = decode(&bytes).unwrap();
//! check_importer_rules(&trace).unwrap();
//! let timeline = Timeline::new(&trace);
//! assert!(!timeline.switches.is_empty());
//! ```

mod extract;
mod ftrace;
mod records;
mod rules;
mod sequence;
mod timeline;
mod wire;

use perfetto_protos::trace::Trace;
use protobuf::Message;

pub use records::{
    ArgValue, CounterPoint, Instant, LostEvents, NewTask, ProcessEntry, ProcessFree, Rename,
    SampleSource, Slice, StackSample, State, Switch, ThreadEntry, Track, TrackKind, UNKNOWN_PID,
    Waking, kernel_version,
};
pub use rules::check_importer_rules;
pub use sequence::ResolvedFrame;
pub use timeline::Timeline;

/// Decodes a whole trace file (uncompressed protobuf).
pub fn decode(bytes: &[u8]) -> Result<Trace, String> {
    Trace::parse_from_bytes(bytes).map_err(|e| format!("not a Perfetto trace: {e}"))
}

#[cfg(test)]
mod tests {
    //! Hand-built traces (official schema types, not the writer).

    use perfetto_protos::clock_snapshot::ClockSnapshot;
    use perfetto_protos::counter_descriptor::CounterDescriptor;
    use perfetto_protos::debug_annotation::{DebugAnnotation, DebugAnnotationName};
    use perfetto_protos::ftrace_event::FtraceEvent;
    use perfetto_protos::ftrace_event_bundle::FtraceEventBundle;
    use perfetto_protos::ftrace_event_bundle::ftrace_event_bundle::CompactSched;
    use perfetto_protos::interned_data::InternedData;
    use perfetto_protos::process_tree::ProcessTree;
    use perfetto_protos::process_tree::process_tree::{Process, Thread};
    use perfetto_protos::profile_common::{Callstack, Frame, InternedString, Mapping};
    use perfetto_protos::profile_packet::PerfSample;
    use perfetto_protos::system_info::{SystemInfo, Utsname};
    use perfetto_protos::task::{TaskNewtaskFtraceEvent, TaskRenameFtraceEvent};
    use perfetto_protos::thread_descriptor::ThreadDescriptor;
    use perfetto_protos::trace_packet::TracePacket;
    use perfetto_protos::track_descriptor::TrackDescriptor;
    use perfetto_protos::track_event::track_event::Type;
    use perfetto_protos::track_event::{EventName, TrackEvent};

    use super::wire::encode;
    use super::*;

    const SEQ: u32 = 7;

    fn system_info(release: &str) -> TracePacket {
        let mut p = TracePacket::new();
        let mut uts = Utsname::new();
        uts.set_release(release.into());
        let mut info = SystemInfo::new();
        info.utsname = Some(uts).into();
        p.set_system_info(info);
        p
    }

    fn bundle(
        cpu: u32,
        compact: CompactSched,
        events: Vec<FtraceEvent>,
        lost: bool,
    ) -> TracePacket {
        let mut b = FtraceEventBundle::new();
        b.cpu = Some(cpu);
        b.compact_sched = Some(compact).into();
        b.event = events;
        if lost {
            b.lost_events = Some(true);
        }
        let mut p = TracePacket::new();
        p.set_ftrace_events(b);
        p
    }

    /// Switches on one CPU: (delta, prev_state, next_pid, comm index).
    fn switches(table: &[&str], rows: &[(u64, i64, i32, u32)]) -> CompactSched {
        let mut c = CompactSched::new();
        c.intern_table = table.iter().map(|s| s.to_string()).collect();
        for &(dt, state, pid, comm) in rows {
            c.switch_timestamp.push(dt);
            c.switch_prev_state.push(state);
            c.switch_next_pid.push(pid);
            c.switch_next_prio.push(120);
            c.switch_next_comm_index.push(comm);
        }
        c
    }

    fn seq_packet(ts: u64, flags: u32) -> TracePacket {
        let mut p = TracePacket::new();
        p.set_timestamp(ts);
        p.set_trusted_packet_sequence_id(SEQ);
        if flags != 0 {
            p.set_sequence_flags(flags);
        }
        p
    }

    fn thread_track(uuid: u64, pid: i32, tid: i32, name: &str) -> TracePacket {
        let mut d = TrackDescriptor::new();
        d.set_uuid(uuid);
        let mut t = ThreadDescriptor::new();
        t.set_pid(pid);
        t.set_tid(tid);
        t.set_thread_name(name.into());
        d.thread = Some(t).into();
        let mut p = seq_packet(0, 0);
        p.clear_timestamp();
        p.set_track_descriptor(d);
        p
    }

    fn event(ts: u64, track: u64, ty: Type, name_iid: Option<u64>) -> TracePacket {
        let mut e = TrackEvent::new();
        e.set_type(ty);
        e.set_track_uuid(track);
        if let Some(iid) = name_iid {
            e.set_name_iid(iid);
        }
        let mut p = seq_packet(ts, 2);
        p.set_track_event(e);
        p
    }

    fn interned_string(iid: u64, s: &str) -> InternedString {
        let mut i = InternedString::new();
        i.set_iid(iid);
        i.set_str(s.as_bytes().to_vec());
        i
    }

    /// A valid trace touching every rule, as a real writer might produce it.
    fn good_trace() -> Trace {
        let mut packets = vec![system_info("6.18.0-1-amd64")];
        let mut clock = ClockSnapshot::new();
        clock.primary_trace_clock = None;
        let mut cp = TracePacket::new();
        cp.set_clock_snapshot(clock);
        packets.push(cp);

        let mut tree = ProcessTree::new();
        let mut proc = Process::new();
        proc.set_pid(100);
        proc.set_ppid(1);
        proc.cmdline = vec!["trainer".into(), "--rank=0".into()];
        tree.processes.push(proc);
        let mut th = Thread::new();
        th.set_tid(101);
        th.set_tgid(100);
        th.set_name("loader".into());
        tree.threads.push(th);
        let mut tp = TracePacket::new();
        tp.set_timestamp(500);
        tp.set_process_tree(tree);
        packets.push(tp);

        // CPU 0: 100 runs at 1000, sleeps (S) at 1500 for 101, which is
        // preempted (R+) at 2000 by idle; 101 renamed at 1700.
        let mut rename = FtraceEvent::new();
        rename.set_timestamp(1700);
        rename.set_pid(101);
        let mut r = TaskRenameFtraceEvent::new();
        r.set_pid(101);
        r.set_oldcomm("loader".into());
        r.set_newcomm("loader-2".into());
        rename.set_task_rename(r);
        let mut c0 = switches(
            &["trainer", "loader", "swapper/0"],
            &[(1000, 0, 100, 0), (500, 1, 101, 1)],
        );
        // 100 woken at 1800 on CPU 0 while 101 runs there.
        c0.waking_timestamp.push(1800);
        c0.waking_pid.push(100);
        c0.waking_target_cpu.push(1);
        c0.waking_prio.push(120);
        c0.waking_comm_index.push(0);
        packets.push(bundle(0, c0, vec![rename], false));
        let mut newtask = FtraceEvent::new();
        newtask.set_timestamp(1900);
        newtask.set_pid(100);
        let mut n = TaskNewtaskFtraceEvent::new();
        n.set_pid(102);
        n.set_comm("trainer".into());
        n.set_clone_flags(0x10000);
        newtask.set_task_newtask(n);
        packets.push(bundle(
            0,
            switches(&["swapper/0"], &[(2000, 0x100, 0, 0)]),
            vec![newtask],
            true,
        ));
        // CPU 1: 100 runs at 1900 (woken at 1800).
        packets.push(bundle(
            1,
            switches(&["trainer"], &[(1900, 0, 100, 0)]),
            vec![],
            false,
        ));

        // Track events on sequence SEQ.
        let mut first = seq_packet(0, 1);
        first.clear_timestamp();
        let mut data = InternedData::new();
        let mut name = EventName::new();
        name.set_iid(1);
        name.set_name("step".into());
        data.event_names.push(name);
        let mut an = DebugAnnotationName::new();
        an.set_iid(1);
        an.set_name("batch".into());
        data.debug_annotation_names.push(an);
        first.interned_data = Some(data).into();
        packets.push(first);
        packets.push(thread_track(55, 100, 100, "trainer-main"));
        let mut begin = event(1000, 55, Type::TYPE_SLICE_BEGIN, Some(1));
        let mut a = DebugAnnotation::new();
        a.set_name_iid(1);
        a.set_uint_value(64);
        begin.mut_track_event().debug_annotations.push(a);
        begin.mut_track_event().flow_ids.push(9);
        packets.push(begin);
        let mut end = event(1400, 55, Type::TYPE_SLICE_END, None);
        end.mut_track_event().terminating_flow_ids.push(9);
        packets.push(end);

        let mut counter = TrackDescriptor::new();
        counter.set_uuid(56);
        counter.set_name("mem".into());
        counter.counter = Some(CounterDescriptor::new()).into();
        let mut cp = seq_packet(0, 0);
        cp.clear_timestamp();
        cp.set_track_descriptor(counter);
        packets.push(cp);
        let mut value = event(1200, 56, Type::TYPE_COUNTER, None);
        value.mut_track_event().set_double_counter_value(3.5);
        packets.push(value);

        // A PerfSample and a StackSample (field 135) with one callstack:
        // main (libc) -> schedule (kernel).
        let mut data = InternedData::new();
        data.function_names.push(interned_string(1, "main"));
        data.function_names.push(interned_string(2, "schedule"));
        data.mapping_paths
            .push(interned_string(1, "/usr/lib/libc.so.6"));
        data.mapping_paths.push(interned_string(2, "kernel"));
        for (iid, path) in [(1, 1), (2, 2)] {
            let mut m = Mapping::new();
            m.set_iid(iid);
            m.path_string_ids.push(path);
            data.mappings.push(m);
        }
        for (iid, func, map) in [(1, 1, 1), (2, 2, 2)] {
            let mut f = Frame::new();
            f.set_iid(iid);
            f.set_function_name_id(func);
            f.set_mapping_id(map);
            data.frames.push(f);
        }
        let mut cs = Callstack::new();
        cs.set_iid(1);
        cs.frame_ids = vec![1, 2];
        data.callstacks.push(cs);
        let mut ps = seq_packet(1500, 2);
        ps.interned_data = Some(data).into();
        let mut s = PerfSample::new();
        s.set_cpu(0);
        s.set_pid(100);
        s.set_tid(100);
        s.set_callstack_iid(1);
        s.set_timebase_count(700);
        ps.set_perf_sample(s);
        packets.push(ps);
        let mut ss = seq_packet(1600, 2);
        let mut body = Vec::new();
        let mut task = Vec::new();
        encode::varint_field(2, 100, &mut task);
        encode::varint_field(3, 101, &mut task);
        encode::bytes_field(1, &task, &mut body);
        encode::varint_field(6, 1, &mut body);
        let mut desc = Vec::new();
        encode::bytes_field(2, b"off-cpu time", &mut desc);
        encode::varint_field(3, 1, &mut desc);
        encode::bytes_field(9, &desc, &mut body);
        encode::varint_field(11, 250, &mut body);
        ss.mut_unknown_fields().add_length_delimited(135, body);
        packets.push(ss);

        let mut t = Trace::new();
        t.packet = packets;
        t
    }

    fn reencode(t: &Trace) -> Trace {
        decode(&t.write_to_bytes().unwrap()).unwrap()
    }

    #[test]
    fn good_trace_passes_and_round_trips() {
        let t = reencode(&good_trace());
        check_importer_rules(&t).unwrap();
    }

    #[test]
    fn timeline_reconstructs_what_the_ui_shows() {
        let tl = Timeline::new(&reencode(&good_trace()));
        assert_eq!(tl.kernel_release.as_deref(), Some("6.18.0-1-amd64"));
        let sw: Vec<(u32, u64, i32, i32)> = tl
            .switches
            .iter()
            .map(|s| (s.cpu, s.ts, s.prev_pid, s.next_pid))
            .collect();
        assert_eq!(
            sw,
            [
                (0, 1000, UNKNOWN_PID, 100),
                (0, 1500, 100, 101),
                (1, 1900, UNKNOWN_PID, 100),
                (0, 2000, 101, 0)
            ]
        );
        assert_eq!(tl.switches[3].next_comm, "swapper/0");
        assert_eq!(tl.wakings.len(), 1);
        assert_eq!(tl.wakings[0].waker_pid, Some(101));
        assert_eq!(tl.wakings[0].comm, "trainer");
        assert_eq!(tl.renames[0].new_comm, "loader-2");
        assert_eq!(tl.new_tasks[0].pid, 102);
        assert_eq!(
            tl.lost_events,
            [LostEvents {
                cpu: 0,
                first_ts: Some(1900)
            }]
        );
        assert!(tl.lost_event_cpus.iter().eq([0].iter()));

        // Names: the track descriptor (priority 4) beats ProcessTree (2),
        // which beats ftrace (1) even when the ftrace rename is later.
        assert_eq!(tl.thread_name(100).as_deref(), Some("trainer-main"));
        assert_eq!(tl.thread_name(101).as_deref(), Some("loader"));
        assert_eq!(tl.thread_name(102).as_deref(), Some("trainer"));
        assert_eq!(tl.process_of(101), Some(100));
        assert_eq!(tl.process_of(102), Some(100));
        assert_eq!(tl.processes[&100].cmdline, ["trainer", "--rank=0"]);

        assert_eq!(
            tl.thread_state_intervals(100),
            [
                (1000, 1500, State::Running),
                (1500, 1800, State::Sleeping),
                (1800, 1900, State::Runnable),
                (1900, 2000, State::Running),
            ]
        );
        assert_eq!(
            tl.thread_state_intervals(101),
            [(1500, 2000, State::Running)],
            "R+ after 2000 is open and ends at end_ts = 2000"
        );

        let slices = tl.slices_on(55);
        assert_eq!(slices.len(), 1);
        assert_eq!((slices[0].ts, slices[0].end), (1000, Some(1400)));
        assert_eq!(slices[0].name, "step");
        assert_eq!(slices[0].arg("batch"), Some(&ArgValue::Uint(64)));
        assert_eq!(slices[0].terminating_flow_ids, [9]);
        assert_eq!(tl.counter_series(56), [(1200, 3.5)]);
        assert_eq!(tl.counter_values("mem"), [3.5]);

        assert_eq!(tl.stack_samples.len(), 2);
        let perf = &tl.stack_samples[0];
        assert_eq!(perf.source, SampleSource::PerfSample);
        assert_eq!(
            (perf.weight, perf.frames.clone()),
            (700, vec!["main".to_string(), "schedule".into()])
        );
        assert_eq!(perf.mappings, ["/usr/lib/libc.so.6", "kernel"]);
        let stack = &tl.stack_samples[1];
        assert_eq!(stack.source, SampleSource::StackSample);
        assert_eq!((stack.pid, stack.tid, stack.weight), (100, 101, 250));
        assert_eq!(stack.frames, ["main", "schedule"]);
    }

    #[test]
    fn a_new_task_with_a_reused_tid_starts_a_fresh_thread() {
        let mut t = good_trace();
        let mut newtask = FtraceEvent::new();
        newtask.set_timestamp(1950);
        newtask.set_pid(100);
        let mut n = TaskNewtaskFtraceEvent::new();
        n.set_pid(101);
        n.set_comm("fresh".into());
        n.set_clone_flags(0);
        newtask.set_task_newtask(n);
        t.packet[4].mut_ftrace_events().event.push(newtask);
        let tl = Timeline::new(&reencode(&t));
        // The ProcessTree name and tgid belonged to the previous thread 101.
        assert_eq!(tl.thread_name(101).as_deref(), Some("fresh"));
        assert_eq!(tl.process_of(101), Some(101));
    }

    #[test]
    fn prev_state_decoding_follows_kernel_version() {
        let new = Some((6, 1));
        assert_eq!(State::from_prev_state(0x80, new), State::Idle);
        assert_eq!(State::from_prev_state(0x100, new), State::RunnablePreempted);
        assert_eq!(State::from_prev_state(0x2, new), State::Uninterruptible);
        assert_eq!(State::from_prev_state(0x20, new), State::Dead);
        assert_eq!(State::from_prev_state(0x4, new), State::Other(4));
        assert_eq!(State::from_prev_state(0x100, None), State::Other(0x100));
        assert_eq!(
            State::from_prev_state(0x800, None),
            State::RunnablePreempted
        );
        assert_eq!(kernel_version("6.18.0-1-amd64"), Some((6, 18)));
        assert_eq!(kernel_version("4.4"), Some((4, 4)));
    }

    fn errors_of(t: &Trace) -> Vec<String> {
        check_importer_rules(t).expect_err("the trace breaks a rule")
    }

    fn has(errors: &[String], needle: &str) -> bool {
        errors.iter().any(|e| e.contains(needle))
    }

    #[test]
    fn detects_missing_system_info_and_bad_bundles() {
        let mut t = good_trace();
        t.packet.remove(0);
        assert!(has(&errors_of(&t), "no SystemInfo"));

        let mut t = good_trace();
        let b = t.packet[3].mut_ftrace_events();
        b.cpu = Some(4096);
        b.previous_bundle_end_timestamp = Some(1);
        let c = b.compact_sched.as_mut().unwrap();
        c.switch_next_comm_index[0] = 9;
        c.switch_next_pid.pop();
        let e = errors_of(&t);
        assert!(has(&e, ">= 1024"), "{e:?}");
        assert!(has(&e, "previous_bundle_end_timestamp"), "{e:?}");
        assert!(has(&e, "comm index 9"), "{e:?}");
        assert!(has(&e, "differ in length"), "{e:?}");
    }

    #[test]
    fn detects_switches_going_back_across_bundles() {
        let mut t = good_trace();
        let c = t.packet[4]
            .mut_ftrace_events()
            .compact_sched
            .as_mut()
            .unwrap();
        c.switch_timestamp[0] = 1200;
        assert!(has(&errors_of(&t), "goes back in time"));
    }

    #[test]
    fn detects_interning_and_sequence_errors() {
        let mut t = good_trace();
        t.packet[6].clear_sequence_flags();
        let e = errors_of(&t);
        assert!(
            has(&e, "before any packet with SEQ_INCREMENTAL_STATE_CLEARED"),
            "{e:?}"
        );
        assert!(has(&e, "SEQ_NEEDS_INCREMENTAL_STATE"), "{e:?}");

        let mut t = good_trace();
        t.packet[8].mut_track_event().set_name_iid(5);
        assert!(has(&errors_of(&t), "event name iid 5"));

        let mut t = good_trace();
        let data = t.packet[12].interned_data.as_mut().unwrap();
        data.frames.pop();
        assert!(has(&errors_of(&t), "frame 2 not defined"));

        let mut t = good_trace();
        t.packet[8].clear_trusted_packet_sequence_id();
        assert!(has(&errors_of(&t), "without trusted_packet_sequence_id"));
    }

    #[test]
    fn detects_track_slice_and_flow_errors() {
        let mut t = good_trace();
        let descriptor = t.packet.remove(7);
        t.packet.insert(9, descriptor);
        assert!(has(&errors_of(&t), "used before its descriptor"));

        let mut t = good_trace();
        t.packet.remove(9);
        let e = errors_of(&t);
        assert!(has(&e, "never ended"), "{e:?}");
        assert!(!has(&e, "terminated but never started"), "{e:?}");

        let mut t = good_trace();
        t.packet[9].set_timestamp(900);
        let e = errors_of(&t);
        assert!(has(&e, "without an open BEGIN"), "{e:?}");
        assert!(has(&e, "never started"), "{e:?}");

        let mut t = good_trace();
        let mut reuse = event(1450, 55, Type::TYPE_INSTANT, Some(1));
        reuse.mut_track_event().flow_ids.push(9);
        t.packet.push(reuse);
        assert!(has(&errors_of(&t), "flow id 9 reused"));

        let mut t = good_trace();
        t.packet[9].mut_track_event().terminating_flow_ids.clear();
        for ts in [1450, 1460] {
            let mut e = event(ts, 55, Type::TYPE_INSTANT, Some(1));
            e.mut_track_event().flow_ids.push(9);
            t.packet.push(e);
        }
        assert!(has(&errors_of(&t), "flow id 9 on a third event"));

        let mut t = good_trace();
        t.packet[11].mut_track_event().set_track_uuid(55);
        assert!(has(&errors_of(&t), "counter value on non-counter track"));
    }

    #[test]
    fn detects_processes_without_cmdline_and_unweighted_descriptors() {
        let mut t = good_trace();
        t.packet[2].mut_process_tree().processes[0].cmdline.clear();
        assert!(has(&errors_of(&t), "has no cmdline"));

        let mut t = good_trace();
        let mut body = Vec::new();
        encode::varint_field(11, 5, &mut body);
        let mut p = seq_packet(1700, 2);
        p.mut_unknown_fields().add_length_delimited(135, body);
        t.packet.push(p);
        assert!(has(&errors_of(&t), "without a primary counter descriptor"));
    }
}
