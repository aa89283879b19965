//! The CFI unwinder (xpuscope_probes::unwind) on a program built without
//! frame pointers, and through the real PyPI libnccl/libcudart.
//!
//! The fixture (tests/workloads/unwind_chain.c) blocks in a glibc call at
//! the end of a chain of its own functions. The test stops it with ptrace
//! (its own child: no root needed), takes what the kernel side would copy
//! (rip, rsp, rbp and 16 KiB of stack from rsp), unwinds that copy, and
//! checks the result against the fixture's symbol table and against gdb's
//! backtrace of the same stopped program. The last test runs the same
//! chains under `agent attach` (root, eBPF): the kernel's copies unwound
//! by the agent.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use object::{Object, ObjectSymbol, SymbolKind};
use xpuscope_probes::maps::{MappedFiles, ProcessMaps};
use xpuscope_probes::unwind::{StackCopy, Unwinder, UserRegs, frame_pointer_walk};
use xpuscope_tests::fixtures;

/// What the kernel side would copy per stack.
const STACK_COPY: usize = 16 * 1024;

/// The chain of the fixture's own functions, innermost first, below what
/// each mode adds.
const CHAIN: [&str; 5] = [
    "block_in_libc",
    "chain_inner",
    "chain_middle",
    "chain_outer",
    "main",
];

fn fixture() -> PathBuf {
    let src = fixtures::repo_root().join("tests/workloads");
    let out = fixtures::fixture_out("workloads");
    let made = Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(&src)
        .arg(format!("OUT={}", out.display()))
        .arg(out.join("xpuscope-unwind-chain"))
        .output()
        .expect("run make (is it installed?)");
    assert!(
        made.status.success(),
        "building the unwind fixture failed:\n{}",
        String::from_utf8_lossy(&made.stderr)
    );
    out.join("xpuscope-unwind-chain")
}

/// A fixture child, killed when dropped.
struct Blocked {
    child: Child,
}

impl Drop for Blocked {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the fixture with `args` and waits until it says it is about to
/// block, then a little longer so it is inside the blocking call.
fn start_blocked(args: &[&str]) -> Blocked {
    let mut child = Command::new(fixture())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the unwind fixture");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the fixture's stdout");
    if line.trim() != "ready" {
        let out = child.wait_with_output().expect("fixture output");
        panic!(
            "unwind fixture {args:?} did not block: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    Blocked { child }
}

/// What the kernel side would record for one stack.
struct Sample {
    regs: UserRegs,
    stack_base: u64,
    stack: Vec<u8>,
    maps: ProcessMaps,
}

/// Stops `pid` (its main thread) with ptrace, copies its registers and the
/// top of its stack, and lets it go on.
fn sample(pid: u32) -> Sample {
    let tid = pid as libc::pid_t;
    // SAFETY: plain ptrace/waitpid calls on our own child; every pointer
    // passed points at a live local of the right type and size.
    unsafe {
        assert_eq!(
            libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0),
            0,
            "PTRACE_SEIZE {pid}: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(
            libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0),
            0,
            "PTRACE_INTERRUPT"
        );
        let mut status = 0;
        assert_eq!(
            libc::waitpid(tid, &mut status, libc::__WALL),
            tid,
            "waitpid"
        );
        assert!(
            libc::WIFSTOPPED(status),
            "the fixture stopped (status {status:#x})"
        );
        let mut regs: libc::user_regs_struct = std::mem::zeroed();
        assert_eq!(
            libc::ptrace(libc::PTRACE_GETREGS, tid, 0, &mut regs as *mut _),
            0,
            "PTRACE_GETREGS"
        );
        let mut stack = vec![0u8; STACK_COPY];
        let local = libc::iovec {
            iov_base: stack.as_mut_ptr().cast(),
            iov_len: stack.len(),
        };
        let remote = libc::iovec {
            iov_base: regs.rsp as *mut libc::c_void,
            iov_len: stack.len(),
        };
        // A partial read (the stack ends before 16 KiB) is what the kernel
        // copy would also get: keep what was read.
        let n = libc::process_vm_readv(tid, &local, 1, &remote, 1, 0);
        assert!(
            n > 0,
            "process_vm_readv: {}",
            std::io::Error::last_os_error()
        );
        stack.truncate(n as usize);
        let maps = ProcessMaps::read(pid).expect("read the fixture's maps");
        assert_eq!(
            libc::ptrace(libc::PTRACE_DETACH, tid, 0, 0),
            0,
            "PTRACE_DETACH"
        );
        Sample {
            regs: UserRegs {
                ip: regs.rip,
                sp: regs.rsp,
                bp: regs.rbp,
            },
            stack_base: regs.rsp,
            stack,
            maps,
        }
    }
}

