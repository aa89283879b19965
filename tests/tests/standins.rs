//! The stand-in device libraries (`tests/standins/`): exported ABI, record
//! layouts and runtime semantics, checked through the small C programs the
//! fixture build puts in `target/fixtures/standins/bin/`.
//!
//! Every child process runs under a guard that kills it on drop, and every
//! wait has a deadline, so a regression that hangs fails instead of stalling
//! the suite.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use object::read::elf::{Dyn, ElfFile64};
use object::{Endianness, Object, ObjectSection, ObjectSymbol, SymbolKind};
use serde_json::Value;

const MS: u64 = 1_000_000;

/// Environment the stand-ins read; cleared so the tests are hermetic.
const STANDIN_ENV: &[&str] = &[
    "STANDIN_DEVICE_MEM_BYTES",
    "STANDIN_DEVICE_COUNT",
    "STANDIN_NCCL_BW_GBPS",
    "STANDIN_NCCL_LAT_US",
    "STANDIN_NCCL_HANG_AT_SEQ",
    "STANDIN_HCCL_BW_GBPS",
    "STANDIN_HCCL_LAT_US",
    "STANDIN_HCCL_HANG_AT_SEQ",
    "STANDIN_LINK_SLOWDOWN",
    "STANDIN_PCIE_GBPS",
    "STANDIN_HBM_GBPS",
    "STANDIN_MEMCPY_LAT_US",
];

fn standins() -> PathBuf {
    xpuscope_tests::fixtures::build_all().join("standins")
}

fn lib(name: &str) -> PathBuf {
    standins().join("lib").join(name)
}

fn bin(name: &str) -> PathBuf {
    standins().join("bin").join(name)
}

fn command(program: &Path, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(program);
    for var in STANDIN_ENV {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    cmd
}

/// Kills and reaps its child on drop.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs a program to completion within `timeout` and parses its stdout as
/// one JSON object.
fn run_json(program: &Path, args: &[&str], env: &[(&str, &str)], timeout: Duration) -> Value {
    let mut child = ChildGuard(
        command(program, env)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display())),
    );
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "{} {args:?} did not finish within {timeout:?}",
            program.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(
        status.success(),
        "{} {args:?}: {status}\n{stdout}\n{stderr}",
        program.display()
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {stdout}"))
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing or not a u64 in {v}"))
}

fn i(v: &Value, key: &str) -> i64 {
    v[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} missing or not an i64 in {v}"))
}

fn s<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("{key} missing or not a string in {v}"))
}

// ---------------------------------------------------------------- exports

/// A defined dynamic function symbol of a library.
#[derive(Debug, Clone)]
struct Export {
    address: u64,
    weak: bool,
    /// `Some("libcudart.so.12")` for `name@@libcudart.so.12`.
    version: Option<String>,
}

struct Library {
    soname: String,
    exports: BTreeMap<String, Export>,
    /// Every defined dynamic symbol name, functions or not.
    all_defined: Vec<String>,
    data: Vec<u8>,
}

fn read_library(path: &Path) -> Library {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let elf = ElfFile64::<Endianness>::parse(&*data).expect("parse ELF");
    let endian = elf.endian();
    let sections = elf.elf_section_table();

    let (dyns, strtab) = sections
        .dynamic(endian, &*data)
        .unwrap()
        .expect("a dynamic section");
    let strings = sections.strings(endian, &*data, strtab).unwrap();
    let soname = dyns
        .iter()
        .find(|d| d.tag32(endian) == Some(object::elf::DT_SONAME))
        .map(|d| String::from_utf8(d.string(endian, strings).unwrap().to_vec()).unwrap())
        .expect("DT_SONAME");

    let versions = sections.versions(endian, &*data).unwrap();
    let mut exports = BTreeMap::new();
    let mut all_defined = Vec::new();
    for sym in elf.dynamic_symbols() {
        if sym.is_undefined() {
            continue;
        }
        let name = sym.name().unwrap().to_string();
        all_defined.push(name.clone());
        if sym.kind() != SymbolKind::Text {
            continue;
        }
        let version = versions.as_ref().and_then(|table| {
            let index = table.version_index(endian, sym.index());
            if index.is_hidden() {
                return None;
            }
            table
                .version(index)
                .unwrap()
                .map(|v| String::from_utf8_lossy(v.name()).into_owned())
        });
        exports.insert(
            name,
            Export {
                address: sym.address(),
                weak: sym.is_weak(),
                version,
            },
        );
    }
    Library {
        soname,
        exports,
        all_defined,
        data,
    }
}

impl Library {
    fn first_bytes(&self, symbol: &str, n: usize) -> Vec<u8> {
        let elf = ElfFile64::<Endianness>::parse(&*self.data).unwrap();
        let address = self.exports[symbol].address;
        let section = elf
            .sections()
            .find(|s| s.address() <= address && address < s.address() + s.size())
            .expect("section holding the symbol");
        let start = (address - section.address()) as usize;
        section.data().unwrap()[start..start + n].to_vec()
    }

