//! CUPTI activity records (CUDA 12.9, `CUPTI_API_VERSION` 28; packed,
//! 8-byte aligned). Offsets, checked against the stand-in's `offsetof`
//! (`tests/standins/tests/record_layout.c`):
//!
//! - `CUpti_ActivityKernel9` (208 B, kind 3 KERNEL / 10 CONCURRENT_KERNEL):
//!   start@16 end@24 completed@32 deviceId@40 contextId@44 streamId@48
//!   gridX/Y/Z@52/56/60 blockX/Y/Z@64/68/72 staticSharedMemory@76
//!   dynamicSharedMemory@80 correlationId@92 name@104. Kernel4 through
//!   Kernel10 share this prefix, so older and newer CUPTIs decode the same.
//! - `CUpti_ActivityMemcpy6` (96 B, kind 1): copyKind@4 (u8) bytes@8
//!   start@16 end@24 deviceId@32 contextId@36 streamId@40 correlationId@44.
//! - `CUpti_ActivityAPI` (40 B, kind 4 DRIVER / 5 RUNTIME): cbid@4 start@8
//!   end@16 processId@24 threadId@28 correlationId@32 returnValue@36.

use super::{
    ActivityApi, ActivityDetail, ActivityError, ActivityKind, DeviceActivity, need, nonzero,
};
use crate::bytes::{i32_at, u32_at, u64_at};
use crate::enums::MemcpyKind;

pub const KIND_MEMCPY: u32 = 1;
pub const KIND_KERNEL: u32 = 3;
pub const KIND_DRIVER: u32 = 4;
pub const KIND_RUNTIME: u32 = 5;
pub const KIND_CONCURRENT_KERNEL: u32 = 10;

/// Field offsets (bytes).
pub mod offsets {
    pub const KERNEL_START: usize = 16;
    pub const KERNEL_END: usize = 24;
    pub const KERNEL_DEVICE: usize = 40;
    pub const KERNEL_STREAM: usize = 48;
    pub const KERNEL_GRID_X: usize = 52;
    pub const KERNEL_BLOCK_X: usize = 64;
    pub const KERNEL_STATIC_SHARED: usize = 76;
    pub const KERNEL_DYNAMIC_SHARED: usize = 80;
    pub const KERNEL_CORRELATION: usize = 92;
    pub const KERNEL_NAME: usize = 104;
    pub const MEMCPY_COPY_KIND: usize = 4;
    pub const MEMCPY_BYTES: usize = 8;
    pub const MEMCPY_START: usize = 16;
    pub const MEMCPY_END: usize = 24;
    pub const MEMCPY_DEVICE: usize = 32;
    pub const MEMCPY_STREAM: usize = 40;
    pub const MEMCPY_CORRELATION: usize = 44;
    pub const API_CBID: usize = 4;
    pub const API_START: usize = 8;
    pub const API_END: usize = 16;
    pub const API_PID: usize = 24;
    pub const API_TID: usize = 28;
    pub const API_CORRELATION: usize = 32;
    pub const API_RETURN: usize = 36;
}

use offsets::*;

/// Bytes of a kernel record that must be present (through `name`).
pub const KERNEL_NEED: usize = KERNEL_NAME + 8;
pub const MEMCPY_NEED: usize = MEMCPY_CORRELATION + 4;
pub const API_NEED: usize = 40;