/// gdb's backtrace of the stopped program as (pc, frame type, name),
/// outermost frames included (through gdb's Python API: `bt` does not say
/// which frames are real).
fn gdb_frames(pid: u32) -> Vec<(u64, String, String)> {
    // Named after the stopped process: tests of this binary run at once.
    let script = std::env::temp_dir().join(format!("xpuscope-unwind-bt-{pid}.py"));
    std::fs::write(
        &script,
        "import gdb\n\
         names = {getattr(gdb, n): n for n in dir(gdb) if n.endswith('_FRAME')}\n\
         f = gdb.newest_frame()\n\
         while f is not None:\n\
         \x20   print('FRAME %x %s %s' % (f.pc(), names.get(f.type(), f.type()), f.name()))\n\
         \x20   f = f.older()\n",
    )
    .expect("write the gdb script");
    let out = Command::new("gdb")
        .args(["-nx", "-batch", "-p", &pid.to_string()])
        .args(["-ex", "set backtrace past-main on"])
        .arg("-x")
        .arg(&script)
        .output()
        .expect("run gdb (Debian: apt-get install gdb)");
    let _ = std::fs::remove_file(&script);
    let text = String::from_utf8_lossy(&out.stdout);
    let frames: Vec<(u64, String, String)> = text
        .lines()
        .filter_map(|l| {
            let mut w = l.strip_prefix("FRAME ")?.split_whitespace();
            let pc = u64::from_str_radix(w.next()?, 16).ok()?;
            Some((
                pc,
                w.next()?.to_string(),
                w.next().unwrap_or("None").to_string(),
            ))
        })
        .collect();
    assert!(
        !frames.is_empty(),
        "gdb printed no frames for {pid}:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    frames
}

/// Names of the fixture's functions from its own symbol table (an
/// independent symbolizer: object's ELF reader, not the unwinder's).
struct Symbols {
    path: String,
    funcs: Vec<(u64, u64, String)>,
}

impl Symbols {
    fn read(path: &Path) -> Self {
        let data = std::fs::read(path).expect("read the fixture");
        let elf = object::File::parse(&*data).expect("parse the fixture");
        let funcs = elf
            .symbols()
            .filter(|s| s.kind() == SymbolKind::Text && s.size() > 0)
            .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_string())))
            .collect();
        Self {
            path: path.to_string_lossy().into_owned(),
            funcs,
        }
    }

    /// The function of the fixture holding return address `ret` (looked
    /// up at `ret - 1`, inside the call), if it is in the fixture.
    fn name(&self, maps: &ProcessMaps, addr: u64, is_return: bool) -> Option<&str> {
        let lookup = if is_return { addr - 1 } else { addr };
        let m = maps.find(lookup)?;
        if m.path != self.path {
            return None;
        }
        let svma = lookup - maps.base_of(&m.path)?;
        self.funcs
            .iter()
            .find(|(a, s, _)| *a <= svma && svma < a + s)
            .map(|(_, _, n)| n.as_str())
    }
}

fn mapped_file(maps: &ProcessMaps, addr: u64) -> String {
    maps.find(addr - 1)
        .map(|m| m.path.clone())
        .unwrap_or_default()
}

