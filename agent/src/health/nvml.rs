//! The host's NVML (`libnvidia-ml.so.1`), loaded at run time: the dozen
//! calls the GPU-health sampler makes, each behind a safe method that
//! bounds what the library hands back (a counted array is read no further
//! than the buffer given, text no further than its NUL or its buffer, a
//! count past [`MAX_GPUS`] is cut).
//!
//! Why `libloading` and not the `nvml-wrapper` crate: its bindings are
//! generated from NVML 11's header, without the 12.x names preferred here
//! (`nvmlDeviceGetCurrentClocksEventReasons`, falling back to the older
//! `...ClocksThrottleReasons`), and they bring the whole API with them; the
//! agent needs a page of declarations, each optional but `nvmlInit_v2` and
//! the device enumeration, so a library that lacks one (an older driver, a
//! test's stand-in) still gives what it has.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::path::Path;

use libloading::Library;

/// GPUs read at most (an NVSwitch system has 16; a count past this is a
/// broken library).
pub const MAX_GPUS: u32 = 64;
/// Processes read per GPU at most.
pub const MAX_PROCESSES: usize = 256;
/// Events of other types skipped per [`Nvml::next_xid`] at most.
const MAX_SKIPPED_EVENTS: usize = 64;

/// `nvmlReturn_t` values the agent tells apart.
const NVML_SUCCESS: c_int = 0;
const NVML_ERROR_INSUFFICIENT_SIZE: c_int = 7;
const NVML_ERROR_TIMEOUT: c_int = 10;
/// `NVML_CLOCK_SM`.
const CLOCK_SM: c_int = 1;
/// `NVML_MEMORY_ERROR_TYPE_UNCORRECTED`, `NVML_VOLATILE_ECC`.
const ECC_UNCORRECTED: c_int = 1;
const ECC_VOLATILE: c_int = 0;
/// `nvmlEventTypeXidCriticalError`.
pub const EVENT_XID: u64 = 0x8;
/// Longest name or UUID read (NVML's v2 buffer sizes are 96 and 80).
const TEXT_BUFFER: usize = 96;

type Device = *mut c_void;
type EventSet = *mut c_void;

/// `nvmlProcessInfo_v2_t` (what `_v3` and `_v2` fill).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// `nvmlEventData_t`.
#[repr(C)]
struct EventData {
    device: Device,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Default)]
struct Memory {
    total: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Default)]
struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

type Status = c_int;

/// The entry points, each looked up by its real name.
struct Calls {
    init: unsafe extern "C" fn() -> Status,
    shutdown: Option<unsafe extern "C" fn() -> Status>,
    count: unsafe extern "C" fn(*mut c_uint) -> Status,
    handle: unsafe extern "C" fn(c_uint, *mut Device) -> Status,
    name: Option<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> Status>,
    uuid: Option<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> Status>,
    clock: Option<unsafe extern "C" fn(Device, c_int, *mut c_uint) -> Status>,
    max_clock: Option<unsafe extern "C" fn(Device, c_int, *mut c_uint) -> Status>,
    reasons: Option<unsafe extern "C" fn(Device, *mut c_ulonglong) -> Status>,
    utilization: Option<unsafe extern "C" fn(Device, *mut Utilization) -> Status>,
    memory: Option<unsafe extern "C" fn(Device, *mut Memory) -> Status>,
    ecc: Option<unsafe extern "C" fn(Device, c_int, c_int, *mut c_ulonglong) -> Status>,
    processes: Option<unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfo) -> Status>,
    event_set_create: Option<unsafe extern "C" fn(*mut EventSet) -> Status>,
    register_events: Option<unsafe extern "C" fn(Device, c_ulonglong, EventSet) -> Status>,
    event_wait: Option<unsafe extern "C" fn(EventSet, *mut EventData, c_uint) -> Status>,
    event_set_free: Option<unsafe extern "C" fn(EventSet) -> Status>,
}

