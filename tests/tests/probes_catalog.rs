//! The probe catalog (`xpuscope-probes`) against real files: the stand-in
//! device libraries built from `tests/standins/` and the real NVIDIA
//! libraries from PyPI (pinned, cached under `~/.cache/xpuscope/nvidia-libs`,
//! installed with pip on first use).
//!
//! No root needed. Run with `--nocapture` to see the placement tables.

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use xpuscope_probes::activity::{self, ActivityApi, ActivityDetail, ActivityKind};
use xpuscope_probes::catalog::Library;
use xpuscope_probes::decode::table::ProbeTable;
use xpuscope_probes::discover::discover;
use xpuscope_probes::maps::ProcessMaps;
use xpuscope_probes::placement::ProbeCost;
use xpuscope_probes::resolve::{ResolvedLibrary, SkipReason, exported_functions, resolve};

fn standins() -> PathBuf {
    xpuscope_tests::fixtures::build_all().join("standins")
}

/// The stand-in libraries: (folder, file, library).
const STANDINS: &[(&str, &str, Library)] = &[
    ("lib", "libcudart.so.12", Library::Cudart),
    ("lib", "libcuda.so.1", Library::Cuda),
    ("lib-cfprot", "libcudart.so.12", Library::Cudart),
    ("lib", "libnccl.so.2", Library::Nccl),
    ("lib", "libcupti.so.12", Library::Cupti),
    ("lib", "libascendcl.so", Library::AscendCl),
    ("lib", "libruntime.so", Library::AscendRuntime),
    ("lib", "libhccl.so", Library::Hccl),
    ("lib", "libmspti.so", Library::Mspti),
];

fn resolve_or_panic(path: &Path, lib: Library) -> ResolvedLibrary {
    resolve(path, lib).unwrap_or_else(|e| panic!("resolving {}: {e}", path.display()))
}

/// Checks that hold for every resolved library.
fn check_common(r: &ResolvedLibrary) {
    let required: Vec<&str> = r.missing_required().map(|f| f.name).collect();
    assert!(
        required.is_empty(),
        "{}: required functions missing: {required:?}",
        r.path.display()
    );
    let mut addresses = HashSet::new();
    for p in &r.probes {
        assert!(
            addresses.insert(p.vaddr),
            "{}: two probes at {:#x}",
            r.path.display(),
            p.vaddr
        );
        // The return probe hijacks the return address at sp: the stack must
        // be as at entry.
        assert_eq!(p.placement.sp_delta, 0, "{}", p.function.name);
        assert!(p.placement.offset < 24, "{}", p.function.name);
        assert_eq!(
            p.placement.emulated,
            p.placement.cost != ProbeCost::SingleStepped
        );
        if p.placement.offset > 0 {
            assert!(
                p.placement.emulated,
                "{}: moved but not onto an emulated instruction",
                p.function.name
            );
        }
    }
}

// ---------------------------------------------------------------- stand-ins

#[test]
fn every_catalog_function_resolves_in_the_standins() {
    let dir = standins();
    for (sub, file, lib) in STANDINS {
        let r = resolve_or_panic(&dir.join(sub).join(file), *lib);
        println!("{r}");
        check_common(&r);
        let report = r.report();
        assert_eq!(report.len(), r.probes.len());
        assert!(
            report
                .iter()
                .all(|row| row.library == *lib && row.file_offset == row.vaddr)
        );
        // Every probe found its public name (the stand-ins export them all).
        for p in &r.probes {
            assert_eq!(p.symbol, p.function.name);
        }
        assert_eq!(
            r.probes.len() + r.skipped.len() + r.missing.len(),
            lib.functions().len(),
            "every catalog entry is accounted for"
        );
    }
}