/// The fixture's own frames of a stack, innermost first.
fn fixture_names(syms: &Symbols, maps: &ProcessMaps, frames: &[u64]) -> Vec<String> {
    frames
        .iter()
        .enumerate()
        .filter_map(|(i, &a)| syms.name(maps, a, i > 0).map(str::to_string))
        .collect()
}

/// Unwinds one blocked fixture, checks the chain, compares with gdb, and
/// returns the sample for the cost figures.
fn check_mode(args: &[&str], expected_own: &[&str], library: Option<&str>) -> Sample {
    let blocked = start_blocked(args);
    let pid = blocked.child.id();
    let s = sample(pid);
    let stack = StackCopy {
        base: s.stack_base,
        bytes: &s.stack,
    };
    let mut unwinder = Unwinder::new();
    let mut process = unwinder.process(&s.maps, MappedFiles::Root(Path::new("/")));
    let unwound = process.unwind(s.regs, &stack, 127);
    let syms = Symbols::read(&fixture());
    let own = fixture_names(&syms, &s.maps, &unwound.frames);

    // gdb also shows inlined calls (at their caller's pc) and tail calls it
    // reconstructs from the DWARF call-site records of libc's debug info
    // (__futex_abstimed_wait_cancelable64 jumps to
    // __futex_abstimed_wait_common): neither has a return address on the
    // stack, so no stack unwinder can or should report them. The real
    // frames must match exactly.
    let gdb = gdb_frames(pid);
    let gdb_real: Vec<u64> = gdb
        .iter()
        .filter(|(_, kind, _)| kind != "INLINE_FRAME" && kind != "TAILCALL_FRAME")
        .map(|(pc, _, _)| *pc)
        .collect();
    let describe = |frames: &[u64]| {
        frames
            .iter()
            .map(|&a| format!("{a:#x} {}", mapped_file(&s.maps, a + 1)))
            .collect::<Vec<_>>()
            .join("\n  ")
    };
    assert_eq!(
        unwound.frames,
        gdb_real,
        "{args:?}: the CFI unwind differs from gdb's bt\nours:\n  {}\ngdb: {gdb:#x?}",
        describe(&unwound.frames)
    );
    assert!(!unwound.truncated, "{args:?}: the unwind ended early");
    assert_eq!(
        own.iter()
            .map(String::as_str)
            .filter(|n| *n != "_start")
            .collect::<Vec<_>>(),
        expected_own,
        "{args:?}: the fixture's own frames, innermost first"
    );
    // The innermost frame is glibc's (the blocking call).
    assert!(
        mapped_file(&s.maps, unwound.frames[0] + 1).contains("libc.so"),
        "{args:?}: frame 0 is in libc"
    );
    if let Some(lib) = library {
        let in_lib = unwound
            .frames
            .iter()
            .filter(|&&a| mapped_file(&s.maps, a).ends_with(lib))
            .count();
        assert!(in_lib > 0, "{args:?}: no frame in {lib}");
        // The workload's callers beyond the library frames are all there.
        let after = own
            .iter()
            .position(|n| n == "call_library")
            .expect("call_library below the library");
        assert_eq!(&own[after + 1..after + 1 + CHAIN.len()], CHAIN);
    }

    // Frame pointers alone, the kernel's walk today, on the same copy.
    let fp = frame_pointer_walk(s.regs, &stack, 127);
    let fp_own = fixture_names(&syms, &s.maps, &fp);
    let recovered = expected_own
        .iter()
        .filter(|n| fp_own.iter().any(|f| f == *n))
        .count();
    println!(
        "{args:?}: gdb {} frames, of which {} inlined or reconstructed tail calls",
        gdb.len(),
        gdb.len() - gdb_real.len()
    );
    println!(
        "{args:?}: CFI {} frames, {}/{} of the fixture's functions; frame pointers alone {} frames, {recovered}/{}; stack used {} bytes",
        unwound.frames.len(),
        expected_own.len(),
        expected_own.len(),
        fp.len(),
        expected_own.len(),
        unwound.stack_bytes_used
    );
    drop(blocked);
    s
}

