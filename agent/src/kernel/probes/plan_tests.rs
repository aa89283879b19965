//! Planning with made-up maps and resolved libraries.

use xpuscope_probes::catalog::Library;

use super::*;
use crate::kernel::probes::fake_source::{CUDART, CUPTI, FakeSource, PAST_ENDBR, level_bit};
use crate::kernel::probes::plan::Predicted;

const BASE: u64 = 0x7f10_0000_0000;
const OTHER_BASE: u64 = 0x7f20_0000_0000;

fn level(n: u8) -> CaptureLevels {
    CaptureLevels {
        device: DeviceLevel::new(n).unwrap(),
        launch_counts: true,
    }
}

fn site(ino: u64, function_start: u64) -> ProbeSite {
    ProbeSite {
        dev: 1,
        ino,
        offset: function_start + PAST_ENDBR,
    }
}

/// (address, slot, function) of each probe announced.
type Announced = Vec<(u64, u32, &'static str)>;

fn functions(update: &TableUpdate) -> Announced {
    update
        .probes
        .iter()
        .map(|(ip, slot, t)| (*ip, *slot, t.function.name))
        .collect()
}

#[test]
fn a_new_library_gets_the_probes_of_the_level_with_slots_and_a_table_update() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    let mut planner = Planner::new(level(0), false);
    let plan = planner.plan(&[10], &mut src);

    // Level 0: cudaMalloc only (cudaMemcpyAsync is level 1).
    assert_eq!(plan.live.len(), 1, "{plan:?}");
    let work = &plan.live[0];
    assert_eq!(work.site, site(11, 0x1100));
    assert_eq!((work.path.as_str(), work.slot), (CUDART, 1));
    assert_eq!(work.name, ("cudart", "cudaMalloc"));
    assert_eq!(
        work.spec.level_bit,
        level_bit(Library::Cudart, "cudaMalloc")
    );
    assert_eq!(plan.uses, vec![(10, site(11, 0x1100))]);
    assert_eq!(
        plan.libraries
            .iter()
            .map(|(pid, path, n, sites)| (*pid, path.clone(), *n, sites.len()))
            .collect::<Vec<_>>(),
        vec![(10, CUDART.to_string(), 1, 1)]
    );
    assert_eq!(plan.updates.len(), 1);
    let update = &plan.updates[0];
    assert_eq!(update.tgid, 10);
    assert_eq!(
        update.identity.rank.as_deref(),
        Some("10"),
        "read at plan time"
    );
    assert_eq!(
        functions(update),
        vec![(
            src.probe_address(CUDART, "cudaMalloc", BASE),
            1,
            "cudaMalloc"
        )]
    );
    assert!(
        update.maps.find(BASE + 0x1100).is_some(),
        "the maps travel with it"
    );
    assert_eq!(planner.probes_of(10).count(), 1);

    // Nothing changed: nothing to do.
    assert!(planner.plan(&[10], &mut src).is_empty());
}

#[test]
fn allocation_stacks_are_asked_for_only_with_stacks_on() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    let with = Planner::new(level(0), true).plan(&[10], &mut src);
    let without = Planner::new(level(0), false).plan(&[10], &mut src);
    assert_ne!(with.live[0].spec.flags & RETURN_USER_STACK, 0);
    assert_eq!(without.live[0].spec.flags & RETURN_USER_STACK, 0);
}

#[test]
fn a_library_gone_leaves_its_site_and_slot_for_the_next_mapping() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    let mut planner = Planner::new(level(0), false);
    planner.plan(&[10], &mut src);

    src.map(10, &[]);
    let plan = planner.plan(&[10], &mut src);
    assert!(plan.live.is_empty() && plan.updates.is_empty(), "{plan:?}");
    assert_eq!(planner.probes_of(10).count(), 0);

    // Mapped again (elsewhere): the same site, the same slot.
    src.map(10, &[(CUDART, 11, OTHER_BASE)]);
    let plan = planner.plan(&[10], &mut src);
    assert_eq!(plan.live.len(), 1);
    assert_eq!(
        (plan.live[0].site, plan.live[0].slot),
        (site(11, 0x1100), 1)
    );
    assert_eq!(
        functions(&plan.updates[0]),
        vec![(
            src.probe_address(CUDART, "cudaMalloc", OTHER_BASE),
            1,
            "cudaMalloc"
        )]
    );
    assert_eq!(src.resolved.len(), 1, "resolved once per (path, inode)");
}