    fn assert_exports(&self, what: &str, names: &[&str]) {
        for name in names {
            assert!(
                self.exports.contains_key(*name),
                "{what} does not export function {name}"
            );
        }
    }

    /// Only the public API and the documented internal hooks are exported.
    fn assert_only_prefixes(&self, what: &str, prefixes: &[&str]) {
        for name in &self.all_defined {
            assert!(
                prefixes.iter().any(|p| name.starts_with(p)),
                "{what} leaks symbol {name}"
            );
        }
    }
}

const CUDART_EXPORTS: &[&str] = &[
    "cudaGetDeviceCount",
    "cudaSetDevice",
    "cudaGetDevice",
    "cudaDeviceSynchronize",
    "cudaDriverGetVersion",
    "cudaRuntimeGetVersion",
    "cudaGetLastError",
    "cudaPeekAtLastError",
    "cudaGetErrorString",
    "cudaGetErrorName",
    "cudaMalloc",
    "cudaFree",
    "cudaMemGetInfo",
    "cudaMallocAsync",
    "cudaMallocAsync_ptsz",
    "cudaFreeAsync",
    "cudaFreeAsync_ptsz",
    "cudaMemcpy",
    "cudaMemcpy_ptds",
    "cudaMemcpyAsync",
    "cudaMemcpyAsync_ptsz",
    "cudaStreamCreate",
    "cudaStreamCreateWithFlags",
    "cudaStreamDestroy",
    "cudaStreamSynchronize",
    "cudaStreamSynchronize_ptsz",
    "cudaStreamQuery",
    "cudaStreamQuery_ptsz",
    "cudaStreamWaitEvent",
    "cudaStreamWaitEvent_ptsz",
    "cudaStreamGetId",
    "cudaLaunchHostFunc",
    "cudaLaunchHostFunc_ptsz",
    "cudaEventCreate",
    "cudaEventCreateWithFlags",
    "cudaEventRecord",
    "cudaEventRecord_ptsz",
    "cudaEventQuery",
    "cudaEventSynchronize",
    "cudaEventElapsedTime",
    "cudaEventDestroy",
    "cudaLaunchKernel",
    "cudaLaunchKernel_ptsz",
    "__cudaLaunchKernel",
    "__cudaLaunchKernel_ptsz",
    "__cudaRegisterFatBinary",
    "__cudaRegisterFatBinaryEnd",
    "__cudaUnregisterFatBinary",
    "__cudaRegisterFunction",
    "__standin_cuda_stream_enqueue",
];

const NCCL_FUNCTIONS: &[&str] = &[
    "GetVersion",
    "GetUniqueId",
    "CommInitRank",
    "CommInitAll",
    "CommDestroy",
    "CommAbort",
    "CommCount",
    "CommCuDevice",
    "CommUserRank",
    "CommGetAsyncError",
    "GetErrorString",
    "GetLastError",
    "AllReduce",
    "AllGather",
    "ReduceScatter",
    "Broadcast",
    "Reduce",
    "Send",
    "Recv",
    "GroupStart",
    "GroupEnd",
];

const CUPTI_EXPORTS: &[&str] = &[
    "cuptiActivityEnable",
    "cuptiActivityDisable",
    "cuptiActivityRegisterCallbacks",
    "cuptiActivityGetNextRecord",
    "cuptiActivityGetNumDroppedRecords",
    "cuptiActivityFlushAll",
    "cuptiActivityFlushPeriod",
    "cuptiGetTimestamp",
    "cuptiGetStreamId",
    "cuptiGetResultString",
    "__standin_cupti_record",
];

const ACL_EXPORTS: &[&str] = &[
    "aclInit",
    "aclFinalize",
    "aclrtSetDevice",
    "aclrtResetDevice",
    "aclrtGetDevice",
    "aclrtGetDeviceCount",
    "aclrtSynchronizeDevice",
    "aclrtCreateStream",
    "aclrtDestroyStream",
    "aclrtSynchronizeStream",
    "aclrtStreamWaitEvent",
    "aclrtStreamGetId",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtGetMemInfo",
    "aclrtMemcpy",
    "aclrtMemcpyAsync",
    "aclrtCreateEvent",
    "aclrtDestroyEvent",
    "aclrtRecordEvent",
    "aclrtSynchronizeEvent",
    "aclrtQueryEventStatus",
    "aclrtEventElapsedTime",
    "aclrtBinaryGetFunction",
    "aclrtLaunchKernel",
    "__standin_acl_stream_enqueue",
];

const HCCL_EXPORTS: &[&str] = &[
    "HcclGetRootInfo",
    "HcclCommInitRootInfo",
    "HcclCommDestroy",
    "HcclGetRankSize",
    "HcclGetRankId",
    "HcclGetCommName",
    "HcclGetErrorString",
    "HcclAllReduce",
    "HcclAllGather",
    "HcclBroadcast",
    "HcclReduceScatter",
    "HcclReduce",
    "HcclSend",
    "HcclRecv",
    "HcclBarrier",
    "HcclGroupStart",
    "HcclGroupEnd",
];

