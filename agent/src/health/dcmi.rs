//! The host's DCMI (`libdcmi.so`, the device management interface the
//! Ascend NPU driver installs), loaded at run time: the calls the health
//! sampler makes, each behind a safe method that bounds what the library
//! hands back (a count past the buffer given is cut to it, text stops at
//! its NUL or its buffer, a card or device count past [`MAX_NPUS`] is cut).
//!
//! The signatures, struct layouts and enum values are those the Ascend NPU
//! driver's `dcmi_interface_api.h` declares (the header's copies that
//! public projects vendor from recent drivers agree on every one used here)
//! and the "DCMI API Reference" of the Atlas products documents:
//! - `int dcmi_init(void)`
//! - `int dcmi_get_card_num_list(int *card_num, int *card_list, int list_len)`
//! - `int dcmi_get_device_num_in_card(int card_id, int *device_num)`
//! - `int dcmi_get_device_chip_info(int card_id, int device_id, struct dcmi_chip_info *)`
//! - `int dcmi_get_device_frequency(int card_id, int device_id, enum dcmi_freq_type, unsigned int *)`
//!   with `DCMI_FREQ_AICORE_CURRENT_ = 7` and `DCMI_FREQ_AICORE_MAX = 9` (MHz)
//! - `int dcmi_get_device_utilization_rate(int card_id, int device_id, int input_type, unsigned int *)`
//!   with `DCMI_UTILIZATION_RATE_AICORE = 2` (percent)
//! - `int dcmi_get_device_hbm_info(int card_id, int device_id, struct dcmi_hbm_info *)`
//!   (`memory_size`, `memory_usage` in MB)
//! - `int dcmi_get_device_health(int card_id, int device_id, unsigned int *health)`
//!   (0 ok, 1 minor, 2 major, 3 critical alarm)
//! - `int dcmi_get_device_errorcode_v2(int card_id, int device_id, int *error_count,
//!   unsigned int *error_code_list, unsigned int list_len)` (the error codes
//!   the device has now)
//! - `int dcmi_get_device_resource_info(int card_id, int device_id,
//!   struct dcmi_proc_mem_info *proc_info, int *proc_num)` (the processes
//!   on the device; the reference's example passes 32 entries, some drivers
//!   list up to 64: [`MAX_PROCESSES`] entries are given)
//!
//! Every call but `dcmi_init` and the enumeration is optional: a library
//! that lacks one (an older driver, an inference card without HBM, a test's
//! stand-in) still gives what it has. DCMI gives no reason for a lowered
//! frequency through these calls, so an NPU's sample carries none.

use std::ffi::{c_int, c_uint, c_ulong, c_ulonglong};
use std::path::Path;

use libloading::Library;

/// NPUs read at most (an Atlas 900 A3 node has 16; a count past this is a
/// broken library).
pub const MAX_NPUS: usize = 64;
/// Process entries handed to `dcmi_get_device_resource_info`: more than
/// any driver lists (32 in the reference's example, 64 in newer drivers).
pub const MAX_PROCESSES: usize = 256;
/// Error codes read per device at most (DCMI's own list holds 128).
pub const MAX_ERROR_CODES: usize = 128;

const DCMI_OK: c_int = 0;
/// `enum dcmi_freq_type`.
const FREQ_AICORE_CURRENT: c_int = 7;
const FREQ_AICORE_MAX: c_int = 9;
/// `DCMI_UTILIZATION_RATE_AICORE`.
const UTILIZATION_AICORE: c_int = 2;
/// `MAX_CHIP_NAME_LEN`.
const CHIP_NAME: usize = 32;

/// `struct dcmi_chip_info`.
#[repr(C)]
struct ChipInfo {
    chip_type: [u8; CHIP_NAME],
    chip_name: [u8; CHIP_NAME],
    chip_ver: [u8; CHIP_NAME],
    aicore_cnt: c_uint,
}

/// `struct dcmi_hbm_info`.
#[repr(C)]
#[derive(Default)]
struct HbmInfo {
    memory_size: c_ulonglong,
    freq: c_uint,
    memory_usage: c_ulonglong,
    temp: c_int,
    bandwith_util_rate: c_uint,
}

/// `struct dcmi_proc_mem_info`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcMemInfo {
    proc_id: c_int,
    proc_mem_usage: c_ulong,
}

type Status = c_int;
type U32Out = unsafe extern "C" fn(c_int, c_int, c_int, *mut c_uint) -> Status;

