//! End-to-end: `agent probes --pid P --duration D` attaches every probe of
//! the process's device libraries, counts their hits in the kernel (nothing
//! recorded), and lists them next to each probe's placement. Root and
//! eBPF; this never skips.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use xpuscope_tests::agent::{Lines, Proc, agent_bin, exclusive, go};
use xpuscope_tests::device::{python_program, wait_for_closers};
use xpuscope_tests::fixtures;

/// Calls known functions of the stand-in CUDA runtime a known number of
/// times once told to, then idles.
const CALLS_PROGRAM: &str = r#"
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1])
print("loaded", flush=True)
sys.stdin.readline()                       # "go": the probes are attached
p = ctypes.c_void_p()
for _ in range(7):
    lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(4096))
    lib.cudaFree(p)
for _ in range(3):
    lib.cudaSetDevice(0)
for _ in range(5):
    lib.cudaStreamSynchronize(ctypes.c_void_p(0))
print("done", flush=True)
sys.stdin.readline()
"#;

/// The hits column of `function`'s row in the listing.
fn hits_of(listing: &str, function: &str) -> String {
    let row = listing
        .lines()
        .find(|l| l.split_whitespace().next() == Some(function))
        .unwrap_or_else(|| panic!("no row for {function}:\n{listing}"));
    // function, address, offset, first instruction (one or more words),
    // hits, placement: the hits column is the first bare integer or '-'
    // after the offset.
    let cols: Vec<&str> = row.split_whitespace().collect();
    let offset_at = cols
        .iter()
        .skip(2)
        .position(|c| c.starts_with("0x"))
        .map(|i| i + 2)
        .unwrap_or_else(|| panic!("{row}"));
    cols[offset_at + 1..]
        .iter()
        .find(|c| c.parse::<u64>().is_ok() || **c == "-")
        .unwrap_or_else(|| panic!("no hits column: {row}"))
        .to_string()
}

#[test]
fn probes_subcommand_counts_hits_per_function() {
    let _serial = exclusive();
    wait_for_closers();
    let fixtures = fixtures::build_all();
    let lib = fixtures.join("standins/lib/libcudart.so.12");
    let mut wl = python_program("probe-hits", CALLS_PROGRAM, &[&lib]);
    let mut wl_in = wl.stdin();
    let mut wl_out = Lines::new(wl.stdout());
    wl_out.wait_for("loaded", Duration::from_secs(20));

    let mut agent = Proc::spawn(
        "agent probes",
        Command::new(agent_bin())
            .args(["probes", "--pid", &wl.pid().to_string(), "--duration", "4s"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let mut stdout = agent.stdout();
    let mut err = Lines::new(agent.stderr());
    let started = err.wait_for("counting calls of", Duration::from_secs(30));
    go(&mut wl_in);
    wl_out.wait_for("done", Duration::from_secs(10));
    let status = agent
        .wait_timeout(Duration::from_secs(30))
        .expect("agent probes finished");
    let mut listing = String::new();
    stdout.read_to_string(&mut listing).expect("listing");
    assert!(status.success(), "{status}: {listing}\n{:?}", err.seen);
    go(&mut wl_in);

    assert!(listing.contains("hits"), "{listing}");
    assert_eq!(hits_of(&listing, "cudaMalloc"), "7", "{started}\n{listing}");
    assert_eq!(hits_of(&listing, "cudaFree"), "7", "{listing}");
    assert_eq!(hits_of(&listing, "cudaSetDevice"), "3", "{listing}");
    assert_eq!(hits_of(&listing, "cudaStreamSynchronize"), "5", "{listing}");
    assert_eq!(hits_of(&listing, "cudaLaunchKernel"), "0", "{listing}");
}
