//! MSPTI activity records (CANN 8; packed with 8-byte alignment, so 64-bit
//! fields sit at unaligned offsets). Offsets, asserted by the stand-in and
//! `tests/standins/tests/record_layout.c`:
//!
//! - Kernel (56 B, kind 2): start@4 end@12 deviceId@20 streamId@24
//!   correlationId@28 (u64) type@36 name@44.
//! - Api (48 B, kind 3): start@4 end@12 processId@20 threadId@24
//!   correlationId@28 name@36.
//! - Hccl (56 B, kind 4): start@4 end@12 deviceId@20 streamId@24
//!   bandWidth@28 (f64, GB/s) name@36 commName@44.
//! - Communication (72 B, kind 9): dataType@4 count@8 deviceId@16
//!   streamId@20 start@24 end@32 algType@40 name@48 commName@56
//!   correlationId@64.
//! - Marker (56 B, kind 1): flag@4 sourceKind@8 timestamp@12 id@20
//!   objectId@28 (pid/tid or deviceId/streamId) name@36 domain@44.

use super::{
    ActivityApi, ActivityDetail, ActivityError, ActivityKind, DeviceActivity, need, nonzero,
};
use crate::bytes::{f64_at, u32_at, u64_at};
use crate::enums::DataType;

pub const KIND_MARKER: u32 = 1;
pub const KIND_KERNEL: u32 = 2;
pub const KIND_API: u32 = 3;
pub const KIND_HCCL: u32 = 4;
pub const KIND_COMMUNICATION: u32 = 9;

/// Record sizes.
pub const KERNEL_SIZE: usize = 56;
pub const API_SIZE: usize = 48;
pub const HCCL_SIZE: usize = 56;
pub const COMMUNICATION_SIZE: usize = 72;
pub const MARKER_SIZE: usize = 56;

/// `msptiActivitySourceKind`: the marker was put on a device stream.
const SOURCE_DEVICE: u32 = 1;