const MSPTI_EXPORTS: &[&str] = &[
    "msptiActivityRegisterCallbacks",
    "msptiActivityEnable",
    "msptiActivityDisable",
    "msptiActivityGetNextRecord",
    "msptiActivityFlushAll",
    "msptiActivityFlushPeriod",
    "mstxMarkA",
    "mstxRangeStartA",
    "mstxRangeEnd",
    "__standin_mspti_record",
];

#[test]
fn libraries_export_the_real_names_sonames_and_versions() {
    let cudart = read_library(&lib("libcudart.so.12"));
    assert_eq!(cudart.soname, "libcudart.so.12");
    cudart.assert_exports("libcudart", CUDART_EXPORTS);
    cudart.assert_only_prefixes(
        "libcudart",
        &["cuda", "__cuda", "__standin_cuda_", "libcudart"],
    );
    for name in CUDART_EXPORTS {
        let e = &cudart.exports[*name];
        assert_eq!(
            e.version.as_deref(),
            Some("libcudart.so.12"),
            "{name}@@libcudart.so.12"
        );
        assert!(!e.weak, "{name} is a strong symbol");
    }

    // The driver: every catalog function under its real (unversioned)
    // name, and the engine the runtime links (`sd_*`, see cudrv.h).
    let cuda = read_library(&lib("libcuda.so.1"));
    assert_eq!(cuda.soname, "libcuda.so.1");
    let driver: Vec<&str> = xpuscope_probes::catalog::Library::Cuda
        .functions()
        .iter()
        .map(|f| f.name)
        .collect();
    cuda.assert_exports("libcuda", &driver);
    cuda.assert_only_prefixes("libcuda", &["cu", "sd_"]);
    for name in &driver {
        assert_eq!(cuda.exports[*name].version, None, "{name} is unversioned");
    }

    // The CANN runtime: every required catalog function and the later
    // calls AscendCL and the simulator use, unversioned, and the engine
    // AscendCL links (`sd_*`, see rtdrv.h).
    let runtime = read_library(&lib("libruntime.so"));
    assert_eq!(runtime.soname, "libruntime.so");
    let mut rt: Vec<&str> = xpuscope_probes::catalog::Library::AscendRuntime
        .functions()
        .iter()
        .filter(|f| !f.optional)
        .map(|f| f.name)
        .collect();
    rt.extend([
        "rtKernelLaunchWithFlag",
        "rtLaunchKernelByFuncHandleV3",
        "rtsFuncGetByName",
        "rtSetDevice",
    ]);
    runtime.assert_exports("libruntime", &rt);
    runtime.assert_only_prefixes("libruntime", &["rt", "sd_"]);
    for name in &rt {
        assert_eq!(
            runtime.exports[*name].version, None,
            "{name} is unversioned"
        );
    }

    let nccl = read_library(&lib("libnccl.so.2"));
    assert_eq!(nccl.soname, "libnccl.so.2");
    for f in NCCL_FUNCTIONS {
        let (weak, strong) = (format!("nccl{f}"), format!("pnccl{f}"));
        let w = nccl
            .exports
            .get(&weak)
            .unwrap_or_else(|| panic!("libnccl lacks {weak}"));
        let p = nccl
            .exports
            .get(&strong)
            .unwrap_or_else(|| panic!("libnccl lacks {strong}"));
        assert_eq!(w.address, p.address, "{weak} and {strong} share an address");
        assert!(w.weak && !p.weak, "{weak} weak, {strong} strong");
    }
    nccl.assert_only_prefixes("libnccl", &["nccl", "pnccl"]);

    let cupti = read_library(&lib("libcupti.so.12"));
    assert_eq!(cupti.soname, "libcupti.so.12");
    cupti.assert_exports("libcupti", CUPTI_EXPORTS);
    cupti.assert_only_prefixes("libcupti", &["cupti", "__standin_cupti_", "libcupti"]);
    assert_eq!(
        cupti.exports["cuptiActivityGetNextRecord"]
            .version
            .as_deref(),
        Some("libcupti.so.12")
    );

    for (file, names, prefixes) in [
        (
            "libascendcl.so",
            ACL_EXPORTS,
            &["acl", "__standin_acl_"][..],
        ),
        ("libhccl.so", HCCL_EXPORTS, &["Hccl"][..]),
        (
            "libmspti.so",
            MSPTI_EXPORTS,
            &["mspti", "mstx", "__standin_mspti_"][..],
        ),
    ] {
        let l = read_library(&lib(file));
        assert_eq!(l.soname, file);
        l.assert_exports(file, names);
        l.assert_only_prefixes(file, prefixes);
    }

    // Development symlinks resolve to the versioned files.
    for (link, target) in [
        ("libcudart.so", "libcudart.so.12"),
        ("libnccl.so", "libnccl.so.2"),
        ("libcupti.so", "libcupti.so.12"),
    ] {
        assert_eq!(std::fs::read_link(lib(link)).unwrap(), Path::new(target));
    }
}

