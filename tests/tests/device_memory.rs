//! End-to-end: device memory under `agent attach` — an OOM marked with the
//! allocating stack and what holds the device's memory, allocation sites
//! by bytes held, and a library replaced at a new inode re-attached.
//! Root and eBPF; these never skip.

use std::time::Duration;

use serde_json::Value;
use xpuscope_tests::agent::{Lines, Recording, TempDir, exclusive, go};
use xpuscope_tests::device::*;
use xpuscope_tests::fixtures;
use xpuscope_tests::trace_check::{
    ArgValue, Instant, Slice, Timeline, TrackKind, check_importer_rules, decode,
};

const MIB: u64 = 1 << 20;

fn instant_arg<'a>(i: &'a Instant, name: &str) -> Option<&'a ArgValue> {
    i.args.iter().find(|(n, _)| n == name).map(|(_, v)| v)
}

fn uint(v: Option<&ArgValue>) -> u64 {
    match v {
        Some(ArgValue::Uint(x)) => *x,
        Some(ArgValue::Int(x)) => *x as u64,
        other => panic!("not an integer: {other:?}"),
    }
}

fn text(v: Option<&ArgValue>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// The pid of the process track an instant is on, or of its thread track.
fn pid_of_track(tl: &Timeline, track: u64) -> Option<i32> {
    match &tl.tracks.get(&track)?.kind {
        TrackKind::Thread { pid, .. } | TrackKind::Process { pid, .. } => Some(*pid),
        _ => None,
    }
}

/// A rank leaks 48 MiB of device memory per step until its 512 MiB device
/// is full (the simulator's `mem_leak` fault). The failed `cudaMalloc` is
/// marked on the rank's thread with the size asked, the bytes the agent
/// saw held, the allocating stack (as a callstack and as text), and the
/// largest live allocation sites: the leaking function, holding every
/// leaked byte. Every traced allocation carries its stack; the summary
/// lists the sites; the rank's exit reports what it still held.
#[test]
fn oom_is_marked_with_its_stack_and_the_sites_holding_memory() {
    let _serial = exclusive();
    let leak = 48 * MIB;
    let run = run_sim_job_any_outcome(
        "devoom",
        "0",
        40,
        &[
            "--device-mem-mb",
            "512",
            "--fault",
            "mem_leak:rank=1,mb=48,from_step=3",
        ],
    );
    assert!(!run.status.success(), "the leaking job must fail");
    let steps = std::fs::read_to_string(run.job_dir.join("rank1.steps.jsonl")).expect("steps");
    let event = |name: &str| -> Value {
        steps
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["event"] == name)
            .unwrap_or_else(|| panic!("rank 1 logged no {name}"))
    };
    let oom = event("oom");
    // Device memory the rank held at its start gate (before the attach).
    let before_attach = event("ready")["mem_bytes"].as_u64().expect("mem_bytes");
    let oom_step = oom["step"].as_u64().unwrap();
    let leaked = oom_step - 3; // allocations that succeeded, steps 3..oom
    assert!(leaked >= 2, "{oom}");
    assert_eq!(oom["request_bytes"].as_u64(), Some(leak));
    let rank1 = run.rank_pids[&1];

    let tl = &run.tl;
    let failed: Vec<&Instant> = tl
        .instants
        .iter()
        .filter(|i| i.name == "cudaMalloc failed")
        .collect();
    assert_eq!(failed.len(), 1, "one failed allocation");
    let f = failed[0];
    assert_eq!(pid_of_track(tl, f.track), Some(rank1));
    assert_eq!(uint(instant_arg(f, "requested")), leak);
    assert_eq!(
        uint(instant_arg(f, "return")),
        2,
        "cudaErrorMemoryAllocation"
    );
    // Allocations made before the attach (at the start gate) are not seen:
    // what the agent saw held is exactly the leak.
    assert_eq!(uint(instant_arg(f, "device_bytes_held")), leaked * leak);
    // ... and with what it held before, the rank's own accounting.
    assert_eq!(
        oom["in_use_bytes"].as_u64(),
        Some(before_attach + leaked * leak),
        "{oom}"
    );
    // The counter track climbs one leak at a time to the same bytes.
    let counter = tl
        .tracks
        .values()
        .find(|t| {
            t.name.as_deref() == Some("device memory dev0")
                && t.parent.and_then(|p| pid_of_track(tl, p)) == Some(rank1)
        })
        .expect("rank 1's device memory counter");
    let values: Vec<u64> = tl
        .counter_series(counter.uuid)
        .iter()
        .map(|(_, v)| *v as u64)
        .collect();
    let climb: Vec<u64> = (1..=leaked).map(|n| n * leak).collect();
    assert!(values.starts_with(&climb), "{values:?}");
    assert_eq!(values.iter().max(), Some(&(leaked * leak)), "{values:?}");
    // The allocating stack, root first, through the simulator's functions.
    let stack = f.callstack.as_ref().expect("the OOM carries its stack");
    let at = |name: &str| stack.iter().position(|f| f == name);
    let (Some(fwd), Some(cache)) = (at("forward"), at("cache_activations")) else {
        panic!("stack lacks forward > cache_activations: {stack:?}");
    };
    assert!(fwd < cache, "root first: {stack:?}");
    assert!(
        text(instant_arg(f, "stack")).contains("cache_activations"),
        "{:?}",
        f.args
    );
    // What holds the memory: the leak's site, with every leaked byte.
    assert_eq!(uint(instant_arg(f, "live_sites.1.bytes")), leaked * leak);
    assert_eq!(uint(instant_arg(f, "live_sites.1.allocations")), leaked);
    assert!(text(instant_arg(f, "live_sites.1.stack")).contains("cache_activations"));
    assert!(instant_arg(f, "live_sites.2.bytes").is_none(), "one site");

    // Every traced cudaMalloc of rank 1 has its stack.
    let mallocs: Vec<&Slice> = tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with("cudaMalloc"))
        .filter(|s| pid_of_track(tl, s.track) == Some(rank1))
        .collect();
    assert_eq!(mallocs.len() as u64, leaked + 1, "the leaks and the OOM");
    for s in &mallocs {
        let cs = s.callstack.as_ref().expect("stack on the allocation");
        assert!(cs.iter().any(|f| f == "cache_activations"), "{cs:?}");
    }

    // The rank exited holding the leak.
    let exit: Vec<&Instant> = tl
        .instants
        .iter()
        .filter(|i| i.name == "device memory held at exit")
        .filter(|i| pid_of_track(tl, i.track) == Some(rank1))
        .collect();
    assert_eq!(exit.len(), 1);
    assert_eq!(
        uint(instant_arg(exit[0], "live_sites.1.bytes")),
        leaked * leak
    );

    // The summary.
    let d = &run.stats["device"];
    assert_eq!(d["failed_allocations"], 1, "{d}");
    assert_eq!(d["alloc_stack_errors"], 0, "{d}");
    assert!(d["alloc_stacks"].as_u64().unwrap() > leaked, "{d}");
    let sites = d["largest_live_sites"].as_array().expect("sites");
    let top = sites
        .iter()
        .find(|s| s["pid"] == rank1 as u64)
        .expect("rank 1's site");
    assert_eq!(top["bytes"].as_u64(), Some(leaked * leak));
    assert!(top["stack"].as_str().unwrap().contains("cache_activations"));
    let functions = d["functions"].as_array().expect("functions");
    let malloc: Vec<&Value> = functions
        .iter()
        .filter(|f| f["function"] == "cudaMalloc")
        .collect();
    assert_eq!(malloc.len(), 1, "{functions:?}");
    // Decoded calls, and the kernel's count of the probe's hits (all of
    // rank 1's and rank 0's, which allocates nothing after the gate).
    assert_eq!(
        malloc[0]["calls"].as_u64(),
        Some(leaked + 1),
        "{functions:?}"
    );
    assert_eq!(
        malloc[0]["hits"].as_u64(),
        Some(leaked + 1),
        "{functions:?}"
    );
    assert_eq!(malloc[0]["errors"].as_u64(), Some(1), "{functions:?}");
    assert!(
        run.stderr
            .contains("largest live device-memory allocation sites"),
        "{}",
        run.stderr
    );
}