#[test]
fn cf_protection_moves_every_probe_past_endbr64() {
    let dir = standins();
    let plain = resolve_or_panic(&dir.join("lib/libcudart.so.12"), Library::Cudart);
    let cf = resolve_or_panic(&dir.join("lib-cfprot/libcudart.so.12"), Library::Cudart);
    assert_eq!(plain.probes.len(), cf.probes.len());
    let mnemonic = |s: &str| s.split(' ').next().unwrap_or("").to_string();
    for (p, c) in plain.probes.iter().zip(&cf.probes) {
        let name = p.function.name;
        assert_eq!(name, c.function.name);
        assert_eq!(c.placement.first_insn, "endbr64", "{name}");
        assert_ne!(p.placement.first_insn, "endbr64", "{name}");
        assert_eq!(
            (p.placement.sp_delta, c.placement.sp_delta),
            (0, 0),
            "{name}"
        );
        if p.placement.first_insn == "push %rbp" {
            // The common case: plain probes the push at 0, cf-protection at +4.
            assert_eq!((p.placement.offset, c.placement.offset), (0, 4), "{name}");
            assert_eq!(c.placement.probed_insn, "push %rbp", "{name}");
            assert_eq!(c.placement.cost, ProbeCost::Emulated, "{name}");
        } else if p.placement.emulated {
            // A wrapper (`mov $cbid,%ecx; xor %edx,%edx; jmp impl`): the same
            // walk, 4 bytes later.
            assert_eq!(c.placement.offset, p.placement.offset + 4, "{name}");
            assert_eq!(
                mnemonic(&c.placement.probed_insn),
                mnemonic(&p.placement.probed_insn),
                "{name}"
            );
            assert_eq!(c.placement.skipped[0], "endbr64", "{name}");
            assert_eq!(c.placement.skipped[1..], p.placement.skipped[..], "{name}");
        } else {
            // The first real instruction writes a register the decoder reads:
            // both stay on the entry (single-stepped either way).
            assert_eq!((p.placement.offset, c.placement.offset), (0, 0), "{name}");
            assert_eq!(c.placement.cost, ProbeCost::SingleStepped, "{name}");
        }
    }
    // The launch entry points are plain frame-pointer functions in both builds.
    for name in [
        "cudaLaunchKernel",
        "cudaLaunchKernel_ptsz",
        "__cudaLaunchKernel",
        "cudaMalloc",
        "cudaMemcpyAsync",
    ] {
        assert_eq!(plain.probe(name).unwrap().placement.offset, 0, "{name}");
        assert_eq!(cf.probe(name).unwrap().placement.offset, 4, "{name}");
    }
}

/// NCCL exports each function twice at one address (strong `pncclX`, weak
/// `ncclX`): one probe, under the public name.
fn check_nccl_aliases(path: &Path) {
    let exports = exported_functions(path).unwrap();
    let at: HashMap<&str, u64> = exports.iter().map(|e| (e.name.as_str(), e.vaddr)).collect();
    let r = resolve_or_panic(path, Library::Nccl);
    assert!(!r.probes.is_empty());
    for p in &r.probes {
        let strong = format!("p{}", p.function.name);
        assert_eq!(
            at.get(strong.as_str()),
            Some(&p.vaddr),
            "{strong} shares {}'s address",
            p.function.name
        );
        assert!(
            p.other_names.contains(&strong),
            "{}: {:?}",
            p.function.name,
            p.other_names
        );
        assert_eq!(p.symbol, p.function.name, "reported under the public name");
    }
    let names: HashSet<&str> = r.probes.iter().map(|p| p.symbol.as_str()).collect();
    assert!(names.iter().all(|n| !n.starts_with('p')), "{names:?}");
}

#[test]
fn nccl_aliases_dedupe() {
    check_nccl_aliases(&standins().join("lib/libnccl.so.2"));
    check_nccl_aliases(&nvidia_libs().join("nvidia/nccl/lib/libnccl.so.2"));
}

// ---------------------------------------------------------------- real NVIDIA libraries

