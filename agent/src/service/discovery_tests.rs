use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use super::*;
use crate::service::config::CommPattern;

#[derive(Clone, Default)]
struct FakeProc {
    stat: Option<ProcStat>,
    maps: String,
    environ: Vec<u8>,
    cgroup: String,
}

#[derive(Default)]
struct FakeTable {
    procs: BTreeMap<u32, FakeProc>,
    maps_reads: Vec<u32>,
}

impl FakeTable {
    fn add(&mut self, pid: u32, comm: &str, start: u64, maps: &str) -> &mut FakeProc {
        self.procs.insert(
            pid,
            FakeProc {
                stat: Some(ProcStat {
                    comm: comm.into(),
                    start_time: start,
                    vsize: 4096 * (1 + maps.lines().count() as u64),
                }),
                maps: maps.into(),
                ..FakeProc::default()
            },
        );
        self.procs.get_mut(&pid).unwrap()
    }
}

impl ProcTable for FakeTable {
    fn pids(&mut self) -> Vec<u32> {
        self.procs.keys().copied().collect()
    }
    fn stat(&mut self, pid: u32) -> Option<ProcStat> {
        self.procs.get(&pid)?.stat.clone()
    }
    fn maps(&mut self, pid: u32) -> Option<ProcessMaps> {
        self.maps_reads.push(pid);
        Some(ProcessMaps::parse(&self.procs.get(&pid)?.maps))
    }
    fn environ(&mut self, pid: u32) -> Option<Vec<u8>> {
        Some(self.procs.get(&pid)?.environ.clone())
    }
    fn cgroup(&mut self, pid: u32) -> Option<String> {
        Some(self.procs.get(&pid)?.cgroup.clone())
    }
}

const NCCL: &str = "7f0000000000-7f0000100000 r-xp 00000000 08:01 4242 /opt/lib/libnccl.so.2\n";
const LIBC: &str = "7f1000000000-7f1000100000 r-xp 00000000 08:01 17 /usr/lib/libc.so.6\n";

fn pids(found: &[Found]) -> Vec<u32> {
    found.iter().map(|f| f.pid).collect()
}

#[test]
fn processes_mapping_a_device_library_are_found_once_and_dlopen_later_too() {
    let mut t = FakeTable::default();
    t.add(10, "python3", 1, &format!("{LIBC}{NCCL}"));
    t.add(11, "bash", 1, LIBC);
    t.add(2, "kthreadd", 0, "").stat.as_mut().unwrap().vsize = 0;
    let mut d = Discovery::new(DiscoveryConfig::default());
    let found = d.scan(&mut t, &HashSet::new());
    assert_eq!(
        found,
        vec![Found {
            pid: 10,
            comm: "python3".into(),
            reason: Reason::Library("libnccl.so.2".into()),
        }]
    );
    assert_eq!(t.maps_reads, vec![10, 11], "kernel threads are not read");
    // The kernel traces 10 now: never looked at again; 11 unchanged: its
    // maps are not re-read, even at a re-check round.
    let traced: HashSet<u32> = [10].into();
    t.maps_reads.clear();
    for _ in 0..RECHECK_EVERY * 2 {
        assert!(d.scan(&mut t, &traced).is_empty());
    }
    assert!(t.maps_reads.is_empty(), "{:?}", t.maps_reads);
    // 11 dlopens libnccl: its size moves, found at the next re-check.
    t.add(11, "bash", 1, &format!("{LIBC}{NCCL}"));
    let mut rounds = 0;
    let found = loop {
        rounds += 1;
        let f = d.scan(&mut t, &traced);
        if !f.is_empty() || rounds > RECHECK_EVERY {
            break f;
        }
    };
    assert_eq!(pids(&found), vec![11]);
    assert!(rounds <= RECHECK_EVERY, "{rounds}");
    assert_eq!(t.maps_reads, vec![11]);
}

#[test]
fn a_reused_pid_is_a_new_process() {
    let mut t = FakeTable::default();
    t.add(20, "sh", 5, LIBC);
    let mut d = Discovery::new(DiscoveryConfig::default());
    assert!(d.scan(&mut t, &HashSet::new()).is_empty());
    // Same size, another start time: the pid went to a training process.
    t.add(20, "sh", 9, LIBC).maps = NCCL.into();
    let mut found = Vec::new();
    for _ in 0..RECHECK_EVERY {
        found.extend(d.scan(&mut t, &HashSet::new()));
    }
    assert_eq!(pids(&found), vec![20]);
}

#[test]
fn selectors_find_processes_without_device_libraries() {
    let mut t = FakeTable::default();
    t.add(30, "torchrun", 1, LIBC);
    t.add(31, "worker", 1, LIBC).cgroup = "/kubepods.slice/pod-a".into();
    t.add(32, "trainer", 1, LIBC).environ = b"HOME=/root\0RANK=3\0".to_vec();
    t.add(33, "other", 1, LIBC).environ = b"RANKS=3\0XRANK=1\0".to_vec();
    let mut d = Discovery::new(DiscoveryConfig {
        comm: Some(CommPattern(regex::Regex::new("^torch").unwrap())),
        cgroup_prefix: vec!["/kubepods.slice".into()],
        env: vec!["RANK".into()],
    });
    let found = d.scan(&mut t, &HashSet::new());
    let reasons: Vec<(u32, Reason)> = found.into_iter().map(|f| (f.pid, f.reason)).collect();
    assert_eq!(
        reasons,
        vec![
            (30, Reason::Comm),
            (31, Reason::Cgroup("/kubepods.slice".into())),
            (32, Reason::Env("RANK".into())),
        ]
    );
}

