//! GPU health as NVML reports it, per GPU (not per process): what the
//! health sampler reads every interval, and the Xid errors the GPU raised.
//! The pids are NVML's compute processes on the GPU; every sink joins them
//! to ranks through the rank identities it has seen (a pid of a process
//! outside the traced job has none and is left out).

/// Most pids kept per sample (NVML lists every process on the GPU).
pub const MAX_SAMPLE_PIDS: usize = 64;

/// One GPU's readings at `ts`; a reading the library did not give (or
/// gave out of range) is `None`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuSample {
    pub ts: u64,
    /// NVML's index of the GPU.
    pub gpu: u32,
    pub name: String,
    pub uuid: String,
    pub sm_clock_mhz: Option<u32>,
    pub max_sm_clock_mhz: Option<u32>,
    /// `nvmlClocksEventReason*` bits.
    pub clock_event_reasons: Option<u64>,
    pub utilization_pct: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    /// Uncorrected ECC errors since the driver loaded (volatile count).
    pub ecc_uncorrected: Option<u64>,
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

/// A GPU's Xid error, from NVML's event set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuXid {
    pub ts: u64,
    pub gpu: u32,
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