/// The entry points, each looked up by its real name.
struct Calls {
    init: unsafe extern "C" fn() -> Status,
    card_list: unsafe extern "C" fn(*mut c_int, *mut c_int, c_int) -> Status,
    devices_in_card: unsafe extern "C" fn(c_int, *mut c_int) -> Status,
    chip_info: Option<unsafe extern "C" fn(c_int, c_int, *mut ChipInfo) -> Status>,
    frequency: Option<U32Out>,
    utilization: Option<U32Out>,
    hbm: Option<unsafe extern "C" fn(c_int, c_int, *mut HbmInfo) -> Status>,
    health: Option<unsafe extern "C" fn(c_int, c_int, *mut c_uint) -> Status>,
    error_codes:
        Option<unsafe extern "C" fn(c_int, c_int, *mut c_int, *mut c_uint, c_uint) -> Status>,
    processes: Option<unsafe extern "C" fn(c_int, c_int, *mut ProcMemInfo, *mut c_int) -> Status>,
}

/// Why DCMI gives nothing.
#[derive(Debug, thiserror::Error)]
pub enum DcmiError {
    #[error("{path} could not be loaded: {source}")]
    Load {
        path: String,
        #[source]
        source: libloading::Error,
    },
    #[error("{path} has no {symbol}")]
    Missing { path: String, symbol: &'static str },
    #[error("{call} failed with DCMI status {status}")]
    Call { call: &'static str, status: i32 },
}

/// An initialized DCMI and its NPUs, each a (card, device) pair. It lives
/// on the sampler's thread.
pub struct Dcmi {
    calls: Calls,
    npus: Vec<(c_int, c_int)>,
    /// Kept loaded while the function pointers above are in use.
    _library: Library,
}

/// Looks `name` up; `None` when the library lacks it.
///
/// # Safety
/// `T` must be the C signature of `name` in dcmi_interface_api.h.
unsafe fn optional<T: Copy>(lib: &Library, name: &[u8]) -> Option<T> {
    // SAFETY: the caller names the symbol's real signature.
    unsafe { lib.get::<T>(name).ok().map(|s| *s) }
}

fn ok(status: Status) -> Option<()> {
    (status == DCMI_OK).then_some(())
}

/// Text DCMI wrote into `buf`: up to its first NUL, never past the buffer.
fn text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The first `count` entries of `buf`, a count below zero or past the
/// buffer bounded to it.
fn counted<T: Copy>(buf: &[T], count: c_int) -> &[T] {
    &buf[..usize::try_from(count).unwrap_or(0).min(buf.len())]
}

impl Dcmi {
    /// Loads the library at `path`, initializes it and enumerates its NPUs
    /// (cards in DCMI's order, the devices of each card in turn).
    pub fn open(path: &Path) -> Result<Self, DcmiError> {
        let shown = path.display().to_string();
        // SAFETY: loading runs the library's initializers; DCMI's (or a
        // stand-in's) are what every DCMI user runs.
        let library = unsafe { Library::new(path) }.map_err(|source| DcmiError::Load {
            path: shown.clone(),
            source,
        })?;
        let missing = |symbol| DcmiError::Missing {
            path: shown.clone(),
            symbol,
        };
        // SAFETY (every lookup): each type is the function's prototype in
        // dcmi_interface_api.h (see the module's comment).
        let calls = unsafe {
            Calls {
                init: optional(&library, b"dcmi_init\0").ok_or_else(|| missing("dcmi_init"))?,
                card_list: optional(&library, b"dcmi_get_card_num_list\0")
                    .ok_or_else(|| missing("dcmi_get_card_num_list"))?,
                devices_in_card: optional(&library, b"dcmi_get_device_num_in_card\0")
                    .ok_or_else(|| missing("dcmi_get_device_num_in_card"))?,
                chip_info: optional(&library, b"dcmi_get_device_chip_info\0"),
                frequency: optional(&library, b"dcmi_get_device_frequency\0"),
                utilization: optional(&library, b"dcmi_get_device_utilization_rate\0"),
                hbm: optional(&library, b"dcmi_get_device_hbm_info\0"),
                health: optional(&library, b"dcmi_get_device_health\0"),
                error_codes: optional(&library, b"dcmi_get_device_errorcode_v2\0"),
                processes: optional(&library, b"dcmi_get_device_resource_info\0"),
            }
        };
        // SAFETY: a call without arguments.
        let status = unsafe { (calls.init)() };
        ok(status).ok_or(DcmiError::Call {
            call: "dcmi_init",
            status,
        })?;
        let mut cards = [0 as c_int; MAX_NPUS];
        let mut n: c_int = 0;
        // SAFETY: the list's length is what the library is told.
        let status = unsafe { (calls.card_list)(&mut n, cards.as_mut_ptr(), MAX_NPUS as c_int) };
        ok(status).ok_or(DcmiError::Call {
            call: "dcmi_get_card_num_list",
            status,
        })?;
        let mut npus = Vec::new();
        for &card in counted(&cards, n) {
            let mut devices: c_int = 0;
            // SAFETY: a valid out-pointer.
            if unsafe { (calls.devices_in_card)(card, &mut devices) } != DCMI_OK {
                continue;
            }
            for device in 0..devices.clamp(0, MAX_NPUS as c_int) {
                if npus.len() < MAX_NPUS {
                    npus.push((card, device));
                }
            }
        }
        Ok(Dcmi {
            calls,
            npus,
            _library: library,
        })
    }

    /// NPUs found.
    pub fn npus(&self) -> u32 {
        self.npus.len() as u32
    }

    fn npu(&self, npu: u32) -> Option<(c_int, c_int)> {
        self.npus.get(npu as usize).copied()
    }

    /// The chip's name (`910B3`), or its type when it has no name.
    pub fn name(&self, npu: u32) -> Option<String> {
        let ((card, device), call) = (self.npu(npu)?, self.calls.chip_info?);
        let mut info = ChipInfo {
            chip_type: [0; CHIP_NAME],
            chip_name: [0; CHIP_NAME],
            chip_ver: [0; CHIP_NAME],
            aicore_cnt: 0,
        };
        // SAFETY: a valid out-pointer to the struct the header declares.
        ok(unsafe { call(card, device, &mut info) })?;
        let name = text(&info.chip_name);
        Some(if name.is_empty() {
            text(&info.chip_type)
        } else {
            format!("Ascend {name}")
        })
    }

    /// The (card, device) pair DCMI addresses the NPU by.
    pub fn card_device(&self, npu: u32) -> Option<(i32, i32)> {
        self.npu(npu)
    }

    fn u32_reading(&self, npu: u32, call: Option<U32Out>, kind: c_int) -> Option<u32> {
        let ((card, device), call) = (self.npu(npu)?, call?);
        let mut v: c_uint = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { call(card, device, kind, &mut v) })?;
        Some(v)
    }

    /// The AI Core frequency now, MHz.
    pub fn aicore_mhz(&self, npu: u32) -> Option<u32> {
        self.u32_reading(npu, self.calls.frequency, FREQ_AICORE_CURRENT)
    }

    /// The AI Core's rated frequency, MHz.
    pub fn aicore_max_mhz(&self, npu: u32) -> Option<u32> {
        self.u32_reading(npu, self.calls.frequency, FREQ_AICORE_MAX)
    }

    /// The AI Core's utilization, percent.
    pub fn aicore_utilization_pct(&self, npu: u32) -> Option<u32> {
        self.u32_reading(npu, self.calls.utilization, UTILIZATION_AICORE)
    }

    /// HBM (used, total), MB as DCMI gives them.
    pub fn hbm_mb(&self, npu: u32) -> Option<(u64, u64)> {
        let ((card, device), call) = (self.npu(npu)?, self.calls.hbm?);
        let mut h = HbmInfo::default();
        // SAFETY: a valid out-pointer to the struct the header declares.
        ok(unsafe { call(card, device, &mut h) })?;
        Some((h.memory_usage, h.memory_size))
    }

    /// The health level (0 ok .. 3 critical alarm).
    pub fn health(&self, npu: u32) -> Option<u32> {
        let ((card, device), call) = (self.npu(npu)?, self.calls.health?);
        let mut h: c_uint = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { call(card, device, &mut h) })?;
        Some(h)
    }