#[test]
fn cf_protection_build_starts_functions_with_endbr64() {
    const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
    let cf = read_library(&standins().join("lib-cfprot").join("libcudart.so.12"));
    assert_eq!(cf.soname, "libcudart.so.12");
    cf.assert_exports("cf-protection libcudart", CUDART_EXPORTS);
    for name in [
        "cudaLaunchKernel",
        "cudaStreamSynchronize",
        "cudaMemcpyAsync",
    ] {
        assert_eq!(
            cf.first_bytes(name, 4),
            ENDBR64,
            "{name} starts with endbr64"
        );
    }
    let plain = read_library(&lib("libcudart.so.12"));
    assert_ne!(
        plain.first_bytes("cudaLaunchKernel", 4),
        ENDBR64,
        "plain build has no endbr64"
    );
}

// ---------------------------------------------------------------- layouts

#[test]
fn record_layouts_match_the_documented_offsets() {
    let layout = run_json(&bin("record_layout"), &[], &[], Duration::from_secs(10));
    let expected: &[(&str, &[(&str, u64)])] = &[
        (
            "msptiActivityKernel",
            &[
                ("size", 56),
                ("kind", 0),
                ("start", 4),
                ("end", 12),
                ("deviceId", 20),
                ("streamId", 24),
                ("correlationId", 28),
                ("type", 36),
                ("name", 44),
            ],
        ),
        (
            "msptiActivityHccl",
            &[
                ("size", 56),
                ("kind", 0),
                ("start", 4),
                ("end", 12),
                ("deviceId", 20),
                ("streamId", 24),
                ("bandWidth", 28),
                ("name", 36),
                ("commName", 44),
            ],
        ),
        (
            "msptiActivityCommunication",
            &[
                ("size", 72),
                ("kind", 0),
                ("dataType", 4),
                ("count", 8),
                ("deviceId", 16),
                ("streamId", 20),
                ("start", 24),
                ("end", 32),
                ("algType", 40),
                ("name", 48),
                ("commName", 56),
                ("correlationId", 64),
            ],
        ),
        (
            "msptiActivityMarker",
            &[
                ("size", 56),
                ("kind", 0),
                ("flag", 4),
                ("sourceKind", 8),
                ("timestamp", 12),
                ("id", 20),
                ("objectId", 28),
                ("name", 36),
                ("domain", 44),
            ],
        ),
        (
            "msptiActivityApi",
            &[
                ("size", 48),
                ("kind", 0),
                ("start", 4),
                ("end", 12),
                ("processId", 20),
                ("threadId", 24),
                ("correlationId", 28),
                ("name", 36),
            ],
        ),
        (
            // CUDA 12.9 (CUPTI_API_VERSION 28) CUpti_ActivityKernel9.
            "CUpti_ActivityKernel9",
            &[
                ("size", 208),
                ("kind", 0),
                ("start", 16),
                ("end", 24),
                ("completed", 32),
                ("deviceId", 40),
                ("contextId", 44),
                ("streamId", 48),
                ("gridX", 52),
                ("blockX", 64),
                ("dynamicSharedMemory", 80),
                ("correlationId", 92),
                ("gridId", 96),
                ("name", 104),
                ("queued", 120),
                ("submitted", 128),
                ("graphNodeId", 144),
                ("channelType", 172),
                ("maxActiveClusters", 204),
            ],
        ),
        (
            "CUpti_ActivityMemcpy6",
            &[
                ("size", 96),
                ("kind", 0),
                ("copyKind", 4),
                ("bytes", 8),
                ("start", 16),
                ("end", 24),
                ("deviceId", 32),
                ("streamId", 40),
                ("correlationId", 44),
                ("copyCount", 88),
            ],
        ),
        (
            "CUpti_ActivityAPI",
            &[
                ("size", 40),
                ("kind", 0),
                ("cbid", 4),
                ("start", 8),
                ("end", 16),
                ("processId", 24),
                ("threadId", 28),
                ("correlationId", 32),
                ("returnValue", 36),
            ],
        ),
    ];
    for (record, fields) in expected {
        let got = &layout[*record];
        assert!(got.is_object(), "record_layout lacks {record}: {layout}");
        for (field, offset) in *fields {
            assert_eq!(u(got, field), *offset, "{record}.{field}");
        }
    }
}

// ---------------------------------------------------------------- CUDA runtime