#[test]
fn a_library_replaced_at_a_new_inode_gets_a_new_site_and_slot() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    let mut planner = Planner::new(level(0), false);
    planner.plan(&[10], &mut src);

    // A package upgrade: the same path, a new file.
    src.files.insert(CUDART.into(), (1, 12));
    src.map(10, &[(CUDART, 12, BASE)]);
    let plan = planner.plan(&[10], &mut src);
    assert_eq!(plan.live.len(), 1, "{plan:?}");
    assert_eq!(
        (plan.live[0].site, plan.live[0].slot),
        (site(12, 0x1100), 2)
    );
    assert_eq!(functions(&plan.updates[0])[0].1, 2);
    assert_eq!(src.resolved, vec![CUDART.to_string(), CUDART.to_string()]);
    let sites: Vec<ProbeSite> = planner.probes_of(10).map(|(_, s)| s).collect();
    assert_eq!(
        sites,
        vec![site(12, 0x1100)],
        "the old file's probes are gone"
    );
}

#[test]
fn two_processes_mapping_one_file_share_its_site_and_slot() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    src.map(11, &[(CUDART, 11, OTHER_BASE)]);
    let mut planner = Planner::new(level(1), false);
    let plan = planner.plan(&[10, 11], &mut src);
    assert_eq!(plan.live.len(), 2, "one per site: {:?}", plan.live);
    assert_eq!(plan.uses.len(), 4, "two functions in two processes");
    assert_eq!(plan.updates.len(), 2);
    let slots = |u: &TableUpdate| -> Vec<u32> { u.probes.iter().map(|p| p.1).collect() };
    assert_eq!(slots(&plan.updates[0]), slots(&plan.updates[1]));
    assert_ne!(
        plan.updates[0].probes[0].0, plan.updates[1].probes[0].0,
        "own addresses"
    );
    assert_eq!(src.resolved.len(), 1);
}

#[test]
fn slot_exhaustion_is_counted_and_the_probe_left_out() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    // Slots 1..2: one slot for two functions.
    let mut planner = Planner::new(level(1), false).with_slot_limit(2);
    let plan = planner.plan(&[10], &mut src);
    assert_eq!(plan.live.len(), 1);
    assert_eq!(planner.stats.slots_exhausted, 1);
    assert_eq!(
        plan.updates[0].probes.len(),
        1,
        "no meaning for a probe without a slot"
    );
    assert_eq!(
        plan.libraries
            .iter()
            .map(|(pid, path, n, sites)| (*pid, path.clone(), *n, sites.len()))
            .collect::<Vec<_>>(),
        vec![(10, CUDART.to_string(), 1, 1)]
    );
}

#[test]
fn processes_no_longer_traced_are_forgotten() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    src.map(11, &[(CUDART, 11, OTHER_BASE)]);
    let mut planner = Planner::new(level(0), false);
    planner.plan(&[10, 11], &mut src);
    let plan = planner.plan(&[11], &mut src);
    assert_eq!(plan.gone, vec![10]);
    assert_eq!(planner.probes_of(10).count(), 0);
    assert_eq!(planner.probes_of(11).count(), 1);
    // A process whose maps cannot be read (exited since) is skipped.
    src.maps.remove(&12);
    assert!(planner.plan(&[11, 12], &mut src).is_empty());
}

#[test]
fn unresolvable_or_unopenable_libraries_count_as_failures() {
    let mut src = FakeSource::nvidia();
    src.exports.remove(CUPTI);
    src.files.remove(CUDART);
    src.map(10, &[(CUDART, 11, BASE), (CUPTI, 21, OTHER_BASE)]);
    let mut planner = Planner::new(level(2), false);
    let plan = planner.plan(&[10], &mut src);
    assert!(plan.live.is_empty() && plan.updates.is_empty(), "{plan:?}");
    assert_eq!(planner.stats.library_failures, 2);
}