    /// The error codes the NPU has now.
    pub fn error_codes(&self, npu: u32) -> Option<Vec<u32>> {
        let ((card, device), call) = (self.npu(npu)?, self.calls.error_codes?);
        let mut codes = [0 as c_uint; MAX_ERROR_CODES];
        let mut n: c_int = 0;
        // SAFETY: the list's length is what the library is told.
        ok(unsafe {
            call(
                card,
                device,
                &mut n,
                codes.as_mut_ptr(),
                MAX_ERROR_CODES as c_uint,
            )
        })?;
        Some(counted(&codes, n).to_vec())
    }

    /// The pids of the processes on the NPU.
    pub fn processes(&self, npu: u32) -> Option<Vec<u32>> {
        let ((card, device), call) = (self.npu(npu)?, self.calls.processes?);
        let mut infos = vec![ProcMemInfo::default(); MAX_PROCESSES];
        let mut n: c_int = 0;
        // SAFETY: the buffer holds more entries than DCMI lists per device.
        ok(unsafe { call(card, device, infos.as_mut_ptr(), &mut n) })?;
        Some(
            counted(&infos, n)
                .iter()
                .filter_map(|p| u32::try_from(p.proc_id).ok())
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_structs_have_the_header_s_sizes() {
        assert_eq!(size_of::<ChipInfo>(), 100);
        assert_eq!(size_of::<HbmInfo>(), 32);
        assert_eq!(size_of::<ProcMemInfo>(), 16);
    }

    #[test]
    fn counts_are_bounded_by_the_buffer() {
        let buf = [1, 2, 3];
        assert_eq!(counted(&buf, 2), &[1, 2]);
        assert_eq!(counted(&buf, 99), &[1, 2, 3]);
        assert!(counted(&buf, -4).is_empty());
        assert_eq!(text(b"910B3\0junk"), "910B3");
    }

    /// The stand-in `libdcmi.so` (tests/standins) with a state file per
    /// NPU. The stand-in reads its directory from the environment: the test
    /// runs itself again in a child process with it set (setting it here
    /// would race the other tests' threads).
    #[test]
    fn reads_the_stand_in_library() {
        const CHILD: &str = "XPUSCOPE_DCMI_TEST_DIR";
        let Some(dir) = std::env::var_os(CHILD).map(std::path::PathBuf::from) else {
            let lib = xpuscope_tests::fixtures::build_all().join("standins/lib/libdcmi.so");
            let dir = std::env::temp_dir().join(format!("xpuscope-dcmi-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "health::dcmi::tests::reads_the_stand_in_library"])
                .args(["--nocapture", "--test-threads", "1"])
                .env(CHILD, &dir)
                .env("XPUSCOPE_DCMI_TEST_LIBRARY", &lib)
                .env("STANDIN_DCMI_DIR", &dir)
                .env("STANDIN_DCMI_DEVICE_COUNT", "3")
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
        let lib = std::env::var_os("XPUSCOPE_DCMI_TEST_LIBRARY").unwrap();
        let pids: String = (1..=40).map(|p| format!("pid {p}\n")).collect();
        std::fs::write(
            dir.join("npu2"),
            format!(
                "{pids}aicore_mhz 900\nmax_aicore_mhz 1800\nutil_aicore 77\nhbm_used_mb 5\nhbm_total_mb 10\nhealth 2\nerror_code 2162169857\n"
            ),
        )
        .unwrap();
        let dcmi = Dcmi::open(Path::new(&lib)).unwrap();
        assert_eq!(dcmi.npus(), 3);
        // The stand-in is two devices per card: NPU 2 is card 1, device 0.
        assert_eq!(dcmi.card_device(2), Some((1, 0)));
        assert_eq!(dcmi.name(2).as_deref(), Some("Ascend 910B3"));
        assert_eq!(dcmi.aicore_mhz(2), Some(900));
        assert_eq!(dcmi.aicore_max_mhz(2), Some(1800));
        assert_eq!(dcmi.aicore_utilization_pct(2), Some(77));
        assert_eq!(dcmi.aicore_utilization_pct(0), Some(0), "no process: idle");
        assert_eq!(dcmi.hbm_mb(2), Some((5, 10)));
        assert_eq!(dcmi.health(2), Some(2));
        assert_eq!(dcmi.health(0), Some(0));
        assert_eq!(dcmi.error_codes(2), Some(vec![0x80E0_1801]));
        assert_eq!(dcmi.error_codes(0), Some(vec![]));
        assert_eq!(dcmi.processes(2), Some((1..=40).collect::<Vec<u32>>()));
        assert_eq!(dcmi.processes(1), Some(vec![]));
        assert_eq!(dcmi.aicore_mhz(7), None, "no such NPU");
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        let e = Dcmi::open(Path::new("/nonexistent/libdcmi.so")).err();
        assert!(matches!(e, Some(DcmiError::Load { .. })), "{e:?}");
    }
}