/// Decodes a CUPTI record (possibly cut to its first bytes).
pub fn parse(r: &[u8]) -> Result<DeviceActivity, ActivityError> {
    let api = ActivityApi::Cupti;
    let kind = u32_at(r, 0).ok_or(ActivityError::Empty { api, len: r.len() })?;
    // All reads below are within the `need` checked first; `unwrap_or(0)`
    // only keeps the code panic-free.
    let u32f = |off| u32_at(r, off).unwrap_or(0);
    let u64f = |off| u64_at(r, off).unwrap_or(0);
    let i32f = |off| i32_at(r, off).unwrap_or(0);
    match kind {
        KIND_KERNEL | KIND_CONCURRENT_KERNEL => {
            need(api, kind, r, KERNEL_NEED)?;
            let dims = |off: usize| [i32f(off), i32f(off + 4), i32f(off + 8)];
            Ok(DeviceActivity {
                api,
                kind: ActivityKind::Kernel,
                raw_kind: kind,
                start: u64f(KERNEL_START),
                end: u64f(KERNEL_END),
                device: Some(u32f(KERNEL_DEVICE)),
                stream: Some(u64::from(u32f(KERNEL_STREAM))),
                correlation_id: Some(u64::from(u32f(KERNEL_CORRELATION))),
                name_ptr: nonzero(u64f(KERNEL_NAME)),
                detail: ActivityDetail::Launch {
                    grid: dims(KERNEL_GRID_X),
                    block: dims(KERNEL_BLOCK_X),
                    static_shared: i32f(KERNEL_STATIC_SHARED),
                    dynamic_shared: i32f(KERNEL_DYNAMIC_SHARED),
                },
            })
        }
        KIND_MEMCPY => {
            need(api, kind, r, MEMCPY_NEED)?;
            Ok(DeviceActivity {
                api,
                kind: ActivityKind::Memcpy,
                raw_kind: kind,
                start: u64f(MEMCPY_START),
                end: u64f(MEMCPY_END),
                device: Some(u32f(MEMCPY_DEVICE)),
                stream: Some(u64::from(u32f(MEMCPY_STREAM))),
                correlation_id: Some(u64::from(u32f(MEMCPY_CORRELATION))),
                name_ptr: None,
                detail: ActivityDetail::Memcpy {
                    bytes: u64f(MEMCPY_BYTES),
                    kind: cupti_copy_kind(r[MEMCPY_COPY_KIND]),
                },
            })
        }
        KIND_DRIVER | KIND_RUNTIME => {
            need(api, kind, r, API_NEED)?;
            Ok(DeviceActivity {
                api,
                kind: ActivityKind::Api,
                raw_kind: kind,
                start: u64f(API_START),
                end: u64f(API_END),
                device: None,
                stream: None,
                correlation_id: Some(u64::from(u32f(API_CORRELATION))),
                name_ptr: None,
                detail: ActivityDetail::Api {
                    cbid: Some(u32f(API_CBID)),
                    pid: u32f(API_PID),
                    tid: u32f(API_TID),
                    ret: Some(u32f(API_RETURN)),
                },
            })
        }
        kind => Err(ActivityError::UnknownKind { api, kind }),
    }
}

