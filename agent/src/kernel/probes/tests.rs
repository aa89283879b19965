//! The device probes end to end over the fakes: planning with made-up
//! processes, applying through [`FakeAttacher`].

use xpuscope_probes::catalog::Library;

use super::attach::{FakeAttacher, FakeCall, ProbeEnd};
use super::fake_source::{CUDART, CUPTI, FakeSource, PAST_ENDBR, level_bit};
use super::*;

const BASE: u64 = 0x7f10_0000_0000;
const OTHER_BASE: u64 = 0x7f20_0000_0000;
const MALLOC: u64 = 0x1100 + PAST_ENDBR;
const COPY: u64 = 0x1200 + PAST_ENDBR;
const NEXT_RECORD: u64 = 0x2100 + PAST_ENDBR;
const LAUNCH: u64 = 0x1300 + PAST_ENDBR;

type Probes = DeviceProbes<u64>;

fn probes(level: u8) -> Probes {
    DeviceProbes::new(
        CaptureLevels {
            device: DeviceLevel::new(level).unwrap(),
            launch_counts: true,
        },
        false,
    )
}

/// One scan: plan, then apply.
fn scan(p: &mut Probes, pids: &[u32], src: &mut FakeSource, k: &mut FakeAttacher) -> Plan {
    let mut plan = p.plan(pids, src);
    let updates = std::mem::take(&mut plan.updates);
    p.apply(k, plan).expect("applied");
    Plan {
        updates,
        ..Plan::default()
    }
}

fn set_level(p: &mut Probes, n: u8, src: &mut FakeSource, k: &mut FakeAttacher) -> Plan {
    let mut plan = p.set_device_level(DeviceLevel::new(n).unwrap(), src);
    let updates = std::mem::take(&mut plan.updates);
    p.apply(k, plan).expect("applied");
    Plan {
        updates,
        ..Plan::default()
    }
}

fn offsets(k: &FakeAttacher) -> Vec<(ProbeEnd, u64)> {
    k.attaches().into_iter().map(|(e, o, _)| (e, o)).collect()
}

#[test]
fn a_shared_file_gets_one_probe_pair_with_its_slot_as_cookie_spec_first() {
    let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(0));
    src.map(10, &[(CUDART, 11, BASE)]);
    src.map(11, &[(CUDART, 11, OTHER_BASE)]);
    scan(&mut p, &[10, 11], &mut src, &mut k);
    let malloc_bit = level_bit(Library::Cudart, "cudaMalloc");
    assert_eq!(
        k.calls,
        vec![
            FakeCall::Load,
            FakeCall::WriteSpec {
                slot: 1,
                level_bit: malloc_bit
            },
            FakeCall::Attach {
                end: ProbeEnd::Entry,
                path: CUDART.into(),
                offset: MALLOC,
                cookie: 1
            },
            FakeCall::Attach {
                end: ProbeEnd::Return,
                path: CUDART.into(),
                offset: MALLOC,
                cookie: 1
            },
        ]
    );
    let stats = p.stats();
    assert_eq!(
        (stats.attached, stats.attach_failures, stats.libraries),
        (2, 0, 2)
    );
    // A later process mapping the file: no attach, no load.
    src.map(12, &[(CUDART, 11, BASE)]);
    scan(&mut p, &[10, 11, 12], &mut src, &mut k);
    assert_eq!(k.calls.len(), 4);
    assert_eq!(p.stats().attached, 3);
}

#[test]
fn a_failed_entry_or_return_attach_rolls_back_and_silences_the_slot() {
    for failing in [ProbeEnd::Entry, ProbeEnd::Return] {
        let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(0));
        k.fail_attach = vec![(failing, MALLOC)];
        src.map(10, &[(CUDART, 11, BASE)]);
        scan(&mut p, &[10], &mut src, &mut k);
        assert!(
            k.open_links.is_empty(),
            "{failing:?}: no half pair left: {:?}",
            k.calls
        );
        assert_eq!(
            k.calls.last(),
            Some(&FakeCall::WriteSpec {
                slot: 1,
                level_bit: 0
            })
        );
        assert!(!k.is_live(1));
        let stats = p.stats();
        assert_eq!(
            (stats.attached, stats.attach_failures),
            (0, 1),
            "{failing:?}"
        );
        assert!(p.hits(&k).is_empty(), "no probe to count");

        // The next process mapping the file tries again, and succeeds.
        k.fail_attach.clear();
        src.map(11, &[(CUDART, 11, OTHER_BASE)]);
        scan(&mut p, &[10, 11], &mut src, &mut k);
        assert_eq!(k.open_links.len(), 2, "{failing:?}");
        assert!(k.is_live(1));
        assert_eq!(p.stats().attached, 1);
    }
}