/// The pinned wheels and the library each provides.
const NVIDIA_WHEELS: &[(&str, &str, Library)] = &[
    (
        "nvidia-cuda-runtime-cu12==12.9.79",
        "nvidia/cuda_runtime/lib/libcudart.so.12",
        Library::Cudart,
    ),
    (
        "nvidia-nccl-cu12==2.21.5",
        "nvidia/nccl/lib/libnccl.so.2",
        Library::Nccl,
    ),
    (
        "nvidia-cuda-cupti-cu12==12.9.79",
        "nvidia/cuda_cupti/lib/libcupti.so.12",
        Library::Cupti,
    ),
];

/// `~/.cache/xpuscope/nvidia-libs` with the pinned wheels installed (the
/// shared installer: `xpuscope_tests::fixtures::nvidia_libs`).
fn nvidia_libs() -> PathBuf {
    xpuscope_tests::fixtures::nvidia_libs()
}

#[test]
fn real_nvidia_libraries_resolve_and_place() {
    let root = nvidia_libs();
    for (wheel, rel, lib) in NVIDIA_WHEELS {
        let r = resolve_or_panic(&root.join(rel), *lib);
        // The table the lead reports.
        println!("{wheel}\n{r}");
        let missing: Vec<&str> = r.missing.iter().map(|f| f.name).collect();
        println!("  missing in the real {}: {missing:?}\n", lib.soname());
        check_common(&r);
        // Measured on these versions: every probe is emulated (most on a
        // leading `push`), none single-stepped.
        for p in &r.probes {
            assert!(
                p.placement.emulated,
                "{}: {} on a single-stepped {}",
                r.path.display(),
                p.function.name,
                p.placement.first_insn
            );
        }
    }
    // CUDA 12.9's __cudaLaunchKernel[_ptsz] tail-jump into cudaLaunchKernel[_ptsz].
    let cudart = resolve_or_panic(&root.join(NVIDIA_WHEELS[0].1), Library::Cudart);
    for (thunk, target) in [
        ("__cudaLaunchKernel", "cudaLaunchKernel"),
        ("__cudaLaunchKernel_ptsz", "cudaLaunchKernel_ptsz"),
    ] {
        let s = cudart
            .skipped
            .iter()
            .find(|s| s.function.name == thunk)
            .expect(thunk);
        assert_eq!(s.reason, SkipReason::TailCallTo(target));
        assert_eq!(cudart.probe(thunk).map(|p| p.function.name), Some(target));
    }
}

// ---------------------------------------------------------------- addresses at run time

/// dlopen'ed into this test process (RTLD_LOCAL: nothing interposes).
struct Loaded(*mut libc::c_void);

impl Loaded {
    fn open(path: &Path) -> Loaded {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; the libraries' constructors are
        // inert until their API is called.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        assert!(!h.is_null(), "dlopen {}", path.display());
        Loaded(h)
    }

    fn sym(&self, name: &str) -> u64 {
        let c = CString::new(name).unwrap();
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        assert!(!p.is_null(), "dlsym {name}");
        p as u64
    }
}

/// Set, to the test's name, in the child process [`in_own_process`] runs
/// a test in.
const IN_CHILD: &str = "XPUSCOPE_TEST_IN_OWN_PROCESS";