#[test]
fn raising_the_level_plans_the_added_probes_of_every_process() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    src.map(11, &[(CUDART, 11, OTHER_BASE), (CUPTI, 21, BASE)]);
    let mut planner = Planner::new(level(0), false);
    planner.plan(&[10, 11], &mut src);

    let plan = planner.set_device_level(DeviceLevel::new(1).unwrap(), &mut src);
    assert_eq!(plan.probe_levels, Some(0b11));
    assert_eq!(planner.levels(), level(1));
    let live: Vec<(ProbeSite, &str)> = plan.live.iter().map(|w| (w.site, w.name.1)).collect();
    assert_eq!(live, vec![(site(11, 0x1200), "cudaMemcpyAsync")]);
    assert!(plan.silence.is_empty());
    let updates: Vec<(u32, Announced)> = plan
        .updates
        .iter()
        .map(|u| (u.tgid, functions(u)))
        .collect();
    let copy = |base| src.probe_address(CUDART, "cudaMemcpyAsync", base);
    assert_eq!(
        updates,
        vec![
            (10, vec![(copy(BASE), 2, "cudaMemcpyAsync")]),
            (11, vec![(copy(OTHER_BASE), 2, "cudaMemcpyAsync")]),
        ]
    );
    assert_eq!(planner.probes_of(11).count(), 2, "level 0 and 1 probes");

    // Lowering: the level-1 site is silenced, by its slot.
    let plan = planner.set_device_level(DeviceLevel::new(0).unwrap(), &mut src);
    assert_eq!(plan.probe_levels, Some(0b1));
    assert_eq!(plan.silence, vec![(site(11, 0x1200), 2)]);
    assert!(plan.live.is_empty() && plan.updates.is_empty());
    // The same level again: nothing.
    assert!(
        planner
            .set_device_level(DeviceLevel::new(0).unwrap(), &mut src)
            .is_empty()
    );
}

/// A program starting: the libraries it will load are probed by file
/// before it maps them (slots announced, no process table yet), once per
/// program start; its loader is to be hooked; when it maps the library,
/// the same sites (and slots) serve it, nothing is attached twice.
#[test]
fn a_starting_program_gets_its_predicted_libraries_probed_by_file_once() {
    let mut src = FakeSource::nvidia();
    src.predicted.insert(
        10,
        Predicted {
            libraries: vec![(Library::Cudart, CUDART.into())],
            interpreter: Some("/lib64/ld-linux-x86-64.so.2".into()),
        },
    );
    src.maps.insert(10, String::new()); // nothing mapped yet
    let mut planner = Planner::new(level(0), false);
    let plan = planner.plan_early(10, true, &mut src);
    assert_eq!(plan.files, vec![(CUDART.to_string(), 1)], "{plan:?}");
    assert_eq!(plan.live.len(), 1);
    assert_eq!(plan.live[0].site, site(11, 0x1100));
    assert_eq!(plan.live[0].slot, 1);
    assert!(!plan.live[0].urgent, "cudaMalloc is no set-up call");
    let slots: Vec<(u32, &str)> = plan
        .slots
        .iter()
        .map(|(s, t)| (*s, t.function.name))
        .collect();
    assert_eq!(slots, vec![(1, "cudaMalloc")]);
    assert!(plan.updates.is_empty(), "nothing mapped: no process table");
    assert_eq!(
        plan.loaders,
        vec!["/lib64/ld-linux-x86-64.so.2".to_string()]
    );

    // Its loader reports again (the libraries are mapped now): no second
    // prediction; the mapped library reuses the site and its slot.
    src.map(10, &[(CUDART, 11, BASE)]);
    let plan = planner.plan_early(10, false, &mut src);
    assert_eq!(
        src.predictions,
        vec![10],
        "predicted once per program start"
    );
    assert!(plan.files.is_empty() && plan.slots.is_empty());
    assert_eq!(plan.live.len(), 1);
    assert_eq!(
        (plan.live[0].site, plan.live[0].slot),
        (site(11, 0x1100), 1)
    );
    assert_eq!(plan.updates.len(), 1);
    assert_eq!(functions(&plan.updates[0])[0].1, 1);

    // A second process starting the same program: predicted, but the file
    // is probed already.
    src.predicted.insert(11, src.predicted[&10].clone());
    src.maps.insert(11, String::new());
    let plan = planner.plan_early(11, true, &mut src);
    assert!(plan.files.is_empty() && plan.live.is_empty(), "{plan:?}");
    // An exec of process 10 predicts again.
    planner.plan_early(10, true, &mut src);
    assert_eq!(src.predictions, vec![10, 11, 10]);
    // A forgotten process is predicted again when it comes back.
    planner.plan(&[11], &mut src);
    planner.plan_early(10, false, &mut src);
    assert_eq!(src.predictions, vec![10, 11, 10, 10]);
}