#[test]
fn a_remapped_file_reuses_its_probe_and_a_replaced_file_gets_a_new_one() {
    let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(0));
    src.map(10, &[(CUDART, 11, BASE)]);
    scan(&mut p, &[10], &mut src, &mut k);
    src.map(10, &[]);
    scan(&mut p, &[10], &mut src, &mut k);
    src.map(10, &[(CUDART, 11, OTHER_BASE)]);
    let plan = scan(&mut p, &[10], &mut src, &mut k);
    assert_eq!(plan.updates.len(), 1, "the new addresses are announced");
    assert_eq!(
        offsets(&k),
        vec![(ProbeEnd::Entry, MALLOC), (ProbeEnd::Return, MALLOC)],
        "never a second probe at one place"
    );
    assert_eq!(k.open_links.len(), 2);

    // The file replaced by a copy at a new inode: old probes get no hits
    // from it, so it gets its own pair and slot.
    src.files.insert(CUDART.into(), (1, 12));
    src.map(10, &[(CUDART, 12, OTHER_BASE)]);
    scan(&mut p, &[10], &mut src, &mut k);
    let attaches = k.attaches();
    assert_eq!(attaches.len(), 4);
    assert_eq!(attaches[2], (ProbeEnd::Entry, MALLOC, 2));
    assert_eq!(k.open_links.len(), 4);
}

#[test]
fn hits_are_read_by_function_and_by_address() {
    let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(1));
    src.map(10, &[(CUDART, 11, BASE)]);
    src.map(11, &[(CUDART, 11, OTHER_BASE)]);
    scan(&mut p, &[10, 11], &mut src, &mut k);
    let slot_of = |offset| {
        k.attaches()
            .into_iter()
            .find(|(_, o, _)| *o == offset)
            .map(|(_, _, c)| c)
            .unwrap()
    };
    let (malloc_slot, launch_slot) = (slot_of(MALLOC), slot_of(COPY));
    k.hits.insert(malloc_slot, 7);
    k.hits.insert(launch_slot, 3);
    let by_fn = p.hits(&k);
    assert_eq!(by_fn.len(), 2);
    assert_eq!(by_fn[&("cudart", "cudaMalloc")], 7);
    assert_eq!(by_fn[&("cudart", "cudaMemcpyAsync")], 3);
    let by_addr = p.hits_by_address(&k, 11);
    assert_eq!(by_addr.len(), 2);
    assert_eq!(by_addr[&(OTHER_BASE + MALLOC)], 7);
    assert_eq!(by_addr[&(OTHER_BASE + COPY)], 3);
    assert!(p.hits_by_address(&k, 99).is_empty());
}

