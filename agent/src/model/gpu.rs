//! Device health as the vendor's management library reports it, per
//! device (not per process): what the health sampler reads every interval
//! from NVML (NVIDIA GPUs) or DCMI (Ascend NPUs), and the errors the device
//! raised (NVML's Xid events, DCMI's error codes). The pids are the
//! library's processes on the device; every sink joins them to ranks
//! through the rank identities it has seen (a pid of a process outside the
//! traced job has none and is left out).

/// Whose device, read through which library. Devices are numbered per
/// vendor: NVML's GPU 0 and DCMI's NPU 0 are two devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Vendor {
    /// An NVIDIA GPU, through NVML.
    #[default]
    Nvidia,
    /// An Ascend NPU, through DCMI.
    Ascend,
}

impl Vendor {
    /// The `vendor` label and evidence value.
    pub fn name(self) -> &'static str {
        match self {
            Vendor::Nvidia => "nvidia",
            Vendor::Ascend => "ascend",
        }
    }

    /// The library its readings come from (a finding's `source`).
    pub fn source(self) -> &'static str {
        match self {
            Vendor::Nvidia => "nvml",
            Vendor::Ascend => "dcmi",
        }
    }

    /// What its devices are called: `GPU 0`, `NPU 0`.
    pub fn device(self) -> &'static str {
        match self {
            Vendor::Nvidia => "GPU",
            Vendor::Ascend => "NPU",
        }
    }
}

/// DCMI's `dcmi_get_device_health` levels (0: healthy).
pub const HEALTH_LEVELS: [&str; 4] = ["ok", "minor alarm", "major alarm", "critical alarm"];

/// A health level's name; `None` for a value DCMI does not document.
pub fn health_name(level: u32) -> Option<&'static str> {
    HEALTH_LEVELS.get(level as usize).copied()
}

/// Most pids kept per sample (NVML lists every process on the GPU).
pub const MAX_SAMPLE_PIDS: usize = 64;

/// One GPU's readings at `ts`; a reading the library did not give (or
/// gave out of range) is `None`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuSample {
    pub ts: u64,
    pub vendor: Vendor,
    /// The device's index: NVML's for a GPU; for an NPU, its place in
    /// DCMI's enumeration (cards in DCMI's order, devices within a card).
    pub gpu: u32,
    pub name: String,
    pub uuid: String,
    /// The SM clock (GPU) or the AI Core frequency (NPU), MHz.
    pub sm_clock_mhz: Option<u32>,
    /// Its highest (GPU) or rated (NPU) value.
    pub max_sm_clock_mhz: Option<u32>,
    /// `nvmlClocksEventReason*` bits; DCMI gives none (`None`).
    pub clock_event_reasons: Option<u64>,
    pub utilization_pct: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    /// Uncorrected ECC errors since the driver loaded (volatile count).
    pub ecc_uncorrected: Option<u64>,
    /// DCMI's health level (index into [`HEALTH_LEVELS`]); NVML has none.
    pub health: Option<u32>,
    /// Compute processes on the GPU.
    pub pids: Vec<u32>,
}

impl GpuSample {
    /// The reasons that slow the clock: every bit but "idle" (an idle GPU
    /// lowers its clock by design), "applications clocks setting" and
    /// "display clock setting" (configured, not a slowdown).
    pub fn slowdown_reasons(&self) -> u64 {
        self.clock_event_reasons.unwrap_or(0) & !NOT_SLOWDOWNS
    }
}

/// A device's error: a GPU's Xid from NVML's event set, or an error code
/// an NPU newly listed in DCMI's `dcmi_get_device_errorcode_v2`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuXid {
    pub ts: u64,
    pub vendor: Vendor,
    pub gpu: u32,
    /// The Xid (GPU) or the DCMI error code (NPU).
    pub xid: u64,
    /// The GPU's compute processes at the last sample before it.
    pub pids: Vec<u32>,
}

/// `nvmlClocksEventReason*` bits and their names (nvml.h).
pub const CLOCK_EVENT_REASONS: [(u64, &str); 9] = [
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

const NOT_SLOWDOWNS: u64 = 0x1 | 0x2 | 0x100;

/// The names of the reason bits set in `bits`, joined by `,` (an unknown
/// bit as `0x...`); empty when none.
pub fn reason_names(bits: u64) -> String {
    let mut names: Vec<String> = CLOCK_EVENT_REASONS
        .iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|(_, name)| (*name).to_owned())
        .collect();
    let known: u64 = CLOCK_EVENT_REASONS.iter().map(|(b, _)| b).sum();
    if bits & !known != 0 {
        names.push(format!("{:#x}", bits & !known));
    }
    names.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_named_and_unknown_bits_kept() {
        assert_eq!(reason_names(0), "");
        assert_eq!(reason_names(0x20), "sw_thermal_slowdown");
        assert_eq!(reason_names(0x44), "sw_power_cap,hw_thermal_slowdown");
        assert_eq!(reason_names(0x1000 | 0x1), "gpu_idle,0x1000");
    }

    #[test]
    fn idle_and_settings_are_no_slowdown() {
        let s = |bits| GpuSample {
            clock_event_reasons: Some(bits),
            ..GpuSample::default()
        };
        assert_eq!(s(0x1 | 0x2 | 0x100).slowdown_reasons(), 0);
        assert_eq!(s(0x1 | 0x20).slowdown_reasons(), 0x20);
        assert_eq!(GpuSample::default().slowdown_reasons(), 0);
    }
}