#[test]
fn kernels_take_their_encoded_time_in_stream_order() {
    let v = run_json(
        &bin("cuda_probe"),
        &["kernel"],
        &[],
        Duration::from_secs(10),
    );
    // Three 50 ms kernels: launching is asynchronous, the sync waits them out.
    assert!(u(&v, "launch_ns") < 40 * MS, "launches return at once: {v}");
    assert!(
        u(&v, "total_ns") >= 150 * MS,
        "kernels run back to back: {v}"
    );
    assert!(
        u(&v, "sync_wait_ns") >= 100 * MS,
        "cudaStreamSynchronize blocks: {v}"
    );
    assert_eq!(i(&v, "query_busy"), 600, "cudaErrorNotReady while busy");
    assert_eq!(i(&v, "query_idle"), 0);
    // Two streams of 60 ms each overlap: a device sync waits ~60 ms, not 120.
    let parallel = u(&v, "parallel_ns");
    assert!(
        (60 * MS..115 * MS).contains(&parallel),
        "streams run concurrently: {v}"
    );
    // Per-thread default stream (spin mode) and legacy stream + cudaMemcpy.
    assert_eq!(i(&v, "ptsz_rc"), 0);
    assert!(u(&v, "ptsz_ns") >= 20 * MS, "{v}");
    assert_eq!(i(&v, "legacy_rc"), 0);
    assert_eq!(i(&v, "memcpy_rc"), 0);
    assert!(
        u(&v, "legacy_ns") >= 30 * MS,
        "cudaMemcpy waits for the stream: {v}"
    );
    assert_eq!(
        i(&v, "bad_stream_rc"),
        400,
        "cudaErrorInvalidResourceHandle"
    );
    assert_eq!(i(&v, "destroy_rc"), 0);
}

#[test]
fn device_memory_has_a_capacity() {
    let v = run_json(
        &bin("cuda_probe"),
        &["memory"],
        &[("STANDIN_DEVICE_MEM_BYTES", "1073741824")],
        Duration::from_secs(10),
    );
    assert_eq!(i(&v, "alloc_rc"), 0);
    assert_eq!(v["ptr_nonnull"], Value::Bool(true));
    assert_eq!(
        i(&v, "over_rc"),
        2,
        "cudaErrorMemoryAllocation beyond capacity"
    );
    assert_eq!(i(&v, "last_error"), 2);
    assert_eq!(i(&v, "last_error_after"), 0, "cudaGetLastError resets");
    assert_eq!(i(&v, "free_rc"), 0);
    assert_eq!(i(&v, "realloc_rc"), 0, "cudaFree gives the capacity back");
    assert_eq!(i(&v, "bogus_free_rc"), 1, "cudaErrorInvalidValue");
    assert_eq!(i(&v, "set_bad_rc"), 101, "cudaErrorInvalidDevice");
    assert_eq!(i(&v, "set1_rc"), 0);
    assert_eq!(i(&v, "other_device_rc"), 0, "capacity is per device");
    assert_eq!(i(&v, "async_rc"), 0);
    assert_eq!(i(&v, "async_over_rc"), 2);
    assert_eq!(i(&v, "free_async_rc"), 0);
    assert_eq!(u(&v, "total"), 1 << 30);
    assert_eq!(u(&v, "free_before"), (1 << 30) - (600 << 20));
    assert_eq!(
        u(&v, "free_after"),
        u(&v, "free_before"),
        "cudaFreeAsync ran on the stream"
    );
    assert_eq!(s(&v, "error_string"), "out of memory");
    assert_eq!(s(&v, "error_name"), "cudaErrorMemoryAllocation");
}

#[test]
fn events_time_the_work_between_them() {
    let v = run_json(
        &bin("cuda_probe"),
        &["events"],
        &[],
        Duration::from_secs(10),
    );
    assert_eq!(i(&v, "query_busy"), 600);
    assert_eq!(i(&v, "elapsed_busy"), 600);
    assert_eq!(i(&v, "sync_rc"), 0);
    assert!(
        u(&v, "sync_wait_ns") >= 60 * MS,
        "cudaEventSynchronize blocks: {v}"
    );
    assert_eq!(i(&v, "query_done"), 0);
    assert_eq!(i(&v, "elapsed_rc"), 0);
    let ms = v["elapsed_ms"].as_f64().unwrap();
    assert!(
        (79.0..300.0).contains(&ms),
        "80 ms kernel between the events: {v}"
    );
    assert_eq!(
        i(&v, "never_rc"),
        400,
        "elapsed time of an unrecorded event"
    );
    assert!(
        u(&v, "wait_chain_ns") >= 65 * MS,
        "cudaStreamWaitEvent orders streams: {v}"
    );
    assert_eq!(i(&v, "destroy_rc"), 0);
}