#[test]
fn levels_change_at_runtime_attaching_once_and_silencing_what_is_dropped() {
    let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(0));
    src.map(10, &[(CUDART, 11, BASE), (CUPTI, 21, OTHER_BASE)]);
    scan(&mut p, &[10], &mut src, &mut k);
    assert_eq!(offsets(&k).len(), 2, "level 0: cudaMalloc only");

    // 0 -> 2: launches (level 1) and activity records (level 2) attached,
    // announced first, the mask written to CONFIG.
    let plan = set_level(&mut p, 2, &mut src, &mut k);
    assert_eq!(k.probe_levels, 0b111);
    assert_eq!(plan.updates.len(), 1);
    let mut announced: Vec<&str> = plan.updates[0]
        .probes
        .iter()
        .map(|(_, _, t)| t.function.name)
        .collect();
    announced.sort_unstable();
    assert_eq!(
        announced,
        vec!["cudaMemcpyAsync", "cuptiActivityGetNextRecord"]
    );
    let attached = offsets(&k);
    assert_eq!(attached.len(), 6);
    for off in [COPY, NEXT_RECORD] {
        assert!(attached.contains(&(ProbeEnd::Entry, off)), "{off:#x}");
        assert!(attached.contains(&(ProbeEnd::Return, off)), "{off:#x}");
    }
    let slot_of = |k: &FakeAttacher, offset| {
        k.attaches()
            .into_iter()
            .find(|(_, o, _)| *o == offset)
            .map(|(_, _, c)| c)
            .unwrap()
    };
    let (malloc, launch, record) = (
        slot_of(&k, MALLOC),
        slot_of(&k, COPY),
        slot_of(&k, NEXT_RECORD),
    );
    assert!(k.is_live(malloc) && k.is_live(launch) && k.is_live(record));

    // 2 -> 1: the activity probe silenced, its link kept.
    set_level(&mut p, 1, &mut src, &mut k);
    assert_eq!(k.probe_levels, 0b11);
    assert!(k.is_live(malloc) && k.is_live(launch) && !k.is_live(record));
    assert_eq!(k.open_links.len(), 6, "nothing detached");

    // 1 -> 2 again: re-enabled without a second attach.
    let plan = set_level(&mut p, 2, &mut src, &mut k);
    assert_eq!(offsets(&k).len(), 6, "no attach: {:?}", k.calls);
    assert!(k.is_live(record));
    assert_eq!(
        plan.updates.len(),
        1,
        "the trace stage is told again (harmless)"
    );
    assert_eq!(
        k.specs[&record].level_bit,
        level_bit(Library::Cupti, "cuptiActivityGetNextRecord")
    );

    // 2 -> 0 -> 1: launches silenced, then back, still one pair each.
    set_level(&mut p, 0, &mut src, &mut k);
    assert!(k.is_live(malloc) && !k.is_live(launch) && !k.is_live(record));
    assert_eq!(p.hits_by_address(&k, 10).len(), 1, "level-0 probes only");
    set_level(&mut p, 1, &mut src, &mut k);
    assert!(k.is_live(launch) && !k.is_live(record));
    assert_eq!(offsets(&k).len(), 6);
    assert_eq!(
        k.calls
            .iter()
            .filter(|c| matches!(c, FakeCall::Load))
            .count(),
        1
    );

    // A process that maps the libraries after the change gets the level
    // now in force.
    src.map(11, &[(CUDART, 11, BASE), (CUPTI, 21, OTHER_BASE)]);
    let plan = scan(&mut p, &[10, 11], &mut src, &mut k);
    let mut announced: Vec<&str> = plan
        .updates
        .iter()
        .flat_map(|u| &u.probes)
        .map(|(_, _, t)| t.function.name)
        .collect();
    announced.sort_unstable();
    assert_eq!(announced, vec!["cudaMalloc", "cudaMemcpyAsync"]);
    assert_eq!(offsets(&k).len(), 6);
}

#[test]
fn detach_all_silences_every_probe_and_releases_every_link() {
    let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(1));
    src.map(10, &[(CUDART, 11, BASE)]);
    scan(&mut p, &[10], &mut src, &mut k);
    assert_eq!(k.open_links.len(), 4);
    p.detach_all(&mut k);
    assert!(k.open_links.is_empty());
    assert!(!k.is_live(1) && !k.is_live(2));
    let Some(FakeCall::Release(links)) = k.calls.last() else {
        panic!("{:?}", k.calls)
    };
    assert_eq!(links.len(), 4);
}

#[test]
fn programs_that_do_not_load_disable_device_probes_once() {
    let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(0));
    k.fail_load = true;
    src.map(10, &[(CUDART, 11, BASE)]);
    let plan = p.plan(&[10], &mut src);
    assert!(
        p.apply(&mut k, plan)
            .unwrap_err()
            .to_string()
            .contains("load")
    );
    src.map(11, &[(CUDART, 11, OTHER_BASE)]);
    let plan = p.plan(&[10, 11], &mut src);
    assert!(p.apply(&mut k, plan).is_ok(), "the recording goes on");
    assert_eq!(k.calls, vec![FakeCall::Load], "no second try");
    assert_eq!(p.stats().attach_failures, 1);
}