/// Why NVML gives nothing.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("{path} could not be loaded: {source}")]
    Load {
        path: String,
        #[source]
        source: libloading::Error,
    },
    #[error("{path} has no {symbol}")]
    Missing { path: String, symbol: &'static str },
    #[error("{call} failed with NVML status {status}")]
    Call { call: &'static str, status: i32 },
}

/// An initialized NVML and its GPUs' handles. Not `Send` (the handles are
/// the library's pointers): it lives on the sampler's thread.
pub struct Nvml {
    calls: Calls,
    devices: Vec<Device>,
    events: Option<EventSet>,
    /// Kept loaded while the function pointers above are in use.
    _library: Library,
}

/// Looks `name` up; `None` when the library lacks it.
///
/// # Safety
/// `T` must be the C signature of `name` in nvml.h.
unsafe fn optional<T: Copy>(lib: &Library, name: &[u8]) -> Option<T> {
    // SAFETY: the caller names the symbol's real signature.
    unsafe { lib.get::<T>(name).ok().map(|s| *s) }
}

/// A reading's status as an `Option`.
fn ok(status: Status) -> Option<()> {
    (status == NVML_SUCCESS).then_some(())
}

/// Text NVML wrote into `buf`: up to its first NUL, never past the buffer.
fn text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

impl Nvml {
    /// Loads the library at `path` (a file name is searched as `dlopen`
    /// does), initializes it and enumerates its GPUs.
    pub fn open(path: &Path) -> Result<Self, NvmlError> {
        let shown = path.display().to_string();
        // SAFETY: loading runs the library's initializers; NVML's (or a
        // stand-in's) are what every NVML user runs.
        let library = unsafe { Library::new(path) }.map_err(|source| NvmlError::Load {
            path: shown.clone(),
            source,
        })?;
        let missing = |symbol| NvmlError::Missing {
            path: shown.clone(),
            symbol,
        };
        // SAFETY (every lookup): each type is the function's prototype in
        // nvml.h (12.x).
        let calls = unsafe {
            Calls {
                init: optional(&library, b"nvmlInit_v2\0").ok_or_else(|| missing("nvmlInit_v2"))?,
                shutdown: optional(&library, b"nvmlShutdown\0"),
                count: optional(&library, b"nvmlDeviceGetCount_v2\0")
                    .ok_or_else(|| missing("nvmlDeviceGetCount_v2"))?,
                handle: optional(&library, b"nvmlDeviceGetHandleByIndex_v2\0")
                    .ok_or_else(|| missing("nvmlDeviceGetHandleByIndex_v2"))?,
                name: optional(&library, b"nvmlDeviceGetName\0"),
                uuid: optional(&library, b"nvmlDeviceGetUUID\0"),
                clock: optional(&library, b"nvmlDeviceGetClockInfo\0"),
                max_clock: optional(&library, b"nvmlDeviceGetMaxClockInfo\0"),
                reasons: optional(&library, b"nvmlDeviceGetCurrentClocksEventReasons\0")
                    .or_else(|| optional(&library, b"nvmlDeviceGetCurrentClocksThrottleReasons\0")),
                utilization: optional(&library, b"nvmlDeviceGetUtilizationRates\0"),
                memory: optional(&library, b"nvmlDeviceGetMemoryInfo\0"),
                ecc: optional(&library, b"nvmlDeviceGetTotalEccErrors\0"),
                processes: optional(&library, b"nvmlDeviceGetComputeRunningProcesses_v3\0")
                    .or_else(|| optional(&library, b"nvmlDeviceGetComputeRunningProcesses_v2\0")),
                event_set_create: optional(&library, b"nvmlEventSetCreate\0"),
                register_events: optional(&library, b"nvmlDeviceRegisterEvents\0"),
                event_wait: optional(&library, b"nvmlEventSetWait_v2\0"),
                event_set_free: optional(&library, b"nvmlEventSetFree\0"),
            }
        };
        // SAFETY: a call without arguments.
        let status = unsafe { (calls.init)() };
        ok(status).ok_or(NvmlError::Call {
            call: "nvmlInit_v2",
            status,
        })?;
        let mut nvml = Nvml {
            calls,
            devices: Vec::new(),
            events: None,
            _library: library,
        };
        let mut count: c_uint = 0;
        // SAFETY: `count` is a valid out-pointer.
        let status = unsafe { (nvml.calls.count)(&mut count) };
        ok(status).ok_or(NvmlError::Call {
            call: "nvmlDeviceGetCount_v2",
            status,
        })?;
        for index in 0..count.min(MAX_GPUS) {
            let mut device: Device = std::ptr::null_mut();
            // SAFETY: `device` is a valid out-pointer.
            let status = unsafe { (nvml.calls.handle)(index, &mut device) };
            if status != NVML_SUCCESS || device.is_null() {
                break;
            }
            nvml.devices.push(device);
        }
        nvml.events = nvml.register_xid_events();
        Ok(nvml)
    }

    /// GPUs found (index = NVML's index).
    pub fn gpus(&self) -> u32 {
        self.devices.len() as u32
    }

    /// An event set with every GPU registered for Xid errors; `None` when
    /// the library has no event API or refuses (a GPU without Xid events
    /// is left out, the others stay).
    fn register_xid_events(&self) -> Option<EventSet> {
        let (create, register) = (self.calls.event_set_create?, self.calls.register_events?);
        self.calls.event_wait?;
        let mut set: EventSet = std::ptr::null_mut();
        // SAFETY: `set` is a valid out-pointer.
        ok(unsafe { create(&mut set) })?;
        if set.is_null() {
            return None;
        }
        let mut any = false;
        for &d in &self.devices {
            // SAFETY: `d` and `set` are the library's own handles.
            any |= unsafe { register(d, EVENT_XID, set) } == NVML_SUCCESS;
        }
        if !any {
            if let Some(free) = self.calls.event_set_free {
                // SAFETY: the set made above, used nowhere else.
                unsafe { free(set) };
            }
            return None;
        }
        Some(set)
    }

    fn device(&self, gpu: u32) -> Option<Device> {
        self.devices.get(gpu as usize).copied()
    }

    fn read_text(
        &self,
        gpu: u32,
        call: Option<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> Status>,
    ) -> Option<String> {
        let (d, call) = (self.device(gpu)?, call?);
        let mut buf = [0u8; TEXT_BUFFER];
        // SAFETY: the buffer's length is what the library is told.
        ok(unsafe { call(d, buf.as_mut_ptr().cast(), buf.len() as c_uint) })?;
        Some(text(&buf))
    }

    pub fn name(&self, gpu: u32) -> Option<String> {
        self.read_text(gpu, self.calls.name)
    }

    pub fn uuid(&self, gpu: u32) -> Option<String> {
        self.read_text(gpu, self.calls.uuid)
    }

    /// The SM clock now, MHz.
    pub fn sm_clock_mhz(&self, gpu: u32) -> Option<u32> {
        self.sm_clock(gpu, self.calls.clock)
    }

    /// The SM clock's highest, MHz.
    pub fn max_sm_clock_mhz(&self, gpu: u32) -> Option<u32> {
        self.sm_clock(gpu, self.calls.max_clock)
    }

    fn sm_clock(
        &self,
        gpu: u32,
        call: Option<unsafe extern "C" fn(Device, c_int, *mut c_uint) -> Status>,
    ) -> Option<u32> {
        let (d, call) = (self.device(gpu)?, call?);
        let mut mhz: c_uint = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { call(d, CLOCK_SM, &mut mhz) })?;
        Some(mhz)
    }

    /// The clock-event (throttle) reason bits now.
    pub fn clock_event_reasons(&self, gpu: u32) -> Option<u64> {
        let (d, call) = (self.device(gpu)?, self.calls.reasons?);
        let mut bits: c_ulonglong = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { call(d, &mut bits) })?;
        Some(bits)
    }

    /// Percent of the last sample period a kernel ran.
    pub fn utilization_pct(&self, gpu: u32) -> Option<u32> {
        let (d, call) = (self.device(gpu)?, self.calls.utilization?);
        let mut u = Utilization::default();
        // SAFETY: a valid out-pointer to the struct nvml.h declares.
        ok(unsafe { call(d, &mut u) })?;
        Some(u.gpu)
    }

    /// (used, total) bytes.
    pub fn memory(&self, gpu: u32) -> Option<(u64, u64)> {
        let (d, call) = (self.device(gpu)?, self.calls.memory?);
        let mut m = Memory::default();
        // SAFETY: a valid out-pointer to the struct nvml.h declares.
        ok(unsafe { call(d, &mut m) })?;
        Some((m.used, m.total))
    }

    /// Uncorrected ECC errors since the driver loaded.
    pub fn ecc_uncorrected(&self, gpu: u32) -> Option<u64> {
        let (d, call) = (self.device(gpu)?, self.calls.ecc?);
        let mut n: c_ulonglong = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { call(d, ECC_UNCORRECTED, ECC_VOLATILE, &mut n) })?;
        Some(n)
    }

    /// The pids of the compute processes running on the GPU.
    pub fn processes(&self, gpu: u32) -> Option<Vec<u32>> {
        let (d, call) = (self.device(gpu)?, self.calls.processes?);
        let mut infos = vec![ProcessInfo::default(); 32];
        loop {
            let mut n = infos.len() as c_uint;
            // SAFETY: `n` is the buffer's length in entries.
            let status = unsafe { call(d, &mut n, infos.as_mut_ptr()) };
            match status {
                NVML_SUCCESS => {
                    let n = (n as usize).min(infos.len());
                    return Some(infos[..n].iter().map(|p| p.pid).collect());
                }
                // More than room for: grow once to what it asked (bounded).
                NVML_ERROR_INSUFFICIENT_SIZE
                    if infos.len() < MAX_PROCESSES && n as usize > infos.len() =>
                {
                    infos.resize((n as usize).min(MAX_PROCESSES), ProcessInfo::default());
                }
                _ => return None,
            }
        }
    }

    /// The next Xid error waiting: (GPU index, Xid). Never waits.
    pub fn next_xid(&self) -> Option<(u32, u64)> {
        let (set, wait) = (self.events?, self.calls.event_wait?);
        // Events of other types are skipped, a bounded number per call (a
        // library that never runs dry cannot hold the sampler here).
        for _ in 0..MAX_SKIPPED_EVENTS {
            let mut e = EventData {
                device: std::ptr::null_mut(),
                event_type: 0,
                event_data: 0,
                gpu_instance_id: 0,
                compute_instance_id: 0,
            };
            // SAFETY: the library's own set; a valid out-pointer.
            let status = unsafe { wait(set, &mut e, 0) };
            if status == NVML_ERROR_TIMEOUT || status != NVML_SUCCESS {
                return None;
            }
            // An event of another type or of a device not enumerated is
            // skipped, not trusted.
            if e.event_type & EVENT_XID != 0
                && let Some(gpu) = self.devices.iter().position(|&d| d == e.device)
            {
                return Some((gpu as u32, e.event_data));
            }
        }
        None
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        if let (Some(set), Some(free)) = (self.events, self.calls.event_set_free) {
            // SAFETY: the set made in `open`, used by nothing else now.
            unsafe { free(set) };
        }
        if let Some(shutdown) = self.calls.shutdown {
            // SAFETY: balances the successful `nvmlInit_v2`.
            unsafe { shutdown() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_stops_at_its_nul_or_its_buffer() {
        assert_eq!(text(b"H100\0garbage"), "H100");
        assert_eq!(text(b"no nul"), "no nul");
        assert_eq!(text(b"\xff\xfe\0"), "\u{fffd}\u{fffd}");
    }

    #[test]
    fn the_structs_have_nvml_h_sizes() {
        assert_eq!(size_of::<ProcessInfo>(), 24);
        assert_eq!(size_of::<EventData>(), 32);
        assert_eq!(size_of::<Memory>(), 24);
        assert_eq!(size_of::<Utilization>(), 8);
    }

    /// The stand-in `libnvidia-ml.so.1` (tests/standins) with a state
    /// file per GPU: what each call reads, the process list past its first
    /// buffer, and each Xid once. The stand-in reads its directory from the
    /// environment: the test runs itself again in a child process with it
    /// set (setting it here would race the other tests' threads).
    #[test]
    fn reads_the_stand_in_library() {
        const CHILD: &str = "XPUSCOPE_NVML_TEST_DIR";
        let Some(dir) = std::env::var_os(CHILD).map(std::path::PathBuf::from) else {
            let lib = xpuscope_tests::fixtures::build_all().join("standins/lib/libnvidia-ml.so.1");
            let dir = std::env::temp_dir().join(format!("xpuscope-nvml-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "health::nvml::tests::reads_the_stand_in_library"])
                .args(["--nocapture", "--test-threads", "1"])
                .env(CHILD, &dir)
                .env("XPUSCOPE_NVML_TEST_LIBRARY", &lib)
                .env("STANDIN_NVML_DIR", &dir)
                .env("STANDIN_NVML_DEVICE_COUNT", "2")
                .output()
                .unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "{text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            return;
        };
        let lib = std::env::var_os("XPUSCOPE_NVML_TEST_LIBRARY").unwrap();
        let pids: String = (1..=40).map(|p| format!("pid {p}\n")).collect();
        std::fs::write(
            dir.join("gpu1"),
            format!("{pids}sm_mhz 990\nmax_sm_mhz 1980\nreasons 32\nutil_gpu 77\nmem_used 5\nmem_total 10\necc_uncorrected 3\n"),
        )
        .unwrap();
        let nvml = Nvml::open(Path::new(&lib)).unwrap();
        assert_eq!(nvml.gpus(), 2);
        assert_eq!(nvml.name(1).as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(nvml.sm_clock_mhz(1), Some(990));
        assert_eq!(nvml.max_sm_clock_mhz(1), Some(1980));
        assert_eq!(nvml.clock_event_reasons(1), Some(0x20));
        assert_eq!(nvml.clock_event_reasons(0), Some(0x1), "no process: idle");
        assert_eq!(nvml.utilization_pct(1), Some(77));
        assert_eq!(nvml.memory(1), Some((5, 10)));
        assert_eq!(nvml.ecc_uncorrected(1), Some(3));
        assert_eq!(nvml.processes(1), Some((1..=40).collect::<Vec<u32>>()));
        assert_eq!(nvml.processes(0), Some(vec![]));
        assert_eq!(nvml.sm_clock_mhz(7), None, "no such GPU");
        assert_eq!(nvml.next_xid(), None);
        std::fs::write(dir.join("gpu0"), "pid 9\nxid 79\nxid 48\n").unwrap();
        assert_eq!(nvml.next_xid(), Some((0, 79)));
        assert_eq!(nvml.next_xid(), Some((0, 48)));
        assert_eq!(nvml.next_xid(), None);
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        let e = Nvml::open(Path::new("/nonexistent/libnvidia-ml.so.1")).err();
        assert!(matches!(e, Some(NvmlError::Load { .. })), "{e:?}");
    }
}