#[test]
fn environment_lookups_match_whole_names() {
    let env = b"JOB_NAME=llama\0XPUSCOPE_JOB=\0RANK=1\0";
    assert!(has_variable(env, "RANK"));
    assert!(!has_variable(env, "RAN"));
    assert!(has_variable(env, "XPUSCOPE_JOB"));
    let stat = "42 (a (b) c) S 1 42 42 0 -1 4194304 1 0 0 0 3 4 0 0 20 0 2 0 777 123456 100";
    assert_eq!(
        ProcStat::parse(stat),
        Some(ProcStat {
            comm: "a (b) c".into(),
            start_time: 777,
            vsize: 123456
        })
    );
}

/// CPU time of this thread (discovery runs on one thread).
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Over the live `/proc` with 300 more (idle) processes: the first round
/// reads every process's maps once; later rounds read no maps of a process
/// that did not change. Prints the CPU a round costs (module docs).
#[test]
fn a_round_over_hundreds_of_processes_reads_only_what_changed() {
    struct Children(Vec<std::process::Child>);
    impl Drop for Children {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let children = Children(
        (0..300)
            .map(|_| {
                std::process::Command::new("sleep")
                    .arg("60")
                    .spawn()
                    .expect("spawn sleep")
            })
            .collect(),
    );
    /// The live `/proc`, counting whose maps are read.
    #[derive(Default)]
    struct Counting(BTreeMap<u32, u32>);
    impl ProcTable for Counting {
        fn pids(&mut self) -> Vec<u32> {
            LiveProcTable.pids()
        }
        fn stat(&mut self, pid: u32) -> Option<ProcStat> {
            LiveProcTable.stat(pid)
        }
        fn maps(&mut self, pid: u32) -> Option<ProcessMaps> {
            *self.0.entry(pid).or_default() += 1;
            LiveProcTable.maps(pid)
        }
        fn environ(&mut self, pid: u32) -> Option<Vec<u8>> {
            LiveProcTable.environ(pid)
        }
        fn cgroup(&mut self, pid: u32) -> Option<String> {
            LiveProcTable.cgroup(pid)
        }
    }
    let mut d = Discovery::new(DiscoveryConfig::default());
    let mut table = Counting::default();
    let traced = HashSet::new();
    let t0 = thread_cpu();
    d.scan(&mut table, &traced);
    let first = thread_cpu() - t0;
    let after_first = d.stats;
    assert!(after_first.stat_reads >= 300, "{after_first:?}");
    for c in &children.0 {
        assert!(d.seen.contains_key(&c.id()), "sleep {} not seen", c.id());
        assert_eq!(
            table.0.get(&c.id()),
            Some(&1),
            "sleep {}: maps read once",
            c.id()
        );
    }
    table.0.clear();
    let steady = RECHECK_EVERY * 4;
    let (mut listing, mut rechecks) = (Vec::new(), Vec::new());
    // Which rounds re-check is known by their number; the stat reads they
    // make show it (a listing round reads only processes new since the last
    // round: on a busy machine a few, never all of them).
    let mut recheck_reads = Vec::new();
    for _ in 0..steady {
        let recheck = d.stats.rounds.is_multiple_of(RECHECK_EVERY);
        let reads = d.stats.stat_reads;
        let t = thread_cpu();
        d.scan(&mut table, &traced);
        let cpu = thread_cpu() - t;
        if recheck {
            rechecks.push(cpu);
            recheck_reads.push(d.stats.stat_reads - reads);
        } else {
            listing.push(cpu);
            assert!(
                d.stats.stat_reads - reads < 300,
                "a listing round read {} stats",
                d.stats.stat_reads - reads
            );
        }
    }
    let mean = |v: &[Duration]| v.iter().sum::<Duration>() / v.len().max(1) as u32;
    assert_eq!(rechecks.len() as u64, steady / RECHECK_EVERY);
    assert!(
        recheck_reads.iter().all(|&n| n >= 300),
        "every re-check round reads every process's stat: {recheck_reads:?}"
    );
    // Idle processes: re-checked (stat) but their maps are not read again.
    // (Other processes of the machine come, go and grow meanwhile: only
    // the idle children are counted.)
    let maps_later = d.stats.maps_reads - after_first.maps_reads;
    let idle_reads: u32 = children.0.iter().filter_map(|c| table.0.get(&c.id())).sum();
    assert_eq!(idle_reads, 0, "maps re-read for idle processes");
    eprintln!(
        "discovery over {} processes: first round {:?} CPU; then {:?} per listing round and \
         {:?} per re-check round ({} stat and {} maps reads in {steady} rounds)",
        d.seen.len(),
        first,
        mean(&listing),
        mean(&rechecks),
        d.stats.stat_reads - after_first.stat_reads,
        maps_later,
    );
}