/// A starting program's predicted library: probed by file with its
/// set-up calls attached first, programs loaded once (ahead, by
/// `load_programs`), and the process mapping it later reuses every pair.
#[test]
fn a_predicted_library_is_attached_set_up_calls_first_and_reused_when_mapped() {
    let nccl = "/opt/nccl/lib/libnccl.so.2";
    let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(0));
    src.files.insert(nccl.into(), (1, 31));
    src.exports.insert(
        nccl.into(),
        vec![
            ("ncclAllReduce", 0x1100),
            ("ncclBroadcast", 0x1200),
            ("ncclCommInitRank", 0x1300),
        ],
    );
    src.predicted.insert(
        10,
        plan::Predicted {
            libraries: vec![(Library::Nccl, nccl.into())],
            interpreter: None,
        },
    );
    p.load_programs(&mut k).unwrap();
    let plan = p.plan_early(10, true, &mut src);
    assert_eq!(plan.slots.len(), 3);
    p.apply(&mut k, plan).unwrap();
    let attached: Vec<(ProbeEnd, u64)> = offsets(&k);
    assert_eq!(
        attached[..2],
        [
            (ProbeEnd::Entry, 0x1300 + PAST_ENDBR),
            (ProbeEnd::Return, 0x1300 + PAST_ENDBR)
        ],
        "ncclCommInitRank first: {attached:?}"
    );
    assert_eq!(attached.len(), 6);
    assert_eq!(
        k.calls.iter().filter(|c| **c == FakeCall::Load).count(),
        1,
        "loaded once, ahead"
    );
    assert_eq!(p.stats().files_ahead, 1);
    // The process maps it: same pairs, nothing attached again.
    src.map(10, &[(nccl, 31, BASE)]);
    let plan = p.plan_early(10, false, &mut src);
    assert_eq!(plan.updates.len(), 1);
    p.apply(&mut k, plan).unwrap();
    assert_eq!(offsets(&k).len(), 6);
    assert_eq!(p.stats().attached, 3);
}