#[test]
fn cupti_delivers_kernel_memcpy_and_runtime_records() {
    let v = run_json(&bin("cuda_probe"), &["cupti"], &[], Duration::from_secs(10));
    let records = v["records"].as_array().unwrap();
    let (t0, t1) = (u(&v, "t0"), u(&v, "t1"));
    let stream = u(&v, "stream_id");
    assert_eq!(
        u(&v, "cupti_stream_id"),
        stream,
        "cuptiGetStreamId == cudaStreamGetId"
    );
    assert_eq!(u(&v, "dropped"), 0);
    assert!(
        u(&v, "buffers") >= 2,
        "1 KiB buffers fill and are handed back: {v}"
    );

    let runtime: HashMap<u64, &Value> = records
        .iter()
        .filter(|r| u(r, "kind") == 5)
        .map(|r| (u(r, "correlation"), r))
        .collect();
    let kernels: Vec<&Value> = records.iter().filter(|r| u(r, "kind") == 10).collect();
    assert_eq!(
        kernels.len(),
        6,
        "one CONCURRENT_KERNEL record per launch: {v}"
    );
    let mut previous_end = 0;
    for (n, k) in kernels.iter().enumerate() {
        let (name, duration) = if n % 2 == 0 {
            ("sgemm_128x64_nn", 20 * MS)
        } else {
            ("probe_relu_kernel", 10 * MS)
        };
        assert_eq!(s(k, "name"), name, "registered / dladdr names");
        let (start, end) = (u(k, "start"), u(k, "end"));
        assert!(
            end - start >= duration,
            "device time covers the encoded duration: {k}"
        );
        assert!(
            t0 <= start && end <= t1,
            "CLOCK_BOOTTIME, inside the run: {k}"
        );
        assert!(start >= previous_end, "in stream order: {k}");
        previous_end = end;
        assert_eq!(u(k, "stream"), stream);
        assert_eq!(u(k, "device"), 0);
        assert_eq!((u(k, "grid_x"), u(k, "block_x")), (4, 128));
        let api = runtime
            .get(&u(k, "correlation"))
            .unwrap_or_else(|| panic!("no RUNTIME record for {k}"));
        assert_eq!(u(api, "cbid"), 211, "cudaLaunchKernel_v7000");
        assert!(u(api, "start") <= u(k, "queued") && u(k, "queued") <= start);
    }
    let copies: Vec<&Value> = records.iter().filter(|r| u(r, "kind") == 1).collect();
    assert_eq!(copies.len(), 1, "{v}");
    assert_eq!(u(copies[0], "bytes"), 1 << 20);
    assert_eq!(
        u(copies[0], "copy_kind"),
        1,
        "CUPTI_ACTIVITY_MEMCPY_KIND_HTOD"
    );
    assert!(
        u(copies[0], "start") >= previous_end,
        "after the kernels on the stream"
    );
    assert_eq!(
        u(runtime[&u(copies[0], "correlation")], "cbid"),
        41,
        "cudaMemcpyAsync_v3020"
    );
    let sync = runtime
        .values()
        .find(|r| u(r, "cbid") == 131)
        .expect("a sync record");
    assert!(
        u(sync, "end") >= u(copies[0], "end"),
        "the sync returned after the work"
    );
}

// ---------------------------------------------------------------- collectives

/// One rank's command line: operation, delay before it, extra environment.
struct Rank {
    op: &'static str,
    delay_ms: u64,
    env: Vec<(&'static str, &'static str)>,
}

impl Rank {
    fn op(op: &'static str) -> Self {
        Rank {
            op,
            delay_ms: 0,
            env: Vec::new(),
        }
    }
}

static JOB_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// The processes of one multi-rank job, killed on drop; their stdout lines
/// arrive on one channel as (rank, line).
struct Job {
    ranks: Vec<ChildGuard>,
    lines: Receiver<(usize, String)>,
    seen: Vec<(usize, String)>,
    dir: PathBuf,
}

impl Job {
    fn spawn(program: &str, ranks: Vec<Rank>) -> Job {
        let dir = std::env::temp_dir().join(format!(
            "xpuscope-standins-{}-{}",
            std::process::id(),
            JOB_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let id_file = dir.join("unique-id");
        let (tx, rx) = mpsc::channel();
        let n = ranks.len();
        let mut children = Vec::new();
        for (rank, spec) in ranks.into_iter().enumerate() {
            let mut child = ChildGuard(
                command(&bin(program), &spec.env)
                    .arg(n.to_string())
                    .arg(rank.to_string())
                    .arg(&id_file)
                    .arg(spec.op)
                    .arg(spec.delay_ms.to_string())
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap_or_else(|e| panic!("spawn {program}: {e}")),
            );
            let stdout = child.0.stdout.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send((rank, line)).is_err() {
                        break;
                    }
                }
            });
            children.push(child);
        }
        Job {
            ranks: children,
            lines: rx,
            seen: Vec::new(),
            dir,
        }
    }

    /// Waits until each rank in `ranks` printed a line starting with `tag`;
    /// returns the JSON after the tag (Null when none), by rank.
    fn expect(&mut self, tag: &str, ranks: &[usize], timeout: Duration) -> HashMap<usize, Value> {
        let deadline = Instant::now() + timeout;
        let mut got = HashMap::new();
        let matches = |line: &str| line == tag || line.starts_with(&format!("{tag} "));
        for (rank, line) in &self.seen {
            if ranks.contains(rank) && matches(line) {
                got.insert(*rank, parse_tail(line, tag));
            }
        }
        while got.len() < ranks.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((rank, line)) => {
                    if ranks.contains(&rank) && matches(&line) {
                        got.insert(rank, parse_tail(&line, tag));
                    }
                    self.seen.push((rank, line));
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => panic!(
                    "ranks {ranks:?} did not all print {tag:?} within {timeout:?}; output: {:?}",
                    self.seen
                ),
            }
        }
        got
    }

    /// Asserts that no rank prints a line starting with `tag` for `period`.
    fn expect_silence(&mut self, tag: &str, period: Duration) {
        let deadline = Instant::now() + period;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            match self.lines.recv_timeout(left) {
                Ok((rank, line)) => {
                    assert!(
                        !line.starts_with(tag),
                        "rank {rank} printed {line:?} but should hang"
                    );
                    self.seen.push((rank, line));
                }
                Err(RecvTimeoutError::Timeout) => return,
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("every rank exited; output: {:?}", self.seen)
                }
            }
        }
    }

    fn all(&self) -> Vec<usize> {
        (0..self.ranks.len()).collect()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.ranks.clear(); // kills every rank
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn parse_tail(line: &str, tag: &str) -> Value {
    let tail = line[tag.len()..].trim();
    if tail.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(tail).unwrap_or_else(|e| panic!("bad JSON ({e}) in {line:?}"))
    }
}