fn own_chain(prefix: &[&'static str]) -> Vec<&'static str> {
    prefix.iter().copied().chain(CHAIN).collect()
}

#[test]
fn omit_frame_pointer_chain_through_glibc_blocking_calls() {
    // Not while the attach test's agent runs, nor before its closer (the
    // process that detaches its probes) is gone: its uretprobes on the
    // same library files would put the kernel's return trampoline
    // ([uprobes]) on this fixture's stack, where gdb and the unwinder
    // then differ.
    let _serial = xpuscope_tests::agent::exclusive();
    xpuscope_tests::device::wait_for_closers();
    for mode in ["nanosleep", "mutex", "condvar"] {
        check_mode(&[mode], &own_chain(&[]), None);
    }
    check_mode(&["pipe"], &own_chain(&["block_on_pipe"]), None);
}

fn nvidia_lib(rel: &str) -> String {
    fixtures::nvidia_libs()
        .join(rel)
        .to_string_lossy()
        .into_owned()
}

const NCCL: &str = "nvidia/nccl/lib/libnccl.so.2";
const CUDART: &str = "nvidia/cuda_runtime/lib/libcudart.so.12";

#[test]
fn callers_beyond_real_libnccl_and_libcudart() {
    // Not while the attach test's agent runs, nor before its closer (the
    // process that detaches its probes) is gone: its uretprobes on the
    // same library files would put the kernel's return trampoline
    // ([uprobes]) on this fixture's stack, where gdb and the unwinder
    // then differ.
    let _serial = xpuscope_tests::agent::exclusive();
    xpuscope_tests::device::wait_for_closers();
    let nccl = nvidia_lib(NCCL);
    check_mode(
        &["dlcall", &nccl, "ncclGetUniqueId"],
        &own_chain(&["block_on_pipe", "getenv", "call_library"]),
        Some("libnccl.so.2"),
    );
    let cudart = nvidia_lib(CUDART);
    check_mode(
        &["dlcall", &cudart, "cudaGetDeviceCount"],
        &own_chain(&["block_on_pipe", "dlopen", "call_library"]),
        Some("libcudart.so.12"),
    );
}

/// Time per stack, as ratios against the frame-pointer walk measured in the
/// same run (printed for docs/src/measurements/stacks.md; no timing is asserted). Content is:
/// every repeat gives the first unwind's frames.
#[test]
fn unwind_cost_against_frame_pointers() {
    // Not while the attach test's agent runs, nor before its closer (the
    // process that detaches its probes) is gone: its uretprobes on the
    // same library files would put the kernel's return trampoline
    // ([uprobes]) on this fixture's stack, where gdb and the unwinder
    // then differ.
    let _serial = xpuscope_tests::agent::exclusive();
    xpuscope_tests::device::wait_for_closers();
    let cases: Vec<(&str, Vec<String>, Vec<&'static str>)> = vec![
        (
            "fixture nanosleep",
            vec!["nanosleep".into()],
            own_chain(&[]),
        ),
        (
            "libnccl",
            vec!["dlcall".into(), nvidia_lib(NCCL), "ncclGetUniqueId".into()],
            own_chain(&["block_on_pipe", "getenv", "call_library"]),
        ),
        (
            "libcudart",
            vec![
                "dlcall".into(),
                nvidia_lib(CUDART),
                "cudaGetDeviceCount".into(),
            ],
            own_chain(&["block_on_pipe", "dlopen", "call_library"]),
        ),
    ];
    let mut figures = HashMap::new();
    for (label, args, expected) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let s = check_mode(&args, &expected, None);
        let stack = StackCopy {
            base: s.stack_base,
            bytes: &s.stack,
        };
        // Cold: reading every mapped file's CFI and building the process.
        let cold_start = Instant::now();
        let mut unwinder = Unwinder::new();
        let mut process = unwinder.process(&s.maps, MappedFiles::Root(Path::new("/")));
        let first = process.unwind(s.regs, &stack, 127);
        let cold = cold_start.elapsed();
        // A further process mapping the same files (CFI cached, rule cache
        // empty): building its unwinder plus its first, uncached stack.
        let fresh_rounds = 200u32;
        let warm_start = Instant::now();
        for _ in 0..fresh_rounds {
            let mut again = unwinder.process(&s.maps, MappedFiles::Root(Path::new("/")));
            let second = again.unwind(s.regs, &stack, 127);
            assert_eq!(first, second);
        }
        let new_process = warm_start.elapsed() / fresh_rounds;

        let rounds = 20_000u32;
        let t = Instant::now();
        for _ in 0..rounds {
            let u = process.unwind(s.regs, &stack, 127);
            assert_eq!(u.frames.len(), first.frames.len());
        }
        let cfi_ns = t.elapsed().as_nanos() as f64 / f64::from(rounds);
        let t = Instant::now();
        let mut fp_frames = 0;
        for _ in 0..rounds {
            fp_frames = frame_pointer_walk(s.regs, &stack, 127).len();
        }
        let fp_ns = t.elapsed().as_nanos() as f64 / f64::from(rounds);
        println!(
            "{label}: steady state {cfi_ns:.0} ns/stack for {} frames ({:.0} ns/frame), frame-pointer walk {fp_ns:.0} ns/stack for {fp_frames} frames (ratio {:.1}x); first stack of a process {:.1} ms with CFI reads, {:.1} us with CFI cached; {} files cached, stack used {} of {} bytes",
            first.frames.len(),
            cfi_ns / first.frames.len() as f64,
            cfi_ns / fp_ns.max(1.0),
            cold.as_secs_f64() * 1e3,
            new_process.as_secs_f64() * 1e6,
            unwinder.cached_files(),
            first.stack_bytes_used,
            s.stack.len()
        );
        figures.insert(label, cfi_ns);
    }
    assert_eq!(figures.len(), 3);
}

/// The fixture's own functions of a trace stack (root first), by the
/// mapping each frame names: the fixture binary's (less the C runtime's
/// `_start`, linked into it).
fn own_frames(frames: &[String], mappings: &[String]) -> Vec<String> {
    frames
        .iter()
        .zip(mappings)
        .filter(|(f, m)| m.ends_with("xpuscope-unwind-chain") && *f != "_start")
        .map(|(f, _)| f.clone())
        .collect()
}

/// End to end (root, eBPF): the same chains under `agent attach`. The
/// kernel copies each off-CPU and allocating stack's registers and top,
/// the agent unwinds them from the CFI: every function of each chain (the
/// frames the ptrace tests above check against gdb's `bt`) is in the
/// trace's stacks, in order, for code without frame pointers, through
/// glibc's blocking calls, through the real libnccl (inside a call the
/// agent return-probes) and libcudart, and for allocations; the summary's off-CPU reasons name the fixture's
/// functions, not glibc's wrappers.
#[test]
fn attach_unwinds_off_cpu_and_allocation_stacks_without_frame_pointers() {
    use xpuscope_tests::agent::{Lines, Proc, Recording, TempDir, exclusive, go};
    use xpuscope_tests::trace_check::{Timeline, check_importer_rules, decode};

    let _serial = exclusive();
    let (nccl, cudart) = (nvidia_lib(NCCL), nvidia_lib(CUDART));
    // (child spec, its own functions innermost first, a library its stack
    // passes through)
    let blocking: Vec<(String, Vec<&str>, Option<&str>)> = vec![
        ("nanosleep".into(), own_chain(&[]), None),
        ("mutex".into(), own_chain(&[]), None),
        ("condvar".into(), own_chain(&[]), None),
        ("pipe".into(), own_chain(&["block_on_pipe"]), None),
        // Inside libnccl's ncclGetUniqueId, which the agent return-probes
        // (the child waits 300 ms after its dlopen: the probes are live
        // before the call): the stack holds the kernel's uretprobe
        // trampoline where the caller's return address was, and the record
        // carries the real one, which the agent puts back before the CFI
        // unwind.
        (
            format!("dlcall:{nccl}:ncclGetUniqueId"),
            own_chain(&["block_on_pipe", "getenv", "call_library"]),
            Some("libnccl.so.2"),
        ),
        (
            format!("dlcall:{cudart}:cudaGetDeviceCount"),
            own_chain(&["block_on_pipe", "dlopen", "call_library"]),
            Some("libcudart.so.12"),
        ),
    ];
    let alloc_spec = format!("alloc:{cudart}");
    let mut args: Vec<&str> = vec!["forks"];
    args.extend(blocking.iter().map(|(spec, _, _)| spec.as_str()));
    args.push(&alloc_spec);

    let dir = TempDir::new("unwind-attach");
    let mut fx = Proc::spawn(
        "unwind fixture",
        Command::new(fixture())
            .args(&args)
            .env("UNWIND_CHAIN_DELAY_MS", "300")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    );
    let mut stdin = fx.stdin();
    let mut out = Lines::new(fx.stdout());
    let rec = Recording::start(
        dir.path(),
        &["--pid", &fx.pid().to_string(), "--stacks", "all"],
    );
    go(&mut stdin);
    let pids = ready_pids(&mut out, blocking.len() + 1);
    // The allocating child goes on calling cudaMalloc (every 50 ms) while
    // its probes are attached after its dlopen.
    std::thread::sleep(Duration::from_millis(1500));
    drop(stdin); // the fixture kills its children and exits
    let done = rec.finish(Duration::from_secs(30));
    assert!(
        done.stderr.contains("stopped (target exited)"),
        "{}",
        done.stderr
    );
    let trace = decode(&done.trace).expect("decodes with the official schema");
    check_importer_rules(&trace).expect("importer rules hold");
    let tl = Timeline::new(&trace);
    // The libnccl child's stacks were taken inside a return-probed call.
    assert!(
        done.stats["user_stacks_past_uretprobes"]
            .as_u64()
            .is_some_and(|n| n > 0),
        "no stack unwound past a uretprobe trampoline: {}",
        done.stats
    );

    for ((spec, expected, library), &pid) in blocking.iter().zip(&pids) {
        let want: Vec<&str> = expected.iter().rev().copied().collect();
        let samples: Vec<_> = tl.stack_samples.iter().filter(|s| s.tid == pid).collect();
        assert!(!samples.is_empty(), "{spec}: no off-CPU stacks of {pid}");
        let found = samples.iter().find(|s| {
            own_frames(&s.frames, &s.mappings) == want && s.mappings.iter().any(|m| m == "kernel")
        });
        let Some(found) = found else {
            panic!(
                "{spec}: no off-CPU stack of {pid} holds the chain {want:?}; its stacks:\n{:#?}",
                samples.iter().map(|s| s.describe()).collect::<Vec<_>>()
            );
        };
        if let Some(lib) = library {
            // Library frames sit between the fixture's caller of the
            // library and the fixture's function the library called.
            let at = |name: &str| found.frames.iter().position(|f| f == name).unwrap();
            let (caller, callee) = (at("call_library"), at(want[want.len() - 2]));
            assert!(
                found.mappings[caller + 1..callee]
                    .iter()
                    .any(|m| m.ends_with(lib)),
                "{spec}: no {lib} frame between call_library and {}: {:?}",
                want[want.len() - 2],
                found.frames.iter().zip(&found.mappings).collect::<Vec<_>>()
            );
        }
    }

    // Allocating stacks (taken as cudaMalloc returns, in its caller).
    let alloc_pid = pids[blocking.len()];
    let want: Vec<&str> = own_chain(&["allocate_in_loop"]).into_iter().rev().collect();
    let mallocs: Vec<_> = tl
        .slices
        .iter()
        .filter(|s| s.name.starts_with("cudaMalloc"))
        .filter(|s| xpuscope_tests::device::thread_of(&tl, s).is_some_and(|(p, _)| p == alloc_pid))
        .collect();
    assert!(!mallocs.is_empty(), "cudaMalloc calls of {alloc_pid}");
    for s in &mallocs {
        let cs = s.callstack.as_ref().expect("a stack on each allocation");
        let own: Vec<&str> = cs
            .iter()
            .map(String::as_str)
            .filter(|f| want.contains(f))
            .collect();
        assert_eq!(own, want, "allocating stack {cs:?}");
    }

    // The allocating child sleeps 50 ms between its calls: its off-CPU
    // stacks after the first are copied only up to the stack end learned
    // from the first, without a frame-pointer walk, and every one is as
    // whole as the first.
    let sleeps: Vec<_> = tl
        .stack_samples
        .iter()
        .filter(|s| s.tid == alloc_pid && s.frames.iter().any(|f| f == "allocate_in_loop"))
        .collect();
    assert!(
        sleeps.len() >= 10,
        "{} off-CPU stacks of the allocating child",
        sleeps.len()
    );
    for s in &sleeps {
        let own: Vec<&str> = s
            .frames
            .iter()
            .map(String::as_str)
            .filter(|f| want.contains(f))
            .collect();
        assert_eq!(own, want, "off-CPU stack {:?}", s.describe());
        assert!(
            !s.frames.iter().any(|f| f.starts_with("[truncated")),
            "{:?}",
            s.describe()
        );
    }
    let short = done.stats["user_stacks_short_copies"].as_u64().unwrap();
    assert!(
        short >= sleeps.len() as u64 / 2,
        "{short} short copies of {} stacks: {}",
        sleeps.len(),
        done.stats
    );
    // The child blocks at the same place each time: its stacks after the
    // first were symbolized once and reused (the agent's stack memo),
    // each sample above still whole.
    let memoized = done.stats["stacks_memoized"].as_u64().unwrap();
    assert!(
        memoized >= sleeps.len() as u64 / 2,
        "{memoized} memoized of {} stacks: {}",
        sleeps.len(),
        done.stats
    );
    // And most of those came in a short record: the ring carried at least
    // (full record - largest short record) bytes less for each of half the
    // short copies (sizes of `xpuscope_common::OffCpuStackOf`).
    const FULL_RECORD: u64 = 10_336;
    const LARGEST_SHORT_RECORD: u64 = 4_736;
    let stacks = done.stats["stacks"].as_u64().unwrap();
    let record_bytes = done.stats["stack_record_bytes"].as_u64().unwrap();
    assert!(
        record_bytes <= stacks * FULL_RECORD - short / 2 * (FULL_RECORD - LARGEST_SHORT_RECORD),
        "{record_bytes} ring bytes for {stacks} stacks, {short} short copies: {}",
        done.stats
    );

    // Stacks came from the CFI unwind, and the summary's top off-CPU
    // reasons name the fixture's functions.
    assert!(
        done.stats["user_stacks_cfi"].as_u64().unwrap() > 0,
        "{}",
        done.stats
    );
    let top: Vec<&str> = done.stats["top_offcpu"]
        .as_array()
        .expect("top_offcpu")
        .iter()
        .filter_map(|r| r["what"].as_str())
        .collect();
    for own in ["block_in_libc", "block_on_pipe"] {
        assert!(
            top.iter().any(|w| w.ends_with(&format!("<- {own}"))),
            "no top off-CPU reason ends in {own}: {top:?}"
        );
    }
}

/// The same blocking chains of the fixture run inside another root (Debian
/// unstable's, with its own glibc), chrooted and in a container (an
/// overlay of that root, `pivot_root`, a mount namespace of its own): every
/// chain is whole, through that glibc, and glibc's frames are named by its
/// own symbols. Stacks of a job in a container are unwound and named from
/// the container's files, never from the host's files of the same name.
#[test]
fn attach_unwinds_a_job_in_another_root() {
    use xpuscope_tests::roots::Entry;
    let _serial = xpuscope_tests::agent::exclusive();
    // Chrooted, its maps name its glibc by the host path of the root's
    // copy; in a container, `/usr/lib/x86_64-linux-gnu/libc.so.6`, the
    // path of the host's own glibc.
    let root = xpuscope_tests::roots::sid();
    let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6";
    unwind_in_root(Entry::Chroot, &format!("{}{libc}", root.display()));
    unwind_in_root(Entry::Container, libc);
}

/// The pids of the fixture's first `n` children, as each says
/// "ready INDEX PID" (`forks` mode).
fn ready_pids(out: &mut xpuscope_tests::agent::Lines, n: usize) -> Vec<i32> {
    (0..n)
        .map(|i| {
            let line = out.wait_for(&format!("ready {i} "), Duration::from_secs(30));
            line.rsplit(' ')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("pid in {line:?}"))
        })
        .collect()
}

