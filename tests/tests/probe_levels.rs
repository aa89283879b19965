//! End-to-end: the device capture level changes while one agent records
//! (the hidden `--probe-level-schedule 0,1@1s`): kernel launches (level 1)
//! are recorded from the switch on, collectives (level 0) throughout, and
//! nothing restarts. Decoded from the written trace with the independent
//! decoder. Root and eBPF; never skips.

use std::time::Duration;

use xpuscope_tests::agent::{Lines, Recording, TempDir, exclusive, go};
use xpuscope_tests::device::{python_program, thread_of, wait_for_closers};
use xpuscope_tests::fixtures;
use xpuscope_tests::trace_check::{Slice, Timeline, check_importer_rules, decode};

/// One process, a one-rank NCCL communicator: every 60 ms for 3 s, one
/// kernel launch then one all-reduce. Prints the number of iterations.
const PROGRAM: &str = r#"
import ctypes, sys, time
from ctypes import (Structure, addressof, byref, c_char_p, c_int, c_size_t, c_uint, c_void_p)
libs = sys.argv[1]
cudart = ctypes.CDLL(libs + "/libcudart.so.12", mode=ctypes.RTLD_GLOBAL)
nccl = ctypes.CDLL(libs + "/libnccl.so.2", mode=ctypes.RTLD_GLOBAL)
class UniqueId(Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
class Dim3(Structure):
    _fields_ = [("x", c_uint), ("y", c_uint), ("z", c_uint)]
uid = UniqueId()
assert nccl.ncclGetUniqueId(byref(uid)) == 0
comm = c_void_p()
assert nccl.ncclCommInitRank(byref(comm), 1, uid, 0) == 0
buf = c_void_p()
assert cudart.cudaMalloc(byref(buf), c_size_t(1 << 20)) == 0
cudart.__cudaRegisterFatBinary.restype = c_void_p
cudart.__cudaRegisterFatBinary.argtypes = [c_void_p]
stub = ctypes.create_string_buffer(16)
h = cudart.__cudaRegisterFatBinary(None)
cudart.__cudaRegisterFunction(c_void_p(h), c_void_p(addressof(stub)), c_char_p(b"level_gemm"),
                              c_char_p(b"level_gemm"), c_int(-1), None, None, None, None, None)
cudart.__cudaRegisterFatBinaryEnd(c_void_p(h))
cudart.cudaLaunchKernel.argtypes = [c_void_p, Dim3, Dim3, c_void_p, c_size_t, c_void_p]
print("loaded", flush=True)                # probed at the attach
sys.stdin.readline()                       # "go": the agent records
n = 0
end = time.monotonic() + 3.0
while time.monotonic() < end:
    assert cudart.cudaLaunchKernel(addressof(stub), Dim3(1, 1, 1), Dim3(32, 1, 1),
                                   None, 0, None) == 0
    # 64 Ki fp32 (ncclFloat32 = 7), ncclSum = 0, default stream
    assert nccl.ncclAllReduce(buf, buf, c_size_t(1 << 16), 7, 0, comm, None) == 0
    n += 1
    time.sleep(0.06)
assert cudart.cudaDeviceSynchronize() == 0
print("iterations", n, flush=True)
sys.stdin.readline()
"#;

fn on_pid<'a>(tl: &'a Timeline, pid: i32, prefix: &str) -> Vec<&'a Slice> {
    let mut v: Vec<&Slice> = tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with(prefix))
        .filter(|s| thread_of(tl, s).is_some_and(|(p, _)| p == pid))
        .collect();
    v.sort_by_key(|s| s.ts);
    v
}

#[test]
fn raising_the_device_level_while_recording_adds_launches_from_then_on() {
    let _serial = exclusive();
    wait_for_closers();
    let fixtures = fixtures::build_all();
    let dir = TempDir::new("levels");
    let libs = fixtures.join("standins/lib");
    let mut wl = python_program("levels", PROGRAM, &[&libs]);
    let mut stdin = wl.stdin();
    let mut out = Lines::new(wl.stdout());
    out.wait_for("loaded", Duration::from_secs(20));
    let rec = Recording::start(
        dir.path(),
        &[
            "-v",
            "--pid",
            &wl.pid().to_string(),
            "--probe-level-schedule",
            "0,1@1s",
        ],
    );
    let agent_pid = rec.agent.pid();
    go(&mut stdin);
    let line = out.wait_for("iterations", Duration::from_secs(30));
    let iterations: usize = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert_eq!(rec.agent.pid(), agent_pid);
    rec.agent.signal(libc::SIGINT);
    let done = rec.finish(Duration::from_secs(30));
    go(&mut stdin);
    // One agent throughout: it switched in place.
    assert_eq!(
        done.stderr.matches("xpuscope: recording").count(),
        1,
        "{}",
        done.stderr
    );
    assert!(
        done.stderr.contains("capture level 0 -> 1"),
        "{}",
        done.stderr
    );

    let trace = decode(&done.trace).expect("decodes");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    let pid = wl.pid() as i32;
    let reduces = on_pid(&tl, pid, "ncclAllReduce");
    let launches = on_pid(&tl, pid, "cudaLaunchKernel");
    // Collectives (level 0): every iteration, before and after the switch.
    assert_eq!(reduces.len(), iterations, "every all-reduce recorded");
    let first_launch = launches
        .first()
        .unwrap_or_else(|| panic!("no launch recorded after the switch"))
        .ts;
    let before = reduces.iter().filter(|s| s.ts < first_launch).count();
    let after = reduces.len() - before;
    eprintln!(
        "{iterations} iterations: {before} before the switch, {after} after; {} launches",
        launches.len()
    );
    assert!(
        before >= 5,
        "level 0 recorded collectives before the switch: {before}"
    );
    assert!(after >= 5, "and after it: {after}");
    // Launches (level 1): none before the switch, every one after it (each
    // iteration launches, then all-reduces).
    assert_eq!(
        launches.len(),
        after,
        "one launch per iteration after the switch"
    );
    // Named by the driver handle the runtime launched it with.
    for s in &launches {
        assert_eq!(
            s.name, "cudaLaunchKernel level_gemm grid(1,1,1) block(32,1,1)",
            "{s:?}"
        );
    }
    let device = &done.stats["device"];
    assert_eq!(device["attach_failures"], 0, "{device}");
    assert_eq!(device["entries_without_return"], 0, "{device}");
}