/// Communicator set-up calls are marked urgent (attached first).
#[test]
fn set_up_calls_are_urgent() {
    let nccl = "/opt/nccl/lib/libnccl.so.2";
    let mut src = FakeSource::nvidia();
    src.files.insert(nccl.into(), (1, 31));
    src.exports.insert(
        nccl.into(),
        vec![("ncclAllReduce", 0x1100), ("ncclCommInitRank", 0x1200)],
    );
    src.predicted.insert(
        10,
        Predicted {
            libraries: vec![(Library::Nccl, nccl.into())],
            interpreter: None,
        },
    );
    let mut planner = Planner::new(level(0), false);
    let plan = planner.plan_early(10, true, &mut src);
    let urgent: Vec<(&str, bool)> = plan.live.iter().map(|w| (w.name.1, w.urgent)).collect();
    assert_eq!(
        urgent,
        vec![("ncclAllReduce", false), ("ncclCommInitRank", true)]
    );
    assert!(plan.loaders.is_empty());
}

/// Launches are counted below level 1 (their entry alone); with launch
/// counts off they are not probed there at all.
#[test]
fn launches_below_their_level_are_planned_only_with_launch_counts() {
    let mut src = crate::kernel::probes::fake_source::FakeSource::nvidia_with_launch();
    src.map(10, &[(CUDART, 11, BASE)]);
    let plan = Planner::new(level(0), false).plan(&[10], &mut src);
    let live: Vec<(&str, bool)> = plan.live.iter().map(|w| (w.name.1, w.entry_only)).collect();
    assert_eq!(
        live,
        vec![("cudaMalloc", false), ("cudaLaunchKernel", true)]
    );

    let off = CaptureLevels {
        launch_counts: false,
        ..level(0)
    };
    let plan = Planner::new(off, false).plan(&[10], &mut src);
    let live: Vec<&str> = plan.live.iter().map(|w| w.name.1).collect();
    assert_eq!(live, vec!["cudaMalloc"]);
    // At level 1 the launch is recorded either way, both ends.
    let plan = Planner::new(
        CaptureLevels {
            launch_counts: false,
            ..level(1)
        },
        false,
    )
    .plan(&[10], &mut src);
    assert!(
        plan.live
            .iter()
            .any(|w| w.name.1 == "cudaLaunchKernel" && !w.entry_only),
        "{plan:?}"
    );
}

/// A process whose loader reported a link-map change (its debugger hook
/// works: each dlopen is announced and rescanned at once) has its maps
/// read by the periodic rounds only every `hooked_rescan`; one that never
/// reported is read at every round, and so is one that exec'd until its
/// new program's loader reports.
#[test]
fn a_process_whose_loader_reports_is_rescanned_by_the_rounds_only_now_and_then() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    src.map(11, &[(CUDART, 11, OTHER_BASE)]);
    let mut planner =
        Planner::new(level(2), false).with_hooked_rescan(std::time::Duration::from_secs(3600));
    planner.plan(&[10, 11], &mut src);
    // 10's loader reports: its maps are read now.
    planner.plan_early(10, false, &mut src);
    let reads = |src: &FakeSource, pid| src.maps_reads[&pid];
    let (r10, r11) = (reads(&src, 10), reads(&src, 11));
    planner.plan(&[10, 11], &mut src);
    planner.plan(&[10, 11], &mut src);
    assert_eq!(reads(&src, 10), r10, "reported: the rounds leave it");
    assert_eq!(reads(&src, 11), r11 + 2, "never reported: every round");

    // Its dlopen is announced: read at once, the new library planned.
    src.map(10, &[(CUDART, 11, BASE), (CUPTI, 21, BASE)]);
    let plan = planner.plan_early(10, false, &mut src);
    assert_eq!(reads(&src, 10), r10 + 1);
    assert!(
        plan.updates
            .iter()
            .any(|u| u.tgid == 10 && functions(u).iter().any(|f| f.2.starts_with("cupti"))),
        "{:?}",
        plan.updates.iter().map(functions).collect::<Vec<_>>()
    );

    // A new program: every round again, until its loader reports.
    planner.plan_early(10, true, &mut src);
    let r = reads(&src, 10);
    planner.plan(&[10, 11], &mut src);
    assert_eq!(reads(&src, 10), r + 1);

    // Gone and back (a reused pid): every round again.
    planner.plan_early(10, false, &mut src);
    planner.plan(&[11], &mut src);
    let r = reads(&src, 10);
    planner.plan(&[10, 11], &mut src);
    planner.plan(&[10, 11], &mut src);
    assert_eq!(reads(&src, 10), r + 2);
}