/// Decodes an MSPTI record (possibly cut to its first bytes).
pub fn parse(r: &[u8]) -> Result<DeviceActivity, ActivityError> {
    let api = ActivityApi::Mspti;
    let kind = u32_at(r, 0).ok_or(ActivityError::Empty { api, len: r.len() })?;
    // Reads below are within the size checked first.
    let u32f = |off| u32_at(r, off).unwrap_or(0);
    let u64f = |off| u64_at(r, off).unwrap_or(0);
    let base = |kind, start, end| DeviceActivity {
        api,
        kind,
        raw_kind: 0,
        start,
        end,
        device: None,
        stream: None,
        correlation_id: None,
        name_ptr: None,
        detail: ActivityDetail::None,
    };
    let a = match kind {
        KIND_KERNEL => {
            need(api, kind, r, KERNEL_SIZE - 4)?;
            DeviceActivity {
                device: Some(u32f(20)),
                stream: Some(u64::from(u32f(24))),
                correlation_id: Some(u64f(28)),
                name_ptr: nonzero(u64f(44)),
                detail: ActivityDetail::KernelType { type_ptr: u64f(36) },
                ..base(ActivityKind::Kernel, u64f(4), u64f(12))
            }
        }
        KIND_API => {
            need(api, kind, r, API_SIZE - 4)?;
            DeviceActivity {
                correlation_id: Some(u64f(28)),
                name_ptr: nonzero(u64f(36)),
                detail: ActivityDetail::Api {
                    cbid: None,
                    pid: u32f(20),
                    tid: u32f(24),
                    ret: None,
                },
                ..base(ActivityKind::Api, u64f(4), u64f(12))
            }
        }
        KIND_HCCL => {
            need(api, kind, r, HCCL_SIZE - 4)?;
            DeviceActivity {
                device: Some(u32f(20)),
                stream: Some(u64::from(u32f(24))),
                name_ptr: nonzero(u64f(36)),
                detail: ActivityDetail::Hccl {
                    bandwidth_gbps: f64_at(r, 28).unwrap_or(0.0),
                    comm_name_ptr: u64f(44),
                },
                ..base(ActivityKind::Hccl, u64f(4), u64f(12))
            }
        }
        KIND_COMMUNICATION => {
            need(api, kind, r, COMMUNICATION_SIZE)?;
            DeviceActivity {
                device: Some(u32f(16)),
                stream: Some(u64::from(u32f(20))),
                correlation_id: Some(u64f(64)),
                name_ptr: nonzero(u64f(48)),
                detail: ActivityDetail::Communication {
                    dtype: DataType::from_hccl(u32f(4)),
                    count: u64f(8),
                    alg_ptr: u64f(40),
                    comm_name_ptr: u64f(56),
                },
                ..base(ActivityKind::Communication, u64f(24), u64f(32))
            }
        }
        KIND_MARKER => {
            need(api, kind, r, MARKER_SIZE - 4)?;
            let ts = u64f(12);
            let source_kind = u32f(8);
            let (a, b) = (u32f(28), u32f(32));
            let on_device = source_kind == SOURCE_DEVICE;
            DeviceActivity {
                device: on_device.then_some(a),
                stream: on_device.then_some(u64::from(b)),
                name_ptr: nonzero(u64f(36)),
                detail: ActivityDetail::Marker {
                    flag: u32f(4),
                    source_kind,
                    id: u64f(20),
                    pid_tid: (!on_device).then_some((a, b)),
                    domain_ptr: u64f(44),
                },
                ..base(ActivityKind::Marker, ts, ts)
            }
        }
        kind => return Err(ActivityError::UnknownKind { api, kind }),
    };
    Ok(DeviceActivity {
        raw_kind: kind,
        ..a
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(r: &mut [u8], off: usize, v: &[u8]) {
        r[off..off + v.len()].copy_from_slice(v);
    }

    #[test]
    fn kernel_and_api() {
        let mut k = vec![0u8; KERNEL_SIZE];
        put(&mut k, 0, &KIND_KERNEL.to_le_bytes());
        put(&mut k, 4, &100u64.to_le_bytes());
        put(&mut k, 12, &200u64.to_le_bytes());
        put(&mut k, 20, &5u32.to_le_bytes());
        put(&mut k, 24, &6u32.to_le_bytes());
        put(&mut k, 28, &(1u64 << 40).to_le_bytes());
        put(&mut k, 36, &0x1111u64.to_le_bytes());
        put(&mut k, 44, &0x2222u64.to_le_bytes());
        let a = parse(&k).unwrap();
        assert_eq!(
            (a.kind, a.raw_kind, a.start, a.end),
            (ActivityKind::Kernel, 2, 100, 200)
        );
        assert_eq!(
            (a.device, a.stream, a.correlation_id, a.name_ptr),
            (Some(5), Some(6), Some(1 << 40), Some(0x2222))
        );
        assert_eq!(a.detail, ActivityDetail::KernelType { type_ptr: 0x1111 });
        assert!(parse(&k[..51]).is_err());

        let mut api = vec![0u8; API_SIZE];
        put(&mut api, 0, &KIND_API.to_le_bytes());
        put(&mut api, 4, &1u64.to_le_bytes());
        put(&mut api, 12, &2u64.to_le_bytes());
        put(&mut api, 20, &77u32.to_le_bytes());
        put(&mut api, 24, &78u32.to_le_bytes());
        put(&mut api, 28, &9u64.to_le_bytes());
        put(&mut api, 36, &0x3333u64.to_le_bytes());
        let a = parse(&api).unwrap();
        assert_eq!(
            (a.kind, a.correlation_id, a.name_ptr),
            (ActivityKind::Api, Some(9), Some(0x3333))
        );
        assert_eq!(
            a.detail,
            ActivityDetail::Api {
                cbid: None,
                pid: 77,
                tid: 78,
                ret: None
            }
        );
    }

    #[test]
    fn hccl_communication_marker() {
        let mut h = vec![0u8; HCCL_SIZE];
        put(&mut h, 0, &KIND_HCCL.to_le_bytes());
        put(&mut h, 4, &10u64.to_le_bytes());
        put(&mut h, 12, &20u64.to_le_bytes());
        put(&mut h, 20, &1u32.to_le_bytes());
        put(&mut h, 24, &2u32.to_le_bytes());
        put(&mut h, 28, &12.5f64.to_le_bytes());
        put(&mut h, 36, &0x10u64.to_le_bytes());
        put(&mut h, 44, &0x20u64.to_le_bytes());
        let a = parse(&h).unwrap();
        assert_eq!(
            (a.kind, a.start, a.end, a.device, a.stream, a.name_ptr),
            (ActivityKind::Hccl, 10, 20, Some(1), Some(2), Some(0x10))
        );
        assert_eq!(
            a.detail,
            ActivityDetail::Hccl {
                bandwidth_gbps: 12.5,
                comm_name_ptr: 0x20
            }
        );

        let mut c = vec![0u8; COMMUNICATION_SIZE];
        put(&mut c, 0, &KIND_COMMUNICATION.to_le_bytes());
        put(&mut c, 4, &11u32.to_le_bytes());
        put(&mut c, 8, &1024u64.to_le_bytes());
        put(&mut c, 16, &3u32.to_le_bytes());
        put(&mut c, 20, &4u32.to_le_bytes());
        put(&mut c, 24, &30u64.to_le_bytes());
        put(&mut c, 32, &40u64.to_le_bytes());
        put(&mut c, 40, &0xa1u64.to_le_bytes());
        put(&mut c, 48, &0xa2u64.to_le_bytes());
        put(&mut c, 56, &0xa3u64.to_le_bytes());
        put(&mut c, 64, &55u64.to_le_bytes());
        let a = parse(&c).unwrap();
        assert_eq!(
            (
                a.start,
                a.end,
                a.device,
                a.stream,
                a.correlation_id,
                a.name_ptr
            ),
            (30, 40, Some(3), Some(4), Some(55), Some(0xa2))
        );
        assert_eq!(
            a.detail,
            ActivityDetail::Communication {
                dtype: DataType::Bf16,
                count: 1024,
                alg_ptr: 0xa1,
                comm_name_ptr: 0xa3
            }
        );
        assert!(parse(&c[..71]).is_err(), "correlationId is the last field");

        let mut m = vec![0u8; MARKER_SIZE];
        put(&mut m, 0, &KIND_MARKER.to_le_bytes());
        put(&mut m, 4, &2u32.to_le_bytes());
        put(&mut m, 8, &0u32.to_le_bytes());
        put(&mut m, 12, &99u64.to_le_bytes());
        put(&mut m, 20, &7u64.to_le_bytes());
        put(&mut m, 28, &1000u32.to_le_bytes());
        put(&mut m, 32, &1001u32.to_le_bytes());
        put(&mut m, 36, &0xb1u64.to_le_bytes());
        put(&mut m, 44, &0xb2u64.to_le_bytes());
        let a = parse(&m).unwrap();
        assert_eq!(
            (a.kind, a.start, a.end, a.device, a.name_ptr),
            (ActivityKind::Marker, 99, 99, None, Some(0xb1))
        );
        assert_eq!(
            a.detail,
            ActivityDetail::Marker {
                flag: 2,
                source_kind: 0,
                id: 7,
                pid_tid: Some((1000, 1001)),
                domain_ptr: 0xb2
            }
        );
        put(&mut m, 8, &1u32.to_le_bytes());
        let a = parse(&m).unwrap();
        assert_eq!((a.device, a.stream), (Some(1000), Some(1001)));
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(parse(&[]).is_err());
        assert!(matches!(
            parse(&5u32.to_le_bytes()),
            Err(ActivityError::UnknownKind { kind: 5, .. })
        ));
        assert!(matches!(
            parse(&KIND_COMMUNICATION.to_le_bytes()),
            Err(ActivityError::Short { need: 72, .. })
        ));
    }
}