const RANK_TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn nccl_all_reduce_completes_on_two_ranks() {
    let mut job = Job::spawn(
        "nccl_rank",
        vec![Rank::op("allreduce"), Rank::op("allreduce")],
    );
    let ready = job.expect("ready", &job.all(), RANK_TIMEOUT);
    for (rank, r) in &ready {
        assert_eq!(u(r, "count"), 2);
        assert_eq!(u(r, "user_rank"), *rank as u64);
        assert_eq!(u(r, "version"), 22105);
        assert_eq!(
            i(r, "null_comm_rc"),
            4,
            "ncclAllReduce(comm = NULL) is ncclInvalidArgument"
        );
        assert_eq!(i(r, "bad_type_rc"), 4);
    }
    let done = job.expect("done", &job.all(), RANK_TIMEOUT);
    for d in done.values() {
        assert_eq!(i(d, "async_error"), 0);
    }
}

#[test]
fn nccl_every_operation_completes_on_four_ranks() {
    let mut job = Job::spawn("nccl_rank", (0..4).map(|_| Rank::op("all")).collect());
    job.expect("ready", &job.all(), RANK_TIMEOUT);
    job.expect("done", &job.all(), RANK_TIMEOUT);
}

#[test]
fn nccl_send_recv_pair_up() {
    let mut ring = Job::spawn("nccl_rank", (0..3).map(|_| Rank::op("sendrecv")).collect());
    let mut pairs = Job::spawn("nccl_rank", (0..4).map(|_| Rank::op("pingpong")).collect());
    ring.expect("done", &ring.all(), RANK_TIMEOUT);
    pairs.expect("done", &pairs.all(), RANK_TIMEOUT);
}

#[test]
fn nccl_missing_rank_hangs_the_others() {
    let ranks = vec![
        Rank::op("allreduce"),
        Rank::op("allreduce"),
        Rank::op("skip"),
    ];
    let mut job = Job::spawn("nccl_rank", ranks);
    job.expect("ready", &job.all(), RANK_TIMEOUT);
    job.expect("enqueued", &[0, 1], RANK_TIMEOUT);
    job.expect_silence("done", Duration::from_millis(800));
}

#[test]
fn nccl_injected_hang_blocks_every_rank() {
    let mut hung = Rank::op("allreduce");
    hung.env.push(("STANDIN_NCCL_HANG_AT_SEQ", "0"));
    let mut job = Job::spawn("nccl_rank", vec![hung, Rank::op("allreduce")]);
    job.expect("enqueued", &job.all(), RANK_TIMEOUT);
    job.expect_silence("done", Duration::from_millis(800));
}

fn assert_late_rank_delays_the_others(program: &str) {
    let late = Rank {
        op: "allreduce",
        delay_ms: 300,
        env: Vec::new(),
    };
    let mut job = Job::spawn(
        program,
        vec![Rank::op("allreduce"), late, Rank::op("allreduce")],
    );
    job.expect("ready", &job.all(), RANK_TIMEOUT);
    let done = job.expect("done", &job.all(), RANK_TIMEOUT);
    for rank in [0, 2] {
        let wait = u(&done[&rank], "wait_ns");
        assert!(
            (250 * MS..1000 * MS).contains(&wait),
            "rank {rank} waits for the late rank: {done:?}"
        );
    }
    assert!(
        u(&done[&1], "wait_ns") < 200 * MS,
        "the late rank does not wait: {done:?}"
    );
    let ends: Vec<u64> = (0..3).map(|r| u(&done[&r], "done_ns")).collect();
    let spread = ends.iter().max().unwrap() - ends.iter().min().unwrap();
    assert!(spread < 150 * MS, "every rank completes together: {done:?}");
}

#[test]
fn nccl_late_rank_delays_the_others() {
    assert_late_rank_delays_the_others("nccl_rank");
}

// ---------------------------------------------------------------- Ascend