/// A process traced after its loader's start-up reports (found by the
/// service's discovery, given to `agent attach`) reports its later
/// link-map changes all the same once its maps hold a loader whose hook is
/// attached: the rounds leave it as they leave one that reported. One that
/// maps another loader is read at every round.
#[test]
fn a_process_mapping_a_hooked_loader_is_rescanned_by_the_rounds_only_now_and_then() {
    const LOADER: &str = "/usr/lib64/ld-linux-x86-64.so.2";
    const OTHER_LOADER: &str = "/opt/glibc/lib/ld-linux-x86-64.so.2";
    const LOADER_BASE: u64 = 0x7f30_0000_0000;
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE), (LOADER, 30, LOADER_BASE)]);
    src.map(
        11,
        &[(CUDART, 11, OTHER_BASE), (OTHER_LOADER, 31, LOADER_BASE)],
    );
    let mut planner =
        Planner::new(level(2), false).with_hooked_rescan(std::time::Duration::from_secs(3600));
    // `stat`'s encoding of the device maps print as `01:00`.
    planner.loaders_hooked(&[(libc::makedev(1, 0), 30)]);
    planner.plan(&[10, 11], &mut src);
    let reads = |src: &FakeSource, pid| src.maps_reads[&pid];
    let (r10, r11) = (reads(&src, 10), reads(&src, 11));
    planner.plan(&[10, 11], &mut src);
    planner.plan(&[10, 11], &mut src);
    assert_eq!(
        reads(&src, 10),
        r10,
        "its loader reports: the rounds leave it"
    );
    assert_eq!(reads(&src, 11), r11 + 2, "another loader: every round");

    // A new program mapping the same loader: read at its start, then left.
    planner.plan_early(10, true, &mut src);
    let r = reads(&src, 10);
    planner.plan(&[10, 11], &mut src);
    assert_eq!(reads(&src, 10), r);

    // The hooks known now name 11's loader only: 10's next program is read
    // at every round again.
    planner.loaders_hooked(&[(libc::makedev(1, 0), 31)]);
    planner.plan_early(10, true, &mut src);
    let (r10, r11) = (reads(&src, 10), reads(&src, 11));
    planner.plan(&[10, 11], &mut src);
    planner.plan(&[10, 11], &mut src);
    assert_eq!(reads(&src, 10), r10 + 2);
    assert_eq!(reads(&src, 11), r11 + 1, "read once more, then left");
}

/// `stat` packs a device number one way, `/proc/PID/maps` prints it
/// another: the two name the same device.
#[test]
fn a_stat_device_number_reads_as_maps_print_it() {
    for (major, minor, printed) in [
        (1, 0, "01:00"),
        (0x103, 3, "103:03"),
        (8, 0x1234, "08:1234"),
    ] {
        let maps = xpuscope_probes::maps::ProcessMaps::parse(&format!(
            "7f0000000000-7f0000001000 r-xp 00000000 {printed} 42 /lib/ld.so\n"
        ));
        assert_eq!(
            maps_dev(libc::makedev(major, minor)),
            maps.mappings()[0].dev,
            "{printed}"
        );
    }
}

/// The rounds' safety net: past `hooked_rescan`, a reported process is
/// read again (code mapped without the loader, a notice lost).
#[test]
fn a_reported_process_is_still_rescanned_past_the_interval() {
    let mut src = FakeSource::nvidia();
    src.map(10, &[(CUDART, 11, BASE)]);
    let mut planner = Planner::new(level(0), false).with_hooked_rescan(std::time::Duration::ZERO);
    planner.plan_early(10, false, &mut src);
    let r = src.maps_reads[&10];
    planner.plan(&[10], &mut src);
    planner.plan(&[10], &mut src);
    assert_eq!(src.maps_reads[&10], r + 2);
}