/// Loads a copy of the stand-in libcudart, calls it, unloads it; the file
/// is then replaced (a new inode at the same path, as an upgrade or a new
/// container layer does) and loaded again.
const REPLACED_PROGRAM: &str = r#"
import ctypes, _ctypes, sys, time
path = sys.argv[1]
def use(size):
    lib = ctypes.CDLL(path)
    time.sleep(1.5)                        # the agent re-scans every 500 ms
    p = ctypes.c_void_p()
    rc = lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(size))
    rc2 = lib.cudaFree(p)
    handle = lib._handle
    del lib
    _ctypes.dlclose(handle)
    return rc, rc2
sys.stdin.readline()                       # "go": the agent is attached
print("first", *use(1 << 20), flush=True)
sys.stdin.readline()                       # the file was replaced
print("second", *use(2 << 20), flush=True)
time.sleep(0.3)
"#;

/// A library unloaded and replaced by a new file at the same path is
/// probed again at its new inode: calls through both copies are traced.
#[test]
fn library_replaced_at_a_new_inode_is_probed_again() {
    use std::os::unix::fs::MetadataExt;

    let _serial = exclusive();
    wait_for_closers();
    let fixtures = fixtures::build_all();
    let dir = TempDir::new("devreplace");
    let original = fixtures.join("standins/lib/libcudart.so.12");
    let lib = dir.path().join("libcudart.so.12");
    std::fs::copy(&original, &lib).expect("copy the library");
    // The stand-in runtime loads its driver from beside itself.
    std::fs::copy(
        fixtures.join("standins/lib/libcuda.so.1"),
        dir.path().join("libcuda.so.1"),
    )
    .expect("copy the driver");
    let first_inode = std::fs::metadata(&lib).unwrap().ino();

    let mut wl = python_program("replaced", REPLACED_PROGRAM, &[&lib]);
    let mut stdin = wl.stdin();
    let mut out = Lines::new(wl.stdout());
    let rec = Recording::start(dir.path(), &["--pid", &wl.pid().to_string()]);
    go(&mut stdin);
    let first = out.wait_for("first", Duration::from_secs(20));
    assert_eq!(first.trim(), "first 0 0");
    // Replace: write the new file beside it, rename over (new inode).
    let staged = dir.path().join("libcudart.so.12.new");
    std::fs::copy(&original, &staged).expect("stage the new library");
    std::fs::rename(&staged, &lib).expect("replace the library");
    let second_inode = std::fs::metadata(&lib).unwrap().ino();
    assert_ne!(first_inode, second_inode);
    go(&mut stdin);
    let second = out.wait_for("second", Duration::from_secs(20));
    assert_eq!(second.trim(), "second 0 0");
    let done = rec.finish(Duration::from_secs(30));

    let trace = decode(&done.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    let pid = wl.pid() as i32;
    let mut mallocs: Vec<&Slice> = tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with("cudaMalloc"))
        .filter(|s| pid_of_track(&tl, s.track) == Some(pid))
        .collect();
    mallocs.sort_by_key(|s| s.ts);
    let sizes: Vec<String> = mallocs.iter().map(|s| arg_text(s, "bytes")).collect();
    assert_eq!(
        sizes,
        [MIB.to_string(), (2 * MIB).to_string()],
        "both copies traced:\n{}",
        done.stderr
    );
    let frees = tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with("cudaFree"))
        .count();
    assert_eq!(frees, 2);
    // Attached twice: the first copy, then the replacement.
    assert!(
        done.stats["device"]["libraries"].as_u64().unwrap() >= 2,
        "{}",
        done.stats["device"]
    );
}