/// `CUpti_ActivityMemcpyKind`: HTOD 1, DTOH 2, DTOD 8, HTOH 9 (array
/// and peer kinds are reported as unknown).
fn cupti_copy_kind(v: u8) -> MemcpyKind {
    match v {
        1 => MemcpyKind::HostToDevice,
        2 => MemcpyKind::DeviceToHost,
        8 => MemcpyKind::DeviceToDevice,
        9 => MemcpyKind::HostToHost,
        v => MemcpyKind::Unknown(u32::from(v)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A CUpti_ActivityKernel9 as the real library lays it out (208 B).
    pub(crate) fn kernel_record(kind: u32) -> Vec<u8> {
        let mut r = vec![0u8; 208];
        r[0..4].copy_from_slice(&kind.to_le_bytes());
        r[16..24].copy_from_slice(&1_000u64.to_le_bytes());
        r[24..32].copy_from_slice(&5_000u64.to_le_bytes());
        r[40..44].copy_from_slice(&3u32.to_le_bytes());
        r[48..52].copy_from_slice(&17u32.to_le_bytes());
        for (i, v) in [7i32, 3, 1, 128, 1, 1].iter().enumerate() {
            r[52 + 4 * i..56 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        r[76..80].copy_from_slice(&256i32.to_le_bytes());
        r[80..84].copy_from_slice(&1024i32.to_le_bytes());
        r[92..96].copy_from_slice(&42u32.to_le_bytes());
        r[104..112].copy_from_slice(&0x5555_0000_1000u64.to_le_bytes());
        r
    }

    #[test]
    fn kernel_record_through_the_128_byte_copy() {
        let full = kernel_record(KIND_CONCURRENT_KERNEL);
        let a = parse(&full[..128]).unwrap();
        assert_eq!(
            (a.kind, a.start, a.end),
            (ActivityKind::Kernel, 1_000, 5_000)
        );
        assert_eq!(
            (a.device, a.stream, a.correlation_id),
            (Some(3), Some(17), Some(42))
        );
        assert_eq!(a.name_ptr, Some(0x5555_0000_1000));
        assert_eq!(
            a.detail,
            ActivityDetail::Launch {
                grid: [7, 3, 1],
                block: [128, 1, 1],
                static_shared: 256,
                dynamic_shared: 1024
            }
        );
        assert_eq!(parse(&kernel_record(KIND_KERNEL)).unwrap().raw_kind, 3);
        // Cut before the name: refused, not misread.
        assert!(matches!(
            parse(&full[..111]),
            Err(ActivityError::Short { need: 112, .. })
        ));
    }

    #[test]
    fn memcpy_and_api_records() {
        let mut m = vec![0u8; 96];
        m[0..4].copy_from_slice(&KIND_MEMCPY.to_le_bytes());
        m[4] = 1;
        m[8..16].copy_from_slice(&(4u64 << 20).to_le_bytes());
        m[16..24].copy_from_slice(&10u64.to_le_bytes());
        m[24..32].copy_from_slice(&20u64.to_le_bytes());
        m[32..36].copy_from_slice(&1u32.to_le_bytes());
        m[40..44].copy_from_slice(&9u32.to_le_bytes());
        m[44..48].copy_from_slice(&77u32.to_le_bytes());
        let a = parse(&m).unwrap();
        assert_eq!(
            (a.kind, a.start, a.end, a.device, a.stream, a.correlation_id),
            (ActivityKind::Memcpy, 10, 20, Some(1), Some(9), Some(77))
        );
        assert_eq!(
            a.detail,
            ActivityDetail::Memcpy {
                bytes: 4 << 20,
                kind: MemcpyKind::HostToDevice
            }
        );

        let mut api = vec![0u8; 40];
        api[0..4].copy_from_slice(&KIND_RUNTIME.to_le_bytes());
        api[4..8].copy_from_slice(&211u32.to_le_bytes());
        api[8..16].copy_from_slice(&100u64.to_le_bytes());
        api[16..24].copy_from_slice(&150u64.to_le_bytes());
        api[24..28].copy_from_slice(&1234u32.to_le_bytes());
        api[28..32].copy_from_slice(&1240u32.to_le_bytes());
        api[32..36].copy_from_slice(&42u32.to_le_bytes());
        api[36..40].copy_from_slice(&35u32.to_le_bytes());
        let a = parse(&api).unwrap();
        assert_eq!(
            (a.kind, a.start, a.end, a.correlation_id),
            (ActivityKind::Api, 100, 150, Some(42))
        );
        assert_eq!(
            a.detail,
            ActivityDetail::Api {
                cbid: Some(211),
                pid: 1234,
                tid: 1240,
                ret: Some(35)
            }
        );
        assert!(parse(&api[..39]).is_err());
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(matches!(parse(&[]), Err(ActivityError::Empty { .. })));
        assert!(matches!(parse(&[1, 0]), Err(ActivityError::Empty { .. })));
        assert!(matches!(
            parse(&99u32.to_le_bytes()),
            Err(ActivityError::UnknownKind { kind: 99, .. })
        ));
        assert!(matches!(
            parse(&KIND_KERNEL.to_le_bytes()),
            Err(ActivityError::Short { .. })
        ));
    }
}