#[test]
fn a_files_sites_are_one_link_per_end_where_the_kernel_has_uprobe_multi() {
    let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(1));
    k.multi = true;
    src.map(10, &[(CUDART, 11, BASE)]);
    src.map(11, &[(CUDART, 11, OTHER_BASE)]);
    scan(&mut p, &[10, 11], &mut src, &mut k);
    let many: Vec<(ProbeEnd, Vec<(u64, u32)>)> = k
        .calls
        .iter()
        .filter_map(|c| match c {
            FakeCall::AttachMany { end, sites, .. } => Some((*end, sites.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(many.len(), 2, "{:?}", k.calls);
    assert_eq!(many[0].0, ProbeEnd::Entry);
    assert_eq!(many[1].0, ProbeEnd::Return);
    assert_eq!(many[0].1, many[1].1, "the same sites at both ends");
    let mut sites = many[0].1.clone();
    sites.sort_unstable();
    assert_eq!(
        sites,
        vec![(MALLOC, 1), (COPY, 2)],
        "offsets with their slots"
    );
    assert!(k.attaches().is_empty(), "nothing attached one by one");
    // Every spec is written before the link that makes it fire.
    let first_link = k
        .calls
        .iter()
        .position(|c| matches!(c, FakeCall::AttachMany { .. }))
        .unwrap();
    for slot in [1, 2] {
        let spec = k
            .calls
            .iter()
            .position(|c| matches!(c, FakeCall::WriteSpec { slot: s, .. } if *s == slot))
            .unwrap();
        assert!(spec < first_link, "slot {slot}: {:?}", k.calls);
        assert!(k.is_live(slot));
    }
    let stats = p.stats();
    assert_eq!((stats.links, stats.multi_links), (2, 2));
    assert_eq!(k.open_links.len(), 2);
    p.detach_all(&mut k);
    assert!(k.open_links.is_empty());
    assert!(!k.is_live(1) && !k.is_live(2));
}

#[test]
fn a_uprobe_multi_link_that_fails_falls_back_to_one_link_per_function() {
    let (mut src, mut k, mut p) = (FakeSource::nvidia(), FakeAttacher::default(), probes(1));
    k.multi = true;
    k.fail_multi = vec![ProbeEnd::Return];
    src.map(10, &[(CUDART, 11, BASE)]);
    scan(&mut p, &[10], &mut src, &mut k);
    // The entry link made before the return's failed is detached at once.
    assert!(
        k.calls.iter().any(|c| matches!(c, FakeCall::Detach(_))),
        "{:?}",
        k.calls
    );
    let one_by_one = offsets(&k);
    assert_eq!(one_by_one.len(), 4, "{one_by_one:?}");
    for end in [ProbeEnd::Entry, ProbeEnd::Return] {
        for offset in [MALLOC, COPY] {
            assert!(one_by_one.contains(&(end, offset)), "{one_by_one:?}");
        }
    }
    assert_eq!(k.open_links.len(), 4);
    let stats = p.stats();
    assert_eq!(
        (stats.links, stats.multi_links, stats.attach_failures),
        (4, 0, 0)
    );
    assert!(k.is_live(1) && k.is_live(2));
}

/// A copy of the stand-in CUDA runtime at `path`, inode `ino` (a job's own
/// virtual environment, a container layer).
fn copy_of_cudart(src: &mut FakeSource, path: &str, ino: u64) {
    src.files.insert(path.into(), (1, ino));
    src.exports.insert(path.into(), src.exports[CUDART].clone());
}

/// Jobs one after another, each on its own copy of a library: a copy no
/// traced process maps any more has its links closed and its slots handed
/// to the next copy, so two slots serve any number of copies; hits stay
/// counted per function across the reuse.
#[test]
fn copies_of_a_library_reuse_the_slots_of_released_ones() {
    let (mut src, mut k) = (FakeSource::nvidia(), FakeAttacher::default());
    // Two slots: one copy's two level-1 functions.
    let mut p = probes(1).with_capacity(2, std::time::Duration::ZERO);
    let mut open_before = Vec::new();
    for job in 0..4u32 {
        let (pid, ino) = (100 + job, 1_000 + u64::from(job));
        let path = format!("/jobs/{job}/venv/libcudart.so.12");
        copy_of_cudart(&mut src, &path, ino);
        src.map(pid, &[(&path, ino, BASE)]);
        scan(&mut p, &[pid], &mut src, &mut k);
        let cookies: Vec<u32> = k
            .attaches()
            .iter()
            .rev()
            .take(4)
            .map(|(_, _, c)| *c)
            .collect();
        assert!(
            cookies.iter().all(|c| [1, 2].contains(c)),
            "job {job}: slots {cookies:?}"
        );
        assert!(k.is_live(1) && k.is_live(2), "job {job}");
        let stats = p.stats();
        assert_eq!(stats.attach_failures, 0, "job {job}: {stats:?}");
        assert_eq!(stats.slots_in_use, 2, "job {job}");
        assert_eq!(stats.files_released, u64::from(job));
        // The previous copy's links are closed, none of this one's.
        assert!(open_before.iter().all(|l| !k.open_links.contains(l)));
        open_before = k.open_links.iter().copied().collect();
        assert_eq!(open_before.len(), 4);
        // The job calls cudaMalloc 3 times, then exits.
        let malloc = k
            .attaches()
            .into_iter()
            .rev()
            .find(|(_, o, _)| *o == MALLOC)
            .unwrap()
            .2;
        *k.hits.entry(malloc).or_default() += 3;
        assert_eq!(
            p.hits(&k)[&("cudart", "cudaMalloc")],
            3 * u64::from(job + 1)
        );
        src.maps.remove(&pid);
        scan(&mut p, &[], &mut src, &mut k);
        assert!(!k.is_live(1) && !k.is_live(2), "silenced at its release");
        assert_eq!(
            p.stats().slots_in_use,
            2,
            "held until their links are closed"
        );
        scan(&mut p, &[], &mut src, &mut k);
        assert_eq!(p.stats().slots_in_use, 0, "free at the next round");
    }
    let closes = k
        .calls
        .iter()
        .filter(|c| matches!(c, FakeCall::Close(l) if l.len() == 4))
        .count();
    assert_eq!(closes, 4, "each copy's links closed together");
    assert_eq!(p.hits(&k)[&("cudart", "cudaMalloc")], 12);
}

/// A file is released only when no traced process maps it or is about to
/// (predicted from its program), and only after the quiet period.
#[test]
fn a_file_in_use_or_about_to_be_is_kept() {
    use super::plan::Predicted;
    let (mut src, mut k) = (FakeSource::nvidia(), FakeAttacher::default());
    let mut p = probes(1).with_capacity(100, std::time::Duration::ZERO);
    // Process 10 maps it, 11 is predicted to.
    src.map(10, &[(CUDART, 11, BASE)]);
    src.predicted.insert(
        11,
        Predicted {
            libraries: vec![(Library::Cudart, CUDART.into())],
            interpreter: None,
        },
    );
    src.maps.insert(11, String::new());
    scan(&mut p, &[10, 11], &mut src, &mut k);
    let plan = p.plan_early(11, true, &mut src);
    p.apply(&mut k, plan).unwrap();
    src.maps.remove(&10);
    let plan = p.plan(&[11], &mut src);
    assert!(plan.release.is_empty(), "11 will map it: {plan:?}");
    p.apply(&mut k, plan).unwrap();
    assert!(k.is_live(1));
    let plan = p.plan(&[], &mut src);
    assert_eq!(plan.release.len(), 1, "{plan:?}");
    assert_eq!(plan.release[0].file, (1, 11));
    assert_eq!(plan.release[0].sites.len(), 2);

    // With the default quiet period, a file left a moment ago stays.
    let (mut src, mut k) = (FakeSource::nvidia(), FakeAttacher::default());
    let mut p = probes(1);
    src.map(10, &[(CUDART, 11, BASE)]);
    scan(&mut p, &[10], &mut src, &mut k);
    src.maps.remove(&10);
    for _ in 0..3 {
        assert!(p.plan(&[], &mut src).release.is_empty());
    }
    // Mapped again within it: the same probes, nothing attached again.
    src.map(12, &[(CUDART, 11, OTHER_BASE)]);
    let attaches = k.attaches().len();
    scan(&mut p, &[12], &mut src, &mut k);
    assert_eq!(k.attaches().len(), attaches);
    assert!(k.is_live(1) && k.is_live(2));
}

/// A launch is counted in the kernel at every level: below level 1 its
/// probe is live with its entry end only (no return probe: it would
/// double the cost of every launch); raising the level adds its return
/// end once; lowering it again leaves it counting, not silenced.
#[test]
fn launches_are_counted_at_every_level_by_their_entry_alone() {
    use xpuscope_common::uprobe::COUNT_LAUNCH_UPPER;
    let (mut src, mut k, mut p) = (
        FakeSource::nvidia_with_launch(),
        FakeAttacher::default(),
        probes(0),
    );
    src.map(10, &[(CUDART, 11, BASE)]);
    scan(&mut p, &[10], &mut src, &mut k);
    let attached = offsets(&k);
    assert!(
        attached.contains(&(ProbeEnd::Entry, LAUNCH)),
        "{attached:?}"
    );
    assert!(
        !attached.contains(&(ProbeEnd::Return, LAUNCH)),
        "{attached:?}"
    );
    assert!(!attached.iter().any(|(_, o)| *o == COPY), "{attached:?}");
    let slot = k
        .attaches()
        .into_iter()
        .find(|(_, o, _)| *o == LAUNCH)
        .map(|(_, _, c)| c)
        .unwrap();
    let spec = k.specs[&slot];
    assert_ne!(spec.flags & COUNT_LAUNCH_UPPER, 0, "{spec:?}");
    assert_eq!(
        spec.level_bit,
        level_bit(Library::Cudart, "cudaLaunchKernel"),
        "recorded at its own level only"
    );
    assert_eq!(k.probe_levels & spec.level_bit, 0);

    // 0 -> 1: the launch's return end, once; its entry is not attached again.
    set_level(&mut p, 1, &mut src, &mut k);
    let launch_ends: Vec<ProbeEnd> = offsets(&k)
        .into_iter()
        .filter(|(_, o)| *o == LAUNCH)
        .map(|(e, _)| e)
        .collect();
    assert_eq!(launch_ends, vec![ProbeEnd::Entry, ProbeEnd::Return]);

    // 1 -> 0: the copy is silenced, the launch keeps counting.
    set_level(&mut p, 0, &mut src, &mut k);
    assert!(k.is_live(slot), "a counting launch is never silenced");
    let copy_slot = k
        .attaches()
        .into_iter()
        .find(|(_, o, _)| *o == COPY)
        .map(|(_, _, c)| c)
        .unwrap();
    assert!(!k.is_live(copy_slot));

    // 0 -> 1 again: nothing new to attach.
    let before = offsets(&k).len();
    set_level(&mut p, 1, &mut src, &mut k);
    assert_eq!(offsets(&k).len(), before);
}

/// With one link per file and end, a launch counted below its level is in
/// the entry link and not in the return link.
#[test]
fn an_entry_only_launch_is_left_out_of_the_file_s_return_link() {
    let (mut src, mut k, mut p) = (
        FakeSource::nvidia_with_launch(),
        FakeAttacher::default(),
        probes(0),
    );
    k.multi = true;
    src.map(10, &[(CUDART, 11, BASE)]);
    scan(&mut p, &[10], &mut src, &mut k);
    let many: Vec<(ProbeEnd, Vec<u64>)> = k
        .calls
        .iter()
        .filter_map(|c| match c {
            FakeCall::AttachMany { end, sites, .. } => {
                Some((*end, sites.iter().map(|(o, _)| *o).collect()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        many,
        vec![
            (ProbeEnd::Entry, vec![MALLOC, LAUNCH]),
            (ProbeEnd::Return, vec![MALLOC]),
        ]
    );
}