/// Calls whose return is never seen must not cost later calls their
/// out-pointers. A program's `cudaMalloc` faults writing its result 12
/// times, and each time the fault handler jumps back out of the call (as a
/// return probe attached a moment after its entry probe, or detached
/// during the call, leaves an entry without its return); then it allocates
/// 1, 2 and 3 MiB. Every one of those three has its pointer read and
/// counted (on an H100, a thread that had left 8 such entries behind lost
/// every later pointer: all of PyTorch's profiler's activity records).
#[test]
fn calls_that_never_return_leave_later_pointers_readable() {
    let _serial = exclusive();
    wait_for_closers();
    fixtures::build_all();
    let dir = TempDir::new("escape");
    let lib = fixtures::fixture_out("standins").join("lib/libcudart.so.12");
    let mut wl = xpuscope_tests::agent::Proc::spawn(
        "escape",
        std::process::Command::new(fixtures::fixture_out("workloads").join("xpuscope-escape"))
            .arg(&lib)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped()),
    );
    let mut stdin = wl.stdin();
    let mut out = Lines::new(wl.stdout());
    out.wait_for("ready", Duration::from_secs(20));
    let rec = Recording::start(dir.path(), &["--pid", &wl.pid().to_string()]);
    go(&mut stdin);
    let done = out.wait_for("done ", Duration::from_secs(20));
    let words: Vec<&str> = done.split_whitespace().collect();
    assert_eq!(words[1], "12", "every faulting call escaped: {done}");
    let pointers: Vec<u64> = words[2..]
        .iter()
        .map(|p| u64::from_str_radix(p.trim_start_matches("0x"), 16).expect("pointer"))
        .collect();
    // The program exits; the recording ends with it.
    go(&mut stdin);
    let finished = rec.finish(Duration::from_secs(30));

    let trace = decode(&finished.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    let pid = wl.pid() as i32;
    let mallocs: Vec<&Slice> = tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with("cudaMalloc"))
        .filter(|s| thread_of(&tl, s).is_some_and(|(p, _)| p == pid))
        .collect();
    assert_eq!(
        mallocs.len(),
        3,
        "only the calls that returned: {mallocs:?}"
    );
    for (i, m) in mallocs.iter().enumerate() {
        let n = i as u64 + 1;
        assert_eq!(uint(arg(m, "bytes")), n * MIB, "{m:?}");
        assert_eq!(
            arg(m, "ptr"),
            Some(&ArgValue::Pointer(pointers[i])),
            "the pointer of call {n} was read: {m:?}"
        );
        assert_eq!(
            uint(arg(m, "device_bytes_held")),
            (1..=n).sum::<u64>() * MIB,
            "{m:?}"
        );
    }
    // The escaped calls: seen entering, never returning (reported as
    // still in them when the process ended).
    let device = &finished.stats["device"];
    assert_eq!(device["entries_without_return"], 12, "{device}");
    assert_eq!(device["died_in_call"], 12, "{device}");
}