/// The blocking chains of the fixture run inside the Debian unstable root
/// as `entry` says, under `agent attach`; `libc` is the path its maps give
/// the root's glibc.
fn unwind_in_root(entry: xpuscope_tests::roots::Entry, libc: &str) {
    use xpuscope_tests::agent::{Lines, Proc, Recording, TempDir, go};
    use xpuscope_tests::roots;
    use xpuscope_tests::trace_check::{Timeline, decode};

    let root = roots::sid();
    let dir = roots::place(root, "unwind_chain", &[&fixture()]);
    let blocking: Vec<(&str, Vec<&str>)> = vec![
        ("nanosleep", own_chain(&[])),
        ("mutex", own_chain(&[])),
        ("pipe", own_chain(&["block_on_pipe"])),
    ];
    let mut cmd = entry.command(root, &format!("{dir}/xpuscope-unwind-chain"));
    cmd.arg("forks")
        .args(blocking.iter().map(|(spec, _)| *spec))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let out_dir = TempDir::new("unwind-root");
    let mut fx = Proc::spawn("unwind fixture in another root", &mut cmd);
    let mut stdin = fx.stdin();
    let mut out = Lines::new(fx.stdout());
    let rec = Recording::start(
        out_dir.path(),
        &["--pid", &fx.pid().to_string(), "--stacks", "all"],
    );
    go(&mut stdin);
    let pids = ready_pids(&mut out, blocking.len());
    std::thread::sleep(Duration::from_millis(1000));
    drop(stdin);
    let done = rec.finish(Duration::from_secs(30));
    let trace = decode(&done.trace).expect("decodes with the official schema");
    let tl = Timeline::new(&trace);
    for ((spec, expected), &pid) in blocking.iter().zip(&pids) {
        let want: Vec<&str> = expected.iter().rev().copied().collect();
        let samples: Vec<_> = tl.stack_samples.iter().filter(|s| s.tid == pid).collect();
        let found = samples.iter().find(|s| {
            own_frames(&s.frames, &s.mappings) == want && s.mappings.iter().any(|m| m == "kernel")
        });
        let Some(found) = found else {
            panic!(
                "{entry:?} {spec}: no off-CPU stack of {pid} holds the chain {want:?}; its stacks:\n{:#?}",
                samples.iter().map(|s| s.describe()).collect::<Vec<_>>()
            );
        };
        // The chain starts in the root's glibc, named by its symbols.
        let start = found
            .frames
            .iter()
            .zip(&found.mappings)
            .find(|(f, _)| *f == "__libc_start_main");
        assert_eq!(
            start.map(|(_, m)| m.as_str()),
            Some(libc),
            "{entry:?} {spec}: {:?}",
            found.frames.iter().zip(&found.mappings).collect::<Vec<_>>()
        );
    }
}
