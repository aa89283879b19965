//! Capture levels: what the kernel programs record, held in one place (the
//! device-probe manager owns the value and mirrors it into `CONFIG`), and
//! changeable while a recording runs.

use std::fmt;

use xpuscope_probes::catalog::Level;

/// Device-library calls to record: 0 collectives, synchronizations, device
/// memory and communicator set-up; 1 adds kernel launches and copies; 2
/// adds activity records (CUPTI/MSPTI). Each level includes those below.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceLevel(u8);

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("device capture level {0} does not exist (use 0, 1 or 2)")]
pub struct NoSuchLevel(pub u8);

impl DeviceLevel {
    pub const MAX: DeviceLevel = DeviceLevel(2);

    pub fn new(level: u8) -> Result<Self, NoSuchLevel> {
        if level > Self::MAX.0 {
            return Err(NoSuchLevel(level));
        }
        Ok(DeviceLevel(level))
    }

    pub fn get(self) -> u8 {
        self.0
    }

    /// `CONFIG.probe_levels` for this level: its bit and every lower one's
    /// (bits of `ProbeSpec::level_bit`).
    pub fn mask(self) -> u32 {
        let level = match self.0 {
            0 => Level::L0,
            1 => Level::L1,
            _ => Level::L2,
        };
        level.mask_up_to()
    }
}

impl fmt::Display for DeviceLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::str::FromStr for DeviceLevel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let n: u8 = s
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not a device capture level (use 0, 1 or 2)"))?;
        DeviceLevel::new(n).map_err(|e| e.to_string())
    }
}

/// Every runtime capture level of a recording. Only the device level
/// changes at runtime today; scheduler stacks and system-wide recording are
/// fixed at start (`Config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaptureLevels {
    pub device: DeviceLevel,
    /// Launches counted in the kernel below the level that records them
    /// (an entry probe per launch function; see the device-probe guide):
    /// on by default, off for a job whose launch rate makes even that cost
    /// too much.
    pub launch_counts: bool,
}

impl Default for CaptureLevels {
    fn default() -> Self {
        Self {
            device: DeviceLevel::default(),
            launch_counts: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_include_lower_levels() {
        let masks: Vec<u32> = (0..=2)
            .map(|n| DeviceLevel::new(n).unwrap().mask())
            .collect();
        assert_eq!(masks, vec![0b1, 0b11, 0b111]);
        assert_eq!(DeviceLevel::new(3), Err(NoSuchLevel(3)));
        assert_eq!("1".parse::<DeviceLevel>(), Ok(DeviceLevel(1)));
        assert!(
            "9".parse::<DeviceLevel>()
                .unwrap_err()
                .contains("use 0, 1 or 2")
        );
        assert!("x".parse::<DeviceLevel>().is_err());
    }
}