#[test]
fn hccl_every_operation_completes_on_two_ranks() {
    let mut job = Job::spawn("hccl_rank", vec![Rank::op("all"), Rank::op("all")]);
    let ready = job.expect("ready", &job.all(), RANK_TIMEOUT);
    assert_eq!(s(&ready[&0], "comm_name"), s(&ready[&1], "comm_name"));
    for (rank, r) in &ready {
        assert_eq!(u(r, "count"), 2);
        assert_eq!(u(r, "user_rank"), *rank as u64);
        assert_eq!(i(r, "null_comm_rc"), 2, "HCCL_E_PTR");
    }
    job.expect("done", &job.all(), RANK_TIMEOUT);
}

#[test]
fn hccl_late_rank_delays_the_others() {
    assert_late_rank_delays_the_others("hccl_rank");
}

#[test]
fn hccl_missing_rank_hangs_the_others() {
    let mut job = Job::spawn("hccl_rank", vec![Rank::op("sendrecv"), Rank::op("skip")]);
    job.expect("enqueued", &[0], RANK_TIMEOUT);
    job.expect_silence("done", Duration::from_millis(800));
}

#[test]
fn mspti_delivers_packed_records_of_every_kind() {
    let v = run_json(
        &bin("mspti_probe"),
        &[],
        &[("STANDIN_DEVICE_MEM_BYTES", "1073741824")],
        Duration::from_secs(10),
    );
    assert_eq!(i(&v, "alloc_rc"), 0);
    assert_eq!(i(&v, "over_rc"), 207_001, "ACL_ERROR_RT_MEMORY_ALLOCATION");
    assert_eq!(i(&v, "free_rc"), 0);
    assert_eq!(i(&v, "realloc_rc"), 0);
    assert_eq!(i(&v, "copy_rc"), 0);
    assert_eq!(
        i(&v, "copy_over_rc"),
        100_000,
        "count > destMax is ACL_ERROR_INVALID_PARAM"
    );
    assert_eq!(
        i(&v, "bad_device_rc"),
        107_001,
        "ACL_ERROR_RT_INVALID_DEVICEID"
    );
    assert_eq!(s(&v, "hccl_error"), "parameter error");
    assert!(
        u(&v, "buffers") >= 2,
        "512-byte buffers fill and are handed back: {v}"
    );

    let records = v["records"].as_array().unwrap();
    let of_kind = |k: u64| records.iter().filter(move |r| u(r, "kind") == k);
    let stream = u(&v, "stream_id");
    let api: HashMap<u64, &Value> = of_kind(3).map(|r| (u(r, "correlation"), r)).collect();
    for r in api.values() {
        assert!(
            u(r, "start") <= u(r, "end") && u(r, "pid") > 0 && u(r, "tid") > 0,
            "{r}"
        );
        assert!(s(r, "name").starts_with("acl"), "{r}");
    }

    let kernels: Vec<&Value> = of_kind(2).collect();
    assert_eq!(kernels.len(), 2, "{v}");
    for k in &kernels {
        assert_eq!(s(k, "name"), "add_custom");
        assert_eq!(s(k, "type"), "KERNEL_AICORE");
        assert_eq!((u(k, "device"), u(k, "stream")), (1, stream));
        assert!(u(k, "end") - u(k, "start") >= 20 * MS, "{k}");
        assert_eq!(s(api[&u(k, "correlation")], "name"), "aclrtLaunchKernel");
    }
    assert!(
        u(kernels[1], "start") >= u(kernels[0], "end"),
        "stream order"
    );

    let hccl: Vec<&Value> = of_kind(4).collect();
    assert_eq!(hccl.len(), 1, "{v}");
    assert_eq!(s(hccl[0], "name"), "HcclAllReduce");
    assert!(s(hccl[0], "comm_name").starts_with("standin-hccl-"));
    assert_eq!((u(hccl[0], "device"), u(hccl[0], "stream")), (1, stream));
    assert!(
        u(hccl[0], "start") >= u(kernels[1], "end"),
        "after the kernels on the stream"
    );

    let comm: Vec<&Value> = of_kind(9).collect();
    assert_eq!(comm.len(), 1, "{v}");
    assert_eq!(u(comm[0], "data_type"), 4, "HCCL_DATA_TYPE_FP32");
    assert_eq!(u(comm[0], "count"), 1 << 20);
    assert_eq!(s(comm[0], "alg_type"), "RING");
    assert_eq!(s(comm[0], "comm_name"), s(hccl[0], "comm_name"));
    assert_eq!(
        (u(comm[0], "start"), u(comm[0], "end")),
        (u(hccl[0], "start"), u(hccl[0], "end"))
    );
    assert!(u(comm[0], "correlation") > 0);

    let markers: Vec<(u64, &str, u64)> = of_kind(1)
        .map(|m| (u(m, "flag"), s(m, "name"), u(m, "id")))
        .collect();
    assert_eq!(
        markers,
        vec![(1, "step_begin", 1), (2, "forward", 2), (4, "forward", 2)],
        "instantaneous, range start, range end"
    );
    for m in of_kind(1) {
        assert_eq!(u(m, "source_kind"), 0, "host markers");
        assert_eq!(s(m, "domain"), "default");
        assert!(u(m, "pid") > 0 && u(m, "timestamp") > 0);
    }
}