/// Runs test `name`'s `body` in a child process of its own (this test
/// binary again, on that test only). For tests that load a device library:
/// it stays mapped, and a process mapping one is a process `agent
/// service` traces with all its children, the later tests' jobs among
/// them.
fn in_own_process(name: &str, body: fn()) {
    if std::env::var(IN_CHILD).is_ok_and(|n| n == name) {
        return body();
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads", "1", "--nocapture"])
        .env(IN_CHILD, name)
        .output()
        .expect("run the test in a child");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} in its own process: {}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn probe_addresses_match_the_dynamic_linker() {
    in_own_process(
        "probes_catalog::probe_addresses_match_the_dynamic_linker",
        probe_addresses_match_the_dynamic_linker_here,
    );
}

fn probe_addresses_match_the_dynamic_linker_here() {
    let dir = standins();
    let mut libs: Vec<(PathBuf, Library)> = STANDINS
        .iter()
        .filter(|(sub, _, _)| *sub == "lib")
        .map(|(sub, file, lib)| (dir.join(sub).join(file), *lib))
        .collect();
    let real = nvidia_libs();
    libs.push((real.join(NVIDIA_WHEELS[0].1), Library::Cudart));
    libs.push((real.join(NVIDIA_WHEELS[1].1), Library::Nccl));
    let handles: Vec<Loaded> = libs.iter().map(|(p, _)| Loaded::open(p)).collect();

    let pid = std::process::id();
    let maps = ProcessMaps::read(pid).unwrap();
    let loaded = discover(&maps);
    let mut table = ProbeTable::new();
    for ((path, lib), handle) in libs.iter().zip(&handles) {
        let canonical = path.canonicalize().unwrap();
        let l = loaded
            .iter()
            .find(|l| Path::new(&l.path) == canonical)
            .unwrap_or_else(|| panic!("{} not discovered in {loaded:#?}", canonical.display()));
        assert_eq!(l.library, *lib);
        assert_eq!(l.inode, std::fs::metadata(&canonical).unwrap().ino());
        assert!(!l.deleted);
        let r = resolve_or_panic(path, *lib);
        let attached = table.add_library(pid, l, &r);
        assert_eq!(
            attached.len(),
            r.probes.len(),
            "{}: every probe is mapped",
            path.display()
        );
        for (p, a) in r.probes.iter().zip(&attached) {
            let start = handle.sym(&p.symbol);
            assert_eq!(
                l.address_of(p.file_offset),
                Some(start),
                "{}",
                p.function.name
            );
            assert_eq!(
                a.key.probe_ip,
                start + p.placement.offset,
                "{}",
                p.function.name
            );
            assert_eq!(a.key.tgid, pid);
            assert_eq!(a.file_offset, p.probe_file_offset());
            let target = table.get(pid, a.key.probe_ip).unwrap();
            assert_eq!(target.function.name, p.function.name);
        }
        // A second scan with nothing new: no change.
        let again = discover(&ProcessMaps::read(pid).unwrap());
        assert!(
            xpuscope_probes::discover::diff(&loaded, &again)
                .added
                .iter()
                .all(|a| a.path != l.path)
        );
    }
}

// ---------------------------------------------------------------- record layouts

fn record_layout() -> Value {
    let bin = standins().join("bin/record_layout");
    let out = Command::new(&bin)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "{}: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("record_layout prints JSON")
}

fn off(layout: &Value, record: &str, field: &str) -> usize {
    layout[record][field]
        .as_u64()
        .unwrap_or_else(|| panic!("{record}.{field} in {layout}")) as usize
}

/// A record of `size` bytes with `values` written at the C offsets.
fn record(layout: &Value, name: &str, values: &[(&str, &[u8])]) -> Vec<u8> {
    let mut r = vec![0u8; off(layout, name, "size")];
    for (field, bytes) in values {
        let o = off(layout, name, field);
        r[o..o + bytes.len()].copy_from_slice(bytes);
    }
    r
}

#[test]
fn activity_parsers_match_the_c_layouts() {
    let layout = record_layout();
    let u32b = |v: u32| v.to_le_bytes().to_vec();
    let u64b = |v: u64| v.to_le_bytes().to_vec();

    // CUPTI kernel, read through the 128-byte copy the probe makes.
    let k = record(
        &layout,
        "CUpti_ActivityKernel9",
        &[
            ("kind", &u32b(10)),
            ("start", &u64b(111)),
            ("end", &u64b(222)),
            ("deviceId", &u32b(3)),
            ("streamId", &u32b(44)),
            ("gridX", &u32b(7)),
            ("blockX", &u32b(128)),
            ("dynamicSharedMemory", &u32b(4096)),
            ("correlationId", &u32b(55)),
            ("name", &u64b(0x1234_5678)),
        ],
    );
    let a = activity::parse(ActivityApi::Cupti, &k[..128]).unwrap();
    assert_eq!(
        (
            a.kind,
            a.start,
            a.end,
            a.device,
            a.stream,
            a.correlation_id,
            a.name_ptr
        ),
        (
            ActivityKind::Kernel,
            111,
            222,
            Some(3),
            Some(44),
            Some(55),
            Some(0x1234_5678)
        )
    );
    let ActivityDetail::Launch {
        grid,
        block,
        dynamic_shared,
        ..
    } = a.detail
    else {
        panic!("{a:?}")
    };
    assert_eq!((grid[0], block[0], dynamic_shared), (7, 128, 4096));

    let m = record(
        &layout,
        "CUpti_ActivityMemcpy6",
        &[
            ("kind", &u32b(1)),
            ("copyKind", &[2]),
            ("bytes", &u64b(1 << 20)),
            ("start", &u64b(5)),
            ("end", &u64b(6)),
            ("deviceId", &u32b(1)),
            ("streamId", &u32b(2)),
            ("correlationId", &u32b(3)),
        ],
    );
    let a = activity::parse(ActivityApi::Cupti, &m).unwrap();
    assert_eq!(
        (a.kind, a.start, a.end, a.device, a.stream, a.correlation_id),
        (ActivityKind::Memcpy, 5, 6, Some(1), Some(2), Some(3))
    );
    assert!(matches!(
        a.detail,
        ActivityDetail::Memcpy { bytes: 1048576, .. }
    ));

    let api = record(
        &layout,
        "CUpti_ActivityAPI",
        &[
            ("kind", &u32b(5)),
            ("cbid", &u32b(211)),
            ("start", &u64b(7)),
            ("end", &u64b(8)),
            ("processId", &u32b(9)),
            ("threadId", &u32b(10)),
            ("correlationId", &u32b(11)),
            ("returnValue", &u32b(35)),
        ],
    );
    let a = activity::parse(ActivityApi::Cupti, &api).unwrap();
    assert_eq!((a.start, a.end, a.correlation_id), (7, 8, Some(11)));
    assert_eq!(
        a.detail,
        ActivityDetail::Api {
            cbid: Some(211),
            pid: 9,
            tid: 10,
            ret: Some(35)
        }
    );

    // MSPTI, packed.
    let k = record(
        &layout,
        "msptiActivityKernel",
        &[
            ("kind", &u32b(2)),
            ("start", &u64b(1)),
            ("end", &u64b(2)),
            ("deviceId", &u32b(3)),
            ("streamId", &u32b(4)),
            ("correlationId", &u64b(5)),
            ("type", &u64b(6)),
            ("name", &u64b(7)),
        ],
    );
    let a = activity::parse(ActivityApi::Mspti, &k).unwrap();
    assert_eq!(
        (
            a.start,
            a.end,
            a.device,
            a.stream,
            a.correlation_id,
            a.name_ptr
        ),
        (1, 2, Some(3), Some(4), Some(5), Some(7))
    );
    assert_eq!(a.detail, ActivityDetail::KernelType { type_ptr: 6 });

    let h = record(
        &layout,
        "msptiActivityHccl",
        &[
            ("kind", &u32b(4)),
            ("start", &u64b(1)),
            ("end", &u64b(2)),
            ("deviceId", &u32b(3)),
            ("streamId", &u32b(4)),
            ("bandWidth", &2.5f64.to_le_bytes()),
            ("name", &u64b(6)),
            ("commName", &u64b(7)),
        ],
    );
    let a = activity::parse(ActivityApi::Mspti, &h).unwrap();
    assert_eq!(
        (a.start, a.end, a.device, a.stream, a.name_ptr),
        (1, 2, Some(3), Some(4), Some(6))
    );
    assert_eq!(
        a.detail,
        ActivityDetail::Hccl {
            bandwidth_gbps: 2.5,
            comm_name_ptr: 7
        }
    );

    let c = record(
        &layout,
        "msptiActivityCommunication",
        &[
            ("kind", &u32b(9)),
            ("dataType", &u32b(11)),
            ("count", &u64b(100)),
            ("deviceId", &u32b(3)),
            ("streamId", &u32b(4)),
            ("start", &u64b(5)),
            ("end", &u64b(6)),
            ("algType", &u64b(7)),
            ("name", &u64b(8)),
            ("commName", &u64b(9)),
            ("correlationId", &u64b(10)),
        ],
    );
    let a = activity::parse(ActivityApi::Mspti, &c).unwrap();
    assert_eq!(
        (
            a.start,
            a.end,
            a.device,
            a.stream,
            a.correlation_id,
            a.name_ptr
        ),
        (5, 6, Some(3), Some(4), Some(10), Some(8))
    );
    assert!(matches!(
        a.detail,
        ActivityDetail::Communication {
            count: 100,
            alg_ptr: 7,
            comm_name_ptr: 9,
            ..
        }
    ));

    let mk = record(
        &layout,
        "msptiActivityMarker",
        &[
            ("kind", &u32b(1)),
            ("flag", &u32b(2)),
            ("sourceKind", &u32b(0)),
            ("timestamp", &u64b(77)),
            ("id", &u64b(5)),
            ("objectId", &u64b(1000 | 1001 << 32)),
            ("name", &u64b(8)),
            ("domain", &u64b(9)),
        ],
    );
    let a = activity::parse(ActivityApi::Mspti, &mk).unwrap();
    assert_eq!((a.start, a.end, a.name_ptr), (77, 77, Some(8)));
    assert_eq!(
        a.detail,
        ActivityDetail::Marker {
            flag: 2,
            source_kind: 0,
            id: 5,
            pid_tid: Some((1000, 1001)),
            domain_ptr: 9
        }
    );

    let api = record(
        &layout,
        "msptiActivityApi",
        &[
            ("kind", &u32b(3)),
            ("start", &u64b(1)),
            ("end", &u64b(2)),
            ("processId", &u32b(3)),
            ("threadId", &u32b(4)),
            ("correlationId", &u64b(5)),
            ("name", &u64b(6)),
        ],
    );
    let a = activity::parse(ActivityApi::Mspti, &api).unwrap();
    assert_eq!(
        (a.start, a.end, a.correlation_id, a.name_ptr),
        (1, 2, Some(5), Some(6))
    );
    assert_eq!(
        a.detail,
        ActivityDetail::Api {
            cbid: None,
            pid: 3,
            tid: 4,
            ret: None
        }
    );
}

/// A mapped file whose name is not UTF-8 (any bytes are allowed) must not
/// hide the process's libraries: maps are read as bytes, lossily.
#[test]
fn a_non_utf8_mapping_name_does_not_hide_the_libraries() {
    in_own_process(
        "probes_catalog::a_non_utf8_mapping_name_does_not_hide_the_libraries",
        a_non_utf8_mapping_name_does_not_hide_the_libraries_here,
    );
}

fn a_non_utf8_mapping_name_does_not_hide_the_libraries_here() {
    use std::os::unix::ffi::OsStrExt;
    let mut name = format!("xpuscope-odd-{}-", std::process::id()).into_bytes();
    name.extend([0xff, 0xfe]);
    let dir = std::env::temp_dir().join(std::ffi::OsStr::from_bytes(&name));
    std::fs::create_dir_all(&dir).unwrap();
    // The stand-in runtime loads its driver from beside itself.
    for file in ["libcudart.so.12", "libcuda.so.1"] {
        std::fs::copy(standins().join("lib").join(file), dir.join(file)).unwrap();
    }
    let _handle = Loaded::open(&dir.join("libcudart.so.12"));
    let maps = ProcessMaps::read(std::process::id()).expect("maps read despite the odd name");
    let found = discover(&maps);
    let _ = std::fs::remove_dir_all(&dir);
    for library in [Library::Cudart, Library::Cuda] {
        assert!(
            found
                .iter()
                .any(|l| l.library == library && l.path.contains("xpuscope-odd-")),
            "{library:?}: {found:#?}"
        );
    }
}
